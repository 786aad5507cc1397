/*
 * beam_bench.c - beam search on the decode node: KV memory (segment KV cache paper eq. 2 vs
 * eq. 3, and what is actually allocated) and next-token latency per beam width.
 *
 * A prompt of N_prompt random tokens is prefilled once (pdm_model_prefill); its KV is copied
 * into each run's own prompt cache, as if it had arrived from the prefill ranks. For each
 * width W, two beam searches of N_response steps run over the same prompt, both driven by the
 * decode node's search (pdm_beam_search_*, no end tokens, so every run is N_response steps):
 *   segmented: the prompt KV once, response KV in 16-step segments, beams reordered through the
 *              indirection table (decode_node/beam.c), steps by pdm_decode_step_beams;
 *   copying:   the "standard" layout of eq. (2): one cache of N_prompt + N_response slots per
 *              beam (the prompt copied W times), steps by pdm_decode_step, and after each step
 *              every beam's cache is overwritten by a copy of its parent's (index select).
 * Latency is wall time per step after the first (the priming step is left out), mean and
 * median. Memory: the bytes each layout allocated, beside eq. (2) and eq. (3).
 *
 * Writes a JSON report (--json FILE) and a markdown table (--md FILE). The machine this runs on
 * may be shared: numbers are labelled as such unless --quiet-machine is given.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/pdm.h"
#include "decode_node/decode.h"
#include "model/model.h"

typedef struct {
    int width;
    size_t eq2, eq3, seg_bytes, copy_bytes;
    double seg_mean, seg_median, copy_mean, copy_median;
    uint64_t copy_bytes_moved; /* KV bytes copied by the copying layout's reorders */
    double seg_phase[PDM_DECODE_PHASES]; /* segmented: mean seconds per step of each phase */
    double seg_advance;                  /* segmented: mean seconds per step of the search's
                                          * advance (log-softmax, top-k, reorder) */
    double seg_cpu_median;               /* segmented: median CPU seconds of the process per
                                          * step (not counting time the machine's other load
                                          * took the core) */
    double samp_median, samp_draw;       /* n = width samples (nsamp.h): median step seconds,
                                          * mean seconds of the n draws per step */
} result_t;

/* CPU seconds used by this process so far (all its threads). */
static double cpu_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

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

static void copy_kv(pdm_kv_cache_t *dst, const pdm_kv_cache_t *src, int32_t n_tokens)
{
    const size_t bytes = (size_t)n_tokens * pdm_dtype_row_bytes(src->dtype, src->head_dim);
    for (uint32_t l = 0; l < src->n_layers; l++)
        for (uint32_t h = 0; h < src->n_kv_heads; h++) {
            memcpy(pdm_kv_cache_k(dst, l, h), pdm_kv_cache_k(src, l, h), bytes);
            memcpy(pdm_kv_cache_v(dst, l, h), pdm_kv_cache_v(src, l, h), bytes);
        }
    dst->n_tokens = n_tokens;
}

/* n = W samples of the prompt (decode_node/nsamp.h) at temperature 0.8, N_response tokens
 * each: the same segmented step as the beams, each row its own sampler. */
static int run_samples(pdm_model_ctx_t *ctx, const pdm_kv_cache_t *base, int32_t last_token,
                       int n_prompt, int n_resp, int W, pdm_act_t *act, float *logits,
                       double *t, result_t *r)
{
    const pdm_model_t *m = pdm_model_ctx_model(ctx);
    const int V = (int)m->hp.n_vocab;
    pdm_kv_cache_t *pc;
    pdm_beam_kv_t *kv;
    pdm_nsamp_t *g;
    pdm_sampler_params_t sp;
    pdm_sampler_params_default(&sp);
    sp.temperature = 0.8f;
    sp.seed = 99;
    if (pdm_kv_cache_create(&m->hp, n_prompt, base->dtype, &pc)) return -1;
    copy_kv(pc, base, n_prompt);
    if (pdm_beam_kv_create(&m->hp, pc, n_prompt, W, n_resp, &kv) ||
        pdm_nsamp_create(&sp, W, V, n_resp + 1, kv, last_token, &g))
        return -1;
    int n_t = 0;
    double draw = 0;
    for (;;) {
        int32_t in[PDM_NSAMP_MAX];
        pdm_decode_seq_t seqs[PDM_NSAMP_MAX];
        pdm_beam_kv_t *beams[PDM_NSAMP_MAX];
        const int rows = pdm_nsamp_inputs(g, in);
        if (!rows) break;
        for (int b = 0; b < rows; b++) {
            seqs[b] = (pdm_decode_seq_t){pc, in[b], logits + (size_t)b * V};
            beams[b] = kv;
        }
        const int priming = !kv->primed;
        double t0 = pdm_now();
        if (pdm_decode_step_beams(ctx, act, seqs, beams, rows)) return -1;
        double t1 = pdm_now();
        pdm_nsamp_token_t out[PDM_NSAMP_MAX];
        pdm_nsamp_sample(g, logits, out);
        pdm_nsamp_advance(g);
        if (!priming) {
            t[n_t++] = t1 - t0;
            draw += pdm_now() - t1;
        }
    }
    double mean;
    stats(t, n_t, &mean, &r->samp_median);
    r->samp_draw = n_t ? draw / n_t : 0;
    pdm_nsamp_destroy(g);
    pdm_beam_kv_destroy(kv);
    pdm_kv_cache_destroy(pc);
    return 0;
}

static int run_width(pdm_model_ctx_t *ctx, const pdm_kv_cache_t *base, int32_t last_token,
                     int n_prompt, int n_resp, int W, result_t *r)
{
    const pdm_model_t *m = pdm_model_ctx_model(ctx);
    const int V = (int)m->hp.n_vocab;
    pdm_beam_params_t bp;
    pdm_beam_params_default(&bp);
    bp.width = W;
    bp.n_best = 1;
    bp.early_stopping = PDM_BEAM_STOP_NEVER;
    pdm_act_t act;
    float *logits = malloc(sizeof(float) * (size_t)V * W);
    double *t = malloc(sizeof(double) * (size_t)(n_resp + 1));
    double *cpu = malloc(sizeof(double) * (size_t)(n_resp + 1));
    if (!logits || !t || !cpu || pdm_act_alloc(&m->hp, W, &act)) return -1;
    r->width = W;
    r->eq2 = pdm_beam_bytes_standard(&m->hp, base->dtype, W, n_prompt, n_resp);
    r->eq3 = pdm_beam_bytes_segment(&m->hp, base->dtype, W, n_prompt, n_resp);

    /* segmented */
    pdm_kv_cache_t *pc;
    pdm_beam_kv_t *kv;
    pdm_beam_search_t *bs;
    if (pdm_kv_cache_create(&m->hp, n_prompt, base->dtype, &pc)) return -1;
    copy_kv(pc, base, n_prompt);
    if (pdm_beam_kv_create(&m->hp, pc, n_prompt, W, n_resp, &kv) ||
        pdm_beam_search_create(&bp, V, n_resp + 1, NULL, 0, &bs))
        return -1;
    pdm_beam_search_prime(bs, last_token);
    int done = 0, n_t = 0;
    double phases[PDM_DECODE_PHASES] = {0}, advance = 0;
    while (!done) {
        int32_t in[PDM_BEAM_MAX_WIDTH];
        pdm_decode_seq_t seqs[PDM_BEAM_MAX_WIDTH];
        pdm_beam_kv_t *beams[PDM_BEAM_MAX_WIDTH];
        int nl = pdm_beam_search_inputs(bs, in);
        for (int b = 0; b < nl; b++) {
            seqs[b] = (pdm_decode_seq_t){pc, in[b], logits + (size_t)b * V};
            beams[b] = kv;
        }
        const int priming = !kv->primed;
        double ph[PDM_DECODE_PHASES] = {0};
        double c0 = cpu_now(), t0 = pdm_now();
        if (pdm_decode_step_timed(ctx, &act, seqs, beams, nl, ph)) return -1;
        double t1 = pdm_now();
        if (!priming) cpu[n_t] = cpu_now() - c0;
        int parent[PDM_BEAM_MAX_WIDTH], nn;
        done = pdm_beam_search_advance(bs, logits, parent, &nn);
        if (done < 0) return -1;
        if (!done) pdm_beam_kv_reorder(kv, parent, nn);
        if (!priming) {
            t[n_t++] = t1 - t0;
            advance += pdm_now() - t1;
            for (int p = 0; p < PDM_DECODE_PHASES; p++) phases[p] += ph[p];
        }
    }
    double cpu_mean;
    stats(cpu, n_t, &cpu_mean, &r->seg_cpu_median);
    for (int p = 0; p < PDM_DECODE_PHASES; p++) r->seg_phase[p] = n_t ? phases[p] / n_t : 0;
    r->seg_advance = n_t ? advance / n_t : 0;
    r->seg_bytes = pdm_kv_cache_bytes(pc) + kv->bytes;
    stats(t, n_t, &r->seg_mean, &r->seg_median);
    pdm_beam_search_destroy(bs);
    pdm_beam_kv_destroy(kv);
    pdm_kv_cache_destroy(pc);
    if (run_samples(ctx, base, last_token, n_prompt, n_resp, W, &act, logits, t, r)) return -1;

    /* copying: one full cache per beam, reorders copy caches */
    pdm_kv_cache_t *cache[PDM_BEAM_MAX_WIDTH], *next[PDM_BEAM_MAX_WIDTH];
    r->copy_bytes = 0;
    for (int b = 0; b < W; b++) {
        if (pdm_kv_cache_create(&m->hp, n_prompt + n_resp, base->dtype, &cache[b]) ||
            pdm_kv_cache_create(&m->hp, n_prompt + n_resp, base->dtype, &next[b]))
            return -1;
        copy_kv(cache[b], base, n_prompt); /* eq. (2): the prompt once per beam */
        r->copy_bytes += pdm_kv_cache_bytes(cache[b]);
    }
    if (pdm_beam_search_create(&bp, V, n_resp + 1, NULL, 0, &bs)) return -1;
    /* priming: logits of the last prompt token */
    cache[0]->n_tokens = n_prompt - 1;
    pdm_decode_seq_t first = {cache[0], last_token, logits};
    if (pdm_decode_step(ctx, &act, &first, 1)) return -1;
    int parent[PDM_BEAM_MAX_WIDTH], nn;
    done = pdm_beam_search_advance(bs, logits, parent, &nn);
    for (int b = 0; b < nn; b++) copy_kv(next[b], cache[parent[b]], n_prompt);
    for (int b = 0; b < nn; b++) {
        pdm_kv_cache_t *x = cache[b];
        cache[b] = next[b];
        next[b] = x;
    }
    n_t = 0;
    r->copy_bytes_moved = 0;
    while (!done) {
        int32_t in[PDM_BEAM_MAX_WIDTH];
        pdm_decode_seq_t seqs[PDM_BEAM_MAX_WIDTH];
        int nl = pdm_beam_search_inputs(bs, in);
        for (int b = 0; b < nl; b++) seqs[b] = (pdm_decode_seq_t){cache[b], in[b], logits + (size_t)b * V};
        double t0 = pdm_now();
        if (pdm_decode_step(ctx, &act, seqs, nl)) return -1;
        done = pdm_beam_search_advance(bs, logits, parent, &nn);
        if (!done) { /* index select: every beam's cache becomes a copy of its parent's */
            for (int b = 0; b < nn; b++) {
                copy_kv(next[b], cache[parent[b]], cache[parent[b]]->n_tokens);
                r->copy_bytes_moved += (uint64_t)cache[parent[b]]->n_tokens * 2 *
                                       m->hp.n_layers * m->hp.n_kv_heads *
                                       pdm_dtype_row_bytes(base->dtype, m->hp.head_dim);
            }
            for (int b = 0; b < nn; b++) {
                pdm_kv_cache_t *x = cache[b];
                cache[b] = next[b];
                next[b] = x;
            }
        }
        t[n_t++] = pdm_now() - t0;
    }
    stats(t, n_t, &r->copy_mean, &r->copy_median);
    pdm_beam_search_destroy(bs);
    for (int b = 0; b < W; b++) {
        pdm_kv_cache_destroy(cache[b]);
        pdm_kv_cache_destroy(next[b]);
    }
    pdm_act_free(&act);
    free(logits);
    free(t);
    free(cpu);
    return 0;
}

/* The 1, 5 and 15 minute load averages (/proc/loadavg), or "?". */
static void read_load(char *buf, size_t cap)
{
    FILE *f = fopen("/proc/loadavg", "r");
    double a, b, c;
    if (f && fscanf(f, "%lf %lf %lf", &a, &b, &c) == 3) snprintf(buf, cap, "%.2f %.2f %.2f", a, b, c);
    else snprintf(buf, cap, "?");
    if (f) fclose(f);
}

/* The first "model name" of /proc/cpuinfo and the online CPU count, or "?". */
static void read_cpu_model(char *buf, size_t cap)
{
    snprintf(buf, cap, "?");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f) return;
    char line[256];
    while (fgets(line, sizeof(line), f)) {
        char *colon = strchr(line, ':');
        if (strncmp(line, "model name", 10) || !colon) continue;
        colon[strcspn(colon, "\n")] = 0;
        snprintf(buf, cap, "%s, %ld CPUs", colon + 2, sysconf(_SC_NPROCESSORS_ONLN));
        break;
    }
    fclose(f);
}

int main(int argc, char **argv)
{
    const char *model_path = pdm_model_default_path(), *json_path = NULL, *md_path = NULL;
    int n_prompt = 1024, n_resp = 128, threads = 2, quiet = 0, repeat = 1;
    int widths[8] = {1, 2, 4, 8}, n_widths = 4;
    pdm_dtype_t kvt = PDM_DT_F16;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--model") && v) model_path = argv[++i];
        else if (!strcmp(a, "--prompt") && v) n_prompt = atoi(argv[++i]);
        else if (!strcmp(a, "--response") && v) n_resp = atoi(argv[++i]);
        else if (!strcmp(a, "--threads") && v) threads = atoi(argv[++i]);
        else if (!strcmp(a, "--json") && v) json_path = argv[++i];
        else if (!strcmp(a, "--md") && v) md_path = argv[++i];
        else if (!strcmp(a, "--kv-dtype") && v) kvt = !strcmp(argv[++i], "f32") ? PDM_DT_F32 : PDM_DT_F16;
        else if (!strcmp(a, "--quiet-machine")) quiet = 1;
        else if (!strcmp(a, "--repeat") && v) repeat = atoi(argv[++i]);
        else if (!strcmp(a, "--widths") && v) {
            n_widths = 0;
            for (char *s = argv[++i]; *s && n_widths < 8;) {
                char *end;
                long w = strtol(s, &end, 10);
                if (end == s || w < 1 || w > PDM_BEAM_MAX_WIDTH) goto usage;
                widths[n_widths++] = (int)w;
                s = *end == ',' ? end + 1 : end;
            }
        } else goto usage;
    }
    if (n_prompt < 2 || n_resp < 1 || threads < 1 || n_widths < 1 || repeat < 1 || repeat > 64)
        goto usage;
    pdm_model_t *m;
    pdm_model_ctx_t *ctx;
    if (pdm_model_load(model_path, &m) || pdm_model_ctx_create(m, threads, 64, &ctx)) {
        fprintf(stderr, "beam_bench: %s\n", pdm_error_last());
        return 1;
    }
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)n_prompt);
    uint64_t seed = 1234;
    for (int i = 0; i < n_prompt; i++) ids[i] = (int32_t)(3 + pdm_splitmix64(&seed) % (m->hp.n_vocab - 3));
    pdm_kv_cache_t *base;
    if (pdm_kv_cache_create(&m->hp, n_prompt, kvt, &base) ||
        pdm_model_prefill(ctx, base, ids, n_prompt, NULL)) {
        fprintf(stderr, "beam_bench: %s\n", pdm_error_last());
        return 1;
    }
    /* Every width once per round, rounds interleaved so that a load change on a shared
     * machine hits all widths alike; per width the round with the median segmented step is
     * reported, and the median over rounds of the n-samples step. */
    char load_before[64], load_after[64], cpu[128];
    read_load(load_before, sizeof(load_before));
    read_cpu_model(cpu, sizeof(cpu));
    result_t res[8], *rounds = calloc((size_t)repeat * n_widths, sizeof(result_t));
    if (!rounds) return 1;
    for (int rd = 0; rd < repeat; rd++)
        for (int w = 0; w < n_widths; w++)
            if (run_width(ctx, base, ids[n_prompt - 1], n_prompt, n_resp, widths[w],
                          &rounds[rd * n_widths + w])) {
                fprintf(stderr, "beam_bench: width %d: %s\n", widths[w], pdm_error_last());
                return 1;
            }
    read_load(load_after, sizeof(load_after));
    for (int w = 0; w < n_widths; w++) {
        double seg[64], samp[64], cpus[64];
        for (int rd = 0; rd < repeat; rd++) {
            seg[rd] = rounds[rd * n_widths + w].seg_median;
            samp[rd] = rounds[rd * n_widths + w].samp_median;
            cpus[rd] = rounds[rd * n_widths + w].seg_cpu_median;
        }
        double mean, seg_mid, samp_mid, cpu_mid;
        stats(seg, repeat, &mean, &seg_mid);
        stats(samp, repeat, &mean, &samp_mid);
        stats(cpus, repeat, &mean, &cpu_mid);
        res[w] = rounds[w];
        for (int rd = 0; rd < repeat; rd++)
            if (rounds[rd * n_widths + w].seg_median == seg[repeat / 2]) res[w] = rounds[rd * n_widths + w];
        res[w].samp_median = samp_mid;
        res[w].seg_cpu_median = cpu_mid;
        fprintf(stderr, "width %d: segmented %.2f ms/step (median %.2f), copying %.2f ms/step, "
                "memory %.1f MiB (eq.3 %.1f) vs %.1f MiB (eq.2 %.1f)\n", widths[w],
                res[w].seg_mean * 1e3, res[w].seg_median * 1e3, res[w].copy_mean * 1e3,
                res[w].seg_bytes / 1048576.0, res[w].eq3 / 1048576.0,
                res[w].copy_bytes / 1048576.0, res[w].eq2 / 1048576.0);
        fprintf(stderr, "  segmented phases ms/step:");
        for (int p = 0; p < PDM_DECODE_PHASES; p++)
            fprintf(stderr, " %s %.2f", pdm_decode_phase_names[p], res[w].seg_phase[p] * 1e3);
        fprintf(stderr, ", search advance %.2f; step CPU median %.2f ms\n",
                res[w].seg_advance * 1e3, res[w].seg_cpu_median * 1e3);
        fprintf(stderr, "  n = %d samples: step median %.2f ms, draws %.2f ms/step\n",
                widths[w], res[w].samp_median * 1e3, res[w].samp_draw * 1e3);
    }
    const char *note = quiet ? "quiet machine" : "noisy, shared machine";
    FILE *f = json_path ? fopen(json_path, "w") : stdout;
    if (!f) return 1;
    fprintf(f, "{\n  \"bench\": \"decode-memory-beam\",\n  \"model\": \"%s\",\n  \"n_layers\": %u, "
            "\"n_kv_heads\": %u, \"head_dim\": %u,\n  \"kv_dtype\": \"%s\",\n  \"n_prompt\": %d,\n"
            "  \"n_response\": %d,\n  \"threads\": %d,\n  \"note\": \"%s\",\n  \"cpu\": \"%s\",\n"
            "  \"loadavg_before\": \"%s\",\n  \"loadavg_after\": \"%s\",\n  \"rounds\": %d,\n"
            "  \"widths\": [\n",
            model_path, m->hp.n_layers, m->hp.n_kv_heads, m->hp.head_dim, pdm_dtype_name(kvt),
            n_prompt, n_resp, threads, note, cpu, load_before, load_after, repeat);
    for (int w = 0; w < n_widths; w++)
        fprintf(f, "    {\"width\": %d, \"eq2_bytes\": %zu, \"eq3_bytes\": %zu, "
                "\"segmented_allocated_bytes\": %zu, \"copying_allocated_bytes\": %zu, "
                "\"segmented_step_ms_mean\": %.3f, \"segmented_step_ms_median\": %.3f, "
                "\"copying_step_ms_mean\": %.3f, \"copying_step_ms_median\": %.3f, "
                "\"copying_kv_bytes_moved\": %llu, \"segmented_kv_bytes_moved\": 0, "
                "\"segmented_step_cpu_ms_median\": %.3f, \"samples_step_ms_median\": %.3f, \"samples_draw_ms_mean\": %.3f, "
                "\"segmented_phase_ms\": {\"attn_in\": %.3f, \"attention\": %.3f, "
                "\"attn_out_ffn\": %.3f, \"logits\": %.3f}, \"search_advance_ms\": %.3f}%s\n",
                res[w].width, res[w].eq2, res[w].eq3, res[w].seg_bytes, res[w].copy_bytes,
                res[w].seg_mean * 1e3, res[w].seg_median * 1e3, res[w].copy_mean * 1e3,
                res[w].copy_median * 1e3, (unsigned long long)res[w].copy_bytes_moved,
                res[w].seg_cpu_median * 1e3, res[w].samp_median * 1e3, res[w].samp_draw * 1e3,
                res[w].seg_phase[PDM_DECODE_PH_ATTN_IN] * 1e3,
                res[w].seg_phase[PDM_DECODE_PH_ATTN] * 1e3,
                res[w].seg_phase[PDM_DECODE_PH_FFN] * 1e3,
                res[w].seg_phase[PDM_DECODE_PH_LOGITS] * 1e3, res[w].seg_advance * 1e3,
                w + 1 < n_widths ? "," : "");
    fprintf(f, "  ]\n}\n");
    if (json_path) fclose(f);
    if (md_path && (f = fopen(md_path, "w"))) {
        fprintf(f, "# Beam search: KV memory and next-token latency (%s)\n\n", note);
        fprintf(f, "Model `%s` (%u layers, %u KV heads x %u dims), KV %s, prompt %d tokens, "
                "response %d steps, %d threads. Produced by `make bench-decode-memory-beam` "
                "(bench/decode-memory/beam_bench.c). CPU: %s; load average (1/5/15 min) %s before, "
                "%s after; per width the median of %d interleaved round(s). Where the time "
                "goes and why width 4 is not yet <= 1.2x: docs/perf/decode-width-cost.md.\n\n",
                model_path, m->hp.n_layers, m->hp.n_kv_heads, m->hp.head_dim,
                pdm_dtype_name(kvt), n_prompt, n_resp, threads, cpu, load_before, load_after,
                repeat);
        fprintf(f, "| beams | eq. (2) MiB | eq. (3) MiB | segmented allocated MiB | copying "
                "allocated MiB | segmented ms/token (mean / median) | copying ms/token (mean / "
                "median) | KV copied by reorders, copying (MiB) |\n|---|---|---|---|---|---|---|---|\n");
        for (int w = 0; w < n_widths; w++)
            fprintf(f, "| %d | %.2f | %.2f | %.2f | %.2f | %.1f / %.1f | %.1f / %.1f | %.0f |\n",
                    res[w].width, res[w].eq2 / 1048576.0, res[w].eq3 / 1048576.0,
                    res[w].seg_bytes / 1048576.0, res[w].copy_bytes / 1048576.0,
                    res[w].seg_mean * 1e3, res[w].seg_median * 1e3, res[w].copy_mean * 1e3,
                    res[w].copy_median * 1e3, res[w].copy_bytes_moved / 1048576.0);
        fprintf(f, "\nWhere a segmented step's time goes (mean ms per step; the search's advance "
                "is outside the step), and n = width independent samples (decode_node/nsamp.h, "
                "temperature 0.8) over the same cache. Ratio = median step / width 1's median "
                "step. Step CPU = the process's CPU time per step, which a busy machine's "
                "time-slicing does not inflate (wall time does).\n\n| width / n | norm+QKV | "
                "attention (KV store, prompt + response) | Wo + FFN | logits | beam advance | "
                "beams: step median (ratio) | beams: step CPU median (ratio) | samples: step "
                "median (ratio) | samples: draws |\n|---|---|---|---|---|---|---|---|---|---|\n");
        for (int w = 0; w < n_widths; w++)
            fprintf(f, "| %d | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f (%.2fx) | %.2f (%.2fx) | "
                    "%.2f (%.2fx) | %.2f |\n", res[w].width,
                    res[w].seg_phase[PDM_DECODE_PH_ATTN_IN] * 1e3,
                    res[w].seg_phase[PDM_DECODE_PH_ATTN] * 1e3,
                    res[w].seg_phase[PDM_DECODE_PH_FFN] * 1e3,
                    res[w].seg_phase[PDM_DECODE_PH_LOGITS] * 1e3, res[w].seg_advance * 1e3,
                    res[w].seg_median * 1e3, res[w].seg_median / res[0].seg_median,
                    res[w].seg_cpu_median * 1e3, res[w].seg_cpu_median / res[0].seg_cpu_median,
                    res[w].samp_median * 1e3, res[w].samp_median / res[0].samp_median,
                    res[w].samp_draw * 1e3);
        fclose(f);
    }
    pdm_kv_cache_destroy(base);
    free(rounds);
    free(ids);
    pdm_model_ctx_destroy(ctx);
    pdm_model_free(m);
    return 0;
usage:
    fprintf(stderr, "usage: beam_bench [--model PATH] [--prompt N] [--response N] [--threads N]\n"
                    "                  [--widths 1,2,4,8] [--kv-dtype f16|f32] [--json FILE] "
                    "[--md FILE] [--quiet-machine] [--repeat R]\n");
    return 2;
}
