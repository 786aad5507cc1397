#!/usr/bin/env python3
"""Table of bench/kquant/run.sh's JSON lines: per (threads, file, engine) the median and the
best of the rounds for prefill 512 and decode 64, and the ratios pdmesh / llama.cpp and
Q4_K_M / Q4_1. Usage: summary.py RUN.jsonl [...]"""
import json
import statistics
import sys


def main():
    runs = {}
    loads = []
    for path in sys.argv[1:]:
        for line in open(path):
            d = json.loads(line)
            r = d["run"]
            loads.append(d["load"])
            key = (r["threads"], d["model"], d["what"], r["engine"])
            runs.setdefault(key, []).append(r["prefill_tok_s" if d["what"] == "prefill"
                                              else "decode_tok_s"])

    def cell(t, m, w, e):
        v = runs.get((t, m, w, e), [])
        return (statistics.median(v), max(v), len(v)) if v else (float("nan"),) * 2 + (0,)

    print("| threads | file | what | pdmesh tok/s median (best) | llama.cpp tok/s median (best) "
          "| pdmesh / llama.cpp median (best) | n |")
    print("|---|---|---|---|---|---|---|")
    for t in (1, 2):
        for m in ("q4_k_m", "q4_1"):
            for w in ("prefill", "decode"):
                p, l = cell(t, m, w, "pdmesh"), cell(t, m, w, "llama.cpp")
                print(f"| {t} | {m} | {w} | {p[0]:.1f} ({p[1]:.1f}) | {l[0]:.1f} ({l[1]:.1f}) "
                      f"| {p[0] / l[0]:.2f}x ({p[1] / l[1]:.2f}x) | {p[2]} |")
    print()
    print("| threads | what | pdmesh Q4_K_M / Q4_1 median (best) |")
    print("|---|---|---|")
    for t in (1, 2):
        for w in ("prefill", "decode"):
            k, q = cell(t, "q4_k_m", w, "pdmesh"), cell(t, "q4_1", w, "pdmesh")
            print(f"| {t} | {w} | {k[0] / q[0]:.2f}x ({k[1] / q[1]:.2f}x) |")
    print()
    print(f"1-minute load average before the runs: min {min(loads):.2f}, "
          f"median {statistics.median(loads):.2f}, max {max(loads):.2f} (2 cores)")


if __name__ == "__main__":
    main()
