#!/usr/bin/env python3
"""Every architecture through the whole mesh: for each random-weight preset of
`pdmesh make-test-model --arch` (llama3, qwen2, qwen3, gemma3; test tokenizer, Q4_1 matrices),
a router + 2-rank prefill group + decode node serve one greedy completion three ways (HTTP
/v1/completions, the Python package, the C SDK through `pdmesh generate --router`), each
prefilled by the group with a different method and streamed layer by layer to the decode node.
Every answer must equal the single-process engine's (`pdmesh generate --temp 0`); the
engine itself is held to llama.cpp by the `arch` unit suite. The prompt is longer than the
gemma3 preset's 16-token sliding window, so local layers mask across ranks.

    python3 tests/integration/test_arch_mesh.py --bindir build/bin
"""
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from mesh import Checks, Mesh, mesh_argparser, reference  # noqa: E402

# preset -> the group's prefill method for it (each method once at least)
PRESETS = {"llama3": "tsp", "qwen2": "cp-q", "qwen3": "cp-kv", "gemma3": "kvr-e"}
PROMPT = ("the quick brown fox jumps over the lazy dog while the small cat sleeps near the "
          "warm window and the old man reads his paper in the garden")
N = 16


def http_complete(port, prompt, n):
    body = json.dumps({"prompt": prompt, "max_tokens": n, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request("http://127.0.0.1:%d/v1/completions" % port, data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def python_sdk(endpoint, prompt, n):
    """The Python package in a child process (build/python on PYTHONPATH, as make sets it)."""
    code = ("import json, sys, pdmesh\n"
            "with pdmesh.Client(sys.argv[1], timeout=120) as c:\n"
            "    r = c.generate(sys.argv[2], max_tokens=int(sys.argv[3]), temperature=0,\n"
            "                   ignore_eos=True)\n"
            "print(json.dumps({'text': r.text, 'tokens': r.tokens}))\n")
    out = subprocess.run([sys.executable, "-c", code, endpoint, prompt, str(n)],
                         capture_output=True, text=True, timeout=180)
    if out.returncode != 0:
        return {"error": out.stderr[-1500:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def c_sdk(bindir, endpoint, prompt, n):
    out = subprocess.run([os.path.join(bindir, "pdmesh"), "generate", "--router", endpoint,
                          "--prompt", prompt, "-n", str(n), "--temp", "0", "--ignore-eos",
                          "--json", "--timeout", "120000"],
                         capture_output=True, text=True, timeout=180)
    if out.returncode != 0:
        return {"error": out.stderr[-1500:]}
    return json.loads(out.stdout)


def main():
    ap = mesh_argparser(__doc__.split("\n")[0])
    ap.add_argument("--preset", action="append", help="only these (default: all)")
    args = ap.parse_args()
    check = Checks()
    t0 = time.time()
    tmp = tempfile.mkdtemp(prefix="pdm-arch-mesh-")
    for preset in args.preset or PRESETS:
        method = PRESETS[preset]
        model = os.path.join(tmp, preset + ".gguf")
        subprocess.run([os.path.join(args.bindir, "pdmesh"), "make-test-model", "--arch",
                        preset, "--seed", "1", "--out", model], check=True,
                       capture_output=True)
        ref = reference(args.bindir, model, PROMPT, N, extra=["--ignore-eos"])
        m = Mesh(args.bindir, model, prefill_ranks=2, local_threshold=0,
                 router_args=("--method", method))
        try:
            m.wait_ready()
            r = http_complete(m.http_port, PROMPT, N)
            u = r["usage"]
            check("%s: HTTP answer prefilled by the group (%s), %d tokens, equal to the engine's"
                  % (preset, u["pdmesh"]["prefill_method"], u["completion_tokens"]),
                  u["pdmesh"]["prefill_method"] == method and
                  r["choices"][0]["text"] == ref["text"], (r["choices"][0]["text"], ref["text"]))
            p = python_sdk(m.client_ep, PROMPT, N)
            check("%s: Python package answer equal to the engine's" % preset,
                  p.get("tokens") == ref["tokens"], (p, ref["tokens"]))
            c = c_sdk(args.bindir, m.client_ep, PROMPT, N)
            check("%s: C SDK (pdmesh generate --router) answer equal to the engine's" % preset,
                  c.get("tokens") == ref["tokens"], (c, ref["tokens"]))
        finally:
            rc = m.stop()
        check("%s: the router exits 0 on SIGTERM" % preset, rc == 0, m.log("router")[-1500:])
    print("architectures through the mesh: %d passed, %d failed in %.0f s"
          % (check.passed, check.failed, time.time() - t0))
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main())
