#!/usr/bin/env python3
"""Checks deploy/k8s against the schemas and against the binaries, then runs it.

1. Every manifest validates (strict) against the Kubernetes 1.30 schemas (kubernetes-validate,
   offline); the kustomization lists every manifest.
2. Every container's command is one of our binaries, every --flag in its args is in that
   binary's --help, every $(VAR) in its args is defined in its env, every port it names is
   declared, and the secret keys it reads are the ones docs/deployment.md tells to create.
3. The manifests run: each Deployment/StatefulSet replica is started as a local process with
   exactly its args and env, with only what a cluster would supply substituted (service DNS
   names and 0.0.0.0 binds -> loopback ports, $(POD_NAME)/$(POD_INDEX), the secret files,
   eth0 -> lo). The mesh must become ready with the group formed, answer an HTTP completion
   equal to `pdmesh generate --temp 0`, and the UCX listeners of the prefill and decode
   processes must lie in the UCX_TCP_PORT_RANGE the network policy opens. The nodes' exec
   probes (pdmesh health on their --health-file) pass; a decode node frozen with SIGSTOP fails
   its liveness probe, and passes again once it runs (SIGCONT).
4. The mesh scales under load as the workloads would: a decode replica and a prefill rank
   (pod ordinal 2: the elastic group is wired anew with 3 ranks) are added, then that rank and
   a decode replica get SIGTERM and drain (--drain-grace); no accepted request fails.
5. Autoscaling: the HPAs (autoscaling.yaml) and the Prometheus adapter's manifests
   (prometheus-adapter/) validate; every HPA scales a workload of the manifests; every External
   metric an HPA uses is one a rule of the adapter's ConfigMap produces; the rules have the
   fields the adapter needs and every pdmesh_* series they name is registered in router/*.c.
   Live, under concurrent load: the router's waiting, prefill in-flight and free-KV gauges move
   and return to rest, every series the rules name is on /metrics, and a real Prometheus
   scraping the router answers each rule's discovery (seriesQuery) and its metricsQuery, filled
   in as the adapter fills it for each HPA, with one finite value.

  python3 tests/deploy/check_k8s.py --bindir build/bin [--model FILE]
"""
import glob
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import kubernetes_validate
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integration"))
from mesh import Checks, free_port, mesh_argparser  # noqa: E402
from k8s_pods import K8S, load_docs, pods, workloads  # noqa: E402
sys.path.insert(0, os.path.join(HERE, "..", "http"))
ADAPTER = os.path.join(K8S, "prometheus-adapter")
ROUTER_SRC = os.path.join(HERE, "..", "..", "router")
RULE_KEYS = {"seriesQuery", "seriesFilters", "resources", "name", "metricsQuery"}
TEMPLATE_FIELDS = {"Series", "LabelMatchers", "GroupBy", "LabelValuesByName", "GroupBySlice"}
SECRET_KEYS = {"cluster-secret", "admin-token"}
check = Checks(4000)


def static_checks(bindir, docs):
    for f, d in docs:
        try:
            kubernetes_validate.validate(d, "1.30.0", strict=True)
            ok, why = True, ""
        except Exception as e:  # ValidationError and schema errors
            ok, why = False, e
        check("%s: %s/%s validates (strict, 1.30)" % (f, d["kind"], d["metadata"]["name"]),
              ok, why)
    with open(os.path.join(K8S, "kustomization.yaml")) as fh:
        kust = yaml.safe_load(fh)
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(K8S, "*.yaml"))
                   if os.path.basename(p) != "kustomization.yaml")
    check("kustomization lists every manifest", sorted(kust["resources"]) == files,
          (kust["resources"], files))
    helps = {}
    for f, d in workloads(docs):
        spec = d["spec"]["template"]["spec"]
        vols = {v["name"]: v for v in spec.get("volumes", [])}
        for c in spec["containers"]:
            b = c["command"][0]
            path = os.path.join(bindir, b)
            check("%s: %s runs a pdmesh binary" % (f, b), os.access(path, os.X_OK), path)
            if b not in helps:
                r = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=30)
                helps[b] = r.stdout + r.stderr
            flags = [a for a in c.get("args", []) if a.startswith("--")]
            unknown = [a for a in flags if not re.search(re.escape(a) + r"\b", helps[b])]
            check("%s: every flag of %s is in its --help" % (f, b), not unknown, unknown)
            env = {e["name"] for e in c.get("env", [])}
            refs = set(re.findall(r"\$\((\w+)\)", " ".join(c.get("args", []))))
            check("%s: %s's $(VAR) references are defined" % (f, b), refs <= env, refs - env)
            named = {p["name"] for p in c.get("ports", [])}
            probes = [c.get(k, {}).get("httpGet", {}).get("port") for k in
                      ("readinessProbe", "livenessProbe")]
            check("%s: %s's probes name declared ports" % (f, b),
                  all(p is None or p in named for p in probes), probes)
            for k in ("startupProbe", "livenessProbe", "readinessProbe"):
                cmd = c.get(k, {}).get("exec", {}).get("command")
                if not cmd:
                    continue
                pb = os.path.join(bindir, cmd[0])
                if cmd[0] not in helps and os.access(pb, os.X_OK):
                    r = subprocess.run([pb, "--help"], capture_output=True, text=True, timeout=30)
                    helps[cmd[0]] = r.stdout + r.stderr
                unknown = [a for a in cmd[1:] if a.startswith("--") and
                           not re.search(re.escape(a) + r"\b", helps.get(cmd[0], ""))]
                check("%s: %s's %s runs a pdmesh binary with known flags" % (f, b, k),
                      os.access(pb, os.X_OK) and not unknown, (cmd, unknown))
            if any("exec" in c.get(k, {}) for k in ("livenessProbe", "readinessProbe")):
                hf = [c["args"][i + 1] for i, a in enumerate(c["args"][:-1])
                      if a == "--health-file"]
                used = {x for k in ("startupProbe", "livenessProbe", "readinessProbe")
                        for x in c.get(k, {}).get("exec", {}).get("command", [])
                        if x.startswith("/")}
                writable = [m["mountPath"] for m in c.get("volumeMounts", [])
                            if "emptyDir" in vols.get(m["name"], {})]
                check("%s: %s's exec probes read the --health-file it writes, on an emptyDir"
                      % (f, b), hf and used == set(hf) and
                      any(hf[0].startswith(w + "/") for w in writable), (hf, used, writable))
            for m in c.get("volumeMounts", []):
                v = vols.get(m["name"])
                check("%s: %s mounts a declared volume %s" % (f, b, m["name"]), v is not None)
                if v and "secret" in v:
                    used = {a.rsplit("/", 1)[1] for a in c["args"]
                            if a.startswith(m["mountPath"] + "/")}
                    check("%s: %s reads only the documented secret keys" % (f, b),
                          used and used <= SECRET_KEYS, used)
    svc = {d["metadata"]["name"]: d for f, d in docs if d["kind"] == "Service"}
    router = [d for f, d in workloads(docs) if d["metadata"]["name"] == "pdmesh-router"][0]
    # high availability (docs/deployment.md): two routers or more, a disruption budget that
    # keeps one, and every node's router list naming each replica on the headless Service
    replicas = router["spec"].get("replicas", 1)
    pdbs = [d for f, d in docs if d["kind"] == "PodDisruptionBudget" and
            d["spec"]["selector"]["matchLabels"] == router["spec"]["selector"]["matchLabels"]]
    check("at least 2 router replicas with a PodDisruptionBudget keeping one (%d)" % replicas,
          replicas >= 2 and pdbs and pdbs[0]["spec"].get("minAvailable") == 1)
    headless = router["spec"].get("serviceName")
    check("the routers' headless Service exists (clusterIP None)",
          headless in svc and svc[headless]["spec"].get("clusterIP") == "None", headless)
    want = {"tcp://%s-%d.%s:7701" % (router["metadata"]["name"], i, headless)
            for i in range(replicas)}
    lists = {}
    for f, d in workloads(docs):
        c = d["spec"]["template"]["spec"]["containers"][0]
        if d is router:
            continue
        env = {e["name"]: e.get("value", "") for e in c.get("env", [])}
        args = c.get("args", [])
        arg = args[args.index("--router") + 1] if "--router" in args else ""
        arg = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), ""), arg)
        lists[d["metadata"]["name"]] = set(arg.split(","))
    check("every node's --router lists every router replica", lists and
          all(v == want for v in lists.values()), (lists, want))
    cports = {p["name"]: p["containerPort"]
              for p in router["spec"]["template"]["spec"]["containers"][0]["ports"]}
    check("router Service targets declared container ports",
          all(p["targetPort"] in cports for p in svc["pdmesh-router"]["spec"]["ports"]))
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    bound = {int(a.rsplit(":", 1)[1]) for a in args if re.match(r"(tcp://)?0\.0\.0\.0:\d+$", a)}
    check("router binds exactly its declared ports", bound == set(cports.values()),
          (bound, cports))


def adapter_docs():
    """[(file name, document)] of deploy/k8s/prometheus-adapter/ but its kustomization."""
    out = []
    for path in sorted(glob.glob(os.path.join(ADAPTER, "*.yaml"))):
        if os.path.basename(path) != "kustomization.yaml":
            with open(path) as fh:
                out += [(os.path.basename(path), d) for d in yaml.safe_load_all(fh) if d]
    return out


def router_series():
    """The series names the router registers (router/*.c, pdm_metrics_add): a histogram's
    _bucket, _sum and _count."""
    names = set()
    for path in glob.glob(os.path.join(ROUTER_SRC, "*.c")):
        src = open(path).read()
        for kind, name in re.findall(r"pdm_metrics_add\(\s*[\w>.-]+,\s*PDM_METRIC_(\w+),\s*"
                                     r"\"(pdmesh_\w+)\"", src):
            names |= ({name + s for s in ("_bucket", "_sum", "_count")}
                      if kind == "HISTOGRAM" else {name})
    return names


def rule_series(rule):
    """The metric name a rule's seriesQuery selects (name{...} or {__name__="name",...})."""
    q = rule.get("seriesQuery", "")
    m = re.match(r"\s*([A-Za-z_:][\w:]*)\s*(\{|$)", q) or \
        re.search(r"__name__\s*=\s*\"([A-Za-z_:][\w:]*)\"", q)
    return m.group(1) if m else None


def rule_external_name(rule, series):
    """The External metric name the adapter gives series under the rule's name.matches/as."""
    name = rule.get("name", {})
    rx = re.compile(name.get("matches", ".*"))
    m = rx.search(series)
    if not m:
        return None
    want = name.get("as") or ("$1" if rx.groups == 1 else "$0")
    return re.sub(r"\$\{?(\d+)\}?", lambda g: m.group(int(g.group(1))) or "", want)


def fill_query(rule, series, matchers):
    """metricsQuery as the adapter fills it: its Go template with << >> delimiters."""
    q = rule["metricsQuery"]
    q = q.replace("<<.Series>>", series).replace("<<.LabelMatchers>>", matchers)
    return q.replace("<<.GroupBy>>", "")


def adapter_rules(adocs):
    """The externalRules of the adapter's ConfigMap(s), parsed from data["config.yaml"]."""
    rules = []
    for f, d in adocs:
        if d["kind"] == "ConfigMap" and "config.yaml" in d.get("data", {}):
            cfg = yaml.safe_load(d["data"]["config.yaml"])
            rules += (cfg or {}).get("externalRules", []) or []
    return rules


def hpas(docs):
    return [(f, d) for f, d in docs if d["kind"] == "HorizontalPodAutoscaler"]


def hpa_metric_uses(docs):
    """[(HPA name, External metric name, {selector labels})] of every HPA."""
    out = []
    for f, d in hpas(docs):
        for m in d["spec"].get("metrics", []):
            if m["type"] == "External":
                mm = m["external"]["metric"]
                out.append((d["metadata"]["name"], mm["name"],
                            mm.get("selector", {}).get("matchLabels", {})))
    return out


def autoscaling_checks(docs, adocs):
    for f, d in adocs:
        try:
            kubernetes_validate.validate(d, "1.30.0", strict=True)
            ok, why = True, ""
        except Exception as e:
            ok, why = False, e
        check("prometheus-adapter/%s: %s/%s validates (strict, 1.30)"
              % (f, d["kind"], d["metadata"]["name"]), ok, why)
    with open(os.path.join(ADAPTER, "kustomization.yaml")) as fh:
        kust = yaml.safe_load(fh)
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ADAPTER, "*.yaml"))
                   if os.path.basename(p) != "kustomization.yaml")
    check("prometheus-adapter kustomization lists every manifest",
          sorted(kust["resources"]) == files, (kust["resources"], files))
    rules = adapter_rules(adocs)
    check("the adapter's ConfigMap holds externalRules (config.yaml parses)", rules, adocs)
    exposed = router_series()
    produced = {}
    for k, r in enumerate(rules):
        bad = []
        if not isinstance(r, dict) or set(r) - RULE_KEYS:
            bad.append(("unknown fields", sorted(set(r) - RULE_KEYS)))
        for key in ("seriesQuery", "metricsQuery"):
            if not isinstance(r.get(key), str) or not r.get(key).strip():
                bad.append(("missing", key))
        res = r.get("resources", {})
        if not (res.get("namespaced") is False or
                {"resource": "namespace"} in [dict(v) for v in
                                             res.get("overrides", {}).values()]):
            bad.append("resources: no namespace override (nor namespaced: false)")
        fields = set(re.findall(r"<<\s*\.(\w+)\s*>>", r.get("metricsQuery", "")))
        if fields - TEMPLATE_FIELDS or not {"Series", "LabelMatchers"} <= fields or \
                r.get("metricsQuery", "").count("<<") != len(re.findall(
                    r"<<\s*\.\w+\s*>>", r.get("metricsQuery", ""))):
            bad.append(("metricsQuery template fields", sorted(fields)))
        series = rule_series(r)
        try:
            ext = rule_external_name(r, series) if series else None
        except re.error as e:
            ext, bad = None, bad + [("name.matches", e)]
        if not series or not ext:
            bad.append(("series/name", series, ext))
        named = set(re.findall(r"\bpdmesh_\w+", r.get("seriesQuery", "") + " " +
                               r.get("metricsQuery", "")))
        if named - exposed:
            bad.append(("not registered by the router", sorted(named - exposed)))
        if ext in produced:
            bad.append(("External name produced twice", ext))
        check("adapter rule %d (%s -> %s) has the adapter's fields and names router series"
              % (k, series, ext), not bad, bad)
        if ext:
            produced[ext] = (r, series)
    wl = {(d["kind"], d["metadata"]["name"]): d for f, d in workloads(docs)}
    for f, d in hpas(docs):
        name, spec = d["metadata"]["name"], d["spec"]
        ref = spec["scaleTargetRef"]
        check("%s: HPA %s scales a workload of the manifests (%s/%s)"
              % (f, name, ref["kind"], ref["name"]),
              ref.get("apiVersion") == "apps/v1" and (ref["kind"], ref["name"]) in wl, ref)
        used = [m for h, m, sel in hpa_metric_uses(docs) if h == name]
        check("%s: HPA %s uses only External metrics that an adapter rule produces (%s)"
              % (f, name, ", ".join(used)),
              used and all(m in produced for m in used) and
              all(m["type"] == "External" for m in spec["metrics"]),
              sorted(set(used) - set(produced)))
        b = spec.get("behavior", {})
        up = b.get("scaleUp", {}).get("stabilizationWindowSeconds", 0)
        down = b.get("scaleDown", {}).get("stabilizationWindowSeconds", 300)
        check("%s: HPA %s scales down more slowly than up (stabilization %d s > %d s), "
              "between %d and %d replicas" % (f, name, down, up, spec.get("minReplicas", 1),
                                              spec["maxReplicas"]),
              down > up and 1 <= spec.get("minReplicas", 1) <= spec["maxReplicas"])
        target = wl.get((ref["kind"], ref["name"]))
        if target:
            c = target["spec"]["template"]["spec"]["containers"][0]
            args = c.get("args", [])
            grace = [int(args[i + 1]) for i, a in enumerate(args[:-1]) if a == "--drain-grace"]
            grace += [int(a.split("=", 1)[1]) for a in args if a.startswith("--drain-grace=")]
            tgps = target["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
            check("%s: %s's terminationGracePeriodSeconds (%d) exceeds its --drain-grace (%s)"
                  % (f, ref["name"], tgps, grace[0] if grace else "not set"),
                  not grace or tgps > grace[0])
    return produced


def listening_ports(pid):
    """TCP ports a process listens on (from /proc/net/tcp{,6} and its fds)."""
    inodes = set()
    for fd in glob.glob("/proc/%d/fd/*" % pid):
        try:
            t = os.readlink(fd)
        except OSError:
            continue
        if t.startswith("socket:["):
            inodes.add(t[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as fh:
            for line in fh.readlines()[1:]:
                f = line.split()
                if f[3] == "0A" and f[9] in inodes:  # LISTEN
                    ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


def scrape(http_port):
    """{series with labels: value} of the router's /metrics."""
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % http_port, timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def autoscaling_live(http_port, docs, produced, namespace="pdmesh"):
    """The autoscaling signals on the mesh of the manifests: the gauges under load and at
    rest, the rules' series on /metrics, and the rules' queries on a real Prometheus."""
    from prom import Prometheus
    decode = [d for f, d in workloads(docs) if d["metadata"]["name"] == "pdmesh-decode"][0]
    dargs = decode["spec"]["template"]["spec"]["containers"][0]["args"]
    budget = int(dargs[dargs.index("--kv-budget") + 1]) * decode["spec"].get("replicas", 1)
    prom = None
    try:
        prom = Prometheus(http_port, labels={"namespace": namespace})
    except FileNotFoundError as e:
        check("a real Prometheus for the adapter's queries", False, e)
    try:
        rest = scrape(http_port)
        check("at rest: capacity = free = %d KV tokens (--kv-budget x decode replicas), nothing "
              "waiting, no prefill in flight" % budget,
              rest.get("pdmesh_decode_kv_capacity_tokens") == budget and
              rest.get("pdmesh_decode_kv_free_tokens") == budget and
              rest.get('pdmesh_requests_waiting{reason="prefill"}') == 0 and
              rest.get('pdmesh_requests_waiting{reason="decode"}') == 0 and
              rest.get('pdmesh_prefill_inflight{group="a"}') == 0,
              {k: v for k, v in rest.items() if "kv_" in k or "waiting" in k or "inflight" in k})
        seen = {k for k in rest}
        names = {k.split("{", 1)[0] for k in seen}
        missing = {s for r, s in produced.values()} - names
        check("every series the adapter's rules select is on the router's /metrics",
              not missing, missing)
        if prom:  # scraping before the load: rate() and avg_over_time() then span it
            prom.wait_series('pdmesh_queue_depth{namespace="%s"}' % namespace, timeout=60)
        # Concurrent prompts long enough for the group (not --local-threshold): the group
        # holds --group-inflight of them, the others wait for it.
        n, done, errors = 8, [], []
        prompt = ("Explain, in a few careful sentences, why the sky looks blue during the day "
                  "and red at sunset, and what the atmosphere has to do with both of them.")

        def client(i):
            body = json.dumps({"prompt": prompt + " " * i, "max_tokens": 16,
                               "temperature": 0}).encode()
            req = urllib.request.Request("http://127.0.0.1:%d/v1/completions" % http_port,
                                         data=body,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=300) as r:
                    done.append(json.loads(r.read())["usage"]["pdmesh"]["prefill_method"])
            except Exception as e:  # reported below
                errors.append(repr(e))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        peak = {"waiting_prefill": 0, "inflight": 0, "limit": None, "kv_free_min": budget}
        while any(t.is_alive() for t in threads):
            m = scrape(http_port)
            peak["waiting_prefill"] = max(peak["waiting_prefill"],
                                          m.get('pdmesh_requests_waiting{reason="prefill"}', 0))
            peak["inflight"] = max(peak["inflight"], m.get('pdmesh_prefill_inflight{group="a"}', 0))
            peak["limit"] = m.get("pdmesh_prefill_inflight_limit")
            peak["kv_free_min"] = min(peak["kv_free_min"],
                                      m.get("pdmesh_decode_kv_free_tokens", budget))
            time.sleep(0.02)
        for t in threads:
            t.join()
        check("%d concurrent completions served" % n, len(done) == n and not errors,
              (done, errors[:3]))
        check("under load: requests wait for the prefill group (peak %d), the group holds "
              "1..limit (%s) tasks (peak %d), the decode node's free KV drops (min %d of %d)"
              % (peak["waiting_prefill"], peak["limit"], peak["inflight"], peak["kv_free_min"],
                 budget),
              peak["waiting_prefill"] >= 1 and peak["limit"] and
              1 <= peak["inflight"] <= peak["limit"] and peak["kv_free_min"] < budget, peak)
        after = scrape(http_port)
        check("after the load: free KV back to %d, nothing waiting, no prefill in flight" % budget,
              after.get("pdmesh_decode_kv_free_tokens") == budget and
              after.get('pdmesh_requests_waiting{reason="prefill"}') == 0 and
              after.get('pdmesh_requests_waiting{reason="decode"}') == 0 and
              after.get('pdmesh_prefill_inflight{group="a"}') == 0,
              {k: v for k, v in after.items() if "kv_" in k or "waiting" in k or "inflight" in k})
        if not prom:
            return
        # What the adapter does for each HPA metric: discovery through /api/v1/series with the
        # rule's seriesQuery, then the metricsQuery with the HPA's namespace and selector.
        time.sleep(2)  # two scrapes after the load: rate() over the window has its points
        uses = {(m, tuple(sorted(sel.items()))) for h, m, sel in hpa_metric_uses(docs)}
        uses |= {(m, ()) for m in produced}
        for ext, sel in sorted(uses):
            if ext not in produced:
                continue
            rule, series = produced[ext]
            found = prom.wait_series(series, timeout=60)
            disc = prom.api("/api/v1/series?match[]=" + urllib.parse.quote(rule["seriesQuery"]))
            matchers = ",".join('%s="%s"' % kv for kv in (("namespace", namespace),) + sel)
            q = fill_query(rule, series, matchers)
            try:
                res = prom.query(q)
            except (AssertionError, OSError) as e:
                res = e
            vals = [float(x["value"][1]) for x in res] if isinstance(res, list) else []
            check("Prometheus: %s%s: discovery finds %s, the query gives one finite value (%s)"
                  % (ext, dict(sel) or "", series, vals[0] if vals else None),
                  found and disc.get("data") and len(vals) == 1 and math.isfinite(vals[0]),
                  (q, res))
        ttft = prom.query(fill_query(produced["pdmesh_ttft_seconds_p90"][0],
                                     "pdmesh_ttft_seconds_bucket", 'namespace="%s"' % namespace))
        used = prom.query(fill_query(produced["pdmesh_decode_kv_used_ratio"][0],
                                     "pdmesh_decode_kv_free_tokens",
                                     'namespace="%s"' % namespace))
        waited = prom.query(fill_query(produced["pdmesh_requests_waiting"][0],
                                       "pdmesh_requests_waiting",
                                       'namespace="%s",reason="prefill"' % namespace))
        tv, uv = float(ttft[0]["value"][1]), float(used[0]["value"][1])
        check("Prometheus: after the load TTFT p90 > 0 (%.3f s), KV used ratio 0 (%.3f); "
              "waiting for prefill, 1 min average: %.2f (the scrapes that fell in the load)"
              % (tv, uv, float(waited[0]["value"][1])), tv > 0 and uv == 0)
    finally:
        if prom:
            prom.stop()


def live_run(bindir, model, docs, produced):
    tmp = tempfile.mkdtemp(prefix="pdm-k8s-")
    secrets = os.path.join(tmp, "secrets")
    os.makedirs(secrets)
    for k in SECRET_KEYS:
        with open(os.path.join(secrets, k), "w") as fh:
            fh.write(os.urandom(16).hex())
        os.chmod(os.path.join(secrets, k), 0o440)
    ports = {}  # (router pod, its bind port) -> local port
    procs = []
    http_port = None
    http_ports = {}  # router pod -> its HTTP port
    svc_port = {}

    def local(pod_name, port):
        return ports.setdefault((pod_name, port), free_port())

    def subst(pod, arg):
        """An arg of `pod` for a local process: its binds on its own free ports; a router
        Service name (tcp://pdmesh-router:7701) -> the first router's port; a pod name on a
        headless Service (tcp://pdmesh-router-1.pdmesh-router-nodes:7701) -> that pod's port;
        a comma list of them -> each one."""
        nonlocal http_port
        if arg.startswith("tcp://") and "," in arg:
            return ",".join(subst(pod, x) for x in arg.split(","))
        arg = arg.replace("/etc/pdmesh/secrets", secrets)
        m = re.match(r"(tcp://)?0\.0\.0\.0:(\d+)$", arg)
        if m:
            port = local(pod.name, int(m.group(2)))
            if not m.group(1):
                http_ports[pod.name] = port
                if http_port is None:
                    http_port = port  # the first router's HTTP port
            return "%s127.0.0.1:%d" % (m.group(1) or "", port)
        m = re.match(r"tcp://([a-z0-9-]+)(?:\.([a-z0-9-]+))?:(\d+)$", arg)
        if m:
            host, headless, port = m.group(1), m.group(2), int(m.group(3))
            if headless:
                return "tcp://127.0.0.1:%d" % local(host, svc_port[(headless, port)])
            return "tcp://127.0.0.1:%d" % local(first_router, svc_port[(host, port)])
        return arg

    for f, d in docs:
        if d["kind"] == "Service":
            for p in d["spec"].get("ports", []):
                svc_port[(d["metadata"]["name"], p["port"])] = p["port"]
    def pod_paths(pod, arg):
        """A path on one of the pod's emptyDir volumes -> a directory of its own here."""
        for m in pod.mounts:
            if m.kind == "emptyDir" and arg.startswith(m.path.rstrip("/") + "/"):
                d = os.path.join(tmp, "pods", pod.name, m.path.strip("/"))
                os.makedirs(d, exist_ok=True)
                return os.path.join(d, arg[len(m.path.rstrip("/")) + 1:])
        return arg

    def probe(pod, kind):
        cmd = pod.probes[kind]
        argv = [os.path.join(bindir, cmd[0])] + [pod_paths(pod, a) for a in cmd[1:]]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=10)
        return r.returncode, r.stdout.strip()

    the_pods = pods(docs)
    first_router = [p.name for p in the_pods if p.component == "router"][0]
    try:
        def start(pod):
            env = dict(os.environ)
            env["PDMESH_MODEL"] = model
            env.update({k: "lo" if v == "eth0" else v for k, v in pod.env.items()})
            argv = [os.path.join(bindir, pod.command[0])] + [subst(pod, pod_paths(pod, a))
                                                             for a in pod.args]
            log = open(os.path.join(tmp, pod.name + ".log"), "w")
            p = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL)
            procs.append((pod.name, pod.workload, p))
            return p

        for pod in the_pods:
            start(pod)
        check("the router's HTTP port was found in its args", http_port is not None)
        ready, end = False, time.time() + 120
        while time.time() < end and not ready:
            try:
                with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % http_port,
                                            timeout=5) as r:
                    text = r.read().decode()
                alive = re.search(r'^pdmesh_nodes\{role_state="prefill_alive"\} (\d+)', text, re.M)
                dalive = re.search(r'^pdmesh_nodes\{role_state="decode_alive"\} (\d+)', text, re.M)
                ready = bool(alive and int(alive.group(1)) >= 2 and dalive and
                             int(dalive.group(1)) >= 1)
            except OSError:
                pass
            if not ready:
                time.sleep(0.3)
        check("the mesh of the manifests registers (2 prefill ranks, 1 decode node)", ready)
        # high availability: every router replica has every node (they register with each)
        seen = {}
        for pod in the_pods:
            if pod.component != "router":
                continue
            hp = ports.get((pod.name, 8080))
            end = time.time() + 60
            while time.time() < end:
                try:
                    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % hp,
                                                timeout=5) as r:
                        text = r.read().decode()
                    seen[pod.name] = sum(int(x) for x in re.findall(
                        r'^pdmesh_nodes\{role_state="(?:prefill|decode)_alive"\} (\d+)', text, re.M))
                except (OSError, TypeError):
                    seen[pod.name] = None
                if seen[pod.name] == 3:
                    break
                time.sleep(0.3)
        check("every router replica (%d) has the 3 nodes registered" % len(seen),
              len(seen) >= 2 and all(v == 3 for v in seen.values()), seen)
        prompt = ("The capital of France is a city that many people visit because of its "
                  "museums, its food, and its long history.")
        body = json.dumps({"prompt": prompt, "max_tokens": 16, "temperature": 0}).encode()
        got = None
        for _ in range(20):  # the group is wired a moment after its ranks register
            req = urllib.request.Request("http://127.0.0.1:%d/v1/completions" % http_port,
                                         data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                got = json.loads(r.read())
            if got["usage"].get("pdmesh", {}).get("prefill_method") not in (None, "local"):
                break
            time.sleep(0.5)
        want = subprocess.run([os.path.join(bindir, "pdmesh"), "generate", "--model", model,
                               "--temp", "0", "-n", "16", "--prompt", prompt],
                              capture_output=True, text=True, timeout=300).stdout.rstrip("\n")
        method = got["usage"].get("pdmesh", {}).get("prefill_method")
        check("HTTP completion through the prefill group equals pdmesh generate --temp 0",
              got["choices"][0]["text"] == want and method not in (None, "local"),
              (got["choices"][0]["text"], want, method))
        autoscaling_live(http_port, docs, produced)
        lo, hi = [int(x) for x in [e["value"] for f, d in workloads(docs)
                                   for e in d["spec"]["template"]["spec"]["containers"][0]
                                   .get("env", []) if e["name"] == "UCX_TCP_PORT_RANGE"][0]
                  .split("-")]
        outside = {}
        for name, kind, p in procs:
            if kind == "pdmesh-router":
                continue
            lp = listening_ports(p.pid)
            bad = {x for x in lp if not lo <= x <= hi}
            if bad or not lp:
                outside[name] = sorted(lp)
        check("prefill and decode listen only inside UCX_TCP_PORT_RANGE %d-%d" % (lo, hi),
              not outside, outside)
        probed = {(pod.name, k): probe(pod, k) for pod in the_pods for k in pod.probes}
        check("every node's exec probes pass (%d probes of %d pods)"
              % (len(probed), len({n for n, _ in probed})),
              probed and all(rc == 0 for rc, _ in probed.values()),
              {k: v for k, v in probed.items() if v[0]})
        dpod = [pod for pod in the_pods if pod.component == "decode" and pod.probes][0]
        dproc = [p for name, kind, p in procs if name == dpod.name][0]
        dproc.send_signal(signal.SIGSTOP)
        t0, failed_after = time.time(), None
        while time.time() - t0 < 30 and failed_after is None:
            time.sleep(1)
            if probe(dpod, "liveness")[0] != 0:
                failed_after = time.time() - t0
        dproc.send_signal(signal.SIGCONT)
        back_after = None
        while time.time() - t0 < 60 and back_after is None:
            time.sleep(0.5)
            if probe(dpod, "liveness")[0] == 0 and probe(dpod, "readiness")[0] == 0:
                back_after = time.time() - t0
        check("a decode node frozen with SIGSTOP fails its liveness probe (after %s s) and "
              "passes liveness and readiness again after SIGCONT"
              % (None if failed_after is None else round(failed_after, 1)),
              failed_after is not None and back_after is not None,
              (failed_after, back_after, probe(dpod, "liveness")))
        # The elastic group grows and shrinks under load on every router at once: a router
        # that re-wires the group first makes the tasks the others planned for the old
        # formation be refused by rank 0 (PrefillTask.formation) and planned again, instead
        # of stalling a group timeout (docs/router.md "High availability").
        elastic_run(docs, sorted(http_ports.values()), start, procs,
                    os.path.join(tmp, first_router + ".log"), prompt, want)
    finally:
        for name, kind, p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for name, kind, p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        if check.failed:
            for log in sorted(glob.glob(os.path.join(tmp, "*.log"))):
                print("---- " + log)
                print(open(log).read()[-1500:])


class Load:
    """Clients sending completions over HTTP one after another, to every router in turn (long
    prompts, which the prefill group takes, and short ones) until finish(): each result is "ok", "refused" (429/503 at
    admission) or "failed" with the reason."""
    CLIENTS = 3

    def __init__(self, ports, prompt):
        self.ports, self.prompt = ports, prompt
        self.results, self.stop = [], threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True)
                        for i in range(self.CLIENTS)]
        for t in self.threads:
            t.start()

    def _client(self, i):
        k = 0
        while not self.stop.is_set():
            k += 1
            words = self.prompt + (" Tell me more, part %d of %d." % (k, i) if k % 3 else "")
            body = json.dumps({"prompt": words if (k + i) % 2 else "Hi %d" % k,
                               "max_tokens": 24, "temperature": 0}).encode()
            port = self.ports[(i + k) % len(self.ports)]  # every router in turn
            req = urllib.request.Request("http://127.0.0.1:%d/v1/completions" % port,
                                         data=body, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    u = json.loads(r.read())["usage"]["pdmesh"]
                self.results.append(("ok", u["decode_node"], u["prefill_ranks"]))
            except urllib.error.HTTPError as e:
                self.results.append(("refused" if e.code in (429, 503) else "failed", e.code,
                                     e.read()[:200]))
            except (OSError, ValueError, KeyError) as e:
                self.results.append(("failed", repr(e), ""))

    def finish(self):
        self.stop.set()
        for t in self.threads:
            t.join(150)
        return self.results


def elastic_run(docs, http_ports, start, procs, router_log, prompt, want):
    """The mesh grows and shrinks under load the way a Deployment/StatefulSet scale does: a
    decode replica added (it takes requests within a heartbeat of registering), a prefill rank
    added (the elastic group is wired anew with 3 ranks, once the tasks in flight end), then
    that rank and a decode replica removed with SIGTERM (they drain: no new work, running work
    finishes, exit 0). No accepted request may fail."""
    more = {p.name: p for p in pods(docs, replicas={"pdmesh-decode": 2, "pdmesh-prefill-a": 3})}
    running = {name for name, _, _ in procs}
    new_dec = [p for n, p in more.items() if p.component == "decode" and n not in running][0]
    new_pre = [p for n, p in more.items() if p.component == "prefill" and n not in running][0]

    def log():
        with open(router_log, errors="replace") as fh:
            return fh.read()

    def wait(pred, seconds):
        end = time.time() + seconds
        while time.time() < end:
            if pred():
                return True
            time.sleep(0.2)
        return False

    load = Load(http_ports, prompt)
    try:
        time.sleep(2)
        t0 = time.time()
        dproc = start(new_dec)
        reg = wait(lambda: "router: %s registered" % new_dec.name in log(), 60)
        t_reg = time.time()
        got = wait(lambda: any(r[0] == "ok" and r[1] == new_dec.name for r in load.results), 30)
        check("a decode replica added under load registers after %.1f s and serves its first "
              "request %.1f s after registering" % (t_reg - t0, time.time() - t_reg), reg and got)

        t0 = time.time()
        pproc = start(new_pre)
        wired3 = wait(lambda: "prefill group a wired (3 ranks, elastic)" in log(), 90)
        t_w = time.time()
        used3 = wait(lambda: any(r[0] == "ok" and r[2] == 3 for r in load.results), 60)
        check("a prefill rank added under load: the elastic group is wired anew with 3 ranks "
              "after %.1f s and prefills with all 3" % (t_w - t0), wired3 and used3)

        n_wired = log().count("prefill group a wired (2 ranks, elastic)")
        pproc.send_signal(signal.SIGTERM)
        t0 = time.time()
        back2 = wait(lambda: log().count("prefill group a wired (2 ranks, elastic)") > n_wired, 60)
        try:
            rc = pproc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            rc = None
        check("SIGTERM of that rank: it drains, the group is wired anew with 2 ranks after %.1f s, "
              "the rank exits 0" % (time.time() - t0), back2 and rc == 0, (back2, rc))

        victim = [p for n, _, p in procs if n == "pdmesh-decode-0"][0]
        time.sleep(1)
        victim.send_signal(signal.SIGTERM)
        t0 = time.time()
        draining = wait(lambda: "router: pdmesh-decode-0 draining" in log(), 10)
        try:
            rc = victim.wait(timeout=40)
        except subprocess.TimeoutExpired:
            rc = None
        check("SIGTERM of a decode replica under load: it drains (no new requests) and exits 0 "
              "after %.1f s" % (time.time() - t0), draining and rc == 0, (draining, rc))
        time.sleep(2)
    finally:
        results = load.finish()
    bad = [r for r in results if r[0] == "failed"]
    by_node = {}
    for r in results:
        if r[0] == "ok":
            by_node[r[1]] = by_node.get(r[1], 0) + 1
    check("under load while the mesh grew and shrank: %d requests, %d refused at admission, "
          "0 accepted ones failed (%s)" % (len(results), len([r for r in results
                                                                if r[0] == "refused"]),
                                           ", ".join("%s %d" % kv for kv in sorted(by_node.items()))),
          results and not bad, bad[:5])


def main():
    ap = mesh_argparser()
    args = ap.parse_args()
    docs = load_docs()
    static_checks(args.bindir, docs)
    produced = autoscaling_checks(docs, adapter_docs())
    live_run(args.bindir, args.model, docs, produced)
    print("k8s: %d passed, %d failed" % (check.passed, check.failed))
    sys.exit(1 if check.failed else 0)


if __name__ == "__main__":
    main()
