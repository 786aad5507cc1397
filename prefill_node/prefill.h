/*
 * prefill.h - a prefill group: R processes computing one prompt's KV cache together.
 *
 * Methods (ARCHITECTURE.md "Prefill methods"):
 *   single  one rank runs the engine's chunked prefill.
 *   tsp     even contiguous split; every layer all-gathers K and V (KV-Runahead §4.1, Fig. 4).
 *   kvr-e   KV-Runahead chain with an even split (§4, Fig. 5, App. C).
 *   kvr-s   KV-Runahead with a searched split (§4.2): the partition table's entry for exactly
 *           this length, or an explicit partition.
 *   kvr-p   KV-Runahead with a split interpolated from the two nearest table entries (§4.2).
 *   cp-kv   ring pass-KV over 2N load-balanced chunks (context-parallelism §3.5.1-3.5.2).
 *   cp-q    ring pass-Q plus an all-to-all of partial outputs (§3.5.3).
 *   auto    chosen by the cost model (pdm_prefill_choose).
 *
 * Every rank owns the new tokens of its share (it computed their KV); the group as a whole
 * keeps a conversation's KV between tasks so that a follow-up turn is a partial prefill of T
 * new tokens after P cached ones (context-parallelism §3.2). Every rank tracks the same
 * deterministic group state (who owns which position, which rank holds which prefix), so
 * no extra messages are needed to agree on it.
 */
#ifndef PDM_PREFILL_H
#define PDM_PREFILL_H

#include <stdint.h>

#include "kvtransfer/kvtransfer.h"
#include "model/model.h"

typedef enum {
    PDM_PREFILL_SINGLE = 0,
    PDM_PREFILL_TSP,
    PDM_PREFILL_KVR_E,
    PDM_PREFILL_KVR_S,
    PDM_PREFILL_KVR_P,
    PDM_PREFILL_CP_KV,
    PDM_PREFILL_CP_Q,
    PDM_PREFILL_AUTO,
    PDM_PREFILL_METHOD_COUNT_
} pdm_prefill_method_t;

const char *pdm_prefill_method_name(pdm_prefill_method_t m);
/* PDM_EINVAL with a message listing the methods if `name` is unknown. */
int pdm_prefill_method_parse(const char *name, pdm_prefill_method_t *out);
static inline int pdm_prefill_method_is_kvr(pdm_prefill_method_t m)
{
    return m == PDM_PREFILL_KVR_E || m == PDM_PREFILL_KVR_S || m == PDM_PREFILL_KVR_P;
}

/* ---- Partitions ------------------------------------------------------------------------ */

/* Even split of n tokens into r chunks, the remainder going to the last chunks (so the last
 * chunk, which holds the last token, is never empty when n >= 1). */
void pdm_prefill_split_even(int n, int r, int *chunks);

/* Who computes which new tokens of a task. */
typedef struct {
    int32_t start, len; /* absolute positions [start, start + len); len may be 0 */
    int rank;
    int chunk;          /* index of the range in the task (part of streamed blocks' tags) */
} pdm_prefill_range_t;

#define PDM_PREFILL_MAX_RANGES (2 * PDM_KVT_MAX_RANKS)

/* The ranges of [start, start + n) in position order: single: one range on rank 0; tsp:
 * `chunks[r]` on rank r; kvr-*: `chunks[c]` in chain order on rank (head + c) mod R; cp-*:
 * 2N even chunks, chunk c on rank c < N ? c : 2N-1-c (context parallelism §3.5.1). Returns the
 * number of ranges (empty ones included). */
int pdm_prefill_plan_ranges(pdm_prefill_method_t m, int ranks, int32_t start, int32_t n,
                            const int *chunks, int head, pdm_prefill_range_t *out);

/* ---- The group's conversation (prefix reuse) --------------------------------------------- *
 * What KV a prefill group holds after its tasks: the tokens, the rank that computed each
 * position, and per rank the prefix [0, held) it holds whole (KV-Runahead passes the prefix
 * down the chain, so after a chain its last rank holds everything, §4; cp-* leave each rank
 * only its own shares, context parallelism §3.5). Every rank keeps one; the router and the
 * launcher keep a mirror built from the same tasks with the same functions, so both ends
 * compute the same plan for a follow-up turn: which rank streams which cached positions. */
typedef struct {
    int32_t n;                       /* positions held: [0, n) */
    int32_t cap;                     /* capacity of owner and tokens */
    int8_t *owner;                   /* [cap] rank that computed each position */
    int32_t *tokens;                 /* [cap] token at each position */
    int32_t held[PDM_KVT_MAX_RANKS]; /* rank r holds all KV of positions [0, held[r]) */
    int last_owner;                  /* rank that computed position n - 1 */
} pdm_prefill_conv_t;

/* Cached positions travel to a decode node as runs of one owner; run i is chunk
 * PDM_PREFILL_PREFIX_CHUNK + i of the request's plan (new tokens use chunks below it). */
#define PDM_PREFILL_PREFIX_CHUNK 128
#define PDM_PREFILL_MAX_PREFIX_RUNS 64

/* Grows the arrays to hold `cap` positions (keeps what is held). */
int pdm_prefill_conv_reserve(pdm_prefill_conv_t *c, int32_t cap);
void pdm_prefill_conv_free(pdm_prefill_conv_t *c);
/* Forgets everything held (a failed task leaves the group's KV incomplete). */
void pdm_prefill_conv_reset(pdm_prefill_conv_t *c);
/* Length of the longest common prefix of the held tokens and tokens[0, n). */
int32_t pdm_prefill_conv_common(const pdm_prefill_conv_t *c, const int32_t *tokens, int32_t n);
/* KVR: the rank to start a chain continuing at `start` (the first one from the last owner on
 * that holds all of [0, start)); 0 for start 0; -1 if no rank does (after cp-*). */
int pdm_prefill_conv_chain_head(const pdm_prefill_conv_t *c, int ranks, int32_t start);
/* The held positions [0, start) as maximal runs of one owner, in position order, with chunk
 * ids PDM_PREFILL_PREFIX_CHUNK + i (out may be NULL: count only). Returns the number of
 * runs, -1 if more than `max`. */
int pdm_prefill_conv_prefix_runs(const pdm_prefill_conv_t *c, int32_t start,
                                 pdm_prefill_range_t *out, int max);
/* The plan of a task continuing the conversation at `start` with `n_new` tokens computed by
 * method `m` (chunks: KVR/TSP sizes, NULL for an even split): with `with_prefix`, first the
 * held runs of [0, start) (what a partial prefill streams besides its new tokens), then the
 * new tokens' ranges (pdm_prefill_plan_ranges, KVR chains starting at the chain head).
 * `out` holds PDM_PREFILL_MAX_PREFIX_RUNS + PDM_PREFILL_MAX_RANGES. Returns the number of
 * ranges and sets *n_prefix to how many of them are cached runs; -1 with the error set when
 * the method cannot continue this conversation. */
#define PDM_PREFILL_MAX_PLAN (PDM_PREFILL_MAX_PREFIX_RUNS + PDM_PREFILL_MAX_RANGES)
int pdm_prefill_conv_plan(const pdm_prefill_conv_t *c, pdm_prefill_method_t m, int ranks,
                          int32_t start, int32_t n_new, const int *chunks, int with_prefix,
                          pdm_prefill_range_t *out, int *n_prefix);
/* Records a task that succeeded: the conversation is cut at `start` and continues with the
 * `n_new` tokens computed as `ranges` (from pdm_prefill_plan_ranges) by method `m`. */
int pdm_prefill_conv_commit(pdm_prefill_conv_t *c, pdm_prefill_method_t m, int ranks,
                            int32_t start, const int32_t *tokens, int32_t n_new,
                            const pdm_prefill_range_t *ranges, int n_ranges);

/* A KVR partition lookup table (§4.2): for each known prompt length the searched chunk sizes
 * as fractions of the length. Stored as JSON by pdmesh partition-search. */
typedef struct {
    int ranks;
    int n_entries;
    struct {
        int length;
        double frac[PDM_KVT_MAX_RANKS]; /* sums to 1 */
        double ttft;                    /* measured seconds at this partition */
        double ttft_cp;                 /* measured seconds of cp-kv at this length (0: none) */
    } entries[64];
} pdm_partition_table_t;

int pdm_partition_table_load(const char *path, pdm_partition_table_t *t);
int pdm_partition_table_save(const char *path, const pdm_partition_table_t *t);
/* Chunk sizes for `length` tokens: the exact entry (exact = 1), or the linear interpolation of
 * the fractions of the two nearest entries (the nearest one outside the table's range).
 * PDM_ENOTFOUND for an exact lookup that misses or an empty table. */
int pdm_partition_table_lookup(const pdm_partition_table_t *t, int length, int exact,
                               int *chunks);
/* Adds or replaces the entry for a length (entries stay sorted by length). */
int pdm_partition_table_put(pdm_partition_table_t *t, int length, const int *chunks,
                            double ttft, double ttft_cp);
/* Interpolated measured TTFTs of KVR (searched) and cp-kv at `length`; 0 where unknown. */
void pdm_partition_table_ttft(const pdm_partition_table_t *t, int length, double *kvr,
                              double *cp);

/* ---- One rank ------------------------------------------------------------------------- */

typedef struct {
    int threads;            /* compute threads of this rank */
    int ctx_tokens;         /* KV capacity (maximum P + T) */
    pdm_dtype_t kv_dtype;   /* F32, F16 or I8 (q8, per-head scales all-reduced per layer):
                             * cache and wire format */
    double timeout;         /* seconds per communication step */
} pdm_prefill_rank_params_t;

void pdm_prefill_rank_params_default(pdm_prefill_rank_params_t *p);

typedef struct pdm_prefill_rank pdm_prefill_rank_t;

/* A rank of a group already connected (`group` stays owned by the caller and must outlive
 * the rank). */
int pdm_prefill_rank_create(const pdm_model_t *model, pdm_kvt_group_t *group,
                            const pdm_prefill_rank_params_t *p, pdm_prefill_rank_t **out);
void pdm_prefill_rank_destroy(pdm_prefill_rank_t *r);

/* Streaming of the KV a rank computes to a decode node, layer by layer as it becomes final
 * (kvtransfer.h, "KV streaming"). */
typedef struct {
    int peer;             /* kvt peer of the decode node */
    uint64_t request_id;
    uint32_t attempt;
    int max_in_flight;    /* blocks outstanding per rank (flow control) */
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
    const pdm_prefill_stream_t *stream; /* NULL: the KV stays on the group; else every rank
                                         * streams the KV of its new tokens and, for a
                                         * partial prefill, its runs of the cached prefix
                                         * (pdm_prefill_conv_prefix_runs) */
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
} pdm_prefill_result_t;

/* Runs the task. Validation errors (method cannot run this task on this group, lengths too
 * short, cache capacity) are reported before any communication, identically on every rank.
 * A communication failure fails the task (PDM_ETIMEOUT / PDM_EPEER) and resets the group's
 * conversation state; the rank stays usable for new tasks after the group is rebuilt. */
int pdm_prefill_rank_run(pdm_prefill_rank_t *r, const pdm_prefill_task_t *task,
                         pdm_prefill_result_t *res);

/* Conversation length the group holds (P for the next task). */
int32_t pdm_prefill_rank_seq_len(const pdm_prefill_rank_t *r);

/* Writes this rank's owned KV (all layers and heads, f32) at its positions into a KV file of
 * the whole conversation, creating it if needed; every rank of the group writes its own rows
 * into the same file. */
int pdm_prefill_rank_dump_kv(const pdm_prefill_rank_t *r, const char *path);

/* ---- KV files (full-cache dumps for comparison) ---------------------------------------- *
 * A 64-byte header: "PDMKV001", u32 n_layers, n_kv_heads, head_dim, n_tokens (little-endian),
 * zeros; then for each layer, for each kv head: K [n_tokens][head_dim] f32, then V. */
/* Reads a whole file; *data is [n_layers][n_kv_heads][2][n_tokens][head_dim] f32 (free()). */
int pdm_kvfile_read(const char *path, const pdm_model_hparams_t *hp, int32_t *n_tokens,
                    float **data);

/* ---- Method choice (auto) -------------------------------------------------------------- */

/* Calibration: achieved compute and link bandwidth, measured by pdmesh calibrate. */
typedef struct {
    double flops;     /* C: achieved FLOP/s of one rank on attention-heavy prefill */
    double bandwidth; /* BW: bytes/s between two ranks */
    double latency;   /* seconds per message */
} pdm_calibration_t;

int pdm_calibration_load(const char *path, pdm_calibration_t *c);
int pdm_calibration_save(const char *path, const pdm_calibration_t *c);

/* Resolves `method` for a task of T new tokens after P cached ones on `ranks` ranks: AUTO
 * becomes a concrete method, KVR methods get their chunk sizes (kvr-e even; kvr-s the table's
 * exact entry unless `explicit_chunks` is given; kvr-p interpolated). `table` and `calib` may
 * be NULL. `why` explains the choice. */
int pdm_prefill_resolve(pdm_prefill_method_t method, const pdm_model_hparams_t *hp, int ranks,
                        int32_t T, int32_t P, const int *explicit_chunks,
                        const pdm_partition_table_t *table, const pdm_calibration_t *calib,
                        pdm_prefill_method_t *out, int *chunks, int *has_chunks, char *why,
                        size_t why_size);

/* The context-parallelism paper's Alg. 1 with the All2All correction of Alg. 5 (§3.4):
 * pass-KV or pass-Q for T new tokens after P cached ones on n ranks. `why` receives a short
 * explanation. */
pdm_prefill_method_t pdm_prefill_choose_cp(const pdm_model_hparams_t *hp,
                                           const pdm_calibration_t *c, int n, int32_t T,
                                           int32_t P, char *why, size_t why_size);

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
} pdm_launch_params_t;

void pdm_launch_params_default(pdm_launch_params_t *p);

typedef struct pdm_launch pdm_launch_t;

/* Spawns the ranks, passes every rank the others' UCX addresses and waits until the group is
 * connected. On error every spawned process is stopped. */
int pdm_launch_start(const pdm_launch_params_t *p, pdm_launch_t **out);
/* Stops the ranks (quit, then SIGKILL after a grace period) and reaps them. */
void pdm_launch_stop(pdm_launch_t *l);
/* The same, and PDM_EPEER unless every process exited with status 0 after "quit" (a crash,
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
    int32_t cached;      /* prompt tokens reused from the group's cache (reuse_prefix) */
    char *offload_json;  /* malloc'd: the decode node's head-wise offload report, or NULL */
    double prefill_wait; /* max over ranks of time blocked in communication (streaming too) */
    char *beam_json;     /* malloc'd, beam search only: {"n_best":[...],"beam":{...}} as the
                          * decode node reported them; else NULL */
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

#endif /* PDM_PREFILL_H */
