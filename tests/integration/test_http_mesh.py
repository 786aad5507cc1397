#!/usr/bin/env python3
"""The HTTP API of a real mesh (pdmesh-router + a prefill group + a decode node, separate
processes, ZeroMQ control plane, KV over UCX):

- curl and the official openai client, streaming and not, completions and chat: outputs at
  temperature 0 equal `pdmesh generate --temp 0` (the single-process engine);
- 32 concurrent HTTP clients, each output equal to the engine's greedy output, while other
  clients send malformed requests (bad JSON, huge body, absurd max_tokens, unknown path,
  wrong method) and get errors;
- best_of: a beam search whose best beam is the answer, equal to `pdmesh disagg-run --beams`
  (not streamable: a 400 with stream);
- sampling as OpenAI clients use it (completions and chat, streamed and not, through the
  prefill group and through local prefill): logprobs / top_logprobs equal the engine's
  (`pdmesh generate --logprobs K`) within LOGPROB_TOL, sorted, the greedy token first; the same
  seed gives the same text at temperature 0.8 (and the engine's, with the same parameters),
  another seed another text; frequency_penalty removes repeats as the engine does; logit_bias
  -100 on the greedy first token changes it, +100 on a token forces it;
- a client that disconnects mid-stream cancels its request (pdmesh_requests_total{outcome=
  "cancelled"});
- a real Prometheus server scrapes /metrics and its query API returns pdmesh_requests_total;
- the router shuts down cleanly on SIGTERM.

  python3 tests/integration/test_http_mesh.py [--bindir build/bin] [--model FILE]"""
import json
import os
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "http"))
from httptest import Reader, call, connect, request_bytes, sse_events, wait_for  # noqa: E402
from mesh import Mesh, mesh_argparser, reference  # noqa: E402

N_TOKENS = 12
# Short prompts are prefilled by the decode node (conditional disaggregation), long ones by
# the prefill group and streamed: both paths are exercised.
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "Write a short list of three fruits and three vegetables, then explain which one of them "
    "has the most vitamin C and why people in cold countries should eat more of it in winter.",
    "The quick brown fox jumps over the lazy dog. " * 6,
]
CHAT = "Why is the sky blue?"
METHODS = set()  # usage.pdmesh.prefill_method of the non-streamed answers


def completion(port, prompt, stream, chat=False, timeout=300):
    body = {"max_tokens": N_TOKENS, "temperature": 0, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    r = call(port, "POST", "/v1/chat/completions" if chat else "/v1/completions", body,
             timeout=timeout)
    assert r.status == 200, r
    if not stream:
        METHODS.add(r.json()["usage"]["pdmesh"]["prefill_method"])
        c = r.json()["choices"][0]
        return c["message"]["content"] if chat else c["text"]
    ev = sse_events(r.body)
    assert ev and ev[-1] == "[DONE]", r.body[-500:]
    out = []
    for e in ev[:-1]:
        j = json.loads(e)
        for ch in j["choices"]:
            out.append(ch["delta"].get("content") or "" if chat else ch["text"])
    return "".join(out)


# |mesh - engine| for one log-probability: the prefill group's logits differ from the single
# process's by float rounding only (ARCHITECTURE.md: every path equals the reference within
# tolerance); the log-softmax of logits of magnitude ~20 in float32 keeps that within 1e-3.
LOGPROB_TOL = 2e-3
LP_PROMPTS = [PROMPTS[3], PROMPTS[0]]  # the prefill group's path, then local prefill


def check_logprobs(port, bindir, model_path, model):
    import openai
    cl = openai.OpenAI(base_url="http://127.0.0.1:%d/v1" % port, api_key="unused",
                       max_retries=0, timeout=300)
    worst = 0.0

    def close(got, want, what):
        nonlocal worst
        assert len(got) == len(want), (what, got, want)
        for a, b in zip(got, want):
            worst = max(worst, abs(a - b))
            assert abs(a - b) < LOGPROB_TOL, (what, got, want)

    def sorted_with_chosen(top, chosen, what):
        vals = [v for _, v in top]
        assert vals == sorted(vals, reverse=True), (what, top)
        assert abs(vals[0] - chosen) < 1e-6, (what, top, chosen)  # greedy: the best one

    for k in (1, 5):
        for p in LP_PROMPTS:
            ref = reference(bindir, model_path, p, N_TOKENS, extra=["--logprobs", str(k)])
            want = [e["logprob"] for e in ref["logprobs"]]
            want_top = [[t["logprob"] for t in e["top"]] for e in ref["logprobs"]]
            c = cl.completions.create(model=model, prompt=p, max_tokens=N_TOKENS,
                                      temperature=0, logprobs=k)
            lp = c.choices[0].logprobs
            assert c.choices[0].text == ref["text"], (c.choices[0].text, ref["text"])
            assert "".join(lp.tokens) == ref["text"], lp.tokens
            close(lp.token_logprobs, want, "completions")
            for i, top in enumerate(lp.top_logprobs):
                items = sorted(top.items(), key=lambda kv: -kv[1])
                assert len(items) == k, top
                sorted_with_chosen(items, lp.token_logprobs[i], "completions top")
                close([v for _, v in items], want_top[i], "completions top")
            assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset), lp
            # streamed: the same entries, spread over the chunks
            got, tokens = [], []
            for ch in cl.completions.create(model=model, prompt=p, max_tokens=N_TOKENS,
                                            temperature=0, logprobs=k, stream=True):
                if ch.choices and ch.choices[0].logprobs:
                    got += ch.choices[0].logprobs.token_logprobs
                    tokens += ch.choices[0].logprobs.tokens
            assert tokens == lp.tokens, (tokens, lp.tokens)
            close(got, want, "completions stream")
        # chat (a short prompt: local prefill), stream and not
        ref = reference(bindir, model_path, CHAT, N_TOKENS, chat=True,
                        extra=["--logprobs", str(k)])
        want = [e["logprob"] for e in ref["logprobs"]]
        msgs = [{"role": "user", "content": CHAT}]
        c = cl.chat.completions.create(model=model, messages=msgs, max_tokens=N_TOKENS,
                                       temperature=0, logprobs=True, top_logprobs=k)
        content = c.choices[0].logprobs.content
        assert [t.token for t in content] and c.choices[0].message.content == ref["text"], c
        close([t.logprob for t in content], want, "chat")
        for t, e in zip(content, ref["logprobs"]):
            sorted_with_chosen([(x.token, x.logprob) for x in t.top_logprobs], t.logprob, "chat")
            assert len(t.top_logprobs) == k and t.top_logprobs[0].token == t.token, t
            assert bytes(t.bytes).decode("utf-8", "replace").replace("\ufffd", "?") == \
                e["text"] or not e["text"].isascii(), (t, e)
        got = []
        for ch in cl.chat.completions.create(model=model, messages=msgs, max_tokens=N_TOKENS,
                                             temperature=0, logprobs=True, top_logprobs=k,
                                             stream=True):
            if ch.choices and ch.choices[0].logprobs:
                got += [t.logprob for t in ch.choices[0].logprobs.content]
        close(got, want, "chat stream")
    print("  logprobs: largest |mesh - engine| %.2e (tolerance %.0e)" % (worst, LOGPROB_TOL))


def comp_text(port, body, chat=False):
    r = call(port, "POST", "/v1/chat/completions" if chat else "/v1/completions", body,
             timeout=300)
    assert r.status == 200, (body, r)
    c = r.json()["choices"][0]
    return c["message"]["content"] if chat else c["text"]


def check_seed(port, bindir, model_path):
    p = PROMPTS[3]  # the prefill group samples the first token, the decode node the rest
    body = {"prompt": p, "max_tokens": 24, "temperature": 0.8, "seed": 42}
    a = comp_text(port, body)
    b = comp_text(port, body)
    assert a == b, (a, b)
    c = comp_text(port, dict(body, seed=43))
    assert c != a, (a, c)
    # the engine with the same parameters and seed (the HTTP defaults: no top-k/p, min-p)
    ref = reference(bindir, model_path, p, 24, extra=["--temp", "0.8", "--seed", "42",
                                                     "--top-k", "0", "--top-p", "1",
                                                     "--min-p", "0"])["text"]
    assert a == ref, (a, ref)
    # local prefill, and chat streamed
    short = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0.8, "seed": 7}
    a2 = comp_text(port, short)
    assert a2 and a2 == comp_text(port, short), a2
    msgs = {"messages": [{"role": "user", "content": CHAT}], "max_tokens": 16,
            "temperature": 0.9, "seed": 5}
    assert comp_text(port, msgs, chat=True) == comp_text(port, msgs, chat=True)
    print("  seed 42: %r / seed 43: %r" % (a[:40], c[:40]))


def check_penalties_bias(port, bindir, model_path):
    # a repeated word: greedy repeats it; frequency_penalty 2 stops that, as in the engine
    p = "Hello! Hello! Hello! Hello! Hello! Hello!"
    plain = comp_text(port, {"prompt": p, "max_tokens": 16, "temperature": 0})
    pen = comp_text(port, {"prompt": p, "max_tokens": 16, "temperature": 0,
                           "frequency_penalty": 2})
    ref = reference(bindir, model_path, p, 16, extra=["--frequency-penalty", "2"])["text"]
    assert pen == ref, (plain, pen, ref)
    assert pen.count("Hello") < plain.count("Hello") and plain.count("Hello") >= 4, (plain, pen)
    pres = comp_text(port, {"prompt": p, "max_tokens": 16, "temperature": 0,
                            "presence_penalty": 2})
    assert pres == reference(bindir, model_path, p, 16,
                             extra=["--presence-penalty", "2"])["text"], pres
    # logit_bias on the first token, through the prefill group and through local prefill
    for prompt in (PROMPTS[3], PROMPTS[0]):
        base = reference(bindir, model_path, prompt, 4)
        first = base["tokens"][0]
        out = comp_text(port, {"prompt": prompt, "max_tokens": 4, "temperature": 0,
                               "logit_bias": {str(first): -100}})
        ref = reference(bindir, model_path, prompt, 4,
                        extra=["--logit-bias", "%d=-100" % first])
        assert out == ref["text"] and ref["tokens"][0] != first, (out, ref, base)
        forced = 19156 if first != 19156 else 19157
        out = comp_text(port, {"prompt": prompt, "max_tokens": 3, "temperature": 0.7, "seed": 3,
                               "logit_bias": {str(forced): 100}})
        ref = reference(bindir, model_path, prompt, 3,
                        extra=["--logit-bias", "%d=100" % forced])
        assert ref["tokens"] == [forced] * 3 and out == ref["text"], (out, ref)
    print("  frequency_penalty 2: %r -> %r" % (plain[:30], pen[:30]))


def check_curl(port, expect):
    for stream in (False, True):
        body = json.dumps({"prompt": PROMPTS[0], "max_tokens": N_TOKENS, "temperature": 0,
                           "stream": stream})
        out = subprocess.run(["curl", "-sS", "-N", "--max-time", "300",
                              "http://127.0.0.1:%d/v1/completions" % port,
                              "-H", "Content-Type: application/json", "-d", body],
                             capture_output=True, text=True, timeout=320)
        assert out.returncode == 0, out.stderr
        if stream:
            ev = sse_events(out.stdout)
            assert ev[-1] == "[DONE]", out.stdout[-500:]
            text = "".join(json.loads(e)["choices"][0]["text"] for e in ev[:-1])
        else:
            text = json.loads(out.stdout)["choices"][0]["text"]
        assert text == expect[PROMPTS[0]], (stream, text, expect[PROMPTS[0]])


def check_openai(port, expect, chat_expect, model):
    import openai
    cl = openai.OpenAI(base_url="http://127.0.0.1:%d/v1" % port, api_key="unused",
                       max_retries=0, timeout=300)
    assert [m.id for m in cl.models.list()] == [model]
    for p in (PROMPTS[0], PROMPTS[3]):
        c = cl.completions.create(model=model, prompt=p, max_tokens=N_TOKENS, temperature=0)
        assert c.choices[0].text == expect[p], (c.choices[0].text, expect[p])
        assert c.usage.completion_tokens == N_TOKENS, c.usage
        text = "".join(ch.choices[0].text for ch in cl.completions.create(
            model=model, prompt=p, max_tokens=N_TOKENS, temperature=0, stream=True))
        assert text == expect[p], (text, expect[p])
    msgs = [{"role": "user", "content": CHAT}]
    c = cl.chat.completions.create(model=model, messages=msgs, max_tokens=N_TOKENS, temperature=0)
    assert c.choices[0].message.content == chat_expect, (c.choices[0].message.content, chat_expect)
    text = "".join(ch.choices[0].delta.content or "" for ch in cl.chat.completions.create(
        model=model, messages=msgs, max_tokens=N_TOKENS, temperature=0, stream=True))
    assert text == chat_expect, (text, chat_expect)
    try:
        cl.completions.create(model=model, prompt="x", max_tokens=10**9)
        raise AssertionError("absurd max_tokens accepted")
    except openai.BadRequestError:
        pass


def check_concurrent(port, expect):
    results = {}
    errors = []
    stop = threading.Event()

    def client(i):
        p = PROMPTS[i % len(PROMPTS)]
        try:
            results[i] = (completion(port, p, stream=i % 2 == 0), p)
        except Exception as e:  # collected and reported below
            errors.append((i, repr(e)))

    def abuser(k):
        bad = [
            ("POST", "/v1/completions", "{not json", 400),
            ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 10**12}, 400),
            ("POST", "/v1/completions", {"prompt": "x", "n": 9}, 400),
            ("GET", "/v1/nothing", None, 404),
            ("DELETE", "/v1/completions", None, 405),
            ("POST", "/v1/chat/completions", {"messages": "hi"}, 400),
        ]
        j = 0
        while not stop.is_set():
            m, path, body, status = bad[(j + k) % len(bad)]
            j += 1
            r = call(port, m, path, body)
            if r.status != status or "error" not in r.json():
                errors.append(("abuse", path, r))
            if j % 7 == 0:  # a huge body: refused from its Content-Length
                s = connect(port)
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                          b"Content-Length: 50000000\r\n\r\n{\"prompt\":\"")
                r = Reader(s).response()
                s.close()
                if r.status != 413:
                    errors.append(("huge", r))
            time.sleep(0.05)

    abusers = [threading.Thread(target=abuser, args=(k,)) for k in range(2)]
    for t in abusers:
        t.start()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(32)]
    t0 = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    stop.set()
    for t in abusers:
        t.join(60)
    assert not errors, errors[:5]
    assert len(results) == 32, "only %d of 32 clients finished" % len(results)
    wrong = [(i, t, expect[p]) for i, (t, p) in results.items() if t != expect[p]]
    assert not wrong, wrong[:3]
    print("  32 concurrent clients in %.1fs, all equal to the engine" % (time.time() - t0))


def check_best_of(port, bindir, model):
    """best_of 4 = beam search of width 4 on the decode node; the answer is the best beam,
    equal to the single-process disaggregated run's (a short prompt: local prefill, which
    computes the prompt's KV like one prefill rank)."""
    prompt = PROMPTS[0]
    out = subprocess.run([os.path.join(bindir, "pdmesh"), "disagg-run", "--prefill-ranks", "1",
                          "--method", "single", "--threads", "1", "--beams", "4", "--n-best", "1",
                          "-n", str(N_TOKENS), "--prompt", prompt, "--json", "--model", model],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    best = json.loads(out.stdout)["n_best"][0]["text"]
    r = call(port, "POST", "/v1/completions",
             {"prompt": prompt, "max_tokens": N_TOKENS, "best_of": 4}, timeout=300)
    assert r.status == 200, r
    text = r.json()["choices"][0]["text"]
    assert text == best, (text, best)
    r = call(port, "POST", "/v1/completions",
             {"prompt": prompt, "max_tokens": N_TOKENS, "best_of": 4, "stream": True})
    assert r.status == 400 and "best_of" in r.json()["error"]["message"], r
    print("  best_of 4: %r" % text)


def check_cancel(mesh):
    before = mesh.metric("pdmesh_requests_total", 'outcome="cancelled"')
    s = connect(mesh.http_port, timeout=300)
    s.sendall(request_bytes("POST", "/v1/completions",
                            {"prompt": PROMPTS[1], "max_tokens": 400, "stream": True,
                             "ignore_eos": True}))
    rd = Reader(s)
    status, _ = rd.head()
    assert status == 200
    next(rd.chunks())
    s.close()
    wait_for(lambda: mesh.metric("pdmesh_requests_total", 'outcome="cancelled"') > before, 30,
             "the router to count the cancelled request")
    # the mesh still serves
    assert completion(mesh.http_port, PROMPTS[0], False) is not None


def check_prometheus(mesh):
    from prom import Prometheus
    p = Prometheus(mesh.http_port)
    try:
        res = p.wait_series('pdmesh_requests_total{outcome="ok"}')
        assert float(res[0]["value"][1]) >= 32, res
        hist = p.wait_series("pdmesh_ttft_seconds_count")
        assert float(hist[0]["value"][1]) >= 32, hist
        up = p.query('up{job="pdmesh"}')
        assert up and up[0]["value"][1] == "1", up
    finally:
        p.stop()


def main():
    ap = mesh_argparser()
    args = ap.parse_args()
    t0 = time.time()
    expect = {p: reference(args.bindir, args.model, p, N_TOKENS)["text"] for p in PROMPTS}
    chat_expect = reference(args.bindir, args.model, CHAT, N_TOKENS, chat=True)["text"]
    print("  references from pdmesh generate in %.1fs" % (time.time() - t0))
    mesh = Mesh(args.bindir, args.model)
    failed = []
    steps = [
        ("ready", lambda: mesh.wait_ready()),
        ("completions == engine (stream and not)", lambda: [
            (lambda t, p=p, s=s: None if t == expect[p] else
             failed.append(("mismatch", p, s, t, expect[p])))(completion(mesh.http_port, p, s))
            for p in PROMPTS for s in (False, True)]),
        ("both paths served: local prefill and a prefill group", lambda: None if
         "local" in METHODS and METHODS - {"local"} else failed.append(("methods", METHODS))),
        ("chat == engine (stream and not)", lambda: [
            (lambda t, s=s: None if t == chat_expect else
             failed.append(("chat mismatch", s, t, chat_expect)))(
                completion(mesh.http_port, CHAT, s, chat=True)) for s in (False, True)]),
        ("curl", lambda: check_curl(mesh.http_port, expect)),
        ("openai client", lambda: check_openai(mesh.http_port, expect, chat_expect,
                                               os.path.basename(args.model)[:-5])),
        ("logprobs == engine (completions and chat, stream and not)",
         lambda: check_logprobs(mesh.http_port, args.bindir, args.model,
                                os.path.basename(args.model)[:-5])),
        ("seed", lambda: check_seed(mesh.http_port, args.bindir, args.model)),
        ("penalties and logit_bias == engine",
         lambda: check_penalties_bias(mesh.http_port, args.bindir, args.model)),
        ("32 concurrent clients beside malformed requests",
         lambda: check_concurrent(mesh.http_port, expect)),
        ("best_of = beam search, the best beam", lambda: check_best_of(mesh.http_port,
                                                                       args.bindir, args.model)),
        ("disconnect cancels", lambda: check_cancel(mesh)),
        ("prometheus", lambda: check_prometheus(mesh)),
    ]
    try:
        for name, fn in steps:
            t = time.time()
            n_failed = len(failed)
            try:
                fn()
            except Exception as e:  # report, then stop: later steps need a healthy mesh
                failed.append((name, repr(e)))
            if len(failed) > n_failed:
                print("FAIL %s: %s" % (name, failed[n_failed:]))
                break
            print("ok   %s (%.1fs)" % (name, time.time() - t))
        print("  prefill methods seen in usage: " + ", ".join(sorted(METHODS)))
    finally:
        rc = mesh.stop()
        if rc != 0:
            failed.append(("router exit", rc))
            print("FAIL router exit status %r:\n%s" % (rc, mesh.log("router")[-3000:]))
        else:
            print("ok   clean shutdown")
    print("logs in " + mesh.logdir)
    if failed:
        print("FAILED (%.0fs)" % (time.time() - t0))
        sys.exit(1)
    print("all passed (%.0fs)" % (time.time() - t0))


if __name__ == "__main__":
    main()
