/*
 * plan_cmd.c - `pdmesh plan`: the memory of each KV placement for the loaded model, like
 * HeadInfer App. A.3 / Table 10 (weights, KV in the fast and slow tier, activations with and
 * without chunked prefill), and with --fast-budget the longest context each placement serves
 * within that fast budget (a Table 3 analogue).
 */
#include <cjson/cJSON.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "common/pdm.h"
#include "decode_node/decode.h"
#include "decode_node/offload.h"

/* "123", "64K", "3M", "2G" (powers of 1024) -> bytes. */
static int parse_bytes(const char *s, int64_t *out)
{
    char *end;
    double v = strtod(s, &end);
    if (end == s || !(v >= 0)) return -1;
    double mul = 1;
    if (*end == 'K' || *end == 'k') mul = 1024.0, end++;
    else if (*end == 'M' || *end == 'm') mul = 1048576.0, end++;
    else if (*end == 'G' || *end == 'g') mul = 1073741824.0, end++;
    if (*end == 'B' || *end == 'i') end++;
    if (*end) return -1;
    *out = (int64_t)(v * mul);
    return 0;
}

static const char *mib(int64_t b, char *buf, size_t n)
{
    snprintf(buf, n, "%.2f", (double)b / 1048576.0);
    return buf;
}

/* Longest context (tokens) whose KV fast bytes for placement `which` stay within `budget`. */
static int32_t longest(const pdm_model_t *m, int which, int beams, int64_t budget, int chunk,
                       pdm_dtype_t dt, const pdm_kvoff_params_t *p)
{
    int32_t lo = 0, hi = 1 << 26;
    while (lo < hi) {
        int32_t mid = lo + (hi - lo + 1) / 2;
        pdm_kvplan_row_t rows[4];
        int n = pdm_kvplan(m, mid, beams, budget, chunk, dt, p, rows);
        int fits = n > which && rows[which].kv_fast <= budget;
        if (fits) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* The KV of one sequence of `context` tokens per layer kind on a decode node whose local
 * (sliding-window) layers keep only their window in r (S - 1) rows (decode.h, --kv-window; r
 * = 0: every layer keeps the whole context), against full KV in every layer. */
typedef struct {
    pdm_kv_cache_layout_t win, full;
    int32_t window; /* S (0: no local layer) */
} plan_kinds_t;

static int plan_kinds(const pdm_model_t *m, int32_t context, pdm_dtype_t dt, double r,
                      plan_kinds_t *out)
{
    memset(out, 0, sizeof(*out));
    for (uint32_t l = 0; l < m->hp.n_layers; l++)
        out->window = PDM_MAX(out->window, m->layers[l].window);
    pdm_kv_cache_params_t p = {.capacity = context, .dtype = dt, .model = m,
                               .window_reserve = r};
    int st = pdm_kv_cache_layout(&m->hp, &p, &out->win);
    p.window_reserve = 0;
    if (!st) st = pdm_kv_cache_layout(&m->hp, &p, &out->full);
    return st;
}

static void plan_kinds_json(cJSON *o, const pdm_model_t *m, const plan_kinds_t *k, double r,
                            int32_t context)
{
    uint32_t n_local = 0;
    for (uint32_t l = 0; l < m->hp.n_layers; l++) n_local += m->layers[l].window > 0;
    cJSON *kv = cJSON_AddObjectToObject(o, "kv_layers");
    cJSON_AddNumberToObject(kv, "window_reserve", r);
    cJSON_AddNumberToObject(kv, "window", k->window);
    cJSON *g = cJSON_AddObjectToObject(kv, "global");
    cJSON_AddNumberToObject(g, "layers", m->hp.n_layers - n_local);
    cJSON_AddNumberToObject(g, "rows_per_head", context);
    const size_t per_layer_full = k->full.full_bytes / (k->full.n_full ? k->full.n_full : 1);
    cJSON_AddNumberToObject(g, "bytes", (double)per_layer_full * (m->hp.n_layers - n_local));
    cJSON *lo = cJSON_AddObjectToObject(kv, "local");
    cJSON_AddNumberToObject(lo, "layers", n_local);
    const int32_t local_rows = k->win.win_rows ? k->win.win_rows : context;
    cJSON_AddNumberToObject(lo, "rows_per_head", local_rows);
    cJSON_AddNumberToObject(lo, "bytes", k->win.win_rows ? (double)k->win.win_bytes
                                                          : (double)per_layer_full * n_local);
    cJSON_AddNumberToObject(lo, "bytes_full_kv", (double)per_layer_full * n_local);
    const double tot = (double)(k->win.full_bytes + k->win.win_bytes);
    cJSON_AddNumberToObject(kv, "bytes", tot);
    cJSON_AddNumberToObject(kv, "bytes_full_kv", (double)k->full.full_bytes);
    cJSON_AddNumberToObject(kv, "bytes_per_token", tot / context);
    cJSON_AddNumberToObject(kv, "bytes_per_token_full_kv", (double)k->full.full_bytes / context);
}

static void plan_kinds_print(const pdm_model_t *m, const plan_kinds_t *k, double r,
                             int32_t context)
{
    uint32_t n_local = 0;
    for (uint32_t l = 0; l < m->hp.n_layers; l++) n_local += m->layers[l].window > 0;
    if (!n_local) return;
    const size_t per_layer_full = k->full.full_bytes / (k->full.n_full ? k->full.n_full : 1);
    const double local = k->win.win_rows ? (double)k->win.win_bytes
                                         : (double)per_layer_full * n_local;
    const double global = (double)per_layer_full * (m->hp.n_layers - n_local);
    printf("KV per layer kind, one sequence of %d tokens (decode node, --kv-window %g: local "
           "layers keep their window of %d in %d rows per head):\n", context, r, k->window,
           k->win.win_rows ? k->win.win_rows : context);
    printf("%-8s %6s %10s %12s %14s\n", "kind", "layers", "rows/head", "MiB", "MiB (full KV)");
    printf("%-8s %6u %10d %12.2f %14.2f\n", "global", m->hp.n_layers - n_local, context,
           global / 1048576.0, global / 1048576.0);
    printf("%-8s %6u %10d %12.2f %14.2f\n", "local", n_local,
           k->win.win_rows ? k->win.win_rows : context, local / 1048576.0,
           (double)per_layer_full * n_local / 1048576.0);
    printf("%-8s %6u %10s %12.2f %14.2f   (%.0f vs %.0f bytes per token of context)\n", "total",
           m->hp.n_layers, "", (global + local) / 1048576.0,
           (double)k->full.full_bytes / 1048576.0, (global + local) / context,
           (double)k->full.full_bytes / context);
}

int cmd_plan(int argc, char **argv)
{
    const char *model_path = pdm_model_default_path();
    long context = 0, beams = 1, chunk = 512;
    int64_t budget = 0;
    int json = 0;
    double kv_window = 2; /* the decode node's default */
    pdm_dtype_t dt = PDM_DT_F16;
    pdm_kvoff_params_t p;
    pdm_kvoff_params_default(&p);
    static const struct option opts[] = {
        {"context", required_argument, 0, 'c'}, {"beams", required_argument, 0, 'b'},
        {"fast-budget", required_argument, 0, 'f'}, {"chunk", required_argument, 0, 'k'},
        {"kv-dtype", required_argument, 0, 'd'},   {"groups", required_argument, 0, 'g'},
        {"model", required_argument, 0, 'm'},      {"json", no_argument, 0, 'j'},
        {"kv-window", required_argument, 0, 'w'},
        {"help", no_argument, 0, 'h'},             {0, 0, 0, 0}};
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case 'c':
            if (pdm_parse_long(optarg, 1, 1L << 26, &context))
                return cli_usage_error("invalid --context '%s' (1..67108864)", optarg);
            break;
        case 'b':
            if (pdm_parse_long(optarg, 1, 64, &beams)) return cli_usage_error("invalid --beams '%s' (1..64)", optarg);
            break;
        case 'k':
            if (pdm_parse_long(optarg, 1, 1 << 20, &chunk)) return cli_usage_error("invalid --chunk '%s'", optarg);
            break;
        case 'f':
            if (parse_bytes(optarg, &budget) || budget < 1)
                return cli_usage_error("invalid --fast-budget '%s' (bytes, K/M/G suffixes)", optarg);
            break;
        case 'd':
            if (!strcmp(optarg, "f16")) dt = PDM_DT_F16;
            else if (!strcmp(optarg, "f32")) dt = PDM_DT_F32;
            else return cli_usage_error("invalid --kv-dtype '%s' (f16 or f32)", optarg);
            break;
        case 'g':
            if (pdm_kvoff_parse_groups(optarg, &p)) return cli_usage_error("%s", pdm_error_last());
            break;
        case 'm': model_path = optarg; break;
        case 'w':
            if (pdm_parse_double(optarg, 0, 8, &kv_window) || (kv_window != 0 && kv_window < 1.5))
                return cli_usage_error("invalid --kv-window '%s' (0, or 1.5 to 8)", optarg);
            break;
        case 'j': json = 1; break;
        case 'h':
            printf("usage: pdmesh plan --context N [--beams B] [--fast-budget BYTES] [--chunk C]\n"
                   "                   [--kv-dtype f16|f32] [--groups CTX:G,...] [--kv-window R]\n"
                   "                   [--json]\n"
                   "The placements keep every layer's whole context; the table per layer kind\n"
                   "(models with sliding-window layers) shows the decode node's windowed KV.\n");
            return 0;
        default: return cli_usage_error("%s", "invalid option");
        }
    }
    if (optind < argc) return cli_usage_error("unexpected argument '%s'", argv[optind]);
    if (!context) return cli_usage_error("%s", "plan needs --context N");
    pdm_model_t *m;
    /* (the plan needs shapes and layer kinds only, not the tokenizer) */
    if (pdm_model_load(model_path, &m)) return cli_runtime_error("cannot load model");
    pdm_kvplan_row_t rows[4];
    int n = pdm_kvplan(m, (int32_t)context, (int)beams, budget, (int)chunk, dt, &p, rows);
    if (n < 0) {
        pdm_model_free(m);
        return cli_runtime_error("plan");
    }
    plan_kinds_t kinds;
    if (plan_kinds(m, (int32_t)context, dt, kv_window, &kinds)) {
        pdm_model_free(m);
        return cli_runtime_error("plan");
    }
    int32_t maxctx[4] = {0};
    if (budget > 0)
        for (int i = 0; i < n; i++)
            maxctx[i] = longest(m, i, (int)beams, budget, (int)chunk, dt, &p);
    if (json) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "context", (double)context);
        cJSON_AddNumberToObject(o, "beams", (double)beams);
        cJSON_AddNumberToObject(o, "fast_budget", (double)budget);
        cJSON_AddNumberToObject(o, "chunk", (double)chunk);
        cJSON_AddStringToObject(o, "kv_dtype", pdm_dtype_name(dt));
        cJSON *arr = cJSON_AddArrayToObject(o, "placements");
        for (int i = 0; i < n; i++) {
            cJSON *r = cJSON_CreateObject();
            cJSON_AddStringToObject(r, "name", rows[i].name);
            cJSON_AddNumberToObject(r, "group", rows[i].group);
            cJSON_AddNumberToObject(r, "kv_fast", (double)rows[i].kv_fast);
            cJSON_AddNumberToObject(r, "kv_slow", (double)rows[i].kv_slow);
            cJSON_AddNumberToObject(r, "weights", (double)rows[i].weights);
            cJSON_AddNumberToObject(r, "act_prefill", (double)rows[i].act_prefill);
            cJSON_AddNumberToObject(r, "act_chunked", (double)rows[i].act_chunked);
            cJSON_AddNumberToObject(r, "act_decode", (double)rows[i].act_decode);
            cJSON_AddNumberToObject(r, "fast_total_chunked",
                                    (double)(rows[i].weights + rows[i].kv_fast + rows[i].act_chunked));
            if (budget > 0) cJSON_AddNumberToObject(r, "max_context_in_budget", maxctx[i]);
            cJSON_AddItemToArray(arr, r);
        }
        plan_kinds_json(o, m, &kinds, kv_window, (int32_t)context);
        cli_print_json_line(o);
    } else {
        char b[6][32];
        printf("context %ld, %ld sequence(s), KV %s, chunk %ld; MiB (fast = GPU memory in a CUDA "
               "build, RAM arena here)\n", context, beams, pdm_dtype_name(dt), chunk);
        printf("%-19s %5s %10s %10s %9s %11s %11s %13s%s\n", "placement", "group", "kv_fast",
               "kv_slow", "weights", "act_prefill", "act_chunked", "fast+chunked",
               budget > 0 ? "  max ctx in budget" : "");
        for (int i = 0; i < n; i++) {
            printf("%-19s %5d %10s %10s %9s %11s %11s %13s", rows[i].name, rows[i].group,
                   mib(rows[i].kv_fast, b[0], 32), mib(rows[i].kv_slow, b[1], 32),
                   mib(rows[i].weights, b[2], 32), mib(rows[i].act_prefill, b[3], 32),
                   mib(rows[i].act_chunked, b[4], 32),
                   mib(rows[i].weights + rows[i].kv_fast + rows[i].act_chunked, b[5], 32));
            if (budget > 0) printf("  %17d", maxctx[i]);
            printf("\n");
        }
        if (budget > 0 && n < 4)
            printf("head-wise+resident: %ld sequence(s) of %ld tokens do not fit the fast budget\n",
                   beams, context);
        plan_kinds_print(m, &kinds, kv_window, (int32_t)context);
        if ((uint32_t)context > m->hp.n_ctx_train)
            printf("note: the model was trained for %u tokens\n", m->hp.n_ctx_train);
    }
    pdm_model_free(m);
    return 0;
}
