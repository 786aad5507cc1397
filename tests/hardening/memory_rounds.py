#!/usr/bin/env python3
"""memory_rounds.py - the decode node's memory stays bounded when streams are cancelled.

Issue 18, item 7: over rounds of streams killed mid-generation the decode node's RSS crept up
(125 -> 415 MB over six rounds) while its KV accounting returned to 0 each time.

This test starts a real mesh (pdmesh-router + one pdmesh-decode + a group of two
pdmesh-prefill ranks so that long prompts stream their KV; --prefill 0 leaves the group out and
every prompt is prefilled on the decode node), then runs N identical rounds. In a
round M streaming clients (pdm-rclient gen) start at once with prompts and token limits of
several sizes; half of them cancel their request after a few streamed tokens (--cancel-after),
the other half are killed with SIGKILL mid-stream (the router cancels their requests). After
the clients are gone the test waits until the router reports the decode node holding no
sequence ("held" 0 in `pdm-rclient admin --op nodes`, twice, a heartbeat apart), then reads
VmRSS from /proc/PID/status.

The rule: round 1 (and round 2) may warm up - the allocator and caches reach their working
set - but every round after round 2 must end with an RSS within 5 % of round 2's, above or
below: flat. A leak or a heap that keeps growing fails it, and so does a heap whose size at
idle swings with how a round's frees happened to fall (fragmentation: a round 2 that ended
high and a later one that trimmed back fail too). The test also fails when the
decode node does not exit 0 on SIGTERM or any log holds a sanitizer report (run it on the
sanitizer build, --bindir build-asan/bin, and LeakSanitizer checks the node at its exit; the
test gives ASan a small quarantine, else the RSS grows with it; about 2 minutes there).

--malloc-stats prints, after every round, the node's RSS by kind of mapping (/proc/PID/smaps)
and glibc's malloc_stats() (gdb attaches for a moment): memory the allocator holds vs memory
in use, the evidence for telling fragmentation from a leak.

Standard library only, plus the binaries of build/bin. Every process started here is stopped
by its pid at the end; every wait is bounded.

    python3 tests/hardening/memory_rounds.py --bindir build/bin [--rounds 6] [--streams 60]
"""
import argparse
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

TOLERANCE = 0.05  # rounds after round 2 end within 5 % of round 2 (either way)

WORDS = ("the city river museum history food travel north winter market story light bridge "
         "garden music evening harbour mountain letter window").split()


def prompt_of(i, long_):
    """A deterministic prompt: the same stream index gets the same prompt every round."""
    rnd = random.Random(i)
    n = rnd.randrange(40, 90) if long_ else rnd.randrange(4, 14)
    return "Tell me a story about " + " ".join(rnd.choice(WORDS) for _ in range(n)) + "."


class Mesh:
    def __init__(self, args):
        self.args = args
        self.dir = tempfile.mkdtemp(prefix="pdm-memrounds.")
        self.procs = []
        port = 20000 + random.randrange(20000)
        self.client = "tcp://127.0.0.1:%d" % port
        self.node = "tcp://127.0.0.1:%d" % (port + 1)
        self.admin_ep = "tcp://127.0.0.1:%d" % (port + 2)
        self.token = secrets.token_hex(16)
        token_file = os.path.join(self.dir, "token")
        with open(os.open(token_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write(self.token)
        self.env = dict(os.environ, PDMESH_SECRET=secrets.token_hex(32), PDMESH_LOG="warn")
        self.env.pop("PDMESH_SECRET_FILE", None)
        # On a sanitizer build ASan's quarantine (256 MB by default) holds freed blocks back
        # and the RSS climbs by what a round frees until it is full (+50 MB a round here):
        # a small one keeps the RSS rule meaningful there too. No effect on other builds.
        asan = self.env.get("ASAN_OPTIONS", "")
        if "quarantine_size_mb" not in asan:
            self.env["ASAN_OPTIONS"] = (asan + ":" if asan else "") + "quarantine_size_mb=8"
        self.token_file = token_file

    def start(self, name, argv):
        log = open(os.path.join(self.dir, name + ".log"), "w")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        self.procs.append((name, p))
        return p

    def up(self):
        a, b = self.args, self.args.bindir
        self.start("router", [
            os.path.join(b, "pdmesh-router"), "--model", a.model, "--client", self.client,
            "--node", self.node, "--admin", self.admin_ep, "--http-port", "-1",
            "--admin-token-file", self.token_file, "--max-tokens", "512",
            "--local-threshold", "24", "--block-tokens", "16", "--per-client-max", "256"])
        n_nodes = 1
        if a.prefill:
            for r in range(2):
                self.start("p%d" % r, [
                    os.path.join(b, "pdmesh-prefill"), "--model", a.model, "--router", self.node,
                    "--node-id", "pa/%d" % r, "--group", "pa", "--rank", str(r),
                    "--group-size", "2", "--timeout", "5"])
            n_nodes += 2
        self.decode = self.start("d0", [
            a.decode_bin or os.path.join(b, "pdmesh-decode"), "--model", a.model,
            "--router", self.node, "--node-id", "d0"])
        end = time.time() + 60
        while time.time() < end:
            nodes = self.nodes()
            if nodes and sum(1 for x in nodes if x.get("state") == "alive") >= n_nodes:
                return
            time.sleep(0.3)
        raise RuntimeError("the mesh did not come up within 60 s")

    def admin(self, *op):
        env = dict(self.env, PDMESH_ADMIN_TOKEN=self.token)
        r = subprocess.run([os.path.join(self.args.bindir, "pdm-rclient"), "admin", "--ep",
                            self.admin_ep, "--timeout", "10"] + list(op),
                           env=env, capture_output=True, text=True, timeout=20)
        lines = [l for l in r.stdout.splitlines() if l.strip()]
        return json.loads(lines[0]) if lines else None

    def nodes(self):
        try:
            d = self.admin("--op", "nodes")
        except (subprocess.TimeoutExpired, ValueError):
            return None
        return d.get("nodes") if d else None

    def decode_held(self):
        for x in self.nodes() or []:
            if x.get("id") == "d0":
                return x.get("held", 0)
        return None

    def rss_kb(self):
        with open("/proc/%d/status" % self.decode.pid) as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        raise RuntimeError("no VmRSS")

    def down(self):
        for _, p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        end = time.time() + 30  # sanitizer builds check for leaks on the way out
        for _, p in self.procs:
            try:
                p.wait(timeout=max(0.1, end - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        return {name: p.returncode for name, p in self.procs}

    def sanitizer_reports(self):
        """The processes whose logs hold a sanitizer report (LeakSanitizer at exit included)."""
        found = []
        for name, _ in self.procs:
            with open(os.path.join(self.dir, name + ".log"), errors="replace") as f:
                text = f.read()
            if "Sanitizer" in text and ("ERROR" in text or "runtime error" in text):
                found.append(name)
        return found

    def tail(self, name, n=15):
        try:
            with open(os.path.join(self.dir, name + ".log"), errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""


def malloc_stats(mesh):
    """glibc's malloc_stats() of the decode node (gdb attaches for a moment; it prints to the
    node's stderr): the number of arenas and the totals, as one line. Diagnostics only."""
    log = os.path.join(mesh.dir, "d0.log")
    start = os.path.getsize(log)
    subprocess.run(["gdb", "-p", str(mesh.decode.pid), "-batch", "-nx", "-ex",
                    "call (void)malloc_stats()"], capture_output=True, timeout=60)
    time.sleep(0.2)
    with open(log, errors="replace") as f:
        f.seek(start)
        text = f.read()
    arenas = text.count("Arena ")
    lines = text.split("Total (incl. mmap):")[-1].splitlines()
    vals = {}
    for l in lines:
        if "=" in l:
            k, v = l.split("=")
            vals[k.strip()] = int(v)
    return "%d arenas, system %.1f MB, in use %.1f MB, max mmap regions %d" % (
        arenas, vals.get("system bytes", 0) / 2**20, vals.get("in use bytes", 0) / 2**20,
        vals.get("max mmap regions", 0))


def smaps(pid):
    """The RSS of a process by kind of mapping (MB): the brk heap, anonymous mappings (malloc's
    mmapped chunks and thread arenas, UCX's pools), files (the model) and the rest."""
    kinds = {"heap": 0, "anon": 0, "file": 0, "other": 0}
    kind = "other"
    with open("/proc/%d/smaps" % pid) as f:
        for line in f:
            first = line.split(None, 1)[0]
            if "-" in first and not first.endswith(":"):
                parts = line.split()
                name = parts[5] if len(parts) > 5 else ""
                kind = ("heap" if name == "[heap]" else "anon" if not name else
                        "file" if name.startswith("/") else "other")
            elif first == "Rss:":
                kinds[kind] += int(line.split()[1])
    return " ".join("%s %.1f" % (k, v / 1024) for k, v in kinds.items())


def one_round(mesh, args):
    """M streams at once; half cancel after a few tokens, half are killed mid-stream."""
    clients = []
    rclient = os.path.join(args.bindir, "pdm-rclient")
    for i in range(args.streams):
        rnd = random.Random(1000 + i)
        long_ = args.prefill and i % 3 == 0
        n = rnd.choice((64, 128, 256, 400))
        argv = [rclient, "gen", "--ep", mesh.client, "--timeout", "60", "--stream", "-n", str(n),
                "--prompt", prompt_of(i, long_)]
        kill_at = None
        if i % 2 == 0:
            argv += ["--cancel-after", str(rnd.randrange(2, 24))]
        else:
            kill_at = time.time() + rnd.uniform(0.5, 2.5)
        p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env=mesh.env)
        clients.append((p, kill_at))
    end = time.time() + 60
    while time.time() < end and any(p.poll() is None for p, _ in clients):
        now = time.time()
        for p, kill_at in clients:
            if kill_at is not None and now >= kill_at and p.poll() is None:
                p.kill()
        time.sleep(0.05)
    for p, _ in clients:
        if p.poll() is None:
            p.kill()
        p.wait()
    # every sequence released (the heartbeat's load lags by up to a heartbeat: two readings)
    end = time.time() + 30
    zeros = 0
    while time.time() < end:
        zeros = zeros + 1 if mesh.decode_held() == 0 else 0
        if zeros >= 2:
            break
        time.sleep(1.1)
    if zeros < 2:
        raise RuntimeError("the decode node still holds sequences 30 s after the round")
    return mesh.rss_kb()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bindir", default="build/bin")
    ap.add_argument("--decode-bin", help="pdmesh-decode to test (default: BINDIR's)")
    ap.add_argument("--model", default=os.environ.get(
        "PDMESH_MODEL", "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--streams", type=int, default=60)
    ap.add_argument("--prefill", type=int, default=1,
                    help="1: a prefill group of 2 ranks streams the long prompts' KV")
    ap.add_argument("--malloc-stats", action="store_true",
                    help="after each round also print glibc's malloc_stats() (needs gdb)")
    args = ap.parse_args()
    if args.rounds < 3:
        ap.error("--rounds must be at least 3")
    if not os.path.isfile(args.model):
        print("memory_rounds: model %s missing" % args.model)
        return 1
    t0 = time.time()
    mesh = Mesh(args)
    rss = []
    status = 1
    try:
        mesh.up()
        print("memory_rounds: %d rounds of %d streams cancelled mid-generation (decode pid %d, "
              "start RSS %.1f MB)" % (args.rounds, args.streams, mesh.decode.pid,
                                      mesh.rss_kb() / 1024), flush=True)
        for r in range(args.rounds):
            rss.append(one_round(mesh, args))
            grew = (rss[-1] - rss[-2]) / 1024 if r else 0
            print("round %d: decode node RSS %.1f MB (%+.1f MB)" % (r + 1, rss[-1] / 1024, grew),
                  flush=True)
            if args.malloc_stats:
                print("         RSS by mapping (MB): %s" % smaps(mesh.decode.pid))
                print("         malloc_stats: %s" % malloc_stats(mesh), flush=True)
        base = rss[1]
        worst = max(rss[2:], key=lambda x: abs(x - base))
        ok = abs(worst - base) <= base * TOLERANCE
        print("%s - rounds 3..%d end within %.1f %% of round 2 (%.1f MB): farthest %.1f MB "
              "(%+.1f %%)" % ("ok  " if ok else "FAIL", args.rounds, TOLERANCE * 100,
                              base / 1024, worst / 1024, (worst / base - 1) * 100))
        status = 0 if ok else 1
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        print("FAIL - %s" % e)
        for name, _ in mesh.procs:
            print("---- %s.log\n%s" % (name, mesh.tail(name)))
    finally:
        codes = mesh.down()
        print("memory_rounds: exit statuses after SIGTERM: %s" %
              ", ".join("%s %s" % kv for kv in codes.items()))
        reports = mesh.sanitizer_reports()
        if reports:
            status = 1
            for name in reports:
                print("FAIL - sanitizer report in %s.log:\n%s" % (name, mesh.tail(name, 60)))
        elif codes.get("d0") != 0:
            status = 1
            print("FAIL - the decode node did not exit cleanly on SIGTERM:\n%s" % mesh.tail("d0"))
        shutil.rmtree(mesh.dir, ignore_errors=True)
    print("memory_rounds: %.0f s" % (time.time() - t0))
    return status


if __name__ == "__main__":
    sys.exit(main())
