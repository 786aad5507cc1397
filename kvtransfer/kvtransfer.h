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
    int max_requests;    /* bound on operations in flight (default 16384) */
    int progress_thread; /* 1 (default): a thread drives progress; 0: the caller does */
} pdm_kvt_params_t;

void pdm_kvt_params_default(pdm_kvt_params_t *p);

/* Where the KV plane listens, for the pdm_kvt_create calls that follow: `devices` is a UCX
 * device list ("lo", "eth0", "mlx5_0:1,eth0") and becomes UCX_NET_DEVICES; NULL leaves UCX's
 * choice (UCX_NET_DEVICES if set, else every interface: the transport is reachable from
 * anywhere that can reach the machine). PDM_EINVAL for a malformed list. */
int pdm_kvt_listen_on(const char *devices);

/* Creates the endpoint (UCX context, worker, progress thread). Transport selection follows
 * the usual UCX_* environment variables (UCX_TLS, UCX_NET_DEVICES, ...). */
int pdm_kvt_create(const pdm_kvt_params_t *p, pdm_kvt_t **out);
/* Fails every outstanding operation, closes every peer and frees everything. NULL is fine. */
void pdm_kvt_destroy(pdm_kvt_t *kvt);

/* This endpoint's address (opaque bytes, valid until destroy) to give to peers. */
void pdm_kvt_address(const pdm_kvt_t *kvt, const void **addr, size_t *len);

/* Connects to a peer by its address; *peer receives a small integer naming it. */
int pdm_kvt_connect(pdm_kvt_t *kvt, const void *addr, size_t len, int *peer);
/* The live peer already connected to this address, or a new connection (a failed peer is
 * never returned: a process that comes back on the same address after a partition, or whose
 * endpoint failed, gets a fresh endpoint). Failed peers' slots are reused once closed. */
int pdm_kvt_connect_cached(pdm_kvt_t *kvt, const void *addr, size_t len, int *peer);
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
/* Non-blocking: 1 and the handle released if the operation completed successfully (*bytes
 * set), 0 while it runs, a negative status (handle released) if it failed. */
int pdm_kvt_test(pdm_kvt_t *kvt, pdm_kvt_req_t req, size_t *bytes);
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
/* The same counters for the traffic with one peer. */
int pdm_kvt_peer_stats(pdm_kvt_t *kvt, int peer, pdm_kvt_stats_t *out);
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
    PDM_KVT_KIND_PING = 7,   /* calibration ping-pong */
    PDM_KVT_KIND_ALLREDUCE = 9, /* all-reduce (8 is the KV stream's kind) */
    PDM_KVT_KIND_ORDER = 10,    /* the group's task order, rank 0 -> the others */
    PDM_KVT_KIND_ORDER_TASK = 11, /* the task of an order entry */
    PDM_KVT_KIND_JOIN = 12        /* forming a group (group.c) */
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
    uint32_t nonce;              /* this formation's name: rank 0's random number, shared at
                                  * init (tags of traffic that must not reach a later
                                  * formation of the same ranks) */
} pdm_kvt_group_t;

/* Connects to every other rank given all ranks' addresses (index = rank) and forms the group:
 * a handshake between rank 0 and each other rank that only this attempt's random numbers
 * complete (a message left over from an earlier attempt of the same processes is skipped),
 * then a barrier of every rank, so that connections are established before timing starts.
 * Every rank ends with rank 0's nonce. */
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

/* All-reduce (max) of `n` floats (n <= 256): on return every rank's `values` holds the
 * element-wise maximum over all ranks, identical bits everywhere (each rank takes the max of
 * the same R vectors). Blocking, bounded by the group timeout. `step` tells concurrent
 * reductions of one layer apart. */
int pdm_kvt_group_allreduce_max(pdm_kvt_group_t *g, int layer, int step, float *values, int n);

/* Deadline of a collective started now. */
double pdm_kvt_group_deadline(const pdm_kvt_group_t *g);

/* ---- KV streaming: prefill ranks -> decode node ---------------------------------------- *
 * A request's KV travels as blocks: one (layer, kv head, token range) each, sent as a 64-byte
 * header, its K rows and its V rows (three contiguous messages under one block tag). The
 * decode node posts tagged receives for every block it expects: the header into its own
 * table and the rows straight into their final place in its KV cache (no intermediate copy).
 * A block is accepted only if its header names the right request, attempt, layer, head, range, dtype and row size, the
 * XXH3-64 of its rows matches and, on a keyed stream, its MAC verifies (a forged block fails
 * the request: it may have landed in the reserved, not yet used, destination); the request is accepted only when every (layer, head, token) is
 * covered exactly once. Blocks of another attempt carry another tag, so they can never land in
 * this attempt's memory; they are drained and counted as stale. */

#define PDM_KVT_BLOCK_MAGIC 0x31564b50u /* "PKV1" */

typedef struct {
    uint32_t magic;
    uint16_t version;  /* 1 */
    uint16_t dtype;    /* pdm dtype id of the rows */
    uint64_t request_id;
    uint32_t attempt;
    uint32_t layer;
    uint32_t head;
    int32_t token_start; /* first token (position within the request's KV) */
    int32_t n_tokens;
    uint32_t row_bytes;  /* bytes of one token's K (or V) row of one head */
    float scale;         /* quantization scale of int8 KV's K rows; 1 otherwise */
    uint32_t chunk;      /* index of the token range in the request's plan */
    uint64_t checksum;   /* XXH3-64 of the K rows then the V rows, seed = request_id */
    float v_scale;       /* quantization scale of int8 KV's V rows; 1 otherwise */
    uint8_t reserved[4];
    uint8_t mac[16];     /* HMAC-SHA256 (truncated) of this header with mac zeroed, keyed by the
                          * request's KV key; it covers the rows through `checksum`. All zero
                          * on an unkeyed stream */
} pdm_kvt_block_header_t;

/* A request's KV key: 32 random bytes the router gives both ends of one request attempt over
 * the authenticated control plane (DecodeTask.kv_key, PrefillTask.kv_key). A receiver with a
 * key accepts only blocks whose header MAC it verifies, so a peer that was not introduced for
 * the request cannot place KV in it, even knowing the tags and the checksum. */
#define PDM_KVT_KEY_BYTES 32

#define PDM_KVT_DTYPE_I8 24 /* int8 KV ("q8", kernels.h PDM_DT_I8): rows carry scales */

/* Tag of a block's piece: kind 8 | request 20 | attempt 8 | layer 10 | piece 2 | head 8 |
 * chunk 8 bits. A block travels as three contiguous messages (header, K rows, V rows): UCX
 * 1.13 has no zero-copy rendezvous for non-contiguous (iov) messages and would copy every
 * byte through bounce buffers (openucx/ucx#1180); contiguous pieces go zero-copy. */
#define PDM_KVT_KIND_STREAM 8
enum { PDM_KVT_PIECE_HEADER = 0, PDM_KVT_PIECE_K = 1, PDM_KVT_PIECE_V = 2, PDM_KVT_PIECES = 3 };
#define PDM_KVT_STREAM_MAX_LAYERS 1024
static inline uint64_t pdm_kvt_stream_tag(uint64_t request_id, uint32_t attempt, uint32_t layer,
                                          uint32_t head, uint32_t chunk)
{
    return ((uint64_t)PDM_KVT_KIND_STREAM << 56) | ((request_id & 0xfffff) << 36) |
           ((uint64_t)(attempt & 0xff) << 28) | ((uint64_t)(layer & 0x3ff) << 18) |
           ((uint64_t)(head & 0xff) << 8) | (chunk & 0xff);
}
static inline uint64_t pdm_kvt_stream_piece_tag(uint64_t block_tag, int piece)
{
    return block_tag | ((uint64_t)(piece & 3) << 16);
}
/* Mask selecting a request's blocks of one attempt / of any attempt. */
#define PDM_KVT_STREAM_MASK_ATTEMPT 0xfffffffff0000000ull
#define PDM_KVT_STREAM_MASK_REQUEST 0xfffffff000000000ull

/* XXH3-64 (seed = request id) of a block's K rows then V rows: what the header's checksum
 * holds. Uses the AVX2 build when the CPU has it; _generic is the baseline build (same value). */
uint64_t pdm_kvt_block_checksum(uint64_t request_id, const void *k, const void *v, size_t bytes);
uint64_t pdm_kvt_block_checksum_generic(uint64_t request_id, const void *k, const void *v,
                                        size_t bytes);

/* A block the decode node expects (the plan: which rank sends which token range). */
typedef struct {
    int peer;          /* kvt peer of the sending rank */
    uint32_t layer, head, chunk;
    int32_t token_start, n_tokens;
} pdm_kvt_stream_block_t;

typedef struct {
    uint64_t request_id;
    uint32_t attempt;
    uint32_t n_layers, n_kv_heads;
    uint16_t dtype;
    size_t row_bytes;
    int32_t n_tokens;                /* the request's tokens: all from token_from on must be
                                      * covered once */
    int32_t token_from;              /* rows [0, token_from) are not streamed (the caller has
                                      * them: a decode node's prefix pool); no block may start
                                      * before it. 0: every row comes in blocks */
    void *const *k, *const *v;       /* [n_layers * n_kv_heads] destination of token 0's row */
    float *scales;                   /* int8 KV: [n_layers * n_kv_heads][2] receives each
                                      * head's K and V scale from the headers (every block of
                                      * a head must carry the same ones); NULL otherwise */
    const pdm_kvt_stream_block_t *blocks;
    int n_blocks;
    const uint8_t *key;              /* [PDM_KVT_KEY_BYTES] the request's KV key (copied), or
                                      * NULL: blocks are not authenticated */
} pdm_kvt_stream_rx_params_t;

typedef struct pdm_kvt_stream_rx pdm_kvt_stream_rx_t;

typedef struct {
    uint64_t bytes;      /* payload bytes accepted */
    int blocks;          /* blocks accepted */
    int stale;           /* messages of other attempts drained */
    int duplicates;      /* extra messages of this attempt drained */
    int forged;          /* blocks refused because their MAC did not verify (keyed streams) */
    double seconds;      /* from start to the last block */
} pdm_kvt_stream_stats_t;

/* Checks that the blocks cover every (layer, head, token >= token_from) exactly once and fit
 * the destinations, then posts a receive for each. PDM_EINVAL names the first gap or overlap. */
int pdm_kvt_stream_rx_start(pdm_kvt_t *kvt, const pdm_kvt_stream_rx_params_t *p,
                            pdm_kvt_stream_rx_t **out);
/* Waits for every block until `deadline` and verifies each one (PDM_ECHECKSUM, PDM_EFORMAT
 * with a message naming the block and the sender; PDM_ETIMEOUT naming what is missing). */
int pdm_kvt_stream_rx_wait(pdm_kvt_stream_rx_t *rx, double deadline);
/* Non-blocking progress of a receiving request: 1 when every block arrived and verified, 0
 * while some are missing, a negative status (as rx_wait) on the first bad block. */
int pdm_kvt_stream_rx_poll(pdm_kvt_stream_rx_t *rx);
/* Drains messages addressed to this request that were not consumed: stale attempts and
 * duplicates (counted in the stats); returns the number of duplicates of this attempt. */
int pdm_kvt_stream_rx_drain(pdm_kvt_stream_rx_t *rx);
void pdm_kvt_stream_rx_stats(const pdm_kvt_stream_rx_t *rx, pdm_kvt_stream_stats_t *out);
/* Cancels every receive still posted, waits until the transport lets go of the destination
 * memory, drains leftovers and frees everything. NULL is fine. */
void pdm_kvt_stream_rx_destroy(pdm_kvt_stream_rx_t *rx);

/* Sender side: at most `max_in_flight` blocks outstanding (flow control: a slow receiver
 * blocks the sender instead of making it buffer); rows are sent from where they are. */
typedef struct pdm_kvt_stream_tx pdm_kvt_stream_tx_t;
int pdm_kvt_stream_tx_create(pdm_kvt_t *kvt, int peer, uint64_t request_id, uint32_t attempt,
                             int max_in_flight, double timeout, pdm_kvt_stream_tx_t **out);
/* Sends one block. The rows must stay unchanged until tx_finish returns. */
int pdm_kvt_stream_tx_send(pdm_kvt_stream_tx_t *tx, uint32_t layer, uint32_t head, uint32_t chunk,
                           int32_t token_start, int32_t n_tokens, uint16_t dtype, float scale,
                           const void *k_rows, const void *v_rows, size_t row_bytes);
/* The same with separate K and V scales (int8 KV); tx_send uses `scale` for both. */
int pdm_kvt_stream_tx_send_scaled(pdm_kvt_stream_tx_t *tx, uint32_t layer, uint32_t head,
                                  uint32_t chunk, int32_t token_start, int32_t n_tokens,
                                  uint16_t dtype, float k_scale, float v_scale,
                                  const void *k_rows, const void *v_rows, size_t row_bytes);
/* Authenticates every block sent from now on with the request's KV key (copied; NULL: none). */
void pdm_kvt_stream_tx_set_key(pdm_kvt_stream_tx_t *tx, const uint8_t *key);
/* Waits for every block sent (until `deadline`). */
int pdm_kvt_stream_tx_finish(pdm_kvt_stream_tx_t *tx, double deadline);
/* Bytes handed to the transport so far. */
uint64_t pdm_kvt_stream_tx_bytes(const pdm_kvt_stream_tx_t *tx);
void pdm_kvt_stream_tx_destroy(pdm_kvt_stream_tx_t *tx);

/* Receives and discards every unexpected message matching (tag, mask) that has arrived;
 * `cb` (may be NULL) sees each one first, once received. Never waits: a receive that does
 * not complete at once (a rendezvous whose sender is slow or died mid-transfer) stays in
 * flight in kvt's own bounded list (256), and every later call, whatever its tag, finishes
 * what ended since: its data goes to that call's cb if the call's (tag, mask) matches it,
 * then it is freed. A receive still in flight 2 s after it was taken is cancelled; one the
 * cancel has not ended 2 s later is given up: kept aside, its buffer freed only once UCX ends
 * it (never under UCX). While 256 are in flight, or 64 MiB of buffers are held, messages
 * stay in UCX's queue for a later call. Returns how many messages this call took. */
typedef void (*pdm_kvt_drain_cb)(void *arg, uint64_t tag, const void *data, size_t len);
int pdm_kvt_drain(pdm_kvt_t *kvt, uint64_t tag, uint64_t mask, pdm_kvt_drain_cb cb, void *arg);
/* Drained messages whose receive is still in flight; *abandoned (may be NULL): those given
 * up so far (a cancel did not end them: each is kept, not counted in flight, until UCX ends
 * it, when its endpoint fails or at pdm_kvt_destroy, and its buffer is freed then). */
int pdm_kvt_drain_pending(pdm_kvt_t *kvt, uint64_t *abandoned);
/* Cancels posted receives (PDM_KVT_REQ_NONE entries are skipped) and waits, one bounded
 * grace period for all, until the transport has released them; every handle is released and
 * set to PDM_KVT_REQ_NONE. */
void pdm_kvt_cancel(pdm_kvt_t *kvt, pdm_kvt_req_t *reqs, int n);

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
