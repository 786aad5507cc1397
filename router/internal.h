/*
 * internal.h - the state shared by the router's files, all on the router's one libuv loop
 * thread. Each file declares what it offers the others in its own header, and the files call
 * one way only (a file calls those below it, never back):
 *
 *   main.c -> core.c        configuration, sockets and loop, start-up and shutdown
 *     core.c -> zfront.c    the ZeroMQ client front end      ]
 *               admin.c     the admin socket (pdctl)         ] -> api.c, the front-end API
 *               http.c      the HTTP front end (via main.c)  ]    (router/router.h)
 *               curve.c     CURVE / ZAP
 *               schedule.c  dispatch policy: which decode node and group
 *               registry.c  membership: nodes, groups, epochs, leases; the node socket
 *     api.c, schedule.c, registry.c -> request.c      the request state machine
 *     request.c, api.c, schedule.c -> beams.c         beam search's request fields
 *   and everyone -> internal.h (types, rt_send, rt_node_usable).
 */
#ifndef PDM_ROUTER_INTERNAL_H
#define PDM_ROUTER_INTERNAL_H

#include <stdint.h>
#include <uv.h>

#include "common/pdm.h"
#include "common/wire.h"
#include "model/model.h"
#include "prefill_node/conv.h"    /* the planner (pure; the router links no UCX) */
#include "prefill_node/pool.h"    /* the groups' pools of conversations (pure) */
#include "prefill_node/plan_io.h"
#include "router/adapt.h"
#include "router/batch.h"
#include "router/metrics.h"
#include "router/router.h"

#define RT_MAX_NODES 256
#define RT_MAX_GROUPS 32
#define RT_IDENT_MAX 256
#define RT_NAME_MAX 136
#define RT_PREFIX_SLOTS 4096
#define RT_MAX_STOPS 8
/* Log-probability entries (tokens x (1 + top_logprobs)) a request may ask for, at most; fewer
 * when the vocabulary has long tokens (rt_logprob_entries_max): its GenerateResult must fit
 * the frame. */
#define RT_MAX_LOGPROB_ENTRIES 32768
/* Refusals for another formation of the group (ERR_STALE_FORMATION) a request's tasks may get
 * and be planned again without a failed attempt; the next one is a failed attempt. */
#define RT_MAX_STALE_FORMATION 3

typedef struct {
    const char *client_ep, *node_ep, *admin_ep;
    const char *model_path;
    const char *chat_template;    /* format name (model/chat.h) overriding the file's, or NULL */
    const char *secret_file;      /* NULL: $PDMESH_SECRET_FILE / $PDMESH_SECRET */
    const char *admin_token_file; /* NULL: $PDMESH_ADMIN_TOKEN_FILE / $PDMESH_ADMIN_TOKEN */
    const char *curve_secret_file; /* CURVE on every socket (router/curve.c), or NULL: plain */
    const char *curve_allow_file;  /* client public keys allowed (Z85, one a line) */
    int heartbeat_ms, lease_ms;
    int queue_max;                /* requests admitted and not yet finished */
    int per_client_max;           /* open requests per client */
    uint32_t max_prompt_tokens, max_tokens, default_max_tokens, max_beams;
    uint32_t default_deadline_ms;
    int max_attempts;             /* dispatches per request (retries + migrations), <= 15 */
    uint32_t local_threshold;     /* prompts shorter than this are prefilled by the decode node */
    char method[16];              /* prefill method for groups: auto, single, kvr-e, ... */
    const char *partition_table;  /* JSON file (pdmesh partition-search) or NULL */
    const char *calibration;      /* JSON file (pdmesh calibrate) or NULL */
    int block_tokens;             /* prefix-hash block size; also the least cached prefix a
                                   * follow-up turn reuses */
    int prefix_reuse;             /* partial prefill of follow-up turns (0: route only) */
    int group_pool_tokens;        /* each prefill group keeps finished conversations up to
                                   * this many tokens (prefill_node/pool.h; 0: only its last) */
    uint32_t pool_local_max;      /* a prompt whose prefix a decode node's pool holds is
                                   * prefilled there when at most this many tokens are left */
    int pool_delta;               /* 1: a longer rest goes through a group to that node, which
                                   * receives only the rest's KV (delta transfer) */
    double max_skew_s;            /* registration timestamp skew */
    int group_inflight;           /* prefill tasks queued per group */
    int adaptive_group;           /* load-adaptive parallelism (adapt.h, rt_adapt_rule_t): a
                                   * request may go to one idle rank of a group alone (solo):
                                   * 0 never, 1 by the cost model, 2 whenever others wait */
    int prefill_batch_max;        /* batched prefill (batch.h): requests per batch task, 1..8
                                   * (1: none) */
    int prefill_batch_tokens;     /* ... and their prompt tokens at most */
    int prefill_chunk_tokens;     /* chunked prefill (request.c "Chunked prefill"): a prompt
                                   * with more than this many tokens left for a whole-group
                                   * task is prefilled by the group in chunks of this size,
                                   * other tasks free to go between them (0: off) */
    const char *http_host;
    int http_port;                /* -1: no HTTP */
} rt_config_t;

typedef struct {
    int used;
    char id[RT_NAME_MAX];
    int role;                     /* Pdmesh__Role */
    char group[64];
    uint32_t rank, gsize;
    uint8_t ident[RT_IDENT_MAX];
    size_t ident_len;
    uint8_t *ucx;
    size_t ucx_len;
    uint64_t kv_tokens;
    uint32_t max_sequences, max_batch, threads, max_prompt;
    uint32_t running, held;
    uint64_t kv_used, kv_free, offload;
    uint64_t epoch;
    double last_hb, registered_at;
    int dead, draining;
    uint32_t pid;
    uint64_t generation;    /* Register.generation of the registration it holds */
    uint64_t features;      /* Register.features (PDM_FEAT_*; 0: a node of an older version) */
    uint64_t reg_ts_ms;     /* Register.timestamp_ms of the newest copy of it taken */
    int tasks;                    /* router-side: attempts assigned and not ended */
    int64_t kv_reserved;          /* router-side: KV tokens of those attempts */
    double full_until;            /* refused a reservation: skip it until then */
    uint32_t max_beams;           /* decode: widest beam search it runs (Capacity.max_beams) */
    uint64_t pool_tokens;         /* decode: its prefix pool's size (Capacity.pool_tokens) */
    Pdmesh__PoolStats pool;       /* decode: its pool as its last KvEvents reported (scalars) */
    uint64_t kvev_seq;            /* the last KvEvents.seq taken from it (this epoch) */
    uint64_t kvev_corrupt_seen;   /* pool.corrupt already counted in the router's metric */
    uint32_t kv_layers, kv_win_layers, kv_win_rows; /* decode: its windowed local layers
                                                     * (Capacity.kv_*; 0: none) */
} rt_node_t;

typedef struct {
    int used;
    char name[64];
    uint32_t size;                /* ranks wired (elastic: the ranks of the current wiring) */
    int elastic;                  /* registered with group_size 0: the group is ranks 0..k-1,
                                   * every registered, usable rank up to the first gap; it is
                                   * wired anew when that changes (rt_group_try_wire) */
    int rewire;                   /* elastic: the membership changed; no new task until the
                                   * tasks in flight end and it is wired anew */
    int member[PDM_PREFILL_MAX_RANKS]; /* node index per rank, -1 while missing */
    uint64_t member_epoch[PDM_PREFILL_MAX_RANKS];
    uint64_t formation;           /* of the current wiring (PrefillTask.formation) */
    int ordered;                  /* of the current wiring (GroupWire.ordered): every rank
                                   * has PDM_FEAT_ORDERED_GROUP (router/features.h) */
    uint64_t wire_gen;            /* wirings sent so far (rt_req_t.wire_gen) */
    int wire_stale;               /* rank 0 refused a task of the current wiring for another
                                   * formation (ERR_STALE_FORMATION): registry.c re-sends the
                                   * GroupWire */
    double stale_rewire_at;       /* when it last did: at most once a lease, so that two
                                   * routers that see an elastic group differently do not
                                   * re-form it under each other's tasks without end */
    int wired;
    int inflight;                 /* prefill tasks sent and not finished on all ranks */
    double suspect_until;         /* an attempt through it failed: not used until then (a
                                   * dead rank is declared only when its lease runs out) */
    pdm_prefill_conv_t conv;      /* mirror of the conversation its ranks hold (conv.c) */
    pdm_prefill_pool_t pool;      /* mirror of its ranks' pools of conversations (pool.h):
                                   * the same operations in the same order, no KV */
    int pool_reset;               /* the mirror was emptied: the next whole-group task tells the
                                   * ranks to empty theirs (PrefillTask.pool_reset) */
    uint64_t pool_tasks, pool_hits, pool_hit_tokens, pool_corrupt; /* whole-group tasks, those
                                   * continuing a held conversation, the tokens they reused,
                                   * pooled prefixes the ranks found corrupt */
    int reuse_pending;            /* a partial prefill is planned and its task not sent yet:
                                   * no other task may overtake it */
    /* Per rank (load-adaptive groups): tasks assigned to it, whole-group or solo, and not
     * answered by it; and when the last of them should end (pdm_now() clock, cost model). */
    int rank_tasks[PDM_PREFILL_MAX_RANKS];
    double rank_free_at[PDM_PREFILL_MAX_RANKS];
    int solo_inflight;            /* solo tasks in flight (counted in inflight too): no
                                   * whole-group task is sent while there is one */
    rt_adapt_cost_t cost;         /* the group's cost model and its learned corrections */
    int has_cost;                 /* cost set up for the current wiring */
} rt_group_t;

/* RQ_SHARED: a choice of OpenAI's n whose tokens come from its leader's attempt (below). */
enum { RQ_QUEUED = 0, RQ_RESERVING, RQ_PREFILL, RQ_DECODE, RQ_SHARED };

#define RT_MAX_CHOICES 8 /* OpenAI's n (PDM_NSAMP_MAX of decode_node/nsamp.h) */

typedef struct rt_req {
    struct rt_req *next, *prev;
    uint64_t id, client_id;
    int state;
    pdm_router_sink_t sink;
    char client[96];
    int32_t *prompt;
    uint32_t n_prompt, max_new;
    pdm_sampler_params_t sp;      /* its bias arrays point at bias_ids / bias_values, its
                                   * json_schema at json_schema */
    char *json_schema;            /* structured output's schema (malloc'd), or NULL */
    int32_t bias_ids[PDM_SAMPLER_MAX_LOGIT_BIAS];
    float bias_values[PDM_SAMPLER_MAX_LOGIT_BIAS];
    /* logprobs (sp.logprobs >= 0): per delivered token i, lp_stride = 1 + sp.logprobs entries
     * at lp_ids/lp_vals[i * lp_stride]: the chosen token, then the alternatives; lp_n[i] the
     * alternatives stored, -1 when the token came without log-probabilities */
    int32_t *lp_ids;              /* [max_new * lp_stride] */
    float *lp_vals;               /* [max_new * lp_stride] */
    int8_t *lp_n;                 /* [max_new] */
    uint32_t lp_stride;
    pdm_token_logprobs_t first_lp; /* the owner rank's (PrefillResult), for DecodeStart */
    int has_first_lp;
    /* prompt log-probabilities (GenerateRequest.prompt_logprobs): the same layout as lp_*,
     * per prompt position, plp_stride = 1 + alternatives; merged from the group's ranks */
    int want_plp;                 /* asked for */
    int prompt_only;              /* score the prompt, generate nothing */
    int32_t *plp_ids;             /* [n_prompt * plp_stride] */
    float *plp_vals;              /* [n_prompt * plp_stride] */
    int8_t *plp_n;                /* [n_prompt] -1: not received (yet) */
    uint32_t plp_stride;
    uint32_t plp_have;            /* positions the current attempt's ranks reported */
    int plp_sent;                 /* complete and handed to sink.on_prompt */
    int32_t first_token;          /* the owner's first token, kept until every rank reported */
    int has_first;
    char *stops[RT_MAX_STOPS];
    size_t n_stops;
    int ignore_eos;
    /* beam search (beams > 1; beams.c): not streamed, restarted from the prompt on a retry */
    uint32_t beams, n_best;
    float length_penalty;
    char early_stopping[16];
    int64_t kv_held;              /* KV tokens this attempt holds in its node's kv_reserved */
    Pdmesh__Beam **res_beams;     /* the DecodeResult's n-best while rt_req_finish runs */
    size_t n_res_beams;
    double t_arrival, deadline, t_first, t_last, t_dispatch;
    uint32_t attempt;             /* of the current dispatch, 1-based */
    int dnode;                    /* decode node index, -1 */
    uint64_t dnode_epoch;
    int group;                    /* group index, -1 (local prefill) */
    uint64_t group_epochs[PDM_PREFILL_MAX_RANKS];
    int local;
    uint32_t base;                /* completion index of this attempt's token 0 */
    uint32_t ranks_done;
    int solo_rank;                /* the rank of a solo attempt (adapt.h), -1: whole group */
    uint64_t ranks_answered;      /* bit k: rank k answered this attempt's PrefillTask */
    double prefill_seconds;       /* slowest rank's PrefillResult.seconds of this attempt */
    int started;                  /* DecodeStart sent */
    int32_t *gen;                 /* [max_new] delivered tokens */
    uint32_t n_gen;
    char *text;
    size_t text_len, text_cap, text_sent;
    pdm_detok_t detok;
    uint64_t kv_bytes;
    double kv_seconds;
    int chunks[PDM_PREFILL_MAX_RANKS]; /* partition of the current group attempt */
    int has_chunks, method_id;
    char method[16];
    char group_name[64], dnode_name[RT_NAME_MAX];
    uint32_t retries, migrations, cached_tokens; /* cached: prompt tokens reused by the group */
    int reuse_pending;            /* holds its group's reuse_pending */
    uint64_t pool_source;         /* the group conversation its cached prefix comes from
                                   * (PrefillTask.pool_source; 0: the current one) */
    int64_t pool_budget;          /* PrefillTask.pool_tokens of the attempt */
    int pool_reset;               /* the attempt's PrefillTask.pool_reset */
    uint64_t wire_gen;            /* its group's wire_gen when its whole-group task went out */
    uint32_t stale_formations;    /* its tasks rank 0 refused for another formation (at most
                                   * RT_MAX_STALE_FORMATION are planned again unfailed) */
    int waits_for_group;          /* QUEUED: the scheduler last found no prefill group with room
                                   * (0: no decode node with room, or not yet scheduled) */
    pdm_prefill_range_t plan[PDM_PREFILL_MAX_PLAN]; /* the group attempt's ranges (Usage) */
    int n_plan;
    uint8_t kv_key[32];           /* the group attempt's KV key (DecodeTask/PrefillTask.kv_key) */
    /* decode-node prefix pool (schedule.c): whether this request's lookup was counted, the
     * node the global index sent it to and the tokens the index expected it to reuse there
     * (checked against DecodeResult.cached_tokens: a hit or an `evicted` miss) */
    int pool_looked;
    int pool_node;
    uint32_t pool_expect;
    /* delta transfer (DecodeTask.pool_prefix, PrefillTask.stream_from): the prefix the
     * scheduler chose for the next dispatch (rt_req_dispatch takes it), the current attempt's
     * (0: whole prompt streamed), and whether a decode node refused it (its pool lost the
     * prefix or held it corrupt): every later attempt streams the whole prompt */
    uint32_t delta_next;
    uint32_t pool_delta;
    int no_delta;
    /* OpenAI's n sharing one prompt (docs/http.md "n", decode_node/nsamp.h). The submit makes
     * one choice request per choice, each with its own sink, seed, tokens, text and stop
     * strings, and a leader that carries the one attempt (one prefill, one KV transfer, one
     * decode sequence of n_samples samples) and has no sink. The node's tokens of sample i go
     * to choice[i] (RQ_SHARED until then), which ends on its own when its sample does. When
     * the attempt fails after tokens were delivered, the leader ends and every unfinished
     * choice goes on alone (QUEUED: a migration with its delivered tokens and its seed);
     * before, the leader is retried. A leader whose choices have all ended ends too. */
    uint32_t n_samples;           /* leader: its choices (> 1); else 0 */
    struct rt_req *choice[RT_MAX_CHOICES]; /* leader: choice requests, NULL once ended */
    struct rt_req *leader;        /* a choice while it shares its leader's attempt, else NULL */
    uint32_t choice_index;        /* a choice's index in its leader */
    int choice_failed;            /* leader: a choice ended with an error (or was cancelled):
                                   * once none is open it ends without waiting for its
                                   * DecodeResult (its sequence is cancelled) */
    int shared_kv;                /* a choice whose kv_bytes are its leader's (counted once) */
    int resumed_choice;           /* a choice that went on alone: it runs as one sample over
                                   * the segmented cache (DecodeTask.n_samples 1), its delivered
                                   * tokens replayed as steps of it, so that its draws continue
                                   * as in the undisturbed shared run */
    float *first_logits;          /* leader: [n_vocab] the owner rank's logits of the last prompt
                                   * token (PrefillTask.want_logits), for DecodeStart, or NULL */
    int tools;                    /* chat with tools, tool_choice not "none": the result's text
                                   * is parsed for tool calls (GenerateResult.tool_calls_json) */
    int fail_code;                /* QUEUED: ends with this error at the next scheduling pass
                                   * (its leader failed), fail_msg says why */
    char fail_msg[200];
    /* batched prefill (batch.h): the id of the batch's lead request (0: not in a batch) while
     * the members' decode nodes reserve; the batch's PrefillTask goes out (request.c
     * rt_batch_try_send) once none is still reserving, without the ones whose reservation
     * failed; batch_ready: this member's reservation is in place */
    uint64_t batch_id;
    int batch_ready;
    uint64_t sched_pass;          /* the rt_schedule pass that last dispatched it: a pass
                                   * that looks at the queue again (after forming a batch)
                                   * does not dispatch a request twice */
    /* chunked prefill (request.c "Chunked prefill"): while QUEUED, a chunk of the prompt may
     * be in flight on group chunk_group as its own task (chunk_id, attempt 1: no attempt of
     * the request), computing the prompt up to chunk_end; chunk_answered: bit k, rank k
     * answered; chunk_until: when the router stops waiting for it. chunk_off: chunking
     * stopped for this request (a chunk failed or made no progress): it goes whole. */
    uint64_t chunk_id;
    int chunk_group;
    uint32_t chunk_start, chunk_end;
    uint64_t chunk_answered;
    uint64_t chunk_epochs[PDM_PREFILL_MAX_RANKS];
    double chunk_until, chunk_seconds;
    int chunk_off;
    uint32_t chunks_done;         /* chunks computed for it */
    uint32_t chunk_reused;        /* the cached prefix its first chunk continued (Usage) */
} rt_req_t;

struct pdm_router {
    uv_loop_t *loop;
    rt_config_t cfg;
    void *zctx;
    void *client_sock, *node_sock, *admin_sock;
    uv_poll_t poll[3];
    uv_check_t check;
    uv_timer_t tick;
    int handles_open;
    pdm_model_t *model;
    char model_name[128];
    uint8_t *secret;
    size_t secret_len;
    char *admin_token;
    rt_node_t nodes[RT_MAX_NODES];
    rt_group_t groups[RT_MAX_GROUPS];
    uint64_t next_epoch, next_id;
    uint64_t sched_pass;          /* rt_schedule passes so far (rt_req_t.sched_pass) */
    int batch_pending;            /* a batch lost a member: rt_batch_send_pending looks again */
    rt_req_t *head, *tail;
    int n_req;
    pdm_router_limits_t limits;
    pdm_partition_table_t table;
    int has_table;
    pdm_calibration_t calib;
    int has_calib;
    uint32_t lp_max_entries;      /* logprob entries a request may ask for (0: not computed) */
    struct { uint8_t hash[32]; int group; uint64_t stamp; } prefix[RT_PREFIX_SLOTS];
    /* which decode nodes' prefix pools hold each block key, from their KvEvents (kvindex.h) */
    struct rt_kvindex *kvidx;
    uint64_t prefix_stamp;
    uint64_t pool_lookups, pool_hits; /* decode-node prefix pools (the hit-rate gauge) */
    int pool_block_tokens;        /* the block size of the keys decode nodes were given in
                                   * their RegisterAck: fixed at start (policy set block_tokens
                                   * changes only the groups' prefix keys) */
    uint8_t prefix_salt[16];      /* random per router: prefix keys are not predictable */
    uint64_t router_id;           /* random per process (RegisterAck.router_id) */
    struct { uint64_t nonce; uint8_t id[8]; double t; } seen[1024]; /* registration replay */
    unsigned seen_next;
    void *zfront;                 /* zfront.c state */
    struct rt_curve *curve;       /* curve.c: ZAP handler, or NULL */
    struct {
        pdm_metrics_t *reg;
        pdm_metric_t *requests, *ttft, *tpot, *queue, *method, *prefill_tokens, *kv_bytes,
            *kv_time, *nodes,
            *migrations, *retries, *offload, *prefix_hits, *prefix_tokens, *waiting, *kv_free,
            *kv_capacity, *group_inflight, *group_inflight_limit, *solo_concurrent, *batch_requests, *batched,
            /* decode-node prefix pools and the global index (schedule.c, registry.c) */
            *pool_lookups, *pool_hits, *pool_misses, *pool_cached_tokens, *pool_hit_rate,
            *pool_tokens, *pool_bytes, *pool_blocks, *pool_corrupt, *kv_events, *kv_index_blocks,
            *pool_delta_requests, *pool_delta_tokens, *pool_delta_refused,
            /* prefill groups' pools of conversations (request.c) */
            *group_pool_tokens, *group_pool_entries, *group_pool_evictions, *group_pool_corrupt,
            *group_prefill_tokens, *stale_formation,
            /* chunked prefill (request.c) */
            *prefill_chunks, *prefill_chunk_failures;
    } m;
};

/* The budget of group gr's pool of conversations (prefill_node/pool.h): the router's
 * group_pool_tokens, at most what every rank keeps (its --pool-tokens, Capacity.pool_tokens
 * at registration), so that the mirror and the ranks evict alike. */
static inline int64_t rt_group_pool_budget(const pdm_router_t *r, const rt_group_t *gr)
{
    int64_t b = r->cfg.group_pool_tokens;
    for (uint32_t k = 0; k < gr->size && b > 0; k++)
        b = gr->member[k] < 0 ? 0 : PDM_MIN(b, (int64_t)r->nodes[gr->member[k]].pool_tokens);
    return b;
}

/* Sends one message to a peer of a ROUTER socket; a failure is logged here (once) and
 * returned (PDM_EPEER: the peer is gone). */
static inline int rt_send(void *sock, const uint8_t *ident, size_t ident_len, int type,
                          const ProtobufCMessage *m)
{
    int st = pdm_wire_send(sock, ident, ident_len, type, m);
    if (st) pdm_log_warn("router: %s", pdm_error_last());
    return st;
}

/* Whether node i may be given new work: registered, alive (its lease holds) and not
 * draining. */
static inline int rt_node_usable(const pdm_router_t *r, int i)
{
    if (i < 0 || i >= RT_MAX_NODES) return 0;
    const rt_node_t *n = &r->nodes[i];
    return n->used && !n->dead && !n->draining;
}

#endif
