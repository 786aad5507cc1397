/*
 * test_common.c - status strings, thread-local error messages, number parsing.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

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
    suite_add_tcase(s, tc);
    return s;
}
