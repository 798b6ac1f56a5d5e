/* y[m, n] = sum_k x[m, k] w[n, k] (+ b[n]) in float32 with AVX2 and FMA: specviz's own kernel paths
   (kernels.py, "avx2" and "avx2-bf16"). The weight is packed once as [ceil(n / 16)][k][16]: a block of
   16 output columns is 16 consecutive weights per k, read once from memory per call and kept in cache
   while up to 6 rows (12 accumulators, 2 weight vectors and a broadcast: 15 of the 16 ymm registers)
   pass over it; the first pass also prefetches the next block (the hardware prefetcher alone left memory
   idle while a pass computed) into L2, not L1: a float32 block of 576 k is 36 KB, so with the next one
   beside it in a 32 KB L1 each evicted the other, and a 6-row forward's products cost clearly more than one
   row's; into L2 about the same. One row prefetches too: a one-row pass is two FMA chains, the slowest to
   compute, and without the hint a bfloat16 output head of one row measured slower than two rows on an AVX2
   CPU.
   Weights are float32 (specviz_gemm) or bfloat16 (specviz_gemm_bf16: half the bytes to stream, each
   widened to float32 in registers, exactly; x, the sums and y stay float32; a block's columns in the order
   load16 widens them).
   Each output is the same k-ordered chain of FMAs whatever the number of rows, so a row's
   result never depends on the rows beside it. Blocks are shared among OpenMP threads (torch's
   runtime: the process loads one libgomp, and torch.set_num_threads sets its thread count). The AVX-512
   kernels are in gemm_avx512.c. */
#include "kernels.h"
#include "gemm_store.h"

/* The 16 weights of a block at k as two float32 vectors (bf16: a literal 0 or 1 where inlined, rows a
   constant). A bfloat16 is the top half of a float32. native.pack stores a bfloat16 block's columns as 0-3,
   8-11, 4-7, 12-15, so that VPUNPCKLWD / VPUNPCKHWD with zeros, which put the low / high four words of each
   128-bit lane into the top halves of float32s, widen them as columns 0-7 and 8-15: one instruction for 8
   weights. Widening in column order instead (zero-extend across the lanes, then shift: 5 instructions for 16)
   made a pass of 2-6 rows wait on those instructions, not on the FMAs: a few-token bfloat16 forward cost
   clearly more one-token steps that way. A one-row pass waits on memory, and there the zero-extension timed a
   little faster (a one-token forward on an AVX2 CPU), so one row keeps it: its sums come out as columns 0-3,
   8-11 | 4-7, 12-15 and are put back in order once, before the store (`in_order`). Either way a weight is the
   same float32, so a row's chain of FMAs is the same at every row count. */
INLINE void load16(const void *wb, int bf16, int rows, int k, __m256 *w0, __m256 *w1)
{
    if (bf16 && rows > 1) {
        __m256i raw = _mm256_loadu_si256((const __m256i *)((const uint16_t *)wb + 16 * (size_t)k));
        *w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), raw));
        *w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), raw));
    } else if (bf16) {
        __m256i raw = _mm256_loadu_si256((const __m256i *)((const uint16_t *)wb + 16 * (size_t)k));
        *w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(raw)), 16));
        *w1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(raw, 1)), 16));
    } else {
        *w0 = _mm256_loadu_ps((const float *)wb + 16 * (size_t)k);
        *w1 = _mm256_loadu_ps((const float *)wb + 16 * (size_t)k + 8);
    }
}

/* A one-row bfloat16 pass's sums (columns 0-3, 8-11 | 4-7, 12-15; load16) as columns 0-7 | 8-15. */
INLINE void in_order(__m256 *lo, __m256 *hi)
{
    __m256 first = _mm256_permute2f128_ps(*lo, *hi, 0x20), second = _mm256_permute2f128_ps(*lo, *hi, 0x31);
    *lo = first, *hi = second;
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
            _mm_prefetch(next + line * k, _MM_HINT_T1);
        load16(wb, bf16, rows, k, &w0, &w1);
        ROW(0, a0, a1) ROW(1, b0, b1) ROW(2, c0, c1) ROW(3, d0, d1) ROW(4, e0, e1) ROW(5, f0, f1)
    }
    if (bf16 && rows == 1)
        in_order(&a0, &a1);
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
        const char *next = p == 0 && j + 1 < blocks ? wb + bytes : 0;
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

