#!/usr/bin/env python3
"""The decode node's prefix pool through the whole mesh (router + 2-rank prefill group + a
decode node with --kv-pool), over HTTP:

1. Turn 1: a long prompt, prefilled by the group (kvr-e) and streamed to the decode node.
2. Turn 2: turn 1's prompt, its answer and a new sentence. The router knows (from turn 1's end)
   that the decode node's pool holds that prefix, so the node prefills only the rest itself:
   usage.pdmesh.prefill_method is "local", prompt_tokens_details.cached_tokens is the reused
   prefix, and the greedy answer equals `pdmesh generate --temp 0` on the whole turn-2 prompt
   (first 8 tokens: the pooled rows of the answer were computed by decode steps, the engine's by
   one prefill, so later tokens may part at a near-tie).
3. A prompt sharing nothing goes through the group as before (no false hit).

    python3 tests/integration/test_prefix_pool.py --bindir build/bin [--model FILE]
"""
import json
import os
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mesh import Checks, Mesh, mesh_argparser, reference  # noqa: E402

LONG = ("The capital of France is a city that many people visit because of its museums, its "
        "food, and its long history. In this short essay I will explain why the city became so "
        "important in Europe and what travellers should see first. The river that runs through "
        "it has shaped its streets for centuries, and its bridges are famous all over the world.")


def complete(port, prompt, n):
    body = json.dumps({"prompt": prompt, "max_tokens": n, "temperature": 0}).encode()
    req = urllib.request.Request("http://127.0.0.1:%d/v1/completions" % port, data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def main():
    args = mesh_argparser(__doc__.split("\n")[0]).parse_args()
    check = Checks()
    m = Mesh(args.bindir, args.model, prefill_ranks=2,
             router_args=("--method", "kvr-e", "--block-tokens", "16"),
             decode_args=("--kv-pool", "65536"))
    t0 = time.time()
    try:
        m.wait_ready()
        r1 = complete(m.http_port, LONG, 16)
        u1 = r1["usage"]
        check("turn 1 is prefilled by the group (%s) and streamed to the decode node"
              % u1["pdmesh"]["prefill_method"], u1["pdmesh"]["prefill_method"] == "kvr-e", u1)
        turn2 = LONG + r1["choices"][0]["text"] + " Which museum should I see first?"
        r2 = complete(m.http_port, turn2, 16)
        u2 = r2["usage"]
        cached = u2.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        check("turn 2 is prefilled on the decode node from its pool: %s, %d of %d prompt tokens "
              "cached, TTFT %.0f ms (turn 1: %.0f ms)"
              % (u2["pdmesh"]["prefill_method"], cached, u2["prompt_tokens"],
                 u2["pdmesh"]["ttft_ms"], u1["pdmesh"]["ttft_ms"]),
              u2["pdmesh"]["prefill_method"] == "local" and
              cached >= u1["prompt_tokens"] - 16, u2)
        ref8 = reference(args.bindir, args.model, turn2, 8)
        ref16 = reference(args.bindir, args.model, turn2, 16)
        check("turn 2's greedy answer starts as the engine's on the whole prompt (8 tokens; all "
              "16 %s)" % ("equal" if r2["choices"][0]["text"] == ref16["text"] else "not equal"),
              r2["choices"][0]["text"].startswith(ref8["text"]),
              (r2["choices"][0]["text"], ref16["text"]))
        r3 = complete(m.http_port, "Tell me about the history of the printing press in Europe, "
                      "who built the first machines, and how books changed after them.", 8)
        check("an unrelated prompt is not served from the pool (%s)"
              % r3["usage"]["pdmesh"]["prefill_method"],
              r3["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) == 0)
    finally:
        rc = m.stop()
    check("the router exits 0 on SIGTERM", rc == 0)
    print("prefix pool: %d passed, %d failed in %.0f s" % (check.passed, check.failed,
                                                            time.time() - t0))
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main())
