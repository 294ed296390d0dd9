// A tenant process for the broker's MPS tests (mps_test.cpp), driven line by line over stdin. At
// start: cuInit and a context, then "ready <multiprocessor count>" (what an MPS client is granted)
// or "init-failed <code>" (exit 3).
//   alloc BYTES   -> "ok" | "oom" | "err CODE"
//   env NAME      -> "env VALUE" ("env -" when unset): what the shim set up
//   fault CODE    -> simgpu_debug_fault(CODE) (as a faulting kernel would): "ok"
//   sync          -> "sync CODE" (cuCtxSynchronize)
//   spin MS       -> launches mps_spin kernels (the cost table says how long a block lasts), each
//                    filling the SMs of a client capped at 30 or 70 % in whole waves, four queued
//                    at all times, for MS ms of host time: "spun KERNELS"
//   release       -> cuDevicePrimaryCtxRelease (with --primary 1: the program lets go of its
//                    context and everything in it): "release CODE"
//   quit          -> exits 0
// Options, applied in main before cuInit (a program changing its own environment after the
// shim's constructor ran):
//   --unset NAME          unsetenv(NAME)
//   --set NAME=VALUE      setenv(NAME, VALUE)
//   --hide NAME=VALUE     from then on this program's getenv answers VALUE for NAME ("" : unset)
//                         to everyone (the driver included) whatever the environment holds: a
//                         program that defeats its MPS settings in a way the shim cannot repair
//                         (the executable exports getenv, so it interposes on the libraries').
//   --primary 1           use the device's primary context (as every runtime program does)
//                         instead of a context of its own (cuCtxCreate)
#include <cuda.h>
#include <dlfcn.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <sstream>
#include <string>

// Plain pointers, constant-initialised: getenv runs before main (the shim's constructor).
static const char* gHideName = nullptr;
static const char* gHideValue = nullptr;

extern "C" char* getenv(const char* name) noexcept {
  if (gHideName != nullptr && std::strcmp(name, gHideName) == 0)
    return *gHideValue ? const_cast<char*>(gHideValue) : nullptr;
  const size_t n = std::strlen(name);
  for (char** e = environ; e && *e; ++e)
    if (std::strncmp(*e, name, n) == 0 && (*e)[n] == '=') return *e + n + 1;
  return nullptr;
}

namespace {

void say(const std::string& s) { std::cout << s << std::endl; }

std::string spin(long ms) {
  static const char kPtx[] = ".version 8.0\n.target sm_90\n.address_size 64\n";  // names nothing: any kernel loads
  CUmodule m = nullptr;
  CUfunction f = nullptr;
  CUstream s = nullptr;
  CUresult r = cuModuleLoadData(&m, kPtx);
  if (r == CUDA_SUCCESS) r = cuModuleGetFunction(&f, m, "mps_spin");
  if (r == CUDA_SUCCESS) r = cuStreamCreate(&s, CU_STREAM_NON_BLOCKING);
  if (r != CUDA_SUCCESS) return "err " + std::to_string(r);
  // Keep four kernels queued at all times, so the device never waits for the host: before each
  // launch, wait for the kernel four back (its event) only.
  constexpr int kQueued = 4;
  // 840 blocks of 1024 threads, two per SM: whole waves on 30 SMs (14) and on 70 (6), so a
  // client capped at 30 or 70 % of simgpu's 100 SMs fills every one of its SMs to the last block
  // (1024 blocks left a last wave on 44 of 70 SMs: 5 % of a kernel's SM-time empty).
  constexpr unsigned kBlocks = 840;
  CUevent done[kQueued] = {};
  for (int i = 0; i < kQueued && r == CUDA_SUCCESS; ++i) r = cuEventCreate(&done[i], CU_EVENT_DISABLE_TIMING);
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  long kernels = 0;
  while (r == CUDA_SUCCESS && std::chrono::steady_clock::now() < end) {
    CUevent& e = done[kernels % kQueued];
    if (kernels >= kQueued) r = cuEventSynchronize(e);
    if (r == CUDA_SUCCESS) r = cuLaunchKernel(f, kBlocks, 1, 1, 1024, 1, 1, 0, s, nullptr, nullptr);
    if (r == CUDA_SUCCESS) r = cuEventRecord(e, s);
    if (r == CUDA_SUCCESS) ++kernels;
  }
  if (r == CUDA_SUCCESS) r = cuStreamSynchronize(s);
  for (CUevent e : done)
    if (e) cuEventDestroy(e);
  return r == CUDA_SUCCESS ? "spun " + std::to_string(kernels) : "err " + std::to_string(r);
}

}  // namespace

int main(int argc, char** argv) {
  bool primary = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string opt = argv[i], arg = argv[i + 1];
    const size_t eq = arg.find('=');
    if (opt == "--primary") {
      primary = arg == "1";
    } else if (opt == "--unset") {
      ::unsetenv(arg.c_str());
    } else if (opt == "--set" && eq != std::string::npos) {
      ::setenv(arg.substr(0, eq).c_str(), arg.c_str() + eq + 1, 1);
    } else if (opt == "--hide" && eq != std::string::npos) {
      argv[i + 1][eq] = '\0';
      gHideValue = argv[i + 1] + eq + 1;
      gHideName = argv[i + 1];
    } else {
      say("bad option " + opt);
      return 2;
    }
  }
  CUcontext ctx;
  CUdevice dev;
  int sms = -1;
  CUresult r = cuInit(0);
  if (r == CUDA_SUCCESS) r = cuDeviceGet(&dev, 0);
  if (r == CUDA_SUCCESS) r = primary ? cuDevicePrimaryCtxRetain(&ctx, dev) : cuCtxCreate(&ctx, nullptr, 0, dev);
  if (r == CUDA_SUCCESS && primary) r = cuCtxSetCurrent(ctx);
  if (r == CUDA_SUCCESS) r = cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev);
  if (r != CUDA_SUCCESS) {
    say("init-failed " + std::to_string(r));
    return 3;
  }
  say("ready " + std::to_string(sms));
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd, arg;
    in >> cmd >> arg;
    if (cmd == "alloc") {
      CUdeviceptr p;
      const CUresult a = cuMemAlloc(&p, std::strtoull(arg.c_str(), nullptr, 10));
      say(a == CUDA_SUCCESS ? "ok" : a == CUDA_ERROR_OUT_OF_MEMORY ? "oom" : "err " + std::to_string(a));
    } else if (cmd == "env") {
      const char* v = std::getenv(arg.c_str());
      say(std::string("env ") + (v ? v : "-"));
    } else if (cmd == "fault") {
      auto f = reinterpret_cast<void (*)(int)>(::dlsym(RTLD_DEFAULT, "simgpu_debug_fault"));
      if (f) f(std::atoi(arg.c_str()));
      say(f ? "ok" : "err no simgpu_debug_fault");
    } else if (cmd == "sync") {
      say("sync " + std::to_string(cuCtxSynchronize()));
    } else if (cmd == "spin") {
      say(spin(std::atol(arg.c_str())));
    } else if (cmd == "release") {
      say("release " + std::to_string(cuDevicePrimaryCtxRelease(dev)));
    } else if (cmd == "quit") {
      return 0;
    } else {
      say("unknown command");
    }
  }
  return 0;
}
