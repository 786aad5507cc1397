/*
 * curve.h - ZeroMQ CURVE key files and socket set-up shared by the router, the node link
 * (common/nodelink.c), the SDK and the CLI (docs/router.md, "CURVE").
 *
 * Key file format: line 1 the Z85 public key (40 characters), line 2 the Z85 secret key; a
 * file with one line holds either a public key (a ".pub" file, what clients are given as the
 * server key) or, for the router's --curve-secret-file, only the secret. Files holding a
 * secret must not be readable by group or others (mode checked). Keys never go on a command
 * line.
 */
#ifndef PDM_CURVE_H
#define PDM_CURVE_H

#define PDM_CURVE_KEY_LEN 40 /* Z85 text of a 32-byte key */

/* Loads a secret key from `path` (line 2 of a key file, or line 1 of a one-line secret file)
 * and derives its public key; checks a public key on line 1 matches. Refuses a file readable
 * by group/others. pub/sec get 41 bytes (NUL-terminated). */
int pdm_curve_load_secret(const char *path, char pub[PDM_CURVE_KEY_LEN + 1],
                          char sec[PDM_CURVE_KEY_LEN + 1]);

/* Loads the public key on line 1 of `path` (a .pub file or a key file). */
int pdm_curve_load_public(const char *path, char pub[PDM_CURVE_KEY_LEN + 1]);

/* 1 if `s` (exactly 40 characters up to a NUL) is a valid Z85 key. */
int pdm_curve_key_valid(const char *s);

/* Parses one line of a key file or allowlist in place. Z85 keys may contain '#' (never as
 * the first character of a 32-byte key, but no rule relies on that), so: the first blank-separated word is a key when it is a valid 40-character Z85
 * key (anything after it must be a '#' comment); otherwise a line starting with '#' is a
 * comment. Returns 1 with *key set, 0 for a blank/comment line, -1 for anything else. */
int pdm_curve_parse_line(char *line, char **key);

/* Client side: ZMQ_CURVE_SERVERKEY from server_key_file (line 1), PUBLICKEY/SECRETKEY from
 * key_file. Both NULL: nothing is set (plain socket). One without the other: PDM_EINVAL.
 * Must be called before zmq_connect. */
int pdm_curve_client_setup(void *sock, const char *server_key_file, const char *key_file);

/* Server side: ZMQ_CURVE_SERVER with the given Z85 secret. Before zmq_bind. */
int pdm_curve_server_setup(void *sock, const char *secret_z85);

/* Writes PREFIX.key (public + secret, mode 0600) and PREFIX.pub (public, 0644) with a fresh
 * keypair. Refuses to overwrite an existing PREFIX.key. */
int pdm_curve_keygen(const char *prefix, char pub[PDM_CURVE_KEY_LEN + 1]);

/* Fills *server / *key from $PDMESH_CURVE_SERVER_KEY_FILE / $PDMESH_CURVE_KEY_FILE where they
 * are still NULL. */
void pdm_curve_env(const char **server_key_file, const char **key_file);

#endif
