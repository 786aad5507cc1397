#!/usr/bin/env python3
"""bench/prefill: TTFT of every prefill method on groups of pdmesh-prefill processes.

Runs `pdmesh prefill-run --json` (real processes, UCX between them, one core per rank with
--pin) and reports, in one run:
  - TTFT per method for R = 1 and 2 ranks at each prompt length;
  - parallel efficiency TTFT(1) / (R * TTFT(R));
  - KVR-S over TSP and over CP pass-KV;
  - KV-Runahead's lower bound TTFT*(p) = TTFT(1)/2 * (1/p + 1/p^2) (eq. 2-3) beside the
    measured values;
  - pass-KV versus pass-Q as the miss rate T/(T+P) varies at fixed T+P, next to the paper's
    message-size threshold 2*NKV/NH (Eq. 1).
Writes docs/perf/prefill.json, docs/perf/prefill.md and (with gnuplot) docs/perf/prefill.png.

Environment: PDMESH (binary, default build/bin/pdmesh), PDMESH_MODEL, BENCH_LENGTHS
(default 1024,2048,4096,8192; BENCH_QUICK=1 -> 1024,2048), BENCH_REPS (default 3, quick 1).
"""
import json
import os
import platform
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PDMESH = os.environ.get("PDMESH", os.path.join(ROOT, "build/bin/pdmesh"))
MODEL = os.environ.get("PDMESH_MODEL", os.path.join(ROOT, "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
QUICK = os.environ.get("BENCH_QUICK") == "1"
LENGTHS = [int(x) for x in os.environ.get(
    "BENCH_LENGTHS", "1024,2048" if QUICK else "1024,2048,4096,8192").split(",")]
REPS = int(os.environ.get("BENCH_REPS", "1" if QUICK else "3"))
OUT = os.environ.get("BENCH_OUT", os.path.join(ROOT, "docs/perf"))
# T+P of the pass-KV / pass-Q sweep.
CROSS_TOTAL = int(os.environ.get("BENCH_CROSS_TOTAL", str(LENGTHS[-1] if QUICK else 4096)))
CTX = max(max(LENGTHS), CROSS_TOTAL) + 64
N_HEADS, N_KV_HEADS = 9, 3  # SmolLM2-135M; only used for the Eq. 1 threshold


def run(args):
    cmd = [PDMESH, "prefill-run", "--model", MODEL, "--pin", "--json", "--threads", "1",
           "--repeat", str(REPS), "--ctx", str(CTX)] + args
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if p.returncode != 0:
        sys.stderr.write("failed: %s\n%s" % (" ".join(cmd), p.stderr))
        return None
    return json.loads(p.stdout.strip().splitlines()[-1])


def machine():
    cpu = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def main():
    os.makedirs(OUT, exist_ok=True)
    table = os.path.join(OUT, "partition-table-r2.json")
    results = {"machine": machine(), "reps": REPS, "lengths": LENGTHS, "ttft": {}, "runs": []}
    # Calibration (achieved compute, link latency and bandwidth) for auto's pass-KV/pass-Q rule.
    calib = os.path.join(OUT, "calibration.json")
    c = subprocess.run([PDMESH, "calibrate", "--model", MODEL, "--pin", "--json", "--out", calib,
                        "--length", "1024"], capture_output=True, text=True, timeout=3600)
    if c.returncode == 0:
        results["calibration"] = json.loads(c.stdout.strip().splitlines()[-1])
    else:
        sys.stderr.write("calibrate failed: %s\n" % c.stderr)
        calib = None
    # KVR-S needs searched partitions: search them first (same run, same machine state).
    t0 = time.time()
    s = subprocess.run([PDMESH, "partition-search", "--model", MODEL, "--ranks", "2", "--pin",
                        "--lengths", ",".join(map(str, LENGTHS)), "--out", table,
                        # One run per candidate and a stride of n/16: the search costs about ten
                        # prefills per length (the table's final TTFTs come from the runs below).
                        "--reps", "1", "--min-stride", str(max(16, min(LENGTHS) // 16)),
                        "--ctx", str(CTX)],
                       capture_output=True, text=True, timeout=7200)
    sys.stderr.write(s.stdout + s.stderr)
    results["partition_search_seconds"] = time.time() - t0
    methods2 = ["tsp", "kvr-e", "kvr-s", "cp-kv", "cp-q"]
    for n in LENGTHS:
        # Alternate the methods in one pass per length so that drift hits them alike.
        single = run(["--ranks", "1", "--method", "single", "--random", str(n)])
        row = {"single": single and single["ttft"]}
        for m in methods2:
            extra = ["--table", table] if m == "kvr-s" else []
            r = run(["--ranks", "2", "--method", m, "--random", str(n)] + extra)
            row[m] = r and r["ttft"]
            if r:
                results["runs"].append(r)
        results["ttft"][str(n)] = row
        sys.stderr.write("%d tokens: %s\n" % (n, json.dumps(row)))
    # pass-KV vs pass-Q at fixed T+P.
    total = CROSS_TOTAL
    cross = []
    for miss in [1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125]:
        T = max(4, int(total * miss))
        P = total - T
        row = {"miss": T / total, "T": T, "P": P}
        if calib:  # what auto would choose (Alg. 1/5 with the calibration), without running
            plan = subprocess.run([PDMESH, "prefill-run", "--model", MODEL, "--ranks", "2",
                                   "--method", "auto", "--random", str(total), "--cached", str(P),
                                   "--calibration", calib, "--plan", "--json"],
                                  capture_output=True, text=True)
            if plan.returncode == 0:
                row["auto"] = json.loads(plan.stdout)["method"]
        for m in ["cp-kv", "cp-q"]:
            r = run(["--ranks", "2", "--method", m, "--random", str(total), "--cached", str(P)])
            row[m] = r and r["ttft"]
        cross.append(row)
        sys.stderr.write("miss %.3f: %s\n" % (T / total, json.dumps(row)))
    results["pass_kv_vs_pass_q"] = {"total": total, "rows": cross,
                                    "eq1_threshold": 2 * N_KV_HEADS / N_HEADS}
    with open(os.path.join(OUT, "prefill.json"), "w") as f:
        json.dump(results, f, indent=1)
    write_markdown(results)
    plot(results)


def fmt(x):
    return "-" if x is None else "%.3f" % x


def write_markdown(res):
    lines = ["# Prefill methods: TTFT on this machine", "",
             "Generated by `make bench-prefill` (bench/prefill/run.py) on %s, %s cores, %s. "
             "Random-token prompts, SmolLM2-135M Q4_1, one thread per rank, ranks pinned to "
             "cores, UCX between processes (transport as reported by UCX: see runs), median "
             "of %d runs. TTFT in seconds." % (res["machine"]["cpu"], res["machine"]["cores"],
                                               res["machine"]["date"], res["reps"]), "",
             "| tokens | single (R=1) | TSP | KVR-E | KVR-S | CP pass-KV | CP pass-Q | "
             "efficiency KVR-S | KVR-S / TSP | KVR-S / pass-KV | TTFT*(2) bound |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for n in res["lengths"]:
        r = res["ttft"][str(n)]
        one, kvs = r.get("single"), r.get("kvr-s")
        eff = one / (2 * kvs) if one and kvs else None
        sp_tsp = r["tsp"] / kvs if kvs and r.get("tsp") else None
        sp_cp = r["cp-kv"] / kvs if kvs and r.get("cp-kv") else None
        bound = one / 2 * (1 / 2 + 1 / 4) if one else None
        lines.append("| %d | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            n, fmt(one), fmt(r.get("tsp")), fmt(r.get("kvr-e")), fmt(kvs), fmt(r.get("cp-kv")),
            fmt(r.get("cp-q")), fmt(eff), fmt(sp_tsp), fmt(sp_cp), fmt(bound)))
    c = res["pass_kv_vs_pass_q"]
    lines += ["", "pass-KV versus pass-Q on 2 ranks at T+P = %d (partial prefill of T new "
              "tokens after P cached). Eq. 1 threshold 2*NKV/NH = %.3f." % (
                  c["total"], c["eq1_threshold"]), "",
              "| miss rate T/(T+P) | T | P | pass-KV | pass-Q | faster | auto's choice |",
              "|---|---|---|---|---|---|---|"]
    for row in c["rows"]:
        kv, q = row.get("cp-kv"), row.get("cp-q")
        faster = "-" if not (kv and q) else ("pass-KV" if kv <= q else "pass-Q")
        lines.append("| %.4f | %d | %d | %s | %s | %s | %s |" % (
            row["miss"], row["T"], row["P"], fmt(kv), fmt(q), faster, row.get("auto", "-")))
    cal = res.get("calibration")
    if cal:
        lines += ["", "Calibration (`pdmesh calibrate`): %.2f GFLOP/s per rank, link %s: latency "
                  "%.1f us, bandwidth %.2f GB/s." % (cal["flops"] / 1e9, cal["transports"],
                                                     cal["latency"] * 1e6, cal["bandwidth"] / 1e9)]
    with open(os.path.join(OUT, "prefill.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def plot(res):
    if not shutil.which("gnuplot"):
        sys.stderr.write("gnuplot not found: no PNG\n")
        return
    data = os.path.join(OUT, "prefill.dat")
    cols = ["single", "tsp", "kvr-e", "kvr-s", "cp-kv", "cp-q"]
    with open(data, "w") as f:
        for n in res["lengths"]:
            r = res["ttft"][str(n)]
            f.write("%d %s\n" % (n, " ".join("%g" % (r.get(c) or float("nan")) for c in cols)))
    script = ("set terminal pngcairo size 900,500; set output '%s';"
              "set logscale xy 2; set xlabel 'prompt tokens'; set ylabel 'TTFT (s)';"
              "set key left top; set title 'Prefill TTFT, R=2 ranks (single: R=1)';"
              % os.path.join(OUT, "prefill.png"))
    script += "plot " + ", ".join("'%s' using 1:%d with linespoints title '%s'" % (data, i + 2, c)
                                  for i, c in enumerate(cols))
    subprocess.run(["gnuplot", "-e", script], check=False)
    os.unlink(data)


if __name__ == "__main__":
    main()
