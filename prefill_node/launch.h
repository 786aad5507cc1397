/*
 * launch.h - a group of pdmesh-prefill processes on this machine (and optionally a decode
 * node), driven from one process: the harness of pdmesh prefill-run, partition-search,
 * calibrate, disagg-run and the tests. It speaks the router's side of the node protocol
 * (proto/pdmesh.proto) to the daemons and plans tasks with the router's planner
 * (pdm_prefill_conv_plan_task), so a request does what it would do through the router.
 */
#ifndef PDM_PREFILL_LAUNCH_H
#define PDM_PREFILL_LAUNCH_H

#include <stddef.h>
#include <stdint.h>

#include "kvtransfer/kvtransfer.h"
#include "model/model.h"
#include "prefill_node/conv.h"
#include "prefill_node/plan.h"
#include "prefill_node/task.h"

/* ---- Launcher: a group of pdmesh-prefill processes on this machine ----------------------- */

typedef struct {
    const char *bin;      /* path of pdmesh-prefill */
    const char *model;    /* GGUF path given to every rank */
    int ranks;
    int threads;          /* per rank */
    int pin;              /* pin rank i to cpu i mod (number of cpus) */
    int ctx_tokens;
    const char *kv_dtype; /* "f32", "f16" or "q8" (prefill ranks and decode node) */
    double timeout;       /* seconds for start-up and for each task */
    const char *wrap;     /* command prefix per rank, "%d" = rank, e.g. "ip netns exec ns%d
                           * env UCX_TLS=tcp UCX_NET_DEVICES=veth%d"; NULL: none (default:
                           * $PDMESH_RANK_WRAP) */
    const char *decode_bin; /* path of pdmesh-decode: also start a decode node the ranks
                             * stream to; NULL: none */
    int decode_threads, decode_batch;
    long decode_kv_budget; /* KV token slots of the decode node */
    const char *decode_kv_dtype; /* the decode node's --kv-dtype; NULL: kv_dtype (tests set
                                  * another to check that mismatched blocks are rejected) */
    const char *decode_kv_fast_budget; /* head-wise KV offload: --kv-fast-budget (NULL: off) */
    const char *decode_kv_slow_tier;   /* --kv-slow-tier ram|file:DIR (NULL: default) */
    const char *decode_kv_window;      /* --kv-window R: windowed local layers' reserve, "0"
                                        * off (NULL: the node's default, 2) */
} pdm_launch_params_t;

void pdm_launch_params_default(pdm_launch_params_t *p);

typedef struct pdm_launch pdm_launch_t;

/* Binds a node socket (ipc:// in a private directory), spawns the daemons against it with a
 * random cluster secret, accepts their registrations, wires the group (GroupWire ->
 * GroupReady from every rank). On error every spawned process is stopped. */
int pdm_launch_start(const pdm_launch_params_t *p, pdm_launch_t **out);
/* Stops the daemons (SIGTERM: they deregister and exit; SIGKILL after a grace period) and
 * reaps them. */
void pdm_launch_stop(pdm_launch_t *l);
/* The same, and PDM_EPEER unless every process exited with status 0 after SIGTERM (a crash,
 * a sanitizer's error exit such as LeakSanitizer's, or a process that had to be killed). */
int pdm_launch_finish(pdm_launch_t *l);
/* Process id of a rank (tests kill ranks to check failure handling). */
int pdm_launch_pid(const pdm_launch_t *l, int rank);
/* Transports UCX chose between rank 0 and rank 1, as reported by rank 0. */
const char *pdm_launch_transports(const pdm_launch_t *l);

typedef struct {
    int first_token;
    int n_top;
    int32_t top_ids[16];
    float top_logits[16];
    double ttft; /* seconds from dispatch to the owner's result */
    int owner;
    float *prompt_logprobs; /* task->prompt_logprobs: malloc'ed [task->n_tokens], [i] the
                             * log-probability of token i given the tokens before it as the
                             * ranks reported it (NAN: none did; [0] always); free() it */
    struct {
        int n_local;
        double t_total, t_compute, t_wait;
        double bytes_sent, bytes_received;
    } rank[PDM_KVT_MAX_RANKS];
} pdm_launch_result_t;

/* Runs one task on every rank. kv_out (may be NULL): the whole conversation's KV is written
 * there (pdm_kvfile_*). logits_out (may be NULL): the last token's n_vocab f32 logits. A rank
 * that reports an error, dies or misses the timeout fails the task with its message. */
int pdm_launch_task(pdm_launch_t *l, const pdm_prefill_task_t *task, const char *kv_out,
                    const char *logits_out, pdm_launch_result_t *res);

/* ---- Disaggregated runs: prefill group -> KV stream -> decode node ----------------------- */

typedef struct {
    const int32_t *tokens;
    int32_t n_tokens;
    pdm_prefill_method_t method; /* resolved (not AUTO) */
    const int *chunks;           /* KVR chunk sizes or NULL */
    int32_t max_new;             /* tokens to generate, the first token included */
    pdm_sampler_params_t sp;
    const char *const *stops;
    int n_stops;
    double timeout;              /* seconds for the whole request; 0: the launcher's */
    int beams;                   /* beam search width on the decode node (0: sampling) */
    float length_penalty;        /* beam search only (see decode_node/beam.h) */
    int n_best;                  /* beam search only; 0: 1 */
    const char *early_stopping;  /* beam search only: heuristic|early|never; NULL: heuristic */
    int reuse_prefix;            /* prefill only what follows the longest prefix the group
                                  * still holds from the previous task (partial prefill; the
                                  * ranks stream the cached positions too) */
    int32_t min_cached;          /* with reuse_prefix: the shortest prefix worth reusing (the
                                  * router's block_tokens); 0: any (1 token) */
} pdm_launch_request_t;

typedef struct {
    int ok;
    char error[512];
    int32_t *tokens; /* malloc'd: generated tokens (first token included) */
    int n_tokens;
    char *text;      /* malloc'd */
    char finish[16];
    double ttft;         /* dispatch of the prefill task -> first token */
    double total;        /* dispatch -> last token */
    double step_seconds; /* mean seconds per decode step */
    double kv_seconds;   /* decode node: start -> KV verified */
    double kv_bytes;     /* KV bytes the decode node received */
    double kv_local_bytes, kv_global_bytes; /* the sequence's KV cache on the decode node in
                                             * local (sliding-window) and global layers */
    int32_t cached;      /* prompt tokens reused from the group's cache (reuse_prefix) */
    char *offload_json;  /* malloc'd: the decode node's head-wise offload report, or NULL */
    double prefill_wait; /* max over ranks of time blocked in communication (streaming too) */
    char *beam_json;     /* malloc'd, beam search only: {"n_best":[...],"beam":{...}} as the
                          * decode node reported them; else NULL */
    pdm_prefill_method_t method; /* the method the task ran (the planner's) */
    pdm_prefill_range_t ranges[PDM_PREFILL_MAX_PLAN]; /* the plan: who computed or held which
                                                       * prompt tokens (as the router's Usage) */
    int n_ranges;
} pdm_launch_response_t;

/* Runs `n` requests end to end: for each, the decode node reserves KV and posts its receives,
 * the prefill group computes the prompt and streams its KV, the decode node continues from
 * the first token. The group prefills one request at a time; the decode node batches all
 * requests that have their KV. Fills out[i] (free with pdm_launch_response_free). Returns an
 * error only when the mesh itself failed; per-request failures are in out[i]. */
int pdm_launch_generate(pdm_launch_t *l, const pdm_launch_request_t *reqs, int n,
                        pdm_launch_response_t *out);
void pdm_launch_response_free(pdm_launch_response_t *r);
/* The decode node's sequences held and KV slots reserved (after all events were read). */
int pdm_launch_decode_usage(pdm_launch_t *l, int *held, long *kv_slots);
/* Process id of the decode node (-1 if none). */
int pdm_launch_decode_pid(const pdm_launch_t *l);

/* Mean round-trip time of a `bytes`-byte message between ranks 0 and 1 (calibration). */
int pdm_launch_pingpong(pdm_launch_t *l, size_t bytes, int iters, double *seconds);

#endif /* PDM_PREFILL_LAUNCH_H */
