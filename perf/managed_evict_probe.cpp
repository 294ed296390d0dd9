// What the device does with managed memory when another process needs the room: the facts the
// bursting tenants of docs/memory-elasticity.md rely on, measured on a real GPU by perf/gpu_check.sh
// (step 10) and on simgpu by tests/managed_evict_probe_test.sh. Prints `key=value` lines:
//   step=a-allocated free=<bytes>            a burster allocated N bytes of managed memory
//   step=a-prefetched free=<bytes> ms=<ms>   ... and prefetched all of it to the device
//   step=resident device_used=<bytes> a_process_bytes=<bytes>   NVML's view (a_process_bytes: -1 not listed)
//   step=b-alloc bytes=<bytes> result=<CUresult> ms=<ms>   another process's cuMemAlloc of what is
//                                            free plus N/2: it fits only if the device evicts
//   step=evicted device_used=<bytes>         NVML's view after it
//   step=a-check intact=<0|1> ms=<ms>        the burster reads all N back (pattern written before)
//   step=a-to-host ms=<ms> free=<bytes>      the burster prefetches all N to the host
//   step=a-fault-in ms=<ms> resident_ms=<ms> us_per_2mib=<us>   a kernel touching one word per
//                                            4 KiB page of an allocation of N/4 written on the host
//                                            faults it in, timed; the same
//                                            kernel again, resident; the difference per 2 MiB
//                                            (simgpu's SIMGPU_FAULT_US guess, docs/simgpu.md)
//   facts alloc_charges_nothing=<0|1> prefetch_charges=<0|1> nvml_process_omits_managed=<0|1>
//         alloc_evicts_managed=<0|1> data_intact=<0|1> host_prefetch_frees=<0|1>
// N is half the device's memory, at most MANAGED_PROBE_MAX_MIB MiB (default 4096: the burster writes
// and reads it all on the host), rounded down to 2 MiB. This process loads only NVML; the burster
// and the allocator are children that use the driver API (fork before any CUDA call).
#include <cuda.h>
#include <dlfcn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cushare/nvml_api.h"

namespace {

using Clock = std::chrono::steady_clock;
double msSince(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

struct Nvml {
  nvmlReturn_t (*memory)(nvmlDevice_t, nvmlMemory_t*) = nullptr;
  nvmlReturn_t (*procs)(nvmlDevice_t, unsigned*, nvmlProcessInfo_t*) = nullptr;
  nvmlDevice_t dev = nullptr;
  uint64_t used() const {
    nvmlMemory_t m{};
    return memory(dev, &m) == NVML_SUCCESS ? m.used : 0;
  }
  long long processBytes(pid_t pid) const {
    nvmlProcessInfo_t infos[64];
    unsigned n = 64;
    if (procs(dev, &n, infos) != NVML_SUCCESS) return -2;
    for (unsigned i = 0; i < n; ++i)
      if (static_cast<pid_t>(infos[i].pid) == pid) return static_cast<long long>(infos[i].usedGpuMemory);
    return -1;
  }
};

bool initCuda() {
  CUdevice dev;
  CUcontext ctx;
  return cuInit(0) == CUDA_SUCCESS && cuDeviceGet(&dev, 0) == CUDA_SUCCESS &&
         cuDevicePrimaryCtxRetain(&ctx, dev) == CUDA_SUCCESS && cuCtxSetCurrent(ctx) == CUDA_SUCCESS;
}

size_t freeNow() {
  size_t f = 0, t = 0;
  cuMemGetInfo(&f, &t);
  return f;
}

void say(const std::string& line) {
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

// Blocks until the other side writes a byte (0 on EOF).
char await(int fd) {
  char c = 0;
  return read(fd, &c, 1) == 1 ? c : 0;
}
void tell(int fd, char c) { (void)!write(fd, &c, 1); }

uint64_t word(size_t i) { return i * 0x9E3779B97F4A7C15ull ^ 0xA5A5A5A5DEADBEEFull; }

// One thread per 4 KiB page of [p, p + pages * 4096): reads its page's first word and writes it
// back (the data stays as it was; the store keeps the load from being dropped). PTX 6.0, sm_50.
constexpr char kTouchPtx[] =
    ".version 6.0\n"
    ".target sm_50\n"
    ".address_size 64\n"
    ".visible .entry cushare_touch_pages(.param .u64 p, .param .u64 pages)\n"
    "{\n"
    "  .reg .pred %p<2>;\n"
    "  .reg .b32 %r<6>;\n"
    "  .reg .b64 %rd<6>;\n"
    "  ld.param.u64 %rd1, [p];\n"
    "  ld.param.u64 %rd2, [pages];\n"
    "  mov.u32 %r1, %ctaid.x;\n"
    "  mov.u32 %r2, %ntid.x;\n"
    "  mov.u32 %r3, %tid.x;\n"
    "  mad.lo.u32 %r4, %r1, %r2, %r3;\n"
    "  cvt.u64.u32 %rd3, %r4;\n"
    "  setp.ge.u64 %p1, %rd3, %rd2;\n"
    "  @%p1 bra DONE;\n"
    "  shl.b64 %rd4, %rd3, 12;\n"
    "  add.u64 %rd5, %rd1, %rd4;\n"
    "  ld.global.u32 %r5, [%rd5];\n"
    "  st.global.u32 [%rd5], %r5;\n"
    "DONE:\n"
    "  ret;\n"
    "}\n";

// Host milliseconds of one launch of touch over all n bytes at m, synchronised; -1 on an error.
double touchAll(CUfunction touch, CUdeviceptr m, size_t n) {
  CUdeviceptr p = m;
  uint64_t pages = n / 4096;
  void* args[] = {&p, &pages};
  const unsigned blocks = static_cast<unsigned>((pages + 255) / 256);
  const auto t = Clock::now();
  if (cuLaunchKernel(touch, blocks, 1, 1, 256, 1, 1, 0, nullptr, args, nullptr) != CUDA_SUCCESS ||
      cuCtxSynchronize() != CUDA_SUCCESS)
    return -1;
  return msSince(t);
}

// The burster: reports, then waits for 'c' (check) and 'h' (to the host), reporting each.
int burster(int toParent, int fromParent) {
  if (!initCuda()) return 10;
  size_t f = 0, total = 0;
  cuMemGetInfo(&f, &total);
  const char* maxMib = std::getenv("MANAGED_PROBE_MAX_MIB");
  const size_t cap = (maxMib && *maxMib ? std::strtoull(maxMib, nullptr, 10) : 4096) << 20;
  const size_t n = std::min(total / 2, cap) / (2u << 20) * (2u << 20);
  CUdeviceptr m = 0;
  if (cuMemAllocManaged(&m, n, CU_MEM_ATTACH_GLOBAL) != CUDA_SUCCESS) return 11;
  auto* w = reinterpret_cast<uint64_t*>(m);
  for (size_t i = 0; i < n / 8; ++i) w[i] = word(i);  // on the host
  say("step=a-allocated bytes=" + std::to_string(n) + " free=" + std::to_string(freeNow()) + " free_before=" + std::to_string(f));
  const CUmemLocation dev0{CU_MEM_LOCATION_TYPE_DEVICE, 0}, host{CU_MEM_LOCATION_TYPE_HOST, 0};
  auto t = Clock::now();
  if (cuMemPrefetchAsync_v2(m, n, dev0, 0, nullptr) != CUDA_SUCCESS || cuCtxSynchronize() != CUDA_SUCCESS) return 12;
  say("step=a-prefetched free=" + std::to_string(freeNow()) + " ms=" + std::to_string(msSince(t)));
  tell(toParent, 'r');
  if (await(fromParent) != 'c') return 0;
  t = Clock::now();
  constexpr size_t kPiece = size_t{64} << 20;  // read back in pieces: no second copy of all of it
  std::vector<uint64_t> back(kPiece / 8);
  bool intact = true;
  for (size_t off = 0; off < n && intact; off += kPiece) {
    const size_t len = std::min(kPiece, n - off);
    intact = cuMemcpyDtoH(back.data(), m + off, len) == CUDA_SUCCESS;
    for (size_t i = 0; i < len / 8 && intact; ++i) intact = back[i] == word(off / 8 + i);
  }
  say("step=a-check intact=" + std::to_string(intact ? 1 : 0) + " ms=" + std::to_string(msSince(t)));
  // Resident again where there is room, then everything to the host.
  cuMemPrefetchAsync_v2(m, n, dev0, 0, nullptr);
  cuCtxSynchronize();
  const size_t before = freeNow();
  t = Clock::now();
  const bool ok = cuMemPrefetchAsync_v2(m, n, host, 0, nullptr) == CUDA_SUCCESS && cuCtxSynchronize() == CUDA_SUCCESS;
  say("step=a-to-host ok=" + std::to_string(ok ? 1 : 0) + " ms=" + std::to_string(msSince(t)) + " free_before=" +
      std::to_string(before) + " free=" + std::to_string(freeNow()));
  // Faulting in: a managed allocation of N/4 written on the host (its pages there: the allocator's
  // memory leaves room for about N/2 on the device), touched by a kernel, timed; the same kernel
  // again with it resident. Its own allocation: a kernel that reaches an allocation may fault in any
  // of it (simgpu populates all of it), and all of N does not fit.
  CUmodule mod = nullptr;
  CUfunction touch = nullptr;
  const size_t quarter = n / 4 / (2u << 20) * (2u << 20);
  CUdeviceptr q = 0;
  if (cuModuleLoadData(&mod, kTouchPtx) == CUDA_SUCCESS &&
      cuModuleGetFunction(&touch, mod, "cushare_touch_pages") == CUDA_SUCCESS &&
      cuMemAllocManaged(&q, quarter, CU_MEM_ATTACH_GLOBAL) == CUDA_SUCCESS) {
    std::memset(reinterpret_cast<void*>(q), 0x5a, quarter);
    const double faulting = touchAll(touch, q, quarter);
    const double resident = touchAll(touch, q, quarter);
    const double chunks = static_cast<double>(quarter) / (2u << 20);
    char line[200];
    std::snprintf(line, sizeof line, "step=a-fault-in ms=%.3f resident_ms=%.3f us_per_2mib=%.1f", faulting, resident,
                  faulting >= 0 && resident >= 0 ? (faulting - resident) * 1000 / chunks : -1.0);
    say(line);
    cuMemFree(q);
  } else {
    say("step=a-fault-in error=module");
  }
  tell(toParent, 'd');
  await(fromParent);
  cuMemFree(m);
  return 0;
}

// The allocator: cuMemAlloc of what is free plus half the burster's N, then waits.
int allocator(size_t n, int toParent, int fromParent) {
  if (!initCuda()) return 20;
  const size_t want = freeNow() + n / 2;
  CUdeviceptr p = 0;
  const auto t = Clock::now();
  const CUresult r = cuMemAlloc(&p, want);
  say("step=b-alloc bytes=" + std::to_string(want) + " result=" + std::to_string(static_cast<int>(r)) + " ms=" +
      std::to_string(msSince(t)));
  tell(toParent, r == CUDA_SUCCESS ? 'y' : 'n');
  await(fromParent);
  if (r == CUDA_SUCCESS) cuMemFree(p);
  return 0;
}

uint64_t field(const std::string& text, const std::string& key) {
  const size_t at = text.find(key + "=");
  return at == std::string::npos ? 0 : std::strtoull(text.c_str() + at + key.size() + 1, nullptr, 10);
}

}  // namespace

int main() {
  void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    std::printf("error=no-nvml %s\n", dlerror());
    return 2;
  }
  auto init = reinterpret_cast<nvmlReturn_t (*)()>(dlsym(lib, "nvmlInit_v2"));
  auto handle = reinterpret_cast<nvmlReturn_t (*)(unsigned, nvmlDevice_t*)>(dlsym(lib, "nvmlDeviceGetHandleByIndex_v2"));
  Nvml nv;
  nv.memory = reinterpret_cast<nvmlReturn_t (*)(nvmlDevice_t, nvmlMemory_t*)>(dlsym(lib, "nvmlDeviceGetMemoryInfo"));
  nv.procs = reinterpret_cast<nvmlReturn_t (*)(nvmlDevice_t, unsigned*, nvmlProcessInfo_t*)>(
      dlsym(lib, "nvmlDeviceGetComputeRunningProcesses_v3"));
  if (!init || !handle || !nv.memory || !nv.procs || init() != NVML_SUCCESS || handle(0, &nv.dev) != NVML_SUCCESS) {
    std::printf("error=nvml-init\n");
    return 2;
  }
  // Each child's lines go through a pipe, so the parent can read the figures back.
  int aUp[2], aDown[2], bUp[2], bDown[2], aOut[2];
  if (pipe(aUp) || pipe(aDown) || pipe(bUp) || pipe(bDown) || pipe(aOut)) return 2;
  const pid_t a = fork();
  if (a == 0) {
    dup2(aOut[1], 1);
    _exit(burster(aUp[1], aDown[0]));
  }
  std::string aText;
  auto drainA = [&] {  // what the burster printed so far (it prints before every byte it sends)
    char buf[4096];
    for (;;) {
      struct timeval tv {0, 100000};
      fd_set s;
      FD_ZERO(&s);
      FD_SET(aOut[0], &s);
      if (select(aOut[0] + 1, &s, nullptr, nullptr, &tv) <= 0) break;
      const ssize_t k = read(aOut[0], buf, sizeof buf);
      if (k <= 0) break;
      aText.append(buf, static_cast<size_t>(k));
      std::fwrite(buf, 1, static_cast<size_t>(k), stdout);
    }
    std::fflush(stdout);
  };
  if (await(aUp[0]) != 'r') {
    drainA();
    int st = 0;
    waitpid(a, &st, 0);
    std::printf("error=burster-failed status=%d\n", WIFEXITED(st) ? WEXITSTATUS(st) : -1);
    return 1;
  }
  drainA();
  const uint64_t n = field(aText, "bytes");
  const uint64_t usedResident = nv.used();
  const long long aBytes = nv.processBytes(a);
  say("step=resident device_used=" + std::to_string(usedResident) + " a_process_bytes=" + std::to_string(aBytes));
  const pid_t b = fork();
  if (b == 0) _exit(allocator(n, bUp[1], bDown[0]));
  const bool granted = await(bUp[0]) == 'y';
  say("step=evicted device_used=" + std::to_string(nv.used()));
  tell(aDown[1], 'c');
  await(aUp[0]);
  drainA();
  tell(aDown[1], 'q');
  tell(bDown[1], 'q');
  int sa = 0, sb = 0;
  waitpid(a, &sa, 0);
  waitpid(b, &sb, 0);
  drainA();
  const bool chargesNothing = field(aText, "free") + (64u << 20) >= field(aText, "free_before");
  const size_t pre = aText.find("step=a-prefetched");
  const uint64_t freePrefetched = pre == std::string::npos ? 0 : field(aText.substr(pre), "free");
  const bool prefetchCharges = freePrefetched + n / 2 <= field(aText, "free");
  const size_t host = aText.find("step=a-to-host");
  const std::string hostLine = host == std::string::npos ? "" : aText.substr(host);
  const bool hostFrees = field(hostLine, "free") >= field(hostLine, "free_before") + n / 2;
  std::printf("facts alloc_charges_nothing=%d prefetch_charges=%d nvml_process_omits_managed=%d alloc_evicts_managed=%d "
              "data_intact=%d host_prefetch_frees=%d\n",
              chargesNothing, prefetchCharges, aBytes >= 0 && static_cast<uint64_t>(aBytes) < n / 2, granted,
              aText.find("intact=1") != std::string::npos, hostFrees);
  return WIFEXITED(sa) && WEXITSTATUS(sa) == 0 && WIFEXITED(sb) && WEXITSTATUS(sb) == 0 ? 0 : 1;
}
