/*
 * test_kernels.c - every kernel variant against the scalar reference, and the reference
 * against independent naive formulas, on random inputs of awkward sizes.
 *
 * Tolerances (stated per op):
 *   quantize -> dequantize, every type    relative RMS error below a measured bound per type
 *                                         (QUANT_RMS_BOUNDS; uniform data in [-1, 1))
 *   matmul (same converted activations)  |y - y_ref| <= 1e-4 * sum|w||x| + 1e-5
 *   matmul reference vs exact f64 product of the dequantized weights and the f32
 *   activations                           sum|w| |x - x_act| + 5e-3 sum|w||x| + 1e-5, where
 *                                         x_act are the 8-bit activations as decoded: only
 *                                         activation rounding separates them (the 5e-3 covers
 *                                         Q8_1's f16-rounded block sums and f32 accumulation)
 *   activation quantization              quants within 1 step, scales equal; Q8_K (the
 *                                         K-quants' activations) byte for byte
 *   attention vs double-precision naive   1e-4 absolute on o and lse (f32 KV), 2e-3 (f16 KV),
 *                                         5e-4 (q8 KV: int8 x per-head scale, saturating);
 *                                         q8 SIMD vs the reference on the same bytes 1e-5;
 *                                         sizes 1, 7, 63, 64, 65, 1000 keys, fully masked rows,
 *                                         GQA ratios 1, 3, 8 (the SIMD exp: < 2e-7 relative)
 *   rmsnorm, swiglu, rope                 1e-5 relative
 *   rope_ext, rope vs the reference       1e-6 (|a| + |b|) per pair (same angle table; the
 *                                         rotation only), pair counts 1 .. 256, odd ones too
 * The CUDA variant runs the same checks when the build has CUDA and a device is present, and
 * prints why it is skipped otherwise.
 */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <string.h>

#include "common/pdm.h"
#include "kernels/cpu/quant_layout.h"
#include "kernels/kernels.h"
#include "tests.h"

static uint64_t rng_state = 12345;

static float frand(void)
{
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(rng_state >> 11) * 0x1.0p-53 * 2.0 - 1.0);
}

static void fill(float *x, size_t n, float scale)
{
    for (size_t i = 0; i < n; i++) x[i] = frand() * scale;
}

/* ---- data types ---------------------------------------------------------------------- */

START_TEST(test_f16_roundtrip_exhaustive)
{
    for (uint32_t h = 0; h < 65536; h++) {
        uint16_t v = (uint16_t)h;
        int is_nan = (v & 0x7c00) == 0x7c00 && (v & 0x3ff);
        float f = pdm_f16_to_f32(v);
        if (is_nan) {
            ck_assert(isnan(f));
            continue;
        }
        ck_assert_msg(pdm_f32_to_f16(f) == v, "f16 0x%04x -> %g -> 0x%04x", v, f,
                      pdm_f32_to_f16(f));
    }
    /* rounding to nearest even between two halves, overflow to inf */
    ck_assert_uint_eq(pdm_f32_to_f16(1.0f + 0x1p-11f), 0x3c00);
    ck_assert_uint_eq(pdm_f32_to_f16(1.0f + 0x1p-11f + 0x1p-20f), 0x3c01);
    ck_assert_uint_eq(pdm_f32_to_f16(70000.0f), 0x7c00);
    ck_assert_uint_eq(pdm_f32_to_f16(-1e-10f), 0x8000);
}
END_TEST

START_TEST(test_quant_roundtrip_error)
{
    static const pdm_dtype_t types[] = {PDM_DT_F16, PDM_DT_BF16, PDM_DT_Q8_0, PDM_DT_Q4_0,
                                        PDM_DT_Q4_1, PDM_DT_Q8_1};
    /* max error relative to the block's absolute maximum */
    static const float tol[] = {1e-3f, 8e-3f, 1.0f / 127 * 0.51f + 1e-3f, 1.0f / 8 + 1e-3f, /* the side opposite the max clips at 7 */
                               
                                2.0f / 15 * 0.51f + 1e-3f, 1.0f / 127 * 0.51f + 1e-3f};
    const int n = 32 * 37;
    float *x = malloc(n * sizeof(float)), *y = malloc(n * sizeof(float));
    void *q = malloc(pdm_dtype_row_bytes(PDM_DT_F32, n));
    fill(x, n, 3.0f);
    for (size_t t = 0; t < PDM_ARRAY_SIZE(types); t++) {
        pdm_quantize_row(types[t], x, q, n);
        pdm_dequantize_row(types[t], q, y, n);
        for (int b = 0; b < n / 32; b++) {
            float amax = 0;
            for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[b * 32 + j]));
            for (int j = 0; j < 32; j++)
                ck_assert_msg(fabsf(x[b * 32 + j] - y[b * 32 + j]) <= tol[t] * amax,
                              "%s: x=%g y=%g amax=%g", pdm_dtype_name(types[t]), x[b * 32 + j],
                              y[b * 32 + j], amax);
        }
    }
    ck_assert_uint_eq(pdm_dtype_row_bytes(PDM_DT_Q4_1, 33), 0);
    ck_assert_uint_eq(pdm_dtype_row_bytes(PDM_DT_Q4_1, 64), 40);
    ck_assert(!pdm_dtype_valid(4));
    ck_assert(!pdm_dtype_valid(999));
    free(x);
    free(y);
    free(q);
}
END_TEST

/* Relative RMS error of quantize -> dequantize on uniform data in [-1, 1), 64 K elements.
 * Measured with the reference quantizers: q8_0 0.38 %, q6_k 1.30 %, q5_k 2.66 %, q5_1 2.94 %,
 * q5_0 3.13 %, q4_k 5.42 %, q4_1 6.07 %, iq4_nl 6.23 %, iq4_xs 6.29 %, q4_0 6.53 %, q3_k
 * 11.8 %, q2_k 21.9 % (uniform data is the hard case for few levels: plain rounding to 16
 * levels over a sub-block's range would give ~6.3 %); the bounds leave ~10 % headroom. */
static const struct {
    pdm_dtype_t type;
    double bound;
} QUANT_RMS_BOUNDS[] = {
    {PDM_DT_Q8_0, 0.0042}, {PDM_DT_Q6_K, 0.0145}, {PDM_DT_Q5_K, 0.03},  {PDM_DT_Q5_1, 0.033},
    {PDM_DT_Q5_0, 0.035},  {PDM_DT_Q4_K, 0.06},   {PDM_DT_Q4_1, 0.067}, {PDM_DT_IQ4_NL, 0.069},
    {PDM_DT_IQ4_XS, 0.069}, {PDM_DT_Q4_0, 0.072}, {PDM_DT_Q3_K, 0.13},  {PDM_DT_Q2_K, 0.242},
};

START_TEST(test_quant_rms_error)
{
    const int n = 256 * 256;
    float *x = malloc(n * sizeof(float)), *y = malloc(n * sizeof(float));
    void *q = malloc(pdm_dtype_row_bytes(PDM_DT_F32, n));
    fill(x, n, 1.0f);
    for (size_t t = 0; t < PDM_ARRAY_SIZE(QUANT_RMS_BOUNDS); t++) {
        pdm_dtype_t type = QUANT_RMS_BOUNDS[t].type;
        pdm_quantize_row(type, x, q, n);
        pdm_dequantize_row(type, q, y, n);
        double err = 0, ref = 0;
        for (int i = 0; i < n; i++) {
            err += (double)(x[i] - y[i]) * (x[i] - y[i]);
            ref += (double)x[i] * x[i];
        }
        double rel = sqrt(err / ref);
        printf("kernels: %-6s quantize round trip: relative RMS error %.3f %%\n",
               pdm_dtype_name(type), 100 * rel);
        ck_assert_msg(rel < QUANT_RMS_BOUNDS[t].bound, "%s: relative RMS error %g >= %g",
                      pdm_dtype_name(type), rel, QUANT_RMS_BOUNDS[t].bound);
    }
    /* all-zero and constant blocks stay exact (no NaN from 0 / 0 scales) */
    for (int i = 0; i < 512; i++) x[i] = i < 256 ? 0.0f : 0.5f;
    for (size_t t = 0; t < PDM_ARRAY_SIZE(QUANT_RMS_BOUNDS); t++) {
        pdm_dtype_t type = QUANT_RMS_BOUNDS[t].type;
        pdm_quantize_row(type, x, q, 512);
        pdm_dequantize_row(type, q, y, 512);
        for (int i = 0; i < 512; i++)
            ck_assert_msg(fabsf(y[i] - x[i]) <= 0.01f, "%s: constant block [%d] %g -> %g",
                          pdm_dtype_name(type), i, x[i], y[i]);
    }
    free(x);
    free(y);
    free(q);
}
END_TEST

/* The traits of the new types: GGUF ids, names, block sizes as GGUF stores them. */
START_TEST(test_dtype_traits)
{
    static const struct {
        int id;
        const char *name;
        int elems;
        size_t bytes;
    } want[] = {{6, "q5_0", 32, 22},    {7, "q5_1", 32, 24},     {10, "q2_k", 256, 84},
                {11, "q3_k", 256, 110}, {12, "q4_k", 256, 144},  {13, "q5_k", 256, 176},
                {14, "q6_k", 256, 210}, {15, "q8_k", 256, 292},  {20, "iq4_nl", 32, 18},
                {23, "iq4_xs", 256, 136}};
    for (size_t i = 0; i < PDM_ARRAY_SIZE(want); i++) {
        ck_assert(pdm_dtype_valid((uint32_t)want[i].id));
        ck_assert_str_eq(pdm_dtype_name(want[i].id), want[i].name);
        ck_assert_int_eq(pdm_dtype_block_elems(want[i].id), want[i].elems);
        ck_assert_uint_eq(pdm_dtype_block_bytes(want[i].id), want[i].bytes);
        ck_assert_int_eq(pdm_dtype_from_name(want[i].name), want[i].id);
    }
    for (int i = 0; i < 16; i++) ck_assert_int_eq(pdm_ql_iq4(i), pdm_kvalues_iq4nl[i]);
    ck_assert(!pdm_dtype_is_weight(PDM_DT_Q8_K));
    ck_assert(!pdm_dtype_is_weight(PDM_DT_Q8_1));
    ck_assert(!pdm_dtype_is_weight(PDM_DT_I8));
    ck_assert_uint_eq(pdm_dtype_row_bytes(PDM_DT_Q4_K, 128), 0);
    ck_assert_uint_eq(pdm_dtype_row_bytes(PDM_DT_Q4_K, 512), 288);
    ck_assert_int_eq(pdm_dtype_from_name("Q4_K"), PDM_DT_Q4_K);
    ck_assert_int_eq(pdm_dtype_from_name("q4_k_m"), -1);
    /* the list in messages names exactly the weight types */
    char names[512] = "";
    for (int t = 0; t < PDM_DT_COUNT_; t++)
        if (pdm_dtype_is_weight(t)) {
            ck_assert_msg(strstr(pdm_dtype_weight_list(), pdm_dtype_name(t)), "%s missing",
                          pdm_dtype_name(t));
            strcat(names, pdm_dtype_name(t));
        }
    size_t listed = 0;
    for (const char *p = pdm_dtype_weight_list(); *p; p++) listed += *p != ',' && *p != ' ';
    ck_assert_uint_eq(listed, strlen(names));
}
END_TEST

/* ---- matmul -------------------------------------------------------------------------- */

/* The activation type llama.cpp pairs with weights of `wtype` (ggml-cpu vec_dot_type). */
static pdm_dtype_t act_type_of(pdm_dtype_t wtype)
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
    default:
        return PDM_DT_Q8_K;
    }
}

/* Where the int8 quants sit in an activation block of the type paired with `wtype`. */
static void act_layout(pdm_dtype_t wtype, size_t *blk, size_t *q0, size_t *nq)
{
    switch (act_type_of(wtype)) {
    case PDM_DT_Q8_1:
        *blk = sizeof(pdm_block_q8_1_t), *q0 = offsetof(pdm_block_q8_1_t, qs), *nq = 32;
        break;
    case PDM_DT_Q8_0:
        *blk = sizeof(pdm_block_q8_0_t), *q0 = offsetof(pdm_block_q8_0_t, qs), *nq = 32;
        break;
    default:
        *blk = sizeof(pdm_block_q8_K_t), *q0 = offsetof(pdm_block_q8_K_t, qs), *nq = 256;
        break;
    }
}

static void check_matmul(const pdm_kern_ops_t *ops, pdm_dtype_t wtype, int rows, int cols,
                         int n_tok)
{
    const pdm_kern_ops_t *ref = &pdm_kern_ops_generic;
    size_t rb = pdm_dtype_row_bytes(wtype, cols);
    float *wf = malloc((size_t)rows * cols * sizeof(float));
    char *w = malloc(rb * rows);
    float *x = malloc((size_t)n_tok * cols * sizeof(float));
    float *wd = malloc((size_t)rows * cols * sizeof(float));
    float *y = malloc((size_t)n_tok * rows * sizeof(float));
    float *yr = malloc((size_t)n_tok * rows * sizeof(float));
    float *xa = malloc((size_t)n_tok * cols * sizeof(float));
    size_t ab = ref->act_bytes(wtype, cols, n_tok);
    void *act = ab ? malloc(ab) : NULL, *act2 = ab ? malloc(ab) : NULL;
    fill(wf, (size_t)rows * cols, 1.0f);
    fill(x, (size_t)n_tok * cols, 2.0f);
    for (int r = 0; r < rows; r++) {
        pdm_quantize_row(wtype, wf + (size_t)r * cols, w + (size_t)r * rb, cols);
        pdm_dequantize_row(wtype, w + (size_t)r * rb, wd + (size_t)r * cols, cols);
    }
    pdm_kern_mat_t m = {.data = w, .type = wtype, .rows = rows, .cols = cols, .row_bytes = rb};
    if (ab) {
        ref->act_convert(wtype, x, cols, 0, n_tok, act);
        /* the variant's own conversion: quants within one step of the reference */
        ops->act_convert(wtype, x, cols, 0, n_tok, act2);
        size_t blk, q0, nq; /* block bytes, offset and count of the int8 quants in a block */
        act_layout(wtype, &blk, &q0, &nq);
        const int8_t *qa = act, *qb = act2;
        for (size_t i = 0; i < ab; i++) {
            if (i % blk < q0 || i % blk >= q0 + nq) continue;
            ck_assert_msg(abs(qa[i] - qb[i]) <= 1, "%s act quant differs at %zu", ops->name, i);
        }
        /* Q8_K is an exact recipe (llama.cpp's quantize_row_q8_K_ref): every variant's
         * blocks, scale and bsums included, equal the reference's byte for byte */
        if (act_type_of(wtype) == PDM_DT_Q8_K)
            ck_assert_msg(!memcmp(act, act2, ab), "%s Q8_K activations differ from the reference",
                          ops->name);
        /* the activations as the products see them */
        size_t arb = ab / (size_t)n_tok;
        pdm_dtype_t at = act_type_of(wtype);
        for (int t = 0; t < n_tok; t++)
            pdm_dequantize_row(at, (char *)act + (size_t)t * arb, xa + (size_t)t * cols, cols);
    } else {
        memcpy(xa, x, (size_t)n_tok * cols * sizeof(float));
    }
    const void *a = ab ? act : (const void *)x;
    ref->matmul(&m, a, n_tok, yr, rows, 0, rows);
    /* split the rows in two calls to test partial ranges */
    ops->matmul(&m, a, n_tok, y, rows, 0, rows / 3);
    ops->matmul(&m, a, n_tok, y, rows, rows / 3, rows);
    for (int t = 0; t < n_tok; t++)
        for (int r = 0; r < rows; r++) {
            double mag = 0.0, exact = 0.0, act_err = 0.0;
            for (int c = 0; c < cols; c++) {
                const float wv = wd[(size_t)r * cols + c], xv = x[(size_t)t * cols + c];
                mag += fabs(wv * xv);
                exact += (double)wv * xv;
                act_err += fabs(wv) * fabs(xv - xa[(size_t)t * cols + c]);
            }
            float got = y[(size_t)t * rows + r], want = yr[(size_t)t * rows + r];
            ck_assert_msg(fabs(got - want) <= 1e-4 * mag + 1e-5,
                          "%s %s rows %d cols %d tok %d: [%d][%d] %g vs ref %g", ops->name,
                          pdm_dtype_name(wtype), rows, cols, n_tok, t, r, got, want);
            /* the reference against the exact product of the dequantized weights: only the
             * 8-bit activation rounding separates them, and it is known element by element */
            double atol = ab ? act_err + 5e-3 * mag + 1e-5 : 1e-5 * mag + 1e-5;
            ck_assert_msg(fabs(want - exact) <= atol, "reference %s: %g vs exact %g (tol %g)",
                          pdm_dtype_name(wtype), want, exact, atol);
        }
    free(wf);
    free(w);
    free(x);
    free(xa);
    free(wd);
    free(y);
    free(yr);
    free(act);
    free(act2);
}

START_TEST(test_matmul_variants)
{
    static const pdm_dtype_t types[] = {PDM_DT_Q4_1, PDM_DT_Q4_0, PDM_DT_Q8_0,  PDM_DT_F16,
                                        PDM_DT_F32,  PDM_DT_BF16, PDM_DT_Q5_0, PDM_DT_Q5_1,
                                        PDM_DT_IQ4_NL};
    static const int toks[] = {1, 2, 3, 4, 5, 7, 9, 12};
    static const int shapes[][2] = {{1, 32}, {7, 64}, {63, 96}, {64, 576}, {65, 160}, {1000, 64}};
    const pdm_kern_ops_t *const *list = pdm_kern_ops_list();
    for (int v = 0; list[v]; v++)
        for (size_t t = 0; t < PDM_ARRAY_SIZE(types); t++)
            for (size_t s = 0; s < PDM_ARRAY_SIZE(shapes); s++)
                for (size_t k = 0; k < PDM_ARRAY_SIZE(toks); k++)
                    check_matmul(list[v], types[t], shapes[s][0], shapes[s][1], toks[k]);
    /* odd float widths (not multiples of the SIMD width) for unquantized weights */
    for (int v = 0; list[v]; v++) {
        check_matmul(list[v], PDM_DT_F32, 5, 1000, 3);
        check_matmul(list[v], PDM_DT_F16, 3, 13, 2);
    }
}
END_TEST

/* The 256-element types (K-quants, IQ4_XS; Q8_K activations) on every variant. */
START_TEST(test_matmul_kquants)
{
    static const pdm_dtype_t types[] = {PDM_DT_Q2_K, PDM_DT_Q3_K, PDM_DT_Q4_K,
                                        PDM_DT_Q5_K, PDM_DT_Q6_K, PDM_DT_IQ4_XS};
    /* token counts: decode, 4-token tiles with and without tails; rows: odd, even, not
     * multiples of the 2- and 4-row tiles (and split at rows / 3 by check_matmul) */
    static const int toks[] = {1, 3, 4, 5, 8, 11};
    static const int shapes[][2] = {{1, 256}, {2, 1024}, {7, 512}, {33, 768}, {65, 256}};
    const pdm_kern_ops_t *const *list = pdm_kern_ops_list();
    for (int v = 0; list[v]; v++)
        for (size_t t = 0; t < PDM_ARRAY_SIZE(types); t++)
            for (size_t s = 0; s < PDM_ARRAY_SIZE(shapes); s++)
                for (size_t k = 0; k < PDM_ARRAY_SIZE(toks); k++)
                    check_matmul(list[v], types[t], shapes[s][0], shapes[s][1], toks[k]);
}
END_TEST

/* Q8_K activation quantization on the cases random data rarely hits: an all-zero block, the
 * largest magnitude twice with both signs (the first fixes the scale's sign), exact ties of
 * the rounding, +128 after scaling (clipped to 127), tiny and huge scales. Every variant
 * must equal the reference byte for byte. */
/* Repacked Q4_K, Q5_K, Q6_K, IQ4_XS, Q8_0, Q5_0 and Q4_1 (PDM_KERN_LAYOUT_X8) on odd shapes: rows that do not fill a group of 8,
 * row ranges cut inside groups, token counts around the 4-token tile. Every variant on the
 * repacked matrix equals the repacked reference bit for bit; the repacked reference matches
 * the file-layout reference to float summation order; dequantized rows are identical. */
static void check_repack(pdm_dtype_t wtype, int rows, int cols, int n_tok)
{
    const pdm_kern_ops_t *ref = &pdm_kern_ops_generic;
    size_t rb = pdm_dtype_row_bytes(wtype, cols);
    float *wf = malloc((size_t)rows * cols * sizeof(float));
    char *w = malloc(rb * rows);
    float *x = malloc((size_t)n_tok * cols * sizeof(float));
    float *y = malloc((size_t)n_tok * rows * sizeof(float));
    float *yr = malloc((size_t)n_tok * rows * sizeof(float));
    float *yf = malloc((size_t)n_tok * rows * sizeof(float));
    float *d0 = malloc((size_t)cols * sizeof(float)), *d1 = malloc((size_t)cols * sizeof(float));
    void *act = malloc(ref->act_bytes(wtype, cols, n_tok));
    fill(wf, (size_t)rows * cols, 1.0f);
    fill(x, (size_t)n_tok * cols, 2.0f);
    for (int r = 0; r < rows; r++)
        pdm_quantize_row(wtype, wf + (size_t)r * cols, w + (size_t)r * rb, cols);
    pdm_kern_mat_t m = {.data = w, .type = wtype, .rows = rows, .cols = cols, .row_bytes = rb};
    size_t pb = pdm_kern_repack_bytes(&m);
    const size_t gb = wtype == PDM_DT_Q4_K   ? sizeof(pdm_block_q4_Kx8_t)
                      : wtype == PDM_DT_Q5_K ? sizeof(pdm_block_q5_Kx8_t)
                      : wtype == PDM_DT_IQ4_XS ? sizeof(pdm_block_iq4_xsx8_t)
                      : wtype == PDM_DT_Q4_1 ? sizeof(pdm_block_q4_1x8_t)
                      : wtype == PDM_DT_Q6_K ? sizeof(pdm_block_q6_Kx8_t)
                      : wtype == PDM_DT_Q5_0 ? sizeof(pdm_block_q5_0x8_t)
                                             : sizeof(pdm_block_q8_0x8_t);
    ck_assert_uint_eq(pb, (size_t)(rows + 7) / 8 * (size_t)(cols / pdm_dtype_block_elems(wtype)) * gb);
    void *packed = aligned_alloc(64, (pb + 63) / 64 * 64);
    pdm_kern_mat_t mp;
    ck_assert_int_eq(pdm_kern_repack(&m, packed, &mp), 0);
    ck_assert_int_eq(mp.layout, PDM_KERN_LAYOUT_X8);
    ck_assert_uint_eq(pdm_kern_repack_bytes(&mp), 0); /* repacked once only */
    for (int r = 0; r < rows; r++) {
        pdm_kern_mat_dequantize_row(&m, r, d0);
        pdm_kern_mat_dequantize_row(&mp, r, d1);
        ck_assert_msg(!memcmp(d0, d1, (size_t)cols * sizeof(float)), "row %d dequantizes differently", r);
    }
    ref->act_convert(wtype, x, cols, 0, n_tok, act);
    ref->matmul(&m, act, n_tok, yf, rows, 0, rows);
    ref->matmul(&mp, act, n_tok, yr, rows, 0, rows);
    for (int i = 0; i < n_tok * rows; i++) {
        double mag = 0.0; /* |w| . |x| bounds the summation-order difference */
        for (int c = 0; c < cols; c++)
            mag += fabs(wf[(size_t)(i % rows) * cols + c] * x[(size_t)(i / rows) * cols + c]);
        ck_assert_msg(fabs(yr[i] - yf[i]) <= 1e-5 * mag + 1e-6, "repacked ref %g vs file %g", yr[i], yf[i]);
    }
    const pdm_kern_ops_t *const *list = pdm_kern_ops_list();
    for (int v = 0; list[v]; v++) {
        for (int i = 0; i < n_tok * rows; i++) y[i] = NAN;
        const int cut = rows / 3; /* two calls, the cut usually inside a group */
        list[v]->matmul(&mp, act, n_tok, y, rows, 0, cut);
        list[v]->matmul(&mp, act, n_tok, y, rows, cut, rows);
        ck_assert_msg(!memcmp(y, yr, (size_t)n_tok * rows * sizeof(float)),
                      "%s repacked %s rows %d cols %d tok %d differs from the reference",
                      list[v]->name, pdm_dtype_name(wtype), rows, cols, n_tok);
    }
    free(packed);
    free(act);
    free(d0);
    free(d1);
    free(wf);
    free(w);
    free(x);
    free(y);
    free(yr);
    free(yf);
}

START_TEST(test_repack_kquants)
{
    static const pdm_dtype_t types[] = {PDM_DT_Q4_K, PDM_DT_Q5_K, PDM_DT_Q6_K, PDM_DT_IQ4_XS,
                                        PDM_DT_Q8_0, PDM_DT_Q5_0, PDM_DT_Q4_1};
    static const int toks[] = {1, 2, 3, 4, 5, 8, 9};
    static const int shapes[][2] = {{1, 256}, {7, 512}, {8, 256}, {13, 768}, {64, 256}, {67, 1280}};
    for (size_t s = 0; s < PDM_ARRAY_SIZE(shapes); s++)
        for (size_t k = 0; k < PDM_ARRAY_SIZE(toks); k++)
            for (size_t t = 0; t < PDM_ARRAY_SIZE(types); t++)
                check_repack(types[t], shapes[s][0], shapes[s][1], toks[k]);
    for (size_t k = 0; k < PDM_ARRAY_SIZE(toks); k++) { /* rows of 1 and 3 blocks */
        check_repack(PDM_DT_Q8_0, 5, 32, toks[k]);
        check_repack(PDM_DT_Q8_0, 19, 96, toks[k]);
        check_repack(PDM_DT_Q5_0, 5, 32, toks[k]);
        check_repack(PDM_DT_Q5_0, 19, 96, toks[k]);
        check_repack(PDM_DT_Q4_1, 5, 32, toks[k]);
        check_repack(PDM_DT_Q4_1, 19, 96, toks[k]);
    }
    /* types without a repacked layout are left alone */
    pdm_kern_mat_t q5 = {.type = PDM_DT_Q3_K, .rows = 8, .cols = 256, .row_bytes = 110};
    ck_assert_uint_eq(pdm_kern_repack_bytes(&q5), 0);
    pdm_kern_mat_t out;
    ck_assert_int_eq(pdm_kern_repack(&q5, NULL, &out), -1);
}
END_TEST

START_TEST(test_q8_K_activations)
{
    enum { N = 6 * PDM_QK_K };
    static float x[N];
    fill(x, N, 1.0f);
    memset(x, 0, PDM_QK_K * sizeof(float));                   /* block 0: zeros */
    x[PDM_QK_K + 3] = -4.0f, x[PDM_QK_K + 200] = 4.0f;         /* block 1: -4 first */
    x[2 * PDM_QK_K + 7] = 4.0f, x[2 * PDM_QK_K + 9] = -4.0f;   /* block 2: +4 first */
    for (int j = 0; j < PDM_QK_K; j++)                         /* block 3: ties x.5 */
        x[3 * PDM_QK_K + j] = (float)(j % 64 - 32) + 0.5f;
    x[3 * PDM_QK_K + 11] = -127.0f; /* iscale 1: the other values are k + 0.5 */
    for (int j = 0; j < PDM_QK_K; j++) x[4 * PDM_QK_K + j] *= 1e-30f; /* block 4: tiny */
    for (int j = 0; j < PDM_QK_K; j++) x[5 * PDM_QK_K + j] *= 1e30f;  /* block 5: huge */
    pdm_block_q8_K_t want[N / PDM_QK_K], got[N / PDM_QK_K];
    pdm_kern_ops_generic.act_convert(PDM_DT_Q4_K, x, N, 0, 1, want);
    ck_assert_int_eq(want[3].qs[0], -32); /* -31.5 -> -32 (ties to even) */
    ck_assert_int_eq(want[3].qs[1], -30); /* -30.5 -> -30 */
    const pdm_kern_ops_t *const *list = pdm_kern_ops_list();
    for (int v = 0; list[v]; v++) {
        memset(got, 0x5a, sizeof(got));
        list[v]->act_convert(PDM_DT_Q4_K, x, N, 0, 1, got);
        for (int i = 0; i < N / PDM_QK_K; i++)
            ck_assert_msg(!memcmp(&got[i], &want[i], sizeof(got[i])),
                          "%s: Q8_K block %d differs from the reference", list[v]->name, i);
    }
}
END_TEST

/* ---- attention ----------------------------------------------------------------------- */

/* Element i of a naive attention's K or V: f32, f16, or int8 times the head's scale. */
static float naive_kv(const pdm_kern_attn_t *a, const void *base, size_t i, float scale)
{
    if (a->kv_type == PDM_DT_I8) return scale * (float)((const int8_t *)base)[i];
    if (a->kv_type == PDM_DT_F16) return pdm_f16_to_f32(((const uint16_t *)base)[i]);
    return ((const float *)base)[i];
}

/* Independent naive attention in double: explicit masked softmax. */
static void naive_attention(const pdm_kern_attn_t *a, float *o, float *lse)
{
    int hd = a->head_dim;
    for (int i = 0; i < a->n_q; i++) {
        double m = -INFINITY;
        double *s = malloc((size_t)(a->n_kv ? a->n_kv : 1) * sizeof(double));
        for (int j = 0; j < a->n_kv; j++) {
            int visible = !a->causal || (a->k_pos0 + j <= a->q_pos[i] &&
                                         (a->window <= 0 ||
                                          a->q_pos[i] - (a->k_pos0 + j) < a->window));
            double dot = 0;
            for (int d = 0; d < hd; d++) {
                float kv = naive_kv(a, a->k, (size_t)j * hd + d, a->k_scale);
                dot += (double)a->q[(size_t)i * a->q_stride + d] * kv;
            }
            s[j] = visible ? dot * a->scale : -INFINITY;
            if (s[j] > m) m = s[j];
        }
        double l = 0;
        for (int d = 0; d < hd; d++) o[(size_t)i * hd + d] = 0;
        if (m == -INFINITY) {
            lse[i] = -INFINITY;
            free(s);
            continue;
        }
        for (int j = 0; j < a->n_kv; j++) l += exp(s[j] - m);
        for (int j = 0; j < a->n_kv; j++) {
            double p = exp(s[j] - m) / l;
            for (int d = 0; d < hd; d++) {
                float vv = naive_kv(a, a->v, (size_t)j * hd + d, a->v_scale);
                o[(size_t)i * hd + d] += (float)(p * vv);
            }
        }
        lse[i] = (float)(m + log(l));
        free(s);
    }
}

/* Sliding window of the attention calls check_attention makes (0: none). */
static int32_t check_window;

static void check_attention(const pdm_kern_ops_t *ops, int n_q, int n_kv, int hd,
                            pdm_dtype_t kvt, int32_t k_pos0, int32_t q_pos0, int causal)
{
    float *q = malloc((size_t)n_q * hd * sizeof(float));
    float *kf = malloc((size_t)n_kv * hd * sizeof(float) + 4);
    float *vf = malloc((size_t)n_kv * hd * sizeof(float) + 4);
    void *k = malloc((size_t)n_kv * hd * 4 + 4), *v = malloc((size_t)n_kv * hd * 4 + 4);
    int32_t *pos = malloc((size_t)n_q * sizeof(int32_t));
    float *o = malloc((size_t)n_q * hd * sizeof(float)), *on = malloc((size_t)n_q * hd * sizeof(float));
    float *lse = malloc((size_t)n_q * sizeof(float)), *lsen = malloc((size_t)n_q * sizeof(float));
    fill(q, (size_t)n_q * hd, 1.0f);
    fill(kf, (size_t)n_kv * hd, 1.0f);
    fill(vf, (size_t)n_kv * hd, 1.0f);
    float k_scale = 1.0f, v_scale = 1.0f;
    if (kvt == PDM_DT_I8) {
        /* K 8x wider than V (as after RoPE in real models): the scales differ per tensor;
         * V's scale is fixed for a smaller range than the data, so some values saturate. */
        for (size_t i = 0; i < (size_t)n_kv * hd; i++) kf[i] *= 8.0f;
        k_scale = pdm_q8_scale(8.0f);
        v_scale = pdm_q8_scale(0.9f);
        pdm_q8_quantize_row(kf, k, (int64_t)n_kv * hd, k_scale);
        pdm_q8_quantize_row(vf, v, (int64_t)n_kv * hd, v_scale);
    } else {
        pdm_quantize_row(kvt, kf, k, (int64_t)n_kv * hd);
        pdm_quantize_row(kvt, vf, v, (int64_t)n_kv * hd);
    }
    for (int i = 0; i < n_q; i++) pos[i] = q_pos0 + i;
    pdm_kern_attn_t a = {.q = q, .q_stride = hd, .q_pos = pos, .n_q = n_q, .k = k, .v = v,
                         .kv_type = kvt, .k_scale = k_scale, .v_scale = v_scale,
                         .k_pos0 = k_pos0, .n_kv = n_kv, .head_dim = hd,
                         .scale = 1.0f / sqrtf((float)hd), .causal = causal, .o = o,
                         .o_stride = hd, .lse = lse, .lse_stride = 1, .window = check_window};
    ops->attention(&a);
    naive_attention(&a, on, lsen);
    /* q8: the naive attention sees the same dequantized values, so only the f32 rounding of
     * larger scores (K is 8x wider) separates them */
    float tol = kvt == PDM_DT_F16 ? 2e-3f : kvt == PDM_DT_I8 ? 5e-4f : 1e-4f;
    for (int i = 0; i < n_q; i++) {
        if (isinf(lsen[i])) {
            ck_assert_msg(isinf(lse[i]) && lse[i] < 0, "%s: masked row %d lse %g", ops->name, i,
                          lse[i]);
        } else {
            ck_assert_msg(fabsf(lse[i] - lsen[i]) <= tol, "%s: lse[%d] %g vs %g (nq %d nkv %d)",
                          ops->name, i, lse[i], lsen[i], n_q, n_kv);
        }
        for (int d = 0; d < hd; d++) {
            ck_assert(!isnan(o[(size_t)i * hd + d]));
            ck_assert_msg(fabsf(o[(size_t)i * hd + d] - on[(size_t)i * hd + d]) <= tol,
                          "%s: o[%d][%d] %g vs %g", ops->name, i, d, o[(size_t)i * hd + d],
                          on[(size_t)i * hd + d]);
        }
    }
    free(q);
    free(kf);
    free(vf);
    free(k);
    free(v);
    free(pos);
    free(o);
    free(on);
    free(lse);
    free(lsen);
}

/* int8 KV: round to nearest even at the given scale, saturate instead of wrapping, and the
 * SIMD attention on q8 KV equals the reference on the same bytes. */
START_TEST(test_q8_kv)
{
    const float x[] = {0.0f, 1.0f, -1.0f, 0.5f, 1.5f, 2.5f, -2.5f, 126.4f, 127.6f, 500.0f,
                       -500.0f, -127.0f};
    const int8_t want[] = {0, 1, -1, 0, 2, 2, -2, 126, 127, 127, -127, -127};
    int8_t q[PDM_ARRAY_SIZE(x)];
    pdm_q8_quantize_row(x, q, (int64_t)PDM_ARRAY_SIZE(x), 1.0f);
    for (size_t i = 0; i < PDM_ARRAY_SIZE(x); i++)
        ck_assert_msg(q[i] == want[i], "q8(%g) = %d, want %d", x[i], q[i], want[i]);
    ck_assert_float_eq(pdm_q8_scale(0.0f), 1.0f);
    ck_assert_float_eq_tol(pdm_q8_scale(12.7f), 0.1f, 1e-7f);
    ck_assert_uint_eq(pdm_dtype_row_bytes(PDM_DT_I8, 64), 64);
    ck_assert_str_eq(pdm_dtype_name(PDM_DT_I8), "q8");

    enum { HD = 64, NKV = 97, NQ = 19 };
    float qf[NQ * HD], kf[NKV * HD], vf[NKV * HD];
    int8_t k8[NKV * HD], v8[NKV * HD];
    int32_t pos[NQ];
    fill(qf, NQ * HD, 1.0f);
    fill(kf, NKV * HD, 6.0f);
    fill(vf, NKV * HD, 1.0f);
    pdm_q8_quantize_row(kf, k8, NKV * HD, pdm_q8_scale(6.0f));
    pdm_q8_quantize_row(vf, v8, NKV * HD, pdm_q8_scale(1.0f));
    for (int i = 0; i < NQ; i++) pos[i] = NKV - NQ + i;
    float o_ref[NQ * HD], lse_ref[NQ], o[NQ * HD], lse[NQ];
    pdm_kern_attn_t a = {.q = qf, .q_stride = HD, .q_pos = pos, .n_q = NQ, .k = k8, .v = v8,
                         .kv_type = PDM_DT_I8, .k_scale = pdm_q8_scale(6.0f),
                         .v_scale = pdm_q8_scale(1.0f), .k_pos0 = 0, .n_kv = NKV,
                         .head_dim = HD, .scale = 0.125f, .causal = 1, .o = o_ref,
                         .o_stride = HD, .lse = lse_ref, .lse_stride = 1};
    pdm_kern_ops_generic.attention(&a);
    const pdm_kern_ops_t *const *list = pdm_kern_ops_list();
    for (int v = 0; list[v]; v++) {
        a.o = o;
        a.lse = lse;
        list[v]->attention(&a);
        for (int i = 0; i < NQ; i++) {
            ck_assert_msg(fabsf(lse[i] - lse_ref[i]) <= 1e-5f, "%s: lse[%d] %g vs %g",
                          list[v]->name, i, lse[i], lse_ref[i]);
            for (int d = 0; d < HD; d++)
                ck_assert_msg(fabsf(o[i * HD + d] - o_ref[i * HD + d]) <= 1e-5f,
                              "%s: o[%d][%d] %g vs %g", list[v]->name, i, d, o[i * HD + d],
                              o_ref[i * HD + d]);
        }
    }
}
END_TEST

START_TEST(test_attention_variants)
{
    static const int nkv[] = {1, 7, 63, 64, 65, 1000};
    static const int nq[] = {1, 7, 65};
    const pdm_kern_ops_t *const *list = pdm_kern_ops_list();
    for (int v = 0; list[v]; v++)
        for (size_t a = 0; a < PDM_ARRAY_SIZE(nkv); a++)
            for (size_t b = 0; b < PDM_ARRAY_SIZE(nq); b++) {
                /* queries at the end of the keys (prefill of the last chunk) */
                check_attention(list[v], nq[b], nkv[a], 64, PDM_DT_F32, 100,
                                100 + nkv[a] - nq[b], 1);
                check_attention(list[v], nq[b], nkv[a], 64, PDM_DT_F16, 0, nkv[a] - 1, 1);
                check_attention(list[v], nq[b], nkv[a], 64, PDM_DT_I8, 0, nkv[a] - 1, 1);
                check_attention(list[v], nq[b], nkv[a], 32, PDM_DT_I8, 10, 5, 1);
                check_attention(list[v], nq[b], nkv[a], 6, PDM_DT_I8, 0, nkv[a] / 2, 1);
                /* keys after some queries: those rows are fully masked */
                check_attention(list[v], nq[b], nkv[a], 32, PDM_DT_F32, 10, 5, 1);
                /* non-causal (pass-Q partials) and odd head dims */
                check_attention(list[v], nq[b], nkv[a], 64, PDM_DT_F32, 0, 0, 0);
                check_attention(list[v], nq[b], nkv[a], 6, PDM_DT_F32, 0, nkv[a] / 2, 1);
            }
}
END_TEST

/* GQA as the engine lays it out: query rows of n_heads heads interleaved per token
 * ([n_q][n_heads * hd]), `group` query heads per KV head; every head's result against the
 * naive attention over its KV head. Ratios 1, 3 (this model) and 8. */
START_TEST(test_attention_gqa)
{
    static const int groups[] = {1, 3, 8};
    const int hd = 64, n_kv_heads = 2, n_q = 19, n_kv = 77;
    const pdm_kern_ops_t *const *list = pdm_kern_ops_list();
    for (size_t g = 0; g < PDM_ARRAY_SIZE(groups); g++) {
        const int n_heads = groups[g] * n_kv_heads, qdim = n_heads * hd;
        float *q = malloc((size_t)n_q * qdim * sizeof(float));
        float *o = malloc((size_t)n_q * qdim * sizeof(float)), *lse = malloc(n_q * n_heads * 4);
        float *on = malloc((size_t)n_q * hd * sizeof(float)), *lsen = malloc(n_q * 4);
        float *qh = malloc((size_t)n_q * hd * sizeof(float));
        float *k = malloc((size_t)n_kv_heads * n_kv * hd * 4), *v = malloc((size_t)n_kv_heads * n_kv * hd * 4);
        int32_t pos[19];
        fill(q, (size_t)n_q * qdim, 1.0f);
        fill(k, (size_t)n_kv_heads * n_kv * hd, 1.0f);
        fill(v, (size_t)n_kv_heads * n_kv * hd, 1.0f);
        for (int i = 0; i < n_q; i++) pos[i] = n_kv - n_q + i - 3; /* the first rows see less */
        for (int vi = 0; list[vi]; vi++)
            for (int h = 0; h < n_heads; h++) {
                int kvh = h / groups[g];
                pdm_kern_attn_t a = {.q = q + (size_t)h * hd, .q_stride = qdim, .q_pos = pos,
                                     .n_q = n_q, .k = k + (size_t)kvh * n_kv * hd,
                                     .v = v + (size_t)kvh * n_kv * hd, .kv_type = PDM_DT_F32,
                                     .k_pos0 = 0, .n_kv = n_kv, .head_dim = hd, .scale = 0.125f,
                                     .causal = 1, .o = o + (size_t)h * hd, .o_stride = qdim,
                                     .lse = lse + h, .lse_stride = n_heads};
                list[vi]->attention(&a);
                for (int i = 0; i < n_q; i++)
                    memcpy(qh + (size_t)i * hd, q + (size_t)i * qdim + (size_t)h * hd, hd * 4);
                pdm_kern_attn_t an = a;
                an.q = qh;
                an.q_stride = hd;
                naive_attention(&an, on, lsen);
                for (int i = 0; i < n_q; i++) {
                    ck_assert_msg(fabsf(lse[i * n_heads + h] - lsen[i]) <= 1e-4f,
                                  "%s gqa %d head %d row %d lse %g vs %g", list[vi]->name,
                                  groups[g], h, i, lse[i * n_heads + h], lsen[i]);
                    for (int d = 0; d < hd; d++)
                        ck_assert(fabsf(o[(size_t)i * qdim + h * hd + d] - on[i * hd + d]) <= 1e-4f);
                }
            }
        free(q);
        free(o);
        free(lse);
        free(on);
        free(lsen);
        free(qh);
        free(k);
        free(v);
    }
}
END_TEST

START_TEST(test_attention_split_merge)
{
    /* attention over [0, n) equals the merge of attention over two views [0, s) and [s, n) */
    const int hd = 64, n = 130, nq = 20;
    float *q = malloc(nq * hd * sizeof(float)), *k = malloc(n * hd * sizeof(float));
    float *v = malloc(n * hd * sizeof(float));
    fill(q, nq * hd, 1.0f);
    fill(k, n * hd, 1.0f);
    fill(v, n * hd, 1.0f);
    int32_t pos[20];
    for (int i = 0; i < nq; i++) pos[i] = n - nq + i - 40; /* some rows see only part 1 */
    const pdm_kern_ops_t *const *list = pdm_kern_ops_list();
    for (int vi = 0; list[vi]; vi++) {
        const pdm_kern_ops_t *ops = list[vi];
        for (int split = 0; split <= n; split += 13) {
            float o_full[20 * 64], lse_full[20], o1[20 * 64], lse1[20], o2[20 * 64], lse2[20];
            pdm_kern_attn_t a = {.q = q, .q_stride = hd, .q_pos = pos, .n_q = nq, .k = k,
                                 .v = v, .kv_type = PDM_DT_F32, .k_pos0 = 0, .n_kv = n,
                                 .head_dim = hd, .scale = 0.125f, .causal = 1, .o = o_full,
                                 .o_stride = hd, .lse = lse_full, .lse_stride = 1};
            ops->attention(&a);
            a.n_kv = split;
            a.o = o1;
            a.lse = lse1;
            ops->attention(&a);
            a.k = k + (size_t)split * hd;
            a.v = v + (size_t)split * hd;
            a.k_pos0 = split;
            a.n_kv = n - split;
            a.o = o2;
            a.lse = lse2;
            ops->attention(&a);
            for (int i = 0; i < nq; i++) {
                ops->attn_merge(o1 + i * hd, &lse1[i], o2 + i * hd, lse2[i], hd);
                ck_assert(!isnan(lse1[i]));
                ck_assert_msg(fabsf(lse1[i] - lse_full[i]) < 1e-4f, "%s split %d lse %g vs %g",
                              ops->name, split, lse1[i], lse_full[i]);
                for (int d = 0; d < hd; d++)
                    ck_assert(fabsf(o1[i * hd + d] - o_full[i * hd + d]) < 1e-4f);
            }
        }
    }
    /* merging two empty partials stays empty without NaN */
    float oa[4] = {0}, ob[4] = {0}, la = -INFINITY;
    pdm_kern_ops_generic.attn_merge(oa, &la, ob, -INFINITY, 4);
    ck_assert(isinf(la) && la < 0);
    ck_assert(oa[0] == 0.0f && !isnan(oa[3]));
    free(q);
    free(k);
    free(v);
}
END_TEST

/* ---- elementwise --------------------------------------------------------------------- */

START_TEST(test_elementwise_variants)
{
    static const int sizes[] = {1, 7, 63, 64, 65, 576, 1000};
    const pdm_kern_ops_t *const *list = pdm_kern_ops_list();
    for (int v = 0; list[v]; v++) {
        const pdm_kern_ops_t *ops = list[v];
        for (size_t s = 0; s < PDM_ARRAY_SIZE(sizes); s++) {
            int n = sizes[s];
            float *x = malloc(n * sizeof(float)), *w = malloc(n * sizeof(float));
            float *y = malloc(n * sizeof(float)), *u = malloc(n * sizeof(float));
            fill(x, n, 3.0f);
            fill(w, n, 1.0f);
            fill(u, n, 1.0f);
            ops->rmsnorm(y, x, w, n, 1e-5f);
            double ss = 0;
            for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
            double sc = 1.0 / sqrt(ss / n + 1e-5);
            for (int i = 0; i < n; i++)
                ck_assert(fabs(y[i] - x[i] * sc * w[i]) <= 1e-5 * (1 + fabs(x[i] * sc * w[i])));
            ops->swiglu(y, x, u, n);
            for (int i = 0; i < n; i++) {
                double want = x[i] / (1 + exp(-(double)x[i])) * u[i];
                ck_assert(fabs(y[i] - want) <= 1e-5 * (1 + fabs(want)));
            }
            /* kv_store to f16 equals the reference conversion */
            uint16_t *h = malloc(n * sizeof(uint16_t));
            ops->kv_store(PDM_DT_F16, x, h, n);
            for (int i = 0; i < n; i++) ck_assert_uint_eq(h[i], pdm_f32_to_f16(x[i]));
            free(h);
            free(x);
            free(w);
            free(y);
            free(u);
        }
        /* RoPE: rotation keeps pair norms; position 0 is the identity */
        float r[128], r0[128];
        fill(r, 128, 1.0f);
        memcpy(r0, r, sizeof(r));
        ops->rope(r, 2, 64, 0, 10000.0f);
        for (int i = 0; i < 128; i++) ck_assert(fabsf(r[i] - r0[i]) < 1e-6f);
        ops->rope(r, 2, 64, 1234, 10000.0f);
        for (int i = 0; i < 64; i++) {
            float a = hypotf(r[2 * i], r[2 * i + 1]), b = hypotf(r0[2 * i], r0[2 * i + 1]);
            ck_assert(fabsf(a - b) < 1e-4f);
        }
        /* pair 0 rotates by exactly `pos` radians */
        float e[2] = {1.0f, 0.0f};
        ops->rope(e, 1, 2, 3, 10000.0f);
        ck_assert(fabsf(e[0] - cosf(3.0f)) < 1e-6f && fabsf(e[1] - sinf(3.0f)) < 1e-6f);
    }
}
END_TEST

/* Sliding-window attention (Gemma 3's local layers): windows of 1 key, shorter than a key
 * tile, across tiles and longer than the view; queries at the end of the keys, in the middle,
 * and before them; every variant against the naive masked softmax. */
START_TEST(test_attention_window)
{
    static const int32_t windows[] = {1, 5, 16, 33, 2000};
    static const int nkv[] = {1, 40, 100};
    static const int nq[] = {1, 17};
    const pdm_kern_ops_t *const *list = pdm_kern_ops_list();
    for (int v = 0; list[v]; v++)
        for (size_t w = 0; w < PDM_ARRAY_SIZE(windows); w++)
            for (size_t a = 0; a < PDM_ARRAY_SIZE(nkv); a++)
                for (size_t b = 0; b < PDM_ARRAY_SIZE(nq); b++) {
                    check_window = windows[w];
                    check_attention(list[v], nq[b], nkv[a], 64, PDM_DT_F32, 100,
                                    100 + nkv[a] - nq[b], 1);
                    check_attention(list[v], nq[b], nkv[a], 256, PDM_DT_F16, 0, nkv[a] / 2, 1);
                    check_attention(list[v], nq[b], nkv[a], 32, PDM_DT_I8, 10, 5, 1);
                    check_attention(list[v], nq[b], nkv[a], 6, PDM_DT_F32, 0, nkv[a] - 1, 1);
                }
    check_window = 0;
}
END_TEST

/* rope_ext against a double-precision rotation (NORM and NEOX pairs, frequency factors,
 * linear scaling), rope_ext without extras equal to rope, and geglu against the tanh GELU in
 * double; every variant. */
START_TEST(test_rope_ext_geglu_variants)
{
    const pdm_kern_ops_t *const *list = pdm_kern_ops_list();
    float ff[128];
    for (int i = 0; i < 128; i++) ff[i] = 1.0f + (float)(i % 7);
    for (int v = 0; list[v]; v++) {
        const pdm_kern_ops_t *ops = list[v];
        for (int neox = 0; neox <= 1; neox++)
            for (int with_ff = 0; with_ff <= 1; with_ff++) {
                const int hd = 256, nh = 2, half = hd / 2, pos = 77;
                pdm_kern_rope_t r = {.theta = 10000.0f, .freq_scale = with_ff ? 0.25f : 1.0f,
                                     .freq_factors = with_ff ? ff : NULL, .neox = neox};
                float x[512], x0[512];
                fill(x, 512, 1.0f);
                memcpy(x0, x, sizeof(x));
                ops->rope_ext(x, nh, hd, pos, &r);
                for (int h = 0; h < nh; h++)
                    for (int i = 0; i < half; i++) {
                        int i0 = h * hd + (neox ? i : 2 * i), i1 = i0 + (neox ? half : 1);
                        double ang = pos * pow(10000.0, -2.0 * i / hd) * r.freq_scale /
                                     (with_ff ? ff[i] : 1.0);
                        double a = x0[i0], b = x0[i1];
                        double want0 = a * cos(ang) - b * sin(ang);
                        double want1 = a * sin(ang) + b * cos(ang);
                        /* f32 angles by repeated multiplication, as llama.cpp: ~1e-4 rad */
                        ck_assert_msg(fabs(x[i0] - want0) < 2e-3 && fabs(x[i1] - want1) < 2e-3,
                                      "%s: rope_ext neox %d ff %d pair %d", ops->name, neox,
                                      with_ff, i);
                    }
            }
        float a[128], b[128];
        fill(a, 128, 1.0f);
        memcpy(b, a, sizeof(a));
        const pdm_kern_rope_t plain = {.theta = 500000.0f, .freq_scale = 1.0f};
        ops->rope(a, 2, 64, 1234, 500000.0f);
        ops->rope_ext(b, 2, 64, 1234, &plain);
        ck_assert(!memcmp(a, b, sizeof(a)));
        static const int sizes[] = {1, 7, 64, 65, 1000};
        for (size_t s = 0; s < PDM_ARRAY_SIZE(sizes); s++) {
            int n = sizes[s];
            float *x = malloc(n * sizeof(float)), *u = malloc(n * sizeof(float));
            float *y = malloc(n * sizeof(float));
            fill(x, n, 6.0f); /* into the tails of GELU */
            fill(u, n, 1.0f);
            ops->geglu(y, x, u, n);
            for (int i = 0; i < n; i++) {
                double g = x[i];
                double want = 0.5 * g * (1 + tanh(sqrt(2 / M_PI) * (g + 0.044715 * g * g * g))) * u[i];
                ck_assert_msg(fabs(y[i] - want) <= 1e-5 * (1 + fabs(want)), "%s: geglu(%g) %g "
                              "vs %g", ops->name, x[i], y[i], want);
            }
            free(x);
            free(u);
            free(y);
        }
    }
}
END_TEST

/* rope_ext and rope of every variant against the reference (pdm_kern_ops_generic) on the same
 * input: NORM and NEOX pairs, frequency factors and linear scaling, head sizes whose pair
 * count is not a multiple of the vector width (1, 3, 5, 9, 17, 65 pairs) and full ones (32,
 * 128, 256 pairs), 1 or 3 heads. Every variant uses the reference's angle table, so the
 * rotation is all that differs: |x - x_ref| <= 1e-6 (|a| + |b|) of the pair (one rounding of a
 * product fused into an FMA at most); measured 0 with the current compilers. */
START_TEST(test_rope_ext_variants_vs_reference)
{
    const pdm_kern_ops_t *const *list = pdm_kern_ops_list();
    static const int pairs[] = {1, 3, 5, 9, 17, 32, 65, 128, 256};
    float ff[256];
    for (int i = 0; i < 256; i++) ff[i] = 1.0f + 0.37f * (float)(i % 11);
    float x[3 * 512], ref[3 * 512], x0[3 * 512];
    for (int v = 0; list[v]; v++)
        for (size_t p = 0; p < PDM_ARRAY_SIZE(pairs); p++)
            for (int nh = 1; nh <= 3; nh += 2)
                for (int mode = 0; mode < 4; mode++) {
                    const int hd = 2 * pairs[p], neox = mode & 1, extra = mode >> 1;
                    const int32_t pos = 1 + 977 * (int32_t)p + 31 * mode;
                    const pdm_kern_rope_t r = {.theta = extra ? 1000000.0f : 10000.0f,
                                               .freq_scale = extra ? 0.125f : 1.0f,
                                               .freq_factors = extra ? ff : NULL,
                                               .neox = neox};
                    const size_t n = (size_t)nh * hd;
                    fill(x0, n, 3.0f);
                    memcpy(x, x0, n * sizeof(float));
                    memcpy(ref, x0, n * sizeof(float));
                    list[v]->rope_ext(x, nh, hd, pos, &r);
                    pdm_kern_ops_generic.rope_ext(ref, nh, hd, pos, &r);
                    for (int h = 0; h < nh; h++)
                        for (int i = 0; i < pairs[p]; i++) {
                            const int i0 = h * hd + (neox ? i : 2 * i), i1 = i0 + (neox ? hd / 2 : 1);
                            const float tol = 1e-6f * (fabsf(x0[i0]) + fabsf(x0[i1]));
                            ck_assert_msg(fabsf(x[i0] - ref[i0]) <= tol &&
                                          fabsf(x[i1] - ref[i1]) <= tol,
                                          "%s: rope_ext head_dim %d heads %d neox %d extra %d "
                                          "pair %d: (%g, %g) vs (%g, %g)", list[v]->name, hd, nh,
                                          neox, extra, i, x[i0], x[i1], ref[i0], ref[i1]);
                        }
                    if (mode == 0) { /* rope is rope_ext without extras */
                        memcpy(x, x0, n * sizeof(float));
                        memcpy(ref, x0, n * sizeof(float));
                        list[v]->rope(x, nh, hd, pos, 10000.0f);
                        pdm_kern_ops_generic.rope(ref, nh, hd, pos, 10000.0f);
                        for (size_t i = 0; i < n; i++)
                            ck_assert_msg(fabsf(x[i] - ref[i]) <= 1e-6f * (1 + fabsf(ref[i])),
                                          "%s: rope head_dim %d value %zu", list[v]->name, hd, i);
                    }
                }
}
END_TEST

/* ---- CUDA ---------------------------------------------------------------------------- */

/* The CUDA variant against the reference with the same checks and tolerances as the CPU
 * variants; skipped with a message when the build has no CUDA or there is no device. */
START_TEST(test_cuda_variant)
{
    char why[256] = "";
    const pdm_kern_ops_t *ops = pdm_kern_ops_cuda(why, sizeof(why));
    if (!ops) {
        fprintf(stderr, "kernels: SKIP cuda variant: %s\n", why);
        return;
    }
    static const pdm_dtype_t types[] = {PDM_DT_Q4_1, PDM_DT_Q4_0, PDM_DT_Q8_0, PDM_DT_F16,
                                        PDM_DT_F32,  PDM_DT_BF16, PDM_DT_Q5_0, PDM_DT_Q5_1,
                                        PDM_DT_IQ4_NL};
    static const int shapes[][2] = {{1, 32}, {7, 64}, {63, 96}, {64, 576}, {65, 160}};
    for (size_t t = 0; t < PDM_ARRAY_SIZE(types); t++)
        for (size_t sh = 0; sh < PDM_ARRAY_SIZE(shapes); sh++)
            for (int n_tok = 1; n_tok <= 9; n_tok += 4)
                check_matmul(ops, types[t], shapes[sh][0], shapes[sh][1], n_tok);
    static const pdm_dtype_t ktypes[] = {PDM_DT_Q2_K, PDM_DT_Q3_K, PDM_DT_Q4_K,
                                         PDM_DT_Q5_K, PDM_DT_Q6_K, PDM_DT_IQ4_XS};
    static const int kshapes[][2] = {{1, 256}, {33, 768}, {65, 512}};
    for (size_t t = 0; t < PDM_ARRAY_SIZE(ktypes); t++)
        for (size_t sh = 0; sh < PDM_ARRAY_SIZE(kshapes); sh++)
            for (int n_tok = 1; n_tok <= 9; n_tok += 4)
                check_matmul(ops, ktypes[t], kshapes[sh][0], kshapes[sh][1], n_tok);
    static const int nkv[] = {1, 7, 63, 64, 65, 1000};
    for (size_t a = 0; a < PDM_ARRAY_SIZE(nkv); a++) {
        check_attention(ops, 7, nkv[a], 64, PDM_DT_F32, 100, 100 + nkv[a] - 7, 1);
        check_attention(ops, 7, nkv[a], 64, PDM_DT_F16, 0, nkv[a] - 1, 1);
        check_attention(ops, 7, nkv[a], 64, PDM_DT_I8, 0, nkv[a] - 1, 1);
        check_attention(ops, 7, nkv[a], 32, PDM_DT_F32, 10, 5, 1);
        check_attention(ops, 7, nkv[a], 64, PDM_DT_F32, 0, 0, 0);
    }
    static const int sizes[] = {1, 7, 63, 64, 65, 576, 1000};
    for (size_t k = 0; k < PDM_ARRAY_SIZE(sizes); k++) {
        int n = sizes[k];
        float *x = malloc(n * sizeof(float)), *w = malloc(n * sizeof(float));
        float *y = malloc(n * sizeof(float)), *yr = malloc(n * sizeof(float));
        uint16_t *h = malloc(n * sizeof(uint16_t));
        fill(x, n, 3.0f);
        fill(w, n, 1.0f);
        ops->rmsnorm(y, x, w, n, 1e-5f);
        pdm_kern_ops_generic.rmsnorm(yr, x, w, n, 1e-5f);
        for (int i = 0; i < n; i++) ck_assert(fabsf(y[i] - yr[i]) <= 1e-5f * (1 + fabsf(yr[i])));
        ops->swiglu(y, x, w, n);
        pdm_kern_ops_generic.swiglu(yr, x, w, n);
        for (int i = 0; i < n; i++) ck_assert(fabsf(y[i] - yr[i]) <= 1e-5f * (1 + fabsf(yr[i])));
        ops->kv_store(PDM_DT_F16, x, h, n);
        for (int i = 0; i < n; i++) ck_assert_uint_eq(h[i], pdm_f32_to_f16(x[i]));
        free(x);
        free(w);
        free(y);
        free(yr);
        free(h);
    }
    float r[128], rr[128];
    fill(r, 128, 1.0f);
    memcpy(rr, r, sizeof(r));
    ops->rope(r, 2, 64, 1234, 10000.0f);
    pdm_kern_ops_generic.rope(rr, 2, 64, 1234, 10000.0f);
    for (int i = 0; i < 128; i++) ck_assert(fabsf(r[i] - rr[i]) < 1e-5f);
    pdm_kern_cuda_release();
}
END_TEST

/* ---- thread pool --------------------------------------------------------------------- */

typedef struct {
    int counts[8];
    int runs[8];       /* times share ith ran: exactly once per task */
    int by_caller;     /* shares the calling thread ran */
    pthread_t caller;
    long sum;
} pool_arg_t;

static void pool_task(void *arg, int ith, int nth)
{
    pool_arg_t *a = arg;
    int64_t b, e;
    pdm_kern_split(1000, ith, nth, 16, &b, &e);
    a->counts[ith] = (int)(e - b);
    __atomic_add_fetch(&a->runs[ith], 1, __ATOMIC_SEQ_CST);
    if (pthread_equal(pthread_self(), a->caller)) __atomic_add_fetch(&a->by_caller, 1, __ATOMIC_SEQ_CST);
    long s = 0;
    for (int64_t i = b; i < e; i++) s += i;
    __atomic_add_fetch(&a->sum, s, __ATOMIC_SEQ_CST);
}

START_TEST(test_pool)
{
    for (int n = 1; n <= 4; n++) {
        pdm_kern_pool_t *pool = pdm_kern_pool_create(n);
        ck_assert_ptr_nonnull(pool);
        ck_assert_int_eq(pdm_kern_pool_size(pool), n);
        for (int rep = 0; rep < 2000; rep++) {
            pool_arg_t a = {.caller = pthread_self()};
            pdm_kern_pool_run(pool, pool_task, &a);
            ck_assert_int_eq(a.sum, 999 * 1000 / 2);
            int total = 0;
            for (int i = 0; i < n; i++) {
                total += a.counts[i];
                ck_assert_int_eq(a.runs[i], 1);
            }
            ck_assert_int_eq(total, 1000);
            if (rep == 1000) usleep(20000); /* workers asleep on the condition variable */
        }
        pdm_kern_pool_destroy(pool);
    }
    /* On one CPU a worker cannot run while the caller does: the caller takes the shares no
     * worker has claimed instead of waiting a time slice for each (a worker kept off its core
     * by another process); every share still runs exactly once. */
    cpu_set_t old_set, one;
    ck_assert_int_eq(sched_getaffinity(0, sizeof(old_set), &old_set), 0);
    CPU_ZERO(&one);
    for (int c = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, &old_set)) {
            CPU_SET(c, &one);
            break;
        }
    ck_assert_int_eq(sched_setaffinity(0, sizeof(one), &one), 0); /* the workers inherit it */
    pdm_kern_pool_t *pool = pdm_kern_pool_create(4);
    ck_assert_ptr_nonnull(pool);
    int all_by_caller = 0;
    for (int rep = 0; rep < 200; rep++) {
        pool_arg_t a = {.caller = pthread_self()};
        pdm_kern_pool_run(pool, pool_task, &a);
        for (int i = 0; i < 4; i++) ck_assert_int_eq(a.runs[i], 1);
        ck_assert_int_eq(a.sum, 999 * 1000 / 2);
        all_by_caller += a.by_caller == 4;
    }
    pdm_kern_pool_destroy(pool);
    ck_assert_int_eq(sched_setaffinity(0, sizeof(old_set), &old_set), 0);
    ck_assert_msg(all_by_caller > 0, "the caller never ran the unclaimed shares itself");
    pdm_kern_pool_destroy(NULL);
    /* split covers [0, n) exactly with aligned boundaries */
    for (int nth = 1; nth <= 5; nth++) {
        int64_t prev = 0;
        for (int i = 0; i < nth; i++) {
            int64_t b, e;
            pdm_kern_split(100, i, nth, 16, &b, &e);
            ck_assert_int_eq(b, prev);
            ck_assert(b % 16 == 0 || b == 100);
            prev = e;
        }
        ck_assert_int_eq(prev, 100);
    }
}
END_TEST

Suite *suite_kernels(void)
{
    Suite *s = suite_create("kernels");
    TCase *tc = tcase_create("kernels");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_f16_roundtrip_exhaustive);
    tcase_add_test(tc, test_quant_roundtrip_error);
    tcase_add_test(tc, test_quant_rms_error);
    tcase_add_test(tc, test_dtype_traits);
    tcase_add_test(tc, test_matmul_variants);
    tcase_add_test(tc, test_matmul_kquants);
    tcase_add_test(tc, test_repack_kquants);
    tcase_add_test(tc, test_q8_K_activations);
    tcase_add_test(tc, test_q8_kv);
    tcase_add_test(tc, test_attention_variants);
    tcase_add_test(tc, test_attention_gqa);
    tcase_add_test(tc, test_attention_split_merge);
    tcase_add_test(tc, test_elementwise_variants);
    tcase_add_test(tc, test_attention_window);
    tcase_add_test(tc, test_rope_ext_geglu_variants);
    tcase_add_test(tc, test_rope_ext_variants_vs_reference);
    tcase_add_test(tc, test_cuda_variant);
    tcase_add_test(tc, test_pool);
    suite_add_tcase(s, tc);
    return s;
}
