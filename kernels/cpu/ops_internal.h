/*
 * ops_internal.h - pieces shared by the CPU kernel variants (not part of the public API).
 */
#ifndef PDM_KERNELS_CPU_OPS_INTERNAL_H
#define PDM_KERNELS_CPU_OPS_INTERNAL_H

#include "../kernels.h"

/* Storage type the activations take for products with weights of `wtype`. */
pdm_dtype_t pdm_kern__act_type(pdm_dtype_t wtype);
size_t pdm_kern__act_bytes(pdm_dtype_t wtype, int64_t cols, int n_tok);
void pdm_kern__quantize_q8_1_row(const float *x, pdm_block_q8_1_t *b, int64_t n);
void pdm_kern__quantize_q8_0_row(const float *x, pdm_block_q8_0_t *b, int64_t n);
void pdm_kern__quantize_q8_K_row(const float *x, pdm_block_q8_K_t *b, int64_t n);

/* One super-block of a K-quant or IQ4_XS decoded to small integers:
 *   x[e] = (d * scale[e / sub_len]) * q[e] - dmin * min[e / sub_len]
 * (dmin and min are 0 for the types without a minimum). The scalar dequantization and the
 * reference dot products with Q8_K both read blocks through this, so they agree by
 * construction; the integer form is what llama.cpp's vec_dot functions sum. */
typedef struct {
    float d, dmin;             /* f16 super-block scales as f32 */
    int sub_len;               /* 16 or 32 elements per sub-block */
    int8_t q[PDM_QK_K];        /* signed quant values (offsets applied, IQ4 table looked up) */
    int16_t scale[16], min[16]; /* [256 / sub_len] integer sub-block scales and minimums */
} pdm_kern__kblock_t;

/* Decodes block `block` (of a type with 256-element blocks: Q2_K..Q6_K, IQ4_XS). */
void pdm_kern__kblock_unpack(pdm_dtype_t type, const void *block, pdm_kern__kblock_t *out);
/* 1 for the types pdm_kern__kblock_unpack decodes. */
int pdm_kern__is_kblock(pdm_dtype_t type);
/* Keys [*first, return value) of the view are the ones row `qpos` may see (causal mask and
 * sliding window); the range is empty when the return value <= *first. */
int pdm_kern__visible_range(const pdm_kern_attn_t *a, int32_t qpos, int *first);
void pdm_kern__rope_generic(float *x, int n_heads, int head_dim, int32_t pos, float theta);
void pdm_kern__rope_ext_generic(float *x, int n_heads, int head_dim, int32_t pos,
                                const pdm_kern_rope_t *r);
/* cs[i], sn[i] = cos and sin of pair i's rope_ext angle (head_dim / 2 <= 256 pairs), scalar
 * libm in the reference's order, so that every variant rotates by the same angles. */
void pdm_kern__rope_ext_table(int head_dim, int32_t pos, const pdm_kern_rope_t *r, float *cs,
                              float *sn);
void pdm_kern__attn_merge_generic(float *o1, float *lse1, const float *o2, float lse2, int n);
void pdm_kern__kv_store_generic(pdm_dtype_t type, const float *src, void *dst, int n);

/* The scalar reference product on a repacked (PDM_KERN_LAYOUT_X8) matrix (repack.c); every
 * ops table's matmul sends X8 matrices there unless it has its own kernel for them. */
void pdm_kern__matmul_x8_generic(const pdm_kern_mat_t *w, const void *act, int n_tok, float *y,
                                 int64_t ldy, int64_t r0, int64_t r1);

/* Variants compiled with per-ISA flags; their tables are only used after a CPUID check. */
extern const pdm_kern_ops_t pdm_kern_ops_avx2;
extern const pdm_kern_ops_t pdm_kern_ops_avx512;

#endif
