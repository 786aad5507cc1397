/*
 * plan.h - the prefill planner: which method, which split, who computes which tokens.
 *
 * Pure functions over plain data: no I/O, no UCX, no model weights (only the model's
 * hyperparameters). The router, the launcher and every rank call the same functions, so they
 * all derive the same plan from the same inputs without exchanging it.
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
 *   auto    chosen by the cost model (pdm_prefill_resolve).
 *
 * The conversation a group holds between tasks, and where a follow-up turn starts, are in
 * conv.h; the files the planner reads (partition tables, calibration) in plan_io.h.
 */
#ifndef PDM_PREFILL_PLAN_H
#define PDM_PREFILL_PLAN_H

#include <stddef.h>
#include <stdint.h>

#include "model/model.h" /* pdm_model_hparams_t only */

/* Most ranks of a group. Equal to PDM_KVT_MAX_RANKS (checked in prefill_internal.h), spelled
 * here so that the planner does not depend on kvtransfer. */
#define PDM_PREFILL_MAX_RANKS 64

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

/* "single", "tsp", ...; "?" for a value outside the enum. */
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

/* The ranges as the protocol's TokenRange messages (DecodeTask.ranges, Usage.prefill_ranges):
 * fills msgs[0..n) and ptrs[0..n) (ptrs[i] = &msgs[i]), both the caller's. */
struct Pdmesh__TokenRange;
void pdm_prefill_ranges_to_wire(const pdm_prefill_range_t *ranges, int n,
                                struct Pdmesh__TokenRange *msgs, struct Pdmesh__TokenRange **ptrs);

/* Delta transfer (PrefillTask.stream_from, DecodeTask.pool_prefix): cuts every range to its
 * rows at or after `from`, in place; a range wholly before it keeps its rank and chunk with
 * len 0 (streamed by nobody, planned by nobody). The ranks (what they send) and the router (the
 * decode node's plan) cut with this one function, so the blocks sent and expected agree.
 * Returns the rows left. */
int32_t pdm_prefill_ranges_clip(pdm_prefill_range_t *ranges, int n, int32_t from);

#define PDM_PREFILL_MAX_RANGES (2 * PDM_PREFILL_MAX_RANKS)

/* The formation of a group (PrefillTask.formation): an XXH64 of its size and every rank's UCX
 * address in rank order (addrs[i] = data, lens[i] = bytes, as a GroupWire lists them); never
 * 0. The router, which wires the group, and its rank 0, which checks each task, compute it
 * alike. */
uint64_t pdm_prefill_formation(const void *const *addrs, const size_t *lens, int n);

/* The ranges of [start, start + n) in position order: single: one range on rank 0; tsp:
 * `chunks[r]` on rank r; kvr-*: `chunks[c]` in chain order on rank (head + c) mod R; cp-*:
 * 2N even chunks, chunk c on rank c < N ? c : 2N-1-c (context parallelism §3.5.1). Returns the
 * number of ranges (empty ones included). */
int pdm_prefill_plan_ranges(pdm_prefill_method_t m, int ranks, int32_t start, int32_t n,
                            const int *chunks, int head, pdm_prefill_range_t *out);

/* ---- Partition lookup table (KV-Runahead §4.2, Fig. 10) ---------------------------------- *
 * For each known prompt length the searched chunk sizes as fractions of the length, with the
 * TTFTs measured there. Filled by the partition search (partition_search.h), stored as JSON
 * (plan_io.h), loaded by the router. */
typedef struct {
    int ranks;
    int n_entries;
    struct {
        int length;
        double frac[PDM_PREFILL_MAX_RANKS]; /* sums to 1 */
        double ttft;                        /* measured seconds at this partition */
        double ttft_cp; /* measured seconds of cp-kv at this length (0: none) */
    } entries[64];
} pdm_partition_table_t;

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

/* ---- Method choice (auto) -------------------------------------------------------------- */

/* Calibration: achieved compute and link bandwidth, measured by pdmesh calibrate. */
typedef struct {
    double flops;     /* C: achieved FLOP/s of one rank on attention-heavy prefill */
    double bandwidth; /* BW: bytes/s between two ranks */
    double latency;   /* seconds per message */
} pdm_calibration_t;

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

#endif /* PDM_PREFILL_PLAN_H */
