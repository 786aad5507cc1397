#!/usr/bin/env python3
"""The prefill group's pool of conversations (prefill_node/pool.h, issue 19) through the whole
mesh (router + 2-rank prefill group, kvr-e + decode node without a pool), over HTTP:

Mesh 1, --group-pool-tokens 8192:
1. Three conversations sharing a system text, three turns each, interleaved (c1 c2 c3 c1 c2 c3
   ...): every follow-up continues its own conversation from the group's pool, not only the
   last one: cached_tokens covers the previous turn's prompt, the group computes only the rest
   (prefill_method kvr-e, not local), and every greedy answer starts as `pdmesh generate
   --temp 0` on the whole prompt (up to a near-tie, mesh.equal_up_to_near_tie).
2. `pdctl cache` shows the group's pool (tier group: tokens, entries, hits) beside the decode
   nodes; /metrics has pdmesh_group_pool_tokens / _entries.
3. The three conversations' next turns at once (queued on the group): each answers as the
   engine, no retry, and follow-ups still continue from the pool while other tasks are in
   flight (the mirror follows the tasks as they are sent).
4. A small budget (`pdctl policy set group_pool_tokens 32`): the next follow-up still takes its
   source (the budget applies after it), then the pool evicts every entry (evictions counted);
   the other conversation's follow-up finds only the system text and its answer is still the
   engine's.
Mesh 2, --group-pool-tokens 0 (the group keeps its last conversation only, as before), ranks
started with PDMESH_FAULT_CORRUPT_POOL=1:
5. The same nine turns: the same answers (each the engine's up to a near-tie), follow-ups reuse
   only the system text, and the group computes more prompt tokens than mesh 1
   (pdmesh_group_prefill_tokens_total) for the same KV bytes streamed to the decode node.
6. Pool on (`policy set group_pool_tokens 4096`), a follow-up of a pooled conversation: every
   rank's copy fails its checksum (the fault flips a byte), the ranks refuse the task together,
   pdmesh_group_pool_corrupt_total counts it, the request is retried without the pool and its
   answer is the engine's.
Mesh 3, --group-pool-tokens 8192, a decode node with its prefix pool (--kv-pool 65536) and
--pool-local-max 0 (every prompt through the group): the delta transfer (issue 19) together
with the group pool:
7. The same nine turns: each answers as the engine (up to a near-tie), every follow-up still
   continues its conversation from the group's pool (the ranks take their rows from it), and
   the decode node takes the prompt's prefix from its own pool: the ranks stream only the rows
   after it, cached or computed (pdmesh_kv_bytes_total is exactly the rows not taken from the
   pool, pdmesh_pool_delta_tokens_total, at mesh 1's bytes per token).

    python3 tests/integration/test_group_pool.py --bindir build/bin [--model FILE]
"""
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mesh import Checks, Mesh, equal_up_to_near_tie, mesh_argparser, reference  # noqa: E402

SYSTEM = ("System: You are a helpful travel assistant. You answer questions about trains, "
          "hotels, museums and food in European cities. Keep answers short, name one concrete "
          "place when you can, and say so when you do not know.\n")
FIRST = ["User: What should I see in Paris?\nAssistant:",
         "User: How do I get from Vienna to Prague?\nAssistant:",
         "User: Where can I eat well in Rome?\nAssistant:"]
MORE = [["\nUser: Is it open on Mondays?\nAssistant:", "\nUser: And the price?\nAssistant:"],
        ["\nUser: How long does it take?\nAssistant:", "\nUser: Is there a night train?\nAssistant:"],
        ["\nUser: Is it expensive?\nAssistant:", "\nUser: Do I need to book?\nAssistant:"]]
N_OUT = 8


def complete(port, prompt, n):
    body = json.dumps({"prompt": prompt, "max_tokens": n, "temperature": 0}).encode()
    req = urllib.request.Request("http://127.0.0.1:%d/v1/completions" % port, data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=180) as r:
        return json.loads(r.read())


def cached_of(r):
    return r["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)


def pdctl(m, token, *args):
    p = subprocess.run([os.path.join(m.bindir, "pdctl"), "--router", m.admin_ep,
                        "--token-file", token, "--timeout", "5000", *args],
                       capture_output=True, text=True, timeout=30)
    return p.returncode, p.stdout + p.stderr


class Refs:
    """The engine's greedy answers, computed once per prompt."""

    def __init__(self, args):
        self.args, self.cache = args, {}

    def __call__(self, prompt):
        if prompt not in self.cache:
            self.cache[prompt] = reference(self.args.bindir, self.args.model, prompt, N_OUT,
                                           extra=("--logprobs", "2"))
        return self.cache[prompt]


def conversations(m, check, refs, label, turns=3):
    """Three conversations, `turns` turns each, interleaved. Returns per turn (conversation,
    turn, prompt tokens, cached tokens, previous prompt tokens, text)."""
    conv = [SYSTEM + FIRST[c] for c in range(3)]
    prev = [0, 0, 0]
    rows = []
    for t in range(turns):
        for c in range(3):
            if t > 0:
                conv[c] += MORE[c][t - 1]
            r = complete(m.http_port, conv[c], N_OUT)
            u, text = r["usage"], r["choices"][0]["text"]
            same, how = equal_up_to_near_tie(text, refs(conv[c]))
            check("%s: conversation %d turn %d (%s, %d of %d prompt tokens cached) answers as "
                  "the engine, up to a near-tie (%s)"
                  % (label, c + 1, t + 1, u["pdmesh"]["prefill_method"], cached_of(r),
                     u["prompt_tokens"], how), same and u["pdmesh"]["prefill_method"] != "local",
                  (text, refs(conv[c])["text"], u["pdmesh"]))
            rows.append((c, t, u["prompt_tokens"], cached_of(r), prev[c], text))
            prev[c] = u["prompt_tokens"]
            conv[c] += text
    return rows, conv


def mesh_pool(args, check, token, refs):
    router = ("--method", "kvr-e", "--block-tokens", "16", "--group-pool-tokens", "8192",
              "--admin-token-file", token)
    m = Mesh(args.bindir, args.model, prefill_ranks=2, router_args=router)
    try:
        m.wait_ready()
        rows, conv = conversations(m, check, refs, "pool")
        follow = [r for r in rows if r[1] > 0]
        check("with the pool every follow-up of the three interleaved conversations reuses its "
              "previous prompt (cached / previous prompt: %s)"
              % ", ".join("%d/%d" % (r[3], r[4]) for r in follow),
              all(r[3] >= r[4] - 4 for r in follow), rows)
        computed = m.metric("pdmesh_group_prefill_tokens_total")
        total = sum(r[2] for r in rows)
        check("the group computed %d of the %d prompt tokens (the rest came from its pool)"
              % (computed, total), 0 < computed < total - sum(r[4] - 4 for r in follow) + 1)
        rc, out = pdctl(m, token, "--json", "cache")
        d = json.loads(out) if rc == 0 else {}
        g = [n for n in d.get("nodes", []) if n.get("group") == "a"]
        p = g[0].get("pool", {}) if g else {}
        check("pdctl --json cache shows the group's pool: %s" % p,
              g and p.get("tier") == "group" and p.get("entries", 0) >= 2 and
              p.get("tokens", 0) > 0 and
              p.get("hits", 0) == sum(1 for r in rows if r[3] > 0) and
              p.get("budget_tokens") == 8192, d)
        rc, out = pdctl(m, token, "cache")
        check("pdctl cache lists the group's pool (tier group)",
              rc == 0 and "group a" in out and " group " in out, out)
        check("/metrics has the group pool gauges (%g tokens, %g entries)"
              % (m.metric("pdmesh_group_pool_tokens", 'group="a"'),
                 m.metric("pdmesh_group_pool_entries", 'group="a"')),
              m.metric("pdmesh_group_pool_tokens", 'group="a"') == p.get("tokens") and
              m.metric("pdmesh_group_pool_entries", 'group="a"') == p.get("entries"))
        kv_bytes = m.metric("pdmesh_kv_bytes_total")

        # The three conversations' next turns at once: the tasks queue on the group, and each
        # follow-up is planned on the mirror of the tasks sent before it (rt_group_mirror).
        retries0 = m.metric("pdmesh_retries_total")
        hits0 = m.metric("pdmesh_prefix_hits_total")
        conc = [None] * 3
        prompts = [conv[c] + "\nUser: Anything else?\nAssistant:" for c in range(3)]

        def turn(c):
            conc[c] = complete(m.http_port, prompts[c], N_OUT)
        ths = [threading.Thread(target=turn, args=(c,)) for c in range(3)]
        for th in ths:
            th.start()
        for th in ths:
            th.join(300)
        for c in range(3):
            same, how = equal_up_to_near_tie(conc[c]["choices"][0]["text"], refs(prompts[c]))
            check("concurrent turn of conversation %d: %d of %d cached, as the engine (%s)"
                  % (c + 1, cached_of(conc[c]), conc[c]["usage"]["prompt_tokens"], how), same,
                  conc[c]["usage"])
        check("the concurrent turns needed no retry (%g) and %g of 3 continued from the group "
              "(the others were prefilled locally or in full)"
              % (m.metric("pdmesh_retries_total") - retries0,
                 m.metric("pdmesh_prefix_hits_total") - hits0),
              m.metric("pdmesh_retries_total") == retries0 and
              m.metric("pdmesh_prefix_hits_total") - hits0 >= 1)
        for c in range(3):
            conv[c] = prompts[c] + conc[c]["choices"][0]["text"]
        rows += [(c, 3, conc[c]["usage"]["prompt_tokens"], cached_of(conc[c]), 0,
                  conc[c]["choices"][0]["text"]) for c in range(3)]

        # A small budget: entries are evicted, a follow-up finds only the system text.
        rc, out = pdctl(m, token, "policy", "set", "group_pool_tokens", "32")
        check("policy set group_pool_tokens 32", rc == 0, out)
        ev0 = m.metric("pdmesh_group_pool_evictions", 'group="a"')
        # a conversation whose last turn the group prefilled (so the pool holds it), another
        a = next(c for c in range(3) if conc[c]["usage"]["pdmesh"]["prefill_method"] != "local")
        b = (a + 1) % 3
        prev1 = conc[a]["usage"]["prompt_tokens"]
        conv[a] += "\nUser: Thank you!\nAssistant:"
        r = complete(m.http_port, conv[a], N_OUT)
        same, how = equal_up_to_near_tie(r["choices"][0]["text"], refs(conv[a]))
        check("conversation %d's next turn still continues from the pool (%d of %d cached; the "
              "budget applies after its source is taken), as the engine (%s)"
              % (a + 1, cached_of(r), r["usage"]["prompt_tokens"], how),
              cached_of(r) >= prev1 - 4 and same, r["usage"])
        ev = m.metric("pdmesh_group_pool_evictions", 'group="a"')
        check("then the 32-token budget evicted the pooled conversations (%g evictions, %g "
              "tokens held)" % (ev - ev0, m.metric("pdmesh_group_pool_tokens", 'group="a"')),
              ev - ev0 >= 2 and m.metric("pdmesh_group_pool_tokens", 'group="a"') <= 32)
        prev2 = conc[b]["usage"]["prompt_tokens"]
        conv[b] += "\nUser: Thank you!\nAssistant:"
        r = complete(m.http_port, conv[b], N_OUT)
        same, how = equal_up_to_near_tie(r["choices"][0]["text"], refs(conv[b]))
        check("conversation %d's next turn, evicted, is prefilled again (%d cached, its previous "
              "prompt had %d) and answers as the engine (%s)"
              % (b + 1, cached_of(r), prev2, how), cached_of(r) < prev2 - 16 and same, r["usage"])
        return rows, computed, kv_bytes
    finally:
        m.stop()


def mesh_baseline(args, check, token, refs, pool_rows, pool_computed, pool_kv_bytes):
    router = ("--method", "kvr-e", "--block-tokens", "16", "--group-pool-tokens", "0",
              "--admin-token-file", token)
    os.environ["PDMESH_FAULT_CORRUPT_POOL"] = "1"
    try:
        m = Mesh(args.bindir, args.model, prefill_ranks=2, router_args=router)
    finally:
        del os.environ["PDMESH_FAULT_CORRUPT_POOL"]
    try:
        m.wait_ready()
        rows, _ = conversations(m, check, refs, "no pool")
        computed = m.metric("pdmesh_group_prefill_tokens_total")
        kv_bytes = m.metric("pdmesh_kv_bytes_total")
        follow = [(a, b) for a, b in zip(pool_rows, rows) if a[1] > 0]
        check("without the pool the interleaved follow-ups reuse less (cached with / without: "
              "%s)" % ", ".join("%d/%d" % (a[3], b[3]) for a, b in follow),
              all(a[3] > b[3] for a, b in follow), rows)
        check("the same nine answers with and without the pool",
              [r[5] for r in rows] == [r[5] for r in pool_rows[:len(rows)]],
              [(a[5], b[5]) for a, b in zip(pool_rows, rows) if a[5] != b[5]])
        print("prefill tokens computed by the group: %d with the pool, %d without; KV bytes to "
              "the decode node: %d with, %d without" % (pool_computed, computed, pool_kv_bytes,
                                                         kv_bytes), flush=True)
        check("the group computed fewer prompt tokens with the pool (%d) than without (%d)"
              % (pool_computed, computed), pool_computed < computed)

        # A corrupted pooled conversation: refused by every rank, recomputed, never used.
        rc, out = pdctl(m, token, "policy", "set", "group_pool_tokens", "4096")
        check("policy set group_pool_tokens 4096", rc == 0, out)
        x = SYSTEM + "User: What is the best season to visit Lisbon?\nAssistant:"
        y = SYSTEM + "User: Which museum in Madrid is the largest?\nAssistant:"
        rx = complete(m.http_port, x, N_OUT)
        complete(m.http_port, y, N_OUT)
        x += rx["choices"][0]["text"] + "\nUser: And in winter?\nAssistant:"
        c0 = m.metric("pdmesh_group_pool_corrupt_total", 'group="a"')
        r = complete(m.http_port, x, N_OUT)
        same, how = equal_up_to_near_tie(r["choices"][0]["text"], refs(x))
        check("a follow-up whose pooled KV fails its checksum on the ranks is counted (%g) and "
              "prefilled again (%s, %d cached), with the engine's answer (%s)"
              % (m.metric("pdmesh_group_pool_corrupt_total", 'group="a"') - c0,
                 r["usage"]["pdmesh"]["prefill_method"], cached_of(r), how),
              m.metric("pdmesh_group_pool_corrupt_total", 'group="a"') == c0 + 1 and same,
              r["usage"])
        logs = m.log("prefill-a.0") + m.log("prefill-a.1") + m.log("router")
        check("the refusal names the checksum", "failed its checksum" in logs or
              "could not use its pooled KV" in logs)
    finally:
        m.stop()


def mesh_delta(args, check, token, refs, pool_rows, pool_kv_bytes):
    router = ("--method", "kvr-e", "--block-tokens", "16", "--group-pool-tokens", "8192",
              "--pool-local-max", "0", "--admin-token-file", token)
    m = Mesh(args.bindir, args.model, prefill_ranks=2, router_args=router,
             decode_args=("--kv-pool", "65536"))
    try:
        m.wait_ready()
        rows, _ = conversations(m, check, refs, "pool+delta")
        follow = [r for r in rows if r[1] > 0]
        n_delta = m.metric("pdmesh_pool_delta_requests_total")
        t_delta = m.metric("pdmesh_pool_delta_tokens_total")
        kv = m.metric("pdmesh_kv_bytes_total")
        total = sum(r[2] for r in rows)
        # mesh 1 streamed every prompt whole: its bytes per prompt token
        per_token = pool_kv_bytes / sum(r[2] for r in pool_rows[:9])
        check("with both pools every follow-up continues from the group's pool (cached / "
              "previous prompt: %s; %g group prefix hits)"
              % (", ".join("%d/%d" % (r[3], r[4]) for r in follow),
                 m.metric("pdmesh_prefix_hits_total")),
              all(r[3] >= r[4] - 4 for r in follow) and
              m.metric("pdmesh_prefix_hits_total") >= len(follow), rows)
        check("and the decode node took %g prompt tokens from its own pool in %g delta transfers "
              "(%d turns, %d prompt tokens): %g KV bytes streamed, %.0f bytes a token for the "
              "rest, mesh 1 (whole prompts) %.0f"
              % (t_delta, n_delta, len(rows), total, kv, kv / max(total - t_delta, 1), per_token),
              n_delta >= len(follow) and m.metric("pdmesh_pool_delta_refused_total") == 0 and
              per_token == int(per_token) and kv == per_token * (total - t_delta) and
              kv < pool_kv_bytes / 2, (n_delta, t_delta, kv, pool_kv_bytes))
    finally:
        m.stop()


def main():
    args = mesh_argparser(__doc__.split("\n")[0]).parse_args()
    check = Checks()
    t0 = time.time()
    refs = Refs(args)
    with tempfile.TemporaryDirectory(prefix="pdm-gpool-") as tmp:
        token = os.path.join(tmp, "token")
        with open(token, "w") as f:
            f.write(os.urandom(16).hex())
        os.chmod(token, 0o600)
        rows, computed, kv_bytes = mesh_pool(args, check, token, refs)
        mesh_baseline(args, check, token, refs, rows, computed, kv_bytes)
        mesh_delta(args, check, token, refs, rows, kv_bytes)
    print("group pool: %d passed, %d failed in %.0f s" % (check.passed, check.failed,
                                                           time.time() - t0))
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main())
