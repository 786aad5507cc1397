#!/usr/bin/env python3
"""Batched prefill (router/batch.h, prefill_node/batch.c) on a real mesh: pdmesh-router, a
1-rank prefill group and two decode nodes, separate processes, over the real protocol.

- a burst of concurrent requests while the rank is busy: the router packs the waiting ones
  into one batch task (pdmesh_prefill_batch_requests histogram: a batch of 2 or more;
  pdmesh_prefill_batched_total: the rank reports them run in one engine batch;
  usage.pdmesh.prefill_method "batch"), their KV streamed to both decode nodes, every answer
  equal to the single-process engine's greedy output (`pdmesh generate --temp 0`);
- per-request outputs of batch members equal those of the same requests sent alone: the
  first token's log-probabilities (logprobs), a json_schema-constrained first token
  (response_format), a logit_bias on the first token; an echo request with prompt
  log-probabilities is never batched (the router sends it alone) and equals its lone run;
- the bounds (the mesh runs --prefill-batch-max 8): --prefill-batch-tokens smaller than two
  prompts keeps every task single;
  the default (--prefill-batch-max 1) never batches;
- a decode node killed (SIGKILL) just before a burst: members reserved on it leave their batch
  when it is declared lost and are retried; every answer still equals the engine's;
- a load-adaptive 2-rank group (--adaptive-group 2): waiting requests go to a solo rank as
  one batch (usage.pdmesh.prefill_rank names it), answers equal to the engine's.

    python3 tests/integration/test_batch_prefill.py --bindir build/bin
"""
import concurrent.futures
import json
import os
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from mesh import Checks, Mesh, equal_up_to_near_tie, mesh_argparser, reference  # noqa: E402

N = 8
BASE = ("The river wound through the valley past the mill and the old stone bridge, where "
        "travellers stopped to water their horses before the long climb to the pass. ")
PROMPTS = ["Tale %d. " % i + BASE * (1 + i % 3) + "Who built the bridge, and why?"
           for i in range(7)]
# long prompts that keep the rank busy while a burst queues behind them
FILLERS = ["Chronicle %d. " % i + BASE * 10 + "What happened at the pass?" for i in range(2)]
# prompts no decode node's prefix pool holds yet (the kill test: they must go to the group)
FRESH = ["Saga %d. " % i + BASE * (1 + i % 2) + "Where did the travellers sleep?"
         for i in range(5)]


def post(port, path, body, timeout=300):
    req = urllib.request.Request("http://127.0.0.1:%d%s" % (port, path),
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def complete(port, prompt, **kw):
    body = {"prompt": prompt, "max_tokens": N, "temperature": 0, "ignore_eos": True}
    body.update(kw)
    return post(port, "/v1/completions", body)


def burst(port, calls, first=0):
    """calls: (function, args, kwargs) run concurrently; results in order. The first `first`
    calls go 0.1 s before the others (they occupy the prefill rank, the others queue)."""
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as ex:
        futs = []
        for i, (f, a, k) in enumerate(calls):
            if first and i == first:
                time.sleep(0.1)
            futs.append(ex.submit(f, *a, **k))
        out = []
        for f in futs:
            try:
                out.append(f.result())
            except Exception as e:  # noqa: BLE001 - reported by the checks
                out.append({"error": repr(e)})
        return out


def text(res):
    return res["choices"][0]["text"] if "choices" in res else None


def px(res):
    return res.get("usage", {}).get("pdmesh", {}) if "usage" in res else {}


def hist_count(m, name, le=None):
    """A histogram's _count, or its cumulative bucket le."""
    if le is None:
        return m.metric(name + "_count")
    return m.metric(name + "_bucket", 'le="%s"' % le)


def start(args, router_args=("--prefill-batch-max", "8")):
    m = Mesh(args.bindir, args.model, prefill_ranks=1, router_args=router_args)
    m._start("decode-1", [os.path.join(args.bindir, "pdmesh-decode"), "--model", args.model,
                          "--threads", "1", "--router", m.node_ep, "--node-id", "decode-1"])
    m.wait_ready()
    end = time.time() + 60
    while time.time() < end and m.metric("pdmesh_nodes", 'role_state="decode_alive"') < 2:
        time.sleep(0.2)
    return m


def main():
    args = mesh_argparser(__doc__).parse_args()
    check = Checks()
    refs = {p: reference(args.bindir, args.model, p, N, extra=("--ignore-eos", "--logprobs", "2"))
            for p in PROMPTS + FILLERS + FRESH}

    def same(res, p):
        t = text(res)
        return t is not None and equal_up_to_near_tie(t, refs[p])[0]

    m = start(args)
    try:
        # 1. a burst: the first requests occupy the rank, the rest wait and go as one batch
        res = burst(m.http_port, [(complete, (m.http_port, p), {}) for p in PROMPTS])
        methods = [px(r).get("prefill_method") for r in res]
        nodes = {px(r).get("decode_node") for r in res}
        exact = sum(text(r) == refs[p]["text"] for r, p in zip(res, PROMPTS))
        print("# burst of %d: methods %s, decode nodes %s, %d exactly equal" % (
            len(res), methods, sorted(x for x in nodes if x), exact), flush=True)
        check("a burst: every answer equals the engine's (greedy, near-tie rule)",
              all(same(r, p) for r, p in zip(res, PROMPTS)),
              [(r.get("error") or text(r), refs[p]["text"]) for r, p in zip(res, PROMPTS)
               if not same(r, p)])
        batches = hist_count(m, "pdmesh_prefill_batch_requests")
        singles = hist_count(m, "pdmesh_prefill_batch_requests", "1")
        batched = m.metric("pdmesh_prefill_batched_total")
        check("metrics: a batch task of two or more requests was sent",
              batches - singles >= 1, (batches, singles))
        check("metrics: the rank ran them in one engine batch (PrefillResult.batch_size)",
              batched >= 2 and batched == methods.count("batch"), (batched, methods))
        check("usage: batch members are reported as prefill_method 'batch'",
              methods.count("batch") >= 2, methods)
        check("the KV went to both decode nodes", nodes >= {"decode-0", "decode-1"}, nodes)

        # 2. per-request outputs in a batch equal the lone run's
        schema = {"type": "object", "properties": {"answer": {"type": "string"}},
                  "required": ["answer"], "additionalProperties": False}
        special = [
            ("logprobs", dict(logprobs=3)),
            ("json_schema", dict(response_format={"type": "json_schema", "json_schema": {
                "name": "a", "schema": schema}})),
            ("logit_bias", dict(logit_bias={"11": 100})),
            ("echo+logprobs", dict(echo=True, logprobs=2)),
        ]
        alone = {}
        for (name, kw), p in zip(special, PROMPTS):
            alone[name] = complete(m.http_port, p, **kw)
        b0 = m.metric("pdmesh_prefill_batched_total")
        calls = [(complete, (m.http_port, p), {}) for p in FILLERS]
        calls += [(complete, (m.http_port, p), kw) for (name, kw), p in zip(special, PROMPTS)]
        calls += [(complete, (m.http_port, p), {}) for p in PROMPTS[4:]]
        res = burst(m.http_port, calls, first=len(FILLERS))
        check("the fillers' answers equal the engine's",
              all(same(r, p) for r, p in zip(res, FILLERS)), [text(r) for r in res[:2]])
        res = res[len(FILLERS):]
        got = {name: r for (name, _), r in zip(special, res)}
        for name, _ in special:
            a, g = alone[name], got[name]
            a_c = a.get("choices", [{}])[0]
            g_c = g.get("choices", [{}])[0]
            check("%s: the answer in the burst (%s) equals the lone run's" % (
                name, px(g).get("prefill_method")),
                  "error" not in g and a_c.get("text") == g_c.get("text") and
                  a_c.get("logprobs") == g_c.get("logprobs"),
                  (g.get("error"), a_c.get("text"), g_c.get("text")))
        check("echo with prompt log-probabilities is not batched",
              px(got["echo+logprobs"]).get("prefill_method") != "batch",
              px(got["echo+logprobs"]))
        check("logprobs, json_schema and logit_bias requests queued behind the fillers were "
              "prefilled in a batch",
              all(px(got[k]).get("prefill_method") == "batch"
                  for k in ("logprobs", "json_schema", "logit_bias")),
              {k: px(v).get("prefill_method") for k, v in got.items()})
        others = res[len(special):]
        check("... the rest of the burst equals the engine's",
              all(same(r, p) for r, p in zip(others, PROMPTS[4:])),
              [r.get("error") or text(r) for r in others])
        print("# special burst: methods %s, batched %d" % (
            [px(r).get("prefill_method") for r in res],
            m.metric("pdmesh_prefill_batched_total") - b0), flush=True)

        # 3. a decode node lost just before a burst
        m.procs["decode-1"][0].kill()
        res = burst(m.http_port, [(complete, (m.http_port, p), {}) for p in FILLERS[:1]] +
                    [(complete, (m.http_port, p), {}) for p in FRESH], first=1)
        check("a decode node killed before a burst: every answer equals the engine's",
              all(same(r, p) for r, p in zip(res, FILLERS[:1] + FRESH)),
              [r.get("error") or text(r) for r in res])
        print("# after the kill: methods %s, attempts %s, retries %d" % (
            [px(r).get("prefill_method") for r in res], [px(r).get("attempts") for r in res],
            m.metric("pdmesh_retries_total")), flush=True)
        check("the router exits cleanly", m.stop() == 0)
    finally:
        m.stop()

    # 4. bounds: a token budget below two prompts, and batching off
    for flags, name in ((("--prefill-batch-max", "8", "--prefill-batch-tokens", "60"),
                         "a 60-token budget"),
                        ((), "the default (--prefill-batch-max 1)")):
        m = start(args, router_args=flags)
        try:
            res = burst(m.http_port, [(complete, (m.http_port, p), {}) for p in PROMPTS[:5]])
            methods = [px(r).get("prefill_method") for r in res]
            check("%s: no batch task, answers equal the engine's" % name,
                  "batch" not in methods and
                  hist_count(m, "pdmesh_prefill_batch_requests") ==
                  hist_count(m, "pdmesh_prefill_batch_requests", "1") and
                  all(same(r, p) for r, p in zip(res, PROMPTS)), methods)
        finally:
            m.stop()

    # 5. a load-adaptive 2-rank group: the solo rank a request goes to takes a batch
    m = Mesh(args.bindir, args.model, prefill_ranks=2,
             router_args=("--adaptive-group", "2", "--prefill-batch-max", "8"))
    try:
        m.wait_ready()
        ps = FILLERS[:1] + FRESH + PROMPTS[:3]
        res = burst(m.http_port, [(complete, (m.http_port, p), {}) for p in ps], first=1)
        methods = [px(r).get("prefill_method") for r in res]
        ranks = {px(r).get("prefill_rank") for r in res if px(r).get("prefill_method") == "batch"}
        print("# adaptive 2-rank group: methods %s, batch ranks %s" % (methods, ranks), flush=True)
        check("a load-adaptive group: waiting requests go to a solo rank as one batch, every "
              "answer equal to the engine's",
              methods.count("batch") >= 2 and ranks <= {0, 1} and None not in ranks and
              m.metric("pdmesh_prefill_batched_total") >= 2 and
              all(same(r, p) for r, p in zip(res, ps)),
              (methods, ranks, [r.get("error") or text(r) for r in res]))
    finally:
        m.stop()

    print("%d passed, %d failed" % (check.passed, check.failed))
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main())
