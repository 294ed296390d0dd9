"""CuPy, a framework nobody on the team wrote, running unmodified on simgpu.

Optional test tier: run by scripts/test-frameworks.sh, never by the build or CTest. The script
starts pytest twice with the environment set up before Python starts (the loader reads
LD_LIBRARY_PATH and LD_PRELOAD only at process start, and CuPy dlopens libcuda.so.1 by soname):

  plain run:  LD_LIBRARY_PATH=build/lib/simgpu:/usr/local/cuda/lib64 SIMGPU_STATE_DIR=...
              SIMGPU_MEMORY=4GiB
  shim run:   the same plus LD_PRELOAD=build/lib/libcushare.so CUSHARE_TENANT=cupy
              CUSHARE_MEMORY_LIMIT=256MiB CUSHARE_LEDGER_DIR=...

Each run executes only its own cases: the shim cases are selected by CUSHARE_MEMORY_LIMIT being
set, the plain cases by it being unset.
"""

import os
import re

import pytest

cupy = pytest.importorskip("cupy")
numpy = pytest.importorskip("numpy")

MiB = 1 << 20
GiB = 1 << 30

from tier import mapped, plain_only, shim_only, test_shim_is_preloaded  # noqa: E402,F401

_UNITS = {
    "": 1,
    "K": 1 << 10, "KI": 1 << 10, "KIB": 1 << 10,
    "M": 1 << 20, "MI": 1 << 20, "MIB": 1 << 20,
    "G": 1 << 30, "GI": 1 << 30, "GIB": 1 << 30,
    "T": 1 << 40, "TI": 1 << 40, "TIB": 1 << 40,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
}


def parse_size(text):
    """A size as simgpu and cushare read it (docs/simgpu.md): bytes, binary or decimal units."""
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    assert m and m.group(2).upper() in _UNITS, f"cannot parse size {text!r}"
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def expected_device_memory():
    # One size for all devices, or the first of a per-device list; simgpu's default is 16GiB.
    return parse_size(os.environ.get("SIMGPU_MEMORY", "16GiB").split(",")[0])


@pytest.fixture(autouse=True)
def empty_pool():
    """Every case starts and ends with CuPy's pools holding no device memory, so mem_info and the
    tenant's ledger see only what the case itself holds."""
    cupy.get_default_memory_pool().free_all_blocks()
    yield
    cupy.cuda.Device(0).synchronize()
    cupy.get_default_memory_pool().free_all_blocks()


@pytest.fixture
def no_pool():
    """CuPy's allocator replaced by plain cudaMalloc/cudaFree, so an array's memory is allocated
    when it is created and returned when it dies (exact mem_info accounting)."""
    previous = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(None)
    try:
        yield
    finally:
        cupy.cuda.set_allocator(previous)


# ---- plain simgpu run ----------------------------------------------------------------------------


@plain_only
def test_one_simgpu_device():
    assert cupy.cuda.runtime.getDeviceCount() == 1
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    if isinstance(name, bytes):
        name = name.decode()
    assert "simgpu" in name


@plain_only
def test_mem_info_total_is_simgpu_memory():
    free, total = cupy.cuda.Device(0).mem_info
    assert total == expected_device_memory()
    assert 0 < free <= total


@plain_only
def test_host_device_host_round_trip_is_exact():
    rng = numpy.random.default_rng(1234)
    for host in (
        rng.standard_normal((257, 33)).astype(numpy.float32),
        rng.integers(-(2**62), 2**62, size=10_001, dtype=numpy.int64),
        numpy.frombuffer(rng.bytes(3 * MiB + 7), dtype=numpy.uint8),
    ):
        back = cupy.asarray(host).get()
        assert back.dtype == host.dtype and back.shape == host.shape
        assert numpy.array_equal(back, host)


@plain_only
def test_1gib_array_lowers_free_memory_while_it_lives(no_pool):
    device = cupy.cuda.Device(0)
    free_before, total = device.mem_info
    big = cupy.empty(GiB, dtype=cupy.uint8)
    free_during, _ = device.mem_info
    assert free_before - free_during >= GiB
    del big
    free_after, _ = device.mem_info
    assert free_after - free_during >= GiB


@plain_only
def test_elementwise_kernel_launches():
    # simgpu never compiles or runs device code: a kernel launch succeeds (the module is loaded,
    # its parameter layout read from the cubin NVRTC produced, the arguments copied) but computes
    # nothing unless a host body is supplied (docs/simgpu.md), so the result's values are
    # whatever the output buffer held. Only the launch path is checked here, not values.
    x = cupy.arange(1024, dtype=cupy.float32)
    y = x * 2
    double = cupy.ElementwiseKernel("float32 a", "float32 b", "b = a * 2", "cushare_double")
    z = double(x)
    cupy.cuda.Device(0).synchronize()
    assert y.shape == z.shape == x.shape and y.dtype == z.dtype == cupy.float32


def test_gemm_runs_through_the_ctk_wheels_cublas():
    # CuPy installed with its [ctk] extra (the CUDA toolkit's libraries as pip wheels) loads cuBLAS
    # from the wheel, which from 13.5.1.27 asks the driver for the stream's green context as the
    # handle is made; the first GEMM failed there (CUBLAS_STATUS_INTERNAL_ERROR) on simgpu before.
    a = cupy.ones((64, 32), dtype=cupy.float32)
    b = cupy.ones((32, 16), dtype=cupy.float32)
    with cupy.cuda.Stream(non_blocking=True):
        c = a @ b
    cupy.cuda.Device(0).synchronize()
    assert c.shape == (64, 16) and c.dtype == cupy.float32
    cublas = mapped("libcublas.so")
    assert cublas and all("site-packages/nvidia/" in p for p in cublas), f"cuBLAS not from the [ctk] wheels: {cublas}"


# ---- shim run ------------------------------------------------------------------------------------


@shim_only
def test_mem_info_total_is_tenant_limit():
    free, total = cupy.cuda.Device(0).mem_info
    assert total == parse_size(os.environ["CUSHARE_MEMORY_LIMIT"]) == 256 * MiB
    assert 0 < free <= total


@shim_only
def test_allocation_over_limit_raises_out_of_memory():
    # Through CuPy's memory pool (the default allocator), a failed cudaMalloc surfaces as
    # OutOfMemoryError; with set_allocator(None) it would be a CUDARuntimeError instead.
    with pytest.raises(cupy.cuda.memory.OutOfMemoryError):
        cupy.empty(300 * MiB, dtype=cupy.uint8)


@shim_only
def test_allocation_under_limit_succeeds():
    # 128 MiB: the cuBLAS handle the GEMM case made (CuPy keeps it for the process) holds memory
    # of the tenant's too.
    device = cupy.cuda.Device(0)
    free_before, _ = device.mem_info
    a = cupy.empty(128 * MiB, dtype=cupy.uint8)
    free_during, total = device.mem_info
    assert total == 256 * MiB
    assert free_before - free_during >= 128 * MiB
    del a
