#!/usr/bin/env python3
"""Reference logits of every supported architecture (tests/golden/arch_golden.json), from
llama.cpp through llama-cpp-python, on small random-weight models.

For each architecture preset of `pdmesh make-test-model --arch NAME` (llama, llama3, qwen2,
qwen3, gemma3; F32 weights, seed 1) this script

  * writes the model with the pdmesh binary (deterministic: the unit test regenerates the
    same file and checks its sha256 against the one recorded here);
  * evaluates a fixed sequence of PROMPT_LEN token ids (pseudo-random ids from a fixed LCG,
    fed to llama.cpp directly: no tokenizer involved) in one batch with logits_all, and
    records the top TOP_K logits of every position;
  * then decodes N_GREEDY tokens greedily one at a time (argmax of the raw logits, lowest id
    on exact ties), recording each step's top TOP_K logits.

The prompt is longer than the gemma3 preset's sliding window (16) so local layers mask.
llama.cpp's extra buffer types (weight repacking) are turned off so its CPU kernels are the
plain ones. tests/unit/test_arch.c compares pdmesh's prefill and decode against this file.

With --gemma PATH it also records the real Gemma 3 270M Q4_K_M (the issue's PyPI file,
sha256 checked): a 600-token prompt of ids (llama.cpp's tokenization of docs/prefill.md,
longer than the 512-token sliding window), the top-20 logits of its last position and a
16-token greedy continuation with each step's top-20. The same for a copy of it with every
layer tensor dequantized to F32 (written next to it as gemma-3-270m-f32layers.gguf, sha256
recorded): the architecture's math without quantized products. And a 1,000-token document
(the first GEMMA_DOC_TOKENS ids of the same text) with every token's negative log-likelihood
and the document's perplexity, from llama.cpp's logits of all positions in one batch.

Usage:
    build/venv/bin/python tests/golden/make_arch_golden.py \
        --pdmesh build/bin/pdmesh --out tests/golden/arch_golden.json [--threads 2] \
        [--gemma models/gemma-3-270m-q4_k_m.gguf]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

import llama_cpp
from llama_cpp import Llama
from llamaref import disable_extra_bufts, sha256_file  # noqa: E402

ARCHS = ["llama", "llama3", "qwen2", "qwen3", "gemma3"]
MAKE_ARGS = ["--wtype", "f32", "--emb-type", "f32", "--seed", "1"]
PROMPT_LEN = 48
N_GREEDY = 16
TOP_K = 16
N_CTX = 128




def prompt_ids(n_vocab: int) -> list[int]:
    """PROMPT_LEN ids in [3, n_vocab) from a 32-bit LCG (Numerical Recipes constants); the C
    test uses the recorded list, so only this script needs the generator."""
    state, out = 12345, []
    for _ in range(PROMPT_LEN):
        state = (1664525 * state + 1013904223) & 0xFFFFFFFF
        out.append(3 + (state >> 8) % (n_vocab - 3))
    return out


def top(logits: np.ndarray) -> list[list]:
    """Top TOP_K (id, logit): logit descending, id ascending on exact ties."""
    ids = np.arange(logits.shape[0])
    order = np.lexsort((ids, -logits.astype(np.float64)))[:TOP_K]
    return [[int(i), float(logits[i])] for i in order]


def token_nll(scores: np.ndarray, tokens: list[int]) -> list[float]:
    """-log p(tokens[i + 1] | tokens[..i]) from the logits rows scores[i], in f64."""
    out = []
    for i in range(len(tokens) - 1):
        row = scores[i].astype(np.float64)
        mx = row.max()
        lse = mx + np.log(np.exp(row - mx).sum())
        out.append(float(lse - row[tokens[i + 1]]))
    return out


def run_arch(pdmesh: str, arch: str, threads: int, tmp: str) -> dict:
    path = os.path.join(tmp, f"{arch}.gguf")
    args = ["make-test-model", "--arch", arch, *MAKE_ARGS]
    subprocess.run([pdmesh, *args, "--out", path], check=True)
    llm = Llama(model_path=path, n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_CTX,
                n_threads=threads, n_threads_batch=threads, logits_all=True, verbose=False)
    n_vocab = llm.n_vocab()
    prompt = prompt_ids(n_vocab)
    llm.reset()
    llm.eval(prompt)
    scores = np.array(llm.scores[:PROMPT_LEN], dtype=np.float32)
    prompt_top = [top(scores[i]) for i in range(PROMPT_LEN)]
    nll = token_nll(scores, prompt)
    greedy, greedy_top = [], []
    logits = scores[-1]
    for _ in range(N_GREEDY):
        tok = int(np.argmax(logits))  # first maximum: lowest id on ties
        greedy.append(tok)
        llm.eval([tok])
        logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        greedy_top.append(top(logits))
    del llm
    return {
        "make_test_model": args,
        "model_sha256": sha256_file(path),
        "n_vocab": n_vocab,
        "prompt": prompt,
        "prompt_top": prompt_top,
        "prompt_nll": nll,
        "prompt_ppl": float(np.exp(np.mean(nll))),
        "greedy": greedy,
        "greedy_top": greedy_top,
    }


GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA_PROMPT_TOKENS = 600  # longer than Gemma 3's 512-token sliding window
GEMMA_TOP_K = 20
GEMMA_GREEDY = 16
GEMMA_DOC_TOKENS = 1000


def write_f32_layers(src: str, dst: str) -> None:
    """A copy of the GGUF `src` with every tensor but token_embd dequantized to F32 (gguf-py),
    metadata unchanged: the same model without the quantized products, so that the
    architecture's math can be compared with llama.cpp's without activation-quantization
    noise (token_embd stays Q8_0: its lookup is exact on both sides)."""
    import gguf
    from gguf.quants import dequantize
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, r.fields["general.architecture"].contents())
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, field.contents(), vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(key, field.contents(), vtype)
    for t in r.tensors:
        if t.name == "token_embd.weight":
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
        else:
            w.add_tensor(t.name, dequantize(t.data, t.tensor_type).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def run_gemma(path: str, text_path: str, threads: int, expect_sha: str | None) -> dict:
    """The real Gemma 3 270M Q4_K_M: llama.cpp's tokenization of the start of `text_path`
    (BOS added as the file asks), truncated to GEMMA_PROMPT_TOKENS ids, evaluated in one
    batch; top GEMMA_TOP_K logits of the last position, then GEMMA_GREEDY greedy tokens with
    each step's top logits. pdmesh's test feeds the recorded ids (its tokenizer does not do
    SentencePiece yet)."""
    sha = sha256_file(path)
    if expect_sha and sha != expect_sha:
        sys.exit(f"make_arch_golden: {path} has sha256 {sha}, expected {expect_sha}")
    n_ctx = GEMMA_PROMPT_TOKENS + GEMMA_GREEDY + 8
    llm = Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                n_threads=threads, n_threads_batch=threads, logits_all=False, verbose=False)
    with open(text_path, "rb") as f:
        text = f.read()
    prompt = [int(t) for t in llm.tokenize(text, add_bos=True, special=False)]
    prompt = prompt[:GEMMA_PROMPT_TOKENS]
    n_vocab = llm.n_vocab()

    def last_logits() -> np.ndarray:
        ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(n_vocab,)).astype(np.float32, copy=True)

    llm.reset()
    llm.eval(prompt)
    logits = last_logits()
    ids = np.arange(n_vocab)
    order = np.lexsort((ids, -logits.astype(np.float64)))[:GEMMA_TOP_K]
    first_top = [[int(i), float(logits[i])] for i in order]
    greedy, greedy_top = [], []
    for _ in range(GEMMA_GREEDY):
        tok = int(np.argmax(logits))
        greedy.append(tok)
        llm.eval([tok])
        logits = last_logits()
        order = np.lexsort((ids, -logits.astype(np.float64)))[:GEMMA_TOP_K]
        greedy_top.append([[int(i), float(logits[i])] for i in order])
    del llm
    return {"model_sha256": sha, "text": text_path, "n_vocab": n_vocab, "prompt": prompt,
            "first_top": first_top, "greedy": greedy, "greedy_top": greedy_top}


def run_gemma_doc(path: str, text_path: str, threads: int) -> dict:
    """The real Gemma 3 270M on a GEMMA_DOC_TOKENS-token document (llama.cpp's tokenization
    of `text_path`, BOS first): every token's negative log-likelihood from llama.cpp's
    logits of all positions, evaluated in one batch, and the document's perplexity."""
    n_ctx = GEMMA_DOC_TOKENS + 8
    llm = Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                n_threads=threads, n_threads_batch=threads, logits_all=True, verbose=False)
    with open(text_path, "rb") as f:
        text = f.read()
    doc = [int(t) for t in llm.tokenize(text, add_bos=True, special=False)][:GEMMA_DOC_TOKENS]
    if len(doc) < GEMMA_DOC_TOKENS:
        sys.exit(f"make_arch_golden: {text_path} has only {len(doc)} tokens")
    llm.reset()
    llm.eval(doc)
    nll = token_nll(np.array(llm.scores[:len(doc)], dtype=np.float32), doc)
    del llm
    return {"model_sha256": sha256_file(path), "text": text_path, "tokens": doc,
            "nll": [round(x, 6) for x in nll], "ppl": float(np.exp(np.mean(nll)))}


def to_json(obj, indent: int = 0) -> str:
    """JSON with one line per innermost record: lists without dicts and at most two levels
    deep (a prompt, one position's top-k) on one line, everything else one item per line."""
    def depth(o) -> int:
        if isinstance(o, list):
            return 1 + max((depth(x) for x in o), default=0)
        return 100 if isinstance(o, dict) else 0
    pad, inner = " " * indent, " " * (indent + 1)
    if isinstance(obj, dict):
        items = [f"{inner}{json.dumps(k)}: {to_json(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, list) and depth(obj) > 2:
        return "[\n" + ",\n".join(inner + to_json(x, indent + 1) for x in obj) + "\n" + pad + "]"
    return json.dumps(obj)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pdmesh", default="build/bin/pdmesh")
    ap.add_argument("--out", default="tests/golden/arch_golden.json")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--arch", action="append", help="only these (default: all)")
    ap.add_argument("--gemma", help="also record the real Gemma 3 270M Q4_K_M at this path "
                    "(sha256 checked) under 'gemma3_270m'")
    ap.add_argument("--gemma-f32", help="where to write the F32-layer copy of the Gemma "
                    "model (default: next to it, gemma-3-270m-f32layers.gguf)")
    ap.add_argument("--gemma-text", default="docs/prefill.md",
                    help="text whose first tokens are the Gemma prompt (the ids are recorded)")
    args = ap.parse_args()
    bufts_off = disable_extra_bufts()
    result = {
        "generator": "tests/golden/make_arch_golden.py",
        "llama_cpp_python": llama_cpp.__version__,
        "extra_bufts_off": bufts_off,
        "prompt_len": PROMPT_LEN,
        "n_greedy": N_GREEDY,
        "top_k": TOP_K,
        "archs": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.arch or ARCHS:
            print(f"make_arch_golden: {arch}", file=sys.stderr)
            result["archs"][arch] = run_arch(args.pdmesh, arch, args.threads, tmp)
    if args.gemma:
        print("make_arch_golden: gemma3 270M", file=sys.stderr)
        result["gemma3_270m"] = run_gemma(args.gemma, args.gemma_text, args.threads,
                                          GEMMA_SHA256)
        print("make_arch_golden: gemma3 270M, %d-token document" % GEMMA_DOC_TOKENS,
              file=sys.stderr)
        result["gemma3_270m_doc"] = run_gemma_doc(args.gemma, args.gemma_text, args.threads)
        f32 = args.gemma_f32 or os.path.join(os.path.dirname(args.gemma),
                                             "gemma-3-270m-f32layers.gguf")
        print(f"make_arch_golden: gemma3 270M with F32 layers ({f32})", file=sys.stderr)
        write_f32_layers(args.gemma, f32)
        result["gemma3_270m_f32layers"] = run_gemma(f32, args.gemma_text, args.threads, None)
    with open(args.out, "w") as f:
        f.write(to_json(result) + "\n")


if __name__ == "__main__":
    main()
