"""PyTorch, exactly as pip installs it (its own libcudart 13.x through its RPATH), on simgpu.

Optional test tier: run by scripts/test-frameworks.sh, never by the build or CTest, twice:

  plain run:  LD_LIBRARY_PATH=build/lib/simgpu SIMGPU_STATE_DIR=... SIMGPU_MEMORY=4GiB
  shim run:   the same plus LD_PRELOAD=build/lib/libcushare.so CUSHARE_TENANT=torch
              CUSHARE_MEMORY_LIMIT=512MiB CUSHARE_LEDGER_DIR=...

Every case holds in both runs against one number, LIMIT: the tenant's limit under the shim, the
whole simulated device without it. Each case runs its PyTorch code in fresh child processes (the
caching allocator, CUDA's state and the shim's process state start clean), which inherit the
run's environment, and judges it twice: by what PyTorch reports, and by the device's own count,
read from simgpu's NVML in a process without the shim (what the device holds for each pid).

simgpu does not compute kernels without a host body (docs/simgpu.md): PyTorch's kernels launch,
are captured and replayed, but their results are not checked here; memory behaviour is.
"""

import os
import re
import subprocess
import sys
import textwrap

import pytest

import tier  # noqa: E402 (tests/frameworks, on pytest's path)

torch = pytest.importorskip("torch")
pynvml = pytest.importorskip("pynvml")

MiB = 1 << 20

UNDER_SHIM = bool(os.environ.get("CUSHARE_MEMORY_LIMIT"))

_UNITS = {"": 1, "K": 1 << 10, "KI": 1 << 10, "KIB": 1 << 10, "M": MiB, "MI": MiB, "MIB": MiB,
          "G": 1 << 30, "GI": 1 << 30, "GIB": 1 << 30}


def parse_size(text):
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    assert m and m.group(2).upper() in _UNITS, f"cannot parse size {text!r}"
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


DEVICE_TOTAL = parse_size(os.environ.get("SIMGPU_MEMORY", "16GiB").split(",")[0])
LIMIT = parse_size(os.environ["CUSHARE_MEMORY_LIMIT"]) if UNDER_SHIM else DEVICE_TOTAL

# Prepended to every child's code: helpers to talk to the test (one JSON line per step; the
# child waits for a line on stdin before going on, so the test can read the device meanwhile).
_PRELUDE = tier.CHILD_PRELUDE + textwrap.dedent("""
    def view():
        free, total = torch.cuda.mem_get_info()
        return {"free": free, "total": total}
    def nvml_view():
        import pynvml
        pynvml.nvmlInit()
        m = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
        out = {"total": m.total, "used": m.used, "free": m.free}
        pynvml.nvmlShutdown()
        return out
    def fill(chunk, limit_bytes):
        # Allocates chunk-sized tensors until PyTorch raises its out-of-memory error.
        held, error = [], None
        while len(held) * chunk <= 2 * limit_bytes:
            try:
                held.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
            except torch.OutOfMemoryError as e:
                error = str(e)
                break
        return held, error
""")


class Child(tier.Child):
    """A Python child running code after _PRELUDE (without importing torch if use_torch is False)."""

    def __init__(self, code, env=None, drop=(), use_torch=True):
        prelude = _PRELUDE if use_torch else _PRELUDE.replace("import torch\n", "", 1)
        super().__init__(prelude, code, env, drop)


@pytest.fixture
def children():
    made = []

    def make(code, **kw):
        c = Child(code, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.kill()


def device_count():
    """The device's own accounting (simgpu's NVML, no shim): used bytes and bytes per pid."""
    return tier.device_count(DEVICE_TOTAL)


def held_by(pids):
    """What the device holds for these processes, by its own count."""
    procs = device_count()["procs"]
    return sum(procs.get(p, 0) for p in pids)


def assert_no_leftovers():
    """No process of the test holds device memory any more (the next case starts clean)."""
    mine = [p for p in device_count()["procs"] if p != os.getpid()]
    assert not mine, f"processes still holding device memory: {mine}"


@pytest.fixture(autouse=True)
def clean_device():
    yield
    assert_no_leftovers()


def test_shim_is_preloaded_exactly_when_the_run_says():
    out = subprocess.run([sys.executable, "-c", "print(open('/proc/self/maps').read())"],
                         capture_output=True, text=True, check=True).stdout
    assert ("libcushare.so" in out) == UNDER_SHIM


def test_pytorch_brings_its_own_cuda_13_runtime(children):
    # The tier runs PyTorch as pip installs it: its libcudart.so.13 is the nvidia-cuda-runtime
    # wheel's, found through its RPATH, not the toolkit's.
    c = children("""
        torch.cuda.init()
        maps = open("/proc/self/maps").read()
        report(runtime=[l.split()[-1] for l in maps.splitlines() if "libcudart.so" in l][:1],
               cuda=torch.version.cuda, count=torch.cuda.device_count())
    """)
    r = c.recv()
    c.finish()
    assert r["cuda"].startswith("13.")
    assert r["count"] == 1
    assert r["runtime"] and "site-packages/nvidia/" in r["runtime"][0], r["runtime"]


def test_views_show_the_limit_and_use_in_a_cuda_process(children):
    c = children("""
        before = view()
        total_memory = torch.cuda.get_device_properties(0).total_memory
        nv_before = nvml_view()
        x = torch.empty(100 * MiB, dtype=torch.uint8, device="cuda")
        report(before=before, total_memory=total_memory, nv_before=nv_before, during=view(), nv_during=nvml_view())
        wait()
    """)
    r = c.recv()
    device = held_by([c.pid])
    c.go()
    c.finish()
    assert r["before"]["total"] == r["total_memory"] == r["nv_before"]["total"] == LIMIT
    assert r["during"]["total"] == r["nv_during"]["total"] == LIMIT
    assert r["before"]["free"] - r["during"]["free"] >= 100 * MiB
    assert r["nv_during"]["used"] - r["nv_before"]["used"] >= 100 * MiB
    assert r["nv_during"]["free"] + r["nv_during"]["used"] == LIMIT
    if UNDER_SHIM:
        # The tenant's only process: its view is exactly what it holds.
        assert r["during"]["free"] == LIMIT - r["nv_during"]["used"]
    assert device >= 100 * MiB, "the device itself holds the tensor"


def test_views_show_the_limit_and_use_in_an_nvml_only_process(children):
    holder = children("""
        x = torch.empty(128 * MiB, dtype=torch.uint8, device="cuda")
        report(held=torch.cuda.memory_reserved())
        wait()
    """)
    held = holder.recv()["held"]
    # pynvml only: this process never imports PyTorch nor calls CUDA (under the shim libcuda.so.1 is
    # mapped all the same: the shim loads the driver when it sets the process up).
    watcher = children("""
        report(nv=nvml_view(), torch_imported="torch" in sys.modules)
    """, use_torch=False)
    r = watcher.recv()
    watcher.finish()
    device = held_by([holder.pid])
    holder.go()
    holder.finish()
    assert not r["torch_imported"]
    assert r["nv"]["total"] == LIMIT
    assert r["nv"]["used"] >= 128 * MiB
    if UNDER_SHIM:
        assert r["nv"]["used"] == held, "the tenant's use is what its process holds"
    assert device >= 128 * MiB


def test_allocation_past_the_limit_is_pytorchs_out_of_memory_and_the_process_goes_on(children):
    c = children("""
        held, error = fill(64 * MiB, %d)
        report(error=error, held=len(held) * 64 * MiB, view=view())
        wait()
        del held
        torch.cuda.empty_cache()
        again = torch.empty(128 * MiB, dtype=torch.uint8, device="cuda")
        again.fill_(1)
        torch.cuda.synchronize()
        report(again=again.numel())
    """ % LIMIT)
    r = c.recv()
    device = held_by([c.pid])
    c.go()
    again = c.recv()
    c.finish()
    assert r["error"] is not None, "no out-of-memory error"
    assert r["error"].startswith("CUDA out of memory. Tried to allocate 64.00 MiB."), r["error"]
    assert r["held"] > LIMIT // 2
    assert r["held"] <= LIMIT
    assert device <= LIMIT, "the device holds more than the limit for the tenant"
    assert device >= r["held"]
    assert again["again"] == 128 * MiB


def test_empty_cache_gives_the_memory_back(children):
    c = children("""
        before = view()
        x = torch.empty(200 * MiB, dtype=torch.uint8, device="cuda")
        del x
        report(cached=view(), reserved=torch.cuda.memory_reserved())
        wait()
        torch.cuda.empty_cache()
        report(emptied=view(), before=before, reserved=torch.cuda.memory_reserved())
        wait()
    """)
    r1 = c.recv()
    device_cached = held_by([c.pid])
    c.go()
    r2 = c.recv()
    device_emptied = held_by([c.pid])
    c.go()
    c.finish()
    assert r1["reserved"] >= 200 * MiB, "the caching allocator keeps the freed block"
    assert r2["before"]["free"] - r1["cached"]["free"] >= 200 * MiB
    assert device_cached >= 200 * MiB
    assert r2["reserved"] == 0
    assert r2["emptied"]["free"] == r2["before"]["free"], "the tenant view got the memory back"
    assert device_cached - device_emptied >= 200 * MiB, "the device got the memory back"


def test_expandable_segments_grow_to_the_limit_and_stop_cleanly(children):
    c = children("""
        held, error = fill(32 * MiB, %d)
        report(error=error, held=len(held) * 32 * MiB, view=view())
        wait()
        del held
        torch.cuda.empty_cache()
        y = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
        report(view=view(), ok=True)
    """ % LIMIT, env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    r = c.recv()
    device = held_by([c.pid])
    c.go()
    after = c.recv()
    c.finish()
    assert r["error"] is not None and r["error"].startswith("CUDA out of memory."), r["error"]
    # Segments grow in 20 MiB pages (2 MiB granularity on simgpu): all but the last chunk fits.
    assert r["held"] >= LIMIT - 64 * MiB, (r["held"], LIMIT)
    assert r["held"] <= LIMIT
    assert device <= LIMIT
    assert after["ok"]


def test_per_process_memory_fraction_applies_to_the_tenants_total(children):
    c = children("""
        torch.cuda.set_per_process_memory_fraction(0.5)
        total = torch.cuda.get_device_properties(0).total_memory
        try:
            torch.empty(int(total * 0.6), dtype=torch.uint8, device="cuda")
            refused = None
        except torch.OutOfMemoryError as e:
            refused = str(e)
        fits = torch.empty(int(total * 0.4), dtype=torch.uint8, device="cuda")
        report(total=total, refused=refused, fits=fits.numel())
    """)
    r = c.recv()
    c.finish()
    assert r["total"] == LIMIT
    assert r["refused"] is not None, "0.6 of the total went through a 0.5 fraction"
    assert "out of memory" in r["refused"]
    assert r["fits"] == int(LIMIT * 0.4)


def test_two_processes_share_one_limit(children):
    first = children("""
        x = torch.empty(int(%d * 0.6), dtype=torch.uint8, device="cuda")
        report(held=torch.cuda.memory_reserved())
        wait()
    """ % LIMIT)
    held = first.recv()["held"]
    second = children("""
        free, total = torch.cuda.mem_get_info()
        try:
            torch.empty(int(%d * 0.6), dtype=torch.uint8, device="cuda")
            refused = False
        except torch.OutOfMemoryError:
            refused = True
        torch.cuda.empty_cache()
        y = torch.empty(int(%d * 0.3), dtype=torch.uint8, device="cuda")
        report(free=free, total=total, refused=refused, second=torch.cuda.memory_reserved())
        wait()
    """ % (LIMIT, LIMIT))
    r = second.recv()
    device = held_by([first.pid, second.pid])
    second.go()
    second.finish()
    first.go()
    first.finish()
    assert r["total"] == LIMIT
    assert r["free"] <= LIMIT - held
    assert r["refused"], "the second process got 0.6 of the limit while the first held 0.6"
    assert device <= LIMIT
    assert device >= held + r["second"]


def test_serving_engine_sizing_fits_inside_the_limit(children):
    # What vLLM does with gpu_memory_utilization=0.9: the KV cache gets 0.9 of the reported
    # total minus what the process already uses; the rest of the total stays usable.
    c = children("""
        weights = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
        free, total = torch.cuda.mem_get_info()
        budget = int(total * 0.9) - torch.cuda.memory_reserved()
        cache = torch.empty(budget, dtype=torch.uint8, device="cuda")
        rest = torch.empty(int(total * 0.05), dtype=torch.uint8, device="cuda")
        report(total=total, budget=budget, reserved=torch.cuda.memory_reserved(), view=view())
        wait()
    """)
    r = c.recv()
    device = held_by([c.pid])
    c.go()
    c.finish()
    assert r["total"] == LIMIT
    assert r["budget"] > LIMIT // 2
    assert r["reserved"] <= LIMIT
    assert device <= LIMIT
    assert device >= r["reserved"]


def test_cuda_graph_capture_and_replay_with_its_pool_counted(children):
    c = children("""
        x = torch.ones(4 * MiB, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            y = x * 2  # warm-up outside the capture, as PyTorch's documentation asks
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        before = view()
        reserved_before = torch.cuda.memory_reserved()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            z = x * 2 + 1
        pool = torch.cuda.memory_reserved() - reserved_before
        for _ in range(5):
            g.replay()
        torch.cuda.synchronize()
        report(pool=pool, before=before, after=view(), shape=list(z.shape))
        wait()
        del g, z
        torch.cuda.empty_cache()
        report(released=view())
    """)
    r = c.recv()
    device = held_by([c.pid])
    c.go()
    released = c.recv()["released"]
    c.finish()
    assert r["shape"] == [4 * MiB]
    assert r["pool"] >= 16 * MiB, "the graph's output lives in its private pool"
    assert r["before"]["free"] - r["after"]["free"] >= r["pool"], "the pool counts in the view"
    assert device >= 2 * 16 * MiB + r["pool"] - 2 * MiB
    assert released["free"] - r["after"]["free"] >= r["pool"]


def test_cudnn_convolution_on_a_side_stream_and_in_graph_capture(children):
    # How serving engines run convolutions: on a torch.cuda.Stream() and captured into a CUDA
    # graph. cuDNN from 9.23.2.1 asks the driver for the stream's green context as it is set to a
    # stream; it failed there (CUDNN_STATUS_INTERNAL_ERROR) when simgpu answered NOT_SUPPORTED.
    # That cuDNN really ran is seen in the process: its convolution engines are loaded on first use.
    c = children("""
        conv = torch.nn.Conv2d(3, 8, 3).cuda()
        x = torch.ones(2, 3, 32, 32, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            y = conv(x)
            y = conv(x)  # warm-up before the capture, as PyTorch's documentation asks
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            z = conv(x)
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        maps = open("/proc/self/maps").read()
        report(y=list(y.shape), z=list(z.shape), cudnn=torch.backends.cudnn.version(),
               enabled=torch.backends.cudnn.enabled, engines="libcudnn_engines" in maps or "libcudnn_cnn" in maps)
    """)
    r = c.recv()
    c.finish()
    assert r["enabled"] and r["cudnn"] >= 91200, r
    assert r["y"] == [2, 8, 30, 30] and r["z"] == [2, 8, 30, 30]
    assert r["engines"], "no cuDNN convolution engine was loaded: the convolutions did not go through cuDNN"
