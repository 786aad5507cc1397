/*
 * rank_steps.c - the per-layer steps every prefill method is built from
 * (prefill_internal.h): model context and scratch, views and iovs over the cache, the
 * partial-attention merge (context parallelism §3.5, lse formula), q8 scales, and the
 * streaming of a layer's final rows to the decode node.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/pdm.h"
#include "prefill_node/prefill_internal.h"

int pdm_prefill__ensure_ctx(pdm_prefill_rank_t *r, int batch)
{
    if (batch < 1) batch = 1;
    if (r->ctx && r->ctx_batch >= batch && r->act_cap >= batch) return PDM_OK;
    pdm_model_ctx_destroy(r->ctx);
    r->ctx = NULL;
    int st = pdm_model_ctx_create(r->model, r->p.threads, batch, &r->ctx);
    if (st) return st;
    /* prompt tokens: the same numbers whether a range holds one token or many (a cached
     * prefix leaves a rank one token to compute; the engine computes it in the batch) */
    pdm_model_ctx_set_split_single(r->ctx, 0);
    if (r->act_cap < batch) {
        pdm_act_free(&r->act);
        r->act_cap = 0; /* freed: a failed allocation must not leave a stale capacity */
        st = pdm_act_alloc(r->hp, batch, &r->act);
        if (st) return st;
        r->act_cap = batch;
    }
    r->ctx_batch = batch; /* only once the context and the activations both hold `batch` */
    return PDM_OK;
}

int pdm_prefill__solo_check(const pdm_prefill_rank_t *r, const pdm_prefill_task_t *t)
{
    if (t->method != PDM_PREFILL_SINGLE || t->start != 0 || t->prefix)
        return pdm_error_set(PDM_EINVAL, "prefill: a solo task is a 'single' prefill of a whole "
                             "prompt (got '%s' at position %d)",
                             pdm_prefill_method_name(t->method), t->start);
    if (t->n_tokens < 1) return pdm_error_set(PDM_EINVAL, "prefill: a task needs new tokens");
    if (t->n_tokens > r->p.ctx_tokens)
        return pdm_error_set(PDM_EOVERFLOW, "prefill: %d tokens exceed the KV capacity of %d "
                             "(--ctx)", t->n_tokens, r->p.ctx_tokens);
    if (t->stream && (t->stream->max_in_flight < 1 || t->stream->peer < 0))
        return pdm_error_set(PDM_EINVAL, "prefill: bad stream target");
    for (int32_t i = 0; i < t->n_tokens; i++)
        if (t->tokens[i] < 0 || (uint32_t)t->tokens[i] >= r->hp->n_vocab)
            return pdm_error_set(PDM_ERANGE, "prefill: token %d at index %d is outside the "
                                 "vocabulary", t->tokens[i], i);
    return PDM_OK;
}

void *pdm_prefill__scratch(pdm_prefill_rank_t *r, size_t bytes)
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
int pdm_prefill__owned_ranges(const pdm_prefill_rank_t *r, int rank, int32_t lo, int32_t hi,
                              pdm_prefill__span_t *out, int max)
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
        out[n++] = (pdm_prefill__span_t){p, q - p};
        p = q;
    }
    return n;
}

size_t pdm_prefill__row_bytes(const pdm_prefill_rank_t *r)
{
    return pdm_dtype_row_bytes(r->cache->dtype, r->hp->head_dim);
}

/* iov over cache rows [start, start + len) of every kv head's K and V of `layer`, appended
 * to msg (head-major: for each head K then V). */
int pdm_prefill__iov_cache_rows(const pdm_prefill_rank_t *r, int layer, int32_t start,
                                int32_t len, pdm_kvt_msg_t *msg)
{
    if (len <= 0) return PDM_OK;
    const size_t row = pdm_prefill__row_bytes(r);
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
void pdm_prefill__block_views(const pdm_prefill_rank_t *r, int layer, const void *block,
                              const pdm_prefill__span_t *ranges, int n_ranges, pdm_kv_view_t *views)
{
    const size_t row = pdm_prefill__row_bytes(r);
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

size_t pdm_prefill__block_bytes(const pdm_prefill_rank_t *r, const pdm_prefill__span_t *ranges,
                                int n)
{
    size_t tokens = 0;
    for (int i = 0; i < n; i++) tokens += (size_t)ranges[i].len;
    return tokens * 2 * r->hp->n_kv_heads * pdm_prefill__row_bytes(r);
}

int pdm_prefill__wait(pdm_prefill_rank_t *r, pdm_kvt_req_t *reqs, int n)
{
    double t0 = pdm_now();
    int st = pdm_kvt_wait_all(r->g->kvt, reqs, n, pdm_kvt_group_deadline(r->g));
    r->t_wait += pdm_now() - t0;
    return st;
}

/* Merges partial attention results (o2, lse2) into (o1, lse1) for n rows of every head. */
void pdm_prefill__merge_rows(pdm_prefill_rank_t *r, float *o1, float *lse1, const float *o2,
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
int pdm_prefill__embed_local(pdm_prefill_rank_t *r, const pdm_prefill_task_t *task,
                             const pdm_prefill__span_t *mine, int n_mine, int n_local)
{
    int32_t *tok = pdm_prefill__scratch(r, sizeof(int32_t) * 2 * (size_t)(n_local + 1));
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
void pdm_prefill__store_local(pdm_prefill_rank_t *r, int layer, const pdm_prefill__span_t *mine,
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
void pdm_prefill__attend(pdm_prefill_rank_t *r, int layer, pdm_act_t *act,
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

/* q8 KV: the scales of `layer`, fixed before any rank stores a row of it, from the absolute
 * maxima of every rank's new K and V rows (an all-reduce max; the Qualcomm KV note's "same
 * quantization parameters" for all of the prompt's KV, model/kv_quant.c). Every rank calls
 * it for every layer of a new conversation, with or without new tokens of its own. Follow-up
 * tasks keep the scales of the first (nothing is re-quantized). */
int pdm_prefill__q8_scales(pdm_prefill_rank_t *r, const pdm_prefill_task_t *t, int layer,
                           int n_local)
{
    if (r->cache->dtype != PDM_DT_I8 || t->start > 0) return PDM_OK;
    float absmax[2 * PDM_MAX_KV_HEADS] = {0};
    if (n_local > 0) {
        pdm_act_t mine = r->act;
        mine.n = n_local;
        PDM_PREFILL__COMPUTE(r, pdm_kv_absmax(r->hp, &mine, absmax));
    }
    double t0 = pdm_now();
    int st = pdm_kvt_group_allreduce_max(r->g, layer, 0, absmax, 2 * (int)r->hp->n_kv_heads);
    r->t_wait += pdm_now() - t0;
    if (!st) pdm_kv_cache_set_scales(r->cache, (uint32_t)layer, absmax);
    return st;
}

/* Streams this rank's rows of `layer` (final once stored) to the decode node: one block per
 * (range, kv head), straight from the cache. */
int pdm_prefill__stream_layer(pdm_prefill_rank_t *r, int layer)
{
    if (!r->tx) return PDM_OK;
    const size_t row = pdm_prefill__row_bytes(r);
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
        pdm_log_warn("prefill rank: fault injection: stalling %d ms after layer %d",
                     r->fault_stall_ms, layer);
        struct timespec ts = {r->fault_stall_ms / 1000, (r->fault_stall_ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
    return st;
}

/* ---- Prompt log-probabilities ------------------------------------------------------------- */

int pdm_prefill__score_logits(pdm_prefill_rank_t *r, const pdm_prefill_task_t *t,
                              const float *logits, const int32_t *pos, int n)
{
    const int32_t end = t->start + t->n_tokens, n_vocab = (int32_t)r->hp->n_vocab;
    for (int i = 0; i < n; i++) {
        const int32_t p = pos[i] + 1; /* the position row i predicts */
        if (p >= end || p <= t->start) continue;
        if (r->n_plp == r->plp_cap) {
            int32_t cap = r->plp_cap ? 2 * r->plp_cap : 256;
            int32_t *np = realloc(r->plp_pos, sizeof(int32_t) * (size_t)cap);
            if (np) r->plp_pos = np;
            pdm_token_logprobs_t *nl = realloc(r->plp, sizeof(*nl) * (size_t)cap);
            if (nl) r->plp = nl;
            if (!np || !nl) return pdm_error_set(PDM_ENOMEM, "prefill: out of memory");
            r->plp_cap = cap;
        }
        pdm_sampler_score(logits + (size_t)i * n_vocab, n_vocab, t->tokens[p - t->start],
                          t->prompt_top, &r->plp[r->n_plp]);
        r->plp_pos[r->n_plp++] = p;
    }
    return PDM_OK;
}

int pdm_prefill__score_act(pdm_prefill_rank_t *r, const pdm_prefill_task_t *t, int n)
{
    const size_t d = r->hp->d_model;
    if (!r->plp_logits &&
        !(r->plp_logits = malloc(sizeof(float) * PDM_PREFILL__SCORE_ROWS * r->hp->n_vocab)))
        return pdm_error_set(PDM_ENOMEM, "prefill: out of memory");
    for (int i0 = 0; i0 < n; i0 += PDM_PREFILL__SCORE_ROWS) {
        const int nb = PDM_MIN(PDM_PREFILL__SCORE_ROWS, n - i0);
        pdm_act_t rows = r->act; /* logits_batch reads rows from x[0] */
        rows.x = r->act.x + (size_t)i0 * d;
        rows.n = nb;
        pdm_model_logits_batch(r->ctx, &rows, nb, r->plp_logits);
        int st = pdm_prefill__score_logits(r, t, r->plp_logits, r->act.pos + i0, nb);
        if (st) return st;
    }
    return PDM_OK;
}
