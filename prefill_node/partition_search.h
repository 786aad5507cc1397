/*
 * partition_search.h - KV-Runahead's context-level load balancing (KV-Runahead §4.2): the
 * search for the chunk sizes of a KVR chain that minimize the measured TTFT at one prompt
 * length. Its results fill the partition table (plan.h) that kvr-s looks up and kvr-p
 * interpolates (Fig. 10).
 *
 * The search measures real TTFTs through a callback, so the caller decides how a partition
 * is run (pdmesh partition-search: through the launcher, pdm_launch_task, median of a few
 * repetitions) and tests can hand it a synthetic cost.
 */
#ifndef PDM_PREFILL_PARTITION_SEARCH_H
#define PDM_PREFILL_PARTITION_SEARCH_H

/* Measures one partition: `chunks` holds `ranks` sizes >= 1 in chain order summing to the
 * prompt length. Returns the TTFT in seconds, or +inf if the run failed (the search then
 * treats the partition as infinitely slow and goes on). */
typedef double (*pdm_partition_measure_cb)(void *data, const int *chunks);

typedef struct {
    int ranks;                        /* chain length R (1..PDM_PREFILL_MAX_RANKS) */
    int n_tokens;                     /* prompt length n (>= ranks) */
    int min_stride;                   /* finest step of a boundary, in tokens (>= 1) */
    pdm_partition_measure_cb measure; /* called once per partition tried */
    void *data;                       /* passed to measure */
} pdm_partition_search_params_t;

/* KV-Runahead §4.2: starts from the even split; for two ranks a search on the single
 * boundary, narrowing towards the side where TTFT decreases (Fig. 6a); for more ranks a
 * hierarchical grid search over all boundaries with 5 (R <= 3) or 3 points per dimension,
 * zooming in around the best point with half the stride at every level until min_stride
 * (Fig. 6b-d). Writes the best chunk sizes found to `best` [ranks] and the number of
 * measurements to *evaluations; returns the best TTFT (+inf if no measurement succeeded;
 * `best` is then the even split). */
double pdm_partition_search(const pdm_partition_search_params_t *p, int *best,
                            int *evaluations);

#endif /* PDM_PREFILL_PARTITION_SEARCH_H */
