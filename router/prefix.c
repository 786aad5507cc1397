/*
 * prefix.c - the router's prefix index: salted block keys of token sequences and the record of
 * which decode node's prefix pool holds each key. Used by the scheduler (schedule.c) to place
 * prompts and by the request state machine (request.c) when a request ends; depends on
 * neither.
 */
#include <stdlib.h>
#include <string.h>

#include "router/internal.h"
#include "router/prefix.h"

/* SHA-256 block keys with tagged fields (PITFALLS.md: cache keys): a domain tag, the router's
 * random salt, the model id, the parent block's key and the block's tokens, each
 * length-prefixed. Block i's key names the whole prefix up to the end of block i. */
int rt_block_hashes(pdm_router_t *r, const int32_t *tok, uint32_t n, uint8_t (*out)[32],
                           int max)
{
    int bt = r->cfg.block_tokens > 0 ? r->cfg.block_tokens : 64, k = 0;
    uint8_t parent[32] = {0};
    static const char tag[] = "pdmesh-prefix-v1";
    uint32_t mlen = (uint32_t)strlen(r->model_name), tlen = (uint32_t)bt;
    size_t cap = sizeof(tag) + 16 + 4 + mlen + 32 + 4 + sizeof(int32_t) * (size_t)bt;
    uint8_t *buf = malloc(cap);
    if (!buf) return 0;
    for (uint32_t s = 0; s + (uint32_t)bt <= n && k < max; s += (uint32_t)bt) {
        size_t o = 0;
        memcpy(buf + o, tag, sizeof(tag)), o += sizeof(tag);
        memcpy(buf + o, r->prefix_salt, 16), o += 16;
        memcpy(buf + o, &mlen, 4), o += 4;
        memcpy(buf + o, r->model_name, mlen), o += mlen;
        memcpy(buf + o, parent, 32), o += 32;
        memcpy(buf + o, &tlen, 4), o += 4;
        memcpy(buf + o, tok + s, sizeof(int32_t) * (size_t)bt), o += sizeof(int32_t) * (size_t)bt;
        pdm_sha256(buf, o, out[k]);
        memcpy(parent, out[k], 32);
        k++;
    }
    free(buf);
    return k;
}

size_t rt_prefix_slot(const uint8_t *h)
{
    return ((size_t)h[0] | (size_t)h[1] << 8 | (size_t)h[2] << 16) % RT_PREFIX_SLOTS;
}

void rt_decode_prefix_note(pdm_router_t *r, const rt_req_t *q, int node)
{
    enum { MAXB = 512 };
    const rt_node_t *n = &r->nodes[node];
    if (!n->pool_tokens || q->beams > 1 || q->n_gen < 1) return;
    uint32_t len = q->n_prompt + q->n_gen - 1; /* the last token is never fed back */
    int32_t *tok = malloc(sizeof(int32_t) * len);
    uint8_t (*h)[32] = malloc(sizeof(uint8_t[32]) * MAXB);
    int nb = 0;
    if (tok && h) {
        memcpy(tok, q->prompt, sizeof(int32_t) * q->n_prompt);
        memcpy(tok + q->n_prompt, q->gen, sizeof(int32_t) * (q->n_gen - 1));
        nb = rt_block_hashes(r, tok, len, h, MAXB);
    }
    for (int b = 0; b < nb; b++) {
        size_t s = rt_prefix_slot(h[b]);
        memcpy(r->dprefix[s].hash, h[b], 32);
        r->dprefix[s].node = node;
        r->dprefix[s].epoch = n->epoch;
        r->dprefix[s].stamp = ++r->prefix_stamp;
    }
    free(tok);
    free(h);
}
