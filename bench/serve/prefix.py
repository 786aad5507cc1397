#!/usr/bin/env python3
"""Prefix reuse benchmark: multi-turn conversations over the HTTP API (docs/perf/prefix.*).

Each conversation opens with a document (about --doc-words words) and a question, then asks
--turns - 1 follow-up questions, every prompt being the previous prompt, the answer and a new
question (what a chat front end sends). Conversations run one after another (closed loop), so
a follow-up finds its group idle and still holding the previous turn. The same conversations
run on a mesh with prefix reuse (router --prefix-reuse 1: the group prefills only the new
tokens and streams the cached ones along), without (--prefix-reuse 0: every turn is
prefilled whole), and with the decode node's prefix pool (decode --kv-pool: the node keeps
each finished turn's KV and prefills only the new tokens itself, router --pool-local-max).
Reported per turn: client TTFT p50 and the cached tokens the router reports
(usage.prompt_tokens_details.cached_tokens), and the ratios to no reuse.

  python3 bench/serve/prefix.py [--bindir build/bin] [--ranks 2] [--out docs/perf] [--quick]
"""
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "integration"))
import loadgen  # noqa: E402
from mesh import Mesh, mesh_argparser  # noqa: E402

DOC = ("the river carried small boats past the old mill while children counted clouds and "
       "merchants argued about the price of salt in the market square near the harbour").split()
QUESTIONS = ["What did the merchants argue about?", "Where was the market square?",
             "What did the children count?", "What passed the old mill?",
             "Summarise the text in one sentence."]


def conversation(i, doc_words, turns, port, max_tokens):
    doc = " ".join(DOC[(i + k) % len(DOC)] for k in range(doc_words))
    prompt = "Document %d: %s\n\nQuestion: %s\nAnswer:" % (i, doc, QUESTIONS[0])
    rows = []
    for t in range(turns):
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        r = loadgen.one_request(port, body, 300)
        if not r["ok"]:
            raise RuntimeError("turn %d failed: %s" % (t, r["error"]))
        rows.append({"turn": t, "ttft": r["ttft"], "cached": r.get("cached", 0),
                     "prompt_tokens": r.get("prompt_tokens")})
        answer = " an answer of a few words"  # the text is fixed so both meshes see the same prompts
        prompt += answer + "\nQuestion: %s\nAnswer:" % QUESTIONS[(t + 1) % len(QUESTIONS)]
    return rows


def run(args, reuse, pool=0):
    mesh = Mesh(args.bindir, args.model, prefill_ranks=args.ranks, threads=1, local_threshold=0,
                router_args=["--prefix-reuse", str(reuse), "--block-tokens", "16"],
                decode_args=["--kv-pool", str(pool)])
    try:
        mesh.wait_ready(groups=True)
        conversation(999, args.doc_words, 2, mesh.http_port, 2)  # warm-up
        rows = []
        for i in range(args.conversations):
            rows += conversation(i, args.doc_words, args.turns, mesh.http_port, args.max_tokens)
        return rows
    finally:
        mesh.stop()


def main():
    ap = mesh_argparser()
    ap.add_argument("--out", default="docs/perf")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--doc-words", type=int, default=600)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--conversations", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()
    if args.conversations is None:
        args.conversations = 3 if args.quick else 8
    t0 = time.time()
    load_before = os.getloadavg()
    res = {"reuse": run(args, 1), "whole": run(args, 0), "pool": run(args, 1, 65536)}
    per_turn = []
    for t in range(args.turns):
        a = [r for r in res["reuse"] if r["turn"] == t]
        b = [r for r in res["whole"] if r["turn"] == t]
        c = [r for r in res["pool"] if r["turn"] == t]
        ra, rb = statistics.median(x["ttft"] for x in a), statistics.median(x["ttft"] for x in b)
        rc = statistics.median(x["ttft"] for x in c)
        per_turn.append({"turn": t, "prompt_tokens": statistics.median(x["prompt_tokens"] for x in a),
                         "cached_tokens": statistics.median(x["cached"] for x in a),
                         "cached_tokens_pool": statistics.median(x["cached"] for x in c),
                         "ttft_p50_ms_reuse": 1e3 * ra, "ttft_p50_ms_whole": 1e3 * rb,
                         "ttft_p50_ms_pool": 1e3 * rc, "ratio": ra / rb, "ratio_pool": rc / rb})
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": "%d vCPUs" % os.cpu_count(), "prefill_ranks": args.ranks,
              "conversations": args.conversations, "turns": args.turns,
              "doc_words": args.doc_words, "max_tokens": args.max_tokens,
              "per_turn": per_turn, "seconds": time.time() - t0,
              "loadavg_before": load_before, "loadavg_after": os.getloadavg()}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "prefix.json"), "w") as f:
        json.dump(result, f, indent=1)
    md = ["# Prefix reuse: follow-up turns (bench/serve/prefix.py)", "",
          "%s, %s, load average %.1f before / %.1f after; %d conversations of %d turns, a "
          "document of %d words, prefill group of %d rank(s), 1 thread per process." % (
              result["date"], result["machine"], load_before[0], result["loadavg_after"][0],
              args.conversations, args.turns, args.doc_words, args.ranks), "",
          "| turn | prompt tokens | cached (group / pool) | TTFT p50 whole (ms) | group reuse "
          "(ms) | decode pool (ms) | group / whole | pool / whole |",
          "|---|---|---|---|---|---|---|---|"]
    for r in per_turn:
        md.append("| %d | %.0f | %.0f / %.0f | %.1f | %.1f | %.1f | %.2f | %.2f |" % (
            r["turn"], r["prompt_tokens"], r["cached_tokens"], r["cached_tokens_pool"],
            r["ttft_p50_ms_whole"], r["ttft_p50_ms_reuse"], r["ttft_p50_ms_pool"], r["ratio"],
            r["ratio_pool"]))
    md += ["", "Turn 0 does the same work on every mesh (nothing cached yet): its ratios show the "
           "run's noise. TTFT is the client's (HTTP, streaming), prefill plus the first token. "
           "Group reuse: the group prefills only the new tokens and streams the cached ones "
           "along; decode pool: the decode node kept the last turn's KV and prefills the new "
           "tokens itself, nothing crosses the network."]
    with open(os.path.join(args.out, "prefix.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
