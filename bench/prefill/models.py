#!/usr/bin/env python3
"""bench/prefill/models.py: prefill-group TTFT on the bigger models, measured beside the
simulator's prediction (docs/perf/prefill-models.{json,md}).

The default model (SmolLM2-135M) is too small for a group to pay off much: a layer's compute
is short next to the per-layer exchanges. The bigger the model, the closer KV-Runahead and
ring attention should come to a linear speed-up. For each model given (GGUF paths) and each
prompt length, this runs, in one pass per length so that drift hits every method alike:

  - `pdmesh prefill-run --ranks 1 --method single` (TTFT(1));
  - on 2 ranks: tsp, kvr-e, cp-kv (pass-KV), cp-q (pass-Q) (KVR-S needs a partition search
    per model and length, which bench/prefill/run.py does for the default model);
  - the parallel efficiency TTFT(1) / (2 * TTFT(2)) of each, and KV-Runahead's lower bound
    TTFT*(2) = TTFT(1)/2 * (1/2 + 1/4) (eq. 2-3);
  - bench/sim/sim.py's prediction for the same method, shape and length, with this model's own
    calibration (`pdmesh calibrate --model M`: achieved FLOP/s of one rank, link latency and
    bandwidth between two ranks).

The simulator counts causal attention pairs on every layer; for Gemma 3 the local layers see
only their sliding window, so its attention estimate is high for those (said in the output).
Random-token prompts, one thread per rank, ranks pinned to cores, median of BENCH_REPS runs.

  python3 bench/prefill/models.py MODEL.gguf [MODEL.gguf ...]
Environment: PDMESH (default build/bin/pdmesh), BENCH_LENGTHS (default 4096,8192),
BENCH_REPS (default 1), BENCH_OUT (default docs/perf). Reports only: nothing fails on timing.
"""
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "bench", "sim"))
sys.path.insert(0, HERE)
import sim  # noqa: E402
from run import machine  # noqa: E402

PDMESH = os.environ.get("PDMESH", os.path.join(ROOT, "build/bin/pdmesh"))
LENGTHS = [int(x) for x in os.environ.get("BENCH_LENGTHS", "4096,8192").split(",")]
REPS = int(os.environ.get("BENCH_REPS", "1"))
OUT = os.environ.get("BENCH_OUT", os.path.join(ROOT, "docs/perf"))
METHODS2 = ["tsp", "kvr-e", "cp-kv", "cp-q"]


def shape(path):
    """The simulator's model dict from the GGUF's metadata (gguf-py)."""
    import gguf
    r = gguf.GGUFReader(path)
    arch = r.fields["general.architecture"].contents()

    def key(suffix, default=None):
        f = r.fields.get("%s.%s" % (arch, suffix))
        if f is None:
            return default
        v = f.contents()
        return v[0] if isinstance(v, list) else v
    d, nh = int(key("embedding_length")), int(key("attention.head_count"))
    emb = next(t for t in r.tensors if t.name == "token_embd.weight")
    name = r.fields.get("general.name")
    return dict(title=(name.contents() if name else os.path.basename(path)), arch=arch,
                layers=int(key("block_count")), d=d, ff=int(key("feed_forward_length")), nh=nh,
                nkv=int(key("attention.head_count_kv", nh)),
                hd=int(key("attention.key_length", d // nh)), vocab=int(emb.shape[-1]),
                window=int(key("attention.sliding_window", 0)))


def run(model, args, ctx):
    """One prefill-run's JSON with "load" added: the 1-minute load average when it started
    (the machine is shared; a run that met other work must be recognisable in the table)."""
    load = os.getloadavg()[0]
    cmd = [PDMESH, "prefill-run", "--model", model, "--pin", "--json", "--threads", "1",
           "--repeat", str(REPS), "--ctx", str(ctx)] + args
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if p.returncode != 0:
        sys.stderr.write("failed: %s\n%s" % (" ".join(cmd), p.stderr[-2000:]))
        return None
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res["load"] = load
    return res


def bench_model(path):
    m = shape(path)
    sys.stderr.write("%s: %s\n" % (path, json.dumps(m)))
    cal_out = os.path.join(ROOT, "build", "calibration-%s.json" % os.path.basename(path))
    c = subprocess.run([PDMESH, "calibrate", "--model", path, "--pin", "--json", "--length",
                        "1024", "--out", cal_out], capture_output=True, text=True, timeout=3600)
    if c.returncode != 0:
        sys.stderr.write("calibrate failed: %s\n" % c.stderr[-2000:])
        return None
    cal = json.loads(c.stdout.strip().splitlines()[-1])
    cost = sim.Cost(m, sim.Hw("calibration", cal["flops"], cal["flops"], cal["bandwidth"],
                              cal.get("latency", 0.0)))
    rows, ctx = [], max(LENGTHS) + 64
    for n in LENGTHS:
        one = run(path, ["--ranks", "1", "--method", "single", "--random", str(n)], ctx)
        row = {"tokens": n, "single": one and one["ttft"],
               "single_pred": sim.predict(cost, "single", n, 1)["ttft"],
               "single_load": one and one["load"], "methods": {}}
        for meth in METHODS2:
            r = run(path, ["--ranks", "2", "--method", meth, "--random", str(n)], ctx)
            pred = sim.predict(cost, meth, n, 2)
            t = r and r["ttft"]
            row["methods"][meth] = {
                "ttft": t, "pred": pred and pred["ttft"], "load": r and r["load"],
                "eff": one["ttft"] / (2 * t) if one and t else None,
                "eff_pred": row["single_pred"] / (2 * pred["ttft"]) if pred else None}
        row["bound"] = one and sim.lower_bound(one["ttft"], 2)
        rows.append(row)
        sys.stderr.write("%s %d: %s\n" % (m["title"], n, json.dumps(row)))
    return {"path": os.path.relpath(os.path.abspath(path), ROOT), "shape": m,
            "calibration": cal, "rows": rows}


def fmt(x, d=2):
    return "-" if x is None else "%.*f" % (d, x)


def write_md(res):
    mc = res["machine"]
    lines = ["# Prefill groups on bigger models: TTFT and parallel efficiency at 2 ranks", "",
             "Generated by `bench/prefill/models.py` on %s, %s cores, %s; load average %.1f "
             "before, %.1f after. Random-token prompts, one thread per rank, ranks pinned, "
             "median of %d run(s). TTFT in seconds; `load` = the range of the 1-minute load average "
             "at the start of the row's runs (2 cores: above ~2.5 the ranks share them with "
             "other work and the row is not a clean measurement); efficiency = TTFT(1) / (2 TTFT(2)); "
             "`pred` = bench/sim/sim.py with the model's own `pdmesh calibrate`." % (
                 mc["cpu"], mc["cores"], mc["date"], res["loadavg_before"][0],
                 res["loadavg_after"][0], res["reps"]), ""]
    for mod in res["models"]:
        s, cal = mod["shape"], mod["calibration"]
        lines += ["## %s (`%s`, %s)" % (s["title"], s["arch"], mod["path"]), "",
                  "%d layers, d_model %d, FFN %d, %d query / %d KV heads of %d%s. Calibration: "
                  "%.1f GFLOP/s per rank, link %.2f GB/s, %.1f us." % (
                      s["layers"], s["d"], s["ff"], s["nh"], s["nkv"], s["hd"],
                      ", sliding window %d on local layers (the simulator counts full causal "
                      "attention there, so its TTFT is high)" % s["window"] if s["window"]
                      else "", cal["flops"] / 1e9, cal["bandwidth"] / 1e9,
                      cal.get("latency", 0) * 1e6), "",
                  "| tokens | TTFT(1) (pred) | " + " | ".join(
                      "%s TTFT (pred) | %s eff (pred)" % (x, x) for x in METHODS2) +
                  " | TTFT*(2) bound | load |",
                  "|---|---|" + "---|---|" * len(METHODS2) + "---|---|"]
        for r in mod["rows"]:
            cells = ["%d" % r["tokens"], "%s (%s)" % (fmt(r["single"]), fmt(r["single_pred"]))]
            for x in METHODS2:
                v = r["methods"][x]
                cells += ["%s (%s)" % (fmt(v["ttft"]), fmt(v["pred"])),
                          "%s (%s)" % (fmt(v["eff"]), fmt(v["eff_pred"]))]
            cells.append(fmt(r["bound"]))
            loads = [x for x in [r.get("single_load")] +
                     [r["methods"][m].get("load") for m in METHODS2] if x is not None]
            cells.append("%s-%s" % (fmt(min(loads), 1), fmt(max(loads), 1)) if loads else "-")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    with open(os.path.join(OUT, "prefill-models.md"), "w") as f:
        f.write("\n".join(lines))


def main():
    models = sys.argv[1:]
    if not models:
        sys.exit(__doc__)
    os.makedirs(OUT, exist_ok=True)
    res = {"machine": machine(), "reps": REPS, "lengths": LENGTHS,
           "loadavg_before": os.getloadavg(), "models": []}
    for path in models:
        r = bench_model(path)
        if r:
            res["models"].append(r)
    res["loadavg_after"] = os.getloadavg()
    with open(os.path.join(OUT, "prefill-models.json"), "w") as f:
        json.dump(res, f, indent=1)
    write_md(res)
    print(open(os.path.join(OUT, "prefill-models.md")).read())


if __name__ == "__main__":
    main()
