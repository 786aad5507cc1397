/*
 * gguf.c - GGUF v2/v3 reader.
 *
 * The file is mapped read-only (or a caller buffer is used) and parsed in one pass by a
 * cursor that checks every read against the bytes left, so no count, length or offset from
 * the file is trusted before it has been compared with the file size using overflow-checked
 * arithmetic. Keys and tensor names are then sorted once (n log n) to reject duplicates and
 * to answer lookups by binary search; tensors are sorted by offset to reject overlaps.
 * Strings, arrays and tensor data point into the mapping.
 */
#include "gguf.h"

#include "../common/pdm.h"

#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define PDM_GGUF__DEFAULT_ALIGNMENT 32
#define PDM_GGUF__MAX_DIMS 4
/* The smallest possible metadata pair: key length, value type and a one-byte value (the key
 * itself may not be empty, but counting it as 0 keeps the bound obviously safe). */
#define PDM_GGUF__MIN_KV_BYTES (8 + 4 + 1)
/* The smallest possible tensor info: name length, n_dims, one dimension, type, offset. */
#define PDM_GGUF__MIN_TENSOR_INFO_BYTES (8 + 4 + 8 + 4 + 8)
/* Longest excerpt of a file string quoted in a message. */
#define PDM_GGUF__QUOTE_MAX 80

struct pdm_gguf {
    char *name;                               /* path or buffer name, for messages */
    const uint8_t *base;                      /* [size] bytes of the file */
    size_t size;                              /* file size in bytes */
    void *map;                                /* the mapping when opened from a path */
    size_t map_size;                          /* bytes mapped */
    uint32_t version;                         /* 2 or 3 */
    size_t alignment;                         /* bytes; a power of two */
    size_t data_offset;                       /* file offset of the tensor data section */
    uint64_t n_kv;
    pdm_gguf_kv_t *kvs;                       /* [n_kv] in file order */
    const pdm_gguf_kv_t **kv_by_key;          /* [n_kv] sorted by key */
    uint64_t n_tensors;
    pdm_gguf_tensor_t *tensors;               /* [n_tensors] in file order */
    const pdm_gguf_tensor_t **tensor_by_name; /* [n_tensors] sorted by name */
};

/* A bounds-checked cursor over the file. Invariant: pos <= size. */
typedef struct {
    const char *name;    /* file name for messages */
    const uint8_t *base; /* [size] bytes */
    size_t size;
    size_t pos;
    char what[192];      /* what is being read, for truncation messages */
} pdm_gguf__cursor_t;

static const char *const pdm_gguf__type_names[PDM_GGUF_TYPE_COUNT_] = {
    "uint8", "int8", "uint16", "int16", "uint32", "int32",  "float32",
    "bool",  "string", "array", "uint64", "int64", "float64",
};

static const char *pdm_gguf__type_name(uint32_t type)
{
    return type < PDM_GGUF_TYPE_COUNT_ ? pdm_gguf__type_names[type] : "unknown";
}

/* Bytes of one scalar of `type`; 0 for STRING, ARRAY and unknown types. */
size_t pdm_gguf_scalar_size(uint32_t type)
{
    switch (type) {
    case PDM_GGUF_UINT8:
    case PDM_GGUF_INT8:
    case PDM_GGUF_BOOL:
        return 1;
    case PDM_GGUF_UINT16:
    case PDM_GGUF_INT16:
        return 2;
    case PDM_GGUF_UINT32:
    case PDM_GGUF_INT32:
    case PDM_GGUF_FLOAT32:
        return 4;
    case PDM_GGUF_UINT64:
    case PDM_GGUF_INT64:
    case PDM_GGUF_FLOAT64:
        return 8;
    default:
        return 0;
    }
}

/* Little-endian loads that work on any host and any alignment. */
static uint16_t pdm_gguf__le16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

static uint32_t pdm_gguf__le32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t pdm_gguf__le64(const uint8_t *p)
{
    return (uint64_t)pdm_gguf__le32(p) | (uint64_t)pdm_gguf__le32(p + 4) << 32;
}

/* Copies at most PDM_GGUF__QUOTE_MAX bytes of `s` into `buf` (which must hold
 * PDM_GGUF__QUOTE_MAX + 4 bytes) with control and non-ASCII bytes replaced by '?', so that a
 * corrupt name can be quoted in a message without garbling the terminal. Returns `buf`. */
static const char *pdm_gguf__quote(pdm_gguf_str_t s, char *buf)
{
    size_t n = s.len < PDM_GGUF__QUOTE_MAX ? (size_t)s.len : PDM_GGUF__QUOTE_MAX;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s.ptr[i];
        buf[i] = (c >= 0x20 && c < 0x7f) ? (char)c : '?';
    }
    if (s.len > n) {
        memcpy(buf + n, "...", 4);
    } else {
        buf[n] = '\0';
    }
    return buf;
}

/* Returns 0 if `n` more bytes can be read, else PDM_EFORMAT with a truncation message. */
static int pdm_gguf__need(const pdm_gguf__cursor_t *cur, size_t n)
{
    size_t left = cur->size - cur->pos;
    if (n <= left) return 0;
    return pdm_error_set(PDM_EFORMAT,
                         "%s: file is truncated: %s at offset %zu needs %zu bytes but only %zu "
                         "are left (file size %zu)",
                         cur->name, cur->what, cur->pos, n, left, cur->size);
}

static int pdm_gguf__read_u32(pdm_gguf__cursor_t *cur, uint32_t *out)
{
    int status = pdm_gguf__need(cur, 4);
    if (status) return status;
    *out = pdm_gguf__le32(cur->base + cur->pos);
    cur->pos += 4;
    return 0;
}

static int pdm_gguf__read_u64(pdm_gguf__cursor_t *cur, uint64_t *out)
{
    int status = pdm_gguf__need(cur, 8);
    if (status) return status;
    *out = pdm_gguf__le64(cur->base + cur->pos);
    cur->pos += 8;
    return 0;
}

/* Reads a length-prefixed string; the result points into the file. The length is checked
 * against the bytes left before anything else is done with it. */
static int pdm_gguf__read_str(pdm_gguf__cursor_t *cur, pdm_gguf_str_t *out)
{
    uint64_t len;
    int status = pdm_gguf__read_u64(cur, &len);
    if (status) return status;
    size_t left = cur->size - cur->pos;
    if (len > left) {
        return pdm_error_set(PDM_EFORMAT,
                             "%s: %s at offset %zu: string length %" PRIu64
                             " exceeds the %zu bytes left in the file",
                             cur->name, cur->what, cur->pos - 8, len, left);
    }
    out->ptr = (const char *)(cur->base + cur->pos);
    out->len = len;
    cur->pos += (size_t)len;
    return 0;
}

/* Decodes one scalar of `type` (not STRING or ARRAY) at `p` into the widened union member. */
static void pdm_gguf__decode_scalar(uint32_t type, const uint8_t *p, pdm_gguf_kv_t *kv)
{
    uint32_t bits32;
    uint64_t bits64;
    float f32;
    double f64;
    switch (type) {
    case PDM_GGUF_UINT8:
    case PDM_GGUF_BOOL:
        kv->v.u64 = p[0];
        break;
    case PDM_GGUF_UINT16:
        kv->v.u64 = pdm_gguf__le16(p);
        break;
    case PDM_GGUF_UINT32:
        kv->v.u64 = pdm_gguf__le32(p);
        break;
    case PDM_GGUF_UINT64:
        kv->v.u64 = pdm_gguf__le64(p);
        break;
    case PDM_GGUF_INT8:
        kv->v.i64 = (int8_t)p[0];
        break;
    case PDM_GGUF_INT16:
        kv->v.i64 = (int16_t)pdm_gguf__le16(p);
        break;
    case PDM_GGUF_INT32:
        kv->v.i64 = (int32_t)pdm_gguf__le32(p);
        break;
    case PDM_GGUF_INT64:
        kv->v.i64 = (int64_t)pdm_gguf__le64(p);
        break;
    case PDM_GGUF_FLOAT32:
        bits32 = pdm_gguf__le32(p);
        memcpy(&f32, &bits32, 4);
        kv->v.f64 = f32;
        break;
    case PDM_GGUF_FLOAT64:
        bits64 = pdm_gguf__le64(p);
        memcpy(&f64, &bits64, 8);
        kv->v.f64 = f64;
        break;
    default:
        assert(!"not a scalar type");
        break;
    }
}

/* Parses the body of an array value (element type, count, elements) for the pair `key` and
 * fills kv->v.arr. For string arrays the offsets index is allocated here and owned by the
 * pair on success; on error nothing is allocated and kv is untouched. */
static int pdm_gguf__parse_array(pdm_gguf__cursor_t *cur, const char *key, pdm_gguf_kv_t *kv)
{
    uint32_t elem_type;
    uint64_t n;
    uint64_t *offsets = NULL;
    int status;

    snprintf(cur->what, sizeof(cur->what), "the element type of array '%s'", key);
    status = pdm_gguf__read_u32(cur, &elem_type);
    if (status) return status;
    if (elem_type == PDM_GGUF_ARRAY) {
        return pdm_error_set(PDM_EUNSUPPORTED, "%s: metadata '%s' is a nested array, which is "
                             "not supported", cur->name, key);
    }
    if (elem_type >= PDM_GGUF_TYPE_COUNT_) {
        return pdm_error_set(PDM_EUNSUPPORTED, "%s: array '%s' has unknown element type %" PRIu32,
                             cur->name, key, elem_type);
    }
    snprintf(cur->what, sizeof(cur->what), "the length of array '%s'", key);
    status = pdm_gguf__read_u64(cur, &n);
    if (status) return status;

    size_t start = cur->pos;
    size_t left = cur->size - start;
    if (elem_type == PDM_GGUF_STRING) {
        /* Each element needs at least its 8-byte length, which bounds the index size by the
         * file size before anything is allocated. */
        if (n > left / 8) {
            return pdm_error_set(PDM_EFORMAT, "%s: string array '%s' claims %" PRIu64
                                 " elements but only %zu bytes are left in the file",
                                 cur->name, key, n, left);
        }
        if (n > 0) {
            offsets = malloc((size_t)n * sizeof(*offsets));
            if (!offsets) {
                return pdm_error_set(PDM_ENOMEM, "%s: out of memory indexing string array '%s'",
                                     cur->name, key);
            }
        }
        snprintf(cur->what, sizeof(cur->what), "an element of string array '%s'", key);
        for (uint64_t i = 0; i < n; i++) {
            pdm_gguf_str_t s;
            offsets[i] = cur->pos - start;
            status = pdm_gguf__read_str(cur, &s);
            if (status) goto err_free_offsets;
        }
    } else {
        size_t elem_size = pdm_gguf_scalar_size(elem_type);
        if (n > left / elem_size) {
            return pdm_error_set(PDM_EFORMAT, "%s: array '%s' of %" PRIu64 " %s elements does "
                                 "not fit in the %zu bytes left in the file",
                                 cur->name, key, n, pdm_gguf__type_name(elem_type), left);
        }
        size_t nbytes = (size_t)n * elem_size;
        if (elem_type == PDM_GGUF_BOOL) {
            for (size_t i = 0; i < nbytes; i++) {
                if (cur->base[start + i] > 1) {
                    return pdm_error_set(PDM_EFORMAT, "%s: bool array '%s' element %zu has "
                                         "value %u (must be 0 or 1)",
                                         cur->name, key, i, cur->base[start + i]);
                }
            }
        }
        cur->pos += nbytes;
    }

    kv->v.arr.type = (pdm_gguf_type_t)elem_type;
    kv->v.arr.n = n;
    kv->v.arr.data = cur->base + start;
    kv->v.arr.str_offsets = offsets;
    return 0;

err_free_offsets:
    free(offsets);
    return status;
}

/* Parses metadata pair number `index` into `kv`. kv->type is set last, so a pair that fails
 * half-way owns nothing (pdm_gguf_close only frees the index of complete string arrays). */
static int pdm_gguf__parse_kv(pdm_gguf__cursor_t *cur, uint64_t index, pdm_gguf_kv_t *kv)
{
    char key[PDM_GGUF__QUOTE_MAX + 4];
    uint32_t type;
    int status;

    snprintf(cur->what, sizeof(cur->what), "the key of metadata pair #%" PRIu64, index);
    status = pdm_gguf__read_str(cur, &kv->key);
    if (status) return status;
    if (kv->key.len == 0) {
        return pdm_error_set(PDM_EFORMAT, "%s: metadata pair #%" PRIu64 " has an empty key",
                             cur->name, index);
    }
    pdm_gguf__quote(kv->key, key);

    snprintf(cur->what, sizeof(cur->what), "the value type of metadata '%s'", key);
    status = pdm_gguf__read_u32(cur, &type);
    if (status) return status;
    if (type >= PDM_GGUF_TYPE_COUNT_) {
        return pdm_error_set(PDM_EUNSUPPORTED, "%s: metadata '%s' has unknown value type %" PRIu32,
                             cur->name, key, type);
    }

    if (type == PDM_GGUF_ARRAY) {
        status = pdm_gguf__parse_array(cur, key, kv);
        if (status) return status;
    } else if (type == PDM_GGUF_STRING) {
        snprintf(cur->what, sizeof(cur->what), "the value of metadata '%s'", key);
        status = pdm_gguf__read_str(cur, &kv->v.str);
        if (status) return status;
    } else {
        size_t size = pdm_gguf_scalar_size(type);
        snprintf(cur->what, sizeof(cur->what), "the value of metadata '%s'", key);
        status = pdm_gguf__need(cur, size);
        if (status) return status;
        if (type == PDM_GGUF_BOOL && cur->base[cur->pos] > 1) {
            return pdm_error_set(PDM_EFORMAT, "%s: bool metadata '%s' has value %u (must be 0 "
                                 "or 1)", cur->name, key, cur->base[cur->pos]);
        }
        pdm_gguf__decode_scalar(type, cur->base + cur->pos, kv);
        cur->pos += size;
    }
    kv->type = (pdm_gguf_type_t)type;
    return 0;
}

/* Parses tensor info number `index`: name, dimensions, type and offset. Validates the
 * dimensions and type and computes nbytes; offset and bounds are checked later, once the
 * alignment and the data section start are known. */
static int pdm_gguf__parse_tensor_info(pdm_gguf__cursor_t *cur, uint64_t index,
                                       pdm_gguf_tensor_t *t)
{
    char name[PDM_GGUF__QUOTE_MAX + 4];
    uint32_t n_dims, type;
    int status;

    snprintf(cur->what, sizeof(cur->what), "the name of tensor info #%" PRIu64, index);
    status = pdm_gguf__read_str(cur, &t->name);
    if (status) return status;
    if (t->name.len == 0) {
        return pdm_error_set(PDM_EFORMAT, "%s: tensor info #%" PRIu64 " has an empty name",
                             cur->name, index);
    }
    pdm_gguf__quote(t->name, name);

    snprintf(cur->what, sizeof(cur->what), "the shape of tensor '%s'", name);
    status = pdm_gguf__read_u32(cur, &n_dims);
    if (status) return status;
    if (n_dims < 1 || n_dims > PDM_GGUF__MAX_DIMS) {
        return pdm_error_set(PDM_EFORMAT, "%s: tensor '%s' has %" PRIu32 " dimensions (must be "
                             "1 to %d)", cur->name, name, n_dims, PDM_GGUF__MAX_DIMS);
    }
    t->n_dims = n_dims;
    int64_t n_elems = 1;
    for (int d = 0; d < PDM_GGUF__MAX_DIMS; d++) t->ne[d] = 1;
    for (uint32_t d = 0; d < n_dims; d++) {
        uint64_t raw;
        status = pdm_gguf__read_u64(cur, &raw);
        if (status) return status;
        int64_t ne = (int64_t)raw;
        if (ne <= 0) {
            return pdm_error_set(PDM_EFORMAT, "%s: tensor '%s' has ne[%" PRIu32 "] = %" PRId64
                                 " (must be positive)", cur->name, name, d, ne);
        }
        if (__builtin_mul_overflow(n_elems, ne, &n_elems)) {
            return pdm_error_set(PDM_EFORMAT, "%s: tensor '%s' element count overflows",
                                 cur->name, name);
        }
        t->ne[d] = ne;
    }

    snprintf(cur->what, sizeof(cur->what), "the type of tensor '%s'", name);
    status = pdm_gguf__read_u32(cur, &type);
    if (status) return status;
    if (!pdm_dtype_valid(type) || !pdm_dtype_is_weight((pdm_dtype_t)type)) {
        return pdm_error_set(PDM_EUNSUPPORTED, "%s: tensor '%s' has type %" PRIu32 " (%s), which "
                             "is not supported (%s are)", cur->name, name, type,
                             pdm_dtype_name((pdm_dtype_t)type), pdm_dtype_weight_list());
    }
    t->type = (pdm_dtype_t)type;

    /* Rows are whole blocks; the byte count is computed here with overflow checks instead of
     * pdm_dtype_row_bytes, which does not check. */
    int64_t block_elems = pdm_dtype_block_elems(t->type);
    if (t->ne[0] % block_elems != 0) {
        return pdm_error_set(PDM_EFORMAT, "%s: tensor '%s' row length ne[0] = %" PRId64 " is not "
                             "a multiple of the %s block size %" PRId64,
                             cur->name, name, t->ne[0], pdm_dtype_name(t->type), block_elems);
    }
    size_t row_bytes, nbytes;
    uint64_t n_rows = (uint64_t)(n_elems / t->ne[0]);
    if (pdm_size_mul((size_t)(t->ne[0] / block_elems), pdm_dtype_block_bytes(t->type),
                     &row_bytes) ||
        n_rows > SIZE_MAX || pdm_size_mul(row_bytes, (size_t)n_rows, &nbytes)) {
        return pdm_error_set(PDM_EFORMAT, "%s: tensor '%s' byte size overflows", cur->name, name);
    }
    t->nbytes = nbytes;

    snprintf(cur->what, sizeof(cur->what), "the data offset of tensor '%s'", name);
    return pdm_gguf__read_u64(cur, &t->offset);
}

static int pdm_gguf__str_cmp(pdm_gguf_str_t a, pdm_gguf_str_t b)
{
    size_t n = a.len < b.len ? (size_t)a.len : (size_t)b.len;
    int c = n ? memcmp(a.ptr, b.ptr, n) : 0;
    if (c) return c;
    return (a.len > b.len) - (a.len < b.len);
}

static int pdm_gguf__kv_ptr_cmp(const void *a, const void *b)
{
    const pdm_gguf_kv_t *x = *(const pdm_gguf_kv_t *const *)a;
    const pdm_gguf_kv_t *y = *(const pdm_gguf_kv_t *const *)b;
    return pdm_gguf__str_cmp(x->key, y->key);
}

static int pdm_gguf__tensor_name_cmp(const void *a, const void *b)
{
    const pdm_gguf_tensor_t *x = *(const pdm_gguf_tensor_t *const *)a;
    const pdm_gguf_tensor_t *y = *(const pdm_gguf_tensor_t *const *)b;
    return pdm_gguf__str_cmp(x->name, y->name);
}

static int pdm_gguf__tensor_offset_cmp(const void *a, const void *b)
{
    const pdm_gguf_tensor_t *x = *(const pdm_gguf_tensor_t *const *)a;
    const pdm_gguf_tensor_t *y = *(const pdm_gguf_tensor_t *const *)b;
    return (x->offset > y->offset) - (x->offset < y->offset);
}

/* Sets g->alignment from `general.alignment` if present (uint32, a power of two). */
static int pdm_gguf__parse_alignment(pdm_gguf_t *g)
{
    g->alignment = PDM_GGUF__DEFAULT_ALIGNMENT;
    const pdm_gguf_kv_t *kv = pdm_gguf_find(g, "general.alignment");
    if (!kv) return 0;
    if (kv->type != PDM_GGUF_UINT32) {
        return pdm_error_set(PDM_EFORMAT, "%s: general.alignment has type %s (must be uint32)",
                             g->name, pdm_gguf__type_name(kv->type));
    }
    uint64_t a = kv->v.u64;
    if (a == 0 || (a & (a - 1)) != 0) {
        return pdm_error_set(PDM_EFORMAT, "%s: general.alignment = %" PRIu64 " is not a power "
                             "of two", g->name, a);
    }
    g->alignment = (size_t)a;
    return 0;
}

/* Checks every tensor's offset alignment and bounds, sets its data pointer, and rejects
 * overlapping tensors (sorted by offset into a temporary array). */
static int pdm_gguf__place_tensors(pdm_gguf_t *g)
{
    char name[PDM_GGUF__QUOTE_MAX + 4], other[PDM_GGUF__QUOTE_MAX + 4];
    const pdm_gguf_tensor_t **by_offset = NULL;
    int status = 0;

    if (g->n_tensors == 0) return 0;
    if (g->data_offset > g->size) {
        return pdm_error_set(PDM_EFORMAT, "%s: the tensor data section would start at offset %zu, "
                             "past the end of the file (size %zu)",
                             g->name, g->data_offset, g->size);
    }
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        pdm_gguf_tensor_t *t = &g->tensors[i];
        size_t start, end;
        if (t->offset % g->alignment != 0) {
            return pdm_error_set(PDM_EFORMAT, "%s: tensor '%s' data offset %" PRIu64 " is not a "
                                 "multiple of the alignment %zu",
                                 g->name, pdm_gguf__quote(t->name, name), t->offset, g->alignment);
        }
        if (t->offset > SIZE_MAX || pdm_size_add(g->data_offset, (size_t)t->offset, &start) ||
            pdm_size_add(start, t->nbytes, &end) || end > g->size) {
            return pdm_error_set(PDM_EFORMAT, "%s: tensor '%s' data [offset %" PRIu64 " in the "
                                 "data section at %zu, %zu bytes] is out of bounds of the file "
                                 "(size %zu)", g->name, pdm_gguf__quote(t->name, name),
                                 t->offset, g->data_offset, t->nbytes, g->size);
        }
        t->data = g->base + start;
    }

    by_offset = malloc((size_t)g->n_tensors * sizeof(*by_offset));
    if (!by_offset) {
        return pdm_error_set(PDM_ENOMEM, "%s: out of memory checking tensor overlaps", g->name);
    }
    for (uint64_t i = 0; i < g->n_tensors; i++) by_offset[i] = &g->tensors[i];
    qsort(by_offset, (size_t)g->n_tensors, sizeof(*by_offset), pdm_gguf__tensor_offset_cmp);
    for (uint64_t i = 1; i < g->n_tensors; i++) {
        const pdm_gguf_tensor_t *prev = by_offset[i - 1], *t = by_offset[i];
        /* prev->offset + prev->nbytes cannot overflow: it is inside the file. */
        if (prev->offset + prev->nbytes > t->offset) {
            status = pdm_error_set(PDM_EFORMAT, "%s: tensors '%s' [offset %" PRIu64 ", %zu bytes] "
                                   "and '%s' [offset %" PRIu64 ", %zu bytes] overlap", g->name,
                                   pdm_gguf__quote(prev->name, name), prev->offset, prev->nbytes,
                                   pdm_gguf__quote(t->name, other), t->offset, t->nbytes);
            goto err_free;
        }
    }
    status = 0;

err_free:
    free(by_offset);
    return status;
}

/* Parses and validates the whole file held in g->base / g->size into `g`. On error returns a
 * negative status with a message; whatever was allocated so far is left in `g` for
 * pdm_gguf_close to free. */
static int pdm_gguf__parse(pdm_gguf_t *g)
{
    char quoted[PDM_GGUF__QUOTE_MAX + 4];
    pdm_gguf__cursor_t cur = {.name = g->name, .base = g->base, .size = g->size, .pos = 0};
    int status;

    /* Header. */
    snprintf(cur.what, sizeof(cur.what), "the magic");
    status = pdm_gguf__need(&cur, 4);
    if (status) return status;
    if (memcmp(g->base, "GGUF", 4) != 0) {
        return pdm_error_set(PDM_EFORMAT, "%s: not a GGUF file (magic is %02x %02x %02x %02x, "
                             "expected \"GGUF\")", g->name, g->base[0], g->base[1], g->base[2],
                             g->base[3]);
    }
    cur.pos = 4;
    snprintf(cur.what, sizeof(cur.what), "the version");
    status = pdm_gguf__read_u32(&cur, &g->version);
    if (status) return status;
    if (g->version != 2 && g->version != 3) {
        uint32_t swapped = __builtin_bswap32(g->version);
        if (g->version == 1) {
            return pdm_error_set(PDM_EUNSUPPORTED, "%s: GGUF version 1 is not supported (only "
                                 "versions 2 and 3 are); convert the file again", g->name);
        }
        if (swapped >= 1 && swapped <= 3) {
            return pdm_error_set(PDM_EUNSUPPORTED, "%s: big-endian GGUF files are not supported",
                                 g->name);
        }
        return pdm_error_set(PDM_EUNSUPPORTED, "%s: unsupported GGUF version %" PRIu32
                             " (only 2 and 3 are supported)", g->name, g->version);
    }
    snprintf(cur.what, sizeof(cur.what), "the tensor count");
    status = pdm_gguf__read_u64(&cur, &g->n_tensors);
    if (status) return status;
    snprintf(cur.what, sizeof(cur.what), "the metadata count");
    status = pdm_gguf__read_u64(&cur, &g->n_kv);
    if (status) return status;

    /* Counts that cannot fit in the rest of the file are rejected before any allocation. */
    size_t left = cur.size - cur.pos;
    if (g->n_kv > left / PDM_GGUF__MIN_KV_BYTES) {
        return pdm_error_set(PDM_EFORMAT, "%s: metadata count %" PRIu64 " cannot fit in the %zu "
                             "bytes after the header", g->name, g->n_kv, left);
    }
    if (g->n_tensors > left / PDM_GGUF__MIN_TENSOR_INFO_BYTES) {
        return pdm_error_set(PDM_EFORMAT, "%s: tensor count %" PRIu64 " cannot fit in the %zu "
                             "bytes after the header", g->name, g->n_tensors, left);
    }
    if ((size_t)g->n_kv * PDM_GGUF__MIN_KV_BYTES >
        left - (size_t)g->n_tensors * PDM_GGUF__MIN_TENSOR_INFO_BYTES) {
        return pdm_error_set(PDM_EFORMAT, "%s: %" PRIu64 " metadata pairs and %" PRIu64
                             " tensor infos cannot fit in the %zu bytes after the header",
                             g->name, g->n_kv, g->n_tensors, left);
    }

    /* Metadata. */
    if (g->n_kv > 0) {
        g->kvs = calloc((size_t)g->n_kv, sizeof(*g->kvs));
        g->kv_by_key = malloc((size_t)g->n_kv * sizeof(*g->kv_by_key));
        if (!g->kvs || !g->kv_by_key) {
            return pdm_error_set(PDM_ENOMEM, "%s: out of memory for %" PRIu64 " metadata pairs",
                                 g->name, g->n_kv);
        }
    }
    for (uint64_t i = 0; i < g->n_kv; i++) {
        status = pdm_gguf__parse_kv(&cur, i, &g->kvs[i]);
        if (status) return status;
        g->kv_by_key[i] = &g->kvs[i];
    }
    if (g->n_kv > 1) {
        qsort(g->kv_by_key, (size_t)g->n_kv, sizeof(*g->kv_by_key), pdm_gguf__kv_ptr_cmp);
        for (uint64_t i = 1; i < g->n_kv; i++) {
            if (pdm_gguf__str_cmp(g->kv_by_key[i - 1]->key, g->kv_by_key[i]->key) == 0) {
                return pdm_error_set(PDM_EFORMAT, "%s: duplicate metadata key '%s'", g->name,
                                     pdm_gguf__quote(g->kv_by_key[i]->key, quoted));
            }
        }
    }
    status = pdm_gguf__parse_alignment(g);
    if (status) return status;

    /* Tensor infos. */
    if (g->n_tensors > 0) {
        g->tensors = calloc((size_t)g->n_tensors, sizeof(*g->tensors));
        g->tensor_by_name = malloc((size_t)g->n_tensors * sizeof(*g->tensor_by_name));
        if (!g->tensors || !g->tensor_by_name) {
            return pdm_error_set(PDM_ENOMEM, "%s: out of memory for %" PRIu64 " tensor infos",
                                 g->name, g->n_tensors);
        }
    }
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        status = pdm_gguf__parse_tensor_info(&cur, i, &g->tensors[i]);
        if (status) return status;
        g->tensor_by_name[i] = &g->tensors[i];
    }
    if (g->n_tensors > 1) {
        qsort(g->tensor_by_name, (size_t)g->n_tensors, sizeof(*g->tensor_by_name),
              pdm_gguf__tensor_name_cmp);
        for (uint64_t i = 1; i < g->n_tensors; i++) {
            if (pdm_gguf__str_cmp(g->tensor_by_name[i - 1]->name, g->tensor_by_name[i]->name) ==
                0) {
                return pdm_error_set(PDM_EFORMAT, "%s: duplicate tensor name '%s'", g->name,
                                     pdm_gguf__quote(g->tensor_by_name[i]->name, quoted));
            }
        }
    }

    /* Tensor data: the section starts at the aligned end of the infos. */
    if (pdm_size_add(cur.pos, g->alignment - 1, &g->data_offset)) {
        return pdm_error_set(PDM_EFORMAT, "%s: data section offset overflows", g->name);
    }
    g->data_offset &= ~(g->alignment - 1);
    return pdm_gguf__place_tensors(g);
}

/* Builds a handle over `size` bytes at `base` named `name` and validates it. On success the
 * handle does not own `base`; on error everything is freed and *out is untouched. */
static int pdm_gguf__open_mem(const uint8_t *base, size_t size, const char *name,
                              pdm_gguf_t **out)
{
    static const uint8_t empty[1];
    int status;

    pdm_gguf_t *g = calloc(1, sizeof(*g));
    if (!g) return pdm_error_set(PDM_ENOMEM, "%s: out of memory", name);
    g->name = strdup(name);
    if (!g->name) {
        status = pdm_error_set(PDM_ENOMEM, "%s: out of memory", name);
        goto err_close;
    }
    /* A NULL buffer of size 0 becomes a real (empty) one so no arithmetic touches NULL. */
    g->base = base ? base : empty;
    g->size = size;
    status = pdm_gguf__parse(g);
    if (status) goto err_close;
    *out = g;
    return PDM_OK;

err_close:
    pdm_gguf_close(g);
    return status;
}

/* Validates `size` bytes at `buf` (which the caller keeps alive until pdm_gguf_close). A NULL
 * name becomes "<buffer>" in messages. */
int pdm_gguf_open_buffer(const void *buf, size_t size, const char *name, pdm_gguf_t **out)
{
    if (!name) name = "<buffer>";
    if (!out || (!buf && size > 0)) {
        return pdm_error_set(PDM_EINVAL, "%s: pdm_gguf_open_buffer: NULL argument", name);
    }
    return pdm_gguf__open_mem(buf, size, name, out);
}

/* Maps `path` read-only and validates it. Only regular, non-empty files are accepted; open,
 * stat and mmap failures return -errno. On error nothing stays open or mapped. The file must
 * not be truncated by someone else while it is mapped (that would raise SIGBUS on access). */
int pdm_gguf_open(const char *path, pdm_gguf_t **out)
{
    struct stat st;
    pdm_gguf_t *g;
    void *map;
    size_t size;
    int status;

    if (!path || !out) return pdm_error_set(PDM_EINVAL, "pdm_gguf_open: NULL argument");
    /* O_NONBLOCK so that a FIFO is rejected below instead of blocking the open. */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        status = -errno;
        return pdm_error_set(status, "%s: cannot open: %s", path, pdm_strerror(status));
    }
    if (fstat(fd, &st) != 0) {
        status = -errno;
        pdm_error_set(status, "%s: cannot stat: %s", path, pdm_strerror(status));
        goto err_close_fd;
    }
    if (S_ISDIR(st.st_mode)) {
        status = pdm_error_set(-EISDIR, "%s: is a directory, not a GGUF file", path);
        goto err_close_fd;
    }
    if (!S_ISREG(st.st_mode)) {
        status = pdm_error_set(PDM_EINVAL, "%s: not a regular file", path);
        goto err_close_fd;
    }
    if (st.st_size == 0) {
        status = pdm_error_set(PDM_EFORMAT, "%s: file is empty, not a GGUF file", path);
        goto err_close_fd;
    }
    if ((uint64_t)st.st_size > SIZE_MAX) {
        status = pdm_error_set(PDM_EFORMAT, "%s: file is too large to map", path);
        goto err_close_fd;
    }
    size = (size_t)st.st_size;
    map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED) {
        status = -errno;
        pdm_error_set(status, "%s: cannot mmap %zu bytes: %s", path, size, pdm_strerror(status));
        goto err_close_fd;
    }
    /* The mapping keeps the file alive; the descriptor is no longer needed. */
    close(fd);

    status = pdm_gguf__open_mem(map, size, path, &g);
    if (status) goto err_unmap;
    g->map = map;
    g->map_size = size;
    *out = g;
    return PDM_OK;

err_unmap:
    munmap(map, size);
    return status;
err_close_fd:
    close(fd);
    return status;
}

/* Frees the handle, including one left half-built by a failed parse. Accepts NULL. */
void pdm_gguf_close(pdm_gguf_t *g)
{
    if (!g) return;
    for (uint64_t i = 0; g->kvs && i < g->n_kv; i++) {
        pdm_gguf_kv_t *kv = &g->kvs[i];
        if (kv->type == PDM_GGUF_ARRAY && kv->v.arr.type == PDM_GGUF_STRING)
            free((void *)kv->v.arr.str_offsets);
    }
    free(g->kvs);
    free(g->kv_by_key);
    free(g->tensors);
    free(g->tensor_by_name);
    if (g->map) munmap(g->map, g->map_size);
    free(g->name);
    free(g);
}

uint32_t pdm_gguf_version(const pdm_gguf_t *g) { return g->version; }
const char *pdm_gguf_path(const pdm_gguf_t *g) { return g->name; }
size_t pdm_gguf_alignment(const pdm_gguf_t *g) { return g->alignment; }
size_t pdm_gguf_file_size(const pdm_gguf_t *g) { return g->size; }
uint64_t pdm_gguf_n_kv(const pdm_gguf_t *g) { return g->n_kv; }
uint64_t pdm_gguf_n_tensors(const pdm_gguf_t *g) { return g->n_tensors; }

const pdm_gguf_kv_t *pdm_gguf_kv_at(const pdm_gguf_t *g, uint64_t i)
{
    return i < g->n_kv ? &g->kvs[i] : NULL;
}

const pdm_gguf_tensor_t *pdm_gguf_tensor_at(const pdm_gguf_t *g, uint64_t i)
{
    return i < g->n_tensors ? &g->tensors[i] : NULL;
}

int pdm_gguf_str_eq(pdm_gguf_str_t s, const char *c)
{
    size_t n = strlen(c);
    return s.len == n && (n == 0 || memcmp(s.ptr, c, n) == 0);
}

/* Binary search of the pair with key `key` in the sorted index; NULL if absent. */
const pdm_gguf_kv_t *pdm_gguf_find(const pdm_gguf_t *g, const char *key)
{
    pdm_gguf_str_t k = {key, strlen(key)};
    size_t lo = 0, hi = (size_t)g->n_kv;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = pdm_gguf__str_cmp(g->kv_by_key[mid]->key, k);
        if (c == 0) return g->kv_by_key[mid];
        if (c < 0) lo = mid + 1;
        else hi = mid;
    }
    return NULL;
}

/* Binary search of the tensor named `name` in the sorted index; NULL if absent. */
const pdm_gguf_tensor_t *pdm_gguf_tensor(const pdm_gguf_t *g, const char *name)
{
    pdm_gguf_str_t k = {name, strlen(name)};
    size_t lo = 0, hi = (size_t)g->n_tensors;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = pdm_gguf__str_cmp(g->tensor_by_name[mid]->name, k);
        if (c == 0) return g->tensor_by_name[mid];
        if (c < 0) lo = mid + 1;
        else hi = mid;
    }
    return NULL;
}

/* ---- Typed getters ---------------------------------------------------------------------- */

/* Finds `key` or returns PDM_ENOTFOUND with a message naming the file and the key. */
static int pdm_gguf__lookup(const pdm_gguf_t *g, const char *key, const pdm_gguf_kv_t **out)
{
    *out = pdm_gguf_find(g, key);
    if (*out) return PDM_OK;
    return pdm_error_set(PDM_ENOTFOUND, "%s: metadata key '%s' not found", g->name, key);
}

static int pdm_gguf__type_error(const pdm_gguf_t *g, const pdm_gguf_kv_t *kv, const char *key,
                                const char *wanted)
{
    return pdm_error_set(PDM_EFORMAT, "%s: metadata '%s' has type %s, expected %s", g->name, key,
                         pdm_gguf__type_name(kv->type), wanted);
}

/* Reads an integer pair as an unsigned value no larger than `max` (`what` names the target
 * type in messages). Negative values, non-integers and values above max are PDM_EFORMAT. */
static int pdm_gguf__get_unsigned(const pdm_gguf_t *g, const char *key, uint64_t max,
                                  const char *what, uint64_t *out)
{
    const pdm_gguf_kv_t *kv;
    uint64_t v;
    int status = pdm_gguf__lookup(g, key, &kv);
    if (status) return status;
    switch (kv->type) {
    case PDM_GGUF_UINT8:
    case PDM_GGUF_UINT16:
    case PDM_GGUF_UINT32:
    case PDM_GGUF_UINT64:
        v = kv->v.u64;
        break;
    case PDM_GGUF_INT8:
    case PDM_GGUF_INT16:
    case PDM_GGUF_INT32:
    case PDM_GGUF_INT64:
        if (kv->v.i64 < 0) {
            return pdm_error_set(PDM_EFORMAT, "%s: metadata '%s' = %" PRId64 " does not fit in %s",
                                 g->name, key, kv->v.i64, what);
        }
        v = (uint64_t)kv->v.i64;
        break;
    default:
        return pdm_gguf__type_error(g, kv, key, what);
    }
    if (v > max) {
        return pdm_error_set(PDM_EFORMAT, "%s: metadata '%s' = %" PRIu64 " does not fit in %s",
                             g->name, key, v, what);
    }
    *out = v;
    return PDM_OK;
}

int pdm_gguf_get_u32(const pdm_gguf_t *g, const char *key, uint32_t *out)
{
    uint64_t v;
    int status = pdm_gguf__get_unsigned(g, key, UINT32_MAX, "uint32", &v);
    if (status) return status;
    *out = (uint32_t)v;
    return PDM_OK;
}

int pdm_gguf_get_u64(const pdm_gguf_t *g, const char *key, uint64_t *out)
{
    return pdm_gguf__get_unsigned(g, key, UINT64_MAX, "uint64", out);
}

int pdm_gguf_get_f32(const pdm_gguf_t *g, const char *key, float *out)
{
    const pdm_gguf_kv_t *kv;
    int status = pdm_gguf__lookup(g, key, &kv);
    if (status) return status;
    if (kv->type != PDM_GGUF_FLOAT32 && kv->type != PDM_GGUF_FLOAT64)
        return pdm_gguf__type_error(g, kv, key, "float32 or float64");
    double v = kv->v.f64;
    if (isfinite(v) && fabs(v) > FLT_MAX) {
        return pdm_error_set(PDM_EFORMAT, "%s: metadata '%s' = %g does not fit in float32",
                             g->name, key, v);
    }
    *out = (float)v;
    return PDM_OK;
}

int pdm_gguf_get_bool(const pdm_gguf_t *g, const char *key, int *out)
{
    const pdm_gguf_kv_t *kv;
    int status = pdm_gguf__lookup(g, key, &kv);
    if (status) return status;
    if (kv->type != PDM_GGUF_BOOL) return pdm_gguf__type_error(g, kv, key, "bool");
    *out = kv->v.u64 != 0;
    return PDM_OK;
}

int pdm_gguf_get_str(const pdm_gguf_t *g, const char *key, pdm_gguf_str_t *out)
{
    const pdm_gguf_kv_t *kv;
    int status = pdm_gguf__lookup(g, key, &kv);
    if (status) return status;
    if (kv->type != PDM_GGUF_STRING) return pdm_gguf__type_error(g, kv, key, "string");
    *out = kv->v.str;
    return PDM_OK;
}

int pdm_gguf_get_arr(const pdm_gguf_t *g, const char *key, pdm_gguf_type_t type,
                     const pdm_gguf_kv_t **out)
{
    const pdm_gguf_kv_t *kv;
    int status = pdm_gguf__lookup(g, key, &kv);
    if (status) return status;
    if (kv->type != PDM_GGUF_ARRAY) return pdm_gguf__type_error(g, kv, key, "array");
    if (kv->v.arr.type != type) {
        return pdm_error_set(PDM_EFORMAT, "%s: metadata '%s' is an array of %s, expected an "
                             "array of %s", g->name, key, pdm_gguf__type_name(kv->v.arr.type),
                             pdm_gguf__type_name(type));
    }
    *out = kv;
    return PDM_OK;
}

/* ---- Array elements --------------------------------------------------------------------- */

/* Element i of a string array; an empty string if `arr` is not one or i is out of range
 * (a caller bug, also caught by the assert in debug builds). */
pdm_gguf_str_t pdm_gguf_arr_str(const pdm_gguf_kv_t *arr, uint64_t i)
{
    pdm_gguf_str_t s = {"", 0};
    int ok = arr->type == PDM_GGUF_ARRAY && arr->v.arr.type == PDM_GGUF_STRING && i < arr->v.arr.n;
    assert(ok);
    if (!ok) return s;
    const uint8_t *p = arr->v.arr.data + arr->v.arr.str_offsets[i];
    s.len = pdm_gguf__le64(p);
    s.ptr = (const char *)(p + 8);
    return s;
}

/* Element i of an integer (or bool) array, sign- or zero-extended; 0 on caller misuse.
 * uint64 values above INT64_MAX wrap. */
int64_t pdm_gguf_arr_int(const pdm_gguf_kv_t *arr, uint64_t i)
{
    int ok = arr->type == PDM_GGUF_ARRAY && i < arr->v.arr.n;
    assert(ok);
    if (!ok) return 0;
    uint32_t type = arr->v.arr.type;
    const uint8_t *p = arr->v.arr.data + i * pdm_gguf_scalar_size(type);
    switch (type) {
    case PDM_GGUF_UINT8:
    case PDM_GGUF_BOOL:
        return p[0];
    case PDM_GGUF_INT8:
        return (int8_t)p[0];
    case PDM_GGUF_UINT16:
        return pdm_gguf__le16(p);
    case PDM_GGUF_INT16:
        return (int16_t)pdm_gguf__le16(p);
    case PDM_GGUF_UINT32:
        return pdm_gguf__le32(p);
    case PDM_GGUF_INT32:
        return (int32_t)pdm_gguf__le32(p);
    case PDM_GGUF_UINT64:
    case PDM_GGUF_INT64:
        return (int64_t)pdm_gguf__le64(p);
    default:
        assert(!"not an integer array");
        return 0;
    }
}

/* Element i of a FLOAT32 / FLOAT64 array; 0 on caller misuse. */
double pdm_gguf_arr_float(const pdm_gguf_kv_t *arr, uint64_t i)
{
    int ok = arr->type == PDM_GGUF_ARRAY && i < arr->v.arr.n &&
             (arr->v.arr.type == PDM_GGUF_FLOAT32 || arr->v.arr.type == PDM_GGUF_FLOAT64);
    assert(ok);
    if (!ok) return 0;
    if (arr->v.arr.type == PDM_GGUF_FLOAT32) {
        uint32_t bits = pdm_gguf__le32(arr->v.arr.data + i * 4);
        float f;
        memcpy(&f, &bits, 4);
        return f;
    }
    uint64_t bits = pdm_gguf__le64(arr->v.arr.data + i * 8);
    double d;
    memcpy(&d, &bits, 8);
    return d;
}
