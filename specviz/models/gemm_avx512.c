/* The matrix-product kernels for AVX-512 CPUs, each compiled for its instructions function by function (the
   library is built with -mavx2; native.py calls these only where ATen runs its AVX-512 kernels, and each
   extension's path asks for its instructions before it packs a weight): the FMA kernel in 512-bit registers
   ("avx512", "avx512-bf16"), the bfloat16 pair kernel ("avx512-dot"), AMX tiles ("amx") and 8-bit integers
   ("vnni-int8"). */
#include "kernels.h"
#include "gemm_store.h"

/* The same kernel with AVX-512 (AVX512F): a block of 16 columns is one 512-bit register, so a pass keeps one
   accumulator per row and takes up to 12 rows (12 accumulators, the weights and a broadcast: 14 of the 32
   registers), twice the FMA width of the AVX2 kernel. Each output is the same k-ordered chain of FMAs as
   there, so both kernels give the same bits. Its bfloat16 blocks keep their columns in order: one zero-extend
   across the register widens all 16 (native.pack). Compiled for AVX-512 function by function (the file is built
   with -mavx2): native.py calls these only where ATen itself runs its AVX-512 kernels. */
#define INLINE512 static inline __attribute__((always_inline, target("avx512f")))
#define KERNEL512 __attribute__((target("avx512f")))

INLINE512 __m512 load16_512(const void *wb, int bf16, int k)
{
    if (bf16) {
        __m256i raw = _mm256_loadu_si256((const __m256i *)((const uint16_t *)wb + 16 * (size_t)k));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
    return _mm512_loadu_ps((const float *)wb + 16 * (size_t)k);
}

#define ROW512(r, acc) if (rows > r) acc = _mm512_fmadd_ps(_mm512_set1_ps(x[(size_t)r * k_len + k]), w, acc);
#define STORE512(r, acc) if (rows > r) store16_512(acc, b, y + (size_t)r * n, n, n0);

INLINE512 void rows_by_block512(const float *x, const void *wb, const char *next, int bf16, const float *b, float *y,
                                int rows, int k_len, int n, int n0)
{
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0,
           a9 = a0, a10 = a0, a11 = a0;
    size_t line = bf16 ? 32 : 64;
    for (int k = 0; k < k_len; k++) {
        if (next)
            _mm_prefetch(next + line * k, _MM_HINT_T1);
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
        /* with more than one row only: one row with the hint has not been timed on an AVX-512 CPU yet */
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

/* Every group of 64 columns (shared among threads) times the m rows in passes of at most 6, as even as can be (8:
   4 + 4): `call` runs pass[rows - 1] on rows m0.. of group g (the pair and int8 kernels). */
#define GROUPS_BY_PASSES(groups, m, call)                                                                      \
    _Pragma("omp parallel for schedule(static)") for (int g = 0; g < (groups); g++)                           \
    {                                                                                                          \
        int passes = ((m) + 5) / 6;                                                                            \
        for (int p = 0, m0 = 0; p < passes; p++) {                                                             \
            int rows = (m) / passes + (p < (m) % passes);                                                      \
            call;                                                                                              \
            m0 += rows;                                                                                        \
        }                                                                                                      \
    }

__attribute__((TARGET_BF16)) void specviz_gemm_dot_bf16(const int32_t *x, const uint16_t *w, const float *bias,
                                                        uint16_t *y, int m, int n, int pairs)
{
    void (*pass[])(const int32_t *, const uint16_t *, const float *, uint16_t *, int, int, int) = {
        pass_1, pass_2, pass_3, pass_4, pass_5, pass_6};
    GROUPS_BY_PASSES((n + GROUP - 1) / GROUP, m,
                     pass[rows - 1](x + (size_t)m0 * pairs, w + (size_t)g * pairs * 2 * GROUP, bias,
                                    y + (size_t)m0 * n, pairs, n, g * GROUP))
}

/* The pair kernel with the signature every product of specviz_layers has (k, not its pairs: k is even there). */
void specviz_gemm_pairs(const void *x, const void *w, const float *bias, void *y, int m, int n, int k)
{
    specviz_gemm_dot_bf16(x, w, bias, y, m, n, k / 2);
}

/* The same packed weights multiplied with AMX tiles (CPUs with AMX-BF16): TDPBF16PS multiplies up to 16 rows by
   16 columns over 32 k (16 pairs) in one instruction, so a verify of up to 16 rows costs about what one row
   does: the weights' stream from memory, not the arithmetic, sets the time. A group of 64 columns is four
   float32 C tiles (tmm0-3) of the block of rows; per 32 k one A tile of the rows' inputs (tmm4) and, for each
   16 columns, a B tile of the group's pairs (rows of 64 bytes, 256 bytes apart: the packed layout as it is).
   Each output is the instruction's own chain over k, whatever the rows beside it (its own bits: "amx").
   The weights are packed with k zero-padded to a step of 32 (the A tile's width; kernels.py), and rows whose k
   is not a multiple of 32 are copied, zero-padded, first; rows above 16 go in blocks of 16. Each step prefetches
   the weights AMX_AHEAD steps on into L2 (tile loads left memory idle: without it the one-row output head
   measured slower than the pair kernel on an AMX CPU, with 2 steps faster; 1 and 4 no better than 2).
   Linux lends a process the tile registers only when asked (specviz_amx_ready), and each thread loads its tile
   configuration before using them and releases them after. */
#if defined(__x86_64__) && ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#define TARGET_AMX target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")

/* 0 if this process may use the tile registers (asked once: ARCH_REQ_XCOMP_PERM for XTILEDATA), else -1. */
int specviz_amx_ready(void)
{
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 0 : -1;
}

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

static __attribute__((TARGET_AMX)) void amx_configure(int rows)
{
    struct tile_config cfg = {0};
    cfg.palette = 1;
    for (int t = 0; t < 7; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = t < 5 ? (uint8_t)rows : 16; /* C tiles 0-3 and A (4): the rows; B (5, 6): 16 pairs */
    }
    _tile_loadconfig(&cfg);
}

#define AMX_AHEAD 2
#define AMX_B(c, t) _tile_loadd(t, at + 32 * (c), 2 * GROUP * 2);
/* rows (1-16) rows of x [rows, k] times the group of 64 columns packed at wg, into y's columns n0.. (bf16). */
static inline __attribute__((always_inline, TARGET_AMX)) void
amx_group(const uint16_t *x, const uint16_t *wg, const float *bias, uint16_t *y, int rows, int n, int n0, int k)
{
    float out[16][GROUP];
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int k0 = 0; k0 < k; k0 += 32) {
        const uint16_t *at = wg + (size_t)k0 * GROUP; /* pair k0 / 2: (k0 / 2) pairs of 2 GROUP weights */
        const char *ahead = (const char *)(at + AMX_AHEAD * 32 * GROUP); /* AMX_AHEAD steps of 32 k on */
        for (int line = 0; line < 32 * GROUP * 2; line += 64)
            _mm_prefetch(ahead + line, _MM_HINT_T1);
        _tile_loadd(4, x + k0, 2 * (size_t)k);
        AMX_B(0, 5) _tile_dpbf16ps(0, 4, 5);
        AMX_B(1, 6) _tile_dpbf16ps(1, 4, 6);
        AMX_B(2, 5) _tile_dpbf16ps(2, 4, 5);
        AMX_B(3, 6) _tile_dpbf16ps(3, 4, 6);
    }
    _tile_stored(0, &out[0][0], sizeof out[0]);
    _tile_stored(1, &out[0][16], sizeof out[0]);
    _tile_stored(2, &out[0][32], sizeof out[0]);
    _tile_stored(3, &out[0][48], sizeof out[0]);
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < GROUP && n0 + c < n; c += 16)
            store16_bf16(_mm512_loadu_ps(&out[r][c]), bias, y + (size_t)r * n, n, n0 + c);
}

/* The AMX product with the signature of specviz_layers' products: x [m, k] and y [m, n] bfloat16 (k even).
   Above 16 rows, each group's weights are read from memory once and multiplied by every block of 16 rows while
   they sit in L2 (blocks outer, the weights were streamed once a block: 8 times at 128 rows, a batch's or a
   prompt's). The rows are zero-padded to whole blocks, so one tile configuration serves every block; the padding
   rows' sums are not stored, and a row's own sums are the same whatever rows share its tile. */
__attribute__((TARGET_AMX)) void specviz_gemm_amx(const void *x, const void *w, const float *bias, void *y, int m,
                                                  int n, int k)
{
    const int groups = (n + GROUP - 1) / GROUP, kp = (k + 31) / 32 * 32, mp = m > 16 ? (m + 15) / 16 * 16 : m;
    uint16_t *padded = NULL;
    if (kp != k || mp != m) { /* the rows zero-padded to the packed k and to whole blocks of 16 */
        if (!(padded = calloc((size_t)mp * kp, sizeof *padded)))
            return;
        for (int r = 0; r < m; r++)
            memcpy(padded + (size_t)r * kp, (const uint16_t *)x + (size_t)r * k, (size_t)k * sizeof *padded);
        x = padded;
    }
#pragma omp parallel
    {
        amx_configure(mp < 16 ? mp : 16);
#pragma omp for schedule(static)
        for (int g = 0; g < groups; g++)
            for (int m0 = 0; m0 < m; m0 += 16)
                amx_group((const uint16_t *)x + (size_t)m0 * kp, (const uint16_t *)w + (size_t)g * kp * GROUP, bias,
                          (uint16_t *)y + (size_t)m0 * n, m - m0 < 16 ? m - m0 : 16, n, g * GROUP, kp);
        _tile_release();
    }
    free(padded);
}
#else
int specviz_amx_ready(void) { return -1; } /* a compiler without AMX: the path is skipped */
void specviz_gemm_amx(const void *x, const void *w, const float *bias, void *y, int m, int n, int k) {}
#endif

/* A drafter's product in 8-bit integers (path "vnni-int8", kernels.py; lossy: the EAGLE head's products only,
   never the target's): half the bytes of bfloat16 weights to stream, on CPUs with AVX512-VNNI. The weight is
   kept as int8 per output column c (w ~ s_c q, s_c = max |w_c| / 127), packed as [ceil(n / 64)][k / 4][64][4]
   (per group of 64 columns and quad of k, each column's four weights side by side, as VPDPBUSD reads them),
   after a header of each column's s_c (float32) and its sum of q (int32), n padded to 64 (native.pack_quads).
   Each bfloat16 input row is quantized alone (x ~ t_r u, t_r = max |x_r| / 127, u rounded to nearest even) and
   stored as u + 128 (VPDPBUSD multiplies unsigned bytes by signed ones), so a row's result never depends on the
   rows beside it: y = t_r s_c (sum (u + 128) q - 128 sum q) (+ bias, in one fused multiply-add with the last
   product), rounded to bfloat16. The integer sums are
   exact (|sum| < 2^31 for k < 65,000); a pass takes a group and up to 6 rows, as the pair kernel's does
   (GROUPS_BY_PASSES). */
#define TARGET_VNNI target("avx512f,avx512bw,avx512vl,avx512vnni")

/* 16 float32 lanes rounded to bfloat16 as to_bf16 rounds each (no AVX512-BF16 needed). */
static inline __attribute__((always_inline, TARGET_VNNI)) __m256i round16_bf16(__m512 f)
{
    const __m512i u = _mm512_castps_si512(f), high = _mm512_srli_epi32(u, 16);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                                   _mm512_and_si512(high, _mm512_set1_epi32(1))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q); /* a NaN stays a NaN, quiet */
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(high, _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
}

#define QUAD(r, c, acc) acc = _mm512_dpbusd_epi32(acc, x##r, w##c);
#define QUADS_OF_ROW(r, a, b, c, d)                                                    \
    if (rows > r) {                                                                    \
        __m512i x##r = _mm512_set1_epi32(xq[(size_t)r * quads + q]);                   \
        QUAD(r, 0, a) QUAD(r, 1, b) QUAD(r, 2, c) QUAD(r, 3, d)                        \
    }
#define STORE_INT8(r, a, b, c, d)                                                      \
    if (rows > r) {                                                                    \
        uint16_t *yr = y + (size_t)r * n;                                              \
        store16_int8(a, scale[r], head, bias, yr, n, n0, npad);                        \
        if (n0 + 16 < n) store16_int8(b, scale[r], head, bias, yr, n, n0 + 16, npad);  \
        if (n0 + 32 < n) store16_int8(c, scale[r], head, bias, yr, n, n0 + 32, npad);  \
        if (n0 + 48 < n) store16_int8(d, scale[r], head, bias, yr, n, n0 + 48, npad);  \
    }

/* 16 integer sums of a row as outputs: t_r s_c (sum - 128 sum q) (+ bias), rounded to bfloat16, into y[n0..]. */
static inline __attribute__((always_inline, TARGET_VNNI)) void store16_int8(__m512i acc, float row_scale,
                                                                           const float *head, const float *bias,
                                                                           uint16_t *y, int n, int n0, int npad)
{
    __mmask16 keep = (__mmask16)((1u << (n - n0 < 16 ? n - n0 : 16)) - 1);
    const __m512i sums = _mm512_loadu_si512((const void *)((const int32_t *)(head + npad) + n0));
    const __m512 exact = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc, _mm512_slli_epi32(sums, 7)));
    /* the last product and the bias' sum as one fused operation, written so: the compiler may not split it */
    const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
    const __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(exact, _mm512_set1_ps(row_scale)), _mm512_loadu_ps(head + n0), b);
    _mm256_mask_storeu_epi16(y + n0, keep, round16_bf16(v));
}

/* `rows` (1-6) quantized rows times the group of 64 columns from n0 on, packed at wg. */
static inline __attribute__((always_inline, TARGET_VNNI)) void
int8_rows_by_group(const int32_t *xq, const float *scale, const int8_t *wg, const float *head, const float *bias,
                   uint16_t *y, int rows, int quads, int n, int n0, int npad)
{
    __m512i z = _mm512_setzero_si512(), a0 = z, a1 = z, a2 = z, a3 = z, b0 = z, b1 = z, b2 = z, b3 = z, c0 = z,
            c1 = z, c2 = z, c3 = z, d0 = z, d1 = z, d2 = z, d3 = z, e0 = z, e1 = z, e2 = z, e3 = z, f0 = z, f1 = z,
            f2 = z, f3 = z;
    for (int q = 0; q < quads; q++) {
        const int8_t *at = wg + 4 * GROUP * (size_t)q;
        if (q + 8 < quads)
            _mm_prefetch((const char *)(at + 8 * 4 * GROUP), _MM_HINT_T0);
        const __m512i w0 = _mm512_loadu_si512((const void *)at), w1 = _mm512_loadu_si512((const void *)(at + 64)),
                      w2 = _mm512_loadu_si512((const void *)(at + 128)),
                      w3 = _mm512_loadu_si512((const void *)(at + 192));
        QUADS_OF_ROW(0, a0, a1, a2, a3) QUADS_OF_ROW(1, b0, b1, b2, b3) QUADS_OF_ROW(2, c0, c1, c2, c3)
        QUADS_OF_ROW(3, d0, d1, d2, d3) QUADS_OF_ROW(4, e0, e1, e2, e3) QUADS_OF_ROW(5, f0, f1, f2, f3)
    }
    STORE_INT8(0, a0, a1, a2, a3) STORE_INT8(1, b0, b1, b2, b3) STORE_INT8(2, c0, c1, c2, c3)
    STORE_INT8(3, d0, d1, d2, d3) STORE_INT8(4, e0, e1, e2, e3) STORE_INT8(5, f0, f1, f2, f3)
}

#define INT8_PASS_FN(r)                                                                                        \
    static __attribute__((noinline, TARGET_VNNI)) void int8_pass_##r(                                          \
        const int32_t *xq, const float *scale, const int8_t *wg, const float *head, const float *bias,          \
        uint16_t *y, int quads, int n, int n0, int npad)                                                       \
    {                                                                                                          \
        int8_rows_by_group(xq, scale, wg, head, bias, y, r, quads, n, n0, npad);                               \
    }
INT8_PASS_FN(1) INT8_PASS_FN(2) INT8_PASS_FN(3) INT8_PASS_FN(4) INT8_PASS_FN(5) INT8_PASS_FN(6)

/* The first min(count, 16) bfloat16 numbers at p as float32, zeros after. */
static inline __attribute__((always_inline, TARGET_VNNI)) __m512 load16_bf16(const uint16_t *p, int count)
{
    const __mmask16 keep = count >= 16 ? (__mmask16)0xffff : count > 0 ? (__mmask16)((1u << count) - 1) : 0;
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, p)), 16));
}

/* A bfloat16 row x[k] as VPDPBUSD's bytes, out[padded] (padded >= k): u + 128, u = x / t rounded to nearest even and
   kept within [-127, 127] (a NaN: 0; zeros past k); returns t = max |x| / 127 (NaNs passed over). 16 at a time. */
static inline __attribute__((always_inline, TARGET_VNNI)) float quantize_row(const uint16_t *x, int k, int padded,
                                                                            uint8_t *out)
{
    __m512 top = _mm512_setzero_ps();
    for (int i = 0; i < k; i += 16) /* max(v, top) is top where v is a NaN */
        top = _mm512_max_ps(_mm512_abs_ps(load16_bf16(x + i, k - i)), top);
    const float t = _mm512_reduce_max_ps(top);
    const __m512 up = _mm512_set1_ps(t > 0.0f ? 127.0f / t : 0.0f), zero = _mm512_setzero_ps();
    for (int i = 0; i < padded; i += 16) {
        __m512 v = _mm512_mul_ps(load16_bf16(x + i, k - i), up);
        v = _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), zero);
        v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f));
        const __m128i bytes = _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(v), _mm512_set1_epi32(128)));
        const int left = padded - i;
        _mm_mask_storeu_epi8(out + i, left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1), bytes);
    }
    return t / 127.0f;
}

/* x [m, k] bfloat16 -> y [m, n] bfloat16 through the packed int8 weight w (header included); k is the weight's. */
__attribute__((TARGET_VNNI)) void specviz_gemm_int8(const void *x_, const void *w, const float *bias, void *y_, int m,
                                                   int n, int k)
{
    const uint16_t *x = x_;
    uint16_t *y = y_;
    const int groups = (n + GROUP - 1) / GROUP, quads = (k + 3) / 4, npad = groups * GROUP;
    const float *head = w; /* s_c, then the sums of q */
    const int8_t *weights = (const int8_t *)(head + 2 * (size_t)npad);
    int32_t *xq = malloc(sizeof(int32_t) * (size_t)m * quads);
    float *scale = malloc(sizeof(float) * (size_t)m);
    if (!xq || !scale)
        abort(); /* a few kB: only where the process has no memory left at all */
    for (int r = 0; r < m; r++) /* each row alone */
        scale[r] = quantize_row(x + (size_t)r * k, k, 4 * quads, (uint8_t *)(xq + (size_t)r * quads));
    void (*pass[])(const int32_t *, const float *, const int8_t *, const float *, const float *, uint16_t *, int, int,
                   int, int) = {int8_pass_1, int8_pass_2, int8_pass_3, int8_pass_4, int8_pass_5, int8_pass_6};
    GROUPS_BY_PASSES(groups, m,
                     pass[rows - 1](xq + (size_t)m0 * quads, scale + m0, weights + (size_t)g * quads * 4 * GROUP, head,
                                    bias, y + (size_t)m0 * n, quads, n, g * GROUP, npad))
    free(xq);
    free(scale);
}
