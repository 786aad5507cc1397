/*
 * prefill_seqs_bench.c - what one batch of several prompts costs the engine against the same
 * prompts prefilled one after another (model.h: pdm_model_prefill_seqs vs pdm_model_prefill
 * in chunks of up to 512 tokens, as a prefill rank runs them). Reports process CPU seconds,
 * which a loaded, shared machine distorts far less than wall time.
 *
 *   pdm-prefill-seqs-bench MODEL TOKENS_PER_PROMPT N_PROMPTS [THREADS [REPEATS]]
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "common/pdm.h"
#include "model/model.h"

static double cpu_seconds(void)
{
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    long len, n, threads = 1, repeats = 3;
    if (argc < 4 || pdm_parse_long(argv[2], 1, 4096, &len) ||
        pdm_parse_long(argv[3], 1, PDM_MODEL_MAX_SEQS, &n) ||
        (argc > 4 && pdm_parse_long(argv[4], 1, 256, &threads)) ||
        (argc > 5 && pdm_parse_long(argv[5], 1, 100, &repeats))) {
        fprintf(stderr, "usage: %s MODEL TOKENS_PER_PROMPT(1..4096) N_PROMPTS(1..%d) "
                "[THREADS [REPEATS]]\n", argv[0], PDM_MODEL_MAX_SEQS);
        return 2;
    }
    pdm_model_t *m = NULL;
    if (pdm_model_load(argv[1], &m)) {
        fprintf(stderr, "%s\n", pdm_error_last());
        return 1;
    }
    const pdm_model_hparams_t *hp = &m->hp;
    const int total = (int)(len * n);
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)total);
    float *logits = malloc(sizeof(float) * hp->n_vocab * (size_t)n);
    pdm_kv_cache_t **cache = calloc((size_t)n, sizeof(*cache));
    pdm_model_seq_t *seqs = calloc((size_t)n, sizeof(*seqs));
    pdm_model_ctx_t *one = NULL, *all = NULL;
    pdm_act_t act = {0};
    int st = !tok || !logits || !cache || !seqs ? PDM_ENOMEM : PDM_OK;
    for (int i = 0; i < total && !st; i++) /* distinct prompts, no shared prefix */
        tok[i] = (int32_t)(((uint32_t)i * 2654435761u >> 7) % hp->n_vocab);
    for (int s = 0; s < n && !st; s++) st = pdm_kv_cache_create(hp, (int)len, PDM_DT_F16, &cache[s]);
    if (!st) st = pdm_model_ctx_create(m, (int)threads, (int)PDM_MIN(len, 512), &one);
    if (!st) st = pdm_model_ctx_create(m, (int)threads, total, &all);
    if (!st) st = pdm_act_alloc(hp, total, &act);
    if (!st) {
        pdm_model_ctx_set_split_single(one, 0);
        pdm_model_ctx_set_split_single(all, 0);
    }
    printf("{\"tokens_per_prompt\": %ld, \"prompts\": %ld, \"threads\": %ld, \"runs\": [", len, n,
           threads);
    for (long r = 0; r < repeats && !st; r++) {
        double t0 = cpu_seconds();
        for (int s = 0; s < n && !st; s++) {
            cache[s]->n_tokens = 0;
            st = pdm_model_prefill(one, cache[s], tok + (size_t)s * len, (int)len,
                                   logits + (size_t)s * hp->n_vocab);
        }
        double t1 = cpu_seconds();
        for (int s = 0; s < n; s++) {
            cache[s]->n_tokens = 0;
            seqs[s] = (pdm_model_seq_t){tok + (size_t)s * len, (int)len, cache[s],
                                        logits + (size_t)s * hp->n_vocab};
        }
        if (!st) st = pdm_model_prefill_seqs(all, &act, seqs, (int)n, NULL, NULL);
        double t2 = cpu_seconds();
        printf("%s{\"one_by_one_cpu_s\": %.4f, \"batch_cpu_s\": %.4f}", r ? ", " : "", t1 - t0,
               t2 - t1);
    }
    printf("]}\n");
    if (st) fprintf(stderr, "%s\n", pdm_error_last());
    pdm_act_free(&act);
    pdm_model_ctx_destroy(all);
    pdm_model_ctx_destroy(one);
    for (int s = 0; s < n && cache; s++) pdm_kv_cache_destroy(cache[s]);
    free(seqs);
    free(cache);
    free(logits);
    free(tok);
    pdm_model_free(m);
    return st ? 1 : 0;
}
