/*
 * chat_stream - a small streaming chat over libpdmesh.
 *
 *   build/bin/pdmesh-chat [ENDPOINT]        (default $PDMESH_ROUTER or tcp://127.0.0.1:7700)
 *
 * Reads one user turn per line from stdin, sends the whole conversation as chat messages and
 * prints the answer as it streams. Ctrl-D ends the chat.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sdk/pdmesh_client.h"

#define MAX_TURNS 64

static int print_chunk(const pdm_client_chunk_t *chunk, void *data)
{
    (void)data;
    fwrite(chunk->text, 1, chunk->text_len, stdout);
    fflush(stdout);
    return 0; /* nonzero would cancel the call */
}

int main(int argc, char **argv)
{
    pdm_client_t *client;
    if (pdm_client_create(argc > 1 ? argv[1] : NULL, NULL, &client)) {
        fprintf(stderr, "chat: %s\n", pdm_client_last_error());
        return 1;
    }
    pdm_client_message_t turns[MAX_TURNS];
    char *owned[MAX_TURNS];
    size_t n = 0;
    int status = 0;
    char line[4096];
    turns[n++] = (pdm_client_message_t){.role = "system", .content = "You are a helpful assistant."};
    owned[0] = NULL;
    fprintf(stderr, "> ");
    while (n + 2 <= MAX_TURNS && fgets(line, sizeof(line), stdin)) {
        line[strcspn(line, "\n")] = 0;
        if (!*line) continue;
        owned[n] = strdup(line);
        turns[n] = (pdm_client_message_t){.role = "user", .content = owned[n]};
        n++;
        pdm_client_request_t req;
        pdm_client_request_init(&req);
        req.messages = turns;
        req.n_messages = n;
        req.max_tokens = 128;
        pdm_client_result_t res;
        int rc = pdm_client_generate_stream(client, &req, print_chunk, NULL, &res);
        if (rc) {
            fprintf(stderr, "\nchat: %s (%s)\n", res.error, pdm_client_status_name(rc));
            pdm_client_result_fini(&res);
            status = 1;
            break;
        }
        fprintf(stderr, "\n[%zu tokens, first after %.0f ms, %.1f tokens/s]\n> ", res.n_tokens,
                res.client_ttft_ms,
                res.n_tokens > 1 && res.client_total_ms > res.client_ttft_ms
                    ? (double)(res.n_tokens - 1) * 1e3 / (res.client_total_ms - res.client_ttft_ms)
                    : 0.0);
        owned[n] = res.text; /* the answer joins the conversation */
        res.text = NULL;
        turns[n] = (pdm_client_message_t){.role = "assistant", .content = owned[n]};
        n++;
        pdm_client_result_fini(&res);
    }
    for (size_t i = 0; i < n; i++) free(owned[i]);
    pdm_client_destroy(client);
    return status;
}
