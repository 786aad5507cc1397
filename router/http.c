/*
 * http.c - the router's OpenAI-compatible HTTP/1.1 server (libuv + http-parser).
 *
 * One connection is a small state machine:
 *   READING  parsing a request; one timer holds its deadline: the head deadline (request line
 *            and headers) from the connection's open or the request's first byte, then the
 *            body deadline; between keep-alive requests the idle timeout. A request that
 *            misses its deadline gets 408; a connection that sent nothing is closed quietly;
 *   BUSY     a request is being answered (a generation in the router, or a response being
 *            written); bytes that arrive meanwhile are pipelined requests, kept in a bounded
 *            buffer and parsed once the answer is complete, so answers keep request order;
 *   CLOSING  the last answer is being written, then a half-close (FIN) and a short linger that
 *            discards input, so the client reads the answer instead of a reset.
 *
 * Admission (on_connection) keeps the front end fair when clients hold connections without
 * using them: a connection that has not begun a request is "idle" and sits on a list, oldest
 * first; a new connection over its peer's share (source address, IPv6 per /64) or over the
 * slots takes the oldest idle connection's slot (of that peer, or of anyone). Only when none
 * is idle is it refused: accepted, answered 429 (its peer's share) or 503 (no slot) with a
 * JSON body, then closed gracefully like any answer, so a client that already sent its
 * request reads the refusal instead of a reset. Refusals use a small budget of their own;
 * beyond it a connection is closed at once (counted as "overflow").
 *
 * A client that disconnects while its request runs cancels it (pdm_router_cancel). The
 * generation's context (gen_t) outlives the connection when needed: the router's sink always
 * ends it exactly once, and a gen without a connection just frees itself then.
 *
 * Streaming (stream: true) is server-sent events in OpenAI's chunk format. The 200 status line
 * is sent with the first token, so a request that fails before producing anything gets a real
 * HTTP error status. A request that fails after tokens were streamed gets one event
 * `data: {"error": {...}}` and the stream ends WITHOUT `data: [DONE]`: [DONE] always means the
 * completion is whole (the openai client raises APIError on the error event).
 */
#include "router/http.h"

#include <cjson/cJSON.h>
#include <ctype.h>
#include <http_parser.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include "common/pdm.h"
#include "common/wire.h"
#include "router/http_internal.h"
#include "router/metrics.h"

#define HTTP_READ_BUF (64u << 10)
#define HTTP_MAX_URL 4096
#define HTTP_MAX_HEADER_BYTES (16u << 10)  /* request line + headers */
#define HTTP_PIPELINE_CAP (64u << 10)      /* bytes buffered while a request is answered */
#define HTTP_WRITE_QUEUE_CAP (8u << 20)    /* unsent bytes before a slow reader is dropped */
#define HTTP_LINGER_MS 2000
#define HTTP_DEFAULT_PER_PEER 256      /* connections per peer (at most half the slots) */
#define HTTP_DEFAULT_IDLE_S 30.0
#define HTTP_DEFAULT_HEAD_S 5.0
#define HTTP_DEFAULT_BODY_S 15.0
#define HTTP_FD_RESERVE 256            /* fds at least left to ZeroMQ, UCX and files */
#define HTTP_PEER_BUCKETS 1024
#define HTTP_PEER_KEY 17               /* address family, then up to 16 address bytes */

/* Connections from one source address (IPv6: one /64), for the per-peer share. */
typedef struct peer {
    struct peer *next;                 /* hash chain */
    unsigned char key[HTTP_PEER_KEY];
    int conns;                         /* served connections (refusals not counted) */
} peer_t;

/* What the connection's timer is waiting for while READING. */
enum deadline { DL_IDLE, DL_HEAD, DL_BODY };

typedef struct conn conn_t;

typedef struct gen gen_t;

/* One prompt of a request (completions take a list): its router request and what its stream
 * has sent. The router's sink context. */
typedef struct {
    gen_t *g;
    uint32_t index;          /* the choice's index (prompt * n + sample) */
    uint32_t sample;         /* OpenAI's n: its sample of its prompt (0..n-1) */
    int prompt_counted;      /* sample 0's part: its prompt's tokens are in the usage */
    uint64_t router_id;
    int done;                /* the router ended it (or it was never submitted) */
    size_t streamed;         /* bytes of completion text already sent */
    size_t text_offset;      /* completions' text_offset of the next streamed token */
    char *prompt;            /* echo: the prompt text as sent (NULL: token ids, or no echo) */
    cJSON *choice;           /* not streamed: the finished choice, until every part is done */
    pdm_http_tool_stream_t tools; /* streamed with tools: text held back from the deltas */
} gen_part_t;

/* A request being answered: n_parts prompts, each its own router request. It is freed once
 * every part has ended, whether or not the client is still there. */
struct gen {
    conn_t *conn;            /* NULL once the client is gone */
    int chat, stream, include_usage;
    int logprobs;            /* the request asked for log-probabilities */
    int echo;                /* completions' echo */
    int tools;               /* chat with tools: tool calls parsed from the output */
    int headers_sent;
    int answered;            /* the answer (or an error) went out; later parts are ignored */
    long created;
    char id[48];
    char *model;
    cJSON *usage;            /* the parts' usage, counts summed */
    size_t n_parts, n_done;
    gen_part_t parts[];
};

enum conn_state { C_READING, C_BUSY, C_CLOSING };

struct conn {
    pdm_http_t *http;
    conn_t *prev, *next;
    uv_tcp_t tcp;
    uv_timer_t timer;
    uv_shutdown_t shutdown_req;
    int handles;             /* open libuv handles (tcp, timer); freed at 0 */
    int closed;              /* uv_close called */
    enum conn_state state;
    int in_feed;
    int reading;             /* uv_read_start active */
    int writes;              /* uv_write requests in flight */
    int shut;                /* shutdown requested */
    int aborting;            /* conn_abort_soon: the timer closes it on the next loop turn */
    int refused;             /* answered 429/503 at admission; uses the refusal budget */
    int served;              /* at least one answer sent (idle then means keep-alive idle) */
    enum deadline deadline;  /* READING: which deadline the timer holds */
    conn_t *idle_prev, *idle_next; /* on the idle list (no request begun) */
    int idle;
    peer_t *peer;            /* NULL for refused connections */
    char peer_name[64];

    http_parser parser;
    int in_message;          /* between message begin and complete */
    int reject;              /* HTTP status decided by a parser callback (413, 431) */
    char url[HTTP_MAX_URL + 1];
    size_t url_len;
    size_t header_bytes;
    char hname[32];          /* the header being read (lower-cased, truncated) */
    size_t hname_len;
    char hvalue[64];
    size_t hvalue_len;
    int hlast_value;         /* last header callback was a value */
    int expect_continue;
    char *body;              /* request body, up to max_body bytes */
    size_t body_len, body_cap;

    int keep_alive;          /* of the response being written */
    int minor;               /* HTTP/1.minor of the request */
    gen_t *gen;
    char *pending;           /* pipelined bytes received while BUSY */
    size_t pending_len;
};

struct pdm_http {
    pdm_router_t *router;
    uv_loop_t *loop;
    uv_tcp_t listener;
    int handles;             /* listener + connections; freed at 0 after stop */
    int stopping;
    int port;
    int max_conns;           /* served connections */
    int max_refusing;        /* connections being answered 429/503 at once */
    int per_peer_max;        /* 0: none */
    uint64_t idle_ms, head_ms, body_ms;
    size_t max_body;
    conn_t *conns;           /* every open connection, refused ones too */
    int n_conns;             /* served connections */
    int n_refusing;
    conn_t *idle_head, *idle_tail; /* idle connections, oldest first */
    peer_t *peers[HTTP_PEER_BUCKETS];
    uint64_t next_request_id;
    long started;
    http_parser_settings settings;
    pdm_metric_t *m_responses;   /* pdmesh_http_responses_total{code} */
    pdm_metric_t *m_conns;       /* pdmesh_http_connections */
    pdm_metric_t *m_refusals;    /* pdmesh_http_refusals_total{reason} */
    pdm_metric_t *m_idle_closed; /* pdmesh_http_idle_closed_total{reason} */
    char read_buf[HTTP_READ_BUF];
};

static void conn_feed(conn_t *c, const char *data, size_t len);
static void conn_close_now(conn_t *c);
static void deadline_arm(conn_t *c, enum deadline kind);
static void idle_push(conn_t *c);
static void idle_remove(conn_t *c);
static int conn_read_start(conn_t *c);

/* ------------------------------------------------------------------ writing */

typedef struct {
    uv_write_t req;
    conn_t *c;
    char *buf;
} write_t;

static void conn_start_shutdown(conn_t *c);

static void on_write(uv_write_t *req, int status)
{
    write_t *w = (write_t *)req;
    conn_t *c = w->c;
    free(w->buf);
    free(w);
    c->writes--;
    if (c->closed) return;
    if (status < 0) {
        pdm_log_debug("http %s: write failed: %s", c->peer_name, uv_strerror(status));
        conn_close_now(c);
        return;
    }
    if (c->state == C_CLOSING && c->writes == 0) conn_start_shutdown(c);
}

/* Queues buf (malloc'ed, ownership taken) for writing. */
static void conn_write(conn_t *c, char *buf, size_t len)
{
    if (!buf) return;
    if (c->closed || len == 0) {
        free(buf);
        return;
    }
    write_t *w = malloc(sizeof(*w));
    if (!w) {
        free(buf);
        conn_close_now(c);
        return;
    }
    w->c = c;
    w->buf = buf;
    uv_buf_t b = uv_buf_init(buf, (unsigned)len);
    int st = uv_write(&w->req, (uv_stream_t *)&c->tcp, &b, 1, on_write);
    if (st < 0) {
        free(buf);
        free(w);
        conn_close_now(c);
        return;
    }
    c->writes++;
}

static char *str_printf(size_t *len, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static char *str_printf(size_t *len, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    char *s = NULL;
    int n = vasprintf(&s, fmt, ap);
    va_end(ap);
    if (n < 0) return NULL;
    *len = (size_t)n;
    return s;
}

static void count_response(conn_t *c, int status)
{
    if (!c->http->m_responses) return;
    char code[8];
    snprintf(code, sizeof(code), "%d", status);
    pdm_metric_inc(c->http->m_responses, code, 1);
}

/* Ends the current exchange: closes the connection or goes back to reading (parsing any
 * pipelined request already received). */
static void conn_finish(conn_t *c)
{
    if (c->closed || c->aborting) return;
    if (!c->keep_alive || c->http->stopping) {
        c->state = C_CLOSING;
        if (c->writes == 0) conn_start_shutdown(c);
        return;
    }
    c->state = C_READING;
    c->served = 1;
    deadline_arm(c, DL_IDLE);
    idle_push(c);
    if (!c->reading && conn_read_start(c) != 0) {
        conn_close_now(c);
        return;
    }
    if (!c->in_feed && c->pending) {
        char *p = c->pending;
        size_t n = c->pending_len;
        c->pending = NULL;
        c->pending_len = 0;
        conn_feed(c, p, n);
        free(p);
    }
}

/* A whole response with a body. extra: more header lines (each ending in \r\n) or "". */
static void conn_respond(conn_t *c, int status, const char *ctype, const char *body,
                         size_t body_len, const char *extra)
{
    idle_remove(c); /* an answer to bytes that never began a request (a parse error) */
    if (status >= 400 && c->reject) c->keep_alive = 0;
    size_t hlen;
    char *head = str_printf(&hlen,
                            "HTTP/1.%d %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
                            "Connection: %s\r\n%s\r\n",
                            c->minor ? 1 : 0, status, pdm_http__reason(status), ctype, body_len,
                            c->keep_alive ? "keep-alive" : "close", extra ? extra : "");
    char *all = head ? malloc(hlen + body_len) : NULL;
    if (!all) {
        free(head);
        conn_close_now(c);
        return;
    }
    memcpy(all, head, hlen);
    if (body_len) memcpy(all + hlen, body, body_len);
    free(head);
    count_response(c, status);
    conn_write(c, all, hlen + body_len);
    conn_finish(c);
}

static void conn_respond_error(conn_t *c, int status, const char *code, const char *message)
{
    char *body = pdm_http__error_json(status, code, message);
    const char *extra = "";
    if (status == 429 || status == 503) extra = "Retry-After: 1\r\n";
    else if (status == 405) extra = "Allow: GET, POST\r\n";
    conn_respond(c, status, "application/json", body ? body : "{}", body ? strlen(body) : 2,
                 extra);
    free(body);
}

/* ------------------------------------------------------------------ peers */

/* The peer key of an address: IPv4 (also IPv4-mapped IPv6) whole, IPv6 its /64, which one
 * host can usually fill with addresses of its own. */
static void peer_key(const struct sockaddr_storage *ss, unsigned char key[HTTP_PEER_KEY])
{
    memset(key, 0, HTTP_PEER_KEY);
    if (ss->ss_family == AF_INET) {
        key[0] = 4;
        memcpy(key + 1, &((const struct sockaddr_in *)ss)->sin_addr, 4);
    } else if (ss->ss_family == AF_INET6) {
        const unsigned char *a = ((const struct sockaddr_in6 *)ss)->sin6_addr.s6_addr;
        static const unsigned char mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
        if (!memcmp(a, mapped, 12)) {
            key[0] = 4;
            memcpy(key + 1, a + 12, 4);
        } else {
            key[0] = 6;
            memcpy(key + 1, a, 8);
        }
    }
}

static peer_t **peer_slot(pdm_http_t *h, const unsigned char key[HTTP_PEER_KEY])
{
    uint32_t x = 2166136261u; /* FNV-1a */
    for (int i = 0; i < HTTP_PEER_KEY; i++) x = (x ^ key[i]) * 16777619u;
    peer_t **pp = &h->peers[x % HTTP_PEER_BUCKETS];
    while (*pp && memcmp((*pp)->key, key, HTTP_PEER_KEY)) pp = &(*pp)->next;
    return pp;
}

/* The peer of `key`, created with no connections if new; NULL when out of memory. */
static peer_t *peer_get(pdm_http_t *h, const unsigned char key[HTTP_PEER_KEY])
{
    peer_t **pp = peer_slot(h, key);
    if (*pp) return *pp;
    peer_t *p = calloc(1, sizeof(*p));
    if (!p) return NULL;
    memcpy(p->key, key, HTTP_PEER_KEY);
    *pp = p;
    return p;
}

/* Drops one connection of `p` (may be NULL); the peer is freed with its last connection. */
static void peer_release(pdm_http_t *h, peer_t *p)
{
    if (!p || --p->conns > 0) return;
    peer_t **pp = peer_slot(h, p->key);
    *pp = p->next;
    free(p);
}

/* ------------------------------------------------------------------ idle list */

/* A READING connection that has not begun a request goes to the tail (the newest). */
static void idle_push(conn_t *c)
{
    pdm_http_t *h = c->http;
    if (c->idle || c->closed || c->refused || c->in_message) return;
    c->idle = 1;
    c->idle_next = NULL;
    c->idle_prev = h->idle_tail;
    if (h->idle_tail) h->idle_tail->idle_next = c;
    else h->idle_head = c;
    h->idle_tail = c;
}

static void idle_remove(conn_t *c)
{
    pdm_http_t *h = c->http;
    if (!c->idle) return;
    c->idle = 0;
    if (c->idle_prev) c->idle_prev->idle_next = c->idle_next;
    else h->idle_head = c->idle_next;
    if (c->idle_next) c->idle_next->idle_prev = c->idle_prev;
    else h->idle_tail = c->idle_prev;
    c->idle_prev = c->idle_next = NULL;
}

/* Closes the oldest idle connection (of peer `p` only, unless NULL) whose answers are all
 * written, to give its slot to a new connection. Returns 1 if one was closed. */
static int idle_reclaim(pdm_http_t *h, peer_t *p)
{
    for (conn_t *c = h->idle_head; c; c = c->idle_next) {
        if (c->writes || (p && c->peer != p)) continue;
        pdm_log_debug("http %s: idle connection closed for a new one", c->peer_name);
        if (h->m_idle_closed) pdm_metric_inc(h->m_idle_closed, "reclaimed", 1);
        conn_close_now(c);
        return 1;
    }
    return 0;
}

/* ------------------------------------------------------------------ closing */

static void http_maybe_free(pdm_http_t *h)
{
    if (h->stopping && h->handles == 0) free(h);
}

static void on_conn_handle_closed(uv_handle_t *handle)
{
    conn_t *c = handle->data;
    if (--c->handles > 0) return;
    pdm_http_t *h = c->http;
    free(c->body);
    free(c->pending);
    free(c);
    h->handles--;
    http_maybe_free(h);
}

/* Closes the connection at once; its running request, if any, is cancelled. */
static void conn_close_now(conn_t *c)
{
    if (c->closed) return;
    c->closed = 1;
    pdm_http_t *h = c->http;
    if (c->prev) c->prev->next = c->next;
    else h->conns = c->next;
    if (c->next) c->next->prev = c->prev;
    idle_remove(c);
    if (c->refused) {
        h->n_refusing--;
    } else {
        h->n_conns--;
        if (h->m_conns) pdm_metric_set(h->m_conns, NULL, h->n_conns);
    }
    peer_release(h, c->peer);
    c->peer = NULL;
    gen_t *g = c->gen;
    c->gen = NULL;
    uv_timer_stop(&c->timer);
    uv_close((uv_handle_t *)&c->timer, on_conn_handle_closed);
    uv_close((uv_handle_t *)&c->tcp, on_conn_handle_closed);
    if (g) {
        g->conn = NULL; /* the sink frees g when the router ends its last part (maybe inside
                         * cancel): the ids are taken first */
        uint64_t ids[PDM_HTTP_MAX_PROMPTS];
        size_t n = 0;
        for (size_t i = 0; i < g->n_parts && n < PDM_HTTP_MAX_PROMPTS; i++)
            if (!g->parts[i].done) ids[n++] = g->parts[i].router_id;
        for (size_t i = 0; i < n; i++) {
            pdm_log_debug("http %s: client gone, cancelling request %llu", c->peer_name,
                          (unsigned long long)ids[i]);
            pdm_router_cancel(h->router, ids[i]);
        }
    }
}

static void on_linger_timeout(uv_timer_t *t)
{
    conn_close_now(t->data);
}

static void on_shutdown(uv_shutdown_t *req, int status)
{
    conn_t *c = req->data;
    if (status < 0 && !c->closed) conn_close_now(c);
}

/* All answers written: send FIN, then read and discard until EOF or the linger timeout. */
static void conn_start_shutdown(conn_t *c)
{
    if (c->closed || c->shut || c->aborting) return;
    c->shut = 1;
    c->shutdown_req.data = c;
    if (uv_shutdown(&c->shutdown_req, (uv_stream_t *)&c->tcp, on_shutdown) < 0) {
        conn_close_now(c);
        return;
    }
    if (!c->reading && conn_read_start(c) != 0) {
        conn_close_now(c);
        return;
    }
    uv_timer_start(&c->timer, on_linger_timeout, HTTP_LINGER_MS, 0);
}

/* Closing from inside a router sink callback goes through the timer, so that the router is
 * never re-entered (pdm_router_cancel) from its own callback. */
static void on_abort_timer(uv_timer_t *t)
{
    conn_close_now(t->data);
}

static void conn_abort_soon(conn_t *c)
{
    if (c->closed || c->aborting) return;
    c->aborting = 1;
    uv_timer_start(&c->timer, on_abort_timer, 0, 0);
}

/* ------------------------------------------------------------------ deadlines */

static void count_refusal(pdm_http_t *h, const char *reason)
{
    if (h->m_refusals) pdm_metric_inc(h->m_refusals, reason, 1);
}

/* The READING deadline expired: a request begun gets 408; a connection that sent nothing of
 * a request is closed quietly. */
static void on_deadline(uv_timer_t *t)
{
    conn_t *c = t->data;
    pdm_http_t *h = c->http;
    if (c->closed || c->state != C_READING) return;
    if (!c->in_message) {
        if (h->m_idle_closed) pdm_metric_inc(h->m_idle_closed, c->served ? "idle_timeout"
                                                                          : "no_request", 1);
        conn_close_now(c);
        return;
    }
    int body = c->deadline == DL_BODY;
    char msg[128];
    snprintf(msg, sizeof(msg), "the request %s did not arrive within %.3g s",
             body ? "body" : "line and headers",
             (double)(body ? h->body_ms : h->head_ms) / 1000.0);
    pdm_log_debug("http %s: %s", c->peer_name, msg);
    count_refusal(h, body ? "body_timeout" : "head_timeout");
    c->state = C_BUSY;
    c->keep_alive = 0;
    c->reject = 408;
    c->minor = 1;
    conn_respond_error(c, 408, "request_timeout", msg);
}

static void deadline_arm(conn_t *c, enum deadline kind)
{
    if (c->closed || c->aborting) return;
    pdm_http_t *h = c->http;
    c->deadline = kind;
    uint64_t ms = kind == DL_IDLE ? h->idle_ms : kind == DL_HEAD ? h->head_ms : h->body_ms;
    uv_timer_start(&c->timer, on_deadline, ms, 0);
}

/* ------------------------------------------------------------------ generation sink */

static void gen_free(gen_t *g)
{
    for (size_t i = 0; i < g->n_parts; i++) {
        free(g->parts[i].prompt);
        cJSON_Delete(g->parts[i].choice);
        pdm_http__tool_stream_fini(&g->parts[i].tools);
    }
    cJSON_Delete(g->usage);
    free(g->model);
    free(g);
}

/* A part ended: counted; g is freed once every part has ended and the caller is done with it
 * (gen_release). */
static void gen_part_done(gen_part_t *p)
{
    if (p->done) return;
    p->done = 1;
    p->g->n_done++;
}

static void gen_release(gen_t *g)
{
    if (g->n_done == g->n_parts) gen_free(g);
}

/* Writes one chunk of a chunked body (or raw bytes for HTTP/1.0). */
static void conn_write_chunk(conn_t *c, const char *data, size_t len)
{
    size_t n;
    char *buf;
    if (c->minor) buf = str_printf(&n, "%zx\r\n%.*s\r\n", len, (int)len, data);
    else buf = str_printf(&n, "%.*s", (int)len, data);
    if (!buf) {
        conn_abort_soon(c);
        return;
    }
    conn_write(c, buf, n);
    if (!c->closed && uv_stream_get_write_queue_size((uv_stream_t *)&c->tcp) > HTTP_WRITE_QUEUE_CAP) {
        pdm_log_warn("http %s: client reads too slowly; dropping it", c->peer_name);
        conn_abort_soon(c);
    }
}

static void sse_event(conn_t *c, char *json)
{
    if (!json) {
        conn_abort_soon(c);
        return;
    }
    size_t n;
    char *ev = str_printf(&n, "data: %s\n\n", json);
    free(json);
    if (!ev) {
        conn_abort_soon(c);
        return;
    }
    conn_write_chunk(c, ev, n);
    free(ev);
}

static void sse_start(gen_t *g)
{
    conn_t *c = g->conn;
    if (g->headers_sent) return;
    g->headers_sent = 1;
    if (!c->minor) c->keep_alive = 0; /* HTTP/1.0: the end of the stream is the close */
    size_t n;
    char *head = str_printf(&n,
                            "HTTP/1.%d 200 OK\r\nContent-Type: text/event-stream\r\n"
                            "Cache-Control: no-cache\r\n%sConnection: %s\r\n\r\n",
                            c->minor ? 1 : 0, c->minor ? "Transfer-Encoding: chunked\r\n" : "",
                            c->keep_alive ? "keep-alive" : "close");
    count_response(c, 200);
    conn_write(c, head, n);
    if (g->chat)
        sse_event(c, pdm_http__chunk_json(1, g->id, g->created, g->model, "", NULL, 1, NULL, NULL));
}

static void sse_end(conn_t *c)
{
    if (c->minor) {
        size_t n;
        conn_write(c, str_printf(&n, "0\r\n\r\n"), 5);
    }
}

static void gen_on_prompt(void *ctx, Pdmesh__TokenLogprob *const *lps, size_t n)
{
    gen_part_t *p = ctx;
    gen_t *g = p->g;
    conn_t *c = g->conn;
    if (!c || c->closed || g->answered || !g->stream || !g->echo) return;
    /* The echo goes out first: the prompt's text and, with logprobs, its tokens' entries. */
    sse_start(g);
    char *echo = pdm_http__echo_text(p->prompt, lps, n);
    pdm_http_logprobs_t lp = {lps, n, 0};
    sse_event(c, pdm_http__chunk_json_at(0, g->id, g->created, g->model, p->index,
                                         echo ? echo : "", NULL, 0, NULL,
                                         g->logprobs ? &lp : NULL));
    free(echo);
    p->text_offset = pdm_http__logprobs_text_len(lps, n);
}

/* The tool-call filter's output as chunks: content deltas, and each call as OpenAI streams it
 * (a first delta with index, id, type and name, then the arguments). */
static void gen_tool_emit(void *ctx, const char *content, const char *name, const char *args)
{
    gen_part_t *p = ctx;
    gen_t *g = p->g;
    conn_t *c = g->conn;
    if (!c || c->closed) return;
    if (content) {
        sse_event(c, pdm_http__chunk_json_at(1, g->id, g->created, g->model, p->index, content,
                                             NULL, 0, NULL, NULL));
        return;
    }
    char call_id[PDM_HTTP_TOOL_CALL_ID_LEN];
    pdm_http__tool_call_id(call_id);
    int k = p->tools.calls;
    sse_event(c, pdm_http__tool_chunk_json(g->id, g->created, g->model, p->index, k, call_id,
                                           name, ""));
    if (c->closed) return;
    sse_event(c, pdm_http__tool_chunk_json(g->id, g->created, g->model, p->index, k, NULL,
                                           NULL, args));
}

static void gen_tool_feed(gen_part_t *p, const char *text, int final)
{
    if (pdm_http__tool_stream_feed(&p->tools, text, final, gen_tool_emit, p) != PDM_OK &&
        p->g->conn)
        conn_abort_soon(p->g->conn);
}

static void gen_on_tokens(void *ctx, uint32_t index, const int32_t *tokens, size_t n,
                          const char *text, Pdmesh__TokenLogprob *const *logprobs)
{
    gen_part_t *p = ctx;
    gen_t *g = p->g;
    conn_t *c = g->conn;
    if (!c || c->closed || !g->stream || g->answered) return;
    /* With logprobs, every token's entry goes out in the chunk of its arrival, even when its
     * text is still held back (a possible stop string): the chunk's text is then "". */
    const int with_lp = g->logprobs && logprobs && n > 0;
    if (!with_lp && (!text || !text[0])) return;
    sse_start(g);
    if (g->tools) {
        /* the text goes out through the tool-call filter; a chunk of its own carries the
         * tokens' log-probabilities */
        p->streamed += text ? strlen(text) : 0;
        if (with_lp) {
            pdm_http_logprobs_t lpt = {logprobs, n, p->text_offset};
            sse_event(c, pdm_http__chunk_json_at(1, g->id, g->created, g->model, p->index, "",
                                                 NULL, 0, NULL, &lpt));
            p->text_offset += pdm_http__logprobs_text_len(logprobs, n);
        }
        gen_tool_feed(p, text, 0);
        return;
    }
    pdm_http_logprobs_t lp = {logprobs, n, p->text_offset};
    sse_event(c, pdm_http__chunk_json_at(g->chat, g->id, g->created, g->model, p->index,
                                         text ? text : "", NULL, 0, NULL, with_lp ? &lp : NULL));
    if (with_lp) p->text_offset += pdm_http__logprobs_text_len(logprobs, n);
    p->streamed += text ? strlen(text) : 0;
}

/* Every part of a non-streamed request has its choice: the response. */
static void gen_respond_all(gen_t *g, conn_t *c)
{
    cJSON *choices = cJSON_CreateArray();
    for (size_t i = 0; choices && i < g->n_parts; i++) {
        if (g->parts[i].choice) cJSON_AddItemToArray(choices, g->parts[i].choice);
        g->parts[i].choice = NULL;
    }
    char *body = pdm_http__response_json(g->chat, g->id, g->created, g->model, choices, g->usage);
    g->usage = NULL;
    if (!body) conn_respond_error(c, 500, "internal_error", "out of memory");
    else conn_respond(c, 200, "application/json", body, strlen(body), "");
    free(body);
}

static void gen_on_result(void *ctx, const Pdmesh__GenerateResult *res)
{
    gen_part_t *p = ctx;
    gen_t *g = p->g;
    conn_t *c = g->conn;
    gen_part_done(p);
    if (!c || c->closed || g->answered) {
        gen_release(g);
        return;
    }
    /* a prompt's tokens count once, however many choices share it (OpenAI's usage) */
    gen_part_t *first = &g->parts[p->index - p->sample];
    const uint32_t pt = res->usage && !first->prompt_counted ? res->usage->prompt_tokens : 0;
    const uint32_t ct = res->usage ? res->usage->completion_tokens : 0;
    first->prompt_counted = 1;
    if (!g->usage) g->usage = pdm_http__usage_json(res->usage); /* (pt counted: the first) */
    else pdm_http__usage_add(g->usage, pt, ct);
    if (!g->stream) {
        char *echo = g->echo ? pdm_http__echo_text(p->prompt, res->prompt_logprobs,
                                                   res->n_prompt_logprobs)
                             : NULL;
        p->choice = pdm_http__choice_json(g->chat, p->index, res, g->logprobs,
                                          g->echo ? (echo ? echo : "") : NULL);
        free(echo);
        if (g->tools && p->choice) pdm_http__choice_tools(p->choice);
        if (g->n_done < g->n_parts) return;
        g->answered = 1;
        c->gen = NULL;
        gen_respond_all(g, c);
        gen_free(g);
        return;
    }
    sse_start(g);
    /* Whatever the token chunks did not carry (text completed only at the end). */
    const char *text = res->text ? res->text : "";
    size_t tl = strlen(text);
    if (g->tools) {
        gen_tool_feed(p, tl > p->streamed ? text + p->streamed : "", 1);
    } else if (tl > p->streamed) {
        sse_event(c, pdm_http__chunk_json_at(g->chat, g->id, g->created, g->model, p->index,
                                             text + p->streamed, NULL, 0, NULL, NULL));
    }
    const char *fr = pdm_http__finish_reason(res->finish);
    if (g->tools && p->tools.calls) fr = "tool_calls";
    sse_event(c, pdm_http__chunk_json_at(g->chat, g->id, g->created, g->model, p->index,
                                         g->chat ? NULL : "", fr ? fr : "stop", 0, NULL, NULL));
    if (g->n_done < g->n_parts) return;
    g->answered = 1;
    c->gen = NULL;
    if (g->include_usage) {
        cJSON *u = g->usage ? g->usage : pdm_http__usage_json(NULL);
        g->usage = NULL;
        sse_event(c, pdm_http__chunk_json_at(g->chat, g->id, g->created, g->model, 0, NULL, NULL,
                                             0, u, NULL));
    }
    static const char done[] = "data: [DONE]\n\n";
    conn_write_chunk(c, done, sizeof(done) - 1);
    sse_end(c);
    gen_free(g);
    conn_finish(c);
}

static void gen_on_error(void *ctx, int code, const char *message)
{
    gen_part_t *p = ctx;
    gen_t *g = p->g;
    conn_t *c = g->conn;
    gen_part_done(p);
    if (!c || c->closed || g->answered) {
        gen_release(g);
        return;
    }
    /* The first part to fail answers for the request; the others run out unseen. */
    g->answered = 1;
    c->gen = NULL;
    int status = pdm_http__status_for_code(code);
    const char *msg = message && *message ? message : "the request failed";
    if (!g->headers_sent) {
        conn_respond_error(c, status, pdm_http__code_name(code), msg);
        gen_release(g);
        return;
    }
    /* Tokens went out already: an error event, and no [DONE] (see the top of this file). */
    sse_event(c, pdm_http__error_json(status, pdm_http__code_name(code), msg));
    sse_end(c);
    gen_release(g);
    conn_finish(c);
}

/* ------------------------------------------------------------------ handlers */

static void handle_generate(conn_t *c, int chat)
{
    pdm_http_t *h = c->http;
    const char *model = pdm_router_model_name(h->router);
    Pdmesh__GenerateRequest **reqs = NULL;
    size_t n = 0;
    pdm_http_opts_t opts;
    pdm_http_err_t err;
    if (pdm_http__parse_batch(c->body, c->body_len, chat, pdm_router_limits(h->router), model,
                              &reqs, &n, &opts, &err) != PDM_OK) {
        conn_respond_error(c, err.status, err.code, err.message);
        return;
    }
    const size_t ns = opts.n_samples > 1 ? (size_t)opts.n_samples : 1, n_parts = n * ns;
    gen_t *g = calloc(1, sizeof(*g) + n_parts * sizeof(gen_part_t));
    if (!g || !(g->model = strdup(model ? model : ""))) {
        free(g);
        pdm_http__batch_free(reqs, n);
        conn_respond_error(c, 500, "internal_error", "out of memory");
        return;
    }
    g->conn = c;
    g->chat = chat;
    g->stream = opts.stream;
    g->include_usage = opts.include_usage;
    g->logprobs = opts.logprobs >= 0;
    g->echo = opts.echo;
    g->tools = opts.tools;
    g->created = (long)time(NULL);
    g->n_parts = n_parts;
    uint64_t rnd = 0;
    pdm_random_bytes(&rnd, sizeof(rnd));
    snprintf(g->id, sizeof(g->id), "%s-%016llx", chat ? "chatcmpl" : "cmpl",
             (unsigned long long)rnd);
    char client[80];
    snprintf(client, sizeof(client), "http:%s", c->peer_name);
    size_t i = 0;
    int st = PDM_OK, code = 0;
    for (; i < n; i++) { /* prompt i: its ns choices are parts [i * ns, (i + 1) * ns) */
        pdm_router_sink_t sinks[PDM_HTTP_MAX_PROMPTS];
        uint64_t ids[PDM_HTTP_MAX_PROMPTS];
        for (size_t k = 0; k < ns && st == PDM_OK; k++) {
            gen_part_t *p = &g->parts[i * ns + k];
            p->g = g;
            p->index = (uint32_t)(i * ns + k);
            p->sample = (uint32_t)k;
            if (g->echo && reqs[i]->prompt && !(p->prompt = strdup(reqs[i]->prompt))) {
                st = PDM_ENOMEM;
                pdm_error_set(st, "out of memory");
                code = PDMESH__ERROR_CODE__ERR_INTERNAL;
            }
            sinks[k] = (pdm_router_sink_t){p, gen_on_tokens, gen_on_result, gen_on_error,
                                           gen_on_prompt};
        }
        if (st) break;
        reqs[i]->request_id = ++h->next_request_id;
        pdm_error_clear();
        if ((st = pdm_router_submit(h->router, reqs[i], client, sinks, ids, &code))) break;
        for (size_t k = 0; k < ns; k++) g->parts[i * ns + k].router_id = ids[k];
    }
    pdm_http__batch_free(reqs, n);
    if (st == PDM_OK) {
        c->gen = g;
        return;
    }
    i *= ns; /* parts [0, i) were submitted */
    /* Prompt i was refused: the request fails as a whole, the parts already submitted are
     * cancelled (their ends free g: it is not touched after the last cancel). */
    if (code == 0)
        code = st == PDM_EINVAL || st == PDM_ERANGE ? PDMESH__ERROR_CODE__ERR_INVALID_ARGUMENT
               : st == PDM_EOVERFLOW               ? PDMESH__ERROR_CODE__ERR_OVERLOADED
                                                   : PDMESH__ERROR_CODE__ERR_UNAVAILABLE;
    char msg[300];
    if (n > 1) snprintf(msg, sizeof(msg), "prompt %zu: %s", i / ns, pdm_error_last());
    else snprintf(msg, sizeof(msg), "%s", pdm_error_last());
    conn_respond_error(c, pdm_http__status_for_code(code), pdm_http__code_name(code), msg);
    g->answered = 1;
    g->conn = NULL;
    for (size_t j = i; j < n_parts; j++) gen_part_done(&g->parts[j]);
    uint64_t ids[PDM_HTTP_MAX_PROMPTS];
    size_t k = 0;
    for (size_t j = 0; j < i && k < PDM_HTTP_MAX_PROMPTS; j++) ids[k++] = g->parts[j].router_id;
    if (k == 0) {
        gen_free(g);
        return;
    }
    for (size_t j = 0; j < k; j++) pdm_router_cancel(h->router, ids[j]);
}

static void handle_models(conn_t *c, const char *one)
{
    const char *model = pdm_router_model_name(c->http->router);
    if (!model) model = "";
    if (one && strcmp(one, model)) {
        char msg[200];
        snprintf(msg, sizeof(msg), "the model '%.80s' does not exist", one);
        conn_respond_error(c, 404, "model_not_found", msg);
        return;
    }
    size_t n;
    char *body;
    if (one)
        body = str_printf(&n, "{\"id\":\"%s\",\"object\":\"model\",\"created\":%ld,"
                              "\"owned_by\":\"pdmesh\"}", model, c->http->started);
    else
        body = str_printf(&n, "{\"object\":\"list\",\"data\":[{\"id\":\"%s\",\"object\":\"model\","
                              "\"created\":%ld,\"owned_by\":\"pdmesh\"}]}", model,
                          c->http->started);
    if (!body) {
        conn_respond_error(c, 500, "internal_error", "out of memory");
        return;
    }
    conn_respond(c, 200, "application/json", body, n, "");
    free(body);
}

static void handle_metrics(conn_t *c)
{
    struct pdm_metrics *m = pdm_router_metrics(c->http->router);
    size_t n = 0;
    char *text = m ? pdm_metrics_render(m, &n) : NULL;
    if (m && !text) {
        conn_respond_error(c, 500, "internal_error", "could not render the metrics");
        return;
    }
    conn_respond(c, 200, "text/plain; version=0.0.4; charset=utf-8", text ? text : "", n, "");
    free(text);
}

/* ------------------------------------------------------------------ tokenizer endpoints
 *
 * vLLM's shapes (lm-evaluation-harness's remote tokenizer speaks them): POST /tokenize
 * {"prompt", "add_special_tokens" (default true)} -> {"tokens", "count", "max_model_len"};
 * POST /detokenize {"tokens"} -> {"prompt"}; GET /tokenizer_info -> {"bos_token",
 * "eos_token", "pad_token", "model"}. */

static void respond_json(conn_t *c, cJSON *root)
{
    char *body = root ? cJSON_PrintUnformatted(root) : NULL;
    cJSON_Delete(root);
    if (!body) {
        conn_respond_error(c, 500, "internal_error", "out of memory");
        return;
    }
    conn_respond(c, 200, "application/json", body, strlen(body), "");
    free(body);
}

/* The text of ids[n] (control tokens rendered), made valid UTF-8; NULL when out of memory or
 * an id is outside the vocabulary (*bad set). */
static char *detokenize(pdm_router_t *r, const cJSON *ids, int *bad)
{
    size_t cap = 256, len = 0;
    char *raw = malloc(cap), piece[256];
    const cJSON *t;
    *bad = 0;
    cJSON_ArrayForEach(t, ids) {
        int w = cJSON_IsNumber(t) && t->valuedouble >= 0 && t->valuedouble <= INT32_MAX &&
                        t->valuedouble == (int32_t)t->valuedouble
                    ? pdm_router_token_text(r, (int32_t)t->valuedouble, piece, sizeof(piece))
                    : PDM_ERANGE;
        if (w < 0) {
            *bad = 1;
            free(raw);
            return NULL;
        }
        if (raw && len + (size_t)w + 1 > cap) {
            char *grown = realloc(raw, cap = 2 * cap + (size_t)w);
            if (!grown) free(raw);
            raw = grown;
        }
        if (!raw) return NULL;
        memcpy(raw + len, piece, (size_t)w);
        len += (size_t)w;
    }
    char *clean = raw ? pdm_http__utf8_sanitize(raw, len) : NULL;
    free(raw);
    return clean;
}

static void handle_tokenizer(conn_t *c, const char *what)
{
    pdm_router_t *r = c->http->router;
    if (!strcmp(what, "info")) {
        cJSON *root = cJSON_CreateObject();
        static const char *const names[] = {"bos_token", "eos_token"};
        for (int i = 0; i < 2 && root; i++) {
            int32_t id = pdm_router_special_token(r, i);
            char piece[256];
            int w = id >= 0 ? pdm_router_token_text(r, id, piece, sizeof(piece) - 1) : -1;
            if (w >= 0) {
                piece[w] = 0;
                cJSON_AddStringToObject(root, names[i], piece);
            } else {
                cJSON_AddNullToObject(root, names[i]);
            }
        }
        cJSON_AddNullToObject(root, "pad_token");
        cJSON_AddStringToObject(root, "model", pdm_router_model_name(r));
        respond_json(c, root);
        return;
    }
    cJSON *in = cJSON_ParseWithLength(c->body ? c->body : "", c->body_len);
    if (!cJSON_IsObject(in)) {
        cJSON_Delete(in);
        conn_respond_error(c, 400, "invalid_json", "the request body must be a JSON object");
        return;
    }
    cJSON *out = cJSON_CreateObject();
    if (!strcmp(what, "tokenize")) {
        const cJSON *p = cJSON_GetObjectItemCaseSensitive(in, "prompt");
        const cJSON *sp = cJSON_GetObjectItemCaseSensitive(in, "add_special_tokens");
        int32_t *ids = NULL;
        size_t n = 0;
        if (!cJSON_IsString(p)) {
            conn_respond_error(c, 400, "invalid_type", "'prompt' must be a string");
        } else if (pdm_router_tokenize(r, p->valuestring, strlen(p->valuestring),
                                       !cJSON_IsFalse(sp), &ids, &n)) {
            conn_respond_error(c, 400, "invalid_value", pdm_error_last());
        } else {
            cJSON_AddItemToObject(out, "tokens", cJSON_CreateIntArray((const int *)ids, (int)n));
            cJSON_AddNumberToObject(out, "count", (double)n);
            const pdm_router_limits_t *lim = pdm_router_limits(r);
            cJSON_AddNumberToObject(out, "max_model_len", lim->max_prompt_tokens);
            respond_json(c, out);
            out = NULL;
        }
        free(ids);
    } else {
        const cJSON *ids = cJSON_GetObjectItemCaseSensitive(in, "tokens");
        int bad = 0;
        char *text = cJSON_IsArray(ids) ? detokenize(r, ids, &bad) : NULL;
        if (!cJSON_IsArray(ids) || bad) {
            conn_respond_error(c, 400, "invalid_value",
                               "'tokens' must be a list of token ids of the vocabulary");
        } else if (!text) {
            conn_respond_error(c, 500, "internal_error", "out of memory");
        } else {
            cJSON_AddStringToObject(out, "prompt", text);
            respond_json(c, out);
            out = NULL;
        }
        free(text);
    }
    cJSON_Delete(out);
    cJSON_Delete(in);
}

/* Percent-decoding is not needed: every route and model name is plain ASCII. */
static void conn_dispatch(conn_t *c)
{
    c->state = C_BUSY;
    uv_timer_stop(&c->timer);
    c->keep_alive = http_should_keep_alive(&c->parser) && !c->http->stopping;
    c->minor = c->parser.http_major == 1 ? c->parser.http_minor : 1;
    char *q = strchr(c->url, '?');
    if (q) *q = 0;
    const char *path = c->url;
    int method = c->parser.method;
    int get = method == HTTP_GET, post = method == HTTP_POST;

    if (!strcmp(path, "/v1/completions") || !strcmp(path, "/v1/chat/completions")) {
        if (!post) goto bad_method;
        handle_generate(c, path[4] == 'c' && path[5] == 'h');
        return;
    }
    if (!strcmp(path, "/v1/models") || !strncmp(path, "/v1/models/", 11)) {
        if (!get) goto bad_method;
        handle_models(c, path[10] == '/' ? path + 11 : NULL);
        return;
    }
    if (!strcmp(path, "/tokenize") || !strcmp(path, "/detokenize")) {
        if (!post) goto bad_method;
        handle_tokenizer(c, path + 1);
        return;
    }
    if (!strcmp(path, "/tokenizer_info")) {
        if (!get) goto bad_method;
        handle_tokenizer(c, "info");
        return;
    }
    if (!strcmp(path, "/metrics")) {
        if (!get) goto bad_method;
        handle_metrics(c);
        return;
    }
    if (!strcmp(path, "/healthz")) {
        if (!get) goto bad_method;
        conn_respond(c, 200, "text/plain; charset=utf-8", "ok\n", 3, "");
        return;
    }
    if (!strcmp(path, "/readyz")) {
        if (!get) goto bad_method;
        if (pdm_router_ready(c->http->router))
            conn_respond(c, 200, "text/plain; charset=utf-8", "ready\n", 6, "");
        else
            conn_respond(c, 503, "text/plain; charset=utf-8", "not ready\n", 10,
                         "Retry-After: 1\r\n");
        return;
    }
    char msg[HTTP_MAX_URL + 64];
    snprintf(msg, sizeof(msg), "no route for %s %.200s", http_method_str(method), path);
    conn_respond_error(c, 404, "not_found", msg);
    return;
bad_method:
    snprintf(msg, sizeof(msg), "%s is not allowed on %.200s", http_method_str(method), path);
    conn_respond_error(c, 405, "method_not_allowed", msg);
}

/* ------------------------------------------------------------------ parser callbacks */

static int header_budget(conn_t *c, size_t n)
{
    c->header_bytes += n;
    if (c->header_bytes > HTTP_MAX_HEADER_BYTES) {
        c->reject = 431;
        return -1;
    }
    return 0;
}

static int on_message_begin(http_parser *p)
{
    conn_t *c = p->data;
    c->in_message = 1;
    idle_remove(c);
    /* A new connection's head deadline runs from its open, a keep-alive request's from its
     * first byte. */
    if (c->deadline == DL_IDLE) deadline_arm(c, DL_HEAD);
    c->reject = 0;
    c->url_len = 0;
    c->url[0] = 0;
    c->header_bytes = 0;
    c->hname_len = c->hvalue_len = 0;
    c->hlast_value = 0;
    c->expect_continue = 0;
    c->body_len = 0;
    return 0;
}

static int on_url(http_parser *p, const char *at, size_t len)
{
    conn_t *c = p->data;
    if (header_budget(c, len)) return -1;
    if (c->url_len + len > HTTP_MAX_URL) {
        c->reject = 431;
        return -1;
    }
    memcpy(c->url + c->url_len, at, len);
    c->url_len += len;
    c->url[c->url_len] = 0;
    return 0;
}

/* The one request header we act on: "Expect: 100-continue". */
static void header_done(conn_t *c)
{
    c->hname[c->hname_len] = 0;
    c->hvalue[c->hvalue_len] = 0;
    if (!strcmp(c->hname, "expect") && !strcasecmp(c->hvalue, "100-continue"))
        c->expect_continue = 1;
    c->hname_len = c->hvalue_len = 0;
}

static int on_header_field(http_parser *p, const char *at, size_t len)
{
    conn_t *c = p->data;
    if (header_budget(c, len)) return -1;
    if (c->hlast_value) header_done(c);
    c->hlast_value = 0;
    for (size_t i = 0; i < len && c->hname_len < sizeof(c->hname) - 1; i++)
        c->hname[c->hname_len++] = (char)tolower((unsigned char)at[i]);
    return 0;
}

static int on_header_value(http_parser *p, const char *at, size_t len)
{
    conn_t *c = p->data;
    if (header_budget(c, len)) return -1;
    c->hlast_value = 1;
    for (size_t i = 0; i < len && c->hvalue_len < sizeof(c->hvalue) - 1; i++)
        c->hvalue[c->hvalue_len++] = at[i];
    return 0;
}

static int on_headers_complete(http_parser *p)
{
    conn_t *c = p->data;
    if (c->hlast_value) header_done(c);
    if (!(p->flags & F_CHUNKED) && p->content_length != ULLONG_MAX &&
        p->content_length > c->http->max_body) {
        c->reject = 413;
        return -1;
    }
    if ((p->flags & F_CHUNKED) || (p->content_length != ULLONG_MAX && p->content_length > 0))
        deadline_arm(c, DL_BODY);
    if (c->expect_continue && p->http_major == 1 && p->http_minor >= 1) {
        static const char cont[] = "HTTP/1.1 100 Continue\r\n\r\n";
        char *b = malloc(sizeof(cont));
        if (b) {
            memcpy(b, cont, sizeof(cont));
            conn_write(c, b, sizeof(cont) - 1);
        }
    }
    return 0;
}

static int on_body(http_parser *p, const char *at, size_t len)
{
    conn_t *c = p->data;
    if (c->body_len + len > c->http->max_body) {
        c->reject = 413;
        return -1;
    }
    if (c->body_len + len + 1 > c->body_cap) {
        size_t cap = c->body_cap ? c->body_cap : 4096;
        while (cap < c->body_len + len + 1) cap *= 2;
        char *b = realloc(c->body, cap);
        if (!b) {
            c->reject = 413;
            return -1;
        }
        c->body = b;
        c->body_cap = cap;
    }
    memcpy(c->body + c->body_len, at, len);
    c->body_len += len;
    c->body[c->body_len] = 0;
    return 0;
}

static int on_message_complete(http_parser *p)
{
    conn_t *c = p->data;
    c->in_message = 0;
    http_parser_pause(p, 1); /* conn_feed dispatches, then resumes */
    return 0;
}

/* Parses bytes while the connection is READING; dispatches every whole request; keeps what
 * arrives behind a request that is still being answered. */
static void conn_feed(conn_t *c, const char *data, size_t len)
{
    c->in_feed = 1;
    while (len > 0 && !c->closed && c->state == C_READING) {
        size_t n = http_parser_execute(&c->parser, &c->http->settings, data, len);
        enum http_errno e = HTTP_PARSER_ERRNO(&c->parser);
        if (n > len) n = len;
        data += n;
        len -= n;
        if (e == HPE_PAUSED) {
            http_parser_pause(&c->parser, 0);
            conn_dispatch(c);
            continue;
        }
        if (e != HPE_OK || c->parser.upgrade) {
            int status = c->reject ? c->reject : 400;
            char msg[160];
            if (status == 413)
                snprintf(msg, sizeof(msg), "the request body exceeds %zu bytes", c->http->max_body);
            else if (status == 431)
                snprintf(msg, sizeof(msg), "the request line and headers exceed %u bytes",
                         HTTP_MAX_HEADER_BYTES);
            else
                snprintf(msg, sizeof(msg), "malformed HTTP request: %s",
                         c->parser.upgrade ? "protocol upgrades are not supported"
                                           : http_errno_description(e));
            c->state = C_BUSY;
            c->keep_alive = 0;
            c->reject = status;
            c->minor = 1;
            uv_timer_stop(&c->timer);
            conn_respond_error(c, status,
                               status == 413   ? "request_too_large"
                               : status == 431 ? "headers_too_large"
                                               : "bad_request",
                               msg);
            len = 0;
            break;
        }
    }
    if (len > 0 && !c->closed && c->state == C_BUSY) {
        char *p = realloc(c->pending, c->pending_len + len);
        if (!p) {
            c->in_feed = 0;
            conn_close_now(c);
            return;
        }
        memcpy(p + c->pending_len, data, len);
        c->pending = p;
        c->pending_len += len;
        if (c->pending_len >= HTTP_PIPELINE_CAP && c->reading) {
            uv_read_stop((uv_stream_t *)&c->tcp); /* back-pressure on a deep pipeline */
            c->reading = 0;
        }
    }
    c->in_feed = 0;
}

/* ------------------------------------------------------------------ libuv callbacks */

static void on_alloc(uv_handle_t *handle, size_t suggested, uv_buf_t *buf)
{
    conn_t *c = handle->data;
    *buf = uv_buf_init(c->http->read_buf, sizeof(c->http->read_buf));
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    conn_t *c = s->data;
    if (c->closed) return;
    if (nread < 0) {
        /* EOF or error: a running request is cancelled (the client went away). */
        conn_close_now(c);
        return;
    }
    if (nread == 0) return;
    if (c->state == C_CLOSING) return; /* lingering: discard */
    if (c->state == C_READING) {
        conn_feed(c, buf->base, (size_t)nread);
        return;
    }
    /* BUSY: a pipelined request; conn_feed with state BUSY only buffers. */
    conn_feed(c, buf->base, (size_t)nread);
}

static int conn_read_start(conn_t *c)
{
    int st = uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read);
    if (st == 0) c->reading = 1;
    return st;
}

/* The last resort when even the refusal budget is spent: a short 503 if the socket takes it at
 * once, then the close (a client that already sent its request may see a reset). */
static void conn_drop_overflow(conn_t *c)
{
    static const char busy[] =
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        "Retry-After: 1\r\nConnection: close\r\nContent-Length: 105\r\n\r\n"
        "{\"error\":{\"message\":\"too many open connections\",\"type\":\"server_error\","
        "\"param\":null,\"code\":\"too_many_connections\"}}";
    uv_buf_t b = uv_buf_init((char *)busy, sizeof(busy) - 1);
    uv_try_write((uv_stream_t *)&c->tcp, &b, 1);
    count_refusal(c->http, "overflow");
    count_response(c, 503);
    c->refused = 1; /* not counted as served: conn_close_now balances the refusal count */
    c->http->n_refusing++;
    conn_close_now(c);
}

/* Answers a connection that may not be served with `status` and closes it gracefully (the
 * answer, FIN, then the linger that reads what the client still sends). */
static void conn_refuse(conn_t *c, int status, const char *code, const char *reason,
                        const char *message)
{
    pdm_http_t *h = c->http;
    if (h->n_refusing >= h->max_refusing) {
        conn_drop_overflow(c);
        return;
    }
    c->refused = 1;
    h->n_refusing++;
    count_refusal(h, reason);
    pdm_log_debug("http %s: refused: %s", c->peer_name, message);
    c->state = C_BUSY;
    c->keep_alive = 0;
    c->minor = 1;
    conn_respond_error(c, status, code, message);
}

/* Admits an accepted connection: within its peer's share and the slots, taking an idle
 * connection's slot if needed (see the top of this file), else refused. */
static void conn_admit(conn_t *c, const struct sockaddr_storage *ss)
{
    pdm_http_t *h = c->http;
    unsigned char key[HTTP_PEER_KEY];
    peer_key(ss, key);
    peer_t *p = peer_get(h, key);
    if (!p) {
        conn_refuse(c, 503, "too_many_connections", "connections", "out of memory");
        return;
    }
    /* Counted before reclaiming, so that closing the peer's last idle connection does not
     * free the peer. */
    c->peer = p;
    p->conns++;
    h->n_conns++;
    if (h->per_peer_max > 0 && p->conns > h->per_peer_max && !idle_reclaim(h, p)) {
        char msg[160];
        snprintf(msg, sizeof(msg), "too many open connections from your address (the limit is "
                 "%d; close idle ones or reuse them)", h->per_peer_max);
        h->n_conns--;
        peer_release(h, p);
        c->peer = NULL;
        conn_refuse(c, 429, "too_many_connections_per_peer", "peer_connections", msg);
        return;
    }
    if (h->n_conns > h->max_conns && !idle_reclaim(h, NULL)) {
        h->n_conns--;
        peer_release(h, p);
        c->peer = NULL;
        conn_refuse(c, 503, "too_many_connections", "connections", "too many open connections");
        return;
    }
    if (h->m_conns) pdm_metric_set(h->m_conns, NULL, h->n_conns);
    c->state = C_READING;
    if (conn_read_start(c) != 0) {
        conn_close_now(c);
        return;
    }
    deadline_arm(c, DL_HEAD);
    idle_push(c);
}

static void on_connection(uv_stream_t *server, int status)
{
    pdm_http_t *h = server->data;
    if (status < 0 || h->stopping) return;
    conn_t *c = calloc(1, sizeof(*c));
    if (!c) return; /* libuv stops accepting until the next call; the kernel keeps the backlog */
    c->http = h;
    uv_tcp_init(h->loop, &c->tcp);
    uv_timer_init(h->loop, &c->timer);
    c->tcp.data = c;
    c->timer.data = c;
    c->handles = 2;
    h->handles++;
    c->next = h->conns;
    if (h->conns) h->conns->prev = c;
    h->conns = c;
    /* Counted as refusing until admitted, so that closing it here balances the counts. */
    c->refused = 1;
    h->n_refusing++;
    http_parser_init(&c->parser, HTTP_REQUEST);
    c->parser.data = c;
    c->state = C_BUSY;
    c->minor = 1;
    if (uv_accept(server, (uv_stream_t *)&c->tcp) != 0) {
        conn_close_now(c);
        return;
    }
    uv_tcp_nodelay(&c->tcp, 1);
    struct sockaddr_storage ss;
    memset(&ss, 0, sizeof(ss));
    int sl = sizeof(ss);
    snprintf(c->peer_name, sizeof(c->peer_name), "?");
    if (uv_tcp_getpeername(&c->tcp, (struct sockaddr *)&ss, &sl) == 0) {
        if (ss.ss_family == AF_INET)
            uv_ip4_name((struct sockaddr_in *)&ss, c->peer_name, sizeof(c->peer_name));
        else if (ss.ss_family == AF_INET6)
            uv_ip6_name((struct sockaddr_in6 *)&ss, c->peer_name, sizeof(c->peer_name));
    }
    c->refused = 0;
    h->n_refusing--;
    conn_admit(c, &ss);
}

/* ------------------------------------------------------------------ public */

static void on_listener_closed(uv_handle_t *handle)
{
    pdm_http_t *h = handle->data;
    h->handles--;
    http_maybe_free(h);
}

int pdm_http_default_slots(long nofile)
{
    long reserve = nofile / 4 > HTTP_FD_RESERVE ? nofile / 4 : HTTP_FD_RESERVE;
    long avail = nofile - reserve;
    long slots = avail * 8 / 9; /* and slots / 8 for refusals (pdm_http_start) */
    if (slots < 16) slots = 16;
    if (slots > 65536) slots = 65536;
    return (int)slots;
}

static uint64_t http_ms(double seconds, double fallback)
{
    uint64_t ms = (uint64_t)((seconds > 0 ? seconds : fallback) * 1000.0);
    return ms ? ms : 1;
}

int pdm_http_start(pdm_router_t *r, const pdm_http_config_t *cfg, pdm_http_t **out)
{
    if (!r || !out) return pdm_error_set(PDM_EINVAL, "pdm_http_start: no router");
    const char *host = cfg && cfg->host && *cfg->host ? cfg->host : "127.0.0.1";
    int port = cfg ? cfg->port : 8080;
    if (port < 0 || port > 65535)
        return pdm_error_set(PDM_EINVAL, "http: port %d is out of range", port);
    if (!strcmp(host, "localhost")) host = "127.0.0.1";
    struct sockaddr_storage addr;
    if (uv_ip4_addr(host, port, (struct sockaddr_in *)&addr) != 0 &&
        uv_ip6_addr(host, port, (struct sockaddr_in6 *)&addr) != 0)
        return pdm_error_set(PDM_EINVAL, "http: '%s' is not an IPv4 or IPv6 address", host);

    pdm_http_t *h = calloc(1, sizeof(*h));
    if (!h) return pdm_error_set(PDM_ENOMEM, "http: out of memory");
    h->router = r;
    h->loop = pdm_router_loop(r);
    struct rlimit rl;
    long nofile = getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY
                      ? (long)rl.rlim_cur : 1024;
    h->max_conns = cfg && cfg->max_connections > 0 ? cfg->max_connections
                                                   : pdm_http_default_slots(nofile);
    h->max_refusing = h->max_conns / 8 > 64 ? h->max_conns / 8 : 64;
    if ((long)h->max_conns + h->max_refusing + HTTP_FD_RESERVE > nofile)
        pdm_log_warn("http: %d connection slots and %d for refusals leave fewer than %d of the "
                     "%ld file descriptors (ulimit -n) to the rest of the router",
                     h->max_conns, h->max_refusing, HTTP_FD_RESERVE, nofile);
    int per_peer = cfg ? cfg->max_connections_per_peer : 0;
    if (per_peer == 0) {
        per_peer = h->max_conns / 2 < HTTP_DEFAULT_PER_PEER ? h->max_conns / 2
                                                            : HTTP_DEFAULT_PER_PEER;
        if (per_peer < 1) per_peer = 1;
    }
    h->per_peer_max = per_peer > 0 ? per_peer : 0;
    h->idle_ms = http_ms(cfg ? cfg->idle_timeout : 0, HTTP_DEFAULT_IDLE_S);
    h->head_ms = http_ms(cfg ? cfg->head_timeout : 0, HTTP_DEFAULT_HEAD_S);
    h->body_ms = http_ms(cfg ? cfg->body_timeout : 0, HTTP_DEFAULT_BODY_S);
    const pdm_router_limits_t *lim = pdm_router_limits(r);
    h->max_body = lim && lim->max_body_bytes ? lim->max_body_bytes : PDM_HTTP_MAX_BODY_DEFAULT;
    h->started = (long)time(NULL);
    http_parser_settings_init(&h->settings);
    h->settings.on_message_begin = on_message_begin;
    h->settings.on_url = on_url;
    h->settings.on_header_field = on_header_field;
    h->settings.on_header_value = on_header_value;
    h->settings.on_headers_complete = on_headers_complete;
    h->settings.on_body = on_body;
    h->settings.on_message_complete = on_message_complete;

    struct pdm_metrics *m = pdm_router_metrics(r);
    if (m) {
        h->m_responses = pdm_metrics_add(m, PDM_METRIC_COUNTER, "pdmesh_http_responses_total",
                                         "HTTP responses by status code", "code", NULL, 0);
        h->m_conns = pdm_metrics_add(m, PDM_METRIC_GAUGE, "pdmesh_http_connections",
                                     "Open HTTP connections", NULL, NULL, 0);
        h->m_refusals = pdm_metrics_add(
            m, PDM_METRIC_COUNTER, "pdmesh_http_refusals_total",
            "HTTP connections or requests refused by the front end's limits (connections: 503, "
            "peer_connections: 429, head_timeout/body_timeout: 408, overflow: closed)",
            "reason", NULL, 0);
        h->m_idle_closed = pdm_metrics_add(
            m, PDM_METRIC_COUNTER, "pdmesh_http_idle_closed_total",
            "Idle HTTP connections closed (reclaimed: for a new connection; idle_timeout: "
            "keep-alive; no_request: nothing sent within the head deadline)", "reason", NULL, 0);
    }

    int st = uv_tcp_init(h->loop, &h->listener);
    if (st < 0) {
        free(h);
        return pdm_error_set(PDM_EIO, "http: uv_tcp_init: %s", uv_strerror(st));
    }
    h->listener.data = h;
    h->handles = 1;
    st = uv_tcp_bind(&h->listener, (struct sockaddr *)&addr, 0);
    if (st == 0) st = uv_listen((uv_stream_t *)&h->listener, 128, on_connection);
    if (st < 0) {
        pdm_error_set(PDM_EIO, "http: cannot listen on %s:%d: %s", host, port, uv_strerror(st));
        /* h is freed by the listener's close callback on the loop's next turn. */
        h->stopping = 1;
        uv_close((uv_handle_t *)&h->listener, on_listener_closed);
        return PDM_EIO;
    }
    struct sockaddr_storage bound;
    int bl = sizeof(bound);
    uv_tcp_getsockname(&h->listener, (struct sockaddr *)&bound, &bl);
    h->port = ntohs(bound.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&bound)->sin6_port
                                                : ((struct sockaddr_in *)&bound)->sin_port);
    pdm_log_info("http: listening on %s:%d; %d connection slots (fd limit %ld), %d per peer%s, "
                 "head %.3g s, body %.3g s, idle %.3g s", host, h->port, h->max_conns, nofile,
                 h->per_peer_max, h->per_peer_max ? "" : " (no limit)", h->head_ms / 1000.0,
                 h->body_ms / 1000.0, h->idle_ms / 1000.0);
    *out = h;
    return PDM_OK;
}

int pdm_http_port(const pdm_http_t *h)
{
    return h ? h->port : -1;
}

void pdm_http_stop(pdm_http_t *h)
{
    if (!h || h->stopping) return;
    h->stopping = 1;
    while (h->conns) conn_close_now(h->conns);
    uv_close((uv_handle_t *)&h->listener, on_listener_closed);
}
