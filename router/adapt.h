/*
 * adapt.h - load-adaptive parallelism (router/adapt.c): per request, the whole prefill group
 * for one prompt (KV-Runahead / context parallelism: the lowest TTFT for that prompt) or one
 * idle rank of the group alone, a "solo" task (the engine's single-rank prefill: R prompts
 * at once, the highest throughput). Pure: no I/O, no router state; schedule.c feeds it.
 *
 * The cost model. One rank prefills n tokens in
 *     t1(n) = a_solo * F(n) / C + b_solo
 * with F(n) the FLOPs of a single-rank prefill exactly as `pdmesh calibrate` counts them
 * (cli/prefill_cmds.c; bench/sim/sim.py prefill_flops) - projections and FFN, 2 FLOP per
 * multiply-add per token, plus 4 * head_dim FLOP per causal query-key pair per head - and C
 * the calibrated FLOP/s of one rank (docs/perf/calibration.json). The whole group of R ranks
 * takes
 *     tR(n) = a_group * (F(n) / (R C) + L * (R - 1) * max(0, t_kv - t_step)) + b_group
 * the compute split R ways plus pass-KV's exposed ring communication per layer
 * (context-parallelism seed §3.5.2, Eq. 2: a step's SendRecv of n/R rows of K and V, f16,
 * hides under that step's attention of n/R queries against n/R keys when it is shorter;
 * t_kv = latency + bytes / bandwidth from the calibration). a and b correct the bare model
 * (a = 1, b = 0) by what the router measures: a least-squares line through the recent
 * (prediction, PrefillResult.seconds) pairs of each kind, older pairs weighing less, so both
 * a machine slower than its calibration (a) and the fixed cost of a task (b: the ranks' per
 * layer synchronisation, which the calibrated latency of one message understates, and which
 * makes short prompts scale worst) are learned. They start from a prior line: a_solo = 1,
 * b_solo = 0; a_group = 1 / 0.75, the parallel efficiency of R = 2 measured at 1024 tokens on
 * the reference machine (docs/perf/prefill.md: 0.71 cp-kv, 0.76 KVR-S; KV-Runahead's bound
 * TTFT*(p) of eq. 2-3 is below what real prompts reach), b_group = 20 ms. While only one
 * kind has been measured, the other follows it through that prior efficiency (a_solo =
 * 0.75 a_group, or a_group = a_solo / 0.75): the calibration's C can be far from the
 * machine's speed under load, and a kind never chosen would otherwise never be measured.
 *
 * The decision (rt_adapt_decide) compares two ways of serving the queue as it stands - this
 * request first, then the requests waiting behind it for a group - and takes the one with
 * the smaller sum of completion times (mean TTFT):
 *   group: every prompt in turn on the whole group, from when every rank is free;
 *   solo:  every prompt on the rank that is free first (list scheduling).
 * With W equal prompts on R = 2 ranks of parallel efficiency e = t1 / (2 tR), solo wins iff
 * e < (W + 1) / (W + 2): for two below e = 0.75, for many below 1. A lone request on an idle
 * group always gets the whole group. A choice that cannot start now (group while a rank is
 * busy with a solo task; solo while no rank is idle) is WAIT.
 *
 * The queue rule (RT_ADAPT_QUEUE, --adaptive-group 2) leaves the cost model out: a request
 * with others waiting behind it, or arriving while a solo task runs, goes to an idle rank
 * alone; one alone in the queue goes to the whole group. Predictable (tests use it), but it
 * splits the group even where the group would serve the queue sooner.
 */
#ifndef PDM_ROUTER_ADAPT_H
#define PDM_ROUTER_ADAPT_H

#include <stdint.h>

#include "model/model.h"
#include "prefill_node/plan.h"

/* Requests of the queue the decision looks at, at most. */
#define RT_ADAPT_MAX_QUEUE 32

typedef struct {
    int ranks;                 /* R: ranks of the group */
    double layers;             /* L */
    double linear_per_token;   /* FLOPs of the projections and FFN per token, all layers */
    double attn_per_pair;      /* FLOPs per causal query-key pair, all heads and layers */
    double kv_bytes_per_token; /* one layer's K and V of one token on the wire (f16) */
    double attn_per_pair_layer; /* attn_per_pair / L */
    double flops;              /* C: FLOP/s of one rank */
    double bandwidth, latency; /* link between ranks: bytes/s, seconds per message */
    /* measured = a * predicted + b: weighted least squares over (x, y) = (bare prediction,
     * measured seconds), sums decayed by RT_ADAPT_DECAY per measurement */
    struct rt_adapt_fit {
        double s0, sx, sy, sxx, sxy;
        double a, b;
        int measured;          /* measurements folded in (0: the prior line) */
    } solo, group;
} rt_adapt_cost_t;

#define RT_ADAPT_DECAY 0.9

/* The model for a group of `ranks` ranks: shapes from hp, rates from calib (NULL: this
 * machine kind's defaults, 30.8 GFLOP/s, 2.5 GB/s, 5 us). */
void rt_adapt_cost_init(rt_adapt_cost_t *c, const pdm_model_hparams_t *hp, int ranks,
                        const pdm_calibration_t *calib);
/* Predicted seconds of a solo prefill of n tokens, and of a whole-group prefill of n new
 * tokens after `cached` ones (partial prefill: the new rows attend to all n + cached keys). */
double rt_adapt_t1(const rt_adapt_cost_t *c, int32_t n);
double rt_adapt_tR(const rt_adapt_cost_t *c, int32_t n, int32_t cached);
/* Folds a measured prefill (seconds it took on its ranks) into the solo (solo = 1) or group
 * line; a in [0.1, 20], b in [0, 5] s. */
void rt_adapt_learn(rt_adapt_cost_t *c, int solo, int32_t n, int32_t cached, double seconds);

typedef enum { RT_ADAPT_WAIT = 0, RT_ADAPT_GROUP, RT_ADAPT_SOLO } rt_adapt_choice_t;

/* --adaptive-group: 0 off, 1 the cost model, 2 the queue rule */
typedef enum { RT_ADAPT_OFF = 0, RT_ADAPT_COST = 1, RT_ADAPT_QUEUE = 2 } rt_adapt_rule_t;

typedef struct {
    const double *busy;       /* [ranks] seconds until each rank is free; 0 exactly when it
                               * holds no task (the caller keeps a busy rank above 0) */
    int group_ok;             /* a whole-group task may be sent now (no solo task in flight,
                               * below the group's task limit) */
    const int32_t *queue;     /* [n_queue] prompt lengths: this request, then those behind it */
    int n_queue;              /* 1..RT_ADAPT_MAX_QUEUE (more are ignored) */
    int32_t head_cached;      /* tokens of queue[0] the group would reuse (partial prefill) */
    rt_adapt_rule_t rule;     /* COST (0 taken as COST) or QUEUE */
} rt_adapt_input_t;

/* The choice for queue[0]: GROUP, SOLO with *rank the idle rank to use, or WAIT. *cost_group
 * and *cost_solo (either may be NULL) receive the two plans' sums of completion times. */
rt_adapt_choice_t rt_adapt_decide(const rt_adapt_cost_t *c, const rt_adapt_input_t *in,
                                  int *rank, double *cost_group, double *cost_solo);

#endif
