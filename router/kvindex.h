/*
 * kvindex.h - the router's global index of the prefix blocks decode nodes' pools hold
 * (router/kvindex.c). Internal to the router; no dependency on the rest of it, so that the
 * unit tests drive it directly.
 *
 * Fed by the nodes' KvEvents (proto/pdmesh.proto): STORED adds a node to a block key's
 * holders, EVICTED removes it, a node's reset or death drops all of that node's entries. This
 * replaces guessing from where requests ended, as Dynamo's KV router does with its workers'
 * KV events (a radix tree of block hashes -> worker set there; a flat table here, since a
 * block key already names its whole prefix).
 *
 * Memory is bounded: a set-associative table of `capacity` entries (RT_KVIDX_WAYS per bucket);
 * a key whose bucket is full replaces the way touched least recently. An entry lost that way
 * only costs a miss (the node checks the tokens itself), never a wrong answer.
 */
#ifndef PDM_ROUTER_KVINDEX_H
#define PDM_ROUTER_KVINDEX_H

#include <stddef.h>
#include <stdint.h>

#define RT_KVIDX_MAX_NODES 256 /* node indices 0..255 (RT_MAX_NODES) */
#define RT_KVIDX_WAYS 8

enum { RT_KVIDX_TIER_RAM = 1, RT_KVIDX_TIER_FILE = 2 };

typedef struct rt_kvindex rt_kvindex_t;

/* An index of at most `capacity` entries (rounded up to whole buckets; 0: 65536). NULL when
 * out of memory. */
rt_kvindex_t *rt_kvindex_create(size_t capacity);
void rt_kvindex_destroy(rt_kvindex_t *x);

/* Node `node` holds block `key` in `tier` (RT_KVIDX_TIER_*). Out-of-range nodes are ignored. */
void rt_kvindex_store(rt_kvindex_t *x, const uint8_t key[32], int node, int tier);
/* Node `node` no longer holds block `key`. Unknown keys are ignored. */
void rt_kvindex_evict(rt_kvindex_t *x, const uint8_t key[32], int node);
/* Forgets every block of `node` (its reset event, death or new epoch). */
void rt_kvindex_drop_node(rt_kvindex_t *x, int node);

/* For the chained block keys keys[0, n_keys) of one prompt (key i names blocks 0..i), how
 * many leading blocks each node holds: blocks[node] for node in [0, RT_KVIDX_MAX_NODES), and
 * file_tier[node] 1 when the deepest of them sits in the file tier (file_tier may be NULL).
 * Returns the largest blocks[] value. */
int rt_kvindex_match(rt_kvindex_t *x, const uint8_t (*keys)[32], int n_keys, uint16_t *blocks,
                     uint8_t *file_tier);

/* Blocks the index holds for `node`, and entries in all. */
uint64_t rt_kvindex_node_blocks(const rt_kvindex_t *x, int node);
size_t rt_kvindex_entries(const rt_kvindex_t *x);
/* Entries replaced because their bucket was full (a bounded index forgetting). */
uint64_t rt_kvindex_replaced(const rt_kvindex_t *x);

#endif
