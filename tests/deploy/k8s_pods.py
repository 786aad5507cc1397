"""deploy/k8s as the pods a cluster would start: one Pod per replica of each Deployment and
StatefulSet, with the container's command, its args with $(VAR) expanded the way the kubelet
expands them, its env (fieldRefs resolved: metadata.name, the StatefulSet pod index), its
volume mounts and its securityContext. Shared by tests/deploy/check_k8s.py (the pods as local
processes) and tests/container/run.py (the pods as podman containers), so that neither writes
the manifests' arguments a second time."""
import glob
import os
import re
from dataclasses import dataclass, field

import yaml

K8S = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "deploy", "k8s")


def load_docs():
    """[(file name, document)] of every manifest but the kustomization, in file order."""
    docs = []
    for path in sorted(glob.glob(os.path.join(K8S, "*.yaml"))):
        if os.path.basename(path) == "kustomization.yaml":
            continue
        with open(path) as f:
            for d in yaml.safe_load_all(f):
                if d:
                    docs.append((os.path.basename(path), d))
    return docs


def workloads(docs):
    return [(f, d) for f, d in docs if d["kind"] in ("Deployment", "StatefulSet")]


@dataclass
class Mount:
    path: str            # mountPath
    kind: str            # "secret" or "emptyDir"
    read_only: bool
    mode: int = 0o644    # the secret volume's defaultMode


@dataclass
class Pod:
    name: str            # "<workload>-<index>" (a StatefulSet's pod name; stands in for a
    workload: str        # Deployment's generated one)
    component: str       # app.kubernetes.io/component: router, prefill, decode
    index: int
    command: list        # the container's command (our binary's name, on the image's PATH)
    args: list           # with $(VAR) expanded from env
    env: dict            # the container's env, fieldRefs resolved
    mounts: list = field(default_factory=list)
    run_as_user: int = None
    run_as_group: int = None
    fs_group: int = None
    read_only_root: bool = False
    drop_caps: list = field(default_factory=list)
    no_new_privileges: bool = False
    probes: dict = field(default_factory=dict)  # "startup"/"liveness"/"readiness" -> exec
                                                # command (httpGet probes are not listed)


def _field_ref(path, name, index):
    if path == "metadata.name":
        return name
    if path == "metadata.labels['apps.kubernetes.io/pod-index']":
        return str(index)
    raise ValueError("fieldRef %s is not one this harness can resolve" % path)


def pods(docs, replicas=None):
    """The pods of the manifests' workloads, the router's first (the others register with it).
    replicas: {workload name: count} overriding spec.replicas (kubectl scale)."""
    replicas = replicas or {}
    # a workload without spec.replicas starts at its HPA's minReplicas (the HPA owns the count)
    hpa_min = {d["spec"]["scaleTargetRef"]["name"]: d["spec"].get("minReplicas", 1)
               for f, d in docs if d["kind"] == "HorizontalPodAutoscaler"}
    out = []
    for f, d in workloads(docs):
        wname = d["metadata"]["name"]
        tspec = d["spec"]["template"]["spec"]
        psc = tspec.get("securityContext", {})
        vols = {v["name"]: v for v in tspec.get("volumes", [])}
        c = tspec["containers"][0]
        csc = c.get("securityContext", {})
        count = d["spec"].get("replicas", hpa_min.get(wname, 1))
        for i in range(replicas.get(wname, count)):
            name = "%s-%d" % (wname, i)
            env = {}
            for e in c.get("env", []):
                if "value" in e:
                    env[e["name"]] = e["value"]
                else:
                    env[e["name"]] = _field_ref(e["valueFrom"]["fieldRef"]["fieldPath"], name, i)
            args = [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), a)
                    for a in c.get("args", [])]
            mounts = []
            for m in c.get("volumeMounts", []):
                v = vols[m["name"]]
                if "secret" in v:
                    mounts.append(Mount(m["mountPath"], "secret", m.get("readOnly", False),
                                        v["secret"].get("defaultMode", 0o644)))
                else:
                    mounts.append(Mount(m["mountPath"], "emptyDir", m.get("readOnly", False)))
            out.append(Pod(name=name, workload=wname,
                           component=d["metadata"]["labels"]["app.kubernetes.io/component"],
                           index=i, command=list(c["command"]), args=args, env=env,
                           mounts=mounts,
                           run_as_user=csc.get("runAsUser", psc.get("runAsUser")),
                           run_as_group=csc.get("runAsGroup", psc.get("runAsGroup")),
                           fs_group=psc.get("fsGroup"),
                           read_only_root=csc.get("readOnlyRootFilesystem", False),
                           drop_caps=csc.get("capabilities", {}).get("drop", []),
                           no_new_privileges=csc.get("allowPrivilegeEscalation") is False,
                           probes={k[:-5]: list(c[k]["exec"]["command"])
                                   for k in ("startupProbe", "livenessProbe", "readinessProbe")
                                   if "exec" in c.get(k, {})}))
    out.sort(key=lambda p: p.component != "router")
    return out
