// The probe kernels' twins in the driver (simgpu/src/probe_twin.h for the model): reading a probe
// launch's ProbeArgs, checking them as the kernel would, and writing the records the engine's
// traces give into the program's device memory once the kernel ended.
//
// Invariants: nothing is written outside args.records[0, grid) and *args.t0; an address that is
// not simulated device memory of the needed size is the kernel's illegal access (the process's
// sticky CUDA_ERROR_ILLEGAL_ADDRESS, as a real fault), never a write.
#include <unistd.h>

#include <cstdio>
#include <cstring>

#include "driver.h"
#include "mps_client.h"
#include "probe_twin.h"

extern "C" void simgpu_debug_fault(int error);

namespace simgpu {
namespace {

using namespace cushare::probe;

// Where [addr, addr + bytes) lies in one simulated allocation: its host address; null otherwise.
void* deviceRange(uint64_t addr, uint64_t bytes) {
  Allocation a;
  if (addr == 0 || !registryFind(static_cast<uintptr_t>(addr), &a)) return nullptr;
  if (bytes > a.size || addr - a.base > a.size - bytes) return nullptr;
  return reinterpret_cast<void*>(static_cast<uintptr_t>(addr));
}

CUresult illegalAccess(const Function* f, const char* what, uint64_t addr, uint64_t bytes) {
  std::fprintf(stderr, "simgpu: %s: args.%s 0x%llx is not device memory of %llu bytes: CUDA_ERROR_ILLEGAL_ADDRESS\n",
               f->name.c_str(), what, static_cast<unsigned long long>(addr), static_cast<unsigned long long>(bytes));
  simgpu_debug_fault(CUDA_ERROR_ILLEGAL_ADDRESS);
  return CUDA_ERROR_ILLEGAL_ADDRESS;
}

}  // namespace

uint32_t probeKindOf(const std::string& name) {
  if (name == kSmProbeName) return kProbeSm;
  if (name == kMemProbeName) return kProbeMem;
  if (name == kTickProbeName) return kProbeTick;
  return 0;
}

CUresult probeBegin(const KernelParams& k, ProbeLaunch* p) {
  *p = ProbeLaunch{};
  p->kind = k.fn->probeKind;
  if (!p->kind) return CUDA_SUCCESS;
  // The one argument, as copied at launch (a packed buffer or the parameter).
  if (k.args.empty() || k.args[0].size() < sizeof(ProbeArgs)) {
    p->valid = false;  // the kernel reads garbage: treat as bad arguments, with nowhere to say so
    return CUDA_SUCCESS;
  }
  std::memcpy(&p->args, k.args[0].data(), sizeof(ProbeArgs));
  const ProbeArgs& a = p->args;
  p->valid = probeArgsValid(a, p->kind, k.grid, k.block);
  if (!p->valid) {
    // Block 0 flags record 0, if there is one to flag.
    if (a.records && a.record_count >= 1) {
      void* r = deviceRange(a.records, sizeof(BlockRecord));
      if (!r) return illegalAccess(k.fn, "records", a.records, sizeof(BlockRecord));
      BlockRecord rec{};
      rec.flags = kProbeBadArgs;
      std::memcpy(r, &rec, sizeof rec);
    }
    return CUDA_SUCCESS;
  }
  if (k.grid[0] > kProbeMaxTracedBlocks) {
    std::fprintf(stderr, "simgpu: %s: a grid of %u blocks is more than simgpu's probe twins trace (%u): CUDA_ERROR_NOT_SUPPORTED\n",
                 k.fn->name.c_str(), k.grid[0], kProbeMaxTracedBlocks);
    return CUDA_ERROR_NOT_SUPPORTED;
  }
  if (!deviceRange(a.records, static_cast<uint64_t>(k.grid[0]) * sizeof(BlockRecord)))
    return illegalAccess(k.fn, "records", a.records, static_cast<uint64_t>(k.grid[0]) * sizeof(BlockRecord));
  if (!deviceRange(a.t0, sizeof(uint64_t))) return illegalAccess(k.fn, "t0", a.t0, sizeof(uint64_t));
  if (p->kind == kProbeMem && !deviceRange(a.buffer, a.buffer_bytes))
    return illegalAccess(k.fn, "buffer", a.buffer, a.buffer_bytes);
  return CUDA_SUCCESS;
}

void probeShape(const ProbeLaunch& p, KernelShape* s) {
  if (!p.kind) return;
  s->blockNs = kProbeLateBlockNs;  // a block past its deadline, or one that rejected its arguments
  if (!p.valid) return;
  s->timeBoxNs = p.args.budget_ns;
  s->traceBlocks = true;
}

CUresult probeEnd(const KernelParams& k, const ProbeLaunch& p, const std::vector<BlockTrace>& traces) {
  if (!p.kind || !p.valid) return CUDA_SUCCESS;
  std::vector<uint32_t> smIds;
  const MpsClientInfo* client = mpsClient();
  if (client || drv().cfg.testSmCap) {
    // An MPS client reads virtual SM ids, its own permutation (SIMGPU_TEST_SM_CAP stands for one).
    smIds = virtualSmIds(drv().cfg.smCount, (static_cast<uint64_t>(getpid()) << 20) ^ 0x5151u);
  }
  std::vector<BlockRecord> recs;
  uint64_t t0 = 0;
  const uint32_t threads = k.block[0] * k.block[1] * k.block[2];
  probeRecords(p.args, p.kind, threads, traces, smIds, drv().cfg.smCount, &recs, &t0);
  // Checked at the launch; the program may have freed the memory since (a real kernel would fault).
  void* r = deviceRange(p.args.records, recs.size() * sizeof(BlockRecord));
  if (!r) return illegalAccess(k.fn, "records", p.args.records, recs.size() * sizeof(BlockRecord));
  void* t = deviceRange(p.args.t0, sizeof t0);
  if (!t) return illegalAccess(k.fn, "t0", p.args.t0, sizeof t0);
  std::memcpy(r, recs.data(), recs.size() * sizeof(BlockRecord));
  if (t0) std::memcpy(t, &t0, sizeof t0);
  return CUDA_SUCCESS;
}

}  // namespace simgpu
