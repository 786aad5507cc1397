/*
 * cli.h - helpers shared by the subcommands of the pdmesh command-line tool (internal).
 */
#ifndef PDM_CLI_H
#define PDM_CLI_H

#include <stddef.h>
#include <stdint.h>

#include "model/model.h"

extern const char *cli_prog;

/* Print "pdmesh: <message>" plus a usage hint; return exit status 2. */
int cli_usage_error(const char *fmt, const char *arg);
/* Print "pdmesh: what: <last error>"; return exit status 1. */
int cli_runtime_error(const char *what);
/* Print a JSON object as one line on stdout (the --json output of the commands), then free it. */
struct cJSON;
void cli_print_json_line(struct cJSON *obj);
/* All of stdin, NUL-terminated (malloc'd), or NULL. */
char *cli_read_stdin(size_t *len_out);
/* Loads a model that has a tokenizer; returns an exit status (0 on success). */
int cli_load_model(const char *path, pdm_model_t **model);
/* Tokenizes text into a malloc'd array. */
int cli_tokenize_alloc(const pdm_tokenizer_t *tok, const char *text, size_t len, int flags,
                       int32_t **ids_out, size_t *n_out);

int cmd_prefill_run(int argc, char **argv);
int cmd_partition_search(int argc, char **argv);
int cmd_calibrate(int argc, char **argv);
int cmd_disagg_run(int argc, char **argv);
int cmd_plan(int argc, char **argv);
int cmd_up(int argc, char **argv);
int cmd_down(int argc, char **argv);
/* pdmesh generate --router ENDPOINT (cli/generate_remote.c, over libpdmesh). */
int cli_generate_wants_router(int argc, char **argv);
int cmd_generate_remote(int argc, char **argv);

#endif /* PDM_CLI_H */
