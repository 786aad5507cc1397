/*
 * offload_cuda.cu - KV tier backends for CUDA builds (HeadInfer §4, Fig. 4: the fast tier is
 * GPU memory, the slow tier pinned host memory so copies run as DMA over PCIe).
 *
 * pdm_kvtier_cuda_device_ops: cudaMalloc / cudaFree; pdm_kvtier_cuda_host_ops: cudaHostAlloc
 * (pinned, portable) / cudaFreeHost. Both copy with cudaMemcpyAsync on one copy stream of the
 * calling thread and wait for it: the offload worker thread calls copy, so the compute thread
 * never waits for the copy except through the worker's job ids (offload.c), which is the role
 * CUDA events play on a GPU pipeline. Built by `make cuda` / checked by `make cuda-check`; the
 * engine keeps using RAM tiers until the CUDA engine runs attention on device pointers.
 */
#include <cuda_runtime.h>
#include <stdio.h>

extern "C" {
#include "decode_node/offload.h"
}

static int pdm__cuda_dev_alloc(pdm_kvtier_t *t, size_t bytes, void **out)
{
    (void)t;
    cudaError_t e = cudaMalloc(out, bytes ? bytes : 1);
    if (e != cudaSuccess)
        return pdm_error_set(PDM_ENOMEM, "KV tier cuda: cudaMalloc of %zu bytes: %s", bytes,
                             cudaGetErrorString(e));
    return PDM_OK;
}

static void pdm__cuda_dev_release(pdm_kvtier_t *t, void *p, size_t bytes)
{
    (void)t;
    (void)bytes;
    cudaFree(p);
}

static int pdm__cuda_host_alloc(pdm_kvtier_t *t, size_t bytes, void **out)
{
    (void)t;
    cudaError_t e = cudaHostAlloc(out, bytes ? bytes : 1, cudaHostAllocPortable);
    if (e != cudaSuccess)
        return pdm_error_set(PDM_ENOMEM, "KV tier cuda-host: cudaHostAlloc of %zu bytes: %s",
                             bytes, cudaGetErrorString(e));
    return PDM_OK;
}

static void pdm__cuda_host_release(pdm_kvtier_t *t, void *p, size_t bytes)
{
    (void)t;
    (void)bytes;
    cudaFreeHost(p);
}

/* One non-blocking copy stream per thread (the offload worker). */
static thread_local cudaStream_t pdm__copy_stream;

static void pdm__cuda_copy(void *dst, const void *src, size_t bytes)
{
    if (!pdm__copy_stream &&
        cudaStreamCreateWithFlags(&pdm__copy_stream, cudaStreamNonBlocking) != cudaSuccess) {
        fprintf(stderr, "pdmesh: KV tier cuda: cannot create a copy stream\n");
        return;
    }
    /* Unified addressing: the direction follows from the pointers. */
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, pdm__copy_stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(pdm__copy_stream);
    if (e != cudaSuccess)
        fprintf(stderr, "pdmesh: KV tier cuda: copy of %zu bytes: %s\n", bytes,
                cudaGetErrorString(e));
}

static const pdm_kvtier_ops_t pdm__cuda_device_ops = {"cuda", pdm__cuda_dev_alloc,
                                                      pdm__cuda_dev_release, pdm__cuda_copy};
static const pdm_kvtier_ops_t pdm__cuda_host_ops = {"cuda-host", pdm__cuda_host_alloc,
                                                    pdm__cuda_host_release, pdm__cuda_copy};

extern "C" const pdm_kvtier_ops_t *pdm_kvtier_cuda_device_ops(void) { return &pdm__cuda_device_ops; }
extern "C" const pdm_kvtier_ops_t *pdm_kvtier_cuda_host_ops(void) { return &pdm__cuda_host_ops; }
