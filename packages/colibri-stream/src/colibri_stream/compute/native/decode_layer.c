/* A decode token's layer of one session, up to and through its routed experts:
 *
 *   colibri_attention_in:  x = rmsnorm(h); q, k, v = x Wq, x Wk, x Wv; q, k normed per head and rotated
 *   colibri_attention_out: h' = h + attn Wo; x' = rmsnorm(h') (the MoE or FFN's input)
 *   colibri_decode_layer_front: both, with the cache write and the attention between them
 *     (attention.c), the row's routing after them, and its experts where all are cached
 *
 * Each step is the kernel the per-module path calls for it (colibri_rms_norm, colibri_q8_quantize
 * once for the three projections that share their input, colibri_q4_matmul or colibri_q8w_matmul,
 * colibri_norm_rope), in the same order, so the results are the same bits; what goes is a dozen
 * Python module calls and torch dispatches per layer. */

#include <stdint.h>
#include <stdlib.h>
#include <time.h>

int colibri_q8_quantize(const float *x, int64_t M, int64_t K, int8_t *xq, float *dx, int32_t *xs, int8_t *pairs,
                        float *pair_scales, int level);
int colibri_q4_matmul(const int8_t *xq, const float *dx, const int32_t *xs, const int8_t *pairs,
                      const float *pair_scales, int64_t M, int64_t K, const uint8_t *packed, const uint16_t *scales,
                      const uint16_t *zeros, int flags, int64_t N, int64_t G, float *y, int threads, int level);
int colibri_q8w_matmul(const int8_t *xq, const float *dx, int64_t M, int64_t K, const int8_t *weights,
                       const uint16_t *scales, int flags, int64_t N, int64_t G, float *y, int threads, int level);
int colibri_rms_norm(const float *x, int64_t D, const float *weight, float eps, float *out);
int colibri_norm_rope(float *x, int64_t heads, int64_t D, const float *weight, float eps, const float *cos,
                      const float *sin);

/* A resident projection as stored (colibri-int4 FORMAT.md): q4 nibbles or q8 bytes [rows, cols],
 * 16-bit scales [rows, cols / group], zeros like the scales or NULL. flags: bit 0 fp16 scales (else
 * bf16), bit 1 a q4 matrix in row tiles (q4_matvec.c's ROW_TILES). */
typedef struct {
    int64_t q8, flags, rows, cols, group;
    const void *data;
    const uint16_t *scales, *zeros;
} colibri_projection;

/* One row x [K] quantized as QuantizedActivations does it */
typedef struct {
    int8_t *q, *pairs;
    float *dx, *pair_scales;
    int32_t *xs;
    void *buffer;
} quantized_row;

static int quantize_row(const float *x, int64_t K, quantized_row *a, int level) {
    int64_t blocks = K / 32;
    int paired = K % 64 == 0;
    a->buffer = malloc((size_t)(2 * K) + sizeof(float) * (size_t)(6 * blocks));
    if (!a->buffer) return -2;
    a->q = (int8_t *)a->buffer;
    a->pairs = paired ? a->q + K : 0;
    a->dx = (float *)(a->q + 2 * K);
    a->xs = (int32_t *)(a->dx + blocks);
    a->pair_scales = paired ? a->dx + 2 * blocks : 0;
    return colibri_q8_quantize(x, 1, K, a->q, a->dx, a->xs, a->pairs, a->pair_scales, level);
}

static int project(const quantized_row *a, const colibri_projection *p, float *y, int threads, int level) {
    if (p->q8)
        return colibri_q8w_matmul(a->q, a->dx, 1, p->cols, (const int8_t *)p->data, p->scales, (int)p->flags, p->rows,
                                  p->group, y, threads, level);
    return colibri_q4_matmul(a->q, a->dx, a->xs, a->pairs, a->pair_scales, 1, p->cols,
                             (const uint8_t *)p->data, p->scales, p->zeros, (int)p->flags, p->rows, p->group, y,
                             threads, level);
}

/* h [D] -> q [heads, head_dim], k and v [kv_heads, head_dim]; projections qkv[0..2] (cols D);
 * q_norm / k_norm: per-head RMSNorm weights [head_dim] or NULL; cos, sin: the position's rows. */
int colibri_attention_in(const float *h, int64_t D, const float *norm, float eps, const colibri_projection *qkv,
                         const float *q_norm, float q_eps, const float *k_norm, float k_eps, const float *cos,
                         const float *sin, int64_t heads, int64_t kv_heads, int64_t head_dim, float *q, float *k,
                         float *v, int threads, int level) {
    if (D % 32) return -1;
    float *x = (float *)malloc(sizeof(float) * (size_t)D);
    if (!x) return -2;
    quantized_row a = {0};
    int status = colibri_rms_norm(h, D, norm, eps, x);
    if (status == 0) status = quantize_row(x, D, &a, level);
    if (status == 0) status = project(&a, &qkv[0], q, threads, level);
    if (status == 0) status = project(&a, &qkv[1], k, threads, level);
    if (status == 0) status = project(&a, &qkv[2], v, threads, level);
    if (status == 0) status = colibri_norm_rope(q, heads, head_dim, q_norm, q_eps, cos, sin);
    if (status == 0) status = colibri_norm_rope(k, kv_heads, head_dim, k_norm, k_eps, cos, sin);
    free(a.buffer);
    free(x);
    return status;
}

/* attn [o.cols] -> h_out [D] = h + attn Wo (each sum rounded to f32, as torch's add), x_out [D] =
 * rmsnorm(h_out) with `norm`. */
int colibri_attention_out(const float *attn, const colibri_projection *o, const float *h, float *h_out,
                          const float *norm, float eps, float *x_out, int threads, int level) {
    if (o->cols % 32) return -1;
    quantized_row a = {0};
    int status = quantize_row(attn, o->cols, &a, level);
    if (status == 0) status = project(&a, o, h_out, threads, level);
    if (status == 0) {
        for (int64_t i = 0; i < o->rows; i++) h_out[i] = h[i] + h_out[i];
        status = colibri_rms_norm(h_out, o->rows, norm, eps, x_out);
    }
    free(a.buffer);
    return status;
}

int colibri_attend_row(const float *q, int64_t heads, int64_t kv_heads, int64_t D, const float *keys,
                       int64_t key_head_stride, int64_t key_col_stride, const float *values,
                       int64_t value_head_stride, int64_t value_col_stride, int64_t S, float scale, float *out,
                       int level, int threads);
int colibri_route_row(const float *x, int64_t D, const float *weight, const float *bias, const float *expert_bias,
                      int64_t E, int64_t k, int softmax, int route_norm, float route_scale, float *scores,
                      int64_t *ids, float *gates);

int colibri_swiglu_rows(const float *gate_up, int64_t M, int64_t F, float *hidden, int level);

/* y [D] = down(silu(gate x) * up x) for one row x [D]: ffn[0..2] = gate, up, down, as the module
 * path (native_decode.py's NativeSwiGLU) computes it: x quantized once for gate and up,
 * colibri_swiglu_rows, the hidden row quantized for down. */
static int swiglu_ffn(const colibri_projection *ffn, const float *x, float *y, int threads, int level) {
    int64_t F = ffn[0].rows;
    float *gate_up = (float *)malloc(sizeof(float) * (size_t)(3 * F));
    if (!gate_up) return -2;
    float *hidden = gate_up + 2 * F;
    quantized_row a = {0}, b = {0};
    int status = quantize_row(x, ffn[0].cols, &a, level);
    if (status == 0) status = project(&a, &ffn[0], gate_up, threads, level);
    if (status == 0) status = project(&a, &ffn[1], gate_up + F, threads, level);
    if (status == 0) status = colibri_swiglu_rows(gate_up, 1, F, hidden, level);
    if (status == 0) status = quantize_row(hidden, F, &b, level);
    if (status == 0) status = project(&b, &ffn[2], y, threads, level);
    free(a.buffer);
    free(b.buffer);
    free(gate_up);
    return status;
}

/* What a layer's FFN is to colibri_decode_layers (colibri_layer_front.ffn_kind) */
enum { FFN_OUTSIDE = 0, FFN_DENSE = 1, FFN_SHARED = 2 };

/* What one layer's decode row needs that does not change from token to token (built once by the
 * caller): its projections and norms, its shape, its buffers, and its router (router_weight NULL:
 * the layer's FFN routes itself, or has no router); ffn_kind with ffn (gate, up, down): FFN_DENSE,
 * the layer's FFN is that swiglu (no router); FFN_SHARED, a shared expert added to the routed
 * experts' sum; FFN_OUTSIDE, neither. Every field 8 bytes wide, as ctypes lays it out. */
typedef struct {
    colibri_projection qkv[3], o, ffn[3];
    int64_t ffn_kind;
    const float *attn_norm, *q_norm, *k_norm, *ffn_norm;
    double attn_eps, q_eps, k_eps, ffn_eps, attention_scale, route_scale;
    int64_t D, heads, kv_heads, head_dim;
    const float *router_weight, *router_bias, *expert_bias;
    int64_t experts, softmax, route_norm;
    float *q, *k, *v, *attended, *scores;
} colibri_layer_front;

int colibri_token_experts(const float *x, int64_t K, int64_t E, const void *const *experts, int flags, int64_t F,
                          int64_t G_gate_up, int64_t G_down, const float *weights, float *out, int threads, int level);
int colibri_q8_token_experts(const float *x, int64_t K, int64_t E, const void *const *experts, int flags, int64_t F,
                             int64_t G_gate_up, int64_t G_down, const float *weights, float *out, int threads,
                             int level);

/* A layer's cached swiglu experts, as colibri_token_experts takes them: entry e's six addresses
 * (gate|up packed, scales, zeros or NULL; down's the same) at entries[6 e .. 6 e + 6), entries[6 e]
 * NULL where expert e is not cached; the shape every one of them has; q8: stored as q8 bytes
 * (colibri_q8_token_experts). */
typedef struct {
    const void *const *entries;
    int64_t expert_dim, group_gate_up, group_down, flags, q8; /* flags: as colibri_projection's */
} colibri_token_table;

/* One decode row of one session through a layer up to its FFN, in one call: colibri_attention_in,
 * the new key and value written at `column` of the session's cache (position s of kv head j at
 * base + j * head_stride + s * col_stride), colibri_attend_row over columns 0..column,
 * colibri_attention_out (h_out, x_out), then colibri_route_row of x_out into ids / gates (top_k)
 * when the layer's router is given and top_k > 0; then, given a table that holds every chosen
 * expert, colibri_token_experts of x_out into experts_out (zeroed first; the chosen experts in
 * ascending order), its time in expert_seconds, and experts_done = 1. The calls the separate path
 * makes, in its order: the same bits. */
int colibri_decode_layer_front(const colibri_layer_front *L, const float *h, const float *cos, const float *sin,
                               float *keys, float *values, int64_t key_head_stride, int64_t key_col_stride,
                               int64_t value_head_stride, int64_t value_col_stride, int64_t column, float *h_out,
                               float *x_out, int64_t top_k, int64_t *ids, float *gates,
                               const colibri_token_table *table, float *experts_out, double *expert_seconds,
                               int *experts_done, int threads, int level) {
    *experts_done = 0;
    int64_t dim = L->head_dim;
    int status = colibri_attention_in(h, L->D, L->attn_norm, (float)L->attn_eps, L->qkv, L->q_norm, (float)L->q_eps,
                                      L->k_norm, (float)L->k_eps, cos, sin, L->heads, L->kv_heads, dim, L->q, L->k,
                                      L->v, threads, level);
    if (status != 0) return status;
    for (int64_t j = 0; j < L->kv_heads; j++)
        for (int64_t d = 0; d < dim; d++) {
            keys[j * key_head_stride + column * key_col_stride + d] = L->k[j * dim + d];
            values[j * value_head_stride + column * value_col_stride + d] = L->v[j * dim + d];
        }
    status = colibri_attend_row(L->q, L->heads, L->kv_heads, dim, keys, key_head_stride, key_col_stride, values,
                                value_head_stride, value_col_stride, column + 1, (float)L->attention_scale,
                                L->attended, level, threads);
    if (status == 0)
        status = colibri_attention_out(L->attended, &L->o, h, h_out, L->ffn_norm, (float)L->ffn_eps, x_out, threads,
                                       level);
    if (status != 0 || !L->router_weight || top_k < 1) return status;
    status = colibri_route_row(x_out, L->D, L->router_weight, L->router_bias, L->expert_bias, L->experts, top_k,
                               (int)L->softmax, (int)L->route_norm, (float)L->route_scale, L->scores, ids, gates);
    if (status != 0 || !table) return status;
    /* the chosen experts in ascending order, as the separate path sums them */
    int64_t order[top_k];
    for (int64_t i = 0; i < top_k; i++) {
        int64_t j = i;
        for (; j > 0 && ids[order[j - 1]] > ids[i]; j--) order[j] = order[j - 1];
        order[j] = i;
    }
    const void *addresses[6 * top_k];
    float weights[top_k];
    for (int64_t i = 0; i < top_k; i++) {
        const void *const *entry = table->entries + 6 * ids[order[i]];
        if (!entry[0]) return 0; /* not cached: the caller fetches it and runs the experts itself */
        for (int r = 0; r < 6; r++) addresses[6 * i + r] = entry[r];
        weights[i] = gates[order[i]];
    }
    for (int64_t d = 0; d < L->D; d++) experts_out[d] = 0.f;
    struct timespec started, stopped;
    clock_gettime(CLOCK_MONOTONIC, &started);
    status = (table->q8 ? colibri_q8_token_experts : colibri_token_experts)(
        x_out, L->D, top_k, addresses, (int)table->flags, table->expert_dim, table->group_gate_up, table->group_down,
        weights, experts_out, threads, level);
    clock_gettime(CLOCK_MONOTONIC, &stopped);
    *expert_seconds = (double)(stopped.tv_sec - started.tv_sec) + 1e-9 * (double)(stopped.tv_nsec - started.tv_nsec);
    *experts_done = status == 0;
    return status;
}

/* One layer of a decode token as colibri_decode_layers runs it: its constants (front; table: its
 * cached experts, NULL where the caller runs them), where this token's key and value go (the
 * session cache's layer: base, strides), this position's rotation rows, its routing's top_k and
 * buffers, and what the call reports back (experts_done, expert_seconds). `finish`: the caller
 * completes the layer even when the call ran its experts (a shared expert to add). Every field
 * 8 bytes wide, as ctypes lays it out. */
typedef struct {
    const colibri_layer_front *front;
    const colibri_token_table *table;
    float *keys, *values;
    int64_t key_head_stride, key_col_stride, value_head_stride, value_col_stride;
    const float *cos, *sin;
    int64_t top_k, finish;
    int64_t *ids;
    float *gates, *experts_out;
    double expert_seconds;
    int64_t experts_done;
} colibri_decode_layer;

/* A decode token of one session through layers[first..count): each layer's
 * colibri_decode_layer_front at cache column `column`, then the layer's output: a dense FFN's
 * (FFN_DENSE) h = h_out + ffn(x_out); where the call ran the routed experts (and the caller need
 * not finish it), h = h_out + experts_out, or h = h_out + (experts_out + shared(x_out)) with a
 * shared expert (FFN_SHARED): each sum one f32 add in the order the module path adds (torch's).
 * h [D] is the input of layer `first` and is updated in place; h_out and x_out [D] take each
 * layer's attention residual and FFN input. *stopped: the layer the caller must finish (its front
 * done: h_out, x_out, ids, gates and experts_done filled; h still its input), or count when every
 * layer ran. */
int colibri_decode_layers(colibri_decode_layer *layers, int64_t first, int64_t count, int64_t column, float *h,
                          float *h_out, float *x_out, int64_t *stopped, int threads, int level) {
    float *ffn_out = 0;
    int status = 0;
    int64_t i = first;
    for (; i < count; i++) {
        colibri_decode_layer *L = &layers[i];
        const colibri_layer_front *front = L->front;
        int done = 0;
        L->experts_done = 0;
        status = colibri_decode_layer_front(front, h, L->cos, L->sin, L->keys, L->values, L->key_head_stride,
                                            L->key_col_stride, L->value_head_stride, L->value_col_stride, column,
                                            h_out, x_out, L->top_k, L->ids, L->gates, L->table, L->experts_out,
                                            &L->expert_seconds, &done, threads, level);
        if (status != 0) break;
        L->experts_done = done;
        int dense = front->ffn_kind == FFN_DENSE;
        if (!dense && (!done || L->finish)) break; /* the caller finishes this layer */
        int64_t D = front->D;
        if (dense || front->ffn_kind == FFN_SHARED) {
            if (!ffn_out && !(ffn_out = (float *)malloc(sizeof(float) * (size_t)D))) {
                status = -2;
                break;
            }
            status = swiglu_ffn(front->ffn, x_out, ffn_out, threads, level);
            if (status != 0) break;
            if (dense)
                for (int64_t d = 0; d < D; d++) h[d] = h_out[d] + ffn_out[d];
            else
                for (int64_t d = 0; d < D; d++) h[d] = h_out[d] + (L->experts_out[d] + ffn_out[d]);
        } else {
            for (int64_t d = 0; d < D; d++) h[d] = h_out[d] + L->experts_out[d];
        }
    }
    *stopped = i;
    free(ffn_out);
    return status;
}
