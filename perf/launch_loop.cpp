// cuLaunchKernel N times on one stream (N from argv[1]) over the null driver: the program
// perf/launch_instructions.sh runs under callgrind (instructions) and timed (ns), without the
// shim, with it and no compute mode, and with it and a cap in force (argv[2] = "paced": the
// program writes the broker's words into its own ledger, mode metered|paced with the gate open,
// as a broker would during the tenant's turn). Each iteration also stores 0 to a word: in the paced
// run its slot's in-flight count (standing in for the pacer, which the null driver's events would
// otherwise wake per launch), elsewhere a dummy, so all runs execute the same loop. argv[3], the
// launch road: kernel (cuLaunchKernel, the default), ex (cuLaunchKernelEx), coop
// (cuLaunchCooperativeKernel).
#include <cuda.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "cushare/ledger_abi.h"

int main(int argc, char** argv) {
  const long n = argc > 1 ? std::strtol(argv[1], nullptr, 10) : 1000;
  const bool paced = argc > 2 && std::strcmp(argv[2], "paced") == 0;
  const char* road = argc > 3 ? argv[3] : "kernel";
  const int how = std::strcmp(road, "ex") == 0 ? 1 : std::strcmp(road, "coop") == 0 ? 2 : 0;
  if (how == 0 && std::strcmp(road, "kernel") != 0) {
    std::fprintf(stderr, "launch_loop: unknown road %s (kernel, ex, coop)\n", road);
    return 2;
  }
  CUcontext ctx;
  CUmodule mod;
  CUfunction fn;
  CUstream stream;
  if (cuInit(0) != CUDA_SUCCESS || cuDevicePrimaryCtxRetain(&ctx, 0) != CUDA_SUCCESS ||
      cuCtxSetCurrent(ctx) != CUDA_SUCCESS || cuModuleLoadData(&mod, "") != CUDA_SUCCESS ||
      cuModuleGetFunction(&fn, mod, "k") != CUDA_SUCCESS || cuStreamCreate(&stream, 0) != CUDA_SUCCESS) {
    std::fprintf(stderr, "launch_loop: no device\n");
    return 1;
  }
  static std::atomic<uint32_t> dummy{0};
  std::atomic<uint32_t>* reset = &dummy;
  if (paced) {
    const char* dir = std::getenv("CUSHARE_LEDGER_DIR");
    const char* tenant = std::getenv("CUSHARE_TENANT");
    const std::string path = std::string(dir ? dir : "") + "/" + (tenant ? tenant : "") + ".ledger";
    const int fd = ::open(path.c_str(), O_RDWR);
    void* map = fd < 0 ? MAP_FAILED : ::mmap(nullptr, cushare::kLedgerFileSize, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) {
      std::fprintf(stderr, "launch_loop: cannot map %s\n", path.c_str());
      return 1;
    }
    auto* base = static_cast<char*>(map);
    auto* words = reinterpret_cast<cushare::LedgerComputeDevice*>(base + cushare::kLedgerComputeOffset);
    auto* pids = reinterpret_cast<std::atomic<int32_t>*>(base + cushare::kLedgerPidOffset);
    int slot = -1;
    for (uint32_t s = 0; s < cushare::kLedgerMaxSlots; ++s)
      if (pids[s].load() == getpid()) slot = static_cast<int>(s);
    if (slot < 0) {
      std::fprintf(stderr, "launch_loop: no slot of mine in %s\n", path.c_str());
      return 1;
    }
    words[0].gate.store(cushare::kGateOpen);
    words[0].mode.store(cushare::kComputeMetered | cushare::kComputePaced);
    reset = &reinterpret_cast<cushare::LedgerComputeSlot*>(base + cushare::kLedgerComputeSlotOffset)[slot].inflight;
  }
  CUlaunchConfig config{};
  config.gridDimX = config.gridDimY = config.gridDimZ = 1;
  config.blockDimX = 32;
  config.blockDimY = config.blockDimZ = 1;
  config.hStream = stream;
  timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (long i = 0; i < n; ++i) {
    const CUresult r = how == 1   ? cuLaunchKernelEx(&config, fn, nullptr, nullptr)
                       : how == 2 ? cuLaunchCooperativeKernel(fn, 1, 1, 1, 32, 1, 1, 0, stream, nullptr)
                                  : cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, stream, nullptr, nullptr);
    if (r != CUDA_SUCCESS) return 1;
    reset->store(0, std::memory_order_relaxed);
  }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  const double ns = (t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec);
  std::printf("%.1f\n", n ? ns / n : 0.0);
  return 0;
}
