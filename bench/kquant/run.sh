#!/bin/sh
# Q4_K_M vs Q4_1, pdmesh vs llama.cpp, on a Llama-3.2-1B-shaped random model
# (docs/perf/kquant.md says how the files are made).
#   bench/kquant/run.sh DIR PYTHON [ROUNDS]
# DIR holds l1b-q4_k_m.gguf and l1b-q4_1.gguf; PYTHON has llama_cpp (build/venv/bin/python).
# Each round runs, per thread count and file, prefill of 512 tokens and 64 decode steps after
# a 1-token prompt, with pdm-engine-bench and then bench/engine/llama_bench.py (same token
# ids, same protocol), one fresh process each. One JSON line per run on stdout, with the
# 1-minute load average before it. Reports only: nothing passes or fails on timing.
set -eu
dir=$1 py=$2 rounds=${3:-3}
bench=build/bin/pdm-engine-bench
line() { # round model what engine json
    echo "{\"round\": $1, \"load\": $(cut -d' ' -f1 /proc/loadavg), \"model\": \"$2\", \"what\": \"$3\", \"run\": $4}"
}
for r in $(seq "$rounds"); do
    for t in 1 2; do
        for m in q4_k_m q4_1; do
            f=$dir/l1b-$m.gguf
            line "$r" "$m" prefill "$($bench --model "$f" --threads "$t" --prompt 512 --reps 1)"
            line "$r" "$m" prefill "$($py bench/engine/llama_bench.py --model "$f" --threads "$t" --prompt 512 --reps 1)"
            line "$r" "$m" decode "$($bench --model "$f" --threads "$t" --prompt 1 --decode 64 --reps 1)"
            line "$r" "$m" decode "$($py bench/engine/llama_bench.py --model "$f" --threads "$t" --prompt 1 --decode 64 --reps 1)"
        done
    done
done
