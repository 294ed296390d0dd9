#!/usr/bin/env python3
"""Evaluates deploy/kubernetes/admission-policy.yaml's CEL, as the API server would, on pods that
must pass and pods that must be denied (each by the one rule meant to catch it), with cel-python
(a CEL implementation apart from Kubernetes'; the policy uses only standard CEL, no Kubernetes
library functions, so both read it alike). Also: the policy's parameters name the same tenants
and uids as the broker's configuration.

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


class Policy:
    def __init__(self, spec):
        self.env = celpy.Environment()
        self.variables = [(v["name"], self.compile(v["expression"])) for v in spec.get("variables", [])]
        self.validations = [(v["message"], self.compile(v["expression"])) for v in spec["validations"]]

    def compile(self, text):
        return self.env.program(self.env.compile(text))

    # The messages of the validations that deny the pod (an evaluation error denies too, as
    # failurePolicy: Fail makes it).
    def denials(self, pod, params):
        act = {"object": celpy.json_to_cel(pod), "params": celpy.json_to_cel(params)}
        variables = {}
        for name, prog in self.variables:
            act["variables"] = celpy.json_to_cel(variables) if not variables else variables_cel(variables)
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


def pod(*containers, user=None, init=(), group=None, supplemental=None, fs_group=None):
    p = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
         "spec": {"containers": list(containers)}}
    sc = {}
    if user is not None:
        sc["runAsUser"] = user
    if group is not None:
        sc["runAsGroup"] = group
    if supplemental is not None:
        sc["supplementalGroups"] = supplemental
    if fs_group is not None:
        sc["fsGroup"] = fs_group
    if sc:
        p["spec"]["securityContext"] = sc
    if init:
        p["spec"]["initContainers"] = list(init)
    return p


def container(name="app", resources=None, user=None, env=None, env_from=None, privileged=None, group=None):
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
    if sc:
        c["securityContext"] = sc
    if env is not None:
        c["env"] = [{"name": k, "value": v} for k, v in env.items()]
    if env_from is not None:
        c["envFrom"] = env_from
    return c


def main(deploy):
    docs = load(deploy, "admission-policy.yaml")
    by_kind = {d["kind"]: d for d in docs}
    need(set(by_kind) == {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "ConfigMap"},
         f"admission-policy.yaml: expected a policy, its binding and its parameters, got {sorted(by_kind)}")
    vap, binding, params = by_kind["ValidatingAdmissionPolicy"], by_kind["ValidatingAdmissionPolicyBinding"], by_kind["ConfigMap"]
    need(vap["apiVersion"] == "admissionregistration.k8s.io/v1", "policy: admissionregistration.k8s.io/v1")
    need(vap["spec"].get("failurePolicy") == "Fail", "policy: failurePolicy Fail (an error denies)")
    need(vap["spec"].get("paramKind") == {"apiVersion": "v1", "kind": "ConfigMap"}, "policy: paramKind ConfigMap")
    rules = vap["spec"]["matchConstraints"]["resourceRules"]
    need(any("pods" in r["resources"] and {"CREATE", "UPDATE"} <= set(r["operations"]) for r in rules),
         "policy: matches pods on CREATE and UPDATE")
    for d in (vap, binding):
        need("namespace" not in d["metadata"], f"{d['kind']}: cluster-scoped, no namespace")
    need(binding["spec"]["policyName"] == vap["metadata"]["name"], "binding: names the policy")
    need(binding["spec"].get("validationActions") == ["Deny"], "binding: validationActions [Deny]")
    ref = binding["spec"]["paramRef"]
    need(ref.get("name") == params["metadata"]["name"] and ref.get("namespace") == params["metadata"]["namespace"],
         "binding: paramRef names the parameters ConfigMap")
    need(ref.get("parameterNotFoundAction") == "Deny", "binding: parameterNotFoundAction Deny (fail closed)")

    # The parameters agree with the broker's configuration.
    (cm,) = [d for d in load(deploy, "configmap.yaml") if d["kind"] == "ConfigMap"]
    conf = yaml.safe_load(cm["data"]["broker.yaml"])
    uids = {t["name"]: str(t["uid"]) for t in conf["tenants"] if "uid" in t}
    uids.update({"gid." + t["name"]: str(t["gid"]) for t in conf["tenants"] if "gid" in t})
    need(params.get("data") == uids, f"cushare-tenant-uids {params.get('data')} != the broker's tenants' uids {uids}")

    policy = Policy(vap["spec"])
    data = params
    alpha = {"cushare.io/alpha": 1}
    m = {msg: msg for msg, _ in policy.validations}
    one, known, uid, groups, env, env_from, priv = list(m)
    # Beta with a group (0660 ledger): nobody else may hold it; with groups, runAsGroup is required.
    grouped = copy.deepcopy(data)
    grouped["data"]["gid.beta"] = "2001"
    beta = {"cushare.io/beta": 1}
    cases = [
        ("alpha as 1000 (container)", pod(container(resources=alpha, user=1000)), data, []),
        ("alpha as 1000 (pod)", pod(container(resources=alpha), user=1000), data, []),
        ("container's uid over the pod's", pod(container(resources=alpha, user=1000), user=1001), data, []),
        ("no cushare resource, any uid", pod(container(user=0)), data, []),
        ("alpha with prefixed envFrom and other variables",
         pod(container(resources=alpha, user=1000, env={"MODEL": "x"}, env_from=[{"prefix": "APP_", "configMapRef": {"name": "c"}}])),
         data, []),
        ("alpha without runAsUser (an image's USER does not count)", pod(container(resources=alpha)), data, [uid]),
        ("alpha as beta's uid", pod(container(resources=alpha, user=1001)), data, [uid]),
        ("alpha as root", pod(container(resources=alpha, user=0)), data, [uid]),
        ("pod uid right, container's wrong", pod(container(resources=alpha, user=1001), user=1000), data, [uid]),
        ("init container as the wrong uid", pod(container(), init=[container("init", resources=alpha, user=1001)]),
         data, [uid]),
        ("a tenant not in the parameters", pod(container(resources={"cushare.io/gamma": 1}, user=1000)), data,
         [known, uid]),
        ("two tenants", pod(container(resources={"cushare.io/alpha": 1, "cushare.io/beta": 1}, user=1000)), data,
         [one, uid]),
        ("sets CUSHARE_TENANT", pod(container(resources=alpha, user=1000, env={"CUSHARE_TENANT": "beta"})), data, [env]),
        ("replaces LD_PRELOAD", pod(container(resources=alpha, user=1000, env={"LD_PRELOAD": "/x.so"})), data, [env]),
        ("envFrom without a prefix", pod(container(resources=alpha, user=1000, env_from=[{"configMapRef": {"name": "c"}}])),
         data, [env_from]),
        ("privileged", pod(container(resources=alpha, user=1000, privileged=True)), data, [priv]),
        ("parameters without data", pod(container(resources=alpha, user=1000)),
         {k: v for k, v in data.items() if k != "data"}, [known, uid]),
        ("groups: alpha with its own group", pod(container(resources=alpha, user=1000), group=1000), grouped, []),
        ("groups: beta with beta's group", pod(container(resources=beta, user=1001, group=2001)), grouped, []),
        ("groups: beta with beta's group as a supplemental one",
         pod(container(resources=beta, user=1001), group=1001, supplemental=[2001]), grouped, []),
        ("groups: alpha without runAsGroup (an image's USER may name beta's group)",
         pod(container(resources=alpha, user=1000)), grouped, [groups]),
        ("groups: alpha as beta's group", pod(container(resources=alpha, user=1000, group=2001)), grouped, [groups]),
        ("groups: alpha with beta's group supplemental", pod(container(resources=alpha, user=1000), group=1000,
                                                             supplemental=[5, 2001]), grouped, [groups]),
        ("groups: alpha with beta's group as fsGroup", pod(container(resources=alpha, user=1000), group=1000,
                                                           fs_group=2001), grouped, [groups]),
        ("groups: a tenant named like a group entry", pod(container(resources={"cushare.io/gid.beta": 1}, user=2001),
                                                          group=7), grouped, [known, uid, groups]),
    ]
    for name, p, prm, want in cases:
        got = policy.denials(copy.deepcopy(p), prm)
        need(got == want, f"{name}: denied by {got}, expected {want}")
        print(f"{name}: {'allowed' if not got else 'denied (' + '; '.join(got) + ')'}")
    # The example Deployment's pods pass.
    for d in load(deploy, "example-inference.yaml"):
        if d["kind"] == "Deployment":
            tpl = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "example"}, "spec": d["spec"]["template"]["spec"]}
            got = policy.denials(tpl, data)
            need(got == [], f"example-inference.yaml: its pods are denied: {got}")
    # Every rule denies at least one case: none of them is a check that cannot fail.
    denied = {msg for _, p, prm, want in cases for msg in want}
    need(denied == set(m), f"rules no case denies: {set(m) - denied}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
    for p in problems:
        print("FAIL:", p)
    print(f"{len(problems)} problem(s)")
    sys.exit(1 if problems else 0)
