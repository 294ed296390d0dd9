// The device plugin of the real cushare-broker on simgpu against the fake kubelet: a pod that asks
// for cushare.io/alpha gets, from Allocate, edits that make its process tenant alpha (run here with
// exactly those edits: tests/containers/cdi_spec.py applies them as a runtime would); the plugin
// registers again when the kubelet restarts; a faulted MPS server turns the devices unhealthy; a
// vanished kubelet and protocol errors leave the tenants' accounting (the broker's and the
// device's own) as it was.
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "fake_kubelet.h"
#include "harness.h"

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
  ASSERT_TRUE(b.start("kubernetes: {device_plugin_dir: " + dp + ", devices_per_gpu: 2}\n"
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
  ASSERT_TRUE(b.start("kubernetes: {device_plugin_dir: " + dp + ", devices_per_gpu: 2}\n"
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

}  // namespace
}  // namespace cushare::test
