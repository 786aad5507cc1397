/*
 * Prometheus metrics of the router: counters, gauges and histograms with a fixed set of
 * labels each, rendered in the Prometheus text exposition format (version 0.0.4) for
 * GET /metrics. Single-threaded (the router loop); no allocation after registration except
 * for new label values, which are bounded per metric (PDM_METRICS_MAX_SERIES).
 *
 * Names used by the router (all prefixed pdmesh_):
 *   requests_total{outcome}               counter  ok, error, cancelled, deadline, overloaded, ...
 *   ttft_seconds                          histogram
 *   tpot_seconds                          histogram
 *   queue_depth                           gauge
 *   prefill_method_total{method}          counter
 *   kv_bytes_total                        counter
 *   kv_transfer_seconds                   histogram
 *   nodes{role,state}                     gauge
 *   migrations_total / retries_total      counter
 *   offload_bytes{node}                   gauge   (from heartbeats)
 *   requests_waiting{reason}              gauge   prefill, decode: what a QUEUED request lacks
 *   decode_kv_free_tokens                 gauge   usable decode nodes, budget - reserved
 *   decode_kv_capacity_tokens             gauge   usable decode nodes, budget
 *   prefill_inflight{group}               gauge
 *   prefill_inflight_limit                gauge   --group-inflight
 *   prefix_pool_lookups_total / hits_total counter decode-node prefix pools (docs/router.md)
 *   prefix_pool_misses_total{reason}      counter no_match, evicted, routed_elsewhere_load,
 *                                                 delta_over_local_max
 *   prefix_pool_cached_tokens_total       counter
 *   prefix_pool_hit_rate                  gauge
 *   prefix_pool_{tokens,bytes,blocks}{node} gauge (from the nodes' KvEvents)
 *   prefix_pool_corrupt_total{node}       counter pooled prefixes that failed their checksum
 *   kv_events_total{kind}                 counter stored, evicted, reset, stale, malformed
 *   kv_index_blocks                       gauge   block keys in the global index
 */
#ifndef PDM_METRICS_H
#define PDM_METRICS_H

#include <stddef.h>

#define PDM_METRICS_MAX_SERIES 64

typedef struct pdm_metrics pdm_metrics_t;
typedef struct pdm_metric pdm_metric_t;

typedef enum { PDM_METRIC_COUNTER, PDM_METRIC_GAUGE, PDM_METRIC_HISTOGRAM } pdm_metric_kind_t;

pdm_metrics_t *pdm_metrics_create(void);
void pdm_metrics_free(pdm_metrics_t *m);

/* Registers a metric. label_name may be NULL (no label). buckets/n_buckets only for
 * histograms (upper bounds, increasing; +Inf is implicit). Returns NULL on a bad argument. */
pdm_metric_t *pdm_metrics_add(pdm_metrics_t *m, pdm_metric_kind_t kind, const char *name,
                              const char *help, const char *label_name, const double *buckets,
                              size_t n_buckets);

/* label_value: NULL when the metric has no label. Over PDM_METRICS_MAX_SERIES label values,
 * new ones are folded into label value "other". */
void pdm_metric_inc(pdm_metric_t *x, const char *label_value, double by);  /* counter, gauge */
void pdm_metric_set(pdm_metric_t *x, const char *label_value, double v);   /* gauge */
void pdm_metric_observe(pdm_metric_t *x, const char *label_value, double v); /* histogram */

/* Renders every metric; returns a malloc'ed NUL-terminated text (NULL on allocation failure). */
char *pdm_metrics_render(const pdm_metrics_t *m, size_t *len);

#endif
