#!/bin/sh
# Kernel-level speeds behind docs/perf/kquant.md: every weight type with a SIMD path on every
# variant this CPU runs (and the scalar reference, which is what x86 used for the K-quants,
# Q5_0/Q5_1, IQ4_NL/IQ4_XS before), matrix-vector (8192 x 2048, from DRAM) and matrix-matrix
# (2048 x 2048 x 128 tokens, 32-row chunks). One JSON line per run.
#   bench/kquant/kernels.sh [VARIANTS]     (default: "avx512 avx2 generic")
set -eu
variants=${1:-avx512 avx2 generic}
for v in $variants; do
    for t in q4_k q6_k q5_k iq4_xs q5_0 q5_1 iq4_nl q4_0 q4_1 q8_0; do
        if [ "$v" = generic ]; then it1=20 it2=2; else it1=200 it2=20; fi
        build/bin/pdm-matmul-bench --type $t --rows 8192 --cols 2048 --tokens 1 --kernels $v --iters $it1
        build/bin/pdm-matmul-bench --type $t --rows 2048 --cols 2048 --tokens 128 --kernels $v --iters $it2
    done
done
