/*
 * reference.c - the exact reference forward pass: the model's arithmetic written the plain way
 * (llama2.c style) in double precision, for measuring how far the engine and llama.cpp are
 * from the model itself.
 *
 * What "exact" means here: the weights are the file's, dequantized (exactly: every GGUF block
 * format decodes to values an f32 holds); everything after that is f64 - embeddings, RMSNorm,
 * the projections (no activation quantization, unlike the Q8_0/Q8_1 dot products of the
 * engine and of llama.cpp), RoPE angles, attention scores and softmax (no f16 KV cache), the
 * SwiGLU FFN and the logits. The only roundings left are f64's and the final f32 store.
 *
 * Two knobs serve experiments on where the engines' error comes from (docs/fidelity.md):
 * act_q8 rounds every input of a quantized matrix as llama.cpp and the engine do before their
 * integer dot products (blocks of 32 values, 8-bit, scale amax / 127 stored as f16), the rest
 * staying f64; perturb multiplies every matrix input by 1 + perturb * u with a fixed
 * pseudo-random u in [-0.5, 0.5), to see how much a tiny change moves the result.
 *
 * Work is split over a thread pool by output rows (matrix products) and by (token, head)
 * (attention); every value is computed by one thread in a fixed order, so the result does
 * not depend on the thread count. Cost: about 2 x n_params multiply-adds per token in scalar
 * f64, a few hundred tokens per second for a 135M model on two cores: for short texts.
 */
#include "model.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Token rows per block of a matrix product: a block of activations (32 x n_ff doubles, about
 * 400 KB for n_ff 1536) stays in L2 while every weight row passes over it. */
#define PDM__REF_TOKEN_BLOCK 32

typedef struct {
    const float *w;  /* (rows, cols) dequantized weights */
    const double *x; /* (n, cols) inputs */
    double *y;       /* (n, rows) outputs */
    int64_t rows, cols;
    int n;
} pdm__ref_mm_t;

static double pdm__ref_dot(const float *w, const double *x, int64_t n)
{
    /* four independent sums: the loop is latency-bound otherwise */
    double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        s0 += (double)w[i] * x[i];
        s1 += (double)w[i + 1] * x[i + 1];
        s2 += (double)w[i + 2] * x[i + 2];
        s3 += (double)w[i + 3] * x[i + 3];
    }
    for (; i < n; i++) s0 += (double)w[i] * x[i];
    return (s0 + s1) + (s2 + s3);
}

static void pdm__ref_mm_task(void *arg, int ith, int nth)
{
    pdm__ref_mm_t *t = arg;
    int64_t r0, r1;
    pdm_kern_split(t->rows, ith, nth, 1, &r0, &r1);
    for (int t0 = 0; t0 < t->n; t0 += PDM__REF_TOKEN_BLOCK) {
        int t1 = PDM_MIN(t->n, t0 + PDM__REF_TOKEN_BLOCK);
        for (int64_t r = r0; r < r1; r++) {
            const float *w = t->w + r * t->cols;
            for (int i = t0; i < t1; i++)
                t->y[(size_t)i * t->rows + r] = pdm__ref_dot(w, t->x + (size_t)i * t->cols,
                                                             t->cols);
        }
    }
}

/* What a matrix product does to its inputs before multiplying (pdm_model_ref_params_t). */
typedef struct {
    pdm_kern_pool_t *pool;
    int act_q8;
    double perturb;
    double *scratch; /* (n, widest input) the modified inputs */
} pdm__ref_ctx_t;

/* x rounded as an 8-bit activation block of the engines (Q8_0 / Q8_1 quantize_row_*_ref in
 * ggml: d = amax / 127 in f32, q = round(x / d), the product uses d rounded to f16). */
static void pdm__ref_round_q8(double *x, int64_t n)
{
    for (int64_t b = 0; b < n; b += 32) {
        int64_t e = PDM_MIN(n, b + 32);
        float amax = 0;
        for (int64_t j = b; j < e; j++) amax = fmaxf(amax, fabsf((float)x[j]));
        const float d = amax / 127.0f, id = d ? 1.0f / d : 0.0f;
        const double dh = pdm_f16_to_f32(pdm_f32_to_f16(d));
        for (int64_t j = b; j < e; j++) x[j] = dh * (double)nearbyintf((float)x[j] * id);
    }
}

/* y[i][:] = W x[i] for i < n, W of file type `wtype`. */
static void pdm__ref_matmul(pdm__ref_ctx_t *rc, pdm_dtype_t wtype, const float *w, int64_t rows,
                            int64_t cols, const double *x, int n, double *y)
{
    const int quantized = wtype != PDM_DT_F32 && wtype != PDM_DT_F16 && wtype != PDM_DT_BF16;
    if ((rc->act_q8 && quantized) || rc->perturb != 0) {
        double *xs = rc->scratch;
        for (size_t i = 0; i < (size_t)n * cols; i++) {
            /* a fixed pseudo-random u in [-0.5, 0.5) per element (Knuth's multiplicative hash) */
            double u = (double)(((uint32_t)i * 2654435761u) >> 8) / (double)(1u << 24) - 0.5;
            xs[i] = x[i] * (1.0 + rc->perturb * u);
        }
        if (rc->act_q8 && quantized)
            for (int i = 0; i < n; i++) pdm__ref_round_q8(xs + (size_t)i * cols, cols);
        x = xs;
    }
    pdm__ref_mm_t t = {.w = w, .x = x, .y = y, .rows = rows, .cols = cols, .n = n};
    pdm_kern_pool_run(rc->pool, pdm__ref_mm_task, &t);
}

/* Dequantizes matrix m into dst (rows * cols floats). */
static void pdm__ref_dequant(const pdm_kern_mat_t *m, float *dst)
{
    for (int64_t r = 0; r < m->rows; r++) pdm_kern_mat_dequantize_row(m, r, dst + r * m->cols);
}

static void pdm__ref_rmsnorm(double *o, const double *x, const float *w, int n, double eps)
{
    double ss = 0;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    double sc = 1.0 / sqrt(ss / n + eps);
    for (int i = 0; i < n; i++) o[i] = x[i] * sc * (double)w[i];
}

/* Llama's RoPE ("normal" mode: adjacent pairs, as GGUF stores Q and K permuted for it). */
static void pdm__ref_rope(double *v, int heads, int head_dim, int pos, double theta)
{
    for (int i = 0; i < head_dim / 2; i++) {
        double ang = pos * pow(theta, -2.0 * i / head_dim), c = cos(ang), s = sin(ang);
        for (int h = 0; h < heads; h++) {
            double *p = v + (size_t)h * head_dim + 2 * i;
            double a = p[0], b = p[1];
            p[0] = a * c - b * s;
            p[1] = a * s + b * c;
        }
    }
}

typedef struct {
    const pdm_model_hparams_t *hp;
    const double *q, *k, *v; /* (n, n_heads * hd), (n, n_kv_heads * hd) x 2 */
    double *o;               /* (n, n_heads * hd) */
    double *scores;          /* [n_threads][n] */
    int n;
} pdm__ref_attn_t;

static void pdm__ref_attn_task(void *arg, int ith, int nth)
{
    pdm__ref_attn_t *t = arg;
    const int hd = (int)t->hp->head_dim, nh = (int)t->hp->n_heads, nkv = (int)t->hp->n_kv_heads;
    const int qd = nh * hd, kvd = nkv * hd, group = nh / nkv;
    const double scale = 1.0 / sqrt((double)hd);
    double *s = t->scores + (size_t)ith * t->n;
    int64_t b, e;
    pdm_kern_split((int64_t)t->n * nh, ith, nth, 1, &b, &e);
    for (int64_t item = b; item < e; item++) {
        int i = (int)(item / nh), h = (int)(item % nh), kh = h / group;
        const double *qi = t->q + (size_t)i * qd + (size_t)h * hd;
        double mx = -INFINITY, sum = 0;
        for (int j = 0; j <= i; j++) {
            const double *kj = t->k + (size_t)j * kvd + (size_t)kh * hd;
            double dot = 0;
            for (int c = 0; c < hd; c++) dot += qi[c] * kj[c];
            s[j] = dot * scale;
            if (s[j] > mx) mx = s[j];
        }
        for (int j = 0; j <= i; j++) {
            s[j] = exp(s[j] - mx);
            sum += s[j];
        }
        double *oi = t->o + (size_t)i * qd + (size_t)h * hd;
        for (int c = 0; c < hd; c++) oi[c] = 0;
        for (int j = 0; j <= i; j++) {
            const double *vj = t->v + (size_t)j * kvd + (size_t)kh * hd;
            double p = s[j] / sum;
            for (int c = 0; c < hd; c++) oi[c] += p * vj[c];
        }
    }
}

void pdm_model_ref_params_default(pdm_model_ref_params_t *p)
{
    memset(p, 0, sizeof(*p));
    p->n_threads = 1;
}

int pdm_model_reference_logits(const pdm_model_t *m, const pdm_model_ref_params_t *p,
                               const int32_t *tokens, int n, int first, float *logits)
{
    const pdm_model_hparams_t *hp = &m->hp;
    const int n_threads = p->n_threads;
    /* The reference computes the plain llama block (normal RoPE pairs, no biases, norms or
     * windows beyond it): other architectures are refused rather than computed wrong. */
    if (hp->arch != PDM_ARCH_LLAMA || hp->rope_neox || hp->rope_freq_scale != 1.0f ||
        hp->embd_scale != 1.0f || m->rope_freqs)
        return pdm_error_set(PDM_EUNSUPPORTED, "reference forward: only the plain llama "
                             "architecture (no Llama 3 RoPE scaling) is implemented");
    for (uint32_t l = 0; l < hp->n_layers; l++)
        if (m->layers[l].bq || m->layers[l].bk || m->layers[l].bv || m->layers[l].q_norm ||
            m->layers[l].k_norm || m->layers[l].attn_post_norm || m->layers[l].window)
            return pdm_error_set(PDM_EUNSUPPORTED, "reference forward: layer %u has attention "
                                 "biases, Q/K or post norms or a window, which it does not implement", l);
    if (n < 1 || first < 0 || first > n || n_threads < 1 || n_threads > 256 ||
        !(fabs(p->perturb) < 1))
        return pdm_error_set(PDM_EINVAL,
                             "reference forward: %d tokens, logits from %d, %d "
                             "threads, perturbation %g",
                             n, first, n_threads, p->perturb);
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || (uint32_t)tokens[i] >= hp->n_vocab)
            return pdm_error_set(PDM_ERANGE, "token id %d is outside the vocabulary (0..%u)",
                                 tokens[i], hp->n_vocab - 1);
    const int d = (int)hp->d_model, hd = (int)hp->head_dim, ff = (int)hp->n_ff;
    const int qd = (int)hp->n_heads * hd, kvd = (int)hp->n_kv_heads * hd;
    const size_t nn = (size_t)n;
    /* the largest matrix of a layer: gate/up/down (n_ff x d_model), Q/O (qd x d_model) */
    size_t wmax = (size_t)PDM_MAX(PDM_MAX(ff, qd), kvd) * (size_t)PDM_MAX(d, PDM_MAX(ff, qd));
    int status = PDM_ENOMEM;
    pdm_kern_pool_t *pool = pdm_kern_pool_create(n_threads);
    double *x = malloc(nn * d * sizeof(double)), *xn = malloc(nn * d * sizeof(double));
    double *q = malloc(nn * qd * sizeof(double)), *k = malloc(nn * kvd * sizeof(double));
    double *v = malloc(nn * kvd * sizeof(double)), *o = malloc(nn * qd * sizeof(double));
    double *g = malloc(nn * ff * sizeof(double)), *u = malloc(nn * ff * sizeof(double));
    double *tmp = malloc(nn * d * sizeof(double));
    double *scores = malloc((size_t)n_threads * nn * sizeof(double));
    float *w = malloc(wmax * sizeof(float)), *row = malloc((size_t)d * sizeof(float));
    const size_t widest = (size_t)PDM_MAX(d, PDM_MAX(ff, qd));
    pdm__ref_ctx_t rc = {
        .pool = pool,
        .act_q8 = p->act_q8,
        .perturb = p->perturb,
        .scratch = malloc(PDM_MAX(nn, (size_t)PDM__REF_TOKEN_BLOCK) * widest * sizeof(double))};
    float *wout = NULL;
    double *lg = NULL;
    if (!pool || !x || !xn || !q || !k || !v || !o || !g || !u || !tmp || !scores || !w || !row ||
        !rc.scratch) {
        pdm_error_set(PDM_ENOMEM, "reference forward: out of memory for %d tokens", n);
        goto out;
    }

    for (int i = 0; i < n; i++) {
        pdm_kern_mat_dequantize_row(&m->tok_embd, tokens[i], row);
        for (int c = 0; c < d; c++) x[(size_t)i * d + c] = row[c];
    }
    for (uint32_t l = 0; l < hp->n_layers; l++) {
        const pdm_model_layer_t *L = &m->layers[l];
        for (int i = 0; i < n; i++)
            pdm__ref_rmsnorm(xn + (size_t)i * d, x + (size_t)i * d, L->attn_norm, d, hp->rms_eps);
        pdm__ref_dequant(&L->wq, w);
        pdm__ref_matmul(&rc, L->wq.type, w, qd, d, xn, n, q);
        pdm__ref_dequant(&L->wk, w);
        pdm__ref_matmul(&rc, L->wk.type, w, kvd, d, xn, n, k);
        pdm__ref_dequant(&L->wv, w);
        pdm__ref_matmul(&rc, L->wv.type, w, kvd, d, xn, n, v);
        for (int i = 0; i < n; i++) {
            pdm__ref_rope(q + (size_t)i * qd, (int)hp->n_heads, hd, i, hp->rope_theta);
            pdm__ref_rope(k + (size_t)i * kvd, (int)hp->n_kv_heads, hd, i, hp->rope_theta);
        }
        pdm__ref_attn_t at = {.hp = hp, .q = q, .k = k, .v = v, .o = o, .scores = scores, .n = n};
        pdm_kern_pool_run(pool, pdm__ref_attn_task, &at);
        pdm__ref_dequant(&L->wo, w);
        pdm__ref_matmul(&rc, L->wo.type, w, d, qd, o, n, tmp);
        for (size_t i = 0; i < nn * d; i++) x[i] += tmp[i];
        for (int i = 0; i < n; i++)
            pdm__ref_rmsnorm(xn + (size_t)i * d, x + (size_t)i * d, L->ffn_norm, d, hp->rms_eps);
        pdm__ref_dequant(&L->w_gate, w);
        pdm__ref_matmul(&rc, L->w_gate.type, w, ff, d, xn, n, g);
        pdm__ref_dequant(&L->w_up, w);
        pdm__ref_matmul(&rc, L->w_up.type, w, ff, d, xn, n, u);
        for (size_t i = 0; i < nn * ff; i++) g[i] = g[i] / (1.0 + exp(-g[i])) * u[i];
        pdm__ref_dequant(&L->w_down, w);
        pdm__ref_matmul(&rc, L->w_down.type, w, d, ff, g, n, tmp);
        for (size_t i = 0; i < nn * d; i++) x[i] += tmp[i];
    }

    const int n_out = n - first;
    if (n_out > 0) {
        const size_t n_vocab = hp->n_vocab;
        wout = malloc(n_vocab * (size_t)d * sizeof(float));
        /* logits in blocks of rows: n_out x n_vocab doubles at once would be large */
        lg = malloc((size_t)PDM__REF_TOKEN_BLOCK * n_vocab * sizeof(double));
        if (!wout || !lg) {
            pdm_error_set(PDM_ENOMEM, "reference forward: out of memory for the output matrix");
            goto out;
        }
        pdm__ref_dequant(&m->output, wout);
        for (int i = first; i < n; i++)
            pdm__ref_rmsnorm(xn + (size_t)(i - first) * d, x + (size_t)i * d, m->output_norm, d,
                             hp->rms_eps);
        for (int b0 = 0; b0 < n_out; b0 += PDM__REF_TOKEN_BLOCK) {
            int bn = PDM_MIN(PDM__REF_TOKEN_BLOCK, n_out - b0);
            pdm__ref_matmul(&rc, m->output.type, wout, (int64_t)n_vocab, d, xn + (size_t)b0 * d, bn,
                            lg);
            for (size_t i = 0; i < (size_t)bn * n_vocab; i++)
                logits[(size_t)b0 * n_vocab + i] = (float)lg[i];
        }
    }
    status = PDM_OK;

out:
    free(lg);
    free(wout);
    free(rc.scratch);
    free(row);
    free(w);
    free(scores);
    free(tmp);
    free(u);
    free(g);
    free(o);
    free(v);
    free(k);
    free(q);
    free(xn);
    free(x);
    pdm_kern_pool_destroy(pool);
    return status;
}
