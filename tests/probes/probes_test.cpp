// The probe kernels and their runner (docs/probes.md): the fatbin's contents, and ProbeRunner on
// simgpu, whose native twins of the kernels write records from what simgpu's engine really gave
// each block (docs/simgpu.md, "Probe kernels"). Judged against simgpu's own ground truth (the
// time-slice board's per-process counters), never only against the records.
//
// Suites (each registered as its own ctest, tests/probes/CMakeLists.txt):
//   Fatbin.*        the fatbin: SASS for sm_80/90/100 and compute_80 PTX, each with the 3 kernels
//   Alone.*         the runner alone on the device
//   TimeSliced.*    next to a hog process that saturates the device (time slicing)
//   SmCap.*         under simulated MPS with an active thread percentage (and SIMGPU_TEST_SM_CAP)
// Children (the MPS client) are this program re-executed with --child.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "probe_runner.h"
#include "simgpu_hog.h"
#include "timeslice_board.h"

namespace {

using namespace cushare::probe;

constexpr uint64_t kUs = 1000, kMs = 1000 * kUs;
constexpr uint64_t kSimTickNs = 1000;  // simgpu's %globaltimer tick (simgpu/src/probe_twin.h)

#define CU_OK(x)                                                        \
  do {                                                                  \
    const CUresult r_ = (x);                                            \
    const char* n_ = nullptr;                                           \
    cuGetErrorName(r_, &n_);                                            \
    ASSERT_EQ(r_, CUDA_SUCCESS) << #x << ": " << (n_ ? n_ : "?");       \
  } while (0)

// ---------------------------------------------------------------------------------------------
// The fatbin

struct Entry {
  uint16_t kind;  // 1 PTX, 2 ELF
  uint32_t arch;  // 80, 90, 100
  std::string payload;
};

// The fatbin container: a 16-byte header (magic 0xBA55ED50, version, header size, payload size),
// then entries, each with its own header: kind at +0, header size at +4, payload size at +8, the
// SM architecture at +28 (as simgpu/src/driver/fatbin.cpp reads them).
std::vector<Entry> fatbinEntries(const std::string& d, std::string* why) {
  std::vector<Entry> out;
  auto u32 = [&](size_t o) { uint32_t v; std::memcpy(&v, d.data() + o, 4); return v; };
  auto u64 = [&](size_t o) { uint64_t v; std::memcpy(&v, d.data() + o, 8); return v; };
  if (d.size() < 16 || u32(0) != 0xBA55ED50u) return *why = "not a fatbin (magic)", out;
  const size_t hs = d[6] | (d[7] << 8);
  const size_t end = hs + u64(8);
  if (end > d.size()) return *why = "payload size past the file", out;
  for (size_t off = hs; off + 32 <= end;) {
    Entry e;
    std::memcpy(&e.kind, d.data() + off, 2);
    const uint32_t ehs = u32(off + 4);
    const uint64_t ps = u64(off + 8);
    e.arch = u32(off + 28);
    if (ehs < 32 || off + ehs + ps > end) return *why = "entry past the container", out;
    e.payload = d.substr(off + ehs, ps);
    out.push_back(std::move(e));
    off += ehs + ps;
  }
  return out;
}

std::string readFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

TEST(Fatbin, HoldsSassForEachArchAndPtxWithTheThreeKernels) {
  const std::string d = readFile(PROBES_FATBIN);
  ASSERT_FALSE(d.empty()) << PROBES_FATBIN;
  std::string why;
  const std::vector<Entry> es = fatbinEntries(d, &why);
  ASSERT_TRUE(why.empty()) << why;
  std::set<uint32_t> elf, ptx;
  for (const Entry& e : es) {
    if (e.kind == 2) {
      elf.insert(e.arch);
      EXPECT_EQ(e.payload.compare(0, 4, "\x7f" "ELF"), 0) << "sm_" << e.arch << " is not a cubin (compressed?)";
      // Kernel symbols are NUL-terminated names in the cubin's string table.
      for (const char* k : {kSmProbeName, kMemProbeName, kTickProbeName})
        EXPECT_NE(e.payload.find(std::string(k) + '\0'), std::string::npos) << k << " missing in sm_" << e.arch;
    } else if (e.kind == 1) {
      ptx.insert(e.arch);
      for (const char* k : {kSmProbeName, kMemProbeName, kTickProbeName})
        EXPECT_NE(e.payload.find(std::string(".entry ") + k + "("), std::string::npos)
            << k << " missing in compute_" << e.arch << " PTX";
    }
  }
  EXPECT_EQ(elf, (std::set<uint32_t>{80, 90, 100}));
  EXPECT_EQ(ptx, (std::set<uint32_t>{80}));
}

TEST(Fatbin, CuobjdumpListsEachArch) {
  const std::string tool = "/usr/local/cuda/bin/cuobjdump";
  if (access(tool.c_str(), X_OK) != 0)
    GTEST_SKIP() << tool << " is not installed here (this toolkit has no cuobjdump); the container test above "
                 << "checks the same from the fatbin's own headers";
  auto run = [&](const std::string& opt) {
    std::string out;
    FILE* p = popen((tool + " " + opt + " " + PROBES_FATBIN + " 2>&1").c_str(), "r");
    if (!p) return out;
    char b[512];
    while (fgets(b, sizeof b, p)) out += b;
    pclose(p);
    return out;
  };
  const std::string elf = run("--list-elf"), ptx = run("--list-ptx");
  for (const char* a : {"sm_80", "sm_90", "sm_100"}) EXPECT_NE(elf.find(a), std::string::npos) << a << "\n" << elf;
  EXPECT_NE(ptx.find("sm_80"), std::string::npos) << ptx;
}

// ---------------------------------------------------------------------------------------------
// The runner on simgpu

// The primary context of device 0, current on this thread.
CUresult initCuda(CUcontext* ctx) {
  if (CUresult r = cuInit(0); r != CUDA_SUCCESS) return r;
  CUdevice dev;
  if (CUresult r = cuDeviceGet(&dev, 0); r != CUDA_SUCCESS) return r;
  if (CUresult r = cuDevicePrimaryCtxRetain(ctx, dev); r != CUDA_SUCCESS) return r;
  return cuCtxSetCurrent(*ctx);
}

RunnerOptions smallOptions() {
  RunnerOptions o;
  o.memBufferBytes = 16 << 20;  // simgpu memory is host memory: keep it small
  return o;
}

std::set<uint32_t> distinctSms(const ProbeRun& p) {
  std::set<uint32_t> s;
  for (const BlockRecord& r : p.records)
    if (r.flags & kProbeRan) s.insert(r.sm_start);
  return s;
}

// This process's ground truth on device 0 (the board's counters; zero if it is not there).
simgpu::ProcessDeviceStats groundTruth() {
  static simgpu::Board* b = [] {
    std::string err;
    simgpu::Board* x = simgpu::openBoard(std::getenv("SIMGPU_STATE_DIR"), 0, &err);
    EXPECT_NE(x, nullptr) << err;
    return x;
  }();
  simgpu::ProcessDeviceStats me;
  if (b) simgpu::forEachProcess(*b, [&](const simgpu::ProcessDeviceStats& p) {
    if (p.pid == getpid()) me = p;
  });
  return me;
}

double timeScale() {
  const char* s = std::getenv("SIMGPU_TIME_SCALE");
  return s ? std::atof(s) : 1.0;
}
// The device time (simgpu's engine clock) of a CLOCK_MONOTONIC reading of the runner.
uint64_t deviceTimeOf(uint64_t monotonicNs) { return static_cast<uint64_t>(static_cast<double>(monotonicNs) / timeScale()); }

// The GPU cost of a round (roundCostUs, probe_runner.h): a block holds one SM at most, so this
// bounds the SM-time the round took from other tenants, as if each block had a whole SM to itself.
class Runner : public ::testing::Test {
 protected:
  void SetUp() override {
    CU_OK(initCuda(&ctx_));
    const ProbeError e = ProbeRunner::load(PROBES_FATBIN, opts_, &runner_);
    ASSERT_FALSE(e) << e.message();
    ASSERT_TRUE(runner_);
  }
  RunnerOptions opts_ = smallOptions();
  CUcontext ctx_ = nullptr;
  std::unique_ptr<ProbeRunner> runner_;
};

using Alone = Runner;

TEST_F(Alone, EveryBlockRunsItsWholeBudgetOnItsOwnSmAndTheTickIsSimgpus) {
  const uint32_t sms = runner_->smCount();
  int sm = 0;
  CUdevice dev;
  CU_OK(cuCtxGetDevice(&dev));
  CU_OK(cuDeviceGetAttribute(&sm, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev));
  ASSERT_EQ(sms, static_cast<uint32_t>(sm));
  const simgpu::ProcessDeviceStats before = groundTruth();
  const ProbeBudgets budget{200 * kUs, 150 * kUs, 100 * kUs};
  RoundRecords r;
  const ProbeError e = runner_->runRound(nullptr, kRunAll, budget, &r);
  ASSERT_FALSE(e) << e.message();
  const simgpu::ProcessDeviceStats after = groundTruth();
  ASSERT_EQ(r.sm.records.size(), sms);
  ASSERT_EQ(r.mem.records.size(), 2 * sms);
  ASSERT_EQ(r.tick.records.size(), 1u);
  for (const ProbeRun* p : {&r.tick, &r.sm, &r.mem}) {
    SCOPED_TRACE(p->kind);
    for (const BlockRecord& b : p->records) {
      EXPECT_EQ(b.flags, kProbeRan);  // ran, on time, never moved, arguments good
      EXPECT_EQ(b.start_ns % kSimTickNs, 0u);
      EXPECT_EQ(b.end_ns % kSimTickNs, 0u);
      // Alone, every block starts with the first and works until the time box ends.
      EXPECT_EQ(b.end_ns - b.start_ns, p->budgetNs);
      EXPECT_EQ(b.gap_ns, 0u);
      EXPECT_GT(b.work, 0u);
      EXPECT_GT(b.cycles, 0u);
      EXPECT_EQ(b.sm_end, b.sm_start);
      EXPECT_LT(b.sm_start, sms);
    }
  }
  EXPECT_EQ(distinctSms(r.sm).size(), sms);
  EXPECT_EQ(distinctSms(r.mem).size(), sms);
  EXPECT_EQ(r.tick.records[0].tick_ns, kSimTickNs);
  EXPECT_EQ(r.tick.records[0].max_gap_ns, kSimTickNs);
  // Probes run back to back in the stream: tick, then SM, then memory.
  EXPECT_LE(r.tick.records[0].end_ns, r.sm.records[0].start_ns);
  EXPECT_LE(r.sm.records[0].end_ns, r.mem.records[0].start_ns);
  // The device's own accounting: every probe block ran, for as long as the records say.
  EXPECT_EQ(after.blocksRun - before.blocksRun, 3 * sms + 1);
  EXPECT_EQ(after.kernelsRun - before.kernelsRun, 3u);
  EXPECT_GE(after.busyNs - before.busyNs, 450 * kUs);
  EXPECT_LE(after.busyNs - before.busyNs, 450 * kUs + 3 * kSimTickNs);
  EXPECT_EQ(after.slicedOutNs, before.slicedOutNs);
  const double cost = roundCostUs(r, sms);
  std::printf("round cost: %.1f us of whole-device time (budgets 100 + 200 + 150 us)\n", cost);
  EXPECT_LT(cost, 1000.0);
  // The same on a stream of the application's own (not the default one).
  CUstream st;
  CU_OK(cuStreamCreate(&st, CU_STREAM_NON_BLOCKING));
  const ProbeError e2 = runner_->runRound(st, kRunTick | kRunSm, budget, &r);
  ASSERT_FALSE(e2) << e2.message();
  EXPECT_EQ(r.sm.records.size(), sms);
  EXPECT_EQ(r.mem.blocks, 0u);
  EXPECT_TRUE(r.mem.records.empty());
  for (const BlockRecord& b : r.sm.records) EXPECT_EQ(b.end_ns - b.start_ns, budget.smNs);
  CU_OK(cuStreamDestroy(st));
}

TEST_F(Alone, BlocksThatStartAfterTheDeadlineAreLateAndDoNoWork) {
  // Three 1024-thread blocks per SM, two fit: the third wave starts when the first ends, at the
  // deadline.
  RunnerOptions o = smallOptions();
  o.smThreads = 1024;
  o.smBlocksPerSm = 3;
  std::unique_ptr<ProbeRunner> waves;
  ProbeError e = ProbeRunner::load(PROBES_FATBIN, o, &waves);
  ASSERT_FALSE(e) << e.message();
  RoundRecords r;
  e = waves->runRound(nullptr, kRunSm, ProbeBudgets{100 * kUs, 1, 1}, &r);
  ASSERT_FALSE(e) << e.message();
  const uint32_t sms = waves->smCount();
  ASSERT_EQ(r.sm.records.size(), 3 * sms);
  uint64_t t0 = UINT64_MAX;
  for (const BlockRecord& b : r.sm.records) t0 = std::min(t0, b.start_ns);
  uint32_t late = 0;
  for (const BlockRecord& b : r.sm.records) {
    if (b.flags & kProbeLate) {
      EXPECT_EQ(b.flags, kProbeLate);  // late, not ran: it did no work
      ++late;
      EXPECT_GE(b.start_ns, t0 + 100 * kUs);
      EXPECT_EQ(b.work, 0u);
      EXPECT_LE(b.end_ns - b.start_ns, kSimTickNs);
    } else {
      EXPECT_EQ(b.flags, kProbeRan);
      EXPECT_EQ(b.start_ns, t0);
      EXPECT_GT(b.work, 0u);
    }
  }
  EXPECT_EQ(late, sms);
  EXPECT_EQ(r.sm.records.size(), 3u * sms);
  EXPECT_FALSE(r.tick.blocks || r.mem.blocks);  // only what was asked ran
}

// A runner knows whether its memory is still its own (the buffer id the driver gave its first
// allocation): after its context is reset, and after a new context takes the old one's handle and
// allocates, it is not, and abandon() forgets every handle so that nothing is freed twice (the
// shim's probe thread, when another thread of the program made the context anew under it).
TEST_F(Alone, ARunnerKnowsWhenItsMemoryIsNoLongerItsOwn) {
  EXPECT_TRUE(runner_->ownsItsMemory());
  CUdevice dev;
  CU_OK(cuDeviceGet(&dev, 0));
  CU_OK(cuDevicePrimaryCtxReset(dev));
  EXPECT_FALSE(runner_->ownsItsMemory()) << "its memory went with the reset";
  CUcontext again;
  CU_OK(cuDevicePrimaryCtxRetain(&again, dev));
  CU_OK(cuCtxSetCurrent(again));
  std::vector<CUdeviceptr> fresh(8);
  for (CUdeviceptr& p : fresh) CU_OK(cuMemAlloc(&p, 64));
  EXPECT_FALSE(runner_->ownsItsMemory()) << "a new allocation at its old address is not its own";
  runner_->abandon();
  EXPECT_FALSE(runner_->ownsItsMemory());
  runner_.reset();  // makes no driver call: the new context's memory is untouched
  unsigned long long id = 0;
  for (CUdeviceptr p : fresh) {
    EXPECT_EQ(cuPointerGetAttribute(&id, CU_POINTER_ATTRIBUTE_BUFFER_ID, p), CUDA_SUCCESS);
    CU_OK(cuMemFree(p));
  }
  CU_OK(cuDevicePrimaryCtxRelease(dev));
}

TEST_F(Alone, BadArgumentsFlagTheFirstRecordOnly) {
  std::vector<char> image;
  {
    const std::string d = readFile(PROBES_FATBIN);
    image.assign(d.begin(), d.end());
  }
  CUmodule m;
  CU_OK(cuModuleLoadData(&m, image.data()));
  CUfunction sm;
  CU_OK(cuModuleGetFunction(&sm, m, kSmProbeName));
  CUdeviceptr t0, recs;
  CU_OK(cuMemAlloc(&t0, 8));
  CU_OK(cuMemAlloc(&recs, 4 * sizeof(BlockRecord)));
  auto launch = [&](ProbeArgs a, unsigned grid) {
    EXPECT_EQ(cuMemsetD8(recs, 0, 4 * sizeof(BlockRecord)), CUDA_SUCCESS);
    EXPECT_EQ(cuMemsetD8(t0, 0, 8), CUDA_SUCCESS);
    void* p[] = {&a};
    EXPECT_EQ(cuLaunchKernel(sm, grid, 1, 1, 64, 1, 1, 0, nullptr, p, nullptr), CUDA_SUCCESS);
    EXPECT_EQ(cuCtxSynchronize(), CUDA_SUCCESS);
    std::vector<BlockRecord> out(4);
    EXPECT_EQ(cuMemcpyDtoH(out.data(), recs, 4 * sizeof(BlockRecord)), CUDA_SUCCESS);
    return out;
  };
  ProbeArgs good{};
  good.abi_version = kProbeAbiVersion;
  good.kind = kProbeSm;
  good.budget_ns = 20 * kUs;
  good.t0 = t0;
  good.records = recs;
  good.record_count = 4;
  good.work_per_step = 64;
  std::vector<BlockRecord> out = launch(good, 4);
  for (const BlockRecord& b : out) EXPECT_EQ(b.flags, kProbeRan);
  uint64_t t0v = 0;
  CU_OK(cuMemcpyDtoH(&t0v, t0, 8));
  EXPECT_EQ(t0v, out[0].start_ns);  // the first block's start, as the CAS leaves it
  ProbeArgs version = good;
  version.abi_version = kProbeAbiVersion + 1;
  ProbeArgs kind = good;
  kind.kind = kProbeMem;
  ProbeArgs count = good;
  count.record_count = 3;
  ProbeArgs steps = good;
  steps.work_per_step = 0;
  for (const ProbeArgs& bad : {version, kind, count, steps}) {
    out = launch(bad, 4);
    EXPECT_EQ(out[0].flags, kProbeBadArgs);
    EXPECT_EQ(out[0].start_ns, 0u);
    for (int i = 1; i < 4; ++i) EXPECT_EQ(out[i].flags, 0u) << i;
  }
  CU_OK(cuMemFree(t0));
  CU_OK(cuMemFree(recs));
  CU_OK(cuModuleUnload(m));
}

TEST(RunnerErrors, NameTheStepAndTheCause) {
  CUcontext ctx;
  CU_OK(initCuda(&ctx));
  std::unique_ptr<ProbeRunner> r;
  ProbeError e = ProbeRunner::load("/nonexistent/probes.fatbin", smallOptions(), &r);
  EXPECT_TRUE(e);
  EXPECT_FALSE(r);
  EXPECT_NE(e.message().find("open probe fatbin"), std::string::npos) << e.message();
  EXPECT_NE(e.message().find("No such file"), std::string::npos) << e.message();
  RunnerOptions odd = smallOptions();
  odd.smThreads = 100;  // not whole warps
  e = ProbeRunner::load(PROBES_FATBIN, odd, &r);
  EXPECT_NE(e.message().find("CUDA_ERROR_INVALID_VALUE"), std::string::npos) << e.message();
  e = ProbeRunner::load(PROBES_FATBIN, smallOptions(), &r);
  ASSERT_FALSE(e) << e.message();
  RoundRecords out;
  e = r->runRound(nullptr, 0, ProbeBudgets{}, &out);
  EXPECT_NE(e.message().find("runRound arguments: CUDA_ERROR_INVALID_VALUE"), std::string::npos) << e.message();
  e = r->runRound(nullptr, kRunSm, ProbeBudgets{0, 1, 1}, &out);
  EXPECT_TRUE(e);
  // Without a current context nothing is loaded.
  CUcontext none;
  CU_OK(cuCtxPopCurrent(&none));
  CUcontext cur = nullptr;
  CU_OK(cuCtxGetCurrent(&cur));
  if (cur == nullptr) {
    std::unique_ptr<ProbeRunner> r2;
    e = ProbeRunner::load(PROBES_FATBIN, smallOptions(), &r2);
    EXPECT_NE(e.message().find("no current context"), std::string::npos) << e.message();
  }
  // The runner pushes its own context: a round works from a thread with none current.
  e = r->runRound(nullptr, kRunTick, ProbeBudgets{}, &out);
  EXPECT_FALSE(e) << e.message();
  CU_OK(cuCtxSetCurrent(ctx));
}

// ---------------------------------------------------------------------------------------------
// Next to a hog (time slicing): a plain process of simgpu_mps_hog keeps every SM busy with 1 ms
// blocks; the device alternates between it and this process in slices (SIMGPU_TIME_SLICE_US).

using cushare::simhog::Hog;

class TimeSliced : public Runner {
 protected:
  void SetUp() override {
    if (!std::getenv("SIMGPU_KERNEL_COSTS")) GTEST_SKIP() << "registered with SIMGPU_KERNEL_COSTS=probes.costs";
    const char* slice = std::getenv("SIMGPU_TIME_SLICE_US");
    sliceNs_ = (slice ? std::strtoull(slice, nullptr, 10) : 2000) * kUs;
    Runner::SetUp();
    ASSERT_TRUE(hog_.start(HOG_BIN, runner_->smCount())) << "the hog did not start";
  }
  uint64_t sliceNs_ = 0;
  Hog hog_;
};

// A round whose time box spans several slices: its blocks are saved out while the hog holds the
// device, and the records' gaps are that time, as the device's own accounting says.
TEST_F(TimeSliced, GapsAreTheTimeTheHogHeldTheDevice) {
  const uint32_t sms = runner_->smCount();
  const uint64_t box = 3 * sliceNs_;
  RoundRecords r;
  simgpu::ProcessDeviceStats before, after;
  // Precondition (not the result): this process had the CPU to launch promptly. On a loaded host
  // a round may start late in its window; then the round is taken again, up to 5 times.
  for (int attempt = 0; attempt < 5; ++attempt) {
    before = groundTruth();
    const ProbeError e = runner_->runRound(nullptr, kRunTick, ProbeBudgets{1, 1, box}, &r);
    ASSERT_FALSE(e) << e.message();
    after = groundTruth();
    if (r.tick.records[0].gap_ns > 0) break;
    std::printf("the tick probe was never sliced out (attempt %d): measuring again\n", attempt);
  }
  const BlockRecord& t = r.tick.records[0];
  ASSERT_EQ(t.flags & (kProbeRan | kProbeLate), kProbeRan);
  const uint64_t span = t.end_ns - t.start_ns;
  const uint64_t resident = span - t.gap_ns;
  std::printf("tick probe: span %llu us, gaps %llu us (largest %llu us), resident %llu us; slice %llu us\n",
              (unsigned long long)(span / kUs), (unsigned long long)(t.gap_ns / kUs),
              (unsigned long long)(t.max_gap_ns / kUs), (unsigned long long)(resident / kUs),
              (unsigned long long)(sliceNs_ / kUs));
  // At least one of the hog's slices fell inside the box, and the largest gap is one slice of
  // the hog (plus the switches), not more than two.
  EXPECT_GE(t.gap_ns, sliceNs_);
  EXPECT_GE(t.max_gap_ns, sliceNs_);
  EXPECT_LE(t.max_gap_ns, 2 * sliceNs_);
  EXPECT_EQ(t.tick_ns, kSimTickNs);
  // Ground truth: the probe's block was this process's only work, so the time it was resident is
  // the process's busy time (to the timer's tick at each end of each residency)...
  const uint64_t busy = after.busyNs - before.busyNs;
  EXPECT_NEAR(static_cast<double>(resident), static_cast<double>(busy), 4.0 * kSimTickNs + 0.02 * busy);
  // ...and its gaps are time the process was sliced out (which also counts the wait before it started).
  const uint64_t out = after.slicedOutNs - before.slicedOutNs;
  EXPECT_GE(static_cast<double>(out), static_cast<double>(t.gap_ns) - 4.0 * kSimTickNs);
  const uint64_t startDelay = t.start_ns - std::min(t.start_ns, deviceTimeOf(r.tick.launchMonotonicNs));
  EXPECT_LE(static_cast<double>(out), static_cast<double>(t.gap_ns + startDelay) + 4.0 * kSimTickNs + 0.05 * out);
  (void)sms;
}

// An SM probe whose box is longer than a slice: every block starts in this process's window (all
// fit at once: none is late), is saved at the window's end, and resumes after the hog's slice, past
// its deadline, only to finish: resident for about one slice, one gap of about one hog slice.
TEST_F(TimeSliced, SmBlocksAllStartInOneWindowAndAreCutByTheHogsSlice) {
  const uint32_t sms = runner_->smCount();
  RoundRecords r;
  const ProbeError e = runner_->runRound(nullptr, kRunSm, ProbeBudgets{sliceNs_ + sliceNs_ / 2, 1, 1}, &r);
  ASSERT_FALSE(e) << e.message();
  ASSERT_EQ(r.sm.records.size(), sms);
  uint64_t first = UINT64_MAX, last = 0;
  for (const BlockRecord& b : r.sm.records) {
    ASSERT_EQ(b.flags & (kProbeRan | kProbeLate | kProbeBadArgs), kProbeRan);
    first = std::min(first, b.start_ns);
    last = std::max(last, b.start_ns);
  }
  EXPECT_EQ(first, last);  // one window, one dispatch
  uint32_t cut = 0;
  for (const BlockRecord& b : r.sm.records) {
    const uint64_t resident = b.end_ns - b.start_ns - b.gap_ns;
    if (b.gap_ns == 0) continue;  // the box ended inside the window it started in
    ++cut;
    EXPECT_GE(b.max_gap_ns, sliceNs_);
    EXPECT_LE(resident, sliceNs_ + 2 * kSimTickNs);
  }
  // On a loaded host the window may start late enough that the box ends inside it: then no block
  // is cut (a precondition, not the result), which is at least consistent.
  if (cut) {
    EXPECT_EQ(cut, sms);
  }
  std::printf("SM probe: %u of %u blocks cut by the hog's slice\n", cut, sms);
}

// The GPU cost of a whole round stays under 1 ms of whole-device time (roundCostUs) however the
// device is contended: time-boxed blocks cut by a slice stop at their deadline.
TEST_F(TimeSliced, ARoundCostsUnderAMillisecondOfDeviceTime) {
  double worst = 0;
  for (int i = 0; i < 5; ++i) {
    RoundRecords r;
    const ProbeError e = runner_->runRound(nullptr, kRunAll, ProbeBudgets{}, &r);
    ASSERT_FALSE(e) << e.message();
    worst = std::max(worst, roundCostUs(r, runner_->smCount()));
    for (const ProbeRun* p : {&r.tick, &r.sm, &r.mem}) ASSERT_EQ(p->records.size(), p->blocks);
  }
  std::printf("round cost next to the hog (default budgets 100 + 200 + 150 us): worst of 5 %.1f us\n", worst);
  EXPECT_LT(worst, 1000.0);
  EXPECT_GT(worst, 0.0);
}

// Launch-to-start: each round waits for the hog's slice to end, so the tick probe's start
// follows its launch by up to one slice (plus a switch); alone it is much shorter.
TEST_F(TimeSliced, LaunchToStartReflectsTheSlices) {
  std::vector<double> waits;
  for (int i = 0; i < 12; ++i) {
    RoundRecords r;
    const ProbeError e = runner_->runRound(nullptr, kRunTick, ProbeBudgets{1, 1, 50 * kUs}, &r);
    ASSERT_FALSE(e) << e.message();
    const BlockRecord& t = r.tick.records[0];
    const uint64_t launched = deviceTimeOf(r.tick.launchMonotonicNs);
    waits.push_back(t.start_ns > launched ? static_cast<double>(t.start_ns - launched) : 0.0);
    usleep(static_cast<useconds_t>((i % 3 + 1) * 700 * timeScale()));  // another phase of the slices
  }
  std::sort(waits.begin(), waits.end());
  const double median = waits[waits.size() / 2], longest = waits.back();
  std::printf("launch to start next to the hog: median %.0f us, longest %.0f us (slice %llu us)\n", median / 1e3,
              longest / 1e3, (unsigned long long)(sliceNs_ / kUs));
  // Most launches wait for the hog's slice (a launch in this process's own window is rare: it
  // releases the device as soon as a round ends)...
  EXPECT_GE(longest, 0.5 * sliceNs_);
  EXPECT_GE(median, 0.1 * sliceNs_);
}

// ---------------------------------------------------------------------------------------------
// SM caps: an MPS client with an active thread percentage, and SIMGPU_TEST_SM_CAP.

// Child: a probe whose records point at host memory: the kernel's illegal access, the process's
// sticky CUDA_ERROR_ILLEGAL_ADDRESS; prints the results of the synchronisation and a later call.
int childIllegal() {
  CUcontext ctx;
  if (initCuda(&ctx) != CUDA_SUCCESS) return 1;
  const std::string d = readFile(PROBES_FATBIN);
  CUmodule m;
  CUfunction f;
  CUdeviceptr t0;
  if (cuModuleLoadData(&m, d.data()) != CUDA_SUCCESS || cuModuleGetFunction(&f, m, kTickProbeName) != CUDA_SUCCESS ||
      cuMemAlloc(&t0, 8) != CUDA_SUCCESS)
    return 1;
  static BlockRecord host[1];
  ProbeArgs a{};
  a.abi_version = kProbeAbiVersion;
  a.kind = kProbeTick;
  a.budget_ns = 10 * kUs;
  a.t0 = t0;
  a.records = reinterpret_cast<uint64_t>(host);
  a.record_count = 1;
  void* p[] = {&a};
  const CUresult launched = cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, nullptr, p, nullptr);
  const CUresult synced = cuCtxSynchronize();
  CUdeviceptr x;
  const CUresult later = cuMemAlloc(&x, 64);
  std::printf("launch %d sync %d later %d written %u\n", launched, synced, later, host[0].flags);
  return 0;
}

// Child: one round of the SM probe with 4 blocks per SM; prints what it saw.
int childMain() {
  CUcontext ctx;
  if (CUresult r = initCuda(&ctx); r != CUDA_SUCCESS) {
    std::printf("error init %d\n", r);
    return 1;
  }
  RunnerOptions o = smallOptions();
  o.smBlocksPerSm = 4;
  std::unique_ptr<ProbeRunner> runner;
  ProbeError e = ProbeRunner::load(PROBES_FATBIN, o, &runner);
  RoundRecords r;
  // PROBE_BOX_US: both probes' time box (default 100 us SM, 50 us tick).
  const char* box = std::getenv("PROBE_BOX_US");
  const uint64_t boxNs = box ? std::strtoull(box, nullptr, 10) * kUs : 0;
  if (!e) e = runner->runRound(nullptr, kRunSm | kRunTick, ProbeBudgets{boxNs ? boxNs : 100 * kUs, 1, boxNs ? boxNs : 50 * kUs}, &r);
  if (e) {
    std::printf("error %s\n", e.message().c_str());
    return 1;
  }
  uint32_t ran = 0, late = 0, smax = 0;
  uint64_t gaps = r.tick.records[0].gap_ns, first = UINT64_MAX, last = 0;
  for (const BlockRecord& b : r.sm.records) {
    ran += (b.flags & kProbeRan) != 0;
    late += (b.flags & kProbeLate) != 0;
    smax = std::max(smax, b.sm_start);
    gaps += b.gap_ns;
    first = std::min(first, b.start_ns);
    last = std::max(last, b.start_ns);
  }
  const uint64_t launched = deviceTimeOf(r.tick.launchMonotonicNs), started = r.tick.records[0].start_ns;
  std::printf("sms %u blocks %zu distinct %zu ran %u late %u tick %llu smax %u gaps %llu spread %llu wait %llu\n",
              runner->smCount(), r.sm.records.size(), distinctSms(r.sm).size(), ran, late,
              (unsigned long long)r.tick.records[0].tick_ns, smax, (unsigned long long)gaps, (unsigned long long)(last - first),
              (unsigned long long)(started > launched ? started - launched : 0));
  return 0;
}

struct ChildResult {
  int rc = -1;
  std::map<std::string, uint64_t> v;
  std::string out;
};

ChildResult runChild(const std::vector<std::string>& env, const char* mode = "--child") {
  ChildResult res;
  int o[2];
  if (pipe2(o, O_CLOEXEC)) return res;
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(o[1], 1);
    for (const std::string& e : env) putenv(const_cast<char*>(e.c_str()));
    execl("/proc/self/exe", "probes_child", mode, static_cast<char*>(nullptr));
    _exit(127);
  }
  ::close(o[1]);
  char b[512];
  ssize_t n;
  while ((n = read(o[0], b, sizeof b)) > 0) res.out.append(b, static_cast<size_t>(n));
  ::close(o[0]);
  int st = 0;
  waitpid(pid, &st, 0);
  res.rc = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  std::istringstream in(res.out);
  std::string k;
  uint64_t x;
  while (in >> k >> x) res.v[k] = x;
  return res;
}

// Runs nvidia-cuda-mps-control with stdin `input`; its stdout.
std::string control(const std::string& input, const std::vector<std::string>& args = {}) {
  std::string cmd = std::string(MPS_BIN) + "/nvidia-cuda-mps-control";
  for (const std::string& a : args) cmd += " " + a;
  std::string out;
  const std::string tmp = std::string(std::getenv("SIMGPU_STATE_DIR")) + "-mps-input";
  { std::ofstream(tmp) << input; }
  FILE* p = popen((cmd + " < " + tmp + " 2>&1").c_str(), "r");
  if (!p) return out;
  char b[256];
  while (fgets(b, sizeof b, p)) out += b;
  pclose(p);
  return out;
}

// A simulated MPS daemon in a directory of this test's own, quit at the end of the scope.
struct MpsDaemon {
  std::string root = std::string(std::getenv("SIMGPU_STATE_DIR")) + "-mps";
  bool up = false;
  MpsDaemon() {
    (void)!system(("rm -rf " + root + " && mkdir -p " + root + "/pipe " + root + "/log").c_str());
    setenv("CUDA_MPS_PIPE_DIRECTORY", (root + "/pipe").c_str(), 1);
    setenv("CUDA_MPS_LOG_DIRECTORY", (root + "/log").c_str(), 1);
    const std::string started = control("", {"-d"});
    up = access((root + "/pipe/control").c_str(), F_OK) == 0;
    EXPECT_TRUE(up) << started;
  }
  ~MpsDaemon() {
    control("quit\n");
    for (int i = 0; i < 100 && access((root + "/pipe/control").c_str(), F_OK) == 0; ++i) usleep(20000);
    while (waitpid(-1, nullptr, WNOHANG) > 0) {
    }
    unsetenv("CUDA_MPS_PIPE_DIRECTORY");
  }
};

TEST(SmCap, AnMpsClientsSmProbeSpreadsOverExactlyItsCap) {
  ChildResult c;
  {
    MpsDaemon d;
    ASSERT_TRUE(d.up);
    EXPECT_EQ(control("set_default_active_thread_percentage 25\n"), "25.0\n");
    c = runChild({});
  }
  ASSERT_EQ(c.rc, 0) << c.out;
  // 25 % of 132 SMs: ceil(33) rounded up to a pair = 34, the multiprocessor count it sees; 4 blocks
  // per SM, all fit at once; they spread over the cap's SMs, no more (virtual ids, one client).
  const uint64_t sms = c.v.at("sms");
  EXPECT_EQ(sms, 34u) << c.out;
  EXPECT_EQ(c.v.at("blocks"), 4 * sms) << c.out;
  EXPECT_EQ(c.v.at("ran"), 4 * sms) << c.out;
  EXPECT_EQ(c.v.at("late"), 0u) << c.out;
  EXPECT_EQ(c.v.at("distinct"), sms) << c.out;
  EXPECT_EQ(c.v.at("tick"), kSimTickNs) << c.out;
  EXPECT_LT(c.v.at("smax"), 132u) << c.out;
}

// Under MPS a hog client does not take turns with the probe: they run side by side (the hog's
// 768-thread blocks leave 512 threads of each SM), so the probe starts at once, its blocks all
// together on its cap's SMs, and is never saved out during a box of 3 slices (contrast
// TimeSliced.*, the same hog outside MPS).
TEST(SmCap, NextToAnMpsHogClientTheProbeRunsSideBySideNeverSlicedOut) {
  if (!std::getenv("SIMGPU_KERNEL_COSTS")) GTEST_SKIP() << "registered with SIMGPU_KERNEL_COSTS=probes.costs";
  ChildResult c;
  {
    MpsDaemon d;
    ASSERT_TRUE(d.up);
    Hog hog;
    ASSERT_TRUE(hog.start(HOG_BIN, 132, {"CUDA_MPS_PIPE_DIRECTORY=" + d.root + "/pipe"}, 768))
        << "the hog did not start";
    // The hog is a client of the server the probe's client joins (not a process taking turns).
    const std::string server = control("get_server_list\n");
    EXPECT_EQ(control("get_client_list " + server), std::to_string(hog.pid) + "\n");
    // A box of 3 slices: outside MPS it would be cut by the hog's slices (TimeSliced.*).
    c = runChild({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25", "PROBE_BOX_US=6000"});
    std::printf("probe client next to the hog client: %s", c.out.c_str());
  }
  ASSERT_EQ(c.rc, 0) << c.out;
  EXPECT_EQ(c.v.at("sms"), 34u) << c.out;
  EXPECT_EQ(c.v.at("ran"), 4 * 34u) << c.out;
  EXPECT_EQ(c.v.at("late"), 0u) << c.out;
  EXPECT_EQ(c.v.at("distinct"), 34u) << c.out;
  EXPECT_EQ(c.v.at("gaps"), 0u) << c.out;
  EXPECT_EQ(c.v.at("spread"), 0u) << c.out;
  // It started as soon as it reached the server (the host's delay only; SIMGPU_TIME_SCALE=4 keeps
  // that small in device time): with 1024-thread hog blocks, which fill the SMs, it waits for the
  // hog's kernels instead (about 19 ms measured).
  EXPECT_LT(c.v.at("wait"), 1 * kMs) << c.out;
}

TEST(SmCap, TheTestCapBoundsTheDistinctSmsOfAPlainProcess) {
  const ChildResult c = runChild({"CUDA_MPS_PIPE_DIRECTORY=/nonexistent", "SIMGPU_TEST_SM_CAP=20"});
  ASSERT_EQ(c.rc, 0) << c.out;
  EXPECT_EQ(c.v.at("sms"), 132u) << c.out;  // the attribute is the device's: only the placement is capped
  EXPECT_EQ(c.v.at("ran") + c.v.at("late"), 4 * 132u) << c.out;  // 20 SMs x 16 blocks fit: the rest are late
  EXPECT_EQ(c.v.at("ran"), 20 * 16u) << c.out;
  EXPECT_EQ(c.v.at("distinct"), 20u) << c.out;
}

TEST(RunnerErrors, RecordsOutsideDeviceMemoryAreTheKernelsIllegalAccess) {
  const ChildResult c = runChild({}, "--child-illegal");
  ASSERT_EQ(c.rc, 0) << c.out;
  EXPECT_EQ(c.v.at("launch"), static_cast<uint64_t>(CUDA_SUCCESS)) << c.out;
  EXPECT_EQ(c.v.at("sync"), static_cast<uint64_t>(CUDA_ERROR_ILLEGAL_ADDRESS)) << c.out;
  EXPECT_EQ(c.v.at("later"), static_cast<uint64_t>(CUDA_ERROR_ILLEGAL_ADDRESS)) << c.out;  // sticky, as a fault
  EXPECT_EQ(c.v.at("written"), 0u) << c.out;  // nothing written to memory it may not touch
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 2 && std::strcmp(argv[1], "--child") == 0) return childMain();
  if (argc >= 2 && std::strcmp(argv[1], "--child-illegal") == 0) return childIllegal();
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
