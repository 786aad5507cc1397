/*
 * features.h - what the router does with the protocol features its nodes register with
 * (Register.features, PDM_FEAT_* of common/pdm.h), the pure rules: registry.c wires a group
 * ordered or not with rt_feat_group_ordered, schedule.c asks rt_feat_delta before a delta KV
 * transfer. A node of an older version registers with no features (0), so a mesh whose pods
 * are upgraded one by one runs what its oldest members understand (docs/deployment.md
 * "Versions").
 *
 * Both rules read only the registrations, never the time or a router's own state, so every
 * router of a mesh decides alike from the same registrations (two routers that wired one
 * group differently would split its ranks between two ways of running it).
 */
#ifndef RT_FEATURES_H
#define RT_FEATURES_H

#include <stdint.h>

/* Whether a group whose ranks registered with rank_features[0..n_ranks) runs ordered
 * (GroupWire.ordered: rank 0 forwards each group task, the others run only what it forwards):
 * 1 only if every rank has PDM_FEAT_ORDERED_GROUP. Otherwise 0 and *lacking (may be NULL) is
 * the first rank without it. A group of one rank has nothing to order but follows the same
 * rule, so that the flag says what its rank has. n_ranks 0: 0, *lacking 0. */
int rt_feat_group_ordered(const uint64_t *rank_features, uint32_t n_ranks, uint32_t *lacking);

/* Whether a delta KV transfer (the decode node takes the prompt's prefix from its pool,
 * DecodeTask.pool_prefix; the ranks stream only the rows from PrefillTask.stream_from on)
 * may go from the group whose ranks registered with rank_features[0..n_ranks) to the decode
 * node that registered with decode_features: 1 only if the node and every rank have
 * PDM_FEAT_DELTA_KV. An older rank would stream every row, an older node would wait for rows
 * it never asked its pool for. n_ranks 0: 0. */
int rt_feat_delta(uint64_t decode_features, const uint64_t *rank_features, uint32_t n_ranks);

#endif
