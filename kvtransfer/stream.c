/*
 * stream.c - KV blocks from prefill ranks into a decode node's KV cache (see kvtransfer.h).
 *
 * Receiver: three posted tagged receives per expected block: its header into the header
 * table, its K rows and its V rows straight into their final locations (each piece is a
 * contiguous message, so UCX moves the rows zero-copy; see kvtransfer.h). The tag includes the
 * attempt, so a late block of an aborted attempt cannot match a receive of the current one
 * and never touches its memory (PITFALLS.md: stale peers, pages reused while a writer is in
 * flight). Each block is verified when it completes; coverage is checked on the plan before
 * anything is posted.
 */
#include "kvtransfer/kvtransfer.h"

#include <math.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/pdm.h"

/* ---- Receiver ----------------------------------------------------------------------------- */

struct pdm_kvt_stream_rx {
    pdm_kvt_t *kvt;
    pdm_kvt_stream_rx_params_t p;
    pdm_kvt_stream_block_t *blocks;   /* [n_blocks] copy of the plan */
    pdm_kvt_block_header_t *headers;  /* [n_blocks] landed headers */
    pdm_kvt_req_t *reqs;              /* [n_blocks * PIECES] posted receives (NONE once done) */
    size_t *lens;                     /* [n_blocks * PIECES] bytes received per piece */
    int done;                         /* blocks verified */
    uint8_t *scale_seen;              /* int8 KV: [n_layers * n_kv_heads] scales recorded */
    pdm_kvt_stream_stats_t stats;
    double t0;
    int keyed;
    uint8_t key[PDM_KVT_KEY_BYTES];
};

/* The header's MAC: HMAC-SHA256 of the header with its mac field zeroed, first 16 bytes. */
static void pdm__block_mac(const uint8_t key[PDM_KVT_KEY_BYTES], const pdm_kvt_block_header_t *h,
                           uint8_t out[16])
{
    pdm_kvt_block_header_t c = *h;
    memset(c.mac, 0, sizeof(c.mac));
    uint8_t full[32];
    unsigned int len = sizeof(full);
    HMAC(EVP_sha256(), key, PDM_KVT_KEY_BYTES, (const uint8_t *)&c, sizeof(c), full, &len);
    memcpy(out, full, 16);
}

/* Checks that the plan covers every (layer, head, token) exactly once. */
static int pdm__plan_check(const pdm_kvt_stream_rx_params_t *p)
{
    if (p->n_layers == 0 || p->n_kv_heads == 0 || p->row_bytes == 0 || p->n_tokens < 1 ||
        p->n_blocks < 1 || !p->k || !p->v || p->token_from < 0 || p->token_from >= p->n_tokens)
        return pdm_error_set(PDM_EINVAL, "stream: empty plan or destinations");
    if (p->n_layers > PDM_KVT_STREAM_MAX_LAYERS)
        return pdm_error_set(PDM_EINVAL, "stream: %u layers (at most %d)", p->n_layers,
                             PDM_KVT_STREAM_MAX_LAYERS);
    const size_t cells = (size_t)p->n_layers * p->n_kv_heads * (size_t)p->n_tokens;
    uint8_t *seen = calloc(cells, 1);
    if (!seen) return pdm_error_set(PDM_ENOMEM, "stream: out of memory");
    int st = PDM_OK;
    for (int b = 0; b < p->n_blocks && !st; b++) {
        const pdm_kvt_stream_block_t *blk = &p->blocks[b];
        if (blk->layer >= p->n_layers || blk->head >= p->n_kv_heads ||
            blk->token_start < p->token_from ||
            blk->n_tokens < 1 || blk->token_start > p->n_tokens - blk->n_tokens ||
            blk->chunk > 0xff) {
            st = pdm_error_set(PDM_EINVAL, "stream: block %d (layer %u head %u tokens %d+%d) is "
                               "outside the request", b, blk->layer, blk->head, blk->token_start,
                               blk->n_tokens);
            break;
        }
        for (int32_t t = 0; t < blk->n_tokens; t++) {
            size_t c = ((size_t)blk->layer * p->n_kv_heads + blk->head) * (size_t)p->n_tokens +
                       (size_t)(blk->token_start + t);
            if (seen[c]++) {
                st = pdm_error_set(PDM_EINVAL, "stream: token %d of layer %u head %u is planned "
                                   "twice", blk->token_start + t, blk->layer, blk->head);
                break;
            }
        }
    }
    for (size_t c = 0; c < cells && !st; c++)
        if (!seen[c] && (int32_t)(c % (size_t)p->n_tokens) >= p->token_from)
            st = pdm_error_set(PDM_EINVAL, "stream: token %zu of layer %zu head %zu has no "
                               "block", c % (size_t)p->n_tokens,
                               c / ((size_t)p->n_tokens * p->n_kv_heads),
                               c / (size_t)p->n_tokens % p->n_kv_heads);
    free(seen);
    return st;
}

void pdm_kvt_stream_rx_destroy(pdm_kvt_stream_rx_t *rx)
{
    if (!rx) return;
    if (rx->reqs) pdm_kvt_cancel(rx->kvt, rx->reqs, rx->p.n_blocks * PDM_KVT_PIECES);
    if (rx->reqs) pdm_kvt_stream_rx_drain(rx);
    free(rx->blocks);
    free(rx->headers);
    free(rx->reqs);
    free(rx->lens);
    free(rx->scale_seen);
    free(rx);
}

int pdm_kvt_stream_rx_start(pdm_kvt_t *kvt, const pdm_kvt_stream_rx_params_t *p,
                            pdm_kvt_stream_rx_t **out)
{
    int st = pdm__plan_check(p);
    if (st) return st;
    pdm_kvt_stream_rx_t *rx = calloc(1, sizeof(*rx));
    if (!rx) return pdm_error_set(PDM_ENOMEM, "stream: out of memory");
    rx->kvt = kvt;
    rx->p = *p;
    rx->p.key = NULL; /* copied below: the caller's buffer need not outlive the call */
    rx->keyed = p->key != NULL;
    if (p->key) memcpy(rx->key, p->key, PDM_KVT_KEY_BYTES);
    rx->t0 = pdm_now();
    rx->blocks = malloc(sizeof(*rx->blocks) * (size_t)p->n_blocks);
    rx->headers = calloc((size_t)p->n_blocks, sizeof(*rx->headers));
    const size_t n_pieces = (size_t)p->n_blocks * PDM_KVT_PIECES;
    rx->reqs = malloc(sizeof(*rx->reqs) * n_pieces);
    rx->lens = calloc(n_pieces, sizeof(*rx->lens));
    if (p->dtype == PDM_KVT_DTYPE_I8 && !p->scales) {
        pdm_kvt_stream_rx_destroy(rx);
        return pdm_error_set(PDM_EINVAL, "stream: int8 KV needs a destination for its scales");
    }
    if (p->dtype == PDM_KVT_DTYPE_I8)
        rx->scale_seen = calloc((size_t)p->n_layers * p->n_kv_heads, 1);
    if (!rx->blocks || !rx->headers || !rx->reqs || !rx->lens ||
        (p->dtype == PDM_KVT_DTYPE_I8 && !rx->scale_seen)) {
        pdm_kvt_stream_rx_destroy(rx);
        return pdm_error_set(PDM_ENOMEM, "stream: out of memory");
    }
    memcpy(rx->blocks, p->blocks, sizeof(*rx->blocks) * (size_t)p->n_blocks);
    rx->p.blocks = rx->blocks;
    for (size_t i = 0; i < n_pieces; i++) rx->reqs[i] = PDM_KVT_REQ_NONE;
    for (int b = 0; b < p->n_blocks && !st; b++) {
        const pdm_kvt_stream_block_t *blk = &rx->blocks[b];
        size_t hi = (size_t)blk->layer * p->n_kv_heads + blk->head;
        size_t off = (size_t)blk->token_start * p->row_bytes, len = (size_t)blk->n_tokens * p->row_bytes;
        const pdm_kvt_iov_t piece[PDM_KVT_PIECES] = {
            [PDM_KVT_PIECE_HEADER] = {&rx->headers[b], sizeof(pdm_kvt_block_header_t)},
            [PDM_KVT_PIECE_K] = {(char *)p->k[hi] + off, len},
            [PDM_KVT_PIECE_V] = {(char *)p->v[hi] + off, len}};
        const uint64_t tag = pdm_kvt_stream_tag(p->request_id, p->attempt, blk->layer, blk->head,
                                                blk->chunk);
        for (int i = 0; i < PDM_KVT_PIECES && !st; i++)
            st = pdm_kvt_irecv(kvt, blk->peer, pdm_kvt_stream_piece_tag(tag, i), &piece[i], 1,
                               &rx->reqs[(size_t)b * PDM_KVT_PIECES + (size_t)i]);
    }
    if (st) {
        char msg[512];
        snprintf(msg, sizeof(msg), "%s", pdm_error_last());
        pdm_kvt_stream_rx_destroy(rx);
        return pdm_error_set(st, "stream: request %llu: %s", (unsigned long long)p->request_id,
                             msg);
    }
    *out = rx;
    return PDM_OK;
}

_Static_assert(sizeof(pdm_kvt_block_header_t) == 80, "KV block header is 80 bytes (version 2: MAC)");

/* Names of the KV dtypes a stream carries (kvtransfer does not depend on kernels/). */
static const char *pdm__dtype_name(unsigned dtype)
{
    switch (dtype) {
    case 0: return "f32";
    case 1: return "f16";
    case PDM_KVT_DTYPE_I8: return "q8";
    default: return "unknown";
    }
}

/* Verifies a landed block against the plan and its checksum. */
static int pdm__verify(pdm_kvt_stream_rx_t *rx, int b)
{
    const pdm_kvt_stream_block_t *blk = &rx->blocks[b];
    const pdm_kvt_block_header_t *h = &rx->headers[b];
    const pdm_kvt_stream_rx_params_t *p = &rx->p;
    const size_t len = (size_t)blk->n_tokens * p->row_bytes;
    const size_t *got = &rx->lens[(size_t)b * PDM_KVT_PIECES];
    const size_t bytes = got[0] + got[1] + got[2];
    if (got[PDM_KVT_PIECE_HEADER] == sizeof(*h) && h->magic == PDM_KVT_BLOCK_MAGIC &&
        h->dtype != p->dtype)
        return pdm_error_set(PDM_EFORMAT, "stream: request %llu: block layer %u head %u tokens "
                             "%d+%d from peer %d carries KV dtype %s but the reservation expects "
                             "%s (prefill and decode --kv-dtype differ); block rejected",
                             (unsigned long long)p->request_id, blk->layer, blk->head,
                             blk->token_start, blk->n_tokens, blk->peer, pdm__dtype_name(h->dtype),
                             pdm__dtype_name(p->dtype));
    if (got[PDM_KVT_PIECE_HEADER] != sizeof(*h) || got[PDM_KVT_PIECE_K] != len ||
        got[PDM_KVT_PIECE_V] != len || h->magic != PDM_KVT_BLOCK_MAGIC || h->version != 2 ||
        h->request_id != p->request_id || h->attempt != p->attempt || h->layer != blk->layer ||
        h->head != blk->head || h->chunk != blk->chunk || h->token_start != blk->token_start ||
        h->n_tokens != blk->n_tokens || h->row_bytes != p->row_bytes || h->dtype != p->dtype)
        return pdm_error_set(PDM_EFORMAT, "stream: request %llu: block layer %u head %u tokens "
                             "%d+%d from peer %d does not match the plan (%zu bytes; header says "
                             "request %llu attempt %u layer %u head %u tokens %d+%d dtype %u)",
                             (unsigned long long)p->request_id, blk->layer, blk->head,
                             blk->token_start, blk->n_tokens, blk->peer, bytes,
                             (unsigned long long)h->request_id, h->attempt, h->layer, h->head,
                             h->token_start, h->n_tokens, h->dtype);
    if (rx->keyed) { /* only a peer introduced for this request holds the key */
        uint8_t want[16];
        pdm__block_mac(rx->key, h, want);
        if (CRYPTO_memcmp(want, h->mac, sizeof(want))) {
            rx->stats.forged++;
            return pdm_error_set(PDM_ECHECKSUM, "stream: request %llu: block layer %u head %u "
                                 "tokens %d+%d from peer %d is forged (its MAC does not verify "
                                 "with the request's KV key); block rejected",
                                 (unsigned long long)p->request_id, blk->layer, blk->head,
                                 blk->token_start, blk->n_tokens, blk->peer);
        }
    }
    size_t hi = (size_t)blk->layer * p->n_kv_heads + blk->head;
    size_t off = (size_t)blk->token_start * p->row_bytes;
    uint64_t sum = pdm_kvt_block_checksum(p->request_id, (const char *)p->k[hi] + off,
                                          (const char *)p->v[hi] + off, len);
    if (sum != h->checksum)
        return pdm_error_set(PDM_ECHECKSUM, "stream: request %llu: block layer %u head %u tokens "
                             "%d+%d from peer %d is corrupt (XXH3-64 %016llx, header %016llx)",
                             (unsigned long long)p->request_id, blk->layer, blk->head,
                             blk->token_start, blk->n_tokens, blk->peer,
                             (unsigned long long)sum, (unsigned long long)h->checksum);
    if (p->dtype == PDM_KVT_DTYPE_I8) {
        /* One scale pair per (layer, head), fixed at prefill: every block of the head must
         * agree, or its rows would be read with another block's scale. */
        float *dst = p->scales + 2 * hi;
        if (!(h->scale > 0) || !(h->v_scale > 0) || !isfinite(h->scale) || !isfinite(h->v_scale))
            return pdm_error_set(PDM_EFORMAT, "stream: request %llu: int8 block layer %u head %u "
                                 "from peer %d has invalid scales %g / %g",
                                 (unsigned long long)p->request_id, blk->layer, blk->head,
                                 blk->peer, h->scale, h->v_scale);
        if (rx->scale_seen[hi] && (dst[0] != h->scale || dst[1] != h->v_scale))
            return pdm_error_set(PDM_EFORMAT, "stream: request %llu: int8 block layer %u head %u "
                                 "tokens %d+%d from peer %d has scales %g / %g, another block of "
                                 "the head had %g / %g (the prefill ranks disagree)",
                                 (unsigned long long)p->request_id, blk->layer, blk->head,
                                 blk->token_start, blk->n_tokens, blk->peer, h->scale,
                                 h->v_scale, dst[0], dst[1]);
        dst[0] = h->scale;
        dst[1] = h->v_scale;
        rx->scale_seen[hi] = 1;
    }
    rx->stats.bytes += 2 * len;
    rx->stats.blocks++;
    return PDM_OK;
}

/* Completes the pieces of block b still posted: waits until `deadline`, or only tests when
 * deadline < 0. Returns 1 when the block is complete, 0 when a piece is still in flight
 * (testing only), or an error status naming the block. */
static int pdm__block_complete(pdm_kvt_stream_rx_t *rx, int b, double deadline)
{
    for (int i = 0; i < PDM_KVT_PIECES; i++) {
        pdm_kvt_req_t *r = &rx->reqs[(size_t)b * PDM_KVT_PIECES + (size_t)i];
        if (*r == PDM_KVT_REQ_NONE) continue;
        size_t bytes = 0;
        int st;
        if (deadline < 0) {
            st = pdm_kvt_test(rx->kvt, *r, &bytes); /* 1 done, 0 in flight, < 0 failed */
            if (st == 0) return 0;
        } else {
            st = pdm_kvt_wait(rx->kvt, *r, deadline, &bytes);
        }
        *r = PDM_KVT_REQ_NONE;
        if (st < 0) {
            const pdm_kvt_stream_block_t *blk = &rx->blocks[b];
            char msg[512];
            snprintf(msg, sizeof(msg), "%s", pdm_error_last());
            return pdm_error_set(st, "stream: request %llu: block layer %u head %u tokens %d+%d "
                                 "from peer %d (%d of %d blocks arrived): %s%s%s%s",
                                 (unsigned long long)rx->p.request_id, blk->layer, blk->head,
                                 blk->token_start, blk->n_tokens, blk->peer, rx->done,
                                 rx->p.n_blocks, msg,
                                 st == PDM_EOVERFLOW ? "; block rejected: larger than planned "
                                 "for KV dtype " : "",
                                 st == PDM_EOVERFLOW ? pdm__dtype_name(rx->p.dtype) : "",
                                 st == PDM_EOVERFLOW ? " (is the sender's --kv-dtype another?)"
                                                     : "");
        }
        rx->lens[(size_t)b * PDM_KVT_PIECES + (size_t)i] = bytes;
    }
    return 1;
}

/* Completes and verifies blocks in order; deadline < 0: without blocking. */
static int pdm__rx_progress(pdm_kvt_stream_rx_t *rx, double deadline)
{
    for (int b = 0; b < rx->p.n_blocks; b++) {
        const pdm_kvt_req_t *r = &rx->reqs[(size_t)b * PDM_KVT_PIECES];
        if (r[0] == PDM_KVT_REQ_NONE && r[1] == PDM_KVT_REQ_NONE && r[2] == PDM_KVT_REQ_NONE)
            continue; /* verified earlier */
        int st = pdm__block_complete(rx, b, deadline);
        if (st <= 0) return st;
        if ((st = pdm__verify(rx, b))) return st;
        rx->done++;
    }
    rx->stats.seconds = pdm_now() - rx->t0;
    return 1;
}

int pdm_kvt_stream_rx_wait(pdm_kvt_stream_rx_t *rx, double deadline)
{
    int st = pdm__rx_progress(rx, deadline < 0 ? 0 : deadline);
    return st < 0 ? st : PDM_OK;
}

int pdm_kvt_stream_rx_poll(pdm_kvt_stream_rx_t *rx)
{
    return pdm__rx_progress(rx, -1);
}

typedef struct {
    pdm_kvt_stream_rx_t *rx;
    int duplicates;
} pdm__drain_ctx_t;

static void pdm__drain_one(void *arg, uint64_t tag, const void *data, size_t len)
{
    pdm__drain_ctx_t *d = arg;
    /* A block is three messages; count it once, by its header. */
    if (((tag >> 16) & 3) != PDM_KVT_PIECE_HEADER) return;
    const uint64_t mine = pdm_kvt_stream_tag(d->rx->p.request_id, d->rx->p.attempt, 0, 0, 0);
    if ((tag & PDM_KVT_STREAM_MASK_ATTEMPT) == (mine & PDM_KVT_STREAM_MASK_ATTEMPT)) {
        d->duplicates++;
        pdm_log_warn("stream: request %llu: dropped a duplicate block",
                     (unsigned long long)d->rx->p.request_id);
    } else {
        d->rx->stats.stale++;
        pdm_log_info("stream: request %llu: dropped a block of attempt %u (current %u)",
                     (unsigned long long)d->rx->p.request_id, (unsigned)((tag >> 28) & 0xff),
                     d->rx->p.attempt & 0xff);
    }
}

int pdm_kvt_stream_rx_drain(pdm_kvt_stream_rx_t *rx)
{
    pdm__drain_ctx_t d = {.rx = rx};
    pdm_kvt_drain(rx->kvt, pdm_kvt_stream_tag(rx->p.request_id, 0, 0, 0, 0),
                  PDM_KVT_STREAM_MASK_REQUEST, pdm__drain_one, &d);
    rx->stats.duplicates += d.duplicates;
    return d.duplicates;
}

void pdm_kvt_stream_rx_stats(const pdm_kvt_stream_rx_t *rx, pdm_kvt_stream_stats_t *out)
{
    *out = rx->stats;
}

/* ---- Sender ------------------------------------------------------------------------------- */

struct pdm_kvt_stream_tx {
    pdm_kvt_t *kvt;
    int peer;
    uint64_t request_id;
    uint32_t attempt;
    double timeout;
    int max_in_flight, head, count; /* ring of in-flight blocks */
    pdm_kvt_req_t *reqs;             /* [max_in_flight * PIECES] */
    pdm_kvt_block_header_t *headers; /* header of each in-flight send (must outlive it) */
    uint64_t bytes;
    int keyed;
    uint8_t key[PDM_KVT_KEY_BYTES];
};

void pdm_kvt_stream_tx_set_key(pdm_kvt_stream_tx_t *tx, const uint8_t *key)
{
    tx->keyed = key != NULL;
    if (key) memcpy(tx->key, key, PDM_KVT_KEY_BYTES);
}

int pdm_kvt_stream_tx_create(pdm_kvt_t *kvt, int peer, uint64_t request_id, uint32_t attempt,
                             int max_in_flight, double timeout, pdm_kvt_stream_tx_t **out)
{
    if (max_in_flight < 1 || max_in_flight > 4096 || !(timeout > 0))
        return pdm_error_set(PDM_EINVAL, "stream: max_in_flight must be 1..4096 and timeout "
                             "positive");
    pdm_kvt_stream_tx_t *tx = calloc(1, sizeof(*tx));
    if (!tx) return pdm_error_set(PDM_ENOMEM, "stream: out of memory");
    tx->kvt = kvt;
    tx->peer = peer;
    tx->request_id = request_id;
    tx->attempt = attempt;
    tx->timeout = timeout;
    tx->max_in_flight = max_in_flight;
    tx->reqs = malloc(sizeof(*tx->reqs) * (size_t)max_in_flight * PDM_KVT_PIECES);
    tx->headers = calloc((size_t)max_in_flight, sizeof(*tx->headers));
    if (!tx->reqs || !tx->headers) {
        pdm_kvt_stream_tx_destroy(tx);
        return pdm_error_set(PDM_ENOMEM, "stream: out of memory");
    }
    *out = tx;
    return PDM_OK;
}

/* Waits for the oldest in-flight block's pieces. */
static int pdm__tx_retire(pdm_kvt_stream_tx_t *tx, double deadline)
{
    int st = PDM_OK;
    for (int i = 0; i < PDM_KVT_PIECES; i++) {
        pdm_kvt_req_t r = tx->reqs[(size_t)tx->head * PDM_KVT_PIECES + (size_t)i];
        if (r == PDM_KVT_REQ_NONE) continue;
        int s2 = pdm_kvt_wait(tx->kvt, r, st ? pdm_now() : deadline, NULL);
        if (s2 && !st) st = s2;
    }
    tx->head = (tx->head + 1) % tx->max_in_flight;
    tx->count--;
    return st;
}

int pdm_kvt_stream_tx_send(pdm_kvt_stream_tx_t *tx, uint32_t layer, uint32_t head, uint32_t chunk,
                           int32_t token_start, int32_t n_tokens, uint16_t dtype, float scale,
                           const void *k_rows, const void *v_rows, size_t row_bytes)
{
    return pdm_kvt_stream_tx_send_scaled(tx, layer, head, chunk, token_start, n_tokens, dtype,
                                         scale, scale, k_rows, v_rows, row_bytes);
}

int pdm_kvt_stream_tx_send_scaled(pdm_kvt_stream_tx_t *tx, uint32_t layer, uint32_t head,
                                  uint32_t chunk, int32_t token_start, int32_t n_tokens,
                                  uint16_t dtype, float scale, float v_scale,
                                  const void *k_rows, const void *v_rows, size_t row_bytes)
{
    if (n_tokens < 1 || token_start < 0 || row_bytes == 0 || row_bytes > UINT32_MAX ||
        layer >= PDM_KVT_STREAM_MAX_LAYERS)
        return pdm_error_set(PDM_EINVAL, "stream: empty or malformed block");
    /* Flow control: never more than max_in_flight blocks outstanding. */
    if (tx->count == tx->max_in_flight) {
        int st = pdm__tx_retire(tx, pdm_now() + tx->timeout);
        if (st) return st;
    }
    int slot = (tx->head + tx->count) % tx->max_in_flight;
    const size_t len = (size_t)n_tokens * row_bytes;
    pdm_kvt_block_header_t *h = &tx->headers[slot];
    *h = (pdm_kvt_block_header_t){
        .magic = PDM_KVT_BLOCK_MAGIC,
        .version = 2,
        .dtype = dtype,
        .request_id = tx->request_id,
        .attempt = tx->attempt,
        .layer = layer,
        .head = head,
        .token_start = token_start,
        .n_tokens = n_tokens,
        .row_bytes = (uint32_t)row_bytes,
        .scale = scale,
        .v_scale = v_scale,
        .chunk = chunk,
        .checksum = pdm_kvt_block_checksum(tx->request_id, k_rows, v_rows, len),
    };
    if (tx->keyed) pdm__block_mac(tx->key, h, h->mac);
    const pdm_kvt_iov_t piece[PDM_KVT_PIECES] = {[PDM_KVT_PIECE_HEADER] = {h, sizeof(*h)},
                                                 [PDM_KVT_PIECE_K] = {(void *)k_rows, len},
                                                 [PDM_KVT_PIECE_V] = {(void *)v_rows, len}};
    const uint64_t tag = pdm_kvt_stream_tag(tx->request_id, tx->attempt, layer, head, chunk);
    pdm_kvt_req_t *reqs = &tx->reqs[(size_t)slot * PDM_KVT_PIECES];
    int st = PDM_OK;
    for (int i = 0; i < PDM_KVT_PIECES; i++) reqs[i] = PDM_KVT_REQ_NONE;
    for (int i = 0; i < PDM_KVT_PIECES && !st; i++)
        st = pdm_kvt_isend(tx->kvt, tx->peer, pdm_kvt_stream_piece_tag(tag, i), &piece[i], 1,
                           &reqs[i]);
    if (st) {
        /* Pieces already posted stay tracked: retire them with the block. */
        if (reqs[0] != PDM_KVT_REQ_NONE) tx->count++;
        return st;
    }
    tx->count++;
    tx->bytes += 2 * len;
    return PDM_OK;
}

int pdm_kvt_stream_tx_finish(pdm_kvt_stream_tx_t *tx, double deadline)
{
    int first = PDM_OK;
    while (tx->count > 0) {
        int st = pdm__tx_retire(tx, first ? pdm_now() : deadline);
        if (st && !first) first = st;
    }
    return first;
}

uint64_t pdm_kvt_stream_tx_bytes(const pdm_kvt_stream_tx_t *tx)
{
    return tx->bytes;
}

void pdm_kvt_stream_tx_destroy(pdm_kvt_stream_tx_t *tx)
{
    if (!tx) return;
    if (tx->reqs) pdm_kvt_stream_tx_finish(tx, pdm_now() + 1.0);
    free(tx->reqs);
    free(tx->headers);
    free(tx);
}
