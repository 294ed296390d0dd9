// simgpu's libnvidia-ml.so.1, exercised through its C API as NVML clients use it.
//
// Three configurations, one program (CMake selects the suites with --gtest_filter, and each
// suite also skips itself when the environment is not the one it was written for):
// - default (1 device, 16 GiB): Nvml* suites;
// - SIMGPU_DEVICES=2 SIMGPU_MEMORY=1GiB,2GiB: NvmlTwoDevices;
// - SIMGPU_DEVICES=0 (invalid): NvmlBadEnv.
// The cross-process tests map the same host-wide state as NVML (simgpu::SharedState), reserve
// memory in a forked child, and check that NVML in this process sees it, and sees it come back
// when the child is killed with SIGKILL.
#define NVML_NO_UNVERSIONED_FUNC_DEFS  // to call the legacy entry points by name too
#include "simgpu/nvml.h"

#include <dlfcn.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "config.h"
#include "shared_state.h"

namespace {

constexpr unsigned long long kMiB = 1ull << 20;

static_assert(sizeof(nvmlMemory_v2_t) == 40 && nvmlMemory_v2 == (40u | (2u << 24)));
static_assert(sizeof(nvmlPciInfo_t) == 68 && sizeof(nvmlPciInfoLegacy_t) == 52);
static_assert(sizeof(nvmlProcessInfo_v1_t) == 16 && sizeof(nvmlProcessInfo_t) == 24);
static_assert(sizeof(nvmlFieldValue_t) == 40 && sizeof(nvmlGpuFabricInfo_v2_t) == 36);
static_assert(NVML_ERROR_INSUFFICIENT_SIZE == 7 && NVML_ERROR_UNKNOWN == 999);

const char* env(const char* name) { return std::getenv(name); }
bool defaultEnv() { return !env("SIMGPU_DEVICES") && !env("SIMGPU_MEMORY"); }
bool twoDeviceEnv() { return env("SIMGPU_DEVICES") && std::string(env("SIMGPU_DEVICES")) == "2"; }

simgpu::SharedState* openState() {
  simgpu::Config cfg;
  std::string err;
  if (!simgpu::loadConfig(&cfg, &err)) return nullptr;
  return simgpu::SharedState::open(cfg.stateDir, cfg.deviceCount, cfg.memory, cfg.smCount, &err);
}

// cushare_sim_test gives each test its own SIMGPU_STATE_DIR under a shared root; SharedState
// creates the state directory itself but not its parents, so make sure the root exists.
class StateRoot : public ::testing::Environment {
 public:
  void SetUp() override {
    const char* dir = env("SIMGPU_STATE_DIR");
    if (!dir || dir[0] != '/') return;
    std::string path(dir);
    for (size_t slash = path.find('/', 1); slash != std::string::npos; slash = path.find('/', slash + 1))
      mkdir(path.substr(0, slash).c_str(), 0777);  // EEXIST is fine; anything else shows up at init
  }
};
[[maybe_unused]] ::testing::Environment* const kStateRoot = ::testing::AddGlobalTestEnvironment(new StateRoot);

nvmlDevice_t handle(unsigned i) {
  nvmlDevice_t h = nullptr;
  EXPECT_EQ(nvmlDeviceGetHandleByIndex_v2(i, &h), NVML_SUCCESS);
  return h;
}

nvmlMemory_t memory(nvmlDevice_t h) {
  nvmlMemory_t m{};
  EXPECT_EQ(nvmlDeviceGetMemoryInfo(h, &m), NVML_SUCCESS);
  EXPECT_EQ(m.free + m.used, m.total);
  return m;
}

std::vector<nvmlProcessInfo_t> processes(nvmlDevice_t h) {
  unsigned n = 0;
  nvmlReturn_t r = nvmlDeviceGetComputeRunningProcesses_v3(h, &n, nullptr);
  EXPECT_TRUE(r == NVML_SUCCESS || r == NVML_ERROR_INSUFFICIENT_SIZE) << nvmlErrorString(r);
  std::vector<nvmlProcessInfo_t> v(n + 4);  // room for a process that starts meanwhile
  n = static_cast<unsigned>(v.size());
  EXPECT_EQ(nvmlDeviceGetComputeRunningProcesses_v3(h, &n, v.data()), NVML_SUCCESS);
  v.resize(n);
  return v;
}

const nvmlProcessInfo_t* findPid(const std::vector<nvmlProcessInfo_t>& v, pid_t pid) {
  for (const auto& p : v)
    if (p.pid == static_cast<unsigned>(pid)) return &p;
  return nullptr;
}

// A child process holding `bytes` on device `dev` until it is killed. The destructor kills it, so
// a failed assertion never leaves it behind.
class Holder {
 public:
  Holder(int dev, uint64_t bytes) {
    int fds[2];
    if (pipe(fds) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      close(fds[0]);
      simgpu::SharedState* st = openState();  // its own mapping and slot, as a CUDA process has
      const char ok = st && st->reserve(dev, bytes) ? 1 : 0;
      if (write(fds[1], &ok, 1) != 1) _exit(1);
      while (true) pause();
    }
    close(fds[1]);
    char ok = 0;
    reserved_ = pid_ > 0 && read(fds[0], &ok, 1) == 1 && ok == 1;
    close(fds[0]);
  }
  ~Holder() { kill(); }
  bool reserved() const { return reserved_; }
  pid_t pid() const { return pid_; }
  void kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  pid_t pid_ = -1;
  bool reserved_ = false;
};

// Initialises NVML around each test, in the environment its suite was written for only.
template <bool (*Wanted)()>
class InitFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!Wanted()) GTEST_SKIP() << "not the SIMGPU_* environment this suite is for";
    ASSERT_TRUE(simgpu::loadConfig(&cfg_, &err_)) << err_;
    ASSERT_EQ(nvmlInit_v2(), NVML_SUCCESS);
    inited_ = true;
  }
  void TearDown() override {
    if (inited_) {
      EXPECT_EQ(nvmlShutdown(), NVML_SUCCESS);
    }
  }
  simgpu::Config cfg_;
  std::string err_;
  bool inited_ = false;
};
using Nvml = InitFixture<defaultEnv>;
using NvmlTwoDevices = InitFixture<twoDeviceEnv>;

TEST(NvmlInit, IsReferenceCounted) {
  if (!defaultEnv()) GTEST_SKIP();
  unsigned n = 0;
  EXPECT_EQ(nvmlDeviceGetCount_v2(&n), NVML_ERROR_UNINITIALIZED);
  EXPECT_EQ(nvmlShutdown(), NVML_ERROR_UNINITIALIZED);
  char buf[80];
  EXPECT_EQ(nvmlSystemGetDriverVersion(buf, sizeof buf), NVML_ERROR_UNINITIALIZED);
  EXPECT_STREQ(nvmlErrorString(NVML_ERROR_UNINITIALIZED), "Uninitialized");  // needs no init

  ASSERT_EQ(nvmlInit_v2(), NVML_SUCCESS);
  ASSERT_EQ(nvmlInit(), NVML_SUCCESS);
  ASSERT_EQ(nvmlInitWithFlags(NVML_INIT_FLAG_NO_GPUS), NVML_SUCCESS);
  nvmlDevice_t h = handle(0);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(nvmlShutdown(), NVML_SUCCESS);
    EXPECT_EQ(nvmlDeviceGetCount_v2(&n), NVML_SUCCESS) << "still initialised after shutdown " << i;
  }
  EXPECT_EQ(nvmlShutdown(), NVML_SUCCESS);
  EXPECT_EQ(nvmlDeviceGetCount_v2(&n), NVML_ERROR_UNINITIALIZED);
  unsigned idx;
  EXPECT_EQ(nvmlDeviceGetIndex(h, &idx), NVML_ERROR_UNINITIALIZED);
  EXPECT_EQ(nvmlShutdown(), NVML_ERROR_UNINITIALIZED);

  ASSERT_EQ(nvmlInit_v2(), NVML_SUCCESS);  // again after a full shutdown: same handles
  EXPECT_EQ(handle(0), h);
  EXPECT_EQ(nvmlShutdown(), NVML_SUCCESS);
}

TEST(NvmlInit, ConcurrentInitAndQueries) {
  if (!defaultEnv()) GTEST_SKIP();
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t)
    threads.emplace_back([&failures] {
      for (int i = 0; i < 200; ++i) {
        if (nvmlInit_v2() != NVML_SUCCESS) {
          ++failures;
          return;
        }
        nvmlDevice_t h;
        nvmlMemory_t m;
        if (nvmlDeviceGetHandleByIndex_v2(0, &h) != NVML_SUCCESS || nvmlDeviceGetMemoryInfo(h, &m) != NVML_SUCCESS)
          ++failures;
        if (nvmlShutdown() != NVML_SUCCESS) ++failures;
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  unsigned n;
  EXPECT_EQ(nvmlDeviceGetCount_v2(&n), NVML_ERROR_UNINITIALIZED);
}

TEST(NvmlInit, ExportsWhatNcclLooksUp) {
  void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
  ASSERT_NE(lib, nullptr) << dlerror();
  for (const char* name :
       {"nvmlInit", "nvmlInit_v2", "nvmlShutdown", "nvmlDeviceGetCount", "nvmlDeviceGetCount_v2",
        "nvmlDeviceGetHandleByPciBusId", "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetIndex",
        "nvmlDeviceGetPciInfo", "nvmlErrorString", "nvmlDeviceGetNvLinkState",
        "nvmlDeviceGetNvLinkRemotePciInfo", "nvmlDeviceGetNvLinkCapability",
        "nvmlDeviceGetCudaComputeCapability", "nvmlDeviceGetP2PStatus", "nvmlDeviceGetFieldValues",
        "nvmlDeviceGetGpuFabricInfoV", "nvmlDeviceGetPlatformInfo", "nvmlSystemGetConfComputeState",
        "nvmlSystemGetConfComputeSettings"})
    EXPECT_NE(dlsym(lib, name), nullptr) << name;
  EXPECT_EQ(dlsym(lib, "nvmlDeviceGetSimgpuNoSuchFunction"), nullptr);
  EXPECT_EQ(dlsym(lib, "_ZN6simgpu4nvml11initializedEv"), nullptr) << "internals must stay hidden";
  dlclose(lib);
}

// Every function NVIDIA's CUDA 13 header declares (the list kept in simgpu/nvml/, taken from
// PyPI's nvidia-nvml-dev 13.5.37 nvml.h) is exported, legacy and versioned names alike. PyTorch,
// for one, resolves its NVML functions with dlsym and asserts each is found.
TEST(NvmlInit, ExportsTheWholeCuda13Api) {
  void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
  ASSERT_NE(lib, nullptr) << dlerror();
  FILE* f = std::fopen(SIMGPU_NVML_API_LIST, "r");
  ASSERT_NE(f, nullptr) << SIMGPU_NVML_API_LIST;
  char line[1024];
  int names = 0, missing = 0;
  while (std::fgets(line, sizeof line, f)) {
    if (line[0] == '#' || line[0] == '\n') continue;
    const char* paren = std::strchr(line, '(');
    ASSERT_NE(paren, nullptr) << line;
    const char* start = paren;
    while (start > line && (std::isalnum(static_cast<unsigned char>(start[-1])) || start[-1] == '_')) --start;
    const std::string name(start, paren);
    ASSERT_EQ(name.rfind("nvml", 0), 0u) << line;
    ++names;
    if (dlsym(lib, name.c_str()) == nullptr) {
      ++missing;
      ADD_FAILURE() << name << " is not exported";
    }
  }
  std::fclose(f);
  EXPECT_EQ(names, 436) << "the kept list changed: update this count with it";
  EXPECT_EQ(missing, 0);
  dlclose(lib);
}

// What simgpu does not model answers as a real device without the feature: NOT_SUPPORTED with
// every output untouched; a null output, an unknown handle or a call before nvmlInit is refused
// first, as NVML does.
TEST(NvmlInit, UnmodelledFunctionsAreNotSupported) {
  void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
  ASSERT_NE(lib, nullptr) << dlerror();
  using RemoteType = nvmlReturn_t (*)(nvmlDevice_t, unsigned int, int*);
  using Temperature = nvmlReturn_t (*)(nvmlDevice_t, int, unsigned int*);
  using Samples = nvmlReturn_t (*)(nvmlDevice_t, unsigned int, unsigned long long, int*, unsigned int*, void*);
  auto remoteType = reinterpret_cast<RemoteType>(dlsym(lib, "nvmlDeviceGetNvLinkRemoteDeviceType"));
  auto temperature = reinterpret_cast<Temperature>(dlsym(lib, "nvmlDeviceGetTemperature"));
  auto samples = reinterpret_cast<Samples>(dlsym(lib, "nvmlDeviceGetSamples"));
  ASSERT_TRUE(remoteType && temperature && samples);

  int type = 12345;
  EXPECT_EQ(remoteType(nullptr, 0, &type), NVML_ERROR_UNINITIALIZED);
  ASSERT_EQ(nvmlInit_v2(), NVML_SUCCESS);
  nvmlDevice_t dev = nullptr;
  ASSERT_EQ(nvmlDeviceGetHandleByIndex_v2(0, &dev), NVML_SUCCESS);
  EXPECT_EQ(remoteType(dev, 0, &type), NVML_ERROR_NOT_SUPPORTED);
  EXPECT_EQ(type, 12345) << "an unsupported query must leave its output alone";
  EXPECT_EQ(remoteType(dev, 0, nullptr), NVML_ERROR_INVALID_ARGUMENT);
  int notADevice = 0;
  EXPECT_EQ(remoteType(reinterpret_cast<nvmlDevice_t>(&notADevice), 0, &type), NVML_ERROR_INVALID_ARGUMENT);
  unsigned temp = 777;
  EXPECT_EQ(temperature(dev, 0, &temp), NVML_ERROR_NOT_SUPPORTED);
  EXPECT_EQ(temp, 777u);
  EXPECT_EQ(temperature(dev, 0, nullptr), NVML_ERROR_INVALID_ARGUMENT);
  // A list with a count pointer: the array may be null (the size query), the count may not.
  int valueType = -1;
  unsigned count = 0;
  EXPECT_EQ(samples(dev, 0, 0, &valueType, &count, nullptr), NVML_ERROR_NOT_SUPPORTED);
  EXPECT_EQ(count, 0u);
  EXPECT_EQ(valueType, -1);
  EXPECT_EQ(samples(dev, 0, 0, &valueType, nullptr, nullptr), NVML_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(nvmlShutdown(), NVML_SUCCESS);
  dlclose(lib);
}

TEST_F(Nvml, HandlesRoundTrip) {
  unsigned n = 0, n1 = 0;
  ASSERT_EQ(nvmlDeviceGetCount_v2(&n), NVML_SUCCESS);
  ASSERT_EQ(nvmlDeviceGetCount(&n1), NVML_SUCCESS);
  EXPECT_EQ(n, static_cast<unsigned>(cfg_.deviceCount));
  EXPECT_EQ(n1, n);
  for (unsigned i = 0; i < n; ++i) {
    nvmlDevice_t h = handle(i), h1 = nullptr, byUuid = nullptr, byPci = nullptr;
    ASSERT_EQ(nvmlDeviceGetHandleByIndex(i, &h1), NVML_SUCCESS);
    EXPECT_EQ(h1, h);
    unsigned idx = 99, minor = 99;
    EXPECT_EQ(nvmlDeviceGetIndex(h, &idx), NVML_SUCCESS);
    EXPECT_EQ(idx, i);
    EXPECT_EQ(nvmlDeviceGetMinorNumber(h, &minor), NVML_SUCCESS);
    EXPECT_EQ(minor, i);

    char uuid[NVML_DEVICE_UUID_BUFFER_SIZE];
    ASSERT_EQ(nvmlDeviceGetUUID(h, uuid, sizeof uuid), NVML_SUCCESS);
    EXPECT_EQ(uuid, simgpu::deviceUuidString(static_cast<int>(i)));
    ASSERT_EQ(nvmlDeviceGetHandleByUUID(uuid, &byUuid), NVML_SUCCESS);
    EXPECT_EQ(byUuid, h);

    nvmlPciInfo_t pci{};
    ASSERT_EQ(nvmlDeviceGetPciInfo_v3(h, &pci), NVML_SUCCESS);
    EXPECT_EQ(pci.busId, simgpu::devicePciBusId(static_cast<int>(i)));
    EXPECT_EQ(pci.bus, simgpu::devicePciBus(static_cast<int>(i)));
    EXPECT_EQ(pci.domain, 0u);
    EXPECT_EQ(pci.pciDeviceId & 0xFFFF, 0x10DEu);
    char legacy[32];
    std::snprintf(legacy, sizeof legacy, "0000:%02X:00.0", pci.bus);
    EXPECT_STREQ(pci.busIdLegacy, legacy);
    char lower[32];
    std::snprintf(lower, sizeof lower, "%02x:00.0", pci.bus);  // no domain, lower case, as NCCL
    for (const char* id : {static_cast<const char*>(pci.busId), static_cast<const char*>(legacy),
                           static_cast<const char*>(lower)}) {
      byPci = nullptr;
      EXPECT_EQ(nvmlDeviceGetHandleByPciBusId_v2(id, &byPci), NVML_SUCCESS) << id;
      EXPECT_EQ(byPci, h) << id;
      byPci = nullptr;
      EXPECT_EQ(nvmlDeviceGetHandleByPciBusId(id, &byPci), NVML_SUCCESS) << id;
      EXPECT_EQ(byPci, h) << id;
    }
  }
}

TEST_F(Nvml, BadArgumentsAreRefused) {
  nvmlDevice_t h = handle(0), out = nullptr;
  unsigned n;
  EXPECT_EQ(nvmlDeviceGetCount_v2(nullptr), NVML_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(nvmlDeviceGetHandleByIndex_v2(static_cast<unsigned>(cfg_.deviceCount), &out),
            NVML_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(nvmlDeviceGetHandleByIndex_v2(0, nullptr), NVML_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000", &out), NVML_ERROR_NOT_FOUND);
  EXPECT_EQ(nvmlDeviceGetHandleByUUID(nullptr, &out), NVML_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(nvmlDeviceGetHandleByPciBusId_v2("00000000:7F:00.0", &out), NVML_ERROR_NOT_FOUND);
  EXPECT_EQ(nvmlDeviceGetHandleByPciBusId_v2("00000001:18:00.0", &out), NVML_ERROR_NOT_FOUND);
  EXPECT_EQ(nvmlDeviceGetHandleByPciBusId_v2("not a bus id", &out), NVML_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(nvmlDeviceGetHandleByPciBusId_v2("18", &out), NVML_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(nvmlDeviceGetHandleByPciBusId_v2(nullptr, &out), NVML_ERROR_INVALID_ARGUMENT);
  int notADevice = 0;
  nvmlDevice_t bogus = reinterpret_cast<nvmlDevice_t>(&notADevice);
  EXPECT_EQ(nvmlDeviceGetIndex(bogus, &n), NVML_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(nvmlDeviceGetIndex(nullptr, &n), NVML_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(nvmlDeviceGetIndex(reinterpret_cast<nvmlDevice_t>(reinterpret_cast<char*>(h) + 1), &n),
            NVML_ERROR_INVALID_ARGUMENT);
  nvmlMemory_t m;
  EXPECT_EQ(nvmlDeviceGetMemoryInfo(bogus, &m), NVML_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(nvmlDeviceGetMemoryInfo(h, nullptr), NVML_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(nvmlDeviceGetComputeRunningProcesses_v3(h, nullptr, nullptr), NVML_ERROR_INVALID_ARGUMENT);
  n = 1;
  EXPECT_EQ(nvmlDeviceGetComputeRunningProcesses_v3(h, &n, nullptr), NVML_ERROR_INVALID_ARGUMENT);
}

TEST_F(Nvml, StringsHonourBufferSizes) {
  nvmlDevice_t h = handle(0);
  char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
  ASSERT_EQ(nvmlDeviceGetName(h, name, sizeof name), NVML_SUCCESS);
  EXPECT_EQ(name, cfg_.name);
  const unsigned need = static_cast<unsigned>(cfg_.name.size() + 1);
  char exact[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
  EXPECT_EQ(nvmlDeviceGetName(h, exact, need), NVML_SUCCESS);
  EXPECT_EQ(nvmlDeviceGetName(h, exact, need - 1), NVML_ERROR_INSUFFICIENT_SIZE);
  EXPECT_EQ(nvmlDeviceGetName(h, nullptr, 64), NVML_ERROR_INVALID_ARGUMENT);
  char small[8];
  EXPECT_EQ(nvmlDeviceGetUUID(h, small, sizeof small), NVML_ERROR_INSUFFICIENT_SIZE);
  char ver[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE];
  EXPECT_EQ(nvmlSystemGetDriverVersion(ver, sizeof ver), NVML_SUCCESS);
  EXPECT_GT(std::strlen(ver), 0u);
  EXPECT_EQ(nvmlSystemGetNVMLVersion(ver, sizeof ver), NVML_SUCCESS);
  EXPECT_EQ(std::string(ver).rfind("13.", 0), 0u) << ver;
  EXPECT_EQ(nvmlSystemGetDriverVersion(ver, 2), NVML_ERROR_INSUFFICIENT_SIZE);
  char serial[NVML_DEVICE_SERIAL_BUFFER_SIZE];
  EXPECT_EQ(nvmlDeviceGetSerial(h, serial, sizeof serial), NVML_SUCCESS);
  char proc[256];
  ASSERT_EQ(nvmlSystemGetProcessName(static_cast<unsigned>(getpid()), proc, sizeof proc), NVML_SUCCESS);
  char exe[4096] = {};
  ASSERT_GT(readlink("/proc/self/exe", exe, sizeof exe - 1), 0);
  const std::string base = std::strrchr(exe, '/') + 1, got = proc;  // argv[0] may be relative
  EXPECT_EQ(got.substr(got.size() - std::min(got.size(), base.size())), base) << got;
}

TEST_F(Nvml, DescribesAHopperWithoutNvlink) {
  nvmlDevice_t h = handle(0);
  int major = 0, minor = 0, cuda = 0;
  EXPECT_EQ(nvmlDeviceGetCudaComputeCapability(h, &major, &minor), NVML_SUCCESS);
  EXPECT_EQ(major * 10 + minor, 90);
  nvmlDeviceArchitecture_t arch = 0;
  EXPECT_EQ(nvmlDeviceGetArchitecture(h, &arch), NVML_SUCCESS);
  EXPECT_EQ(arch, static_cast<nvmlDeviceArchitecture_t>(NVML_DEVICE_ARCH_HOPPER));
  EXPECT_EQ(nvmlSystemGetCudaDriverVersion(&cuda), NVML_SUCCESS);
  EXPECT_EQ(cuda, 13000);
  EXPECT_EQ(nvmlSystemGetCudaDriverVersion_v2(&cuda), NVML_SUCCESS);
  nvmlComputeMode_t mode;
  EXPECT_EQ(nvmlDeviceGetComputeMode(h, &mode), NVML_SUCCESS);
  EXPECT_EQ(mode, NVML_COMPUTEMODE_DEFAULT);
  unsigned gen = 0, multi = 1;
  EXPECT_EQ(nvmlDeviceGetMaxPcieLinkGeneration(h, &gen), NVML_SUCCESS);
  EXPECT_EQ(gen, 5u);
  EXPECT_EQ(nvmlDeviceGetMultiGpuBoard(h, &multi), NVML_SUCCESS);
  EXPECT_EQ(multi, 0u);
  nvmlUtilization_t u{7, 7};
  EXPECT_EQ(nvmlDeviceGetUtilizationRates(h, &u), NVML_SUCCESS);
  EXPECT_EQ(u.gpu + u.memory, 0u);

  unsigned long cpus[4];
  EXPECT_EQ(nvmlDeviceGetCpuAffinity(h, 4, cpus), NVML_ERROR_NOT_SUPPORTED);
  nvmlEnableState_t active;
  unsigned cap;
  EXPECT_EQ(nvmlDeviceGetNvLinkState(h, 0, &active), NVML_ERROR_NOT_SUPPORTED);
  EXPECT_EQ(nvmlDeviceGetNvLinkCapability(h, 0, NVML_NVLINK_CAP_P2P_SUPPORTED, &cap), NVML_ERROR_NOT_SUPPORTED);
  nvmlPciInfoLegacy_t remote;
  EXPECT_EQ(nvmlDeviceGetNvLinkRemotePciInfo(h, 0, &remote), NVML_ERROR_NOT_SUPPORTED);
  nvmlGpuP2PStatus_t p2p = NVML_P2P_STATUS_UNKNOWN;
  EXPECT_EQ(nvmlDeviceGetP2PStatus(h, h, NVML_P2P_CAPS_INDEX_READ, &p2p), NVML_SUCCESS);
  EXPECT_EQ(p2p, NVML_P2P_STATUS_OK);
  EXPECT_EQ(nvmlDeviceGetP2PStatus(h, h, NVML_P2P_CAPS_INDEX_NVLINK, &p2p), NVML_SUCCESS);
  EXPECT_EQ(p2p, NVML_P2P_STATUS_NOT_SUPPORTED);

  nvmlFieldValue_t fv[2] = {};
  fv[0].fieldId = NVML_FI_DEV_NVLINK_LINK_COUNT;
  fv[1].fieldId = NVML_FI_DEV_NVLINK_GET_STATE;
  ASSERT_EQ(nvmlDeviceGetFieldValues(h, 2, fv), NVML_SUCCESS);
  EXPECT_EQ(fv[0].nvmlReturn, NVML_SUCCESS);
  EXPECT_EQ(fv[0].value.uiVal, 0u);
  EXPECT_EQ(fv[1].nvmlReturn, NVML_ERROR_NOT_SUPPORTED);

  nvmlGpuFabricInfoV_t fabric{};
  fabric.version = nvmlGpuFabricInfo_v2;
  EXPECT_EQ(nvmlDeviceGetGpuFabricInfoV(h, &fabric), NVML_ERROR_NOT_SUPPORTED);
  nvmlPlatformInfo_t platform{};
  platform.version = nvmlPlatformInfo_v2;
  EXPECT_EQ(nvmlDeviceGetPlatformInfo(h, &platform), NVML_ERROR_NOT_SUPPORTED);
  nvmlConfComputeSystemState_t cc{9, 9, 9};
  EXPECT_EQ(nvmlSystemGetConfComputeState(&cc), NVML_SUCCESS);
  EXPECT_EQ(cc.ccFeature, static_cast<unsigned>(NVML_CC_SYSTEM_FEATURE_DISABLED));
  nvmlSystemConfComputeSettings_t ccs{};
  EXPECT_EQ(nvmlSystemGetConfComputeSettings(&ccs), NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
  ccs.version = nvmlSystemConfComputeSettings_v1;
  ccs.multiGpuMode = 9;
  EXPECT_EQ(nvmlSystemGetConfComputeSettings(&ccs), NVML_SUCCESS);
  EXPECT_EQ(ccs.multiGpuMode, static_cast<unsigned>(NVML_CC_SYSTEM_MULTIGPU_NONE));
}

// NCCL hands the unversioned nvmlDeviceGetPciInfo a 52-byte struct: nothing past it may change.
TEST_F(Nvml, LegacyPciInfoWritesTheLegacyLayoutOnly) {
  unsigned char buf[sizeof(nvmlPciInfoLegacy_t) + 16];
  std::memset(buf, 0xAB, sizeof buf);
  auto* pci = reinterpret_cast<nvmlPciInfoLegacy_t*>(buf);
  ASSERT_EQ(nvmlDeviceGetPciInfo(handle(0), pci), NVML_SUCCESS);
  for (size_t i = sizeof(nvmlPciInfoLegacy_t); i < sizeof buf; ++i) EXPECT_EQ(buf[i], 0xAB) << i;
  EXPECT_EQ(std::string(pci->busId), "0000:18:00.0");
  EXPECT_EQ(pci->bus, 0x18u);
  EXPECT_EQ(pci->reserved0, 0u);
}

TEST_F(Nvml, MemoryV1AndV2Agree) {
  nvmlDevice_t h = handle(0);
  nvmlMemory_t m1 = memory(h);
  nvmlMemory_v2_t m2{};
  EXPECT_EQ(nvmlDeviceGetMemoryInfo_v2(h, &m2), NVML_ERROR_ARGUMENT_VERSION_MISMATCH);  // version 0
  m2.version = nvmlMemory_v2;
  ASSERT_EQ(nvmlDeviceGetMemoryInfo_v2(h, &m2), NVML_SUCCESS);
  EXPECT_EQ(m1.total, cfg_.memory[0]);
  EXPECT_EQ(m2.total, m1.total);
  EXPECT_EQ(m2.reserved, 0u);
  EXPECT_EQ(m2.used, m1.used);  // nothing else runs on this test's private simulated host
  EXPECT_EQ(m2.free + m2.used, m2.total);
}

TEST_F(Nvml, NoProcessesListsAsEmpty) {
  nvmlDevice_t h = handle(0);
  unsigned n = 0;
  EXPECT_EQ(nvmlDeviceGetComputeRunningProcesses_v3(h, &n, nullptr), NVML_SUCCESS);
  EXPECT_EQ(n, 0u);
  n = 5;
  nvmlProcessInfo_t infos[5];
  EXPECT_EQ(nvmlDeviceGetGraphicsRunningProcesses_v3(h, &n, infos), NVML_SUCCESS);
  EXPECT_EQ(n, 0u);
}

// The detail list (one mode per call) agrees with the compute list; simgpu runs no graphics or
// MPS clients. Same buffer protocol; a wrong version or mode is refused.
TEST_F(Nvml, RunningProcessDetailListAgreesWithTheComputeList) {
  nvmlDevice_t h = handle(0);
  Holder child(0, 96 * kMiB);
  ASSERT_TRUE(child.reserved());
  nvmlProcessDetailList_t list{};
  list.version = nvmlProcessDetailList_v1;
  list.mode = NVML_PROCESS_MODE_COMPUTE;
  ASSERT_EQ(nvmlDeviceGetRunningProcessDetailList(h, &list), NVML_ERROR_INSUFFICIENT_SIZE);
  const unsigned needed = list.numProcArrayEntries;
  ASSERT_GE(needed, 1u);
  std::vector<nvmlProcessDetail_v1_t> entries(needed);
  list.procArray = entries.data();
  ASSERT_EQ(nvmlDeviceGetRunningProcessDetailList(h, &list), NVML_SUCCESS);
  ASSERT_EQ(list.numProcArrayEntries, needed);
  const auto it = std::find_if(entries.begin(), entries.end(),
                               [&](const nvmlProcessDetail_v1_t& e) { return e.pid == static_cast<unsigned>(child.pid()); });
  ASSERT_NE(it, entries.end());
  EXPECT_EQ(it->usedGpuMemory, 96 * kMiB);
  EXPECT_EQ(it->gpuInstanceId, 0xFFFFFFFFu);
  EXPECT_EQ(it->usedGpuCcProtectedMemory, 0u);
  EXPECT_EQ(processes(h).size(), needed);

  list.mode = NVML_PROCESS_MODE_ALL;
  list.numProcArrayEntries = needed;
  EXPECT_EQ(nvmlDeviceGetRunningProcessDetailList(h, &list), NVML_SUCCESS);
  EXPECT_EQ(list.numProcArrayEntries, needed);
  list.mode = NVML_PROCESS_MODE_GRAPHICS;
  EXPECT_EQ(nvmlDeviceGetRunningProcessDetailList(h, &list), NVML_SUCCESS);
  EXPECT_EQ(list.numProcArrayEntries, 0u);
  list.mode = NVML_PROCESS_MODE_MAX;
  EXPECT_EQ(nvmlDeviceGetRunningProcessDetailList(h, &list), NVML_ERROR_INVALID_ARGUMENT);
  list.mode = NVML_PROCESS_MODE_COMPUTE;
  list.version = 1;
  EXPECT_EQ(nvmlDeviceGetRunningProcessDetailList(h, &list), NVML_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(nvmlDeviceGetRunningProcessDetailList(h, nullptr), NVML_ERROR_INVALID_ARGUMENT);
}

TEST_F(Nvml, SeesAnotherProcessAllocateAndDie) {
  nvmlDevice_t h = handle(0);
  const unsigned long long before = memory(h).used;
  Holder child(0, 256 * kMiB);
  ASSERT_TRUE(child.reserved());

  nvmlMemory_t m = memory(h);
  EXPECT_EQ(m.used, before + 256 * kMiB);
  nvmlMemory_v2_t m2{};
  m2.version = nvmlMemory_v2;
  ASSERT_EQ(nvmlDeviceGetMemoryInfo_v2(h, &m2), NVML_SUCCESS);
  EXPECT_EQ(m2.used, m.used);
  EXPECT_EQ(m2.free, m.free);

  auto procs = processes(h);
  const nvmlProcessInfo_t* p = findPid(procs, child.pid());
  ASSERT_NE(p, nullptr) << "child " << child.pid() << " not in the running-process list";
  EXPECT_EQ(p->usedGpuMemory, 256 * kMiB);
  EXPECT_EQ(p->gpuInstanceId, 0xFFFFFFFFu);
  EXPECT_EQ(p->computeInstanceId, 0xFFFFFFFFu);

  // This process allocates too: two entries, and the buffer protocol with a one-entry array.
  static simgpu::SharedState* const st = openState();  // kept, like the driver's own mapping
  ASSERT_NE(st, nullptr);
  ASSERT_TRUE(st->reserve(0, 64 * kMiB));
  unsigned n = 1;
  nvmlProcessInfo_t one[1];
  EXPECT_EQ(nvmlDeviceGetComputeRunningProcesses_v3(h, &n, one), NVML_ERROR_INSUFFICIENT_SIZE);
  EXPECT_EQ(n, static_cast<unsigned>(procs.size() + 1));
  n = 0;
  EXPECT_EQ(nvmlDeviceGetComputeRunningProcesses_v3(h, &n, nullptr), NVML_ERROR_INSUFFICIENT_SIZE);
  EXPECT_EQ(n, static_cast<unsigned>(procs.size() + 1));
  EXPECT_EQ(memory(h).used, before + 320 * kMiB);

  // The legacy and v2 entry points write their own layouts.
  std::vector<nvmlProcessInfo_v1_t> v1(n);
  unsigned n1 = n;
  ASSERT_EQ(nvmlDeviceGetComputeRunningProcesses(h, &n1, v1.data()), NVML_SUCCESS);
  std::vector<nvmlProcessInfo_v2_t> v2(n);
  unsigned n2 = n;
  ASSERT_EQ(nvmlDeviceGetComputeRunningProcesses_v2(h, &n2, v2.data()), NVML_SUCCESS);
  ASSERT_EQ(n1, n);
  ASSERT_EQ(n2, n);
  bool seenSelf = false, seenChild = false;
  for (unsigned i = 0; i < n; ++i) {
    EXPECT_EQ(v1[i].pid, v2[i].pid);
    EXPECT_EQ(v1[i].usedGpuMemory, v2[i].usedGpuMemory);
    seenSelf |= v1[i].pid == static_cast<unsigned>(getpid()) && v1[i].usedGpuMemory == 64 * kMiB;
    seenChild |= v1[i].pid == static_cast<unsigned>(child.pid()) && v1[i].usedGpuMemory == 256 * kMiB;
  }
  EXPECT_TRUE(seenSelf);
  EXPECT_TRUE(seenChild);
  st->release(0, 64 * kMiB);

  const pid_t dead = child.pid();
  child.kill();
  EXPECT_EQ(memory(h).used, before) << "a SIGKILLed process's memory must come back";
  EXPECT_EQ(findPid(processes(h), dead), nullptr);
}

// ---- SIMGPU_DEVICES=2 SIMGPU_MEMORY=1GiB,2GiB ----------------------------------------------

TEST_F(NvmlTwoDevices, DistinctIdentitiesAndSizes) {
  unsigned n = 0;
  ASSERT_EQ(nvmlDeviceGetCount_v2(&n), NVML_SUCCESS);
  ASSERT_EQ(n, 2u);
  nvmlDevice_t a = handle(0), b = handle(1);
  ASSERT_NE(a, b);
  EXPECT_EQ(memory(a).total, 1024 * kMiB);
  EXPECT_EQ(memory(b).total, 2048 * kMiB);
  char ua[NVML_DEVICE_UUID_BUFFER_SIZE], ub[NVML_DEVICE_UUID_BUFFER_SIZE];
  ASSERT_EQ(nvmlDeviceGetUUID(a, ua, sizeof ua), NVML_SUCCESS);
  ASSERT_EQ(nvmlDeviceGetUUID(b, ub, sizeof ub), NVML_SUCCESS);
  EXPECT_STRNE(ua, ub);
  nvmlDevice_t byUuid = nullptr, byPci = nullptr;
  ASSERT_EQ(nvmlDeviceGetHandleByUUID(ub, &byUuid), NVML_SUCCESS);
  EXPECT_EQ(byUuid, b);
  nvmlPciInfo_t pa{}, pb{};
  ASSERT_EQ(nvmlDeviceGetPciInfo_v3(a, &pa), NVML_SUCCESS);
  ASSERT_EQ(nvmlDeviceGetPciInfo_v3(b, &pb), NVML_SUCCESS);
  EXPECT_STREQ(pa.busId, "00000000:18:00.0");
  EXPECT_STREQ(pb.busId, "00000000:19:00.0");
  ASSERT_EQ(nvmlDeviceGetHandleByPciBusId_v2("0000:19:00.0", &byPci), NVML_SUCCESS);
  EXPECT_EQ(byPci, b);
  unsigned ba = 0, bb = 0;
  EXPECT_EQ(nvmlDeviceGetBoardId(a, &ba), NVML_SUCCESS);
  EXPECT_EQ(nvmlDeviceGetBoardId(b, &bb), NVML_SUCCESS);
  EXPECT_NE(ba, bb);
}

TEST_F(NvmlTwoDevices, PeersOverPcieOnly) {
  nvmlDevice_t a = handle(0), b = handle(1);
  for (auto idx : {NVML_P2P_CAPS_INDEX_READ, NVML_P2P_CAPS_INDEX_WRITE, NVML_P2P_CAPS_INDEX_ATOMICS}) {
    nvmlGpuP2PStatus_t s = NVML_P2P_STATUS_UNKNOWN;
    EXPECT_EQ(nvmlDeviceGetP2PStatus(a, b, idx, &s), NVML_SUCCESS);
    EXPECT_EQ(s, NVML_P2P_STATUS_OK) << idx;
  }
  nvmlGpuP2PStatus_t s = NVML_P2P_STATUS_OK;
  EXPECT_EQ(nvmlDeviceGetP2PStatus(a, b, NVML_P2P_CAPS_INDEX_NVLINK, &s), NVML_SUCCESS);
  EXPECT_EQ(s, NVML_P2P_STATUS_NOT_SUPPORTED);
  nvmlGpuTopologyLevel_t level;
  EXPECT_EQ(nvmlDeviceGetTopologyCommonAncestor(a, b, &level), NVML_SUCCESS);
  EXPECT_EQ(level, NVML_TOPOLOGY_HOSTBRIDGE);
  EXPECT_EQ(nvmlDeviceGetTopologyCommonAncestor(a, a, &level), NVML_SUCCESS);
  EXPECT_EQ(level, NVML_TOPOLOGY_INTERNAL);
}

TEST_F(NvmlTwoDevices, AllocationShowsOnItsDeviceOnly) {
  nvmlDevice_t a = handle(0), b = handle(1);
  const unsigned long long usedA = memory(a).used, usedB = memory(b).used;
  Holder child(1, 512 * kMiB);
  ASSERT_TRUE(child.reserved());
  EXPECT_EQ(memory(a).used, usedA);
  EXPECT_EQ(memory(b).used, usedB + 512 * kMiB);
  EXPECT_EQ(findPid(processes(a), child.pid()), nullptr);
  const nvmlProcessInfo_t* p = nullptr;
  auto procsB = processes(b);
  p = findPid(procsB, child.pid());
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(p->usedGpuMemory, 512 * kMiB);
  child.kill();
  EXPECT_EQ(memory(b).used, usedB);
}

// ---- an invalid SIMGPU_* environment (SIMGPU_DEVICES=0) --------------------------------------

TEST(NvmlBadEnv, InitFailsAndSaysWhyOnce) {
  simgpu::Config cfg;
  std::string err;
  if (simgpu::loadConfig(&cfg, &err)) GTEST_SKIP() << "runs with an invalid SIMGPU_* environment only";
  testing::internal::CaptureStderr();
  EXPECT_EQ(nvmlInit_v2(), NVML_ERROR_UNKNOWN);
  EXPECT_EQ(nvmlInit(), NVML_ERROR_UNKNOWN);
  EXPECT_EQ(nvmlInitWithFlags(0), NVML_ERROR_UNKNOWN);
  const std::string out = testing::internal::GetCapturedStderr();
  EXPECT_EQ(out, err + "\n") << "the error line, printed once";
  unsigned n;
  EXPECT_EQ(nvmlDeviceGetCount_v2(&n), NVML_ERROR_UNINITIALIZED);
  EXPECT_EQ(nvmlShutdown(), NVML_ERROR_UNINITIALIZED);
}

}  // namespace
