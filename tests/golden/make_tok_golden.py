#!/usr/bin/env python3
"""Reference tokenizations and chat renderings from llama.cpp (llama-cpp-python 0.3.36) for
pdmesh's tokenizers (SentencePiece and byte-level BPE) and chat templates.

Writes tests/golden/tok_golden.json and, next to it, tok/<vocab>.gguf: small vocabulary-only
GGUF fixtures cut from the real vocabularies, so that tests/unit/test_tokenizer.c runs with no
download. A fixture keeps exactly the tokens the test strings can reach:

  * every byte token <0xXX> (SentencePiece byte fallback);
  * every control / user-defined / unknown token whose text occurs in a test string (the
    special-token partition only ever cuts out texts that occur), plus BOS/EOS/UNK/PAD;
  * every other token whose text is a substring of a test string as the tokenizer sees it
    (SentencePiece: spaces as U+2581, with the U+2581 prefix; BPE: the GPT-2 byte-mapped
    text), and, for BPE, every merge whose result is such a substring, in the original order.

Both algorithms only ever look up substrings of their input, so the cut vocabulary
tokenizes the test strings exactly as the full one does; the fixture's
`pdmesh.fixture.orig_ids` maps its ids back to the original ids the JSON records.

Vocabularies: llama.cpp's own test vocabularies ggml-vocab-llama-spm (Llama 2, SentencePiece
with the space prefix), ggml-vocab-llama-bpe (Llama 3), ggml-vocab-qwen2 (Qwen2/2.5/3) and
ggml-vocab-qwen35 (Qwen3.5: marks inside words) from the sdist's vendor/llama.cpp/models, with
their .inp test strings, and the Gemma 3 270M file (SentencePiece without the space prefix,
262k tokens). Chat templates: the real Jinja
templates in vendor/llama.cpp/models/templates, the SmolLM2 file's own template, and every
built-in format name.

    build/venv/bin/python tests/golden/make_tok_golden.py \\
        --llama-src build/llama.cpp/llama_cpp_python-0.3.36/vendor/llama.cpp \\
        --gemma models/gemma-3-270m-q4_k_m.gguf --smollm models/SmolLM2-135M-Instruct.Q4_1.gguf
"""
import argparse
import ctypes
import json
import os
import sys

import gguf
import llama_cpp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from llamaref import sha256_file  # noqa: E402

SEP = "\n__ggml_vocab_test__\n"

# Strings every vocabulary is tested on, beyond llama.cpp's .inp lists: Unicode, emoji, runs
# of spaces and newlines, and special-token text (tried with and without parse_special).
EXTRA = [
    "",
    " ",
    "Hello",
    " Hello",
    "  Hello  world  ",
    "\n\nHello\n",
    "line one\nline two\r\n\ttabbed",
    "Grüße aus Köln – naïve café",
    "日本語のテキストと中文字符",
    "Привет, мир! Як справи?",
    "🦙🚀👩‍👩‍👧 emoji ✅❤️",
    "x = f(a, b) * 12345 + 3.14159; // code",
    "   leading spaces",
    "trailing spaces   ",
    "<s>Hello</s>",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n",
    "text<bos>more<eos>end <unk> <pad>",
    "[INST] Bonjour [/INST]",
]

# Chat conversations for the template golden data.
CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": " Answer briefly. "},
     {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "  It is 4.  "},
     {"role": "user", "content": " And 3+3?\n"}],
    [{"role": "user", "content": "Grüße 🦙"},
     {"role": "assistant", "content": "Hallo!"},
     {"role": "user", "content": "Merci"}],
]

TEMPLATE_FILES = [
    "Qwen-Qwen2.5-7B-Instruct.jinja",
    "Qwen-Qwen3-0.6B.jinja",
    "Qwen-QwQ-32B.jinja",
    "meta-llama-Llama-3.1-8B-Instruct.jinja",
    "meta-llama-Llama-3.2-3B-Instruct.jinja",
    "meta-llama-Llama-3.3-70B-Instruct.jinja",
    "google-gemma-2-2b-it.jinja",
    "mistralai-Mistral-Nemo-Instruct-2407.jinja",
    "Mistral-Small-3.2-24B-Instruct-2506.jinja",
    "unsloth-mistral-Devstral-Small-2507.jinja",
    "microsoft-Phi-3.5-mini-instruct.jinja",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
    "CohereForAI-c4ai-command-r-plus-tool_use.jinja",
]

# The formats pdmesh renders (model/chat.h), in llama.cpp's spelling.
PDMESH_FORMATS = ["chatml", "llama2", "llama2-sys", "llama2-sys-bos", "llama2-sys-strip",
                  "mistral-v1", "mistral-v3", "mistral-v3-tekken", "mistral-v7",
                  "mistral-v7-tekken", "phi3", "phi4", "zephyr", "gemma", "llama3"]


# ---- tokenization ------------------------------------------------------------------------

def bytes_to_unicode():
    keep = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    mapping, n = {}, 0
    for b in range(256):
        if b in keep:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + n)
            n += 1
    return mapping


BYTE_MAP = bytes_to_unicode()


def seen_text(s, spm):
    """The text a tokenizer's vocabulary lookups run on (see the module comment)."""
    if spm:
        return "\u2581" + s.replace(" ", "\u2581")
    return "".join(BYTE_MAP[b] for b in s.encode("utf-8"))


def field(r, key, default=None):
    f = r.fields.get(key)
    return f.contents() if f is not None else default


def make_fixture(src, dst, strings):
    """Writes the cut vocabulary of `src` for `strings` to `dst`; returns (n_tokens, n_merges)."""
    r = gguf.GGUFReader(src)
    model = field(r, "tokenizer.ggml.model")
    spm = model == "llama"
    tokens = field(r, "tokenizer.ggml.tokens")
    types = field(r, "tokenizer.ggml.token_type")
    scores = field(r, "tokenizer.ggml.scores")
    merges = field(r, "tokenizer.ggml.merges") if not spm else None
    specials = {field(r, "tokenizer.ggml." + k) for k in
                ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")}
    # one string to search (NUL never occurs in a token)
    seen = "\0".join(seen_text(s, spm) for s in strings)
    raw = "\0".join(strings)

    keep = []
    for i, (tok, ty) in enumerate(zip(tokens, types)):
        if ty == 6:  # byte token
            ok = True
        elif ty in (2, 3, 4):  # unknown, control, user-defined: cut out as raw text
            ok = i in specials or tok in raw or tok in seen
        else:
            ok = tok in seen
        if ok:
            keep.append(i)
    new_id = {old: k for k, old in enumerate(keep)}

    w = gguf.GGUFWriter(dst, field(r, "general.architecture", "llama"))
    w.add_string("general.name", "pdmesh tokenizer fixture cut from " + os.path.basename(src))
    w.add_tokenizer_model(model)
    pre = field(r, "tokenizer.ggml.pre")
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list([tokens[i] for i in keep])
    w.add_token_types([int(types[i]) for i in keep])
    if scores is not None:
        w.add_token_scores([float(scores[i]) for i in keep])
    n_merges = 0
    if merges is not None:
        kept = []
        for m in merges:  # "left right", split at the first space after the first character
            sp = m.find(" ", 1)
            if sp > 0 and m[:sp] + m[sp + 1:] in seen:
                kept.append(m)
        n_merges = len(kept)
        w.add_token_merges(kept)
    for key, setter in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id),
                        ("unknown_token_id", w.add_unk_token_id),
                        ("padding_token_id", w.add_pad_token_id)):
        v = field(r, "tokenizer.ggml." + key)
        if v is not None and v in new_id:
            setter(new_id[v])
    for key, setter in (("add_bos_token", w.add_add_bos_token),
                        ("add_eos_token", w.add_add_eos_token),
                        ("add_space_prefix", w.add_add_space_prefix)):
        v = field(r, "tokenizer.ggml." + key)
        if v is not None:
            setter(bool(v))
    w.add_array("pdmesh.fixture.orig_ids", keep)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return len(keep), n_merges


def piece_bytes(vocab, tid):
    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_token_to_piece(vocab, tid, buf, 256, 0, True)
    assert n >= 0
    return buf.raw[:n]


def tokenize_cases(path, strings):
    llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    cases = []
    for s in strings:
        for add_bos, special in ((False, False), (True, True)):
            ids = llm.tokenize(s.encode("utf-8"), add_bos=add_bos, special=special)
            text = b"".join(piece_bytes(vocab, t) for t in ids)
            cases.append({"text": s, "add_bos": add_bos, "special": special, "ids": ids,
                          "pieces_hex": text.hex()})
    info = {"bos": llm.token_bos(), "eos": llm.token_eos(), "n_vocab": llm.n_vocab(),
            "eog": [t for t in range(llm.n_vocab())
                    if llama_cpp.llama_vocab_is_eog(vocab, t)] if llm.n_vocab() < 300000 else []}
    del llm
    return cases, info


# ---- chat templates ----------------------------------------------------------------------

def apply_template(tmpl, messages, add_ass):
    arr = (llama_cpp.llama_chat_message * len(messages))()
    keep = []
    for i, m in enumerate(messages):
        role, content = m["role"].encode(), m["content"].encode()
        keep += [role, content]
        arr[i].role = role
        arr[i].content = content
    t = tmpl.encode() if tmpl is not None else None
    n = llama_cpp.llama_chat_apply_template(t, arr, len(messages), add_ass, None, 0)
    if n < 0:
        return None
    buf = ctypes.create_string_buffer(n + 1)
    llama_cpp.llama_chat_apply_template(t, arr, len(messages), add_ass, buf, n + 1)
    return buf.raw[:n].decode("utf-8")


def builtin_names():
    n = llama_cpp.llama_chat_builtin_templates(None, 0)
    arr = (ctypes.c_char_p * n)()
    llama_cpp.llama_chat_builtin_templates(arr, n)
    return [arr[i].decode() for i in range(n)]


PROBE = CONVERSATIONS[2] + [{"role": "assistant", "content": "6"}]


def family_of(tmpl, names):
    """llama.cpp's family of a template: the built-in name whose rendering of a probe
    conversation is the template's (pdmesh's names first), or None if llama.cpp has none."""
    got = apply_template(tmpl, PROBE, True)
    if got is None:
        return None
    for name in PDMESH_FORMATS + [n for n in names if n not in PDMESH_FORMATS]:
        if apply_template(name, PROBE, True) == got:
            return name
    return "?"


def default_system(tmpl):
    """The default system prompt of a ChatML Jinja template, found by rendering it (Jinja,
    as Hugging Face does) without a system message; None if it adds none."""
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        return None
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = lambda m: (_ for _ in ()).throw(RuntimeError(m))
    try:
        out = env.from_string(tmpl).render(messages=[{"role": "user", "content": "x"}],
                                           add_generation_prompt=False, bos_token="",
                                           eos_token="")
    except Exception:
        return None
    head = "<|im_start|>system\n"
    if out.startswith(head) and "<|im_end|>" in out:
        return out[len(head):out.index("<|im_end|>")]
    return None


def chat_cases(templates):
    names = builtin_names()
    out = []
    for label, tmpl in templates:
        fam = family_of(tmpl, names)
        sys_prompt = default_system(tmpl) if fam == "chatml" and tmpl != "chatml" else None
        renders = []
        for conv in CONVERSATIONS:
            for add_ass in (True, False):
                ref = apply_template(tmpl, conv, add_ass)
                expect = ref
                if sys_prompt is not None and ref is not None and conv[0]["role"] != "system":
                    # pdmesh's one addition: the template's default system prompt (chat.h)
                    expect = "<|im_start|>system\n" + sys_prompt + "<|im_end|>\n" + ref
                renders.append({"messages": conv, "add_generation_prompt": add_ass,
                                "llama_cpp": ref, "expect": expect})
        out.append({"name": label, "template": tmpl, "llama_cpp_family": fam,
                    "pdmesh_format": fam if fam in PDMESH_FORMATS else None,
                    "default_system": sys_prompt, "renders": renders})
    return out


# ---- end to end on the real Gemma 3 270M ---------------------------------------------------

GEMMA_PROMPTS = [
    ("chat", [{"role": "user",
               "content": "What is the capital of France? Answer in one sentence."}]),
    ("plain", "The capital of France is"),
    ("plain", "def fibonacci(n):"),
]
GEMMA_GREEDY = 24


def gemma_generate(path):
    """llama.cpp's greedy continuation (argmax, lowest id on ties, stop at EOG) of each prompt,
    with the gap between the two best logits at every step so that a comparison can stop at
    a near-tie. Chat prompts are rendered with llama.cpp's built-in 'gemma' format: the file
    has no template (llama.cpp alone would use ChatML, whose markers the vocabulary lacks)."""
    import numpy as np
    from llamaref import disable_extra_bufts
    disable_extra_bufts()
    llm = llama_cpp.Llama(model_path=path, n_ctx=256, n_batch=256, n_ubatch=256, n_threads=2,
                          n_threads_batch=2, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    n_vocab = llm.n_vocab()
    out = []
    for kind, p in GEMMA_PROMPTS:
        text = apply_template("gemma", p, True) if kind == "chat" else p
        ids = llm.tokenize(text.encode("utf-8"), add_bos=True, special=kind == "chat")
        llm.reset()
        llm.eval(ids)
        greedy, gaps = [], []
        for _ in range(GEMMA_GREEDY):
            lg = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1),
                                       shape=(n_vocab,)).astype(np.float64)
            top = np.argsort(-lg, kind="stable")[:2]
            tok = int(top[0])
            gaps.append(float(lg[top[0]] - lg[top[1]]))
            if llama_cpp.llama_vocab_is_eog(vocab, tok):
                break
            greedy.append(tok)
            llm.eval([tok])
        out.append({"chat": kind == "chat", "messages": p if kind == "chat" else None,
                    "prompt": p if kind != "chat" else p[0]["content"], "rendered": text,
                    "prompt_ids": ids, "greedy": greedy, "gaps": gaps,
                    "text": llm.detokenize(greedy).decode("utf-8", "replace")})
    del llm
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-src", required=True, help="vendor/llama.cpp of the sdist")
    ap.add_argument("--gemma", required=True)
    ap.add_argument("--smollm", required=True)
    ap.add_argument("--out", default=os.path.join(HERE, "tok_golden.json"))
    args = ap.parse_args()
    models = os.path.join(args.llama_src, "models")
    fixture_dir = os.path.join(os.path.dirname(args.out), "tok")
    os.makedirs(fixture_dir, exist_ok=True)

    vocabs = []
    specs = [("llama-spm", os.path.join(models, "ggml-vocab-llama-spm.gguf")),
             ("llama-bpe", os.path.join(models, "ggml-vocab-llama-bpe.gguf")),
             ("qwen2", os.path.join(models, "ggml-vocab-qwen2.gguf")),
             ("qwen35", os.path.join(models, "ggml-vocab-qwen35.gguf")),
             ("gemma3", args.gemma)]
    for name, path in specs:
        inp = path + ".inp"
        strings = list(EXTRA)
        if os.path.exists(inp):
            with open(inp, encoding="utf-8") as f:
                strings += [s for s in f.read().split(SEP) if s not in strings]
        else:  # Gemma: llama-spm's strings
            with open(os.path.join(models, "ggml-vocab-llama-spm.gguf.inp"),
                      encoding="utf-8") as f:
                strings += [s for s in f.read().split(SEP) if s not in strings]
        fixture = os.path.join(fixture_dir, name + ".gguf")
        n_tok, n_merges = make_fixture(path, fixture, strings)
        cases, info = tokenize_cases(path, strings)
        # the fixture must tokenize exactly as the full vocabulary (checked with llama.cpp too)
        fcases, _ = tokenize_cases(fixture, strings)
        orig = field(gguf.GGUFReader(fixture), "pdmesh.fixture.orig_ids")
        for c, fc in zip(cases, fcases):
            assert [orig[i] for i in fc["ids"]] == c["ids"], (name, c["text"])
        vocabs.append({"name": name, "source": os.path.basename(path),
                       "source_sha256": sha256_file(path), "fixture": "tok/" + name + ".gguf",
                       "fixture_tokens": n_tok, "fixture_merges": n_merges,
                       "n_vocab": info["n_vocab"], "bos": info["bos"], "eos": info["eos"],
                       "eog": info["eog"], "cases": cases})
        print(f"{name}: {len(strings)} strings, fixture {n_tok} tokens, {n_merges} merges",
              file=sys.stderr)

    templates = []
    for fn in TEMPLATE_FILES:
        with open(os.path.join(models, "templates", fn), encoding="utf-8") as f:
            templates.append((fn, f.read()))
    smol = field(gguf.GGUFReader(args.smollm), "tokenizer.chat_template")
    templates.append(("SmolLM2-135M-Instruct (GGUF)", smol))
    templates += [(n, n) for n in PDMESH_FORMATS]

    out = {
        "generator": "tests/golden/make_tok_golden.py",
        "llama_cpp_python": llama_cpp.__version__,
        "vocabs": vocabs,
        "chat": chat_cases(templates),
        "gemma3_file_has_template": field(gguf.GGUFReader(args.gemma),
                                          "tokenizer.chat_template") is not None,
        "gemma3_generate": gemma_generate(args.gemma),
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
