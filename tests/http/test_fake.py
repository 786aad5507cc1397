#!/usr/bin/env python3
"""The HTTP front end (router/http.c) on a scripted router core (tests/http/fake_core.c).

Covers what is hard to provoke with real nodes: errors before and in the middle of a stream,
every error-code mapping, cancellation when a client disconnects, limits (body, headers,
connections, idle timeout), pipelining, keep-alive, and a clean shutdown with nothing left open.

  PDM_HTTP_FAKE=build/bin/pdm-http-fake python3 tests/http/test_fake.py [name-filter]
The openai client tests run when the package is importable (tools/deps.sh installs it)."""
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from httptest import Reader, call, connect, request_bytes, sse_events, wait_for  # noqa: E402

FAKE = os.environ.get("PDM_HTTP_FAKE", "build/bin/pdm-http-fake")


class Fake:
    """One pdm-http-fake process; its event lines are collected by a reader thread."""

    def __init__(self, *args):
        self.proc = subprocess.Popen([FAKE, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.lines = []
        self.q = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        first = self.q.get(timeout=30)
        assert first.startswith("port "), first
        self.port = int(first.split()[1])

    def _read(self):
        for line in self.proc.stdout:
            line = line.strip()
            self.lines.append(line)
            self.q.put(line)

    def events(self, kind):
        return [l for l in list(self.lines) if l.startswith(kind + " ")]

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError("pdm-http-fake did not exit after SIGTERM")
        err = self.proc.stderr.read()
        assert rc == 0, "pdm-http-fake exited with %d: %s" % (rc, err[-2000:])
        time.sleep(0.1)
        assert "exit" in self.lines, "no clean exit: %s" % err[-2000:]
        # every submitted request ended exactly once
        subs = {l.split()[1] for l in self.events("submit")}
        ends = [l.split()[1] for l in self.events("end")]
        assert sorted(ends) == sorted(subs), "submitted %s, ended %s" % (subs, ends)


def comp(port, body, path="/v1/completions"):
    return call(port, "POST", path, body)


def test_routes(f):
    r = call(f.port, "GET", "/healthz")
    assert r.status == 200 and r.body == "ok\n", r
    r = call(f.port, "GET", "/readyz")
    assert r.status == 200, r
    r = call(f.port, "GET", "/v1/models")
    assert r.status == 200 and r.json()["data"][0]["id"] == "fake-model", r
    r = call(f.port, "GET", "/v1/models/fake-model")
    assert r.status == 200 and r.json()["id"] == "fake-model", r
    r = call(f.port, "GET", "/v1/models/other")
    assert r.status == 404 and r.json()["error"]["code"] == "model_not_found", r
    r = call(f.port, "GET", "/metrics?x=1")
    assert r.status == 200 and "pdmesh_http_responses_total" in r.body, r
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4"), r.headers
    r = call(f.port, "GET", "/nope")
    assert r.status == 404 and r.json()["error"]["type"] == "invalid_request_error", r
    r = call(f.port, "GET", "/v1/completions")
    assert r.status == 405 and "allow" in r.headers, r
    r = call(f.port, "DELETE", "/healthz")
    assert r.status == 405, r


def test_not_ready():
    g = Fake("--not-ready")
    try:
        r = call(g.port, "GET", "/readyz")
        assert r.status == 503, r
        assert call(g.port, "GET", "/healthz").status == 200
    finally:
        g.stop()


def test_completion(f):
    r = comp(f.port, {"model": "fake-model", "prompt": "alpha beta gamma", "max_tokens": 5})
    assert r.status == 200, r
    j = r.json()
    assert j["object"] == "text_completion" and j["id"].startswith("cmpl-"), j
    assert j["choices"][0]["text"] == "alpha beta gamma alpha beta", j
    assert j["choices"][0]["finish_reason"] == "length", j
    assert j["usage"]["completion_tokens"] == 5, j
    assert j["usage"]["total_tokens"] == j["usage"]["prompt_tokens"] + 5, j
    r = comp(f.port, {"messages": [{"role": "user", "content": "one two"}], "max_tokens": 3},
             "/v1/chat/completions")
    j = r.json()
    assert r.status == 200 and j["object"] == "chat.completion", r
    assert j["choices"][0]["message"] == {"role": "assistant", "content": "one two one"}, j


def test_default_max_tokens(f):
    p = json.loads(comp(f.port, {"prompt": "PARAMS"}).json()["choices"][0]["text"])
    assert p["max_tokens"] == 16 and abs(p["temperature"] - 1.0) < 1e-6, p
    p = json.loads(comp(f.port, {"messages": [{"role": "user", "content": "PARAMS"}]},
                        "/v1/chat/completions").json()["choices"][0]["message"]["content"])
    assert p["max_tokens"] == 0, p  # chat: until done (the router's default)


def test_params(f):
    body = {"prompt": "PARAMS", "temperature": 0, "top_p": 0.5, "top_k": 7, "seed": 1234,
            "stop": ["\n", "END"], "max_tokens": 99, "model": "fake-model", "min_p": 0.1,
            "repetition_penalty": 1.2, "ignore_eos": True, "n": 1, "user": "x",
            "presence_penalty": 0, "unknown_field": {"a": 1}}
    r = comp(f.port, body)
    assert r.status == 200, r
    p = json.loads(r.json()["choices"][0]["text"])
    assert p["temperature"] == 0 and abs(p["top_p"] - 0.5) < 1e-6 and p["top_k"] == 7, p
    assert p["seed"] == "1234" and p["stop"] == ["\n", "END"] and p["max_tokens"] == 99, p
    assert p["prompt"] == "PARAMS" and p["ignore_eos"] and p["model"] == "fake-model", p
    assert abs(p["repeat_penalty"] - 1.2) < 1e-6 and abs(p["min_p"] - 0.1) < 1e-6, p
    p = json.loads(comp(f.port, {"prompt": "PARAMS", "stop": "x"}).json()["choices"][0]["text"])
    assert p["stop"] == ["x"], p
    # two requests without a seed sample differently
    s1 = json.loads(comp(f.port, {"prompt": "PARAMS"}).json()["choices"][0]["text"])["seed"]
    s2 = json.loads(comp(f.port, {"prompt": "PARAMS"}).json()["choices"][0]["text"])["seed"]
    assert s1 != s2
    # token-id prompts: [ids] and [[ids]]
    for prompt in ([5, 6, 7], [[5, 6, 7]]):
        r = comp(f.port, {"prompt": prompt, "max_tokens": 2})
        assert r.status == 200, r
    # chat: content parts and the developer role
    msgs = [{"role": "developer", "content": "sys"},
            {"role": "user", "content": [{"type": "text", "text": "PAR"},
                                         {"type": "text", "text": "AMS"}]}]
    r = comp(f.port, {"messages": msgs}, "/v1/chat/completions")
    p = json.loads(r.json()["choices"][0]["message"]["content"])
    assert p["messages"] == [{"role": "system", "content": "sys"},
                             {"role": "user", "content": "PARAMS"}], p
    # best_of -> beams (not streamable)
    p = json.loads(comp(f.port, {"prompt": "PARAMS", "best_of": 3}).json()["choices"][0]["text"])
    assert p["beams"] == 3, p


def test_sampling_fields(f):
    body = {"prompt": "PARAMS", "presence_penalty": 0.5, "frequency_penalty": -1.25,
            "logit_bias": {"7": -100, "42": 3.5}, "logprobs": 4, "seed": 9}
    p = json.loads(comp(f.port, body).json()["choices"][0]["text"])
    assert p["presence_penalty"] == 0.5 and p["frequency_penalty"] == -1.25, p
    assert p["logit_bias"] == {"7": -100, "42": 3.5}, p
    assert p["logprobs"] is True and p["top_logprobs"] == 4 and p["seed"] == "9", p
    assert p["json_schema"] == "", p
    # response_format -> SamplingParams.json_schema (json_object is {"type":"object"})
    p = json.loads(comp(f.port, {"prompt": "PARAMS", "response_format": {"type": "json_object"}}
                        ).json()["choices"][0]["text"])
    assert json.loads(p["json_schema"]) == {"type": "object"}, p
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    p = json.loads(comp(f.port, {"messages": [{"role": "user", "content": "PARAMS"}],
                                 "response_format": {"type": "json_schema", "json_schema": {
                                     "name": "s", "strict": True, "schema": schema}}},
                        "/v1/chat/completions").json()["choices"][0]["message"]["content"])
    assert json.loads(p["json_schema"]) == schema, p
    p = json.loads(comp(f.port, {"prompt": "PARAMS", "response_format": {"type": "text"}}
                        ).json()["choices"][0]["text"])
    assert p["json_schema"] == "", p
    p = json.loads(comp(f.port, {"messages": [{"role": "user", "content": "PARAMS"}],
                                 "logprobs": True, "top_logprobs": 20},
                        "/v1/chat/completions").json()["choices"][0]["message"]["content"])
    assert p["logprobs"] is True and p["top_logprobs"] == 20, p
    p = json.loads(comp(f.port, {"messages": [{"role": "user", "content": "PARAMS"}],
                                 "logprobs": False},
                        "/v1/chat/completions").json()["choices"][0]["message"]["content"])
    assert p["logprobs"] is False, p
    p = json.loads(comp(f.port, {"prompt": "PARAMS", "logprobs": None}).json()
                   ["choices"][0]["text"])
    assert p["logprobs"] is False, p


def scripted(i, text, k):
    """fake_core.c's log-probabilities of token i with text `text`, k alternatives."""
    lp = -(i + 1) / 8
    return lp, [(text if j == 0 else "alt%d" % j, lp - j) for j in range(k)]


def check_completion_logprobs(lp, texts, k, offset0=0):
    assert lp["tokens"] == texts, lp
    off = offset0
    for i, t in enumerate(texts):
        want, top = scripted(i, t, k)
        assert abs(lp["token_logprobs"][i] - want) < 1e-6, lp
        assert lp["top_logprobs"][i] == {a: b for a, b in top}, lp
        assert lp["text_offset"][i] == off, lp
        off += len(t.encode())


def check_chat_logprobs(content, texts, k):
    assert [c["token"] for c in content] == texts, content
    for i, (c, t) in enumerate(zip(content, texts)):
        want, top = scripted(i, t, k)
        assert abs(c["logprob"] - want) < 1e-6 and c["bytes"] == list(t.encode()), c
        assert [(x["token"], x["logprob"]) for x in c["top_logprobs"]] == top, c
        assert all(x["bytes"] == list(x["token"].encode()) for x in c["top_logprobs"]), c


def test_logprobs_shapes(f):
    texts = ["p", " q", " p", " q", " p"]
    # completions, not streamed: {tokens, token_logprobs, top_logprobs, text_offset}
    j = comp(f.port, {"prompt": "p q", "max_tokens": 5, "logprobs": 3}).json()
    check_completion_logprobs(j["choices"][0]["logprobs"], texts, 3)
    # logprobs 0: the chosen token's only (empty alternatives)
    j = comp(f.port, {"prompt": "p q", "max_tokens": 5, "logprobs": 0}).json()
    check_completion_logprobs(j["choices"][0]["logprobs"], texts, 0)
    # without logprobs: null
    j = comp(f.port, {"prompt": "p q", "max_tokens": 2}).json()
    assert j["choices"][0]["logprobs"] is None, j
    # completions, streamed: each chunk carries its tokens' entries, offsets run on
    r = comp(f.port, {"prompt": "p q", "max_tokens": 5, "logprobs": 2, "stream": True})
    chunks = [json.loads(e) for e in sse_events(r.body)[:-1]]
    got = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    merged = {k: sum((g[k] for g in got), []) for k in
              ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    check_completion_logprobs(merged, texts, 2)
    assert len(got) == 5 and chunks[-1]["choices"][0]["logprobs"] is None, chunks
    # chat, not streamed: logprobs.content[{token, logprob, bytes, top_logprobs}]
    msgs = [{"role": "user", "content": "p q"}]
    j = comp(f.port, {"messages": msgs, "max_tokens": 5, "logprobs": True, "top_logprobs": 4},
             "/v1/chat/completions").json()
    check_chat_logprobs(j["choices"][0]["logprobs"]["content"], texts, 4)
    j = comp(f.port, {"messages": msgs, "max_tokens": 5, "logprobs": True},
             "/v1/chat/completions").json()
    check_chat_logprobs(j["choices"][0]["logprobs"]["content"], texts, 0)
    # chat, streamed
    r = comp(f.port, {"messages": msgs, "max_tokens": 5, "logprobs": True, "top_logprobs": 1,
                      "stream": True}, "/v1/chat/completions")
    chunks = [json.loads(e) for e in sse_events(r.body)[:-1]]
    content = sum((c["choices"][0]["logprobs"]["content"] for c in chunks
                   if c["choices"] and c["choices"][0]["logprobs"]), [])
    check_chat_logprobs(content, texts, 1)


def test_bad_requests(f):
    cases = [
        ("{not json", 400, "invalid_json"),
        ("", 400, "invalid_json"),
        ("[1,2]", 400, "invalid_json"),
        ({"prompt": "a", "max_tokens": 10**12}, 400, "invalid_value"),
        ({"prompt": "a", "max_tokens": 0}, 400, "invalid_value"),
        ({"prompt": "a", "max_tokens": 5000}, 400, "invalid_value"),  # over the router limit
        ({"prompt": "a", "max_tokens": 1.5}, 400, "invalid_type"),
        ({"prompt": "a", "max_tokens": "7"}, 400, "invalid_type"),
        ({"prompt": "a", "temperature": 3}, 400, "invalid_value"),
        ({"prompt": "a", "temperature": "hot"}, 400, "invalid_type"),
        ({"prompt": "a", "top_p": 0}, 400, "invalid_value"),
        ({"prompt": "a", "n": 0}, 400, "invalid_value"),
        ({"prompt": "a", "n": 9}, 400, "invalid_value"),
        ({"prompt": "a", "echo": "yes"}, 400, "invalid_type"),
        ({"prompt": "a", "max_tokens": -1, "echo": True}, 400, "invalid_value"),
        ({"prompt": ["a"] * 65}, 400, "invalid_value"),
        ({"prompt": ["a", 5]}, 400, "invalid_type"),
        ({"prompt": ["a", ""]}, 400, "invalid_value"),
        ({"prompt": "a", "logprobs": 21}, 400, "invalid_value"),
        ({"prompt": "a", "logprobs": -1}, 400, "invalid_value"),
        ({"prompt": "a", "logprobs": "3"}, 400, "invalid_type"),
        ({"prompt": "a", "top_logprobs": 3}, 400, "unsupported_value"),
        ({"prompt": "a", "logprobs": 2, "best_of": 2}, 400, "unsupported_value"),
        ({"prompt": "a", "presence_penalty": 2.5}, 400, "invalid_value"),
        ({"prompt": "a", "frequency_penalty": -3}, 400, "invalid_value"),
        ({"prompt": "a", "frequency_penalty": "x"}, 400, "invalid_type"),
        ({"prompt": "a", "logit_bias": {"5": 101}}, 400, "invalid_value"),
        ({"prompt": "a", "logit_bias": {"x": 1}}, 400, "invalid_value"),
        ({"prompt": "a", "logit_bias": {"-3": 1}}, 400, "invalid_value"),
        ({"prompt": "a", "logit_bias": {"5": "1"}}, 400, "invalid_type"),
        ({"prompt": "a", "logit_bias": [1]}, 400, "invalid_type"),
        ({"prompt": "a", "logit_bias": {str(i): 1 for i in range(301)}}, 400, "invalid_value"),
        ({"prompt": "a", "suffix": "z"}, 400, "unsupported_value"),
        ({"prompt": "a", "response_format": {"type": "xml"}}, 400, "unsupported_value"),
        ({"prompt": "a", "response_format": "json"}, 400, "invalid_type"),
        ({"prompt": "a", "response_format": {"type": "json_schema"}}, 400, "invalid_value"),
        ({"prompt": "a", "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "string", "pattern": "a"}}}}, 400,
         "unsupported_value"),
        ({"prompt": "a", "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"$ref": "#/$defs/missing"}}}}, 400, "invalid_value"),
        ({"prompt": "a", "stop": 5}, 400, "invalid_type"),
        ({"prompt": "a", "stop": [""]}, 400, "invalid_value"),
        ({"prompt": "a", "stop": ["s"] * 40}, 400, "invalid_value"),
        ({"prompt": "a", "stream": "yes"}, 400, "invalid_type"),
        ({"prompt": "a", "best_of": 2, "stream": True}, 400, "invalid_value"),
        ({"prompt": "a", "best_of": 99}, 400, "invalid_value"),
        ({"prompt": []}, 400, "invalid_value"),
        ({"prompt": [1, -2]}, 400, "invalid_type"),
        ({"prompt": list(range(9000))}, 400, "context_length_exceeded"),
        ({"prompt": 5}, 400, "invalid_type"),
        ({"max_tokens": 3}, 400, "missing_field"),
        ({"prompt": "a", "model": "gpt-4"}, 404, "model_not_found"),
        ({"prompt": "a", "model": 4}, 400, "invalid_type"),
        ({"messages": [{"role": "user", "content": "x"}]}, 400, "invalid_value"),
    ]
    for body, status, code in cases:
        r = comp(f.port, body)
        assert r.status == status, (body, r)
        e = r.json()["error"]
        assert e["code"] == code and e["message"], (body, e)
    chat_cases = [
        ({"messages": []}, "invalid_value"),
        ({"messages": "hi"}, "invalid_type"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "invalid_value"),
        ({"messages": [{"content": "x"}]}, "missing_field"),
        ({"messages": [5]}, "invalid_type"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "unsupported_value"),
        ({"messages": [{"role": "user", "content": "x"}], "prompt": "y"}, "invalid_value"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
         "invalid_value"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "retrieval"}]},
         "unsupported_value"),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
         "invalid_value"),
        ({"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]},
         "unsupported_value"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "invalid_value"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
         "invalid_value"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": 3}, "invalid_type"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 100}, "invalid_value"),
        ({"messages": [{"role": "user", "content": "x"}], "echo": True}, "unsupported_value"),
    ]
    for body, code in chat_cases:
        r = comp(f.port, body, "/v1/chat/completions")
        assert r.status == 400 and r.json()["error"]["code"] == code, (body, r)
    # deep nesting and odd bytes: errors, never a crash
    r = comp(f.port, "[" * 100000)
    assert r.status == 400, r
    r = comp(f.port, b"\xff\xfe\x00garbage")
    assert r.status == 400, r
    assert call(f.port, "GET", "/healthz").status == 200


def test_refusal_codes(f):
    for code, status in ((4, 400), (5, 401), (11, 404), (6, 429), (9, 503), (13, 503), (7, 504),
                         (10, 500), (3, 413)):
        r = comp(f.port, {"prompt": "REFUSE %d" % code})
        assert r.status == status, (code, r)
        assert r.json()["error"]["message"], r
        if status in (429, 503):
            assert r.headers.get("retry-after") == "1", r.headers
        # the same code arriving asynchronously, before any token, streaming or not
        for stream in (False, True):
            r = comp(f.port, {"prompt": "EARLY %d" % code, "stream": stream})
            assert r.status == status, (code, stream, r)
            assert "error" in r.json(), r


def test_prompt_list(f):
    """A list of prompts: one router request each, one choice each with its index, usage
    summed; streamed chunks carry their index; a disconnect cancels every part; a refused
    prompt fails the whole request and cancels the parts already submitted."""
    r = comp(f.port, {"prompt": ["alpha beta", "x y z"], "max_tokens": 3})
    assert r.status == 200, r
    j = r.json()
    assert [c["index"] for c in j["choices"]] == [0, 1], j
    assert [c["text"] for c in j["choices"]] == ["alpha beta alpha", "x y z"], j
    assert j["usage"]["completion_tokens"] == 6, j
    assert j["usage"]["prompt_tokens"] == len("alpha beta") + len("x y z"), j
    r = comp(f.port, {"prompt": [[1, 2], [3]], "max_tokens": 2})
    assert r.status == 200 and len(r.json()["choices"]) == 2, r
    r = comp(f.port, {"prompt": ["a b", "c d"], "max_tokens": 4, "stream": True,
                      "stream_options": {"include_usage": True}})
    ev = sse_events(r.body)
    assert ev[-1] == "[DONE]", ev
    chunks = [json.loads(e) for e in ev[:-1]]
    per = {}
    for c in chunks:
        for ch in c["choices"]:
            per[ch["index"]] = per.get(ch["index"], "") + ch["text"]
    assert per == {0: "a b a b", 1: "c d c d"}, per
    fins = [ch["index"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert sorted(fins) == [0, 1], chunks
    assert chunks[-1]["usage"]["completion_tokens"] == 8, chunks[-1]
    before = len(f.events("cancel"))
    r = comp(f.port, {"prompt": ["SLOW", "REFUSE 9"], "max_tokens": 50})
    assert r.status == 503 and "prompt 1" in r.json()["error"]["message"], r
    wait_for(lambda: len(f.events("cancel")) > before, 10, "cancel of the submitted part")
    before = len(f.events("cancel"))
    s = connect(f.port)
    s.sendall(request_bytes("POST", "/v1/completions",
                            {"prompt": ["SLOW", "SLOW"], "max_tokens": 500, "stream": True}))
    rd = Reader(s)
    status, _ = rd.head()
    assert status == 200
    next(rd.chunks())
    s.close()
    wait_for(lambda: len(f.events("cancel")) >= before + 2, 10, "both parts cancelled")


def test_stream_completion(f):
    r = comp(f.port, {"prompt": "a b", "max_tokens": 4, "stream": True})
    assert r.status == 200 and r.headers["content-type"] == "text/event-stream", r
    assert r.headers.get("transfer-encoding") == "chunked", r.headers
    ev = sse_events(r.body)
    assert ev[-1] == "[DONE]", ev
    chunks = [json.loads(e) for e in ev[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "a b a b", chunks
    assert chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-1]
    assert all(c["id"] == chunks[0]["id"] for c in chunks)
    assert all(c["object"] == "text_completion" for c in chunks)


def test_stream_chat_usage(f):
    r = comp(f.port, {"messages": [{"role": "user", "content": "x y z"}], "max_tokens": 3,
                      "stream": True, "stream_options": {"include_usage": True}},
             "/v1/chat/completions")
    ev = sse_events(r.body)
    assert r.status == 200 and ev[-1] == "[DONE]", r
    chunks = [json.loads(e) for e in ev[:-1]]
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant", chunks[0]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "x y z", text
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3, chunks
    assert chunks[-2]["choices"][0]["finish_reason"] == "length", chunks[-2]


def test_stream_error_midway(f):
    r = comp(f.port, {"prompt": "p q r s", "max_tokens": 10, "stream": True})
    assert r.status == 200, r  # MID not in the prompt: a normal stream
    r = comp(f.port, {"prompt": "MID 9", "max_tokens": 10, "stream": True})
    assert r.status == 200, r
    ev = sse_events(r.body)
    assert "[DONE]" not in ev, ev  # a failed stream never looks complete
    last = json.loads(ev[-1])
    assert last["error"]["code"] == "unavailable", last
    assert len(ev) == 4, ev  # three tokens, then the error
    # non-streaming: the same failure is a plain error status, no partial text
    r = comp(f.port, {"prompt": "MID 7", "max_tokens": 10})
    assert r.status == 504 and "choices" not in r.json(), r


def test_cancel_on_disconnect(f):
    for stream in (True, False):
        before = len(f.events("cancel"))
        s = connect(f.port)
        s.sendall(request_bytes("POST", "/v1/completions",
                                {"prompt": "SLOW", "max_tokens": 500, "stream": stream}))
        if stream:
            rd = Reader(s)
            status, _ = rd.head()
            assert status == 200
            next(rd.chunks())  # the first token arrived: the request runs
        else:
            wait_for(lambda: len(f.events("submit")) > 0 and
                     f.events("submit")[-1].split()[1] not in
                     {l.split()[1] for l in f.events("end")}, 10, "submit")
        s.close()
        wait_for(lambda: len(f.events("cancel")) > before, 10, "cancel after disconnect")


def test_slow_reader_dropped(f):
    """A client that never reads its stream is dropped once 8 MiB wait unsent."""
    before = len(f.events("cancel"))
    s = connect(f.port)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.sendall(request_bytes("POST", "/v1/completions",
                            {"prompt": "FLOOD", "max_tokens": 4000, "stream": True}))
    wait_for(lambda: len(f.events("cancel")) > before, 30, "the slow reader to be dropped")
    s.close()
    assert call(f.port, "GET", "/healthz").status == 200


def test_pipelining_and_keepalive(f):
    s = connect(f.port)
    rd = Reader(s)
    data = (request_bytes("GET", "/healthz") +
            request_bytes("POST", "/v1/completions", {"prompt": "k l", "max_tokens": 3}) +
            request_bytes("POST", "/v1/completions", {"prompt": "m", "max_tokens": 2,
                                                       "stream": True}) +
            request_bytes("GET", "/v1/models") +
            request_bytes("GET", "/nope"))
    # split at awkward places to exercise partial parsing
    for i in range(0, len(data), 7):
        s.sendall(data[i:i + 7])
    r1, r2, r3, r4, r5 = (rd.response() for _ in range(5))
    assert r1.status == 200 and r1.body == "ok\n", r1
    assert r2.json()["choices"][0]["text"] == "k l k", r2
    assert sse_events(r3.body)[-1] == "[DONE]", r3
    assert r4.json()["object"] == "list", r4
    assert r5.status == 404, r5
    # the connection stays usable
    s.sendall(request_bytes("GET", "/healthz"))
    assert rd.response().status == 200
    # Connection: close is honoured
    s.sendall(request_bytes("GET", "/healthz", headers={"Connection": "close"}))
    r = rd.response()
    assert r.headers["connection"] == "close", r.headers
    assert rd.closed(), "the server kept the connection open after Connection: close"
    s.close()
    # HTTP/1.0 streaming: no chunked framing, the end is the close
    s = connect(f.port)
    s.sendall(request_bytes("POST", "/v1/completions", {"prompt": "v", "max_tokens": 2,
                                                        "stream": True}, version="1.0"))
    r = Reader(s).response()
    assert r.status == 200 and "transfer-encoding" not in r.headers, r.headers
    assert sse_events(r.body)[-1] == "[DONE]", r
    s.close()


def test_limits(f):
    # body over the cap (1 MiB default): 413 from Content-Length, before the body is read
    big = {"prompt": "a" * (2 << 20)}
    r = comp(f.port, big)
    assert r.status == 413 and r.json()["error"]["code"] == "request_too_large", r
    # chunked body over the cap
    s = connect(f.port)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunk = b"a" * 65536
    try:
        for _ in range(40):
            s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    except (BrokenPipeError, ConnectionResetError):
        pass
    r = Reader(s).response()
    assert r.status == 413, r
    s.close()
    # headers over the cap
    r = call(f.port, "GET", "/healthz", headers={"X-Big": "b" * 40000})
    assert r.status == 431, r
    r = call(f.port, "GET", "/" + "u" * 10000)
    assert r.status == 431, r
    # garbage instead of HTTP
    s = connect(f.port)
    s.sendall(b"\x16\x03\x01\x02\x00garbage garbage\r\n\r\n")
    r = Reader(s).response()
    assert r.status == 400, r
    s.close()
    # Expect: 100-continue
    s = connect(f.port)
    body = json.dumps({"prompt": "e f", "max_tokens": 2}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n"
              b"Expect: 100-continue\r\n\r\n" % len(body))
    rd = Reader(s)
    status, _ = rd.head()
    assert status == 100, status
    s.sendall(body)
    r = rd.response()
    assert r.status == 200 and r.json()["choices"][0]["text"] == "e f", r
    s.close()
    assert call(f.port, "GET", "/healthz").status == 200


def test_connection_bound_and_idle():
    g = Fake("--max-conns", "4", "--max-conns-per-peer", "-1", "--idle", "0.5",
             "--head-timeout", "0.5", "--body-timeout", "0.5")
    try:
        # four requests running: no idle slot to take, a fifth connection gets a clean 503
        busy = [connect(g.port) for _ in range(4)]
        for s in busy:
            s.sendall(request_bytes("POST", "/v1/completions", {"prompt": "SLOW", "max_tokens": 50}))
        wait_for(lambda: len(g.events("submit")) == 4, 10, "four requests")
        extra = connect(g.port)
        extra.sendall(request_bytes("GET", "/healthz"))
        rd = Reader(extra)
        r = rd.response()
        assert r.status == 503 and r.json()["error"]["code"] == "too_many_connections", r
        assert r.headers["connection"] == "close" and rd.closed(), r.headers
        extra.close()
        for s in busy:
            s.close()
        wait_for(lambda: len(g.events("cancel")) == 4, 10, "the cancels")
        # four idle connections: a new one takes the oldest one's slot
        held = [connect(g.port) for _ in range(4)]
        time.sleep(0.1)
        assert call(g.port, "GET", "/healthz").status == 200
        assert Reader(held[0]).closed(timeout=2), "the oldest idle connection stayed open"
        # idle connections are closed quietly after the head deadline (nothing sent) or the
        # idle timeout (after a response)
        assert all(Reader(s).closed(timeout=5) for s in held[1:]), "idle connections stayed open"
        for s in held:
            s.close()
        s = connect(g.port)
        s.sendall(request_bytes("GET", "/healthz"))
        rd = Reader(s)
        assert rd.response().status == 200
        assert rd.closed(timeout=5), "a keep-alive connection outlived the idle timeout"
        s.close()
        # a request left unfinished gets 408, then the close
        for head in (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{\"pro",
                     b"GET /healthz HTTP/1.1\r\nHost: x\r\n"):
            s = connect(g.port)
            s.sendall(head)
            rd = Reader(s)
            r = rd.response()
            assert r.status == 408 and r.json()["error"]["code"] == "request_timeout", r
            assert rd.closed()
            s.close()
        assert call(g.port, "GET", "/healthz").status == 200
        m = call(g.port, "GET", "/metrics").body
        for line in ('pdmesh_http_responses_total{code="503"} 1',
                     'pdmesh_http_responses_total{code="408"} 2',
                     'pdmesh_http_refusals_total{reason="connections"} 1',
                     'pdmesh_http_refusals_total{reason="head_timeout"} 1',
                     'pdmesh_http_refusals_total{reason="body_timeout"} 1',
                     'pdmesh_http_idle_closed_total{reason="reclaimed"} 1'):
            assert line in m, (line, m)
    finally:
        g.stop()


def test_invalid_utf8(f):
    """Every error that quotes the client stays valid JSON when the client sent invalid UTF-8
    (each ill-formed sequence becomes U+FFFD)."""
    bad = b"\xff\xfe\xc0\xaf\xed\xa0\x80\xe2\x82"

    def body_with(template):
        return json.dumps(template).encode().replace(b"@BAD@", bad)

    cases = [
        ("POST", "/v1/completions", body_with({"prompt": "a", "model": "@BAD@"}), 404),
        ("POST", "/v1/chat/completions",
         body_with({"messages": [{"role": "@BAD@", "content": "x"}]}), 400),
        ("POST", "/v1/chat/completions",
         body_with({"model": "@BAD@", "messages": [{"role": "user", "content": "x"}]}), 404),
        ("GET", b"/v1/models/" + bad, None, 404),
        ("GET", b"/nope" + bad, None, 404),
        ("DELETE", b"/v1/" + bad, None, 404),
        ("POST", "/v1/completions", body_with({"prompt": "@BAD@", "max_tokens": 10**12}), 400),
        ("POST", "/v1/completions", b'{"prompt": "a", "model": "\\ud800"}', 400),  # cJSON: not JSON
    ]
    for method, path, body, status in cases:
        if isinstance(path, str):
            path = path.encode()
        head = b"%s %s HTTP/1.1\r\nHost: x\r\n" % (method.encode(), path)
        if body is not None:
            head += b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
        s = connect(f.port)
        s.sendall(head + b"\r\n" + (body or b""))
        rd = Reader(s)
        st, headers = rd.head()
        raw = rd._exact(int(headers["content-length"]))
        s.close()
        assert st == status, (path, body, st, raw)
        text = raw.decode("utf-8")  # strict: raises on invalid UTF-8
        e = json.loads(text)["error"]
        assert e["message"], (path, e)
        if b"@BAD@" in (body or b"") or bad in path:
            assert "\ufffd" in e["message"], (path, body, e)


def test_concurrent_with_abuse(f):
    """32 clients with different prompts (half streaming) while others send junk."""
    results = {}
    stop = threading.Event()

    def client(i):
        words = " ".join("w%d_%d" % (i, k) for k in range(3))
        body = {"prompt": words, "max_tokens": 6, "stream": i % 2 == 0}
        r = comp(f.port, body)
        if i % 2 == 0:
            ev = sse_events(r.body)
            ok = ev[-1] == "[DONE]"
            text = "".join(json.loads(e)["choices"][0]["text"] for e in ev[:-1])
        else:
            ok = r.status == 200
            text = r.json()["choices"][0]["text"]
        expect = " ".join((words.split() * 2)[:6])
        results[i] = ok and text == expect

    def abuser():
        while not stop.is_set():
            comp(f.port, "{bad")
            call(f.port, "PUT", "/v1/completions", "x")
            comp(f.port, {"prompt": "a", "max_tokens": -1})
            s = connect(f.port)
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # never finished; closed at once
            s.close()

    abusers = [threading.Thread(target=abuser) for _ in range(2)]
    for t in abusers:
        t.start()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    stop.set()
    for t in abusers:
        t.join(60)
    assert len(results) == 32 and all(results.values()), results


def test_openai_client(f):
    try:
        import openai
    except ImportError:
        print("  (skipped: the openai package is not installed)")
        return
    cl = openai.OpenAI(base_url="http://127.0.0.1:%d/v1" % f.port, api_key="none",
                       max_retries=0, timeout=30)
    assert [m.id for m in cl.models.list()] == ["fake-model"]
    c = cl.completions.create(model="fake-model", prompt="u v", max_tokens=3)
    assert c.choices[0].text == "u v u" and c.usage.completion_tokens == 3, c
    text = "".join(ch.choices[0].text for ch in
                   cl.completions.create(model="fake-model", prompt="u v", max_tokens=3,
                                         stream=True))
    assert text == "u v u", text
    c = cl.chat.completions.create(model="fake-model", max_tokens=2,
                                   messages=[{"role": "user", "content": "g h"}])
    assert c.choices[0].message.content == "g h", c
    text = "".join(ch.choices[0].delta.content or "" for ch in
                   cl.chat.completions.create(model="fake-model", max_tokens=2, stream=True,
                                              messages=[{"role": "user", "content": "g h"}]))
    assert text == "g h", text
    # errors surface as the client's typed exceptions
    for prompt, exc in (("REFUSE 6", openai.RateLimitError), ("REFUSE 4", openai.BadRequestError),
                        ("EARLY 9", openai.InternalServerError)):
        try:
            cl.completions.create(model="fake-model", prompt=prompt, max_tokens=3)
            raise AssertionError("no exception for " + prompt)
        except exc:
            pass
    try:
        cl.completions.create(model="gpt-4", prompt="x")
        raise AssertionError("unknown model accepted")
    except openai.NotFoundError:
        pass
    # a failure in the middle of a stream raises, after the tokens that did arrive
    got = []
    try:
        for ch in cl.completions.create(model="fake-model", prompt="MID 9", max_tokens=10,
                                        stream=True):
            got.append(ch.choices[0].text)
        raise AssertionError("a failed stream ended without an exception")
    except openai.APIError as e:
        assert "middle of the stream" in str(e), e
    assert len(got) == 3, got
    # log-probabilities through the client's own types
    c = cl.completions.create(model="fake-model", prompt="u v", max_tokens=3, logprobs=2)
    assert c.choices[0].logprobs.tokens == ["u", " v", " u"], c
    assert c.choices[0].logprobs.text_offset == [0, 1, 3], c
    c = cl.chat.completions.create(model="fake-model", max_tokens=2, logprobs=True,
                                   top_logprobs=2, messages=[{"role": "user", "content": "g h"}])
    lc = c.choices[0].logprobs.content
    assert [t.token for t in lc] == ["g", " h"] and len(lc[1].top_logprobs) == 2, c
    assert abs(lc[1].logprob + 0.25) < 1e-6, c
    n = 0
    for ch in cl.chat.completions.create(model="fake-model", max_tokens=2, logprobs=True,
                                         top_logprobs=1, stream=True,
                                         messages=[{"role": "user", "content": "g h"}]):
        if ch.choices and ch.choices[0].logprobs:
            n += len(ch.choices[0].logprobs.content)
    assert n == 2, n


def test_curl(f):
    out = subprocess.run(["curl", "-sS", "--max-time", "30", "-N",
                          "http://127.0.0.1:%d/v1/chat/completions" % f.port,
                          "-H", "Content-Type: application/json",
                          "-d", json.dumps({"messages": [{"role": "user", "content": "c d"}],
                                            "max_tokens": 2, "stream": True})],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert sse_events(out.stdout)[-1] == "[DONE]", out.stdout
    # a body over 1 KiB makes curl send Expect: 100-continue
    body = json.dumps({"prompt": "q " * 800, "max_tokens": 2})
    out = subprocess.run(["curl", "-sS", "--max-time", "30", "-w", "\n%{http_code}",
                          "http://127.0.0.1:%d/v1/completions" % f.port,
                          "-H", "Content-Type: application/json", "-d", body],
                         capture_output=True, text=True, timeout=60)
    text, code = out.stdout.rsplit("\n", 1)
    assert code == "200" and json.loads(text)["choices"][0]["text"] == "q q", out


def test_prometheus(f):
    """A real Prometheus server scrapes /metrics; its query API returns our series."""
    try:
        from prom import Prometheus
        p = Prometheus(f.port)
    except FileNotFoundError as e:
        print("  (skipped: %s)" % e)
        return
    try:
        call(f.port, "GET", "/healthz")
        res = p.wait_series('pdmesh_http_responses_total{code="200"}')
        assert float(res[0]["value"][1]) >= 1, res
        assert res[0]["metric"]["job"] == "pdmesh", res
        up = p.query('up{job="pdmesh"}')
        assert up and up[0]["value"][1] == "1", up
    finally:
        p.stop()


def main():
    want = sys.argv[1] if len(sys.argv) > 1 else ""
    tests = [(n, t) for n, t in sorted(globals().items()) if n.startswith("test_") and want in n]
    f = Fake()
    failed = 0
    try:
        for name, t in tests:
            t0 = time.time()
            try:
                if t.__code__.co_argcount:
                    t(f)
                else:
                    t()
                print("ok   %s (%.1fs)" % (name, time.time() - t0))
            except Exception as e:  # report every failure, then fail
                failed += 1
                print("FAIL %s: %r" % (name, e))
    finally:
        try:
            f.stop()
            print("ok   clean shutdown, every request ended once")
        except AssertionError as e:
            failed += 1
            print("FAIL shutdown: %s" % e)
    print("%d of %d failed" % (failed, len(tests)) if failed else "all %d passed" % len(tests))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
