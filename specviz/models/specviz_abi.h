/* The library's interface with native.py, which mirrors these structures with ctypes. native.library() asks
   specviz_abi for the version and the sizes and refuses a library that differs, and specviz_layers checks the
   size its caller wrote into the dims, so a change made on one side only fails loudly instead of reading
   memory at the wrong offsets. Change SPECVIZ_ABI_VERSION (and native.ABI_VERSION) with any change here. */
#ifndef SPECVIZ_ABI_H
#define SPECVIZ_ABI_H
#include <stdint.h>

#define SPECVIZ_ABI_VERSION 1

/* y [m, n] = x [m, k] w^T + b, through the packed weight w, in the model's dtype (specviz_gemm and the others:
   the caller took each from the path this machine chose for it). */
typedef void (*product_fn)(const void *x, const void *w, const float *b, void *y, int m, int n, int k);

struct specviz_product {
    product_fn run;
    const void *weight; /* packed for `run` */
    const float *bias;  /* float32 [n], or NULL */
};

/* One decoder layer's weights for specviz_layers. */
struct specviz_layer {
    const void *norm1, *norm2; /* the RMSNorms' weights, in the model's dtype */
    struct specviz_product qkv, o, gate_up, down;
};

struct specviz_layers_dims {
    int64_t size; /* sizeof(struct specviz_layers_dims), as the caller knows it */
    int64_t layers, batch, tokens, width, heads, kv_heads, head_dim, inter, capacity, kv_len;
    int64_t mask_batch, mask_query, mask_slot; /* the mask's strides, in elements */
    int64_t slots_row;                          /* slots [B, t]: t; slots [t], the same for every row: 0 */
    int64_t f32;                                /* 1: float32, 0: bfloat16 */
    int64_t share;                              /* the row-by-row steps share their rows among threads */
};

struct specviz_abi {
    int64_t version, layers_dims, layer, product; /* SPECVIZ_ABI_VERSION and the structures' sizes */
};

void specviz_abi(struct specviz_abi *out);

#endif
