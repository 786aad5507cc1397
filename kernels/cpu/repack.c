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
    if (m->type != PDM_DT_Q4_K || m->layout != PDM_KERN_LAYOUT_ROWS || m->rows < 1 ||
        m->cols < PDM_QK_K || m->cols % PDM_QK_K)
        return 0;
    *nb = m->cols / PDM_QK_K;
    return (m->rows + PDM_X8_ROWS - 1) / PDM_X8_ROWS;
}

size_t pdm_kern_repack_bytes(const pdm_kern_mat_t *m)
{
    int64_t nb = 0, groups = pdm__x8_groups(m, &nb);
    return (size_t)groups * (size_t)nb * sizeof(pdm_block_q4_Kx8_t);
}

int pdm_kern_repack(const pdm_kern_mat_t *m, void *dst, pdm_kern_mat_t *out)
{
    int64_t nb = 0, groups = pdm__x8_groups(m, &nb);
    if (!groups) return -1;
    pdm_block_q4_Kx8_t *o = dst;
    for (int64_t g = 0; g < groups; g++) {
        for (int64_t i = 0; i < nb; i++, o++) {
            memset(o, 0, sizeof(*o)); /* rows past the end stay zero: d = 0 gives 0 */
            for (int r = 0; r < PDM_X8_ROWS; r++) {
                const int64_t row = g * PDM_X8_ROWS + r;
                if (row >= m->rows) break;
                const pdm_block_q4_K_t *b =
                    (const pdm_block_q4_K_t *)((const char *)m->data + (size_t)row * m->row_bytes) + i;
                o->d[r] = b->d;
                o->dmin[r] = b->dmin;
                for (int j = 0; j < 8; j++) {
                    int scale, min;
                    pdm_ql_scale_min_k4(b->scales, j, &scale, &min);
                    o->scales[j][r] = (uint8_t)scale;
                    o->mins[j / 2][r][j % 2] = (uint8_t)min;
                }
                for (int p = 0; p < 4; p++)
                    for (int k = 0; k < 8; k++)
                        memcpy(&o->qs[p][k][4 * r], b->qs + 32 * p + 4 * k, 4);
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

void pdm_kern_mat_dequantize_row(const pdm_kern_mat_t *m, int64_t r, float *dst)
{
    if (m->layout == PDM_KERN_LAYOUT_ROWS) {
        pdm_dequantize_row(m->type, (const char *)m->data + (size_t)r * m->row_bytes, dst,
                           m->cols);
        return;
    }
    /* X8 (Q4_K): the arithmetic of pdm_dequantize_row's K-quant path, value for value */
    const int64_t nb = m->cols / PDM_QK_K;
    const pdm_block_q4_Kx8_t *g = (const pdm_block_q4_Kx8_t *)m->data + (r / PDM_X8_ROWS) * nb;
    const int rr = (int)(r % PDM_X8_ROWS);
    for (int64_t i = 0; i < nb; i++) {
        const float d = pdm_f16_to_f32(g[i].d[rr]), dmin = pdm_f16_to_f32(g[i].dmin[rr]);
        for (int j = 0; j < 8; j++) {
            const float dl = d * (float)g[i].scales[j][rr];
            const float ml = dmin * (float)g[i].mins[j / 2][rr][j % 2];
            for (int l = 0; l < 32; l++)
                dst[i * PDM_QK_K + 32 * j + l] = dl * (float)pdm__x8_q(&g[i], rr, 32 * j + l) - ml;
        }
    }
}

/* The reference product on a repacked Q4_K matrix. Per output, super-block by super-block:
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
    for (int t = 0; t < n_tok; t++) {
        const pdm_block_q8_K_t *xt = x + (size_t)t * nb;
        for (int64_t r = r0; r < r1; r++) {
            const pdm_block_q4_Kx8_t *g = wb + (r / PDM_X8_ROWS) * nb;
            const int rr = (int)(r % PDM_X8_ROWS);
            float acc = 0.0f;
            for (int64_t i = 0; i < nb; i++) {
                int32_t sumi = 0, summ = 0;
                for (int j = 0; j < 8; j++) {
                    int32_t s = 0;
                    for (int l = 0; l < 32; l++)
                        s += pdm__x8_q(&g[i], rr, 32 * j + l) * xt[i].qs[32 * j + l];
                    sumi += g[i].scales[j][rr] * s;
                    summ += g[i].mins[j / 2][rr][j % 2] * (xt[i].bsums[2 * j] + xt[i].bsums[2 * j + 1]);
                }
                const float dx = xt[i].d;
                acc = fmaf(pdm_f16_to_f32(g[i].d[rr]) * dx, (float)sumi, acc);
                acc = fmaf(-(pdm_f16_to_f32(g[i].dmin[rr]) * dx), (float)summ, acc);
            }
            y[(size_t)t * ldy + r] = acc;
        }
    }
}
