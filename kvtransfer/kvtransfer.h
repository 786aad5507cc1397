/*
 * kvtransfer.h - pdmesh's communication layer.
 *
 * Two levels:
 *   - pdm_kvt_t: one communication endpoint per process (a UCX worker in CPU builds), peers
 *     connected by address exchanged out of band, and tagged non-blocking sends and receives
 *     of scatter/gather lists that complete in the background. Every wait has a deadline; a
 *     peer that fails or misses a deadline is closed and every operation on it fails with
 *     PDM_EPEER or PDM_ETIMEOUT instead of hanging.
 *   - pdm_kvt_group_t: R ranks of one prefill group and the patterns the prefill methods use:
 *     point-to-point chain send/receive (KV-Runahead), ring shift (context parallelism),
 *     all-gather (TSP) and all-to-all (pass-Q).
 *
 * Thread model: the transport runs its own progress thread (default) that sleeps on the
 * worker's event fd, so sends and receives advance while the caller computes. Operations may
 * be posted and waited on from any one thread at a time per handle.
 *
 * Buffers handed to pdm_kvt_isend/irecv belong to the transport until the operation's wait
 * returns (whatever it returns).
 */
#ifndef PDM_KVTRANSFER_H
#define PDM_KVTRANSFER_H

#include <stddef.h>
#include <stdint.h>

typedef struct pdm_kvt pdm_kvt_t;

/* A contiguous piece of a message; a message is a list of them (gathered on send, scattered
 * on receive). */
typedef struct {
    void *base;
    size_t len;
} pdm_kvt_iov_t;

#define PDM_KVT_MAX_IOV 128 /* pieces per message */

typedef struct {
    int max_requests;    /* bound on operations in flight (default 1024) */
    int progress_thread; /* 1 (default): a thread drives progress; 0: the caller does */
} pdm_kvt_params_t;

void pdm_kvt_params_default(pdm_kvt_params_t *p);

/* Creates the endpoint (UCX context, worker, progress thread). Transport selection follows
 * the usual UCX_* environment variables (UCX_TLS, UCX_NET_DEVICES, ...). */
int pdm_kvt_create(const pdm_kvt_params_t *p, pdm_kvt_t **out);
/* Fails every outstanding operation, closes every peer and frees everything. NULL is fine. */
void pdm_kvt_destroy(pdm_kvt_t *kvt);

/* This endpoint's address (opaque bytes, valid until destroy) to give to peers. */
void pdm_kvt_address(const pdm_kvt_t *kvt, const void **addr, size_t *len);

/* Connects to a peer by its address; *peer receives a small integer naming it. */
int pdm_kvt_connect(pdm_kvt_t *kvt, const void *addr, size_t len, int *peer);
/* 1 while the peer has not failed. */
int pdm_kvt_peer_alive(pdm_kvt_t *kvt, int peer);
/* Declares a peer failed: closes its endpoint at once and fails its operations. */
void pdm_kvt_peer_fail(pdm_kvt_t *kvt, int peer, const char *why);

/* A handle on an operation in flight. */
typedef int32_t pdm_kvt_req_t;
#define PDM_KVT_REQ_NONE ((pdm_kvt_req_t)-1)

/* Posts a send of the concatenation of `iov` to `peer` under `tag`. */
int pdm_kvt_isend(pdm_kvt_t *kvt, int peer, uint64_t tag, const pdm_kvt_iov_t *iov, int n_iov,
                  pdm_kvt_req_t *req);
/* Posts a receive of a message from `peer` with exactly `tag`, scattered into `iov`. A
 * message longer than the buffers fails with PDM_EOVERFLOW. */
int pdm_kvt_irecv(pdm_kvt_t *kvt, int peer, uint64_t tag, const pdm_kvt_iov_t *iov, int n_iov,
                  pdm_kvt_req_t *req);
/* Waits until the operation completes or `deadline` (pdm_now() seconds) passes, then
 * releases the handle. On success *bytes (may be NULL) is the message length. On timeout the
 * peer is declared failed (PDM_ETIMEOUT). Never blocks past the deadline by more than a
 * short grace period for the transport to let go of the buffers. */
int pdm_kvt_wait(pdm_kvt_t *kvt, pdm_kvt_req_t req, double deadline, size_t *bytes);
/* Waits for all `n` handles (PDM_KVT_REQ_NONE entries are skipped) and releases every one
 * of them, also on error; returns the first error. */
int pdm_kvt_wait_all(pdm_kvt_t *kvt, pdm_kvt_req_t *reqs, int n, double deadline);

/* For callers that drive progress themselves (progress_thread = 0), e.g. from a libuv loop:
 * pdm_kvt_progress until it returns 0, then pdm_kvt_arm; if arm returns PDM_EAGAIN-like
 * "busy" (1), progress again; else poll the fd. */
int pdm_kvt_progress(pdm_kvt_t *kvt);
int pdm_kvt_event_fd(pdm_kvt_t *kvt, int *fd);
int pdm_kvt_arm(pdm_kvt_t *kvt);

typedef struct {
    uint64_t bytes_sent, bytes_received;
    uint64_t sends, receives;
    uint64_t failures;
} pdm_kvt_stats_t;
void pdm_kvt_stats(pdm_kvt_t *kvt, pdm_kvt_stats_t *out);
/* A one-line description of the transports UCX chose towards `peer` (for logs and
 * benchmarks); empty if unknown. */
void pdm_kvt_peer_transports(pdm_kvt_t *kvt, int peer, char *buf, size_t size);

/* ---- Groups --------------------------------------------------------------------------- */

/* Tags carry (kind, source rank, task, layer, step) so that messages of different layers,
 * ring steps and tasks can never be confused, and stale messages of an aborted task match
 * nothing. */
typedef enum {
    PDM_KVT_KIND_BARRIER = 1,
    PDM_KVT_KIND_CHAIN = 2,  /* KV-Runahead: rank i -> i+1 */
    PDM_KVT_KIND_GATHER = 3, /* TSP all-gather */
    PDM_KVT_KIND_RING = 4,   /* ring shift */
    PDM_KVT_KIND_A2A = 5,    /* all-to-all */
    PDM_KVT_KIND_RESULT = 6,
    PDM_KVT_KIND_PING = 7    /* calibration ping-pong */
} pdm_kvt_kind_t;

static inline uint64_t pdm_kvt_tag(pdm_kvt_kind_t kind, int src_rank, uint32_t task, int layer,
                                   int step)
{
    return ((uint64_t)(kind & 0xff) << 56) | ((uint64_t)(src_rank & 0xff) << 48) |
           ((uint64_t)(task & 0xffff) << 32) | ((uint64_t)(layer & 0xffff) << 16) |
           (uint64_t)(step & 0xffff);
}

#define PDM_KVT_MAX_RANKS 64

typedef struct {
    pdm_kvt_t *kvt;
    int rank, size;
    int peer[PDM_KVT_MAX_RANKS]; /* kvt peer of each rank (-1 for ourselves) */
    uint32_t task;               /* current task id, part of every tag */
    double timeout;              /* seconds allowed for each collective */
} pdm_kvt_group_t;

/* Connects to every other rank given all ranks' addresses (index = rank) and exchanges a
 * barrier message with each so that connections are established before timing starts. */
int pdm_kvt_group_init(pdm_kvt_group_t *g, pdm_kvt_t *kvt, int rank, int size,
                       const void *const *addrs, const size_t *lens, double timeout);
void pdm_kvt_group_fini(pdm_kvt_group_t *g);

int pdm_kvt_group_send(pdm_kvt_group_t *g, int dst, pdm_kvt_kind_t kind, int layer, int step,
                       const pdm_kvt_iov_t *iov, int n_iov, pdm_kvt_req_t *req);
int pdm_kvt_group_recv(pdm_kvt_group_t *g, int src, pdm_kvt_kind_t kind, int layer, int step,
                       const pdm_kvt_iov_t *iov, int n_iov, pdm_kvt_req_t *req);

/* Barrier over all ranks (each sends one small message to every other and waits). */
int pdm_kvt_group_barrier(pdm_kvt_group_t *g, int step);

/* All-gather with per-rank pieces: rank r contributes parts[r] (its own, read) and receives
 * parts[j] for every j != r (written). Blocking, bounded by the group timeout. */
typedef struct {
    pdm_kvt_iov_t iov[PDM_KVT_MAX_IOV];
    int n_iov;
} pdm_kvt_msg_t;
int pdm_kvt_group_allgather(pdm_kvt_group_t *g, int layer, const pdm_kvt_msg_t *parts);
/* All-to-all: rank r sends send[j] to every j != r and receives recv[j] from every j != r. */
int pdm_kvt_group_alltoall(pdm_kvt_group_t *g, int layer, const pdm_kvt_msg_t *send,
                           const pdm_kvt_msg_t *recv);

/* Deadline of a collective started now. */
double pdm_kvt_group_deadline(const pdm_kvt_group_t *g);

/* ---- NCCL (CUDA builds) ----------------------------------------------------------------- *
 * The same group patterns over NCCL for KV in GPU memory (kvtransfer/nccl.c, built by
 * `make cuda`). NCCL matches sends and receives by order per pair of ranks, not by tag; the
 * prefill methods post in the same order on every rank. The unique id comes from rank 0 and
 * travels through the control plane. */
#define PDM_KVT_NCCL_ID_BYTES 128

typedef struct pdm_kvt_nccl pdm_kvt_nccl_t;
typedef void *pdm_kvt_nccl_req_t;

typedef struct {
    int peer;     /* rank */
    int is_send;
    void *buf;    /* device memory */
    size_t bytes;
} pdm_kvt_nccl_op_t;

int pdm_kvt_nccl_unique_id(uint8_t id[PDM_KVT_NCCL_ID_BYTES]);
/* Joins the group on CUDA device `device`; PDM_EUNSUPPORTED without a device. */
int pdm_kvt_nccl_create(const uint8_t id[PDM_KVT_NCCL_ID_BYTES], int rank, int size, int device,
                        double timeout, pdm_kvt_nccl_t **out);
void pdm_kvt_nccl_destroy(pdm_kvt_nccl_t *c);
/* Posts the operations as one NCCL group on the communicator's stream. */
int pdm_kvt_nccl_post(pdm_kvt_nccl_t *c, const pdm_kvt_nccl_op_t *ops, int n_ops,
                      pdm_kvt_nccl_req_t *req);
/* Waits for a posted group until `deadline`; on timeout or peer error the communicator is
 * aborted (PDM_ETIMEOUT / PDM_EPEER) and must be re-created. Releases `req`. */
int pdm_kvt_nccl_wait(pdm_kvt_nccl_t *c, pdm_kvt_nccl_req_t req, double deadline);

#endif /* PDM_KVTRANSFER_H */
