/*
 * sampling.c - the sampling flags of every generating command (cli/cli.h): one parser, one
 * set of limits, the ones the router enforces on every request (pdm_sampler_params_check,
 * model/model.h), so a value the CLI accepts is never refused later by the router or the
 * decode node.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "common/pdm.h"

/* A decimal uint64 with nothing else around it (no sign, no blanks: strtoull alone would
 * turn "-1" into 2^64 - 1). */
static int cli__parse_u64(const char *s, uint64_t *out)
{
    if (*s < '0' || *s > '9') return PDM_EINVAL;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (*end || errno) return PDM_EINVAL;
    *out = v;
    return PDM_OK;
}

/* Prints the usage error "invalid FLAG 'ARG' (RANGE)", RANGE formatted from range_fmt with
 * `bound` (a double: %g); returns -1. */
static int cli__bad(const char *flag, const char *arg, const char *range_fmt, double bound)
{
    char range[128], msg[512];
    snprintf(range, sizeof(range), range_fmt, bound);
    snprintf(msg, sizeof(msg), "invalid %s '%s' (%s)", flag, arg, range);
    cli_usage_error("%s", msg);
    return -1;
}

/* --logit-bias entries of the process (one command line). */
static int32_t cli__bias_ids[PDM_SAMPLER_MAX_LOGIT_BIAS];
static float cli__bias_values[PDM_SAMPLER_MAX_LOGIT_BIAS];

int cli_sampling_flag_parse(int opt_id, const char *arg, pdm_sampler_params_t *sp)
{
    double d;
    long v;
    switch (opt_id) {
    case CLI_OPT_TEMP:
        if (pdm_parse_double(arg, 0, PDM_SAMPLER_TEMPERATURE_MAX, &d))
            return cli__bad("--temp", arg, "0..%g, 0 = greedy", PDM_SAMPLER_TEMPERATURE_MAX);
        sp->temperature = (float)d;
        return 1;
    case CLI_OPT_TOP_K:
        if (pdm_parse_long(arg, 0, INT32_MAX, &v))
            return cli__bad("--top-k", arg, "0..%.0f, 0 = off", INT32_MAX);
        sp->top_k = (int32_t)v;
        return 1;
    case CLI_OPT_TOP_P:
        if (pdm_parse_double(arg, 0, 1, &d) || !(d > 0))
            return cli__bad("--top-p", arg, "over 0 and at most %g, 1 = off", 1);
        sp->top_p = (float)d;
        return 1;
    case CLI_OPT_MIN_P:
        if (pdm_parse_double(arg, 0, 1, &d)) return cli__bad("--min-p", arg, "0..%g, 0 = off", 1);
        sp->min_p = (float)d;
        return 1;
    case CLI_OPT_REPEAT_PENALTY:
        if (pdm_parse_double(arg, 0, PDM_SAMPLER_REPEAT_PENALTY_MAX, &d) || !(d > 0))
            return cli__bad("--repeat-penalty", arg, "over 0 and at most %g, 1 = off",
                            PDM_SAMPLER_REPEAT_PENALTY_MAX);
        sp->repeat_penalty = (float)d;
        return 1;
    case CLI_OPT_SEED:
        if (cli__parse_u64(arg, &sp->seed))
            return cli__bad("--seed", arg, "a decimal integer 0..18446744073709551615", 0);
        return 1;
    case CLI_OPT_PRESENCE:
    case CLI_OPT_FREQUENCY:
        if (pdm_parse_double(arg, -PDM_SAMPLER_PENALTY_MAX, PDM_SAMPLER_PENALTY_MAX, &d))
            return cli__bad(opt_id == CLI_OPT_PRESENCE ? "--presence-penalty"
                                                       : "--frequency-penalty",
                            arg, "-%g..2, 0 = off", PDM_SAMPLER_PENALTY_MAX);
        if (opt_id == CLI_OPT_PRESENCE) sp->presence_penalty = (float)d;
        else sp->frequency_penalty = (float)d;
        return 1;
    case CLI_OPT_LOGIT_BIAS: {
        char id_text[32];
        const char *eq = strchr(arg, '=');
        size_t id_len = eq ? (size_t)(eq - arg) : 0;
        if (!eq || id_len == 0 || id_len >= sizeof(id_text))
            return cli__bad("--logit-bias", arg, "ID=BIAS, BIAS in -%g..100", PDM_SAMPLER_BIAS_MAX);
        memcpy(id_text, arg, id_len);
        id_text[id_len] = 0;
        if (pdm_parse_long(id_text, 0, INT32_MAX, &v) ||
            pdm_parse_double(eq + 1, -PDM_SAMPLER_BIAS_MAX, PDM_SAMPLER_BIAS_MAX, &d))
            return cli__bad("--logit-bias", arg, "ID=BIAS, BIAS in -%g..100", PDM_SAMPLER_BIAS_MAX);
        if (sp->n_bias >= PDM_SAMPLER_MAX_LOGIT_BIAS)
            return cli__bad("--logit-bias", arg, "at most %g of them", PDM_SAMPLER_MAX_LOGIT_BIAS);
        cli__bias_ids[sp->n_bias] = (int32_t)v;
        cli__bias_values[sp->n_bias] = (float)d;
        sp->n_bias++;
        sp->bias_ids = cli__bias_ids;
        sp->bias_values = cli__bias_values;
        return 1;
    }
    case CLI_OPT_LOGPROBS:
        if (pdm_parse_long(arg, 0, PDM_SAMPLER_MAX_TOP_LOGPROBS, &v))
            return cli__bad("--logprobs", arg, "0..%g alternatives per token",
                            PDM_SAMPLER_MAX_TOP_LOGPROBS);
        sp->logprobs = (int32_t)v;
        return 1;
    default: return 0;
    }
}
