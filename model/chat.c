/*
 * chat.c - chat template families and their renderers, after llama.cpp's src/llama-chat.cpp
 * (llama-cpp-python 0.3.36): llm_chat_detect_template's marker tests in its order, and
 * llm_chat_apply_template's rules for the families pdmesh serves (ChatML, Llama 2 and its
 * variants, Mistral v1/v3/v3-tekken/v7/v7-tekken, Phi-3, Phi-4, Zephyr, Gemma, Llama 3).
 * See chat.h.
 */
#include "chat.h"

#include <stdlib.h>
#include <string.h>

#include "../common/pdm.h"

static const char *const pdm_chat__names[PDM_CHAT_N_FORMATS] = {
    [PDM_CHAT_UNKNOWN] = "unknown",
#define PDM_CHAT__NAME(e, name) [PDM_CHAT_##e] = name,
    PDM_CHAT_FORMATS(PDM_CHAT__NAME)
#undef PDM_CHAT__NAME
};

const char *pdm_chat_name(pdm_chat_format_t fmt)
{
    if ((int)fmt < 0 || fmt >= PDM_CHAT_N_FORMATS) return "unknown";
    return pdm_chat__names[fmt];
}

pdm_chat_format_t pdm_chat_from_name(const char *name)
{
    if (!name) return PDM_CHAT_UNKNOWN;
    for (int f = PDM_CHAT_UNKNOWN + 1; f < PDM_CHAT_N_FORMATS; f++)
        if (!strcmp(name, pdm_chat__names[f])) return (pdm_chat_format_t)f;
    return PDM_CHAT_UNKNOWN;
}

const char *pdm_chat_names(void)
{
#define PDM_CHAT__LIST(e, name) name ", "
    static const char list[] = PDM_CHAT_FORMATS(PDM_CHAT__LIST);
#undef PDM_CHAT__LIST
    static char trimmed[sizeof(list)];
    /* drop the trailing ", " once; the result is the same on every call, so a race only
     * writes identical bytes */
    if (!trimmed[0]) {
        memcpy(trimmed, list, sizeof(list) - 3);
        trimmed[sizeof(list) - 3] = 0;
    }
    return trimmed;
}

/* llm_chat_detect_template. Families llama.cpp tests before the ones pdmesh renders are tested
 * too (and give PDM_CHAT_UNKNOWN), so that a SmolVLM or Falcon 3 template is never taken for
 * ChatML or Zephyr. */
pdm_chat_format_t pdm_chat_detect(const char *tmpl)
{
    if (!tmpl) return PDM_CHAT_UNKNOWN;
    pdm_chat_format_t by_name = pdm_chat_from_name(tmpl);
    if (by_name != PDM_CHAT_UNKNOWN) return by_name;
#define HAS(s) (strstr(tmpl, (s)) != NULL)
    if (HAS("<|im_start|>")) {
        if (HAS("<|im_sep|>")) return PDM_CHAT_PHI4;
        if (HAS("<end_of_utterance>")) return PDM_CHAT_UNKNOWN; /* SmolVLM */
        return PDM_CHAT_CHATML;
    }
    if (!strncmp(tmpl, "mistral", 7) || HAS("[INST]")) {
        if (HAS("[SYSTEM_PROMPT]")) return PDM_CHAT_MISTRAL_V7;
        if (HAS("' [INST] ' + system_message") || HAS("[AVAILABLE_TOOLS]")) {
            /* official Mistral v1, v3 and v3-tekken templates */
            if (HAS(" [INST]")) return PDM_CHAT_MISTRAL_V1;
            if (HAS("\"[INST]\"")) return PDM_CHAT_MISTRAL_V3_TEKKEN;
            return PDM_CHAT_MISTRAL_V3;
        }
        if (HAS("content.strip()")) return PDM_CHAT_LLAMA2_SYS_STRIP;
        if (HAS("bos_token + '[INST]")) return PDM_CHAT_LLAMA2_SYS_BOS;
        if (HAS("<<SYS>>")) return PDM_CHAT_LLAMA2_SYS;
        return PDM_CHAT_LLAMA2;
    }
    if (HAS("<|assistant|>") && HAS("<|end|>")) return PDM_CHAT_PHI3;
    if (HAS("[gMASK]<sop>")) return PDM_CHAT_UNKNOWN;                       /* ChatGLM 4 */
    if (HAS("<|assistant|>") && HAS("<|user|>")) return PDM_CHAT_UNKNOWN;   /* Falcon 3, GLM */
    if (HAS("<|{{ item['role'] }}|>") && HAS("<|begin_of_image|>")) return PDM_CHAT_UNKNOWN;
    if (HAS("<|user|>") && HAS("<|endoftext|>")) return PDM_CHAT_ZEPHYR;
    if (HAS("bos_token + message['role']")) return PDM_CHAT_UNKNOWN;         /* Monarch */
    if (HAS("<start_of_turn>")) return PDM_CHAT_GEMMA;
    if (HAS("'\\n\\nAssistant: ' + eos_token")) return PDM_CHAT_UNKNOWN;     /* Orion */
    if (HAS("GPT4 Correct ")) return PDM_CHAT_UNKNOWN;                       /* OpenChat */
    if (HAS("USER: ") && HAS("ASSISTANT: ")) return PDM_CHAT_UNKNOWN;        /* Vicuna */
    if (HAS("### Instruction:") && HAS("<|EOT|>")) return PDM_CHAT_UNKNOWN;  /* DeepSeek */
    if (HAS("<|START_OF_TURN_TOKEN|>") && HAS("<|USER_TOKEN|>")) return PDM_CHAT_UNKNOWN;
    if (HAS("<|start_header_id|>") && HAS("<|end_header_id|>")) return PDM_CHAT_LLAMA3;
#undef HAS
    return PDM_CHAT_UNKNOWN;
}

/* See chat.h. */
char *pdm_chat_default_system(const char *tmpl)
{
    static const char head[] = "<|im_start|>system";
    if (!tmpl || (!strstr(tmpl, "'system'") && !strstr(tmpl, "\"system\""))) return NULL;
    for (const char *p = strstr(tmpl, head); p; p = strstr(p + 1, head)) {
        if (p == tmpl || (p[-1] != '\'' && p[-1] != '"')) continue;
        char quote = p[-1];
        const char *q = p + sizeof(head) - 1;
        if (*q == '\n') q++;
        else if (q[0] == '\\' && q[1] == 'n') q += 2;
        else continue;
        /* Unescape the rest of the literal. */
        size_t n = 0;
        char *lit = malloc(strlen(q) + 1);
        if (!lit) return NULL;
        int closed = 0;
        while (*q) {
            if (*q == quote) {
                closed = 1;
                break;
            }
            if (*q == '\\' && q[1]) {
                char e = q[1];
                lit[n++] = e == 'n' ? '\n' : e == 't' ? '\t' : e;
                q += 2;
                continue;
            }
            lit[n++] = *q++;
        }
        lit[n] = 0;
        static const char tail[] = "<|im_end|>";
        size_t tl = sizeof(tail) - 1;
        if (closed && n > 0 && lit[n - 1] == '\n') lit[--n] = 0;
        if (closed && n >= tl && !memcmp(lit + n - tl, tail, tl) && !strstr(lit, "{{")) {
            lit[n - tl] = 0;
            return lit;
        }
        free(lit);
    }
    return NULL;
}

/* ---- Rendering -------------------------------------------------------------------------- */

typedef struct {
    char *s;
    size_t n, cap;
    int oom;
} pdm_chat__buf_t;

static void pdm_chat__putn(pdm_chat__buf_t *b, const char *s, size_t n)
{
    if (b->oom) return;
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1) cap *= 2;
        char *p = realloc(b->s, cap);
        if (!p) {
            b->oom = 1;
            return;
        }
        b->s = p;
        b->cap = cap;
    }
    memcpy(b->s + b->n, s, n);
    b->n += n;
    b->s[b->n] = 0;
}

static void pdm_chat__put(pdm_chat__buf_t *b, const char *s) { pdm_chat__putn(b, s, strlen(s)); }

/* llama.cpp's trim(): C-locale isspace at both ends. */
static int pdm_chat__space(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r';
}

static void pdm_chat__put_trimmed(pdm_chat__buf_t *b, const char *s)
{
    size_t a = 0, e = strlen(s);
    while (a < e && pdm_chat__space(s[a])) a++;
    while (e > a && pdm_chat__space(s[e - 1])) e--;
    pdm_chat__putn(b, s + a, e - a);
}

static void pdm_chat__chatml(pdm_chat__buf_t *b, const char *const *roles,
                             const char *const *contents, int n, int add_ass, const char *sys)
{
    if (sys && n > 0 && strcmp(roles[0], "system") != 0) {
        pdm_chat__put(b, "<|im_start|>system\n");
        pdm_chat__put(b, sys);
        pdm_chat__put(b, "<|im_end|>\n");
    }
    for (int i = 0; i < n; i++) {
        pdm_chat__put(b, "<|im_start|>");
        pdm_chat__put(b, roles[i]);
        pdm_chat__put(b, "\n");
        pdm_chat__put(b, contents[i]);
        pdm_chat__put(b, "<|im_end|>\n");
    }
    if (add_ass) pdm_chat__put(b, "<|im_start|>assistant\n");
}

/* Mistral v7 / v7-tekken: the v7 markers take a space after them, tekken's do not; there is
 * no generation prompt (the next turn starts with the model's text). */
static void pdm_chat__mistral_v7(pdm_chat__buf_t *b, const char *const *roles,
                                 const char *const *contents, int n, int tekken)
{
    const char *sp = tekken ? "" : " ";
    for (int i = 0; i < n; i++) {
        if (!strcmp(roles[i], "system")) {
            pdm_chat__put(b, "[SYSTEM_PROMPT]");
            pdm_chat__put(b, sp);
            pdm_chat__put(b, contents[i]);
            pdm_chat__put(b, "[/SYSTEM_PROMPT]");
        } else if (!strcmp(roles[i], "user")) {
            pdm_chat__put(b, "[INST]");
            pdm_chat__put(b, sp);
            pdm_chat__put(b, contents[i]);
            pdm_chat__put(b, "[/INST]");
        } else {
            pdm_chat__put(b, sp);
            pdm_chat__put(b, contents[i]);
            pdm_chat__put(b, "</s>");
        }
    }
}

/* Mistral v1 / v3 / v3-tekken (mistralai cookbook's templates.md): one [INST] opens a turn
 * that the assistant's answer closes; v1 puts a space before [INST] and [/INST], tekken none
 * after, v3 trims the assistant's text. */
static void pdm_chat__mistral_v1_v3(pdm_chat__buf_t *b, const char *const *roles,
                                    const char *const *contents, int n, pdm_chat_format_t fmt)
{
    const char *lead = fmt == PDM_CHAT_MISTRAL_V1 ? " " : "";
    const char *trail = fmt == PDM_CHAT_MISTRAL_V3_TEKKEN ? "" : " ";
    int inside = 0;
    for (int i = 0; i < n; i++) {
        if (!inside) {
            pdm_chat__put(b, lead);
            pdm_chat__put(b, "[INST]");
            pdm_chat__put(b, trail);
            inside = 1;
        }
        if (!strcmp(roles[i], "system")) {
            pdm_chat__put(b, contents[i]);
            pdm_chat__put(b, "\n\n");
        } else if (!strcmp(roles[i], "user")) {
            pdm_chat__put(b, contents[i]);
            pdm_chat__put(b, lead);
            pdm_chat__put(b, "[/INST]");
        } else {
            pdm_chat__put(b, trail);
            if (fmt == PDM_CHAT_MISTRAL_V3) pdm_chat__put_trimmed(b, contents[i]);
            else pdm_chat__put(b, contents[i]);
            pdm_chat__put(b, "</s>");
            inside = 0;
        }
    }
}

/* Llama 2 and its variants: <<SYS>> blocks (or the bare system text for plain llama2), <s>
 * before later turns (sys-bos), trimmed messages (sys-strip). */
static void pdm_chat__llama2(pdm_chat__buf_t *b, const char *const *roles,
                             const char *const *contents, int n, pdm_chat_format_t fmt)
{
    int sys_ok = fmt != PDM_CHAT_LLAMA2;
    int bos_inside = fmt == PDM_CHAT_LLAMA2_SYS_BOS;
    int strip = fmt == PDM_CHAT_LLAMA2_SYS_STRIP;
    int inside = 1; /* the first [INST] is written without BOS */
    pdm_chat__put(b, "[INST] ");
    for (int i = 0; i < n; i++) {
        if (!inside) {
            inside = 1;
            pdm_chat__put(b, bos_inside ? "<s>[INST] " : "[INST] ");
        }
        if (!strcmp(roles[i], "system")) {
            if (sys_ok) pdm_chat__put(b, "<<SYS>>\n");
            if (strip) pdm_chat__put_trimmed(b, contents[i]);
            else pdm_chat__put(b, contents[i]);
            pdm_chat__put(b, sys_ok ? "\n<</SYS>>\n\n" : "\n");
        } else if (!strcmp(roles[i], "user")) {
            if (strip) pdm_chat__put_trimmed(b, contents[i]);
            else pdm_chat__put(b, contents[i]);
            pdm_chat__put(b, " [/INST]");
        } else {
            if (strip) pdm_chat__put_trimmed(b, contents[i]);
            else pdm_chat__put(b, contents[i]);
            pdm_chat__put(b, "</s>");
            inside = 0;
        }
    }
}

/* Gemma: no system role, so system text (trimmed) is joined to the next non-model turn;
 * "assistant" is called "model"; every message is trimmed. */
static void pdm_chat__gemma(pdm_chat__buf_t *b, const char *const *roles,
                            const char *const *contents, int n, int add_ass)
{
    pdm_chat__buf_t sys = {0};
    for (int i = 0; i < n; i++) {
        if (!strcmp(roles[i], "system")) {
            pdm_chat__put_trimmed(&sys, contents[i]);
            if (sys.oom) b->oom = 1;
            continue;
        }
        const char *role = !strcmp(roles[i], "assistant") ? "model" : roles[i];
        pdm_chat__put(b, "<start_of_turn>");
        pdm_chat__put(b, role);
        pdm_chat__put(b, "\n");
        if (sys.n && strcmp(role, "model") != 0) {
            pdm_chat__putn(b, sys.s, sys.n);
            pdm_chat__put(b, "\n\n");
            sys.n = 0;
        }
        pdm_chat__put_trimmed(b, contents[i]);
        pdm_chat__put(b, "<end_of_turn>\n");
    }
    free(sys.s);
    if (add_ass) pdm_chat__put(b, "<start_of_turn>model\n");
}

/* See chat.h. */
char *pdm_chat_render(pdm_chat_format_t fmt, const char *default_system,
                      const char *const *roles, const char *const *contents, int n_messages,
                      int add_generation_prompt)
{
    if (n_messages < 0 || (n_messages > 0 && (!roles || !contents))) {
        pdm_error_set(PDM_EINVAL, "pdm_chat_render: bad argument");
        return NULL;
    }
    for (int i = 0; i < n_messages; i++) {
        if (!roles[i] || !contents[i]) {
            pdm_error_set(PDM_EINVAL, "pdm_chat_render: message %d is NULL", i);
            return NULL;
        }
    }
    if (fmt <= PDM_CHAT_UNKNOWN || fmt >= PDM_CHAT_N_FORMATS) {
        pdm_error_set(PDM_EUNSUPPORTED, "chat: unknown chat template format (known: %s)",
                      pdm_chat_names());
        return NULL;
    }
    pdm_chat__buf_t b = {0};
    pdm_chat__putn(&b, "", 0); /* an empty conversation still gives "" */
    const char *const *r = roles, *const *c = contents;
    int n = n_messages, add = add_generation_prompt;
    switch (fmt) {
    case PDM_CHAT_CHATML:
        pdm_chat__chatml(&b, r, c, n, add, default_system);
        break;
    case PDM_CHAT_MISTRAL_V7:
    case PDM_CHAT_MISTRAL_V7_TEKKEN:
        pdm_chat__mistral_v7(&b, r, c, n, fmt == PDM_CHAT_MISTRAL_V7_TEKKEN);
        break;
    case PDM_CHAT_MISTRAL_V1:
    case PDM_CHAT_MISTRAL_V3:
    case PDM_CHAT_MISTRAL_V3_TEKKEN:
        pdm_chat__mistral_v1_v3(&b, r, c, n, fmt);
        break;
    case PDM_CHAT_LLAMA2:
    case PDM_CHAT_LLAMA2_SYS:
    case PDM_CHAT_LLAMA2_SYS_BOS:
    case PDM_CHAT_LLAMA2_SYS_STRIP:
        pdm_chat__llama2(&b, r, c, n, fmt);
        break;
    case PDM_CHAT_PHI3:
        for (int i = 0; i < n; i++) {
            pdm_chat__put(&b, "<|");
            pdm_chat__put(&b, r[i]);
            pdm_chat__put(&b, "|>\n");
            pdm_chat__put(&b, c[i]);
            pdm_chat__put(&b, "<|end|>\n");
        }
        if (add) pdm_chat__put(&b, "<|assistant|>\n");
        break;
    case PDM_CHAT_PHI4:
        for (int i = 0; i < n; i++) {
            pdm_chat__put(&b, "<|im_start|>");
            pdm_chat__put(&b, r[i]);
            pdm_chat__put(&b, "<|im_sep|>");
            pdm_chat__put(&b, c[i]);
            pdm_chat__put(&b, "<|im_end|>");
        }
        if (add) pdm_chat__put(&b, "<|im_start|>assistant<|im_sep|>");
        break;
    case PDM_CHAT_ZEPHYR:
        for (int i = 0; i < n; i++) {
            pdm_chat__put(&b, "<|");
            pdm_chat__put(&b, r[i]);
            pdm_chat__put(&b, "|>\n");
            pdm_chat__put(&b, c[i]);
            pdm_chat__put(&b, "<|endoftext|>\n");
        }
        if (add) pdm_chat__put(&b, "<|assistant|>\n");
        break;
    case PDM_CHAT_GEMMA:
        pdm_chat__gemma(&b, r, c, n, add);
        break;
    case PDM_CHAT_LLAMA3:
        for (int i = 0; i < n; i++) {
            pdm_chat__put(&b, "<|start_header_id|>");
            pdm_chat__put(&b, r[i]);
            pdm_chat__put(&b, "<|end_header_id|>\n\n");
            pdm_chat__put_trimmed(&b, c[i]);
            pdm_chat__put(&b, "<|eot_id|>");
        }
        if (add) pdm_chat__put(&b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
        break;
    default:
        break;
    }
    if (b.oom) {
        free(b.s);
        pdm_error_set(PDM_ENOMEM, "chat: out of memory for the chat prompt");
        return NULL;
    }
    return b.s;
}
