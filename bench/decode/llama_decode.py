#!/usr/bin/env python3
"""bench/decode/llama_decode.py: llama.cpp batched decode on the same grid as decode_bench.

Runs under the Python that has llama-cpp-python (tools/deps.sh VENV --golden installs it).
Low-level API: one context per context length C with n_seq_max = max(B) and a non-unified KV
cache (kv_unified = false: one KV stream per sequence, so each sequence attends only over its
own cells, as on pdmesh's decode node). Sequence 0 is prefilled with C random tokens and
copied to the others with llama_memory_seq_cp (across streams this copies the whole stream's
buffer: every sequence gets its own C tokens of KV, as in decode_bench). Then for each thread
count and each B: W warm-up and K timed llama_decode calls of one llama_batch holding one
token of each of the first B sequences (logits requested for all), llama_synchronize after
each; generated tokens are removed (llama_memory_seq_rm) before the next B.

Prints one JSON object per (threads, C, B) on stdout.
"""
import argparse
import ctypes
import json
import random
import statistics
import sys
import time

import llama_cpp as L


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _quiet(level, text, user):
    pass


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", default="1")
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--contexts", default="512,4096")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args()
    threads = [int(x) for x in a.threads.split(",")]
    batches = [int(x) for x in a.batches.split(",")]
    contexts = [int(x) for x in a.contexts.split(",")]
    max_b = max(batches)
    rnd = random.Random(a.seed)

    L.llama_log_set(_quiet, None)
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    model = L.llama_model_load_from_file(a.model.encode(), mp)
    if not model:
        sys.exit("llama_decode: cannot load %s" % a.model)
    vocab = L.llama_model_get_vocab(model)
    n_vocab = L.llama_vocab_n_tokens(vocab)
    extra = a.warmup + a.steps + 1

    for C in contexts:
        per_seq = (C + extra + 255) // 256 * 256
        cp = L.llama_context_default_params()
        cp.n_ctx = per_seq * max_b
        cp.n_seq_max = max_b
        cp.kv_unified = False
        cp.n_batch = 512
        cp.n_ubatch = 512
        cp.n_threads = cp.n_threads_batch = max(threads)
        ctx = L.llama_init_from_model(model, cp)
        if not ctx:
            sys.exit("llama_decode: cannot create a context of %d x %d tokens" % (max_b, per_seq))
        mem = L.llama_get_memory(ctx)
        batch = L.llama_batch_init(max(512, max_b), 0, 1)

        def decode(items):
            """items: (token, pos, seq, want_logits)"""
            for i, (tok, pos, seq, out) in enumerate(items):
                batch.token[i] = tok
                batch.pos[i] = pos
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = 1 if out else 0
            batch.n_tokens = len(items)
            rc = L.llama_decode(ctx, batch)
            if rc != 0:
                sys.exit("llama_decode: llama_decode returned %d" % rc)
            L.llama_synchronize(ctx)

        t0 = time.perf_counter()
        prompt = [rnd.randrange(n_vocab) for _ in range(C)]
        for s0 in range(0, C, 512):
            chunk = prompt[s0:s0 + 512]
            decode([(t, s0 + i, 0, s0 + i == C - 1) for i, t in enumerate(chunk)])
        prefill_s = time.perf_counter() - t0
        for s in range(1, max_b):
            L.llama_memory_seq_cp(mem, 0, s, -1, -1)
        for s in range(max_b):
            if L.llama_memory_seq_pos_max(mem, s) != C - 1:
                sys.exit("llama_decode: sequence %d holds positions up to %d after the copy, "
                         "not %d" % (s, L.llama_memory_seq_pos_max(mem, s), C - 1))
        sys.stderr.write("llama_decode: context %d prefilled in %.2f s, copied to %d sequences\n"
                         % (C, prefill_s, max_b - 1))

        for T in threads:
            L.llama_set_n_threads(ctx, T, T)
            for B in batches:
                lat = []
                n = C
                for step in range(a.warmup + a.steps):
                    items = [(rnd.randrange(n_vocab), n, s, True) for s in range(B)]
                    t = time.perf_counter()
                    decode(items)
                    if step >= a.warmup:
                        lat.append(time.perf_counter() - t)
                    n += 1
                for s in range(B):
                    L.llama_memory_seq_rm(mem, s, C, -1)
                total = sum(lat)
                print(json.dumps({
                    "kind": "llama.cpp", "threads": T, "context": C, "batch": B,
                    "steps": a.steps, "step_median_s": statistics.median(lat),
                    "step_mean_s": total / a.steps, "tokens_per_s": B * a.steps / total,
                    "prefill_s": prefill_s, "kv_unified": False,
                    "flash_attn_type": int(cp.flash_attn_type),
                    "llama_cpp_python": L.__version__}), flush=True)
        L.llama_batch_free(batch)
        L.llama_free(ctx)
    L.llama_model_free(model)


if __name__ == "__main__":
    main()
