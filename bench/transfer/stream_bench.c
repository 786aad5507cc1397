/*
 * stream_bench.c - throughput of pdmesh's KV streaming between two processes.
 *
 * The process forks: the parent is the decode side (receiver), the child the prefill side
 * (sender). Each creates its own pdm_kvt endpoint after the fork; the worker addresses travel
 * over pipes. The request's KV is laid out as in a KV cache (head-major, one [tokens][head_dim]
 * array of K and one of V per (layer, kv head)) on both sides; the receiver scatters straight
 * into its arrays, which are allocated and touched once before the first repetition.
 *
 * Modes:
 *   stream  pdm_kvt_stream_rx_start/rx_wait on the receiver, pdm_kvt_stream_tx_send/finish
 *           on the sender: 64-byte headers, XXH3-64 of every block on both sides, plan checks.
 *   raw     the same blocks as plain pdm_kvt_isend/irecv of [K rows | V rows] (no header,
 *           no checksum), the same window of sends in flight: the transport alone.
 *
 * A repetition is timed from the sender's first send (pdm_now() before it, a system-wide
 * CLOCK_MONOTONIC, handed to the receiver over a pipe afterwards) to the receiver's last
 * completion (rx_wait success / wait_all). The receiver posts everything before it tells the
 * sender to go (a small tagged message), so posting is not timed.
 *
 * Prints one JSON object per mode on stdout, then one for the checksum alone ("mode":"xxh64":
 * the checksum's single-thread throughput over the same payload, no transport).
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/pdm.h"
#include "kernels/kernels.h"
#include "kvtransfer/kvtransfer.h"

typedef struct {
    int tokens;    /* tokens of the request */
    int chunks;    /* token ranges (one block per layer x head x chunk) */
    int layers, heads, head_dim;
    int elem;      /* bytes per element (2: f16, 4: f32) */
    int reps, warmup, window;
    int stream, raw;
    int keyed;     /* --key 1: the request's KV key, a MAC on every block header */
    double timeout;
} opts_t;

/* The benchmark's KV key (the mesh draws one per request attempt). */
static const uint8_t bench_key[PDM_KVT_KEY_BYTES] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                                     14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24,
                                                     25, 26, 27, 28, 29, 30, 31, 32};

static void usage(void)
{
    fprintf(stderr,
            "usage: stream_bench [--tokens T] [--chunks C] [--layers L] [--heads H]\n"
            "                    [--head-dim D] [--dtype f16|f32] [--reps N] [--warmup N]\n"
            "                    [--window W] [--mode stream|raw|both] [--timeout S] [--key 0|1]\n"
            "Defaults: 4096 tokens, 1 chunk, 30 layers, 3 heads, head_dim 64, f16, 5 reps,\n"
            "1 warm-up, window 64, both modes. Transport from UCX_TLS as in pdmesh.\n");
}

static int parse(int argc, char **argv, opts_t *o)
{
    *o = (opts_t){.tokens = 4096, .chunks = 1, .layers = 30, .heads = 3, .head_dim = 64,
                  .elem = 2, .reps = 5, .warmup = 1, .window = 64, .stream = 1, .raw = 1,
                  .timeout = 120};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage();
            exit(0);
        }
        if (!v) {
            usage();
            return -1;
        }
        i++;
        if (!strcmp(a, "--tokens")) o->tokens = atoi(v);
        else if (!strcmp(a, "--chunks")) o->chunks = atoi(v);
        else if (!strcmp(a, "--layers")) o->layers = atoi(v);
        else if (!strcmp(a, "--heads")) o->heads = atoi(v);
        else if (!strcmp(a, "--head-dim")) o->head_dim = atoi(v);
        else if (!strcmp(a, "--reps")) o->reps = atoi(v);
        else if (!strcmp(a, "--warmup")) o->warmup = atoi(v);
        else if (!strcmp(a, "--window")) o->window = atoi(v);
        else if (!strcmp(a, "--timeout")) o->timeout = atof(v);
        else if (!strcmp(a, "--key")) o->keyed = atoi(v) != 0;
        else if (!strcmp(a, "--dtype")) {
            if (!strcmp(v, "f16")) o->elem = 2;
            else if (!strcmp(v, "f32")) o->elem = 4;
            else return -1;
        } else if (!strcmp(a, "--mode")) {
            o->stream = !strcmp(v, "stream") || !strcmp(v, "both");
            o->raw = !strcmp(v, "raw") || !strcmp(v, "both");
            if (!o->stream && !o->raw) return -1;
        } else {
            usage();
            return -1;
        }
    }
    if (o->tokens < 1 || o->chunks < 1 || o->chunks > o->tokens || o->chunks > 256 ||
        o->layers < 1 || o->layers > 4095 || o->heads < 1 || o->heads > 255 ||
        o->head_dim < 1 || o->reps < 1 || o->warmup < 0 || o->window < 1 || o->window > 4096 ||
        !(o->timeout > 0)) {
        fprintf(stderr, "stream_bench: bad arguments\n");
        return -1;
    }
    return 0;
}

/* ---- Pipes: addresses, start times --------------------------------------------------------- */

static int write_all(int fd, const void *buf, size_t len)
{
    const char *p = buf;
    while (len) {
        ssize_t n = write(fd, p, len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

static int read_all(int fd, void *buf, size_t len)
{
    char *p = buf;
    while (len) {
        ssize_t n = read(fd, p, len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

/* Creates the endpoint, swaps addresses over (rfd, wfd) and connects. */
static int setup(int rfd, int wfd, pdm_kvt_t **kvt, int *peer)
{
    pdm_kvt_params_t prm;
    pdm_kvt_params_default(&prm);
    prm.max_requests = 8192;
    if (pdm_kvt_create(&prm, kvt)) return -1;
    const void *addr;
    size_t len;
    pdm_kvt_address(*kvt, &addr, &len);
    uint64_t l64 = len;
    if (write_all(wfd, &l64, sizeof(l64)) || write_all(wfd, addr, len)) return -1;
    uint64_t rl;
    if (read_all(rfd, &rl, sizeof(rl)) || rl == 0 || rl > (1u << 20)) return -1;
    void *raddr = malloc(rl);
    if (!raddr || read_all(rfd, raddr, rl)) return -1;
    int st = pdm_kvt_connect(*kvt, raddr, rl, peer);
    free(raddr);
    return st ? -1 : 0;
}

/* ---- The request's KV ------------------------------------------------------------------- */

typedef struct {
    size_t row_bytes, head_bytes;
    int n_arrays;
    char *storage;
    void **k, **v; /* [layers * heads] */
} kv_t;

static int kv_alloc(const opts_t *o, kv_t *kv, uint64_t seed)
{
    kv->row_bytes = (size_t)o->head_dim * (size_t)o->elem;
    kv->head_bytes = ((size_t)o->tokens * kv->row_bytes + 63) & ~(size_t)63;
    kv->n_arrays = o->layers * o->heads;
    kv->storage = aligned_alloc(64, kv->head_bytes * 2 * (size_t)kv->n_arrays);
    kv->k = calloc((size_t)kv->n_arrays, sizeof(void *));
    kv->v = calloc((size_t)kv->n_arrays, sizeof(void *));
    if (!kv->storage || !kv->k || !kv->v) return -1;
    for (int i = 0; i < kv->n_arrays; i++) {
        kv->k[i] = kv->storage + (size_t)(2 * i) * kv->head_bytes;
        kv->v[i] = kv->storage + (size_t)(2 * i + 1) * kv->head_bytes;
    }
    /* Touch every page (random contents on the sender, zeros on the receiver). */
    uint64_t x = seed | 1;
    size_t words = kv->head_bytes * 2 * (size_t)kv->n_arrays / 8;
    uint64_t *w = (uint64_t *)kv->storage;
    for (size_t i = 0; i < words; i++) {
        if (seed) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
        }
        w[i] = seed ? x : 0;
    }
    return 0;
}

static void kv_free(kv_t *kv)
{
    free(kv->storage);
    free(kv->k);
    free(kv->v);
}

static void chunk_range(const opts_t *o, int c, int32_t *start, int32_t *n)
{
    int64_t a = (int64_t)o->tokens * c / o->chunks, b = (int64_t)o->tokens * (c + 1) / o->chunks;
    *start = (int32_t)a;
    *n = (int32_t)(b - a);
}

#define TAG_GO(rep) pdm_kvt_tag(PDM_KVT_KIND_PING, 0, 0xbe, 0, (rep))
#define TAG_RAW(rep, l, h, c, piece)                                                            \
    pdm_kvt_stream_piece_tag(pdm_kvt_stream_tag(0x80000u + (uint32_t)(rep), 0, (l), (h), (c)),  \
                             (piece))

/* ---- Sender ---------------------------------------------------------------------------- */

static int sender_rep(const opts_t *o, pdm_kvt_t *kvt, int peer, const kv_t *kv, int raw, int rep,
                      double *t0)
{
    /* Wait for the receiver to have posted everything. */
    char go = 0;
    pdm_kvt_iov_t giov = {&go, 1};
    pdm_kvt_req_t gr;
    if (pdm_kvt_irecv(kvt, peer, TAG_GO(rep), &giov, 1, &gr) ||
        pdm_kvt_wait(kvt, gr, pdm_now() + o->timeout, NULL))
        return -1;
    const double deadline = pdm_now() + o->timeout;
    *t0 = pdm_now();
    if (!raw) {
        pdm_kvt_stream_tx_t *tx;
        if (pdm_kvt_stream_tx_create(kvt, peer, (uint64_t)rep + 1, 0, o->window, o->timeout, &tx))
            return -1;
        pdm_kvt_stream_tx_set_key(tx, o->keyed ? bench_key : NULL);
        int st = 0;
        for (int l = 0; l < o->layers && !st; l++)
            for (int h = 0; h < o->heads && !st; h++)
                for (int c = 0; c < o->chunks && !st; c++) {
                    int32_t s, n;
                    chunk_range(o, c, &s, &n);
                    size_t i = (size_t)l * (size_t)o->heads + (size_t)h;
                    st = pdm_kvt_stream_tx_send(tx, (uint32_t)l, (uint32_t)h, (uint32_t)c, s, n,
                                                o->elem == 2 ? PDM_DT_F16 : PDM_DT_F32, 1.0f,
                                                (char *)kv->k[i] + (size_t)s * kv->row_bytes,
                                                (char *)kv->v[i] + (size_t)s * kv->row_bytes,
                                                kv->row_bytes);
                }
        if (!st) st = pdm_kvt_stream_tx_finish(tx, deadline);
        pdm_kvt_stream_tx_destroy(tx);
        return st ? -1 : 0;
    }
    /* Raw: K and V of each block as two contiguous messages, the same window of blocks in
     * flight, retired oldest first. */
    pdm_kvt_req_t *ring = malloc(sizeof(*ring) * 2 * (size_t)o->window);
    if (!ring) return -1;
    int head = 0, count = 0, st = 0;
    for (int l = 0; l < o->layers && !st; l++)
        for (int h = 0; h < o->heads && !st; h++)
            for (int c = 0; c < o->chunks && !st; c++) {
                if (count == o->window) {
                    st = pdm_kvt_wait_all(kvt, &ring[2 * head], 2, deadline);
                    head = (head + 1) % o->window;
                    count--;
                    if (st) break;
                }
                int32_t s, n;
                chunk_range(o, c, &s, &n);
                size_t i = (size_t)l * (size_t)o->heads + (size_t)h;
                size_t off = (size_t)s * kv->row_bytes, len = (size_t)n * kv->row_bytes;
                pdm_kvt_iov_t k = {(char *)kv->k[i] + off, len}, v = {(char *)kv->v[i] + off, len};
                pdm_kvt_req_t *r = &ring[2 * ((head + count) % o->window)];
                st = pdm_kvt_isend(kvt, peer, TAG_RAW(rep, l, h, c, PDM_KVT_PIECE_K), &k, 1, &r[0]);
                if (!st)
                    st = pdm_kvt_isend(kvt, peer, TAG_RAW(rep, l, h, c, PDM_KVT_PIECE_V), &v, 1,
                                       &r[1]);
                if (!st) count++;
            }
    while (count > 0) {
        int s2 = pdm_kvt_wait_all(kvt, &ring[2 * head], 2, deadline);
        if (s2 && !st) st = s2;
        head = (head + 1) % o->window;
        count--;
    }
    free(ring);
    return st ? -1 : 0;
}

/* ---- Receiver -------------------------------------------------------------------------- */

static int receiver_rep(const opts_t *o, pdm_kvt_t *kvt, int peer, const kv_t *kv, int raw,
                        int rep, double *t_end, uint64_t *payload)
{
    const int n_blocks = o->layers * o->heads * o->chunks;
    pdm_kvt_stream_block_t *blocks = malloc(sizeof(*blocks) * (size_t)n_blocks);
    pdm_kvt_req_t *reqs = malloc(sizeof(*reqs) * 2 * (size_t)n_blocks);
    if (!blocks || !reqs) return -1;
    int b = 0, st = 0;
    for (int l = 0; l < o->layers; l++)
        for (int h = 0; h < o->heads; h++)
            for (int c = 0; c < o->chunks; c++, b++) {
                int32_t s, n;
                chunk_range(o, c, &s, &n);
                blocks[b] = (pdm_kvt_stream_block_t){.peer = peer, .layer = (uint32_t)l,
                                                     .head = (uint32_t)h, .chunk = (uint32_t)c,
                                                     .token_start = s, .n_tokens = n};
            }
    pdm_kvt_stream_rx_t *rx = NULL;
    if (!raw) {
        pdm_kvt_stream_rx_params_t p = {
            .request_id = (uint64_t)rep + 1,
            .attempt = 0,
            .n_layers = (uint32_t)o->layers,
            .n_kv_heads = (uint32_t)o->heads,
            .dtype = o->elem == 2 ? PDM_DT_F16 : PDM_DT_F32,
            .row_bytes = kv->row_bytes,
            .n_tokens = o->tokens,
            .k = kv->k,
            .v = kv->v,
            .blocks = blocks,
            .n_blocks = n_blocks,
            .key = o->keyed ? bench_key : NULL,
        };
        st = pdm_kvt_stream_rx_start(kvt, &p, &rx);
    } else {
        for (b = 0; b < n_blocks && !st; b++) {
            const pdm_kvt_stream_block_t *blk = &blocks[b];
            size_t i = (size_t)blk->layer * (size_t)o->heads + blk->head;
            size_t off = (size_t)blk->token_start * kv->row_bytes;
            size_t len = (size_t)blk->n_tokens * kv->row_bytes;
            pdm_kvt_iov_t k = {(char *)kv->k[i] + off, len}, v = {(char *)kv->v[i] + off, len};
            st = pdm_kvt_irecv(kvt, peer,
                               TAG_RAW(rep, blk->layer, blk->head, blk->chunk, PDM_KVT_PIECE_K),
                               &k, 1, &reqs[2 * b]);
            if (!st)
                st = pdm_kvt_irecv(kvt, peer,
                                   TAG_RAW(rep, blk->layer, blk->head, blk->chunk, PDM_KVT_PIECE_V),
                                   &v, 1, &reqs[2 * b + 1]);
        }
    }
    if (st) {
        fprintf(stderr, "stream_bench: posting receives: %s\n", pdm_error_last());
        return -1;
    }
    char go = 1;
    pdm_kvt_iov_t giov = {&go, 1};
    pdm_kvt_req_t gr;
    const double deadline = pdm_now() + o->timeout;
    if (pdm_kvt_isend(kvt, peer, TAG_GO(rep), &giov, 1, &gr)) return -1;
    if (!raw) {
        st = pdm_kvt_stream_rx_wait(rx, deadline);
        *t_end = pdm_now();
        pdm_kvt_stream_stats_t ss;
        pdm_kvt_stream_rx_stats(rx, &ss);
        *payload = ss.bytes;
        pdm_kvt_stream_rx_destroy(rx);
    } else {
        st = pdm_kvt_wait_all(kvt, reqs, 2 * n_blocks, deadline);
        *t_end = pdm_now();
        *payload = (uint64_t)o->tokens * kv->row_bytes * 2 * (uint64_t)(o->layers * o->heads);
    }
    if (st) fprintf(stderr, "stream_bench: receiving: %s\n", pdm_error_last());
    if (pdm_kvt_wait(kvt, gr, pdm_now() + o->timeout, NULL)) st = -1;
    free(blocks);
    free(reqs);
    return st ? -1 : 0;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* ---- Main ------------------------------------------------------------------------------- */

int main(int argc, char **argv)
{
    opts_t o;
    if (parse(argc, argv, &o)) return 2;
    int to_child[2], to_parent[2];
    if (pipe(to_child) || pipe(to_parent)) {
        perror("pipe");
        return 1;
    }
    const int modes[2] = {0, 1}; /* stream, raw */
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0) {
        perror("fork");
        return 1;
    }
    if (pid == 0) { /* sender */
        close(to_child[1]);
        close(to_parent[0]);
        int rfd = to_child[0], wfd = to_parent[1];
        pdm_kvt_t *kvt;
        int peer, rc = 0;
        kv_t kv;
        if (kv_alloc(&o, &kv, 0x9e3779b97f4a7c15ull) || setup(rfd, wfd, &kvt, &peer)) {
            fprintf(stderr, "stream_bench sender: setup: %s\n", pdm_error_last());
            _exit(1);
        }
        int rep = 0;
        for (int m = 0; m < 2 && !rc; m++) {
            if ((modes[m] == 0 && !o.stream) || (modes[m] == 1 && !o.raw)) continue;
            for (int r = 0; r < o.warmup + o.reps && !rc; r++, rep++) {
                double t0 = 0;
                if (sender_rep(&o, kvt, peer, &kv, modes[m], rep, &t0)) {
                    fprintf(stderr, "stream_bench sender: %s\n", pdm_error_last());
                    rc = 1;
                    t0 = -1;
                }
                if (write_all(wfd, &t0, sizeof(t0))) rc = 1;
            }
        }
        /* Wait for the receiver to be done with us before tearing the endpoint down. */
        char bye;
        (void)read_all(rfd, &bye, 1);
        pdm_kvt_destroy(kvt);
        kv_free(&kv);
        _exit(rc);
    }
    close(to_child[0]);
    close(to_parent[1]);
    int rfd = to_parent[0], wfd = to_child[1];
    pdm_kvt_t *kvt;
    int peer, rc = 0;
    kv_t kv;
    if (kv_alloc(&o, &kv, 0) || setup(rfd, wfd, &kvt, &peer)) {
        fprintf(stderr, "stream_bench receiver: setup: %s\n", pdm_error_last());
        return 1;
    }
    char transports[256];
    int rep = 0;
    const int n_blocks = o.layers * o.heads * o.chunks;
    double *secs = calloc((size_t)o.reps, sizeof(double));
    for (int m = 0; m < 2 && !rc; m++) {
        if ((modes[m] == 0 && !o.stream) || (modes[m] == 1 && !o.raw)) continue;
        uint64_t payload = 0;
        for (int r = 0; r < o.warmup + o.reps && !rc; r++, rep++) {
            double t_end = 0, t0 = 0;
            if (receiver_rep(&o, kvt, peer, &kv, modes[m], rep, &t_end, &payload)) rc = 1;
            if (read_all(rfd, &t0, sizeof(t0)) || t0 < 0) rc = 1;
            if (!rc && r >= o.warmup) secs[r - o.warmup] = t_end - t0;
        }
        if (rc) break;
        /* The transports UCX chose, once the large messages have gone through. */
        pdm_kvt_peer_transports(kvt, peer, transports, sizeof(transports));
        qsort(secs, (size_t)o.reps, sizeof(double), cmp_double);
        double med = o.reps % 2 ? secs[o.reps / 2] : (secs[o.reps / 2 - 1] + secs[o.reps / 2]) / 2;
        const size_t row = kv.row_bytes;
        const uint64_t header = modes[m] == 0 ? sizeof(pdm_kvt_block_header_t) : 0;
        const uint64_t wire = payload + header * (uint64_t)n_blocks;
        const size_t block_tokens = (size_t)(o.tokens / o.chunks);
        printf("{\"mode\":\"%s\",\"tokens\":%d,\"chunks\":%d,\"layers\":%d,\"heads\":%d,"
               "\"head_dim\":%d,\"elem_bytes\":%d,\"blocks\":%d,\"message_bytes\":%zu,"
               "\"payload_bytes\":%" PRIu64 ",\"wire_bytes\":%" PRIu64 ",\"window\":%d,"
               "\"reps\":%d,\"seconds\":[",
               modes[m] == 0 ? "stream" : "raw", o.tokens, o.chunks, o.layers, o.heads,
               o.head_dim, o.elem, n_blocks, (size_t)header + 2 * block_tokens * row, payload,
               wire, o.window, o.reps);
        for (int r = 0; r < o.reps; r++) printf("%s%.9f", r ? "," : "", secs[r]);
        printf("],\"median_seconds\":%.9f,\"payload_bytes_per_s\":%.6e,"
               "\"wire_bytes_per_s\":%.6e,\"ucx_tls\":\"%s\",\"transports\":\"%s\"}\n",
               med, (double)payload / med, (double)wire / med,
               getenv("UCX_TLS") ? getenv("UCX_TLS") : "", transports);
        fflush(stdout);
    }
    if (!rc) {
        /* The protocol's checksum alone (XXH3-64) over the whole payload (as the sender
         * computes it once and the receiver once more), best of 3, one thread. */
        double best = 1e30;
        uint64_t sink = 0;
        for (int r = 0; r < 3; r++) {
            double t = pdm_now();
            for (int i = 0; i < kv.n_arrays; i++)
                sink ^= pdm_kvt_block_checksum(1, kv.k[i], kv.v[i],
                                               (size_t)o.tokens * kv.row_bytes);
            t = pdm_now() - t;
            if (t < best) best = t;
        }
        uint64_t bytes = (uint64_t)o.tokens * kv.row_bytes * 2 * (uint64_t)kv.n_arrays;
        printf("{\"mode\":\"xxh64\",\"tokens\":%d,\"payload_bytes\":%" PRIu64
               ",\"seconds\":%.9f,\"payload_bytes_per_s\":%.6e,\"sink\":%" PRIu64 "}\n",
               o.tokens, bytes, best, (double)bytes / best, sink & 1);
    }
    char bye = 0;
    (void)write_all(wfd, &bye, 1);
    int wst = 0;
    waitpid(pid, &wst, 0);
    pdm_kvt_destroy(kvt);
    kv_free(&kv);
    free(secs);
    if (!WIFEXITED(wst) || WEXITSTATUS(wst) != 0) rc = 1;
    return rc;
}
