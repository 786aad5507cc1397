#!/usr/bin/env python3
"""OpenAI's `n` through a real mesh (pdmesh-router + a prefill group of 2 ranks + a decode
node, separate processes), asked with the official openai client (docs/http.md "n").

- completions, n = 3, seeded, temperature 0.9, logprobs 2: three choices with indexes 0..2,
  each with one logprobs entry per token and its own finish_reason; choice 0 equals the same
  request with n = 1 (sample 0 keeps the request's seed); the samples differ; the same request
  again gives the same three choices; usage counts every choice's completion tokens;
- the same streamed: chunks carry their choice's index, each choice's concatenated text and
  logprobs equal the non-streamed ones, one finish_reason per choice, the usage chunk sums
  the choices;
- chat, n = 3, logprobs with top_logprobs 2, streamed and not: the same properties;
- temperature 0: every choice is the greedy completion;
- a list of 2 prompts with n = 2: 4 choices, index = prompt * n + sample;
- refusals: n = 0 and n = 9 (400 naming 'n'), n = 2 with best_of = 3.

  python3 tests/integration/test_openai_n.py [--bindir build/bin] [--model FILE]"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from mesh import Checks, Mesh, mesh_argparser  # noqa: E402

import openai  # noqa: E402

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
    ck("completions n=3: choice 0 equals the request with n=1 (the request's seed)",
       one.choices[0].text == chs[0].text, repr((one.choices[0].text, chs[0].text)))
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
                               max_tokens=6, temperature=0.9, seed=3)
    by = {x.index: x.text for x in lst.choices}
    first = c.completions.create(model="", prompt="The capital of France is", n=1,
                                 max_tokens=6, temperature=0.9, seed=3)
    ck("list of 2 prompts x n=2: 4 choices, index = prompt * n + sample",
       sorted(by) == [0, 1, 2, 3] and by[2] == first.choices[0].text, repr(by))


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
    # local threshold 0: every prompt goes through the 2-rank prefill group
    m = Mesh(args.bindir, args.model, prefill_ranks=2, local_threshold=0,
             router_args=("--method", "kvr-e"))
    try:
        m.wait_ready()
        c = openai.OpenAI(base_url="http://127.0.0.1:%d/v1" % m.http_port, api_key="none",
                          max_retries=0, timeout=300)
        check_completions(ck, c)
        check_chat(ck, c)
        check_refusals(ck, c)
    finally:
        ck("router exits 0 on SIGTERM", m.stop() == 0)
    print("%d passed, %d failed" % (ck.passed, ck.failed))
    return 1 if ck.failed else 0


if __name__ == "__main__":
    sys.exit(main())
