/*
 * prefill.h - everything of prefill_node/ in one include, for callers that use several
 * parts. Each concern has its own header; include the one you need:
 *
 *   plan.h              the planner, pure: methods, even split, ranges of a task, partition
 *                       table lookup, calibration type, method choice (auto). No I/O, no UCX.
 *   conv.h              the group's conversation (prefix reuse), pure: the mirror the router,
 *                       the launcher and the ranks keep, where a follow-up turn starts, and
 *                       the plan of a task continuing it.
 *   pool.h              the group's pool of finished conversations (issue 19), pure: LRU
 *                       within a token budget, the same operations on the ranks (with their
 *                       KV rows) and in the router's mirror.
 *   plan_io.h           partition tables and calibration as JSON files.
 *   task.h              a prefill task, its stream target and result, rank parameters (types).
 *   rank.h              one rank of a prefill group (kvtransfer, model): create, run, destroy.
 *   kvfile.h            KV files: a conversation's whole KV in f32, for comparisons.
 *   partition_search.h  the KV-Runahead §4.2 partition search (Fig. 6).
 *   launch.h            a group of pdmesh-prefill processes (and a decode node) on this
 *                       machine.
 *
 * ARCHITECTURE.md "Prefill methods" describes the methods; plan.h lists them.
 */
#ifndef PDM_PREFILL_H
#define PDM_PREFILL_H

#include "prefill_node/conv.h"
#include "prefill_node/kvfile.h"
#include "prefill_node/launch.h"
#include "prefill_node/partition_search.h"
#include "prefill_node/plan.h"
#include "prefill_node/plan_io.h"
#include "prefill_node/pool.h"
#include "prefill_node/rank.h"
#include "prefill_node/task.h"

#endif /* PDM_PREFILL_H */
