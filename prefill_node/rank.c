/*
 * rank.c - one rank of a prefill group: the prefill methods on the engine's per-layer steps.
 *
 * Each method only changes where a layer's KV comes from and which KV the local queries see
 * (KV-Runahead §4.3, Fig. 7): embed -> per layer [attn_in -> exchange -> attention ->
 * attn_out_ffn] -> logits on the rank that owns the last token. KV lives in one head-major
 * cache per rank with slot == absolute position, so received KV lands at its final place and
 * views over it need no copies.
 */
#include "prefill_node/prefill.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/pdm.h"

#define PDM__MAX_RANGES 32 /* owned position ranges of one rank in one conversation */

typedef struct {
    int32_t start, len;
} pdm__range_t;

typedef struct {
    pdm__range_t ranges[PDM_KVT_MAX_RANKS][PDM__MAX_RANGES]; /* each rank's KV block */
    int n_ranges[PDM_KVT_MAX_RANKS];
    size_t bytes[PDM_KVT_MAX_RANKS];
    int n_new[PDM_KVT_MAX_RANKS]; /* new tokens (queries) of each rank */
    size_t max_bytes;
} pdm__cp_layout_t;

struct pdm_prefill_rank {
    /* Fault injection for tests (PDMESH_FAULT_STALL_AFTER_LAYER=L): after streaming layer L
     * the rank stalls for 60 s, so a test can kill it while its request is certainly
     * mid-stream; -1 = off. */
    int fault_stall_layer;
    const pdm_model_t *model;
    pdm_kvt_group_t *g;
    pdm_prefill_rank_params_t p;
    const pdm_model_hparams_t *hp;

    pdm_model_ctx_t *ctx; /* recreated when a task needs a larger batch */
    int ctx_batch;
    pdm_kv_cache_t *cache; /* [capacity = ctx_tokens], slot == absolute position */
    pdm_act_t act;         /* this rank's new tokens */
    int act_cap;
    float *logits; /* [n_vocab] */

    /* Group state, identical on every rank (capacity ctx_tokens). */
    pdm_prefill_conv_t conv;

    /* Message descriptors of the collectives and the CP layout (large: on the heap). */
    pdm_kvt_msg_t *send_msgs, *recv_msgs; /* [PDM_KVT_MAX_RANKS] */
    pdm__cp_layout_t *layout;

    /* Per-task scratch (grown as needed, never shrunk). */
    void *scratch;
    size_t scratch_bytes;

    /* Statistics of the running task. */
    double t_wait, t_compute;

    /* Streaming of the running task (NULL: none) and this rank's ranges of it. */
    pdm_kvt_stream_tx_t *tx;
    pdm_prefill_range_t mine[PDM_PREFILL_MAX_RANGES];
    int n_mine;
    pdm_prefill_range_t prefix_mine[PDM_PREFILL_MAX_PREFIX_RUNS]; /* cached runs it streams */
    int n_prefix_mine;
};

void pdm_prefill_rank_params_default(pdm_prefill_rank_params_t *p)
{
    p->threads = 1;
    p->ctx_tokens = 8192;
    p->kv_dtype = PDM_DT_F16;
    p->timeout = 30.0;
}

int pdm_prefill_rank_create(const pdm_model_t *model, pdm_kvt_group_t *group,
                            const pdm_prefill_rank_params_t *p, pdm_prefill_rank_t **out)
{
    if (p->threads < 1 || p->ctx_tokens < 1 || !(p->timeout > 0) ||
        (p->kv_dtype != PDM_DT_F16 && p->kv_dtype != PDM_DT_F32 && p->kv_dtype != PDM_DT_I8))
        return pdm_error_set(PDM_EINVAL, "prefill rank: bad parameters");
    pdm_prefill_rank_t *r = calloc(1, sizeof(*r));
    if (r) {
        const char *f = getenv("PDMESH_FAULT_STALL_AFTER_LAYER");
        long v;
        r->fault_stall_layer = f && !pdm_parse_long(f, 0, 1 << 20, &v) ? (int)v : -1;
    }
    if (!r) return pdm_error_set(PDM_ENOMEM, "prefill rank: out of memory");
    r->model = model;
    r->g = group;
    r->p = *p;
    r->hp = &model->hp;
    int st = pdm_kv_cache_create(&model->hp, p->ctx_tokens, p->kv_dtype, &r->cache);
    if (st) goto err;
    if (!st) st = pdm_prefill_conv_reserve(&r->conv, p->ctx_tokens);
    if (st) goto err;
    r->logits = malloc(sizeof(float) * model->hp.n_vocab);
    r->send_msgs = calloc(PDM_KVT_MAX_RANKS, sizeof(pdm_kvt_msg_t));
    r->recv_msgs = calloc(PDM_KVT_MAX_RANKS, sizeof(pdm_kvt_msg_t));
    r->layout = calloc(1, sizeof(pdm__cp_layout_t));
    if (!r->logits || !r->send_msgs || !r->recv_msgs || !r->layout) {
        st = pdm_error_set(PDM_ENOMEM, "prefill rank: out of memory");
        goto err;
    }
    *out = r;
    return PDM_OK;
err:
    pdm_prefill_rank_destroy(r);
    return st;
}

void pdm_prefill_rank_destroy(pdm_prefill_rank_t *r)
{
    if (!r) return;
    pdm_model_ctx_destroy(r->ctx);
    pdm_kv_cache_destroy(r->cache);
    pdm_act_free(&r->act);
    pdm_prefill_conv_free(&r->conv);
    free(r->logits);
    free(r->send_msgs);
    free(r->recv_msgs);
    free(r->layout);
    free(r->scratch);
    free(r);
}

int32_t pdm_prefill_rank_seq_len(const pdm_prefill_rank_t *r)
{
    return r->conv.n;
}

/* ---- Helpers ------------------------------------------------------------------------- */

static int pdm__ensure_ctx(pdm_prefill_rank_t *r, int batch)
{
    if (batch < 1) batch = 1;
    if (r->ctx && r->ctx_batch >= batch) return PDM_OK;
    pdm_model_ctx_destroy(r->ctx);
    r->ctx = NULL;
    int st = pdm_model_ctx_create(r->model, r->p.threads, batch, &r->ctx);
    if (st) return st;
    r->ctx_batch = batch;
    if (r->act_cap < batch) {
        pdm_act_free(&r->act);
        st = pdm_act_alloc(r->hp, batch, &r->act);
        if (st) return st;
        r->act_cap = batch;
    }
    return PDM_OK;
}

static void *pdm__scratch(pdm_prefill_rank_t *r, size_t bytes)
{
    if (bytes <= r->scratch_bytes) return r->scratch;
    void *p = realloc(r->scratch, bytes);
    if (!p) return NULL;
    r->scratch = p;
    r->scratch_bytes = bytes;
    return p;
}

/* Ranges of positions in [lo, hi) owned by `rank`. Returns the count or -1 if more than
 * `max`. */
static int pdm__owned_ranges(const pdm_prefill_rank_t *r, int rank, int32_t lo, int32_t hi,
                             pdm__range_t *out, int max)
{
    int n = 0;
    for (int32_t p = lo; p < hi;) {
        if (r->conv.owner[p] != rank) {
            p++;
            continue;
        }
        int32_t q = p;
        while (q < hi && r->conv.owner[q] == rank) q++;
        if (n == max) return -1;
        out[n++] = (pdm__range_t){p, q - p};
        p = q;
    }
    return n;
}

static size_t pdm__row_bytes(const pdm_prefill_rank_t *r)
{
    return pdm_dtype_row_bytes(r->cache->dtype, r->hp->head_dim);
}

/* iov over cache rows [start, start + len) of every kv head's K and V of `layer`, appended
 * to msg (head-major: for each head K then V). */
static int pdm__iov_cache_rows(const pdm_prefill_rank_t *r, int layer, int32_t start,
                               int32_t len, pdm_kvt_msg_t *msg)
{
    if (len <= 0) return PDM_OK;
    const size_t row = pdm__row_bytes(r);
    for (uint32_t h = 0; h < r->hp->n_kv_heads; h++) {
        if (msg->n_iov + 2 > PDM_KVT_MAX_IOV)
            return pdm_error_set(PDM_EOVERFLOW, "prefill: KV message needs more than %d pieces",
                                 PDM_KVT_MAX_IOV);
        msg->iov[msg->n_iov++] = (pdm_kvt_iov_t){
            (char *)pdm_kv_cache_k(r->cache, (uint32_t)layer, h) + (size_t)start * row,
            (size_t)len * row};
        msg->iov[msg->n_iov++] = (pdm_kvt_iov_t){
            (char *)pdm_kv_cache_v(r->cache, (uint32_t)layer, h) + (size_t)start * row,
            (size_t)len * row};
    }
    return PDM_OK;
}

/* Views of a packed block (ranges in order; per range, per head: K rows then V rows). */
static void pdm__block_views(const pdm_prefill_rank_t *r, int layer, const void *block,
                             const pdm__range_t *ranges, int n_ranges, pdm_kv_view_t *views)
{
    const size_t row = pdm__row_bytes(r);
    const char *p = block;
    for (int i = 0; i < n_ranges; i++) {
        pdm_kv_view_t *v = &views[i];
        v->dtype = r->cache->dtype;
        v->pos0 = ranges[i].start;
        v->n_tokens = ranges[i].len;
        for (uint32_t h = 0; h < r->hp->n_kv_heads; h++) {
            const float *sc = r->cache->scale + 2 * ((size_t)layer * r->hp->n_kv_heads + h);
            v->k_scale[h] = sc[0]; /* q8: every rank holds the same scales (all-reduced) */
            v->v_scale[h] = sc[1];
            v->k[h] = p;
            p += (size_t)ranges[i].len * row;
            v->v[h] = p;
            p += (size_t)ranges[i].len * row;
        }
    }
}

static size_t pdm__block_bytes(const pdm_prefill_rank_t *r, const pdm__range_t *ranges, int n)
{
    size_t tokens = 0;
    for (int i = 0; i < n; i++) tokens += (size_t)ranges[i].len;
    return tokens * 2 * r->hp->n_kv_heads * pdm__row_bytes(r);
}

static int pdm__wait(pdm_prefill_rank_t *r, pdm_kvt_req_t *reqs, int n)
{
    double t0 = pdm_now();
    int st = pdm_kvt_wait_all(r->g->kvt, reqs, n, pdm_kvt_group_deadline(r->g));
    r->t_wait += pdm_now() - t0;
    return st;
}

/* Merges partial attention results (o2, lse2) into (o1, lse1) for n rows of every head. */
static void pdm__merge_rows(pdm_prefill_rank_t *r, float *o1, float *lse1, const float *o2,
                            const float *lse2, int n)
{
    const pdm_kern_ops_t *ops = pdm_model_ctx_ops(r->ctx);
    const int nh = (int)r->hp->n_heads, hd = (int)r->hp->head_dim;
    for (int i = 0; i < n; i++)
        for (int h = 0; h < nh; h++) {
            size_t row = (size_t)i * nh + h;
            ops->attn_merge(o1 + row * hd, lse1 + row, o2 + row * hd, lse2[row], hd);
        }
}

/* Embeds this rank's new tokens (given as ranges of positions in ascending order) into
 * r->act. */
static int pdm__embed_local(pdm_prefill_rank_t *r, const pdm_prefill_task_t *task,
                            const pdm__range_t *mine, int n_mine, int n_local)
{
    int32_t *tok = pdm__scratch(r, sizeof(int32_t) * 2 * (size_t)(n_local + 1));
    if (!tok) return pdm_error_set(PDM_ENOMEM, "prefill: out of memory");
    int32_t *pos = tok + n_local + 1;
    int k = 0;
    for (int i = 0; i < n_mine; i++)
        for (int32_t j = 0; j < mine[i].len; j++, k++) {
            pos[k] = mine[i].start + j;
            tok[k] = task->tokens[pos[k] - task->start];
        }
    return pdm_model_embed(r->ctx, tok, pos, n_local, &r->act);
}

/* Stores the new K and V rows of r->act (laid out as `mine`) into the cache. */
static void pdm__store_local(pdm_prefill_rank_t *r, int layer, const pdm__range_t *mine,
                             int n_mine)
{
    const size_t kvdim = (size_t)r->hp->n_kv_heads * r->hp->head_dim;
    int row = 0;
    for (int i = 0; i < n_mine; i++) {
        pdm_act_t part = r->act;
        part.n = mine[i].len;
        part.k = r->act.k + (size_t)row * kvdim;
        part.v = r->act.v + (size_t)row * kvdim;
        pdm_model_kv_store(r->ctx, r->cache, layer, &part, mine[i].start);
        row += mine[i].len;
    }
}

/* Attention of act's queries against `views`; with no view at all every row is empty
 * (o = 0, lse = -inf), the neutral element of the merge. */
static void pdm__attend(pdm_prefill_rank_t *r, int layer, pdm_act_t *act,
                        const pdm_kv_view_t *views, int n_views)
{
    if (n_views > 0) {
        pdm_model_attention(r->ctx, layer, act, views, n_views);
        return;
    }
    const size_t nh = r->hp->n_heads;
    memset(act->o, 0, sizeof(float) * (size_t)act->n * nh * r->hp->head_dim);
    for (size_t i = 0; i < (size_t)act->n * nh; i++) act->lse[i] = -INFINITY;
}

#define PDM__COMPUTE(r, stmt)                                                                  \
    do {                                                                                        \
        double t0_ = pdm_now();                                                                 \
        stmt;                                                                                   \
        (r)->t_compute += pdm_now() - t0_;                                                      \
    } while (0)

/* q8 KV: the scales of `layer`, fixed before any rank stores a row of it, from the absolute
 * maxima of every rank's new K and V rows (an all-reduce max; the Qualcomm KV note's "same
 * quantization parameters" for all of the prompt's KV, model/kv_quant.c). Every rank calls
 * it for every layer of a new conversation, with or without new tokens of its own. Follow-up
 * tasks keep the scales of the first (nothing is re-quantized). */
static int pdm__q8_scales(pdm_prefill_rank_t *r, const pdm_prefill_task_t *t, int layer,
                          int n_local)
{
    if (r->cache->dtype != PDM_DT_I8 || t->start > 0) return PDM_OK;
    float absmax[2 * PDM_MAX_KV_HEADS] = {0};
    if (n_local > 0) {
        pdm_act_t mine = r->act;
        mine.n = n_local;
        PDM__COMPUTE(r, pdm_kv_absmax(r->hp, &mine, absmax));
    }
    double t0 = pdm_now();
    int st = pdm_kvt_group_allreduce_max(r->g, layer, 0, absmax, 2 * (int)r->hp->n_kv_heads);
    r->t_wait += pdm_now() - t0;
    if (!st) pdm_kv_cache_set_scales(r->cache, (uint32_t)layer, absmax);
    return st;
}

/* Streams this rank's rows of `layer` (final once stored) to the decode node: one block per
 * (range, kv head), straight from the cache. */
static int pdm__stream_layer(pdm_prefill_rank_t *r, int layer)
{
    if (!r->tx) return PDM_OK;
    const size_t row = pdm__row_bytes(r);
    double t0 = pdm_now();
    int st = PDM_OK;
    for (int i = 0; i < r->n_mine + r->n_prefix_mine && !st; i++) {
        const pdm_prefill_range_t *g =
            i < r->n_mine ? &r->mine[i] : &r->prefix_mine[i - r->n_mine];
        if (g->len == 0) continue;
        for (uint32_t h = 0; h < r->hp->n_kv_heads && !st; h++)
            st = pdm_kvt_stream_tx_send_scaled(
                r->tx, (uint32_t)layer, h, (uint32_t)g->chunk, g->start, g->len,
                (uint16_t)r->cache->dtype,
                r->cache->scale[2 * ((size_t)layer * r->hp->n_kv_heads + h)],
                r->cache->scale[2 * ((size_t)layer * r->hp->n_kv_heads + h) + 1],
                (const char *)pdm_kv_cache_k(r->cache, (uint32_t)layer, h) + (size_t)g->start * row,
                (const char *)pdm_kv_cache_v(r->cache, (uint32_t)layer, h) + (size_t)g->start * row,
                row);
    }
    r->t_wait += pdm_now() - t0; /* only blocks when the window is full */
    if (layer == r->fault_stall_layer) {
        pdm_log_warn("prefill rank: fault injection: stalling after layer %d", layer);
        sleep(60);
    }
    return st;
}

/* ---- single ----------------------------------------------------------------------------- */

static int pdm__run_single(pdm_prefill_rank_t *r, const pdm_prefill_task_t *t)
{
    int st = pdm__ensure_ctx(r, PDM_MIN(t->n_tokens, 512));
    if (st) return st;
    r->cache->n_tokens = t->start;
    PDM__COMPUTE(r, st = pdm_model_prefill(r->ctx, r->cache, t->tokens, t->n_tokens, r->logits));
    /* The engine's chunked prefill finishes all layers of a chunk before the next: the KV is
     * final only at the end, so a single rank streams after it (no overlap). */
    for (int l = 0; l < (int)r->hp->n_layers && !st; l++) st = pdm__stream_layer(r, l);
    return st;
}

/* ---- TSP: even split, all-gather of every layer's K and V (KV-Runahead §4.1) ------------ */

static int pdm__run_tsp(pdm_prefill_rank_t *r, const pdm_prefill_task_t *t, const int *chunks)
{
    const int R = r->g->size, me = r->g->rank;
    int32_t begin[PDM_KVT_MAX_RANKS + 1];
    begin[0] = t->start;
    for (int i = 0; i < R; i++) begin[i + 1] = begin[i] + chunks[i];
    pdm__range_t mine = {begin[me], chunks[me]};
    int st = pdm__ensure_ctx(r, chunks[me]);
    if (!st) PDM__COMPUTE(r, st = pdm__embed_local(r, t, &mine, 1, chunks[me]));
    if (st) return st;
    pdm_kvt_msg_t *parts = r->send_msgs;
    for (int l = 0; l < (int)r->hp->n_layers; l++) {
        PDM__COMPUTE(r, pdm_model_attn_in(r->ctx, l, &r->act));
        if ((st = pdm__q8_scales(r, t, l, chunks[me]))) return st;
        PDM__COMPUTE(r, pdm__store_local(r, l, &mine, 1));
        if ((st = pdm__stream_layer(r, l))) return st;
        for (int j = 0; j < R; j++) {
            parts[j].n_iov = 0;
            st = pdm__iov_cache_rows(r, l, begin[j], chunks[j], &parts[j]);
            if (st) return st;
        }
        double t0 = pdm_now();
        st = pdm_kvt_group_allgather(r->g, l, parts);
        r->t_wait += pdm_now() - t0;
        if (st) return st;
        pdm_kv_view_t view;
        pdm_kv_cache_view(r->cache, (uint32_t)l, 0, begin[R], &view);
        PDM__COMPUTE(r, pdm_model_attention(r->ctx, l, &r->act, &view, 1);
                     pdm_model_attn_out_ffn(r->ctx, l, &r->act));
    }
    if (me == R - 1) PDM__COMPUTE(r, pdm_model_logits(r->ctx, &r->act, chunks[me] - 1, r->logits));
    return PDM_OK;
}

/* ---- KV-Runahead: a chain of ranks with uneven chunks (KV-Runahead §4, App. C) ----------- */

static int pdm__run_kvr(pdm_prefill_rank_t *r, const pdm_prefill_task_t *t, const int *chunks,
                        int head)
{
    const int R = r->g->size, me = r->g->rank;
    const int pos_in_chain = (me - head + R) % R;
    const int prev = (me - 1 + R) % R, next = (me + 1) % R;
    int32_t my_start = t->start;
    for (int c = 0; c < pos_in_chain; c++) my_start += chunks[c];
    const int n_local = chunks[pos_in_chain];
    const int32_t my_end = my_start + n_local;
    pdm__range_t mine = {my_start, n_local};

    int st = pdm__ensure_ctx(r, n_local);
    if (!st) PDM__COMPUTE(r, st = pdm__embed_local(r, t, &mine, 1, n_local));
    if (st) return st;

    const int n_layers = (int)r->hp->n_layers;
    pdm_kvt_req_t *sends = pdm__scratch(r, sizeof(pdm_kvt_req_t) * (size_t)n_layers);
    if (!sends) return pdm_error_set(PDM_ENOMEM, "prefill: out of memory");
    for (int l = 0; l < n_layers; l++) sends[l] = PDM_KVT_REQ_NONE;
    pdm_kvt_msg_t msg;
    for (int l = 0; l < n_layers && !st; l++) {
        /* (a) Post the receive of [0, my_start) before the QKV projection so that it
         * overlaps with it (Fig. 7, first blue box). */
        pdm_kvt_req_t recv = PDM_KVT_REQ_NONE;
        if (pos_in_chain > 0) {
            msg.n_iov = 0;
            st = pdm__iov_cache_rows(r, l, 0, my_start, &msg);
            if (!st)
                st = pdm_kvt_group_recv(r->g, prev, PDM_KVT_KIND_CHAIN, l, 0, msg.iov, msg.n_iov,
                                        &recv);
            if (st) break;
        }
        PDM__COMPUTE(r, pdm_model_attn_in(r->ctx, l, &r->act));
        if ((st = pdm__q8_scales(r, t, l, n_local))) {
            pdm_kvt_cancel(r->g->kvt, &recv, 1); /* NONE is skipped */
            break;
        }
        PDM__COMPUTE(r, pdm__store_local(r, l, &mine, 1));
        if ((st = pdm__stream_layer(r, l))) break;
        if (recv != PDM_KVT_REQ_NONE && (st = pdm__wait(r, &recv, 1))) break;
        /* (b) Forward the concatenated cache [0, my_end) at once and without waiting
         * (second blue box); the rows are final, so the send can run during attention. */
        if (pos_in_chain < R - 1) {
            msg.n_iov = 0;
            st = pdm__iov_cache_rows(r, l, 0, my_end, &msg);
            if (!st)
                st = pdm_kvt_group_send(r->g, next, PDM_KVT_KIND_CHAIN, l, 0, msg.iov,
                                        msg.n_iov, &sends[l]);
            if (st) break;
        }
        pdm_kv_view_t view;
        pdm_kv_cache_view(r->cache, (uint32_t)l, 0, my_end, &view);
        PDM__COMPUTE(r, pdm_model_attention(r->ctx, l, &r->act, &view, 1);
                     pdm_model_attn_out_ffn(r->ctx, l, &r->act));
    }
    int st2 = pdm__wait(r, sends, n_layers); /* also releases the handles after an error */
    if (st) return st;
    if (st2) return st2;
    if (pos_in_chain == R - 1)
        PDM__COMPUTE(r, pdm_model_logits(r->ctx, &r->act, n_local - 1, r->logits));
    return PDM_OK;
}

/* ---- Context parallelism: ring pass-KV and pass-Q (CP paper §3.5) ------------------------ */


/* Every rank's block: the positions it owns among [0, start + T), cached and new. */
static int pdm__cp_layout(const pdm_prefill_rank_t *r, int32_t end, pdm__cp_layout_t *L)
{
    memset(L, 0, sizeof(*L));
    for (int j = 0; j < r->g->size; j++) {
        int n = pdm__owned_ranges(r, j, 0, end, L->ranges[j], PDM__MAX_RANGES);
        if (n < 0 || (size_t)n * 2 * r->hp->n_kv_heads > PDM_KVT_MAX_IOV)
            return pdm_error_set(PDM_EOVERFLOW, "prefill: rank %d's share of the conversation "
                                 "is too fragmented for one message", j);
        L->n_ranges[j] = n;
        L->bytes[j] = pdm__block_bytes(r, L->ranges[j], n);
        if (L->bytes[j] > L->max_bytes) L->max_bytes = L->bytes[j];
    }
    return PDM_OK;
}

static int pdm__run_cp_kv(pdm_prefill_rank_t *r, const pdm_prefill_task_t *t,
                          const pdm__range_t *mine, int n_mine, int n_local,
                          const pdm__cp_layout_t *L)
{
    const int N = r->g->size, me = r->g->rank;
    const int prev = (me - 1 + N) % N, next = (me + 1) % N;
    const size_t qrows = (size_t)PDM_MAX(n_local, 1);
    const size_t o_floats = qrows * r->hp->n_heads * r->hp->head_dim;
    const size_t lse_floats = qrows * r->hp->n_heads;
    const size_t stage_bytes = (L->max_bytes + 63) / 64 * 64;
    char *mem = pdm__scratch(r, 2 * stage_bytes + sizeof(float) * (o_floats + lse_floats));
    if (!mem) return pdm_error_set(PDM_ENOMEM, "prefill: out of memory");
    void *stage[2] = {mem, mem + stage_bytes};
    float *tmp_o = (float *)(mem + 2 * stage_bytes), *tmp_lse = tmp_o + o_floats;

    int st = PDM_OK;
    pdm_kv_view_t views[PDM__MAX_RANGES];
    pdm_kvt_msg_t msg;
    for (int l = 0; l < (int)r->hp->n_layers && !st; l++) {
        if (n_local) PDM__COMPUTE(r, pdm_model_attn_in(r->ctx, l, &r->act));
        if ((st = pdm__q8_scales(r, t, l, n_local))) break;
        if (n_local) PDM__COMPUTE(r, pdm__store_local(r, l, mine, n_mine));
        if ((st = pdm__stream_layer(r, l))) break;
        pdm_kvt_req_t send = PDM_KVT_REQ_NONE, recv = PDM_KVT_REQ_NONE;
        /* Step 0: post the receive of the next block, send ours (gathered straight from the
         * cache), and attend to our own KV meanwhile. */
        if (N > 1) {
            int from = prev;
            pdm_kvt_iov_t in = {stage[0], L->bytes[from]};
            st = pdm_kvt_group_recv(r->g, prev, PDM_KVT_KIND_RING, l, 1, &in, 1, &recv);
            msg.n_iov = 0;
            for (int i = 0; i < L->n_ranges[me] && !st; i++)
                st = pdm__iov_cache_rows(r, l, L->ranges[me][i].start, L->ranges[me][i].len,
                                         &msg);
            if (!st)
                st = pdm_kvt_group_send(r->g, next, PDM_KVT_KIND_RING, l, 1, msg.iov, msg.n_iov,
                                        &send);
            if (st) break;
        }
        if (n_local) {
            for (int i = 0; i < L->n_ranges[me]; i++)
                pdm_kv_cache_view(r->cache, (uint32_t)l, L->ranges[me][i].start,
                                  L->ranges[me][i].len, &views[i]);
            PDM__COMPUTE(r, pdm__attend(r, l, &r->act, views, L->n_ranges[me]));
        }
        for (int s = 1; s < N && !st; s++) {
            const int origin = (me - s + N) % N, cur = (s - 1) & 1;
            if ((st = pdm__wait(r, &recv, 1))) break;
            if ((st = pdm__wait(r, &send, 1))) break;
            if (s < N - 1) { /* keep the ring moving while we compute on this block */
                int from = (origin - 1 + N) % N;
                pdm_kvt_iov_t in = {stage[cur ^ 1], L->bytes[from]};
                pdm_kvt_iov_t out = {stage[cur], L->bytes[origin]};
                st = pdm_kvt_group_recv(r->g, prev, PDM_KVT_KIND_RING, l, s + 1, &in, 1, &recv);
                if (!st)
                    st = pdm_kvt_group_send(r->g, next, PDM_KVT_KIND_RING, l, s + 1, &out, 1,
                                            &send);
                if (st) break;
            }
            if (!n_local) continue;
            pdm__block_views(r, l, stage[cur], L->ranges[origin], L->n_ranges[origin], views);
            pdm_act_t part = r->act;
            part.o = tmp_o;
            part.lse = tmp_lse;
            PDM__COMPUTE(r, pdm__attend(r, l, &part, views, L->n_ranges[origin]);
                         pdm__merge_rows(r, r->act.o, r->act.lse, tmp_o, tmp_lse, n_local));
        }
        pdm_kvt_req_t left[2] = {send, recv};
        int st2 = pdm__wait(r, left, 2);
        if (!st) st = st2;
        if (!st && n_local) PDM__COMPUTE(r, pdm_model_attn_out_ffn(r->ctx, l, &r->act));
    }
    return st;
}

static int pdm__run_cp_q(pdm_prefill_rank_t *r, const pdm_prefill_task_t *t,
                         const pdm__range_t *mine, int n_mine, int n_local,
                         const pdm__cp_layout_t *L)
{
    const int N = r->g->size, me = r->g->rank;
    const int prev = (me - 1 + N) % N, next = (me + 1) % N;
    const size_t qdim = (size_t)r->hp->n_heads * r->hp->head_dim, nh = r->hp->n_heads;
    int max_new = 0, total_new = 0;
    size_t q_off[PDM_KVT_MAX_RANKS]; /* row offset of each rank's partials */
    for (int j = 0; j < N; j++) {
        q_off[j] = (size_t)total_new;
        total_new += L->n_new[j];
        max_new = PDM_MAX(max_new, L->n_new[j]);
    }
    /* Scratch: two Q stages [max_new] x (qdim floats + 1 position), partial outputs of every
     * rank's queries against our KV [total_new] x (qdim + nh), and the partials of our own
     * queries computed by every other rank [N][n_local] x (qdim + nh). */
    const size_t stage_floats = (size_t)PDM_MAX(max_new, 1) * (qdim + 1);
    const size_t part_floats = (size_t)PDM_MAX(total_new, 1) * (qdim + nh);
    const size_t in_floats = (size_t)N * PDM_MAX(n_local, 1) * (qdim + nh);
    float *mem = pdm__scratch(r, sizeof(float) * (2 * stage_floats + part_floats + in_floats));
    if (!mem) return pdm_error_set(PDM_ENOMEM, "prefill: out of memory");
    float *stage[2] = {mem, mem + stage_floats};
    float *part_o = mem + 2 * stage_floats, *part_lse = part_o + (size_t)total_new * qdim;
    float *in_o = part_o + part_floats, *in_lse = in_o + (size_t)N * n_local * qdim;

    int st = PDM_OK;
    pdm_kv_view_t views[PDM__MAX_RANGES];
    pdm_kvt_msg_t *a2a_send = r->send_msgs, *a2a_recv = r->recv_msgs;
    for (int l = 0; l < (int)r->hp->n_layers && !st; l++) {
        if (n_local) PDM__COMPUTE(r, pdm_model_attn_in(r->ctx, l, &r->act));
        if ((st = pdm__q8_scales(r, t, l, n_local))) break;
        if (n_local) PDM__COMPUTE(r, pdm__store_local(r, l, mine, n_mine));
        if ((st = pdm__stream_layer(r, l))) break;
        for (int i = 0; i < L->n_ranges[me]; i++)
            pdm_kv_cache_view(r->cache, (uint32_t)l, L->ranges[me][i].start,
                              L->ranges[me][i].len, &views[i]);
        pdm_kvt_req_t send = PDM_KVT_REQ_NONE, recv = PDM_KVT_REQ_NONE;
        /* A Q message: the query rows, then their absolute positions (as int32). */
        if (N > 1) {
            int from = prev;
            pdm_kvt_iov_t in[2] = {
                {stage[0], sizeof(float) * qdim * L->n_new[from]},
                {stage[0] + qdim * L->n_new[from], sizeof(int32_t) * L->n_new[from]}};
            pdm_kvt_iov_t out[2] = {{r->act.q, sizeof(float) * qdim * n_local},
                                    {r->act.pos, sizeof(int32_t) * n_local}};
            st = pdm_kvt_group_recv(r->g, prev, PDM_KVT_KIND_RING, l, 1, in, 2, &recv);
            if (!st)
                st = pdm_kvt_group_send(r->g, next, PDM_KVT_KIND_RING, l, 1, out, 2, &send);
            if (st) break;
        }
        if (n_local) {
            pdm_act_t part = r->act;
            part.o = part_o + q_off[me] * qdim;
            part.lse = part_lse + q_off[me] * nh;
            PDM__COMPUTE(r, pdm__attend(r, l, &part, views, L->n_ranges[me]));
        }
        for (int s = 1; s < N && !st; s++) {
            const int origin = (me - s + N) % N, cur = (s - 1) & 1, nq = L->n_new[origin];
            if ((st = pdm__wait(r, &recv, 1))) break;
            if ((st = pdm__wait(r, &send, 1))) break;
            if (s < N - 1) {
                int from = (origin - 1 + N) % N;
                pdm_kvt_iov_t in[2] = {
                    {stage[cur ^ 1], sizeof(float) * qdim * L->n_new[from]},
                    {stage[cur ^ 1] + qdim * L->n_new[from], sizeof(int32_t) * L->n_new[from]}};
                pdm_kvt_iov_t out[2] = {{stage[cur], sizeof(float) * qdim * nq},
                                        {stage[cur] + qdim * nq, sizeof(int32_t) * nq}};
                st = pdm_kvt_group_recv(r->g, prev, PDM_KVT_KIND_RING, l, s + 1, in, 2, &recv);
                if (!st)
                    st = pdm_kvt_group_send(r->g, next, PDM_KVT_KIND_RING, l, s + 1, out, 2,
                                            &send);
                if (st) break;
            }
            if (!nq) continue;
            pdm_act_t foreign = {
                .n = nq,
                .pos = (int32_t *)(stage[cur] + qdim * nq),
                .q = stage[cur],
                .o = part_o + q_off[origin] * qdim,
                .lse = part_lse + q_off[origin] * nh,
            };
            PDM__COMPUTE(r, pdm__attend(r, l, &foreign, views, L->n_ranges[me]));
        }
        pdm_kvt_req_t left[2] = {send, recv};
        int st2 = pdm__wait(r, left, 2);
        if (!st) st = st2;
        if (st) break;
        /* All2All: partial outputs go back to the ranks that own the queries (§3.5.3). */
        for (int j = 0; j < N; j++) {
            a2a_send[j] = (pdm_kvt_msg_t){
                .iov = {{part_o + q_off[j] * qdim, sizeof(float) * qdim * L->n_new[j]},
                        {part_lse + q_off[j] * nh, sizeof(float) * nh * L->n_new[j]}},
                .n_iov = 2};
            a2a_recv[j] = (pdm_kvt_msg_t){
                .iov = {{in_o + (size_t)j * n_local * qdim, sizeof(float) * qdim * n_local},
                        {in_lse + (size_t)j * n_local * nh, sizeof(float) * nh * n_local}},
                .n_iov = 2};
        }
        double t0 = pdm_now();
        st = pdm_kvt_group_alltoall(r->g, l, a2a_send, a2a_recv);
        r->t_wait += pdm_now() - t0;
        if (st || !n_local) continue;
        PDM__COMPUTE(r, {
            memcpy(r->act.o, part_o + q_off[me] * qdim, sizeof(float) * qdim * n_local);
            memcpy(r->act.lse, part_lse + q_off[me] * nh, sizeof(float) * nh * n_local);
            for (int j = 0; j < N; j++)
                if (j != me)
                    pdm__merge_rows(r, r->act.o, r->act.lse, in_o + (size_t)j * n_local * qdim,
                                    in_lse + (size_t)j * n_local * nh, n_local);
            pdm_model_attn_out_ffn(r->ctx, l, &r->act);
        });
    }
    return st;
}

static int pdm__run_cp(pdm_prefill_rank_t *r, const pdm_prefill_task_t *t)
{
    const int me = r->g->rank;
    const int32_t end = t->start + t->n_tokens;
    pdm__cp_layout_t *L = r->layout;
    int st = pdm__cp_layout(r, end, L);
    if (st) return st;
    pdm__range_t mine[PDM__MAX_RANGES];
    int n_mine = pdm__owned_ranges(r, me, t->start, end, mine, PDM__MAX_RANGES);
    int n_local = 0;
    for (int i = 0; i < n_mine; i++) n_local += mine[i].len;
    for (int j = 0; j < r->g->size; j++) {
        pdm__range_t tmp[PDM__MAX_RANGES];
        int n = pdm__owned_ranges(r, j, t->start, end, tmp, PDM__MAX_RANGES);
        for (int i = 0; i < n; i++) L->n_new[j] += tmp[i].len;
    }
    st = pdm__ensure_ctx(r, n_local);
    if (!st && n_local) PDM__COMPUTE(r, st = pdm__embed_local(r, t, mine, n_mine, n_local));
    if (st) return st;
    if (t->method == PDM_PREFILL_CP_KV)
        st = pdm__run_cp_kv(r, t, mine, n_mine, n_local, L);
    else
        st = pdm__run_cp_q(r, t, mine, n_mine, n_local, L);
    if (st) return st;
    if (r->conv.owner[end - 1] == me)
        PDM__COMPUTE(r, pdm_model_logits(r->ctx, &r->act, n_local - 1, r->logits));
    return PDM_OK;
}

/* ---- Task ------------------------------------------------------------------------------- */

/* Checks a task against the group state; identical outcome on every rank. */
static int pdm__validate(const pdm_prefill_rank_t *r, const pdm_prefill_task_t *t, int *chunks,
                         int *head)
{
    const int R = r->g->size;
    const char *name = pdm_prefill_method_name(t->method);
    if ((unsigned)t->method >= PDM_PREFILL_AUTO)
        return pdm_error_set(PDM_EINVAL, "prefill: method '%s' must be resolved before a task "
                             "runs", name);
    if (t->n_tokens < 1) return pdm_error_set(PDM_EINVAL, "prefill: a task needs new tokens");
    /* A task naming its prefix may cut a longer conversation short; one without must
     * continue exactly where the group stands. */
    if (t->start < 0 || (t->start > 0 && (t->prefix ? t->start > r->conv.n
                                                    : t->start != r->conv.n)))
        return pdm_error_set(PDM_ESTATE, "prefill: the task continues a conversation at "
                             "position %d but the group holds %d tokens", t->start, r->conv.n);
    if (t->prefix && t->start > 0) {
        int32_t same = pdm_prefill_conv_common(&r->conv, t->prefix, t->start);
        if (same < t->start)
            return pdm_error_set(PDM_ESTATE, "prefill: the task's cached prefix differs from "
                                 "the group's conversation at position %d (prefix miss)", same);
    }
    if ((int64_t)t->start + t->n_tokens > r->p.ctx_tokens)
        return pdm_error_set(PDM_EOVERFLOW, "prefill: %d + %d tokens exceed the KV capacity of "
                             "%d (--ctx)", t->start, t->n_tokens, r->p.ctx_tokens);
    if (t->stream && t->start > 0 &&
        pdm_prefill_conv_prefix_runs(&r->conv, t->start, NULL, PDM_PREFILL_MAX_PREFIX_RUNS) < 0)
        return pdm_error_set(PDM_EOVERFLOW, "prefill: the cached prefix is split into more than "
                             "%d runs, too many to stream", PDM_PREFILL_MAX_PREFIX_RUNS);
    if (t->stream && (t->stream->max_in_flight < 1 || t->stream->peer < 0))
        return pdm_error_set(PDM_EINVAL, "prefill: bad stream target");
    for (int32_t i = 0; i < t->n_tokens; i++)
        if (t->tokens[i] < 0 || (uint32_t)t->tokens[i] >= r->hp->n_vocab)
            return pdm_error_set(PDM_ERANGE, "prefill: token %d at index %d is outside the "
                                 "vocabulary", t->tokens[i], i);
    switch (t->method) {
    case PDM_PREFILL_SINGLE:
        if (R != 1)
            return pdm_error_set(PDM_EINVAL, "prefill: 'single' runs on 1 rank, not %d", R);
        return PDM_OK;
    case PDM_PREFILL_TSP:
        if (t->start > 0)
            return pdm_error_set(PDM_EUNSUPPORTED, "prefill: 'tsp' does not support partial "
                                 "prefill (use kvr-* or cp-*)");
        if (t->n_tokens < R)
            return pdm_error_set(PDM_EINVAL, "prefill: 'tsp' needs at least one token per rank "
                                 "(%d tokens, %d ranks)", t->n_tokens, R);
        pdm_prefill_split_even(t->n_tokens, R, chunks);
        return PDM_OK;
    case PDM_PREFILL_KVR_E:
    case PDM_PREFILL_KVR_S:
    case PDM_PREFILL_KVR_P: {
        if (t->n_tokens < R)
            return pdm_error_set(PDM_EINVAL, "prefill: '%s' needs at least one token per rank "
                                 "(%d tokens, %d ranks)", name, t->n_tokens, R);
        if (t->chunks) {
            int64_t sum = 0;
            for (int i = 0; i < R; i++) {
                if (t->chunks[i] < 1)
                    return pdm_error_set(PDM_EINVAL, "prefill: chunk %d of the partition is "
                                         "empty", i);
                sum += t->chunks[i];
                chunks[i] = t->chunks[i];
            }
            if (sum != t->n_tokens)
                return pdm_error_set(PDM_EINVAL, "prefill: the partition covers %lld tokens, "
                                     "the prompt has %d", (long long)sum, t->n_tokens);
        } else {
            pdm_prefill_split_even(t->n_tokens, R, chunks);
        }
        /* The chain starts at a rank that holds the whole cached prefix: the previous
         * chain's last rank holds it all (§4: only the last process has the full KV). */
        *head = pdm_prefill_conv_chain_head(&r->conv, R, t->start);
        if (*head < 0)
            return pdm_error_set(PDM_EUNSUPPORTED, "prefill: no rank holds the whole cached "
                                 "prefix of %d tokens, which KV-Runahead needs (it was "
                                 "computed with cp-*; continue with cp-kv or cp-q)", t->start);
        return PDM_OK;
    }
    case PDM_PREFILL_CP_KV:
    case PDM_PREFILL_CP_Q:
        return PDM_OK;
    default:
        return pdm_error_set(PDM_EINVAL, "prefill: unknown method %d", (int)t->method);
    }
}

int pdm_prefill_rank_run(pdm_prefill_rank_t *r, const pdm_prefill_task_t *t,
                         pdm_prefill_result_t *res)
{
    const int R = r->g->size, me = r->g->rank;
    int chunks[PDM_KVT_MAX_RANKS], head = 0;
    int st = pdm__validate(r, t, chunks, &head);
    if (st) return st;
    if (t->start == 0) {
        pdm_prefill_conv_reset(&r->conv);
        r->cache->scales_fixed = 0; /* q8: a new prompt fixes new scales */
    }
    pdm_kvt_stats_t s0, s1;
    pdm_kvt_stats(r->g->kvt, &s0);
    r->g->task = t->id;
    r->t_wait = r->t_compute = 0;
    double t0 = pdm_now();
    const int32_t end = t->start + t->n_tokens;
    /* Who computes what (the same function tells the decode node where blocks come from). */
    pdm_prefill_range_t ranges[PDM_PREFILL_MAX_RANGES];
    int n_ranges = pdm_prefill_plan_ranges(t->method, R, t->start, t->n_tokens, chunks, head,
                                           ranges);
    int n_local = 0;
    for (int i = 0; i < n_ranges; i++) {
        memset(r->conv.owner + ranges[i].start, ranges[i].rank, (size_t)ranges[i].len);
        if (ranges[i].rank == me) n_local += ranges[i].len;
    }
    const int owner_rank = r->conv.owner[end - 1];
    r->n_mine = 0;
    for (int i = 0; i < n_ranges; i++)
        if (ranges[i].rank == me) r->mine[r->n_mine++] = ranges[i];
    /* A partial prefill streamed to a decode node: the cached positions this rank computed
     * go along (validated above: at most PDM_PREFILL_MAX_PREFIX_RUNS runs). */
    r->n_prefix_mine = 0;
    if (t->stream && t->start > 0) {
        pdm_prefill_range_t runs[PDM_PREFILL_MAX_PREFIX_RUNS];
        int nr = pdm_prefill_conv_prefix_runs(&r->conv, t->start, runs,
                                              PDM_PREFILL_MAX_PREFIX_RUNS);
        for (int i = 0; i < nr; i++)
            if (runs[i].rank == me) r->prefix_mine[r->n_prefix_mine++] = runs[i];
    }
    if (t->stream) {
        st = pdm_kvt_stream_tx_create(r->g->kvt, t->stream->peer, t->stream->request_id,
                                      t->stream->attempt, t->stream->max_in_flight,
                                      r->p.timeout, &r->tx);
        if (st) return st;
    }

    switch (t->method) {
    case PDM_PREFILL_SINGLE:
        st = pdm__run_single(r, t);
        break;
    case PDM_PREFILL_TSP:
        st = pdm__run_tsp(r, t, chunks);
        break;
    case PDM_PREFILL_KVR_E:
    case PDM_PREFILL_KVR_S:
    case PDM_PREFILL_KVR_P:
        st = pdm__run_kvr(r, t, chunks, head);
        break;
    default: /* cp-kv, cp-q */
        st = pdm__run_cp(r, t);
        break;
    }
    uint64_t streamed = 0;
    if (r->tx) {
        if (!st) {
            double tw = pdm_now();
            st = pdm_kvt_stream_tx_finish(r->tx, pdm_now() + r->p.timeout);
            r->t_wait += pdm_now() - tw;
        }
        streamed = pdm_kvt_stream_tx_bytes(r->tx);
        pdm_kvt_stream_tx_destroy(r->tx);
        r->tx = NULL;
    }
    if (!st)
        st = pdm_prefill_conv_commit(&r->conv, t->method, R, t->start, t->tokens, t->n_tokens,
                                     ranges, n_ranges);
    if (st) {
        /* The group's KV is incomplete now: the conversation cannot continue. */
        pdm_prefill_conv_reset(&r->conv);
        return st;
    }
    r->cache->n_tokens = end;
    pdm_kv_cache_fix_scales(r->cache);
    pdm_kvt_stats(r->g->kvt, &s1);
    memset(res, 0, sizeof(*res));
    res->owner = owner_rank == me;
    res->n_local = n_local;
    res->t_total = pdm_now() - t0;
    res->t_compute = r->t_compute;
    res->t_wait = r->t_wait;
    res->bytes_sent = s1.bytes_sent - s0.bytes_sent;
    res->bytes_received = s1.bytes_received - s0.bytes_received;
    res->bytes_streamed = streamed;
    if (res->owner) {
        res->logits = r->logits;
        int32_t best = 0;
        for (uint32_t i = 1; i < r->hp->n_vocab; i++)
            if (r->logits[i] > r->logits[best]) best = (int32_t)i;
        res->first_token = best;
    }
    return PDM_OK;
}

/* ---- KV files ---------------------------------------------------------------------------- */

#define PDM__KVFILE_HEADER 64

static off_t pdm__kvfile_offset(const pdm_model_hparams_t *hp, int32_t n_tokens, uint32_t layer,
                                uint32_t head, int is_v, int32_t pos)
{
    size_t plane = (size_t)n_tokens * hp->head_dim * sizeof(float);
    return (off_t)(PDM__KVFILE_HEADER + ((size_t)(layer * hp->n_kv_heads + head) * 2 + is_v) *
                                            plane + (size_t)pos * hp->head_dim * sizeof(float));
}

static int pdm__kvfile_header(int fd, const char *path, const pdm_model_hparams_t *hp,
                              int32_t *n_tokens)
{
    uint8_t h[PDM__KVFILE_HEADER];
    uint32_t f[4];
    if (pread(fd, h, sizeof(h), 0) != (ssize_t)sizeof(h) || memcmp(h, "PDMKV001", 8))
        return pdm_error_set(PDM_EFORMAT, "%s: not a pdmesh KV file", path);
    memcpy(f, h + 8, sizeof(f));
    if (f[0] != hp->n_layers || f[1] != hp->n_kv_heads || f[2] != hp->head_dim ||
        f[3] > (1u << 24))
        return pdm_error_set(PDM_EFORMAT, "%s: KV shape does not match the model", path);
    *n_tokens = (int32_t)f[3];
    return PDM_OK;
}

int pdm_prefill_rank_dump_kv(const pdm_prefill_rank_t *r, const char *path)
{
    const pdm_model_hparams_t *hp = r->hp;
    /* Every rank of the group writes the same header and size, then its own rows. */
    int fd = open(path, O_WRONLY | O_CREAT, 0644);
    if (fd < 0) return pdm_error_set(-errno, "%s: %s", path, strerror(errno));
    const int32_t n_file = r->conv.n;
    uint8_t header[PDM__KVFILE_HEADER] = "PDMKV001";
    uint32_t f[4] = {hp->n_layers, hp->n_kv_heads, hp->head_dim, (uint32_t)n_file};
    memcpy(header + 8, f, sizeof(f));
    int st = PDM_OK;
    if (pwrite(fd, header, sizeof(header), 0) != (ssize_t)sizeof(header) ||
        ftruncate(fd, pdm__kvfile_offset(hp, n_file, hp->n_layers, 0, 0, 0)) != 0)
        st = pdm_error_set(-errno, "%s: %s", path, strerror(errno));
    pdm__range_t ranges[PDM__MAX_RANGES];
    int n = st ? 0 : pdm__owned_ranges(r, r->g->rank, 0, r->conv.n, ranges, PDM__MAX_RANGES);
    if (n < 0) st = pdm_error_set(PDM_EOVERFLOW, "KV dump: too many ranges");
    float *buf = NULL;
    if (!st && !(buf = malloc(sizeof(float) * hp->head_dim * (size_t)PDM_MAX(r->conv.n, 1))))
        st = pdm_error_set(PDM_ENOMEM, "KV dump: out of memory");
    const size_t row = pdm__row_bytes(r);
    for (int i = 0; i < n && !st; i++)
        for (uint32_t l = 0; l < hp->n_layers && !st; l++)
            for (uint32_t h = 0; h < hp->n_kv_heads && !st; h++)
                for (int is_v = 0; is_v < 2 && !st; is_v++) {
                    const char *src = is_v ? pdm_kv_cache_v(r->cache, l, h)
                                           : pdm_kv_cache_k(r->cache, l, h);
                    src += (size_t)ranges[i].start * row;
                    size_t count = (size_t)ranges[i].len * hp->head_dim;
                    const float sc = r->cache->scale[2 * ((size_t)l * hp->n_kv_heads + h) + is_v];
                    if (r->cache->dtype == PDM_DT_F32)
                        memcpy(buf, src, count * sizeof(float));
                    else if (r->cache->dtype == PDM_DT_I8)
                        for (size_t e = 0; e < count; e++)
                            buf[e] = sc * (float)((const int8_t *)src)[e];
                    else
                        for (size_t e = 0; e < count; e++)
                            buf[e] = pdm_f16_to_f32(((const uint16_t *)src)[e]);
                    off_t off = pdm__kvfile_offset(hp, n_file, l, h, is_v, ranges[i].start);
                    if (pwrite(fd, buf, count * sizeof(float), off) != (ssize_t)(count * 4))
                        st = pdm_error_set(-errno, "%s: %s", path, strerror(errno));
                }
    free(buf);
    close(fd);
    return st;
}

int pdm_kvfile_read(const char *path, const pdm_model_hparams_t *hp, int32_t *n_tokens,
                    float **data)
{
    int fd = open(path, O_RDONLY);
    if (fd < 0) return pdm_error_set(-errno, "%s: %s", path, strerror(errno));
    int32_t n = 0;
    int st = pdm__kvfile_header(fd, path, hp, &n);
    size_t bytes = (size_t)hp->n_layers * hp->n_kv_heads * 2 * (size_t)n * hp->head_dim * 4;
    float *d = NULL;
    if (!st && !(d = malloc(bytes ? bytes : 1))) st = pdm_error_set(PDM_ENOMEM, "out of memory");
    if (!st && pread(fd, d, bytes, PDM__KVFILE_HEADER) != (ssize_t)bytes)
        st = pdm_error_set(PDM_EFORMAT, "%s: truncated KV file", path);
    close(fd);
    if (st) {
        free(d);
        return st;
    }
    *n_tokens = n;
    *data = d;
    return PDM_OK;
}
