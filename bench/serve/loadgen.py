"""Open-loop load generator for the OpenAI-compatible HTTP API (stdlib only).

Requests arrive as a Poisson process at a given rate; each one is a streaming completion so
that the client sees its own time to first token (TTFT) and time per output token (TPOT). A
thread per request keeps arrivals independent of service (open loop: a slow server does not
slow the arrivals down, as real users would not)."""
import json
import random
import socket
import statistics
import threading
import time


def pct(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, int(round(p / 100.0 * (len(xs) - 1)))))
    return xs[k]


def one_request(port, body, timeout):
    """Sends one streaming completion; returns a dict with the client-side timings."""
    t0 = time.perf_counter()
    out = {"ok": False, "ttft": None, "tpot": None, "latency": None, "tokens": 0, "error": None}
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        data = json.dumps(body).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(data), data))
        buf = b""
        first = last = None
        pieces = 0
        texts = []
        status = None
        usage = None
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            now = time.perf_counter()
            buf += chunk
            if status is None and b"\r\n" in buf:
                status = int(buf.split(b" ", 2)[1])
                if status != 200:
                    out["error"] = "HTTP %d" % status
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                line = ev[ev.find(b"data: "):] if b"data: " in ev else b""
                if not line:
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    out["ok"] = status == 200
                    continue
                try:
                    j = json.loads(payload)
                except ValueError:
                    continue
                if "error" in j:
                    out["error"] = j["error"].get("code")
                    continue
                if j.get("usage"):
                    usage = j["usage"]
                for c in j.get("choices", []):
                    if c.get("text"):
                        texts.append(c["text"])
                        pieces += 1
                        if first is None:
                            first = now
                        last = now
        s.close()
        end = time.perf_counter()
        out["latency"] = end - t0
        out["text"] = "".join(texts)
        if first is not None:
            out["ttft"] = first - t0
        n = usage["completion_tokens"] if usage else pieces
        out["tokens"] = n
        if usage:
            out["cached"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            out["prompt_tokens"] = usage.get("prompt_tokens")
        if usage and usage.get("pdmesh"):
            out["router_ttft"] = usage["pdmesh"].get("ttft_ms", 0) / 1e3
            out["router_total"] = usage["pdmesh"].get("total_ms", 0) / 1e3
            out["method"] = usage["pdmesh"].get("prefill_method")
        if first is not None and n > 1:
            out["tpot"] = (last - first) / (n - 1)
    except (OSError, ValueError) as e:
        out["error"] = str(e)
    return out


def run_rate(port, rate, duration, prompts, max_tokens, seed=1, timeout=120, model=None):
    """Poisson arrivals at `rate` req/s for `duration` seconds; waits for every request.
    prompts: list of prompt strings to draw from (uniformly)."""
    rng = random.Random(seed)
    results = []
    lock = threading.Lock()
    threads = []
    t_start = time.perf_counter()
    t = 0.0
    i = 0
    while True:
        t += rng.expovariate(rate)
        if t > duration:
            break
        delay = t_start + t - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        p = prompts[rng.randrange(len(prompts))]
        body = {"prompt": p["text"], "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True}
        if model:
            body["model"] = model

        def work(b=body, kind=p["kind"]):
            r = one_request(port, b, timeout)
            r["kind"] = kind
            with lock:
                results.append(r)

        th = threading.Thread(target=work, daemon=True)
        th.start()
        threads.append(th)
        i += 1
    for th in threads:
        th.join(timeout)
    wall = time.perf_counter() - t_start
    return results, wall


def summarize(results, wall, slo_ttft, slo_tpot):
    ok = [r for r in results if r["ok"]]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    good = [r for r in ok if r["ttft"] is not None and r["ttft"] <= slo_ttft and
            (r["tpot"] is None or r["tpot"] <= slo_tpot)]
    toks = sum(r["tokens"] for r in ok)
    over = [r["ttft"] - r["router_ttft"] for r in ok
            if r.get("router_ttft") and r["ttft"] is not None]
    return {
        "requests": len(results),
        "ok": len(ok),
        "errors": sorted({str(r["error"]) for r in results if not r["ok"]}),
        "wall_s": wall,
        "throughput_req_s": len(ok) / wall if wall else 0,
        "throughput_tok_s": toks / wall if wall else 0,
        "goodput_req_s": len(good) / wall if wall else 0,
        "ttft_p50_ms": 1e3 * pct(ttft, 50) if ttft else None,
        "ttft_p99_ms": 1e3 * pct(ttft, 99) if ttft else None,
        "tpot_p50_ms": 1e3 * pct(tpot, 50) if tpot else None,
        "tpot_p99_ms": 1e3 * pct(tpot, 99) if tpot else None,
        "client_minus_router_ttft_p50_ms": 1e3 * statistics.median(over) if over else None,
        "methods": sorted({r.get("method") for r in ok if r.get("method")}),
    }
