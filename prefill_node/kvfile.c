/*
 * kvfile.c - KV files (kvfile.h, which describes the format): a whole conversation's KV in
 * f32 for comparing methods. Every rank of a group writes its own rows.
 */
#include "prefill_node/kvfile.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/pdm.h"
#include "prefill_node/prefill_internal.h"

#define PDM__KVFILE_HEADER 64

static off_t pdm__kvfile_offset(const pdm_model_hparams_t *hp, int32_t n_tokens, uint32_t layer,
                                uint32_t head, int is_v, int32_t pos)
{
    size_t plane = (size_t)n_tokens * hp->head_dim * sizeof(float);
    return (off_t)(PDM__KVFILE_HEADER + ((size_t)(layer * hp->n_kv_heads + head) * 2 + is_v) *
                                            plane + (size_t)pos * hp->head_dim * sizeof(float));
}

static int pdm__kvfile_header(int fd, const char *path, const pdm_model_hparams_t *hp,
                              int32_t *n_tokens)
{
    uint8_t h[PDM__KVFILE_HEADER];
    uint32_t f[4];
    if (pread(fd, h, sizeof(h), 0) != (ssize_t)sizeof(h) || memcmp(h, "PDMKV001", 8))
        return pdm_error_set(PDM_EFORMAT, "%s: not a pdmesh KV file", path);
    memcpy(f, h + 8, sizeof(f));
    if (f[0] != hp->n_layers || f[1] != hp->n_kv_heads || f[2] != hp->head_dim ||
        f[3] > (1u << 24))
        return pdm_error_set(PDM_EFORMAT, "%s: KV shape does not match the model", path);
    *n_tokens = (int32_t)f[3];
    return PDM_OK;
}

int pdm_prefill_rank_dump_kv(const pdm_prefill_rank_t *r, const char *path)
{
    const pdm_model_hparams_t *hp = r->hp;
    /* Every rank of the group writes the same header and size, then its own rows. */
    int fd = open(path, O_WRONLY | O_CREAT, 0644);
    if (fd < 0) return pdm_error_set(-errno, "%s: %s", path, strerror(errno));
    const int32_t n_file = r->conv.n;
    uint8_t header[PDM__KVFILE_HEADER] = "PDMKV001";
    uint32_t f[4] = {hp->n_layers, hp->n_kv_heads, hp->head_dim, (uint32_t)n_file};
    memcpy(header + 8, f, sizeof(f));
    int st = PDM_OK;
    if (pwrite(fd, header, sizeof(header), 0) != (ssize_t)sizeof(header) ||
        ftruncate(fd, pdm__kvfile_offset(hp, n_file, hp->n_layers, 0, 0, 0)) != 0)
        st = pdm_error_set(-errno, "%s: %s", path, strerror(errno));
    pdm_prefill__span_t ranges[PDM_PREFILL__MAX_SPANS];
    int n = st ? 0
               : pdm_prefill__owned_ranges(r, r->g->rank, 0, r->conv.n, ranges,
                                           PDM_PREFILL__MAX_SPANS);
    if (n < 0) st = pdm_error_set(PDM_EOVERFLOW, "KV dump: too many ranges");
    float *buf = NULL;
    if (!st && !(buf = malloc(sizeof(float) * hp->head_dim * (size_t)PDM_MAX(r->conv.n, 1))))
        st = pdm_error_set(PDM_ENOMEM, "KV dump: out of memory");
    const size_t row = pdm_prefill__row_bytes(r);
    for (int i = 0; i < n && !st; i++)
        for (uint32_t l = 0; l < hp->n_layers && !st; l++)
            for (uint32_t h = 0; h < hp->n_kv_heads && !st; h++)
                for (int is_v = 0; is_v < 2 && !st; is_v++) {
                    const char *src = is_v ? pdm_kv_cache_v(r->cache, l, h)
                                           : pdm_kv_cache_k(r->cache, l, h);
                    src += (size_t)ranges[i].start * row;
                    size_t count = (size_t)ranges[i].len * hp->head_dim;
                    const float sc = r->cache->scale[2 * ((size_t)l * hp->n_kv_heads + h) + is_v];
                    if (r->cache->dtype == PDM_DT_F32)
                        memcpy(buf, src, count * sizeof(float));
                    else if (r->cache->dtype == PDM_DT_I8)
                        for (size_t e = 0; e < count; e++)
                            buf[e] = sc * (float)((const int8_t *)src)[e];
                    else
                        for (size_t e = 0; e < count; e++)
                            buf[e] = pdm_f16_to_f32(((const uint16_t *)src)[e]);
                    off_t off = pdm__kvfile_offset(hp, n_file, l, h, is_v, ranges[i].start);
                    if (pwrite(fd, buf, count * sizeof(float), off) != (ssize_t)(count * 4))
                        st = pdm_error_set(-errno, "%s: %s", path, strerror(errno));
                }
    free(buf);
    close(fd);
    return st;
}

int pdm_kvfile_read(const char *path, const pdm_model_hparams_t *hp, int32_t *n_tokens,
                    float **data)
{
    int fd = open(path, O_RDONLY);
    if (fd < 0) return pdm_error_set(-errno, "%s: %s", path, strerror(errno));
    int32_t n = 0;
    int st = pdm__kvfile_header(fd, path, hp, &n);
    size_t bytes = (size_t)hp->n_layers * hp->n_kv_heads * 2 * (size_t)n * hp->head_dim * 4;
    float *d = NULL;
    if (!st && !(d = malloc(bytes ? bytes : 1))) st = pdm_error_set(PDM_ENOMEM, "out of memory");
    if (!st && pread(fd, d, bytes, PDM__KVFILE_HEADER) != (ssize_t)bytes)
        st = pdm_error_set(PDM_EFORMAT, "%s: truncated KV file", path);
    close(fd);
    if (st) {
        free(d);
        return st;
    }
    *n_tokens = n;
    *data = d;
    return PDM_OK;
}

