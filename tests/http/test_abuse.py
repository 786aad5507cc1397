#!/usr/bin/env python3
"""The HTTP front end under clients that hold connections without using them (issue 18):
idle floods, slowloris, one peer taking more than its share, exhausted slots. Each scenario
runs its own pdm-http-fake (router/http.c on the scripted core, tests/http/fake_core.c), asserts
that honest clients are served or cleanly refused (never a reset after they sent a request),
and prints the honest clients' success rate under the flood.

A second loopback address (127.0.0.2) stands for another host: Linux routes all of
127.0.0.0/8 to lo, so binding the client socket to it is enough.

  PDM_HTTP_FAKE=build/bin/pdm-http-fake python3 tests/http/test_abuse.py [name-filter]"""
import json
import os
import select
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from httptest import Reader, call, connect, request_bytes, wait_for  # noqa: E402
from test_fake import Fake  # noqa: E402

HONEST = {"prompt": "a b", "max_tokens": 2}


def connect_from(port, src, timeout=10):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.bind((src, 0))
    s.connect(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def honest(port, src="127.0.0.1", body=None, pause=0):
    """One honest completion on a new connection: "ok", "http<status>" (with a JSON error
    body), or the exception's name (a reset, a timeout, a body that is not JSON). pause: seconds
    between the head and the body (as a client waiting for 100-continue does)."""
    try:
        s = connect_from(port, src)
        try:
            data = request_bytes("POST", "/v1/completions", body or HONEST)
            if pause:
                head, rest = data.split(b"\r\n\r\n", 1)
                s.sendall(head + b"\r\n\r\n")
                time.sleep(pause)
                data = rest
            s.sendall(data)
            r = Reader(s).response()
        finally:
            s.close()
        if r.status == 200:
            return "ok" if r.json()["choices"][0]["text"] == "a b" else "wrong"
        r.json()["error"]["code"]  # a refusal must carry a JSON error body
        return "http%d" % r.status
    except (OSError, EOFError, ValueError, KeyError) as e:
        return type(e).__name__


def summary(results):
    ok = results.count("ok")
    kinds = {k: results.count(k) for k in sorted(set(results))}
    return ok / max(1, len(results)), "%d/%d served (%.0f%%) %s" % (
        ok, len(results), 100.0 * ok / max(1, len(results)), kinds)


def metric(port, line):
    body = call(port, "GET", "/metrics").body
    for l in body.splitlines():
        if l.startswith(line + " "):
            return float(l.split()[-1])
    return 0.0


class Slowloris:
    """n connections that each send a request head one byte a second and never finish it;
    records when each one receives the server's answer and what it was."""

    def __init__(self, port, n, src="127.0.0.1"):
        self.socks, self.opened, self.answer, self.at = [], {}, {}, {}
        for _ in range(n):
            s = connect_from(port, src)
            s.setblocking(False)
            try:
                s.send(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            except OSError:
                pass
            self.opened[s] = time.time()
            self.answer[s] = b""
            self.socks.append(s)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        next_drip = time.time() + 1
        while not self.stop.is_set():
            live = [s for s in self.socks if s.fileno() >= 0]
            r, _, _ = select.select(live, [], [], 0.05) if live else ([], [], [])
            for s in r:
                try:
                    data = s.recv(65536)
                except OSError:
                    data = b""
                    self.answer[s] += b"<reset>"
                if s not in self.at:
                    self.at[s] = time.time()
                self.answer[s] += data
                if not data:
                    s.close()
            if time.time() >= next_drip:
                next_drip += 1
                for s in self.socks:
                    if s.fileno() >= 0 and s not in self.at:
                        try:
                            s.send(b"a")
                        except OSError:
                            pass

    def close(self):
        self.stop.set()
        self.thread.join(5)
        for s in self.socks:
            s.close()

    def statuses(self):
        out = []
        for s in self.socks:
            a = self.answer[s]
            out.append(int(a.split(b" ")[1]) if a.startswith(b"HTTP/1.1 ") else None)
        return out


def test_idle_flood():
    """300 idle sockets (more than the 256 slots) hold no slot an honest client needs."""
    f = Fake("--max-conns", "256")
    try:
        held = [connect(f.port) for _ in range(300)]
        time.sleep(0.3)
        res = [honest(f.port) for _ in range(20)] + [honest(f.port, "127.0.0.2")
                                                     for _ in range(20)]
        rate, text = summary(res)
        print("  idle flood (300 idle sockets, 256 slots): honest clients %s" % text)
        assert rate == 1.0, text
        assert metric(f.port, 'pdmesh_http_idle_closed_total{reason="reclaimed"}') >= 40
        for s in held:
            s.close()
    finally:
        f.stop()


def test_slowloris():
    """100 connections sending one header byte a second get 408 within the head deadline
    (default 5 s) while honest clients are served."""
    f = Fake()
    try:
        t0 = time.time()
        sl = Slowloris(f.port, 100)
        res = []
        while time.time() - t0 < 5.5:
            res += [honest(f.port), honest(f.port, "127.0.0.2")]
            time.sleep(0.1)
        wait_for(lambda: len(sl.at) == 100, 5, "every slowloris connection answered")
        sl.close()
        late = [sl.at[s] - sl.opened[s] for s in sl.socks]
        st = sl.statuses()
        assert st == [408] * 100, st
        assert max(late) < 5 + 1.5 and min(late) > 4.5, (min(late), max(late))
        rate, text = summary(res)
        print("  slowloris (100 connections, one byte/s): 408 after %.1f-%.1f s; honest "
              "clients %s" % (min(late), max(late), text))
        assert rate == 1.0, text
        assert metric(f.port, 'pdmesh_http_refusals_total{reason="head_timeout"}') == 100
        assert metric(f.port, 'pdmesh_http_responses_total{code="408"}') == 100
    finally:
        f.stop()


def test_slowloris_over_slots():
    """400 slowloris connections from one address against 256 slots: the address gets its
    share (half the slots) and clean refusals beyond it; another host is served throughout."""
    f = Fake("--max-conns", "256", "--head-timeout", "3")
    try:
        t0 = time.time()
        sl = Slowloris(f.port, 400)
        other, same = [], []
        while time.time() - t0 < 3.5:
            other.append(honest(f.port, "127.0.0.2"))
            same.append(honest(f.port))
            time.sleep(0.1)
        wait_for(lambda: len(sl.at) == 400, 10, "every slowloris connection answered")
        sl.close()
        st = sl.statuses()
        assert st.count(408) == 128, {k: st.count(k) for k in set(st)}
        rate, text = summary(other)
        _, text_same = summary(same)
        print("  slowloris (400 connections from 127.0.0.1, 256 slots, 128 per peer): honest "
              "clients from 127.0.0.2 %s; from 127.0.0.1 (the flooding address) %s; the flood "
              "got %s" % (text, text_same, {k: st.count(k) for k in sorted(set(st), key=str)}))
        assert rate == 1.0, text
        assert all(r in ("ok", "http429", "http503") for r in same), same
        assert metric(f.port, 'pdmesh_http_responses_total{code="429"}') > 0
        assert metric(f.port, 'pdmesh_http_refusals_total{reason="peer_connections"}') > 0
    finally:
        f.stop()


def test_per_peer_limit():
    """A peer over its share: its oldest idle connection makes room; with none idle, a 429
    with a JSON body, while another peer is served."""
    f = Fake("--max-conns-per-peer", "8")
    try:
        busy = [connect_from(f.port, "127.0.0.1") for _ in range(8)]
        for s in busy:
            s.sendall(request_bytes("POST", "/v1/completions", {"prompt": "SLOW", "max_tokens": 40}))
        wait_for(lambda: len(f.events("submit")) == 8, 10, "eight requests running")
        res = [honest(f.port) for _ in range(10)]
        assert res == ["http429"] * 10, res
        s = connect_from(f.port, "127.0.0.1")
        s.sendall(request_bytes("GET", "/healthz"))
        r = Reader(s).response()
        s.close()
        assert r.status == 429 and r.headers.get("retry-after") == "1", r
        assert r.json()["error"]["code"] == "too_many_connections_per_peer", r
        other = [honest(f.port, "127.0.0.2") for _ in range(10)]
        assert other == ["ok"] * 10, other
        for s in busy:
            s.close()
        wait_for(lambda: len(f.events("cancel")) == 8, 10, "the cancels")
        # eight idle connections: the ninth takes the oldest one's slot
        idle = [connect_from(f.port, "127.0.0.1") for _ in range(8)]
        time.sleep(0.1)
        assert honest(f.port) == "ok"
        assert Reader(idle[0]).closed(timeout=2), "the peer's oldest idle connection stayed open"
        for s in idle:
            s.close()
        print("  per-peer limit 8: the 9th busy connection of 127.0.0.1 got 429, 127.0.0.2 "
              "served 10/10")
        assert metric(f.port, 'pdmesh_http_refusals_total{reason="peer_connections"}') == 11
        assert metric(f.port, 'pdmesh_http_responses_total{code="429"}') == 11
    finally:
        f.stop()


def test_no_reset_when_full():
    """Every slot busy: clients that send a whole request (small, 200 KB, or the body 50 ms
    after the head) read a 503 with a JSON body and a graceful close, never a reset (before:
    the server closed at once, and the client that sent its body after the head got a reset)."""
    f = Fake("--max-conns", "8", "--max-conns-per-peer", "-1")
    try:
        busy = [connect(f.port) for _ in range(8)]
        for s in busy:
            s.sendall(request_bytes("POST", "/v1/completions", {"prompt": "SLOW", "max_tokens": 60}))
        wait_for(lambda: len(f.events("submit")) == 8, 10, "eight requests running")
        res = []
        lock = threading.Lock()

        def client(i):
            body = {"prompt": "a " * (100000 if i % 3 == 1 else 1), "max_tokens": 2}
            r = honest(f.port, body=body, pause=0.05 if i % 3 == 2 else 0)
            with lock:
                res.append(r)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(50)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        print("  every slot busy, 50 clients sending whole requests: %s" %
              {k: res.count(k) for k in set(res)})
        assert res == ["http503"] * 50, res
        for s in busy:
            s.close()
        wait_for(lambda: len(f.events("cancel")) == 8, 10, "the cancels")
        assert metric(f.port, 'pdmesh_http_responses_total{code="503"}') == 50
        assert metric(f.port, 'pdmesh_http_refusals_total{reason="connections"}') == 50
        assert honest(f.port) == "ok"
    finally:
        f.stop()


def main():
    want = sys.argv[1] if len(sys.argv) > 1 else ""
    tests = [(n, t) for n, t in sorted(globals().items()) if n.startswith("test_") and want in n]
    failed = 0
    for name, t in tests:
        t0 = time.time()
        try:
            t()
            print("ok   %s (%.1fs)" % (name, time.time() - t0))
        except Exception as e:  # report every failure, then fail
            failed += 1
            print("FAIL %s: %r" % (name, e))
    print("%d of %d failed" % (failed, len(tests)) if failed else "all %d passed" % len(tests))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
