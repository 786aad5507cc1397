"""llama.cpp's own `llama-server` as a benchmark arm beside the mesh (bench/serve/*.py).

It is built from the llama.cpp sources that the llama-cpp-python sdist on PyPI carries
(tools/llama_tools.sh, cached under build/llama.cpp) and started on the same model and the
same cores as the mesh it is compared with, configured the way an operator would run it for
concurrent chat traffic:

  -t/-tb THREADS     every core the mesh's processes share (2 on this machine kind);
  --parallel 4       four slots with continuous batching (llama-server's default);
  -c 4 * SLOT_CTX    each slot gets SLOT_CTX tokens of context;
  prompt cache on    each request reuses its slot's common prefix (`cache_prompt`, default on
                     in current llama-server), and `--cache-reuse 256` also reuses shifted
                     chunks, so a chat's follow-up prefills only its new tokens;
  --no-repack        llama.cpp's extra weight buffer types off, as every reference in this
                     repository runs it (AMX hosts crash with them; see ENVIRONMENT.md).

The object has the two members the load generators use from tests/integration/mesh.Mesh:
`http_port` and `stop()`, so an arm is `LlamaServer(...)` instead of `Mesh(...)`."""
import os
import socket
import subprocess
import time
import urllib.request


def find(bindir=None):
    """The llama-server binary: BINDIR/llama-server, $LLAMA_SERVER, or build/llama.cpp's.
    None when there is none (the caller skips its arm and says so)."""
    here = os.path.dirname(os.path.abspath(__file__))
    cands = [os.path.join(bindir, "llama-server")] if bindir else []
    cands += [os.environ.get("LLAMA_SERVER", ""),
              os.path.join(here, "..", "..", "build", "llama.cpp", "build", "bin", "llama-server")]
    for c in cands:
        if c and os.access(c, os.X_OK):
            return os.path.abspath(c)
    return None


def _free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class LlamaServer:
    def __init__(self, binary, model, threads=2, parallel=4, slot_ctx=2048, log=None):
        self.http_port = _free_port()
        self.argv = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(self.http_port),
                     "-t", str(threads), "-tb", str(threads), "--parallel", str(parallel),
                     "-c", str(parallel * slot_ctx), "--cache-reuse", "256", "--no-repack",
                     "--no-webui", "--metrics"]
        self.log_path = log or os.path.join("/tmp", "llama-server-%d.log" % self.http_port)
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout=120, **_):
        """Waits until /health answers 200 (the model is loaded); raises on timeout or exit."""
        t_end = time.time() + timeout
        while time.time() < t_end:
            if self.proc.poll() is not None:
                raise RuntimeError("llama-server exited with %d (log: %s)" % (
                    self.proc.returncode, self.log_path))
            try:
                with urllib.request.urlopen("http://127.0.0.1:%d/health" % self.http_port,
                                            timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.3)
        raise RuntimeError("llama-server not ready after %d s (log: %s)" % (timeout,
                                                                           self.log_path))

    def stop(self, timeout=30):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
