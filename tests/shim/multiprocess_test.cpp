// libcushare.so across processes, end to end on simgpu: one tenant limit enforced over many
// processes racing for it, processes killed at any instant (kill -9) never leaking quota, two
// tenants side by side, fork+exec, and a killed process's quota coming back before anything is
// denied. See CMakeLists.txt for the registrations: each suite runs in its own simulated host and
// ledger directory, with the tenant and limit of its registration.
//
// The parent is a GoogleTest program; every helper process is this same executable started again
// with `--child=<mode> args...` (fork, then execve of /proc/self/exe): a fresh CUDA process with
// the shim preloaded (the environment is inherited, with per-child overrides applied to the
// execve environment). A child talks through fixed descriptors set up before exec:
//   3: the report pipe (the child writes lines);
//   4: the control pipe (the child blocks reading it; a byte or EOF moves it on),
//   5: (racing children only) the board, a shared page where each child publishes what it holds,
// so a child whose parent dies sees EOF and exits instead of lingering.
//
// The observer child runs without LD_PRELOAD: its NVML is simgpu's own, so it reports what the
// simulated device really holds host-wide (the shim would report the tenant's view).
#include <cuda.h>
#include <fcntl.h>
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/mman.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <atomic>
#include <deque>
#include <filesystem>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "device_used.h"
#include "simgpu/nvml.h"

extern char** environ;

namespace {

constexpr size_t kMiB = size_t{1} << 20;
constexpr int kReportFd = 3;
constexpr int kControlFd = 4;
constexpr int kBoardFd = 5;
constexpr int kBoardSlots = 64;

// The board: what the racing children hold, published so that it never exceeds what the tenant
// ledger charges them (raised after cuMemAlloc returned, lowered before cuMemFree is called).
// Slot kBoardTotal is the one counter every child adds to and subtracts from, so one atomic load of
// it is <= what the tenant holds <= the limit at that instant, and a total above the limit, seen
// by anyone at any time, is an over-commit: exact, unlike sampling the device. (Summing the
// children's own slots is not: a child read before it frees plus one read after it reallocated
// count the same bytes twice, which a loaded machine shows.) The children's slots say who held
// what when a test fails.
using Board = std::atomic<uint64_t>;
static_assert(Board::is_always_lock_free);
constexpr int kBoardTotal = kBoardSlots - 1;

Board* mapBoard(int fd) {
  void* p = mmap(nullptr, sizeof(Board) * kBoardSlots, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  return p == MAP_FAILED ? nullptr : static_cast<Board*>(p);
}

uint64_t boardTotal(const Board* b) { return b[kBoardTotal].load(); }

void boardAdd(Board* b, int slot, uint64_t n) {
  b[slot].fetch_add(n);
  b[kBoardTotal].fetch_add(n);
}

void boardSub(Board* b, int slot, uint64_t n) {
  b[kBoardTotal].fetch_sub(n);
  b[slot].fetch_sub(n);
}

using Clock = std::chrono::steady_clock;

// The registration's limit (CUSHARE_MEMORY_LIMIT, a plain "<n>MiB" here); 0 if unset.
size_t envLimit() {
  const char* v = std::getenv("CUSHARE_MEMORY_LIMIT");
  if (!v) return 0;
  char* end = nullptr;
  const unsigned long long n = std::strtoull(v, &end, 10);
  if (end && std::strcmp(end, "MiB") == 0) return n * kMiB;
  if (end && std::strcmp(end, "GiB") == 0) return n * 1024 * kMiB;
  return n;
}

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

// Blocks until the parent writes a byte or closes the pipe (or dies); the byte, 0 on EOF.
char awaitControl() {
  char c = 0;
  const ssize_t n = read(kControlFd, &c, 1);
  return n == 1 ? c : 0;
}

// True once the parent wrote a byte or closed the control pipe.
bool controlPending() {
  pollfd p{kControlFd, POLLIN, 0};
  return poll(&p, 1, 0) > 0;
}

// churn <durationMs> <seed> <window> <waitForGo 0|1> <board slot, -1: none>: loops until the
// deadline allocating random
// sizes of 1..64 MiB with cuMemAlloc, holding at most <window> allocations at once for a short
// random time. After every successful allocation it checks the tenant view: total is the limit,
// free <= total, and the tenant's use (total - free) covers at least what this process holds.
// Any other failure than CUDA_ERROR_OUT_OF_MEMORY, or a broken check, is reported at once as
// "bad ..." and the child exits 1. At the end it frees everything and reports
// "done <granted> <denied>".
int childChurn(long durationMs, unsigned seed, size_t window, bool waitForGo, int boardSlot) {
  const size_t limit = envLimit();
  Board* board = nullptr;
  if (boardSlot >= 0) {
    board = mapBoard(kBoardFd);
    if (!board || boardSlot >= kBoardTotal) {
      report("bad board");
      return 1;
    }
  }
  if (CUresult r = childInit(); r != CUDA_SUCCESS) {
    report("bad init " + std::to_string(r));
    return 1;
  }
  report("ready");
  if (waitForGo) awaitControl();
  std::mt19937 rng(seed);
  std::deque<std::pair<CUdeviceptr, size_t>> held;
  size_t heldBytes = 0;
  long granted = 0, denied = 0;
  auto freeOldest = [&]() -> bool {
    const auto [p, n] = held.front();
    held.pop_front();
    heldBytes -= n;
    if (board) boardSub(board, boardSlot, n);  // before the free: the board never exceeds the ledger
    if (CUresult r = cuMemFree(p); r != CUDA_SUCCESS) {
      report("bad cuMemFree " + std::to_string(r));
      return false;
    }
    return true;
  };
  const auto deadline = Clock::now() + std::chrono::milliseconds(durationMs);
  while (Clock::now() < deadline) {
    const size_t bytes = (1 + rng() % 64) * kMiB;
    CUdeviceptr p = 0;
    const CUresult r = cuMemAlloc(&p, bytes);
    if (r == CUDA_SUCCESS) {
      ++granted;
      held.emplace_back(p, bytes);
      heldBytes += bytes;
      if (board) {
        boardAdd(board, boardSlot, bytes);
        if (const uint64_t sum = boardTotal(board); sum > limit) {
          report("bad over-commit: the tenant's processes hold " + std::to_string(sum) + " bytes, limit " +
                 std::to_string(limit));
          return 1;
        }
      }
      size_t f = 0, t = 0;
      const CUresult ri = cuMemGetInfo(&f, &t);
      if (ri != CUDA_SUCCESS || t != limit || f > t || t - f < heldBytes) {
        report("bad info r=" + std::to_string(ri) + " free=" + std::to_string(f) + " total=" + std::to_string(t) +
               " held=" + std::to_string(heldBytes) + " limit=" + std::to_string(limit));
        return 1;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % 500));
      while (held.size() >= window || (!held.empty() && rng() % 4 == 0))
        if (!freeOldest()) return 1;
    } else if (r == CUDA_ERROR_OUT_OF_MEMORY) {
      ++denied;
      if (!held.empty() && !freeOldest()) return 1;
    } else {
      report("bad cuMemAlloc(" + std::to_string(bytes) + ") " + std::to_string(r));
      return 1;
    }
  }
  while (!held.empty())
    if (!freeOldest()) return 1;
  report("done " + std::to_string(granted) + " " + std::to_string(denied));
  return 0;
}

// observe: samples simgpu's own NVML (no shim) about every millisecond until the control pipe
// moves, then reports "max <highest used> total <total> samples <n> over <samples above limit>".
int childObserve(size_t limit) {
  if (std::getenv("LD_PRELOAD")) {
    report("bad the observer must run without the shim");
    return 1;
  }
  nvmlDevice_t d;
  if (nvmlInit_v2() != NVML_SUCCESS || nvmlDeviceGetHandleByIndex_v2(0, &d) != NVML_SUCCESS) {
    report("bad nvml init");
    return 1;
  }
  nvmlMemory_t m{};
  if (nvmlDeviceGetMemoryInfo(d, &m) != NVML_SUCCESS) {
    report("bad nvml memory");
    return 1;
  }
  report("ready " + std::to_string(m.total));
  unsigned long long maxUsed = 0, samples = 0, over = 0;
  while (!controlPending()) {
    if (nvmlDeviceGetMemoryInfo(d, &m) != NVML_SUCCESS) {
      report("bad nvml memory");
      return 1;
    }
    ++samples;
    if (m.used > maxUsed) maxUsed = m.used;
    if (m.used > limit) ++over;
    usleep(1000);
  }
  report("max " + std::to_string(maxUsed) + " total " + std::to_string(m.total) + " samples " +
         std::to_string(samples) + " over " + std::to_string(over));
  nvmlShutdown();
  return 0;
}

// script <op>...: runs the ops in order, reporting one line each:
//   alloc:<bytes>          cuMemAlloc, keeps the pointer      -> "alloc <code>"
//   retry:<bytes>:<ms>     cuMemAlloc until it succeeds or ms passed (1 ms apart) -> "alloc <code>"
//   info                   cuMemGetInfo                       -> "info <free> <total>"
//   total                  cuDeviceTotalMem of device 0       -> "total <bytes>"
//   freeall                frees every pointer kept           -> "freeall <code>"
//   wait                   reports "wait", then blocks on the control pipe
// then reports "end" and blocks on the control pipe (EOF: exit 0 without freeing).
//   stderr (first op only)  the shim's log lines go to the report pipe too, from before cuInit
int childScript(int argc, char** argv, int first) {
  if (first < argc && std::strcmp(argv[first], "stderr") == 0) {
    dup2(kReportFd, STDERR_FILENO);
    ++first;
  }
  if (CUresult r = childInit(); r != CUDA_SUCCESS) {
    report("init " + std::to_string(r));
    return 1;
  }
  std::vector<CUdeviceptr> held;
  for (int i = first; i < argc; ++i) {
    const std::string op = argv[i];
    if (op.rfind("alloc:", 0) == 0) {
      CUdeviceptr p = 0;
      const CUresult r = cuMemAlloc(&p, std::strtoull(op.c_str() + 6, nullptr, 10));
      if (r == CUDA_SUCCESS) held.push_back(p);
      report("alloc " + std::to_string(r));
    } else if (op.rfind("retry:", 0) == 0) {
      char* end = nullptr;
      const size_t bytes = std::strtoull(op.c_str() + 6, &end, 10);
      const long ms = std::strtol(end + 1, nullptr, 10);
      const auto deadline = Clock::now() + std::chrono::milliseconds(ms);
      CUdeviceptr p = 0;
      CUresult r;
      while ((r = cuMemAlloc(&p, bytes)) != CUDA_SUCCESS && Clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      if (r == CUDA_SUCCESS) held.push_back(p);
      report("alloc " + std::to_string(r));
    } else if (op == "info") {
      size_t f = 0, t = 0;
      const CUresult r = cuMemGetInfo(&f, &t);
      report(r == CUDA_SUCCESS ? "info " + std::to_string(f) + " " + std::to_string(t) : "info error " + std::to_string(r));
    } else if (op == "total") {
      size_t t = 0;
      const CUresult r = cuDeviceTotalMem(&t, 0);
      report(r == CUDA_SUCCESS ? "total " + std::to_string(t) : "total error " + std::to_string(r));
    } else if (op == "freeall") {
      CUresult r = CUDA_SUCCESS;
      for (CUdeviceptr p : held)
        if (CUresult rr = cuMemFree(p); rr != CUDA_SUCCESS) r = rr;
      held.clear();
      report("freeall " + std::to_string(r));
    } else if (op == "wait") {
      report("wait");
      awaitControl();
    } else {
      report("bad op " + op);
      return 2;
    }
  }
  report("end");
  awaitControl();
  return 0;
}

// nvml [stderr]: a process that only uses NVML (nvidia-smi, pynvml), never cuInit: nvmlInit_v2 and
// the memory of NVML device 0 through both ABIs. Reports "init <code>" and, if that succeeded,
// "v1 <code> <total> <free> <used>" and "v2 <code> <total> <free> <used>"; then "end" and blocks
// on the control pipe.
int childNvml(int argc, char** argv) {
  if (argc > 2 && std::strcmp(argv[2], "stderr") == 0) dup2(kReportFd, STDERR_FILENO);
  const nvmlReturn_t r = nvmlInit_v2();
  report("init " + std::to_string(r));
  if (r == NVML_SUCCESS) {
    nvmlDevice_t d;
    if (nvmlDeviceGetHandleByIndex_v2(0, &d) != NVML_SUCCESS) {
      report("bad handle");
      return 1;
    }
    nvmlMemory_t m{};
    const nvmlReturn_t r1 = nvmlDeviceGetMemoryInfo(d, &m);
    report("v1 " + std::to_string(r1) + " " + std::to_string(m.total) + " " + std::to_string(m.free) + " " +
           std::to_string(m.used));
    nvmlMemory_v2_t m2{};
    m2.version = nvmlMemory_v2;
    const nvmlReturn_t r2 = nvmlDeviceGetMemoryInfo_v2(d, &m2);
    report("v2 " + std::to_string(r2) + " " + std::to_string(m2.total) + " " + std::to_string(m2.free) + " " +
           std::to_string(m2.used));
  }
  report("end");
  awaitControl();
  return 0;
}

int childMain(const std::string& mode, int argc, char** argv) {
  alarm(60);  // never outlive a broken test for long
  auto arg = [&](int i) { return i < argc ? std::string(argv[i]) : std::string(); };
  if (mode == "churn")
    return childChurn(std::strtol(arg(2).c_str(), nullptr, 10), static_cast<unsigned>(std::strtoul(arg(3).c_str(), nullptr, 10)),
                      std::strtoull(arg(4).c_str(), nullptr, 10), arg(5) == "1", std::atoi(arg(6).c_str()));
  if (mode == "observe") return childObserve(std::strtoull(arg(2).c_str(), nullptr, 10));
  if (mode == "script") return childScript(argc, argv, 2);
  if (mode == "nvml") return childNvml(argc, argv);
  std::fprintf(stderr, "unknown child mode '%s'\n", mode.c_str());
  return 2;
}

// ---------------------------------------------------------------------------------------------
// Parent side

const std::string& selfPath() {
  static const std::string p = [] {
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
  std::string buffered;

  // One line (without the newline); "" on EOF or after timeoutMs.
  std::string readLine(int timeoutMs = 20000) {
    const auto deadline = Clock::now() + std::chrono::milliseconds(timeoutMs);
    while (true) {
      if (const size_t nl = buffered.find('\n'); nl != std::string::npos) {
        std::string line = buffered.substr(0, nl);
        buffered.erase(0, nl + 1);
        return line;
      }
      const int left =
          static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count());
      if (left <= 0 || report < 0) return "";
      pollfd pfd{report, POLLIN, 0};
      if (poll(&pfd, 1, left) <= 0) return "";
      char buf[512];
      const ssize_t n = read(report, buf, sizeof buf);
      if (n <= 0) return "";
      buffered.append(buf, static_cast<size_t>(n));
    }
  }
  // Everything the child wrote so far, without blocking.
  std::string drain() {
    while (report >= 0) {
      pollfd pfd{report, POLLIN, 0};
      if (poll(&pfd, 1, 0) <= 0) break;
      char buf[512];
      const ssize_t n = read(report, buf, sizeof buf);
      if (n <= 0) break;
      buffered.append(buf, static_cast<size_t>(n));
    }
    return buffered;
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

// Environment changes for one child: NAME=value sets, a bare NAME removes.
using EnvEdits = std::vector<std::string>;

std::vector<std::string> editedEnvironment(const EnvEdits& edits) {
  std::vector<std::string> env;
  for (char** e = environ; e && *e; ++e) env.emplace_back(*e);
  for (const std::string& ed : edits) {
    const size_t eq = ed.find('=');
    const std::string name = ed.substr(0, eq);
    std::erase_if(env, [&](const std::string& v) { return v.compare(0, name.size() + 1, name + "=") == 0; });
    if (eq != std::string::npos) env.push_back(ed);
  }
  return env;
}

// Starts this executable as a child: --child=<mode> args..., with the environment edited.
// boardFd >= 0: passed to the child as descriptor 5.
void spawn(Child* c, const std::string& mode, const std::vector<std::string>& args, const EnvEdits& edits = {},
           int boardFd = -1) {
  int rep[2], ctl[2];
  ASSERT_EQ(pipe2(rep, O_CLOEXEC), 0);
  ASSERT_EQ(pipe2(ctl, O_CLOEXEC), 0);
  std::vector<std::string> strs = {selfPath(), "--child=" + mode};
  strs.insert(strs.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& s : strs) argv.push_back(s.data());
  argv.push_back(nullptr);
  std::vector<std::string> envStrs = editedEnvironment(edits);
  std::vector<char*> envp;
  for (std::string& s : envStrs) envp.push_back(s.data());
  envp.push_back(nullptr);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    // Only async-signal-safe calls until exec. Move the two ends out of the way, then into place;
    // dup2 clears close-on-exec on the copies, every other descriptor closes at exec.
    const int r = fcntl(rep[1], F_DUPFD_CLOEXEC, 100);
    const int w = fcntl(ctl[0], F_DUPFD_CLOEXEC, 100);
    const int b = boardFd >= 0 ? fcntl(boardFd, F_DUPFD_CLOEXEC, 100) : -1;
    if (r < 0 || w < 0 || dup2(r, kReportFd) < 0 || dup2(w, kControlFd) < 0) _exit(126);
    if (boardFd >= 0 && (b < 0 || dup2(b, kBoardFd) < 0)) _exit(126);
    execve(argv[0], argv.data(), envp.data());
    _exit(127);
  }
  close(rep[1]);
  close(ctl[0]);
  c->pid = pid;
  c->report = rep[0];
  c->control = ctl[1];
  c->buffered.clear();
}

bool exitedOk(int status) { return WIFEXITED(status) && WEXITSTATUS(status) == 0; }

std::string statusText(int status) {
  if (WIFEXITED(status)) return "exit " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("signal ") + strsignal(WTERMSIG(status));
  return "status " + std::to_string(status);
}

std::string mib(size_t n) { return std::to_string(n / kMiB) + " MiB"; }

// The parent is a CUDA process of the registration's tenant too.
class Tenant : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ASSERT_EQ(CUDA_SUCCESS, cuInit(0));
    ASSERT_EQ(CUDA_SUCCESS, cuDevicePrimaryCtxRetain(&ctx_, 0));
  }
  static void TearDownTestSuite() {
    if (ctx_) cuDevicePrimaryCtxRelease(0);
    ctx_ = nullptr;
  }
  void SetUp() override {
    ASSERT_EQ(CUDA_SUCCESS, cuCtxSetCurrent(ctx_));
    limit_ = envLimit();
    ASSERT_GT(limit_, 0u) << "CUSHARE_MEMORY_LIMIT must be set by the registration";
  }
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
  static inline CUcontext ctx_ = nullptr;
  size_t limit_ = 0;
};

// CUSHARE_TENANT=race CUSHARE_MEMORY_LIMIT=512MiB SIMGPU_MEMORY=4GiB
using Race = Tenant;
// CUSHARE_TENANT=storm CUSHARE_MEMORY_LIMIT=512MiB SIMGPU_MEMORY=4GiB
using KillStorm = Tenant;
// CUSHARE_TENANT=fx CUSHARE_MEMORY_LIMIT=256MiB SIMGPU_MEMORY=4GiB
using ForkExec = Tenant;
// CUSHARE_TENANT=kq CUSHARE_MEMORY_LIMIT=512MiB, SIMGPU_MEMORY=4GiB and =512MiB
using KilledQuota = Tenant;
// CUSHARE_TENANT=kv CUSHARE_MEMORY_LIMIT=512MiB SIMGPU_MEMORY=4GiB
using KilledView = Tenant;
// CUSHARE_TENANT=nv CUSHARE_MEMORY_LIMIT=512MiB SIMGPU_MEMORY=4GiB
using NvmlView = Tenant;
// CUSHARE_TENANT=sa CUSHARE_MEMORY_LIMIT=256MiB SIMGPU_MEMORY=4GiB (children use other tenants)
using Standalone = Tenant;
using Logging = Tenant;

// Every line a child reports up to and including the first that starts with `last` (or EOF).
std::vector<std::string> linesUntil(Child& c, const std::string& last) {
  std::vector<std::string> lines;
  for (std::string l = c.readLine(); !l.empty(); l = c.readLine()) {
    lines.push_back(l);
    if (l.rfind(last, 0) == 0) break;
  }
  return lines;
}

bool anyContains(const std::vector<std::string>& lines, const std::string& what) {
  return std::any_of(lines.begin(), lines.end(), [&](const std::string& l) { return l.find(what) != l.npos; });
}

std::string joined(const std::vector<std::string>& lines) {
  std::string out;
  for (const std::string& l : lines) out += l + "\n";
  return out;
}

// The device's own accounting (simgpu's NVML without the shim): what it holds in use.
size_t deviceUsed() {
  Child observer;
  spawn(&observer, "nvml", {}, {"LD_PRELOAD"});
  unsigned long long total = 0, free = 0, used = 0;
  observer.readLine();  // init
  EXPECT_EQ(3, std::sscanf(observer.readLine().c_str(), "v1 0 %llu %llu %llu", &total, &free, &used));
  EXPECT_EQ(4096 * kMiB, total) << "the observer must see the whole device";
  observer.closeControl();
  observer.wait();
  return used;
}

// Every churning child reports "done <granted> <denied>" and exits 0; together they allocated a
// lot and were denied at least once (the race reached the limit).
void expectChurnsDone(std::vector<Child>& kids) {
  long granted = 0, denied = 0;
  for (size_t i = 0; i < kids.size(); ++i) {
    const std::string line = kids[i].readLine();
    long g = -1, d = -1;
    EXPECT_EQ(2, std::sscanf(line.c_str(), "done %ld %ld", &g, &d)) << "child " << i << ": '" << line << "'";
    granted += g;
    denied += d;
    const int status = kids[i].wait();
    EXPECT_TRUE(exitedOk(status)) << "child " << i << ": " << statusText(status);
  }
  EXPECT_GT(granted, 100) << "the children hardly allocated";
  EXPECT_GT(denied, 0) << "no allocation was ever denied: the race never reached the limit";
}

// Stops the observer: the device it watched never held more than limit, and came near it.
void expectObservedWithin(Child& observer, size_t limit, unsigned long long minSamples) {
  observer.send('q');
  const std::string seen = observer.readLine();
  unsigned long long maxUsed = 0, total = 0, obsSamples = 0, over = 0;
  ASSERT_EQ(4, std::sscanf(seen.c_str(), "max %llu total %llu samples %llu over %llu", &maxUsed, &total, &obsSamples, &over))
      << seen;
  EXPECT_EQ(0u, over) << "the device held more than the tenant's limit in " << over << " of " << obsSamples << " samples";
  EXPECT_LE(maxUsed, limit) << "the device held " << maxUsed << " bytes for a tenant limited to " << limit;
  EXPECT_GT(maxUsed, limit / 2) << "the observer never saw the tenant near its limit";
  EXPECT_GT(obsSamples, minSamples) << "the observer hardly sampled";
  EXPECT_TRUE(exitedOk(observer.wait()));
}

// ---------------------------------------------------------------------------------------------
// 8 processes of one tenant race for its 512 MiB for about 2 s. Checked from three sides: each
// child's own view after every grant, the parent's view sampled every millisecond, and the
// simulated device itself (an observer without the shim samples simgpu's NVML every millisecond):
// what the device holds never exceeds the tenant's limit.
TEST_F(Race, EightProcessesNeverExceedTheLimit) {
  ASSERT_EQ(limit_, totalMem());
  ASSERT_EQ(limit_, freeMem()) << "the tenant holds memory before the test";
  Child observer;
  ASSERT_NO_FATAL_FAILURE(spawn(&observer, "observe", {std::to_string(limit_)}, {"LD_PRELOAD"}));
  const std::string ready = observer.readLine();
  ASSERT_EQ(0u, ready.rfind("ready ", 0)) << ready;
  EXPECT_EQ(4096 * kMiB, std::strtoull(ready.c_str() + 6, nullptr, 10))
      << "the observer must see the real device (4 GiB), not the tenant's view";

  const int boardFd = memfd_create("cushare-test-board", MFD_CLOEXEC);
  ASSERT_GE(boardFd, 0);
  ASSERT_EQ(0, ftruncate(boardFd, sizeof(Board) * kBoardSlots));
  Board* board = mapBoard(boardFd);
  ASSERT_NE(nullptr, board);

  constexpr int kChildren = 8;
  std::vector<Child> kids(kChildren);
  for (int i = 0; i < kChildren; ++i)
    ASSERT_NO_FATAL_FAILURE(
        spawn(&kids[i], "churn", {"2000", std::to_string(1000 + i), "4", "1", std::to_string(i)}, {}, boardFd));
  close(boardFd);
  for (Child& k : kids) ASSERT_EQ("ready", k.readLine());
  for (Child& k : kids) k.send('g');

  // The parent's view meanwhile, and the board.
  long samples = 0, busy = 0, bad = 0;
  uint64_t boardMax = 0;
  std::string firstBad;
  const auto end = Clock::now() + std::chrono::milliseconds(2200);
  while (Clock::now() < end) {
    for (int k = 0; k < 10; ++k) boardMax = std::max(boardMax, boardTotal(board));
    size_t f = 0, t = 0;
    const CUresult r = cuMemGetInfo(&f, &t);
    ++samples;
    if (r != CUDA_SUCCESS || t != limit_ || f > t) {
      if (bad++ == 0) firstBad = "r=" + std::to_string(r) + " free=" + std::to_string(f) + " total=" + std::to_string(t);
    } else if (f < t) {
      ++busy;
    }
    usleep(1000);
  }
  EXPECT_EQ(0, bad) << "parent's view broken in " << bad << " of " << samples << " samples, first: " << firstBad;
  EXPECT_GT(busy, samples / 4) << "the parent hardly ever saw the children's memory in its view";
  EXPECT_LE(boardMax, limit_) << "over-commit: the tenant's processes held " << boardMax << " bytes at once";
  EXPECT_GT(boardMax, limit_ / 2) << "the children never came near the limit together";

  ASSERT_NO_FATAL_FAILURE(expectChurnsDone(kids));
  ASSERT_NO_FATAL_FAILURE(expectObservedWithin(observer, limit_, 200));

  // Everything came back: the children freed what they held and exited.
  EXPECT_EQ(0u, boardTotal(board));
  EXPECT_EQ(limit_, freeMem());
  munmap(board, sizeof(Board) * kBoardSlots);
}

// Churning processes are killed with SIGKILL at random instants, about 50 times in 3 s, and
// restarted; in the end all of them are killed. Nothing may leak: the tenant's view shows the
// whole limit free, and one allocation of the whole limit succeeds.
TEST_F(KillStorm, NothingLeaksFromKilledProcesses) {
  ASSERT_EQ(limit_, freeMem());
  constexpr int kChildren = 8;
  constexpr int kKills = 50;
  std::vector<Child> kids(kChildren);
  unsigned seed = 1;
  for (Child& k : kids) ASSERT_NO_FATAL_FAILURE(spawn(&k, "churn", {"60000", std::to_string(seed++), "4", "0", "-1"}));
  std::mt19937 rng(42);
  int killedWhileRunning = 0;
  for (int i = 0; i < kKills; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20 + rng() % 80));
    Child& k = kids[rng() % kChildren];
    const std::string said = k.drain();
    EXPECT_EQ(std::string::npos, said.find("bad")) << said;
    k.kill9();
    const int status = k.wait();
    if (WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
      ++killedWhileRunning;
    else
      ADD_FAILURE() << "a churning child ended by itself: " << statusText(status) << " after '" << said << "'";
    ASSERT_NO_FATAL_FAILURE(spawn(&k, "churn", {"60000", std::to_string(seed++), "4", "0", "-1"}));
  }
  // Let the last ones get going, then kill them all while they hold memory.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  for (Child& k : kids) {
    const std::string said = k.drain();
    EXPECT_EQ(std::string::npos, said.find("bad")) << said;
    k.kill9();
  }
  for (Child& k : kids) EXPECT_TRUE(WIFSIGNALED(k.wait()));
  EXPECT_EQ(kKills, killedWhileRunning);

  // The view first: a framework sizes its cache from cuMemGetInfo before allocating anything.
  EXPECT_EQ(limit_, freeMem()) << "killed processes' usage still shows in the tenant's view (" << mib(limit_ - freeMem())
                               << " of " << mib(limit_) << ")";
  CUdeviceptr p = 0;
  ASSERT_EQ(CUDA_SUCCESS, cuMemAlloc(&p, limit_)) << "quota leaked by killed processes";
  EXPECT_EQ(0u, freeMem());
  ASSERT_EQ(CUDA_SUCCESS, cuMemFree(p));
  EXPECT_EQ(limit_, freeMem());
}

// Two tenants side by side, each child with its own CUSHARE_TENANT / CUSHARE_MEMORY_LIMIT: each sees
// its own total, and each is limited by its own limit only.
TEST(TwoTenants, EachIsLimitedByItsOwnLimit) {
  const std::string a256 = std::to_string(256 * kMiB), b768 = std::to_string(768 * kMiB);
  Child a, b;
  ASSERT_NO_FATAL_FAILURE(spawn(&a, "script",
                                {"info", "alloc:" + a256, "alloc:1", "info", "wait", "alloc:1", "alloc:" + std::to_string(kMiB), "info"},
                                {"CUSHARE_TENANT=tenant-a", "CUSHARE_MEMORY_LIMIT=256MiB"}));
  EXPECT_EQ("info " + a256 + " " + a256, a.readLine()) << "tenant A's view at the start";
  EXPECT_EQ("alloc 0", a.readLine()) << "A allocates its whole limit";
  EXPECT_EQ("alloc 2", a.readLine()) << "A is denied past 256 MiB";
  EXPECT_EQ("info 0 " + a256, a.readLine());
  EXPECT_EQ("wait", a.readLine());

  // B, while A holds its 256 MiB.
  const std::string b1g = std::to_string(1024 * kMiB);
  ASSERT_NO_FATAL_FAILURE(spawn(&b, "script",
                                {"info", "alloc:" + b768, "info", "alloc:" + std::to_string(256 * kMiB), "alloc:1", "info"},
                                {"CUSHARE_TENANT=tenant-b", "CUSHARE_MEMORY_LIMIT=1GiB"}));
  EXPECT_EQ("info " + b1g + " " + b1g, b.readLine()) << "tenant B's view at the start (A's use is not B's)";
  EXPECT_EQ("alloc 0", b.readLine()) << "B allocates 768 MiB while A is at its limit";
  EXPECT_EQ("info " + std::to_string(256 * kMiB) + " " + b1g, b.readLine());
  EXPECT_EQ("alloc 0", b.readLine()) << "B fills its own limit";
  EXPECT_EQ("alloc 2", b.readLine()) << "B is denied past 1 GiB";
  EXPECT_EQ("info 0 " + b1g, b.readLine());
  EXPECT_EQ("end", b.readLine());

  // A is still at its limit and still denied, however much B holds.
  a.send('g');
  EXPECT_EQ("alloc 2", a.readLine());
  EXPECT_EQ("alloc 2", a.readLine());
  EXPECT_EQ("info 0 " + a256, a.readLine());
  EXPECT_EQ("end", a.readLine());
  a.closeControl();
  b.closeControl();
  EXPECT_TRUE(exitedOk(a.wait()));
  EXPECT_TRUE(exitedOk(b.wait()));
}

// A process holding 200 MiB of a 256 MiB limit fork+execs a child of the same tenant: the parent's
// use counts against the child (denied at 100 MiB), and once the parent frees, the child's retries
// succeed.
TEST_F(ForkExec, ParentUsageCountsForTheExecedChild) {
  ASSERT_EQ(256 * kMiB, limit_);
  CUdeviceptr mine = 0;
  ASSERT_EQ(CUDA_SUCCESS, cuMemAlloc(&mine, 200 * kMiB));
  const std::string hundred = std::to_string(100 * kMiB);
  Child c;
  ASSERT_NO_FATAL_FAILURE(spawn(&c, "script", {"info", "alloc:" + hundred, "retry:" + hundred + ":10000", "info"}));
  EXPECT_EQ("info " + std::to_string(56 * kMiB) + " " + std::to_string(limit_), c.readLine())
      << "the child's view must include the parent's 200 MiB";
  EXPECT_EQ("alloc 2", c.readLine()) << "100 MiB more than 56 MiB left must be denied";
  // The child keeps retrying (and being denied) while the parent holds its memory.
  EXPECT_EQ("", c.readLine(300)) << "the child got its memory while the parent still held 200 MiB";
  ASSERT_EQ(CUDA_SUCCESS, cuMemFree(mine));
  EXPECT_EQ("alloc 0", c.readLine()) << "after the parent freed, the child's retry must succeed";
  EXPECT_EQ("info " + std::to_string(156 * kMiB) + " " + std::to_string(limit_), c.readLine());
  EXPECT_EQ("end", c.readLine());
  EXPECT_EQ(156 * kMiB, freeMem()) << "the parent sees the child's 100 MiB";
  c.closeControl();
  EXPECT_TRUE(exitedOk(c.wait()));
  // The child exited holding its 100 MiB (no free): its usage comes back.
  CUdeviceptr all = 0;
  EXPECT_EQ(CUDA_SUCCESS, cuMemAlloc(&all, limit_));
  if (all) {
    EXPECT_EQ(CUDA_SUCCESS, cuMemFree(all));
  }
}

// A plain fork (no exec, the child never touches CUDA) must not take the parent's usage with it
// when the child exits: the parent's 200 MiB stay counted.
TEST_F(ForkExec, ForkedChildExitDoesNotReturnParentUsage) {
  CUdeviceptr mine = 0;
  ASSERT_EQ(CUDA_SUCCESS, cuMemAlloc(&mine, 200 * kMiB));
  for (int how = 0; how < 2; ++how) {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      if (how == 0) _exit(0);
      raise(SIGKILL);
    }
    int status = 0;
    ASSERT_EQ(pid, waitpid(pid, &status, 0));
  }
  EXPECT_EQ(56 * kMiB, freeMem());
  CUdeviceptr more = 0;
  EXPECT_EQ(CUDA_ERROR_OUT_OF_MEMORY, cuMemAlloc(&more, 57 * kMiB)) << "the parent's usage was lost with its forked child";
  ASSERT_EQ(CUDA_SUCCESS, cuMemAlloc(&more, 56 * kMiB));
  ASSERT_EQ(CUDA_SUCCESS, cuMemFree(more));
  ASSERT_EQ(CUDA_SUCCESS, cuMemFree(mine));
  EXPECT_EQ(limit_, freeMem());
}

// A child holds the whole limit and is killed; right after reaping it (no polling, no delay) the
// parent allocates the whole limit: the shim returns a dead process's quota before it denies.
TEST_F(KilledQuota, KilledProcessQuotaReturnsBeforeADenial) {
  for (int round = 0; round < 5; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    Child c;
    ASSERT_NO_FATAL_FAILURE(spawn(&c, "script", {"alloc:" + std::to_string(limit_)}));
    ASSERT_EQ("alloc 0", c.readLine());
    ASSERT_EQ("end", c.readLine());
    CUdeviceptr p = 0;
    EXPECT_EQ(CUDA_ERROR_OUT_OF_MEMORY, cuMemAlloc(&p, kMiB)) << "the child holds the whole limit";
    c.kill9();
    const int status = c.wait();
    EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << statusText(status);
    ASSERT_EQ(CUDA_SUCCESS, cuMemAlloc(&p, limit_)) << "the killed child's quota was not returned before the denial";
    EXPECT_EQ(0u, freeMem());
    ASSERT_EQ(CUDA_SUCCESS, cuMemFree(p));
    EXPECT_EQ(limit_, freeMem());
  }
}

// The smallest case of what the kill storm shows: a killed process's usage must not stay in the
// tenant's view. Frameworks size their caches from cuMemGetInfo / NVML before they allocate
// anything (vLLM's gpu_memory_utilization, PyTorch's caching allocator), so a view that still
// counts a dead process under-reports free memory until some allocation happens to be denied.
TEST_F(KilledView, ViewDoesNotCountKilledProcesses) {
  ASSERT_EQ(limit_, freeMem());
  Child c;
  ASSERT_NO_FATAL_FAILURE(spawn(&c, "script", {"alloc:" + std::to_string(200 * kMiB)}));
  ASSERT_EQ("alloc 0", c.readLine());
  ASSERT_EQ("end", c.readLine());
  EXPECT_EQ(limit_ - 200 * kMiB, freeMem());
  c.kill9();
  c.wait();
  EXPECT_EQ(limit_, freeMem()) << "cuMemGetInfo still counts the killed process's 200 MiB";
  ASSERT_EQ(NVML_SUCCESS, nvmlInit_v2());
  nvmlDevice_t d;
  ASSERT_EQ(NVML_SUCCESS, nvmlDeviceGetHandleByIndex_v2(0, &d));
  nvmlMemory_t m{};
  ASSERT_EQ(NVML_SUCCESS, nvmlDeviceGetMemoryInfo(d, &m));
  EXPECT_EQ(limit_, m.total);
  EXPECT_EQ(limit_, m.free) << "NVML (through the shim) still counts the killed process's 200 MiB";
  nvmlShutdown();
  // An allocation that needs the dead process's share reaps it (as documented), and the view heals.
  CUdeviceptr p = 0;
  ASSERT_EQ(CUDA_SUCCESS, cuMemAlloc(&p, limit_));
  ASSERT_EQ(CUDA_SUCCESS, cuMemFree(p));
  EXPECT_EQ(limit_, freeMem());
}

// An NVML-only process of the tenant (nvidia-smi or a framework's pynvml start-up check: never
// cuInit) sees the tenant's view while another process of the tenant holds memory: the limit as
// total, the tenant's use as used, the rest as free; through both ABIs. Without the shim's NVML
// set-up it saw the whole device.
TEST_F(NvmlView, NvmlOnlyProcessSeesTheTenantView) {
  CUdeviceptr held = 0;
  ASSERT_EQ(CUDA_SUCCESS, cuMemAlloc(&held, 200 * kMiB));
  Child c;
  ASSERT_NO_FATAL_FAILURE(spawn(&c, "nvml", {}));
  const std::string total = std::to_string(limit_), used = std::to_string(200 * kMiB),
                    free = std::to_string(limit_ - 200 * kMiB);
  EXPECT_EQ("init 0", c.readLine());
  EXPECT_EQ("v1 0 " + total + " " + free + " " + used, c.readLine());
  EXPECT_EQ("v2 0 " + total + " " + free + " " + used, c.readLine());
  EXPECT_EQ("end", c.readLine());
  c.closeControl();
  EXPECT_TRUE(exitedOk(c.wait()));
  EXPECT_GE(deviceUsed(), 200 * kMiB) << "the device itself holds the parent's memory";
  ASSERT_EQ(CUDA_SUCCESS, cuMemFree(held));

  // The first process of a tenant may be an NVML-only one: its environment sets the limit.
  Child first;
  ASSERT_NO_FATAL_FAILURE(spawn(&first, "nvml", {}, {"CUSHARE_TENANT=nv-first", "CUSHARE_MEMORY_LIMIT=300MiB"}));
  const std::string t300 = std::to_string(300 * kMiB);
  EXPECT_EQ("init 0", first.readLine());
  EXPECT_EQ("v1 0 " + t300 + " " + t300 + " 0", first.readLine());
  EXPECT_EQ("v2 0 " + t300 + " " + t300 + " 0", first.readLine());
  first.closeControl();
  EXPECT_TRUE(exitedOk(first.wait()));
}

// Per-process lists through every ABI show the tenant's own processes only, with what the device
// holds for each: another tenant's process and its memory stay hidden, while the device itself
// holds both. NVML's buffer protocol holds for the filtered list.
TEST_F(NvmlView, ProcessListsShowTheTenantsProcessesOnly) {
  CUdeviceptr held = 0;
  ASSERT_EQ(CUDA_SUCCESS, cuMemAlloc(&held, 200 * kMiB));
  Child other;
  ASSERT_NO_FATAL_FAILURE(spawn(&other, "script", {"alloc:" + std::to_string(100 * kMiB)},
                                {"CUSHARE_TENANT=nv-other", "CUSHARE_MEMORY_LIMIT=300MiB"}));
  ASSERT_EQ("alloc 0", other.readLine());
  ASSERT_EQ("end", other.readLine());
  EXPECT_GE(deviceUsed(), 300 * kMiB) << "the device holds both tenants' memory";

  ASSERT_EQ(NVML_SUCCESS, nvmlInit_v2());
  nvmlDevice_t d;
  ASSERT_EQ(NVML_SUCCESS, nvmlDeviceGetHandleByIndex_v2(0, &d));
  const unsigned self = static_cast<unsigned>(getpid());
  {
    nvmlProcessInfo_t infos[8];
    unsigned n = 8;
    ASSERT_EQ(NVML_SUCCESS, nvmlDeviceGetComputeRunningProcesses_v3(d, &n, infos));
    ASSERT_EQ(1u, n) << "only this tenant's process";
    EXPECT_EQ(self, infos[0].pid);
    EXPECT_EQ(200 * kMiB, infos[0].usedGpuMemory);
    n = 8;
    ASSERT_EQ(NVML_SUCCESS, nvmlDeviceGetComputeRunningProcesses_v2(d, &n, infos));
    ASSERT_EQ(1u, n);
    EXPECT_EQ(self, infos[0].pid);
    // The size query counts the filtered list.
    n = 0;
    EXPECT_EQ(NVML_ERROR_INSUFFICIENT_SIZE, nvmlDeviceGetComputeRunningProcesses_v3(d, &n, nullptr));
    EXPECT_EQ(1u, n);
    EXPECT_EQ(NVML_ERROR_INVALID_ARGUMENT, nvmlDeviceGetComputeRunningProcesses_v3(d, nullptr, infos));
    n = 8;
    EXPECT_EQ(NVML_SUCCESS, nvmlDeviceGetMPSComputeRunningProcesses_v3(d, &n, infos));
    EXPECT_EQ(0u, n);
    n = 8;
    EXPECT_EQ(NVML_SUCCESS, nvmlDeviceGetGraphicsRunningProcesses_v3(d, &n, infos));
    EXPECT_EQ(0u, n);
  }
  {
    nvmlProcessDetail_v1_t details[8];
    nvmlProcessDetailList_t list{};
    list.version = nvmlProcessDetailList_v1;
    list.mode = NVML_PROCESS_MODE_ALL;
    EXPECT_EQ(NVML_ERROR_INSUFFICIENT_SIZE, nvmlDeviceGetRunningProcessDetailList(d, &list));
    EXPECT_EQ(1u, list.numProcArrayEntries) << "the size query counts the tenant's processes only";
    list.numProcArrayEntries = 8;
    list.procArray = details;
    ASSERT_EQ(NVML_SUCCESS, nvmlDeviceGetRunningProcessDetailList(d, &list));
    ASSERT_EQ(1u, list.numProcArrayEntries);
    EXPECT_EQ(self, details[0].pid);
    EXPECT_EQ(200 * kMiB, details[0].usedGpuMemory);
  }
  {
    // Utilisation samples: only this tenant's pids (the other tenant's process has a context).
    nvmlProcessUtilizationSample_t samples[8];
    unsigned n = 8;
    const nvmlReturn_t r = nvmlDeviceGetProcessUtilization(d, samples, &n, 0);
    ASSERT_TRUE(r == NVML_SUCCESS || r == NVML_ERROR_NOT_FOUND) << r;
    if (r == NVML_SUCCESS) {
      for (unsigned i = 0; i < n; ++i) EXPECT_EQ(self, samples[i].pid) << "another tenant's pid in the samples";
    }
    n = 0;
    const nvmlReturn_t q = nvmlDeviceGetProcessUtilization(d, nullptr, &n, 0);
    if (q == NVML_ERROR_INSUFFICIENT_SIZE) {
      EXPECT_LE(n, 1u) << "the size query counts another tenant's process";
    }
  }
  {
    // The legacy (v1) entry points, as a program built against an old header or a dlsym user
    // (pynvml) reaches them.
    using V1 = nvmlReturn_t (*)(nvmlDevice_t, unsigned*, nvmlProcessInfo_v1_t*);
    const auto compute = reinterpret_cast<V1>(dlsym(RTLD_DEFAULT, "nvmlDeviceGetComputeRunningProcesses"));
    const auto mps = reinterpret_cast<V1>(dlsym(RTLD_DEFAULT, "nvmlDeviceGetMPSComputeRunningProcesses"));
    ASSERT_TRUE(compute && mps);
    nvmlProcessInfo_v1_t infos[8];
    unsigned n = 8;
    ASSERT_EQ(NVML_SUCCESS, compute(d, &n, infos));
    ASSERT_EQ(1u, n);
    EXPECT_EQ(self, infos[0].pid);
    EXPECT_EQ(200 * kMiB, infos[0].usedGpuMemory);
    n = 8;
    EXPECT_EQ(NVML_SUCCESS, mps(d, &n, infos));
    EXPECT_EQ(0u, n);
  }
  nvmlShutdown();
  other.closeControl();
  EXPECT_TRUE(exitedOk(other.wait()));
  ASSERT_EQ(CUDA_SUCCESS, cuMemFree(held));
}

// A configuration the shim refuses fails NVML too, at nvmlInit, with the shim's line; and one NVML
// cannot resolve without CUDA (limits by CUDA ordinal) fails the memory queries: never the whole
// device.
TEST_F(NvmlView, BadConfigurationFailsInNvmlTerms) {
  Child bad;
  ASSERT_NO_FATAL_FAILURE(spawn(&bad, "nvml", {"stderr"}, {"CUSHARE_MEMORY_LIMIT=lots"}));
  const auto lines = linesUntil(bad, "end");
  EXPECT_TRUE(anyContains(lines, "invalid CUSHARE_MEMORY_LIMIT='lots'")) << joined(lines);
  EXPECT_TRUE(anyContains(lines, "init " + std::to_string(NVML_ERROR_UNKNOWN))) << joined(lines);
  bad.closeControl();
  bad.wait();

  Child ordinal;
  ASSERT_NO_FATAL_FAILURE(spawn(&ordinal, "nvml", {"stderr"}, {"CUSHARE_TENANT=nv-ordinal", "CUSHARE_MEMORY_LIMIT=0=128MiB"}));
  const auto ol = linesUntil(ordinal, "end");
  EXPECT_TRUE(anyContains(ol, "names devices by ordinal")) << joined(ol);
  const std::string unknown = std::to_string(NVML_ERROR_UNKNOWN);
  EXPECT_TRUE(anyContains(ol, "v1 " + unknown + " ")) << joined(ol);
  EXPECT_TRUE(anyContains(ol, "v2 " + unknown + " ")) << joined(ol);
  ordinal.closeControl();
  ordinal.wait();
}

// `cushare env` output used without the broker's ledger directory (not mounted, or misspelt):
// with CUSHARE_REQUIRE_BROKER=1 the process fails closed and says why; without it, the
// environment's limit still holds (standalone).
TEST_F(Standalone, RequireBrokerFailsClosedWithoutTheBrokersDirectory) {
  const char* dir = std::getenv("CUSHARE_LEDGER_DIR");
  ASSERT_NE(nullptr, dir);
  const std::string typo = std::string(dir) + "-typo";
  Child c;
  ASSERT_NO_FATAL_FAILURE(spawn(&c, "script", {"stderr", "alloc:" + std::to_string(64 * kMiB)},
                                {"CUSHARE_TENANT=rb", "CUSHARE_LEDGER_DIR=" + typo, "CUSHARE_REQUIRE_BROKER=1"}));
  const auto lines = linesUntil(c, "init");
  EXPECT_TRUE(anyContains(lines, "CUSHARE_REQUIRE_BROKER=1, but no broker owns the ledger directory " + typo))
      << joined(lines);
  ASSERT_FALSE(lines.empty());
  EXPECT_EQ("init " + std::to_string(CUDA_ERROR_NOT_INITIALIZED), lines.back()) << joined(lines);
  c.wait();
  EXPECT_NE(0, access(typo.c_str(), F_OK)) << "the shim created the misspelt directory";

  Child e;
  const std::string over = std::to_string(128 * kMiB + kMiB), at = std::to_string(128 * kMiB);
  ASSERT_NO_FATAL_FAILURE(spawn(&e, "script", {"alloc:" + over, "alloc:" + at, "info", "wait"},
                                {"CUSHARE_TENANT=rb", "CUSHARE_LEDGER_DIR=" + typo, "CUSHARE_MEMORY_LIMIT=128MiB"}));
  EXPECT_EQ("alloc 2", e.readLine()) << "the environment's limit did not hold without the ledger directory";
  EXPECT_EQ("alloc 0", e.readLine());
  EXPECT_EQ("info 0 " + at, e.readLine());
  EXPECT_EQ("wait", e.readLine());
  const size_t onDevice = deviceUsed();
  EXPECT_GE(onDevice, 128 * kMiB);
  EXPECT_LT(onDevice, 128 * kMiB + kMiB) << "the device holds more than the environment's limit";
  e.closeControl();
  e.wait();
  std::filesystem::remove_all(typo);
}

// Standalone, the limit belongs to the tenant's session: a process started while another lives
// cannot raise it (refused with a warning) but may lower it for itself; once every process exited
// (or was killed), the next one's CUSHARE_MEMORY_LIMIT applies.
TEST_F(Standalone, TheNextSessionTakesTheNewLimit) {
  const std::string t256 = std::to_string(256 * kMiB), t128 = std::to_string(128 * kMiB),
                    t512 = std::to_string(512 * kMiB), t1g = std::to_string(1024 * kMiB);
  Child a;
  ASSERT_NO_FATAL_FAILURE(spawn(&a, "script", {"info", "wait", "info"}, {"CUSHARE_TENANT=sess", "CUSHARE_MEMORY_LIMIT=256MiB"}));
  EXPECT_EQ("info " + t256 + " " + t256, a.readLine());
  EXPECT_EQ("wait", a.readLine());

  Child higher;
  ASSERT_NO_FATAL_FAILURE(spawn(&higher, "script", {"stderr", "info", "alloc:" + std::to_string(300 * kMiB)},
                                {"CUSHARE_TENANT=sess", "CUSHARE_MEMORY_LIMIT=512MiB"}));
  const auto hl = linesUntil(higher, "alloc");
  EXPECT_TRUE(anyContains(hl, "asks for " + t512 + " bytes, but the tenant's running processes use a limit of " + t256))
      << joined(hl);
  EXPECT_TRUE(anyContains(hl, "info " + t256 + " " + t256)) << joined(hl);
  EXPECT_EQ("alloc 2", hl.back()) << "a raised limit applied while the tenant's first process lives";
  higher.closeControl();
  higher.wait();

  Child lower;
  ASSERT_NO_FATAL_FAILURE(spawn(&lower, "script", {"info", "alloc:" + std::to_string(200 * kMiB)},
                                {"CUSHARE_TENANT=sess", "CUSHARE_MEMORY_LIMIT=128MiB"}));
  EXPECT_EQ("info " + t128 + " " + t128, lower.readLine());
  EXPECT_EQ("alloc 2", lower.readLine()) << "a lower limit must apply to its own process";
  lower.closeControl();
  lower.wait();
  a.send('g');
  EXPECT_EQ("info " + t256 + " " + t256, a.readLine()) << "the lower limit leaked to the others";
  a.closeControl();
  EXPECT_TRUE(exitedOk(a.wait()));

  // Everyone exited: the next process's limit is the tenant's.
  Child next;
  ASSERT_NO_FATAL_FAILURE(spawn(&next, "script", {"info", "alloc:" + std::to_string(400 * kMiB)},
                                {"CUSHARE_TENANT=sess", "CUSHARE_MEMORY_LIMIT=512MiB"}));
  EXPECT_EQ("info " + t512 + " " + t512, next.readLine()) << "the previous session's limit stuck";
  EXPECT_EQ("alloc 0", next.readLine());
  EXPECT_EQ("end", next.readLine());
  // Killed with -9 while holding memory: its session ends too, and its memory comes back.
  next.kill9();
  next.wait();
  Child after;
  ASSERT_NO_FATAL_FAILURE(spawn(&after, "script", {"info"}, {"CUSHARE_TENANT=sess", "CUSHARE_MEMORY_LIMIT=1GiB"}));
  EXPECT_EQ("info " + t1g + " " + t1g, after.readLine());
  after.closeControl();
  EXPECT_TRUE(exitedOk(after.wait()));
}

// CUSHARE_LOG_LEVEL=error keeps what an operator must see: a denial, with its allocation site.
TEST_F(Logging, DenialsShowAtLogLevelError) {
  Child c;
  ASSERT_NO_FATAL_FAILURE(spawn(&c, "script", {"stderr", "alloc:" + std::to_string(limit_ + 1)},
                                {"CUSHARE_LOG_LEVEL=error", "CUSHARE_TENANT=quiet"}));
  const auto lines = linesUntil(c, "alloc");
  // The line names the charge: linear allocations are charged in the driver's 256-byte units.
  EXPECT_TRUE(anyContains(lines, "allocation of " + std::to_string(limit_ + 256) + " bytes denied")) << joined(lines);
  EXPECT_TRUE(anyContains(lines, "  #0 ")) << "no allocation site with the denial:\n" << joined(lines);
  // The application's frames, readable: the shim's own left out, names demangled (issue 26: a
  // denial printed seven mangled frames of the shim).
  EXPECT_FALSE(anyContains(lines, "cushare4shim") || anyContains(lines, "cushare::shim")) << joined(lines);
  EXPECT_TRUE(anyContains(lines, "childMain(std::")) << "demangled\n" << joined(lines);
  ASSERT_FALSE(lines.empty());
  EXPECT_EQ("alloc 2", lines.back());
  c.closeControl();
  c.wait();
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Device visibility: processes of one tenant that number the host's devices differently
// (CUDA_VISIBLE_DEVICES by index, reordered, by UUID, cut short by an invalid entry; a container's
// subset, SIMGPU_CONTAINER_DEVICES) share one budget per physical device. Judged by simgpu's own
// per-device count (device_used.h). Host: SIMGPU_DEVICES=2 SIMGPU_MEMORY=1GiB,2GiB.

constexpr const char* kHostUuid0 = "GPU-5e1a90c0-513d-4b1e-8a7f-2c6100000000";
constexpr const char* kHostUuid1 = "GPU-5e1a90c0-513d-4b1e-8a7f-2c6100000001";

std::string errCode(CUresult r) { return std::to_string(static_cast<int>(r)); }

// CUSHARE_TENANT=vis CUSHARE_MEMORY_LIMIT=<host 0's UUID>=256MiB,<host 1's UUID>=512MiB: one list
// for every process, whatever it sees.
TEST(Visibility, EachProcessIsLimitedOnTheHostDeviceBehindItsOrdinal) {
  using cushare::test::deviceUsed;
  const std::string oom = "alloc " + errCode(CUDA_ERROR_OUT_OF_MEMORY), ok = "alloc 0";

  // Sees host device 1 only, as its device 0: host 1's limit (512 MiB), not host 0's.
  Child a;
  ASSERT_NO_FATAL_FAILURE(spawn(&a, "script", {"alloc:" + std::to_string(512 * kMiB), "alloc:" + std::to_string(kMiB),
                                              "info", "wait", "freeall"},
                                {"CUDA_VISIBLE_DEVICES=1"}));
  EXPECT_EQ(ok, a.readLine());
  EXPECT_EQ(oom, a.readLine());
  EXPECT_EQ("info 0 " + std::to_string(512 * kMiB), a.readLine());
  EXPECT_EQ("wait", a.readLine());
  EXPECT_EQ(512 * kMiB, deviceUsed(1));
  EXPECT_EQ(0u, deviceUsed(0));

  // Every other numbering of host device 1 finds its budget spent.
  const std::vector<EnvEdits> host1 = {
      {"CUDA_VISIBLE_DEVICES=1,0"},
      {std::string("CUDA_VISIBLE_DEVICES=") + kHostUuid1},
      {"CUDA_VISIBLE_DEVICES=1,7,0"},  // the list ends at 7: only host device 1
      {std::string("SIMGPU_CONTAINER_DEVICES=") + kHostUuid1},
      {"SIMGPU_CONTAINER_DEVICES=1,0", "CUDA_VISIBLE_DEVICES=1,0"},
  };
  for (const EnvEdits& e : host1) {
    Child c;
    ASSERT_NO_FATAL_FAILURE(spawn(&c, "script", {"alloc:" + std::to_string(kMiB), "info", "total"}, e));
    EXPECT_EQ(oom, c.readLine()) << e[0];
    EXPECT_EQ("info 0 " + std::to_string(512 * kMiB), c.readLine()) << e[0];
    EXPECT_EQ("total " + std::to_string(512 * kMiB), c.readLine()) << e[0];
    EXPECT_EQ("end", c.readLine()) << e[0];
    c.closeControl();
    EXPECT_TRUE(exitedOk(c.wait())) << e[0];
  }
  EXPECT_EQ(512 * kMiB, deviceUsed(1)) << "a process charged host device 1 beyond the tenant's limit";

  // Host device 0, by UUID and inside a container of both: its own 256 MiB, untouched by the above.
  const std::vector<EnvEdits> host0 = {{std::string("CUDA_VISIBLE_DEVICES=") + kHostUuid0},
                                       {"SIMGPU_CONTAINER_DEVICES=0", "CUDA_VISIBLE_DEVICES=0"}};
  for (const EnvEdits& e : host0) {
    Child c;
    ASSERT_NO_FATAL_FAILURE(spawn(&c, "script", {"alloc:" + std::to_string(256 * kMiB), "alloc:" + std::to_string(kMiB),
                                                "wait", "freeall"}, e));
    EXPECT_EQ(ok, c.readLine()) << e[0];
    EXPECT_EQ(oom, c.readLine()) << e[0];
    EXPECT_EQ("wait", c.readLine()) << e[0];
    EXPECT_EQ(256 * kMiB, deviceUsed(0)) << e[0];
    EXPECT_EQ(512 * kMiB, deviceUsed(1)) << e[0];
    c.send('f');
    EXPECT_EQ("freeall 0", c.readLine()) << e[0];
    EXPECT_EQ("end", c.readLine()) << e[0];
    c.closeControl();
    EXPECT_TRUE(exitedOk(c.wait())) << e[0];
  }
  EXPECT_EQ(0u, deviceUsed(0));

  // The NVML view (a process that only uses NVML): NVML ignores CUDA_VISIBLE_DEVICES, so its
  // device 0 is host device 0 (256 MiB) under CUDA_VISIBLE_DEVICES=1, and host device 1 (512 MiB,
  // A's 512 MiB in use) in a container of host device 1.
  const std::vector<std::pair<EnvEdits, std::string>> nvmlViews = {
      {{"CUDA_VISIBLE_DEVICES=1"}, "v1 0 " + std::to_string(256 * kMiB) + " " + std::to_string(256 * kMiB) + " 0"},
      {{"SIMGPU_CONTAINER_DEVICES=1"}, "v1 0 " + std::to_string(512 * kMiB) + " 0 " + std::to_string(512 * kMiB)},
  };
  for (const auto& [e, want] : nvmlViews) {
    Child c;
    ASSERT_NO_FATAL_FAILURE(spawn(&c, "nvml", {}, e));
    EXPECT_EQ("init 0", c.readLine()) << e[0];
    EXPECT_EQ(want, c.readLine()) << e[0];
    EXPECT_EQ(0u, c.readLine().rfind("v2 0 ", 0)) << e[0];
    EXPECT_EQ("end", c.readLine()) << e[0];
    c.closeControl();
    EXPECT_TRUE(exitedOk(c.wait())) << e[0];
  }

  // No device at all (empty list, a repeated device): cuInit fails as the real driver's does.
  for (const char* v : {"CUDA_VISIBLE_DEVICES=", "CUDA_VISIBLE_DEVICES=1,1"}) {
    Child c;
    ASSERT_NO_FATAL_FAILURE(spawn(&c, "script", {"alloc:1"}, {v}));
    EXPECT_EQ("init " + errCode(CUDA_ERROR_NO_DEVICE), c.readLine()) << v;
    EXPECT_FALSE(exitedOk(c.wait())) << v;
  }

  // Once A frees, a process in a container of host device 1 gets the whole 512 MiB.
  a.send('f');
  EXPECT_EQ("freeall 0", a.readLine());
  Child d;
  ASSERT_NO_FATAL_FAILURE(
      spawn(&d, "script", {"alloc:" + std::to_string(512 * kMiB), "wait", "freeall"}, {"SIMGPU_CONTAINER_DEVICES=1"}));
  EXPECT_EQ(ok, d.readLine());
  EXPECT_EQ("wait", d.readLine());
  EXPECT_EQ(512 * kMiB, deviceUsed(1));
  d.send('f');
  EXPECT_EQ("freeall 0", d.readLine());
  EXPECT_EQ("end", d.readLine());
  d.closeControl();
  EXPECT_TRUE(exitedOk(d.wait()));
  a.closeControl();
  EXPECT_TRUE(exitedOk(a.wait()));
  EXPECT_EQ(0u, deviceUsed(1));
}

// Per-ordinal limits are the process's own ordinals: under CUDA_VISIBLE_DEVICES=1,0, `0=` is host
// device 1. A list naming an ordinal the process does not have fails cuInit, never runs unlimited.
TEST(Visibility, OrdinalLimitsAreTheProcessOwnNumbering) {
  using cushare::test::deviceUsed;
  Child c;
  ASSERT_NO_FATAL_FAILURE(spawn(&c, "script", {"alloc:" + std::to_string(101 * kMiB), "alloc:" + std::to_string(100 * kMiB),
                                              "wait", "freeall"},
                                {"CUSHARE_TENANT=vis-ordinal", "CUSHARE_MEMORY_LIMIT=0=100MiB,1=1GiB", "CUDA_VISIBLE_DEVICES=1,0"}));
  EXPECT_EQ("alloc " + errCode(CUDA_ERROR_OUT_OF_MEMORY), c.readLine());
  EXPECT_EQ("alloc 0", c.readLine());
  EXPECT_EQ("wait", c.readLine());
  EXPECT_EQ(100 * kMiB, deviceUsed(1));
  EXPECT_EQ(0u, deviceUsed(0));
  c.send('f');
  EXPECT_EQ("freeall 0", c.readLine());
  EXPECT_EQ("end", c.readLine());
  c.closeControl();
  EXPECT_TRUE(exitedOk(c.wait()));

  Child bad;
  ASSERT_NO_FATAL_FAILURE(spawn(&bad, "script", {"alloc:1"},
                                {"CUSHARE_TENANT=vis-ordinal", "CUSHARE_MEMORY_LIMIT=0=100MiB,1=1GiB", "CUDA_VISIBLE_DEVICES=1"}));
  EXPECT_EQ("init " + errCode(CUDA_ERROR_NOT_INITIALIZED), bad.readLine());
  EXPECT_FALSE(exitedOk(bad.wait()));
  // A UUID list that leaves a visible device unnamed while naming one it cannot see: refused too.
  Child typo;
  ASSERT_NO_FATAL_FAILURE(spawn(&typo, "script", {"alloc:1"},
                                {"CUSHARE_TENANT=vis-ordinal", std::string("CUSHARE_MEMORY_LIMIT=") + kHostUuid0 + "=100MiB",
                                 "CUDA_VISIBLE_DEVICES=1"}));
  EXPECT_EQ("init " + errCode(CUDA_ERROR_NOT_INITIALIZED), typo.readLine());
  EXPECT_FALSE(exitedOk(typo.wait()));
}

// CUSHARE_TENANT=visrace CUSHARE_MEMORY_LIMIT=512MiB: 8 processes race for host device 1, which
// each numbers its own way; an observer in a container of host device 1 (so its NVML index 0 is
// that device) samples simgpu's NVML without the shim. The device never holds more than the limit.
TEST(Visibility, RaceAcrossNumberingsOfOneDevice) {
  const size_t limit = envLimit();
  ASSERT_EQ(512 * kMiB, limit);
  Child observer;
  ASSERT_NO_FATAL_FAILURE(spawn(&observer, "observe", {std::to_string(limit)}, {"LD_PRELOAD", "SIMGPU_CONTAINER_DEVICES=1"}));
  const std::string ready = observer.readLine();
  ASSERT_EQ("ready " + std::to_string(2048 * kMiB), ready) << "the observer must see host device 1 (2 GiB)";

  const int boardFd = memfd_create("cushare-test-board", MFD_CLOEXEC);
  ASSERT_GE(boardFd, 0);
  ASSERT_EQ(0, ftruncate(boardFd, sizeof(Board) * kBoardSlots));
  Board* board = mapBoard(boardFd);
  ASSERT_NE(nullptr, board);
  const std::vector<EnvEdits> numberings = {
      {"CUDA_VISIBLE_DEVICES=1"},
      {"CUDA_VISIBLE_DEVICES=1,0"},
      {std::string("CUDA_VISIBLE_DEVICES=") + kHostUuid1 + "," + kHostUuid0},
      {"SIMGPU_CONTAINER_DEVICES=1"},
  };
  constexpr int kChildren = 8;
  std::vector<Child> kids(kChildren);
  for (int i = 0; i < kChildren; ++i)
    ASSERT_NO_FATAL_FAILURE(spawn(&kids[i], "churn", {"1500", std::to_string(2000 + i), "4", "1", std::to_string(i)},
                                  numberings[i % numberings.size()], boardFd));
  close(boardFd);
  for (Child& k : kids) ASSERT_EQ("ready", k.readLine());
  for (Child& k : kids) k.send('g');
  ASSERT_NO_FATAL_FAILURE(expectChurnsDone(kids));
  ASSERT_NO_FATAL_FAILURE(expectObservedWithin(observer, limit, 100));
  EXPECT_EQ(0u, cushare::test::deviceUsed(0)) << "an allocation landed on host device 0";
  EXPECT_EQ(0u, cushare::test::deviceUsed(1));
  munmap(board, sizeof(Board) * kBoardSlots);
}

int main(int argc, char** argv) {
  if (argc > 1 && std::strncmp(argv[1], "--child=", 8) == 0) return childMain(argv[1] + 8, argc, argv);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
