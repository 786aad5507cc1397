/*
 * kv_cache.c - the head-major KV cache: one contiguous [capacity][head_dim] array of K and
 * one of V per (layer, kv head), carved from a single allocation.
 */
#include "model.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

/* Storage from this size up is mapped from the kernel directly rather than malloc'd. A decode
 * node creates and destroys a cache per request (MBs each, sizes all different); through
 * malloc, glibc's dynamic mmap threshold rises to the largest cache freed so far, later caches
 * come from its heap, and the heap cannot return the holes they leave: the node's RSS crept up
 * by hundreds of MB over rounds of cancelled streams while the memory in use stayed flat
 * (issue 18 item 7; docs/troubleshooting.md). A mapping goes back to the kernel when the cache
 * is destroyed. Small caches (tests, short contexts) stay on malloc, where ASan watches them. */
#define PDM__KV_MMAP_MIN ((size_t)1 << 20)

/* Bytes of one head array of `rows` rows, cache-line aligned. */
static int pdm__head_bytes(const pdm_model_hparams_t *hp, int32_t rows, pdm_dtype_t dtype,
                           size_t *out)
{
    size_t b;
    if (pdm_size_mul((size_t)rows * hp->head_dim, pdm_dtype_row_bytes(dtype, 1), &b) ||
        b > SIZE_MAX / 4)
        return 1;
    *out = (b + 63) & ~(size_t)63; /* keep every head array cache-line aligned */
    return 0;
}

int pdm_kv_cache_layout(const pdm_model_hparams_t *hp, const pdm_kv_cache_params_t *p,
                        pdm_kv_cache_layout_t *out)
{
    if (p->capacity < 1 ||
        (p->dtype != PDM_DT_F32 && p->dtype != PDM_DT_F16 && p->dtype != PDM_DT_I8))
        return pdm_error_set(PDM_EINVAL, "KV cache: invalid capacity %d or dtype %s",
                             p->capacity, pdm_dtype_name(p->dtype));
    if (p->window_reserve != 0 && !(p->window_reserve >= 1.5 && p->window_reserve <= 8))
        return pdm_error_set(PDM_EINVAL, "KV cache: window reserve %g (1.5 to 8, or 0: off)",
                             p->window_reserve);
    pdm_kv_cache_layout_t l = {.full_rows = p->capacity, .n_full = hp->n_layers};
    int32_t window = 0; /* S: the largest local window */
    uint32_t n_local = 0;
    for (uint32_t i = 0; p->model && p->window_reserve > 0 && i < hp->n_layers; i++)
        if (p->model->layers[i].window > 0) {
            window = PDM_MAX(window, p->model->layers[i].window);
            n_local++;
        }
    if (n_local && window >= 2) {
        /* Qualcomm note, "KV cache buffer management optimizations" (c), (d): r(S-1) rows,
         * and at least S so that a decode step (S - 1 kept + 1 new) fits. */
        int64_t rows = (int64_t)ceil(p->window_reserve * (window - 1));
        rows = PDM_MAX(rows, window);
        if (rows < p->capacity) {
            l.win_rows = (int32_t)rows;
            l.win_keep = window - 1;
            l.n_windowed = n_local;
            l.n_full = hp->n_layers - n_local;
        }
    }
    size_t full_head, win_head = 0;
    if (pdm__head_bytes(hp, l.full_rows, p->dtype, &full_head) ||
        (l.win_rows && pdm__head_bytes(hp, l.win_rows, p->dtype, &win_head)) ||
        pdm_size_mul(full_head, 2 * (size_t)l.n_full * hp->n_kv_heads, &l.full_bytes) ||
        pdm_size_mul(win_head, 2 * (size_t)l.n_windowed * hp->n_kv_heads, &l.win_bytes) ||
        l.full_bytes > SIZE_MAX - l.win_bytes)
        return pdm_error_set(PDM_EOVERFLOW, "KV cache: %d tokens overflow the address space",
                             p->capacity);
    *out = l;
    return PDM_OK;
}

int pdm_kv_cache_create(const pdm_model_hparams_t *hp, int32_t capacity, pdm_dtype_t dtype,
                        pdm_kv_cache_t **out)
{
    const pdm_kv_cache_params_t p = {.capacity = capacity, .dtype = dtype};
    return pdm_kv_cache_create_params(hp, &p, out);
}

int pdm_kv_cache_create_params(const pdm_model_hparams_t *hp, const pdm_kv_cache_params_t *p,
                               pdm_kv_cache_t **out)
{
    pdm_kv_cache_layout_t lay;
    int st = pdm_kv_cache_layout(hp, p, &lay);
    if (st) return st;
    const size_t n_arrays = (size_t)hp->n_layers * hp->n_kv_heads;
    const size_t total = lay.full_bytes + lay.win_bytes;
    size_t full_head = 0, win_head = 0;
    pdm__head_bytes(hp, lay.full_rows, p->dtype, &full_head);
    if (lay.win_rows) pdm__head_bytes(hp, lay.win_rows, p->dtype, &win_head);

    pdm_kv_cache_t *c = calloc(1, sizeof(*c));
    if (!c) goto err_nomem;
    c->k = calloc(n_arrays, sizeof(void *));
    c->v = calloc(n_arrays, sizeof(void *));
    c->scale = malloc(2 * n_arrays * sizeof(float));
    if (!c->k || !c->v || !c->scale) goto err_arrays;
    if (lay.win_rows && !(c->windowed = calloc(hp->n_layers, 1))) goto err_arrays;
    for (size_t i = 0; i < 2 * n_arrays; i++) c->scale[i] = 1.0f;
    if (total >= PDM__KV_MMAP_MIN) {
        void *m = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) goto err_arrays;
        c->storage = m; /* page-aligned, zero-filled */
        c->storage_bytes = total;
    } else if (!(c->storage = aligned_alloc(64, total))) {
        goto err_arrays;
    }
    c->n_layers = hp->n_layers;
    c->n_kv_heads = hp->n_kv_heads;
    c->head_dim = hp->head_dim;
    c->capacity = p->capacity;
    c->dtype = p->dtype;
    c->win_keep = lay.win_keep;
    c->win_rows = lay.win_rows;
    char *at = c->storage;
    for (uint32_t l = 0; l < hp->n_layers; l++) {
        const int win = lay.win_rows && p->model->layers[l].window > 0;
        if (c->windowed) c->windowed[l] = (uint8_t)win;
        const size_t hb = win ? win_head : full_head;
        for (uint32_t h = 0; h < hp->n_kv_heads; h++) {
            c->k[l * hp->n_kv_heads + h] = at;
            c->v[l * hp->n_kv_heads + h] = at + hb;
            at += 2 * hb;
        }
    }
    *out = c;
    return PDM_OK;

err_arrays:
    free(c->windowed);
    free(c->scale);
    free(c->k);
    free(c->v);
    free(c);
err_nomem:
    return pdm_error_set(PDM_ENOMEM, "KV cache: cannot allocate %zu bytes for %d tokens", total,
                         p->capacity);
}

void pdm_kv_cache_destroy(pdm_kv_cache_t *c)
{
    if (!c) return;
    if (c->storage_bytes) munmap(c->storage, c->storage_bytes);
    else free(c->storage);
    free(c->windowed);
    free(c->scale);
    free(c->k);
    free(c->v);
    free(c);
}

void pdm_kv_cache_clear(pdm_kv_cache_t *c)
{
    c->n_tokens = 0;
    c->pos0 = 0;
    c->win_first = 0;
    c->scales_fixed = 0; /* q8: the next prompt fixes its own scales */
}

size_t pdm_kv_cache_bytes(const pdm_kv_cache_t *c)
{
    size_t full = 0, win = 0;
    const size_t row = (size_t)c->head_dim * pdm_dtype_row_bytes(c->dtype, 1);
    for (uint32_t l = 0; l < c->n_layers; l++) {
        if (c->windowed && c->windowed[l]) win += (size_t)c->win_rows * row;
        else full += (size_t)c->capacity * row;
    }
    return (full + win) * 2 * c->n_kv_heads;
}

int32_t pdm_kv_cache_append_max(const pdm_kv_cache_t *c)
{
    int32_t free_slots = c->capacity - c->n_tokens;
    if (!c->windowed) return free_slots;
    return PDM_MIN(free_slots, c->win_rows - c->win_keep);
}

void pdm_kv_cache_move_rows(pdm_kv_cache_t *c, int32_t from, int32_t to, int32_t n)
{
    const size_t row = pdm_dtype_row_bytes(c->dtype, c->head_dim);
    for (uint32_t l = 0; l < c->n_layers; l++) {
        if (c->windowed && !c->windowed[l]) continue;
        for (uint32_t h = 0; h < c->n_kv_heads; h++) {
            char *k = pdm_kv_cache_k(c, l, h), *v = pdm_kv_cache_v(c, l, h);
            memmove(k + (size_t)to * row, k + (size_t)from * row, (size_t)n * row);
            memmove(v + (size_t)to * row, v + (size_t)from * row, (size_t)n * row);
            c->win_bytes_moved += 2 * (uint64_t)n * row;
        }
    }
    c->win_copies++;
}

int pdm_kv_cache_room(pdm_kv_cache_t *c, int32_t n)
{
    if (n < 0 || n > pdm_kv_cache_append_max(c))
        return pdm_error_set(PDM_EOVERFLOW, "KV cache: %d more tokens do not fit (%d of %d "
                             "slots used, at most %d per append)", n, c->n_tokens, c->capacity,
                             pdm_kv_cache_append_max(c));
    if (!c->windowed || c->n_tokens + n - c->win_first <= c->win_rows) return PDM_OK;
    /* The note's one copy: the kept rows (the last S - 1 slots) go back to row 0. */
    const int32_t keep_from = PDM_MAX(c->win_first, c->n_tokens - c->win_keep);
    const int32_t kept = c->n_tokens - keep_from;
    if (kept > 0) pdm_kv_cache_move_rows(c, keep_from - c->win_first, 0, kept);
    c->win_first = keep_from;
    return PDM_OK;
}

void pdm_kv_cache_window_fill(pdm_kv_cache_t *c, void *const *stage_k, void *const *stage_v,
                              int32_t n_prompt)
{
    if (!c->windowed) return;
    const size_t row = pdm_dtype_row_bytes(c->dtype, c->head_dim);
    const int32_t first = PDM_MAX(0, n_prompt - c->win_keep);
    for (uint32_t l = 0; l < c->n_layers; l++) {
        if (!c->windowed[l]) continue;
        for (uint32_t h = 0; h < c->n_kv_heads; h++) {
            const size_t i = (size_t)l * c->n_kv_heads + h;
            memcpy(c->k[i], (const char *)stage_k[i] + first * row,
                   (size_t)(n_prompt - first) * row);
            memcpy(c->v[i], (const char *)stage_v[i] + first * row,
                   (size_t)(n_prompt - first) * row);
        }
    }
    c->win_first = first;
}

void pdm_kv_cache_view(const pdm_kv_cache_t *c, uint32_t layer, int32_t start, int32_t n,
                       pdm_kv_view_t *out)
{
    const int32_t row0 = pdm_kv_cache_row0(c, layer);
    if (start < row0) { /* a windowed layer no longer holds the slots before row0 */
        n = PDM_MAX(0, n - (row0 - start));
        start = row0;
    }
    size_t off = (size_t)(start - row0) * c->head_dim * pdm_dtype_row_bytes(c->dtype, 1);
    for (uint32_t h = 0; h < c->n_kv_heads; h++) {
        out->k[h] = (const char *)pdm_kv_cache_k(c, layer, h) + off;
        out->v[h] = (const char *)pdm_kv_cache_v(c, layer, h) + off;
        out->k_scale[h] = c->scale[2 * ((size_t)layer * c->n_kv_heads + h)];
        out->v_scale[h] = c->scale[2 * ((size_t)layer * c->n_kv_heads + h) + 1];
    }
    out->dtype = c->dtype;
    out->pos0 = c->pos0 + start;
    out->n_tokens = n;
}
