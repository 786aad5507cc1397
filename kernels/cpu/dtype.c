/*
 * dtype.c - data type traits and the reference (scalar) conversions between f32 and every
 * storage type. These are the definitions the SIMD kernels are tested against.
 */
#include "../kernels.h"

#include <math.h>
#include <string.h>

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
    [PDM_DT_I8] = {"q8", 1, 1},
    [PDM_DT_BF16] = {"bf16", 1, 2},
};

_Static_assert(sizeof(pdm_block_q4_0_t) == 18, "q4_0 block layout");
_Static_assert(sizeof(pdm_block_q4_1_t) == 20, "q4_1 block layout");
_Static_assert(sizeof(pdm_block_q8_0_t) == 34, "q8_0 block layout");
_Static_assert(sizeof(pdm_block_q8_1_t) == 40, "q8_1 block layout");

int pdm_dtype_valid(uint32_t type)
{
    return type < PDM_DT_COUNT_ && pdm__traits[type].name != NULL;
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
    default:
        break;
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
