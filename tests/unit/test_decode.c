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

/* ---- Windowed layers (Gemma 3's local layers on the static window) -------------------- */

/* The gemma3 preset (5 local : 1 global layers, head_dim 256, one KV head) with F32 weights
 * and a local window of `window` tokens. */
static pdm_model_t *gemma3_model(uint32_t window)
{
    char path[600];
    snprintf(path, sizeof(path), "%s/decode-gemma3-w%u.gguf", pdm_test_tmpdir(), window);
    pdm_testmodel_params_t p;
    ck_assert_int_eq(pdm_testmodel_params_preset(&p, "gemma3"), 0);
    p.wtype = PDM_DT_F32;
    p.embtype = PDM_DT_F32;
    p.n_swa = window;
    ck_assert_int_eq(pdm_testmodel_write(path, &p), 0);
    pdm_model_t *m;
    ck_assert_int_eq(pdm_model_load(path, &m), 0);
    return m;
}

static double max_rel_diff(const float *a, const float *b, uint32_t n)
{
    double maxv = 1, diff = 0;
    for (uint32_t i = 0; i < n; i++) {
        maxv = fmax(maxv, fabs(b[i]));
        diff = fmax(diff, fabs((double)a[i] - b[i]));
    }
    return diff / maxv;
}

/* Windowed caches equal full ones (full KV + the mask): two sequences whose prompts and
 * generations run far past the window, decoded in one continuous batch (one joins late),
 * their windowed caches filled (a) by the local prefill in chunks of win_rows - (S - 1)
 * (the full cache is prefilled in the same chunks: a batch's size changes its rounding) and
 * (b) as the decode node fills them from a KV stream: every layer's prompt rows computed
 * elsewhere, the windowed layers keeping the last S - 1 (pdm_kv_cache_window_fill). Logits
 * within 1e-5 relative, same greedy tokens; copies once every win_rows - (S - 1) tokens. */
static void run_window_layers(pdm_dtype_t kv, double r, int streamed)
{
    const uint32_t S = 24;
    pdm_model_t *m = gemma3_model(S);
    const uint32_t V = m->hp.n_vocab;
    enum { NSEQ = 2 };
    const int32_t prompt[NSEQ] = {70, 9}, gen = 90, join_at[NSEQ] = {0, 20};
    const int32_t cap = 70 + gen + 1;
    pdm_model_ctx_t *ctx;
    ck_assert_int_eq(pdm_model_ctx_create(m, 1, 32, &ctx), 0);
    pdm_act_t act;
    ck_assert_int_eq(pdm_act_alloc(&m->hp, NSEQ, &act), 0);
    pdm_kv_cache_t *cw[NSEQ], *cf[NSEQ];
    float *lw[NSEQ], *lf[NSEQ];
    int32_t next[NSEQ];
    uint64_t seed = 21;
    const pdm_kv_cache_params_t wp = {.capacity = cap, .dtype = kv, .model = m,
                                      .window_reserve = r};
    for (int s = 0; s < NSEQ; s++) {
        int32_t ids[80];
        for (int i = 0; i < prompt[s]; i++) ids[i] = (int32_t)(pdm_splitmix64(&seed) % V);
        lw[s] = malloc(sizeof(float) * V);
        lf[s] = malloc(sizeof(float) * V);
        ck_assert_int_eq(pdm_kv_cache_create(&m->hp, cap, kv, &cf[s]), 0);
        ck_assert_int_eq(pdm_kv_cache_create_params(&m->hp, &wp, &cw[s]), 0);
        ck_assert_ptr_nonnull(cw[s]->windowed);
        ck_assert_int_eq(cw[s]->win_keep, (int32_t)S - 1);
        ck_assert_int_eq(cw[s]->win_rows, (int32_t)ceil(r * (S - 1)));
        ck_assert_int_lt(pdm_kv_cache_bytes(cw[s]), pdm_kv_cache_bytes(cf[s]));
        /* the full cache in the chunks the windowed prefill takes (win_rows - (S - 1)
         * tokens), so that both round alike; streamed: in one batch, as a prefill rank */
        const int32_t chunk = streamed ? prompt[s] : pdm_kv_cache_append_max(cw[s]);
        for (int32_t c0 = 0; c0 < prompt[s]; c0 += chunk)
            ck_assert_int_eq(pdm_model_prefill(ctx, cf[s], ids + c0,
                                               PDM_MIN(chunk, prompt[s] - c0), lf[s]), 0);
        if (streamed) { /* the decode node's receive path: full rows, then the window */
            const size_t row = pdm_dtype_row_bytes(kv, m->hp.head_dim);
            for (uint32_t l = 0; l < m->hp.n_layers; l++)
                for (uint32_t h = 0; !cw[s]->windowed[l] && h < m->hp.n_kv_heads; h++) {
                    memcpy(pdm_kv_cache_k(cw[s], l, h), pdm_kv_cache_k(cf[s], l, h),
                           row * (size_t)prompt[s]);
                    memcpy(pdm_kv_cache_v(cw[s], l, h), pdm_kv_cache_v(cf[s], l, h),
                           row * (size_t)prompt[s]);
                }
            pdm_kv_cache_window_fill(cw[s], cf[s]->k, cf[s]->v, prompt[s]);
            memcpy(cw[s]->scale, cf[s]->scale,
                   sizeof(float) * 2 * m->hp.n_layers * m->hp.n_kv_heads);
            cw[s]->scales_fixed = cf[s]->scales_fixed;
            cw[s]->n_tokens = prompt[s];
            memcpy(lw[s], lf[s], sizeof(float) * V);
            ck_assert_int_eq(cw[s]->win_first, PDM_MAX(0, prompt[s] - (int32_t)S + 1));
        } else {
            ck_assert_int_eq(pdm_model_prefill(ctx, cw[s], ids, prompt[s], lw[s]), 0);
            ck_assert_msg(max_rel_diff(lw[s], lf[s], V) <= 1e-5, "prompt %d: logits differ by "
                          "%g", s, max_rel_diff(lw[s], lf[s], V));
        }
        next[s] = pdm_test_argmax(lf[s], V);
        ck_assert_int_eq(pdm_test_argmax(lw[s], V), next[s]);
    }
    double worst = 0;
    for (int step = 0; step < gen; step++) {
        pdm_decode_seq_t bw[NSEQ], bf[NSEQ];
        int n = 0, who[NSEQ];
        for (int s = 0; s < NSEQ; s++)
            if (step >= join_at[s]) {
                bw[n] = (pdm_decode_seq_t){cw[s], next[s], lw[s]};
                bf[n] = (pdm_decode_seq_t){cf[s], next[s], lf[s]};
                who[n++] = s;
            }
        ck_assert_int_eq(pdm_decode_step(ctx, &act, bw, n), 0);
        ck_assert_int_eq(pdm_decode_step(ctx, &act, bf, n), 0);
        for (int k = 0; k < n; k++) {
            const int s = who[k];
            const double d = max_rel_diff(lw[s], lf[s], V);
            worst = fmax(worst, d);
            ck_assert_msg(d <= 1e-5, "%s r=%.1f step %d seq %d: logits differ by %g",
                          pdm_dtype_name(kv), r, step, s, d);
            next[s] = pdm_test_argmax(lf[s], V);
            ck_assert_int_eq(pdm_test_argmax(lw[s], V), next[s]);
            ck_assert_int_eq(cw[s]->n_tokens, cf[s]->n_tokens);
        }
    }
    /* The kept rows never fall behind the window: S - 1 before the next token. */
    for (int s = 0; s < NSEQ; s++)
        ck_assert_int_le(cw[s]->win_first, cw[s]->n_tokens - (int32_t)(S - 1));
    /* Sequence 1 decoded gen - 20 steps from 9 tokens: its copies follow the note's rule,
     * one per win_rows - (S - 1) tokens once the rows run out. */
    const pdm_kv_cache_t *c1 = cw[1];
    int32_t first = 0;
    uint64_t copies = 0;
    for (int32_t t = prompt[1]; t < c1->n_tokens; t++)
        if (t + 1 - first > c1->win_rows) {
            first = t - c1->win_keep;
            copies++;
        }
    ck_assert_uint_eq(c1->win_copies, copies);
    ck_assert_int_eq(c1->win_first, first);
    if (getenv("PDM_TEST_VERBOSE"))
        fprintf(stderr, "windowed layers %s r=%.1f %s: worst logit difference %g, KV %zu vs "
                "%zu bytes, %llu copies\n", pdm_dtype_name(kv), r, streamed ? "streamed" :
                "prefilled", worst, pdm_kv_cache_bytes(cw[0]), pdm_kv_cache_bytes(cf[0]),
                (unsigned long long)cw[0]->win_copies);
    for (int s = 0; s < NSEQ; s++) {
        pdm_kv_cache_destroy(cw[s]);
        pdm_kv_cache_destroy(cf[s]);
        free(lw[s]);
        free(lf[s]);
    }
    pdm_act_free(&act);
    pdm_model_ctx_destroy(ctx);
    pdm_model_free(m);
}

START_TEST(test_window_layers_f32) { run_window_layers(PDM_DT_F32, 2.0, 0); }
END_TEST
START_TEST(test_window_layers_f16_r15) { run_window_layers(PDM_DT_F16, 1.5, 0); }
END_TEST
START_TEST(test_window_layers_streamed) { run_window_layers(PDM_DT_F32, 2.0, 1); }
END_TEST
/* int8 KV: the scales come with the stream (fixed at prefill), rows are appended with them. */
START_TEST(test_window_layers_q8_streamed) { run_window_layers(PDM_DT_I8, 2.0, 1); }
END_TEST

/* Layout and accounting: which layers are windowed, bytes per layer kind, slots the node
 * counts, when a cache stays full (short sequences, r = 0, no local layer), bad reserves. */
START_TEST(test_window_layers_layout)
{
    pdm_model_t *m = gemma3_model(16);
    uint32_t n_local = 0;
    for (uint32_t l = 0; l < m->hp.n_layers; l++) n_local += m->layers[l].window > 0;
    ck_assert_uint_gt(n_local, 0);
    pdm_kv_cache_layout_t lay;
    pdm_kv_cache_params_t p = {.capacity = 1000, .dtype = PDM_DT_F16, .model = m,
                               .window_reserve = 2};
    ck_assert_int_eq(pdm_kv_cache_layout(&m->hp, &p, &lay), 0);
    ck_assert_int_eq(lay.win_rows, 30);
    ck_assert_int_eq(lay.win_keep, 15);
    ck_assert_uint_eq(lay.n_windowed, n_local);
    ck_assert_uint_eq(lay.n_full + lay.n_windowed, m->hp.n_layers);
    const size_t head_row = (size_t)m->hp.head_dim * 2; /* f16 */
    ck_assert_uint_eq(lay.win_bytes, (size_t)n_local * m->hp.n_kv_heads * 2 * 30 * head_row);
    ck_assert_uint_eq(lay.full_bytes,
                      (size_t)(m->hp.n_layers - n_local) * m->hp.n_kv_heads * 2 * 1000 * head_row);
    pdm_kv_cache_t *c;
    ck_assert_int_eq(pdm_kv_cache_create_params(&m->hp, &p, &c), 0);
    ck_assert_uint_eq(pdm_kv_cache_bytes(c), lay.win_bytes + lay.full_bytes);
    ck_assert_int_eq(pdm_kv_cache_append_max(c), 15);
    ck_assert_int_eq(pdm_kv_cache_room(c, 16), PDM_EOVERFLOW);
    pdm_kv_cache_destroy(c);
    /* slots: ceil((n_full * n + n_windowed * rows) / n_layers) */
    const int64_t want = ((int64_t)(m->hp.n_layers - n_local) * 1000 + (int64_t)n_local * 30 +
                          m->hp.n_layers - 1) / m->hp.n_layers;
    ck_assert_int_eq(pdm_kvwin_slots(m->hp.n_layers, n_local, 30, 1000), want);
    ck_assert_int_eq(pdm_kvwin_slots(m->hp.n_layers, n_local, 30, 20), 20);
    pdm_kvwin_plan_t wp;
    ck_assert_int_eq(pdm_kvwin_plan(m, PDM_DT_F16, 2, 600, 400, &wp), 0);
    ck_assert_int_eq(wp.slots, want);
    ck_assert_int_eq(wp.stage_slots,
                     ((int64_t)n_local * 600 + m->hp.n_layers - 1) / m->hp.n_layers);
    ck_assert_int_eq(pdm_kvwin_plan(m, PDM_DT_F16, 2, 20, 4, &wp), 0); /* fits the rows */
    ck_assert_int_eq(wp.slots, 24);
    ck_assert_int_eq(wp.stage_slots, 0);
    /* full caches: too short to gain, r = 0 */
    p.capacity = 30;
    ck_assert_int_eq(pdm_kv_cache_create_params(&m->hp, &p, &c), 0);
    ck_assert_ptr_null(c->windowed);
    pdm_kv_cache_destroy(c);
    p.capacity = 1000;
    p.window_reserve = 0;
    ck_assert_int_eq(pdm_kv_cache_create_params(&m->hp, &p, &c), 0);
    ck_assert_ptr_null(c->windowed);
    pdm_kv_cache_destroy(c);
    p.window_reserve = 1.2;
    ck_assert_int_eq(pdm_kv_cache_create_params(&m->hp, &p, &c), PDM_EINVAL);
    /* a q8 prompt prefill needs every row of the prompt at once: refused, not miscomputed */
    p.window_reserve = 2;
    p.dtype = PDM_DT_I8;
    ck_assert_int_eq(pdm_kv_cache_create_params(&m->hp, &p, &c), 0);
    pdm_model_ctx_t *ctx;
    ck_assert_int_eq(pdm_model_ctx_create(m, 1, 8, &ctx), 0);
    int32_t ids[40] = {0};
    ck_assert_int_eq(pdm_model_prefill(ctx, c, ids, 40, NULL), PDM_EUNSUPPORTED);
    ck_assert_int_eq(c->n_tokens, 0);
    pdm_model_ctx_destroy(ctx);
    pdm_kv_cache_destroy(c);
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
    TCase *tw = tcase_create("windowed-layers");
    tcase_add_test(tw, test_window_layers_f32);
    tcase_add_test(tw, test_window_layers_f16_r15);
    tcase_add_test(tw, test_window_layers_streamed);
    tcase_add_test(tw, test_window_layers_q8_streamed);
    tcase_add_test(tw, test_window_layers_layout);
    suite_add_tcase(s, tw);
    return s;
}
