/*
 * quantize.c - converts the 2-D weight matrices of an F32/F16/BF16 GGUF file to a quantized
 * type (or to a "q4_k_m"-like mix), keeping every metadata pair and every other tensor.
 *
 * Rules: tensors with one row or one dimension (norms, biases) are written as F32; a matrix
 * whose row length is not a multiple of the target's block size falls back to Q8_0 (rows of
 * 32) or F16, as llama.cpp's quantizer falls back, and the fallback is logged. Quantization
 * uses the reference quantizers of kernels/ (pdm_quantize_row).
 */
#include "model.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* llama.cpp's LLAMA_FTYPE_* numbers (llama.h) written as general.file_type. */
static uint32_t pdm__ftype(pdm_dtype_t type, int mix)
{
    if (mix) return 15; /* MOSTLY_Q4_K_M */
    switch (type) {
    case PDM_DT_F32: return 0;
    case PDM_DT_F16: return 1;
    case PDM_DT_Q4_0: return 2;
    case PDM_DT_Q4_1: return 3;
    case PDM_DT_Q8_0: return 7;
    case PDM_DT_Q5_0: return 8;
    case PDM_DT_Q5_1: return 9;
    case PDM_DT_Q2_K: return 10;
    case PDM_DT_Q3_K: return 11; /* Q3_K_S: every matrix Q3_K */
    case PDM_DT_Q4_K: return 14; /* Q4_K_S */
    case PDM_DT_Q5_K: return 16; /* Q5_K_S */
    case PDM_DT_Q6_K: return 18;
    case PDM_DT_IQ4_NL: return 25;
    case PDM_DT_IQ4_XS: return 30;
    case PDM_DT_BF16: return 32;
    default: return 0;
    }
}

static int pdm__name_has(pdm_gguf_str_t name, const char *part)
{
    size_t n = strlen(part);
    for (uint64_t i = 0; i + n <= name.len; i++)
        if (!memcmp(name.ptr + i, part, n)) return 1;
    return 0;
}

/* The type a matrix named `name` gets: `type`, or with `mix` Q6_K for attn_v, ffn_down and the
 * embeddings and output, Q4_K for the rest; then the block-size fallback. */
static pdm_dtype_t pdm__target(pdm_gguf_str_t name, int64_t cols, pdm_dtype_t type, int mix)
{
    pdm_dtype_t t = type;
    if (mix)
        t = pdm__name_has(name, ".attn_v.") || pdm__name_has(name, ".ffn_down.") ||
                    pdm_gguf_str_eq(name, "token_embd.weight") ||
                    pdm_gguf_str_eq(name, "output.weight")
                ? PDM_DT_Q6_K
                : PDM_DT_Q4_K;
    if (cols % pdm_dtype_block_elems(t) == 0) return t;
    pdm_dtype_t fb = cols % PDM_QK == 0 ? PDM_DT_Q8_0 : PDM_DT_F16;
    pdm_log_info("quantize: %.*s: %lld columns are not a multiple of the %s block size; "
                 "using %s", (int)name.len, name.ptr, (long long)cols, pdm_dtype_name(t),
                 pdm_dtype_name(fb));
    return fb;
}

/* Converts tensor `t` (F32/F16/BF16) to `type`, row by row; the result is added to `w`. */
static int pdm__convert_tensor(pdm_gguf_writer_t *w, const pdm_gguf_tensor_t *t, pdm_dtype_t type,
                               const char *name)
{
    const int64_t cols = t->ne[0], rows = t->ne[1] * t->ne[2] * t->ne[3];
    const size_t in_rb = pdm_dtype_row_bytes(t->type, cols);
    const size_t out_rb = pdm_dtype_row_bytes(type, cols);
    float *row = malloc((size_t)cols * sizeof(float));
    char *out = malloc(out_rb * (size_t)rows);
    int rc;
    if (!row || !out) {
        rc = pdm_error_set(PDM_ENOMEM, "quantize: out of memory for '%s'", name);
        goto out;
    }
    for (int64_t r = 0; r < rows; r++) {
        pdm_dequantize_row(t->type, (const char *)t->data + (size_t)r * in_rb, row, cols);
        pdm_quantize_row(type, row, out + (size_t)r * out_rb, cols);
    }
    rc = pdm_gguf_writer_add_tensor(w, name, type, t->n_dims, t->ne, out);
out:
    free(row);
    free(out);
    return rc;
}

int pdm_model_quantize_file(const char *in_path, const char *out_path, const char *scheme)
{
    const int mix = !strcasecmp(scheme, "q4_k_m");
    const int type = mix ? PDM_DT_Q4_K : pdm_dtype_from_name(scheme);
    if (type < 0 || !pdm_dtype_is_weight((pdm_dtype_t)type))
        return pdm_error_set(PDM_EINVAL, "quantize: unknown type '%s' (use one of %s, or "
                             "q4_k_m)", scheme, pdm_dtype_weight_list());
    pdm_gguf_t *g;
    int rc = pdm_gguf_open(in_path, &g);
    if (rc) return rc;
    pdm_gguf_writer_t *w = pdm_gguf_writer_create();
    if (!w) {
        rc = pdm_error_set(PDM_ENOMEM, "quantize: out of memory");
        goto err_gguf;
    }
    for (uint64_t i = 0; i < pdm_gguf_n_kv(g); i++)
        if ((rc = pdm_gguf_writer_copy_kv(w, pdm_gguf_kv_at(g, i)))) goto err_writer;
    if ((rc = pdm_gguf_writer_set_u32(w, "general.file_type", pdm__ftype(type, mix))))
        goto err_writer;
    for (uint64_t i = 0; i < pdm_gguf_n_tensors(g); i++) {
        const pdm_gguf_tensor_t *t = pdm_gguf_tensor_at(g, i);
        char name[256];
        snprintf(name, sizeof(name), "%.*s", (int)PDM_MIN(t->name.len, 255), t->name.ptr);
        if (t->type != PDM_DT_F32 && t->type != PDM_DT_F16 && t->type != PDM_DT_BF16) {
            rc = pdm_error_set(PDM_EUNSUPPORTED, "%s: tensor '%s' is already %s; quantize "
                               "converts f32, f16 and bf16 files", in_path, name,
                               pdm_dtype_name(t->type));
            goto err_writer;
        }
        const int matrix = t->n_dims >= 2 && t->ne[1] > 1;
        pdm_dtype_t to = matrix ? pdm__target(t->name, t->ne[0], (pdm_dtype_t)type, mix)
                                : PDM_DT_F32;
        if ((rc = pdm__convert_tensor(w, t, to, name))) goto err_writer;
    }
    rc = pdm_gguf_writer_write(w, out_path);

err_writer:
    pdm_gguf_writer_destroy(w);
err_gguf:
    pdm_gguf_close(g);
    return rc;
}
