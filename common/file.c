/*
 * file.c - whole small files and secrets (common/pdm.h): the one "read a file into memory"
 * helper and the one loader of secrets and tokens (cluster secret, admin token).
 *
 * Secrets never come from a command-line value (argv is visible in ps); a secret is found in
 * this order, and the first source that is configured is the only one read:
 *   1. the file given by an option or a config file (src->file),
 *   2. the file named by an environment variable (src->env_file, e.g. $PDMESH_SECRET_FILE),
 *   3. the value of an environment variable (src->env_value, e.g. $PDMESH_SECRET).
 * An empty string counts as "not configured" at every level.
 */
#include "common/pdm.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int pdm_file_read(const char *path, size_t max_bytes, char **data, size_t *len)
{
    if (!path || !*path || !data) return pdm_error_set(PDM_EINVAL, "pdm_file_read: no path");
    FILE *f = fopen(path, "rb");
    if (!f) return pdm_error_set(PDM_EIO, "%s: %s", path, strerror(errno));
    /* Read in growing chunks up to max_bytes + 1, so that special files (/proc, pipes) whose
     * size is unknown work too, and one byte past the cap tells "too large". */
    size_t cap = PDM_MIN(max_bytes, (size_t)4096) + 2, n = 0;
    char *buf = malloc(cap);
    int st = PDM_OK;
    if (!buf) {
        st = pdm_error_set(PDM_ENOMEM, "%s: out of memory", path);
        goto err_file;
    }
    for (;;) {
        size_t got = fread(buf + n, 1, cap - 1 - n, f);
        n += got;
        if (n > max_bytes) {
            st = pdm_error_set(PDM_ERANGE, "%s: larger than %zu bytes", path, max_bytes);
            goto err_buf;
        }
        if (got == 0) break;
        if (n == cap - 1) {
            size_t ncap = cap - 1 > max_bytes / 2 ? max_bytes + 2 : 2 * cap;
            char *nb = realloc(buf, ncap);
            if (!nb) {
                st = pdm_error_set(PDM_ENOMEM, "%s: out of memory", path);
                goto err_buf;
            }
            buf = nb;
            cap = ncap;
        }
    }
    if (ferror(f)) {
        st = pdm_error_set(PDM_EIO, "%s: read error", path);
        goto err_buf;
    }
    fclose(f);
    buf[n] = 0;
    *data = buf;
    if (len) *len = n;
    return PDM_OK;

err_buf:
    free(buf);
err_file:
    fclose(f);
    return st;
}

/* Strips the trailing line ends ("\n", "\r\n", any run of CR/LF) a text editor or `echo`
 * leaves behind; nothing else is trimmed (leading and inner blanks are part of the secret). */
static size_t pdm__secret_trim(char *buf, size_t n)
{
    while (n && (buf[n - 1] == '\n' || buf[n - 1] == '\r')) n--;
    buf[n] = 0;
    return n;
}

int pdm_secret_load(const pdm_secret_source_t *src, char **out, size_t *len)
{
    const char *what = src->what ? src->what : "secret";
    const char *env_file = src->env_file ? getenv(src->env_file) : NULL;
    const char *env_value = src->env_value ? getenv(src->env_value) : NULL;
    char from[128] = ""; /* " from $VAR" when the environment named the source */
    char *buf = NULL;
    size_t n = 0;
    int st;
    if (src->file && *src->file) {
        st = pdm_file_read(src->file, PDM_SECRET_MAX, &buf, &n);
    } else if (env_file && *env_file) {
        snprintf(from, sizeof(from), " from $%s", src->env_file);
        st = pdm_file_read(env_file, PDM_SECRET_MAX, &buf, &n);
    } else if (env_value && *env_value) {
        snprintf(from, sizeof(from), " from $%s", src->env_value);
        n = strlen(env_value);
        if (n > PDM_SECRET_MAX)
            return pdm_error_set(PDM_ERANGE, "%s%s: over %d bytes", what, from, PDM_SECRET_MAX);
        buf = strdup(env_value);
        st = buf ? PDM_OK : pdm_error_set(PDM_ENOMEM, "out of memory");
    } else {
        return pdm_error_set(PDM_ENOTFOUND, "no %s configured: give %s%s%s%s%s%s", what,
                             src->file_option ? src->file_option : "",
                             src->file_option && src->env_file ? ", " : "",
                             src->env_file ? "$" : "", src->env_file ? src->env_file : "",
                             src->env_value ? " or $" : "", src->env_value ? src->env_value : "");
    }
    if (st) { /* pdm_file_read's message names the file; add which secret, who named it */
        char why[1024];
        snprintf(why, sizeof(why), "%s", pdm_error_last());
        return pdm_error_set(st, "%s%s: %s", what, from, why);
    }
    n = pdm__secret_trim(buf, n);
    if (n < src->min_len)
        st = pdm_error_set(PDM_EINVAL, "%s%s: too short (%zu bytes, need at least %zu)", what, from,
                           n, src->min_len);
    else if (!src->binary && memchr(buf, 0, n))
        st = pdm_error_set(PDM_EINVAL, "%s%s: contains a NUL byte", what, from);
    if (st) {
        explicit_bzero(buf, n);
        free(buf);
        return st;
    }
    *out = buf;
    if (len) *len = n;
    return PDM_OK;
}
