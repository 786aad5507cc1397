/*
 * adapt.c - load-adaptive parallelism: the cost model and the group-or-solo decision
 * (adapt.h has the formulas and the rule).
 */
#include "router/adapt.h"

#include "common/pdm.h"

/* The prior parallel efficiency of the group (docs/perf/prefill.md, R = 2, 1024 tokens). */
#define RT_ADAPT_E0 0.75

void rt_adapt_cost_init(rt_adapt_cost_t *c, const pdm_model_hparams_t *hp, int ranks,
                        const pdm_calibration_t *calib)
{
    const double d = hp->d_model, hd = hp->head_dim, nh = hp->n_heads, nkv = hp->n_kv_heads;
    c->ranks = ranks < 1 ? 1 : ranks;
    c->layers = hp->n_layers;
    /* pdmesh calibrate's count (cli/prefill_cmds.c prefill_flops) */
    c->linear_per_token = hp->n_layers * 2 * (d * nh * hd * 2 + d * nkv * hd * 2 + 3 * d * hp->n_ff);
    c->attn_per_pair_layer = 4 * hd * nh;
    c->attn_per_pair = hp->n_layers * c->attn_per_pair_layer;
    c->kv_bytes_per_token = nkv * hd * 2 * 2;
    c->flops = calib && calib->flops > 0 ? calib->flops : 30.8e9;
    c->bandwidth = calib && calib->bandwidth > 0 ? calib->bandwidth : 2.5e9;
    c->latency = calib && calib->latency > 0 ? calib->latency : 5e-6;
    /* the prior lines, as two pseudo-measurements each, at 0.1 s and 1 s of prediction */
    const double prior[2][2] = {{1.0, 0.0}, {1.0 / RT_ADAPT_E0, 0.02}};
    struct rt_adapt_fit *f[2] = {&c->solo, &c->group};
    for (int k = 0; k < 2; k++) {
        *f[k] = (struct rt_adapt_fit){.a = prior[k][0], .b = prior[k][1]};
        for (double x = 0.1; x < 2; x *= 10) {
            const double y = prior[k][0] * x + prior[k][1];
            f[k]->s0 += 1;
            f[k]->sx += x;
            f[k]->sy += y;
            f[k]->sxx += x * x;
            f[k]->sxy += x * y;
        }
    }
}

/* FLOPs of n new tokens after `cached` ones: causal pairs sum_{i=cached}^{cached+n-1} (i+1). */
static double rt_adapt__flops(const rt_adapt_cost_t *c, double n, double cached)
{
    const double pairs = n * cached + n * (n + 1) / 2;
    return c->linear_per_token * n + c->attn_per_pair * pairs;
}

/* The bare models (a = 1, b = 0). */
static double rt_adapt__t1(const rt_adapt_cost_t *c, int32_t n)
{
    return rt_adapt__flops(c, n, 0) / c->flops;
}

static double rt_adapt__tR(const rt_adapt_cost_t *c, int32_t n, int32_t cached)
{
    const double R = c->ranks;
    double t = rt_adapt__flops(c, n, cached) / (R * c->flops);
    if (c->ranks > 1) {
        /* pass-KV (context parallelism §3.5.2): per layer R - 1 ring steps, each sending a
         * block of (n + cached) / R rows of K and V while attending n / R queries to it. */
        const double rows = ((double)n + cached) / R, q_rows = (double)n / R;
        const double t_kv = c->latency + rows * c->kv_bytes_per_token / c->bandwidth;
        const double t_step = c->attn_per_pair_layer * q_rows * rows / c->flops;
        t += c->layers * (R - 1) * PDM_MAX(0.0, t_kv - t_step);
    }
    return t;
}

double rt_adapt_t1(const rt_adapt_cost_t *c, int32_t n)
{
    if (!c->solo.measured && c->group.measured) /* scaled from the group's line */
        return RT_ADAPT_E0 * c->group.a * rt_adapt__t1(c, n);
    return c->solo.a * rt_adapt__t1(c, n) + c->solo.b;
}

double rt_adapt_tR(const rt_adapt_cost_t *c, int32_t n, int32_t cached)
{
    if (!c->group.measured && c->solo.measured)
        return c->solo.a / RT_ADAPT_E0 * rt_adapt__tR(c, n, cached) + 0.02;
    return c->group.a * rt_adapt__tR(c, n, cached) + c->group.b;
}

void rt_adapt_learn(rt_adapt_cost_t *c, int solo, int32_t n, int32_t cached, double seconds)
{
    if (!(seconds > 0) || n < 1) return;
    struct rt_adapt_fit *f = solo ? &c->solo : &c->group;
    const double x = solo ? rt_adapt__t1(c, n) : rt_adapt__tR(c, n, cached), y = seconds;
    const double w = RT_ADAPT_DECAY;
    f->s0 = w * f->s0 + 1;
    f->sx = w * f->sx + x;
    f->sy = w * f->sy + y;
    f->sxx = w * f->sxx + x * x;
    f->sxy = w * f->sxy + x * y;
    const double den = f->s0 * f->sxx - f->sx * f->sx;
    double a = den > 1e-12 * f->s0 * f->sxx ? (f->s0 * f->sxy - f->sx * f->sy) / den
                                             : (f->sx > 0 ? f->sy / f->sx : f->a);
    a = PDM_MIN(20.0, PDM_MAX(0.1, a));
    /* the intercept for that slope, never negative: a slope fitted to noise then gives way
     * to the line through the origin */
    double b = (f->sy - a * f->sx) / f->s0;
    if (b < 0) {
        b = 0;
        a = PDM_MIN(20.0, PDM_MAX(0.1, f->sxy / f->sxx));
    }
    f->a = a;
    f->b = PDM_MIN(5.0, b);
    f->measured++;
}

rt_adapt_choice_t rt_adapt_decide(const rt_adapt_cost_t *c, const rt_adapt_input_t *in,
                                  int *rank, double *cost_group, double *cost_solo)
{
    const int R = c->ranks, nq = PDM_MIN(in->n_queue, RT_ADAPT_MAX_QUEUE);
    double free_at[PDM_PREFILL_MAX_RANKS], start = 0;
    for (int k = 0; k < R; k++) {
        free_at[k] = in->busy[k];
        start = PDM_MAX(start, in->busy[k]);
    }
    /* group: one prompt after another on all ranks, once all are free */
    double t = start, sum_group = 0;
    for (int i = 0; i < nq; i++) {
        const int32_t cached = i == 0 ? in->head_cached : 0;
        t += rt_adapt_tR(c, in->queue[i] - cached, cached);
        sum_group += t;
    }
    /* solo: each prompt on the rank free first */
    double sum_solo = 0;
    int first = -1;
    for (int i = 0; i < nq; i++) {
        int best = 0;
        for (int k = 1; k < R; k++)
            if (free_at[k] < free_at[best]) best = k;
        free_at[best] += rt_adapt_t1(c, in->queue[i]);
        sum_solo += free_at[best];
        if (i == 0) first = best;
    }
    if (cost_group) *cost_group = sum_group;
    if (cost_solo) *cost_solo = sum_solo;
    if (in->rule == RT_ADAPT_QUEUE) {
        /* others wait, or a solo task runs: an idle rank alone; else the whole group */
        if (R < 2 || (nq < 2 && in->group_ok)) return in->group_ok ? RT_ADAPT_GROUP : RT_ADAPT_WAIT;
        for (int k = 0; k < R; k++)
            if (in->busy[k] == 0) {
                *rank = k;
                return RT_ADAPT_SOLO;
            }
        return RT_ADAPT_WAIT;
    }
    /* a lone request on an idle group: the whole group, even where one rank would be as fast
     * (a short prompt: that is the decode node's local threshold to judge) */
    int all_idle = 1;
    for (int k = 0; k < R; k++) all_idle &= in->busy[k] == 0;
    if (nq <= 1 && all_idle && in->group_ok) return RT_ADAPT_GROUP;
    if (R > 1 && nq > 0 && sum_solo < sum_group) {
        if (in->busy[first] > 0) return RT_ADAPT_WAIT;
        *rank = first;
        return RT_ADAPT_SOLO;
    }
    return in->group_ok ? RT_ADAPT_GROUP : RT_ADAPT_WAIT;
}
