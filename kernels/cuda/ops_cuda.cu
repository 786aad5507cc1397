/*
 * ops_cuda.cu - the kernel ops table (pdm_kern_ops_t) in CUDA C.
 *
 * Memory model (deliberately simple): every op takes the same HOST pointers as the CPU
 * variants, copies its inputs to the device, runs, and copies the outputs back. Weight
 * matrices are the exception: they are uploaded once, on first use, and cached by host address
 * (weights are immutable for the life of a model; pdm_kern_cuda_release drops the cache).
 * This keeps the CUDA backend behind the one interface the engine and the tests use; a
 * device-resident engine (activations and KV kept on the GPU across ops) is a later step.
 *
 * Numerics follow the scalar reference: activations are converted to Q8_1 / Q8_0 / Q8_K on the
 * host with the reference code (act_convert), quantized block dot products are exact integer
 * sums (dp4a for Q4_0/Q4_1/Q8_0; plain integer arithmetic through quant_layout.h, the
 * reference's own bit accessors, for Q5_0/Q5_1/IQ4_NL and the 256-element K-quants and
 * IQ4_XS) scaled in f32, RoPE advances its angles by repeated multiplication like the
 * reference, attention is an online softmax with lse, kv_store rounds to nearest even.
 *
 * Built only by `make cuda` (nvcc, sm_80 and sm_90) into build-cuda/; never part of make test.
 */
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

extern "C" {
#include "../cpu/ops_internal.h"
}
#include "../cpu/quant_layout.h"

#define PDM_CUDA_CHECK(call)                                                                     \
    do {                                                                                         \
        cudaError_t err_ = (call);                                                               \
        if (err_ != cudaSuccess) {                                                               \
            fprintf(stderr, "pdmesh cuda: %s at %s:%d\n", cudaGetErrorString(err_), __FILE__,     \
                    __LINE__);                                                                   \
            pdm_cuda_failed = 1;                                                                 \
        }                                                                                        \
    } while (0)

static int pdm_cuda_failed = 0;
static pthread_mutex_t pdm_cuda_lock = PTHREAD_MUTEX_INITIALIZER;

/* ---- Device memory: scratch buffers and the weight cache ------------------------------------ */

/* Grow-only scratch slots, one per operand position of an op. Ops are serialised by the lock. */
#define PDM_CUDA_SLOTS 7
static void *pdm_cuda_slot[PDM_CUDA_SLOTS];
static size_t pdm_cuda_slot_bytes[PDM_CUDA_SLOTS];

static void *scratch(int slot, size_t bytes)
{
    if (bytes == 0) bytes = 16;
    if (pdm_cuda_slot_bytes[slot] < bytes) {
        cudaFree(pdm_cuda_slot[slot]);
        pdm_cuda_slot[slot] = NULL;
        pdm_cuda_slot_bytes[slot] = 0;
        PDM_CUDA_CHECK(cudaMalloc(&pdm_cuda_slot[slot], bytes));
        if (pdm_cuda_slot[slot]) pdm_cuda_slot_bytes[slot] = bytes;
    }
    return pdm_cuda_slot[slot];
}

static void *upload(int slot, const void *host, size_t bytes)
{
    void *d = scratch(slot, bytes);
    if (d && host && bytes) PDM_CUDA_CHECK(cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice));
    return d;
}

static void download(void *host, const void *dev, size_t bytes)
{
    if (dev && bytes) PDM_CUDA_CHECK(cudaMemcpy(host, dev, bytes, cudaMemcpyDeviceToHost));
}

typedef struct {
    const void *host;
    size_t bytes;
    void *dev;
} pdm_cuda_weight_t;

#define PDM_CUDA_MAX_WEIGHTS 4096
static pdm_cuda_weight_t pdm_cuda_weights[PDM_CUDA_MAX_WEIGHTS];
static int pdm_cuda_n_weights;

/* Device copy of an immutable host weight matrix, uploaded on first use. */
static const void *weight_on_device(const void *host, size_t bytes)
{
    for (int i = 0; i < pdm_cuda_n_weights; i++)
        if (pdm_cuda_weights[i].host == host && pdm_cuda_weights[i].bytes == bytes)
            return pdm_cuda_weights[i].dev;
    void *dev = NULL;
    PDM_CUDA_CHECK(cudaMalloc(&dev, bytes));
    if (!dev) return NULL;
    PDM_CUDA_CHECK(cudaMemcpy(dev, host, bytes, cudaMemcpyHostToDevice));
    if (pdm_cuda_n_weights < PDM_CUDA_MAX_WEIGHTS)
        pdm_cuda_weights[pdm_cuda_n_weights++] = (pdm_cuda_weight_t){host, bytes, dev};
    return dev;
}

/* ---- Device helpers ------------------------------------------------------------------------ */

__device__ static inline float f16_to_f32(uint16_t h)
{
    return __half2float(__ushort_as_half(h));
}

__device__ static inline float bf16_to_f32(uint16_t h)
{
    return __uint_as_float((uint32_t)h << 16);
}

__device__ static inline float warp_sum(float v)
{
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ static inline float warp_max(float v)
{
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* 4 bytes of a possibly unaligned block field as an int (blocks are 18/20/34/40 bytes). */
__device__ static inline int load_i32(const uint8_t *p)
{
    return (int)((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
                 (uint32_t)p[3] << 24);
}

/* Integer dot product of block i: weights w (Q4_1, Q4_0 or Q8_0) and activations x
 * (Q8_1 or Q8_0), scaled to f32, exactly the reference's per-block term. */
__device__ static float block_dot(pdm_dtype_t type, const uint8_t *wrow, const uint8_t *xrow,
                                 int64_t i)
{
    if (type == PDM_DT_Q4_1) {
        const pdm_block_q4_1_t *w = (const pdm_block_q4_1_t *)wrow + i;
        const pdm_block_q8_1_t *x = (const pdm_block_q8_1_t *)xrow + i;
        int sumi = 0;
        for (int j = 0; j < 4; j++) {
            int q = load_i32(w->qs + 4 * j);
            int lo = q & 0x0f0f0f0f, hi = (q >> 4) & 0x0f0f0f0f;
            sumi = __dp4a(lo, load_i32((const uint8_t *)x->qs + 4 * j), sumi);
            sumi = __dp4a(hi, load_i32((const uint8_t *)x->qs + 16 + 4 * j), sumi);
        }
        return f16_to_f32(w->d) * x->d * (float)sumi + f16_to_f32(w->m) * x->s;
    }
    const pdm_block_q8_0_t *x = (const pdm_block_q8_0_t *)xrow + i;
    int sumi = 0;
    float dw;
    if (type == PDM_DT_Q4_0) {
        const pdm_block_q4_0_t *w = (const pdm_block_q4_0_t *)wrow + i;
        for (int j = 0; j < 4; j++) {
            int q = load_i32(w->qs + 4 * j);
            /* nibble - 8 as signed bytes: (n ^ 8) - 8 per byte without borrows via __vsub4 */
            int lo = __vsub4(q & 0x0f0f0f0f, 0x08080808);
            int hi = __vsub4((q >> 4) & 0x0f0f0f0f, 0x08080808);
            sumi = __dp4a(lo, load_i32((const uint8_t *)x->qs + 4 * j), sumi);
            sumi = __dp4a(hi, load_i32((const uint8_t *)x->qs + 16 + 4 * j), sumi);
        }
        dw = f16_to_f32(w->d);
    } else {
        const pdm_block_q8_0_t *w = (const pdm_block_q8_0_t *)wrow + i;
        for (int j = 0; j < 8; j++)
            sumi = __dp4a(load_i32((const uint8_t *)w->qs + 4 * j),
                          load_i32((const uint8_t *)x->qs + 4 * j), sumi);
        dw = f16_to_f32(w->d);
    }
    return dw * f16_to_f32(x->d) * (float)sumi;
}

/* Block i of the other 32-element types against Q8_0 (Q5_0, IQ4_NL) or Q8_1 (Q5_1): the
 * reference's integer sum and scaling (ops_generic.c dot_q5_0_q8_0 and friends). */
__device__ static float block_dot_32(pdm_dtype_t type, const uint8_t *wrow, const uint8_t *xrow,
                                    int64_t i)
{
    int sumi = 0;
    if (type == PDM_DT_Q5_1) {
        const pdm_block_q5_1_t *w = (const pdm_block_q5_1_t *)wrow + i;
        const pdm_block_q8_1_t *x = (const pdm_block_q8_1_t *)xrow + i;
        for (int e = 0; e < PDM_QK; e++) sumi += pdm_ql_q5(w->qs, w->qh, e) * x->qs[e];
        return f16_to_f32(w->d) * x->d * (float)sumi + f16_to_f32(w->m) * x->s;
    }
    const pdm_block_q8_0_t *x = (const pdm_block_q8_0_t *)xrow + i;
    uint16_t d;
    if (type == PDM_DT_Q5_0) {
        const pdm_block_q5_0_t *w = (const pdm_block_q5_0_t *)wrow + i;
        for (int e = 0; e < PDM_QK; e++) sumi += (pdm_ql_q5(w->qs, w->qh, e) - 16) * x->qs[e];
        d = w->d;
    } else {
        const pdm_block_iq4_nl_t *w = (const pdm_block_iq4_nl_t *)wrow + i;
        for (int l = 0; l < PDM_QK / 2; l++) {
            sumi += pdm_ql_iq4(w->qs[l] & 0x0f) * x->qs[l];
            sumi += pdm_ql_iq4(w->qs[l] >> 4) * x->qs[l + PDM_QK / 2];
        }
        d = w->d;
    }
    return f16_to_f32(d) * f16_to_f32(x->d) * (float)sumi;
}

/* Super-block i of a K-quant or IQ4_XS row against Q8_K: per sub-block scale * (q . q8) as
 * an integer, minimums through the activation sums of 16, scaled by d * d8 and dmin * d8
 * (ops_generic.c dot_kblock_q8_K). */
__device__ static float block_dot_k(pdm_dtype_t type, const uint8_t *wrow, const uint8_t *xrow,
                                   int64_t i, size_t block_bytes)
{
    const void *w = wrow + (size_t)i * block_bytes;
    const pdm_block_q8_K_t *x = (const pdm_block_q8_K_t *)xrow + i;
    const int sub = pdm_ql_sub_len(type);
    int sumi = 0, summ = 0;
    for (int j = 0; j < PDM_QK_K / sub; j++) {
        int sc, mn, s = 0;
        pdm_ql_ksub(type, w, j, &sc, &mn);
        for (int l = 0; l < sub; l++) s += pdm_ql_kquant(type, w, j * sub + l) * x->qs[j * sub + l];
        sumi += sc * s;
        for (int g = j * sub / 16; g < (j + 1) * sub / 16; g++) summ += mn * x->bsums[g];
    }
    uint16_t d, dmin;
    pdm_ql_kscales(type, w, &d, &dmin);
    return f16_to_f32(d) * x->d * (float)sumi - f16_to_f32(dmin) * x->d * (float)summ;
}

/* Bytes of one 256-element block (device side: the host traits table is not reachable). */
__device__ static size_t kblock_bytes(pdm_dtype_t type)
{
    switch (type) {
    case PDM_DT_Q2_K: return sizeof(pdm_block_q2_K_t);
    case PDM_DT_Q3_K: return sizeof(pdm_block_q3_K_t);
    case PDM_DT_Q4_K: return sizeof(pdm_block_q4_K_t);
    case PDM_DT_Q5_K: return sizeof(pdm_block_q5_K_t);
    case PDM_DT_Q6_K: return sizeof(pdm_block_q6_K_t);
    default: return sizeof(pdm_block_iq4_xs_t);
    }
}

/* ---- Kernels ------------------------------------------------------------------------------- */

/* One warp per (row, token): lanes stride over the row's blocks (or elements for float
 * weights), then a warp reduction. Block = 4 warps = 4 tokens of the same row. */
__global__ void k_matmul(const uint8_t *w, pdm_dtype_t type, int64_t cols, size_t row_bytes,
                         const uint8_t *act, size_t act_row_bytes, int n_tok, float *y,
                         int64_t ldy, int64_t r0, int64_t r1)
{
    int64_t r = r0 + blockIdx.x;
    int t = blockIdx.y * 4 + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (r >= r1 || t >= n_tok) return;
    const uint8_t *wrow = w + (size_t)r * row_bytes, *xrow = act + (size_t)t * act_row_bytes;
    float sum = 0.0f;
    if (type == PDM_DT_Q4_1 || type == PDM_DT_Q4_0 || type == PDM_DT_Q8_0) {
        for (int64_t i = lane; i < cols / PDM_QK; i += 32) sum += block_dot(type, wrow, xrow, i);
    } else if (type == PDM_DT_Q5_0 || type == PDM_DT_Q5_1 || type == PDM_DT_IQ4_NL) {
        for (int64_t i = lane; i < cols / PDM_QK; i += 32) sum += block_dot_32(type, wrow, xrow, i);
    } else if (type == PDM_DT_Q2_K || type == PDM_DT_Q3_K || type == PDM_DT_Q4_K ||
               type == PDM_DT_Q5_K || type == PDM_DT_Q6_K || type == PDM_DT_IQ4_XS) {
        const size_t bb = kblock_bytes(type);
        for (int64_t i = lane; i < cols / PDM_QK_K; i += 32)
            sum += block_dot_k(type, wrow, xrow, i, bb);
    } else {
        const float *x = (const float *)xrow;
        for (int64_t c = lane; c < cols; c += 32) {
            float wv = type == PDM_DT_F32   ? ((const float *)wrow)[c]
                       : type == PDM_DT_F16 ? f16_to_f32(((const uint16_t *)wrow)[c])
                                            : bf16_to_f32(((const uint16_t *)wrow)[c]);
            sum += wv * x[c];
        }
    }
    sum = warp_sum(sum);
    if (lane == 0) y[(size_t)t * ldy + r] = sum;
}

/* One block per row; 256 threads. Sum of squares in double like the reference. */
__global__ void k_rmsnorm(float *out, const float *x, const float *w, int n, float eps)
{
    __shared__ double part[256];
    double ss = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += (double)x[i] * x[i];
    part[threadIdx.x] = ss;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
        __syncthreads();
    }
    float scale = 1.0f / sqrtf((float)(part[0] / n) + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = x[i] * scale * w[i];
}

/* Thread per rotation pair; the angle is advanced by repeated multiplication as in the
 * reference so both round alike. */
__global__ void k_rope(float *x, int n_heads, int head_dim, int32_t pos, float step)
{
    int idx = blockIdx.x * blockDim.x + threadIdx.x, half = head_dim / 2;
    if (idx >= n_heads * half) return;
    int h = idx / half, i = idx % half;
    float angle = (float)pos;
    for (int k = 0; k < i; k++) angle *= step;
    float cs = cosf(angle), sn = sinf(angle);
    float *v = x + (size_t)h * head_dim;
    float a = v[2 * i], b = v[2 * i + 1];
    v[2 * i] = a * cs - b * sn;
    v[2 * i + 1] = a * sn + b * cs;
}

__global__ void k_swiglu(float *out, const float *gate, const float *up, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

/* gelu(g) * u, tanh form, as the reference (ops_generic.c generic_geglu). */
__global__ void k_geglu(float *out, const float *gate, const float *up, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float x = gate[i];
        out[i] = 0.5f * x * (1.0f + tanhf(0.79788456080286535587989211986876f * x *
                                          (1.0f + 0.044715f * x * x))) * up[i];
    }
}

__global__ void k_kv_store_f16(const float *src, uint16_t *dst, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = __half_as_ushort(__float2half_rn(src[i]));
}

/* Element i of K or V; int8 ("q8") KV is dequantized on the fly with the head's scale. */
__device__ static inline float kv_at(pdm_dtype_t type, const void *base, int64_t i, float qs)
{
    if (type == PDM_DT_I8) return qs * (float)((const int8_t *)base)[i];
    return type == PDM_DT_F16 ? f16_to_f32(((const uint16_t *)base)[i])
                              : ((const float *)base)[i];
}

/* One block (one warp, 32 threads) per query row: keys in chunks of 32, one key per lane for
 * the score, then an online-softmax update of the row's output where lanes own head_dim / 32
 * dimensions each. Output o rows are compact [n_q][head_dim]; lse [n_q]. Key j is row rows[j]
 * of k and v when rows is not NULL (the beam-indirection table, segment KV cache §3.3). */
__global__ void k_attention(const float *q, int64_t q_stride, const int32_t *q_pos,
                            const void *k, const void *v, pdm_dtype_t kv_type, float k_scale,
                            float v_scale, int32_t k_pos0, int n_kv, int head_dim, float scale,
                            int causal, int32_t window, float *o, float *lse,
                            const int32_t *rows)
{
    const int row = blockIdx.x, lane = threadIdx.x;
    const float *qr = q + (size_t)row * q_stride;
    int vis = n_kv, first = 0; /* keys [first, vis) are visible (pdm_kern_attn_t) */
    if (causal) {
        int64_t v64 = (int64_t)q_pos[row] - k_pos0 + 1;
        vis = v64 < 0 ? 0 : (v64 > n_kv ? n_kv : (int)v64);
        int64_t lo = window > 0 ? (int64_t)q_pos[row] - window + 1 - k_pos0 : 0;
        first = lo < 0 ? 0 : (lo > vis ? vis : (int)lo);
        if (first == vis) vis = first = 0;
    }
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}; /* head_dim <= 256: dims lane + 32 * j */
    float m = -INFINITY, l = 0.0f;
    for (int j0 = first; j0 < vis; j0 += 32) {
        int j = j0 + lane;
        float s = -INFINITY;
        if (j < vis) {
            s = 0.0f;
            const int64_t kr = rows ? rows[j] : j;
            for (int d = 0; d < head_dim; d++) s += qr[d] * kv_at(kv_type, k, kr * head_dim + d, k_scale);
            s *= scale;
        }
        float m_new = fmaxf(m, warp_max(s));
        float c = m == -INFINITY ? 0.0f : expf(m - m_new);
        float p = j < vis ? expf(s - m_new) : 0.0f;
        l = l * c + warp_sum(p);
        for (int jj = 0; jj < 32 && j0 + jj < vis; jj++) {
            float pj = __shfl_sync(0xffffffffu, p, jj);
            for (int t = 0; t < 8; t++) {
                int d = lane + 32 * t;
                if (d < head_dim) {
                    if (jj == 0) acc[t] *= c;
                    const int64_t vr = rows ? rows[j0 + jj] : j0 + jj;
                    acc[t] += pj * kv_at(kv_type, v, vr * head_dim + d, v_scale);
                }
            }
        }
        m = m_new;
    }
    for (int t = 0; t < 8; t++) {
        int d = lane + 32 * t;
        if (d < head_dim) o[(size_t)row * head_dim + d] = vis ? acc[t] / l : 0.0f;
    }
    if (lane == 0) lse[row] = vis ? m + logf(l) : -INFINITY;
}

/* ---- Ops table ----------------------------------------------------------------------------- */

static size_t cuda_act_bytes(pdm_dtype_t wtype, int64_t cols, int n_tok)
{
    return pdm_kern__act_bytes(wtype, cols, n_tok);
}

/* Activation quantization stays on the host with the reference code (cheap next to the
 * product, and keeps the quantized activations bit-identical to the reference's). */
static void cuda_act_convert(pdm_dtype_t wtype, const float *x, int64_t cols, int t0, int t1,
                             void *act)
{
    pdm_kern_ops_generic.act_convert(wtype, x, cols, t0, t1, act);
}

static void cuda_matmul(const pdm_kern_mat_t *w, const void *act, int n_tok, float *y,
                        int64_t ldy, int64_t r0, int64_t r1)
{
    if (r1 <= r0 || n_tok <= 0) return;
    if (w->layout != PDM_KERN_LAYOUT_ROWS) {
        /* Layouts repacked for the CPU kernels have no device kernel: compute on the host
         * (a model meant for the GPU is loaded with PDMESH_REPACK=0). */
        pdm_kern_ops_generic.matmul(w, act, n_tok, y, ldy, r0, r1);
        return;
    }
    pthread_mutex_lock(&pdm_cuda_lock);
    pdm_dtype_t at = pdm_kern__act_type(w->type);
    size_t arb = at == PDM_DT_F32 ? (size_t)w->cols * sizeof(float)
                                  : pdm_dtype_row_bytes(at, w->cols);
    const void *dw = weight_on_device(w->data, w->row_bytes * (size_t)w->rows);
    const void *da = upload(0, act, arb * (size_t)n_tok);
    size_t ybytes = ((size_t)(n_tok - 1) * ldy + (size_t)r1) * sizeof(float);
    float *dy = (float *)upload(1, y, ybytes); /* rows outside [r0, r1) keep their values */
    if (dw && da && dy) {
        dim3 grid((unsigned)(r1 - r0), (unsigned)((n_tok + 3) / 4));
        k_matmul<<<grid, 128>>>((const uint8_t *)dw, w->type, w->cols, w->row_bytes,
                                (const uint8_t *)da, arb, n_tok, dy, ldy, r0, r1);
        PDM_CUDA_CHECK(cudaGetLastError());
        download(y, dy, ybytes);
    }
    pthread_mutex_unlock(&pdm_cuda_lock);
}

static void cuda_rmsnorm(float *out, const float *x, const float *w, int n, float eps)
{
    pthread_mutex_lock(&pdm_cuda_lock);
    const float *dx = (const float *)upload(0, x, (size_t)n * 4);
    const float *dw = (const float *)upload(1, w, (size_t)n * 4);
    float *dout = (float *)scratch(2, (size_t)n * 4);
    if (dx && dw && dout) {
        k_rmsnorm<<<1, 256>>>(dout, dx, dw, n, eps);
        PDM_CUDA_CHECK(cudaGetLastError());
        download(out, dout, (size_t)n * 4);
    }
    pthread_mutex_unlock(&pdm_cuda_lock);
}

static void cuda_rope(float *x, int n_heads, int head_dim, int32_t pos, float theta)
{
    pthread_mutex_lock(&pdm_cuda_lock);
    size_t bytes = (size_t)n_heads * head_dim * 4;
    float *dx = (float *)upload(0, x, bytes);
    int pairs = n_heads * head_dim / 2;
    if (dx && pairs > 0) {
        k_rope<<<(pairs + 127) / 128, 128>>>(dx, n_heads, head_dim, pos,
                                             powf(theta, -2.0f / (float)head_dim));
        PDM_CUDA_CHECK(cudaGetLastError());
        download(x, dx, bytes);
    }
    pthread_mutex_unlock(&pdm_cuda_lock);
}

static void cuda_swiglu(float *out, const float *gate, const float *up, int n)
{
    pthread_mutex_lock(&pdm_cuda_lock);
    const float *dg = (const float *)upload(0, gate, (size_t)n * 4);
    const float *du = (const float *)upload(1, up, (size_t)n * 4);
    float *dout = (float *)scratch(2, (size_t)n * 4);
    if (dg && du && dout && n > 0) {
        k_swiglu<<<(n + 255) / 256, 256>>>(dout, dg, du, n);
        PDM_CUDA_CHECK(cudaGetLastError());
        download(out, dout, (size_t)n * 4);
    }
    pthread_mutex_unlock(&pdm_cuda_lock);
}

/* Key j is row rows[j] of k and v (row j when rows is NULL). The table goes to the device and
 * the kernel gathers through it; only the rows up to the largest index are uploaded. */
static void cuda_attention_rows(const pdm_kern_attn_t *a, const int32_t *rows)
{
    if (a->head_dim > 256 || a->n_q <= 0 || a->n_kv <= 0) {
        pdm_kern_ops_generic.attention_rows(a, rows);
        return;
    }
    int64_t n_rows = a->n_kv;
    if (rows) {
        n_rows = 0;
        for (int j = 0; j < a->n_kv; j++)
            if (rows[j] + 1 > n_rows) n_rows = rows[j] + 1;
    }
    pthread_mutex_lock(&pdm_cuda_lock);
    size_t esz = a->kv_type == PDM_DT_F16 ? 2 : a->kv_type == PDM_DT_I8 ? 1 : 4;
    size_t hd = (size_t)a->head_dim;
    size_t qbytes = ((size_t)(a->n_q - 1) * a->q_stride + hd) * 4;
    const float *dq = (const float *)upload(0, a->q, qbytes);
    const int32_t *dpos = (const int32_t *)upload(1, a->q_pos, (size_t)a->n_q * 4);
    const void *dk = upload(2, a->k, (size_t)n_rows * hd * esz);
    const void *dv = upload(3, a->v, (size_t)n_rows * hd * esz);
    float *dout = (float *)scratch(4, (size_t)a->n_q * hd * 4);
    float *dlse = (float *)scratch(5, (size_t)a->n_q * 4);
    const int32_t *drows = rows ? (const int32_t *)upload(6, rows, (size_t)a->n_kv * 4) : NULL;
    if (dq && dpos && dk && dv && dout && dlse && (drows || !rows)) {
        k_attention<<<a->n_q, 32>>>(dq, a->q_stride, dpos, dk, dv, a->kv_type, a->k_scale,
                                    a->v_scale, a->k_pos0, a->n_kv, a->head_dim, a->scale,
                                    a->causal, a->window, dout, dlse, drows);
        PDM_CUDA_CHECK(cudaGetLastError());
        float *ho = (float *)malloc((size_t)a->n_q * hd * 4), *hl = (float *)malloc((size_t)a->n_q * 4);
        if (ho && hl) {
            download(ho, dout, (size_t)a->n_q * hd * 4);
            download(hl, dlse, (size_t)a->n_q * 4);
            for (int i = 0; i < a->n_q; i++) {
                memcpy(a->o + (size_t)i * a->o_stride, ho + (size_t)i * hd, hd * 4);
                a->lse[(size_t)i * a->lse_stride] = hl[i];
            }
        }
        free(ho);
        free(hl);
    }
    pthread_mutex_unlock(&pdm_cuda_lock);
}

static void cuda_attention(const pdm_kern_attn_t *a) { cuda_attention_rows(a, NULL); }

/* The merge is O(head_dim) per row: a kernel launch and two copies would cost more than the
 * work, so it shares the reference's host code (as the CPU SIMD variants do). */
static void cuda_attn_merge(float *o1, float *lse1, const float *o2, float lse2, int n)
{
    pdm_kern__attn_merge_generic(o1, lse1, o2, lse2, n);
}

static void cuda_kv_store(pdm_dtype_t type, const float *src, void *dst, int n)
{
    if (type != PDM_DT_F16) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    pthread_mutex_lock(&pdm_cuda_lock);
    const float *ds = (const float *)upload(0, src, (size_t)n * 4);
    uint16_t *dd = (uint16_t *)scratch(1, (size_t)n * 2);
    if (ds && dd && n > 0) {
        k_kv_store_f16<<<(n + 255) / 256, 256>>>(ds, dd, n);
        PDM_CUDA_CHECK(cudaGetLastError());
        download(dst, dd, (size_t)n * 2);
    }
    pthread_mutex_unlock(&pdm_cuda_lock);
}

/* The generalised RoPE is O(head_dim) per head like the merge: the host reference. */
static void cuda_rope_ext(float *x, int n_heads, int head_dim, int32_t pos,
                          const pdm_kern_rope_t *r)
{
    pdm_kern__rope_ext_generic(x, n_heads, head_dim, pos, r);
}

static void cuda_geglu(float *out, const float *gate, const float *up, int n)
{
    pthread_mutex_lock(&pdm_cuda_lock);
    const float *dg = (const float *)upload(0, gate, (size_t)n * 4);
    const float *du = (const float *)upload(1, up, (size_t)n * 4);
    float *dout = (float *)scratch(2, (size_t)n * 4);
    if (dg && du && dout && n > 0) {
        k_geglu<<<(n + 255) / 256, 256>>>(dout, dg, du, n);
        PDM_CUDA_CHECK(cudaGetLastError());
        download(out, dout, (size_t)n * 4);
    }
    pthread_mutex_unlock(&pdm_cuda_lock);
}

static const pdm_kern_ops_t pdm_kern_ops_cuda_table = {
    "cuda",         cuda_act_bytes, cuda_act_convert, cuda_matmul,     cuda_rmsnorm,
    cuda_rope,      cuda_swiglu,    cuda_attention,   cuda_attn_merge, cuda_kv_store,
    cuda_attention_rows, cuda_rope_ext, cuda_geglu,
};

extern "C" const pdm_kern_ops_t *pdm_kern_ops_cuda(char *why, size_t why_len)
{
    int n = 0;
    cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess || n == 0) {
        if (why)
            snprintf(why, why_len, "no CUDA device (%s)",
                     err != cudaSuccess ? cudaGetErrorString(err) : "0 devices");
        return NULL;
    }
    return pdm_cuda_failed ? NULL : &pdm_kern_ops_cuda_table;
}

extern "C" void pdm_kern_cuda_release(void)
{
    pthread_mutex_lock(&pdm_cuda_lock);
    for (int i = 0; i < pdm_cuda_n_weights; i++) cudaFree(pdm_cuda_weights[i].dev);
    pdm_cuda_n_weights = 0;
    for (int s = 0; s < PDM_CUDA_SLOTS; s++) {
        cudaFree(pdm_cuda_slot[s]);
        pdm_cuda_slot[s] = NULL;
        pdm_cuda_slot_bytes[s] = 0;
    }
    pthread_mutex_unlock(&pdm_cuda_lock);
}
