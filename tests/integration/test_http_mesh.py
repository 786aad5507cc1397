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
            ("POST", "/v1/completions", {"prompt": "x", "n": 4}, 400),
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
