/*
 * pdm_matmul_bench.c - one weight matrix type through one kernel variant: the matrix-vector
 * product from DRAM (decode) and the matrix-matrix product in the engine's 32-row chunks
 * (prefill), best and median of repeated runs. Prints one JSON object.
 *
 *   pdm-matmul-bench --type T [--rows R] [--cols C] [--tokens N] [--kernels NAME] [--iters K]
 *                    [--repack 0|1]
 *
 * --repack 1 computes on the layout the loader repacks the type into (pdm_kern_repack), as the
 * engine does by default; 0 (default) on the file's layout.
 *
 * The matrix is copied enough times to exceed 256 MiB and the runs cycle through the copies,
 * so that a matrix-vector product reads its weights from DRAM as in a real decode step (the
 * weights of a whole model do not fit in cache). Activation conversion is included. Reports
 * only: nothing passes or fails on timing.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/kernels.h"

static double pdm__now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int pdm__cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
    const char *tname = NULL, *kernels = NULL;
    int rows = 8192, cols = 2048, n_tok = 1, iters = 0, repack = 0;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--type")) tname = argv[i + 1];
        else if (!strcmp(argv[i], "--rows")) rows = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--cols")) cols = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--tokens")) n_tok = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--kernels")) kernels = argv[i + 1];
        else if (!strcmp(argv[i], "--iters")) iters = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--repack")) repack = atoi(argv[i + 1]);
        else {
            fprintf(stderr, "unknown option %s\n", argv[i]);
            return 2;
        }
    }
    const int type = tname ? pdm_dtype_from_name(tname) : -1;
    const size_t rb = type >= 0 ? pdm_dtype_row_bytes((pdm_dtype_t)type, cols) : 0;
    if (type < 0 || !pdm_dtype_is_weight((pdm_dtype_t)type) || rb == 0 || rows < 1 || n_tok < 1) {
        fprintf(stderr,
                "usage: %s --type T [--rows R] [--cols C] [--tokens N] [--kernels NAME] "
                "[--iters K] [--repack 0|1]\n",
                argv[0]);
        return 2;
    }
    const pdm_kern_ops_t *ops = kernels ? pdm_kern_ops_find(kernels) : pdm_kern_ops_get();
    if (!ops) {
        fprintf(stderr, "kernel variant %s is not available\n", kernels);
        return 1;
    }
    if (iters <= 0) iters = n_tok == 1 ? 200 : 20;
    const size_t mat_bytes = rb * (size_t)rows;
    const int copies = (int)((256u << 20) / mat_bytes) + 1;
    char *w = malloc(mat_bytes * (size_t)copies);
    float *row = malloc((size_t)cols * sizeof(float));
    float *x = malloc((size_t)n_tok * cols * sizeof(float));
    float *y = malloc((size_t)n_tok * rows * sizeof(float));
    double *times = malloc((size_t)iters * sizeof(double));
    size_t ab = ops->act_bytes((pdm_dtype_t)type, cols, n_tok);
    void *act = malloc(ab ? ab : 1);
    if (!w || !row || !x || !y || !times || !act) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    uint64_t s = 0x9e3779b97f4a7c15ull;
#define PDM__RAND()                                             \
    ((s = s * 6364136223846793005ull + 1442695040888963407ull), \
     (float)((double)(s >> 11) * 0x1.0p-53 * 2.0 - 1.0))
    for (int r = 0; r < rows; r++) {
        for (int c = 0; c < cols; c++) row[c] = PDM__RAND();
        pdm_quantize_row((pdm_dtype_t)type, row, w + (size_t)r * rb, cols);
    }
    for (int k = 1; k < copies; k++) memcpy(w + mat_bytes * (size_t)k, w, mat_bytes);
    for (size_t i = 0; i < (size_t)n_tok * cols; i++) x[i] = PDM__RAND();
#undef PDM__RAND
    pdm_kern_mat_t m = {.type = (pdm_dtype_t)type, .rows = rows, .cols = cols, .row_bytes = rb};
    size_t stride = mat_bytes; /* bytes between the copies */
    if (repack) {
        m.data = w;
        const size_t pb = pdm_kern_repack_bytes(&m);
        if (!pb) {
            fprintf(stderr, "type %s has no repacked layout\n", tname);
            return 2;
        }
        stride = (pb + 63) / 64 * 64;
        char *packed = aligned_alloc(64, stride * (size_t)copies);
        if (!packed) {
            fprintf(stderr, "out of memory\n");
            return 1;
        }
        pdm_kern_mat_t mp;
        pdm_kern_repack(&m, packed, &mp);
        for (int k = 1; k < copies; k++) memcpy(packed + stride * (size_t)k, packed, pb);
        free(w);
        w = packed;
        m = mp;
    }
    for (int it = 0; it < iters; it++) {
        m.data = w + stride * (size_t)(it % copies);
        double t0 = pdm__now();
        if (ab) ops->act_convert((pdm_dtype_t)type, x, cols, 0, n_tok, act);
        for (int r = 0; r < rows; r += 32) /* the engine's chunks (model/forward.c) */
            ops->matmul(&m, ab ? act : x, n_tok, y, rows, r, r + 32 < rows ? r + 32 : rows);
        times[it] = pdm__now() - t0;
    }
    qsort(times, (size_t)iters, sizeof(double), pdm__cmp);
    const double best = times[0], med = times[iters / 2];
    const double macs = (double)rows * cols * n_tok;
    printf("{\"kernels\": \"%s\", \"type\": \"%s\", \"rows\": %d, \"cols\": %d, \"tokens\": %d, "
           "\"repack\": %d, \"iters\": %d, \"best_ms\": %.4f, \"median_ms\": %.4f, "
           "\"best_gb_s\": %.2f, "
           "\"best_gmac_s\": %.2f, \"median_gmac_s\": %.2f}\n",
           ops->name, pdm_dtype_name((pdm_dtype_t)type), rows, cols, n_tok, repack, iters,
           best * 1e3, med * 1e3, (double)mat_bytes / best / 1e9, macs / best / 1e9,
           macs / med / 1e9);
    free(w);
    free(row);
    free(x);
    free(y);
    free(times);
    free(act);
    return 0;
}
