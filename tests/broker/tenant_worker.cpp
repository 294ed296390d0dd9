// A tenant process for the broker tests: a CUDA driver-API program driven line by line over stdin,
// answering one line per command on stdout, so a test can make many processes allocate, hold,
// free and report at chosen moments. It runs on simgpu with the shim preloaded.
//
//   alloc BYTES          -> "ok" | "oom" | "err CODE"
//   fill STEP            -> allocate STEP at a time until refused: "held TOTAL"
//   churn STEP N MS      -> for MS milliseconds allocate or free STEP-sized blocks at random,
//                           holding at most N of them: "churned OK OOM held TOTAL"
//   freeall              -> "ok"
//   held                 -> "held TOTAL"
//   info                 -> "free FREE total TOTAL" (cuMemGetInfo: the tenant's view)
//   pattern BYTES        -> allocates BYTES (cuMemAlloc) and writes a pattern of its own into it
//                           (a copy from the host): "ok" | "oom" | "err CODE"
//   check                -> reads back every pattern allocation (a copy to the host): "intact N"
//                           (N allocations) | "corrupt I" (the first that differs) | "err CODE"
//   pool BYTES           -> cuMemAllocAsync of BYTES on a stream of its own, synchronised, kept:
//                           "ok" | "oom" | "err CODE"
//   vmm BYTES            -> cuMemCreate of BYTES (rounded up to the granularity), kept: "ok" | "oom" | "err CODE"
//   time BYTES N         -> N pairs of cuMemAlloc(BYTES) + cuMemFree: "ns PER_PAIR" (median of
//                           five rounds of N/5) | "err CODE"
//   talloc BYTES         -> as alloc, timed: "ok MS" | "oom MS" | "err CODE MS"
//   forgewant BYTES MS   -> writes a wait of BYTES into its ledger's device entry 0 behind the shim's
//                           back (want_bytes, want_ns = now), every 20 ms for MS ms: "forged" | "failed"
//   forgework MS         -> writes launches in flight (5 and 6 in turn, every 10 ms) into every
//                           compute slot of its ledger's device entry 0 behind the shim's back,
//                           for MS ms, running nothing: "forged" | "failed"
//   target               -> what cushare_reclaim_target says for device 0: "target T held H" | "none held H"
//                           | "err WHAT"
//   cooperate            -> gives back plain bursts when the broker asks (docs/memory-elasticity.md):
//                           a thread polls cushare_reclaim_fd and frees its newest allocations until
//                           the tenant holds no more than cushare_reclaim_target says: "cooperating"
//                           | "err WHAT"
//   touch MS             -> for MS milliseconds, rounds of one kernel per held allocation (its
//                           argument points into the allocation: simgpu populates managed memory it
//                           reaches) and a synchronisation: "touched ROUNDS" | "err CODE"
//   kinds                -> what the driver made of everything it holds (cuPointerGetAttribute
//                           IS_MANAGED): "managed BYTES plain BYTES"
//   quit                 -> frees everything and exits 0
// Attacks on its own ledger ($CUSHARE_LEDGER_DIR/$CUSHARE_TENANT.ledger), as a hostile tenant
// would make them, behind the shim's back:
//   zero [FILE]          -> writes zeros over every usage counter of the file (raw pwrite), or of
//                           FILE in the ledger directory (a former ledger): "ok" | "failed"
//   closeledger          -> closes every descriptor of the ledger file it has: "closed N"
//   pid                  -> "pid PID" (getpid(): in its own pid namespace)
//   mapfile FILE         -> maps FILE of the ledger directory (read-only, kept): "mapped" | "failed"
//                           (a process claiming to be a ledger's without the shim's say)
//   export BYTES SOCKET  -> makes BYTES of shareable VMM memory (cuMemCreate, POSIX descriptor),
//                           exports it, sends the descriptor over the Unix socket SOCKET
//                           (SCM_RIGHTS) and releases its handle: "exported" | "err WHAT"
// At start it prints "ready", or "init-failed CODE" and exits 3 when cuInit or the context fails.
#include <cuda.h>
#include <fcntl.h>
#include <poll.h>
#include <dlfcn.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstddef>
#include <cstdlib>
#include <filesystem>

#include "cushare/ledger_abi.h"
#include "fd_passing.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <random>
#include <thread>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

namespace {

std::vector<std::pair<CUdeviceptr, uint64_t>> gHeld;

std::string ledgerPath() {
  const char* dir = std::getenv("CUSHARE_LEDGER_DIR");
  const char* tenant = std::getenv("CUSHARE_TENANT");
  return std::string(dir ? dir : "") + "/" + (tenant ? tenant : "default") + ".ledger";
}

bool zeroCounters(const std::string& file) {
  const char* dir = std::getenv("CUSHARE_LEDGER_DIR");
  const std::string path = file.empty() ? ledgerPath() : std::string(dir ? dir : "") + "/" + file;
  const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const std::vector<char> zeros(cushare::kLedgerUsedBytes, 0);
  const bool ok = ::pwrite(fd, zeros.data(), zeros.size(), cushare::kLedgerUsedOffset) ==
                  static_cast<ssize_t>(zeros.size());
  ::close(fd);
  return ok;
}

int closeLedger() {
  const std::string want = std::filesystem::canonical(ledgerPath()).string();
  int closed = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    const auto target = std::filesystem::read_symlink(e.path(), ec);
    if (!ec && target.string() == want && ::close(std::stoi(e.path().filename().string())) == 0) ++closed;
  }
  return closed;
}

uint64_t heldBytes() {
  uint64_t t = 0;
  for (auto& [p, n] : gHeld) t += n;
  return t;
}

CUresult alloc(uint64_t n) {
  CUdeviceptr p;
  const CUresult r = cuMemAlloc(&p, n);
  if (r == CUDA_SUCCESS) gHeld.emplace_back(p, n);
  return r;
}

std::vector<size_t> gPatterns;  // indexes into gHeld
std::mutex gMu;  // the command loop and the cooperating thread (cooperate)

void freeLast() {
  cuMemFree(gHeld.back().first);
  gHeld.pop_back();
  while (!gPatterns.empty() && gPatterns.back() >= gHeld.size()) gPatterns.pop_back();  // freed with it
}

void say(const std::string& s) { std::cout << s << std::endl; }

// export BYTES SOCKET (see the top).
std::string exportTo(uint64_t n, const std::string& path) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  CUmemGenericAllocationHandle h;
  if (CUresult r = cuMemCreate(&h, n, &prop, 0); r != CUDA_SUCCESS) return "err create " + std::to_string(r);
  int fd = -1;
  if (CUresult r = cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0); r != CUDA_SUCCESS)
    return "err export " + std::to_string(r);
  cuMemRelease(h);  // only the descriptor keeps it alive now
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof addr.sun_path) return "err path";
  std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path.c_str());
  const int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0 || ::connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) return "err connect";
  const bool sent = cushare::fdpass::sendFd(s, fd) == 0;
  ::close(s);
  ::close(fd);
  return sent ? "exported" : "err send";
}

}  // namespace

// The pattern of allocation i's word w.
uint64_t patternWord(size_t i, size_t w) { return (i + 1) * 0x9E3779B97F4A7C15ull ^ (w * 0xC2B2AE3D27D4EB4Full); }
std::string pattern(uint64_t n) {
  const CUresult a = alloc(n);
  if (a != CUDA_SUCCESS) return a == CUDA_ERROR_OUT_OF_MEMORY ? "oom" : "err " + std::to_string(a);
  const size_t i = gHeld.size() - 1;
  std::vector<uint64_t> words(n / 8);
  for (size_t w = 0; w < words.size(); ++w) words[w] = patternWord(i, w);
  const CUresult c = cuMemcpyHtoD(gHeld[i].first, words.data(), words.size() * 8);
  if (c != CUDA_SUCCESS) return "err " + std::to_string(c);
  gPatterns.push_back(i);
  return "ok";
}

std::string check() {
  for (size_t k = 0; k < gPatterns.size(); ++k) {
    const size_t i = gPatterns[k];
    if (i >= gHeld.size()) return "corrupt " + std::to_string(i);  // freed since
    std::vector<uint64_t> words(gHeld[i].second / 8);
    const CUresult c = cuMemcpyDtoH(words.data(), gHeld[i].first, words.size() * 8);
    if (c != CUDA_SUCCESS) return "err " + std::to_string(c);
    for (size_t w = 0; w < words.size(); ++w)
      if (words[w] != patternWord(i, w)) return "corrupt " + std::to_string(i);
  }
  return "intact " + std::to_string(gPatterns.size());
}

// touch MS (see the top). simgpu runs any kernel name of a module whose PTX names none.
std::string touch(uint64_t ms) {
  static CUfunction f = nullptr;
  if (f == nullptr) {
    static const char kPtx[] = ".version 8.0\n.target sm_90\n.address_size 64\n";
    CUmodule mod = nullptr;
    if (CUresult r = cuModuleLoadData(&mod, kPtx); r != CUDA_SUCCESS) return "err " + std::to_string(r);
    if (CUresult r = cuModuleGetFunction(&f, mod, "touch"); r != CUDA_SUCCESS) return "err " + std::to_string(r);
  }
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  uint64_t rounds = 0;
  while (std::chrono::steady_clock::now() < end) {
    for (auto& [p, n] : gHeld) {
      CUdeviceptr arg = p;
      size_t size = sizeof arg;
      void* extra[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, &arg, CU_LAUNCH_PARAM_BUFFER_SIZE, &size, CU_LAUNCH_PARAM_END};
      if (CUresult r = cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, nullptr, nullptr, extra); r != CUDA_SUCCESS)
        return "err " + std::to_string(r);
    }
    if (CUresult r = cuCtxSynchronize(); r != CUDA_SUCCESS) return "err " + std::to_string(r);
    ++rounds;
  }
  return "touched " + std::to_string(rounds);
}

std::vector<CUdeviceptr> gPool;
std::vector<CUmemGenericAllocationHandle> gVmm;
std::string answer(CUresult r) {
  return r == CUDA_SUCCESS ? "ok" : r == CUDA_ERROR_OUT_OF_MEMORY ? "oom" : "err " + std::to_string(r);
}
std::string poolAlloc(uint64_t n) {
  static CUstream s = nullptr;
  if (!s && cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) return "err stream";
  CUdeviceptr p = 0;
  CUresult r = cuMemAllocAsync(&p, n, s);
  if (r == CUDA_SUCCESS) r = cuStreamSynchronize(s);
  if (r == CUDA_SUCCESS) gPool.push_back(p);
  return answer(r);
}
std::string vmmCreate(uint64_t n) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  size_t gran = 0;
  if (cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS) return "err gran";
  CUmemGenericAllocationHandle h;
  const CUresult r = cuMemCreate(&h, (n + gran - 1) / gran * gran, &prop, 0);
  if (r == CUDA_SUCCESS) gVmm.push_back(h);
  return answer(r);
}

std::string timePairs(uint64_t n, uint64_t pairs) {
  std::vector<double> rounds;
  const uint64_t per = pairs / 5 ? pairs / 5 : 1;
  for (int r = 0; r < 5; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (uint64_t i = 0; i < per; ++i) {
      CUdeviceptr p = 0;
      if (const CUresult a = cuMemAlloc(&p, n); a != CUDA_SUCCESS) return "err " + std::to_string(a);
      cuMemFree(p);
    }
    rounds.push_back(std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() /
                     static_cast<double>(per));
  }
  std::sort(rounds.begin(), rounds.end());
  char b[64];
  std::snprintf(b, sizeof b, "ns %.1f", rounds[2]);
  return b;
}

std::string forgeWant(uint64_t bytes, uint64_t ms) {
  const int fd = ::open(ledgerPath().c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) return "failed";
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  bool ok = true;
  while (ok && std::chrono::steady_clock::now() < end) {
    timespec ts{};
    clock_gettime(CLOCK_MONOTONIC, &ts);
    const uint64_t now = static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
    const size_t entry = offsetof(cushare::LedgerHeader, devices);
    ok = ::pwrite(fd, &bytes, 8, entry + offsetof(cushare::LedgerDevice, want_bytes)) == 8 &&
         ::pwrite(fd, &now, 8, entry + offsetof(cushare::LedgerDevice, want_ns)) == 8;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ::close(fd);
  return ok ? "forged" : "failed";
}

std::string forgeWork(uint64_t ms) {
  const int fd = ::open(ledgerPath().c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) return "failed";
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  bool ok = true;
  for (uint32_t k = 0; ok && std::chrono::steady_clock::now() < end; ++k) {
    const uint32_t n = 5 + (k & 1);  // moving: never taken for stuck
    for (uint32_t slot = 0; ok && slot < cushare::kLedgerMaxSlots; ++slot) {
      const size_t at = cushare::kLedgerComputeSlotOffset + sizeof(cushare::LedgerComputeSlot) * slot +
                        offsetof(cushare::LedgerComputeSlot, inflight);  // device entry 0: the first row
      ok = ::pwrite(fd, &n, 4, static_cast<off_t>(at)) == 4;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const uint32_t zero = 0;
  for (uint32_t slot = 0; slot < cushare::kLedgerMaxSlots; ++slot)
    (void)!::pwrite(fd, &zero, 4, static_cast<off_t>(cushare::kLedgerComputeSlotOffset +
                                                     sizeof(cushare::LedgerComputeSlot) * slot +
                                                     offsetof(cushare::LedgerComputeSlot, inflight)));
  ::close(fd);
  return ok ? "forged" : "failed";
}

std::string reclaimTarget() {
  using TargetFn = int (*)(int, unsigned long long*, unsigned long long*);
  auto targetFn = reinterpret_cast<TargetFn>(dlsym(RTLD_DEFAULT, "cushare_reclaim_target"));
  if (!targetFn) return "err no-api";
  unsigned long long target = 0, held = 0;
  const int r = targetFn(0, &target, &held);
  if (r < 0) return "err " + std::to_string(r);
  return (r == 1 ? "target " + std::to_string(target) : std::string("none")) + " held " + std::to_string(held);
}

std::string cooperate() {
  using FdFn = int (*)();
  using TargetFn = int (*)(int, unsigned long long*, unsigned long long*);
  auto fdFn = reinterpret_cast<FdFn>(dlsym(RTLD_DEFAULT, "cushare_reclaim_fd"));
  auto targetFn = reinterpret_cast<TargetFn>(dlsym(RTLD_DEFAULT, "cushare_reclaim_target"));
  if (!fdFn || !targetFn) return "err no-api";
  const int fd = fdFn();
  if (fd < 0) return "err fd";
  std::thread([fd, targetFn] {
    for (;;) {
      pollfd p{fd, POLLIN, 0};
      if (poll(&p, 1, -1) <= 0) continue;
      uint64_t v;
      (void)!read(fd, &v, sizeof v);
      std::lock_guard<std::mutex> g(gMu);
      unsigned long long target = 0, held = 0;
      while (targetFn(0, &target, &held) == 1 && held > target && !gHeld.empty()) freeLast();
    }
  }).detach();
  return "cooperating";
}

std::string kinds() {
  uint64_t managed = 0, plain = 0;
  for (const auto& [p, n] : gHeld) {
    unsigned isManaged = 0;
    cuPointerGetAttribute(&isManaged, CU_POINTER_ATTRIBUTE_IS_MANAGED, p);
    (isManaged ? managed : plain) += n;
  }
  return "managed " + std::to_string(managed) + " plain " + std::to_string(plain);
}

int main() {
  CUcontext ctx;
  CUdevice dev;
  CUresult r = cuInit(0);
  if (r == CUDA_SUCCESS) r = cuDeviceGet(&dev, 0);
  if (r == CUDA_SUCCESS) r = cuCtxCreate(&ctx, nullptr, 0, dev);
  if (r != CUDA_SUCCESS) {
    say("init-failed " + std::to_string(r));
    return 3;
  }
  say("ready");
  std::mt19937_64 rng(std::random_device{}());
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    std::unique_lock<std::mutex> lock(gMu);
    if (cmd == "talloc") {
      uint64_t n = 0;
      in >> n;
      lock.unlock();  // the allocation may wait for another tenant: the cooperating thread runs on
      const auto t0 = std::chrono::steady_clock::now();
      CUdeviceptr p = 0;
      const CUresult a = cuMemAlloc(&p, n);
      const long long ms =
          std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
      lock.lock();
      if (a == CUDA_SUCCESS) gHeld.emplace_back(p, n);
      say((a == CUDA_SUCCESS ? std::string("ok") : a == CUDA_ERROR_OUT_OF_MEMORY ? std::string("oom") : "err " + std::to_string(a)) +
          " " + std::to_string(ms));
    } else if (cmd == "forgewant") {
      uint64_t n = 0, ms = 0;
      in >> n >> ms;
      say(forgeWant(n, ms));
    } else if (cmd == "forgework") {
      uint64_t ms = 0;
      in >> ms;
      say(forgeWork(ms));
    } else if (cmd == "target") {
      say(reclaimTarget());
    } else if (cmd == "cooperate") {
      say(cooperate());
    } else if (cmd == "alloc") {
      uint64_t n = 0;
      in >> n;
      const CUresult a = alloc(n);
      say(a == CUDA_SUCCESS ? "ok" : a == CUDA_ERROR_OUT_OF_MEMORY ? "oom" : "err " + std::to_string(a));
    } else if (cmd == "fill") {
      uint64_t step = 0;
      in >> step;
      while (step > 0 && alloc(step) == CUDA_SUCCESS) {
      }
      say("held " + std::to_string(heldBytes()));
    } else if (cmd == "churn") {
      uint64_t step = 0, most = 0, ms = 0, ok = 0, oom = 0;
      in >> step >> most >> ms;
      const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
      while (std::chrono::steady_clock::now() < end) {
        const bool grow = gHeld.size() < most && (gHeld.empty() || rng() % 2 == 0);
        if (!grow) {
          if (!gHeld.empty()) freeLast();
          continue;
        }
        (alloc(step) == CUDA_SUCCESS ? ok : oom) += 1;
      }
      say("churned " + std::to_string(ok) + " " + std::to_string(oom) + " held " + std::to_string(heldBytes()));
    } else if (cmd == "freeall") {
      while (!gHeld.empty()) freeLast();
      gPatterns.clear();
      for (CUdeviceptr p : gPool) cuMemFree(p);
      gPool.clear();
      for (CUmemGenericAllocationHandle h : gVmm) cuMemRelease(h);
      gVmm.clear();
      say("ok");
    } else if (cmd == "held") {
      say("held " + std::to_string(heldBytes()));
    } else if (cmd == "info") {
      size_t f = 0, t = 0;
      cuMemGetInfo(&f, &t);
      say("free " + std::to_string(f) + " total " + std::to_string(t));
    } else if (cmd == "zero") {
      std::string file;
      in >> file;
      say(zeroCounters(file) ? "ok" : "failed");
    } else if (cmd == "mapfile") {
      std::string file;
      in >> file;
      const char* dir = std::getenv("CUSHARE_LEDGER_DIR");
      const int fd = ::open((std::string(dir ? dir : "") + "/" + file).c_str(), O_RDONLY | O_CLOEXEC);
      void* m = fd < 0 ? MAP_FAILED : ::mmap(nullptr, 4096, PROT_READ, MAP_SHARED, fd, 0);
      if (fd >= 0) ::close(fd);
      say(m == MAP_FAILED ? "failed" : "mapped");
    } else if (cmd == "closeledger") {
      say("closed " + std::to_string(closeLedger()));
    } else if (cmd == "export") {
      uint64_t n = 0;
      std::string path;
      in >> n >> path;
      say(exportTo(n, path));
    } else if (cmd == "pattern") {
      uint64_t n = 0;
      in >> n;
      say(pattern(n));
    } else if (cmd == "check") {
      say(check());
    } else if (cmd == "pool") {
      uint64_t n = 0;
      in >> n;
      say(poolAlloc(n));
    } else if (cmd == "vmm") {
      uint64_t n = 0;
      in >> n;
      say(vmmCreate(n));
    } else if (cmd == "time") {
      uint64_t n = 0, pairs = 0;
      in >> n >> pairs;
      say(timePairs(n, pairs));
    } else if (cmd == "touch") {
      uint64_t ms = 0;
      in >> ms;
      say(touch(ms));
    } else if (cmd == "kinds") {
      say(kinds());
    } else if (cmd == "pid") {
      say("pid " + std::to_string(::getpid()));
    } else if (cmd == "quit") {
      break;
    } else {
      say("unknown-command");
    }
  }
  while (!gHeld.empty()) freeLast();
  cuCtxDestroy(ctx);
  return 0;
}
