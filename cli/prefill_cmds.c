/*
 * prefill_cmds.c - pdmesh prefill-run, partition-search and calibrate: prefill groups of
 * pdmesh-prefill processes on this machine, without the router.
 */
#include <cjson/cJSON.h>
#include <getopt.h>
#include <libgen.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli.h"
#include "common/pdm.h"
#include "prefill_node/prefill.h"

/* Options shared by the three commands. */
typedef struct {
    pdm_launch_params_t lp;
    char bin[PATH_MAX];
    const char *prompt, *prompt_file;
    int chat;
    long length;   /* exact prompt length (the text is repeated), 0: as tokenized */
    long random;   /* random prompt of this many tokens, 0: off */
    uint64_t seed;
} group_opts_t;

enum {
    O_RANKS = 1000, O_METHOD, O_PROMPT, O_PROMPT_FILE, O_CHAT, O_LENGTH, O_RANDOM, O_SEED,
    O_PARTITION, O_CACHED, O_TABLE, O_CALIB, O_THREADS, O_PIN, O_CTX, O_KV_DTYPE, O_TIMEOUT,
    O_KV_OUT, O_LOGITS_OUT, O_REPEAT, O_JSON, O_MODEL, O_LENGTHS, O_OUT, O_REPS, O_STRIDE
};

#define GROUP_LONG_OPTS                                                                        \
    {"ranks", required_argument, 0, O_RANKS}, {"prompt", required_argument, 0, O_PROMPT},      \
        {"prompt-file", required_argument, 0, O_PROMPT_FILE}, {"chat", no_argument, 0, O_CHAT}, \
        {"length", required_argument, 0, O_LENGTH}, {"random", required_argument, 0, O_RANDOM}, \
        {"seed", required_argument, 0, O_SEED}, {"threads", required_argument, 0, O_THREADS},   \
        {"pin", no_argument, 0, O_PIN}, {"ctx", required_argument, 0, O_CTX},                   \
        {"kv-dtype", required_argument, 0, O_KV_DTYPE},                                         \
        {"timeout", required_argument, 0, O_TIMEOUT}, {"model", required_argument, 0, O_MODEL}, \
        {"json", no_argument, 0, O_JSON}

static void group_opts_init(group_opts_t *o)
{
    memset(o, 0, sizeof(*o));
    pdm_launch_params_default(&o->lp);
    o->lp.timeout = 300;
    o->seed = 1;
    const char *env = getenv("PDMESH_PREFILL_BIN");
    if (env) {
        snprintf(o->bin, sizeof(o->bin), "%s", env);
    } else {
        /* pdmesh-prefill lives next to this binary. */
        char self[PATH_MAX];
        ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
        if (n > 0) {
            self[n] = 0;
            snprintf(o->bin, sizeof(o->bin), "%s/pdmesh-prefill", dirname(self));
        } else {
            snprintf(o->bin, sizeof(o->bin), "pdmesh-prefill");
        }
    }
    o->lp.bin = o->bin;
}

/* Handles an option shared by all group commands: 1 handled, 0 not ours, -1 bad value. */
static int group_opt(group_opts_t *o, int c, const char *arg, int *json)
{
    long v;
    double d;
    switch (c) {
    case O_RANKS:
        if (pdm_parse_long(arg, 1, PDM_KVT_MAX_RANKS, &v)) return -1;
        o->lp.ranks = (int)v;
        return 1;
    case O_PROMPT: o->prompt = arg; return 1;
    case O_PROMPT_FILE: o->prompt_file = arg; return 1;
    case O_CHAT: o->chat = 1; return 1;
    case O_LENGTH:
        if (pdm_parse_long(arg, 1, 1 << 22, &o->length)) return -1;
        return 1;
    case O_RANDOM:
        if (pdm_parse_long(arg, 1, 1 << 22, &o->random)) return -1;
        return 1;
    case O_SEED:
        if (pdm_parse_long(arg, 0, LONG_MAX, &v)) return -1;
        o->seed = (uint64_t)v;
        return 1;
    case O_THREADS:
        if (pdm_parse_long(arg, 1, 256, &v)) return -1;
        o->lp.threads = (int)v;
        return 1;
    case O_PIN: o->lp.pin = 1; return 1;
    case O_CTX:
        if (pdm_parse_long(arg, 1, 1 << 22, &v)) return -1;
        o->lp.ctx_tokens = (int)v;
        return 1;
    case O_KV_DTYPE:
        if (strcmp(arg, "f16") && strcmp(arg, "f32")) return -1;
        o->lp.kv_dtype = arg;
        return 1;
    case O_TIMEOUT:
        if (pdm_parse_double(arg, 0.01, 86400, &d)) return -1;
        o->lp.timeout = d;
        return 1;
    case O_MODEL: o->lp.model = arg; return 1;
    case O_JSON: *json = 1; return 1;
    default: return 0;
    }
}

static char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        pdm_error_set(PDM_EIO, "%s: cannot open", path);
        return NULL;
    }
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    for (size_t got; buf && (got = fread(buf + n, 1, cap - n - 1, f)) > 0;) {
        n += got;
        if (cap - n < 2) {
            if (cap > (64u << 20)) break;
            char *b = realloc(buf, cap * 2);
            if (!b) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = b;
            cap *= 2;
        }
    }
    fclose(f);
    if (!buf) {
        pdm_error_set(PDM_ENOMEM, "out of memory");
        return NULL;
    }
    buf[n] = 0;
    *len = n;
    return buf;
}

/* The prompt's token ids (malloc'd). Exit status on error. */
static int prompt_tokens(const group_opts_t *o, const pdm_model_t *model, int32_t **ids_out,
                         size_t *n_out)
{
    int32_t *ids = NULL;
    size_t n = 0;
    if (o->random) {
        uint64_t state = o->seed;
        ids = malloc(sizeof(int32_t) * (size_t)o->random);
        if (!ids) return cli_runtime_error("out of memory");
        for (long i = 0; i < o->random; i++)
            ids[i] = (int32_t)(pdm_splitmix64(&state) % model->hp.n_vocab);
        n = (size_t)o->random;
    } else {
        char *text = NULL, *rendered = NULL;
        size_t len = 0;
        if (o->prompt_file) {
            if (!(text = read_file(o->prompt_file, &len))) return cli_runtime_error("prompt");
        } else if (o->prompt) {
            text = strdup(o->prompt);
            len = strlen(o->prompt);
        } else {
            return cli_usage_error("%s", "give --prompt TEXT, --prompt-file FILE or --random N");
        }
        int flags = PDM_TOKENIZE_ADD_BOS;
        const char *src = text;
        if (o->chat) {
            const char *role = "user";
            rendered = pdm_tokenizer_chat_render(model->tokenizer, &role, (const char **)&text,
                                                 1, 1);
            if (!rendered) {
                free(text);
                return cli_runtime_error("cannot apply the chat template");
            }
            src = rendered;
            len = strlen(rendered);
            flags |= PDM_TOKENIZE_SPECIAL;
        }
        int st = cli_tokenize_alloc(model->tokenizer, src, len, flags, &ids, &n);
        free(text);
        free(rendered);
        if (st) return cli_runtime_error("cannot tokenize the prompt");
    }
    if (n == 0) {
        free(ids);
        fprintf(stderr, "%s: the prompt is empty after tokenization\n", cli_prog);
        return 1;
    }
    if (o->length && (size_t)o->length != n) {
        /* Repeat (or cut) the prompt to exactly `length` tokens, for benchmarks. */
        int32_t *r = malloc(sizeof(int32_t) * (size_t)o->length);
        if (!r) {
            free(ids);
            return cli_runtime_error("out of memory");
        }
        for (long i = 0; i < o->length; i++) r[i] = ids[(size_t)i % n];
        free(ids);
        ids = r;
        n = (size_t)o->length;
    }
    *ids_out = ids;
    *n_out = n;
    return 0;
}

static int parse_int_list(const char *s, int *out, int max, int *n)
{
    *n = 0;
    char *copy = strdup(s), *save = NULL;
    if (!copy) return -1;
    for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        long v;
        if (*n == max || pdm_parse_long(tok, 1, 1 << 22, &v)) {
            free(copy);
            return -1;
        }
        out[(*n)++] = (int)v;
    }
    free(copy);
    return *n ? 0 : -1;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Runs (optionally) a cached first turn and then the measured task `reps` times; fills res
 * with the run of median TTFT. */
static int run_measured(pdm_launch_t *l, pdm_prefill_method_t method, const int32_t *ids,
                        int32_t n, int32_t cached, const int *chunks, int reps,
                        const char *kv_out, const char *logits_out, pdm_launch_result_t *res,
                        double *ttfts)
{
    for (int rep = 0; rep < reps; rep++) {
        if (cached > 0) {
            /* The earlier turn: the same method family computes the first `cached` tokens
             * (KVR continues from a KVR prefix, CP from a CP prefix). */
            pdm_prefill_task_t first = {
                .method = pdm_prefill_method_is_kvr(method) ? PDM_PREFILL_KVR_E : method,
                .start = 0, .tokens = ids, .n_tokens = cached};
            pdm_launch_result_t ignored;
            int st = pdm_launch_task(l, &first, NULL, NULL, &ignored);
            if (st) return st;
        }
        pdm_prefill_task_t t = {.method = method, .start = cached, .tokens = ids + cached,
                                .n_tokens = n - cached, .chunks = chunks};
        pdm_launch_result_t r;
        int last = rep == reps - 1;
        int st = pdm_launch_task(l, &t, last ? kv_out : NULL, last ? logits_out : NULL, &r);
        if (st) return st;
        ttfts[rep] = r.ttft;
        if (rep == 0 || last) {
            double keep_ttft = rep ? res->ttft : r.ttft;
            *res = r;
            res->ttft = keep_ttft;
        }
    }
    double sorted[64];
    memcpy(sorted, ttfts, sizeof(double) * (size_t)reps);
    qsort(sorted, (size_t)reps, sizeof(double), cmp_double);
    res->ttft = sorted[reps / 2];
    return PDM_OK;
}

int cmd_prefill_run(int argc, char **argv)
{
    group_opts_t o;
    group_opts_init(&o);
    const char *method_name = "kvr-e", *partition = NULL, *table_path = NULL, *calib_path = NULL;
    const char *kv_out = NULL, *logits_out = NULL;
    long cached = 0, repeat = 1;
    int json = 0;
    static const struct option opts[] = {
        GROUP_LONG_OPTS,
        {"method", required_argument, 0, O_METHOD},
        {"partition", required_argument, 0, O_PARTITION},
        {"cached", required_argument, 0, O_CACHED},
        {"table", required_argument, 0, O_TABLE},
        {"calibration", required_argument, 0, O_CALIB},
        {"kv-out", required_argument, 0, O_KV_OUT},
        {"logits-out", required_argument, 0, O_LOGITS_OUT},
        {"repeat", required_argument, 0, O_REPEAT},
        {0, 0, 0, 0}};
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        int g = group_opt(&o, c, optarg, &json);
        if (g < 0) return cli_usage_error("invalid value '%s'", optarg);
        if (g) continue;
        switch (c) {
        case O_METHOD: method_name = optarg; break;
        case O_PARTITION: partition = optarg; break;
        case O_CACHED:
            if (pdm_parse_long(optarg, 0, 1 << 22, &cached))
                return cli_usage_error("invalid --cached '%s'", optarg);
            break;
        case O_TABLE: table_path = optarg; break;
        case O_CALIB: calib_path = optarg; break;
        case O_KV_OUT: kv_out = optarg; break;
        case O_LOGITS_OUT: logits_out = optarg; break;
        case O_REPEAT:
            if (pdm_parse_long(optarg, 1, 64, &repeat))
                return cli_usage_error("invalid --repeat '%s' (1..64)", optarg);
            break;
        default: return cli_usage_error("%s", "unknown option (see pdmesh --help)");
        }
    }
    if (optind != argc) return cli_usage_error("unexpected argument '%s'", argv[optind]);
    pdm_prefill_method_t method;
    if (pdm_prefill_method_parse(method_name, &method)) return cli_usage_error("%s", pdm_error_last());
    int explicit_chunks[PDM_KVT_MAX_RANKS], n_explicit = 0;
    if (partition && (parse_int_list(partition, explicit_chunks, PDM_KVT_MAX_RANKS, &n_explicit) ||
                      n_explicit != o.lp.ranks))
        return cli_usage_error("--partition needs one positive size per rank: '%s'", partition);

    pdm_model_t *model = NULL;
    int32_t *ids = NULL;
    size_t n = 0;
    int rc = cli_load_model(o.lp.model, &model);
    if (rc) return rc;
    rc = prompt_tokens(&o, model, &ids, &n);
    if (rc) goto out_model;
    rc = 1;
    if ((long)n <= cached) {
        fprintf(stderr, "%s: --cached %ld leaves no new tokens of the %zu-token prompt\n",
                cli_prog, cached, n);
        goto out_ids;
    }
    if ((long)n > o.lp.ctx_tokens) {
        fprintf(stderr, "%s: the prompt has %zu tokens, more than --ctx %d\n", cli_prog, n,
                o.lp.ctx_tokens);
        goto out_ids;
    }
    pdm_partition_table_t table;
    pdm_calibration_t calib;
    if (table_path && pdm_partition_table_load(table_path, &table)) {
        cli_runtime_error("partition table");
        goto out_ids;
    }
    if (calib_path && pdm_calibration_load(calib_path, &calib)) {
        cli_runtime_error("calibration");
        goto out_ids;
    }
    const int32_t T = (int32_t)(n - (size_t)cached);
    int chunks[PDM_KVT_MAX_RANKS], has_chunks;
    char why[256];
    pdm_prefill_method_t resolved;
    if (pdm_prefill_resolve(method, &model->hp, o.lp.ranks, T, (int32_t)cached,
                            partition ? explicit_chunks : NULL, table_path ? &table : NULL,
                            calib_path ? &calib : NULL, &resolved, chunks, &has_chunks, why,
                            sizeof(why))) {
        cli_runtime_error("cannot plan the prefill");
        goto out_ids;
    }
    pdm_launch_t *l;
    if (pdm_launch_start(&o.lp, &l)) {
        cli_runtime_error("prefill group");
        goto out_ids;
    }
    pdm_launch_result_t res = {0};
    double ttfts[64];
    if (run_measured(l, resolved, ids, (int32_t)n, (int32_t)cached, has_chunks ? chunks : NULL,
                     (int)repeat, kv_out, logits_out, &res, ttfts)) {
        cli_runtime_error("prefill");
        pdm_launch_stop(l);
        goto out_ids;
    }
    char text[256] = "";
    pdm_tokenizer_token_bytes(model->tokenizer, res.first_token, 1, text, sizeof(text));
    if (json) {
        cJSON *j = cJSON_CreateObject();
        cJSON_AddStringToObject(j, "method", pdm_prefill_method_name(resolved));
        cJSON_AddStringToObject(j, "requested_method", pdm_prefill_method_name(method));
        cJSON_AddStringToObject(j, "why", why);
        cJSON_AddNumberToObject(j, "ranks", o.lp.ranks);
        cJSON_AddNumberToObject(j, "threads_per_rank", o.lp.threads);
        cJSON_AddNumberToObject(j, "prompt_tokens", (double)n);
        cJSON_AddNumberToObject(j, "cached_tokens", (double)cached);
        if (has_chunks) cJSON_AddItemToObject(j, "partition", cJSON_CreateIntArray(chunks, o.lp.ranks));
        cJSON_AddNumberToObject(j, "first_token", res.first_token);
        cJSON_AddStringToObject(j, "first_token_text", text);
        cJSON *top = cJSON_AddArrayToObject(j, "top");
        for (int i = 0; i < res.n_top; i++) {
            cJSON *pair = cJSON_CreateArray();
            cJSON_AddItemToArray(pair, cJSON_CreateNumber(res.top_ids[i]));
            cJSON_AddItemToArray(pair, cJSON_CreateNumber(res.top_logits[i]));
            cJSON_AddItemToArray(top, pair);
        }
        cJSON_AddNumberToObject(j, "ttft", res.ttft);
        cJSON_AddItemToObject(j, "ttft_runs", cJSON_CreateDoubleArray(ttfts, (int)repeat));
        cJSON_AddStringToObject(j, "transports", pdm_launch_transports(l));
        cJSON *ranks = cJSON_AddArrayToObject(j, "per_rank");
        for (int i = 0; i < o.lp.ranks; i++) {
            cJSON *r = cJSON_CreateObject();
            cJSON_AddNumberToObject(r, "rank", i);
            cJSON_AddNumberToObject(r, "tokens", res.rank[i].n_local);
            cJSON_AddNumberToObject(r, "t_total", res.rank[i].t_total);
            cJSON_AddNumberToObject(r, "t_compute", res.rank[i].t_compute);
            cJSON_AddNumberToObject(r, "t_wait", res.rank[i].t_wait);
            cJSON_AddNumberToObject(r, "bytes_sent", res.rank[i].bytes_sent);
            cJSON_AddNumberToObject(r, "bytes_received", res.rank[i].bytes_received);
            cJSON_AddItemToArray(ranks, r);
        }
        char *s = cJSON_PrintUnformatted(j);
        printf("%s\n", s);
        free(s);
        cJSON_Delete(j);
    } else {
        printf("first token: %d %s\n", res.first_token, text);
        printf("ttft: %.4f s (%s on %d ranks, %zu tokens, %ld cached; %s)\n", res.ttft,
               pdm_prefill_method_name(resolved), o.lp.ranks, n, cached, why);
        if (has_chunks) {
            printf("partition:");
            for (int i = 0; i < o.lp.ranks; i++) printf(" %d", chunks[i]);
            printf("\n");
        }
        printf("transports: %s\n", pdm_launch_transports(l)[0] ? pdm_launch_transports(l) : "-");
        for (int i = 0; i < o.lp.ranks; i++)
            printf("rank %d: %5d tokens  total %.4f s  compute %.4f s  wait %.4f s  sent %.0f B  "
                   "received %.0f B%s\n", i, res.rank[i].n_local, res.rank[i].t_total,
                   res.rank[i].t_compute, res.rank[i].t_wait, res.rank[i].bytes_sent,
                   res.rank[i].bytes_received, i == res.owner ? "  (first token)" : "");
    }
    pdm_launch_stop(l);
    rc = 0;
out_ids:
    free(ids);
out_model:
    pdm_model_free(model);
    return rc;
}
