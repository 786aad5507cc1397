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
 *       "ranges":[[start,len,rank,chunk],...],"beams":B}      beams optional (beam.h)
 *   node -> {"event":"reserved","id":N,"ok":true}       (or ok:false, "error": "... full ...")
 *   <- {"cmd":"start","id":N,"first_token":T,"temp":..,"top_k":..,"top_p":..,"min_p":..,
 *       "repeat_penalty":..,"seed":..,"stop":[...],"timeout":S,
 *       "length_penalty":X,"n_best":N,"early_stopping":"heuristic|early|never",
 *       "prompt_last":T,"ignore_eos":bool}   beam fields optional; prompt_last required for
 *                                 beams; ignore_eos: end-of-generation tokens do not end it
 *   node -> {"event":"token","id":N,"token":T,"index":i} ...
 *   node -> {"event":"done","id":N,"finish":"eos|length|stop|deadline|cancelled",
 *            "tokens":[...],"text":"...","kv_seconds":..,"step_seconds":..,"kv_bytes":..,
 *            beam search only: "n_best":[{"tokens":[..],"text":"..","score":..,"logprob":..,
 *            "eos":bool},...], "beam":{"width":..,"length_penalty":..,"early_stopping":"..",
 *            "n_prompt":..,"n_response":..,"kv_prompt_bytes":..,"kv_response_bytes":..,
 *            "kv_bytes_eq2":..,"kv_bytes_eq3":..}}
 *            "offload":{...}}   (with --kv-fast-budget: pdm_kvoff_stats_json, node-wide)
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
static pdm_kvoff_params_t offload; /* --kv-fast-budget / --kv-slow-tier / --kv-offload-groups */
static int n_ranks;
static pdm_beam_params_t node_beam; /* --beams, --length-penalty, --n-best, --early-stopping */

static void reply(const char *event, double id, int ok, const char *error)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "event", event);
    if (id >= 0) cJSON_AddNumberToObject(o, "id", id);
    cJSON_AddBoolToObject(o, "ok", ok);
    if (error) cJSON_AddStringToObject(o, "error", error);
    pdm_ctl_emit(o);
}

/* The n-best list and the segmented cache's memory of a finished beam search. */
static void add_beam_report(cJSON *o, const pdm_beam_report_t *r)
{
    cJSON *list = cJSON_AddArrayToObject(o, "n_best");
    for (int h = 0; h < r->n_hyps; h++) {
        cJSON *e = cJSON_CreateObject();
        cJSON_AddItemToObject(e, "tokens", cJSON_CreateIntArray(r->hyps[h].tokens,
                                                                r->hyps[h].n_tokens));
        cJSON_AddStringToObject(e, "text", r->texts[h]);
        cJSON_AddNumberToObject(e, "score", r->hyps[h].score);
        cJSON_AddNumberToObject(e, "logprob", r->hyps[h].logprob);
        cJSON_AddBoolToObject(e, "eos", r->hyps[h].eos);
        cJSON_AddItemToArray(list, e);
    }
    cJSON *b = cJSON_AddObjectToObject(o, "beam");
    cJSON_AddNumberToObject(b, "width", r->width);
    cJSON_AddNumberToObject(b, "length_penalty", r->length_penalty);
    cJSON_AddStringToObject(b, "early_stopping", pdm_beam_stop_name(r->early_stopping));
    cJSON_AddNumberToObject(b, "n_prompt", r->n_prompt);
    cJSON_AddNumberToObject(b, "n_response", r->n_response);
    cJSON_AddNumberToObject(b, "kv_prompt_bytes", (double)r->prompt_bytes);
    cJSON_AddNumberToObject(b, "kv_response_bytes", (double)r->response_bytes);
    cJSON_AddNumberToObject(b, "kv_bytes_eq2", (double)r->eq2_bytes);
    cJSON_AddNumberToObject(b, "kv_bytes_eq3", (double)r->eq3_bytes);
}

static void on_event(void *arg, const pdm_decode_event_t *ev)
{
    pdm_decode_node_t *node = arg;
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
        if (ev->beam) add_beam_report(o, ev->beam);
        pdm_kvoff_stats_t os; /* head-wise offload: what it did so far (node-wide) */
        if (node && !pdm_decode_node_offload_stats(node, &os))
            cJSON_AddItemToObject(o, "offload", pdm_kvoff_stats_json(&os, &offload));
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
            int st = pdm_kvt_connect_cached(kvt, b, len, &rank_peer[n_ranks]);
            free(b);
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
                                   .ranges = rg, .n_ranges = k,
                                   .beams = (int)num(cmd, "beams", 0)};
        if (pdm_decode_node_reserve(node, &rv)) reply("reserved", id, 0, pdm_error_last());
        else reply("reserved", id, 1, NULL);
    } else if (!strcmp(name, "reserve_local")) {
        /* {"cmd":"reserve_local","id":N,"attempt":A,"tokens":[...],"max_new":M,"beams":B}: this
         * node prefills the tokens itself (conditional disaggregation, migration); beams
         * optional (> 0: a beam search, started with prompt_last). */
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
        if (pdm_decode_node_reserve_local_beams(node, (uint64_t)id,
                                                (uint32_t)num(cmd, "attempt", 0), t, n,
                                                (int32_t)num(cmd, "max_new", 0),
                                                (int)num(cmd, "beams", -1)))
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
        /* beam search: the node's defaults, overridden per request */
        s.beam = node_beam;
        s.beam.width = (int)num(cmd, "beams", 0);
        s.beam.length_penalty = (float)num(cmd, "length_penalty", s.beam.length_penalty);
        s.beam.n_best = (int)num(cmd, "n_best", s.beam.n_best);
        const cJSON *es = cJSON_GetObjectItem(cmd, "early_stopping");
        if (cJSON_IsString(es) && pdm_beam_stop_parse(es->valuestring, &s.beam.early_stopping)) {
            reply("error", id, 0, pdm_error_last());
            return;
        }
        s.prompt_last = (int32_t)num(cmd, "prompt_last", -1);
        s.ignore_eos = cJSON_IsTrue(cJSON_GetObjectItem(cmd, "ignore_eos"));
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
        {"beams", required_argument, 0, 'B'},     {"length-penalty", required_argument, 0, 'L'},
        {"n-best", required_argument, 0, 'N'},    {"early-stopping", required_argument, 0, 'E'},
        {"kv-fast-budget", required_argument, 0, 'F'}, {"kv-slow-tier", required_argument, 0, 'S'},
        {"kv-offload-groups", required_argument, 0, 'G'},
        {"router", required_argument, 0, 'R'},    {"node-id", required_argument, 0, 'I'},
        {"secret-file", required_argument, 0, 'K'},
        {"curve-server-key", required_argument, 0, 1001},
        {"curve-key", required_argument, 0, 1002}, {0, 0, 0, 0}};
    pdm_agent_params_t ap;
    pdm_agent_params_default(&ap);
    ap.role = PDM_AGENT_DECODE;
    int c;
    long v;
    double d;
    pdm_kvoff_params_default(&offload);
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case 'F': if (pdm_parse_long(optarg, 1, 1L << 50, &v)) goto bad; offload.fast_budget = v; break;
        case 'S': offload.slow_tier = optarg; break;
        case 'G': if (pdm_kvoff_parse_groups(optarg, &offload)) goto bad; break;
        case 'm': model_path = optarg; break;
        case 't': if (pdm_parse_long(optarg, 1, 256, &v)) goto bad; dp.threads = (int)v; break;
        case 'b': if (pdm_parse_long(optarg, 1, 1024, &v)) goto bad; dp.max_batch = (int)v; break;
        case 's': if (pdm_parse_long(optarg, 1, 4096, &v)) goto bad; dp.max_sequences = (int)v; break;
        case 'k': if (pdm_parse_long(optarg, 1, 1L << 30, &v)) goto bad; dp.kv_budget = v; break;
        case 'd':
            if (pdm_kv_dtype_parse(optarg, &dp.kv_dtype)) goto bad;
            break;
        case 'o': if (pdm_parse_double(optarg, 0.01, 86400, &d)) goto bad; dp.kv_timeout = d; break;
        case 'B': if (pdm_parse_long(optarg, 0, PDM_BEAM_MAX_WIDTH, &v)) goto bad; dp.beam.width = (int)v; break;
        case 'L': if (pdm_parse_double(optarg, -100, 100, &d)) goto bad; dp.beam.length_penalty = (float)d; break;
        case 'N': if (pdm_parse_long(optarg, 1, PDM_BEAM_MAX_WIDTH, &v)) goto bad; dp.beam.n_best = (int)v; break;
        case 'E': if (pdm_beam_stop_parse(optarg, &dp.beam.early_stopping)) goto bad; break;
        case 'R': ap.endpoint = optarg; break;
        case 1001: ap.curve_server_key_file = optarg; break;
        case 1002: ap.curve_key_file = optarg; break;
        case 'I': ap.node_id = optarg; break;
        case 'K': ap.secret_file = optarg; break;
        case 'h':
            printf("usage: pdmesh-decode [--model FILE] [--threads N] [--batch N] "
                   "[--max-sequences N]\n       [--kv-budget TOKENS] [--kv-dtype f32|f16|q8] "
                   "[--kv-timeout S]\n       [--beams B] [--length-penalty X] [--n-best N] "
                   "[--early-stopping heuristic|early|never]\n"
                   "       [--kv-fast-budget BYTES] [--kv-slow-tier ram|file:DIR] "
                   "[--kv-offload-groups CTX:G,...]\n"
                   "       [--router ENDPOINT --node-id NAME [--secret-file F]\n"
                   "        [--curve-server-key F --curve-key F]]\n");
            return 0;
        default: return 2;
        }
    }
    if (dp.beam.width && dp.beam.n_best > dp.beam.width) goto bad;
    node_beam = dp.beam;
    if (optind != argc) {
    bad:
        fprintf(stderr, "pdmesh-decode: invalid option value\n");
        return 2;
    }
    if (offload.fast_budget > 0) dp.offload = &offload; /* head-wise KV offload */
    else if (strcmp(offload.slow_tier, "ram")) {
        fprintf(stderr, "pdmesh-decode: --kv-slow-tier needs --kv-fast-budget\n");
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
        /* the widest beam search this node runs (node.c: at most the batch) */
        ap.max_beams = (uint32_t)PDM_MIN(PDM_BEAM_MAX_WIDTH, dp.max_batch);
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
        int held = pdm_decode_node_run_once(node, on_event, node);
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
