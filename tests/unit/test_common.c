/*
 * test_common.c - status strings, thread-local error messages, number parsing, files and
 * secrets.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/health.h"
#include "common/pdm.h"
#include "common/wire.h"
#include "tests.h"

START_TEST(test_errors)
{
    ck_assert_str_eq(pdm_strerror(PDM_OK), "success");
    ck_assert_str_eq(pdm_strerror(PDM_EFORMAT), "malformed input");
    ck_assert_str_eq(pdm_strerror(-ENOENT), strerror(ENOENT));
    ck_assert_str_eq(pdm_strerror(-99999), "unknown error");
    pdm_error_clear();
    ck_assert_int_eq(pdm_error_set(PDM_ERANGE, "value %d too big", 7), PDM_ERANGE);
    ck_assert_str_eq(pdm_error_last(), "value 7 too big");
    pdm_error_clear();
    ck_assert_str_eq(pdm_error_last(), "success");
}
END_TEST

START_TEST(test_parse)
{
    long v;
    double d;
    ck_assert_int_eq(pdm_parse_long("42", 0, 100, &v), PDM_OK);
    ck_assert_int_eq(v, 42);
    ck_assert_int_eq(pdm_parse_long("42x", 0, 100, &v), PDM_EINVAL);
    ck_assert_int_eq(pdm_parse_long("", 0, 100, &v), PDM_EINVAL);
    ck_assert_int_eq(pdm_parse_long("101", 0, 100, &v), PDM_ERANGE);
    ck_assert_int_eq(pdm_parse_long("99999999999999999999999", 0, 100, &v), PDM_ERANGE);
    ck_assert_int_eq(pdm_parse_double("0.5", 0, 1, &d), PDM_OK);
    ck_assert_int_eq(pdm_parse_double("nan", 0, 1, &d), PDM_EINVAL);
    ck_assert_int_eq(pdm_parse_double("1.5", 0, 1, &d), PDM_ERANGE);
    size_t s;
    ck_assert_int_eq(pdm_size_mul(SIZE_MAX / 2, 3, &s), -1);
    ck_assert_int_eq(pdm_size_add(SIZE_MAX, 1, &s), -1);
}
END_TEST

START_TEST(test_hex_roundtrip)
{
    const uint8_t data[5] = {0x00, 0x7f, 0x80, 0xab, 0xff};
    char *h = pdm_hex_encode(data, sizeof(data));
    ck_assert_str_eq(h, "007f80abff");
    uint8_t *back;
    size_t len;
    ck_assert_int_eq(pdm_hex_decode(h, &back, &len), PDM_OK);
    ck_assert_uint_eq(len, 5);
    ck_assert(memcmp(back, data, 5) == 0);
    free(back);
    free(h);
    ck_assert_int_eq(pdm_hex_decode("ABcd", &back, &len), PDM_OK);
    ck_assert_uint_eq(back[0], 0xab);
    free(back);
    ck_assert_int_eq(pdm_hex_decode("", &back, &len), PDM_EFORMAT);
    ck_assert_int_eq(pdm_hex_decode("abc", &back, &len), PDM_EFORMAT);
    ck_assert_int_eq(pdm_hex_decode("zz", &back, &len), PDM_EFORMAT);
}
END_TEST

START_TEST(test_wire)
{
    int32_t toks[3] = {1, 2, 3};
    Pdmesh__GenerateRequest req = PDMESH__GENERATE_REQUEST__INIT;
    req.request_id = 42;
    req.prompt = "hello";
    req.n_prompt_tokens = 3;
    req.prompt_tokens = toks;
    uint8_t *buf;
    size_t len;
    ck_assert_int_eq(pdm_wire_pack(PDMESH__MSG_TYPE__MSG_GENERATE_REQUEST, &req.base, &buf, &len),
                     PDM_OK);
    /* A message packed under another type's name is refused. */
    uint8_t *b2;
    size_t l2;
    ck_assert_int_eq(pdm_wire_pack(PDMESH__MSG_TYPE__MSG_REGISTER, &req.base, &b2, &l2), PDM_EINVAL);
    pdm_wire_msg_t *m;
    ck_assert_int_eq(pdm_wire_unpack(buf, len, PDM_WIRE_MAX_FRAME, 0, &m), PDM_OK);
    ck_assert_int_eq(pdm_wire_type(m), PDMESH__MSG_TYPE__MSG_GENERATE_REQUEST);
    const Pdmesh__GenerateRequest *r = (const Pdmesh__GenerateRequest *)pdm_wire_message(m);
    ck_assert_uint_eq(r->request_id, 42);
    ck_assert_str_eq(r->prompt, "hello");
    ck_assert_uint_eq(r->n_prompt_tokens, 3);
    ck_assert_int_eq(r->prompt_tokens[2], 3);
    pdm_wire_msg_free(m);
    /* Over the cap, short, bad magic, bad version, unknown type, truncated protobuf. */
    ck_assert_int_eq(pdm_wire_unpack(buf, len, len - 1, 0, &m), PDM_EOVERFLOW);
    ck_assert_int_eq(pdm_wire_unpack(buf, 5, PDM_WIRE_MAX_FRAME, 0, &m), PDM_EFORMAT);
    uint8_t *bad = malloc(len);
    memcpy(bad, buf, len);
    bad[0] = 'X';
    ck_assert_int_eq(pdm_wire_unpack(bad, len, PDM_WIRE_MAX_FRAME, 0, &m), PDM_EFORMAT);
    memcpy(bad, buf, len);
    bad[2] = 9;
    ck_assert_int_eq(pdm_wire_unpack(bad, len, PDM_WIRE_MAX_FRAME, 0, &m), PDM_EFORMAT);
    memcpy(bad, buf, len);
    bad[5] = 250;
    ck_assert_int_eq(pdm_wire_unpack(bad, len, PDM_WIRE_MAX_FRAME, 0, &m), PDM_EUNSUPPORTED);
    ck_assert_int_eq(pdm_wire_unpack(buf, len - 2, PDM_WIRE_MAX_FRAME, 0, &m), PDM_EFORMAT);
    /* A tiny allocation budget refuses the message instead of allocating it. */
    ck_assert_int_eq(pdm_wire_unpack(buf, len, PDM_WIRE_MAX_FRAME, 16, &m), PDM_EFORMAT);
    /* Random bytes after a valid header: an error or a message, never a crash. */
    uint64_t st = 7;
    for (int it = 0; it < 2000; it++) {
        size_t n = PDM_WIRE_HDR + (size_t)(pdm_splitmix64(&st) % 64);
        uint8_t *f = malloc(n);
        memcpy(f, buf, PDM_WIRE_HDR);
        for (size_t i = PDM_WIRE_HDR; i < n; i++) f[i] = (uint8_t)pdm_splitmix64(&st);
        if (pdm_wire_unpack(f, n, PDM_WIRE_MAX_FRAME, 0, &m) == PDM_OK) pdm_wire_msg_free(m);
        free(f);
    }
    free(bad);
    free(buf);
}
END_TEST

START_TEST(test_auth)
{
    const char *secret = "0123456789abcdef-cluster";
    uint8_t proof[32];
    pdm_auth_proof(secret, strlen(secret), "decode-0", 99, 1700000000000ull, proof);
    ck_assert(pdm_auth_verify(secret, strlen(secret), "decode-0", 99, 1700000000000ull, proof, 32));
    ck_assert(!pdm_auth_verify("wrong-secret-wrong", 18, "decode-0", 99, 1700000000000ull, proof, 32));
    ck_assert(!pdm_auth_verify(secret, strlen(secret), "decode-1", 99, 1700000000000ull, proof, 32));
    ck_assert(!pdm_auth_verify(secret, strlen(secret), "decode-0", 98, 1700000000000ull, proof, 32));
    ck_assert(!pdm_auth_verify(secret, strlen(secret), "decode-0", 99, 1700000000001ull, proof, 32));
    ck_assert(!pdm_auth_verify(secret, strlen(secret), "decode-0", 99, 1700000000000ull, proof, 31));
    /* SHA-256 of "abc" (FIPS 180-2 example). */
    uint8_t h[32];
    pdm_sha256("abc", 3, h);
    char *hex = pdm_hex_encode(h, 32);
    ck_assert_str_eq(hex, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    free(hex);
    /* Secrets come from the environment or a file, and must not be short. */
    uint8_t *s;
    size_t n;
    unsetenv("PDMESH_SECRET_FILE");
    setenv("PDMESH_SECRET", "short", 1);
    ck_assert_int_eq(pdm_auth_load_secret(NULL, &s, &n), PDM_EINVAL);
    setenv("PDMESH_SECRET", "a-long-enough-secret\n", 1);
    ck_assert_int_eq(pdm_auth_load_secret(NULL, &s, &n), PDM_OK);
    ck_assert_uint_eq(n, 20);
    free(s);
    unsetenv("PDMESH_SECRET");
    ck_assert_int_eq(pdm_auth_load_secret(NULL, &s, &n), PDM_ENOTFOUND);
    ck_assert_int_eq(pdm_auth_load_secret("/nonexistent/secret", &s, &n), PDM_EIO);
    /* the --secret-file option wins over $PDMESH_SECRET_FILE (it used to be the other way) */
    setenv("PDMESH_SECRET_FILE", "/nonexistent/env-secret", 1);
    ck_assert_int_eq(pdm_auth_load_secret("/nonexistent/opt-secret", &s, &n), PDM_EIO);
    ck_assert(strstr(pdm_error_last(), "opt-secret") && strstr(pdm_error_last(), "cluster secret"));
    unsetenv("PDMESH_SECRET_FILE");
}
END_TEST

/* Writes `text` (len bytes) to a file in the test directory; returns its path (static, valid
 * for the next 7 calls). */
static const char *write_tmp(const char *name, const void *text, size_t len)
{
    static char path[8][512];
    static int next;
    char *p = path[next++ % 8];
    snprintf(p, sizeof(path[0]), "%s/%s", pdm_test_tmpdir(), name);
    FILE *f = fopen(p, "wb");
    ck_assert_ptr_nonnull(f);
    ck_assert_uint_eq(fwrite(text, 1, len, f), len);
    fclose(f);
    return p;
}

START_TEST(test_file_read)
{
    char *data;
    size_t len;
    const char *p = write_tmp("ten", "0123456789", 10);
    ck_assert_int_eq(pdm_file_read(p, 10, &data, &len), PDM_OK);
    ck_assert_uint_eq(len, 10);
    ck_assert_str_eq(data, "0123456789"); /* NUL-terminated */
    free(data);
    ck_assert_int_eq(pdm_file_read(p, 9, &data, &len), PDM_ERANGE);
    ck_assert(strstr(pdm_error_last(), p) && strstr(pdm_error_last(), "9 bytes"));
    /* a file larger than the first read chunk grows the buffer; embedded NULs are kept */
    size_t big_len = 100000;
    char *big = malloc(big_len);
    for (size_t i = 0; i < big_len; i++) big[i] = (char)(i % 251);
    p = write_tmp("big", big, big_len);
    ck_assert_int_eq(pdm_file_read(p, big_len, &data, &len), PDM_OK);
    ck_assert_uint_eq(len, big_len);
    ck_assert_int_eq(memcmp(data, big, big_len), 0);
    ck_assert_int_eq(data[len], 0);
    free(data);
    ck_assert_int_eq(pdm_file_read(p, big_len - 1, &data, &len), PDM_ERANGE);
    free(big);
    p = write_tmp("empty", "", 0);
    ck_assert_int_eq(pdm_file_read(p, 0, &data, &len), PDM_OK);
    ck_assert_uint_eq(len, 0);
    free(data);
    /* files of unknown size */
    ck_assert_int_eq(pdm_file_read("/proc/self/stat", 4096, &data, NULL), PDM_OK);
    ck_assert(strlen(data) > 0);
    free(data);
    data = (char *)"untouched";
    ck_assert_int_eq(pdm_file_read("/nonexistent/file", 10, &data, &len), PDM_EIO);
    ck_assert_str_eq(data, "untouched");
    ck_assert(strstr(pdm_error_last(), "/nonexistent/file"));
}
END_TEST

START_TEST(test_secret_load)
{
    pdm_secret_source_t src = {.what = "test secret", .file_option = "--secret-file FILE",
                               .env_file = "PDM_TEST_SECRET_FILE",
                               .env_value = "PDM_TEST_SECRET", .min_len = 8};
    char *s;
    size_t n;
    const char *opt_file = write_tmp("opt", "from-the-option\r\n\n", 18);
    const char *env_file = write_tmp("env", "from-the-env-file\n", 18);
    /* precedence: file option > env file > env value */
    setenv("PDM_TEST_SECRET_FILE", env_file, 1);
    setenv("PDM_TEST_SECRET", "from-the-env-value", 1);
    src.file = opt_file;
    ck_assert_int_eq(pdm_secret_load(&src, &s, &n), PDM_OK);
    ck_assert_str_eq(s, "from-the-option"); /* trailing CR/LF stripped */
    ck_assert_uint_eq(n, 15);
    free(s);
    src.file = ""; /* empty = not given */
    ck_assert_int_eq(pdm_secret_load(&src, &s, &n), PDM_OK);
    ck_assert_str_eq(s, "from-the-env-file");
    free(s);
    setenv("PDM_TEST_SECRET_FILE", "", 1);
    ck_assert_int_eq(pdm_secret_load(&src, &s, &n), PDM_OK);
    ck_assert_str_eq(s, "from-the-env-value");
    free(s);
    /* only the first configured source is read, even when it is broken */
    setenv("PDM_TEST_SECRET_FILE", "/nonexistent/secret", 1);
    ck_assert_int_eq(pdm_secret_load(&src, &s, &n), PDM_EIO);
    ck_assert(strstr(pdm_error_last(), "test secret from $PDM_TEST_SECRET_FILE"));
    ck_assert(strstr(pdm_error_last(), "/nonexistent/secret"));
    unsetenv("PDM_TEST_SECRET_FILE");
    /* only the trailing line end is trimmed */
    setenv("PDM_TEST_SECRET", "  spaced  token \n", 1);
    ck_assert_int_eq(pdm_secret_load(&src, &s, &n), PDM_OK);
    ck_assert_str_eq(s, "  spaced  token ");
    free(s);
    /* limits: min_len after trimming, PDM_SECRET_MAX from a file and from the environment */
    setenv("PDM_TEST_SECRET", "1234567\n", 1);
    ck_assert_int_eq(pdm_secret_load(&src, &s, &n), PDM_EINVAL);
    ck_assert(strstr(pdm_error_last(), "$PDM_TEST_SECRET") && strstr(pdm_error_last(), "short"));
    char *big = malloc(PDM_SECRET_MAX + 2);
    memset(big, 'x', PDM_SECRET_MAX + 1);
    big[PDM_SECRET_MAX + 1] = 0;
    setenv("PDM_TEST_SECRET", big, 1);
    ck_assert_int_eq(pdm_secret_load(&src, &s, &n), PDM_ERANGE);
    src.file = write_tmp("big", big, PDM_SECRET_MAX + 1);
    ck_assert_int_eq(pdm_secret_load(&src, &s, &n), PDM_ERANGE);
    ck_assert(strstr(pdm_error_last(), "test secret") && strstr(pdm_error_last(), src.file));
    src.file = write_tmp("max", big, PDM_SECRET_MAX);
    ck_assert_int_eq(pdm_secret_load(&src, &s, &n), PDM_OK);
    ck_assert_uint_eq(n, PDM_SECRET_MAX);
    free(s);
    free(big);
    /* NUL bytes: refused in text secrets, kept in binary ones */
    src.file = write_tmp("nul", "abcd\0efgh", 9);
    ck_assert_int_eq(pdm_secret_load(&src, &s, &n), PDM_EINVAL);
    src.binary = 1;
    ck_assert_int_eq(pdm_secret_load(&src, &s, &n), PDM_OK);
    ck_assert_uint_eq(n, 9);
    ck_assert_int_eq(memcmp(s, "abcd\0efgh", 9), 0);
    free(s);
    /* nothing configured: the message lists the sources */
    src.file = NULL;
    unsetenv("PDM_TEST_SECRET");
    ck_assert_int_eq(pdm_secret_load(&src, &s, &n), PDM_ENOTFOUND);
    ck_assert(strstr(pdm_error_last(), "--secret-file FILE") &&
              strstr(pdm_error_last(), "$PDM_TEST_SECRET_FILE") &&
              strstr(pdm_error_last(), "$PDM_TEST_SECRET"));
    /* the admin token: at least 8 bytes, the same precedence */
    unsetenv("PDMESH_ADMIN_TOKEN_FILE");
    setenv("PDMESH_ADMIN_TOKEN", "1234567", 1);
    ck_assert_int_eq(pdm_auth_load_admin_token(NULL, "--token-file FILE", &s), PDM_EINVAL);
    setenv("PDMESH_ADMIN_TOKEN", "12345678", 1);
    ck_assert_int_eq(pdm_auth_load_admin_token(NULL, "--token-file FILE", &s), PDM_OK);
    ck_assert_str_eq(s, "12345678");
    free(s);
    setenv("PDMESH_ADMIN_TOKEN_FILE", env_file, 1);
    ck_assert_int_eq(pdm_auth_load_admin_token(opt_file, NULL, &s), PDM_OK);
    ck_assert_str_eq(s, "from-the-option");
    free(s);
    unsetenv("PDMESH_ADMIN_TOKEN_FILE");
    unsetenv("PDMESH_ADMIN_TOKEN");
}
END_TEST

/* The health file: written and read back; judged fresh, stale, stalled and not ready; a file
 * that is not one, a missing file. */
START_TEST(test_health_file)
{
    char dir[] = "/tmp/pdm-health-XXXXXX", path[64];
    ck_assert_ptr_nonnull(mkdtemp(dir));
    snprintf(path, sizeof(path), "%s/h", dir);
    pdm_health_t h = {.pid = 42, .written_ms = 1000000, .main_age_ms = 250, .registered = 1,
                      .epoch = 7},
                 r;
    snprintf(h.node_id, sizeof(h.node_id), "g/0");
    ck_assert_int_eq(pdm_health_write(path, &h), PDM_OK);
    ck_assert_int_eq(pdm_health_read(path, &r), PDM_OK);
    ck_assert_int_eq(r.pid, 42);
    ck_assert_uint_eq(r.written_ms, 1000000);
    ck_assert_uint_eq(r.main_age_ms, 250);
    ck_assert_int_eq(r.registered, 1);
    ck_assert_uint_eq(r.epoch, 7);
    ck_assert_str_eq(r.node_id, "g/0");
    char why[256];
    ck_assert_int_eq(pdm_health_judge(&r, 1004000, 10000, 120000, 1, why, sizeof(why)), 0);
    ck_assert_int_eq(pdm_health_judge(&r, 1011000, 10000, 120000, 0, why, sizeof(why)), 1);
    ck_assert_ptr_nonnull(strstr(why, "frozen or gone"));
    r.main_age_ms = 130000;
    ck_assert_int_eq(pdm_health_judge(&r, 1001000, 10000, 120000, 0, why, sizeof(why)), 1);
    ck_assert_ptr_nonnull(strstr(why, "has not turned"));
    r.main_age_ms = 0;
    r.registered = 0;
    ck_assert_int_eq(pdm_health_judge(&r, 1001000, 10000, 120000, 0, why, sizeof(why)), 0);
    ck_assert_int_eq(pdm_health_judge(&r, 1001000, 10000, 120000, 1, why, sizeof(why)), 1);
    ck_assert_ptr_nonnull(strstr(why, "not registered"));
    FILE *f = fopen(path, "w");
    fputs("pid=1 garbage\n", f);
    fclose(f);
    ck_assert_int_eq(pdm_health_read(path, &r), PDM_EINVAL);
    unlink(path);
    ck_assert_int_eq(pdm_health_read(path, &r), PDM_ENOTFOUND);
    rmdir(dir);
}
END_TEST

Suite *suite_common(void)
{
    Suite *s = suite_create("common");
    TCase *tc = tcase_create("common");
    tcase_add_test(tc, test_errors);
    tcase_add_test(tc, test_parse);
    tcase_add_test(tc, test_hex_roundtrip);
    tcase_add_test(tc, test_wire);
    tcase_add_test(tc, test_auth);
    tcase_add_test(tc, test_file_read);
    tcase_add_test(tc, test_secret_load);
    tcase_add_test(tc, test_health_file);
    suite_add_tcase(s, tc);
    return s;
}
