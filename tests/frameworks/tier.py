"""What the frameworks tier's test files share (scripts/test-frameworks.sh runs each file twice:
plain simgpu, then under the shim with CUSHARE_MEMORY_LIMIT set)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

UNDER_SHIM = bool(os.environ.get("CUSHARE_MEMORY_LIMIT"))
plain_only = pytest.mark.skipif(UNDER_SHIM, reason="plain simgpu case; CUSHARE_MEMORY_LIMIT is set")
shim_only = pytest.mark.skipif(not UNDER_SHIM, reason="shim case; CUSHARE_MEMORY_LIMIT is unset")


def mapped(name):
    """The files mapped into this process whose path contains name."""
    with open("/proc/self/maps") as maps:
        return sorted({line.split()[-1] for line in maps if name in line.split()[-1]})


@shim_only
def test_shim_is_preloaded():
    # Imported by each test file, so it runs in each file's shim run.
    assert mapped("libcushare.so"), "CUSHARE_MEMORY_LIMIT is set but libcushare.so is not loaded"


# The start of every PyTorch child's code: one JSON line per step (report), and a wait for "go"
# on stdin between steps, so the test can read the device meanwhile.
CHILD_PRELUDE = textwrap.dedent("""
    import json, os, sys
    import torch
    MiB = 1 << 20
    def report(**values):
        print(json.dumps(values), flush=True)
    def wait():
        if sys.stdin.readline().strip() != "go":
            sys.exit(3)
""")


class Child:
    """A Python child running prelude + code (dedented) with the run's environment: drop removes
    variables, env adds to it. It reports one JSON line per step (recv) and waits for "go"."""

    def __init__(self, prelude, code, env=None, drop=()):
        full_env = dict(os.environ)
        for k in drop:
            full_env.pop(k, None)
        full_env.update(env or {})
        self.proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "-c", prelude + textwrap.dedent(code)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=full_env)

    @property
    def pid(self):
        return self.proc.pid

    def recv(self):
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=120)
            raise AssertionError(f"child exited {self.proc.returncode} without a report:\n{self.proc.stderr.read()}")
        return json.loads(line)

    def go(self):
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def finish(self):
        self.proc.stdin.close()
        rc = self.proc.wait(timeout=120)
        err = self.proc.stderr.read()
        assert rc == 0, f"child exited {rc}:\n{err}"
        return err

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def device_count(total):
    """The device's own accounting (simgpu's NVML, read by a process without the shim): used bytes
    and bytes per pid; the observer must see the whole device of `total` bytes."""
    code = textwrap.dedent("""
        import json, pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        m = pynvml.nvmlDeviceGetMemoryInfo(h)
        procs = {p.pid: p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}
        print(json.dumps({"used": m.used, "total": m.total, "procs": procs}))
    """)
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    d["procs"] = {int(k): v or 0 for k, v in d["procs"].items()}
    assert d["total"] == total, "the observer must see the whole device"
    return d
