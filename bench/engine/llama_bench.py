#!/usr/bin/env python3
"""llama.cpp's side of the engine benchmark (through llama-cpp-python).

Same protocol as pdm-engine-bench: for each repetition a cleared context (f16 KV cache,
n_batch = n_ubatch = 512, flash attention off: llama-cpp-python's defaults), prefill of the
same pseudo-random token ids (time of Llama.eval over the prompt), then D single-token eval
calls at context P. Prints one JSON object on stdout; peak RSS is the Python process's
(interpreter included).
"""
import argparse
import json
import resource
import statistics
import sys
import time

import llama_cpp


def prompt_tokens(n, n_vocab):
    """The pdmesh bench's sequence: an LCG, ids in [100, n_vocab)."""
    s = 0x9E3779B97F4A7C15
    out = []
    for _ in range(n):
        s = (s * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF
        out.append(100 + (s >> 33) % (n_vocab - 100))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=0)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    llm = llama_cpp.Llama(model_path=args.model, n_ctx=args.prompt + args.decode + 16,
                          n_batch=512, n_ubatch=512, n_threads=args.threads,
                          n_threads_batch=args.threads, verbose=False)
    toks = prompt_tokens(args.prompt, llm.n_vocab())
    pf, dc = [], []
    for _ in range(args.reps):
        # reset() only rewinds the token count; clear the KV cache itself so that every
        # repetition starts from an empty cache like pdmesh's fresh one
        llm.reset()
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm._ctx.ctx), True)
        t0 = time.perf_counter()
        llm.eval(toks)
        t1 = time.perf_counter()
        pf.append(args.prompt / (t1 - t0))
        nxt = toks[-1]
        for i in range(args.decode):
            llm.eval([nxt])
            nxt = toks[i % len(toks)]
        t2 = time.perf_counter()
        dc.append(args.decode / (t2 - t1) if args.decode else 0.0)
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    print(json.dumps({
        "engine": "llama.cpp", "version": llama_cpp.__version__, "threads": args.threads,
        "prompt": args.prompt, "decode": args.decode, "batch": 512,
        "prefill_samples": pf, "decode_samples": dc,
        "prefill_tok_s": statistics.median(pf),
        "decode_tok_s": statistics.median(dc) if args.decode else 0.0,
        "peak_rss_mb": rss_mb}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
