// The device plugin of the real cushare-broker on simgpu against the fake kubelet: a pod that asks
// for cushare.io/alpha gets, from Allocate, edits that make its process tenant alpha (run here with
// exactly those edits: tests/containers/cdi_spec.py applies them as a runtime would); the plugin
// registers again when the kubelet restarts; a faulted MPS server turns the devices unhealthy; a
// vanished kubelet and protocol errors leave the tenants' accounting (the broker's and the
// device's own) as it was.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <functional>
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
// GPUs (ctest broker_plugin_mig): GPU 0 in MIG mode, GPU 1 whole. Each tenant's resource is backed
// by the devices it is placed on, Allocate gives the MIG device by UUID (and NVIDIA's CDI device by
// its index), the pod's process is held to its limit by the MIG device's own count; a layout
// changed under the broker turns the devices of the MIG devices it touched Unhealthy (the others
// stay), and the broker's next start advertises the new layout.
class BrokerPluginMig : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(nvmlInit_v2(), NVML_SUCCESS);
    ASSERT_EQ(nvmlDeviceGetHandleByIndex_v2(0, &gpu), NVML_SUCCESS);
    nvmlReturn_t act;
    ASSERT_EQ(nvmlDeviceSetMigMode(gpu, NVML_DEVICE_MIG_ENABLE, &act), NVML_SUCCESS);
    nvmlDevice_t whole;
    char u[96];
    ASSERT_EQ(nvmlDeviceGetHandleByIndex_v2(1, &whole), NVML_SUCCESS);
    ASSERT_EQ(nvmlDeviceGetUUID(whole, u, sizeof u), NVML_SUCCESS);
    gpu1 = u;
    dp = "/tmp/cushare-dp-" + std::to_string(::getpid()) + "-mig";
    std::filesystem::remove_all(dp);
  }
  void TearDown() override {  // the next test starts from MIG off (the state is the host's)
    for (auto& [g, cis] : made) {
      for (nvmlComputeInstance_t c : cis)
        if (c) EXPECT_EQ(nvmlComputeInstanceDestroy(c), NVML_SUCCESS);
      if (g) EXPECT_EQ(nvmlGpuInstanceDestroy(g), NVML_SUCCESS);
    }
    nvmlReturn_t act;
    EXPECT_EQ(nvmlDeviceSetMigMode(gpu, NVML_DEVICE_MIG_DISABLE, &act), NVML_SUCCESS);
    nvmlShutdown();
    std::filesystem::remove_all(dp);
  }
  // A GPU instance of `profile` with compute instances of `ciProfiles`; its index in `made`.
  size_t make(unsigned profile, const std::vector<unsigned>& ciProfiles) {
    made.emplace_back();
    EXPECT_EQ(nvmlDeviceCreateGpuInstance(gpu, profile, &made.back().first), NVML_SUCCESS);
    for (unsigned c : ciProfiles) {
      made.back().second.emplace_back();
      EXPECT_EQ(nvmlGpuInstanceCreateComputeInstance(made.back().first, c, &made.back().second.back()), NVML_SUCCESS);
    }
    return made.size() - 1;
  }
  std::string migUuid(unsigned index) {
    nvmlDevice_t m;
    char u[96] = "";
    if (nvmlDeviceGetMigDeviceHandleByIndex(gpu, index, &m) != NVML_SUCCESS ||
        nvmlDeviceGetUUID(m, u, sizeof u) != NVML_SUCCESS)
      return "";
    return u;
  }
  // The MIG device of compute instance `ci` of made[g] (MIG devices are in GPU instance ID order,
  // not in the order of creation).
  std::string uuidOf(size_t g, size_t ci) {
    nvmlGpuInstanceInfo_t gi{};
    nvmlComputeInstanceInfo_t c{};
    if (nvmlGpuInstanceGetInfo(made[g].first, &gi) != NVML_SUCCESS ||
        nvmlComputeInstanceGetInfo_v2(made[g].second[ci], &c) != NVML_SUCCESS)
      return "";
    for (unsigned i = 0; i < 8; ++i) {
      nvmlDevice_t m;
      unsigned g2 = 0, c2 = 0;
      if (nvmlDeviceGetMigDeviceHandleByIndex(gpu, i, &m) == NVML_SUCCESS &&
          nvmlDeviceGetGpuInstanceId(m, &g2) == NVML_SUCCESS && nvmlDeviceGetComputeInstanceId(m, &c2) == NVML_SUCCESS &&
          g2 == gi.id && c2 == c.id)
        return migUuid(i);
    }
    return "";
  }
  int indexOf(const std::string& uuid) {
    for (unsigned i = 0; i < 8; ++i)
      if (migUuid(i) == uuid) return static_cast<int>(i);
    return -1;
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
  std::vector<std::pair<nvmlGpuInstance_t, std::vector<nvmlComputeInstance_t>>> made;
  std::string gpu1, dp;
};

std::vector<std::string> idsOf(const FakeKubelet::Plugin& p) {
  std::vector<std::string> out;
  for (const auto& d : p.devices) out.push_back(d.id());
  return out;
}

// Devices of `healthyOn` Healthy, the others Unhealthy (n in all).
std::function<bool(const FakeKubelet::Plugin&)> healthyOnly(std::vector<std::string> healthyOn, size_t n) {
  return [healthyOn, n](const FakeKubelet::Plugin& p) {
    if (p.devices.size() != n) return false;
    for (const auto& d : p.devices) {
      bool on = false;
      for (const std::string& u : healthyOn) on = on || d.id().starts_with(u + "::");
      if ((d.health() == "Healthy") != on) return false;
    }
    return true;
  };
}

// Two 1g.10gb MIG devices (0:0, 0:1). A pod of alpha gets its MIG device and is held there.
TEST_F(BrokerPluginMig, APodGetsTheMigDeviceItsTenantIsPlacedOnAndIsHeldThere) {
  make(19, {NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE});  // 1g.10gb
  make(19, {NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE});
  const std::string mig0 = migUuid(0), mig1 = migUuid(1);
  ASSERT_TRUE(mig0.starts_with("MIG-") && mig1.starts_with("MIG-")) << mig0 << " " << mig1;
  FakeKubelet kubelet(dp);
  ASSERT_TRUE(kubelet.start());
  const std::string dir = testDir();
  Broker b(dir);
  ASSERT_TRUE(b.start("kubernetes: {device_plugin_dir: " + dp +
                      ", devices_per_gpu: 2, pod_resources_socket: off, gpu_cdi_device: 'nvidia.com/gpu={index}'}\n"
                      "tenants:\n  - {name: alpha, uid: 2000, memory: {'0:0': 256MiB}}\n"
                      "  - {name: beta, memory: {'0:1': 512MiB, 1: 512MiB}}\n  - {name: gamma, memory: 128MiB}\n"))
      << b.log();
  ASSERT_TRUE(kubelet.waitFor("cushare.io/alpha", [](const auto& p) { return healthy(p, 2); })) << b.log();
  ASSERT_TRUE(kubelet.waitFor("cushare.io/beta", [](const auto& p) { return healthy(p, 4); })) << b.log();
  ASSERT_TRUE(kubelet.waitFor("cushare.io/gamma", [](const auto& p) { return healthy(p, 6); })) << b.log();
  EXPECT_EQ(idsOf(kubelet.plugin("cushare.io/alpha")), (std::vector<std::string>{mig0 + "::0", mig0 + "::1"}));
  EXPECT_EQ(idsOf(kubelet.plugin("cushare.io/beta")),
            (std::vector<std::string>{mig1 + "::0", mig1 + "::1", gpu1 + "::0", gpu1 + "::1"}));

  v1beta1::AllocateResponse a;
  EXPECT_EQ(allocate(kubelet, "cushare.io/alpha", mig1 + "::0", &a).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  ASSERT_TRUE(allocate(kubelet, "cushare.io/alpha", mig0 + "::1", &a).ok());
  const auto& c = a.container_responses(0);
  EXPECT_EQ(c.envs().at("CUDA_VISIBLE_DEVICES"), mig0);
  ASSERT_EQ(c.cdi_devices_size(), 2);
  EXPECT_EQ(c.cdi_devices(0).name(), "nvidia.com/gpu=0:0");
  EXPECT_EQ(c.cdi_devices(1).name(), "cushare.io/tenant=alpha");
  // The pod's process on its tenant's own uid (docs/security.md): the container's mounts applied
  // as a runtime would, then alpha's environment from staged copies any user can read (the
  // checkout may be private), with the MIG device Allocate named.
  v1beta1::ContainerAllocateResponse mounts;
  for (const auto& m : c.mounts()) *mounts.add_mounts() = m;
  UidTenants users;
  Child pod = users.spawn(2000, WORKER_BIN, b, "alpha", {{"CUDA_VISIBLE_DEVICES", c.envs().at("CUDA_VISIBLE_DEVICES")}},
                          {}, {PYTHON3, CDI_SPEC_PY, "run", asSpec(mounts, dir + "/pod.json"), "pod", "--"});
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
  EXPECT_EQ(b.stop(), 0);
}

// The nodes a container of a MIG device needs (docs/mig.md, "Containers"): its GPU's /dev/nvidiaN
// and the nvidia-caps nodes of its GPU and compute instance, numbered as the driver's table
// numbers them (simgpu has no /proc/driver/nvidia-caps/mig-minors: the driver's fixed numbering,
// written out here independently), come from cushare itself: the device plugin gives them as
// device specs when no gpu_cdi_device names NVIDIA's CDI device, and the CDI spec has a device per
// tenant and MIG device it is placed on, "<tenant>:<gpu>:<mig>". A process run with exactly that
// CDI device's edits, as uid 2000, lands in its MIG device with nothing else set and is held to
// its tenant's limit there by the MIG device's own count.
TEST_F(BrokerPluginMig, WithoutNvidiasCdiDeviceTheMigDevicesNodesComeFromCushare) {
  const size_t g0 = make(19, {NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE});
  const size_t g1 = make(19, {NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE});
  const std::string m0 = uuidOf(g0, 0), m1 = uuidOf(g1, 0);
  ASSERT_FALSE(m0.empty() || m1.empty());
  unsigned minor = 99;
  ASSERT_EQ(nvmlDeviceGetMinorNumber(gpu, &minor), NVML_SUCCESS);
  const auto nodesOf = [&](const std::string& uuid) {
    nvmlDevice_t m;
    unsigned gi = 0, ci = 0;
    EXPECT_EQ(nvmlDeviceGetHandleByUUID(uuid.c_str(), &m), NVML_SUCCESS);
    EXPECT_EQ(nvmlDeviceGetGpuInstanceId(m, &gi), NVML_SUCCESS);
    EXPECT_EQ(nvmlDeviceGetComputeInstanceId(m, &ci), NVML_SUCCESS);
    const unsigned access = 3 + (minor * 15 + gi) * 9;  // "gpuM/giG/access", then its 8 CIs' lines
    return std::vector<std::string>{"/dev/nvidia" + std::to_string(minor),
                                    "/dev/nvidia-caps/nvidia-cap" + std::to_string(access),
                                    "/dev/nvidia-caps/nvidia-cap" + std::to_string(access + 1 + ci)};
  };
  const std::string i0 = "0:" + std::to_string(indexOf(m0)), i1 = "0:" + std::to_string(indexOf(m1));
  FakeKubelet kubelet(dp);
  ASSERT_TRUE(kubelet.start());
  const std::string dir = testDir();
  Broker b(dir);
  ASSERT_TRUE(b.start("kubernetes: {device_plugin_dir: " + dp + ", devices_per_gpu: 1, pod_resources_socket: off}\n"
                      "tenants:\n  - {name: alpha, uid: 2000, memory: {" + m0 + ": 256MiB}}\n"
                      "  - {name: beta, memory: 128MiB}\n"))
      << b.log();
  ASSERT_TRUE(kubelet.waitFor("cushare.io/alpha", [](const auto& p) { return healthy(p, 1); })) << b.log();
  v1beta1::AllocateResponse a;
  ASSERT_TRUE(allocate(kubelet, "cushare.io/alpha", m0 + "::0", &a).ok());
  std::vector<std::string> given;
  for (const auto& d : a.container_responses(0).devices()) given.push_back(d.host_path());
  EXPECT_EQ(given, nodesOf(m0)) << b.log();

  // The CDI spec: valid by CDI's rules, a device per tenant and MIG device it is placed on.
  const std::string spec = dir + "/cdi/cushare.io-tenant.json", log = dir + "/check.log";
  const int st = std::system((PYTHON3 " " CDI_SPEC_PY " check " + spec + " --max-version 0.5.0 >" + log + " 2>&1").c_str());
  std::ifstream in(spec);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(st, 0) << text;
  for (const std::string& name : {"alpha:" + i0, "beta:" + i0, "beta:" + i1})
    EXPECT_NE(text.find("\"name\": \"" + name + "\""), std::string::npos) << name << "\n" << text;
  EXPECT_EQ(text.find("\"name\": \"alpha:" + i1 + "\""), std::string::npos) << "alpha is not placed on " << i1;
  const size_t at = text.find("\"name\": \"alpha:" + i0 + "\"");
  const std::string dev = text.substr(at, text.find("\"name\"", at + 10) - at);
  for (const std::string& node : nodesOf(m0))
    EXPECT_NE(dev.find("{\"path\": \"" + node + "\"}"), std::string::npos) << node << "\n" << dev;
  EXPECT_NE(dev.find("\"CUDA_VISIBLE_DEVICES=" + m0 + "\""), std::string::npos) << dev;

  // A process with exactly alpha:<mig>'s edits (simgpu has no device nodes to check), as uid 2000.
  UidTenants users;
  Child pod = users.spawn(2000, WORKER_BIN, b, "alpha", {}, {},
                          {PYTHON3, CDI_SPEC_PY, "run", spec, "alpha:" + i0, "--nodes-absent-ok", "--"});
  const std::string first = pod.readLine();
  if (first.empty() && std::ifstream(dir + "/tenants.log").peek() != EOF) {
    std::ifstream tl(dir + "/tenants.log");
    const std::string tlog((std::istreambuf_iterator<char>(tl)), std::istreambuf_iterator<char>());
    if (tlog.find("no mount namespace") != std::string::npos) GTEST_SKIP() << tlog;
  }
  ASSERT_EQ(first, "ready");
  ASSERT_EQ(pod.ask("alloc " + std::to_string(128 * MiB)), "ok");
  EXPECT_GE(heldIn(m0, pod.pid()), 128 * MiB) << "the MIG device's own count";
  EXPECT_EQ(heldIn(m1, pod.pid()), 0u);
  EXPECT_EQ(pod.ask("alloc " + std::to_string(192 * MiB)), "oom") << "alpha's limit holds in its MIG device";
  EXPECT_EQ(pod.ask("quit"), "");
  EXPECT_EQ(pod.wait(), 0);
  EXPECT_EQ(b.stop(), 0);
}

// A reload that moves a tenant off a device: its resource loses the device (the limit there is
// lifted after the resource no longer offers it); a reload the broker refuses leaves the resource
// as the configuration in force places it (the plugin narrows it before the broker decides).
TEST_F(BrokerPluginMig, AReloadMovesTheResourceAndARefusedOneLeavesIt) {
  make(19, {NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE});
  make(19, {NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE});
  const std::string mig0 = migUuid(0);
  FakeKubelet kubelet(dp);
  ASSERT_TRUE(kubelet.start());
  const std::string dir = testDir();
  const std::string head = "kubernetes: {device_plugin_dir: " + dp +
                           ", devices_per_gpu: 1, pod_resources_socket: off, gpu_cdi_device: 'nvidia.com/gpu={uuid}'}\n";
  Broker b(dir);
  ASSERT_TRUE(b.start(head + "tenants:\n  - {name: alpha, memory: {'0:0': 256MiB, 1: 256MiB}}\n")) << b.log();
  const std::vector<std::string> both = {mig0 + "::0", gpu1 + "::0"}, gpuOnly = {gpu1 + "::0"};
  ASSERT_TRUE(kubelet.waitFor("cushare.io/alpha", [&](const auto& p) { return healthy(p, 2) && idsOf(p) == both; }))
      << b.log();
  // Refused (ledger_dir cannot change on reload), though the file loads: alpha keeps both.
  std::string moved = brokerConfig(dir, head + "tenants:\n  - {name: alpha, memory: {1: 256MiB}}\n");
  std::string refused = moved;
  refused.replace(refused.find("/ledgers\n"), 9, "/elsewhere\n");
  std::ofstream(dir + "/config.yaml") << refused;
  EXPECT_FALSE(b.reload().ok());
  EXPECT_TRUE(b.logHas("reload refused")) << b.log();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // several list periods
  EXPECT_TRUE(kubelet.waitFor("cushare.io/alpha", [&](const auto& p) { return idsOf(p) == both; })) << b.log();
  // Accepted: alpha leaves 0:0.
  std::ofstream(dir + "/config.yaml") << moved;
  ASSERT_TRUE(b.reload().ok()) << b.log();
  EXPECT_TRUE(kubelet.waitFor("cushare.io/alpha", [&](const auto& p) { return idsOf(p) == gpuOnly; })) << b.log();
  EXPECT_TRUE(b.logHas("tenant alpha: the reload lifts its memory limit on device 0:0")) << b.log();
  v1beta1::AllocateResponse a;
  EXPECT_EQ(allocate(kubelet, "cushare.io/alpha", mig0 + "::0", &a).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(b.stop(), 0);
}

// A 3g.40gb split into two compute instances (sharing its memory) and a 1g.10gb. One compute
// instance of the 3g is destroyed under the broker: the devices of its sibling turn Unhealthy
// (the broker stops reading their GPU instance's accounting) though the sibling kept its index, and
// so do those of any MIG device renumbered; GPU 1's stay Healthy. The next start advertises the
// layout as it is then.
TEST_F(BrokerPluginMig, ALayoutChangedUnderTheBrokerTurnsWhatItTouchedUnhealthy) {
  const size_t g3 = make(9, {NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE, NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE});
  const size_t g1 = make(19, {NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE});
  const std::string a = uuidOf(g3, 0), gone = uuidOf(g3, 1), small = uuidOf(g1, 0);
  ASSERT_FALSE(a.empty() || gone.empty() || small.empty());
  ASSERT_LT(indexOf(a), indexOf(gone)) << "the 2c comes first in its GPU instance: it keeps its index";
  FakeKubelet kubelet(dp);
  ASSERT_TRUE(kubelet.start());
  const std::string dir = testDir();
  // A broker that does not start again on the new layout (mig.follow_layout: false; one that does
  // is TheBrokerStartsAgainOnAChangedLayout, below).
  const std::string body = "mig: {follow_layout: false}\n"
                           "kubernetes: {device_plugin_dir: " + dp + ", devices_per_gpu: 1, pod_resources_socket: off}\n"
                           "tenants:\n  - {name: alpha, memory: {" + a + ": 1GiB}}\n"
                           "  - {name: beta, memory: {" + small + ": 1GiB}}\n  - {name: gamma, memory: {1: 1GiB}}\n"
                           "  - {name: delta, memory: 128MiB}\n";
  auto b = std::make_unique<Broker>(dir);
  ASSERT_TRUE(b->start(body)) << b->log();
  ASSERT_TRUE(kubelet.waitFor("cushare.io/delta", [](const auto& p) { return healthy(p, 4); })) << b->log();
  const int smallBefore = indexOf(small), aBefore = indexOf(a);
  EXPECT_TRUE(b->logHas("is limited on some devices only")) << "placement without gpu_cdi_device is warned about";

  ASSERT_EQ(nvmlComputeInstanceDestroy(made[g3].second[1]), NVML_SUCCESS);
  made[g3].second[1] = nullptr;
  ASSERT_EQ(indexOf(a), aBefore) << "alpha's MIG device kept its index: only its GPU instance changed";
  const bool smallMoved = indexOf(small) != smallBefore;
  std::printf("the 1g.10gb was MIG device 0:%d and is 0:%d\n", smallBefore, indexOf(small));
  std::vector<std::string> ok = {gpu1};
  if (!smallMoved) ok.push_back(small);
  EXPECT_TRUE(kubelet.waitFor("cushare.io/alpha", healthyOnly(ok, 1), 20000)) << b->log();
  EXPECT_TRUE(kubelet.waitFor("cushare.io/delta", healthyOnly(ok, 4), 20000)) << b->log();
  EXPECT_TRUE(kubelet.waitFor("cushare.io/gamma", healthyOnly(ok, 1), 20000)) << b->log();
  EXPECT_TRUE(kubelet.waitFor("cushare.io/beta", healthyOnly(ok, 1), 20000)) << b->log();

  // The next start: the 3g has one MIG device now.
  EXPECT_EQ(b->stop(), 0);
  b = std::make_unique<Broker>(dir);
  ASSERT_TRUE(b->start(body)) << b->log();
  EXPECT_TRUE(kubelet.waitFor("cushare.io/delta", [](const auto& p) { return healthy(p, 3); }, 20000)) << b->log();
  EXPECT_TRUE(kubelet.waitFor("cushare.io/alpha", [&](const auto& p) {
    return healthy(p, 1) && p.devices[0].id() == a + "::0";
  }, 20000)) << b->log();
  EXPECT_EQ(b->stop(), 0);
}

// A layout changed under a running broker (docs/mig.md, "When the layout changes"; the default
// mig.follow_layout): the broker starts again on it in the same process (same pid, no exit): the
// device plugin advertises the new MIG device, the CDI spec names it, `cushare status` lists it;
// a tenant process running across it keeps its memory and its limit (the MIG device's own count).
// A layout the configuration does not fit is refused with the reason, and the broker goes on.
TEST_F(BrokerPluginMig, TheBrokerStartsAgainOnAChangedLayout) {
  const size_t g0 = make(19, {NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE});
  const std::string m0 = uuidOf(g0, 0);
  ASSERT_FALSE(m0.empty());
  FakeKubelet kubelet(dp);
  ASSERT_TRUE(kubelet.start());
  const std::string dir = testDir();
  Broker b(dir);
  // With a declarative layout applied at start (the one made above): a start on a followed layout
  // does not apply it (the change was made on purpose), and the --check that judges it first
  // knows that (its dry run would refuse: a process runs on GPU 0).
  ASSERT_TRUE(b.start("mig: {apply_at_start: true, layout: [{devices: [0], mig-enabled: true, "
                      "mig-devices: {1g.10gb: 1}}]}\n"
                      "kubernetes: {device_plugin_dir: " + dp + ", devices_per_gpu: 1, pod_resources_socket: off}\n"
                      "tenants:\n  - {name: alpha, uid: 2000, memory: {" + m0 + ": 256MiB}}\n"
                      "  - {name: beta, memory: 128MiB}\n"))
      << b.log();
  ASSERT_TRUE(kubelet.waitFor("cushare.io/beta", [](const auto& p) { return healthy(p, 2); })) << b.log();
  const pid_t pid = b.pid();
  const auto openFds = [&] {
    size_t n = 0;
    std::error_code ec;
    for (auto it = std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd", ec);
         !ec && it != std::filesystem::directory_iterator(); it.increment(ec))
      ++n;
    return n;
  };
  const size_t fdsBefore = openFds();
  UidTenants users;
  Child pod = users.spawn(2000, WORKER_BIN, b, "alpha", {{"CUDA_VISIBLE_DEVICES", m0}});
  ASSERT_EQ(pod.readLine(), "ready");
  ASSERT_EQ(pod.ask("alloc " + std::to_string(128 * MiB)), "ok");

  // While a `cushare mig apply` holds the layout lock (an flock beside state_file), the broker
  // does not follow: the layout may be half-way.
  const int lock = ::open((dir + "/broker.state.mig-lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  ASSERT_GE(lock, 0);
  ASSERT_EQ(::flock(lock, LOCK_EX), 0);
  const size_t g1 = make(19, {NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE});  // a new MIG device
  const std::string m1 = uuidOf(g1, 0);
  ASSERT_FALSE(m1.empty());
  const std::string i1 = "0:" + std::to_string(indexOf(m1));
  EXPECT_TRUE(b.logHas("mig: the MIG layout changed; waiting to follow it: ", 20000)) << b.log();
  EXPECT_FALSE(b.logHas("mig: the MIG layout changed (was: ", 0)) << b.log();
  ::close(lock);
  EXPECT_TRUE(kubelet.waitFor("cushare.io/beta", [&](const auto& p) {
    return healthy(p, 3) && std::any_of(p.devices.begin(), p.devices.end(), [&](const auto& d) { return d.id() == m1 + "::0"; });
  }, 30000)) << b.log();
  EXPECT_TRUE(b.logHas("mig: the MIG layout changed (was: ")) << b.log();
  EXPECT_TRUE(b.logHas("mig.apply_at_start is not run now")) << b.log();
  EXPECT_EQ(b.pid(), pid);
  EXPECT_EQ(::kill(pid, 0), 0) << "the same process, still running";
  ASSERT_TRUE(eventually([&] { return b.status().devices_size() == 3; }, 10000)) << b.log();
  EXPECT_LE(openFds(), fdsBefore + 2) << "nothing of the image before stays open in the new one";
  std::ifstream in(dir + "/cdi/cushare.io-tenant.json");
  const std::string spec((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(spec.find("\"name\": \"beta:" + i1 + "\""), std::string::npos) << spec;
  EXPECT_GE(heldIn(m0, pod.pid()), 128 * MiB) << "the tenant's memory, by the MIG device's own count";
  EXPECT_EQ(pod.ask("alloc " + std::to_string(192 * MiB)), "oom") << "its limit holds across the new start";
  EXPECT_EQ(pod.ask("alloc " + std::to_string(64 * MiB)), "ok");

  // A layout the configuration does not fit (alpha's MIG device gone: its key names nothing) is
  // refused with the reason; the broker goes on with the devices it has.
  EXPECT_EQ(pod.ask("quit"), "");
  EXPECT_EQ(pod.wait(), 0);
  const std::string i0 = "0:" + std::to_string(indexOf(m0));
  const auto specNow = [&] {
    std::ifstream f(dir + "/cdi/cushare.io-tenant.json");
    return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  };
  EXPECT_NE(specNow().find("\"name\": \"alpha:" + i0 + "\""), std::string::npos) << specNow();
  ASSERT_EQ(nvmlComputeInstanceDestroy(made[g0].second[0]), NVML_SUCCESS);
  made[g0].second[0] = nullptr;
  // At once: the gone device's CDI devices go (their nodes would be another instance's).
  EXPECT_TRUE(eventually([&] { return specNow().find("\"name\": \"alpha:" + i0 + "\"") == std::string::npos; }, 10000))
      << specNow();
  EXPECT_TRUE(b.logHas("mig: the MIG layout changed, but the configuration does not fit it: ", 30000)) << b.log();
  EXPECT_TRUE(b.logHas(m0)) << b.log();
  EXPECT_EQ(b.status().devices_size(), 3) << "the broker keeps its list";
  EXPECT_EQ(b.stop(), 0);
}

}  // namespace
}  // namespace cushare::test
