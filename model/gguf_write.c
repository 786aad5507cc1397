/*
 * gguf_write.c - GGUF v3 writer for tests and tools.
 *
 * Metadata values are serialised into their final little-endian bytes as soon as they are
 * set, so writing is a straight copy; tensors are copied and laid out at write time, each at
 * a multiple of the alignment (32) from the start of the data section. The file is written
 * to "<path>.tmp" and renamed into place, so a reader never sees a half-written file.
 */
#include "gguf.h"

#include "../common/pdm.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define PDM_GGUF__WRITE_ALIGNMENT 32
#define PDM_GGUF__WRITE_VERSION 3

/* A growable byte buffer. */
typedef struct {
    uint8_t *data; /* [len] bytes, [cap] allocated */
    size_t len, cap;
} pdm_gguf__bytes_t;

typedef struct {
    char *key;               /* NUL-terminated copy */
    pdm_gguf__bytes_t value; /* value type (u32) followed by the serialised value */
} pdm_gguf__wkv_t;

typedef struct {
    char *name;       /* NUL-terminated copy */
    pdm_dtype_t type;
    uint32_t n_dims;  /* 1..4 */
    int64_t ne[4];    /* unused dims are 1 */
    void *data;       /* [nbytes] copy in `type`'s layout */
    size_t nbytes;
} pdm_gguf__wtensor_t;

struct pdm_gguf_writer {
    pdm_gguf__wkv_t *kvs;         /* [n_kv] in insertion order */
    size_t n_kv, cap_kv;
    pdm_gguf__wtensor_t *tensors; /* [n_tensors] in insertion order */
    size_t n_tensors, cap_tensors;
};

/* Makes room for `extra` more bytes; PDM_ENOMEM on failure (the buffer is unchanged). */
static int pdm_gguf__bytes_reserve(pdm_gguf__bytes_t *b, size_t extra)
{
    size_t need;
    if (pdm_size_add(b->len, extra, &need)) return PDM_ENOMEM;
    if (need <= b->cap) return PDM_OK;
    size_t cap = b->cap ? b->cap : 64;
    while (cap < need) {
        if (pdm_size_mul(cap, 2, &cap)) return PDM_ENOMEM;
    }
    uint8_t *p = realloc(b->data, cap);
    if (!p) return PDM_ENOMEM;
    b->data = p;
    b->cap = cap;
    return PDM_OK;
}

static int pdm_gguf__bytes_put(pdm_gguf__bytes_t *b, const void *src, size_t n)
{
    int status = pdm_gguf__bytes_reserve(b, n);
    if (status) return status;
    if (n) memcpy(b->data + b->len, src, n);
    b->len += n;
    return PDM_OK;
}

static int pdm_gguf__bytes_put_u32(pdm_gguf__bytes_t *b, uint32_t v)
{
    uint8_t le[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    return pdm_gguf__bytes_put(b, le, 4);
}

static int pdm_gguf__bytes_put_u64(pdm_gguf__bytes_t *b, uint64_t v)
{
    int status = pdm_gguf__bytes_put_u32(b, (uint32_t)v);
    return status ? status : pdm_gguf__bytes_put_u32(b, (uint32_t)(v >> 32));
}

static int pdm_gguf__bytes_put_str(pdm_gguf__bytes_t *b, const char *s)
{
    size_t n = strlen(s);
    int status = pdm_gguf__bytes_put_u64(b, n);
    return status ? status : pdm_gguf__bytes_put(b, s, n);
}

pdm_gguf_writer_t *pdm_gguf_writer_create(void) { return calloc(1, sizeof(pdm_gguf_writer_t)); }

/* Frees the writer and every copied key, value and tensor. Accepts NULL. */
void pdm_gguf_writer_destroy(pdm_gguf_writer_t *w)
{
    if (!w) return;
    for (size_t i = 0; i < w->n_kv; i++) {
        free(w->kvs[i].key);
        free(w->kvs[i].value.data);
    }
    for (size_t i = 0; i < w->n_tensors; i++) {
        free(w->tensors[i].name);
        free(w->tensors[i].data);
    }
    free(w->kvs);
    free(w->tensors);
    free(w);
}

/* Checks the arguments common to every setter. The writer owns `general.alignment`. */
static int pdm_gguf__check_key(const pdm_gguf_writer_t *w, const char *key)
{
    if (!w || !key || !*key)
        return pdm_error_set(PDM_EINVAL, "gguf writer: NULL writer or empty key");
    if (!strcmp(key, "general.alignment")) {
        return pdm_error_set(PDM_EINVAL, "gguf writer: general.alignment is set by the writer "
                             "itself (always %d)", PDM_GGUF__WRITE_ALIGNMENT);
    }
    return PDM_OK;
}

/* Stores `value` (type + serialised value; ownership passes to the writer on success) under
 * `key`, replacing an existing value of the same key in place. On error `value` is freed. */
static int pdm_gguf__set(pdm_gguf_writer_t *w, const char *key, pdm_gguf__bytes_t value)
{
    int status;
    for (size_t i = 0; i < w->n_kv; i++) {
        if (!strcmp(w->kvs[i].key, key)) {
            free(w->kvs[i].value.data);
            w->kvs[i].value = value;
            return PDM_OK;
        }
    }
    if (w->n_kv == w->cap_kv) {
        size_t cap = w->cap_kv ? 2 * w->cap_kv : 16;
        pdm_gguf__wkv_t *kvs = realloc(w->kvs, cap * sizeof(*kvs));
        if (!kvs) {
            status = PDM_ENOMEM;
            goto err_free_value;
        }
        w->kvs = kvs;
        w->cap_kv = cap;
    }
    char *copy = strdup(key);
    if (!copy) {
        status = PDM_ENOMEM;
        goto err_free_value;
    }
    w->kvs[w->n_kv].key = copy;
    w->kvs[w->n_kv].value = value;
    w->n_kv++;
    return PDM_OK;

err_free_value:
    free(value.data);
    return pdm_error_set(status, "gguf writer: out of memory setting '%s'", key);
}

/* Serialises a scalar of `type` from the `size` little-endian bytes at `le` and stores it. */
static int pdm_gguf__set_scalar(pdm_gguf_writer_t *w, const char *key, pdm_gguf_type_t type,
                                const uint8_t *le, size_t size)
{
    pdm_gguf__bytes_t value = {0};
    int status = pdm_gguf__check_key(w, key);
    if (status) return status;
    if (pdm_gguf__bytes_put_u32(&value, type) || pdm_gguf__bytes_put(&value, le, size)) {
        free(value.data);
        return pdm_error_set(PDM_ENOMEM, "gguf writer: out of memory setting '%s'", key);
    }
    return pdm_gguf__set(w, key, value);
}


/* Scalar setters: store `v` under `key`, replacing any earlier value of that key (whatever its
 * type). PDM_EINVAL for a NULL writer, an empty key or `general.alignment`; PDM_ENOMEM. */
int pdm_gguf_writer_set_u32(pdm_gguf_writer_t *w, const char *key, uint32_t v)
{
    uint8_t le[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    return pdm_gguf__set_scalar(w, key, PDM_GGUF_UINT32, le, 4);
}

int pdm_gguf_writer_set_i32(pdm_gguf_writer_t *w, const char *key, int32_t v)
{
    uint32_t u = (uint32_t)v;
    uint8_t le[4] = {(uint8_t)u, (uint8_t)(u >> 8), (uint8_t)(u >> 16), (uint8_t)(u >> 24)};
    return pdm_gguf__set_scalar(w, key, PDM_GGUF_INT32, le, 4);
}

int pdm_gguf_writer_set_f32(pdm_gguf_writer_t *w, const char *key, float v)
{
    uint32_t u;
    memcpy(&u, &v, 4);
    uint8_t le[4] = {(uint8_t)u, (uint8_t)(u >> 8), (uint8_t)(u >> 16), (uint8_t)(u >> 24)};
    return pdm_gguf__set_scalar(w, key, PDM_GGUF_FLOAT32, le, 4);
}

int pdm_gguf_writer_set_bool(pdm_gguf_writer_t *w, const char *key, int v)
{
    uint8_t b = v != 0;
    return pdm_gguf__set_scalar(w, key, PDM_GGUF_BOOL, &b, 1);
}

/* Stores a copy of the NUL-terminated string `v` (PDM_EINVAL if NULL). */
int pdm_gguf_writer_set_str(pdm_gguf_writer_t *w, const char *key, const char *v)
{
    pdm_gguf__bytes_t value = {0};
    int status = pdm_gguf__check_key(w, key);
    if (status) return status;
    if (!v) return pdm_error_set(PDM_EINVAL, "gguf writer: NULL string for '%s'", key);
    if (pdm_gguf__bytes_put_u32(&value, PDM_GGUF_STRING) || pdm_gguf__bytes_put_str(&value, v)) {
        free(value.data);
        return pdm_error_set(PDM_ENOMEM, "gguf writer: out of memory setting '%s'", key);
    }
    return pdm_gguf__set(w, key, value);
}

/* Stores copies of `n` NUL-terminated strings (v may be NULL when n is 0; no element may be
 * NULL). */
int pdm_gguf_writer_set_arr_str(pdm_gguf_writer_t *w, const char *key, const char *const *v,
                                uint64_t n)
{
    pdm_gguf__bytes_t value = {0};
    int status = pdm_gguf__check_key(w, key);
    if (status) return status;
    if (n > 0 && !v) return pdm_error_set(PDM_EINVAL, "gguf writer: NULL array for '%s'", key);
    for (uint64_t i = 0; i < n; i++) {
        if (!v[i]) {
            return pdm_error_set(PDM_EINVAL, "gguf writer: element %llu of '%s' is NULL",
                                 (unsigned long long)i, key);
        }
    }
    status = pdm_gguf__bytes_put_u32(&value, PDM_GGUF_ARRAY);
    if (!status) status = pdm_gguf__bytes_put_u32(&value, PDM_GGUF_STRING);
    if (!status) status = pdm_gguf__bytes_put_u64(&value, n);
    for (uint64_t i = 0; !status && i < n; i++) status = pdm_gguf__bytes_put_str(&value, v[i]);
    if (status) {
        free(value.data);
        return pdm_error_set(status, "gguf writer: out of memory setting '%s'", key);
    }
    return pdm_gguf__set(w, key, value);
}

/* Stores an array of `n` 4-byte elements of `elem_type` given as host-order 32-bit words. */
static int pdm_gguf__set_arr32(pdm_gguf_writer_t *w, const char *key, pdm_gguf_type_t elem_type,
                               const void *v, uint64_t n)
{
    pdm_gguf__bytes_t value = {0};
    size_t nbytes;
    int status = pdm_gguf__check_key(w, key);
    if (status) return status;
    if (n > 0 && !v) return pdm_error_set(PDM_EINVAL, "gguf writer: NULL array for '%s'", key);
    if (n > SIZE_MAX || pdm_size_mul((size_t)n, 4, &nbytes))
        return pdm_error_set(PDM_EINVAL, "gguf writer: array '%s' is too large", key);
    status = pdm_gguf__bytes_put_u32(&value, PDM_GGUF_ARRAY);
    if (!status) status = pdm_gguf__bytes_put_u32(&value, elem_type);
    if (!status) status = pdm_gguf__bytes_put_u64(&value, n);
    if (!status) status = pdm_gguf__bytes_reserve(&value, nbytes);
    for (uint64_t i = 0; !status && i < n; i++) {
        uint32_t word;
        memcpy(&word, (const uint8_t *)v + 4 * i, 4);
        status = pdm_gguf__bytes_put_u32(&value, word);
    }
    if (status) {
        free(value.data);
        return pdm_error_set(status, "gguf writer: out of memory setting '%s'", key);
    }
    return pdm_gguf__set(w, key, value);
}

int pdm_gguf_writer_set_arr_i32(pdm_gguf_writer_t *w, const char *key, const int32_t *v,
                                uint64_t n)
{
    return pdm_gguf__set_arr32(w, key, PDM_GGUF_INT32, v, n);
}

int pdm_gguf_writer_set_arr_f32(pdm_gguf_writer_t *w, const char *key, const float *v,
                                uint64_t n)
{
    return pdm_gguf__set_arr32(w, key, PDM_GGUF_FLOAT32, v, n);
}

/* Validates the tensor (type a file type, 1..4 positive dims, whole blocks per row, size
 * representable), then copies name and data. PDM_EINVAL with a message on bad arguments or
 * a duplicate name; the writer is unchanged on any error. */
int pdm_gguf_writer_add_tensor(pdm_gguf_writer_t *w, const char *name, pdm_dtype_t type,
                               uint32_t n_dims, const int64_t *ne, const void *data)
{
    pdm_gguf__wtensor_t t = {0};
    int64_t n_elems = 1;
    size_t row_bytes;
    int status;

    if (!w || !name || !*name || !ne || !data)
        return pdm_error_set(PDM_EINVAL, "gguf writer: NULL argument or empty tensor name");
    if (!pdm_dtype_valid((uint32_t)type) || !pdm_dtype_is_weight(type))
        return pdm_error_set(PDM_EINVAL, "gguf writer: tensor '%s' has invalid type %d", name,
                             (int)type);
    if (n_dims < 1 || n_dims > 4)
        return pdm_error_set(PDM_EINVAL, "gguf writer: tensor '%s' has %u dimensions", name,
                             n_dims);
    for (int d = 0; d < 4; d++) t.ne[d] = 1;
    for (uint32_t d = 0; d < n_dims; d++) {
        if (ne[d] <= 0 || __builtin_mul_overflow(n_elems, ne[d], &n_elems))
            return pdm_error_set(PDM_EINVAL, "gguf writer: tensor '%s' has a bad shape", name);
        t.ne[d] = ne[d];
    }
    int64_t block_elems = pdm_dtype_block_elems(type);
    if (ne[0] % block_elems != 0)
        return pdm_error_set(PDM_EINVAL, "gguf writer: tensor '%s' ne[0] = %lld is not a "
                             "multiple of %lld", name, (long long)ne[0], (long long)block_elems);
    if (pdm_size_mul((size_t)(ne[0] / block_elems), pdm_dtype_block_bytes(type), &row_bytes) ||
        pdm_size_mul(row_bytes, (size_t)(n_elems / ne[0]), &t.nbytes))
        return pdm_error_set(PDM_EINVAL, "gguf writer: tensor '%s' is too large", name);
    for (size_t i = 0; i < w->n_tensors; i++) {
        if (!strcmp(w->tensors[i].name, name))
            return pdm_error_set(PDM_EINVAL, "gguf writer: duplicate tensor name '%s'", name);
    }
    t.type = type;
    t.n_dims = n_dims;

    if (w->n_tensors == w->cap_tensors) {
        size_t cap = w->cap_tensors ? 2 * w->cap_tensors : 16;
        pdm_gguf__wtensor_t *tensors = realloc(w->tensors, cap * sizeof(*tensors));
        if (!tensors) {
            status = PDM_ENOMEM;
            goto err;
        }
        w->tensors = tensors;
        w->cap_tensors = cap;
    }
    t.name = strdup(name);
    if (!t.name) {
        status = PDM_ENOMEM;
        goto err;
    }
    t.data = malloc(t.nbytes);
    if (!t.data) {
        status = PDM_ENOMEM;
        goto err_free_name;
    }
    memcpy(t.data, data, t.nbytes);
    w->tensors[w->n_tensors++] = t;
    return PDM_OK;

err_free_name:
    free(t.name);
err:
    return pdm_error_set(status, "gguf writer: out of memory adding tensor '%s'", name);
}

static size_t pdm_gguf__align_up(size_t n) /* callers keep n far below SIZE_MAX */
{
    return (n + PDM_GGUF__WRITE_ALIGNMENT - 1) & ~(size_t)(PDM_GGUF__WRITE_ALIGNMENT - 1);
}

/* Serialises everything before the tensor data: header, `general.alignment`, the user's
 * pairs, tensor infos (data offsets assigned in order, each aligned) and padding. */
static int pdm_gguf__build_head(const pdm_gguf_writer_t *w, pdm_gguf__bytes_t *head)
{
    static const uint8_t zeros[PDM_GGUF__WRITE_ALIGNMENT];
    int status = pdm_gguf__bytes_put(head, "GGUF", 4);
    if (!status) status = pdm_gguf__bytes_put_u32(head, PDM_GGUF__WRITE_VERSION);
    if (!status) status = pdm_gguf__bytes_put_u64(head, w->n_tensors);
    if (!status) status = pdm_gguf__bytes_put_u64(head, w->n_kv + 1);
    if (!status) status = pdm_gguf__bytes_put_str(head, "general.alignment");
    if (!status) status = pdm_gguf__bytes_put_u32(head, PDM_GGUF_UINT32);
    if (!status) status = pdm_gguf__bytes_put_u32(head, PDM_GGUF__WRITE_ALIGNMENT);
    for (size_t i = 0; !status && i < w->n_kv; i++) {
        status = pdm_gguf__bytes_put_str(head, w->kvs[i].key);
        if (!status) status = pdm_gguf__bytes_put(head, w->kvs[i].value.data, w->kvs[i].value.len);
    }
    size_t offset = 0;
    for (size_t i = 0; !status && i < w->n_tensors; i++) {
        const pdm_gguf__wtensor_t *t = &w->tensors[i];
        status = pdm_gguf__bytes_put_str(head, t->name);
        if (!status) status = pdm_gguf__bytes_put_u32(head, t->n_dims);
        for (uint32_t d = 0; !status && d < t->n_dims; d++)
            status = pdm_gguf__bytes_put_u64(head, (uint64_t)t->ne[d]);
        if (!status) status = pdm_gguf__bytes_put_u32(head, (uint32_t)t->type);
        if (!status) status = pdm_gguf__bytes_put_u64(head, offset);
        offset = pdm_gguf__align_up(offset + t->nbytes);
    }
    if (!status)
        status = pdm_gguf__bytes_put(head, zeros, pdm_gguf__align_up(head->len) - head->len);
    return status;
}

/* Writes the file to "<path>.tmp", syncs it and renames it to `path`. On error the temporary
 * file is removed and `path` is untouched. */
int pdm_gguf_writer_write(pdm_gguf_writer_t *w, const char *path)
{
    static const uint8_t zeros[PDM_GGUF__WRITE_ALIGNMENT];
    pdm_gguf__bytes_t head = {0};
    char *tmp;
    FILE *f;
    int status;

    if (!w || !path) return pdm_error_set(PDM_EINVAL, "gguf writer: NULL argument");
    status = pdm_gguf__build_head(w, &head);
    if (status) {
        pdm_error_set(status, "%s: out of memory serialising the GGUF header", path);
        goto err_free_head;
    }
    tmp = malloc(strlen(path) + 5);
    if (!tmp) {
        status = pdm_error_set(PDM_ENOMEM, "%s: out of memory", path);
        goto err_free_head;
    }
    strcpy(tmp, path);
    strcat(tmp, ".tmp");
    f = fopen(tmp, "wb");
    if (!f) {
        status = -errno;
        pdm_error_set(status, "%s: cannot create: %s", tmp, pdm_strerror(status));
        goto err_free_tmp;
    }

    errno = 0;
    int ok = fwrite(head.data, 1, head.len, f) == head.len;
    for (size_t i = 0; ok && i < w->n_tensors; i++) {
        const pdm_gguf__wtensor_t *t = &w->tensors[i];
        size_t pad = pdm_gguf__align_up(t->nbytes) - t->nbytes;
        ok = fwrite(t->data, 1, t->nbytes, f) == t->nbytes && fwrite(zeros, 1, pad, f) == pad;
    }
    if (!ok || fflush(f) != 0 || fsync(fileno(f)) != 0) {
        status = errno ? -errno : PDM_EIO;
        pdm_error_set(status, "%s: write failed: %s", tmp, pdm_strerror(status));
        fclose(f);
        goto err_unlink;
    }
    if (fclose(f) != 0) {
        status = errno ? -errno : PDM_EIO;
        pdm_error_set(status, "%s: close failed: %s", tmp, pdm_strerror(status));
        goto err_unlink;
    }
    if (rename(tmp, path) != 0) {
        status = -errno;
        pdm_error_set(status, "%s: cannot rename %s into place: %s", path, tmp,
                      pdm_strerror(status));
        goto err_unlink;
    }
    free(tmp);
    free(head.data);
    return PDM_OK;

err_unlink:
    unlink(tmp);
err_free_tmp:
    free(tmp);
err_free_head:
    free(head.data);
    return status;
}

/* Serialises a decoded scalar back into its little-endian bytes. */
static int pdm_gguf__put_scalar(pdm_gguf__bytes_t *b, const pdm_gguf_kv_t *kv)
{
    uint64_t bits;
    switch (kv->type) {
    case PDM_GGUF_FLOAT32: {
        float f = (float)kv->v.f64;
        uint32_t u;
        memcpy(&u, &f, 4);
        bits = u;
        break;
    }
    case PDM_GGUF_FLOAT64:
        memcpy(&bits, &kv->v.f64, 8);
        break;
    case PDM_GGUF_INT8:
    case PDM_GGUF_INT16:
    case PDM_GGUF_INT32:
    case PDM_GGUF_INT64:
        bits = (uint64_t)kv->v.i64;
        break;
    default:
        bits = kv->v.u64;
        break;
    }
    size_t n = pdm_gguf_scalar_size(kv->type);
    uint8_t le[8];
    for (size_t i = 0; i < n; i++) le[i] = (uint8_t)(bits >> (8 * i));
    return pdm_gguf__bytes_put(b, le, n);
}

/* Copies one metadata pair of an open file (any value type) into the writer, replacing a
 * pair of the same key. general.alignment is skipped (the writer owns it). Keys containing
 * a NUL byte are rejected with PDM_EINVAL. */
int pdm_gguf_writer_copy_kv(pdm_gguf_writer_t *w, const pdm_gguf_kv_t *kv)
{
    if (!w || !kv) return pdm_error_set(PDM_EINVAL, "gguf writer: NULL argument");
    if (pdm_gguf_str_eq(kv->key, "general.alignment")) return PDM_OK;
    char *key = malloc(kv->key.len + 1);
    if (!key) return pdm_error_set(PDM_ENOMEM, "gguf writer: out of memory");
    memcpy(key, kv->key.ptr, kv->key.len);
    key[kv->key.len] = 0;
    int status = strlen(key) == kv->key.len ? PDM_OK : PDM_EINVAL;
    if (status) {
        free(key);
        return pdm_error_set(status, "gguf writer: metadata key with a NUL byte");
    }
    pdm_gguf__bytes_t value = {0};
    status = pdm_gguf__bytes_put_u32(&value, kv->type);
    if (!status && kv->type == PDM_GGUF_STRING) {
        status = pdm_gguf__bytes_put_u64(&value, kv->v.str.len);
        if (!status) status = pdm_gguf__bytes_put(&value, kv->v.str.ptr, kv->v.str.len);
    } else if (!status && kv->type == PDM_GGUF_ARRAY) {
        status = pdm_gguf__bytes_put_u32(&value, kv->v.arr.type);
        if (!status) status = pdm_gguf__bytes_put_u64(&value, kv->v.arr.n);
        for (uint64_t i = 0; !status && kv->v.arr.type == PDM_GGUF_STRING && i < kv->v.arr.n; i++) {
            pdm_gguf_str_t e = pdm_gguf_arr_str(kv, i);
            status = pdm_gguf__bytes_put_u64(&value, e.len);
            if (!status) status = pdm_gguf__bytes_put(&value, e.ptr, e.len);
        }
        const size_t elem = pdm_gguf_scalar_size(kv->v.arr.type);
        if (!status && kv->v.arr.type != PDM_GGUF_STRING) /* raw little-endian elements */
            status = pdm_gguf__bytes_put(&value, kv->v.arr.data, (size_t)kv->v.arr.n * elem);
    } else if (!status) {
        status = pdm_gguf__put_scalar(&value, kv);
    }
    if (!status) status = pdm_gguf__set(w, key, value);
    else free(value.data);
    free(key);
    return status ? pdm_error_set(status, "gguf writer: cannot copy metadata") : PDM_OK;
}
