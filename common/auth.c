/*
 * auth.c - node registration proofs (HMAC-SHA256 with the cluster secret), the cluster secret
 * loader and SHA-256 (common/wire.h, "authentication"). Node-only: used by the router, the
 * daemons and the test clients, not by libpdmesh (COMMON_NODE_SRC in the Makefile).
 */
#include "common/wire.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/pdm.h"

static size_t pdm__proof_input(const char *node_id, uint64_t nonce, uint64_t ts, uint8_t *buf,
                               size_t cap)
{
    size_t n = strlen(node_id);
    if (n + 17 > cap) n = cap - 17;
    memcpy(buf, node_id, n);
    buf[n++] = 0;
    for (int i = 7; i >= 0; i--) buf[n++] = (uint8_t)(nonce >> (8 * i));
    for (int i = 7; i >= 0; i--) buf[n++] = (uint8_t)(ts >> (8 * i));
    return n;
}

void pdm_auth_proof(const void *secret, size_t secret_len, const char *node_id, uint64_t nonce,
                    uint64_t timestamp_ms, uint8_t out[32])
{
    uint8_t in[512];
    size_t n = pdm__proof_input(node_id, nonce, timestamp_ms, in, sizeof(in));
    unsigned int olen = 32;
    HMAC(EVP_sha256(), secret, (int)secret_len, in, n, out, &olen);
}

int pdm_auth_verify(const void *secret, size_t secret_len, const char *node_id, uint64_t nonce,
                    uint64_t timestamp_ms, const void *proof, size_t proof_len)
{
    if (proof_len != 32) return 0;
    uint8_t want[32];
    pdm_auth_proof(secret, secret_len, node_id, nonce, timestamp_ms, want);
    return CRYPTO_memcmp(want, proof, 32) == 0;
}

int pdm_auth_load_secret(const char *path, uint8_t **out, size_t *len)
{
    const pdm_secret_source_t src = {.what = "cluster secret",
                                     .file = path,
                                     .file_option = "--secret-file FILE",
                                     .env_file = "PDMESH_SECRET_FILE",
                                     .env_value = "PDMESH_SECRET",
                                     .min_len = 16,
                                     .binary = 1};
    char *secret;
    int st = pdm_secret_load(&src, &secret, len);
    if (!st) *out = (uint8_t *)secret;
    return st;
}

void pdm_sha256(const void *data, size_t len, uint8_t out[32])
{
    unsigned int olen = 32;
    EVP_Digest(data, len, out, &olen, EVP_sha256(), NULL);
}

void pdm_prefix_salt_derive(const void *secret, size_t secret_len, uint8_t out[16])
{
    static const char label[] = "pdmesh prefix block key salt v1";
    uint8_t mac[32];
    unsigned int olen = 32;
    HMAC(EVP_sha256(), secret, (int)secret_len, (const uint8_t *)label, sizeof(label) - 1, mac,
         &olen);
    memcpy(out, mac, 16);
}

int pdm_prefix_block_keys(const pdm_prefix_key_params_t *p, const int32_t *tok, uint32_t n,
                          uint8_t (*out)[32], int max)
{
    const int bt = p->block_tokens > 0 ? p->block_tokens : 64;
    int k = 0;
    uint8_t parent[32] = {0};
    static const char tag[] = "pdmesh-prefix-v1";
    const char *model = p->model ? p->model : "";
    uint32_t mlen = (uint32_t)strlen(model), tlen = (uint32_t)bt;
    size_t cap = sizeof(tag) + 16 + 4 + mlen + 32 + 4 + sizeof(int32_t) * (size_t)bt;
    uint8_t *buf = malloc(cap);
    if (!buf) return 0;
    for (uint32_t s = 0; s + (uint32_t)bt <= n && k < max; s += (uint32_t)bt) {
        size_t o = 0;
        memcpy(buf + o, tag, sizeof(tag)), o += sizeof(tag);
        memcpy(buf + o, p->salt, 16), o += 16;
        memcpy(buf + o, &mlen, 4), o += 4;
        memcpy(buf + o, model, mlen), o += mlen;
        memcpy(buf + o, parent, 32), o += 32;
        memcpy(buf + o, &tlen, 4), o += 4;
        memcpy(buf + o, tok + s, sizeof(int32_t) * (size_t)bt), o += sizeof(int32_t) * (size_t)bt;
        pdm_sha256(buf, o, out[k]);
        memcpy(parent, out[k], 32);
        k++;
    }
    free(buf);
    return k;
}
