/*
 * core.c - the router core: ZeroMQ sockets on the libuv loop, the request lifecycle and
 * scheduling (ARCHITECTURE.md "Request lifecycle", "Control plane").
 *
 * Sockets: three ROUTER sockets (client, node, admin). Each socket's ZMQ_FD is watched with a
 * uv_poll; ZeroMQ signals that fd edge-triggered, so every callback - and a uv_check after
 * every loop iteration, because sending can consume the edge - drains the socket until
 * ZMQ_EVENTS has no POLLIN (PITFALLS.md, ZeroMQ).
 *
 * A request: QUEUED -> RESERVING (DecodeTask sent, the decode node reserves KV) -> PREFILL
 * (PrefillTask on every rank of the group; the ranks stream the KV to the decode node) ->
 * DECODE (DecodeStart with the first token; tokens flow back) -> ended exactly once through
 * its sink. Local prefill (conditional disaggregation, no group, migration) skips PREFILL.
 * A failed attempt (node dead, transfer failed, node error) goes back to QUEUED and is
 * dispatched again, up to cfg.max_attempts; tokens already delivered are never sent again:
 * a migrated request is prefilled locally on the new decode node with prompt + delivered
 * tokens and continues at completion index n_gen.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "common/curve.h"
#include "router/internal.h"

void rt_config_default(rt_config_t *c)
{
    memset(c, 0, sizeof(*c));
    c->client_ep = "tcp://127.0.0.1:7700";
    c->node_ep = "tcp://127.0.0.1:7701";
    c->admin_ep = "tcp://127.0.0.1:7702";
    c->heartbeat_ms = 1000;
    c->lease_ms = 3000;
    c->queue_max = 256;
    c->per_client_max = 64;
    c->max_prompt_tokens = 4096;
    c->max_tokens = 1024;
    c->default_max_tokens = 128;
    c->max_beams = 8; /* the decode node's widest (PDM_BEAM_MAX_WIDTH) */
    c->default_deadline_ms = 120000;
    c->max_attempts = 4;
    c->local_threshold = 16;
    snprintf(c->method, sizeof(c->method), "auto");
    c->block_tokens = 64;
    c->prefix_reuse = 1;
    c->max_skew_s = 30;
    c->group_inflight = 2;
    c->http_host = "127.0.0.1";
    c->http_port = 8080;
}

int rt_send(void *sock, const uint8_t *ident, size_t ident_len, int type, const ProtobufCMessage *m)
{
    int st = pdm_wire_send(sock, ident, ident_len, type, m);
    if (st) pdm_log_warn("router: %s", pdm_error_last());
    return st;
}

/* ---------------------------------------------------------------- requests */

rt_req_t *rt_req_find(pdm_router_t *r, uint64_t id)
{
    for (rt_req_t *q = r->head; q; q = q->next)
        if (q->id == id) return q;
    return NULL;
}

static void rt_req_unlink_free(pdm_router_t *r, rt_req_t *q)
{
    if (q->prev) q->prev->next = q->next;
    else r->head = q->next;
    if (q->next) q->next->prev = q->prev;
    else r->tail = q->prev;
    r->n_req--;
    free(q->prompt);
    free(q->gen);
    free(q->text);
    for (size_t i = 0; i < q->n_stops; i++) free(q->stops[i]);
    free(q);
    pdm_metric_set(r->m.queue, NULL, r->n_req);
}

/* Gives back what the current attempt holds; cancel: tell the decode node to drop it. */
void rt_req_release_nodes(pdm_router_t *r, rt_req_t *q, int cancel)
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
        if (q->ranks_done < g->size && g->inflight > 0) g->inflight--;
        if (q->reuse_pending) g->reuse_pending = 0;
        q->group = -1;
    }
    q->reuse_pending = 0;
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

void rt_req_fail(pdm_router_t *r, rt_req_t *q, int code, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
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

int rt_req_tokens(pdm_router_t *r, rt_req_t *q, uint32_t index, const int32_t *toks, size_t n)
{
    uint32_t first = q->n_gen;
    for (size_t k = 0; k < n; k++) {
        uint32_t idx = index + (uint32_t)k;
        if (idx < q->n_gen) continue;     /* already delivered (migration, duplicates) */
        if (idx > q->n_gen || q->n_gen >= q->max_new) break; /* a gap: the result fills it */
        int32_t t = toks[k];
        if (t < 0 || !r->model || (uint32_t)t >= r->model->hp.n_vocab) break;
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
    if (q->sink.on_tokens)
        q->sink.on_tokens(q->sink.ctx, first, q->gen + first, q->n_gen - first, chunk ? chunk : "");
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
        q->sink.on_tokens(q->sink.ctx, q->n_gen, NULL, 0, q->text + q->text_sent);
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
    u.cached_tokens = q->cached_tokens;
    res.usage = &u;
    if (q->n_gen > 1) pdm_metric_observe(r->m.tpot, NULL, u.tpot_ms / 1e3);
    if (q->kv_bytes) {
        pdm_metric_inc(r->m.kv_bytes, NULL, (double)q->kv_bytes);
        pdm_metric_observe(r->m.kv_time, NULL, q->kv_seconds);
    }
    pdm_metric_inc(r->m.requests, "ok", 1);
    pdm_router_sink_t sink = q->sink;
    rt_beams_result(q, &res);
    if (sink.on_result) sink.on_result(sink.ctx, &res);
    rt_req_unlink_free(r, q);
}

void rt_attempt_failed(pdm_router_t *r, rt_req_t *q, int code, const char *msg)
{
    if (q->group >= 0) { /* the retry goes elsewhere (another group or local prefill) */
        r->groups[q->group].suspect_until = pdm_now() + r->cfg.lease_ms / 1e3;
        /* Its ranks may have dropped their conversation (or never held the one assumed):
         * forget the mirror, the next task starts afresh. */
        pdm_prefill_conv_reset(&r->groups[q->group].conv);
    }
    rt_req_release_nodes(r, q, 1);
    q->retries++;
    pdm_log_warn("router: request %llu attempt %u failed: %s", (unsigned long long)q->id,
                 q->attempt, msg);
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

/* ---------------------------------------------------------------- scheduling */

static int rt_pick_decode(pdm_router_t *r, const rt_req_t *q, int64_t need)
{
    int best = -1;
    double best_score = 0, now = pdm_now();
    for (int i = 0; i < RT_MAX_NODES; i++) {
        rt_node_t *n = &r->nodes[i];
        if (!rt_node_usable(r, i) || n->role != PDMESH__ROLE__ROLE_DECODE) continue;
        if (n->full_until > now || !rt_beams_node_ok(r, i, q)) continue;
        if (n->max_sequences && n->tasks >= (int)n->max_sequences) continue;
        int64_t free_kv = (int64_t)n->kv_tokens - n->kv_reserved;
        if (n->kv_tokens && free_kv < need) continue;
        /* Most free KV, then fewest running sequences (ARCHITECTURE.md: decode node by free
         * KV capacity and load). */
        double score = (double)free_kv - 512.0 * (n->tasks + n->running);
        if (best < 0 || score > best_score) best = i, best_score = score;
    }
    return best;
}

/* SHA-256 block keys with tagged fields (PITFALLS.md: cache keys): a domain tag, the router's
 * random salt, the model id, the parent block's key and the block's tokens, each
 * length-prefixed. Block i's key names the whole prefix up to the end of block i. */
static int rt_block_hashes(pdm_router_t *r, const int32_t *tok, uint32_t n, uint8_t (*out)[32],
                           int max)
{
    int bt = r->cfg.block_tokens > 0 ? r->cfg.block_tokens : 64, k = 0;
    uint8_t parent[32] = {0};
    static const char tag[] = "pdmesh-prefix-v1";
    uint32_t mlen = (uint32_t)strlen(r->model_name), tlen = (uint32_t)bt;
    size_t cap = sizeof(tag) + 16 + 4 + mlen + 32 + 4 + sizeof(int32_t) * (size_t)bt;
    uint8_t *buf = malloc(cap);
    if (!buf) return 0;
    for (uint32_t s = 0; s + (uint32_t)bt <= n && k < max; s += (uint32_t)bt) {
        size_t o = 0;
        memcpy(buf + o, tag, sizeof(tag)), o += sizeof(tag);
        memcpy(buf + o, r->prefix_salt, 16), o += 16;
        memcpy(buf + o, &mlen, 4), o += 4;
        memcpy(buf + o, r->model_name, mlen), o += mlen;
        memcpy(buf + o, parent, 32), o += 32;
        memcpy(buf + o, &tlen, 4), o += 4;
        memcpy(buf + o, tok + s, sizeof(int32_t) * (size_t)bt), o += sizeof(int32_t) * (size_t)bt;
        pdm_sha256(buf, o, out[k]);
        memcpy(parent, out[k], 32);
        k++;
    }
    free(buf);
    return k;
}

static size_t rt_prefix_slot(const uint8_t *h)
{
    return ((size_t)h[0] | (size_t)h[1] << 8 | (size_t)h[2] << 16) % RT_PREFIX_SLOTS;
}

/* A group can take another task: usable, below its queue limit, and no planned partial
 * prefill waiting for its decode reservation (the ranks must see that task next). */
static int rt_group_has_room(const pdm_router_t *r, int g)
{
    return rt_group_usable(r, g) && r->groups[g].inflight < r->cfg.group_inflight &&
           !r->groups[g].reuse_pending;
}

/* The group for a prompt: the usable group that last prefilled its longest known prefix,
 * else the least busy usable group; -1 if none has room. (What that group still holds, and so
 * what a task can reuse, its mirror tells: rt_reuse_start.) */
static int rt_pick_group(pdm_router_t *r, rt_req_t *q)
{
    enum { MAXB = 256 };
    int room = 0; /* no hashing while every group is busy (the queue is scanned often) */
    for (int g = 0; g < RT_MAX_GROUPS && !room; g++)
        room = rt_group_has_room(r, g);
    if (!room) return -1;
    uint8_t (*h)[32] = malloc(sizeof(uint8_t[32]) * MAXB);
    int nb = h ? rt_block_hashes(r, q->prompt, q->n_prompt, h, MAXB) : 0;
    int best = -1;
    for (int b = nb - 1; b >= 0 && best < 0; b--) {
        size_t s = rt_prefix_slot(h[b]);
        int g = r->prefix[s].group;
        if (r->prefix[s].stamp && !memcmp(r->prefix[s].hash, h[b], 32) && rt_group_has_room(r, g))
            best = g;
    }
    for (int g = 0; g < RT_MAX_GROUPS && best < 0; g++) {
        if (!rt_group_has_room(r, g)) continue;
        if (best < 0 || r->groups[g].inflight < r->groups[best].inflight) best = g;
    }
    if (best >= 0)
        for (int b = 0; b < nb; b++) {
            size_t s = rt_prefix_slot(h[b]);
            memcpy(r->prefix[s].hash, h[b], 32);
            r->prefix[s].group = best;
            r->prefix[s].stamp = ++r->prefix_stamp;
        }
    free(h);
    return best;
}

static int rt_any_group_alive(pdm_router_t *r)
{
    for (int g = 0; g < RT_MAX_GROUPS; g++)
        if (rt_group_usable(r, g)) return 1;
    return 0;
}

/* Prefix reuse: the cached tokens a new task on group `gr` can start after. Only while the
 * group is idle is its mirror what the ranks hold when the task arrives; at least one block
 * must be reused and at least one token computed (its logits give the first token). */
static int32_t rt_reuse_start(const pdm_router_t *r, const rt_group_t *gr, const rt_req_t *q)
{
    if (!r->cfg.prefix_reuse || gr->inflight > 0 || gr->reuse_pending) return 0;
    int32_t k = pdm_prefill_conv_common(&gr->conv, q->prompt, (int32_t)q->n_prompt);
    k = PDM_MIN(k, (int32_t)q->n_prompt - 1);
    return k >= r->cfg.block_tokens ? k : 0;
}

/* Every rank of the request's group finished its task: the mirror follows (conv.c). */
void rt_group_prefilled(pdm_router_t *r, rt_req_t *q)
{
    rt_group_t *gr = &r->groups[q->group];
    const int32_t start = (int32_t)q->cached_tokens, T = (int32_t)q->n_prompt - start;
    pdm_prefill_range_t plan[PDM_PREFILL_MAX_PLAN];
    int n_prefix;
    int nr = pdm_prefill_conv_plan(&gr->conv, (pdm_prefill_method_t)q->method_id, (int)gr->size,
                                   start, T, q->chunks, 0, plan, &n_prefix);
    if (nr < 0 || pdm_prefill_conv_commit(&gr->conv, (pdm_prefill_method_t)q->method_id,
                                          (int)gr->size, start, q->prompt + start, T, plan, nr))
        pdm_prefill_conv_reset(&gr->conv); /* out of step: forget (a smaller view is safe) */
    if (start > 0) {
        pdm_metric_inc(r->m.prefix_hits, NULL, 1);
        pdm_metric_inc(r->m.prefix_tokens, NULL, (double)start);
    }
}

/* Sends the DecodeTask of a new attempt. */
static void rt_dispatch(pdm_router_t *r, rt_req_t *q, int d, int g)
{
    rt_node_t *n = &r->nodes[d];
    q->attempt++;
    q->dnode = d;
    q->dnode_epoch = n->epoch;
    q->group = g;
    q->local = g < 0;
    q->base = q->n_gen;
    q->ranks_done = 0;
    q->started = 0;
    q->t_dispatch = pdm_now();
    q->cached_tokens = 0;
    snprintf(q->dnode_name, sizeof(q->dnode_name), "%s", n->id);
    const uint32_t remaining = q->max_new - q->n_gen;
    const uint32_t n_in = q->local ? q->n_prompt + q->n_gen : q->n_prompt;
    n->tasks++;
    q->kv_held = rt_kv_need(q, n_in, remaining);
    n->kv_reserved += q->kv_held;
    Pdmesh__DecodeTask t = PDMESH__DECODE_TASK__INIT;
    t.task_id = q->id;
    t.attempt = q->attempt;
    t.epoch = n->epoch;
    t.n_prompt = n_in;
    t.max_new = remaining;
    rt_beams_task(q, &t);
    int32_t *all = NULL;
    ProtobufCBinaryData addrs[PDM_KVT_MAX_RANKS];
    Pdmesh__TokenRange rg[PDM_PREFILL_MAX_PLAN], *rgp[PDM_PREFILL_MAX_PLAN];
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
    } else {
        rt_group_t *gr = &r->groups[g];
        const int32_t start0 = rt_reuse_start(r, gr, q);
        gr->inflight++;
        snprintf(q->group_name, sizeof(q->group_name), "%s", gr->name);
        for (uint32_t k = 0; k < gr->size; k++) {
            rt_node_t *m = &r->nodes[gr->member[k]];
            addrs[k].data = m->ucx;
            addrs[k].len = m->ucx_len;
            q->group_epochs[k] = m->epoch;
        }
        /* Method and partition by the length to compute and the cached prefix
         * (prefill_node/policy.c: partition table, calibration, auto; with a prefix auto
         * picks pass-KV or pass-Q). Where the method cannot continue there, the group
         * recomputes a little more (KVR needs a token per rank) or, if it cannot continue
         * the cached conversation at all (tsp; KVR after cp-*), the whole prompt. */
        pdm_prefill_method_t want = PDM_PREFILL_AUTO, m;
        pdm_prefill_method_parse(r->cfg.method, &want);
        int chunks[PDM_KVT_MAX_RANKS], has = 0, nr = -1, n_prefix = 0;
        pdm_prefill_range_t pr[PDM_PREFILL_MAX_PLAN];
        char why[256];
        const int32_t starts[3] = {start0, PDM_MIN(start0, (int32_t)(q->n_prompt - gr->size)), 0};
        int32_t start = 0;
        for (int c = 0; c < 3; c++) {
            start = starts[c];
            if (start < 0 || (start > 0 && start < r->cfg.block_tokens)) continue;
            const int32_t T = (int32_t)q->n_prompt - start;
            int rs = pdm_prefill_resolve(want, &r->model->hp, (int)gr->size, T, start, NULL,
                                         r->has_table ? &r->table : NULL,
                                         r->has_calib ? &r->calib : NULL, &m, chunks, &has, why,
                                         sizeof(why));
            if (rs && start > 0) continue;
            if (rs) m = gr->size == 1 ? PDM_PREFILL_SINGLE : PDM_PREFILL_KVR_E, has = 0;
            if (!has) pdm_prefill_split_even(T, (int)gr->size, chunks);
            nr = pdm_prefill_conv_plan(&gr->conv, m, (int)gr->size, start, T, chunks, 1, pr,
                                       &n_prefix);
            if (nr >= 0) break;
        }
        if (nr < 0) {
            rt_attempt_failed(r, q, PDMESH__ERROR_CODE__ERR_INTERNAL, pdm_error_last());
            return;
        }
        memcpy(q->chunks, chunks, sizeof(chunks));
        q->has_chunks = has;
        q->method_id = (int)m;
        q->cached_tokens = (uint32_t)start;
        q->reuse_pending = gr->reuse_pending = start > 0;
        snprintf(q->method, sizeof(q->method), "%s", pdm_prefill_method_name(m));
        for (int k = 0; k < nr; k++) {
            pdmesh__token_range__init(&rg[k]);
            rg[k].start = (uint32_t)pr[k].start;
            rg[k].len = (uint32_t)pr[k].len;
            rg[k].rank = (uint32_t)pr[k].rank;
            rg[k].chunk = (uint32_t)pr[k].chunk;
            rgp[k] = &rg[k];
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
    if (st) rt_attempt_failed(r, q, PDMESH__ERROR_CODE__ERR_UNAVAILABLE, "cannot reach the decode node");
}

void rt_schedule(pdm_router_t *r)
{
    rt_req_t *next;
    for (rt_req_t *q = r->head; q; q = next) {
        next = q->next;
        if (q->state != RQ_QUEUED) continue;
        if (q->n_gen >= q->max_new) { /* everything was delivered before the node failed */
            rt_req_finish(r, q, PDMESH__FINISH_REASON__FINISH_LENGTH);
            continue;
        }
        int migrate = q->n_gen > 0;
        int want_local = migrate || q->n_prompt < r->cfg.local_threshold || !rt_any_group_alive(r);
        int g = -1;
        if (!want_local) {
            g = rt_pick_group(r, q);
            if (g < 0) continue; /* every group is busy: wait */
        }
        int64_t need = rt_kv_need(q, q->n_prompt, q->max_new);
        int d = rt_pick_decode(r, q, need);
        if (d < 0) continue; /* wait for capacity (the deadline bounds the wait) */
        /* local prefills count here, a group's methods in rt_send_prefill */
        pdm_metric_inc(r->m.method, "local", g < 0 ? 1 : 0);
        rt_dispatch(r, q, d, g);
    }
}

/* Called by registry.c when a PrefillTask may be sent (the reservation is in place). */
void rt_send_prefill(pdm_router_t *r, rt_req_t *q)
{
    rt_group_t *g = &r->groups[q->group];
    rt_node_t *d = &r->nodes[q->dnode];
    Pdmesh__PrefillTask t = PDMESH__PREFILL_TASK__INIT;
    Pdmesh__SamplingParams sp = PDMESH__SAMPLING_PARAMS__INIT;
    uint32_t chunks[PDM_KVT_MAX_RANKS];
    t.task_id = q->id;
    t.attempt = q->attempt;
    t.method = q->method;
    /* A partial prefill names the cached prefix it assumes; the ranks check it. */
    t.start = q->cached_tokens;
    t.tokens = q->prompt + q->cached_tokens;
    t.n_tokens = q->n_prompt - q->cached_tokens;
    t.prefix = q->prompt;
    t.n_prefix = q->cached_tokens;
    if (q->reuse_pending) g->reuse_pending = q->reuse_pending = 0; /* it goes out now */
    if (q->has_chunks) {
        for (uint32_t k = 0; k < g->size; k++) chunks[k] = (uint32_t)q->chunks[k];
        t.chunks = chunks;
        t.n_chunks = g->size;
    }
    t.decode_address.data = d->ucx;
    t.decode_address.len = d->ucx_len;
    t.decode_node = d->id;
    t.sampling = &sp;
    double left = q->deadline - pdm_now();
    t.deadline_ms = left > 0 ? (uint32_t)(left * 1e3) : 1;
    q->state = RQ_PREFILL;
    pdm_metric_inc(r->m.method, q->method, 1);
    for (uint32_t k = 0; k < g->size; k++) {
        rt_node_t *m = &r->nodes[g->member[k]];
        t.epoch = m->epoch;
        if (rt_send(r->node_sock, m->ident, m->ident_len, PDMESH__MSG_TYPE__MSG_PREFILL_TASK, &t.base)) {
            rt_attempt_failed(r, q, PDMESH__ERROR_CODE__ERR_UNAVAILABLE, "cannot reach a prefill rank");
            return;
        }
    }
}

void rt_send_start(pdm_router_t *r, rt_req_t *q, int32_t first_token)
{
    rt_node_t *d = &r->nodes[q->dnode];
    Pdmesh__DecodeStart s = PDMESH__DECODE_START__INIT;
    Pdmesh__SamplingParams sp = PDMESH__SAMPLING_PARAMS__INIT;
    sp.temperature = q->sp.temperature;
    sp.top_k = q->sp.top_k;
    sp.top_p = q->sp.top_p;
    sp.min_p = q->sp.min_p;
    sp.repeat_penalty = q->sp.repeat_penalty;
    sp.seed = q->sp.seed;
    s.task_id = q->id;
    s.attempt = q->attempt;
    s.first_token = first_token;
    s.sampling = &sp;
    s.stop = q->stops;
    s.n_stop = q->n_stops;
    double left = q->deadline - pdm_now();
    s.deadline_ms = left > 0 ? (uint32_t)(left * 1e3) + 1 : 1;
    s.ignore_eos = q->ignore_eos;
    s.skip_tokens = 0; /* the router continues at q->base (migration re-prefills delivered tokens) */
    rt_beams_start(q, &s);
    q->state = RQ_DECODE;
    q->started = 1;
    if (rt_send(r->node_sock, d->ident, d->ident_len, PDMESH__MSG_TYPE__MSG_DECODE_START, &s.base))
        rt_attempt_failed(r, q, PDMESH__ERROR_CODE__ERR_UNAVAILABLE, "cannot reach the decode node");
}

/* ---------------------------------------------------------------- front-end API */

static int rt_refuse(int *code, int c, int st, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static int rt_refuse(int *code, int c, int st, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    *code = c;
    return pdm_error_set(st, "%s", msg);
}

int pdm_router_render_chat(pdm_router_t *r, const Pdmesh__ChatMessage *const *msgs, size_t n,
                           int32_t **out, size_t *n_out)
{
    if (!r->model || !r->model->tokenizer) return pdm_error_set(PDM_ESTATE, "no tokenizer");
    if (n == 0 || n > 256) return pdm_error_set(PDM_EINVAL, "chat needs 1 to 256 messages");
    const char *roles[256], *contents[256];
    for (size_t i = 0; i < n; i++) {
        roles[i] = msgs[i]->role ? msgs[i]->role : "";
        contents[i] = msgs[i]->content ? msgs[i]->content : "";
        if (strcmp(roles[i], "system") && strcmp(roles[i], "user") && strcmp(roles[i], "assistant"))
            return pdm_error_set(PDM_EINVAL, "chat role \"%.32s\" is not system, user or assistant",
                                 roles[i]);
    }
    char *text = pdm_tokenizer_chat_render(r->model->tokenizer, roles, contents, (int)n, 1);
    if (!text) return pdm_error_set(PDM_EUNSUPPORTED, "cannot apply the chat template");
    size_t len = strlen(text), need = 0;
    int32_t *ids = malloc(sizeof(int32_t) * (len + 8));
    int st = ids ? pdm_tokenizer_encode(r->model->tokenizer, text, len,
                                        PDM_TOKENIZE_ADD_BOS | PDM_TOKENIZE_SPECIAL, ids, len + 8, &need)
                 : PDM_ENOMEM;
    free(text);
    if (st) {
        free(ids);
        return pdm_error_set(st, "cannot tokenize the chat");
    }
    *out = ids;
    *n_out = need;
    return PDM_OK;
}

static int rt_tokenize(pdm_router_t *r, const char *text, int32_t **out, size_t *n_out)
{
    size_t len = strlen(text), need = 0;
    int32_t *ids = malloc(sizeof(int32_t) * (len + 8));
    if (!ids) return PDM_ENOMEM;
    int st = pdm_tokenizer_encode(r->model->tokenizer, text, len, PDM_TOKENIZE_ADD_BOS, ids,
                                  len + 8, &need);
    if (st) {
        free(ids);
        return st;
    }
    *out = ids;
    *n_out = need;
    return PDM_OK;
}

static int rt_has_decode(const pdm_router_t *r)
{
    for (int i = 0; i < RT_MAX_NODES; i++)
        if (rt_node_usable(r, i) && r->nodes[i].role == PDMESH__ROLE__ROLE_DECODE) return 1;
    return 0;
}

int pdm_router_ready(const pdm_router_t *r) { return rt_has_decode(r); }

int pdm_router_submit(pdm_router_t *r, const Pdmesh__GenerateRequest *req, const char *client,
                      const pdm_router_sink_t *sink, uint64_t *id, int *code)
{
    const int INV = PDMESH__ERROR_CODE__ERR_INVALID_ARGUMENT;
    int kinds = (req->prompt && req->prompt[0]) + (req->n_prompt_tokens > 0) + (req->n_messages > 0);
    if (kinds != 1)
        return rt_refuse(code, INV, PDM_EINVAL, "give exactly one of prompt, prompt_tokens or messages");
    if (req->model && req->model[0] && strcmp(req->model, r->model_name))
        return rt_refuse(code, PDMESH__ERROR_CODE__ERR_NOT_FOUND, PDM_ENOTFOUND,
                         "model \"%.64s\" is not served (this router serves \"%s\")", req->model,
                         r->model_name);
    uint32_t max_new = req->max_tokens ? req->max_tokens : r->cfg.default_max_tokens;
    if (r->cfg.max_tokens && max_new > r->cfg.max_tokens)
        return rt_refuse(code, INV, PDM_EINVAL, "max_tokens %u over the limit of %u", max_new,
                         r->cfg.max_tokens);
    if (req->n_stop > RT_MAX_STOPS)
        return rt_refuse(code, INV, PDM_EINVAL, "at most %d stop strings", RT_MAX_STOPS);
    for (size_t i = 0; i < req->n_stop; i++)
        if (!req->stop[i] || strlen(req->stop[i]) > 256)
            return rt_refuse(code, INV, PDM_EINVAL, "a stop string is longer than 256 bytes");
    if (req->deadline_ms > 3600u * 1000u)
        return rt_refuse(code, INV, PDM_EINVAL, "deadline_ms over one hour");
    pdm_sampler_params_t sp;
    pdm_sampler_params_default(&sp);
    const Pdmesh__SamplingParams *s = req->sampling;
    sp.temperature = s ? s->temperature : 0;
    sp.top_k = s && s->top_k > 0 ? s->top_k : 0;
    sp.top_p = s && s->top_p > 0 && s->top_p < 1 ? s->top_p : 1;
    sp.min_p = s ? s->min_p : 0;
    sp.repeat_penalty = s && s->repeat_penalty > 0 ? s->repeat_penalty : 1;
    sp.seed = s && s->seed ? s->seed : sp.seed;
    if (pdm_sampler_params_check(&sp))
        return rt_refuse(code, INV, PDM_EINVAL, "sampling: %s", pdm_error_last());
    int open_ = 0;
    for (rt_req_t *q = r->head; q; q = q->next) open_ += !strcmp(q->client, client ? client : "");
    if (r->cfg.per_client_max && open_ >= r->cfg.per_client_max)
        return rt_refuse(code, PDMESH__ERROR_CODE__ERR_OVERLOADED, PDM_EOVERFLOW,
                         "this client already has %d open requests (the limit)", open_);
    if (r->n_req >= r->cfg.queue_max) {
        pdm_metric_inc(r->m.requests, "overloaded", 1);
        return rt_refuse(code, PDMESH__ERROR_CODE__ERR_OVERLOADED, PDM_EOVERFLOW,
                         "overloaded: %d requests are open (the admission limit)", r->n_req);
    }
    if (!rt_has_decode(r))
        return rt_refuse(code, PDMESH__ERROR_CODE__ERR_UNAVAILABLE, PDM_ESTATE,
                         "no decode node is available");
    int32_t *tok = NULL;
    size_t n = 0;
    if (req->n_prompt_tokens) {
        if (req->n_prompt_tokens > r->cfg.max_prompt_tokens)
            return rt_refuse(code, INV, PDM_EINVAL, "%zu prompt tokens over the limit of %u",
                             req->n_prompt_tokens, r->cfg.max_prompt_tokens);
        for (size_t i = 0; i < req->n_prompt_tokens; i++)
            if (req->prompt_tokens[i] < 0 || (uint32_t)req->prompt_tokens[i] >= r->model->hp.n_vocab)
                return rt_refuse(code, INV, PDM_EINVAL, "prompt token %d is outside the vocabulary",
                                 req->prompt_tokens[i]);
        tok = malloc(sizeof(int32_t) * req->n_prompt_tokens);
        if (!tok) return rt_refuse(code, PDMESH__ERROR_CODE__ERR_INTERNAL, PDM_ENOMEM, "out of memory");
        memcpy(tok, req->prompt_tokens, sizeof(int32_t) * req->n_prompt_tokens);
        n = req->n_prompt_tokens;
    } else {
        if (req->prompt && strlen(req->prompt) > (size_t)r->cfg.max_prompt_tokens * 64)
            return rt_refuse(code, INV, PDM_EINVAL, "prompt text too long");
        int st = req->prompt && req->prompt[0] ? rt_tokenize(r, req->prompt, &tok, &n)
                             : pdm_router_render_chat(r, (const Pdmesh__ChatMessage *const *)req->messages,
                                                      req->n_messages, &tok, &n);
        if (st) return rt_refuse(code, INV, PDM_EINVAL, "prompt: %s", pdm_error_last());
    }
    if (n == 0 || n > r->cfg.max_prompt_tokens || n + max_new > r->model->hp.n_ctx_train) {
        free(tok);
        return rt_refuse(code, INV, PDM_EINVAL, "%zu prompt tokens + %u new tokens do not fit "
                         "(prompt limit %u, context %u)", n, max_new, r->cfg.max_prompt_tokens,
                         r->model->hp.n_ctx_train);
    }
    rt_req_t *q = calloc(1, sizeof(*q));
    if (q) q->gen = malloc(sizeof(int32_t) * max_new);
    if (!q || !q->gen) {
        if (q) free(q);
        free(tok);
        return rt_refuse(code, PDMESH__ERROR_CODE__ERR_INTERNAL, PDM_ENOMEM, "out of memory");
    }
    int bst = rt_beams_admit(r, req, q, code);
    if (bst) {
        free(q->gen);
        free(q);
        free(tok);
        return bst;
    }
    q->id = ++r->next_id;
    q->client_id = req->request_id;
    q->sink = *sink;
    snprintf(q->client, sizeof(q->client), "%s", client ? client : "");
    q->prompt = tok;
    q->n_prompt = (uint32_t)n;
    q->max_new = max_new;
    q->sp = sp;
    for (size_t i = 0; i < req->n_stop; i++)
        if (req->stop[i][0]) q->stops[q->n_stops++] = strdup(req->stop[i]);
    q->ignore_eos = req->ignore_eos;
    q->t_arrival = pdm_now();
    q->deadline = q->t_arrival + (req->deadline_ms ? req->deadline_ms : r->cfg.default_deadline_ms) / 1e3;
    q->dnode = q->group = -1;
    pdm_detok_init(&q->detok, 0);
    q->prev = r->tail;
    if (r->tail) r->tail->next = q;
    else r->head = q;
    r->tail = q;
    r->n_req++;
    pdm_metric_set(r->m.queue, NULL, r->n_req);
    *id = q->id;
    return PDM_OK;
}

int pdm_router_cancel(pdm_router_t *r, uint64_t id)
{
    rt_req_t *q = rt_req_find(r, id);
    if (!q) return pdm_error_set(PDM_ENOTFOUND, "request %llu is not open", (unsigned long long)id);
    rt_req_fail(r, q, PDMESH__ERROR_CODE__ERR_CANCELLED, "cancelled");
    return PDM_OK;
}

uv_loop_t *pdm_router_loop(pdm_router_t *r) { return r->loop; }
const char *pdm_router_model_name(const pdm_router_t *r) { return r->model_name; }
const pdm_router_limits_t *pdm_router_limits(const pdm_router_t *r) { return &r->limits; }
struct pdm_metrics *pdm_router_metrics(pdm_router_t *r)
{
    rt_node_metrics(r);
    return r->m.reg;
}

/* ---------------------------------------------------------------- sockets and loop */

static void rt_drain(pdm_router_t *r, int which)
{
    void *sock = which == 0 ? r->client_sock : which == 1 ? r->node_sock : r->admin_sock;
    for (int k = 0; k < 100000; k++) {
        int ev = 0;
        size_t sz = sizeof(ev);
        if (zmq_getsockopt(sock, ZMQ_EVENTS, &ev, &sz) || !(ev & ZMQ_POLLIN)) break;
        zmq_msg_t part[2];
        int nparts = 0, more = 1;
        while (more) {
            zmq_msg_t m;
            zmq_msg_init(&m);
            if (zmq_msg_recv(&m, sock, ZMQ_DONTWAIT) < 0) {
                zmq_msg_close(&m);
                break;
            }
            more = zmq_msg_more(&m);
            if (nparts < 2) part[nparts] = m;
            else zmq_msg_close(&m);
            nparts++;
        }
        if (nparts < 1) break;
        const uint8_t *ident = zmq_msg_data(&part[0]);
        size_t ident_len = zmq_msg_size(&part[0]);
        if (nparts != 2) {
            pdm_wire_send_error(sock, ident, ident_len, PDMESH__ERROR_CODE__ERR_BAD_MESSAGE, 0,
                                "expected exactly one message frame, got %d", nparts - 1);
        } else {
            const void *f = zmq_msg_data(&part[1]);
            size_t flen = zmq_msg_size(&part[1]);
            if (which == 0) rt_on_client_frame(r, ident, ident_len, f, flen);
            else if (which == 1) rt_on_node_frame(r, ident, ident_len, f, flen);
            else rt_on_admin_frame(r, ident, ident_len, f, flen);
        }
        for (int i = 0; i < PDM_MIN(nparts, 2); i++) zmq_msg_close(&part[i]);
    }
}

static void rt_drain_all(pdm_router_t *r)
{
    for (int i = 0; i < 3; i++) rt_drain(r, i);
    rt_schedule(r);
}

static void rt_on_poll(uv_poll_t *h, int status, int events)
{
    (void)status;
    (void)events;
    rt_drain_all(h->data);
}

static void rt_on_check(uv_check_t *h) { rt_drain_all(h->data); }

static void rt_on_tick(uv_timer_t *h)
{
    pdm_router_t *r = h->data;
    rt_registry_tick(r);
    rt_zfront_sweep(r);
    double now = pdm_now();
    rt_req_t *next;
    for (rt_req_t *q = r->head; q; q = next) {
        next = q->next;
        if (now > q->deadline)
            rt_req_fail(r, q, PDMESH__ERROR_CODE__ERR_DEADLINE_EXCEEDED,
                        "deadline exceeded after %.0f ms (%u of %u tokens generated)",
                        (now - q->t_arrival) * 1e3, q->n_gen, q->max_new);
    }
    rt_drain_all(r);
}

static void *rt_socket(pdm_router_t *r, const char *ep, const char *curve_secret)
{
    void *s = zmq_socket(r->zctx, ZMQ_ROUTER);
    if (!s) return NULL;
    if (curve_secret[0] && pdm_curve_server_setup(s, curve_secret)) {
        zmq_close(s);
        return NULL;
    }
    int one = 1, zero = 0, hwm = 10000, ivl = 10000, ttl = 30000;
    int64_t maxmsg = 2 * (int64_t)PDM_WIRE_MAX_FRAME + 1024; /* frames up to twice the cap get a
                                                             * TOO_LARGE reply; beyond, the
                                                             * connection is dropped */
    zmq_setsockopt(s, ZMQ_ROUTER_MANDATORY, &one, sizeof(one));
    zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof(zero));
    zmq_setsockopt(s, ZMQ_SNDHWM, &hwm, sizeof(hwm));
    zmq_setsockopt(s, ZMQ_RCVHWM, &hwm, sizeof(hwm));
    zmq_setsockopt(s, ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg));
    zmq_setsockopt(s, ZMQ_HEARTBEAT_IVL, &ivl, sizeof(ivl));
    zmq_setsockopt(s, ZMQ_HEARTBEAT_TIMEOUT, &ttl, sizeof(ttl));
    zmq_setsockopt(s, ZMQ_HEARTBEAT_TTL, &ttl, sizeof(ttl));
    if (zmq_bind(s, ep)) {
        pdm_error_set(PDM_EIO, "cannot bind %s: %s", ep, zmq_strerror(errno));
        zmq_close(s);
        return NULL;
    }
    return s;
}

/* The admin token (common/wire.h); none configured: NULL, every admin call is refused. */
static int rt_load_token(const char *path, char **out)
{
    int st = pdm_auth_load_admin_token(path, "--admin-token-file FILE", out);
    if (st == PDM_ENOTFOUND) *out = NULL;
    return st == PDM_ENOTFOUND ? PDM_OK : st;
}

int rt_router_create(uv_loop_t *loop, const rt_config_t *cfg, pdm_router_t **out)
{
    pdm_router_t *r = calloc(1, sizeof(*r));
    if (!r) return pdm_error_set(PDM_ENOMEM, "router: out of memory");
    r->loop = loop;
    r->cfg = *cfg;
    if (r->cfg.max_attempts < 1) r->cfg.max_attempts = 1;
    if (r->cfg.max_attempts > 15) r->cfg.max_attempts = 15;
    r->limits.max_body_bytes = 1u << 20;
    r->limits.max_prompt_tokens = cfg->max_prompt_tokens;
    r->limits.max_tokens = cfg->max_tokens;
    r->limits.max_beams = cfg->max_beams;
    int st = pdm_auth_load_secret(cfg->secret_file, &r->secret, &r->secret_len);
    if (st) {
        pdm_error_set(st, "cluster secret: %s (set PDMESH_SECRET_FILE or PDMESH_SECRET)",
                      pdm_error_last());
        goto fail;
    }
    if ((st = rt_load_token(cfg->admin_token_file, &r->admin_token))) goto fail;
    if ((st = pdm_random_bytes(r->prefix_salt, sizeof(r->prefix_salt)))) goto fail;
    if ((st = pdm_model_load(cfg->model_path, &r->model))) goto fail;
    if (!r->model->tokenizer) {
        st = pdm_error_set(PDM_EUNSUPPORTED, "%s has no tokenizer", cfg->model_path);
        goto fail;
    }
    const char *base = strrchr(cfg->model_path, '/');
    snprintf(r->model_name, sizeof(r->model_name), "%s", base ? base + 1 : cfg->model_path);
    char *dot = strstr(r->model_name, ".gguf");
    if (dot) *dot = 0;
    if (cfg->partition_table) {
        if ((st = pdm_partition_table_load(cfg->partition_table, &r->table))) goto fail;
        r->has_table = 1;
    }
    if (cfg->calibration) {
        if ((st = pdm_calibration_load(cfg->calibration, &r->calib))) goto fail;
        r->has_calib = 1;
    }
    r->m.reg = pdm_metrics_create();
    static const double lat[] = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30};
    static const double tpot[] = {0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1};
    pdm_metrics_t *m = r->m.reg;
    r->m.requests = pdm_metrics_add(m, PDM_METRIC_COUNTER, "pdmesh_requests_total",
                                    "Requests ended, by outcome.", "outcome", NULL, 0);
    r->m.ttft = pdm_metrics_add(m, PDM_METRIC_HISTOGRAM, "pdmesh_ttft_seconds",
                                "Arrival to first token.", NULL, lat, PDM_ARRAY_SIZE(lat));
    r->m.tpot = pdm_metrics_add(m, PDM_METRIC_HISTOGRAM, "pdmesh_tpot_seconds",
                                "Mean time per output token after the first.", NULL, tpot,
                                PDM_ARRAY_SIZE(tpot));
    r->m.queue = pdm_metrics_add(m, PDM_METRIC_GAUGE, "pdmesh_queue_depth",
                                 "Requests admitted and not ended.", NULL, NULL, 0);
    r->m.method = pdm_metrics_add(m, PDM_METRIC_COUNTER, "pdmesh_prefill_method_total",
                                  "Prefills by method (local: the decode node prefilled).",
                                  "method", NULL, 0);
    r->m.kv_bytes = pdm_metrics_add(m, PDM_METRIC_COUNTER, "pdmesh_kv_bytes_total",
                                    "KV bytes streamed from prefill groups to decode nodes.",
                                    NULL, NULL, 0);
    r->m.kv_time = pdm_metrics_add(m, PDM_METRIC_HISTOGRAM, "pdmesh_kv_transfer_seconds",
                                   "Decode node: start to KV verified.", NULL, lat,
                                   PDM_ARRAY_SIZE(lat));
    r->m.nodes = pdm_metrics_add(m, PDM_METRIC_GAUGE, "pdmesh_nodes", "Nodes by role and state.",
                                 "role_state", NULL, 0);
    r->m.migrations = pdm_metrics_add(m, PDM_METRIC_COUNTER, "pdmesh_migrations_total",
                                      "Requests moved to another decode node.", NULL, NULL, 0);
    r->m.retries = pdm_metrics_add(m, PDM_METRIC_COUNTER, "pdmesh_retries_total",
                                   "Prefill attempts run again.", NULL, NULL, 0);
    r->m.offload = pdm_metrics_add(m, PDM_METRIC_GAUGE, "pdmesh_offload_bytes",
                                   "Head-wise offload: bytes in the slow tier, per node.", "node",
                                   NULL, 0);
    r->m.prefix_hits = pdm_metrics_add(m, PDM_METRIC_COUNTER, "pdmesh_prefix_hits_total",
                                       "Prefills that reused a prefix cached on their group.",
                                       NULL, NULL, 0);
    r->m.prefix_tokens = pdm_metrics_add(m, PDM_METRIC_COUNTER,
                                         "pdmesh_prefix_cached_tokens_total",
                                         "Prompt tokens not prefilled again (cached on the group).",
                                         NULL, NULL, 0);
    pdm_metric_set(r->m.queue, NULL, 0);
    pdm_metric_inc(r->m.requests, "ok", 0);
    pdm_metric_inc(r->m.migrations, NULL, 0);
    pdm_metric_inc(r->m.retries, NULL, 0);
    pdm_metric_inc(r->m.kv_bytes, NULL, 0);
    r->zctx = zmq_ctx_new();
    char curve_secret[PDM_CURVE_KEY_LEN + 1] = "";
    if (r->zctx && (st = rt_curve_start(r, curve_secret))) goto fail; /* ZAP before binds */
    if (!r->zctx || !(r->client_sock = rt_socket(r, cfg->client_ep, curve_secret)) ||
        !(r->node_sock = rt_socket(r, cfg->node_ep, curve_secret)) ||
        !(r->admin_sock = rt_socket(r, cfg->admin_ep, curve_secret))) {
        explicit_bzero(curve_secret, sizeof(curve_secret));
        st = PDM_EIO;
        goto fail;
    }
    explicit_bzero(curve_secret, sizeof(curve_secret));
    void *socks[3] = {r->client_sock, r->node_sock, r->admin_sock};
    for (int i = 0; i < 3; i++) {
        int fd;
        size_t sz = sizeof(fd);
        zmq_getsockopt(socks[i], ZMQ_FD, &fd, &sz);
        uv_poll_init(loop, &r->poll[i], fd);
        r->poll[i].data = r;
        uv_poll_start(&r->poll[i], UV_READABLE, rt_on_poll);
    }
    uv_check_init(loop, &r->check);
    r->check.data = r;
    uv_check_start(&r->check, rt_on_check);
    uv_timer_init(loop, &r->tick);
    r->tick.data = r;
    uv_timer_start(&r->tick, rt_on_tick, 50, 50);
    r->handles_open = 1;
    if ((st = rt_zfront_init(r))) goto fail;
    *out = r;
    return PDM_OK;
fail:
    rt_router_close(r);
    if (r->handles_open) uv_run(loop, UV_RUN_DEFAULT);
    rt_router_free(r);
    return st ? st : PDM_EIO;
}

/* Ends every open request with an error, closes the loop handles. */
void rt_router_close(pdm_router_t *r)
{
    while (r->head)
        rt_req_fail(r, r->head, PDMESH__ERROR_CODE__ERR_UNAVAILABLE, "the router is shutting down");
    if (r->handles_open) {
        for (int i = 0; i < 3; i++) uv_close((uv_handle_t *)&r->poll[i], NULL);
        uv_close((uv_handle_t *)&r->check, NULL);
        uv_close((uv_handle_t *)&r->tick, NULL);
    }
}

void rt_router_free(pdm_router_t *r)
{
    if (!r) return;
    rt_zfront_fini(r);
    if (r->client_sock) zmq_close(r->client_sock);
    if (r->node_sock) zmq_close(r->node_sock);
    if (r->admin_sock) zmq_close(r->admin_sock);
    rt_curve_stop(r);
    if (r->zctx) zmq_ctx_term(r->zctx);
    for (int i = 0; i < RT_MAX_NODES; i++) free(r->nodes[i].ucx);
    for (int g = 0; g < RT_MAX_GROUPS; g++) pdm_prefill_conv_free(&r->groups[g].conv);
    pdm_metrics_free(r->m.reg);
    pdm_model_free(r->model);
    free(r->secret);
    free(r->admin_token);
    free(r);
}
