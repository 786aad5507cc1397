#!/usr/bin/env python3
"""Write llama.cpp's log-probabilities of a text as a KL-divergence base for pdmesh.

Runs llama.cpp through llama-cpp-python and evaluates the text exactly as
llama.cpp's `llama-perplexity` does (tools/perplexity/perplexity.cpp, perplexity()):

  * the whole text is tokenized once, with BOS in front when the vocabulary adds
    one, special tokens not parsed;
  * it is cut into chunks of --ctx tokens (at least two chunks of text needed);
  * every chunk is evaluated from an empty KV cache, its first token replaced by
    BOS when the vocabulary adds BOS;
  * the positions ctx/2 .. ctx-2 of each chunk are scored (they predict tokens
    ctx/2+1 .. ctx-1).

The output is llama-perplexity's own `--kl-divergence-base` file (cli/kldbase.h
describes it; `pdmesh perplexity --kl-divergence --kl-divergence-base OUT` and
`llama-perplexity --kl-divergence` both read it). With --summary, a small JSON
file records what was measured (versions, sha256 of model and text, perplexity
and its error, per-chunk perplexities) so the figures can be committed while the
base itself (about 98 KB per scored position) stays under build/.

Usage:
    python make_kld_base.py --model M --file TEXT --ctx N --chunks K --out F
                            [--summary F.json] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
import time

import numpy as np

import llama_cpp
from llama_cpp import Llama
from llamaref import disable_extra_bufts, sha256_file  # noqa: E402

LOGP_FLOOR = 16.0  # llama.cpp keeps log-probabilities within 16 nats of the top




def encode_record(logits: np.ndarray) -> tuple[bytes, float]:
    """One position as llama-perplexity's log_softmax(n_vocab, logits, uint16_t *, tok)
    writes it (float32 arithmetic, a double sum of expf, round to nearest even).
    Returns the record and the log-sum-exp (for the nll)."""
    x = logits.astype(np.float32, copy=False)
    max_logit = np.float32(x.max())
    min_logit = np.float32(max(np.float32(x.min()), np.float32(max_logit - np.float32(LOGP_FLOOR))))
    sum_exp = float(np.exp((x - max_logit).astype(np.float32), dtype=np.float32).astype(np.float64).sum())
    log_sum_exp = np.float32(math.log(sum_exp))
    min_log_prob = np.float32(np.float32(min_logit - max_logit) - log_sum_exp)
    scale = np.float32(np.float32(max_logit - min_logit) / np.float32(65535.0))
    n_vocab = x.shape[0]
    nv = 2 * ((n_vocab + 1) // 2)
    q = np.zeros(nv, dtype=np.uint16)
    if scale > 0:
        inv_scale = np.float32(np.float32(1.0) / scale)
        v = np.rint((inv_scale * (x - min_logit)).astype(np.float32))  # rint: ties to even
        q[:n_vocab] = np.where(x > min_logit, np.minimum(v, 65535), 0).astype(np.uint16)
    head = struct.pack("<ff", float(scale), float(min_log_prob))
    return head + q.tobytes(), float(max_logit) + float(log_sum_exp)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="GGUF model file")
    ap.add_argument("--file", required=True, help="text to evaluate (UTF-8)")
    ap.add_argument("--ctx", type=int, default=512, help="tokens per chunk (default 512)")
    ap.add_argument("--chunks", type=int, default=-1, help="chunks to evaluate (default: all)")
    ap.add_argument("--out", required=True, help="the base file to write")
    ap.add_argument("--summary", help="also write a small JSON summary here")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads (default 2)")
    args = ap.parse_args()
    n_ctx = args.ctx
    if n_ctx < 8:
        sys.exit("make_kld_base: --ctx must be at least 8")

    t_start = time.perf_counter()
    if disable_extra_bufts():
        print("make_kld_base: llama.cpp extra buffer types off (use_extra_bufts = False)",
              file=sys.stderr)
    else:
        print("make_kld_base: this llama-cpp-python has no use_extra_bufts; left as is",
              file=sys.stderr)
    llm = Llama(model_path=args.model, logits_all=True, n_ctx=n_ctx, n_batch=n_ctx,
                n_ubatch=n_ctx, n_threads=args.threads, n_threads_batch=args.threads,
                verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    n_vocab = llm.n_vocab()
    add_bos = bool(llama_cpp.llama_vocab_get_add_bos(vocab))
    bos = int(llama_cpp.llama_vocab_bos(vocab))

    with open(args.file, "rb") as f:
        text = f.read()
    tokens = [int(t) for t in llm.tokenize(text, add_bos=add_bos, special=False)]
    if len(tokens) < 2 * n_ctx:
        sys.exit(f"make_kld_base: {args.file} tokenizes to {len(tokens)} tokens; a context of "
                 f"{n_ctx} needs at least {2 * n_ctx}")
    n_chunk = len(tokens) // n_ctx
    if args.chunks > 0:
        n_chunk = min(n_chunk, args.chunks)
    first = n_ctx // 2
    scored = n_ctx - 1 - first

    nll = nll2 = 0.0
    count = 0
    per_chunk = []
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tmp = args.out + ".tmp"
    with open(tmp, "wb") as out:
        out.write(b"_logits_")
        out.write(struct.pack("<Iii", n_ctx, n_vocab, n_chunk))
        out.write(np.asarray(tokens[: n_chunk * n_ctx], dtype="<i4").tobytes())
        for k in range(n_chunk):
            chunk = tokens[k * n_ctx:(k + 1) * n_ctx]
            if add_bos:
                chunk[0] = bos
            # a cleared context, as llama_memory_clear(mem, true) before every chunk
            llm.reset()
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm.ctx), True)
            llm.eval(chunk)
            chunk_nll = 0.0
            for i in range(scored):
                pos = first + i
                rec, lse = encode_record(llm.scores[pos])
                out.write(rec)
                v = lse - float(llm.scores[pos][chunk[pos + 1]])
                chunk_nll += v
                nll2 += v * v
            nll += chunk_nll
            count += scored
            per_chunk.append({"ppl": math.exp(chunk_nll / scored),
                              "running_ppl": math.exp(nll / count)})
            print(f"[{k + 1}]{math.exp(nll / count):.4f},", end="", file=sys.stderr, flush=True)
    os.replace(tmp, args.out)
    mean = nll / count
    var = nll2 / count - mean * mean
    ppl = math.exp(mean)
    err = ppl * math.sqrt(var / (count - 1)) if var > 0 else 0.0
    print(f"\nFinal estimate: PPL = {ppl:.4f} +/- {err:.5f}", file=sys.stderr)
    summary = {
        "generator": "tests/golden/make_kld_base.py",
        "llama_cpp_python": llama_cpp.__version__,
        "model_file": os.path.basename(args.model),
        "model_sha256": sha256_file(args.model),
        "text_file": os.path.basename(args.file),
        "text_sha256": sha256_file(args.file),
        "n_ctx": n_ctx, "n_batch": n_ctx, "n_threads": args.threads,
        "add_bos": add_bos, "n_vocab": n_vocab,
        "tokens": len(tokens), "chunks": n_chunk, "scored": count,
        "ppl": ppl, "ppl_err": err, "per_chunk": per_chunk,
        "seconds": time.perf_counter() - t_start,
    }
    if args.summary:
        with open(args.summary, "w", encoding="utf-8") as f:
            f.write(json.dumps(summary, indent=1) + "\n")
    print(f"make_kld_base: {n_chunk} chunks of {n_ctx}, {count} positions -> {args.out} "
          f"({summary['seconds']:.1f}s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
