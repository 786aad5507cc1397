/*
 * chat.h - chat templates: which family a model's template belongs to, and rendering a
 * conversation in that family's format. Part of model.h (through tokenizer.h).
 *
 * This is llama.cpp's built-in template list (src/llama-chat.cpp: llm_chat_detect_template and
 * llm_chat_apply_template, the engine behind llama_chat_apply_template), not a Jinja
 * interpreter: a template is recognised by the marker strings llama.cpp looks for, in
 * llama.cpp's order, and rendered with that family's fixed rules. The one addition is the
 * default system prompt of ChatML templates (SmolLM2, Qwen2.5): the Jinja template inserts it
 * when the conversation has no system message, llama.cpp's built-in renderer does not; pdmesh
 * follows the template (pdm_chat_render's default_system).
 *
 * Pure string functions: thread-safe, no global state.
 */
#ifndef PDM_MODEL_CHAT_H
#define PDM_MODEL_CHAT_H

#include <stddef.h>

/* X(enum suffix, name as llama.cpp spells it in its template list) */
#define PDM_CHAT_FORMATS(X)                                                                    \
    X(CHATML, "chatml")                                                                        \
    X(LLAMA2, "llama2")                                                                        \
    X(LLAMA2_SYS, "llama2-sys")                                                                \
    X(LLAMA2_SYS_BOS, "llama2-sys-bos")                                                        \
    X(LLAMA2_SYS_STRIP, "llama2-sys-strip")                                                    \
    X(MISTRAL_V1, "mistral-v1")                                                                \
    X(MISTRAL_V3, "mistral-v3")                                                                \
    X(MISTRAL_V3_TEKKEN, "mistral-v3-tekken")                                                  \
    X(MISTRAL_V7, "mistral-v7")                                                                \
    X(MISTRAL_V7_TEKKEN, "mistral-v7-tekken")                                                  \
    X(PHI3, "phi3")                                                                            \
    X(PHI4, "phi4")                                                                            \
    X(ZEPHYR, "zephyr")                                                                        \
    X(GEMMA, "gemma")                                                                          \
    X(LLAMA3, "llama3")

typedef enum {
    PDM_CHAT_UNKNOWN = 0, /* not a family pdmesh renders (or no template at all) */
#define PDM_CHAT__ENUM(e, name) PDM_CHAT_##e,
    PDM_CHAT_FORMATS(PDM_CHAT__ENUM)
#undef PDM_CHAT__ENUM
    PDM_CHAT_N_FORMATS
} pdm_chat_format_t;

/* The family of a Jinja chat template, or of a format name ("chatml", "gemma", ...: a name is
 * also what llama.cpp accepts in place of a template). PDM_CHAT_UNKNOWN when the template is
 * NULL, or belongs to a family llama.cpp knows but pdmesh does not render (SmolVLM, DeepSeek,
 * Command-R, ...), or to none. */
pdm_chat_format_t pdm_chat_detect(const char *tmpl);

/* The format called `name` exactly, or PDM_CHAT_UNKNOWN. */
pdm_chat_format_t pdm_chat_from_name(const char *name);

/* The name of a format ("unknown" for PDM_CHAT_UNKNOWN or an out-of-range value). */
const char *pdm_chat_name(pdm_chat_format_t fmt);

/* Comma-separated list of every format name, for usage and error messages (static). */
const char *pdm_chat_names(void);

/* The default system prompt a ChatML template inserts when the conversation does not start
 * with a system message: a string literal '<|im_start|>system\n...<|im_end|>\n' with no
 * expression inside (SmolLM2, Qwen2.5). Returns a malloc'd copy, or NULL if there is none (or
 * on out of memory, which only loses the default prompt). */
char *pdm_chat_default_system(const char *tmpl);

/* Renders `n_messages` messages (roles[i], contents[i], NUL-terminated) in format `fmt` as
 * llama_chat_apply_template does, followed by the assistant's turn header when
 * add_generation_prompt (for the formats that have one). `default_system` (may be NULL) is
 * put first as a system message when the first message is not one: ChatML only, see above.
 * Returns a malloc'd NUL-terminated string, or NULL with the error recorded (PDM_EUNSUPPORTED
 * for PDM_CHAT_UNKNOWN, PDM_EINVAL for a NULL message, PDM_ENOMEM). */
char *pdm_chat_render(pdm_chat_format_t fmt, const char *default_system,
                      const char *const *roles, const char *const *contents, int n_messages,
                      int add_generation_prompt);

/* ---- Tools (OpenAI's tools / tool_calls / role "tool") -----------------------------------
 * Rendered as the model's own Jinja template does; the ChatML family takes Qwen 2.5's rules
 * (Qwen/Qwen2.5-*-Instruct tokenizer_config.json chat_template): a "# Tools" block in the
 * system turn listing each tool as `tool | tojson` inside <tools></tools>, assistant calls as
 * "<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>", tool results as
 * <tool_response> blocks in a user turn (consecutive results share one turn). The Llama 3
 * family takes Llama 3.1's rules (chat.c, pdm_chat__llama3_tools): tools in the first user
 * message, a call is the bare JSON object {"name": ..., "parameters": ...}. Other families do
 * not render tools (pdm_chat_supports_tools). JSON is printed as Python's json.dumps
 * does (", " and ": " separators, non-ASCII kept), which is what `tojson` gives in
 * transformers; numbers are printed from doubles, so 1.0 becomes 1. */

/* One message of a conversation with tools. */
typedef struct {
    const char *role;            /* system | user | assistant | tool */
    const char *content;         /* never NULL ("" for an assistant turn with calls only) */
    const char *tool_calls_json; /* assistant: OpenAI's tool_calls list as JSON text, or NULL */
} pdm_chat_msg_t;

/* 1 if format `fmt` renders tools, tool calls and tool results. */
int pdm_chat_supports_tools(pdm_chat_format_t fmt);

/* Renders like pdm_chat_render, with `tools_json` (OpenAI's tools list as JSON text, or NULL)
 * and messages that may carry tool calls or be tool results. Returns a malloc'd string, or
 * NULL with the error recorded: PDM_EUNSUPPORTED when the format has no tools, PDM_EINVAL for
 * malformed tools or tool_calls JSON (the message names the problem), PDM_ENOMEM. */
char *pdm_chat_render_tools(pdm_chat_format_t fmt, const char *default_system,
                            const pdm_chat_msg_t *msgs, int n_messages, const char *tools_json,
                            int add_generation_prompt);

/* The JSON schema (grammar.h, with its x-pdmesh-prefix/suffix wrapper for ChatML's tags) that
 * forces one call in the format's syntax: {"name": one of the tools' names (only `name` when
 * not NULL), "arguments" (Llama 3.1: "parameters"): that function's parameters schema
 * ({"type": "object"} when it has none)}.
 * Returns malloc'd text, or NULL with PDM_EINVAL (no such function, malformed tools),
 * PDM_EUNSUPPORTED (format without tools) or PDM_ENOMEM. */
char *pdm_chat_tool_call_schema(pdm_chat_format_t fmt, const char *tools_json,
                                const char *name);

/* One tool call found in generated text. */
typedef struct {
    char *name;      /* function name */
    char *arguments; /* the arguments as compact JSON text ("{}" when absent) */
} pdm_chat_tool_call_t;

/* Finds the tool calls in generated text written in the ChatML/Qwen syntax
 * (<tool_call>{json}</tool_call>; a JSON object with a string "name" and an object (or a JSON
 * string holding one) "arguments" or "parameters"), or, when the text has no <tool_call>, in
 * Llama 3.1's (the whole text, after an optional <|python_tag|>, is one such object). On
 * success *calls (malloc'd array, free with
 * pdm_chat_tool_calls_free) and *n_calls are set, and *content to the text outside the calls
 * (trimmed; NULL when empty). A block that does not parse, or an unclosed one, stays in the
 * content; with no call at all the content is the text unchanged. Returns PDM_OK or
 * PDM_ENOMEM (outputs untouched). */
int pdm_chat_tool_calls_parse(const char *text, pdm_chat_tool_call_t **calls, int *n_calls,
                              char **content);
void pdm_chat_tool_calls_free(pdm_chat_tool_call_t *calls, int n_calls);

/* One call's JSON text (what is between the markers): 1 with *name and *arguments (compact
 * JSON) malloc'd, 0 if it is not a call, -1 out of memory. */
int pdm_chat_tool_call_parse_one(const char *json, size_t len, char **name, char **arguments);

/* The opening marker of a call (for streaming: text that may begin one is held back). */
#define PDM_CHAT_TOOL_CALL_OPEN "<tool_call>"
#define PDM_CHAT_TOOL_CALL_CLOSE "</tool_call>"
/* Llama 3.1 may start a call with this token (its text when special tokens are rendered). */
#define PDM_CHAT_PYTHON_TAG "<|python_tag|>"

#endif /* PDM_MODEL_CHAT_H */
