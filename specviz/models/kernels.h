/* What the kernel files share (internal to the library): includes, the bfloat16 conversions, and the functions
   one file calls in another. Functions not in the interface (specviz_abi.h and the specviz_* entry points
   native.py binds) are hidden, so no other library loaded into the process can take their names' place. */
#ifndef SPECVIZ_KERNELS_H
#define SPECVIZ_KERNELS_H
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))
#define HIDDEN __attribute__((visibility("hidden")))

/* A bfloat16 is the top half of a float32: widening is exact; rounding is to nearest even, as torch rounds. */
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

/* gemm_avx2.c, gemm_avx512.c: the FMA kernels on bfloat16 weights (layers.c widens a bfloat16 model's rows) */
void specviz_gemm_bf16(const float *x, const uint16_t *w, const float *b, float *y, int m, int n, int k_len);
void specviz_gemm512_bf16(const float *x, const uint16_t *w, const float *b, float *y, int m, int n, int k_len);

/* layer_ops.c: a layer's steps between its products in the model's dtype (f32, else bfloat16), for layers.c */
HIDDEN void layer_norm(const void *x, const void *w, void *y, int64_t rows, int64_t n, float eps, int64_t f32,
                       int64_t share);
HIDDEN void layer_rope_store(const void *qkv, const void *cos, const void *sin, const int64_t *slots, void *q_out,
                             void *k_cache, void *v_cache, const int64_t *dims, int f32);
HIDDEN void layer_attend(const void *q, const void *k, const void *v, const uint8_t *mask, void *out,
                         const int64_t *dims, const int64_t *strides, float scale, int64_t f32);
HIDDEN void layer_add(void *x, const void *y, int64_t n, int64_t f32);
HIDDEN void layer_silu_mul(const void *gate_up, const uint16_t *silu, void *act, int64_t rows, int64_t I,
                           int64_t f32, int64_t share);
#endif
