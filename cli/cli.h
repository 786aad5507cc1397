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

/* ---- Sampling flags: one parser and one set of limits for every generating command -------
 * Add CLI_SAMPLING_LONG_OPTS to a getopt_long option table and pass each option to
 * cli_sampling_flag_parse. The limits are the router's (pdm_sampler_params_check):
 * --temp [0, 100], --top-k [0, INT32_MAX], --top-p (0, 1], --min-p [0, 1],
 * --repeat-penalty (0, 100], --seed any decimal uint64, --presence-penalty and
 * --frequency-penalty [-2, 2], --logit-bias ID=BIAS (repeatable, at most 300, BIAS in
 * [-100, 100]; the entries live in a static table of this module), --logprobs K (0..20: each
 * token's log-probability and its K best alternatives; printed by --json). */
enum {
    CLI_OPT_TEMP = 3000,
    CLI_OPT_TOP_K,
    CLI_OPT_TOP_P,
    CLI_OPT_MIN_P,
    CLI_OPT_REPEAT_PENALTY,
    CLI_OPT_SEED,
    CLI_OPT_PRESENCE,
    CLI_OPT_FREQUENCY,
    CLI_OPT_LOGIT_BIAS,
    CLI_OPT_LOGPROBS
};
#define CLI_SAMPLING_LONG_OPTS                                                                 \
    {"temp", required_argument, 0, CLI_OPT_TEMP}, {"top-k", required_argument, 0, CLI_OPT_TOP_K}, \
        {"top-p", required_argument, 0, CLI_OPT_TOP_P},                                        \
        {"min-p", required_argument, 0, CLI_OPT_MIN_P},                                        \
        {"repeat-penalty", required_argument, 0, CLI_OPT_REPEAT_PENALTY},                      \
        {"seed", required_argument, 0, CLI_OPT_SEED},                                         \
        {"presence-penalty", required_argument, 0, CLI_OPT_PRESENCE},                          \
        {"frequency-penalty", required_argument, 0, CLI_OPT_FREQUENCY},                        \
        {"logit-bias", required_argument, 0, CLI_OPT_LOGIT_BIAS},                              \
        {"logprobs", required_argument, 0, CLI_OPT_LOGPROBS}
/* Stores the value of sampling option `opt_id` into *sp: 1 when done, 0 when opt_id is not a
 * sampling option (sp unchanged), -1 when the value is invalid (a usage error naming the flag
 * and its range has been printed; exit with status 2; sp unchanged). */
int cli_sampling_flag_parse(int opt_id, const char *arg, pdm_sampler_params_t *sp);

int cmd_prefill_run(int argc, char **argv);
int cmd_partition_search(int argc, char **argv);
int cmd_calibrate(int argc, char **argv);
int cmd_disagg_run(int argc, char **argv);
int cmd_plan(int argc, char **argv);
int cmd_up(int argc, char **argv);
int cmd_down(int argc, char **argv);
int cmd_status(int argc, char **argv);
int cmd_health(int argc, char **argv);
/* pdmesh perplexity / pdmesh kld (cli/perplexity.c). */
int cmd_perplexity(int argc, char **argv);
int cmd_kld(int argc, char **argv);
/* pdmesh generate --router ENDPOINT (cli/generate_remote.c, over libpdmesh). */
int cli_generate_wants_router(int argc, char **argv);
int cmd_generate_remote(int argc, char **argv);

#endif /* PDM_CLI_H */
