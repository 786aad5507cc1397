/*
 * request.c - the request state machine: a request's life from admission to its one end
 * through its sink (ARCHITECTURE.md "Request lifecycle"). It is the only file that moves a
 * request between states; the others send it events.
 *
 * States (rt_req_t.state):
 *   QUEUED     admitted (rt_req_enqueue) or sent back by a failed attempt; waits for the
 *              scheduler (schedule.c) to pick a decode node and, unless prefilled locally, a
 *              prefill group.
 *   RESERVING  DecodeTask sent; the decode node reserves KV for the attempt.
 *   PREFILL    PrefillTask sent to every rank of the group; the ranks stream the KV to the
 *              decode node and each answers PrefillResult. A solo attempt (adapt.h) sends
 *              it to one rank, which streams every token and alone answers.
 *   DECODE     DecodeStart sent (with the first token); DecodeTokens flow back, then one
 *              DecodeResult.
 *   ended      exactly once, through sink.on_result (rt_req_finish) or sink.on_error
 *              (rt_req_fail); the request is freed then.
 * Local prefill (conditional disaggregation, no group, every migration) skips PREFILL: the
 * decode node prefills the prompt itself after DecodeStart(first_token -1).
 *
 * Events, transitions and what is sent (router -> decode node D, prefill ranks P):
 *   schedule.c rt_req_dispatch      QUEUED -> RESERVING                     DecodeTask to D
 *   schedule.c rt_req_finish        QUEUED -> ended (all tokens were delivered before a failure)
 *   D DecodeReserved ok             RESERVING -> PREFILL                     PrefillTask to P
 *                                   RESERVING -> DECODE (local prefill)      DecodeStart to D
 *   D DecodeReserved ERR_NODE_FULL  RESERVING -> QUEUED, not a failure (D skipped for 0.5 s;
 *                                   after 15 dispatches -> ended, OVERLOADED)
 *   P PrefillResult ERR_STALE_FORMATION  PREFILL -> QUEUED, not a failure (rank 0: planned
 *                                   for another formation; the group may be re-wired; after
 *                                   RT_MAX_STALE_FORMATION of them -> attempt failed)
 *   P PrefillResult ok              ranks_done++ (once per rank asked); the last frees the group; the rank
 *                                   that carries the first token: -> DECODE  DecodeStart to D
 *   D DecodeTokens                  DECODE: tokens delivered (a stop string ends the request)
 *   D DecodeResult ok               -> ended (on_result)
 *   D DecodeResult deadline         -> ended (on_error DEADLINE_EXCEEDED)
 *   D DecodeReserved / P PrefillResult / D DecodeResult error, a send that fails, or
 *   registry.c rt_req_on_node_lost  attempt failed (below)
 *   core.c rt_req_expire (tick)     any state -> ended (on_error DEADLINE_EXCEEDED)
 *   pdm_router_cancel, shutdown     any state -> ended (rt_req_fail)          CancelTask to D
 * An attempt failed: its group is suspected for a lease and its conversation mirror
 * forgotten, its nodes released (CancelTask to D, unless D is lost or reported the failure
 * itself), and the request goes back to QUEUED; once cfg.max_attempts attempts have failed
 * it ends instead (UNAVAILABLE, or DEADLINE_EXCEEDED if that was the last error). Counted as
 * a migration if tokens were delivered, else a retry. Tokens already delivered are never sent again: a
 * migrated request is prefilled locally on the new decode node with prompt + delivered
 * tokens and continues at completion index n_gen.
 * Chunked prefill ("Chunked prefill" below) happens while QUEUED and changes no state: the
 * scheduler may send a chunk of a long prompt to a group (rt_req_chunk, PrefillTask under the
 * chunk's own task id, nothing streamed); the ranks' PrefillResults complete it, an error
 * or a lost rank ends the chunking, and the request goes on as above.
 * Task messages count only for the request's current attempt on the node (or group rank, by
 * epoch) that holds it; anything else is stale and dropped. registry.c checks the sender and
 * its epoch before it hands a message here.
 */
#include <cjson/cJSON.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "router/internal.h"
#include "router/beams.h"
#include "router/request.h"
#include "router/prefix.h"

static void rt_attempt_failed(pdm_router_t *r, rt_req_t *q, int code, const char *msg);
static void rt_batch_try_send(pdm_router_t *r, uint64_t batch);
static int rt_plp_take(pdm_router_t *r, rt_req_t *q, const uint32_t *positions, size_t n_pos,
                       Pdmesh__SampledLogprob *const *lps, size_t n_lps);
static void rt_plp_complete(pdm_router_t *r, rt_req_t *q, int32_t first);

rt_req_t *rt_req_find(pdm_router_t *r, uint64_t id)
{
    for (rt_req_t *q = r->head; q; q = q->next)
        if (q->id == id) return q;
    return NULL;
}

static const char *rt_err_text(const Pdmesh__Error *e)
{
    return e && e->message && e->message[0] ? e->message : "failed";
}

static void rt_chunk_release(pdm_router_t *r, rt_req_t *q, int cancel);

/* Prompt tokens q reused from a cache rather than computed for it: its task's cached prefix,
 * of which the rows its own prefill chunks computed do not count. */
static uint32_t rt_req_reused(const rt_req_t *q)
{
    return q->chunks_done ? PDM_MIN(q->cached_tokens, q->chunk_reused) : q->cached_tokens;
}

static void rt_req_unlink_free(pdm_router_t *r, rt_req_t *q)
{
    rt_chunk_release(r, q, 0); /* a chunk of its prompt still in flight */
    /* OpenAI's n: a choice leaves its leader; a leader's choices go on alone */
    if (q->leader) q->leader->choice[q->choice_index] = NULL;
    for (uint32_t i = 0; i < q->n_samples && i < RT_MAX_CHOICES; i++) {
        rt_req_t *c = q->choice[i];
        if (!c) continue;
        c->leader = NULL;
        if (c->state == RQ_SHARED) c->state = RQ_QUEUED;
    }
    if (q->prev) q->prev->next = q->next;
    else r->head = q->next;
    if (q->next) q->next->prev = q->prev;
    else r->tail = q->prev;
    r->n_req--;
    rt_req_free(q);
    pdm_metric_set(r->m.queue, NULL, r->n_req);
}

void rt_req_free(rt_req_t *q)
{
    if (!q) return;
    free(q->prompt);
    free(q->gen);
    free(q->lp_ids);
    free(q->lp_vals);
    free(q->lp_n);
    free(q->plp_ids);
    free(q->plp_vals);
    free(q->plp_n);
    free(q->text);
    for (size_t i = 0; i < q->n_stops; i++) free(q->stops[i]);
    free(q->json_schema);
    free(q->first_logits);
    free(q);
}

/* A copy of memory of n bytes at p (NULL stays NULL); *ok cleared when out of memory. */
static void *rt_dup(const void *p, size_t n, int *ok)
{
    if (!p) return NULL;
    void *d = malloc(n ? n : 1);
    if (!d) *ok = 0;
    else memcpy(d, p, n);
    return d;
}

rt_req_t *rt_req_clone(const rt_req_t *q)
{
    rt_req_t *c = malloc(sizeof(*c));
    if (!c) return NULL;
    *c = *q;
    c->next = c->prev = NULL;
    int ok = 1;
    c->prompt = rt_dup(q->prompt, sizeof(int32_t) * q->n_prompt, &ok);
    c->gen = rt_dup(q->gen, sizeof(int32_t) * q->max_new, &ok);
    c->lp_ids = rt_dup(q->lp_ids, sizeof(int32_t) * q->max_new * q->lp_stride, &ok);
    c->lp_vals = rt_dup(q->lp_vals, sizeof(float) * q->max_new * q->lp_stride, &ok);
    c->lp_n = rt_dup(q->lp_n, q->max_new, &ok);
    c->plp_ids = rt_dup(q->plp_ids, sizeof(int32_t) * q->n_prompt * q->plp_stride, &ok);
    c->plp_vals = rt_dup(q->plp_vals, sizeof(float) * q->n_prompt * q->plp_stride, &ok);
    c->plp_n = rt_dup(q->plp_n, q->n_prompt, &ok);
    c->text = q->text ? rt_dup(q->text, q->text_cap, &ok) : NULL;
    c->first_logits = NULL; /* (a leader's, per attempt) */
    c->json_schema = q->json_schema ? strdup(q->json_schema) : NULL;
    if (q->json_schema && !c->json_schema) ok = 0;
    for (size_t i = 0; i < q->n_stops; i++)
        if (!(c->stops[i] = strdup(q->stops[i]))) ok = 0;
    if (!ok) {
        rt_req_free(c);
        return NULL;
    }
    c->sp.bias_ids = c->bias_ids;
    c->sp.bias_values = c->bias_values;
    c->sp.json_schema = c->json_schema;
    return c;
}

void rt_req_enqueue(pdm_router_t *r, rt_req_t *q)
{
    /* Deadline order (batch.h): after every request that goes before it, found from the tail
     * (a new request mostly has the latest deadline: O(1)). */
    rt_req_t *after = r->tail;
    while (after && rt_batch_before(q->deadline, q->id, after->deadline, after->id))
        after = after->prev;
    q->prev = after;
    q->next = after ? after->next : r->head;
    if (q->next) q->next->prev = q;
    else r->tail = q;
    if (after) after->next = q;
    else r->head = q;
    r->n_req++;
    pdm_metric_set(r->m.queue, NULL, r->n_req);
}

/* PrefillResults the current group attempt waits for: 1 for a solo task, else one a rank. */
static uint32_t rt_req_ranks_expected(const pdm_router_t *r, const rt_req_t *q)
{
    return q->solo_rank >= 0 ? 1 : r->groups[q->group].size;
}

/* Whether rank k of its group runs the current attempt's PrefillTask. */
static int rt_req_has_rank(const rt_req_t *q, uint32_t k)
{
    return q->solo_rank < 0 || (uint32_t)q->solo_rank == k;
}

/* Rank k of g is done with one of its tasks. */
static void rt_rank_done(rt_group_t *g, uint32_t k)
{
    if (g->rank_tasks[k] > 0) g->rank_tasks[k]--;
    if (!g->rank_tasks[k]) g->rank_free_at[k] = pdm_now();
}

/* Gives back what the current attempt holds; cancel: tell the decode node to drop it. */
static void rt_req_release_nodes(pdm_router_t *r, rt_req_t *q, int cancel)
{
    if (q->dnode >= 0) {
        rt_node_t *n = &r->nodes[q->dnode];
        if (n->epoch == q->dnode_epoch) {
            n->tasks--;
            n->kv_reserved -= q->kv_held;
            if (n->kv_reserved < 0) n->kv_reserved = 0;
            if (cancel && !n->dead) {
                Pdmesh__CancelTask c = PDMESH__CANCEL_TASK__INIT;
                c.task_id = q->id;
                c.attempt = q->attempt;
                rt_send(r->node_sock, n->ident, n->ident_len, PDMESH__MSG_TYPE__MSG_CANCEL_TASK,
                        &c.base);
            }
        }
        q->dnode = -1;
    }
    if (q->group >= 0) {
        rt_group_t *g = &r->groups[q->group];
        if (q->ranks_done < rt_req_ranks_expected(r, q) && g->inflight > 0) {
            g->inflight--;
            if (q->solo_rank >= 0 && g->solo_inflight > 0) g->solo_inflight--;
        }
        /* the ranks that did not answer are taken as free: a failed attempt suspects the
         * group for a lease, a finished request no longer waits for them */
        for (uint32_t k = 0; k < g->size && k < PDM_PREFILL_MAX_RANKS; k++)
            if (rt_req_has_rank(q, k) && !(q->ranks_answered >> k & 1)) {
                rt_rank_done(g, k);
                /* A rank that still queues the task drops it (prefill_node/main.c); one that
                 * runs it finishes it within the task's deadline. */
                rt_node_t *m = g->member[k] >= 0 ? &r->nodes[g->member[k]] : NULL;
                if (cancel && m && !m->dead && m->epoch == q->group_epochs[k]) {
                    Pdmesh__CancelTask c = PDMESH__CANCEL_TASK__INIT;
                    c.task_id = q->id;
                    c.attempt = q->attempt;
                    rt_send(r->node_sock, m->ident, m->ident_len,
                            PDMESH__MSG_TYPE__MSG_CANCEL_TASK, &c.base);
                }
            }
        if (q->reuse_pending) g->reuse_pending = 0;
        q->group = -1;
    }
    q->reuse_pending = 0;
    if (q->batch_id) { /* out of its batch: the others may be all that is awaited now; the
                        * send waits for the next scheduling pass (rt_batch_send_pending),
                        * since sending may end members, and callers walk the queue */
        q->batch_id = 0;
        q->batch_ready = 0;
        r->batch_pending = 1;
    }
}

static const char *rt_outcome(int code)
{
    switch (code) {
    case PDMESH__ERROR_CODE__ERR_CANCELLED: return "cancelled";
    case PDMESH__ERROR_CODE__ERR_DEADLINE_EXCEEDED: return "deadline";
    case PDMESH__ERROR_CODE__ERR_OVERLOADED: return "overloaded";
    case PDMESH__ERROR_CODE__ERR_UNAVAILABLE: return "unavailable";
    case PDMESH__ERROR_CODE__ERR_INVALID_ARGUMENT: return "invalid";
    default: return "error";
    }
}

void rt_leader_end(pdm_router_t *r, rt_req_t *q, int code, const char *msg, int cancel)
{
    for (uint32_t i = 0; i < q->n_samples && i < RT_MAX_CHOICES; i++) {
        rt_req_t *c = q->choice[i];
        if (!c) continue;
        q->choice[i] = NULL;
        c->leader = NULL;
        c->state = RQ_QUEUED;
        c->attempt = PDM_MAX(c->attempt, q->attempt); /* attempts go on from the leader's */
        c->resumed_choice = 1;
        if (code) { /* ends with the leader's error at the next scheduling pass */
            c->fail_code = code;
            snprintf(c->fail_msg, sizeof(c->fail_msg), "%s", msg ? msg : "failed");
        } else if (c->n_gen > 0) { /* goes on alone from its delivered tokens */
            c->migrations++;
            pdm_metric_inc(r->m.migrations, NULL, 1);
        }
    }
    rt_req_release_nodes(r, q, cancel);
    pdm_log_info("router: request %llu (%u choices) ends: %s", (unsigned long long)q->id,
                 q->n_samples, code ? msg : cancel ? "its choices go on alone" : "done");
    rt_req_unlink_free(r, q);
}

void rt_req_fail(pdm_router_t *r, rt_req_t *q, int code, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    if (q->n_samples) { /* a leader has no sink: its choices end with its error */
        rt_leader_end(r, q, code, msg, 1);
        return;
    }
    if (q->leader) q->leader->choice_failed = 1; /* its sample need not run to its end */
    rt_req_release_nodes(r, q, 1);
    pdm_metric_inc(r->m.requests, rt_outcome(code), 1);
    pdm_log_info("router: request %llu ends: %s", (unsigned long long)q->id, msg);
    pdm_router_sink_t sink = q->sink;
    rt_req_unlink_free(r, q);
    if (sink.on_error) sink.on_error(sink.ctx, code, msg);
}

/* Longest stop-string match position in text (or text_len) and the hold-back length. */
static size_t rt_stop_cut(const rt_req_t *q, size_t *hold)
{
    size_t cut = q->text_len, maxlen = 0;
    for (size_t i = 0; i < q->n_stops; i++) {
        size_t l = strlen(q->stops[i]);
        maxlen = PDM_MAX(maxlen, l);
        char *hit = q->text ? strstr(q->text, q->stops[i]) : NULL;
        if (hit && (size_t)(hit - q->text) < cut) cut = (size_t)(hit - q->text);
    }
    *hold = maxlen ? maxlen - 1 : 0;
    return cut;
}

static int rt_text_append(rt_req_t *q, const char *s, size_t n)
{
    if (q->text_len + n + 1 > q->text_cap) {
        size_t cap = PDM_MAX(q->text_cap * 2, q->text_len + n + 256);
        char *t = realloc(q->text, cap);
        if (!t) return PDM_ENOMEM;
        q->text = t;
        q->text_cap = cap;
    }
    memcpy(q->text + q->text_len, s, n);
    q->text_len += n;
    q->text[q->text_len] = 0;
    return PDM_OK;
}

/* A store of log-probability entries: per token i, `stride` slots at ids/vals[i * stride]
 * (the token itself, then its alternatives) and n[i] alternatives kept, -1 when missing.
 * The completion's (lp_*) and the prompt's (plp_*) have this shape. */
typedef struct {
    int32_t *ids;
    float *vals;
    int8_t *n;
    uint32_t stride;
    const int32_t *tokens; /* [i] the token whose entry slot i holds */
} rt_lp_store_t;

static rt_lp_store_t rt_lp_gen(rt_req_t *q)
{
    return (rt_lp_store_t){q->lp_ids, q->lp_vals, q->lp_n, q->lp_stride, q->gen};
}

static rt_lp_store_t rt_lp_prompt(rt_req_t *q)
{
    return (rt_lp_store_t){q->plp_ids, q->plp_vals, q->plp_n, q->plp_stride, q->prompt};
}

/* Stores the log-probabilities of token i (lp NULL or malformed: missing); 1 if stored. */
static int rt_lp_store(const rt_lp_store_t *s, uint32_t i, int32_t tok,
                       const Pdmesh__SampledLogprob *lp, uint32_t n_vocab)
{
    int32_t *ids = s->ids + (size_t)i * s->stride;
    float *vals = s->vals + (size_t)i * s->stride;
    s->n[i] = -1;
    if (!lp || lp->n_top_ids != lp->n_top_logprobs || lp->n_top_ids > s->stride - 1) return 0;
    for (size_t k = 0; k < lp->n_top_ids; k++)
        if (lp->top_ids[k] < 0 || (uint32_t)lp->top_ids[k] >= n_vocab) return 0;
    ids[0] = tok;
    vals[0] = lp->logprob;
    if (lp->n_top_ids) { /* (none: NULL arrays) */
        memcpy(ids + 1, lp->top_ids, sizeof(int32_t) * lp->n_top_ids);
        memcpy(vals + 1, lp->top_logprobs, sizeof(float) * lp->n_top_ids);
    }
    s->n[i] = (int8_t)lp->n_top_ids;
    return 1;
}

/* The client's TokenLogprob messages of tokens [from, from + n) of a store: one allocation
 * (free with free()) holding the messages, their pointer arrays and the tokens' texts;
 * *out_list is the list of the n messages. NULL when out of memory. */
static void *rt_lp_build(pdm_router_t *r, const rt_lp_store_t *s, uint32_t from, size_t n,
                         Pdmesh__TokenLogprob ***out_list)
{
    const pdm_tokenizer_t *tk = r->model->tokenizer;
    char piece[256];
    size_t entries = 0, text_bytes = 0;
    for (size_t i = 0; i < n; i++) {
        const int k = s->n[from + i];
        const int32_t *ids = s->ids + (size_t)(from + i) * s->stride;
        for (int j = 0; j <= (k < 0 ? 0 : k); j++) {
            int32_t id = k < 0 ? s->tokens[from + i] : ids[j];
            int w = pdm_tokenizer_token_bytes(tk, id, 1, piece, sizeof(piece));
            text_bytes += w > 0 ? (size_t)w : 0;
        }
        entries += k < 0 ? 1 : 1 + (size_t)k;
    }
    const size_t need = sizeof(Pdmesh__TokenLogprob *) * (n + entries) +
                        sizeof(Pdmesh__TokenLogprob) * entries + text_bytes + 1;
    char *block = malloc(need);
    if (!block) return NULL;
    Pdmesh__TokenLogprob **list = (Pdmesh__TokenLogprob **)block;
    Pdmesh__TokenLogprob **tops = list + n;
    Pdmesh__TokenLogprob *msgs = (Pdmesh__TokenLogprob *)(tops + entries);
    char *text = (char *)(msgs + entries);
    for (size_t i = 0; i < n; i++) {
        const uint32_t t = from + (uint32_t)i;
        const int k = s->n[t];
        const int32_t *ids = s->ids + (size_t)t * s->stride;
        const float *vals = s->vals + (size_t)t * s->stride;
        for (int j = 0; j <= (k < 0 ? 0 : k); j++) {
            Pdmesh__TokenLogprob *m = msgs++;
            pdmesh__token_logprob__init(m);
            if (j == 0) list[i] = m;
            else tops[j - 1] = m;
            m->token = k < 0 ? s->tokens[t] : ids[j];
            if (k < 0) {
                m->missing = 1;
            } else {
                m->logprob = vals[j];
            }
            int w = pdm_tokenizer_token_bytes(tk, m->token, 1, text, sizeof(piece));
            if (w > 0) {
                m->text.data = (uint8_t *)text;
                m->text.len = (size_t)w;
                text += w;
            }
        }
        if (k > 0) {
            list[i]->top = tops;
            list[i]->n_top = (size_t)k;
            tops += k;
        }
    }
    *out_list = list;
    return block;
}

int rt_req_resume(pdm_router_t *r, rt_req_t *q, const int32_t *toks, size_t n,
                  uint32_t text_bytes)
{
    if (n > q->max_new)
        return pdm_error_set(PDM_EINVAL, "resume: %zu tokens delivered, over max_tokens %u", n,
                             q->max_new);
    for (size_t k = 0; k < n; k++) {
        int32_t t = toks[k];
        if (t < 0 || (uint32_t)t >= r->model->hp.n_vocab)
            return pdm_error_set(PDM_EINVAL, "resume: token %d is outside the vocabulary", t);
        if (q->lp_stride) { /* the first router computed them: missing here */
            rt_lp_store_t ls = rt_lp_gen(q);
            rt_lp_store(&ls, q->n_gen, t, NULL, r->model->hp.n_vocab);
        }
        q->gen[q->n_gen++] = t;
        char piece[256];
        int w = pdm_detok_feed(&q->detok, r->model->tokenizer, t, piece, sizeof(piece));
        if (w > 0 && rt_text_append(q, piece, (size_t)w))
            return pdm_error_set(PDM_ENOMEM, "resume: out of memory");
    }
    /* what the client has of the text (a partial UTF-8 character or a held stop-string
     * prefix may have stayed behind) */
    q->text_sent = PDM_MIN((size_t)text_bytes, q->text_len);
    return PDM_OK;
}

/* Delivers tokens [index, index + n) (duplicates and gaps ignored), with their log-
 * probabilities lps[n] (NULL: none came); 1 if that ended the request (a stop string), and q
 * is gone. */
static int rt_req_tokens(pdm_router_t *r, rt_req_t *q, uint32_t index, const int32_t *toks,
                         size_t n, Pdmesh__SampledLogprob *const *lps)
{
    uint32_t first = q->n_gen;
    for (size_t k = 0; k < n; k++) {
        uint32_t idx = index + (uint32_t)k;
        if (idx < q->n_gen) continue;     /* already delivered (migration, duplicates) */
        if (idx > q->n_gen || q->n_gen >= q->max_new) break; /* a gap: the result fills it */
        int32_t t = toks[k];
        if (t < 0 || !r->model || (uint32_t)t >= r->model->hp.n_vocab) break;
        if (q->lp_stride) {
            rt_lp_store_t ls = rt_lp_gen(q);
            rt_lp_store(&ls, q->n_gen, t, lps ? lps[k] : NULL, r->model->hp.n_vocab);
        }
        q->gen[q->n_gen++] = t;
        char piece[256];
        int w = pdm_detok_feed(&q->detok, r->model->tokenizer, t, piece, sizeof(piece));
        if (w > 0) rt_text_append(q, piece, (size_t)w);
    }
    if (q->n_gen == first) return 0;
    double now = pdm_now();
    if (first == 0) {
        q->t_first = now;
        pdm_metric_observe(r->m.ttft, NULL, now - q->t_arrival);
    }
    q->t_last = now;
    size_t hold, cut = rt_stop_cut(q, &hold);
    size_t safe = q->text_len > hold ? q->text_len - hold : 0;
    safe = PDM_MIN(safe, cut);
    char *chunk = NULL;
    if (safe > q->text_sent) chunk = strndup(q->text + q->text_sent, safe - q->text_sent);
    if (safe > q->text_sent) q->text_sent = safe;
    Pdmesh__TokenLogprob **lpl = NULL;
    rt_lp_store_t ls = rt_lp_gen(q);
    void *lp_block = q->lp_stride ? rt_lp_build(r, &ls, first, q->n_gen - first, &lpl) : NULL;
    if (q->sink.on_tokens)
        q->sink.on_tokens(q->sink.ctx, first, q->gen + first, q->n_gen - first, chunk ? chunk : "",
                          lp_block ? lpl : NULL);
    free(lp_block);
    free(chunk);
    if (cut < q->text_len) {
        /* A stop string the decode node could not see (it began before a migration): end
         * the request here and release the node. */
        rt_req_release_nodes(r, q, 1);
        rt_req_finish(r, q, PDMESH__FINISH_REASON__FINISH_STOP);
        return 1;
    }
    return 0;
}

/* The tool calls in a chat's generated text (model/chat.h's parser, the one the HTTP front end
 * uses) as OpenAI's tool_calls list in JSON (*calls, malloc'd) and the text outside them
 * (*content); both NULL when there is no call (or no memory). */
static void rt_tool_calls(const char *text, char **calls, char **content)
{
    pdm_chat_tool_call_t *tc = NULL;
    int n = 0;
    char *rest = NULL;
    *calls = *content = NULL;
    if (pdm_chat_tool_calls_parse(text, &tc, &n, &rest) || n == 0) {
        pdm_chat_tool_calls_free(tc, n);
        free(rest);
        return;
    }
    cJSON *list = cJSON_CreateArray();
    for (int i = 0; list && i < n; i++) {
        cJSON *c = cJSON_CreateObject(), *fn = NULL;
        uint8_t rnd[12];
        char id[32] = "call_";
        if (!pdm_random_bytes(rnd, sizeof(rnd)))
            for (int k = 0; k < 12; k++) snprintf(id + 5 + 2 * k, 3, "%02x", rnd[k]);
        if (c) cJSON_AddItemToArray(list, c);
        if (c) cJSON_AddStringToObject(c, "id", id);
        if (c) cJSON_AddStringToObject(c, "type", "function");
        if (c) fn = cJSON_AddObjectToObject(c, "function");
        if (fn) cJSON_AddStringToObject(fn, "name", tc[i].name);
        if (fn) cJSON_AddStringToObject(fn, "arguments", tc[i].arguments);
    }
    pdm_chat_tool_calls_free(tc, n);
    *calls = list ? cJSON_PrintUnformatted(list) : NULL;
    cJSON_Delete(list);
    *content = rest;
    if (!*calls) {
        free(rest);
        *content = NULL;
    }
}

void rt_req_finish(pdm_router_t *r, rt_req_t *q, int finish)
{
    rt_req_release_nodes(r, q, 0);
    char tail[16];
    int w = pdm_detok_flush(&q->detok, tail, sizeof(tail));
    if (w > 0) rt_text_append(q, tail, (size_t)w);
    size_t hold, cut = rt_stop_cut(q, &hold);
    if (cut < q->text_len) {
        q->text_len = cut;
        q->text[cut] = 0;
        finish = PDMESH__FINISH_REASON__FINISH_STOP;
    }
    if (q->text_len > q->text_sent && q->sink.on_tokens) /* text held back for stop strings */
        q->sink.on_tokens(q->sink.ctx, q->n_gen, NULL, 0, q->text + q->text_sent, NULL);
    double now = pdm_now();
    Pdmesh__GenerateResult res = PDMESH__GENERATE_RESULT__INIT;
    Pdmesh__Usage u = PDMESH__USAGE__INIT;
    res.request_id = q->client_id;
    res.finish = finish;
    res.tokens = q->gen;
    res.n_tokens = q->n_gen;
    res.text = q->text ? q->text : "";
    u.prompt_tokens = q->n_prompt;
    u.completion_tokens = q->n_gen;
    u.ttft_ms = q->t_first > 0 ? (q->t_first - q->t_arrival) * 1e3 : 0;
    u.tpot_ms = q->n_gen > 1 ? (q->t_last - q->t_first) * 1e3 / (q->n_gen - 1) : 0;
    u.total_ms = (now - q->t_arrival) * 1e3;
    u.kv_bytes = q->kv_bytes;
    u.prefill_method = q->method;
    u.prefill_group = q->group_name;
    u.decode_node = q->dnode_name;
    u.attempts = q->attempt;
    u.cached_tokens = rt_req_reused(q);
    u.pool_prefix_tokens = q->pool_delta;
    Pdmesh__TokenRange rg[PDM_PREFILL_MAX_PLAN], *rgp[PDM_PREFILL_MAX_PLAN];
    pdm_prefill_ranges_to_wire(q->plan, q->n_plan, rg, rgp);
    u.prefill_ranges = rgp;
    u.n_prefill_ranges = (size_t)q->n_plan;
    res.usage = &u;
    if (q->n_gen > 1) pdm_metric_observe(r->m.tpot, NULL, u.tpot_ms / 1e3);
    if (q->kv_bytes && !q->shared_kv) { /* a shared prompt's: once, by its leader */
        pdm_metric_inc(r->m.kv_bytes, NULL, (double)q->kv_bytes);
        pdm_metric_observe(r->m.kv_time, NULL, q->kv_seconds);
    }
    pdm_metric_inc(r->m.requests, "ok", 1);
    pdm_router_sink_t sink = q->sink;
    rt_beams_result(q, &res);
    Pdmesh__TokenLogprob **lpl = NULL, **plpl = NULL;
    rt_lp_store_t ls = rt_lp_gen(q), pls = rt_lp_prompt(q);
    void *lp_block = q->lp_stride ? rt_lp_build(r, &ls, 0, q->n_gen, &lpl) : NULL;
    if (lp_block) {
        res.logprobs = lpl;
        res.n_logprobs = q->n_gen;
    }
    void *plp_block = q->plp_sent ? rt_lp_build(r, &pls, 0, q->n_prompt, &plpl) : NULL;
    if (plp_block) {
        res.prompt_logprobs = plpl;
        res.n_prompt_logprobs = q->n_prompt;
    }
    char *calls = NULL, *content = NULL;
    if (q->tools) rt_tool_calls(q->text ? q->text : "", &calls, &content);
    if (calls) {
        res.tool_calls_json = calls;
        res.tool_content = content ? content : "";
    }
    if (sink.on_result) sink.on_result(sink.ctx, &res);
    free(calls);
    free(content);
    free(lp_block);
    free(plp_block);
    rt_req_unlink_free(r, q);
}

/* The current attempt failed (msg says why): back to QUEUED, or the request ends when it has
 * used its attempts. */
static void rt_attempt_failed(pdm_router_t *r, rt_req_t *q, int code, const char *msg)
{
    if (q->group >= 0) { /* the retry goes elsewhere (another group or local prefill) */
        r->groups[q->group].suspect_until = pdm_now() + r->cfg.lease_ms / 1e3;
        /* Its ranks may have dropped their conversation (or never held the one assumed):
         * forget the mirror and the pool's, and have the ranks empty theirs with the next
         * task, which starts afresh. */
        rt_group_t *gr = &r->groups[q->group];
        pdm_prefill_conv_reset(&gr->conv);
        pdm_prefill_pool_clear(&gr->pool);
        gr->pool_reset = 1;
    }
    rt_req_release_nodes(r, q, 1);
    q->retries++;
    /* a failed delta transfer is not tried again: whatever went wrong (a node or rank that
     * does not know the fields, a stream that broke), the retry streams the whole prompt */
    if (q->pool_delta) q->no_delta = 1;
    q->pool_delta = 0;
    pdm_log_warn("router: request %llu attempt %u failed: %s", (unsigned long long)q->id,
                 q->attempt, msg);
    if (q->n_samples) {
        /* OpenAI's n: once a choice has tokens the choices go on alone, each a migration
         * from its own delivered tokens with its own seed (finished ones are not redone);
         * before that the shared attempt is retried like any request. */
        int delivered = 0;
        for (uint32_t i = 0; i < q->n_samples && i < RT_MAX_CHOICES; i++)
            delivered |= q->choice[i] && q->choice[i]->n_gen > 0;
        if (delivered) {
            rt_leader_end(r, q, 0, NULL, 0);
            return;
        }
    }
    if ((int)q->retries >= r->cfg.max_attempts || q->attempt >= 15) {
        rt_req_fail(r, q, code == PDMESH__ERROR_CODE__ERR_DEADLINE_EXCEEDED ? code
                                                                             : PDMESH__ERROR_CODE__ERR_UNAVAILABLE,
                    "request failed after %u attempts; last: %s", q->attempt, msg);
        return;
    }
    if (q->n_gen > 0) {
        q->migrations++;
        pdm_metric_inc(r->m.migrations, NULL, 1);
    } else {
        pdm_metric_inc(r->m.retries, NULL, 1);
    }
    q->state = RQ_QUEUED;
    q->started = 0;
}

/* ---------------------------------------------------------------- dispatch and tasks */

/* A whole-group task goes out: the mirror does what the ranks will do before and after it
 * (pool.h, then conv.c), in the order the tasks are sent, which is the order the ranks run
 * them. A task that fails resets the mirror (rt_attempt_failed). */
static void rt_group_mirror_task(pdm_router_t *r, rt_group_t *gr, int reset, uint64_t source,
                                 int64_t budget, int method, const int *chunks,
                                 const int32_t *tokens, int32_t start, int32_t end)
{
    const int32_t T = end - start;
    pdm_prefill_range_t plan[PDM_PREFILL_MAX_PLAN];
    int n_prefix;
    if (reset) {
        pdm_prefill_pool_clear(&gr->pool);
        pdm_prefill_conv_reset(&gr->conv);
    }
    int loaded;
    if (pdm_prefill_pool_begin(&gr->pool, &gr->conv, source, start, &loaded)) {
        pdm_log_warn("router: group %s: its pool mirror is out of step (%s): reset",
                     gr->name, pdm_error_last());
        pdm_prefill_pool_clear(&gr->pool);
        gr->pool_reset = 1;
    }
    pdm_prefill_pool_set_budget(&gr->pool, budget); /* after, as the ranks do */
    int nr = pdm_prefill_conv_plan(&gr->conv, (pdm_prefill_method_t)method, (int)gr->size,
                                   start, T, chunks, 0, plan, &n_prefix);
    if (nr < 0 || pdm_prefill_conv_commit(&gr->conv, (pdm_prefill_method_t)method,
                                          (int)gr->size, start, tokens + start, T, plan, nr))
        pdm_prefill_conv_reset(&gr->conv); /* out of step: forget (a smaller view is safe) */
}

static void rt_group_mirror(pdm_router_t *r, rt_req_t *q)
{
    rt_group_mirror_task(r, &r->groups[q->group], q->pool_reset, q->pool_source, q->pool_budget,
                         q->method_id, q->chunks, q->prompt, (int32_t)q->cached_tokens,
                         (int32_t)q->n_prompt);
}

/* Every rank of the request's group finished its task: its counters. */
static void rt_group_prefilled(pdm_router_t *r, rt_req_t *q)
{
    rt_group_t *gr = &r->groups[q->group];
    const int32_t T = (int32_t)q->n_prompt - (int32_t)q->cached_tokens;
    const int32_t start = (int32_t)rt_req_reused(q);
    gr->pool_tasks++;
    pdm_metric_inc(r->m.group_prefill_tokens, NULL, (double)T);
    pdm_metric_set(r->m.group_pool_tokens, gr->name, (double)gr->pool.tokens);
    pdm_metric_set(r->m.group_pool_entries, gr->name, (double)gr->pool.n);
    pdm_metric_set(r->m.group_pool_evictions, gr->name, (double)gr->pool.evictions);
    if (start > 0) {
        pdm_metric_inc(r->m.prefix_hits, NULL, 1);
        pdm_metric_inc(r->m.prefix_tokens, NULL, (double)start);
        gr->pool_hits++;
        gr->pool_hit_tokens += (uint64_t)start;
    }
}

/* Whether a whole-group task of group g other than q was dispatched and not sent yet: it may
 * go out before q, so the mirror does not yet show what the ranks will hold for q. */
static int rt_group_unsent(const pdm_router_t *r, int g, const rt_req_t *q)
{
    for (const rt_req_t *w = r->head; w; w = w->next)
        if (w != q && w->group == g && w->state == RQ_RESERVING && w->solo_rank < 0) return 1;
    return 0;
}

/* ---------------------------------------------------------------- chunked prefill */
/*
 * Chunked prefill (issue 19; the chunked prefills of Sarathi-Serve, Agrawal et al., OSDI '24,
 * §4, applied here between the tasks of a prefill group instead of inside one batch). A long
 * prompt holds its group for its whole prefill, and every prompt queued behind it waits that
 * long. With prefill_chunk_tokens C, a request that has more than C tokens left for a
 * whole-group task first has the group compute its prompt C tokens at a time. Each chunk is
 * a partial prefill of the prompt so far (PrefillTask.start/prefix, as a follow-up turn is),
 * sent under its own task id, with no decode node and nothing streamed. The request stays
 * QUEUED meanwhile, so what the scheduler sends the group next (deadline order, up to
 * group_inflight tasks) runs between two chunks, and the group's pool (prefill_node/pool.h)
 * keeps the chunked conversation while it does: chunking needs a pool budget that holds the
 * whole prompt. Once at most C tokens are left, the request is dispatched as any other: its
 * task continues the conversation, computes the rest and streams the whole prompt's KV to
 * its decode node (the chunks' rows from the ranks' caches, as for a follow-up turn).
 * Chunks are only a way there: one that fails, is lost with its group or finds the group
 * holding less than it left (the pool lost the conversation) stops the chunking, and the
 * request goes whole. The mirror follows a chunk when it is sent, as it follows any task.
 */

/* The request whose chunk in flight is task `task_id`, when `node` is one of the ranks it went
 * to (same registration); else NULL. */
static rt_req_t *rt_chunk_req(pdm_router_t *r, int node, uint64_t task_id, uint32_t attempt)
{
    if (attempt != 1 || !task_id) return NULL;
    for (rt_req_t *q = r->head; q; q = q->next) {
        if (q->chunk_id != task_id) continue;
        const rt_node_t *n = &r->nodes[node];
        const rt_group_t *gr = &r->groups[q->chunk_group];
        return n->rank < gr->size && gr->member[n->rank] == node &&
                       q->chunk_epochs[n->rank] == n->epoch ? q : NULL;
    }
    return NULL;
}

/* Gives back what q's chunk in flight holds of its group; the ranks that did not answer are
 * taken as free. With `cancel` (the chunk failed, the mirror is reset), they are told to drop
 * it if it still waits there: a follower's copy that rank 0 refused is never forwarded, and
 * would hold it (a draining follower waits for its copies). Otherwise the chunk is bounded
 * work that the mirror counts on, and runs. */
static void rt_chunk_release(pdm_router_t *r, rt_req_t *q, int cancel)
{
    if (!q->chunk_id) return;
    rt_group_t *gr = &r->groups[q->chunk_group];
    if (gr->inflight > 0) gr->inflight--;
    for (uint32_t k = 0; k < gr->size && k < PDM_PREFILL_MAX_RANKS; k++) {
        if (q->chunk_answered >> k & 1) continue;
        rt_rank_done(gr, k);
        rt_node_t *m = gr->member[k] >= 0 ? &r->nodes[gr->member[k]] : NULL;
        if (cancel && m && !m->dead && m->epoch == q->chunk_epochs[k]) {
            Pdmesh__CancelTask c = PDMESH__CANCEL_TASK__INIT;
            c.task_id = q->chunk_id;
            c.attempt = 1;
            rt_send(r->node_sock, m->ident, m->ident_len, PDMESH__MSG_TYPE__MSG_CANCEL_TASK,
                    &c.base);
        }
    }
    q->chunk_id = 0;
}

/* q's chunk failed (why): the group's ranks may hold less than the mirror says, so both start
 * afresh (as after a failed attempt); with `stop`, q goes whole from now on. */
static void rt_chunk_failed(pdm_router_t *r, rt_req_t *q, const char *why, int stop)
{
    rt_group_t *gr = &r->groups[q->chunk_group];
    pdm_log_warn("router: request %llu: its prefill chunk %u-%u on group %s failed: %s%s",
                 (unsigned long long)q->id, q->chunk_start, q->chunk_end, gr->name, why,
                 stop ? " (the request goes whole)" : "");
    pdm_prefill_conv_reset(&gr->conv);
    pdm_prefill_pool_clear(&gr->pool);
    gr->pool_reset = 1;
    rt_chunk_release(r, q, 1);
    if (stop) q->chunk_off = 1;
    pdm_metric_inc(r->m.prefill_chunk_failures, NULL, 1);
}

int rt_req_chunk(pdm_router_t *r, rt_req_t *q, int g)
{
    rt_group_t *gr = &r->groups[g];
    /* (at least a prefix block: smaller chunks would not be reused) */
    const int32_t C = r->cfg.prefill_chunk_tokens > 0
                          ? PDM_MAX(r->cfg.prefill_chunk_tokens, r->cfg.block_tokens)
                          : 0,
                  n = (int32_t)q->n_prompt;
    const int64_t budget = rt_group_pool_budget(r, gr);
    pdm_prefill_method_t want = PDM_PREFILL_AUTO;
    pdm_prefill_method_parse(r->cfg.method, &want);
    /* (prompt log-probabilities need every row computed in the request's own task; tsp has
     * no partial prefill) */
    if (C <= 0 || n <= C || q->chunk_off || q->chunk_id || !r->cfg.prefix_reuse || q->n_gen > 0 ||
        (q->want_plp && !q->plp_sent) || want == PDM_PREFILL_TSP || budget < n)
        return 0;
    /* Another task of the group waits for its decode node's reservation and goes out first:
     * planned now, the request's task could not count on the chunks (no reuse), so it waits. */
    if (rt_group_unsent(r, g, q) || gr->reuse_pending) return q->chunks_done ? -1 : 0;
    if (!gr->has_cost) {
        rt_adapt_cost_init(&gr->cost, &r->model->hp, (int)gr->size,
                           r->has_calib ? &r->calib : NULL);
        gr->has_cost = 1;
    }
    pdm_prefill_task_plan_params_t pp = {
        .followup = {.method = want, .ranks = (int)gr->size, .tokens = q->prompt,
                     .n_tokens = n, .min_cached = r->cfg.block_tokens, .reuse = 1},
        .hp = &r->model->hp, .table = r->has_table ? &r->table : NULL,
        .calib = r->has_calib ? &r->calib : NULL, .fallback = 1};
    uint64_t source = 0;
    const pdm_prefill_conv_t *from = pdm_prefill_pool_pick(&gr->pool, &gr->conv, &pp.followup,
                                                           &source);
    const int32_t start = pdm_prefill_conv_followup_start(from, &pp.followup);
    if (q->chunks_done && start < (int32_t)q->chunk_end) {
        q->chunk_off = 1; /* the group no longer holds what the chunks computed */
        pdm_metric_inc(r->m.prefill_chunk_failures, NULL, 1);
        pdm_log_info("router: request %llu: group %s holds %d of the %u tokens its chunks "
                     "computed: it goes whole", (unsigned long long)q->id, gr->name, start,
                     q->chunk_end);
        return 0;
    }
    if (n - start <= C) return 0; /* the rest goes in the request's own task */
    const int32_t end = start + C;
    pp.followup.n_tokens = end;
    pdm_prefill_task_plan_t plan;
    if (pdm_prefill_conv_plan_task(from, &pp, &plan) || plan.start != start) {
        q->chunk_off = 1; /* a method that cannot continue there: whole */
        return 0;
    }
    if (!plan.start) source = 0;
    else if (!source) source = pdm_prefill_conv_id(&gr->conv);
    uint32_t chunks[PDM_PREFILL_MAX_RANKS];
    Pdmesh__PrefillTask t = PDMESH__PREFILL_TASK__INIT;
    q->chunk_id = ++r->next_id; /* its own task: the request's attempts are not touched */
    t.task_id = q->chunk_id;
    t.attempt = 1;
    t.method = (char *)pdm_prefill_method_name(plan.method);
    t.start = (uint32_t)start;
    t.tokens = q->prompt + start;
    t.n_tokens = (size_t)(end - start);
    t.prefix = q->prompt;
    t.n_prefix = (size_t)start;
    t.formation = gr->formation;
    t.pool_source = source;
    t.pool_tokens = (uint64_t)budget;
    t.pool_reset = gr->pool_reset;
    if (plan.has_chunks) {
        for (uint32_t k = 0; k < gr->size; k++) chunks[k] = (uint32_t)plan.chunks[k];
        t.chunks = chunks;
        t.n_chunks = gr->size;
    }
    const double now = pdm_now(), left = q->deadline - now;
    t.deadline_ms = left > 0 ? (uint32_t)(left * 1e3) : 1;
    rt_group_mirror_task(r, gr, gr->pool_reset, source, budget, (int)plan.method, plan.chunks,
                         q->prompt, start, end);
    gr->pool_reset = 0;
    if (!q->chunks_done) q->chunk_reused = (uint32_t)start; /* a follow-up's cached prefix */
    q->chunk_group = g;
    q->chunk_start = (uint32_t)start;
    q->chunk_end = (uint32_t)end;
    q->chunk_answered = 0;
    q->chunk_seconds = 0;
    /* a rank that fails answers within its group timeout; this only bounds a lost answer */
    q->chunk_until = now + 60;
    gr->inflight++;
    double at = now;
    for (uint32_t k = 0; k < gr->size; k++) at = PDM_MAX(at, gr->rank_free_at[k]);
    at += rt_adapt_tR(&gr->cost, end - start, start);
    for (uint32_t k = 0; k < gr->size; k++) {
        gr->rank_free_at[k] = at;
        gr->rank_tasks[k]++;
        q->chunk_epochs[k] = r->nodes[gr->member[k]].epoch;
    }
    pdm_metric_inc(r->m.prefill_tokens, "group", (double)(end - start));
    pdm_log_info("router: request %llu: prefill chunk %d-%d of %d -> %s (%s, task %llu)",
                 (unsigned long long)q->id, start, end, n, gr->name, t.method,
                 (unsigned long long)q->chunk_id);
    for (uint32_t k = 0; k < gr->size; k++) {
        rt_node_t *m = &r->nodes[gr->member[k]];
        t.epoch = m->epoch;
        if (rt_send(r->node_sock, m->ident, m->ident_len, PDMESH__MSG_TYPE__MSG_PREFILL_TASK,
                    &t.base)) {
            rt_chunk_failed(r, q, "cannot reach a prefill rank", 1);
            return 0;
        }
    }
    return 1;
}

/* A rank's PrefillResult for q's chunk: when every rank answered, the chunk is done. */
static void rt_chunk_on_result(pdm_router_t *r, rt_req_t *q, int node,
                               const Pdmesh__PrefillResult *p)
{
    rt_group_t *gr = &r->groups[q->chunk_group];
    const uint32_t rank = r->nodes[node].rank;
    if (!p->ok) {
        char m2[512];
        snprintf(m2, sizeof(m2), "prefill rank %s: %s", r->nodes[node].id, rt_err_text(p->error));
        if (p->error && p->error->code == PDMESH__ERROR_CODE__ERR_KV_CORRUPT) {
            gr->pool_corrupt++;
            pdm_metric_inc(r->m.group_pool_corrupt, gr->name, 1);
        }
        rt_chunk_failed(r, q, m2, 1);
        return;
    }
    if (q->chunk_answered >> rank & 1) return;
    q->chunk_answered |= 1ull << rank;
    rt_rank_done(gr, rank);
    if (p->seconds > q->chunk_seconds) q->chunk_seconds = p->seconds;
    for (uint32_t k = 0; k < gr->size; k++)
        if (!(q->chunk_answered >> k & 1)) return;
    const int32_t start = (int32_t)q->chunk_start, T = (int32_t)q->chunk_end - start;
    if (gr->inflight > 0) gr->inflight--;
    rt_adapt_learn(&gr->cost, 0, T, start, q->chunk_seconds);
    pdm_metric_inc(r->m.group_prefill_tokens, NULL, (double)T);
    pdm_metric_inc(r->m.prefill_chunks, NULL, 1);
    pdm_metric_set(r->m.group_pool_tokens, gr->name, (double)gr->pool.tokens);
    pdm_metric_set(r->m.group_pool_entries, gr->name, (double)gr->pool.n);
    pdm_metric_set(r->m.group_pool_evictions, gr->name, (double)gr->pool.evictions);
    q->chunks_done++;
    q->chunk_id = 0;
}

void rt_req_dispatch(pdm_router_t *r, rt_req_t *q, int d, int g, int solo_rank)
{
    rt_node_t *n = &r->nodes[d];
    q->attempt++;
    q->dnode = d;
    q->dnode_epoch = n->epoch;
    q->group = g;
    q->local = g < 0;
    q->base = q->n_gen;
    q->ranks_done = 0;
    q->ranks_answered = 0;
    q->prefill_seconds = 0;
    q->solo_rank = g >= 0 ? solo_rank : -1;
    q->started = 0;
    q->t_dispatch = pdm_now();
    q->sched_pass = r->sched_pass;
    q->cached_tokens = 0;
    q->n_plan = 0;
    q->pool_source = 0;
    q->pool_budget = 0;
    q->pool_reset = 0;
    /* delta transfer: chosen by the scheduler for a group attempt to the node whose pool
     * holds the prefix (schedule.c, rt_delta_prefix); not in a batch (whole prompts) */
    q->pool_delta = g >= 0 && !q->batch_id && q->delta_next < q->n_prompt ? q->delta_next : 0;
    q->delta_next = 0;
    snprintf(q->dnode_name, sizeof(q->dnode_name), "%s", n->id);
    const uint32_t remaining = q->max_new - q->n_gen;
    const uint32_t n_in = q->local ? q->n_prompt + q->n_gen : q->n_prompt;
    n->tasks++;
    q->kv_held = rt_kv_need(n, q, n_in, remaining, q->local);
    n->kv_reserved += q->kv_held;
    Pdmesh__DecodeTask t = PDMESH__DECODE_TASK__INIT;
    t.task_id = q->id;
    t.attempt = q->attempt;
    t.epoch = n->epoch;
    t.n_prompt = n_in;
    t.max_new = remaining;
    rt_beams_task(q, &t);
    int32_t *all = NULL;
    ProtobufCBinaryData addrs[PDM_PREFILL_MAX_RANKS];
    Pdmesh__TokenRange rg[PDM_PREFILL_MAX_PLAN], *rgp[PDM_PREFILL_MAX_PLAN];
    pdm_prefill_range_t cut[PDM_PREFILL_MAX_PLAN];
    if (q->local) {
        snprintf(q->method, sizeof(q->method), "local");
        q->group_name[0] = 0;
        all = malloc(sizeof(int32_t) * (n_in ? n_in : 1));
        if (!all) {
            rt_attempt_failed(r, q, PDMESH__ERROR_CODE__ERR_INTERNAL, "out of memory");
            return;
        }
        memcpy(all, q->prompt, sizeof(int32_t) * q->n_prompt);
        memcpy(all + q->n_prompt, q->gen, sizeof(int32_t) * q->n_gen);
        t.local_prefill = 1;
        t.prompt_tokens = all;
        t.n_prompt_tokens = n_in;
        pdm_metric_inc(r->m.prefill_tokens, "local", (double)n_in);
        /* A migration: the prompt ends with the tokens delivered so far; the sampler resumes
         * at step n_gen with them as history (model.h "Sampling"), and a sampled (not greedy)
         * request has them recomputed as first computed, so its seeded draws continue
         * exactly. */
        t.n_generated = q->n_gen;
        t.replay_generated = q->n_gen > 0 && (q->sp.temperature > 0 || q->resumed_choice);
        if (q->want_plp && !q->plp_sent) { /* a new prompt (no token delivered yet) */
            t.prompt_logprobs = 1;
            t.prompt_top_logprobs = q->plp_stride - 1;
        }
    } else {
        rt_group_t *gr = &r->groups[g];
        gr->inflight++;
        snprintf(q->group_name, sizeof(q->group_name), "%s", gr->name);
        for (uint32_t k = 0; k < gr->size; k++) {
            rt_node_t *m = &r->nodes[gr->member[k]];
            addrs[k].data = m->ucx;
            addrs[k].len = m->ucx_len;
            q->group_epochs[k] = m->epoch;
        }
        if (!gr->has_cost) {
            rt_adapt_cost_init(&gr->cost, &r->model->hp, (int)gr->size,
                               r->has_calib ? &r->calib : NULL);
            gr->has_cost = 1;
        }
        /* Where it starts, the method and partition, who computes what: the planner the
         * harness uses too (conv.c). Prefix reuse only while no other task of the group waits
         * to be sent: the mirror follows the tasks sent (rt_group_mirror), so it is then what
         * the ranks hold when this task arrives, tasks in flight included. */
        pdm_prefill_method_t want = PDM_PREFILL_AUTO;
        pdm_prefill_method_parse(r->cfg.method, &want);
        pdm_prefill_task_plan_params_t pp = {
            .followup = {.method = want, .ranks = (int)gr->size, .tokens = q->prompt,
                         .n_tokens = (int32_t)q->n_prompt, .min_cached = r->cfg.block_tokens,
                         .reuse = r->cfg.prefix_reuse && !rt_group_unsent(r, g, q) &&
                                  !gr->reuse_pending && !(q->want_plp && !q->plp_sent)},
            .hp = &r->model->hp, .table = r->has_table ? &r->table : NULL,
            .calib = r->has_calib ? &r->calib : NULL, .fallback = 1};
        pdm_prefill_task_plan_t plan_, *plan = &plan_;
        if (q->solo_rank >= 0) {
            /* A solo task: the whole prompt on one rank (the engine's prefill), streamed by
             * it alone; the group's conversation and its mirror stay as they are. */
            memset(plan, 0, sizeof(*plan));
            plan->method = PDM_PREFILL_SINGLE;
            plan->ranges[0] = (pdm_prefill_range_t){0, (int32_t)q->n_prompt, q->solo_rank, 0};
            plan->n_ranges = 1;
            /* (a batch's members after its lead run in the lead's task, not beside it) */
            if (gr->solo_inflight++ > 0 && (!q->batch_id || q->batch_id == q->id))
                pdm_metric_inc(r->m.solo_concurrent, gr->name, 1);
            const uint32_t k = (uint32_t)q->solo_rank;
            gr->rank_free_at[k] = PDM_MAX(gr->rank_free_at[k], q->t_dispatch) +
                                  rt_adapt_t1(&gr->cost, (int32_t)q->n_prompt);
            gr->rank_tasks[k]++;
        } else if (pdm_prefill_conv_plan_task(
                       pdm_prefill_pool_pick(&gr->pool, &gr->conv, &pp.followup,
                                             &q->pool_source),
                       &pp, plan)) {
            rt_attempt_failed(r, q, PDMESH__ERROR_CODE__ERR_INTERNAL, pdm_error_last());
            return;
        } else {
            /* The conversation it continues: the current one or one of the group's pool
             * (pool.h); the ranks do what the mirror does when the task ends. */
            if (!plan->start) q->pool_source = 0;
            /* named, not "the current one": a new prompt's task may reach the ranks first
             * (its decode node reserved sooner) and move this conversation into the pool */
            else if (!q->pool_source) q->pool_source = pdm_prefill_conv_id(&gr->conv);
            q->pool_budget = rt_group_pool_budget(r, gr);
            /* every rank: after the last task it holds, for the predicted group time */
            double at = q->t_dispatch;
            for (uint32_t k = 0; k < gr->size; k++) at = PDM_MAX(at, gr->rank_free_at[k]);
            at += rt_adapt_tR(&gr->cost, (int32_t)q->n_prompt - plan->start, plan->start);
            for (uint32_t k = 0; k < gr->size; k++) {
                gr->rank_free_at[k] = at;
                gr->rank_tasks[k]++;
            }
        }
        memcpy(q->chunks, plan->chunks, sizeof(q->chunks));
        q->has_chunks = plan->has_chunks;
        q->method_id = (int)plan->method;
        q->cached_tokens = (uint32_t)plan->start;
        q->reuse_pending = gr->reuse_pending = plan->start > 0;
        snprintf(q->method, sizeof(q->method), "%s",
                 q->batch_id ? "batch" : q->solo_rank >= 0 ? "solo"
                                                           : pdm_prefill_method_name(plan->method));
        const int nr = plan->n_ranges;
        memcpy(q->plan, plan->ranges, sizeof(pdm_prefill_range_t) * (size_t)nr);
        q->n_plan = nr;
        /* Delta transfer: the node expects only the rows from pool_delta on, cut as the ranks
         * cut what they send (PrefillTask.stream_from); Usage keeps the whole plan. */
        memcpy(cut, plan->ranges, sizeof(pdm_prefill_range_t) * (size_t)nr);
        pdm_prefill_ranges_clip(cut, nr, (int32_t)q->pool_delta);
        pdm_prefill_ranges_to_wire(cut, nr, rg, rgp);
        t.pool_prefix = q->pool_delta;
        /* A fresh KV key for the attempt: the decode node takes blocks only from the ranks
         * that hold it (kvtransfer.h). */
        if (pdm_random_bytes(q->kv_key, sizeof(q->kv_key))) {
            rt_attempt_failed(r, q, PDMESH__ERROR_CODE__ERR_INTERNAL, "no random bytes");
            return;
        }
        t.kv_key.data = q->kv_key;
        t.kv_key.len = sizeof(q->kv_key);
        if (n->pool_tokens) { /* so that the node's prefix pool can keep this prompt's KV */
            t.prompt_tokens = q->prompt;
            t.n_prompt_tokens = q->n_prompt;
        }
        t.prefill_addresses = addrs;
        t.n_prefill_addresses = gr->size;
        t.ranges = rgp;
        t.n_ranges = (size_t)nr;
        t.group = gr->name;
    }
    q->state = RQ_RESERVING;
    pdm_log_info("router: request %llu attempt %u -> %s via %s", (unsigned long long)q->id,
                 q->attempt, n->id, q->local ? "local prefill" : q->group_name);
    int st = rt_send(r->node_sock, n->ident, n->ident_len, PDMESH__MSG_TYPE__MSG_DECODE_TASK, &t.base);
    free(all);
    if (st) {
        /* gone (its socket closed) before its lease ran out: skipped until the lease decides,
         * so that the retry goes to another node instead of failing here again */
        n->full_until = pdm_now() + r->cfg.lease_ms / 1e3;
        rt_attempt_failed(r, q, PDMESH__ERROR_CODE__ERR_UNAVAILABLE, "cannot reach the decode node");
    }
}

/* q's PrefillTask into t (pointing into q, sp and chunks[PDM_PREFILL_MAX_RANKS]); q goes
 * RESERVING -> PREFILL. */
static void rt_prefill_task_fill(pdm_router_t *r, rt_req_t *q, Pdmesh__PrefillTask *tp,
                                 Pdmesh__SamplingParams *sp, uint32_t *chunks)
{
    rt_group_t *g = &r->groups[q->group];
    rt_node_t *d = &r->nodes[q->dnode];
    Pdmesh__PrefillTask t = PDMESH__PREFILL_TASK__INIT;
    pdmesh__sampling_params__init(sp);
    t.task_id = q->id;
    t.attempt = q->attempt;
    t.method = q->solo_rank >= 0 ? "single" : q->method;
    t.solo = q->solo_rank >= 0;
    t.solo_rank = q->solo_rank >= 0 ? (uint32_t)q->solo_rank : 0;
    /* A partial prefill names the cached prefix it assumes; the ranks check it. */
    t.start = q->cached_tokens;
    t.tokens = q->prompt + q->cached_tokens;
    t.n_tokens = q->n_prompt - q->cached_tokens;
    t.prefix = q->prompt;
    t.n_prefix = q->cached_tokens;
    t.stream_from = q->pool_delta; /* the decode node holds the rows before it */
    if (q->reuse_pending) g->reuse_pending = q->reuse_pending = 0; /* it goes out now */
    if (q->solo_rank < 0) { /* a solo task leaves the group's conversations alone */
        t.formation = g->formation; /* rank 0 refuses it if the group re-formed meanwhile */
        q->wire_gen = g->wire_gen;
        t.pool_source = q->pool_source;
        t.pool_tokens = (uint64_t)q->pool_budget;
        t.pool_reset = q->pool_reset = g->pool_reset;
        g->pool_reset = 0;
        rt_group_mirror(r, q);
    }
    if (q->has_chunks) {
        for (uint32_t k = 0; k < g->size; k++) chunks[k] = (uint32_t)q->chunks[k];
        t.chunks = chunks;
        t.n_chunks = g->size;
    }
    t.decode_address.data = d->ucx;
    t.decode_address.len = d->ucx_len;
    t.decode_node = d->id;
    t.kv_key.data = q->kv_key;
    t.kv_key.len = sizeof(q->kv_key);
    pdm_sampler_params_to_msg(&q->sp, sp); /* the owner rank samples the first token */
    t.sampling = sp;
    /* n samples (or a choice of them going on alone) draw their first tokens from the owner's
     * logits, as each choice's own request did (DecodeStart.first_logits) */
    t.want_logits = q->n_samples > 1 || q->resumed_choice;
    free(q->first_logits);
    q->first_logits = NULL;
    q->has_first_lp = 0;
    q->has_first = 0;
    if (q->want_plp && !q->plp_sent) { /* every rank scores the prompt tokens its rows
                                         * predict (once: a retry after they were merged and
                                         * handed on does not ask again) */
        t.prompt_logprobs = 1;
        t.prompt_top_logprobs = q->plp_stride - 1;
        memset(q->plp_n, -1, q->n_prompt);
        q->plp_have = 0;
    }
    double left = q->deadline - pdm_now();
    t.deadline_ms = left > 0 ? (uint32_t)(left * 1e3) : 1;
    q->state = RQ_PREFILL;
    pdm_metric_inc(r->m.method, q->method, 1);
    pdm_metric_inc(r->m.prefill_tokens, "group", (double)t.n_tokens);
    *tp = t;
}

/* RESERVING -> PREFILL: the reservation is in place, the ranks may send the KV. */
static void rt_send_prefill(pdm_router_t *r, rt_req_t *q)
{
    rt_group_t *g = &r->groups[q->group];
    if (q->solo_rank < 0 && q->cached_tokens > 0 && g->pool_reset && q->attempt < 15) {
        /* A failure since the task was planned emptied the group's conversations (the ranks
         * empty theirs with this very task): the prefix it counts on is gone. Planned again,
         * not a failed attempt, and not held against the group (while attempt numbers last:
         * the 15th goes out and fails as any attempt would). */
        pdm_log_info("router: request %llu: the group %s was reset after its task was planned "
                     "on %u cached tokens: planned again", (unsigned long long)q->id, g->name,
                     q->cached_tokens);
        rt_req_release_nodes(r, q, 1);
        q->state = RQ_QUEUED;
        q->started = 0;
        return;
    }
    Pdmesh__PrefillTask t;
    Pdmesh__SamplingParams sp;
    uint32_t chunks[PDM_PREFILL_MAX_RANKS];
    rt_prefill_task_fill(r, q, &t, &sp, chunks);
    for (uint32_t k = 0; k < g->size; k++) {
        if (!rt_req_has_rank(q, k)) continue; /* a solo task goes to its rank only */
        /* (rank 0 forwards a group task to the others in the group's one order; their own
         * copies tell them what work of the group is still to come: prefill_node/main.c) */
        rt_node_t *m = &r->nodes[g->member[k]];
        t.epoch = m->epoch;
        if (rt_send(r->node_sock, m->ident, m->ident_len, PDMESH__MSG_TYPE__MSG_PREFILL_TASK, &t.base)) {
            rt_attempt_failed(r, q, PDMESH__ERROR_CODE__ERR_UNAVAILABLE, "cannot reach a prefill rank");
            return;
        }
    }
}

/* Batched prefill (batch.h): the PrefillTask of batch `batch` (its lead's id) goes out once
 * none of its members is still waiting for its decode node's reservation: one task holding
 * every reserved member, in queue (deadline) order, to the members' rank; a lone member goes
 * as a plain solo task. Members that left the batch (failed reservation, deadline, cancel)
 * are not in it. */
static void rt_batch_try_send(pdm_router_t *r, uint64_t batch)
{
    rt_req_t *m[RT_BATCH_MAX];
    int n = 0;
    for (rt_req_t *w = r->head; w; w = w->next) {
        if (w->batch_id != batch) continue;
        if (w->state == RQ_RESERVING && !w->batch_ready) return; /* still reserving */
        if (w->state == RQ_RESERVING && n < RT_BATCH_MAX) m[n++] = w;
    }
    for (int i = 0; i < n; i++) m[i]->batch_id = 0, m[i]->batch_ready = 0;
    if (n == 0) return;
    pdm_metric_observe(r->m.batch_requests, NULL, n);
    if (n == 1) { /* the others left: a plain solo task */
        snprintf(m[0]->method, sizeof(m[0]->method), "solo");
        rt_send_prefill(r, m[0]);
        return;
    }
    Pdmesh__PrefillTask t[RT_BATCH_MAX];
    Pdmesh__SamplingParams sp[RT_BATCH_MAX];
    uint32_t chunks[RT_BATCH_MAX][PDM_PREFILL_MAX_RANKS];
    Pdmesh__PrefillTask *tp[RT_BATCH_MAX];
    for (int i = 0; i < n; i++) {
        rt_prefill_task_fill(r, m[i], &t[i], &sp[i], chunks[i]);
        tp[i] = &t[i];
    }
    rt_group_t *g = &r->groups[m[0]->group];
    const uint32_t k = (uint32_t)m[0]->solo_rank;
    rt_node_t *node = &r->nodes[g->member[k]];
    Pdmesh__PrefillTask c = PDMESH__PREFILL_TASK__INIT;
    c.task_id = m[0]->id; /* the rank's queue key (a cancel of the lead leaves it queued) */
    c.attempt = m[0]->attempt;
    c.epoch = node->epoch;
    c.method = "single";
    c.solo = 1;
    c.solo_rank = k;
    c.batch = tp;
    c.n_batch = (size_t)n;
    for (int i = 0; i < n; i++) t[i].epoch = node->epoch;
    pdm_log_info("router: batch of %d prefill(s) (lead %llu) -> %s rank %u", n,
                 (unsigned long long)m[0]->id, g->name, k);
    if (rt_send(r->node_sock, node->ident, node->ident_len, PDMESH__MSG_TYPE__MSG_PREFILL_TASK,
                &c.base))
        for (int i = 0; i < n; i++)
            rt_attempt_failed(r, m[i], PDMESH__ERROR_CODE__ERR_UNAVAILABLE,
                              "cannot reach a prefill rank");
}

void rt_batch_send_pending(pdm_router_t *r)
{
    if (!r->batch_pending) return;
    r->batch_pending = 0;
    enum { MAX_BATCHES = 64 };
    uint64_t ids[MAX_BATCHES];
    int n = 0;
    for (rt_req_t *w = r->head; w && n < MAX_BATCHES; w = w->next) {
        if (!w->batch_id || w->state != RQ_RESERVING) continue;
        int seen = 0;
        for (int i = 0; i < n && !seen; i++) seen = ids[i] == w->batch_id;
        if (!seen) ids[n++] = w->batch_id;
    }
    for (int i = 0; i < n; i++) rt_batch_try_send(r, ids[i]); /* each walks the queue anew */
}

/* -> DECODE: the decode node may start (first_token -1: it prefills locally). */
static void rt_send_start(pdm_router_t *r, rt_req_t *q, int32_t first_token)
{
    rt_node_t *d = &r->nodes[q->dnode];
    Pdmesh__DecodeStart s = PDMESH__DECODE_START__INIT;
    Pdmesh__SamplingParams sp = PDMESH__SAMPLING_PARAMS__INIT;
    Pdmesh__SampledLogprob flp = PDMESH__SAMPLED_LOGPROB__INIT;
    pdm_sampler_params_to_msg(&q->sp, &sp);
    s.task_id = q->id;
    s.attempt = q->attempt;
    s.first_token = first_token;
    s.sampling = &sp;
    if (first_token >= 0 && q->has_first_lp) {
        flp.logprob = q->first_lp.logprob;
        flp.top_ids = q->first_lp.top_ids;
        flp.n_top_ids = (size_t)q->first_lp.n_top;
        flp.top_logprobs = q->first_lp.top_logprobs;
        flp.n_top_logprobs = (size_t)q->first_lp.n_top;
        s.first_logprob = &flp;
    }
    s.stop = q->stops;
    s.n_stop = q->n_stops;
    double left = q->deadline - pdm_now();
    s.deadline_ms = left > 0 ? (uint32_t)(left * 1e3) + 1 : 1;
    s.ignore_eos = q->ignore_eos;
    if (first_token >= 0 && q->first_logits) {
        s.first_logits = q->first_logits;
        s.n_first_logits = r->model->hp.n_vocab;
    }
    s.skip_tokens = 0; /* the router continues at q->base (migration re-prefills delivered tokens) */
    rt_beams_start(q, &s);
    q->state = RQ_DECODE;
    q->started = 1;
    if (rt_send(r->node_sock, d->ident, d->ident_len, PDMESH__MSG_TYPE__MSG_DECODE_START, &s.base))
        rt_attempt_failed(r, q, PDMESH__ERROR_CODE__ERR_UNAVAILABLE, "cannot reach the decode node");
}

/* ---------------------------------------------------------------- events from nodes */

/* The request a task message is about, if it is the current attempt on that node. */
static rt_req_t *rt_task_req(pdm_router_t *r, int node, uint64_t task_id, uint32_t attempt)
{
    rt_req_t *q = rt_req_find(r, task_id);
    if (!q || q->attempt != attempt || q->state == RQ_QUEUED) return NULL;
    const rt_node_t *n = &r->nodes[node];
    if (n->role == PDMESH__ROLE__ROLE_DECODE) return q->dnode == node ? q : NULL;
    if (q->group < 0) return NULL;
    const rt_group_t *g = &r->groups[q->group];
    return n->rank < g->size && g->member[n->rank] == node &&
                   q->group_epochs[n->rank] == n->epoch ? q : NULL;
}

void rt_req_on_reserved(pdm_router_t *r, int node, const Pdmesh__DecodeReserved *d)
{
    rt_req_t *q = rt_task_req(r, node, d->task_id, d->attempt);
    if (!q || q->state != RQ_RESERVING) return;
    if (!d->ok) {
        if (d->pool_miss && q->pool_delta) {
            /* Delta transfer refused: the node's pool lost the prefix since its last KV event,
             * or held it corrupt (never used). Not a failure of the request: it goes again
             * with the whole prompt streamed (counted; its lookup an `evicted` miss). */
            pdm_metric_inc(r->m.pool_delta_refused, NULL, 1);
            if (q->pool_expect && node == q->pool_node)
                pdm_metric_inc(r->m.pool_misses, "evicted", 1);
            q->pool_expect = 0;
            q->no_delta = 1;
            pdm_log_info("router: request %llu: %s refused the delta transfer of %u tokens (%s): "
                         "retried in full", (unsigned long long)q->id, r->nodes[node].id,
                         q->pool_delta, rt_err_text(d->error));
            rt_req_release_nodes(r, q, 0);
            q->state = RQ_QUEUED;
            q->pool_delta = 0;
            return;
        }
        if (d->error && d->error->code == PDMESH__ERROR_CODE__ERR_NODE_FULL) {
            /* Not a failure of the request: try another node (or this one later). */
            r->nodes[node].full_until = pdm_now() + 0.5;
            rt_req_release_nodes(r, q, 0);
            q->state = RQ_QUEUED;
            if (q->attempt >= 15)
                rt_req_fail(r, q, PDMESH__ERROR_CODE__ERR_OVERLOADED,
                            "no decode node has room: %s", rt_err_text(d->error));
        } else {
            rt_attempt_failed(r, q, d->error ? (int)d->error->code : PDMESH__ERROR_CODE__ERR_INTERNAL,
                              rt_err_text(d->error));
        }
        return;
    }
    if (!q->local && q->batch_id) {
        q->batch_ready = 1;
        rt_batch_try_send(r, q->batch_id);
    } else if (!q->local) {
        if (q->pool_delta) {
            pdm_metric_inc(r->m.pool_delta_requests, NULL, 1);
            pdm_metric_inc(r->m.pool_delta_tokens, NULL, (double)q->pool_delta);
        }
        rt_send_prefill(r, q);
    } else if (q->want_plp && !q->plp_sent) {
        /* the node prefilled and scored the prompt itself */
        memset(q->plp_n, -1, q->n_prompt);
        q->plp_have = 0;
        if (rt_plp_take(r, q, d->prompt_positions, d->n_prompt_positions, d->prompt_logprobs,
                        d->n_prompt_logprobs)) {
            rt_attempt_failed(r, q, PDMESH__ERROR_CODE__ERR_INTERNAL,
                              "the decode node sent malformed prompt log-probabilities");
            return;
        }
        rt_plp_complete(r, q, -1);
    } else {
        rt_send_start(r, q, -1);
    }
}

void rt_req_on_task_error(pdm_router_t *r, int node, const Pdmesh__Error *e)
{
    rt_req_t *c = rt_chunk_req(r, node, e->task_id, e->attempt);
    if (c) {
        char m1[512];
        snprintf(m1, sizeof(m1), "%s refused it: %s", r->nodes[node].id, rt_err_text(e));
        rt_chunk_failed(r, c, m1, 1);
        return;
    }
    rt_req_t *q = rt_task_req(r, node, e->task_id, e->attempt);
    if (!q || q->state == RQ_QUEUED) return;
    char m2[512];
    snprintf(m2, sizeof(m2), "%s refused the task: %s", r->nodes[node].id, rt_err_text(e));
    rt_attempt_failed(r, q, e->code ? (int)e->code : PDMESH__ERROR_CODE__ERR_INTERNAL, m2);
}

/* Takes a rank's share of the prompt log-probabilities into q's store: positions in
 * [1, n_prompt), each at most once per attempt. Nonzero when the message is malformed. */
static int rt_plp_take(pdm_router_t *r, rt_req_t *q, const uint32_t *positions, size_t n_pos,
                       Pdmesh__SampledLogprob *const *lps, size_t n_lps)
{
    if (n_pos != n_lps) return 1;
    rt_lp_store_t pls = rt_lp_prompt(q);
    for (size_t i = 0; i < n_pos; i++) {
        const uint32_t pos = positions[i];
        if (pos < 1 || pos >= q->n_prompt || q->plp_n[pos] >= 0) return 1;
        if (!rt_lp_store(&pls, pos, q->prompt[pos], lps[i], r->model->hp.n_vocab)) return 1;
        q->plp_have++;
    }
    return 0;
}

/* Every source of the prompt log-probabilities reported (the group's ranks, or the decode
 * node's local prefill): checks that each position 1..n-1 came, hands them to the sink, then
 * starts the decode node with `first` (-1: it samples the first token itself) or, scoring
 * only, releases it and ends the request. */
static void rt_plp_complete(pdm_router_t *r, rt_req_t *q, int32_t first)
{
    if (q->plp_have + 1 != q->n_prompt) {
        char m2[160];
        snprintf(m2, sizeof(m2), "%u of %u prompt log-probabilities came back", q->plp_have,
                 q->n_prompt - 1);
        rt_attempt_failed(r, q, PDMESH__ERROR_CODE__ERR_INTERNAL, m2);
        return;
    }
    q->plp_sent = 1;
    q->plp_n[0] = -1; /* nothing predicts the first token */
    Pdmesh__TokenLogprob **list = NULL;
    rt_lp_store_t pls = rt_lp_prompt(q);
    void *block = q->sink.on_prompt ? rt_lp_build(r, &pls, 0, q->n_prompt, &list) : NULL;
    if (block) q->sink.on_prompt(q->sink.ctx, list, q->n_prompt);
    free(block);
    if (q->prompt_only) {
        rt_req_release_nodes(r, q, 1); /* the decode node's reservation is not needed */
        rt_req_finish(r, q, PDMESH__FINISH_REASON__FINISH_LENGTH);
        return;
    }
    rt_send_start(r, q, first);
}

/* Rank 0 refused q's whole-group task as planned for another formation of the group
 * (ERR_STALE_FORMATION, e): the group re-formed under another router's GroupWire, or this
 * router's re-wire is on its way. Nothing is wrong with the group, so it is not suspected and
 * its mirrors stay: no rank ran the task, and the wiring that changed the ranks' formation
 * (ours, now or before) empties them as any wiring does. If the task was planned for the
 * current wiring, registry.c re-sends it (wire_stale). The request goes back to QUEUED for
 * the next scheduling pass, without a failed attempt, RT_MAX_STALE_FORMATION times; the
 * next refusal is a failed attempt as any other. */
static void rt_stale_formation(pdm_router_t *r, rt_req_t *q, const Pdmesh__Error *e,
                               const char *msg)
{
    rt_group_t *gr = &r->groups[q->group];
    pdm_metric_inc(r->m.stale_formation, gr->name, 1);
    if (q->stale_formations >= RT_MAX_STALE_FORMATION) {
        rt_attempt_failed(r, q, PDMESH__ERROR_CODE__ERR_UNAVAILABLE, msg);
        return;
    }
    q->stale_formations++;
    if (gr->wired && q->wire_gen == gr->wire_gen && e->formation != gr->formation)
        gr->wire_stale = 1;
    pdm_log_info("router: request %llu attempt %u planned again (%s)", (unsigned long long)q->id,
                 q->attempt, msg);
    rt_req_release_nodes(r, q, 1);
    q->state = RQ_QUEUED;
    q->started = 0;
}

void rt_req_on_prefill_result(pdm_router_t *r, int node, const Pdmesh__PrefillResult *p)
{
    rt_req_t *c = rt_chunk_req(r, node, p->task_id, p->attempt);
    if (c) {
        rt_chunk_on_result(r, c, node, p);
        return;
    }
    rt_req_t *q = rt_task_req(r, node, p->task_id, p->attempt);
    if (!q || (q->state != RQ_PREFILL && q->state != RQ_DECODE)) return;
    if (!p->ok) {
        char m2[512];
        snprintf(m2, sizeof(m2), "prefill rank %s: %s", r->nodes[node].id, rt_err_text(p->error));
        if (q->group >= 0 && q->solo_rank < 0 && q->state == RQ_PREFILL && p->error &&
            p->error->code == PDMESH__ERROR_CODE__ERR_STALE_FORMATION) {
            rt_stale_formation(r, q, p->error, m2);
            return;
        }
        if (q->group >= 0 && p->error &&
            p->error->code == PDMESH__ERROR_CODE__ERR_KV_CORRUPT) { /* pool.c, rank.c */
            r->groups[q->group].pool_corrupt++;
            pdm_metric_inc(r->m.group_pool_corrupt, r->groups[q->group].name, 1);
        }
        rt_attempt_failed(r, q, PDMESH__ERROR_CODE__ERR_KV_TRANSFER, m2);
        return;
    }
    const uint32_t rank = r->nodes[node].rank;
    if (!rt_req_has_rank(q, rank) || (q->ranks_answered >> rank & 1)) return; /* not asked */
    q->ranks_answered |= 1ull << rank;
    q->ranks_done++;
    q->kv_bytes += p->kv_bytes;
    if (p->batch_size > 1) pdm_metric_inc(r->m.batched, NULL, 1);
    if (p->seconds > q->prefill_seconds) q->prefill_seconds = p->seconds;
    if (q->group >= 0) rt_rank_done(&r->groups[q->group], rank);
    int32_t first = p->first_token;
    const Pdmesh__SampledLogprob *flp = p->first_logprob;
    if (first >= 0 && (q->n_samples > 1 || q->resumed_choice) && !q->first_logits &&
        p->n_logits == r->model->hp.n_vocab &&
        (q->first_logits = malloc(sizeof(float) * p->n_logits)))
        memcpy(q->first_logits, p->logits, sizeof(float) * p->n_logits);
    if (first >= 0 && flp && flp->n_top_ids == flp->n_top_logprobs &&
        flp->n_top_ids <= PDM_SAMPLER_MAX_TOP_LOGPROBS) {
        q->first_lp.logprob = flp->logprob;
        q->first_lp.n_top = (int32_t)flp->n_top_ids;
        if (flp->n_top_ids) { /* (none: the arrays are NULL, and memcpy's must not be) */
            memcpy(q->first_lp.top_ids, flp->top_ids, sizeof(int32_t) * flp->n_top_ids);
            memcpy(q->first_lp.top_logprobs, flp->top_logprobs,
                   sizeof(float) * flp->n_top_ids);
        }
        q->has_first_lp = 1;
    }
    const int need_plp = q->want_plp && !q->plp_sent;
    if (need_plp && !q->started &&
        rt_plp_take(r, q, p->prompt_positions, p->n_prompt_positions, p->prompt_logprobs,
                    p->n_prompt_logprobs)) {
        char m2[512];
        snprintf(m2, sizeof(m2), "prefill rank %s sent malformed prompt log-probabilities",
                 r->nodes[node].id);
        rt_attempt_failed(r, q, PDMESH__ERROR_CODE__ERR_INTERNAL, m2);
        return;
    }
    const int all_done = q->group >= 0 && q->ranks_done == rt_req_ranks_expected(r, q);
    if (all_done) {
        /* Every rank finished: the group is free and the request no longer depends on it
         * (a rank dying now does not touch the request). */
        rt_group_t *gr = &r->groups[q->group];
        if (gr->inflight > 0) gr->inflight--;
        const int32_t cached = (int32_t)q->cached_tokens;
        rt_adapt_learn(&gr->cost, q->solo_rank >= 0, (int32_t)q->n_prompt - cached, cached,
                       q->prefill_seconds);
        if (q->solo_rank >= 0) {
            if (gr->solo_inflight > 0) gr->solo_inflight--;
        } else {
            rt_group_prefilled(r, q);
        }
        q->group = -1;
    }
    if (first >= 0) {
        q->first_token = first;
        q->has_first = 1;
    }
    if (q->started) return;
    if (!need_plp) {
        if (first >= 0) rt_send_start(r, q, first);
        return;
    }
    /* Prompt log-probabilities: the decode node starts (or, scoring only, is released) once
     * every rank has reported its share, so that they reach the client before any token. */
    if (!all_done) return;
    if (!q->has_first) {
        rt_attempt_failed(r, q, PDMESH__ERROR_CODE__ERR_INTERNAL,
                          "no prefill rank reported the first token");
        return;
    }
    rt_plp_complete(r, q, q->first_token);
}

/* What a choice's usage reports of its leader's attempt. */
static void rt_choice_sync(rt_req_t *c, const rt_req_t *q)
{
    c->kv_bytes = q->kv_bytes;
    c->kv_seconds = q->kv_seconds;
    c->shared_kv = 1;
    c->attempt = q->attempt;
    c->cached_tokens = rt_req_reused(q);
    memcpy(c->method, q->method, sizeof(c->method));
    memcpy(c->group_name, q->group_name, sizeof(c->group_name));
    memcpy(c->dnode_name, q->dnode_name, sizeof(c->dnode_name));
    memcpy(c->plan, q->plan, sizeof(c->plan));
    c->n_plan = q->n_plan;
}

/* Tokens of sample i of a leader's attempt go to choice i (which may end with them: a stop
 * string it found, or the sample's end `finish`). */
static void rt_leader_tokens(pdm_router_t *r, rt_req_t *q, uint32_t i, uint32_t index,
                             const int32_t *toks, size_t n, Pdmesh__SampledLogprob *const *lps,
                             int finish)
{
    rt_req_t *c = i < q->n_samples && i < RT_MAX_CHOICES ? q->choice[i] : NULL;
    if (!c) return; /* ended already (cancelled, or its stop string) */
    rt_choice_sync(c, q);
    if (rt_req_tokens(r, c, index, toks, n, lps)) return;
    /* a sample's end ends its choice only with every token in hand: after a lost message the
     * leader's DecodeResult fills the gap first */
    if (finish && c->n_gen == index + (uint32_t)n) rt_req_finish(r, c, finish);
}

void rt_req_on_tokens(pdm_router_t *r, int node, const Pdmesh__DecodeTokens *d)
{
    rt_req_t *q = rt_task_req(r, node, d->task_id, d->attempt);
    if (!q || q->state != RQ_DECODE) return;
    if (q->n_samples) {
        rt_leader_tokens(r, q, d->sample, d->index, d->tokens, d->n_tokens,
                         d->n_logprobs == d->n_tokens ? d->logprobs : NULL, (int)d->finish);
        return;
    }
    rt_req_tokens(r, q, q->base + d->index, d->tokens, d->n_tokens,
                  d->n_logprobs == d->n_tokens ? d->logprobs : NULL);
}

void rt_req_on_decode_result(pdm_router_t *r, int node, const Pdmesh__DecodeResult *d)
{
    rt_req_t *q = rt_task_req(r, node, d->task_id, d->attempt);
    if (!q || q->state == RQ_QUEUED) return;
    if (q->n_samples && d->ok) {
        /* every sample's tokens (a gap left by a lost DecodeTokens is filled, without its
         * log-probabilities) and end; then the leader is done */
        if (d->kv_bytes) q->kv_bytes = d->kv_bytes;
        q->kv_seconds = d->kv_seconds;
        if (q->kv_bytes) { /* the one transfer of the choices' prompt */
            pdm_metric_inc(r->m.kv_bytes, NULL, (double)q->kv_bytes);
            pdm_metric_observe(r->m.kv_time, NULL, q->kv_seconds);
        }
        size_t at = 0;
        for (size_t i = 0; i < d->n_sample_n_tokens && i < q->n_samples; i++) {
            const size_t nt = d->sample_n_tokens[i];
            if (at + nt > d->n_tokens) break; /* malformed: what arrived stands */
            const int fin = i < d->n_sample_finish && d->sample_finish[i]
                                ? (int)d->sample_finish[i] : PDMESH__FINISH_REASON__FINISH_LENGTH;
            rt_leader_tokens(r, q, (uint32_t)i, 0, d->tokens + at, nt, NULL, fin);
            at += nt;
        }
        q->dnode_epoch = r->nodes[node].epoch;
        rt_leader_end(r, q, PDMESH__ERROR_CODE__ERR_INTERNAL,
                      "the decode node ended without this choice", 0);
        return;
    }
    if (d->ok) {
        /* fills any gap (those tokens' log-probabilities are missing: DecodeTokens only) */
        if (rt_req_tokens(r, q, q->base, d->tokens, d->n_tokens, NULL)) return;
        q->kv_seconds = d->kv_seconds;
        if (d->kv_bytes) q->kv_bytes = d->kv_bytes;
        /* (a delta's pooled prefix saved its transfer, not its computation on the group:
         * Usage.pool_prefix_tokens reports it, cached_tokens stays the group's) */
        if (!q->pool_delta && d->cached_tokens > q->cached_tokens)
            q->cached_tokens = d->cached_tokens;
        if (d->cached_tokens)
            pdm_metric_inc(r->m.pool_cached_tokens, NULL, (double)d->cached_tokens);
        if (q->pool_expect && (q->local || q->pool_delta) && node == q->pool_node) {
            /* the index sent it here: did the node find what the index promised? */
            if (d->cached_tokens >= q->pool_expect) {
                r->pool_hits++;
                pdm_metric_inc(r->m.pool_hits, NULL, 1);
            } else {
                pdm_metric_inc(r->m.pool_misses, "evicted", 1);
                pdm_log_info("router: request %llu: %s reused %u pooled tokens, the index said "
                             "%u", (unsigned long long)q->id, r->nodes[node].id,
                             d->cached_tokens, q->pool_expect);
            }
            q->pool_expect = 0;
        }
        q->res_beams = d->beams; /* borrowed until rt_req_finish returns */
        q->n_res_beams = d->n_beams;
        rt_req_finish(r, q, d->finish);
    } else if (d->error && d->error->code == PDMESH__ERROR_CODE__ERR_DEADLINE_EXCEEDED) {
        rt_req_fail(r, q, PDMESH__ERROR_CODE__ERR_DEADLINE_EXCEEDED, "deadline exceeded on %s",
                    r->nodes[node].id);
    } else {
        char m2[512];
        snprintf(m2, sizeof(m2), "decode node %s: %s", r->nodes[node].id, rt_err_text(d->error));
        q->dnode_epoch = r->nodes[node].epoch; /* released normally: the node dropped it */
        rt_req_release_nodes(r, q, 0);
        rt_attempt_failed(r, q, d->error ? (int)d->error->code : PDMESH__ERROR_CODE__ERR_INTERNAL,
                          m2);
    }
}

void rt_req_on_node_lost(pdm_router_t *r, int node, int group, const char *why)
{
    rt_node_t *n = &r->nodes[node];
    rt_req_t *next;
    for (rt_req_t *q = r->head; q; q = next) {
        next = q->next;
        if (q->chunk_id && group >= 0 && q->chunk_group == group) {
            char m1[256];
            snprintf(m1, sizeof(m1), "prefill rank %s %s", n->id, why);
            /* (not the request's fault; its next chunk finds less held than its chunks
             * computed, and it then goes whole) */
            rt_chunk_failed(r, q, m1, 0);
        }
        if (q->state == RQ_QUEUED) continue;
        int hit = q->dnode == node || (group >= 0 && q->group == group);
        if (!hit) continue;
        char msg[256];
        snprintf(msg, sizeof(msg), "%s %s %s", n->role == PDMESH__ROLE__ROLE_DECODE ? "decode node"
                 : "prefill rank", n->id, why);
        if (q->dnode == node) q->dnode_epoch = 0; /* do not count or cancel on the lost node */
        if (q->dnode == node) n->tasks = PDM_MAX(0, n->tasks - 1);
        rt_attempt_failed(r, q, PDMESH__ERROR_CODE__ERR_UNAVAILABLE, msg);
    }
    if (n->role == PDMESH__ROLE__ROLE_DECODE) {
        n->tasks = 0;
        n->kv_reserved = 0;
    }
}

void rt_req_expire(pdm_router_t *r)
{
    double now = pdm_now();
    rt_req_t *next;
    for (rt_req_t *q = r->head; q; q = next) {
        next = q->next;
        if (q->chunk_id && now > q->chunk_until)
            rt_chunk_failed(r, q, "no answer from every rank", 1);
        if (now > q->deadline)
            rt_req_fail(r, q, PDMESH__ERROR_CODE__ERR_DEADLINE_EXCEEDED,
                        "deadline exceeded after %.0f ms (%u of %u tokens generated)",
                        (now - q->t_arrival) * 1e3, q->n_gen, q->max_new);
    }
}
