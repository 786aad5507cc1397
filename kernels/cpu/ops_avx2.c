/*
 * ops_avx2.c - AVX2 + FMA + F16C variants of the hot kernels. Compiled with -mavx2 -mfma
 * -mf16c; only reached after select.c has checked CPUID.
 *
 * Matrix products process a weight row against up to four activation rows at once, so that
 * each quantized weight block is unpacked once per four tokens during prefill.
 */
#include "ops_internal.h"

#include <immintrin.h>
#include <math.h>
#include <string.h>

static inline float hsum256(__m256 v)
{
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* Sum of products of 32 unsigned bytes (0..15 or |w|) and 32 signed bytes as 8 floats. */
static inline __m256 mul_sum_u8_i8(__m256i u, __m256i s)
{
    __m256i p16 = _mm256_maddubs_epi16(u, s);
    __m256i p32 = _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
    return _mm256_cvtepi32_ps(p32);
}

static inline __m256i unpack_nibbles(const uint8_t *qs)
{
    __m128i b = _mm_loadu_si128((const __m128i *)qs);
    __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0f));
    __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0f));
    return _mm256_set_m128i(hi, lo); /* elements 0..15 then 16..31 */
}

#define TILE 4

static void matmul_q4_1(const pdm_kern_mat_t *w, const void *act, int n_tok, float *y,
                        int64_t ldy, int64_t r0, int64_t r1)
{
    const int64_t nb = w->cols / PDM_QK;
    const pdm_block_q8_1_t *x = act;
    for (int t0 = 0; t0 < n_tok; t0 += TILE) {
        int nt = n_tok - t0 < TILE ? n_tok - t0 : TILE;
        for (int64_t r = r0; r < r1; r++) {
            const pdm_block_q4_1_t *wb =
                (const pdm_block_q4_1_t *)((const char *)w->data + (size_t)r * w->row_bytes);
            __m256 acc[TILE];
            float mins[TILE] = {0};
            for (int k = 0; k < TILE; k++) acc[k] = _mm256_setzero_ps();
            for (int64_t i = 0; i < nb; i++) {
                __m256i wq = unpack_nibbles(wb[i].qs);
                float dw = _cvtsh_ss(wb[i].d), mw = _cvtsh_ss(wb[i].m);
                for (int k = 0; k < nt; k++) {
                    const pdm_block_q8_1_t *xb = x + (size_t)(t0 + k) * nb + i;
                    __m256i xq = _mm256_loadu_si256((const __m256i *)xb->qs);
                    acc[k] = _mm256_fmadd_ps(mul_sum_u8_i8(wq, xq), _mm256_set1_ps(dw * xb->d),
                                             acc[k]);
                    mins[k] += mw * xb->s;
                }
            }
            for (int k = 0; k < nt; k++) y[(size_t)(t0 + k) * ldy + r] = hsum256(acc[k]) + mins[k];
        }
    }
}

static void matmul_q8_0(const pdm_kern_mat_t *w, const void *act, int n_tok, float *y,
                        int64_t ldy, int64_t r0, int64_t r1, int w_is_q4_0)
{
    const int64_t nb = w->cols / PDM_QK;
    const pdm_block_q8_0_t *x = act;
    for (int t0 = 0; t0 < n_tok; t0 += TILE) {
        int nt = n_tok - t0 < TILE ? n_tok - t0 : TILE;
        for (int64_t r = r0; r < r1; r++) {
            const char *wrow = (const char *)w->data + (size_t)r * w->row_bytes;
            __m256 acc[TILE];
            for (int k = 0; k < TILE; k++) acc[k] = _mm256_setzero_ps();
            for (int64_t i = 0; i < nb; i++) {
                __m256i wq;
                float dw;
                if (w_is_q4_0) {
                    const pdm_block_q4_0_t *wb = (const pdm_block_q4_0_t *)wrow + i;
                    wq = _mm256_sub_epi8(unpack_nibbles(wb->qs), _mm256_set1_epi8(8));
                    dw = _cvtsh_ss(wb->d);
                } else {
                    const pdm_block_q8_0_t *wb = (const pdm_block_q8_0_t *)wrow + i;
                    wq = _mm256_loadu_si256((const __m256i *)wb->qs);
                    dw = _cvtsh_ss(wb->d);
                }
                /* signed x signed via |w| * (x with w's sign) */
                __m256i wabs = _mm256_sign_epi8(wq, wq);
                for (int k = 0; k < nt; k++) {
                    const pdm_block_q8_0_t *xb = x + (size_t)(t0 + k) * nb + i;
                    __m256i xq = _mm256_loadu_si256((const __m256i *)xb->qs);
                    __m256i xs = _mm256_sign_epi8(xq, wq);
                    acc[k] = _mm256_fmadd_ps(mul_sum_u8_i8(wabs, xs),
                                             _mm256_set1_ps(dw * _cvtsh_ss(xb->d)), acc[k]);
                }
            }
            for (int k = 0; k < nt; k++) y[(size_t)(t0 + k) * ldy + r] = hsum256(acc[k]);
        }
    }
}

static inline __m256 load8(pdm_dtype_t type, const void *base, int64_t i)
{
    if (type == PDM_DT_F32) return _mm256_loadu_ps((const float *)base + i);
    if (type == PDM_DT_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + i)));
    /* BF16: shift into the high half of each f32 */
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static float dot_float_avx2(pdm_dtype_t type, const void *w, const float *x, int64_t n)
{
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(load8(type, w, i), _mm256_loadu_ps(x + i), acc);
    float sum = hsum256(acc);
    for (; i < n; i++) {
        float wv = type == PDM_DT_F32   ? ((const float *)w)[i]
                   : type == PDM_DT_F16 ? pdm_f16_to_f32(((const uint16_t *)w)[i])
                                        : pdm_bf16_to_f32(((const uint16_t *)w)[i]);
        sum += wv * x[i];
    }
    return sum;
}

static void avx2_matmul(const pdm_kern_mat_t *w, const void *act, int n_tok, float *y,
                        int64_t ldy, int64_t r0, int64_t r1)
{
    switch (w->type) {
    case PDM_DT_Q4_1:
        matmul_q4_1(w, act, n_tok, y, ldy, r0, r1);
        return;
    case PDM_DT_Q8_0:
        matmul_q8_0(w, act, n_tok, y, ldy, r0, r1, 0);
        return;
    case PDM_DT_Q4_0:
        matmul_q8_0(w, act, n_tok, y, ldy, r0, r1, 1);
        return;
    default:
        break;
    }
    for (int t = 0; t < n_tok; t++) {
        const float *xr = (const float *)act + (size_t)t * w->cols;
        for (int64_t r = r0; r < r1; r++)
            y[(size_t)t * ldy + r] =
                dot_float_avx2(w->type, (const char *)w->data + (size_t)r * w->row_bytes, xr, w->cols);
    }
}

/* Q8_1 / Q8_0 activation quantization, vectorised over each block of 32. */
static void avx2_act_convert(pdm_dtype_t wtype, const float *x, int64_t cols, int t0, int t1,
                             void *act)
{
    pdm_dtype_t at = pdm_kern__act_type(wtype);
    if (at == PDM_DT_F32) return;
    const int64_t nb = cols / PDM_QK;
    const __m256 sign_mask = _mm256_set1_ps(-0.0f);
    for (int t = t0; t < t1; t++) {
        const float *xr = x + (size_t)t * cols;
        for (int64_t i = 0; i < nb; i++) {
            const float *xb = xr + i * PDM_QK;
            __m256 v[4];
            __m256 vmax = _mm256_setzero_ps();
            for (int k = 0; k < 4; k++) {
                v[k] = _mm256_loadu_ps(xb + 8 * k);
                vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign_mask, v[k]));
            }
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            float amax = _mm_cvtss_f32(m4);
            float d = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
            __m256 vid = _mm256_set1_ps(id);
            __m256i q32[4];
            for (int k = 0; k < 4; k++)
                q32[k] = _mm256_cvtps_epi32(_mm256_round_ps(
                    _mm256_mul_ps(v[k], vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            __m256i q16a = _mm256_packs_epi32(q32[0], q32[1]);
            __m256i q16b = _mm256_packs_epi32(q32[2], q32[3]);
            __m256i q8 = _mm256_packs_epi16(q16a, q16b);
            /* undo the lane interleaving of the two packs */
            q8 = _mm256_permutevar8x32_epi32(q8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            if (at == PDM_DT_Q8_1) {
                pdm_block_q8_1_t *b = (pdm_block_q8_1_t *)act + (size_t)t * nb + i;
                _mm256_storeu_si256((__m256i *)b->qs, q8);
                __m256i s32 = _mm256_add_epi32(_mm256_add_epi32(q32[0], q32[1]),
                                               _mm256_add_epi32(q32[2], q32[3]));
                __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s32),
                                           _mm256_extracti128_si256(s32, 1));
                s4 = _mm_hadd_epi32(s4, s4);
                s4 = _mm_hadd_epi32(s4, s4);
                int sum = _mm_cvtsi128_si32(s4);
                b->d = pdm_f16_to_f32(pdm_f32_to_f16(d));
                b->s = pdm_f16_to_f32(pdm_f32_to_f16((float)sum * d));
            } else {
                pdm_block_q8_0_t *b = (pdm_block_q8_0_t *)act + (size_t)t * nb + i;
                _mm256_storeu_si256((__m256i *)b->qs, q8);
                b->d = pdm_f32_to_f16(d);
            }
        }
    }
}

static void avx2_rmsnorm(float *out, const float *x, const float *w, int n, float eps)
{
    double ss = 0.0;
    int i = 0;
    __m256d acc = _mm256_setzero_pd();
    for (; i + 4 <= n; i += 4) {
        __m256d v = _mm256_cvtps_pd(_mm_loadu_ps(x + i));
        acc = _mm256_fmadd_pd(v, v, acc);
    }
    double tmp[4];
    _mm256_storeu_pd(tmp, acc);
    ss = tmp[0] + tmp[1] + tmp[2] + tmp[3];
    for (; i < n; i++) ss += (double)x[i] * x[i];
    __m256 scale = _mm256_set1_ps(1.0f / sqrtf((float)(ss / n) + eps));
    for (i = 0; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), scale),
                                                _mm256_loadu_ps(w + i)));
    float s = _mm256_cvtss_f32(scale);
    for (; i < n; i++) out[i] = x[i] * s * w[i];
}

static void avx2_swiglu(float *out, const float *gate, const float *up, int n)
{
    for (int i = 0; i < n; i++) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

/* Flash attention for one head: keys are walked in tiles; scores of a tile are computed with
 * FMA over head_dim, then the tile is folded into the running (max, sum, output) state. */
#define KTILE 64

static void avx2_attention(const pdm_kern_attn_t *a)
{
    const int hd = a->head_dim;
    if (hd % 8 || hd > 256) {
        pdm_kern_ops_generic.attention(a);
        return;
    }
    float s[KTILE];
    __m256 acc[32];
    const int nv = hd / 8;
    for (int i = 0; i < a->n_q; i++) {
        const float *q = a->q + (size_t)i * a->q_stride;
        float *o = a->o + (size_t)i * a->o_stride;
        int vis = pdm_kern__visible_keys(a, a->q_pos[i]);
        if (vis == 0) {
            memset(o, 0, (size_t)hd * sizeof(float));
            a->lse[(size_t)i * a->lse_stride] = -INFINITY;
            continue;
        }
        __m256 qv[32];
        for (int d = 0; d < nv; d++) {
            qv[d] = _mm256_mul_ps(_mm256_loadu_ps(q + 8 * d), _mm256_set1_ps(a->scale));
            acc[d] = _mm256_setzero_ps();
        }
        float m = -INFINITY, l = 0.0f;
        for (int j0 = 0; j0 < vis; j0 += KTILE) {
            int nt = vis - j0 < KTILE ? vis - j0 : KTILE;
            float tmax = -INFINITY;
            for (int j = 0; j < nt; j++) {
                int64_t off = (int64_t)(j0 + j) * hd;
                __m256 dot = _mm256_setzero_ps();
                for (int d = 0; d < nv; d++) dot = _mm256_fmadd_ps(qv[d], load8(a->kv_type, a->k, off + 8 * d), dot);
                s[j] = hsum256(dot);
                tmax = fmaxf(tmax, s[j]);
            }
            if (tmax > m) {
                float c = expf(m - tmax);
                l *= c;
                __m256 cv = _mm256_set1_ps(c);
                for (int d = 0; d < nv; d++) acc[d] = _mm256_mul_ps(acc[d], cv);
                m = tmax;
            }
            for (int j = 0; j < nt; j++) {
                float p = expf(s[j] - m);
                l += p;
                __m256 pv = _mm256_set1_ps(p);
                int64_t off = (int64_t)(j0 + j) * hd;
                for (int d = 0; d < nv; d++) acc[d] = _mm256_fmadd_ps(pv, load8(a->kv_type, a->v, off + 8 * d), acc[d]);
            }
        }
        __m256 inv = _mm256_set1_ps(1.0f / l);
        for (int d = 0; d < nv; d++) _mm256_storeu_ps(o + 8 * d, _mm256_mul_ps(acc[d], inv));
        a->lse[(size_t)i * a->lse_stride] = m + logf(l);
    }
}

static void avx2_kv_store(pdm_dtype_t type, const float *src, void *dst, int n)
{
    if (type != PDM_DT_F16) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *d = dst;
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(d + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) d[i] = pdm_f32_to_f16(src[i]);
}

const pdm_kern_ops_t pdm_kern_ops_avx2 = {
    .name = "avx2",
    .act_bytes = pdm_kern__act_bytes,
    .act_convert = avx2_act_convert,
    .matmul = avx2_matmul,
    .rmsnorm = avx2_rmsnorm,
    .rope = pdm_kern__rope_generic,
    .swiglu = avx2_swiglu,
    .attention = avx2_attention,
    .attn_merge = pdm_kern__attn_merge_generic,
    .kv_store = avx2_kv_store,
};
