#!/usr/bin/env python3
"""Chunked prefill (router/request.c "Chunked prefill", issue 19) through the whole mesh: a
router with --prefill-chunk-tokens 128 and a group pool, a 2-rank prefill group (method auto)
and a decode node, over HTTP:

1. A long prompt alone: the group computes it in chunks of 128 tokens (the count the rule
   gives: while more than 128 tokens are left, one chunk), then the request's own task
   computes the rest and streams the whole prompt's KV. The answer is the engine's (`pdmesh
   generate --temp 0`, up to a near-tie); every prompt token is computed exactly once
   (pdmesh_group_prefill_tokens_total grows by the prompt's length); the usage reports no
   cached tokens (the chunks' rows were computed for this request).
2. A short prompt sent while a second long prompt is being chunked: it goes through the
   group between two chunks and completes before the long one does; both answer as the
   engine.
3. A pool budget smaller than the prompt (`pdctl policy set group_pool_tokens 64`): no chunk
   (the group could not keep the chunks between other tasks); the answer is the engine's.
4. A rank killed (SIGKILL) while a long prompt is chunked: the chunk fails or is lost with the
   group (pdmesh_prefill_chunk_failures_total), the request still completes with the
   engine's answer (prefilled elsewhere), nothing hangs.

    python3 tests/integration/test_chunked_prefill.py --bindir build/bin [--model FILE]
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

CHUNK = 128
N_OUT = 8
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def text_of(name, skip, n):
    with open(os.path.join(ROOT, "docs", name)) as f:
        return f.read()[skip:skip + n]


# Long prompts of 500-700 tokens (no common prefix), and a short one that still goes through
# the group (longer than the router's --local-threshold of 16 tokens).
LONG = [text_of("router.md", 2000, 2400), text_of("http.md", 3000, 2400),
        text_of("deployment.md", 1000, 2400), text_of("prefill.md", 500, 2400)]
SHORT = ("User: In one sentence, what is the capital of France and why do travellers like "
         "to visit it in spring?\nAssistant:")


def complete(port, prompt, n, timeout=300):
    body = json.dumps({"prompt": prompt, "max_tokens": n, "temperature": 0}).encode()
    req = urllib.request.Request("http://127.0.0.1:%d/v1/completions" % port, data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def chunks_for(n):
    """Chunks the router's rule sends for a new n-token prompt (nothing cached)."""
    k, s = 0, 0
    while n - s > CHUNK:
        s += CHUNK
        k += 1
    return k


def pdctl(m, token, *args):
    p = subprocess.run([os.path.join(m.bindir, "pdctl"), "--router", m.admin_ep,
                        "--token-file", token, "--timeout", "5000", *args],
                       capture_output=True, text=True, timeout=30)
    return p.returncode, p.stdout + p.stderr


def main():
    args = mesh_argparser(__doc__.split("\n")[0]).parse_args()
    check = Checks()
    t0 = time.time()
    refs = {}

    def ref(prompt):
        if prompt not in refs:
            refs[prompt] = reference(args.bindir, args.model, prompt, N_OUT,
                                     extra=("--logprobs", "2"))
        return refs[prompt]

    def answers(r, prompt):
        return equal_up_to_near_tie(r["choices"][0]["text"], ref(prompt))

    with tempfile.TemporaryDirectory(prefix="pdm-chunk-") as tmp:
        token = os.path.join(tmp, "token")
        with open(token, "w") as f:
            f.write(os.urandom(16).hex())
        os.chmod(token, 0o600)
        router = ("--group-pool-tokens", "8192", "--prefill-chunk-tokens", str(CHUNK),
                  "--block-tokens", "16", "--admin-token-file", token)
        m = Mesh(args.bindir, args.model, prefill_ranks=2, router_args=router)
        try:
            m.wait_ready()
            # 1. alone
            c0 = m.metric("pdmesh_prefill_chunks_total")
            g0 = m.metric("pdmesh_group_prefill_tokens_total")
            r = complete(m.http_port, LONG[0], N_OUT)
            u = r["usage"]
            n = u["prompt_tokens"]
            same, how = answers(r, LONG[0])
            chunks = m.metric("pdmesh_prefill_chunks_total") - c0
            computed = m.metric("pdmesh_group_prefill_tokens_total") - g0
            check("a %d-token prompt alone: %g chunks of %d (the rule gives %d), then its own "
                  "task (%s); it answers as the engine (%s)"
                  % (n, chunks, CHUNK, chunks_for(n), u["pdmesh"]["prefill_method"], how),
                  same and chunks == chunks_for(n) and chunks >= 3 and
                  u["pdmesh"]["prefill_method"] != "local", (u, r["choices"][0]["text"]))
            check("every prompt token computed once: the group computed %g of %d, no cached "
                  "tokens reported (%d)"
                  % (computed, n, u.get("prompt_tokens_details", {}).get("cached_tokens", 0)),
                  computed == n and
                  u.get("prompt_tokens_details", {}).get("cached_tokens", 0) == 0, u)

            # 2. a short prompt between the chunks of a long one
            c1 = m.metric("pdmesh_prefill_chunks_total")
            done = {}

            def long_job():
                done["long"] = complete(m.http_port, LONG[1], N_OUT)
                done["long_at"] = time.time()
            th = threading.Thread(target=long_job)
            th.start()
            end = time.time() + 120
            while m.metric("pdmesh_prefill_chunks_total") < c1 + 1 and th.is_alive() and \
                    time.time() < end:
                time.sleep(0.01)
            rs = complete(m.http_port, SHORT, N_OUT)
            short_at = time.time()
            th.join(300)
            rl = done.get("long")
            chunks = m.metric("pdmesh_prefill_chunks_total") - c1
            check("a short prompt sent after the first chunk of a %s-token prompt went through "
                  "the group (%s) and completed %.2f s before it; %g chunks"
                  % (rl and rl["usage"]["prompt_tokens"], rs["usage"]["pdmesh"]["prefill_method"],
                     done.get("long_at", 0) - short_at, chunks),
                  rl is not None and rs["usage"]["pdmesh"]["prefill_method"] != "local" and
                  short_at < done.get("long_at", 0) and
                  chunks == chunks_for(rl["usage"]["prompt_tokens"]),
                  (rs["usage"], rl and rl["usage"]))
            same_s, how_s = answers(rs, SHORT)
            same_l, how_l = answers(rl, LONG[1]) if rl else (False, "no answer")
            check("both answer as the engine (short: %s; long: %s)" % (how_s, how_l),
                  same_s and same_l)

            # 3. a pool that cannot hold the prompt: no chunking
            rc, out = pdctl(m, token, "policy", "set", "group_pool_tokens", "64")
            c2 = m.metric("pdmesh_prefill_chunks_total")
            r = complete(m.http_port, LONG[2], N_OUT)
            same, how = answers(r, LONG[2])
            check("group_pool_tokens 64 (policy set: rc %d): the %d-token prompt goes whole "
                  "(%g chunks) and answers as the engine (%s)"
                  % (rc, r["usage"]["prompt_tokens"], m.metric("pdmesh_prefill_chunks_total") - c2,
                     how),
                  rc == 0 and same and m.metric("pdmesh_prefill_chunks_total") == c2, r["usage"])
            rc, out = pdctl(m, token, "policy", "set", "group_pool_tokens", "8192")

            # 4. a rank dies while a prompt is chunked
            c3 = m.metric("pdmesh_prefill_chunks_total")
            f3 = m.metric("pdmesh_prefill_chunk_failures_total")
            done.clear()

            def long_job2():
                try:
                    done["long"] = complete(m.http_port, LONG[3], N_OUT)
                except OSError as e:
                    done["err"] = e
            th = threading.Thread(target=long_job2)
            t_start = time.time()
            th.start()
            end = time.time() + 120
            while m.metric("pdmesh_prefill_chunks_total") < c3 + 1 and th.is_alive() and \
                    time.time() < end:
                time.sleep(0.01)
            killed = th.is_alive()
            if killed:
                m.procs["prefill-a.1"][0].kill()
            th.join(300)
            r = done.get("long")
            same, how = answers(r, LONG[3]) if r else (False, repr(done.get("err")))
            check("rank 1 killed after the first chunk: the request completes in %.1f s (%s, "
                  "%s), answering as the engine (%s); chunk failures %g"
                  % (time.time() - t_start, r and r["usage"]["pdmesh"]["prefill_method"],
                     r and "attempts %d" % r["usage"]["pdmesh"]["attempts"], how,
                     m.metric("pdmesh_prefill_chunk_failures_total") - f3),
                  killed and same and
                  m.metric("pdmesh_prefill_chunk_failures_total") > f3,
                  (done, m.log("router")[-2000:]))
        finally:
            m.stop()
    print("chunked prefill: %d passed, %d failed in %.0f s" % (check.passed, check.failed,
                                                                time.time() - t0))
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main())
