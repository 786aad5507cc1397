/*
 * dtype.c - data type traits and the reference (scalar) conversions between f32 and every
 * storage type. These are the definitions the SIMD kernels are tested against.
 */
#include "ops_internal.h"
#include "quant_layout.h"

#include <math.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

typedef struct {
    const char *name;
    int block_elems;
    size_t block_bytes;
} pdm__dtype_traits_t;

static const pdm__dtype_traits_t pdm__traits[PDM_DT_COUNT_] = {
    [PDM_DT_F32] = {"f32", 1, 4},
    [PDM_DT_F16] = {"f16", 1, 2},
    [PDM_DT_Q4_0] = {"q4_0", PDM_QK, sizeof(pdm_block_q4_0_t)},
    [PDM_DT_Q4_1] = {"q4_1", PDM_QK, sizeof(pdm_block_q4_1_t)},
    [PDM_DT_Q8_0] = {"q8_0", PDM_QK, sizeof(pdm_block_q8_0_t)},
    [PDM_DT_Q8_1] = {"q8_1", PDM_QK, sizeof(pdm_block_q8_1_t)},
    [PDM_DT_Q5_0] = {"q5_0", PDM_QK, sizeof(pdm_block_q5_0_t)},
    [PDM_DT_Q5_1] = {"q5_1", PDM_QK, sizeof(pdm_block_q5_1_t)},
    [PDM_DT_Q2_K] = {"q2_k", PDM_QK_K, sizeof(pdm_block_q2_K_t)},
    [PDM_DT_Q3_K] = {"q3_k", PDM_QK_K, sizeof(pdm_block_q3_K_t)},
    [PDM_DT_Q4_K] = {"q4_k", PDM_QK_K, sizeof(pdm_block_q4_K_t)},
    [PDM_DT_Q5_K] = {"q5_k", PDM_QK_K, sizeof(pdm_block_q5_K_t)},
    [PDM_DT_Q6_K] = {"q6_k", PDM_QK_K, sizeof(pdm_block_q6_K_t)},
    [PDM_DT_Q8_K] = {"q8_k", PDM_QK_K, sizeof(pdm_block_q8_K_t)},
    [PDM_DT_IQ4_NL] = {"iq4_nl", PDM_QK, sizeof(pdm_block_iq4_nl_t)},
    [PDM_DT_IQ4_XS] = {"iq4_xs", PDM_QK_K, sizeof(pdm_block_iq4_xs_t)},
    [PDM_DT_I8] = {"q8", 1, 1},
    [PDM_DT_BF16] = {"bf16", 1, 2},
};

_Static_assert(sizeof(pdm_block_q4_0_t) == 18, "q4_0 block layout");
_Static_assert(sizeof(pdm_block_q4_1_t) == 20, "q4_1 block layout");
_Static_assert(sizeof(pdm_block_q8_0_t) == 34, "q8_0 block layout");
_Static_assert(sizeof(pdm_block_q8_1_t) == 40, "q8_1 block layout");
/* Sizes as GGUF files store them (gguf-py constants.py GGML_QUANT_SIZES, ggml-common.h). */
_Static_assert(sizeof(pdm_block_q5_0_t) == 22, "q5_0 block layout");
_Static_assert(sizeof(pdm_block_q5_1_t) == 24, "q5_1 block layout");
_Static_assert(sizeof(pdm_block_q2_K_t) == 84, "q2_K block layout");
_Static_assert(sizeof(pdm_block_q3_K_t) == 110, "q3_K block layout");
_Static_assert(sizeof(pdm_block_q4_K_t) == 144, "q4_K block layout");
_Static_assert(sizeof(pdm_block_q5_K_t) == 176, "q5_K block layout");
_Static_assert(sizeof(pdm_block_q6_K_t) == 210, "q6_K block layout");
_Static_assert(sizeof(pdm_block_q8_K_t) == 292, "q8_K block layout");
_Static_assert(sizeof(pdm_block_iq4_nl_t) == 18, "iq4_nl block layout");
_Static_assert(sizeof(pdm_block_iq4_xs_t) == 136, "iq4_xs block layout");

const int8_t pdm_kvalues_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                      1,    13,   25,  38,  53,  69,  89,  113};

int pdm_dtype_valid(uint32_t type)
{
    return type < PDM_DT_COUNT_ && pdm__traits[type].name != NULL;
}

int pdm_dtype_is_weight(pdm_dtype_t type)
{
    return pdm_dtype_valid(type) && type != PDM_DT_Q8_1 && type != PDM_DT_Q8_K &&
           type != PDM_DT_I8;
}

const char *pdm_dtype_weight_list(void)
{
    /* kept in step with pdm_dtype_is_weight by test_kernels.c */
    return "f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q2_k, q3_k, q4_k, q5_k, q6_k, "
           "iq4_nl, iq4_xs";
}

int pdm_dtype_from_name(const char *name)
{
    for (int t = 0; t < PDM_DT_COUNT_; t++)
        if (pdm__traits[t].name && !strcasecmp(name, pdm__traits[t].name)) return t;
    return -1;
}

const char *pdm_dtype_name(pdm_dtype_t type)
{
    return pdm_dtype_valid(type) ? pdm__traits[type].name : "unknown";
}

int pdm_dtype_block_elems(pdm_dtype_t type)
{
    return pdm_dtype_valid(type) ? pdm__traits[type].block_elems : 0;
}

size_t pdm_dtype_block_bytes(pdm_dtype_t type)
{
    return pdm_dtype_valid(type) ? pdm__traits[type].block_bytes : 0;
}

size_t pdm_dtype_row_bytes(pdm_dtype_t type, int64_t n)
{
    if (!pdm_dtype_valid(type) || n < 0) return 0;
    int be = pdm__traits[type].block_elems;
    if (n % be) return 0;
    return (size_t)(n / be) * pdm__traits[type].block_bytes;
}

/* IEEE half <-> single by bit manipulation, round-to-nearest-even, subnormals and
 * infinities/NaN preserved. */
float pdm_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t mant = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {
            /* subnormal: value = mant * 2^-24 */
            float f = (float)mant * 0x1p-24f;
            memcpy(&bits, &f, 4);
            bits |= sign;
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    }
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

uint16_t pdm_f32_to_f16(float f)
{
    uint32_t bits;
    memcpy(&bits, &f, 4);
    uint16_t sign = (uint16_t)((bits >> 16) & 0x8000);
    uint32_t abs = bits & 0x7fffffffu;
    if (abs >= 0x7f800000u) /* inf or NaN (keep a quiet NaN) */
        return sign | 0x7c00 | (abs > 0x7f800000u ? 0x200 : 0);
    if (abs >= 0x477ff000u) /* rounds to >= 65520: overflow to inf */
        return sign | 0x7c00;
    if (abs < 0x38800000u) { /* below the smallest normal half: subnormal or zero */
        float a;
        memcpy(&a, &abs, 4);
        /* a * 2^24 rounded to nearest even integer gives the subnormal mantissa */
        float m = nearbyintf(a * 0x1p24f);
        return sign | (uint16_t)m;
    }
    uint32_t exp = (abs >> 23) - 112;
    uint32_t mant = abs & 0x7fffff;
    uint32_t half = (exp << 10) | (mant >> 13);
    uint32_t rest = mant & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (half & 1))) half++;
    return sign | (uint16_t)half;
}

float pdm_bf16_to_f32(uint16_t h)
{
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

uint16_t pdm_f32_to_bf16(float f)
{
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7fff + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

/* ---- Decoding the 5-bit, IQ4 and K-quant layouts ------------------------------------------
 * Bit positions are in quant_layout.h (shared with the CUDA kernels). */

int pdm_kern__is_kblock(pdm_dtype_t type)
{
    return type == PDM_DT_Q2_K || type == PDM_DT_Q3_K || type == PDM_DT_Q4_K ||
           type == PDM_DT_Q5_K || type == PDM_DT_Q6_K || type == PDM_DT_IQ4_XS;
}

void pdm_kern__kblock_unpack(pdm_dtype_t type, const void *block, pdm_kern__kblock_t *k)
{
    if (!pdm_kern__is_kblock(type)) {
        memset(k, 0, sizeof(*k));
        k->sub_len = 32;
        return;
    }
    uint16_t d, dmin;
    pdm_ql_kscales(type, block, &d, &dmin);
    k->d = pdm_f16_to_f32(d);
    k->dmin = pdm_f16_to_f32(dmin);
    k->sub_len = pdm_ql_sub_len(type);
    memset(k->scale, 0, sizeof(k->scale));
    memset(k->min, 0, sizeof(k->min));
    for (int j = 0; j < PDM_QK_K / k->sub_len; j++) {
        int sc, mn;
        pdm_ql_ksub(type, block, j, &sc, &mn);
        k->scale[j] = (int16_t)sc;
        k->min[j] = (int16_t)mn;
    }
    for (int e = 0; e < PDM_QK_K; e++) k->q[e] = (int8_t)pdm_ql_kquant(type, block, e);
}

/* Dequantizes the 256-element blocks through their integer form; the float operations and
 * their order are ggml's dequantize_row_* (sub-block scale d * sc first, then * q - dmin * m),
 * so values are bit-identical to ggml's and gguf-py's. */
static void pdm__dequantize_kblocks(pdm_dtype_t type, const void *src, float *dst, int64_t n)
{
    const size_t bb = pdm_dtype_block_bytes(type);
    pdm_kern__kblock_t k;
    for (int64_t i = 0; i < n / PDM_QK_K; i++) {
        pdm_kern__kblock_unpack(type, (const char *)src + (size_t)i * bb, &k);
        float *y = dst + i * PDM_QK_K;
        for (int j = 0; j < PDM_QK_K / k.sub_len; j++) {
            const float dl = k.d * (float)k.scale[j], ml = k.dmin * (float)k.min[j];
            for (int l = 0; l < k.sub_len; l++) {
                const int e = j * k.sub_len + l;
                y[e] = dl * (float)k.q[e] - ml;
            }
        }
    }
}

/* The 32-element types added with the K-quants: Q5_0, Q5_1, IQ4_NL. */
static void pdm__dequantize_q5_iq4nl(pdm_dtype_t type, const void *src, float *dst, int64_t n)
{
    for (int64_t i = 0; i < n / PDM_QK; i++) {
        float *y = dst + i * PDM_QK;
        if (type == PDM_DT_Q5_0) {
            const pdm_block_q5_0_t *b = (const pdm_block_q5_0_t *)src + i;
            const float d = pdm_f16_to_f32(b->d);
            for (int e = 0; e < PDM_QK; e++) y[e] = (float)(pdm_ql_q5(b->qs, b->qh, e) - 16) * d;
        } else if (type == PDM_DT_Q5_1) {
            const pdm_block_q5_1_t *b = (const pdm_block_q5_1_t *)src + i;
            const float d = pdm_f16_to_f32(b->d), m = pdm_f16_to_f32(b->m);
            for (int e = 0; e < PDM_QK; e++) y[e] = (float)pdm_ql_q5(b->qs, b->qh, e) * d + m;
        } else {
            const pdm_block_iq4_nl_t *b = (const pdm_block_iq4_nl_t *)src + i;
            const float d = pdm_f16_to_f32(b->d);
            for (int l = 0; l < PDM_QK / 2; l++) {
                y[l] = d * (float)pdm_kvalues_iq4nl[b->qs[l] & 0x0f];
                y[l + PDM_QK / 2] = d * (float)pdm_kvalues_iq4nl[b->qs[l] >> 4];
            }
        }
    }
}

void pdm_dequantize_row(pdm_dtype_t type, const void *src, float *dst, int64_t n)
{
    switch (type) {
    case PDM_DT_F32:
        memcpy(dst, src, (size_t)n * sizeof(float));
        break;
    case PDM_DT_F16: {
        const uint16_t *s = src;
        for (int64_t i = 0; i < n; i++) dst[i] = pdm_f16_to_f32(s[i]);
        break;
    }
    case PDM_DT_BF16: {
        const uint16_t *s = src;
        for (int64_t i = 0; i < n; i++) dst[i] = pdm_bf16_to_f32(s[i]);
        break;
    }
    case PDM_DT_Q4_0: {
        const pdm_block_q4_0_t *b = src;
        for (int64_t i = 0; i < n / PDM_QK; i++) {
            float d = pdm_f16_to_f32(b[i].d);
            for (int j = 0; j < PDM_QK / 2; j++) {
                dst[i * PDM_QK + j] = (float)((b[i].qs[j] & 0x0f) - 8) * d;
                dst[i * PDM_QK + j + PDM_QK / 2] = (float)((b[i].qs[j] >> 4) - 8) * d;
            }
        }
        break;
    }
    case PDM_DT_Q4_1: {
        const pdm_block_q4_1_t *b = src;
        for (int64_t i = 0; i < n / PDM_QK; i++) {
            float d = pdm_f16_to_f32(b[i].d), m = pdm_f16_to_f32(b[i].m);
            for (int j = 0; j < PDM_QK / 2; j++) {
                dst[i * PDM_QK + j] = (float)(b[i].qs[j] & 0x0f) * d + m;
                dst[i * PDM_QK + j + PDM_QK / 2] = (float)(b[i].qs[j] >> 4) * d + m;
            }
        }
        break;
    }
    case PDM_DT_Q8_0: {
        const pdm_block_q8_0_t *b = src;
        for (int64_t i = 0; i < n / PDM_QK; i++) {
            float d = pdm_f16_to_f32(b[i].d);
            for (int j = 0; j < PDM_QK; j++) dst[i * PDM_QK + j] = (float)b[i].qs[j] * d;
        }
        break;
    }
    case PDM_DT_Q8_1: {
        const pdm_block_q8_1_t *b = src;
        for (int64_t i = 0; i < n / PDM_QK; i++)
            for (int j = 0; j < PDM_QK; j++) dst[i * PDM_QK + j] = (float)b[i].qs[j] * b[i].d;
        break;
    }
    case PDM_DT_Q8_K: {
        const pdm_block_q8_K_t *b = src;
        for (int64_t i = 0; i < n / PDM_QK_K; i++)
            for (int j = 0; j < PDM_QK_K; j++) dst[i * PDM_QK_K + j] = (float)b[i].qs[j] * b[i].d;
        break;
    }
    case PDM_DT_Q5_0:
    case PDM_DT_Q5_1:
    case PDM_DT_IQ4_NL:
        pdm__dequantize_q5_iq4nl(type, src, dst, n);
        break;
    default:
        if (pdm_kern__is_kblock(type)) pdm__dequantize_kblocks(type, src, dst, n);
        break;
    }
}

/* ---- Quantizers for the 5-bit, IQ4 and K-quant layouts ------------------------------------
 * Our own scale search (not a copy of llama.cpp's): each sub-block's scale (and minimum) is
 * fitted by least squares over a small set of candidate grids, keeping the candidate with the
 * smallest squared error; the super-block scales then quantize the sub-block scales, and the
 * values are assigned again with the scales as they will be decoded. */

#define PDM__N_GRIDS 21 /* candidate grids per sub-block: steps -10 .. +10 around max / nmax */

static inline int pdm__clampi(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

/* Asymmetric fit x ~= scale * L - min with L in [0, nmax], scale >= 0, min >= 0 (the offset
 * is never positive, as ggml's K-quants store it). Writes L; returns the scale. */
static float pdm__fit_scale_min(const float *x, int n, int nmax, uint8_t *L, float *min_out)
{
    float lo = 0.0f, hi = x[0];
    for (int i = 0; i < n; i++) lo = fminf(lo, x[i]), hi = fmaxf(hi, x[i]);
    if (!(hi > lo)) {
        memset(L, 0, (size_t)n);
        *min_out = -lo;
        return 0.0f;
    }
    float best_err = INFINITY, best_scale = 0.0f, best_off = lo;
    uint8_t cand[32];
    for (int k = -PDM__N_GRIDS / 2; k <= PDM__N_GRIDS / 2; k++) {
        const float iscale = ((float)nmax + 0.1f * (float)k) / (hi - lo);
        double sl = 0, sx = 0, sll = 0, slx = 0;
        for (int i = 0; i < n; i++) {
            cand[i] = (uint8_t)pdm__clampi((int)nearbyintf(iscale * (x[i] - lo)), 0, nmax);
            sl += cand[i];
            sx += x[i];
            sll += (double)cand[i] * cand[i];
            slx += (double)cand[i] * x[i];
        }
        /* least squares x ~= a L + b, then b <= 0 enforced */
        double det = n * sll - sl * sl, a, b;
        if (det > 0) {
            a = (n * slx - sl * sx) / det;
            b = (sx - a * sl) / n;
        } else {
            a = 0;
            b = sx / n;
        }
        if (b > 0) {
            b = 0;
            a = sll > 0 ? slx / sll : 0;
        }
        if (a < 0) continue;
        double err = 0;
        for (int i = 0; i < n; i++) {
            double r = a * cand[i] + b - x[i];
            err += r * r;
        }
        if (err < best_err) {
            best_err = (float)err;
            best_scale = (float)a;
            best_off = (float)b;
            memcpy(L, cand, (size_t)n);
        }
    }
    *min_out = -best_off;
    return best_scale;
}

/* Symmetric fit x ~= scale * L with L in [-nmax, nmax - 1] (the extra negative level goes to
 * the element of largest magnitude, whose sign the scale takes). Returns the scale. */
static float pdm__fit_scale_sym(const float *x, int n, int nmax)
{
    float max = 0.0f, amax = 0.0f;
    for (int i = 0; i < n; i++)
        if (fabsf(x[i]) > amax) amax = fabsf(x[i]), max = x[i];
    if (amax == 0.0f) return 0.0f;
    float best_err = INFINITY, best_scale = 0.0f;
    for (int k = -PDM__N_GRIDS / 2; k <= PDM__N_GRIDS / 2; k++) {
        const float iscale = -((float)nmax + 0.1f * (float)k) / max;
        double sll = 0, slx = 0;
        for (int i = 0; i < n; i++) {
            int l = pdm__clampi((int)nearbyintf(iscale * x[i]), -nmax, nmax - 1);
            sll += (double)l * l;
            slx += (double)l * x[i];
        }
        if (sll == 0) continue;
        const double a = slx / sll;
        double err = 0;
        for (int i = 0; i < n; i++) {
            int l = pdm__clampi((int)nearbyintf(iscale * x[i]), -nmax, nmax - 1);
            double r = a * l - x[i];
            err += r * r;
        }
        if (err < best_err) best_err = (float)err, best_scale = (float)a;
    }
    return best_scale;
}

/* Index of the IQ4 table value nearest to v (the table is sorted). */
static int pdm__iq4_index(float v)
{
    int best = 0;
    for (int i = 1; i < 16; i++)
        if (fabsf(v - (float)pdm_kvalues_iq4nl[i]) < fabsf(v - (float)pdm_kvalues_iq4nl[best]))
            best = i;
    return best;
}

/* Fit x ~= d * kvalues[L] for one sub-block; candidates map the element of largest magnitude
 * near either end of the table. Returns d. */
static float pdm__fit_iq4(const float *x, int n)
{
    float max = 0.0f, amax = 0.0f;
    for (int i = 0; i < n; i++)
        if (fabsf(x[i]) > amax) amax = fabsf(x[i]), max = x[i];
    if (amax == 0.0f) return 0.0f;
    float best_err = INFINITY, best_d = 0.0f;
    for (int end = 0; end < 2; end++) {
        const float edge = end ? 113.0f : -127.0f;
        for (int k = -PDM__N_GRIDS / 2; k <= PDM__N_GRIDS / 2; k++) {
            const float id = (edge + (end ? 1.0f : -1.0f) * (float)k) / max;
            double skk = 0, skx = 0;
            int8_t kv[PDM_QK];
            for (int i = 0; i < n; i++) {
                kv[i] = pdm_kvalues_iq4nl[pdm__iq4_index(id * x[i])];
                skk += (double)kv[i] * kv[i];
                skx += (double)kv[i] * x[i];
            }
            if (skk == 0) continue;
            const double d = skx / skk;
            double err = 0;
            for (int i = 0; i < n; i++) {
                double r = d * kv[i] - x[i];
                err += r * r;
            }
            if (err < best_err) best_err = (float)err, best_d = (float)d;
        }
    }
    return best_d;
}

/* Q5_0 / Q5_1: as Q4_0 / Q4_1 with 32 levels (ggml's reference rule). */
static void pdm__quantize_q5(pdm_dtype_t type, const float *x, void *block)
{
    int q[PDM_QK];
    uint8_t *qs, *qh;
    if (type == PDM_DT_Q5_0) {
        pdm_block_q5_0_t *b = block;
        float max = 0.0f, amax = 0.0f;
        for (int j = 0; j < PDM_QK; j++)
            if (fabsf(x[j]) > amax) amax = fabsf(x[j]), max = x[j];
        const float d = max / -16.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        b->d = pdm_f32_to_f16(d);
        for (int j = 0; j < PDM_QK; j++) q[j] = pdm__clampi((int)(x[j] * id + 16.5f), 0, 31);
        qs = b->qs, qh = b->qh;
    } else {
        pdm_block_q5_1_t *b = block;
        float lo = x[0], hi = x[0];
        for (int j = 1; j < PDM_QK; j++) lo = fminf(lo, x[j]), hi = fmaxf(hi, x[j]);
        const float d = (hi - lo) / 31.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        b->d = pdm_f32_to_f16(d);
        b->m = pdm_f32_to_f16(lo);
        for (int j = 0; j < PDM_QK; j++) q[j] = pdm__clampi((int)((x[j] - lo) * id + 0.5f), 0, 31);
        qs = b->qs, qh = b->qh;
    }
    uint32_t h = 0;
    for (int j = 0; j < PDM_QK / 2; j++) {
        qs[j] = (uint8_t)((q[j] & 0x0f) | (q[j + 16] & 0x0f) << 4);
        h |= (uint32_t)(q[j] >> 4) << j | (uint32_t)(q[j + 16] >> 4) << (j + 16);
    }
    for (int k = 0; k < 4; k++) qh[k] = (uint8_t)(h >> (8 * k));
}

static void pdm__quantize_iq4_nl(const float *x, pdm_block_iq4_nl_t *b)
{
    b->d = pdm_f32_to_f16(pdm__fit_iq4(x, PDM_QK));
    const float d = pdm_f16_to_f32(b->d), id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int j = 0; j < PDM_QK / 2; j++)
        b->qs[j] = (uint8_t)(pdm__iq4_index(x[j] * id) | pdm__iq4_index(x[j + 16] * id) << 4);
}

/* Super-block scale for sub-block scales s[0..n): d such that round(s / d) fits [lo, hi]
 * (signed: the scale of largest magnitude maps to lo; unsigned: the largest to hi). */
static float pdm__super_scale(const float *s, int n, int lo, int hi)
{
    float max = 0.0f, amax = 0.0f;
    for (int j = 0; j < n; j++)
        if (fabsf(s[j]) > amax) amax = fabsf(s[j]), max = s[j];
    if (amax == 0.0f) return 0.0f;
    return lo < 0 ? max / (float)lo : max / (float)hi;
}

static inline int pdm__quant_scale(float s, float d, int lo, int hi)
{
    return d != 0.0f ? pdm__clampi((int)nearbyintf(s / d), lo, hi) : 0;
}

/* Q4_K, Q5_K (sub-blocks of 32, 6-bit scale and min) and Q2_K (of 16, 4-bit). */
static void pdm__quantize_k_asym(pdm_dtype_t type, const float *x, void *block)
{
    const int sub = type == PDM_DT_Q2_K ? 16 : 32, ns = PDM_QK_K / sub;
    const int nmax = type == PDM_DT_Q2_K ? 3 : type == PDM_DT_Q4_K ? 15 : 31;
    const int smax = type == PDM_DT_Q2_K ? 15 : 63;
    float scale[16], min[16];
    uint8_t L[PDM_QK_K];
    int ls[16], lm[16];
    for (int j = 0; j < ns; j++)
        scale[j] = pdm__fit_scale_min(x + j * sub, sub, nmax, L + j * sub, &min[j]);
    uint16_t d16 = pdm_f32_to_f16(pdm__super_scale(scale, ns, 0, smax));
    uint16_t m16 = pdm_f32_to_f16(pdm__super_scale(min, ns, 0, smax));
    const float d = pdm_f16_to_f32(d16), dmin = pdm_f16_to_f32(m16);
    for (int j = 0; j < ns; j++) {
        /* the integer scale and min nearest the fitted ones, or a neighbour if that decodes
         * the sub-block with a smaller squared error */
        const int ls0 = pdm__quant_scale(scale[j], d, 0, smax);
        const int lm0 = pdm__quant_scale(min[j], dmin, 0, smax);
        double best = INFINITY;
        for (int a = ls0 - 1; a <= ls0 + 1; a++)
            for (int c = lm0 - 1; c <= lm0 + 1; c++) {
                if (a < 0 || a > smax || c < 0 || c > smax) continue;
                const float dl = d * (float)a, ml = dmin * (float)c;
                double err = 0;
                for (int l = 0; l < sub; l++) {
                    const float v = x[j * sub + l];
                    const int q =
                        dl > 0.0f ? pdm__clampi((int)nearbyintf((v + ml) / dl), 0, nmax) : 0;
                    err += (double)(dl * (float)q - ml - v) * (dl * (float)q - ml - v);
                }
                if (err < best) best = err, ls[j] = a, lm[j] = c;
            }
        const float dl = d * (float)ls[j], ml = dmin * (float)lm[j];
        for (int l = 0; l < sub; l++) {
            const int e = j * sub + l;
            const int q = dl > 0.0f ? (int)nearbyintf((x[e] + ml) / dl) : 0;
            L[e] = (uint8_t)pdm__clampi(q, 0, nmax);
        }
    }
    if (type == PDM_DT_Q2_K) {
        pdm_block_q2_K_t *b = block;
        b->d = d16, b->dmin = m16;
        memset(b->qs, 0, sizeof(b->qs));
        for (int j = 0; j < 16; j++) b->scales[j] = (uint8_t)(ls[j] | lm[j] << 4);
        for (int e = 0; e < PDM_QK_K; e++)
            b->qs[(e / 128) * 32 + e % 32] |= (uint8_t)(L[e] << (2 * ((e / 32) % 4)));
        return;
    }
    /* Q4_K / Q5_K share d, dmin, scales and the low-nibble layout */
    const int is5 = type == PDM_DT_Q5_K;
    pdm_block_q4_K_t *b4 = block;
    pdm_block_q5_K_t *b5 = block;
    uint8_t *sc = is5 ? b5->scales : b4->scales, *qs = is5 ? b5->qs : b4->qs;
    if (is5) b5->d = d16, b5->dmin = m16, memset(b5->qh, 0, sizeof(b5->qh));
    else b4->d = d16, b4->dmin = m16;
    memset(sc, 0, 12);
    memset(qs, 0, PDM_QK_K / 2);
    for (int j = 0; j < 8; j++) { /* inverse of pdm_ql_scale_min_k4 */
        if (j < 4) {
            sc[j] |= (uint8_t)ls[j];
            sc[j + 4] |= (uint8_t)lm[j];
        } else {
            sc[j + 4] = (uint8_t)((ls[j] & 0x0f) | (lm[j] & 0x0f) << 4);
            sc[j - 4] |= (uint8_t)((ls[j] >> 4) << 6);
            sc[j] |= (uint8_t)((lm[j] >> 4) << 6);
        }
    }
    for (int e = 0; e < PDM_QK_K; e++) {
        qs[(e / 64) * 32 + e % 32] |= (uint8_t)((L[e] & 0x0f) << (4 * ((e / 32) % 2)));
        if (is5) b5->qh[e % 32] |= (uint8_t)((L[e] >> 4) << (e / 32));
    }
}

/* Q3_K (3-bit values, 6-bit signed scales), Q6_K (6-bit, 8-bit scales) and IQ4_XS (table
 * values, 6-bit signed scales): symmetric sub-blocks, no minimum. */
static void pdm__quantize_k_sym(pdm_dtype_t type, const float *x, void *block)
{
    const int sub = type == PDM_DT_IQ4_XS ? 32 : 16, ns = PDM_QK_K / sub;
    const int nmax = type == PDM_DT_Q3_K ? 4 : 32;
    const int slo = type == PDM_DT_Q6_K ? -128 : -32, shi = type == PDM_DT_Q6_K ? 127 : 31;
    float scale[16];
    int ls[16], L[PDM_QK_K];
    for (int j = 0; j < ns; j++)
        scale[j] = type == PDM_DT_IQ4_XS ? pdm__fit_iq4(x + j * sub, sub)
                                         : pdm__fit_scale_sym(x + j * sub, sub, nmax);
    const uint16_t d16 = pdm_f32_to_f16(pdm__super_scale(scale, ns, slo, shi));
    const float d = pdm_f16_to_f32(d16);
    for (int j = 0; j < ns; j++) {
        /* the nearest integer scale or a neighbour, whichever decodes with less error */
        const int ls0 = pdm__quant_scale(scale[j], d, slo, shi);
        double best = INFINITY;
        for (int a = ls0 - 1; a <= ls0 + 1; a++) {
            if (a < slo || a > shi) continue;
            const float dl = d * (float)a, idl = dl != 0.0f ? 1.0f / dl : 0.0f;
            double err = 0;
            int cand[32];
            for (int l = 0; l < sub; l++) {
                const float v = x[j * sub + l];
                float y;
                if (type == PDM_DT_IQ4_XS) {
                    cand[l] = pdm__iq4_index(v * idl);
                    y = dl * (float)pdm_kvalues_iq4nl[cand[l]];
                } else {
                    cand[l] = pdm__clampi((int)nearbyintf(v * idl), -nmax, nmax - 1) + nmax;
                    y = dl * (float)(cand[l] - nmax);
                }
                err += (double)(y - v) * (y - v);
            }
            if (err < best) {
                best = err;
                ls[j] = a;
                memcpy(L + j * sub, cand, (size_t)sub * sizeof(int));
            }
        }
    }
    if (type == PDM_DT_Q3_K) {
        pdm_block_q3_K_t *b = block;
        b->d = d16;
        memset(b->hmask, 0, sizeof(b->hmask));
        memset(b->qs, 0, sizeof(b->qs));
        memset(b->scales, 0, sizeof(b->scales));
        for (int i = 0; i < 16; i++) { /* inverse of pdm_ql_q3_scale */
            const int v = ls[i] + 32;
            b->scales[i % 8] |= (uint8_t)((v & 0x0f) << (i < 8 ? 0 : 4));
            b->scales[8 + i % 4] |= (uint8_t)((v >> 4) << (2 * (i / 4)));
        }
        for (int e = 0; e < PDM_QK_K; e++) { /* L = q + 4 in 0..7: bit 2 is the high bit */
            b->qs[(e / 128) * 32 + e % 32] |= (uint8_t)((L[e] & 3) << (2 * ((e / 32) % 4)));
            b->hmask[e % 32] |= (uint8_t)((L[e] >> 2) << (e / 32));
        }
    } else if (type == PDM_DT_Q6_K) {
        pdm_block_q6_K_t *b = block;
        b->d = d16;
        memset(b->ql, 0, sizeof(b->ql));
        memset(b->qh, 0, sizeof(b->qh));
        for (int j = 0; j < 16; j++) b->scales[j] = (int8_t)ls[j];
        for (int e = 0; e < PDM_QK_K; e++) { /* inverse of pdm_ql_q6 */
            const int h = e / 128, k = (e % 128) / 32, l = e % 32;
            b->ql[64 * h + 32 * (k % 2) + l] |= (uint8_t)((L[e] & 0x0f) << (4 * (k / 2)));
            b->qh[32 * h + l] |= (uint8_t)((L[e] >> 4) << (2 * k));
        }
    } else {
        pdm_block_iq4_xs_t *b = block;
        b->d = d16;
        b->scales_h = 0;
        memset(b->scales_l, 0, sizeof(b->scales_l));
        for (int j = 0; j < 8; j++) {
            const int v = ls[j] + 32;
            b->scales_l[j / 2] |= (uint8_t)((v & 0x0f) << (4 * (j % 2)));
            b->scales_h |= (uint16_t)((v >> 4) << (2 * j));
            for (int l = 0; l < 16; l++)
                b->qs[16 * j + l] = (uint8_t)(L[32 * j + l] | L[32 * j + l + 16] << 4);
        }
    }
}

/* Activations for the K-quants (llama.cpp's quantize_row_q8_K_ref): per 256, the element of
 * largest magnitude maps to -127 (so +128 can occur and saturates at 127), ties to even,
 * d = 1 / iscale kept as f32, bsums the sums of 16 consecutive quants. */
void pdm_kern__quantize_q8_K_row(const float *x, pdm_block_q8_K_t *b, int64_t n)
{
    for (int64_t i = 0; i < n / PDM_QK_K; i++) {
        const float *xb = x + i * PDM_QK_K;
        float max = 0.0f, amax = 0.0f;
        for (int j = 0; j < PDM_QK_K; j++)
            if (fabsf(xb[j]) > amax) amax = fabsf(xb[j]), max = xb[j];
        if (amax == 0.0f) {
            memset(&b[i], 0, sizeof(b[i]));
            continue;
        }
        const float iscale = -127.0f / max;
        for (int j = 0; j < PDM_QK_K; j++) {
            int v = (int)nearbyintf(iscale * xb[j]);
            b[i].qs[j] = (int8_t)(v > 127 ? 127 : v);
        }
        for (int g = 0; g < PDM_QK_K / 16; g++) {
            int sum = 0;
            for (int l = 0; l < 16; l++) sum += b[i].qs[16 * g + l];
            b[i].bsums[g] = (int16_t)sum;
        }
        b[i].d = 1.0f / iscale;
    }
}

/* Quantizes the types added with the K-quants, one block at a time. */
static void pdm__quantize_new(pdm_dtype_t type, const float *src, void *dst, int64_t n)
{
    const int be = pdm_dtype_block_elems(type);
    const size_t bb = pdm_dtype_block_bytes(type);
    if (type == PDM_DT_Q8_K) {
        pdm_kern__quantize_q8_K_row(src, dst, n);
        return;
    }
    for (int64_t i = 0; i < n / be; i++) {
        const float *x = src + i * be;
        void *b = (char *)dst + (size_t)i * bb;
        switch (type) {
        case PDM_DT_Q5_0:
        case PDM_DT_Q5_1:
            pdm__quantize_q5(type, x, b);
            break;
        case PDM_DT_IQ4_NL:
            pdm__quantize_iq4_nl(x, b);
            break;
        case PDM_DT_Q2_K:
        case PDM_DT_Q4_K:
        case PDM_DT_Q5_K:
            pdm__quantize_k_asym(type, x, b);
            break;
        default: /* Q3_K, Q6_K, IQ4_XS */
            pdm__quantize_k_sym(type, x, b);
            break;
        }
    }
}

static float pdm__absmax(const float *x, int n)
{
    float amax = 0.0f;
    for (int j = 0; j < n; j++) amax = fmaxf(amax, fabsf(x[j]));
    return amax;
}

void pdm_quantize_row(pdm_dtype_t type, const float *src, void *dst, int64_t n)
{
    switch (type) {
    case PDM_DT_F32:
        memcpy(dst, src, (size_t)n * sizeof(float));
        break;
    case PDM_DT_F16: {
        uint16_t *d = dst;
        for (int64_t i = 0; i < n; i++) d[i] = pdm_f32_to_f16(src[i]);
        break;
    }
    case PDM_DT_BF16: {
        uint16_t *d = dst;
        for (int64_t i = 0; i < n; i++) d[i] = pdm_f32_to_bf16(src[i]);
        break;
    }
    case PDM_DT_Q4_0: {
        /* Symmetric: the element of largest magnitude maps to -8. */
        pdm_block_q4_0_t *b = dst;
        for (int64_t i = 0; i < n / PDM_QK; i++) {
            const float *x = src + i * PDM_QK;
            float max = 0.0f, amax = 0.0f;
            for (int j = 0; j < PDM_QK; j++)
                if (fabsf(x[j]) > amax) amax = fabsf(x[j]), max = x[j];
            float d = max / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            b[i].d = pdm_f32_to_f16(d);
            for (int j = 0; j < PDM_QK / 2; j++) {
                int q0 = (int)fminf(15.0f, x[j] * id + 8.5f);
                int q1 = (int)fminf(15.0f, x[j + PDM_QK / 2] * id + 8.5f);
                b[i].qs[j] = (uint8_t)(q0 | (q1 << 4));
            }
        }
        break;
    }
    case PDM_DT_Q4_1: {
        pdm_block_q4_1_t *b = dst;
        for (int64_t i = 0; i < n / PDM_QK; i++) {
            const float *x = src + i * PDM_QK;
            float lo = x[0], hi = x[0];
            for (int j = 1; j < PDM_QK; j++) lo = fminf(lo, x[j]), hi = fmaxf(hi, x[j]);
            float d = (hi - lo) / 15.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            b[i].d = pdm_f32_to_f16(d);
            b[i].m = pdm_f32_to_f16(lo);
            for (int j = 0; j < PDM_QK / 2; j++) {
                int q0 = (int)fminf(15.0f, (x[j] - lo) * id + 0.5f);
                int q1 = (int)fminf(15.0f, (x[j + PDM_QK / 2] - lo) * id + 0.5f);
                b[i].qs[j] = (uint8_t)(q0 | (q1 << 4));
            }
        }
        break;
    }
    case PDM_DT_Q8_0: {
        pdm_block_q8_0_t *b = dst;
        for (int64_t i = 0; i < n / PDM_QK; i++) {
            const float *x = src + i * PDM_QK;
            float d = pdm__absmax(x, PDM_QK) / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            b[i].d = pdm_f32_to_f16(d);
            for (int j = 0; j < PDM_QK; j++) b[i].qs[j] = (int8_t)roundf(x[j] * id);
        }
        break;
    }
    case PDM_DT_Q8_1: {
        pdm_block_q8_1_t *b = dst;
        for (int64_t i = 0; i < n / PDM_QK; i++) {
            const float *x = src + i * PDM_QK;
            float d = pdm__absmax(x, PDM_QK) / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            int sum = 0;
            for (int j = 0; j < PDM_QK; j++) {
                b[i].qs[j] = (int8_t)roundf(x[j] * id);
                sum += b[i].qs[j];
            }
            b[i].d = d;
            b[i].s = d * (float)sum;
        }
        break;
    }
    default:
        if (pdm_dtype_valid(type) && type != PDM_DT_I8) pdm__quantize_new(type, src, dst, n);
        break;
    }
}

/* int8 KV with a per-head scale fixed at prefill (Qualcomm KV note, "Quantized model
 * optimization" d): past and new K/V share the quantization parameters, so rows are written
 * once with the head's scale and never re-quantized; new values beyond the prompt's range
 * saturate. */
void pdm_q8_quantize_row(const float *src, int8_t *dst, int64_t n, float scale)
{
    const float inv = 1.0f / scale;
    for (int64_t i = 0; i < n; i++) {
        float q = nearbyintf(src[i] * inv);
        q = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q;
        dst[i] = (int8_t)(q == q ? q : 0.0f); /* NaN stores 0 rather than undefined */
    }
}

float pdm_q8_scale(float absmax)
{
    return absmax > 0.0f && isfinite(absmax) ? absmax / 127.0f : 1.0f;
}
