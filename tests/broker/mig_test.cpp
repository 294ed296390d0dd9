// cushare-broker on a GPU in MIG mode (docs/mig.md), on simgpu's H100 (SIMGPU_GPU_MODEL=h100-80gb):
// GPU 0 holds a 3g.40gb GPU instance split into a 2c and a 1c compute instance (MIG devices 0:0
// and 0:1, sharing the instance's 40448 MiB) and a 1g.10gb (0:2). The broker lists the MIG devices
// instead of the GPU, tenants are placed in them by <gpu>:<mig> or MIG-<uuid>, admission sums the
// limits per GPU instance, each tenant is held to its limit by the device's own count (simgpu's NVML
// per MIG device), memory outside cushare is attributed to the compute instance that holds it, and
// metrics and the CLI name each MIG device with its profile.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <vector>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "harness.h"
#include "simgpu/nvml.h"

namespace cushare::test {
namespace {

std::string readAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

class Mig : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(nvmlInit_v2(), NVML_SUCCESS);
    ASSERT_EQ(nvmlDeviceGetHandleByIndex_v2(0, &gpu), NVML_SUCCESS);
    nvmlReturn_t act;
    ASSERT_EQ(nvmlDeviceSetMigMode(gpu, NVML_DEVICE_MIG_ENABLE, &act), NVML_SUCCESS);
    ASSERT_EQ(nvmlDeviceCreateGpuInstance(gpu, 9, &g3), NVML_SUCCESS);   // 3g.40gb
    ASSERT_EQ(nvmlDeviceCreateGpuInstance(gpu, 19, &g1), NVML_SUCCESS);  // 1g.10gb
    // The 2c first: its only placement is the instance's first two slices, which a 1c made first
    // could take (as on the real driver).
    ASSERT_EQ(nvmlGpuInstanceCreateComputeInstance(g3, NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE, &c3a), NVML_SUCCESS);
    ASSERT_EQ(nvmlGpuInstanceCreateComputeInstance(g3, NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, &c3b), NVML_SUCCESS);
    ASSERT_EQ(nvmlGpuInstanceCreateComputeInstance(g1, NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, &c1), NVML_SUCCESS);
    for (unsigned i = 0; i < 3; ++i) {
      ASSERT_EQ(nvmlDeviceGetMigDeviceHandleByIndex(gpu, i, &mig[i]), NVML_SUCCESS) << i;
      char u[96];
      ASSERT_EQ(nvmlDeviceGetUUID(mig[i], u, sizeof u), NVML_SUCCESS);
      uuid[i] = u;
    }
    char u[96];
    ASSERT_EQ(nvmlDeviceGetUUID(gpu, u, sizeof u), NVML_SUCCESS);
    gpuUuid = u;
  }
  void TearDown() override {  // the next test starts from MIG off (the state is the host's)
    for (nvmlComputeInstance_t c : {c3a, c3b, c1})
      if (c) nvmlComputeInstanceDestroy(c);
    for (nvmlGpuInstance_t g : {g3, g1})
      if (g) nvmlGpuInstanceDestroy(g);
    nvmlReturn_t act;
    EXPECT_EQ(nvmlDeviceSetMigMode(gpu, NVML_DEVICE_MIG_DISABLE, &act), NVML_SUCCESS);
    nvmlShutdown();
  }

  // Bytes pid holds in MIG device i, as the device counts them (0: not listed).
  uint64_t heldIn(unsigned i, pid_t pid) {
    nvmlProcessInfo_t p[16];
    unsigned n = 16;
    if (nvmlDeviceGetComputeRunningProcesses_v3(mig[i], &n, p) != NVML_SUCCESS) return UINT64_MAX;
    for (unsigned k = 0; k < n; ++k)
      if (p[k].pid == static_cast<unsigned>(pid)) return p[k].usedGpuMemory;
    return 0;
  }
  uint64_t instanceUsed(unsigned i) {
    nvmlMemory_t m{};
    return nvmlDeviceGetMemoryInfo(mig[i], &m) == NVML_SUCCESS ? m.used : UINT64_MAX;
  }

  nvmlDevice_t gpu = nullptr, mig[3] = {};
  nvmlGpuInstance_t g3 = nullptr, g1 = nullptr;
  nvmlComputeInstance_t c3a = nullptr, c3b = nullptr, c1 = nullptr;
  std::string uuid[3], gpuUuid;
};

// The limits of the two compute instances of the 3g are admitted against its 40448 MiB together;
// the GPU itself cannot be given a limit while it is in MIG mode.
// A directory of its own for each of a test's brokers, in the test's (testDir() empties it).
std::string brokerDir(const std::string& base, const std::string& name) {
  const std::string d = base + "/" + name;
  std::filesystem::create_directories(d);
  return d;
}

TEST_F(Mig, AdmissionSumsEachGpuInstanceAndRefusesTheGpu) {
  const std::string dir = testDir();
  Broker over(brokerDir(dir, "over"));
  EXPECT_FALSE(over.start("tenants:\n  - {name: a, memory: {'0:0': 20GiB}}\n  - {name: b, memory: {'0:1': 20GiB}}\n"));
  EXPECT_NE(over.log().find("tenant 'b' brings the memory limits on GPU instance 1 of GPU 0 (MIG devices 0:0, 0:1, "
                            "sharing its memory) to 42949672960 bytes (40 GiB), over the device's total of "
                            "42412802048 bytes (39.50 GiB)"),
            std::string::npos)
      << over.log();
  Broker whole(brokerDir(dir, "whole"));
  EXPECT_FALSE(whole.start("tenants:\n  - {name: a, memory: {0: 1GiB}}\n"));
  EXPECT_NE(whole.log().find("GPU '0' is in MIG mode: CUDA runs only in its MIG devices (0:0, 0:1, 0:2); name one of "
                             "them as <gpu>:<mig> or MIG-<uuid>"),
            std::string::npos)
      << whole.log();
  // Exactly full, and the 1g apart.
  Broker fits(brokerDir(dir, "fits"));
  EXPECT_TRUE(fits.start("tenants:\n  - {name: a, memory: {'0:0': 20224MiB, '0:2': 9984MiB}}\n"
                         "  - {name: b, memory: {'0:1': 20224MiB}}\n"))
      << fits.log();
}

TEST_F(Mig, TenantsInAndAcrossInstancesAreHeldToTheirLimits) {
  Broker b(testDir());
  ASSERT_TRUE(b.start("tenants:\n"
                      "  - {name: alpha, memory: {'0:0': 1GiB}}\n"
                      "  - {name: beta, memory: {'0:1': 2GiB}}\n"
                      "  - {name: gamma, memory: {" + uuid[2] + ": 512MiB}}\n"))
      << b.log();
  // The broker lists the MIG devices, not the GPU.
  const rpc::StatusReply st = b.status();
  ASSERT_EQ(st.devices_size(), 3) << b.log();
  const char* profiles[3] = {"2c.3g.40gb", "1c.3g.40gb", "1g.10gb"};
  for (int i = 0; i < 3; ++i) {
    const rpc::Device& d = st.devices(i);
    EXPECT_EQ(d.name(), "0:" + std::to_string(i));
    EXPECT_EQ(d.index(), i);
    EXPECT_EQ(d.uuid(), uuid[i]);
    EXPECT_TRUE(d.mig());
    EXPECT_EQ(d.gpu_uuid(), gpuUuid);
    EXPECT_EQ(d.mig_profile(), profiles[i]);
  }
  EXPECT_EQ(st.devices(0).capacity_bytes(), 40448 * MiB) << "a compute instance has its GPU instance's memory";
  EXPECT_EQ(st.devices(1).gpu_instance_id(), st.devices(0).gpu_instance_id());
  EXPECT_EQ(st.devices(1).compute_instance_id(), 1u);
  EXPECT_EQ(st.devices(2).capacity_bytes(), 9984 * MiB);

  // Each tenant's process in its MIG device: its view is its limit, and it gets exactly that.
  Child a = b.tenantProcess("alpha", {{"CUDA_VISIBLE_DEVICES", uuid[0]}});
  Child be = b.tenantProcess("beta", {{"CUDA_VISIBLE_DEVICES", "MIG-" + gpuUuid + "/" +
                                                                   std::to_string(st.devices(1).gpu_instance_id()) +
                                                                   "/1"}});  // the legacy form
  Child g = b.tenantProcess("gamma", {{"CUDA_VISIBLE_DEVICES", uuid[2]}});
  EXPECT_EQ(a.ask("info"), "free " + std::to_string(1024 * MiB) + " total " + std::to_string(1024 * MiB));
  EXPECT_EQ(a.ask("fill " + std::to_string(64 * MiB)), "held " + std::to_string(1024 * MiB));
  EXPECT_EQ(be.ask("fill " + std::to_string(64 * MiB)), "held " + std::to_string(2048 * MiB));
  EXPECT_EQ(g.ask("fill " + std::to_string(64 * MiB)), "held " + std::to_string(512 * MiB));
  // Judged by the device's own count, per MIG device.
  EXPECT_EQ(heldIn(0, a.pid()), 1024 * MiB);
  EXPECT_EQ(heldIn(1, be.pid()), 2048 * MiB);
  EXPECT_EQ(heldIn(2, g.pid()), 512 * MiB);
  EXPECT_EQ(instanceUsed(0), 3072 * MiB) << "the 3g's two compute instances";
  EXPECT_EQ(instanceUsed(2), 512 * MiB);

  // A process outside cushare in 0:1 (no shim): its memory is outside on 0:1, not on 0:0 whose
  // GPU instance holds it too (the sibling's processes are taken off).
  Child outsider = Child::spawn({WORKER_BIN}, {{"CUDA_VISIBLE_DEVICES", uuid[1]}}, b.dir() + "/outsider.log");
  ASSERT_EQ(outsider.readLine(), "ready");
  ASSERT_EQ(outsider.ask("alloc " + std::to_string(100 * MiB)), "ok");
  EXPECT_TRUE(eventually([&] {
    const rpc::StatusReply s = b.status();
    return s.devices(1).outside_bytes() == 100 * MiB && s.devices(0).outside_bytes() == 0 &&
           s.devices(0).device_used_bytes() == 1024 * MiB && s.devices(1).device_used_bytes() == 2148 * MiB;
  })) << b.status().DebugString();
  ASSERT_EQ(b.status().devices(1).outside_pids_size(), 1);
  EXPECT_EQ(b.status().devices(1).outside_pids(0), outsider.pid());
  EXPECT_EQ(b.tenant("alpha").devices(0).device_name(), "0:0");

  // Metrics: per MIG device, with what each is.
  const std::string m = b.metrics();
  EXPECT_NE(m.find("cushare_tenant_memory_used_bytes{tenant=\"alpha\",device=\"0:0\",uuid=\"" + uuid[0] + "\"} " +
                   std::to_string(1024 * MiB)),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("cushare_device_info{device=\"0:2\",uuid=\"" + uuid[2] + "\",kind=\"mig\",gpu_uuid=\"" + gpuUuid +
                   "\",mig_profile=\"1g.10gb\",gpu_instance_id=\"" + std::to_string(st.devices(2).gpu_instance_id()) +
                   "\",compute_instance_id=\"0\"} 1"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("cushare_device_memory_outside_bytes{device=\"0:1\",uuid=\"" + uuid[1] + "\"} " +
                   std::to_string(100 * MiB)),
            std::string::npos)
      << m;

  // The CLI: devices by name or UUID; GPU 0 is refused with its MIG devices named.
  const auto cli = [&](const std::string& args) {
    const std::string cmd =
        std::string(CLI_BIN) + " --socket " + b.socket() + " " + args + " > " + b.dir() + "/out.txt 2>&1";
    const int rc = std::system(cmd.c_str());
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  };
  EXPECT_EQ(cli("set-limit gamma --memory 256MiB --device 0:2"), 0) << readAll(b.dir() + "/out.txt");
  EXPECT_NE(readAll(b.dir() + "/out.txt").find("note: gamma holds 512 MiB on device 0:2, above its new limit"),
            std::string::npos)
      << readAll(b.dir() + "/out.txt");
  EXPECT_EQ(g.ask("alloc 1"), "oom") << "over its lowered limit";
  EXPECT_EQ(cli("set-limit gamma --reset --device " + uuid[2]), 0) << readAll(b.dir() + "/out.txt");
  EXPECT_EQ(b.tenant("gamma").devices(2).limit_bytes(), 512 * MiB);
  EXPECT_EQ(cli("set-limit gamma --memory 1GiB --device 0"), 1);
  EXPECT_EQ(readAll(b.dir() + "/out.txt"),
            "cushare: set-limit: GPU 0 is in MIG mode; name one of its MIG devices (0:0, 0:1, 0:2) or its MIG-<uuid>\n");
  // A live limit that would overfill the 3g beside beta's 2 GiB is refused.
  EXPECT_EQ(cli("set-limit alpha --memory 39GiB --device 0:0"), 1);
  EXPECT_NE(readAll(b.dir() + "/out.txt").find("the limits on GPU instance 1 of GPU 0 (MIG devices 0:0, 0:1, sharing "
                                               "its memory) would add up to 41 GiB, more than its 39.50 GiB"),
            std::string::npos)
      << readAll(b.dir() + "/out.txt");
  EXPECT_EQ(cli("status"), 0);
  EXPECT_NE(readAll(b.dir() + "/out.txt").find("device 0:2: MIG 1g.10gb, GPU instance " +
                                               std::to_string(st.devices(2).gpu_instance_id()) +
                                               ", compute instance 0, of GPU " + gpuUuid),
            std::string::npos)
      << readAll(b.dir() + "/out.txt");

  // kill -9: the instance's memory comes back, and the tenant's budget with it.
  a.kill(SIGKILL);
  a.wait();
  EXPECT_TRUE(eventually([&] { return b.tenant("alpha").devices(0).used_bytes() == 0; })) << b.log();
  Child a2 = b.tenantProcess("alpha", {{"CUDA_VISIBLE_DEVICES", uuid[0]}});
  EXPECT_EQ(a2.ask("fill " + std::to_string(64 * MiB)), "held " + std::to_string(1024 * MiB));
}

// The layout changes under a running broker: the 1g destroyed (its MIG device gone), then a 2g.20gb
// made (another compute instance at index 2). The broker never reads another compute instance as
// the one it listed, says to restart it, and goes on reading the MIG devices that did not change.
TEST_F(Mig, ALayoutChangedUnderTheBrokerIsNotReadAsTheOld) {
  Broker b(testDir());
  // A broker that does not start again on a new layout (mig.follow_layout: false; one that does
  // is BrokerPluginMig.TheBrokerStartsAgainOnAChangedLayout).
  ASSERT_TRUE(b.start("mig: {follow_layout: false}\ntenants:\n  - {name: gamma, memory: {'0:2': 512MiB}}\n")) << b.log();
  ASSERT_TRUE(eventually([&] { return b.status().devices(2).has_device_used_bytes(); })) << b.log();
  ASSERT_EQ(nvmlComputeInstanceDestroy(c1), NVML_SUCCESS);
  ASSERT_EQ(nvmlGpuInstanceDestroy(g1), NVML_SUCCESS);
  c1 = nullptr;
  g1 = nullptr;
  const std::string changed = "(" + uuid[2] + ") is gone or another compute instance has its index: the MIG layout "
                              "changed since the broker started, restart it";
  EXPECT_TRUE(b.logHas("the device's per-process memory of 0:2 cannot be read, hidden memory there goes unnoticed: MIG "
                       "device 0:2 " + changed,
                       5000))
      << b.log();
  // The others are still read: a process outside cushare in 0:1 is seen there.
  Child outsider = Child::spawn({WORKER_BIN}, {{"CUDA_VISIBLE_DEVICES", uuid[1]}}, b.dir() + "/outsider.log");
  ASSERT_EQ(outsider.readLine(), "ready");
  ASSERT_EQ(outsider.ask("alloc " + std::to_string(10 * MiB)), "ok");
  EXPECT_TRUE(eventually([&] {
    const rpc::StatusReply s = b.status();
    return !s.devices(2).has_device_used_bytes() && s.devices(0).has_device_used_bytes() &&
           s.devices(1).outside_bytes() == 10 * MiB;
  })) << b.status().DebugString();

  // Another compute instance at index 2: not read as the old one.
  ASSERT_EQ(nvmlDeviceCreateGpuInstance(gpu, 14, &g1), NVML_SUCCESS);  // 2g.20gb
  ASSERT_EQ(nvmlGpuInstanceCreateComputeInstance(g1, NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE, &c1), NVML_SUCCESS);
  nvmlDevice_t now;
  char u[96];
  ASSERT_EQ(nvmlDeviceGetMigDeviceHandleByIndex(gpu, 2, &now), NVML_SUCCESS);
  ASSERT_EQ(nvmlDeviceGetUUID(now, u, sizeof u), NVML_SUCCESS);
  ASSERT_NE(std::string(u), uuid[2]);
  Child stranger = Child::spawn({WORKER_BIN}, {{"CUDA_VISIBLE_DEVICES", u}}, b.dir() + "/stranger.log");
  ASSERT_EQ(stranger.readLine(), "ready");
  ASSERT_EQ(stranger.ask("alloc " + std::to_string(20 * MiB)), "ok");
  for (int i = 0; i < 10; ++i) {
    const rpc::StatusReply s = b.status();
    EXPECT_FALSE(s.devices(2).has_device_used_bytes()) << "the new instance read as 0:2";
    EXPECT_EQ(s.devices(2).outside_bytes(), 0u);
    std::this_thread::sleep_for(std::chrono::milliseconds(60));
  }
  // A tenant process in the new MIG device: not a device the broker knows, so nothing is granted.
  std::string first;
  Child g = b.tenantProcess("gamma", {{"CUDA_VISIBLE_DEVICES", u}}, &first);
  ASSERT_EQ(first, "ready");
  EXPECT_EQ(g.ask("alloc " + std::to_string(MiB)), "oom");
}

// As docs/security.md deploys them: tenants on uids of their own, each in a MIG device, held to its
// limit by the device's own count (the shim, simgpu's MIG state and the ledgers reached as that uid).
TEST_F(Mig, TenantsOnTheirOwnUidsAreHeldInTheirMigDevices) {
  if (::geteuid() != 0) GTEST_SKIP() << "switching users needs root (CI runs as root)";
  Broker b(testDir());
  ASSERT_TRUE(b.start("tenants:\n  - {name: alpha, uid: 1000, memory: {'0:0': 1GiB}}\n"
                      "  - {name: gamma, uid: 1001, memory: {'0:2': 512MiB}}\n"))
      << b.log();
  UidTenants users;
  Child a = users.spawn(1000, WORKER_BIN, b, "alpha", {{"CUDA_VISIBLE_DEVICES", uuid[0]}});
  Child g = users.spawn(1001, WORKER_BIN, b, "gamma", {{"CUDA_VISIBLE_DEVICES", uuid[2]}});
  ASSERT_EQ(a.readLine(), "ready") << readAll(b.dir() + "/tenants.log");
  ASSERT_EQ(g.readLine(), "ready") << readAll(b.dir() + "/tenants.log");
  EXPECT_EQ(a.ask("fill " + std::to_string(64 * MiB)), "held " + std::to_string(1024 * MiB));
  EXPECT_EQ(g.ask("fill " + std::to_string(64 * MiB)), "held " + std::to_string(512 * MiB));
  EXPECT_EQ(heldIn(0, a.pid()), 1024 * MiB);
  EXPECT_EQ(heldIn(2, g.pid()), 512 * MiB);
  EXPECT_TRUE(eventually([&] { return b.tenant("gamma").devices(2).used_bytes() == 512 * MiB; }));
}

// A live limit on a MIG device is kept across a restart of the broker (its state file names the
// device by its MIG- UUID; an attack review found it read back as GPU- and lost).
TEST_F(Mig, LiveLimitsOfMigDevicesSurviveARestart) {
  Broker b(testDir());
  ASSERT_TRUE(b.start("tenants:\n  - {name: gamma, memory: {'0:2': 512MiB}}\n")) << b.log();
  ASSERT_TRUE(b.setLimit("gamma", "256MiB", 2).ok());
  ASSERT_EQ(b.stop(), 0);
  ASSERT_TRUE(b.startWithFile()) << b.log();
  const rpc::Tenant t = b.tenant("gamma");
  ASSERT_EQ(t.devices_size(), 3);
  EXPECT_EQ(t.devices(2).limit_bytes(), 256 * MiB) << b.log();
  EXPECT_TRUE(t.devices(2).overridden());
  Child g = b.tenantProcess("gamma", {{"CUDA_VISIBLE_DEVICES", uuid[2]}});
  EXPECT_EQ(g.ask("fill " + std::to_string(64 * MiB)), "held " + std::to_string(256 * MiB));
}

// MPS under the broker does not run inside MIG devices (yet): mode on refuses to start with the
// reason, auto runs without it.
// MPS on MIG devices runs a control daemon per MIG device at <pipe_dir>/MIG-<uuid> (docs/mig.md;
// BrokerMpsMig.* runs them): a pipe_dir too long for those sockets is refused with mode on, and
// leaves MPS off with mode auto, saying why.
TEST_F(Mig, APipeDirTooLongForMigDaemonsIsRefused) {
  const std::string dir = testDir();
  const std::string pipe = "/tmp/" + std::string(60, 'p');  // 65 bytes
  Broker on(brokerDir(dir, "on"));
  EXPECT_FALSE(on.start("mps: {mode: on, pipe_dir: " + pipe + "}\ntenants:\n  - {name: a, memory: {'0:2': 1GiB}}\n"));
  EXPECT_NE(on.log().find("mps.mode on: mps.pipe_dir " + pipe + " is 65 bytes: with MIG devices (a control daemon "
                          "each, at <pipe_dir>/MIG-<uuid>) it may be at most 47"),
            std::string::npos)
      << on.log();
  Broker autoMode(brokerDir(dir, "auto"));
  ASSERT_TRUE(autoMode.start("mps: {mode: auto, pipe_dir: " + pipe + "}\ntenants:\n  - {name: a, memory: {'0:2': 1GiB}}\n"))
      << autoMode.log();
  EXPECT_FALSE(autoMode.status().mps().active());
  EXPECT_NE(autoMode.status().mps().why().find("it may be at most 47"), std::string::npos)
      << autoMode.status().mps().DebugString();
}

}  // namespace
}  // namespace cushare::test

namespace cushare::test {
namespace {

// ---- The declarative layout (docs/mig.md, "Declarative layout"): cushare mig assert|apply and
// the broker's mig.apply_at_start, judged by NVML's own view of the GPU. GPU 0 starts with MIG off.

struct MigState {
  unsigned current = 0, pending = 0;
  std::map<std::string, int> profiles;  // GPU instance profile name -> count
  std::vector<unsigned> gis;
};

MigState migState() {
  MigState s;
  nvmlDevice_t gpu;
  if (nvmlInit_v2() != NVML_SUCCESS || nvmlDeviceGetHandleByIndex_v2(0, &gpu) != NVML_SUCCESS) return s;
  nvmlDeviceGetMigMode(gpu, &s.current, &s.pending);
  for (unsigned p = 0; p < NVML_GPU_INSTANCE_PROFILE_COUNT; ++p) {
    nvmlGpuInstanceProfileInfo_v2_t info{};
    info.version = nvmlGpuInstanceProfileInfo_v2;
    if (nvmlDeviceGetGpuInstanceProfileInfoV(gpu, p, &info) != NVML_SUCCESS) continue;
    nvmlGpuInstance_t gis[8];
    unsigned n = 8;
    if (nvmlDeviceGetGpuInstances(gpu, info.id, gis, &n) != NVML_SUCCESS) continue;
    for (unsigned i = 0; i < n; ++i) {
      nvmlGpuInstanceInfo_t gi{};
      nvmlGpuInstanceGetInfo(gis[i], &gi);
      s.gis.push_back(gi.id);
      ++s.profiles[std::string(info.name).substr(4)];
    }
  }
  std::sort(s.gis.begin(), s.gis.end());
  nvmlShutdown();
  return s;
}

// `cushare mig ARGS` with the configuration file: exit status, and stdout+stderr in *out.
int migCli(const std::string& dir, const std::string& args, std::string* out) {
  const std::string cmd = std::string(CLI_BIN) + " mig " + args + " --config " + dir + "/mig.yaml > " + dir +
                          "/mig.out 2>&1";
  const int rc = std::system(cmd.c_str());
  *out = readAll(dir + "/mig.out");
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

void writeFile(const std::string& path, const std::string& text) { std::ofstream(path) << text; }
// The CLI's configuration: the layout and tenants given, and a state_file of the test's (its
// directory holds the MIG layout lock: tests running side by side do not share one).
void writeMig(const std::string& dir, const std::string& text) {
  writeFile(dir + "/mig.yaml", text + "state_file: " + dir + "/broker.state\n");
}

TEST(MigLayout, AssertApplyDryRunAndRefusals) {
  const std::string dir = testDir();
  const std::string balanced =
      "mig:\n  layout:\n    - devices: all\n      mig-enabled: true\n      mig-devices: {\"3g.40gb\": 1, \"1g.10gb\": 2}\n";
  writeMig(dir, balanced + "tenants:\n  - {name: a, memory: {'0:2': 1GiB}}\n");
  std::string out;
  EXPECT_EQ(migCli(dir, "assert", &out), 1);
  EXPECT_EQ(out, "GPU 0: has MIG off, wanted MIG on, 2 x 1g.10gb, 1 x 3g.40gb\n");
  EXPECT_EQ(migCli(dir, "apply --dry-run", &out), 0) << out;
  EXPECT_EQ(out, "would change GPU 0: has MIG off, wanted MIG on, 2 x 1g.10gb, 1 x 3g.40gb\n");
  EXPECT_EQ(migState().current, 0u) << "a dry run changes nothing";
  // A profile this board does not have, or more instances than one holds, is refused before MIG
  // is turned on (found by a review: the GPU was left in MIG mode with nothing on it).
  writeFile(dir + "/bad.yaml", "mig:\n  layout:\n    - {devices: all, mig-enabled: true, mig-devices: {\"1g.5gb\": 2}}\n");
  EXPECT_EQ(std::system((std::string(CLI_BIN) + " mig apply --config " + dir + "/bad.yaml > " + dir + "/bad.out 2>&1").c_str()),
            1 << 8);
  EXPECT_NE(readAll(dir + "/bad.out").find("GPU 0 has no MIG profile 1g.5gb"), std::string::npos) << readAll(dir + "/bad.out");
  EXPECT_EQ(migState().current, 0u) << "MIG left off";

  ASSERT_EQ(migCli(dir, "apply", &out), 0) << out;
  EXPECT_NE(out.find("GPU 0: MIG mode enabled\n"), std::string::npos) << out;
  EXPECT_NE(out.find("GPU 0: created 3g.40gb at 0:4 with one compute instance\n"), std::string::npos) << out;
  EXPECT_NE(out.find("restart cushare-broker"), std::string::npos) << out;
  MigState s = migState();
  EXPECT_EQ(s.current, 1u);
  EXPECT_EQ(s.profiles, (std::map<std::string, int>{{"1g.10gb", 2}, {"3g.40gb", 1}}));
  EXPECT_EQ(migCli(dir, "assert", &out), 0) << out;
  EXPECT_EQ(out, "the MIG layout is applied\n");
  // Applied again: nothing changes (the same instances, the same IDs).
  EXPECT_EQ(migCli(dir, "apply", &out), 0) << out;
  EXPECT_NE(out.find("GPU 0: already MIG on, 2 x 1g.10gb, 1 x 3g.40gb\n"), std::string::npos) << out;
  EXPECT_EQ(migState().gis, s.gis);

  // A layout the tenants' keys would not survive, one that cannot fit, one in use: refused,
  // nothing changed.
  writeMig(dir, "mig:\n  layout:\n    - {devices: [0], mig-enabled: true, mig-devices: {\"7g.80gb\": 1}}\n"
                               "tenants:\n  - {name: a, memory: {'0:2': 1GiB}}\n");
  EXPECT_EQ(migCli(dir, "apply", &out), 1);
  EXPECT_NE(out.find("cushare: mig apply: tenant a (tenants[0].memory.0:2) names MIG device 0:2, but the layout makes 1 "
                     "MIG device on GPU 0"),
            std::string::npos)
      << out;
  writeMig(dir, "mig:\n  layout:\n    - {devices: all, mig-enabled: true, mig-devices: {\"4g.40gb\": 2}}\n");
  EXPECT_EQ(migCli(dir, "apply", &out), 1);
  EXPECT_NE(out.find("GPU 0 holds at most 1 x 4g.40gb, not 2"), std::string::npos) << out;
  writeMig(dir, "mig:\n  layout:\n    - {devices: all, mig-enabled: true, mig-devices: {\"4g.40gb\": 1, "
                               "\"3g.40gb\": 1, \"1g.10gb\": 1}}\n");
  EXPECT_EQ(migCli(dir, "apply", &out), 1);
  EXPECT_NE(out.find("GPU 0 cannot hold 1 x 1g.10gb, 1 x 3g.40gb, 1 x 4g.40gb at once (no placements fit)"),
            std::string::npos)
      << out;
  writeMig(dir, "mig:\n  layout:\n    - {devices: all, mig-enabled: true, mig-devices: {\"1g.5gb\": 1}}\n");
  EXPECT_EQ(migCli(dir, "apply", &out), 1);
  EXPECT_NE(out.find("GPU 0 has no MIG profile 1g.5gb (it has "), std::string::npos) << out;
  writeMig(dir, "mig:\n  layout:\n    - {devices: all, mig-enabled: true, mig-devices: {\"1g.10gb\": 7}}\n"
                               "tenants:\n  - {name: big, memory: 10GiB}\n");
  EXPECT_EQ(migCli(dir, "apply", &out), 1);
  EXPECT_NE(out.find("the single memory sizes of big add up to 10737418240 bytes on every device, more than the "
                     "smallest GPU instance the layout makes (1g.10gb on GPU 0, 10468982784 bytes)"),
            std::string::npos)
      << out;
  EXPECT_EQ(migState().gis, s.gis) << "nothing changed by the refusals";
  writeMig(dir, "mig:\n  layout:\n    - {devices: all, mig-enabled: true, mig-devices: {\"2g.20gb\": 9}}\n");
  EXPECT_EQ(migCli(dir, "apply", &out), 1);
  EXPECT_NE(out.find("mig.layout[0].mig-devices.2g.20gb: expected a count of instances, 0..7"), std::string::npos) << out;

  // In use: a process in one of the MIG devices.
  nvmlDevice_t gpu, m;
  char u[96];
  ASSERT_EQ(nvmlInit_v2(), NVML_SUCCESS);
  ASSERT_EQ(nvmlDeviceGetHandleByIndex_v2(0, &gpu), NVML_SUCCESS);
  ASSERT_EQ(nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0, &m), NVML_SUCCESS);
  ASSERT_EQ(nvmlDeviceGetUUID(m, u, sizeof u), NVML_SUCCESS);
  nvmlShutdown();
  Child p = Child::spawn({WORKER_BIN}, {{"CUDA_VISIBLE_DEVICES", u}}, dir + "/worker.log");
  ASSERT_EQ(p.readLine(), "ready");
  writeMig(dir, "mig:\n  layout:\n    - {devices: all, mig-enabled: true, mig-devices: {\"1g.10gb\": 7}}\n");
  EXPECT_EQ(migCli(dir, "apply", &out), 1);
  EXPECT_NE(out.find("cushare: mig apply: GPU 0 is in use by process " + std::to_string(p.pid()) +
                     ": its layout changes only when no process runs on it"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("(GPU 0: has MIG on, 2 x 1g.10gb, 1 x 3g.40gb, wanted MIG on, 7 x 1g.10gb)"), std::string::npos)
      << out;
  EXPECT_EQ(migState().gis, s.gis);
  p.send("quit");
  p.wait();
  EXPECT_EQ(migCli(dir, "apply", &out), 0) << out;
  EXPECT_EQ(migState().profiles, (std::map<std::string, int>{{"1g.10gb", 7}}));

  // mig-parted's own file, by config name; MIG off again.
  writeFile(dir + "/parted.yaml", "version: v1\nmig-configs:\n  all-disabled:\n    - devices: all\n      mig-enabled: false\n"
                                  "  all-1g.10gb:\n    - devices: all\n      mig-enabled: true\n      mig-devices:\n"
                                  "        \"1g.10gb\": 7\n");
  writeMig(dir, "mig: {config_file: " + dir + "/parted.yaml, config: all-balanced}\n");
  EXPECT_EQ(migCli(dir, "assert", &out), 1);
  EXPECT_NE(out.find("parted.yaml:3:3: mig-configs: no config 'all-balanced' (it has all-disabled, all-1g.10gb)"),
            std::string::npos)
      << out;
  writeMig(dir, "mig: {config_file: " + dir + "/parted.yaml, config: all-1g.10gb}\n");
  EXPECT_EQ(migCli(dir, "assert", &out), 0) << out;
  writeMig(dir, "mig: {config_file: " + dir + "/parted.yaml, config: all-disabled}\n");
  EXPECT_EQ(migCli(dir, "apply", &out), 0) << out;
  EXPECT_NE(out.find("GPU 0: destroyed its 7 GPU instance(s)\nGPU 0: MIG mode disabled\n"), std::string::npos) << out;
  EXPECT_EQ(migState().current, 0u);
}

// One broker shares at most 16 devices: 21 MIG devices (three GPUs of seven 1g.10gb) are refused at
// start with the reason, rather than by the first tenant's ledger.
TEST(MigMany, MoreDevicesThanABrokerSharesAreRefusedWithTheReason) {
  ASSERT_EQ(nvmlInit_v2(), NVML_SUCCESS);
  for (unsigned i = 0; i < 3; ++i) {
    nvmlDevice_t gpu;
    nvmlReturn_t act;
    ASSERT_EQ(nvmlDeviceGetHandleByIndex_v2(i, &gpu), NVML_SUCCESS);
    ASSERT_EQ(nvmlDeviceSetMigMode(gpu, NVML_DEVICE_MIG_ENABLE, &act), NVML_SUCCESS);
    for (int k = 0; k < 7; ++k) {
      nvmlGpuInstance_t gi;
      nvmlComputeInstance_t ci;
      ASSERT_EQ(nvmlDeviceCreateGpuInstance(gpu, 19, &gi), NVML_SUCCESS);
      ASSERT_EQ(nvmlGpuInstanceCreateComputeInstance(gi, NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, &ci), NVML_SUCCESS);
    }
  }
  nvmlShutdown();
  Broker b(testDir());
  EXPECT_FALSE(b.start("tenants:\n  - {name: a, memory: 1GiB}\n"));
  EXPECT_NE(b.log().find("this host has 21 devices (21 of them MIG devices, each counts), more than the 16 one broker "
                         "can share"),
            std::string::npos)
      << b.log();
}

// The broker applies the layout at start when asked, then lists the MIG devices it made.
TEST(MigLayout, TheBrokerAppliesTheLayoutAtStart) {
  Broker b(testDir());
  ASSERT_TRUE(b.start("mig:\n  apply_at_start: true\n  layout:\n    - devices: all\n      mig-enabled: true\n"
                      "      mig-devices: {\"3g.40gb\": 2}\n"
                      "tenants:\n  - {name: a, memory: {'0:1': 1GiB}}\n"))
      << b.log();
  EXPECT_TRUE(b.logHas("mig: GPU 0: created 3g.40gb at 0:4 with one compute instance")) << b.log();
  const rpc::StatusReply st = b.status();
  ASSERT_EQ(st.devices_size(), 2) << b.log();
  EXPECT_EQ(st.devices(1).name(), "0:1");
  EXPECT_EQ(st.devices(1).mig_profile(), "3g.40gb");
  // The metrics endpoint may bind a little after the control socket answers (ThreadSanitizer's
  // clean clone caught a read before it): read until it answers.
  std::string m;
  EXPECT_TRUE(eventually([&] { return (m = b.metrics()).find("cushare_mig_layout_matches") != std::string::npos; }, 10000))
      << m;
  EXPECT_NE(m.find("\ncushare_mig_layout_matches 1\n"), std::string::npos) << m;
  EXPECT_NE(m.find("\ncushare_mig_layout_changes 3\n"), std::string::npos) << m;
  EXPECT_EQ(b.stop(), 0);
  // Started again on the same layout: nothing to change.
  Broker again(testDir());
  ASSERT_TRUE(again.start("mig:\n  apply_at_start: true\n  layout:\n    - devices: all\n      mig-enabled: true\n"
                          "      mig-devices: {\"3g.40gb\": 2}\n"))
      << again.log();
  EXPECT_TRUE(
      eventually([&] { return (m = again.metrics()).find("cushare_mig_layout_changes") != std::string::npos; }, 10000))
      << m;
  EXPECT_NE(m.find("\ncushare_mig_layout_changes 0\n"), std::string::npos) << m << again.log();
}

// One change of layout at a time (docs/mig.md): while another holds the lock beside the state
// file, `cushare mig apply` refuses at once naming its pid and changes nothing (a dry run goes on);
// a broker's apply_at_start waits for it, then applies.
TEST(MigLayout, OneApplyAtATime) {
  const std::string dir = testDir();
  // Whatever the tests before left, a layout that differs from it.
  const std::string layout = "mig:\n  layout:\n    - {devices: all, mig-enabled: true, mig-devices: {\"2g.20gb\": 3}}\n";
  writeMig(dir, layout);
  const MigState before = migState();
  ASSERT_NE(before.profiles, (std::map<std::string, int>{{"2g.20gb", 3}}));
  const std::string lockPath = dir + "/broker.state.mig-lock";
  int fd = ::open(lockPath.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX), 0);
  const std::string me = std::to_string(::getpid());
  ASSERT_EQ(::pwrite(fd, me.data(), me.size(), 0), static_cast<ssize_t>(me.size()));
  std::string out;
  EXPECT_EQ(migCli(dir, "apply", &out), 1);
  EXPECT_NE(out.find("cushare: mig apply: another cushare mig apply or starting broker (pid " + me +
                     ", as it recorded) is changing the MIG layout (it holds " + lockPath + "); try again when it is done"),
            std::string::npos)
      << out;
  EXPECT_EQ(migState().profiles, before.profiles) << "nothing changed";
  EXPECT_EQ(migState().current, before.current);
  EXPECT_EQ(migCli(dir, "apply --dry-run", &out), 0) << out;

  // A broker applying at start waits for the lock.
  Broker b(brokerDir(dir, "b"));
  const std::string body = "mig:\n  apply_at_start: true\n  layout:\n    - {devices: all, mig-enabled: true, "
                           "mig-devices: {\"2g.20gb\": 3}}\n";
  ::close(fd);  // the test's lock was on dir's state file; the broker's state file is its own
  fd = ::open((b.dir() + "/broker.state.mig-lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX), 0);
  std::thread release([fd] {
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    ::close(fd);
  });
  const auto t0 = std::chrono::steady_clock::now();
  const bool started = b.start(body);
  release.join();
  ASSERT_TRUE(started) << b.log();
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(1400)) << "it waited for the lock";
  EXPECT_TRUE(b.logHas("is changing the MIG layout (it holds " + b.dir() + "/broker.state.mig-lock): waiting for it, "
                       "60 s at most"))
      << b.log();
  EXPECT_TRUE(b.logHas("mig: GPU 0: created 2g.20gb")) << b.log();
  EXPECT_EQ(b.status().devices_size(), 3) << b.log();
  EXPECT_EQ(b.stop(), 0);
  // The lock is free again: the CLI applies (nothing left to change).
  EXPECT_EQ(migCli(dir, "apply", &out), 0) << out;
  // A lock file others could open (and hold for ever), or another user's, is refused, not used.
  const std::string refusedText = " is not a file of this user that only it may open (another user made it, it has "
                                  "other names, or its mode lets others open it): remove it";
  ASSERT_EQ(::chmod(lockPath.c_str(), 0644), 0);
  EXPECT_EQ(migCli(dir, "apply", &out), 1);
  EXPECT_NE(out.find(lockPath + refusedText), std::string::npos) << out;
  ASSERT_EQ(::chmod(lockPath.c_str(), 0600), 0);
  if (::geteuid() == 0) {
    ASSERT_EQ(::chown(lockPath.c_str(), 1000, 1000), 0);
    EXPECT_EQ(migCli(dir, "apply", &out), 1);
    EXPECT_NE(out.find(lockPath + refusedText), std::string::npos) << out;
  }
  ASSERT_EQ(::unlink(lockPath.c_str()), 0);
  // Nor is a state_file in a directory others may write.
  const std::string open = dir + "/open";
  ASSERT_EQ(::mkdir(open.c_str(), 0777), 0);
  ASSERT_EQ(::chmod(open.c_str(), 0777), 0);
  writeFile(dir + "/mig.yaml", layout + "state_file: " + open + "/broker.state\n");
  EXPECT_EQ(migCli(dir, "apply", &out), 1);
  EXPECT_NE(out.find("the MIG layout lock " + open + "/broker.state.mig-lock would lie in " + open +
                     ", which is a link, or another user's, or writable by others"),
            std::string::npos)
      << out;
  writeMig(dir, "mig:\n  layout:\n    - {devices: all, mig-enabled: false}\n");  // MIG off again
  EXPECT_EQ(migCli(dir, "apply", &out), 0) << out;
}

// An A100-40GB applies a mode change only at a GPU reset: apply stops there and says so, and goes
// on after the reset.
TEST(MigLayoutA100, APendingModeChangeWaitsForTheReset) {
  const std::string dir = testDir();
  writeMig(dir, "mig:\n  layout:\n    - {devices: all, mig-enabled: true, mig-devices: {\"2g.10gb\": 3}}\n");
  std::string out;
  EXPECT_EQ(migCli(dir, "apply", &out), 1);
  EXPECT_NE(out.find("GPU 0: MIG mode enabled (pending: the driver applies it at the next GPU reset)"), std::string::npos)
      << out;
  EXPECT_NE(out.find("cushare: mig apply: GPU 0: the MIG mode change waits for a GPU reset (nvidia-smi -r -i 0 with no "
                     "process on it, or a reboot); run apply again after it"),
            std::string::npos)
      << out;
  EXPECT_EQ(migCli(dir, "assert", &out), 1);
  EXPECT_EQ(out, "GPU 0: has MIG off (on pending a reset), wanted MIG on, 3 x 2g.10gb\n");
  ASSERT_EQ(std::system((std::string(SIMGPU_SMI) + " -i 0 --gpu-reset > /dev/null").c_str()), 0);
  EXPECT_EQ(migCli(dir, "apply", &out), 0) << out;
  EXPECT_EQ(migState().profiles, (std::map<std::string, int>{{"2g.10gb", 3}}));
}

}  // namespace
}  // namespace cushare::test
