// A tenant program for the demo: keeps the device busy for a while with kernels that would fill
// it (one block per SM, each spinning for a fixed time), and says, every second, what share of
// the device's time its kernels got. Under cushare that share is the tenant's: its compute cap,
// or less while a tenant of a higher priority has work (docs/compute.md). Plain C++ on the CUDA
// driver API with the kernel in PTX, so it runs unchanged on a GPU (the block spins on
// %globaltimer) and on simgpu (with the cost table examples/tenant/busy_for.costs, whose blocks
// last 1 ms: the default --block-us).
//
//   usage: busy_for [--seconds N] [--block-us N] [--device N] [--name LABEL]
//
// Every line of output starts with [LABEL] (default: $CUSHARE_TENANT, else "default"). The share
// of a second is the device time of the kernels that completed in it (each kernel one wave of
// blocks of --block-us) over the second's wall time. On a GPU a block spins until a time, so a
// block the hardware slices out meanwhile counts as if it ran; under cushare's pacing tenants
// take exclusive turns (docs/compute.md), so it does not arise there. `busy_for --ptx` prints the
// kernel's PTX (the ctest busy_for_ptx compiles it with ptxas). Exit status: 0 when done, 1 on a
// CUDA error or a share above what a device has (simgpu without the cost table), 2 on a usage
// error.
#include <cuda.h>

#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "cushare/parse.h"
#include "tenant_program.h"

namespace {

constexpr const char* kUsage =
    "usage: busy_for [--seconds N] [--block-us N] [--device N] [--name LABEL] | --ptx\n"
    "  Launches kernels of one block per SM, each block busy for --block-us (default 1000), for\n"
    "  --seconds (default 4), two at a time; prints the share of the device's time it got each second.\n";

// Each block spins until %globaltimer has moved by its parameter (ns). No output, no memory. PTX
// ISA 6.0 for sm_50: nothing newer is used, so any GPU and driver of the last years JIT it.
constexpr char kSpinPtx[] =
    ".version 6.0\n"
    ".target sm_50\n"
    ".address_size 64\n"
    ".visible .entry cushare_demo_spin(.param .u64 ns)\n"
    "{\n"
    "  .reg .pred %p<2>;\n"
    "  .reg .b64 %rd<5>;\n"
    "  ld.param.u64 %rd1, [ns];\n"
    "  mov.u64 %rd2, %globaltimer;\n"
    "  add.u64 %rd3, %rd2, %rd1;\n"
    "SPIN:\n"
    "  mov.u64 %rd4, %globaltimer;\n"
    "  setp.lt.u64 %p1, %rd4, %rd3;\n"
    "  @%p1 bra SPIN;\n"
    "  ret;\n"
    "}\n";

struct Options {
  int64_t seconds = 4;
  int64_t blockUs = 1000;
  int device = 0;
  std::string name;
};

// Fills *o from argv. On a usage error returns false with *err set to one line.
bool parseArgs(int argc, char** argv, Options* o, std::string* err) {
  o->name = tenant_program::defaultLabel();
  return tenant_program::parseOptions(
      argc, argv, {"--seconds", "--block-us", "--device", "--name"},
      [&](std::string_view opt, std::string_view value, std::string* why) {
        int64_t device = 0;
        if (opt == "--name") {
          o->name = value;
          if (o->name.empty()) *why = "must not be empty";
          return !o->name.empty();
        }
        if (opt == "--seconds") return cushare::parseInt(value, 1, 3600, &o->seconds, why);
        if (opt == "--block-us") return cushare::parseInt(value, 10, 100000, &o->blockUs, why);
        if (!cushare::parseInt(value, 0, INT_MAX, &device, why)) return false;
        o->device = static_cast<int>(device);
        return true;
      },
      err);
}

bool ok(CUresult r, const char* what) { return tenant_program::cudaOk("busy_for", r, what); }

// Loads the PTX; a JIT failure prints the compiler's log.
bool loadSpin(CUmodule* mod) {
  char log[4096] = {};
  CUjit_option opts[] = {CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
  void* values[] = {log, reinterpret_cast<void*>(static_cast<uintptr_t>(sizeof log))};
  if (ok(cuModuleLoadDataEx(mod, kSpinPtx, 2, opts, values), "cuModuleLoadDataEx")) return true;
  if (log[0] != 0) std::fprintf(stderr, "busy_for: the JIT said: %s\n", log);
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::string_view(argv[1]) == "--ptx") {
    std::fputs(kSpinPtx, stdout);
    return 0;
  }
  Options o;
  if (const int rc = tenant_program::begin("busy_for", kUsage, argc, argv,
                                           [&](std::string* err) { return parseArgs(argc, argv, &o, err); });
      rc >= 0)
    return rc;
  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  CUmodule mod = nullptr;
  CUfunction spin = nullptr;
  CUstream stream = nullptr;
  int sms = 0;
  if (!ok(cuInit(0), "cuInit") || !ok(cuDeviceGet(&dev, o.device), "cuDeviceGet") ||
      !ok(cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain") ||
      !ok(cuCtxSetCurrent(ctx), "cuCtxSetCurrent") ||
      !ok(cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev), "cuDeviceGetAttribute") ||
      !loadSpin(&mod) ||
      !ok(cuModuleGetFunction(&spin, mod, "cushare_demo_spin"), "cuModuleGetFunction") ||
      !ok(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate"))
    return 1;
  std::printf("[%s] %lld s of kernels of %d blocks (one per SM) of %lld us each\n", o.name.c_str(),
              static_cast<long long>(o.seconds), sms, static_cast<long long>(o.blockUs));

  // Two kernels in flight, each followed by an event: a kernel counts in the second its event
  // completed in (the host sees it then; good to a kernel's time, a millisecond here).
  using Clock = std::chrono::steady_clock;
  CUevent done[2] = {};
  for (CUevent& e : done)
    if (!ok(cuEventCreate(&e, CU_EVENT_DISABLE_TIMING), "cuEventCreate")) return 1;
  uint64_t ns = static_cast<uint64_t>(o.blockUs) * 1000;
  void* params[] = {&ns};
  const auto launch = [&](int slot) {
    return ok(cuLaunchKernel(spin, static_cast<unsigned>(sms), 1, 1, 128, 1, 1, 0, stream, params, nullptr),
              "cuLaunchKernel") &&
           ok(cuEventRecord(done[slot], stream), "cuEventRecord");
  };
  // Seconds are counted from the start, so the last one ends with the run and is printed too.
  const auto start = Clock::now();
  auto lastPrint = start;
  int64_t kernelsThisSecond = 0, second = 1;
  if (!launch(0) || !launch(1)) return 1;
  for (int slot = 0;; slot ^= 1) {
    if (!ok(cuEventSynchronize(done[slot]), "cuEventSynchronize")) return 1;
    ++kernelsThisSecond;
    const auto now = Clock::now();
    if (now - start >= std::chrono::seconds(second)) {
      // Since the last line (a second, or more where the host stalled this program).
      const auto whole = std::chrono::duration_cast<std::chrono::seconds>(now - start).count();
      const double wall = std::chrono::duration<double>(now - lastPrint).count();
      const double share = 100.0 * static_cast<double>(kernelsThisSecond) * static_cast<double>(o.blockUs) / 1e6 / wall;
      // More than the device has (allowing for a kernel counted at a second's edge): its kernels
      // did not spin for their blocks' time. simgpu does not run PTX; its cost table does.
      if (share > 110.0) {
        std::fprintf(stderr,
                     "busy_for: %.0f %% of the device's time is more than a device has: the kernels finished before "
                     "their blocks' %lld us. On simgpu, set SIMGPU_KERNEL_COSTS to busy_for.costs (installed beside "
                     "this program in share/cushare/examples, examples/tenant/ in the source)\n",
                     share, static_cast<long long>(o.blockUs));
        return 1;
      }
      std::printf("[%s] second %lld: %3.0f %% of the device's time\n", o.name.c_str(), static_cast<long long>(whole),
                  share);
      lastPrint = now;
      kernelsThisSecond = 0;
      second = whole + 1;
      if (whole >= o.seconds) break;
    }
    if (!launch(slot)) return 1;
  }
  if (!ok(cuStreamSynchronize(stream), "cuStreamSynchronize")) return 1;
  std::printf("[%s] done\n", o.name.c_str());
  return 0;
}
