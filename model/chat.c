/*
 * chat.c - chat template families and their renderers, after llama.cpp's src/llama-chat.cpp
 * (llama-cpp-python 0.3.36): llm_chat_detect_template's marker tests in its order, and
 * llm_chat_apply_template's rules for the families pdmesh serves (ChatML, Llama 2 and its
 * variants, Mistral v1/v3/v3-tekken/v7/v7-tekken, Phi-3, Phi-4, Zephyr, Gemma, Llama 3).
 * See chat.h.
 */
#include "chat.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../common/pdm.h"
#include "grammar.h"

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

/* ---- Tools -------------------------------------------------------------------------------- */

int pdm_chat_supports_tools(pdm_chat_format_t fmt)
{
    return fmt == PDM_CHAT_CHATML || fmt == PDM_CHAT_LLAMA3;
}

/* Python's json.dumps(v, ensure_ascii=False) (transformers' tojson): ", " and ": " separators,
 * keys in their order, \" \\ \n \r \t \b \f escaped, other control bytes as \u00XX, the rest
 * (UTF-8 included) as is. */
static void pdm_chat__py_json_at(pdm_chat__buf_t *b, const cJSON *v, int indent, int level);

static void pdm_chat__py_json(pdm_chat__buf_t *b, const cJSON *v)
{
    pdm_chat__py_json_at(b, v, 0, 0);
}

/* With indent > 0: json.dumps(v, indent=indent), "," and ": " separators, one item a line. */
static void pdm_chat__newline(pdm_chat__buf_t *b, int indent, int level)
{
    pdm_chat__put(b, "\n");
    for (int i = 0; i < indent * level; i++) pdm_chat__put(b, " ");
}

static void pdm_chat__py_json_at(pdm_chat__buf_t *b, const cJSON *v, int indent, int level)
{
    char num[40];
    if (cJSON_IsNull(v)) {
        pdm_chat__put(b, "null");
    } else if (cJSON_IsTrue(v)) {
        pdm_chat__put(b, "true");
    } else if (cJSON_IsFalse(v)) {
        pdm_chat__put(b, "false");
    } else if (cJSON_IsNumber(v)) {
        double d = v->valuedouble;
        if (d == floor(d) && fabs(d) < 1e15) {
            snprintf(num, sizeof(num), "%.0f", d);
        } else { /* the shortest %g that reads back the same double, as repr() */
            for (int prec = 15; prec <= 17; prec++) {
                snprintf(num, sizeof(num), "%.*g", prec, d);
                if (strtod(num, NULL) == d) break;
            }
        }
        pdm_chat__put(b, num);
    } else if (cJSON_IsString(v)) {
        pdm_chat__put(b, "\"");
        for (const unsigned char *p = (const unsigned char *)v->valuestring; *p; p++) {
            const char *esc = NULL;
            switch (*p) {
            case '"': esc = "\\\""; break;
            case '\\': esc = "\\\\"; break;
            case '\n': esc = "\\n"; break;
            case '\r': esc = "\\r"; break;
            case '\t': esc = "\\t"; break;
            case '\b': esc = "\\b"; break;
            case '\f': esc = "\\f"; break;
            default: break;
            }
            if (esc) {
                pdm_chat__put(b, esc);
            } else if (*p < 0x20) {
                snprintf(num, sizeof(num), "\\u%04x", *p);
                pdm_chat__put(b, num);
            } else {
                pdm_chat__putn(b, (const char *)p, 1);
            }
        }
        pdm_chat__put(b, "\"");
    } else if (cJSON_IsArray(v) || cJSON_IsObject(v)) {
        int obj = cJSON_IsObject(v);
        pdm_chat__put(b, obj ? "{" : "[");
        for (const cJSON *e = v->child; e; e = e->next) {
            if (indent) pdm_chat__newline(b, indent, level + 1);
            if (obj) {
                cJSON key = {.type = cJSON_String, .valuestring = e->string ? e->string : ""};
                pdm_chat__py_json(b, &key);
                pdm_chat__put(b, ": ");
            }
            pdm_chat__py_json_at(b, e, indent, level + 1);
            if (e->next) pdm_chat__put(b, indent ? "," : ", ");
        }
        if (indent && v->child) pdm_chat__newline(b, indent, level);
        pdm_chat__put(b, obj ? "}" : "]");
    }
}

/* Prints OpenAI's `arguments` (JSON text, or an object) as the templates' `arguments | tojson`
 * expects: the parsed object; a string that is not JSON as a string. */
static void pdm_chat__put_arguments(pdm_chat__buf_t *b, const cJSON *args)
{
    cJSON *parsed = cJSON_IsString(args) ? cJSON_Parse(args->valuestring) : NULL;
    if (parsed) pdm_chat__py_json(b, parsed);
    else if (args) pdm_chat__py_json(b, args);
    else pdm_chat__put(b, "{}");
    cJSON_Delete(parsed);
}

/* Qwen 2.5's assistant turn with calls: '<|im_start|>assistant' ['\n' content] then per call
 * '\n<tool_call>\n{"name": "' name '", "arguments": ' arguments|tojson '}\n</tool_call>', then
 * '<|im_end|>\n'. `arguments` is OpenAI's JSON string: parsed, so that tojson prints the
 * object as the template expects (a string that is not JSON is printed as a string). */
static int pdm_chat__qwen_calls(pdm_chat__buf_t *b, const pdm_chat_msg_t *m, int index)
{
    cJSON *calls = cJSON_Parse(m->tool_calls_json);
    if (!cJSON_IsArray(calls)) {
        cJSON_Delete(calls);
        return pdm_error_set(PDM_EINVAL, "messages[%d].tool_calls must be a list", index);
    }
    pdm_chat__put(b, "<|im_start|>assistant");
    if (m->content[0]) {
        pdm_chat__put(b, "\n");
        pdm_chat__put(b, m->content);
    }
    int k = 0;
    for (const cJSON *call = calls->child; call; call = call->next, k++) {
        const cJSON *fn = cJSON_GetObjectItemCaseSensitive(call, "function");
        const cJSON *c = fn ? fn : call; /* the template's `if tool_call.function is defined` */
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(c, "name");
        const cJSON *args = cJSON_GetObjectItemCaseSensitive(c, "arguments");
        if (!cJSON_IsString(name)) {
            cJSON_Delete(calls);
            return pdm_error_set(PDM_EINVAL, "messages[%d].tool_calls[%d].function.name must be "
                                 "a string", index, k);
        }
        pdm_chat__put(b, "\n<tool_call>\n{\"name\": \"");
        pdm_chat__put(b, name->valuestring);
        pdm_chat__put(b, "\", \"arguments\": ");
        pdm_chat__put_arguments(b, args);
        pdm_chat__put(b, "}\n</tool_call>");
    }
    pdm_chat__put(b, "<|im_end|>\n");
    cJSON_Delete(calls);
    return PDM_OK;
}

/* The ChatML family with Qwen 2.5's tool rules (see chat.h). */
static int pdm_chat__qwen_tools(pdm_chat__buf_t *b, const pdm_chat_msg_t *m, int n,
                                const cJSON *tools, int add_ass, const char *sys)
{
    int first = 0;
    if (tools) {
        pdm_chat__put(b, "<|im_start|>system\n");
        if (n > 0 && !strcmp(m[0].role, "system")) {
            pdm_chat__put(b, m[0].content);
            first = 1;
        } else if (sys) {
            pdm_chat__put(b, sys);
        }
        pdm_chat__put(b, "\n\n# Tools\n\nYou may call one or more functions to assist with the "
                         "user query.\n\nYou are provided with function signatures within "
                         "<tools></tools> XML tags:\n<tools>");
        for (const cJSON *t = tools->child; t; t = t->next) {
            pdm_chat__put(b, "\n");
            pdm_chat__py_json(b, t);
        }
        pdm_chat__put(b, "\n</tools>\n\nFor each function call, return a json object with "
                         "function name and arguments within <tool_call></tool_call> XML "
                         "tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                         "<args-json-object>}\n</tool_call><|im_end|>\n");
    } else if (n > 0 && !strcmp(m[0].role, "system")) {
        pdm_chat__put(b, "<|im_start|>system\n");
        pdm_chat__put(b, m[0].content);
        pdm_chat__put(b, "<|im_end|>\n");
        first = 1;
    } else if (sys) {
        pdm_chat__put(b, "<|im_start|>system\n");
        pdm_chat__put(b, sys);
        pdm_chat__put(b, "<|im_end|>\n");
    }
    for (int i = first; i < n; i++) {
        const char *role = m[i].role;
        if (!strcmp(role, "tool")) {
            if (i == 0 || strcmp(m[i - 1].role, "tool")) pdm_chat__put(b, "<|im_start|>user");
            pdm_chat__put(b, "\n<tool_response>\n");
            pdm_chat__put(b, m[i].content);
            pdm_chat__put(b, "\n</tool_response>");
            if (i == n - 1 || strcmp(m[i + 1].role, "tool")) pdm_chat__put(b, "<|im_end|>\n");
        } else if (!strcmp(role, "assistant") && m[i].tool_calls_json) {
            int st = pdm_chat__qwen_calls(b, &m[i], i);
            if (st) return st;
        } else {
            pdm_chat__put(b, "<|im_start|>");
            pdm_chat__put(b, role);
            pdm_chat__put(b, "\n");
            pdm_chat__put(b, m[i].content);
            pdm_chat__put(b, "<|im_end|>\n");
        }
    }
    if (add_ass) pdm_chat__put(b, "<|im_start|>assistant\n");
    return PDM_OK;
}

static void pdm_chat__llama3_turn(pdm_chat__buf_t *b, const char *role, const char *content)
{
    pdm_chat__put(b, "<|start_header_id|>");
    pdm_chat__put(b, role);
    pdm_chat__put(b, "<|end_header_id|>\n\n");
    pdm_chat__put_trimmed(b, content);
    pdm_chat__put(b, "<|eot_id|>");
}

/* Llama 3.1's template (meta-llama/Llama-3.1-8B-Instruct tokenizer_config.json chat_template,
 * with its defaults: tools in the first user message, date_string "26 Jul 2024", no builtin
 * tools; BOS comes from the tokenizer): a system turn with "Environment: ipython" (with tools),
 * the knowledge and today dates and the system message; the tools as `tojson(indent=4)` in the
 * first user message; an assistant call as {"name": ..., "parameters": ...} (one call per
 * message, as the template demands); tool results in "ipython" turns, printed with tojson (a
 * string content is iterable in Jinja, so it comes out quoted, as with the real template). */
static int pdm_chat__llama3_tools(pdm_chat__buf_t *b, const pdm_chat_msg_t *m, int n,
                                  const cJSON *tools, int add_ass)
{
    int i = 0;
    pdm_chat__put(b, "<|start_header_id|>system<|end_header_id|>\n\n");
    if (tools) pdm_chat__put(b, "Environment: ipython\n");
    pdm_chat__put(b, "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n");
    if (n > 0 && !strcmp(m[0].role, "system")) pdm_chat__put_trimmed(b, m[i++].content);
    pdm_chat__put(b, "<|eot_id|>");
    if (tools) {
        if (i >= n)
            return pdm_error_set(PDM_EINVAL, "chat: Llama 3.1's template puts the tools in the "
                                 "first user message, and there is none");
        pdm_chat__put(b, "<|start_header_id|>user<|end_header_id|>\n\nGiven the following "
                         "functions, please respond with a JSON for a function call with its "
                         "proper arguments that best answers the given prompt.\n\nRespond in "
                         "the format {\"name\": function name, \"parameters\": dictionary of "
                         "argument name and its value}.Do not use variables.\n\n");
        for (const cJSON *t = tools->child; t; t = t->next) {
            pdm_chat__py_json_at(b, t, 4, 0);
            pdm_chat__put(b, "\n\n");
        }
        pdm_chat__put_trimmed(b, m[i++].content);
        pdm_chat__put(b, "<|eot_id|>");
    }
    for (; i < n; i++) {
        if (!strcmp(m[i].role, "tool")) {
            cJSON str = {.type = cJSON_String, .valuestring = (char *)m[i].content};
            pdm_chat__put(b, "<|start_header_id|>ipython<|end_header_id|>\n\n");
            pdm_chat__py_json(b, &str);
            pdm_chat__put(b, "<|eot_id|>");
        } else if (m[i].tool_calls_json) {
            cJSON *calls = cJSON_Parse(m[i].tool_calls_json);
            if (!cJSON_IsArray(calls) || cJSON_GetArraySize(calls) != 1) {
                cJSON_Delete(calls);
                return pdm_error_set(PDM_EINVAL, "messages[%d].tool_calls: Llama 3.1's template "
                                     "takes exactly one call per message", i);
            }
            const cJSON *fn = cJSON_GetObjectItemCaseSensitive(calls->child, "function");
            const cJSON *name = cJSON_GetObjectItemCaseSensitive(fn, "name");
            if (!cJSON_IsString(name)) {
                cJSON_Delete(calls);
                return pdm_error_set(PDM_EINVAL, "messages[%d].tool_calls[0].function.name must "
                                     "be a string", i);
            }
            pdm_chat__put(b, "<|start_header_id|>assistant<|end_header_id|>\n\n{\"name\": \"");
            pdm_chat__put(b, name->valuestring);
            pdm_chat__put(b, "\", \"parameters\": ");
            pdm_chat__put_arguments(b, cJSON_GetObjectItemCaseSensitive(fn, "arguments"));
            pdm_chat__put(b, "}<|eot_id|>");
            cJSON_Delete(calls);
        } else {
            pdm_chat__llama3_turn(b, m[i].role, m[i].content);
        }
    }
    if (add_ass) pdm_chat__put(b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
    return PDM_OK;
}

/* See chat.h. */
char *pdm_chat_render_tools(pdm_chat_format_t fmt, const char *default_system,
                            const pdm_chat_msg_t *msgs, int n_messages, const char *tools_json,
                            int add_generation_prompt)
{
    if (n_messages < 0 || (n_messages > 0 && !msgs)) {
        pdm_error_set(PDM_EINVAL, "pdm_chat_render_tools: bad argument");
        return NULL;
    }
    for (int i = 0; i < n_messages; i++) {
        if (!msgs[i].role || !msgs[i].content) {
            pdm_error_set(PDM_EINVAL, "pdm_chat_render_tools: message %d is NULL", i);
            return NULL;
        }
    }
    if (!pdm_chat_supports_tools(fmt)) {
        pdm_error_set(PDM_EUNSUPPORTED, "the model's chat template (%s) does not support tools "
                      "(templates with tools: chatml as Qwen 2.5, llama3 as Llama 3.1)",
                      pdm_chat_name(fmt));
        return NULL;
    }
    cJSON *tools = NULL;
    if (tools_json && tools_json[0]) {
        tools = cJSON_Parse(tools_json);
        if (!cJSON_IsArray(tools)) {
            cJSON_Delete(tools);
            pdm_error_set(PDM_EINVAL, "tools must be a JSON list");
            return NULL;
        }
        if (!tools->child) {
            cJSON_Delete(tools);
            tools = NULL; /* the template's `if tools`: an empty list is no tools */
        }
    }
    pdm_chat__buf_t b = {0};
    pdm_chat__putn(&b, "", 0);
    int st = fmt == PDM_CHAT_LLAMA3
                 ? pdm_chat__llama3_tools(&b, msgs, n_messages, tools, add_generation_prompt)
                 : pdm_chat__qwen_tools(&b, msgs, n_messages, tools, add_generation_prompt,
                                        default_system);
    cJSON_Delete(tools);
    if (!st && b.oom) st = pdm_error_set(PDM_ENOMEM, "chat: out of memory for the chat prompt");
    if (st) {
        free(b.s);
        return NULL;
    }
    return b.s;
}

/* See chat.h. */
char *pdm_chat_tool_call_schema(pdm_chat_format_t fmt, const char *tools_json, const char *name)
{
    if (!pdm_chat_supports_tools(fmt)) {
        pdm_error_set(PDM_EUNSUPPORTED, "the model's chat template (%s) does not support tools",
                      pdm_chat_name(fmt));
        return NULL;
    }
    cJSON *tools = tools_json ? cJSON_Parse(tools_json) : NULL;
    cJSON *root = cJSON_CreateObject(), *any = NULL;
    char *out = NULL;
    if (!cJSON_IsArray(tools) || !tools->child) {
        pdm_error_set(PDM_EINVAL, "tool_choice needs a non-empty tools list");
        goto done;
    }
    if (!root) goto oom;
    /* Qwen: the object inside <tool_call> tags; Llama 3.1: the bare object, whose arguments
     * are called "parameters" */
    const char *args_key = fmt == PDM_CHAT_LLAMA3 ? "parameters" : "arguments";
    if (fmt == PDM_CHAT_CHATML) {
        cJSON_AddStringToObject(root, PDM_GRAMMAR_KEY_PREFIX, PDM_CHAT_TOOL_CALL_OPEN "\n");
        cJSON_AddStringToObject(root, PDM_GRAMMAR_KEY_SUFFIX, "\n" PDM_CHAT_TOOL_CALL_CLOSE);
    }
    if (!(any = cJSON_AddArrayToObject(root, "anyOf"))) goto oom;
    int k = 0;
    for (const cJSON *t = tools->child; t; t = t->next, k++) {
        const cJSON *fn = cJSON_GetObjectItemCaseSensitive(t, "function");
        const cJSON *fname = cJSON_GetObjectItemCaseSensitive(fn, "name");
        const cJSON *params = cJSON_GetObjectItemCaseSensitive(fn, "parameters");
        if (!cJSON_IsString(fname)) {
            pdm_error_set(PDM_EINVAL, "tools[%d].function.name must be a string", k);
            goto done;
        }
        if (name && strcmp(name, fname->valuestring)) continue;
        cJSON *alt = cJSON_CreateObject();
        if (!alt) goto oom;
        cJSON_AddItemToArray(any, alt);
        cJSON_AddStringToObject(alt, "type", "object");
        cJSON *props = cJSON_AddObjectToObject(alt, "properties");
        cJSON *nm = cJSON_AddObjectToObject(props, "name");
        if (!nm) goto oom;
        cJSON_AddStringToObject(nm, "const", fname->valuestring);
        cJSON *args = params && !cJSON_IsNull(params) ? cJSON_Duplicate(params, 1)
                                                      : cJSON_Parse("{\"type\":\"object\"}");
        if (!args) goto oom;
        cJSON_AddItemToObject(props, args_key, args);
        cJSON *req = cJSON_AddArrayToObject(alt, "required");
        if (!req) goto oom;
        cJSON_AddItemToArray(req, cJSON_CreateString("name"));
        cJSON_AddItemToArray(req, cJSON_CreateString(args_key));
        cJSON_AddFalseToObject(alt, "additionalProperties");
    }
    if (!any->child) {
        pdm_error_set(PDM_EINVAL, "tool_choice names the function '%.64s', which is not in "
                      "tools", name ? name : "");
        goto done;
    }
    if (!(out = cJSON_PrintUnformatted(root))) goto oom;
    goto done;
oom:
    pdm_error_set(PDM_ENOMEM, "out of memory");
done:
    cJSON_Delete(tools);
    cJSON_Delete(root);
    return out;
}

void pdm_chat_tool_calls_free(pdm_chat_tool_call_t *calls, int n_calls)
{
    if (!calls) return;
    for (int i = 0; i < n_calls; i++) {
        free(calls[i].name);
        free(calls[i].arguments);
    }
    free(calls);
}

/* See chat.h. */
int pdm_chat_tool_call_parse_one(const char *json, size_t len, char **name, char **arguments)
{
    cJSON *j = cJSON_ParseWithLength(json, len);
    const cJSON *nm = cJSON_GetObjectItemCaseSensitive(j, "name");
    const cJSON *args = cJSON_GetObjectItemCaseSensitive(j, "arguments");
    if (!args) args = cJSON_GetObjectItemCaseSensitive(j, "parameters"); /* Llama 3.1 */
    cJSON *parsed = NULL;
    if (cJSON_IsString(args)) args = parsed = cJSON_Parse(args->valuestring);
    int st = 0;
    if (cJSON_IsObject(j) && cJSON_IsString(nm) && (!args || cJSON_IsObject(args))) {
        char *n = strdup(nm->valuestring);
        char *a = args ? cJSON_PrintUnformatted(args) : strdup("{}");
        if (n && a) {
            *name = n;
            *arguments = a;
            st = 1;
        } else {
            free(n);
            free(a);
            st = -1;
        }
    }
    cJSON_Delete(parsed);
    cJSON_Delete(j);
    return st;
}

/* See chat.h. */
int pdm_chat_tool_calls_parse(const char *text, pdm_chat_tool_call_t **calls, int *n_calls,
                              char **content)
{
    static const char open[] = PDM_CHAT_TOOL_CALL_OPEN, close[] = PDM_CHAT_TOOL_CALL_CLOSE;
    pdm_chat__buf_t rest = {0};
    pdm_chat_tool_call_t *list = NULL;
    int n = 0, cap = 0;
    pdm_chat__putn(&rest, "", 0);
    const char *p = text ? text : "";
    if (!strstr(p, open)) { /* Llama 3.1: the whole answer is one bare call */
        const char *a = p, *e = p + strlen(p);
        while (pdm_chat__space(*a)) a++;
        if (!strncmp(a, PDM_CHAT_PYTHON_TAG, strlen(PDM_CHAT_PYTHON_TAG)))
            a += strlen(PDM_CHAT_PYTHON_TAG);
        while (e > a && pdm_chat__space(e[-1])) e--;
        if (*a == '{') {
            char *name = NULL, *args = NULL;
            int st = pdm_chat_tool_call_parse_one(a, (size_t)(e - a), &name, &args);
            if (st < 0) goto oom;
            if (st > 0 && !(list = malloc(sizeof(*list)))) {
                free(name);
                free(args);
                goto oom;
            }
            if (st > 0) {
                list[0] = (pdm_chat_tool_call_t){name, args};
                free(rest.s);
                *calls = list;
                *n_calls = 1;
                *content = NULL;
                return PDM_OK;
            }
        }
    }
    for (;;) {
        const char *a = strstr(p, open);
        if (!a) {
            pdm_chat__put(&rest, p);
            break;
        }
        const char *body = a + sizeof(open) - 1, *z = strstr(body, close);
        if (!z) { /* an unclosed call (cut by max_tokens): text, not a call */
            pdm_chat__put(&rest, p);
            break;
        }
        pdm_chat__putn(&rest, p, (size_t)(a - p));
        if (n == cap) {
            cap = cap ? 2 * cap : 4;
            pdm_chat_tool_call_t *l = realloc(list, sizeof(*l) * (size_t)cap);
            if (!l) goto oom;
            list = l;
        }
        int st = pdm_chat_tool_call_parse_one(body, (size_t)(z - body), &list[n].name,
                                              &list[n].arguments);
        if (st < 0) goto oom;
        p = z + sizeof(close) - 1;
        if (st == 0) { /* not a call's JSON: the block stays text */
            pdm_chat__putn(&rest, a, (size_t)(p - a));
            continue;
        }
        n++;
    }
    if (n == 0) { /* no call: the text is the content as it is, untrimmed */
        rest.n = 0;
        pdm_chat__put(&rest, text ? text : "");
    }
    if (rest.oom) goto oom;
    size_t a = 0, e = rest.n;
    while (a < e && pdm_chat__space(rest.s[a])) a++;
    while (e > a && pdm_chat__space(rest.s[e - 1])) e--;
    char *c = NULL;
    if (e > a) {
        if (!(c = malloc(e - a + 1))) goto oom;
        memcpy(c, rest.s + a, e - a);
        c[e - a] = 0;
    }
    free(rest.s);
    *calls = list;
    *n_calls = n;
    *content = c;
    return PDM_OK;
oom:
    pdm_chat_tool_calls_free(list, n);
    free(rest.s);
    return pdm_error_set(PDM_ENOMEM, "out of memory");
}
