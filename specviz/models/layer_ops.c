/* The steps of a layer between its products, as one C call each where ATen runs several small operations:
   RMSNorm, attention, RoPE with the cache writes and SiLU times up, in bfloat16 with ATen's bits (the entry
   points native.py binds) and in float32 for layers.c; and a greedy round's argmax and the inspector's top-k
   over a vocabulary of logits. Each works row by row, so a row's bits never depend on its neighbours. */
#include <math.h>
#include <stdlib.h>

#include "kernels.h"

/* RMSNorm of bfloat16 rows as transformers' LlamaRMSNorm computes it (leanllama.rms_norm): a row widened
   to float32, times 1 / sqrt(mean of its squares + eps), rounded to bfloat16, times the weight, rounded
   again, each rounding to nearest even as torch rounds. Only the order of the sum of squares differs
   from ATen's. With `share` (and more than one row) the rows are shared among OpenMP threads, which changes no
   row's bits, only the time: a row's arithmetic is small, but inside a forward its numbers arrive from the other
   core's cache (the products share their columns among threads), so whether starting the threads pays depends on
   the machine and the row count, and the caller decides from this machine's timing (native.rms_bf16). */
#define SHARED(rows) (share && (rows) > 1) /* whether the row-by-row functions below share rows among threads */

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

/* Decoder layers in one call (specviz_layers, layers.c): between its products, what leanllama.LeanLayer.forward
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

/* rms_f32 on its own (native.rms_f32: the EAGLE head's norms outside its layer's call, where ATen's float32
   RMSNorm is several operations, each with its threads to start). */
void specviz_rms_f32(const float *x, const float *w, float *y, int64_t rows, int64_t n, float eps, int64_t share)
{
    rms_f32(x, w, y, rows, n, eps, share);
}

/* A layer's steps between its products in the model's dtype (f32, else bfloat16): the functions above. */
void layer_norm(const void *x, const void *w, void *y, int64_t rows, int64_t n, float eps, int64_t f32, int64_t share)
{
    if (f32)
        rms_f32(x, w, y, rows, n, eps, share);
    else
        specviz_rms_bf16(x, w, y, (int)rows, (int)n, eps, (int)share);
}

void layer_attend(const void *q, const void *k, const void *v, const uint8_t *mask, void *out, const int64_t *dims,
                  const int64_t *strides, float scale, int64_t f32)
{
    if (f32)
        attend_f32(q, k, v, mask, out, dims, strides, scale);
    else
        specviz_attend_bf16(q, k, v, mask, out, dims, strides, scale);
}

void layer_add(void *x, const void *y, int64_t n, int64_t f32)
{
    if (f32)
        add_f32(x, y, n);
    else
        add_bf16(x, y, n);
}

void layer_silu_mul(const void *gate_up, const uint16_t *silu, void *act, int64_t rows, int64_t I, int64_t f32,
                    int64_t share)
{
    if (f32)
        silu_mul_f32(gate_up, act, rows, I, share);
    else
        specviz_silu_mul_bf16(gate_up, silu, act, rows, I, share);
}

void layer_rope_store(const void *qkv, const void *cos, const void *sin, const int64_t *slots, void *q_out,
                      void *k_cache, void *v_cache, const int64_t *dims, int f32)
{
    rope_store(qkv, cos, sin, slots, q_out, k_cache, v_cache, dims, f32);
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
