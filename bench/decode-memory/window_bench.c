/*
 * window_bench.c - windowed local layers on the decode node (decode_node/decode.h): KV bytes
 * per token of context with and without the window, and what the window costs per decode
 * step, for a model with sliding-window layers (Gemma 3 270M: 15 of 18 layers local, window
 * 512).
 *
 * For each context C: two caches of C + STEPS slots (f16 unless --kv-dtype), one with every
 * layer full, one with the local layers windowed at reserve r (--reserve, default 2, the
 * decode node's). Their bytes are what pdm_kv_cache_create_params allocated (64-byte aligned
 * head arrays). Both are filled with the same random rows up to C tokens (the windowed one
 * keeps the last S - 1 of each local layer, pdm_kv_cache_window_fill, as from a KV stream);
 * then STEPS decode steps (pdm_decode_step, one sequence, the same input token each step) run
 * on each: wall time per step, mean and median; the windowed run's logits must equal the full
 * run's (checked, bit for bit). The rows' values do not change the attention's cost.
 * Copies: the windowed cache's moves and bytes moved per appended token over 4 (S - 1) appends
 * (pdm_kv_cache_room alone, no compute).
 *
 * Writes a JSON report (--json FILE) and a markdown table (--md FILE). The machine may be
 * shared: numbers are labelled so unless --quiet-machine is given.
 *
 * --check P,N instead: the real model end to end on real activations. A prompt of P random
 * token ids is prefilled into a full and a windowed cache in the same chunks (q8: the full
 * cache's prompt, the window keeping its tail, as from a KV stream), then N - 1 greedy decode
 * steps run on each; every step's logits must be equal bit for bit and the greedy tokens the
 * same (exit 1 otherwise). P + N past 2 (S - 1) + (S - 1) makes the window move.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/pdm.h"
#include "decode_node/decode.h"
#include "model/model.h"

enum { MAX_CTX = 8, STEPS = 48 };

typedef struct {
    int32_t context;
    size_t full_bytes, win_bytes; /* allocated KV of one sequence */
    size_t win_local_bytes, win_global_bytes;
    double full_mean, full_median, win_mean, win_median; /* seconds per decode step */
    double copies_per_token, moved_per_token;            /* window moves, bytes */
    int windowed; /* 0: the context is within the window rows */
} result_t;

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static void stats(double *t, int n, double *mean, double *median)
{
    double s = 0;
    for (int i = 0; i < n; i++) s += t[i];
    *mean = n ? s / n : 0;
    qsort(t, (size_t)n, sizeof(double), cmp_double);
    *median = n ? (n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2])) : 0;
}

/* Random rows in every slot [0, n) of every layer of c (q8: int8 in [-100, 100]). */
static void fill_random(pdm_kv_cache_t *c, int32_t n, uint64_t seed)
{
    const size_t elems = (size_t)n * c->head_dim;
    for (size_t i = 0; i < (size_t)c->n_layers * c->n_kv_heads; i++)
        for (int kv = 0; kv < 2; kv++) {
            void *dst = kv ? c->v[i] : c->k[i];
            for (size_t e = 0; e < elems; e++) {
                const double u = (double)(pdm_splitmix64(&seed) >> 11) / 9007199254740992.0;
                const float x = (float)(2 * u - 1);
                if (c->dtype == PDM_DT_F32) ((float *)dst)[e] = x;
                else if (c->dtype == PDM_DT_F16) ((uint16_t *)dst)[e] = pdm_f32_to_f16(x);
                else ((int8_t *)dst)[e] = (int8_t)lrintf(100 * x);
            }
        }
    for (size_t i = 0; i < 2 * (size_t)c->n_layers * c->n_kv_heads; i++) c->scale[i] = 0.01f;
    c->scales_fixed = 1;
    c->n_tokens = n;
}

/* STEPS decode steps of one sequence on c; seconds per step into t[]. */
static int time_steps(pdm_model_ctx_t *ctx, pdm_act_t *act, pdm_kv_cache_t *c, float *logits,
                      float *first_logits, double *t)
{
    for (int s = 0; s < STEPS; s++) {
        pdm_decode_seq_t seq = {c, 1, logits};
        const double t0 = pdm_now();
        int st = pdm_decode_step(ctx, act, &seq, 1);
        t[s] = pdm_now() - t0;
        if (st) return st;
        if (s == STEPS - 1 && first_logits)
            memcpy(first_logits, logits, sizeof(float) * pdm_model_ctx_model(ctx)->hp.n_vocab);
    }
    return 0;
}

static int run_context(pdm_model_ctx_t *ctx, pdm_dtype_t dt, double r, int32_t C, result_t *res)
{
    const pdm_model_t *m = pdm_model_ctx_model(ctx);
    const uint32_t V = m->hp.n_vocab;
    pdm_kv_cache_params_t fp = {.capacity = C + STEPS, .dtype = dt};
    pdm_kv_cache_params_t wp = {.capacity = C + STEPS,
                                .dtype = dt,
                                .model = m,
                                .window_reserve = r};
    pdm_kv_cache_t *full = NULL, *win = NULL;
    pdm_act_t act = {0};
    float *lf = malloc(sizeof(float) * V), *lw = malloc(sizeof(float) * V);
    float *end_f = malloc(sizeof(float) * V), *end_w = malloc(sizeof(float) * V);
    double *t = malloc(sizeof(double) * STEPS);
    int st = !lf || !lw || !end_f || !end_w || !t ? PDM_ENOMEM : 0;
    if (!st) st = pdm_act_alloc(&m->hp, 1, &act);
    if (!st) st = pdm_kv_cache_create_params(&m->hp, &fp, &full);
    if (!st) st = pdm_kv_cache_create_params(&m->hp, &wp, &win);
    if (st) goto out;
    memset(res, 0, sizeof(*res));
    res->context = C;
    /* memory: a sequence of exactly C tokens, as allocated (the timed caches hold C + STEPS) */
    pdm_kv_cache_layout_t lay_f, lay_w;
    fp.capacity = wp.capacity = C;
    if ((st = pdm_kv_cache_layout(&m->hp, &fp, &lay_f)) ||
        (st = pdm_kv_cache_layout(&m->hp, &wp, &lay_w)))
        goto out;
    res->full_bytes = lay_f.full_bytes + lay_f.win_bytes;
    res->win_bytes = lay_w.full_bytes + lay_w.win_bytes;
    res->windowed = lay_w.win_rows > 0;
    const size_t per_full_layer = lay_f.full_bytes / m->hp.n_layers;
    uint32_t n_local = 0;
    for (uint32_t l = 0; l < m->hp.n_layers; l++) n_local += m->layers[l].window > 0;
    res->win_local_bytes = lay_w.win_rows ? lay_w.win_bytes : per_full_layer * n_local;
    res->win_global_bytes = res->win_bytes - res->win_local_bytes;
    fill_random(full, C, 42);
    /* the windowed cache: global layers' rows as the full cache's, local layers' last S - 1 */
    if (win->windowed) {
        const size_t row = pdm_dtype_row_bytes(dt, m->hp.head_dim);
        for (uint32_t l = 0; l < m->hp.n_layers; l++)
            for (uint32_t h = 0; !win->windowed[l] && h < m->hp.n_kv_heads; h++) {
                memcpy(pdm_kv_cache_k(win, l, h), pdm_kv_cache_k(full, l, h), row * (size_t)C);
                memcpy(pdm_kv_cache_v(win, l, h), pdm_kv_cache_v(full, l, h), row * (size_t)C);
            }
        pdm_kv_cache_window_fill(win, full->k, full->v, C);
    } else {
        fill_random(win, C, 42);
    }
    memcpy(win->scale, full->scale, sizeof(float) * 2 * m->hp.n_layers * m->hp.n_kv_heads);
    win->scales_fixed = 1;
    win->n_tokens = C;
    if ((st = time_steps(ctx, &act, full, lf, end_f, t))) goto out;
    stats(t, STEPS, &res->full_mean, &res->full_median);
    if ((st = time_steps(ctx, &act, win, lw, end_w, t))) goto out;
    stats(t, STEPS, &res->win_mean, &res->win_median);
    if (memcmp(end_f, end_w, sizeof(float) * V)) {
        st = pdm_error_set(PDM_EINVAL, "context %d: windowed logits differ from full KV", C);
        goto out;
    }
    /* copies per appended token, the room rule alone */
    if (win->windowed) {
        const uint64_t c0 = win->win_copies, b0 = win->win_bytes_moved;
        const int32_t appends = 4 * win->win_keep;
        pdm_kv_cache_t probe = *win; /* same arrays; a larger capacity for the appends */
        probe.capacity = win->n_tokens + appends;
        for (int32_t i = 0; i < appends; i++) {
            if ((st = pdm_kv_cache_room(&probe, 1))) goto out;
            probe.n_tokens++;
        }
        res->copies_per_token = (double)(probe.win_copies - c0) / appends;
        res->moved_per_token = (double)(probe.win_bytes_moved - b0) / appends;
    }
out:
    pdm_kv_cache_destroy(full);
    pdm_kv_cache_destroy(win);
    pdm_act_free(&act);
    free(lf);
    free(lw);
    free(end_f);
    free(end_w);
    free(t);
    return st;
}

static int argmax(const float *x, int n)
{
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

/* --check (above): 0 when windowed and full caches agree at every step. */
static int run_check(pdm_model_ctx_t *ctx, pdm_dtype_t dt, double r, int P, int N)
{
    const pdm_model_t *m = pdm_model_ctx_model(ctx);
    const int V = (int)m->hp.n_vocab;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)P);
    float *lf = malloc(sizeof(float) * (size_t)V), *lw = malloc(sizeof(float) * (size_t)V);
    pdm_kv_cache_params_t fp = {.capacity = P + N, .dtype = dt};
    pdm_kv_cache_params_t wp = {.capacity = P + N, .dtype = dt, .model = m, .window_reserve = r};
    pdm_kv_cache_t *cf = NULL, *cw = NULL;
    pdm_act_t act = {0};
    int st = !ids || !lf || !lw ? PDM_ENOMEM : 0, differ = 0, same = 1;
    if (!st) st = pdm_act_alloc(&m->hp, 1, &act);
    if (!st) st = pdm_kv_cache_create_params(&m->hp, &fp, &cf);
    if (!st) st = pdm_kv_cache_create_params(&m->hp, &wp, &cw);
    if (st) goto out;
    uint64_t seed = 5;
    for (int i = 0; i < P; i++) ids[i] = (int32_t)(pdm_splitmix64(&seed) % (uint64_t)V);
    const double t0 = pdm_now();
    if (dt == PDM_DT_I8 && cw->windowed) {
        if ((st = pdm_model_prefill(ctx, cf, ids, P, lf))) goto out;
        const size_t row = pdm_dtype_row_bytes(dt, m->hp.head_dim);
        for (uint32_t l = 0; l < m->hp.n_layers; l++)
            for (uint32_t h = 0; !cw->windowed[l] && h < m->hp.n_kv_heads; h++) {
                memcpy(pdm_kv_cache_k(cw, l, h), pdm_kv_cache_k(cf, l, h), row * (size_t)P);
                memcpy(pdm_kv_cache_v(cw, l, h), pdm_kv_cache_v(cf, l, h), row * (size_t)P);
            }
        pdm_kv_cache_window_fill(cw, cf->k, cf->v, P);
        memcpy(cw->scale, cf->scale, sizeof(float) * 2 * m->hp.n_layers * m->hp.n_kv_heads);
        cw->scales_fixed = 1;
        cw->n_tokens = P;
        memcpy(lw, lf, sizeof(float) * (size_t)V);
    } else if (dt == PDM_DT_I8) {
        if ((st = pdm_model_prefill(ctx, cf, ids, P, lf)) ||
            (st = pdm_model_prefill(ctx, cw, ids, P, lw)))
            goto out;
    } else {
        const int chunk = pdm_kv_cache_append_max(cw);
        for (int c0 = 0; c0 < P; c0 += chunk) {
            const int cn = PDM_MIN(chunk, P - c0);
            if ((st = pdm_model_prefill(ctx, cf, ids + c0, cn, lf)) ||
                (st = pdm_model_prefill(ctx, cw, ids + c0, cn, lw)))
                goto out;
        }
    }
    differ = memcmp(lf, lw, sizeof(float) * (size_t)V) != 0;
    int32_t tf = argmax(lf, V), tw = argmax(lw, V);
    for (int s = 0; s < N - 1; s++) {
        same &= tf == tw;
        pdm_decode_seq_t a = {cf, tf, lf}, b = {cw, tw, lw};
        if ((st = pdm_decode_step(ctx, &act, &a, 1)) || (st = pdm_decode_step(ctx, &act, &b, 1)))
            goto out;
        differ += memcmp(lf, lw, sizeof(float) * (size_t)V) != 0;
        tf = argmax(lf, V);
        tw = argmax(lw, V);
    }
    same &= tf == tw;
    printf("check %s r=%g: prompt %d + %d tokens; KV %zu (full) vs %zu (windowed) bytes; window "
           "copies %llu; steps whose logits differ: %d; greedy tokens identical: %s (%.0f s)\n",
           pdm_dtype_name(dt), r, P, N, pdm_kv_cache_bytes(cf), pdm_kv_cache_bytes(cw),
           (unsigned long long)cw->win_copies, differ, same ? "yes" : "no", pdm_now() - t0);
out:
    if (st) fprintf(stderr, "window_bench: %s\n", pdm_error_last());
    pdm_kv_cache_destroy(cf);
    pdm_kv_cache_destroy(cw);
    pdm_act_free(&act);
    free(ids);
    free(lf);
    free(lw);
    return st || differ || !same;
}

int main(int argc, char **argv)
{
    const char *model_path = pdm_model_default_path(), *json_path = NULL, *md_path = NULL;
    int threads = 1, quiet = 0, n_ctx = 0, check_p = 0, check_n = 0;
    int32_t ctxs[MAX_CTX];
    double r = 2;
    pdm_dtype_t dt = PDM_DT_F16;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--model") && v) model_path = argv[++i];
        else if (!strcmp(a, "--threads") && v) threads = atoi(argv[++i]);
        else if (!strcmp(a, "--reserve") && v) r = atof(argv[++i]);
        else if (!strcmp(a, "--json") && v) json_path = argv[++i];
        else if (!strcmp(a, "--md") && v) md_path = argv[++i];
        else if (!strcmp(a, "--kv-dtype") && v) {
            if (pdm_kv_dtype_parse(argv[++i], &dt)) return 2;
        } else if (!strcmp(a, "--quiet-machine")) quiet = 1;
        else if (!strcmp(a, "--check") && v) {
            if (sscanf(argv[++i], "%d,%d", &check_p, &check_n) != 2 || check_p < 1 || check_n < 1)
                return 2;
        } else if (!strcmp(a, "--contexts") && v) {
            for (char *s = argv[++i]; *s && n_ctx < MAX_CTX;) {
                ctxs[n_ctx++] = (int32_t)strtol(s, &s, 10);
                if (*s == ',') s++;
            }
        } else {
            fprintf(stderr, "usage: window_bench [--model F] [--threads N] [--reserve R] "
                            "[--kv-dtype f16|f32|q8] [--contexts 512,2048,...] [--json F] "
                            "[--md F] [--quiet-machine] [--check PROMPT,NEW]\n");
            return 2;
        }
    }
    if (!n_ctx) {
        const int32_t def[] = {512, 2048, 8192, 32768};
        memcpy(ctxs, def, sizeof(def));
        n_ctx = 4;
    }
    pdm_model_t *m;
    pdm_model_ctx_t *ctx;
    if (pdm_model_load(model_path, &m) || pdm_model_ctx_create(m, threads, 64, &ctx)) {
        fprintf(stderr, "window_bench: %s\n", pdm_error_last());
        return 1;
    }
    if (check_p) {
        const int bad = run_check(ctx, dt, r, check_p, check_n);
        pdm_model_ctx_destroy(ctx);
        pdm_model_free(m);
        return bad;
    }
    int32_t window = 0;
    uint32_t n_local = 0;
    for (uint32_t l = 0; l < m->hp.n_layers; l++) {
        window = PDM_MAX(window, m->layers[l].window);
        n_local += m->layers[l].window > 0;
    }
    result_t res[MAX_CTX];
    for (int i = 0; i < n_ctx; i++) {
        if (run_context(ctx, dt, r, ctxs[i], &res[i])) {
            fprintf(stderr, "window_bench: %s\n", pdm_error_last());
            return 1;
        }
        fprintf(stderr,
                "context %6d: KV %9zu -> %9zu bytes (%.0f -> %.0f per token), step "
                "%.2f -> %.2f ms (median)\n",
                res[i].context, res[i].full_bytes, res[i].win_bytes,
                (double)res[i].full_bytes / res[i].context,
                (double)res[i].win_bytes / res[i].context, 1e3 * res[i].full_median,
                1e3 * res[i].win_median);
    }
    const char *machine = quiet ? "quiet" : "shared (other jobs running: latencies are noisy)";
    if (json_path) {
        FILE *f = fopen(json_path, "w");
        if (!f) return 1;
        fprintf(f,
                "{\"model\": \"%s\", \"kv_dtype\": \"%s\", \"reserve\": %g, \"window\": %d, "
                "\"layers\": %u, \"local_layers\": %u, \"threads\": %d, \"steps\": %d, "
                "\"machine\": \"%s\", \"contexts\": [",
                model_path, pdm_dtype_name(dt), r, window, m->hp.n_layers, n_local, threads, STEPS,
                machine);
        for (int i = 0; i < n_ctx; i++)
            fprintf(f,
                    "%s\n  {\"context\": %d, \"windowed\": %d, \"kv_bytes_full\": %zu, "
                    "\"kv_bytes_windowed\": %zu, \"kv_bytes_local\": %zu, \"kv_bytes_global\": "
                    "%zu, \"bytes_per_token_full\": %.1f, \"bytes_per_token_windowed\": %.1f, "
                    "\"step_ms_full_mean\": %.3f, \"step_ms_full_median\": %.3f, "
                    "\"step_ms_windowed_mean\": %.3f, \"step_ms_windowed_median\": %.3f, "
                    "\"copies_per_token\": %.5f, \"bytes_moved_per_token\": %.1f}",
                    i ? "," : "", res[i].context, res[i].windowed, res[i].full_bytes,
                    res[i].win_bytes, res[i].win_local_bytes, res[i].win_global_bytes,
                    (double)res[i].full_bytes / res[i].context,
                    (double)res[i].win_bytes / res[i].context, 1e3 * res[i].full_mean,
                    1e3 * res[i].full_median, 1e3 * res[i].win_mean, 1e3 * res[i].win_median,
                    res[i].copies_per_token, res[i].moved_per_token);
        fprintf(f, "\n]}\n");
        fclose(f);
    }
    if (md_path) {
        FILE *f = fopen(md_path, "w");
        if (!f) return 1;
        fprintf(f,
                "KV of one sequence, %s, %u layers (%u local, window %d), windowed reserve "
                "r = %g; decode step of one sequence, %d thread(s), median of %d steps; "
                "machine: %s.\n\n",
                pdm_dtype_name(dt), m->hp.n_layers, n_local, window, r, threads, STEPS, machine);
        fprintf(f, "| context | KV full (MiB) | KV windowed (MiB) | local / global (MiB) | "
                   "bytes/token full | bytes/token windowed | ratio | step full (ms) | "
                   "step windowed (ms) | bytes moved/token |\n");
        fprintf(f, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
        for (int i = 0; i < n_ctx; i++)
            fprintf(f,
                    "| %d | %.2f | %.2f | %.2f / %.2f | %.0f | %.0f | %.2f | %.2f | %.2f | "
                    "%.0f |\n",
                    res[i].context, res[i].full_bytes / 1048576.0, res[i].win_bytes / 1048576.0,
                    res[i].win_local_bytes / 1048576.0, res[i].win_global_bytes / 1048576.0,
                    (double)res[i].full_bytes / res[i].context,
                    (double)res[i].win_bytes / res[i].context,
                    (double)res[i].full_bytes / (double)res[i].win_bytes, 1e3 * res[i].full_median,
                    1e3 * res[i].win_median, res[i].moved_per_token);
        fclose(f);
    }
    pdm_model_ctx_destroy(ctx);
    pdm_model_free(m);
    return 0;
}
