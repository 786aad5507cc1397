/*
 * request.h - the router's request state machine (router/request.c; its states and events
 * are documented there). Internal to the router: every call runs on the loop thread. A
 * function that ends a request (on_result or on_error called, q freed) says so; after it the
 * caller must not touch q.
 */
#ifndef PDM_ROUTER_REQUEST_H
#define PDM_ROUTER_REQUEST_H

#include "router/internal.h"

/* The open request with router id `id`, or NULL. */
rt_req_t *rt_req_find(pdm_router_t *r, uint64_t id);

/* Admits q, filled in by the front-end API and QUEUED: the router owns it from now on. */
/* Frees a request that is in no list and everything it owns (NULL: nothing). */
void rt_req_free(rt_req_t *q);
/* A copy of q (not linked) that owns copies of everything q owns; NULL when out of memory. */
rt_req_t *rt_req_clone(const rt_req_t *q);
void rt_req_enqueue(pdm_router_t *r, rt_req_t *q);
/* A resumed request (GenerateRequest.resume_tokens, docs/sdk.md "Failover"): the n tokens
 * another router delivered become the completion's first tokens, not sent again; the client
 * holds text_bytes bytes of its text. Before rt_req_enqueue; the scheduler then continues it
 * as a migration (prompt + delivered tokens prefilled on the decode node). */
int rt_req_resume(pdm_router_t *r, rt_req_t *q, const int32_t *toks, size_t n,
                  uint32_t text_bytes);

/* QUEUED -> RESERVING: a new attempt on decode node d, prefilled by group g (-1: locally),
 * by all its ranks (solo_rank -1) or by rank solo_rank alone (a solo task, adapt.h); sends
 * the DecodeTask. A failure to plan or send is a failed attempt (q may have ended). */
void rt_req_dispatch(pdm_router_t *r, rt_req_t *q, int d, int g, int solo_rank);
/* Chunked prefill (request.c): with prefill_chunk_tokens set, sends the next chunk of q's
 * prompt to group g, chosen for a whole-group task (q stays QUEUED until it is done): 1.
 * 0: q goes whole now (nothing to chunk, or at most a chunk left: its own task continues
 * the chunks). -1: q waits for g (its chunks are done, but another task of g goes out
 * first). */
int rt_req_chunk(pdm_router_t *r, rt_req_t *q, int g);
/* Batched prefill: sends the batches that lost a member since the last pass (the others
 * may be all that was awaited); called by rt_schedule outside any walk of the queue. */
void rt_batch_send_pending(pdm_router_t *r);

/* Ends q with success: flushes the text held back for stop strings, calls sink.on_result and
 * frees q. */
void rt_req_finish(pdm_router_t *r, rt_req_t *q, int finish);

/* Ends q with an error (code: Pdmesh__ErrorCode): cancels its attempt on the decode node,
 * calls sink.on_error with the formatted message and frees q. */
void rt_req_fail(pdm_router_t *r, rt_req_t *q, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Ends a leader of OpenAI's n (rt_req_t.n_samples) without a word to any client: its attempt
 * is released (cancel: CancelTask to its decode node) and its choices still open leave it,
 * QUEUED: with code 0 each goes on alone (a migration from its delivered tokens), else each
 * ends with that error (msg) at the next scheduling pass. q is freed. */
void rt_leader_end(pdm_router_t *r, rt_req_t *q, int code, const char *msg, int cancel);

/* Ends every request past its deadline (DEADLINE_EXCEEDED). */
void rt_req_expire(pdm_router_t *r);

/* Messages of node `node` about a task, its sender and epoch already checked (registry.c).
 * One that is not about its request's current attempt there is dropped. */
void rt_req_on_reserved(pdm_router_t *r, int node, const Pdmesh__DecodeReserved *d);
void rt_req_on_prefill_result(pdm_router_t *r, int node, const Pdmesh__PrefillResult *p);
void rt_req_on_tokens(pdm_router_t *r, int node, const Pdmesh__DecodeTokens *d);
void rt_req_on_decode_result(pdm_router_t *r, int node, const Pdmesh__DecodeResult *d);
/* A node refused a message about a task (stale epoch, malformed, not for its role): the
 * attempt fails and is retried while the request's deadline allows. */
void rt_req_on_task_error(pdm_router_t *r, int node, const Pdmesh__Error *e);

/* Node `node` is gone (dead, deregistered or registered again; why says which), and with it
 * its prefill group `group` (-1: none): every attempt on either fails. */
void rt_req_on_node_lost(pdm_router_t *r, int node, int group, const char *why);

#endif
