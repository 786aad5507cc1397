#!/usr/bin/env python3
"""bench/transfer: KV streaming throughput of pdmesh against ucx_perftest.

For each UCX transport (UCX_TLS) and each block size it runs:
  - bench/transfer/stream_bench (two processes, fork): a request of T tokens x 30 layers x
    3 KV heads (f16, head_dim 64) streamed as one block per (layer, head) with
    pdm_kvt_stream_tx (window 64) into pdm_kvt_stream_rx (64-byte headers, XXH3-64 on both
    sides), and the same blocks as raw pdm_kvt_isend/irecv (no header, no checksum);
  - ucx_perftest -t tag_bw at the size of one K (or V) message (T*128 bytes) between a server and
    a client process: with -e (endpoints with peer error handling, as pdmesh creates them:
    the reference for the ratio) and, unless quick, without it.
The posix runs set UCX_POSIX_ERROR_HANDLING=y for both, as pdm_kvt_create does by itself
(without it UCX drops shared memory for endpoints with error handling).

Writes docs/perf/transfer.json, docs/perf/transfer.md and (with gnuplot) transfer.png.

Environment:
  STREAM_BENCH   the binary (default: built here with make into $BUILD, default build-bench)
  BENCH_QUICK=1  short run: tokens 1024,4096, 3 reps, no plain perftest
  BENCH_TLS      transports (default posix,tcp; "default" = UCX_TLS unset, what pdmesh picks)
  BENCH_TOKENS   tokens per block (default 256,1024,4096,16384)
  BENCH_REPS     repetitions per point (median; default 7)
  BENCH_CHUNKS   token ranges per request (default 1: one block per layer x head)
  BENCH_OUT      output directory (default docs/perf)
"""
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("BUILD", "build-bench")
QUICK = os.environ.get("BENCH_QUICK") == "1" or "--quick" in sys.argv
TLS = os.environ.get("BENCH_TLS", "posix,tcp").split(",")
TOKENS = [int(x) for x in os.environ.get(
    "BENCH_TOKENS", "1024,4096" if QUICK else "256,1024,4096,16384").split(",")]
REPS = int(os.environ.get("BENCH_REPS", "3" if QUICK else "7"))
CHUNKS = int(os.environ.get("BENCH_CHUNKS", "1"))
PLAIN = not QUICK
OUT = os.environ.get("BENCH_OUT", os.path.join(ROOT, "docs/perf"))
LAYERS, HEADS, HEAD_DIM, ELEM = 30, 3, 64, 2  # SmolLM2-135M, f16 KV
HEADER = 64
WINDOW = 64


def binary():
    b = os.environ.get("STREAM_BENCH")
    if b:
        return b
    target = os.path.join(BUILD, "bin/stream_bench")
    subprocess.run(["make", "--no-print-directory", "-C", ROOT, "-f", "Makefile", "-f",
                    "bench/transfer/build.mk", "BUILD=" + BUILD, target], check=True,
                   stdout=sys.stderr)
    return os.path.join(ROOT, target)


def tls_env(tls):
    env = dict(os.environ)
    env.pop("UCX_TLS", None)
    if tls != "default":
        env["UCX_TLS"] = tls
    if tls == "default" or "posix" in tls or "shm" in tls or "all" in tls:
        env.setdefault("UCX_POSIX_ERROR_HANDLING", "y")  # what pdm_kvt_create sets
    return env


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def perftest(tls, size, error_handling):
    """One ucx_perftest tag_bw run; bytes/s (overall) or None."""
    iters = max(100, min(100000, (512 << 20) // size))
    warm = max(10, iters // 10)
    env = tls_env(tls)
    for attempt in range(5):
        port = free_port()
        srv = subprocess.Popen(["ucx_perftest", "-p", str(port)], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(0.3 + 0.3 * attempt)
        cmd = ["ucx_perftest", "127.0.0.1", "-p", str(port), "-t", "tag_bw", "-s", str(size),
               "-n", str(iters), "-w", str(warm), "-f", "-v"] + (["-e"] if error_handling else [])
        try:
            c = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            c = None
        try:
            srv.wait(timeout=10)
        except subprocess.TimeoutExpired:
            srv.kill()
            srv.wait()
        if c is None or c.returncode != 0:
            continue  # server not listening yet, or port taken: try again
        lines = [l for l in c.stdout.splitlines() if l.strip()]
        for i, l in enumerate(lines):
            if l.startswith("iterations,"):
                head = l.split(",")
                vals = lines[i + 1].split(",")
                row = dict(zip(head, vals))
                return float(row["overall_bw"]) * (1 << 20)  # perftest's MB are MiB
        sys.stderr.write("perftest: no result in:\n%s\n" % c.stdout)
        return None
    sys.stderr.write("perftest failed: %s (UCX_TLS=%s)\n" % (" ".join(cmd), tls))
    return None


def stream(bench, tls, tokens):
    cmd = [bench, "--tokens", str(tokens), "--chunks", str(CHUNKS), "--reps", str(REPS),
           "--window", str(WINDOW), "--layers", str(LAYERS), "--heads", str(HEADS),
           "--head-dim", str(HEAD_DIM), "--dtype", "f16" if ELEM == 2 else "f32"]
    p = subprocess.run(cmd, env=tls_env(tls), capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        sys.stderr.write("failed (UCX_TLS=%s): %s\n%s" % (tls, " ".join(cmd), p.stderr))
        return {}
    return {r["mode"]: r for r in map(json.loads, p.stdout.strip().splitlines())}


def machine():
    cpu = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ucx = subprocess.run(["ucx_info", "-v"], capture_output=True, text=True).stdout
    ver = next((l.split()[-1] for l in ucx.splitlines() if "Version" in l), "?")
    return {"cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(), "ucx": ver,
            "load": os.getloadavg()[0], "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def main():
    if not shutil.which("ucx_perftest"):
        sys.exit("ucx_perftest not found (apt-get install ucx-utils)")
    bench = binary()
    os.makedirs(OUT, exist_ok=True)
    res = {"machine": machine(), "quick": QUICK, "reps": REPS, "window": WINDOW,
           "layers": LAYERS, "kv_heads": HEADS, "head_dim": HEAD_DIM, "elem_bytes": ELEM,
           "chunks": CHUNKS, "header_bytes": HEADER, "points": []}
    for tls in TLS:
        for t in TOKENS:
            tb = t // CHUNKS
            # A block is three messages: a 64-byte header, then K and V of tb rows each; the
            # rows dominate, so perftest runs at the size of one K (or V) message.
            size = tb * HEAD_DIM * ELEM
            # Interleave pdmesh and perftest repetitions' blocks so drift hits them alike.
            s = stream(bench, tls, t)
            pt_eh = [x for x in (perftest(tls, size, True) for _ in range(REPS)) if x]
            pt_plain = [x for x in (perftest(tls, size, False) for _ in range(REPS)) if x] \
                if PLAIN else []
            pt = statistics.median(pt_eh) if pt_eh else None
            row = {"tls": tls, "tokens": t, "block_tokens": tb, "message_bytes": size,
                   "blocks": LAYERS * HEADS * CHUNKS,
                   "stream_Bps": s.get("stream", {}).get("wire_bytes_per_s"),
                   "stream_payload_Bps": s.get("stream", {}).get("payload_bytes_per_s"),
                   "raw_Bps": s.get("raw", {}).get("wire_bytes_per_s"),
                   "checksum_Bps": s.get("xxh64", {}).get("payload_bytes_per_s"),
                   "transports": s.get("stream", {}).get("transports"),
                   "perftest_eh_Bps": pt, "perftest_eh_runs": pt_eh,
                   "perftest_Bps": statistics.median(pt_plain) if pt_plain else None,
                   "perftest_runs": pt_plain, "stream_bench": s}
            row["stream_ratio"] = row["stream_Bps"] / pt if pt and row["stream_Bps"] else None
            row["raw_ratio"] = row["raw_Bps"] / pt if pt and row["raw_Bps"] else None
            res["points"].append(row)
            sys.stderr.write("%s %d tokens (%d B): stream %s raw %s perftest -e %s plain %s\n" % (
                tls, t, size, gbs(row["stream_Bps"]), gbs(row["raw_Bps"]), gbs(pt),
                gbs(row["perftest_Bps"])))
    with open(os.path.join(OUT, "transfer.json"), "w") as f:
        json.dump(res, f, indent=1)
    write_markdown(res)
    plot(res)


def gbs(x):
    return "-" if not x else "%.2f" % (x / 1e9)


def pct(x):
    return "-" if not x else "%.0f%%" % (100 * x)


def write_markdown(res):
    m = res["machine"]
    lines = [
        "# KV streaming throughput versus ucx_perftest", "",
        "Generated by bench/transfer/run.py%s on %s (%s cores, load %.1f at start), UCX %s, %s." % (
            " (quick run: few points, noisy)" if res["quick"] else "", m["cpu"], m["cores"],
            m["load"], m["ucx"], m["date"]), "",
        "A request of T tokens x %d layers x %d KV heads, f16, head_dim %d, sent as %d blocks "
        "(one per layer x head%s), each sent as three contiguous messages (64-byte header, K rows, "
        "V rows), window %d blocks, between "
        "two processes on this host. Median of %d repetitions, each timed from the sender's "
        "first send to the receiver's last verified block. GB/s = 1e9 bytes/s of K and V bytes "
        "(headers included for the stream). Message bytes = one K (or V) message: the size "
        "perftest runs at." % (
            res["layers"], res["kv_heads"], res["head_dim"], res["points"][0]["blocks"]
            if res["points"] else 0, " x %d token ranges" % res["chunks"] if res["chunks"] > 1
            else "", res["window"], res["reps"]), "",
        "- **stream**: pdm_kvt_stream_tx -> pdm_kvt_stream_rx (headers, plan checks, XXH3-64 of "
        "every block on the sender and again on the receiver).",
        "- **raw**: the same K and V messages as plain pdm_kvt_isend/irecv (no header, no "
        "checksum).",
        "- **perftest -e**: `ucx_perftest -t tag_bw -s <message bytes> -e` (endpoints with peer "
        "error handling, as pdmesh creates them): the reference of the ratios. **perftest**: "
        "without -e.",
        "- **checksum**: XXH3-64 alone over the same payload, one thread (no transport).",
        "- posix runs set UCX_POSIX_ERROR_HANDLING=y for perftest too, as pdm_kvt_create does.",
        "", "| UCX_TLS | tokens/block | message bytes | perftest -e GB/s | perftest GB/s | "
        "stream GB/s | raw GB/s | stream / perftest -e | raw / perftest -e | checksum GB/s | "
        "UCX lanes |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in res["points"]:
        lines.append("| %s | %d | %d | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            p["tls"], p["block_tokens"], p["message_bytes"], gbs(p["perftest_eh_Bps"]),
            gbs(p["perftest_Bps"]), gbs(p["stream_Bps"]), gbs(p["raw_Bps"]),
            pct(p["stream_ratio"]), pct(p["raw_ratio"]), gbs(p["checksum_Bps"]),
            p["transports"] or "-"))
    lines += ["", "Goal: stream / perftest -e >= 90%. raw / perftest -e is the transport's "
              "share (pdm_kvt: progress thread sleeping on the worker's event fd, bounded window); "
              "stream / raw is the protocol's (headers, the checksum twice, per-block "
              "verification on the receiving thread). perftest busy-polls one buffer.",
              "", "On a 2-core machine both processes (and pdmesh's progress threads) share two "
              "cores: shared-memory numbers are CPU-bound and sensitive to other load."]
    with open(os.path.join(OUT, "transfer.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def plot(res):
    if not shutil.which("gnuplot"):
        sys.stderr.write("gnuplot not found: no PNG\n")
        return
    series = []
    data = os.path.join(OUT, "transfer.dat")
    with open(data, "w") as f:
        for tls in dict.fromkeys(p["tls"] for p in res["points"]):
            for key, name in [("perftest_eh_Bps", "perftest -e"), ("stream_Bps", "stream"),
                              ("raw_Bps", "raw")]:
                f.write("# %s %s\n" % (tls, name))
                for p in res["points"]:
                    if p["tls"] == tls:
                        f.write("%d %g\n" % (p["message_bytes"], (p[key] or float("nan")) / 1e9))
                f.write("\n\n")
                series.append("%s %s" % (tls, name))
    script = ("set terminal pngcairo noenhanced size 900,500; set output '%s';"
              "set logscale x 2; set format x '%%.0b %%BB'; set xlabel 'message bytes';"
              "set ylabel 'GB/s';"
              "set key left top; set title 'KV streaming vs ucx_perftest (tag_bw)';"
              % os.path.join(OUT, "transfer.png"))
    script += "plot " + ", ".join("'%s' index %d using 1:2 with linespoints title '%s'" % (
        data, i, s) for i, s in enumerate(series))
    subprocess.run(["gnuplot", "-e", script], check=False)
    os.unlink(data)


if __name__ == "__main__":
    main()
