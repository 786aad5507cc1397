/*
 * cli.c - what every pdmesh subcommand shares (cli/cli.h): the program name, usage and runtime
 * errors with their exit statuses, JSON lines on stdout, reading stdin, loading a model with
 * its tokenizer, tokenizing into a new array. The subcommands live in their own files and
 * pdmesh.c only dispatches to them, so the calls run one way: subcommand -> cli.c.
 */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>

#include "cli/cli.h"
#include "common/pdm.h"
#include "model/model.h"

const char *cli_prog = "pdmesh";

int cli_usage_error(const char *fmt, const char *arg)
{
    fprintf(stderr, "%s: ", cli_prog);
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\n(run 'pdmesh --help' for usage)\n");
    return 2;
}

int cli_runtime_error(const char *what)
{
    fprintf(stderr, "%s: %s: %s\n", cli_prog, what, pdm_error_last());
    return 1;
}

void cli_print_json_line(cJSON *obj)
{
    char *js = obj ? cJSON_PrintUnformatted(obj) : NULL;
    if (js) printf("%s\n", js);
    free(js);
    cJSON_Delete(obj);
}

/* Reads all of stdin into a malloc'd NUL-terminated string. */
char *cli_read_stdin(size_t *len_out)
{
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap);
    if (!buf) return NULL;
    size_t got;
    while ((got = fread(buf + len, 1, cap - len - 1, stdin)) > 0) {
        len += got;
        if (cap - len - 1 == 0) {
            char *nb = realloc(buf, cap * 2);
            if (!nb) {
                free(buf);
                return NULL;
            }
            buf = nb;
            cap *= 2;
        }
    }
    buf[len] = '\0';
    *len_out = len;
    return buf;
}

int cli_load_model(const char *path, pdm_model_t **model)
{
    if (pdm_model_load(path, model) != PDM_OK) return cli_runtime_error("cannot load model");
    if (!(*model)->tokenizer) {
        pdm_model_free(*model);
        fprintf(stderr, "%s: %s has no tokenizer\n", cli_prog, path);
        return 1;
    }
    return 0;
}

/* Tokenizes text into a malloc'd array. */
int cli_tokenize_alloc(const pdm_tokenizer_t *tok, const char *text, size_t len, int flags,
                          int32_t **ids_out, size_t *n_out)
{
    size_t need = 0;
    int rc = pdm_tokenizer_encode(tok, text, len, flags, NULL, 0, &need);
    if (rc != PDM_OK && rc != PDM_EOVERFLOW) return rc;
    int32_t *ids = malloc((need ? need : 1) * sizeof(int32_t));
    if (!ids) return pdm_error_set(PDM_ENOMEM, "out of memory");
    if ((rc = pdm_tokenizer_encode(tok, text, len, flags, ids, need, &need)) != PDM_OK) {
        free(ids);
        return rc;
    }
    *ids_out = ids;
    *n_out = need;
    return PDM_OK;
}
