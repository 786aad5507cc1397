"""The Python package (build/python/pdmesh) against a live router, or a silent socket.

    python sdk_python.py live ENDPOINT EXPECTED.json
    python sdk_python.py silent            (binds its own socket that never answers)
    python sdk_python.py unreachable
    python sdk_python.py seeds             (no router: pdmesh.seed_for_choice against the C
                                          function's values)
    python sdk_python.py nfailover         (two scripted routers: n = 2 failed over per
                                          choice, as tests/unit/test_sdk.c)
    python sdk_python.py sampling ENDPOINT PROMPT N K REF.json  (REF: pdmesh generate --json
                                          --logprobs K --presence-penalty 0.5
                                          --frequency-penalty 0.5 --logit-bias 13=-100)
    python sdk_python.py beams ENDPOINT PROMPT N DISAGG.json   (pdmesh disagg-run --beams 4
                                                              --n-best 2 --json of PROMPT)

Exit status 0 when every check holds; each failed check is printed.
"""
import json
import sys
import threading
import time

import zmq

import pdmesh

failures = []


def check(name, cond, detail=""):
    print(("ok   " if cond else "FAIL ") + name + ("" if cond else f": {detail}"))
    if not cond:
        failures.append(name)


def sampling(endpoint, prompt, n, k, ref_path):
    ref = json.load(open(ref_path))
    kw = dict(max_tokens=n, temperature=0, presence_penalty=0.5, frequency_penalty=0.5,
              logit_bias={13: -100}, logprobs=True, top_logprobs=k)
    with pdmesh.Client(endpoint, timeout=300) as c:
        r = c.generate(prompt, **kw)
        check("python sampling: tokens equal the engine's", r.tokens == ref["tokens"],
              (r.tokens, ref["tokens"]))
        want = [e["logprob"] for e in ref["logprobs"]]
        got = [e.logprob for e in r.logprobs]
        # 0.15: sdk.sh's 2-rank group quantizes activations over other row blocks than the
        # single process (sdk_itest.c LP_TOL); the tokens stay equal
        check("python logprobs equal the engine's (0.15)", len(got) == len(want) and
              all(abs(a - b) < 0.15 for a, b in zip(got, want)), (got, want))
        check("python top_logprobs: k, sorted, the chosen first",
              all(len(e.top) == k and e.top[0].token == e.token and
                  [t.logprob for t in e.top] == sorted((t.logprob for t in e.top), reverse=True)
                  for e in r.logprobs), r.logprobs[:2])
        s = c.stream(prompt, **kw)
        streamed = [e for ch in s for e in ch.logprobs]
        check("python stream: chunks carry the logprobs",
              [(e.token, e.logprob) for e in streamed] ==
              [(e.token, e.logprob) for e in r.logprobs], streamed[:2])
        seeded = [c.generate(prompt, max_tokens=n, temperature=0.8, seed=sd).text
                  for sd in (11, 11, 12)]
        check("python seed: same seed same text, another seed another",
              seeded[0] == seeded[1] != seeded[2], seeded)
        try:
            c.generate(prompt, max_tokens=n, logit_bias={5: 101})
            check("python logit_bias range checked", False)
        except pdmesh.InvalidArgumentError:
            check("python logit_bias range checked", True)


def live(endpoint, expected_path):
    expected = json.load(open(expected_path))
    with pdmesh.Client(endpoint, timeout=300) as c:
        check("python ping", c.ping(timeout=10) < 10)
        for e in expected[:2]:
            r = c.generate(e["prompt"], max_tokens=e["n"], temperature=0)
            check(f"python generate equals the engine ({e['prompt'][:20]!r})",
                  r.tokens == e["tokens"], f"{r.tokens} != {e['tokens']}")
            check("python generate usage", r.usage["completion_tokens"] == len(r.tokens) and
                  r.usage["prompt_tokens"] > 0, r.usage)
            s = c.stream(e["prompt"], max_tokens=e["n"], temperature=0)
            chunks = list(s)
            toks = [t for ch in chunks for t in ch.tokens]
            check(f"python stream equals the engine ({e['prompt'][:20]!r})",
                  toks == e["tokens"] and s.result.tokens == e["tokens"],
                  f"{toks} / {s.result.tokens} != {e['tokens']}")
            check("python stream text", "".join(ch.text for ch in chunks) == s.result.text,
                  s.result.text)
            idx = [ch.index for ch in chunks]
            check("python stream indexes in order", idx == sorted(idx) and idx[0] == 0, idx)
        e = expected[0]
        # chat messages and token ids as input
        r = c.generate(messages=[{"role": "user", "content": "What is 2+2?"}], max_tokens=8,
                       temperature=0)
        check("python chat messages", len(r.tokens) > 0 and r.usage["prompt_tokens"] > 5, r)
        r2 = c.generate(messages=[{"role": "user", "content": "What is 2+2?"}], max_tokens=8,
                        temperature=0)
        check("python chat is deterministic at temperature 0", r2.tokens == r.tokens)
        # cancel from another thread while iterating
        s = c.stream(e["prompt"], max_tokens=400, temperature=0, ignore_eos=True)
        got = []
        t0 = time.monotonic()
        try:
            for ch in s:
                got.append(ch)
                if len(got) == 1:
                    threading.Thread(target=s.cancel).start()
            check("python cancel raises CancelledError", False, "stream ended normally")
        except pdmesh.CancelledError:
            check("python cancel raises CancelledError", len(got) < 400, len(got))
        check("python cancel is prompt", time.monotonic() - t0 < 60)
        # typed router errors
        try:
            c.generate(e["prompt"], max_tokens=10_000_000, temperature=0)
            check("python: absurd max_tokens rejected", False, "accepted")
        except pdmesh.InvalidArgumentError as ex:
            check("python: absurd max_tokens rejected", ex.code == "ERR_INVALID_ARGUMENT", ex)
        # local validation
        try:
            c.generate()
            check("python: no prompt rejected", False, "accepted")
        except pdmesh.InvalidArgumentError:
            check("python: no prompt rejected", True)
        # the router still serves after all that
        r = c.generate(e["prompt"], max_tokens=e["n"], temperature=0)
        check("python: router still serving", r.tokens == e["tokens"])


def silent():
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.setsockopt(zmq.LINGER, 0)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    with pdmesh.Client(f"tcp://127.0.0.1:{port}", timeout=0.6) as c:
        t0 = time.monotonic()
        try:
            c.generate("hello", max_tokens=4)
            check("python timeout (silent router)", False, "returned")
        except pdmesh.PdmeshTimeout as ex:
            dt = time.monotonic() - t0
            check("python timeout (silent router)", 0.55 <= dt < 3.0, f"{dt:.3f} s: {ex}")
        try:
            for _ in c.stream("hello", max_tokens=4, timeout=0.4):
                pass
            check("python stream timeout", False, "returned")
        except pdmesh.PdmeshTimeout as ex:
            check("python stream timeout", ex.code == "TIMEOUT")
    s.close()
    ctx.term()


def unreachable():
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    s.close(0)
    ctx.term()
    with pdmesh.Client(f"tcp://127.0.0.1:{port}", timeout=20, connect_timeout=0.5) as c:
        t0 = time.monotonic()
        try:
            c.generate("hello")
            check("python unreachable", False, "returned")
        except pdmesh.UnreachableError as ex:
            check("python unreachable", time.monotonic() - t0 < 3, ex)


def beams(endpoint, prompt, n, ref_path):
    """Beam search through the router equals the single-process disaggregated run; not
    streamable; refused past the router's limit; ignore_eos runs to max_tokens."""
    ref = json.load(open(ref_path))["n_best"]
    with pdmesh.Client(endpoint, timeout=300) as c:
        r = c.generate(prompt, max_tokens=n, beams=4, n_best=2)
        check("python beams: the n best equal disagg-run",
              [b["tokens"] for b in r.beams] == [b["tokens"] for b in ref],
              (r.beams, ref))
        check("python beams: text and tokens are the best beam's",
              r.tokens == ref[0]["tokens"] and r.text == ref[0]["text"], (r.text, ref[0]))
        check("python beams: score and logprob",
              all(abs(a["score"] - b["score"]) < 1e-6 and abs(a["logprob"] - b["logprob"]) < 1e-6
                  for a, b in zip(r.beams, ref)), r.beams)
        try:
            for _ in c.stream(prompt, max_tokens=n, beams=4):
                pass
            check("python beams + stream refused", False, "streamed")
        except pdmesh.InvalidArgumentError as ex:
            check("python beams + stream refused", "stream" in str(ex), ex)
        try:
            c.generate(prompt, max_tokens=n, beams=9)
            check("python beams over the limit refused", False, "served")
        except pdmesh.InvalidArgumentError as ex:
            check("python beams over the limit refused", "limit" in str(ex), ex)
        yn = [{"role": "user", "content": "Reply with one word: yes or no."}]
        a = c.generate(messages=yn, max_tokens=24)
        b = c.generate(messages=yn, max_tokens=24, ignore_eos=True)
        check("python ignore_eos: EOS ends it early without, max_tokens with",
              a.finish == "eos" and len(a.tokens) < 24 and b.finish == "length" and
              len(b.tokens) == 24 and b.tokens[:len(a.tokens)] == a.tokens, (a, b))


def structured(endpoint, n):
    """Structured output: json_schema (a dict) and json_object; a refused keyword."""
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                                "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    msgs = [{"role": "user", "content": "John is 31. Give his name and age as JSON."}]
    with pdmesh.Client(endpoint, timeout=300) as c:
        r = c.generate(messages=msgs, max_tokens=n, json_schema=schema)
        try:
            v = json.loads(r.text)
            ok = isinstance(v, dict) and set(v) == {"name", "age"} and isinstance(v["age"], int)
        except ValueError:
            ok = False
        check("python json_schema: the completion validates", ok, r.text)
        s = c.stream(messages=msgs, max_tokens=n, json_schema=json.dumps(schema))
        check("python json_schema streamed (schema as text): same text",
              "".join(ch.text for ch in s) == r.text, r.text)
        r = c.generate(messages=msgs, max_tokens=n, json_object=True)
        check("python json_object: starts as a JSON object", r.text.lstrip().startswith("{"),
              r.text)
        try:
            c.generate(messages=msgs, max_tokens=n,
                       json_schema={"type": "string", "format": "email"})
            check("python json_schema: unsupported keyword refused", False)
        except pdmesh.InvalidArgumentError as e:
            check("python json_schema: unsupported keyword refused, named", "format" in str(e),
                  str(e))


def nchoices(endpoint, prompt, n):
    """n = 3: Result.choices, chunks naming their choice, usage summed; greedy choices equal;
    n = 9 refused."""
    with pdmesh.Client(endpoint, timeout=300) as c:
        r = c.generate(prompt, max_tokens=n, temperature=0.9, seed=17, n=3)
        check("python n=3: three choices, in index order",
              [x.index for x in r.choices] == [0, 1, 2], repr(r.choices))
        check("python n=3: text/tokens are choice 0's, usage sums the choices",
              r.text == r.choices[0].text and r.tokens == r.choices[0].tokens and
              r.usage["completion_tokens"] == sum(len(x.tokens) for x in r.choices))
        check("python n=3: the samples differ", len({x.text for x in r.choices}) > 1,
              repr([x.text for x in r.choices]))
        s = c.stream(prompt, max_tokens=n, temperature=0.9, seed=17, n=3)
        texts = {}
        for ch in s:
            texts[ch.choice] = texts.get(ch.choice, "") + ch.text
        check("python n=3 streamed: chunks name their choice, same texts",
              [texts.get(i) for i in range(3)] == [x.text for x in r.choices] and
              [x.text for x in s.result.choices] == [x.text for x in r.choices], repr(texts))
        g = c.generate(prompt, max_tokens=n, temperature=0, n=2)
        check("python n=2 greedy: both choices the same text",
              len(g.choices) == 2 and g.choices[0].text == g.choices[1].text)
        try:
            c.generate(prompt, max_tokens=2, n=9)
            check("python n=9 refused", False)
        except pdmesh.InvalidArgumentError:
            check("python n=9 refused", True)


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"],
        "additionalProperties": False}}}]


def tools(endpoint, n):
    """tool_choice "required" and a named function (forced by the grammar): parsed ToolCalls;
    the next turn with the call and a tool result; "none": no calls."""
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    with pdmesh.Client(endpoint, timeout=300) as c:
        r = c.generate(messages=msgs, max_tokens=n, tools=TOOLS, tool_choice="required")
        ok = len(r.tool_calls) >= 1 and r.tool_calls[0].name in ("get_weather", "get_time")
        args = r.tool_calls[0].args() if ok else None
        check("python tools required: a parsed call of one of the tools, object arguments",
              ok and isinstance(args, dict) and r.choices[0].tool_calls == r.tool_calls,
              r.text)
        if ok:
            turn = msgs + [{"role": "assistant", "content": None, "tool_calls": r.tool_calls},
                           {"role": "tool", "tool_call_id": r.tool_calls[0].id,
                            "content": json.dumps({"temperature": 21})}]
            a = c.generate(messages=turn, max_tokens=n, tools=TOOLS, tool_choice="none")
            check("python tools: the next turn (call + result) is answered, no call",
                  not a.tool_calls, a.text)
        r = c.generate(messages=msgs, max_tokens=n, tools=TOOLS,
                       tool_choice={"type": "function", "function": {"name": "get_time"}})
        check("python tools named: get_time is called",
              [t.name for t in r.tool_calls][:1] == ["get_time"], r.text)
        r = c.generate(messages=msgs, max_tokens=n, tools=TOOLS, tool_choice="required", n=2,
                       temperature=0.8, seed=3)
        check("python tools with n=2: each choice has its parsed call",
              len(r.choices) == 2 and all(x.tool_calls for x in r.choices), repr(r.choices))


# pdm_seed_for_choice / pdm_sampler_seed_for_choice (common/pdm.h) of these (seed, i): the
# values tests/unit/test_sdk.c checks the C functions against (test_seed_for_choice)
SEEDS_OF_C = [(0x5EED, 0, 0x5EED), (0x5EED, 1, 0xBF61994367A404F7),
              (0x5EED, 2, 0x8BF7AE6268510A62), (0x5EED, 3, 0xEA51EF4CE9DDB022),
              (7, 1, 0x6078BF180FF8632F), (7, 3, 0xDCFA1426C230EF5F), (42, 2, 0xFA797F03F3C87F80),
              (2**64 - 1, 0, 2**64 - 1), (2**64 - 1, 1, 0x6A5CA13BE3A3489E),
              (2**64 - 1, 3, 0x294A8675F849BEDD)]


def seeds():
    """The seed a failed-over choice is sent with equals the one the router derives."""
    got = [(s, i, pdmesh.seed_for_choice(s, i)) for s, i, _ in SEEDS_OF_C]
    check("python seed_for_choice equals the C function's values", got == SEEDS_OF_C,
          [(hex(a[2]), hex(b[2])) for a, b in zip(got, SEEDS_OF_C) if a != b])
    check("python SEED_DEFAULT is the sampler's default seed", pdmesh.SEED_DEFAULT == 0x5EED)


NFAIL_SEED = 7
NFAIL_TEXT = ["abcd", "xyz"]  # choice 0's and choice 1's completions, one token a character


class ScriptedRouter(threading.Thread):
    """A ROUTER socket in its own thread answering as test_sdk.c's peer_nfail: `first`
    streams choice 0's first two tokens and choice 1's first (keep: choice 1 whole with its
    result) for an n = 2 request, then waits; kill() closes its socket (the connection
    drops). Otherwise one choice going on alone (resume_choice) gets the rest of its text
    after its resume tokens, told apart by its seed; anything else an ERR_INVALID_ARGUMENT."""

    def __init__(self, keep):
        super().__init__(daemon=True)
        self.keep, self.requests, self.dead = keep, [], threading.Event()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = "tcp://127.0.0.1:%d" % self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.start()

    def kill(self):
        self.dead.set()
        self.join(5)

    def run(self):
        pb = pdmesh.client.pb
        while not self.dead.is_set():
            if not self.sock.poll(20):
                continue
            ident, frame = self.sock.recv_multipart()
            q = pb.GenerateRequest()
            q.ParseFromString(frame[8:])
            self.requests.append(q)

            def send(t, m):
                self.sock.send_multipart([ident, pdmesh.client.pack(t, m)])

            def chunk(choice, index, ch):
                send(pb.MSG_TOKEN_CHUNK, pb.TokenChunk(request_id=q.request_id, choice=choice,
                                                       index=index, tokens=[ord(ch)], text=ch))

            def result(choice, text):
                r = pb.GenerateResult(request_id=q.request_id, choice=choice,
                                      finish=pb.FINISH_EOS, tokens=[ord(x) for x in text],
                                      text=text)
                r.usage.prompt_tokens, r.usage.completion_tokens = 5, len(text)
                send(pb.MSG_GENERATE_RESULT, r)

            send(pb.MSG_ACCEPTED, pb.Accepted(request_id=q.request_id, router_request_id=1))
            seed = q.sampling.seed
            if q.n == 2 and not q.resume_choice and seed == NFAIL_SEED:
                chunk(0, 0, "a")
                chunk(0, 1, "b")
                for i in range(3 if self.keep else 1):
                    chunk(1, i, NFAIL_TEXT[1][i])
                if self.keep:
                    result(1, NFAIL_TEXT[1])
                continue
            k = {NFAIL_SEED: 0, pdmesh.seed_for_choice(NFAIL_SEED, 1): 1}.get(seed)
            text = NFAIL_TEXT[k] if k is not None else ""
            done = len(q.resume_tokens)
            if k is None or not q.resume_choice or q.n > 1 or \
                    list(q.resume_tokens) != [ord(x) for x in text[:done]]:
                send(pb.MSG_ERROR, pb.Error(request_id=q.request_id,
                                            code=pb.ERR_INVALID_ARGUMENT,
                                            message="nfail: unexpected request %s" % q))
                continue
            for i in range(done, len(text)):
                chunk(0, i, text[i])
            result(0, text)
        self.sock.close(0)
        self.ctx.term()


def nfailover():
    """n = 2 whose router dies after both choices delivered tokens: the unfinished choices go
    on alone at the next router (n 0, their seeds, their tokens, resume_choice), a choice
    whose result came is kept; streams contiguous, the result whole, usage summed."""
    for keep in (False, True):
        first, nxt = ScriptedRouter(keep), ScriptedRouter(keep)
        with pdmesh.Client([first.endpoint, nxt.endpoint], timeout=20) as c:
            texts, nexts, gap = ["", ""], [0, 0], False
            s = c.stream("nfail", max_tokens=8, temperature=0.8, seed=NFAIL_SEED, n=2)
            try:
                for k, ch in enumerate(s):
                    if ch.choice > 1 or ch.index != nexts[ch.choice] or len(ch.tokens) != 1:
                        gap = True
                        continue
                    texts[ch.choice] += ch.text
                    nexts[ch.choice] += 1
                    if k + 1 == (5 if keep else 3):
                        time.sleep(0.2)
                        first.kill()  # the connection drops: the call fails over
                r = s.result
                name = "python n=2 failover%s" % (" (choice 1 ended first)" if keep else "")
                check(name + ": streams contiguous, per choice", not gap and texts == NFAIL_TEXT,
                      texts)
                check(name + ": the result holds both choices, usage summed",
                      [x.text for x in r.choices] == NFAIL_TEXT and r.text == NFAIL_TEXT[0] and
                      [x.index for x in r.choices] == [0, 1] and
                      [x.finish for x in r.choices] == ["eos", "eos"] and
                      r.usage["completion_tokens"] == 7, r)
                check(name + ": only the unfinished choices went on",
                      len(nxt.requests) == (1 if keep else 2), nxt.requests)
            except pdmesh.PdmeshError as e:
                check("python n=2 failover (keep %s)" % keep, False, e)
        first.kill()
        nxt.kill()


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "live":
        live(sys.argv[2], sys.argv[3])
    elif mode == "silent":
        silent()
    elif mode == "unreachable":
        unreachable()
    elif mode == "seeds":
        seeds()
    elif mode == "nfailover":
        nfailover()
    elif mode == "beams":
        beams(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
    elif mode == "structured":
        structured(sys.argv[2], int(sys.argv[3]))
    elif mode == "nchoices":
        nchoices(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif mode == "tools":
        tools(sys.argv[2], int(sys.argv[3]))
    elif mode == "sampling":
        sampling(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    sys.exit(1 if failures else 0)
