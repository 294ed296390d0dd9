#!/usr/bin/env python3
"""Checks deploy/kubernetes/: every file parses as YAML, each object has the fields the API
server requires, the DaemonSet has what docs/kubernetes.md promises (and no more privilege), the
example Deployment asks for a cushare resource and the ResourceQuota caps it, and the ConfigMap's
broker configuration is one cushare-broker accepts (--check) whose paths the DaemonSet mounts.

usage: manifests_test.py DEPLOY_DIR CUSHARE_BROKER WORK_DIR
"""
import glob
import os
import subprocess
import sys

import yaml

problems = []


def need(cond, what):
    if not cond:
        problems.append(what)
    return cond


def get(obj, path, default=None):
    for k in path.split("."):
        if not isinstance(obj, dict) or k not in obj:
            return default
        obj = obj[k]
    return obj


def main(deploy, broker, work):
    docs = []
    for f in sorted(glob.glob(os.path.join(deploy, "*.yaml"))):
        with open(f) as fh:
            try:
                for d in yaml.safe_load_all(fh):
                    if d is not None:
                        docs.append((os.path.basename(f), d))
            except yaml.YAMLError as e:
                problems.append(f"{f}: not YAML: {e}")
    need(docs, "no manifests found")
    by_kind = {}
    for f, d in docs:
        where = f"{f}: {d.get('kind')} {get(d, 'metadata.name')}"
        need(isinstance(d.get("apiVersion"), str) and d["apiVersion"], f"{where}: apiVersion missing")
        need(isinstance(d.get("kind"), str) and d["kind"], f"{where}: kind missing")
        need(get(d, "metadata.name"), f"{where}: metadata.name missing")
        if d.get("kind") not in ("Namespace", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"):
            need(get(d, "metadata.namespace"), f"{where}: metadata.namespace missing")
        by_kind.setdefault(d.get("kind"), []).append((where, d))

    # DaemonSet
    ds_list = by_kind.get("DaemonSet", [])
    need(len(ds_list) == 1, "expected one DaemonSet")
    for where, ds in ds_list:
        need(ds["apiVersion"] == "apps/v1", f"{where}: apiVersion apps/v1")
        sel = get(ds, "spec.selector.matchLabels", {})
        labels = get(ds, "spec.template.metadata.labels", {})
        need(sel and all(labels.get(k) == v for k, v in sel.items()), f"{where}: selector does not match the pod labels")
        pod = get(ds, "spec.template.spec", {})
        need(pod.get("priorityClassName") == "system-node-critical", f"{where}: priorityClassName system-node-critical")
        need(get(ds, "spec.updateStrategy.type") == "RollingUpdate", f"{where}: RollingUpdate")
        need(pod.get("hostPID") is True, f"{where}: hostPID (the broker reaps by host pid)")
        need(not pod.get("hostNetwork"), f"{where}: hostNetwork is not needed")
        tol = {(t.get("key"), t.get("operator")) for t in pod.get("tolerations", [])}
        need(("nvidia.com/gpu", "Exists") in tol, f"{where}: toleration nvidia.com/gpu")
        need(("CriticalAddonsOnly", "Exists") in tol, f"{where}: toleration CriticalAddonsOnly")
        terms = get(pod, "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms", [])
        keys = {e["key"] for t in terms for e in t.get("matchExpressions", [])}
        need({"feature.node.kubernetes.io/pci-10de.present", "nvidia.com/gpu.present"} <= keys,
             f"{where}: GPU node affinity")
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        host = {v["hostPath"]["path"]: v for v in volumes.values() if "hostPath" in v}
        for p in ("/var/lib/kubelet/device-plugins", "/var/lib/kubelet/pod-resources", "/var/run/cdi", "/dev/shm",
                  "/run/cushare"):
            need(p in host, f"{where}: hostPath {p}")
        mounts = {}
        for c in pod.get("initContainers", []) + pod.get("containers", []):
            cw = f"{where}: container {c.get('name')}"
            need(c.get("name") and c.get("image"), f"{cw}: name and image required")
            sc = c.get("securityContext", {})
            need(not sc.get("privileged"), f"{cw}: must not be privileged")
            need(sc.get("allowPrivilegeEscalation") is False, f"{cw}: allowPrivilegeEscalation false")
            need(get(sc, "capabilities.drop") == ["ALL"], f"{cw}: drops ALL capabilities")
            added = set(get(sc, "capabilities.add", []) or [])
            need(added <= {"CHOWN", "FOWNER", "DAC_OVERRIDE"}, f"{cw}: capabilities beyond CHOWN FOWNER DAC_OVERRIDE: {added}")
            for m in c.get("volumeMounts", []):
                need(m["name"] in volumes, f"{cw}: volumeMount {m['name']} has no volume")
                if c in pod.get("containers", []) and m["name"] in volumes and "hostPath" in volumes[m["name"]]:
                    mounts[m["mountPath"]] = volumes[m["name"]]["hostPath"]["path"]
        # The broker writes host paths into specs and Allocate answers: each is mounted at itself.
        for mp, hp in mounts.items():
            need(mp == hp, f"{where}: hostPath {hp} is mounted at {mp}, not at the same path")

    # ConfigMap: the broker accepts it, and the DaemonSet mounts what it names.
    cms = [(w, cm) for w, cm in by_kind.get("ConfigMap", []) if get(cm, "metadata.name") == "cushare-broker"]
    tenants = []
    need(len(cms) == 1, "expected one ConfigMap cushare-broker")
    for where, cm in cms:
        text = (cm.get("data") or {}).get("broker.yaml")
        if not need(isinstance(text, str), f"{where}: data.broker.yaml missing"):
            continue
        conf = yaml.safe_load(text)
        ds = ds_list[0][1] if ds_list else {}
        cmd = get(ds, "spec.template.spec.containers", [{}])[0].get("command", [])
        need("/etc/cushare/broker.yaml" in cmd, f"{where}: the DaemonSet runs the broker on /etc/cushare/broker.yaml")

        def under(path, what):
            ok = any(path == mp or path.startswith(mp.rstrip("/") + "/") for mp in mounts)
            need(ok, f"{where}: {what} {path} is not under a hostPath the DaemonSet mounts")

        # Probes: the image's CLI (deploy/Containerfile copies it to /usr/local/bin) asks the broker
        # on the socket the configuration names; readiness scrapes the metrics port it listens on.
        broker_c = get(ds, "spec.template.spec.containers", [{}])[0]
        with open(os.path.join(os.path.dirname(deploy.rstrip("/")), "Containerfile")) as fh:
            containerfile = fh.read()
        for probe in ("startupProbe", "livenessProbe"):
            cmd_ = get(broker_c, probe + ".exec.command", [])
            need(cmd_[:1] == ["/usr/local/bin/cushare"] and cmd_[-1:] == ["status"],
                 f"{where}: {probe} runs cushare status: {cmd_}")
            need("--socket" in cmd_ and cmd_[cmd_.index("--socket") + 1] == conf["socket"],
                 f"{where}: {probe} asks the socket the configuration names ({conf['socket']})")
        need("/usr/local/bin/cushare" in containerfile, f"{where}: the image (deploy/Containerfile) has no /usr/local/bin/cushare")
        port = get(broker_c, "readinessProbe.httpGet.port")
        ports = {p_.get("name"): p_.get("containerPort") for p_ in broker_c.get("ports", [])}
        need(get(broker_c, "readinessProbe.httpGet.path") == "/metrics" and port in ports,
             f"{where}: readinessProbe scrapes /metrics on a named port")
        need(str(conf.get("metrics_listen", "")).endswith(":" + str(ports.get(port))),
             f"{where}: metrics_listen {conf.get('metrics_listen')} is not the readiness port {ports.get(port)}")
        under(conf["ledger_dir"], "ledger_dir")
        under(os.path.dirname(conf["socket"]), "socket")
        under(conf["cdi"]["spec_dir"], "cdi.spec_dir")
        under(os.path.dirname(conf["cdi"]["shim"]), "cdi.shim")
        under(conf["kubernetes"]["device_plugin_dir"], "kubernetes.device_plugin_dir")
        # Pod labels: the kubelet's socket and the allocation directories (bound into pods from
        # the host, so the same path on both sides).
        under(os.path.dirname(conf["kubernetes"]["pod_resources_socket"]), "kubernetes.pod_resources_socket")
        under(conf["kubernetes"]["allocation_dir"], "kubernetes.allocation_dir")
        tenants = [t["name"] for t in conf.get("tenants", [])]
        path = os.path.join(work, "broker.yaml")
        os.makedirs(work, exist_ok=True)
        # The check runs here, on simgpu: the paths that are the node's go into the work directory.
        local = text.replace("/run/cushare", os.path.join(work, "run")).replace("/dev/shm/cushare",
                                                                                  os.path.join(work, "ledgers"))
        os.makedirs(os.path.join(work, "run"), mode=0o755, exist_ok=True)
        with open(path, "w") as fh:
            fh.write(local)
        if os.environ.get("BROKER_WITHOUT_PLUGIN") == "1":
            # A broker built without gRPC refuses the kubernetes block, and says so; the rest of the
            # configuration is checked without it.
            r = subprocess.run([broker, "--config", path, "--check"], capture_output=True, text=True)
            need(r.returncode == 1 and "built without gRPC" in r.stderr, f"{where}: expected the no-gRPC refusal: {r.stderr}")
            conf.pop("kubernetes")
            with open(path, "w") as fh:
                fh.write(yaml.safe_dump(conf))
            r = subprocess.run([broker, "--config", path, "--check"], capture_output=True, text=True)
            need(r.returncode == 0, f"{where}: cushare-broker --check refused it: {r.stderr.strip()} {r.stdout.strip()}")
            need("cdi: /var/run/cdi/cushare.io-tenant.json" in r.stdout, f"{where}: --check did not describe the CDI spec")
            continue
        r = subprocess.run([broker, "--config", path, "--check"], capture_output=True, text=True)
        need(r.returncode == 0, f"{where}: cushare-broker --check refused it: {r.stderr.strip()} {r.stdout.strip()}")
        need("cdi: /var/run/cdi/cushare.io-tenant.json" in r.stdout, f"{where}: --check did not describe the CDI spec: {r.stdout}")
        need("kubernetes: device plugin in /var/lib/kubelet/device-plugins" in r.stdout,
             f"{where}: --check did not describe the device plugin: {r.stdout}")
        need("kubernetes: pod labels from /var/lib/kubelet/pod-resources/kubelet.sock" in r.stdout
             and "allocation directories in " + os.path.join(work, "run", "allocations") in r.stdout,
             f"{where}: --check did not describe the pod labels: {r.stdout}")

    # The example: a pod asking for a tenant's resource, a quota capping it.
    deps = by_kind.get("Deployment", [])
    need(deps, "expected an example Deployment")
    asked = set()
    for where, d in deps:
        for c in get(d, "spec.template.spec.containers", []):
            for k, v in (get(c, "resources.limits", {}) or {}).items():
                if k.startswith("cushare.io/"):
                    asked.add(k)
                    need(str(v) == "1", f"{where}: {k} should be 1 per container")
    need(asked, "the example asks for no cushare.io resource")
    for k in asked:
        need(k.split("/", 1)[1] in tenants, f"{k}: no such tenant in the ConfigMap")
    quotas = by_kind.get("ResourceQuota", [])
    need(any(f"requests.{k}" in (get(q, "spec.hard", {}) or {}) for _, q in quotas for k in asked),
         "no ResourceQuota caps requests of the example's resource")
    for p in problems:
        print("manifests:", p)
    print(f"manifests: {len(docs)} objects checked, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
