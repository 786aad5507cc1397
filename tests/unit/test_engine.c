/*
 * test_engine.c - the forward pass on random test models: batched prefill, token-by-token
 * decode, chunking, split KV views and every kernel variant agree with each other and with an
 * independent naive implementation written here (llama2.c style, f64 accumulation).
 *
 * Tolerances: against the naive reference, max |logit difference| <= 2e-3 for f32/f16
 * weights with f32 KV; between engine paths with identical numerics (chunking, views,
 * prefill vs decode) <= 1e-4; between kernel variants <= 2e-2 on Q4_1 models (activation
 * quantization may round one step differently).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model/model.h"
#include "tests.h"

static char *make_model(const char *tag, uint32_t heads, uint32_t kv_heads, uint32_t d_model,
                        pdm_dtype_t wtype, int tied)
{
    static char path[512];
    snprintf(path, sizeof(path), "%s/engine-%s.gguf", pdm_test_tmpdir(), tag);
    pdm_testmodel_params_t p;
    pdm_testmodel_params_default(&p);
    p.n_heads = heads;
    p.n_kv_heads = kv_heads;
    p.d_model = d_model;
    p.n_ff = 2 * d_model + 32;
    p.n_layers = 3;
    p.wtype = wtype;
    p.embtype = wtype == PDM_DT_F32 || wtype == PDM_DT_F16 ? wtype : PDM_DT_Q8_0;
    p.tied = tied;
    p.seed = heads * 131 + kv_heads;
    ck_assert_msg(pdm_testmodel_write(path, &p) == PDM_OK, "%s", pdm_error_last());
    return path;
}

static pdm_model_t *load(const char *path)
{
    pdm_model_t *m = NULL;
    ck_assert_msg(pdm_model_load(path, &m) == PDM_OK, "%s", pdm_error_last());
    return m;
}

static void random_tokens(int32_t *t, int n, int n_vocab, unsigned seed)
{
    for (int i = 0; i < n; i++) {
        seed = seed * 1103515245u + 12345u;
        t[i] = (int32_t)((seed >> 8) % (unsigned)n_vocab);
    }
}

/* ---- naive reference ----------------------------------------------------------------- */

static float *dequant_mat(const pdm_kern_mat_t *m)
{
    float *w = malloc((size_t)m->rows * m->cols * sizeof(float));
    for (int64_t r = 0; r < m->rows; r++)
        pdm_dequantize_row(m->type, (const char *)m->data + r * m->row_bytes, w + r * m->cols,
                           m->cols);
    return w;
}

static void naive_matvec(const float *w, const float *x, float *y, int rows, int cols)
{
    for (int r = 0; r < rows; r++) {
        double s = 0;
        for (int c = 0; c < cols; c++) s += (double)w[(size_t)r * cols + c] * x[c];
        y[r] = (float)s;
    }
}

static void naive_rmsnorm(float *o, const float *x, const float *w, int n, float eps)
{
    double ss = 0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    double sc = 1.0 / sqrt(ss / n + eps);
    for (int i = 0; i < n; i++) o[i] = (float)(x[i] * sc * w[i]);
}

static void naive_rope(float *v, int heads, int hd, int pos, float theta)
{
    for (int h = 0; h < heads; h++)
        for (int i = 0; i < hd / 2; i++) {
            double ang = pos * pow(theta, -2.0 * i / hd);
            float a = v[h * hd + 2 * i], b = v[h * hd + 2 * i + 1];
            v[h * hd + 2 * i] = (float)(a * cos(ang) - b * sin(ang));
            v[h * hd + 2 * i + 1] = (float)(a * sin(ang) + b * cos(ang));
        }
}

/* Logits of the last token of `tokens`, computed the plain way over the whole sequence. */
static void naive_forward(const pdm_model_t *m, const int32_t *tokens, int n, float *logits)
{
    const pdm_model_hparams_t *hp = &m->hp;
    int d = (int)hp->d_model, hd = (int)hp->head_dim, nh = (int)hp->n_heads,
        nkv = (int)hp->n_kv_heads, ff = (int)hp->n_ff;
    int qd = nh * hd, kvd = nkv * hd;
    float *x = malloc((size_t)n * d * sizeof(float)), *xn = malloc(d * sizeof(float));
    float *q = malloc((size_t)n * qd * sizeof(float)), *k = malloc((size_t)n * kvd * sizeof(float));
    float *v = malloc((size_t)n * kvd * sizeof(float)), *att = malloc(qd * sizeof(float));
    float *tmp = malloc(PDM_MAX(d, ff) * sizeof(float)), *g = malloc(ff * sizeof(float)),
          *u = malloc(ff * sizeof(float));
    float *emb = dequant_mat(&m->tok_embd);
    for (int t = 0; t < n; t++) memcpy(x + (size_t)t * d, emb + (size_t)tokens[t] * d, d * sizeof(float));
    for (uint32_t l = 0; l < hp->n_layers; l++) {
        const pdm_model_layer_t *L = &m->layers[l];
        float *wq = dequant_mat(&L->wq), *wk = dequant_mat(&L->wk), *wv = dequant_mat(&L->wv);
        float *wo = dequant_mat(&L->wo), *wg = dequant_mat(&L->w_gate), *wu = dequant_mat(&L->w_up);
        float *wd = dequant_mat(&L->w_down);
        for (int t = 0; t < n; t++) {
            naive_rmsnorm(xn, x + (size_t)t * d, L->attn_norm, d, hp->rms_eps);
            naive_matvec(wq, xn, q + (size_t)t * qd, qd, d);
            naive_matvec(wk, xn, k + (size_t)t * kvd, kvd, d);
            naive_matvec(wv, xn, v + (size_t)t * kvd, kvd, d);
            naive_rope(q + (size_t)t * qd, nh, hd, t, hp->rope_theta);
            naive_rope(k + (size_t)t * kvd, nkv, hd, t, hp->rope_theta);
        }
        for (int t = 0; t < n; t++) {
            for (int h = 0; h < nh; h++) {
                int kh = h / (nh / nkv);
                double *s = malloc((t + 1) * sizeof(double)), mx = -1e300, sum = 0;
                for (int j = 0; j <= t; j++) {
                    double dot = 0;
                    for (int e = 0; e < hd; e++)
                        dot += (double)q[(size_t)t * qd + h * hd + e] * k[(size_t)j * kvd + kh * hd + e];
                    s[j] = dot / sqrt((double)hd);
                    if (s[j] > mx) mx = s[j];
                }
                for (int j = 0; j <= t; j++) sum += exp(s[j] - mx);
                for (int e = 0; e < hd; e++) {
                    double o = 0;
                    for (int j = 0; j <= t; j++) o += exp(s[j] - mx) / sum * v[(size_t)j * kvd + kh * hd + e];
                    att[h * hd + e] = (float)o;
                }
                free(s);
            }
            float *xt = x + (size_t)t * d;
            naive_matvec(wo, att, tmp, d, qd);
            for (int i = 0; i < d; i++) xt[i] += tmp[i];
            naive_rmsnorm(xn, xt, L->ffn_norm, d, hp->rms_eps);
            naive_matvec(wg, xn, g, ff, d);
            naive_matvec(wu, xn, u, ff, d);
            for (int i = 0; i < ff; i++) g[i] = (float)(g[i] / (1 + exp(-(double)g[i])) * u[i]);
            naive_matvec(wd, g, tmp, d, ff);
            for (int i = 0; i < d; i++) xt[i] += tmp[i];
        }
        free(wq); free(wk); free(wv); free(wo); free(wg); free(wu); free(wd);
    }
    naive_rmsnorm(xn, x + (size_t)(n - 1) * d, m->output_norm, d, hp->rms_eps);
    float *wout = dequant_mat(&m->output);
    naive_matvec(wout, xn, logits, (int)hp->n_vocab, d);
    free(wout); free(emb); free(x); free(xn); free(q); free(k); free(v); free(att);
    free(tmp); free(g); free(u);
}

static float max_diff(const float *a, const float *b, int n)
{
    float m = 0;
    for (int i = 0; i < n; i++) {
        ck_assert(!isnan(a[i]) && !isnan(b[i]));
        m = fmaxf(m, fabsf(a[i] - b[i]));
    }
    return m;
}

/* Prefill of n tokens with the given batch size and KV dtype; returns the last logits. */
static float *run_prefill(pdm_model_t *m, const int32_t *tok, int n, int batch, pdm_dtype_t kvt,
                          const pdm_kern_ops_t *ops, pdm_kv_cache_t **cache_out)
{
    pdm_model_ctx_t *ctx;
    pdm_kv_cache_t *cache;
    ck_assert_int_eq(pdm_model_ctx_create(m, 2, batch, &ctx), PDM_OK);
    if (ops) pdm_model_ctx_set_ops(ctx, ops);
    ck_assert_int_eq(pdm_kv_cache_create(&m->hp, n + 8, kvt, &cache), PDM_OK);
    float *logits = malloc(m->hp.n_vocab * sizeof(float));
    ck_assert_msg(pdm_model_prefill(ctx, cache, tok, n, logits) == PDM_OK, "%s", pdm_error_last());
    ck_assert_int_eq(cache->n_tokens, n);
    pdm_model_ctx_destroy(ctx);
    if (cache_out) *cache_out = cache;
    else pdm_kv_cache_destroy(cache);
    return logits;
}

START_TEST(test_engine_vs_naive)
{
    /* GQA ratios 1, 3 and 8 (query heads per KV head), f32 and f16 weights */
    static const struct { uint32_t h, kv, d; pdm_dtype_t wt; } shapes[] = {
        {4, 4, 64, PDM_DT_F32}, {6, 2, 96, PDM_DT_F32}, {8, 1, 128, PDM_DT_F16},
        {3, 1, 96, PDM_DT_F32}};
    for (size_t s = 0; s < PDM_ARRAY_SIZE(shapes); s++) {
        char tag[32];
        snprintf(tag, sizeof(tag), "naive%zu", s);
        pdm_model_t *m = load(make_model(tag, shapes[s].h, shapes[s].kv, shapes[s].d, shapes[s].wt, s % 2));
        int32_t tok[41];
        random_tokens(tok, 41, (int)m->hp.n_vocab, 7 + (unsigned)s);
        float *want = malloc(m->hp.n_vocab * sizeof(float));
        naive_forward(m, tok, 41, want);
        float *got = run_prefill(m, tok, 41, 16, PDM_DT_F32, NULL, NULL);
        float diff = max_diff(got, want, (int)m->hp.n_vocab);
        ck_assert_msg(diff <= 2e-3f, "shape %zu: engine vs naive max |diff| %g", s, diff);
        free(want);
        free(got);
        pdm_model_free(m);
    }
}
END_TEST

START_TEST(test_prefill_decode_chunks_agree)
{
    pdm_model_t *m = load(make_model("q41", 4, 2, 64, PDM_DT_Q4_1, 1));
    const int n = 70;
    int32_t tok[70];
    random_tokens(tok, n, (int)m->hp.n_vocab, 3);
    pdm_kv_cache_t *c_full, *c_chunk;
    float *full = run_prefill(m, tok, n, 512, PDM_DT_F16, NULL, &c_full);
    float *chunked = run_prefill(m, tok, n, 7, PDM_DT_F16, NULL, &c_chunk);
    ck_assert_msg(max_diff(full, chunked, (int)m->hp.n_vocab) <= 1e-4f, "chunked prefill differs");
    /* the caches agree slot by slot */
    for (uint32_t l = 0; l < m->hp.n_layers; l++)
        for (uint32_t h = 0; h < m->hp.n_kv_heads; h++) {
            const uint16_t *a = pdm_kv_cache_k(c_full, l, h), *b = pdm_kv_cache_k(c_chunk, l, h);
            for (int i = 0; i < n * (int)m->hp.head_dim; i++)
                ck_assert_int_le(abs((int)a[i] - (int)b[i]), 1);
        }
    /* token by token decode gives the same last logits as one prefill */
    pdm_model_ctx_t *ctx;
    pdm_kv_cache_t *cache;
    ck_assert_int_eq(pdm_model_ctx_create(m, 2, 32, &ctx), PDM_OK);
    ck_assert_int_eq(pdm_kv_cache_create(&m->hp, n, PDM_DT_F16, &cache), PDM_OK);
    float *step = malloc(m->hp.n_vocab * sizeof(float));
    for (int i = 0; i < n; i++) ck_assert_int_eq(pdm_model_decode(ctx, cache, tok[i], step), PDM_OK);
    ck_assert_msg(max_diff(full, step, (int)m->hp.n_vocab) <= 1e-4f, "decode steps differ");
    /* the cache is full now: one more token is refused and nothing changes */
    ck_assert_int_eq(pdm_model_decode(ctx, cache, tok[0], step), PDM_EOVERFLOW);
    ck_assert_int_eq(cache->n_tokens, n);
    free(step);
    free(full);
    free(chunked);
    pdm_kv_cache_destroy(cache);
    pdm_kv_cache_destroy(c_full);
    pdm_kv_cache_destroy(c_chunk);
    pdm_model_ctx_destroy(ctx);
    pdm_model_free(m);
}
END_TEST

START_TEST(test_split_views)
{
    /* attention over the cache split into three views, given in shuffled order, equals
     * attention over one view: the basis of every parallel prefill method */
    pdm_model_t *m = load(make_model("views", 6, 2, 96, PDM_DT_Q4_1, 1));
    const int n = 50;
    int32_t tok[50];
    random_tokens(tok, n, (int)m->hp.n_vocab, 11);
    pdm_kv_cache_t *cache;
    float *logits = run_prefill(m, tok, n, 64, PDM_DT_F32, NULL, &cache);
    pdm_model_ctx_t *ctx;
    ck_assert_int_eq(pdm_model_ctx_create(m, 2, 64, &ctx), PDM_OK);
    pdm_act_t a1, a2;
    ck_assert_int_eq(pdm_act_alloc(&m->hp, n, &a1), PDM_OK);
    ck_assert_int_eq(pdm_act_alloc(&m->hp, n, &a2), PDM_OK);
    int32_t pos[50];
    for (int i = 0; i < n; i++) pos[i] = i;
    ck_assert_int_eq(pdm_model_embed(ctx, tok, pos, n, &a1), PDM_OK);
    pdm_model_attn_in(ctx, 0, &a1);
    memcpy(a2.q, a1.q, (size_t)n * m->hp.n_heads * m->hp.head_dim * sizeof(float));
    memcpy(a2.pos, a1.pos, sizeof(pos));
    a2.n = n;
    pdm_kv_view_t one, parts[3];
    pdm_kv_cache_view(cache, 0, 0, n, &one);
    pdm_kv_cache_view(cache, 0, 30, 20, &parts[0]);
    pdm_kv_cache_view(cache, 0, 0, 17, &parts[1]);
    pdm_kv_cache_view(cache, 0, 17, 13, &parts[2]);
    pdm_model_attention(ctx, 0, &a1, &one, 1);
    pdm_model_attention(ctx, 0, &a2, parts, 3);
    int qd = (int)(m->hp.n_heads * m->hp.head_dim);
    ck_assert_msg(max_diff(a1.o, a2.o, n * qd) <= 1e-5f, "split views differ");
    ck_assert_msg(max_diff(a1.lse, a2.lse, n * (int)m->hp.n_heads) <= 1e-5f, "lse differs");
    pdm_act_free(&a1);
    pdm_act_free(&a2);
    pdm_model_ctx_destroy(ctx);
    pdm_kv_cache_destroy(cache);
    free(logits);
    pdm_model_free(m);
}
END_TEST

START_TEST(test_kernel_variants_agree)
{
    pdm_model_t *m = load(make_model("variants", 4, 2, 64, PDM_DT_Q4_1, 0));
    int32_t tok[33];
    random_tokens(tok, 33, (int)m->hp.n_vocab, 5);
    float *ref = run_prefill(m, tok, 33, 16, PDM_DT_F16, &pdm_kern_ops_generic, NULL);
    const pdm_kern_ops_t *const *list = pdm_kern_ops_list();
    for (int v = 0; list[v]; v++) {
        float *got = run_prefill(m, tok, 33, 16, PDM_DT_F16, list[v], NULL);
        float diff = max_diff(ref, got, (int)m->hp.n_vocab);
        ck_assert_msg(diff <= 2e-2f, "%s vs generic: %g", list[v]->name, diff);
        free(got);
    }
    free(ref);
    pdm_model_free(m);
}
END_TEST

START_TEST(test_engine_errors)
{
    pdm_model_t *m = NULL;
    ck_assert_int_lt(pdm_model_load("/nonexistent/model.gguf", &m), 0);
    ck_assert_ptr_null(m);
    ck_assert_ptr_nonnull(strstr(pdm_error_last(), "/nonexistent/model.gguf"));

    /* a truncated copy of a valid model */
    const char *good = make_model("trunc", 4, 2, 64, PDM_DT_Q4_1, 1);
    char bad[600];
    snprintf(bad, sizeof(bad), "%s/engine-truncated.gguf", pdm_test_tmpdir());
    FILE *in = fopen(good, "rb"), *out = fopen(bad, "wb");
    char buf[4096];
    size_t got, total = 0;
    while ((got = fread(buf, 1, sizeof(buf), in)) > 0 && total < 20000) {
        fwrite(buf, 1, got, out);
        total += got;
    }
    fclose(in);
    fclose(out);
    ck_assert_int_lt(pdm_model_load(bad, &m), 0);
    ck_assert_ptr_nonnull(strstr(pdm_error_last(), bad));

    /* a GGUF that is not a llama model */
    char other[600];
    snprintf(other, sizeof(other), "%s/engine-other.gguf", pdm_test_tmpdir());
    pdm_gguf_writer_t *w = pdm_gguf_writer_create();
    pdm_gguf_writer_set_str(w, "general.architecture", "mamba");
    ck_assert_int_eq(pdm_gguf_writer_write(w, other), PDM_OK);
    pdm_gguf_writer_destroy(w);
    ck_assert_int_eq(pdm_model_load(other, &m), PDM_EUNSUPPORTED);
    ck_assert_ptr_nonnull(strstr(pdm_error_last(), "mamba"));

    m = load(good);
    pdm_model_ctx_t *ctx;
    pdm_kv_cache_t *cache;
    ck_assert_int_eq(pdm_model_ctx_create(m, 1, 8, &ctx), PDM_OK);
    ck_assert_int_eq(pdm_kv_cache_create(&m->hp, 4, PDM_DT_F16, &cache), PDM_OK);
    int32_t tok[5] = {1, 2, 3, 4, 5};
    ck_assert_int_eq(pdm_model_prefill(ctx, cache, tok, 5, NULL), PDM_EOVERFLOW);
    int32_t badtok = (int32_t)m->hp.n_vocab;
    ck_assert_int_eq(pdm_model_prefill(ctx, cache, &badtok, 1, NULL), PDM_ERANGE);
    ck_assert_int_eq(cache->n_tokens, 0);
    ck_assert_int_eq(pdm_model_ctx_create(m, 0, 8, &ctx), PDM_EINVAL);
    ck_assert_int_eq(pdm_kv_cache_create(&m->hp, 0, PDM_DT_F16, &cache), PDM_EINVAL);
    pdm_kv_cache_t *c2;
    ck_assert_int_eq(pdm_kv_cache_create(&m->hp, 4, PDM_DT_Q4_1, &c2), PDM_EINVAL);
    pdm_kv_cache_destroy(cache);
    pdm_model_ctx_destroy(ctx);
    pdm_model_free(m);
}
END_TEST

Suite *suite_engine(void)
{
    Suite *s = suite_create("engine");
    TCase *tc = tcase_create("engine");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_engine_vs_naive);
    tcase_add_test(tc, test_prefill_decode_chunks_agree);
    tcase_add_test(tc, test_split_views);
    tcase_add_test(tc, test_kernel_variants_agree);
    tcase_add_test(tc, test_engine_errors);
    suite_add_tcase(s, tc);
    return s;
}
