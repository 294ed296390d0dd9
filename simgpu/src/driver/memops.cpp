// Stream memory operations (the v2 API, CUDA 11.7+: always available; the device says 64-bit ones
// and NOR are supported): a 32- or 64-bit write to, or a wait on, device-accessible memory, in
// stream order. simgpu's device memory is host memory, so a write is an atomic store and a wait
// polls the word on the stream's own worker, holding back only that stream's later work, as on
// the device. The v1 API (CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1 is 0) answers
// CUDA_ERROR_NOT_SUPPORTED (simgpu/driver_api_cuda13.txt). Not modelled: capturing them into a
// graph (the capture is invalidated, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) and
// CU_STREAM_WAIT_VALUE_FLUSH / FLUSH_REMOTE_WRITES (CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES
// is 0: CUDA_ERROR_INVALID_VALUE).
#include <chrono>
#include <thread>
#include <vector>

#include "driver.h"

namespace simgpu {
namespace {

// One operation, checked at the call (as the driver checks its arguments before queuing).
struct MemOp {
  enum Kind { kWait, kWrite, kBarrier } kind = kBarrier;
  bool wide = false;  // 64-bit
  uintptr_t addr = 0;
  uint64_t value = 0;
  unsigned flags = 0;
};

// The address must lie inside memory the device can reach (not managed memory, which cuda.h says no
// memory operation supports), aligned to the operation's width.
CUresult checkAddress(CUdeviceptr addr, bool wide) {
  const size_t width = wide ? 8 : 4;
  if (addr == 0 || addr % width != 0) return CUDA_ERROR_INVALID_VALUE;
  Allocation a;
  if (!registryFind(static_cast<uintptr_t>(addr), &a)) return CUDA_ERROR_INVALID_VALUE;
  if (a.kind == MemKind::kManaged) return CUDA_ERROR_INVALID_VALUE;  // cuda.h: managed memory is not supported
  if (static_cast<uintptr_t>(addr) + width > a.base + a.size) return CUDA_ERROR_INVALID_VALUE;
  return CUDA_SUCCESS;
}

CUresult makeWait(CUdeviceptr addr, uint64_t value, unsigned flags, bool wide, MemOp* op) {
  if (flags & ~3u) return CUDA_ERROR_INVALID_VALUE;  // FLUSH: no remote-write flush on simgpu
  CU_TRY(checkAddress(addr, wide));
  *op = {MemOp::kWait, wide, static_cast<uintptr_t>(addr), value, flags};
  return CUDA_SUCCESS;
}

CUresult makeWrite(CUdeviceptr addr, uint64_t value, unsigned flags, bool wide, MemOp* op) {
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;  // NO_MEMORY_BARRIER is not in the v2 API
  CU_TRY(checkAddress(addr, wide));
  *op = {MemOp::kWrite, wide, static_cast<uintptr_t>(addr), value, flags};
  return CUDA_SUCCESS;
}

uint64_t load(const MemOp& op) {
  return op.wide ? __atomic_load_n(reinterpret_cast<uint64_t*>(op.addr), __ATOMIC_ACQUIRE)
                 : __atomic_load_n(reinterpret_cast<uint32_t*>(op.addr), __ATOMIC_ACQUIRE);
}

bool satisfied(const MemOp& op) {
  const uint64_t v = load(op);
  switch (op.flags) {
    case CU_STREAM_WAIT_VALUE_GEQ:  // cyclic: the signed difference, at the operation's width
      return op.wide ? static_cast<int64_t>(v - op.value) >= 0
                     : static_cast<int32_t>(static_cast<uint32_t>(v) - static_cast<uint32_t>(op.value)) >= 0;
    case CU_STREAM_WAIT_VALUE_EQ:
      return v == (op.wide ? op.value : static_cast<uint32_t>(op.value));
    case CU_STREAM_WAIT_VALUE_AND:
      return (v & op.value) != 0;
    default: {  // NOR
      const uint64_t nor = ~(v | op.value);
      return (op.wide ? nor : static_cast<uint32_t>(nor)) != 0;
    }
  }
}

void runOne(const MemOp& op) {
  switch (op.kind) {
    case MemOp::kWrite:
      if (op.wide)
        __atomic_store_n(reinterpret_cast<uint64_t*>(op.addr), op.value, __ATOMIC_SEQ_CST);
      else
        __atomic_store_n(reinterpret_cast<uint32_t*>(op.addr), static_cast<uint32_t>(op.value), __ATOMIC_SEQ_CST);
      break;
    case MemOp::kWait: {
      // Poll with a growing pause (1 us .. 100 us): the writer is another stream or the host.
      auto pause = std::chrono::microseconds(1);
      while (!satisfied(op)) {
        std::this_thread::sleep_for(pause);
        if (pause < std::chrono::microseconds(100)) pause *= 2;
      }
      streamPositionAtLeast(deviceNowNs());  // the stream waited for the value
      break;
    }
    case MemOp::kBarrier:
      __atomic_thread_fence(__ATOMIC_SEQ_CST);
      break;
  }
}

CUresult enqueueOps(CUstream h, std::vector<MemOp> ops) {
  Stream* s;
  CU_TRY(resolveStream(h, &s));
  if (s->captureStatus != CU_STREAM_CAPTURE_STATUS_NONE) {
    // Recording memory operations into a graph is not modelled: the capture ends invalid.
    s->captureStatus = CU_STREAM_CAPTURE_STATUS_INVALIDATED;
    return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  }
  Op op;
  op.type = Op::kEmpty;
  op.run = [ops = std::move(ops)] {
    for (const MemOp& o : ops) runOne(o);
    return CUDA_SUCCESS;
  };
  return submit(s, std::move(op));
}

}  // namespace
}  // namespace simgpu

using namespace simgpu;

namespace {
// One wait or write, queued on its own.
CUresult single(CUstream h, CUdeviceptr addr, uint64_t value, unsigned flags, bool write, bool wide) {
  MemOp op;
  CU_TRY(write ? makeWrite(addr, value, flags, wide, &op) : makeWait(addr, value, flags, wide, &op));
  return enqueueOps(h, {op});
}
}  // namespace

CU_EXPORT CUresult cuStreamWaitValue32_v2(CUstream h, CUdeviceptr addr, cuuint32_t value, unsigned int flags) {
  API_ENTER(h, addr, value, flags);
  return single(h, addr, value, flags, false, false);
}
CU_EXPORT CUresult cuStreamWaitValue64_v2(CUstream h, CUdeviceptr addr, cuuint64_t value, unsigned int flags) {
  API_ENTER(h, addr, value, flags);
  return single(h, addr, value, flags, false, true);
}
CU_EXPORT CUresult cuStreamWriteValue32_v2(CUstream h, CUdeviceptr addr, cuuint32_t value, unsigned int flags) {
  API_ENTER(h, addr, value, flags);
  return single(h, addr, value, flags, true, false);
}
CU_EXPORT CUresult cuStreamWriteValue64_v2(CUstream h, CUdeviceptr addr, cuuint64_t value, unsigned int flags) {
  API_ENTER(h, addr, value, flags);
  return single(h, addr, value, flags, true, true);
}

CU_EXPORT CUresult cuStreamBatchMemOp_v2(CUstream h, unsigned int count, CUstreamBatchMemOpParams* params,
                                         unsigned int flags) {
  API_ENTER(h, count, params, flags);
  if (count == 0 || count >= 256 || !params || flags != 0) return CUDA_ERROR_INVALID_VALUE;  // cuda.h: fewer than 256
  std::vector<MemOp> ops(count);
  for (unsigned i = 0; i < count; ++i) {
    const CUstreamBatchMemOpParams& p = params[i];
    switch (p.operation) {
      case CU_STREAM_MEM_OP_WAIT_VALUE_32:
        CU_TRY(makeWait(p.waitValue.address, p.waitValue.value, p.waitValue.flags, false, &ops[i]));
        break;
      case CU_STREAM_MEM_OP_WAIT_VALUE_64:
        CU_TRY(makeWait(p.waitValue.address, p.waitValue.value64, p.waitValue.flags, true, &ops[i]));
        break;
      case CU_STREAM_MEM_OP_WRITE_VALUE_32:
        CU_TRY(makeWrite(p.writeValue.address, p.writeValue.value, p.writeValue.flags, false, &ops[i]));
        break;
      case CU_STREAM_MEM_OP_WRITE_VALUE_64:
        CU_TRY(makeWrite(p.writeValue.address, p.writeValue.value64, p.writeValue.flags, true, &ops[i]));
        break;
      case CU_STREAM_MEM_OP_BARRIER:
        if (p.memoryBarrier.flags > CU_STREAM_MEMORY_BARRIER_TYPE_GPU) return CUDA_ERROR_INVALID_VALUE;
        ops[i].kind = MemOp::kBarrier;
        break;
      default:  // FLUSH_REMOTE_WRITES (no remote-write flush on simgpu) or not an operation
        return CUDA_ERROR_INVALID_VALUE;
    }
  }
  return enqueueOps(h, std::move(ops));
}
