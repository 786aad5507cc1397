/*
 * test_kvtransfer.c - the UCX transport and group patterns, with several endpoints in one
 * process (each with its own worker and progress thread; UCX picks shared memory or loopback
 * between them exactly as between processes). Multi-process behaviour is covered by the
 * prefill suite.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <xxhash.h>

#include "common/pdm.h"
#include "kvtransfer/kvtransfer.h"
#include "tests.h"

typedef struct {
    pdm_kvt_t *a, *b;
    int a_to_b, b_to_a; /* peer ids */
} pair_t;

static void pair_open(pair_t *p, int max_requests)
{
    pdm_kvt_params_t prm;
    pdm_kvt_params_default(&prm);
    prm.max_requests = max_requests;
    ck_assert_int_eq(pdm_kvt_create(&prm, &p->a), 0);
    ck_assert_int_eq(pdm_kvt_create(&prm, &p->b), 0);
    const void *addr;
    size_t len;
    pdm_kvt_address(p->b, &addr, &len);
    ck_assert_int_eq(pdm_kvt_connect(p->a, addr, len, &p->a_to_b), 0);
    pdm_kvt_address(p->a, &addr, &len);
    ck_assert_int_eq(pdm_kvt_connect(p->b, addr, len, &p->b_to_a), 0);
}

static void pair_close(pair_t *p)
{
    pdm_kvt_destroy(p->a);
    pdm_kvt_destroy(p->b);
}

START_TEST(test_kvt_scatter_gather)
{
    pair_t p;
    pair_open(&p, 64);
    char s1[5] = "hello", s2[1] = {','}, s3[7] = " world!";
    char d1[3], d2[20];
    memset(d2, 0, sizeof(d2));
    pdm_kvt_iov_t out[3] = {{s1, 5}, {s2, 1}, {s3, 7}}, in[2] = {{d1, 3}, {d2, 20}};
    pdm_kvt_req_t rr, sr;
    ck_assert_int_eq(pdm_kvt_irecv(p.b, p.b_to_a, 42, in, 2, &rr), 0);
    ck_assert_int_eq(pdm_kvt_isend(p.a, p.a_to_b, 42, out, 3, &sr), 0);
    size_t got = 0;
    ck_assert_int_eq(pdm_kvt_wait(p.b, rr, pdm_now() + 10, &got), 0);
    ck_assert_int_eq(pdm_kvt_wait(p.a, sr, pdm_now() + 10, NULL), 0);
    ck_assert_uint_eq(got, 13);
    ck_assert(memcmp(d1, "hel", 3) == 0);
    ck_assert_str_eq(d2, "lo, world!");
    pdm_kvt_stats_t st;
    pdm_kvt_stats(p.b, &st);
    ck_assert_uint_eq(st.bytes_received, 13);
    pdm_kvt_stats_t ps;
    ck_assert_int_eq(pdm_kvt_peer_stats(p.a, p.a_to_b, &ps), 0);
    ck_assert_uint_eq(ps.bytes_sent, 13);
    ck_assert_uint_eq(ps.sends, 1);
    /* A handle is released by its wait: waiting again is an error, not a hang. */
    ck_assert_int_eq(pdm_kvt_wait(p.b, rr, pdm_now() + 1, NULL), PDM_EINVAL);
    pair_close(&p);
}
END_TEST

START_TEST(test_kvt_tags_match_out_of_order)
{
    pair_t p;
    pair_open(&p, 64);
    int va = 1, vb = 2, ra = 0, rb = 0;
    pdm_kvt_iov_t ia = {&ra, sizeof(ra)}, ib = {&rb, sizeof(rb)};
    pdm_kvt_iov_t oa = {&va, sizeof(va)}, ob = {&vb, sizeof(vb)};
    pdm_kvt_req_t r[4];
    ck_assert_int_eq(pdm_kvt_irecv(p.b, p.b_to_a, pdm_kvt_tag(PDM_KVT_KIND_RING, 0, 1, 3, 2), &ib,
                                   1, &r[0]), 0);
    ck_assert_int_eq(pdm_kvt_isend(p.a, p.a_to_b, pdm_kvt_tag(PDM_KVT_KIND_RING, 0, 1, 3, 1), &oa,
                                   1, &r[1]), 0);
    ck_assert_int_eq(pdm_kvt_isend(p.a, p.a_to_b, pdm_kvt_tag(PDM_KVT_KIND_RING, 0, 1, 3, 2), &ob,
                                   1, &r[2]), 0);
    ck_assert_int_eq(pdm_kvt_irecv(p.b, p.b_to_a, pdm_kvt_tag(PDM_KVT_KIND_RING, 0, 1, 3, 1), &ia,
                                   1, &r[3]), 0);
    ck_assert_int_eq(pdm_kvt_wait_all(p.a, &r[1], 2, pdm_now() + 10), 0);
    ck_assert_int_eq(pdm_kvt_wait(p.b, r[0], pdm_now() + 10, NULL), 0);
    ck_assert_int_eq(pdm_kvt_wait(p.b, r[3], pdm_now() + 10, NULL), 0);
    ck_assert_int_eq(ra, 1);
    ck_assert_int_eq(rb, 2);
    pair_close(&p);
}
END_TEST

START_TEST(test_kvt_timeout_fails_peer)
{
    pair_t p;
    pair_open(&p, 64);
    int x;
    pdm_kvt_iov_t in = {&x, sizeof(x)};
    pdm_kvt_req_t r;
    ck_assert_int_eq(pdm_kvt_irecv(p.b, p.b_to_a, 7, &in, 1, &r), 0);
    double t0 = pdm_now();
    ck_assert_int_eq(pdm_kvt_wait(p.b, r, t0 + 0.2, NULL), PDM_ETIMEOUT);
    double took = pdm_now() - t0;
    ck_assert_msg(took >= 0.19 && took < 3.0, "wait took %.3f s", took);
    ck_assert(strstr(pdm_error_last(), "timed out") != NULL);
    /* The peer is given up: new operations on it fail at once. */
    ck_assert_int_eq(pdm_kvt_peer_alive(p.b, p.b_to_a), 0);
    ck_assert_int_eq(pdm_kvt_irecv(p.b, p.b_to_a, 8, &in, 1, &r), PDM_EPEER);
    pair_close(&p);
}
END_TEST

START_TEST(test_kvt_message_too_long)
{
    pair_t p;
    pair_open(&p, 64);
    char big[64] = {0}, small[16];
    pdm_kvt_iov_t out = {big, sizeof(big)}, in = {small, sizeof(small)};
    pdm_kvt_req_t rr, sr;
    ck_assert_int_eq(pdm_kvt_irecv(p.b, p.b_to_a, 9, &in, 1, &rr), 0);
    ck_assert_int_eq(pdm_kvt_isend(p.a, p.a_to_b, 9, &out, 1, &sr), 0);
    ck_assert_int_eq(pdm_kvt_wait(p.b, rr, pdm_now() + 10, NULL), PDM_EOVERFLOW);
    pdm_kvt_wait(p.a, sr, pdm_now() + 10, NULL);
    pair_close(&p);
}
END_TEST

START_TEST(test_kvt_bounded)
{
    pair_t p;
    pair_open(&p, 4);
    int x[5];
    pdm_kvt_req_t r[5];
    for (int i = 0; i < 4; i++) {
        pdm_kvt_iov_t in = {&x[i], sizeof(int)};
        ck_assert_int_eq(pdm_kvt_irecv(p.b, p.b_to_a, 100 + (uint64_t)i, &in, 1, &r[i]), 0);
    }
    pdm_kvt_iov_t in = {&x[4], sizeof(int)};
    ck_assert_int_eq(pdm_kvt_irecv(p.b, p.b_to_a, 200, &in, 1, &r[4]), PDM_EOVERFLOW);
    ck_assert_int_eq(pdm_kvt_irecv(p.b, p.b_to_a, 200, &in, PDM_KVT_MAX_IOV + 1, &r[4]),
                     PDM_EINVAL);
    ck_assert_int_eq(pdm_kvt_irecv(p.b, 99, 200, &in, 1, &r[4]), PDM_EINVAL);
    /* Destroying with receives still posted cancels them (ASan checks for leaks). */
    pair_close(&p);
}
END_TEST

/* Three ranks in threads: barrier, all-gather with uneven parts, all-to-all. */
typedef struct {
    pdm_kvt_t *kvt[3];
    const void *addr[3];
    size_t len[3];
    int ok[3];
} trio_t;

typedef struct {
    trio_t *t;
    int rank;
} trio_arg_t;

static void *trio_main(void *p)
{
    trio_arg_t *a = p;
    trio_t *t = a->t;
    pdm_kvt_group_t g;
    if (pdm_kvt_group_init(&g, t->kvt[a->rank], a->rank, 3, t->addr, t->len, 10)) return NULL;
    /* Rank j contributes j+1 ints of value 10*j + i. */
    int data[3][3] = {{0}};
    pdm_kvt_msg_t parts[3];
    for (int j = 0; j < 3; j++) {
        if (j == a->rank)
            for (int i = 0; i <= j; i++) data[j][i] = 10 * j + i;
        parts[j].iov[0] = (pdm_kvt_iov_t){data[j], sizeof(int) * (size_t)(j + 1)};
        parts[j].n_iov = 1;
    }
    if (pdm_kvt_group_allgather(&g, 5, parts)) return NULL;
    for (int j = 0; j < 3; j++)
        for (int i = 0; i <= j; i++)
            if (data[j][i] != 10 * j + i) return NULL;
    int send[3], recv[3] = {-1, -1, -1};
    pdm_kvt_msg_t sm[3], rm[3];
    for (int j = 0; j < 3; j++) {
        send[j] = 100 * a->rank + j;
        sm[j] = (pdm_kvt_msg_t){.iov = {{&send[j], sizeof(int)}}, .n_iov = 1};
        rm[j] = (pdm_kvt_msg_t){.iov = {{&recv[j], sizeof(int)}}, .n_iov = 1};
    }
    if (pdm_kvt_group_alltoall(&g, 6, sm, rm)) return NULL;
    for (int j = 0; j < 3; j++)
        if (j != a->rank && recv[j] != 100 * j + a->rank) return NULL;
    /* all-reduce max (int8 KV scales): element i's maximum sits on rank i % 3 */
    float vals[5];
    for (int i = 0; i < 5; i++) vals[i] = i % 3 == a->rank ? 2.5f * (float)i : -(float)a->rank;
    if (pdm_kvt_group_allreduce_max(&g, 8, 0, vals, 5)) return NULL;
    for (int i = 0; i < 5; i++)
        if (vals[i] != (i == 0 ? 0.0f : 2.5f * (float)i)) return NULL;
    if (pdm_kvt_group_barrier(&g, 7)) return NULL;
    pdm_kvt_group_fini(&g);
    t->ok[a->rank] = 1;
    return NULL;
}

START_TEST(test_kvt_group_patterns)
{
    trio_t t = {0};
    for (int i = 0; i < 3; i++) {
        ck_assert_int_eq(pdm_kvt_create(NULL, &t.kvt[i]), 0);
        pdm_kvt_address(t.kvt[i], &t.addr[i], &t.len[i]);
    }
    pthread_t th[3];
    trio_arg_t args[3];
    for (int i = 0; i < 3; i++) {
        args[i] = (trio_arg_t){&t, i};
        pthread_create(&th[i], NULL, trio_main, &args[i]);
    }
    for (int i = 0; i < 3; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < 3; i++) {
        ck_assert_msg(t.ok[i], "rank %d failed: %s", i, pdm_error_last());
        pdm_kvt_destroy(t.kvt[i]);
    }
}
END_TEST

/* A formation that failed leaves its messages behind; the next formation of the same two
 * ranks must not take them for its own (a rank that took rank 0's old JOIN formed with the
 * old nonce, and the group's order then named entries its rank 0 never sent). */
typedef struct {
    pdm_kvt_t *kvt[2];
    const void *addr[2];
    size_t len[2];
    double timeout[2], delay[2], started[2], done[2];
    int st[2];
    uint32_t nonce[2];
} duo_t;

typedef struct {
    duo_t *d;
    int rank;
} duo_arg_t;

static void *duo_main(void *p)
{
    duo_arg_t *a = p;
    duo_t *d = a->d;
    usleep((useconds_t)(d->delay[a->rank] * 1e6));
    pdm_kvt_group_t g;
    d->started[a->rank] = pdm_now();
    d->st[a->rank] = pdm_kvt_group_init(&g, d->kvt[a->rank], a->rank, 2, d->addr, d->len,
                                        d->timeout[a->rank]);
    d->done[a->rank] = pdm_now();
    d->nonce[a->rank] = g.nonce;
    return NULL;
}

START_TEST(test_kvt_group_join_skips_stale)
{
    duo_t d = {0};
    for (int i = 0; i < 2; i++) {
        ck_assert_int_eq(pdm_kvt_create(NULL, &d.kvt[i]), 0);
        pdm_kvt_address(d.kvt[i], &d.addr[i], &d.len[i]);
    }
    pthread_t th[2];
    duo_arg_t args[2] = {{&d, 0}, {&d, 1}};
    for (int round = 0; round < 2; round++) {
        /* rank 0 forms alone and gives up after 0.3 s: its JOIN waits at rank 1 (in round 1
         * beside rank 1's CONFIRM of round 0's stale JOIN, which waits at rank 0) */
        d.timeout[0] = 0.3;
        d.delay[0] = 0;
        pthread_create(&th[0], NULL, duo_main, &args[0]);
        pthread_join(th[0], NULL);
        ck_assert_int_ne(d.st[0], 0);
        const uint32_t old_nonce = d.nonce[0];
        /* the next formation at once (the stale JOIN's sender gave up only just now): rank 1
         * first, rank 0 0.4 s later */
        d.timeout[0] = d.timeout[1] = 10;
        d.delay[1] = 0;
        d.delay[0] = 0.4;
        for (int i = 0; i < 2; i++) pthread_create(&th[i], NULL, duo_main, &args[i]);
        for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
        ck_assert_msg(d.st[0] == 0 && d.st[1] == 0, "round %d: the formation failed: %d %d",
                      round, d.st[0], d.st[1]);
        ck_assert_msg(d.done[1] >= d.started[0], "round %d: rank 1 formed %.3f s before rank 0 "
                      "started: it took the stale JOIN", round, d.started[0] - d.done[1]);
        ck_assert_msg(d.nonce[1] == d.nonce[0] && d.nonce[0] && d.nonce[0] != old_nonce,
                      "round %d: nonces: rank 0 %u (before %u), rank 1 %u", round, d.nonce[0],
                      old_nonce, d.nonce[1]);
    }
    for (int i = 0; i < 2; i++) pdm_kvt_destroy(d.kvt[i]);
}
END_TEST

/* ---- KV streaming ------------------------------------------------------------------------ */

enum { S_LAYERS = 2, S_HEADS = 2, S_TOKENS = 10, S_ROW = 8 };

typedef struct {
    pair_t p;
    uint8_t src_k[S_LAYERS * S_HEADS][S_TOKENS * S_ROW], src_v[S_LAYERS * S_HEADS][S_TOKENS * S_ROW];
    uint8_t dst_k[S_LAYERS * S_HEADS][S_TOKENS * S_ROW], dst_v[S_LAYERS * S_HEADS][S_TOKENS * S_ROW];
    void *k[S_LAYERS * S_HEADS], *v[S_LAYERS * S_HEADS];
    pdm_kvt_stream_block_t plan[S_LAYERS * S_HEADS * 2];
    pdm_kvt_stream_rx_params_t rx;
} stream_fix_t;

/* Two endpoints, source rows with a pattern, and a plan of two chunks (tokens 0-5, 6-9) per
 * (layer, head), all sent by a. */
static void stream_setup(stream_fix_t *f, uint32_t attempt)
{
    memset(f, 0, sizeof(*f));
    pair_open(&f->p, 256);
    int n = 0;
    for (int hi = 0; hi < S_LAYERS * S_HEADS; hi++) {
        for (int i = 0; i < S_TOKENS * S_ROW; i++) {
            f->src_k[hi][i] = (uint8_t)(hi * 31 + i);
            f->src_v[hi][i] = (uint8_t)(hi * 17 + i * 3 + 1);
        }
        f->k[hi] = f->dst_k[hi];
        f->v[hi] = f->dst_v[hi];
        for (int c = 0; c < 2; c++)
            f->plan[n++] = (pdm_kvt_stream_block_t){.peer = f->p.b_to_a,
                                                    .layer = (uint32_t)(hi / S_HEADS),
                                                    .head = (uint32_t)(hi % S_HEADS),
                                                    .chunk = (uint32_t)c,
                                                    .token_start = c ? 6 : 0,
                                                    .n_tokens = c ? 4 : 6};
    }
    f->rx = (pdm_kvt_stream_rx_params_t){.request_id = 77, .attempt = attempt,
                                         .n_layers = S_LAYERS, .n_kv_heads = S_HEADS,
                                         .dtype = 1, .row_bytes = S_ROW, .n_tokens = S_TOKENS,
                                         .k = f->k, .v = f->v, .blocks = f->plan, .n_blocks = n};
}

/* int8 KV: blocks of every (layer, head) carry that head's K and V scales; the receiver records
 * them, rejects a block whose scales disagree with another block of its head, and rejects
 * blocks of another dtype with a message naming both. */
static void stream_send_q8(stream_fix_t *f, uint16_t dtype, int bad_block)
{
    pdm_kvt_stream_tx_t *tx;
    ck_assert_int_eq(pdm_kvt_stream_tx_create(f->p.a, f->p.a_to_b, 77, 1, 4, 5, &tx), 0);
    for (int b = 0; b < f->rx.n_blocks; b++) {
        const pdm_kvt_stream_block_t *blk = &f->plan[b];
        int hi = (int)(blk->layer * S_HEADS + blk->head);
        float ks = 0.5f + (float)hi, vs = 0.25f / (float)(hi + 1);
        if (b == bad_block) ks *= 1.001f;
        ck_assert_int_eq(pdm_kvt_stream_tx_send_scaled(tx, blk->layer, blk->head, blk->chunk,
                                                       blk->token_start, blk->n_tokens, dtype,
                                                       ks, vs,
                                                       f->src_k[hi] + blk->token_start * S_ROW,
                                                       f->src_v[hi] + blk->token_start * S_ROW,
                                                       S_ROW), 0);
    }
    ck_assert_int_eq(pdm_kvt_stream_tx_finish(tx, pdm_now() + 5), 0);
    pdm_kvt_stream_tx_destroy(tx);
}

START_TEST(test_stream_q8_scales)
{
    for (int round = 0; round < 3; round++) { /* ok, disagreeing scales, f16 blocks */
        stream_fix_t f;
        stream_setup(&f, 1);
        float scales[S_LAYERS * S_HEADS * 2] = {0};
        f.rx.dtype = PDM_KVT_DTYPE_I8;
        pdm_kvt_stream_rx_t *rx;
        ck_assert_int_ne(pdm_kvt_stream_rx_start(f.p.b, &f.rx, &rx), 0); /* no scales given */
        f.rx.scales = scales;
        ck_assert_int_eq(pdm_kvt_stream_rx_start(f.p.b, &f.rx, &rx), 0);
        stream_send_q8(&f, round == 2 ? 1 : PDM_KVT_DTYPE_I8, round == 1 ? 5 : -1);
        int st = pdm_kvt_stream_rx_wait(rx, pdm_now() + 5);
        if (round == 0) {
            ck_assert_msg(st == 0, "%s", pdm_error_last());
            ck_assert(memcmp(f.src_k, f.dst_k, sizeof(f.src_k)) == 0);
            for (int hi = 0; hi < S_LAYERS * S_HEADS; hi++) {
                ck_assert_float_eq(scales[2 * hi], 0.5f + (float)hi);
                ck_assert_float_eq(scales[2 * hi + 1], 0.25f / (float)(hi + 1));
            }
        } else if (round == 1) {
            ck_assert_int_eq(st, PDM_EFORMAT);
            ck_assert_msg(strstr(pdm_error_last(), "scales"), "%s", pdm_error_last());
        } else {
            ck_assert_int_eq(st, PDM_EFORMAT);
            ck_assert_msg(strstr(pdm_error_last(), "f16") && strstr(pdm_error_last(), "q8") &&
                              strstr(pdm_error_last(), "rejected"), "%s", pdm_error_last());
        }
        pdm_kvt_stream_rx_destroy(rx);
        pair_close(&f.p);
    }
}
END_TEST

/* Sends every planned block except `skip` (-1: none) from attempt `attempt`, MACed with `key`
 * (NULL: an unkeyed stream). */
static void stream_send(stream_fix_t *f, uint32_t attempt, int skip, int max_in_flight,
                        const uint8_t *key)
{
    pdm_kvt_stream_tx_t *tx;
    ck_assert_int_eq(pdm_kvt_stream_tx_create(f->p.a, f->p.a_to_b, 77, attempt, max_in_flight, 5,
                                              &tx), 0);
    pdm_kvt_stream_tx_set_key(tx, key);
    for (int b = 0; b < f->rx.n_blocks; b++) {
        if (b == skip) continue;
        const pdm_kvt_stream_block_t *blk = &f->plan[b];
        int hi = (int)(blk->layer * S_HEADS + blk->head);
        ck_assert_int_eq(pdm_kvt_stream_tx_send(tx, blk->layer, blk->head, blk->chunk,
                                                blk->token_start, blk->n_tokens, 1, 1.0f,
                                                f->src_k[hi] + blk->token_start * S_ROW,
                                                f->src_v[hi] + blk->token_start * S_ROW, S_ROW),
                         0);
    }
    ck_assert_int_eq(pdm_kvt_stream_tx_finish(tx, pdm_now() + 5), 0);
    pdm_kvt_stream_tx_destroy(tx);
}

/* Keyed streams (the request's KV key): blocks MACed with the key land and verify; a sender
 * that was not given the key (an unintroduced peer that knows the tags and can compute the
 * checksum) is refused and counted, and so is an unkeyed sender. */
START_TEST(test_stream_forged_blocks)
{
    uint8_t key[PDM_KVT_KEY_BYTES], other[PDM_KVT_KEY_BYTES];
    for (int i = 0; i < PDM_KVT_KEY_BYTES; i++) key[i] = (uint8_t)(i * 7 + 1), other[i] = key[i];
    other[5] ^= 1; /* one bit off */
    for (int round = 0; round < 3; round++) { /* the key, another key, no key */
        stream_fix_t f;
        stream_setup(&f, 1);
        f.rx.key = key;
        pdm_kvt_stream_rx_t *rx;
        ck_assert_int_eq(pdm_kvt_stream_rx_start(f.p.b, &f.rx, &rx), 0);
        stream_send(&f, 1, -1, 4, round == 0 ? key : round == 1 ? other : NULL);
        int st = pdm_kvt_stream_rx_wait(rx, pdm_now() + 5);
        pdm_kvt_stream_stats_t ss;
        pdm_kvt_stream_rx_stats(rx, &ss);
        if (round == 0) {
            ck_assert_msg(st == 0, "%s", pdm_error_last());
            ck_assert(memcmp(f.src_k, f.dst_k, sizeof(f.src_k)) == 0);
            ck_assert_int_eq(ss.forged, 0);
        } else {
            ck_assert_int_eq(st, PDM_ECHECKSUM);
            ck_assert_msg(strstr(pdm_error_last(), "forged"), "%s", pdm_error_last());
            ck_assert_int_eq(ss.forged, 1); /* the first bad block ends the request */
            ck_assert_int_eq(ss.blocks, 0);
        }
        pdm_kvt_stream_rx_destroy(rx);
        pair_close(&f.p);
    }
}
END_TEST

START_TEST(test_stream_lands_in_place)
{
    stream_fix_t f;
    stream_setup(&f, 1);
    pdm_kvt_stream_rx_t *rx;
    ck_assert_int_eq(pdm_kvt_stream_rx_start(f.p.b, &f.rx, &rx), 0);
    stream_send(&f, 1, -1, 3, NULL); /* 8 blocks through a window of 3 */
    ck_assert_msg(pdm_kvt_stream_rx_wait(rx, pdm_now() + 5) == 0, "%s", pdm_error_last());
    ck_assert(memcmp(f.src_k, f.dst_k, sizeof(f.src_k)) == 0);
    ck_assert(memcmp(f.src_v, f.dst_v, sizeof(f.src_v)) == 0);
    pdm_kvt_stream_stats_t st;
    pdm_kvt_stream_rx_stats(rx, &st);
    ck_assert_int_eq(st.blocks, 8);
    ck_assert_uint_eq(st.bytes, 2 * sizeof(f.src_k));
    ck_assert_int_eq(pdm_kvt_stream_rx_drain(rx), 0);
    pdm_kvt_stream_rx_destroy(rx);
    pair_close(&f.p);
}
END_TEST

START_TEST(test_stream_plan_checked)
{
    stream_fix_t f;
    stream_setup(&f, 1);
    pdm_kvt_stream_rx_t *rx;
    f.plan[1].token_start = 5; /* overlaps token 5 */
    ck_assert_int_eq(pdm_kvt_stream_rx_start(f.p.b, &f.rx, &rx), PDM_EINVAL);
    ck_assert(strstr(pdm_error_last(), "planned twice") != NULL);
    f.plan[1].token_start = 7; /* token 6 missing */
    f.plan[1].n_tokens = 3;
    ck_assert_int_eq(pdm_kvt_stream_rx_start(f.p.b, &f.rx, &rx), PDM_EINVAL);
    ck_assert(strstr(pdm_error_last(), "has no block") != NULL);
    pair_close(&f.p);
}
END_TEST

/* Delta transfer (token_from): rows before it are the receiver's own; the plan covers the rest
 * exactly, no block may start before it, and the rows before it are left untouched. */
START_TEST(test_stream_token_from)
{
    stream_fix_t f;
    stream_setup(&f, 1);
    pdm_kvt_stream_rx_t *rx;
    f.rx.token_from = 6; /* chunk 0 (tokens 0-5) is not planned: only chunk 1 comes */
    ck_assert_int_eq(pdm_kvt_stream_rx_start(f.p.b, &f.rx, &rx), PDM_EINVAL); /* starts at 0 */
    ck_assert(strstr(pdm_error_last(), "outside the request") != NULL);
    int n = 0;
    for (int b = 0; b < f.rx.n_blocks; b++)
        if (f.plan[b].chunk == 1) f.plan[n++] = f.plan[b];
    f.rx.n_blocks = n;
    f.rx.token_from = 7; /* token 6 is then planned but before token_from */
    ck_assert_int_eq(pdm_kvt_stream_rx_start(f.p.b, &f.rx, &rx), PDM_EINVAL);
    f.rx.token_from = 5; /* token 5 has no block */
    ck_assert_int_eq(pdm_kvt_stream_rx_start(f.p.b, &f.rx, &rx), PDM_EINVAL);
    ck_assert(strstr(pdm_error_last(), "has no block") != NULL);
    f.rx.token_from = S_TOKENS; /* nothing left to stream */
    ck_assert_int_eq(pdm_kvt_stream_rx_start(f.p.b, &f.rx, &rx), PDM_EINVAL);
    f.rx.token_from = 6;
    memset(f.dst_k, 0xee, sizeof(f.dst_k));
    memset(f.dst_v, 0xee, sizeof(f.dst_v));
    ck_assert_int_eq(pdm_kvt_stream_rx_start(f.p.b, &f.rx, &rx), 0);
    stream_send(&f, 1, -1, 3, NULL);
    ck_assert_msg(pdm_kvt_stream_rx_wait(rx, pdm_now() + 5) == 0, "%s", pdm_error_last());
    for (int hi = 0; hi < S_LAYERS * S_HEADS; hi++) {
        ck_assert(memcmp(f.src_k[hi] + 6 * S_ROW, f.dst_k[hi] + 6 * S_ROW, 4 * S_ROW) == 0);
        ck_assert(memcmp(f.src_v[hi] + 6 * S_ROW, f.dst_v[hi] + 6 * S_ROW, 4 * S_ROW) == 0);
        for (int i = 0; i < 6 * S_ROW; i++)
            ck_assert(f.dst_k[hi][i] == 0xee && f.dst_v[hi][i] == 0xee);
    }
    pdm_kvt_stream_stats_t st;
    pdm_kvt_stream_rx_stats(rx, &st);
    ck_assert_int_eq(st.blocks, S_LAYERS * S_HEADS);
    ck_assert_uint_eq(st.bytes, (uint64_t)2 * S_LAYERS * S_HEADS * 4 * S_ROW);
    ck_assert_int_eq(pdm_kvt_stream_rx_drain(rx), 0);
    pdm_kvt_stream_rx_destroy(rx);
    pair_close(&f.p);
}
END_TEST

START_TEST(test_block_checksum)
{
    /* The AVX2 build and the baseline build agree, and both equal the xxhash library's own
     * XXH3-64 of the concatenated rows (an independent build of the algorithm). */
    uint64_t st = 11;
    for (size_t n = 0; n < 3000; n = n * 2 + 1) {
        uint8_t *kv = malloc(2 * n + 1);
        for (size_t i = 0; i < 2 * n; i++) kv[i] = (uint8_t)pdm_splitmix64(&st);
        uint64_t want = XXH3_64bits_withSeed(kv, 2 * n, 99);
        ck_assert_uint_eq(pdm_kvt_block_checksum(99, kv, kv + n, n), want);
        ck_assert_uint_eq(pdm_kvt_block_checksum_generic(99, kv, kv + n, n), want);
        if (n) {
            kv[n / 2] ^= 1;
            ck_assert_uint_ne(pdm_kvt_block_checksum(99, kv, kv + n, n), want);
        }
        free(kv);
    }
}
END_TEST

START_TEST(test_stream_corrupt_block)
{
    stream_fix_t f;
    stream_setup(&f, 1);
    pdm_kvt_stream_rx_t *rx;
    ck_assert_int_eq(pdm_kvt_stream_rx_start(f.p.b, &f.rx, &rx), 0);
    /* Block 3 travels with a bit flipped after its checksum was computed. */
    pdm_kvt_block_header_t h = {.magic = PDM_KVT_BLOCK_MAGIC, .version = 2, .dtype = 1,
                                .request_id = 77, .attempt = 1, .layer = 1, .head = 0,
                                .chunk = 1, .token_start = 6, .n_tokens = 4, .row_bytes = S_ROW,
                                .scale = 1};
    uint8_t k[4 * S_ROW], v[4 * S_ROW];
    memcpy(k, f.src_k[2] + 6 * S_ROW, sizeof(k));
    memcpy(v, f.src_v[2] + 6 * S_ROW, sizeof(v));
    h.checksum = pdm_kvt_block_checksum(77, k, v, sizeof(k));
    v[5] ^= 0x10;
    pdm_kvt_iov_t iov[3] = {{&h, sizeof(h)}, {k, sizeof(k)}, {v, sizeof(v)}};
    for (int i = 0; i < PDM_KVT_PIECES; i++) {
        pdm_kvt_req_t r;
        ck_assert_int_eq(pdm_kvt_isend(f.p.a, f.p.a_to_b,
                                       pdm_kvt_stream_piece_tag(pdm_kvt_stream_tag(77, 1, 1, 0, 1),
                                                                i),
                                       &iov[i], 1, &r), 0);
        ck_assert_int_eq(pdm_kvt_wait(f.p.a, r, pdm_now() + 5, NULL), 0);
    }
    stream_send(&f, 1, 5, 4, NULL); /* the rest, correct (plan index 5 = layer 1, head 0, chunk 1) */
    ck_assert_int_eq(pdm_kvt_stream_rx_wait(rx, pdm_now() + 5), PDM_ECHECKSUM);
    ck_assert_msg(strstr(pdm_error_last(), "layer 1 head 0 tokens 6+4") != NULL, "%s",
                  pdm_error_last());
    pdm_kvt_stream_rx_destroy(rx);
    pair_close(&f.p);
}
END_TEST

START_TEST(test_stream_missing_block)
{
    stream_fix_t f;
    stream_setup(&f, 1);
    pdm_kvt_stream_rx_t *rx;
    ck_assert_int_eq(pdm_kvt_stream_rx_start(f.p.b, &f.rx, &rx), 0);
    stream_send(&f, 1, 6, 4, NULL);
    double t0 = pdm_now();
    ck_assert_int_eq(pdm_kvt_stream_rx_wait(rx, t0 + 0.3), PDM_ETIMEOUT);
    ck_assert(pdm_now() - t0 < 4);
    ck_assert_msg(strstr(pdm_error_last(), "6 of 8 blocks arrived") != NULL, "%s",
                  pdm_error_last());
    pdm_kvt_stream_rx_destroy(rx); /* cancels the receive still posted */
    pair_close(&f.p);
}
END_TEST

START_TEST(test_stream_duplicate_and_stale)
{
    stream_fix_t f;
    stream_setup(&f, 2);
    pdm_kvt_stream_rx_t *rx;
    ck_assert_int_eq(pdm_kvt_stream_rx_start(f.p.b, &f.rx, &rx), 0);
    /* A late block of attempt 1 with different contents arrives first: it must not land. */
    uint8_t junk[6 * S_ROW];
    memset(junk, 0xee, sizeof(junk));
    pdm_kvt_stream_tx_t *old;
    ck_assert_int_eq(pdm_kvt_stream_tx_create(f.p.a, f.p.a_to_b, 77, 1, 4, 5, &old), 0);
    ck_assert_int_eq(pdm_kvt_stream_tx_send(old, 0, 0, 0, 0, 6, 1, 1.0f, junk, junk, S_ROW), 0);
    ck_assert_int_eq(pdm_kvt_stream_tx_finish(old, pdm_now() + 5), 0);
    pdm_kvt_stream_tx_destroy(old);
    stream_send(&f, 2, -1, 4, NULL);
    stream_send(&f, 2, -1, 4, NULL); /* everything a second time: duplicates */
    ck_assert_msg(pdm_kvt_stream_rx_wait(rx, pdm_now() + 5) == 0, "%s", pdm_error_last());
    ck_assert(memcmp(f.src_k, f.dst_k, sizeof(f.src_k)) == 0);
    ck_assert_int_eq(pdm_kvt_stream_rx_drain(rx), 8);
    pdm_kvt_stream_stats_t st;
    pdm_kvt_stream_rx_stats(rx, &st);
    ck_assert_int_eq(st.stale, 1);
    ck_assert_int_eq(st.duplicates, 8);
    pdm_kvt_stream_rx_destroy(rx);
    pair_close(&f.p);
}
END_TEST

/* ---- Draining never waits for a stalled sender ----------------------------------------- */

typedef struct {
    int seen;
    size_t bytes;
    int intact;
} drain_seen_t;

static void drain_count(void *arg, uint64_t tag, const void *data, size_t len)
{
    drain_seen_t *d = arg;
    const unsigned char *b = data;
    d->seen++;
    d->bytes = len;
    d->intact = len > 0 && b[0] == 0x5a && b[len - 1] == 0x5a;
}

/* Drains `tag` from rx until a message is taken, progressing the sender tx until then only
 * (its announcement must go out, its data must not), within 10 s; *worst: the longest call.
 * Returns how many were taken. */
static int drain_take(pdm_kvt_t *rx, pdm_kvt_t *tx, uint64_t tag, drain_seen_t *seen,
                      double *worst)
{
    int taken = 0;
    for (double end = pdm_now() + 10; !taken && pdm_now() < end;) {
        const double t0 = pdm_now();
        taken = pdm_kvt_drain(rx, tag, ~0ull, drain_count, seen);
        if (pdm_now() - t0 > *worst) *worst = pdm_now() - t0;
        if (!taken) pdm_kvt_progress(tx);
    }
    return taken;
}

/* A dead or stalled sender's rendezvous (decode_node/node.c drains the dropped sequences'
 * streams on its loop): its receive cannot complete, and pdm_kvt_drain used to spin up to
 * the 2 s grace for it, per message, stalling every other sequence. The sender here is a
 * worker that nobody progresses (TCP only, so the receiver cannot read its memory itself):
 * the drain must return at once with the message in flight; once the sender goes on, a later
 * call completes it (its cb sees the data); a message whose sender never goes on is cancelled
 * after the grace, later calls still returning at once. No more than 256 are in flight: the
 * others wait in UCX's queue for later calls. */
START_TEST(test_kvt_drain_stalled_sender)
{
    setenv("UCX_TLS", "tcp", 1);
    setenv("UCX_RNDV_THRESH", "8192", 1);
    pdm_kvt_params_t prm;
    pdm_kvt_params_default(&prm);
    prm.max_requests = 64;
    pdm_kvt_t *rx, *tx;
    ck_assert_int_eq(pdm_kvt_create(&prm, &rx), 0);
    prm.max_requests = 1024;
    prm.progress_thread = 0; /* progressed only when the test says */
    ck_assert_int_eq(pdm_kvt_create(&prm, &tx), 0);
    const void *addr;
    size_t len;
    int to_rx, to_tx;
    pdm_kvt_address(rx, &addr, &len);
    ck_assert_int_eq(pdm_kvt_connect(tx, addr, len, &to_rx), 0);
    pdm_kvt_address(tx, &addr, &len);
    ck_assert_int_eq(pdm_kvt_connect(rx, addr, len, &to_tx), 0);
    /* wire-up both ways while the sender is progressed */
    int one = 1, got = 0;
    pdm_kvt_iov_t o1 = {&one, sizeof(one)}, i1 = {&got, sizeof(got)};
    pdm_kvt_req_t rr, sr;
    ck_assert_int_eq(pdm_kvt_irecv(rx, to_tx, 1, &i1, 1, &rr), 0);
    ck_assert_int_eq(pdm_kvt_isend(tx, to_rx, 1, &o1, 1, &sr), 0);
    ck_assert_int_eq(pdm_kvt_wait(tx, sr, pdm_now() + 10, NULL), 0);
    ck_assert_int_eq(pdm_kvt_wait(rx, rr, pdm_now() + 10, NULL), 0);

    const size_t big = 4u << 20;
    unsigned char *payload = malloc(big);
    memset(payload, 0x5a, big);
    pdm_kvt_iov_t ob = {payload, big};
    const uint64_t tag_a = 0x7100000000000001ull, tag_b = 0x7200000000000001ull;
    const uint64_t mask = ~0ull;
    double worst = 0;

    /* a stalled sender that goes on later */
    drain_seen_t seen = {0};
    ck_assert_int_eq(pdm_kvt_isend(tx, to_rx, tag_a, &ob, 1, &sr), 0);
    pdm_kvt_progress(tx);
    ck_assert_int_eq(drain_take(rx, tx, tag_a, &seen, &worst), 1);
    ck_assert_msg(worst < 1.0, "a drain call blocked %.3f s (the grace is 2 s)", worst);
    ck_assert_msg(pdm_kvt_drain_pending(rx, NULL) == 1 && seen.seen == 0,
                  "the stalled receive did not stay in flight (%d pending, %d seen)",
                  pdm_kvt_drain_pending(rx, NULL), seen.seen);
    fprintf(stderr, "drain of a stalled rendezvous: %.1f ms per call at most\n", worst * 1e3);
    ck_assert_int_eq(pdm_kvt_wait(tx, sr, pdm_now() + 10, NULL), 0); /* the sender goes on */
    for (double end = pdm_now() + 10; seen.seen == 0 && pdm_now() < end; usleep(1000))
        ck_assert_int_eq(pdm_kvt_drain(rx, tag_a, mask, drain_count, &seen), 0);
    ck_assert_msg(seen.seen == 1 && seen.bytes == big && seen.intact,
                  "the later call saw %d message(s) of %zu bytes", seen.seen, seen.bytes);
    ck_assert_int_eq(pdm_kvt_drain_pending(rx, NULL), 0);

    /* a sender that never goes on: cancelled after the grace, every call still at once */
    drain_seen_t never = {0};
    ck_assert_int_eq(pdm_kvt_isend(tx, to_rx, tag_b, &ob, 1, &sr), 0);
    pdm_kvt_progress(tx);
    worst = 0;
    ck_assert_int_eq(drain_take(rx, tx, tag_b, &never, &worst), 1);
    ck_assert_int_eq(pdm_kvt_drain_pending(rx, NULL), 1);
    for (double end = pdm_now() + 10; pdm_kvt_drain_pending(rx, NULL) && pdm_now() < end;) {
        const double t0 = pdm_now();
        pdm_kvt_drain(rx, tag_b, mask, drain_count, &never);
        if (pdm_now() - t0 > worst) worst = pdm_now() - t0;
        usleep(20000);
    }
    uint64_t abandoned = 0;
    ck_assert_msg(pdm_kvt_drain_pending(rx, &abandoned) == 0,
                  "the stalled receive is still in flight after 10 s");
    ck_assert_msg(worst < 1.0, "a drain call blocked %.3f s", worst);
    ck_assert_int_eq(never.seen, 0);
    fprintf(stderr, "a never-ending rendezvous: cancelled or given up (%llu given up), calls "
            "%.1f ms at most\n", (unsigned long long)abandoned, worst * 1e3);

    /* the bound: 256 in flight at most, the rest stays in UCX's queue for later calls */
    enum { N_MANY = 300 };
    const uint64_t tag_c = 0x7300000000000000ull, mask_c = ~0xffffull;
    pdm_kvt_iov_t om = {payload, 65536};
    pdm_kvt_req_t sm[N_MANY];
    for (int i = 0; i < N_MANY; i++)
        ck_assert_int_eq(pdm_kvt_isend(tx, to_rx, tag_c | (uint64_t)i, &om, 1, &sm[i]), 0);
    for (double end = pdm_now() + 1; pdm_now() < end; usleep(1000)) pdm_kvt_progress(tx);
    drain_seen_t many = {0};
    int taken = pdm_kvt_drain(rx, tag_c, mask_c, drain_count, &many);
    ck_assert_msg(taken == 256 && pdm_kvt_drain_pending(rx, NULL) == 256,
                  "the first call took %d messages, %d in flight", taken,
                  pdm_kvt_drain_pending(rx, NULL));
    for (double end = pdm_now() + 20; many.seen < N_MANY && pdm_now() < end;) {
        pdm_kvt_progress(tx);
        taken += pdm_kvt_drain(rx, tag_c, mask_c, drain_count, &many);
        ck_assert_int_le(pdm_kvt_drain_pending(rx, NULL), 256);
    }
    ck_assert_msg(taken == N_MANY && many.seen == N_MANY, "%d taken, %d seen", taken, many.seen);
    ck_assert_int_eq(pdm_kvt_wait_all(tx, sm, N_MANY, pdm_now() + 10), 0);
    pdm_kvt_destroy(rx);
    pdm_kvt_destroy(tx); /* (tag_b's send is still posted there: cancelled) */
    free(payload);
}
END_TEST

static void setup_env(void)
{
    setenv("UCX_HANDLE_ERRORS", "none", 0);
}

Suite *suite_kvtransfer(void)
{
    Suite *s = suite_create("kvtransfer");
    TCase *tc = tcase_create("ucx");
    tcase_add_unchecked_fixture(tc, setup_env, NULL);
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_kvt_scatter_gather);
    tcase_add_test(tc, test_kvt_tags_match_out_of_order);
    tcase_add_test(tc, test_kvt_timeout_fails_peer);
    tcase_add_test(tc, test_kvt_message_too_long);
    tcase_add_test(tc, test_kvt_bounded);
    tcase_add_test(tc, test_kvt_group_patterns);
    tcase_add_test(tc, test_kvt_group_join_skips_stale);
    tcase_add_test(tc, test_stream_lands_in_place);
    tcase_add_test(tc, test_stream_forged_blocks);
    tcase_add_test(tc, test_stream_token_from);
    tcase_add_test(tc, test_stream_q8_scales);
    tcase_add_test(tc, test_stream_plan_checked);
    tcase_add_test(tc, test_stream_corrupt_block);
    tcase_add_test(tc, test_stream_missing_block);
    tcase_add_test(tc, test_stream_duplicate_and_stale);
    tcase_add_test(tc, test_block_checksum);
    tcase_add_test(tc, test_kvt_drain_stalled_sender);
    suite_add_tcase(s, tc);
    return s;
}
