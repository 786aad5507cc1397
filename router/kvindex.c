/*
 * kvindex.c - the global prefix block index (kvindex.h): a set-associative table of block
 * keys, each with the set of nodes holding it as a 256-bit mask and which of them hold it in
 * the file tier.
 */
#include "router/kvindex.h"

#include <stdlib.h>
#include <string.h>

#define RT_KVIDX_WORDS (RT_KVIDX_MAX_NODES / 64)

typedef struct {
    uint8_t key[32];
    uint64_t nodes[RT_KVIDX_WORDS]; /* holders; all zero: the way is free */
    uint64_t file[RT_KVIDX_WORDS];  /* holders whose copy is in the file tier */
    uint64_t stamp;                 /* last store / match */
} rt_kvidx_entry_t;

struct rt_kvindex {
    rt_kvidx_entry_t *e; /* [n_buckets * RT_KVIDX_WAYS] */
    size_t n_buckets, entries;
    uint64_t stamp, replaced;
    uint64_t node_blocks[RT_KVIDX_MAX_NODES];
};

rt_kvindex_t *rt_kvindex_create(size_t capacity)
{
    if (!capacity) capacity = 65536;
    rt_kvindex_t *x = calloc(1, sizeof(*x));
    if (!x) return NULL;
    x->n_buckets = (capacity + RT_KVIDX_WAYS - 1) / RT_KVIDX_WAYS;
    x->e = calloc(x->n_buckets * RT_KVIDX_WAYS, sizeof(rt_kvidx_entry_t));
    if (!x->e) {
        free(x);
        return NULL;
    }
    return x;
}

void rt_kvindex_destroy(rt_kvindex_t *x)
{
    if (!x) return;
    free(x->e);
    free(x);
}

static int rt_kvidx__empty(const rt_kvidx_entry_t *e)
{
    for (int w = 0; w < RT_KVIDX_WORDS; w++)
        if (e->nodes[w]) return 0;
    return 1;
}

/* Takes every holder of e off the per-node counts and frees the way. */
static void rt_kvidx__clear(rt_kvindex_t *x, rt_kvidx_entry_t *e)
{
    for (int w = 0; w < RT_KVIDX_WORDS; w++)
        for (uint64_t m = e->nodes[w]; m; m &= m - 1)
            x->node_blocks[w * 64 + __builtin_ctzll(m)]--;
    if (!rt_kvidx__empty(e)) x->entries--;
    memset(e, 0, sizeof(*e));
}

static rt_kvidx_entry_t *rt_kvidx__bucket(const rt_kvindex_t *x, const uint8_t key[32])
{
    uint64_t h; /* the key is a SHA-256 output: any 8 bytes are uniform */
    memcpy(&h, key, sizeof(h));
    return &x->e[(h % x->n_buckets) * RT_KVIDX_WAYS];
}

static rt_kvidx_entry_t *rt_kvidx__find(const rt_kvindex_t *x, const uint8_t key[32])
{
    rt_kvidx_entry_t *b = rt_kvidx__bucket(x, key);
    for (int i = 0; i < RT_KVIDX_WAYS; i++)
        if (!rt_kvidx__empty(&b[i]) && !memcmp(b[i].key, key, 32)) return &b[i];
    return NULL;
}

void rt_kvindex_store(rt_kvindex_t *x, const uint8_t key[32], int node, int tier)
{
    if (node < 0 || node >= RT_KVIDX_MAX_NODES) return;
    rt_kvidx_entry_t *e = rt_kvidx__find(x, key);
    if (!e) {
        rt_kvidx_entry_t *b = rt_kvidx__bucket(x, key), *lru = &b[0];
        for (int i = 0; i < RT_KVIDX_WAYS && !e; i++) {
            if (rt_kvidx__empty(&b[i])) e = &b[i];
            else if (b[i].stamp < lru->stamp) lru = &b[i];
        }
        if (!e) {
            rt_kvidx__clear(x, lru);
            x->replaced++;
            e = lru;
        }
        memcpy(e->key, key, 32);
        x->entries++;
    }
    const int w = node / 64;
    const uint64_t bit = 1ull << (node % 64);
    if (!(e->nodes[w] & bit)) x->node_blocks[node]++;
    e->nodes[w] |= bit;
    if (tier == RT_KVIDX_TIER_FILE) e->file[w] |= bit;
    else e->file[w] &= ~bit;
    e->stamp = ++x->stamp;
}

void rt_kvindex_evict(rt_kvindex_t *x, const uint8_t key[32], int node)
{
    if (node < 0 || node >= RT_KVIDX_MAX_NODES) return;
    rt_kvidx_entry_t *e = rt_kvidx__find(x, key);
    const int w = node / 64;
    const uint64_t bit = 1ull << (node % 64);
    if (!e || !(e->nodes[w] & bit)) return;
    e->nodes[w] &= ~bit;
    e->file[w] &= ~bit;
    x->node_blocks[node]--;
    if (rt_kvidx__empty(e)) {
        x->entries--;
        memset(e, 0, sizeof(*e));
    }
}

void rt_kvindex_drop_node(rt_kvindex_t *x, int node)
{
    if (node < 0 || node >= RT_KVIDX_MAX_NODES || !x->node_blocks[node]) return;
    const int w = node / 64;
    const uint64_t bit = 1ull << (node % 64);
    for (size_t i = 0; i < x->n_buckets * RT_KVIDX_WAYS; i++) {
        rt_kvidx_entry_t *e = &x->e[i];
        if (!(e->nodes[w] & bit)) continue;
        e->nodes[w] &= ~bit;
        e->file[w] &= ~bit;
        if (rt_kvidx__empty(e)) {
            x->entries--;
            memset(e, 0, sizeof(*e));
        }
    }
    x->node_blocks[node] = 0;
}

int rt_kvindex_match(rt_kvindex_t *x, const uint8_t (*keys)[32], int n_keys, uint16_t *blocks,
                     uint8_t *file_tier)
{
    uint64_t seen[RT_KVIDX_WORDS] = {0};
    int best = 0;
    memset(blocks, 0, sizeof(uint16_t) * RT_KVIDX_MAX_NODES);
    if (file_tier) memset(file_tier, 0, RT_KVIDX_MAX_NODES);
    /* deepest first: a node's first hit is its longest prefix (key i names blocks 0..i) */
    for (int b = n_keys - 1; b >= 0; b--) {
        rt_kvidx_entry_t *e = rt_kvidx__find(x, keys[b]);
        if (!e) continue;
        e->stamp = ++x->stamp;
        for (int w = 0; w < RT_KVIDX_WORDS; w++)
            for (uint64_t m = e->nodes[w] & ~seen[w]; m; m &= m - 1) {
                const int node = w * 64 + __builtin_ctzll(m);
                blocks[node] = (uint16_t)(b + 1 > 65535 ? 65535 : b + 1);
                if (file_tier) file_tier[node] = (e->file[w] >> (node % 64)) & 1;
                if (b + 1 > best) best = b + 1;
                seen[w] |= 1ull << (node % 64);
            }
    }
    return best;
}

uint64_t rt_kvindex_node_blocks(const rt_kvindex_t *x, int node)
{
    return node >= 0 && node < RT_KVIDX_MAX_NODES ? x->node_blocks[node] : 0;
}

size_t rt_kvindex_entries(const rt_kvindex_t *x) { return x->entries; }
uint64_t rt_kvindex_replaced(const rt_kvindex_t *x) { return x->replaced; }
