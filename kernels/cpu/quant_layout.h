/*
 * quant_layout.h - where the bits of each element live in the 5-bit, IQ4 and K-quant blocks,
 * as ggml defines them (ggml/src/ggml-common.h block_*, dequantize_row_* in ggml-quants.c).
 * Shared by the scalar reference (dtype.c, ops_generic.c) and the CUDA kernels, hence
 * host-and-device inline functions on raw block bytes and no tables in memory. Internal.
 */
#ifndef PDM_KERNELS_CPU_QUANT_LAYOUT_H
#define PDM_KERNELS_CPU_QUANT_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#include "../kernels.h"

#ifdef __CUDACC__
#define PDM_QL_FN __host__ __device__ static inline
#else
#define PDM_QL_FN static inline
#endif

/* kvalues_iq4nl[i] without a table (device code cannot read host arrays): the 16 values as
 * int8 bytes of two 64-bit constants. test_kernels checks it against pdm_kvalues_iq4nl. */
PDM_QL_FN int pdm_ql_iq4(int i)
{
    const uint64_t lo = 0xf6eaddcfbfad9881ull, hi = 0x7159453526190d01ull;
    return (int)(int8_t)(uint8_t)((i < 8 ? lo : hi) >> (8 * (i % 8)));
}

/* Q5_0 / Q5_1 5-bit value of element e (0..31): low 4 bits in qs[e % 16] (low nibble for
 * e < 16), bit 4 is bit e of qh read as a little-endian u32. */
PDM_QL_FN int pdm_ql_q5(const uint8_t *qs, const uint8_t *qh, int e)
{
    return (e < 16 ? qs[e] & 0x0f : qs[e - 16] >> 4) | ((qh[e / 8] >> (e % 8)) & 1) << 4;
}

/* 6-bit scale and min of sub-block j (0..7) of Q4_K / Q5_K (ggml's get_scale_min_k4):
 * j < 4: low 6 bits of bytes j and j + 4; j >= 4: a nibble of byte j + 4 plus the top two
 * bits of bytes j - 4 (scale) and j (min). */
PDM_QL_FN void pdm_ql_scale_min_k4(const uint8_t *s, int j, int *scale, int *min)
{
    if (j < 4) {
        *scale = s[j] & 63;
        *min = s[j + 4] & 63;
    } else {
        *scale = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        *min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* 6-bit scale i (0..15) of Q3_K, stored + 32: low 4 bits are a nibble of bytes 0..7 (low for
 * i < 8), the high 2 bits are bits 2 (i / 4) .. +1 of byte 8 + i % 4. */
PDM_QL_FN int pdm_ql_q3_scale(const uint8_t *s, int i)
{
    int lo = i < 8 ? s[i] & 0x0f : s[i - 8] >> 4;
    int hi = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
    return (lo | hi << 4) - 32;
}

/* Q2_K / Q3_K 2-bit field of element e: byte (e / 128) * 32 + e % 32, bits 2 ((e / 32) % 4). */
PDM_QL_FN int pdm_ql_q2(const uint8_t *qs, int e)
{
    return (qs[(e / 128) * 32 + e % 32] >> (2 * ((e / 32) % 4))) & 3;
}

/* Q4_K / Q5_K low nibble of element e: byte (e / 64) * 32 + e % 32, high nibble for odd e / 32. */
PDM_QL_FN int pdm_ql_q4k(const uint8_t *qs, int e)
{
    return (qs[(e / 64) * 32 + e % 32] >> (4 * ((e / 32) % 2))) & 0x0f;
}

/* Q6_K 6-bit value of element e: in each half h = e / 128 with r = e % 128, quarter k = r / 32,
 * l = r % 32: low nibble (k < 2) or high nibble of ql[64 h + 32 (k % 2) + l], high two bits
 * at bits 2k of qh[32 h + l]. */
PDM_QL_FN int pdm_ql_q6(const uint8_t *ql, const uint8_t *qh, int e)
{
    int h = e / 128, k = (e % 128) / 32, l = e % 32;
    int lo = (ql[64 * h + 32 * (k % 2) + l] >> (4 * (k / 2))) & 0x0f;
    return lo | ((qh[32 * h + l] >> (2 * k)) & 3) << 4;
}

/* Elements per sub-block of a 256-element type (16 or 32). */
PDM_QL_FN int pdm_ql_sub_len(pdm_dtype_t type)
{
    return type == PDM_DT_Q4_K || type == PDM_DT_Q5_K || type == PDM_DT_IQ4_XS ? 32 : 16;
}

/* Signed quant of element e of a 256-element block (offsets applied, IQ4 table looked up):
 * x[e] = d * scale_j * q - dmin * min_j with j = e / sub_len. */
PDM_QL_FN int pdm_ql_kquant(pdm_dtype_t type, const void *block, int e)
{
    switch (type) {
    case PDM_DT_Q2_K:
        return pdm_ql_q2(((const pdm_block_q2_K_t *)block)->qs, e);
    case PDM_DT_Q3_K: {
        const pdm_block_q3_K_t *b = (const pdm_block_q3_K_t *)block;
        return pdm_ql_q2(b->qs, e) - (((b->hmask[e % 32] >> (e / 32)) & 1) ? 0 : 4);
    }
    case PDM_DT_Q4_K:
        return pdm_ql_q4k(((const pdm_block_q4_K_t *)block)->qs, e);
    case PDM_DT_Q5_K: {
        const pdm_block_q5_K_t *b = (const pdm_block_q5_K_t *)block;
        return pdm_ql_q4k(b->qs, e) | ((b->qh[e % 32] >> (e / 32)) & 1) << 4;
    }
    case PDM_DT_Q6_K: {
        const pdm_block_q6_K_t *b = (const pdm_block_q6_K_t *)block;
        return pdm_ql_q6(b->ql, b->qh, e) - 32;
    }
    default: { /* IQ4_XS: sub-block j's 16 bytes as IQ4_NL's */
        const uint8_t *qs = ((const pdm_block_iq4_xs_t *)block)->qs + 16 * (e / 32);
        const int l = e % 32;
        return pdm_ql_iq4(l < 16 ? qs[l] & 0x0f : qs[l - 16] >> 4);
    }
    }
}

/* Integer scale and minimum of sub-block j (min 0 for the types without one). */
PDM_QL_FN void pdm_ql_ksub(pdm_dtype_t type, const void *block, int j, int *scale, int *min)
{
    *min = 0;
    switch (type) {
    case PDM_DT_Q2_K: {
        const uint8_t sc = ((const pdm_block_q2_K_t *)block)->scales[j];
        *scale = sc & 0x0f;
        *min = sc >> 4;
        break;
    }
    case PDM_DT_Q3_K:
        *scale = pdm_ql_q3_scale(((const pdm_block_q3_K_t *)block)->scales, j);
        break;
    case PDM_DT_Q4_K:
        pdm_ql_scale_min_k4(((const pdm_block_q4_K_t *)block)->scales, j, scale, min);
        break;
    case PDM_DT_Q5_K:
        pdm_ql_scale_min_k4(((const pdm_block_q5_K_t *)block)->scales, j, scale, min);
        break;
    case PDM_DT_Q6_K:
        *scale = ((const pdm_block_q6_K_t *)block)->scales[j];
        break;
    default: { /* IQ4_XS: nibble j of scales_l and bits 2j..2j+1 of scales_h, stored + 32 */
        const pdm_block_iq4_xs_t *b = (const pdm_block_iq4_xs_t *)block;
        *scale = (((b->scales_l[j / 2] >> (4 * (j % 2))) & 0x0f) |
                  ((b->scales_h >> (2 * j)) & 3) << 4) - 32;
        break;
    }
    }
}

/* The f16 super-block scale d and minimum scale dmin (0 when the type has none). */
PDM_QL_FN void pdm_ql_kscales(pdm_dtype_t type, const void *block, uint16_t *d, uint16_t *dmin)
{
    *dmin = 0;
    switch (type) {
    case PDM_DT_Q2_K:
        *d = ((const pdm_block_q2_K_t *)block)->d;
        *dmin = ((const pdm_block_q2_K_t *)block)->dmin;
        break;
    case PDM_DT_Q3_K:
        *d = ((const pdm_block_q3_K_t *)block)->d;
        break;
    case PDM_DT_Q4_K:
        *d = ((const pdm_block_q4_K_t *)block)->d;
        *dmin = ((const pdm_block_q4_K_t *)block)->dmin;
        break;
    case PDM_DT_Q5_K:
        *d = ((const pdm_block_q5_K_t *)block)->d;
        *dmin = ((const pdm_block_q5_K_t *)block)->dmin;
        break;
    case PDM_DT_Q6_K:
        *d = ((const pdm_block_q6_K_t *)block)->d;
        break;
    default:
        *d = ((const pdm_block_iq4_xs_t *)block)->d;
        break;
    }
}

#endif
