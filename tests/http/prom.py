"""A real Prometheus server (Debian package `prometheus`) for the tests: scrapes one target
every 500 ms; query() goes through its HTTP API."""
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Prometheus:
    def __init__(self, target_port, binary="prometheus", labels=None):
        """labels: {name: value} put on every series of the target (as a Kubernetes scrape
        job's relabelling would, e.g. namespace)."""
        if not shutil.which(binary):
            raise FileNotFoundError("prometheus is not installed (tools/deps.sh installs it)")
        self.dir = tempfile.mkdtemp(prefix="pdm-prom-")
        cfg = os.path.join(self.dir, "prometheus.yml")
        with open(cfg, "w") as f:
            f.write("global:\n  scrape_interval: 500ms\n  evaluation_interval: 500ms\n"
                    "scrape_configs:\n  - job_name: pdmesh\n    static_configs:\n"
                    "      - targets: ['127.0.0.1:%d']\n" % target_port)
            if labels:
                f.write("        labels: {%s}\n" % ", ".join('%s: "%s"' % kv
                                                           for kv in sorted(labels.items())))
        self.port = free_port()
        self.log = open(os.path.join(self.dir, "log"), "w")
        self.proc = subprocess.Popen(
            [binary, "--config.file=" + cfg, "--storage.tsdb.path=" + os.path.join(self.dir, "db"),
             "--web.listen-address=127.0.0.1:%d" % self.port, "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT)

    def api(self, path, timeout=5):
        url = "http://127.0.0.1:%d%s" % (self.port, path)
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.loads(r.read())

    def query(self, expr):
        j = self.api("/api/v1/query?query=" + urllib.parse.quote(expr))
        assert j["status"] == "success", j
        return j["data"]["result"]

    def wait_series(self, expr, timeout=60):
        """Waits until `expr` returns at least one sample; returns the result."""
        end = time.time() + timeout
        last = None
        while time.time() < end:
            if self.proc.poll() is not None:
                raise AssertionError("prometheus exited: " + open(self.log.name).read()[-2000:])
            try:
                res = self.query(expr)
                if res:
                    return res
                last = res
            except OSError as e:
                last = e
            time.sleep(0.3)
        targets = None
        try:
            targets = self.api("/api/v1/targets")
        except OSError:
            pass
        raise AssertionError("no series for %s after %ds (last %r, targets %r)"
                             % (expr, timeout, last, targets))

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
