#!/usr/bin/env python3
"""OpenAI's `n` through a real mesh (pdmesh-router + a prefill group of 2 ranks + a decode
node, separate processes), asked with the official openai client (docs/http.md "n").

- completions, n = 3, seeded, temperature 0.9, logprobs 2: three choices with indexes 0..2,
  each with one logprobs entry per token and its own finish_reason; choice 0 draws as the same
  request with n = 1 (sample 0 keeps the request's seed; `same_draws`: the same first token,
  then the same tokens with logprobs within the engine's noise floor until they part); the
  samples differ; the same request again gives the same three choices; usage counts every
  choice's completion tokens;
- the same streamed: chunks carry their choice's index, each choice's concatenated text and
  logprobs equal the non-streamed ones, one finish_reason per choice, the usage chunk sums
  the choices;
- chat, n = 3, logprobs with top_logprobs 2, streamed and not: the same properties;
- temperature 0: every choice is the greedy completion;
- a list of 2 prompts with n = 2: 4 choices, index = prompt * n + sample;
- refusals: n = 0 and n = 9 (400 naming 'n'), n = 2 with best_of = 3.

The choices share one prompt (decode_node/nsamp.h, docs/http.md "n"):
- n = 4 is prefilled and its KV transferred once: pdmesh_prefill_tokens_total{where="group"}
  grows by the prompt's tokens, pdmesh_prefill_method_total by one task and
  pdmesh_kv_bytes_total by one prompt's KV, exactly as for the same request with n = 1;
- temperature 0, n = 4: every choice is the engine's greedy text (up to a near-tie);
- seeded, n = 3 (3 seeds, over ZeroMQ for exact 64-bit seeds): choice i draws as the request
  with n = 1 and the seed pdm_sampler_seed_for_choice(seed, i) (choice i of the per-choice
  path before sharing), by `same_draws`: its first token is the same (the prefill rank's
  logits), the tokens after it too until the two paths' rounding (segmented cache vs one
  contiguous cache, docs/http.md "n") moves a draw;
- stop strings (n = 4, streamed and not) and a json_schema (n = 3) apply to each choice;
- a decode node SIGKILLed mid-stream (n = 3, seeded, 160 tokens each, streamed): every
  unfinished choice goes on alone on the other node from its delivered tokens and the output,
  streamed and whole, equals the undisturbed run's; the migrations are counted.

  python3 tests/integration/test_openai_n.py [--bindir build/bin] [--model FILE]"""
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from mesh import Checks, Mesh, equal_up_to_near_tie, mesh_argparser, reference  # noqa: E402

import openai  # noqa: E402

sys.path.insert(0, os.path.join(HERE, "..", "..", "build", "python"))
import pdmesh  # noqa: E402

PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
CHAT = [{"role": "user", "content": "Write one sentence about the sea and the wind."}]
N = 3


def completion_tokens(ch):
    return len(ch.logprobs.tokens)


def check_completions(ck, c):
    kw = dict(model="", prompt=PROMPT, max_tokens=12, temperature=0.9, seed=7, logprobs=2)
    r = c.completions.create(n=N, **kw)
    chs = sorted(r.choices, key=lambda x: x.index)
    ck("completions n=3: three choices, indexes 0..2", [x.index for x in chs] == list(range(N)),
       repr([x.index for x in r.choices]))
    ck("completions n=3: logprobs per choice, one entry per token",
       all(x.logprobs and len(x.logprobs.token_logprobs) == len(x.logprobs.tokens) > 0 and
           all(len(t) >= 1 for t in x.logprobs.top_logprobs) for x in chs))
    ck("completions n=3: a finish_reason per choice",
       all(x.finish_reason in ("length", "stop") for x in chs))
    ck("completions n=3: usage counts every choice's tokens",
       r.usage.completion_tokens == sum(completion_tokens(x) for x in chs),
       "%d vs %r" % (r.usage.completion_tokens, [completion_tokens(x) for x in chs]))
    one = c.completions.create(n=1, **kw)
    ok, what = same_draws(chs[0].logprobs, one.choices[0].logprobs)
    ck("completions n=3: choice 0 draws as the request with n=1 (the request's seed)", ok,
       "%s: %r" % (what, (one.choices[0].text, chs[0].text)))
    ck("completions n=3: the samples differ", len({x.text for x in chs}) > 1,
       repr([x.text for x in chs]))
    again = sorted(c.completions.create(n=N, **kw).choices, key=lambda x: x.index)
    ck("completions n=3: same seed and prompt, same three choices",
       [x.text for x in again] == [x.text for x in chs])

    stream = list(c.completions.create(n=N, stream=True,
                                       stream_options={"include_usage": True}, **kw))
    texts, lps, fins = {}, {}, {}
    for chunk in stream:
        for x in chunk.choices:
            texts[x.index] = texts.get(x.index, "") + x.text
            if x.logprobs:
                lps.setdefault(x.index, []).extend(x.logprobs.token_logprobs)
            if x.finish_reason:
                fins[x.index] = fins.get(x.index, []) + [x.finish_reason]
    ck("completions n=3 streamed: chunks carry their index, texts equal the non-streamed",
       [texts.get(i) for i in range(N)] == [x.text for x in chs], repr(texts))
    ck("completions n=3 streamed: logprobs per choice equal the non-streamed",
       [lps.get(i) for i in range(N)] == [x.logprobs.token_logprobs for x in chs])
    ck("completions n=3 streamed: one finish_reason per choice",
       fins == {i: [chs[i].finish_reason] for i in range(N)}, repr(fins))
    ck("completions n=3 streamed: the usage chunk sums the choices",
       stream[-1].usage is not None and
       stream[-1].usage.completion_tokens == r.usage.completion_tokens)

    g = c.completions.create(model="", prompt=PROMPT, max_tokens=10, temperature=0, n=N)
    ck("completions n=3, temperature 0: every choice is the greedy completion",
       len({x.text for x in g.choices}) == 1 and len(g.choices) == N)

    lst = c.completions.create(model="", prompt=[PROMPT, "The capital of France is"], n=2,
                               max_tokens=6, temperature=0.9, seed=3, logprobs=1)
    by = {x.index: x for x in lst.choices}
    first = c.completions.create(model="", prompt="The capital of France is", n=1,
                                 max_tokens=6, temperature=0.9, seed=3, logprobs=1)
    ok, what = same_draws(by[2].logprobs, first.choices[0].logprobs) if 2 in by else (False, "")
    ck("list of 2 prompts x n=2: 4 choices, index = prompt * n + sample",
       sorted(by) == [0, 1, 2, 3] and ok, "%s %r" % (what, {k: x.text for k, x in by.items()}))


def check_chat(ck, c):
    kw = dict(model="", messages=CHAT, max_tokens=12, temperature=0.9, seed=11, logprobs=True,
              top_logprobs=2)
    r = c.chat.completions.create(n=N, **kw)
    chs = sorted(r.choices, key=lambda x: x.index)
    ck("chat n=3: three choices, indexes 0..2", [x.index for x in chs] == list(range(N)))
    ck("chat n=3: logprobs per choice (top_logprobs 2)",
       all(x.logprobs and x.logprobs.content and
           all(len(t.top_logprobs) == 2 for t in x.logprobs.content) for x in chs))
    ck("chat n=3: usage counts every choice's tokens",
       r.usage.completion_tokens == sum(len(x.logprobs.content) for x in chs),
       "%d vs %r" % (r.usage.completion_tokens, [len(x.logprobs.content) for x in chs]))
    ck("chat n=3: the samples differ", len({x.message.content for x in chs}) > 1)
    stream = list(c.chat.completions.create(n=N, stream=True,
                                            stream_options={"include_usage": True}, **kw))
    texts, n_lp, fins = {}, {}, {}
    for chunk in stream:
        for x in chunk.choices:
            texts[x.index] = texts.get(x.index, "") + (x.delta.content or "")
            if x.logprobs and x.logprobs.content:
                n_lp[x.index] = n_lp.get(x.index, 0) + len(x.logprobs.content)
            if x.finish_reason:
                fins[x.index] = x.finish_reason
    ck("chat n=3 streamed: chunks carry their index, contents equal the non-streamed",
       [texts.get(i) for i in range(N)] == [x.message.content for x in chs], repr(texts))
    ck("chat n=3 streamed: logprobs per choice",
       [n_lp.get(i) for i in range(N)] == [len(x.logprobs.content) for x in chs])
    ck("chat n=3 streamed: a finish_reason per choice",
       fins == {i: chs[i].finish_reason for i in range(N)}, repr(fins))
    ck("chat n=3 streamed: the usage chunk sums the choices",
       stream[-1].usage is not None and
       stream[-1].usage.completion_tokens == r.usage.completion_tokens)


MASK = (1 << 64) - 1


def same_draws(a, b, tol=0.5):
    """Whether two seeded completions (their completions logprobs) are the same draws up to
    the engine's noise floor: the same first token (drawn from the same logits with the same
    seed), then the same tokens until the first where they part, with every shared token's
    log-probability within `tol` of the other's. The shared choices compute their steps over
    the segmented cache, a request of its own over one contiguous cache; on the Q4_1 model the
    two round a token's logits apart by up to a few tenths (docs/http.md "n"), which moves a
    seeded draw's boundaries a little: a later token may then differ."""
    ta, tb = a.tokens, b.tokens
    if not ta or not tb or ta[0] != tb[0]:
        return False, "first tokens %r / %r" % (ta[:1], tb[:1])
    k = 0
    while k < min(len(ta), len(tb)) and ta[k] == tb[k]:
        if abs(a.token_logprobs[k] - b.token_logprobs[k]) > tol:
            return False, "token %d: logprobs %.3f / %.3f" % (k, a.token_logprobs[k],
                                                              b.token_logprobs[k])
        k += 1
    return True, "the same %d tokens%s" % (k, "" if k == len(ta) == len(tb) else
                                          ", then parted")


def seed_for_choice(seed, i):
    """pdm_sampler_seed_for_choice (model/sampler.c): choice i's seed."""
    if i == 0:
        return seed
    x = (seed ^ ((i * 0xD1B54A32D192ED03) & MASK)) & MASK
    z = x = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


class Lp:
    """A pdmesh Result's or Choice's tokens and logprobs in the openai client's shape."""

    def __init__(self, r):
        self.tokens = list(r.tokens)
        self.token_logprobs = [x.logprob for x in r.logprobs]


def counters(m):
    return (m.metric("pdmesh_prefill_tokens_total", 'where="group"'),
            m.metric("pdmesh_prefill_method_total", 'method="kvr-e"'),
            m.metric("pdmesh_kv_bytes_total"))


def check_shared(ck, c, m, args):
    kw = dict(model="", prompt=PROMPT, max_tokens=8, temperature=0.9, seed=5)
    a = counters(m)
    one = c.completions.create(n=1, **kw)
    b = counters(m)
    four = c.completions.create(n=4, **kw)
    d = counters(m)
    grow1 = [y - x for x, y in zip(a, b)]
    grow4 = [y - x for x, y in zip(b, d)]
    ck("n=4: the prompt is prefilled once (prefill tokens, tasks and KV bytes grow as for n=1)",
       grow4 == grow1 and grow1[0] == one.usage.prompt_tokens and grow1[1] == 1 and grow1[2] > 0,
       "n=1 %r, n=4 %r" % (grow1, grow4))
    ck("n=4: usage counts the prompt once and every choice's tokens",
       four.usage.prompt_tokens == one.usage.prompt_tokens and len(four.choices) == 4,
       repr(four.usage))

    ref = reference(args.bindir, args.model, PROMPT, 16, extra=("--logprobs", "2"))
    g = c.completions.create(model="", prompt=PROMPT, max_tokens=16, temperature=0, n=4)
    for x in sorted(g.choices, key=lambda x: x.index):
        ok, what = equal_up_to_near_tie(x.text, ref)
        ck("n=4, temperature 0: choice %d is the engine's greedy text" % x.index, ok,
           "%s: %r vs %r" % (what, x.text, ref["text"]))

    # choice i against a request of its own with the derived seed: over ZeroMQ (the Python
    # package), whose 64-bit seeds are exact (JSON numbers above 2^53 are not)
    with pdmesh.Client(m.client_ep, timeout=300) as z:
        for seed in (21, 22, 23):
            three = z.generate(PROMPT, max_tokens=12, temperature=0.9, seed=seed, n=3,
                               logprobs=True).choices
            for i, x in enumerate(three):
                alone = z.generate(PROMPT, max_tokens=12, temperature=0.9,
                                   seed=seed_for_choice(seed, i), logprobs=True)
                ok, what = same_draws(Lp(x), Lp(alone))
                ck("seeded n=3 (seed %d): choice %d draws as the request with n=1 and its "
                   "derived seed" % (seed, i), ok, "%s: %r" % (what, (x.text, alone.text)))


def check_per_choice(ck, c):
    """Stop strings, max_tokens and a JSON schema apply to each shared choice on its own."""
    kw = dict(model="", prompt=PROMPT, max_tokens=40, temperature=1.0, seed=9, n=4,
              stop=[".", ","])
    r = sorted(c.completions.create(**kw).choices, key=lambda x: x.index)
    ck("n=4 with stop strings: no choice holds one, each has its own finish_reason",
       all("." not in x.text and "," not in x.text and x.finish_reason in ("stop", "length")
           for x in r), repr([(x.text, x.finish_reason) for x in r]))
    texts, fins = stream_choices(c, kw)
    ck("n=4 with stop strings, streamed: each choice's text and finish as not streamed",
       [texts.get(i) for i in range(4)] == [x.text for x in r] and
       [fins.get(i) for i in range(4)] == [x.finish_reason for x in r], repr((texts, fins)))
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                                "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    j = c.chat.completions.create(
        model="", n=3, max_tokens=60, temperature=0.8, seed=4,
        messages=[{"role": "user", "content": "John is 31. Give his name and age as JSON."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "p", "schema": schema, "strict": True}})
    import json as _json
    good = 0
    for x in j.choices:
        try:
            v = _json.loads(x.message.content)
            good += isinstance(v, dict) and set(v) == {"name", "age"} and \
                isinstance(v["age"], int)
        except ValueError:
            pass
    ck("n=3 with a json_schema: every choice's content validates (a matcher per sample)",
       good == 3 and len(j.choices) == 3, repr([x.message.content for x in j.choices]))


def stream_choices(c, kw, on_chunk=None):
    texts, fins, k = {}, {}, 0
    for chunk in c.completions.create(stream=True, **kw):
        for x in chunk.choices:
            texts[x.index] = texts.get(x.index, "") + x.text
            if x.finish_reason:
                fins[x.index] = x.finish_reason
        k += 1
        if on_chunk:
            on_chunk(k)
    return texts, fins


def check_kill(ck, c, m):
    """A decode node SIGKILLed mid-stream: the choices go on alone on the other node."""
    kw = dict(model="", prompt=PROMPT, max_tokens=160, temperature=0.8, seed=77, n=3,
              extra_body={"ignore_eos": True})
    ref = sorted(c.completions.create(**kw).choices, key=lambda x: x.index)
    mig0 = m.metric("pdmesh_migrations_total")
    before = m.log("router").count("attempt 1 ->")
    killed = []

    def kill_at(k):
        if k != 40 or killed:
            return
        lines = [x for x in m.log("router").splitlines() if "attempt 1 ->" in x]
        victim = lines[before:][-1].split("-> ")[1].split(" ")[0] if len(lines) > before else ""
        if victim in m.procs:
            m.procs[victim][0].kill()
            killed.append(victim)

    texts, fins = stream_choices(c, kw, kill_at)
    ck("kill: a decode node was killed mid-stream", len(killed) == 1, repr(killed))
    ck("kill -9 mid-stream, n=3 seeded: every choice equals the undisturbed run's",
       [texts.get(i) for i in range(3)] == [x.text for x in ref] and
       all(fins.get(i) == "length" for i in range(3)),
       repr((texts, [x.text for x in ref])))
    ck("kill: the choices migrated (pdmesh_migrations_total)",
       m.metric("pdmesh_migrations_total") >= mig0 + 1)


def check_refusals(ck, c):
    for kw, what in (({"n": 0}, "n = 0"), ({"n": 9}, "n = 9"),
                     ({"n": 2, "best_of": 3}, "n = 2 with best_of = 3")):
        try:
            c.completions.create(model="", prompt="hi", max_tokens=2, **kw)
            ck("refused: " + what, False)
        except openai.BadRequestError as ex:
            ck("refused: " + what + " (400 naming 'n')", "'n'" in str(ex), str(ex))


def main():
    ap = mesh_argparser(__doc__)
    args = ap.parse_args()
    ck = Checks()
    os.environ["PDMESH_LOG"] = "info"  # the router logs where each attempt goes
    # local threshold 0: every prompt goes through the 2-rank prefill group
    m = Mesh(args.bindir, args.model, prefill_ranks=2, local_threshold=0,
             router_args=("--method", "kvr-e", "--heartbeat-ms", "300", "--lease-ms", "1500"))
    # a second decode node, where the choices go on when the first is killed
    m._start("decode-1", [os.path.join(args.bindir, "pdmesh-decode"), "--model", args.model,
                          "--threads", "1", "--router", m.node_ep, "--node-id", "decode-1"])
    try:
        m.wait_ready()
        for _ in range(100):  # both decode nodes registered
            if m.metric("pdmesh_nodes", 'role_state="decode_alive"') >= 2:
                break
            time.sleep(0.1)
        c = openai.OpenAI(base_url="http://127.0.0.1:%d/v1" % m.http_port, api_key="none",
                          max_retries=0, timeout=300)
        check_completions(ck, c)
        check_chat(ck, c)
        check_refusals(ck, c)
        check_shared(ck, c, m, args)
        check_per_choice(ck, c)
        check_kill(ck, c, m)
    finally:
        ck("router exits 0 on SIGTERM", m.stop() == 0)
    print("%d passed, %d failed" % (ck.passed, ck.failed))
    return 1 if ck.failed else 0


if __name__ == "__main__":
    sys.exit(main())
