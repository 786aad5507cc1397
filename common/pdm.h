/*
 * pdm.h - the common layer of pdmesh: status codes, error messages, logging, clocks.
 *
 * Every function in pdmesh that can fail returns a pdm status: 0 is success, a positive value
 * means "in progress", a negative value is an error. System errors pass through as -errno.
 * Besides the code, the place that first detects an error records a human-readable message
 * (pdm_error_set); callers higher up print pdm_error_last() to the user. The message is
 * thread-local, so concurrent threads never see each other's messages.
 */
#ifndef PDM_H
#define PDM_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

/* One list produces the enum and the strings. Codes start far below -4095 so that they can
 * never collide with a negated errno value. */
#define PDM_ERRNO_MAP(X)                                                                        \
    X(INVAL, -5000, "invalid argument")                                                        \
    X(NOMEM, -5001, "out of memory")                                                           \
    X(IO, -5002, "input/output error")                                                         \
    X(FORMAT, -5003, "malformed input")                                                        \
    X(UNSUPPORTED, -5004, "unsupported")                                                       \
    X(RANGE, -5005, "value out of range")                                                      \
    X(NOTFOUND, -5006, "not found")                                                            \
    X(TIMEOUT, -5007, "timed out")                                                             \
    X(CANCELED, -5008, "canceled")                                                             \
    X(OVERFLOW, -5009, "capacity exceeded")                                                    \
    X(PEER, -5010, "peer failure")                                                             \
    X(CHECKSUM, -5011, "checksum mismatch")                                                    \
    X(STATE, -5012, "operation not valid in the current state")

typedef enum {
    PDM_OK = 0,
#define PDM__ERR_ENUM(name, code, msg) PDM_E##name = code,
    PDM_ERRNO_MAP(PDM__ERR_ENUM)
#undef PDM__ERR_ENUM
} pdm_status_t;

/* Returns a static string describing `status` (a pdm code or a negated errno). */
const char *pdm_strerror(int status);

/* Records a formatted message for the calling thread and returns `status` unchanged, so that
 * error paths read `return pdm_error_set(PDM_EFORMAT, "%s: bad magic", path);`. */
int pdm_error_set(int status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* The calling thread's last recorded message, or the strerror of the last status if no
 * message was recorded. Never NULL. */
const char *pdm_error_last(void);

/* Clears the calling thread's message. */
void pdm_error_clear(void);

/* Logging to stderr. The level comes from PDMESH_LOG (error, warn, info, debug); default warn. */
typedef enum { PDM_LOG_ERROR = 0, PDM_LOG_WARN, PDM_LOG_INFO, PDM_LOG_DEBUG } pdm_log_level_t;

void pdm_log(pdm_log_level_t level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void pdm_log_set_level(pdm_log_level_t level);
int pdm_log_enabled(pdm_log_level_t level);

#define pdm_log_error(...) pdm_log(PDM_LOG_ERROR, __VA_ARGS__)
#define pdm_log_warn(...) pdm_log(PDM_LOG_WARN, __VA_ARGS__)
#define pdm_log_info(...) pdm_log(PDM_LOG_INFO, __VA_ARGS__)
#define pdm_log_debug(...)                                                                     \
    do {                                                                                        \
        if (pdm_log_enabled(PDM_LOG_DEBUG)) pdm_log(PDM_LOG_DEBUG, __VA_ARGS__);                \
    } while (0)

/* Monotonic time in seconds. */
double pdm_now(void);

/* Overflow-checked size arithmetic: return 0 and store the result, or -1 on overflow. */
static inline int pdm_size_mul(size_t a, size_t b, size_t *out)
{
    return __builtin_mul_overflow(a, b, out) ? -1 : 0;
}
static inline int pdm_size_add(size_t a, size_t b, size_t *out)
{
    return __builtin_add_overflow(a, b, out) ? -1 : 0;
}

/* Parses a whole decimal integer / float string; returns PDM_EINVAL if `s` is not entirely a
 * number or PDM_ERANGE if it is outside [min, max]. */
int pdm_parse_long(const char *s, long min, long max, long *out);
int pdm_parse_double(const char *s, double min, double max, double *out);

/* SplitMix64 (Steele, Lea, Flood 2014): advances *state and returns 64 well-mixed bits.
 * Used to seed generators and to make reproducible test data. */
static inline uint64_t pdm_splitmix64(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* The seed a request that names none (seed 0) samples with (model.h, sampling parameters). */
#define PDM_SEED_DEFAULT 0x5eedull

/* The seed of choice i of a request seeded with `seed` (OpenAI's n): `seed` itself for i = 0,
 * so that n = 1 is the ordinary request, else splitmix64 of seed XOR (i * 0xD1B54A32D192ED03)
 * (a constant other than the sampler's per-step one, so that choice i's draws are not choice
 * 0's shifted by i steps). The sampler (pdm_sampler_seed_for_choice), the decode node's
 * samples and the SDKs' failover of a choice all derive it here; `seed` is the one sampled
 * with, PDM_SEED_DEFAULT for a request that named none. The Python SDK's copy
 * (sdk/python/pdmesh/client.py seed_for_choice) is checked against the same values. */
static inline uint64_t pdm_seed_for_choice(uint64_t seed, int i)
{
    if (i == 0) return seed;
    uint64_t x = seed ^ ((uint64_t)i * 0xD1B54A32D192ED03ull);
    return pdm_splitmix64(&x);
}

/* Lower-case hex of `len` bytes, malloc'd and NUL-terminated (NULL if out of memory). */
char *pdm_hex_encode(const void *data, size_t len);
/* Decodes lower- or upper-case hex into a malloc'd buffer; PDM_EFORMAT if `s` is empty, of odd
 * length or not hex, PDM_ENOMEM. Writes the outputs only on success. */
int pdm_hex_decode(const char *s, uint8_t **out, size_t *len);

/* ---- Files and secrets (common/file.c) ----------------------------------------------------- */

/* Reads the whole file `path` into a malloc'd buffer with a NUL byte after the data (so text
 * can be used as a C string; binary data may hold NULs, *len counts the bytes without the
 * terminator). Refuses files over max_bytes. Works on files of unknown size (/proc, pipes).
 * PDM_EIO (cannot open or read; the message names the path and the reason), PDM_ERANGE (over
 * max_bytes), PDM_ENOMEM. Writes *data and *len only on success; len may be NULL. */
int pdm_file_read(const char *path, size_t max_bytes, char **data, size_t *len);

/* The size limit of every secret and token, from a file or the environment. */
#define PDM_SECRET_MAX 4096

/* Where a secret comes from (see pdm_secret_load). */
typedef struct {
    const char *what;        /* named in errors: "cluster secret", "admin token" */
    const char *file;        /* 1st: a file from an option or config; NULL/"" = not given */
    const char *file_option; /* the option's name for messages ("--secret-file FILE"), or NULL */
    const char *env_file;    /* 2nd: the name of a variable holding a file path, or NULL */
    const char *env_value;   /* 3rd: the name of a variable holding the value itself, or NULL */
    size_t min_len;          /* the shortest value accepted (after trimming) */
    int binary;              /* 1: may contain NUL bytes (an HMAC key); 0: text (a token) */
} pdm_secret_source_t;

/* Loads a secret: the first configured of src->file, the file named by $src->env_file, the
 * value of $src->env_value (precedence file option > env file > env value; empty strings count
 * as not configured). At most PDM_SECRET_MAX bytes; trailing CR/LF characters are stripped,
 * nothing else. No file-mode check is made (none of the loaders this replaced made one).
 * On success *out is malloc'd and NUL-terminated, *len (may be NULL) its length.
 * Errors name the secret and the source: PDM_ENOTFOUND (nothing configured; the message lists
 * the sources), PDM_EIO (file unreadable), PDM_ERANGE (too long), PDM_EINVAL (shorter than
 * src->min_len, or a NUL byte in a text secret), PDM_ENOMEM. */
int pdm_secret_load(const pdm_secret_source_t *src, char **out, size_t *len);

/* ---- protocol features (Register.features) ----
 * One bit per control-plane behaviour that a peer of an older version does not have, so that
 * a mesh whose pods are upgraded one by one keeps serving (docs/deployment.md "Versions"). A
 * node sends the bits of its role; an older node sends none. A new behaviour that an older
 * peer would misread gets the next bit here, its name in pdm_feat_format, and a rule in the
 * router for what it does when a peer lacks it. */
#define PDM_FEAT_ORDERED_GROUP (1ull << 0) /* prefill: rank 0 forwards each group task
                                            * (PDM_KVT_KIND_ORDER_TASK), followers run only
                                            * what it forwards when GroupWire.ordered */
#define PDM_FEAT_DELTA_KV (1ull << 1)      /* prefill: PrefillTask.stream_from honoured;
                                            * decode: DecodeTask.pool_prefix honoured */
#define PDM_FEAT_PREFILL (PDM_FEAT_ORDERED_GROUP | PDM_FEAT_DELTA_KV)
#define PDM_FEAT_DECODE PDM_FEAT_DELTA_KV

/* Writes the names of the bits of `features` into buf ("ordered_group,delta_kv"; "none" for
 * 0; an unknown bit as "bit<N>"), always NUL-terminated, cut at cap - 1 bytes. */
void pdm_feat_format(uint64_t features, char *buf, size_t cap);

#define PDM_ARRAY_SIZE(a) (sizeof(a) / sizeof((a)[0]))
#define PDM_MIN(a, b) ((a) < (b) ? (a) : (b))
#define PDM_MAX(a, b) ((a) > (b) ? (a) : (b))

#endif /* PDM_H */
