#!/usr/bin/env python3
"""What prompt log-probabilities cost: TTFT and TPOT of the same completion with and without
echo + logprobs, and the time of a scoring-only request (echo, max_tokens 0), through a real
mesh (pdmesh-router, a prefill group of 2 ranks running kvr-e, a decode node). Requests
alternate, one at a time; medians over --rounds. Writes docs/perf/prompt-logprobs.{json,md}.

  python3 bench/api/prompt_logprobs.py [--bindir build/bin] [--model FILE] [--rounds 7]"""
import json
import os
import statistics
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
from mesh import Mesh, mesh_argparser  # noqa: E402


def post(port, body):
    req = urllib.request.Request("http://127.0.0.1:%d/v1/completions" % port,
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        j = json.loads(r.read())
    return j, time.perf_counter() - t0


def main():
    ap = mesh_argparser(__doc__)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "perf", "prompt-logprobs"))
    args = ap.parse_args()
    with open(os.path.join(ROOT, "tests", "golden", "ppl_text.txt")) as f:
        text = f.read()
    m = Mesh(args.bindir, args.model, prefill_ranks=2, router_args=("--method", "kvr-e"))
    rows = []
    try:
        m.wait_ready()
        for chars in (600, 2400):
            prompt = text[:chars]
            base = {"prompt": prompt, "max_tokens": args.tokens, "temperature": 0,
                    "ignore_eos": True}
            kinds = {"plain": dict(base),
                     "echo+logprobs 5": dict(base, echo=True, logprobs=5),
                     "scoring only (max_tokens 0)": {"prompt": prompt, "echo": True,
                                                     "logprobs": 1, "max_tokens": 0}}
            post(m.http_port, dict(base, prompt="Warm-up. " + prompt))
            got = {k: {"ttft": [], "tpot": [], "total": []} for k in kinds}
            n_prompt = 0
            for rnd in range(args.rounds):
                for ki, (k, body) in enumerate(kinds.items()):
                    # a prompt never seen before: no prefix of it is cached anywhere (echo
                    # requests never reuse one; the others must not either, to compare)
                    body = dict(body, prompt="Note %d.%d: " % (rnd, ki) + body["prompt"])
                    j, wall = post(m.http_port, body)
                    x = j["usage"]["pdmesh"]
                    n_prompt = j["usage"]["prompt_tokens"]
                    got[k]["ttft"].append(x["ttft_ms"])
                    got[k]["tpot"].append(x["tpot_ms"])
                    got[k]["total"].append(x["total_ms"])
            for k in kinds:
                med = {s: statistics.median(v) for s, v in got[k].items()}
                rows.append({"prompt_tokens": n_prompt, "kind": k, "ttft_ms": med["ttft"],
                             "tpot_ms": med["tpot"], "total_ms": med["total"],
                             "rounds": args.rounds})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        m.stop()
    with open(args.out + ".json", "w") as f:
        json.dump({"method": "kvr-e", "ranks": 2, "max_tokens": args.tokens, "rows": rows}, f,
                  indent=1)
    with open(args.out + ".md", "w") as f:
        f.write("# Prompt log-probabilities: cost\n\n"
                "`python3 bench/api/prompt_logprobs.py` on this machine (2 vCPUs shared with "
                "other jobs; one thread per process): a prefill group of 2 ranks (kvr-e) and a "
                "decode node, %d completion tokens (ignore_eos), medians of %d alternating "
                "rounds, every prompt new (nothing cached). `ttft_ms`/`tpot_ms`/`total_ms` are the router's usage.pdmesh figures; "
                "a scoring-only request has no TTFT (nothing is generated): its total is the "
                "prefill plus the merge.\n\n" % (args.tokens, args.rounds))
        f.write("| prompt tokens | request | TTFT ms | TPOT ms | total ms |\n|---|---|---|---|---|\n")
        for r in rows:
            f.write("| %d | %s | %.1f | %.2f | %.1f |\n" % (r["prompt_tokens"], r["kind"],
                                                        r["ttft_ms"], r["tpot_ms"],
                                                        r["total_ms"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
