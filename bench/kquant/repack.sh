#!/bin/sh
# Repacked (--repack 1, the loader's default) against file-layout (--repack 0) kernels for the
# types the loader repacks, alternating run by run so both see the same machine state:
# matrix-vector 8192 x 2048 from DRAM, matrix-matrix 2048 x 2048 and 2048 x 8192 (the FFN
# down projection's row length) x 128 tokens in the engine's 32-row chunks; one thread.
# One JSON line per run with the 1-minute load average.
#   bench/kquant/repack.sh [ROUNDS] [VARIANTS]     (defaults: 3, "avx512 avx2")
set -eu
rounds=${1:-3} variants=${2:-avx512 avx2}
for r in $(seq "$rounds"); do
    for v in $variants; do
        for t in ${TYPES:-q4_k q6_k q8_0 q5_0}; do
            for shape in "8192 2048 1 200" "2048 2048 128 20" "2048 8192 128 10"; do
                set -- $shape
                for p in 0 1; do
                    echo "{\"round\": $r, \"load\": $(cut -d' ' -f1 /proc/loadavg), \"run\": $(build/bin/pdm-matmul-bench \
                        --type $t --rows $1 --cols $2 --tokens $3 --iters $4 --kernels $v --repack $p)}"
                done
            done
        done
    done
done
