#!/usr/bin/env python3
"""Checks a CDI spec against the rules of the CDI specification that cushare relies on, and runs a
command with exactly one device's container edits, as a container runtime would apply them.

  cdi_spec.py check SPEC [--max-version V]  exit 0 when valid; else one line per problem, exit 1
  cdi_spec.py run SPEC DEVICE [--nodes-absent-ok] -- CMD...
                                            the edits of SPEC's device DEVICE (and the spec's own),
                                            then exec CMD in the same process (same pid)
  cdi_spec.py self-test                     the checks refuse what they must (each rule bites)

The rules are written from the CDI specification's text (SPEC.md, "CDI JSON Specification") and
its version history: a field not in the declared version is refused, an unknown field is refused,
the declared version must be one the spec defines and, for cushare, the lowest that covers the
fields used (podman 4.3 refuses versions newer than it knows, 0.6.0 among them).

`run` applies env (replacing same-named variables) and mounts (bind mounts in a private mount
namespace: unshare(CLONE_NEWNS) as root, else through `unshare -rm`) and checks that each device
node's host path is a device (a runtime fails the container otherwise; `--nodes-absent-ok` only
says so, for a simulated GPU, which has no nodes). A mount point that does not
exist is made as a runtime makes it: in a tmpfs mounted, inside the namespace only, on the first
missing directory (left behind on the host, empty, and reused by the next run) or on an empty
directory above it. Without mount namespaces it says so
and exits 77.
"""
import ctypes
import json
import os
import re
import sys

VERSIONS = ["0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0"]
# Fields and the version that introduced them (0.3.0: the base this checker knows).
TOP = {"cdiVersion": "0.3.0", "kind": "0.3.0", "devices": "0.3.0", "containerEdits": "0.3.0",
       "annotations": "0.6.0"}
DEVICE = {"name": "0.3.0", "containerEdits": "0.3.0", "annotations": "0.6.0"}
EDITS = {"env": "0.3.0", "deviceNodes": "0.3.0", "mounts": "0.3.0", "hooks": "0.3.0",
         "intelRdt": "0.7.0", "additionalGids": "0.7.0", "netDevices": "1.1.0"}
MOUNT = {"hostPath": "0.3.0", "containerPath": "0.3.0", "options": "0.3.0", "type": "0.4.0"}
DEVNODE = {"path": "0.3.0", "hostPath": "0.5.0", "type": "0.3.0", "major": "0.3.0", "minor": "0.3.0",
           "fileMode": "0.3.0", "permissions": "0.3.0", "uid": "0.3.0", "gid": "0.3.0"}
VENDOR = re.compile(r"^[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
CLASS = re.compile(r"^[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
DEVNAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")
ENVNAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def vkey(v):
    return VERSIONS.index(v)


def check(spec, max_version=None):
    """Problems (strings) of a parsed spec; [] when valid."""
    bad = []
    need = ["0.3.0"]

    def needs(v, why):
        need.append(v)
        need_why.append((v, why))

    need_why = []

    def fields(obj, allowed, where, required):
        if not isinstance(obj, dict):
            bad.append(f"{where}: expected an object")
            return False
        for k in obj:
            if k not in allowed:
                bad.append(f"{where}: unknown field {k!r}")
            elif allowed[k] != "0.3.0":
                needs(allowed[k], f"{where}.{k}")
        for k in required:
            if k not in obj:
                bad.append(f"{where}: required field {k!r} missing")
        return True

    if not fields(spec, TOP, "spec", ["cdiVersion", "kind", "devices"]):
        return bad
    version = spec.get("cdiVersion")
    if version not in VERSIONS:
        bad.append(f"cdiVersion {version!r} is not a released CDI version")
    kind = spec.get("kind", "")
    vendor, sep, cls = str(kind).partition("/")
    if not sep or not VENDOR.match(vendor) or not CLASS.match(cls):
        bad.append(f"kind {kind!r} is not vendor/class (vendor: letters, digits, _ - ., class: letters, digits, _ -)")
    elif "." in cls:
        needs("0.6.0", "a '.' in the kind's class")
    devices = spec.get("devices")
    if not isinstance(devices, list) or not devices:
        bad.append("devices: expected a non-empty list")
        devices = []
    names = set()

    def edits(e, where, must_edit):
        if not fields(e, EDITS, where, []):
            return
        if must_edit and not any(e.get(k) for k in EDITS):
            bad.append(f"{where}: a device must have at least one edit")
        env = e.get("env", [])
        if not isinstance(env, list):
            bad.append(f"{where}.env: expected a list")
            env = []
        seen = set()
        for i, kv in enumerate(env):
            if not isinstance(kv, str) or "=" not in kv or not ENVNAME.match(kv.split("=", 1)[0]):
                bad.append(f"{where}.env[{i}]: expected NAME=VALUE, found {kv!r}")
                continue
            if kv.split("=", 1)[0] in seen:
                bad.append(f"{where}.env[{i}]: {kv.split('=', 1)[0]} set twice")
            seen.add(kv.split("=", 1)[0])
        mounts = e.get("mounts", [])
        if not isinstance(mounts, list):
            bad.append(f"{where}.mounts: expected a list")
            mounts = []
        for i, m in enumerate(mounts):
            w = f"{where}.mounts[{i}]"
            if not fields(m, MOUNT, w, ["hostPath", "containerPath"]):
                continue
            for k in ("hostPath", "containerPath"):
                p = m.get(k)
                if k in m and (not isinstance(p, str) or not p.startswith("/")):
                    bad.append(f"{w}.{k}: expected an absolute path, found {p!r}")
            opts = m.get("options", [])
            if not isinstance(opts, list) or not all(isinstance(o, str) for o in opts):
                bad.append(f"{w}.options: expected a list of strings")
            elif "bind" not in opts and "rbind" not in opts and "type" not in m:
                bad.append(f"{w}: neither a type nor a bind option: the runtime cannot tell what to mount")
        nodes = e.get("deviceNodes", [])
        if not isinstance(nodes, list):
            bad.append(f"{where}.deviceNodes: expected a list")
            nodes = []
        paths = set()
        for i, n in enumerate(nodes):
            w = f"{where}.deviceNodes[{i}]"
            if not fields(n, DEVNODE, w, ["path"]):
                continue
            for k in ("path", "hostPath"):
                p = n.get(k)
                if k in n and (not isinstance(p, str) or not p.startswith("/")):
                    bad.append(f"{w}.{k}: expected an absolute path, found {p!r}")
            if n.get("path") in paths:
                bad.append(f"{w}.path {n.get('path')!r}: a second node at that path")
            paths.add(n.get("path"))
            perms = n.get("permissions", "rwm")
            if not isinstance(perms, str) or not perms or any(c not in "rwm" for c in perms):
                bad.append(f"{w}.permissions: one or more of r, w, m, found {perms!r}")
            if "type" in n and n["type"] not in ("b", "c", "u", "p"):
                bad.append(f"{w}.type: b, c, u or p, found {n['type']!r}")
        if e.get("hooks"):
            bad.append(f"{where}.hooks: this checker does not know the rules of hooks (cushare writes none)")

    for i, d in enumerate(devices):
        w = f"devices[{i}]"
        if not fields(d, DEVICE, w, ["name", "containerEdits"]):
            continue
        name = d.get("name")
        if not isinstance(name, str) or not DEVNAME.match(name):
            bad.append(f"{w}.name {name!r}: letters, digits, _ - . : starting and ending with a letter or a digit")
        else:
            if not name[0].isalpha():
                needs("0.5.0", f"{w}.name starts with a digit")
            if name in names:
                bad.append(f"{w}.name {name!r}: a second device of that name")
            names.add(name)
        if "containerEdits" in d:
            edits(d["containerEdits"], w + ".containerEdits", True)
    if "containerEdits" in spec:
        edits(spec["containerEdits"], "spec.containerEdits", False)
    lowest = max(need, key=vkey)
    if version in VERSIONS:
        if vkey(version) < vkey(lowest):
            why = ", ".join(w for v, w in need_why if v == lowest)
            bad.append(f"cdiVersion {version} is lower than {lowest}, which {why} needs")
        elif vkey(version) > vkey(lowest):
            bad.append(f"cdiVersion {version} is not the lowest that covers the fields used ({lowest})")
        if max_version and vkey(version) > vkey(max_version):
            bad.append(f"cdiVersion {version} is newer than {max_version}")
    return bad


def load(path):
    with open(path) as f:
        return json.load(f)


# --- run --------------------------------------------------------------------------------------
CLONE_NEWNS = 0x00020000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
libc = ctypes.CDLL(None, use_errno=True)


def sys_mount(src, target, fstype, flags, data=None):
    enc = lambda s: s.encode() if s is not None else None
    if libc.mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount {src} on {target}: {os.strerror(e)}")


def apply_mounts(mounts):
    ours = []  # tmpfs mount points made here

    def under_ours(p):
        return any(p == o or p.startswith(o + "/") for o in ours)

    for m in mounts:
        host, target = m["hostPath"], m["containerPath"]
        opts = m.get("options", [])
        if not os.path.lexists(target):
            parts = target.strip("/").split("/")
            first = next("/" + "/".join(parts[:i + 1]) for i in range(len(parts))
                         if not os.path.lexists("/" + "/".join(parts[:i + 1])))
            parent = os.path.dirname(first)
            if under_ours(parent):
                pass
            elif os.path.isdir(parent) and not os.listdir(parent):
                # An empty directory (one left by an earlier run): a tmpfs on it hides nothing.
                sys_mount("tmpfs", parent, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
                ours.append(parent)
            else:
                os.makedirs(first, exist_ok=True)  # the one empty directory left on the host
                sys_mount("tmpfs", first, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
                ours.append(first)
            if os.path.isdir(host):
                os.makedirs(target, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(target), exist_ok=True)
                open(target, "a").close()
        flags = MS_BIND | (MS_REC if "rbind" in opts else 0)
        sys_mount(host, target, None, flags)
        extra = (MS_RDONLY if "ro" in opts else 0) | (MS_NOSUID if "nosuid" in opts else 0) | \
                (MS_NODEV if "nodev" in opts else 0)
        if extra:
            sys_mount(None, target, None, MS_BIND | MS_REMOUNT | extra)


def run(spec_path, device, cmd, nodes_absent_ok=False):
    spec = load(spec_path)
    problems = check(spec)
    if problems:
        sys.exit("cdi_spec: invalid spec: " + "; ".join(problems))
    dev = next((d for d in spec["devices"] if d["name"] == device), None)
    if dev is None:
        sys.exit(f"cdi_spec: no device {device!r} in {spec_path}")
    env = dict(os.environ)
    mounts, nodes = [], []
    for e in (spec.get("containerEdits", {}), dev["containerEdits"]):
        for kv in e.get("env", []):
            k, v = kv.split("=", 1)
            env[k] = v  # CDI env replaces a same-named variable
        mounts += e.get("mounts", [])
        nodes += e.get("deviceNodes", [])
    # Device nodes: the process shares this host's /dev, where a runtime would make them in the
    # container's; a runtime fails the container when a node's host path is no device.
    import stat
    for n in nodes:
        host = n.get("hostPath", n["path"])
        try:
            ok = stat.S_ISCHR(os.stat(host).st_mode) or stat.S_ISBLK(os.stat(host).st_mode)
        except OSError:
            ok = False
        if not ok and not nodes_absent_ok:
            sys.exit(f"cdi_spec: device node {host} is not a device on this host: a runtime would fail the container")
        if not ok:
            print(f"cdi_spec: device node {host} is not on this host (simulated GPU): not checked", file=sys.stderr)
    if mounts:
        if os.geteuid() != 0 and not os.environ.get("CDI_SPEC_IN_USERNS"):
            env_again = dict(os.environ, CDI_SPEC_IN_USERNS="1")
            os.execvpe("unshare", ["unshare", "-rm", sys.executable, __file__, "run", spec_path, device] +
                       (["--nodes-absent-ok"] if nodes_absent_ok else []) + ["--"] + cmd, env_again)
        if libc.unshare(CLONE_NEWNS) != 0:
            print(f"cdi_spec: no mount namespace ({os.strerror(ctypes.get_errno())}): cannot apply the mounts",
                  file=sys.stderr)
            sys.exit(77)
        sys_mount(None, "/", None, MS_REC | MS_PRIVATE)
        apply_mounts(mounts)
    env.pop("CDI_SPEC_IN_USERNS", None)
    os.execvpe(cmd[0], cmd, env)


# --- self-test --------------------------------------------------------------------------------
def self_test():
    good = {"cdiVersion": "0.3.0", "kind": "cushare.io/tenant", "devices": [
        {"name": "alpha", "containerEdits": {
            "env": ["CUSHARE_TENANT=alpha"],
            "mounts": [{"hostPath": "/h", "containerPath": "/c", "options": ["ro", "bind"]}]}}]}
    assert check(good) == [], check(good)
    cases = [
        ("unknown top field", lambda s: s.update(extra=1), "unknown field 'extra'"),
        ("unknown device field", lambda s: s["devices"][0].update(hooks=[]), "unknown field 'hooks'"),
        ("unknown mount field", lambda s: s["devices"][0]["containerEdits"]["mounts"][0].update(readOnly=True),
         "unknown field 'readOnly'"),
        ("no kind", lambda s: s.pop("kind"), "required field 'kind'"),
        ("kind syntax", lambda s: s.update(kind="cushare.io"), "is not vendor/class"),
        ("kind vendor", lambda s: s.update(kind="-x/tenant"), "is not vendor/class"),
        ("no devices", lambda s: s.update(devices=[]), "non-empty list"),
        ("no name", lambda s: s["devices"][0].pop("name"), "required field 'name'"),
        ("name syntax", lambda s: s["devices"][0].update(name="alpha-"), "starting and ending"),
        ("name char", lambda s: s["devices"][0].update(name="al/pha"), "starting and ending"),
        ("digit needs 0.5.0", lambda s: s["devices"][0].update(name="7up"), "lower than 0.5.0"),
        ("mount type needs 0.4.0", lambda s: s["devices"][0]["containerEdits"]["mounts"][0].update(type="bind"),
         "lower than 0.4.0"),
        ("annotations need 0.6.0", lambda s: s.update(annotations={"a": "b"}), "lower than 0.6.0"),
        ("not the lowest", lambda s: s.update(cdiVersion="0.5.0"), "not the lowest"),
        ("unreleased", lambda s: s.update(cdiVersion="0.3"), "not a released"),
        ("relative container path",
         lambda s: s["devices"][0]["containerEdits"]["mounts"][0].update(containerPath="c"), "absolute path"),
        ("relative host path",
         lambda s: s["devices"][0]["containerEdits"]["mounts"][0].update(hostPath="h"), "absolute path"),
        ("no container path",
         lambda s: s["devices"][0]["containerEdits"]["mounts"][0].pop("containerPath"), "required field"),
        ("env syntax", lambda s: s["devices"][0]["containerEdits"].update(env=["NOVALUE"]), "NAME=VALUE"),
        ("env twice", lambda s: s["devices"][0]["containerEdits"].update(env=["A=1", "A=2"]), "set twice"),
        ("empty edits", lambda s: s["devices"][0].update(containerEdits={}), "at least one edit"),
        ("two of a name", lambda s: s["devices"].append(json.loads(json.dumps(s["devices"][0]))), "a second device"),
        ("node without a path", lambda s: s["devices"][0]["containerEdits"].update(deviceNodes=[{"type": "c"}]),
         "required field 'path'"),
        ("relative node", lambda s: s["devices"][0]["containerEdits"].update(deviceNodes=[{"path": "dev/x"}]),
         "absolute path"),
        ("node twice", lambda s: s["devices"][0]["containerEdits"].update(
            deviceNodes=[{"path": "/dev/x"}, {"path": "/dev/x"}]), "a second node"),
        ("node permissions", lambda s: s["devices"][0]["containerEdits"].update(
            deviceNodes=[{"path": "/dev/x", "permissions": "rx"}]), "one or more of r, w, m"),
        ("node host path needs 0.5.0", lambda s: s["devices"][0]["containerEdits"].update(
            deviceNodes=[{"path": "/dev/x", "hostPath": "/dev/y"}]), "lower than 0.5.0"),
        ("unknown node field", lambda s: s["devices"][0]["containerEdits"].update(
            deviceNodes=[{"path": "/dev/x", "readOnly": True}]), "unknown field 'readOnly'"),
    ]
    failed = 0
    for what, change, expect in cases:
        s = json.loads(json.dumps(good))
        change(s)
        got = check(s)
        if not any(expect in g for g in got):
            print(f"self-test {what}: expected a problem with {expect!r}, got {got}")
            failed += 1
    s = json.loads(json.dumps(good))
    s["cdiVersion"] = "0.6.0"
    s["annotations"] = {"a": "b"}
    if not any("newer than 0.5.0" in g for g in check(s, "0.5.0")):
        print("self-test max version: not refused")
        failed += 1
    print(f"self-test: {len(cases) + 1 - failed} of {len(cases) + 1} rules bite")
    return 1 if failed else 0


def main(argv):
    if len(argv) >= 2 and argv[1] == "self-test":
        return self_test()
    if len(argv) >= 3 and argv[1] == "check":
        max_version = argv[argv.index("--max-version") + 1] if "--max-version" in argv else None
        problems = check(load(argv[2]), max_version)
        for p in problems:
            print(f"{argv[2]}: {p}")
        return 1 if problems else 0
    if len(argv) >= 6 and argv[1] == "run" and argv[4] == "--":
        run(argv[2], argv[3], argv[5:])
    if len(argv) >= 7 and argv[1] == "run" and argv[4] == "--nodes-absent-ok" and argv[5] == "--":
        run(argv[2], argv[3], argv[6:], nodes_absent_ok=True)
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
