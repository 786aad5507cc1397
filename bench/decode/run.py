#!/usr/bin/env python3
"""bench/decode: batched decode throughput of pdm_decode_step, beside llama.cpp.

Runs bench/decode/decode_bench (real model; one sequence prefilled with C random tokens, its
KV copied to the B-1 others; K timed batched steps per B; the single-sequence reference is
pdm_model_decode) and, when a Python with llama-cpp-python is available,
bench/decode/llama_decode.py on the same grid (several sequences in one llama_decode batch,
one KV stream per sequence). Writes docs/perf/decode.json, docs/perf/decode.md and (with
gnuplot) docs/perf/decode.png.

Environment:
  DECODE_BENCH   the binary (default: built here with make into $BUILD, default build-bench)
  PDMESH_MODEL   the model (default models/SmolLM2-135M-Instruct.Q4_1.gguf)
  LLAMA_PYTHON   Python with llama_cpp (default $BUILD/venv/bin/python, then build/venv);
                 none found -> the llama.cpp columns are empty
  BENCH_QUICK=1  (or --quick) short run: C 512, B 1,4,16, 4 steps
  BENCH_BATCHES, BENCH_CONTEXTS, BENCH_THREADS (default 1,4,16,64 / 512,4096 / 1,2),
  BENCH_STEPS (default 32), BENCH_WARMUP (default 3), BENCH_OUT (default docs/perf)
"""
import json
import os
import platform
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("BUILD", "build-bench")
QUICK = os.environ.get("BENCH_QUICK") == "1" or "--quick" in sys.argv
MODEL = os.environ.get("PDMESH_MODEL",
                       os.path.join(ROOT, "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
BATCHES = os.environ.get("BENCH_BATCHES", "1,4,16" if QUICK else "1,4,16,64")
CONTEXTS = os.environ.get("BENCH_CONTEXTS", "512" if QUICK else "512,4096")
THREADS = os.environ.get("BENCH_THREADS", "1,2")
STEPS = os.environ.get("BENCH_STEPS", "4" if QUICK else "32")
WARMUP = os.environ.get("BENCH_WARMUP", "1" if QUICK else "3")
OUT = os.environ.get("BENCH_OUT", os.path.join(ROOT, "docs/perf"))


def binary():
    b = os.environ.get("DECODE_BENCH")
    if b:
        return b
    target = os.path.join(BUILD, "bin/decode_bench")
    subprocess.run(["make", "--no-print-directory", "-C", ROOT, "-f", "Makefile", "-f",
                    "bench/decode/build.mk", "BUILD=" + BUILD, target], check=True,
                   stdout=sys.stderr)
    return os.path.join(ROOT, target)


def llama_python():
    cands = [os.environ.get("LLAMA_PYTHON"), os.path.join(ROOT, BUILD, "venv/bin/python"),
             os.path.join(ROOT, "build/venv/bin/python")]
    for c in cands:
        if c and os.path.exists(c) and subprocess.run(
                [c, "-c", "import llama_cpp"], capture_output=True).returncode == 0:
            return c
    return None


def lines_json(out):
    return [json.loads(l) for l in out.splitlines() if l.startswith("{")]


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
            "load": os.getloadavg()[0], "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def main():
    bench = binary()
    os.makedirs(OUT, exist_ok=True)
    grid = ["--batches", BATCHES, "--contexts", CONTEXTS, "--threads", THREADS,
            "--steps", STEPS, "--warmup", WARMUP]
    res = {"machine": machine(), "quick": QUICK, "model": os.path.basename(MODEL),
           "steps": int(STEPS), "warmup": int(WARMUP), "pdmesh": [], "llama_cpp": [],
           "llama_cpp_note": None}
    cmd = [bench, "--model", MODEL, "--breakdown"] + grid
    sys.stderr.write("%s\n" % " ".join(cmd))
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=7200)
    sys.stderr.write(p.stderr)
    if p.returncode != 0:
        sys.exit("decode_bench failed")
    res["pdmesh"] = lines_json(p.stdout)
    py = llama_python()
    if py:
        cmd = [py, os.path.join(ROOT, "bench/decode/llama_decode.py"), "--model", MODEL] + grid
        sys.stderr.write("%s\n" % " ".join(cmd))
        q = subprocess.run(cmd, capture_output=True, text=True, timeout=7200)
        sys.stderr.write(q.stderr)
        if q.returncode == 0:
            res["llama_cpp"] = lines_json(q.stdout)
        else:
            res["llama_cpp_note"] = "llama_decode.py failed: " + q.stderr.strip()[-500:]
    else:
        res["llama_cpp_note"] = ("no Python with llama_cpp (tools/deps.sh VENV --golden, or "
                                 "LLAMA_PYTHON)")
    with open(os.path.join(OUT, "decode.json"), "w") as f:
        json.dump(res, f, indent=1)
    write_markdown(res)
    plot(res)


def f3(x, scale=1.0):
    return "-" if x is None else "%.1f" % (x * scale)


def r2(x):
    return "-" if x is None else "%.2f" % x


def write_markdown(res):
    m = res["machine"]
    single = {(r["threads"], r["context"]): r for r in res["pdmesh"] if r["kind"] == "single"}
    batched = [r for r in res["pdmesh"] if r["kind"] == "batched"]
    llama = {(r["threads"], r["context"], r["batch"]): r for r in res["llama_cpp"]}
    lines = [
        "# Batched decode throughput", "",
        "Generated by bench/decode/run.py%s on %s (%s cores, load %.1f at start), %s. Model %s, "
        "f16 KV cache. Each of B sequences has its own KV cache holding C tokens: one sequence "
        "is prefilled with C random tokens and its KV is copied to the others (a memcpy, not "
        "B prefills). A step decodes one token of every sequence (`pdm_decode_step`: batched "
        "projections and FFN, attention per sequence against its own cache, logits of every "
        "sequence). %d timed steps after %d warm-up steps per point; tokens/s = B x steps / "
        "time; step latency is the median." % (
            " (quick run: few steps, noisy)" if res["quick"] else "", m["cpu"], m["cores"],
            m["load"], m["date"], res["model"], res["steps"], res["warmup"]), "",
        "- **single**: `pdm_model_decode` of one sequence at context C (the unbatched engine); "
        "**x single** = batched tokens/s / single tokens/s.",
        "- **llama.cpp**: llama-cpp-python %s, B sequences in one `llama_decode` batch "
        "(llama_batch with one seq_id per token, n_seq_max = max B, kv_unified = false: one KV "
        "stream per sequence; prefix copied with llama_memory_seq_cp), same model file, same "
        "threads. **pdmesh / llama.cpp** compares tokens/s." % (
            res["llama_cpp"][0]["llama_cpp_python"] if res["llama_cpp"] else "(not run)"),
        "", "| threads | C | B | pdmesh tok/s | step ms | single tok/s | x single | "
        "llama.cpp tok/s | llama.cpp step ms | pdmesh / llama.cpp |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    for r in batched:
        s = single.get((r["threads"], r["context"]))
        l = llama.get((r["threads"], r["context"], r["batch"]))
        lines.append("| %d | %d | %d | %s | %s | %s | %s | %s | %s | %s |" % (
            r["threads"], r["context"], r["batch"], f3(r["tokens_per_s"]),
            f3(r["step_median_s"], 1e3), f3(s and s["tokens_per_s"]),
            r2(s and r["tokens_per_s"] / s["tokens_per_s"]), f3(l and l["tokens_per_s"]),
            f3(l and l["step_median_s"], 1e3),
            r2(l and r["tokens_per_s"] / l["tokens_per_s"])))
    if res.get("llama_cpp_note"):
        lines += ["", "llama.cpp: %s" % res["llama_cpp_note"]]
    if any("phases_s" in r for r in batched):
        names = list(batched[0]["phases_s"].keys())
        lines += ["", "Where a step's time goes (ms per step, measured separately with a copy of "
                  "decode_node/step.c's loop timed per phase; attn_in, attn_out_ffn are batched "
                  "over B, kv_store_attention and logits run once per sequence):", "",
                  "| threads | C | B | " + " | ".join(names) + " | total |",
                  "|---|---|---|" + "---|" * (len(names) + 1)]
        for r in batched:
            ph = r.get("phases_s", {})
            lines.append("| %d | %d | %d | %s | %s |" % (
                r["threads"], r["context"], r["batch"],
                " | ".join(f3(ph.get(n), 1e3) for n in names), f3(r.get("phases_total_s"), 1e3)))
    with open(os.path.join(OUT, "decode.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def plot(res):
    if not shutil.which("gnuplot"):
        sys.stderr.write("gnuplot not found: no PNG\n")
        return
    data = os.path.join(OUT, "decode.dat")
    series = []
    with open(data, "w") as f:
        for src, rows in [("pdmesh", [r for r in res["pdmesh"] if r["kind"] == "batched"]),
                          ("llama.cpp", res["llama_cpp"])]:
            for key in sorted({(r["threads"], r["context"]) for r in rows}):
                f.write("# %s t%d C%d\n" % (src, key[0], key[1]))
                for r in rows:
                    if (r["threads"], r["context"]) == key:
                        f.write("%d %g\n" % (r["batch"], r["tokens_per_s"]))
                f.write("\n\n")
                series.append("%s %dT C=%d" % (src, key[0], key[1]))
    if not series:
        os.unlink(data)
        return
    script = ("set terminal pngcairo noenhanced size 900,500; set output '%s';"
              "set logscale xy 2; set xlabel 'sequences per step (B)'; set ylabel 'tokens/s';"
              "set key left top; set title 'Batched decode, SmolLM2-135M Q4_1';"
              % os.path.join(OUT, "decode.png"))
    script += "plot " + ", ".join("'%s' index %d using 1:2 with linespoints title '%s'" % (
        data, i, s) for i, s in enumerate(series))
    subprocess.run(["gnuplot", "-e", script], check=False)
    os.unlink(data)


if __name__ == "__main__":
    main()
