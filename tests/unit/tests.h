/*
 * tests.h - the list of Check suites and helpers shared by the unit tests.
 */
#ifndef PDM_TESTS_H
#define PDM_TESTS_H

#include <check.h>
#include <stdint.h>

/* Every suite of the unit test binary; main.c runs them all (or those named on the command
 * line). Add a suite here and in main.c's table. */
Suite *suite_common(void);
Suite *suite_gguf(void);
Suite *suite_tokenizer(void);
Suite *suite_kernels(void);
Suite *suite_engine(void);
Suite *suite_sampler(void);
Suite *suite_grammar(void);
Suite *suite_golden(void);
Suite *suite_prefill(void);
Suite *suite_kvtransfer(void);
Suite *suite_decode(void);
Suite *suite_disagg(void);
Suite *suite_beam(void);
Suite *suite_offload(void);
Suite *suite_router(void);
Suite *suite_kvindex(void);
Suite *suite_sdk(void);
Suite *suite_http(void);
Suite *suite_curve(void);
Suite *suite_nodeproto(void);
Suite *suite_quant(void);
Suite *suite_arch(void);

/* Path of a scratch directory for this test run (created on first use; from PDM_TEST_TMP or
 * under /tmp). */
const char *pdm_test_tmpdir(void);
/* A JSON file parsed (the test fails with the path if it is missing or not JSON); free it with
 * cJSON_Delete. */
struct cJSON;
struct cJSON *pdm_test_load_json(const char *path);
/* Index of the largest of x[0..n) (the first on ties): the greedy token of a logit row. */
int32_t pdm_test_argmax(const float *x, uint32_t n);
/* Path of the real model, or NULL when it is not present (tests then skip with a message). */
const char *pdm_test_model_path(void);

#endif
