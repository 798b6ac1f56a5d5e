/* Decoder layers in one call (specviz_layers) and the library's interface check (specviz_abi). */
#include <stdlib.h>

#include "kernels.h"
#include "specviz_abi.h"

void specviz_abi(struct specviz_abi *out)
{
    out->version = SPECVIZ_ABI_VERSION;
    out->layers_dims = sizeof(struct specviz_layers_dims);
    out->layer = sizeof(struct specviz_layer);
    out->product = sizeof(struct specviz_product);
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
   one of the GEMM kernels), in bfloat16 the layer-by-layer path's bits (the same functions in the same order); in
   float32 see layer_ops.c. What it saves is the per-operation cost of the layer-by-layer path: a dozen Python calls
   and ATen operations a layer, a few microseconds each, thirty layers a forward. The EAGLE head's one layer takes
   it too.
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
        layer_norm(x, w->norm1, h, rows, C, eps, f32, share);
        PRODUCT(qkv, h, qkv, width, C);
        layer_rope_store(qkv, cos, sin, slots, q, k_cache, v_cache, rope_dims, (int)f32);
        layer_attend(q, k_cache, v_cache, mask, att, attend_dims, strides, scale, f32);
        PRODUCT(o, att, y, C, H * D);
        layer_add(x, y, rows * C, f32);
        layer_norm(x, w->norm2, h, rows, C, eps, f32, share);
        PRODUCT(gate_up, h, gu, 2 * I, C);
        layer_silu_mul(gu, silu, act, rows, I, f32, share);
        PRODUCT(down, act, y, C, I);
        layer_add(x, y, rows * C, f32);
#undef PRODUCT
    }
    return 0;
}
