/*
 * ucx.c - pdm_kvt_t on UCX (UCP tag matching).
 *
 * One context and one worker per process, created thread-safe (UCS_THREAD_MODE_MULTI) so
 * that a progress thread can drive the worker while the compute thread posts operations.
 * The progress thread progresses until idle, arms the worker and sleeps in poll() on its
 * event fd; ucp_worker_signal() wakes it whenever an operation is posted.
 *
 * Every operation lives in a slot of a bounded table that we own, so that an operation can
 * be failed by us (timeout, dead peer) even if UCX never calls back for it after a forced
 * endpoint close (PITFALLS.md, UCX). Slots are recycled only after UCX has released the
 * request (its callback ran, or it completed inline).
 */
#include "kvtransfer/kvtransfer.h"

#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucp/api/ucp.h>

#include "common/pdm.h"

#define PDM__KVT_MAX_PEERS 256
#define PDM__KVT_GRACE 2.0 /* seconds UCX gets to let go of buffers after a failure */
#define PDM__KVT_MAX_DRAINS 256 /* drained messages whose receive is in flight, at most */
/* ... and their bytes: a drained KV block may be megabytes, and a dead stream has many */
#define PDM__KVT_DRAIN_BYTES ((size_t)64 << 20)

enum { SLOT_FREE = 0, SLOT_PENDING, SLOT_DONE, SLOT_ORPHAN };

typedef struct pdm__slot {
    struct pdm_kvt *kvt;
    int state;         /* SLOT_* (under kvt->lock) */
    int gen;           /* bumped at every reuse: stale handles are detected */
    int is_send;
    int peer;
    uint64_t tag;
    int status;        /* pdm status once done */
    size_t length;     /* bytes moved once done */
    void *ureq;        /* UCX request while it is alive */
    int ucx_alive;     /* UCX may still call back */
    ucp_dt_iov_t one;  /* a single piece (sent as a contiguous buffer) */
    ucp_dt_iov_t *iov; /* pieces of a multi-piece message (heap; UCX reads it until the
                          operation completes, so it is freed only when the slot is reused) */
    size_t total;      /* bytes of the message */
} pdm__slot_t;

/* A message pdm_kvt_drain took from UCX's unexpected queue whose receive did not complete at
 * once: a rendezvous whose sender is slow, stalled or dead. Later drain calls finish it. */
typedef struct {
    void *ureq;       /* the UCX receive; released only once done, or given up after a cancel */
    void *buf;        /* (len) bytes UCX writes into: freed only once ureq is done */
    size_t len;
    uint64_t tag;     /* the sender's */
    double cancel_at; /* pdm_now() clock: cancelled from then on (once cancelled: given up) */
    int cancelled;
    int abandoned;    /* a cancel did not end it: kept until UCX ends it (a failed endpoint
                       * does), then its buffer is freed */
} pdm__drain_t;

typedef struct {
    ucp_ep_h ep;
    pdm_kvt_stats_t stats; /* traffic with this peer */
    int alive;
    int close_pending; /* failed: the progress thread must close ep */
    int connecting;    /* the slot is taken by a connect in progress */
    ucs_status_t reason;
    uint8_t *addr;     /* the worker address it was connected to (pdm_kvt_connect_cached) */
    size_t addr_len;
} pdm__peer_t;

struct pdm_kvt {
    ucp_context_h context;
    ucp_worker_h worker;
    ucp_address_t *address;
    size_t address_len;
    int efd;

    pthread_mutex_t lock; /* slots, peers, stats (recursive) */
    /* Held around every ucp_worker_progress (recursive) and by pdm_kvt_cancel while it calls
     * ucp_request_cancel under `lock`: progress holds UCX's worker lock and its callbacks take
     * `lock`, cancel holds `lock` and takes the worker lock, so without this the two could
     * deadlock (seen: a stream receiver destroyed while its remaining blocks arrive). Order:
     * progress_lock, then lock. */
    pthread_mutex_t progress_lock;
    pthread_cond_t cond;  /* signalled on every completion */
    pdm__slot_t *slots;
    int n_slots;
    int slot_hint;   /* where the next free-slot scan starts */
    pdm__peer_t peers[PDM__KVT_MAX_PEERS];
    int n_peers;
    pdm_kvt_stats_t stats;

    /* pdm_kvt_drain's receives in flight, [0, n_drains) (under progress_lock), and those given
     * up (a cancel did not end them: their buffers are leaked rather than freed under UCX) */
    pdm__drain_t drains[2 * PDM__KVT_MAX_DRAINS]; /* in flight, then given up (abandoned) */
    int n_drains, n_abandoned;
    size_t drain_bytes;         /* their buffers' bytes */
    uint64_t drains_abandoned;

    int use_thread;
    pthread_t thread;
    atomic_int stop;
    atomic_int n_waiters; /* threads polling the worker in pdm_kvt_wait */
};

void pdm_kvt_params_default(pdm_kvt_params_t *p)
{
    p->max_requests = 16384;
    const char *env = getenv("PDMESH_KVT_PROGRESS_THREAD");
    p->progress_thread = env && !strcmp(env, "0") ? 0 : 1;
}

static int pdm__from_ucs(ucs_status_t st)
{
    switch (st) {
    case UCS_OK: return PDM_OK;
    case UCS_ERR_CANCELED: return PDM_ECANCELED;
    case UCS_ERR_MESSAGE_TRUNCATED: return PDM_EOVERFLOW;
    case UCS_ERR_NO_MEMORY: return PDM_ENOMEM;
    case UCS_ERR_TIMED_OUT: return PDM_ETIMEOUT;
    default: return PDM_EPEER;
    }
}

/* Records the completion of a slot; called with the lock held. */
static void pdm__slot_complete(pdm_kvt_t *kvt, pdm__slot_t *s, ucs_status_t st, size_t length)
{
    s->ucx_alive = 0;
    if (s->ureq) {
        ucp_request_free(s->ureq);
        s->ureq = NULL;
    }
    if (s->state == SLOT_ORPHAN) { /* its waiter gave up: nobody reads it */
        s->state = SLOT_FREE;
        return;
    }
    if (s->state != SLOT_PENDING) return; /* already failed by us */
    s->status = pdm__from_ucs(st);
    s->length = length;
    s->state = SLOT_DONE;
    if (st == UCS_OK) {
        pdm_kvt_stats_t *ps = &kvt->peers[s->peer].stats;
        if (s->is_send) {
            kvt->stats.bytes_sent += length;
            kvt->stats.sends++;
            ps->bytes_sent += length;
            ps->sends++;
        } else {
            kvt->stats.bytes_received += length;
            kvt->stats.receives++;
            ps->bytes_received += length;
            ps->receives++;
        }
    }
    pthread_cond_broadcast(&kvt->cond);
}

static void pdm__send_cb(void *request, ucs_status_t status, void *user_data)
{
    pdm__slot_t *s = user_data;
    pdm_kvt_t *kvt = s->kvt;
    pthread_mutex_lock(&kvt->lock);
    s->ureq = request;
    pdm__slot_complete(kvt, s, status, s->total);
    pthread_mutex_unlock(&kvt->lock);
}

static void pdm__recv_cb(void *request, ucs_status_t status, const ucp_tag_recv_info_t *info,
                         void *user_data)
{
    pdm__slot_t *s = user_data;
    pdm_kvt_t *kvt = s->kvt;
    pthread_mutex_lock(&kvt->lock);
    s->ureq = request;
    pdm__slot_complete(kvt, s, status, status == UCS_OK ? info->length : 0);
    pthread_mutex_unlock(&kvt->lock);
}

/* Peer failure reported by UCX (runs inside progress: must not progress or close here). */
static void pdm__ep_error_cb(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    pdm_kvt_t *kvt = arg;
    pthread_mutex_lock(&kvt->lock);
    for (int p = 0; p < kvt->n_peers; p++) {
        if (kvt->peers[p].ep == ep && kvt->peers[p].alive) {
            kvt->peers[p].alive = 0;
            kvt->peers[p].close_pending = 1;
            kvt->peers[p].reason = status;
            kvt->stats.failures++;
            /* A peer that leaves while nothing is in flight to it is a normal shutdown. */
            int busy = 0;
            for (int i = 0; i < kvt->n_slots; i++)
                busy += kvt->slots[i].peer == p && kvt->slots[i].state == SLOT_PENDING;
            if (busy)
                pdm_log_warn("kvtransfer: peer %d failed with %d operations in flight: %s", p,
                             busy, ucs_status_string(status));
            else
                pdm_log_debug("kvtransfer: peer %d gone: %s", p, ucs_status_string(status));
        }
    }
    pthread_cond_broadcast(&kvt->cond);
    pthread_mutex_unlock(&kvt->lock);
}

/* Closes failed endpoints and cancels receives that wait for failed peers. Called from the
 * progressing thread, never from a UCX callback. */
static void pdm__reap_failed_locked(pdm_kvt_t *kvt)
{
    ucp_ep_h to_close[PDM__KVT_MAX_PEERS];
    int n_close = 0;
    pthread_mutex_lock(&kvt->lock);
    for (int p = 0; p < kvt->n_peers; p++) {
        pdm__peer_t *peer = &kvt->peers[p];
        if (!peer->close_pending) continue;
        peer->close_pending = 0;
        if (peer->ep) to_close[n_close++] = peer->ep;
        peer->ep = NULL;
        for (int i = 0; i < kvt->n_slots; i++) {
            pdm__slot_t *s = &kvt->slots[i];
            if (s->peer == p && !s->is_send && s->ucx_alive && s->ureq)
                ucp_request_cancel(kvt->worker, s->ureq);
        }
    }
    pthread_mutex_unlock(&kvt->lock);
    for (int i = 0; i < n_close; i++) {
        ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                                   .flags = UCP_EP_CLOSE_FLAG_FORCE};
        void *r = ucp_ep_close_nbx(to_close[i], &prm);
        if (UCS_PTR_IS_PTR(r)) {
            double until = pdm_now() + PDM__KVT_GRACE;
            while (ucp_request_check_status(r) == UCS_INPROGRESS && pdm_now() < until)
                ucp_worker_progress(kvt->worker);
            ucp_request_free(r);
        }
    }
    if (n_close) {
        /* Sends on a force-closed endpoint that UCX does not call back for any more. */
        pthread_mutex_lock(&kvt->lock);
        for (int i = 0; i < kvt->n_slots; i++) {
            pdm__slot_t *s = &kvt->slots[i];
            if (s->is_send && s->ucx_alive && !kvt->peers[s->peer].alive &&
                kvt->peers[s->peer].ep == NULL && s->ureq &&
                ucp_request_check_status(s->ureq) != UCS_INPROGRESS)
                pdm__slot_complete(kvt, s, UCS_ERR_CANCELED, 0);
        }
        pthread_cond_broadcast(&kvt->cond);
        pthread_mutex_unlock(&kvt->lock);
    }
}

/* Cancels and closes what failed peers left, under progress_lock (it cancels UCX requests
 * while holding `lock`; see progress_lock). */
static void pdm__reap_failed(pdm_kvt_t *kvt)
{
    pthread_mutex_lock(&kvt->progress_lock);
    pdm__reap_failed_locked(kvt);
    pthread_mutex_unlock(&kvt->progress_lock);
}

int pdm_kvt_progress(pdm_kvt_t *kvt)
{
    int n = 0;
    pthread_mutex_lock(&kvt->progress_lock);
    while (ucp_worker_progress(kvt->worker)) n++;
    pdm__reap_failed(kvt);
    pthread_mutex_unlock(&kvt->progress_lock);
    return n;
}

int pdm_kvt_event_fd(pdm_kvt_t *kvt, int *fd)
{
    *fd = kvt->efd;
    return kvt->efd >= 0 ? PDM_OK : PDM_EUNSUPPORTED;
}

int pdm_kvt_arm(pdm_kvt_t *kvt)
{
    ucs_status_t st = ucp_worker_arm(kvt->worker);
    if (st == UCS_ERR_BUSY) return 1;
    return st == UCS_OK ? PDM_OK : pdm__from_ucs(st);
}

static void *pdm__progress_main(void *arg)
{
    pdm_kvt_t *kvt = arg;
    while (!atomic_load(&kvt->stop)) {
        /* Stand aside while a waiter polls the worker: two threads progressing one worker
         * contend on its lock, and when both run on the rank's one pinned core a thread
         * spinning on that lock can wait for the holder's whole time slice (measured: 550 us
         * per message over shared memory instead of 2 us). */
        if (atomic_load(&kvt->n_waiters) > 0) {
            struct pollfd none = {.fd = -1};
            poll(&none, 0, 1);
            continue;
        }
        pdm_kvt_progress(kvt);
        if (pdm_kvt_arm(kvt) == 1) continue;
        /* Woken by the event fd (arrivals) or ucp_worker_signal (posts); the timeout bounds
         * how long a transport that does not signal its fd can go without progress. */
        struct pollfd pfd = {.fd = kvt->efd, .events = POLLIN};
        poll(&pfd, 1, 1);
    }
    return NULL;
}

int pdm_kvt_listen_on(const char *devices)
{
    if (!devices) {
        if (!getenv("UCX_NET_DEVICES"))
            pdm_log_info("kvtransfer: the KV plane listens on every interface (--kv-interface "
                         "or UCX_NET_DEVICES restricts it)");
        return PDM_OK;
    }
    size_t n = strlen(devices);
    if (!n || n > 256 || strspn(devices, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                          "0123456789,:._-") != n)
        return pdm_error_set(PDM_EINVAL, "--kv-interface '%s': not a device list such as lo, "
                             "eth0 or mlx5_0:1,eth0", devices);
    if (setenv("UCX_NET_DEVICES", devices, 1))
        return pdm_error_set(PDM_ENOMEM, "kvtransfer: cannot set UCX_NET_DEVICES");
    return PDM_OK;
}

int pdm_kvt_create(const pdm_kvt_params_t *params, pdm_kvt_t **out)
{
    pdm_kvt_params_t p;
    if (params)
        p = *params;
    else
        pdm_kvt_params_default(&p);
    if (p.max_requests < 1 || p.max_requests > (1 << 16))
        return pdm_error_set(PDM_EINVAL, "kvtransfer: max_requests %d out of range",
                             p.max_requests);

    int status;
    pdm_kvt_t *kvt = calloc(1, sizeof(*kvt));
    if (!kvt) return pdm_error_set(PDM_ENOMEM, "kvtransfer: out of memory");
    kvt->efd = -1;
    kvt->n_slots = p.max_requests;
    kvt->slots = calloc((size_t)kvt->n_slots, sizeof(*kvt->slots));
    if (!kvt->slots) {
        status = pdm_error_set(PDM_ENOMEM, "kvtransfer: out of memory");
        goto err_free;
    }
    for (int i = 0; i < kvt->n_slots; i++) kvt->slots[i].kvt = kvt;
    /* Recursive: ucp_request_cancel may run a completion callback (which locks) inline. */
    pthread_mutexattr_t ma;
    pthread_mutexattr_init(&ma);
    pthread_mutexattr_settype(&ma, PTHREAD_MUTEX_RECURSIVE);
    pthread_mutex_init(&kvt->lock, &ma);
    pthread_mutex_init(&kvt->progress_lock, &ma);
    pthread_mutexattr_destroy(&ma);
    pthread_cond_init(&kvt->cond, NULL);

    /* Peer error handling drops the shared-memory transports unless they are told to handle
     * errors themselves (PITFALLS.md, UCX): without this, ranks on one host talk over TCP
     * loopback. An explicit setting in the environment wins. */
    const char *tls = getenv("UCX_TLS");
    if (!tls || strstr(tls, "all") || strstr(tls, "shm") || strstr(tls, "posix"))
        setenv("UCX_POSIX_ERROR_HANDLING", "y", 0);
    ucp_config_t *config;
    ucs_status_t st = ucp_config_read(NULL, NULL, &config);
    if (st != UCS_OK) {
        status = pdm_error_set(PDM_EIO, "kvtransfer: UCX configuration: %s",
                               ucs_status_string(st));
        goto err_sync;
    }
    ucp_params_t cp = {
        .field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED,
        .features = UCP_FEATURE_TAG | UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP,
        .mt_workers_shared = 0,
    };
    st = ucp_init(&cp, config, &kvt->context);
    ucp_config_release(config);
    if (st != UCS_OK) {
        status = pdm_error_set(PDM_EIO, "kvtransfer: ucp_init: %s", ucs_status_string(st));
        goto err_sync;
    }
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_MULTI};
    st = ucp_worker_create(kvt->context, &wp, &kvt->worker);
    if (st != UCS_OK) {
        status = pdm_error_set(PDM_EIO, "kvtransfer: ucp_worker_create: %s",
                               ucs_status_string(st));
        goto err_context;
    }
    st = ucp_worker_get_address(kvt->worker, &kvt->address, &kvt->address_len);
    if (st != UCS_OK) {
        status = pdm_error_set(PDM_EIO, "kvtransfer: worker address: %s", ucs_status_string(st));
        goto err_worker;
    }
    st = ucp_worker_get_efd(kvt->worker, &kvt->efd);
    if (st != UCS_OK) {
        status = pdm_error_set(PDM_EIO, "kvtransfer: worker event fd: %s",
                               ucs_status_string(st));
        goto err_address;
    }
    kvt->use_thread = p.progress_thread;
    if (kvt->use_thread && pthread_create(&kvt->thread, NULL, pdm__progress_main, kvt) != 0) {
        status = pdm_error_set(PDM_ENOMEM, "kvtransfer: cannot start the progress thread");
        goto err_address;
    }
    *out = kvt;
    return PDM_OK;

err_address:
    ucp_worker_release_address(kvt->worker, kvt->address);
err_worker:
    ucp_worker_destroy(kvt->worker);
err_context:
    ucp_cleanup(kvt->context);
err_sync:
    pthread_cond_destroy(&kvt->cond);
    pthread_mutex_destroy(&kvt->lock);
    pthread_mutex_destroy(&kvt->progress_lock);
err_free:
    free(kvt->slots);
    free(kvt);
    return status;
}

void pdm_kvt_destroy(pdm_kvt_t *kvt)
{
    if (!kvt) return;
    if (kvt->use_thread) {
        atomic_store(&kvt->stop, 1);
        ucp_worker_signal(kvt->worker);
        pthread_join(kvt->thread, NULL);
    }
    pthread_mutex_lock(&kvt->lock);
    for (int p = 0; p < kvt->n_peers; p++) {
        if (kvt->peers[p].ep) {
            kvt->peers[p].alive = 0;
            kvt->peers[p].close_pending = 1;
        }
    }
    pthread_mutex_unlock(&kvt->lock);
    pdm__reap_failed(kvt);
    /* Receives still posted (never waited for): cancel and let them complete. */
    pthread_mutex_lock(&kvt->lock);
    for (int i = 0; i < kvt->n_slots; i++)
        if (kvt->slots[i].ucx_alive && kvt->slots[i].ureq && !kvt->slots[i].is_send)
            ucp_request_cancel(kvt->worker, kvt->slots[i].ureq);
    pthread_mutex_unlock(&kvt->lock);
    for (int i = 0; i < kvt->n_drains; i++)
        if (!kvt->drains[i].cancelled) ucp_request_cancel(kvt->worker, kvt->drains[i].ureq);
    double until = pdm_now() + PDM__KVT_GRACE;
    for (;;) {
        int alive = 0;
        ucp_worker_progress(kvt->worker);
        pthread_mutex_lock(&kvt->lock);
        for (int i = 0; i < kvt->n_slots; i++) alive += kvt->slots[i].ucx_alive;
        pthread_mutex_unlock(&kvt->lock);
        for (int i = 0; i < kvt->n_drains; i++)
            alive += ucp_request_check_status(kvt->drains[i].ureq) == UCS_INPROGRESS;
        if (!alive || pdm_now() > until) break;
    }
    for (int i = 0; i < kvt->n_drains; i++) ucp_request_free(kvt->drains[i].ureq);
    ucp_worker_release_address(kvt->worker, kvt->address);
    ucp_worker_destroy(kvt->worker);
    /* (the worker is gone: nothing writes the drained buffers any more) */
    for (int i = 0; i < kvt->n_drains; i++) free(kvt->drains[i].buf);
    ucp_cleanup(kvt->context);
    pthread_cond_destroy(&kvt->cond);
    pthread_mutex_destroy(&kvt->lock);
    pthread_mutex_destroy(&kvt->progress_lock);
    for (int i = 0; kvt->slots && i < kvt->n_slots; i++) free(kvt->slots[i].iov);
    for (int p = 0; p < kvt->n_peers; p++) free(kvt->peers[p].addr);
    free(kvt->slots);
    free(kvt);
}

void pdm_kvt_address(const pdm_kvt_t *kvt, const void **addr, size_t *len)
{
    *addr = kvt->address;
    *len = kvt->address_len;
}

/* A peer slot for a new connection (lock held): a failed peer's slot once its endpoint is
 * closed and no operation refers to it any more, else a new one; -1 if the table is full. */
static int pdm__peer_slot(pdm_kvt_t *kvt)
{
    for (int p = 0; p < kvt->n_peers; p++) {
        const pdm__peer_t *q = &kvt->peers[p];
        if (q->alive || q->ep || q->close_pending || q->connecting) continue;
        int used = 0;
        for (int i = 0; i < kvt->n_slots && !used; i++)
            used = kvt->slots[i].state != SLOT_FREE && kvt->slots[i].peer == p;
        if (!used) return p;
    }
    return kvt->n_peers < PDM__KVT_MAX_PEERS ? kvt->n_peers++ : -1;
}

int pdm_kvt_connect(pdm_kvt_t *kvt, const void *addr, size_t len, int *peer)
{
    if (!addr || len == 0) return pdm_error_set(PDM_EINVAL, "kvtransfer: empty peer address");
    uint8_t *copy = malloc(len);
    if (!copy) return pdm_error_set(PDM_ENOMEM, "kvtransfer: out of memory");
    memcpy(copy, addr, len);
    pthread_mutex_lock(&kvt->lock);
    int idx = pdm__peer_slot(kvt);
    if (idx >= 0) {
        free(kvt->peers[idx].addr);
        kvt->peers[idx] = (pdm__peer_t){.connecting = 1};
    }
    pthread_mutex_unlock(&kvt->lock);
    if (idx < 0) {
        free(copy);
        return pdm_error_set(PDM_EOVERFLOW, "kvtransfer: more than %d peers connected at once",
                             PDM__KVT_MAX_PEERS);
    }
    /* UCX does not validate a worker address: a garbled one can crash ucp_ep_create, so
     * callers must only pass addresses they received intact (the control plane checks). */
    ucp_ep_params_t ep = {
        .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER,
        .address = addr,
        .err_mode = UCP_ERR_HANDLING_MODE_PEER,
        .err_handler = {.cb = pdm__ep_error_cb, .arg = kvt},
    };
    ucp_ep_h h;
    ucs_status_t st = ucp_ep_create(kvt->worker, &ep, &h);
    pthread_mutex_lock(&kvt->lock);
    if (st == UCS_OK)
        kvt->peers[idx] = (pdm__peer_t){.ep = h, .alive = 1, .addr = copy, .addr_len = len};
    else
        kvt->peers[idx].connecting = 0;
    pthread_mutex_unlock(&kvt->lock);
    if (st != UCS_OK) {
        free(copy);
        return pdm_error_set(PDM_EPEER, "kvtransfer: cannot connect to peer: %s",
                             ucs_status_string(st));
    }
    *peer = idx;
    return PDM_OK;
}

int pdm_kvt_connect_cached(pdm_kvt_t *kvt, const void *addr, size_t len, int *peer)
{
    pthread_mutex_lock(&kvt->lock);
    for (int p = 0; p < kvt->n_peers; p++)
        if (kvt->peers[p].alive && kvt->peers[p].addr_len == len &&
            !memcmp(kvt->peers[p].addr, addr, len)) {
            pthread_mutex_unlock(&kvt->lock);
            *peer = p;
            return PDM_OK;
        }
    pthread_mutex_unlock(&kvt->lock);
    return pdm_kvt_connect(kvt, addr, len, peer);
}

int pdm_kvt_peer_alive(pdm_kvt_t *kvt, int peer)
{
    pthread_mutex_lock(&kvt->lock);
    int alive = peer >= 0 && peer < kvt->n_peers && kvt->peers[peer].alive;
    pthread_mutex_unlock(&kvt->lock);
    return alive;
}

void pdm_kvt_peer_fail(pdm_kvt_t *kvt, int peer, const char *why)
{
    pthread_mutex_lock(&kvt->lock);
    if (peer >= 0 && peer < kvt->n_peers && kvt->peers[peer].alive) {
        kvt->peers[peer].alive = 0;
        kvt->peers[peer].close_pending = 1;
        kvt->peers[peer].reason = UCS_ERR_ENDPOINT_TIMEOUT;
        kvt->stats.failures++;
        pdm_log_warn("kvtransfer: giving up on peer %d: %s", peer, why ? why : "failed");
    }
    pthread_cond_broadcast(&kvt->cond);
    pthread_mutex_unlock(&kvt->lock);
    if (kvt->use_thread)
        ucp_worker_signal(kvt->worker);
    else
        pdm__reap_failed(kvt);
}

/* Takes a free slot (lock held); -1 if the table is full. */
static int pdm__slot_take(pdm_kvt_t *kvt)
{
    /* Scan from after the last slot taken: amortised O(1) while the table is not full. */
    for (int k = 0; k < kvt->n_slots; k++) {
        int i = (kvt->slot_hint + k) % kvt->n_slots;
        if (kvt->slots[i].state == SLOT_FREE && !kvt->slots[i].ucx_alive) {
            kvt->slot_hint = (i + 1) % kvt->n_slots;
            return i;
        }
    }
    return -1;
}

static int pdm__post(pdm_kvt_t *kvt, int is_send, int peer, uint64_t tag,
                     const pdm_kvt_iov_t *iov, int n_iov, pdm_kvt_req_t *req)
{
    if (n_iov < 0 || n_iov > PDM_KVT_MAX_IOV)
        return pdm_error_set(PDM_EINVAL, "kvtransfer: %d pieces in one message (max %d)", n_iov,
                             PDM_KVT_MAX_IOV);
    pthread_mutex_lock(&kvt->lock);
    if (peer < 0 || peer >= kvt->n_peers) {
        pthread_mutex_unlock(&kvt->lock);
        return pdm_error_set(PDM_EINVAL, "kvtransfer: no peer %d", peer);
    }
    if (!kvt->peers[peer].alive) {
        pthread_mutex_unlock(&kvt->lock);
        return pdm_error_set(PDM_EPEER, "kvtransfer: peer %d has failed", peer);
    }
    int idx = pdm__slot_take(kvt);
    if (idx < 0) {
        pthread_mutex_unlock(&kvt->lock);
        return pdm_error_set(PDM_EOVERFLOW, "kvtransfer: more than %d operations in flight",
                             kvt->n_slots);
    }
    pdm__slot_t *s = &kvt->slots[idx];
    free(s->iov); /* UCX is done with the previous user's pieces (ucx_alive was 0) */
    s->iov = NULL;
    if (n_iov > 1 && !(s->iov = malloc(sizeof(*s->iov) * (size_t)n_iov))) {
        pthread_mutex_unlock(&kvt->lock);
        return pdm_error_set(PDM_ENOMEM, "kvtransfer: out of memory");
    }
    s->state = SLOT_PENDING;
    s->gen = (s->gen + 1) & 0x7fff;
    s->is_send = is_send;
    s->peer = peer;
    s->tag = tag;
    s->status = PDM_OK;
    s->length = 0;
    s->ureq = NULL;
    s->ucx_alive = 1;
    s->total = 0;
    ucp_dt_iov_t *pieces = n_iov > 1 ? s->iov : &s->one;
    s->one = (ucp_dt_iov_t){NULL, 0};
    for (int i = 0; i < n_iov; i++) {
        pieces[i].buffer = iov[i].base;
        pieces[i].length = iov[i].len;
        s->total += iov[i].len;
    }
    ucp_ep_h ep = kvt->peers[peer].ep;
    pthread_mutex_unlock(&kvt->lock);

    /* One piece goes as a contiguous buffer: only contiguous messages get UCX's zero-copy
     * rendezvous (1.13 copies iov messages through bounce buffers, openucx/ucx#1180). */
    const int contig = n_iov <= 1;
    void *buf = contig ? s->one.buffer : (void *)s->iov;
    size_t count = contig ? s->one.length : (size_t)n_iov;
    ucp_request_param_t prm = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                        UCP_OP_ATTR_FIELD_DATATYPE,
        .user_data = s,
        .datatype = contig ? ucp_dt_make_contig(1) : ucp_dt_make_iov(),
    };
    ucp_tag_recv_info_t info = {0};
    void *r;
    if (is_send) {
        prm.cb.send = pdm__send_cb;
        r = ucp_tag_send_nbx(ep, buf, count, tag, &prm);
    } else {
        /* Always complete through the callback, which reports the received length. */
        prm.cb.recv = pdm__recv_cb;
        prm.op_attr_mask |= UCP_OP_ATTR_FIELD_RECV_INFO | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
        prm.recv_info.tag_info = &info;
        r = ucp_tag_recv_nbx(kvt->worker, buf, count, tag, UINT64_MAX, &prm);
    }
    pthread_mutex_lock(&kvt->lock);
    if (UCS_PTR_IS_ERR(r)) {
        s->ucx_alive = 0;
        s->state = SLOT_FREE;
        pthread_mutex_unlock(&kvt->lock);
        return pdm_error_set(pdm__from_ucs(UCS_PTR_STATUS(r)), "kvtransfer: %s to peer %d: %s",
                             is_send ? "send" : "receive", peer,
                             ucs_status_string(UCS_PTR_STATUS(r)));
    }
    if (r == NULL) { /* completed inline: no callback will come */
        pdm__slot_complete(kvt, s, UCS_OK, is_send ? s->total : info.length);
    } else if (s->ucx_alive) {
        s->ureq = r;
    }
    /* else: the callback already ran on the progress thread and freed r. */
    pthread_mutex_unlock(&kvt->lock);
    if (kvt->use_thread) ucp_worker_signal(kvt->worker);
    *req = (pdm_kvt_req_t)((s->gen << 16) | idx);
    return PDM_OK;
}

int pdm_kvt_isend(pdm_kvt_t *kvt, int peer, uint64_t tag, const pdm_kvt_iov_t *iov, int n_iov,
                  pdm_kvt_req_t *req)
{
    return pdm__post(kvt, 1, peer, tag, iov, n_iov, req);
}

int pdm_kvt_irecv(pdm_kvt_t *kvt, int peer, uint64_t tag, const pdm_kvt_iov_t *iov, int n_iov,
                  pdm_kvt_req_t *req)
{
    return pdm__post(kvt, 0, peer, tag, iov, n_iov, req);
}

/* The slot of a live handle, returned with kvt->lock held; PDM_EINVAL (lock not held) for a
 * malformed handle or one already released. */
static int pdm__slot_lock(pdm_kvt_t *kvt, pdm_kvt_req_t req, pdm__slot_t **out)
{
    int idx = req & 0xffff, gen = (req >> 16) & 0x7fff;
    if (req < 0 || idx >= kvt->n_slots)
        return pdm_error_set(PDM_EINVAL, "kvtransfer: bad request handle %d", req);
    pdm__slot_t *s = &kvt->slots[idx];
    pthread_mutex_lock(&kvt->lock);
    if (s->gen != gen || s->state == SLOT_FREE || s->state == SLOT_ORPHAN) {
        pthread_mutex_unlock(&kvt->lock);
        return pdm_error_set(PDM_EINVAL, "kvtransfer: stale request handle %d", req);
    }
    *out = s;
    return PDM_OK;
}

int pdm_kvt_wait(pdm_kvt_t *kvt, pdm_kvt_req_t req, double deadline, size_t *bytes)
{
    pdm__slot_t *s;
    if (pdm__slot_lock(kvt, req, &s)) return PDM_EINVAL;
    int timed_out = 0;
    double grace_end = 0;
    atomic_fetch_add(&kvt->n_waiters, 1);
    while (s->state == SLOT_PENDING) {
        double now = pdm_now();
        if (!kvt->peers[s->peer].alive || (now >= deadline && !timed_out)) {
            if (!grace_end) {
                if (kvt->peers[s->peer].alive) timed_out = 1;
                grace_end = now + PDM__KVT_GRACE;
                int peer = s->peer;
                pthread_mutex_unlock(&kvt->lock);
                pdm_kvt_peer_fail(kvt, peer, "operation timed out");
                pthread_mutex_lock(&kvt->lock);
                continue;
            }
            if (now >= grace_end) break;
        }
        /* The waiter has nothing else to do: it polls the worker itself, as MPI and NCCL
         * do, instead of sleeping until the progress thread is woken through the event fd
         * (that costs a millisecond per message once both threads consume events). It
         * yields the core between polls because ranks may share cores. */
        pthread_mutex_unlock(&kvt->lock);
        if (!pdm_kvt_progress(kvt)) sched_yield();
        pthread_mutex_lock(&kvt->lock);
    }
    atomic_fetch_sub(&kvt->n_waiters, 1);
    int status;
    const char *what = s->is_send ? "send to" : "receive from";
    int peer = s->peer;
    uint64_t tag = s->tag;
    if (s->state == SLOT_DONE && !timed_out) {
        status = s->status;
        if (bytes) *bytes = s->length;
        s->state = SLOT_FREE;
    } else {
        status = timed_out ? PDM_ETIMEOUT : PDM_EPEER;
        if (s->state == SLOT_DONE || !s->ucx_alive)
            s->state = SLOT_FREE;
        else
            s->state = SLOT_ORPHAN; /* UCX still holds it; freed at its callback */
    }
    pthread_mutex_unlock(&kvt->lock);
    if (status == PDM_ETIMEOUT)
        return pdm_error_set(status, "kvtransfer: %s peer %d (tag %016llx) timed out", what,
                             peer, (unsigned long long)tag);
    if (status == PDM_EOVERFLOW)
        return pdm_error_set(status, "kvtransfer: message from peer %d (tag %016llx) is larger "
                             "than the receive buffer", peer, (unsigned long long)tag);
    if (status != PDM_OK)
        return pdm_error_set(status, "kvtransfer: %s peer %d (tag %016llx) failed: %s", what,
                             peer, (unsigned long long)tag, pdm_strerror(status));
    return PDM_OK;
}

int pdm_kvt_wait_all(pdm_kvt_t *kvt, pdm_kvt_req_t *reqs, int n, double deadline)
{
    int first = PDM_OK;
    char msg[512] = "";
    for (int i = 0; i < n; i++) {
        if (reqs[i] == PDM_KVT_REQ_NONE) continue;
        /* After a failure, still release the rest (they fail fast on dead peers). */
        int st = pdm_kvt_wait(kvt, reqs[i], first ? pdm_now() : deadline, NULL);
        reqs[i] = PDM_KVT_REQ_NONE;
        if (st && !first) {
            first = st;
            snprintf(msg, sizeof(msg), "%s", pdm_error_last());
        }
    }
    if (first) return pdm_error_set(first, "%s", msg);
    return PDM_OK;
}

void pdm_kvt_stats(pdm_kvt_t *kvt, pdm_kvt_stats_t *out)
{
    pthread_mutex_lock(&kvt->lock);
    *out = kvt->stats;
    pthread_mutex_unlock(&kvt->lock);
}

int pdm_kvt_peer_stats(pdm_kvt_t *kvt, int peer, pdm_kvt_stats_t *out)
{
    pthread_mutex_lock(&kvt->lock);
    int ok = peer >= 0 && peer < kvt->n_peers;
    if (ok) *out = kvt->peers[peer].stats;
    pthread_mutex_unlock(&kvt->lock);
    return ok ? PDM_OK : pdm_error_set(PDM_EINVAL, "kvtransfer: no peer %d", peer);
}

void pdm_kvt_peer_transports(pdm_kvt_t *kvt, int peer, char *buf, size_t size)
{
    if (size) buf[0] = 0;
    pthread_mutex_lock(&kvt->lock);
    ucp_ep_h ep = peer >= 0 && peer < kvt->n_peers ? kvt->peers[peer].ep : NULL;
    pthread_mutex_unlock(&kvt->lock);
    if (!ep || size == 0) return;
    char *text = NULL;
    size_t text_len = 0;
    FILE *f = open_memstream(&text, &text_len);
    if (!f) return;
    ucp_ep_print_info(ep, f);
    fclose(f);
    /* Keep the lane lines ("lane[0]: 2:posix/memory.0 md[2] ..."): they name the transports. */
    size_t used = 0;
    for (char *line = strtok(text, "\n"); line && used + 2 < size; line = strtok(NULL, "\n")) {
        char *colon = strstr(line, "lane[");
        if (!colon) continue;
        char *p = strchr(colon, ':');
        if (!p) continue;
        p++;
        while (*p == ' ') p++;
        char word[64];
        if (sscanf(p, "%63s", word) != 1) continue;
        char *tl = strchr(word, ':');
        const char *name = tl ? tl + 1 : word;
        if (strstr(buf, name)) continue;
        int w = snprintf(buf + used, size - used, "%s%s", used ? "," : "", name);
        if (w < 0 || (size_t)w >= size - used) break;
        used += (size_t)w;
    }
    free(text);
}

void pdm_kvt_cancel(pdm_kvt_t *kvt, pdm_kvt_req_t *reqs, int n)
{
    /* Cancel every receive first, then wait once: a receive already matched by a message in
     * flight cannot be cancelled and completes when its data is in, so waiting for each in
     * turn could add one grace period per request. No other thread progresses the worker
     * meanwhile (see progress_lock). */
    pthread_mutex_lock(&kvt->progress_lock);
    pthread_mutex_lock(&kvt->lock);
    for (int i = 0; i < n; i++) {
        pdm__slot_t *s;
        if (reqs[i] == PDM_KVT_REQ_NONE) continue;
        if (pdm__slot_lock(kvt, reqs[i], &s)) { /* released already */
            reqs[i] = PDM_KVT_REQ_NONE;
            continue;
        }
        if (s->state == SLOT_PENDING && s->ucx_alive && s->ureq && !s->is_send)
            ucp_request_cancel(kvt->worker, s->ureq); /* may complete inline (recursive lock) */
        pthread_mutex_unlock(&kvt->lock); /* taken by pdm__slot_lock */
    }
    pthread_mutex_unlock(&kvt->progress_lock);
    double until = pdm_now() + PDM__KVT_GRACE;
    for (;;) {
        int pending = 0;
        for (int i = 0; i < n; i++)
            if (reqs[i] != PDM_KVT_REQ_NONE &&
                kvt->slots[reqs[i] & 0xffff].state == SLOT_PENDING)
                pending++;
        if (!pending || pdm_now() >= until) break;
        pthread_mutex_unlock(&kvt->lock);
        if (!pdm_kvt_progress(kvt)) sched_yield();
        pthread_mutex_lock(&kvt->lock);
    }
    for (int i = 0; i < n; i++) {
        if (reqs[i] == PDM_KVT_REQ_NONE) continue;
        pdm__slot_t *s = &kvt->slots[reqs[i] & 0xffff];
        if (s->state == SLOT_PENDING && s->ucx_alive)
            s->state = SLOT_ORPHAN; /* UCX still owns it; freed at its callback */
        else
            s->state = SLOT_FREE;
        reqs[i] = PDM_KVT_REQ_NONE;
    }
    pthread_mutex_unlock(&kvt->lock);
}

/* Finishes pdm_kvt_drain's receives in flight (progress_lock held). A finished one goes to cb
 * when its tag matches (tag, mask), then is freed. One still in flight past its grace is
 * cancelled; one a cancel has not ended within another grace is given up: its request is
 * released (UCX frees it when it ends) and its buffer leaked, since UCX may still write it. */
static void pdm__drains_reap(pdm_kvt_t *kvt, uint64_t tag, uint64_t mask, pdm_kvt_drain_cb cb,
                             void *arg, double now)
{
    for (int i = 0; i < kvt->n_drains;) {
        pdm__drain_t *d = &kvt->drains[i];
        const ucs_status_t st = ucp_request_check_status(d->ureq);
        if (st == UCS_INPROGRESS && (now < d->cancel_at || d->abandoned)) {
            i++;
            continue;
        }
        if (st == UCS_INPROGRESS && !d->cancelled) {
            ucp_request_cancel(kvt->worker, d->ureq); /* may end it at once: looked at again */
            d->cancelled = 1;
            d->cancel_at = now + PDM__KVT_GRACE;
            continue;
        }
        if (st == UCS_INPROGRESS) { /* UCX may still write its buffer: kept until it ends */
            d->abandoned = 1;
            kvt->n_abandoned++;
            kvt->drains_abandoned++;
            pdm_log_warn("kvt: a drained message (tag %016llx, %zu bytes) did not end %.0f s "
                         "after its cancel: kept until its endpoint fails",
                         (unsigned long long)d->tag, d->len, PDM__KVT_GRACE);
            i++;
            continue;
        }
        ucp_request_free(d->ureq);
        if (st == UCS_OK && cb && !d->abandoned && ((d->tag ^ tag) & mask) == 0)
            cb(arg, d->tag, d->buf, d->len);
        if (d->abandoned) kvt->n_abandoned--;
        free(d->buf);
        kvt->drain_bytes -= d->len;
        kvt->drains[i] = kvt->drains[--kvt->n_drains];
    }
}

int pdm_kvt_drain(pdm_kvt_t *kvt, uint64_t tag, uint64_t mask, pdm_kvt_drain_cb cb, void *arg)
{
    int n = 0;
    pdm_kvt_progress(kvt);
    pthread_mutex_lock(&kvt->progress_lock);
    const double now = pdm_now();
    pdm__drains_reap(kvt, tag, mask, cb, arg, now);
    /* One list entry must be free before a message leaves UCX's queue (it may not complete
     * at once); with none, the rest stays queued for a later call. */
    for (int guard = 0; guard < 65536 &&
                        kvt->n_drains - kvt->n_abandoned < PDM__KVT_MAX_DRAINS &&
                        kvt->n_drains < 2 * PDM__KVT_MAX_DRAINS &&
                        kvt->drain_bytes < PDM__KVT_DRAIN_BYTES;
         guard++) {
        ucp_tag_recv_info_t info;
        ucp_tag_message_h msg = ucp_tag_probe_nb(kvt->worker, tag, mask, 1, &info);
        if (!msg) break;
        n++;
        /* Removed from the unexpected queue: it must be received, whatever its size. */
        void *buf = malloc(info.length ? info.length : 1);
        if (!buf) {
            pdm_log_warn("kvt: no memory to drain a message of %zu bytes: lost", info.length);
            continue;
        }
        ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_DATATYPE,
                                   .datatype = ucp_dt_make_contig(1)};
        void *r = ucp_tag_msg_recv_nbx(kvt->worker, buf, info.length, msg, &prm);
        ucs_status_t st = UCS_PTR_IS_PTR(r) ? ucp_request_check_status(r) : UCS_PTR_STATUS(r);
        if (st == UCS_INPROGRESS) { /* finished (or given up) by a later call */
            kvt->drains[kvt->n_drains++] = (pdm__drain_t){
                .ureq = r, .buf = buf, .len = info.length, .tag = info.sender_tag,
                .cancel_at = now + PDM__KVT_GRACE};
            kvt->drain_bytes += info.length;
            continue;
        }
        if (UCS_PTR_IS_PTR(r)) ucp_request_free(r);
        if (st == UCS_OK && cb) cb(arg, info.sender_tag, buf, info.length);
        free(buf);
    }
    pthread_mutex_unlock(&kvt->progress_lock);
    return n;
}

int pdm_kvt_drain_pending(pdm_kvt_t *kvt, uint64_t *abandoned)
{
    pthread_mutex_lock(&kvt->progress_lock);
    const int n = kvt->n_drains - kvt->n_abandoned;
    if (abandoned) *abandoned = kvt->drains_abandoned;
    pthread_mutex_unlock(&kvt->progress_lock);
    return n;
}

int pdm_kvt_test(pdm_kvt_t *kvt, pdm_kvt_req_t req, size_t *bytes)
{
    pdm__slot_t *s;
    if (pdm__slot_lock(kvt, req, &s)) return PDM_EINVAL;
    int pending = s->state == SLOT_PENDING && kvt->peers[s->peer].alive;
    pthread_mutex_unlock(&kvt->lock);
    if (pending) {
        if (!kvt->use_thread) pdm_kvt_progress(kvt);
        pthread_mutex_lock(&kvt->lock);
        pending = s->state == SLOT_PENDING && kvt->peers[s->peer].alive;
        pthread_mutex_unlock(&kvt->lock);
        if (pending) return 0;
    }
    /* Done, or its peer failed: let pdm_kvt_wait release it and report. */
    int st = pdm_kvt_wait(kvt, req, pdm_now() + PDM__KVT_GRACE, bytes);
    return st ? st : 1;
}
