/*
 * pdmesh-decode - a decode node.
 *
 * The node connects to a node socket (--router: the router's, or a local harness's such as
 * pdmesh disagg-run, prefill_node/launch.c) and takes its work as the messages of
 * proto/pdmesh.proto through its link (common/nodelink.h):
 *
 *   DecodeTask   -> connect to the prefill ranks, reserve KV, post the receives of every
 *                   block (or prefill locally)                       -> DecodeReserved
 *   DecodeStart  -> generate once the KV has arrived and verified    -> DecodeTokens ...,
 *                                                                       DecodeResult
 *   CancelTask   -> end the sequence (its DecodeResult says ERR_CANCELLED)
 *   StatsRequest ->                                                  -> NodeStats
 *
 * A task attempt is known on the node by PDM_LINK_TASK_KEY(task_id, attempt). The node keeps
 * stepping its batch while it takes messages (it polls without blocking while sequences run).
 * Diagnostics go to stderr. SIGTERM ends the process cleanly (Deregister first).
 */
#include <getopt.h>
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/nodelink.h"
#include "common/pdm.h"
#include "decode_node/decode.h"

#define PDM__MAX_TASKS 4096

/* What a task attempt needs between its DecodeTask and its DecodeResult. */
typedef struct {
    int used;
    uint64_t key;           /* PDM_LINK_TASK_KEY */
    uint64_t task_id;
    uint32_t attempt;
    uint32_t skip;          /* migration: tokens already delivered, not streamed again */
    int orphan;             /* its router is gone: cancelled, nothing more is sent */
    int origin;             /* the router it came from (pdm_link_origin): answers go there */
    /* beam search of the DecodeTask (beams > 1), applied at its DecodeStart */
    uint32_t beams, n_best;
    float length_penalty;
    char early_stopping[16];
    uint32_t samples;       /* DecodeTask.n_samples (> 1: OpenAI's n over a shared prompt) */
} pdm__task_t;

typedef struct {
    const pdm_model_t *model;
    pdm_kvt_t *kvt;
    pdm_decode_node_t *node;
    pdm_link_t *link;
    pdm_decode_params_t dp;
    pdm_kvoff_params_t offload;  /* --kv-fast-budget / --kv-slow-tier / --kv-offload-groups */
    pdm_beam_params_t beam;      /* --beams, --length-penalty, --n-best, --early-stopping */
    unsigned orphans_seen;       /* pdm_link_orphans when the tasks were last checked */
    unsigned orphans_of[PDM_LINK_MAX_ROUTERS]; /* pdm_link_orphans_of, per router, then */
    double next_load_report;     /* pdm__report_load: when the heartbeat's load is refreshed */
    /* KV events of the prefix pool (pdm__report_kv_events) */
    uint64_t kvev_epoch[PDM_LINK_MAX_ROUTERS]; /* each router's registration the events
                                  * last went to (a new one gets a reset and a snapshot) */
    uint64_t kvev_seq;           /* KvEvents.seq of the last message (to every router) */
    double kvev_next_snapshot;   /* anti-entropy snapshot (PDM_KVEV_SNAPSHOT_S) */
    double kvev_next_stats;      /* pool stats go out at least this often, events or not */
    pdm_decode_kv_event_t *kvev; /* [PDM_KVEV_MAX_KEYS] one message's events */
    Pdmesh__KvEvent *kvev_runs;  /* [PDM_KVEV_MAX_KEYS] its runs of one kind and tier */
    Pdmesh__KvEvent **kvev_runp; /* [PDM_KVEV_MAX_KEYS] */
    ProtobufCBinaryData *kvev_keys; /* [PDM_KVEV_MAX_KEYS] */
    const char *node_id;
    int n_tasks;                 /* tasks[n_tasks..] are all free (lookups stop there: a token
                                  * event looks its task up, and few tasks are held at once) */
    int rank_peer[PDM_KVT_MAX_RANKS]; /* kvt peers of the last DecodeTask's prefill ranks */
    int n_ranks;
    pdm__task_t tasks[PDM__MAX_TASKS];
} pdm__daemon_t;

static pdm__task_t *pdm__task_find(pdm__daemon_t *dn, uint64_t key)
{
    for (int i = 0; i < dn->n_tasks; i++)
        if (dn->tasks[i].used && dn->tasks[i].key == key) return &dn->tasks[i];
    return NULL;
}

static pdm__task_t *pdm__task_new(pdm__daemon_t *dn, uint64_t task_id, uint32_t attempt)
{
    for (int i = 0; i < PDM__MAX_TASKS; i++)
        if (!dn->tasks[i].used) {
            pdm__task_t *t = &dn->tasks[i];
            memset(t, 0, sizeof(*t));
            t->used = 1;
            t->key = PDM_LINK_TASK_KEY(task_id, attempt);
            t->task_id = task_id;
            t->attempt = attempt;
            t->origin = pdm_link_origin(dn->link);
            dn->n_tasks = PDM_MAX(dn->n_tasks, i + 1);
            return t;
        }
    return NULL;
}

static void pdm__task_free(pdm__daemon_t *dn, pdm__task_t *t)
{
    t->used = 0;
    while (dn->n_tasks > 0 && !dn->tasks[dn->n_tasks - 1].used) dn->n_tasks--;
}

/* DecodeReserved for task t (st: the reservation's status); plp (may be NULL): a local
 * prefill's prompt log-probabilities, [t->n_prompt_tokens], positions 1.. reported. */
static void pdm__reserved(pdm__daemon_t *dn, const Pdmesh__DecodeTask *t, int st,
                          const pdm_token_logprobs_t *plp)
{
    Pdmesh__DecodeReserved r = PDMESH__DECODE_RESERVED__INIT;
    Pdmesh__Error e = PDMESH__ERROR__INIT;
    Pdmesh__SampledLogprob *msgs = NULL, **list = NULL;
    uint32_t *pos = NULL;
    const size_t n = !st && plp && t->n_prompt_tokens > 1 ? t->n_prompt_tokens - 1 : 0;
    if (n) {
        msgs = malloc(sizeof(*msgs) * n);
        list = malloc(sizeof(*list) * n);
        pos = malloc(sizeof(*pos) * n);
        if (!msgs || !list || !pos) st = pdm_error_set(PDM_ENOMEM, "decode node: out of memory");
    }
    for (size_t i = 0; !st && i < n; i++) {
        const pdm_token_logprobs_t *x = &plp[i + 1];
        pdmesh__sampled_logprob__init(&msgs[i]);
        msgs[i].logprob = x->logprob;
        msgs[i].top_ids = (int32_t *)x->top_ids;
        msgs[i].n_top_ids = (size_t)x->n_top;
        msgs[i].top_logprobs = (float *)x->top_logprobs;
        msgs[i].n_top_logprobs = (size_t)x->n_top;
        list[i] = &msgs[i];
        pos[i] = (uint32_t)(i + 1);
    }
    if (!st && n) {
        r.prompt_logprobs = list;
        r.n_prompt_logprobs = n;
        r.prompt_positions = pos;
        r.n_prompt_positions = n;
    }
    r.task_id = e.task_id = t->task_id;
    r.attempt = e.attempt = t->attempt;
    r.epoch = pdm_link_epoch(dn->link);
    r.ok = !st;
    if (st) {
        e.code = st == PDM_EOVERFLOW ? PDMESH__ERROR_CODE__ERR_NODE_FULL
                                     : PDMESH__ERROR_CODE__ERR_INVALID_ARGUMENT;
        e.message = (char *)pdm_error_last();
        r.error = &e;
        /* delta transfer refused (decode.h, pdm_decode_node_reserve): the router streams the
         * whole prompt instead */
        r.pool_miss = t->pool_prefix && !t->local_prefill &&
                      (st == PDM_ENOTFOUND || st == PDM_ECHECKSUM || st == PDM_EUNSUPPORTED);
        if (r.pool_miss)
            e.code = st == PDM_ECHECKSUM ? PDMESH__ERROR_CODE__ERR_KV_CORRUPT
                                         : PDMESH__ERROR_CODE__ERR_KV_TRANSFER;
    }
    pdm_link_send(dn->link, PDMESH__MSG_TYPE__MSG_DECODE_RESERVED, &r.base);
    free(msgs);
    free(list);
    free(pos);
}

/* Connects the prefill ranks (cached peers) and posts the receives of the plan, or prefills
 * locally. */
static int pdm__reserve(pdm__daemon_t *dn, const Pdmesh__DecodeTask *t, const pdm__task_t *rec,
                        pdm_token_logprobs_t *plp)
{
    const uint64_t key = rec->key;
    const int beams = rec->beams ? (int)rec->beams : -1; /* -1: none, whatever --beams says */
    if (t->max_new > (1u << 30) || t->n_prompt > (1u << 30))
        return pdm_error_set(PDM_ERANGE, "DecodeTask: n_prompt or max_new out of range");
    if (t->local_prefill) {
        if (t->pool_prefix) /* (the local prefill finds its pooled prefix by itself) */
            return pdm_error_set(PDM_EINVAL, "DecodeTask: pool_prefix with a local prefill");
        if (!t->n_prompt_tokens)
            return pdm_error_set(PDM_EINVAL, "DecodeTask: local prefill without prompt tokens");
        if (t->n_prompt_tokens > (1u << 30) || t->n_generated >= t->n_prompt_tokens)
            return pdm_error_set(PDM_ERANGE, "DecodeTask: %u generated tokens in a prompt of %zu",
                                 t->n_generated, t->n_prompt_tokens);
        pdm_decode_local_t lr = {.id = key, .attempt = t->attempt & 15u,
                                 .tokens = t->prompt_tokens,
                                 .n_tokens = (int32_t)t->n_prompt_tokens,
                                 .max_new = (int32_t)t->max_new, .beams = beams,
                                 .n_generated = (int32_t)t->n_generated,
                                 .replay = t->replay_generated, .prompt_lp = plp,
                                 .samples = (int)rec->samples,
                                 .prompt_top = (int)t->prompt_top_logprobs};
        return pdm_decode_node_reserve_local(dn->node, &lr);
    }
    if (!t->n_prefill_addresses || t->n_prefill_addresses > PDM_KVT_MAX_RANKS ||
        !t->n_ranges || t->n_ranges > 1024)
        return pdm_error_set(PDM_EINVAL, "DecodeTask: needs 1..%d prefill addresses and "
                             "1..1024 ranges", PDM_KVT_MAX_RANKS);
    int peers[PDM_KVT_MAX_RANKS];
    for (size_t i = 0; i < t->n_prefill_addresses; i++) {
        int st = pdm_kvt_connect_cached(dn->kvt, t->prefill_addresses[i].data,
                                        t->prefill_addresses[i].len, &peers[i]);
        if (st) return pdm_error_set(st, "prefill rank %zu: %s", i, pdm_error_last());
    }
    memcpy(dn->rank_peer, peers, sizeof(int) * t->n_prefill_addresses);
    dn->n_ranks = (int)t->n_prefill_addresses;
    pdm_decode_range_t rg[1024];
    for (size_t i = 0; i < t->n_ranges; i++) {
        const Pdmesh__TokenRange *x = t->ranges[i];
        if (x->rank >= t->n_prefill_addresses || x->start > (1u << 30) || x->len > (1u << 30) ||
            x->chunk > (1u << 20))
            return pdm_error_set(PDM_EINVAL, "DecodeTask: range %zu names an unknown rank or is "
                                 "out of range", i);
        rg[i] = (pdm_decode_range_t){.start = (int32_t)x->start, .len = (int32_t)x->len,
                                     .peer = peers[x->rank], .chunk = (int)x->chunk};
    }
    if (t->kv_key.len && t->kv_key.len != PDM_KVT_KEY_BYTES)
        return pdm_error_set(PDM_EINVAL, "DecodeTask: kv_key must be %d bytes", PDM_KVT_KEY_BYTES);
    pdm_decode_reserve_t rv = {.id = key, .attempt = t->attempt & 15u,
                               .n_prompt = (int32_t)t->n_prompt, .max_new = (int32_t)t->max_new,
                               .ranges = rg, .n_ranges = (int)t->n_ranges, .beams = beams,
                               .samples = (int)rec->samples,
                               .kv_key = t->kv_key.len ? t->kv_key.data : NULL,
                               .tokens = t->n_prompt_tokens == t->n_prompt ? t->prompt_tokens
                                                                           : NULL,
                               .pool_prefix = (int32_t)PDM_MIN(t->pool_prefix, 1u << 30)};
    return pdm_decode_node_reserve(dn->node, &rv);
}

static void pdm__on_decode_task(pdm__daemon_t *dn, const Pdmesh__DecodeTask *t)
{
    const uint64_t key = PDM_LINK_TASK_KEY(t->task_id, t->attempt);
    if (pdm__task_find(dn, key)) {
        pdm__reserved(dn, t, pdm_error_set(PDM_EINVAL, "DecodeTask: task %llu attempt %u is "
                                         "already held", (unsigned long long)t->task_id,
                                         t->attempt), NULL);
        return;
    }
    pdm__task_t *rec = pdm__task_new(dn, t->task_id, t->attempt);
    if (!rec) {
        pdm__reserved(dn, t, pdm_error_set(PDM_EOVERFLOW, "decode node full: %d tasks held",
                                         PDM__MAX_TASKS), NULL);
        return;
    }
    if (t->n_samples > PDM_NSAMP_MAX) {
        pdm__reserved(dn, t, pdm_error_set(PDM_EINVAL, "DecodeTask: n_samples %u (at most %d)",
                                         t->n_samples, PDM_NSAMP_MAX), NULL);
        pdm__task_free(dn, rec);
        return;
    }
    rec->samples = t->n_samples; /* 1: one sample over the segmented cache (a resumed choice) */
    if (t->beams > 1) {
        rec->beams = t->beams;
        rec->n_best = t->n_best ? t->n_best : 1;
        rec->length_penalty = t->length_penalty;
        snprintf(rec->early_stopping, sizeof(rec->early_stopping), "%s",
                 t->early_stopping && t->early_stopping[0] ? t->early_stopping : "heuristic");
    }
    /* A local prefill that scores the prompt (the router's echo / prompt_logprobs). */
    pdm_token_logprobs_t *plp = NULL;
    int st = PDM_OK;
    if (t->prompt_logprobs) {
        if (!t->local_prefill || t->n_generated || !t->n_prompt_tokens ||
            t->n_prompt_tokens > (1u << 30) ||
            t->prompt_top_logprobs > PDM_SAMPLER_MAX_TOP_LOGPROBS)
            st = pdm_error_set(PDM_EINVAL, "DecodeTask: prompt_logprobs need a local prefill of "
                               "a new prompt and at most %d alternatives",
                               PDM_SAMPLER_MAX_TOP_LOGPROBS);
        else if (!(plp = malloc(sizeof(*plp) * t->n_prompt_tokens)))
            st = pdm_error_set(PDM_ENOMEM, "decode node: out of memory");
    }
    if (!st) st = pdm__reserve(dn, t, rec, plp);
    if (st) pdm__task_free(dn, rec);
    pdm__reserved(dn, t, st, plp);
    free(plp);
}

/* DecodeResult of a task that ends with an error (its record is released). */
static void pdm__result_error(pdm__daemon_t *dn, uint64_t task_id, uint32_t attempt, int code,
                            const char *msg)
{
    Pdmesh__DecodeResult r = PDMESH__DECODE_RESULT__INIT;
    Pdmesh__Error e = PDMESH__ERROR__INIT;
    pdm__task_t *rec = pdm__task_find(dn, PDM_LINK_TASK_KEY(task_id, attempt));
    const int origin = rec ? rec->origin : pdm_link_origin(dn->link);
    r.task_id = e.task_id = task_id;
    r.attempt = e.attempt = attempt;
    r.epoch = pdm_link_epoch_of(dn->link, origin);
    e.code = (Pdmesh__ErrorCode)code;
    e.message = (char *)msg;
    r.error = &e;
    pdm_link_send_to(dn->link, origin, PDMESH__MSG_TYPE__MSG_DECODE_RESULT, &r.base);
    if (rec) pdm__task_free(dn, rec);
}

static void pdm__on_decode_start(pdm__daemon_t *dn, const Pdmesh__DecodeStart *m)
{
    const uint64_t key = PDM_LINK_TASK_KEY(m->task_id, m->attempt);
    pdm__task_t *rec = pdm__task_find(dn, key);
    pdm_decode_start_t s = {.id = key, .first_token = m->first_token};
    pdm_token_logprobs_t first_lp;
    /* the router sends the request's parameters (SamplingParams, one mapping for all) */
    int st = pdm_sampler_params_from_msg(m->sampling, &s.sp);
    if (!st && m->first_logprob) {
        const Pdmesh__SampledLogprob *f = m->first_logprob;
        if (f->n_top_ids != f->n_top_logprobs || f->n_top_ids > PDM_SAMPLER_MAX_TOP_LOGPROBS) {
            st = pdm_error_set(PDM_EINVAL, "DecodeStart: first_logprob has %zu ids and %zu "
                               "values (at most %d)", f->n_top_ids, f->n_top_logprobs,
                               PDM_SAMPLER_MAX_TOP_LOGPROBS);
        } else {
            first_lp.logprob = f->logprob;
            first_lp.n_top = (int32_t)f->n_top_ids;
            if (f->n_top_ids) { /* (none: NULL arrays) */
                memcpy(first_lp.top_ids, f->top_ids, sizeof(int32_t) * f->n_top_ids);
                memcpy(first_lp.top_logprobs, f->top_logprobs, sizeof(float) * f->n_top_ids);
            }
            s.first_logprob = &first_lp;
        }
    }
    const char *stops[8];
    for (size_t i = 0; i < m->n_stop && s.n_stops < 8; i++) stops[s.n_stops++] = m->stop[i];
    s.stops = stops;
    s.deadline = m->deadline_ms ? pdm_now() + m->deadline_ms / 1000.0 : 0;
    s.ignore_eos = m->ignore_eos;
    s.prompt_last = -1;
    s.beam = dn->beam;
    s.beam.width = 0;
    if (st) {
        /* refused below, with the parameters' message */
    } else if (!rec) {
        st = pdm_error_set(PDM_ENOTFOUND, "DecodeStart: task %llu attempt %u is not reserved "
                           "here", (unsigned long long)m->task_id, m->attempt);
    } else {
        rec->skip = m->skip_tokens;
        if (rec->samples) { /* the first tokens: from the rank's logits, else a priming step */
            s.prompt_last = m->prompt_last;
            if (m->n_first_logits == dn->model->hp.n_vocab) s.first_logits = m->first_logits;
        }
        if (rec->beams) { /* the search picks the first token itself from the last one */
            s.beam.width = (int)rec->beams;
            s.beam.n_best = (int)rec->n_best;
            s.beam.length_penalty = rec->length_penalty;
            st = pdm_beam_stop_parse(rec->early_stopping, &s.beam.early_stopping);
            s.prompt_last = m->prompt_last;
        }
    }
    if (!st) st = pdm_decode_node_start(dn->node, &s);
    if (st)
        pdm__result_error(dn, m->task_id, m->attempt, st == PDM_ENOTFOUND || st == PDM_EINVAL
                                                        ? PDMESH__ERROR_CODE__ERR_INVALID_ARGUMENT
                                                        : PDMESH__ERROR_CODE__ERR_INTERNAL,
                        pdm_error_last());
}

/* What the node holds now: sequences, KV slots, bytes in the offload tier. */
static void pdm__load(pdm__daemon_t *dn, Pdmesh__Load *load)
{
    int held;
    int64_t slots;
    pdm_decode_node_usage(dn->node, &held, &slots);
    pdmesh__load__init(load);
    load->running = (uint32_t)pdm_decode_node_running(dn->node);
    load->held = (uint32_t)held;
    load->kv_tokens_used = (uint64_t)slots;
    load->kv_tokens_free = dn->dp.kv_budget > slots ? (uint64_t)(dn->dp.kv_budget - slots) : 0;
    pdm_kvoff_stats_t os;
    if (!pdm_decode_node_offload_stats(dn->node, &os)) load->offload_bytes = (uint64_t)os.slow.used;
}

static void pdm__on_stats(pdm__daemon_t *dn)
{
    Pdmesh__NodeStats s = PDMESH__NODE_STATS__INIT;
    Pdmesh__Load load;
    Pdmesh__PeerTraffic traffic[PDM_KVT_MAX_RANKS], *tp[PDM_KVT_MAX_RANKS];
    pdm__load(dn, &load);
    s.epoch = pdm_link_epoch(dn->link);
    s.load = &load;
    s.held = load.held;
    s.kv_slots = load.kv_tokens_used;
    /* KV received from each prefill rank so far (transfer statistics). */
    for (int r = 0; r < dn->n_ranks; r++) {
        pdm_kvt_stats_t ps;
        if (pdm_kvt_peer_stats(dn->kvt, dn->rank_peer[r], &ps)) continue;
        pdmesh__peer_traffic__init(&traffic[s.n_ranks]);
        traffic[s.n_ranks].rank = (uint32_t)r;
        traffic[s.n_ranks].bytes_received = ps.bytes_received;
        traffic[s.n_ranks].messages = ps.receives;
        tp[s.n_ranks] = &traffic[s.n_ranks];
        s.n_ranks++;
    }
    s.ranks = tp;
    pdm_link_send(dn->link, PDMESH__MSG_TYPE__MSG_NODE_STATS, &s.base);
}

/* The load the heartbeats report (refreshed every 50 ms: the heartbeat is seconds apart). */
static void pdm__report_load(pdm__daemon_t *dn)
{
    double now = pdm_now();
    if (now < dn->next_load_report) return;
    dn->next_load_report = now + 0.05;
    Pdmesh__Load load;
    pdm__load(dn, &load);
    pdm_link_set_load(dn->link, &load);
}

/* The prefix pool's KV events (decode.h) to every router the node is registered with (each
 * keeps its own index from the same events: docs/router.md "High availability"), at most
 * PDM_KVEV_MAX_KEYS keys a message, a few messages per call (the link's queue is bounded too),
 * with the pool's stats. A new registration with any router brings the block keys
 * (RegisterAck: the same in every router of a mesh, pdm_prefix_salt_derive) and a reset and
 * full snapshot to all of them; a snapshot also goes out every PDM_KVEV_SNAPSHOT_S in case a
 * message was lost. */
static void pdm__report_kv_events(pdm__daemon_t *dn)
{
    if (dn->dp.pool_tokens <= 0 || !dn->kvev) return;
    const int nr = pdm_link_n_routers(dn->link);
    int any = 0, fresh = 0;
    for (int o = 0; o < nr && o < PDM_LINK_MAX_ROUTERS; o++) {
        const uint64_t e =
            pdm_link_router_registered(dn->link, o) ? pdm_link_epoch_of(dn->link, o) : 0;
        any |= e != 0;
        fresh |= e && e != dn->kvev_epoch[o];
        dn->kvev_epoch[o] = e;
    }
    if (!any) return;
    const double now = pdm_now();
    if (fresh) {
        pdm_prefix_key_params_t kp;
        char model[128];
        const uint64_t ke = pdm_link_prefix_keys(dn->link, &kp, model, sizeof(model));
        pdm_decode_node_set_prefix_keys(dn->node, ke ? &kp : NULL);
        dn->kvev_next_snapshot = now + PDM_KVEV_SNAPSHOT_S;
        dn->kvev_next_stats = 0;
    } else if (now > dn->kvev_next_snapshot) {
        pdm_decode_node_kv_resync(dn->node);
        dn->kvev_next_snapshot = now + PDM_KVEV_SNAPSHOT_S;
    }
    for (int msg = 0; msg < 8; msg++) {
        int reset = 0;
        const int n = pdm_decode_node_kv_events(dn->node, dn->kvev, PDM_KVEV_MAX_KEYS, &reset);
        if (!n && !reset && now < dn->kvev_next_stats) return;
        /* one KvEvent per run of equal kind and tier, in order (at most n runs) */
        Pdmesh__KvEvent *evs = dn->kvev_runs, **evp = dn->kvev_runp;
        ProtobufCBinaryData *keys = dn->kvev_keys;
        size_t n_ev = 0;
        int i = 0;
        while (i < n) {
            int j = i;
            while (j < n && dn->kvev[j].kind == dn->kvev[i].kind &&
                   dn->kvev[j].tier == dn->kvev[i].tier)
                j++;
            pdmesh__kv_event__init(&evs[n_ev]);
            evs[n_ev].kind = dn->kvev[i].kind == PDM_DECODE_KVEV_STORED
                                 ? PDMESH__KV_EVENT_KIND__KV_EVENT_STORED
                                 : PDMESH__KV_EVENT_KIND__KV_EVENT_EVICTED;
            evs[n_ev].tier = dn->kvev[i].tier == 2 ? PDMESH__KV_TIER__KV_TIER_FILE
                                                   : PDMESH__KV_TIER__KV_TIER_RAM;
            for (int k = i; k < j; k++) keys[k] = (ProtobufCBinaryData){32, dn->kvev[k].key};
            evs[n_ev].block_keys = &keys[i];
            evs[n_ev].n_block_keys = (size_t)(j - i);
            evp[n_ev] = &evs[n_ev];
            n_ev++;
            i = j;
        }
        pdm_decode_pool_stats_t ps;
        pdm_decode_node_pool_stats(dn->node, &ps);
        Pdmesh__PoolStats pool = PDMESH__POOL_STATS__INIT;
        pool.budget_tokens = (uint64_t)dn->dp.pool_tokens;
        pool.tokens = (uint64_t)ps.slots;
        pool.blocks = ps.blocks;
        pool.bytes = ps.bytes;
        pool.entries = (uint32_t)ps.entries;
        pool.lookups = ps.lookups;
        pool.hits = ps.hits;
        pool.reused_tokens = ps.reused_tokens;
        pool.evictions = ps.evictions;
        pool.corrupt = ps.corrupt;
        pool.file_tokens = (uint64_t)ps.file_tokens;
        pool.file_bytes = ps.file_bytes;
        Pdmesh__KvEvents m = PDMESH__KV_EVENTS__INIT;
        m.node_id = (char *)dn->node_id;
        m.seq = ++dn->kvev_seq;
        m.reset = reset;
        m.events = evp;
        m.n_events = n_ev;
        m.pool = &pool;
        for (int o = 0; o < nr && o < PDM_LINK_MAX_ROUTERS; o++) {
            if (!dn->kvev_epoch[o]) continue;
            m.epoch = dn->kvev_epoch[o];
            pdm_link_send_to(dn->link, o, PDMESH__MSG_TYPE__MSG_KV_EVENTS, &m.base);
        }
        dn->kvev_next_stats = now + 1.0;
        if (n < PDM_KVEV_MAX_KEYS) return;
    }
}

static void pdm__on_event(void *arg, const pdm_decode_event_t *ev);

/* The router that gave the node its tasks is gone (common/nodelink.h): cancel them all and
 * release their KV at once, sending nothing about them (a restarted router numbers its
 * requests afresh, and must not take an old task's end for one of its own). */
static void pdm__drop_orphans(pdm__daemon_t *dn)
{
    unsigned now = pdm_link_orphans(dn->link);
    if (now == dn->orphans_seen) return;
    dn->orphans_seen = now;
    int gone[PDM_LINK_MAX_ROUTERS] = {0};
    for (int o = 0; o < pdm_link_n_routers(dn->link); o++) {
        unsigned k = pdm_link_orphans_of(dn->link, o);
        gone[o] = k != dn->orphans_of[o];
        dn->orphans_of[o] = k;
    }
    int n = 0;
    for (int i = 0; i < dn->n_tasks; i++)
        if (dn->tasks[i].used && !dn->tasks[i].orphan && gone[dn->tasks[i].origin]) {
            dn->tasks[i].orphan = 1;
            pdm_decode_node_cancel(dn->node, dn->tasks[i].key);
            n++;
        }
    if (!n) return;
    pdm_decode_node_run_once(dn->node, pdm__on_event, dn); /* cancelled ones end here */
    for (int i = dn->n_tasks - 1; i >= 0; i--) /* reserved but never started, or failed */
        if (dn->tasks[i].used && dn->tasks[i].orphan) pdm__task_free(dn, &dn->tasks[i]);
    pdm_log_warn("decode node: dropped %d task(s) of a router that is gone", n);
}

static void pdm__on_message(pdm__daemon_t *dn, const pdm_wire_msg_t *m)
{
    const ProtobufCMessage *msg = pdm_wire_message(m);
    switch (pdm_wire_type(m)) {
    case PDMESH__MSG_TYPE__MSG_DECODE_TASK:
        pdm__on_decode_task(dn, (const Pdmesh__DecodeTask *)msg);
        break;
    case PDMESH__MSG_TYPE__MSG_DECODE_START:
        pdm__on_decode_start(dn, (const Pdmesh__DecodeStart *)msg);
        break;
    case PDMESH__MSG_TYPE__MSG_CANCEL_TASK: {
        const Pdmesh__CancelTask *c = (const Pdmesh__CancelTask *)msg;
        /* unknown (already ended) tasks need no answer */
        pdm_decode_node_cancel(dn->node, PDM_LINK_TASK_KEY(c->task_id, c->attempt));
        break;
    }
    case PDMESH__MSG_TYPE__MSG_STATS_REQUEST: pdm__on_stats(dn); break;
    default: break;
    }
}

/* ---- events of the batch -> DecodeTokens / DecodeResult ---- */

static void pdm__beam_result(const pdm_beam_report_t *br, Pdmesh__DecodeResult *r,
                           Pdmesh__Beam *beams, Pdmesh__Beam **bp, Pdmesh__BeamReport *rep)
{
    int n = PDM_MIN(br->n_hyps, PDM_BEAM_MAX_WIDTH);
    for (int h = 0; h < n; h++) {
        pdmesh__beam__init(&beams[h]);
        beams[h].tokens = br->hyps[h].tokens;
        beams[h].n_tokens = (size_t)br->hyps[h].n_tokens;
        beams[h].text = (char *)br->texts[h];
        beams[h].score = br->hyps[h].score;
        beams[h].logprob = br->hyps[h].logprob;
        beams[h].finish = br->hyps[h].eos ? PDMESH__FINISH_REASON__FINISH_EOS
                                          : PDMESH__FINISH_REASON__FINISH_LENGTH;
        bp[h] = &beams[h];
    }
    r->beams = bp;
    r->n_beams = (size_t)n;
    rep->width = (uint32_t)br->width;
    rep->length_penalty = br->length_penalty;
    rep->early_stopping = (char *)pdm_beam_stop_name(br->early_stopping);
    rep->n_prompt = (uint32_t)br->n_prompt;
    rep->n_response = (uint32_t)br->n_response;
    rep->kv_prompt_bytes = br->prompt_bytes;
    rep->kv_response_bytes = br->response_bytes;
    rep->kv_bytes_eq2 = br->eq2_bytes;
    rep->kv_bytes_eq3 = br->eq3_bytes;
    r->beam_report = rep;
}

static void pdm__offload_result(const pdm__daemon_t *dn, const pdm_kvoff_stats_t *st, Pdmesh__OffloadStats *o)
{
    o->fast_budget = (uint64_t)st->fast.budget;
    o->fast_bytes = (uint64_t)st->fast.used;
    o->fast_peak = (uint64_t)st->fast.peak;
    o->slow_tier = (char *)(dn->offload.slow_tier ? dn->offload.slow_tier : "ram");
    o->slow_bytes = (uint64_t)st->slow.used;
    o->slow_peak = (uint64_t)st->slow.peak;
    o->resident_heads = (uint32_t)st->resident_heads;
    o->offloaded_heads = (uint32_t)st->offloaded_heads;
    o->group = (uint32_t)st->last_group;
    o->prefetches = (uint64_t)st->prefetches;
    o->prefetch_bytes = (uint64_t)st->prefetch_bytes;
    o->writeback_bytes = (uint64_t)st->writeback_bytes;
    o->prefetch_waits = (uint64_t)st->prefetch_waits;
    o->wait_seconds = st->wait_seconds;
}

/* The wire's FinishReason of a DONE's or a sample's end (NONE: NULL, deadline, cancelled). */
static Pdmesh__FinishReason pdm__finish_reason(const char *why)
{
    if (!why) return PDMESH__FINISH_REASON__FINISH_NONE;
    if (!strcmp(why, "eos")) return PDMESH__FINISH_REASON__FINISH_EOS;
    if (!strcmp(why, "length")) return PDMESH__FINISH_REASON__FINISH_LENGTH;
    if (!strcmp(why, "stop")) return PDMESH__FINISH_REASON__FINISH_STOP;
    return PDMESH__FINISH_REASON__FINISH_NONE;
}

static void pdm__on_event(void *arg, const pdm_decode_event_t *ev)
{
    pdm__daemon_t *dn = arg;
    pdm__task_t *rec = pdm__task_find(dn, ev->id);
    if (rec && rec->orphan) { /* its router is gone: end it quietly */
        if (ev->type != PDM_DECODE_EV_TOKEN) pdm__task_free(dn, rec);
        return;
    }
    const int origin = rec ? rec->origin : pdm_link_origin(dn->link);
    const uint64_t task_id = rec ? rec->task_id : ev->id / 16;
    const uint32_t attempt = rec ? rec->attempt : (uint32_t)(ev->id % 16);
    if (ev->type == PDM_DECODE_EV_TOKEN) {
        if (rec && (uint32_t)ev->index < rec->skip) return; /* migration: already delivered */
        Pdmesh__DecodeTokens d = PDMESH__DECODE_TOKENS__INIT;
        Pdmesh__SampledLogprob lp = PDMESH__SAMPLED_LOGPROB__INIT, *lpp = &lp;
        int32_t tok = ev->token;
        d.task_id = task_id;
        d.attempt = attempt;
        d.index = (uint32_t)ev->index;
        d.tokens = &tok;
        d.n_tokens = 1;
        d.sample = (uint32_t)ev->sample;
        d.finish = pdm__finish_reason(ev->sample_finish);
        if (ev->logprob) {
            lp.logprob = ev->logprob->logprob;
            lp.top_ids = (int32_t *)ev->logprob->top_ids;
            lp.n_top_ids = (size_t)ev->logprob->n_top;
            lp.top_logprobs = (float *)ev->logprob->top_logprobs;
            lp.n_top_logprobs = (size_t)ev->logprob->n_top;
            d.logprobs = &lpp;
            d.n_logprobs = 1;
        }
        pdm_link_send_to(dn->link, origin, PDMESH__MSG_TYPE__MSG_DECODE_TOKENS, &d.base);
        return;
    }
    if (ev->type != PDM_DECODE_EV_DONE) {
        pdm__result_error(dn, task_id, attempt, ev->kv_error ? PDMESH__ERROR_CODE__ERR_KV_TRANSFER
                                                           : PDMESH__ERROR_CODE__ERR_INTERNAL,
                        ev->error ? ev->error : "failed");
        return;
    }
    Pdmesh__DecodeResult r = PDMESH__DECODE_RESULT__INIT;
    Pdmesh__Error e = PDMESH__ERROR__INIT;
    Pdmesh__Beam beams[PDM_BEAM_MAX_WIDTH], *bp[PDM_BEAM_MAX_WIDTH];
    Pdmesh__BeamReport rep = PDMESH__BEAM_REPORT__INIT;
    Pdmesh__OffloadStats off = PDMESH__OFFLOAD_STATS__INIT;
    r.task_id = e.task_id = task_id;
    r.attempt = e.attempt = attempt;
    r.epoch = pdm_link_epoch_of(dn->link, origin);
    r.ok = 1;
    r.finish = pdm__finish_reason(ev->finish);
    if (!r.finish) { /* deadline, cancelled: not a completion; the tokens so far come along */
        r.ok = 0;
        e.code = !strcmp(ev->finish, "deadline") ? PDMESH__ERROR_CODE__ERR_DEADLINE_EXCEEDED
                                                 : PDMESH__ERROR_CODE__ERR_CANCELLED;
        e.message = (char *)ev->finish;
        r.error = &e;
    }
    r.tokens = (int32_t *)ev->tokens;
    r.n_tokens = (size_t)ev->n_tokens;
    /* n samples: every sample's tokens one after another, with their counts and ends */
    int32_t *all = NULL;
    Pdmesh__FinishReason sfin[PDM_NSAMP_MAX];
    uint32_t snt[PDM_NSAMP_MAX];
    if (ev->n_samples > 0 && ev->n_samples <= PDM_NSAMP_MAX) {
        size_t total = 0;
        for (int i = 0; i < ev->n_samples; i++) total += (size_t)ev->sample_n_tokens[i];
        all = malloc(sizeof(int32_t) * (total ? total : 1));
        if (all) {
            total = 0;
            for (int i = 0; i < ev->n_samples; i++) {
                if (ev->sample_n_tokens[i] > 0)
                    memcpy(all + total, ev->sample_tokens[i],
                           sizeof(int32_t) * (size_t)ev->sample_n_tokens[i]);
                total += (size_t)ev->sample_n_tokens[i];
                snt[i] = (uint32_t)ev->sample_n_tokens[i];
                sfin[i] = pdm__finish_reason(ev->sample_finish_all[i]);
            }
            r.tokens = all;
            r.n_tokens = total;
            r.sample_finish = sfin;
            r.n_sample_finish = (size_t)ev->n_samples;
            r.sample_n_tokens = snt;
            r.n_sample_n_tokens = (size_t)ev->n_samples;
        } else { /* the router fills the samples from their DecodeTokens */
            r.n_tokens = 0;
        }
    }
    r.text = (char *)(ev->text ? ev->text : "");
    r.kv_seconds = ev->kv_seconds;
    r.step_seconds = ev->step_seconds;
    r.kv_bytes = ev->kv_bytes;
    r.kv_local_bytes = ev->kv_local_bytes;
    r.kv_global_bytes = ev->kv_global_bytes;
    r.cached_tokens = (uint32_t)(ev->cached_tokens > 0 ? ev->cached_tokens : 0);
    if (ev->beam) pdm__beam_result(ev->beam, &r, beams, bp, &rep);
    pdm_kvoff_stats_t os; /* head-wise offload: what it did so far (node-wide) */
    if (!pdm_decode_node_offload_stats(dn->node, &os)) {
        pdm__offload_result(dn, &os, &off);
        r.offload = &off;
    }
    pdm_link_send_to(dn->link, origin, PDMESH__MSG_TYPE__MSG_DECODE_RESULT, &r.base);
    free(all);
    if (rec) pdm__task_free(dn, rec);
}

static void pdm__usage(FILE *f)
{
    fprintf(f, "usage: pdmesh-decode --router ENDPOINT --node-id NAME [--secret-file F]\n"
               "       [--curve-server-key F --curve-key F] [--exit-with-parent] [--kv-interface DEV]\n"
               "       [--health-file F] [--drain-grace S]\n"
               "       [--model FILE] [--threads N] [--batch N] [--max-sequences N]\n"
               "       [--kv-budget TOKENS] [--kv-pool TOKENS] [--kv-dtype f32|f16|q8] [--kv-timeout S]\n"
               "       [--kv-window R]\n"
               "       [--beams B] [--length-penalty X] [--n-best N] "
               "[--early-stopping heuristic|early|never]\n"
               "       [--kv-fast-budget BYTES] [--kv-slow-tier ram|file:DIR] "
               "[--kv-offload-groups CTX:G,...]\n"
               "A decode node. It takes its tasks from the node socket at ENDPOINT (the router's,\n"
               "or pdmesh disagg-run's) as protobuf messages. --health-file: rewritten every\n"
               "second for `pdmesh health` (liveness and readiness probes). --drain-grace: on\n"
               "SIGTERM take no new work and stop once idle, for at most S seconds (0).\n"
               "--kv-pool: finished sequences keep their KV in up to TOKENS slots (evicted when\n"
               "work needs them) for later prompts that start with theirs (0: off); each pooled\n"
               "prefix carries checksums verified before reuse, and the pool's blocks are\n"
               "published to the router as KV events. --fault-corrupt-pool (tests only): flip\n"
               "a byte of a pooled prefix before each reuse, which the checksum must catch.\n"
               "--kv-pool-file file:DIR --kv-pool-file-tokens N: the pool's second tier:\n"
               "sequences evicted from the pool go to unlinked files under DIR (up to N\n"
               "tokens, least recently used out first) and are loaded back on a hit.\n"
               "--kv-window: sliding-window layers (Gemma 3's local layers) keep only their\n"
               "window S, in R x (S-1) rows per head (the static-window KV manager; 1.5 to 8,\n"
               "default 2; 0: every layer keeps the whole context); --kv-budget then counts\n"
               "their smaller footprint. Beam searches and --kv-fast-budget keep full KV.\n");
}

int main(int argc, char **argv)
{
    /* Every sequence allocates vocabulary-sized buffers (sampler candidates and counts,
     * logits: 0.2-0.4 MB each). glibc maps blocks that large, but raises its mapping threshold
     * to the largest block freed, after which they come from the heap, whose holes it cannot
     * return: the node's RSS at idle then swings with how the frees fell. A fixed threshold
     * keeps them mapped and returned on free (tests/hardening/memory_rounds.py). */
    mallopt(M_MMAP_THRESHOLD, 128 * 1024);
    const char *model_path = pdm_model_default_path();
    static pdm__daemon_t dn; /* the task table is large: not on the stack */
    pdm_decode_params_default(&dn.dp);
    pdm_kvoff_params_default(&dn.offload);
    enum { O_CURVE_SERVER = 1001, O_CURVE_KEY, O_EXIT_WITH_PARENT, O_KV_IFACE, O_HEALTH, O_DRAIN, O_POOL,
           O_WINDOW, O_FAULT_POOL, O_POOL_FILE, O_POOL_FILE_TOKENS };
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'},     {"threads", required_argument, 0, 't'},
        {"batch", required_argument, 0, 'b'},     {"kv-budget", required_argument, 0, 'k'},
        {"kv-dtype", required_argument, 0, 'd'},  {"kv-timeout", required_argument, 0, 'o'},
        {"max-sequences", required_argument, 0, 's'}, {"help", no_argument, 0, 'h'},
        {"beams", required_argument, 0, 'B'},     {"length-penalty", required_argument, 0, 'L'},
        {"n-best", required_argument, 0, 'N'},    {"early-stopping", required_argument, 0, 'E'},
        {"kv-fast-budget", required_argument, 0, 'F'}, {"kv-slow-tier", required_argument, 0, 'S'},
        {"kv-offload-groups", required_argument, 0, 'G'},
        {"router", required_argument, 0, 'R'},    {"node-id", required_argument, 0, 'I'},
        {"secret-file", required_argument, 0, 'K'},
        {"curve-server-key", required_argument, 0, O_CURVE_SERVER},
        {"curve-key", required_argument, 0, O_CURVE_KEY},
        {"exit-with-parent", no_argument, 0, O_EXIT_WITH_PARENT},
        {"kv-interface", required_argument, 0, O_KV_IFACE},
        {"health-file", required_argument, 0, O_HEALTH},
        {"drain-grace", required_argument, 0, O_DRAIN},
        {"kv-pool", required_argument, 0, O_POOL},
        {"kv-window", required_argument, 0, O_WINDOW},
        {"fault-corrupt-pool", no_argument, 0, O_FAULT_POOL},
        {"kv-pool-file", required_argument, 0, O_POOL_FILE},
        {"kv-pool-file-tokens", required_argument, 0, O_POOL_FILE_TOKENS}, {0, 0, 0, 0}};
    const char *kv_iface = NULL;
    pdm_link_params_t lp;
    pdm_link_params_default(&lp);
    lp.role = PDMESH__ROLE__ROLE_DECODE;
    lp.features = PDM_FEAT_DECODE;
    pdm_decode_params_t *dp = &dn.dp;
    int c;
    long v;
    double d;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case 'F': if (pdm_parse_long(optarg, 1, 1L << 50, &v)) goto bad; dn.offload.fast_budget = v; break;
        case 'S': dn.offload.slow_tier = optarg; break;
        case 'G': if (pdm_kvoff_parse_groups(optarg, &dn.offload)) goto bad; break;
        case 'm': model_path = optarg; break;
        case 't': if (pdm_parse_long(optarg, 1, 256, &v)) goto bad; dp->threads = (int)v; break;
        case 'b': if (pdm_parse_long(optarg, 1, 1024, &v)) goto bad; dp->max_batch = (int)v; break;
        case 's': if (pdm_parse_long(optarg, 1, 4096, &v)) goto bad; dp->max_sequences = (int)v; break;
        case 'k': if (pdm_parse_long(optarg, 1, 1L << 30, &v)) goto bad; dp->kv_budget = v; break;
        case 'd':
            if (pdm_kv_dtype_parse(optarg, &dp->kv_dtype)) goto bad;
            break;
        case 'o': if (pdm_parse_double(optarg, 0.01, 86400, &d)) goto bad; dp->kv_timeout = d; break;
        case 'B': if (pdm_parse_long(optarg, 0, PDM_BEAM_MAX_WIDTH, &v)) goto bad; dp->beam.width = (int)v; break;
        case 'L': if (pdm_parse_double(optarg, -100, 100, &d)) goto bad; dp->beam.length_penalty = (float)d; break;
        case 'N': if (pdm_parse_long(optarg, 1, PDM_BEAM_MAX_WIDTH, &v)) goto bad; dp->beam.n_best = (int)v; break;
        case 'E': if (pdm_beam_stop_parse(optarg, &dp->beam.early_stopping)) goto bad; break;
        case 'R':
            if (pdm_link_params_add_router(&lp, optarg)) {
                fprintf(stderr, "%s\n", pdm_error_last());
                return 2;
            }
            break;
        case O_CURVE_SERVER: lp.curve_server_key_file = optarg; break;
        case O_CURVE_KEY: lp.curve_key_file = optarg; break;
        case O_EXIT_WITH_PARENT: lp.exit_with_parent = 1; break;
        case O_KV_IFACE: kv_iface = optarg; break;
        case O_HEALTH: lp.health_file = optarg; break;
        case O_POOL: if (pdm_parse_long(optarg, 0, 1L << 30, &v)) goto bad; dp->pool_tokens = v; break;
        case O_FAULT_POOL: dp->fault_corrupt_pool = 1; break;
        case O_POOL_FILE: dp->pool_file_tier = optarg; break;
        case O_POOL_FILE_TOKENS:
            if (pdm_parse_long(optarg, 0, 1L << 40, &v)) goto bad;
            dp->pool_file_tokens = v;
            break;
        case O_WINDOW:
            if (pdm_parse_double(optarg, 0, 8, &d) || (d != 0 && d < 1.5)) goto bad;
            dp->kv_window = d;
            break;
        case O_DRAIN:
            if (pdm_parse_double(optarg, 0, 3600, &d)) goto bad;
            lp.drain_grace = d;
            break;
        case 'I': lp.node_id = optarg; break;
        case 'K': lp.secret_file = optarg; break;
        case 'h': pdm__usage(stdout); return 0;
        default: pdm__usage(stderr); return 2;
        }
    }
    if (dp->beam.width && dp->beam.n_best > dp->beam.width) goto bad;
    dn.beam = dp->beam;
    if (optind != argc) {
    bad:
        fprintf(stderr, "pdmesh-decode: invalid option value\n");
        pdm__usage(stderr);
        return 2;
    }
    if (!lp.endpoint_list[0]) {
        fprintf(stderr, "pdmesh-decode: needs --router ENDPOINT and --node-id NAME\n");
        pdm__usage(stderr);
        return 2;
    }
    if (dn.offload.fast_budget > 0) dp->offload = &dn.offload; /* head-wise KV offload */
    else if (strcmp(dn.offload.slow_tier, "ram")) {
        fprintf(stderr, "pdmesh-decode: --kv-slow-tier needs --kv-fast-budget\n");
        return 2;
    }
    lp.model_id = model_path;
    lp.capacity.kv_tokens = (uint64_t)dp->kv_budget;
    lp.capacity.max_sequences = (uint32_t)dp->max_sequences;
    lp.capacity.max_batch = (uint32_t)dp->max_batch;
    lp.capacity.threads = (uint32_t)dp->threads;
    /* the widest beam search this node runs (node.c: at most the batch) */
    lp.capacity.max_beams = (uint32_t)PDM_MIN(PDM_BEAM_MAX_WIDTH, dp->max_batch);
    lp.capacity.pool_tokens = (uint64_t)dp->pool_tokens;
    /* The model first (a loader, no threads): the router counts a sequence's KV slots as
     * this node does, which needs the windowed layers' layout (decode.h). Streamed sampling
     * sequences are windowed unless offload is on; a q8 node is announced without windows
     * because its local prefills keep full KV (the router then over-reserves, never under). */
    pdm_model_t *model = NULL;
    if (pdm_model_load(model_path, &model)) {
        fprintf(stderr, "pdmesh-decode: %s\n", pdm_error_last());
        return 1;
    }
    pdm_kvwin_plan_t wp;
    if (!dp->offload && dp->kv_dtype != PDM_DT_I8 &&
        !pdm_kvwin_plan(model, dp->kv_dtype, dp->kv_window, 1, INT32_MAX - 1, &wp) &&
        wp.layout.win_rows) {
        lp.capacity.kv_layers = model->hp.n_layers;
        lp.capacity.kv_windowed_layers = wp.layout.n_windowed;
        lp.capacity.kv_window_rows = (uint32_t)wp.layout.win_rows;
    }
    /* First, before any library starts a thread: signals are blocked from here on. */
    if (pdm_link_create(&lp, &dn.link)) {
        fprintf(stderr, "pdmesh-decode: %s\n", pdm_error_last());
        pdm_model_free(model);
        return 1;
    }
    int status = 1;
    if (pdm_kvt_listen_on(kv_iface) ||
        pdm_kvt_create(NULL, &dn.kvt) ||
        pdm_decode_node_create(model, dn.kvt, dp, &dn.node)) {
        fprintf(stderr, "pdmesh-decode: %s\n", pdm_error_last());
        goto out;
    }
    dn.model = model;
    dn.node_id = lp.node_id;
    if (dp->pool_tokens > 0 &&
        (!(dn.kvev = malloc(sizeof(*dn.kvev) * PDM_KVEV_MAX_KEYS)) ||
         !(dn.kvev_runs = malloc(sizeof(*dn.kvev_runs) * PDM_KVEV_MAX_KEYS)) ||
         !(dn.kvev_runp = malloc(sizeof(*dn.kvev_runp) * PDM_KVEV_MAX_KEYS)) ||
         !(dn.kvev_keys = malloc(sizeof(*dn.kvev_keys) * PDM_KVEV_MAX_KEYS)))) {
        fprintf(stderr, "pdmesh-decode: out of memory\n");
        goto out;
    }
    const void *addr;
    size_t alen;
    pdm_kvt_address(dn.kvt, &addr, &alen);
    if (pdm_link_start(dn.link, addr, alen)) {
        fprintf(stderr, "pdmesh-decode: %s\n", pdm_error_last());
        goto out;
    }
    for (;;) {
        int held = pdm_decode_node_run_once(dn.node, pdm__on_event, &dn);
        pdm__report_load(&dn);
        pdm__report_kv_events(&dn);
        int timeout_ms = pdm_decode_node_running(dn.node) ? 0 : (held ? 2 : 50);
        pdm_wire_msg_t *m;
        if (pdm_link_recv(dn.link, timeout_ms, &m)) break; /* SIGTERM or refused registration */
        if (!m && !held && pdm_link_draining(dn.link)) break; /* drained: nothing left */
        pdm__drop_orphans(&dn); /* before any task of the next router */
        for (int k = 0; m && k < 256; k++) {     /* every message waiting, then a step */
            pdm__on_message(&dn, m);
            pdm_wire_msg_free(m);
            if (pdm_link_recv(dn.link, 0, &m)) break;
        }
    }
    status = pdm_link_exit_status(dn.link);
out:
    free(dn.kvev);
    free(dn.kvev_runs);
    free(dn.kvev_runp);
    free(dn.kvev_keys);
    pdm_decode_node_destroy(dn.node);
    pdm_link_destroy(dn.link);
    pdm_kvt_destroy(dn.kvt);
    pdm_model_free(model);
    return status;
}
