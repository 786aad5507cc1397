/*
 * repack.c - weight layouts rearranged at load for the CPU kernels (kernels.h, "Repacking at
 * load"): the conversion from the file's layout, the row dequantization of a repacked
 * matrix, and the scalar reference product on it that the SIMD variants are tested against.
 *
 * The technique (interleaving rows so that SIMD lanes hold rows, scales decoded ahead) is the
 * one of llama.cpp's ggml-cpu repack.cpp (block_q4_Kx8, ggml_gemm_q4_K_8x8_q8_K); the layout
 * and the code here are pdmesh's own.
 */
#include "ops_internal.h"
#include "quant_layout.h"

#include <math.h>
#include <string.h>

#define PDM_X8_ROWS 8

/* Super-blocks per row and groups of 8 rows of a repackable matrix; 0 groups if `m` has no
 * repacked layout. */
static int64_t pdm__x8_groups(const pdm_kern_mat_t *m, int64_t *nb)
{
    if ((m->type != PDM_DT_Q4_K && m->type != PDM_DT_Q5_K && m->type != PDM_DT_Q6_K &&
         m->type != PDM_DT_IQ4_XS && m->type != PDM_DT_Q8_0 && m->type != PDM_DT_Q5_0 &&
         m->type != PDM_DT_Q4_1) ||
        m->layout != PDM_KERN_LAYOUT_ROWS || m->rows < 1 || m->cols < 1)
        return 0;
    const int be = pdm_dtype_block_elems(m->type);
    if (m->cols % be) return 0;
    *nb = m->cols / be;
    return (m->rows + PDM_X8_ROWS - 1) / PDM_X8_ROWS;
}

/* Bytes of one group block of a repacked type. */
static size_t pdm__x8_block_bytes(pdm_dtype_t type)
{
    return type == PDM_DT_Q4_K   ? sizeof(pdm_block_q4_Kx8_t)
           : type == PDM_DT_Q5_K ? sizeof(pdm_block_q5_Kx8_t)
           : type == PDM_DT_Q6_K ? sizeof(pdm_block_q6_Kx8_t)
           : type == PDM_DT_Q5_0 ? sizeof(pdm_block_q5_0x8_t)
           : type == PDM_DT_IQ4_XS ? sizeof(pdm_block_iq4_xsx8_t)
           : type == PDM_DT_Q4_1 ? sizeof(pdm_block_q4_1x8_t)
                                 : sizeof(pdm_block_q8_0x8_t);
}

size_t pdm_kern_repack_bytes(const pdm_kern_mat_t *m)
{
    int64_t nb = 0, groups = pdm__x8_groups(m, &nb);
    return groups ? (size_t)groups * (size_t)nb * pdm__x8_block_bytes(m->type) : 0;
}

/* Row r (0..7) of group block o from the file's Q8_0 block b. */
static void pdm__repack_q8_0(const pdm_block_q8_0_t *b, int r, pdm_block_q8_0x8_t *o)
{
    o->d[r] = b->d;
    for (int k = 0; k < 8; k++) { /* 4 values at a time, + 128 each */
        uint32_t v;
        memcpy(&v, b->qs + 4 * k, 4);
        v ^= 0x80808080u;
        memcpy(&o->qs[k][4 * r], &v, 4);
    }
}

/* Row r (0..7) of group block o from the file's Q5_0 block b: the nibbles stay paired as in
 * the file (bytes 4k..4k+3 of qs hold elements 4k + l and 4k + 16 + l), the 32 high bits are
 * regrouped so that byte l of row r has those of elements l, 4 + l, ..., 28 + l. */
static void pdm__repack_q5_0(const pdm_block_q5_0_t *b, int r, pdm_block_q5_0x8_t *o)
{
    o->d[r] = b->d;
    for (int k = 0; k < 4; k++) memcpy(&o->qs[k][4 * r], b->qs + 4 * k, 4);
    const uint32_t h = (uint32_t)b->qh[0] | (uint32_t)b->qh[1] << 8 | (uint32_t)b->qh[2] << 16 |
                       (uint32_t)b->qh[3] << 24;
    for (int l = 0; l < 4; l++) {
        uint32_t v = 0;
        for (int k = 0; k < 8; k++) v |= ((h >> (4 * k + l)) & 1) << k;
        o->qh[4 * r + l] = (uint8_t)v;
    }
}

/* Row r (0..7) of group super-block o from the file's Q6_K block b. */
static void pdm__repack_q6_K(const pdm_block_q6_K_t *b, int r, pdm_block_q6_Kx8_t *o)
{
    o->d[r] = b->d;
    for (int j = 0; j < 16; j++) o->scales[j / 2][r][j % 2] = b->scales[j];
    uint8_t q[PDM_QK_K]; /* the 6-bit values, then composed byte by byte (no read-modify-write) */
    for (int h = 0; h < 2; h++) { /* pdm_ql_q6, 32 elements of each quarter at a time */
        const uint8_t *ql = b->ql + 64 * h, *qh = b->qh + 32 * h;
        uint8_t *qq = q + 128 * h;
        for (int l = 0; l < 32; l++) {
            qq[l] = (uint8_t)((ql[l] & 0x0f) | (qh[l] & 3) << 4);
            qq[l + 32] = (uint8_t)((ql[l + 32] & 0x0f) | ((qh[l] >> 2) & 3) << 4);
            qq[l + 64] = (uint8_t)((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4);
            qq[l + 96] = (uint8_t)((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4);
        }
    }
    for (int p = 0; p < 4; p++) {
        const uint8_t *lo = q + 64 * p, *hi = lo + 32;
        for (int k = 0; k < 8; k++)
            for (int l = 0; l < 4; l++) {
                const int e = 4 * k + l;
                o->run[p].ql[k][4 * r + l] = (uint8_t)((lo[e] & 0x0f) | (hi[e] & 0x0f) << 4);
            }
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 4; l++) {
                const int e0 = 8 * j + l, e1 = e0 + 4; /* k = 2j and 2j + 1 */
                o->run[p].qh[j][4 * r + l] = (uint8_t)((lo[e0] >> 4) | (hi[e0] >> 4) << 2 |
                                                       (lo[e1] >> 4) << 4 | (hi[e1] >> 4) << 6);
            }
    }
}

/* Row r (0..7) of group super-block o from the file's Q4_K block b. */
static void pdm__repack_q4_K(const pdm_block_q4_K_t *b, int r, pdm_block_q4_Kx8_t *o)
{
    o->d[r] = b->d;
    o->dmin[r] = b->dmin;
    for (int j = 0; j < 8; j++) {
        int scale, min;
        pdm_ql_scale_min_k4(b->scales, j, &scale, &min);
        o->scales[j][r] = (uint8_t)scale;
        o->mins[j / 2][r][j % 2] = (uint8_t)min;
    }
    for (int p = 0; p < 4; p++)
        for (int k = 0; k < 8; k++) memcpy(&o->qs[p][k][4 * r], b->qs + 32 * p + 4 * k, 4);
}

/* Row r (0..7) of group super-block o from the file's Q5_K block b: Q4_K's rearrangement,
 * and the fifth bits (bit 2p of the file's qh[e % 32] for element 64p + e % 32, bit 2p + 1 for
 * element 64p + 32 + e % 32) next to their run's nibbles. */
static void pdm__repack_q5_K(const pdm_block_q5_K_t *b, int r, pdm_block_q5_Kx8_t *o)
{
    o->d[r] = b->d;
    o->dmin[r] = b->dmin;
    for (int j = 0; j < 8; j++) {
        int scale, min;
        pdm_ql_scale_min_k4(b->scales, j, &scale, &min);
        o->scales[j][r] = (uint8_t)scale;
        o->mins[j / 2][r][j % 2] = (uint8_t)min;
    }
    for (int p = 0; p < 4; p++) {
        for (int k = 0; k < 8; k++) memcpy(&o->run[p].qs[k][4 * r], b->qs + 32 * p + 4 * k, 4);
        for (int h = 0; h < 2; h++)
            for (int l = 0; l < 4; l++) {
                unsigned v = 0;
                for (int kk = 0; kk < 4; kk++)
                    v |= ((b->qh[4 * (4 * h + kk) + l] >> (2 * p)) & 3u) << (2 * kk);
                o->run[p].qh[h][4 * r + l] = (uint8_t)v;
            }
    }
}

/* Row r (0..7) of group block o from the file's Q4_1 block b. */
static void pdm__repack_q4_1(const pdm_block_q4_1_t *b, int r, pdm_block_q4_1x8_t *o)
{
    o->d[r] = b->d;
    o->m[r] = b->m;
    for (int k = 0; k < 4; k++) memcpy(&o->qs[k][4 * r], b->qs + 4 * k, 4);
}

/* Row r (0..7) of group super-block o from the file's IQ4_XS block b. */
static void pdm__repack_iq4_xs(const pdm_block_iq4_xs_t *b, int r, pdm_block_iq4_xsx8_t *o)
{
    o->d[r] = b->d;
    for (int j = 0; j < 8; j++) {
        int scale, min;
        pdm_ql_ksub(PDM_DT_IQ4_XS, b, j, &scale, &min);
        o->scales[j][r] = (int8_t)scale;
        for (int k = 0; k < 4; k++) memcpy(&o->qs[j][k][4 * r], b->qs + 16 * j + 4 * k, 4);
    }
}

int pdm_kern_repack(const pdm_kern_mat_t *m, void *dst, pdm_kern_mat_t *out)
{
    int64_t nb = 0, groups = pdm__x8_groups(m, &nb);
    if (!groups) return -1;
    const size_t ob = pdm_kern_repack_bytes(m) / (size_t)(groups * nb); /* group block bytes */
    const size_t fb = pdm_dtype_block_bytes(m->type);
    char *o = dst;
    for (int64_t g = 0; g < groups; g++) {
        for (int64_t i = 0; i < nb; i++, o += ob) {
            /* rows past the end: d = 0 and q = 0 (Q8_0: stored as 0x80) give 0 */
            memset(o, 0, ob);
            if (m->type == PDM_DT_Q8_0) memset(((pdm_block_q8_0x8_t *)o)->qs, 0x80, 256);
            for (int r = 0; r < PDM_X8_ROWS; r++) {
                const int64_t row = g * PDM_X8_ROWS + r;
                if (row >= m->rows) break;
                const char *b = (const char *)m->data + (size_t)row * m->row_bytes + (size_t)i * fb;
                if (m->type == PDM_DT_Q4_K)
                    pdm__repack_q4_K((const pdm_block_q4_K_t *)b, r, (pdm_block_q4_Kx8_t *)o);
                else if (m->type == PDM_DT_Q5_K)
                    pdm__repack_q5_K((const pdm_block_q5_K_t *)b, r, (pdm_block_q5_Kx8_t *)o);
                else if (m->type == PDM_DT_Q8_0)
                    pdm__repack_q8_0((const pdm_block_q8_0_t *)b, r, (pdm_block_q8_0x8_t *)o);
                else if (m->type == PDM_DT_Q5_0)
                    pdm__repack_q5_0((const pdm_block_q5_0_t *)b, r, (pdm_block_q5_0x8_t *)o);
                else if (m->type == PDM_DT_Q4_1)
                    pdm__repack_q4_1((const pdm_block_q4_1_t *)b, r, (pdm_block_q4_1x8_t *)o);
                else if (m->type == PDM_DT_IQ4_XS)
                    pdm__repack_iq4_xs((const pdm_block_iq4_xs_t *)b, r, (pdm_block_iq4_xsx8_t *)o);
                else pdm__repack_q6_K((const pdm_block_q6_K_t *)b, r, (pdm_block_q6_Kx8_t *)o);
            }
        }
    }
    *out = *m;
    out->data = dst;
    out->layout = PDM_KERN_LAYOUT_X8;
    return 0;
}

/* The 4-bit value of element e of row r (0..7) in a repacked group super-block. */
static inline int pdm__x8_q(const pdm_block_q4_Kx8_t *b, int r, int e)
{
    const int p = e / 64, hi = (e / 32) % 2, k = (e % 32) / 4, l = e % 4;
    return (b->qs[p][k][4 * r + l] >> (4 * hi)) & 0x0f;
}

/* The 5-bit value of element e of row r in a repacked Q5_K group super-block. */
static inline int pdm__x8_q5k(const pdm_block_q5_Kx8_t *b, int r, int e)
{
    const int p = e / 64, hi = (e / 32) % 2, k = (e % 32) / 4, l = e % 4;
    const int lo = (b->run[p].qs[k][4 * r + l] >> (4 * hi)) & 0x0f;
    return lo | ((b->run[p].qh[k / 4][4 * r + l] >> (2 * (k % 4) + hi)) & 1) << 4;
}

/* The IQ4_XS value (kvalues[code]) of element e of row r in a repacked group super-block. */
static inline int pdm__x8_iq4(const pdm_block_iq4_xsx8_t *b, int r, int e)
{
    const int j = e / 32, hi = (e % 32) / 16, k = (e % 16) / 4, l = e % 4;
    return pdm_ql_iq4((b->qs[j][k][4 * r + l] >> (4 * hi)) & 0x0f);
}

/* The 5-bit value (0..31) of element e of row r in a repacked Q5_0 group block. */
static inline int pdm__x8_q5(const pdm_block_q5_0x8_t *b, int r, int e)
{
    const int k = e / 4, l = e % 4;
    const int lo = (b->qs[k % 4][4 * r + l] >> (4 * (k / 4))) & 0x0f;
    return lo | ((b->qh[4 * r + l] >> k) & 1) << 4;
}

/* The 6-bit value (0..63) of element e of row r in a repacked Q6_K group super-block. */
static inline int pdm__x8_q6(const pdm_block_q6_Kx8_t *b, int r, int e)
{
    const int p = e / 64, hi = (e / 32) % 2, k = (e % 32) / 4, l = e % 4;
    const int lo = (b->run[p].ql[k][4 * r + l] >> (4 * hi)) & 0x0f;
    return lo | ((b->run[p].qh[k / 2][4 * r + l] >> (4 * (k % 2) + 2 * hi)) & 3) << 4;
}

void pdm_kern_mat_dequantize_row(const pdm_kern_mat_t *m, int64_t r, float *dst)
{
    if (m->layout == PDM_KERN_LAYOUT_ROWS) {
        pdm_dequantize_row(m->type, (const char *)m->data + (size_t)r * m->row_bytes, dst, m->cols);
        return;
    }
    if (m->type == PDM_DT_Q8_0) { /* as pdm_dequantize_row: q * d */
        const int64_t nb = m->cols / PDM_QK;
        const pdm_block_q8_0x8_t *g = (const pdm_block_q8_0x8_t *)m->data + (r / PDM_X8_ROWS) * nb;
        const int rr = (int)(r % PDM_X8_ROWS);
        for (int64_t i = 0; i < nb; i++) {
            const float d = pdm_f16_to_f32(g[i].d[rr]);
            for (int e = 0; e < PDM_QK; e++)
                dst[i * PDM_QK + e] = (float)((int)g[i].qs[e / 4][4 * rr + e % 4] - 128) * d;
        }
        return;
    }
    if (m->type == PDM_DT_Q4_1) { /* as pdm_dequantize_row: q * d + m */
        const int64_t nb = m->cols / PDM_QK;
        const pdm_block_q4_1x8_t *g = (const pdm_block_q4_1x8_t *)m->data + (r / PDM_X8_ROWS) * nb;
        const int rr = (int)(r % PDM_X8_ROWS);
        for (int64_t i = 0; i < nb; i++) {
            const float d = pdm_f16_to_f32(g[i].d[rr]), mn = pdm_f16_to_f32(g[i].m[rr]);
            for (int e = 0; e < PDM_QK; e++) {
                const int k = (e % 16) / 4, hi = e / 16;
                const int q = (g[i].qs[k][4 * rr + e % 4] >> (4 * hi)) & 0x0f;
                dst[i * PDM_QK + e] = (float)q * d + mn;
            }
        }
        return;
    }
    if (m->type == PDM_DT_Q5_0) { /* as pdm_dequantize_row: (q - 16) * d */
        const int64_t nb = m->cols / PDM_QK;
        const pdm_block_q5_0x8_t *g = (const pdm_block_q5_0x8_t *)m->data + (r / PDM_X8_ROWS) * nb;
        const int rr = (int)(r % PDM_X8_ROWS);
        for (int64_t i = 0; i < nb; i++) {
            const float d = pdm_f16_to_f32(g[i].d[rr]);
            for (int e = 0; e < PDM_QK; e++)
                dst[i * PDM_QK + e] = (float)(pdm__x8_q5(&g[i], rr, e) - 16) * d;
        }
        return;
    }
    /* X8 K-quants: the arithmetic of pdm_dequantize_row's K-quant path, value for value */
    const int64_t nb = m->cols / PDM_QK_K;
    if (m->type == PDM_DT_IQ4_XS) {
        const pdm_block_iq4_xsx8_t *g = (const pdm_block_iq4_xsx8_t *)m->data + (r / PDM_X8_ROWS) * nb;
        const int rr = (int)(r % PDM_X8_ROWS);
        for (int64_t i = 0; i < nb; i++) {
            const float d = pdm_f16_to_f32(g[i].d[rr]), ml = 0.0f * 0.0f; /* no minimum */
            for (int j = 0; j < 8; j++) {
                const float dl = d * (float)g[i].scales[j][rr];
                for (int l = 0; l < 32; l++)
                    dst[i * PDM_QK_K + 32 * j + l] = dl * (float)pdm__x8_iq4(&g[i], rr, 32 * j + l) - ml;
            }
        }
        return;
    }
    if (m->type == PDM_DT_Q6_K) {
        const pdm_block_q6_Kx8_t *g = (const pdm_block_q6_Kx8_t *)m->data + (r / PDM_X8_ROWS) * nb;
        const int rr = (int)(r % PDM_X8_ROWS);
        for (int64_t i = 0; i < nb; i++) {
            const float d = pdm_f16_to_f32(g[i].d[rr]), ml = 0.0f * 0.0f; /* no minimum */
            for (int j = 0; j < 16; j++) {
                const float dl = d * (float)g[i].scales[j / 2][rr][j % 2];
                for (int l = 0; l < 16; l++)
                    dst[i * PDM_QK_K + 16 * j + l] =
                        dl * (float)(pdm__x8_q6(&g[i], rr, 16 * j + l) - 32) - ml;
            }
        }
        return;
    }
    /* Q4_K and Q5_K: the same header, 4- or 5-bit values */
    const int q5 = m->type == PDM_DT_Q5_K;
    const pdm_block_q4_Kx8_t *g = (const pdm_block_q4_Kx8_t *)m->data + (r / PDM_X8_ROWS) * nb;
    const pdm_block_q5_Kx8_t *g5 = (const pdm_block_q5_Kx8_t *)m->data + (r / PDM_X8_ROWS) * nb;
    const int rr = (int)(r % PDM_X8_ROWS);
    for (int64_t i = 0; i < nb; i++) {
        const uint16_t *hd = q5 ? g5[i].d : g[i].d, *hm = q5 ? g5[i].dmin : g[i].dmin;
        const float d = pdm_f16_to_f32(hd[rr]), dmin = pdm_f16_to_f32(hm[rr]);
        for (int j = 0; j < 8; j++) {
            const float dl = d * (float)(q5 ? g5[i].scales[j][rr] : g[i].scales[j][rr]);
            const float ml = dmin * (float)(q5 ? g5[i].mins[j / 2][rr][j % 2] : g[i].mins[j / 2][rr][j % 2]);
            for (int l = 0; l < 32; l++) {
                const int e = 32 * j + l, q = q5 ? pdm__x8_q5k(&g5[i], rr, e) : pdm__x8_q(&g[i], rr, e);
                dst[i * PDM_QK_K + e] = dl * (float)q - ml;
            }
        }
    }
}

/* The reference product on a repacked Q6_K matrix: per output, super-block by super-block,
 *   sumi = sum_j scale_j * (q_j . x_j) - 32 * sum_j scale_j * bsum_j  (j over 16 of 16)
 *   acc = fma(d * dx, sumi, acc)
 * with the same exactness argument as Q4_K's below. */
static void matmul_q6_Kx8(const pdm_kern_mat_t *w, const void *act, int n_tok, float *y,
                          int64_t ldy, int64_t r0, int64_t r1)
{
    const int64_t nb = w->cols / PDM_QK_K;
    const pdm_block_q6_Kx8_t *wb = w->data;
    const pdm_block_q8_K_t *x = act;
    for (int t = 0; t < n_tok; t++) {
        const pdm_block_q8_K_t *xt = x + (size_t)t * nb;
        for (int64_t r = r0; r < r1; r++) {
            const pdm_block_q6_Kx8_t *g = wb + (r / PDM_X8_ROWS) * nb;
            const int rr = (int)(r % PDM_X8_ROWS);
            float acc = 0.0f;
            for (int64_t i = 0; i < nb; i++) {
                int32_t sumi = 0, offs = 0;
                for (int j = 0; j < 16; j++) {
                    const int scale = g[i].scales[j / 2][rr][j % 2];
                    int32_t s = 0;
                    for (int l = 0; l < 16; l++)
                        s += pdm__x8_q6(&g[i], rr, 16 * j + l) * xt[i].qs[16 * j + l];
                    sumi += scale * s;
                    offs += scale * xt[i].bsums[j];
                }
                acc = fmaf(pdm_f16_to_f32(g[i].d[rr]) * xt[i].d, (float)(sumi - 32 * offs), acc);
            }
            y[(size_t)t * ldy + r] = acc;
        }
    }
}

/* The reference product on a repacked Q4_1 matrix (Q8_1 activations): per output, block by
 * block, acc = fma(d_w * d_x, sum of q * x, acc), acc = fma(m_w, s_x, acc). */
static void matmul_q4_1x8(const pdm_kern_mat_t *w, const void *act, int n_tok, float *y,
                          int64_t ldy, int64_t r0, int64_t r1)
{
    const int64_t nb = w->cols / PDM_QK;
    const pdm_block_q4_1x8_t *wb = w->data;
    const pdm_block_q8_1_t *x = act;
    for (int t = 0; t < n_tok; t++) {
        const pdm_block_q8_1_t *xt = x + (size_t)t * nb;
        for (int64_t r = r0; r < r1; r++) {
            const pdm_block_q4_1x8_t *g = wb + (r / PDM_X8_ROWS) * nb;
            const int rr = (int)(r % PDM_X8_ROWS);
            float acc = 0.0f;
            for (int64_t i = 0; i < nb; i++) {
                int32_t sumi = 0;
                for (int e = 0; e < PDM_QK; e++) {
                    const int k = (e % 16) / 4, hi = e / 16;
                    sumi += ((g[i].qs[k][4 * rr + e % 4] >> (4 * hi)) & 0x0f) * xt[i].qs[e];
                }
                acc = fmaf(pdm_f16_to_f32(g[i].d[rr]) * xt[i].d, (float)sumi, acc);
                acc = fmaf(pdm_f16_to_f32(g[i].m[rr]), xt[i].s, acc);
            }
            y[(size_t)t * ldy + r] = acc;
        }
    }
}

/* The reference product on a repacked IQ4_XS matrix: per output, super-block by super-block,
 * sumi = sum_j scale_j * (q_j . x_j), acc = fma(d * dx, sumi, acc). */
static void matmul_iq4_xsx8(const pdm_kern_mat_t *w, const void *act, int n_tok, float *y,
                            int64_t ldy, int64_t r0, int64_t r1)
{
    const int64_t nb = w->cols / PDM_QK_K;
    const pdm_block_iq4_xsx8_t *wb = w->data;
    const pdm_block_q8_K_t *x = act;
    for (int t = 0; t < n_tok; t++) {
        const pdm_block_q8_K_t *xt = x + (size_t)t * nb;
        for (int64_t r = r0; r < r1; r++) {
            const pdm_block_iq4_xsx8_t *g = wb + (r / PDM_X8_ROWS) * nb;
            const int rr = (int)(r % PDM_X8_ROWS);
            float acc = 0.0f;
            for (int64_t i = 0; i < nb; i++) {
                int32_t sumi = 0;
                for (int j = 0; j < 8; j++) {
                    int32_t s = 0;
                    for (int l = 0; l < 32; l++)
                        s += pdm__x8_iq4(&g[i], rr, 32 * j + l) * xt[i].qs[32 * j + l];
                    sumi += g[i].scales[j][rr] * s;
                }
                acc = fmaf(pdm_f16_to_f32(g[i].d[rr]) * xt[i].d, (float)sumi, acc);
            }
            y[(size_t)t * ldy + r] = acc;
        }
    }
}

/* The reference product on a repacked Q8_0 or Q5_0 matrix (Q8_0 activations): per output,
 * block by block, acc = fma(d_w * d_x, sum of w * x, acc). */
static void matmul_q8_0x8(const pdm_kern_mat_t *w, const void *act, int n_tok, float *y,
                          int64_t ldy, int64_t r0, int64_t r1)
{
    const int64_t nb = w->cols / PDM_QK;
    const int q5 = w->type == PDM_DT_Q5_0;
    const size_t gb = q5 ? sizeof(pdm_block_q5_0x8_t) : sizeof(pdm_block_q8_0x8_t);
    const pdm_block_q8_0_t *x = act;
    for (int t = 0; t < n_tok; t++) {
        const pdm_block_q8_0_t *xt = x + (size_t)t * nb;
        for (int64_t r = r0; r < r1; r++) {
            const char *g = (const char *)w->data + (size_t)(r / PDM_X8_ROWS) * (size_t)nb * gb;
            const int rr = (int)(r % PDM_X8_ROWS);
            float acc = 0.0f;
            for (int64_t i = 0; i < nb; i++) {
                const pdm_block_q8_0x8_t *b8 = (const pdm_block_q8_0x8_t *)g + i;
                const pdm_block_q5_0x8_t *b5 = (const pdm_block_q5_0x8_t *)g + i;
                int32_t sumi = 0;
                for (int e = 0; e < PDM_QK; e++)
                    sumi += (q5 ? pdm__x8_q5(b5, rr, e) - 16
                                : (int)b8->qs[e / 4][4 * rr + e % 4] - 128) * xt[i].qs[e];
                const uint16_t d = q5 ? b5->d[rr] : b8->d[rr];
                acc = fmaf(pdm_f16_to_f32(d) * pdm_f16_to_f32(xt[i].d), (float)sumi, acc);
            }
            y[(size_t)t * ldy + r] = acc;
        }
    }
}

/* The reference product on a repacked Q4_K (or Q5_K) matrix. Per output, super-block by super-block:
 *   sumi = sum_j scale_j * (q_j . x_j),  summ = sum_j min_j * (bsum_2j + bsum_2j+1)
 *   acc = fma(d * dx, sumi, acc);  acc = fma(-(dmin * dx), summ, acc)
 * Integer sums are exact, and every SIMD variant performs these two roundings per super-block
 * in this order, so all variants give the same bits. Against the file-layout kernels the
 * results differ in float summation order only. */
void pdm_kern__matmul_x8_generic(const pdm_kern_mat_t *w, const void *act, int n_tok, float *y,
                                 int64_t ldy, int64_t r0, int64_t r1)
{
    const int64_t nb = w->cols / PDM_QK_K;
    const pdm_block_q4_Kx8_t *wb = w->data;
    const pdm_block_q8_K_t *x = act;
    if (w->type == PDM_DT_Q6_K) {
        matmul_q6_Kx8(w, act, n_tok, y, ldy, r0, r1);
        return;
    }
    if (w->type == PDM_DT_Q8_0 || w->type == PDM_DT_Q5_0) {
        matmul_q8_0x8(w, act, n_tok, y, ldy, r0, r1);
        return;
    }
    if (w->type == PDM_DT_IQ4_XS) {
        matmul_iq4_xsx8(w, act, n_tok, y, ldy, r0, r1);
        return;
    }
    if (w->type == PDM_DT_Q4_1) {
        matmul_q4_1x8(w, act, n_tok, y, ldy, r0, r1);
        return;
    }
    const int q5 = w->type == PDM_DT_Q5_K; /* Q5_K: the same header, 5-bit values */
    const pdm_block_q5_Kx8_t *wb5 = w->data;
    for (int t = 0; t < n_tok; t++) {
        const pdm_block_q8_K_t *xt = x + (size_t)t * nb;
        for (int64_t r = r0; r < r1; r++) {
            const pdm_block_q4_Kx8_t *g = wb + (r / PDM_X8_ROWS) * nb;
            const pdm_block_q5_Kx8_t *g5 = wb5 + (r / PDM_X8_ROWS) * nb;
            const int rr = (int)(r % PDM_X8_ROWS);
            float acc = 0.0f;
            for (int64_t i = 0; i < nb; i++) {
                int32_t sumi = 0, summ = 0;
                for (int j = 0; j < 8; j++) {
                    int32_t s = 0;
                    for (int l = 0; l < 32; l++) {
                        const int e = 32 * j + l;
                        s += (q5 ? pdm__x8_q5k(&g5[i], rr, e) : pdm__x8_q(&g[i], rr, e)) * xt[i].qs[e];
                    }
                    sumi += (q5 ? g5[i].scales[j][rr] : g[i].scales[j][rr]) * s;
                    summ += (q5 ? g5[i].mins[j / 2][rr][j % 2] : g[i].mins[j / 2][rr][j % 2]) *
                            (xt[i].bsums[2 * j] + xt[i].bsums[2 * j + 1]);
                }
                const float dx = xt[i].d;
                const uint16_t hd = q5 ? g5[i].d[rr] : g[i].d[rr], hm = q5 ? g5[i].dmin[rr] : g[i].dmin[rr];
                acc = fmaf(pdm_f16_to_f32(hd) * dx, (float)sumi, acc);
                acc = fmaf(-(pdm_f16_to_f32(hm) * dx), (float)summ, acc);
            }
            y[(size_t)t * ldy + r] = acc;
        }
    }
}
