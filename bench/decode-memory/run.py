#!/usr/bin/env python3
"""bench/decode-memory/run.py - head-wise KV offload against all-resident KV.

Runs build/bin/offload_bench (make bench-decode-memory builds it) and writes
docs/perf/decode-memory-offload.{json,md} (+ .png when gnuplot is installed):

  - decode time per token at contexts 4K, 32K and 128K, all resident versus head-wise offload
    with a fast budget of exactly one head group's ping-pong buffer (goal: <= 1.2x at 32K+);
  - with OFFLOAD_GROUPS=1,2,3 also every group size (how the policy's thresholds were chosen);
  - the longest context each placement serves within a fixed fast budget (HeadInfer Table 3).

Environment: OFFLOAD_BENCH (binary), PDMESH_MODEL, OFFLOAD_CONTEXTS (default
4096,32768,131072), OFFLOAD_GROUPS (default 0 = the policy), OFFLOAD_THREADS (1),
OFFLOAD_SLOW (ram or file:DIR), OFFLOAD_BUDGET (bytes for the table, default 256 MiB),
OFFLOAD_KV_DTYPE (f16, default, or q8: int8 rows with per-head scales; output
docs/perf/decode-memory-offload-q8.*),
PDM_BENCH_QUICK=1 (fewer steps, one run), OFFLOAD_REPEAT (runs per context, default 3), OFFLOAD_OUT (output path without extension),
PDM_BENCH_LABEL (a note on the machine, e.g.
"noisy, shared machine").
"""
import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("OFFLOAD_BENCH", os.path.join(ROOT, "build/bin/offload_bench"))
MODEL = os.environ.get("PDMESH_MODEL", os.path.join(ROOT, "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
CONTEXTS = [int(x) for x in os.environ.get("OFFLOAD_CONTEXTS", "4096,32768,131072").split(",")]
GROUPS = os.environ.get("OFFLOAD_GROUPS", "0")
THREADS = os.environ.get("OFFLOAD_THREADS", "1")
SLOW = os.environ.get("OFFLOAD_SLOW", "ram")
BUDGET = os.environ.get("OFFLOAD_BUDGET", str(256 << 20))
QUICK = os.environ.get("PDM_BENCH_QUICK") == "1"
REPEAT = int(os.environ.get("OFFLOAD_REPEAT", "1" if QUICK else "3"))
LABEL = os.environ.get("PDM_BENCH_LABEL", "")
KV_DTYPE = os.environ.get("OFFLOAD_KV_DTYPE", "f16")
OUT = os.path.join(ROOT, os.environ.get(
    "OFFLOAD_OUT", "docs/perf/decode-memory-offload" + ("-q8" if KV_DTYPE == "q8" else "")))


def steps_for(ctx):
    if ctx <= 8192:
        return 3 if QUICK else 9
    if ctx <= 65536:
        return 2 if QUICK else 5
    return 1 if QUICK else 3


def run(args):
    sys.stderr.write("+ " + " ".join(args) + "\n")
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return [json.loads(l) for l in out.splitlines() if l.startswith("{")]


def main():
    rows, table = [], []
    for i, ctx in enumerate(CONTEXTS):
        runs = {}
        for rep in range(REPEAT):
            got = run([BIN, "--model", MODEL, "--contexts", str(ctx), "--steps", str(steps_for(ctx)),
                       "--groups", GROUPS, "--threads", THREADS, "--slow", SLOW, "--budget", BUDGET,
                       "--kv-dtype", KV_DTYPE])
            for r in got:
                if r["kind"] == "decode":
                    runs.setdefault(r["group"], []).append(r)
                elif i == 0 and rep == 0:
                    table.append(r)
        # Each run times both placements back to back; the median run (by ratio) is reported
        # with the spread of the ratio over the runs (the machine's noise).
        for g, rs in sorted(runs.items()):
            rs.sort(key=lambda r: r["ratio"])
            med = dict(rs[len(rs) // 2])
            med["ratio_min"], med["ratio_max"], med["runs"] = rs[0]["ratio"], rs[-1]["ratio"], len(rs)
            rows.append(med)
    data = {"label": LABEL, "model": os.path.basename(MODEL), "threads": int(THREADS),
            "kv_dtype": KV_DTYPE, "loadavg_after": os.getloadavg(),
            "slow_tier": SLOW, "budget": int(BUDGET), "decode": rows, "max_context": table}
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT + ".json", "w") as f:
        json.dump(data, f, indent=1)
    report(data)


def report(data):
    """Markdown and PNG from the JSON (OFFLOAD_REPORT_ONLY=1 redoes them from the file)."""
    rows, table, LABEL, THREADS, SLOW = (data["decode"], data["max_context"], data["label"],
                                         data["threads"], data["slow_tier"])
    BUDGET = data.get("budget", 256 << 20)

    md = ["# Head-wise KV offload: decode time and longest context", ""]
    if LABEL:
        md += [f"**{LABEL}.**", ""]
    md += [f"Model {data['model']}, {data.get('kv_dtype', 'f16')} KV, {THREADS} compute thread(s) plus the copy worker, "
           f"slow tier `{SLOW}`. Fast budget for the offload runs: exactly one head group's "
           "ping-pong buffer (no resident heads). KV filled with synthetic values. "
           "Regenerate: `make bench-decode-memory` (see docs/decode-memory.md).", "",
           "Each context is run OFFLOAD_REPEAT times (both placements back to back in each run); the "
           "median run by ratio is shown with the ratio's range over the runs.", "",
           "| context | group | KV total MiB | fast MiB | resident ms/token | offload ms/token | ratio | ratio range | prefetch waits |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        md.append(f"| {r['context']} | {r['group']} | {r['kv_bytes'] / 2**20:.0f} | "
                  f"{r['fast_peak'] / 2**20:.1f} | {r['resident_s'] * 1e3:.1f} | "
                  f"{r['offload_s'] * 1e3:.1f} | {r['ratio']:.2f} | {r['ratio_min']:.2f}-{r['ratio_max']:.2f} "
                  f"({r['runs']}) | {r['prefetch_waits']} |")
    md += ["", f"Longest context within a fast budget of {int(BUDGET) / 2**20:.0f} MiB of KV "
           "(HeadInfer Table 3 analogue; from the plan, `verified` = the allocator placed the "
           "store at that context and refused it just above):", "",
           "| placement | max context | verified |", "|---|---:|---|"]
    for t in table:
        v = {1: "yes", 0: "NO", -1: "plan only"}[t["verified"]]
        md.append(f"| {t['placement']} | {t['max_context']} | {v} |")
    with open(OUT + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    sys.stderr.write(f"wrote {OUT}.json and {OUT}.md\n")

    if shutil.which("gnuplot") and rows:
        dat = OUT + ".dat"
        with open(dat, "w") as f:
            for r in rows:
                f.write(f"{r['context']} {r['group']} {r['resident_s'] * 1e3} {r['offload_s'] * 1e3}\n")
        script = (f"set terminal png size 800,480; set output '{OUT}.png'; set logscale x 2; "
                  "set xlabel 'context (tokens)'; set ylabel 'ms per token'; set key left top; "
                  "set offsets graph 0.03, graph 0.08, graph 0.12, 0; set yrange [0:*]; "
                  f"set title 'decode time: all resident vs head-wise offload {LABEL}'; "
                  f"plot '{dat}' using 1:3 with linespoints title 'all resident', "
                  f"'{dat}' using 1:4:(sprintf('G=%d', $2)) with labels offset 0,1 notitle, "
                  f"'{dat}' using 1:4 with linespoints title 'head-wise offload'")
        subprocess.run(["gnuplot", "-e", script], check=False)
        os.remove(dat)
    else:
        sys.stderr.write("gnuplot not found: no PNG\n")


if __name__ == "__main__":
    if os.environ.get("OFFLOAD_REPORT_ONLY") == "1":
        with open(OUT + ".json") as f:
            report(json.load(f))
    else:
        main()
