// One simulated device shared host-wide: processes see each other's allocations, and memory of a process that dies comes back.
//
// The parent is a GoogleTest program; its helpers are this same executable started again with
// `--child <mode> ...` (fork, then exec of /proc/self/exe: a child never inherits the parent's
// CUDA state). A child talks through fixed descriptors set up before exec:
//   3: the report pipe (the child writes lines: "ok", "err <code>", "ready", "count <n> <code>");
//   4: the go/quit pipe (the child blocks reading it; a byte or EOF moves it on);
// so a child whose parent dies sees EOF and exits instead of lingering.
//
// Two registrations: CrossProcess.* on the default 16 GiB device, DeviceFull.* with
// SIMGPU_MEMORY=1GiB.
#include <cuda.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "config.h"
#include "shared_state.h"
#include "simgpu/nvml.h"
#include "timeslice_board.h"

namespace {

constexpr size_t kMiB = size_t{1} << 20;
constexpr size_t kGiB = size_t{1} << 30;
constexpr int kReportFd = 3;
constexpr int kControlFd = 4;

// ---------------------------------------------------------------------------------------------
// Child side
CUresult childInit() {
  CUresult r = cuInit(0);
  CUcontext ctx = nullptr;
  if (r == CUDA_SUCCESS) r = cuDevicePrimaryCtxRetain(&ctx, 0);
  if (r == CUDA_SUCCESS) r = cuCtxSetCurrent(ctx);
  return r;
}

void report(const std::string& line) {
  const std::string l = line + "\n";
  (void)!write(kReportFd, l.data(), l.size());
}

// Blocks until the parent writes a byte or closes the pipe (or dies); returns the byte, 0 on EOF.
char awaitControl() {
  char c = 0;
  const ssize_t n = read(kControlFd, &c, 1);
  return n == 1 ? c : 0;
}

// hold <bytes>: allocate, report, wait; on 'f' free first, then exit normally.
int childHold(size_t bytes) {
  CUresult r = childInit();
  CUdeviceptr p = 0;
  if (r == CUDA_SUCCESS) r = cuMemAlloc(&p, bytes);
  if (r == CUDA_SUCCESS) {
    // Touch a little of it: the memory is real host memory of this process.
    static_cast<volatile char*>(reinterpret_cast<void*>(p))[0] = 1;
    report("ok");
  } else {
    report("err " + std::to_string(static_cast<int>(r)));
    return 1;
  }
  if (awaitControl() == 'f') cuMemFree(p);
  return 0;  // a normal exit, allocation (maybe) still held
}

// race <chunk>: initialise, wait for go, allocate chunks until refused, report, hold until quit.
int childRace(size_t chunk) {
  CUresult r = childInit();
  if (r != CUDA_SUCCESS) {
    report("err " + std::to_string(static_cast<int>(r)));
    return 1;
  }
  report("ready");
  awaitControl();  // go
  int count = 0;
  CUdeviceptr p = 0;
  while ((r = cuMemAlloc(&p, chunk)) == CUDA_SUCCESS) ++count;
  report("count " + std::to_string(count) + " " + std::to_string(static_cast<int>(r)));
  awaitControl();  // quit
  return 0;
}

// hog <kernels>: queue that many slice_hog kernels (1 block of 1024 threads; the cost table says
// how long) between two events once the parent says go, then report "elapsed <device us>".
int childHog(size_t kernels) {
  CUresult r = childInit();
  static const char kPtx[] = ".version 8.0\n.target sm_90\n.address_size 64\n";  // names nothing: any kernel loads
  CUmodule m = nullptr;
  CUfunction f = nullptr;
  CUstream s = nullptr;
  CUevent a = nullptr, b = nullptr;
  if (r == CUDA_SUCCESS) r = cuModuleLoadData(&m, kPtx);
  if (r == CUDA_SUCCESS) r = cuModuleGetFunction(&f, m, "slice_hog");
  if (r == CUDA_SUCCESS) r = cuStreamCreate(&s, CU_STREAM_NON_BLOCKING);
  if (r == CUDA_SUCCESS) r = cuEventCreate(&a, 0);
  if (r == CUDA_SUCCESS) r = cuEventCreate(&b, 0);
  if (r != CUDA_SUCCESS) {
    report("err " + std::to_string(static_cast<int>(r)));
    return 1;
  }
  report("ready");
  if (awaitControl() != 'g') return 0;
  cuEventRecord(a, s);
  for (size_t i = 0; i < kernels && r == CUDA_SUCCESS; ++i) r = cuLaunchKernel(f, 1, 1, 1, 1024, 1, 1, 0, s, nullptr, nullptr);
  cuEventRecord(b, s);
  float ms = -1;
  if (r == CUDA_SUCCESS) r = cuEventSynchronize(b);
  if (r == CUDA_SUCCESS) r = cuEventElapsedTime(&ms, a, b);
  report(r == CUDA_SUCCESS ? "elapsed " + std::to_string(static_cast<long long>(ms * 1000)) : "err " + std::to_string(static_cast<int>(r)));
  awaitControl();  // quit
  return 0;
}

// context: a primary context and nothing allocated ("primary"); on a byte, released ("released");
// on the next, a created context ("created"); on the next, destroyed ("destroyed"); then waits.
int childContext() {
  CUresult r = childInit();
  report(r == CUDA_SUCCESS ? "primary" : "err " + std::to_string(static_cast<int>(r)));
  awaitControl();
  r = cuDevicePrimaryCtxRelease(0);
  report(r == CUDA_SUCCESS ? "released" : "err " + std::to_string(static_cast<int>(r)));
  awaitControl();
  CUcontext c = nullptr;
  r = cuCtxCreate(&c, nullptr, 0, 0);
  report(r == CUDA_SUCCESS ? "created" : "err " + std::to_string(static_cast<int>(r)));
  awaitControl();
  r = cuCtxDestroy(c);
  report(r == CUDA_SUCCESS ? "destroyed" : "err " + std::to_string(static_cast<int>(r)));
  awaitControl();
  return 0;
}


// The CUDA 13 header maps cuMemPrefetchAsync and cuMemAdvise to their _v2 forms (a location);
// these take the legacy device ordinal (CU_DEVICE_CPU: the host).
CUmemLocation locationOf(int dev) {
  return dev == CU_DEVICE_CPU ? CUmemLocation{CU_MEM_LOCATION_TYPE_HOST, 0} : CUmemLocation{CU_MEM_LOCATION_TYPE_DEVICE, dev};
}
CUresult prefetch(CUdeviceptr p, size_t n, int dev) { return cuMemPrefetchAsync_v2(p, n, locationOf(dev), 0, nullptr); }
CUresult advise(CUdeviceptr p, size_t n, CUmem_advise a, int dev) { return cuMemAdvise_v2(p, n, a, locationOf(dev)); }

// managed <bytes>: allocate managed memory, write a pattern from the host, prefetch it to the
// device; report "ok". Then per control byte: 'c' reads it back through the device (a copy) and
// reports "intact" or "corrupt"; 'p' prefetches it to the device again ("ok"); 'h' to the host
// ("ok"); anything else (or EOF) exits.
uint32_t managedPattern(size_t i) { return static_cast<uint32_t>(i * 2654435761u) ^ 0x5a5a5a5au; }
int childManaged(size_t bytes) {
  CUresult r = childInit();
  CUdeviceptr m = 0;
  if (r == CUDA_SUCCESS) r = cuMemAllocManaged(&m, bytes, CU_MEM_ATTACH_GLOBAL);
  if (r == CUDA_SUCCESS) {
    auto* w = reinterpret_cast<uint32_t*>(m);
    for (size_t i = 0; i < bytes / 4; ++i) w[i] = managedPattern(i);
    r = prefetch(m, bytes, 0);
  }
  report(r == CUDA_SUCCESS ? "ok" : "err " + std::to_string(static_cast<int>(r)));
  if (r != CUDA_SUCCESS) return 1;
  while (true) {
    const char c = awaitControl();
    if (c == 'c') {
      std::vector<uint32_t> back(bytes / 4);
      r = cuMemcpyDtoH(back.data(), m, bytes);
      bool same = r == CUDA_SUCCESS;
      for (size_t i = 0; i < back.size() && same; ++i) same = back[i] == managedPattern(i);
      report(same ? "intact" : "corrupt");
    } else if (c == 'p' || c == 'h') {
      r = prefetch(m, bytes, c == 'p' ? 0 : CU_DEVICE_CPU);
      report(r == CUDA_SUCCESS ? "ok" : "err " + std::to_string(static_cast<int>(r)));
    } else {
      return 0;
    }
  }
}

int childMain(int argc, char** argv) {
  alarm(60);  // never outlive a broken test for long
  const std::string mode = argc > 2 ? argv[2] : "";
  const size_t bytes = argc > 3 ? std::strtoull(argv[3], nullptr, 10) : 0;
  if (mode == "hold") return childHold(bytes);
  if (mode == "race") return childRace(bytes);
  if (mode == "hog") return childHog(bytes);
  if (mode == "context") return childContext();
  if (mode == "managed") return childManaged(bytes);
  std::fprintf(stderr, "unknown child mode '%s'\n", mode.c_str());
  return 2;
}

// ---------------------------------------------------------------------------------------------
// Parent side
std::string& selfPath() {
  static std::string p = [] {
    char b[4096];
    const ssize_t n = readlink("/proc/self/exe", b, sizeof b - 1);
    return std::string(b, n > 0 ? static_cast<size_t>(n) : 0);
  }();
  return p;
}

struct Child {
  pid_t pid = -1;
  int report = -1;   // read end
  int control = -1;  // write end

  // Reads one line (without the newline); "" on EOF or after timeoutMs.
  std::string readLine(int timeoutMs = 20000) {
    std::string line;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeoutMs);
    while (true) {
      const int left = static_cast<int>(
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count());
      if (left <= 0) return line;
      pollfd pfd{report, POLLIN, 0};
      if (poll(&pfd, 1, left) <= 0) return line;
      char c;
      if (read(report, &c, 1) != 1) return line;
      if (c == '\n') return line;
      line += c;
    }
  }
  void send(char c) { (void)!write(control, &c, 1); }
  void closeControl() {
    if (control >= 0) close(control);
    control = -1;
  }
  int wait() {
    int status = -1;
    if (pid > 0) waitpid(pid, &status, 0);
    pid = -1;
    if (report >= 0) close(report);
    report = -1;
    closeControl();
    return status;
  }
  void kill9() {
    if (pid > 0) kill(pid, SIGKILL);
  }
  ~Child() {
    if (pid > 0) {
      kill9();
      wait();
    }
  }
};

// Starts this executable as a child: --child <args...>.
void spawn(Child* c, const std::vector<std::string>& args) {
  int rep[2], ctl[2];
  ASSERT_EQ(pipe2(rep, O_CLOEXEC), 0);
  ASSERT_EQ(pipe2(ctl, O_CLOEXEC), 0);
  std::vector<std::string> strs = {selfPath(), "--child"};
  strs.insert(strs.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& s : strs) argv.push_back(s.data());
  argv.push_back(nullptr);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    // Only async-signal-safe calls until exec. Move the two ends out of the way, then into place;
    // dup2 clears close-on-exec on the copies, every other descriptor closes at exec.
    const int r = fcntl(rep[1], F_DUPFD_CLOEXEC, 100);
    const int w = fcntl(ctl[0], F_DUPFD_CLOEXEC, 100);
    if (r < 0 || w < 0 || dup2(r, kReportFd) < 0 || dup2(w, kControlFd) < 0) _exit(126);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(rep[1]);
  close(ctl[0]);
  c->pid = pid;
  c->report = rep[0];
  c->control = ctl[1];
}

class Shared : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ASSERT_EQ(CUDA_SUCCESS, cuInit(0));
    ASSERT_EQ(CUDA_SUCCESS, cuDevicePrimaryCtxRetain(&ctx_, 0));
  }
  static void TearDownTestSuite() {
    if (ctx_) cuDevicePrimaryCtxRelease(0);
    ctx_ = nullptr;
  }
  void SetUp() override { ASSERT_EQ(CUDA_SUCCESS, cuCtxSetCurrent(ctx_)); }
  static size_t freeMem() {
    size_t f = 0, t = 0;
    EXPECT_EQ(CUDA_SUCCESS, cuMemGetInfo(&f, &t));
    return f;
  }
  static size_t totalMem() {
    size_t f = 0, t = 0;
    EXPECT_EQ(CUDA_SUCCESS, cuMemGetInfo(&f, &t));
    return t;
  }
  // Polls cuMemGetInfo until free memory is `want`, for at most `ms`; returns the last value.
  static size_t waitFree(size_t want, int ms) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
    size_t f = freeMem();
    while (f != want && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      f = freeMem();
    }
    return f;
  }
  static inline CUcontext ctx_ = nullptr;
};

using CrossProcess = Shared;
using DeviceFull = Shared;
using Managed = Shared;

// ---------------------------------------------------------------------------------------------
TEST_F(CrossProcess, ChildAllocationIsVisibleAndKill9GivesItBack) {
  if (totalMem() < 2 * kGiB) GTEST_SKIP() << "needs a device of 2 GiB or more";
  const size_t before = freeMem();
  Child c;
  ASSERT_NO_FATAL_FAILURE(spawn(&c, {"hold", std::to_string(kGiB)}));
  ASSERT_EQ(c.readLine(), "ok");
  const size_t during = freeMem();
  EXPECT_LE(during + kGiB, before) << "the child's 1 GiB is not visible to this process";
  EXPECT_EQ(during, before - kGiB);

  c.kill9();
  const int status = c.wait();
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  EXPECT_EQ(waitFree(before, 1000), before) << "memory of a killed process did not come back within 1 s";
}

TEST_F(CrossProcess, NormalExitGivesItBack) {
  if (totalMem() < 2 * kGiB) GTEST_SKIP() << "needs a device of 2 GiB or more";
  const size_t before = freeMem();
  Child c;
  ASSERT_NO_FATAL_FAILURE(spawn(&c, {"hold", std::to_string(kGiB)}));
  ASSERT_EQ(c.readLine(), "ok");
  EXPECT_EQ(freeMem(), before - kGiB);
  c.send('x');  // exit without freeing
  const int status = c.wait();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_EQ(waitFree(before, 1000), before) << "memory of an exited process did not come back within 1 s";
}

TEST_F(CrossProcess, ChildFreeIsSeenAtOnce) {
  const size_t before = freeMem();
  Child c;
  ASSERT_NO_FATAL_FAILURE(spawn(&c, {"hold", std::to_string(256 * kMiB)}));
  ASSERT_EQ(c.readLine(), "ok");
  EXPECT_EQ(freeMem(), before - 256 * kMiB);
  c.send('f');  // free, then exit
  const int status = c.wait();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_EQ(freeMem(), before);
}

// NVML's compute list names every process with a context on the device, memory or not, as the
// real driver does (a context holds memory there; simgpu models none, so the entry shows 0 B);
// a process whose last context on the device is gone is no longer listed.
TEST_F(CrossProcess, AProcessWithAContextIsListedWithoutMemory) {
  ASSERT_EQ(nvmlInit_v2(), NVML_SUCCESS);
  nvmlDevice_t dev;
  ASSERT_EQ(nvmlDeviceGetHandleByIndex_v2(0, &dev), NVML_SUCCESS);
  // The entry for pid, or -1 if it is not listed.
  auto listed = [&](pid_t pid) -> long long {
    nvmlProcessInfo_t infos[64];
    unsigned n = 64;
    EXPECT_EQ(nvmlDeviceGetComputeRunningProcesses_v3(dev, &n, infos), NVML_SUCCESS);
    for (unsigned i = 0; i < n; ++i)
      if (infos[i].pid == static_cast<unsigned>(pid)) return static_cast<long long>(infos[i].usedGpuMemory);
    return -1;
  };
  Child c;
  ASSERT_NO_FATAL_FAILURE(spawn(&c, {"context"}));
  ASSERT_EQ(c.readLine(), "primary");
  EXPECT_EQ(listed(c.pid), 0) << "a process holding the primary context only";
  c.send('n');
  ASSERT_EQ(c.readLine(), "released");
  EXPECT_EQ(listed(c.pid), -1) << "its last context released";
  c.send('n');
  ASSERT_EQ(c.readLine(), "created");
  EXPECT_EQ(listed(c.pid), 0) << "a process holding a created context only";
  c.send('n');
  ASSERT_EQ(c.readLine(), "destroyed");
  EXPECT_EQ(listed(c.pid), -1) << "its created context destroyed";
  c.send('n');
  c.wait();
  // Killed while it holds a context: gone from the list as its memory would be.
  Child k;
  ASSERT_NO_FATAL_FAILURE(spawn(&k, {"context"}));
  ASSERT_EQ(k.readLine(), "primary");
  ASSERT_EQ(listed(k.pid), 0);
  const pid_t killed = k.pid;
  k.kill9();
  k.wait();
  EXPECT_EQ(listed(killed), -1) << "a killed process's context";
  nvmlShutdown();
}

TEST_F(CrossProcess, TwoChildrenAndTheParentAddUp) {
  const size_t before = freeMem();
  CUdeviceptr mine = 0;
  ASSERT_EQ(CUDA_SUCCESS, cuMemAlloc(&mine, 64 * kMiB));
  Child a, b;
  ASSERT_NO_FATAL_FAILURE(spawn(&a, {"hold", std::to_string(128 * kMiB)}));
  ASSERT_NO_FATAL_FAILURE(spawn(&b, {"hold", std::to_string(32 * kMiB)}));
  ASSERT_EQ(a.readLine(), "ok");
  ASSERT_EQ(b.readLine(), "ok");
  EXPECT_EQ(freeMem(), before - (64 + 128 + 32) * kMiB);
  a.kill9();
  a.wait();
  EXPECT_EQ(waitFree(before - 96 * kMiB, 1000), before - 96 * kMiB) << "only the killed child's memory returns";
  b.closeControl();  // EOF: exits normally
  b.wait();
  EXPECT_EQ(waitFree(before - 64 * kMiB, 1000), before - 64 * kMiB);
  ASSERT_EQ(CUDA_SUCCESS, cuMemFree(mine));
  EXPECT_EQ(freeMem(), before);
}

// ---------------------------------------------------------------------------------------------
// SIMGPU_MEMORY=1GiB
TEST_F(DeviceFull, OutOfMemoryAcrossProcesses) {
  if (totalMem() != kGiB) GTEST_SKIP() << "needs SIMGPU_MEMORY=1GiB";
  ASSERT_EQ(freeMem(), kGiB) << "the device is not empty at the start";
  Child c;
  ASSERT_NO_FATAL_FAILURE(spawn(&c, {"hold", std::to_string(768 * kMiB)}));
  ASSERT_EQ(c.readLine(), "ok");
  EXPECT_EQ(freeMem(), 256 * kMiB);
  CUdeviceptr p = 0;
  EXPECT_EQ(CUDA_ERROR_OUT_OF_MEMORY, cuMemAlloc(&p, 512 * kMiB)) << "768 MiB held elsewhere: 512 MiB cannot fit";
  EXPECT_EQ(freeMem(), 256 * kMiB) << "a refused allocation must not count";
  CUdeviceptr small = 0;
  ASSERT_EQ(CUDA_SUCCESS, cuMemAlloc(&small, 128 * kMiB)) << "what is left can still be used";
  ASSERT_EQ(CUDA_SUCCESS, cuMemFree(small));

  c.kill9();
  c.wait();
  // No polling: an allocation that does not fit first returns the memory of dead processes.
  ASSERT_EQ(CUDA_SUCCESS, cuMemAlloc(&p, 512 * kMiB));
  EXPECT_EQ(freeMem(), 512 * kMiB);
  ASSERT_EQ(CUDA_SUCCESS, cuMemFree(p));
  EXPECT_EQ(freeMem(), kGiB);
}

TEST_F(DeviceFull, RacingChildrenNeverOvercommit) {
  if (totalMem() != kGiB) GTEST_SKIP() << "needs SIMGPU_MEMORY=1GiB";
  ASSERT_EQ(freeMem(), kGiB);
  constexpr int kChildren = 8;
  constexpr size_t kChunk = 200 * kMiB;
  std::vector<Child> kids(kChildren);
  for (Child& k : kids) ASSERT_NO_FATAL_FAILURE(spawn(&k, {"race", std::to_string(kChunk)}));
  for (Child& k : kids) ASSERT_EQ(k.readLine(), "ready");
  for (Child& k : kids) k.send('g');  // all initialised children start at once
  int total = 0;
  for (int i = 0; i < kChildren; ++i) {
    const std::string line = kids[i].readLine();
    int count = -1, code = -1;
    ASSERT_EQ(std::sscanf(line.c_str(), "count %d %d", &count, &code), 2) << "child " << i << ": '" << line << "'";
    EXPECT_EQ(code, CUDA_ERROR_OUT_OF_MEMORY) << "child " << i << " stopped for another reason";
    total += count;
  }
  EXPECT_LE(total * kChunk, kGiB) << total << " chunks of 200 MiB granted on a 1 GiB device";
  EXPECT_EQ(total, static_cast<int>(kGiB / kChunk)) << "every chunk that fits is granted to someone";
  EXPECT_EQ(freeMem(), kGiB - total * kChunk);
  for (Child& k : kids) k.closeControl();
  for (Child& k : kids) {
    const int status = k.wait();
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  }
  EXPECT_EQ(waitFree(kGiB, 1000), kGiB);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Time slicing between processes (registered with slices.costs: slice_hog blocks last 1 ms, and
// 2 ms slices). Ground truth: the device's time-slice board, which each process's engine fills.
simgpu::Board* board() {
  std::string err;
  simgpu::Board* b = simgpu::openBoard(std::getenv("SIMGPU_STATE_DIR"), 0, &err);
  EXPECT_NE(b, nullptr) << err;
  return b;
}

const simgpu::BoardSlot* slotOf(simgpu::Board* b, pid_t pid) {
  for (auto& s : b->slot)
    if (s.pid.load() == pid) return &s;
  return nullptr;
}

long long elapsedUs(Child& c) {
  const std::string line = c.readLine();
  EXPECT_EQ(line.rfind("elapsed ", 0), 0u) << line;
  return line.size() > 8 ? std::atoll(line.c_str() + 8) : -1;
}

TEST(TimeSlicing, AloneAProcessRunsUninterruptedAndNvmlSeesIt) {
  ASSERT_EQ(nvmlInit_v2(), NVML_SUCCESS);
  nvmlDevice_t dev;
  ASSERT_EQ(nvmlDeviceGetHandleByIndex_v2(0, &dev), NVML_SUCCESS);
  nvmlUtilization_t util = {};
  Child c;
  ASSERT_NO_FATAL_FAILURE(spawn(&c, {"hog", "20"}));
  ASSERT_EQ(c.readLine(), "ready");
  ASSERT_EQ(nvmlDeviceGetUtilizationRates(dev, &util), NVML_SUCCESS);  // the period starts here
  EXPECT_EQ(util.gpu, 0u);
  c.send('g');
  EXPECT_NEAR(elapsedUs(c), 20'000, 1'000);  // 20 ms of blocks, plus the host's launch gaps
  ASSERT_EQ(nvmlDeviceGetUtilizationRates(dev, &util), NVML_SUCCESS);
  EXPECT_GT(util.gpu, 0u) << "20 ms of kernels ran in the period (about 20-100 % of it, with the host's delays)";
  unsigned n = 0;
  EXPECT_EQ(nvmlDeviceGetProcessUtilization(dev, nullptr, &n, 0), NVML_ERROR_INSUFFICIENT_SIZE);
  ASSERT_GE(n, 1u);
  std::vector<nvmlProcessUtilizationSample_t> samples(n);
  ASSERT_EQ(nvmlDeviceGetProcessUtilization(dev, samples.data(), &n, 0), NVML_SUCCESS);
  bool seen = false;
  for (unsigned i = 0; i < n; ++i)
    if (samples[i].pid == static_cast<unsigned>(c.pid)) seen = samples[i].smUtil > 0;
  EXPECT_TRUE(seen) << "the hog's own utilisation";
  // As the driver: only samples newer than lastSeenTimeStamp; each covers the period since the
  // process's previous sample (the hog is idle since: 0 %); none newer than the future.
  unsigned long long last = 0;
  for (unsigned i = 0; i < n; ++i)
    if (samples[i].pid == static_cast<unsigned>(c.pid)) last = samples[i].timeStamp;
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  n = static_cast<unsigned>(samples.size());
  ASSERT_EQ(nvmlDeviceGetProcessUtilization(dev, samples.data(), &n, last), NVML_SUCCESS);
  seen = false;
  for (unsigned i = 0; i < n; ++i) {
    if (samples[i].pid != static_cast<unsigned>(c.pid)) continue;
    seen = true;
    EXPECT_GT(samples[i].timeStamp, last);
    EXPECT_EQ(samples[i].smUtil, 0u) << "idle since its previous sample";
  }
  EXPECT_TRUE(seen);
  n = static_cast<unsigned>(samples.size());
  EXPECT_EQ(nvmlDeviceGetProcessUtilization(dev, samples.data(), &n, ~0ull >> 1), NVML_ERROR_NOT_FOUND);
  // simgpu-smi --json: the same ground truth for scripts.
  FILE* smi = popen(SIMGPU_SMI " --json", "r");
  ASSERT_TRUE(smi);
  char buf[8192] = {};
  const size_t got = fread(buf, 1, sizeof buf - 1, smi);
  pclose(smi);
  const std::string json(buf, got);
  EXPECT_NE(json.find("{\"pid\": " + std::to_string(c.pid) + ", \"busy_ns\": 20000000, \"busy_sm_ns\": 20000000, "
                      "\"blocks\": 20, \"kernels\": 20, \"sliced_out_ns\": 0}"),
            std::string::npos)
      << json;
  nvmlShutdown();
  simgpu::Board* b = board();
  ASSERT_TRUE(b);
  const simgpu::BoardSlot* s = slotOf(b, c.pid);
  ASSERT_TRUE(s);
  EXPECT_EQ(s->busyNs.load(), 20'000'000u);
  EXPECT_EQ(s->blocksRun.load(), 20u);
  EXPECT_EQ(s->slicedOutNs.load(), 0u);
}

TEST(TimeSlicing, TwoProcessesTakeTurnsNeverSideBySide) {
  Child a, c;
  ASSERT_NO_FATAL_FAILURE(spawn(&a, {"hog", "60"}));
  ASSERT_NO_FATAL_FAILURE(spawn(&c, {"hog", "60"}));
  ASSERT_EQ(a.readLine(), "ready");
  ASSERT_EQ(c.readLine(), "ready");
  a.send('g');
  c.send('g');
  // Each needs 60 ms of the whole device; sharing it by slices, each waits about as long as the
  // other runs while both have work. Side by side (no slicing) each would read 60 ms.
  const long long ea = elapsedUs(a), ec = elapsedUs(c);
  std::printf("elapsed device time: %lld us and %lld us\n", ea, ec);
  // The two starts may be apart by some ms on a loaded host (one runs alone meanwhile: the work
  // is 60 ms so that 40 ms of it still overlaps with starts 20 ms apart; it was 20 ms, and a
  // start 10 ms late failed the bounds); side by side, both would read about 60 ms.
  EXPECT_GE(std::max(ea, ec), 90'000) << ea << " " << ec;
  EXPECT_GE(std::min(ea, ec), 60'000) << ea << " " << ec;
  simgpu::Board* b = board();
  ASSERT_TRUE(b);
  for (Child* k : {&a, &c}) {
    const simgpu::BoardSlot* s = slotOf(b, k->pid);
    ASSERT_TRUE(s);
    EXPECT_EQ(s->busyNs.load(), 60'000'000u);  // all of its work ran...
    EXPECT_GE(s->slicedOutNs.load(), 20'000'000u) << "...but not while the other held the device";
  }
  EXPECT_GE(b->switches.load(), 4u);
}

TEST(TimeSlicing, AHolderKilledMidSliceLeavesTheDeviceToTheOthers) {
  Child a, c;
  ASSERT_NO_FATAL_FAILURE(spawn(&a, {"hog", "100000"}));  // 100 s of work
  ASSERT_EQ(a.readLine(), "ready");
  a.send('g');
  simgpu::Board* b = board();
  ASSERT_TRUE(b);
  for (int i = 0; i < 2000 && !b->holder.load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_NE(b->holder.load(), 0u) << "the hog never took the device";
  a.kill9();
  a.wait();
  ASSERT_NO_FATAL_FAILURE(spawn(&c, {"hog", "5"}));
  ASSERT_EQ(c.readLine(), "ready");
  const auto t0 = std::chrono::steady_clock::now();
  c.send('g');
  // The dead holder's window was not renewed: c's work was never sliced out behind it. Judged by
  // the board (simgpu's own count), not by c's elapsed event time, which includes the host's gaps
  // between c's launches (1.2 ms more than its 5 ms of blocks once under a loaded host).
  const long long elapsed = elapsedUs(c);
  const simgpu::BoardSlot* s = slotOf(b, c.pid);
  ASSERT_TRUE(s);
  EXPECT_EQ(s->busyNs.load(), 5'000'000u) << "all of its work ran";
  EXPECT_LT(s->slicedOutNs.load(), 1'000'000u) << "it did not wait for the dead holder's slice (elapsed " << elapsed
                                               << " us)";
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
}


// ---------------------------------------------------------------------------------------------
// Managed memory (SIMGPU_MEMORY=1GiB): device memory only while resident; evicted to the host,
// data intact, when an ordinary allocation or another population needs the room.

// Bytes NVML's process list shows for pid on device 0 (-1: not listed), and the device's used.
long long nvmlProcessBytes(pid_t pid) {
  nvmlDevice_t dev;
  if (nvmlDeviceGetHandleByIndex_v2(0, &dev) != NVML_SUCCESS) return -2;
  nvmlProcessInfo_t infos[64];
  unsigned n = 64;
  if (nvmlDeviceGetComputeRunningProcesses_v3(dev, &n, infos) != NVML_SUCCESS) return -2;
  for (unsigned i = 0; i < n; ++i)
    if (static_cast<pid_t>(infos[i].pid) == pid) return static_cast<long long>(infos[i].usedGpuMemory);
  return -1;
}
unsigned long long nvmlDeviceUsed() {
  nvmlDevice_t dev;
  nvmlMemory_t mem{};
  if (nvmlDeviceGetHandleByIndex_v2(0, &dev) != NVML_SUCCESS || nvmlDeviceGetMemoryInfo(dev, &mem) != NVML_SUCCESS)
    return ~0ull;
  return mem.used;
}

TEST_F(Managed, TakesDeviceMemoryOnlyWhileResident) {
  if (totalMem() != kGiB) GTEST_SKIP() << "needs SIMGPU_MEMORY=1GiB";
  ASSERT_EQ(nvmlInit_v2(), NVML_SUCCESS);
  ASSERT_EQ(freeMem(), kGiB);
  CUdeviceptr m = 0;
  ASSERT_EQ(CUDA_SUCCESS, cuMemAllocManaged(&m, 2 * kGiB, CU_MEM_ATTACH_GLOBAL)) << "more than the device: not resident";
  EXPECT_EQ(freeMem(), kGiB) << "nothing is populated at allocation";
  ASSERT_EQ(CUDA_SUCCESS, cuMemFree(m));
  ASSERT_EQ(CUDA_SUCCESS, cuMemAllocManaged(&m, 256 * kMiB, CU_MEM_ATTACH_GLOBAL));
  EXPECT_EQ(freeMem(), kGiB);
  ASSERT_EQ(CUDA_SUCCESS, prefetch(m, 256 * kMiB, 0));
  EXPECT_EQ(freeMem(), kGiB - 256 * kMiB) << "a prefetch to the device populates it there";
  EXPECT_EQ(nvmlDeviceUsed(), 256 * kMiB) << "the device's used memory counts resident managed memory";
  EXPECT_EQ(nvmlProcessBytes(getpid()), 0) << "NVML's per-process figure leaves managed memory out";
  ASSERT_EQ(CUDA_SUCCESS, prefetch(m + 64 * kMiB, 64 * kMiB, CU_DEVICE_CPU));
  EXPECT_EQ(freeMem(), kGiB - 192 * kMiB) << "a prefetch of part of it to the host frees that part";
  ASSERT_EQ(CUDA_SUCCESS, cuMemFree(m));
  EXPECT_EQ(freeMem(), kGiB) << "freeing returns what was resident";
}

// A kernel whose arguments point into managed memory touches it: its chunks are populated on the
// launch's device, unless advice prefers the host.
TEST_F(Managed, ALaunchPopulatesWhatItsArgumentsReach) {
  if (totalMem() != kGiB) GTEST_SKIP() << "needs SIMGPU_MEMORY=1GiB";
  static const char kPtx[] = ".version 8.0\n.target sm_90\n.address_size 64\n";
  CUmodule mod = nullptr;
  CUfunction f = nullptr;
  ASSERT_EQ(CUDA_SUCCESS, cuModuleLoadData(&mod, kPtx));
  ASSERT_EQ(CUDA_SUCCESS, cuModuleGetFunction(&f, mod, "touch"));
  CUdeviceptr a = 0, b = 0;
  ASSERT_EQ(CUDA_SUCCESS, cuMemAllocManaged(&a, 64 * kMiB, CU_MEM_ATTACH_GLOBAL));
  ASSERT_EQ(CUDA_SUCCESS, cuMemAllocManaged(&b, 32 * kMiB, CU_MEM_ATTACH_GLOBAL));
  ASSERT_EQ(CUDA_SUCCESS, advise(b, 32 * kMiB, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, CU_DEVICE_CPU));
  auto launchWith = [&](CUdeviceptr p) {
    CUdeviceptr arg = p + 100;  // any address inside the allocation
    size_t size = sizeof arg;
    void* extra[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, &arg, CU_LAUNCH_PARAM_BUFFER_SIZE, &size, CU_LAUNCH_PARAM_END};
    ASSERT_EQ(CUDA_SUCCESS, cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, nullptr, nullptr, extra));
    ASSERT_EQ(CUDA_SUCCESS, cuCtxSynchronize());
  };
  ASSERT_NO_FATAL_FAILURE(launchWith(b));
  EXPECT_EQ(freeMem(), kGiB) << "preferred on the host: the kernel reaches it remotely";
  ASSERT_NO_FATAL_FAILURE(launchWith(a));
  EXPECT_EQ(freeMem(), kGiB - 64 * kMiB) << "the touch populated the allocation";
  ASSERT_EQ(CUDA_SUCCESS, cuMemFree(a));
  ASSERT_EQ(CUDA_SUCCESS, cuMemFree(b));
  ASSERT_EQ(CUDA_SUCCESS, cuModuleUnload(mod));
  EXPECT_EQ(freeMem(), kGiB);
}

// A launch that populates managed memory waits for the faults' migrations: its kernel starts
// SIMGPU_FAULT_US (200 us by default) per 2 MiB chunk later; a touch of resident memory moves
// nothing. Judged by event times (exact to the model) and the device's migration count.
TEST_F(Managed, ALaunchWaitsForTheChunksItMigrates) {
  if (totalMem() != kGiB) GTEST_SKIP() << "needs SIMGPU_MEMORY=1GiB";
  if (std::getenv("SIMGPU_FAULT_US")) GTEST_SKIP() << "needs the default fault cost";
  simgpu::Config cfg;
  std::string err;
  ASSERT_TRUE(simgpu::loadConfig(&cfg, &err)) << err;
  simgpu::SharedState* state = simgpu::SharedState::open(cfg.stateDir, cfg.deviceCount, cfg.memory, cfg.smCount, &err);
  ASSERT_TRUE(state) << err;
  static const char kPtx[] = ".version 8.0\n.target sm_90\n.address_size 64\n";
  CUmodule mod = nullptr;
  CUfunction f = nullptr;
  ASSERT_EQ(CUDA_SUCCESS, cuModuleLoadData(&mod, kPtx));
  ASSERT_EQ(CUDA_SUCCESS, cuModuleGetFunction(&f, mod, "touch"));
  CUevent e0 = nullptr, e1 = nullptr;
  ASSERT_EQ(CUDA_SUCCESS, cuEventCreate(&e0, CU_EVENT_DEFAULT));
  ASSERT_EQ(CUDA_SUCCESS, cuEventCreate(&e1, CU_EVENT_DEFAULT));
  CUdeviceptr m = 0;
  ASSERT_EQ(CUDA_SUCCESS, cuMemAllocManaged(&m, 64 * kMiB, CU_MEM_ATTACH_GLOBAL));
  // Device time of one launch touching m (ms), and the bytes migrated in meanwhile.
  auto touch = [&](float* ms, uint64_t* in) {
    const uint64_t before = state->migratedIn(0);
    CUdeviceptr arg = m;
    size_t size = sizeof arg;
    void* extra[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, &arg, CU_LAUNCH_PARAM_BUFFER_SIZE, &size, CU_LAUNCH_PARAM_END};
    ASSERT_EQ(CUDA_SUCCESS, cuEventRecord(e0, nullptr));
    ASSERT_EQ(CUDA_SUCCESS, cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, nullptr, nullptr, extra));
    ASSERT_EQ(CUDA_SUCCESS, cuEventRecord(e1, nullptr));
    ASSERT_EQ(CUDA_SUCCESS, cuCtxSynchronize());
    ASSERT_EQ(CUDA_SUCCESS, cuEventElapsedTime(ms, e0, e1));
    *in = state->migratedIn(0) - before;
  };
  float ms = 0;
  uint64_t in = 0;
  ASSERT_NO_FATAL_FAILURE(touch(&ms, &in));
  EXPECT_EQ(in, 64 * kMiB) << "the first touch populates all 32 chunks";
  EXPECT_GE(ms, 32 * 0.2f) << "and waits 200 us for each";
  ASSERT_NO_FATAL_FAILURE(touch(&ms, &in));
  EXPECT_EQ(in, 0u) << "resident: nothing moves";
  ASSERT_EQ(CUDA_SUCCESS, prefetch(m, 32 * kMiB, CU_DEVICE_CPU));
  ASSERT_NO_FATAL_FAILURE(touch(&ms, &in));
  EXPECT_EQ(in, 32 * kMiB) << "half was sent to the host: it comes back";
  EXPECT_GE(ms, 16 * 0.2f);
  ASSERT_EQ(CUDA_SUCCESS, cuMemFree(m));
  ASSERT_EQ(CUDA_SUCCESS, cuEventDestroy(e0));
  ASSERT_EQ(CUDA_SUCCESS, cuEventDestroy(e1));
  ASSERT_EQ(CUDA_SUCCESS, cuModuleUnload(mod));
}

// An ordinary allocation that finds the device full evicts another process's resident managed
// memory to the host (exactly what it needs); the data survives; device memory from cuMemAlloc is
// never evicted.
TEST_F(Managed, AnAllocationEvictsAnotherProcesssManagedMemoryAndItsDataSurvives) {
  if (totalMem() != kGiB) GTEST_SKIP() << "needs SIMGPU_MEMORY=1GiB";
  ASSERT_EQ(nvmlInit_v2(), NVML_SUCCESS);
  ASSERT_EQ(freeMem(), kGiB);
  Child burst;
  ASSERT_NO_FATAL_FAILURE(spawn(&burst, {"managed", std::to_string(768 * kMiB)}));
  ASSERT_EQ(burst.readLine(), "ok");
  EXPECT_EQ(freeMem(), 256 * kMiB) << "the child's managed memory is resident";
  EXPECT_EQ(nvmlProcessBytes(burst.pid), 0);

  CUdeviceptr p = 0;
  ASSERT_EQ(CUDA_SUCCESS, cuMemAlloc(&p, 512 * kMiB)) << "the device evicts managed pages to make room";
  EXPECT_EQ(freeMem(), 0u) << "exactly what was needed went to the host: 256 MiB of the child's stay";
  EXPECT_EQ(nvmlDeviceUsed(), kGiB);
  burst.send('c');
  EXPECT_EQ(burst.readLine(), "intact") << "evicted managed memory keeps its data";

  CUdeviceptr q = 0;
  EXPECT_EQ(CUDA_ERROR_OUT_OF_MEMORY, cuMemAlloc(&q, 768 * kMiB)) << "only 512 MiB can be evicted: nothing moves";
  EXPECT_EQ(freeMem(), 0u);
  EXPECT_EQ(nvmlDeviceUsed(), kGiB);

  burst.send('p');  // the child prefetches its 768 MiB again: only what is free, the rest stays on the host
  ASSERT_EQ(burst.readLine(), "ok");
  EXPECT_EQ(freeMem(), 0u) << "cuMemAlloc memory is never evicted by managed memory";
  ASSERT_EQ(CUDA_SUCCESS, cuMemFree(p));
  EXPECT_EQ(freeMem(), 512 * kMiB);
  burst.send('p');
  ASSERT_EQ(burst.readLine(), "ok");
  EXPECT_EQ(freeMem(), 256 * kMiB) << "with room again, all of it is resident";
  burst.send('c');
  EXPECT_EQ(burst.readLine(), "intact");

  burst.kill9();
  burst.wait();
  EXPECT_EQ(waitFree(kGiB, 1000), kGiB) << "a killed process's resident managed memory comes back";
}

// Populating managed memory evicts the managed memory that migrated in least recently, across
// processes; the device never holds more than its size.
TEST_F(Managed, PopulationEvictsTheLeastRecentlyMigratedIn) {
  if (totalMem() != kGiB) GTEST_SKIP() << "needs SIMGPU_MEMORY=1GiB";
  ASSERT_EQ(freeMem(), kGiB);
  Child first, second;
  ASSERT_NO_FATAL_FAILURE(spawn(&first, {"managed", std::to_string(600 * kMiB)}));
  ASSERT_EQ(first.readLine(), "ok");
  ASSERT_NO_FATAL_FAILURE(spawn(&second, {"managed", std::to_string(600 * kMiB)}));
  ASSERT_EQ(second.readLine(), "ok");
  EXPECT_EQ(freeMem(), 0u) << "the second population evicted 176 MiB of the first's";
  EXPECT_EQ(nvmlDeviceUsed(), kGiB);
  CUdeviceptr m = 0;
  ASSERT_EQ(CUDA_SUCCESS, cuMemAllocManaged(&m, 100 * kMiB, CU_MEM_ATTACH_GLOBAL));
  ASSERT_EQ(CUDA_SUCCESS, prefetch(m, 100 * kMiB, 0));
  EXPECT_EQ(freeMem(), 0u);
  // The first child's chunks are the oldest: its resident part went first. Sent to the host, they
  // free what it still had (1024 - 600 - 100 = 324 MiB).
  first.send('h');
  ASSERT_EQ(first.readLine(), "ok");
  EXPECT_EQ(freeMem(), 324 * kMiB);
  second.send('c');
  EXPECT_EQ(second.readLine(), "intact");
  first.send('c');
  EXPECT_EQ(first.readLine(), "intact");
  ASSERT_EQ(CUDA_SUCCESS, cuMemFree(m));
  first.closeControl();
  second.closeControl();
  first.wait();
  second.wait();
  EXPECT_EQ(waitFree(kGiB, 1000), kGiB);
}

TEST_F(Managed, AdviceAndPrefetchAreReportedPerRange) {
  CUdeviceptr m = 0;
  const size_t n = 8 * kMiB;  // four chunks of 2 MiB
  ASSERT_EQ(CUDA_SUCCESS, cuMemAllocManaged(&m, n, CU_MEM_ATTACH_GLOBAL));
  int v = 7;
  ASSERT_EQ(CUDA_SUCCESS, cuMemRangeGetAttribute(&v, 4, CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION, m, n));
  EXPECT_EQ(v, CU_DEVICE_INVALID) << "no preference set";
  ASSERT_EQ(CUDA_SUCCESS, cuMemRangeGetAttribute(&v, 4, CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION, m, n));
  EXPECT_EQ(v, CU_DEVICE_INVALID) << "never prefetched";
  ASSERT_EQ(CUDA_SUCCESS, advise(m, n, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, 0));
  ASSERT_EQ(CUDA_SUCCESS, advise(m, 2 * kMiB, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, CU_DEVICE_CPU));
  ASSERT_EQ(CUDA_SUCCESS, cuMemRangeGetAttribute(&v, 4, CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION, m, 2 * kMiB));
  EXPECT_EQ(v, CU_DEVICE_CPU);
  ASSERT_EQ(CUDA_SUCCESS, cuMemRangeGetAttribute(&v, 4, CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION, m + 4 * kMiB, 4 * kMiB));
  EXPECT_EQ(v, 0);
  ASSERT_EQ(CUDA_SUCCESS, cuMemRangeGetAttribute(&v, 4, CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION, m, n));
  EXPECT_EQ(v, CU_DEVICE_INVALID) << "mixed preferences";
  ASSERT_EQ(CUDA_SUCCESS, cuMemRangeGetAttribute(&v, 4, CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION_TYPE, m + 4 * kMiB, kMiB));
  EXPECT_EQ(v, CU_MEM_LOCATION_TYPE_DEVICE);
  ASSERT_EQ(CUDA_SUCCESS, cuMemRangeGetAttribute(&v, 4, CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION_ID, m + 4 * kMiB, kMiB));
  EXPECT_EQ(v, 0);
  ASSERT_EQ(CUDA_SUCCESS, cuMemRangeGetAttribute(&v, 4, CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION_TYPE, m, n));
  EXPECT_EQ(v, CU_MEM_LOCATION_TYPE_INVALID);

  // The _v2 entry points take a location; prefetch flags must be 0.
  CUmemLocation host{CU_MEM_LOCATION_TYPE_HOST, 0}, dev0{CU_MEM_LOCATION_TYPE_DEVICE, 0};
  EXPECT_EQ(CUDA_ERROR_INVALID_VALUE, cuMemPrefetchAsync_v2(m, n, host, 1, nullptr));
  ASSERT_EQ(CUDA_SUCCESS, cuMemPrefetchAsync_v2(m, n, dev0, 0, nullptr));
  ASSERT_EQ(CUDA_SUCCESS, cuMemPrefetchAsync_v2(m, 2 * kMiB, host, 0, nullptr));
  ASSERT_EQ(CUDA_SUCCESS, cuMemRangeGetAttribute(&v, 4, CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION, m, kMiB));
  EXPECT_EQ(v, CU_DEVICE_CPU);
  ASSERT_EQ(CUDA_SUCCESS, cuMemRangeGetAttribute(&v, 4, CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION_TYPE, m, kMiB));
  EXPECT_EQ(v, CU_MEM_LOCATION_TYPE_HOST);
  ASSERT_EQ(CUDA_SUCCESS, cuMemRangeGetAttribute(&v, 4, CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION, m + 2 * kMiB, 6 * kMiB));
  EXPECT_EQ(v, 0);
  // The legacy entry points (old binaries call them by name): a device ordinal, CU_DEVICE_CPU.
  using LegacyPrefetch = CUresult (*)(CUdeviceptr, size_t, CUdevice, CUstream);
  using LegacyAdvise = CUresult (*)(CUdeviceptr, size_t, CUmem_advise, CUdevice);
  auto legacyPrefetch = reinterpret_cast<LegacyPrefetch>(dlsym(RTLD_DEFAULT, "cuMemPrefetchAsync"));
  auto legacyAdvise = reinterpret_cast<LegacyAdvise>(dlsym(RTLD_DEFAULT, "cuMemAdvise"));
  ASSERT_TRUE(legacyPrefetch && legacyAdvise);
  ASSERT_EQ(CUDA_SUCCESS, legacyPrefetch(m, n, CU_DEVICE_CPU, nullptr));
  ASSERT_EQ(CUDA_SUCCESS, cuMemRangeGetAttribute(&v, 4, CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION, m, n));
  EXPECT_EQ(v, CU_DEVICE_CPU);
  ASSERT_EQ(CUDA_SUCCESS, legacyAdvise(m, n, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, CU_DEVICE_CPU));
  ASSERT_EQ(CUDA_SUCCESS, cuMemRangeGetAttribute(&v, 4, CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION, m, n));
  EXPECT_EQ(v, CU_DEVICE_CPU);
  ASSERT_EQ(CUDA_SUCCESS, legacyPrefetch(m, n, 0, nullptr));

  EXPECT_EQ(CUDA_SUCCESS, cuMemAdvise_v2(m, n, CU_MEM_ADVISE_SET_READ_MOSTLY, CUmemLocation{}));
  EXPECT_EQ(CUDA_SUCCESS, cuMemAdvise_v2(m, n, CU_MEM_ADVISE_SET_ACCESSED_BY, dev0));
  EXPECT_EQ(CUDA_SUCCESS, cuMemAdvise_v2(m, n, CU_MEM_ADVISE_SET_ACCESSED_BY, host));
  CUmemLocation numa{CU_MEM_LOCATION_TYPE_HOST_NUMA, 0};
  EXPECT_EQ(CUDA_ERROR_INVALID_DEVICE, cuMemAdvise_v2(m, n, CU_MEM_ADVISE_SET_ACCESSED_BY, numa)) << "device or host only";
  CUmemLocation bad{CU_MEM_LOCATION_TYPE_DEVICE, 99};
  EXPECT_EQ(CUDA_ERROR_INVALID_DEVICE, cuMemAdvise_v2(m, n, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, bad));
  EXPECT_EQ(CUDA_ERROR_INVALID_VALUE, cuMemAdvise_v2(m, n, static_cast<CUmem_advise>(9), dev0));
  int accessed[3] = {7, 7, 7};
  ASSERT_EQ(CUDA_SUCCESS, cuMemRangeGetAttribute(accessed, sizeof accessed, CU_MEM_RANGE_ATTRIBUTE_ACCESSED_BY, m, n));
  EXPECT_EQ(accessed[0], 0);
  EXPECT_EQ(accessed[1], CU_DEVICE_CPU);
  EXPECT_EQ(accessed[2], CU_DEVICE_INVALID);
  // Several at once.
  int rm = 0, pref = 0;
  void* data[] = {&rm, &pref};
  size_t sizes[] = {4, 4};
  CUmem_range_attribute attrs[] = {CU_MEM_RANGE_ATTRIBUTE_READ_MOSTLY, CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION};
  ASSERT_EQ(CUDA_SUCCESS, cuMemRangeGetAttributes(data, sizes, attrs, 2, m + 4 * kMiB, kMiB));
  EXPECT_EQ(rm, 1);
  EXPECT_EQ(pref, CU_DEVICE_CPU);
  EXPECT_EQ(CUDA_ERROR_INVALID_VALUE, cuMemRangeGetAttribute(&v, 8, CU_MEM_RANGE_ATTRIBUTE_READ_MOSTLY, m, n));
  EXPECT_EQ(CUDA_ERROR_INVALID_VALUE, cuMemRangeGetAttribute(&v, 4, CU_MEM_RANGE_ATTRIBUTE_READ_MOSTLY, m, n + 1))
      << "past the allocation";
  CUdeviceptr plain = 0;
  ASSERT_EQ(CUDA_SUCCESS, cuMemAlloc(&plain, kMiB));
  EXPECT_EQ(CUDA_ERROR_INVALID_VALUE, prefetch(plain, kMiB, 0)) << "not managed memory";
  ASSERT_EQ(CUDA_SUCCESS, cuMemFree(plain));
  ASSERT_EQ(CUDA_SUCCESS, cuMemFree(m));
}

TEST_F(Managed, NotAllocatedDuringAGlobalCapture) {
  CUstream s = nullptr;
  ASSERT_EQ(CUDA_SUCCESS, cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  ASSERT_EQ(CUDA_SUCCESS, cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
  CUdeviceptr m = 0;
  EXPECT_EQ(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, cuMemAllocManaged(&m, kMiB, CU_MEM_ATTACH_GLOBAL));
  CUgraph g = nullptr;
  cuStreamEndCapture(s, &g);
  if (g) cuGraphDestroy(g);
  ASSERT_EQ(CUDA_SUCCESS, cuStreamDestroy(s));
}

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--child") == 0) return childMain(argc, argv);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
