/*
 * test_curve.c - CURVE key files (common/curve.h): the line grammar (Z85 keys may contain
 * '#'), keygen modes, the secret-file mode check, public/secret consistency, and a real
 * CURVE handshake between two ZeroMQ sockets set up by the helpers. The router's ZAP
 * allowlist is exercised with real processes by tests/integration/curve.sh.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include "common/curve.h"
#include "common/pdm.h"
#include "tests.h"

static void write_text(const char *path, const char *text, mode_t mode)
{
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    fputs(text, f);
    fclose(f);
    ck_assert_int_eq(chmod(path, mode), 0);
}

START_TEST(test_parse_line)
{
    char pub[41], sec[41];
    ck_assert_int_eq(zmq_curve_keypair(pub, sec), 0);
    char line[200], *key;
    strcpy(line, "   \n");
    ck_assert_int_eq(pdm_curve_parse_line(line, &key), 0);
    strcpy(line, "# a comment\n");
    ck_assert_int_eq(pdm_curve_parse_line(line, &key), 0);
    snprintf(line, sizeof(line), "  %s\r\n", pub);
    ck_assert_int_eq(pdm_curve_parse_line(line, &key), 1);
    ck_assert_str_eq(key, pub);
    snprintf(line, sizeof(line), "%s   # laptop\n", pub);
    ck_assert_int_eq(pdm_curve_parse_line(line, &key), 1);
    ck_assert_str_eq(key, pub);
    snprintf(line, sizeof(line), "%s trailing\n", pub);
    ck_assert_int_eq(pdm_curve_parse_line(line, &key), -1);
    strcpy(line, "not-a-key\n");
    ck_assert_int_eq(pdm_curve_parse_line(line, &key), -1);
    /* a valid key containing '#' is a key, and its tail is not a comment (a 32-byte key's
     * first Z85 digit is at most '%', so '#' never starts one) */
    char hashkey[41];
    for (int tries = 0;; tries++) { /* about a third of all keys contain '#' */
        ck_assert_int_lt(tries, 100000);
        ck_assert_int_eq(zmq_curve_keypair(hashkey, sec), 0);
        if (strchr(hashkey, '#')) break;
    }
    snprintf(line, sizeof(line), "%s\n", hashkey);
    ck_assert_int_eq(pdm_curve_parse_line(line, &key), 1);
    ck_assert_str_eq(key, hashkey);
}
END_TEST

START_TEST(test_keyfiles)
{
    char dir[] = "/tmp/pdm-curve-XXXXXX", prefix[128], path[160], pub[41], sec[41], pub2[41];
    ck_assert_ptr_nonnull(mkdtemp(dir));
    snprintf(prefix, sizeof(prefix), "%s/k", dir);
    ck_assert_int_eq(pdm_curve_keygen(prefix, pub), PDM_OK);
    ck_assert(pdm_curve_key_valid(pub));
    ck_assert_int_ne(pdm_curve_keygen(prefix, pub2), PDM_OK); /* never overwrites */
    struct stat st;
    snprintf(path, sizeof(path), "%s.key", prefix);
    ck_assert_int_eq(stat(path, &st), 0);
    ck_assert_int_eq(st.st_mode & 0777, 0600);
    ck_assert_int_eq(pdm_curve_load_secret(path, pub2, sec), PDM_OK);
    ck_assert_str_eq(pub, pub2);
    ck_assert_int_eq(pdm_curve_load_public(path, pub2), PDM_OK);
    ck_assert_str_eq(pub, pub2);
    chmod(path, 0640);
    ck_assert_int_eq(pdm_curve_load_secret(path, pub2, sec), PDM_EINVAL);
    ck_assert_ptr_nonnull(strstr(pdm_error_last(), "mode 640"));
    chmod(path, 0600);
    snprintf(path, sizeof(path), "%s.pub", prefix);
    ck_assert_int_eq(pdm_curve_load_public(path, pub2), PDM_OK);
    ck_assert_str_eq(pub, pub2);

    /* one-line secret file; a public key that does not match the secret */
    char other_pub[41], other_sec[41], text[200];
    ck_assert_int_eq(zmq_curve_keypair(other_pub, other_sec), 0);
    snprintf(path, sizeof(path), "%s/secret-only", dir);
    snprintf(text, sizeof(text), "%s\n", other_sec);
    write_text(path, text, 0600);
    ck_assert_int_eq(pdm_curve_load_secret(path, pub2, sec), PDM_OK);
    ck_assert_str_eq(pub2, other_pub);
    snprintf(path, sizeof(path), "%s/mismatch", dir);
    snprintf(text, sizeof(text), "%s\n%s\n", pub, other_sec);
    write_text(path, text, 0600);
    ck_assert_int_eq(pdm_curve_load_secret(path, pub2, sec), PDM_EFORMAT);
    snprintf(path, sizeof(path), "%s/garbage", dir);
    write_text(path, "hello\n", 0600);
    ck_assert_int_eq(pdm_curve_load_secret(path, pub2, sec), PDM_EFORMAT);
    snprintf(path, sizeof(path), "%s/missing", dir);
    ck_assert_int_eq(pdm_curve_load_public(path, pub2), PDM_EIO);

    /* client setup: both files or neither */
    void *ctx = zmq_ctx_new(), *s = zmq_socket(ctx, ZMQ_DEALER);
    snprintf(path, sizeof(path), "%s.key", prefix);
    ck_assert_int_eq(pdm_curve_client_setup(s, NULL, NULL), PDM_OK);
    ck_assert_int_eq(pdm_curve_client_setup(s, path, NULL), PDM_EINVAL);
    zmq_close(s);
    zmq_ctx_term(ctx);
    char cmd[200];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    ck_assert_int_eq(system(cmd), 0);
}
END_TEST

/* A CURVE server and a client set up by the helpers exchange a message (no ZAP handler in
 * this context: libzmq then accepts any client key). A client with the wrong server key
 * does not get through. */
START_TEST(test_handshake)
{
    char dir[] = "/tmp/pdm-curve-XXXXXX", sp[128], cp[128], spub[160], ckey[160], pub[41], sec[41];
    ck_assert_ptr_nonnull(mkdtemp(dir));
    snprintf(sp, sizeof(sp), "%s/server", dir);
    snprintf(cp, sizeof(cp), "%s/client", dir);
    ck_assert_int_eq(pdm_curve_keygen(sp, pub), PDM_OK);
    ck_assert_int_eq(pdm_curve_keygen(cp, pub), PDM_OK);
    snprintf(spub, sizeof(spub), "%s.pub", sp);
    snprintf(ckey, sizeof(ckey), "%s.key", cp);
    char skey[160];
    snprintf(skey, sizeof(skey), "%s.key", sp);
    ck_assert_int_eq(pdm_curve_load_secret(skey, pub, sec), PDM_OK);

    void *ctx = zmq_ctx_new(), *srv = zmq_socket(ctx, ZMQ_ROUTER), *cli = zmq_socket(ctx, ZMQ_DEALER);
    int zero = 0, tmo = 5000;
    zmq_setsockopt(srv, ZMQ_LINGER, &zero, sizeof(zero));
    zmq_setsockopt(cli, ZMQ_LINGER, &zero, sizeof(zero));
    zmq_setsockopt(srv, ZMQ_RCVTIMEO, &tmo, sizeof(tmo));
    ck_assert_int_eq(pdm_curve_server_setup(srv, sec), PDM_OK);
    ck_assert_int_eq(zmq_bind(srv, "tcp://127.0.0.1:*"), 0);
    char ep[128];
    size_t len = sizeof(ep);
    zmq_getsockopt(srv, ZMQ_LAST_ENDPOINT, ep, &len);
    ck_assert_int_eq(pdm_curve_client_setup(cli, spub, ckey), PDM_OK);
    ck_assert_int_eq(zmq_connect(cli, ep), 0);
    ck_assert_int_eq(zmq_send(cli, "hello", 5, 0), 5);
    char id[256], buf[16];
    ck_assert_int_gt(zmq_recv(srv, id, sizeof(id), 0), 0);
    ck_assert_int_eq(zmq_recv(srv, buf, sizeof(buf), 0), 5);
    ck_assert_int_eq(memcmp(buf, "hello", 5), 0);

    /* a client that trusts another server key never gets through */
    void *bad = zmq_socket(ctx, ZMQ_DEALER);
    zmq_setsockopt(bad, ZMQ_LINGER, &zero, sizeof(zero));
    ck_assert_int_eq(pdm_curve_client_setup(bad, ckey, ckey), PDM_OK); /* client's own pub as "server" */
    ck_assert_int_eq(zmq_connect(bad, ep), 0);
    zmq_send(bad, "intruder", 8, ZMQ_DONTWAIT);
    tmo = 700;
    zmq_setsockopt(srv, ZMQ_RCVTIMEO, &tmo, sizeof(tmo));
    ck_assert_int_lt(zmq_recv(srv, id, sizeof(id), 0), 0);
    zmq_close(bad);
    zmq_close(cli);
    zmq_close(srv);
    zmq_ctx_term(ctx);
    char cmd[200];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    ck_assert_int_eq(system(cmd), 0);
}
END_TEST

Suite *suite_curve(void)
{
    Suite *s = suite_create("curve");
    TCase *tc = tcase_create("curve");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_parse_line);
    tcase_add_test(tc, test_keyfiles);
    tcase_add_test(tc, test_handshake);
    suite_add_tcase(s, tc);
    return s;
}
