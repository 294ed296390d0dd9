"""PyTorch, as pip installs it, bursting above its guarantee and being reclaimed (docs/memory-elasticity.md).

Optional test tier: run by scripts/test-frameworks.sh, never by the build or CTest, once, with a
broker of its own per case (FRAMEWORK_BROKER: the cushare-broker binary; FRAMEWORK_SHIM: libcushare.so,
preloaded into the PyTorch children only) on a 1 GiB simulated device (SIMGPU_MEMORY=1GiB):

  - burst: managed. A tenant guaranteed 256 MiB fills its 768 MiB limit with tensors; another
    tenant's 768 MiB, which admission reserved for it, is granted at once (the device evicts the
    burst to host memory), and the burster's tensors read back intact.
  - burst: plain, with the documented recipe (a thread polls cushare_reclaim_fd and calls
    torch.cuda.empty_cache()): the burster's cached blocks above its guarantee go back when the other
    tenant's guaranteed allocation waits for them, and that allocation is granted.

Judged by what PyTorch reports, by the tensors' contents (copied from and back to the host: simgpu
does not compute kernels) and by the device's own count (simgpu's NVML, read without the shim).
"""

import os
import signal
import subprocess
import textwrap
import time

import pytest

import tier  # noqa: E402 (tests/frameworks, on pytest's path)

torch = pytest.importorskip("torch")
pynvml = pytest.importorskip("pynvml")

MiB = 1 << 20
BROKER = os.environ.get("FRAMEWORK_BROKER", "")
SHIM = os.environ.get("FRAMEWORK_SHIM", "")

pytestmark = pytest.mark.skipif(not BROKER or not SHIM, reason="needs FRAMEWORK_BROKER and FRAMEWORK_SHIM")

# Helpers every child starts with: one JSON line per step; it waits for "go" between steps.
_PRELUDE = tier.CHILD_PRELUDE + textwrap.dedent("""
    import ctypes, select, threading
    def tensors(count, size, first_value):
        # count tensors of size bytes on the device, each filled from the host with its own value.
        out = []
        for i in range(count):
            t = torch.empty(size, dtype=torch.uint8, device="cuda")
            t.copy_(torch.full((size,), first_value + i, dtype=torch.uint8))
            out.append(t)
        torch.cuda.synchronize()
        return out
    def intact(ts, first_value):
        return all(bool((t.cpu() == first_value + i).all()) for i, t in enumerate(ts))
""")


class Child(tier.Child):
    """A PyTorch child of tenant `tenant` under the shim (preloaded into it only)."""

    def __init__(self, code, tenant, ledgers):
        super().__init__(_PRELUDE, code, {"LD_PRELOAD": SHIM, "CUSHARE_TENANT": tenant, "CUSHARE_LEDGER_DIR": ledgers})


def device_count():
    """The device's own accounting; this tier runs on a 1 GiB device (SIMGPU_MEMORY=1GiB)."""
    return tier.device_count(1 << 30)


@pytest.fixture
def broker(tmp_path):
    """start(tenants_yaml, extra_yaml) starts a broker on a configuration of its own; its ledger dir."""
    procs, children = [], []

    def start(tenants, extra=""):
        config = tmp_path / "config.yaml"
        config.write_text(f"ledger_dir: {tmp_path}/ledgers\nsocket: {tmp_path}/broker.sock\n"
                          f"state_file: {tmp_path}/broker.state\nmetrics_listen: 127.0.0.1:0\n"
                          f"cdi: {{spec_dir: {tmp_path}/cdi}}\ncontext_memory: 0\n{extra}{tenants}")
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        log = open(tmp_path / "broker.log", "w")
        p = subprocess.Popen([BROKER, "--config", str(config), "--log-level", "debug"], env=env, stdout=log, stderr=log)
        procs.append(p)
        for _ in range(200):
            if (tmp_path / "broker.sock").exists():
                break
            assert p.poll() is None, (tmp_path / "broker.log").read_text()
            time.sleep(0.05)
        else:
            raise AssertionError("the broker did not open its socket:\n" + (tmp_path / "broker.log").read_text())
        return str(tmp_path / "ledgers")

    def child(code, tenant, ledgers):
        c = Child(code, tenant, ledgers)
        children.append(c)
        return c

    start.child = child
    start.log = lambda: (tmp_path / "broker.log").read_text()
    yield start
    for c in children:
        c.kill()
    for p in procs:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)


def test_a_managed_burst_is_evicted_for_a_guarantee_and_the_tensors_survive(broker):
    ledgers = broker("tenants:\n"
                     "  - {name: burster, memory: 768MiB, guarantee: 256MiB}\n"
                     "  - {name: steady, memory: 768MiB}\n")
    burster = broker.child("""
        ts = tensors(3, 256 * MiB, 1)
        report(allocated=torch.cuda.memory_allocated(), free=torch.cuda.mem_get_info()[0])
        wait()
        try:
            torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
            report(over_limit="granted")
        except torch.OutOfMemoryError:
            report(over_limit="refused")
        wait()
        report(intact=intact(ts, 1))
        wait()
    """, "burster", ledgers)
    r = burster.recv()
    assert r["allocated"] == 768 * MiB, r
    assert device_count()["used"] == 768 * MiB, "the burst is resident: the device had room"
    burster.go()
    assert burster.recv()["over_limit"] == "refused", "its limit holds, bursts included"

    steady = broker.child("""
        ts = tensors(3, 256 * MiB, 7)
        report(allocated=torch.cuda.memory_allocated())
        wait()
        report(intact=intact(ts, 7))
        wait()
    """, "steady", ledgers)
    assert steady.recv()["allocated"] == 768 * MiB, "the guarantee admission reserved is there when it asks"
    d = device_count()
    assert d["used"] == 1024 * MiB, d
    assert d["procs"].get(steady.pid) == 768 * MiB, d
    # NVML's per-process figure leaves managed memory out: the burster shows its guarantee only.
    assert d["procs"].get(burster.pid) == 256 * MiB, d
    burster.go()
    assert burster.recv()["intact"] is True, "the evicted tensors read back intact"
    steady.go()
    assert steady.recv()["intact"] is True
    burster.go()
    steady.go()
    burster.finish()
    steady.finish()


def test_a_plain_burster_using_the_recipe_gives_its_cache_back_for_a_guarantee(broker):
    ledgers = broker("tenants:\n"
                     "  - {name: burster, memory: 768MiB, guarantee: 256MiB, burst: plain}\n"
                     "  - {name: steady, memory: 768MiB}\n",
                     "elasticity: {reclaim_wait_ms: 5000, reclaim_deadline_ms: 5000}\n")
    burster = broker.child("""
        lib = ctypes.CDLL(None)                       # the preloaded libcushare.so
        lib.cushare_reclaim_target.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        fd = lib.cushare_reclaim_fd()
        gave = threading.Event()
        def give_back():
            target, held = ctypes.c_ulonglong(), ctypes.c_ulonglong()
            while True:
                select.select([fd], [], [])
                os.read(fd, 8)
                if lib.cushare_reclaim_target(0, ctypes.byref(target), ctypes.byref(held)) == 1 and held.value > target.value:
                    torch.cuda.empty_cache()
                    gave.set()
        threading.Thread(target=give_back, daemon=True).start()
        ts = tensors(3, 256 * MiB, 1)
        del ts[1:]                                    # freed, but PyTorch keeps the blocks cached
        report(fd=fd, allocated=torch.cuda.memory_allocated(), reserved=torch.cuda.memory_reserved())
        wait()
        report(gave=gave.wait(10), reserved=torch.cuda.memory_reserved(), intact=intact(ts, 1))
        wait()
    """, "burster", ledgers)
    r = burster.recv()
    assert r["fd"] >= 0, "the shim gives a reclaim descriptor under a broker"
    assert r["allocated"] == 256 * MiB and r["reserved"] == 768 * MiB, r
    assert device_count()["procs"].get(burster.pid) == 768 * MiB, "PyTorch's cache holds the device memory"

    steady = broker.child("""
        import time
        t0 = time.monotonic()
        ts = tensors(3, 256 * MiB, 7)
        report(allocated=torch.cuda.memory_allocated(), seconds=time.monotonic() - t0)
        wait()
    """, "steady", ledgers)
    s = steady.recv()
    assert s["allocated"] == 768 * MiB, "its guaranteed allocation waited for the burster's cache and got it"
    burster.go()
    b = burster.recv()
    assert b["gave"] is True, "the recipe's thread was woken and emptied PyTorch's cache"
    assert b["reserved"] == 256 * MiB and b["intact"] is True, b
    d = device_count()
    assert d["procs"].get(steady.pid) == 768 * MiB and d["procs"].get(burster.pid) == 256 * MiB, d
    print(f"guaranteed allocations granted in {s['seconds']:.3f} s (three of 256 MiB, the last after the reclaim)")
    assert "reclaim" in broker.log()
    burster.go()
    steady.go()
    burster.finish()
    steady.finish()
