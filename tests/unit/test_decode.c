/*
 * test_decode.c - the decode node's batched step equals decoding each sequence alone, with
 * sequences of different lengths joining and leaving the batch.
 *
 * Tolerance: logits within 1e-4 * max(1, |logit|max). The batched step computes each row with
 * the same kernels as a batch of one; with f32 weights no activation quantization is involved.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/pdm.h"
#include "decode_node/decode.h"
#include "tests.h"

static pdm_model_t *tiny_model(pdm_dtype_t wtype)
{
    char path[600];
    snprintf(path, sizeof(path), "%s/decode-model-%d.gguf", pdm_test_tmpdir(), (int)wtype);
    pdm_testmodel_params_t p;
    pdm_testmodel_params_default(&p);
    p.n_layers = 2;
    p.d_model = 64;
    p.n_heads = 4;
    p.n_kv_heads = 2;
    p.n_ff = 96;
    p.wtype = wtype;
    p.embtype = PDM_DT_F32;
    p.seed = 3;
    ck_assert_int_eq(pdm_testmodel_write(path, &p), 0);
    pdm_model_t *m;
    ck_assert_int_eq(pdm_model_load(path, &m), 0);
    return m;
}

static void run_batched_vs_alone(pdm_dtype_t wtype, double tol, int contiguous)
{
    pdm_model_t *m = tiny_model(wtype);
    const uint32_t V = m->hp.n_vocab;
    enum { NSEQ = 4, STEPS = 12 };
    const int prompt_len[NSEQ] = {1, 7, 20, 13};
    const int join_at[NSEQ] = {0, 0, 3, 5};   /* step at which a sequence joins */
    const int leave_at[NSEQ] = {12, 6, 12, 9}; /* step at which it leaves */
    pdm_model_ctx_t *ctx_b, *ctx_a;
    ck_assert_int_eq(pdm_model_ctx_create(m, 2, NSEQ, &ctx_b), 0);
    ck_assert_int_eq(pdm_model_ctx_create(m, 1, 32, &ctx_a), 0);
    pdm_act_t act;
    ck_assert_int_eq(pdm_act_alloc(&m->hp, NSEQ, &act), 0);
    pdm_kv_cache_t *cb[NSEQ], *ca[NSEQ];
    float *lb[NSEQ], *la[NSEQ];
    int32_t next_b[NSEQ], next_a[NSEQ];
    uint64_t seed = 11;
    for (int s = 0; s < NSEQ; s++) {
        int32_t ids[32];
        for (int i = 0; i < prompt_len[s]; i++) ids[i] = (int32_t)(pdm_splitmix64(&seed) % V);
        ck_assert_int_eq(pdm_kv_cache_create(&m->hp, 64, PDM_DT_F32, &cb[s]), 0);
        ck_assert_int_eq(pdm_kv_cache_create(&m->hp, 64, PDM_DT_F32, &ca[s]), 0);
        lb[s] = malloc(sizeof(float) * V);
        la[s] = malloc(sizeof(float) * V);
        ck_assert_int_eq(pdm_model_prefill(ctx_a, cb[s], ids, prompt_len[s], lb[s]), 0);
        ck_assert_int_eq(pdm_model_prefill(ctx_a, ca[s], ids, prompt_len[s], la[s]), 0);
        next_b[s] = pdm_test_argmax(lb[s], V);
        next_a[s] = pdm_test_argmax(la[s], V);
    }
    float *rows = malloc(sizeof(float) * V * NSEQ); /* one [n][V] array of outputs */
    for (int step = 0; step < STEPS; step++) {
        pdm_decode_seq_t batch[NSEQ];
        int n = 0, who[NSEQ];
        for (int s = 0; s < NSEQ; s++)
            if (step >= join_at[s] && step < leave_at[s]) {
                batch[n] = (pdm_decode_seq_t){cb[s], next_b[s],
                                              contiguous ? rows + (size_t)n * V : lb[s]};
                who[n++] = s;
            }
        ck_assert_int_eq(pdm_decode_step(ctx_b, &act, batch, n), 0);
        for (int k = 0; k < n; k++) {
            int s = who[k];
            if (contiguous) memcpy(lb[s], batch[k].logits, sizeof(float) * V);
            ck_assert_int_eq(pdm_model_decode(ctx_a, ca[s], next_a[s], la[s]), 0);
            double maxv = 1, diff = 0;
            for (uint32_t i = 0; i < V; i++) {
                maxv = fmax(maxv, fabs(la[s][i]));
                diff = fmax(diff, fabs(la[s][i] - lb[s][i]));
            }
            ck_assert_msg(diff <= tol * maxv, "step %d seq %d: logits differ by %g", step, s,
                          diff);
            next_b[s] = pdm_test_argmax(lb[s], V);
            next_a[s] = pdm_test_argmax(la[s], V);
            ck_assert_int_eq(next_a[s], next_b[s]);
            ck_assert_int_eq(ca[s]->n_tokens, cb[s]->n_tokens);
        }
    }
    /* A full cache is refused without changing anything. */
    cb[0]->n_tokens = cb[0]->capacity;
    pdm_decode_seq_t full = {cb[0], 1, lb[0]};
    ck_assert_int_eq(pdm_decode_step(ctx_b, &act, &full, 1), PDM_EOVERFLOW);
    ck_assert_int_eq(cb[0]->n_tokens, cb[0]->capacity);
    free(rows);
    for (int s = 0; s < NSEQ; s++) {
        pdm_kv_cache_destroy(cb[s]);
        pdm_kv_cache_destroy(ca[s]);
        free(lb[s]);
        free(la[s]);
    }
    pdm_act_free(&act);
    pdm_model_ctx_destroy(ctx_b);
    pdm_model_ctx_destroy(ctx_a);
    pdm_model_free(m);
}

START_TEST(test_decode_batched_f32) { run_batched_vs_alone(PDM_DT_F32, 1e-4, 0); }
END_TEST
START_TEST(test_decode_batched_q8) { run_batched_vs_alone(PDM_DT_Q8_0, 1e-4, 0); }
END_TEST
/* Outputs as rows of one array: the logits of all sequences in one matrix product. */
START_TEST(test_decode_batched_logits) { run_batched_vs_alone(PDM_DT_Q8_0, 1e-4, 1); }
END_TEST

/* Naive sliding-window reference: every token in one big cache; token at position p attends
 * to positions [max(0, p - window), p]. */
static void naive_window_step(pdm_model_ctx_t *ctx, pdm_act_t *act, pdm_kv_cache_t *c,
                              int32_t window, const int32_t *tokens, int n, float *logits)
{
    int32_t pos[64];
    for (int i = 0; i < n; i++) pos[i] = c->n_tokens + i;
    ck_assert_int_eq(pdm_model_embed(ctx, tokens, pos, n, act), 0);
    const int32_t first = PDM_MAX(0, c->n_tokens + n - 1 - window);
    ck_assert(n == 1 || first == 0); /* batches only before the window fills */
    for (int l = 0; l < (int)c->n_layers; l++) {
        pdm_model_attn_in(ctx, l, act);
        pdm_model_kv_store(ctx, c, l, act, c->n_tokens);
        pdm_kv_view_t view;
        pdm_kv_cache_view(c, (uint32_t)l, first, c->n_tokens + n - first, &view);
        pdm_model_attention(ctx, l, act, &view, 1);
        pdm_model_attn_out_ffn(ctx, l, act);
    }
    pdm_model_logits(ctx, act, n - 1, logits);
    c->n_tokens += n;
}

/* Generation far beyond S through the static window equals the naive sliding window; copies
 * happen once every reserve - (S - 1) tokens. */
static void run_window(double r)
{
    pdm_model_t *m = tiny_model(PDM_DT_F32);
    const uint32_t V = m->hp.n_vocab;
    const int32_t S = 16, prompt = 10, gen = 70;
    pdm_model_ctx_t *ctx;
    ck_assert_int_eq(pdm_model_ctx_create(m, 1, 16, &ctx), 0);
    pdm_act_t act;
    ck_assert_int_eq(pdm_act_alloc(&m->hp, 16, &act), 0);
    pdm_kvwin_t *w;
    ck_assert_int_eq(pdm_kvwin_create(&m->hp, S, r, PDM_DT_F32, &w), 0);
    pdm_kv_cache_t *ref;
    ck_assert_int_eq(pdm_kv_cache_create(&m->hp, prompt + gen + 1, PDM_DT_F32, &ref), 0);
    float *lw = malloc(sizeof(float) * V), *lr = malloc(sizeof(float) * V);
    int32_t ids[16];
    uint64_t seed = 9;
    for (int i = 0; i < prompt; i++) ids[i] = (int32_t)(pdm_splitmix64(&seed) % V);
    ck_assert_int_eq(pdm_kvwin_forward(ctx, &act, w, ids, prompt, lw), 0);
    naive_window_step(ctx, &act, ref, S - 1, ids, prompt, lr);
    /* Simulated copy count: the window end advances by one per token; a copy when full. */
    int32_t end = S - 1;
    uint64_t expect_copies = 0;
    if (end + prompt > w->reserve) end = PDM_MIN(S - 1, w->reserve - prompt); /* nothing valid */
    end += prompt;
    for (int t = 0; t < gen; t++) {
        for (uint32_t i = 0; i < V; i++)
            ck_assert_msg(fabsf(lw[i] - lr[i]) <= 1e-5f * fmaxf(1, fabsf(lr[i])),
                          "r=%.1f token %d: logit %u %g vs %g", r, t, i, lw[i], lr[i]);
        int32_t next = pdm_test_argmax(lw, V);
        ck_assert_int_eq(next, pdm_test_argmax(lr, V));
        if (end + 1 > w->reserve) {
            expect_copies++;
            end = S - 1;
        }
        end++;
        ck_assert_int_eq(pdm_kvwin_forward(ctx, &act, w, &next, 1, lw), 0);
        naive_window_step(ctx, &act, ref, S - 1, &next, 1, lr);
    }
    ck_assert_uint_eq(w->copies, expect_copies);
    ck_assert_int_eq(w->n_valid, S - 1);
    /* Copies per generated token: 1 / (reserve - (S - 1)) in the steady state. */
    const double per_token = (double)w->copies / gen;
    const double model = 1.0 / (w->reserve - (S - 1));
    ck_assert_msg(fabs(per_token - model) < 0.05, "r=%.1f: %.3f copies per token, model %.3f", r,
                  per_token, model);
    if (getenv("PDM_TEST_VERBOSE"))
        fprintf(stderr, "static window S=%d r=%.1f: reserve %d rows, %llu copies in %d tokens "
                "(%.3f per token), %.0f bytes moved per generated token\n", S, r, w->reserve,
                (unsigned long long)w->copies, gen, per_token, (double)w->bytes_moved / gen);
    /* A batch that would slide inside itself is refused. */
    ck_assert_int_eq(pdm_kvwin_forward(ctx, &act, w, ids, 2, lw), PDM_EINVAL);
    free(lw);
    free(lr);
    pdm_kv_cache_destroy(ref);
    pdm_kvwin_destroy(w);
    pdm_act_free(&act);
    pdm_model_ctx_destroy(ctx);
    pdm_model_free(m);
}

START_TEST(test_window_r2) { run_window(2.0); }
END_TEST
START_TEST(test_window_r15) { run_window(1.5); }
END_TEST

START_TEST(test_window_bad_params)
{
    pdm_model_t *m = tiny_model(PDM_DT_F32);
    pdm_kvwin_t *w;
    ck_assert_int_eq(pdm_kvwin_create(&m->hp, 1, 2.0, PDM_DT_F32, &w), PDM_EINVAL);
    ck_assert_int_eq(pdm_kvwin_create(&m->hp, 16, 1.2, PDM_DT_F32, &w), PDM_EINVAL);
    pdm_model_free(m);
}
END_TEST

Suite *suite_decode(void)
{
    Suite *s = suite_create("decode");
    TCase *tc = tcase_create("step");
    tcase_add_test(tc, test_decode_batched_f32);
    tcase_add_test(tc, test_decode_batched_q8);
    tcase_add_test(tc, test_decode_batched_logits);
    tcase_add_test(tc, test_window_r2);
    tcase_add_test(tc, test_window_r15);
    tcase_add_test(tc, test_window_bad_params);
    suite_add_tcase(s, tc);
    return s;
}
