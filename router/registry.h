/*
 * registry.h - nodes and prefill groups (router/registry.c). Internal to the router.
 */
#ifndef PDM_ROUTER_REGISTRY_H
#define PDM_ROUTER_REGISTRY_H

#include "router/internal.h"

/* Handles one message frame from the node socket (registration, heartbeats, deregistration;
 * task messages go to request.c once sender and epoch are checked). Errors are answered to
 * the sender. */
void rt_on_node_frame(pdm_router_t *r, const uint8_t *ident, size_t ident_len, const void *frame,
                      size_t len);
/* Declares dead every node whose lease ran out. */
void rt_registry_tick(pdm_router_t *r);
/* Whether group g may take a prefill: wired, every rank usable, not suspected. */
int rt_group_usable(const pdm_router_t *r, int g);
/* Sets the gauges computed at scrape time: nodes by role and state, offload bytes per decode
 * node, free and total KV tokens of the usable decode nodes, requests waiting (by what they
 * wait for), prefill tasks in flight per group and the per-group limit. */
void rt_node_metrics(pdm_router_t *r);
/* "alive", "draining" or "dead". */
const char *rt_node_state(const rt_node_t *n);

#endif
