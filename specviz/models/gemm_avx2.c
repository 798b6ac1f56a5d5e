/* y[m, n] = sum_k x[m, k] w[n, k] (+ b[n]) in float32 with AVX2 and FMA: specviz's own kernel paths
   (kernels.py, "avx2" and "avx2-bf16"). The weight is packed once as [ceil(n / 16)][k][16]: a block of
   16 output columns is 16 consecutive weights per k, read once from memory per call and kept in cache
   while up to 6 rows (12 accumulators, 2 weight vectors and a broadcast: 15 of the 16 ymm registers)
   pass over it; with more than one row the first pass also prefetches the next block (the hardware
   prefetcher alone left memory idle while a pass computed, on the AVX2 CPU this was timed on).
   Weights are float32 (specviz_gemm) or bfloat16 (specviz_gemm_bf16: half the bytes to stream, each
   widened to float32 in registers, exactly; x, the sums and y stay float32).
   Each output is the same k-ordered chain of FMAs whatever the number of rows, so a row's
   result never depends on the rows beside it. Blocks are shared among OpenMP threads (torch's
   runtime: the process loads one libgomp, and torch.set_num_threads sets its thread count).
   Below it, the same kernel in AVX-512 registers ("avx512", "avx512-bf16") and a bfloat16 one for
   AVX512-BF16 ("avx512-dot"), each compiled for its instructions function by function. */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#define INLINE static inline __attribute__((always_inline))

INLINE void store_row(const __m256 lo, const __m256 hi, const float *b, float *y, int n, int n0)
{
    float out[16];
    _mm256_storeu_ps(out, lo);
    _mm256_storeu_ps(out + 8, hi);
    int cols = n - n0 < 16 ? n - n0 : 16;
    for (int c = 0; c < cols; c++)
        y[n0 + c] = b ? out[c] + b[n0 + c] : out[c];
}

/* The 16 weights of a block at k as two float32 vectors (bf16: a literal 0 or 1 where inlined). A
   bfloat16 is the top half of a float32: zero-extend each to 32 bits and shift it up. */
INLINE void load16(const void *wb, int bf16, int k, __m256 *w0, __m256 *w1)
{
    if (bf16) {
        __m256i raw = _mm256_loadu_si256((const __m256i *)((const uint16_t *)wb + 16 * (size_t)k));
        *w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(raw)), 16));
        *w1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(raw, 1)), 16));
    } else {
        *w0 = _mm256_loadu_ps((const float *)wb + 16 * (size_t)k);
        *w1 = _mm256_loadu_ps((const float *)wb + 16 * (size_t)k + 8);
    }
}

/* One pass of `rows` (1-6, a constant where it is inlined) rows over one block. The accumulators are
   named variables, not an array: compilers keep an indexed array in memory and store it every k. */
#define ROW(r, lo, hi)                                                                             \
    if (rows > r) {                                                                                \
        __m256 xv = _mm256_broadcast_ss(x + (size_t)r * k_len + k);                                \
        lo = _mm256_fmadd_ps(xv, w0, lo);                                                          \
        hi = _mm256_fmadd_ps(xv, w1, hi);                                                          \
    }
#define STORE(r, lo, hi) if (rows > r) store_row(lo, hi, b, y + (size_t)r * n, n, n0);

INLINE void rows_by_block(const float *x, const void *wb, const char *next, int bf16, const float *b, float *y,
                          int rows, int k_len, int n, int n0)
{
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0, d0 = a0, d1 = a0,
           e0 = a0, e1 = a0, f0 = a0, f1 = a0, w0, w1;
    size_t line = bf16 ? 32 : 64; /* bytes of one k's 16 weights */
    for (int k = 0; k < k_len; k++) {
        if (next) /* the next block, as much per k as this one reads, while this one computes */
            _mm_prefetch(next + line * k, _MM_HINT_T0);
        load16(wb, bf16, k, &w0, &w1);
        ROW(0, a0, a1) ROW(1, b0, b1) ROW(2, c0, c1) ROW(3, d0, d1) ROW(4, e0, e1) ROW(5, f0, f1)
    }
    STORE(0, a0, a1) STORE(1, b0, b1) STORE(2, c0, c1) STORE(3, d0, d1) STORE(4, e0, e1) STORE(5, f0, f1)
}

/* Every row times block j: rows in passes of at most 6, as even as can be (8 rows: 4 + 4, not 6 + 2),
   since a pass of r rows keeps 2r FMA chains going and fewer than about 8 leave the FMA units waiting. */
INLINE void block(const float *x, const void *w, int bf16, const float *b, float *y, int m, int n, int k_len, int j)
{
    size_t bytes = (size_t)k_len * 16 * (bf16 ? 2 : 4); /* one packed block */
    const char *wb = (const char *)w + j * bytes;
    int passes = (m + 5) / 6, blocks = (n + 15) / 16;
    for (int p = 0, m0 = 0; p < passes; p++) {
        int rows = m / passes + (p < m % passes);
        const float *xs = x + (size_t)m0 * k_len;
        const char *next = m > 1 && p == 0 && j + 1 < blocks ? wb + bytes : 0;
        float *ys = y + (size_t)m0 * n;
        switch (rows) { /* a constant row count per case: accumulators in registers */
        case 1: rows_by_block(xs, wb, next, bf16, b, ys, 1, k_len, n, j * 16); break;
        case 2: rows_by_block(xs, wb, next, bf16, b, ys, 2, k_len, n, j * 16); break;
        case 3: rows_by_block(xs, wb, next, bf16, b, ys, 3, k_len, n, j * 16); break;
        case 4: rows_by_block(xs, wb, next, bf16, b, ys, 4, k_len, n, j * 16); break;
        case 5: rows_by_block(xs, wb, next, bf16, b, ys, 5, k_len, n, j * 16); break;
        default: rows_by_block(xs, wb, next, bf16, b, ys, 6, k_len, n, j * 16); break;
        }
        m0 += rows;
    }
}

void specviz_gemm(const float *x, const float *w, const float *b, float *y, int m, int n, int k_len)
{
#pragma omp parallel for schedule(static)
    for (int j = 0; j < (n + 15) / 16; j++)
        block(x, w, 0, b, y, m, n, k_len, j);
}

void specviz_gemm_bf16(const float *x, const uint16_t *w, const float *b, float *y, int m, int n, int k_len)
{
#pragma omp parallel for schedule(static)
    for (int j = 0; j < (n + 15) / 16; j++)
        block(x, w, 1, b, y, m, n, k_len, j);
}

/* The same kernel with AVX-512 (AVX512F): a block of 16 columns is one 512-bit register, so a pass keeps one
   accumulator per row and takes up to 12 rows (12 accumulators, the weights and a broadcast: 14 of the 32
   registers), twice the FMA width of the AVX2 kernel. Each output is the same k-ordered chain of FMAs as
   there, so both kernels give the same bits. Compiled for AVX-512 function by function (the file is built
   with -mavx2): native.py calls these only where ATen itself runs its AVX-512 kernels. */
#define INLINE512 static inline __attribute__((always_inline, target("avx512f")))
#define KERNEL512 __attribute__((target("avx512f")))

INLINE512 void store16(const __m512 acc, const float *b, float *y, int n, int n0)
{
    float out[16];
    _mm512_storeu_ps(out, acc);
    int cols = n - n0 < 16 ? n - n0 : 16;
    for (int c = 0; c < cols; c++)
        y[n0 + c] = b ? out[c] + b[n0 + c] : out[c];
}

INLINE512 __m512 load16_512(const void *wb, int bf16, int k)
{
    if (bf16) {
        __m256i raw = _mm256_loadu_si256((const __m256i *)((const uint16_t *)wb + 16 * (size_t)k));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
    return _mm512_loadu_ps((const float *)wb + 16 * (size_t)k);
}

#define ROW512(r, acc) if (rows > r) acc = _mm512_fmadd_ps(_mm512_set1_ps(x[(size_t)r * k_len + k]), w, acc);
#define STORE512(r, acc) if (rows > r) store16(acc, b, y + (size_t)r * n, n, n0);

INLINE512 void rows_by_block512(const float *x, const void *wb, const char *next, int bf16, const float *b, float *y,
                                int rows, int k_len, int n, int n0)
{
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0,
           a9 = a0, a10 = a0, a11 = a0;
    size_t line = bf16 ? 32 : 64;
    for (int k = 0; k < k_len; k++) {
        if (next)
            _mm_prefetch(next + line * k, _MM_HINT_T0);
        __m512 w = load16_512(wb, bf16, k);
        ROW512(0, a0) ROW512(1, a1) ROW512(2, a2) ROW512(3, a3) ROW512(4, a4) ROW512(5, a5)
        ROW512(6, a6) ROW512(7, a7) ROW512(8, a8) ROW512(9, a9) ROW512(10, a10) ROW512(11, a11)
    }
    STORE512(0, a0) STORE512(1, a1) STORE512(2, a2) STORE512(3, a3) STORE512(4, a4) STORE512(5, a5)
    STORE512(6, a6) STORE512(7, a7) STORE512(8, a8) STORE512(9, a9) STORE512(10, a10) STORE512(11, a11)
}

#define PASS512(r) case r: rows_by_block512(xs, wb, next, bf16, b, ys, r, k_len, n, j * 16); break;

INLINE512 void block512(const float *x, const void *w, int bf16, const float *b, float *y, int m, int n, int k_len,
                        int j)
{
    size_t bytes = (size_t)k_len * 16 * (bf16 ? 2 : 4);
    const char *wb = (const char *)w + j * bytes;
    int passes = (m + 11) / 12, blocks = (n + 15) / 16;
    for (int p = 0, m0 = 0; p < passes; p++) {
        int rows = m / passes + (p < m % passes);
        const float *xs = x + (size_t)m0 * k_len;
        const char *next = m > 1 && p == 0 && j + 1 < blocks ? wb + bytes : 0;
        float *ys = y + (size_t)m0 * n;
        switch (rows) {
        PASS512(1) PASS512(2) PASS512(3) PASS512(4) PASS512(5) PASS512(6)
        PASS512(7) PASS512(8) PASS512(9) PASS512(10) PASS512(11)
        default: rows_by_block512(xs, wb, next, bf16, b, ys, 12, k_len, n, j * 16); break;
        }
        m0 += rows;
    }
}

KERNEL512 void specviz_gemm512(const float *x, const float *w, const float *b, float *y, int m, int n, int k_len)
{
#pragma omp parallel for schedule(static)
    for (int j = 0; j < (n + 15) / 16; j++)
        block512(x, w, 0, b, y, m, n, k_len, j);
}

KERNEL512 void specviz_gemm512_bf16(const float *x, const uint16_t *w, const float *b, float *y, int m, int n,
                                    int k_len)
{
#pragma omp parallel for schedule(static)
    for (int j = 0; j < (n + 15) / 16; j++)
        block512(x, w, 1, b, y, m, n, k_len, j);
}

/* A bfloat16 model on a CPU with AVX512-BF16: inputs stay bfloat16 and one VDPBF16PS multiplies a pair of k
   per column and adds both products to the float32 sum, twice the products per instruction of the FMA
   kernels. The weights are packed as [ceil(n / 64)][k / 2][64][2]: per group of 64 columns and pair of k,
   the columns' two weights side by side, as the instruction reads them (16 columns a register), so a pass
   streams one group as one run of memory. A row's two inputs at a pair are broadcast as one 32-bit value.
   The sums are float32; y gets them (+ bias) rounded to bfloat16.
   A pass takes a group and up to 6 rows: 4 sums a row, independent, so the instruction's latency is hidden
   even for one row (with one 16-column block a pass, one row left each sum waiting on the last), 24 sums,
   4 weight vectors and a broadcast: 29 of the 32 registers. Each output is the same chain of pair steps
   whatever the rows beside it. */
#define GROUP 64 /* columns per packed group: native.PAIR_GROUP */
#define TARGET_BF16 target("avx512f,avx512bw,avx512vl,avx512bf16")

/* 16 sums (+ bias) rounded to bfloat16 (to nearest even, as torch rounds) into y[n0..], the columns below n. */
static inline __attribute__((always_inline, TARGET_BF16)) void store16_bf16(__m512 acc, const float *bias,
                                                                           uint16_t *y, int n, int n0)
{
    __mmask16 keep = (__mmask16)((1u << (n - n0 < 16 ? n - n0 : 16)) - 1);
    if (bias)
        acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(keep, bias + n0));
    _mm256_mask_storeu_epi16(y + n0, keep, (__m256i)_mm512_cvtneps_pbh(acc));
}
#define PAIR(r, c, acc) acc = _mm512_dpbf16_ps(acc, x##r, w##c);
#define PAIRS_OF_ROW(r, a, b, c, d)                                                    \
    if (rows > r) {                                                                    \
        __m512bh x##r = (__m512bh)_mm512_set1_epi32(xp[(size_t)r * pairs + p]);       \
        PAIR(r, 0, a) PAIR(r, 1, b) PAIR(r, 2, c) PAIR(r, 3, d)                        \
    }
#define STORE_ROW(r, a, b, c, d)                                                       \
    if (rows > r) {                                                                    \
        uint16_t *yr = y + (size_t)r * n;                                              \
        store16_bf16(a, bias, yr, n, n0);                                              \
        if (n0 + 16 < n) store16_bf16(b, bias, yr, n, n0 + 16);                        \
        if (n0 + 32 < n) store16_bf16(c, bias, yr, n, n0 + 32);                        \
        if (n0 + 48 < n) store16_bf16(d, bias, yr, n, n0 + 48);                        \
    }

/* `rows` (1-6; a constant where inlined) rows times the group of 64 columns from n0 on, packed at wg. */
static inline __attribute__((always_inline, TARGET_BF16)) void
rows_by_group(const int32_t *xp, const uint16_t *wg, const float *bias, uint16_t *y, int rows, int pairs, int n, int n0)
{
    __m512 z = _mm512_setzero_ps(), a0 = z, a1 = z, a2 = z, a3 = z, b0 = z, b1 = z, b2 = z, b3 = z, c0 = z, c1 = z,
           c2 = z, c3 = z, d0 = z, d1 = z, d2 = z, d3 = z, e0 = z, e1 = z, e2 = z, e3 = z, f0 = z, f1 = z, f2 = z,
           f3 = z;
    for (int p = 0; p < pairs; p++) {
        const uint16_t *at = wg + 2 * GROUP * (size_t)p;
        __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)at),
                 w1 = (__m512bh)_mm512_loadu_si512((const void *)(at + 32)),
                 w2 = (__m512bh)_mm512_loadu_si512((const void *)(at + 64)),
                 w3 = (__m512bh)_mm512_loadu_si512((const void *)(at + 96));
        PAIRS_OF_ROW(0, a0, a1, a2, a3) PAIRS_OF_ROW(1, b0, b1, b2, b3) PAIRS_OF_ROW(2, c0, c1, c2, c3)
        PAIRS_OF_ROW(3, d0, d1, d2, d3) PAIRS_OF_ROW(4, e0, e1, e2, e3) PAIRS_OF_ROW(5, f0, f1, f2, f3)
    }
    STORE_ROW(0, a0, a1, a2, a3) STORE_ROW(1, b0, b1, b2, b3) STORE_ROW(2, c0, c1, c2, c3)
    STORE_ROW(3, d0, d1, d2, d3) STORE_ROW(4, e0, e1, e2, e3) STORE_ROW(5, f0, f1, f2, f3)
}

/* One function per row count, so each gets the 32 registers to itself (inlined into one switch, the
   compiler kept the sums of the larger passes in memory). */
#define PASS_FN(r)                                                                                             \
    static __attribute__((noinline, TARGET_BF16)) void pass_##r(                                               \
        const int32_t *xs, const uint16_t *wg, const float *bias, uint16_t *ys, int pairs, int n, int n0)      \
    {                                                                                                          \
        rows_by_group(xs, wg, bias, ys, r, pairs, n, n0);                                                      \
    }
PASS_FN(1) PASS_FN(2) PASS_FN(3) PASS_FN(4) PASS_FN(5) PASS_FN(6)

__attribute__((TARGET_BF16)) void specviz_gemm_dot_bf16(const int32_t *x, const uint16_t *w, const float *bias,
                                                        uint16_t *y, int m, int n, int pairs)
{
    void (*pass[])(const int32_t *, const uint16_t *, const float *, uint16_t *, int, int, int) = {
        pass_1, pass_2, pass_3, pass_4, pass_5, pass_6};
#pragma omp parallel for schedule(static)
    for (int g = 0; g < (n + GROUP - 1) / GROUP; g++) {
        const uint16_t *wg = w + (size_t)g * pairs * 2 * GROUP;
        int passes = (m + 5) / 6; /* rows in passes of at most 6, as even as can be (8: 4 + 4) */
        for (int p = 0, m0 = 0; p < passes; p++) {
            int rows = m / passes + (p < m % passes);
            pass[rows - 1](x + (size_t)m0 * pairs, wg, bias, y + (size_t)m0 * n, pairs, n, g * GROUP);
            m0 += rows;
        }
    }
}

/* RMSNorm of bfloat16 rows as transformers' LlamaRMSNorm computes it (leanllama.rms_norm): a row widened
   to float32, times 1 / sqrt(mean of its squares + eps), rounded to bfloat16, times the weight, rounded
   again, each rounding to nearest even as torch rounds. Only the order of the sum of squares differs
   from ATen's. A row after another, on the calling thread: a row is a few hundred numbers, less work
   than starting threads costs, and eight ATen operations a row cost more than this call. */
#include <string.h>

static inline float from_bf16(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN stays NaN */
        return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

void specviz_rms_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int rows, int n, float eps)
{
    for (int r = 0; r < rows; r++) {
        const uint16_t *xr = x + (size_t)r * n;
        uint16_t *yr = y + (size_t)r * n;
        float sum = 0.0f;
        for (int i = 0; i < n; i++)
            sum += from_bf16(xr[i]) * from_bf16(xr[i]);
        float scale = 1.0f / _mm_cvtss_f32(_mm_sqrt_ss(_mm_set_ss(sum / (float)n + eps))); /* IEEE, as rsqrt */
        for (int i = 0; i < n; i++)
            yr[i] = to_bf16(from_bf16(w[i]) * from_bf16(to_bf16(from_bf16(xr[i]) * scale)));
    }
}
