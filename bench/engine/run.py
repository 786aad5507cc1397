#!/usr/bin/env python3
"""Engine benchmark: pdmesh against llama.cpp on the same GGUF, run alternately.

    bench/engine/run.py --pdm-bench build/bin/pdm-engine-bench --roofline build/bin/pdm-roofline
                        --python VENV/bin/python --model M.gguf --out docs/perf

For every thread count (1, 2) and configuration, each repetition runs pdmesh then llama.cpp
(one fresh process each), so both see the same machine state; medians over the repetitions
are reported. Configurations: prefill at 512, 2048, 4096, 8192 prompt tokens; decode at
contexts 128, 4096, 8192 (the decode steps follow the prefill of that context). Roofline:
prefill GFLOP/s against the measured f32 FMA peak, decode GB/s against the measured read
bandwidth. PDM_BENCH_QUICK=1: prompts 512 and 2048, decode at 128 and 2048, 2 repetitions.

Writes engine.json, engine.md and engine.png (gnuplot) into --out. Reports only: nothing
here passes or fails on timing.
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys


def sh(cmd):
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def machine():
    flags = sh("grep -m1 '^flags' /proc/cpuinfo")
    return {
        "cpu": sh("grep -m1 'model name' /proc/cpuinfo | cut -d: -f2").strip(),
        "family_model": sh("grep -m1 '^cpu family' /proc/cpuinfo | cut -d: -f2").strip() + "/" +
        sh("grep -m1 '^model\\s' /proc/cpuinfo | cut -d: -f2").strip(),
        "cores": os.cpu_count(),
        "avx2": " avx2" in flags, "avx512f": "avx512f" in flags,
        "avx512_vnni": "avx512_vnni" in flags,
        "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "kernel": platform.release(),
        "loadavg_at_start": os.getloadavg(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
    }


def run_json(cmd, timeout=3600):
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pdm-bench", required=True)
    ap.add_argument("--roofline", required=True)
    ap.add_argument("--python", required=True, help="a Python with llama_cpp")
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    quick = os.environ.get("PDM_BENCH_QUICK", "") not in ("", "0")
    reps = int(os.environ.get("PDM_BENCH_REPS", "2" if quick else "3"))
    decode_steps = 16 if quick else 32
    # (prompt tokens, decode steps after it)
    if quick:
        configs = [(128, decode_steps), (512, 0), (2048, decode_steps)]
    else:
        configs = [(128, decode_steps), (512, 0), (2048, 0), (4096, decode_steps),
                   (8192, decode_steps)]
    here = os.path.dirname(os.path.abspath(__file__))
    llama_py = os.path.join(here, "llama_bench.py")

    result = {"machine": machine(), "quick": quick, "reps": reps, "model": args.model,
              "roofline": {}, "runs": []}
    for t in (1, 2):
        result["roofline"][str(t)] = run_json([args.roofline, "--threads", str(t), "--mb", "256",
                                               "--reps", "3"])
        print(f"roofline {t} thread(s): {result['roofline'][str(t)]}", flush=True)

    model_info = None
    for t in (1, 2):
        for prompt, decode in configs:
            samples = {"pdmesh": [], "llama.cpp": []}
            loads = []
            for r in range(reps):
                loads.append(round(os.getloadavg()[0], 2))
                pdm = run_json([args.pdm_bench, "--model", args.model, "--threads", str(t),
                                "--prompt", str(prompt), "--decode", str(decode), "--reps", "1"])
                lla = run_json([args.python, llama_py, "--model", args.model, "--threads", str(t),
                                "--prompt", str(prompt), "--decode", str(decode), "--reps", "1"])
                samples["pdmesh"].append(pdm)
                samples["llama.cpp"].append(lla)
                model_info = model_info or pdm
                print(f"t={t} prompt={prompt} decode={decode} rep {r}: pdmesh "
                      f"{pdm['prefill_tok_s']:.1f}/{pdm['decode_tok_s']:.1f} tok/s, llama.cpp "
                      f"{lla['prefill_tok_s']:.1f}/{lla['decode_tok_s']:.1f} tok/s", flush=True)
            entry = {"threads": t, "prompt": prompt, "decode": decode, "loadavg_1min": loads}
            for eng, runs in samples.items():
                entry[eng] = {
                    "prefill_tok_s": statistics.median(x["prefill_tok_s"] for x in runs),
                    "decode_tok_s": statistics.median(x["decode_tok_s"] for x in runs),
                    "prefill_samples": [x["prefill_tok_s"] for x in runs],
                    "decode_samples": [x["decode_tok_s"] for x in runs],
                    "peak_rss_mb": max(x["peak_rss_mb"] for x in runs),
                }
            entry["kernels"] = samples["pdmesh"][0]["kernels"]
            result["runs"].append(entry)

    # Roofline: flops per prefill token (layer matmuls + causal attention averaged over the
    # prompt), bytes per decode token (weights + this context's f16 KV).
    mi = model_info
    attn_per_tok = lambda p: 4.0 * mi["n_layers"] * mi["n_heads"] * mi["head_dim"] * (p + 1) / 2
    kv_bytes_per_ctx_tok = 2 * mi["n_layers"] * mi["n_kv_heads"] * mi["head_dim"] * 2
    for e in result["runs"]:
        roof = result["roofline"][str(e["threads"])]
        for eng in ("pdmesh", "llama.cpp"):
            x = e[eng]
            flops = (2.0 * mi["layer_params"] + attn_per_tok(e["prompt"])) * x["prefill_tok_s"]
            x["prefill_gflops"] = flops * 1e-9
            x["prefill_frac_peak"] = x["prefill_gflops"] / roof["peak_f32_gflops"]
            if e["decode"]:
                gbs = (mi["weight_bytes"] + kv_bytes_per_ctx_tok * e["prompt"]) * x["decode_tok_s"]
                x["decode_gbs"] = gbs * 1e-9
                x["decode_frac_bw"] = x["decode_gbs"] / roof["read_gbs"]
        e["prefill_ratio"] = e["pdmesh"]["prefill_tok_s"] / e["llama.cpp"]["prefill_tok_s"]
        if e["decode"]:
            e["decode_ratio"] = e["pdmesh"]["decode_tok_s"] / e["llama.cpp"]["decode_tok_s"]
    result["machine"]["loadavg_at_end"] = os.getloadavg()
    result["model_info"] = {k: mi[k] for k in ("layer_params", "output_params", "weight_bytes",
                                               "n_layers", "n_heads", "n_kv_heads", "head_dim")}

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "engine.json"), "w") as f:
        json.dump(result, f, indent=1)
    write_markdown(result, os.path.join(args.out, "engine.md"))
    write_plot(result, args.out)
    print(open(os.path.join(args.out, "engine.md")).read())
    return 0


def write_markdown(res, path):
    m = res["machine"]
    lines = [
        "# Engine benchmark: pdmesh vs llama.cpp",
        "",
        f"Generated by `make bench-engine` on {m['date_utc']} UTC{' (QUICK mode)' if res['quick'] else ''}. "
        f"Machine: {m['cpu']} (family/model {m['family_model']}), {m['cores']} cores, "
        f"AVX2 {m['avx2']}, AVX-512F {m['avx512f']}, AVX-512 VNNI {m['avx512_vnni']}, "
        f"{m['mem_gib']} GiB; load average at start {tuple(round(x, 2) for x in m['loadavg_at_start'])}, "
        f"at end {tuple(round(x, 2) for x in m['loadavg_at_end'])} (other work on the same cores "
        "distorts 2-thread numbers most; engine.json has the 1-minute load before each repetition). "
        f"Medians of {res['reps']} alternating repetitions (pdmesh, then llama.cpp, one fresh "
        "process each). Model: SmolLM2-135M-Instruct Q4_1, f16 KV cache, batch 512.",
        "",
        "| threads | prompt | pdmesh prefill tok/s | llama.cpp prefill tok/s | ratio | "
        "pdmesh decode tok/s | llama.cpp decode tok/s | ratio | pdmesh RSS MB | llama.cpp RSS MB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in res["runs"]:
        p, l = e["pdmesh"], e["llama.cpp"]
        dec = (f"{p['decode_tok_s']:.1f} | {l['decode_tok_s']:.1f} | {e['decode_ratio']:.2f}x"
               if e["decode"] else "- | - | -")
        lines.append(f"| {e['threads']} | {e['prompt']} | {p['prefill_tok_s']:.1f} | "
                     f"{l['prefill_tok_s']:.1f} | {e['prefill_ratio']:.2f}x | {dec} | "
                     f"{p['peak_rss_mb']:.0f} | {l['peak_rss_mb']:.0f} |")
    lines += ["", "Decode rows: decode steps at the context given by `prompt`, after its prefill. "
              "llama.cpp's RSS includes the Python interpreter.", "", "## Roofline", ""]
    for t, r in res["roofline"].items():
        lines.append(f"- {t} thread(s): f32 FMA peak {r['peak_f32_gflops']:.0f} GFLOP/s "
                     f"({r['isa']}), read bandwidth {r['read_gbs']:.1f} GB/s, triad "
                     f"{r['triad_gbs']:.1f} GB/s")
    lines += ["", "| threads | prompt | pdmesh prefill GFLOP/s (of peak) | llama.cpp prefill GFLOP/s "
              "(of peak) | pdmesh decode GB/s (of bw) | llama.cpp decode GB/s (of bw) |",
              "|---|---|---|---|---|---|"]
    for e in res["runs"]:
        p, l = e["pdmesh"], e["llama.cpp"]
        dec = (f"{p['decode_gbs']:.1f} ({100 * p['decode_frac_bw']:.0f} %) | "
               f"{l['decode_gbs']:.1f} ({100 * l['decode_frac_bw']:.0f} %)"
               if e["decode"] else "- | -")
        lines.append(f"| {e['threads']} | {e['prompt']} | {p['prefill_gflops']:.1f} "
                     f"({100 * p['prefill_frac_peak']:.1f} %) | {l['prefill_gflops']:.1f} "
                     f"({100 * l['prefill_frac_peak']:.1f} %) | {dec} |")
    lines += ["", "Prefill flops count 2 per weight per token in the layer matrices plus causal "
              "attention (4 x layers x heads x head_dim x (prompt + 1) / 2); the int8 matrix "
              "products are measured against the f32 FMA peak. Decode bytes are the layer and "
              "output matrices plus the context's f16 KV per step.", ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def write_plot(res, out):
    """engine.png: prefill and decode tok/s per prompt/context, both engines, 1 and 2 threads."""
    dat = os.path.join(out, "engine.dat")
    ddat = os.path.join(out, "engine_decode.dat")
    with open(dat, "w") as f, open(ddat, "w") as g:
        f.write("# threads prompt pdm_prefill llama_prefill\n")
        g.write("# threads context pdm_decode llama_decode\n")
        for e in res["runs"]:
            f.write(f"{e['threads']} {e['prompt']} {e['pdmesh']['prefill_tok_s']:.2f} "
                    f"{e['llama.cpp']['prefill_tok_s']:.2f}\n")
            if e["decode"]:
                g.write(f"{e['threads']} {e['prompt']} {e['pdmesh']['decode_tok_s']:.2f} "
                        f"{e['llama.cpp']['decode_tok_s']:.2f}\n")
    gp = f"""
set terminal pngcairo size 1100,450 font ',10' noenhanced
set datafile missing '?'
set output '{os.path.join(out, 'engine.png')}'
set multiplot layout 1,2 title 'pdmesh vs llama.cpp, SmolLM2-135M Q4_1 ({res['machine']['cpu']}, {res['machine']['date_utc']})'
set logscale x 2
set key top right
set grid
set xlabel 'prompt tokens'
set ylabel 'prefill tokens/s'
plot '{dat}' u ($1==1?$2:1/0):3 w lp lw 2 t 'pdmesh 1t', '' u ($1==1?$2:1/0):4 w lp lw 2 t 'llama.cpp 1t', \\
     '' u ($1==2?$2:1/0):3 w lp lw 2 t 'pdmesh 2t', '' u ($1==2?$2:1/0):4 w lp lw 2 t 'llama.cpp 2t'
set xlabel 'context tokens'
set ylabel 'decode tokens/s'
plot '{ddat}' u ($1==1?$2:1/0):3 w lp lw 2 t 'pdmesh 1t', '' u ($1==1?$2:1/0):4 w lp lw 2 t 'llama.cpp 1t', \\
     '' u ($1==2?$2:1/0):3 w lp lw 2 t 'pdmesh 2t', '' u ($1==2?$2:1/0):4 w lp lw 2 t 'llama.cpp 2t'
unset multiplot
"""
    r = subprocess.run(["gnuplot"], input=gp, text=True, capture_output=True)
    if r.returncode != 0:
        print(f"bench: gnuplot failed: {r.stderr.strip()}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
