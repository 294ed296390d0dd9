// A tenant program for the demo: takes device memory a step at a time until the driver refuses
// (under the shim: until the tenant's limit), then holds it. SIGUSR1 tries to take more (after a
// limit was raised, or another tenant freed memory); SIGTERM or SIGINT frees everything and exits
// 0. Plain C++ on the CUDA driver API, so it runs unchanged on a GPU and on simgpu.
//
//   usage: alloc_until_denied [--step SIZE] [--max SIZE] [--device N] [--name LABEL]
//
// Every line of output starts with [LABEL] (default: $CUSHARE_TENANT, else "default"), so the
// output of several tenants can be interleaved in one terminal. Exit status: 0 after a signal to
// stop, 1 on a CUDA error other than out of memory, 2 on a usage error.
#include <cuda.h>
#include <signal.h>
#include <unistd.h>

#include <climits>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "cushare/parse.h"
#include "tenant_program.h"

namespace {

constexpr const char* kUsage =
    "usage: alloc_until_denied [--step SIZE] [--max SIZE] [--device N] [--name LABEL]\n"
    "  Allocates SIZE (default 64MiB) at a time with cuMemAlloc until out of memory or --max,\n"
    "  then waits: SIGUSR1 allocates again, SIGTERM or SIGINT frees everything and exits.\n";

struct Options {
  uint64_t step = 64ull << 20;
  uint64_t max = UINT64_MAX;  // no bound but the device's (or the tenant's) memory
  int device = 0;
  std::string name;
};

// Fills *o from argv. On a usage error returns false with *err set to one line.
bool parseArgs(int argc, char** argv, Options* o, std::string* err) {
  o->name = tenant_program::defaultLabel();
  const bool parsed = tenant_program::parseOptions(
      argc, argv, {"--step", "--max", "--device", "--name"},
      [&](std::string_view opt, std::string_view value, std::string* why) {
        int64_t device = 0;
        if (opt == "--name") {
          o->name = value;
          return true;
        }
        if (opt == "--device") {
          if (!cushare::parseInt(value, 0, INT_MAX, &device, why)) return false;
          o->device = static_cast<int>(device);
          return true;
        }
        return cushare::parseSize(value, opt == "--step" ? &o->step : &o->max, why);
      },
      err);
  if (!parsed) return false;
  if (o->step == 0) *err = "--step: must be more than 0 bytes";
  if (o->name.empty()) *err = "--name: must not be empty";
  return err->empty();
}

// True for CUDA_SUCCESS; otherwise prints "alloc_until_denied: <what>: <text> (<name>)".
bool ok(CUresult r, const char* what) { return tenant_program::cudaOk("alloc_until_denied", r, what); }

// The memory this program holds, in allocations of one step each.
class Holding {
 public:
  explicit Holding(const Options& o) : o_(o) {}

  // Allocates steps until the driver says out of memory or --max is reached, one line each.
  // False on any other error (already reported).
  bool fill() {
    for (;;) {
      if (o_.max - held_ < o_.step) {
        say("holding %s; --max %s reached", cushare::formatSize(held_).c_str(),
            cushare::formatSize(o_.max).c_str());
        return true;
      }
      CUdeviceptr p = 0;
      const CUresult r = cuMemAlloc(&p, o_.step);
      if (r == CUDA_ERROR_OUT_OF_MEMORY) {
        sayDenied();
        return true;
      }
      if (!ok(r, "cuMemAlloc")) return false;
      ptrs_.push_back(p);
      held_ += o_.step;
      say("+%s -> holding %s", cushare::formatSize(o_.step).c_str(),
          cushare::formatSize(held_).c_str());
    }
  }

  // Frees everything; false if a free failed (reported; the rest are still freed).
  bool release() {
    bool all = true;
    for (const CUdeviceptr p : ptrs_) all = ok(cuMemFree(p), "cuMemFree") && all;
    say("freed %s (%zu allocations), exiting", cushare::formatSize(held_).c_str(), ptrs_.size());
    ptrs_.clear();
    held_ = 0;
    return all;
  }

  // "[label] " + the formatted text + newline, on stdout, flushed: whoever watches the output (a
  // demo reading a file or pipe) sees each line as it happens.
  __attribute__((format(printf, 2, 3))) void say(const char* format, ...) const {
    std::printf("[%s] ", o_.name.c_str());
    va_list args;
    va_start(args, format);
    std::vprintf(format, args);
    va_end(args);
    std::printf("\n");
    std::fflush(stdout);
  }

 private:
  // The denial, with the view that explains it: under the shim, total is the tenant's limit, so
  // "0 B free of 512 MiB" means the tenant is at its limit; without it, the device is full.
  void sayDenied() const {
    size_t free = 0, total = 0;
    const bool info = cuMemGetInfo(&free, &total) == CUDA_SUCCESS;
    say("denied at %s: out of memory (cuMemGetInfo: %s free of %s)",
        cushare::formatSize(held_).c_str(), info ? cushare::formatSize(free).c_str() : "?",
        info ? cushare::formatSize(total).c_str() : "?");
  }

  const Options& o_;
  std::vector<CUdeviceptr> ptrs_;
  uint64_t held_ = 0;
};

// Waits for the signals in set: SIGUSR1 fills again, SIGTERM/SIGINT end the wait. False on a CUDA
// error.
bool serveSignals(const sigset_t& set, Holding* holding) {
  for (;;) {
    int sig = 0;
    if (sigwait(&set, &sig) != 0) continue;  // only EINVAL, impossible for this set
    if (sig != SIGUSR1) return true;
    holding->say("SIGUSR1: allocating again");
    if (!holding->fill()) return false;
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (const int rc = tenant_program::begin("alloc_until_denied", kUsage, argc, argv,
                                           [&](std::string* err) { return parseArgs(argc, argv, &o, err); });
      rc >= 0)
    return rc;

  // Block the signals before cuInit: the driver's threads inherit this mask, so the signals stay
  // pending for sigwait below instead of being delivered to (and by default killing the process
  // from) a thread that does not wait for them.
  sigset_t set;
  sigemptyset(&set);
  for (const int sig : {SIGUSR1, SIGTERM, SIGINT}) sigaddset(&set, sig);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);

  CUdevice dev = 0;
  CUcontext ctx = nullptr;
  if (!ok(cuInit(0), "cuInit") || !ok(cuDeviceGet(&dev, o.device), "cuDeviceGet") ||
      !ok(cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain") ||
      !ok(cuCtxSetCurrent(ctx), "cuCtxSetCurrent"))
    return 1;
  char deviceName[256] = {};
  cuDeviceGetName(deviceName, sizeof deviceName, dev);

  // Under the shim this is the tenant's view: total is its limit, free what is left of it.
  size_t free = 0, total = 0;
  if (!ok(cuMemGetInfo(&free, &total), "cuMemGetInfo")) return 1;
  Holding holding(o);
  holding.say("device %d (%s): %s free of %s", o.device, deviceName,
              cushare::formatSize(free).c_str(), cushare::formatSize(total).c_str());
  bool fine = holding.fill();
  if (fine) {
    holding.say("waiting (pid %d): kill -USR1 allocates again, kill -TERM frees and exits",
                static_cast<int>(getpid()));
    fine = serveSignals(set, &holding);
  }
  fine = holding.release() && fine;
  cuDevicePrimaryCtxRelease(dev);
  return fine ? 0 : 1;
}
