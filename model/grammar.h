/*
 * grammar.h - structured output: a JSON-Schema -> grammar compiler and an incremental matcher
 * that masks the vocabulary per decode step. Part of model.h.
 *
 * The grammar is a context-free grammar over bytes in the shape of llama.cpp's GBNF (rules of
 * alternatives of sequences of byte classes and rule references; ideas from llama.cpp's
 * grammar-parser.cpp / json-schema-to-grammar and from XGrammar, arXiv:2411.15100; no code
 * taken). The matcher is a pushdown automaton that keeps the set of its possible stacks (as
 * llama.cpp's llama_grammar_advance_stack does), so anyOf and optional whitespace need no
 * backtracking. A step's mask comes from one walk of a byte trie over the vocabulary (built
 * once per model and shared), pruned where no stack survives, so tokens sharing a prefix are
 * advanced once; masks are cached by the matcher state (inside a string or a number the state
 * repeats step after step).
 *
 * Supported schema subset (anything else is refused with a message naming the keyword):
 * type (object, array, string, number, integer, boolean, null, or a list of them), properties,
 * required, additionalProperties (false; true or a schema only where there are no properties:
 * a dictionary), items, minItems, maxItems, enum, const, anyOf, oneOf (as anyOf), $ref to
 * "#/$defs/..." or "#/definitions/...", $defs, definitions; annotations (title, description,
 * default, examples, $schema, $id, $comment) are ignored. Properties come in the schema's
 * order; the ones not in required may be left out. Whitespace between tokens is bounded
 * (PDM_GRAMMAR_MAX_WS bytes), numbers have at most 16 integer and 16 fraction digits, so the
 * model cannot loop on padding.
 *
 * One pdmesh extension: the root schema may carry "x-pdmesh-prefix" and "x-pdmesh-suffix",
 * literal texts the output must start and end with around the JSON value (tool calls: Qwen's
 * "<tool_call>\n" ... "\n</tool_call>"). The keys are otherwise ignored (as any "x-" key is
 * an annotation), so the schema still validates the value alone.
 */
#ifndef PDM_MODEL_GRAMMAR_H
#define PDM_MODEL_GRAMMAR_H

#include <stddef.h>
#include <stdint.h>

#include "tokenizer.h"

#define PDM_GRAMMAR_MAX_WS 12          /* whitespace bytes between two JSON tokens */
#define PDM_GRAMMAR_MAX_ELEMS (1 << 18) /* grammar size bound (elements of all rules) */
#define PDM_GRAMMAR_MAX_DEPTH 32       /* schema nesting the compiler follows */
#define PDM_GRAMMAR_MAX_SCHEMA (1 << 20) /* bytes of schema text */
#define PDM_GRAMMAR_KEY_PREFIX "x-pdmesh-prefix"
#define PDM_GRAMMAR_KEY_SUFFIX "x-pdmesh-suffix"

typedef struct pdm_grammar pdm_grammar_t;
typedef struct pdm_vocab_trie pdm_vocab_trie_t;
typedef struct pdm_gmatch pdm_gmatch_t;

/* Compiles a JSON schema (the text of one JSON value; `{"type":"object"}` is OpenAI's
 * json_object) into a grammar for JSON text that validates against it, with bounded leading
 * and trailing whitespace. On error returns PDM_EINVAL (unsupported keyword, malformed
 * schema, unresolvable $ref) or PDM_ERANGE (too large or too deep) with a message naming the
 * problem (pdm_error_last); nothing is allocated. */
int pdm_grammar_compile(const char *schema, size_t len, pdm_grammar_t **out);
void pdm_grammar_destroy(pdm_grammar_t *g);
/* Number of elements (a size measure for tests and logs). */
size_t pdm_grammar_size(const pdm_grammar_t *g);

/* The vocabulary as a byte trie (token bytes as pdm_tokenizer_token_bytes gives them without
 * special text). Read-only once built: one per model, shared by every matcher and thread.
 * NULL with PDM_ENOMEM. */
pdm_vocab_trie_t *pdm_vocab_trie_create(const pdm_tokenizer_t *t);
void pdm_vocab_trie_destroy(pdm_vocab_trie_t *trie);

/* A matcher: the grammar's state after the tokens accepted so far. It borrows g and trie
 * (they outlive it). NULL with PDM_ENOMEM. */
pdm_gmatch_t *pdm_gmatch_create(const pdm_grammar_t *g, const pdm_vocab_trie_t *trie);
void pdm_gmatch_destroy(pdm_gmatch_t *m);
/* Feeds `len` bytes; 1 if the grammar could take them (the state then advanced), 0 if not
 * (the state is unchanged). */
int pdm_gmatch_accept_bytes(pdm_gmatch_t *m, const char *bytes, size_t len);
/* Feeds a token: an end-of-generation token is accepted only when the text is complete
 * (and leaves the state as it is). 1 accepted, 0 refused (state unchanged). */
int pdm_gmatch_accept_token(pdm_gmatch_t *m, int32_t token);
/* 1 if the text so far is a complete value (end of generation is allowed). */
int pdm_gmatch_is_complete(const pdm_gmatch_t *m);
/* 1 if `token` may come next (its bytes extend the state, or it ends generation and the text
 * is complete). Does not change the state. */
int pdm_gmatch_allows(pdm_gmatch_t *m, int32_t token);
/* The tokens that may come next as a bitset over the vocabulary ([ (n_vocab + 31) / 32 ]
 * words, bit t of word t / 32): valid until the next call on m. Never NULL after create. */
const uint32_t *pdm_gmatch_mask(pdm_gmatch_t *m);
/* Counters since create: masks computed by a trie walk, masks served from the cache. */
void pdm_gmatch_stats(const pdm_gmatch_t *m, uint64_t *walks, uint64_t *hits);

#endif /* PDM_MODEL_GRAMMAR_H */
