/* A drafter's product in 8-bit integers on AVX2 (path "avx2-int8", kernels.py; lossy: the EAGLE head's products
   only, never the target's): a byte a weight to stream instead of bfloat16's two, and a fraction of the float
   kernels' instructions a weight, so a one-row step waits on memory, not on arithmetic.

   The weight is pack_quads' (native.py), as the AVX-512 VNNI kernel reads it (gemm_avx512.c): int8 per output
   column c (w ~ s_c q, s_c = max |w_c| / 127), [ceil(n / 64)][k / 4][64][4] after a header of each column's s_c
   (float32) and its sum of q (int32, unused here). Each float32 input row is quantized alone (x ~ t_r u,
   t_r = max |x_r| / 127, u rounded to nearest even within [-127, 127]), so a row's result never depends on the
   rows beside it. Without VNNI, VPMADDUBSW multiplies unsigned bytes by signed ones into pairs of int16: it
   takes |u| and q with u's sign (VPSIGNB), whose pair sums stay within 2 * 127 * 127 < 2^15 (no saturation),
   and VPMADDWD with ones sums the pairs into int32: the exact sum of u q, the VNNI kernel's. An output is then
   t_r s_c sum + bias, one multiply and one fused multiply-add as the VNNI kernel writes it (before its rounding
   to bfloat16). A row takes a group's 64 columns at once (8 accumulators), reading its quads in order; the rows
   of a call go one after another over each group, which stays in L2 after the first (a pass of several rows over
   fewer columns would broadcast each row's bytes once per column block: no fewer instructions). */
#include <stdlib.h>

#include "kernels.h"

#define TARGET_INT8 target("avx2,fma")
#define INT8_GROUP 64 /* columns per packed group */

/* A float32 row x[k] as int8 u[padded] (zeros past k; a NaN: 0) and |u|; returns t = max |x| / 127. */
static inline __attribute__((always_inline, TARGET_INT8)) float quantize_row8(const float *x, int k, int padded,
                                                                             int8_t *u, int8_t *magnitude)
{
    float top = 0.0f;
    for (int i = 0; i < k; i++) {
        const float a = __builtin_fabsf(x[i]);
        top = a > top ? a : top; /* a NaN is passed over */
    }
    const float up = top > 0.0f ? 127.0f / top : 0.0f;
    for (int i = 0; i < padded; i++) {
        float v = i < k ? x[i] * up : 0.0f;
        v = v == v ? __builtin_nearbyintf(v) : 0.0f; /* to nearest even, as the VNNI kernel rounds */
        v = v < -127.0f ? -127.0f : v > 127.0f ? 127.0f : v;
        u[i] = (int8_t)v;
        magnitude[i] = (int8_t)__builtin_fabsf(v);
    }
    return top / 127.0f;
}

/* 8 integer sums of a row as outputs y[n0..n0 + 7] (those below n): t_r s_c sum (+ bias). */
static inline __attribute__((always_inline, TARGET_INT8)) void store8_int8(__m256i acc, float row_scale,
                                                                          const float *head, const float *bias,
                                                                          float *y, int n, int n0)
{
    if (n0 >= n)
        return;
    float sums[8], out[8];
    const __m256 b = bias && n0 + 8 <= n ? _mm256_loadu_ps(bias + n0) : _mm256_setzero_ps();
    const __m256 v = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(row_scale)),
                                     _mm256_loadu_ps(head + n0), b);
    if (n0 + 8 <= n) {
        _mm256_storeu_ps(y + n0, v);
        return;
    }
    _mm256_storeu_ps(out, v); /* the last columns of a width that is no multiple of 8 */
    _mm256_storeu_ps(sums, _mm256_mul_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(row_scale)));
    for (int c = 0; n0 + c < n; c++)
        y[n0 + c] = bias ? __builtin_fmaf(sums[c], head[n0 + c], bias[n0 + c]) : out[c];
}

/* Ask for the group's weights AHEAD quads on (all four lines of one), into L1 for the row that reads them next:
   without it the one-row output head measured slower than bfloat16 weights read from memory. */
#define AHEAD 8
static inline __attribute__((always_inline)) void prefetch_quad(const int8_t *wg, int q, int quads)
{
    if (q + AHEAD < quads) {
        const char *at = (const char *)(wg + (size_t)4 * INT8_GROUP * (q + AHEAD));
        _mm_prefetch(at, _MM_HINT_T0);
        _mm_prefetch(at + 64, _MM_HINT_T0);
        _mm_prefetch(at + 128, _MM_HINT_T0);
        _mm_prefetch(at + 192, _MM_HINT_T0);
    }
}

/* One quantized row times the whole group of 64 columns packed at wg (8 accumulators): the quads' bytes read in
   order. */
static __attribute__((noinline, TARGET_INT8)) void int8_row(const int32_t *xq, const int32_t *xa_, float row_scale,
                                                           const int8_t *wg, const float *head, const float *bias,
                                                           float *y, int quads, int n, int n0)
{
    const __m256i ones = _mm256_set1_epi16(1), z = _mm256_setzero_si256();
    __m256i acc[8] = {z, z, z, z, z, z, z, z};
    for (int q = 0; q < quads; q++) {
        const int8_t *at = wg + (size_t)4 * INT8_GROUP * q;
        prefetch_quad(wg, q, quads);
        const __m256i xs = _mm256_set1_epi32(xq[q]), xa = _mm256_set1_epi32(xa_[q]);
        for (int c = 0; c < 8; c++) { /* unrolled: the accumulators stay in registers */
            const __m256i w = _mm256_loadu_si256((const __m256i *)(at + 32 * c));
            acc[c] = _mm256_add_epi32(acc[c], _mm256_madd_epi16(_mm256_maddubs_epi16(xa, _mm256_sign_epi8(w, xs)),
                                                                ones));
        }
    }
    for (int c = 0; c < 8; c++)
        store8_int8(acc[c], row_scale, head, bias, y, n, n0 + 8 * c);
}

/* x [m, k] float32 -> y [m, n] float32 through the packed int8 weight w (header included); k is the weight's. */
__attribute__((TARGET_INT8)) void specviz_gemm_int8_avx2(const void *x_, const void *w, const float *bias, void *y_,
                                                        int m, int n, int k)
{
    const float *x = x_;
    float *y = y_;
    const int groups = (n + INT8_GROUP - 1) / INT8_GROUP, quads = (k + 3) / 4, npad = groups * INT8_GROUP;
    const float *head = w; /* s_c, then the sums of q */
    const int8_t *weights = (const int8_t *)(head + 2 * (size_t)npad);
    int32_t *xq = malloc(2 * sizeof(int32_t) * (size_t)m * quads), *xa = xq + (size_t)m * quads;
    float *scale = malloc(sizeof(float) * (size_t)m);
    if (!xq || !scale)
        abort(); /* a few kB: only where the process has no memory left at all */
    for (int r = 0; r < m; r++) /* each row alone */
        scale[r] = quantize_row8(x + (size_t)r * k, k, 4 * quads, (int8_t *)(xq + (size_t)r * quads),
                                 (int8_t *)(xa + (size_t)r * quads));
#pragma omp parallel for schedule(static)
    for (int g = 0; g < groups; g++) /* the group's bytes from memory for the first row, from L2 for the others */
        for (int r = 0; r < m; r++)
            int8_row(xq + (size_t)r * quads, xa + (size_t)r * quads, scale[r],
                     weights + (size_t)g * quads * 4 * INT8_GROUP, head, bias, y + (size_t)r * n, quads, n,
                     g * INT8_GROUP);
    free(xq);
    free(scale);
}
