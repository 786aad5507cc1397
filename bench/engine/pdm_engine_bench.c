/*
 * pdm_engine_bench.c - times pdmesh's single-process prefill and decode on a real model.
 *
 *   pdm-engine-bench --model M.gguf --threads N --prompt P [--decode D] [--reps R]
 *                    [--batch B] [--kernels NAME]
 *
 * For each repetition: a fresh f16 KV cache, prefill of P pseudo-random token ids (fixed
 * seed, ids drawn from the vocabulary excluding the first 100 special-ish ids), then D decode
 * steps (greedy over the logits) at context P. Prints one JSON object on stdout with the
 * median and all samples of prefill and decode tokens/s and the process's peak RSS. Reports
 * only; never fails on timing.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include "model/model.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof(double), cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static void print_samples(const char *name, const double *v, int n)
{
    printf("\"%s\": [", name);
    for (int i = 0; i < n; i++) printf("%s%.3f", i ? ", " : "", v[i]);
    printf("]");
}

int main(int argc, char **argv)
{
    const char *model_path = NULL, *kernels = NULL;
    int threads = 1, prompt = 512, decode = 0, reps = 3, batch = 512;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--model")) model_path = argv[i + 1];
        else if (!strcmp(argv[i], "--threads")) threads = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--prompt")) prompt = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--decode")) decode = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--reps")) reps = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--batch")) batch = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--kernels")) kernels = argv[i + 1];
        else {
            fprintf(stderr, "unknown option %s\n", argv[i]);
            return 2;
        }
    }
    if (!model_path || threads < 1 || prompt < 1 || decode < 0 || reps < 1 || reps > 100 ||
        batch < 1) {
        fprintf(stderr, "usage: %s --model M --threads N --prompt P [--decode D] [--reps R] "
                        "[--batch B] [--kernels NAME]\n", argv[0]);
        return 2;
    }
    pdm_model_t *m = NULL;
    if (pdm_model_load(model_path, &m) != PDM_OK) {
        fprintf(stderr, "bench: %s\n", pdm_error_last());
        return 1;
    }
    pdm_model_ctx_t *ctx = NULL;
    if (pdm_model_ctx_create(m, threads, batch, &ctx) != PDM_OK) {
        fprintf(stderr, "bench: %s\n", pdm_error_last());
        return 1;
    }
    if (kernels) {
        const pdm_kern_ops_t *ops = pdm_kern_ops_find(kernels);
        if (!ops) {
            fprintf(stderr, "bench: kernel variant %s is not available\n", kernels);
            return 1;
        }
        pdm_model_ctx_set_ops(ctx, ops);
    }
    int32_t *tokens = malloc((size_t)prompt * sizeof(int32_t));
    float *logits = malloc(m->hp.n_vocab * sizeof(float));
    double *pf = calloc((size_t)reps, sizeof(double)), *dc = calloc((size_t)reps, sizeof(double));
    uint64_t s = 0x9e3779b97f4a7c15ull;
    for (int i = 0; i < prompt; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        tokens[i] = 100 + (int32_t)((s >> 33) % (m->hp.n_vocab - 100));
    }
    for (int r = 0; r < reps; r++) {
        pdm_kv_cache_t *cache = NULL;
        if (pdm_kv_cache_create(&m->hp, prompt + decode + 1, PDM_DT_F16, &cache) != PDM_OK) {
            fprintf(stderr, "bench: %s\n", pdm_error_last());
            return 1;
        }
        double t0 = now_s();
        if (pdm_model_prefill(ctx, cache, tokens, prompt, logits) != PDM_OK) {
            fprintf(stderr, "bench: %s\n", pdm_error_last());
            return 1;
        }
        double t1 = now_s();
        pf[r] = prompt / (t1 - t0);
        for (int i = 0; i < decode; i++) {
            int32_t best = 0;
            for (uint32_t v = 1; v < m->hp.n_vocab; v++)
                if (logits[v] > logits[best]) best = (int32_t)v;
            pdm_model_decode(ctx, cache, best, logits);
        }
        double t2 = now_s();
        dc[r] = decode ? decode / (t2 - t1) : 0.0;
        pdm_kv_cache_destroy(cache);
    }
    /* Model sizes for the roofline: multiply-adds per token in the layer matrices and the
     * bytes a decode step must read (layer matrices + output matrix). */
    double layer_params = 0.0, weight_bytes = 0.0;
    for (uint32_t l = 0; l < m->hp.n_layers; l++) {
        const pdm_kern_mat_t *mats[] = {&m->layers[l].wq, &m->layers[l].wk, &m->layers[l].wv,
                                        &m->layers[l].wo, &m->layers[l].w_gate,
                                        &m->layers[l].w_up, &m->layers[l].w_down};
        for (int k = 0; k < 7; k++) {
            layer_params += (double)mats[k]->rows * (double)mats[k]->cols;
            weight_bytes += (double)mats[k]->rows * (double)mats[k]->row_bytes;
        }
    }
    weight_bytes += (double)m->output.rows * (double)m->output.row_bytes;
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    printf("{\"engine\": \"pdmesh\", \"kernels\": \"%s\", \"threads\": %d, \"prompt\": %d, "
           "\"decode\": %d, \"batch\": %d, ",
           pdm_model_ctx_ops(ctx)->name, threads, prompt, decode, batch);
    print_samples("prefill_samples", pf, reps);
    printf(", ");
    print_samples("decode_samples", dc, reps);
    double pm = median(pf, reps), dm = decode ? median(dc, reps) : 0.0;
    printf(", \"prefill_tok_s\": %.3f, \"decode_tok_s\": %.3f, \"peak_rss_mb\": %.1f, "
           "\"layer_params\": %.0f, \"output_params\": %.0f, \"weight_bytes\": %.0f, "
           "\"n_layers\": %u, \"n_heads\": %u, \"n_kv_heads\": %u, \"head_dim\": %u}\n",
           pm, dm, (double)ru.ru_maxrss / 1024.0, layer_params,
           (double)m->output.rows * (double)m->output.cols, weight_bytes, m->hp.n_layers,
           m->hp.n_heads, m->hp.n_kv_heads, m->hp.head_dim);
    free(tokens);
    free(logits);
    free(pf);
    free(dc);
    pdm_model_ctx_destroy(ctx);
    pdm_model_free(m);
    return 0;
}
