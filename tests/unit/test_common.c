/*
 * test_common.c - status strings, thread-local error messages, number parsing.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "common/pdm.h"
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

Suite *suite_common(void)
{
    Suite *s = suite_create("common");
    TCase *tc = tcase_create("common");
    tcase_add_test(tc, test_errors);
    tcase_add_test(tc, test_parse);
    tcase_add_test(tc, test_hex_roundtrip);
    suite_add_tcase(s, tc);
    return s;
}
