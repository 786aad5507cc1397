/*
 * prefix.h - the router's prefix index (router/prefix.c). Internal to the router.
 */
#ifndef PDM_ROUTER_PREFIX_H
#define PDM_ROUTER_PREFIX_H

#include "router/internal.h"

/* Block keys of tok[0, n): key i names the whole prefix up to the end of block i (block size
 * cfg.block_tokens); at most `max` keys. Returns how many were written (0 on no memory). */
int rt_block_hashes(pdm_router_t *r, const int32_t *tok, uint32_t n, uint8_t (*out)[32], int max);
/* The slot of a key in the prefix tables (RT_PREFIX_SLOTS). */
size_t rt_prefix_slot(const uint8_t *h);

/* Request q ended normally on decode node `node`: if that node keeps a prefix pool, its
 * block keys of the prompt and the generated tokens fed back (what the pool now holds) point
 * at the node, so a follow-up turn is prefilled there from the pooled KV. */
void rt_decode_prefix_note(pdm_router_t *r, const rt_req_t *q, int node);

#endif
