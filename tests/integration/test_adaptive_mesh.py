#!/usr/bin/env python3
"""Load-adaptive groups (router/adapt.h, --adaptive-group) on a real mesh: pdmesh-router, a
2-rank prefill group and a decode node as separate processes.

- one request on an idle mesh uses the whole group (not "solo"), its answer equal to the
  single-process engine's greedy output (`pdmesh generate --temp 0`), with the cost model
  (--adaptive-group 1) and with the queue rule (2);
- the rest runs the queue rule, whose choices do not depend on timings the router learns:
- a burst of concurrent requests: while requests wait, the group's ranks prefill different
  prompts alone ("solo", usage.pdmesh.prefill_rank), both ranks at once
  (pdmesh_prefill_solo_concurrent_total, pdmesh_prefill_method_total{method="solo"}), every
  answer equal to the engine's;
- solo tasks keep the group's conversation as it was: a follow-up of the prompt the group
  prefilled last (solo tasks ran after it), sent after the burst, is a partial prefill on the
  group (cached tokens > 0) whose answer equals the engine's;
- --adaptive-group 0 (the default): the same burst never runs a solo task;
- a rank killed (SIGKILL) while solo tasks run: the requests are retried (pdmesh_retries_total)
  and every answer is still the engine's.

    python3 tests/integration/test_adaptive_mesh.py --bindir build/bin
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
BASE = ("In the small harbour town the fishermen mended their nets while the gulls circled "
        "above the boats, and the children ran along the stone quay shouting at the waves. ")
# Prompts of a few hundred tokens: long enough for the group (local threshold 16) and for two
# solo prefills to overlap in time, short enough for a loaded 2-core machine. They differ from
# their first tokens on: a prompt sharing most of the group's conversation is better served by
# a partial prefill on the group than by a solo rank, and the policy knows it.
PROMPTS = ["Story number %d. " % i + BASE * 3 + "What did the old captain say about the storm?"
           for i in range(6)]
MORE = " " + BASE * 2 + "And what happened the next morning?"


def complete(port, prompt, n=N, timeout=300):
    body = json.dumps({"prompt": prompt, "max_tokens": n, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request("http://127.0.0.1:%d/v1/completions" % port, data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def burst(port, prompts):
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as ex:
        futs = [ex.submit(complete, port, p) for p in prompts]
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


def main():
    args = mesh_argparser(__doc__).parse_args()
    check = Checks()
    refs = {p: reference(args.bindir, args.model, p, N, extra=("--ignore-eos",))["text"]
            for p in PROMPTS}

    m = Mesh(args.bindir, args.model, prefill_ranks=2, router_args=("--adaptive-group", "1"))
    try:
        m.wait_ready()
        r0 = complete(m.http_port, PROMPTS[0])
        check("cost model: one request on an idle mesh uses the whole group",
              px(r0).get("prefill_method") not in ("solo", "local", None) and
              text(r0) == refs[PROMPTS[0]], (px(r0), text(r0)))
    finally:
        m.stop()

    # --pool-local-max 0: the follow-up must go to the group, not to the decode node's pool
    # batched prefill off: this test is about solo tasks of one request each
    # (test_batch_prefill.py covers batches)
    queue_rule = ("--adaptive-group", "2", "--prefill-batch-max", "1")
    m = Mesh(args.bindir, args.model, prefill_ranks=2,
             router_args=("--pool-local-max", "0") + queue_rule)
    try:
        m.wait_ready()
        r0 = complete(m.http_port, PROMPTS[0])
        check("one request on an idle mesh uses the whole group",
              px(r0).get("prefill_method") not in ("solo", "local", None) and
              px(r0).get("prefill_ranks") == 2, px(r0))
        check("... and its answer equals the engine's", text(r0) == refs[PROMPTS[0]],
              (text(r0), refs[PROMPTS[0]]))

        res = burst(m.http_port, PROMPTS[1:])
        methods = [px(r).get("prefill_method") for r in res]
        solo_ranks = {px(r).get("prefill_rank") for r in res
                      if px(r).get("prefill_method") == "solo"}
        print("# burst of %d: methods %s, solo ranks %s" % (len(res), methods, sorted(
            x for x in solo_ranks if x is not None)), flush=True)
        check("a burst: every answer equals the engine's",
              all(text(r) == refs[p] for r, p in zip(res, PROMPTS[1:])),
              [(text(r), refs[p]) for r, p in zip(res, PROMPTS[1:]) if text(r) != refs[p]])
        check("a burst: waiting requests are prefilled solo, on both ranks",
              methods.count("solo") >= 2 and solo_ranks == {0, 1}, (methods, solo_ranks))
        solo_total = m.metric("pdmesh_prefill_method_total", 'method="solo"')
        conc = m.metric("pdmesh_prefill_solo_concurrent_total", 'group="a"')
        check("metrics: solo prefills counted, two at once on the group",
              solo_total == methods.count("solo") and conc >= 1, (solo_total, conc))

        # the group holds the prompt of its last whole-group task (pipelined in arrival order:
        # the one answered last); the solo tasks ran after it
        last = max([(px(r).get("ttft_ms", 0), p) for r, p in zip(res, PROMPTS[1:])
                    if px(r).get("prefill_method") not in ("solo", None)] or
                   [(0, PROMPTS[0])])[1]
        followup = last + MORE
        # (with the engine's top two per token: the follow-up attends over the cached prefix
        # and its new rows as two KV views merged by log-sum-exp, which rounds differently
        # from one pass, so it may part at a near-tie: mesh.equal_up_to_near_tie)
        fref = reference(args.bindir, args.model, followup, N,
                         extra=("--ignore-eos", "--logprobs", "2"))
        refs[followup] = fref["text"]
        rf = complete(m.http_port, followup)
        cached = rf.get("usage", {}).get("prompt_tokens_details", {}).get("cached_tokens", 0)
        check("after solo tasks the group still holds its conversation: the follow-up is a "
              "partial prefill", cached >= 64 and px(rf).get("prefill_method") != "solo",
              (cached, px(rf)))
        same, how = equal_up_to_near_tie(text(rf), fref)
        check("... and its answer equals the engine's (up to a near-tie)", same,
              (how, text(rf), refs[followup]))
        check("the router exits cleanly", m.stop() == 0)
    finally:
        m.stop()

    m = Mesh(args.bindir, args.model, prefill_ranks=2)  # the default: off
    try:
        m.wait_ready()
        res = burst(m.http_port, PROMPTS[:4])
        methods = [px(r).get("prefill_method") for r in res]
        check("--adaptive-group 0 (default): no solo task, answers equal the engine's",
              "solo" not in methods and all(text(r) == refs[p] for r, p in zip(res, PROMPTS)),
              methods)
    finally:
        m.stop()

    m = Mesh(args.bindir, args.model, prefill_ranks=2, router_args=queue_rule)
    try:
        m.wait_ready()
        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            futs = [ex.submit(complete, m.http_port, p) for p in PROMPTS[:4]]
            end = time.time() + 120
            while time.time() < end and m.metric("pdmesh_prefill_method_total",
                                                 'method="solo"') < 2:
                time.sleep(0.02)
            solo_seen = m.metric("pdmesh_prefill_method_total", 'method="solo"')
            m.procs["prefill-a.1"][0].kill()
            res = []
            for f in futs:
                try:
                    res.append(f.result())
                except Exception as e:  # noqa: BLE001
                    res.append({"error": repr(e)})
        check("a rank killed while solo tasks run: every answer equals the engine's",
              solo_seen >= 1 and all(text(r) == refs[p] for r, p in zip(res, PROMPTS)),
              (solo_seen, [r.get("error") or text(r) for r in res]))
        check("... the failed attempts were retried",
              m.metric("pdmesh_retries_total") >= 1 or
              any(px(r).get("attempts", 1) > 1 for r in res),
              [px(r) for r in res])
    finally:
        m.stop()

    print("%d passed, %d failed" % (check.passed, check.failed))
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main())
