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

typedef struct {
    const char *host;            /* default "127.0.0.1" */
    int port;                    /* 0 = pick a free port (tests); see pdm_http_port */
    int max_connections;         /* bound on open connections (default 256) */
    double idle_timeout;         /* seconds a connection may sit without a complete request */
} pdm_http_config_t;

int pdm_http_start(pdm_router_t *r, const pdm_http_config_t *cfg, pdm_http_t **out);
int pdm_http_port(const pdm_http_t *h);
/* Closes the listener and every connection (their requests are cancelled). */
void pdm_http_stop(pdm_http_t *h);

#endif
