/*
 * main.c - runs the Check suites of pdmesh: all of them, or those named as arguments.
 */
#define _POSIX_C_SOURCE 200809L
#include "tests.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "common/pdm.h"

static const struct {
    const char *name;
    Suite *(*make)(void);
} suites[] = {
    {"common", suite_common},   {"gguf", suite_gguf},     {"tokenizer", suite_tokenizer},
    {"kernels", suite_kernels}, {"engine", suite_engine}, {"sampler", suite_sampler}, {"grammar", suite_grammar},
    {"golden", suite_golden},   {"kvtransfer", suite_kvtransfer}, {"prefill", suite_prefill},
    {"decode", suite_decode},   {"disagg", suite_disagg},
    {"beam", suite_beam},       {"offload", suite_offload},   {"router", suite_router},
    {"sdk", suite_sdk},
    {"http", suite_http},
    {"curve", suite_curve},     {"nodeproto", suite_nodeproto}, {"quant", suite_quant},
    {"arch", suite_arch},
    {"kvindex", suite_kvindex},
};

struct cJSON *pdm_test_load_json(const char *path)
{
    size_t n = 0;
    char *text = NULL;
    ck_assert_msg(pdm_file_read(path, 64u << 20, &text, &n) == 0, "cannot read %s: %s", path,
                  pdm_error_last());
    cJSON *root = cJSON_ParseWithLength(text, n);
    free(text);
    ck_assert_msg(root != NULL, "%s is not valid JSON", path);
    return root;
}

int32_t pdm_test_argmax(const float *x, uint32_t n)
{
    int32_t b = 0;
    for (uint32_t i = 1; i < n; i++)
        if (x[i] > x[b]) b = (int32_t)i;
    return b;
}

const char *pdm_test_tmpdir(void)
{
    static char dir[512];
    if (!dir[0]) {
        const char *env = getenv("PDM_TEST_TMP");
        if (env && *env) snprintf(dir, sizeof(dir), "%s", env);
        else snprintf(dir, sizeof(dir), "/tmp/pdmesh-test-%ld", (long)getpid());
        mkdir(dir, 0700);
    }
    return dir;
}

const char *pdm_test_model_path(void)
{
    static char path[1024];
    const char *env = getenv("PDMESH_MODEL");
    snprintf(path, sizeof(path), "%s",
             env && *env ? env : "models/SmolLM2-135M-Instruct.Q4_1.gguf");
    return access(path, R_OK) == 0 ? path : NULL;
}

int main(int argc, char **argv)
{
    SRunner *runner = NULL;
    pdm_test_tmpdir(); /* once, before Check forks, so every test shares one directory */
    for (size_t i = 0; i < sizeof(suites) / sizeof(suites[0]); i++) {
        int wanted = argc < 2;
        for (int a = 1; a < argc; a++)
            if (!strcmp(argv[a], suites[i].name)) wanted = 1;
        if (!wanted) continue;
        if (!runner) runner = srunner_create(suites[i].make());
        else srunner_add_suite(runner, suites[i].make());
    }
    if (!runner) {
        fprintf(stderr, "no such suite\n");
        return 2;
    }
    srunner_run_all(runner, CK_NORMAL);
    int failed = srunner_ntests_failed(runner);
    srunner_free(runner);
    return failed == 0 ? 0 : 1;
}
