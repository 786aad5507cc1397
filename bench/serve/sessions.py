#!/usr/bin/env python3
"""Multi-turn chat sessions over the HTTP API (docs/perf/sessions.*): the workload of a chat
front end, where a session's every turn resends the whole conversation.

Sessions arrive as a Poisson process (--rate sessions/s for --duration s). Each session opens
with a shared system text (about --system-words words, the same for every session, as a
deployed assistant's instructions are) and a question of its own, then asks --turns - 1
follow-ups, each after a think time (exponential, mean --think s); a turn's prompt is the
previous prompt, the model's answer and the new question. Every turn is a streaming
completion, so the client sees its own TTFT.

Two meshes (router + 2-rank prefill group + decode node) run the same sessions (same seed):
without the decode node's prefix pool (every turn's prompt is prefilled by the group, which
keeps only its last conversation: --prefix-reuse 1) and with it (decode --kv-pool: a follow-up
is prefilled on the decode node from the KV its earlier turn left there). Reported: TTFT
p50/p90 of first turns and of follow-ups, the share of turns within the TTFT SLO, cached tokens.

With --decode-nodes N the meshes have N decode nodes (each with the pool in the pooled arm):
the router's global index of the nodes' KV events then decides which node a follow-up goes to,
and the pooled arm also reports the router's prefix-pool counters (lookups, hits, misses by
reason). --arms picks the arms (default: all three).

Delta transfer (issue 19): the arms `delta` and `nodelta` run the decode-node pool and the
group pool (16384 tokens) with every follow-up sent through the group (--pool-local-max 0),
with and without --pool-delta: the decode node holding the conversation takes its prefix from
its pool and receives only the rest's KV, or receives the whole prompt's. Reported besides:
KV bytes streamed, the delta counters.

  python3 bench/serve/sessions.py [--bindir build/bin] [--rate 0.2] [--duration 60] [--quick]
      [--decode-nodes 2] [--arms with] [--name sessions-2dec]
"""
import json
import os
import random
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "integration"))
import loadgen  # noqa: E402
from llamaserver import LlamaServer, find as find_llama_server  # noqa: E402
from mesh import Mesh, mesh_argparser  # noqa: E402

SYSTEM = ("You are a patient assistant for a city library. You answer questions about opening "
          "hours, borrowing rules, events for children and adults, study rooms, printing, "
          "digital lending, lost cards and accessibility. Keep answers short and friendly, "
          "say when you do not know, and never invent a rule.").split()
QUESTIONS = ["When does the library open on Saturdays?", "Can I renew a book online?",
             "Are there reading events for children?", "How do I book a study room?",
             "What does printing cost?", "I lost my card, what now?",
             "Can I borrow e-books?", "Is the building accessible by wheelchair?"]


def session(k, args, port, rng, rows, lock):
    words = [SYSTEM[i % len(SYSTEM)] for i in range(args.system_words)]
    prompt = "System: %s\nUser: %s\nAssistant:" % (" ".join(words), QUESTIONS[k % len(QUESTIONS)])
    for t in range(args.turns):
        body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        r = loadgen.one_request(port, body, 300)
        with lock:
            rows.append({"session": k, "turn": t, "ok": r["ok"], "ttft": r["ttft"],
                         "cached": r.get("cached", 0), "prompt_tokens": r.get("prompt_tokens")})
        if not r["ok"]:
            return
        prompt += r.get("text", " I am not sure.") + "\nUser: %s\nAssistant:" % (
            QUESTIONS[(k + t + 1) % len(QUESTIONS)])
        time.sleep(rng.expovariate(1.0 / args.think))


def run(args, pool, llama_server=None, group_pool=0, router_extra=()):
    """One arm: the mesh with a decode-node pool of `pool` tokens (0: none) and a prefill-group
    pool of `group_pool` tokens (0: the group keeps its last conversation only), or llama.cpp's
    llama-server (binary path) on the same model and cores."""
    if llama_server:
        mesh = LlamaServer(llama_server, args.model, threads=2)
    else:
        mesh = Mesh(args.bindir, args.model, prefill_ranks=2, threads=1, local_threshold=16,
                    router_args=["--prefix-reuse", "1", "--block-tokens", "16",
                                 "--group-pool-tokens", str(group_pool), *router_extra],
                    decode_args=["--kv-pool", str(pool)])
        for d in range(1, args.decode_nodes):
            mesh._start("decode-%d" % d, [os.path.join(args.bindir, "pdmesh-decode"), "--model",
                                          args.model, "--threads", "1", "--router",
                                          mesh.node_ep, "--node-id", "decode-%d" % d,
                                          "--kv-pool", str(pool)])
    rows, lock, threads = [], threading.Lock(), []
    pool_counts = {}
    try:
        mesh.wait_ready(groups=True)
        end = time.time() + 30
        while not llama_server and time.time() < end and mesh.metric(
                "pdmesh_nodes", 'role_state="decode_alive"') < args.decode_nodes:
            time.sleep(0.2)
        loadgen.one_request(mesh.http_port, {"prompt": "warm up", "max_tokens": 2,
                                             "stream": True}, 120)
        rng = random.Random(args.seed)
        t0, k = time.time(), 0
        next_at = t0 + rng.expovariate(args.rate)
        while next_at < t0 + args.duration:
            time.sleep(max(0.0, next_at - time.time()))
            th = threading.Thread(target=session, args=(k, args, mesh.http_port,
                                                        random.Random(args.seed + k), rows, lock))
            th.start()
            threads.append(th)
            k += 1
            next_at += rng.expovariate(args.rate)
        for th in threads:
            th.join(600)
        wall = time.time() - t0
        if not llama_server:
            for key, name in (("group_prefill_tokens", "pdmesh_group_prefill_tokens_total"),
                              ("group_cached_tokens", "pdmesh_prefix_cached_tokens_total"),
                              ("group_hits", "pdmesh_prefix_hits_total"),
                              ("kv_bytes", "pdmesh_kv_bytes_total")):
                pool_counts[key] = mesh.metric(name)
        if pool and not llama_server:
            for key, name, labels in (
                    ("lookups", "pdmesh_prefix_pool_lookups_total", ""),
                    ("hits", "pdmesh_prefix_pool_hits_total", ""),
                    ("cached_tokens", "pdmesh_prefix_pool_cached_tokens_total", ""),
                    ("miss_no_match", "pdmesh_prefix_pool_misses_total", 'reason="no_match"'),
                    ("miss_evicted", "pdmesh_prefix_pool_misses_total", 'reason="evicted"'),
                    ("miss_routed_elsewhere_load", "pdmesh_prefix_pool_misses_total",
                     'reason="routed_elsewhere_load"'),
                    ("miss_delta_over_local_max", "pdmesh_prefix_pool_misses_total",
                     'reason="delta_over_local_max"'),
                    ("delta_requests", "pdmesh_pool_delta_requests_total", ""),
                    ("delta_tokens", "pdmesh_pool_delta_tokens_total", ""),
                    ("delta_refused", "pdmesh_pool_delta_refused_total", ""),
                    ("kv_events_stored", "pdmesh_kv_events_total", 'kind="stored"'),
                    ("kv_events_evicted", "pdmesh_kv_events_total", 'kind="evicted"')):
                pool_counts[key] = mesh.metric(name, labels)
        return rows, wall, pool_counts
    finally:
        mesh.stop()


def summary(run_result, slo):
    rows, wall, pool_counts = run_result

    def stats(xs):
        t = [x["ttft"] for x in xs if x["ok"] and x["ttft"] is not None]
        return {"n": len(xs), "failed": sum(1 for x in xs if not x["ok"]),
                "ttft_p50_ms": 1e3 * statistics.median(t) if t else None,
                "ttft_p90_ms": 1e3 * loadgen.pct(t, 90) if t else None,
                "within_slo": sum(1 for v in t if v <= slo) / max(1, len(xs)),
                "cached_p50": statistics.median(x["cached"] or 0 for x in xs) if xs else 0,
                "goodput_turns_s": sum(1 for v in t if v <= slo) / wall}
    return {"first": stats([r for r in rows if r["turn"] == 0]),
            "followup": stats([r for r in rows if r["turn"] > 0]), "all": stats(rows),
            "pool": pool_counts}


def main():
    ap = mesh_argparser()
    ap.add_argument("--out", default="docs/perf")
    ap.add_argument("--rate", type=float, default=0.2)
    ap.add_argument("--duration", type=float, default=90)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--think", type=float, default=2.0)
    ap.add_argument("--system-words", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--slo-ttft", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="40 s of arrivals")
    ap.add_argument("--decode-nodes", type=int, default=1)
    ap.add_argument("--arms", default="without,with,llama",
                    help="comma-separated: without (no pool), with (decode-node pool), group "
                    "(prefill-group pool of conversations), llama (llama-server), delta / "
                    "nodelta (both pools, follow-ups through the group, with / without the "
                    "delta transfer)")
    ap.add_argument("--name", default="sessions", help="output file name (OUT/NAME.json, .md)")
    ap.add_argument("--llama-bindir", help="where llama-server is (default: $LLAMA_SERVER or "
                    "build/llama.cpp, built by tools/llama_tools.sh); without one its arm is "
                    "skipped with a message")
    args = ap.parse_args()
    if args.quick:
        args.duration = 40
    t0, load_before = time.time(), os.getloadavg()
    arms = args.arms.split(",")
    res = {}
    if "without" in arms:
        res["without pool"] = summary(run(args, 0), args.slo_ttft)
    if "with" in arms:
        res["with pool"] = summary(run(args, 65536), args.slo_ttft)
    if "group" in arms:
        res["group pool"] = summary(run(args, 0, group_pool=16384), args.slo_ttft)
    for arm, on in (("delta", "1"), ("nodelta", "0")):
        if arm in arms:
            res["both pools, via group, delta %s" % ("on" if on == "1" else "off")] = summary(
                run(args, 65536, group_pool=16384,
                    router_extra=("--pool-local-max", "0", "--pool-delta", on)), args.slo_ttft)
    ls = find_llama_server(args.llama_bindir) if "llama" in arms else None
    if ls:
        res["llama-server"] = summary(run(args, 0, llama_server=ls), args.slo_ttft)
    elif "llama" in arms:
        print("sessions: no llama-server binary (tools/llama_tools.sh builds one); its arm is "
              "skipped", file=sys.stderr)
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "machine": "%d vCPUs (%s)" % (os.cpu_count(), cpu), "args": vars(args), "results": res,
           "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
           "seconds": time.time() - t0}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, args.name + ".json"), "w") as f:
        json.dump(out, f, indent=1)
    title = ("the prefill group's pool of conversations" if "group pool" in res and
             "with pool" not in res else "the decode node's prefix pool")
    md = ["# Multi-turn sessions: %s (bench/serve/sessions.py)" % title, "",
          "%s, %s, load average %.1f before / %.1f after. Sessions arrive at %.2f/s for %.0f s, "
          "%d turns each, think time %.1f s (mean), a shared %d-word system text, %d new "
          "tokens per turn; router + 2-rank prefill group + %d decode node(s), 1 thread per "
          "process; %sTTFT SLO %.1f s."
          % (out["date"], out["machine"], load_before[0], out["loadavg_after"][0], args.rate,
             args.duration, args.turns, args.think, args.system_words, args.max_tokens,
             args.decode_nodes,
             "`llama-server`: the same model on the same 2 cores (`-t 2 --parallel 4`, prompt "
             "cache and `--cache-reuse 256` on, `--no-repack`; bench/serve/llamaserver.py); "
             if "llama-server" in res else "", args.slo_ttft),
          "", "| mesh | turns | first-turn TTFT p50 / p90 (ms) | follow-up TTFT p50 / p90 (ms) | "
          "follow-up cached tokens (p50) | turns within SLO | goodput (turns/s) | failed |",
          "|---|---|---|---|---|---|---|---|"]
    for name, r in res.items():
        f, u = r["first"], r["followup"]
        md.append("| %s | %d | %s / %s | %s / %s | %.0f | %.0f %% | %.3f | %d |" % (
            name, r["all"]["n"], "%.0f" % f["ttft_p50_ms"] if f["ttft_p50_ms"] else "-",
            "%.0f" % f["ttft_p90_ms"] if f["ttft_p90_ms"] else "-",
            "%.0f" % u["ttft_p50_ms"] if u["ttft_p50_ms"] else "-",
            "%.0f" % u["ttft_p90_ms"] if u["ttft_p90_ms"] else "-", u["cached_p50"],
            100 * r["all"]["within_slo"], r["all"]["goodput_turns_s"], r["all"]["failed"]))
    if "with pool" in res:
        md += ["", "Without the pool a follow-up is prefilled by the group, which keeps only the "
               "conversation it prefilled last (its partial prefill helps only when no other "
               "session came between); with it, the decode node that served the earlier turn "
               "still holds its KV and prefills only the new tokens."]
    if any("group_prefill_tokens" in (r.get("pool") or {}) for r in res.values()):
        md += ["", "| mesh | prompt tokens prefilled by the group | cached on the group | turns "
               "continuing a group's conversation | KV bytes streamed to decode nodes |",
               "|---|---|---|---|---|"]
        for name, r in res.items():
            pc = r.get("pool") or {}
            if "group_prefill_tokens" in pc:
                md.append("| %s | %d | %d | %d | %.1f MB |" % (
                    name, pc["group_prefill_tokens"], pc["group_cached_tokens"],
                    pc["group_hits"], pc["kv_bytes"] / 1e6))
        if "group pool" in res:
            md += ["", "With the group pool (`--group-pool-tokens 16384`, prefill_node/pool.h) "
                   "the group keeps every recent conversation, so a follow-up computes only its "
                   "new tokens whichever session came between; without it the group keeps its "
                   "last conversation only (a follow-up reuses the shared system text at best). "
                   "Without the delta transfer the group streams the whole prompt's KV to "
                   "the decode node, so the KV bytes do not drop."]
    for name, r in res.items():
        pc = r.get("pool") or {}
        if pc.get("lookups"):
            md += ["", "%s, the router's prefix-pool counters: %d lookups, %d hits (hit rate %.0f %%), "
                   "%d cached tokens served; misses: no_match %d, evicted %d, "
                   "routed_elsewhere_load %d, delta_over_local_max %d; KV events: %d stored, "
                   "%d evicted." % (name, pc["lookups"], pc["hits"],
                                    100 * pc["hits"] / pc["lookups"], pc["cached_tokens"],
                                    pc["miss_no_match"], pc["miss_evicted"],
                                    pc["miss_routed_elsewhere_load"],
                                    pc["miss_delta_over_local_max"], pc["kv_events_stored"],
                                    pc["kv_events_evicted"])]
        if pc.get("delta_requests") or "delta" in name:
            md += ["", "%s: %d delta transfers, %d prompt tokens' KV not streamed, %d refused."
                   % (name, pc.get("delta_requests", 0), pc.get("delta_tokens", 0),
                      pc.get("delta_refused", 0))]
    with open(os.path.join(args.out, args.name + ".md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
