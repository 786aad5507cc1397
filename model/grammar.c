/*
 * grammar.c - JSON Schema -> byte grammar, and the incremental matcher (grammar.h).
 *
 * Grammar: rules are lists of alternatives; an alternative is a run of elements in `elems`
 * ended by GE_END; an element is a byte class (a 256-bit set) or a reference to a rule. This is
 * GBNF's model (llama.cpp grammars/README.md) without its text syntax: the compiler builds
 * rules directly.
 *
 * Matcher: the state is a set of stacks (llama.cpp's llama_grammar "stacks"). A stack is a
 * linked list of nodes in an arena; a node is a position in `elems` still to match, its parent
 * the position to return to when its alternative ends; the top of every stack in a set is a
 * byte class (references are expanded eagerly), and the empty stack (-1) means "complete".
 * Advancing by a byte keeps the stacks whose top class holds it, moves them on and expands.
 * Nodes are only ever appended, so the trie walk in pdm_gmatch_mask works like a stack
 * machine: the nodes made below a trie depth are dropped by resetting the arena's top when the
 * walk climbs back (the idea of sharing prefixes is XGrammar's "persistent stack" and
 * Outlines' index over token prefixes; arXiv:2411.15100 §3.3, arXiv:2307.09702).
 */
#include "model.h"

#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>

/* ---- Grammar ------------------------------------------------------------------------------ */

enum { GE_END = 0, GE_CHAR = 1, GE_REF = 2 };

typedef struct {
    uint32_t kind : 2;
    uint32_t arg : 30; /* GE_CHAR: class index; GE_REF: rule id */
} pdm__gelem_t;

typedef struct {
    uint32_t rule, start; /* alternative of `rule` starting at elems[start] */
} pdm__galt_t;

struct pdm_grammar {
    pdm__gelem_t *elems; /* [n_elems] alternatives, each ended by GE_END */
    size_t n_elems, cap_elems;
    uint32_t (*classes)[8]; /* [n_classes] 256-bit byte sets */
    size_t n_classes, cap_classes;
    pdm__galt_t *alts; /* [n_alts] (sorted by rule at the end of compile) */
    size_t n_alts, cap_alts;
    uint32_t n_rules;
    uint32_t *rule_first; /* [n_rules + 1] alternatives of rule r: alts[rule_first[r] ..
                           * rule_first[r + 1]) */
    uint32_t root;
    int failed; /* out of memory or over PDM_GRAMMAR_MAX_ELEMS while building */
};

typedef struct {
    pdm__gelem_t *e;
    size_t n, cap;
    int failed;
} pdm__gseq_t;

static void pdm__seq_put(pdm__gseq_t *s, unsigned kind, uint32_t arg)
{
    if (s->failed) return;
    if (s->n == s->cap) {
        size_t cap = s->cap ? 2 * s->cap : 32;
        pdm__gelem_t *e = cap > PDM_GRAMMAR_MAX_ELEMS ? NULL : realloc(s->e, cap * sizeof(*e));
        if (!e) {
            s->failed = 1;
            return;
        }
        s->e = e;
        s->cap = cap;
    }
    s->e[s->n++] = (pdm__gelem_t){kind, arg};
}

static uint32_t pdm__rule_new(pdm_grammar_t *g)
{
    return g->n_rules++;
}

/* Interns a byte set; returns its index (0 on failure, g->failed set). */
static uint32_t pdm__class(pdm_grammar_t *g, const uint32_t bits[8])
{
    for (size_t i = 0; i < g->n_classes; i++)
        if (!memcmp(g->classes[i], bits, 32)) return (uint32_t)i;
    if (g->n_classes == g->cap_classes) {
        size_t cap = g->cap_classes ? 2 * g->cap_classes : 32;
        void *c = cap > 4096 ? NULL : realloc(g->classes, cap * 32);
        if (!c) {
            g->failed = 1;
            return 0;
        }
        g->classes = c;
        g->cap_classes = cap;
    }
    memcpy(g->classes[g->n_classes], bits, 32);
    return (uint32_t)g->n_classes++;
}

static uint32_t pdm__range(pdm_grammar_t *g, int lo, int hi)
{
    uint32_t bits[8] = {0};
    for (int c = lo; c <= hi; c++) bits[c >> 5] |= 1u << (c & 31);
    return pdm__class(g, bits);
}

/* A class from a list of bytes, e.g. " \t\n\r". */
static uint32_t pdm__chars(pdm_grammar_t *g, const char *list)
{
    uint32_t bits[8] = {0};
    for (const unsigned char *p = (const unsigned char *)list; *p; p++)
        bits[*p >> 5] |= 1u << (*p & 31);
    return pdm__class(g, bits);
}

static void pdm__lit(pdm_grammar_t *g, pdm__gseq_t *s, const char *text, size_t len)
{
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)text[i];
        pdm__seq_put(s, GE_CHAR, pdm__range(g, c, c));
    }
}

/* Adds `rule ::= seq` (seq is emptied and may be reused). */
static void pdm__alt(pdm_grammar_t *g, uint32_t rule, pdm__gseq_t *s)
{
    if (s->failed) g->failed = 1;
    if (g->failed) goto out;
    if (g->n_elems + s->n + 1 > PDM_GRAMMAR_MAX_ELEMS) {
        g->failed = 2;
        goto out;
    }
    if (g->n_elems + s->n + 1 > g->cap_elems) {
        size_t cap = g->cap_elems ? g->cap_elems : 256;
        while (cap < g->n_elems + s->n + 1) cap *= 2;
        pdm__gelem_t *e = realloc(g->elems, cap * sizeof(*e));
        if (!e) {
            g->failed = 1;
            goto out;
        }
        g->elems = e;
        g->cap_elems = cap;
    }
    if (g->n_alts == g->cap_alts) {
        size_t cap = g->cap_alts ? 2 * g->cap_alts : 64;
        pdm__galt_t *a = realloc(g->alts, cap * sizeof(*a));
        if (!a) {
            g->failed = 1;
            goto out;
        }
        g->alts = a;
        g->cap_alts = cap;
    }
    g->alts[g->n_alts++] = (pdm__galt_t){rule, (uint32_t)g->n_elems};
    if (s->n) memcpy(g->elems + g->n_elems, s->e, s->n * sizeof(*s->e));
    g->n_elems += s->n;
    g->elems[g->n_elems++] = (pdm__gelem_t){GE_END, 0};
out:
    s->n = 0;
}

/* ---- Schema compiler ---------------------------------------------------------------------- */

typedef struct {
    pdm_grammar_t *g;
    const cJSON *root;
    struct {
        const cJSON *target;
        uint32_t rule;
    } refs[256];
    int n_refs;
    /* shared rules, made on first use (-1 = not yet) */
    int64_t ws, string, number, integer, value;
} pdm__cc_t;

static int pdm__compile(pdm__cc_t *cc, const cJSON *schema, int depth, uint32_t *rule);

/* ws ::= w_MAX; w_k ::= "" | [ \t\n\r] w_(k-1): at most PDM_GRAMMAR_MAX_WS bytes. */
static uint32_t pdm__ws(pdm__cc_t *cc)
{
    if (cc->ws >= 0) return (uint32_t)cc->ws;
    pdm_grammar_t *g = cc->g;
    pdm__gseq_t s = {0};
    uint32_t prev = pdm__rule_new(g);
    pdm__alt(g, prev, &s); /* w_0 ::= "" */
    for (int k = 1; k <= PDM_GRAMMAR_MAX_WS; k++) {
        uint32_t r = pdm__rule_new(g);
        pdm__alt(g, r, &s);
        pdm__seq_put(&s, GE_CHAR, pdm__chars(g, " \t\n\r"));
        pdm__seq_put(&s, GE_REF, prev);
        pdm__alt(g, r, &s);
        prev = r;
    }
    free(s.e);
    return (uint32_t)(cc->ws = prev);
}

/* d_k ::= "" | [0-9] d_(k-1): up to k more digits. */
static uint32_t pdm__digits(pdm_grammar_t *g, int k)
{
    pdm__gseq_t s = {0};
    uint32_t prev = pdm__rule_new(g);
    pdm__alt(g, prev, &s);
    for (int i = 1; i <= k; i++) {
        uint32_t r = pdm__rule_new(g);
        pdm__alt(g, r, &s);
        pdm__seq_put(&s, GE_CHAR, pdm__range(g, '0', '9'));
        pdm__seq_put(&s, GE_REF, prev);
        pdm__alt(g, r, &s);
        prev = r;
    }
    free(s.e);
    return prev;
}

/* string ::= "\"" chars "\""; chars ::= "" | char chars; char ::= an unescaped byte of JSON
 * (no control byte, no '"' or '\\'), a well-formed UTF-8 lead + continuation bytes, or an
 * escape (RFC 8259 §7). */
static uint32_t pdm__string(pdm__cc_t *cc)
{
    if (cc->string >= 0) return (uint32_t)cc->string;
    pdm_grammar_t *g = cc->g;
    pdm__gseq_t s = {0};
    uint32_t str = pdm__rule_new(g), chars = pdm__rule_new(g), ch = pdm__rule_new(g);
    uint32_t esc = pdm__rule_new(g);
    uint32_t bits[8] = {0};
    for (int c = 0x20; c < 0x80; c++)
        if (c != '"' && c != '\\') bits[c >> 5] |= 1u << (c & 31);
    const uint32_t plain = pdm__class(g, bits), cont = pdm__range(g, 0x80, 0xBF);
    pdm__seq_put(&s, GE_CHAR, plain);
    pdm__alt(g, ch, &s);
    pdm__seq_put(&s, GE_CHAR, pdm__range(g, 0xC2, 0xDF));
    pdm__seq_put(&s, GE_CHAR, cont);
    pdm__alt(g, ch, &s);
    pdm__seq_put(&s, GE_CHAR, pdm__range(g, 0xE0, 0xEF));
    pdm__seq_put(&s, GE_CHAR, cont);
    pdm__seq_put(&s, GE_CHAR, cont);
    pdm__alt(g, ch, &s);
    pdm__seq_put(&s, GE_CHAR, pdm__range(g, 0xF0, 0xF4));
    pdm__seq_put(&s, GE_CHAR, cont);
    pdm__seq_put(&s, GE_CHAR, cont);
    pdm__seq_put(&s, GE_CHAR, cont);
    pdm__alt(g, ch, &s);
    pdm__lit(g, &s, "\\", 1);
    pdm__seq_put(&s, GE_REF, esc);
    pdm__alt(g, ch, &s);
    pdm__seq_put(&s, GE_CHAR, pdm__chars(g, "\"\\/bfnrt"));
    pdm__alt(g, esc, &s);
    const uint32_t hex = pdm__chars(g, "0123456789abcdefABCDEF");
    pdm__lit(g, &s, "u", 1);
    for (int i = 0; i < 4; i++) pdm__seq_put(&s, GE_CHAR, hex);
    pdm__alt(g, esc, &s);
    pdm__alt(g, chars, &s); /* chars ::= "" */
    pdm__seq_put(&s, GE_REF, ch);
    pdm__seq_put(&s, GE_REF, chars);
    pdm__alt(g, chars, &s);
    pdm__lit(g, &s, "\"", 1);
    pdm__seq_put(&s, GE_REF, chars);
    pdm__lit(g, &s, "\"", 1);
    pdm__alt(g, str, &s);
    free(s.e);
    return (uint32_t)(cc->string = str);
}

/* integer ::= "-"? ("0" | [1-9] d_15); number ::= integer ("." [0-9] d_15)? ([eE] [+-]? [0-9]
 * d_2)?: bounded digit runs, so a number always ends. */
static uint32_t pdm__number(pdm__cc_t *cc, int integer_only)
{
    if (integer_only && cc->integer >= 0) return (uint32_t)cc->integer;
    if (!integer_only && cc->number >= 0) return (uint32_t)cc->number;
    pdm_grammar_t *g = cc->g;
    pdm__gseq_t s = {0};
    uint32_t d15 = pdm__digits(g, 15), d2 = pdm__digits(g, 2);
    uint32_t sign = pdm__rule_new(g), intpart = pdm__rule_new(g), num = pdm__rule_new(g);
    pdm__alt(g, sign, &s);
    pdm__lit(g, &s, "-", 1);
    pdm__alt(g, sign, &s);
    pdm__lit(g, &s, "0", 1);
    pdm__alt(g, intpart, &s);
    pdm__seq_put(&s, GE_CHAR, pdm__range(g, '1', '9'));
    pdm__seq_put(&s, GE_REF, d15);
    pdm__alt(g, intpart, &s);
    pdm__seq_put(&s, GE_REF, sign);
    pdm__seq_put(&s, GE_REF, intpart);
    if (!integer_only) {
        uint32_t frac = pdm__rule_new(g), ex = pdm__rule_new(g), exsign = pdm__rule_new(g);
        pdm__gseq_t t = {0};
        pdm__alt(g, frac, &t);
        pdm__lit(g, &t, ".", 1);
        pdm__seq_put(&t, GE_CHAR, pdm__range(g, '0', '9'));
        pdm__seq_put(&t, GE_REF, d15);
        pdm__alt(g, frac, &t);
        pdm__alt(g, exsign, &t);
        pdm__seq_put(&t, GE_CHAR, pdm__chars(g, "+-"));
        pdm__alt(g, exsign, &t);
        pdm__alt(g, ex, &t);
        pdm__seq_put(&t, GE_CHAR, pdm__chars(g, "eE"));
        pdm__seq_put(&t, GE_REF, exsign);
        pdm__seq_put(&t, GE_CHAR, pdm__range(g, '0', '9'));
        pdm__seq_put(&t, GE_REF, d2);
        pdm__alt(g, ex, &t);
        free(t.e);
        pdm__seq_put(&s, GE_REF, frac);
        pdm__seq_put(&s, GE_REF, ex);
    }
    pdm__alt(g, num, &s);
    free(s.e);
    if (integer_only) cc->integer = num;
    else cc->number = num;
    return num;
}

/* A dictionary / any object: "{" ws ("}" | member more); more ::= ws ("}" | "," ws member
 * more); member ::= string ws ":" ws value ws... written so that each byte has one reading. */
static uint32_t pdm__object_of(pdm__cc_t *cc, uint32_t value)
{
    pdm_grammar_t *g = cc->g;
    pdm__gseq_t s = {0};
    const uint32_t ws = pdm__ws(cc), str = pdm__string(cc);
    uint32_t obj = pdm__rule_new(g), tail = pdm__rule_new(g), more = pdm__rule_new(g);
    uint32_t more2 = pdm__rule_new(g), member = pdm__rule_new(g);
    pdm__seq_put(&s, GE_REF, str);
    pdm__seq_put(&s, GE_REF, ws);
    pdm__lit(g, &s, ":", 1);
    pdm__seq_put(&s, GE_REF, ws);
    pdm__seq_put(&s, GE_REF, value);
    pdm__alt(g, member, &s);
    pdm__lit(g, &s, "}", 1);
    pdm__alt(g, tail, &s);
    pdm__seq_put(&s, GE_REF, member);
    pdm__seq_put(&s, GE_REF, more);
    pdm__alt(g, tail, &s);
    pdm__seq_put(&s, GE_REF, ws);
    pdm__seq_put(&s, GE_REF, more2);
    pdm__alt(g, more, &s);
    pdm__lit(g, &s, "}", 1);
    pdm__alt(g, more2, &s);
    pdm__lit(g, &s, ",", 1);
    pdm__seq_put(&s, GE_REF, ws);
    pdm__seq_put(&s, GE_REF, member);
    pdm__seq_put(&s, GE_REF, more);
    pdm__alt(g, more2, &s);
    pdm__lit(g, &s, "{", 1);
    pdm__seq_put(&s, GE_REF, ws);
    pdm__seq_put(&s, GE_REF, tail);
    pdm__alt(g, obj, &s);
    free(s.e);
    return obj;
}

/* Arrays of `item` with min..max elements (max < 0: unbounded): "[" ws R_0, where R_k (k items
 * so far) ::= "]" (if k >= min) | sep_k item ws R_(k+1) (if k < max); sep_0 = "", sep_k =
 * "," ws. Past max(min, 1) with no maximum, one looping rule. */
static int pdm__array_of(pdm__cc_t *cc, uint32_t item, long min, long max, uint32_t *out)
{
    pdm_grammar_t *g = cc->g;
    const long unroll = max >= 0 ? max : (min > 1 ? min : 1);
    if (unroll > 256)
        return pdm_error_set(PDM_ERANGE, "response_format: minItems/maxItems above 256 are "
                             "not supported");
    pdm__gseq_t s = {0};
    const uint32_t ws = pdm__ws(cc);
    uint32_t first = g->n_rules;
    for (long k = 0; k <= unroll; k++) pdm__rule_new(g);
    for (long k = 0; k <= unroll; k++) {
        uint32_t r = first + (uint32_t)k;
        if (k >= min) {
            pdm__lit(g, &s, "]", 1);
            pdm__alt(g, r, &s);
        }
        if (max >= 0 && k >= max) continue;
        if (k > 0) {
            pdm__lit(g, &s, ",", 1);
            pdm__seq_put(&s, GE_REF, ws);
        }
        pdm__seq_put(&s, GE_REF, item);
        pdm__seq_put(&s, GE_REF, ws);
        /* no maximum: the last rule loops on itself */
        pdm__seq_put(&s, GE_REF, k < unroll ? r + 1 : r);
        pdm__alt(g, r, &s);
    }
    uint32_t arr = pdm__rule_new(g);
    pdm__lit(g, &s, "[", 1);
    pdm__seq_put(&s, GE_REF, ws);
    pdm__seq_put(&s, GE_REF, first);
    pdm__alt(g, arr, &s);
    free(s.e);
    *out = arr;
    return PDM_OK;
}

/* value ::= object | array | string | number | true | false | null (any JSON). */
static uint32_t pdm__any(pdm__cc_t *cc)
{
    if (cc->value >= 0) return (uint32_t)cc->value;
    pdm_grammar_t *g = cc->g;
    uint32_t value = pdm__rule_new(g);
    cc->value = value;
    pdm__gseq_t s = {0};
    uint32_t arr = 0;
    pdm__array_of(cc, value, 0, -1, &arr);
    const uint32_t alts[] = {pdm__object_of(cc, value), arr, pdm__string(cc),
                             pdm__number(cc, 0)};
    for (size_t i = 0; i < PDM_ARRAY_SIZE(alts); i++) {
        pdm__seq_put(&s, GE_REF, alts[i]);
        pdm__alt(g, value, &s);
    }
    const char *words[] = {"true", "false", "null"};
    for (size_t i = 0; i < 3; i++) {
        pdm__lit(g, &s, words[i], strlen(words[i]));
        pdm__alt(g, value, &s);
    }
    free(s.e);
    return value;
}

/* A rule matching exactly the JSON text of `v` (enum and const). */
static int pdm__literal(pdm__cc_t *cc, const cJSON *v, uint32_t rule)
{
    char *text = cJSON_PrintUnformatted(v);
    if (!text) return pdm_error_set(PDM_ENOMEM, "out of memory");
    pdm__gseq_t s = {0};
    pdm__lit(cc->g, &s, text, strlen(text));
    pdm__alt(cc->g, rule, &s);
    free(text);
    free(s.e);
    return PDM_OK;
}

static const char *const pdm__known_keywords[] = {
    "type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems",
    "enum", "const", "anyOf", "oneOf", "$ref", "$defs", "definitions", "title", "description",
    "default", "examples", "$schema", "$id", "$comment", PDM_GRAMMAR_KEY_PREFIX,
    PDM_GRAMMAR_KEY_SUFFIX};

static int pdm__check_keywords(const cJSON *schema)
{
    for (const cJSON *k = schema->child; k; k = k->next) {
        size_t i = 0;
        while (i < PDM_ARRAY_SIZE(pdm__known_keywords) && strcmp(k->string, pdm__known_keywords[i]))
            i++;
        if (i == PDM_ARRAY_SIZE(pdm__known_keywords))
            return pdm_error_set(PDM_EINVAL, "response_format: the JSON schema keyword '%s' is "
                                 "not supported", k->string);
    }
    return PDM_OK;
}

/* "#/$defs/Name" (JSON pointer, RFC 6901, within the schema itself). */
static int pdm__resolve(pdm__cc_t *cc, const char *ref, const cJSON **out)
{
    if (ref[0] != '#') return pdm_error_set(PDM_EINVAL, "response_format: $ref '%.80s' is not "
                                            "local (only \"#/...\" is supported)", ref);
    const cJSON *at = cc->root;
    const char *p = ref + 1;
    while (*p == '/') {
        char seg[256];
        size_t n = 0;
        p++;
        for (; *p && *p != '/'; p++) {
            char c = *p;
            if (c == '~' && (p[1] == '0' || p[1] == '1')) c = *++p == '0' ? '~' : '/';
            if (n + 1 >= sizeof(seg)) break;
            seg[n++] = c;
        }
        seg[n] = 0;
        at = cJSON_IsObject(at) ? cJSON_GetObjectItemCaseSensitive(at, seg) : NULL;
        if (!at) break;
    }
    if (!at || *p) return pdm_error_set(PDM_EINVAL, "response_format: $ref '%.80s' does not "
                                        "resolve", ref);
    *out = at;
    return PDM_OK;
}

static int pdm__object(pdm__cc_t *cc, const cJSON *schema, int depth, uint32_t *out)
{
    pdm_grammar_t *g = cc->g;
    const cJSON *props = cJSON_GetObjectItemCaseSensitive(schema, "properties");
    const cJSON *req = cJSON_GetObjectItemCaseSensitive(schema, "required");
    const cJSON *addl = cJSON_GetObjectItemCaseSensitive(schema, "additionalProperties");
    if (props && !cJSON_IsObject(props))
        return pdm_error_set(PDM_EINVAL, "response_format: 'properties' must be an object");
    if (req && !cJSON_IsArray(req))
        return pdm_error_set(PDM_EINVAL, "response_format: 'required' must be an array");
    if (addl && !cJSON_IsBool(addl) && !cJSON_IsObject(addl))
        return pdm_error_set(PDM_EINVAL, "response_format: 'additionalProperties' must be a "
                             "boolean or a schema");
    int st;
    if (!props || !props->child) {
        /* no properties: any object, or a dictionary of additionalProperties' schema */
        uint32_t value;
        if (addl && cJSON_IsObject(addl)) {
            if ((st = pdm__compile(cc, addl, depth + 1, &value))) return st;
        } else if (addl && cJSON_IsFalse(addl)) {
            pdm__gseq_t s = {0};
            *out = pdm__rule_new(g);
            pdm__lit(g, &s, "{", 1);
            pdm__seq_put(&s, GE_REF, pdm__ws(cc));
            pdm__lit(g, &s, "}", 1);
            pdm__alt(g, *out, &s);
            free(s.e);
            return PDM_OK;
        } else {
            value = pdm__any(cc);
        }
        *out = pdm__object_of(cc, value);
        return PDM_OK;
    }
    for (const cJSON *r = req ? req->child : NULL; r; r = r->next) {
        if (!cJSON_IsString(r))
            return pdm_error_set(PDM_EINVAL, "response_format: 'required' must list strings");
        if (!cJSON_GetObjectItemCaseSensitive(props, r->valuestring))
            return pdm_error_set(PDM_EINVAL, "response_format: required property '%.80s' is not "
                                 "in 'properties'", r->valuestring);
    }
    /* Properties in order; A_i: none written yet, B_i: some written (a comma first).
     * required i: A_i ::= kv_i B_(i+1); B_i ::= "," ws kv_i B_(i+1)
     * optional i: both also ::= A_(i+1) / B_(i+1) (left out). A_n = B_n = "". */
    int n = cJSON_GetArraySize(props);
    uint32_t first = g->n_rules;
    for (int i = 0; i <= n; i++) {
        pdm__rule_new(g);
        pdm__rule_new(g);
    }
    const uint32_t ws = pdm__ws(cc);
    pdm__gseq_t s = {0};
    pdm__alt(g, first + 2 * (uint32_t)n, &s);
    pdm__alt(g, first + 2 * (uint32_t)n + 1, &s);
    int i = 0;
    for (const cJSON *p = props->child; p; p = p->next, i++) {
        uint32_t value;
        if ((st = pdm__compile(cc, p, depth + 1, &value))) {
            free(s.e);
            return st;
        }
        int required = 0;
        for (const cJSON *r = req ? req->child : NULL; r; r = r->next)
            required |= !strcmp(r->valuestring, p->string);
        cJSON *name = cJSON_CreateString(p->string);
        char *quoted = name ? cJSON_PrintUnformatted(name) : NULL;
        cJSON_Delete(name);
        if (!quoted) {
            free(s.e);
            return pdm_error_set(PDM_ENOMEM, "out of memory");
        }
        const uint32_t a = first + 2 * (uint32_t)i, b = a + 1;
        for (int comma = 0; comma < 2; comma++) {
            if (comma) {
                pdm__lit(g, &s, ",", 1);
                pdm__seq_put(&s, GE_REF, ws);
            }
            pdm__lit(g, &s, quoted, strlen(quoted));
            pdm__seq_put(&s, GE_REF, ws);
            pdm__lit(g, &s, ":", 1);
            pdm__seq_put(&s, GE_REF, ws);
            pdm__seq_put(&s, GE_REF, value);
            pdm__seq_put(&s, GE_REF, ws);
            pdm__seq_put(&s, GE_REF, b + 2);
            pdm__alt(g, comma ? b : a, &s);
            if (!required) {
                pdm__seq_put(&s, GE_REF, (comma ? b : a) + 2);
                pdm__alt(g, comma ? b : a, &s);
            }
        }
        free(quoted);
    }
    *out = pdm__rule_new(g);
    pdm__lit(g, &s, "{", 1);
    pdm__seq_put(&s, GE_REF, ws);
    pdm__seq_put(&s, GE_REF, first);
    pdm__lit(g, &s, "}", 1);
    pdm__alt(g, *out, &s);
    free(s.e);
    return PDM_OK;
}

static int pdm__typed(pdm__cc_t *cc, const cJSON *schema, const char *type, int depth,
                      uint32_t *out)
{
    pdm_grammar_t *g = cc->g;
    if (!strcmp(type, "object")) return pdm__object(cc, schema, depth, out);
    if (!strcmp(type, "array")) {
        const cJSON *items = cJSON_GetObjectItemCaseSensitive(schema, "items");
        const cJSON *mn = cJSON_GetObjectItemCaseSensitive(schema, "minItems");
        const cJSON *mx = cJSON_GetObjectItemCaseSensitive(schema, "maxItems");
        long min = 0, max = -1;
        if ((mn && (!cJSON_IsNumber(mn) || mn->valuedouble < 0)) ||
            (mx && (!cJSON_IsNumber(mx) || mx->valuedouble < 0)))
            return pdm_error_set(PDM_EINVAL, "response_format: minItems/maxItems must be "
                                 "non-negative integers");
        if (mn) min = mn->valuedouble > 1e6 ? 1000000 : (long)mn->valuedouble;
        if (mx) max = mx->valuedouble > 1e6 ? 1000000 : (long)mx->valuedouble;
        if (max >= 0 && max < min)
            return pdm_error_set(PDM_EINVAL, "response_format: maxItems is below minItems");
        uint32_t item;
        int st = items ? pdm__compile(cc, items, depth + 1, &item) : PDM_OK;
        if (st) return st;
        if (!items) item = pdm__any(cc);
        return pdm__array_of(cc, item, min, max, out);
    }
    if (!strcmp(type, "string")) *out = pdm__string(cc);
    else if (!strcmp(type, "number")) *out = pdm__number(cc, 0);
    else if (!strcmp(type, "integer")) *out = pdm__number(cc, 1);
    else if (!strcmp(type, "boolean") || !strcmp(type, "null")) {
        pdm__gseq_t s = {0};
        *out = pdm__rule_new(g);
        if (!strcmp(type, "null")) {
            pdm__lit(g, &s, "null", 4);
            pdm__alt(g, *out, &s);
        } else {
            pdm__lit(g, &s, "true", 4);
            pdm__alt(g, *out, &s);
            pdm__lit(g, &s, "false", 5);
            pdm__alt(g, *out, &s);
        }
        free(s.e);
    } else {
        return pdm_error_set(PDM_EINVAL, "response_format: unknown type '%.40s'", type);
    }
    return PDM_OK;
}

/* Compiles `schema` into a rule (*rule). Errors are set (pdm_error_last) and returned. */
static int pdm__compile(pdm__cc_t *cc, const cJSON *schema, int depth, uint32_t *rule)
{
    pdm_grammar_t *g = cc->g;
    int st;
    if (depth > PDM_GRAMMAR_MAX_DEPTH)
        return pdm_error_set(PDM_ERANGE, "response_format: the schema nests deeper than %d",
                             PDM_GRAMMAR_MAX_DEPTH);
    if (g->failed)
        return pdm_error_set(g->failed == 2 ? PDM_ERANGE : PDM_ENOMEM,
                             "response_format: the schema's grammar is too large");
    if (cJSON_IsTrue(schema)) {
        *rule = pdm__any(cc);
        return PDM_OK;
    }
    if (!cJSON_IsObject(schema))
        return pdm_error_set(PDM_EINVAL, "response_format: a schema must be an object");
    if ((st = pdm__check_keywords(schema))) return st;
    const cJSON *ref = cJSON_GetObjectItemCaseSensitive(schema, "$ref");
    if (ref) {
        const cJSON *target = NULL;
        if (!cJSON_IsString(ref))
            return pdm_error_set(PDM_EINVAL, "response_format: '$ref' must be a string");
        if ((st = pdm__resolve(cc, ref->valuestring, &target))) return st;
        for (int i = 0; i < cc->n_refs; i++)
            if (cc->refs[i].target == target) {
                *rule = cc->refs[i].rule;
                return PDM_OK;
            }
        if (cc->n_refs == (int)PDM_ARRAY_SIZE(cc->refs))
            return pdm_error_set(PDM_ERANGE, "response_format: more than %d $ref targets",
                                 (int)PDM_ARRAY_SIZE(cc->refs));
        /* the rule exists before its body, so a recursive $ref finds it */
        uint32_t r = pdm__rule_new(g), body;
        cc->refs[cc->n_refs].target = target;
        cc->refs[cc->n_refs++].rule = r;
        if ((st = pdm__compile(cc, target, depth + 1, &body))) return st;
        pdm__gseq_t s = {0};
        pdm__seq_put(&s, GE_REF, body);
        pdm__alt(g, r, &s);
        free(s.e);
        *rule = r;
        return PDM_OK;
    }
    const cJSON *cst = cJSON_GetObjectItemCaseSensitive(schema, "const");
    const cJSON *en = cJSON_GetObjectItemCaseSensitive(schema, "enum");
    if (cst || en) {
        *rule = pdm__rule_new(g);
        if (cst) return pdm__literal(cc, cst, *rule);
        if (!cJSON_IsArray(en) || !en->child)
            return pdm_error_set(PDM_EINVAL, "response_format: 'enum' must be a non-empty array");
        for (const cJSON *v = en->child; v; v = v->next)
            if ((st = pdm__literal(cc, v, *rule))) return st;
        return PDM_OK;
    }
    const cJSON *any = cJSON_GetObjectItemCaseSensitive(schema, "anyOf");
    if (!any) any = cJSON_GetObjectItemCaseSensitive(schema, "oneOf");
    if (any) {
        if (!cJSON_IsArray(any) || !any->child)
            return pdm_error_set(PDM_EINVAL, "response_format: 'anyOf' must be a non-empty array");
        uint32_t r = pdm__rule_new(g);
        pdm__gseq_t s = {0};
        for (const cJSON *v = any->child; v; v = v->next) {
            uint32_t sub;
            if ((st = pdm__compile(cc, v, depth + 1, &sub))) {
                free(s.e);
                return st;
            }
            pdm__seq_put(&s, GE_REF, sub);
            pdm__alt(g, r, &s);
        }
        free(s.e);
        *rule = r;
        return PDM_OK;
    }
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(schema, "type");
    if (!type) {
        if (cJSON_GetObjectItemCaseSensitive(schema, "properties"))
            return pdm__typed(cc, schema, "object", depth, rule);
        if (cJSON_GetObjectItemCaseSensitive(schema, "items"))
            return pdm__typed(cc, schema, "array", depth, rule);
        *rule = pdm__any(cc);
        return PDM_OK;
    }
    if (cJSON_IsString(type)) return pdm__typed(cc, schema, type->valuestring, depth, rule);
    if (!cJSON_IsArray(type) || !type->child)
        return pdm_error_set(PDM_EINVAL, "response_format: 'type' must be a string or a "
                             "non-empty array of strings");
    uint32_t r = pdm__rule_new(g);
    pdm__gseq_t s = {0};
    for (const cJSON *t = type->child; t; t = t->next) {
        uint32_t sub;
        if (!cJSON_IsString(t))
            st = pdm_error_set(PDM_EINVAL, "response_format: 'type' must list strings");
        else
            st = pdm__typed(cc, schema, t->valuestring, depth, &sub);
        if (st) {
            free(s.e);
            return st;
        }
        pdm__seq_put(&s, GE_REF, sub);
        pdm__alt(g, r, &s);
    }
    free(s.e);
    *rule = r;
    return PDM_OK;
}

static int pdm__alt_cmp(const void *a, const void *b)
{
    const pdm__galt_t *x = a, *y = b;
    if (x->rule != y->rule) return x->rule < y->rule ? -1 : 1;
    return (x->start > y->start) - (x->start < y->start);
}

void pdm_grammar_destroy(pdm_grammar_t *g)
{
    if (!g) return;
    free(g->elems);
    free(g->classes);
    free(g->alts);
    free(g->rule_first);
    free(g);
}

size_t pdm_grammar_size(const pdm_grammar_t *g)
{
    return g->n_elems;
}

int pdm_grammar_compile(const char *schema, size_t len, pdm_grammar_t **out)
{
    if (!schema || len == 0)
        return pdm_error_set(PDM_EINVAL, "response_format: the JSON schema is empty");
    if (len > PDM_GRAMMAR_MAX_SCHEMA)
        return pdm_error_set(PDM_ERANGE, "response_format: the JSON schema has %zu bytes (at "
                             "most %d)", len, PDM_GRAMMAR_MAX_SCHEMA);
    cJSON *root = cJSON_ParseWithLength(schema, len);
    if (!root) return pdm_error_set(PDM_EINVAL, "response_format: the JSON schema is not JSON");
    pdm_grammar_t *g = calloc(1, sizeof(*g));
    pdm__cc_t *cc = calloc(1, sizeof(*cc));
    int st = PDM_OK;
    if (!g || !cc) {
        st = pdm_error_set(PDM_ENOMEM, "out of memory");
        goto done;
    }
    cc->g = g;
    cc->root = root;
    cc->ws = cc->string = cc->number = cc->integer = cc->value = -1;
    pdm__range(g, 0, 0); /* class 0 exists */
    uint32_t value;
    const uint32_t top = pdm__rule_new(g);
    /* pdmesh's wrapper (grammar.h): literal text around the value, e.g. a tool-call syntax */
    const cJSON *prefix = NULL, *suffix = NULL;
    if (cJSON_IsObject(root)) {
        prefix = cJSON_GetObjectItemCaseSensitive(root, PDM_GRAMMAR_KEY_PREFIX);
        suffix = cJSON_GetObjectItemCaseSensitive(root, PDM_GRAMMAR_KEY_SUFFIX);
        if ((prefix && !cJSON_IsString(prefix)) || (suffix && !cJSON_IsString(suffix))) {
            st = pdm_error_set(PDM_EINVAL, "response_format: '%s' and '%s' must be strings",
                               PDM_GRAMMAR_KEY_PREFIX, PDM_GRAMMAR_KEY_SUFFIX);
            goto done;
        }
    }
    if ((st = pdm__compile(cc, root, 0, &value))) goto done;
    pdm__gseq_t s = {0};
    if (prefix) pdm__lit(g, &s, prefix->valuestring, strlen(prefix->valuestring));
    pdm__seq_put(&s, GE_REF, pdm__ws(cc));
    pdm__seq_put(&s, GE_REF, value);
    pdm__seq_put(&s, GE_REF, pdm__ws(cc));
    if (suffix) pdm__lit(g, &s, suffix->valuestring, strlen(suffix->valuestring));
    pdm__alt(g, top, &s);
    free(s.e);
    if (g->failed) {
        st = pdm_error_set(g->failed == 2 ? PDM_ERANGE : PDM_ENOMEM,
                           "response_format: the schema's grammar is too large (over %d "
                           "elements)", PDM_GRAMMAR_MAX_ELEMS);
        goto done;
    }
    qsort(g->alts, g->n_alts, sizeof(*g->alts), pdm__alt_cmp);
    if (!(g->rule_first = calloc((size_t)g->n_rules + 1, sizeof(uint32_t)))) {
        st = pdm_error_set(PDM_ENOMEM, "out of memory");
        goto done;
    }
    for (size_t i = 0; i < g->n_alts; i++) g->rule_first[g->alts[i].rule + 1]++;
    for (uint32_t r = 0; r < g->n_rules; r++) {
        if (!g->rule_first[r + 1]) {
            st = pdm_error_set(PDM_EINVAL, "response_format: internal: rule %u is empty", r);
            goto done;
        }
        g->rule_first[r + 1] += g->rule_first[r];
    }
    g->root = top;
done:
    cJSON_Delete(root);
    free(cc);
    if (st) {
        pdm_grammar_destroy(g);
        return st;
    }
    *out = g;
    return PDM_OK;
}

/* ---- Vocabulary trie ---------------------------------------------------------------------- */

#define PDM__TRIE_MAX_DEPTH 128 /* longer tokens are never allowed under a grammar */

/* One trie node; the walk reads nodes in order, so they are packed together. */
typedef struct {
    uint32_t skip;     /* size of the node's subtree (itself included) */
    int32_t tok_first; /* first token ending here, or -1 */
    uint8_t byte;
    uint8_t depth;     /* 1.. */
} pdm__tnode_t;

struct pdm_vocab_trie {
    int32_t n_vocab;
    uint32_t n_nodes;
    pdm__tnode_t *node; /* [n_nodes] depth-first order */
    int32_t *tok_next;  /* [n_vocab] next token with the same bytes, or -1 */
    uint32_t *tok_off;  /* [n_vocab + 1] token t's bytes: bytes[tok_off[t] .. tok_off[t + 1]) */
    char *bytes;
    uint8_t *eog;       /* [n_vocab] ends generation */
};

/* Token order by bytes (then id), for qsort_r (glibc; the build defines _GNU_SOURCE). */
static int pdm__tok_cmp(const void *a, const void *b, void *arg)
{
    const pdm_vocab_trie_t *t = arg;
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    uint32_t lx = t->tok_off[x + 1] - t->tok_off[x], ly = t->tok_off[y + 1] - t->tok_off[y];
    int c = memcmp(t->bytes + t->tok_off[x], t->bytes + t->tok_off[y], lx < ly ? lx : ly);
    if (c) return c;
    if (lx != ly) return lx < ly ? -1 : 1;
    return (x > y) - (x < y);
}

void pdm_vocab_trie_destroy(pdm_vocab_trie_t *t)
{
    if (!t) return;
    free(t->node);
    free(t->tok_next);
    free(t->tok_off);
    free(t->bytes);
    free(t->eog);
    free(t);
}

pdm_vocab_trie_t *pdm_vocab_trie_create(const pdm_tokenizer_t *tk)
{
    const int32_t n = tk ? pdm_tokenizer_n_vocab(tk) : 0;
    pdm_vocab_trie_t *t = calloc(1, sizeof(*t));
    int32_t *order = NULL;
    size_t cap = (size_t)n * 8 + 64, used = 0;
    if (!t || n <= 0) goto err;
    t->n_vocab = n;
    t->tok_off = malloc(sizeof(uint32_t) * ((size_t)n + 1));
    t->bytes = malloc(cap);
    t->eog = calloc((size_t)n, 1);
    t->tok_next = malloc(sizeof(int32_t) * (size_t)n);
    order = malloc(sizeof(int32_t) * (size_t)n);
    if (!t->tok_off || !t->bytes || !t->eog || !t->tok_next || !order) goto err;
    for (int32_t i = 0; i < n; i++) {
        char buf[PDM__TRIE_MAX_DEPTH + 1];
        int len = pdm_tokenizer_token_bytes(tk, i, 0, buf, sizeof(buf));
        if (len < 0 || len > PDM__TRIE_MAX_DEPTH) len = 0; /* never allowed by bytes */
        if (used + (size_t)len > cap) {
            char *b = realloc(t->bytes, cap *= 2);
            if (!b) goto err;
            t->bytes = b;
        }
        t->tok_off[i] = (uint32_t)used;
        memcpy(t->bytes + used, buf, (size_t)len);
        used += (size_t)len;
        t->eog[i] = (uint8_t)pdm_tokenizer_is_eog(tk, i);
        t->tok_next[i] = -1;
        order[i] = i;
    }
    t->tok_off[n] = (uint32_t)used;
    qsort_r(order, (size_t)n, sizeof(int32_t), pdm__tok_cmp, t);
    /* at most one node per byte */
    if (!(t->node = malloc(sizeof(*t->node) * (used + 1)))) goto err;
    uint32_t path[PDM__TRIE_MAX_DEPTH + 1]; /* path[d - 1]: node at depth d */
    int path_len = 0;
    const char *prev = NULL;
    uint32_t prev_len = 0;
    for (int32_t k = 0; k < n; k++) {
        int32_t id = order[k];
        const char *b = t->bytes + t->tok_off[id];
        uint32_t len = t->tok_off[id + 1] - t->tok_off[id];
        if (!len) continue;
        uint32_t common = 0;
        while (prev && common < len && common < prev_len && b[common] == prev[common]) common++;
        while ((uint32_t)path_len > common) { /* close nodes that this token leaves */
            uint32_t node = path[--path_len];
            t->node[node].skip = t->n_nodes - node;
        }
        for (uint32_t d = common; d < len; d++) {
            uint32_t node = t->n_nodes++;
            t->node[node].byte = (uint8_t)b[d];
            t->node[node].depth = (uint8_t)(d + 1);
            t->node[node].tok_first = -1;
            path[path_len++] = node;
        }
        uint32_t end = path[len - 1];
        /* equal bytes: chain behind the first */
        if (t->node[end].tok_first < 0) {
            t->node[end].tok_first = id;
        } else {
            int32_t j = t->node[end].tok_first;
            while (t->tok_next[j] >= 0) j = t->tok_next[j];
            t->tok_next[j] = id;
        }
        prev = b;
        prev_len = len;
    }
    while (path_len > 0) {
        uint32_t node = path[--path_len];
        t->node[node].skip = t->n_nodes - node;
    }
    free(order);
    return t;
err:
    free(order);
    pdm_vocab_trie_destroy(t);
    pdm_error_set(PDM_ENOMEM, "out of memory");
    return NULL;
}

/* ---- Matcher ------------------------------------------------------------------------------ */

#define PDM__MAX_STACKS 64      /* stacks in one state; more readings are dropped */
#define PDM__MAX_STACK_DEPTH 400 /* nested rules on one stack (deep JSON nesting) */
#define PDM__MAX_NODES (1 << 22)
#define PDM__CACHE 16
#define PDM__MAX_ISETS 2048
#define PDM__ITABLE 4096 /* power of two, > 1.5 * PDM__MAX_ISETS */

typedef struct {
    uint32_t pos;   /* element to match (a GE_CHAR, or a GE_REF while parked as a parent) */
    int32_t parent; /* node to continue with when pos's alternative ends; -1: the end */
    uint32_t depth;
    uint64_t hash;  /* of the positions from this node down to the bottom of its stack */
} pdm__gnode_t;

typedef struct {
    int32_t id[PDM__MAX_STACKS]; /* node ids of the stacks' tops; -1: complete */
    int n;
} pdm__gset_t;

struct pdm_gmatch {
    const pdm_grammar_t *g;
    const pdm_vocab_trie_t *trie;
    pdm__gnode_t *nodes; /* [n_nodes] arena; [0, n_nodes) at rest holds the current state */
    size_t n_nodes, cap_nodes;
    int overflow;
    pdm__gset_t cur;
    pdm__gset_t *levels; /* [PDM__TRIE_MAX_DEPTH + 1] the trie walk's sets by depth */
    size_t *marks;       /* [PDM__TRIE_MAX_DEPTH + 1] arena top after each level */
    uint32_t *mask;      /* [words] */
    size_t words;
    struct {
        uint64_t key;
        uint32_t *mask; /* [words] */
    } cache[PDM__CACHE];
    int n_cache, cache_next;
    uint64_t walks, hits;
    /* the walk's distinct sets (interned) and their byte transitions: inside a string most trie
     * nodes map the "in a string" set to itself, so each (set, byte) is computed once per walk
     * and a trie node costs one table lookup */
    pdm__gset_t *isets;  /* [PDM__MAX_ISETS] */
    uint64_t *ihashes;   /* [PDM__MAX_ISETS] */
    int n_isets;
    int32_t *itable;     /* [PDM__ITABLE] open addressing: iset index + 1, 0 = free */
    int32_t *trans;      /* [PDM__MAX_ISETS][256]: next iset, -1 none, -2 not computed */
    int32_t *ilevel;     /* [PDM__TRIE_MAX_DEPTH + 1] iset of each depth of the walk */
    pdm__gnode_t *scratch; /* [cap_scratch] pdm__compact's copy ... */
    int32_t *map;          /* [cap_scratch] ... and its old id -> new id */
    size_t cap_scratch;
};

static int32_t pdm__push(pdm_gmatch_t *m, uint32_t pos, int32_t parent)
{
    uint32_t depth = parent >= 0 ? m->nodes[parent].depth + 1 : 1;
    if (depth > PDM__MAX_STACK_DEPTH) return -2;
    if (m->n_nodes == m->cap_nodes) {
        size_t cap = m->cap_nodes * 2;
        pdm__gnode_t *nn = cap > PDM__MAX_NODES ? NULL : realloc(m->nodes, cap * sizeof(*nn));
        if (!nn) {
            m->overflow = 1;
            return -2;
        }
        m->nodes = nn;
        m->cap_nodes = cap;
    }
    uint64_t h = (parent >= 0 ? m->nodes[parent].hash : 0xcbf29ce484222325ull) ^ pos;
    h *= 0x100000001b3ull;
    h ^= h >> 31;
    m->nodes[m->n_nodes] = (pdm__gnode_t){pos, parent, depth, h};
    return (int32_t)m->n_nodes++;
}

static int pdm__stack_eq(const pdm_gmatch_t *m, int32_t a, int32_t b)
{
    if (a >= 0 && b >= 0 && m->nodes[a].hash != m->nodes[b].hash) return 0;
    while (a != b) {
        if (a < 0 || b < 0 || m->nodes[a].pos != m->nodes[b].pos) return 0;
        a = m->nodes[a].parent;
        b = m->nodes[b].parent;
    }
    return 1;
}

static void pdm__set_add(const pdm_gmatch_t *m, pdm__gset_t *s, int32_t id)
{
    for (int i = 0; i < s->n; i++)
        if (pdm__stack_eq(m, s->id[i], id)) return;
    if (s->n < PDM__MAX_STACKS) s->id[s->n++] = id;
}

static void pdm__expand(pdm_gmatch_t *m, uint32_t pos, int32_t parent, pdm__gset_t *out,
                        int guard);

/* Continues with stack `id` (its top's alternative has ended up to it): adds it when its top
 * is a byte class, expands it when a reference. */
static void pdm__expand_rest(pdm_gmatch_t *m, int32_t id, pdm__gset_t *out, int guard)
{
    if (id == -1) {
        pdm__set_add(m, out, -1);
    } else if (id >= 0) {
        const pdm__gnode_t nd = m->nodes[id];
        if (m->g->elems[nd.pos].kind == GE_CHAR) pdm__set_add(m, out, id);
        else pdm__expand(m, nd.pos, nd.parent, out, guard);
    }
}

/* Adds the stacks that matching elems[pos..] (then `parent`) starts with. */
static void pdm__expand(pdm_gmatch_t *m, uint32_t pos, int32_t parent, pdm__gset_t *out,
                        int guard)
{
    const pdm_grammar_t *g = m->g;
    if (guard > 64) return; /* no grammar we build has such an empty-rule chain */
    const pdm__gelem_t e = g->elems[pos];
    if (e.kind == GE_END) {
        pdm__expand_rest(m, parent, out, guard + 1);
        return;
    }
    if (e.kind == GE_CHAR) {
        int32_t id = pdm__push(m, pos, parent);
        if (id >= 0) pdm__set_add(m, out, id);
        return;
    }
    int32_t rest = g->elems[pos + 1].kind == GE_END ? parent : pdm__push(m, pos + 1, parent);
    if (rest == -2) return;
    for (uint32_t a = g->rule_first[e.arg]; a < g->rule_first[e.arg + 1]; a++) {
        uint32_t start = g->alts[a].start;
        if (g->elems[start].kind == GE_END) pdm__expand_rest(m, rest, out, guard + 1);
        else pdm__expand(m, start, rest, out, guard + 1);
    }
}

static int pdm__advance(pdm_gmatch_t *m, const pdm__gset_t *in, unsigned char c, pdm__gset_t *out)
{
    const pdm_grammar_t *g = m->g;
    out->n = 0;
    for (int i = 0; i < in->n; i++) {
        int32_t id = in->id[i];
        if (id < 0) continue;
        const pdm__gnode_t nd = m->nodes[id];
        if (!(g->classes[g->elems[nd.pos].arg][c >> 5] >> (c & 31) & 1)) continue;
        uint32_t next = nd.pos + 1;
        if (g->elems[next].kind == GE_END) pdm__expand_rest(m, nd.parent, out, 0);
        else if (g->elems[next].kind == GE_CHAR) {
            int32_t nid = pdm__push(m, next, nd.parent);
            if (nid >= 0) pdm__set_add(m, out, nid);
        } else {
            pdm__expand(m, next, nd.parent, out, 0);
        }
    }
    return out->n;
}

/* Copies the stacks of `s` to the bottom of a fresh arena (the rest is garbage). */
static int pdm__compact(pdm_gmatch_t *m, pdm__gset_t *s)
{
    /* scratch kept between calls: the live nodes are far fewer than the arena's capacity,
     * which the mask walks grow */
    if (m->cap_scratch < m->n_nodes) {
        size_t cap = m->n_nodes + m->n_nodes / 2 + 64;
        pdm__gnode_t *f = realloc(m->scratch, cap * sizeof(*f));
        if (f) m->scratch = f;
        int32_t *mp = f ? realloc(m->map, cap * sizeof(*mp)) : NULL;
        if (mp) m->map = mp;
        if (!f || !mp) return PDM_ENOMEM;
        m->cap_scratch = cap;
    }
    pdm__gnode_t *fresh = m->scratch;
    int32_t *map = m->map;
    memset(map, 0xff, m->n_nodes * sizeof(int32_t));
    size_t n = 0;
    for (int i = 0; i < s->n; i++) {
        int32_t chain[PDM__MAX_STACK_DEPTH + 1];
        int len = 0;
        for (int32_t id = s->id[i]; id >= 0 && map[id] < 0; id = m->nodes[id].parent)
            chain[len++] = id;
        while (len > 0) { /* parents first */
            int32_t id = chain[--len];
            int32_t p = m->nodes[id].parent;
            fresh[n] = m->nodes[id];
            fresh[n].parent = p >= 0 ? map[p] : -1;
            map[id] = (int32_t)n++;
        }
        if (s->id[i] >= 0) s->id[i] = map[s->id[i]];
    }
    memcpy(m->nodes, fresh, n * sizeof(*fresh)); /* n <= n_nodes <= cap_nodes */
    m->n_nodes = n;
    return PDM_OK;
}

pdm_gmatch_t *pdm_gmatch_create(const pdm_grammar_t *g, const pdm_vocab_trie_t *trie)
{
    pdm_gmatch_t *m = calloc(1, sizeof(*m));
    if (!m) goto err;
    m->g = g;
    m->trie = trie;
    m->cap_nodes = 4096;
    m->words = ((size_t)trie->n_vocab + 31) / 32;
    m->nodes = malloc(m->cap_nodes * sizeof(*m->nodes));
    m->levels = malloc((PDM__TRIE_MAX_DEPTH + 1) * sizeof(*m->levels));
    m->marks = malloc((PDM__TRIE_MAX_DEPTH + 1) * sizeof(*m->marks));
    m->mask = calloc(m->words, sizeof(uint32_t));
    m->isets = malloc(PDM__MAX_ISETS * sizeof(*m->isets));
    m->ihashes = malloc(PDM__MAX_ISETS * sizeof(*m->ihashes));
    m->itable = malloc(PDM__ITABLE * sizeof(*m->itable));
    m->trans = malloc((size_t)PDM__MAX_ISETS * 256 * sizeof(*m->trans));
    m->ilevel = malloc((PDM__TRIE_MAX_DEPTH + 1) * sizeof(*m->ilevel));
    if (!m->nodes || !m->levels || !m->marks || !m->mask || !m->isets || !m->ihashes ||
        !m->itable || !m->trans || !m->ilevel)
        goto err;
    /* the root rule's alternative: expand a reference to it */
    for (uint32_t a = g->rule_first[g->root]; a < g->rule_first[g->root + 1]; a++)
        pdm__expand(m, g->alts[a].start, -1, &m->cur, 0);
    if (m->overflow) goto err;
    return m;
err:
    pdm_gmatch_destroy(m);
    pdm_error_set(PDM_ENOMEM, "out of memory");
    return NULL;
}

void pdm_gmatch_destroy(pdm_gmatch_t *m)
{
    if (!m) return;
    free(m->nodes);
    free(m->levels);
    free(m->marks);
    free(m->mask);
    free(m->isets);
    free(m->ihashes);
    free(m->itable);
    free(m->trans);
    free(m->ilevel);
    free(m->scratch);
    free(m->map);
    for (int i = 0; i < m->n_cache; i++) free(m->cache[i].mask);
    free(m);
}

int pdm_gmatch_is_complete(const pdm_gmatch_t *m)
{
    for (int i = 0; i < m->cur.n; i++)
        if (m->cur.id[i] == -1) return 1;
    return 0;
}

/* Runs the bytes from the current state into *out; 0 if some byte is refused. The arena grows
 * (the caller resets or compacts). */
static int pdm__run(pdm_gmatch_t *m, const char *bytes, size_t len, pdm__gset_t *out)
{
    pdm__gset_t a = m->cur, b;
    pdm__gset_t *x = &a, *y = &b;
    for (size_t i = 0; i < len; i++) {
        if (!pdm__advance(m, x, (unsigned char)bytes[i], y)) return 0;
        pdm__gset_t *t = x;
        x = y;
        y = t;
    }
    *out = *x;
    return 1;
}

int pdm_gmatch_accept_bytes(pdm_gmatch_t *m, const char *bytes, size_t len)
{
    const size_t top = m->n_nodes;
    pdm__gset_t next;
    if (!pdm__run(m, bytes, len, &next) || m->overflow) {
        m->n_nodes = top;
        m->overflow = 0;
        return 0;
    }
    if (pdm__compact(m, &next)) {
        m->n_nodes = top;
        return 0;
    }
    m->cur = next;
    return 1;
}

int pdm_gmatch_accept_token(pdm_gmatch_t *m, int32_t token)
{
    const pdm_vocab_trie_t *t = m->trie;
    if (token < 0 || token >= t->n_vocab) return 0;
    if (t->eog[token]) return pdm_gmatch_is_complete(m);
    uint32_t len = t->tok_off[token + 1] - t->tok_off[token];
    if (!len) return 0;
    return pdm_gmatch_accept_bytes(m, t->bytes + t->tok_off[token], len);
}

int pdm_gmatch_allows(pdm_gmatch_t *m, int32_t token)
{
    const pdm_vocab_trie_t *t = m->trie;
    if (token < 0 || token >= t->n_vocab) return 0;
    if (t->eog[token]) return pdm_gmatch_is_complete(m);
    uint32_t len = t->tok_off[token + 1] - t->tok_off[token];
    if (!len) return 0;
    const size_t top = m->n_nodes;
    pdm__gset_t out;
    int ok = pdm__run(m, t->bytes + t->tok_off[token], len, &out) && !m->overflow;
    m->n_nodes = top;
    m->overflow = 0;
    return ok;
}

/* The state's identity for the mask cache: each stack's positions hashed (FNV-1a), the stacks
 * combined independently of their order. */
static uint64_t pdm__set_key(const pdm_gmatch_t *m, const pdm__gset_t *s)
{
    uint64_t key = 0x9E3779B97F4A7C15ull;
    for (int i = 0; i < s->n; i++) {
        uint64_t h = s->id[i] >= 0 ? m->nodes[s->id[i]].hash : 0x51afd7ed558ccd00ull;
        h ^= h >> 29;
        h *= 0xbf58476d1ce4e5b9ull;
        key += h ^ (h >> 32);
    }
    return key;
}

/* Sets equal as sets of stacks (each is deduplicated). */
static int pdm__set_eq(const pdm_gmatch_t *m, const pdm__gset_t *a, const pdm__gset_t *b)
{
    if (a->n != b->n) return 0;
    for (int i = 0; i < a->n; i++) {
        int found = 0;
        for (int j = 0; j < b->n && !found; j++) found = pdm__stack_eq(m, a->id[i], b->id[j]);
        if (!found) return 0;
    }
    return 1;
}

/* The index of set s among the walk's interned sets (added if new), or -1 when full. */
static int32_t pdm__intern(pdm_gmatch_t *m, const pdm__gset_t *s)
{
    const uint64_t h = pdm__set_key(m, s);
    uint32_t slot = (uint32_t)(h ^ (h >> 32)) & (PDM__ITABLE - 1);
    for (; m->itable[slot]; slot = (slot + 1) & (PDM__ITABLE - 1)) {
        int32_t k = m->itable[slot] - 1;
        if (m->ihashes[k] == h && pdm__set_eq(m, &m->isets[k], s)) return k;
    }
    if (m->n_isets == PDM__MAX_ISETS) return -1;
    int32_t k = m->n_isets++;
    m->isets[k] = *s;
    m->ihashes[k] = h;
    m->itable[slot] = k + 1;
    for (int b = 0; b < 256; b++) m->trans[(size_t)k * 256 + (size_t)b] = -2;
    return k;
}

/* The walk with interned sets; 0 if the sets overflowed (then the plain walk runs). */
static int pdm__walk_interned(pdm_gmatch_t *m, uint32_t *mask)
{
    const pdm_vocab_trie_t *t = m->trie;
    memset(m->itable, 0, PDM__ITABLE * sizeof(*m->itable));
    m->n_isets = 0;
    m->ilevel[0] = pdm__intern(m, &m->cur);
    for (uint32_t i = 0; i < t->n_nodes;) {
        const unsigned d = t->node[i].depth;
        const int32_t from = m->ilevel[d - 1];
        int32_t *tr = &m->trans[(size_t)from * 256 + t->node[i].byte];
        if (*tr == -2) {
            pdm__gset_t out;
            if (!pdm__advance(m, &m->isets[from], t->node[i].byte, &out)) *tr = -1;
            else if ((*tr = pdm__intern(m, &out)) < 0) return 0;
        }
        if (*tr < 0) {
            i += t->node[i].skip;
            continue;
        }
        m->ilevel[d] = *tr;
        for (int32_t k = t->node[i].tok_first; k >= 0; k = t->tok_next[k])
            mask[k >> 5] |= 1u << (k & 31);
        i++;
    }
    return 1;
}

const uint32_t *pdm_gmatch_mask(pdm_gmatch_t *m)
{
    const pdm_vocab_trie_t *t = m->trie;
    const uint64_t key = pdm__set_key(m, &m->cur);
    for (int i = 0; i < m->n_cache; i++)
        if (m->cache[i].key == key) {
            m->hits++;
            return m->cache[i].mask;
        }
    m->walks++;
    uint32_t *mask = m->mask;
    memset(mask, 0, m->words * sizeof(uint32_t));
    const size_t base = m->n_nodes;
    if (pdm__walk_interned(m, mask) && !m->overflow) goto walked;
    memset(mask, 0, m->words * sizeof(uint32_t));
    m->n_nodes = base;
    m->overflow = 0;
    m->levels[0] = m->cur;
    m->marks[0] = base;
    for (uint32_t i = 0; i < t->n_nodes;) {
        const unsigned d = t->node[i].depth;
        m->n_nodes = m->marks[d - 1];
        if (!pdm__advance(m, &m->levels[d - 1], t->node[i].byte, &m->levels[d])) {
            i += t->node[i].skip;
            continue;
        }
        m->marks[d] = m->n_nodes;
        for (int32_t k = t->node[i].tok_first; k >= 0; k = t->tok_next[k])
            mask[k >> 5] |= 1u << (k & 31);
        i++;
    }
walked:
    m->n_nodes = base;
    m->overflow = 0;
    if (pdm_gmatch_is_complete(m))
        for (int32_t k = 0; k < t->n_vocab; k++)
            if (t->eog[k]) mask[k >> 5] |= 1u << (k & 31);
    /* cache a copy (round robin) */
    int slot = m->n_cache < PDM__CACHE ? m->n_cache : m->cache_next;
    if (m->n_cache < PDM__CACHE) {
        if (!(m->cache[slot].mask = malloc(m->words * sizeof(uint32_t)))) return mask;
        m->n_cache++;
    } else {
        m->cache_next = (m->cache_next + 1) % PDM__CACHE;
    }
    m->cache[slot].key = key;
    memcpy(m->cache[slot].mask, mask, m->words * sizeof(uint32_t));
    return m->cache[slot].mask;
}

void pdm_gmatch_stats(const pdm_gmatch_t *m, uint64_t *walks, uint64_t *hits)
{
    *walks = m->walks;
    *hits = m->hits;
}
