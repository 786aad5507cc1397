/*
 * kernels.h - the one kernel interface of pdmesh.
 *
 * Data types (numbered as in GGUF/ggml so that file tensors map directly), their reference
 * (de)quantization, an ops table implemented by every backend (scalar reference, AVX2,
 * AVX-512, CUDA), and a persistent thread pool that splits work across cores.
 *
 * This layer depends on nothing else of pdmesh. Functions here never allocate in the hot path.
 */
#ifndef PDM_KERNELS_H
#define PDM_KERNELS_H

#include <stddef.h>
#include <stdint.h>

/* ---- Data types ------------------------------------------------------------------------- */

/* Values are the GGUF tensor type ids. */
typedef enum {
    PDM_DT_F32 = 0,
    PDM_DT_F16 = 1,
    PDM_DT_Q4_0 = 2,
    PDM_DT_Q4_1 = 3,
    PDM_DT_Q5_0 = 6,
    PDM_DT_Q5_1 = 7,
    PDM_DT_Q8_0 = 8,
    PDM_DT_Q8_1 = 9, /* activations only: 8-bit with per-block scale and sum */
    PDM_DT_Q2_K = 10,
    PDM_DT_Q3_K = 11,
    PDM_DT_Q4_K = 12,
    PDM_DT_Q5_K = 13,
    PDM_DT_Q6_K = 14,
    PDM_DT_Q8_K = 15, /* activations only: 8-bit per 256, f32 scale, sums of 16 */
    PDM_DT_IQ4_NL = 20,
    PDM_DT_IQ4_XS = 23,
    PDM_DT_I8 = 24,  /* KV cache "q8": plain int8, x = q * scale, one scale per (layer, kv
                      * head) for K and one for V, kept outside the rows */
    PDM_DT_BF16 = 30,
    PDM_DT_COUNT_ = 31
} pdm_dtype_t;

#define PDM_QK 32   /* elements per block of the 32-element types (Q4_0 .. Q8_1, IQ4_NL) */
#define PDM_QK_K 256 /* elements per super-block of the K-quants and IQ4_XS */

/* Block layouts (little-endian, packed as in GGUF files; the spec is ggml's
 * ggml/src/ggml-common.h, whose block_* structs these mirror field for field). Elements of a
 * block are numbered in row order; "element j" below is the j-th of its block. */
typedef struct {
    uint16_t d;             /* f16 scale */
    uint8_t qs[PDM_QK / 2]; /* 4-bit values, x = (q - 8) * d; low nibbles hold elements 0..15 */
} pdm_block_q4_0_t;
typedef struct {
    uint16_t d, m;          /* f16 scale and minimum: x = q * d + m */
    uint8_t qs[PDM_QK / 2]; /* low nibbles: elements 0..15, high nibbles: 16..31 */
} pdm_block_q4_1_t;
typedef struct {
    uint16_t d;         /* f16 scale: x = q * d */
    int8_t qs[PDM_QK];
} pdm_block_q8_0_t;
typedef struct {
    float d;            /* scale: x = q * d */
    float s;            /* d * sum(qs), used by Q4_1 dot products */
    int8_t qs[PDM_QK];
} pdm_block_q8_1_t;

typedef struct {
    uint16_t d;             /* f16 scale: x = (q - 16) * d, q 5 bits */
    uint8_t qh[4];          /* bit j (little-endian u32) is bit 4 of element j's q */
    uint8_t qs[PDM_QK / 2]; /* low 4 bits: low nibbles elements 0..15, high nibbles 16..31 */
} pdm_block_q5_0_t;
typedef struct {
    uint16_t d, m;          /* f16 scale and minimum: x = q * d + m, q 5 bits */
    uint8_t qh[4];          /* as Q5_0 */
    uint8_t qs[PDM_QK / 2];
} pdm_block_q5_1_t;

/* The K-quants (ggml-common.h block_q2_K .. block_q6_K, block_q8_K). A super-block of 256
 * holds 8 sub-blocks of 32 (Q4_K, Q5_K) or 16 of 16 (Q2_K, Q3_K, Q6_K), each with a small
 * integer scale (and min) that the f16 super-block scale d (and dmin) multiply. */
typedef struct {
    uint8_t scales[PDM_QK_K / 16]; /* sub-block j of 16: scale low nibble, min high nibble */
    uint8_t qs[PDM_QK_K / 4];      /* 2-bit q; see pdm_dequantize_row for the bit order */
    uint16_t d, dmin;              /* x = d * scale_j * q - dmin * min_j */
} pdm_block_q2_K_t;
typedef struct {
    uint8_t hmask[PDM_QK_K / 8];   /* bit e / 32 of byte e % 32: element e's high bit h */
    uint8_t qs[PDM_QK_K / 4];      /* low 2 bits lo of q, packed as Q2_K's */
    uint8_t scales[12];            /* 16 6-bit scales, stored + 32 */
    uint16_t d;                    /* x = d * (scale_j - 32) * (lo - (h ? 0 : 4)) */
} pdm_block_q3_K_t;
typedef struct {
    uint16_t d, dmin;
    uint8_t scales[12];            /* 8 6-bit scales and 8 6-bit mins (get_scale_min_k4) */
    uint8_t qs[PDM_QK_K / 2];      /* x = d * scale_j * q - dmin * min_j, q 4 bits */
} pdm_block_q4_K_t;
typedef struct {
    uint16_t d, dmin;
    uint8_t scales[12];            /* as Q4_K */
    uint8_t qh[PDM_QK_K / 8];      /* bit 4 of q */
    uint8_t qs[PDM_QK_K / 2];      /* low 4 bits of q */
} pdm_block_q5_K_t;
typedef struct {
    uint8_t ql[PDM_QK_K / 2];      /* low 4 bits of q */
    uint8_t qh[PDM_QK_K / 4];      /* high 2 bits of q */
    int8_t scales[PDM_QK_K / 16];  /* x = d * scale_j * (q - 32), q 6 bits */
    uint16_t d;
} pdm_block_q6_K_t;
typedef struct {
    float d;                       /* scale: x = q * d (not rounded to f16) */
    int8_t qs[PDM_QK_K];
    int16_t bsums[PDM_QK_K / 16];  /* sums of qs over groups of 16 (the K-quants' min terms) */
} pdm_block_q8_K_t;

/* IQ4_NL and IQ4_XS (ggml-common.h block_iq4_nl, block_iq4_xs): 4-bit indices into the fixed
 * non-linear table pdm_kvalues_iq4nl. */
typedef struct {
    uint16_t d;                    /* x = d * kvalues[q] */
    uint8_t qs[PDM_QK / 2];        /* low nibbles elements 0..15, high nibbles 16..31 */
} pdm_block_iq4_nl_t;
typedef struct {
    uint16_t d;
    uint16_t scales_h;             /* bits 2j..2j+1: high 2 bits of sub-block j's scale */
    uint8_t scales_l[PDM_QK_K / 64]; /* nibble j: low 4 bits of sub-block j's scale */
    uint8_t qs[PDM_QK_K / 2];      /* per 32: as IQ4_NL; x = d * (scale_j - 32) * kvalues[q] */
} pdm_block_iq4_xs_t;

/* The 16 values of IQ4_NL / IQ4_XS (a format constant, ggml-common.h kvalues_iq4nl). */
extern const int8_t pdm_kvalues_iq4nl[16];

/* Returns 1 if `type` is a known type, 0 otherwise. */
int pdm_dtype_valid(uint32_t type);
/* Returns 1 if `type` can hold weights in a model file (every known type but the activation
 * formats Q8_1 and Q8_K and the KV cache's I8). */
int pdm_dtype_is_weight(pdm_dtype_t type);
/* The weight types, comma-separated, for error messages ("f32, f16, ..."). */
const char *pdm_dtype_weight_list(void);
/* The type named `name` ("q4_k", case-insensitive), or -1. */
int pdm_dtype_from_name(const char *name);
const char *pdm_dtype_name(pdm_dtype_t type);
/* Elements per block (1 for plain float types) and bytes per block. */
int pdm_dtype_block_elems(pdm_dtype_t type);
size_t pdm_dtype_block_bytes(pdm_dtype_t type);
/* Bytes of a row of `n` elements; 0 if `n` is not a multiple of the block size. */
size_t pdm_dtype_row_bytes(pdm_dtype_t type, int64_t n);

float pdm_f16_to_f32(uint16_t h);
uint16_t pdm_f32_to_f16(float f);
float pdm_bf16_to_f32(uint16_t h);
uint16_t pdm_f32_to_bf16(float f);

/* Reference dequantization of `n` elements (n a multiple of the block size) into f32. */
void pdm_dequantize_row(pdm_dtype_t type, const void *src, float *dst, int64_t n);
/* Reference quantization of `n` f32 elements; supports every type above but I8 (whose scale
 * lives outside the row: see pdm_q8_quantize_row). For the K-quants and IQ4 the scales are
 * searched to minimise the squared error of each sub-block (our own search, not llama.cpp's:
 * files differ from llama-quantize's bit for bit, the format is the same). Q8_K follows
 * llama.cpp's quantize_row_q8_K_ref exactly (it is an activation format). */
void pdm_quantize_row(pdm_dtype_t type, const float *src, void *dst, int64_t n);

/* int8 KV ("q8"): dst[i] = round-to-nearest-even(src[i] / scale), saturated to [-127, 127]
 * (values beyond the range the scale was fixed for clip instead of wrapping). scale > 0. */
void pdm_q8_quantize_row(const float *src, int8_t *dst, int64_t n, float scale);
/* The scale that maps [-absmax, absmax] onto [-127, 127]; 1 for an all-zero tensor. */
float pdm_q8_scale(float absmax);

/* ---- Thread pool ------------------------------------------------------------------------ */

typedef struct pdm_kern_pool pdm_kern_pool_t;

/* A task body: called once for each share index `ith` in [0, nth), each share on one thread.
 * Which thread runs a share is not fixed (a thread may run several, one after another), so a
 * share's work must depend on `ith` only and must never wait for another share. */
typedef void (*pdm_kern_task_cb)(void *arg, int ith, int nth);

/* Creates a pool of `n_threads` (>= 1) threads, the caller's thread counting as thread 0.
 * Returns NULL if threads cannot be started. */
pdm_kern_pool_t *pdm_kern_pool_create(int n_threads);
void pdm_kern_pool_destroy(pdm_kern_pool_t *pool);
int pdm_kern_pool_size(const pdm_kern_pool_t *pool);
/* Runs the pool-size shares of `cb` on the pool's threads, the caller's included, and returns
 * when all have finished. The caller also runs the shares that no worker has claimed by the
 * time its own is done, so a worker kept off its core by another process does not stall the
 * task. A NULL pool runs it on the calling thread with nth = 1. Not reentrant. */
void pdm_kern_pool_run(pdm_kern_pool_t *pool, pdm_kern_task_cb cb, void *arg);

/* Splits [0, n) into `nth` contiguous ranges aligned to `align` items; writes thread ith's. */
void pdm_kern_split(int64_t n, int ith, int nth, int64_t align, int64_t *begin, int64_t *end);

/* ---- Ops table -------------------------------------------------------------------------- */

/* How a weight matrix's bytes are arranged. */
typedef enum {
    PDM_KERN_LAYOUT_ROWS = 0, /* the file's: row r at data + r * row_bytes */
    PDM_KERN_LAYOUT_X8 = 1,   /* repacked at load (pdm_kern_repack): groups of 8 rows, see
                               * pdm_block_q4_Kx8_t, pdm_block_q5_Kx8_t, pdm_block_q6_Kx8_t,
                               * pdm_block_q8_0x8_t, pdm_block_q5_0x8_t, pdm_block_q4_1x8_t,
                               * pdm_block_iq4_xsx8_t;
                               * the last group padded with zero rows */
} pdm_kern_layout_t;

/* A weight matrix: `rows` rows of `cols` elements of `type`. With the ROWS layout (the
 * default, zero) rows are row-major, `row_bytes` apart; row_bytes is the file's row size in
 * every layout. y = W x means y[r] = sum_c W[r][c] * x[c]. */
typedef struct {
    const void *data;
    pdm_dtype_t type;
    int64_t rows, cols;
    size_t row_bytes;
    pdm_kern_layout_t layout;
} pdm_kern_mat_t;

/* ---- Repacking at load -------------------------------------------------------------------
 *
 * Q4_K, Q5_K, Q6_K, IQ4_XS, Q8_0, Q5_0 and Q4_1 matrices can be rearranged once, at load, into a layout the CPU
 * kernels compute on faster (the idea of llama.cpp's ggml-cpu repack.cpp, block_q4_Kx8; the
 * layouts here are our own): 8 rows interleaved so that one 32-byte vector holds 4 consecutive 4-bit values of
 * each of the 8 rows, and each row's 6-bit packed sub-block scales and minimums decoded once
 * to bytes. A u8 x s8 dot product against 4 broadcast activation bytes (vpdpbusd) then gives
 * the 8 rows' partial sums in the 8 int32 lanes: no horizontal sums, no per-row scale
 * unpacking, and the 4-bit values of a super-block are unpacked once per 4 tokens for 8 rows.
 * Group super-block i (1184 bytes for 8 x 144 in the file) of rows 8g..8g+7: */
typedef struct {
    uint16_t d[8], dmin[8];       /* f16 super-block scale and minimum scale of each row */
    uint8_t scales[8][8];         /* [sub-block j][row r]: 6-bit scale */
    uint8_t mins[4][8][2];        /* [j / 2][row r][j % 2]: 6-bit minimum (int16 pairs with
                                   * vpmaddwd against pairs of sub-block activation sums) */
    uint8_t qs[4][8][32];         /* [p][k][4 r + l]: low nibble element 64p + 4k + l of row
                                   * r (sub-block 2p), high nibble element 64p + 32 + 4k + l
                                   * (sub-block 2p + 1): byte 32p + 4k + l of the file's qs */
} pdm_block_q4_Kx8_t;

/* Q5_K's group super-block (1440 bytes for 8 x 176 in the file: the decoded scales, as for
 * Q4_K): Q4_K's scales, minimums and nibbles, with the fifth bit of each value beside the
 * nibbles of its 64-element run (one forward stream, as Q6_K's below).
 * x = d * scale_j * q - dmin * min_j, q 5 bits. */
typedef struct {
    uint16_t d[8], dmin[8];       /* as pdm_block_q4_Kx8_t */
    uint8_t scales[8][8];
    uint8_t mins[4][8][2];
    struct {
        uint8_t qs[8][32];        /* as pdm_block_q4_Kx8_t.qs[p] */
        uint8_t qh[2][32];        /* [k / 4][4 r + l]: bit 4 of the values of qs[k][4 r + l]
                                   * at bits 2 (k % 4) (low nibble's) and 2 (k % 4) + 1 (high
                                   * nibble's) */
    } run[4];                     /* [p]: elements 64p .. 64p + 63 */
} pdm_block_q5_Kx8_t;

/* Q6_K's group super-block (1680 bytes, 8 x 210 as in the file): the low 4 bits of q as
 * Q4_K's qs above, the high 2 bits of four such vectors packed in one, sub-block scales
 * pre-arranged in int16-pair order. x = d * scale_j * (q - 32), j = e / 16, q 6 bits. The
 * high bits of a 64-element run sit right after its low bits, so that one forward stream
 * reads the block (with them at the end, matrix-vector products ran at 8 instead of 28 GB/s:
 * the hardware prefetcher did not follow the two interleaved streams). */
typedef struct {
    uint16_t d[8];                /* f16 super-block scale of each row */
    int8_t scales[8][8][2];       /* [j / 2][row r][j % 2]: scale of sub-block j of 16 */
    struct {
        uint8_t ql[8][32];        /* low 4 bits of q, as pdm_block_q4_Kx8_t.qs[p] */
        uint8_t qh[4][32];        /* [k / 2][4 r + l]: high 2 bits of the values of
                                   * ql[k][4 r + l] at bits 4 (k % 2) (low nibble's) and
                                   * 4 (k % 2) + 2 (high nibble's) */
    } run[4];                     /* [p]: elements 64p .. 64p + 63 */
} pdm_block_q6_Kx8_t;

/* Q8_0's group block (272 bytes, 8 x 34 as in the file): values stored plus 128 (w ^ 0x80)
 * so that vpdpbusd takes them as unsigned bytes; the kernels take 128 * sum(x) off. */
typedef struct {
    uint16_t d[8];                /* f16 scale of each row */
    uint8_t qs[8][32];            /* [k][4 r + l]: element 4k + l of row r, plus 128 */
} pdm_block_q8_0x8_t;

/* Q5_0's group block (176 bytes, 8 x 22 as in the file). The value q (0..31, x = d (q - 16))
 * of element 4k + l of row r is the nibble of qs[k % 4][4 r + l] (low for k < 4: the file's
 * own pairing of elements j and j + 16 in one byte) with bit 4 from bit k of qh[4 r + l]: a
 * shift and a mask put the high bits of the 32 lanes of chunk k in place, and the kernels feed
 * q to vpdpbusd unsigned and take 16 * sum(x) off, as for Q8_0's + 128. */
typedef struct {
    uint16_t d[8];                /* f16 scale of each row */
    uint8_t qh[32];               /* [4 r + l]: bit k = bit 4 of element 4k + l of row r */
    uint8_t qs[4][32];            /* [k][4 r + l]: low 4 bits of elements 4k + l (low nibble)
                                   * and 4k + 16 + l (high nibble) of row r */
} pdm_block_q5_0x8_t;

/* Q4_1's group block (160 bytes, 8 x 20 as in the file): Q5_0's arrangement of the nibbles
 * (chunk k of elements 4k..4k+3 is the low nibbles of qs[k] for k < 4, the high nibbles of
 * qs[k - 4] after), and the rows' scales and minimums side by side. x = d q + m, q 4 bits. */
typedef struct {
    uint16_t d[8], m[8];          /* f16 scale and minimum of each row */
    uint8_t qs[4][32];            /* [k][4 r + l]: byte 4k + l of row r's qs */
} pdm_block_q4_1x8_t;

/* IQ4_XS's group super-block (1104 bytes for 8 x 136 in the file: the scales decoded to
 * bytes). Nibbles keep the file's pairing within a 32-element sub-block (element 32j + 4k + l
 * low, 32j + 16 + 4k + l high). The kernels look the codes up in kvalues + 128 (unsigned, for
 * vpdpbusd) and take 128 times the sub-block's activation sum off; x = d * scale_j * kvalues[q]. */
typedef struct {
    uint16_t d[8];                /* f16 super-block scale of each row */
    int8_t scales[8][8];          /* [sub-block j][row r]: scale - 32 */
    uint8_t qs[8][4][32];         /* [j][k][4 r + l]: byte 16j + 4k + l of row r's qs */
} pdm_block_iq4_xsx8_t;

/* Bytes matrix `m` takes repacked (0 if its type or shape has no repacked layout: today
 * Q4_K, Q5_K, Q6_K, IQ4_XS, Q8_0, Q5_0 and Q4_1 with ROWS layout). */
size_t pdm_kern_repack_bytes(const pdm_kern_mat_t *m);
/* Repacks `m` (ROWS layout) into `dst` (pdm_kern_repack_bytes(m) bytes, 32-byte aligned) and
 * writes the repacked matrix (data = dst) to *out. Returns 0, or -1 (nothing written) if the
 * matrix has no repacked layout. */
int pdm_kern_repack(const pdm_kern_mat_t *m, void *dst, pdm_kern_mat_t *out);
/* Row r of `m` in f32 in any layout: exactly pdm_dequantize_row of the file's row. */
void pdm_kern_mat_dequantize_row(const pdm_kern_mat_t *m, int64_t r, float *dst);

/* Attention of a block of query rows of one head against one KV view of the matching KV
 * head. Positions are absolute. With `causal`, query row i sees key j iff
 * k_pos0 + j <= q_pos[i], and with a sliding window (window > 0) also
 * q_pos[i] - (k_pos0 + j) < window (llama.cpp's LLAMA_SWA_TYPE_STANDARD, is_masked_swa in
 * src/llama-hparams.h: the row sees itself and the window - 1 keys before it). Rows that see
 * no key get o = 0 and lse = -INFINITY. */
typedef struct {
    const float *q;       /* [n_q][q_stride] floats; head_dim used per row */
    int64_t q_stride;     /* floats between query rows */
    const int32_t *q_pos; /* [n_q] absolute positions */
    int n_q;
    const void *k, *v;    /* [n_kv][head_dim] of kv_type (F32, F16 or I8), contiguous */
    pdm_dtype_t kv_type;
    float k_scale, v_scale; /* I8 only: k = k_scale * int8, v = v_scale * int8 */
    int32_t k_pos0;       /* absolute position of key 0 */
    int n_kv;
    int head_dim;
    float scale;          /* usually 1/sqrt(head_dim) */
    int causal;
    float *o;             /* [n_q][o_stride] out */
    int64_t o_stride;
    float *lse;           /* [n_q] out, lse_stride apart */
    int64_t lse_stride;
    int32_t window;       /* causal only: sliding window in tokens; 0 = unlimited */
} pdm_kern_attn_t;

/* RoPE parameters beyond the base (llama.cpp's ggml_rope_ext with ext_factor 0 and
 * attn_factor 1, i.e. no YaRN): pair i of a head of d dims is rotated by
 *     pos * freq_scale * theta^(-2i/d) / freq_factors[i]
 * (ggml-cpu ops.cpp ggml_rope_cache_init / rope_yarn). `neox` picks the pairs: 0 rotates
 * adjacent values (x[2i], x[2i+1]) (GGML_ROPE_TYPE_NORM: Llama), 1 rotates (x[i], x[i + d/2])
 * (GGML_ROPE_TYPE_NEOX: Qwen2, Qwen3, Gemma 3). */
typedef struct {
    float theta;               /* frequency base */
    float freq_scale;          /* 1 / linear scaling factor; 1 = none */
    const float *freq_factors; /* [head_dim / 2] divisors of each pair's frequency (Llama 3's
                                * rope_freqs tensor), or NULL */
    int neox;
} pdm_kern_rope_t;

typedef struct pdm_kern_ops {
    const char *name;

    /* Bytes of scratch needed to hold activations x [n_tok][cols] converted for
     * matmul on weights of `wtype` (0 if x is used as f32 directly). */
    size_t (*act_bytes)(pdm_dtype_t wtype, int64_t cols, int n_tok);
    /* Converts rows [t0, t1) of x into the scratch layout for weights of `wtype`. */
    void (*act_convert)(pdm_dtype_t wtype, const float *x, int64_t cols, int t0, int t1,
                        void *act);
    /* y[t][r] = sum_c W[r][c] * x[t][c] for r in [r0, r1), t in [0, n_tok); y rows are
     * `ldy` floats apart. `act` is the converted x (or x itself when act_bytes is 0). */
    void (*matmul)(const pdm_kern_mat_t *w, const void *act, int n_tok, float *y, int64_t ldy,
                   int64_t r0, int64_t r1);

    /* out[i] = x[i] / rms(x) * w[i] */
    void (*rmsnorm)(float *out, const float *x, const float *w, int n, float eps);
    /* Rotates adjacent pairs (x[2i], x[2i+1]) of each of `n_heads` heads of `x` by
     * pos * theta^(-2i/head_dim) (llama.cpp's "normal" RoPE). */
    void (*rope)(float *x, int n_heads, int head_dim, int32_t pos, float theta);
    /* out[i] = silu(gate[i]) * up[i] */
    void (*swiglu)(float *out, const float *gate, const float *up, int n);
    /* Causal flash attention with online softmax over key tiles; see pdm_kern_attn_t. */
    void (*attention)(const pdm_kern_attn_t *a);
    /* Merges a partial result (o2, lse2) into (o1, lse1) in place for one row of `n` floats.
     * An empty partial (lse = -INFINITY) is a no-op; never produces NaN. */
    void (*attn_merge)(float *o1, float *lse1, const float *o2, float lse2, int n);
    /* Converts f32 to the KV storage type (F32 copy or F16; I8 goes through
     * pdm_q8_quantize_row, which needs the head's scale). */
    void (*kv_store)(pdm_dtype_t type, const float *src, void *dst, int n);
    /* `attention` with the keys gathered through a row table: key j (position k_pos0 + j) is
     * row kv_rows[j] of k and of v (rows of head_dim values of kv_type). The beam search reads
     * its response segments through the beam-indirection table this way, the "index select"
     * fused into the attention (segment KV cache paper §3.3), so reordering beams never copies
     * KV. kv_rows NULL is `attention`. */
    void (*attention_rows)(const pdm_kern_attn_t *a, const int32_t *kv_rows);
    /* `rope` generalised (see pdm_kern_rope_t); rope(x, .., theta) is rope_ext with
     * {theta, 1, NULL, 0}. */
    void (*rope_ext)(float *x, int n_heads, int head_dim, int32_t pos, const pdm_kern_rope_t *r);
    /* out[i] = gelu(gate[i]) * up[i] with the tanh form of GELU,
     * gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (Gemma's gated FFN, llama.cpp
     * LLM_FFN_GELU + LLM_FFN_PAR = ggml_geglu). out may alias gate. */
    void (*geglu)(float *out, const float *gate, const float *up, int n);
} pdm_kern_ops_t;

/* The scalar reference implementation. */
extern const pdm_kern_ops_t pdm_kern_ops_generic;

/* The best variant for this CPU (avx512, then avx2, then generic), or the one named by
 * PDMESH_KERNELS if set and supported. Chosen once. */
const pdm_kern_ops_t *pdm_kern_ops_get(void);
/* A variant by name if compiled in and supported by this CPU, else NULL. */
const pdm_kern_ops_t *pdm_kern_ops_find(const char *name);
/* NULL-terminated list of the variants this CPU supports. */
const pdm_kern_ops_t *const *pdm_kern_ops_list(void);

/* The CUDA variant (kernels/cuda, built by `make cuda` only): the same ops on host pointers,
 * the backend copying to and from the device (weights are uploaded once and cached). Returns
 * NULL when no device is present or the build has no CUDA, with the reason in `why`. */
const pdm_kern_ops_t *pdm_kern_ops_cuda(char *why, size_t why_len);
/* Frees the CUDA backend's device memory (weight cache, scratch); a no-op without CUDA. */
void pdm_kern_cuda_release(void);

#endif /* PDM_KERNELS_H */
