/*
 * pdmesh-decode - a decode node.
 *
 * Until the router drives it (control plane), a launcher drives it over stdin/stdout with one
 * JSON object per line (pdmesh disagg-run, the tests):
 *
 *   node -> {"event":"hello","address":"<hex UCX worker address>","pid":N}
 *   <- {"cmd":"connect","addrs":["<hex>",...]}        prefill ranks, in rank order
 *   node -> {"event":"connected","ok":true}
 *   <- {"cmd":"reserve","id":N,"attempt":A,"n_prompt":P,"max_new":M,
 *       "ranges":[[start,len,rank,chunk],...]}
 *   node -> {"event":"reserved","id":N,"ok":true}       (or ok:false, "error": "... full ...")
 *   <- {"cmd":"start","id":N,"first_token":T,"temp":..,"top_k":..,"top_p":..,"min_p":..,
 *       "repeat_penalty":..,"seed":..,"stop":[...],"timeout":S}
 *   node -> {"event":"token","id":N,"token":T,"index":i} ...
 *   node -> {"event":"done","id":N,"finish":"eos|length|stop|deadline|cancelled",
 *            "tokens":[...],"text":"...","kv_seconds":..,"step_seconds":..,"kv_bytes":..}
 *        or {"event":"error","id":N,"error":"..."}
 *   <- {"cmd":"cancel","id":N}   <- {"cmd":"quit"}
 *   <- {"cmd":"stats"}  node -> {"event":"stats","held":N,"kv_slots":K,"running":R}
 *
 * The node keeps stepping its batch while it reads commands (poll without blocking when
 * sequences run). Diagnostics go to stderr; fd 1 points at stderr too, the protocol has its
 * own copy of stdout.
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <getopt.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/agent.h"
#include "common/pdm.h"
#include "decode_node/decode.h"

#define MAX_LINE (16u << 20)

static int rank_peer[PDM_KVT_MAX_RANKS];
static int n_ranks;

/* Peers already connected, by address: a node serving several prefill groups (router mode)
 * connects to each rank once. */
#define PEER_CACHE 256
static struct { uint8_t *addr; size_t len; int peer; } peer_cache[PEER_CACHE];
static int n_peer_cache;

static int connect_cached(pdm_kvt_t *kvt, uint8_t *addr, size_t len, int *peer)
{
    for (int i = 0; i < n_peer_cache; i++)
        if (peer_cache[i].len == len && !memcmp(peer_cache[i].addr, addr, len)) {
            *peer = peer_cache[i].peer;
            free(addr);
            return PDM_OK;
        }
    int st = pdm_kvt_connect(kvt, addr, len, peer);
    if (st || n_peer_cache == PEER_CACHE) {
        free(addr);
        return st;
    }
    peer_cache[n_peer_cache].addr = addr;
    peer_cache[n_peer_cache].len = len;
    peer_cache[n_peer_cache++].peer = *peer;
    return PDM_OK;
}


static void reply(const char *event, double id, int ok, const char *error)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "event", event);
    if (id >= 0) cJSON_AddNumberToObject(o, "id", id);
    cJSON_AddBoolToObject(o, "ok", ok);
    if (error) cJSON_AddStringToObject(o, "error", error);
    pdm_ctl_emit(o);
}

static void on_event(void *arg, const pdm_decode_event_t *ev)
{
    (void)arg;
    cJSON *o = cJSON_CreateObject();
    switch (ev->type) {
    case PDM_DECODE_EV_TOKEN:
        cJSON_AddStringToObject(o, "event", "token");
        cJSON_AddNumberToObject(o, "id", (double)ev->id);
        cJSON_AddNumberToObject(o, "token", ev->token);
        cJSON_AddNumberToObject(o, "index", ev->index);
        break;
    case PDM_DECODE_EV_DONE:
        cJSON_AddStringToObject(o, "event", "done");
        cJSON_AddNumberToObject(o, "id", (double)ev->id);
        cJSON_AddStringToObject(o, "finish", ev->finish);
        cJSON_AddItemToObject(o, "tokens", cJSON_CreateIntArray(ev->tokens, ev->n_tokens));
        cJSON_AddStringToObject(o, "text", ev->text);
        cJSON_AddNumberToObject(o, "kv_seconds", ev->kv_seconds);
        cJSON_AddNumberToObject(o, "step_seconds", ev->step_seconds);
        cJSON_AddNumberToObject(o, "kv_bytes", (double)ev->kv_bytes);
        break;
    default:
        cJSON_AddStringToObject(o, "event", "error");
        cJSON_AddNumberToObject(o, "id", (double)ev->id);
        cJSON_AddStringToObject(o, "error", ev->error ? ev->error : "failed");
        break;
    }
    pdm_ctl_emit(o);
}

static double num(const cJSON *o, const char *key, double def)
{
    const cJSON *v = cJSON_GetObjectItem(o, key);
    return cJSON_IsNumber(v) ? v->valuedouble : def;
}

static void handle(const cJSON *cmd, const char *name, pdm_kvt_t *kvt, pdm_decode_node_t *node)
{
    double id = num(cmd, "id", -1);
    if (!strcmp(name, "connect")) {
        const cJSON *addrs = cJSON_GetObjectItem(cmd, "addrs"), *a;
        if (!cJSON_IsArray(addrs) || cJSON_GetArraySize(addrs) > PDM_KVT_MAX_RANKS) {
            reply("connected", -1, 0, "connect needs addrs (at most 64)");
            return;
        }
        n_ranks = 0;
        cJSON_ArrayForEach(a, addrs)
        {
            uint8_t *b;
            size_t len;
            if (!cJSON_IsString(a) || pdm_hex_decode(a->valuestring, &b, &len)) {
                reply("connected", -1, 0, "an address is not hex");
                return;
            }
            int st = connect_cached(kvt, b, len, &rank_peer[n_ranks]);
            if (st) {
                reply("connected", -1, 0, pdm_error_last());
                return;
            }
            n_ranks++;
        }
        reply("connected", -1, 1, NULL);
    } else if (!strcmp(name, "reserve")) {
        const cJSON *ranges = cJSON_GetObjectItem(cmd, "ranges"), *r;
        int n = cJSON_IsArray(ranges) ? cJSON_GetArraySize(ranges) : 0;
        if (id < 0 || n < 1 || n > 1024) {
            reply("reserved", id, 0, "reserve needs id and ranges");
            return;
        }
        pdm_decode_range_t rg[1024];
        int k = 0;
        cJSON_ArrayForEach(r, ranges)
        {
            int rank = cJSON_IsArray(r) && cJSON_GetArraySize(r) == 4
                           ? cJSON_GetArrayItem(r, 2)->valueint : -1;
            if (rank < 0 || rank >= n_ranks) {
                reply("reserved", id, 0, "a range names an unknown rank");
                return;
            }
            rg[k++] = (pdm_decode_range_t){.start = cJSON_GetArrayItem(r, 0)->valueint,
                                           .len = cJSON_GetArrayItem(r, 1)->valueint,
                                           .peer = rank_peer[rank],
                                           .chunk = cJSON_GetArrayItem(r, 3)->valueint};
        }
        pdm_decode_reserve_t rv = {.id = (uint64_t)id,
                                   .attempt = (uint32_t)num(cmd, "attempt", 0),
                                   .n_prompt = (int32_t)num(cmd, "n_prompt", 0),
                                   .max_new = (int32_t)num(cmd, "max_new", 0),
                                   .ranges = rg, .n_ranges = k};
        if (pdm_decode_node_reserve(node, &rv)) reply("reserved", id, 0, pdm_error_last());
        else reply("reserved", id, 1, NULL);
    } else if (!strcmp(name, "reserve_local")) {
        /* {"cmd":"reserve_local","id":N,"attempt":A,"tokens":[...],"max_new":M}: this node
         * prefills the tokens itself (conditional disaggregation, migration). */
        const cJSON *toks = cJSON_GetObjectItem(cmd, "tokens"), *e;
        int n = cJSON_IsArray(toks) ? cJSON_GetArraySize(toks) : 0;
        int32_t *t = n > 0 ? malloc(sizeof(int32_t) * (size_t)n) : NULL;
        if (id < 0 || !t) {
            free(t);
            reply("reserved", id, 0, "reserve_local needs id and tokens");
            return;
        }
        int k = 0;
        cJSON_ArrayForEach(e, toks) t[k++] = cJSON_IsNumber(e) ? (int32_t)e->valuedouble : -1;
        if (pdm_decode_node_reserve_local(node, (uint64_t)id, (uint32_t)num(cmd, "attempt", 0), t,
                                          n, (int32_t)num(cmd, "max_new", 0)))
            reply("reserved", id, 0, pdm_error_last());
        else
            reply("reserved", id, 1, NULL);
        free(t);
    } else if (!strcmp(name, "start")) {
        pdm_decode_start_t s = {.id = (uint64_t)id, .first_token = (int32_t)num(cmd, "first_token", -1)};
        pdm_sampler_params_default(&s.sp);
        s.sp.temperature = (float)num(cmd, "temp", s.sp.temperature);
        s.sp.top_k = (int32_t)num(cmd, "top_k", s.sp.top_k);
        s.sp.top_p = (float)num(cmd, "top_p", s.sp.top_p);
        s.sp.min_p = (float)num(cmd, "min_p", s.sp.min_p);
        s.sp.repeat_penalty = (float)num(cmd, "repeat_penalty", s.sp.repeat_penalty);
        s.sp.seed = (uint64_t)num(cmd, "seed", (double)s.sp.seed);
        const char *stops[8];
        const cJSON *st = cJSON_GetObjectItem(cmd, "stop"), *e;
        cJSON_ArrayForEach(e, st)
        {
            if (s.n_stops < 8 && cJSON_IsString(e)) stops[s.n_stops++] = e->valuestring;
        }
        s.stops = stops;
        double timeout = num(cmd, "timeout", 0);
        s.deadline = timeout > 0 ? pdm_now() + timeout : 0;
        if (id < 0 || pdm_decode_node_start(node, &s)) {
            cJSON *o = cJSON_CreateObject();
            cJSON_AddStringToObject(o, "event", "error");
            cJSON_AddNumberToObject(o, "id", id);
            cJSON_AddStringToObject(o, "error", id < 0 ? "start needs an id" : pdm_error_last());
            pdm_ctl_emit(o);
        }
    } else if (!strcmp(name, "stats")) {
        int held;
        int64_t slots;
        pdm_decode_node_usage(node, &held, &slots);
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "event", "stats");
        cJSON_AddBoolToObject(o, "ok", 1);
        cJSON_AddNumberToObject(o, "held", held);
        cJSON_AddNumberToObject(o, "kv_slots", (double)slots);
        cJSON_AddNumberToObject(o, "running", pdm_decode_node_running(node));
        /* KV received from each prefill rank so far (transfer statistics for metrics). */
        cJSON *peers = cJSON_AddArrayToObject(o, "ranks");
        for (int r = 0; r < n_ranks; r++) {
            pdm_kvt_stats_t ps;
            if (pdm_kvt_peer_stats(kvt, rank_peer[r], &ps)) continue;
            cJSON *e = cJSON_CreateObject();
            cJSON_AddNumberToObject(e, "rank", r);
            cJSON_AddNumberToObject(e, "bytes_received", (double)ps.bytes_received);
            cJSON_AddNumberToObject(e, "messages", (double)ps.receives);
            cJSON_AddItemToArray(peers, e);
        }
        pdm_ctl_emit(o);
    } else if (!strcmp(name, "cancel")) {
        if (id < 0 || pdm_decode_node_cancel(node, (uint64_t)id))
            reply("error", id, 0, "cancel: unknown request");
    } else {
        reply("error", id, 0, "unknown command");
    }
}

int main(int argc, char **argv)
{
    const char *model_path = pdm_model_default_path();
    pdm_decode_params_t dp;
    pdm_decode_params_default(&dp);
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'},     {"threads", required_argument, 0, 't'},
        {"batch", required_argument, 0, 'b'},     {"kv-budget", required_argument, 0, 'k'},
        {"kv-dtype", required_argument, 0, 'd'},  {"kv-timeout", required_argument, 0, 'o'},
        {"max-sequences", required_argument, 0, 's'}, {"help", no_argument, 0, 'h'},
        {"router", required_argument, 0, 'R'},    {"node-id", required_argument, 0, 'N'},
        {"secret-file", required_argument, 0, 'S'},
        {0, 0, 0, 0}};
    pdm_agent_params_t ap;
    pdm_agent_params_default(&ap);
    ap.role = PDM_AGENT_DECODE;
    int c;
    long v;
    double d;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case 'm': model_path = optarg; break;
        case 't': if (pdm_parse_long(optarg, 1, 256, &v)) goto bad; dp.threads = (int)v; break;
        case 'b': if (pdm_parse_long(optarg, 1, 1024, &v)) goto bad; dp.max_batch = (int)v; break;
        case 's': if (pdm_parse_long(optarg, 1, 4096, &v)) goto bad; dp.max_sequences = (int)v; break;
        case 'k': if (pdm_parse_long(optarg, 1, 1L << 30, &v)) goto bad; dp.kv_budget = v; break;
        case 'd':
            if (!strcmp(optarg, "f16")) dp.kv_dtype = PDM_DT_F16;
            else if (!strcmp(optarg, "f32")) dp.kv_dtype = PDM_DT_F32;
            else goto bad;
            break;
        case 'o': if (pdm_parse_double(optarg, 0.01, 86400, &d)) goto bad; dp.kv_timeout = d; break;
        case 'R': ap.endpoint = optarg; break;
        case 'N': ap.node_id = optarg; break;
        case 'S': ap.secret_file = optarg; break;
        case 'h':
            printf("usage: pdmesh-decode [--model FILE] [--threads N] [--batch N] "
                   "[--max-sequences N]\n       [--kv-budget TOKENS] [--kv-dtype f16|f32] "
                   "[--kv-timeout S]\n       [--router ENDPOINT --node-id NAME [--secret-file F]]\n");
            return 0;
        default: return 2;
        }
    }
    if (optind != argc) {
    bad:
        fprintf(stderr, "pdmesh-decode: invalid option value\n");
        return 2;
    }
    if (ap.endpoint) {
        /* Router mode: the agent thread registers and bridges the control plane to this
         * command loop (common/agent.h). */
        ap.model_id = model_path;
        ap.kv_tokens = (uint64_t)dp.kv_budget;
        ap.max_sequences = (uint32_t)dp.max_sequences;
        ap.max_batch = (uint32_t)dp.max_batch;
        ap.threads = (uint32_t)dp.threads;
        if (pdm_agent_start(&ap)) {
            fprintf(stderr, "pdmesh-decode: %s\n", pdm_error_last());
            return 1;
        }
    }
    if (pdm_ctl_open()) {
        fprintf(stderr, "pdmesh-decode: %s\n", pdm_error_last());
        return 1;
    }

    pdm_model_t *model = NULL;
    pdm_kvt_t *kvt = NULL;
    pdm_decode_node_t *node = NULL;
    int status = 1;
    if (pdm_model_load(model_path, &model) || pdm_kvt_create(NULL, &kvt) ||
        pdm_decode_node_create(model, kvt, &dp, &node)) {
        reply("hello", -1, 0, pdm_error_last());
        goto out;
    }
    const void *addr;
    size_t alen;
    pdm_kvt_address(kvt, &addr, &alen);
    pdm_ctl_hello(addr, alen);

    char *buf = malloc(MAX_LINE + 1);
    size_t len = 0;
    int eof = 0, quit = 0;
    while (buf && !quit) {
        int held = pdm_decode_node_run_once(node, on_event, NULL);
        if (eof && held == 0) break;
        struct pollfd pfd = {.fd = 0, .events = POLLIN};
        int timeout_ms = pdm_decode_node_running(node) ? 0 : (held ? 2 : 50);
        if (eof || poll(&pfd, 1, timeout_ms) <= 0) continue;
        ssize_t got = read(0, buf + len, MAX_LINE - len);
        if (got <= 0) {
            if (got < 0 && errno == EINTR) continue;
            eof = 1; /* the launcher is gone: finish what runs, then exit */
            continue;
        }
        len += (size_t)got;
        char *nl;
        while ((nl = memchr(buf, '\n', len))) {
            *nl = 0;
            cJSON *cmd = cJSON_Parse(buf);
            const cJSON *name = cmd ? cJSON_GetObjectItem(cmd, "cmd") : NULL;
            if (!cJSON_IsString(name))
                reply("error", -1, 0, "malformed command (expected a JSON object with \"cmd\")");
            else if (!strcmp(name->valuestring, "quit"))
                quit = 1;
            else
                handle(cmd, name->valuestring, kvt, node);
            cJSON_Delete(cmd);
            size_t used = (size_t)(nl - buf) + 1;
            memmove(buf, nl + 1, len - used);
            len -= used;
        }
        if (len == MAX_LINE) {
            reply("error", -1, 0, "command line too long");
            len = 0;
        }
    }
    free(buf);
    status = 0;
out:
    pdm_decode_node_destroy(node);
    pdm_kvt_destroy(kvt);
    pdm_model_free(model);
    pdm_ctl_close();
    return status;
}
