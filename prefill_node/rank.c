/*
 * rank.c - one rank of a prefill group (rank.h): the rank object, the checks a task must
 * pass, the group state (conv.h) before and after it, the streaming set-up, and the
 * dispatch to the method's file: single here (the engine's own prefill), tsp.c, kvr.c,
 * ring.c (ring_pass_kv.c, ring_pass_q.c). prefill_internal.h describes how a method is built.
 */
#include "prefill_node/rank.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/pdm.h"
#include "prefill_node/prefill_internal.h"

void pdm_prefill_rank_params_default(pdm_prefill_rank_params_t *p)
{
    p->threads = 1;
    p->ctx_tokens = 8192;
    p->kv_dtype = PDM_DT_F16;
    p->timeout = 30.0;
    p->pool_tokens = 16384;
}

/* ---- The group's pool of conversations (pool.h): this rank's rows of each --------------- */

/* Bytes of one head's rows [0, n) of K (or V) and of the q8 scales. */
static size_t pdm__pool_rows(const pdm_prefill_rank_t *r, int32_t n)
{
    return pdm_prefill__row_bytes(r) * (size_t)n;
}

static size_t pdm__pool_scale_bytes(const pdm_prefill_rank_t *r)
{
    return sizeof(float) * 2 * r->hp->n_layers * r->hp->n_kv_heads;
}

/* XXH3 (kvtransfer/checksum.c) of an entry's K half and V half, then of its scales. */
static uint64_t pdm__pool_checksum(const pdm_prefill_rank_t *r, const void *kv, int32_t n)
{
    const size_t half = pdm__pool_rows(r, n) * r->hp->n_layers * r->hp->n_kv_heads;
    const char *b = kv, *scales = b + 2 * half;
    const size_t sh = pdm__pool_scale_bytes(r) / 2;
    return pdm_kvt_block_checksum((uint64_t)n, b, b + half, half) ^
           pdm_kvt_block_checksum((uint64_t)n + 1, scales, scales + sh, sh);
}

static int pdm__pool_save_cb(void *ctx, const pdm_prefill_conv_t *c, pdm_prefill_pool_entry_t *e)
{
    pdm_prefill_rank_t *r = ctx;
    const size_t nh = (size_t)r->hp->n_layers * r->hp->n_kv_heads;
    const size_t rows = pdm__pool_rows(r, c->n), half = rows * nh;
    char *kv = malloc(2 * half + pdm__pool_scale_bytes(r));
    if (!kv) return PDM_ENOMEM;
    for (size_t i = 0; i < nh; i++) {
        memcpy(kv + i * rows, r->cache->k[i], rows);
        memcpy(kv + half + i * rows, r->cache->v[i], rows);
    }
    memcpy(kv + 2 * half, r->cache->scale, pdm__pool_scale_bytes(r));
    e->kv = kv;
    e->kv_bytes = 2 * half + pdm__pool_scale_bytes(r);
    e->checksum = pdm__pool_checksum(r, kv, c->n);
    return PDM_OK;
}

static int pdm__pool_load_cb(void *ctx, const pdm_prefill_pool_entry_t *e)
{
    pdm_prefill_rank_t *r = ctx;
    const int32_t n = e->conv.n;
    const size_t nh = (size_t)r->hp->n_layers * r->hp->n_kv_heads;
    const size_t rows = pdm__pool_rows(r, n), half = rows * nh;
    if (r->fault_corrupt_pool) /* tests: what a bad page or a reuse race would do */
        ((uint8_t *)e->kv)[half / 2] ^= 0x40;
    if (pdm__pool_checksum(r, e->kv, n) != e->checksum) return PDM_ECHECKSUM;
    const char *kv = e->kv;
    for (size_t i = 0; i < nh; i++) {
        memcpy(r->cache->k[i], kv + i * rows, rows);
        memcpy(r->cache->v[i], kv + half + i * rows, rows);
    }
    memcpy(r->cache->scale, kv + 2 * half, pdm__pool_scale_bytes(r));
    r->cache->scales_fixed = 1;
    r->cache->n_tokens = n;
    return PDM_OK;
}

static void pdm__pool_drop_cb(void *ctx, pdm_prefill_pool_entry_t *e)
{
    (void)ctx;
    free(e->kv);
    e->kv = NULL;
    e->kv_bytes = 0;
}

/* Before a whole-group task: the pool operations the router mirrors (pdm_prefill_pool_begin),
 * then, when the task names a pooled source, every rank agrees that its own load succeeded
 * (an all-reduce of one flag), so that a checksum failure on one rank fails the task on all
 * of them at once instead of leaving the others waiting. On error the pool and the
 * conversation are emptied (the router resets its mirror when the task fails). */
static int pdm__pool_prepare(pdm_prefill_rank_t *r, const pdm_prefill_task_t *t)
{
    if (t->pool_reset) {
        pdm_prefill_pool_clear(&r->pool);
        pdm_prefill_conv_reset(&r->conv);
    }
    /* The budget applies after the source was taken: a smaller budget never evicts the
     * conversation the task continues. */
    int loaded;
    int st = pdm_prefill_pool_begin(&r->pool, &r->conv, t->pool_source, t->start, &loaded);
    pdm_prefill_pool_set_budget(&r->pool, PDM_MIN(PDM_MAX(t->pool_tokens, 0), r->p.pool_tokens));
    if (t->start > 0 && t->pool_source && r->g->size > 1) {
        char msg[256];
        snprintf(msg, sizeof(msg), "%s", st ? pdm_error_last() : "");
        float failed = st ? 1.0f : 0.0f;
        r->g->task = t->id;
        int ast = pdm_kvt_group_allreduce_max(r->g, 0xffff, 1, &failed, 1);
        if (ast) st = ast;
        else if (failed > 0 && !st)
            st = pdm_error_set(PDM_ECHECKSUM, "prefill: another rank of the group could not use "
                               "its pooled KV of the task's cached prefix: prefilled in full");
        else if (st)
            pdm_error_set(st, "%s", msg);
    }
    if (st) {
        pdm_prefill_pool_clear(&r->pool);
        pdm_prefill_conv_reset(&r->conv);
    }
    return st;
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
        char spec[32] = "";
        if (f) snprintf(spec, sizeof(spec), "%s", f);
        char *ms = strchr(spec, ':');
        if (ms) *ms++ = '\0';
        long v, w = 60000;
        r->fault_stall_layer = f && !pdm_parse_long(spec, 0, 1 << 20, &v) &&
                                       (!ms || !pdm_parse_long(ms, 0, 600000, &w))
                                   ? (int)v
                                   : -1;
        r->fault_stall_ms = (int)w;
        const char *c = getenv("PDMESH_FAULT_CORRUPT_POOL");
        r->fault_corrupt_pool = c && !strcmp(c, "1");
    }
    if (!r) return pdm_error_set(PDM_ENOMEM, "prefill rank: out of memory");
    r->model = model;
    r->g = group;
    r->p = *p;
    r->hp = &model->hp;
    pdm_prefill_pool_ops_t ops = {pdm__pool_save_cb, pdm__pool_load_cb, pdm__pool_drop_cb, r};
    pdm_prefill_pool_init(&r->pool, 0, &ops);
    int st = pdm_kv_cache_create(&model->hp, p->ctx_tokens, p->kv_dtype, &r->cache);
    if (st) goto err;
    if (!st) st = pdm_prefill_conv_reserve(&r->conv, p->ctx_tokens);
    if (st) goto err;
    r->logits = malloc(sizeof(float) * model->hp.n_vocab);
    r->send_msgs = calloc(PDM_KVT_MAX_RANKS, sizeof(pdm_kvt_msg_t));
    r->recv_msgs = calloc(PDM_KVT_MAX_RANKS, sizeof(pdm_kvt_msg_t));
    r->layout = calloc(1, sizeof(pdm_prefill__ring_layout_t));
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
    pdm_kv_cache_destroy(r->solo_cache);
    pdm_prefill__batch_free(r->batch);
    pdm_act_free(&r->act);
    pdm_prefill_pool_fini(&r->pool);
    pdm_prefill_conv_free(&r->conv);
    free(r->logits);
    free(r->send_msgs);
    free(r->recv_msgs);
    free(r->layout);
    free(r->scratch);
    free(r->plp_pos);
    free(r->plp);
    free(r->plp_logits);
    free(r);
}

int32_t pdm_prefill_rank_seq_len(const pdm_prefill_rank_t *r)
{
    return r->conv.n;
}

/* ---- single ----------------------------------------------------------------------------- */

/* 'single' with prompt log-probabilities: the prompt in blocks of PDM_PREFILL__SCORE_ROWS
 * with every row's logits (pdm_model_prefill_logits), each block scored before the next. */
static int pdm__single_scored(pdm_prefill_rank_t *r, const pdm_prefill_task_t *t)
{
    const size_t n_vocab = r->hp->n_vocab;
    if (!r->plp_logits &&
        !(r->plp_logits = malloc(sizeof(float) * PDM_PREFILL__SCORE_ROWS * n_vocab)))
        return pdm_error_set(PDM_ENOMEM, "prefill: out of memory");
    int32_t pos[PDM_PREFILL__SCORE_ROWS];
    for (int32_t c0 = 0; c0 < t->n_tokens; c0 += PDM_PREFILL__SCORE_ROWS) {
        const int cn = (int)PDM_MIN(PDM_PREFILL__SCORE_ROWS, t->n_tokens - c0);
        int st = pdm_model_prefill_logits(r->ctx, r->cache, t->tokens + c0, cn, 0, r->plp_logits);
        for (int i = 0; i < cn; i++) pos[i] = t->start + c0 + i;
        if (!st) st = pdm_prefill__score_logits(r, t, r->plp_logits, pos, cn);
        if (st) return st;
        if (c0 + cn == t->n_tokens)
            memcpy(r->logits, r->plp_logits + (size_t)(cn - 1) * n_vocab, sizeof(float) * n_vocab);
    }
    return PDM_OK;
}

static int pdm__run_single(pdm_prefill_rank_t *r, const pdm_prefill_task_t *t)
{
    int st = pdm_prefill__ensure_ctx(r, PDM_MIN(t->n_tokens, 512));
    if (st) return st;
    r->cache->n_tokens = t->start;
    if (t->prompt_logprobs)
        PDM_PREFILL__COMPUTE(r, st = pdm__single_scored(r, t));
    else
        PDM_PREFILL__COMPUTE(
            r, st = pdm_model_prefill(r->ctx, r->cache, t->tokens, t->n_tokens, r->logits));
    /* The engine's chunked prefill finishes all layers of a chunk before the next: the KV is
     * final only at the end, so a single rank streams after it (no overlap). */
    for (int l = 0; l < (int)r->hp->n_layers && !st; l++) st = pdm_prefill__stream_layer(r, l);
    return st;
}

/* ---- Streaming -------------------------------------------------------------------------- */

/* Opens the task's stream to its decode node (no-op without one). */
static int pdm__stream_open(pdm_prefill_rank_t *r, const pdm_prefill_task_t *t)
{
    if (!t->stream) return PDM_OK;
    int st = pdm_kvt_stream_tx_create(r->g->kvt, t->stream->peer, t->stream->request_id,
                                      t->stream->attempt, t->stream->max_in_flight,
                                      r->p.timeout, &r->tx);
    if (st) return st;
    pdm_kvt_stream_tx_set_key(r->tx, t->stream->key);
    return PDM_OK;
}

/* Waits for the stream's last blocks (when st is OK) and closes it; returns the task's
 * status and sets *streamed to the bytes sent. */
static int pdm__stream_close(pdm_prefill_rank_t *r, int st, uint64_t *streamed)
{
    *streamed = 0;
    if (!r->tx) return st;
    if (!st) {
        double tw = pdm_now();
        st = pdm_kvt_stream_tx_finish(r->tx, pdm_now() + r->p.timeout);
        r->t_wait += pdm_now() - tw;
    }
    *streamed = pdm_kvt_stream_tx_bytes(r->tx);
    pdm_kvt_stream_tx_destroy(r->tx);
    r->tx = NULL;
    return st;
}

/* ---- Solo (load-adaptive groups) ---------------------------------------------------------- */

/* Solo prompts up to this length run as one batch through the per-layer steps, so that each
 * layer's KV streams while the next layers compute (as a group's ranks do); longer ones take
 * the engine's chunked prefill (bounded activations) and stream at the end. */
#define PDM__SOLO_LAYERED_MAX 2048

/* The whole prompt as one batch, layer by layer: embed, then per layer QKV, (q8: this
 * prompt's scales, from its own rows - no all-reduce, the rank is alone), store, stream,
 * attention over [0, n), output projection and FFN; the last token's logits. */
static int pdm__run_solo_layers(pdm_prefill_rank_t *r, const pdm_prefill_task_t *t)
{
    const int n = t->n_tokens;
    const pdm_prefill__span_t all = {0, n};
    int st = pdm_prefill__ensure_ctx(r, n);
    if (!st) PDM_PREFILL__COMPUTE(r, st = pdm_prefill__embed_local(r, t, &all, 1, n));
    for (int l = 0; l < (int)r->hp->n_layers && !st; l++) {
        PDM_PREFILL__COMPUTE(r, pdm_model_attn_in(r->ctx, l, &r->act));
        if (r->cache->dtype == PDM_DT_I8) {
            float absmax[2 * PDM_MAX_KV_HEADS] = {0};
            pdm_act_t rows = r->act;
            rows.n = n;
            PDM_PREFILL__COMPUTE(r, pdm_kv_absmax(r->hp, &rows, absmax));
            pdm_kv_cache_set_scales(r->cache, (uint32_t)l, absmax);
        }
        PDM_PREFILL__COMPUTE(r, pdm_prefill__store_local(r, l, &all, 1));
        if ((st = pdm_prefill__stream_layer(r, l))) break;
        pdm_kv_view_t view;
        pdm_kv_cache_view(r->cache, (uint32_t)l, 0, n, &view);
        PDM_PREFILL__COMPUTE(r, pdm_model_attention(r->ctx, l, &r->act, &view, 1);
                             pdm_model_attn_out_ffn(r->ctx, l, &r->act));
    }
    if (!st) PDM_PREFILL__COMPUTE(r, pdm_model_logits(r->ctx, &r->act, n - 1, r->logits));
    return st;
}

/* A solo task: this rank alone prefills the whole prompt (the engine's single-rank prefill,
 * or its per-layer steps so that the KV streams layer by layer) into its scratch cache and
 * streams all of it; the group's cache and conversation are not touched (on success or
 * failure), so a later partial prefill finds what the group held before. */
static int pdm__run_solo(pdm_prefill_rank_t *r, const pdm_prefill_task_t *t,
                         pdm_prefill_result_t *res)
{
    const int me = r->g->rank;
    const int invalid = pdm_prefill__solo_check(r, t);
    if (invalid) return invalid;
    if (!r->solo_cache || r->solo_cache->capacity < t->n_tokens) {
        /* grown in steps of 256 tokens so a mix of prompt lengths settles quickly */
        int32_t cap = PDM_MIN((t->n_tokens + 255) / 256 * 256, r->p.ctx_tokens);
        pdm_kv_cache_destroy(r->solo_cache);
        r->solo_cache = NULL;
        int st = pdm_kv_cache_create(r->hp, cap, r->p.kv_dtype, &r->solo_cache);
        if (st) return st;
    }
    pdm_kv_cache_t *group_cache = r->cache;
    r->cache = r->solo_cache;
    r->cache->scales_fixed = 0; /* q8: this prompt's own scales */
    r->n_mine = 1;
    r->mine[0] = (pdm_prefill_range_t){0, t->n_tokens, me, 0};
    r->n_prefix_mine = 0;
    if (t->stream) pdm_prefill_ranges_clip(r->mine, 1, t->stream->from); /* delta transfer */
    r->t_wait = r->t_compute = 0;
    double t0 = pdm_now();
    uint64_t streamed;
    int st = pdm__stream_open(r, t);
    if (!st) st = t->n_tokens <= PDM__SOLO_LAYERED_MAX ? pdm__run_solo_layers(r, t)
                                                       : pdm__run_single(r, t);
    st = pdm__stream_close(r, st, &streamed);
    r->cache = group_cache;
    if (st) return st;
    memset(res, 0, sizeof(*res));
    res->owner = 1;
    res->n_local = t->n_tokens;
    res->t_total = pdm_now() - t0;
    res->t_compute = r->t_compute;
    res->t_wait = r->t_wait;
    res->bytes_streamed = streamed;
    res->logits = r->logits;
    int32_t best = 0;
    for (uint32_t i = 1; i < r->hp->n_vocab; i++)
        if (r->logits[i] > r->logits[best]) best = (int32_t)i;
    res->first_token = best;
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
    if (t->prompt_logprobs && t->start > 0)
        return pdm_error_set(PDM_EUNSUPPORTED, "prefill: prompt log-probabilities need the whole "
                             "prompt computed (start 0, not %d)", t->start);
    if (t->prompt_logprobs && (t->prompt_top < 0 || t->prompt_top > PDM_SAMPLER_MAX_TOP_LOGPROBS))
        return pdm_error_set(PDM_EINVAL, "prefill: %d prompt alternatives (at most %d)",
                             t->prompt_top, PDM_SAMPLER_MAX_TOP_LOGPROBS);
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
    if (t->solo) return pdm__run_solo(r, t, res);
    const int R = r->g->size, me = r->g->rank;
    int chunks[PDM_KVT_MAX_RANKS], head = 0;
    /* A follow-up first takes its source conversation from the pool (the checks need it); a
     * new prompt is checked first, so that a refused one leaves the group as it was. */
    int st = t->start > 0 ? pdm__pool_prepare(r, t) : pdm__validate(r, t, chunks, &head);
    if (!st) st = t->start > 0 ? pdm__validate(r, t, chunks, &head) : pdm__pool_prepare(r, t);
    if (st) return st;
    if (t->start == 0) {
        pdm_prefill_conv_reset(&r->conv);
        r->cache->scales_fixed = 0; /* q8: a new prompt fixes new scales */
    }
    pdm_kvt_stats_t s0, s1;
    pdm_kvt_stats(r->g->kvt, &s0);
    r->g->task = t->id;
    r->t_wait = r->t_compute = 0;
    r->n_plp = 0;
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
    /* Delta transfer: the decode node holds the rows before stream->from in its own pool;
     * nothing before them is sent, computed now or cached (the router cut the decode node's
     * plan with the same function). */
    if (t->stream) {
        pdm_prefill_ranges_clip(r->mine, r->n_mine, t->stream->from);
        pdm_prefill_ranges_clip(r->prefix_mine, r->n_prefix_mine, t->stream->from);
    }
    if ((st = pdm__stream_open(r, t))) return st;

    switch (t->method) {
    case PDM_PREFILL_SINGLE:
        st = pdm__run_single(r, t);
        break;
    case PDM_PREFILL_TSP:
        st = pdm_prefill__run_tsp(r, t, chunks);
        break;
    case PDM_PREFILL_KVR_E:
    case PDM_PREFILL_KVR_S:
    case PDM_PREFILL_KVR_P:
        st = pdm_prefill__run_kvr(r, t, chunks, head);
        break;
    default: /* cp-kv, cp-q */
        st = pdm_prefill__run_ring(r, t);
        break;
    }
    /* The other methods leave this rank's rows, ascending positions, in r->act: score them
     * while the stream's last blocks are in flight. */
    if (!st && t->prompt_logprobs && t->method != PDM_PREFILL_SINGLE && n_local > 0)
        PDM_PREFILL__COMPUTE(r, st = pdm_prefill__score_act(r, t, n_local));
    uint64_t streamed;
    st = pdm__stream_close(r, st, &streamed);
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
    res->n_prompt_lp = r->n_plp;
    res->prompt_lp_pos = r->plp_pos;
    res->prompt_lp = r->plp;
    if (res->owner) {
        res->logits = r->logits;
        int32_t best = 0;
        for (uint32_t i = 1; i < r->hp->n_vocab; i++)
            if (r->logits[i] > r->logits[best]) best = (int32_t)i;
        res->first_token = best;
    }
    return PDM_OK;
}
