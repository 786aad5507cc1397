/*
 * batch.c - a batch task (rank.h, pdm_prefill_rank_run_batch): several solo prompts run by
 * one rank as one batch through the engine (model.h, pdm_model_prefill_seqs), each into its
 * own scratch KV cache, each streamed layer by layer to its own decode node over its own
 * stream (as a solo task streams, rank.c). Members are independent: one whose input is bad,
 * whose decode node cannot be reached or stops taking blocks, or whose deadline passes fails
 * alone (its stream is dropped, its status set) and the others go on. The group's cache and
 * conversation are never touched, as for a solo task.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/pdm.h"
#include "prefill_node/prefill_internal.h"
#include "prefill_node/rank.h"

/* The rank's batch state (grown as needed, freed with the rank). */
struct pdm_prefill__batch {
    pdm_kv_cache_t *cache[PDM_PREFILL_BATCH_MAX]; /* scratch KV per member [capacity: its
                                                   * longest prompt so far, <= ctx_tokens] */
    float *logits[PDM_PREFILL_BATCH_MAX];         /* [n_vocab] per member */
};

void pdm_prefill__batch_free(pdm_prefill__batch_t *b)
{
    if (!b) return;
    for (int i = 0; i < PDM_PREFILL_BATCH_MAX; i++) {
        pdm_kv_cache_destroy(b->cache[i]);
        free(b->logits[i]);
    }
    free(b);
}

/* What the layer callback needs: the live members and their streams. */
typedef struct {
    pdm_prefill_rank_t *r;
    int n;                                  /* live members in the engine's batch */
    int member[PDM_PREFILL_BATCH_MAX];      /* their index among the caller's tasks */
    pdm_kv_cache_t *cache[PDM_PREFILL_BATCH_MAX];
    pdm_kvt_stream_tx_t *tx[PDM_PREFILL_BATCH_MAX]; /* NULL: no stream (or dropped) */
    const pdm_prefill_batch_member_t *in;
    pdm_prefill_batch_out_t *out;
} pdm__batch_run_t;

/* Marks member i failed with status st and the message now in pdm_error_last(). */
static void pdm__fail(pdm_prefill_batch_out_t *out, int i, int st)
{
    out[i].status = st;
    snprintf(out[i].message, sizeof(out[i].message), "%s", pdm_error_last());
}

/* Checks one member as a solo task is checked (rank_steps.c pdm_prefill__solo_check), and that it
 * asks for nothing a batch member does not do. */
static int pdm__member_check(const pdm_prefill_rank_t *r, const pdm_prefill_task_t *t)
{
    if (!t->solo)
        return pdm_error_set(PDM_EINVAL, "prefill: a batch member is a solo task");
    if (t->prompt_logprobs)
        return pdm_error_set(PDM_EUNSUPPORTED, "prefill: a batch member does not score its "
                             "prompt (the router sends those alone)");
    return pdm_prefill__solo_check(r, t);
}

/* Member slot k's scratch cache and logits, grown to n tokens (steps of 256). */
static int pdm__member_room(pdm_prefill_rank_t *r, int k, int32_t n)
{
    pdm_prefill__batch_t *b = r->batch;
    if (!b->logits[k] && !(b->logits[k] = malloc(sizeof(float) * r->hp->n_vocab)))
        return pdm_error_set(PDM_ENOMEM, "prefill: out of memory");
    if (b->cache[k] && b->cache[k]->capacity >= n) return PDM_OK;
    int32_t cap = PDM_MIN((n + 255) / 256 * 256, r->p.ctx_tokens);
    pdm_kv_cache_destroy(b->cache[k]);
    b->cache[k] = NULL;
    return pdm_kv_cache_create(r->hp, cap, r->p.kv_dtype, &b->cache[k]);
}

/* Drops live member j's stream (after a failure). */
static void pdm__drop_stream(pdm__batch_run_t *br, int j)
{
    pdm_kvt_stream_tx_destroy(br->tx[j]);
    br->tx[j] = NULL;
}

/* The engine's per-layer hook: every live member's KV of `layer` goes to its decode node.
 * A member whose stream fails or whose deadline passed is failed and its stream dropped; the
 * batch itself goes on (its rows are computed anyway: the batch is already formed). */
static int pdm__on_layer(void *data, int layer)
{
    pdm__batch_run_t *br = data;
    pdm_prefill_rank_t *r = br->r;
    const double now = pdm_now();
    for (int j = 0; j < br->n; j++) {
        const int i = br->member[j];
        if (br->out[i].status) continue;
        if (br->in[i].deadline > 0 && now > br->in[i].deadline) {
            pdm__drop_stream(br, j);
            pdm_error_set(PDM_ETIMEOUT, "prefill: the request's deadline passed at layer %d of "
                          "its batch", layer);
            pdm__fail(br->out, i, PDM_ETIMEOUT);
            continue;
        }
        if (!br->tx[j]) continue;
        r->tx = br->tx[j];
        r->cache = br->cache[j];
        r->n_mine = 1;
        r->mine[0] = (pdm_prefill_range_t){0, br->in[i].task.n_tokens, r->g->rank, 0};
        r->n_prefix_mine = 0;
        int st = pdm_prefill__stream_layer(r, layer);
        r->tx = NULL;
        if (st) {
            pdm__drop_stream(br, j);
            pdm__fail(br->out, i, st);
        }
    }
    return PDM_OK;
}

int pdm_prefill_rank_run_batch(pdm_prefill_rank_t *r, const pdm_prefill_batch_member_t *in,
                               int n, pdm_prefill_batch_out_t *out)
{
    if (n < 1 || n > PDM_PREFILL_BATCH_MAX)
        return pdm_error_set(PDM_EINVAL, "prefill: a batch of %d tasks (1..%d)", n,
                             PDM_PREFILL_BATCH_MAX);
    if (!r->batch && !(r->batch = calloc(1, sizeof(*r->batch))))
        return pdm_error_set(PDM_ENOMEM, "prefill: out of memory");
    const double t0 = pdm_now();
    pdm__batch_run_t br = {.r = r, .in = in, .out = out};
    pdm_model_seq_t seqs[PDM_PREFILL_BATCH_MAX];
    int total = 0;
    for (int i = 0; i < n; i++) {
        memset(&out[i], 0, sizeof(out[i]));
        const pdm_prefill_task_t *t = &in[i].task;
        int st = pdm__member_check(r, t);
        if (!st && total + t->n_tokens > PDM_PREFILL_BATCH_TOKENS)
            st = pdm_error_set(PDM_EOVERFLOW, "prefill: the batch would hold more than %d tokens",
                               PDM_PREFILL_BATCH_TOKENS);
        if (!st) st = pdm__member_room(r, br.n, t->n_tokens);
        if (st) {
            pdm__fail(out, i, st);
            continue;
        }
        const int j = br.n;
        pdm_kv_cache_t *c = r->batch->cache[j];
        c->n_tokens = 0;
        c->scales_fixed = 0; /* q8: this prompt's own scales */
        if (t->stream) {
            st = pdm_kvt_stream_tx_create(r->g->kvt, t->stream->peer, t->stream->request_id,
                                          t->stream->attempt, t->stream->max_in_flight,
                                          r->p.timeout, &br.tx[j]);
            if (st) {
                br.tx[j] = NULL;
                pdm__fail(out, i, st);
                continue;
            }
            pdm_kvt_stream_tx_set_key(br.tx[j], t->stream->key);
        }
        br.member[j] = i;
        br.cache[j] = c;
        seqs[j] = (pdm_model_seq_t){t->tokens, t->n_tokens, c, r->batch->logits[j]};
        total += t->n_tokens;
        br.n++;
    }
    r->t_wait = r->t_compute = 0;
    int st = PDM_OK;
    if (br.n > 0) {
        pdm_kv_cache_t *group_cache = r->cache;
        st = pdm_prefill__ensure_ctx(r, total);
        if (!st)
            PDM_PREFILL__COMPUTE(r, st = pdm_model_prefill_seqs(r->ctx, &r->act, seqs, br.n,
                                                                pdm__on_layer, &br));
        r->cache = group_cache;
        r->tx = NULL;
    }
    /* A whole-batch failure (no memory for the context, bad batch) fails every member still
     * standing; each stream is closed either way. */
    for (int j = 0; j < br.n; j++) {
        const int i = br.member[j];
        if (st && !out[i].status) pdm__fail(out, i, st);
        if (br.tx[j]) {
            if (!out[i].status) {
                double tw = pdm_now();
                int fs = pdm_kvt_stream_tx_finish(br.tx[j], pdm_now() + r->p.timeout);
                r->t_wait += pdm_now() - tw;
                if (fs) pdm__fail(out, i, fs);
            }
            out[i].res.bytes_streamed = pdm_kvt_stream_tx_bytes(br.tx[j]);
            pdm__drop_stream(&br, j);
        }
        if (out[i].status) continue;
        pdm_prefill_result_t *res = &out[i].res;
        res->owner = 1;
        res->n_local = in[i].task.n_tokens;
        res->logits = r->batch->logits[j];
        int32_t best = 0;
        for (uint32_t v = 1; v < r->hp->n_vocab; v++)
            if (res->logits[v] > res->logits[best]) best = (int32_t)v;
        res->first_token = best;
    }
    const double t_total = pdm_now() - t0;
    for (int i = 0; i < n; i++) {
        out[i].res.t_total = t_total;
        out[i].res.t_compute = r->t_compute;
        out[i].res.t_wait = r->t_wait;
    }
    return PDM_OK;
}
