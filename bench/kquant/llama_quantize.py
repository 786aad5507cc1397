#!/usr/bin/env python3
"""Quantizes a GGUF with llama.cpp's own quantizer (llama-cpp-python's llama_model_quantize,
default parameters: the tensor type mix llama-quantize gives the ftype).

    build/venv/bin/python bench/kquant/llama_quantize.py IN.gguf OUT.gguf Q4_K_M|Q8_0|...
"""
import ctypes
import sys

import llama_cpp


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    src, dst, ftype = sys.argv[1:]
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + ftype.upper())
    p.nthread = 2
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(p))
    if rc != 0:
        sys.exit(f"llama_model_quantize({ftype}) failed: {rc}")


if __name__ == "__main__":
    main()
