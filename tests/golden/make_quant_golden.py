#!/usr/bin/env python3
"""Reference data for pdmesh's GGUF weight types, made by llama.cpp itself.

Steps (all deterministic):
  1. pdmesh writes a small random F32 model (`pdmesh make-test-model --wtype f32 ...`, fixed
     seed and shape: 1 layer, d_model 256, ffn 256, 4 heads / 1 KV head, the test models' BPE
     vocabulary of 339 tokens).  It is not committed: its sha256 is recorded, and the quant
     suite rebuilds it with the test model writer and checks that sha256, so the provenance
     of the quantized files stays reproducible.
  2. llama.cpp's own quantizer (llama_cpp.llama_model_quantize with
     llama_model_quantize_default_params()) converts it to each FTYPES mix and writes
     tests/golden/quant/<ftype>.gguf.  Together the mixes hold every weight type pdmesh
     added with the K-quants (q2_k q3_k q4_k q5_k q6_k q5_0 q5_1 iq4_nl iq4_xs).  These files
     are committed (200-350 KB each): the unit test loads exactly what llama.cpp wrote.
  3. For every quantized tensor, gguf-py's independent decoder (gguf.quants.dequantize)
     gives the sha256 of the whole tensor as little-endian f32 and the values of row 1 of the
     first tensor of each type.
  4. llama.cpp evaluates TOKENS on each file (Llama(logits_all=True, n_threads=2), CPU,
     use_extra_bufts=False so no repacked CPU kernels are used) and the script records, per
     position, the top TOP_K [id, logit] and the argmax.

Usage:
    build/venv/bin/python tests/golden/make_quant_golden.py [--pdmesh build/bin/pdmesh]
Writes tests/golden/quant/*.gguf and tests/golden/quant_golden.json.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

import gguf
from gguf.quants import dequantize
import llama_cpp
from llama_cpp import Llama

BASE_ARGS = ["--wtype", "f32", "--emb-type", "f32", "--layers", "1", "--d-model", "256",
             "--ffn", "256", "--heads", "4", "--kv-heads", "1", "--seed", "7"]
# llama.cpp mixes and the types each contributes (printed by the script when run).
FTYPES = ["Q2_K", "Q3_K_M", "Q4_K_M", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS"]
TEXT = b"The quick brown fox jumps over the lazy dog. A serving mesh"
TOP_K = 8
OUT_DIR = "tests/golden/quant"
OUT_JSON = "tests/golden/quant_golden.json"


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read())
    return h.hexdigest()


def quantize(src: str, dst: str, ftype: str) -> None:
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + ftype)
    p.allow_requantize = True
    p.nthread = 2
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(p))
    if rc != 0:
        sys.exit(f"llama_model_quantize({ftype}) failed: {rc}")


def tensor_records(path: str) -> list[dict]:
    """sha256 of every quantized tensor dequantized by gguf-py, row 1 of the first per type."""
    reader = gguf.GGUFReader(path)
    out, seen = [], set()
    for t in reader.tensors:
        if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            continue
        values = dequantize(t.data, t.tensor_type).astype("<f4")
        cols = int(t.shape[0])
        values = values.reshape(-1, cols)
        rec = {
            "name": t.name,
            "type": t.tensor_type.name.lower(),
            "ne": [int(x) for x in t.shape],
            "deq_sha256": hashlib.sha256(values.tobytes()).hexdigest(),
        }
        if rec["type"] not in seen:
            seen.add(rec["type"])
            rec["row"] = 1
            rec["values"] = [float(v) for v in values[1]]
        out.append(rec)
    return out


def logits_records(path: str, threads: int) -> tuple[list[int], list[dict]]:
    llm = Llama(model_path=path, logits_all=True, n_threads=threads, n_ctx=128, n_batch=64,
                use_extra_bufts=False, verbose=False, seed=1234)
    tokens = llm.tokenize(TEXT, add_bos=False, special=False)
    llm.eval(tokens)
    scores = np.array(llm.scores[: len(tokens)], dtype=np.float32)
    ids = np.arange(scores.shape[1])
    recs = []
    for pos, row in enumerate(scores):
        order = np.lexsort((ids, -row.astype(np.float64)))[:TOP_K]
        recs.append({"argmax": int(order[0]),
                     "top": [[int(i), float(row[i])] for i in order]})
    llm.close()
    return tokens, recs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pdmesh", default="build/bin/pdmesh")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    os.makedirs(OUT_DIR, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "base-f32.gguf")
        subprocess.run([args.pdmesh, "make-test-model", "--out", base] + BASE_ARGS, check=True)
        result = {
            "config": {
                "llama_cpp_python": llama_cpp.__version__,
                "base": {"pdmesh_make_test_model": BASE_ARGS, "sha256": sha256_file(base)},
                "text": TEXT.decode(),
                "n_threads": args.threads,
                "top_k": TOP_K,
            },
            "files": [],
        }
        tokens = None
        for ftype in FTYPES:
            path = os.path.join(OUT_DIR, ftype.lower() + ".gguf")
            quantize(base, path, ftype)
            toks, logits = logits_records(path, args.threads)
            if tokens is None:
                tokens = toks
            assert toks == tokens
            tensors = tensor_records(path)
            types = sorted({t["type"] for t in tensors})
            print(f"{ftype}: {os.path.getsize(path)} bytes, types {types}", file=sys.stderr)
            result["files"].append({
                "ftype": ftype,
                "path": path,
                "size": os.path.getsize(path),
                "sha256": sha256_file(path),
                "tensors": tensors,
                "logits": logits,
            })
        result["config"]["tokens"] = tokens
    with open(OUT_JSON, "w") as f:
        json.dump(result, f, indent=None, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {OUT_JSON} ({os.path.getsize(OUT_JSON)} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
