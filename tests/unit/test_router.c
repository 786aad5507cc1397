/*
 * test_router.c - the router's Prometheus registry (router/metrics.c) and the decode node's
 * local prefill (what the router uses for short prompts and migration). The router itself is
 * tested with real processes in tests/integration/run.sh.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/pdm.h"
#include "decode_node/decode.h"
#include "kvtransfer/kvtransfer.h"
#include "router/adapt.h"
#include "router/batch.h"
#include "router/features.h"
#include "router/metrics.h"
#include "tests.h"

START_TEST(test_metrics_render)
{
    pdm_metrics_t *m = pdm_metrics_create();
    ck_assert_ptr_nonnull(m);
    static const double b[] = {0.1, 1};
    pdm_metric_t *c = pdm_metrics_add(m, PDM_METRIC_COUNTER, "pdmesh_requests_total", "Requests.",
                                      "outcome", NULL, 0);
    pdm_metric_t *g = pdm_metrics_add(m, PDM_METRIC_GAUGE, "pdmesh_queue_depth", "Queue.", NULL,
                                      NULL, 0);
    pdm_metric_t *h = pdm_metrics_add(m, PDM_METRIC_HISTOGRAM, "pdmesh_ttft_seconds", "TTFT.",
                                      NULL, b, 2);
    ck_assert_ptr_nonnull(c);
    ck_assert_ptr_nonnull(g);
    ck_assert_ptr_nonnull(h);
    /* bad registrations */
    ck_assert_ptr_null(pdm_metrics_add(m, PDM_METRIC_GAUGE, "pdmesh_queue_depth", "dup", NULL, NULL, 0));
    ck_assert_ptr_null(pdm_metrics_add(m, PDM_METRIC_GAUGE, "bad name", "x", NULL, NULL, 0));
    static const double nb[] = {1, 0.5};
    ck_assert_ptr_null(pdm_metrics_add(m, PDM_METRIC_HISTOGRAM, "h2", "x", NULL, nb, 2));
    pdm_metric_inc(c, "ok", 2);
    pdm_metric_inc(c, "ok", 1);
    pdm_metric_inc(c, "err\"x", 1);
    pdm_metric_inc(c, "ok", -5); /* counters never go down */
    pdm_metric_set(g, NULL, 7);
    pdm_metric_observe(h, NULL, 0.05);
    pdm_metric_observe(h, NULL, 0.5);
    pdm_metric_observe(h, NULL, 5);
    size_t len;
    char *t = pdm_metrics_render(m, &len);
    ck_assert_ptr_nonnull(t);
    ck_assert_uint_eq(len, strlen(t));
    ck_assert_ptr_nonnull(strstr(t, "# TYPE pdmesh_requests_total counter\n"));
    ck_assert_ptr_nonnull(strstr(t, "pdmesh_requests_total{outcome=\"ok\"} 3\n"));
    ck_assert_ptr_nonnull(strstr(t, "pdmesh_requests_total{outcome=\"err\\\"x\"} 1\n"));
    ck_assert_ptr_nonnull(strstr(t, "pdmesh_queue_depth 7\n"));
    ck_assert_ptr_nonnull(strstr(t, "pdmesh_ttft_seconds_bucket{le=\"0.10000000000000001\"} 1\n"));
    ck_assert_ptr_nonnull(strstr(t, "pdmesh_ttft_seconds_bucket{le=\"1\"} 2\n"));
    ck_assert_ptr_nonnull(strstr(t, "pdmesh_ttft_seconds_bucket{le=\"+Inf\"} 3\n"));
    ck_assert_ptr_nonnull(strstr(t, "pdmesh_ttft_seconds_count 3\n"));
    ck_assert_ptr_nonnull(strstr(t, "pdmesh_ttft_seconds_sum 5.5499999999999998\n"));
    free(t);
    pdm_metrics_free(m);
}
END_TEST

START_TEST(test_metrics_series_bound)
{
    pdm_metrics_t *m = pdm_metrics_create();
    pdm_metric_t *c = pdm_metrics_add(m, PDM_METRIC_COUNTER, "x_total", "x", "node", NULL, 0);
    char name[32];
    for (int i = 0; i < 3 * PDM_METRICS_MAX_SERIES; i++) {
        snprintf(name, sizeof(name), "n%d", i);
        pdm_metric_inc(c, name, 1);
    }
    char *t = pdm_metrics_render(m, NULL);
    ck_assert_ptr_nonnull(strstr(t, "x_total{node=\"other\"} "));
    size_t lines = 0;
    for (char *p = t; *p; p++) lines += *p == '\n';
    ck_assert_uint_le(lines, PDM_METRICS_MAX_SERIES + 3);
    free(t);
    pdm_metrics_free(m);
}
END_TEST

/* ---- decode node: local prefill (conditional disaggregation, migration) ---------------- */

typedef struct {
    int32_t toks[64];
    int n, done;
    char finish[16];
} local_events_t;

static void local_cb(void *arg, const pdm_decode_event_t *ev)
{
    local_events_t *e = arg;
    if (ev->type == PDM_DECODE_EV_TOKEN && e->n < 64) e->toks[e->n++] = ev->token;
    if (ev->type == PDM_DECODE_EV_DONE) {
        e->done = 1;
        snprintf(e->finish, sizeof(e->finish), "%s", ev->finish);
    }
    if (ev->type == PDM_DECODE_EV_ERROR) e->done = -1;
}

/* The DONE event of a beam search: the best hypothesis and the size of the n-best list. */
typedef struct {
    int32_t toks[64];
    int n, done, n_hyps;
} beam_events_t;

static void beam_cb(void *arg, const pdm_decode_event_t *ev)
{
    beam_events_t *e = arg;
    if (ev->type == PDM_DECODE_EV_TOKEN) e->done = -2; /* a beam search streams nothing */
    if (ev->type == PDM_DECODE_EV_ERROR) e->done = -1;
    if (ev->type != PDM_DECODE_EV_DONE || e->done < 0) return;
    e->done = 1;
    e->n = PDM_MIN(ev->n_tokens, 64);
    memcpy(e->toks, ev->tokens, sizeof(int32_t) * (size_t)e->n);
    e->n_hyps = ev->beam ? ev->beam->n_hyps : 0;
}

/* A small random model (2 layers, 4 heads, 2 KV heads) written and loaded under `name`. */
static pdm_model_t *small_model(const char *name, int d_model, int n_ff, pdm_dtype_t wtype,
                                pdm_dtype_t embtype, uint64_t seed)
{
    char path[600];
    snprintf(path, sizeof(path), "%s/%s.gguf", pdm_test_tmpdir(), name);
    pdm_testmodel_params_t tp;
    pdm_testmodel_params_default(&tp);
    tp.n_layers = 2;
    tp.d_model = d_model;
    tp.n_heads = 4;
    tp.n_kv_heads = 2;
    tp.n_ff = n_ff;
    tp.wtype = wtype;
    tp.embtype = embtype;
    tp.seed = seed;
    ck_assert_int_eq(pdm_testmodel_write(path, &tp), 0);
    pdm_model_t *m;
    ck_assert_int_eq(pdm_model_load(path, &m), 0);
    return m;
}

/* The engine alone, greedy: n_new tokens after the prompt, with KV of dtype `dt`. */
static void engine_greedy(pdm_model_ctx_t *ctx, const pdm_model_t *m, const int32_t *prompt,
                          int n_prompt, int n_new, pdm_dtype_t dt, int32_t *out)
{
    pdm_kv_cache_t *c;
    ck_assert_int_eq(pdm_kv_cache_create(&m->hp, n_prompt + n_new, dt, &c), 0);
    float *logits = malloc(sizeof(float) * m->hp.n_vocab);
    ck_assert_int_eq(pdm_model_prefill(ctx, c, prompt, n_prompt, logits), 0);
    for (int k = 0; k < n_new; k++) {
        out[k] = pdm_test_argmax(logits, m->hp.n_vocab);
        if (k + 1 < n_new) ck_assert_int_eq(pdm_model_decode(ctx, c, out[k], logits), 0);
    }
    free(logits);
    pdm_kv_cache_destroy(c);
}

/* A local prefill of tokens[n] for max_new tokens (beams 0: sampling). */
static int reserve_local(pdm_decode_node_t *node, uint64_t id, const int32_t *tokens, int32_t n,
                         int32_t max_new, int beams)
{
    pdm_decode_local_t r = {.id = id, .tokens = tokens, .n_tokens = n, .max_new = max_new,
                            .beams = beams};
    return pdm_decode_node_reserve_local(node, &r);
}

START_TEST(test_decode_local_prefill)
{
    pdm_model_t *m = small_model("router-local-model", 64, 96, PDM_DT_F32, PDM_DT_F32, 11);
    enum { P = 21, NEW = 8 };
    int32_t prompt[P];
    for (int i = 0; i < P; i++) prompt[i] = (int32_t)((i * 37 + 5) % (int)m->hp.n_vocab);

    /* Reference: the engine alone, greedy, f32 KV. */
    pdm_model_ctx_t *ctx;
    ck_assert_int_eq(pdm_model_ctx_create(m, 1, 16, &ctx), 0);
    int32_t ref[NEW];
    engine_greedy(ctx, m, prompt, P, NEW, PDM_DT_F32, ref);

    pdm_kvt_t *kvt;
    ck_assert_int_eq(pdm_kvt_create(NULL, &kvt), 0);
    pdm_decode_params_t dp;
    pdm_decode_params_default(&dp);
    dp.kv_dtype = PDM_DT_F32;
    dp.kv_budget = 64;
    pdm_decode_node_t *node;
    ck_assert_int_eq(pdm_decode_node_create(m, kvt, &dp, &node), 0);
    /* refusals: too long for the budget, out-of-vocabulary token */
    int32_t big[60] = {0};
    ck_assert_int_eq(reserve_local(node, 1, big, 60, 10, 0), PDM_EOVERFLOW);
    int32_t bad[2] = {1, (int32_t)m->hp.n_vocab};
    ck_assert_int_eq(reserve_local(node, 1, bad, 2, 4, 0), PDM_ERANGE);
    /* prompt prefilled on the node; the node samples the first token itself */
    ck_assert_int_eq(reserve_local(node, 7, prompt, P, NEW, 0), 0);
    pdm_decode_start_t s = {.id = 7, .first_token = -1};
    pdm_sampler_params_default(&s.sp);
    s.sp.temperature = 0;
    ck_assert_int_eq(pdm_decode_node_start(node, &s), 0);
    local_events_t ev = {0};
    for (int round = 0; round < 100 && !ev.done; round++) pdm_decode_node_run_once(node, local_cb, &ev);
    ck_assert_int_eq(ev.done, 1);
    ck_assert_str_eq(ev.finish, "length");
    ck_assert_int_eq(ev.n, NEW);
    for (int k = 0; k < NEW; k++) ck_assert_int_eq(ev.toks[k], ref[k]);
    int held;
    int64_t slots;
    pdm_decode_node_usage(node, &held, &slots);
    ck_assert_int_eq(held, 0);
    ck_assert_int_eq(slots, 0);

    /* A beam search on a locally prefilled prompt (the router's beam requests on short prompts
     * and restarts): the reservation counts every beam's response segments (beam.h), so 4
     * beams do not fit the 64-slot budget; width 1 is greedy decoding. */
    ck_assert_int_eq(reserve_local(node, 9, prompt, P, NEW, 4),
                     PDM_EOVERFLOW);
    ck_assert_int_eq(reserve_local(node, 9, prompt, P, NEW, 1), 0);
    pdm_decode_node_usage(node, &held, &slots);
    ck_assert_int_eq(slots, pdm_beam_kv_slots(1, P, NEW));
    pdm_decode_start_t bs = {.id = 9, .first_token = -1, .prompt_last = prompt[P - 1]};
    pdm_sampler_params_default(&bs.sp);
    bs.beam = dp.beam;
    bs.beam.width = 1;
    bs.beam.n_best = 1;
    ck_assert_int_eq(pdm_decode_node_start(node, &bs), 0);
    beam_events_t be = {0};
    for (int round = 0; round < 100 && !be.done; round++) pdm_decode_node_run_once(node, beam_cb, &be);
    ck_assert_int_eq(be.done, 1);
    ck_assert_int_eq(be.n_hyps, 1);
    ck_assert_int_eq(be.n, NEW);
    for (int k = 0; k < NEW; k++) ck_assert_int_eq(be.toks[k], ref[k]);
    pdm_decode_node_usage(node, &held, &slots);
    ck_assert_int_eq(held, 0);
    ck_assert_int_eq(slots, 0);
    pdm_decode_node_destroy(node);
    /* q8 KV: a beam search of width 1 over int8 segments is the q8 engine's greedy decoding */
    int32_t qref[NEW];
    engine_greedy(ctx, m, prompt, P, NEW, PDM_DT_I8, qref);
    dp.kv_dtype = PDM_DT_I8;
    dp.kv_budget = 4096;
    ck_assert_int_eq(pdm_decode_node_create(m, kvt, &dp, &node), 0);
    ck_assert_int_eq(reserve_local(node, 10, prompt, P, NEW, 1), 0);
    bs.id = 10;
    ck_assert_int_eq(pdm_decode_node_start(node, &bs), 0);
    beam_events_t qe = {0};
    for (int round = 0; round < 100 && !qe.done; round++) pdm_decode_node_run_once(node, beam_cb, &qe);
    ck_assert_int_eq(qe.done, 1);
    ck_assert_int_eq(qe.n, NEW);
    for (int k = 0; k < NEW; k++) ck_assert_int_eq(qe.toks[k], qref[k]);
    pdm_decode_node_destroy(node);
    pdm_kvt_destroy(kvt);
    pdm_model_ctx_destroy(ctx);
    pdm_model_free(m);
}
END_TEST

/* Tokens and chosen-token log-probabilities of a sampled run on the node. */
typedef struct {
    int32_t toks[64];
    float lps[64];
    int n, done;
} sampled_events_t;

static void sampled_cb(void *arg, const pdm_decode_event_t *ev)
{
    sampled_events_t *e = arg;
    if (ev->type == PDM_DECODE_EV_TOKEN && e->n < 64) {
        e->lps[e->n] = ev->logprob ? ev->logprob->logprob : 1.0f;
        e->toks[e->n++] = ev->token;
    }
    if (ev->type == PDM_DECODE_EV_DONE) e->done = 1;
    if (ev->type == PDM_DECODE_EV_ERROR) e->done = -1;
}

/* One sampled request on the node: a local prefill of tokens[n] (the last n_generated of
 * them delivered before a migration, replayed one by one when asked), max_new new tokens. */
static void run_sampled(pdm_decode_node_t *node, uint64_t id, const int32_t *tokens, int32_t n,
                        int32_t n_generated, int replay, int32_t max_new, sampled_events_t *e)
{
    pdm_decode_local_t r = {.id = id, .tokens = tokens, .n_tokens = n, .max_new = max_new,
                            .n_generated = n_generated, .replay = replay};
    ck_assert_int_eq(pdm_decode_node_reserve_local(node, &r), 0);
    pdm_decode_start_t s = {.id = id, .first_token = -1};
    pdm_sampler_params_default(&s.sp);
    s.sp.temperature = 1.2f; /* a flat distribution: tiny logit changes would show */
    s.sp.top_k = 0;
    s.sp.top_p = 1.0f;
    s.sp.min_p = 0.0f;
    s.sp.frequency_penalty = 0.3f;
    s.sp.seed = 99;
    s.sp.logprobs = 2;
    ck_assert_int_eq(pdm_decode_node_start(node, &s), 0);
    memset(e, 0, sizeof(*e));
    for (int round = 0; round < 200 && !e->done; round++)
        pdm_decode_node_run_once(node, sampled_cb, e);
    ck_assert_int_eq(e->done, 1);
    ck_assert_int_eq(e->n, max_new);
}

/* A migration of a seeded sampled request: the new node prefills prompt + the k delivered
 * tokens (replaying those as decode steps) and resumes the draws at step k; the continuation
 * equals the uninterrupted run's, tokens and log-probabilities bit for bit. (On this small
 * random model a batched recomputation happens to round the same; on SmolLM2 Q4_1 it does
 * not, which tests/integration/run.sh's seeded migration catches.) */
START_TEST(test_decode_migration_resume)
{
    pdm_model_t *m = small_model("router-resume-model", 256, 512, PDM_DT_Q4_1, PDM_DT_Q8_0, 12);
    enum { P = 19, NEW = 24 };
    int32_t all[P + NEW];
    for (int i = 0; i < P; i++) all[i] = (int32_t)((i * 41 + 3) % (int)m->hp.n_vocab);
    pdm_kvt_t *kvt;
    ck_assert_int_eq(pdm_kvt_create(NULL, &kvt), 0);
    pdm_decode_params_t dp;
    pdm_decode_params_default(&dp);
    dp.kv_budget = 256;
    pdm_decode_node_t *node;
    ck_assert_int_eq(pdm_decode_node_create(m, kvt, &dp, &node), 0);
    sampled_events_t straight, resumed;
    run_sampled(node, 1, all, P, 0, 0, NEW, &straight);
    memcpy(all + P, straight.toks, sizeof(int32_t) * NEW);
    for (int k = 1; k < NEW; k += 5) {
        run_sampled(node, 2 + (uint64_t)k, all, P + k, k, 1, NEW - k, &resumed);
        ck_assert_mem_eq(resumed.toks, straight.toks + k, sizeof(int32_t) * (size_t)(NEW - k));
        ck_assert_mem_eq(resumed.lps, straight.lps + k, sizeof(float) * (size_t)(NEW - k));
    }
    pdm_decode_node_destroy(node);
    pdm_kvt_destroy(kvt);
    pdm_model_free(m);
}
END_TEST

/* What n samples (OpenAI's n, nsamp.h) told the node's callback: each sample's tokens and
 * chosen-token log-probabilities from its TOKEN events, how each event said it ended, and the
 * DONE's per-sample lists. */
typedef struct {
    int32_t toks[PDM_NSAMP_MAX][64];
    float lps[PDM_NSAMP_MAX][64];
    int n[PDM_NSAMP_MAX];
    char ends[PDM_NSAMP_MAX][16];   /* from the TOKEN that ended it */
    int done, bad_index;
    int done_samples;               /* DONE.n_samples */
    int done_n[PDM_NSAMP_MAX];
    char done_fin[PDM_NSAMP_MAX][16];
    int done_same;                  /* DONE's tokens equal the streamed ones */
} nsamp_events_t;

static void nsamp_cb(void *arg, const pdm_decode_event_t *ev)
{
    nsamp_events_t *e = arg;
    if (ev->type == PDM_DECODE_EV_TOKEN) {
        const int i = ev->sample;
        if (i < 0 || i >= PDM_NSAMP_MAX || ev->index != e->n[i] || e->ends[i][0]) {
            e->bad_index = 1;
            return;
        }
        e->lps[i][e->n[i]] = ev->logprob ? ev->logprob->logprob : 1.0f;
        e->toks[i][e->n[i]++] = ev->token;
        if (ev->sample_finish) snprintf(e->ends[i], 16, "%s", ev->sample_finish);
    }
    if (ev->type == PDM_DECODE_EV_DONE) {
        e->done = 1;
        e->done_samples = ev->n_samples;
        e->done_same = 1;
        for (int i = 0; i < ev->n_samples && i < PDM_NSAMP_MAX; i++) {
            e->done_n[i] = ev->sample_n_tokens[i];
            snprintf(e->done_fin[i], 16, "%s", ev->sample_finish_all[i]);
            e->done_same &= ev->sample_n_tokens[i] == e->n[i] &&
                            !memcmp(ev->sample_tokens[i], e->toks[i],
                                    sizeof(int32_t) * (size_t)e->n[i]);
        }
    }
    if (ev->type == PDM_DECODE_EV_ERROR) e->done = -1;
}

/* n samples of one prompt on the decode node: the reservation is eq. (3) of beam.h with
 * BW = n (the prompt once), every TOKEN names its sample and the one that ends a sample says
 * how, the DONE lists every sample; sample i equals an ordinary request of the same prompt
 * with the seed pdm_sampler_seed_for_choice(seed, i) (tokens; log-probabilities to 1e-4: the
 * two attend in a different order, f32 here so the tokens cannot part); a cancel in the middle
 * ends the running samples as "cancelled" and frees everything; bad counts are refused. */
START_TEST(test_decode_nsamp_node)
{
    pdm_model_t *m = small_model("router-nsamp-model", 64, 96, PDM_DT_F32, PDM_DT_F32, 13);
    enum { P = 17, NEW = 20, N = 4 };
    int32_t prompt[P];
    for (int i = 0; i < P; i++) prompt[i] = (int32_t)((i * 29 + 7) % (int)m->hp.n_vocab);
    pdm_kvt_t *kvt;
    ck_assert_int_eq(pdm_kvt_create(NULL, &kvt), 0);
    pdm_decode_params_t dp;
    pdm_decode_params_default(&dp);
    dp.kv_dtype = PDM_DT_F32;
    dp.kv_budget = 4096;
    pdm_decode_node_t *node;
    ck_assert_int_eq(pdm_decode_node_create(m, kvt, &dp, &node), 0);
    pdm_decode_local_t r = {.id = 5, .tokens = prompt, .n_tokens = P, .max_new = NEW,
                            .samples = 9};
    ck_assert_int_eq(pdm_decode_node_reserve_local(node, &r), PDM_EINVAL);
    r.samples = N;
    r.beams = 2;
    ck_assert_int_eq(pdm_decode_node_reserve_local(node, &r), PDM_EINVAL);
    r.beams = 0;
    ck_assert_int_eq(pdm_decode_node_reserve_local(node, &r), 0);
    int held;
    int64_t slots;
    pdm_decode_node_usage(node, &held, &slots);
    ck_assert_int_eq(slots, pdm_beam_kv_slots(N, P, NEW));
    pdm_decode_start_t s = {.id = 5, .first_token = -1, .prompt_last = -1};
    pdm_sampler_params_default(&s.sp);
    s.sp.temperature = 1.2f;
    s.sp.top_k = 0;
    s.sp.top_p = 1.0f;
    s.sp.min_p = 0.0f;
    s.sp.frequency_penalty = 0.3f;
    s.sp.seed = 99;
    s.sp.logprobs = 2;
    ck_assert_int_eq(pdm_decode_node_start(node, &s), 0);
    static nsamp_events_t e;
    memset(&e, 0, sizeof(e));
    for (int round = 0; round < 200 && !e.done; round++) pdm_decode_node_run_once(node, nsamp_cb, &e);
    ck_assert_int_eq(e.done, 1);
    ck_assert(!e.bad_index && e.done_same);
    ck_assert_int_eq(e.done_samples, N);
    for (int i = 0; i < N; i++) {
        ck_assert_int_eq(e.n[i], NEW);
        ck_assert_str_eq(e.ends[i], "length");
        ck_assert_str_eq(e.done_fin[i], "length");
        /* the same as an ordinary request with the choice's seed (this small random model's
         * outputs are near certain: the samples may agree; test_beam's nsamp_seeded shows them
         * differ on the real model) */
        pdm_decode_local_t one = {.id = 100 + (uint64_t)i, .tokens = prompt, .n_tokens = P,
                                  .max_new = NEW};
        ck_assert_int_eq(pdm_decode_node_reserve_local(node, &one), 0);
        pdm_decode_start_t os = s;
        os.id = one.id;
        os.sp.seed = pdm_sampler_seed_for_choice(s.sp.seed, i);
        ck_assert_int_eq(pdm_decode_node_start(node, &os), 0);
        sampled_events_t alone = {0};
        for (int round = 0; round < 200 && !alone.done; round++)
            pdm_decode_node_run_once(node, sampled_cb, &alone);
        ck_assert_int_eq(alone.n, NEW);
        ck_assert_mem_eq(alone.toks, e.toks[i], sizeof(int32_t) * NEW);
        for (int k = 0; k < NEW; k++) ck_assert_float_eq_tol(alone.lps[k], e.lps[i][k], 1e-4);
    }
    pdm_decode_node_usage(node, &held, &slots);
    ck_assert_int_eq(held, 0);
    ck_assert_int_eq(slots, 0);

    /* cancelled after a few steps: the DONE says so for every running sample */
    r.id = 6;
    ck_assert_int_eq(pdm_decode_node_reserve_local(node, &r), 0);
    s.id = 6;
    ck_assert_int_eq(pdm_decode_node_start(node, &s), 0);
    memset(&e, 0, sizeof(e));
    for (int round = 0; round < 4; round++) pdm_decode_node_run_once(node, nsamp_cb, &e);
    ck_assert_int_eq(pdm_decode_node_cancel(node, 6), 0);
    pdm_decode_node_run_once(node, nsamp_cb, &e);
    ck_assert_int_eq(e.done, 1);
    for (int i = 0; i < N; i++) {
        ck_assert_str_eq(e.done_fin[i], "cancelled");
        ck_assert(e.n[i] > 0 && e.n[i] < NEW && e.done_n[i] == e.n[i]);
    }
    pdm_decode_node_usage(node, &held, &slots);
    ck_assert_int_eq(held, 0);
    ck_assert_int_eq(slots, 0);
    pdm_decode_node_destroy(node);
    pdm_kvt_destroy(kvt);
    pdm_model_free(m);
}
END_TEST

/* A choice of n that goes on alone after its decode node died (router: rt_leader_end): one
 * sample over the segmented cache, its k delivered tokens replayed as steps of it
 * (pdm_nsamp_force), on another node: its continuation equals the undisturbed shared run's
 * sample, tokens and log-probabilities bit for bit (the same arithmetic), for every k, also
 * for a sample other than 0 (its derived seed as the request's). The Q4_1 model, where the
 * ordinary path's replay would round differently. */
START_TEST(test_decode_nsamp_resume)
{
    pdm_model_t *m = small_model("router-nsresume-model", 256, 512, PDM_DT_Q4_1, PDM_DT_Q8_0, 14);
    enum { P = 19, NEW = 24, N = 3 };
    int32_t all[P + NEW];
    for (int i = 0; i < P; i++) all[i] = (int32_t)((i * 43 + 11) % (int)m->hp.n_vocab);
    pdm_kvt_t *kvt;
    ck_assert_int_eq(pdm_kvt_create(NULL, &kvt), 0);
    pdm_decode_params_t dp;
    pdm_decode_params_default(&dp);
    dp.kv_budget = 4096;
    pdm_decode_node_t *node;
    ck_assert_int_eq(pdm_decode_node_create(m, kvt, &dp, &node), 0);
    pdm_decode_start_t s = {.id = 1, .first_token = -1, .prompt_last = -1};
    pdm_sampler_params_default(&s.sp);
    s.sp.temperature = 1.2f;
    s.sp.top_k = 0;
    s.sp.top_p = 1.0f;
    s.sp.min_p = 0.0f;
    s.sp.frequency_penalty = 0.3f;
    s.sp.seed = 5;
    s.sp.logprobs = 2;
    pdm_decode_local_t r = {.id = 1, .tokens = all, .n_tokens = P, .max_new = NEW, .samples = N};
    ck_assert_int_eq(pdm_decode_node_reserve_local(node, &r), 0);
    ck_assert_int_eq(pdm_decode_node_start(node, &s), 0);
    static nsamp_events_t full, part;
    memset(&full, 0, sizeof(full));
    for (int round = 0; round < 200 && !full.done; round++)
        pdm_decode_node_run_once(node, nsamp_cb, &full);
    ck_assert_int_eq(full.done, 1);
    for (int i = 0; i < N; i += 2) /* samples 0 and 2 */
        for (int k = 1; k < NEW; k += 7) {
            memcpy(all + P, full.toks[i], sizeof(int32_t) * (size_t)k);
            pdm_decode_local_t rr = {.id = 10 + (uint64_t)(i * NEW + k), .tokens = all,
                                     .n_tokens = P + k, .max_new = NEW - k, .samples = 1,
                                     .n_generated = k, .replay = 1};
            ck_assert_int_eq(pdm_decode_node_reserve_local(node, &rr), 0);
            int held;
            int64_t slots;
            pdm_decode_node_usage(node, &held, &slots);
            ck_assert_int_eq(slots, pdm_beam_kv_slots(1, P, NEW)); /* the router's count */
            pdm_decode_start_t rs = s;
            rs.id = rr.id;
            rs.sp.seed = pdm_sampler_seed_for_choice(s.sp.seed, i);
            ck_assert_int_eq(pdm_decode_node_start(node, &rs), 0);
            memset(&part, 0, sizeof(part));
            for (int round = 0; round < 200 && !part.done; round++)
                pdm_decode_node_run_once(node, nsamp_cb, &part);
            ck_assert_int_eq(part.done, 1);
            ck_assert(!part.bad_index && part.done_same && part.done_samples == 1);
            ck_assert_int_eq(part.n[0], NEW - k);
            ck_assert_mem_eq(part.toks[0], full.toks[i] + k, sizeof(int32_t) * (size_t)(NEW - k));
            ck_assert_mem_eq(part.lps[0], full.lps[i] + k, sizeof(float) * (size_t)(NEW - k));
        }
    int held;
    int64_t slots;
    pdm_decode_node_usage(node, &held, &slots);
    ck_assert(held == 0 && slots == 0);
    pdm_decode_node_destroy(node);
    pdm_kvt_destroy(kvt);
    pdm_model_free(m);
}
END_TEST

/* The decode node's prefix pool (decode.h): a finished sequence's KV (prompt and generated
 * tokens) stays; a next turn that starts with it copies those rows and prefills only the rest,
 * and its greedy continuation equals the engine's on the whole prompt (f32 weights and KV:
 * the pooled rows were computed by decode steps, the engine's by one prefill, equal to 1e-4,
 * checked through the tokens); a reservation that needs the slots evicts it; cancelled
 * sequences are not pooled. */
START_TEST(test_decode_prefix_pool)
{
    pdm_model_t *m = small_model("router-pool-model", 64, 96, PDM_DT_F32, PDM_DT_F32, 12);
    enum { P = 30, NEW = 8, EXTRA = 9 };
    pdm_model_ctx_t *ctx;
    ck_assert_int_eq(pdm_model_ctx_create(m, 1, 16, &ctx), 0);
    pdm_kvt_t *kvt;
    ck_assert_int_eq(pdm_kvt_create(NULL, &kvt), 0);
    pdm_decode_params_t dp;
    pdm_decode_params_default(&dp);
    dp.kv_dtype = PDM_DT_F32;
    dp.kv_budget = 100;
    dp.pool_tokens = 100;
    pdm_decode_node_t *node;
    ck_assert_int_eq(pdm_decode_node_create(m, kvt, &dp, &node), 0);
    pdm_sampler_params_t greedy;
    pdm_sampler_params_default(&greedy);
    greedy.temperature = 0;

    /* turn 1 */
    int32_t turn[P + NEW + EXTRA];
    for (int i = 0; i < P; i++) turn[i] = (int32_t)((i * 29 + 3) % (int)m->hp.n_vocab);
    ck_assert_int_eq(reserve_local(node, 1, turn, P, NEW, 0), 0);
    pdm_decode_start_t s = {.id = 1, .first_token = -1, .sp = greedy};
    ck_assert_int_eq(pdm_decode_node_start(node, &s), 0);
    local_events_t ev = {0};
    for (int round = 0; round < 100 && !ev.done; round++) pdm_decode_node_run_once(node, local_cb, &ev);
    ck_assert_int_eq(ev.done, 1);
    pdm_decode_pool_stats_t ps;
    pdm_decode_node_pool_stats(node, &ps);
    ck_assert_int_eq(ps.entries, 1);
    ck_assert_int_eq(ps.slots, P + NEW);
    int held;
    int64_t slots;
    pdm_decode_node_usage(node, &held, &slots);
    ck_assert_int_eq(slots, 0); /* pooled KV is not reserved: it gives way */

    /* turn 2: turn 1's prompt, its answer (all but the last token has KV) and a new message */
    int n2 = P;
    for (int k = 0; k < NEW; k++) turn[n2++] = ev.toks[k];
    for (int i = 0; i < EXTRA; i++) turn[n2++] = (int32_t)((i * 7 + 1) % (int)m->hp.n_vocab);
    int32_t ref[NEW];
    engine_greedy(ctx, m, turn, n2, NEW, PDM_DT_F32, ref);
    ck_assert_int_eq(reserve_local(node, 2, turn, n2, NEW, 0), 0);
    s.id = 2;
    ck_assert_int_eq(pdm_decode_node_start(node, &s), 0);
    local_events_t ev2 = {0};
    int32_t cached = -1;
    for (int round = 0; round < 100 && !ev2.done; round++) pdm_decode_node_run_once(node, local_cb, &ev2);
    ck_assert_int_eq(ev2.done, 1);
    pdm_decode_node_pool_stats(node, &ps);
    ck_assert_int_eq(ps.hits, 1);
    cached = (int32_t)ps.reused_tokens;
    ck_assert_int_eq(cached, P + NEW - 1);
    for (int k = 0; k < NEW; k++) ck_assert_int_eq(ev2.toks[k], ref[k]);
    /* turn 2's KV replaced turn 1's (which it extends) */
    ck_assert_int_eq(ps.entries, 1);
    ck_assert_int_eq(ps.slots, n2 + NEW);

    /* a reservation that needs the pool's slots evicts it; a cancelled sequence stays out */
    int32_t other[60];
    for (int i = 0; i < 60; i++) other[i] = (int32_t)((i * 11 + 2) % (int)m->hp.n_vocab);
    ck_assert_int_eq(reserve_local(node, 3, other, 60, 30, 0), 0);
    pdm_decode_node_pool_stats(node, &ps);
    ck_assert_int_eq(ps.entries, 0);
    ck_assert_int_eq(ps.evictions, 1);
    s.id = 3;
    ck_assert_int_eq(pdm_decode_node_start(node, &s), 0);
    ck_assert_int_eq(pdm_decode_node_cancel(node, 3), 0);
    local_events_t ev3 = {0};
    for (int round = 0; round < 10 && !ev3.done; round++) pdm_decode_node_run_once(node, local_cb, &ev3);
    ck_assert_str_eq(ev3.finish, "cancelled");
    pdm_decode_node_pool_stats(node, &ps);
    ck_assert_int_eq(ps.entries, 0);
    pdm_decode_node_usage(node, &held, &slots);
    ck_assert_int_eq(held, 0);
    ck_assert_int_eq(slots, 0);
    pdm_decode_node_destroy(node);
    pdm_kvt_destroy(kvt);
    pdm_model_ctx_destroy(ctx);
    pdm_model_free(m);
}
END_TEST

/* Runs one greedy local request to its end; its tokens in *ev. */
static void pool_turn(pdm_decode_node_t *node, uint64_t id, const int32_t *tok, int n, int new_,
                      local_events_t *ev)
{
    pdm_sampler_params_t greedy;
    pdm_sampler_params_default(&greedy);
    greedy.temperature = 0;
    ck_assert_int_eq(reserve_local(node, id, tok, n, new_, 0), 0);
    pdm_decode_start_t s = {.id = id, .first_token = -1, .sp = greedy};
    ck_assert_int_eq(pdm_decode_node_start(node, &s), 0);
    memset(ev, 0, sizeof(*ev));
    for (int round = 0; round < 200 && !ev->done; round++) pdm_decode_node_run_once(node, local_cb, ev);
    ck_assert_int_eq(ev->done, 1);
}

/* Counts drained KV events by kind; *reset when the batch said so. */
static void pool_events(pdm_decode_node_t *node, int *stored, int *evicted, int *reset)
{
    pdm_decode_kv_event_t evs[64];
    *stored = *evicted = *reset = 0;
    int n, r;
    while ((n = pdm_decode_node_kv_events(node, evs, 64, &r)) > 0 || r) {
        *reset |= r;
        for (int i = 0; i < n; i++) {
            *stored += evs[i].kind == PDM_DECODE_KVEV_STORED;
            *evicted += evs[i].kind == PDM_DECODE_KVEV_EVICTED;
        }
    }
}

/* The prefix pool's KV events and checksums (decode.h): with the router's keys set, turn 1
 * pools 30 + 7 tokens = 4 blocks of 8 (STORED x4, after the reset of the keys' snapshot);
 * turn 2 extends it: only its new blocks are STORED, nothing EVICTED (the superseded entry's
 * blocks stay held); the keys equal the router's for the same tokens. Then every reuse is
 * corrupted by the fault hook: the checksum catches it, the prefix is dropped (EVICTED) and
 * recomputed, the greedy answer equals the engine's, and `corrupt` counts it. */
START_TEST(test_decode_pool_events)
{
    pdm_model_t *m = small_model("router-pool-events", 64, 96, PDM_DT_F32, PDM_DT_F32, 12);
    enum { P = 30, NEW = 8, EXTRA = 9, BT = 8 };
    pdm_model_ctx_t *ctx;
    ck_assert_int_eq(pdm_model_ctx_create(m, 1, 16, &ctx), 0);
    pdm_kvt_t *kvt;
    ck_assert_int_eq(pdm_kvt_create(NULL, &kvt), 0);
    pdm_decode_params_t dp;
    pdm_decode_params_default(&dp);
    dp.kv_dtype = PDM_DT_F32;
    dp.kv_budget = 200;
    dp.pool_tokens = 200;
    pdm_decode_node_t *node;
    ck_assert_int_eq(pdm_decode_node_create(m, kvt, &dp, &node), 0);
    pdm_prefix_key_params_t kp = {.model = "router-pool-events", .block_tokens = BT};
    memset(kp.salt, 5, sizeof(kp.salt));
    pdm_decode_node_set_prefix_keys(node, &kp);
    int stored, evicted, reset;
    pool_events(node, &stored, &evicted, &reset);
    ck_assert_int_eq(reset, 1); /* an empty snapshot */
    ck_assert_int_eq(stored, 0);

    int32_t turn[P + NEW + EXTRA + NEW + EXTRA];
    for (int i = 0; i < P; i++) turn[i] = (int32_t)((i * 29 + 3) % (int)m->hp.n_vocab);
    local_events_t ev;
    pool_turn(node, 1, turn, P, NEW, &ev);
    pool_events(node, &stored, &evicted, &reset);
    ck_assert_int_eq(stored, (P + NEW - 1) / BT);
    ck_assert_int_eq(evicted, 0);
    ck_assert_int_eq(reset, 0);
    pdm_decode_pool_stats_t ps;
    pdm_decode_node_pool_stats(node, &ps);
    ck_assert_int_eq(ps.blocks, (P + NEW - 1) / BT);
    ck_assert_uint_gt(ps.bytes, 0);

    int n2 = P;
    for (int k = 0; k < NEW; k++) turn[n2++] = ev.toks[k];
    for (int i = 0; i < EXTRA; i++) turn[n2++] = (int32_t)((i * 7 + 1) % (int)m->hp.n_vocab);
    pool_turn(node, 2, turn, n2, NEW, &ev);
    pool_events(node, &stored, &evicted, &reset);
    const int blocks2 = (n2 + NEW - 1) / BT;
    ck_assert_int_eq(stored, blocks2 - (P + NEW - 1) / BT);
    ck_assert_int_eq(evicted, 0);
    pdm_decode_node_pool_stats(node, &ps);
    ck_assert_int_eq(ps.hits, 1);
    ck_assert_int_eq(ps.entries, 1);
    ck_assert_int_eq(ps.blocks, blocks2);
    /* a resync queues the whole pool behind a reset */
    pdm_decode_node_kv_resync(node);
    pool_events(node, &stored, &evicted, &reset);
    ck_assert_int_eq(reset, 1);
    ck_assert_int_eq(stored, blocks2);

    /* the same keys as the router computes for these tokens (common/wire.h) */
    int32_t all[P + NEW + EXTRA + NEW];
    memcpy(all, turn, sizeof(int32_t) * (size_t)n2);
    memcpy(all + n2, ev.toks, sizeof(int32_t) * (NEW - 1));
    uint8_t keys[16][32];
    ck_assert_int_eq(pdm_prefix_block_keys(&kp, all, (uint32_t)(n2 + NEW - 1), keys, 16), blocks2);
    pdm_decode_node_kv_resync(node);
    pdm_decode_kv_event_t evs[64];
    int nev = pdm_decode_node_kv_events(node, evs, 64, &reset);
    ck_assert_int_eq(nev, blocks2);
    for (int b = 0; b < blocks2; b++) ck_assert(!memcmp(evs[b].key, keys[b], 32));
    pdm_decode_node_destroy(node);

    /* corruption: the fault hook flips a byte of the pooled prefix before its reuse */
    dp.fault_corrupt_pool = 1;
    ck_assert_int_eq(pdm_decode_node_create(m, kvt, &dp, &node), 0);
    pdm_decode_node_set_prefix_keys(node, &kp);
    pool_turn(node, 1, turn, P, NEW, &ev);
    n2 = P;
    for (int k = 0; k < NEW; k++) turn[n2++] = ev.toks[k];
    for (int i = 0; i < EXTRA; i++) turn[n2++] = (int32_t)((i * 7 + 1) % (int)m->hp.n_vocab);
    int32_t ref[NEW];
    engine_greedy(ctx, m, turn, n2, NEW, PDM_DT_F32, ref);
    pool_events(node, &stored, &evicted, &reset);
    pool_turn(node, 2, turn, n2, NEW, &ev);
    pdm_decode_node_pool_stats(node, &ps);
    ck_assert_int_eq(ps.corrupt, 1);
    ck_assert_int_eq(ps.hits, 0);
    ck_assert_int_eq(ps.lookups, 2);
    for (int k = 0; k < NEW; k++) ck_assert_int_eq(ev.toks[k], ref[k]);
    pool_events(node, &stored, &evicted, &reset);
    ck_assert_int_eq(evicted, (P + NEW - 1) / BT); /* the corrupted entry left the index */
    ck_assert_int_eq(stored, blocks2);             /* turn 2's own KV, computed afresh */
    ck_assert_int_eq(ps.entries, 1);
    pdm_decode_node_destroy(node);
    pdm_kvt_destroy(kvt);
    pdm_model_ctx_destroy(ctx);
    pdm_model_free(m);
}
END_TEST

/* Delta transfer (decode.h, pdm_decode_node_reserve with pool_prefix): turn 1 is pooled (37
 * rows); turn 2 (47 tokens) takes rows [0, 32) from the pool and receives only [32, 47) over a
 * real stream, from the engine's own KV of the whole prompt (what a prefill rank sends); its
 * greedy continuation equals the engine's, the pool counts a hit of 32 tokens and 15 rows
 * came. Refused: no tokens or a prefix reaching the last token (PDM_EINVAL), a prefix the pool
 * does not hold (PDM_ENOTFOUND), a corrupt entry (PDM_ECHECKSUM, dropped, never used). */
/* Two UCX workers in this process connected both ways: a prefill rank's end and a decode
 * node's, with each one's peer index of the other. */
static void kvt_pair(pdm_kvt_t **rank, pdm_kvt_t **kvt, int *to_node, int *to_rank)
{
    pdm_kvt_params_t kp;
    pdm_kvt_params_default(&kp);
    ck_assert_int_eq(pdm_kvt_create(&kp, rank), 0);
    ck_assert_int_eq(pdm_kvt_create(&kp, kvt), 0);
    const void *addr;
    size_t len;
    pdm_kvt_address(*kvt, &addr, &len);
    ck_assert_int_eq(pdm_kvt_connect(*rank, addr, len, to_node), 0);
    pdm_kvt_address(*rank, &addr, &len);
    ck_assert_int_eq(pdm_kvt_connect(*kvt, addr, len, to_rank), 0);
}

/* The decode node's loop in a thread (test_decode_dropped_stream). */
typedef struct {
    pdm_decode_node_t *node;
    local_events_t ev;
    atomic_int stop;
} node_loop_t;

static void *node_loop(void *arg)
{
    node_loop_t *nl = arg;
    while (!atomic_load(&nl->stop)) {
        pdm_decode_node_run_once(nl->node, local_cb, &nl->ev);
        usleep(1000);
    }
    return NULL;
}

/* A sequence cancelled while its prompt's KV streams in: the rank goes on sending (it does
 * not know yet) and must not wait out its stream timeout on rendezvous sends nobody receives
 * (it stalled a prefill group for 30 s in test_ha.py): the node throws the blocks away. */
START_TEST(test_decode_dropped_stream)
{
    pdm_model_t *m = small_model("router-dead-stream", 64, 96, PDM_DT_F32, PDM_DT_F32, 13);
    enum { N = 1000, ID = 9 };
    pdm_kvt_t *rank, *kvt; /* the prefill rank's end and the decode node's */
    int to_node, to_rank;
    kvt_pair(&rank, &kvt, &to_node, &to_rank);
    pdm_decode_params_t dp;
    pdm_decode_params_default(&dp);
    dp.kv_dtype = PDM_DT_F32;
    dp.kv_budget = 4 * N;
    node_loop_t nl = {0};
    ck_assert_int_eq(pdm_decode_node_create(m, kvt, &dp, &nl.node), 0);
    const pdm_decode_range_t range = {.start = 0, .len = N, .peer = to_rank, .chunk = 0};
    pdm_decode_reserve_t r = {.id = ID, .n_prompt = N, .max_new = 4, .ranges = &range,
                              .n_ranges = 1, .beams = -1};
    ck_assert_int_eq(pdm_decode_node_reserve(nl.node, &r), 0);
    ck_assert_int_eq(pdm_decode_node_cancel(nl.node, ID), 0);
    pthread_t th;
    ck_assert_int_eq(pthread_create(&th, NULL, node_loop, &nl), 0);
    /* 64 KB pieces: rendezvous sends, complete only once someone receives them */
    const size_t row = pdm_dtype_row_bytes(PDM_DT_F32, m->hp.head_dim);
    char *rows = calloc(N, row);
    pdm_kvt_stream_tx_t *tx;
    ck_assert_int_eq(pdm_kvt_stream_tx_create(rank, to_node, ID, 0, 2, 20, &tx), 0);
    const double t0 = pdm_now();
    int st = PDM_OK;
    for (uint32_t l = 0; l < m->hp.n_layers && !st; l++)
        for (uint32_t h = 0; h < m->hp.n_kv_heads && !st; h++)
            st = pdm_kvt_stream_tx_send(tx, l, h, 0, 0, N, (uint16_t)PDM_DT_F32, 1.0f, rows, rows,
                                        row);
    if (!st) st = pdm_kvt_stream_tx_finish(tx, pdm_now() + 20);
    const double took = pdm_now() - t0;
    pdm_kvt_stream_tx_destroy(tx);
    atomic_store(&nl.stop, 1);
    pthread_join(th, NULL);
    ck_assert_msg(st == PDM_OK && took < 5, "the rank's stream to a dropped sequence took %.1f s "
                  "(status %d)", took, st);
    int held;
    int64_t slots;
    pdm_decode_node_usage(nl.node, &held, &slots);
    ck_assert_int_eq(held, 0);
    free(rows);
    pdm_decode_node_destroy(nl.node);
    pdm_kvt_destroy(kvt);
    pdm_kvt_destroy(rank);
    pdm_model_free(m);
}
END_TEST

START_TEST(test_decode_pool_delta)
{
    pdm_model_t *m = small_model("router-pool-delta", 64, 96, PDM_DT_F32, PDM_DT_F32, 12);
    enum { P = 30, NEW = 8, EXTRA = 9, D = 32, ID = 5 };
    pdm_model_ctx_t *ctx;
    ck_assert_int_eq(pdm_model_ctx_create(m, 1, 16, &ctx), 0);
    pdm_kvt_t *rank, *kvt; /* the prefill rank's end and the decode node's */
    int to_node, to_rank;
    kvt_pair(&rank, &kvt, &to_node, &to_rank);
    pdm_decode_params_t dp;
    pdm_decode_params_default(&dp);
    dp.kv_dtype = PDM_DT_F32;
    dp.kv_budget = 200;
    dp.pool_tokens = 200;
    for (int corrupt = 0; corrupt < 2; corrupt++) {
        dp.fault_corrupt_pool = corrupt;
        pdm_decode_node_t *node;
        ck_assert_int_eq(pdm_decode_node_create(m, kvt, &dp, &node), 0);
        int32_t turn[P + NEW + EXTRA];
        for (int i = 0; i < P; i++) turn[i] = (int32_t)((i * 29 + 3) % (int)m->hp.n_vocab);
        local_events_t ev;
        pool_turn(node, 1, turn, P, NEW, &ev);
        int n2 = P;
        for (int k = 0; k < NEW; k++) turn[n2++] = ev.toks[k];
        for (int i = 0; i < EXTRA; i++) turn[n2++] = (int32_t)((i * 7 + 1) % (int)m->hp.n_vocab);
        const pdm_decode_range_t range = {.start = D, .len = n2 - D, .peer = to_rank, .chunk = 0};
        pdm_decode_reserve_t r = {.id = ID, .n_prompt = n2, .max_new = NEW, .ranges = &range,
                                  .n_ranges = 1, .beams = -1, .pool_prefix = D};
        ck_assert_int_eq(pdm_decode_node_reserve(node, &r), PDM_EINVAL); /* no tokens */
        r.tokens = turn;
        r.pool_prefix = n2;
        ck_assert_int_eq(pdm_decode_node_reserve(node, &r), PDM_EINVAL);
        int32_t other[P + NEW + EXTRA];
        memcpy(other, turn, sizeof(other));
        other[D - 4] = (other[D - 4] + 1) % (int32_t)m->hp.n_vocab;
        r.tokens = other;
        r.pool_prefix = D;
        ck_assert_int_eq(pdm_decode_node_reserve(node, &r), PDM_ENOTFOUND);
        r.tokens = turn;
        pdm_decode_pool_stats_t ps;
        if (corrupt) {
            ck_assert_int_eq(pdm_decode_node_reserve(node, &r), PDM_ECHECKSUM);
            pdm_decode_node_pool_stats(node, &ps);
            ck_assert_int_eq(ps.corrupt, 1);
            ck_assert_int_eq(ps.entries, 0);
            ck_assert_int_eq(ps.hits, 0);
            int held;
            int64_t slots;
            pdm_decode_node_usage(node, &held, &slots);
            ck_assert_int_eq(held, 0); /* nothing is held after a refusal */
            ck_assert_int_eq(slots, 0);
            pdm_decode_node_destroy(node);
            continue;
        }
        ck_assert_int_eq(pdm_decode_node_reserve(node, &r), 0);
        /* the rank's side: the engine's KV of the whole prompt, rows from D on */
        pdm_kv_cache_t *c;
        ck_assert_int_eq(pdm_kv_cache_create(&m->hp, n2, PDM_DT_F32, &c), 0);
        float *logits = malloc(sizeof(float) * m->hp.n_vocab);
        ck_assert_int_eq(pdm_model_prefill(ctx, c, turn, n2, logits), 0);
        int32_t ref[NEW];
        engine_greedy(ctx, m, turn, n2, NEW, PDM_DT_F32, ref);
        pdm_kvt_stream_tx_t *tx;
        ck_assert_int_eq(pdm_kvt_stream_tx_create(rank, to_node, ID, 0, 64, 5, &tx), 0);
        const size_t row = pdm_dtype_row_bytes(PDM_DT_F32, m->hp.head_dim);
        for (uint32_t l = 0; l < m->hp.n_layers; l++)
            for (uint32_t h = 0; h < m->hp.n_kv_heads; h++)
                ck_assert_int_eq(pdm_kvt_stream_tx_send(
                                     tx, l, h, 0, D, n2 - D, (uint16_t)PDM_DT_F32, 1.0f,
                                     (const char *)pdm_kv_cache_k(c, l, h) + D * row,
                                     (const char *)pdm_kv_cache_v(c, l, h) + D * row, row),
                                 0);
        pdm_sampler_params_t greedy;
        pdm_sampler_params_default(&greedy);
        greedy.temperature = 0;
        pdm_decode_start_t s = {.id = ID, .first_token = ref[0], .sp = greedy};
        ck_assert_int_eq(pdm_decode_node_start(node, &s), 0);
        memset(&ev, 0, sizeof(ev));
        /* bounded by time, not rounds: the KV comes over UCX, later on a loaded machine */
        for (const double until = pdm_now() + 30; !ev.done && pdm_now() < until;) {
            pdm_decode_node_run_once(node, local_cb, &ev);
            pdm_kvt_progress(rank);
        }
        ck_assert_int_eq(pdm_kvt_stream_tx_finish(tx, pdm_now() + 5), 0);
        ck_assert_uint_eq(pdm_kvt_stream_tx_bytes(tx),
                          (uint64_t)2 * m->hp.n_layers * m->hp.n_kv_heads * (n2 - D) * row);
        pdm_kvt_stream_tx_destroy(tx);
        ck_assert_int_eq(ev.done, 1);
        ck_assert_int_eq(ev.n, NEW);
        for (int k = 0; k < NEW; k++) ck_assert_int_eq(ev.toks[k], ref[k]);
        pdm_decode_node_pool_stats(node, &ps);
        ck_assert_int_eq(ps.hits, 1);
        ck_assert_int_eq(ps.reused_tokens, D);
        ck_assert_int_eq(ps.corrupt, 0);
        free(logits);
        pdm_kv_cache_destroy(c);
        pdm_decode_node_destroy(node);
    }
    pdm_kvt_destroy(kvt);
    pdm_kvt_destroy(rank);
    pdm_model_ctx_destroy(ctx);
    pdm_model_free(m);
}
END_TEST

/* The prefix pool's second tier (decode.h): a RAM pool of 50 tokens and a file tier of 200.
 * Turn 1 (37 tokens of KV) is pooled; an unrelated sequence needs the RAM, so turn 1 moves to
 * the file tier (its blocks announced again with tier FILE, no EVICTED); turn 2 hits it there:
 * its rows are loaded back, the checksums verified, and the greedy answer equals the engine's. */
START_TEST(test_decode_pool_file_tier)
{
    pdm_model_t *m = small_model("router-pool-file", 64, 96, PDM_DT_F32, PDM_DT_F32, 12);
    enum { P = 30, NEW = 8, EXTRA = 9, BT = 8 };
    pdm_model_ctx_t *ctx;
    ck_assert_int_eq(pdm_model_ctx_create(m, 1, 16, &ctx), 0);
    pdm_kvt_t *kvt;
    ck_assert_int_eq(pdm_kvt_create(NULL, &kvt), 0);
    char spec[600];
    snprintf(spec, sizeof(spec), "file:%s", pdm_test_tmpdir());
    pdm_decode_params_t dp;
    pdm_decode_params_default(&dp);
    dp.kv_dtype = PDM_DT_F32;
    dp.kv_budget = 200;
    dp.pool_tokens = 50;
    dp.pool_file_tier = spec;
    dp.pool_file_tokens = 200;
    pdm_decode_node_t *node;
    ck_assert_int_eq(pdm_decode_node_create(m, kvt, &dp, &node), 0);
    pdm_prefix_key_params_t kp = {.model = "router-pool-file", .block_tokens = BT};
    memset(kp.salt, 3, sizeof(kp.salt));
    pdm_decode_node_set_prefix_keys(node, &kp);
    int stored, evicted, reset;
    pool_events(node, &stored, &evicted, &reset);

    int32_t turn[P + NEW + EXTRA], other[P];
    for (int i = 0; i < P; i++) turn[i] = (int32_t)((i * 29 + 3) % (int)m->hp.n_vocab);
    for (int i = 0; i < P; i++) other[i] = (int32_t)((i * 11 + 2) % (int)m->hp.n_vocab);
    local_events_t ev, evo;
    pool_turn(node, 1, turn, P, NEW, &ev);
    pool_turn(node, 2, other, P, NEW, &evo);
    pdm_decode_pool_stats_t ps;
    pdm_decode_node_pool_stats(node, &ps);
    ck_assert_int_eq(ps.entries, 1);            /* `other` in RAM */
    ck_assert_int_eq(ps.file_tokens, P + NEW - 1); /* turn 1 in the file tier */
    ck_assert_uint_gt(ps.file_bytes, 0);
    ck_assert_int_eq(ps.blocks, 2 * ((P + NEW - 1) / BT));
    pdm_decode_kv_event_t evs[64];
    int nev = pdm_decode_node_kv_events(node, evs, 64, &reset), file_stored = 0;
    for (int i = 0; i < nev; i++) {
        ck_assert_int_eq(evs[i].kind, PDM_DECODE_KVEV_STORED);
        file_stored += evs[i].tier == 2;
    }
    ck_assert_int_eq(file_stored, (P + NEW - 1) / BT);

    int n2 = P;
    for (int k = 0; k < NEW; k++) turn[n2++] = ev.toks[k];
    for (int i = 0; i < EXTRA; i++) turn[n2++] = (int32_t)((i * 7 + 1) % (int)m->hp.n_vocab);
    int32_t ref[NEW];
    engine_greedy(ctx, m, turn, n2, NEW, PDM_DT_F32, ref);
    pool_turn(node, 3, turn, n2, NEW, &ev);
    pdm_decode_node_pool_stats(node, &ps);
    ck_assert_int_eq(ps.file_hits, 1);
    ck_assert_int_eq(ps.hits, 1);
    ck_assert_int_eq(ps.corrupt, 0);
    ck_assert_int_eq((int32_t)ps.reused_tokens, P + NEW - 1);
    for (int k = 0; k < NEW; k++) ck_assert_int_eq(ev.toks[k], ref[k]);
    pdm_decode_node_destroy(node);
    pdm_kvt_destroy(kvt);
    pdm_model_ctx_destroy(ctx);
    pdm_model_free(m);
}
END_TEST

/* Windowed local layers in local prefills (decode.h): a gemma3 model with a 16-token window
 * (30 rows per windowed head at r = 2). Turn 1, 20 + 8 tokens, fits the rows: full KV, pooled.
 * Turn 2 (turn 1, its answer and 30 new tokens; 40 new) is windowed: its global layers copy the
 * pooled rows, its local layers keep the last 15 of them (pdm_kv_cache_window_fill), the rest
 * is prefilled in chunks of 15 and decoded past the window; the greedy output equals the
 * engine's full KV on the whole prompt; the node counts fewer slots than tokens; a windowed
 * sequence does not join the pool. */
START_TEST(test_decode_window_local)
{
    char path[600];
    snprintf(path, sizeof(path), "%s/router-gemma3-window.gguf", pdm_test_tmpdir());
    pdm_testmodel_params_t tp;
    ck_assert_int_eq(pdm_testmodel_params_preset(&tp, "gemma3"), 0);
    tp.wtype = PDM_DT_F32;
    tp.embtype = PDM_DT_F32;
    tp.n_ctx = 1024;
    ck_assert_int_eq(pdm_testmodel_write(path, &tp), 0);
    pdm_model_t *m;
    ck_assert_int_eq(pdm_model_load(path, &m), 0);
    enum { P = 20, NEW1 = 8, EXTRA = 30, NEW2 = 40 };
    pdm_model_ctx_t *ctx;
    ck_assert_int_eq(pdm_model_ctx_create(m, 1, 16, &ctx), 0);
    pdm_kvt_t *kvt;
    ck_assert_int_eq(pdm_kvt_create(NULL, &kvt), 0);
    pdm_decode_params_t dp;
    pdm_decode_params_default(&dp);
    dp.kv_dtype = PDM_DT_F32;
    dp.kv_budget = 1000;
    dp.pool_tokens = 1000;
    pdm_decode_node_t *node;
    ck_assert_int_eq(pdm_decode_node_create(m, kvt, &dp, &node), 0);
    pdm_sampler_params_t greedy;
    pdm_sampler_params_default(&greedy);
    greedy.temperature = 0;
    int32_t turn[P + NEW1 + EXTRA];
    for (int i = 0; i < P; i++) turn[i] = (int32_t)((i * 29 + 3) % (int)m->hp.n_vocab);
    ck_assert_int_eq(reserve_local(node, 1, turn, P, NEW1, 0), 0);
    pdm_decode_start_t s = {.id = 1, .first_token = -1, .sp = greedy};
    ck_assert_int_eq(pdm_decode_node_start(node, &s), 0);
    local_events_t ev = {0};
    for (int round = 0; round < 100 && !ev.done; round++) pdm_decode_node_run_once(node, local_cb, &ev);
    ck_assert_int_eq(ev.done, 1);
    ck_assert_int_eq(ev.n, NEW1);
    pdm_decode_pool_stats_t ps;
    pdm_decode_node_pool_stats(node, &ps);
    ck_assert_int_eq(ps.entries, 1); /* 28 slots < 30 rows: full KV, pooled */

    int n2 = P;
    for (int k = 0; k < NEW1; k++) turn[n2++] = ev.toks[k];
    for (int i = 0; i < EXTRA; i++) turn[n2++] = (int32_t)((i * 7 + 1) % (int)m->hp.n_vocab);
    int32_t ref[NEW2];
    engine_greedy(ctx, m, turn, n2, NEW2, PDM_DT_F32, ref);
    ck_assert_int_eq(reserve_local(node, 2, turn, n2, NEW2, 0), 0);
    int held;
    int64_t slots;
    pdm_decode_node_usage(node, &held, &slots);
    pdm_kvwin_plan_t wp;
    ck_assert_int_eq(pdm_kvwin_plan(m, PDM_DT_F32, 2, n2, NEW2, &wp), 0);
    ck_assert_int_eq(slots, wp.slots);
    ck_assert_int_lt(slots, n2 + NEW2);
    s.id = 2;
    ck_assert_int_eq(pdm_decode_node_start(node, &s), 0);
    local_events_t ev2 = {0};
    for (int round = 0; round < 200 && !ev2.done; round++) pdm_decode_node_run_once(node, local_cb, &ev2);
    ck_assert_int_eq(ev2.done, 1);
    pdm_decode_node_pool_stats(node, &ps);
    ck_assert_int_eq(ps.hits, 1);
    ck_assert_int_eq((int32_t)ps.reused_tokens, P + NEW1 - 1);
    ck_assert_int_eq(ev2.n, NEW2);
    for (int k = 0; k < NEW2; k++) ck_assert_int_eq(ev2.toks[k], ref[k]);
    ck_assert_int_eq(ps.entries, 1); /* turn 1's; turn 2 (windowed) was not pooled */
    pdm_decode_node_usage(node, &held, &slots);
    ck_assert_int_eq(held, 0);
    ck_assert_int_eq(slots, 0);
    pdm_decode_node_destroy(node);
    pdm_kvt_destroy(kvt);
    pdm_model_ctx_destroy(ctx);
    pdm_model_free(m);
}
END_TEST

/* ---- load-adaptive groups (router/adapt.h): the cost model and the decision ---------------- */

static void adapt_cost(rt_adapt_cost_t *c, int ranks)
{
    pdm_model_hparams_t hp = {0}; /* SmolLM2-135M's shapes */
    hp.n_layers = 30;
    hp.d_model = 576;
    hp.n_ff = 1536;
    hp.n_heads = 9;
    hp.n_kv_heads = 3;
    hp.head_dim = 64;
    pdm_calibration_t cal = {.flops = 30.78e9, .bandwidth = 2.54e9, .latency = 4.7e-6};
    rt_adapt_cost_init(c, &hp, ranks, &cal);
}

START_TEST(test_adapt_cost_model)
{
    rt_adapt_cost_t c;
    adapt_cost(&c, 2);
    /* pdmesh calibrate's FLOP count: 1024 tokens at C take what calibrate measured them in */
    const double d = 576, hd = 64, nh = 9, nkv = 3, n = 1024;
    const double flops = 30 * (2 * (d * nh * hd * 2 + d * nkv * hd * 2 + 3 * d * 1536) * n +
                               4 * hd * nh * n * (n + 1) / 2);
    ck_assert_double_eq_tol(rt_adapt_t1(&c, 1024), flops / 30.78e9, 1e-9);
    for (int32_t len = 16; len <= 8192; len *= 2) {
        double t1 = rt_adapt_t1(&c, len), tr = rt_adapt_tR(&c, len, 0);
        ck_assert_msg(tr < t1 && tr > t1 / 2, "%d tokens: tR %g vs t1 %g", len, tr, t1);
    }
    /* a partial prefill costs less than the whole prompt and more than its new tokens alone */
    ck_assert(rt_adapt_tR(&c, 256, 768) < rt_adapt_tR(&c, 1024, 0));
    ck_assert(rt_adapt_tR(&c, 256, 768) > rt_adapt_tR(&c, 256, 0));
    /* learning: measurements on the line 2 x + 50 ms (x: the bare model's prediction) move
     * the solo line there, whatever the prior */
    rt_adapt_cost_t bare;
    adapt_cost(&bare, 2);
    for (int i = 0; i < 60; i++) {
        const int32_t len = 64 + 97 * (i % 9);
        rt_adapt_learn(&c, 1, len, 0, 2 * rt_adapt_t1(&bare, len) + 0.05);
    }
    ck_assert_double_eq_tol(c.solo.a, 2.0, 0.05);
    ck_assert_double_eq_tol(c.solo.b, 0.05, 0.005);
    ck_assert_double_eq_tol(rt_adapt_t1(&c, 300), 2 * rt_adapt_t1(&bare, 300) + 0.05, 0.01);
    /* a fixed cost per group task (short prompts scale worst) is learned as such */
    for (int i = 0; i < 60; i++) {
        const int32_t len = 64 + 97 * (i % 9);
        rt_adapt_learn(&c, 0, len, 0, (rt_adapt_tR(&bare, len, 0) - 0.02) * 0.75 + 0.3);
    }
    ck_assert_double_eq_tol(c.group.b, 0.3, 0.01);
    /* absurd measurements are clamped; nothing measured changes nothing */
    for (int i = 0; i < 100; i++) rt_adapt_learn(&c, 1, 512, 0, 1e6);
    ck_assert(c.solo.a <= 20 && c.solo.b <= 5);
    const double ga = c.group.a, gb = c.group.b;
    rt_adapt_learn(&c, 0, 512, 0, 0);
    ck_assert(c.group.a == ga && c.group.b == gb);
}
END_TEST

START_TEST(test_adapt_decide)
{
    rt_adapt_cost_t c, bare_c;
    adapt_cost(&c, 2);
    adapt_cost(&bare_c, 2);
    double idle[2] = {0, 0};
    int rank = -1;
    /* an empty queue on an idle group: the whole group, whatever the length */
    for (int32_t len = 16; len <= 8192; len *= 2) {
        rt_adapt_input_t in = {.busy = idle, .group_ok = 1, .queue = &len, .n_queue = 1};
        ck_assert_int_eq(rt_adapt_decide(&c, &in, &rank, NULL, NULL), RT_ADAPT_GROUP);
    }
    /* a queue on an idle group: solo on a free rank */
    int32_t q4[4] = {600, 600, 600, 600};
    rt_adapt_input_t in = {.busy = idle, .group_ok = 1, .queue = q4, .n_queue = 4};
    double cg, cs;
    ck_assert_int_eq(rt_adapt_decide(&c, &in, &rank, &cg, &cs), RT_ADAPT_SOLO);
    ck_assert_int_eq(rank, 0);
    ck_assert(cs < cg);
    /* the next one: rank 0 now busy with it, rank 1 idle */
    double one_busy[2] = {rt_adapt_t1(&c, 600), 0};
    in.busy = one_busy;
    in.queue = q4 + 1;
    in.n_queue = 3;
    in.group_ok = 0; /* a solo task is in flight */
    ck_assert_int_eq(rt_adapt_decide(&c, &in, &rank, NULL, NULL), RT_ADAPT_SOLO);
    ck_assert_int_eq(rank, 1);
    /* both ranks busy: wait (solo needs an idle rank, group needs every rank) */
    double both[2] = {1.0, 1.2};
    in.busy = both;
    ck_assert_int_eq(rt_adapt_decide(&c, &in, &rank, NULL, NULL), RT_ADAPT_WAIT);
    /* one request, one rank almost free: worth waiting for the group, which is not allowed
     * to start yet */
    int32_t big = 2048;
    double almost[2] = {0.01, 0};
    rt_adapt_input_t w = {.busy = almost, .group_ok = 0, .queue = &big, .n_queue = 1};
    ck_assert_int_eq(rt_adapt_decide(&c, &w, &rank, NULL, NULL), RT_ADAPT_WAIT);
    /* ... but not when that rank is busy for long: the idle rank takes it alone */
    double long_busy[2] = {100, 0};
    w.busy = long_busy;
    ck_assert_int_eq(rt_adapt_decide(&c, &w, &rank, NULL, NULL), RT_ADAPT_SOLO);
    ck_assert_int_eq(rank, 1);
    /* a group that scales well (learned k_group near 1) keeps short queues whole */
    c.group.a = 1.0;
    c.group.b = 0;
    int32_t q2[2] = {600, 600};
    rt_adapt_input_t two = {.busy = idle, .group_ok = 1, .queue = q2, .n_queue = 2};
    ck_assert_int_eq(rt_adapt_decide(&c, &two, &rank, NULL, NULL), RT_ADAPT_GROUP);
    /* a partial prefill that reuses most of the prompt stays on the group */
    adapt_cost(&c, 2);
    int32_t qp[3] = {1024, 1024, 1024};
    rt_adapt_input_t p = {.busy = idle, .group_ok = 1, .queue = qp, .n_queue = 3,
                          .head_cached = 960};
    ck_assert_int_eq(rt_adapt_decide(&c, &p, &rank, NULL, NULL), RT_ADAPT_GROUP);
    /* the queue rule: others waiting -> an idle rank; alone -> the whole group */
    adapt_cost(&c, 2);
    c.group.a = 0.1; /* a group the cost model would always keep whole */
    rt_adapt_input_t qr = {.busy = idle, .group_ok = 1, .queue = q4, .n_queue = 4,
                           .rule = RT_ADAPT_QUEUE};
    ck_assert_int_eq(rt_adapt_decide(&c, &qr, &rank, NULL, NULL), RT_ADAPT_SOLO);
    ck_assert_int_eq(rank, 0);
    qr.n_queue = 1;
    ck_assert_int_eq(rt_adapt_decide(&c, &qr, &rank, NULL, NULL), RT_ADAPT_GROUP);
    double r0_busy[2] = {0.5, 0};
    qr.busy = r0_busy;
    qr.group_ok = 0; /* rank 0 runs a solo task */
    ck_assert_int_eq(rt_adapt_decide(&c, &qr, &rank, NULL, NULL), RT_ADAPT_SOLO);
    ck_assert_int_eq(rank, 1);
    qr.busy = both;
    ck_assert_int_eq(rt_adapt_decide(&c, &qr, &rank, NULL, NULL), RT_ADAPT_WAIT);
    /* only the group has been measured: the solo line follows it at the prior efficiency */
    rt_adapt_cost_t g1;
    adapt_cost(&g1, 2);
    for (int i = 0; i < 20; i++) rt_adapt_learn(&g1, 0, 300, 0, 0.5 * rt_adapt_tR(&bare_c, 300, 0));
    ck_assert(rt_adapt_t1(&g1, 300) < 0.6 * rt_adapt_t1(&bare_c, 300));
    /* one rank: never solo */
    adapt_cost(&c, 1);
    double idle1[1] = {0};
    rt_adapt_input_t r1 = {.busy = idle1, .group_ok = 1, .queue = q4, .n_queue = 4};
    ck_assert_int_eq(rt_adapt_decide(&c, &r1, &rank, NULL, NULL), RT_ADAPT_GROUP);
}
END_TEST

/* ---- batched prefill (router/batch.h): packing bounds and the queue's order --------------- */

START_TEST(test_batch_pack)
{
    int out[RT_BATCH_MAX];
    /* the lead is taken alone over the token budget; nothing else then fits */
    rt_batch_cand_t big[3] = {{3000, 1}, {10, 1}, {20, 1}};
    ck_assert_int_eq(rt_batch_pack(big, 3, 8, 2048, out), 1);
    ck_assert_int_eq(out[0], 0);
    /* first fit in queue order: 1500 + 600 is over 2048, 300 and 200 still fit */
    rt_batch_cand_t c[6] = {{1000, 1}, {500, 1}, {600, 1}, {300, 0}, {300, 1}, {200, 1}};
    ck_assert_int_eq(rt_batch_pack(c, 6, 8, 2048, out), 4);
    const int want[4] = {0, 1, 4, 5}; /* 1000 + 500 + 300 + 200 = 2000; [3] not eligible */
    for (int i = 0; i < 4; i++) ck_assert_int_eq(out[i], want[i]);
    /* the request bound, in order */
    ck_assert_int_eq(rt_batch_pack(c, 6, 2, 1 << 20, out), 2);
    ck_assert_int_eq(out[1], 1);
    /* exactly at the budget */
    rt_batch_cand_t e[3] = {{1024, 1}, {1024, 1}, {1, 1}};
    ck_assert_int_eq(rt_batch_pack(e, 3, 8, 2048, out), 2);
    /* bounds clamp to [1, RT_BATCH_MAX] */
    rt_batch_cand_t many[12];
    for (int i = 0; i < 12; i++) many[i] = (rt_batch_cand_t){10, 1};
    ck_assert_int_eq(rt_batch_pack(many, 12, 100, 1 << 20, out), RT_BATCH_MAX);
    ck_assert_int_eq(rt_batch_pack(many, 12, 0, 1 << 20, out), 1);
    ck_assert_int_eq(rt_batch_pack(many, 0, 8, 2048, out), 0);
}
END_TEST

START_TEST(test_batch_deadline_order)
{
    /* earlier deadline first; equal deadlines by admission */
    ck_assert(rt_batch_before(1.0, 9, 2.0, 1));
    ck_assert(!rt_batch_before(2.0, 1, 1.0, 9));
    ck_assert(rt_batch_before(5.0, 3, 5.0, 4));
    ck_assert(!rt_batch_before(5.0, 4, 5.0, 3));
    ck_assert(!rt_batch_before(5.0, 4, 5.0, 4));
    /* insertion from the tail as rt_req_enqueue does it gives a sorted, stable queue */
    const double dl[7] = {10, 4, 10, 2, 7, 4, 12};
    int q[7], n = 0;
    for (int id = 0; id < 7; id++) {
        int at = n;
        while (at > 0 && rt_batch_before(dl[id], (uint64_t)id, dl[q[at - 1]], (uint64_t)q[at - 1]))
            at--;
        memmove(q + at + 1, q + at, sizeof(int) * (size_t)(n - at));
        q[at] = id;
        n++;
    }
    const int want[7] = {3, 1, 5, 4, 0, 2, 6};
    for (int i = 0; i < 7; i++) ck_assert_int_eq(q[i], want[i]);
}
END_TEST

/* ---- protocol features (router/features.h): what a mixed-version mesh runs -------------- */

/* A group runs ordered only if every rank has the feature; the first rank without it is
 * named (the router's log line). The delta transfer only if the decode node and every rank
 * have it: a node or rank of an older version (features 0) gets the whole prompt. */
START_TEST(test_feat_rules)
{
    const uint64_t all = PDM_FEAT_PREFILL, old = 0;
    uint32_t lacking = 99;
    const uint64_t new2[2] = {all, all}, old_rank1[2] = {all, old}, old_rank0[3] = {old, all, old};
    ck_assert_int_eq(rt_feat_group_ordered(new2, 2, &lacking), 1);
    ck_assert_int_eq(rt_feat_group_ordered(old_rank1, 2, &lacking), 0);
    ck_assert_uint_eq(lacking, 1);
    ck_assert_int_eq(rt_feat_group_ordered(old_rank0, 3, &lacking), 0);
    ck_assert_uint_eq(lacking, 0);
    ck_assert_int_eq(rt_feat_group_ordered(new2, 0, &lacking), 0);
    /* a rank with only the delta bit (a future build could drop ordering) is not ordered */
    const uint64_t delta_only[2] = {all, PDM_FEAT_DELTA_KV};
    ck_assert_int_eq(rt_feat_group_ordered(delta_only, 2, NULL), 0);
    ck_assert_int_eq(rt_feat_delta(PDM_FEAT_DECODE, delta_only, 2), 1);

    ck_assert_int_eq(rt_feat_delta(PDM_FEAT_DECODE, new2, 2), 1);
    ck_assert_int_eq(rt_feat_delta(old, new2, 2), 0);              /* an older decode node */
    ck_assert_int_eq(rt_feat_delta(PDM_FEAT_DECODE, old_rank1, 2), 0); /* an older rank */
    const uint64_t ordered_only[1] = {PDM_FEAT_ORDERED_GROUP};
    ck_assert_int_eq(rt_feat_delta(PDM_FEAT_DECODE, ordered_only, 1), 0);
    ck_assert_int_eq(rt_feat_delta(PDM_FEAT_DECODE, new2, 0), 0);
    /* unknown bits of a newer node change nothing */
    const uint64_t newer[2] = {all | 1ull << 40, all};
    ck_assert_int_eq(rt_feat_group_ordered(newer, 2, NULL), 1);
    ck_assert_int_eq(rt_feat_delta(PDM_FEAT_DECODE | 1ull << 63, newer, 2), 1);

    char buf[64];
    pdm_feat_format(0, buf, sizeof(buf));
    ck_assert_str_eq(buf, "none");
    pdm_feat_format(PDM_FEAT_PREFILL, buf, sizeof(buf));
    ck_assert_str_eq(buf, "ordered_group,delta_kv");
    pdm_feat_format(PDM_FEAT_DELTA_KV | 1ull << 5, buf, sizeof(buf));
    ck_assert_str_eq(buf, "delta_kv,bit5");
    pdm_feat_format(PDM_FEAT_PREFILL, buf, 8); /* cut, terminated */
    ck_assert_str_eq(buf, "ordered");
}
END_TEST

Suite *suite_router(void)
{
    Suite *s = suite_create("router");
    TCase *tc = tcase_create("metrics");
    tcase_add_test(tc, test_metrics_render);
    tcase_add_test(tc, test_metrics_series_bound);
    suite_add_tcase(s, tc);
    TCase *tl = tcase_create("local_prefill");
    tcase_add_test(tl, test_decode_local_prefill);
    tcase_add_test(tl, test_decode_prefix_pool);
    tcase_add_test(tl, test_decode_pool_events);
    tcase_add_test(tl, test_decode_pool_delta);
    tcase_add_test(tl, test_decode_dropped_stream);
    tcase_add_test(tl, test_decode_pool_file_tier);
    tcase_add_test(tl, test_decode_window_local);
    tcase_add_test(tl, test_decode_migration_resume);
    tcase_add_test(tl, test_decode_nsamp_node);
    tcase_add_test(tl, test_decode_nsamp_resume);
    suite_add_tcase(s, tl);
    TCase *ta = tcase_create("adaptive");
    tcase_add_test(ta, test_adapt_cost_model);
    tcase_add_test(ta, test_adapt_decide);
    suite_add_tcase(s, ta);
    TCase *tb = tcase_create("batch");
    tcase_add_test(tb, test_batch_pack);
    tcase_add_test(tb, test_batch_deadline_order);
    suite_add_tcase(s, tb);
    TCase *tf = tcase_create("features");
    tcase_add_test(tf, test_feat_rules);
    suite_add_tcase(s, tf);
    return s;
}
