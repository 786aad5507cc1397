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
#include "decode_node/beam.h"
#include "prefill_node/prefill.h"

/* Options shared by the three commands. */
typedef struct {
    pdm_launch_params_t lp;
    char bin[PATH_MAX];
    const char *prompt, *prompt_file;
    int chat;
    const char *chat_template; /* --chat-template NAME, or NULL: the file's */
    long length;   /* exact prompt length (the text is repeated), 0: as tokenized */
    long random;   /* random prompt of this many tokens, 0: off */
    uint64_t seed;
} group_opts_t;

enum {
    O_RANKS = 1000, O_METHOD, O_PROMPT, O_PROMPT_FILE, O_CHAT, O_LENGTH, O_RANDOM, O_SEED,
    O_PARTITION, O_CACHED, O_TABLE, O_CALIB, O_THREADS, O_PIN, O_CTX, O_KV_DTYPE, O_TIMEOUT,
    O_KV_OUT, O_LOGITS_OUT, O_REPEAT, O_JSON, O_MODEL, O_LENGTHS, O_OUT, O_REPS, O_STRIDE,
    O_PLAN, O_CHAT_TEMPLATE, O_PROMPT_LP
};

#define GROUP_LONG_OPTS                                                                        \
    {"ranks", required_argument, 0, O_RANKS}, {"prompt", required_argument, 0, O_PROMPT},      \
        {"prompt-file", required_argument, 0, O_PROMPT_FILE}, {"chat", no_argument, 0, O_CHAT}, \
        {"length", required_argument, 0, O_LENGTH}, {"random", required_argument, 0, O_RANDOM}, \
        {"seed", required_argument, 0, O_SEED}, {"threads", required_argument, 0, O_THREADS},   \
        {"pin", no_argument, 0, O_PIN}, {"ctx", required_argument, 0, O_CTX},                   \
        {"kv-dtype", required_argument, 0, O_KV_DTYPE},                                         \
        {"timeout", required_argument, 0, O_TIMEOUT}, {"model", required_argument, 0, O_MODEL}, \
        {"json", no_argument, 0, O_JSON}, {"chat-template", required_argument, 0, O_CHAT_TEMPLATE}

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
    case O_CHAT_TEMPLATE:
        if (pdm_chat_from_name(arg) == PDM_CHAT_UNKNOWN) {
            fprintf(stderr, "%s: unknown --chat-template '%s' (known: %s)\n", cli_prog, arg,
                    pdm_chat_names());
            return -1;
        }
        o->chat_template = arg;
        return 1;
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
        if (strcmp(arg, "f16") && strcmp(arg, "f32") && strcmp(arg, "q8")) return -1;
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
            if (pdm_file_read(o->prompt_file, 128u << 20, &text, &len))
                return cli_runtime_error("prompt");
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
            if (o->chat_template &&
                pdm_tokenizer_set_chat_template(model->tokenizer, o->chat_template)) {
                free(text);
                return cli_runtime_error("--chat-template");
            }
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
                        double *ttfts, int prompt_logprobs)
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
                                .n_tokens = n - cached, .chunks = chunks,
                                .prompt_logprobs = prompt_logprobs, .prompt_top = 5};
        pdm_launch_result_t r;
        int last = rep == reps - 1;
        int st = pdm_launch_task(l, &t, last ? kv_out : NULL, last ? logits_out : NULL, &r);
        free(r.prompt_logprobs);
        r.prompt_logprobs = NULL;
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
    int json = 0, plan_only = 0, prompt_logprobs = 0;
    static const struct option opts[] = {
        GROUP_LONG_OPTS,
        {"prompt-logprobs", no_argument, 0, O_PROMPT_LP},
        {"method", required_argument, 0, O_METHOD},
        {"partition", required_argument, 0, O_PARTITION},
        {"cached", required_argument, 0, O_CACHED},
        {"table", required_argument, 0, O_TABLE},
        {"calibration", required_argument, 0, O_CALIB},
        {"kv-out", required_argument, 0, O_KV_OUT},
        {"logits-out", required_argument, 0, O_LOGITS_OUT},
        {"repeat", required_argument, 0, O_REPEAT},
        {"plan", no_argument, 0, O_PLAN},
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
        case O_PLAN: plan_only = 1; break;
        case O_PROMPT_LP: prompt_logprobs = 1; break;
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
    if (plan_only) { /* what would run, without starting the group */
        if (json) {
            printf("{\"method\":\"%s\",\"requested_method\":\"%s\",\"prompt_tokens\":%zu,"
                   "\"cached_tokens\":%ld,\"why\":\"%s\"", pdm_prefill_method_name(resolved),
                   pdm_prefill_method_name(method), n, cached, why);
            if (has_chunks) {
                printf(",\"partition\":[");
                for (int i = 0; i < o.lp.ranks; i++) printf("%s%d", i ? "," : "", chunks[i]);
                printf("]");
            }
            printf("}\n");
        } else {
            printf("%s on %d ranks (%s)\n", pdm_prefill_method_name(resolved), o.lp.ranks, why);
        }
        rc = 0;
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
                     (int)repeat, kv_out, logits_out, &res, ttfts, prompt_logprobs)) {
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
        cli_print_json_line(j);
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

/* ---- partition-search ------------------------------------------------------------------- */

typedef struct {
    pdm_launch_t *l;
    const int32_t *ids;
    int n, reps;
} search_ctx_t;

/* The partition search's measurement (pdm_partition_measure_cb): median TTFT of KVR with
 * the given chunk sizes over the group, +inf if the run fails. */
static double measure_kvr(void *data, const int *chunks)
{
    const search_ctx_t *s = data;
    pdm_launch_result_t res = {0};
    double ttfts[64];
    if (run_measured(s->l, PDM_PREFILL_KVR_S, s->ids, s->n, 0, chunks, s->reps, NULL, NULL,
                     &res, ttfts, 0)) {
        fprintf(stderr, "%s: partition-search: %s\n", cli_prog, pdm_error_last());
        return INFINITY;
    }
    return res.ttft;
}

int cmd_partition_search(int argc, char **argv)
{
    group_opts_t o;
    group_opts_init(&o);
    const char *out_path = "partition-table.json", *lengths_arg = NULL;
    long reps = 3, min_stride = 32;
    int json = 0;
    static const struct option opts[] = {GROUP_LONG_OPTS,
                                         {"lengths", required_argument, 0, O_LENGTHS},
                                         {"out", required_argument, 0, O_OUT},
                                         {"reps", required_argument, 0, O_REPS},
                                         {"min-stride", required_argument, 0, O_STRIDE},
                                         {0, 0, 0, 0}};
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        int g = group_opt(&o, c, optarg, &json);
        if (g < 0) return cli_usage_error("invalid value '%s'", optarg);
        if (g) continue;
        switch (c) {
        case O_LENGTHS: lengths_arg = optarg; break;
        case O_OUT: out_path = optarg; break;
        case O_REPS:
            if (pdm_parse_long(optarg, 1, 64, &reps)) return cli_usage_error("bad --reps '%s'", optarg);
            break;
        case O_STRIDE:
            if (pdm_parse_long(optarg, 1, 1 << 20, &min_stride))
                return cli_usage_error("bad --min-stride '%s'", optarg);
            break;
        default: return cli_usage_error("%s", "unknown option (see pdmesh --help)");
        }
    }
    int lengths[64], n_lengths;
    if (!lengths_arg || parse_int_list(lengths_arg, lengths, 64, &n_lengths))
        return cli_usage_error("%s", "partition-search needs --lengths N,N,... (positive)");
    pdm_model_t *model = NULL;
    int rc = cli_load_model(o.lp.model, &model);
    if (rc) return rc;
    int max_len = 0;
    for (int i = 0; i < n_lengths; i++) max_len = PDM_MAX(max_len, lengths[i]);
    if (o.lp.ctx_tokens < max_len) o.lp.ctx_tokens = max_len;
    pdm_partition_table_t table = {.ranks = o.lp.ranks};
    if (access(out_path, R_OK) == 0 && pdm_partition_table_load(out_path, &table) == 0 &&
        table.ranks != o.lp.ranks) {
        fprintf(stderr, "%s: %s is a table for %d ranks\n", cli_prog, out_path, table.ranks);
        pdm_model_free(model);
        return 1;
    }
    pdm_launch_t *l;
    if (pdm_launch_start(&o.lp, &l)) {
        pdm_model_free(model);
        return cli_runtime_error("prefill group");
    }
    rc = 0;
    for (int i = 0; i < n_lengths && !rc; i++) {
        int n = lengths[i];
        int32_t *ids = malloc(sizeof(int32_t) * (size_t)n);
        uint64_t seed = o.seed + (uint64_t)n;
        for (int k = 0; ids && k < n; k++) ids[k] = (int32_t)(pdm_splitmix64(&seed) % model->hp.n_vocab);
        search_ctx_t s = {.l = l, .ids = ids, .n = n, .reps = (int)reps};
        pdm_partition_search_params_t sp = {.ranks = o.lp.ranks, .n_tokens = n,
                                            .min_stride = (int)min_stride,
                                            .measure = measure_kvr, .data = &s};
        int best[PDM_KVT_MAX_RANKS], evaluations = 0;
        double t0 = pdm_now();
        double best_t = ids && n >= o.lp.ranks ? pdm_partition_search(&sp, best, &evaluations)
                                               : INFINITY;
        /* cp-kv at the same length, for auto's KVR-versus-CP choice. */
        double cp_t = 0, ttfts[64];
        pdm_launch_result_t res = {0};
        if (isfinite(best_t) && o.lp.ranks > 1 &&
            run_measured(l, PDM_PREFILL_CP_KV, ids, n, 0, NULL, (int)reps, NULL, NULL, &res,
                         ttfts, 0) == 0)
            cp_t = res.ttft;
        free(ids);
        if (!isfinite(best_t)) {
            fprintf(stderr, "%s: no partition of %d tokens over %d ranks ran\n", cli_prog, n,
                    o.lp.ranks);
            rc = 1;
            break;
        }
        pdm_partition_table_put(&table, n, best, best_t, cp_t);
        if (pdm_partition_table_save(out_path, &table)) {
            rc = cli_runtime_error("partition table");
            break;
        }
        printf("length %d: partition", n);
        for (int r = 0; r < o.lp.ranks; r++) printf(" %d", best[r]);
        printf("  ttft %.4f s  (cp-kv %.4f s)  %d runs in %.1f s\n", best_t, cp_t,
               evaluations, pdm_now() - t0);
        fflush(stdout);
    }
    pdm_launch_stop(l);
    pdm_model_free(model);
    if (!rc) printf("wrote %s\n", out_path);
    return rc;
}

/* ---- calibrate --------------------------------------------------------------------------- */

/* FLOPs of a prefill of n tokens: 2 per multiply-add of every projection for every token, and
 * causal attention (QK^T and PV: 4 * head_dim per query-key pair and head, n(n+1)/2 pairs). */
static double prefill_flops(const pdm_model_hparams_t *hp, double n)
{
    const double d = hp->d_model, hd = hp->head_dim, nh = hp->n_heads, nkv = hp->n_kv_heads;
    const double per_layer = d * nh * hd * 2 + d * nkv * hd * 2 + 3 * d * hp->n_ff;
    return hp->n_layers * (2 * per_layer * n + 4 * hd * nh * n * (n + 1) / 2);
}

int cmd_calibrate(int argc, char **argv)
{
    group_opts_t o;
    group_opts_init(&o);
    const char *out_path = "calibration.json";
    long length = 1024, reps = 3;
    int json = 0;
    static const struct option opts[] = {GROUP_LONG_OPTS,
                                         {"out", required_argument, 0, O_OUT},
                                         {"reps", required_argument, 0, O_REPS},
                                         {0, 0, 0, 0}};
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        int g = group_opt(&o, c, optarg, &json);
        if (g < 0) return cli_usage_error("invalid value '%s'", optarg);
        if (g) continue;
        if (c == O_OUT)
            out_path = optarg;
        else if (c == O_REPS) {
            if (pdm_parse_long(optarg, 1, 64, &reps)) return cli_usage_error("bad --reps '%s'", optarg);
        } else
            return cli_usage_error("%s", "unknown option (see pdmesh --help)");
    }
    if (o.length) length = o.length;
    pdm_model_t *model = NULL;
    int rc = cli_load_model(o.lp.model, &model);
    if (rc) return rc;
    if (o.lp.ctx_tokens < length) o.lp.ctx_tokens = (int)length;
    pdm_calibration_t cal = {0};
    char transports[128] = "";
    /* Compute: the single-rank prefill of `length` random tokens. */
    o.lp.ranks = 1;
    pdm_launch_t *l;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)length);
    uint64_t seed = o.seed;
    for (long i = 0; ids && i < length; i++)
        ids[i] = (int32_t)(pdm_splitmix64(&seed) % model->hp.n_vocab);
    double ttfts[64];
    pdm_launch_result_t res = {0};
    if (!ids || pdm_launch_start(&o.lp, &l)) {
        rc = cli_runtime_error("calibrate");
        goto out;
    }
    if (run_measured(l, PDM_PREFILL_SINGLE, ids, (int32_t)length, 0, NULL, (int)reps, NULL, NULL,
                     &res, ttfts, 0)) {
        pdm_launch_stop(l);
        rc = cli_runtime_error("calibrate: compute");
        goto out;
    }
    pdm_launch_stop(l);
    cal.flops = prefill_flops(&model->hp, (double)length) / res.ttft;
    /* Link: round trips of 8 bytes (latency) and 4 MiB (bandwidth) between two ranks. */
    o.lp.ranks = 2;
    double small = 0, large = 0;
    const size_t big = 4u << 20;
    if (pdm_launch_start(&o.lp, &l)) {
        rc = cli_runtime_error("calibrate");
        goto out;
    }
    snprintf(transports, sizeof(transports), "%s", pdm_launch_transports(l));
    if (pdm_launch_pingpong(l, 8, 2000, &small) || pdm_launch_pingpong(l, big, 30, &large)) {
        pdm_launch_stop(l);
        rc = cli_runtime_error("calibrate: link");
        goto out;
    }
    pdm_launch_stop(l);
    cal.latency = small / 2;
    cal.bandwidth = (double)big / PDM_MAX(large / 2 - cal.latency, 1e-9);
    if (pdm_calibration_save(out_path, &cal)) {
        rc = cli_runtime_error("calibration");
        goto out;
    }
    if (json)
        printf("{\"flops\":%g,\"bandwidth\":%g,\"latency\":%g,\"transports\":\"%s\","
               "\"length\":%ld,\"ttft\":%g}\n", cal.flops, cal.bandwidth, cal.latency, transports,
               length, res.ttft);
    else
        printf("compute: %.2f GFLOP/s (prefill of %ld tokens in %.3f s)\n"
               "link (%s): latency %.1f us, bandwidth %.2f GB/s\nwrote %s\n",
               cal.flops / 1e9, length, res.ttft, transports[0] ? transports : "-",
               cal.latency * 1e6, cal.bandwidth / 1e9, out_path);
out:
    free(ids);
    pdm_model_free(model);
    return rc;
}

/* ---- disagg-run --------------------------------------------------------------------------- */

int cmd_disagg_run(int argc, char **argv)
{
    group_opts_t o;
    group_opts_init(&o);
    const char *method_name = "kvr-e", *partition = NULL, *prompts[64], *files[64], *stops[8];
    int n_prompts = 0, n_files = 0, n_stops = 0, json = 0;
    long n_new = 64, decode_batch = 16, decode_threads = 1;
    pdm_sampler_params_t sp;
    pdm_sampler_params_default(&sp);
    sp.temperature = 0; /* greedy unless asked */
    enum { D_N = 2000, D_STOP, D_DBATCH, D_DTHREADS, D_BEAMS, D_LPEN, D_NBEST, D_ESTOP, D_FAST,
           D_SLOW, D_REUSE, D_BLOCK, D_WINDOW };
    int reuse_prefix = 0;
    long block_tokens = 64; /* the router's default --block-tokens */
    long beams = 0, n_best = 1;
    double length_penalty = 1.0;
    const char *early_stopping = "heuristic";
    const char *kv_fast = NULL, *kv_slow = NULL; /* head-wise KV offload on the decode node */
    const char *kv_window = NULL; /* the decode node's --kv-window (NULL: its default) */
    static const struct option opts[] = {
        {"prefill-ranks", required_argument, 0, O_RANKS},
        {"method", required_argument, 0, O_METHOD},
        {"partition", required_argument, 0, O_PARTITION},
        {"prompt", required_argument, 0, O_PROMPT},
        {"prompt-file", required_argument, 0, O_PROMPT_FILE},
        {"chat", no_argument, 0, O_CHAT},
        {"chat-template", required_argument, 0, O_CHAT_TEMPLATE},
        {"random", required_argument, 0, O_RANDOM},
        {"length", required_argument, 0, O_LENGTH},
        {"n-predict", required_argument, 0, D_N},
        CLI_SAMPLING_LONG_OPTS,
        {"stop", required_argument, 0, D_STOP},
        {"decode-batch", required_argument, 0, D_DBATCH},
        {"decode-threads", required_argument, 0, D_DTHREADS},
        {"beams", required_argument, 0, D_BEAMS},
        {"length-penalty", required_argument, 0, D_LPEN},
        {"n-best", required_argument, 0, D_NBEST},
        {"early-stopping", required_argument, 0, D_ESTOP},
        {"kv-fast-budget", required_argument, 0, D_FAST},
        {"kv-slow-tier", required_argument, 0, D_SLOW},
        {"kv-window", required_argument, 0, D_WINDOW},
        {"reuse-prefix", no_argument, 0, D_REUSE},
        {"block-tokens", required_argument, 0, D_BLOCK},
        {"threads", required_argument, 0, O_THREADS},
        {"pin", no_argument, 0, O_PIN},
        {"ctx", required_argument, 0, O_CTX},
        {"kv-dtype", required_argument, 0, O_KV_DTYPE},
        {"timeout", required_argument, 0, O_TIMEOUT},
        {"model", required_argument, 0, O_MODEL},
        {"json", no_argument, 0, O_JSON},
        {0, 0, 0, 0}};
    int c;
    long v;
    optind = 1;
    while ((c = getopt_long(argc, argv, "n:", opts, NULL)) != -1) {
        if (c == O_PROMPT) {
            if (n_prompts == 64) return cli_usage_error("%s", "at most 64 prompts");
            prompts[n_prompts++] = optarg;
            continue;
        }
        if (c == O_PROMPT_FILE) {
            if (n_files == 64) return cli_usage_error("%s", "at most 64 prompt files");
            files[n_files++] = optarg;
            continue;
        }
        int g = group_opt(&o, c, optarg, &json);
        if (g < 0) return cli_usage_error("invalid value '%s'", optarg);
        if (g) continue;
        int sampling = cli_sampling_flag_parse(c, optarg, &sp);
        if (sampling < 0) return 2;
        if (sampling) continue;
        switch (c) {
        case O_METHOD: method_name = optarg; break;
        case O_PARTITION: partition = optarg; break;
        case 'n':
        case D_N:
            if (pdm_parse_long(optarg, 1, 1 << 20, &n_new)) return cli_usage_error("bad -n '%s'", optarg);
            break;
        case D_STOP:
            if (n_stops == 8) return cli_usage_error("%s", "at most 8 stop strings");
            stops[n_stops++] = optarg;
            break;
        case D_DBATCH:
            if (pdm_parse_long(optarg, 1, 1024, &decode_batch)) return cli_usage_error("bad --decode-batch '%s'", optarg);
            break;
        case D_DTHREADS:
            if (pdm_parse_long(optarg, 1, 256, &decode_threads)) return cli_usage_error("bad --decode-threads '%s'", optarg);
            break;
        case D_BEAMS:
            if (pdm_parse_long(optarg, 0, PDM_BEAM_MAX_WIDTH, &beams)) return cli_usage_error("bad --beams '%s' (0..8)", optarg);
            break;
        case D_LPEN:
            if (pdm_parse_double(optarg, -100, 100, &length_penalty)) return cli_usage_error("bad --length-penalty '%s'", optarg);
            break;
        case D_NBEST:
            if (pdm_parse_long(optarg, 1, PDM_BEAM_MAX_WIDTH, &n_best)) return cli_usage_error("bad --n-best '%s'", optarg);
            break;
        case D_ESTOP: {
            pdm_beam_stop_t es;
            if (pdm_beam_stop_parse(optarg, &es)) return cli_usage_error("%s", pdm_error_last());
            early_stopping = pdm_beam_stop_name(es);
            break;
        }
        case D_REUSE: reuse_prefix = 1; break;
        case D_BLOCK:
            if (pdm_parse_long(optarg, 1, 4096, &block_tokens))
                return cli_usage_error("invalid --block-tokens '%s'", optarg);
            break;
        case D_FAST:
            if (pdm_parse_long(optarg, 1, 1L << 50, &v)) return cli_usage_error("bad --kv-fast-budget '%s'", optarg);
            kv_fast = optarg;
            break;
        case D_SLOW:
            if (strcmp(optarg, "ram") && (strncmp(optarg, "file:", 5) || !optarg[5]))
                return cli_usage_error("bad --kv-slow-tier '%s' (ram or file:DIR)", optarg);
            kv_slow = optarg;
            break;
        case D_WINDOW: {
            double r;
            if (pdm_parse_double(optarg, 0, 8, &r) || (r != 0 && r < 1.5))
                return cli_usage_error("bad --kv-window '%s' (0, or 1.5 to 8)", optarg);
            kv_window = optarg;
            break;
        }
        default: return cli_usage_error("%s", "unknown option (see pdmesh --help)");
        }
    }
    if (optind != argc) return cli_usage_error("unexpected argument '%s'", argv[optind]);
    if (beams > 0 && n_best > beams)
        return cli_usage_error("%s", "--n-best exceeds --beams");
    if (beams > 0 && n_stops)
        return cli_usage_error("%s", "--stop is not supported with --beams");
    if (beams > decode_batch)
        return cli_usage_error("%s", "--beams exceeds --decode-batch");
    if (kv_slow && !kv_fast) return cli_usage_error("%s", "--kv-slow-tier needs --kv-fast-budget");
    if (n_prompts + n_files == 0 && !o.random)
        return cli_usage_error("%s", "give --prompt TEXT or --prompt-file FILE (repeatable)");
    pdm_prefill_method_t method;
    if (pdm_prefill_method_parse(method_name, &method)) return cli_usage_error("%s", pdm_error_last());
    if (method == PDM_PREFILL_AUTO || method == PDM_PREFILL_KVR_P)
        return cli_usage_error("%s", "disagg-run takes single, tsp, kvr-e, kvr-s (--partition), "
                                     "cp-kv or cp-q");
    int explicit_chunks[PDM_KVT_MAX_RANKS], n_explicit = 0;
    if (partition && (parse_int_list(partition, explicit_chunks, PDM_KVT_MAX_RANKS, &n_explicit) ||
                      n_explicit != o.lp.ranks))
        return cli_usage_error("--partition needs one positive size per rank: '%s'", partition);

    pdm_model_t *model = NULL;
    int rc = cli_load_model(o.lp.model, &model);
    if (rc) return rc;
    const int n_req = n_prompts + n_files + (o.random ? 1 : 0);
    int32_t *ids[130] = {0};
    size_t lens[130] = {0};
    pdm_launch_request_t reqs[130];
    pdm_launch_response_t out[130];
    memset(out, 0, sizeof(out));
    rc = 1;
    for (int i = 0; i < n_req; i++) {
        group_opts_t one = o;
        one.prompt = i < n_prompts ? prompts[i] : NULL;
        one.prompt_file = i >= n_prompts && i < n_prompts + n_files ? files[i - n_prompts] : NULL;
        if (!one.prompt && !one.prompt_file) one.random = o.random;
        else one.random = 0;
        if ((rc = prompt_tokens(&one, model, &ids[i], &lens[i]))) goto out;
        rc = 1;
        if ((long)lens[i] + n_new > (long)model->hp.n_ctx_train || (long)lens[i] > o.lp.ctx_tokens) {
            fprintf(stderr, "%s: prompt %d has %zu tokens: too long for --ctx %d / the model's "
                            "context\n", cli_prog, i, lens[i], o.lp.ctx_tokens);
            goto out;
        }
        int chunks[PDM_KVT_MAX_RANKS], has_chunks = 0;
        char why[256];
        pdm_prefill_method_t resolved;
        if (pdm_prefill_resolve(method, &model->hp, o.lp.ranks, (int32_t)lens[i], 0,
                                partition ? explicit_chunks : NULL, NULL, NULL, &resolved, chunks,
                                &has_chunks, why, sizeof(why))) {
            cli_runtime_error("cannot plan the prefill");
            goto out;
        }
        reqs[i] = (pdm_launch_request_t){.tokens = ids[i], .n_tokens = (int32_t)lens[i],
                                         .method = resolved, .chunks = NULL, .max_new = (int32_t)n_new,
                                         .sp = sp, .stops = stops, .n_stops = n_stops,
                                         .beams = (int)beams,
                                         .length_penalty = (float)length_penalty,
                                         .n_best = (int)n_best, .early_stopping = early_stopping,
                                         .reuse_prefix = reuse_prefix,
                                         .min_cached = (int32_t)block_tokens};
        if (partition && has_chunks) { /* else the planner splits (kvr-e), as the router */
            int *copy = malloc(sizeof(int) * (size_t)o.lp.ranks);
            if (!copy) goto out;
            memcpy(copy, chunks, sizeof(int) * (size_t)o.lp.ranks);
            reqs[i].chunks = copy;
        }
    }
    char decode_bin[PATH_MAX];
    snprintf(decode_bin, sizeof(decode_bin), "%.*s/pdmesh-decode",
             (int)(strrchr(o.bin, '/') ? strrchr(o.bin, '/') - o.bin : 1),
             strrchr(o.bin, '/') ? o.bin : ".");
    const char *env = getenv("PDMESH_DECODE_BIN");
    o.lp.decode_bin = env && *env ? env : decode_bin;
    o.lp.decode_batch = (int)decode_batch;
    o.lp.decode_threads = (int)decode_threads;
    o.lp.decode_kv_fast_budget = kv_fast;
    o.lp.decode_kv_slow_tier = kv_slow;
    o.lp.decode_kv_window = kv_window;
    pdm_launch_t *l;
    if (pdm_launch_start(&o.lp, &l)) {
        cli_runtime_error("mesh");
        goto out;
    }
    int st = pdm_launch_generate(l, reqs, n_req, out);
    const char *transports = pdm_launch_transports(l);
    int failed = 0;
    for (int i = 0; i < n_req; i++) {
        if (!out[i].ok) {
            fprintf(stderr, "%s: prompt %d: %s\n", cli_prog, i, out[i].error);
            failed++;
            continue;
        }
        if (json) {
            cJSON *j = cJSON_CreateObject();
            cJSON_AddNumberToObject(j, "prompt", i);
            cJSON_AddStringToObject(j, "method", pdm_prefill_method_name(out[i].method));
            cJSON_AddNumberToObject(j, "prefill_ranks", o.lp.ranks);
            cJSON_AddNumberToObject(j, "cached_tokens", out[i].cached);
            cJSON *pr = cJSON_AddArrayToObject(j, "prefill_ranges"); /* the plan (Usage's) */
            for (int k = 0; k < out[i].n_ranges; k++) {
                const pdm_prefill_range_t *x = &out[i].ranges[k];
                int rv[4] = {x->start, x->len, x->rank, x->chunk};
                cJSON_AddItemToArray(pr, cJSON_CreateIntArray(rv, 4));
            }
            cJSON_AddNumberToObject(j, "prompt_tokens", reqs[i].n_tokens);
            cJSON_AddItemToObject(j, "token_ids", cJSON_CreateIntArray(out[i].tokens, out[i].n_tokens));
            cJSON_AddStringToObject(j, "text", out[i].text);
            cJSON_AddStringToObject(j, "finish", out[i].finish);
            cJSON_AddNumberToObject(j, "ttft", out[i].ttft);
            cJSON_AddNumberToObject(j, "time_per_output_token", out[i].step_seconds);
            cJSON_AddNumberToObject(j, "total", out[i].total);
            cJSON_AddNumberToObject(j, "kv_bytes", out[i].kv_bytes);
            cJSON *kc = cJSON_AddObjectToObject(j, "kv_cache"); /* on the decode node */
            cJSON_AddNumberToObject(kc, "local_bytes", out[i].kv_local_bytes);
            cJSON_AddNumberToObject(kc, "global_bytes", out[i].kv_global_bytes);
            cJSON_AddStringToObject(j, "kv_dtype", o.lp.kv_dtype);
            cJSON_AddNumberToObject(j, "kv_seconds", out[i].kv_seconds);
            cJSON_AddStringToObject(j, "transports", transports);
            cJSON *bj = out[i].beam_json ? cJSON_Parse(out[i].beam_json) : NULL;
            if (bj) { /* beam search: the n-best list with scores and the KV memory */
                cJSON *e;
                while ((e = bj->child)) cJSON_AddItemToObject(j, e->string, cJSON_DetachItemViaPointer(bj, e));
                cJSON_Delete(bj);
            }
            if (out[i].offload_json) /* what head-wise offload did on the decode node */
                cJSON_AddItemToObject(j, "offload", cJSON_Parse(out[i].offload_json));
            cli_print_json_line(j);
        } else {
            printf("%s\n", out[i].text);
        }
        fflush(stdout);
    }
    pdm_launch_stop(l);
    rc = st || failed ? 1 : 0;
    if (st) fprintf(stderr, "%s: mesh: %s\n", cli_prog, pdm_error_last());
out:
    for (int i = 0; i < n_req; i++) {
        free(ids[i]);
        if (i < n_req && reqs[i].chunks) free((void *)reqs[i].chunks);
        pdm_launch_response_free(&out[i]);
    }
    pdm_model_free(model);
    return rc;
}
