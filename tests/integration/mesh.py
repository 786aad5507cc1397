"""A real local mesh for the HTTP tests and the serving benchmark: pdmesh-router (with HTTP),
one prefill group and one decode node, as separate processes on free loopback ports, the
nodes registering with the cluster secret from the environment (never a command line)."""
import argparse
import json
import os
import random
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request


class Checks:
    """The test scripts' check(name, cond, detail): prints "ok   - name" or "FAIL - name:
    detail" (detail cut to `width` characters) and counts both."""

    def __init__(self, width=800):
        self.width, self.passed, self.failed = width, 0, 0

    def __call__(self, name, cond, detail=""):
        if cond:
            self.passed += 1
            print("ok   - " + name, flush=True)
        else:
            self.failed += 1
            print("FAIL - %s%s" % (name, (": " + str(detail)[:self.width]) if detail else ""),
                  flush=True)
        return bool(cond)


def free_port():
    """A port free now, below Linux's ephemeral range (32768-60999): a port the kernel hands
    out as ephemeral may be taken by any outgoing connection (UCX's, ZeroMQ's) before the
    process it is meant for binds it (seen once: "cannot bind ...: Address already in use")."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(21000, 32000)
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
            return port
        except OSError:
            continue
        finally:
            s.close()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def mesh_argparser(doc=None):
    """The options every script that starts processes of the mesh takes: where the binaries
    are and which model they load ($PDMESH_MODEL, else the default model)."""
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--bindir", default="build/bin")
    ap.add_argument("--model", default=os.environ.get("PDMESH_MODEL",
                                                      "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    return ap


class Mesh:
    def __init__(self, bindir="build/bin", model="models/SmolLM2-135M-Instruct.Q4_1.gguf",
                 prefill_ranks=1, threads=1, local_threshold=16, router_args=(), decode_args=(),
                 logdir=None, node_env=None):
        self.bindir = bindir
        # extra environment per process name ("decode-0", "prefill-a.1"), e.g. a node that
        # stands in for an older version: {"PDMESH_TEST_FEATURES": "0"}
        self.node_env = node_env or {}
        self.model = model
        self.logdir = logdir or tempfile.mkdtemp(prefix="pdm-mesh-")
        self.env = dict(os.environ)
        self.env["PDMESH_SECRET"] = os.urandom(16).hex()
        self.env.setdefault("UCX_TLS", "tcp,self")
        self.env.setdefault("UCX_NET_DEVICES", "lo")
        self.procs = {}
        p = [free_port() for _ in range(4)]
        self.node_ep = "tcp://127.0.0.1:%d" % p[1]
        self.client_ep = "tcp://127.0.0.1:%d" % p[0]
        self.http_port = p[3]
        self.admin_ep = "tcp://127.0.0.1:%d" % p[2]
        self._start("router", [os.path.join(bindir, "pdmesh-router"), "--model", model,
                               "--client", self.client_ep, "--node", self.node_ep,
                               "--admin", "tcp://127.0.0.1:%d" % p[2],
                               "--http", "127.0.0.1:%d" % self.http_port,
                               "--local-threshold", str(local_threshold), *router_args])
        self._start("decode-0", [os.path.join(bindir, "pdmesh-decode"), "--model", model,
                                 "--threads", str(threads), "--router", self.node_ep,
                                 "--node-id", "decode-0", *decode_args])
        for r in range(prefill_ranks):
            self._start("prefill-a.%d" % r,
                        [os.path.join(bindir, "pdmesh-prefill"), "--model", model, "--threads",
                         str(threads), "--router", self.node_ep, "--node-id", "prefill-a/%d" % r,
                         "--group", "a", "--rank", str(r), "--group-size", str(prefill_ranks)])
        self.prefill_ranks = prefill_ranks

    def _start(self, name, argv):
        log = open(os.path.join(self.logdir, name + ".log"), "w")
        env = dict(self.env, **self.node_env.get(name, {}))
        self.procs[name] = (subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, env=env), log)

    def get(self, path, timeout=5):
        with urllib.request.urlopen("http://127.0.0.1:%d%s" % (self.http_port, path),
                                    timeout=timeout) as r:
            return r.status, r.read().decode()

    def metric(self, name, labels=""):
        """The value of one series on /metrics (0 when absent)."""
        _, text = self.get("/metrics")
        want = name + ("{%s}" % labels if labels else "")
        for line in text.splitlines():
            if line.startswith(want + " "):
                return float(line.split()[-1])
        return 0.0

    def wait_ready(self, timeout=90, groups=True):
        """Waits for /readyz and, with groups, for every prefill rank to be alive."""
        end = time.time() + timeout
        while time.time() < end:
            for name, (p, _) in self.procs.items():
                if p.poll() is not None:
                    raise AssertionError("%s exited with %d:\n%s" % (name, p.returncode,
                                                                     self.log(name)[-3000:]))
            try:
                st, _ = self.get("/readyz")
                alive = self.metric("pdmesh_nodes", 'role_state="prefill_alive"')
                if st == 200 and (not groups or alive >= self.prefill_ranks):
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError("the mesh did not become ready in %ds; router log:\n%s"
                             % (timeout, self.log("router")[-3000:]))

    def log(self, name):
        try:
            with open(os.path.join(self.logdir, name + ".log")) as f:
                return f.read()
        except OSError:
            return ""

    def stop(self, timeout=30):
        """SIGTERM to everything (router last); returns the router's exit status."""
        rc = None
        order = [n for n in self.procs if n != "router"] + ["router"]
        for name in order:
            p, log = self.procs[name]
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
                if name == "router":
                    rc = "hung"
            log.close()
            if name == "router" and rc is None:
                rc = p.returncode
        return rc


def equal_up_to_near_tie(text, ref, tol=0.5):
    """Whether `text` starts with the engine's greedy text `ref` (reference() run with
    extra=("--logprobs", "2")), or the two part at a near-tie: at the first engine token whose
    text `text` does not continue with, the engine's own two best candidates are within `tol`
    (8-bit activations turn rounding differences of another path into a few tenths of a
    logit; the golden tests' near-tie rule). Returns (ok, what happened)."""
    if text.startswith(ref["text"]):
        return True, "equal"
    got = ""
    for k, lp in enumerate(ref.get("logprobs", [])):
        if not text.startswith(got + lp["text"]):
            top = lp["top"]
            gap = top[0]["logprob"] - top[1]["logprob"] if len(top) > 1 else float("inf")
            return gap <= tol, "parts at token %d (engine: %r, its top two %.3f apart)" % (
                k, lp["text"], gap)
        got += lp["text"]
    return False, "the engine's tokens do not spell its text"


def reference(bindir, model, prompt, n, chat=False, threads=1, extra=()):
    """Greedy output of the single-process engine (pdmesh generate --temp 0); extra: more
    flags (--logprobs K, --logit-bias ID=B, ...; a later --temp overrides)."""
    argv = [os.path.join(bindir, "pdmesh"), "generate", "--model", model, "--temp", "0",
            "-n", str(n), "--prompt", prompt, "--json", "--threads", str(threads), *extra]
    if chat:
        argv.append("--chat")
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise AssertionError("pdmesh generate failed: " + out.stderr[-2000:])
    return json.loads(out.stdout)


def reference_turns(bindir, model, prompts, n, threads=1, extra=()):
    """The single-process engine following a conversation as the mesh serves it (pdmesh
    generate --turn, docs/configuration.md): prompts[0] is prefilled, its answer generated
    with every token but the last fed back as a decode step; each later prompt (the whole
    conversation so far) reuses the rows of the longest common token prefix, as a decode
    node's prefix pool does, and prefills only the rest. Returns one dict per turn (text,
    tokens, cached_tokens, logprobs with extra=("--logprobs", "2"), ...). Pass ("--batch",
    "16") in extra to prefill in the decode node's batches (its --batch)."""
    argv = [os.path.join(bindir, "pdmesh"), "generate", "--model", model, "--temp", "0",
            "-n", str(n), "--prompt", prompts[0], "--json", "--threads", str(threads), *extra]
    for p in prompts[1:]:
        argv += ["--turn", p]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise AssertionError("pdmesh generate --turn failed: " + out.stderr[-2000:])
    turns = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    if len(turns) != len(prompts):
        raise AssertionError("pdmesh generate --turn printed %d turns for %d prompts"
                             % (len(turns), len(prompts)))
    return turns
