/* A Llama-family decoder stack in one call: every layer's norm, matmuls, rotary, K/V write, paged
 * attention and MLP (or a MoE layer's router, routing and experts), in the order and with the very
 * kernels the Python modules call one by one (cpu_ops.c, moe_route.c, and the GGUF block kernels of
 * the quant library through function pointers), so the result is bit for bit the module path's.
 * What it saves is the Python between the kernels: about a dozen calls per layer, ~100 us of
 * interpreter and ctypes work per layer, more than the layer's kernels take on a small model
 * (shardserve/kernels/cpu/decoder_stack.py has the Python side).
 *
 * Linked into the cpu_ops library (same flags: AVX2 + FMA).
 */
#include <stdint.h>
#include <string.h>

/* cpu_ops.c */
void linear_packed(const float *x, int64_t ldx, const void *wp, int wbf16, const float *bias, float *y, int64_t ldy,
                   int64_t M, int64_t N, int64_t K);
void write_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride, void *k_cache, void *v_cache,
              int kv_kind, const int64_t *slots, int64_t T, int64_t Hk, int64_t D, int64_t pool_slots,
              float k_scale, float v_scale);
void paged_attention(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache, int kv_kind,
                     const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens, float *out,
                     int64_t out_stride, int64_t B, int64_t Hq, int64_t Hk, int64_t D, int64_t block_size,
                     int64_t pool_slots, float scale, int64_t window, float k_scale, float v_scale);
void rms_norm(const float *x, float *residual, const float *weight, float *out, int64_t T, int64_t H, float eps);
void rms_norm_heads(const float *x, int64_t stride, float *out, int64_t out_stride, const float *weight, int64_t T,
                    int64_t heads, int64_t D, float eps);
void silu_and_mul(const float *x, float *out, int64_t T, int64_t d);
void rotary_neox(const int64_t *positions, float *q, int64_t q_stride, int64_t Hq, float *k, int64_t k_stride,
                 int64_t Hk, const float *cos_table, const float *sin_table, int64_t T, int64_t D);

/* moe_route.c: a MoE layer's softmax, top-k and renormalisation with torch's bits (its RouteFns). */
typedef struct {
    void *exp;
    int64_t lanes;
    void *topk;
} RouteFns;
void moe_route(const RouteFns *f, float *logits, int64_t T, int64_t E, int64_t k, int renormalize, float *weights,
               int64_t *ids, float *tmp);

/* The quant library's GGUF kernels (quant_dot.c's gguf_linear_q8, quant_ops.c's gguf_linear, and
 * gguf_moe_q8 for a MoE layer's picked experts). */
typedef int (*gguf_int8_fn)(int isa, int type, int levels, int gated, const float *x, int64_t ldx, const void *w,
                            const float *bias, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K);
typedef int (*gguf_fp32_fn)(int isa, int type, const float *x, int64_t ldx, const void *w, int64_t row_bytes,
                            const float *bias, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K);
typedef int (*gguf_moe_fn)(int isa, int type13, int type2, int levels, const float *x, int64_t T, int64_t H,
                           int64_t I, const int64_t *ids, const float *weights, int64_t top_k, const void *w13,
                           int64_t w13_bytes, const void *w2, int64_t w2_bytes, float *y);

enum { STACK_PANELS = 0, STACK_GGUF_INT8 = 1, STACK_GGUF_FP32 = 2 };

/* One matmul y = x W^T (+ bias). Field order and types mirror decoder_stack.py's ctypes structures.
 * A fused layer whose parts differ in GGUF type (Q4_K_M's v in Q6_K) is a chain of parts through
 * `next`, each writing its n columns from column `col` of the one output. */
typedef struct StackLinear {
    int64_t kind;           /* STACK_* */
    const void *w;          /* panels (cpu_ops.pack_weight) or GGUF blocks as the kernel takes them */
    const float *bias;      /* fp32 [n] or NULL */
    void *fn;               /* the GGUF kernel */
    int64_t n, k;           /* output and input features (gated: n = gate + up rows, the output n / 2) */
    int64_t wbf16;          /* panels of bf16 (1) or fp32 (0) values */
    int64_t isa, type, levels, gated, row_bytes;   /* GGUF: the kernel's arguments */
    int64_t col;                            /* the first output column this part writes */
    const struct StackLinear *next;         /* the layer's next part, or NULL */
} StackLinear;

/* A MoE layer's sparse MLP on one rank (layers/moe.py's SparseMoeBlock): the router, the routing,
 * and the experts, kept in GGUF blocks and run by gguf_moe_q8 (as torch_moe.fused_moe calls it). */
typedef struct {
    StackLinear router;                     /* hidden -> one logit per expert */
    int64_t experts, top_k, renormalize;
    void *fn;                               /* gguf_moe_q8 */
    const void *w13, *w2;                   /* every expert's [gate; up] and down, as it takes them */
    int64_t w13_bytes, w2_bytes;            /* one expert's */
    int64_t inter, isa, type13, type2, levels;
} StackMoe;

typedef struct {
    const float *ln1, *ln2;                 /* input_layernorm, post_attention_layernorm weights */
    const float *q_norm, *k_norm;           /* per-head q and k norm weights [D] (Qwen3), or NULL */
    StackLinear qkv, o, gate_up, down;      /* gate_up, down: the dense MLP's (unused with moe) */
    void *k_cache, *v_cache;                /* [Hk, blocks, block_size, D] each */
    int64_t window;                         /* sliding window (0: none) */
    float k_scale, v_scale;                 /* an fp8 pool's scales */
    const StackMoe *moe;                    /* the sparse MLP in place of the dense one, or NULL */
} StackLayer;

typedef struct {
    int64_t layers, hidden, hq, hk, head_dim, inter, kv_kind, block_size, pool_slots;
    float eps, scale;
    const float *cos, *sin;                 /* [max_position, D / 2] */
    const StackLayer *layer;
    int64_t experts, top_k;                 /* the most of any MoE layer (0: none), for the scratch */
    RouteFns route;                         /* for MoE layers */
} StackModel;

/* y[M, n] (row stride ldy) = x[M, k] W^T (+ bias); gated: y[M, n / 2] = silu(x W_gate^T) * (x W_up^T). */
static int matmul_part(const StackLinear *l, const float *x, float *y, int64_t ldy, int64_t M) {
    switch (l->kind) {
    case STACK_PANELS:
        linear_packed(x, l->k, l->w, (int)l->wbf16, l->bias, y, ldy, M, l->n, l->k);
        return 0;
    case STACK_GGUF_INT8:
        return ((gguf_int8_fn)l->fn)((int)l->isa, (int)l->type, (int)l->levels, (int)l->gated, x, l->k, l->w,
                                     l->bias, y, ldy, M, l->n, l->k);
    case STACK_GGUF_FP32:
        return ((gguf_fp32_fn)l->fn)((int)l->isa, (int)l->type, x, l->k, l->w, l->row_bytes, l->bias, y, ldy, M,
                                     l->n, l->k);
    }
    return -1;
}

/* Every part of a layer in turn (one call each, as quantization/gguf.py's apply makes them), each
 * into its columns of y. */
static int matmul(const StackLinear *l, const float *x, float *y, int64_t ldy, int64_t M) {
    for (; l; l = l->next) {
        const int rc = matmul_part(l, x, y + l->col, ldy, M);
        if (rc)
            return rc;
    }
    return 0;
}

/* hidden[T, H] = the sparse MLP of h[T, H], as SparseMoeBlock.forward computes it: the router's
 * logits, the routing (moe_route.c: torch's bits), every pick in one gguf_moe_q8 call. Scratch:
 * logits [T, E], weights [T, k], ids [T, k], tmp [E]. Returns 0 or the kernels' error code. */
static int sparse_mlp(const StackModel *m, const StackMoe *e, const float *h, float *hidden, int64_t T,
                      float *logits, float *weights, int64_t *ids, float *tmp) {
    int rc = matmul(&e->router, h, logits, e->experts, T);
    if (rc)
        return rc;
    moe_route(&m->route, logits, T, e->experts, e->top_k, (int)e->renormalize, weights, ids, tmp);
    return ((gguf_moe_fn)e->fn)((int)e->isa, (int)e->type13, (int)e->type2, (int)e->levels, h, T, m->hidden,
                                e->inter, ids, weights, e->top_k, e->w13, e->w13_bytes, e->w2, e->w2_bytes, hidden);
}

/* Runs every layer of `m` on T tokens. hidden [T, H] holds the layer input and receives the last
 * layer's output (its MLP's, before the residual add, as LlamaDecoderLayer returns it); residual
 * [T, H] is the running residual, which the first layer starts from hidden when has_residual is 0.
 * positions / slots [T] int64, block_tables [T, bt_stride] and seq_lens [T] int32 are the native
 * attention backend's per-token metadata. scratch: DecoderStack.scratch_floats(T) floats
 * (decoder_stack.py).
 * Returns 0, or a GGUF kernel's error code. */
int decoder_stack(const StackModel *m, int64_t T, float *hidden, float *residual, int has_residual,
                  const int64_t *positions, const int64_t *slots, const int32_t *block_tables, int64_t bt_stride,
                  const int32_t *seq_lens, float *scratch) {
    const int64_t H = m->hidden, D = m->head_dim, Hq = m->hq, Hk = m->hk, I = m->inter, E = m->experts;
    const int64_t W = (Hq + 2 * Hk) * D;   /* a qkv row */
    int64_t *ids = (int64_t *)scratch;     /* first: 8-byte aligned */
    float *h = scratch + 2 * T * m->top_k, *qkv = h + T * H, *attn = qkv + T * W, *act = attn + T * Hq * D;
    float *gate_up = act + T * I, *logits = gate_up + 2 * T * I, *weights = logits + T * E;
    float *tmp = weights + T * m->top_k;
    for (int64_t i = 0; i < m->layers; i++) {
        const StackLayer *L = m->layer + i;
        if (i == 0 && !has_residual) {
            memcpy(residual, hidden, sizeof(float) * T * H);
            rms_norm(hidden, 0, L->ln1, h, T, H, m->eps);
        } else {
            rms_norm(hidden, residual, L->ln1, h, T, H, m->eps);
        }
        int rc = matmul(&L->qkv, h, qkv, W, T);
        if (rc)
            return rc;
        float *q = qkv, *k = qkv + Hq * D, *v = k + Hk * D;
        if (L->q_norm) {   /* in place: the modules write a copy, with the same values */
            rms_norm_heads(q, W, q, W, L->q_norm, T, Hq, D, m->eps);
            rms_norm_heads(k, W, k, W, L->k_norm, T, Hk, D, m->eps);
        }
        rotary_neox(positions, q, W, Hq, k, W, Hk, m->cos, m->sin, T, D);
        write_kv(k, W, v, W, L->k_cache, L->v_cache, (int)m->kv_kind, slots, T, Hk, D, m->pool_slots, L->k_scale,
                 L->v_scale);
        paged_attention(q, W, L->k_cache, L->v_cache, (int)m->kv_kind, block_tables, bt_stride, seq_lens, attn, Hq * D,
                        T, Hq, Hk, D, m->block_size, m->pool_slots, m->scale, L->window, L->k_scale, L->v_scale);
        if ((rc = matmul(&L->o, attn, hidden, H, T)))
            return rc;
        rms_norm(hidden, residual, L->ln2, h, T, H, m->eps);
        if (L->moe) {
            if ((rc = sparse_mlp(m, L->moe, h, hidden, T, logits, weights, ids, tmp)))
                return rc;
            continue;
        }
        if (L->gate_up.gated) {
            rc = matmul(&L->gate_up, h, act, I, T);
        } else {
            rc = matmul(&L->gate_up, h, gate_up, 2 * I, T);
            silu_and_mul(gate_up, act, T, I);
        }
        if (rc || (rc = matmul(&L->down, act, hidden, H, T)))
            return rc;
    }
    return 0;
}
