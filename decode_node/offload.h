/*
 * offload.h - head-wise KV offload for the decode node (HeadInfer §3-4, Alg. 1, App. A.3).
 *
 * KV is placed per (layer, kv head) in one of two tiers:
 *   - the fast tier: a byte budget (a RAM arena in CPU builds; device memory in a CUDA build,
 *     which plugs in through pdm_kvtier_ops_t);
 *   - the slow tier: RAM, or an mmap'd file under a directory (--kv-slow-tier file:DIR).
 * Heads that fit the budget stay resident in the fast tier (HeadInfer's H_on); the others live
 * in the slow tier (H_off) and attention walks them in groups of G heads: while one group
 * computes from one half of a ping-pong buffer in the fast tier, a worker thread prefetches the
 * next group into the other half and writes the previous group's new KV row back to the slow
 * tier (Alg. 1 lines 25-26, Fig. 4). G adapts to the context length (App. D "adaptive head
 * grouping"): all heads of a layer for short contexts, down to one head for the longest.
 *
 * A store's `cache` is an ordinary head-major pdm_kv_cache_t whose per-head pointers are the
 * heads' final homes (fast or slow), so KV received from the prefill ranks, or prefilled
 * locally, lands directly in its final tier.
 */
#ifndef PDM_OFFLOAD_H
#define PDM_OFFLOAD_H

#include <stddef.h>
#include <stdint.h>

#include "model/model.h"

/* ---- Tiers -------------------------------------------------------------------------------- */

typedef struct pdm_kvtier pdm_kvtier_t;

/* What a tier backend provides. The CPU backends (RAM arena, mmap'd file) copy with memcpy; a
 * CUDA backend would allocate with cudaMalloc / cudaHostAlloc and copy on a copy stream. */
typedef struct {
    const char *name;
    int (*alloc)(pdm_kvtier_t *t, size_t bytes, void **out);
    void (*release)(pdm_kvtier_t *t, void *p, size_t bytes);
    /* Copies between any two tiers' memory (host-visible in CPU builds). */
    void (*copy)(void *dst, const void *src, size_t bytes);
} pdm_kvtier_ops_t;

typedef struct {
    int64_t budget;   /* bytes; 0: unbounded */
    int64_t used;     /* bytes allocated now */
    int64_t peak;     /* most bytes ever allocated at once */
    int64_t allocs;   /* allocations made */
    int64_t refused;  /* allocations refused for the budget */
} pdm_kvtier_stats_t;

/* spec: "ram" or "file:DIR" (an unlinked file per allocation under DIR, mmap'd shared).
 * budget: bytes, 0 for none. PDM_EINVAL for a bad spec. */
int pdm_kvtier_create(const char *spec, int64_t budget, pdm_kvtier_t **out);
/* A tier over another backend (decode_node/offload_cuda.cu: device memory and pinned host
 * memory; the engine uses RAM tiers until the CUDA engine keeps activations on the device). */
int pdm_kvtier_create_ops(const pdm_kvtier_ops_t *ops, int64_t budget, pdm_kvtier_t **out);
#ifdef PDM_WITH_CUDA
const pdm_kvtier_ops_t *pdm_kvtier_cuda_device_ops(void); /* cudaMalloc'd fast tier */
const pdm_kvtier_ops_t *pdm_kvtier_cuda_host_ops(void);   /* pinned host slow tier */
#endif
void pdm_kvtier_destroy(pdm_kvtier_t *t);
/* PDM_EOVERFLOW (nothing allocated) when `bytes` would take the tier past its budget. */
int pdm_kvtier_alloc(pdm_kvtier_t *t, size_t bytes, void **out);
void pdm_kvtier_free(pdm_kvtier_t *t, void *p, size_t bytes);
void pdm_kvtier_stats(const pdm_kvtier_t *t, pdm_kvtier_stats_t *st);
const char *pdm_kvtier_name(const pdm_kvtier_t *t);

/* ---- Offload engine (one per decode node) ------------------------------------------------ */

#define PDM_KVOFF_MAX_STEPS 8

typedef struct {
    int64_t fast_budget;    /* bytes of the fast tier (> 0) */
    const char *slow_tier;  /* "ram" or "file:DIR" */
    /* Group size by context (capacity) length: the first i with capacity <= group_ctx[i]
     * gives group_size[i]; 0 in group_size[i] means "all kv heads of a layer". Beyond the
     * last threshold the group is one head. Defaults from bench/decode-memory (docs). */
    int32_t group_ctx[PDM_KVOFF_MAX_STEPS];
    int32_t group_size[PDM_KVOFF_MAX_STEPS];
    int n_steps;
    int force_group;        /* > 0: this group size at every context (tests, benchmarks) */
    int no_resident;        /* 1: offload every head (layer-wise / head-wise placements of
                             * `pdmesh plan`, benchmarks); 0: keep what fits resident */
    double wait_timeout;    /* seconds any wait on the copy worker may take */
    double resident_share;  /* a store keeps heads resident only within this share of the
                             * fast tier's free bytes (its ping-pong buffer may use the rest),
                             * so later sequences still find room; 1: greedy. Default 0.5 */
} pdm_kvoff_params_t;

void pdm_kvoff_params_default(pdm_kvoff_params_t *p);
/* Parses "CTX:G,CTX:G,..." (G = 0 for all heads) into the group steps. */
int pdm_kvoff_parse_groups(const char *s, pdm_kvoff_params_t *p);
/* The group size the policy picks for `capacity` tokens with `n_kv_heads` heads per layer. */
int pdm_kvoff_group_for(const pdm_kvoff_params_t *p, int32_t capacity, uint32_t n_kv_heads);

typedef struct pdm_kvoff_engine pdm_kvoff_engine_t;

typedef struct {
    pdm_kvtier_stats_t fast, slow;
    int64_t stores;           /* stores created */
    int64_t resident_heads;   /* (layer, head) arrays placed in the fast tier, all stores */
    int64_t offloaded_heads;  /* ... in the slow tier */
    int64_t prefetches;       /* group prefetch jobs */
    int64_t prefetch_bytes;   /* bytes copied slow -> fast */
    int64_t writeback_bytes;  /* bytes copied fast -> slow */
    int64_t prefetch_waits;   /* times attention had to block for a prefetch */
    double wait_seconds;      /* time blocked in those waits */
    int last_group;           /* group size of the last store placed */
} pdm_kvoff_stats_t;

int pdm_kvoff_engine_create(const pdm_kvoff_params_t *p, pdm_kvoff_engine_t **out);
/* Stops the worker; every store must have been destroyed. */
void pdm_kvoff_engine_destroy(pdm_kvoff_engine_t *e);
void pdm_kvoff_engine_stats(pdm_kvoff_engine_t *e, pdm_kvoff_stats_t *st);
const pdm_kvoff_params_t *pdm_kvoff_engine_params(const pdm_kvoff_engine_t *e);

/* The statistics as a cJSON object (returned as void * so this header needs no cJSON):
 * fast_budget, fast_bytes, fast_peak, slow_tier, slow_bytes, slow_peak, resident_heads,
 * offloaded_heads, group, prefetches, prefetch_bytes, writeback_bytes, prefetch_waits,
 * wait_seconds. NULL when out of memory. */
void *pdm_kvoff_stats_json(const pdm_kvoff_stats_t *st, const pdm_kvoff_params_t *p);

/* ---- Per-sequence store ---------------------------------------------------------------- */

typedef struct pdm_kvoff pdm_kvoff_t;

/* Places a sequence of `capacity` tokens: every head resident when the whole KV fits the fast
 * tier's free bytes (and no_resident is 0); else a ping-pong buffer of 2 x G heads plus as many
 * resident heads as fit, the rest in the slow tier. PDM_EOVERFLOW when not even the ping-pong
 * buffer of one head fits. */
int pdm_kvoff_create(pdm_kvoff_engine_t *e, const pdm_model_hparams_t *hp, int32_t capacity,
                     pdm_dtype_t dtype, pdm_kvoff_t **out);
/* Waits (bounded) for the worker to finish with the store, then frees it. */
void pdm_kvoff_destroy(pdm_kvoff_t *s);
/* Waits (bounded) until every copy queued for the store has landed: after it, every head's
 * home holds all rows up to cache->n_tokens. */
int pdm_kvoff_sync(pdm_kvoff_t *s);
/* The store's head-major cache: its per-head pointers are the heads' homes. */
pdm_kv_cache_t *pdm_kvoff_cache(pdm_kvoff_t *s);
/* Placement of the store: group size, resident heads, bytes in each tier. */
void pdm_kvoff_placement(const pdm_kvoff_t *s, int *group, int *resident, int64_t *fast_bytes,
                         int64_t *slow_bytes);

/* One layer of one decode row (act->n == 1, at slot cache->n_tokens): stores the row's new K/V
 * (resident heads at home, offloaded heads in their ping-pong half, written back by the
 * worker) and computes attention over the cache plus the new row, group by group. The result
 * is bit-identical to pdm_model_kv_store + pdm_model_attention on an all-resident cache.
 * PDM_ETIMEOUT when the worker does not deliver within the timeout. */
int pdm_kvoff_attention(pdm_kvoff_t *s, pdm_model_ctx_t *ctx, int layer, pdm_act_t *row);

/* ---- Memory plan (HeadInfer App. A.3) ---------------------------------------------------- */

typedef struct {
    const char *name;        /* "all-resident", "layer-wise", "head-wise", "head-wise+resident" */
    int group;               /* heads per group (0: not applicable) */
    int64_t kv_fast;         /* KV bytes in the fast tier */
    int64_t kv_slow;         /* KV bytes in the slow tier */
    int64_t weights;         /* model weight bytes (all placements keep them in the fast tier) */
    int64_t act_prefill;     /* peak prefill activation bytes (whole prompt in one chunk) */
    int64_t act_chunked;     /* same with chunked prefill of `chunk` tokens */
    int64_t act_decode;      /* decode activation bytes for `beams` rows */
} pdm_kvplan_row_t;

/* Predicts the placements for a context of `context` tokens and `beams` sequences sharing the
 * fast tier. fast_budget > 0 adds the head-wise placement with resident heads under that
 * budget (as pdm_kvoff_create would place it) when the sequences fit it. Row bytes follow the allocator exactly
 * (64-byte aligned head arrays), so a test compares them with the tier peaks. Fills up to 4
 * rows, returns how many. */
int pdm_kvplan(const pdm_model_t *m, int32_t context, int beams, int64_t fast_budget,
               int chunk, pdm_dtype_t dtype, const pdm_kvoff_params_t *p,
               pdm_kvplan_row_t rows[4]);

#endif /* PDM_OFFLOAD_H */
