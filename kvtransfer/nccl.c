/*
 * nccl.c - the group transport of CUDA builds: point-to-point NCCL operations between the
 * ranks of a prefill group, for KV that lives in GPU memory.
 *
 * NCCL has no tags: sends and receives between two ranks match in the order they are posted,
 * which the prefill methods respect (per layer, per ring step, in program order on every
 * rank). Each pattern (chain step, ring step, all-gather, all-to-all) is one ncclGroupStart /
 * ncclGroupEnd on the communicator's stream, followed by an event; waiting polls the event
 * and the communicator's asynchronous error until the deadline, and aborts the communicator
 * (ncclCommAbort, the only way to stop NCCL operations that wait for a dead peer) when the
 * deadline passes. The communicator is non-blocking (config.blocking = 0) so that init and
 * abort cannot hang either.
 *
 * Compiled only in CUDA builds (make cuda / make cuda-check); the CPU build uses ucx.c.
 */
#include <cuda_runtime_api.h>
/* nccl.h declares a few functions without prototypes (f() instead of f(void)). */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstrict-prototypes"
#include <nccl.h>
#pragma GCC diagnostic pop
#include <sched.h>
#include <stdlib.h>
#include <string.h>

#include "common/pdm.h"
#include "kvtransfer/kvtransfer.h"

struct pdm_kvt_nccl {
    ncclComm_t comm;
    cudaStream_t stream;
    int rank, size, device;
    double timeout;
    int aborted;
};

/* Waits until the communicator leaves ncclInProgress (non-blocking init/group calls). */
static int pdm__nccl_settle(pdm_kvt_nccl_t *c, double deadline, const char *what)
{
    ncclResult_t async;
    for (;;) {
        if (ncclCommGetAsyncError(c->comm, &async) != ncclSuccess)
            return pdm_error_set(PDM_EPEER, "nccl: %s: cannot query the communicator", what);
        if (async == ncclSuccess) return PDM_OK;
        if (async != ncclInProgress)
            return pdm_error_set(PDM_EPEER, "nccl: %s: %s", what, ncclGetErrorString(async));
        if (pdm_now() > deadline) return pdm_error_set(PDM_ETIMEOUT, "nccl: %s timed out", what);
        sched_yield();
    }
}

int pdm_kvt_nccl_unique_id(uint8_t id[PDM_KVT_NCCL_ID_BYTES])
{
    ncclUniqueId uid;
    ncclResult_t r = ncclGetUniqueId(&uid);
    if (r != ncclSuccess)
        return pdm_error_set(PDM_EIO, "nccl: unique id: %s", ncclGetErrorString(r));
    memcpy(id, uid.internal, PDM_KVT_NCCL_ID_BYTES);
    return PDM_OK;
}

int pdm_kvt_nccl_create(const uint8_t id[PDM_KVT_NCCL_ID_BYTES], int rank, int size, int device,
                        double timeout, pdm_kvt_nccl_t **out)
{
    if (size < 1 || rank < 0 || rank >= size || !(timeout > 0))
        return pdm_error_set(PDM_EINVAL, "nccl: bad rank %d of %d or timeout", rank, size);
    int n_dev = 0;
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0)
        return pdm_error_set(PDM_EUNSUPPORTED, "nccl: no CUDA device");
    if (device < 0 || device >= n_dev)
        return pdm_error_set(PDM_EINVAL, "nccl: no CUDA device %d (%d present)", device, n_dev);
    pdm_kvt_nccl_t *c = calloc(1, sizeof(*c));
    if (!c) return pdm_error_set(PDM_ENOMEM, "nccl: out of memory");
    c->rank = rank;
    c->size = size;
    c->device = device;
    c->timeout = timeout;
    int st;
    if (cudaSetDevice(device) != cudaSuccess ||
        cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking) != cudaSuccess) {
        st = pdm_error_set(PDM_EIO, "nccl: cannot set up device %d", device);
        goto err_free;
    }
    ncclUniqueId uid;
    memcpy(uid.internal, id, PDM_KVT_NCCL_ID_BYTES);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclResult_t r = ncclCommInitRankConfig(&c->comm, size, uid, rank, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
        st = pdm_error_set(PDM_EPEER, "nccl: init: %s", ncclGetErrorString(r));
        goto err_stream;
    }
    st = pdm__nccl_settle(c, pdm_now() + timeout, "init");
    if (st) goto err_comm;
    *out = c;
    return PDM_OK;

err_comm:
    ncclCommAbort(c->comm);
err_stream:
    cudaStreamDestroy(c->stream);
err_free:
    free(c);
    return st;
}

void pdm_kvt_nccl_destroy(pdm_kvt_nccl_t *c)
{
    if (!c) return;
    if (!c->aborted) {
        ncclCommFinalize(c->comm);
        if (pdm__nccl_settle(c, pdm_now() + c->timeout, "finalize") == PDM_OK)
            ncclCommDestroy(c->comm);
        else
            ncclCommAbort(c->comm);
    }
    cudaStreamDestroy(c->stream);
    free(c);
}

int pdm_kvt_nccl_post(pdm_kvt_nccl_t *c, const pdm_kvt_nccl_op_t *ops, int n_ops,
                      pdm_kvt_nccl_req_t *req)
{
    if (c->aborted) return pdm_error_set(PDM_EPEER, "nccl: the communicator was aborted");
    for (int i = 0; i < n_ops; i++)
        if (ops[i].peer < 0 || ops[i].peer >= c->size || ops[i].peer == c->rank)
            return pdm_error_set(PDM_EINVAL, "nccl: no peer rank %d", ops[i].peer);
    cudaEvent_t ev;
    if (cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) != cudaSuccess)
        return pdm_error_set(PDM_ENOMEM, "nccl: cannot create an event");
    ncclResult_t r = ncclGroupStart();
    for (int i = 0; i < n_ops && r == ncclSuccess; i++) {
        if (ops[i].bytes == 0) continue;
        r = ops[i].is_send
                ? ncclSend(ops[i].buf, ops[i].bytes, ncclUint8, ops[i].peer, c->comm, c->stream)
                : ncclRecv(ops[i].buf, ops[i].bytes, ncclUint8, ops[i].peer, c->comm, c->stream);
    }
    ncclResult_t end = ncclGroupEnd();
    if (r == ncclSuccess) r = end;
    if (r != ncclSuccess && r != ncclInProgress) {
        cudaEventDestroy(ev);
        return pdm_error_set(PDM_EPEER, "nccl: posting %d operations: %s", n_ops,
                             ncclGetErrorString(r));
    }
    if (cudaEventRecord(ev, c->stream) != cudaSuccess) {
        cudaEventDestroy(ev);
        return pdm_error_set(PDM_EIO, "nccl: cannot record an event");
    }
    *req = (pdm_kvt_nccl_req_t)ev;
    return PDM_OK;
}

int pdm_kvt_nccl_wait(pdm_kvt_nccl_t *c, pdm_kvt_nccl_req_t req, double deadline)
{
    cudaEvent_t ev = (cudaEvent_t)req;
    int st = PDM_OK;
    for (;;) {
        cudaError_t q = cudaEventQuery(ev);
        if (q == cudaSuccess) break;
        if (q != cudaErrorNotReady) {
            st = pdm_error_set(PDM_EIO, "nccl: %s", cudaGetErrorString(q));
            break;
        }
        ncclResult_t async;
        if (ncclCommGetAsyncError(c->comm, &async) == ncclSuccess && async != ncclSuccess &&
            async != ncclInProgress) {
            st = pdm_error_set(PDM_EPEER, "nccl: %s", ncclGetErrorString(async));
            break;
        }
        if (pdm_now() > deadline) {
            st = pdm_error_set(PDM_ETIMEOUT, "nccl: operations timed out (a peer is gone or "
                               "stuck); aborting the communicator");
            break;
        }
        sched_yield();
    }
    if (st) {
        /* NCCL kernels waiting for a dead peer never finish: abort is the only way out. The
         * group must be re-created (a new unique id through the control plane). */
        ncclCommAbort(c->comm);
        c->aborted = 1;
    }
    cudaEventDestroy(ev);
    return st;
}
