/*
 * ops_generic.c - the scalar reference implementation of every kernel. Plain C, no
 * intrinsics: the SIMD variants are tested against these functions.
 *
 * Numerics follow llama.cpp's CPU backend where that matters for matching its outputs:
 * activations are quantized to 8 bits per block before products with quantized weights,
 * paired as llama.cpp pairs them (ggml-cpu.c type_traits_cpu vec_dot_type): Q8_1 for Q4_1 and
 * Q5_1, Q8_0 (scale rounded to f16) for Q4_0, Q5_0, Q8_0 and IQ4_NL, Q8_K (f32 scale, 256 per
 * block) for the K-quants and IQ4_XS. Dot products are accumulated as integers per block (per
 * super-block for Q8_K, sub-block scales applied as integers), then scaled by the two block
 * scales, as llama.cpp's vec_dot functions do. RMSNorm accumulates in double, RoPE angles are
 * advanced by repeated multiplication.
 */
#include "ops_internal.h"
#include "quant_layout.h"

#include <math.h>
#include <string.h>

/* ---- Activation conversion -------------------------------------------------------------- */

pdm_dtype_t pdm_kern__act_type(pdm_dtype_t wtype)
{
    switch (wtype) {
    case PDM_DT_Q4_1:
    case PDM_DT_Q5_1:
        return PDM_DT_Q8_1;
    case PDM_DT_Q4_0:
    case PDM_DT_Q5_0:
    case PDM_DT_Q8_0:
    case PDM_DT_IQ4_NL:
        return PDM_DT_Q8_0;
    case PDM_DT_Q2_K:
    case PDM_DT_Q3_K:
    case PDM_DT_Q4_K:
    case PDM_DT_Q5_K:
    case PDM_DT_Q6_K:
    case PDM_DT_IQ4_XS:
        return PDM_DT_Q8_K;
    default:
        return PDM_DT_F32;
    }
}

size_t pdm_kern__act_bytes(pdm_dtype_t wtype, int64_t cols, int n_tok)
{
    pdm_dtype_t at = pdm_kern__act_type(wtype);
    if (at == PDM_DT_F32) return 0;
    return pdm_dtype_row_bytes(at, cols) * (size_t)n_tok;
}

/* Quantizes one row of activations to Q8_1: scale 127 / amax, ties rounded to even, d and s
 * rounded through f16, the numerics llama.cpp's x86 backend uses, so that results match it
 * closely (the model amplifies single-step rounding differences across its 30 layers). */
void pdm_kern__quantize_q8_1_row(const float *x, pdm_block_q8_1_t *b, int64_t n)
{
    for (int64_t i = 0; i < n / PDM_QK; i++) {
        const float *xb = x + i * PDM_QK;
        float amax = 0.0f;
        for (int j = 0; j < PDM_QK; j++) amax = fmaxf(amax, fabsf(xb[j]));
        float d = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
        int sum = 0;
        for (int j = 0; j < PDM_QK; j++) {
            b[i].qs[j] = (int8_t)nearbyintf(xb[j] * id); /* ties to even */
            sum += b[i].qs[j];
        }
        b[i].d = pdm_f16_to_f32(pdm_f32_to_f16(d));
        b[i].s = pdm_f16_to_f32(pdm_f32_to_f16((float)sum * d));
    }
}

/* Activation Q8_0: like Q8_1 without the sum. */
void pdm_kern__quantize_q8_0_row(const float *x, pdm_block_q8_0_t *b, int64_t n)
{
    for (int64_t i = 0; i < n / PDM_QK; i++) {
        const float *xb = x + i * PDM_QK;
        float amax = 0.0f;
        for (int j = 0; j < PDM_QK; j++) amax = fmaxf(amax, fabsf(xb[j]));
        float id = amax != 0.0f ? 127.0f / amax : 0.0f;
        for (int j = 0; j < PDM_QK; j++) b[i].qs[j] = (int8_t)nearbyintf(xb[j] * id);
        b[i].d = pdm_f32_to_f16(amax / 127.0f);
    }
}

static void generic_act_convert(pdm_dtype_t wtype, const float *x, int64_t cols, int t0,
                                int t1, void *act)
{
    pdm_dtype_t at = pdm_kern__act_type(wtype);
    size_t rb = pdm_dtype_row_bytes(at, cols);
    for (int t = t0; t < t1; t++) {
        void *dst = (char *)act + (size_t)t * rb;
        if (at == PDM_DT_Q8_1) pdm_kern__quantize_q8_1_row(x + (size_t)t * cols, dst, cols);
        else if (at == PDM_DT_Q8_K) pdm_kern__quantize_q8_K_row(x + (size_t)t * cols, dst, cols);
        else pdm_kern__quantize_q8_0_row(x + (size_t)t * cols, dst, cols);
    }
}

/* ---- Dot products of one weight row with one activation row ------------------------------ */

static float dot_q4_1_q8_1(const pdm_block_q4_1_t *w, const pdm_block_q8_1_t *x, int64_t nb)
{
    float sum = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        int sumi = 0;
        for (int j = 0; j < PDM_QK / 2; j++) {
            sumi += (w[i].qs[j] & 0x0f) * x[i].qs[j];
            sumi += (w[i].qs[j] >> 4) * x[i].qs[j + PDM_QK / 2];
        }
        sum += pdm_f16_to_f32(w[i].d) * x[i].d * (float)sumi + pdm_f16_to_f32(w[i].m) * x[i].s;
    }
    return sum;
}

static float dot_q4_0_q8_0(const pdm_block_q4_0_t *w, const pdm_block_q8_0_t *x, int64_t nb)
{
    float sum = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        int sumi = 0;
        for (int j = 0; j < PDM_QK / 2; j++) {
            sumi += ((w[i].qs[j] & 0x0f) - 8) * x[i].qs[j];
            sumi += ((w[i].qs[j] >> 4) - 8) * x[i].qs[j + PDM_QK / 2];
        }
        sum += pdm_f16_to_f32(w[i].d) * pdm_f16_to_f32(x[i].d) * (float)sumi;
    }
    return sum;
}

static float dot_q8_0_q8_0(const pdm_block_q8_0_t *w, const pdm_block_q8_0_t *x, int64_t nb)
{
    float sum = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        int sumi = 0;
        for (int j = 0; j < PDM_QK; j++) sumi += w[i].qs[j] * x[i].qs[j];
        sum += pdm_f16_to_f32(w[i].d) * pdm_f16_to_f32(x[i].d) * (float)sumi;
    }
    return sum;
}

/* Q5_0 x Q8_0 and IQ4_NL x Q8_0 (ggml_vec_dot_q5_0_q8_0, ggml_vec_dot_iq4_nl_q8_0): the
 * signed weight values times the activation quants, summed as integers per block. */
static float dot_q5_0_q8_0(const pdm_block_q5_0_t *w, const pdm_block_q8_0_t *x, int64_t nb)
{
    float sum = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        int sumi = 0;
        for (int e = 0; e < PDM_QK; e++) sumi += (pdm_ql_q5(w[i].qs, w[i].qh, e) - 16) * x[i].qs[e];
        sum += pdm_f16_to_f32(w[i].d) * pdm_f16_to_f32(x[i].d) * (float)sumi;
    }
    return sum;
}

static float dot_iq4_nl_q8_0(const pdm_block_iq4_nl_t *w, const pdm_block_q8_0_t *x, int64_t nb)
{
    float sum = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        int sumi = 0;
        for (int j = 0; j < PDM_QK / 2; j++) {
            sumi += pdm_kvalues_iq4nl[w[i].qs[j] & 0x0f] * x[i].qs[j];
            sumi += pdm_kvalues_iq4nl[w[i].qs[j] >> 4] * x[i].qs[j + PDM_QK / 2];
        }
        sum += pdm_f16_to_f32(w[i].d) * pdm_f16_to_f32(x[i].d) * (float)sumi;
    }
    return sum;
}

/* Q5_1 x Q8_1 (ggml_vec_dot_q5_1_q8_1): as Q4_1 with 5-bit values. */
static float dot_q5_1_q8_1(const pdm_block_q5_1_t *w, const pdm_block_q8_1_t *x, int64_t nb)
{
    float sum = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        int sumi = 0;
        for (int e = 0; e < PDM_QK; e++) sumi += pdm_ql_q5(w[i].qs, w[i].qh, e) * x[i].qs[e];
        sum += pdm_f16_to_f32(w[i].d) * x[i].d * (float)sumi + pdm_f16_to_f32(w[i].m) * x[i].s;
    }
    return sum;
}

/* One decoded super-block against one Q8_K block (ggml_vec_dot_q*_K_q8_K, iq4_xs): the sum
 * over sub-blocks of scale * (q . q8) as an integer, scaled by d * d8; the minimums through
 * the precomputed sums of 16 activations, sum of min * bsum, scaled by dmin * d8. */
static float dot_kblock_q8_K(const pdm_kern__kblock_t *k, const pdm_block_q8_K_t *x)
{
    int32_t sumi = 0, summ = 0;
    for (int j = 0; j < PDM_QK_K / k->sub_len; j++) {
        int32_t s = 0;
        for (int l = 0; l < k->sub_len; l++) {
            const int e = j * k->sub_len + l;
            s += k->q[e] * x->qs[e];
        }
        sumi += k->scale[j] * s;
    }
    if (k->dmin != 0.0f) /* groups of 16: a sub-block of 32 covers two bsums */
        for (int g = 0; g < PDM_QK_K / 16; g++) summ += k->min[g * 16 / k->sub_len] * x->bsums[g];
    return k->d * x->d * (float)sumi - k->dmin * x->d * (float)summ;
}

/* y[t][r] for the 256-element types: each weight block is decoded once and used for every
 * token; outputs accumulate block by block in y itself, so no scratch is needed. */
static void matmul_kblocks(const pdm_kern_mat_t *w, const void *act, int n_tok, float *y,
                           int64_t ldy, int64_t r0, int64_t r1)
{
    const int64_t nb = w->cols / PDM_QK_K;
    const size_t bb = pdm_dtype_block_bytes(w->type);
    const pdm_block_q8_K_t *x = act;
    pdm_kern__kblock_t k;
    for (int64_t r = r0; r < r1; r++) {
        const char *wr = (const char *)w->data + (size_t)r * w->row_bytes;
        for (int t = 0; t < n_tok; t++) y[(size_t)t * ldy + r] = 0.0f;
        for (int64_t i = 0; i < nb; i++) {
            pdm_kern__kblock_unpack(w->type, wr + (size_t)i * bb, &k);
            for (int t = 0; t < n_tok; t++)
                y[(size_t)t * ldy + r] += dot_kblock_q8_K(&k, x + (size_t)t * nb + i);
        }
    }
}

static float dot_float(pdm_dtype_t type, const void *w, const float *x, int64_t n)
{
    float sum = 0.0f;
    if (type == PDM_DT_F32) {
        const float *wf = w;
        for (int64_t i = 0; i < n; i++) sum += wf[i] * x[i];
    } else if (type == PDM_DT_F16) {
        const uint16_t *wh = w;
        for (int64_t i = 0; i < n; i++) sum += pdm_f16_to_f32(wh[i]) * x[i];
    } else {
        const uint16_t *wh = w;
        for (int64_t i = 0; i < n; i++) sum += pdm_bf16_to_f32(wh[i]) * x[i];
    }
    return sum;
}

static void generic_matmul(const pdm_kern_mat_t *w, const void *act, int n_tok, float *y,
                           int64_t ldy, int64_t r0, int64_t r1)
{
    if (w->layout == PDM_KERN_LAYOUT_X8) {
        pdm_kern__matmul_x8_generic(w, act, n_tok, y, ldy, r0, r1);
        return;
    }
    if (pdm_kern__is_kblock(w->type)) {
        matmul_kblocks(w, act, n_tok, y, ldy, r0, r1);
        return;
    }
    pdm_dtype_t at = pdm_kern__act_type(w->type);
    size_t arb = at == PDM_DT_F32 ? (size_t)w->cols * sizeof(float)
                                  : pdm_dtype_row_bytes(at, w->cols);
    int64_t nb = w->cols / PDM_QK;
    for (int64_t r = r0; r < r1; r++) {
        const void *wr = (const char *)w->data + (size_t)r * w->row_bytes;
        for (int t = 0; t < n_tok; t++) {
            const void *xr = (const char *)act + (size_t)t * arb;
            float v;
            switch (w->type) {
            case PDM_DT_Q4_1:
                v = dot_q4_1_q8_1(wr, xr, nb);
                break;
            case PDM_DT_Q4_0:
                v = dot_q4_0_q8_0(wr, xr, nb);
                break;
            case PDM_DT_Q8_0:
                v = dot_q8_0_q8_0(wr, xr, nb);
                break;
            case PDM_DT_Q5_0:
                v = dot_q5_0_q8_0(wr, xr, nb);
                break;
            case PDM_DT_Q5_1:
                v = dot_q5_1_q8_1(wr, xr, nb);
                break;
            case PDM_DT_IQ4_NL:
                v = dot_iq4_nl_q8_0(wr, xr, nb);
                break;
            default:
                v = dot_float(w->type, wr, xr, w->cols);
                break;
            }
            y[(size_t)t * ldy + r] = v;
        }
    }
}

/* ---- Elementwise ------------------------------------------------------------------------- */

static void generic_rmsnorm(float *out, const float *x, const float *w, int n, float eps)
{
    double ss = 0.0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    float scale = 1.0f / sqrtf((float)(ss / n) + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * scale * w[i];
}

void pdm_kern__rope_generic(float *x, int n_heads, int head_dim, int32_t pos, float theta)
{
    /* Angle for pair i is pos * theta^(-2i/head_dim); advanced by multiplication as
     * llama.cpp does so both round the same way. */
    const float step = powf(theta, -2.0f / (float)head_dim);
    float cs[256], sn[256]; /* head_dim <= 512 is enforced by the model loader */
    float angle = (float)pos;
    for (int i = 0; i < head_dim / 2; i++) {
        cs[i] = cosf(angle);
        sn[i] = sinf(angle);
        angle *= step;
    }
    for (int h = 0; h < n_heads; h++) {
        float *v = x + (size_t)h * head_dim;
        for (int i = 0; i < head_dim / 2; i++) {
            float a = v[2 * i], b = v[2 * i + 1];
            v[2 * i] = a * cs[i] - b * sn[i];
            v[2 * i + 1] = a * sn[i] + b * cs[i];
        }
    }
}

static void generic_swiglu(float *out, const float *gate, const float *up, int n)
{
    for (int i = 0; i < n; i++) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

void pdm_kern__rope_ext_table(int head_dim, int32_t pos, const pdm_kern_rope_t *r, float *cs,
                              float *sn)
{
    /* As pdm_kern__rope_generic, with each pair's angle divided by its frequency factor and
     * multiplied by freq_scale in the order ggml's rope_yarn applies them. */
    const float step = powf(r->theta, -2.0f / (float)head_dim);
    float angle = (float)pos;
    for (int i = 0; i < head_dim / 2; i++) {
        float a = r->freq_factors ? angle / r->freq_factors[i] : angle;
        a *= r->freq_scale;
        cs[i] = cosf(a);
        sn[i] = sinf(a);
        angle *= step;
    }
}

void pdm_kern__rope_ext_generic(float *x, int n_heads, int head_dim, int32_t pos,
                                const pdm_kern_rope_t *r)
{
    const int half = head_dim / 2;
    float cs[256], sn[256];
    pdm_kern__rope_ext_table(head_dim, pos, r, cs, sn);
    /* pair i is (x[i0], x[i1]): adjacent values (NORM) or half a head apart (NEOX) */
    const int stride = r->neox ? 1 : 2, gap = r->neox ? half : 1;
    for (int h = 0; h < n_heads; h++) {
        float *v = x + (size_t)h * head_dim;
        for (int i = 0; i < half; i++) {
            float *p0 = v + (size_t)i * stride, *p1 = p0 + gap;
            float a = *p0, b = *p1;
            *p0 = a * cs[i] - b * sn[i];
            *p1 = a * sn[i] + b * cs[i];
        }
    }
}

/* GELU, tanh form, as ggml_gelu_f32 writes it (ggml-cpu vec.h). */
static void generic_geglu(float *out, const float *gate, const float *up, int n)
{
    const float sqrt_2_over_pi = 0.79788456080286535587989211986876f, coef_a = 0.044715f;
    for (int i = 0; i < n; i++) {
        float x = gate[i];
        out[i] = 0.5f * x * (1.0f + tanhf(sqrt_2_over_pi * x * (1.0f + coef_a * x * x))) * up[i];
    }
}

/* ---- Attention --------------------------------------------------------------------------- */

/* Element i of a K or V array; int8 ("q8") is dequantized on the fly with the head's scale. */
static inline float kv_get(pdm_dtype_t type, const void *base, int64_t i, float scale)
{
    if (type == PDM_DT_I8) return scale * (float)((const int8_t *)base)[i];
    return type == PDM_DT_F16 ? pdm_f16_to_f32(((const uint16_t *)base)[i])
                              : ((const float *)base)[i];
}

int pdm_kern__visible_range(const pdm_kern_attn_t *a, int32_t qpos, int *first)
{
    *first = 0;
    if (!a->causal) return a->n_kv;
    int64_t vis = (int64_t)qpos - a->k_pos0 + 1;
    if (vis <= 0) return 0;
    if (a->window > 0) {
        int64_t lo = (int64_t)qpos - a->window + 1 - a->k_pos0; /* oldest key in the window */
        if (lo > 0) *first = lo > a->n_kv ? a->n_kv : (int)lo;
    }
    return vis > a->n_kv ? a->n_kv : (int)vis;
}

/* Key j is row rows[j] of k and v (row j when rows is NULL). */
static void generic_attention_rows(const pdm_kern_attn_t *a, const int32_t *rows)
{
    const int hd = a->head_dim;
    for (int i = 0; i < a->n_q; i++) {
        const float *q = a->q + (size_t)i * a->q_stride;
        float *o = a->o + (size_t)i * a->o_stride;
        int first;
        int vis = pdm_kern__visible_range(a, a->q_pos[i], &first);
        for (int d = 0; d < hd; d++) o[d] = 0.0f;
        if (vis <= first) {
            a->lse[(size_t)i * a->lse_stride] = -INFINITY;
            continue;
        }
        /* Online softmax: running max m, running denominator l, o holds the unnormalised
         * weighted sum of values. */
        float m = -INFINITY, l = 0.0f;
        for (int j = first; j < vis; j++) {
            const int64_t row = rows ? rows[j] : j;
            float s = 0.0f;
            for (int d = 0; d < hd; d++) s += q[d] * kv_get(a->kv_type, a->k, row * hd + d, a->k_scale);
            s *= a->scale;
            if (s > m) {
                float c = expf(m - s); /* exp(-inf) = 0 on the first key */
                l *= c;
                for (int d = 0; d < hd; d++) o[d] *= c;
                m = s;
            }
            float p = expf(s - m);
            l += p;
            for (int d = 0; d < hd; d++) o[d] += p * kv_get(a->kv_type, a->v, row * hd + d, a->v_scale);
        }
        float inv = 1.0f / l;
        for (int d = 0; d < hd; d++) o[d] *= inv;
        a->lse[(size_t)i * a->lse_stride] = m + logf(l);
    }
}

static void generic_attention(const pdm_kern_attn_t *a) { generic_attention_rows(a, NULL); }

void pdm_kern__attn_merge_generic(float *o1, float *lse1, const float *o2, float lse2, int n)
{
    /* Empty partials carry lse = -inf and must not produce -inf - -inf = NaN
     * (context-parallelism paper §3.5, merge of partial attention). */
    if (isinf(lse2) && lse2 < 0) return;
    if (isinf(*lse1) && *lse1 < 0) {
        memcpy(o1, o2, (size_t)n * sizeof(float));
        *lse1 = lse2;
        return;
    }
    float m = fmaxf(*lse1, lse2);
    float w1 = expf(*lse1 - m), w2 = expf(lse2 - m);
    float inv = 1.0f / (w1 + w2);
    for (int i = 0; i < n; i++) o1[i] = (w1 * o1[i] + w2 * o2[i]) * inv;
    *lse1 = m + log1pf(expf(fminf(*lse1, lse2) - m));
}

void pdm_kern__kv_store_generic(pdm_dtype_t type, const float *src, void *dst, int n)
{
    if (type == PDM_DT_F16) {
        uint16_t *d = dst;
        for (int i = 0; i < n; i++) d[i] = pdm_f32_to_f16(src[i]);
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

const pdm_kern_ops_t pdm_kern_ops_generic = {
    .name = "generic",
    .act_bytes = pdm_kern__act_bytes,
    .act_convert = generic_act_convert,
    .matmul = generic_matmul,
    .rmsnorm = generic_rmsnorm,
    .rope = pdm_kern__rope_generic,
    .swiglu = generic_swiglu,
    .attention = generic_attention,
    .attn_merge = pdm_kern__attn_merge_generic,
    .kv_store = pdm_kern__kv_store_generic,
    .attention_rows = generic_attention_rows,
    .rope_ext = pdm_kern__rope_ext_generic,
    .geglu = generic_geglu,
};
