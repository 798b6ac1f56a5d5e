/* y[m, n] = sum_k x[m, k] w[n, k] (+ b[n]) in float32, the weight kept as a GGUF file keeps it: blocks of 32
   k, each a float16 scale d (and, Q4_1, a float16 minimum m) over 4-bit (Q4_1) or 8-bit (Q8_0) integers q
   (kernels.py, the path "blocks"; native.pack_blocks packs them).

   A weight is the float32 the file's dequantization makes of it (transformers' GGUF loader, as gguf-py does):
   Q4_1 (d * q) + m, Q8_0 d * q. d * q is exact in float32 (11 bits times at most 8), so one FMA, d * q + m
   rounded once, is that same float32, and so is the product d * q. So a weight here is bit for bit the weight
   of the float32 model, and each output is the k-ordered chain of FMAs that gemm_avx2.c's kernel computes on
   the float32 weights: the same bits as the paths "avx2" and "avx512", at every row count. What changes is
   the bytes read: 0.625 a weight for Q4_1 (a fifth of float32's 4), 1.0625 for Q8_0.

   Layout, per block of 16 output columns (gemm_avx2.c's width) and per group of 32 k in order:
     Q4_1: uint16 d[16], uint16 m[16] (float16), then 16 pairs of k, 16 bytes each: byte c holds column c's q at
           the pair's first k in its low 4 bits and at its second k in its high 4 bits (320 bytes);
     Q8_0: uint16 d[16], then 32 k of 16 int8 q each (544 bytes).
   A group's 512 weights are made float32 into a tile that stays in L1 and a pass of up to 6 rows runs over it;
   a call of more rows makes a whole block float32 once and runs its passes over that: each weight is made
   once a call, not once a row. Blocks are
   shared among OpenMP threads, as in gemm_avx2.c. F16C widens the scales: every AVX2 CPU has it, and
   native.py asks for it before packing. */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "gemm_store.h"

#define INLINE static inline __attribute__((always_inline, target("avx2,fma,f16c")))
#define GROUP 32                /* k per block of the file */
#define Q4_GROUP_BYTES 320      /* 16 columns x 32 k of Q4_1 */
#define Q8_GROUP_BYTES 544      /* 16 columns x 32 k of Q8_0 */
#define MAX_ROWS 6              /* 12 accumulators, 2 weight vectors and a broadcast: 15 of 16 ymm registers */

INLINE __m256 half8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* A Q4_1 group's 32 x 16 weights as float32, k by k, into tile[32][16]. */
INLINE void q4_tile(const uint8_t *g, float *tile)
{
    const __m256 d0 = half8(g), d1 = half8(g + 16), m0 = half8(g + 32), m1 = half8(g + 48);
    const __m128i low = _mm_set1_epi8(0x0F);
    const uint8_t *q = g + 64;
    for (int p = 0; p < GROUP / 2; p++) {
        __m128i v = _mm_loadu_si128((const __m128i *)(q + 16 * p));
        __m128i first = _mm_and_si128(v, low), second = _mm_and_si128(_mm_srli_epi16(v, 4), low);
        float *t = tile + 32 * p;
        _mm256_storeu_ps(t, _mm256_fmadd_ps(d0, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(first)), m0));
        _mm256_storeu_ps(t + 8, _mm256_fmadd_ps(d1, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                                        _mm_srli_si128(first, 8))), m1));
        _mm256_storeu_ps(t + 16, _mm256_fmadd_ps(d0, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(second)), m0));
        _mm256_storeu_ps(t + 24, _mm256_fmadd_ps(d1, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                                         _mm_srli_si128(second, 8))), m1));
    }
}

/* A Q8_0 group's 32 x 16 weights as float32 into tile[32][16]. */
INLINE void q8_tile(const uint8_t *g, float *tile)
{
    const __m256 d0 = half8(g), d1 = half8(g + 16);
    const uint8_t *q = g + 32;
    for (int k = 0; k < GROUP; k++) {
        __m128i v = _mm_loadu_si128((const __m128i *)(q + 16 * k));
        _mm256_storeu_ps(tile + 16 * k, _mm256_mul_ps(d0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))));
        _mm256_storeu_ps(tile + 16 * k + 8,
                         _mm256_mul_ps(d1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)))));
    }
}

/* The accumulators are named variables, not an array: compilers keep an indexed array in memory. */
#define ROW(r, lo, hi)                                                                             \
    if (rows > r) {                                                                                \
        __m256 xv = _mm256_broadcast_ss(x + (size_t)r * k_len + k0 + k);                           \
        lo = _mm256_fmadd_ps(xv, w0, lo);                                                          \
        hi = _mm256_fmadd_ps(xv, w1, hi);                                                          \
    }
#define STORE(r, lo, hi) if (rows > r) store_row(lo, hi, b, y + (size_t)r * n, n, n0);

/* One pass of `rows` rows (1-6, a constant where it is inlined) over one block of 16 columns. */
INLINE void pass(const float *x, const uint8_t *wb, int q8, const float *b, float *y, int rows, int k_len, int n,
                 int n0)
{
    float tile[GROUP * 16] __attribute__((aligned(32)));
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0, d0 = a0, d1 = a0,
           e0 = a0, e1 = a0, f0 = a0, f1 = a0, w0, w1;
    const size_t group_bytes = q8 ? Q8_GROUP_BYTES : Q4_GROUP_BYTES;
    for (int k0 = 0; k0 < k_len; k0 += GROUP) {
        const uint8_t *g = wb + (size_t)(k0 / GROUP) * group_bytes;
        if (q8)
            q8_tile(g, tile);
        else
            q4_tile(g, tile);
        for (int k = 0; k < GROUP; k++) {
            w0 = _mm256_load_ps(tile + 16 * k);
            w1 = _mm256_load_ps(tile + 16 * k + 8);
            ROW(0, a0, a1) ROW(1, b0, b1) ROW(2, c0, c1) ROW(3, d0, d1) ROW(4, e0, e1) ROW(5, f0, f1)
        }
    }
    STORE(0, a0, a1) STORE(1, b0, b1) STORE(2, c0, c1) STORE(3, d0, d1) STORE(4, e0, e1) STORE(5, f0, f1)
}

/* One pass of `rows` rows over a block already made float32, [k_len][16] (more rows than one pass takes). */
INLINE void pass_floats(const float *x, const float *wf, const float *b, float *y, int rows, int k_len, int n, int n0)
{
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0, d0 = a0, d1 = a0,
           e0 = a0, e1 = a0, f0 = a0, f1 = a0, w0, w1;
    const int k0 = 0;
    for (int k = 0; k < k_len; k++) {
        w0 = _mm256_load_ps(wf + 16 * (size_t)k);
        w1 = _mm256_load_ps(wf + 16 * (size_t)k + 8);
        ROW(0, a0, a1) ROW(1, b0, b1) ROW(2, c0, c1) ROW(3, d0, d1) ROW(4, e0, e1) ROW(5, f0, f1)
    }
    STORE(0, a0, a1) STORE(1, b0, b1) STORE(2, c0, c1) STORE(3, d0, d1) STORE(4, e0, e1) STORE(5, f0, f1)
}

#define BY_ROWS(call)                                                                              \
    switch (rows) { /* a constant row count per case: accumulators in registers */                 \
    case 1: call(1); break;                                                                        \
    case 2: call(2); break;                                                                        \
    case 3: call(3); break;                                                                        \
    case 4: call(4); break;                                                                        \
    case 5: call(5); break;                                                                        \
    default: call(6); break;                                                                       \
    }

/* Every row times block j, in passes of at most 6 rows, as even as can be (as gemm_avx2.c's `block`). One pass
   makes a group's weights as it goes; more make the whole block float32 first, once, into `floats` (k_len x 16,
   in L1 or L2), and read it there: a wide verify makes each weight once. */
INLINE void block(const float *x, const uint8_t *w, int q8, const float *b, float *y, int m, int n, int k_len, int j,
                  float *floats)
{
    const size_t group_bytes = q8 ? Q8_GROUP_BYTES : Q4_GROUP_BYTES;
    const uint8_t *wb = w + (size_t)j * (k_len / GROUP) * group_bytes;
    int passes = (m + MAX_ROWS - 1) / MAX_ROWS;
    if (passes > 1 && floats) /* (no memory for it: each pass makes the weights again) */
        for (int g = 0; g < k_len / GROUP; g++) {
            if (q8)
                q8_tile(wb + g * group_bytes, floats + (size_t)g * GROUP * 16);
            else
                q4_tile(wb + g * group_bytes, floats + (size_t)g * GROUP * 16);
        }
    for (int p = 0, m0 = 0; p < passes; p++) {
        int rows = m / passes + (p < m % passes);
        const float *xs = x + (size_t)m0 * k_len;
        float *ys = y + (size_t)m0 * n;
#define MADE(r) pass(xs, wb, q8, b, ys, r, k_len, n, j * 16)
#define READ(r) pass_floats(xs, floats, b, ys, r, k_len, n, j * 16)
        if (passes == 1 || !floats) {
            BY_ROWS(MADE)
        } else {
            BY_ROWS(READ)
        }
#undef MADE
#undef READ
        m0 += rows;
    }
}

/* The blocks shared among threads; each thread's float32 block where a call has more rows than a pass. */
INLINE void product(const float *x, const void *w, int q8, const float *b, float *y, int m, int n, int k_len)
{
#pragma omp parallel
    {
        float *floats = m > MAX_ROWS ? aligned_alloc(32, (size_t)k_len * 16 * sizeof(float)) : NULL;
#pragma omp for schedule(static)
        for (int j = 0; j < (n + 15) / 16; j++)
            block(x, (const uint8_t *)w, q8, b, y, m, n, k_len, j, floats);
        free(floats);
    }
}

/* k_len a multiple of 32 (native.pack_blocks refuses other weights). */
__attribute__((target("avx2,fma,f16c"))) void specviz_gemm_q4(const float *x, const void *w, const float *b,
                                                             float *y, int m, int n, int k_len)
{
    product(x, w, 0, b, y, m, n, k_len);
}

__attribute__((target("avx2,fma,f16c"))) void specviz_gemm_q8(const float *x, const void *w, const float *b,
                                                             float *y, int m, int n, int k_len)
{
    product(x, w, 1, b, y, m, n, k_len);
}

/* The same in AVX-512 registers ("q4-512", "q8-512"): a group's 16 columns at one k are one register, made from
   its 16 integers in three instructions (widen, convert, FMA) where AVX2 takes seven, and a pass takes up to 12
   rows. The same weights and chains, so the same bits. Compiled for AVX-512 function by function; native.py
   calls these only where ATen itself runs its AVX-512 kernels. */
#define INLINE512 static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512vl,f16c,fma")))
#define KERNEL512 __attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma")))
#define MAX_ROWS512 12

INLINE512 __m512 half16(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }

INLINE512 void q4_tile512(const uint8_t *g, float *tile)
{
    const __m512 d = half16(g), m = half16(g + 32);
    const __m128i low = _mm_set1_epi8(0x0F);
    const uint8_t *q = g + 64;
    for (int p = 0; p < GROUP / 2; p++) {
        __m128i v = _mm_loadu_si128((const __m128i *)(q + 16 * p));
        __m128i first = _mm_and_si128(v, low), second = _mm_and_si128(_mm_srli_epi16(v, 4), low);
        _mm512_store_ps(tile + 32 * p, _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(first)), m));
        _mm512_store_ps(tile + 32 * p + 16, _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(second)), m));
    }
}

INLINE512 void q8_tile512(const uint8_t *g, float *tile)
{
    const __m512 d = half16(g);
    const uint8_t *q = g + 32;
    for (int k = 0; k < GROUP; k++)
        _mm512_store_ps(tile + 16 * k, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                              _mm_loadu_si128((const __m128i *)(q + 16 * k))))));
}

#define ROW512(r, acc) if (rows > r) acc = _mm512_fmadd_ps(_mm512_set1_ps(x[(size_t)r * k_len + k0 + k]), w, acc);
#define ROWS512 ROW512(0, a0) ROW512(1, a1) ROW512(2, a2) ROW512(3, a3) ROW512(4, a4) ROW512(5, a5)           \
                ROW512(6, a6) ROW512(7, a7) ROW512(8, a8) ROW512(9, a9) ROW512(10, a10) ROW512(11, a11)
#define STORE512(r, acc) if (rows > r) store16_512(acc, b, y + (size_t)r * n, n, n0);

/* One pass of `rows` rows (1-12) over one block: made group by group into a tile (wf NULL), or read from the
   block made float32 beforehand (wf, [k_len][16]). */
INLINE512 void pass512(const float *x, const uint8_t *wb, const float *wf, int q8, const float *b, float *y, int rows,
                       int k_len, int n, int n0)
{
    float tile[GROUP * 16] __attribute__((aligned(64)));
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0,
           a9 = a0, a10 = a0, a11 = a0;
    const size_t group_bytes = q8 ? Q8_GROUP_BYTES : Q4_GROUP_BYTES;
    for (int k0 = 0; k0 < k_len; k0 += GROUP) {
        const float *t = wf ? wf + (size_t)k0 * 16 : tile;
        if (!wf) {
            if (q8)
                q8_tile512(wb + (size_t)(k0 / GROUP) * group_bytes, tile);
            else
                q4_tile512(wb + (size_t)(k0 / GROUP) * group_bytes, tile);
        }
        for (int k = 0; k < GROUP; k++) {
            __m512 w = _mm512_load_ps(t + 16 * k);
            ROWS512
        }
    }
    STORE512(0, a0) STORE512(1, a1) STORE512(2, a2) STORE512(3, a3) STORE512(4, a4) STORE512(5, a5)
    STORE512(6, a6) STORE512(7, a7) STORE512(8, a8) STORE512(9, a9) STORE512(10, a10) STORE512(11, a11)
}

#define PASS512(r) case r: pass512(xs, wb, wf, q8, b, ys, r, k_len, n, j * 16); break;

INLINE512 void block512(const float *x, const uint8_t *w, int q8, const float *b, float *y, int m, int n, int k_len,
                        int j, float *floats)
{
    const size_t group_bytes = q8 ? Q8_GROUP_BYTES : Q4_GROUP_BYTES;
    const uint8_t *wb = w + (size_t)j * (k_len / GROUP) * group_bytes;
    int passes = (m + MAX_ROWS512 - 1) / MAX_ROWS512;
    const float *wf = passes > 1 ? floats : NULL;
    if (wf)
        for (int g = 0; g < k_len / GROUP; g++) {
            if (q8)
                q8_tile512(wb + g * group_bytes, floats + (size_t)g * GROUP * 16);
            else
                q4_tile512(wb + g * group_bytes, floats + (size_t)g * GROUP * 16);
        }
    for (int p = 0, m0 = 0; p < passes; p++) {
        int rows = m / passes + (p < m % passes);
        const float *xs = x + (size_t)m0 * k_len;
        float *ys = y + (size_t)m0 * n;
        switch (rows) {
        PASS512(1) PASS512(2) PASS512(3) PASS512(4) PASS512(5) PASS512(6)
        PASS512(7) PASS512(8) PASS512(9) PASS512(10) PASS512(11)
        default: pass512(xs, wb, wf, q8, b, ys, 12, k_len, n, j * 16); break;
        }
        m0 += rows;
    }
}

INLINE512 void product512(const float *x, const void *w, int q8, const float *b, float *y, int m, int n, int k_len)
{
#pragma omp parallel
    {
        float *floats = m > MAX_ROWS512 ? aligned_alloc(64, (size_t)k_len * 16 * sizeof(float)) : NULL;
#pragma omp for schedule(static)
        for (int j = 0; j < (n + 15) / 16; j++)
            block512(x, (const uint8_t *)w, q8, b, y, m, n, k_len, j, floats);
        free(floats);
    }
}

KERNEL512 void specviz_gemm512_q4(const float *x, const void *w, const float *b, float *y, int m, int n, int k_len)
{
    product512(x, w, 0, b, y, m, n, k_len);
}

KERNEL512 void specviz_gemm512_q8(const float *x, const void *w, const float *b, float *y, int m, int n, int k_len)
{
    product512(x, w, 1, b, y, m, n, k_len);
}
