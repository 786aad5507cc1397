/*
 * features.c - the router's rules on its nodes' protocol features (features.h).
 */
#include "router/features.h"

#include "common/pdm.h"

int rt_feat_group_ordered(const uint64_t *rank_features, uint32_t n_ranks, uint32_t *lacking)
{
    for (uint32_t k = 0; k < n_ranks; k++)
        if (!(rank_features[k] & PDM_FEAT_ORDERED_GROUP)) {
            if (lacking) *lacking = k;
            return 0;
        }
    if (!n_ranks && lacking) *lacking = 0;
    return n_ranks > 0;
}

int rt_feat_delta(uint64_t decode_features, const uint64_t *rank_features, uint32_t n_ranks)
{
    if (!(decode_features & PDM_FEAT_DELTA_KV) || !n_ranks) return 0;
    for (uint32_t k = 0; k < n_ranks; k++)
        if (!(rank_features[k] & PDM_FEAT_DELTA_KV)) return 0;
    return 1;
}
