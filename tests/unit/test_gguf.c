/*
 * test_gguf.c - the GGUF reader and writer: round trips, hand-built v2/v3 files with every
 * value type, every kind of corruption, truncation at every length, random byte flips, and
 * the real model when present.
 *
 * Files given to pdm_gguf_open_buffer are copied into allocations of exactly their size, so
 * that AddressSanitizer catches any read past the end.
 */
#include "tests.h"

#include "common/pdm.h"
#include "model/gguf.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- A byte builder for hand-made files ------------------------------------------------- */

typedef struct {
    uint8_t *p; /* [len] bytes, [cap] allocated */
    size_t len, cap;
} tb_t;

static void tb_put(tb_t *b, const void *src, size_t n)
{
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n) cap *= 2;
        b->p = realloc(b->p, cap);
        ck_assert_ptr_nonnull(b->p);
        b->cap = cap;
    }
    if (n) memcpy(b->p + b->len, src, n);
    b->len += n;
}

static void tb_u8(tb_t *b, uint8_t v) { tb_put(b, &v, 1); }
static void tb_u16(tb_t *b, uint16_t v)
{
    tb_u8(b, (uint8_t)v);
    tb_u8(b, (uint8_t)(v >> 8));
}
static void tb_u32(tb_t *b, uint32_t v)
{
    tb_u16(b, (uint16_t)v);
    tb_u16(b, (uint16_t)(v >> 16));
}
static void tb_u64(tb_t *b, uint64_t v)
{
    tb_u32(b, (uint32_t)v);
    tb_u32(b, (uint32_t)(v >> 32));
}
static void tb_f32(tb_t *b, float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    tb_u32(b, u);
}
static void tb_f64(tb_t *b, double d)
{
    uint64_t u;
    memcpy(&u, &d, 8);
    tb_u64(b, u);
}
static void tb_str(tb_t *b, const char *s)
{
    tb_u64(b, strlen(s));
    tb_put(b, s, strlen(s));
}
static void tb_zeros(tb_t *b, size_t n)
{
    for (size_t i = 0; i < n; i++) tb_u8(b, 0);
}
static void tb_pad(tb_t *b, size_t align) { tb_zeros(b, (align - b->len % align) % align); }
static void tb_free(tb_t *b)
{
    free(b->p);
    memset(b, 0, sizeof(*b));
}

static void tb_header(tb_t *b, uint32_t version, uint64_t n_tensors, uint64_t n_kv)
{
    tb_put(b, "GGUF", 4);
    tb_u32(b, version);
    tb_u64(b, n_tensors);
    tb_u64(b, n_kv);
}
/* A key and its value type; the value follows. */
static void tb_key(tb_t *b, const char *key, pdm_gguf_type_t type)
{
    tb_str(b, key);
    tb_u32(b, type);
}
static void tb_kv_u32(tb_t *b, const char *key, uint32_t v)
{
    tb_key(b, key, PDM_GGUF_UINT32);
    tb_u32(b, v);
}
static void tb_kv_str(tb_t *b, const char *key, const char *v)
{
    tb_key(b, key, PDM_GGUF_STRING);
    tb_str(b, v);
}
/* An array header: key, ARRAY, element type, count; the elements follow. */
static void tb_arr(tb_t *b, const char *key, pdm_gguf_type_t elem_type, uint64_t n)
{
    tb_key(b, key, PDM_GGUF_ARRAY);
    tb_u32(b, elem_type);
    tb_u64(b, n);
}
static void tb_tensor(tb_t *b, const char *name, uint32_t n_dims, const int64_t *ne,
                      uint32_t type, uint64_t offset)
{
    tb_str(b, name);
    tb_u32(b, n_dims);
    for (uint32_t d = 0; d < n_dims; d++) tb_u64(b, (uint64_t)ne[d]);
    tb_u32(b, type);
    tb_u64(b, offset);
}

/* A v3 file with no metadata and one tensor, followed by `data_bytes` bytes of data. */
static void tb_one_tensor(tb_t *b, const char *name, uint32_t n_dims, const int64_t *ne,
                          uint32_t type, uint64_t offset, size_t data_bytes)
{
    tb_header(b, 3, 1, 0);
    tb_tensor(b, name, n_dims, ne, type, offset);
    tb_pad(b, 32);
    tb_zeros(b, data_bytes);
}

/* ---- Helpers ------------------------------------------------------------------------------ */

static char sentinel_storage;
#define SENTINEL ((pdm_gguf_t *)(void *)&sentinel_storage)

static char *tmp_path(const char *name)
{
    static char path[1024];
    snprintf(path, sizeof(path), "%s/%s", pdm_test_tmpdir(), name);
    return path;
}

static void write_file(const char *path, const void *data, size_t len)
{
    FILE *f = fopen(path, "wb");
    ck_assert_ptr_nonnull(f);
    ck_assert_uint_eq(fwrite(data, 1, len, f), len);
    ck_assert_int_eq(fclose(f), 0);
}

static uint8_t *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    ck_assert_ptr_nonnull(f);
    ck_assert_int_eq(fseek(f, 0, SEEK_END), 0);
    long n = ftell(f);
    ck_assert_int_ge(n, 0);
    rewind(f);
    uint8_t *p = malloc((size_t)n + 1);
    ck_assert_ptr_nonnull(p);
    ck_assert_uint_eq(fread(p, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    *len = (size_t)n;
    return p;
}

/* A copy of `len` bytes in an allocation of exactly that size (NULL when len is 0). */
static uint8_t *exact_copy(const void *src, size_t len)
{
    if (len == 0) return NULL;
    uint8_t *p = malloc(len);
    ck_assert_ptr_nonnull(p);
    memcpy(p, src, len);
    return p;
}

/* Reads everything a handle exposes, so that sanitizers see any bad pointer. */
static uint64_t walk(const pdm_gguf_t *g)
{
    uint64_t sum = 0;
    for (uint64_t i = 0; i < pdm_gguf_n_kv(g); i++) {
        const pdm_gguf_kv_t *kv = pdm_gguf_kv_at(g, i);
        for (uint64_t j = 0; j < kv->key.len; j++) sum += (uint8_t)kv->key.ptr[j];
        if (kv->type == PDM_GGUF_STRING) {
            for (uint64_t j = 0; j < kv->v.str.len; j++) sum += (uint8_t)kv->v.str.ptr[j];
        } else if (kv->type == PDM_GGUF_ARRAY) {
            for (uint64_t j = 0; j < kv->v.arr.n; j++) {
                switch (kv->v.arr.type) {
                case PDM_GGUF_STRING: {
                    pdm_gguf_str_t s = pdm_gguf_arr_str(kv, j);
                    for (uint64_t k = 0; k < s.len; k++) sum += (uint8_t)s.ptr[k];
                    break;
                }
                case PDM_GGUF_FLOAT32:
                case PDM_GGUF_FLOAT64:
                    sum += (uint64_t)(pdm_gguf_arr_float(kv, j) != 0);
                    break;
                default:
                    sum += (uint64_t)pdm_gguf_arr_int(kv, j);
                    break;
                }
            }
        } else {
            sum += kv->v.u64;
        }
        ck_assert_ptr_eq(pdm_gguf_kv_at(g, i), kv);
    }
    ck_assert_ptr_null(pdm_gguf_kv_at(g, pdm_gguf_n_kv(g)));
    for (uint64_t i = 0; i < pdm_gguf_n_tensors(g); i++) {
        const pdm_gguf_tensor_t *t = pdm_gguf_tensor_at(g, i);
        const uint8_t *d = t->data;
        ck_assert_uint_gt(t->nbytes, 0);
        sum += d[0] + d[t->nbytes - 1];
        for (uint64_t j = 0; j < t->name.len; j++) sum += (uint8_t)t->name.ptr[j];
    }
    ck_assert_ptr_null(pdm_gguf_tensor_at(g, pdm_gguf_n_tensors(g)));
    return sum;
}

/* Opens `len` bytes both as a buffer named `name` and as a file tmpdir/name; both must fail
 * with `status`, leave the output untouched and record a message naming the buffer or file
 * and containing `needle` (if not NULL). */
static void expect_fail_(const void *bytes, size_t len, const char *name, int status,
                         const char *needle, int line)
{
    uint8_t *copy = exact_copy(bytes, len);
    pdm_gguf_t *g = SENTINEL;
    pdm_error_clear();
    int st = pdm_gguf_open_buffer(copy, len, name, &g);
    const char *msg = pdm_error_last();
    ck_assert_msg(st == status, "line %d: %s: status %d (%s), expected %d; message: %s", line,
                  name, st, pdm_strerror(st), status, msg);
    ck_assert_msg(g == SENTINEL, "line %d: output written on error", line);
    ck_assert_msg(strstr(msg, name), "line %d: message does not name %s: %s", line, name, msg);
    ck_assert_msg(!needle || strstr(msg, needle), "line %d: message lacks '%s': %s", line,
                  needle, msg);
    free(copy);

    const char *path = tmp_path(name);
    write_file(path, bytes, len);
    pdm_error_clear();
    st = pdm_gguf_open(path, &g);
    msg = pdm_error_last();
    ck_assert_msg(st == status, "line %d: %s: status %d, expected %d; message: %s", line, path,
                  st, status, msg);
    ck_assert_msg(g == SENTINEL, "line %d: output written on error", line);
    ck_assert_msg(strstr(msg, path), "line %d: message does not name %s: %s", line, path, msg);
    ck_assert_msg(!needle || strstr(msg, needle), "line %d: message lacks '%s': %s", line,
                  needle, msg);
    unlink(path);
}
#define EXPECT_FAIL(b, name, status, needle)                                                   \
    expect_fail_((b)->p, (b)->len, (name), (status), (needle), __LINE__)

/* Opens `b` as a buffer (kept in *copy, to be freed after close) and asserts success. */
static pdm_gguf_t *open_ok(const tb_t *b, const char *name, uint8_t **copy)
{
    pdm_gguf_t *g = NULL;
    *copy = exact_copy(b->p, b->len);
    int st = pdm_gguf_open_buffer(*copy, b->len, name, &g);
    ck_assert_msg(st == 0, "%s: %d %s", name, st, pdm_error_last());
    ck_assert_ptr_nonnull(g);
    return g;
}

static uint64_t rng_state;
static uint64_t rng_next(void)
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545F4914F6CDD1DULL;
}

/* ---- Writer -> reader round trip ---------------------------------------------------------- */

static const struct {
    const char *name;
    pdm_dtype_t type;
    uint32_t n_dims;
    int64_t ne[4];
} rt_tensors[] = {
    {"f32.weight", PDM_DT_F32, 2, {7, 3, 1, 1}},
    {"f16.weight", PDM_DT_F16, 1, {5, 1, 1, 1}},
    {"bf16.weight", PDM_DT_BF16, 3, {3, 2, 2, 1}},
    {"q8_0.weight", PDM_DT_Q8_0, 2, {64, 3, 1, 1}},
    {"q4_0.weight", PDM_DT_Q4_0, 4, {32, 1, 2, 2}},
    {"q4_1.weight", PDM_DT_Q4_1, 2, {96, 2, 1, 1}},
    {"q5_0.weight", PDM_DT_Q5_0, 2, {64, 2, 1, 1}},
    {"q5_1.weight", PDM_DT_Q5_1, 1, {32, 1, 1, 1}},
    {"q2_k.weight", PDM_DT_Q2_K, 2, {256, 2, 1, 1}},
    {"q3_k.weight", PDM_DT_Q3_K, 2, {512, 1, 1, 1}},
    {"q4_k.weight", PDM_DT_Q4_K, 2, {256, 3, 1, 1}},
    {"q5_k.weight", PDM_DT_Q5_K, 3, {256, 1, 2, 1}},
    {"q6_k.weight", PDM_DT_Q6_K, 2, {256, 2, 1, 1}},
    {"iq4_nl.weight", PDM_DT_IQ4_NL, 2, {96, 1, 1, 1}},
    {"iq4_xs.weight", PDM_DT_IQ4_XS, 2, {256, 2, 1, 1}},
};

static size_t rt_nbytes(size_t i)
{
    int64_t rows = rt_tensors[i].ne[1] * rt_tensors[i].ne[2] * rt_tensors[i].ne[3];
    return pdm_dtype_row_bytes(rt_tensors[i].type, rt_tensors[i].ne[0]) * (size_t)rows;
}

/* Deterministic contents of round-trip tensor i. */
static void rt_fill(size_t i, uint8_t *p, size_t n)
{
    for (size_t j = 0; j < n; j++) p[j] = (uint8_t)(j * 31 + i * 7 + 1);
}

static const char *const rt_strs[] = {"alpha", "", "gamma with spaces", "\xc4\xa0t", ""};
static const int32_t rt_ints[] = {0, -1, 2147483647, -2147483647 - 1, 42};
static const float rt_floats[] = {0.0f, -1.5f, 3.25e-7f, 1e30f};

/* Writes the round-trip file to `path` with every writer value kind and every tensor type. */
static void rt_write(const char *path)
{
    pdm_gguf_writer_t *w = pdm_gguf_writer_create();
    ck_assert_ptr_nonnull(w);
    ck_assert_int_eq(pdm_gguf_writer_set_str(w, "general.architecture", "llama"), 0);
    ck_assert_int_eq(pdm_gguf_writer_set_u32(w, "llama.block_count", 7), 0);
    ck_assert_int_eq(pdm_gguf_writer_set_u32(w, "t.u32_max", UINT32_MAX), 0);
    ck_assert_int_eq(pdm_gguf_writer_set_i32(w, "t.i32", -123456), 0);
    ck_assert_int_eq(pdm_gguf_writer_set_i32(w, "t.i32_pos", 99), 0);
    ck_assert_int_eq(pdm_gguf_writer_set_f32(w, "t.f32", 1e-5f), 0);
    ck_assert_int_eq(pdm_gguf_writer_set_bool(w, "t.true", 5), 0);
    ck_assert_int_eq(pdm_gguf_writer_set_bool(w, "t.false", 0), 0);
    ck_assert_int_eq(pdm_gguf_writer_set_str(w, "t.empty", ""), 0);
    ck_assert_int_eq(pdm_gguf_writer_set_arr_str(w, "t.strs", rt_strs, 5), 0);
    ck_assert_int_eq(pdm_gguf_writer_set_arr_str(w, "t.no_strs", NULL, 0), 0);
    ck_assert_int_eq(pdm_gguf_writer_set_arr_i32(w, "t.ints", rt_ints, 5), 0);
    ck_assert_int_eq(pdm_gguf_writer_set_arr_i32(w, "t.no_ints", NULL, 0), 0);
    ck_assert_int_eq(pdm_gguf_writer_set_arr_f32(w, "t.floats", rt_floats, 4), 0);
    /* Setting a key again replaces its value (and type) in place. */
    ck_assert_int_eq(pdm_gguf_writer_set_u32(w, "t.replaced", 1), 0);
    ck_assert_int_eq(pdm_gguf_writer_set_str(w, "t.replaced", "second"), 0);
    for (size_t i = 0; i < PDM_ARRAY_SIZE(rt_tensors); i++) {
        size_t n = rt_nbytes(i);
        uint8_t *data = malloc(n);
        ck_assert_ptr_nonnull(data);
        rt_fill(i, data, n);
        ck_assert_int_eq(pdm_gguf_writer_add_tensor(w, rt_tensors[i].name, rt_tensors[i].type,
                                                    rt_tensors[i].n_dims, rt_tensors[i].ne, data),
                         0);
        free(data);
    }
    ck_assert_int_eq(pdm_gguf_writer_write(w, path), 0);
    pdm_gguf_writer_destroy(w);
    ck_assert_int_ne(access(path, R_OK), -1);
}

START_TEST(test_roundtrip_kv)
{
    const char *path = tmp_path("roundtrip_kv.gguf");
    rt_write(path);
    pdm_gguf_t *g = NULL;
    ck_assert_msg(pdm_gguf_open(path, &g) == 0, "%s", pdm_error_last());
    ck_assert_uint_eq(pdm_gguf_version(g), 3);
    ck_assert_uint_eq(pdm_gguf_alignment(g), 32);
    ck_assert_str_eq(pdm_gguf_path(g), path);
    ck_assert_uint_eq(pdm_gguf_n_kv(g), 15 + 1); /* + general.alignment */

    uint32_t u32;
    uint64_t u64;
    float f32;
    int b;
    pdm_gguf_str_t s;
    const pdm_gguf_kv_t *kv;

    ck_assert_int_eq(pdm_gguf_get_u32(g, "general.alignment", &u32), 0);
    ck_assert_uint_eq(u32, 32);
    ck_assert_int_eq(pdm_gguf_find(g, "general.alignment")->type, PDM_GGUF_UINT32);
    ck_assert_int_eq(pdm_gguf_get_str(g, "general.architecture", &s), 0);
    ck_assert(pdm_gguf_str_eq(s, "llama"));
    ck_assert(!pdm_gguf_str_eq(s, "llam"));
    ck_assert(!pdm_gguf_str_eq(s, "llama2"));
    ck_assert_int_eq(pdm_gguf_get_u32(g, "llama.block_count", &u32), 0);
    ck_assert_uint_eq(u32, 7);
    ck_assert_int_eq(pdm_gguf_get_u32(g, "t.u32_max", &u32), 0);
    ck_assert_uint_eq(u32, UINT32_MAX);
    ck_assert_int_eq(pdm_gguf_get_u64(g, "t.u32_max", &u64), 0);
    ck_assert_uint_eq(u64, UINT32_MAX);
    kv = pdm_gguf_find(g, "t.i32");
    ck_assert_ptr_nonnull(kv);
    ck_assert_int_eq(kv->type, PDM_GGUF_INT32);
    ck_assert_int_eq(kv->v.i64, -123456);
    ck_assert_int_eq(pdm_gguf_get_u32(g, "t.i32_pos", &u32), 0); /* int32 that fits */
    ck_assert_uint_eq(u32, 99);
    ck_assert_int_eq(pdm_gguf_get_f32(g, "t.f32", &f32), 0);
    ck_assert(f32 == 1e-5f);
    ck_assert_int_eq(pdm_gguf_get_bool(g, "t.true", &b), 0);
    ck_assert_int_eq(b, 1);
    ck_assert_int_eq(pdm_gguf_get_bool(g, "t.false", &b), 0);
    ck_assert_int_eq(b, 0);
    ck_assert_int_eq(pdm_gguf_get_str(g, "t.empty", &s), 0);
    ck_assert_uint_eq(s.len, 0);
    ck_assert(pdm_gguf_str_eq(s, ""));
    ck_assert_int_eq(pdm_gguf_get_str(g, "t.replaced", &s), 0);
    ck_assert(pdm_gguf_str_eq(s, "second"));

    ck_assert_int_eq(pdm_gguf_get_arr(g, "t.strs", PDM_GGUF_STRING, &kv), 0);
    ck_assert_uint_eq(kv->v.arr.n, 5);
    ck_assert_ptr_nonnull(kv->v.arr.str_offsets);
    for (uint64_t i = 0; i < 5; i++)
        ck_assert(pdm_gguf_str_eq(pdm_gguf_arr_str(kv, i), rt_strs[i]));
    ck_assert_int_eq(pdm_gguf_get_arr(g, "t.no_strs", PDM_GGUF_STRING, &kv), 0);
    ck_assert_uint_eq(kv->v.arr.n, 0);
    ck_assert_int_eq(pdm_gguf_get_arr(g, "t.ints", PDM_GGUF_INT32, &kv), 0);
    ck_assert_uint_eq(kv->v.arr.n, 5);
    ck_assert_ptr_null(kv->v.arr.str_offsets);
    for (uint64_t i = 0; i < 5; i++) ck_assert_int_eq(pdm_gguf_arr_int(kv, i), rt_ints[i]);
    ck_assert_int_eq(pdm_gguf_get_arr(g, "t.no_ints", PDM_GGUF_INT32, &kv), 0);
    ck_assert_uint_eq(kv->v.arr.n, 0);
    ck_assert_int_eq(pdm_gguf_get_arr(g, "t.floats", PDM_GGUF_FLOAT32, &kv), 0);
    ck_assert_uint_eq(kv->v.arr.n, 4);
    for (uint64_t i = 0; i < 4; i++) ck_assert(pdm_gguf_arr_float(kv, i) == rt_floats[i]);

    /* Getter errors: missing keys, wrong types, values that do not fit. */
    pdm_error_clear();
    ck_assert_int_eq(pdm_gguf_get_u32(g, "no.such.key", &u32), PDM_ENOTFOUND);
    ck_assert_ptr_nonnull(strstr(pdm_error_last(), "no.such.key"));
    ck_assert_ptr_null(pdm_gguf_find(g, "no.such.key"));
    ck_assert_ptr_null(pdm_gguf_find(g, ""));
    ck_assert_ptr_null(pdm_gguf_find(g, "general.architecturex"));
    u32 = 777;
    pdm_error_clear();
    ck_assert_int_eq(pdm_gguf_get_u32(g, "t.i32", &u32), PDM_EFORMAT); /* negative */
    ck_assert_ptr_nonnull(strstr(pdm_error_last(), path));
    ck_assert_ptr_nonnull(strstr(pdm_error_last(), "t.i32"));
    ck_assert_uint_eq(u32, 777);
    ck_assert_int_eq(pdm_gguf_get_u64(g, "t.i32", &u64), PDM_EFORMAT);
    ck_assert_int_eq(pdm_gguf_get_u32(g, "t.f32", &u32), PDM_EFORMAT);
    ck_assert_int_eq(pdm_gguf_get_u32(g, "general.architecture", &u32), PDM_EFORMAT);
    ck_assert_int_eq(pdm_gguf_get_u32(g, "t.true", &u32), PDM_EFORMAT);
    ck_assert_int_eq(pdm_gguf_get_f32(g, "llama.block_count", &f32), PDM_EFORMAT);
    ck_assert_int_eq(pdm_gguf_get_bool(g, "llama.block_count", &b), PDM_EFORMAT);
    ck_assert_int_eq(pdm_gguf_get_str(g, "t.strs", &s), PDM_EFORMAT);
    ck_assert_int_eq(pdm_gguf_get_arr(g, "t.strs", PDM_GGUF_INT32, &kv), PDM_EFORMAT);
    ck_assert_int_eq(pdm_gguf_get_arr(g, "t.f32", PDM_GGUF_FLOAT32, &kv), PDM_EFORMAT);
    ck_assert_int_eq(pdm_gguf_get_arr(g, "missing", PDM_GGUF_FLOAT32, &kv), PDM_ENOTFOUND);
    pdm_gguf_close(g);
    unlink(path);
}
END_TEST

START_TEST(test_roundtrip_tensors)
{
    const char *path = tmp_path("roundtrip_tensors.gguf");
    rt_write(path);
    pdm_gguf_t *g = NULL;
    ck_assert_msg(pdm_gguf_open(path, &g) == 0, "%s", pdm_error_last());
    ck_assert_uint_eq(pdm_gguf_n_tensors(g), PDM_ARRAY_SIZE(rt_tensors));
    const uint8_t *base = pdm_gguf_tensor_at(g, 0)->data;
    for (size_t i = 0; i < PDM_ARRAY_SIZE(rt_tensors); i++) {
        const pdm_gguf_tensor_t *t = pdm_gguf_tensor_at(g, i);
        ck_assert_ptr_eq(pdm_gguf_tensor(g, rt_tensors[i].name), t); /* file order kept */
        ck_assert(pdm_gguf_str_eq(t->name, rt_tensors[i].name));
        ck_assert_int_eq(t->type, rt_tensors[i].type);
        ck_assert_uint_eq(t->n_dims, rt_tensors[i].n_dims);
        for (int d = 0; d < 4; d++) ck_assert_int_eq(t->ne[d], rt_tensors[i].ne[d]);
        ck_assert_uint_eq(t->nbytes, rt_nbytes(i));
        ck_assert_uint_eq(t->offset % 32, 0);
        ck_assert_uint_eq((size_t)((const uint8_t *)t->data - base), t->offset);
        ck_assert_uint_eq((uintptr_t)t->data % 32, 0); /* mapping is page aligned */
        uint8_t *want = malloc(t->nbytes);
        ck_assert_ptr_nonnull(want);
        rt_fill(i, want, t->nbytes);
        ck_assert_int_eq(memcmp(want, t->data, t->nbytes), 0);
        free(want);
    }
    ck_assert_ptr_null(pdm_gguf_tensor(g, "missing.weight"));
    ck_assert_ptr_null(pdm_gguf_tensor(g, "f32.weigh"));
    walk(g);
    pdm_gguf_close(g);
    unlink(path);
}
END_TEST

START_TEST(test_writer_errors)
{
    static const float data[64];
    const int64_t ne_ok[2] = {32, 2}, ne_zero[2] = {32, 0}, ne_odd[1] = {33};
    pdm_gguf_writer_t *w = pdm_gguf_writer_create();
    ck_assert_ptr_nonnull(w);
    ck_assert_int_eq(pdm_gguf_writer_set_u32(w, "general.alignment", 64), PDM_EINVAL);
    ck_assert_int_eq(pdm_gguf_writer_set_u32(w, "", 1), PDM_EINVAL);
    ck_assert_int_eq(pdm_gguf_writer_set_str(w, "k", NULL), PDM_EINVAL);
    ck_assert_int_eq(pdm_gguf_writer_set_arr_i32(w, "k", NULL, 3), PDM_EINVAL);
    ck_assert_int_eq(pdm_gguf_writer_add_tensor(w, "a", PDM_DT_Q8_1, 2, ne_ok, data), PDM_EINVAL);
    ck_assert_int_eq(pdm_gguf_writer_add_tensor(w, "a", (pdm_dtype_t)14, 2, ne_ok, data),
                     PDM_EINVAL);
    ck_assert_int_eq(pdm_gguf_writer_add_tensor(w, "a", PDM_DT_F32, 0, ne_ok, data), PDM_EINVAL);
    ck_assert_int_eq(pdm_gguf_writer_add_tensor(w, "a", PDM_DT_F32, 5, ne_ok, data), PDM_EINVAL);
    ck_assert_int_eq(pdm_gguf_writer_add_tensor(w, "a", PDM_DT_F32, 2, ne_zero, data), PDM_EINVAL);
    ck_assert_int_eq(pdm_gguf_writer_add_tensor(w, "a", PDM_DT_Q4_0, 1, ne_odd, data), PDM_EINVAL);
    ck_assert_int_eq(pdm_gguf_writer_add_tensor(w, "", PDM_DT_F32, 2, ne_ok, data), PDM_EINVAL);
    ck_assert_int_eq(pdm_gguf_writer_add_tensor(w, "a", PDM_DT_F32, 2, ne_ok, data), 0);
    ck_assert_int_eq(pdm_gguf_writer_add_tensor(w, "a", PDM_DT_F16, 2, ne_ok, data), PDM_EINVAL);
    ck_assert_ptr_nonnull(strstr(pdm_error_last(), "duplicate"));

    /* A missing directory fails with -ENOENT and leaves nothing behind. */
    char bad[1100];
    snprintf(bad, sizeof(bad), "%s/no/such/dir/x.gguf", pdm_test_tmpdir());
    pdm_error_clear();
    ck_assert_int_eq(pdm_gguf_writer_write(w, bad), -ENOENT);
    ck_assert_ptr_nonnull(strstr(pdm_error_last(), "x.gguf"));

    /* The failed calls left the writer usable. */
    const char *path = tmp_path("writer_errors.gguf");
    ck_assert_int_eq(pdm_gguf_writer_write(w, path), 0);
    char tmp[1100];
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    ck_assert_int_eq(access(tmp, F_OK), -1); /* renamed away */
    pdm_gguf_writer_destroy(w);
    pdm_gguf_writer_destroy(NULL);

    pdm_gguf_t *g = NULL;
    ck_assert_msg(pdm_gguf_open(path, &g) == 0, "%s", pdm_error_last());
    ck_assert_uint_eq(pdm_gguf_n_tensors(g), 1);
    ck_assert_uint_eq(pdm_gguf_n_kv(g), 1);
    ck_assert_int_eq(pdm_gguf_tensor(g, "a")->type, PDM_DT_F32);
    pdm_gguf_close(g);
    pdm_gguf_close(NULL);
    unlink(path);
}
END_TEST

/* ---- Hand-built files: every value type, v2 and v3 --------------------------------------- */

/* Builds a file of `version` with one pair of every scalar type, arrays of every element type
 * (empty ones included), and two tensors; v3 uses general.alignment = 64, v2 the default. */
static void build_all_types(tb_t *b, uint32_t version)
{
    size_t align = version == 3 ? 64 : 32;
    tb_header(b, version, 2, version == 3 ? 31 : 30);
    tb_key(b, "t.u8", PDM_GGUF_UINT8);
    tb_u8(b, 200);
    tb_key(b, "t.i8", PDM_GGUF_INT8);
    tb_u8(b, (uint8_t)-100);
    tb_key(b, "t.u16", PDM_GGUF_UINT16);
    tb_u16(b, 60000);
    tb_key(b, "t.i16", PDM_GGUF_INT16);
    tb_u16(b, (uint16_t)-30000);
    tb_kv_u32(b, "t.u32", 4000000000u);
    tb_key(b, "t.i32", PDM_GGUF_INT32);
    tb_u32(b, (uint32_t)-2000000000);
    tb_key(b, "t.f32", PDM_GGUF_FLOAT32);
    tb_f32(b, 1.5f);
    tb_key(b, "t.bool", PDM_GGUF_BOOL);
    tb_u8(b, 1);
    tb_kv_str(b, "t.str", "hello");
    tb_kv_str(b, "t.empty_str", "");
    tb_key(b, "t.u64", PDM_GGUF_UINT64);
    tb_u64(b, (1ull << 40) + 5);
    tb_key(b, "t.i64", PDM_GGUF_INT64);
    tb_u64(b, (uint64_t)-(1ll << 40));
    tb_key(b, "t.f64", PDM_GGUF_FLOAT64);
    tb_f64(b, 1e300);
    tb_key(b, "t.small_f64", PDM_GGUF_FLOAT64);
    tb_f64(b, 0.25);
    tb_arr(b, "a.u8", PDM_GGUF_UINT8, 3);
    tb_u8(b, 1), tb_u8(b, 2), tb_u8(b, 255);
    tb_arr(b, "a.i8", PDM_GGUF_INT8, 3);
    tb_u8(b, (uint8_t)-1), tb_u8(b, 127), tb_u8(b, (uint8_t)-128);
    tb_arr(b, "a.u16", PDM_GGUF_UINT16, 2);
    tb_u16(b, 65535), tb_u16(b, 7);
    tb_arr(b, "a.i16", PDM_GGUF_INT16, 2);
    tb_u16(b, (uint16_t)-32768), tb_u16(b, 5);
    tb_arr(b, "a.u32", PDM_GGUF_UINT32, 2);
    tb_u32(b, 4294967295u), tb_u32(b, 0);
    tb_arr(b, "a.i32", PDM_GGUF_INT32, 2);
    tb_u32(b, (uint32_t)-7), tb_u32(b, 8);
    tb_arr(b, "a.f32", PDM_GGUF_FLOAT32, 2);
    tb_f32(b, 0.5f), tb_f32(b, -2.0f);
    tb_arr(b, "a.bool", PDM_GGUF_BOOL, 3);
    tb_u8(b, 1), tb_u8(b, 0), tb_u8(b, 1);
    tb_arr(b, "a.str", PDM_GGUF_STRING, 3);
    tb_str(b, "x"), tb_str(b, ""), tb_str(b, "yz");
    tb_arr(b, "a.u64", PDM_GGUF_UINT64, 2);
    tb_u64(b, 1ull << 50), tb_u64(b, 3);
    tb_arr(b, "a.i64", PDM_GGUF_INT64, 2);
    tb_u64(b, (uint64_t)-(1ll << 50)), tb_u64(b, 4);
    tb_arr(b, "a.f64", PDM_GGUF_FLOAT64, 2);
    tb_f64(b, 1e-300), tb_f64(b, -0.125);
    tb_arr(b, "a.empty_str", PDM_GGUF_STRING, 0);
    tb_arr(b, "a.empty_i32", PDM_GGUF_INT32, 0);
    tb_arr(b, "a.empty_f64", PDM_GGUF_FLOAT64, 0);
    tb_arr(b, "a.one_empty_str", PDM_GGUF_STRING, 1);
    tb_str(b, "");
    if (version == 3) tb_kv_u32(b, "general.alignment", 64);
    const int64_t ne0[2] = {4, 2}, ne1[1] = {32};
    tb_tensor(b, "t0", 2, ne0, PDM_DT_F32, 0);
    tb_tensor(b, "t1", 1, ne1, PDM_DT_Q8_0, align); /* after t0's 32 bytes, aligned */
    tb_pad(b, align);
    for (int i = 0; i < 32; i++) tb_u8(b, (uint8_t)(i + 1));
    tb_pad(b, align);
    for (int i = 0; i < 34; i++) tb_u8(b, (uint8_t)(100 + i));
}

/* The pair `key`, asserted present and of type `type`. */
static const pdm_gguf_kv_t *kv_typed(const pdm_gguf_t *g, const char *key, pdm_gguf_type_t type)
{
    const pdm_gguf_kv_t *kv = pdm_gguf_find(g, key);
    ck_assert_msg(kv != NULL, "%s missing", key);
    ck_assert_int_eq(kv->type, type);
    return kv;
}

static void check_all_types(uint32_t version)
{
    tb_t b = {0};
    uint8_t *copy;
    char name[32];
    snprintf(name, sizeof(name), "all-types-v%u.gguf", version);
    build_all_types(&b, version);
    pdm_gguf_t *g = open_ok(&b, name, &copy);
    const pdm_gguf_kv_t *kv;
    uint32_t u32;
    uint64_t u64;
    float f32;

    ck_assert_uint_eq(pdm_gguf_version(g), version);
    ck_assert_uint_eq(pdm_gguf_alignment(g), version == 3 ? 64 : 32);
    ck_assert_uint_eq(pdm_gguf_file_size(g), b.len);
    ck_assert_str_eq(pdm_gguf_path(g), name);
#define KV(key, t) kv_typed(g, key, t)
    ck_assert_uint_eq(KV("t.u8", PDM_GGUF_UINT8)->v.u64, 200);
    ck_assert_int_eq(KV("t.i8", PDM_GGUF_INT8)->v.i64, -100);
    ck_assert_uint_eq(KV("t.u16", PDM_GGUF_UINT16)->v.u64, 60000);
    ck_assert_int_eq(KV("t.i16", PDM_GGUF_INT16)->v.i64, -30000);
    ck_assert_uint_eq(KV("t.u32", PDM_GGUF_UINT32)->v.u64, 4000000000u);
    ck_assert_int_eq(KV("t.i32", PDM_GGUF_INT32)->v.i64, -2000000000);
    ck_assert(KV("t.f32", PDM_GGUF_FLOAT32)->v.f64 == 1.5);
    ck_assert_uint_eq(KV("t.bool", PDM_GGUF_BOOL)->v.u64, 1);
    ck_assert(pdm_gguf_str_eq(KV("t.str", PDM_GGUF_STRING)->v.str, "hello"));
    ck_assert_uint_eq(KV("t.empty_str", PDM_GGUF_STRING)->v.str.len, 0);
    ck_assert_uint_eq(KV("t.u64", PDM_GGUF_UINT64)->v.u64, (1ull << 40) + 5);
    ck_assert_int_eq(KV("t.i64", PDM_GGUF_INT64)->v.i64, -(1ll << 40));
    ck_assert(KV("t.f64", PDM_GGUF_FLOAT64)->v.f64 == 1e300);

    /* Getter conversions between widths, only when the value fits. */
    ck_assert_int_eq(pdm_gguf_get_u32(g, "t.u8", &u32), 0);
    ck_assert_uint_eq(u32, 200);
    ck_assert_int_eq(pdm_gguf_get_u32(g, "t.u16", &u32), 0);
    ck_assert_uint_eq(u32, 60000);
    ck_assert_int_eq(pdm_gguf_get_u32(g, "t.u64", &u32), PDM_EFORMAT);
    ck_assert_int_eq(pdm_gguf_get_u64(g, "t.u64", &u64), 0);
    ck_assert_uint_eq(u64, (1ull << 40) + 5);
    ck_assert_int_eq(pdm_gguf_get_u64(g, "t.i8", &u64), PDM_EFORMAT);
    ck_assert_int_eq(pdm_gguf_get_u64(g, "t.i64", &u64), PDM_EFORMAT);
    ck_assert_int_eq(pdm_gguf_get_f32(g, "t.small_f64", &f32), 0);
    ck_assert(f32 == 0.25f);
    pdm_error_clear();
    ck_assert_int_eq(pdm_gguf_get_f32(g, "t.f64", &f32), PDM_EFORMAT); /* 1e300 */
    ck_assert_ptr_nonnull(strstr(pdm_error_last(), name));

    ck_assert_int_eq(pdm_gguf_get_arr(g, "a.u8", PDM_GGUF_UINT8, &kv), 0);
    ck_assert_int_eq(pdm_gguf_arr_int(kv, 2), 255);
    ck_assert_int_eq(pdm_gguf_get_arr(g, "a.i8", PDM_GGUF_INT8, &kv), 0);
    ck_assert_int_eq(pdm_gguf_arr_int(kv, 0), -1);
    ck_assert_int_eq(pdm_gguf_arr_int(kv, 2), -128);
    ck_assert_int_eq(pdm_gguf_get_arr(g, "a.u16", PDM_GGUF_UINT16, &kv), 0);
    ck_assert_int_eq(pdm_gguf_arr_int(kv, 0), 65535);
    ck_assert_int_eq(pdm_gguf_get_arr(g, "a.i16", PDM_GGUF_INT16, &kv), 0);
    ck_assert_int_eq(pdm_gguf_arr_int(kv, 0), -32768);
    ck_assert_int_eq(pdm_gguf_arr_int(kv, 1), 5);
    ck_assert_int_eq(pdm_gguf_get_arr(g, "a.u32", PDM_GGUF_UINT32, &kv), 0);
    ck_assert_int_eq(pdm_gguf_arr_int(kv, 0), 4294967295ll);
    ck_assert_int_eq(pdm_gguf_get_arr(g, "a.i32", PDM_GGUF_INT32, &kv), 0);
    ck_assert_int_eq(pdm_gguf_arr_int(kv, 0), -7);
    ck_assert_int_eq(pdm_gguf_get_arr(g, "a.f32", PDM_GGUF_FLOAT32, &kv), 0);
    ck_assert(pdm_gguf_arr_float(kv, 1) == -2.0);
    ck_assert_int_eq(pdm_gguf_get_arr(g, "a.bool", PDM_GGUF_BOOL, &kv), 0);
    ck_assert_int_eq(pdm_gguf_arr_int(kv, 0) + pdm_gguf_arr_int(kv, 1) * 2 +
                         pdm_gguf_arr_int(kv, 2) * 4, 5);
    ck_assert_int_eq(pdm_gguf_get_arr(g, "a.str", PDM_GGUF_STRING, &kv), 0);
    ck_assert(pdm_gguf_str_eq(pdm_gguf_arr_str(kv, 0), "x"));
    ck_assert(pdm_gguf_str_eq(pdm_gguf_arr_str(kv, 1), ""));
    ck_assert(pdm_gguf_str_eq(pdm_gguf_arr_str(kv, 2), "yz"));
    ck_assert_int_eq(pdm_gguf_get_arr(g, "a.u64", PDM_GGUF_UINT64, &kv), 0);
    ck_assert_int_eq(pdm_gguf_arr_int(kv, 0), 1ll << 50);
    ck_assert_int_eq(pdm_gguf_get_arr(g, "a.i64", PDM_GGUF_INT64, &kv), 0);
    ck_assert_int_eq(pdm_gguf_arr_int(kv, 0), -(1ll << 50));
    ck_assert_int_eq(pdm_gguf_get_arr(g, "a.f64", PDM_GGUF_FLOAT64, &kv), 0);
    ck_assert(pdm_gguf_arr_float(kv, 0) == 1e-300);
    ck_assert(pdm_gguf_arr_float(kv, 1) == -0.125);
    ck_assert_int_eq(pdm_gguf_get_arr(g, "a.empty_str", PDM_GGUF_STRING, &kv), 0);
    ck_assert_uint_eq(kv->v.arr.n, 0);
    ck_assert_int_eq(pdm_gguf_get_arr(g, "a.empty_i32", PDM_GGUF_INT32, &kv), 0);
    ck_assert_uint_eq(kv->v.arr.n, 0);
    ck_assert_int_eq(pdm_gguf_get_arr(g, "a.empty_f64", PDM_GGUF_FLOAT64, &kv), 0);
    ck_assert_uint_eq(kv->v.arr.n, 0);
    ck_assert_int_eq(pdm_gguf_get_arr(g, "a.one_empty_str", PDM_GGUF_STRING, &kv), 0);
    ck_assert_uint_eq(pdm_gguf_arr_str(kv, 0).len, 0);
#undef KV

    const pdm_gguf_tensor_t *t0 = pdm_gguf_tensor(g, "t0"), *t1 = pdm_gguf_tensor(g, "t1");
    ck_assert_ptr_nonnull(t0);
    ck_assert_ptr_nonnull(t1);
    ck_assert_uint_eq(t0->nbytes, 32);
    ck_assert_uint_eq(t1->nbytes, 34);
    ck_assert_int_eq(((const uint8_t *)t0->data)[0], 1);
    ck_assert_int_eq(((const uint8_t *)t0->data)[31], 32);
    ck_assert_int_eq(((const uint8_t *)t1->data)[0], 100);
    ck_assert_int_eq(((const uint8_t *)t1->data)[33], 133);
    ck_assert_uint_eq((size_t)((const uint8_t *)t1->data - copy) % (version == 3 ? 64 : 32), 0);
    ck_assert_ptr_eq((const uint8_t *)t1->data + 34, copy + b.len); /* ends exactly at EOF */
    walk(g);
    pdm_gguf_close(g);
    free(copy);
    tb_free(&b);
}

START_TEST(test_all_types_v3) { check_all_types(3); }
END_TEST

START_TEST(test_v2_accepted) { check_all_types(2); }
END_TEST

START_TEST(test_empty_model)
{
    /* No metadata and no tensors: valid, with nothing after the header. */
    tb_t b = {0};
    uint8_t *copy;
    tb_header(&b, 3, 0, 0);
    pdm_gguf_t *g = open_ok(&b, "empty-model.gguf", &copy);
    ck_assert_uint_eq(pdm_gguf_n_kv(g), 0);
    ck_assert_uint_eq(pdm_gguf_n_tensors(g), 0);
    ck_assert_ptr_null(pdm_gguf_find(g, "general.architecture"));
    ck_assert_ptr_null(pdm_gguf_tensor(g, "x"));
    pdm_gguf_close(g);
    free(copy);
    tb_free(&b);
}
END_TEST

/* ---- Corruption ------------------------------------------------------------------------- */

START_TEST(test_bad_header)
{
    tb_t b = {0};
    tb_put(&b, "GGUX", 4), tb_u32(&b, 3), tb_u64(&b, 0), tb_u64(&b, 0);
    EXPECT_FAIL(&b, "bad-magic.gguf", PDM_EFORMAT, "magic");
    tb_free(&b);

    tb_header(&b, 1, 0, 0);
    EXPECT_FAIL(&b, "v1.gguf", PDM_EUNSUPPORTED, "version 1");
    tb_free(&b);

    tb_header(&b, 4, 0, 0);
    EXPECT_FAIL(&b, "v4.gguf", PDM_EUNSUPPORTED, "version 4");
    tb_free(&b);

    tb_header(&b, 0, 0, 0);
    EXPECT_FAIL(&b, "v0.gguf", PDM_EUNSUPPORTED, "version 0");
    tb_free(&b);

    tb_header(&b, 0x03000000u, 0, 0);
    EXPECT_FAIL(&b, "big-endian.gguf", PDM_EUNSUPPORTED, "big-endian");
    tb_free(&b);

    tb_header(&b, 3, 0, 1ull << 40);
    EXPECT_FAIL(&b, "huge-n-kv.gguf", PDM_EFORMAT, "metadata count");
    tb_free(&b);

    tb_header(&b, 3, 0, UINT64_MAX);
    EXPECT_FAIL(&b, "max-n-kv.gguf", PDM_EFORMAT, "metadata count");
    tb_free(&b);

    tb_header(&b, 3, UINT64_MAX, 0);
    EXPECT_FAIL(&b, "max-n-tensors.gguf", PDM_EFORMAT, "tensor count");
    tb_free(&b);

    /* 1 pair and 1 tensor fit separately in 40 bytes, but not together. */
    tb_header(&b, 3, 1, 1);
    tb_zeros(&b, 40);
    EXPECT_FAIL(&b, "counts-together.gguf", PDM_EFORMAT, "cannot fit");
    tb_free(&b);

    /* Counts that fit the size but whose records are not there. */
    tb_header(&b, 3, 0, 2);
    tb_kv_u32(&b, "a", 1);
    tb_zeros(&b, 20);
    EXPECT_FAIL(&b, "kv-garbage.gguf", PDM_EFORMAT, NULL);
    tb_free(&b);
}
END_TEST

START_TEST(test_bad_metadata)
{
    tb_t b = {0};

    tb_header(&b, 3, 0, 1);
    tb_u64(&b, UINT64_MAX); /* key length */
    tb_zeros(&b, 16);
    EXPECT_FAIL(&b, "key-len.gguf", PDM_EFORMAT, "string length");
    tb_free(&b);

    tb_header(&b, 3, 0, 1);
    tb_key(&b, "k", PDM_GGUF_STRING);
    tb_u64(&b, 1ull << 62);
    tb_zeros(&b, 8);
    EXPECT_FAIL(&b, "value-len.gguf", PDM_EFORMAT, "string length");
    tb_free(&b);

    tb_header(&b, 3, 0, 1);
    tb_key(&b, "", PDM_GGUF_UINT32);
    tb_u32(&b, 1);
    EXPECT_FAIL(&b, "empty-key.gguf", PDM_EFORMAT, "empty key");
    tb_free(&b);

    tb_header(&b, 3, 0, 1);
    tb_key(&b, "k", (pdm_gguf_type_t)13);
    tb_u64(&b, 0);
    EXPECT_FAIL(&b, "value-type.gguf", PDM_EUNSUPPORTED, "unknown value type 13");
    tb_free(&b);

    tb_header(&b, 3, 0, 1);
    tb_key(&b, "k", (pdm_gguf_type_t)0xffffffffu);
    tb_u64(&b, 0);
    EXPECT_FAIL(&b, "value-type-max.gguf", PDM_EUNSUPPORTED, "unknown value type");
    tb_free(&b);

    tb_header(&b, 3, 0, 1);
    tb_arr(&b, "k", (pdm_gguf_type_t)77, 1);
    tb_u64(&b, 0);
    EXPECT_FAIL(&b, "elem-type.gguf", PDM_EUNSUPPORTED, "element type 77");
    tb_free(&b);

    tb_header(&b, 3, 0, 1);
    tb_arr(&b, "nest", PDM_GGUF_ARRAY, 1);
    tb_u32(&b, PDM_GGUF_UINT8), tb_u64(&b, 0);
    EXPECT_FAIL(&b, "nested.gguf", PDM_EUNSUPPORTED, "nested");
    tb_free(&b);

    tb_header(&b, 3, 0, 1);
    tb_arr(&b, "big", PDM_GGUF_UINT32, 1ull << 62);
    tb_zeros(&b, 16);
    EXPECT_FAIL(&b, "arr-count.gguf", PDM_EFORMAT, "does not fit");
    tb_free(&b);

    tb_header(&b, 3, 0, 1);
    tb_arr(&b, "big", PDM_GGUF_UINT64, UINT64_MAX / 4); /* n * 8 overflows */
    tb_zeros(&b, 16);
    EXPECT_FAIL(&b, "arr-overflow.gguf", PDM_EFORMAT, "does not fit");
    tb_free(&b);

    tb_header(&b, 3, 0, 1);
    tb_arr(&b, "strs", PDM_GGUF_STRING, 1ull << 61);
    tb_zeros(&b, 16);
    EXPECT_FAIL(&b, "str-arr-count.gguf", PDM_EFORMAT, "claims");
    tb_free(&b);

    tb_header(&b, 3, 0, 1);
    tb_arr(&b, "strs", PDM_GGUF_STRING, 2);
    tb_str(&b, "ok");
    tb_u64(&b, 1000); /* second element runs off the end */
    tb_zeros(&b, 8);
    EXPECT_FAIL(&b, "str-arr-elem.gguf", PDM_EFORMAT, "string array 'strs'");
    tb_free(&b);

    tb_header(&b, 3, 0, 1);
    tb_key(&b, "flag", PDM_GGUF_BOOL);
    tb_u8(&b, 2);
    EXPECT_FAIL(&b, "bool-value.gguf", PDM_EFORMAT, "must be 0 or 1");
    tb_free(&b);

    tb_header(&b, 3, 0, 1);
    tb_arr(&b, "flags", PDM_GGUF_BOOL, 2);
    tb_u8(&b, 0), tb_u8(&b, 255);
    EXPECT_FAIL(&b, "bool-arr.gguf", PDM_EFORMAT, "must be 0 or 1");
    tb_free(&b);

    tb_header(&b, 3, 0, 3);
    tb_kv_u32(&b, "a.b", 1);
    tb_kv_str(&b, "c", "x");
    tb_kv_u32(&b, "a.b", 2);
    EXPECT_FAIL(&b, "dup-key.gguf", PDM_EFORMAT, "duplicate metadata key 'a.b'");
    tb_free(&b);

    tb_header(&b, 3, 0, 1);
    tb_key(&b, "general.alignment", PDM_GGUF_UINT64);
    tb_u64(&b, 32);
    EXPECT_FAIL(&b, "align-type.gguf", PDM_EFORMAT, "must be uint32");
    tb_free(&b);

    tb_header(&b, 3, 0, 1);
    tb_kv_u32(&b, "general.alignment", 0);
    EXPECT_FAIL(&b, "align-zero.gguf", PDM_EFORMAT, "power of two");
    tb_free(&b);

    tb_header(&b, 3, 0, 1);
    tb_kv_u32(&b, "general.alignment", 48);
    EXPECT_FAIL(&b, "align-48.gguf", PDM_EFORMAT, "power of two");
    tb_free(&b);

    /* A huge (valid) alignment pushes the data section past the end of the file. */
    const int64_t ne[1] = {8};
    tb_header(&b, 3, 1, 1);
    tb_kv_u32(&b, "general.alignment", 1u << 31);
    tb_tensor(&b, "w", 1, ne, PDM_DT_F32, 0);
    tb_zeros(&b, 64);
    EXPECT_FAIL(&b, "align-huge.gguf", PDM_EFORMAT, "past the end");
    tb_free(&b);
}
END_TEST

START_TEST(test_bad_tensors)
{
    tb_t b = {0};
    const int64_t ne_ok[2] = {32, 2};

    /* Positive control: the one-tensor builder makes a valid file. */
    uint8_t *copy;
    tb_one_tensor(&b, "w", 2, ne_ok, PDM_DT_F32, 0, 256);
    pdm_gguf_t *g = open_ok(&b, "one-tensor.gguf", &copy);
    ck_assert_uint_eq(pdm_gguf_tensor(g, "w")->nbytes, 256);
    pdm_gguf_close(g);
    free(copy);
    tb_free(&b);

    tb_one_tensor(&b, "w", 0, ne_ok, PDM_DT_F32, 0, 256);
    EXPECT_FAIL(&b, "dims-0.gguf", PDM_EFORMAT, "0 dimensions");
    tb_free(&b);

    const int64_t ne5[5] = {32, 1, 1, 1, 1};
    tb_one_tensor(&b, "w", 5, ne5, PDM_DT_F32, 0, 256);
    EXPECT_FAIL(&b, "dims-5.gguf", PDM_EFORMAT, "5 dimensions");
    tb_free(&b);

    const int64_t ne_zero[2] = {32, 0};
    tb_one_tensor(&b, "w", 2, ne_zero, PDM_DT_F32, 0, 256);
    EXPECT_FAIL(&b, "ne-zero.gguf", PDM_EFORMAT, "ne[1] = 0");
    tb_free(&b);

    const int64_t ne_neg[2] = {-32, 2};
    tb_one_tensor(&b, "w", 2, ne_neg, PDM_DT_F32, 0, 256);
    EXPECT_FAIL(&b, "ne-negative.gguf", PDM_EFORMAT, "ne[0] = -32");
    tb_free(&b);

    const int64_t ne_big[3] = {1ll << 32, 1ll << 31, 4};
    tb_one_tensor(&b, "w", 3, ne_big, PDM_DT_F32, 0, 256);
    EXPECT_FAIL(&b, "ne-overflow.gguf", PDM_EFORMAT, "overflows");
    tb_free(&b);

    const int64_t ne_bytes[1] = {1ll << 62}; /* elements fit, bytes do not */
    tb_one_tensor(&b, "w", 1, ne_bytes, PDM_DT_F32, 0, 256);
    EXPECT_FAIL(&b, "bytes-overflow.gguf", PDM_EFORMAT, "overflows");
    tb_free(&b);

    tb_one_tensor(&b, "w", 2, ne_ok, 16 /* IQ2_XXS */, 0, 256);
    EXPECT_FAIL(&b, "type-iq2xxs.gguf", PDM_EUNSUPPORTED, "type 16");
    tb_free(&b);

    tb_one_tensor(&b, "w", 2, ne_ok, PDM_DT_Q8_K, 0, 256); /* activations only */
    EXPECT_FAIL(&b, "type-q8_k.gguf", PDM_EUNSUPPORTED, "type 15 (q8_k)");
    tb_free(&b);

    /* The new block types: sizes from their block layouts, rows of whole super-blocks. */
    const int64_t ne_k[2] = {256, 2};
    tb_one_tensor(&b, "w", 2, ne_k, PDM_DT_Q6_K, 0, 2 * 210);
    g = open_ok(&b, "q6k.gguf", &copy);
    ck_assert_uint_eq(pdm_gguf_tensor(g, "w")->nbytes, 2 * 210);
    pdm_gguf_close(g);
    free(copy);
    tb_free(&b);

    tb_one_tensor(&b, "w", 2, ne_k, PDM_DT_Q4_K, 0, 2 * 144 - 1);
    EXPECT_FAIL(&b, "q4k-short.gguf", PDM_EFORMAT, "'w' data");
    tb_free(&b);

    tb_one_tensor(&b, "w", 2, ne_k, PDM_DT_IQ4_XS, 0, 2 * 136 - 1);
    EXPECT_FAIL(&b, "iq4xs-short.gguf", PDM_EFORMAT, "'w' data");
    tb_free(&b);

    tb_one_tensor(&b, "w", 2, ne_ok, PDM_DT_Q4_K, 0, 256); /* 32 columns: not a super-block */
    EXPECT_FAIL(&b, "q4k-row.gguf", PDM_EFORMAT, "not a multiple of the q4_k block size 256");
    tb_free(&b);

    const int64_t ne_q5[2] = {48, 2};
    tb_one_tensor(&b, "w", 2, ne_q5, PDM_DT_Q5_1, 0, 256);
    EXPECT_FAIL(&b, "q5_1-row.gguf", PDM_EFORMAT, "not a multiple of the q5_1 block size 32");
    tb_free(&b);

    tb_one_tensor(&b, "w", 2, ne_ok, PDM_DT_Q8_1, 0, 256);
    EXPECT_FAIL(&b, "type-q8_1.gguf", PDM_EUNSUPPORTED, "type 9");
    tb_free(&b);

    tb_one_tensor(&b, "w", 2, ne_ok, 0xffffffffu, 0, 256);
    EXPECT_FAIL(&b, "type-max.gguf", PDM_EUNSUPPORTED, "'w'");
    tb_free(&b);

    const int64_t ne_row[2] = {48, 2};
    tb_one_tensor(&b, "w", 2, ne_row, PDM_DT_Q4_0, 0, 256);
    EXPECT_FAIL(&b, "row-blocks.gguf", PDM_EFORMAT, "not a multiple of the q4_0 block size 32");
    tb_free(&b);

    tb_one_tensor(&b, "w", 2, ne_ok, PDM_DT_F32, 16, 512);
    EXPECT_FAIL(&b, "unaligned.gguf", PDM_EFORMAT, "not a multiple of the alignment 32");
    tb_free(&b);

    tb_one_tensor(&b, "blk.3.attn_q.weight", 2, ne_ok, PDM_DT_F32, 0, 255);
    EXPECT_FAIL(&b, "oob.gguf", PDM_EFORMAT, "'blk.3.attn_q.weight' data");
    tb_free(&b);

    tb_one_tensor(&b, "w", 2, ne_ok, PDM_DT_F32, 1ull << 40, 256);
    EXPECT_FAIL(&b, "oob-offset.gguf", PDM_EFORMAT, "out of bounds");
    tb_free(&b);

    tb_one_tensor(&b, "w", 2, ne_ok, PDM_DT_F32, UINT64_MAX - 31, 256); /* aligned, overflows */
    EXPECT_FAIL(&b, "oob-wrap.gguf", PDM_EFORMAT, "out of bounds");
    tb_free(&b);

    tb_one_tensor(&b, "", 2, ne_ok, PDM_DT_F32, 0, 256);
    EXPECT_FAIL(&b, "empty-name.gguf", PDM_EFORMAT, "empty name");
    tb_free(&b);

    tb_header(&b, 3, 2, 0);
    tb_tensor(&b, "a", 2, ne_ok, PDM_DT_F32, 0);   /* [0, 256) */
    tb_tensor(&b, "b", 2, ne_ok, PDM_DT_F32, 224); /* [224, 480) */
    tb_pad(&b, 32);
    tb_zeros(&b, 512);
    EXPECT_FAIL(&b, "overlap.gguf", PDM_EFORMAT, "overlap");
    tb_free(&b);

    tb_header(&b, 3, 2, 0);
    tb_tensor(&b, "b", 2, ne_ok, PDM_DT_F32, 256);
    tb_tensor(&b, "a", 2, ne_ok, PDM_DT_F32, 256); /* same offset, listed in any order */
    tb_pad(&b, 32);
    tb_zeros(&b, 512);
    EXPECT_FAIL(&b, "overlap-same.gguf", PDM_EFORMAT, "overlap");
    tb_free(&b);

    tb_header(&b, 3, 3, 0);
    tb_tensor(&b, "same", 2, ne_ok, PDM_DT_F32, 0);
    tb_tensor(&b, "other", 2, ne_ok, PDM_DT_F32, 256);
    tb_tensor(&b, "same", 2, ne_ok, PDM_DT_F32, 512);
    tb_pad(&b, 32);
    tb_zeros(&b, 768);
    EXPECT_FAIL(&b, "dup-tensor.gguf", PDM_EFORMAT, "duplicate tensor name 'same'");
    tb_free(&b);

    /* A name with control bytes is quoted safely. */
    tb_one_tensor(&b, "bad\n\x01name", 2, ne_ok, PDM_DT_F32, 0, 255);
    EXPECT_FAIL(&b, "ctl-name.gguf", PDM_EFORMAT, "'bad??name'");
    tb_free(&b);
}
END_TEST

START_TEST(test_open_errors)
{
    pdm_gguf_t *g = SENTINEL;
    const char *missing = tmp_path("does-not-exist.gguf");
    pdm_error_clear();
    ck_assert_int_eq(pdm_gguf_open(missing, &g), -ENOENT);
    ck_assert_ptr_nonnull(strstr(pdm_error_last(), missing));
    ck_assert_ptr_eq(g, SENTINEL);

    pdm_error_clear();
    ck_assert_int_eq(pdm_gguf_open(pdm_test_tmpdir(), &g), -EISDIR);
    ck_assert_ptr_nonnull(strstr(pdm_error_last(), pdm_test_tmpdir()));

    const char *empty = tmp_path("empty.gguf");
    write_file(empty, "", 0);
    pdm_error_clear();
    ck_assert_int_eq(pdm_gguf_open(empty, &g), PDM_EFORMAT);
    ck_assert_ptr_nonnull(strstr(pdm_error_last(), empty));
    unlink(empty);

    /* A FIFO is rejected without blocking in open(). */
    const char *fifo = tmp_path("fifo.gguf");
    ck_assert_int_eq(mkfifo(fifo, 0600), 0);
    ck_assert_int_eq(pdm_gguf_open(fifo, &g), PDM_EINVAL);
    ck_assert_ptr_nonnull(strstr(pdm_error_last(), "not a regular file"));
    unlink(fifo);

    if (access("/dev/null", R_OK) == 0) {
        ck_assert_int_eq(pdm_gguf_open("/dev/null", &g), PDM_EINVAL);
        ck_assert_ptr_nonnull(strstr(pdm_error_last(), "/dev/null"));
    }

    pdm_error_clear();
    ck_assert_int_eq(pdm_gguf_open_buffer(NULL, 0, "null-buffer", &g), PDM_EFORMAT);
    ck_assert_ptr_nonnull(strstr(pdm_error_last(), "null-buffer"));
    ck_assert_int_eq(pdm_gguf_open_buffer(NULL, 10, "null-buffer", &g), PDM_EINVAL);
    ck_assert_int_eq(pdm_gguf_open_buffer("GGUF", 4, NULL, &g), PDM_EFORMAT);
    ck_assert_ptr_nonnull(strstr(pdm_error_last(), "<buffer>"));
    ck_assert_ptr_eq(g, SENTINEL);
}
END_TEST

/* ---- Truncation and random corruption ---------------------------------------------------- */

/* Writes the round-trip file and returns its bytes. */
static uint8_t *rt_bytes(const char *name, size_t *len)
{
    const char *path = tmp_path(name);
    rt_write(path);
    uint8_t *bytes = read_file(path, len);
    unlink(path);
    return bytes;
}

START_TEST(test_truncation)
{
    size_t full;
    uint8_t *bytes = rt_bytes("truncation.gguf", &full);

    /* The last byte any tensor needs; bytes after it are only padding. */
    pdm_gguf_t *g;
    ck_assert_int_eq(pdm_gguf_open_buffer(bytes, full, "full", &g), 0);
    size_t needed = 0;
    for (uint64_t i = 0; i < pdm_gguf_n_tensors(g); i++) {
        const pdm_gguf_tensor_t *t = pdm_gguf_tensor_at(g, i);
        size_t end = (size_t)((const uint8_t *)t->data - bytes) + t->nbytes;
        needed = PDM_MAX(needed, end);
    }
    pdm_gguf_close(g);
    ck_assert_uint_lt(needed, full); /* the file ends with padding, which is exercised too */

    for (size_t len = 0; len <= full; len++) {
        uint8_t *copy = exact_copy(bytes, len);
        g = SENTINEL;
        pdm_error_clear();
        int st = pdm_gguf_open_buffer(copy, len, "truncated.gguf", &g);
        if (len < needed) {
            ck_assert_msg(st < 0, "length %zu of %zu opened", len, full);
            ck_assert_ptr_eq(g, SENTINEL);
            ck_assert_msg(strstr(pdm_error_last(), "truncated.gguf"), "length %zu: %s", len,
                          pdm_error_last());
        } else {
            ck_assert_msg(st == 0, "length %zu: %s", len, pdm_error_last());
            walk(g);
            pdm_gguf_close(g);
        }
        free(copy);
    }

    /* A few lengths through the file path too. */
    const size_t lens[] = {1, 4, 8, 23, 24, 100, needed - 1};
    const char *path = tmp_path("truncated-file.gguf");
    for (size_t i = 0; i < PDM_ARRAY_SIZE(lens); i++) {
        write_file(path, bytes, lens[i]);
        g = SENTINEL;
        pdm_error_clear();
        ck_assert_int_eq(pdm_gguf_open(path, &g), PDM_EFORMAT);
        ck_assert_ptr_eq(g, SENTINEL);
        ck_assert_ptr_nonnull(strstr(pdm_error_last(), path));
        ck_assert_ptr_nonnull(strstr(pdm_error_last(), "truncated"));
    }
    unlink(path);
    free(bytes);
}
END_TEST

START_TEST(test_random_flips)
{
    size_t full;
    uint8_t *bytes = rt_bytes("flips.gguf", &full);
    pdm_gguf_t *g;
    ck_assert_int_eq(pdm_gguf_open_buffer(bytes, full, "full", &g), 0);
    size_t head = (size_t)((const uint8_t *)pdm_gguf_tensor_at(g, 0)->data - bytes);
    pdm_gguf_close(g);

    int opened = 0, failed = 0;
    rng_state = 0x9E3779B97F4A7C15ull;
    for (int iter = 0; iter < 4000; iter++) {
        uint8_t *copy = exact_copy(bytes, full);
        int n_flips = 1 + (int)(rng_next() % 4);
        for (int f = 0; f < n_flips; f++) {
            /* Mostly in the header, metadata and tensor infos, where corruption matters. */
            size_t range = rng_next() % 8 ? head : full;
            size_t pos = (size_t)(rng_next() % range);
            uint64_t r = rng_next();
            if (r % 4 == 0) {
                copy[pos] ^= (uint8_t)(1u << (r >> 8) % 8);
            } else if (r % 4 == 1) {
                copy[pos] = (uint8_t)(r >> 16);
            } else if (r % 4 == 2) {
                copy[pos] = (r >> 16) % 2 ? 0xff : 0x00;
            } else if (pos + 8 <= full) {
                /* A boundary value over a whole count, length or offset field. */
                static const uint64_t edges[] = {0, 1, 31, 32, 33, 1ull << 32, INT64_MAX,
                                                 UINT64_MAX, UINT64_MAX - 31};
                uint64_t v = edges[(r >> 16) % PDM_ARRAY_SIZE(edges)];
                for (int k = 0; k < 8; k++) copy[pos + k] = (uint8_t)(v >> (8 * k));
            }
        }
        /* Sometimes cut the file short as well. */
        size_t len = full;
        if (rng_next() % 4 == 0) len = (size_t)(rng_next() % full);
        g = SENTINEL;
        pdm_error_clear();
        int st = pdm_gguf_open_buffer(copy, len, "flipped.gguf", &g);
        if (st == 0) {
            walk(g);
            pdm_gguf_close(g);
            opened++;
        } else {
            ck_assert_int_lt(st, 0);
            ck_assert_ptr_eq(g, SENTINEL);
            ck_assert_msg(strstr(pdm_error_last(), "flipped.gguf"), "%s", pdm_error_last());
            failed++;
        }
        free(copy);
    }
    printf("gguf random flips: %d opened, %d rejected\n", opened, failed);
    ck_assert_int_gt(failed, 0);
    free(bytes);
}
END_TEST

/* ---- The real model --------------------------------------------------------------------- */

START_TEST(test_real_model)
{
    const char *path = pdm_test_model_path();
    if (!path) {
        printf("gguf: real model not present, skipping test_real_model\n");
        return;
    }
    pdm_gguf_t *g = NULL;
    double t0 = pdm_now();
    ck_assert_msg(pdm_gguf_open(path, &g) == 0, "%s", pdm_error_last());
    double open_ms = (pdm_now() - t0) * 1e3;

    pdm_gguf_str_t s;
    uint32_t u32;
    float f32;
    const pdm_gguf_kv_t *kv;
    ck_assert_uint_eq(pdm_gguf_version(g), 3);
    ck_assert_uint_eq(pdm_gguf_alignment(g), 32);
    ck_assert_int_eq(pdm_gguf_get_str(g, "general.architecture", &s), 0);
    ck_assert(pdm_gguf_str_eq(s, "llama"));
    ck_assert_int_eq(pdm_gguf_get_u32(g, "llama.block_count", &u32), 0);
    ck_assert_uint_eq(u32, 30);
    ck_assert_int_eq(pdm_gguf_get_u32(g, "llama.embedding_length", &u32), 0);
    ck_assert_uint_eq(u32, 576);
    ck_assert_int_eq(pdm_gguf_get_f32(g, "llama.rope.freq_base", &f32), 0);
    ck_assert(f32 == 100000.0f);
    ck_assert_int_eq(pdm_gguf_get_arr(g, "tokenizer.ggml.tokens", PDM_GGUF_STRING, &kv), 0);
    ck_assert_uint_eq(kv->v.arr.n, 49152);
    ck_assert(pdm_gguf_str_eq(pdm_gguf_arr_str(kv, 0), "<|endoftext|>"));
    ck_assert_int_eq(pdm_gguf_get_arr(g, "tokenizer.ggml.merges", PDM_GGUF_STRING, &kv), 0);
    ck_assert_uint_eq(kv->v.arr.n, 48900);
    ck_assert_int_eq(pdm_gguf_get_arr(g, "tokenizer.ggml.token_type", PDM_GGUF_INT32, &kv), 0);
    ck_assert_uint_eq(kv->v.arr.n, 49152);

    /* 272 tensors: embeddings, output norm and 9 per block for 30 blocks. */
    ck_assert_uint_eq(pdm_gguf_n_tensors(g), 272);
    int seen[64] = {0}, blocks = 0;
    for (uint64_t i = 0; i < pdm_gguf_n_tensors(g); i++) {
        const pdm_gguf_tensor_t *t = pdm_gguf_tensor_at(g, i);
        char name[128];
        ck_assert_uint_lt(t->name.len, sizeof(name));
        memcpy(name, t->name.ptr, t->name.len);
        name[t->name.len] = '\0';
        ck_assert_ptr_eq(pdm_gguf_tensor(g, name), t);
        int blk;
        if (sscanf(name, "blk.%d.", &blk) == 1) {
            ck_assert(blk >= 0 && blk < 64);
            if (!seen[blk]++) blocks++;
        }
    }
    ck_assert_int_eq(blocks, 30);
    for (int i = 0; i < 30; i++) ck_assert_int_eq(seen[i], 9);

    const pdm_gguf_tensor_t *emb = pdm_gguf_tensor(g, "token_embd.weight");
    ck_assert_ptr_nonnull(emb);
    ck_assert_int_eq(emb->type, PDM_DT_Q8_0);
    ck_assert_uint_eq(emb->n_dims, 2);
    ck_assert_int_eq(emb->ne[0], 576);
    ck_assert_int_eq(emb->ne[1], 49152);
    ck_assert_uint_eq(emb->nbytes, 49152u * 18 * 34);
    const pdm_gguf_tensor_t *q = pdm_gguf_tensor(g, "blk.0.attn_q.weight");
    ck_assert_ptr_nonnull(q);
    ck_assert_int_eq(q->type, PDM_DT_Q4_1);
    const pdm_gguf_tensor_t *norm = pdm_gguf_tensor(g, "output_norm.weight");
    ck_assert_ptr_nonnull(norm);
    ck_assert_int_eq(norm->type, PDM_DT_F32);
    ck_assert_uint_eq(norm->n_dims, 1);
    ck_assert_ptr_null(pdm_gguf_tensor(g, "output.weight")); /* tied to the embeddings */
    walk(g);
    pdm_gguf_close(g);
    printf("gguf: real model opened in %.2f ms\n", open_ms);
}
END_TEST

Suite *suite_gguf(void)
{
    Suite *s = suite_create("gguf");

    TCase *tc = tcase_create("roundtrip");
    tcase_set_timeout(tc, 10);
    tcase_add_test(tc, test_roundtrip_kv);
    tcase_add_test(tc, test_roundtrip_tensors);
    tcase_add_test(tc, test_writer_errors);
    tcase_add_test(tc, test_all_types_v3);
    tcase_add_test(tc, test_v2_accepted);
    tcase_add_test(tc, test_empty_model);
    suite_add_tcase(s, tc);

    tc = tcase_create("corrupt");
    tcase_set_timeout(tc, 10);
    tcase_add_test(tc, test_bad_header);
    tcase_add_test(tc, test_bad_metadata);
    tcase_add_test(tc, test_bad_tensors);
    tcase_add_test(tc, test_open_errors);
    suite_add_tcase(s, tc);

    tc = tcase_create("fuzz");
    tcase_set_timeout(tc, 30);
    tcase_add_test(tc, test_truncation);
    tcase_add_test(tc, test_random_flips);
    suite_add_tcase(s, tc);

    tc = tcase_create("real_model");
    tcase_set_timeout(tc, 30);
    tcase_add_test(tc, test_real_model);
    suite_add_tcase(s, tc);
    return s;
}
