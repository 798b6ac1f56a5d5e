/* Storing a block's 16 sums, for gemm_avx2.c and gemm_blocks.c (each includes it once, as its own static copy). */
#ifndef SPECVIZ_GEMM_STORE_H
#define SPECVIZ_GEMM_STORE_H
#include <immintrin.h>

/* 16 sums (+ b) into y[n0..], the columns below n, in vectors (masked in a last block that n cuts): a scalar
   loop here was vectorized by gcc -O3 at each of its hundreds of inlined sites, most of the file's compile time. */
static inline __attribute__((always_inline)) void store_row(__m256 lo, __m256 hi, const float *b, float *y, int n,
                                                            int n0)
{
    int cols = n - n0 < 16 ? n - n0 : 16;
    if (cols == 16) {
        if (b) {
            lo = _mm256_add_ps(lo, _mm256_loadu_ps(b + n0));
            hi = _mm256_add_ps(hi, _mm256_loadu_ps(b + n0 + 8));
        }
        _mm256_storeu_ps(y + n0, lo);
        _mm256_storeu_ps(y + n0 + 8, hi);
        return;
    }
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i keep_lo = _mm256_cmpgt_epi32(_mm256_set1_epi32(cols), lane);
    __m256i keep_hi = _mm256_cmpgt_epi32(_mm256_set1_epi32(cols - 8), lane);
    if (b) {
        lo = _mm256_add_ps(lo, _mm256_maskload_ps(b + n0, keep_lo));
        hi = _mm256_add_ps(hi, _mm256_maskload_ps(b + n0 + 8, keep_hi));
    }
    _mm256_maskstore_ps(y + n0, keep_lo, lo);
    _mm256_maskstore_ps(y + n0 + 8, keep_hi, hi);
}

/* The same from one AVX-512 register. */
static inline __attribute__((always_inline, target("avx512f"))) void store16_512(__m512 acc, const float *b, float *y,
                                                                               int n, int n0)
{
    __mmask16 keep = (__mmask16)((1u << (n - n0 < 16 ? n - n0 : 16)) - 1);
    if (b)
        acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(keep, b + n0));
    _mm512_mask_storeu_ps(y + n0, keep, acc);
}

#endif
