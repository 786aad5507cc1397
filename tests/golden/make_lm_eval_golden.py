#!/usr/bin/env python3
"""llama.cpp's loglikelihoods of the lm-eval task shipped in tests/lm_eval/tiny_facts.jsonl
(tests/golden/lm_eval_golden.json), so tests/integration/test_lm_eval.py can compare the mesh
with llama.cpp without llama-cpp-python installed (CI has lm-eval, not llama.cpp).

For every question and choice it forms the pair lm-eval's multiple_choice task sends
(context = the question, continuation = " " + choice: target_delimiter " "), splits it into
token ids as lm-eval's TemplateLM._encode_pair does (the whole text tokenized, cut at the
context's length; no BOS: SmolLM2 adds none), and records llama.cpp's sum of the
continuation tokens' log-probabilities (llamaref.token_logprobs: one batch, logits_all, f64
log-softmax, extra buffer types off), with the sha256 of the model it used.

Usage:
    build/venv/bin/python tests/golden/make_lm_eval_golden.py \\
        --model models/SmolLM2-135M-Instruct.Q4_1.gguf --out tests/golden/lm_eval_golden.json
"""
import argparse
import json
import os
import sys

import llama_cpp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from llamaref import sha256_file, token_logprobs  # noqa: E402

DATA = os.path.join(HERE, "..", "lm_eval", "tiny_facts.jsonl")


def encode_pair(llm, context, continuation):
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]

    def tok(text):
        return [int(t) for t in llm.tokenize(text.encode(), add_bos=False, special=False)]
    return tok(context + continuation), len(tok(context))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--out", default="tests/golden/lm_eval_golden.json")
    args = ap.parse_args()
    vocab = llama_cpp.Llama(model_path=args.model, vocab_only=True, verbose=False)
    pairs = []
    for line in open(DATA):
        doc = json.loads(line)
        for choice in doc["choices"]:
            whole, n_ctx = encode_pair(vocab, doc["question"], " " + choice)
            lp = token_logprobs(args.model, whole, n_ctx=256)
            pairs.append({"context": doc["question"], "continuation": " " + choice,
                          "tokens": whole, "n_ctx": n_ctx, "loglikelihood": float(sum(lp[n_ctx:]))})
    out = {"generator": "tests/golden/make_lm_eval_golden.py",
           "llama_cpp_python": llama_cpp.__version__,
           "model": os.path.basename(args.model), "model_sha256": sha256_file(args.model),
           "data": "tests/lm_eval/tiny_facts.jsonl", "pairs": pairs}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print("make_lm_eval_golden: %d pairs -> %s" % (len(pairs), args.out))


if __name__ == "__main__":
    main()
