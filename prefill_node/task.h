/*
 * task.h - one prefill task as every rank of a group runs it: the task, where its KV is
 * streamed, its result on a rank, and the parameters a rank runs tasks under. Shared by the
 * rank (rank.h), the launcher that sends tasks (launch.h) and pdmesh-prefill's line protocol
 * (main.c). Types only.
 */
#ifndef PDM_PREFILL_TASK_H
#define PDM_PREFILL_TASK_H

#include <stdint.h>

#include "model/model.h" /* pdm_dtype_t */
#include "prefill_node/plan.h"

/* A rank of a prefill group (rank.h). */
typedef struct pdm_prefill_rank pdm_prefill_rank_t;

typedef struct {
    int threads;            /* compute threads of this rank */
    int ctx_tokens;         /* KV capacity (maximum P + T) */
    pdm_dtype_t kv_dtype;   /* F32, F16 or I8 (q8, per-head scales all-reduced per layer):
                             * cache and wire format */
    double timeout;         /* seconds per communication step */
    int64_t pool_tokens;    /* most tokens the group pool of conversations (pool.h) may hold
                             * on this rank, whatever a task asks for (0: no pool) */
} pdm_prefill_rank_params_t;

/* Streaming of the KV a rank computes to a decode node, layer by layer as it becomes final
 * (kvtransfer.h, "KV streaming"). */
typedef struct {
    int peer;             /* kvt peer of the decode node */
    uint64_t request_id;
    uint32_t attempt;
    int max_in_flight;    /* blocks outstanding per rank (flow control) */
    const uint8_t *key;   /* [PDM_KVT_KEY_BYTES] the request's KV key (every block carries a
                           * MAC with it), or NULL: unauthenticated */
    int32_t from;         /* delta transfer: no row before this position is sent (the decode
                           * node has [0, from) in its prefix pool), whether computed now or
                           * cached on the group; 0: every row (PrefillTask.stream_from) */
} pdm_prefill_stream_t;

/* One prefill task, identical on every rank of the group. */
typedef struct {
    uint32_t id;                 /* task id (part of every tag; distinct per task) */
    pdm_prefill_method_t method; /* not AUTO: the caller resolves it first */
    int32_t start;               /* P: tokens of the conversation already cached (0: new) */
    const int32_t *prefix;       /* NULL, or [start] the cached tokens the task assumes: then
                                  * they are checked against what the group holds, and a
                                  * group holding a longer conversation is cut at start */
    const int32_t *tokens;       /* [n_tokens] the T new tokens at positions start.. */
    int32_t n_tokens;
    const int32_t *chunks;       /* KVR only: [size] chunk sizes in chain order (sum n_tokens);
                                  * NULL for an even split */
    int solo;                    /* 1: this rank runs the task alone (load-adaptive groups,
                                  * router/adapt.h): method single, start 0, on the rank's
                                  * scratch cache; the group's conversation and KV stay as they
                                  * were, the result keeps nothing. Other ranks never see it. */
    const pdm_prefill_stream_t *stream; /* NULL: the KV stays on the group; else every rank
                                         * streams the KV of its new tokens and, for a
                                         * partial prefill, its runs of the cached prefix
                                         * (pdm_prefill_conv_prefix_runs) */
    int prompt_logprobs;         /* 1: every rank scores the prompt tokens its rows predict
                                  * (the result's prompt_lp); needs start 0 and, for 'single',
                                  * an f16/f32 KV cache */
    int prompt_top;              /* ... with this many alternatives each (<= 20) */
    /* The group's pool of conversations (pool.h), identical on every rank: */
    uint64_t pool_source;        /* the conversation the cached prefix comes from
                                  * (pdm_prefill_conv_id; 0: the one the group is on) */
    int64_t pool_tokens;         /* the pool's budget in tokens (capped by the rank's
                                  * pool_tokens; 0: no pool, one conversation as before) */
    int pool_reset;              /* 1: empty the pool and the conversation first (the router
                                  * lost track of them) */
} pdm_prefill_task_t;

typedef struct {
    int owner;             /* 1 on the rank that computed the last token */
    float *logits;         /* owner only: [n_vocab] of the last token (owned by the rank) */
    int32_t first_token;   /* owner only: greedy first token */
    int32_t n_local;       /* new tokens this rank computed */
    double t_total;        /* seconds from start to end of the task on this rank */
    double t_compute;      /* seconds in model steps */
    double t_wait;         /* seconds blocked on communication */
    uint64_t bytes_sent, bytes_received;
    uint64_t bytes_streamed; /* KV sent to the decode node */
    /* task.prompt_logprobs: entry i is log p(tokens[p] | tokens[0..p)) for p =
     * prompt_lp_pos[i], a position whose predicting row p - 1 this rank computed (p >= 1,
     * ascending); owned by the rank, valid until its next task */
    int32_t n_prompt_lp;
    const int32_t *prompt_lp_pos;
    const pdm_token_logprobs_t *prompt_lp;
} pdm_prefill_result_t;

/* A batch task (rank.h, pdm_prefill_rank_run_batch): up to PDM_PREFILL_BATCH_MAX solo tasks
 * one rank runs as one batch through the engine; each member streams to its own decode node
 * and gets its own result or error. */
#define PDM_PREFILL_BATCH_MAX 8
#define PDM_PREFILL_BATCH_TOKENS 8192 /* tokens of one batch (activations of this many rows) */
typedef struct {
    pdm_prefill_task_t task; /* a solo 'single' task of a whole prompt, no prompt_logprobs */
    double deadline;         /* pdm_now() clock; 0: none. Past it the member fails alone. */
} pdm_prefill_batch_member_t;
typedef struct {
    int status;              /* 0: res is valid; else the member's error */
    char message[256];       /* the error's text */
    pdm_prefill_result_t res; /* res.logits owned by the rank, valid until its next batch */
} pdm_prefill_batch_out_t;

#endif /* PDM_PREFILL_TASK_H */
