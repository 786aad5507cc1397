/*
 * tokenizer.h - the tokenizers of GGUF files: byte-level BPE (tokenizer.ggml.model = gpt2)
 * and SentencePiece (= llama). Part of model.h.
 *
 * Vocabulary, merges or scores, token types and special ids come from the `tokenizer.ggml.*`
 * keys; BPE pre-tokenization uses the model's split regex through PCRE2 (UTF + UCP), so
 * tokenization matches llama.cpp token for token. Detokenization streams: bytes of a UTF-8 character that
 * spans several tokens are held back until the character is complete.
 */
#ifndef PDM_MODEL_TOKENIZER_H
#define PDM_MODEL_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "chat.h"
#include "gguf.h"

typedef struct pdm_tokenizer pdm_tokenizer_t;

/* Builds a tokenizer from the metadata of `g` (which must outlive it only during this call:
 * everything needed is copied). Unsupported tokenizer models give PDM_EUNSUPPORTED. */
int pdm_tokenizer_create(const pdm_gguf_t *g, pdm_tokenizer_t **out);
void pdm_tokenizer_destroy(pdm_tokenizer_t *t);

int32_t pdm_tokenizer_n_vocab(const pdm_tokenizer_t *t);
int32_t pdm_tokenizer_bos(const pdm_tokenizer_t *t); /* -1 if none */
int32_t pdm_tokenizer_eos(const pdm_tokenizer_t *t); /* -1 if none */
int32_t pdm_tokenizer_pad(const pdm_tokenizer_t *t); /* -1 if none */
int pdm_tokenizer_add_bos(const pdm_tokenizer_t *t); /* tokenizer.ggml.add_bos_token */
/* 1 if generation should stop at `id` (EOS or an end-of-generation control token). A NULL
 * tokenizer (a model loaded without one: its tokenizer type is unsupported, so it runs on
 * token ids) has no such token: 0. */
int pdm_tokenizer_is_eog(const pdm_tokenizer_t *t, int32_t id);

typedef enum {
    PDM_TOKENIZE_ADD_BOS = 1 << 0, /* prepend BOS if the model asks for it (add_bos_token) */
    PDM_TOKENIZE_SPECIAL = 1 << 1, /* parse special/control token text like <|im_start|> */
} pdm_tokenize_flags_t;

/* Tokenizes `len` bytes of `text`. Writes at most `cap` ids to `ids` and the total count
 * needed to *n_out. Returns PDM_OK, or PDM_EOVERFLOW if cap was too small (then *n_out is
 * the size needed, so callers can retry). Invalid UTF-8 is tokenized byte-wise, never
 * rejected. */
int pdm_tokenizer_encode(const pdm_tokenizer_t *t, const char *text, size_t len, int flags,
                         int32_t *ids, size_t cap, size_t *n_out);

/* The bytes of token `id` as it appears in text (byte-level decoding applied; control
 * tokens give their text only when `special` is set, else ""). Returns the length written
 * (at most cap, not NUL-terminated) or a negative status for an invalid id. */
int pdm_tokenizer_token_bytes(const pdm_tokenizer_t *t, int32_t id, int special, char *buf,
                              size_t cap);

/* Streaming detokenizer: feed ids one at a time, get back text that ends on a UTF-8
 * character boundary; incomplete trailing bytes are kept until completed (or flushed). */
typedef struct {
    char pending[8]; /* bytes of an incomplete UTF-8 sequence */
    int n_pending;
    int special;     /* render control tokens */
} pdm_detok_t;

void pdm_detok_init(pdm_detok_t *d, int special);
/* Appends the completed text of `id` to buf (NUL-terminated, at most cap-1 bytes). Returns
 * the number of bytes written or a negative status (invalid id, buffer too small). */
int pdm_detok_feed(pdm_detok_t *d, const pdm_tokenizer_t *t, int32_t id, char *buf, size_t cap);
/* Emits whatever is pending (an invalid sequence is emitted as U+FFFD). */
int pdm_detok_flush(pdm_detok_t *d, char *buf, size_t cap);

/* Renders a conversation in the model's chat format (chat.h): the family of the file's
 * tokenizer.chat_template as llama.cpp detects it, or the one set with
 * pdm_tokenizer_set_chat_template; a file without a template gets Gemma's format if it is a
 * Gemma model, ChatML if its vocabulary has <|im_start|>. ChatML templates with a default
 * system prompt (SmolLM2, Qwen2.5) insert it when the first message is not a system message.
 * roles/contents are NUL-terminated. Returns a malloc'd NUL-terminated string or NULL; with
 * no known format, NULL and PDM_EUNSUPPORTED (the message names --chat-template). */
char *pdm_tokenizer_chat_render(const pdm_tokenizer_t *t, const char *const *roles,
                                const char *const *contents, int n_messages,
                                int add_generation_prompt);

/* The same with tools (chat.h, pdm_chat_render_tools): `tools_json` (may be NULL) and
 * messages that may carry tool calls or be tool results. NULL with PDM_EUNSUPPORTED when the
 * format does not render tools. */
char *pdm_tokenizer_chat_render_tools(const pdm_tokenizer_t *t, const pdm_chat_msg_t *msgs,
                                      int n_messages, const char *tools_json,
                                      int add_generation_prompt);

/* Chooses the chat format by name ("chatml", "gemma", "llama3", ...; pdm_chat_names()),
 * overriding the file's template. The one call that writes to a tokenizer after create: make
 * it before the tokenizer is shared between threads. PDM_EINVAL for an unknown name (the
 * message lists the known ones); the format is then unchanged. */
int pdm_tokenizer_set_chat_template(pdm_tokenizer_t *t, const char *name);

/* The chat format in use (PDM_CHAT_UNKNOWN if there is none). */
pdm_chat_format_t pdm_tokenizer_chat_format(const pdm_tokenizer_t *t);

#endif /* PDM_MODEL_TOKENIZER_H */
