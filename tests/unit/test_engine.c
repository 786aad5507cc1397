/*
 * test_engine.c - the forward pass on random test models: batched prefill, token-by-token
 * decode, chunking, split KV views and every kernel variant agree with each other and with the
 * exact f64 reference forward (model/reference.c, llama2.c style, shared with the perplexity
 * tool's --exact).
 *
 * Tolerances: against the reference, max |logit difference| <= 2e-3 for f32/f16
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

START_TEST(test_engine_vs_reference)
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
        pdm_model_ref_params_t rp;
        pdm_model_ref_params_default(&rp);
        rp.n_threads = 2;
        ck_assert_msg(pdm_model_reference_logits(m, &rp, tok, 41, 40, want) == PDM_OK, "%s",
                      pdm_error_last());
        float *got = run_prefill(m, tok, 41, 16, PDM_DT_F32, NULL, NULL);
        float diff = max_diff(got, want, (int)m->hp.n_vocab);
        ck_assert_msg(diff <= 2e-3f, "shape %zu: engine vs naive max |diff| %g", s, diff);
        free(want);
        free(got);
        pdm_model_free(m);
    }
}
END_TEST

START_TEST(test_prefill_logits_rows)
{
    /* the logits of every row from `first` on (what perplexity scores) match the reference
     * row by row, whatever the batch size, also when `first` falls inside a batch; the
     * reference gives the same bits on 1 and 3 threads */
    pdm_model_t *m = load(make_model("rows", 6, 2, 96, PDM_DT_F32, 1));
    const int n = 45, first = 12, n_out = n - first, nv = (int)m->hp.n_vocab;
    int32_t tok[45];
    random_tokens(tok, n, nv, 21);
    float *want = malloc((size_t)n_out * nv * sizeof(float));
    float *want3 = malloc((size_t)n_out * nv * sizeof(float));
    pdm_model_ref_params_t rp;
    pdm_model_ref_params_default(&rp);
    ck_assert_int_eq(pdm_model_reference_logits(m, &rp, tok, n, first, want), PDM_OK);
    rp.n_threads = 3;
    ck_assert_int_eq(pdm_model_reference_logits(m, &rp, tok, n, first, want3), PDM_OK);
    ck_assert_msg(!memcmp(want, want3, (size_t)n_out * nv * sizeof(float)),
                  "reference depends on the thread count");
    static const int batches[] = {64, 7, 12, 1};
    float *prev = NULL;
    for (size_t b = 0; b < PDM_ARRAY_SIZE(batches); b++) {
        pdm_model_ctx_t *ctx;
        pdm_kv_cache_t *cache;
        ck_assert_int_eq(pdm_model_ctx_create(m, 2, batches[b], &ctx), PDM_OK);
        ck_assert_int_eq(pdm_kv_cache_create(&m->hp, n, PDM_DT_F32, &cache), PDM_OK);
        float *got = malloc((size_t)n_out * nv * sizeof(float));
        ck_assert_msg(pdm_model_prefill_logits(ctx, cache, tok, n, first, got) == PDM_OK, "%s",
                      pdm_error_last());
        ck_assert_int_eq(cache->n_tokens, n);
        float diff = max_diff(got, want, n_out * nv);
        ck_assert_msg(diff <= 2e-3f, "batch %d: rows vs reference max |diff| %g", batches[b], diff);
        if (prev) ck_assert_msg(max_diff(got, prev, n_out * nv) <= 1e-4f, "batch %d differs",
                                batches[b]);
        free(prev);
        prev = got;
        pdm_kv_cache_destroy(cache);
        pdm_model_ctx_destroy(ctx);
    }
    /* bad ranges are refused */
    pdm_model_ctx_t *ctx;
    pdm_kv_cache_t *cache;
    ck_assert_int_eq(pdm_model_ctx_create(m, 1, 8, &ctx), PDM_OK);
    ck_assert_int_eq(pdm_kv_cache_create(&m->hp, n, PDM_DT_F32, &cache), PDM_OK);
    ck_assert_int_eq(pdm_model_prefill_logits(ctx, cache, tok, 4, 5, prev), PDM_EINVAL);
    ck_assert_int_eq(pdm_model_reference_logits(m, &rp, tok, 4, -1, prev), PDM_EINVAL);
    ck_assert_int_eq(cache->n_tokens, 0);
    pdm_kv_cache_destroy(cache);
    /* a q8 cache takes its scales from the whole prompt: only the last row is available */
    ck_assert_int_eq(pdm_kv_cache_create(&m->hp, n, PDM_DT_I8, &cache), PDM_OK);
    ck_assert_int_eq(pdm_model_prefill_logits(ctx, cache, tok, 8, 2, prev), PDM_EUNSUPPORTED);
    ck_assert_int_eq(cache->n_tokens, 0);
    pdm_kv_cache_destroy(cache);
    pdm_model_ctx_destroy(ctx);
    free(prev);
    free(want);
    free(want3);
    pdm_model_free(m);
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

/* ---- Several sequences as one batch (pdm_model_prefill_seqs) ------------------------------ */

#define SEQS_N 4
static const int seqs_len[SEQS_N] = {33, 1, 70, 7}; /* odd sizes, a one-token sequence */

/* Whether rows [0, n) of every layer's K and V (and the q8 scales) of a and b are the same
 * bytes. */
static int same_kv(const pdm_model_hparams_t *hp, const pdm_kv_cache_t *a,
                   const pdm_kv_cache_t *b, int n, uint32_t layers)
{
    const size_t row = pdm_dtype_row_bytes(a->dtype, hp->head_dim);
    for (uint32_t l = 0; l < layers; l++)
        for (uint32_t h = 0; h < hp->n_kv_heads; h++)
            if (memcmp(pdm_kv_cache_k(a, l, h), pdm_kv_cache_k(b, l, h), row * (size_t)n) ||
                memcmp(pdm_kv_cache_v(a, l, h), pdm_kv_cache_v(b, l, h), row * (size_t)n))
                return 0;
    if (a->dtype == PDM_DT_I8 &&
        memcmp(a->scale, b->scale, sizeof(float) * 2 * layers * hp->n_kv_heads))
        return 0;
    return 1;
}

typedef struct {
    const pdm_model_hparams_t *hp;
    pdm_kv_cache_t **got, **want;
    int calls, stop_at;
} seqs_probe_t;

/* The layer hook: layer l's KV of every sequence is final when it is called (what the
 * prefill rank streams then is what the sequence alone would give). */
static int seqs_on_layer(void *data, int layer)
{
    seqs_probe_t *p = data;
    ck_assert_int_eq(layer, p->calls);
    p->calls++;
    if (p->want)
        for (int s = 0; s < SEQS_N; s++) {
            const size_t row = pdm_dtype_row_bytes(p->got[s]->dtype, p->hp->head_dim);
            for (uint32_t h = 0; h < p->hp->n_kv_heads; h++) {
                ck_assert(!memcmp(pdm_kv_cache_k(p->got[s], (uint32_t)layer, h),
                                  pdm_kv_cache_k(p->want[s], (uint32_t)layer, h),
                                  row * (size_t)seqs_len[s]));
                ck_assert(!memcmp(pdm_kv_cache_v(p->got[s], (uint32_t)layer, h),
                                  pdm_kv_cache_v(p->want[s], (uint32_t)layer, h),
                                  row * (size_t)seqs_len[s]));
            }
        }
    return layer == p->stop_at ? PDM_ECANCELED : PDM_OK;
}

/* Every sequence's last logits and KV equal, bit for bit, those of the sequence prefilled
 * alone (pdm_model_prefill with a context that holds it in one batch), for every kernel
 * variant of this CPU, f32/f16/q8 KV, Q4_1 (GQA) and f32 weights. Bit-for-bit holds because
 * every step but attention is per row, and attention runs per sequence on the same rows. */
START_TEST(test_prefill_seqs_equal_alone)
{
    static const struct { uint32_t h, kv, d; pdm_dtype_t wt; } shapes[] = {
        {4, 2, 64, PDM_DT_Q4_1}, {6, 3, 96, PDM_DT_F32}};
    static const pdm_dtype_t kvts[] = {PDM_DT_F16, PDM_DT_F32, PDM_DT_I8};
    for (size_t sh = 0; sh < PDM_ARRAY_SIZE(shapes); sh++) {
        char tag[32];
        snprintf(tag, sizeof(tag), "seqs%zu", sh);
        pdm_model_t *m = load(make_model(tag, shapes[sh].h, shapes[sh].kv, shapes[sh].d,
                                         shapes[sh].wt, (int)sh));
        const pdm_model_hparams_t *hp = &m->hp;
        int32_t tok[SEQS_N][70];
        int total = 0;
        for (int s = 0; s < SEQS_N; s++) {
            random_tokens(tok[s], seqs_len[s], (int)hp->n_vocab, 11 + (unsigned)s);
            total += seqs_len[s];
        }
        const pdm_kern_ops_t *const *list = pdm_kern_ops_list();
        for (int v = 0; list[v]; v++)
            for (size_t kt = 0; kt < PDM_ARRAY_SIZE(kvts); kt++) {
                pdm_kv_cache_t *want[SEQS_N], *got[SEQS_N];
                float *want_l[SEQS_N], *got_l[SEQS_N];
                pdm_model_seq_t seqs[SEQS_N];
                for (int s = 0; s < SEQS_N; s++) {
                    pdm_model_ctx_t *one;
                    ck_assert_int_eq(pdm_model_ctx_create(m, 2, seqs_len[s], &one), PDM_OK);
                    pdm_model_ctx_set_ops(one, list[v]);
                    pdm_model_ctx_set_split_single(one, 0); /* as a prefill rank's context */
                    ck_assert_int_eq(pdm_kv_cache_create(hp, seqs_len[s] + 3, kvts[kt], &want[s]),
                                     PDM_OK);
                    want_l[s] = malloc(sizeof(float) * hp->n_vocab);
                    ck_assert_msg(pdm_model_prefill(one, want[s], tok[s], seqs_len[s],
                                                    want_l[s]) == PDM_OK, "%s", pdm_error_last());
                    pdm_model_ctx_destroy(one);
                    ck_assert_int_eq(pdm_kv_cache_create(hp, seqs_len[s] + 3, kvts[kt], &got[s]),
                                     PDM_OK);
                    got_l[s] = malloc(sizeof(float) * hp->n_vocab);
                    seqs[s] = (pdm_model_seq_t){tok[s], seqs_len[s], got[s], got_l[s]};
                }
                pdm_model_ctx_t *ctx;
                pdm_act_t act;
                ck_assert_int_eq(pdm_model_ctx_create(m, 2, total, &ctx), PDM_OK);
                pdm_model_ctx_set_ops(ctx, list[v]);
                pdm_model_ctx_set_split_single(ctx, 0);
                ck_assert_int_eq(pdm_act_alloc(hp, total, &act), PDM_OK);
                seqs_probe_t probe = {hp, got, want, 0, -1};
                ck_assert_msg(pdm_model_prefill_seqs(ctx, &act, seqs, SEQS_N, seqs_on_layer,
                                                     &probe) == PDM_OK, "%s", pdm_error_last());
                ck_assert_int_eq(probe.calls, (int)hp->n_layers);
                for (int s = 0; s < SEQS_N; s++) {
                    ck_assert_int_eq(got[s]->n_tokens, seqs_len[s]);
                    ck_assert_int_eq(got[s]->scales_fixed, want[s]->scales_fixed);
                    ck_assert_msg(!memcmp(got_l[s], want_l[s], sizeof(float) * hp->n_vocab),
                                  "%s, kv %zu, sequence %d: logits differ by %g", list[v]->name,
                                  kt, s, max_diff(got_l[s], want_l[s], (int)hp->n_vocab));
                    ck_assert_msg(same_kv(hp, got[s], want[s], seqs_len[s], hp->n_layers),
                                  "%s, kv %zu, sequence %d: KV differs", list[v]->name, kt, s);
                    pdm_kv_cache_destroy(want[s]);
                    pdm_kv_cache_destroy(got[s]);
                    free(want_l[s]);
                    free(got_l[s]);
                }
                pdm_act_free(&act);
                pdm_model_ctx_destroy(ctx);
            }
        pdm_model_free(m);
    }
}
END_TEST

/* Bad batches are refused with nothing changed; a hook that stops it stops it. */
START_TEST(test_prefill_seqs_errors)
{
    pdm_model_t *m = load(make_model("seqserr", 4, 2, 64, PDM_DT_Q4_1, 0));
    const pdm_model_hparams_t *hp = &m->hp;
    pdm_model_ctx_t *ctx;
    pdm_act_t act;
    pdm_kv_cache_t *a, *b;
    ck_assert_int_eq(pdm_model_ctx_create(m, 1, 16, &ctx), PDM_OK);
    ck_assert_int_eq(pdm_act_alloc(hp, 16, &act), PDM_OK);
    ck_assert_int_eq(pdm_kv_cache_create(hp, 8, PDM_DT_F16, &a), PDM_OK);
    ck_assert_int_eq(pdm_kv_cache_create(hp, 8, PDM_DT_F16, &b), PDM_OK);
    int32_t tok[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, bad[2] = {1, (int32_t)hp->n_vocab};
    pdm_model_seq_t s2[2] = {{tok, 4, a, NULL}, {tok, 4, a, NULL}};
    ck_assert_int_eq(pdm_model_prefill_seqs(ctx, &act, s2, 2, NULL, NULL), PDM_EINVAL); /* shared */
    s2[1].cache = b;
    s2[1].tokens = bad;
    s2[1].n = 2;
    ck_assert_int_eq(pdm_model_prefill_seqs(ctx, &act, s2, 2, NULL, NULL), PDM_ERANGE);
    s2[1].tokens = tok;
    s2[1].n = 9; /* over b's 8 slots */
    ck_assert_int_eq(pdm_model_prefill_seqs(ctx, &act, s2, 2, NULL, NULL), PDM_EOVERFLOW);
    s2[1].n = 0;
    ck_assert_int_eq(pdm_model_prefill_seqs(ctx, &act, s2, 2, NULL, NULL), PDM_EINVAL);
    ck_assert_int_eq(pdm_model_prefill_seqs(ctx, &act, s2, 0, NULL, NULL), PDM_EINVAL);
    pdm_kv_cache_t *c;
    ck_assert_int_eq(pdm_kv_cache_create(hp, 32, PDM_DT_F16, &c), PDM_OK);
    pdm_model_seq_t big[2] = {{tok, 8, a, NULL}, {tok, 12, c, NULL}}; /* 20 > max batch 16 */
    ck_assert_int_eq(pdm_model_prefill_seqs(ctx, &act, big, 2, NULL, NULL), PDM_EINVAL);
    ck_assert_int_eq(a->n_tokens, 0);
    ck_assert_int_eq(c->n_tokens, 0);
    /* a hook that stops at layer 1: its status, and no sequence counts as prefilled */
    s2[1].n = 4;
    seqs_probe_t probe = {hp, NULL, NULL, 0, 1};
    ck_assert_int_eq(pdm_model_prefill_seqs(ctx, &act, s2, 2, seqs_on_layer, &probe),
                     PDM_ECANCELED);
    ck_assert_int_eq(probe.calls, 2);
    ck_assert_int_eq(a->n_tokens, 0);
    ck_assert_int_eq(b->n_tokens, 0);
    pdm_kv_cache_destroy(a);
    pdm_kv_cache_destroy(b);
    pdm_kv_cache_destroy(c);
    pdm_act_free(&act);
    pdm_model_ctx_destroy(ctx);
    pdm_model_free(m);
}
END_TEST

Suite *suite_engine(void)
{
    Suite *s = suite_create("engine");
    TCase *tc = tcase_create("engine");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_engine_vs_reference);
    tcase_add_test(tc, test_prefill_logits_rows);
    tcase_add_test(tc, test_prefill_decode_chunks_agree);
    tcase_add_test(tc, test_split_views);
    tcase_add_test(tc, test_kernel_variants_agree);
    tcase_add_test(tc, test_engine_errors);
    tcase_add_test(tc, test_prefill_seqs_equal_alone);
    tcase_add_test(tc, test_prefill_seqs_errors);
    suite_add_tcase(s, tc);
    return s;
}
