#!/usr/bin/env python3
"""TPOT through a real mesh (router + 2-rank prefill group, kvr-e + decode node) with and
without a json_schema response_format, as the router reports it (usage.pdmesh.tpot_ms):
6 alternating pairs of seeded (temperature 0.8) chat requests, at most 120 tokens (the
unconstrained ones with ignore_eos, so they run the whole 120). Prints the medians; a
benchmark, it does not pass or fail. docs/perf/grammar.md quotes a run.

  build/venv/bin/python bench/grammar/mesh_tpot.py [--bindir build/bin] [--model FILE]"""
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "integration"))
from mesh import Mesh, mesh_argparser  # noqa: E402

import openai  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"},
    "sentences": {"type": "array", "items": {"type": "string"}, "minItems": 6, "maxItems": 6}},
    "required": ["title", "sentences"]}


def main():
    args = mesh_argparser(__doc__).parse_args()
    m = Mesh(args.bindir, args.model, prefill_ranks=2, local_threshold=0,
             router_args=("--method", "kvr-e"))
    try:
        m.wait_ready()
        c = openai.OpenAI(base_url="http://127.0.0.1:%d/v1" % m.http_port, api_key="none",
                          max_retries=0, timeout=300)
        msg = [{"role": "user",
                "content": "Write a story about a dragon who learns to cook, in 6 sentences."}]
        res = {"free": [], "json_schema": []}
        for i in range(6):
            for k in res:
                kw = ({"response_format": {"type": "json_schema", "json_schema": {
                    "name": "s", "schema": SCHEMA}}} if k == "json_schema" else {})
                r = c.chat.completions.create(model="", messages=msg, temperature=0.8, seed=i,
                                              max_tokens=120,
                                              extra_body={"ignore_eos": k == "free"}, **kw)
                res[k].append((r.usage.model_extra["pdmesh"]["tpot_ms"],
                               r.usage.completion_tokens))
        with open("/proc/loadavg") as f:
            load = f.read().split()[:3]
        for k, v in res.items():
            print("%-12s TPOT median %.2f ms, tokens %s" %
                  (k, statistics.median(x[0] for x in v), [x[1] for x in v]))
        print("load average after: %s" % " ".join(load))
    finally:
        m.stop()


if __name__ == "__main__":
    main()
