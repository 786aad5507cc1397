/*
 * group.c - the communication patterns of a prefill group on top of pdm_kvt_t.
 *
 * All patterns post every receive before any send (so that no message waits in the
 * transport's unexpected queue longer than needed) and wait with the group's deadline.
 */
#include "kvtransfer/kvtransfer.h"

#include <stdio.h>
#include <string.h>
#include <time.h>

#include "common/pdm.h"
#include "common/wire.h"

double pdm_kvt_group_deadline(const pdm_kvt_group_t *g)
{
    return pdm_now() + g->timeout;
}

/* The join message of a formation (pdm_kvt_group_init). */
typedef struct {
    uint32_t rank;
    uint32_t nonce;  /* rank 0's for this formation; 0 from the others */
    int64_t until_ms; /* when the sender gives up on this formation (its wall clock) */
} pdm__join_msg_t;

static int64_t pdm__wall_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Every rank sends its join message to every other and takes one from each that is not left
 * over from an earlier formation (kvtransfer.h); followers take rank 0's nonce. */
static int pdm__join(pdm_kvt_group_t *g)
{
    if (g->rank == 0) {
        if (pdm_random_bytes(&g->nonce, sizeof(g->nonce)) || !g->nonce)
            g->nonce = (uint32_t)pdm__wall_ms() | 1u;
    }
    if (g->size == 1) return PDM_OK;
    /* a message whose sender gave up before this rank started (1 s allowed for clock skew)
     * is left over from a formation that failed */
    const int64_t start = pdm__wall_ms(), oldest = start - 1000;
    const double deadline = pdm_kvt_group_deadline(g);
    pdm__join_msg_t out = {(uint32_t)g->rank, g->rank == 0 ? g->nonce : 0,
                           start + (int64_t)(g->timeout * 1e3)};
    pdm__join_msg_t in[PDM_KVT_MAX_RANKS];
    pdm_kvt_req_t recv[PDM_KVT_MAX_RANKS], send[PDM_KVT_MAX_RANKS];
    int n_send = 0, st = PDM_OK;
    for (int j = 0; j < g->size; j++) {
        recv[j] = PDM_KVT_REQ_NONE;
        if (j == g->rank || st) continue;
        pdm_kvt_iov_t iov = {&in[j], sizeof(in[j])};
        st = pdm_kvt_group_recv(g, j, PDM_KVT_KIND_BARRIER, 0, 0, &iov, 1, &recv[j]);
    }
    for (int j = 0; j < g->size && !st; j++) {
        if (j == g->rank) continue;
        pdm_kvt_iov_t iov = {&out, sizeof(out)};
        st = pdm_kvt_group_send(g, j, PDM_KVT_KIND_BARRIER, 0, 0, &iov, 1, &send[n_send]);
        if (!st) n_send++;
    }
    for (int j = 0; j < g->size && !st; j++) {
        if (j == g->rank) continue;
        for (;;) {
            size_t bytes = 0;
            st = pdm_kvt_wait(g->kvt, recv[j], deadline, &bytes);
            recv[j] = PDM_KVT_REQ_NONE;
            if (st) break;
            if (bytes != sizeof(in[j]) || in[j].rank != (uint32_t)j) {
                st = pdm_error_set(PDM_EPEER, "group: the join message from rank %d is not one "
                                   "(%zu bytes, rank %u)", j, bytes, in[j].rank);
                break;
            }
            if (in[j].until_ms >= oldest) break;
            /* left over from a formation that failed: the next one is this formation's */
            pdm_kvt_iov_t iov = {&in[j], sizeof(in[j])};
            if ((st = pdm_kvt_group_recv(g, j, PDM_KVT_KIND_BARRIER, 0, 0, &iov, 1, &recv[j])))
                break;
        }
    }
    if (!st && g->rank != 0) {
        g->nonce = in[0].nonce;
        if (!g->nonce) st = pdm_error_set(PDM_EPEER, "group: rank 0 named no formation");
    }
    char msg[512];
    snprintf(msg, sizeof(msg), "%s", st ? pdm_error_last() : "");
    for (int j = 0; j < g->size; j++) /* receives still posted after a failure */
        if (recv[j] != PDM_KVT_REQ_NONE) pdm_kvt_cancel(g->kvt, &recv[j], 1);
    const int sst = pdm_kvt_wait_all(g->kvt, send, n_send, st ? pdm_now() : deadline);
    if (st) return pdm_error_set(st, "%s", msg);
    return sst;
}

int pdm_kvt_group_init(pdm_kvt_group_t *g, pdm_kvt_t *kvt, int rank, int size,
                       const void *const *addrs, const size_t *lens, double timeout)
{
    if (size < 1 || size > PDM_KVT_MAX_RANKS || rank < 0 || rank >= size)
        return pdm_error_set(PDM_EINVAL, "group: rank %d of %d is invalid (at most %d ranks)",
                             rank, size, PDM_KVT_MAX_RANKS);
    if (!(timeout > 0)) return pdm_error_set(PDM_EINVAL, "group: timeout must be positive");
    memset(g, 0, sizeof(*g));
    g->kvt = kvt;
    g->rank = rank;
    g->size = size;
    g->timeout = timeout;
    for (int r = 0; r < size; r++) {
        g->peer[r] = -1;
        if (r == rank) continue;
        int st = pdm_kvt_connect(kvt, addrs[r], lens[r], &g->peer[r]);
        if (st) return pdm_error_set(st, "group: rank %d: %s", r, pdm_error_last());
    }
    return pdm__join(g);
}

void pdm_kvt_group_fini(pdm_kvt_group_t *g)
{
    (void)g; /* endpoints belong to the kvt and are closed by pdm_kvt_destroy */
}

static int pdm__check_rank(const pdm_kvt_group_t *g, int r)
{
    if (r < 0 || r >= g->size || r == g->rank)
        return pdm_error_set(PDM_EINVAL, "group: no peer rank %d (we are %d of %d)", r, g->rank,
                             g->size);
    return PDM_OK;
}

int pdm_kvt_group_send(pdm_kvt_group_t *g, int dst, pdm_kvt_kind_t kind, int layer, int step,
                       const pdm_kvt_iov_t *iov, int n_iov, pdm_kvt_req_t *req)
{
    int st = pdm__check_rank(g, dst);
    if (st) return st;
    return pdm_kvt_isend(g->kvt, g->peer[dst], pdm_kvt_tag(kind, g->rank, g->task, layer, step),
                         iov, n_iov, req);
}

int pdm_kvt_group_recv(pdm_kvt_group_t *g, int src, pdm_kvt_kind_t kind, int layer, int step,
                       const pdm_kvt_iov_t *iov, int n_iov, pdm_kvt_req_t *req)
{
    int st = pdm__check_rank(g, src);
    if (st) return st;
    return pdm_kvt_irecv(g->kvt, g->peer[src], pdm_kvt_tag(kind, src, g->task, layer, step), iov,
                         n_iov, req);
}

/* Posts receives of recv[j] from every j != rank, then sends send[j] to every j; waits. */
static int pdm__exchange(pdm_kvt_group_t *g, pdm_kvt_kind_t kind, int layer, int step,
                         const pdm_kvt_msg_t *send, int send_same, const pdm_kvt_msg_t *recv)
{
    pdm_kvt_req_t reqs[2 * PDM_KVT_MAX_RANKS];
    int n = 0, st = PDM_OK;
    double deadline = pdm_kvt_group_deadline(g);
    for (int j = 0; j < g->size && !st; j++) {
        if (j == g->rank) continue;
        st = pdm_kvt_group_recv(g, j, kind, layer, step, recv[j].iov, recv[j].n_iov, &reqs[n]);
        if (!st) n++;
    }
    for (int j = 0; j < g->size && !st; j++) {
        if (j == g->rank) continue;
        const pdm_kvt_msg_t *m = send_same ? &send[0] : &send[j];
        st = pdm_kvt_group_send(g, j, kind, layer, step, m->iov, m->n_iov, &reqs[n]);
        if (!st) n++;
    }
    if (st) {
        char msg[512];
        snprintf(msg, sizeof(msg), "%s", pdm_error_last());
        pdm_kvt_wait_all(g->kvt, reqs, n, pdm_now()); /* release what was posted */
        return pdm_error_set(st, "%s", msg);
    }
    return pdm_kvt_wait_all(g->kvt, reqs, n, deadline);
}

int pdm_kvt_group_barrier(pdm_kvt_group_t *g, int step)
{
    if (g->size == 1) return PDM_OK;
    uint32_t out = (uint32_t)g->rank, in[PDM_KVT_MAX_RANKS];
    pdm_kvt_msg_t send = {.iov = {{&out, sizeof(out)}}, .n_iov = 1};
    pdm_kvt_msg_t recv[PDM_KVT_MAX_RANKS];
    for (int j = 0; j < g->size; j++) {
        recv[j].iov[0] = (pdm_kvt_iov_t){&in[j], sizeof(in[j])};
        recv[j].n_iov = 1;
    }
    int st = pdm__exchange(g, PDM_KVT_KIND_BARRIER, 0, step, &send, 1, recv);
    if (st) return st;
    for (int j = 0; j < g->size; j++)
        if (j != g->rank && in[j] != (uint32_t)j)
            return pdm_error_set(PDM_EPEER, "group: barrier message from rank %d claims rank %u",
                                 j, in[j]);
    return PDM_OK;
}

int pdm_kvt_group_allgather(pdm_kvt_group_t *g, int layer, const pdm_kvt_msg_t *parts)
{
    if (g->size == 1) return PDM_OK;
    return pdm__exchange(g, PDM_KVT_KIND_GATHER, layer, 0, &parts[g->rank], 1, parts);
}

int pdm_kvt_group_alltoall(pdm_kvt_group_t *g, int layer, const pdm_kvt_msg_t *send,
                           const pdm_kvt_msg_t *recv)
{
    if (g->size == 1) return PDM_OK;
    return pdm__exchange(g, PDM_KVT_KIND_A2A, layer, 0, send, 0, recv);
}

/* Every rank sends its vector to every other and reduces the R vectors itself: R - 1
 * messages per rank, one round trip, and no rank depends on another's arithmetic. Used for
 * the int8 KV scales (a few floats per layer), where latency matters more than bandwidth. */
int pdm_kvt_group_allreduce_max(pdm_kvt_group_t *g, int layer, int step, float *values, int n)
{
    enum { MAX_N = 256 };
    if (n < 0 || n > MAX_N)
        return pdm_error_set(PDM_EINVAL, "group: all-reduce of %d values (at most %d)", n, MAX_N);
    if (g->size == 1 || n == 0) return PDM_OK;
    static _Thread_local float in[PDM_KVT_MAX_RANKS][MAX_N];
    pdm_kvt_msg_t send = {.iov = {{values, sizeof(float) * (size_t)n}}, .n_iov = 1};
    pdm_kvt_msg_t recv[PDM_KVT_MAX_RANKS];
    for (int j = 0; j < g->size; j++) {
        recv[j].iov[0] = (pdm_kvt_iov_t){in[j], sizeof(float) * (size_t)n};
        recv[j].n_iov = 1;
    }
    int st = pdm__exchange(g, PDM_KVT_KIND_ALLREDUCE, layer, step, &send, 1, recv);
    if (st) return st;
    for (int j = 0; j < g->size; j++)
        if (j != g->rank)
            for (int i = 0; i < n; i++)
                if (in[j][i] > values[i]) values[i] = in[j][i];
    return PDM_OK;
}
