/*
 * test_grammar.c - structured output (model/grammar.h): the JSON-Schema compiler accepts and
 * refuses the right texts, refuses unsupported keywords and oversized schemas, and the matcher
 * on SmolLM2's real vocabulary gives token masks equal to testing every token by itself, the
 * same state fed at once or token by token, EOS only when the value is complete, and a
 * mutation fuzz of schemas and token streams.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model/model.h"
#include "tests.h"

#define SMOL "models/SmolLM2-135M-Instruct.Q4_1.gguf"

/* A vocabulary of the 256 single bytes plus a few multi-byte tokens, from a synthetic
 * tokenizer is more work than using the real model; tests that need a vocabulary use SmolLM2
 * and are skipped without it. */
static pdm_tokenizer_t *smol_tokenizer(void)
{
    pdm_gguf_t *g;
    if (access(SMOL, R_OK)) return NULL;
    ck_assert_msg(pdm_gguf_open(SMOL, &g) == 0, "%s", pdm_error_last());
    pdm_tokenizer_t *t = NULL;
    ck_assert_msg(pdm_tokenizer_create(g, &t) == 0, "%s", pdm_error_last());
    pdm_gguf_close(g);
    return t;
}

/* A vocabulary-free matcher: one fake token per byte is not needed, accept_bytes works on
 * text; the trie is still required, so build one from SmolLM2 once per test. */
static int accepts(const pdm_vocab_trie_t *trie, const char *schema, const char *text)
{
    pdm_grammar_t *g;
    ck_assert_msg(pdm_grammar_compile(schema, strlen(schema), &g) == 0, "%s: %s", schema,
                  pdm_error_last());
    pdm_gmatch_t *m = pdm_gmatch_create(g, trie);
    ck_assert_ptr_nonnull(m);
    int ok = pdm_gmatch_accept_bytes(m, text, strlen(text)) && pdm_gmatch_is_complete(m);
    pdm_gmatch_destroy(m);
    pdm_grammar_destroy(g);
    return ok;
}

static const char *const person =
    "{\"$defs\":{\"Pet\":{\"properties\":{\"kind\":{\"enum\":[\"cat\",\"dog\"],\"title\":\"Kind\"},"
    "\"age\":{\"type\":\"integer\"}},\"required\":[\"kind\",\"age\"],\"title\":\"Pet\","
    "\"type\":\"object\",\"additionalProperties\":false}},"
    "\"properties\":{\"name\":{\"type\":\"string\"},\"height\":{\"type\":\"number\"},"
    "\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\"},\"maxItems\":3},"
    "\"pet\":{\"anyOf\":[{\"$ref\":\"#/$defs/Pet\"},{\"type\":\"null\"}]},"
    "\"nick\":{\"type\":[\"string\",\"null\"],\"default\":null},"
    "\"ok\":{\"type\":\"boolean\"}},"
    "\"required\":[\"name\",\"height\",\"tags\",\"pet\",\"ok\"],\"type\":\"object\"}";

START_TEST(test_compile_accepts)
{
    pdm_tokenizer_t *tk = smol_tokenizer();
    if (!tk) return;
    pdm_vocab_trie_t *trie = pdm_vocab_trie_create(tk);
    ck_assert_ptr_nonnull(trie);
    const char *obj = "{\"type\":\"object\"}";
    ck_assert(accepts(trie, obj, "{}"));
    ck_assert(accepts(trie, obj, " {\"a\": [1, 2.5e3, \"x\\n\\u00e9\", true, null, {}]}\n"));
    ck_assert(accepts(trie, obj, "{\"k\":\"caf\xc3\xa9\"}"));
    ck_assert(!accepts(trie, obj, "[]"));
    ck_assert(!accepts(trie, obj, "{\"a\":}"));
    ck_assert(!accepts(trie, obj, "{\"a\":1,}"));
    ck_assert(!accepts(trie, obj, "{\"a\":01}"));
    ck_assert(!accepts(trie, obj, "{\"a\":\"\x01\"}"));
    ck_assert(!accepts(trie, obj, "{"));
    /* bounded whitespace */
    ck_assert(accepts(trie, obj, "{            }"));
    ck_assert(!accepts(trie, obj, "{                                }"));
    ck_assert(accepts(trie, person, "{\"name\":\"Ann\",\"height\":1.7,\"tags\":[],\"pet\":null,"
                                    "\"ok\":true}"));
    ck_assert(accepts(trie, person, "{\n  \"name\": \"Ann\",\n  \"height\": -2,\n  \"tags\": "
                                    "[\"a\", \"b\", \"c\"],\n  \"pet\": {\"kind\": \"dog\", "
                                    "\"age\": 3},\n  \"nick\": \"A\",\n  \"ok\": false\n}"));
    /* order, required, maxItems, enum, integer */
    ck_assert(!accepts(trie, person, "{\"height\":1,\"name\":\"A\",\"tags\":[],\"pet\":null,"
                                     "\"ok\":true}"));
    ck_assert(!accepts(trie, person, "{\"name\":\"A\",\"tags\":[],\"pet\":null,\"ok\":true}"));
    ck_assert(!accepts(trie, person, "{\"name\":\"A\",\"height\":1,\"tags\":[\"1\",\"2\",\"3\","
                                     "\"4\"],\"pet\":null,\"ok\":true}"));
    ck_assert(!accepts(trie, person, "{\"name\":\"A\",\"height\":1,\"tags\":[],\"pet\":{\"kind\":"
                                     "\"cow\",\"age\":1},\"ok\":true}"));
    ck_assert(!accepts(trie, person, "{\"name\":\"A\",\"height\":1,\"tags\":[],\"pet\":{\"kind\":"
                                     "\"cat\",\"age\":1.5},\"ok\":true}"));
    ck_assert(!accepts(trie, person, "{\"name\":\"A\",\"height\":1,\"tags\":[],\"pet\":null,"
                                     "\"ok\":true,\"extra\":1}"));
    /* minItems, const, recursion through $ref */
    ck_assert(accepts(trie, "{\"type\":\"array\",\"items\":{\"const\":1},\"minItems\":2}",
                      "[1, 1, 1]"));
    ck_assert(!accepts(trie, "{\"type\":\"array\",\"items\":{\"const\":1},\"minItems\":2}", "[1]"));
    const char *tree = "{\"$ref\":\"#/$defs/N\",\"$defs\":{\"N\":{\"type\":\"object\","
                       "\"properties\":{\"kids\":{\"type\":\"array\",\"items\":{\"$ref\":"
                       "\"#/$defs/N\"}}},\"required\":[\"kids\"]}}}";
    ck_assert(accepts(trie, tree, "{\"kids\":[{\"kids\":[]},{\"kids\":[{\"kids\":[]}]}]}"));
    ck_assert(!accepts(trie, tree, "{\"kids\":[{}]}"));
    /* the literal prefix/suffix wrapper (tool calls) */
    const char *call = "{\"x-pdmesh-prefix\":\"<tool_call>\\n\",\"x-pdmesh-suffix\":"
                       "\"\\n</tool_call>\",\"type\":\"object\",\"properties\":{\"name\":"
                       "{\"const\":\"f\"}},\"required\":[\"name\"]}";
    ck_assert(accepts(trie, call, "<tool_call>\n{\"name\": \"f\"}\n</tool_call>"));
    ck_assert(!accepts(trie, call, "{\"name\": \"f\"}"));
    ck_assert(!accepts(trie, call, "<tool_call>\n{\"name\": \"f\"}"));
    ck_assert(!accepts(trie, call, "<tool_call>\n{\"name\": \"g\"}\n</tool_call>"));
    /* the schema model/chat.c builds for tool_choice "required" */
    char *forced = pdm_chat_tool_call_schema(
        PDM_CHAT_CHATML, "[{\"type\":\"function\",\"function\":{\"name\":\"get_time\"}},"
        "{\"type\":\"function\",\"function\":{\"name\":\"add\",\"parameters\":{\"type\":"
        "\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}},\"required\":[\"a\"]}}}]",
        NULL);
    ck_assert_msg(forced, "%s", pdm_error_last());
    ck_assert(accepts(trie, forced, "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}"
                                    "\n</tool_call>"));
    ck_assert(accepts(trie, forced, "<tool_call>\n{\"name\": \"add\", \"arguments\": "
                                    "{\"a\": 3}}\n</tool_call>"));
    ck_assert(!accepts(trie, forced, "<tool_call>\n{\"name\": \"add\", \"arguments\": "
                                     "{\"a\": \"3\"}}\n</tool_call>"));
    ck_assert(!accepts(trie, forced, "<tool_call>\n{\"name\": \"sub\", \"arguments\": {}}"
                                     "\n</tool_call>"));
    free(forced);
    pdm_vocab_trie_destroy(trie);
    pdm_tokenizer_destroy(tk);
}
END_TEST

START_TEST(test_compile_refuses)
{
    const char *bad[][2] = {
        {"{\"type\":\"string\",\"pattern\":\"a+\"}", "'pattern'"},
        {"{\"type\":\"integer\",\"minimum\":3}", "'minimum'"},
        {"{\"allOf\":[{\"type\":\"string\"}]}", "'allOf'"},
        {"{\"type\":\"strin\"}", "unknown type"},
        {"{\"$ref\":\"#/$defs/Nope\"}", "does not resolve"},
        {"{\"$ref\":\"http://x/y\"}", "not local"},
        {"{\"type\":", "not JSON"},
        {"[1]", "must be an object"},
        {"{\"type\":\"object\",\"properties\":{\"a\":{}},\"required\":[\"b\"]}", "'b'"},
        {"{\"type\":\"array\",\"minItems\":5000}", "256"},
        {"{\"x-pdmesh-prefix\":1,\"type\":\"object\"}", "must be strings"},
    };
    for (size_t i = 0; i < PDM_ARRAY_SIZE(bad); i++) {
        pdm_grammar_t *g = NULL;
        int st = pdm_grammar_compile(bad[i][0], strlen(bad[i][0]), &g);
        ck_assert_msg(st != 0, "accepted %s", bad[i][0]);
        ck_assert_ptr_null(g);
        ck_assert_msg(strstr(pdm_error_last(), bad[i][1]), "%s: %s", bad[i][0], pdm_error_last());
    }
    /* deep nesting and huge schemas end in a clear error, not a crash */
    size_t cap = 1 << 16, n = 0;
    char *deep = malloc(cap);
    for (int i = 0; i < 500; i++) n += (size_t)snprintf(deep + n, cap - n, "{\"items\":");
    n += (size_t)snprintf(deep + n, cap - n, "{}");
    for (int i = 0; i < 500 && n + 2 < cap; i++) deep[n++] = '}';
    pdm_grammar_t *g = NULL;
    ck_assert_int_ne(pdm_grammar_compile(deep, n, &g), 0);
    ck_assert(strstr(pdm_error_last(), "deeper"));
    free(deep);
    /* a very wide object: over the element bound */
    cap = 1 << 21;
    char *wide = malloc(cap);
    n = (size_t)snprintf(wide, cap, "{\"type\":\"object\",\"properties\":{");
    for (int i = 0; i < 20000; i++)
        n += (size_t)snprintf(wide + n, cap - n, "%s\"p%05d_with_a_long_name_xxxxxxxxxxxx\":"
                              "{\"type\":\"array\",\"maxItems\":8}", i ? "," : "", i);
    n += (size_t)snprintf(wide + n, cap - n, "}}");
    ck_assert_int_ne(pdm_grammar_compile(wide, n, &g), 0);
    free(wide);
}
END_TEST

/* The trie walk's mask equals testing every token on its own, for states along a text. */
START_TEST(test_mask_equals_bruteforce)
{
    pdm_tokenizer_t *tk = smol_tokenizer();
    if (!tk) return;
    pdm_vocab_trie_t *trie = pdm_vocab_trie_create(tk);
    pdm_grammar_t *g;
    ck_assert_int_eq(pdm_grammar_compile(person, strlen(person), &g), 0);
    pdm_gmatch_t *m = pdm_gmatch_create(g, trie);
    const char *text = "{\"name\": \"Zo\xc3\xab\", \"height\": 1.5, \"tags\": [\"x\"], \"pet\": "
                       "{\"kind\": \"cat\", \"age\": 2}, \"ok\": true}";
    const int32_t n_vocab = pdm_tokenizer_n_vocab(tk);
    const int32_t eos = pdm_tokenizer_eos(tk);
    size_t cuts[] = {0, 1, 2, 9, 12, 20, 35, 60, 70, strlen(text)};
    size_t at = 0;
    for (size_t c = 0; c < PDM_ARRAY_SIZE(cuts); c++) {
        ck_assert(pdm_gmatch_accept_bytes(m, text + at, cuts[c] - at));
        at = cuts[c];
        const uint32_t *mask = pdm_gmatch_mask(m);
        int allowed = 0;
        for (int32_t t = 0; t < n_vocab; t++) {
            int bit = mask[t >> 5] >> (t & 31) & 1;
            ck_assert_msg(bit == pdm_gmatch_allows(m, t), "cut %zu token %d", at, t);
            allowed += bit;
        }
        ck_assert_int_gt(allowed, 0);
        ck_assert_int_eq(mask[eos >> 5] >> (eos & 31) & 1, at == strlen(text));
        /* a cached mask is the same */
        ck_assert(pdm_gmatch_mask(m) == mask || !memcmp(pdm_gmatch_mask(m), mask,
                                                        sizeof(uint32_t) * (size_t)(n_vocab + 31) / 32));
    }
    ck_assert(pdm_gmatch_accept_token(m, eos));
    pdm_gmatch_destroy(m);
    pdm_grammar_destroy(g);
    pdm_vocab_trie_destroy(trie);
    pdm_tokenizer_destroy(tk);
}
END_TEST

/* Feeding the tokens of a text one at a time gives the same state (same mask) as feeding its
 * bytes at once: a migrated request's matcher rebuilt from the delivered tokens equals the
 * one that produced them. */
START_TEST(test_incremental_equals_scratch)
{
    pdm_tokenizer_t *tk = smol_tokenizer();
    if (!tk) return;
    pdm_vocab_trie_t *trie = pdm_vocab_trie_create(tk);
    pdm_grammar_t *g;
    ck_assert_int_eq(pdm_grammar_compile(person, strlen(person), &g), 0);
    const char *text = "{\"name\": \"Ann Lee\", \"height\": 170, \"tags\": [\"tall\", \"kind\"], "
                       "\"pet\": null, \"ok\"";
    int32_t ids[256];
    size_t n_ids = 0;
    ck_assert_int_eq(pdm_tokenizer_encode(tk, text, strlen(text), 0, ids, 256, &n_ids), 0);
    const size_t words = ((size_t)pdm_tokenizer_n_vocab(tk) + 31) / 32;
    pdm_gmatch_t *inc = pdm_gmatch_create(g, trie);
    for (size_t i = 0; i < n_ids; i++) {
        ck_assert_msg(pdm_gmatch_mask(inc)[ids[i] >> 5] >> (ids[i] & 31) & 1, "token %zu", i);
        ck_assert(pdm_gmatch_accept_token(inc, ids[i]));
        /* from scratch: the bytes of the tokens so far */
        char buf[1024];
        size_t len = 0;
        for (size_t j = 0; j <= i; j++)
            len += (size_t)pdm_tokenizer_token_bytes(tk, ids[j], 0, buf + len, sizeof(buf) - len);
        pdm_gmatch_t *scratch = pdm_gmatch_create(g, trie);
        ck_assert(pdm_gmatch_accept_bytes(scratch, buf, len));
        ck_assert(!memcmp(pdm_gmatch_mask(inc), pdm_gmatch_mask(scratch), words * 4));
        pdm_gmatch_destroy(scratch);
    }
    /* a refused token leaves the state as it was */
    int32_t bad[4];
    size_t n_bad;
    ck_assert_int_eq(pdm_tokenizer_encode(tk, "]]", 2, 0, bad, 4, &n_bad), 0);
    ck_assert(!pdm_gmatch_accept_token(inc, bad[0]));
    ck_assert(pdm_gmatch_accept_bytes(inc, ": false}", 8));
    ck_assert(pdm_gmatch_is_complete(inc));
    pdm_gmatch_destroy(inc);
    pdm_grammar_destroy(g);
    pdm_vocab_trie_destroy(trie);
    pdm_tokenizer_destroy(tk);
}
END_TEST

/* The sampler under a grammar: greedy picks the best allowed token; the draw never picks a
 * refused one. */
START_TEST(test_sampler_constrained)
{
    pdm_tokenizer_t *tk = smol_tokenizer();
    if (!tk) return;
    pdm_vocab_trie_t *trie = pdm_vocab_trie_create(tk);
    pdm_grammar_t *g;
    const char *schema = "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"boolean\"}},"
                         "\"required\":[\"a\"]}";
    ck_assert_int_eq(pdm_grammar_compile(schema, strlen(schema), &g), 0);
    const int32_t n = pdm_tokenizer_n_vocab(tk);
    float *logits = malloc(sizeof(float) * (size_t)n);
    for (int seed = 0; seed < 3; seed++) {
        for (int temp = 0; temp < 2; temp++) {
            pdm_gmatch_t *m = pdm_gmatch_create(g, trie);
            pdm_sampler_params_t p;
            pdm_sampler_params_default(&p);
            p.temperature = temp ? 1.0f : 0.0f;
            p.seed = (uint64_t)seed + 1;
            pdm_sampler_t *s;
            ck_assert_int_eq(pdm_sampler_create(&p, n, &s), 0);
            pdm_sampler_set_grammar(s, m);
            uint64_t x = (uint64_t)seed * 77 + 5;
            char out[2048];
            size_t len = 0;
            int32_t hist[256];
            int i;
            for (i = 0; i < 256; i++) {
                for (int32_t t = 0; t < n; t++)
                    logits[t] = (float)(pdm_splitmix64(&x) >> 40) / (float)(1 << 24) * 8.0f;
                int32_t tok = pdm_sampler_sample(s, logits, hist, i, NULL);
                ck_assert(pdm_gmatch_accept_token(m, tok));
                hist[i] = tok;
                if (pdm_tokenizer_is_eog(tk, tok)) break;
                len += (size_t)pdm_tokenizer_token_bytes(tk, tok, 0, out + len, sizeof(out) - len);
            }
            out[len] = 0;
            ck_assert_msg(i < 256, "no end: %s", out);
            ck_assert_msg(strstr(out, "\"a\"") && (strstr(out, "true") || strstr(out, "false")),
                          "%s", out);
            pdm_sampler_destroy(s);
            pdm_gmatch_destroy(m);
        }
    }
    free(logits);
    pdm_grammar_destroy(g);
    pdm_vocab_trie_destroy(trie);
    pdm_tokenizer_destroy(tk);
}
END_TEST

/* Mutated schemas (bytes replaced, dropped, inserted) either compile or fail with a message;
 * the matchers of those that compile, driven by random tokens and by tokens drawn from their
 * own masks, never accept a token the mask refused nor refuse one it allowed (run under the
 * asan build to catch memory errors). */
START_TEST(test_mutation_fuzz)
{
    pdm_tokenizer_t *tk = smol_tokenizer();
    if (!tk) return;
    pdm_vocab_trie_t *trie = pdm_vocab_trie_create(tk);
    const int32_t n_vocab = pdm_tokenizer_n_vocab(tk);
    const char *seeds[] = {
        person,
        "{\"$ref\":\"#/$defs/N\",\"$defs\":{\"N\":{\"type\":\"object\",\"properties\":{\"k\":"
        "{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/N\"}}},\"required\":[\"k\"]}}}",
        "{\"type\":\"object\",\"additionalProperties\":{\"type\":\"array\",\"items\":{\"oneOf\":"
        "[{\"type\":\"integer\"},{\"type\":\"boolean\"}]}}}",
        "{\"$ref\":\"#\"}", "{\"anyOf\":[{\"$ref\":\"#\"},{\"type\":\"null\"}]}",
        "{\"items\":{\"$ref\":\"#\"},\"minItems\":2,\"maxItems\":3}"};
    uint64_t x = 12345;
    char buf[4096];
    int compiled = 0;
    for (int it = 0; it < 300; it++) {
        const char *sd = seeds[pdm_splitmix64(&x) % PDM_ARRAY_SIZE(seeds)];
        size_t len = strlen(sd);
        memcpy(buf, sd, len);
        for (int k = (int)(pdm_splitmix64(&x) % 4); k > 0; k--) {
            size_t at = pdm_splitmix64(&x) % len;
            int op = (int)(pdm_splitmix64(&x) % 3);
            if (op == 0) {
                buf[at] = "{}[]\":,0aA$#/-1 "[pdm_splitmix64(&x) % 17];
            } else if (op == 1 && len > 2) {
                memmove(buf + at, buf + at + 1, len - at - 1);
                len--;
            } else if (len + 1 < sizeof(buf)) {
                memmove(buf + at + 1, buf + at, len - at);
                buf[at] = "{}[]\":,x"[pdm_splitmix64(&x) % 8];
                len++;
            }
        }
        pdm_grammar_t *g = NULL;
        if (pdm_grammar_compile(buf, len, &g)) {
            ck_assert(pdm_error_last()[0]);
            continue;
        }
        compiled++;
        pdm_gmatch_t *m = pdm_gmatch_create(g, trie);
        ck_assert_ptr_nonnull(m);
        for (int step = 0; step < 24; step++) {
            const uint32_t *mask = pdm_gmatch_mask(m);
            int32_t tok = (int32_t)(pdm_splitmix64(&x) % (uint64_t)n_vocab);
            if (step % 2) { /* a token the mask allows, if any */
                int32_t seen = 0;
                for (int32_t i = 0; i < n_vocab; i++)
                    if (mask[i >> 5] >> (i & 31) & 1 && pdm_splitmix64(&x) % (uint64_t)++seen == 0)
                        tok = i;
                if (!seen) break;
            }
            const int allowed = mask[tok >> 5] >> (tok & 31) & 1;
            ck_assert_int_eq(pdm_gmatch_accept_token(m, tok), allowed);
        }
        pdm_gmatch_destroy(m);
        pdm_grammar_destroy(g);
    }
    ck_assert_int_gt(compiled, 30);
    pdm_vocab_trie_destroy(trie);
    pdm_tokenizer_destroy(tk);
}
END_TEST

Suite *suite_grammar(void)
{
    Suite *s = suite_create("grammar");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_compile_accepts);
    tcase_add_test(tc, test_compile_refuses);
    tcase_add_test(tc, test_mask_equals_bruteforce);
    tcase_add_test(tc, test_incremental_equals_scratch);
    tcase_add_test(tc, test_sampler_constrained);
    tcase_add_test(tc, test_mutation_fuzz);
    suite_add_tcase(s, tc);
    return s;
}
