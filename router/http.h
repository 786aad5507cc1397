/*
 * OpenAI-compatible HTTP front end of the router (libuv + http-parser), on the router's loop:
 * POST /v1/completions, POST /v1/chat/completions (stream: true -> server-sent events),
 * GET /v1/models, GET /metrics (Prometheus text), GET /healthz, GET /readyz.
 * Requests become pdm_router_submit calls (router/router.h); errors map to HTTP status codes
 * with an OpenAI-style JSON error body; a client that disconnects cancels its request.
 */
#ifndef PDM_HTTP_H
#define PDM_HTTP_H

#include "router/router.h"

typedef struct pdm_http pdm_http_t;

/* Limits of the front end against clients that hold connections without using them (see
 * docs/http.md, "Abusive clients"). Zero in any field means its default. */
typedef struct {
    const char *host;            /* default "127.0.0.1" */
    int port;                    /* 0 = pick a free port (tests); see pdm_http_port */
    int max_connections;         /* open connections served at once; default: sized from
                                  * RLIMIT_NOFILE (pdm_http_default_slots) */
    int max_connections_per_peer; /* per source address (IPv6: per /64); default half of
                                  * max_connections, at most 256; -1: no per-peer limit */
    double idle_timeout;         /* seconds a keep-alive connection may wait between requests
                                  * (default 30); idle connections are also closed, oldest
                                  * first, when a new connection needs their slot */
    double head_timeout;         /* seconds for the request line and headers, from the
                                  * connection's open or the request's first byte (default 5) */
    double body_timeout;         /* seconds for the body once the headers are in (default 15) */
} pdm_http_config_t;

int pdm_http_start(pdm_router_t *r, const pdm_http_config_t *cfg, pdm_http_t **out);
int pdm_http_port(const pdm_http_t *h);
/* The default connection slots for an fd limit of `nofile` descriptors: a quarter (at least 256)
 * is left for ZeroMQ, UCX and files, 1/9 of the rest answers refusals (503/429 with a body
 * and a graceful close; max(64, slots / 8)), the remainder serves clients; at least 16, at
 * most 65536. */
int pdm_http_default_slots(long nofile);
/* Closes the listener and every connection (their requests are cancelled). */
void pdm_http_stop(pdm_http_t *h);

#endif
