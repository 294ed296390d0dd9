// CUDA inside simgpu's MIG devices (docs/simgpu.md, "MIG"): a process whose CUDA_VISIBLE_DEVICES
// names a MIG device sees only it, with the instance's name, SMs, memory and UUID; its allocations
// are held to the GPU instance's memory across processes while another instance is untouched; NVML
// counts them per MIG device and per instance (the device's own accounting, not the process's
// word); a killed process's memory returns; a MIG-enabled GPU is not reachable outside its MIG
// devices. Children are this program re-executed with --child (SIMGPU_GPU_MODEL=h100-80gb).
#include <dlfcn.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <cuda.h>

#include "simgpu/nvml.h"

namespace {

constexpr uint64_t kMiB = 1ull << 20;
std::string gSelf;

// ---- The child: cuInit, describe device 0, then allocate what stdin asks ----

// --child-shim: under the shim (its limit set by the parent), the tenant's view through CUDA and
// through NVML's MIG device handle, which must agree.
int childShim() {
  if (cuInit(0) != CUDA_SUCCESS) return 2;
  CUdevice dev;
  CUcontext ctx;
  cuDeviceGet(&dev, 0);
  cuDevicePrimaryCtxRetain(&ctx, dev);
  cuCtxSetCurrent(ctx);
  size_t free = 0, total = 0;
  cuMemGetInfo(&free, &total);
  nvmlInit_v2();
  nvmlDevice_t gpu, mig;
  nvmlMemory_t m = {};
  const bool ok = nvmlDeviceGetHandleByIndex_v2(0, &gpu) == NVML_SUCCESS &&
                  nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0, &mig) == NVML_SUCCESS &&
                  nvmlDeviceGetMemoryInfo(mig, &m) == NVML_SUCCESS;
  std::printf("cuda_total=%zu nvml_mig_total=%llu ok=%d\n", total, static_cast<unsigned long long>(m.total), ok);
  return 0;
}

// --child-init: cuInit only (no context, no memory), then wait for stdin to close.
int childInitOnly() {
  std::printf("init=%d\n", static_cast<int>(cuInit(0)));
  std::fflush(stdout);
  char line[16];
  while (std::fgets(line, sizeof line, stdin)) {
  }
  return 0;
}

int child() {
  const CUresult init = cuInit(0);
  int count = 0;
  if (init == CUDA_SUCCESS) cuDeviceGetCount(&count);
  if (init != CUDA_SUCCESS || count == 0) {
    std::printf("init=%d count=%d\n", static_cast<int>(init), count);
    std::fflush(stdout);
    return 0;
  }
  CUdevice dev;
  cuDeviceGet(&dev, 0);
  char name[128] = {};
  cuDeviceGetName(name, sizeof name, dev);
  size_t total = 0;
  cuDeviceTotalMem(&total, dev);
  int sms = 0;
  cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev);
  CUuuid v2, v1;
  cuDeviceGetUuid_v2(&v2, dev);
  // The first ABI by its own name (cuda.h maps cuDeviceGetUuid to _v2).
  using UuidFn = CUresult (*)(CUuuid*, CUdevice);
  reinterpret_cast<UuidFn>(dlsym(RTLD_DEFAULT, "cuDeviceGetUuid"))(&v1, dev);
  auto hex = [](const CUuuid& u) {
    char b[40];
    for (int i = 0; i < 16; ++i) std::snprintf(b + 2 * i, 3, "%02x", static_cast<unsigned char>(u.bytes[i]));
    return std::string(b);
  };
  CUcontext ctx;
  cuDevicePrimaryCtxRetain(&ctx, dev);
  cuCtxSetCurrent(ctx);
  std::printf("count=%d name=%s total=%zu sms=%d uuid=%s uuid1=%s\n", count, name, total, sms, hex(v2).c_str(),
              hex(v1).c_str());
  std::fflush(stdout);
  char line[128];
  while (std::fgets(line, sizeof line, stdin)) {
    unsigned long long mib = 0;
    if (std::sscanf(line, "alloc %llu", &mib) == 1) {
      CUdeviceptr p;
      const CUresult r = cuMemAlloc(&p, mib * kMiB);
      std::printf("%s\n", r == CUDA_SUCCESS ? "ok" : r == CUDA_ERROR_OUT_OF_MEMORY ? "oom" : "error");
    } else if (std::strncmp(line, "meminfo", 7) == 0) {
      size_t free = 0, tot = 0;
      cuMemGetInfo(&free, &tot);
      std::printf("free=%zu total=%zu\n", free, tot);
    } else {
      break;
    }
    std::fflush(stdout);
  }
  return 0;
}

// ---- The parent ----

struct Child {
  pid_t pid = -1;
  FILE* in = nullptr;
  FILE* out = nullptr;
  std::string line() {
    char b[512] = {};
    if (!std::fgets(b, sizeof b, out)) return "";
    std::string s(b);
    if (!s.empty() && s.back() == '\n') s.pop_back();
    return s;
  }
  std::string ask(const std::string& cmd) {
    std::fprintf(in, "%s\n", cmd.c_str());
    std::fflush(in);
    return line();
  }
  int stop() {
    if (pid < 0) return -1;
    if (in) std::fclose(in);
    int st = 0;
    ::waitpid(pid, &st, 0);
    if (out) std::fclose(out);
    pid = -1;
    return st;
  }
  ~Child() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      stop();
    }
  }
};

// This program as a child, with CUDA_VISIBLE_DEVICES set to visible (unset when null).
Child spawn(const char* visible, const char* mode = "--child") {
  int a[2], b[2];
  Child c;
  if (::pipe(a) != 0 || ::pipe(b) != 0) return c;
  c.pid = ::fork();
  if (c.pid == 0) {
    ::dup2(a[0], 0);
    ::dup2(b[1], 1);
    ::close(a[1]);
    ::close(b[0]);
    if (visible) ::setenv("CUDA_VISIBLE_DEVICES", visible, 1);
    else ::unsetenv("CUDA_VISIBLE_DEVICES");
    ::execl(gSelf.c_str(), gSelf.c_str(), mode, static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::close(a[0]);
  ::close(b[1]);
  c.in = ::fdopen(a[1], "w");
  c.out = ::fdopen(b[0], "r");
  return c;
}

std::string uuidHex(const std::string& migUuid) {  // "MIG-xxxxxxxx-..." or "GPU-..." -> 32 hex digits
  std::string h;
  for (char ch : migUuid.substr(4))
    if (ch != '-') h += ch;
  return h;
}

class MigCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(nvmlInit_v2(), NVML_SUCCESS);
    ASSERT_EQ(nvmlDeviceGetHandleByIndex_v2(0, &gpu), NVML_SUCCESS);
    nvmlReturn_t act;
    ASSERT_EQ(nvmlDeviceSetMigMode(gpu, NVML_DEVICE_MIG_ENABLE, &act), NVML_SUCCESS);
    // A 3g.40gb (GI 1) and a 1g.10gb at 0:1 (GI 7), each with its full compute instance.
    nvmlGpuInstancePlacement_t at = {0, 1};
    ASSERT_EQ(nvmlDeviceCreateGpuInstance(gpu, 9, &g3), NVML_SUCCESS);
    ASSERT_EQ(nvmlDeviceCreateGpuInstanceWithPlacement(gpu, 19, &at, &g1), NVML_SUCCESS);
    ASSERT_EQ(nvmlGpuInstanceCreateComputeInstance(g3, NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE, &c3), NVML_SUCCESS);
    ASSERT_EQ(nvmlGpuInstanceCreateComputeInstance(g1, NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, &c1), NVML_SUCCESS);
    ASSERT_EQ(nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0, &m3), NVML_SUCCESS);
    ASSERT_EQ(nvmlDeviceGetMigDeviceHandleByIndex(gpu, 1, &m1), NVML_SUCCESS);
    char u[96];
    ASSERT_EQ(nvmlDeviceGetUUID(m3, u, sizeof u), NVML_SUCCESS);
    uuid3 = u;
    ASSERT_EQ(nvmlDeviceGetUUID(m1, u, sizeof u), NVML_SUCCESS);
    uuid1 = u;
    ASSERT_EQ(nvmlDeviceGetUUID(gpu, u, sizeof u), NVML_SUCCESS);
    gpuUuid = u;
  }
  void TearDown() override {  // the next test starts from MIG off (the state is the host's)
    nvmlComputeInstanceDestroy(c3);
    nvmlComputeInstanceDestroy(c1);
    nvmlGpuInstanceDestroy(g3);
    nvmlGpuInstanceDestroy(g1);
    nvmlReturn_t act;
    EXPECT_EQ(nvmlDeviceSetMigMode(gpu, NVML_DEVICE_MIG_DISABLE, &act), NVML_SUCCESS);
    nvmlShutdown();
  }

  uint64_t used(nvmlDevice_t d) {
    nvmlMemory_t m = {};
    EXPECT_EQ(nvmlDeviceGetMemoryInfo(d, &m), NVML_SUCCESS);
    return m.used;
  }
  std::vector<nvmlProcessInfo_t> procs(nvmlDevice_t d) {
    std::vector<nvmlProcessInfo_t> p(16);
    unsigned n = 16;
    EXPECT_EQ(nvmlDeviceGetComputeRunningProcesses_v3(d, &n, p.data()), NVML_SUCCESS);
    p.resize(n);
    return p;
  }

  nvmlDevice_t gpu = nullptr, m3 = nullptr, m1 = nullptr;
  nvmlGpuInstance_t g3 = nullptr, g1 = nullptr;
  nvmlComputeInstance_t c3 = nullptr, c1 = nullptr;
  std::string uuid3, uuid1, gpuUuid;
};

TEST_F(MigCuda, AProcessInAMigDeviceIsHeldToItsInstance) {
  Child a = spawn(uuid3.c_str());
  const std::string info = a.line();
  EXPECT_EQ(info, "count=1 name=NVIDIA H100 80GB HBM3 MIG 3g.40gb total=" + std::to_string(40448 * kMiB) +
                      " sms=60 uuid=" + uuidHex(uuid3) + " uuid1=" + uuidHex(gpuUuid))
      << "(uuid1: the GPU's, through the first ABI)";
  // The legacy MIG-<GPU-UUID>/<GI>/<CI> form selects the 1g.
  Child b = spawn(("MIG-" + gpuUuid + "/7/0").c_str());
  EXPECT_EQ(b.line().rfind("count=1 name=NVIDIA H100 80GB HBM3 MIG 1g.10gb total=" + std::to_string(9984 * kMiB) +
                               " sms=16 ",
                           0),
            0u);

  // The 3g's 40448 MiB hold across the instance, though the GPU has 81559 MiB.
  ASSERT_EQ(a.ask("alloc 40000"), "ok");
  EXPECT_EQ(a.ask("alloc 1000"), "oom");
  EXPECT_EQ(a.ask("meminfo"), "free=" + std::to_string(448 * kMiB) + " total=" + std::to_string(40448 * kMiB));
  Child a2 = spawn(uuid3.c_str());  // a second process in the same instance shares its memory
  ASSERT_EQ(a2.line().rfind("count=1", 0), 0u);
  EXPECT_EQ(a2.ask("alloc 449"), "oom");
  EXPECT_EQ(a2.ask("alloc 448"), "ok");
  // The other instance is untouched.
  EXPECT_EQ(b.ask("alloc 9984"), "ok");
  EXPECT_EQ(b.ask("alloc 1"), "oom");

  // The device's own accounting: per MIG device, per process with its instance, and the GPU's sum.
  EXPECT_EQ(used(m3), (40000 + 448) * kMiB);
  EXPECT_EQ(used(m1), 9984 * kMiB);
  EXPECT_EQ(used(gpu), (40000 + 448 + 9984) * kMiB);
  const auto in3 = procs(m3);
  ASSERT_EQ(in3.size(), 2u);
  for (const auto& p : in3) {
    EXPECT_TRUE(p.pid == static_cast<unsigned>(a.pid) || p.pid == static_cast<unsigned>(a2.pid));
    EXPECT_EQ(p.gpuInstanceId, 1u);
    EXPECT_EQ(p.computeInstanceId, 0u);
  }
  const auto all = procs(gpu);
  ASSERT_EQ(all.size(), 3u);
  for (const auto& p : all)
    if (p.pid == static_cast<unsigned>(b.pid)) {
      EXPECT_EQ(p.gpuInstanceId, 7u);
      EXPECT_EQ(p.usedGpuMemory, 9984 * kMiB);
    }

  // An instance with processes in it cannot be destroyed.
  EXPECT_EQ(nvmlComputeInstanceDestroy(c3), NVML_ERROR_IN_USE);
  // kill -9: the instance's memory comes back (reaped on the next look).
  ASSERT_EQ(::kill(a.pid, SIGKILL), 0);
  a.stop();
  EXPECT_EQ(used(m3), 448 * kMiB);
  EXPECT_EQ(a2.ask("alloc 40000"), "ok");
  for (Child* c : {&a2, &b}) EXPECT_EQ(c->stop(), 0);
  EXPECT_EQ(used(gpu), 0u);
  EXPECT_EQ(nvmlComputeInstanceDestroy(c3), NVML_SUCCESS);
}

// A process is in its MIG device from cuInit on, before any context or memory: the instance
// cannot be destroyed under it (nor its GPU instance).
TEST_F(MigCuda, AnInstanceIsInUseFromTheFirstCudaCall) {
  Child c = spawn(uuid1.c_str(), "--child-init");
  ASSERT_EQ(c.line(), "init=0");
  EXPECT_EQ(nvmlComputeInstanceDestroy(c1), NVML_ERROR_IN_USE);
  EXPECT_EQ(nvmlComputeInstanceDestroy(c3), NVML_SUCCESS) << "the other instance is free";
  EXPECT_EQ(c.stop(), 0);
  EXPECT_EQ(nvmlComputeInstanceDestroy(c1), NVML_SUCCESS) << "free once the process has gone";
}

// Under the shim inside a MIG device (a standalone limit of 1 GiB on the MIG device), CUDA and
// NVML's MIG device handle report the tenant's view alike: cushare knows the MIG device by its UUID.
TEST_F(MigCuda, TheShimsViewHoldsForTheMigDeviceThroughCudaAndNvml) {
  ::setenv("LD_PRELOAD", SHIM_LIB, 1);
  ::setenv("CUSHARE_TENANT", "alpha", 1);
  ::setenv("CUSHARE_MEMORY_LIMIT", "1GiB", 1);
  const std::string ledgers = std::string(std::getenv("SIMGPU_STATE_DIR")) + "/ledgers";
  ::setenv("CUSHARE_LEDGER_DIR", ledgers.c_str(), 1);
  Child c = spawn(uuid3.c_str(), "--child-shim");
  for (const char* v : {"LD_PRELOAD", "CUSHARE_TENANT", "CUSHARE_MEMORY_LIMIT", "CUSHARE_LEDGER_DIR"}) ::unsetenv(v);
  EXPECT_EQ(c.line(), "cuda_total=" + std::to_string(1024 * kMiB) + " nvml_mig_total=" + std::to_string(1024 * kMiB) +
                          " ok=1");
}

// Outside its MIG devices a MIG-enabled GPU is not reachable: no CUDA_VISIBLE_DEVICES, its index,
// its GPU UUID, a MIG UUID it does not have.
TEST_F(MigCuda, AMigEnabledGpuIsOnlyReachedThroughItsMigDevices) {
  for (const char* v : {static_cast<const char*>(nullptr), "0", gpuUuid.c_str(),
                        "MIG-00000000-0000-5000-8000-000000000000", "MIG-"}) {
    Child c = spawn(v);
    EXPECT_EQ(c.line(), "init=100 count=0") << (v ? v : "<unset>");  // CUDA_ERROR_NO_DEVICE
  }
  // The first MIG entry counts; one MIG device per process.
  Child c = spawn((std::string("0,") + uuid1 + "," + uuid3).c_str());
  EXPECT_EQ(c.line().rfind("count=1 name=NVIDIA H100 80GB HBM3 MIG 1g.10gb ", 0), 0u);
}

// Device time (timing: run alone): compute instances run side by side, each on its own SMs, while
// two processes in one MIG device take turns as on a whole GPU. perf/timeslice_probe reads the
// gaps in its own device time (runs: the slices between gaps).
std::string probe(const std::string& visible) {
  const std::string cmd = "CUDA_VISIBLE_DEVICES=" + visible + " SIMGPU_TIME_SLICE_US=4000 " +
                          SIMGPU_PROBES "/timeslice_probe 1 500 2>&1";
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  char b[512];
  while (p && std::fgets(b, sizeof b, p)) out += b;
  if (p) ::pclose(p);
  return out;
}

double field(const std::string& line, const std::string& key) {
  const size_t at = line.find(" " + key + "=");
  return at == std::string::npos ? -1 : std::atof(line.c_str() + at + key.size() + 2);
}

TEST_F(MigCuda, InstancesRunSideBySideAndProcessesInOneTakeTurns) {
  std::string a, b;
  {
    std::thread t([&] { a = probe(uuid3); });
    b = probe(uuid1);
    t.join();
  }
  // Never sliced out: no gaps, or (the host descheduled simgpu's engine for a few hundred us, as
  // a 2-core machine under load does) gaps far shorter than the 4 ms slice a second process in
  // the same MIG device would take (below: 20 runs and more, gaps of 3.5 ms and more).
  for (const std::string& l : {a, b}) {
    EXPECT_EQ(l.rfind("timeslice ", 0), 0u) << l;
    EXPECT_TRUE(field(l, "runs") == 0 || (field(l, "runs") < 5 && field(l, "gap_us") < 2000))
        << "never sliced out: " << l;
  }
  {
    std::thread t([&] { a = probe(uuid3); });
    b = probe(uuid3);
    t.join();
  }
  for (const std::string& l : {a, b}) {
    EXPECT_GE(field(l, "runs"), 20) << "slices of 4 ms in one MIG device: " << l;
    EXPECT_GE(field(l, "gap_us"), 3500) << l;
  }
}

}  // namespace

int main(int argc, char** argv) {
  gSelf = argv[0];
  if (argc > 1 && std::strcmp(argv[1], "--child") == 0) return child();
  if (argc > 1 && std::strcmp(argv[1], "--child-init") == 0) return childInitOnly();
  if (argc > 1 && std::strcmp(argv[1], "--child-shim") == 0) return childShim();
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
