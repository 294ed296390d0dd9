#!/usr/bin/env python3
"""Evaluates deploy/kubernetes/admission-policy.yaml's CEL, as the API server would, on pods that
must pass and pods that must be denied (each by the rules meant to catch it), with cel-python
(a CEL implementation apart from Kubernetes'; the policy uses only standard CEL, no Kubernetes
library functions, so both read it alike). Also: the policy's tenants are the broker's (same
names, uids and gids as configmap.yaml), and the example Deployment's pods pass.

usage: admission_test.py DEPLOY_DIR   (run by admission_test.sh in a venv with cel-python)
"""
import copy
import os
import sys

import celpy
import yaml

problems = []


def need(cond, what):
    if not cond:
        problems.append(what)
    return cond


def load(deploy, name):
    with open(os.path.join(deploy, name)) as fh:
        return [d for d in yaml.safe_load_all(fh) if d is not None]


def to_python(v):
    if isinstance(v, celpy.celtypes.MapType):
        return {str(k): to_python(x) for k, x in v.items()}
    if isinstance(v, celpy.celtypes.ListType):
        return [to_python(x) for x in v]
    if isinstance(v, celpy.celtypes.IntType):
        return int(v)
    return v


class Policy:
    def __init__(self, spec, tenants_expression=None):
        self.env = celpy.Environment()
        self.conditions = [self.compile(c["expression"]) for c in spec.get("matchConditions", [])]
        self.variables = []
        for v in spec.get("variables", []):
            text = tenants_expression if (v["name"] == "tenants" and tenants_expression) else v["expression"]
            self.variables.append((v["name"], self.compile(text)))
        self.validations = [(v["message"], self.compile(v["expression"])) for v in spec["validations"]]

    def compile(self, text):
        return self.env.program(self.env.compile(text))

    def tenants(self):
        return to_python(dict(self.variables)["tenants"].evaluate({}))

    # None when the policy does not judge the pod (its match conditions are false); else the
    # messages of the validations that deny it (an evaluation error denies too, as
    # failurePolicy: Fail makes it).
    def denials(self, pod):
        act = {"object": celpy.json_to_cel(pod)}
        if not all(bool(c.evaluate(act)) for c in self.conditions):
            return None
        variables = {}
        for name, prog in self.variables:
            act["variables"] = variables_cel(variables)
            variables[name] = prog.evaluate(act)
        act["variables"] = variables_cel(variables)
        out = []
        for message, prog in self.validations:
            try:
                ok = prog.evaluate(act)
            except celpy.CELEvalError as e:
                out.append(f"error: {e}")
                continue
            if isinstance(ok, celpy.celtypes.BoolType):
                ok = bool(ok)
            if ok is not True:
                out.append(message if ok is False else f"error: {ok}")
        return out


def variables_cel(values):
    return celpy.celtypes.MapType({celpy.celtypes.StringType(k): v for k, v in values.items()})


def pod(*containers, user=None, init=(), group=None, supplemental=None, fs_group=None, strict=None,
        share_pid=None, ephemeral=None, host_ipc=None, host_pid=None, host_network=None, host_paths=()):
    p = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
         "spec": {"containers": list(containers)}}
    for key, value in (("hostIPC", host_ipc), ("hostPID", host_pid), ("hostNetwork", host_network)):
        if value is not None:
            p["spec"][key] = value
    if host_paths:
        p["spec"]["volumes"] = [{"name": f"h{i}", "hostPath": {"path": path}} for i, path in enumerate(host_paths)]
    sc = {}
    for key, value in (("runAsUser", user), ("runAsGroup", group), ("supplementalGroups", supplemental),
                       ("fsGroup", fs_group), ("supplementalGroupsPolicy", strict)):
        if value is not None:
            sc[key] = value
    if sc:
        p["spec"]["securityContext"] = sc
    if init:
        p["spec"]["initContainers"] = list(init)
    if share_pid is not None:
        p["spec"]["shareProcessNamespace"] = share_pid
    if ephemeral is not None:
        p["spec"]["ephemeralContainers"] = ephemeral
    return p


# A container as a careful operator writes it (no escalation, every capability dropped); the
# keywords take that away or add what a case needs.
def container(name="app", resources=None, user=None, env=None, env_from=None, privileged=None, group=None,
              escalation=False, drop=("ALL",), add=None):
    c = {"name": name, "image": "inference:1"}
    if resources is not None:
        c["resources"] = {"limits": resources}
    sc = {}
    if user is not None:
        sc["runAsUser"] = user
    if group is not None:
        sc["runAsGroup"] = group
    if privileged is not None:
        sc["privileged"] = privileged
    if escalation is not None:
        sc["allowPrivilegeEscalation"] = escalation
    if drop is not None or add is not None:
        sc["capabilities"] = {}
        if drop is not None:
            sc["capabilities"]["drop"] = list(drop)
        if add is not None:
            sc["capabilities"]["add"] = list(add)
    if sc:
        c["securityContext"] = sc
    if env is not None:
        c["env"] = [{"name": k, "value": v} for k, v in env.items()]
    if env_from is not None:
        c["envFrom"] = env_from
    return c


def check_policy_shape(vap, binding):
    spec = vap["spec"]
    need(vap["apiVersion"] == "admissionregistration.k8s.io/v1", f"{vap['metadata']['name']}: admissionregistration.k8s.io/v1")
    need(spec.get("failurePolicy") == "Fail", f"{vap['metadata']['name']}: failurePolicy Fail (an error denies)")
    need("paramKind" not in spec and "paramRef" not in binding["spec"],
         "no parameters object: a missing one would deny every pod of the cluster")
    rules = {(tuple(r["operations"]), tuple(r["resources"])) for r in spec["matchConstraints"]["resourceRules"]}
    need(rules == {(("CREATE",), ("pods",)), (("UPDATE",), ("pods/ephemeralcontainers",))},
         f"{vap['metadata']['name']}: pods on CREATE and ephemeral containers on UPDATE, got {rules}")
    for d in (vap, binding):
        need("namespace" not in d["metadata"], f"{d['kind']}: cluster-scoped, no namespace")
    need(binding["spec"]["policyName"] == vap["metadata"]["name"], "binding: names the policy")
    need(binding["spec"].get("validationActions") == ["Deny"], "binding: validationActions [Deny]")


def main(deploy):
    docs = load(deploy, "admission-policy.yaml")
    kinds = sorted(d["kind"] for d in docs)
    need(kinds == ["ValidatingAdmissionPolicy"] * 2 + ["ValidatingAdmissionPolicyBinding"] * 2,
         f"admission-policy.yaml: expected two policies and their bindings, got {kinds}")
    named = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    vap = named[("ValidatingAdmissionPolicy", "cushare-tenant-binding")]
    binding = named[("ValidatingAdmissionPolicyBinding", "cushare-tenant-binding")]
    ns_vap = named[("ValidatingAdmissionPolicy", "cushare-tenant-namespaces")]
    ns_binding = named[("ValidatingAdmissionPolicyBinding", "cushare-tenant-namespaces")]
    check_policy_shape(vap, binding)
    check_policy_shape(ns_vap, ns_binding)
    # The namespace policy judges every pod of a labelled namespace, nothing elsewhere.
    need("matchConditions" not in ns_vap["spec"], "cushare-tenant-namespaces: every pod of the namespace is judged")
    need(ns_binding["spec"].get("matchResources", {}).get("namespaceSelector") ==
         {"matchLabels": {"cushare.io/tenants": "enabled"}},
         "cushare-tenant-namespaces: bound to namespaces labelled cushare.io/tenants=enabled")
    spec = vap["spec"]

    # The policy's tenants are the broker's.
    policy = Policy(spec)
    (cm,) = [d for d in load(deploy, "configmap.yaml") if d["kind"] == "ConfigMap"]
    conf = yaml.safe_load(cm["data"]["broker.yaml"])
    want = {t["name"]: {k: t[k] for k in ("uid", "gid") if k in t} for t in conf["tenants"]}
    need(policy.tenants() == want, f"the policy's tenants {policy.tenants()} != the broker's {want}")

    m = [msg for msg, _ in policy.validations]
    one, known, uid, sameuid, priv, env, env_from, pidns, host, groups = m
    namespaces = Policy(ns_vap["spec"])
    ns_ipc, ns_host, ns_paths, ns_priv = [msg for msg, _ in namespaces.validations]
    # Beta with a group (0660 ledger): nobody else may hold it.
    grouped = Policy(spec, "{'alpha': {'uid': 1000}, 'beta': {'uid': 1001, 'gid': 2001}}")
    alpha = {"cushare.io/alpha": 1}
    beta = {"cushare.io/beta": 1}
    ok = container(resources=alpha, user=1000)
    cases = [
        ("alpha as 1000 (container)", policy, pod(ok), []),
        ("alpha as 1000 (pod)", policy, pod(container(resources=alpha), user=1000), []),
        ("container's uid over the pod's", policy, pod(ok, user=1001), []),
        ("no cushare resource: not judged, whatever it does", policy,
         pod(container(user=0, privileged=True, escalation=True, env={"LD_PRELOAD": "/x.so"})), None),
        ("alpha with prefixed envFrom and other variables", policy,
         pod(container(resources=alpha, user=1000, env={"MODEL": "x"},
                       env_from=[{"prefix": "APP_", "configMapRef": {"name": "c"}}])), []),
        ("alpha without runAsUser (an image's USER does not count)", policy, pod(container(resources=alpha)), [uid]),
        ("alpha as beta's uid", policy, pod(container(resources=alpha, user=1001)), [uid]),
        ("alpha as root", policy, pod(container(resources=alpha, user=0)), [uid]),
        ("pod uid right, container's wrong", policy, pod(container(resources=alpha, user=1001), user=1000), [uid]),
        ("init container as the wrong uid", policy, pod(container(), init=[container("init", resources=alpha, user=1001)]),
         [uid, sameuid]),
        ("an init container of the pod's uid", policy, pod(container(resources=alpha), init=[container("init")], user=1000),
         []),
        ("a sidecar as beta's uid beside alpha (it would share the pod's hostIPC)", policy,
         pod(ok, container("side", user=1001), host_ipc=True), [sameuid]),
        ("a root sidecar, capabilities dropped", policy, pod(ok, container("side", user=0)), [sameuid]),
        ("a sidecar of no uid (the image's USER) beside alpha", policy, pod(ok, container("side")), [sameuid]),
        ("a tenant not in the policy", policy, pod(container(resources={"cushare.io/gamma": 1}, user=1000)), [known, uid]),
        ("two tenants", policy, pod(container(resources={"cushare.io/alpha": 1, "cushare.io/beta": 1}, user=1000)),
         [one, uid]),
        ("privilege escalation allowed (a setuid-root binary makes it root)", policy,
         pod(container(resources=alpha, user=1000, escalation=True)), [priv]),
        ("escalation not said", policy, pod(container(resources=alpha, user=1000, escalation=None)), [priv]),
        ("capabilities kept", policy, pod(container(resources=alpha, user=1000, drop=None)), [priv]),
        ("privileged", policy, pod(container(resources=alpha, user=1000, privileged=True)), [priv]),
        ("a privileged sidecar beside the tenant container", policy,
         pod(ok, container("sidecar", user=1000, privileged=True)), [priv]),
        ("sets CUSHARE_TENANT", policy, pod(container(resources=alpha, user=1000, env={"CUSHARE_TENANT": "beta"})), [env]),
        ("replaces LD_PRELOAD", policy, pod(container(resources=alpha, user=1000, env={"LD_PRELOAD": "/x.so"})), [env]),
        ("a sidecar sets CUSHARE_LEDGER_DIR", policy,
         pod(ok, container("side", user=1000, env={"CUSHARE_LEDGER_DIR": "/x"})), [env]),
        ("envFrom without a prefix", policy,
         pod(container(resources=alpha, user=1000, env_from=[{"configMapRef": {"name": "c"}}])), [env_from]),
        ("a shared process namespace", policy, pod(ok, share_pid=True), [pidns]),
        ("an ephemeral container added", policy, pod(ok, ephemeral=[{"name": "debug", "image": "busybox"}]), [pidns]),
        ("groups: alpha with its own group", grouped, pod(ok, group=1000, strict="Strict"), []),
        ("groups: beta with beta's group", grouped, pod(container(resources=beta, user=1001, group=2001), strict="Strict"),
         []),
        ("groups: beta's group as a supplemental one", grouped,
         pod(container(resources=beta, user=1001), group=1001, supplemental=[2001], strict="Strict"), []),
        ("groups: without supplementalGroupsPolicy Strict (the image's /etc/group may add beta's group)", grouped,
         pod(ok, group=1000), [groups]),
        ("groups: alpha without runAsGroup (an image's USER may name beta's group)", grouped, pod(ok, strict="Strict"),
         [groups]),
        ("groups: alpha as beta's group", grouped, pod(container(resources=alpha, user=1000, group=2001), strict="Strict"),
         [groups]),
        ("groups: alpha with beta's group supplemental", grouped,
         pod(ok, group=1000, supplemental=[5, 2001], strict="Strict"), [groups]),
        ("groups: alpha with beta's group as fsGroup", grouped, pod(ok, group=1000, fs_group=2001, strict="Strict"),
         [groups]),
        # envFrom prefixes that would form a refused name with the right key.
        ("envFrom prefix LD_ (key PRELOAD makes LD_PRELOAD)", policy,
         pod(container(resources=alpha, user=1000, env_from=[{"prefix": "LD_", "configMapRef": {"name": "c"}}])),
         [env_from]),
        ("envFrom prefix CUSHARE_", policy,
         pod(container(resources=alpha, user=1000, env_from=[{"prefix": "CUSHARE_", "secretRef": {"name": "s"}}])),
         [env_from]),
        ("envFrom prefix C", policy,
         pod(container(resources=alpha, user=1000, env_from=[{"prefix": "C", "configMapRef": {"name": "c"}}])),
         [env_from]),
        # Host namespaces and directories.
        ("alpha with hostIPC (MPS needs it)", policy, pod(ok, host_ipc=True), []),
        ("alpha with hostPID", policy, pod(ok, host_pid=True), [host]),
        ("alpha with hostNetwork", policy, pod(ok, host_network=True), [host]),
        ("alpha mounting the ledger directory", policy, pod(ok, host_paths=["/dev/shm/cushare"]), [host]),
        ("alpha mounting /dev (above the ledgers)", policy, pod(ok, host_paths=["/dev"]), [host]),
        ("alpha mounting /", policy, pod(ok, host_paths=["/"]), [host]),
        ("alpha mounting /run/cushare/ (the broker's socket)", policy, pod(ok, host_paths=["/run/cushare/"]), [host]),
        ("alpha mounting /data/../dev/shm", policy, pod(ok, host_paths=["/data/../dev/shm"]), [host]),
        ("alpha mounting //dev/shm", policy, pod(ok, host_paths=["//dev/shm"]), [host]),
        ("alpha mounting its models (/data/models)", policy, pod(ok, host_paths=["/data/models", "/runner"]), []),
        ("alpha mounting dev/shm (relative)", policy, pod(ok, host_paths=["dev/shm"]), [host]),
        ("alpha mounting /proc/1/root (the host's / through init)", policy, pod(ok, host_paths=["/proc/1/root"]), [host]),
        ("alpha mounting /var/run/nvidia-mps", policy, pod(ok, host_paths=["/var/run/nvidia-mps"]), [host]),
        ("alpha mounting the kubelet's directory", policy, pod(ok, host_paths=["/var/lib/kubelet"]), [host]),
    ]
    # Every pod of a labelled tenant namespace, with or without a cushare.io resource.
    plain = container(user=1001)
    cases += [
        ("ns: a plain pod", namespaces, pod(plain), []),
        ("ns: alpha's pod with hostIPC (MPS)", namespaces, pod(ok, host_ipc=True), []),
        ("ns: no cushare resource, hostIPC, beta's uid (the host's /dev/shm)", namespaces, pod(plain, host_ipc=True),
         [ns_ipc]),
        ("ns: hostIPC false said", namespaces, pod(plain, host_ipc=False), []),
        ("ns: hostPID", namespaces, pod(plain, host_pid=True), [ns_host]),
        ("ns: hostNetwork", namespaces, pod(ok, host_network=True), [ns_host]),
        ("ns: hostPath of the ledger directory", namespaces, pod(plain, host_paths=["/dev/shm/cushare/beta.ledger"]),
         [ns_paths]),
        ("ns: hostPath /run (above the broker's socket)", namespaces, pod(plain, host_paths=["/run"]), [ns_paths]),
        ("ns: hostPath of the device plugins' sockets", namespaces,
         pod(plain, host_paths=["/var/lib/kubelet/device-plugins"]), [ns_paths]),
        ("ns: hostPath /srv/cache", namespaces, pod(plain, host_paths=["/srv/cache"]), []),
        ("ns: a privileged container", namespaces, pod(container(user=1001, privileged=True)), [ns_priv]),
        ("ns: a container adding SYS_ADMIN", namespaces, pod(container(user=1001, drop=None, add=["SYS_ADMIN"])),
         [ns_priv]),
        ("ns: a container adding NET_BIND_SERVICE (baseline allows it)", namespaces,
         pod(container(user=1001, drop=None, add=["NET_BIND_SERVICE"])), []),
    ]
    for name, pol, p, want_denials in cases:
        got = pol.denials(copy.deepcopy(p))
        need(got == want_denials, f"{name}: denied by {got}, expected {want_denials}")
        print(f"{name}: {'not judged' if got is None else 'allowed' if not got else 'denied (' + '; '.join(got) + ')'}")
    # The example Deployment's pods pass.
    for d in load(deploy, "example-inference.yaml"):
        if d["kind"] == "Deployment":
            tpl = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "example"}, "spec": d["spec"]["template"]["spec"]}
            got = policy.denials(tpl)
            need(got == [], f"example-inference.yaml: its pods are denied (or not judged): {got}")
    for d in load(deploy, "example-inference.yaml"):
        if d["kind"] == "Namespace":
            need(d["metadata"].get("labels", {}).get("cushare.io/tenants") == "enabled",
                 "example-inference.yaml: its tenant namespace is labelled cushare.io/tenants=enabled")
        if d["kind"] == "Deployment":
            tpl = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "example"}, "spec": d["spec"]["template"]["spec"]}
            need(namespaces.denials(tpl) == [], "example-inference.yaml: its pods pass the namespace policy")
    # Every rule denies at least one case: none of them is a check that cannot fail.
    denied = {msg for _, _, _, want_denials in cases for msg in (want_denials or [])}
    every = set(m) | {ns_ipc, ns_host, ns_paths, ns_priv}
    need(denied == every, f"rules no case denies: {every - denied}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
    for p in problems:
        print("FAIL:", p)
    print(f"{len(problems)} problem(s)")
    sys.exit(1 if problems else 0)
