/*
 * pdmesh-prefill - one rank of a prefill group.
 *
 * The rank connects to a node socket (--router: the router's, or a local harness's such as
 * pdmesh prefill-run / disagg-run, prefill_node/launch.c) and takes its work as the messages
 * of proto/pdmesh.proto through its link (common/nodelink.h):
 *
 *   GroupWire      -> connect to the other ranks, barrier      -> GroupReady
 *                     (a later GroupWire re-forms the group: a rank was replaced)
 *   PrefillTask    -> run this rank's share, stream KV         -> PrefillResult
 *                     (solo: only rank solo_rank runs it, alone, and answers; the others
 *                     skip it without a word)
 *   GroupPingPong  -> timed round trips between ranks 0 and 1  -> GroupPingPongResult
 *   StatsRequest   ->                                          -> NodeStats
 *   CancelTask     -> a task still queued here is dropped (a running one ends by its deadline)
 *
 * One order for the whole group (several routers, docs/router.md "High availability"): every
 * rank of a group must run the group's tasks in one order, or their collectives pair
 * different tasks and stall. A router sends a group task to every rank; rank 0 queues the
 * tasks of every router, takes them first come, first served and, before running one, sends
 * it to every other rank as the next entry of the group's order (UCX: an entry naming the
 * task's key and router, tag PDM_KVT_KIND_ORDER and a sequence number, then the task's
 * frame, PDM_KVT_KIND_ORDER_TASK). The other ranks run exactly that sequence, each task as
 * rank 0 forwarded it, and answer the router the entry names (RegisterAck.router_id: each
 * rank may list the routers in its own order). A router that dies after handing rank 0 a
 * task therefore cannot leave the others without it (before, rank 0's collectives waited a
 * group timeout for a copy that never came). A follower keeps the copies routers send it
 * only as a record of the group's work still to come: one is dropped when its forwarded
 * twin runs (or on arrival if that ran first), with the same router's copies queued before
 * it (rank 0 passed them over: cancelled, dropped), or as any queued task is (CancelTask,
 * its router's lease). A draining follower leaves only once it holds none, as rank 0 does
 * (a follower that left early stalled rank 0's next task). Rank 0 refuses, before ordering
 * it, a group task planned for another formation of the group (PrefillTask.formation: an
 * elastic group re-wired by another router since), with ERR_STALE_FORMATION and its own
 * formation. Solo tasks need no order and come from the router to their rank. A router whose
 * lease expired (common/nodelink.h) has its queued tasks dropped, like a CancelTask: one
 * mechanism frees what a dead router left.
 *
 * Mixed versions (docs/deployment.md "Versions"): the group is ordered as above only when
 * the router's GroupWire says so (GroupWire.ordered: every rank registered with
 * PDM_FEAT_ORDERED_GROUP). Otherwise (a rank of an older version, which neither forwards nor
 * follows forwarded tasks) the group runs as before forwarding existed: every rank runs the
 * copies the routers send it, first come, first served, answers the router each came from,
 * and rank 0 forwards nothing. One flag (follow_rank0) selects which; the queue is the same.
 * In that mode a group task is the group's work on every rank: a CancelTask does not drop it
 * from one rank alone (the others would wait in its collectives), it runs and its stream is
 * refused by the decode node that gave it up.
 *
 * A task is checked before anything runs; what the rank cannot do is answered in its result
 * (ok = false, an Error with a code and a message). Diagnostics go to stderr. SIGTERM ends
 * the process cleanly (Deregister first).
 */
#include <getopt.h>
#include <limits.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <xxhash.h>

#include "common/nodelink.h"
#include "common/pdm.h"
#include "prefill_node/prefill.h"

#define PDM__MAX_QUEUED 256

/* An entry of the group's order as rank 0 sends it; the task's frame follows as a message of
 * its own (frame_bytes, kind PDM_KVT_KIND_ORDER_TASK, the same sequence number). */
typedef struct {
    uint64_t key;         /* PDM_LINK_TASK_KEY of the task */
    uint64_t router_id;   /* the router it came from (RegisterAck.router_id) */
    uint32_t frame_bytes; /* its frame (common/wire.h), as rank 0 forwards it */
    uint32_t reserved;
} pdm__order_entry_t;

/* A PrefillTask waiting for its turn. */
typedef struct {
    pdm_wire_msg_t *m;  /* owned */
    int origin;         /* the router it came from (pdm_link_origin) */
    uint64_t key;       /* PDM_LINK_TASK_KEY */
    double arrived;
} pdm__queued_t;

typedef struct {
    const pdm_model_t *model;
    pdm_kvt_t *kvt;
    pdm_link_t *link;
    pdm_prefill_rank_params_t rp;
    pdm_kvt_group_t group;
    pdm_prefill_rank_t *rank;
    int grouped;
    const char *dump_dir;       /* --dump-dir: where PrefillTask.kv_dump files go (NULL: off) */
    pdm_vocab_trie_t *trie;     /* the vocabulary's byte trie, built at the first task with a
                                 * json_schema (its first token is masked here) */
    uint64_t wire_hash;         /* of the GroupWire the group was formed from */
    int follow_rank0;           /* GroupWire.ordered: rank 0 forwards each group task and the
                                 * others run only what it forwards; 0: every rank runs its
                                 * own copies in arrival order (a rank of an older version) */
    uint64_t formation;         /* its pdm_prefill_formation (PrefillTask.formation) */
    /* the routers (RegisterAck.router_id, random per router process) that wired this
     * formation: what decides, alike on every rank, whether a GroupWire re-forms the group */
    uint64_t wired_ids[PDM_LINK_MAX_ROUTERS];
    int n_wired;
    pdm__queued_t queue[PDM__MAX_QUEUED]; /* FIFO, [0, n_queued) */
    double task_arrived;        /* when the running task was queued (pdm_now() clock) */
    int n_queued;
    unsigned orphans_seen, orphans_of[PDM_LINK_MAX_ROUTERS];
    /* the group's order (rank 0 sends, the others follow) */
    uint32_t order_seq;         /* number of the next entry */
    pdm_kvt_req_t order_req;    /* rank > 0: the posted receive of entry order_seq */
    pdm__order_entry_t order_entry; /* its payload */
    pdm__order_entry_t order_out;   /* rank 0: the entry being sent (not on the stack: a
                                     * send UCX gave up on may read it later) */
    uint64_t ran[64];               /* follower: keys of the last forwarded tasks it ran, so
                                     * that a router's copy coming after is dropped */
    int ran_next;
    double order_retry_at;
} pdm__daemon_t;

/* The Error code of a failed task, from its status. */
static int pdm__error_code(int st)
{
    switch (st) {
    case PDM_EINVAL:
    case PDM_EFORMAT:
    case PDM_ERANGE:
    case PDM_EUNSUPPORTED:
    case PDM_ESTATE: return PDMESH__ERROR_CODE__ERR_INVALID_ARGUMENT;
    case PDM_EOVERFLOW: return PDMESH__ERROR_CODE__ERR_NODE_FULL;
    case PDM_ETIMEOUT: return PDMESH__ERROR_CODE__ERR_DEADLINE_EXCEEDED;
    case PDM_EPEER: return PDMESH__ERROR_CODE__ERR_KV_TRANSFER;
    case PDM_ECHECKSUM: return PDMESH__ERROR_CODE__ERR_KV_CORRUPT; /* its group pool (pool.c) */
    default: return PDMESH__ERROR_CODE__ERR_INTERNAL;
    }
}

static void pdm__leave_group(pdm__daemon_t *pn)
{
    if (pn->order_req != PDM_KVT_REQ_NONE) pdm_kvt_cancel(pn->kvt, &pn->order_req, 1);
    pn->order_seq = 0;
    memset(pn->ran, 0, sizeof(pn->ran)); /* keys of the old formation's forwarded tasks */
    pn->ran_next = 0;
    pn->follow_rank0 = 0;
    /* order entries of the formation that ends, never taken, are thrown away (rank 0 sends
     * the next formation's only after this rank's join message) */
    const uint64_t kind_mask = 0xffull << 56;
    pdm_kvt_drain(pn->kvt, (uint64_t)PDM_KVT_KIND_ORDER << 56, kind_mask, NULL, NULL);
    pdm_kvt_drain(pn->kvt, (uint64_t)PDM_KVT_KIND_ORDER_TASK << 56, kind_mask, NULL, NULL);
    if (!pn->grouped) return;
    pdm_log_info("prefill rank: leaving the group to re-form it");
    pdm_prefill_rank_destroy(pn->rank);
    pn->rank = NULL;
    pdm_kvt_group_fini(&pn->group);
    pn->grouped = 0;
}

static void pdm__drop_stale(pdm__daemon_t *pn);

static void pdm__on_group_wire(pdm__daemon_t *pn, const Pdmesh__GroupWire *w)
{
    pdm__drop_stale(pn); /* tasks of routers that are gone leave the queue first */
    Pdmesh__GroupReady ready = PDMESH__GROUP_READY__INIT;
    Pdmesh__Error e = PDMESH__ERROR__INIT;
    char transports[128] = "";
    int st = PDM_OK;
    /* Every router of the mesh wires the group: a router's first wire equal to the one the
     * group was formed from (same rank, size and addresses) is answered at once, without
     * re-forming the group under the other routers' tasks. A router that wires it again
     * means it (a rank came back): the group re-forms. Every rank sees each router's wires
     * in that router's order, so all ranks decide alike. Routers are told apart by their
     * process's router_id, never by what this rank alone saw of them: a restarted router (a
     * new id) has not wired this formation; a router whose lease ran out here but that lives
     * on wires it again to re-form it, and every rank re-forms. (Clearing a router whenever
     * this rank lost its lease let one rank skip a re-forming wire that the other took: the
     * follower then waited for order entry 0 while rank 0 sent entry 10, for good.) */
    XXH64_state_t *hs = XXH64_createState();
    uint64_t hash = 0;
    if (hs) {
        XXH64_reset(hs, 0);
        XXH64_update(hs, &w->rank, sizeof(w->rank));
        XXH64_update(hs, &w->size, sizeof(w->size));
        /* a wire that runs the group the other way (ordered or not) is another formation */
        const uint8_t ordered = w->ordered != 0;
        XXH64_update(hs, &ordered, sizeof(ordered));
        for (size_t i = 0; i < w->n_ucx_addresses; i++) {
            XXH64_update(hs, &w->ucx_addresses[i].len, sizeof(w->ucx_addresses[i].len));
            XXH64_update(hs, w->ucx_addresses[i].data, w->ucx_addresses[i].len);
        }
        hash = XXH64_digest(hs);
        XXH64_freeState(hs);
    }
    const uint64_t rid = pdm_link_router_id(pn->link, pdm_link_origin(pn->link));
    int known = 0;
    for (int i = 0; i < pn->n_wired && !known; i++) known = pn->wired_ids[i] == rid;
    if (pn->grouped && hash && hash == pn->wire_hash && !known) {
        if (pn->n_wired == PDM_LINK_MAX_ROUTERS) { /* the oldest (a router long restarted) */
            memmove(pn->wired_ids, pn->wired_ids + 1,
                    sizeof(pn->wired_ids[0]) * (size_t)(PDM_LINK_MAX_ROUTERS - 1));
            pn->n_wired--;
        }
        pn->wired_ids[pn->n_wired++] = rid;
        ready.epoch = pdm_link_epoch(pn->link);
        ready.group = (char *)(w->group ? w->group : "");
        ready.rank = w->rank;
        ready.ok = 1;
        pdm_kvt_peer_transports(pn->kvt, pn->group.peer[(pn->group.rank + 1) % pn->group.size],
                                transports, sizeof(transports));
        ready.transports = transports;
        pdm_link_send(pn->link, PDMESH__MSG_TYPE__MSG_GROUP_READY, &ready.base);
        return;
    }
    pdm__leave_group(pn);
    if (w->size < 1 || w->size > PDM_KVT_MAX_RANKS || w->rank >= w->size ||
        w->n_ucx_addresses != w->size) {
        st = pdm_error_set(PDM_EFORMAT, "GroupWire: rank %u, size %u and %zu addresses do not "
                           "make a group", w->rank, w->size, w->n_ucx_addresses);
    } else {
        const void *addrs[PDM_KVT_MAX_RANKS];
        size_t lens[PDM_KVT_MAX_RANKS];
        for (uint32_t i = 0; i < w->size; i++) {
            addrs[i] = w->ucx_addresses[i].data;
            lens[i] = w->ucx_addresses[i].len;
        }
        pn->formation = pdm_prefill_formation(addrs, lens, (int)w->size);
        st = pdm_kvt_group_init(&pn->group, pn->kvt, (int)w->rank, (int)w->size, addrs, lens,
                                pn->rp.timeout);
        if (!st && (st = pdm_prefill_rank_create(pn->model, &pn->group, &pn->rp, &pn->rank)))
            pdm_kvt_group_fini(&pn->group);
    }
    ready.epoch = pdm_link_epoch(pn->link);
    ready.group = (char *)(w->group ? w->group : "");
    ready.rank = w->rank;
    if (st) {
        e.code = pdm__error_code(st);
        e.message = (char *)pdm_error_last();
        ready.error = &e;
        pdm_log_warn("prefill rank: the group did not form: %s", e.message);
    } else {
        pn->grouped = 1;
        pn->wire_hash = hash;
        pn->follow_rank0 = w->ordered;
        if (!w->ordered && w->size > 1)
            pdm_log_info("prefill rank: group %s runs unordered (a rank of an older version): "
                         "each rank runs its routers' copies in arrival order",
                         w->group ? w->group : "");
        pn->wired_ids[0] = rid;
        pn->n_wired = 1;
        ready.ok = 1;
        pdm_kvt_peer_transports(pn->kvt, pn->group.peer[(pn->group.rank + 1) % pn->group.size],
                                transports, sizeof(transports));
        ready.transports = transports;
    }
    pdm_link_send(pn->link, PDMESH__MSG_TYPE__MSG_GROUP_READY, &ready.base);
    /* A group that did not form (a peer was still busy or gone): registering again gives this
     * rank a new epoch, so the router breaks the group and wires it anew once every rank is
     * alive. */
    if (st) pdm_link_reregister(pn->link);
}

/* The K largest logits, best first (ties: lower id first); K = 0 when out of memory. */
static uint32_t pdm__top_logits(const float *logits, uint32_t n_vocab, uint32_t k, int32_t *ids,
                              float *values)
{
    char *taken = calloc(n_vocab, 1);
    if (!taken) return 0;
    for (uint32_t i = 0; i < k; i++) {
        int32_t best = -1;
        for (uint32_t v = 0; v < n_vocab; v++)
            if (!taken[v] && (best < 0 || logits[v] > logits[best])) best = (int32_t)v;
        taken[best] = 1;
        ids[i] = best;
        values[i] = logits[best];
    }
    free(taken);
    return k;
}

/* Checks a task message and fills `task` (pointing into the message). */
static int pdm__task_from_msg(pdm__daemon_t *pn, const Pdmesh__PrefillTask *t, pdm_prefill_task_t *task,
                            pdm_prefill_stream_t *stream)
{
    if (!pn->grouped) return pdm_error_set(PDM_ESTATE, "PrefillTask before GroupWire");
    int st = pdm_prefill_method_parse(t->method ? t->method : "", &task->method);
    if (st) return st;
    if (t->n_tokens > INT32_MAX / 2 || t->start > INT32_MAX / 2)
        return pdm_error_set(PDM_ERANGE, "PrefillTask: too many tokens");
    for (size_t i = 0; i < t->n_tokens; i++)
        if (t->tokens[i] < 0) return pdm_error_set(PDM_EFORMAT, "PrefillTask: negative token id");
    if (t->n_chunks && t->n_chunks != (size_t)pn->group.size)
        return pdm_error_set(PDM_EFORMAT, "PrefillTask: chunks must hold one size per rank "
                             "(%zu for %d ranks)", t->n_chunks, pn->group.size);
    for (size_t i = 0; i < t->n_chunks; i++)
        if (t->chunks[i] > (uint32_t)INT32_MAX)
            return pdm_error_set(PDM_ERANGE, "PrefillTask: chunk size out of range");
    /* (the last token's row is always streamed: the decode node needs its KV) */
    if (t->stream_from && (int64_t)t->stream_from >= (int64_t)t->start + (int64_t)t->n_tokens)
        return pdm_error_set(PDM_ERANGE, "PrefillTask: stream_from %u is not before the "
                             "prompt's last token (%u + %zu tokens)", t->stream_from, t->start,
                             t->n_tokens);
    if (t->n_prefix && t->n_prefix != t->start)
        return pdm_error_set(PDM_EFORMAT, "PrefillTask: prefix must hold the start cached "
                             "tokens (%zu for start %u)", t->n_prefix, t->start);
    if (t->kv_dump && t->kv_dump[0]) {
        if (!pn->dump_dir)
            return pdm_error_set(PDM_EUNSUPPORTED, "PrefillTask: KV dumps are off on this rank "
                                 "(start it with --dump-dir DIR)");
        if (strchr(t->kv_dump, '/') || !strcmp(t->kv_dump, ".") || !strcmp(t->kv_dump, "..") ||
            strlen(t->kv_dump) > 128)
            return pdm_error_set(PDM_EINVAL, "PrefillTask: kv_dump must be a plain file name");
    }
    if (t->solo && t->kv_dump && t->kv_dump[0])
        return pdm_error_set(PDM_EUNSUPPORTED, "PrefillTask: a solo task keeps no KV to dump");
    task->solo = t->solo;
    task->id = (uint32_t)PDM_LINK_TASK_KEY(t->task_id, t->attempt);
    task->start = (int32_t)t->start;
    task->prefix = t->n_prefix ? t->prefix : NULL;
    task->tokens = t->tokens;
    task->n_tokens = (int32_t)t->n_tokens;
    task->chunks = t->n_chunks ? (const int32_t *)t->chunks : NULL;
    task->stream = NULL;
    task->pool_source = t->pool_source;
    task->pool_tokens = t->pool_tokens > (uint64_t)INT32_MAX ? INT32_MAX : (int64_t)t->pool_tokens;
    task->pool_reset = t->pool_reset;
    if (t->prompt_top_logprobs > PDM_SAMPLER_MAX_TOP_LOGPROBS)
        return pdm_error_set(PDM_ERANGE, "PrefillTask: prompt_top_logprobs is over %d",
                             PDM_SAMPLER_MAX_TOP_LOGPROBS);
    task->prompt_logprobs = t->prompt_logprobs;
    task->prompt_top = (int)t->prompt_top_logprobs;
    if (t->kv_key.len && t->kv_key.len != PDM_KVT_KEY_BYTES)
        return pdm_error_set(PDM_EFORMAT, "PrefillTask: kv_key must be %d bytes",
                             PDM_KVT_KEY_BYTES);
    if (t->decode_address.len) {
        int peer;
        if ((st = pdm_kvt_connect_cached(pn->kvt, t->decode_address.data, t->decode_address.len,
                                         &peer)))
            return st;
        *stream = (pdm_prefill_stream_t){
            .peer = peer, .request_id = PDM_LINK_TASK_KEY(t->task_id, t->attempt),
            .attempt = t->attempt & 15u,
            .max_in_flight = t->stream_window ? (int)PDM_MIN(t->stream_window, 4096u) : 64,
            .key = t->kv_key.len ? t->kv_key.data : NULL, .from = (int32_t)t->stream_from};
        task->stream = stream;
    }
    return PDM_OK;
}

static void pdm__set_running(pdm__daemon_t *pn, uint32_t running)
{
    Pdmesh__Load load = PDMESH__LOAD__INIT;
    load.running = running;
    load.held = running;
    pdm_link_set_load(pn->link, &load);
}

/* The owner's first token: step 0 of the request's sampler (model.h "Sampling": logit_bias,
 * seed, temperature...; no history yet, so no penalty) over the last prompt token's logits,
 * and its log-probabilities, masked by the request's json_schema when it has one (the grammar's
 * start state). Without sampling parameters, the greedy token. */
static int pdm__sample_first(pdm__daemon_t *pn, const Pdmesh__SamplingParams *m,
                             const float *logits, int32_t *first, pdm_token_logprobs_t *lp)
{
    pdm_sampler_params_t sp;
    pdm_sampler_t *s = NULL;
    pdm_grammar_t *g = NULL;
    pdm_gmatch_t *gm = NULL;
    int st = pdm_sampler_params_from_msg(m, &sp);
    if (!st) st = pdm_sampler_create(&sp, (int32_t)pn->model->hp.n_vocab, &s);
    if (!st && sp.json_schema) {
        if (!pn->model->tokenizer)
            st = pdm_error_set(PDM_EUNSUPPORTED, "json_schema needs the model's tokenizer");
        else if (!pn->trie && !(pn->trie = pdm_vocab_trie_create(pn->model->tokenizer)))
            st = PDM_ENOMEM;
        if (!st) st = pdm_grammar_compile(sp.json_schema, strlen(sp.json_schema), &g);
        if (!st && !(gm = pdm_gmatch_create(g, pn->trie))) st = PDM_ENOMEM;
        if (!st) pdm_sampler_set_grammar(s, gm);
    }
    if (!st) *first = pdm_sampler_sample(s, logits, NULL, 0, lp);
    pdm_sampler_destroy(s);
    pdm_gmatch_destroy(gm);
    pdm_grammar_destroy(g);
    if (st) return pdm_error_set(st, "PrefillTask: sampling: %s", pdm_error_last());
    return PDM_OK;
}

/* What every PrefillResult of task t to router `origin` says, and its Error's task. */
static void pdm__result_head(const pdm__daemon_t *pn, const Pdmesh__PrefillTask *t, int origin,
                             Pdmesh__PrefillResult *r, Pdmesh__Error *e)
{
    r->task_id = e->task_id = t->task_id;
    r->attempt = e->attempt = t->attempt;
    r->epoch = pdm_link_epoch_of(pn->link, origin);
    r->rank = pn->grouped ? (uint32_t)pn->group.rank : 0;
    r->first_token = -1;
}

/* Sends task t's PrefillResult to router `origin`: st and err (its message) when it failed,
 * else from res (the owner samples the first token with t's sampling parameters). */
static void pdm__answer(pdm__daemon_t *pn, const Pdmesh__PrefillTask *t, int origin, int st,
                        const char *err, const pdm_prefill_result_t *rs, int kv_dumped,
                        uint32_t batch_size)
{
    Pdmesh__PrefillResult r = PDMESH__PREFILL_RESULT__INIT;
    Pdmesh__Error e = PDMESH__ERROR__INIT;
    pdm_prefill_result_t res = *rs;
    int32_t top_ids[100];
    float top_values[100];
    pdm__result_head(pn, t, origin, &r, &e);
    r.kv_dumped = kv_dumped;
    r.batch_size = batch_size;
    if (st) {
        e.code = pdm__error_code(st);
        e.message = (char *)err;
        r.error = &e;
        pdm_link_send_to(pn->link, origin, PDMESH__MSG_TYPE__MSG_PREFILL_RESULT, &r.base);
        return;
    }
    const uint32_t n_vocab = pn->model->hp.n_vocab;
    r.ok = 1;
    r.owner = res.owner;
    r.seconds = res.t_total;
    r.kv_bytes = res.bytes_streamed;
    r.n_local = (uint32_t)res.n_local;
    r.t_compute = res.t_compute;
    r.t_wait = res.t_wait;
    r.bytes_sent = res.bytes_sent;
    r.bytes_received = res.bytes_received;
    Pdmesh__SampledLogprob flp = PDMESH__SAMPLED_LOGPROB__INIT;
    pdm_token_logprobs_t lp;
    if (res.owner && pdm__sample_first(pn, t->sampling, res.logits, &r.first_token, &lp)) {
        e.code = PDMESH__ERROR_CODE__ERR_INVALID_ARGUMENT;
        e.message = (char *)pdm_error_last();
        r.ok = 0;
        r.error = &e;
    } else if (res.owner && t->sampling && t->sampling->logprobs) {
        flp.logprob = lp.logprob;
        flp.top_ids = lp.top_ids;
        flp.n_top_ids = (size_t)lp.n_top;
        flp.top_logprobs = lp.top_logprobs;
        flp.n_top_logprobs = (size_t)lp.n_top;
        r.first_logprob = &flp;
    }
    /* The prompt tokens this rank's rows predict: views into the rank's entries. */
    Pdmesh__SampledLogprob *plp = NULL, **plpp = NULL;
    uint32_t *plp_pos = NULL;
    if (r.ok && res.n_prompt_lp > 0) {
        const size_t n = (size_t)res.n_prompt_lp;
        plp = malloc(sizeof(*plp) * n);
        plpp = malloc(sizeof(*plpp) * n);
        plp_pos = malloc(sizeof(*plp_pos) * n);
        if (!plp || !plpp || !plp_pos) {
            e.code = PDMESH__ERROR_CODE__ERR_INTERNAL;
            e.message = "out of memory for the prompt log-probabilities";
            r.ok = 0;
            r.error = &e;
        } else {
            for (size_t i = 0; i < n; i++) {
                const pdm_token_logprobs_t *x = &res.prompt_lp[i];
                pdmesh__sampled_logprob__init(&plp[i]);
                plp[i].logprob = x->logprob;
                plp[i].top_ids = (int32_t *)x->top_ids;
                plp[i].n_top_ids = (size_t)x->n_top;
                plp[i].top_logprobs = (float *)x->top_logprobs;
                plp[i].n_top_logprobs = (size_t)x->n_top;
                plpp[i] = &plp[i];
                plp_pos[i] = (uint32_t)res.prompt_lp_pos[i];
            }
            r.prompt_logprobs = plpp;
            r.n_prompt_logprobs = n;
            r.prompt_positions = plp_pos;
            r.n_prompt_positions = n;
        }
    }
    if (res.owner) {
        uint32_t k = PDM_MIN(PDM_MIN(t->top_logits, 100u), n_vocab);
        k = pdm__top_logits(res.logits, n_vocab, k, top_ids, top_values);
        r.top_ids = top_ids;
        r.n_top_ids = k;
        r.top_logits = top_values;
        r.n_top_logits = k;
        if (t->want_logits) {
            r.logits = res.logits;
            r.n_logits = n_vocab;
        }
    }
    pdm_link_send_to(pn->link, origin, PDMESH__MSG_TYPE__MSG_PREFILL_RESULT, &r.base);
    free(plp);
    free(plpp);
    free(plp_pos);
}

/* A batch task (PrefillTask.batch): every member checked and converted on its own (a bad one
 * is answered with its error), the rest run as one batch (batch.c), each answered. */
static void pdm__on_batch(pdm__daemon_t *pn, const Pdmesh__PrefillTask *t, int origin)
{
    pdm_prefill_batch_member_t in[PDM_PREFILL_BATCH_MAX];
    pdm_prefill_batch_out_t out[PDM_PREFILL_BATCH_MAX];
    pdm_prefill_stream_t stream[PDM_PREFILL_BATCH_MAX];
    const Pdmesh__PrefillTask *msg[PDM_PREFILL_BATCH_MAX];
    const pdm_prefill_result_t none = {0};
    int n = 0;
    for (size_t i = 0; i < t->n_batch; i++) {
        const Pdmesh__PrefillTask *m = t->batch[i];
        int st = PDM_OK;
        if (i >= PDM_PREFILL_BATCH_MAX)
            st = pdm_error_set(PDM_EINVAL, "PrefillTask: a batch of %zu tasks (at most %d)",
                               t->n_batch, PDM_PREFILL_BATCH_MAX);
        else if (m->n_batch || !m->solo || m->solo_rank != t->solo_rank)
            st = pdm_error_set(PDM_EFORMAT, "PrefillTask: a batch member is a solo task of the "
                               "batch's rank and holds no batch itself");
        else if (m->stream_from) /* (batch.c streams each member's whole prompt) */
            st = pdm_error_set(PDM_EUNSUPPORTED, "PrefillTask: a batch member streams its whole "
                               "prompt (stream_from %u)", m->stream_from);
        else if (m->kv_dump && m->kv_dump[0])
            st = pdm_error_set(PDM_EUNSUPPORTED, "PrefillTask: a solo task keeps no KV to dump");
        if (!st) st = pdm__task_from_msg(pn, m, &in[n].task, &stream[n]);
        if (st) {
            pdm__answer(pn, m, origin, st, pdm_error_last(), &none, 0, 0);
            continue;
        }
        if (in[n].task.stream) in[n].task.stream = &stream[n];
        /* the deadline counts from when the task reached this rank */
        in[n].deadline = m->deadline_ms ? pn->task_arrived + m->deadline_ms / 1e3 : 0;
        msg[n++] = m;
    }
    if (!n) return;
    pdm__set_running(pn, (uint32_t)n);
    int st = pdm_prefill_rank_run_batch(pn->rank, in, n, out);
    pdm__set_running(pn, 0);
    if (st) {
        for (int i = 0; i < n; i++) pdm__answer(pn, msg[i], origin, st, pdm_error_last(), &none, 0, 0);
        return;
    }
    uint32_t ran = 0; /* members that went through the engine together */
    for (int i = 0; i < n; i++) ran += !out[i].status;
    for (int i = 0; i < n; i++)
        pdm__answer(pn, msg[i], origin, out[i].status, out[i].message, &out[i].res, 0, ran);
    pdm_log_info("prefill rank: batch of %d task(s) (%u ran, first %llu) in %.3f s (compute "
                 "%.3f s, waiting for streams %.3f s)", n, ran, (unsigned long long)t->task_id,
                 out[0].res.t_total, out[0].res.t_compute, out[0].res.t_wait);
}

static void pdm__on_task(pdm__daemon_t *pn, const Pdmesh__PrefillTask *t, int origin)
{
    pdm_prefill_task_t task;
    pdm_prefill_stream_t stream;
    pdm_prefill_result_t res = {0};
    int kv_dumped = 0;
    if (t->solo && pn->grouped && t->solo_rank != (uint32_t)pn->group.rank) {
        /* Another rank's solo task: not ours to run or answer, and nothing here changes. */
        pdm_log_debug("prefill rank: task %llu is rank %u's solo task: skipped",
                      (unsigned long long)t->task_id, t->solo_rank);
        return;
    }
    if (t->n_batch) {
        pdm__on_batch(pn, t, origin);
        return;
    }
    pdm__set_running(pn, 1);
    int st = pdm__task_from_msg(pn, t, &task, &stream);
    if (!st) st = pdm_prefill_rank_run(pn->rank, &task, &res);
    if (!st && t->kv_dump && t->kv_dump[0]) {
        char path[PATH_MAX];
        snprintf(path, sizeof(path), "%s/%s", pn->dump_dir, t->kv_dump);
        if (!(st = pdm_prefill_rank_dump_kv(pn->rank, path))) kv_dumped = 1;
    }
    pdm__set_running(pn, 0);
    pdm__answer(pn, t, origin, st, pdm_error_last(), &res, kv_dumped, 0);
}

/* Ranks 0 and 1 bounce a message of `bytes` back and forth `iters` times (after one warm-up
 * round); rank 0 reports the mean round-trip time. Other ranks only answer. */
static int pdm__pingpong(pdm_kvt_group_t *g, size_t bytes, int iters, double *seconds)
{
    char *buf = malloc(bytes);
    if (!buf) return pdm_error_set(PDM_ENOMEM, "pingpong: out of memory");
    memset(buf, 1, bytes);
    int st = PDM_OK;
    *seconds = 0;
    if (g->rank <= 1) {
        const int other = 1 - g->rank;
        pdm_kvt_iov_t iov = {buf, bytes};
        double t0 = 0;
        for (int i = 0; i <= iters && !st; i++) {
            if (i == 1) t0 = pdm_now();
            pdm_kvt_req_t r;
            double deadline = pdm_kvt_group_deadline(g);
            const int first_send = g->rank == 0;
            for (int half = 0; half < 2 && !st; half++) {
                if (half == !first_send)
                    st = pdm_kvt_group_send(g, other, PDM_KVT_KIND_PING, g->rank, i, &iov, 1, &r);
                else
                    st = pdm_kvt_group_recv(g, other, PDM_KVT_KIND_PING, other, i, &iov, 1, &r);
                if (!st) st = pdm_kvt_wait(g->kvt, r, deadline, NULL);
            }
        }
        *seconds = (pdm_now() - t0) / iters;
    }
    free(buf);
    return st;
}

static void pdm__on_pingpong(pdm__daemon_t *pn, const Pdmesh__GroupPingPong *p)
{
    Pdmesh__GroupPingPongResult r = PDMESH__GROUP_PING_PONG_RESULT__INIT;
    Pdmesh__Error e = PDMESH__ERROR__INIT;
    int st;
    r.epoch = pdm_link_epoch(pn->link);
    r.rank = pn->grouped ? (uint32_t)pn->group.rank : 0;
    if (!pn->grouped)
        st = pdm_error_set(PDM_ESTATE, "GroupPingPong before GroupWire");
    else if (p->bytes < 1 || p->bytes > (1u << 30) || p->iters < 1 || p->iters > 60000 ||
             pn->group.size < 2)
        st = pdm_error_set(PDM_EINVAL, "GroupPingPong needs bytes in [1, 1 GiB], iters in "
                           "[1, 60000] and two ranks");
    else
        st = pdm__pingpong(&pn->group, (size_t)p->bytes, (int)p->iters, &r.seconds);
    if (st) {
        e.code = pdm__error_code(st);
        e.message = (char *)pdm_error_last();
        r.error = &e;
    }
    r.ok = !st;
    pdm_link_send(pn->link, PDMESH__MSG_TYPE__MSG_GROUP_PINGPONG_RESULT, &r.base);
}

static void pdm__on_stats(pdm__daemon_t *pn)
{
    Pdmesh__NodeStats s = PDMESH__NODE_STATS__INIT;
    Pdmesh__Load load = PDMESH__LOAD__INIT;
    s.epoch = pdm_link_epoch(pn->link);
    s.load = &load;
    pdm_link_send(pn->link, PDMESH__MSG_TYPE__MSG_NODE_STATS, &s.base);
}

/* ---- the task queue and the group's order ---- */

/* Removes queue entry i (its message is freed unless `keep`). */
static pdm_wire_msg_t *pdm__dequeue(pdm__daemon_t *pn, int i, int keep)
{
    pdm_wire_msg_t *m = pn->queue[i].m;
    memmove(&pn->queue[i], &pn->queue[i + 1], sizeof(pn->queue[0]) * (size_t)(pn->n_queued - i - 1));
    pn->n_queued--;
    if (!keep) {
        pdm_wire_msg_free(m);
        m = NULL;
    }
    return m;
}

static int pdm__queue_find(const pdm__daemon_t *pn, uint64_t key)
{
    for (int i = 0; i < pn->n_queued; i++)
        if (pn->queue[i].key == key) return i;
    return -1;
}

/* Takes ownership of a PrefillTask message from router `origin`. */
static void pdm__enqueue(pdm__daemon_t *pn, pdm_wire_msg_t *m, int origin)
{
    const Pdmesh__PrefillTask *t = (const Pdmesh__PrefillTask *)pdm_wire_message(m);
    if (pn->n_queued == PDM__MAX_QUEUED) {
        pdm_link_send_error(pn->link, PDMESH__ERROR_CODE__ERR_OVERLOADED, t->task_id, t->attempt,
                            "prefill rank: %d tasks queued already", PDM__MAX_QUEUED);
        pdm_wire_msg_free(m);
        return;
    }
    const uint64_t key = PDM_LINK_TASK_KEY(t->task_id, t->attempt);
    for (int k = 0; k < (int)PDM_ARRAY_SIZE(pn->ran); k++)
        if (pn->ran[k] == key && key) { /* its forwarded twin ran already */
            pdm_wire_msg_free(m);
            return;
        }
    pn->queue[pn->n_queued++] = (pdm__queued_t){
        .m = m, .origin = origin, .key = key, .arrived = pdm_now()};
}

static int pdm__ordered(const pdm__daemon_t *pn, const pdm__queued_t *q);

/* CancelTask: a queued task is dropped (no answer: the router gave it up). On rank 0 that is
 * before it was ordered: the others never hear of it. */
static void pdm__on_cancel(pdm__daemon_t *pn, const Pdmesh__CancelTask *c)
{
    int i = pdm__queue_find(pn, PDM_LINK_TASK_KEY(c->task_id, c->attempt));
    if (i < 0) return; /* ran already or never came */
    /* A batch is keyed by its first member: the others still want it (the cancelled member's
     * decode node dropped its reservation, so its stream fails alone when the batch runs). */
    if (((const Pdmesh__PrefillTask *)pdm_wire_message(pn->queue[i].m))->n_batch) return;
    /* Unordered (see the top): only all ranks together may leave a group task out. */
    if (!pn->follow_rank0 && pdm__ordered(pn, &pn->queue[i])) {
        pdm_log_info("prefill rank: task %llu cancelled while queued: it runs all the same "
                     "(unordered group)", (unsigned long long)c->task_id);
        return;
    }
    pdm_log_info("prefill rank: task %llu cancelled while queued",
                 (unsigned long long)c->task_id);
    pdm__dequeue(pn, i, 0);
}

/* The routers whose lease ran out (common/nodelink.h): their queued tasks are dropped, and
 * tasks queued for longer than any deadline allows. */
static void pdm__drop_stale(pdm__daemon_t *pn)
{
    int gone[PDM_LINK_MAX_ROUTERS] = {0}, any = 0;
    unsigned now_orphans = pdm_link_orphans(pn->link);
    if (now_orphans != pn->orphans_seen) {
        pn->orphans_seen = now_orphans;
        for (int o = 0; o < pdm_link_n_routers(pn->link); o++) {
            unsigned k = pdm_link_orphans_of(pn->link, o);
            any |= gone[o] = k != pn->orphans_of[o];
            pn->orphans_of[o] = k;
        }
    }
    const double too_old = pdm_now() - PDM_MAX(60.0, 4 * pn->rp.timeout);
    int n = 0;
    for (int i = pn->n_queued - 1; i >= 0; i--) {
        /* (in an unordered group a group task runs on every rank or none: a router's lease
         * runs out on each rank at its own time, so its group tasks run, unanswered) */
        const int keep = !pn->follow_rank0 && pdm__ordered(pn, &pn->queue[i]);
        if ((any && gone[pn->queue[i].origin] && !keep) || pn->queue[i].arrived < too_old) {
            pdm__dequeue(pn, i, 0);
            n++;
        }
    }
    if (n) pdm_log_warn("prefill rank: dropped %d queued task(s) of a router that is gone", n);
}

/* Runs task m (owned, freed here) of router `origin` (-1: a router no longer registered; the
 * task still runs, the others' collectives count on it, and its answer goes nowhere). */
static void pdm__run_msg(pdm__daemon_t *pn, pdm_wire_msg_t *m, int origin, double arrived)
{
    pn->task_arrived = arrived;
    pdm__on_task(pn, (const Pdmesh__PrefillTask *)pdm_wire_message(m), origin);
    pdm_wire_msg_free(m);
}

static void pdm__run_queued(pdm__daemon_t *pn, int i)
{
    const pdm__queued_t q = pn->queue[i];
    pdm__run_msg(pn, pdm__dequeue(pn, i, 1), q.origin, q.arrived);
}

/* The tag of order entry `seq` (or of its task): named by the formation (the group's nonce,
 * kvtransfer.h), so that an entry a follower never took before the group re-formed cannot be
 * taken for the new formation's entry of the same number. */
static uint64_t pdm__order_tag(const pdm__daemon_t *pn, pdm_kvt_kind_t kind, int seq)
{
    return pdm_kvt_tag(kind, 0, pn->group.nonce & 0xffff, 0, seq);
}

/* 1 when the task needs the whole group in one order (not solo, group of 2 or more). */
static int pdm__ordered(const pdm__daemon_t *pn, const pdm__queued_t *q)
{
    const Pdmesh__PrefillTask *t = (const Pdmesh__PrefillTask *)pdm_wire_message(q->m);
    return pn->grouped && pn->group.size > 1 && !t->solo;
}

/* Rank 0: queued task q goes to every other rank as the next entry of the group's order, with
 * the deadline it has left. A rank that does not take it fails the task's collectives within
 * the group timeout, not later. Fails (nothing sent) only when the frame cannot be made. */
static int pdm__order_send(pdm__daemon_t *pn, const pdm__queued_t *q)
{
    Pdmesh__PrefillTask t = *(const Pdmesh__PrefillTask *)pdm_wire_message(q->m);
    if (t.deadline_ms) {
        const double left = t.deadline_ms / 1e3 - (pdm_now() - q->arrived);
        t.deadline_ms = left > 1e-3 ? (uint32_t)(left * 1e3) : 1;
    }
    uint8_t *frame;
    size_t len;
    int st = pdm_wire_pack(PDMESH__MSG_TYPE__MSG_PREFILL_TASK, &t.base, &frame, &len);
    if (st) return st;
    pdm__order_entry_t *e = &pn->order_out;
    *e = (pdm__order_entry_t){.key = q->key,
                              .router_id = pdm_link_router_id(pn->link, q->origin),
                              .frame_bytes = (uint32_t)len};
    pdm_kvt_req_t reqs[2 * PDM_KVT_MAX_RANKS];
    int n = 0;
    pdm_kvt_iov_t iov[2] = {{e, sizeof(*e)}, {frame, len}};
    const int seq = (int)(pn->order_seq & 0xffff);
    const uint64_t tag[2] = {pdm__order_tag(pn, PDM_KVT_KIND_ORDER, seq),
                             pdm__order_tag(pn, PDM_KVT_KIND_ORDER_TASK, seq)};
    pn->order_seq++;
    for (int k = 1; k < pn->group.size; k++)
        for (int part = 0; part < 2; part++)
            if (!pdm_kvt_isend(pn->kvt, pn->group.peer[k], tag[part], &iov[part], 1, &reqs[n]))
                n++;
    if (pdm_kvt_wait_all(pn->kvt, reqs, n, pdm_kvt_group_deadline(&pn->group))) {
        /* A send UCX gave up on may still read its buffer: the frame is left to it (leaked,
         * once per broken group) rather than freed under it. */
        pdm_log_warn("prefill rank: the group's order did not reach every rank: %s",
                     pdm_error_last());
        return PDM_OK;
    }
    free(frame);
    return PDM_OK;
}

/* Rank > 0: the next entry of the order, when it came (its receive is posted meanwhile), with
 * its task: *m (to run), its router *origin. 0: none yet; -1: an entry that cannot be run
 * (logged; rank 0's collectives for it time out as for a dead rank). */
static int pdm__order_poll(pdm__daemon_t *pn, pdm_wire_msg_t **m, int *origin)
{
    if (pn->order_req == PDM_KVT_REQ_NONE) {
        if (pdm_now() < pn->order_retry_at) return 0;
        pdm_kvt_iov_t iov = {&pn->order_entry, sizeof(pn->order_entry)};
        const uint64_t tag =
            pdm__order_tag(pn, PDM_KVT_KIND_ORDER, (int)(pn->order_seq & 0xffff));
        if (pdm_kvt_irecv(pn->kvt, pn->group.peer[0], tag, &iov, 1, &pn->order_req)) {
            pn->order_req = PDM_KVT_REQ_NONE;
            pn->order_retry_at = pdm_now() + 1.0;
            return 0;
        }
    }
    size_t bytes = 0;
    int st = pdm_kvt_test(pn->kvt, pn->order_req, &bytes);
    if (st == 0) return 0;
    pn->order_req = PDM_KVT_REQ_NONE;
    if (st < 0) {
        pdm_log_warn("prefill rank: no order from rank 0: %s", pdm_error_last());
        pn->order_retry_at = pdm_now() + 1.0;
        return 0;
    }
    if (bytes != sizeof(pn->order_entry)) { /* consumed: the next entry has the next number */
        pdm_log_warn("prefill rank: order entry %u of %zu bytes (a rank 0 of another version?): "
                     "skipped", pn->order_seq & 0xffff, bytes);
        pn->order_seq++;
        return -1;
    }
    const pdm__order_entry_t e = pn->order_entry;
    const int seq = (int)(pn->order_seq++ & 0xffff);
    if (e.frame_bytes < PDM_WIRE_HDR || e.frame_bytes > PDM_WIRE_MAX_FRAME) {
        pdm_log_warn("prefill rank: order entry %d names a task of %u bytes: skipped", seq,
                     e.frame_bytes);
        return -1;
    }
    uint8_t *frame = malloc(e.frame_bytes);
    if (!frame) {
        pdm_log_warn("prefill rank: no memory for order entry %d's task: skipped", seq);
        return -1;
    }
    pdm_kvt_iov_t iov = {frame, e.frame_bytes};
    pdm_kvt_req_t r;
    st = pdm_kvt_irecv(pn->kvt, pn->group.peer[0],
                       pdm__order_tag(pn, PDM_KVT_KIND_ORDER_TASK, seq), &iov, 1, &r);
    if (!st) st = pdm_kvt_wait(pn->kvt, r, pdm_kvt_group_deadline(&pn->group), &bytes);
    if (!st && bytes != e.frame_bytes)
        st = pdm_error_set(PDM_EFORMAT, "%zu bytes, the entry said %u", bytes, e.frame_bytes);
    if (!st) st = pdm_wire_unpack(frame, bytes, PDM_WIRE_MAX_FRAME, 0, m);
    if (!st && pdm_wire_type(*m) != PDMESH__MSG_TYPE__MSG_PREFILL_TASK) {
        pdm_wire_msg_free(*m);
        st = pdm_error_set(PDM_EFORMAT, "not a PrefillTask");
    }
    free(frame);
    if (st) {
        pdm_log_warn("prefill rank: order entry %d's task: %s: skipped", seq, pdm_error_last());
        return -1;
    }
    *origin = pdm_link_origin_of_router(pn->link, e.router_id);
    if (*origin < 0)
        pdm_log_info("prefill rank: the router of task key %llu is gone: it runs for the group, "
                     "unanswered", (unsigned long long)e.key);
    return 1;
}

/* Follower: the forwarded task `key` of router `origin` runs. Its copy from the router is
 * dropped, with the same router's copies queued before it (rank 0 passed them over); a copy
 * not here yet is dropped when it comes (pn->ran). */
static void pdm__forwarded_ran(pdm__daemon_t *pn, uint64_t key, int origin)
{
    const int i = pdm__queue_find(pn, key);
    if (i < 0) {
        pn->ran[pn->ran_next] = key;
        pn->ran_next = (pn->ran_next + 1) % (int)PDM_ARRAY_SIZE(pn->ran);
        return;
    }
    for (int j = i; j >= 0; j--)
        if (j == i || pn->queue[j].origin == origin) {
            if (j != i)
                pdm_log_info("prefill rank: task key %llu was passed over by rank 0: dropped",
                             (unsigned long long)pn->queue[j].key);
            pdm__dequeue(pn, j, 0);
        }
}

/* Rank 0: task t was planned for another formation of the group than this rank's. Answered
 * ERR_STALE_FORMATION with the rank's formation, a code of its own: the router does not take
 * it for a failure of the group (it re-checks its wiring and plans the task again). */
static void pdm__refuse_formation(pdm__daemon_t *pn, const Pdmesh__PrefillTask *t, int origin)
{
    Pdmesh__PrefillResult r = PDMESH__PREFILL_RESULT__INIT;
    Pdmesh__Error e = PDMESH__ERROR__INIT;
    char msg[160];
    snprintf(msg, sizeof(msg), "PrefillTask: planned for formation %016llx of the group, the "
             "rank is in %016llx (the group re-formed since)", (unsigned long long)t->formation,
             (unsigned long long)pn->formation);
    pdm_log_info("prefill rank: task %llu attempt %u refused: %s", (unsigned long long)t->task_id,
                 t->attempt, msg);
    pdm__result_head(pn, t, origin, &r, &e);
    e.code = PDMESH__ERROR_CODE__ERR_STALE_FORMATION;
    e.message = msg;
    e.formation = pn->grouped ? pn->formation : 0;
    r.error = &e;
    pdm_link_send_to(pn->link, origin, PDMESH__MSG_TYPE__MSG_PREFILL_RESULT, &r.base);
}

/* Whether queued task q is a group task planned for another formation than this rank's: if
 * so it is answered (pdm__refuse_formation) and dropped. */
static int pdm__stale_formation(pdm__daemon_t *pn, pdm__queued_t *q)
{
    const Pdmesh__PrefillTask *t = (const Pdmesh__PrefillTask *)pdm_wire_message(q->m);
    if (!t->formation || t->solo || (pn->grouped && t->formation == pn->formation)) return 0;
    pdm__refuse_formation(pn, t, q->origin);
    pdm__dequeue(pn, (int)(q - pn->queue), 0);
    return 1;
}

/* Runs what may run now: 1 if a task ran. */
static int pdm__run_next(pdm__daemon_t *pn)
{
    const int follower =
        pn->grouped && pn->group.rank > 0 && pn->group.size > 1 && pn->follow_rank0;
    /* solo tasks and tasks before the group formed need no order; a follower runs a group
     * task only as rank 0 forwards it (its own copy is a record: pdm__forwarded_ran); in an
     * unordered group every rank takes its queue's head, as rank 0 does, and forwards none */
    /* a group task planned for another formation (the group re-formed since, under another
     * router's GroupWire) is refused before the others hear of it: its collectives and the
     * decode node's ranges would not match this one (a group of one rank runs its tasks
     * unordered: checked alike) */
    for (int i = 0; i < pn->n_queued; i++)
        if (!pdm__ordered(pn, &pn->queue[i])) {
            if (pdm__stale_formation(pn, &pn->queue[i])) return 1;
            pdm__run_queued(pn, i);
            return 1;
        }
    if (!follower) {
        if (!pn->n_queued) return 0;
        if (pdm__stale_formation(pn, &pn->queue[0])) return 1;
        const pdm__queued_t q = pn->queue[0];
        const int st = pn->follow_rank0 ? pdm__order_send(pn, &q) : PDM_OK;
        if (st) {
            const pdm_prefill_result_t none = {0};
            pdm__answer(pn, (const Pdmesh__PrefillTask *)pdm_wire_message(q.m), q.origin, st,
                        pdm_error_last(), &none, 0, 0);
            pdm__dequeue(pn, 0, 0);
            return 1;
        }
        pdm__run_queued(pn, 0);
        return 1;
    }
    pdm_wire_msg_t *m;
    int origin;
    if (pdm__order_poll(pn, &m, &origin) <= 0) return 0;
    const Pdmesh__PrefillTask *t = (const Pdmesh__PrefillTask *)pdm_wire_message(m);
    pdm__forwarded_ran(pn, PDM_LINK_TASK_KEY(t->task_id, t->attempt), origin);
    pdm__run_msg(pn, m, origin, pdm_now());
    return 1;
}

/* One message from the link (owned: queued or freed here). */
static void pdm__on_message(pdm__daemon_t *pn, pdm_wire_msg_t *m)
{
    const ProtobufCMessage *msg = pdm_wire_message(m);
    switch (pdm_wire_type(m)) {
    case PDMESH__MSG_TYPE__MSG_GROUP_WIRE: pdm__on_group_wire(pn, (const Pdmesh__GroupWire *)msg); break;
    case PDMESH__MSG_TYPE__MSG_PREFILL_TASK:
        pdm__enqueue(pn, m, pdm_link_origin(pn->link));
        return;
    case PDMESH__MSG_TYPE__MSG_GROUP_PINGPONG:
        pdm__on_pingpong(pn, (const Pdmesh__GroupPingPong *)msg);
        break;
    case PDMESH__MSG_TYPE__MSG_STATS_REQUEST: pdm__on_stats(pn); break;
    case PDMESH__MSG_TYPE__MSG_CANCEL_TASK: pdm__on_cancel(pn, (const Pdmesh__CancelTask *)msg); break;
    default: break;
    }
    pdm_wire_msg_free(m);
}

static void pdm__usage(FILE *f)
{
    fprintf(f, "usage: pdmesh-prefill --router ENDPOINT --node-id NAME --group G --rank r\n"
               "                      --group-size R [--secret-file F]\n"
               "                      [--curve-server-key F --curve-key F]\n"
               "                      [--model FILE] [--threads N] [--cpu N] [--ctx N]\n"
               "                      [--kv-dtype f32|f16|q8] [--timeout SECONDS]\n"
               "                      [--dump-dir DIR] [--exit-with-parent] [--kv-interface DEV]\n"
               "                      [--health-file F] [--drain-grace S] [--pool-tokens N]\n"
               "One rank of a prefill group. It takes its tasks from the node socket at ENDPOINT\n"
               "(the router's, or pdmesh prefill-run's / disagg-run's) as protobuf messages.\n"
               "--health-file: rewritten every second for `pdmesh health` (liveness and readiness).\n"
               "--drain-grace: on SIGTERM take no new task and stop once idle, for at most S s (0).\n"
               "--group-size 0: an elastic group, the router wires ranks 0..k-1 as they come.\n"
               "--pool-tokens: most tokens of finished conversations this rank keeps for\n"
               "  follow-ups (the router's --group-pool-tokens asks for at most this; 16384).\n");
}

int main(int argc, char **argv)
{
    const char *model_path = pdm_model_default_path();
    pdm__daemon_t pn = {0};
    pn.order_req = PDM_KVT_REQ_NONE;
    pdm_prefill_rank_params_default(&pn.rp);
    long cpu = -1;
    enum { O_CURVE_SERVER = 1001, O_CURVE_KEY, O_DUMP_DIR, O_EXIT_WITH_PARENT, O_KV_IFACE, O_HEALTH, O_DRAIN,
           O_POOL_TOKENS };
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'}, {"threads", required_argument, 0, 't'},
        {"cpu", required_argument, 0, 'c'},   {"ctx", required_argument, 0, 'x'},
        {"kv-dtype", required_argument, 0, 'k'}, {"timeout", required_argument, 0, 'o'},
        {"help", no_argument, 0, 'h'},        {"router", required_argument, 0, 'R'},
        {"node-id", required_argument, 0, 'N'}, {"group", required_argument, 0, 'G'},
        {"rank", required_argument, 0, 'r'},  {"group-size", required_argument, 0, 'g'},
        {"secret-file", required_argument, 0, 'S'},
        {"curve-server-key", required_argument, 0, O_CURVE_SERVER},
        {"curve-key", required_argument, 0, O_CURVE_KEY},
        {"dump-dir", required_argument, 0, O_DUMP_DIR},
        {"exit-with-parent", no_argument, 0, O_EXIT_WITH_PARENT},
        {"kv-interface", required_argument, 0, O_KV_IFACE},
        {"health-file", required_argument, 0, O_HEALTH},
        {"drain-grace", required_argument, 0, O_DRAIN},
        {"pool-tokens", required_argument, 0, O_POOL_TOKENS}, {0, 0, 0, 0}};
    pdm_link_params_t lp;
    pdm_link_params_default(&lp);
    lp.role = PDMESH__ROLE__ROLE_PREFILL;
    lp.features = PDM_FEAT_PREFILL;
    const char *kv_iface = NULL;
    int c;
    long v;
    double d;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case 'm': model_path = optarg; break;
        case 't':
            if (pdm_parse_long(optarg, 1, 256, &v)) goto bad;
            pn.rp.threads = (int)v;
            break;
        case 'c':
            if (pdm_parse_long(optarg, 0, CPU_SETSIZE - 1, &cpu)) goto bad;
            break;
        case 'x':
            if (pdm_parse_long(optarg, 1, 1 << 22, &v)) goto bad;
            pn.rp.ctx_tokens = (int)v;
            break;
        case 'k':
            if (pdm_kv_dtype_parse(optarg, &pn.rp.kv_dtype)) goto bad;
            break;
        case 'o':
            if (pdm_parse_double(optarg, 0.001, 86400, &d)) goto bad;
            pn.rp.timeout = d;
            break;
        case 'R':
            if (pdm_link_params_add_router(&lp, optarg)) {
                fprintf(stderr, "%s\n", pdm_error_last());
                return 2;
            }
            break;
        case O_CURVE_SERVER: lp.curve_server_key_file = optarg; break;
        case O_CURVE_KEY: lp.curve_key_file = optarg; break;
        case O_DUMP_DIR: pn.dump_dir = optarg; break;
        case O_EXIT_WITH_PARENT: lp.exit_with_parent = 1; break;
        case O_KV_IFACE: kv_iface = optarg; break;
        case O_HEALTH: lp.health_file = optarg; break;
        case O_DRAIN:
            if (pdm_parse_double(optarg, 0, 3600, &d)) goto bad;
            lp.drain_grace = d;
            break;
        case O_POOL_TOKENS:
            if (pdm_parse_long(optarg, 0, 1 << 24, &v)) goto bad;
            pn.rp.pool_tokens = v;
            break;
        case 'N': lp.node_id = optarg; break;
        case 'G': lp.group = optarg; break;
        case 'S': lp.secret_file = optarg; break;
        case 'r':
            if (pdm_parse_long(optarg, 0, PDM_KVT_MAX_RANKS - 1, &v)) goto bad;
            lp.rank = (uint32_t)v;
            break;
        case 'g':
            if (pdm_parse_long(optarg, 0, PDM_KVT_MAX_RANKS, &v)) goto bad;
            lp.group_size = (uint32_t)v;
            break;
        case 'h': pdm__usage(stdout); return 0;
        default: pdm__usage(stderr); return 2;
        }
    }
    if (optind != argc) {
    bad:
        fprintf(stderr, "pdmesh-prefill: invalid option value\n");
        pdm__usage(stderr);
        return 2;
    }
    if (!lp.endpoint_list[0] || !lp.group || (lp.group_size && lp.rank >= lp.group_size)) {
        fprintf(stderr, "pdmesh-prefill: needs --router, --node-id, --group, --rank and "
                        "--group-size (rank < group size; 0: an elastic group)\n");
        pdm__usage(stderr);
        return 2;
    }
    lp.model_id = model_path;
    lp.capacity.threads = (uint32_t)pn.rp.threads;
    lp.capacity.max_prompt = (uint32_t)pn.rp.ctx_tokens;
    /* the router asks its group pool for at most this (pool.h): its mirror then never keeps
     * what a rank had to evict */
    lp.capacity.pool_tokens = (uint64_t)pn.rp.pool_tokens;
    /* First, before any library starts a thread: signals are blocked from here on. */
    if (pdm_link_create(&lp, &pn.link)) {
        fprintf(stderr, "pdmesh-prefill: %s\n", pdm_error_last());
        return 1;
    }
    if (cpu >= 0) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET((int)cpu, &set);
        if (sched_setaffinity(0, sizeof(set), &set))
            fprintf(stderr, "pdmesh-prefill: cannot pin to cpu %ld (continuing)\n", cpu);
    }

    pdm_model_t *model = NULL;
    int status = 1;
    if (pdm_model_load(model_path, &model) || pdm_kvt_listen_on(kv_iface) ||
        pdm_kvt_create(NULL, &pn.kvt)) {
        fprintf(stderr, "pdmesh-prefill: %s\n", pdm_error_last());
        goto out;
    }
    pn.model = model;
    const void *addr;
    size_t alen;
    pdm_kvt_address(pn.kvt, &addr, &alen);
    if (pdm_link_start(pn.link, addr, alen)) {
        fprintf(stderr, "pdmesh-prefill: %s\n", pdm_error_last());
        goto out;
    }
    for (;;) {
        pdm_wire_msg_t *m;
        /* a follower rank polls its order channel between messages */
        const int follower =
            pn.grouped && pn.group.rank > 0 && pn.group.size > 1 && pn.follow_rank0;
        const int timeout = pn.n_queued || follower ? 2 : 1000;
        if (pdm_link_recv(pn.link, timeout, &m)) break; /* SIGTERM or a refused registration */
        if (!m && !pn.n_queued && pdm_link_draining(pn.link)) break; /* drained */
        int stop = 0;
        while (m) { /* everything that came, cancels included, before the next task runs */
            pdm__on_message(&pn, m);
            if (pdm_link_recv(pn.link, 0, &m)) {
                stop = 1;
                break;
            }
        }
        if (stop) break;
        pdm__drop_stale(&pn);
        pdm__run_next(&pn);
    }
    status = pdm_link_exit_status(pn.link);
out:
    while (pn.n_queued) pdm__dequeue(&pn, pn.n_queued - 1, 0);
    if (pn.order_req != PDM_KVT_REQ_NONE && pn.kvt) pdm_kvt_cancel(pn.kvt, &pn.order_req, 1);
    pdm_prefill_rank_destroy(pn.rank);
    if (pn.grouped) pdm_kvt_group_fini(&pn.group);
    pdm_link_destroy(pn.link);
    pdm_kvt_destroy(pn.kvt);
    pdm_vocab_trie_destroy(pn.trie);
    pdm_model_free(model);
    return status;
}
