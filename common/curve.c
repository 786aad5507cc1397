/*
 * curve.c - ZeroMQ CURVE key files and socket options (common/curve.h).
 */
#include "common/curve.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include "common/pdm.h"

int pdm_curve_key_valid(const char *s)
{
    if (!s || strlen(s) != PDM_CURVE_KEY_LEN) return 0;
    uint8_t raw[32];
    return zmq_z85_decode(raw, s) != NULL;
}

int pdm_curve_parse_line(char *line, char **key)
{
    char *t = line;
    while (*t == ' ' || *t == '\t') t++;
    char *end = t;
    while (*end && *end != ' ' && *end != '\t' && *end != '\r' && *end != '\n') end++;
    char *rest = end;
    while (*rest == ' ' || *rest == '\t' || *rest == '\r' || *rest == '\n') rest++;
    if (end - t == PDM_CURVE_KEY_LEN) {
        char save = *end;
        *end = 0;
        if (pdm_curve_key_valid(t) && (!*rest || *rest == '#')) {
            *key = t;
            return 1;
        }
        *end = save;
    }
    if (t == end) return 0; /* blank */
    return *t == '#' ? 0 : -1;
}

/* Reads up to two lines of `path` (each stripped of CR/LF and surrounding blanks) into l1/l2
 * (41 bytes each); returns the number of non-empty lines read. `need_private` checks the mode. */
static int curve_read(const char *path, int need_private, char *l1, char *l2, int *nlines)
{
    if (!path) return pdm_error_set(PDM_EINVAL, "CURVE: no key file given");
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return pdm_error_set(PDM_EIO, "CURVE key file %s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) || !S_ISREG(st.st_mode)) {
        close(fd);
        return pdm_error_set(PDM_EIO, "CURVE key file %s: not a regular file", path);
    }
    if (need_private && (st.st_mode & (S_IRWXG | S_IRWXO))) {
        close(fd);
        return pdm_error_set(PDM_EINVAL,
                             "CURVE key file %s holds a secret and has mode %03o: it must not be "
                             "accessible by group or others (chmod 600)",
                             path, (unsigned)(st.st_mode & 0777));
    }
    char buf[512];
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n < 0) return pdm_error_set(PDM_EIO, "CURVE key file %s: %s", path, strerror(errno));
    buf[n] = 0;
    char *lines[2] = {l1, l2};
    int k = 0;
    char *save = NULL;
    int lineno = 0;
    for (char *t = strtok_r(buf, "\n", &save); t; t = strtok_r(NULL, "\n", &save)) {
        char *key;
        lineno++;
        int r = pdm_curve_parse_line(t, &key);
        if (r == 0) continue;
        if (r < 0) {
            explicit_bzero(buf, sizeof(buf));
            return pdm_error_set(PDM_EFORMAT,
                                 "CURVE key file %s: line %d is not a 40-character Z85 key", path,
                                 lineno);
        }
        if (k == 2) {
            explicit_bzero(buf, sizeof(buf));
            return pdm_error_set(PDM_EFORMAT, "CURVE key file %s: more than two keys", path);
        }
        memcpy(lines[k++], key, PDM_CURVE_KEY_LEN + 1);
    }
    explicit_bzero(buf, sizeof(buf));
    if (!k) return pdm_error_set(PDM_EFORMAT, "CURVE key file %s: no key", path);
    *nlines = k;
    return PDM_OK;
}

int pdm_curve_load_secret(const char *path, char pub[PDM_CURVE_KEY_LEN + 1],
                          char sec[PDM_CURVE_KEY_LEN + 1])
{
    char l1[PDM_CURVE_KEY_LEN + 1], l2[PDM_CURVE_KEY_LEN + 1];
    int n = 0, st = curve_read(path, 1, l1, l2, &n);
    if (st) return st;
    memcpy(sec, n == 2 ? l2 : l1, PDM_CURVE_KEY_LEN + 1);
    if (zmq_curve_public(pub, sec))
        return pdm_error_set(PDM_EFORMAT, "CURVE key file %s: cannot derive the public key: %s",
                             path, zmq_strerror(errno));
    if (n == 2 && strcmp(pub, l1))
        return pdm_error_set(PDM_EFORMAT,
                             "CURVE key file %s: the public key on line 1 does not belong to the "
                             "secret on line 2",
                             path);
    explicit_bzero(l2, sizeof(l2));
    explicit_bzero(l1, sizeof(l1));
    return PDM_OK;
}

int pdm_curve_load_public(const char *path, char pub[PDM_CURVE_KEY_LEN + 1])
{
    char l1[PDM_CURVE_KEY_LEN + 1], l2[PDM_CURVE_KEY_LEN + 1];
    int n = 0, st = curve_read(path, 0, l1, l2, &n);
    if (st) return st;
    memcpy(pub, l1, PDM_CURVE_KEY_LEN + 1);
    explicit_bzero(l2, sizeof(l2));
    return PDM_OK;
}

int pdm_curve_client_setup(void *sock, const char *server_key_file, const char *key_file)
{
    if (!server_key_file && !key_file) return PDM_OK;
    if (!server_key_file || !key_file)
        return pdm_error_set(PDM_EINVAL, "CURVE needs both the server's public key file and the "
                                         "client key file");
    char spub[PDM_CURVE_KEY_LEN + 1], pub[PDM_CURVE_KEY_LEN + 1], sec[PDM_CURVE_KEY_LEN + 1];
    int st = pdm_curve_load_public(server_key_file, spub);
    if (!st) st = pdm_curve_load_secret(key_file, pub, sec);
    if (st) return st;
    if (zmq_setsockopt(sock, ZMQ_CURVE_SERVERKEY, spub, PDM_CURVE_KEY_LEN) ||
        zmq_setsockopt(sock, ZMQ_CURVE_PUBLICKEY, pub, PDM_CURVE_KEY_LEN) ||
        zmq_setsockopt(sock, ZMQ_CURVE_SECRETKEY, sec, PDM_CURVE_KEY_LEN))
        st = pdm_error_set(PDM_EUNSUPPORTED, "CURVE socket options: %s", zmq_strerror(errno));
    explicit_bzero(sec, sizeof(sec));
    return st;
}

int pdm_curve_server_setup(void *sock, const char *secret_z85)
{
    int one = 1;
    if (zmq_setsockopt(sock, ZMQ_CURVE_SERVER, &one, sizeof(one)) ||
        zmq_setsockopt(sock, ZMQ_CURVE_SECRETKEY, secret_z85, PDM_CURVE_KEY_LEN))
        return pdm_error_set(PDM_EUNSUPPORTED, "CURVE server options: %s", zmq_strerror(errno));
    return PDM_OK;
}

static int curve_write(const char *path, const char *text, mode_t mode, int excl)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC | (excl ? O_EXCL : O_TRUNC), mode);
    if (fd < 0) return pdm_error_set(PDM_EIO, "%s: %s", path, strerror(errno));
    size_t len = strlen(text);
    int ok = write(fd, text, len) == (ssize_t)len && fchmod(fd, mode) == 0;
    if (close(fd)) ok = 0;
    return ok ? PDM_OK : pdm_error_set(PDM_EIO, "%s: write failed", path);
}

int pdm_curve_keygen(const char *prefix, char pub[PDM_CURVE_KEY_LEN + 1])
{
    char sec[PDM_CURVE_KEY_LEN + 1], key[2 * PDM_CURVE_KEY_LEN + 8], path[4096];
    if (zmq_curve_keypair(pub, sec))
        return pdm_error_set(PDM_EUNSUPPORTED, "zmq_curve_keypair: %s", zmq_strerror(errno));
    snprintf(key, sizeof(key), "%s\n%s\n", pub, sec);
    explicit_bzero(sec, sizeof(sec));
    if (snprintf(path, sizeof(path), "%s.key", prefix) >= (int)sizeof(path))
        return pdm_error_set(PDM_EINVAL, "key prefix too long");
    int st = curve_write(path, key, 0600, 1);
    explicit_bzero(key, sizeof(key));
    if (st) return st;
    snprintf(path, sizeof(path), "%s.pub", prefix);
    snprintf(key, sizeof(key), "%s\n", pub);
    return curve_write(path, key, 0644, 0);
}

void pdm_curve_env(const char **server_key_file, const char **key_file)
{
    const char *e;
    if (!*server_key_file && (e = getenv("PDMESH_CURVE_SERVER_KEY_FILE")) && *e)
        *server_key_file = e;
    if (!*key_file && (e = getenv("PDMESH_CURVE_KEY_FILE")) && *e) *key_file = e;
}
