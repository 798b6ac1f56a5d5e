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
   runtime: the process loads one libgomp, and torch.set_num_threads sets its thread count).
   Below it, the same kernel in AVX-512 registers ("avx512", "avx512-bf16") and a bfloat16 one for
   AVX512-BF16 ("avx512-dot"), each compiled for its instructions function by function. */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#define INLINE static inline __attribute__((always_inline))
#include "gemm_store.h"
#include "specviz_abi.h"

void specviz_abi(struct specviz_abi *out)
{
    out->version = SPECVIZ_ABI_VERSION;
    out->layers_dims = sizeof(struct specviz_layers_dims);
    out->layer = sizeof(struct specviz_layer);
    out->product = sizeof(struct specviz_product);
}

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

/* RMSNorm of bfloat16 rows as transformers' LlamaRMSNorm computes it (leanllama.rms_norm): a row widened
   to float32, times 1 / sqrt(mean of its squares + eps), rounded to bfloat16, times the weight, rounded
   again, each rounding to nearest even as torch rounds. Only the order of the sum of squares differs
   from ATen's. With `share` (and more than one row) the rows are shared among OpenMP threads, which changes no
   row's bits, only the time: a row's arithmetic is small, but inside a forward its numbers arrive from the other
   core's cache (the products share their columns among threads), so whether starting the threads pays depends on
   the machine and the row count, and the caller decides from this machine's timing (native.rms_bf16). */
#include <string.h>

#define SHARED(rows) (share && (rows) > 1) /* whether the row-by-row functions below share rows among threads */

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

/* Eight bfloat16 numbers rounded from float32 lanes as to_bf16 rounds each (to nearest even; a NaN stays a NaN
   with the quiet bit set), in lane order. */
INLINE __m128i round8_bf16(__m256 f)
{
    const __m256i u = _mm256_castps_si256(f), high = _mm256_srli_epi32(u, 16);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)),
                                                   _mm256_and_si256(high, _mm256_set1_epi32(1))), 16);
    r = _mm256_blendv_epi8(r, _mm256_or_si256(high, _mm256_set1_epi32(0x40)),
                           _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}

INLINE __m256 load8_bf16(const uint16_t *p)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* The first min(count, 8) of p as float32, zeros after (a head dimension that is not a multiple of 8). */
INLINE __m256 load_bf16(const uint16_t *p, int64_t count)
{
    if (count >= 8)
        return load8_bf16(p);
    uint16_t part[8] = {0};
    memcpy(part, p, sizeof(uint16_t) * (size_t)count);
    return load8_bf16(part);
}

INLINE float sum8(__m256 v) /* one fixed order: halves, then pairs, then the last two */
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

INLINE __m256 widen8_bits(__m128i h) /* eight bfloat16 numbers held in a register, widened */
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* The sum of squares in eight lanes (each lane its own chain of fused multiply-adds, then sum8), a row's
   numbers never depending on the rows beside it; the rest eight at a time with to_bf16's roundings, so the same
   bits as the scalar tail. A scalar running sum would be a chain of n dependent adds, each waiting on the one
   before: slow, for a small row's work. */
void specviz_rms_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int rows, int n, float eps, int share)
{
#pragma omp parallel for schedule(static) if (SHARED(rows))
    for (int r = 0; r < rows; r++) {
        const uint16_t *xr = x + (size_t)r * n;
        uint16_t *yr = y + (size_t)r * n;
        __m256 acc = _mm256_setzero_ps();
        for (int i = 0; i < n; i += 8) { /* the last chunk zero-padded */
            const __m256 v = load_bf16(xr + i, n - i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        const float scale = 1.0f / _mm_cvtss_f32(_mm_sqrt_ss(_mm_set_ss(sum8(acc) / (float)n + eps))); /* IEEE */
        const __m256 s = _mm256_set1_ps(scale);
        int i = 0;
        for (; i + 8 <= n; i += 8) {
            const __m256 normed = widen8_bits(round8_bf16(_mm256_mul_ps(load8_bf16(xr + i), s)));
            _mm_storeu_si128((__m128i *)(yr + i), round8_bf16(_mm256_mul_ps(load8_bf16(w + i), normed)));
        }
        for (; i < n; i++)
            yr[i] = to_bf16(from_bf16(w[i]) * from_bf16(to_bf16(from_bf16(xr[i]) * scale)));
    }
}

/* Attention of bfloat16 queries over bfloat16 keys and values, in float32 (specviz_attend_bf16), the same
   numbers for a query whatever else is in the call: each query's visible keys are gathered in slot order
   first, and every sum then runs over that list (the scores' dot products over the head's dimension in
   8-lane chunks, reduced in one fixed order; the softmax's sum in 8-lane partial sums over the list; the
   values' weighted sum key after key). So a query gets the same bits alone in a one-token step, among the
   rows of a verify, beside other batch rows, or as a tree node whose ancestors are not consecutive slots:
   what makes bfloat16 greedy speculation decode exactly the plain decoding's tokens, where the products are
   row-invariant too. ATen's kernels split the keys into blocks by slot and reduce them in an order that
   depends on the call's shape. Work items are (batch row, key head, query): the key head's query heads
   share each key's load; items are shared among OpenMP threads, which do not change any item's bits. */
#include <math.h>
#include <stdlib.h>

/* e^x for x <= 0 in eight lanes (Cephes' expf: x = n ln 2 + r, |r| <= ln 2 / 2, a degree-6 polynomial for
   e^r, times 2^n); below -87.3 it returns 2^-126 instead of a smaller number, which the sum of a softmax,
   whose largest term is 1, does not see. Lane by lane: a number's result does not depend on its lane. */
INLINE __m256 exp_neg(__m256 x)
{
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

#define MAX_REP 16     /* query heads per key head */
#define MAX_DIM 256    /* head dimension */

/* p's elements at..at + min(count, 8) as float32, zeros after (a head dimension that is not a multiple of 8):
   float32 storage or bfloat16 (f32 a constant where it is inlined). */
INLINE __m256 load_at(const void *p, int64_t at, int64_t count, int f32)
{
    if (!f32)
        return load_bf16((const uint16_t *)p + at, count);
    if (count >= 8)
        return _mm256_loadu_ps((const float *)p + at);
    float part[8] = {0};
    memcpy(part, (const float *)p + at, sizeof(float) * (size_t)count);
    return _mm256_loadu_ps(part);
}

/* sum8 of each of eight vectors, as one vector (lane j: sum8(v[j])), in sum8's order lane by lane: each
   vector's halves added, then its lanes 0 + 2 and 1 + 3, then those two; the same bits, a quarter of the
   shuffles. */
INLINE __m256 sum8_of_8(const __m256 *v)
{
    __m256 s[4];
    for (int j = 0; j < 4; j++) /* [v_j's lanes 0-3 + 4-7 | v_(j+4)'s]: halves added */
        s[j] = _mm256_add_ps(_mm256_permute2f128_ps(v[j], v[j + 4], 0x20),
                             _mm256_permute2f128_ps(v[j], v[j + 4], 0x31));
    __m256 t0 = _mm256_unpacklo_ps(s[0], s[1]), t1 = _mm256_unpackhi_ps(s[0], s[1]);
    __m256 t2 = _mm256_unpacklo_ps(s[2], s[3]), t3 = _mm256_unpackhi_ps(s[2], s[3]);
    __m256 l0 = _mm256_shuffle_ps(t0, t2, 0x44), l1 = _mm256_shuffle_ps(t0, t2, 0xEE); /* lane 0, lane 1 of each */
    __m256 l2 = _mm256_shuffle_ps(t1, t3, 0x44), l3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    return _mm256_add_ps(_mm256_add_ps(l0, l2), _mm256_add_ps(l1, l3));
}

/* The slots a query sees (its mask row's nonzero bytes, `sm2` apart) into seen, in slot order; returns how many.
   A contiguous row is read 32 bytes at a time, and a block it sees whole is written as one run of slot numbers. */
INLINE int visible_slots(const uint8_t *row, int64_t L, int64_t sm2, int *seen)
{
    int n = 0;
    int64_t j = 0;
    if (sm2 == 1)
        for (; j + 32 <= L; j += 32) {
            const __m256i bytes = _mm256_loadu_si256((const __m256i *)(row + j));
            uint32_t bits = ~(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(bytes, _mm256_setzero_si256()));
            if (bits == 0xFFFFFFFFu) {
                __m256i slots = _mm256_add_epi32(_mm256_set1_epi32((int)j), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
                for (int c = 0; c < 4; c++, slots = _mm256_add_epi32(slots, _mm256_set1_epi32(8)))
                    _mm256_storeu_si256((__m256i *)(seen + n + 8 * c), slots);
                n += 32;
            } else
                for (; bits; bits &= bits - 1)
                    seen[n++] = (int)j + __builtin_ctz(bits);
        }
    for (; j < L; j++)
        if (row[j * sm2])
            seen[n++] = (int)j;
    return n;
}

/* One work item: rep query heads of key head g at query i of batch row b, over a head dimension of D (rep and D
   constants where it is inlined, so the accumulators stay in registers; the last chunk of 8 zero-padded). Each
   key and value is read and widened once for the rep heads that share it, and a score's sum of 8 lanes is taken
   eight keys at a time (sum8_of_8): per score and per output the same operations in the same order as one head
   at a time, so the same bits.
   q, k, v, out: the tensors, the item's first element of each at qo, ko, vo, oo (float32, f32, or bfloat16
   numbers; the arithmetic is float32 either way, a bfloat16 output rounded once at the end).
   seen: scratch for L slot numbers; e: for rep rows of L + 8 scores. */
INLINE void attend_item(const void *q, int64_t qo, const void *k, int64_t ko, const void *v, int64_t vo,
                        const uint8_t *row, void *out, int64_t oo, int64_t L, int64_t rep, int64_t D, int64_t sm2,
                        const int64_t *sk, const int64_t *sv, int64_t sq1, int64_t so1, float scale, int *seen,
                        float *e, int f32)
{
    const int64_t chunks = (D + 7) / 8, Dp = 8 * chunks;
    const int n = visible_slots(row, L, sm2, seen);
    const int64_t padded = (n + 7) / 8 * 8;
    float qf[MAX_REP * MAX_DIM] __attribute__((aligned(32)));
    for (int64_t r = 0; r < rep; r++)
        for (int64_t c = 0; c < chunks; c++)
            _mm256_store_ps(qf + r * Dp + 8 * c, load_at(q, qo + r * sq1 + 8 * c, D - 8 * c, f32));
    /* scores: e[r][m] = (q_r . k_seen[m]) * scale, eight keys at a time */
    __m256 hold[MAX_REP][8], kc[MAX_DIM / 8];
    for (int m0 = 0; m0 < n; m0 += 8) {
        for (int j = 0; j < 8; j++) {
            if (m0 + j >= n) { /* past the last key: sums of nothing, overwritten below */
                for (int64_t r = 0; r < rep; r++)
                    hold[r][j] = _mm256_setzero_ps();
                continue;
            }
            const int64_t kr = ko + (int64_t)seen[m0 + j] * sk[2];
            for (int64_t c = 0; c < chunks; c++)
                kc[c] = load_at(k, kr + 8 * c, D - 8 * c, f32);
            for (int64_t r = 0; r < rep; r++) {
                __m256 acc = _mm256_setzero_ps();
                for (int64_t c = 0; c < chunks; c++)
                    acc = _mm256_fmadd_ps(_mm256_load_ps(qf + r * Dp + 8 * c), kc[c], acc);
                hold[r][j] = acc;
            }
        }
        for (int64_t r = 0; r < rep; r++)
            _mm256_storeu_ps(e + r * (L + 8) + m0, _mm256_mul_ps(sum8_of_8(hold[r]), _mm256_set1_ps(scale)));
    }
    float inv[MAX_REP];
    for (int64_t r = 0; r < rep; r++) {
        float *er = e + r * (L + 8), top = -INFINITY, lanes[8];
        __m256 most = _mm256_set1_ps(-INFINITY); /* the largest score, eight lanes at a time: the same number */
        int m = 0;                                /* (a tie between 0 and -0 aside, which exp does not tell apart) */
        for (; m + 8 <= n; m += 8)
            most = _mm256_max_ps(_mm256_loadu_ps(er + m), most); /* a NaN score is passed over, as below */
        _mm256_storeu_ps(lanes, most);
        for (int j = 0; j < 8; j++)
            top = lanes[j] > top ? lanes[j] : top;
        for (; m < n; m++)
            top = er[m] > top ? er[m] : top;
        for (int m = n; m < padded; m++)
            er[m] = top;
        __m256 sum = _mm256_setzero_ps(), mx = _mm256_set1_ps(top);
        for (int64_t m = 0; m < padded; m += 8) {
            __m256 x = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(er + m), mx));
            if (m + 8 > n) /* the padding's lanes add nothing */
                x = _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_cmpgt_epi32(
                        _mm256_set1_epi32(n - (int)m), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))));
            _mm256_storeu_ps(er + m, x);
            sum = _mm256_add_ps(sum, x);
        }
        inv[r] = n ? 1.0f / sum8(sum) : 0.0f;
    }
    /* out_r = sum_m e[r][m] v_seen[m] / sum, key after key, two chunks of 8 at a time for all rep heads */
    for (int64_t c0 = 0; c0 < chunks; c0 += 2) {
        const int64_t cn = chunks - c0 < 2 ? chunks - c0 : 2;
        __m256 acc[MAX_REP][2];
        for (int64_t r = 0; r < rep; r++)
            acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int m = 0; m < n; m++) {
            const int64_t vr = vo + (int64_t)seen[m] * sv[2] + 8 * c0;
            __m256 v0 = load_at(v, vr, D - 8 * c0, f32), v1 = cn > 1 ? load_at(v, vr + 8, D - 8 * c0 - 8, f32) : v0;
            for (int64_t r = 0; r < rep; r++) {
                __m256 p = _mm256_set1_ps(e[r * (L + 8) + m]);
                acc[r][0] = _mm256_fmadd_ps(p, v0, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(p, v1, acc[r][1]);
            }
        }
        for (int64_t r = 0; r < rep; r++) {
            const int64_t o = oo + r * so1;
            float tmp[16];
            _mm256_storeu_ps(tmp, _mm256_mul_ps(acc[r][0], _mm256_set1_ps(inv[r])));
            _mm256_storeu_ps(tmp + 8, _mm256_mul_ps(acc[r][1], _mm256_set1_ps(inv[r])));
            for (int64_t d = 0; d < 8 * cn && 8 * c0 + d < D; d++) {
                if (f32)
                    ((float *)out)[o + 8 * c0 + d] = tmp[d];
                else
                    ((uint16_t *)out)[o + 8 * c0 + d] = to_bf16(tmp[d]);
            }
        }
    }
}

/* dims: B, H, KV, t, L, D. Strides in elements: q (batch, head, query), k and v (batch, key head, slot), mask
   (batch, query, slot), out (batch, head, query); the last dimension of each is contiguous. mask: 1 = the
   query sees that slot. A query that sees nothing gets zeros. f32: float32 tensors, else bfloat16. */
INLINE void attend_all(const void *q, const void *k, const void *v, const uint8_t *mask, void *out,
                       const int64_t *dims, const int64_t *strides, float scale, int f32)
{
    const int64_t B = dims[0], H = dims[1], KV = dims[2], T = dims[3], L = dims[4], D = dims[5];
    const int64_t rep = H / KV, items = B * KV * T;
    const int64_t *sq = strides, *sk = strides + 3, *sv = strides + 6, *sm = strides + 9, *so = strides + 12;
#pragma omp parallel if (items > 1)
    {
        int *seen = malloc(sizeof(int) * (size_t)L);
        float *e = malloc(sizeof(float) * (size_t)rep * (size_t)(L + 8));
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; item++) {
            const int64_t b = item / (KV * T), g = item / T % KV, i = item % T;
            const int64_t qo = b * sq[0] + g * rep * sq[1] + i * sq[2], ko = b * sk[0] + g * sk[1],
                          vo = b * sv[0] + g * sv[1], oo = b * so[0] + g * rep * so[1] + i * so[2];
            const uint8_t *row = mask + b * sm[0] + i * sm[1];
            if (D == 64 && rep == 3) /* the offline target's 9 query heads on 3 key heads: both constants */
                attend_item(q, qo, k, ko, v, vo, row, out, oo, L, 3, 64, sm[2], sk, sv, sq[1], so[1], scale, seen, e,
                            f32);
            else if (D == 64)
                attend_item(q, qo, k, ko, v, vo, row, out, oo, L, rep, 64, sm[2], sk, sv, sq[1], so[1], scale, seen, e,
                            f32);
            else
                attend_item(q, qo, k, ko, v, vo, row, out, oo, L, rep, D, sm[2], sk, sv, sq[1], so[1], scale, seen, e,
                            f32);
        }
        free(seen);
        free(e);
    }
}

void specviz_attend_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, const uint8_t *mask, uint16_t *out,
                         const int64_t *dims, const int64_t *strides, float scale)
{
    attend_all(q, k, v, mask, out, dims, strides, scale, 0);
}

static void attend_f32(const float *q, const float *k, const float *v, const uint8_t *mask, float *out,
                       const int64_t *dims, const int64_t *strides, float scale)
{
    attend_all(q, k, v, mask, out, dims, strides, scale, 1);
}

/* RoPE on a step's queries and keys, and its keys and values written to their cache slots, in one call
   (specviz_rope_store_bf16), with ATen's roundings (bitwise what leanllama.rotate and index_copy_ give):
   each of x * cos and rotate_half(x) * sin rounded to bfloat16, then their sum. qkv: [B, t, H + 2 KV, D]
   (the fused projection's output), cos and sin: [B, t, D]; q_out: [B, t, H, D]; k_cache and v_cache:
   [B, KV, capacity, D]; slots: int64, row b's t slot numbers from slots + b * dims[6] (0: the same for every
   row); dims[7]: share the rows among threads (as specviz_rms_bf16's `share`). f32 (rope_store_f32, for
   specviz_layers): float32 tensors, x * cos + turned * sin in float32 (the compiler may fuse one product into the
   sum: within rounding of ATen's, not its bits). */
INLINE void rope_store(const void *qkv, const void *cos, const void *sin, const int64_t *slots, void *q_out,
                       void *k_cache, void *v_cache, const int64_t *dims, int f32)
{
    const int64_t B = dims[0], T = dims[1], H = dims[2], KV = dims[3], D = dims[4], C = dims[5], half = D / 2,
                  slot_stride = dims[6], size = f32 ? 4 : 2, share = dims[7];
#pragma omp parallel for schedule(static) if (SHARED(B * T))
    for (int64_t bi = 0; bi < B * T; bi++) {
        const int64_t b = bi / T, i = bi % T, co = (b * T + i) * D;
        for (int64_t h = 0; h < H + 2 * KV; h++) {
            const int64_t xo = ((b * T + i) * (H + 2 * KV) + h) * D;
            const int64_t oo = h < H ? ((b * T + i) * H + h) * D
                                     : ((b * KV + (h - H) % KV) * C + slots[b * slot_stride + i]) * D;
            char *out = (char *)(h < H ? q_out : h < H + KV ? k_cache : v_cache) + oo * size;
            if (h >= H + KV) { /* values: stored as they are */
                memcpy(out, (const char *)qkv + xo * size, (size_t)(size * D));
                continue;
            }
            if (f32) {
                const float *x = (const float *)qkv + xo, *c = (const float *)cos + co, *s = (const float *)sin + co;
                for (int64_t d = 0; d < D; d++)
                    ((float *)out)[d] = x[d] * c[d] + (d < half ? -x[d + half] : x[d - half]) * s[d];
                continue;
            }
            const uint16_t *x = (const uint16_t *)qkv + xo, *c = (const uint16_t *)cos + co,
                           *s = (const uint16_t *)sin + co;
            if (half % 8 == 0) { /* eight at a time in each half, the same roundings (negating is exact) */
                const __m256 sign = _mm256_set1_ps(-0.0f);
                for (int64_t d = 0; d < half; d += 8) {
                    const __m256 lo = load8_bf16(x + d), hi = load8_bf16(x + d + half);
                    const __m256 lo_c = widen8_bits(round8_bf16(_mm256_mul_ps(lo, load8_bf16(c + d))));
                    const __m256 hi_s = widen8_bits(round8_bf16(_mm256_mul_ps(_mm256_xor_ps(hi, sign),
                                                                              load8_bf16(s + d))));
                    const __m256 hi_c = widen8_bits(round8_bf16(_mm256_mul_ps(hi, load8_bf16(c + d + half))));
                    const __m256 lo_s = widen8_bits(round8_bf16(_mm256_mul_ps(lo, load8_bf16(s + d + half))));
                    _mm_storeu_si128((__m128i *)((uint16_t *)out + d), round8_bf16(_mm256_add_ps(lo_c, hi_s)));
                    _mm_storeu_si128((__m128i *)((uint16_t *)out + d + half), round8_bf16(_mm256_add_ps(hi_c, lo_s)));
                }
                continue;
            }
            for (int64_t d = 0; d < D; d++) {
                float turned = d < half ? -from_bf16(x[d + half]) : from_bf16(x[d - half]);
                ((uint16_t *)out)[d] = to_bf16(from_bf16(to_bf16(from_bf16(x[d]) * from_bf16(c[d])))
                                               + from_bf16(to_bf16(turned * from_bf16(s[d]))));
            }
        }
    }
}

void specviz_rope_store_bf16(const uint16_t *qkv, const uint16_t *cos, const uint16_t *sin, const int64_t *slots,
                             uint16_t *q_out, uint16_t *k_cache, uint16_t *v_cache, const int64_t *dims)
{
    rope_store(qkv, cos, sin, slots, q_out, k_cache, v_cache, dims, 0);
}

/* Decoder layers in one call (specviz_layers, below): between its products, what leanllama.LeanLayer.forward
   does with ATen operations, as C. In bfloat16 with ATen's roundings (each elementwise result in float32, rounded
   to bfloat16 to nearest even; SiLU looked up in `silu`, ATen's own SiLU of each of the 65,536 bfloat16 values),
   so the same bits as the layer-by-layer path. In float32 in specviz's own order (the sum of squares of an
   RMSNorm in eight lanes, SiLU from exp_neg's polynomial): within rounding of ATen's numbers, not its bits, and a
   row's numbers never depend on the rows beside it. */
static void add_bf16(uint16_t *x, const uint16_t *y, int64_t n)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(x + i), round8_bf16(_mm256_add_ps(load8_bf16(x + i), load8_bf16(y + i))));
    for (; i < n; i++)
        x[i] = to_bf16(from_bf16(x[i]) + from_bf16(y[i]));
}

static void add_f32(float *x, const float *y, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        x[i] += y[i];
}

/* act[r, i] = SiLU(gate) * up, gate_up [rows, 2 I] (gate, then up): SiLU from the table, the product rounded.
   Rows shared among threads with `share`, as specviz_rms_bf16's (and the float32 twins' below). */
void specviz_silu_mul_bf16(const uint16_t *gate_up, const uint16_t *silu, uint16_t *act, int64_t rows, int64_t I,
                           int64_t share)
{
#pragma omp parallel for schedule(static) if (SHARED(rows))
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gate = gate_up + r * 2 * I, *up = gate + I;
        int64_t i = 0;
        for (; i + 8 <= I; i += 8) { /* eight table entries gathered as 32-bit words ending at each (the table starts
                                        one entry late: native.silu_table), their high halves taken */
            const __m256i at = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(gate + i)));
            const __m256i words = _mm256_i32gather_epi32((const int *)(silu - 1), at, 2);
            const __m256 s = _mm256_castsi256_ps(_mm256_and_si256(words, _mm256_set1_epi32((int)0xffff0000u)));
            _mm_storeu_si128((__m128i *)(act + r * I + i), round8_bf16(_mm256_mul_ps(s, load8_bf16(up + i))));
        }
        for (; i < I; i++)
            act[r * I + i] = to_bf16(from_bf16(silu[gate[i]]) * from_bf16(up[i]));
    }
}

/* The same in float32: SiLU(g) = g / (1 + e^-g) as ATen writes it, with e = e^-|g| (never overflows) and, for a
   negative g, g e / (1 + e); eight lanes at a time, a lane's result independent of its lane. */
static void silu_mul_f32(const float *gate_up, float *act, int64_t rows, int64_t I, int64_t share)
{
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
#pragma omp parallel for schedule(static) if (SHARED(rows))
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * I, *up = gate + I;
        for (int64_t i = 0; i < I; i += 8) {
            const int64_t count = I - i < 8 ? I - i : 8;
            __m256 g = load_at(gate, i, count, 1), e = exp_neg(_mm256_or_ps(g, sign)); /* e^-|g| */
            __m256 top = _mm256_blendv_ps(g, _mm256_mul_ps(g, e), g); /* g e where g is negative */
            float out[8];
            _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_div_ps(top, _mm256_add_ps(one, e)), load_at(up, i, count, 1)));
            memcpy(act + r * I + i, out, sizeof(float) * (size_t)count);
        }
    }
}

/* RMSNorm in float32: y = w (x / sqrt(mean of x^2 + eps)), the sum of squares in eight lanes, then sum8. */
static void rms_f32(const float *x, const float *w, float *y, int64_t rows, int64_t n, float eps, int64_t share)
{
#pragma omp parallel for schedule(static) if (SHARED(rows))
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < n; i += 8) {
            __m256 v = load_at(xr, i, n - i, 1);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float scale = 1.0f / _mm_cvtss_f32(_mm_sqrt_ss(_mm_set_ss(sum8(acc) / (float)n + eps)));
        for (int64_t i = 0; i < n; i++)
            y[r * n + i] = w[i] * (xr[i] * scale);
    }
}

/* A layer's steps between its products in the model's dtype (f32, else bfloat16): the functions above. */
static void norm(const void *x, const void *w, void *y, int64_t rows, int64_t n, float eps, int64_t f32,
                 int64_t share)
{
    if (f32)
        rms_f32(x, w, y, rows, n, eps, share);
    else
        specviz_rms_bf16(x, w, y, (int)rows, (int)n, eps, (int)share);
}

static void attend_any(const void *q, const void *k, const void *v, const uint8_t *mask, void *out,
                       const int64_t *dims, const int64_t *strides, float scale, int64_t f32)
{
    if (f32)
        attend_f32(q, k, v, mask, out, dims, strides, scale);
    else
        specviz_attend_bf16(q, k, v, mask, out, dims, strides, scale);
}

static void add(void *x, const void *y, int64_t n, int64_t f32)
{
    if (f32)
        add_f32(x, y, n);
    else
        add_bf16(x, y, n);
}

static void silu_mul(const void *gate_up, const uint16_t *silu, void *act, int64_t rows, int64_t I, int64_t f32,
                     int64_t share)
{
    if (f32)
        silu_mul_f32(gate_up, act, rows, I, share);
    else
        specviz_silu_mul_bf16(gate_up, silu, act, rows, I, share);
}

/* A bfloat16 model's product on the FMA kernels (paths "avx2" and "avx512", CPUs with no bf16 instructions): x
   widened to float32 (exact), the kernel on the packed bfloat16 weights, each sum (+ bias) rounded to bfloat16,
   which is what kernels._native does around specviz_gemm_bf16 op by op: the same bits, inside one call. */
typedef void (*gemm_bf16_fn)(const float *x, const uint16_t *w, const float *b, float *y, int m, int n, int k);

static void widened(gemm_bf16_fn gemm, const uint16_t *x, const uint16_t *w, const float *b, uint16_t *y, int m,
                    int n, int k)
{
    /* the float32 rows and sums: one buffer per calling thread (ctypes lets Python threads call at once), grown
       to the largest product so far and kept, so a forward's 4 products a layer allocate nothing */
    static __thread float *buffer;
    static __thread size_t held;
    const size_t in = (size_t)m * k, out = (size_t)m * n;
    if (in + out > held) {
        float *grown = realloc(buffer, sizeof(float) * (in + out));
        if (!grown)
            abort(); /* a few MB at most: only where the process has no memory left at all */
        buffer = grown;
        held = in + out;
    }
    float *xf = buffer, *yf = buffer + in;
    for (size_t i = 0; i < in; i++)
        xf[i] = from_bf16(x[i]);
    gemm(xf, w, b, yf, m, n, k);
    for (size_t i = 0; i < out; i++)
        y[i] = to_bf16(yf[i]);
}

void specviz_gemm_widened(const void *x, const void *w, const float *b, void *y, int m, int n, int k)
{
    widened(specviz_gemm_bf16, x, w, b, y, m, n, k);
}

void specviz_gemm512_widened(const void *x, const void *w, const float *b, void *y, int m, int n, int k)
{
    widened(specviz_gemm512_bf16, x, w, b, y, m, n, k);
}

/* A stack of Llama decoder layers in one call (leanllama.LeanLayer.forward, where each product's path is one of
   the kernels above), in bfloat16 the layer-by-layer path's bits (the same functions in the same order); in
   float32 see above. What it saves is the per-operation cost of the path above it: a dozen Python calls and ATen
   operations a layer, a few microseconds each, thirty layers a forward. The EAGLE head's one layer takes it too.
   x: [rows, C] (rows = B t), updated in place. dims, layers: specviz_abi.h (the structures' fields say what
   they hold); caches: per layer keys, values ([B, KV, capacity, D]). cos, sin: [B, t, D]; mask: 1 = the query
   sees the slot; silu: the bfloat16 table (bfloat16 only); scale: the attention's, as the layer-by-layer path
   passes it; scratch: rows (2 C + (H + 2 KV) D + 2 H D + 3 I) numbers of the model's dtype for the intermediate
   results. Returns 0, or -1 without touching anything where dims->size is not this library's. */
int specviz_layers(void *x, const struct specviz_layers_dims *dims, const struct specviz_layer *layers,
                   void *const *caches, const void *cos, const void *sin, const int64_t *slots, const uint8_t *mask,
                   const uint16_t *silu, void *scratch, float eps, float scale)
{
    if (dims->size != (int64_t)sizeof(*dims))
        return -1;
    const int64_t B = dims->batch, T = dims->tokens, C = dims->width, H = dims->heads, KV = dims->kv_heads,
                  D = dims->head_dim, I = dims->inter, capacity = dims->capacity, f32 = dims->f32,
                  share = dims->share, rows = B * T, width = (H + 2 * KV) * D, size = f32 ? 4 : 2;
    char *h = scratch, *qkv = h + rows * C * size, *q = qkv + rows * width * size, *att = q + rows * H * D * size,
         *gu = att + rows * H * D * size, *act = gu + rows * 2 * I * size, *y = act + rows * I * size;
    const int64_t rope_dims[8] = {B, T, H, KV, D, capacity, dims->slots_row, share},
                  attend_dims[6] = {B, H, KV, T, dims->kv_len, D};
    /* strides: q and the output [B, t, H, D] read as [B, H, t, D]; caches [B, KV, capacity, D]; mask as given */
    const int64_t strides[15] = {T * H * D, D, H * D, KV * capacity * D, capacity * D, D, KV * capacity * D,
                                 capacity * D, D, dims->mask_batch, dims->mask_query, dims->mask_slot, T * H * D, D,
                                 H * D};
    for (int64_t l = 0; l < dims->layers; l++) {
        const struct specviz_layer *w = layers + l;
        void *k_cache = caches[2 * l], *v_cache = caches[2 * l + 1];
#define PRODUCT(p, in, out, n, k) w->p.run(in, w->p.weight, w->p.bias, out, (int)rows, (int)(n), (int)(k))
        norm(x, w->norm1, h, rows, C, eps, f32, share);
        PRODUCT(qkv, h, qkv, width, C);
        rope_store(qkv, cos, sin, slots, q, k_cache, v_cache, rope_dims, (int)f32);
        attend_any(q, k_cache, v_cache, mask, att, attend_dims, strides, scale, f32);
        PRODUCT(o, att, y, C, H * D);
        add(x, y, rows * C, f32);
        norm(x, w->norm2, h, rows, C, eps, f32, share);
        PRODUCT(gate_up, h, gu, 2 * I, C);
        silu_mul(gu, silu, act, rows, I, f32, share);
        PRODUCT(down, act, y, C, I);
        add(x, y, rows * C, f32);
#undef PRODUCT
    }
    return 0;
}

/* out[r] = the index of row r's largest value, x [rows, n] float32: torch.argmax's answer (the first of equal
   values; a NaN counts as larger than any number, the first NaN). One pass finds the largest value 8 lanes at a
   time (and whether a NaN is there), a second the first index holding it: ATen's argmax keeps an index per
   element and runs several times slower than a max over a vocabulary's logits. */
void specviz_argmax_f32(const float *x, int64_t rows, int64_t n, int64_t *out)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * n;
        __m256 best = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            __m256 v = _mm256_loadu_ps(row + i);
            best = _mm256_max_ps(best, v);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        float lanes[8], top = -INFINITY;
        int has_nan = _mm256_movemask_ps(nan) != 0;
        _mm256_storeu_ps(lanes, best);
        for (int j = 0; j < 8; j++)
            top = lanes[j] > top ? lanes[j] : top;
        for (; i < n; i++) {
            has_nan |= row[i] != row[i];
            top = row[i] > top ? row[i] : top;
        }
        int64_t at = 0;
        if (has_nan) {
            while (row[at] == row[at])
                at++;
        } else {
            __m256 t = _mm256_set1_ps(top);
            for (i = 0; i + 8 <= n; i += 8) {
                int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i), t, _CMP_EQ_OQ));
                if (hit)
                    break;
            }
            for (at = i; at < n && row[at] != top; at++)
                ;
        }
        out[r] = at;
    }
}

/* Whether a ranks above b: a larger number, or a NaN over a number (torch's order: a NaN is the largest). */
static inline int above(float a, float b)
{
    return a != a ? b == b : a > b;
}

/* The k largest values of each row of x [rows, n] float32 (rows `stride` apart; 1 <= k <= n), largest first, into
   values [rows, k] and index [rows, k]: torch.topk's (a NaN counts as the largest; of equal values the first index
   comes first, where torch leaves the order open). What the inspector lists at each drafted position. A row is
   read once, 8 lanes at a time against the k-th largest so far, and the few values above it go into a sorted list
   of k: ATen's topk over a 49,152-token row costs several times as much. */
void specviz_topk_f32(const float *x, int64_t rows, int64_t n, int64_t stride, int64_t k, float *values,
                      int64_t *index)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * stride;
        float *val = values + r * k;
        int64_t *at = index + r * k, have = 0;
        for (int64_t i = 0; i < n;) {
            int64_t stop = i + 8 <= n ? i + 8 : n;
            if (have == k && stop - i == 8 /* none of 8 above the k-th (NLE_UQ: a NaN is never passed over) */
                && !_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i), _mm256_set1_ps(val[k - 1]),
                                                     _CMP_NLE_UQ))) {
                i = stop;
                continue;
            }
            for (; i < stop; i++) {
                float v = row[i];
                if (have == k && !above(v, val[k - 1]))
                    continue;
                int64_t j = have < k ? have++ : k - 1; /* a full list drops its last */
                for (; j > 0 && above(v, val[j - 1]); j--) {
                    val[j] = val[j - 1];
                    at[j] = at[j - 1];
                }
                val[j] = v;
                at[j] = i;
            }
        }
    }
}

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
