/*
 * kv_cache.c - the head-major KV cache: one contiguous [capacity][head_dim] array of K and
 * one of V per (layer, kv head), carved from a single allocation.
 */
#include "model.h"

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

int pdm_kv_cache_create(const pdm_model_hparams_t *hp, int32_t capacity, pdm_dtype_t dtype,
                        pdm_kv_cache_t **out)
{
    if (capacity < 1 || (dtype != PDM_DT_F32 && dtype != PDM_DT_F16 && dtype != PDM_DT_I8))
        return pdm_error_set(PDM_EINVAL, "KV cache: invalid capacity %d or dtype %s", capacity,
                             pdm_dtype_name(dtype));
    size_t n_arrays = (size_t)hp->n_layers * hp->n_kv_heads;
    size_t head_bytes, total;
    if (pdm_size_mul((size_t)capacity * hp->head_dim, pdm_dtype_row_bytes(dtype, 1),
                     &head_bytes) ||
        pdm_size_mul(head_bytes, 2 * n_arrays, &total))
        return pdm_error_set(PDM_EOVERFLOW, "KV cache: %d tokens overflow the address space",
                             capacity);
    head_bytes = (head_bytes + 63) & ~(size_t)63; /* keep every head array cache-line aligned */
    total = head_bytes * 2 * n_arrays;

    pdm_kv_cache_t *c = calloc(1, sizeof(*c));
    if (!c) goto err_nomem;
    c->k = calloc(n_arrays, sizeof(void *));
    c->v = calloc(n_arrays, sizeof(void *));
    c->scale = malloc(2 * n_arrays * sizeof(float));
    if (!c->k || !c->v || !c->scale) goto err_arrays;
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
    c->capacity = capacity;
    c->dtype = dtype;
    for (size_t i = 0; i < n_arrays; i++) {
        c->k[i] = (char *)c->storage + (2 * i) * head_bytes;
        c->v[i] = (char *)c->storage + (2 * i + 1) * head_bytes;
    }
    *out = c;
    return PDM_OK;

err_arrays:
    free(c->scale);
    free(c->k);
    free(c->v);
    free(c);
err_nomem:
    return pdm_error_set(PDM_ENOMEM, "KV cache: cannot allocate %zu bytes for %d tokens", total,
                         capacity);
}

void pdm_kv_cache_destroy(pdm_kv_cache_t *c)
{
    if (!c) return;
    if (c->storage_bytes) munmap(c->storage, c->storage_bytes);
    else free(c->storage);
    free(c->scale);
    free(c->k);
    free(c->v);
    free(c);
}

void pdm_kv_cache_clear(pdm_kv_cache_t *c)
{
    c->n_tokens = 0;
    c->pos0 = 0;
    c->scales_fixed = 0; /* q8: the next prompt fixes its own scales */
}

size_t pdm_kv_cache_bytes(const pdm_kv_cache_t *c)
{
    return (size_t)c->capacity * c->head_dim * pdm_dtype_row_bytes(c->dtype, 1) * 2 *
           c->n_layers * c->n_kv_heads;
}

void pdm_kv_cache_view(const pdm_kv_cache_t *c, uint32_t layer, int32_t start, int32_t n,
                       pdm_kv_view_t *out)
{
    size_t off = (size_t)start * c->head_dim * pdm_dtype_row_bytes(c->dtype, 1);
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
