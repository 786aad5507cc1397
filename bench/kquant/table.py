#!/usr/bin/env python3
"""Issue 14's benchmark table: pdmesh against llama.cpp's own llama-bench, per model and thread
count, prefill and decode, in one run with the engines alternating.

    bench/kquant/table.py --pdm-bench build/bin/pdm-engine-bench --roofline build/bin/pdm-roofline
        --llama-bench DIR/llama-bench --model NAME=PATH [--model NAME=PATH ...]
        [--threads 1,2] [--prefill 512] [--depth 128] [--decode 32] [--reps 3] --out DIR
        [--name kquant-table]
    bench/kquant/table.py --from DIR/NAME.json --out DIR [--name NAME]   (tables + PNG again)

Per repetition, thread count, model and test, one fresh process each runs in turn: pdmesh
(pdm-engine-bench, weights repacked at load as by default), llama-bench with its CPU repacking
on (`--repack 1`, its default: the anchor of the ratios, the faster llama.cpp on an AMD host)
and llama-bench with extra buffer types off (`--repack 0`, what the issue prescribes on the
Intel hosts whose AMX buffers crash). Tests: prefill of P tokens (llama-bench -p P -n 0), and
D decode steps after a prompt of C tokens (pdm-engine-bench --prompt C --decode D, llama-bench
-p 0 -n D -d C). Peak RSS of every process from /usr/bin/time. GOP/s of prefill = 2 x layer
parameters x tokens/s against pdm-roofline's int8 (vpdpbusd) peak for that thread count;
GB/s of decode = weight bytes read per step (layer matrices + output matrix, the file's sizes)
x tokens/s against its read bandwidth. The 1-minute load average is recorded before every
run. Best of the repetitions is the least disturbed run on a shared machine; medians are
given too.

Writes NAME.json, NAME.md and NAME.png (the ratios per model and test) into --out. Reports only: nothing passes or fails
on timing.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "engine"))
from run import machine  # noqa: E402  (bench/engine/run.py: CPU, flags, load, date)

ENGINES = ("pdmesh", "llama-repack", "llama-norepack")


def timed(cmd, env=None, timeout=900):
    """Runs cmd under /usr/bin/time; returns (last stdout line as JSON, peak RSS MB)."""
    with tempfile.NamedTemporaryFile("r", suffix=".rss") as f:
        out = subprocess.run(["/usr/bin/time", "-o", f.name, "-f", "%M"] + cmd, env=env,
                             capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {out.stderr.strip()[-800:]}")
        rss_kb = int(f.read().strip().splitlines()[-1])
    return json.loads(out.stdout.strip().splitlines()[-1]), rss_kb / 1024.0


def run_one(args, engine, path, threads, test):
    kind, n = test  # ("prefill", P) or ("decode", C)
    if engine == "pdmesh":
        cmd = [args.pdm_bench, "--model", path, "--threads", str(threads), "--reps", "1"]
        cmd += ["--prompt", str(n), "--decode", "0"] if kind == "prefill" else \
            ["--prompt", str(n), "--decode", str(args.decode)]
        res, rss = timed(cmd)
        tok_s = res["prefill_tok_s"] if kind == "prefill" else res["decode_tok_s"]
        return tok_s, rss, res
    cmd = [args.llama_bench, "-m", path, "-t", str(threads), "-r", "1", "-o", "jsonl",
           "--repack", "1" if engine == "llama-repack" else "0"]
    cmd += ["-p", str(n), "-n", "0"] if kind == "prefill" else \
        ["-p", "0", "-n", str(args.decode), "-d", str(n)]
    res, rss = timed(cmd)
    return res["avg_ts"], rss, res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--from", dest="from_json", help="a NAME.json of an earlier run: write "
                    "its markdown and PNG again without running anything")
    ap.add_argument("--name", default="kquant-table", help="output file name without suffix")
    ap.add_argument("--pdm-bench")
    ap.add_argument("--roofline")
    ap.add_argument("--llama-bench")
    ap.add_argument("--model", action="append", help="NAME=PATH")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--prefill", default="512")
    ap.add_argument("--depth", default="128")
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    out = os.path.join(args.out, args.name)
    if args.from_json:
        with open(args.from_json) as f:
            res = json.load(f)
        write_markdown(res, out + ".md")
        write_png(res, out + ".png")
        return
    if not (args.pdm_bench and args.roofline and args.llama_bench and args.model):
        ap.error("--pdm-bench, --roofline, --llama-bench and --model are required")
    models = [m.split("=", 1) for m in args.model]
    threads = [int(t) for t in args.threads.split(",")]
    tests = [("prefill", int(p)) for p in args.prefill.split(",")] + \
            [("decode", int(d)) for d in args.depth.split(",")]
    res = {"machine": machine(), "protocol": {
        "reps": args.reps, "decode_steps": args.decode, "threads": threads,
        "anchor": "llama-bench --repack 1 (its default CPU repacking on)",
        "llama_bench": args.llama_bench}, "roofline": {}, "models": {}, "runs": []}
    for t in threads:
        res["roofline"][str(t)] = subprocess.run(
            [args.roofline, "--threads", str(t), "--reps", "3"], capture_output=True,
            text=True, check=True).stdout.strip()
        res["roofline"][str(t)] = json.loads(res["roofline"][str(t)])
        print(f"roofline {t} threads: {res['roofline'][str(t)]}", file=sys.stderr)
    for rep in range(args.reps):
        for t in threads:
            for name, path in models:
                for test in tests:
                    for engine in ENGINES:
                        load = os.getloadavg()[0]
                        tok_s, rss, raw = run_one(args, engine, path, t, test)
                        if engine == "pdmesh":
                            res["models"][name] = {
                                "path": os.path.basename(path), "size_bytes": os.path.getsize(path),
                                "layer_params": raw["layer_params"],
                                "weight_bytes": raw["weight_bytes"]}
                        run = {"rep": rep, "model": name, "threads": t, "test": test[0],
                               "n": test[1], "engine": engine, "tok_s": tok_s,
                               "peak_rss_mb": round(rss, 1), "load1": load}
                        res["runs"].append(run)
                        print(json.dumps(run), file=sys.stderr, flush=True)
    summarise(res, tests, threads, models)
    with open(out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    write_markdown(res, out + ".md")
    write_png(res, out + ".png")


def write_png(res, path):
    """NAME.png (gnuplot): the ratio pdmesh / llama.cpp, repack on and off, per model, thread
    count and test; the line at 1 is parity."""
    dat = path[:-4] + ".dat"
    with open(dat, "w") as f:
        f.write("# label ratio_vs_repack_on ratio_vs_repack_off\n")
        for c in res["summary"]:
            test = f"pf{c['n']}" if c["test"] == "prefill" else f"dec@{c['n']}"
            f.write(f"\"{c['model']} {c['threads']}t {test}\" "
                    f"{c['ratio_best']:.3f} {c['ratio_best_norepack']:.3f}\n")
    m = res["machine"]
    gp = f"""
set terminal pngcairo size 1200,480 font ',9' noenhanced
set output '{path}'
set title 'pdmesh / llama-bench tok/s, best of {res['protocol']['reps']} ({m['cpu']}, {m['cores']} vCPUs, {m['date_utc']} UTC)'
set style data histograms
set style histogram clustered gap 1
set style fill solid 0.8 border -1
set boxwidth 0.9
set grid ytics
set yrange [0:*]
set ylabel 'ratio (1 = parity)'
set xtics rotate by -40 scale 0
set key top right
plot '{dat}' u 2:xtic(1) t 'vs llama.cpp repack on (anchor)', '' u 3 t 'vs llama.cpp repack off', 1 w l lc 'black' notitle
"""
    try:
        r = subprocess.run(["gnuplot"], input=gp, text=True, capture_output=True)
    except FileNotFoundError:
        print("table: gnuplot missing (apt-get install gnuplot-nox), no PNG", file=sys.stderr)
        return
    finally:
        os.unlink(dat)
    if r.returncode != 0:
        print(f"table: gnuplot failed: {r.stderr.strip()}", file=sys.stderr)


def summarise(res, tests, threads, models):
    """Best, median and peak RSS per (model, threads, test, engine); ratios to the anchor."""
    rows = []
    for name, _ in models:
        for t in threads:
            for kind, n in tests:
                cell = {"model": name, "threads": t, "test": kind, "n": n}
                for e in ENGINES:
                    runs = [r for r in res["runs"] if r["model"] == name and r["threads"] == t
                            and r["test"] == kind and r["n"] == n and r["engine"] == e]
                    v = [r["tok_s"] for r in runs]
                    cell[e] = {"best": max(v), "median": statistics.median(v),
                               "peak_rss_mb": max(r["peak_rss_mb"] for r in runs), "n": len(v)}
                cell["load1"] = [r["load1"] for r in res["runs"] if r["model"] == name and
                                 r["threads"] == t and r["test"] == kind and r["n"] == n]
                a = cell["llama-repack"]
                cell["ratio_best"] = cell["pdmesh"]["best"] / a["best"]
                cell["ratio_median"] = cell["pdmesh"]["median"] / a["median"]
                cell["ratio_best_norepack"] = cell["pdmesh"]["best"] / cell["llama-norepack"]["best"]
                m, roof = res["models"][name], res["roofline"][str(t)]
                if kind == "prefill":
                    gops = 2 * m["layer_params"] * cell["pdmesh"]["best"] / 1e9
                    cell["pdmesh_gops"] = gops
                    cell["pdmesh_pct_int8_peak"] = 100 * gops / roof["peak_int8_gops"]
                else:
                    gbs = m["weight_bytes"] * cell["pdmesh"]["best"] / 1e9
                    cell["pdmesh_gbs"] = gbs
                    cell["pdmesh_pct_read_bw"] = 100 * gbs / roof["read_gbs"]
                rows.append(cell)
    res["summary"] = rows


def write_markdown(res, path):
    m, p = res["machine"], res["protocol"]
    lines = [
        "# pdmesh vs llama.cpp (llama-bench): the issue 14 table",
        "",
        f"Measured {m['date_utc']} UTC by `make bench-kquant` (bench/kquant/table.py). CPU: "
        f"{m['cpu']} (family/model {m['family_model']}), {m['cores']} vCPUs, AVX2 {m['avx2']}, "
        f"AVX-512 {m['avx512f']}, VNNI {m['avx512_vnni']}; {m['mem_gib']} GiB. "
        + ("**Quiet machine**: nothing else ran; " if m['loadavg_at_start'][0] < 0.5 else
           "**Shared machine**: other sessions ran during the runs; ")
        + f"1-minute load average at the start {m['loadavg_at_start'][0]:.2f}, per cell below "
        f"(min-max over its runs; an engine's own threads count).",
        "",
        f"{p['reps']} repetitions, engines alternating run by run (pdmesh, llama.cpp repack on, "
        f"llama.cpp repack off), one fresh process each; **best** run (least disturbed) and "
        f"median. Ratio = pdmesh / llama.cpp with its CPU repacking on (llama-bench's default "
        f"`--repack 1`, the faster llama.cpp here; the anchor). Decode: {p['decode_steps']} "
        f"steps after a prompt of the given context. Peak RSS: max over the cell's runs "
        f"(/usr/bin/time). pdmesh GOP/s = 2 x layer parameters x prefill tokens/s (attention "
        f"and the output matrix not counted); GB/s = weight bytes x decode tokens/s.",
        "",
    ]
    for t, r in sorted(res["roofline"].items()):
        lines.append(f"- pdm-roofline, {t} thread(s): int8 peak {r['peak_int8_gops']:.0f} GOP/s, "
                     f"read {r['read_gbs']:.1f} GB/s")
    lines += ["", "| model | threads | test | pdmesh tok/s best (median) | llama.cpp repack on "
              "| llama.cpp repack off | **ratio** best (median) | ratio vs repack off | pdmesh "
              "roofline | peak RSS MB pdmesh / llama.cpp | load |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in res["summary"]:
        pd, lr, ln = c["pdmesh"], c["llama-repack"], c["llama-norepack"]
        test = f"prefill {c['n']}" if c["test"] == "prefill" else f"decode @{c['n']}"
        roof = (f"{c['pdmesh_gops']:.0f} GOP/s ({c['pdmesh_pct_int8_peak']:.0f} % int8)"
                if c["test"] == "prefill" else
                f"{c['pdmesh_gbs']:.1f} GB/s ({c['pdmesh_pct_read_bw']:.0f} % read)")
        lines.append(
            f"| {c['model']} | {c['threads']} | {test} | {pd['best']:.1f} ({pd['median']:.1f}) | "
            f"{lr['best']:.1f} ({lr['median']:.1f}) | {ln['best']:.1f} ({ln['median']:.1f}) | "
            f"**{c['ratio_best']:.2f}x** ({c['ratio_median']:.2f}x) | "
            f"{c['ratio_best_norepack']:.2f}x | {roof} | {pd['peak_rss_mb']:.0f} / "
            f"{lr['peak_rss_mb']:.0f} | {min(c['load1']):.1f}-{max(c['load1']):.1f} |")
    lines += ["", "Models:", ""]
    for name, mm in res["models"].items():
        lines.append(f"- {name}: `{mm['path']}`, {mm['size_bytes'] / 1e6:.0f} MB, "
                     f"{mm['layer_params'] / 1e6:.0f} M layer parameters")
    lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    main()
