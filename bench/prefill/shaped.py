#!/usr/bin/env python3
"""bench/prefill/shaped.py: prefill methods over a shaped network ("noisy network", KV-Runahead
§5, Fig. 11).

Two network namespaces (one per rank) joined by a veth pair; both directions shaped with tbf at
10 Gbit/s, 1 Gbit/s and 100 Mbit/s; UCX over TCP on the veth (UCX_TLS=tcp, UCX_NET_DEVICES),
so traffic cannot take shared memory. Then the same at 1 Gbit/s with a competing bulk TCP flow
(iperf3) on the link. Each rank is started through `ip netns exec` by the launcher
(PDMESH_RANK_WRAP). Needs root (namespaces, tc); skips with a message otherwise.

Writes docs/perf/prefill-shaped.json and .md. Environment: PDMESH, PDMESH_MODEL, BENCH_LENGTHS
(default 1024,2048; BENCH_QUICK=1 -> 1024), BENCH_REPS (default 3, quick 1),
BENCH_RATES (default 10gbit,1gbit,100mbit).
"""
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PDMESH = os.environ.get("PDMESH", os.path.join(ROOT, "build/bin/pdmesh"))
MODEL = os.environ.get("PDMESH_MODEL", os.path.join(ROOT, "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
QUICK = os.environ.get("BENCH_QUICK") == "1"
LENGTHS = [int(x) for x in os.environ.get("BENCH_LENGTHS", "1024" if QUICK else "1024,2048").split(",")]
REPS = int(os.environ.get("BENCH_REPS", "1" if QUICK else "3"))
RATES = os.environ.get("BENCH_RATES", "10gbit,1gbit,100mbit").split(",")
METHODS = ["tsp", "kvr-e", "cp-kv", "cp-q"]
NS = ["pdmbench0", "pdmbench1"]
DEV = ["pdmv0", "pdmv1"]
ADDR = ["10.231.7.1", "10.231.7.2"]
OUT = os.environ.get("BENCH_OUT", os.path.join(ROOT, "docs/perf"))


def sh(cmd, check=True):
    return subprocess.run(cmd, shell=True, check=check, capture_output=True, text=True)


def teardown():
    for ns in NS:
        sh("ip netns del %s" % ns, check=False)


def setup():
    teardown()
    for ns in NS:
        sh("ip netns add %s" % ns)
    sh("ip link add %s type veth peer name %s" % (DEV[0], DEV[1]))
    for i in range(2):
        sh("ip link set %s netns %s" % (DEV[i], NS[i]))
        sh("ip netns exec %s ip addr add %s/24 dev %s" % (NS[i], ADDR[i], DEV[i]))
        sh("ip netns exec %s ip link set %s up" % (NS[i], DEV[i]))
        sh("ip netns exec %s ip link set lo up" % NS[i])


def shape(rate):
    for i in range(2):
        sh("ip netns exec %s tc qdisc replace dev %s root tbf rate %s burst 256kb latency 50ms"
           % (NS[i], DEV[i], rate))


def run(method, n):
    env = dict(os.environ)
    env["PDMESH_RANK_WRAP"] = ("ip netns exec pdmbench%d env UCX_TLS=tcp UCX_NET_DEVICES=pdmv%d "
                               "UCX_WARN_UNUSED_ENV_VARS=n")
    cmd = [PDMESH, "prefill-run", "--model", MODEL, "--ranks", "2", "--method", method,
           "--random", str(n), "--pin", "--json", "--repeat", str(REPS), "--ctx", str(n + 64)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if p.returncode != 0:
        sys.stderr.write("failed: %s\n%s" % (" ".join(cmd), p.stderr[-2000:]))
        return None
    r = json.loads(p.stdout.strip().splitlines()[-1])
    return {"ttft": r["ttft"], "transports": r["transports"],
            "bytes": sum(x["bytes_sent"] for x in r["per_rank"])}


def main():
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        print("shaped: needs root, ip and tc; skipped")
        return 0
    os.makedirs(OUT, exist_ok=True)
    results = {"lengths": LENGTHS, "reps": REPS, "rows": [],
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    try:
        setup()
        conditions = [(rate, False) for rate in RATES]
        if shutil.which("iperf3"):
            conditions.append(("1gbit", True))
        for rate, noisy in conditions:
            shape(rate)
            bulk = None
            if noisy:
                sh("ip netns exec %s iperf3 -s -D -1 -p 5299" % NS[1])
                time.sleep(0.3)
                bulk = subprocess.Popen(
                    ["ip", "netns", "exec", NS[0], "iperf3", "-c", ADDR[1], "-p", "5299",
                     "-t", "600", "-P", "2"], stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL)
                time.sleep(1.0)
            for n in LENGTHS:
                row = {"rate": rate, "competing_flow": noisy, "tokens": n}
                for m in METHODS:
                    row[m] = run(m, n)
                results["rows"].append(row)
                sys.stderr.write("%s%s %d: %s\n" % (rate, " +bulk" if noisy else "", n,
                                                    json.dumps({m: row[m] and row[m]["ttft"]
                                                                for m in METHODS})))
            if bulk:
                bulk.kill()
                bulk.wait()
                sh("pkill -f 'iperf3 -s -D -1 -p 5299'", check=False)
    finally:
        teardown()
    with open(os.path.join(OUT, "prefill-shaped.json"), "w") as f:
        json.dump(results, f, indent=1)
    lines = ["# Prefill over a shaped link (2 ranks in network namespaces, UCX over TCP)", "",
             "Generated by `bench/prefill/shaped.py` on %s. tbf on both veth ends; "
             "'+bulk' = two iperf3 TCP streams competing on the same link. Median TTFT of %d "
             "runs in seconds; bytes = KV/Q bytes sent by both ranks." % (results["date"], REPS),
             "", "| link | tokens | " + " | ".join(METHODS) + " | KVR-E / TSP |",
             "|---|---|" + "---|" * len(METHODS) + "---|"]
    for row in results["rows"]:
        cells = []
        for m in METHODS:
            r = row[m]
            cells.append("-" if not r else "%.3f (%.1f MB)" % (r["ttft"], r["bytes"] / 1e6))
        sp = (row["tsp"]["ttft"] / row["kvr-e"]["ttft"]) if row["tsp"] and row["kvr-e"] else None
        lines.append("| %s%s | %d | %s | %s |" % (row["rate"], " +bulk" if row["competing_flow"] else "",
                                                row["tokens"], " | ".join(cells),
                                                "-" if sp is None else "%.2f" % sp))
    with open(os.path.join(OUT, "prefill-shaped.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
