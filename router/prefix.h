/*
 * prefix.h - the router's prefix index (router/prefix.c). Internal to the router.
 */
#ifndef PDM_ROUTER_PREFIX_H
#define PDM_ROUTER_PREFIX_H

#include "router/internal.h"

/* Block keys of tok[0, n): key i names the whole prefix up to the end of block i (block size
 * cfg.block_tokens); at most `max` keys. Returns how many were written (0 on no memory). */
int rt_block_hashes(pdm_router_t *r, const int32_t *tok, uint32_t n, uint8_t (*out)[32], int max);
/* The same with the block size of the decode nodes' KV events (pool_block_tokens). */
int rt_pool_block_hashes(pdm_router_t *r, const int32_t *tok, uint32_t n, uint8_t (*out)[32],
                         int max);
/* The slot of a key in the prefix tables (RT_PREFIX_SLOTS). */
size_t rt_prefix_slot(const uint8_t *h);

/* A decode node's KvEvents (proto/pdmesh.proto): applied to the global index (kvindex.h)
 * when they come from node `node`'s current epoch and in sequence; `reset` first drops every
 * block of the node. Keys that are not 32 bytes are skipped and counted (kind "malformed");
 * nothing in a message can make the router fail. The pool's stats are kept for metrics and
 * `pdctl cache`. */
void rt_prefix_on_kv_events(pdm_router_t *r, int node, const Pdmesh__KvEvents *m);

/* Node `node` is gone or registered again: its blocks leave the index. */
void rt_prefix_node_reset(pdm_router_t *r, int node);

/* The decode-node prefix pool metrics that follow from the nodes' reports (rt_node_metrics). */
void rt_prefix_metrics(pdm_router_t *r);

#endif
