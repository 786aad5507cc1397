#!/usr/bin/env python3
"""OpenAI's n = 4 through a real mesh (pdmesh-router, a prefill group of 2 ranks running kvr-e,
one decode node; every process --threads 1): the choices sharing the prompt (one request with
n = 4: one prefill, one KV transfer, one decode sequence of 4 samples, decode_node/nsamp.h)
against the per-choice path (what the HTTP front end did before: 4 requests with n = 1 and the
seeds pdm_sampler_seed_for_choice(seed, i), sent at once).

Per round and path: TTFT (request sent -> first streamed token of any choice), total time
(-> [DONE]), prompt tokens prefilled (pdmesh_prefill_tokens_total{where="group"}), KV bytes
moved (pdmesh_kv_bytes_total), and the decode node's CPU time (utime + stime of its process)
per decode step (the steps are the tokens of the longest choice: every step computes all live
choices, in one batch on either path). Rounds alternate the paths, each with a prompt never
seen before; medians over --rounds. With --pin the decode node runs on CPU 1 and the rest on
CPU 0 (taskset). Writes docs/perf/nshare.{json,md} with the CPU and the load average.

  python3 bench/api/nshare.py [--bindir build/bin] [--model FILE] [--rounds 5] [--tokens 64]"""
import json
import os
import platform
import shutil
import statistics
import sys
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
from mesh import Mesh, mesh_argparser  # noqa: E402

MASK = (1 << 64) - 1
N = 4


def seed_for_choice(seed, i):
    """pdm_sampler_seed_for_choice (model/sampler.c)."""
    if i == 0:
        return seed
    x = (seed ^ ((i * 0xD1B54A32D192ED03) & MASK)) & MASK
    z = x = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def stream(port, body, t0, out):
    """Posts a streamed completions request; out gets the first token's and the end's times
    (seconds after t0) and the texts per choice index."""
    req = urllib.request.Request("http://127.0.0.1:%d/v1/completions" % port,
                                 data=json.dumps(dict(body, stream=True)).encode(),
                                 headers={"Content-Type": "application/json"})
    first, texts = None, {}
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for ch in json.loads(line[6:]).get("choices", []):
                if ch.get("text") and first is None:
                    first = time.perf_counter() - t0
                texts[ch["index"]] = texts.get(ch["index"], "") + ch.get("text", "")
    out.append((first, time.perf_counter() - t0, texts))


def cpu_seconds(pid):
    with open("/proc/%d/stat" % pid) as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def counters(m):
    return (m.metric("pdmesh_prefill_tokens_total", 'where="group"'),
            m.metric("pdmesh_kv_bytes_total"))


def run_path(m, dec_pid, shared, prompt, tokens, seed):
    base = {"prompt": prompt, "max_tokens": tokens, "temperature": 0.8, "ignore_eos": True}
    c0, cpu0, out = counters(m), cpu_seconds(dec_pid), []
    t0 = time.perf_counter()
    if shared:
        stream(m.http_port, dict(base, n=N, seed=seed), t0, out)
    else:
        ths = [threading.Thread(target=stream, args=(m.http_port,
                                                     dict(base, seed=seed_for_choice(seed, i)),
                                                     t0, out)) for i in range(N)]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
    time.sleep(0.3)  # the router's counters follow the last result
    c1, cpu1 = counters(m), cpu_seconds(dec_pid)
    ttft = min(x[0] for x in out if x[0] is not None)
    total = max(x[1] for x in out)
    texts = {}
    if shared:
        texts = out[0][2]
    else:
        for i, x in enumerate(out):
            texts[i] = x[2].get(0, "")
    return {"ttft_ms": ttft * 1e3, "total_ms": total * 1e3,
            "prefill_tokens": c1[0] - c0[0], "kv_bytes": c1[1] - c0[1],
            "decode_cpu_ms_per_step": (cpu1 - cpu0) * 1e3 / tokens, "choices": len(texts)}


def main():
    ap = mesh_argparser(__doc__)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--pin", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "perf", "nshare"))
    ap.add_argument("--render", help="only write the markdown of this JSON result")
    args = ap.parse_args()
    if args.render:
        with open(args.render) as f:
            render(json.load(f), args.render[:-5] + ".md")
        return
    with open(os.path.join(ROOT, "tests", "golden", "ppl_text.txt")) as f:
        text = f.read()
    m = Mesh(args.bindir, args.model, prefill_ranks=2, local_threshold=0,
             router_args=("--method", "kvr-e"))
    pin = args.pin and shutil.which("taskset") and os.cpu_count() >= 2
    rows = {"shared": [], "per-choice": []}
    try:
        m.wait_ready()
        dec = m.procs["decode-0"][0].pid
        if pin:
            os.system("taskset -pc 1 %d > /dev/null" % dec)
            for name, (p, _) in m.procs.items():
                if name != "decode-0":
                    os.system("taskset -pc 0 %d > /dev/null" % p.pid)
        run_path(m, dec, True, "Warm-up. " + text[:300], 8, 1)
        load = [os.getloadavg()]
        for rnd in range(args.rounds):
            for k, shared in (("shared", True), ("per-choice", False)):
                prompt = "Note %d %s: " % (rnd, k) + text[:1200]
                rows[k].append(run_path(m, dec, shared, prompt, args.tokens, 100 + rnd))
        load.append(os.getloadavg())
    finally:
        m.stop()
    med = {k: {f: statistics.median(r[f] for r in v) for f in v[0]} for k, v in rows.items()}
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(x.split(":", 1)[1].strip() for x in f if x.startswith("model name"))
    except (OSError, StopIteration):
        pass
    res = {"n": N, "tokens": args.tokens, "rounds": args.rounds, "cpu": cpu,
           "nproc": os.cpu_count(), "pinned": bool(pin),
           "loadavg_before": load[0], "loadavg_after": load[-1], "median": med, "rounds_raw": rows}
    with open(args.out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    render(res, args.out + ".md")


def render(res, path):
    """The markdown table of a result (also: --render FILE.json)."""
    s, p = res["median"]["shared"], res["median"]["per-choice"]
    load = [res["loadavg_before"], res["loadavg_after"]]
    lines = ["# n = %d: the choices sharing the prompt vs one request per choice" % res["n"], "",
             "Generated by `bench/api/nshare.py` (%d rounds, medians; %d new tokens per choice, "
             "temperature 0.8, ignore_eos; a prompt of about %d tokens never seen before per "
             "round). Mesh: pdmesh-router, a prefill group of 2 ranks (kvr-e), one decode node, "
             "every process `--threads 1`%s. CPU: %s, %d vCPUs; load average %s before, %s "
             "after (the machine is shared with other jobs: absolute times are noisy, the "
             "counts are exact)." % (
                 res["rounds"], res["tokens"], s["prefill_tokens"],
                 "; decode node pinned to CPU 1, the rest to CPU 0" if res["pinned"] else "",
                 res["cpu"], res["nproc"], "/".join("%.2f" % x for x in load[0]),
                 "/".join("%.2f" % x for x in load[-1])), "",
             "| | shared (n = 4) | per-choice (4 x n = 1) | shared / per-choice |",
             "|---|---|---|---|"]
    for f, name in (("ttft_ms", "TTFT, ms"), ("total_ms", "total time, ms"),
                    ("prefill_tokens", "prompt tokens prefilled"),
                    ("kv_bytes", "KV bytes moved"),
                    ("decode_cpu_ms_per_step", "decode node CPU per step, ms (its process: steps and KV receipt)")):
        ratio = s[f] / p[f] if p[f] else float("nan")
        lines.append("| %s | %.1f | %.1f | %.2f |" % (name, s[f], p[f], ratio))
    lines += ["", "The shared path prefills and transfers the prompt once and keeps its KV once "
              "on the decode node (eq. (3) of decode_node/beam.h with width 4); its decode step "
              "computes the 4 samples as rows of one batch against that one prompt KV "
              "(decode_node/nsamp.h). The per-choice path prefills and streams the prompt 4 "
              "times (the group runs the 4 tasks one after another) and decodes 4 separate "
              "sequences in one batch, each against its own copy of the prompt's KV. TTFT is "
              "the first token of any choice: the per-choice path's first prefill is as fast as "
              "the shared one, the other three choices start later (in its total time).", ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
