"""ONNX Runtime GPU (CUDA execution provider, with the cuBLAS and cuDNN wheels its [cuda,cudnn]
extras name) running unmodified on simgpu, then under the cushare shim.

Optional test tier: run by scripts/test-frameworks.sh, never by the build or CTest, as
test_cupy.py: the plain run has LD_LIBRARY_PATH=build/lib/simgpu (ONNX Runtime's own CUDA
libraries come from the nvidia-* wheels through onnxruntime.preload_dlls), the shim run adds
LD_PRELOAD=build/lib/libcushare.so with a tenant limit in CUSHARE_MEMORY_LIMIT. Each case is judged
by ONNX Runtime's own view (providers, outputs, errors) and by the device's own count of memory
(simgpu-smi --json, run without the shim: what the whole simulated device holds).

simgpu computes nothing unless a kernel has a host body, so outputs are checked for shape and
type, never values.
"""

import json
import os
import re
import subprocess

import pytest

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
numpy = pytest.importorskip("numpy")
from onnx import TensorProto, helper  # noqa: E402

MiB = 1 << 20

from tier import mapped, plain_only, shim_only, test_shim_is_preloaded  # noqa: E402,F401
SMI = os.environ.get("SIMGPU_SMI", "")

ort.preload_dlls(cuda=True, cudnn=True)


def device_used():
    """What the simulated device holds, all processes together (its own count, not the tenant's view)."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    out = subprocess.run([SMI, "--json"], env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out)["devices"][0]["memory_used"]


def conv_matmul_model():
    """Conv (cuDNN) then MatMul (cuBLAS) on a batch of 3x32x32 images; the batch is dynamic."""
    rng = numpy.random.default_rng(7)
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 3, 32, 32])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)
    w = helper.make_tensor("W", TensorProto.FLOAT, [8, 3, 3, 3], rng.random(8 * 3 * 3 * 3, dtype=numpy.float32))
    m = helper.make_tensor("M", TensorProto.FLOAT, [30, 16], rng.random(30 * 16, dtype=numpy.float32))
    graph = helper.make_graph(
        [helper.make_node("Conv", ["X", "W"], ["C"]), helper.make_node("MatMul", ["C", "M"], ["Y"])],
        "conv_matmul", [x], [y], [w, m])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model.SerializeToString()


def add_model():
    """Y = X + X on a flat float tensor of any length: device memory in proportion to the input."""
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["L"])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["L"])
    graph = helper.make_graph([helper.make_node("Add", ["X", "X"], ["Y"])], "add", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model.SerializeToString()


def cuda_session(model, **cuda_options):
    s = ort.InferenceSession(model, providers=[("CUDAExecutionProvider", cuda_options)])
    assert s.get_providers()[0] == "CUDAExecutionProvider", s.get_providers()
    return s


def floats(mib):
    return numpy.zeros(mib * MiB // 4, dtype=numpy.float32)


# ---- both runs ---------------------------------------------------------------------------------


def test_cuda_provider_runs_a_convolution_and_a_gemm():
    s = cuda_session(conv_matmul_model())
    y = s.run(None, {"X": numpy.ones((2, 3, 32, 32), dtype=numpy.float32)})[0]
    assert y.shape == (2, 8, 30, 16) and y.dtype == numpy.float32


# ---- plain simgpu run --------------------------------------------------------------------------


@plain_only
def test_arena_limit_refuses_before_the_device_is_asked():
    # gpu_mem_limit caps ONNX Runtime's arena: an input that does not fit is refused by the arena
    # itself (its own message), the device's count does not move, and the session goes on working.
    # (Beside the arena, the CUDA provider's cuBLAS and cuDNN handles hold memory of their own,
    # which the cap does not cover.)
    s = cuda_session(add_model(), gpu_mem_limit=64 * MiB, arena_extend_strategy="kSameAsRequested")
    assert s.run(None, {"X": floats(8)})[0].shape == (8 * MiB // 4,)
    held = device_used()
    with pytest.raises(Exception, match=r"Available memory of \d+ is smaller than requested bytes of 100663296"):
        s.run(None, {"X": floats(96)})
    assert device_used() == held, "the refused request reached the device"
    assert s.run(None, {"X": floats(8)})[0].shape == (8 * MiB // 4,), "the session works after the refusal"


# ---- shim run ----------------------------------------------------------------------------------


@shim_only
def test_tenant_limit_refuses_a_too_large_input_cleanly():
    # No arena cap: the tenant's limit is what stops it. ONNX Runtime reports its own error (no
    # crash), the device's count never passes the limit, and the session goes on working.
    limit = 256 * MiB
    assert re.fullmatch(r"256MiB", os.environ["CUSHARE_MEMORY_LIMIT"])
    s = cuda_session(add_model())
    assert s.run(None, {"X": floats(16)})[0].shape == (16 * MiB // 4,)
    with pytest.raises(Exception, match=r"Failed to allocate memory for requested buffer of size 209715200"):
        s.run(None, {"X": floats(200)})  # input and output: 400 MiB
    assert device_used() <= limit, "the device holds more for the tenant (this process) than its limit"
    assert s.run(None, {"X": floats(16)})[0].shape == (16 * MiB // 4,), "the session works after the refusal"
