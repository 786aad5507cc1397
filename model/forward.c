/*
 * forward.c - the transformer forward pass as per-layer steps over batches of tokens, one code
 * path for every architecture of model.h (pdm_model_arch_t): the hyperparameters and the
 * optional tensors a layer has (biases, Q/K norms, post norms) switch the few points where
 * they differ, after llama.cpp's graphs (src/models/{llama,qwen2,qwen3,gemma3}.cpp):
 *
 *   x = embed(token) * embd_scale                                   (gemma3: sqrt(d_model))
 *   per layer:
 *     n = rmsnorm(x, attn_norm)
 *     q, k, v = Wq n (+ bq), Wk n (+ bk), Wv n (+ bv)                 (biases: qwen2)
 *     q, k = rmsnorm per head (q_norm, k_norm)                        (qwen3, gemma3)
 *     q, k = rope(q, k, layer's base and scale, NORM or NEOX pairs, rope_freqs)
 *     o = softmax(attn_scale q.k + causal/sliding-window mask) v      (window: local layers)
 *     a = Wo o; a = rmsnorm(a, attn_post_norm)                        (post norms: gemma3)
 *     x = x + a
 *     n = rmsnorm(x, ffn_norm)
 *     f = W_down (act(W_gate n) * W_up n); f = rmsnorm(f, ffn_post_norm)
 *     x = x + f                                          (act: SiLU, gemma3 GELU-tanh)
 *   logits = W_out rmsnorm(x, output_norm); cap * tanh(logits / cap)  (if softcapping)
 *
 * Every step splits its work over the context's thread pool: matrix products by output rows
 * (several matrices that share an input, Q/K/V or gate/up, in one dispatch), attention by
 * (head, block of query rows), elementwise ops by token. Scratch comes from buffers sized once
 * at context creation; the steps themselves never allocate.
 */
#include "model.h"
#include "model_internal.h"

#include <assert.h>
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#define PDM__ATTN_QBLOCK 16 /* query rows per attention work item */

struct pdm_model_ctx {
    const pdm_model_t *model;
    const pdm_kern_ops_t *ops;
    pdm_kern_pool_t *pool;
    int max_batch;
    float *xn;       /* [max_batch][d_model] normalised residual */
    float *tmp;      /* [max_batch][d_model] projection output */
    float *gate;     /* [max_batch][n_ff] */
    float *up;       /* [max_batch][n_ff] */
    void *act;       /* converted activations for the widest matrix input, max_batch rows */
    float *partial;  /* [n_threads][PDM__ATTN_QBLOCK][head_dim + 1] attention partials */
    float *split;    /* decode: [n_kv_heads][2 * n_threads][group][head_dim + 1] partials of
                      * the KV ranges, merged after the parallel step */
    int n_threads;
    int split_single; /* pdm_model_ctx_set_split_single */
    pdm_act_t batch; /* activations used by pdm_model_prefill */
};

void pdm_model_ctx_set_split_single(pdm_model_ctx_t *ctx, int on) { ctx->split_single = on != 0; }

int pdm_act_alloc(const pdm_model_hparams_t *hp, int n, pdm_act_t *act)
{
    memset(act, 0, sizeof(*act));
    size_t qdim = (size_t)hp->n_heads * hp->head_dim;
    size_t kvdim = (size_t)hp->n_kv_heads * hp->head_dim;
    act->pos = malloc((size_t)n * sizeof(int32_t));
    act->x = malloc((size_t)n * hp->d_model * sizeof(float));
    act->q = malloc((size_t)n * qdim * sizeof(float));
    act->k = malloc((size_t)n * kvdim * sizeof(float));
    act->v = malloc((size_t)n * kvdim * sizeof(float));
    act->o = malloc((size_t)n * qdim * sizeof(float));
    act->lse = malloc((size_t)n * hp->n_heads * sizeof(float));
    if (!act->pos || !act->x || !act->q || !act->k || !act->v || !act->o || !act->lse) {
        pdm_act_free(act);
        return pdm_error_set(PDM_ENOMEM, "cannot allocate activations for %d tokens", n);
    }
    return PDM_OK;
}

void pdm_act_free(pdm_act_t *act)
{
    if (!act) return;
    free(act->pos);
    free(act->x);
    free(act->q);
    free(act->k);
    free(act->v);
    free(act->o);
    free(act->lse);
    memset(act, 0, sizeof(*act));
}

int pdm_model_ctx_create(const pdm_model_t *model, int n_threads, int max_batch,
                         pdm_model_ctx_t **out)
{
    const pdm_model_hparams_t *hp = &model->hp;
    if (n_threads < 1 || n_threads > 256 || max_batch < 1 || max_batch > 65536)
        return pdm_error_set(PDM_EINVAL, "invalid thread count %d or batch size %d", n_threads,
                             max_batch);
    pdm_model_ctx_t *ctx = calloc(1, sizeof(*ctx));
    if (!ctx) return pdm_error_set(PDM_ENOMEM, "out of memory");
    ctx->model = model;
    ctx->ops = pdm_kern_ops_get();
    ctx->max_batch = max_batch;
    ctx->pool = pdm_kern_pool_create(n_threads);
    if (!ctx->pool) {
        free(ctx);
        return pdm_error_set(PDM_ENOMEM, "cannot start %d threads", n_threads);
    }
    size_t b = (size_t)max_batch;
    size_t widest = PDM_MAX(hp->d_model, PDM_MAX(hp->n_ff, hp->n_heads * hp->head_dim));
    /* Q8_1 is the largest activation encoding (40 bytes per 32 values); f32 needs none. */
    size_t act_bytes = pdm_dtype_row_bytes(PDM_DT_Q8_1, (int64_t)((widest + 31) / 32 * 32)) * b;
    ctx->xn = malloc(b * hp->d_model * sizeof(float));
    ctx->tmp = malloc(b * hp->d_model * sizeof(float));
    ctx->gate = malloc(b * hp->n_ff * sizeof(float));
    ctx->up = malloc(b * hp->n_ff * sizeof(float));
    ctx->act = malloc(act_bytes);
    ctx->partial = malloc((size_t)n_threads * PDM__ATTN_QBLOCK * (hp->head_dim + 1) *
                          sizeof(float));
    ctx->n_threads = n_threads;
    ctx->split_single = 1;
    ctx->split = malloc((size_t)hp->n_heads * 2 * n_threads * (hp->head_dim + 1) * sizeof(float));
    if (!ctx->xn || !ctx->tmp || !ctx->gate || !ctx->up || !ctx->act || !ctx->partial ||
        !ctx->split ||
        pdm_act_alloc(hp, max_batch, &ctx->batch) != PDM_OK) {
        pdm_model_ctx_destroy(ctx);
        return pdm_error_set(PDM_ENOMEM, "cannot allocate scratch for batches of %d", max_batch);
    }
    *out = ctx;
    return PDM_OK;
}

void pdm_model_ctx_destroy(pdm_model_ctx_t *ctx)
{
    if (!ctx) return;
    pdm_kern_pool_destroy(ctx->pool);
    free(ctx->xn);
    free(ctx->tmp);
    free(ctx->gate);
    free(ctx->up);
    free(ctx->act);
    free(ctx->partial);
    free(ctx->split);
    pdm_act_free(&ctx->batch);
    free(ctx);
}

const pdm_model_t *pdm_model_ctx_model(const pdm_model_ctx_t *ctx)
{
    return ctx->model;
}

int pdm_model_ctx_max_batch(const pdm_model_ctx_t *ctx) { return ctx->max_batch; }
const pdm_kern_ops_t *pdm_model_ctx_ops(const pdm_model_ctx_t *ctx) { return ctx->ops; }
pdm_kern_pool_t *pdm_model_ctx_pool(const pdm_model_ctx_t *ctx) { return ctx->pool; }

void pdm_model_ctx_set_ops(pdm_model_ctx_t *ctx, const pdm_kern_ops_t *ops)
{
    ctx->ops = ops ? ops : pdm_kern_ops_get();
}

/* ---- Matrix products --------------------------------------------------------------------- */

/* Runs a per-token step on the pool, or inline on the calling thread for a single token:
 * there the work (a norm, a rotation, a few hundred additions) is smaller than waking the
 * other threads and waiting for them, and a decode step has a dozen such steps per layer. */
static void pdm__run_tokens(pdm_model_ctx_t *ctx, int n_tokens, pdm_kern_task_cb cb, void *arg)
{
    if (n_tokens <= 1) cb(arg, 0, 1);
    else pdm_kern_pool_run(ctx->pool, cb, arg);
}

/* Up to three matrices with the same input and weight type, computed in one dispatch. */
typedef struct {
    const pdm_kern_ops_t *ops;
    const pdm_kern_mat_t *w[3];
    float *y[3];
    int n_w;
    const float *x;
    int n;
    void *act;
    atomic_llong next; /* next unclaimed chunk of output rows */
} pdm__mm_task_t;

/* Output rows per claimed chunk: small enough that a thread slowed down by another process
 * on its core leaves the rest to the others, large enough to amortise the atomic. */
#define PDM__MM_CHUNK 32

static void pdm__mm_convert(void *arg, int ith, int nth)
{
    pdm__mm_task_t *t = arg;
    int64_t b, e;
    pdm_kern_split(t->n, ith, nth, 1, &b, &e);
    if (b < e) t->ops->act_convert(t->w[0]->type, t->x, t->w[0]->cols, (int)b, (int)e, t->act);
}

/* Threads claim chunks of PDM__MM_CHUNK output rows (of the concatenated matrices) from an
 * atomic counter, so the split follows each thread's actual speed. Each row's result does not
 * depend on which thread computes it. */
static void pdm__mm_rows(void *arg, int ith, int nth)
{
    (void)ith;
    (void)nth;
    pdm__mm_task_t *t = arg;
    int64_t total = 0;
    for (int i = 0; i < t->n_w; i++) total += t->w[i]->rows;
    const void *act = t->act ? t->act : (const void *)t->x;
    for (;;) {
        int64_t b = atomic_fetch_add_explicit(&t->next, 1, memory_order_relaxed) * PDM__MM_CHUNK;
        if (b >= total) break;
        int64_t e = PDM_MIN(total, b + PDM__MM_CHUNK), base = 0;
        for (int i = 0; i < t->n_w && b < e; i++) {
            int64_t rows = t->w[i]->rows;
            int64_t lo = PDM_MAX(b, base) - base, hi = PDM_MIN(e, base + rows) - base;
            if (lo < hi) t->ops->matmul(t->w[i], act, t->n, t->y[i], rows, lo, hi);
            base += rows;
        }
    }
}

/* A single token's product with fewer weights than this (all matrices of the dispatch) runs
 * on the calling thread: a few hundred of them make a decode step, and for small ones waking
 * the pool and waiting for it costs more than the second core saves. Measured with
 * pdm-engine-bench at 2 threads on a 2-vCPU AMD EPYC (2026-11-24): SmolLM2-135M (every layer
 * matrix under 1 M weights) 162-170 -> 193-210 tokens/s, the 1-thread speed; Gemma 3 270M
 * and the 1B-shaped model unchanged within noise. The split never changes a result: each
 * row's value is the same whichever thread computes it. */
#define PDM__MM_SERIAL_WEIGHTS ((int64_t)3 << 20)

/* y_i[t][:] = W_i x[t] for i < n_w, t < n. All W_i share cols and type. */
static void pdm__matmul(pdm_model_ctx_t *ctx, const float *x, int n, int n_w,
                        const pdm_kern_mat_t *w0, float *y0, const pdm_kern_mat_t *w1,
                        float *y1, const pdm_kern_mat_t *w2, float *y2)
{
    pdm__mm_task_t t = {.ops = ctx->ops, .w = {w0, w1, w2}, .y = {y0, y1, y2}, .n_w = n_w,
                        .x = x, .n = n, .act = NULL};
    atomic_init(&t.next, 0);
    if (ctx->ops->act_bytes(w0->type, w0->cols, n) > 0) {
        t.act = ctx->act;
        pdm__run_tokens(ctx, n, pdm__mm_convert, &t);
    }
    int64_t weights = 0;
    for (int i = 0; i < n_w; i++) weights += t.w[i]->rows * t.w[i]->cols;
    if (n == 1 && weights < PDM__MM_SERIAL_WEIGHTS) pdm__mm_rows(&t, 0, 1);
    else pdm_kern_pool_run(ctx->pool, pdm__mm_rows, &t);
}

/* ---- Elementwise steps, parallel over tokens ------------------------------------------- */

typedef struct {
    pdm_model_ctx_t *ctx;
    pdm_act_t *act;
    const float *norm_w;
    int layer;
} pdm__tok_task_t;

static void pdm__norm_task(void *arg, int ith, int nth)
{
    pdm__tok_task_t *t = arg;
    const pdm_model_hparams_t *hp = &t->ctx->model->hp;
    int64_t b, e;
    pdm_kern_split(t->act->n, ith, nth, 1, &b, &e);
    for (int64_t i = b; i < e; i++)
        t->ctx->ops->rmsnorm(t->ctx->xn + i * hp->d_model, t->act->x + i * hp->d_model,
                             t->norm_w, (int)hp->d_model, hp->rms_eps);
}

static void pdm__add_bias(float *x, const float *bias, size_t n)
{
    if (bias)
        for (size_t j = 0; j < n; j++) x[j] += bias[j];
}

/* RMSNorm of each of n_heads heads of x in place (weights over head_dim), if w is set. */
static void pdm__head_norm(const pdm_kern_ops_t *ops, float *x, const float *w, int n_heads,
                           int head_dim, float eps)
{
    if (!w) return;
    for (int h = 0; h < n_heads; h++) {
        float *v = x + (size_t)h * head_dim;
        ops->rmsnorm(v, v, w, head_dim, eps);
    }
}

/* Per token, after the Q/K/V products: biases, per-head Q/K norms, RoPE at the token's
 * position with the layer's frequency base and scaling. */
static void pdm__qk_task(void *arg, int ith, int nth)
{
    pdm__tok_task_t *t = arg;
    const pdm_model_t *m = t->ctx->model;
    const pdm_model_hparams_t *hp = &m->hp;
    const pdm_model_layer_t *L = &m->layers[t->layer];
    const pdm_kern_ops_t *ops = t->ctx->ops;
    const int hd = (int)hp->head_dim;
    const pdm_kern_rope_t rope = {.theta = L->rope_theta, .freq_scale = L->rope_freq_scale,
                                  .freq_factors = m->rope_freqs, .neox = hp->rope_neox};
    const int plain_rope = !rope.neox && !rope.freq_factors && rope.freq_scale == 1.0f;
    int64_t b, e;
    pdm_kern_split(t->act->n, ith, nth, 1, &b, &e);
    size_t qdim = (size_t)hp->n_heads * hd, kvdim = (size_t)hp->n_kv_heads * hd;
    for (int64_t i = b; i < e; i++) {
        float *q = t->act->q + i * qdim, *k = t->act->k + i * kvdim;
        pdm__add_bias(q, L->bq, qdim);
        pdm__add_bias(k, L->bk, kvdim);
        pdm__add_bias(t->act->v + i * kvdim, L->bv, kvdim);
        pdm__head_norm(ops, q, L->q_norm, (int)hp->n_heads, hd, hp->rms_eps);
        pdm__head_norm(ops, k, L->k_norm, (int)hp->n_kv_heads, hd, hp->rms_eps);
        if (plain_rope) { /* the original op (Llama 2 / SmolLM), kept for its SIMD variants */
            ops->rope(q, (int)hp->n_heads, hd, t->act->pos[i], rope.theta);
            ops->rope(k, (int)hp->n_kv_heads, hd, t->act->pos[i], rope.theta);
        } else {
            ops->rope_ext(q, (int)hp->n_heads, hd, t->act->pos[i], &rope);
            ops->rope_ext(k, (int)hp->n_kv_heads, hd, t->act->pos[i], &rope);
        }
    }
}

/* tmp = rmsnorm(tmp, norm_w) per token (the post norms of Gemma 3) */
static void pdm__post_norm_task(void *arg, int ith, int nth)
{
    pdm__tok_task_t *t = arg;
    const pdm_model_hparams_t *hp = &t->ctx->model->hp;
    int64_t b, e;
    pdm_kern_split(t->act->n, ith, nth, 1, &b, &e);
    for (int64_t i = b; i < e; i++) {
        float *row = t->ctx->tmp + i * hp->d_model;
        t->ctx->ops->rmsnorm(row, row, t->norm_w, (int)hp->d_model, hp->rms_eps);
    }
}

/* x += tmp (after the attention output projection) */
static void pdm__residual_task(void *arg, int ith, int nth)
{
    pdm__tok_task_t *t = arg;
    size_t d = t->ctx->model->hp.d_model;
    int64_t b, e;
    pdm_kern_split((int64_t)t->act->n * (int64_t)d, ith, nth, 64, &b, &e);
    for (int64_t i = b; i < e; i++) t->act->x[i] += t->ctx->tmp[i];
}

static void pdm__swiglu_task(void *arg, int ith, int nth)
{
    pdm__tok_task_t *t = arg;
    size_t f = t->ctx->model->hp.n_ff;
    int64_t b, e;
    pdm_kern_split(t->act->n, ith, nth, 1, &b, &e);
    const int gelu = t->ctx->model->hp.ffn_gelu;
    for (int64_t i = b; i < e; i++) {
        if (gelu)
            t->ctx->ops->geglu(t->ctx->gate + i * f, t->ctx->gate + i * f, t->ctx->up + i * f,
                               (int)f);
        else
            t->ctx->ops->swiglu(t->ctx->gate + i * f, t->ctx->gate + i * f, t->ctx->up + i * f,
                                (int)f);
    }
}

int pdm_model_embed(pdm_model_ctx_t *ctx, const int32_t *tokens, const int32_t *positions,
                    int n, pdm_act_t *act)
{
    const pdm_model_t *m = ctx->model;
    if (n < 0 || n > ctx->max_batch)
        return pdm_error_set(PDM_EINVAL, "batch of %d tokens exceeds the context's %d", n,
                             ctx->max_batch);
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || (uint32_t)tokens[i] >= m->hp.n_vocab)
            return pdm_error_set(PDM_ERANGE, "token id %d is outside the vocabulary (0..%u)",
                                 tokens[i], m->hp.n_vocab - 1);
    for (int i = 0; i < n; i++) {
        float *x = act->x + (size_t)i * m->hp.d_model;
        pdm_kern_mat_dequantize_row(&m->tok_embd, tokens[i], x); /* any layout (tied output) */
        if (m->hp.embd_scale != 1.0f)
            for (uint32_t j = 0; j < m->hp.d_model; j++) x[j] *= m->hp.embd_scale;
        act->pos[i] = positions[i];
    }
    act->n = n;
    return PDM_OK;
}

void pdm_model_attn_in(pdm_model_ctx_t *ctx, int layer, pdm_act_t *act)
{
    const pdm_model_layer_t *L = &ctx->model->layers[layer];
    pdm__tok_task_t t = {.ctx = ctx, .act = act, .norm_w = L->attn_norm, .layer = layer};
    pdm__run_tokens(ctx, act->n, pdm__norm_task, &t);
    if (L->wq.type == L->wk.type && L->wq.type == L->wv.type) {
        pdm__matmul(ctx, ctx->xn, act->n, 3, &L->wq, act->q, &L->wk, act->k, &L->wv, act->v);
    } else {
        pdm__matmul(ctx, ctx->xn, act->n, 1, &L->wq, act->q, NULL, NULL, NULL, NULL);
        pdm__matmul(ctx, ctx->xn, act->n, 1, &L->wk, act->k, NULL, NULL, NULL, NULL);
        pdm__matmul(ctx, ctx->xn, act->n, 1, &L->wv, act->v, NULL, NULL, NULL, NULL);
    }
    pdm__run_tokens(ctx, act->n, pdm__qk_task, &t);
}

/* ---- Attention ----------------------------------------------------------------------- */

typedef struct {
    pdm_model_ctx_t *ctx;
    pdm_act_t *act;
    const pdm_kv_view_t *views;
    int n_views;
    int kvh0, kvh1;  /* kv heads [kvh0, kvh1) (and their query heads) are computed */
    int layer;
    atomic_int next; /* next unclaimed work item */
} pdm__attn_task_t;

static void pdm__attn_task(void *arg, int ith, int nth)
{
    pdm__attn_task_t *t = arg;
    const pdm_model_hparams_t *hp = &t->ctx->model->hp;
    const int hd = (int)hp->head_dim, n_heads = (int)hp->n_heads;
    const int group = (int)(hp->n_heads / hp->n_kv_heads);
    const int64_t qdim = (int64_t)n_heads * hd;
    const int n_blocks = (t->act->n + PDM__ATTN_QBLOCK - 1) / PDM__ATTN_QBLOCK;
    float *part_o = t->ctx->partial + (size_t)ith * PDM__ATTN_QBLOCK * (hd + 1);
    float *part_lse = part_o + PDM__ATTN_QBLOCK * hd;

    /* Items are (query block, head), claimed from an atomic counter, last (most keys) block
     * first so the cheap ones fill in at the end. */
    (void)nth;
    const int h0 = t->kvh0 * group, nh = (t->kvh1 - t->kvh0) * group;
    for (;;) {
        int item = atomic_fetch_add_explicit(&t->next, 1, memory_order_relaxed);
        if (item >= n_blocks * nh) break;
        int blk = n_blocks - 1 - item / nh, h = h0 + item % nh, kvh = h / group;
        int i0 = blk * PDM__ATTN_QBLOCK;
        int nq = PDM_MIN(PDM__ATTN_QBLOCK, t->act->n - i0);
        pdm_kern_attn_t a = {
            .q = t->act->q + (size_t)i0 * qdim + (size_t)h * hd,
            .q_stride = qdim,
            .q_pos = t->act->pos + i0,
            .n_q = nq,
            .head_dim = hd,
        };
        pdm_model_attn_setup(t->ctx->model, t->layer, &a);
        for (int vi = 0; vi < t->n_views; vi++) {
            const pdm_kv_view_t *view = &t->views[vi];
            a.k = view->k[kvh];
            a.v = view->v[kvh];
            a.kv_type = view->dtype;
            a.k_scale = view->k_scale[kvh];
            a.v_scale = view->v_scale[kvh];
            a.k_pos0 = view->pos0;
            a.n_kv = view->n_tokens;
            if (vi == 0) {
                a.o = t->act->o + (size_t)i0 * qdim + (size_t)h * hd;
                a.o_stride = qdim;
                a.lse = t->act->lse + (size_t)i0 * n_heads + h;
                a.lse_stride = n_heads;
                t->ctx->ops->attention(&a);
            } else {
                a.o = part_o;
                a.o_stride = hd;
                a.lse = part_lse;
                a.lse_stride = 1;
                t->ctx->ops->attention(&a);
                for (int r = 0; r < nq; r++)
                    t->ctx->ops->attn_merge(t->act->o + (size_t)(i0 + r) * qdim + (size_t)h * hd,
                                            t->act->lse + (size_t)(i0 + r) * n_heads + h,
                                            part_o + (size_t)r * hd, part_lse[r], hd);
            }
        }
        if (t->n_views == 0) {
            for (int r = 0; r < nq; r++) {
                memset(t->act->o + (size_t)(i0 + r) * qdim + (size_t)h * hd, 0,
                       (size_t)hd * sizeof(float));
                t->act->lse[(size_t)(i0 + r) * n_heads + h] = -INFINITY;
            }
        }
    }
}

/* Decode (one token): work items are (kv head, range of keys). The group's query heads of
 * the token are one block of rows (heads are contiguous in a token's q row, so the stride is
 * head_dim), which reads each KV head once instead of once per query head; the keys of each
 * view are split into n_threads ranges so both cores work however few KV heads there are.
 * Each item leaves (o, lse) of its range in ctx->split; pdm__attn_split_merge combines them.
 * Twice as many ranges as threads, claimed dynamically, so a thread slowed by another process
 * on its core does not hold the step back.
 * Splitting along the KV axis and merging by log-sum-exp is exact (flash-decoding). */
static void pdm__attn_split_task(void *arg, int ith, int nth)
{
    pdm__attn_task_t *t = arg;
    const pdm_model_hparams_t *hp = &t->ctx->model->hp;
    const int hd = (int)hp->head_dim, n_kv = t->kvh1 - t->kvh0;
    const int group = (int)(hp->n_heads / hp->n_kv_heads), n_split = 2 * t->ctx->n_threads;
    int32_t pos[PDM__ATTN_QBLOCK];
    float tmp_o[PDM__ATTN_QBLOCK * PDM_MAX_HEAD_DIM], tmp_lse[PDM__ATTN_QBLOCK];
    for (int g = 0; g < group; g++) pos[g] = t->act->pos[0];
    (void)ith;
    (void)nth;
    for (;;) {
        int item = atomic_fetch_add_explicit(&t->next, 1, memory_order_relaxed);
        if (item >= n_kv * n_split) break;
        int kvh = t->kvh0 + item / n_split, sp = item % n_split;
        float *part = t->ctx->split + ((size_t)kvh * n_split + sp) * group * (hd + 1);
        float *part_lse = part + (size_t)group * hd;
        pdm_kern_attn_t a = {.q = t->act->q + (size_t)kvh * group * hd, .q_stride = hd,
                             .q_pos = pos, .n_q = group, .head_dim = hd};
        pdm_model_attn_setup(t->ctx->model, t->layer, &a);
        for (int g = 0; g < group; g++) part_lse[g] = -INFINITY;
        memset(part, 0, (size_t)group * hd * sizeof(float));
        for (int vi = 0; vi < t->n_views; vi++) {
            const pdm_kv_view_t *view = &t->views[vi];
            /* a sliding window sees keys from pos - window + 1 on: split only those */
            int64_t lo = 0, b, e;
            if (a.window > 0)
                lo = PDM_MAX(0, (int64_t)pos[0] - a.window + 1 - view->pos0);
            if (lo >= view->n_tokens) continue;
            pdm_kern_split(view->n_tokens - lo, sp, n_split, 32, &b, &e);
            b += lo;
            e += lo;
            if (b >= e) continue;
            size_t off = (size_t)b * hd * pdm_dtype_row_bytes(view->dtype, 1);
            a.k = (const char *)view->k[kvh] + off;
            a.v = (const char *)view->v[kvh] + off;
            a.kv_type = view->dtype;
            a.k_scale = view->k_scale[kvh];
            a.v_scale = view->v_scale[kvh];
            a.k_pos0 = view->pos0 + (int32_t)b;
            a.n_kv = (int)(e - b);
            a.o = tmp_o;
            a.o_stride = hd;
            a.lse = tmp_lse;
            a.lse_stride = 1;
            t->ctx->ops->attention(&a);
            for (int g = 0; g < group; g++)
                t->ctx->ops->attn_merge(part + (size_t)g * hd, &part_lse[g],
                                        tmp_o + (size_t)g * hd, tmp_lse[g], hd);
        }
    }
}

static void pdm__attn_split_merge(pdm_model_ctx_t *ctx, pdm_act_t *act, int kvh0, int kvh1)
{
    const pdm_model_hparams_t *hp = &ctx->model->hp;
    const int hd = (int)hp->head_dim, group = (int)(hp->n_heads / hp->n_kv_heads);
    const int n_split = 2 * ctx->n_threads;
    for (int kvh = kvh0; kvh < kvh1; kvh++)
        for (int g = 0; g < group; g++) {
            int h = kvh * group + g;
            float *o = act->o + (size_t)h * hd, *lse = act->lse + h;
            memset(o, 0, (size_t)hd * sizeof(float));
            *lse = -INFINITY;
            for (int sp = 0; sp < n_split; sp++) {
                const float *part = ctx->split + ((size_t)kvh * n_split + sp) * group * (hd + 1);
                ctx->ops->attn_merge(o, lse, part + (size_t)g * hd, part[(size_t)group * hd + g],
                                     hd);
            }
        }
}

void pdm_model_attention_heads(pdm_model_ctx_t *ctx, int layer, pdm_act_t *act,
                               const pdm_kv_view_t *views, int n_views, int kvh0, int kvh1)
{
    const pdm_model_hparams_t *hp = &ctx->model->hp;
    if (kvh0 < 0) kvh0 = 0;
    if (kvh1 > (int)hp->n_kv_heads) kvh1 = (int)hp->n_kv_heads;
    if (kvh0 >= kvh1) return;
    pdm__attn_task_t t = {.ctx = ctx, .act = act, .views = views, .n_views = n_views,
                          .kvh0 = kvh0, .kvh1 = kvh1, .layer = layer};
    atomic_init(&t.next, 0);
    if (act->n == 1 && ctx->split_single && hp->n_heads / hp->n_kv_heads <= PDM__ATTN_QBLOCK) {
        pdm_kern_pool_run(ctx->pool, pdm__attn_split_task, &t);
        pdm__attn_split_merge(ctx, act, kvh0, kvh1);
        return;
    }
    pdm_kern_pool_run(ctx->pool, pdm__attn_task, &t);
}

void pdm_model_attention(pdm_model_ctx_t *ctx, int layer, pdm_act_t *act,
                         const pdm_kv_view_t *views, int n_views)
{
    pdm_model_attention_heads(ctx, layer, act, views, n_views, 0,
                              (int)ctx->model->hp.n_kv_heads);
}

void pdm_model_attn_out_ffn(pdm_model_ctx_t *ctx, int layer, pdm_act_t *act)
{
    const pdm_model_layer_t *L = &ctx->model->layers[layer];
    pdm__tok_task_t t = {.ctx = ctx, .act = act, .norm_w = L->ffn_norm, .layer = layer};
    pdm__tok_task_t post = {.ctx = ctx, .act = act, .layer = layer};
    pdm__matmul(ctx, act->o, act->n, 1, &L->wo, ctx->tmp, NULL, NULL, NULL, NULL);
    if (L->attn_post_norm) {
        post.norm_w = L->attn_post_norm;
        pdm__run_tokens(ctx, act->n, pdm__post_norm_task, &post);
    }
    pdm__run_tokens(ctx, act->n, pdm__residual_task, &t);
    pdm__run_tokens(ctx, act->n, pdm__norm_task, &t);
    if (L->w_gate.type == L->w_up.type)
        pdm__matmul(ctx, ctx->xn, act->n, 2, &L->w_gate, ctx->gate, &L->w_up, ctx->up, NULL, NULL);
    else {
        pdm__matmul(ctx, ctx->xn, act->n, 1, &L->w_gate, ctx->gate, NULL, NULL, NULL, NULL);
        pdm__matmul(ctx, ctx->xn, act->n, 1, &L->w_up, ctx->up, NULL, NULL, NULL, NULL);
    }
    pdm__run_tokens(ctx, act->n, pdm__swiglu_task, &t);
    pdm__matmul(ctx, ctx->gate, act->n, 1, &L->w_down, ctx->tmp, NULL, NULL, NULL, NULL);
    if (L->ffn_post_norm) {
        post.norm_w = L->ffn_post_norm;
        pdm__run_tokens(ctx, act->n, pdm__post_norm_task, &post);
    }
    pdm__run_tokens(ctx, act->n, pdm__residual_task, &t);
}

/* Final logit soft-capping (Gemma 2 style, llama.cpp f_final_logit_softcapping):
 * logit = cap * tanh(logit / cap). */
static void pdm__softcap(const pdm_model_hparams_t *hp, float *logits, size_t n)
{
    if (hp->logit_softcap <= 0.0f) return;
    const float cap = hp->logit_softcap, inv = 1.0f / cap;
    for (size_t i = 0; i < n; i++) logits[i] = cap * tanhf(logits[i] * inv);
}

void pdm_model_logits(pdm_model_ctx_t *ctx, const pdm_act_t *act, int row, float *logits)
{
    const pdm_model_t *m = ctx->model;
    ctx->ops->rmsnorm(ctx->xn, act->x + (size_t)row * m->hp.d_model, m->output_norm,
                      (int)m->hp.d_model, m->hp.rms_eps);
    pdm__matmul(ctx, ctx->xn, 1, 1, &m->output, logits, NULL, NULL, NULL, NULL);
    pdm__softcap(&m->hp, logits, m->hp.n_vocab);
}

void pdm_model_logits_batch(pdm_model_ctx_t *ctx, const pdm_act_t *act, int n, float *logits)
{
    const pdm_model_t *m = ctx->model;
    const size_t d = m->hp.d_model;
    for (int i = 0; i < n; i++)
        ctx->ops->rmsnorm(ctx->xn + (size_t)i * d, act->x + (size_t)i * d, m->output_norm,
                          (int)d, m->hp.rms_eps);
    pdm__matmul(ctx, ctx->xn, n, 1, &m->output, logits, NULL, NULL, NULL, NULL);
    pdm__softcap(&m->hp, logits, (size_t)n * m->hp.n_vocab);
}

void pdm_model_kv_store(pdm_model_ctx_t *ctx, pdm_kv_cache_t *cache, int layer,
                        const pdm_act_t *act, int32_t slot)
{
    const uint32_t hd = cache->head_dim, nkv = cache->n_kv_heads;
    const size_t esz = pdm_dtype_row_bytes(cache->dtype, 1);
    /* a windowed layer's row 0 holds slot win_first (pdm_kv_cache_room made the room) */
    const int32_t row = slot - pdm_kv_cache_row0(cache, (uint32_t)layer);
    assert(row >= 0 && row + act->n <= (cache->windowed && cache->windowed[layer]
                                            ? cache->win_rows : cache->capacity));
    if (cache->dtype == PDM_DT_I8) {
        pdm_model__kv_store_q8(cache, layer, act, row);
        return;
    }
    for (int i = 0; i < act->n; i++) {
        for (uint32_t h = 0; h < nkv; h++) {
            size_t off = (size_t)(row + i) * hd * esz;
            ctx->ops->kv_store(cache->dtype, act->k + ((size_t)i * nkv + h) * hd,
                               (char *)pdm_kv_cache_k(cache, layer, h) + off, (int)hd);
            ctx->ops->kv_store(cache->dtype, act->v + ((size_t)i * nkv + h) * hd,
                               (char *)pdm_kv_cache_v(cache, layer, h) + off, (int)hd);
        }
    }
}

/* ---- Whole sequences ----------------------------------------------------------------- */

int pdm_model_prefill_logits(pdm_model_ctx_t *ctx, pdm_kv_cache_t *cache, const int32_t *tokens,
                             int n, int first, float *logits)
{
    const pdm_model_t *m = ctx->model;
    if (n < 1) return pdm_error_set(PDM_EINVAL, "prefill of %d tokens", n);
    if (first < 0 || first > n)
        return pdm_error_set(PDM_EINVAL, "logits from token %d of a %d-token prefill", first, n);
    if ((int64_t)cache->n_tokens + n > cache->capacity)
        return pdm_error_set(PDM_EOVERFLOW, "%d tokens do not fit in the KV cache (%d of %d "
                             "slots used)", n, cache->n_tokens, cache->capacity);
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || (uint32_t)tokens[i] >= m->hp.n_vocab)
            return pdm_error_set(PDM_ERANGE, "token id %d is outside the vocabulary (0..%u)",
                                 tokens[i], m->hp.n_vocab - 1);
    if (cache->dtype == PDM_DT_I8 && !cache->scales_fixed) {
        if (first < n - 1)
            return pdm_error_set(PDM_EUNSUPPORTED, "logits of every token need an f16 or f32 "
                                 "KV cache (q8 takes its scales from the whole prompt)");
        return pdm_model__prefill_q8_prompt(ctx, cache, tokens, n, first < n ? logits : NULL);
    }

    pdm_act_t *act = &ctx->batch;
    int32_t *positions = act->pos; /* filled before embed copies it onto itself */
    const size_t n_vocab = m->hp.n_vocab;
    const int32_t n_tokens0 = cache->n_tokens;
    /* windowed layers (static-window KV) take at most win_rows - (S - 1) rows per chunk */
    const int chunk = cache->windowed ? PDM_MIN(ctx->max_batch,
                                                cache->win_rows - cache->win_keep)
                                      : ctx->max_batch;
    for (int c0 = 0; c0 < n; c0 += chunk) {
        int cn = PDM_MIN(chunk, n - c0);
        int32_t slot = n_tokens0 + c0;
        cache->n_tokens = slot; /* what pdm_kv_cache_room keeps is counted from here */
        int rc = pdm_kv_cache_room(cache, cn);
        if (rc) {
            cache->n_tokens = n_tokens0;
            return rc;
        }
        for (int i = 0; i < cn; i++) positions[i] = cache->pos0 + slot + i;
        rc = pdm_model_embed(ctx, tokens + c0, positions, cn, act);
        if (rc) { /* (not reached: the tokens were checked above) */
            cache->n_tokens = n_tokens0;
            return rc;
        }
        for (uint32_t l = 0; l < m->hp.n_layers; l++) {
            pdm_model_attn_in(ctx, (int)l, act);
            pdm_model_kv_store(ctx, cache, (int)l, act, slot);
            pdm_kv_view_t view;
            pdm_kv_cache_view(cache, l, 0, slot + cn, &view);
            pdm_model_attention(ctx, (int)l, act, &view, 1);
            pdm_model_attn_out_ffn(ctx, (int)l, act);
        }
        /* rows [r0, cn) of this batch are tokens at or after `first` */
        int r0 = PDM_MAX(0, first - c0);
        if (r0 >= cn) continue;
        float *out = logits + (size_t)(c0 + r0 - first) * n_vocab;
        if (r0 == cn - 1) {
            pdm_model_logits(ctx, act, r0, out);
        } else {
            /* logits_batch reads rows from row 0: move rows [r0, cn) of x to the front (x
             * is not needed after the last layer) */
            if (r0 > 0)
                memmove(act->x, act->x + (size_t)r0 * m->hp.d_model,
                        (size_t)(cn - r0) * m->hp.d_model * sizeof(float));
            pdm_model_logits_batch(ctx, act, cn - r0, out);
        }
    }
    cache->n_tokens = n_tokens0 + n;
    return PDM_OK;
}

int pdm_model_prefill(pdm_model_ctx_t *ctx, pdm_kv_cache_t *cache, const int32_t *tokens, int n,
                      float *logits)
{
    return pdm_model_prefill_logits(ctx, cache, tokens, n, logits ? n - 1 : n, logits);
}

int pdm_model_decode(pdm_model_ctx_t *ctx, pdm_kv_cache_t *cache, int32_t token, float *logits)
{
    return pdm_model_prefill(ctx, cache, &token, 1, logits);
}
