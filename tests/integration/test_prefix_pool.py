#!/usr/bin/env python3
"""The decode nodes' prefix pools, their KV events and the router's global index, through the
whole mesh (router + 2-rank prefill group + decode nodes with --kv-pool), over HTTP:

Mesh 1, two decode nodes with pools:
1. Turn 1: a long prompt, prefilled by the group (kvr-e) and streamed to one decode node X.
   X's pool keeps its KV and X publishes the blocks (KvEvents): the router's index holds them
   (`pdctl cache`: X's index_blocks > 0).
2. Turns 2 and 3: the conversation so far and a new sentence. The index sends each to X, which
   prefills only the rest itself: prefill_method "local", cached_tokens the reused prefix, a hit
   in pdmesh_prefix_pool_hits_total, and the greedy answer (all 16 tokens) equal to the engine
   following the same conversation in its own cache (`pdmesh generate --turn`: the answers'
   rows computed by decode steps, the same rows reused, the rest prefilled in the node's
   batches of 16), which must also reuse the same number of tokens.
3. A prompt sharing nothing goes through the group (no false hit; a `no_match` miss).
4. `pdctl cache` (human and --json) shows both nodes' pools: tokens, blocks, bytes, budget, tier.
5. X restarts (SIGTERM, started again: a new epoch): the router drops its index entries; the
   next turn is a `no_match` miss, prefilled in full, and its answer is still the engine's.
   The node that served it drains (`pdctl drain`): the next turn goes to the other node, a
   `routed_elsewhere_load` miss, with the engine's answer.
Mesh 2, one decode node with a small pool (--kv-pool 160) and --fault-corrupt-pool:
6. Turn 2 of a conversation: the index sends it to the node, whose pooled prefix fails its
   checksum (the fault hook flipped a byte): it is dropped and the prompt prefilled in full
   (cached 0), an `evicted` miss and pdmesh_prefix_pool_corrupt_total count it, and the answer
   equals the engine's.
7. An unrelated prompt's KV does not fit beside the conversation's in the small pool: the
   conversation's entry is evicted (pdctl cache: evictions), the router sees the EVICTED events
   (pdmesh_kv_events_total{kind="evicted"}), and the conversation's next turn is a `no_match`.
8. Malformed events from a registered (fake, Python) decode node: keys of the wrong length, an
   unknown kind, a sequence gap, undecodable bytes: counted (malformed, stale), the node gets
   an Error for the bad frame, and the router goes on serving.
Delta transfer (issue 19; `policy set pool_local_max 0`: every follow-up goes through the group):
9. Mesh 1 at its end, the next turn with pool_delta 1: the group prefills it and streams only the rows after the
   prefix X's pool holds (block-aligned): pdmesh_pool_delta_requests_total and _tokens_total
   count it, X reports the prefix as cached, far fewer KV bytes than the whole prompt's (the
   same prompt again with pool_delta 0), and the same greedy answer (up to a near-tie at the
   engine's own top two, as the other mesh checks allow). Turn 5, whose prefix the group holds
   as well (a partial prefill): its ranks' cached runs are cut at the delta too. Then
   tsp, cp-kv and cp-q (`policy set method`; single runs on 1-rank groups only, kvr-p falls
   back to kvr-e without a partition table): a new conversation each, whose follow-up streams
   exactly the rows after the pooled prefix, with the engine's answer.
10. Mesh 2 (--fault-corrupt-pool), a follow-up with a delta: the node's pooled prefix fails its
   checksum, the node refuses the reservation (DecodeReserved.pool_miss), the router retries it
   with the whole prompt streamed (pdmesh_pool_delta_refused_total), and the answer is the
   engine's.
Mesh 3, a rolling upgrade half done: the decode node and prefill rank 1 stand in for an older
version (PDMESH_TEST_FEATURES=0: they register without protocol features):
11. `pdctl nodes` shows each node's features (older ones: none); the router logs that group a
   runs unordered because rank 1 lacks ordered tasks; a prompt through the unordered group gets
   the engine's answer; a follow-up whose prefix the node's pool holds goes through the group
   without a delta (pdmesh_pool_delta_requests_total unchanged, a `delta_unsupported` miss):
   the whole prompt's KV is streamed, and the answer is the engine's.

    python3 tests/integration/test_prefix_pool.py --bindir build/bin [--model FILE]
"""
import hashlib
import hmac
import json
import os
import struct
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mesh import (Checks, Mesh, equal_up_to_near_tie, mesh_argparser, reference,  # noqa: E402
                  reference_turns)

LONG = ("The capital of France is a city that many people visit because of its museums, its "
        "food, and its long history. In this short essay I will explain why the city became so "
        "important in Europe and what travellers should see first. The river that runs through "
        "it has shaped its streets for centuries, and its bridges are famous all over the world.")
OTHER = ("Tell me about the history of the printing press in Europe, who built the first "
         "machines, how the workshops were organised, and how books changed after them.")


def complete(port, prompt, n):
    body = json.dumps({"prompt": prompt, "max_tokens": n, "temperature": 0}).encode()
    req = urllib.request.Request("http://127.0.0.1:%d/v1/completions" % port, data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def cached_of(r):
    return r["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)


def pdctl(m, token, *args):
    p = subprocess.run([os.path.join(m.bindir, "pdctl"), "--router", m.admin_ep,
                        "--token-file", token, "--timeout", "5000", *args],
                       capture_output=True, text=True, timeout=30)
    return p.returncode, p.stdout + p.stderr


def cache_json(m, token):
    rc, out = pdctl(m, token, "--json", "cache")
    if rc:
        raise AssertionError("pdctl cache: %d %s" % (rc, out))
    d = json.loads(out)
    return {n["node_id"]: n for n in d.get("nodes", [])}, d.get("values", {})


def wait_for(what, fn, timeout=10):
    end = time.time() + timeout
    while time.time() < end:
        v = fn()
        if v:
            return v
        time.sleep(0.1)
    return fn()


def decode_args(name, node_ep, model, extra=()):
    return [name, "--model", model, "--threads", "1", "--router", node_ep, "--node-id", name,
            *extra]


def mesh_one(args, check, token):
    router = ("--method", "kvr-e", "--block-tokens", "16", "--admin-token-file", token)
    m = Mesh(args.bindir, args.model, prefill_ranks=2, router_args=router,
             decode_args=("--kv-pool", "65536"))
    dec = os.path.join(args.bindir, "pdmesh-decode")
    try:
        m._start("decode-1", [dec] + decode_args("decode-1", m.node_ep, args.model,
                                                 ("--kv-pool", "65536"))[1:])
        m.wait_ready()
        wait_for("two decode nodes", lambda: m.metric("pdmesh_nodes",
                                                      'role_state="decode_alive"') >= 2, 30)
        r1 = complete(m.http_port, LONG, 16)
        u1 = r1["usage"]
        x = u1["pdmesh"]["decode_node"]
        check("turn 1 is prefilled by the group (%s) and streamed to decode node %s"
              % (u1["pdmesh"]["prefill_method"], x), u1["pdmesh"]["prefill_method"] == "kvr-e", u1)
        nodes = wait_for("index", lambda: (lambda n: n if n.get(x, {}).get("pool", {})
                                           .get("index_blocks", 0) > 0 else None)(
                                               cache_json(m, token)[0]))
        check("%s's KV events put its pooled blocks in the router's index (%s blocks, node "
              "reports %s)" % (x, nodes and nodes[x]["pool"]["index_blocks"],
                               nodes and nodes[x]["pool"]["blocks"]),
              nodes and nodes[x]["pool"]["index_blocks"] == nodes[x]["pool"]["blocks"] > 0, nodes)
        conv = LONG + r1["choices"][0]["text"]
        prev_prompt = u1["prompt_tokens"]
        turns = [LONG]
        for turn, q in ((2, " Which museum should I see first?"),
                        (3, " And where should I eat in the evening?")):
            conv += q
            hits0 = m.metric("pdmesh_prefix_pool_hits_total")
            r = complete(m.http_port, conv, 16)
            u = r["usage"]
            check("turn %d goes by the index to %s and is prefilled there from its pool: %s on "
                  "%s, %d of %d prompt tokens cached, TTFT %.0f ms (turn 1: %.0f ms)"
                  % (turn, x, u["pdmesh"]["prefill_method"], u["pdmesh"]["decode_node"],
                     cached_of(r), u["prompt_tokens"], u["pdmesh"]["ttft_ms"],
                     u1["pdmesh"]["ttft_ms"]),
                  u["pdmesh"]["prefill_method"] == "local" and u["pdmesh"]["decode_node"] == x
                  and cached_of(r) >= prev_prompt - 16, u)
            check("turn %d counts as a pool hit" % turn,
                  m.metric("pdmesh_prefix_pool_hits_total") == hits0 + 1)
            turns.append(conv)
            ref = reference_turns(args.bindir, args.model, turns, 16,
                                  extra=("--logprobs", "2", "--batch", "16"))[-1]
            same, how = equal_up_to_near_tie(r["choices"][0]["text"], ref)
            check("turn %d's greedy answer equals the engine's continuing the conversation in "
                  "its own cache (%s; both reuse %d tokens: %d)"
                  % (turn, how, cached_of(r), ref["cached_tokens"]),
                  (r["choices"][0]["text"] == ref["text"] if how == "equal" else same) and
                  ref["cached_tokens"] == cached_of(r),
                  (r["choices"][0]["text"], ref["text"]))
            conv += r["choices"][0]["text"]
            prev_prompt = u["prompt_tokens"]
        nm0 = m.metric("pdmesh_prefix_pool_misses_total", 'reason="no_match"')
        r3 = complete(m.http_port, OTHER, 8)
        fake_node_abuse(m, check)
        fake_node_register_twice(m, check)
        check("an unrelated prompt is not served from a pool (%s) and is a no_match miss"
              % r3["usage"]["pdmesh"]["prefill_method"],
              cached_of(r3) == 0 and
              m.metric("pdmesh_prefix_pool_misses_total", 'reason="no_match"') == nm0 + 1)
        time.sleep(0.3)  # the last turn's KV events
        rc, out = pdctl(m, token, "cache")
        check("pdctl cache lists both pools (tokens, budget, blocks, bytes, tier, hit rate)",
              rc == 0 and "decode-0" in out and "decode-1" in out and "HIT_RATE" in out and
              "65536" in out and " ram " in out and "router hit_rate" in out, out)
        nodes, vals = cache_json(m, token)
        px = nodes[x]["pool"]
        check("pdctl --json cache: %s holds %d tokens in %d blocks (%d in the router's index, "
              "%d bytes), %d of %d lookups hit; router: %s"
              % (x, px["tokens"], px["blocks"], px["index_blocks"], px["bytes"], px["hits"],
                 px["lookups"], vals),
              px["tokens"] > 0 and px["bytes"] > 0 and px["blocks"] > 0 and px["hits"] == 2 and
              px["index_blocks"] == px["blocks"] and
              vals.get("hits") == 2 and vals.get("lookups", 0) >= 3, nodes)
        check("/metrics has the pool gauges of %s" % x,
              m.metric("pdmesh_prefix_pool_blocks", 'node="%s"' % x) == px["blocks"] and
              m.metric("pdmesh_prefix_pool_bytes", 'node="%s"' % x) == px["bytes"])

        # X restarts: a new epoch, its pool empty; the router forgets its blocks.
        p, log = m.procs[x]
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)
        log.close()
        m._start(x, [dec] + decode_args(x, m.node_ep, args.model, ("--kv-pool", "65536"))[1:])
        nodes = wait_for("restart", lambda: (lambda n: n if n.get(x, {}).get("state") == "alive"
                                             and n[x]["epoch"] > 0 else None)(
                                                 cache_json(m, token)[0]), 30)
        check("after %s restarted, the index holds none of its blocks (%s)"
              % (x, nodes and nodes[x]["pool"]["index_blocks"]),
              nodes and nodes[x]["pool"]["index_blocks"] == 0, nodes)
        conv += " Is it expensive?"
        nm0 = m.metric("pdmesh_prefix_pool_misses_total", 'reason="no_match"')
        r = complete(m.http_port, conv, 8)
        ref8 = reference(args.bindir, args.model, conv, 8)
        check("the next turn is a no_match miss, nothing cached (%s, %d cached), and its answer "
              "is still the engine's" % (r["usage"]["pdmesh"]["prefill_method"], cached_of(r)),
              cached_of(r) == 0 and r["choices"][0]["text"] == ref8["text"] and
              m.metric("pdmesh_prefix_pool_misses_total", 'reason="no_match"') == nm0 + 1,
              (r["choices"][0]["text"], ref8["text"]))

        # The node holding the conversation now drains: the next turn goes elsewhere.
        z = r["usage"]["pdmesh"]["decode_node"]
        conv += r["choices"][0]["text"]
        time.sleep(0.3)  # its KV events
        rc, out = pdctl(m, token, "drain", z)
        conv += " And on Sundays?"
        rl0 = m.metric("pdmesh_prefix_pool_misses_total", 'reason="routed_elsewhere_load"')
        r = complete(m.http_port, conv, 8)
        ref8 = reference(args.bindir, args.model, conv, 8)
        check("with %s (which holds the conversation) draining, the next turn goes to %s: a "
              "routed_elsewhere_load miss, and its answer is the engine's"
              % (z, r["usage"]["pdmesh"]["decode_node"]),
              rc == 0 and r["usage"]["pdmesh"]["decode_node"] != z and
              r["choices"][0]["text"] == ref8["text"] and
              m.metric("pdmesh_prefix_pool_misses_total",
                       'reason="routed_elsewhere_load"') == rl0 + 1,
              (out, r["usage"], r["choices"][0]["text"], ref8["text"]))
        pdctl(m, token, "undrain", z)
        delta_turns(m, args, check, token, conv + r["choices"][0]["text"])
        delta_methods(m, args, check, token)
    finally:
        rc = m.stop()
    check("the router exits 0 on SIGTERM", rc == 0)


def delta_turns(m, args, check, token, conv):
    """Step 9: a follow-up through the group with a delta transfer to the node holding its
    prefix, then the same prompt streamed whole, then the next turn."""
    time.sleep(0.3)  # the last turn's KV events
    rc, out = pdctl(m, token, "policy", "set", "pool_local_max", "0")
    check("policy set pool_local_max 0 (every follow-up through the group)", rc == 0, out)
    conv += (" Which of the bridges is the oldest one, and what can a visitor still see of the "
             "old city walls near it today?")
    n0, t0 = (m.metric("pdmesh_pool_delta_requests_total"),
              m.metric("pdmesh_pool_delta_tokens_total"))
    r = complete(m.http_port, conv, 16)
    u = r["usage"]
    dn, dt = (m.metric("pdmesh_pool_delta_requests_total") - n0,
              m.metric("pdmesh_pool_delta_tokens_total") - t0)
    check("a follow-up through the group (%s) to %s, which holds its prefix, takes %d tokens "
          "from the pool and receives the KV of the other %d (usage: pool_prefix_tokens %s, %d "
          "cached on the group, %d prompt tokens)"
          % (u["pdmesh"]["prefill_method"], u["pdmesh"]["decode_node"], dt,
             u["prompt_tokens"] - dt, u["pdmesh"].get("pool_prefix_tokens"), cached_of(r),
             u["prompt_tokens"]),
          u["pdmesh"]["prefill_method"] == "kvr-e" and dn == 1 and dt > 0 and dt % 16 == 0 and
          dt < u["prompt_tokens"] and u["pdmesh"].get("pool_prefix_tokens") == dt, u)
    rc, out = pdctl(m, token, "policy", "set", "pool_delta", "0")
    r_full = complete(m.http_port, conv, 16)
    uf = r_full["usage"]
    pdctl(m, token, "policy", "set", "pool_delta", "1")
    pdctl(m, token, "policy", "set", "pool_local_max", "512")
    check("the same prompt with pool_delta 0 streams all its KV: %d bytes, against %d with the "
          "delta (%.2fx; %d of %d rows)"
          % (uf["pdmesh"]["kv_bytes"], u["pdmesh"]["kv_bytes"],
             u["pdmesh"]["kv_bytes"] / max(uf["pdmesh"]["kv_bytes"], 1),
             u["prompt_tokens"] - dt, u["prompt_tokens"]),
          rc == 0 and uf["pdmesh"]["prefill_method"] == "kvr-e" and
          m.metric("pdmesh_pool_delta_requests_total") == n0 + 1 and
          0 < u["pdmesh"]["kv_bytes"] < uf["pdmesh"]["kv_bytes"] and
          u["pdmesh"]["kv_bytes"] * u["prompt_tokens"] ==
          uf["pdmesh"]["kv_bytes"] * (u["prompt_tokens"] - dt), (u, uf))
    ref = reference(args.bindir, args.model, conv, 16, extra=("--logprobs", "2"))
    same, how = equal_up_to_near_tie(r["choices"][0]["text"], ref)
    same_f, how_f = equal_up_to_near_tie(r_full["choices"][0]["text"], ref)
    check("the delta's greedy answer is the whole stream's (%s) and the engine's (%s; whole "
          "stream: %s)" % ("equal" if r["choices"][0]["text"] == r_full["choices"][0]["text"]
                           else "differs", how, how_f),
          same and same_f and (r["choices"][0]["text"] == r_full["choices"][0]["text"] or
                               how != "equal" or how_f != "equal"),
          (r["choices"][0]["text"], r_full["choices"][0]["text"], ref["text"]))
    print("delta transfer: %d prompt tokens, %d from the pool: KV streamed %d bytes with the "
          "delta, %d without" % (u["prompt_tokens"], dt, u["pdmesh"]["kv_bytes"],
                                 uf["pdmesh"]["kv_bytes"]))
    # The next turn: the group holds most of it too (its conversation: the prompt it streamed
    # whole), so its ranks stream their cached runs cut at the delta, as well as the new rows.
    per_token = uf["pdmesh"]["kv_bytes"] // uf["prompt_tokens"]
    conv += r_full["choices"][0]["text"] + (" Are the bridges lit at night, and from which one "
                                            "is the view of the river the most beautiful?")
    time.sleep(0.3)
    pdctl(m, token, "policy", "set", "pool_local_max", "0")
    n0, t0, h0 = (m.metric("pdmesh_pool_delta_requests_total"),
                  m.metric("pdmesh_pool_delta_tokens_total"),
                  m.metric("pdmesh_prefix_hits_total"))
    r5 = complete(m.http_port, conv, 16)
    pdctl(m, token, "policy", "set", "pool_local_max", "512")
    u5 = r5["usage"]
    dt5 = m.metric("pdmesh_pool_delta_tokens_total") - t0
    x = u5["pdmesh"]["decode_node"]
    ref5 = reference(args.bindir, args.model, conv, 16, extra=("--logprobs", "2"))
    same5, how5 = equal_up_to_near_tie(r5["choices"][0]["text"], ref5)
    check("a follow-up whose prefix both the group (a partial prefill: +%g group prefix hits) "
          "and %s hold: %d of %d rows streamed (%d KV bytes), the answer the engine's (%s)"
          % (m.metric("pdmesh_prefix_hits_total") - h0, x, u5["prompt_tokens"] - dt5,
             u5["prompt_tokens"], u5["pdmesh"]["kv_bytes"], how5),
          u5["pdmesh"]["prefill_method"] == "kvr-e" and cached_of(r5) > 0 and
          u5["pdmesh"].get("pool_prefix_tokens") == dt5 and
          m.metric("pdmesh_prefix_hits_total") == h0 + 1 and
          m.metric("pdmesh_pool_delta_requests_total") == n0 + 1 and dt5 > 0 and
          u5["pdmesh"]["kv_bytes"] == per_token * (u5["prompt_tokens"] - dt5) and same5,
          (u5, r5["choices"][0]["text"], ref5["text"]))



TOPICS = {"tsp": "how honey bees build their combs and decide where a new colony should live",
          "cp-kv": "the daily life of a lighthouse keeper on a small island in a winter storm",
          "cp-q": "the first electronic computers, how large they were and who programmed them"}


def delta_methods(m, args, check, token):
    """Step 9, every other method: a new conversation per method (no prefix shared with the
    others), its follow-up streamed from the node's pooled prefix on."""
    pdctl(m, token, "policy", "set", "pool_local_max", "0")
    try:
        for method, topic in TOPICS.items():
            rc, out = pdctl(m, token, "policy", "set", "method", method)
            first = ("Here is a short essay about %s. It has three parts: where it began, what "
                     "changed, and why it still matters today. First," % topic)
            r1 = complete(m.http_port, first, 16)
            per_token = r1["usage"]["pdmesh"]["kv_bytes"] // max(r1["usage"]["prompt_tokens"], 1)
            conv = (first + r1["choices"][0]["text"] +
                    " Second, and this is the part that most readers remember best,")
            time.sleep(0.3)  # the KV events
            n0, t0 = (m.metric("pdmesh_pool_delta_requests_total"),
                      m.metric("pdmesh_pool_delta_tokens_total"))
            r = complete(m.http_port, conv, 16)
            u = r["usage"]
            dt = m.metric("pdmesh_pool_delta_tokens_total") - t0
            ref = reference(args.bindir, args.model, conv, 16, extra=("--logprobs", "2"))
            same, how = equal_up_to_near_tie(r["choices"][0]["text"], ref)
            check("%s: the follow-up streams %d of %d rows (%d KV bytes, %d a token), the rest "
                  "from %s's pool; the answer the engine's (%s)"
                  % (method, u["prompt_tokens"] - dt, u["prompt_tokens"], u["pdmesh"]["kv_bytes"],
                     per_token, u["pdmesh"]["decode_node"], how),
                  rc == 0 and u["pdmesh"]["prefill_method"] == method and
                  r["choices"][0]["text"] != "" and
                  r1["usage"]["pdmesh"]["prefill_method"] == method and
                  m.metric("pdmesh_pool_delta_requests_total") == n0 + 1 and dt > 0 and
                  u["pdmesh"].get("pool_prefix_tokens") == dt and
                  u["pdmesh"]["kv_bytes"] == per_token * (u["prompt_tokens"] - dt) and same,
                  (out, r1["usage"], u, r["choices"][0]["text"], ref["text"]))
    finally:
        pdctl(m, token, "policy", "set", "method", "kvr-e")
        pdctl(m, token, "policy", "set", "pool_local_max", "512")


def delta_refused(m, args, check, token):
    """Step 10: a delta transfer to a node whose pooled prefix fails its checksum."""
    r1 = complete(m.http_port, OTHER, 16)
    kv_bytes_per_token = r1["usage"]["pdmesh"]["kv_bytes"] // r1["usage"]["prompt_tokens"]
    conv = OTHER + r1["choices"][0]["text"] + (" The first books printed in Italy were made by "
                                               "two German printers in the town of")
    time.sleep(0.3)  # the KV events
    rc, out = pdctl(m, token, "policy", "set", "pool_local_max", "0")
    ref0, c0 = (m.metric("pdmesh_pool_delta_refused_total"),
                m.metric("pdmesh_prefix_pool_corrupt_total", 'node="decode-0"'))
    r = complete(m.http_port, conv, 16)
    pdctl(m, token, "policy", "set", "pool_local_max", "512")
    u = r["usage"]
    ref = reference(args.bindir, args.model, conv, 16, extra=("--logprobs", "2"))
    same, how = equal_up_to_near_tie(r["choices"][0]["text"], ref)
    check("a delta transfer to a node whose pooled prefix fails its checksum is refused and "
          "retried with the whole prompt streamed (refused +%g, corrupt +%g, attempts %d, %d KV "
          "bytes for %d prompt tokens), the answer %r the engine's (%s)"
          % (m.metric("pdmesh_pool_delta_refused_total") - ref0,
             m.metric("pdmesh_prefix_pool_corrupt_total", 'node="decode-0"') - c0,
             u["pdmesh"].get("attempts", 0), u["pdmesh"]["kv_bytes"], u["prompt_tokens"],
             r["choices"][0]["text"], how),
          rc == 0 and m.metric("pdmesh_pool_delta_refused_total") == ref0 + 1 and
          m.metric("pdmesh_prefix_pool_corrupt_total", 'node="decode-0"') == c0 + 1 and
          u["pdmesh"]["prefill_method"] == "kvr-e" and u["pdmesh"].get("attempts") == 2 and
          u["pdmesh"]["kv_bytes"] == kv_bytes_per_token * u["prompt_tokens"] and
          r["choices"][0]["text"] != "" and same,
          (u, r["choices"][0]["text"], ref["text"]))


def mesh_two(args, check, token):
    router = ("--method", "kvr-e", "--block-tokens", "16", "--admin-token-file", token)
    m = Mesh(args.bindir, args.model, prefill_ranks=2, router_args=router,
             decode_args=("--kv-pool", "160", "--fault-corrupt-pool"))
    try:
        m.wait_ready()
        r1 = complete(m.http_port, LONG, 16)
        conv = LONG + r1["choices"][0]["text"] + " Which museum should I see first?"
        wait_for("index", lambda: cache_json(m, token)[0].get("decode-0", {}).get("pool", {})
                 .get("index_blocks", 0) > 0)
        ev0 = m.metric("pdmesh_prefix_pool_misses_total", 'reason="evicted"')
        r2 = complete(m.http_port, conv, 16)
        ref8 = reference(args.bindir, args.model, conv, 8)
        check("a corrupted pooled prefix is detected and recomputed: %s, %d cached, the answer "
              "starts as the engine's" % (r2["usage"]["pdmesh"]["prefill_method"], cached_of(r2)),
              r2["usage"]["pdmesh"]["prefill_method"] == "local" and cached_of(r2) == 0 and
              r2["choices"][0]["text"].startswith(ref8["text"]),
              (r2["choices"][0]["text"], ref8["text"]))
        time.sleep(0.3)
        check("pdmesh_prefix_pool_corrupt_total counts it (%g), and the miss is `evicted` (%g)"
              % (m.metric("pdmesh_prefix_pool_corrupt_total", 'node="decode-0"'),
                 m.metric("pdmesh_prefix_pool_misses_total", 'reason="evicted"') - ev0),
              m.metric("pdmesh_prefix_pool_corrupt_total", 'node="decode-0"') == 1 and
              m.metric("pdmesh_prefix_pool_misses_total", 'reason="evicted"') == ev0 + 1)
        conv += r2["choices"][0]["text"]
        evk0 = m.metric("pdmesh_kv_events_total", 'kind="evicted"')
        complete(m.http_port, OTHER + " " + OTHER, 16)
        time.sleep(0.3)
        nodes, _ = cache_json(m, token)
        p = nodes["decode-0"]["pool"]
        check("the small pool (160 tokens) evicted the conversation for the other prompt "
              "(evictions %d, %d tokens held) and the router saw EVICTED events (+%g)"
              % (p["evictions"], p["tokens"],
                 m.metric("pdmesh_kv_events_total", 'kind="evicted"') - evk0),
              p["evictions"] >= 1 and p["tokens"] <= 160 and
              m.metric("pdmesh_kv_events_total", 'kind="evicted"') > evk0, p)
        conv += " Is it expensive?"
        nm0 = m.metric("pdmesh_prefix_pool_misses_total", 'reason="no_match"')
        r = complete(m.http_port, conv, 8)
        ref8 = reference(args.bindir, args.model, conv, 8)
        check("the conversation's next turn is a no_match miss and its answer is the engine's",
              cached_of(r) == 0 and r["choices"][0]["text"] == ref8["text"] and
              m.metric("pdmesh_prefix_pool_misses_total", 'reason="no_match"') == nm0 + 1,
              (r["choices"][0]["text"], ref8["text"]))
        delta_refused(m, args, check, token)
    finally:
        rc = m.stop()
    check("the router exits 0 on SIGTERM", rc == 0)


def mesh_three(args, check, token):
    """Step 11: older nodes in the mesh (docs/deployment.md "Versions")."""
    router = ("--method", "kvr-e", "--block-tokens", "16", "--admin-token-file", token)
    old = {"PDMESH_TEST_FEATURES": "0"}
    m = Mesh(args.bindir, args.model, prefill_ranks=2, router_args=router,
             decode_args=("--kv-pool", "65536"),
             node_env={"decode-0": old, "prefill-a.1": old})
    try:
        m.wait_ready()
        rc, out = pdctl(m, token, "--json", "nodes")
        feats = {n["node_id"]: n.get("features") for n in json.loads(out).get("nodes", [])}
        rc2, human = pdctl(m, token, "nodes")
        check("pdctl nodes shows each node's features (%s)" % feats,
              rc == 0 and rc2 == 0 and feats == {"decode-0": "none",
                                                 "prefill-a/0": "ordered_group,delta_kv",
                                                 "prefill-a/1": "none"} and
              "FEATURES" in human, (out, human))
        check("the router says group a runs unordered because rank 1 is older",
              "group a: rank 1 (prefill-a/1) lacks ordered tasks (older version); running "
              "unordered" in m.log("router"), m.log("router")[-2000:])
        r1 = complete(m.http_port, LONG, 16)
        ref = reference(args.bindir, args.model, LONG, 16, extra=("--logprobs", "2"))
        same, how = equal_up_to_near_tie(r1["choices"][0]["text"], ref)
        check("a prompt through the unordered group (%s) gets the engine's answer (%s)"
              % (r1["usage"]["pdmesh"]["prefill_method"], how),
              r1["usage"]["pdmesh"]["prefill_method"] == "kvr-e" and same,
              (r1["choices"][0]["text"], ref["text"]))
        per_token = r1["usage"]["pdmesh"]["kv_bytes"] // r1["usage"]["prompt_tokens"]
        conv = LONG + r1["choices"][0]["text"] + " Which museum should I see first?"
        wait_for("index", lambda: cache_json(m, token)[0].get("decode-0", {}).get("pool", {})
                 .get("index_blocks", 0) > 0)
        rc, out = pdctl(m, token, "policy", "set", "pool_local_max", "0")
        n0 = m.metric("pdmesh_pool_delta_requests_total")
        u0 = m.metric("pdmesh_prefix_pool_misses_total", 'reason="delta_unsupported"')
        r = complete(m.http_port, conv, 16)
        u = r["usage"]
        ref = reference(args.bindir, args.model, conv, 16, extra=("--logprobs", "2"))
        same, how = equal_up_to_near_tie(r["choices"][0]["text"], ref)
        check("a follow-up whose prefix the older decode node holds streams its whole prompt "
              "(%d KV bytes for %d tokens, %d per token; delta requests +%g, delta_unsupported "
              "+%g) and gets the engine's answer (%s)"
              % (u["pdmesh"]["kv_bytes"], u["prompt_tokens"], per_token,
                 m.metric("pdmesh_pool_delta_requests_total") - n0,
                 m.metric("pdmesh_prefix_pool_misses_total", 'reason="delta_unsupported"') - u0,
                 how),
              rc == 0 and u["pdmesh"]["prefill_method"] == "kvr-e" and
              m.metric("pdmesh_pool_delta_requests_total") == n0 and
              m.metric("pdmesh_prefix_pool_misses_total", 'reason="delta_unsupported"') ==
              u0 + 1 and u["pdmesh"]["kv_bytes"] == per_token * u["prompt_tokens"] and same,
              (u, r["choices"][0]["text"], ref["text"]))
    finally:
        rc = m.stop()
    check("the router exits 0 on SIGTERM", rc == 0)


def frame(pb, type_, msg):
    return b"PD\x01\x00" + struct.pack(">H", type_) + b"\x00\x00" + msg.SerializeToString()


def fake_node_abuse(m, check):
    """Registers a fake decode node over the real protocol and sends it malformed KvEvents."""
    import zmq
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                    "sdk", "python"))
    from pdmesh import pdmesh_pb2 as pb
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 5000)
    s.connect(m.node_ep)
    try:
        reg = pb.Register(node_id="fake-decode", role=pb.ROLE_DECODE, model_id="x",
                          nonce=int.from_bytes(os.urandom(8), "big"),
                          timestamp_ms=int(time.time() * 1000), pid=os.getpid())
        reg.capacity.kv_tokens = 1000
        reg.capacity.max_sequences = 4
        reg.capacity.max_batch = 4
        reg.capacity.pool_tokens = 1000
        reg.ucx_address = b"\x00" * 16
        reg.proof = hmac.new(m.env["PDMESH_SECRET"].encode(), reg.node_id.encode() + b"\x00" +
                             struct.pack(">QQ", reg.nonce, reg.timestamp_ms),
                             hashlib.sha256).digest()
        s.send(frame(pb, pb.MSG_REGISTER, reg))
        raw = s.recv()
        ack = pb.RegisterAck()
        ack.ParseFromString(raw[8:])
        check("a fake decode node registers and gets the prefix key parameters (%d-byte salt, "
              "blocks of %d)" % (len(ack.prefix_salt), ack.prefix_block_tokens),
              struct.unpack(">H", raw[4:6])[0] == pb.MSG_REGISTER_ACK and
              len(ack.prefix_salt) == 16 and ack.prefix_block_tokens == 16)
        before = {k: m.metric("pdmesh_kv_events_total", 'kind="%s"' % k)
                  for k in ("malformed", "stale", "stored")}
        ev = pb.KvEvents(node_id="fake-decode", epoch=ack.epoch, seq=1)
        e = ev.events.add(kind=pb.KV_EVENT_STORED, tier=pb.KV_TIER_RAM)
        e.block_keys.extend([b"short", b"\x01" * 32, b"\x02" * 33])
        ev.events.add(kind=7, tier=pb.KV_TIER_RAM).block_keys.append(b"\x03" * 32)
        s.send(frame(pb, pb.MSG_KV_EVENTS, ev))
        ev2 = pb.KvEvents(node_id="fake-decode", epoch=ack.epoch, seq=9)  # a gap
        ev2.events.add(kind=pb.KV_EVENT_EVICTED, tier=pb.KV_TIER_RAM).block_keys.append(
            b"\x01" * 32)
        s.send(frame(pb, pb.MSG_KV_EVENTS, ev2))
        s.send(b"PD\x01\x00" + struct.pack(">H", pb.MSG_KV_EVENTS) + b"\x00\x00" +
               b"\xff\xff\xff\xff\x0f")
        err = pb.Error()
        raw = s.recv()
        err.ParseFromString(raw[8:])
        time.sleep(0.3)
        after = {k: m.metric("pdmesh_kv_events_total", 'kind="%s"' % k) for k in before}
        check("malformed KV events are counted and skipped (malformed +%g, stale +%g, stored "
              "+%g), undecodable bytes answered with %s"
              % (after["malformed"] - before["malformed"], after["stale"] - before["stale"],
                 after["stored"] - before["stored"], pb.ErrorCode.Name(err.code)),
              after["malformed"] - before["malformed"] == 3 and
              after["stale"] - before["stale"] == 1 and
              after["stored"] - before["stored"] == 1 and err.code == pb.ERR_BAD_MESSAGE)
        s.send(frame(pb, pb.MSG_DEREGISTER, pb.Deregister(node_id="fake-decode",
                                                           epoch=ack.epoch)))
        time.sleep(0.3)
    finally:
        s.close()
        ctx.term()


def fake_node_register_twice(m, check):
    """A registration sent twice (its first copy waited for a restarting router; the node sent
    it again over a fresh connection) whose older copy arrives last: the router keeps the
    node on the newer connection (docs/router.md, "A router dies"). Before, it moved the node
    to the older one, refused its heartbeats and took its next registration for a restart."""
    import zmq
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                    "sdk", "python"))
    from pdmesh import pdmesh_pb2 as pb
    ctx = zmq.Context()
    socks = []
    try:
        for _ in range(2):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVTIMEO, 3000)
            s.connect(m.node_ep)
            socks.append(s)
        new, old = socks
        now = int(time.time() * 1000)

        def register(ts):
            reg = pb.Register(node_id="fake-twice", role=pb.ROLE_DECODE, model_id="x",
                              nonce=int.from_bytes(os.urandom(8), "big"), timestamp_ms=ts,
                              pid=os.getpid(), generation=1)
            reg.capacity.kv_tokens = 1000
            reg.capacity.max_sequences = 4
            reg.capacity.max_batch = 4
            reg.ucx_address = b"\x00" * 16
            reg.proof = hmac.new(m.env["PDMESH_SECRET"].encode(), reg.node_id.encode() +
                                 b"\x00" + struct.pack(">QQ", reg.nonce, reg.timestamp_ms),
                                 hashlib.sha256).digest()
            return frame(pb, pb.MSG_REGISTER, reg)
        new.send(register(now))
        raw = new.recv()
        ack = pb.RegisterAck()
        ack.ParseFromString(raw[8:])
        old.send(register(now - 800))  # the first attempt, delivered late
        old.setsockopt(zmq.RCVTIMEO, 1000)
        try:
            old_answer = struct.unpack(">H", old.recv()[4:6])[0]
        except zmq.Again:
            old_answer = None
        new.send(frame(pb, pb.MSG_HEARTBEAT, pb.Heartbeat(node_id="fake-twice", epoch=ack.epoch)))
        raw = new.recv()
        hb_type = struct.unpack(">H", raw[4:6])[0]
        check("a registration's older copy arriving after the newer one is ignored (answer on "
              "the old connection: %s) and the node's heartbeats on the newer one are acked (%s)"
              % (old_answer, pb.MsgType.Name(hb_type)),
              old_answer is None and hb_type == pb.MSG_HEARTBEAT_ACK, (old_answer, hb_type))
        new.send(frame(pb, pb.MSG_DEREGISTER, pb.Deregister(node_id="fake-twice",
                                                             epoch=ack.epoch)))
        time.sleep(0.3)
    finally:
        for s in socks:
            s.close()
        ctx.term()


def main():
    args = mesh_argparser(__doc__.split("\n")[0]).parse_args()
    check = Checks()
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="pdm-pool-") as tmp:
        token = os.path.join(tmp, "token")
        with open(token, "w") as f:
            f.write(os.urandom(16).hex())
        os.chmod(token, 0o600)
        mesh_one(args, check, token)
        mesh_two(args, check, token)
        mesh_three(args, check, token)
    print("prefix pool: %d passed, %d failed in %.0f s" % (check.passed, check.failed,
                                                            time.time() - t0))
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main())
