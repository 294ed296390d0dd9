// Device visibility: CUDA_VISIBLE_DEVICES (the real driver's rules, docs/simgpu.md "Device
// visibility") and SIMGPU_CONTAINER_DEVICES (a container's device nodes).
//
// - VisibleRules.*, ContainerConfig.*: the parsing rules, on simgpu::visibleDevices and
//   simgpu::loadConfig directly (any environment; ContainerConfig sets its own variables).
// - VisibleProcess.*: one process under the environment CMake gives it, on a host of two devices
//   of different sizes (SIMGPU_DEVICES=2 SIMGPU_MEMORY=1GiB,2GiB). EXPECT_HOSTS lists the host
//   devices the driver must show, in order ("" for none: cuInit gives CUDA_ERROR_NO_DEVICE);
//   EXPECT_NVML_HOSTS those NVML must show. Each ordinal's size, UUID and PCI bus must be its host
//   device's, and memory allocated on it must be counted on that host device in simgpu's state.
#include <cuda.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "config.h"
#include "cu_check.h"
#include "device_used.h"
#include "simgpu/nvml.h"

namespace {

using simgpu::Config;
using simgpu::deviceUuidString;

std::vector<int> visible(const Config& c, const char* value) {
  int out[simgpu::kMaxDevices];
  const int n = simgpu::visibleDevices(c, value, out);
  return std::vector<int>(out, out + n);
}

Config host(int devices) {
  Config c;
  c.deviceCount = devices;
  c.containerCount = devices;
  for (int d = 0; d < devices; ++d) c.container[d] = d;
  return c;
}

using V = std::vector<int>;

TEST(VisibleRules, UnsetShowsEveryDeviceInHostOrder) { EXPECT_EQ((V{0, 1, 2}), visible(host(3), nullptr)); }

TEST(VisibleRules, IndicesSelectAndReorder) {
  const Config c = host(3);
  EXPECT_EQ((V{1}), visible(c, "1"));
  EXPECT_EQ((V{2, 0}), visible(c, "2,0"));
  EXPECT_EQ((V{1, 0, 2}), visible(c, "1,0,2"));
}

TEST(VisibleRules, EmptyValueShowsNoDevice) {
  EXPECT_EQ(V{}, visible(host(3), ""));
  EXPECT_EQ(V{}, visible(host(3), ","));
}

TEST(VisibleRules, ListEndsAtFirstInvalidEntry) {
  const Config c = host(3);
  EXPECT_EQ((V{0, 2}), visible(c, "0,2,-1,1"));  // the CUDA Programming Guide's own example
  EXPECT_EQ((V{0}), visible(c, "0,3,1"));        // not found
  EXPECT_EQ((V{0}), visible(c, "0,,1"));         // empty entry
  EXPECT_EQ((V{0}), visible(c, "0,x,1"));
  EXPECT_EQ(V{}, visible(c, "7"));
  EXPECT_EQ(V{}, visible(c, "99999999999999999999999"));
  EXPECT_EQ((V{1}), visible(c, "1,MIG-GPU-5e1a90c0/1/0"));  // no MIG on simgpu
}

TEST(VisibleRules, IndexIsReadLikeStrtoul) {
  const Config c = host(3);
  EXPECT_EQ((V{1, 2}), visible(c, "1gpu,2ampere"));
  EXPECT_EQ((V{1, 2}), visible(c, " 1, +2"));
  EXPECT_EQ((V{2}), visible(c, "02"));
}

TEST(VisibleRules, RepeatedDeviceShowsNoDevice) {
  const Config c = host(3);
  EXPECT_EQ(V{}, visible(c, "0,0"));
  EXPECT_EQ(V{}, visible(c, "1,0,1"));
  EXPECT_EQ(V{}, visible(c, "1,01"));
  const std::string u = deviceUuidString(2);
  EXPECT_EQ(V{}, visible(c, (u + "," + u).c_str()));
}

TEST(VisibleRules, UuidsFullAndUniquePrefixes) {
  const Config c = host(3);
  const std::string u0 = deviceUuidString(0), u2 = deviceUuidString(2);
  EXPECT_EQ((V{2, 0}), visible(c, (u2 + "," + u0).c_str()));
  // simgpu's UUIDs differ only in their last digits: a prefix is unique only that far in.
  EXPECT_EQ(V{}, visible(c, u2.substr(0, u2.size() - 1).c_str()));  // ambiguous: all three match
  EXPECT_EQ(V{}, visible(c, u2.substr(0, 12).c_str()));
  EXPECT_EQ((V{2}), visible(c, u2.c_str()));
  EXPECT_EQ((V{0}), visible(host(1), "GPU-5e1a"));        // unique on a one-device host
  EXPECT_EQ(V{}, visible(c, "GPU-ffffffff"));             // no such device
  EXPECT_EQ((V{2}), visible(c, (u2 + ",GPU-ffffffff," + u0).c_str()));
}

TEST(VisibleRules, UuidHexIsCaseSensitiveAndNeedsGpuPrefix) {
  const Config c = host(2);
  std::string upper = deviceUuidString(1);
  for (size_t i = 4; i < upper.size(); ++i) upper[i] = static_cast<char>(std::toupper(upper[i]));
  EXPECT_EQ(V{}, visible(c, upper.c_str()));
  EXPECT_EQ(V{}, visible(c, deviceUuidString(1).substr(4).c_str()));  // without "GPU-"
}

TEST(VisibleRules, FirstEntryDecidesIndicesOrUuids) {
  const Config c = host(3);
  EXPECT_EQ((V{1}), visible(c, ("1," + deviceUuidString(2)).c_str()));
  EXPECT_EQ((V{2}), visible(c, (deviceUuidString(2) + ",1").c_str()));
}

TEST(VisibleRules, IndicesCountWithinTheContainer) {
  Config c = host(4);
  c.containerCount = 2;
  c.container[0] = 1;
  c.container[1] = 3;
  EXPECT_EQ((V{1, 3}), visible(c, nullptr));
  EXPECT_EQ((V{3}), visible(c, "1"));
  EXPECT_EQ(V{}, visible(c, "2"));                               // the host's index 2 is not there
  EXPECT_EQ(V{}, visible(c, deviceUuidString(0).c_str()));      // nor is host device 0
  EXPECT_EQ((V{3, 1}), visible(c, (deviceUuidString(3) + "," + deviceUuidString(1)).c_str()));
}

// ---- SIMGPU_CONTAINER_DEVICES ----
struct EnvGuard {
  EnvGuard(const char* devices, const char* container) {
    setenv("SIMGPU_DEVICES", devices, 1);
    if (container) setenv("SIMGPU_CONTAINER_DEVICES", container, 1);
    else unsetenv("SIMGPU_CONTAINER_DEVICES");
    unsetenv("SIMGPU_MEMORY");
  }
  ~EnvGuard() {
    unsetenv("SIMGPU_DEVICES");
    unsetenv("SIMGPU_CONTAINER_DEVICES");
  }
};

std::vector<int> container(const char* value, std::string* err) {
  EnvGuard g("4", value);
  Config c;
  if (!simgpu::loadConfig(&c, err)) return {-1};
  return std::vector<int>(c.container, c.container + c.containerCount);
}

TEST(ContainerConfig, IndicesAndUuidsInHostOrder) {
  std::string err;
  EXPECT_EQ((V{0, 1, 2, 3}), container(nullptr, &err));
  EXPECT_EQ((V{1, 3}), container("3,1", &err)) << err;
  std::string upper = deviceUuidString(2);
  for (char& ch : upper) ch = static_cast<char>(std::toupper(ch));
  EXPECT_EQ((V{0, 2}), container((upper + ", 0").c_str(), &err)) << err;
  EXPECT_EQ(V{}, container("", &err)) << err;
}

TEST(ContainerConfig, BadListsAreRefusedNamingTheVariable) {
  for (const char* bad : {"4", "-1", "1,1", "0,", "one", "GPU-5e1a90c0", "GPU-00000000-0000-0000-0000-000000000000"}) {
    std::string err;
    EXPECT_EQ((V{-1}), container(bad, &err)) << bad;
    EXPECT_NE(std::string::npos, err.find("SIMGPU_CONTAINER_DEVICES")) << err;
    EXPECT_EQ(std::string::npos, err.find('\n')) << err;
  }
}

// ---- one process under CMake's environment ----
std::vector<int> hostsFrom(const char* var) {
  const char* v = std::getenv(var);
  std::vector<int> out;
  for (const char* p = v; p && *p;) {
    out.push_back(std::atoi(p));
    p = std::strchr(p, ',');
    if (p) ++p;
  }
  return out;
}

TEST(VisibleProcess, DriverShowsExactlyTheExpectedHostDevices) {
  ASSERT_NE(nullptr, std::getenv("EXPECT_HOSTS"));
  const std::vector<int> hosts = hostsFrom("EXPECT_HOSTS");
  const uint64_t kSize[2] = {1ull << 30, 2ull << 30};
  if (hosts.empty()) {
    CU_EXPECT_ERR(CUDA_ERROR_NO_DEVICE, cuInit(0));
    int n = -1;
    EXPECT_NE(CUDA_SUCCESS, cuDeviceGetCount(&n));
    return;
  }
  CU_ASSERT(cuInit(0));
  int n = -1;
  CU_ASSERT(cuDeviceGetCount(&n));
  ASSERT_EQ(static_cast<int>(hosts.size()), n);
  CUdevice bad;
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_DEVICE, cuDeviceGet(&bad, n));
  for (int i = 0; i < n; ++i) {
    SCOPED_TRACE("ordinal " + std::to_string(i) + " = host device " + std::to_string(hosts[i]));
    CUdevice dev;
    CU_ASSERT(cuDeviceGet(&dev, i));
    size_t total = 0;
    CU_ASSERT(cuDeviceTotalMem(&total, dev));
    EXPECT_EQ(kSize[hosts[i]], total);
    CUuuid u;
    CU_ASSERT(cuDeviceGetUuid(&u, dev));
    unsigned char want[16];
    simgpu::deviceUuid(hosts[i], want);
    EXPECT_EQ(0, std::memcmp(want, u.bytes, 16));
    int bus = -1;
    CU_ASSERT(cuDeviceGetAttribute(&bus, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, dev));
    EXPECT_EQ(static_cast<int>(simgpu::devicePciBus(hosts[i])), bus);
    char busId[32];
    CU_ASSERT(cuDeviceGetPCIBusId(busId, sizeof busId, dev));
    CUdevice back = -1;
    CU_ASSERT(cuDeviceGetByPCIBusId(&back, busId));
    EXPECT_EQ(dev, back);

    // Memory on this ordinal is counted on its host device, and cuMemGetInfo shows that device.
    CUcontext ctx;
    CU_ASSERT(cuDevicePrimaryCtxRetain(&ctx, dev));
    CU_ASSERT(cuCtxSetCurrent(ctx));
    const uint64_t before[2] = {cushare::test::deviceUsed(0), cushare::test::deviceUsed(1)};
    CUdeviceptr p;
    CU_ASSERT(cuMemAlloc(&p, 64 << 20));
    EXPECT_EQ(before[hosts[i]] + (64 << 20), cushare::test::deviceUsed(hosts[i]));
    EXPECT_EQ(before[1 - hosts[i]], cushare::test::deviceUsed(1 - hosts[i]));
    size_t free = 0;
    CU_ASSERT(cuMemGetInfo(&free, &total));
    EXPECT_EQ(kSize[hosts[i]], total);
    EXPECT_EQ(kSize[hosts[i]] - cushare::test::deviceUsed(hosts[i]), free);
    CU_ASSERT(cuMemFree(p));
    CU_ASSERT(cuDevicePrimaryCtxRelease(dev));
  }
}

TEST(VisibleProcess, NvmlShowsTheContainerAndIgnoresCudaVisibleDevices) {
  ASSERT_NE(nullptr, std::getenv("EXPECT_NVML_HOSTS"));
  const std::vector<int> hosts = hostsFrom("EXPECT_NVML_HOSTS");
  ASSERT_EQ(NVML_SUCCESS, nvmlInit_v2());
  unsigned n = 0;
  ASSERT_EQ(NVML_SUCCESS, nvmlDeviceGetCount_v2(&n));
  ASSERT_EQ(hosts.size(), n);
  for (unsigned i = 0; i < n; ++i) {
    nvmlDevice_t d;
    ASSERT_EQ(NVML_SUCCESS, nvmlDeviceGetHandleByIndex_v2(i, &d));
    char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    ASSERT_EQ(NVML_SUCCESS, nvmlDeviceGetUUID(d, uuid, sizeof uuid));
    EXPECT_EQ(deviceUuidString(hosts[i]), uuid);
    unsigned index = 99, minor = 99;
    ASSERT_EQ(NVML_SUCCESS, nvmlDeviceGetIndex(d, &index));
    EXPECT_EQ(i, index);
    ASSERT_EQ(NVML_SUCCESS, nvmlDeviceGetMinorNumber(d, &minor));
    EXPECT_EQ(static_cast<unsigned>(hosts[i]), minor);  // /dev/nvidiaN keeps its host number
    nvmlMemory_t m;
    ASSERT_EQ(NVML_SUCCESS, nvmlDeviceGetMemoryInfo(d, &m));
    EXPECT_EQ((hosts[i] + 1ull) << 30, m.total);
  }
  nvmlDevice_t none;
  EXPECT_EQ(NVML_ERROR_INVALID_ARGUMENT, nvmlDeviceGetHandleByIndex_v2(n, &none));
  EXPECT_EQ(NVML_SUCCESS, nvmlShutdown());
}

}  // namespace
