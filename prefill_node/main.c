/*
 * pdmesh-prefill - one rank of a prefill group.
 *
 * Until the router speaks to it (control plane), a rank is driven over its standard input and
 * output by a launcher (pdmesh prefill-run, the tests, the benchmarks), one JSON object per
 * line (prefill_node/launch.c is the other side):
 *
 *   rank -> {"event":"hello","address":"<hex UCX worker address>","pid":N}
 *   <- {"cmd":"group","rank":r,"size":R,"addrs":["<hex>",...]}
 *   rank -> {"event":"ready"}                      (connected, barrier passed; a later
 *                                                  group command re-forms the group)
 *   <- {"cmd":"task","id":n,"method":"kvr-e","start":P,"tokens":[...],"chunks":[...],
 *       "prefix":[...],"kv_out":"FILE","logits_out":"FILE","top":K}
 *      tokens: the new tokens at positions P..; prefix (optional): the P cached tokens the
 *      task assumes, checked against the group's conversation (a longer one is cut at P)
 *   rank -> {"event":"result","ok":true,...}      (or "ok":false,"error":"...")
 *   rank -> {"event":"dumped","ok":true}          (only with kv_out)
 *   <- {"cmd":"pingpong","bytes":N,"iters":K}   (ranks 0 and 1: round trips of N bytes)
 *   rank -> {"event":"pingpong","ok":true,"seconds":S}  (S per round trip, from rank 0)
 *   <- {"cmd":"quit"}
 *
 * Diagnostics go to stderr. End of input ends the process (its launcher is gone).
 */
#include <cjson/cJSON.h>
#include <getopt.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/agent.h"
#include "common/pdm.h"
#include "prefill_node/prefill.h"

#define PDM__MAX_LINE (64u << 20)



/* Id of the task being answered (results carry it so that a launcher that gave up on a
 * task can tell its late answers from the next task's); -1 outside tasks. */
static double current_task = -1;

static void emit_error(const char *event, const char *msg)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "event", event);
    if (current_task >= 0) cJSON_AddNumberToObject(o, "id", current_task);
    cJSON_AddBoolToObject(o, "ok", 0);
    cJSON_AddStringToObject(o, "error", msg);
    pdm_ctl_emit(o);
}

/* Reads an int array field; PDM_EFORMAT if it is not an array of integers in [min, max]. */
static int json_ints(const cJSON *arr, long min, long max, int32_t **out, int *n)
{
    if (!cJSON_IsArray(arr)) return PDM_EFORMAT;
    int count = cJSON_GetArraySize(arr);
    int32_t *v = malloc(sizeof(int32_t) * (size_t)(count ? count : 1));
    if (!v) return PDM_ENOMEM;
    int i = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, arr)
    {
        if (!cJSON_IsNumber(e) || e->valuedouble != (double)(long)e->valuedouble ||
            e->valuedouble < (double)min || e->valuedouble > (double)max) {
            free(v);
            return PDM_EFORMAT;
        }
        v[i++] = (int32_t)e->valuedouble;
    }
    *out = v;
    *n = count;
    return PDM_OK;
}

/* The kvt peer of the decode node this rank streams to (-1: none). */
static int decode_peer = -1;

/* The kvt peer of a decode node named by its hex address (router mode: a task names its
 * decode node; a node that failed and came back gets a fresh endpoint). */
static int decode_peer_for(pdm_kvt_t *kvt, const char *hex, int *peer)
{
    uint8_t *a;
    size_t alen;
    if (pdm_hex_decode(hex, &a, &alen))
        return pdm_error_set(PDM_EFORMAT, "task command: decode_addr is not hex");
    int st = pdm_kvt_connect_cached(kvt, a, alen, peer);
    free(a);
    return st;
}

static int handle_group(const cJSON *cmd, pdm_kvt_t *kvt, pdm_kvt_group_t *g, double timeout)
{
    const cJSON *rank = cJSON_GetObjectItem(cmd, "rank"), *size = cJSON_GetObjectItem(cmd, "size");
    const cJSON *addrs = cJSON_GetObjectItem(cmd, "addrs");
    if (!cJSON_IsNumber(rank) || !cJSON_IsNumber(size) || !cJSON_IsArray(addrs) ||
        cJSON_GetArraySize(addrs) != size->valueint || size->valueint < 1 ||
        size->valueint > PDM_KVT_MAX_RANKS)
        return pdm_error_set(PDM_EFORMAT, "group command: bad rank, size or addresses");
    int R = size->valueint, st = PDM_OK;
    uint8_t *bufs[PDM_KVT_MAX_RANKS] = {0};
    size_t lens[PDM_KVT_MAX_RANKS] = {0};
    for (int i = 0; i < R && !st; i++) {
        const cJSON *a = cJSON_GetArrayItem(addrs, i);
        if (!cJSON_IsString(a) || pdm_hex_decode(a->valuestring, &bufs[i], &lens[i]))
            st = pdm_error_set(PDM_EFORMAT, "group command: address %d is not hex", i);
    }
    if (!st)
        st = pdm_kvt_group_init(g, kvt, rank->valueint, R, (const void *const *)bufs, lens,
                                timeout);
    for (int i = 0; i < R; i++) free(bufs[i]);
    const cJSON *dec = cJSON_GetObjectItem(cmd, "decode_addr");
    if (!st && cJSON_IsString(dec)) {
        uint8_t *a;
        size_t alen;
        if (pdm_hex_decode(dec->valuestring, &a, &alen))
            return pdm_error_set(PDM_EFORMAT, "group command: decode_addr is not hex");
        st = pdm_kvt_connect(kvt, a, alen, &decode_peer);
        free(a);
    }
    return st;
}

static void handle_task(const cJSON *cmd, pdm_prefill_rank_t *rank, const pdm_model_t *model,
                        pdm_kvt_group_t *g, pdm_kvt_t *kvt)
{
    pdm_prefill_task_t task = {0};
    int32_t *tokens = NULL, *chunks = NULL, *prefix = NULL;
    int n_tokens = 0, n_chunks = 0, n_prefix = 0, st;
    const cJSON *id = cJSON_GetObjectItem(cmd, "id"), *method = cJSON_GetObjectItem(cmd, "method");
    const cJSON *start = cJSON_GetObjectItem(cmd, "start"), *top = cJSON_GetObjectItem(cmd, "top");
    const cJSON *kv_out = cJSON_GetObjectItem(cmd, "kv_out");
    const cJSON *logits_out = cJSON_GetObjectItem(cmd, "logits_out");
    if (!cJSON_IsNumber(id) || !cJSON_IsString(method) || !cJSON_IsNumber(start) ||
        json_ints(cJSON_GetObjectItem(cmd, "tokens"), 0, INT32_MAX, &tokens, &n_tokens)) {
        emit_error("result", "task command: missing or malformed id, method, start or tokens");
        return;
    }
    const cJSON *cj = cJSON_GetObjectItem(cmd, "chunks");
    if (cj && !cJSON_IsNull(cj)) {
        if (json_ints(cj, 0, INT32_MAX, &chunks, &n_chunks) || n_chunks != g->size) {
            emit_error("result", "task command: chunks must hold one size per rank");
            free(tokens);
            free(chunks);
            return;
        }
    }
    const cJSON *pj = cJSON_GetObjectItem(cmd, "prefix");
    if (pj && !cJSON_IsNull(pj)) {
        if (json_ints(pj, 0, INT32_MAX, &prefix, &n_prefix) || n_prefix != start->valueint) {
            emit_error("result", "task command: prefix must hold the start cached tokens");
            free(tokens);
            free(chunks);
            free(prefix);
            return;
        }
        task.prefix = prefix;
    }
    st = pdm_prefill_method_parse(method->valuestring, &task.method);
    const cJSON *stream = cJSON_GetObjectItem(cmd, "stream");
    pdm_prefill_stream_t target;
    if (!st && stream && !cJSON_IsNull(stream)) {
        const cJSON *rq = cJSON_GetObjectItem(stream, "request");
        const cJSON *at = cJSON_GetObjectItem(stream, "attempt");
        const cJSON *win = cJSON_GetObjectItem(stream, "window");
        const cJSON *daddr = cJSON_GetObjectItem(stream, "decode_addr");
        int peer = decode_peer;
        if (cJSON_IsString(daddr)) st = decode_peer_for(kvt, daddr->valuestring, &peer);
        if (st) {
            /* decode_addr could not be connected: the message is set */
        } else if (peer < 0)
            st = pdm_error_set(PDM_ESTATE, "task streams to a decode node but the group has none");
        else if (!cJSON_IsNumber(rq) || !cJSON_IsNumber(at) || rq->valuedouble < 0 ||
                 at->valuedouble < 0 || at->valuedouble > 255)
            st = pdm_error_set(PDM_EFORMAT, "task command: malformed stream target");
        else {
            target = (pdm_prefill_stream_t){
                .peer = peer, .request_id = (uint64_t)rq->valuedouble,
                .attempt = (uint32_t)at->valuedouble,
                .max_in_flight = cJSON_IsNumber(win) ? PDM_MAX(1, PDM_MIN(win->valueint, 4096)) : 64};
            task.stream = &target;
        }
    }
    task.id = (uint32_t)id->valuedouble;
    task.start = (int32_t)start->valuedouble;
    task.tokens = tokens;
    task.n_tokens = n_tokens;
    task.chunks = chunks;
    pdm_prefill_result_t res;
    if (!st) st = pdm_prefill_rank_run(rank, &task, &res);
    if (st) {
        emit_error("result", pdm_error_last());
        free(tokens);
        free(chunks);
        free(prefix);
        return;
    }
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "event", "result");
    cJSON_AddNumberToObject(o, "id", current_task);
    cJSON_AddBoolToObject(o, "ok", 1);
    cJSON_AddNumberToObject(o, "rank", g->rank);
    cJSON_AddBoolToObject(o, "owner", res.owner);
    cJSON_AddNumberToObject(o, "n_local", res.n_local);
    cJSON_AddNumberToObject(o, "t_total", res.t_total);
    cJSON_AddNumberToObject(o, "t_compute", res.t_compute);
    cJSON_AddNumberToObject(o, "t_wait", res.t_wait);
    cJSON_AddNumberToObject(o, "bytes_sent", (double)res.bytes_sent);
    cJSON_AddNumberToObject(o, "bytes_received", (double)res.bytes_received);
    cJSON_AddNumberToObject(o, "bytes_streamed", (double)res.bytes_streamed);
    int logits_st = PDM_OK;
    if (res.owner) {
        cJSON_AddNumberToObject(o, "first_token", res.first_token);
        int k = cJSON_IsNumber(top) ? PDM_MAX(0, PDM_MIN(top->valueint, 100)) : 10;
        cJSON *arr = cJSON_AddArrayToObject(o, "top");
        char *taken = calloc(model->hp.n_vocab, 1);
        for (int i = 0; i < k && taken; i++) {
            int32_t best = -1;
            for (uint32_t v = 0; v < model->hp.n_vocab; v++)
                if (!taken[v] && (best < 0 || res.logits[v] > res.logits[best])) best = (int32_t)v;
            taken[best] = 1;
            cJSON *pair = cJSON_CreateArray();
            cJSON_AddItemToArray(pair, cJSON_CreateNumber(best));
            cJSON_AddItemToArray(pair, cJSON_CreateNumber(res.logits[best]));
            cJSON_AddItemToArray(arr, pair);
        }
        free(taken);
        if (cJSON_IsString(logits_out)) {
            FILE *f = fopen(logits_out->valuestring, "wb");
            if (!f || fwrite(res.logits, sizeof(float), model->hp.n_vocab, f) !=
                          model->hp.n_vocab)
                logits_st = pdm_error_set(PDM_EIO, "%s: cannot write logits",
                                          logits_out->valuestring);
            if (f && fclose(f)) logits_st = PDM_EIO;
        }
    }
    if (logits_st) {
        cJSON_Delete(o);
        emit_error("result", pdm_error_last());
    } else {
        pdm_ctl_emit(o);
    }
    if (cJSON_IsString(kv_out)) {
        st = pdm_prefill_rank_dump_kv(rank, kv_out->valuestring);
        if (st) {
            emit_error("dumped", pdm_error_last());
        } else {
            cJSON *d = cJSON_CreateObject();
            cJSON_AddStringToObject(d, "event", "dumped");
            cJSON_AddNumberToObject(d, "id", current_task);
            cJSON_AddBoolToObject(d, "ok", 1);
            pdm_ctl_emit(d);
        }
    }
    free(tokens);
    free(chunks);
    free(prefix);
}

/* Ranks 0 and 1 bounce a message of `bytes` back and forth `iters` times (after one warm-up
 * round); rank 0 reports the mean round-trip time. Other ranks only answer. */
static void handle_pingpong(const cJSON *cmd, pdm_kvt_group_t *g)
{
    const cJSON *b = cJSON_GetObjectItem(cmd, "bytes"), *it = cJSON_GetObjectItem(cmd, "iters");
    if (!cJSON_IsNumber(b) || !cJSON_IsNumber(it) || b->valuedouble < 1 ||
        b->valuedouble > (1 << 30) || it->valueint < 1 || it->valueint > 60000 || g->size < 2) {
        emit_error("pingpong", "pingpong needs bytes in [1, 1 GiB], iters in [1, 60000] and "
                               "two ranks");
        return;
    }
    size_t bytes = (size_t)b->valuedouble;
    int iters = it->valueint, st = PDM_OK;
    double seconds = 0;
    char *buf = malloc(bytes);
    if (!buf) {
        emit_error("pingpong", "out of memory");
        return;
    }
    memset(buf, 1, bytes);
    if (g->rank <= 1) {
        const int other = 1 - g->rank;
        pdm_kvt_iov_t iov = {buf, bytes};
        double t0 = 0;
        for (int i = 0; i <= iters && !st; i++) {
            if (i == 1) t0 = pdm_now();
            pdm_kvt_req_t r;
            double deadline = pdm_kvt_group_deadline(g);
            if (g->rank == 0) {
                st = pdm_kvt_group_send(g, other, PDM_KVT_KIND_PING, 0, i, &iov, 1, &r);
                if (!st) st = pdm_kvt_wait(g->kvt, r, deadline, NULL);
                if (!st) st = pdm_kvt_group_recv(g, other, PDM_KVT_KIND_PING, 1, i, &iov, 1, &r);
                if (!st) st = pdm_kvt_wait(g->kvt, r, deadline, NULL);
            } else {
                st = pdm_kvt_group_recv(g, other, PDM_KVT_KIND_PING, 0, i, &iov, 1, &r);
                if (!st) st = pdm_kvt_wait(g->kvt, r, deadline, NULL);
                if (!st) st = pdm_kvt_group_send(g, other, PDM_KVT_KIND_PING, 1, i, &iov, 1, &r);
                if (!st) st = pdm_kvt_wait(g->kvt, r, deadline, NULL);
            }
        }
        seconds = (pdm_now() - t0) / iters;
    }
    free(buf);
    if (st) {
        emit_error("pingpong", pdm_error_last());
        return;
    }
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "event", "pingpong");
    cJSON_AddBoolToObject(o, "ok", 1);
    cJSON_AddNumberToObject(o, "seconds", seconds);
    pdm_ctl_emit(o);
}

static void usage(FILE *f)
{
    fprintf(f, "usage: pdmesh-prefill [--model FILE] [--threads N] [--cpu N] [--ctx N]\n"
               "                      [--kv-dtype f32|f16|q8] [--timeout SECONDS]\n"
               "                      [--router ENDPOINT --node-id NAME --group G --rank r\n"
               "                       --group-size R [--secret-file F]\n"
               "                       [--curve-server-key F --curve-key F]]\n"
               "One rank of a prefill group, driven by JSON lines on stdin/stdout\n"
               "(see pdmesh prefill-run), or by the router's control plane (--router).\n");
}

int main(int argc, char **argv)
{
    const char *model_path = pdm_model_default_path();
    pdm_prefill_rank_params_t rp;
    pdm_prefill_rank_params_default(&rp);
    long cpu = -1;
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'}, {"threads", required_argument, 0, 't'},
        {"cpu", required_argument, 0, 'c'},   {"ctx", required_argument, 0, 'x'},
        {"kv-dtype", required_argument, 0, 'k'}, {"timeout", required_argument, 0, 'o'},
        {"help", no_argument, 0, 'h'},        {"router", required_argument, 0, 'R'},
        {"node-id", required_argument, 0, 'N'}, {"group", required_argument, 0, 'G'},
        {"rank", required_argument, 0, 'r'},  {"group-size", required_argument, 0, 'g'},
        {"secret-file", required_argument, 0, 'S'}, {"curve-server-key", required_argument, 0, 1001},
        {"curve-key", required_argument, 0, 1002}, {0, 0, 0, 0}};
    pdm_agent_params_t ap;
    pdm_agent_params_default(&ap);
    ap.role = PDM_AGENT_PREFILL;
    int c;
    long v;
    double d;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case 'm': model_path = optarg; break;
        case 't':
            if (pdm_parse_long(optarg, 1, 256, &v)) goto bad;
            rp.threads = (int)v;
            break;
        case 'c':
            if (pdm_parse_long(optarg, 0, CPU_SETSIZE - 1, &cpu)) goto bad;
            break;
        case 'x':
            if (pdm_parse_long(optarg, 1, 1 << 22, &v)) goto bad;
            rp.ctx_tokens = (int)v;
            break;
        case 'k':
            if (pdm_kv_dtype_parse(optarg, &rp.kv_dtype)) goto bad;
            break;
        case 'o':
            if (pdm_parse_double(optarg, 0.001, 86400, &d)) goto bad;
            rp.timeout = d;
            break;
        case 'R': ap.endpoint = optarg; break;
        case 1001: ap.curve_server_key_file = optarg; break;
        case 1002: ap.curve_key_file = optarg; break;
        case 'N': ap.node_id = optarg; break;
        case 'G': ap.group = optarg; break;
        case 'S': ap.secret_file = optarg; break;
        case 'r':
            if (pdm_parse_long(optarg, 0, PDM_KVT_MAX_RANKS - 1, &v)) goto bad;
            ap.rank = (uint32_t)v;
            break;
        case 'g':
            if (pdm_parse_long(optarg, 1, PDM_KVT_MAX_RANKS, &v)) goto bad;
            ap.group_size = (uint32_t)v;
            break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (optind != argc) {
    bad:
        fprintf(stderr, "pdmesh-prefill: invalid option value\n");
        usage(stderr);
        return 2;
    }
    if (ap.endpoint) {
        /* Router mode: the agent thread registers this rank and bridges the control plane to
         * this command loop (common/agent.h). */
        if (!ap.group || ap.group_size < 1 || ap.rank >= ap.group_size) {
            fprintf(stderr, "pdmesh-prefill: --router needs --group, --rank and --group-size\n");
            return 2;
        }
        ap.model_id = model_path;
        ap.threads = (uint32_t)rp.threads;
        ap.max_prompt = (uint32_t)rp.ctx_tokens;
        if (pdm_agent_start(&ap)) {
            fprintf(stderr, "pdmesh-prefill: %s\n", pdm_error_last());
            return 1;
        }
    }
    if (pdm_ctl_open()) {
        fprintf(stderr, "pdmesh-prefill: %s\n", pdm_error_last());
        return 1;
    }
    if (cpu >= 0) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET((int)cpu, &set);
        if (sched_setaffinity(0, sizeof(set), &set))
            fprintf(stderr, "pdmesh-prefill: cannot pin to cpu %ld (continuing)\n", cpu);
    }

    pdm_model_t *model = NULL;
    pdm_kvt_t *kvt = NULL;
    pdm_kvt_group_t group;
    pdm_prefill_rank_t *rank = NULL;
    int grouped = 0, status = 1;
    if (pdm_model_load(model_path, &model)) {
        emit_error("hello", pdm_error_last());
        goto out;
    }
    if (pdm_kvt_create(NULL, &kvt)) {
        emit_error("hello", pdm_error_last());
        goto out;
    }
    const void *addr;
    size_t alen;
    pdm_kvt_address(kvt, &addr, &alen);
    pdm_ctl_hello(addr, alen);

    char *line = NULL;
    size_t cap = 0;
    ssize_t n;
    while ((n = getline(&line, &cap, stdin)) > 0) {
        if ((size_t)n > PDM__MAX_LINE) {
            emit_error("error", "command line too long");
            continue;
        }
        cJSON *cmd = cJSON_ParseWithLength(line, (size_t)n);
        const cJSON *name = cmd ? cJSON_GetObjectItem(cmd, "cmd") : NULL;
        if (!cJSON_IsString(name)) {
            emit_error("error", "malformed command (expected a JSON object with \"cmd\")");
        } else if (!strcmp(name->valuestring, "quit")) {
            cJSON_Delete(cmd);
            status = 0;
            break;
        } else if (!strcmp(name->valuestring, "group")) {
            if (grouped) { /* the group re-forms (a rank was replaced): start afresh */
                pdm_log_info("prefill rank: leaving the group to re-form it");
                pdm_prefill_rank_destroy(rank);
                rank = NULL;
                pdm_kvt_group_fini(&group);
                grouped = 0;
            }
            if (handle_group(cmd, kvt, &group, rp.timeout) ||
                       pdm_prefill_rank_create(model, &group, &rp, &rank)) {
                emit_error("ready", pdm_error_last());
            } else {
                grouped = 1;
                cJSON *o = cJSON_CreateObject();
                cJSON_AddStringToObject(o, "event", "ready");
                cJSON_AddBoolToObject(o, "ok", 1);
                char tl[128];
                pdm_kvt_peer_transports(kvt, group.peer[(group.rank + 1) % group.size], tl,
                                        sizeof(tl));
                cJSON_AddStringToObject(o, "transports", tl);
                pdm_ctl_emit(o);
            }
        } else if (!strcmp(name->valuestring, "pingpong")) {
            if (!grouped)
                emit_error("pingpong", "pingpong before group");
            else
                handle_pingpong(cmd, &group);
        } else if (!strcmp(name->valuestring, "task")) {
            const cJSON *tid = cJSON_GetObjectItem(cmd, "id");
            current_task = cJSON_IsNumber(tid) ? tid->valuedouble : -1;
            if (!grouped)
                emit_error("result", "task before group");
            else
                handle_task(cmd, rank, model, &group, kvt);
            current_task = -1;
        } else {
            emit_error("error", "unknown command");
        }
        cJSON_Delete(cmd);
    }
    if (n <= 0) status = 0; /* launcher closed our input: a normal end */
    free(line);
out:
    pdm_prefill_rank_destroy(rank);
    if (grouped) pdm_kvt_group_fini(&group);
    pdm_kvt_destroy(kvt);
    pdm_model_free(model);
    pdm_ctl_close();
    return status;
}
