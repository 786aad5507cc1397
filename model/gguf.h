/*
 * gguf.h - GGUF v2/v3 reader (mmap, fully validated) and writer. Part of model.h.
 *
 * The reader maps the file read-only and validates every count, length and offset against
 * the file size before use; strings and tensor data point into the mapping and stay valid
 * until pdm_gguf_close(). Errors are returned as pdm status codes with a message naming the
 * file and the problem (pdm_error_last()).
 */
#ifndef PDM_MODEL_GGUF_H
#define PDM_MODEL_GGUF_H

#include <stddef.h>
#include <stdint.h>

#include "../kernels/kernels.h"

/* Metadata value types, numbered as in the GGUF specification. */
typedef enum {
    PDM_GGUF_UINT8 = 0,
    PDM_GGUF_INT8 = 1,
    PDM_GGUF_UINT16 = 2,
    PDM_GGUF_INT16 = 3,
    PDM_GGUF_UINT32 = 4,
    PDM_GGUF_INT32 = 5,
    PDM_GGUF_FLOAT32 = 6,
    PDM_GGUF_BOOL = 7,
    PDM_GGUF_STRING = 8,
    PDM_GGUF_ARRAY = 9,
    PDM_GGUF_UINT64 = 10,
    PDM_GGUF_INT64 = 11,
    PDM_GGUF_FLOAT64 = 12,
    PDM_GGUF_TYPE_COUNT_
} pdm_gguf_type_t;

/* A string inside the mapping: not NUL-terminated. */
typedef struct {
    const char *ptr;
    uint64_t len;
} pdm_gguf_str_t;

/* One metadata key/value pair. Scalars are decoded; arrays point at their raw elements. */
typedef struct {
    pdm_gguf_str_t key;
    pdm_gguf_type_t type;
    union {
        uint64_t u64; /* every unsigned integer type and BOOL, widened */
        int64_t i64;  /* every signed integer type, widened */
        double f64;   /* FLOAT32 and FLOAT64, widened */
        pdm_gguf_str_t str;
        struct {
            pdm_gguf_type_t type; /* element type; never ARRAY (nested arrays are rejected) */
            uint64_t n;           /* element count */
            const uint8_t *data;  /* first element, raw little-endian */
            /* For STRING arrays: [n] offsets of each element's length prefix from `data`,
             * built at open time so element access is O(1). NULL otherwise. */
            const uint64_t *str_offsets;
        } arr;
    } v;
} pdm_gguf_kv_t;

/* Tensor dimensions follow GGUF: ne[0] is the innermost (contiguous) dimension. */
typedef struct {
    pdm_gguf_str_t name;
    uint32_t n_dims;   /* 1..4 */
    int64_t ne[4];     /* unused dims are 1 */
    pdm_dtype_t type;
    uint64_t offset;   /* relative to the data section */
    const void *data;  /* inside the mapping */
    size_t nbytes;
} pdm_gguf_tensor_t;

typedef struct pdm_gguf pdm_gguf_t;

/* Opens and validates `path`. On success *out owns the mapping; on error nothing is left
 * open, *out is untouched and the message names the file and the problem. */
int pdm_gguf_open(const char *path, pdm_gguf_t **out);
/* Same as pdm_gguf_open on a caller-owned buffer that must outlive the handle (fuzzing, tests).
 * `name` is used in messages. */
int pdm_gguf_open_buffer(const void *buf, size_t size, const char *name, pdm_gguf_t **out);
void pdm_gguf_close(pdm_gguf_t *g);

uint32_t pdm_gguf_version(const pdm_gguf_t *g);
const char *pdm_gguf_path(const pdm_gguf_t *g);
size_t pdm_gguf_alignment(const pdm_gguf_t *g);
/* Bytes of one scalar of metadata type `type` (0 for STRING, ARRAY and unknown types). */
size_t pdm_gguf_scalar_size(uint32_t type);
size_t pdm_gguf_file_size(const pdm_gguf_t *g);

uint64_t pdm_gguf_n_kv(const pdm_gguf_t *g);
const pdm_gguf_kv_t *pdm_gguf_kv_at(const pdm_gguf_t *g, uint64_t i);
/* The pair with key `key`, or NULL. */
const pdm_gguf_kv_t *pdm_gguf_find(const pdm_gguf_t *g, const char *key);

/* Typed getters. They return PDM_ENOTFOUND if the key is missing, PDM_EFORMAT (with a
 * message) if its type does not fit (integers convert between widths only when the value
 * fits; floats accept FLOAT32/FLOAT64), and PDM_OK otherwise. */
int pdm_gguf_get_u32(const pdm_gguf_t *g, const char *key, uint32_t *out);
int pdm_gguf_get_u64(const pdm_gguf_t *g, const char *key, uint64_t *out);
int pdm_gguf_get_f32(const pdm_gguf_t *g, const char *key, float *out);
int pdm_gguf_get_bool(const pdm_gguf_t *g, const char *key, int *out);
int pdm_gguf_get_str(const pdm_gguf_t *g, const char *key, pdm_gguf_str_t *out);
/* An array of element type `type` (PDM_EFORMAT if the element type differs). */
int pdm_gguf_get_arr(const pdm_gguf_t *g, const char *key, pdm_gguf_type_t type,
                     const pdm_gguf_kv_t **out);

/* Element i of an array (i must be < n; bounds already validated at open). */
pdm_gguf_str_t pdm_gguf_arr_str(const pdm_gguf_kv_t *arr, uint64_t i);
int64_t pdm_gguf_arr_int(const pdm_gguf_kv_t *arr, uint64_t i);   /* any integer type */
double pdm_gguf_arr_float(const pdm_gguf_kv_t *arr, uint64_t i);  /* FLOAT32 / FLOAT64 */

uint64_t pdm_gguf_n_tensors(const pdm_gguf_t *g);
const pdm_gguf_tensor_t *pdm_gguf_tensor_at(const pdm_gguf_t *g, uint64_t i);
const pdm_gguf_tensor_t *pdm_gguf_tensor(const pdm_gguf_t *g, const char *name);

/* Compares a GGUF string with a C string. */
int pdm_gguf_str_eq(pdm_gguf_str_t s, const char *c);

/* ---- Writer (tests, tools): builds a GGUF v3 file in memory, then writes it. ------------- */

typedef struct pdm_gguf_writer pdm_gguf_writer_t;

pdm_gguf_writer_t *pdm_gguf_writer_create(void);
void pdm_gguf_writer_destroy(pdm_gguf_writer_t *w);
int pdm_gguf_writer_set_u32(pdm_gguf_writer_t *w, const char *key, uint32_t v);
int pdm_gguf_writer_set_i32(pdm_gguf_writer_t *w, const char *key, int32_t v);
int pdm_gguf_writer_set_f32(pdm_gguf_writer_t *w, const char *key, float v);
int pdm_gguf_writer_set_bool(pdm_gguf_writer_t *w, const char *key, int v);
int pdm_gguf_writer_set_str(pdm_gguf_writer_t *w, const char *key, const char *v);
/* Arrays: elements are copied. Strings are NUL-terminated. */
int pdm_gguf_writer_set_arr_str(pdm_gguf_writer_t *w, const char *key, const char *const *v,
                                uint64_t n);
int pdm_gguf_writer_set_arr_i32(pdm_gguf_writer_t *w, const char *key, const int32_t *v,
                                uint64_t n);
int pdm_gguf_writer_set_arr_f32(pdm_gguf_writer_t *w, const char *key, const float *v,
                                uint64_t n);
/* Copies a metadata pair read from a file (any value type, arrays of strings included). */
int pdm_gguf_writer_copy_kv(pdm_gguf_writer_t *w, const pdm_gguf_kv_t *kv);
/* Adds a tensor with raw data already in `type`'s layout (copied). */
int pdm_gguf_writer_add_tensor(pdm_gguf_writer_t *w, const char *name, pdm_dtype_t type,
                               uint32_t n_dims, const int64_t *ne, const void *data);
/* Serialises to `path` (alignment 32). */
int pdm_gguf_writer_write(pdm_gguf_writer_t *w, const char *path);

#endif /* PDM_MODEL_GGUF_H */
