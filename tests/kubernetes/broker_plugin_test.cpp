// The device plugin of the real cushare-broker on simgpu against the fake kubelet: a pod that asks
// for cushare.io/alpha gets, from Allocate, edits that make its process tenant alpha (run here with
// exactly those edits: tests/containers/cdi_spec.py applies them as a runtime would); the plugin
// registers again when the kubelet restarts; a faulted MPS server turns the devices unhealthy; a
// vanished kubelet and protocol errors leave the tenants' accounting (the broker's and the
// device's own) as it was.
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "core/pod_labels.h"
#include "fake_kubelet.h"
#include "harness.h"
#include "simgpu/nvml.h"

namespace cushare::test {
namespace {

// A CDI-shaped file holding one Allocate answer's env and mounts, so cdi_spec.py can apply them.
std::string asSpec(const v1beta1::ContainerAllocateResponse& c, const std::string& path) {
  std::ofstream out(path);
  out << "{\"cdiVersion\": \"0.3.0\", \"kind\": \"cushare.io/pod\", \"devices\": [{\"name\": \"pod\", "
         "\"containerEdits\": {\"env\": [";
  bool first = true;
  for (const auto& [k, v] : c.envs()) {
    out << (first ? "" : ", ") << "\"" << k << "=" << v << "\"";
    first = false;
  }
  out << "], \"mounts\": [";
  first = true;
  for (const auto& m : c.mounts()) {
    out << (first ? "" : ", ") << "{\"hostPath\": \"" << m.host_path() << "\", \"containerPath\": \""
        << m.container_path() << "\", \"options\": [\"" << (m.read_only() ? "ro" : "rw") << "\", \"bind\"]}";
    first = false;
  }
  out << "]}}]}\n";
  return path;
}

grpc::Status allocate(FakeKubelet& k, const std::string& resource, const std::string& id,
                      v1beta1::AllocateResponse* out) {
  v1beta1::AllocateRequest req;
  req.add_container_requests()->add_devices_ids(id);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  return k.dial(resource)->Allocate(&ctx, req, out);
}

bool healthy(const FakeKubelet::Plugin& p, size_t n) {
  if (p.devices.size() != n) return false;
  for (const auto& d : p.devices)
    if (d.health() != "Healthy") return false;
  return true;
}

TEST(BrokerPlugin, APodAskingForATenantIsThatTenantAndSurvivesKubeletRestarts) {
  Broker b(testDir());
  const std::string dp = "/tmp/cushare-dp-" + std::to_string(::getpid()) + "-broker";
  std::filesystem::remove_all(dp);
  auto kubelet = std::make_unique<FakeKubelet>(dp);
  ASSERT_TRUE(kubelet->start());
  ASSERT_TRUE(b.start("kubernetes: {device_plugin_dir: " + dp + ", devices_per_gpu: 2, allocation_dir: " + b.dir() +
                      "/allocations}\n"
                      "tenants:\n  - {name: alpha, memory: 256MiB}\n  - {name: beta, memory: 512MiB}\n"))
      << b.log();
  ASSERT_TRUE(kubelet->waitFor("cushare.io/alpha", [](const auto& p) { return healthy(p, 2); })) << b.log();
  ASSERT_TRUE(kubelet->waitFor("cushare.io/beta", [](const auto& p) { return healthy(p, 2); })) << b.log();
  const std::string id = kubelet->plugin("cushare.io/alpha").devices[1].id();
  v1beta1::AllocateResponse a;
  ASSERT_TRUE(allocate(*kubelet, "cushare.io/alpha", id, &a).ok());
  ASSERT_EQ(a.container_responses_size(), 1);
  const auto& c = a.container_responses(0);
  ASSERT_EQ(c.cdi_devices_size(), 1);
  EXPECT_EQ(c.cdi_devices(0).name(), "cushare.io/tenant=alpha");
  EXPECT_EQ(c.envs().at("CUSHARE_TENANT"), "alpha");
  EXPECT_EQ(c.envs().at("CUSHARE_REQUIRE_BROKER"), "1");

  // The pod's process, with exactly these edits, is alpha.
  std::map<std::string, std::string> env = {{"LD_PRELOAD", ""}};
  Child pod = Child::spawn({PYTHON3, CDI_SPEC_PY, "run", asSpec(c, b.dir() + "/pod.json"), "pod", "--", WORKER_BIN},
                           env, b.dir() + "/tenants.log");
  const std::string first = pod.readLine();
  if (first.empty() && std::ifstream(b.dir() + "/tenants.log").peek() != EOF) {
    std::ifstream in(b.dir() + "/tenants.log");
    const std::string log((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (log.find("no mount namespace") != std::string::npos) GTEST_SKIP() << log;
  }
  ASSERT_EQ(first, "ready");
  ASSERT_EQ(pod.ask("alloc " + std::to_string(64 * MiB)), "ok");
  EXPECT_EQ(usedOn0(b.tenant("alpha")), 64 * MiB);
  EXPECT_GE(deviceMemoryOn0()[pod.pid()], 64 * MiB);
  EXPECT_EQ(pod.ask("alloc " + std::to_string(256 * MiB)), "oom") << "alpha's limit holds";

  // Protocol errors: an ID the plugin never advertised, an empty request. Nothing changes.
  v1beta1::AllocateResponse bad;
  EXPECT_EQ(allocate(*kubelet, "cushare.io/alpha", "GPU-nope::9", &bad).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  {
    v1beta1::AllocateRequest empty;
    grpc::ClientContext ctx;
    EXPECT_EQ(kubelet->dial("cushare.io/alpha")->Allocate(&ctx, empty, &bad).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
  }

  // The kubelet restarts (deleting every socket): the broker registers both resources again.
  kubelet->stop(true);
  ASSERT_TRUE(kubelet->start());
  ASSERT_TRUE(kubelet->waitFor("cushare.io/alpha", [](const auto& p) { return healthy(p, 2); })) << b.log();
  ASSERT_TRUE(kubelet->waitFor("cushare.io/beta", [](const auto& p) { return healthy(p, 2); })) << b.log();
  a.Clear();
  EXPECT_TRUE(allocate(*kubelet, "cushare.io/beta", kubelet->plugin("cushare.io/beta").devices[0].id(), &a).ok());

  // The kubelet vanishes: the tenant's process and its accounting are untouched.
  kubelet->stop(false);
  kubelet.reset();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_EQ(usedOn0(b.tenant("alpha")), 64 * MiB);
  EXPECT_GE(deviceMemoryOn0()[pod.pid()], 64 * MiB);
  EXPECT_EQ(pod.ask("held"), "held " + std::to_string(64 * MiB));
  EXPECT_TRUE(b.status().version().size() > 0) << "the broker answers";
  EXPECT_EQ(pod.ask("quit"), "");
  EXPECT_EQ(pod.wait(), 0);
  EXPECT_EQ(usedOn0(b.tenant("alpha")), 0u);
  EXPECT_EQ(b.stop(), 0);
  EXPECT_FALSE(std::filesystem::exists(dp + "/cushare-alpha.sock")) << "the broker removes its sockets at stop";
  std::filesystem::remove_all(dp);
}

size_t countLines(const std::string& text, const std::string& prefix) {
  size_t n = 0;
  for (size_t at = text.find(prefix); at != std::string::npos; at = text.find(prefix, at + 1))
    if (at == 0 || text[at - 1] == '\n') ++n;
  return n;
}

// Pods in the metrics (docs/kubernetes.md): a process is named by the namespace, pod and container
// that the kubelet's pod resources API gives for the device ID whose allocation directory its
// container has mounted (exactly as Allocate answered, applied by tests/containers/cdi_spec.py),
// on the tenants' own uids. Nothing else names one: a process without the mount, another
// tenant's mount, a look-alike directory on the same filesystem, an ID the kubelet does not list.
// The labels follow the kubelet (a new container within seconds, none while it fails) and change
// no accounting.
TEST(BrokerPlugin, ProcessesAreNamedByTheirPodAndContainer) {
  Broker b(testDir());
  const std::string dp = "/tmp/cushare-dp-" + std::to_string(::getpid()) + "-pods";
  const std::string socket = "/tmp/cushare-pr-" + std::to_string(::getpid()) + ".sock";
  const std::string alloc = b.dir() + "/allocations";
  std::filesystem::remove_all(dp);
  FakeKubelet kubelet(dp);
  ASSERT_TRUE(kubelet.start());
  FakePodResources pods(socket);
  ASSERT_TRUE(pods.start());
  ASSERT_TRUE(b.start("kubernetes: {device_plugin_dir: " + dp + ", devices_per_gpu: 3, pod_resources_socket: " + socket +
                      ", allocation_dir: " + alloc + "}\n"
                      "tenants:\n  - {name: alpha, memory: 256MiB, uid: 2000}\n"
                      "  - {name: beta, memory: 256MiB, uid: 2001}\n"))
      << b.log();
  ASSERT_TRUE(kubelet.waitFor("cushare.io/alpha", [](const auto& p) { return healthy(p, 3); })) << b.log();
  ASSERT_TRUE(kubelet.waitFor("cushare.io/beta", [](const auto& p) { return healthy(p, 3); })) << b.log();
  std::vector<std::string> ids;
  for (const auto& d : kubelet.plugin("cushare.io/alpha").devices) ids.push_back(d.id());
  std::sort(ids.begin(), ids.end());
  const std::string betaId = kubelet.plugin("cushare.io/beta").devices[0].id();

  // Allocate mounts the directory of the container's first ID, read-only.
  auto mountOf = [&](const std::vector<std::string>& request) {
    v1beta1::AllocateRequest req;
    v1beta1::ContainerAllocateRequest* c = req.add_container_requests();  // one container, all of them
    for (const std::string& id : request) c->add_devices_ids(id);
    v1beta1::AllocateResponse a;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    EXPECT_TRUE(kubelet.dial("cushare.io/alpha")->Allocate(&ctx, req, &a).ok());
    std::string host;
    for (const auto& m : a.container_responses(0).mounts())
      if (m.container_path() == broker::kAllocationMountPoint) {
        EXPECT_TRUE(m.read_only());
        EXPECT_TRUE(host.empty()) << "one allocation mount";
        host = m.host_path();
      }
    return host;
  };
  const std::string first = mountOf({ids[1], ids[0]});
  EXPECT_EQ(first, alloc + "/alpha/" + broker::allocationDirName(ids[0]));
  const std::string second = mountOf({ids[2]});
  EXPECT_EQ(second, alloc + "/alpha/" + broker::allocationDirName(ids[2]));
  ASSERT_TRUE(std::filesystem::is_directory(first) && std::filesystem::is_directory(second));

  // Processes in containers: the allocation mount applied as a runtime would, then the tenant's uid.
  UidTenants users;
  auto inContainer = [&](const std::string& hostPath, const std::string& name) {
    v1beta1::ContainerAllocateResponse r;
    v1beta1::Mount* m = r.add_mounts();
    m->set_container_path(broker::kAllocationMountPoint);
    m->set_host_path(hostPath);
    m->set_read_only(true);
    return std::vector<std::string>{PYTHON3, CDI_SPEC_PY, "run", asSpec(r, b.dir() + "/" + name + ".json"), "pod", "--"};
  };
  Child server = users.spawn(2000, WORKER_BIN, b, "alpha", {}, {}, inContainer(first, "server"));
  const std::string ready = server.readLine();
  if (ready.empty()) {
    std::ifstream in(b.dir() + "/tenants.log");
    const std::string log((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (log.find("no mount namespace") != std::string::npos) GTEST_SKIP() << log;
  }
  ASSERT_EQ(ready, "ready");
  ASSERT_EQ(server.ask("alloc " + std::to_string(64 * MiB)), "ok");
  Child worker = users.spawn(2000, WORKER_BIN, b, "alpha", {}, {}, inContainer(second, "worker"));
  ASSERT_EQ(worker.readLine(), "ready");
  ASSERT_EQ(worker.ask("alloc " + std::to_string(32 * MiB)), "ok");
  Child bare = users.spawn(2000, WORKER_BIN, b, "alpha");  // no container
  ASSERT_EQ(bare.readLine(), "ready");
  ASSERT_EQ(bare.ask("alloc " + std::to_string(16 * MiB)), "ok");
  // beta's process with alpha's allocation mounted (a pod that asked for cushare.io/alpha but runs
  // as beta's user), and alpha's process with a look-alike of that directory on the same filesystem.
  Child intruder = users.spawn(2001, WORKER_BIN, b, "beta", {}, {}, inContainer(first, "intruder"));
  ASSERT_EQ(intruder.readLine(), "ready");
  ASSERT_EQ(intruder.ask("alloc " + std::to_string(8 * MiB)), "ok");
  const std::string lookAlike = b.dir() + "/mine/alpha/" + broker::allocationDirName(ids[0]);
  std::filesystem::create_directories(lookAlike);
  Child copy = users.spawn(2000, WORKER_BIN, b, "alpha", {}, {}, inContainer(lookAlike, "copy"));
  ASSERT_EQ(copy.readLine(), "ready");
  ASSERT_EQ(copy.ask("alloc " + std::to_string(4 * MiB)), "ok");

  // The kubelet lists the first container (and beta's, which holds none of these processes).
  pods.set({{"team-a", "infer-0", "server", "cushare.io/alpha", {ids[0], ids[1]}},
            {"team-b", "other", "main", "cushare.io/beta", {betaId}}});
  const std::string dev = "device=\"0\",uuid=\"" + kDevice0Uuid + "\"";
  const std::string serverMemory = "cushare_container_memory_used_bytes{tenant=\"alpha\"," + dev +
                                   ",namespace=\"team-a\",pod=\"infer-0\",container=\"server\"} ";
  const std::string workerMemory = "cushare_container_memory_used_bytes{tenant=\"alpha\"," + dev +
                                   ",namespace=\"team-a\",pod=\"infer-1\",container=\"worker\"} ";
  ASSERT_TRUE(eventually([&] { return b.metrics().find(serverMemory + std::to_string(64 * MiB) + "\n") != std::string::npos; }))
      << b.metrics() << b.log();
  std::string m = b.metrics();
  EXPECT_NE(m.find("\ncushare_kubernetes_pod_resources_up 1\n"), std::string::npos);
  EXPECT_NE(m.find("\ncushare_container_processes{tenant=\"alpha\",namespace=\"team-a\",pod=\"infer-0\",container=\"server\"} 1\n"),
            std::string::npos)
      << m;
  EXPECT_EQ(countLines(m, "cushare_container_memory_used_bytes{"), 1u) << m;
  EXPECT_EQ(countLines(m, "cushare_container_processes{"), 1u) << m;
  // The device's own count agrees: the server's process holds that much there.
  EXPECT_GE(deviceMemoryOn0()[server.pid()], 64 * MiB);
  // Labels change no accounting.
  EXPECT_EQ(usedOn0(b.tenant("alpha")), (64 + 32 + 16 + 4) * MiB);
  EXPECT_EQ(usedOn0(b.tenant("beta")), 8 * MiB);
  EXPECT_TRUE(b.logHas("has tenant alpha's allocation mounted")) << b.log();
  // cushare processes names the container of the server's process, and no other.
  rpc::Request req;
  req.set_version(1);
  req.mutable_processes();
  const rpc::ProcessesReply procs = b.call(req).processes();
  int named = 0;
  for (const rpc::Process& p : procs.processes()) {
    if (!p.has_pod()) continue;
    ++named;
    EXPECT_EQ(p.host_pid(), server.pid());
    EXPECT_EQ(p.pod().namespace_(), "team-a");
    EXPECT_EQ(p.pod().pod(), "infer-0");
    EXPECT_EQ(p.pod().container(), "server");
  }
  EXPECT_EQ(named, 1);
  EXPECT_EQ(procs.processes_size(), 5);
  // ... and so does the CLI: a POD column, "-" for the others; a pod object in its JSON.
  auto cli = [&](const std::string& args) {
    const std::string out = b.dir() + "/cli.txt";
    const std::string cmd = std::string(CLI_BIN) + " --socket " + b.socket() + " " + args + " > " + out + " 2>&1";
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
    std::ifstream in(out);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  const std::string table = cli("processes --tenant alpha");
  EXPECT_NE(table.find("POD"), std::string::npos) << table;
  EXPECT_NE(table.find(std::to_string(server.pid()) + " "), std::string::npos) << table;
  EXPECT_NE(table.find("team-a/infer-0/server"), std::string::npos) << table;
  EXPECT_EQ(countLines(table, "alpha "), 4u) << table;
  const std::string json = cli("processes --tenant alpha --json");
  EXPECT_NE(json.find("\"pod\":{\"namespace\":\"team-a\",\"pod\":\"infer-0\",\"container\":\"server\"}"),
            std::string::npos)
      << json;

  // A container the kubelet lists later is named within seconds (a miss asks the kubelet again
  // at once, not at the next period of 10 s).
  pods.set({{"team-a", "infer-0", "server", "cushare.io/alpha", {ids[0], ids[1]}},
            {"team-a", "infer-1", "worker", "cushare.io/alpha", {ids[2]}}});
  EXPECT_TRUE(eventually([&] { return b.metrics().find(workerMemory + std::to_string(32 * MiB) + "\n") != std::string::npos; },
                         5000))
      << b.metrics();

  // The kubelet fails: no labels (a device ID may pass to another pod meanwhile), the gauge says so.
  pods.fail(true);
  EXPECT_TRUE(eventually([&] {
    const std::string t = b.metrics();
    return t.find("\ncushare_kubernetes_pod_resources_up 0\n") != std::string::npos &&
           countLines(t, "cushare_container_memory_used_bytes{") == 0;
  }, 20000)) << b.metrics();
  EXPECT_TRUE(b.logHas("pod labels: List on " + socket)) << b.log();
  pods.fail(false);
  EXPECT_TRUE(eventually([&] { return b.metrics().find(serverMemory + std::to_string(64 * MiB) + "\n") != std::string::npos; },
                         20000))
      << b.metrics();

  // The server exits: its container's series go with it.
  EXPECT_EQ(server.ask("quit"), "");
  EXPECT_EQ(server.wait(), 0);
  EXPECT_TRUE(eventually([&] { return b.metrics().find(serverMemory) == std::string::npos; })) << b.metrics();
  EXPECT_NE(b.metrics().find(workerMemory + std::to_string(32 * MiB) + "\n"), std::string::npos);
  for (Child* c : {&worker, &bare, &intruder, &copy}) {
    c->send("quit");
    EXPECT_EQ(c->wait(), 0);
  }
  EXPECT_EQ(b.stop(), 0);
  std::filesystem::remove_all(dp);
}

// A faulted MPS server makes every device unhealthy (the kubelet places no new pod on it) until it
// serves again; the kubelet hears it on the ListAndWatch stream.
TEST(BrokerPlugin, AFaultedMpsServerMakesTheDevicesUnhealthyUntilItRecovers) {
  Broker b(testDir());
  const std::string dp = "/tmp/cushare-dp-" + std::to_string(::getpid()) + "-mps";
  const std::string pipe = "/tmp/cushare-test-mps/plugin-" + std::to_string(::getpid());
  ::mkdir("/tmp/cushare-test-mps", 0755);
  std::filesystem::remove_all(dp);
  std::filesystem::remove_all(pipe);
  FakeKubelet kubelet(dp);
  ASSERT_TRUE(kubelet.start());
  ASSERT_TRUE(b.start("kubernetes: {device_plugin_dir: " + dp + ", devices_per_gpu: 2, pod_resources_socket: off}\n"
                      "mps: {mode: on, control: " SIMGPU_MPS_BIN "/nvidia-cuda-mps-control, pipe_dir: " + pipe +
                      ", log_dir: " + b.dir() + "/mps-log, context_reserve: 256MiB}\n"
                      "tenants:\n  - {name: alpha, memory: 256MiB, thread_percentage: 30}\n"))
      << b.log();
  ASSERT_TRUE(kubelet.waitFor("cushare.io/alpha", [](const auto& p) { return healthy(p, 2); })) << b.log();
  Child w = Child::spawn({MPS_WORKER_BIN}, {{"LD_PRELOAD", SHIM_LIB}, {"CUSHARE_TENANT", "alpha"},
                                            {"CUSHARE_LEDGER_DIR", b.ledgerDir()}, {"CUSHARE_LOG_LEVEL", "warn"}},
                         b.dir() + "/tenants.log");
  ASSERT_EQ(w.readLine(), "ready 30");
  ASSERT_EQ(w.ask("fault 700"), "ok");  // CUDA_ERROR_ILLEGAL_ADDRESS: the server enters FAULT
  auto allUnhealthy = [](const FakeKubelet::Plugin& p) {
    if (p.devices.size() != 2) return false;
    for (const auto& d : p.devices)
      if (d.health() != "Unhealthy") return false;
    return true;
  };
  EXPECT_TRUE(kubelet.waitFor("cushare.io/alpha", allUnhealthy, 20000)) << b.log();
  w.send("quit");
  w.wait();
  EXPECT_TRUE(kubelet.waitFor("cushare.io/alpha", [](const auto& p) { return healthy(p, 2); }, 20000)) << b.log();
  EXPECT_EQ(b.stop(), 0);
  std::filesystem::remove_all(dp);
  std::filesystem::remove_all(pipe);
}

// cushare on MIG under Kubernetes (docs/mig.md, docs/kubernetes.md), on simgpu's H100 with two
// GPUs (ctest broker_plugin_mig): GPU 0 split into two 1g.10gb MIG devices (0:0, 0:1), GPU 1 whole.
// Each tenant's resource is backed by the devices it is placed on, Allocate gives the MIG device by
// UUID (and NVIDIA's CDI device by its index), the pod's process is held to its limit by the MIG
// device's own count; a layout changed under the broker turns the devices of the MIG device that
// went Unhealthy (the others stay), and the broker's next start advertises the new layout.
class BrokerPluginMig : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(nvmlInit_v2(), NVML_SUCCESS);
    ASSERT_EQ(nvmlDeviceGetHandleByIndex_v2(0, &gpu), NVML_SUCCESS);
    nvmlReturn_t act;
    ASSERT_EQ(nvmlDeviceSetMigMode(gpu, NVML_DEVICE_MIG_ENABLE, &act), NVML_SUCCESS);
    for (int i = 0; i < 2; ++i) make(i);
  }
  void TearDown() override {  // the next test starts from MIG off (the state is the host's)
    for (int i = 0; i < 2; ++i) drop(i);
    nvmlReturn_t act;
    EXPECT_EQ(nvmlDeviceSetMigMode(gpu, NVML_DEVICE_MIG_DISABLE, &act), NVML_SUCCESS);
    nvmlShutdown();
  }
  void make(int i) {
    ASSERT_EQ(nvmlDeviceCreateGpuInstance(gpu, 19, &gi[i]), NVML_SUCCESS);  // 1g.10gb
    ASSERT_EQ(nvmlGpuInstanceCreateComputeInstance(gi[i], NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, &ci[i]), NVML_SUCCESS);
  }
  void drop(int i) {
    if (ci[i]) EXPECT_EQ(nvmlComputeInstanceDestroy(ci[i]), NVML_SUCCESS);
    if (gi[i]) EXPECT_EQ(nvmlGpuInstanceDestroy(gi[i]), NVML_SUCCESS);
    ci[i] = nullptr;
    gi[i] = nullptr;
  }
  std::string migUuid(unsigned index) {
    nvmlDevice_t m;
    char u[96] = "";
    if (nvmlDeviceGetMigDeviceHandleByIndex(gpu, index, &m) != NVML_SUCCESS ||
        nvmlDeviceGetUUID(m, u, sizeof u) != NVML_SUCCESS)
      return "";
    return u;
  }
  uint64_t heldIn(const std::string& uuid, pid_t pid) {  // the MIG device's own count
    nvmlDevice_t m;
    nvmlProcessInfo_t p[16];
    unsigned n = 16;
    if (nvmlDeviceGetHandleByUUID(uuid.c_str(), &m) != NVML_SUCCESS ||
        nvmlDeviceGetComputeRunningProcesses_v3(m, &n, p) != NVML_SUCCESS)
      return UINT64_MAX;
    for (unsigned k = 0; k < n; ++k)
      if (p[k].pid == static_cast<unsigned>(pid)) return p[k].usedGpuMemory;
    return 0;
  }
  nvmlDevice_t gpu = nullptr;
  nvmlGpuInstance_t gi[2] = {};
  nvmlComputeInstance_t ci[2] = {};
};

std::vector<std::string> idsOf(const FakeKubelet::Plugin& p) {
  std::vector<std::string> out;
  for (const auto& d : p.devices) out.push_back(d.id());
  return out;
}

TEST_F(BrokerPluginMig, ATenantGetsTheMigDevicesItIsPlacedOnAndALayoutChangeIsSeen) {
  const std::string mig0 = migUuid(0), mig1 = migUuid(1);
  ASSERT_TRUE(mig0.starts_with("MIG-") && mig1.starts_with("MIG-")) << mig0 << " " << mig1;
  nvmlDevice_t whole;
  char u[96];
  ASSERT_EQ(nvmlDeviceGetHandleByIndex_v2(1, &whole), NVML_SUCCESS);
  ASSERT_EQ(nvmlDeviceGetUUID(whole, u, sizeof u), NVML_SUCCESS);
  const std::string gpu1 = u;
  const std::string dp = "/tmp/cushare-dp-" + std::to_string(::getpid()) + "-mig";
  std::filesystem::remove_all(dp);
  FakeKubelet kubelet(dp);
  ASSERT_TRUE(kubelet.start());
  const std::string dir = testDir();
  const std::string body = "kubernetes: {device_plugin_dir: " + dp +
                           ", devices_per_gpu: 2, pod_resources_socket: off, gpu_cdi_device: 'nvidia.com/gpu={index}'}\n"
                           "tenants:\n  - {name: alpha, memory: {'0:0': 256MiB}}\n"
                           "  - {name: beta, memory: {'0:1': 512MiB, 1: 512MiB}}\n  - {name: gamma, memory: 128MiB}\n";
  auto b = std::make_unique<Broker>(dir);
  ASSERT_TRUE(b->start(body)) << b->log();
  ASSERT_TRUE(kubelet.waitFor("cushare.io/alpha", [](const auto& p) { return healthy(p, 2); })) << b->log();
  ASSERT_TRUE(kubelet.waitFor("cushare.io/beta", [](const auto& p) { return healthy(p, 4); })) << b->log();
  ASSERT_TRUE(kubelet.waitFor("cushare.io/gamma", [](const auto& p) { return healthy(p, 6); })) << b->log();
  EXPECT_EQ(idsOf(kubelet.plugin("cushare.io/alpha")), (std::vector<std::string>{mig0 + "::0", mig0 + "::1"}));
  EXPECT_EQ(idsOf(kubelet.plugin("cushare.io/beta")),
            (std::vector<std::string>{mig1 + "::0", mig1 + "::1", gpu1 + "::0", gpu1 + "::1"}));

  // A pod of alpha: its MIG device by UUID, NVIDIA's CDI device by index, held to 256 MiB there.
  v1beta1::AllocateResponse a;
  EXPECT_EQ(allocate(kubelet, "cushare.io/alpha", mig1 + "::0", &a).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  ASSERT_TRUE(allocate(kubelet, "cushare.io/alpha", mig0 + "::1", &a).ok());
  const auto& c = a.container_responses(0);
  EXPECT_EQ(c.envs().at("CUDA_VISIBLE_DEVICES"), mig0);
  ASSERT_EQ(c.cdi_devices_size(), 2);
  EXPECT_EQ(c.cdi_devices(0).name(), "nvidia.com/gpu=0:0");
  EXPECT_EQ(c.cdi_devices(1).name(), "cushare.io/tenant=alpha");
  Child pod = Child::spawn({PYTHON3, CDI_SPEC_PY, "run", asSpec(c, dir + "/pod.json"), "pod", "--", WORKER_BIN},
                           {{"LD_PRELOAD", ""}}, dir + "/tenants.log");
  const std::string first = pod.readLine();
  if (first.empty() && std::ifstream(dir + "/tenants.log").peek() != EOF) {
    std::ifstream in(dir + "/tenants.log");
    const std::string log((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (log.find("no mount namespace") != std::string::npos) GTEST_SKIP() << log;
  }
  ASSERT_EQ(first, "ready");
  ASSERT_EQ(pod.ask("alloc " + std::to_string(128 * MiB)), "ok");
  EXPECT_GE(heldIn(mig0, pod.pid()), 128 * MiB) << "the MIG device's own count";
  EXPECT_EQ(heldIn(mig1, pod.pid()), 0u);
  EXPECT_EQ(pod.ask("alloc " + std::to_string(192 * MiB)), "oom") << "alpha's limit holds in its MIG device";
  EXPECT_EQ(pod.ask("quit"), "");
  EXPECT_EQ(pod.wait(), 0);

  // MIG device 0:0 is destroyed under the broker and 0:1 takes its index: alpha's devices (gone)
  // and beta's on that MIG device (now 0:0, an index the broker's accounting no longer trusts)
  // turn Unhealthy; beta's on GPU 1 and gamma's there stay Healthy. (MIG devices are in GPU
  // instance ID order, not in the order of creation: find the instance that is 0:0.)
  int which = -1;
  nvmlDevice_t m0;
  unsigned gi0 = 0;
  ASSERT_EQ(nvmlDeviceGetHandleByUUID(mig0.c_str(), &m0), NVML_SUCCESS);
  ASSERT_EQ(nvmlDeviceGetGpuInstanceId(m0, &gi0), NVML_SUCCESS);
  for (int i = 0; i < 2; ++i) {
    nvmlGpuInstanceInfo_t info{};
    ASSERT_EQ(nvmlGpuInstanceGetInfo(gi[i], &info), NVML_SUCCESS);
    if (info.id == gi0) which = i;
  }
  ASSERT_GE(which, 0);
  drop(which);
  ASSERT_EQ(migUuid(0), mig1) << "the remaining MIG device moved to index 0";
  auto onlyGpu1 = [&](size_t n) {
    return [&gpu1, n](const FakeKubelet::Plugin& p) {
      if (p.devices.size() != n) return false;
      for (const auto& d : p.devices)
        if ((d.health() == "Healthy") != d.id().starts_with(gpu1)) return false;
      return true;
    };
  };
  EXPECT_TRUE(kubelet.waitFor("cushare.io/beta", onlyGpu1(4), 20000)) << b->log();
  EXPECT_TRUE(kubelet.waitFor("cushare.io/alpha", onlyGpu1(2), 20000)) << b->log();
  EXPECT_TRUE(kubelet.waitFor("cushare.io/gamma", onlyGpu1(6), 20000)) << b->log();
  // Another 1g: the broker's next start (the way a layout change reaches the plugin, as
  // mig.apply_at_start does it) advertises the layout as it is now.
  make(which);
  const std::string now0 = migUuid(0), now1 = migUuid(1);
  ASSERT_FALSE(now0.empty() || now1.empty());
  EXPECT_EQ(b->stop(), 0);
  b = std::make_unique<Broker>(dir);
  ASSERT_TRUE(b->start(body)) << b->log();
  EXPECT_TRUE(kubelet.waitFor("cushare.io/alpha", [&](const auto& p) {
    return healthy(p, 2) && p.devices[0].id() == now0 + "::0";
  }, 20000)) << b->log();
  EXPECT_TRUE(kubelet.waitFor("cushare.io/beta", [&](const auto& p) {
    return healthy(p, 4) && p.devices[0].id() == now1 + "::0";
  }, 20000)) << b->log();
  EXPECT_EQ(b->stop(), 0);
  std::filesystem::remove_all(dp);
}

}  // namespace
}  // namespace cushare::test
