// Device enumeration and properties through the CUDA runtime API.
//
// On simgpu the expected values come from the same environment the driver reads: SIMGPU_DEVICES
// (default 1), SIMGPU_SMS (default 132), SIMGPU_MEMORY (default 16GiB), SIMGPU_NAME (default name
// contains "simgpu"). CMakeLists.txt runs this program twice: with the defaults and with
// SIMGPU_SMS=66 SIMGPU_MEMORY=4GiB SIMGPU_NAME=TestGPU.
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "cuda_check.h"

using namespace simtest;

namespace {

std::string uuidHex(const cudaUUID_t& u) {
  std::string s;
  char b[3];
  for (int i = 0; i < 16; ++i) {
    std::snprintf(b, sizeof b, "%02x", static_cast<unsigned char>(u.bytes[i]));
    s += b;
  }
  return s;
}

}  // namespace

TEST(DeviceQuery, DeviceCount) {
  int n = -1;
  CUDA_ASSERT(cudaGetDeviceCount(&n));
  ASSERT_GE(n, 1);
  if (onSimgpu()) EXPECT_EQ(expectedSimgpuDevices(), n);
  int dev = -1;
  CUDA_ASSERT(cudaGetDevice(&dev));
  EXPECT_EQ(0, dev);  // a fresh thread starts on device 0
}

TEST(DeviceQuery, Properties) {
  cudaDeviceProp p;
  std::memset(&p, 0xab, sizeof p);
  CUDA_ASSERT(cudaGetDeviceProperties(&p, 0));
  // The name is NUL-terminated and non-empty.
  ASSERT_NE(nullptr, std::memchr(p.name, '\0', sizeof p.name));
  EXPECT_GT(std::strlen(p.name), 0u);
  // Architectural constants every CUDA device since Kepler reports.
  EXPECT_EQ(32, p.warpSize);
  EXPECT_EQ(1024, p.maxThreadsPerBlock);
  EXPECT_EQ(1024, p.maxThreadsDim[0]);
  EXPECT_EQ(1024, p.maxThreadsDim[1]);
  EXPECT_EQ(64, p.maxThreadsDim[2]);
  EXPECT_EQ(2147483647, p.maxGridSize[0]);
  EXPECT_EQ(65535, p.maxGridSize[1]);
  EXPECT_EQ(65535, p.maxGridSize[2]);
  EXPECT_EQ(48 * KiB, p.sharedMemPerBlock);
  EXPECT_GE(p.sharedMemPerBlockOptin, p.sharedMemPerBlock);
  EXPECT_EQ(65536, p.regsPerBlock);
  EXPECT_EQ(64 * KiB, p.totalConstMem);
  EXPECT_EQ(1, p.unifiedAddressing);
  EXPECT_EQ(1, p.managedMemory);
  EXPECT_EQ(1, p.canMapHostMemory);
  EXPECT_GT(p.multiProcessorCount, 0);
  EXPECT_GT(p.maxThreadsPerMultiProcessor, 0);
  EXPECT_GT(p.totalGlobalMem, 0u);
  EXPECT_GE(p.major, 3);
  if (onSimgpu()) {
    EXPECT_EQ(9, p.major);
    EXPECT_EQ(0, p.minor);
    EXPECT_EQ(expectedSimgpuSms(), p.multiProcessorCount);
    EXPECT_EQ(expectedSimgpuMemory(0), p.totalGlobalMem);
    if (const char* name = std::getenv("SIMGPU_NAME"))
      EXPECT_STREQ(name, p.name);
    else
      EXPECT_NE(nullptr, std::strstr(p.name, "simgpu")) << p.name;
    EXPECT_EQ(1, p.cooperativeLaunch);
    EXPECT_EQ(1, p.memoryPoolsSupported);
    EXPECT_EQ(1, p.streamPrioritiesSupported);
  }
}

TEST(DeviceQuery, PropertiesOfBadOrdinal) {
  const int n = deviceCount();
  cudaDeviceProp p{};
  CUDA_EXPECT_ERR(cudaErrorInvalidDevice, cudaGetDeviceProperties(&p, n));
  CUDA_EXPECT_ERR(cudaErrorInvalidDevice, cudaGetDeviceProperties(&p, -1));
}

TEST(DeviceQuery, AttributesMatchProperties) {
  cudaDeviceProp p{};
  CUDA_ASSERT(cudaGetDeviceProperties(&p, 0));
  struct {
    cudaDeviceAttr attr;
    long long expected;
    const char* what;
  } const cases[] = {
      {cudaDevAttrMultiProcessorCount, p.multiProcessorCount, "multiProcessorCount"},
      {cudaDevAttrComputeCapabilityMajor, p.major, "major"},
      {cudaDevAttrComputeCapabilityMinor, p.minor, "minor"},
      {cudaDevAttrWarpSize, p.warpSize, "warpSize"},
      {cudaDevAttrMaxThreadsPerBlock, p.maxThreadsPerBlock, "maxThreadsPerBlock"},
      {cudaDevAttrMaxBlockDimX, p.maxThreadsDim[0], "maxThreadsDim[0]"},
      {cudaDevAttrMaxBlockDimZ, p.maxThreadsDim[2], "maxThreadsDim[2]"},
      {cudaDevAttrMaxGridDimX, p.maxGridSize[0], "maxGridSize[0]"},
      {cudaDevAttrMaxSharedMemoryPerBlock, static_cast<long long>(p.sharedMemPerBlock), "sharedMemPerBlock"},
      {cudaDevAttrMaxThreadsPerMultiProcessor, p.maxThreadsPerMultiProcessor, "maxThreadsPerMultiProcessor"},
      {cudaDevAttrPciBusId, p.pciBusID, "pciBusID"},
      {cudaDevAttrPciDeviceId, p.pciDeviceID, "pciDeviceID"},
      {cudaDevAttrPciDomainId, p.pciDomainID, "pciDomainID"},
      {cudaDevAttrUnifiedAddressing, p.unifiedAddressing, "unifiedAddressing"},
      {cudaDevAttrManagedMemory, p.managedMemory, "managedMemory"},
      {cudaDevAttrConcurrentManagedAccess, p.concurrentManagedAccess, "concurrentManagedAccess"},
      {cudaDevAttrCooperativeLaunch, p.cooperativeLaunch, "cooperativeLaunch"},
      {cudaDevAttrMemoryPoolsSupported, p.memoryPoolsSupported, "memoryPoolsSupported"},
      {cudaDevAttrL2CacheSize, p.l2CacheSize, "l2CacheSize"},
      {cudaDevAttrGlobalMemoryBusWidth, p.memoryBusWidth, "memoryBusWidth"},
      {cudaDevAttrAsyncEngineCount, p.asyncEngineCount, "asyncEngineCount"},
  };
  for (const auto& c : cases) {
    int v = -12345;
    CUDA_EXPECT(cudaDeviceGetAttribute(&v, c.attr, 0));
    EXPECT_EQ(c.expected, v) << c.what << " (attribute " << static_cast<int>(c.attr) << ")";
  }
  if (onSimgpu()) {
    int sms = 0;
    CUDA_EXPECT(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    EXPECT_EQ(expectedSimgpuSms(), sms);
  }
}

TEST(DeviceQuery, AttributeErrors) {
  int v = 0;
  CUDA_EXPECT_ERR(cudaErrorInvalidDevice, cudaDeviceGetAttribute(&v, cudaDevAttrWarpSize, deviceCount()));
  CUDA_EXPECT_ERR(cudaErrorInvalidValue, cudaDeviceGetAttribute(&v, static_cast<cudaDeviceAttr>(100000), 0));
  EXPECT_EQ(cudaSuccess, cudaGetLastError());
}

TEST(DeviceQuery, DriverAndRuntimeVersion) {
  int driver = 0, runtime = 0;
  CUDA_ASSERT(cudaDriverGetVersion(&driver));
  CUDA_ASSERT(cudaRuntimeGetVersion(&runtime));
  EXPECT_GE(driver, 13000);
  EXPECT_EQ(CUDART_VERSION, runtime);
  EXPECT_GE(driver, runtime);  // cudart refuses to run on an older driver
}

TEST(DeviceQuery, MemGetInfo) {
  size_t freeBytes = 0, totalBytes = 0;
  CUDA_ASSERT(cudaMemGetInfo(&freeBytes, &totalBytes));
  cudaDeviceProp p{};
  CUDA_ASSERT(cudaGetDeviceProperties(&p, 0));
  EXPECT_GT(freeBytes, 0u);
  EXPECT_LE(freeBytes, totalBytes);
  EXPECT_EQ(p.totalGlobalMem, totalBytes);
  if (onSimgpu()) EXPECT_EQ(expectedSimgpuMemory(0), totalBytes);
}

TEST(DeviceQuery, UuidStableWithinProcess) {
  cudaDeviceProp a{}, b{};
  CUDA_ASSERT(cudaGetDeviceProperties(&a, 0));
  CUDA_ASSERT(cudaGetDeviceProperties(&b, 0));
  EXPECT_EQ(0, std::memcmp(&a.uuid, &b.uuid, sizeof a.uuid));
  const cudaUUID_t zero{};
  EXPECT_NE(0, std::memcmp(&a.uuid, &zero, sizeof zero)) << "all-zero UUID";
}

// Helper for UuidStableAcrossProcesses: runs only in the child that test starts.
TEST(DeviceQuery, WriteUuidForParent) {
  const char* out = std::getenv("SIMGPU_TEST_UUID_OUT");
  if (!out) GTEST_SKIP() << "runs only as the child of UuidStableAcrossProcesses";
  cudaDeviceProp p{};
  CUDA_ASSERT(cudaGetDeviceProperties(&p, 0));
  std::ofstream(out) << uuidHex(p.uuid) << "\n";
}

TEST(DeviceQuery, UuidStableAcrossProcesses) {
  if (std::getenv("SIMGPU_TEST_UUID_OUT")) GTEST_SKIP() << "child";
  cudaDeviceProp p{};
  CUDA_ASSERT(cudaGetDeviceProperties(&p, 0));
  const std::string mine = uuidHex(p.uuid);

  char path[] = "/tmp/simgpu_uuid_XXXXXX";
  const int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  close(fd);
  std::vector<std::string> envStore;
  for (char** e = environ; e && *e; ++e) envStore.emplace_back(*e);
  envStore.push_back(std::string("SIMGPU_TEST_UUID_OUT=") + path);
  std::vector<char*> envp;
  for (auto& s : envStore) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::string exe = "/proc/self/exe", filter = "--gtest_filter=DeviceQuery.WriteUuidForParent";
  char* argv[] = {exe.data(), filter.data(), nullptr};
  pid_t pid = -1;
  ASSERT_EQ(0, posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv, envp.data()));
  int status = 0;
  ASSERT_EQ(pid, waitpid(pid, &status, 0));
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  std::ifstream in(path);
  std::string theirs;
  in >> theirs;
  unlink(path);
  EXPECT_EQ(mine, theirs);
}

TEST(DeviceQuery, PciBusId) {
  char busId[64];
  std::memset(busId, 0, sizeof busId);
  CUDA_ASSERT(cudaDeviceGetPCIBusId(busId, sizeof busId, 0));
  unsigned domain = 0, bus = 0, device = 0, function = 99;
  ASSERT_EQ(4, std::sscanf(busId, "%x:%x:%x.%x", &domain, &bus, &device, &function)) << busId;
  int attrDomain = -1, attrBus = -1, attrDevice = -1;
  CUDA_ASSERT(cudaDeviceGetAttribute(&attrDomain, cudaDevAttrPciDomainId, 0));
  CUDA_ASSERT(cudaDeviceGetAttribute(&attrBus, cudaDevAttrPciBusId, 0));
  CUDA_ASSERT(cudaDeviceGetAttribute(&attrDevice, cudaDevAttrPciDeviceId, 0));
  EXPECT_EQ(static_cast<unsigned>(attrDomain), domain) << busId;
  EXPECT_EQ(static_cast<unsigned>(attrBus), bus) << busId;
  EXPECT_EQ(static_cast<unsigned>(attrDevice), device) << busId;
  EXPECT_EQ(0u, function);
  if (onSimgpu()) EXPECT_EQ(0x18u, bus) << busId;  // simgpu puts device N at bus 0x18+N
  int back = -1;
  CUDA_ASSERT(cudaDeviceGetByPCIBusId(&back, busId));
  EXPECT_EQ(0, back);
}

TEST(DeviceQuery, SetDevice) {
  const int n = deviceCount();
  ASSERT_GE(n, 1);
  CUDA_ASSERT(cudaSetDevice(0));
  CUDA_EXPECT_ERR(cudaErrorInvalidDevice, cudaSetDevice(n));
  CUDA_EXPECT_ERR(cudaErrorInvalidDevice, cudaSetDevice(-1));
  CUDA_EXPECT_ERR(cudaErrorInvalidDevice, cudaSetDevice(1 << 20));
  int dev = -1;
  CUDA_ASSERT(cudaGetDevice(&dev));
  EXPECT_EQ(0, dev);  // a failed cudaSetDevice leaves the current device alone
  EXPECT_EQ(cudaSuccess, cudaGetLastError());
  // The device is usable after the failed calls.
  void* p = nullptr;
  CUDA_ASSERT(cudaMalloc(&p, 4096));
  CUDA_ASSERT(cudaFree(p));
}

TEST(DeviceQuery, Limits) {
  size_t v = 0;
  CUDA_ASSERT(cudaDeviceGetLimit(&v, cudaLimitStackSize));
  EXPECT_GT(v, 0u);
  CUDA_ASSERT(cudaDeviceSetLimit(cudaLimitMallocHeapSize, 16 * MiB));
  CUDA_ASSERT(cudaDeviceGetLimit(&v, cudaLimitMallocHeapSize));
  EXPECT_GE(v, 16 * MiB);
  CUDA_ASSERT(cudaDeviceSetLimit(cudaLimitPrintfFifoSize, 2 * MiB));
  CUDA_ASSERT(cudaDeviceGetLimit(&v, cudaLimitPrintfFifoSize));
  EXPECT_GE(v, 2 * MiB);
}

TEST(DeviceQuery, SynchronizeIdleDevice) {
  CUDA_ASSERT(cudaDeviceSynchronize());
  CUDA_ASSERT(cudaFree(nullptr));  // the classic "initialise the context" idiom
  EXPECT_EQ(cudaSuccess, cudaGetLastError());
}
