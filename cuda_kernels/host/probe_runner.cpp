// ProbeRunner (see probe_runner.h).
#include "probe_runner.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>

namespace cushare::probe {
namespace {

constexpr uint32_t kTickThreads = 32;  // one warp
constexpr uint64_t kMaxFatbinBytes = 64ull << 20;

uint64_t clockNs(clockid_t id) {
  timespec ts{};
  clock_gettime(id, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1'000'000'000ull + static_cast<uint64_t>(ts.tv_nsec);
}

ProbeError cuFail(const char* step, CUresult r) { return ProbeError{step, r, 0}; }
ProbeError sysFail(const char* step, int e) { return ProbeError{step, CUDA_SUCCESS, e ? e : EIO}; }

// The whole file into *out; sysErrno on failure (EFBIG: larger than any fatbin we build).
ProbeError readFile(const char* path, std::vector<char>* out) {
  const int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return sysFail("open probe fatbin", errno);
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const int e = errno;
    close(fd);
    return sysFail("stat probe fatbin", e);
  }
  if (!S_ISREG(st.st_mode) || st.st_size <= 0 || static_cast<uint64_t>(st.st_size) > kMaxFatbinBytes) {
    close(fd);
    return sysFail("probe fatbin size", S_ISREG(st.st_mode) ? EFBIG : EINVAL);
  }
  out->resize(static_cast<size_t>(st.st_size));
  size_t got = 0;
  while (got < out->size()) {
    const ssize_t n = read(fd, out->data() + got, out->size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int e = n < 0 ? errno : EIO;  // shorter than fstat said: truncated meanwhile
      close(fd);
      return sysFail("read probe fatbin", e);
    }
    got += static_cast<size_t>(n);
  }
  close(fd);
  return {};
}

// Pushes a context for a scope; pops it at the end if the push succeeded.
struct CtxScope {
  CUresult pushed;
  explicit CtxScope(CUcontext c) : pushed(cuCtxPushCurrent(c)) {}
  ~CtxScope() {
    if (pushed == CUDA_SUCCESS) {
      CUcontext dummy;
      cuCtxPopCurrent(&dummy);
    }
  }
};

}  // namespace

std::string ProbeError::message() const {
  std::string m = step ? step : "probe";
  m += ": ";
  if (result != CUDA_SUCCESS) {
    const char* name = nullptr;
    const char* text = nullptr;
    if (cuGetErrorName(result, &name) != CUDA_SUCCESS || !name) name = nullptr;
    if (cuGetErrorString(result, &text) != CUDA_SUCCESS) text = nullptr;
    m += name ? name : ("CUresult " + std::to_string(static_cast<int>(result)));
    if (text) m += std::string(" (") + text + ")";
  } else if (sysErrno) {
    m += std::strerror(sysErrno);
  } else {
    m += "ok";
  }
  return m;
}

ProbeError ProbeRunner::load(const char* fatbinPath, const RunnerOptions& opts, std::unique_ptr<ProbeRunner>* out) {
  if (!fatbinPath || !out) return cuFail("ProbeRunner::load arguments", CUDA_ERROR_INVALID_VALUE);
  if (opts.smThreads == 0 || opts.smThreads % 32 || opts.smThreads > 1024 || opts.memThreads == 0 ||
      opts.memThreads % 32 || opts.memThreads > 1024 || opts.workPerStep == 0 || opts.memBufferBytes < 16 ||
      opts.memBufferBytes % 16 || opts.smBlocksPerSm == 0 || opts.memBlocksPerSm == 0 ||
      opts.smBlocksPerSm > 32 || opts.memBlocksPerSm > 32)
    return cuFail("probe runner options", CUDA_ERROR_INVALID_VALUE);
  std::vector<char> image;
  if (ProbeError e = readFile(fatbinPath, &image)) return e;

  std::unique_ptr<ProbeRunner> r(new ProbeRunner);
  r->opts_ = opts;
  if (CUresult c = cuCtxGetCurrent(&r->ctx_); c != CUDA_SUCCESS) return cuFail("cuCtxGetCurrent", c);
  if (!r->ctx_) return cuFail("cuCtxGetCurrent (no current context)", CUDA_ERROR_INVALID_CONTEXT);
  CUdevice dev;
  if (CUresult c = cuCtxGetDevice(&dev); c != CUDA_SUCCESS) return cuFail("cuCtxGetDevice", c);
  int sms = 0;
  if (CUresult c = cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev); c != CUDA_SUCCESS)
    return cuFail("cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)", c);
  if (sms <= 0) return cuFail("cuDeviceGetAttribute(MULTIPROCESSOR_COUNT) <= 0", CUDA_ERROR_INVALID_DEVICE);
  r->sms_ = static_cast<uint32_t>(sms);
  r->smBlocks_ = r->sms_ * opts.smBlocksPerSm;
  r->memBlocks_ = r->sms_ * opts.memBlocksPerSm;

  if (CUresult c = cuModuleLoadData(&r->module_, image.data()); c != CUDA_SUCCESS) {
    r->module_ = nullptr;
    return cuFail("cuModuleLoadData(probe fatbin)", c);
  }
  const char* names[3] = {kSmProbeName, kMemProbeName, kTickProbeName};
  for (int i = 0; i < 3; ++i)
    if (CUresult c = cuModuleGetFunction(&r->fn_[i], r->module_, names[i]); c != CUDA_SUCCESS)
      return cuFail(i == 0 ? "cuModuleGetFunction(cushare_probe_sm)"
                           : i == 1 ? "cuModuleGetFunction(cushare_probe_mem)" : "cuModuleGetFunction(cushare_probe_tick)",
                    c);
  const size_t nRecords = static_cast<size_t>(r->smBlocks_) + r->memBlocks_ + r->tickBlocks_;
  if (CUresult c = cuMemAlloc(&r->t0_, 3 * sizeof(uint64_t)); c != CUDA_SUCCESS) {
    r->t0_ = 0;
    return cuFail("cuMemAlloc(t0 words)", c);
  }
  if (CUresult c = cuPointerGetAttribute(&r->t0Id_, CU_POINTER_ATTRIBUTE_BUFFER_ID, r->t0_); c != CUDA_SUCCESS)
    return cuFail("cuPointerGetAttribute(t0 words, buffer id)", c);
  if (CUresult c = cuMemAlloc(&r->records_, nRecords * sizeof(BlockRecord)); c != CUDA_SUCCESS) {
    r->records_ = 0;
    return cuFail("cuMemAlloc(probe records)", c);
  }
  if (CUresult c = cuMemAlloc(&r->buffer_, opts.memBufferBytes); c != CUDA_SUCCESS) {
    r->buffer_ = 0;
    return cuFail("cuMemAlloc(memory probe buffer)", c);
  }
  if (CUresult c = cuMemsetD8(r->buffer_, 0, opts.memBufferBytes); c != CUDA_SUCCESS)
    return cuFail("cuMemsetD8(memory probe buffer)", c);
  r->host_.assign(nRecords, BlockRecord{});
  *out = std::move(r);
  return {};
}

void ProbeRunner::release() noexcept {
  if (!ctx_) return;
  CtxScope scope(ctx_);
  if (scope.pushed != CUDA_SUCCESS) return;  // the context is gone: so is everything in it
  if (buffer_) cuMemFree(buffer_);
  if (records_) cuMemFree(records_);
  if (t0_) cuMemFree(t0_);
  if (module_) cuModuleUnload(module_);
  buffer_ = records_ = t0_ = 0;
  module_ = nullptr;
}

ProbeRunner::~ProbeRunner() { release(); }

bool ProbeRunner::ownsItsMemory() const noexcept {
  unsigned long long id = 0;
  return t0_ != 0 && t0Id_ != 0 && cuPointerGetAttribute(&id, CU_POINTER_ATTRIBUTE_BUFFER_ID, t0_) == CUDA_SUCCESS &&
         id == t0Id_;
}

void ProbeRunner::abandon() noexcept {
  ctx_ = nullptr;
  module_ = nullptr;
  for (CUfunction& f : fn_) f = nullptr;
  buffer_ = records_ = t0_ = 0;
}

ProbeError ProbeRunner::launch(CUstream stream, CUfunction f, ProbeKind kind, uint32_t slot, uint32_t blocks,
                               uint32_t threads, uint64_t budgetNs, uint64_t records, ProbeRun* run) noexcept {
  ProbeArgs a{};
  a.abi_version = kProbeAbiVersion;
  a.kind = kind;
  a.budget_ns = budgetNs;
  a.t0 = t0_ + slot * sizeof(uint64_t);
  a.records = records;
  a.record_count = blocks;
  a.work_per_step = kind == kProbeSm ? opts_.workPerStep : 0;
  if (kind == kProbeMem) {
    a.buffer = buffer_;
    a.buffer_bytes = opts_.memBufferBytes;
  }
  void* params[] = {&a};
  run->kind = kind;
  run->blocks = blocks;
  run->threads = threads;
  run->budgetNs = budgetNs;
  run->launchRealtimeNs = clockNs(CLOCK_REALTIME);
  run->launchMonotonicNs = clockNs(CLOCK_MONOTONIC);
  if (CUresult c = cuLaunchKernel(f, blocks, 1, 1, threads, 1, 1, 0, stream, params, nullptr); c != CUDA_SUCCESS) {
    run->blocks = 0;
    return cuFail(kind == kProbeSm ? "cuLaunchKernel(cushare_probe_sm)"
                  : kind == kProbeMem ? "cuLaunchKernel(cushare_probe_mem)" : "cuLaunchKernel(cushare_probe_tick)",
                  c);
  }
  return {};
}

ProbeError ProbeRunner::runRound(CUstream stream, uint32_t what, const ProbeBudgets& budget, RoundRecords* out) noexcept {
  if (!out || (what & ~static_cast<uint32_t>(kRunAll)) || what == 0)
    return cuFail("runRound arguments", CUDA_ERROR_INVALID_VALUE);
  if ((what & kRunSm && budget.smNs == 0) || (what & kRunMem && budget.memNs == 0) ||
      (what & kRunTick && budget.tickNs == 0))
    return cuFail("runRound budget (0 ns)", CUDA_ERROR_INVALID_VALUE);
  *out = RoundRecords{};
  CtxScope scope(ctx_);
  if (scope.pushed != CUDA_SUCCESS) return cuFail("cuCtxPushCurrent(probe context)", scope.pushed);
  const size_t nRecords = host_.size();
  if (CUresult c = cuMemsetD8Async(t0_, 0, 3 * sizeof(uint64_t), stream); c != CUDA_SUCCESS)
    return cuFail("cuMemsetD8Async(t0 words)", c);
  if (CUresult c = cuMemsetD8Async(records_, 0, nRecords * sizeof(BlockRecord), stream); c != CUDA_SUCCESS)
    return cuFail("cuMemsetD8Async(probe records)", c);
  // Records: [sm | mem | tick]; t0 words: sm 0, mem 1, tick 2.
  const CUdeviceptr smRec = records_;
  const CUdeviceptr memRec = smRec + smBlocks_ * sizeof(BlockRecord);
  const CUdeviceptr tickRec = memRec + memBlocks_ * sizeof(BlockRecord);
  ProbeError err;
  out->tick.kind = kProbeTick;
  out->sm.kind = kProbeSm;
  out->mem.kind = kProbeMem;
  if (!err && (what & kRunTick))
    err = launch(stream, fn_[2], kProbeTick, 2, tickBlocks_, kTickThreads, budget.tickNs, tickRec, &out->tick);
  if (!err && (what & kRunSm))
    err = launch(stream, fn_[0], kProbeSm, 0, smBlocks_, opts_.smThreads, budget.smNs, smRec, &out->sm);
  if (!err && (what & kRunMem))
    err = launch(stream, fn_[1], kProbeMem, 1, memBlocks_, opts_.memThreads, budget.memNs, memRec, &out->mem);
  // Whatever was launched is waited for before the records are read (or the runner reused).
  if (CUresult c = cuMemcpyDtoHAsync(host_.data(), records_, nRecords * sizeof(BlockRecord), stream);
      c != CUDA_SUCCESS && !err)
    err = cuFail("cuMemcpyDtoHAsync(probe records)", c);
  if (CUresult c = cuStreamSynchronize(stream); c != CUDA_SUCCESS && !err) err = cuFail("cuStreamSynchronize", c);
  if (err) {
    *out = RoundRecords{};
    return err;
  }
  const BlockRecord* h = host_.data();
  if (out->sm.blocks) out->sm.records = {h, smBlocks_};
  if (out->mem.blocks) out->mem.records = {h + smBlocks_, memBlocks_};
  if (out->tick.blocks) out->tick.records = {h + smBlocks_ + memBlocks_, tickBlocks_};
  return {};
}

double roundCostUs(const RoundRecords& r, uint32_t sms) {
  uint64_t sum = 0;
  for (const ProbeRun* p : {&r.tick, &r.sm, &r.mem})
    for (const BlockRecord& b : p->records)
      if (b.flags & (kProbeRan | kProbeLate)) sum += b.end_ns - b.start_ns - std::min(b.gap_ns, b.end_ns - b.start_ns);
  return sms ? static_cast<double>(sum) / sms / 1000.0 : 0.0;
}

}  // namespace cushare::probe
