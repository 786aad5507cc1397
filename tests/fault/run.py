#!/usr/bin/env python3
"""Fault injection on a noisy network: the mesh spread over network namespaces.

Every process gets its own "host": a network namespace joined to a bridge by a veth pair
(router 10.232.0.1, prefill ranks .10/.11, decode nodes .20/.21; clients and the proxy run in
the root namespace, .254). ZeroMQ runs over that network, and UCX over TCP on the veths
(UCX_TLS=tcp, UCX_NET_DEVICES): nothing can take a shortcut through shared memory. Faults come
from the kernel where it can (nftables: random loss and partitions; tc tbf: bandwidth) and from
a user-space TCP proxy where it cannot (no netem here: delay, jitter and corrupted bytes).

Scenarios, each with a pass condition:
  1. clean network: a long prompt through the group equals `pdmesh generate --temp 0`;
  2. 5 % random packet loss on every node's host and 100 Mbit/s links: requests through the
     group complete before their deadlines, equal to the engine (TCP recovers);
  3. a prefill rank partitioned mid-request: the request completes (retried elsewhere) before
     its deadline; the rank is declared dead; after the partition heals the rank registers
     again, the group re-forms and prefills again, equal to the engine;
  4. a decode node partitioned mid-stream: the request moves to the other decode node and
     completes, no token lost or repeated;
  5. clients through a proxy that delays and jitters every chunk (2-40 ms): equal to the engine;
  6. clients through a proxy that flips bytes: each such call ends by its timeout with an error
     or a result, never a hang; the router stays up and a clean client is still served;
  7. a second router (every node registers with both; docs/router.md "High availability")
     partitioned from one decode node: it serves its requests on the other decode node, the
     first router keeps using the cut-off node (each router reserves only on nodes it sees
     alive, and a node refuses what it has no room for); after the partition heals the node
     registers with the second router again by itself.
Needs root (namespaces, nftables, tc); skips with a message otherwise.

  python3 tests/fault/run.py --bindir build/bin [--model FILE]
"""
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))
from mesh import Checks, mesh_argparser  # noqa: E402

NET = "10.232.0"
BR = "pdmfbr"
HOSTS = {"router": 1, "router2": 2, "p0": 10, "p1": 11, "d0": 20, "d1": 21}
LONG = ("The capital of France is a city that many people visit because of its museums, its "
        "food, and its long history. In this short essay I will explain why the city became so "
        "important in Europe and what travellers should see first.")
check = Checks(600)


def sh(cmd, check_=True):
    r = subprocess.run(cmd, shell=True, capture_output=True, text=True)
    if check_ and r.returncode:
        raise RuntimeError("%s: %s" % (cmd, r.stderr.strip()))
    return r


def ns(h):
    return "pdmf-" + h


def net_up():
    net_down()
    sh("ip link add %s type bridge" % BR)
    sh("ip addr add %s.254/24 dev %s" % (NET, BR))
    sh("ip link set %s up" % BR)
    for h, i in HOSTS.items():
        sh("ip netns add %s" % ns(h))
        sh("ip link add pdmf%d type veth peer name pdmf%db" % (i, i))
        sh("ip link set pdmf%d netns %s" % (i, ns(h)))
        sh("ip netns exec %s ip link set pdmf%d name eth0" % (ns(h), i))
        sh("ip netns exec %s ip addr add %s.%d/24 dev eth0" % (ns(h), NET, i))
        sh("ip netns exec %s ip link set eth0 up" % ns(h))
        sh("ip netns exec %s ip link set lo up" % ns(h))
        sh("ip link set pdmf%db master %s up" % (i, BR))
        sh("ip netns exec %s nft add table inet pdmf" % ns(h))
        for hook in ("input", "output"):
            sh("ip netns exec %s nft 'add chain inet pdmf %s { type filter hook %s priority 0; }'"
               % (ns(h), hook, hook))


def net_down():
    for h in HOSTS:
        sh("ip netns del %s" % ns(h), check_=False)
    sh("ip link del %s" % BR, check_=False)


def loss(h, percent):
    """Random loss of `percent` % of the packets a host receives (0: none)."""
    sh("ip netns exec %s nft flush chain inet pdmf input" % ns(h))
    if percent:
        sh("ip netns exec %s nft add rule inet pdmf input numgen random mod 100 '<' %d drop"
           % (ns(h), percent))


def partition(h, on):
    """Cuts a host off the network (both directions), or heals it."""
    for chain in ("input", "output"):
        sh("ip netns exec %s nft flush chain inet pdmf %s" % (ns(h), chain))
        if on:
            sh("ip netns exec %s nft add rule inet pdmf %s oifname eth0 drop" % (ns(h), chain)
               if chain == "output" else
               "ip netns exec %s nft add rule inet pdmf %s iifname eth0 drop" % (ns(h), chain))


def rate(h, r):
    if r:
        sh("ip netns exec %s tc qdisc replace dev eth0 root tbf rate %s burst 64kb latency 100ms"
           % (ns(h), r))
    else:
        sh("ip netns exec %s tc qdisc del dev eth0 root" % ns(h), check_=False)


class Proxy:
    """TCP proxy in the root namespace: each chunk is delayed by U(lo, hi) seconds (order kept)
    and, with probability `flip`, gets one random byte inverted."""

    def __init__(self, target, lo=0.0, hi=0.0, flip=0.0, seed=1):
        self.target, self.lo, self.hi, self.flip = target, lo, hi, flip
        self.rng = random.Random(seed)
        self.lsock = socket.socket()
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.lsock.bind(("%s.254" % NET, 0))
        self.lsock.listen(64)
        self.port = self.lsock.getsockname()[1]
        self.stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.stop:
            try:
                c, _ = self.lsock.accept()
            except OSError:
                return
            try:
                u = socket.create_connection(self.target, timeout=5)
            except OSError:
                c.close()
                continue
            # (the connect's timeout must not stay on the socket: a reply that takes longer
            # than 5 s, a slow first token on a loaded machine, made the proxy close the
            # connection, and the client's ZeroMQ socket reconnected under a new identity
            # that the router's reply never reached)
            u.settimeout(None)
            for a, b in ((c, u), (u, c)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, a, b):
        try:
            while True:
                data = a.recv(65536)
                if not data:
                    break
                if self.hi:
                    time.sleep(self.rng.uniform(self.lo, self.hi))
                if self.flip and self.rng.random() < self.flip:
                    i = self.rng.randrange(len(data))
                    data = data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:]
                b.sendall(data)
        except OSError:
            pass
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self):
        self.stop = True
        self.lsock.close()


class Mesh:
    def __init__(self, bindir, model, tmp):
        self.bindir, self.model, self.tmp = bindir, model, tmp
        self.procs = {}
        self.env = dict(os.environ, PDMESH_SECRET=os.urandom(16).hex(), PDMESH_LOG="info",
                        UCX_TLS="tcp", UCX_NET_DEVICES="eth0", UCX_WARN_UNUSED_ENV_VARS="n",
                        PDMESH_ADMIN_TOKEN=os.urandom(8).hex())
        self.client_ep = "tcp://%s.1:7700" % NET
        self.node_ep = "tcp://%s.1:7701" % NET
        self.http = "http://%s.1:8080" % NET
        self.client_ep2 = "tcp://%s.2:7700" % NET
        self.node_ep2 = "tcp://%s.2:7701" % NET
        self.http2 = "http://%s.2:8080" % NET

    def start(self, name, host, argv):
        log = open(os.path.join(self.tmp, name + ".log"), "a")
        self.procs[name] = subprocess.Popen(["ip", "netns", "exec", ns(host)] + argv,
                                            env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL)

    def start_router(self, host="router", i=1):
        b = self.bindir
        self.start(host, host, [
            b + "/pdmesh-router", "--model", self.model, "--client", "tcp://%s.%d:7700" % (NET, i),
            "--node", "tcp://%s.%d:7701" % (NET, i), "--admin", "tcp://%s.%d:7702" % (NET, i),
            "--http", "%s.%d:8080" % (NET, i), "--local-threshold", "24", "--method", "kvr-e",
            "--max-attempts", "6", "--prefix-reuse", "0"])

    def start_prefill(self, r):
        self.start("p%d" % r, "p%d" % r, [
            self.bindir + "/pdmesh-prefill", "--model", self.model, "--router",
            self.node_ep + "," + self.node_ep2,
            "--node-id", "pa/%d" % r, "--group", "pa", "--rank", str(r), "--group-size", "2",
            "--timeout", "5"])

    def start_decode(self, d):
        self.start("d%d" % d, "d%d" % d, [
            self.bindir + "/pdmesh-decode", "--model", self.model, "--router",
            self.node_ep + "," + self.node_ep2,
            "--node-id", "d%d" % d])

    def metric(self, name, http=None):
        with urllib.request.urlopen((http or self.http) + "/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[-1])
        return 0.0

    def wait(self, cond, seconds):
        end = time.time() + seconds
        while time.time() < end:
            try:
                if cond():
                    return True
            except OSError:
                pass
            time.sleep(0.3)
        return False

    def stop(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()


def gen(bindir, ep, prompt, n=16, deadline_ms=60000, timeout=90, stream=True, ignore_eos=False):
    """One request through pdm-rclient (the real ZeroMQ protocol); its JSON reply or None."""
    argv = [bindir + "/pdm-rclient", "gen", "--ep", ep, "--prompt", prompt, "-n", str(n),
            "--deadline-ms", str(deadline_ms), "--timeout", str(timeout)]
    if stream:
        argv.append("--stream")
    if ignore_eos:
        argv.append("--ignore-eos")
    t0 = time.time()
    # errors="replace": a corrupted reply may carry bytes that are not UTF-8
    p = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=timeout + 30)
    out = None
    for line in p.stdout.splitlines():
        try:
            out = json.loads(line)
        except ValueError:
            pass
    return out, time.time() - t0, p.returncode


def main():
    ap = mesh_argparser()
    args = ap.parse_args()
    if os.geteuid() != 0 or not all(shutil.which(t) for t in ("ip", "nft", "tc")):
        print("fault: needs root, ip, nft and tc (network namespaces, nftables); skipped")
        return 0
    bindir = os.path.abspath(args.bindir)
    model = os.path.abspath(args.model)
    ref = subprocess.run([bindir + "/pdmesh", "generate", "--model", model, "--temp", "0",
                          "-n", "16", "--prompt", LONG], capture_output=True, text=True,
                         timeout=300).stdout.rstrip("\n")
    tmp = tempfile.mkdtemp(prefix="pdm-fault-")
    net_up()
    mesh = Mesh(bindir, model, tmp)
    try:
        mesh.start_router()
        mesh.start_router("router2", 2)
        for r in (0, 1):
            mesh.start_prefill(r)
        for d in (0, 1):
            mesh.start_decode(d)
        up = mesh.wait(lambda: mesh.metric('pdmesh_nodes{role_state="prefill_alive"}') >= 2 and
                       mesh.metric('pdmesh_nodes{role_state="decode_alive"}') >= 2, 90)
        check("mesh over 5 network namespaces registers (2 prefill ranks, 2 decode nodes)", up)
        if not up:
            return 1
        time.sleep(1)

        # 1. clean network
        out, _, _ = gen(bindir, mesh.client_ep, LONG)
        check("clean network: a long prompt through the group equals the engine",
              out and out.get("ok") and out["text"] == ref and
              out["usage"]["prefill_method"] == "kvr-e", out)

        # 2. 5 % loss on every node's host, 100 Mbit/s links
        for h in ("p0", "p1", "d0", "d1"):
            loss(h, 5)
            rate(h, "100mbit")
        res = [gen(bindir, mesh.client_ep, LONG, deadline_ms=60000) for _ in range(3)]
        good = [o for o, _, _ in res if o and o.get("ok") and o["text"] == ref and
                o["usage"]["prefill_method"] == "kvr-e"]
        check("5 %% loss + 100 Mbit/s: 3 requests through the group complete equal to the "
              "engine (%.1f s each at most)" % max(t for _, t, _ in res), len(good) == 3,
              [o for o, _, _ in res])
        for h in ("p0", "p1", "d0", "d1"):
            loss(h, 0)
            rate(h, None)

        # 3. a prefill rank partitioned mid-request, then healed
        before = mesh.metric("pdmesh_retries_total")
        holder = {}
        t = threading.Thread(target=lambda: holder.update(
            r=gen(bindir, mesh.client_ep, " ".join([LONG] * 8), deadline_ms=60000)))
        t.start()
        time.sleep(0.15)
        partition("p1", True)
        t.join()
        out, secs, _ = holder["r"]
        check("rank partitioned mid-request: the request completes before its deadline "
              "(%.1f s)" % secs, out and out.get("ok"), out)
        dead = mesh.wait(lambda: mesh.metric('pdmesh_nodes{role_state="prefill_alive"}') <= 1, 15)
        check("the partitioned rank is declared dead (lease)", dead)
        check("the failure was retried", mesh.metric("pdmesh_retries_total") > before or
              (out and out["usage"].get("attempts", 1) > 1))
        partition("p1", False)
        back = mesh.wait(lambda: mesh.metric('pdmesh_nodes{role_state="prefill_alive"}') >= 2, 30)
        check("after the partition heals the rank registers again", back)
        ok = None
        for _ in range(20):  # the group re-forms a moment after
            o, _, _ = gen(bindir, mesh.client_ep, LONG)
            if o and o.get("ok") and o["usage"]["prefill_method"] == "kvr-e":
                ok = o
                break
            time.sleep(1)
        check("the group re-forms and prefills again, equal to the engine",
              ok is not None and ok["text"] == ref, ok)

        # 4. a decode node partitioned mid-stream
        migr = mesh.metric("pdmesh_migrations_total")

        def dispatches():
            """(request id, decode node) of every first attempt the router logged."""
            with open(os.path.join(tmp, "router.log")) as f:
                return [(int(l.split("request ")[1].split()[0]), l.split(" -> ")[1].split()[0])
                        for l in f if " -> d" in l and "attempt 1 " in l]
        # this request is the first one numbered above every request logged so far (a line of
        # an earlier request that reaches the log late must not name the victim)
        last_id = max((i for i, _ in dispatches()), default=0)
        holder = {}
        t = threading.Thread(target=lambda: holder.update(
            r=gen(bindir, mesh.client_ep, LONG, n=1024, deadline_ms=90000, timeout=120,
                  ignore_eos=True)))  # several seconds of decoding after the partition
        t.start()
        victim = None
        end = time.time() + 20
        while time.time() < end and victim is None:  # the node that got this request
            later = [d for i, d in dispatches() if i > last_id]
            if later:
                victim = later[0]
            time.sleep(0.05)
        time.sleep(1.0)
        if victim:
            partition(victim, True)
        t.join()
        out, secs, _ = holder["r"]
        check("decode node %s partitioned mid-stream: completed on the other node, stream "
              "consistent (%.1f s)" % (victim, secs),
              victim and out and out.get("ok") and out.get("stream_matches") and
              out["usage"]["decode_node"] != victim and len(out["tokens"]) > 0, out)
        check("the migration is counted", mesh.metric("pdmesh_migrations_total") > migr)
        if victim:
            partition(victim, False)

        # 5. delay and jitter between client and router (user-space proxy)
        px = Proxy(("%s.1" % NET, 7700), lo=0.002, hi=0.04, seed=5)
        res = [gen(bindir, "tcp://%s.254:%d" % (NET, px.port), LONG) for _ in range(2)]
        check("2-40 ms jitter on every chunk client <-> router: equal to the engine",
              all(o and o.get("ok") and o["text"] == ref and o.get("stream_matches")
                  for o, _, _ in res), res)
        px.close()

        # 6. corrupted bytes between client and router
        px = Proxy(("%s.1" % NET, 7700), flip=0.3, seed=9)
        outcomes, slow = [], []
        for i in range(6):
            o, secs, rc = gen(bindir, "tcp://%s.254:%d" % (NET, px.port), LONG, timeout=10)
            outcomes.append("ok" if o and o.get("ok") else
                            ("error %s" % o.get("code") if o else "no reply (rc %d)" % rc))
            if secs > 10 + 15:
                slow.append(secs)
        px.close()
        check("corrupted client traffic: every call ends by its timeout (%s)"
              % ", ".join(outcomes), not slow, slow)
        alive = mesh.procs["router"].poll() is None
        out, _, _ = gen(bindir, mesh.client_ep, LONG)
        check("the router stays up and still serves a clean client correctly",
              alive and out and out.get("ok") and out["text"] == ref, out)
        # 7. the second router cut off from d0 (nftables in its namespace), d0 still on the
        # first router's network
        both = mesh.wait(lambda: mesh.metric('pdmesh_nodes{role_state="decode_alive"}',
                                             mesh.http2) >= 2, 30)
        check("the second router has both decode nodes", both)
        for chain, rule in (("input", "ip saddr %s.20 drop" % NET),
                            ("output", "ip daddr %s.20 drop" % NET)):
            sh("ip netns exec %s nft add rule inet pdmf %s %s" % (ns("router2"), chain, rule))
        lost = mesh.wait(lambda: mesh.metric('pdmesh_nodes{role_state="decode_alive"}',
                                             mesh.http2) == 1, 30)
        check("the second router declares d0 dead at its lease", lost)
        via2 = [gen(bindir, mesh.client_ep2, LONG)[0] for _ in range(3)]
        via1 = [None] * 4  # at once: the first router spreads them over d0 and d1

        def one(k):
            via1[k] = gen(bindir, mesh.client_ep, LONG)[0]
        ts = [threading.Thread(target=one, args=(k,)) for k in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        check("router 2 (cut off from d0) serves on d1, equal to the engine",
              all(o and o.get("ok") and o["text"] == ref and o["usage"]["decode_node"] == "d1"
                  for o in via2), via2)
        check("router 1 keeps using d0 (both nodes alive there; %s)"
              % ", ".join(o["usage"]["decode_node"] if o and o.get("ok") else "failed"
                          for o in via1),
              all(o and o.get("ok") for o in via1) and
              mesh.metric('pdmesh_nodes{role_state="decode_alive"}') == 2 and
              any(o["usage"]["decode_node"] == "d0" for o in via1), via1)
        sh("ip netns exec %s nft flush chain inet pdmf input" % ns("router2"))
        sh("ip netns exec %s nft flush chain inet pdmf output" % ns("router2"))
        back = mesh.wait(lambda: mesh.metric('pdmesh_nodes{role_state="decode_alive"}',
                                             mesh.http2) >= 2, 30)
        check("after the partition heals d0 registers with the second router again", back)
        out, _, _ = gen(bindir, mesh.client_ep2, LONG)
        check("the second router serves again, equal to the engine",
              out and out.get("ok") and out["text"] == ref, out)
        crashed = [n for n, p in mesh.procs.items() if p.poll() not in (None, 0)]
        check("no process crashed", not crashed, crashed)
    finally:
        mesh.stop()
        net_down()
        if check.failed:
            for n in sorted(os.listdir(tmp)):
                print("---- " + n)
                print(open(os.path.join(tmp, n)).read()[-1500:])
    print("fault: %d passed, %d failed" % (check.passed, check.failed))
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main())
