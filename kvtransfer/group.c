/*
 * group.c - the communication patterns of a prefill group on top of pdm_kvt_t.
 *
 * All patterns post every receive before any send (so that no message waits in the
 * transport's unexpected queue longer than needed) and wait with the group's deadline.
 */
#include "kvtransfer/kvtransfer.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "common/pdm.h"
#include "common/wire.h"

double pdm_kvt_group_deadline(const pdm_kvt_group_t *g)
{
    return pdm_now() + g->timeout;
}

/*
 * Forming a group (pdm_kvt_group_init). Two processes may form a group many times (a GroupWire
 * re-forms it), and a message of an attempt that failed stays in the receiver's transport
 * queue: it must never pass for a later attempt's. So the formation is a handshake that only
 * fresh numbers complete, between rank 0 and each other rank:
 *   rank 0 -> rank j   JOIN    {0, n}     n: rank 0's random number for this attempt
 *   rank j -> rank 0   CONFIRM {j, n', f} n': the n of a JOIN it took, f: its own random number
 *   rank 0 -> rank j   COMMIT  {0, n, f}  only for a CONFIRM of this attempt's n
 * Rank 0 skips a CONFIRM of another n (left over, or for a JOIN left over). Rank j confirms
 * every JOIN that comes while it waits, so a left-over JOIN it took first costs nothing: the
 * fresh one comes and is confirmed too; it is done at the COMMIT of its own f. Then a barrier
 * of every rank, tagged with n, connects all the ranks. n is the group's nonce.
 */
typedef struct {
    uint32_t rank;
    uint32_t nonce;
    uint64_t f;
} pdm__join_msg_t;

enum { PDM__JOIN = 0, PDM__CONFIRM = 1, PDM__COMMIT = 2 };

static int pdm__join_send(pdm_kvt_group_t *g, int j, int step, const pdm__join_msg_t *m,
                          double deadline)
{
    pdm_kvt_req_t r;
    pdm_kvt_iov_t iov = {(void *)m, sizeof(*m)};
    int st = pdm_kvt_group_send(g, j, PDM_KVT_KIND_JOIN, 0, step, &iov, 1, &r);
    return st ? st : pdm_kvt_wait(g->kvt, r, deadline, NULL);
}

static int pdm__join_post(pdm_kvt_group_t *g, int step, pdm__join_msg_t *m, pdm_kvt_req_t *r)
{
    pdm_kvt_iov_t iov = {m, sizeof(*m)};
    return pdm_kvt_group_recv(g, 0, PDM_KVT_KIND_JOIN, 0, step, &iov, 1, r);
}

/* Rank 0: a JOIN to every rank, then each rank's CONFIRM of it, answered by a COMMIT. */
static int pdm__join_lead(pdm_kvt_group_t *g, double deadline)
{
    const pdm__join_msg_t join = {0, g->nonce, 0};
    int st = PDM_OK;
    for (int j = 1; j < g->size && !st; j++) st = pdm__join_send(g, j, PDM__JOIN, &join, deadline);
    for (int j = 1; j < g->size && !st; j++) {
        for (;;) {
            pdm__join_msg_t c;
            pdm_kvt_req_t r;
            pdm_kvt_iov_t iov = {&c, sizeof(c)};
            size_t bytes = 0;
            st = pdm_kvt_group_recv(g, j, PDM_KVT_KIND_JOIN, 0, PDM__CONFIRM, &iov, 1, &r);
            if (!st) st = pdm_kvt_wait(g->kvt, r, deadline, &bytes);
            if (st) break;
            if (bytes != sizeof(c) || c.rank != (uint32_t)j) {
                st = pdm_error_set(PDM_EPEER, "group: rank %d sent a malformed CONFIRM", j);
                break;
            }
            if (c.nonce != g->nonce) continue; /* of an earlier attempt */
            const pdm__join_msg_t commit = {0, g->nonce, c.f};
            st = pdm__join_send(g, j, PDM__COMMIT, &commit, deadline);
            break;
        }
    }
    return st;
}

/* Whether posted receive *r has a message (1, *bytes set) or failed (negative); either way
 * *r is released. 0 while it waits. */
static int pdm__join_took(pdm_kvt_group_t *g, pdm_kvt_req_t *r, size_t *bytes)
{
    const int t = pdm_kvt_test(g->kvt, *r, bytes);
    if (t) *r = PDM_KVT_REQ_NONE;
    return t;
}

/* Rank j > 0: confirms every JOIN from rank 0 until the COMMIT of its own f comes. */
static int pdm__join_follow(pdm_kvt_group_t *g, double deadline)
{
    uint64_t f = 0;
    if (pdm_random_bytes(&f, sizeof(f)) || !f) f = (uint64_t)(pdm_now() * 1e9) | 1u;
    pdm__join_msg_t jm, cm;
    pdm_kvt_req_t rj = PDM_KVT_REQ_NONE, rc = PDM_KVT_REQ_NONE;
    int st = pdm__join_post(g, PDM__JOIN, &jm, &rj);
    if (!st) st = pdm__join_post(g, PDM__COMMIT, &cm, &rc);
    uint32_t nonce = 0;
    int done = 0;
    while (!st && !done) {
        size_t bytes = 0;
        int got = 0, t = pdm__join_took(g, &rj, &bytes);
        if (t > 0) {
            got = 1;
            if (bytes == sizeof(jm) && jm.rank == 0 && jm.nonce) {
                nonce = jm.nonce;
                const pdm__join_msg_t c = {(uint32_t)g->rank, nonce, f};
                st = pdm__join_send(g, 0, PDM__CONFIRM, &c, deadline);
            }
            if (!st) st = pdm__join_post(g, PDM__JOIN, &jm, &rj);
        }
        if (t < 0) st = t;
        if (st) break;
        t = pdm__join_took(g, &rc, &bytes);
        if (t > 0) {
            got = 1;
            if (bytes == sizeof(cm) && cm.rank == 0 && cm.f == f && cm.nonce) {
                g->nonce = cm.nonce;
                done = 1;
            } else {
                st = pdm__join_post(g, PDM__COMMIT, &cm, &rc); /* of an earlier attempt */
            }
        }
        if (t < 0) st = t;
        if (!st && !done && !got) {
            if (pdm_now() > deadline)
                st = pdm_error_set(PDM_ETIMEOUT, "group: no COMMIT from rank 0 within %.1f s%s",
                                   g->timeout, nonce ? " (a JOIN came and was confirmed)"
                                                     : " (no JOIN came)");
            else
                usleep(200);
        }
    }
    pdm_kvt_req_t left[2] = {rj, rc};
    pdm_kvt_cancel(g->kvt, left, 2);
    return st;
}

/* The handshake above, then a barrier of every rank tagged with the nonce. */
static int pdm__join(pdm_kvt_group_t *g)
{
    if (g->rank == 0 && (pdm_random_bytes(&g->nonce, sizeof(g->nonce)) || !g->nonce))
        g->nonce = (uint32_t)(pdm_now() * 1e6) | 1u;
    if (g->size == 1) return PDM_OK;
    const double deadline = pdm_kvt_group_deadline(g);
    int st = g->rank == 0 ? pdm__join_lead(g, deadline) : pdm__join_follow(g, deadline);
    if (st) {
        char msg[512];
        snprintf(msg, sizeof(msg), "%s", pdm_error_last());
        return pdm_error_set(st, "%s", msg);
    }
    g->task = g->nonce & 0xffff; /* a barrier message of another formation cannot match */
    st = pdm_kvt_group_barrier(g, 0);
    g->task = 0;
    return st;
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
