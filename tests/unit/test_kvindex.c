/*
 * test_kvindex.c - the router's global prefix block index (router/kvindex.h): store, evict,
 * a node's reset, longest prefix per node, and the memory bound.
 */
#include "tests.h"

#include <stdlib.h>
#include <string.h>

#include "common/wire.h"
#include "router/kvindex.h"

/* n chained block keys of a sequence that starts with `first` (same first => same keys). */
static void keys_of(int first, int n, uint8_t (*out)[32])
{
    int32_t tok[64 * 8];
    for (int i = 0; i < 64 * n; i++) tok[i] = first * 1000 + i;
    pdm_prefix_key_params_t kp = {.model = "m", .block_tokens = 64};
    memset(kp.salt, 7, sizeof(kp.salt));
    ck_assert_int_eq(pdm_prefix_block_keys(&kp, tok, (uint32_t)(64 * n), out, n), n);
}

START_TEST(test_kvindex_match_evict)
{
    rt_kvindex_t *x = rt_kvindex_create(1024);
    ck_assert_ptr_nonnull(x);
    uint8_t k[6][32];
    uint16_t blocks[RT_KVIDX_MAX_NODES];
    uint8_t file[RT_KVIDX_MAX_NODES];
    keys_of(1, 6, k);
    /* node 3 holds 6 blocks, node 200 the first 2 (a shared system prompt) in the file tier */
    for (int b = 0; b < 6; b++) rt_kvindex_store(x, k[b], 3, RT_KVIDX_TIER_RAM);
    for (int b = 0; b < 2; b++) rt_kvindex_store(x, k[b], 200, RT_KVIDX_TIER_FILE);
    ck_assert_uint_eq(rt_kvindex_entries(x), 6);
    ck_assert_uint_eq(rt_kvindex_node_blocks(x, 3), 6);
    ck_assert_uint_eq(rt_kvindex_node_blocks(x, 200), 2);
    ck_assert_int_eq(rt_kvindex_match(x, (const uint8_t(*)[32])k, 6, blocks, file), 6);
    ck_assert_int_eq(blocks[3], 6);
    ck_assert_int_eq(blocks[200], 2);
    ck_assert_int_eq(file[200], 1);
    ck_assert_int_eq(file[3], 0);
    ck_assert_int_eq(blocks[0], 0);
    /* a prompt that shares only the first 4 blocks */
    ck_assert_int_eq(rt_kvindex_match(x, (const uint8_t(*)[32])k, 4, blocks, NULL), 4);
    ck_assert_int_eq(blocks[3], 4);
    /* evictions: node 3 loses its deepest two blocks; unknown keys / nodes are ignored */
    rt_kvindex_evict(x, k[5], 3);
    rt_kvindex_evict(x, k[4], 3);
    rt_kvindex_evict(x, k[4], 3);
    rt_kvindex_evict(x, k[0], 77);
    rt_kvindex_store(x, k[0], -1, RT_KVIDX_TIER_RAM);
    rt_kvindex_store(x, k[0], RT_KVIDX_MAX_NODES, RT_KVIDX_TIER_RAM);
    ck_assert_int_eq(rt_kvindex_match(x, (const uint8_t(*)[32])k, 6, blocks, NULL), 4);
    ck_assert_int_eq(blocks[3], 4);
    ck_assert_uint_eq(rt_kvindex_entries(x), 4);
    ck_assert_uint_eq(rt_kvindex_node_blocks(x, 3), 4);
    /* node 3 restarts: only node 200's blocks remain */
    rt_kvindex_drop_node(x, 3);
    ck_assert_uint_eq(rt_kvindex_node_blocks(x, 3), 0);
    ck_assert_uint_eq(rt_kvindex_entries(x), 2);
    ck_assert_int_eq(rt_kvindex_match(x, (const uint8_t(*)[32])k, 6, blocks, NULL), 2);
    ck_assert_int_eq(blocks[3], 0);
    ck_assert_int_eq(blocks[200], 2);
    /* moved back to RAM */
    rt_kvindex_store(x, k[1], 200, RT_KVIDX_TIER_RAM);
    rt_kvindex_match(x, (const uint8_t(*)[32])k, 6, blocks, file);
    ck_assert_int_eq(file[200], 0);
    rt_kvindex_destroy(x);
    rt_kvindex_destroy(NULL);
}
END_TEST

START_TEST(test_kvindex_bounded)
{
    /* 16 entries (2 buckets of 8 ways): 500 distinct keys never take more, the counts stay
     * consistent, and the most recently stored keys are the ones kept */
    rt_kvindex_t *x = rt_kvindex_create(16);
    uint8_t k[8][32];
    for (int s = 0; s < 100; s++) {
        keys_of(s + 10, 5, k);
        for (int b = 0; b < 5; b++) rt_kvindex_store(x, k[b], s % 4, RT_KVIDX_TIER_RAM);
        ck_assert_uint_le(rt_kvindex_entries(x), 16);
    }
    uint64_t sum = 0;
    for (int n = 0; n < 4; n++) sum += rt_kvindex_node_blocks(x, n);
    ck_assert_uint_eq(sum, rt_kvindex_entries(x));
    ck_assert_uint_gt(rt_kvindex_replaced(x), 400);
    uint16_t blocks[RT_KVIDX_MAX_NODES];
    keys_of(109, 5, k); /* the last sequence stored: its deepest block is still there */
    rt_kvindex_match(x, (const uint8_t(*)[32])k, 5, blocks, NULL);
    ck_assert_int_eq(blocks[99 % 4], 5);
    for (int n = 0; n < 4; n++) rt_kvindex_drop_node(x, n);
    ck_assert_uint_eq(rt_kvindex_entries(x), 0);
    rt_kvindex_destroy(x);
}
END_TEST

START_TEST(test_prefix_keys_shared)
{
    /* the router and the decode nodes share one definition: salt, model and block size all
     * change the keys; a shorter sequence's keys are a prefix of a longer one's */
    int32_t tok[200];
    for (int i = 0; i < 200; i++) tok[i] = i;
    uint8_t a[3][32], b[3][32];
    pdm_prefix_key_params_t kp = {.model = "m", .block_tokens = 64};
    memset(kp.salt, 1, 16);
    ck_assert_int_eq(pdm_prefix_block_keys(&kp, tok, 200, a, 3), 3);
    ck_assert_int_eq(pdm_prefix_block_keys(&kp, tok, 130, b, 3), 2);
    ck_assert(!memcmp(a, b, 64));
    kp.salt[0] = 2;
    pdm_prefix_block_keys(&kp, tok, 200, b, 3);
    ck_assert(memcmp(a[0], b[0], 32));
    kp.salt[0] = 1;
    kp.model = "n";
    pdm_prefix_block_keys(&kp, tok, 200, b, 3);
    ck_assert(memcmp(a[0], b[0], 32));
    kp.model = "m";
    kp.block_tokens = 32;
    ck_assert_int_eq(pdm_prefix_block_keys(&kp, tok, 200, b, 3), 3);
    ck_assert(memcmp(a[0], b[1], 32));
}
END_TEST

Suite *suite_kvindex(void)
{
    Suite *s = suite_create("kvindex");
    TCase *tc = tcase_create("index");
    tcase_set_timeout(tc, 10);
    tcase_add_test(tc, test_kvindex_match_evict);
    tcase_add_test(tc, test_kvindex_bounded);
    tcase_add_test(tc, test_prefix_keys_shared);
    suite_add_tcase(s, tc);
    return s;
}
