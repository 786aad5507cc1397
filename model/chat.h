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

#endif /* PDM_MODEL_CHAT_H */
