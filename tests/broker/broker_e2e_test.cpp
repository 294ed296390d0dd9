// End-to-end tests of cushare-broker on simgpu: real broker process, real tenant processes under
// the shim, the control socket. Each suite runs as its own CTest test (tests/broker/CMakeLists.txt).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <fcntl.h>
#include <sys/file.h>
#include <grp.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <regex>
#include <thread>
#include <tuple>

#include "fd_passing.h"
#include "harness.h"
#include "cushare/ledger.h"
#include "simgpu/nvml.h"
#include "rpc/codec.h"

namespace cushare::test {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

const std::string kTwoTenants =
    "unknown_tenants: refuse\n"
    "profiles:\n"
    "  balanced: {memory: 25%, thread_percentage: 25, priority: normal}\n"
    "tenants:\n"
    "  - {name: alpha, memory: 512MiB, thread_percentage: 30, priority: high}\n"
    "  - {name: beta, profile: balanced}\n";

// The tenant's ledger, opened as the broker does (no slot): to look at it or write it as a process
// of the tenant could.
std::unique_ptr<Ledger> observe(const std::string& dir, const std::string& tenant) {
  std::string err;
  LedgerOpenOptions o;
  o.createFile = false;
  o.createDir = false;
  o.claimSlot = false;
  auto ledger = Ledger::open(dir, tenant, o, &err);
  EXPECT_TRUE(ledger) << err;
  return ledger;
}

// The slot of tenant's ledger holding exactly `bytes` on its first device entry; -1 if none.
int slotHolding(Broker& b, const std::string& tenant, uint64_t bytes) {
  auto ledger = observe(b.ledgerDir(), tenant);
  if (!ledger) return -1;
  for (const Ledger::SlotUsage& u : ledger->slots())
    if (u.used[0] == bytes) return u.slot;
  return -1;
}

// ---- Ledgers, admission, the environment ----

TEST(Basics, CreatesLedgersAndHostSegment) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kTwoTenants)) << b.log();
  struct stat st;
  ASSERT_EQ(::stat(b.ledgerDir().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0711u) << "tenants must not list each other's ledgers";
  ASSERT_EQ(::stat((b.ledgerDir() + "/alpha.ledger").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  ASSERT_EQ(::stat((b.ledgerDir() + "/host.segment").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0644u);
  const rpc::StatusReply s = b.status();
  EXPECT_EQ(s.tenants(), 2u);
  EXPECT_EQ(s.config_generation(), 1u);
  ASSERT_EQ(s.devices_size(), 1);
  EXPECT_EQ(s.devices(0).capacity_bytes(), 4096 * MiB);
  EXPECT_EQ(limitOn0(b.tenant("alpha")), 512 * MiB);
  EXPECT_EQ(limitOn0(b.tenant("beta")), 1024 * MiB) << "25% of 4 GiB";
  EXPECT_EQ(b.tenant("alpha").priority(), "high");
}

TEST(Basics, TenantStoppedAtItsLimitWhileTheOtherProceeds) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kTwoTenants)) << b.log();
  Child alpha = b.tenantProcess("alpha");
  Child beta = b.tenantProcess("beta");
  EXPECT_EQ(alpha.ask("fill " + std::to_string(64 * MiB)), "held " + std::to_string(512 * MiB));
  EXPECT_EQ(beta.ask("fill " + std::to_string(64 * MiB)), "held " + std::to_string(1024 * MiB));
  EXPECT_EQ(usedOn0(b.tenant("alpha")), 512 * MiB);
  EXPECT_EQ(b.tenant("alpha").devices(0).denied(), 1u);
  EXPECT_EQ(b.tenant("alpha").processes(), 1u);
  EXPECT_EQ(alpha.ask("info"), "free 0 total " + std::to_string(512 * MiB)) << "the tenant's view";
}

TEST(Basics, UnknownTenantIsRefused) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kTwoTenants)) << b.log();
  std::string first;
  Child c = b.tenantProcess("gamma", {}, &first);
  EXPECT_EQ(first, "init-failed 3") << "CUDA_ERROR_NOT_INITIALIZED";
  std::ifstream log(b.dir() + "/tenants.log");
  std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("tenant 'gamma': not a tenant of this host's broker"), std::string::npos) << text;
  EXPECT_FALSE(std::filesystem::exists(b.ledgerDir() + "/gamma.ledger"));
}

TEST(Basics, DamagedHostSegmentFailsClosed) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kTwoTenants)) << b.log();
  b.stop();
  std::ofstream(b.ledgerDir() + "/host.segment", std::ios::binary | std::ios::trunc) << "not a segment";
  std::string first;
  Child c = b.tenantProcess("alpha", {}, &first);
  EXPECT_EQ(first, "init-failed 3") << "never unlimited, never standalone";
  std::ifstream log(b.dir() + "/tenants.log");
  std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("host.segment: field 'magic' does not read"), std::string::npos) << text;
}

TEST(Basics, EnvironmentMayLowerTheLimitNeverRaiseIt) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kTwoTenants)) << b.log();
  Child high = b.tenantProcess("alpha", {{"CUSHARE_MEMORY_LIMIT", "2GiB"}});
  EXPECT_EQ(high.ask("fill " + std::to_string(64 * MiB)), "held " + std::to_string(512 * MiB));
  EXPECT_EQ(high.ask("freeall"), "ok");
  Child low = b.tenantProcess("alpha", {{"CUSHARE_MEMORY_LIMIT", "128MiB"}});
  EXPECT_EQ(low.ask("fill " + std::to_string(64 * MiB)), "held " + std::to_string(128 * MiB));
  EXPECT_EQ(low.ask("info"), "free 0 total " + std::to_string(128 * MiB));
  EXPECT_EQ(limitOn0(b.tenant("alpha")), 512 * MiB) << "the environment never changes the ledger";
}

TEST(Basics, UnknownTenantGetsTheProfile) {
  Broker b(testDir());
  ASSERT_TRUE(b.start("unknown_tenants: small\nprofiles:\n  small: {memory: 256MiB}\n"
                      "tenants:\n  - {name: alpha, memory: 512MiB}\n"))
      << b.log();
  struct stat st;
  ASSERT_EQ(::stat(b.ledgerDir().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 01733u);
  Child z = b.tenantProcess("zeta");
  EXPECT_EQ(z.ask("fill " + std::to_string(64 * MiB)), "held " + std::to_string(256 * MiB));
  const auto start = Clock::now();
  // Adopted once the broker sees the file; its device entry follows at a later tick when the
  // adoption found the shim still creating it (the entry's lock busy).
  while ((b.tenant("zeta").source().empty() || b.tenant("zeta").devices_size() == 0) &&
         Clock::now() - start < std::chrono::seconds(5))
    std::this_thread::sleep_for(milliseconds(5));
  const rpc::Tenant t = b.tenant("zeta");
  EXPECT_EQ(t.source(), "unknown-tenant");
  EXPECT_EQ(t.profile(), "small");
  EXPECT_EQ(usedOn0(t), 256 * MiB);
  EXPECT_EQ(limitOn0(t), 256 * MiB);
}

TEST(Basics, MetricsEndpoint) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kTwoTenants)) << b.log();
  Child alpha = b.tenantProcess("alpha");
  ASSERT_EQ(alpha.ask("alloc " + std::to_string(96 * MiB)), "ok");
  const std::string body = b.metrics();
  EXPECT_EQ(body.find(" 200 OK\r\n"), 8u) << body.substr(0, 200);
  EXPECT_NE(body.find("cushare_tenant_memory_used_bytes{tenant=\"alpha\",device=\"0\",uuid=\"" + kDevice0Uuid + "\"} " +
                      std::to_string(96 * MiB) + "\n"),
            std::string::npos)
      << body;
  EXPECT_NE(body.find("cushare_tenant_memory_limit_bytes{tenant=\"alpha\",device=\"0\",uuid=\"" + kDevice0Uuid + "\"} " +
                      std::to_string(512 * MiB) + "\n"),
            std::string::npos);
  EXPECT_NE(body.find("cushare_tenant_processes{tenant=\"alpha\"} 1\n"), std::string::npos);
  EXPECT_NE(body.find("cushare_broker_up 1\n"), std::string::npos);
}

// ---- Many processes at once ----

TEST(Load, ThirtyTwoProcessesAcrossFourTenants) {
  Broker b(testDir());
  ASSERT_TRUE(b.start("tenants:\n"
                      "  - {name: t0, memory: 256MiB}\n  - {name: t1, memory: 384MiB}\n"
                      "  - {name: t2, memory: 512MiB}\n  - {name: t3, memory: 640MiB}\n"))
      << b.log();
  const std::vector<uint64_t> limits = {256 * MiB, 384 * MiB, 512 * MiB, 640 * MiB};
  std::vector<Child> procs;
  for (int i = 0; i < 32; ++i) procs.push_back(b.tenantProcess("t" + std::to_string(i % 4)));
  // Every process churns 16 MiB blocks, up to 8 each (128 MiB), so each tenant of 8 processes asks
  // for up to 1 GiB at once: all tenants are pressed against their limits.
  for (Child& c : procs) ASSERT_TRUE(c.send("churn " + std::to_string(16 * MiB) + " 8 1500"));
  std::atomic<bool> done{false};
  std::vector<uint64_t> maxSeen(4, 0);
  std::thread sampler([&] {
    while (!done) {
      for (int t = 0; t < 4; ++t) maxSeen[t] = std::max(maxSeen[t], usedOn0(b.tenant("t" + std::to_string(t))));
      std::this_thread::sleep_for(milliseconds(2));
    }
  });
  uint64_t oks = 0, ooms = 0;
  std::vector<uint64_t> held(4, 0);
  for (size_t i = 0; i < procs.size(); ++i) {
    const std::string r = procs[i].readLine(60000);
    ASSERT_EQ(r.rfind("churned ", 0), 0u) << r;
    oks += field(r, 1);
    ooms += field(r, 2);
    held[i % 4] += field(r, 4);
  }
  done = true;
  sampler.join();
  for (int t = 0; t < 4; ++t) {
    const rpc::Tenant s = b.tenant("t" + std::to_string(t));
    // The exact guarantee: every granted reservation saw a total within the limit (the peak).
    // A sample of `used` may also include other processes' intents that are about to be
    // retracted (announce, then validate; docs/ledger-abi.md): at most one 16 MiB block per
    // process of the tenant.
    EXPECT_LE(s.devices(0).peak_bytes(), limits[t]) << "t" << t;
    EXPECT_LE(maxSeen[t], limits[t] + 8 * 16 * MiB) << "t" << t;
    EXPECT_EQ(usedOn0(s), held[t]) << "the ledger holds exactly what the processes hold";
    EXPECT_EQ(s.processes(), 8u);
  }
  EXPECT_GT(oks, 0u);
  EXPECT_GT(ooms, 0u) << "the limits were reached";
  for (Child& c : procs) c.send("quit");
  for (Child& c : procs) EXPECT_EQ(c.wait(), 0);
  for (int t = 0; t < 4; ++t) EXPECT_EQ(usedOn0(b.tenant("t" + std::to_string(t))), 0u);
}

// ---- Reaping ----

// Processes holding memory are killed with SIGKILL, one at a time, while nobody allocates: the
// broker alone returns each one's quota. The time from the kernel reporting the death (waitpid) to
// the broker's ledger showing the usage gone is measured for every kill.
TEST(Reaping, KillStormReturnsQuotaWithin100ms) {
  Broker b(testDir());
  ASSERT_TRUE(b.start("tenants:\n  - {name: alpha, memory: 2GiB}\n  - {name: beta, memory: 1GiB}\n")) << b.log();
  constexpr int kProcs = 24;
  std::vector<Child> procs;
  uint64_t expect[2] = {0, 0};
  for (int i = 0; i < kProcs; ++i) {
    procs.push_back(b.tenantProcess(i % 2 ? "beta" : "alpha"));
    ASSERT_EQ(procs.back().ask("alloc " + std::to_string(32 * MiB)), "ok");
    expect[i % 2] += 32 * MiB;
  }
  std::vector<int> order(kProcs);
  for (int i = 0; i < kProcs; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), std::mt19937(42));
  std::vector<double> latencyMs;
  for (int i : order) {
    procs[i].kill(SIGKILL);
    ASSERT_NE(procs[i].wait(), -1);
    const auto dead = Clock::now();
    expect[i % 2] -= 32 * MiB;
    const std::string name = i % 2 ? "beta" : "alpha";
    // Polled every millisecond: back-to-back requests took CPU from the broker's reaper on 2 cores.
    while (usedOn0(b.tenant(name)) != expect[i % 2] && Clock::now() - dead < std::chrono::seconds(5))
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    latencyMs.push_back(std::chrono::duration<double, std::milli>(Clock::now() - dead).count());
    ASSERT_EQ(usedOn0(b.tenant(name)), expect[i % 2]) << "not returned within 5 s";
  }
  std::sort(latencyMs.begin(), latencyMs.end());
  const double median = latencyMs[latencyMs.size() / 2], p90 = latencyMs[latencyMs.size() * 9 / 10],
               worst = latencyMs.back();
  std::printf("reaping latency over %d kills: median %.2f ms, 90th percentile %.2f ms, worst %.2f ms\n", kProcs,
              median, p90, worst);
  EXPECT_LT(median, 100.0);
  EXPECT_LT(p90, 100.0);
  // The worst case on a loaded 2-core CI machine includes scheduling delays; the design bound is
  // one 50 ms tick after the death, which the median shows.
  EXPECT_LT(worst, 500.0);
  EXPECT_EQ(b.status().reaped_processes(), static_cast<uint64_t>(kProcs));
  EXPECT_EQ(usedOn0(b.tenant("alpha")), 0u);
  EXPECT_EQ(usedOn0(b.tenant("beta")), 0u);
}

// A storm: many processes of two tenants killed at the same moment, while the survivors keep
// allocating and freeing. Nothing may leak and the dead processes' quota must come back at once.
TEST(Reaping, SimultaneousKillsUnderLoadLeakNothing) {
  Broker b(testDir());
  ASSERT_TRUE(b.start("tenants:\n  - {name: alpha, memory: 2GiB}\n  - {name: beta, memory: 1GiB}\n")) << b.log();
  for (int round = 0; round < 3; ++round) {
    std::vector<Child> victims, churners;
    for (int i = 0; i < 12; ++i) {
      victims.push_back(b.tenantProcess(i % 2 ? "beta" : "alpha"));
      ASSERT_EQ(victims.back().ask("alloc " + std::to_string(16 * MiB)), "ok");
    }
    for (int i = 0; i < 4; ++i) churners.push_back(b.tenantProcess(i % 2 ? "beta" : "alpha"));
    for (Child& c : churners) ASSERT_TRUE(c.send("churn " + std::to_string(4 * MiB) + " 4 400"));
    for (Child& v : victims) v.kill(SIGKILL);
    for (Child& v : victims) ASSERT_NE(v.wait(), -1);
    const auto dead = Clock::now();
    // The churners still hold up to 4 blocks each; when they report, compare exactly.
    uint64_t held[2] = {0, 0};
    for (size_t i = 0; i < churners.size(); ++i) {
      const std::string r = churners[i].readLine(60000);
      ASSERT_EQ(r.rfind("churned ", 0), 0u) << r;
      held[i % 2] += field(r, 4);
    }
    EXPECT_EQ(usedOn0(b.tenant("alpha")), held[0]) << "round " << round;
    EXPECT_EQ(usedOn0(b.tenant("beta")), held[1]) << "round " << round;
    EXPECT_LT(Clock::now() - dead, std::chrono::seconds(5));
    for (Child& c : churners) c.send("quit");
    for (Child& c : churners) EXPECT_EQ(c.wait(), 0);
  }
  EXPECT_EQ(usedOn0(b.tenant("alpha")), 0u);
  EXPECT_EQ(usedOn0(b.tenant("beta")), 0u);
  EXPECT_GE(b.status().reaped_processes(), 36u);
}

// ---- Broker restarts ----

TEST(Restart, BrokerKilledDuringLoadLosesNothing) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kTwoTenants)) << b.log();
  ASSERT_TRUE(b.setLimit("alpha", "640MiB").ok());
  std::vector<Child> churners, holders;
  for (int i = 0; i < 6; ++i) churners.push_back(b.tenantProcess(i % 2 ? "beta" : "alpha"));
  for (int i = 0; i < 4; ++i) holders.push_back(b.tenantProcess(i % 2 ? "beta" : "alpha"));
  for (Child& c : churners) ASSERT_TRUE(c.send("churn " + std::to_string(8 * MiB) + " 8 3000"));
  for (Child& h : holders) ASSERT_EQ(h.ask("alloc " + std::to_string(64 * MiB)), "ok");
  std::this_thread::sleep_for(milliseconds(300));
  b.kill9();
  // Without a broker, tenants keep working and keep their limits; a process killed now is
  // returned by the next reservation that needs the room (or by the restarted broker).
  Child extra = b.tenantProcess("alpha");
  EXPECT_EQ(extra.ask("alloc " + std::to_string(16 * MiB)), "ok") << "tenants never stall on the broker";
  holders[0].kill(SIGKILL);
  holders[0].wait();
  std::this_thread::sleep_for(milliseconds(300));
  ASSERT_TRUE(b.startWithFile()) << b.log();
  uint64_t held[2] = {0, 0};
  for (size_t i = 0; i < churners.size(); ++i) {
    const std::string r = churners[i].readLine(60000);
    ASSERT_EQ(r.rfind("churned ", 0), 0u) << r;
    held[i % 2] += field(r, 4);
  }
  held[1] += 64 * MiB * 2;  // holders 1 and 3 (beta)
  held[0] += 64 * MiB;      // holder 2 (alpha); holder 0 was killed
  held[0] += 16 * MiB;      // extra
  const auto start = Clock::now();
  while (usedOn0(b.tenant("alpha")) != held[0] && Clock::now() - start < std::chrono::seconds(2)) {
  }
  EXPECT_EQ(usedOn0(b.tenant("alpha")), held[0]);
  EXPECT_EQ(usedOn0(b.tenant("beta")), held[1]);
  EXPECT_EQ(b.tenant("alpha").processes(), 3u + 1u + 1u);
  EXPECT_EQ(limitOn0(b.tenant("alpha")), 640 * MiB) << "a live limit survives a restart";
  EXPECT_TRUE(b.tenant("alpha").devices(0).overridden());
}

// The limits a process enforces live in the broker's limits file for its ledger (limits_file.h).
// A restarted broker keeps that file: processes that ran across the restart, and one started
// while no broker ran, follow a live change made after it. (Had the broker made a new file, their
// mappings would keep the old limits.) A ledger's file goes when the broker lets go of the ledger.
TEST(Restart, ProcessesAcrossARestartFollowLiveLimits) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kTwoTenants)) << b.log();
  Child before = b.tenantProcess("alpha");
  ASSERT_EQ(before.ask("alloc " + std::to_string(64 * MiB)), "ok");
  b.kill9();
  Child during = b.tenantProcess("alpha");
  ASSERT_EQ(during.ask("alloc " + std::to_string(16 * MiB)), "ok") << "the limits file outlives the broker";
  ASSERT_TRUE(b.startWithFile()) << b.log();
  ASSERT_TRUE(b.setLimit("alpha", "100MiB").ok());
  for (Child* c : {&before, &during}) {
    const std::string view = c->ask("info");
    EXPECT_EQ(view.substr(view.find("total")), "total " + std::to_string(100 * MiB)) << view;
    EXPECT_EQ(c->ask("alloc " + std::to_string(32 * MiB)), "oom");
  }
  EXPECT_EQ(during.ask("alloc " + std::to_string(20 * MiB)), "ok");
  size_t files = 0;
  for (const auto& e : std::filesystem::directory_iterator(b.ledgerDir() + "/limits")) files += e.is_regular_file();
  EXPECT_EQ(files, 2u) << "one per ledger";
}

// A damaged ledger found at start is reported for that tenant; the others are managed as usual.
TEST(Restart, DamagedLedgerIsReportedNotFatal) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kTwoTenants)) << b.log();
  b.stop();
  {
    std::fstream f(b.ledgerDir() + "/alpha.ledger", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(8);
    f.write("\x07\x00\x00\x00", 4);  // version 7
  }
  ASSERT_TRUE(b.startWithFile()) << b.log();
  const rpc::Tenant alpha = b.tenant("alpha");
  EXPECT_NE(alpha.error().find("field 'version' is 7, expected 3"), std::string::npos) << alpha.error();
  EXPECT_EQ(alpha.devices_size(), 0);
  std::string first;
  Child refused = b.tenantProcess("alpha", {}, &first);
  EXPECT_EQ(first, "init-failed 3") << "the shim refuses the damaged ledger too";
  Child beta = b.tenantProcess("beta");
  EXPECT_EQ(beta.ask("alloc " + std::to_string(64 * MiB)), "ok");
  EXPECT_EQ(usedOn0(b.tenant("beta")), 64 * MiB);
  const rpc::Response r = b.setLimit("alpha", "1GiB");
  EXPECT_FALSE(r.ok());
  EXPECT_NE(r.error().find("cannot be managed"), std::string::npos) << r.error();
}

// ---- Live limits ----

TEST(LiveLimits, LowerAndRaiseUnderLoad) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kTwoTenants)) << b.log();
  std::vector<Child> procs;
  for (int i = 0; i < 4; ++i) procs.push_back(b.tenantProcess("alpha"));
  Child viewer = b.tenantProcess("alpha");
  for (Child& c : procs) ASSERT_TRUE(c.send("churn " + std::to_string(16 * MiB) + " 8 4000"));
  std::this_thread::sleep_for(milliseconds(300));
  ASSERT_TRUE(b.setLimit("alpha", "192MiB").ok());
  const std::string view = viewer.ask("info");
  EXPECT_EQ(view.substr(view.find("total")), "total " + std::to_string(192 * MiB)) << "the view follows at once";
  // Usage above the new limit is not revoked; it drains as the processes free, and from then on
  // never exceeds the new limit.
  const auto start = Clock::now();
  while (usedOn0(b.tenant("alpha")) > 192 * MiB && Clock::now() - start < std::chrono::seconds(2)) {
  }
  uint64_t maxAfter = 0;
  for (int i = 0; i < 150; ++i) {
    maxAfter = std::max(maxAfter, usedOn0(b.tenant("alpha")));
    std::this_thread::sleep_for(milliseconds(2));
  }
  // Each of the 4 single-threaded processes may have one 16 MiB intent in flight when sampled
  // (see Load); without the new limit they would climb back towards 512 MiB.
  EXPECT_LE(maxAfter, 192 * MiB + 4 * 16 * MiB);
  EXPECT_EQ(viewer.ask("alloc " + std::to_string(256 * MiB)), "oom");
  // Admission: beta is guaranteed 1 GiB of the 4 GiB device, so alpha may have 3 GiB, not all.
  const rpc::Response all = b.setLimit("alpha", "100%");
  EXPECT_FALSE(all.ok());
  EXPECT_NE(all.error().find("would add up to 5 GiB, more than its 4 GiB"), std::string::npos) << all.error();
  ASSERT_TRUE(b.setLimit("alpha", "3GiB").ok());
  EXPECT_EQ(limitOn0(b.tenant("alpha")), 3072 * MiB);
  EXPECT_EQ(viewer.ask("alloc " + std::to_string(1024 * MiB)), "ok") << "room returns when the limit is raised";
  for (Child& c : procs) EXPECT_EQ(c.readLine(60000).rfind("churned ", 0), 0u);
}

// ---- Configuration: start, reload ----

std::string readFile(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void writeConfig(const Broker& b, const std::string& body) {
  std::ofstream(b.dir() + "/config.yaml") << brokerConfig(b.dir(), body);
}

TEST(Config, BadConfigurationIsRefusedAtStart) {
  Broker b(testDir());
  EXPECT_FALSE(b.start("tenants:\n  - {name: alpha, memory: 512MiB, memroy: 1GiB}\n"));
  EXPECT_NE(b.log().find("config.yaml:6:35: tenants[0].memroy: unknown key 'memroy'; did you mean 'memory'?"),
            std::string::npos)
      << b.log();
  Broker over(testDir() + "/over");
  std::filesystem::create_directories(over.dir());
  EXPECT_FALSE(over.start("tenants:\n  - {name: a, memory: 3GiB}\n  - {name: b, memory: 2GiB}\n"));
  EXPECT_NE(over.log().find("config.yaml:7:23: tenants[1].memory: tenant 'b' brings the memory limits on device 0"),
            std::string::npos)
      << over.log();
}

TEST(Config, DamagedStateFileIsRefusedAtStart) {
  Broker b(testDir());
  std::ofstream(b.dir() + "/broker.state") << "cushare-broker-state 1\nlimit alpha GPU-nope 5\n";
  EXPECT_FALSE(b.start(kTwoTenants));
  EXPECT_NE(b.log().find("broker.state:2: 'GPU-nope' is not a GPU or MIG device UUID (written by the broker; remove the file"),
            std::string::npos)
      << b.log();
}

TEST(Config, RefusedReloadKeepsTheRunningConfiguration) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kTwoTenants)) << b.log();
  Child alpha = b.tenantProcess("alpha");
  writeConfig(b, "tenants:\n  - {name: alpha, memory: 3GiB}\n  - {name: beta, memory: 2GiB}\n");
  const rpc::Response r = b.reload();
  EXPECT_FALSE(r.ok());
  EXPECT_NE(r.error().find("reload refused, the running configuration is unchanged"), std::string::npos) << r.error();
  EXPECT_NE(r.error().find("config.yaml:7:26: tenants[1].memory"), std::string::npos) << r.error();
  EXPECT_EQ(b.status().config_generation(), 1u);
  EXPECT_EQ(b.status().reloads_refused(), 1u);
  EXPECT_EQ(limitOn0(b.tenant("alpha")), 512 * MiB);
  writeConfig(b, "tenants:\n  - {name: alpha, memory: 256MiB}\n  - {name: beta, memory: 2GiB}\n");
  ASSERT_TRUE(b.reload().ok()) << b.log();
  EXPECT_EQ(b.status().config_generation(), 2u);
  EXPECT_EQ(limitOn0(b.tenant("alpha")), 256 * MiB);
  EXPECT_EQ(alpha.ask("fill " + std::to_string(64 * MiB)), "held " + std::to_string(256 * MiB))
      << "a running process uses the reloaded limit";
}

TEST(Config, SighupReloads) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kTwoTenants)) << b.log();
  writeConfig(b, "tenants:\n  - {name: alpha, memory: 300MiB}\n  - {name: beta, memory: 1GiB}\n");
  ::kill(b.pid(), SIGHUP);
  const auto start = Clock::now();
  while (b.status().config_generation() != 2 && Clock::now() - start < std::chrono::seconds(5))
    std::this_thread::sleep_for(milliseconds(5));
  EXPECT_EQ(limitOn0(b.tenant("alpha")), 300 * MiB);
}

// Removing a tenant and adding it back, with a process running throughout: the same ledger comes
// back, so the running process still counts against the tenant (no second budget).
TEST(Config, ReAddedTenantKeepsItsRunningProcesses) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kTwoTenants)) << b.log();
  Child holder = b.tenantProcess("beta");
  ASSERT_EQ(holder.ask("alloc " + std::to_string(256 * MiB)), "ok");
  writeConfig(b, "tenants:\n  - {name: alpha, memory: 512MiB}\n");
  ASSERT_TRUE(b.reload().ok());
  EXPECT_EQ(b.tenant("beta").source(), "removed");
  writeConfig(b, kTwoTenants);
  ASSERT_TRUE(b.reload().ok()) << b.log();
  const rpc::Tenant beta = b.tenant("beta");
  EXPECT_EQ(beta.source(), "config");
  EXPECT_EQ(usedOn0(beta), 256 * MiB);
  EXPECT_EQ(beta.processes(), 1u);
  Child late = b.tenantProcess("beta");
  EXPECT_EQ(late.ask("fill " + std::to_string(64 * MiB)), "held " + std::to_string(768 * MiB))
      << "1 GiB in all, the running process's 256 MiB included";
}

TEST(Config, ReloadCannotMoveTheLedgers) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kTwoTenants)) << b.log();
  std::ofstream(b.dir() + "/config.yaml")
      << "ledger_dir: " << b.dir() << "/elsewhere\n"
      << "socket: " << b.socket() << "\nstate_file: " << b.dir() << "/broker.state\nmetrics_listen: 127.0.0.1:0\n"
      << kTwoTenants;
  const rpc::Response r = b.reload();
  EXPECT_FALSE(r.ok());
  EXPECT_NE(r.error().find("ledger_dir cannot change on reload"), std::string::npos) << r.error();
}

TEST(Config, RemovedTenantKeepsItsProcessesUntilTheyExit) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kTwoTenants)) << b.log();
  Child holder = b.tenantProcess("beta");
  ASSERT_EQ(holder.ask("alloc " + std::to_string(64 * MiB)), "ok");
  writeConfig(b, "tenants:\n  - {name: alpha, memory: 512MiB}\n");
  ASSERT_TRUE(b.reload().ok());
  rpc::Tenant beta = b.tenant("beta");
  EXPECT_EQ(beta.source(), "removed");
  EXPECT_EQ(usedOn0(beta), 64 * MiB) << "still accounted while its process runs";
  std::string first;
  Child late = b.tenantProcess("beta", {}, &first);
  EXPECT_EQ(first, "init-failed 3") << "a removed tenant's new processes are refused";
  EXPECT_EQ(holder.ask("alloc " + std::to_string(64 * MiB)), "ok") << "the running one keeps working";
  holder.kill(SIGKILL);
  holder.wait();
  const auto start = Clock::now();
  while (!b.tenant("beta").source().empty() && Clock::now() - start < std::chrono::seconds(5))
    std::this_thread::sleep_for(milliseconds(5));
  EXPECT_EQ(b.tenant("beta").source(), "") << "gone with its last process";
}

// ---- Security: file permissions, peer credentials, malformed messages ----

// Runs fn in a child process as uid/gid (with the given supplementary groups); its exit status.
template <class F>
int asUser(uid_t uid, gid_t gid, std::vector<gid_t> groups, F fn) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    if (::setgroups(groups.size(), groups.data()) != 0 || ::setgid(gid) != 0 || ::setuid(uid) != 0) ::_exit(99);
    ::_exit(fn());
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 100;
}

rpc::Response callAs(const std::string& socket, const rpc::Request& req) {
  rpc::Response resp;
  std::string err;
  if (!rpc::call(socket, req, &resp, &err)) resp.set_error("call failed: " + err);
  return resp;
}

TEST(Security, OtherUsersCannotOpenALedgerOrChangeLimits) {
  if (::geteuid() != 0) GTEST_SKIP() << "switching users needs root (CI runs as root)";
  Broker b(testDir());
  ASSERT_TRUE(b.start("admin_group: nogroup\ntenants:\n  - {name: alpha, memory: 512MiB, uid: 1000}\n"
                      "  - {name: beta, memory: 256MiB, gid: 1001}\n"))
      << b.log();
  const std::string alpha = b.ledgerDir() + "/alpha.ledger", beta = b.ledgerDir() + "/beta.ledger";
  struct stat st;
  ASSERT_EQ(::stat(alpha.c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, 1000u);
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  ASSERT_EQ(::stat(beta.c_str(), &st), 0);
  EXPECT_EQ(st.st_gid, 1001u);
  EXPECT_EQ(st.st_mode & 07777, 0660u);
  auto opens = [](const std::string& p, int flags) {
    const int fd = ::open(p.c_str(), flags);
    if (fd >= 0) ::close(fd);
    return fd >= 0 ? 0 : errno == EACCES ? 1 : 2;
  };
  EXPECT_EQ(asUser(1000, 1000, {}, [&] { return opens(alpha, O_RDWR); }), 0) << "the tenant's own user";
  EXPECT_EQ(asUser(2000, 2000, {}, [&] { return opens(alpha, O_RDONLY); }), 1) << "another user";
  EXPECT_EQ(asUser(1000, 1000, {}, [&] { return opens(beta, O_RDWR); }), 1) << "another tenant's user";
  EXPECT_EQ(asUser(3000, 1001, {}, [&] { return opens(beta, O_RDWR); }), 0) << "beta's group";
  EXPECT_EQ(asUser(2000, 2000, {}, [&] { return opens(b.ledgerDir() + "/host.segment", O_RDONLY); }), 0);

  rpc::Request status, set;
  status.set_version(1);
  status.mutable_status();
  set.set_version(1);
  set.mutable_set_limit()->set_tenant("alpha");
  set.mutable_set_limit()->set_memory("1GiB");
  set.mutable_set_limit()->set_device(-1);
  const std::string sock = b.socket();
  EXPECT_EQ(asUser(2000, 2000, {}, [&] { return callAs(sock, status).ok() ? 0 : 1; }), 0) << "anyone may read";
  EXPECT_EQ(asUser(2000, 2000, {}, [&] {
              const rpc::Response r = callAs(sock, set);
              return !r.ok() && r.error().find("permission denied") != std::string::npos ? 0 : 1;
            }),
            0);
  EXPECT_EQ(limitOn0(b.tenant("alpha")), 512 * MiB);
  EXPECT_EQ(asUser(2000, 2000, {65534}, [&] { return callAs(sock, set).ok() ? 0 : 1; }), 0)
      << "a member of admin_group may";
  EXPECT_EQ(limitOn0(b.tenant("alpha")), 1024 * MiB);
}

// A tenant can write its own ledger; a limit it raises there is put back by the broker.
TEST(Security, ALimitRewrittenInTheLedgerIsRestored) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kTwoTenants)) << b.log();
  auto ledger = observe(b.ledgerDir(), "alpha");
  ASSERT_TRUE(ledger);
  ledger->setLimit(0, 4096 * MiB);
  const auto start = Clock::now();
  while (ledger->limit(0) != 512 * MiB && Clock::now() - start < std::chrono::seconds(2))
    std::this_thread::sleep_for(milliseconds(1));
  EXPECT_EQ(ledger->limit(0), 512 * MiB);
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(1));
  EXPECT_TRUE(b.logHas("tenant alpha device 0: the limit in its ledger was changed to 4 GiB outside the broker; restored to 512 MiB")) << b.log();
}

// A process that holds the init lock of a ledger forever, or truncates a ledger under the broker's
// mapping, must not freeze or kill the broker.
TEST(Security, LockedOrTruncatedLedgersDoNotStopTheBroker) {
  Broker b(testDir());
  ASSERT_TRUE(b.start("unknown_tenants: small\nprofiles:\n  small: {memory: 256MiB}\n"
                      "tenants:\n  - {name: alpha, memory: 512MiB}\n"))
      << b.log();
  // An "unknown tenant" ledger whose flock is held: adoption gives up, everything else goes on.
  // (Locked before it appears in the directory, so the broker's first look already finds it locked.)
  const std::string staged = b.dir() + "/x.staged", x = b.ledgerDir() + "/x.ledger";
  const int fd = ::open(staged.c_str(), O_RDWR | O_CREAT, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX), 0);
  ASSERT_EQ(::rename(staged.c_str(), x.c_str()), 0);
  std::this_thread::sleep_for(milliseconds(300));
  const auto t0 = Clock::now();
  EXPECT_EQ(b.status().tenants(), 1u);
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(1)) << "the broker must not wait on a tenant's lock";
  ::close(fd);
  // alpha's ledger truncated under the broker's mapping: no SIGBUS death; the ledger is reopened.
  if (kUnderThreadSanitizer) GTEST_SKIP() << kSigbusUnderTsan;
  Child alpha = b.tenantProcess("alpha");
  ASSERT_EQ(alpha.ask("alloc " + std::to_string(64 * MiB)), "ok");
  ASSERT_EQ(::truncate((b.ledgerDir() + "/alpha.ledger").c_str(), 0), 0);
  std::this_thread::sleep_for(milliseconds(300));
  EXPECT_EQ(b.tenant("alpha").name(), "alpha") << "still answering";
  const auto start = Clock::now();
  while (limitOn0(b.tenant("alpha")) != 512 * MiB && Clock::now() - start < std::chrono::seconds(5))
    std::this_thread::sleep_for(milliseconds(20));
  EXPECT_EQ(limitOn0(b.tenant("alpha")), 512 * MiB) << b.log();
  EXPECT_NE(b.log().find("became unreadable"), std::string::npos) << b.log();
  EXPECT_NE(b.log().find("is usable again"), std::string::npos) << b.log();
}

// One user cannot take every connection slot: past 16 its connections are closed, while other
// users and administrators are still served.
TEST(Security, OneUserCannotTakeEveryConnection) {
  if (::geteuid() != 0) GTEST_SKIP() << "switching users needs root (CI runs as root)";
  Broker b(testDir());
  ASSERT_TRUE(b.start(kTwoTenants)) << b.log();
  int report[2];
  ASSERT_EQ(::pipe(report), 0);
  const std::string sock = b.socket();
  const pid_t hog = ::fork();
  if (hog == 0) {
    if (::setgid(2000) != 0 || ::setuid(2000) != 0) ::_exit(99);
    std::vector<int> fds;
    for (int i = 0; i < 20; ++i) {
      const int fd = connectUnix(sock);
      if (fd < 0) ::_exit(98);
      fds.push_back(fd);
    }
    // Counts the connections the broker refused at once (a busy answer, then end of file); the
    // accepted ones stay open and silent for 5 s. Waits for the broker to have seen all 20 (a
    // busy machine).
    char closed = 0;
    std::vector<bool> seen(fds.size(), false);
    auto look = [&] {
      for (size_t i = 0; i < fds.size(); ++i) {
        pollfd p{fds[i], POLLIN, 0};
        if (seen[i] || ::poll(&p, 1, 0) != 1) continue;
        seen[i] = true;
        std::string answer;
        char buf[512];
        for (ssize_t n; (n = ::read(fds[i], buf, sizeof buf)) > 0;) answer.append(buf, static_cast<size_t>(n));
        rpc::Response r;
        if (answer.size() > 4 && r.ParseFromString(answer.substr(4)) && r.busy() &&
            r.error().rfind("broker busy: uid 2000 already has 16 connections open", 0) == 0)
          ++closed;
      }
    };
    for (int round = 0; round < 300 && closed < 4; ++round) {
      look();
      ::usleep(10000);
    }
    ::usleep(200000);  // and none more after a while
    look();
    (void)!::write(report[1], &closed, 1);
    ::pause();
    ::_exit(0);
  }
  char closed = -1;
  ASSERT_EQ(::read(report[0], &closed, 1), 1);
  EXPECT_EQ(closed, 4) << "16 connections per user, the others refused with a busy answer";
  rpc::Request status;
  status.set_version(1);
  status.mutable_status();
  EXPECT_EQ(asUser(3000, 3000, {}, [&] { return callAs(sock, status).ok() ? 0 : 1; }), 0) << "another user";
  EXPECT_TRUE(b.setLimit("alpha", "256MiB").ok()) << "an administrator";
  ::kill(hog, SIGKILL);
  ::waitpid(hog, nullptr, 0);
}

// Every malformed message of the corpus gets an error answer, never a crash; the broker answers
// normally afterwards.
TEST(Security, MalformedMessagesAreRefused) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kTwoTenants)) << b.log();
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(CORPUS_DIR)) {
    const std::string name = e.path().filename();
    const std::string bytes = readFile(e.path());
    const int fd = connectUnix(b.socket());
    ASSERT_GE(fd, 0);
    (void)!::write(fd, bytes.data(), bytes.size());
    ::shutdown(fd, SHUT_WR);
    std::string answer;
    char buf[4096];
    for (ssize_t n; (n = ::read(fd, buf, sizeof buf)) > 0;) answer.append(buf, static_cast<size_t>(n));
    ::close(fd);
    rpc::Response resp;
    const bool framed = answer.size() >= 4 && resp.ParseFromString(answer.substr(4));
    if (name.rfind("valid-", 0) == 0) {
      EXPECT_TRUE(framed) << name;
      EXPECT_EQ(resp.error().find("malformed"), std::string::npos) << name << ": " << resp.error();
    } else {
      EXPECT_TRUE(framed) << name << ": every malformed message gets its error, half-closed or not";
      EXPECT_FALSE(resp.ok()) << name;
      EXPECT_FALSE(resp.error().empty()) << name;
    }
    ++files;
  }
  EXPECT_GE(files, 25);
  EXPECT_EQ(b.status().tenants(), 2u) << "still answering";
}

TEST(Security, SilentClientsBlockNeitherRequestsNorReaping) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kTwoTenants)) << b.log();
  std::vector<int> idle;
  for (int i = 0; i < 20; ++i) {
    const int fd = connectUnix(b.socket());
    ASSERT_GE(fd, 0);
    const char partial[2] = {10, 0};  // half a length prefix, then nothing
    (void)!::write(fd, partial, sizeof partial);
    idle.push_back(fd);
  }
  const auto t0 = Clock::now();
  EXPECT_EQ(b.status().tenants(), 2u);
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(1));
  Child holder = b.tenantProcess("alpha");
  ASSERT_EQ(holder.ask("alloc " + std::to_string(64 * MiB)), "ok");
  holder.kill(SIGKILL);
  holder.wait();
  const auto dead = Clock::now();
  while (usedOn0(b.tenant("alpha")) != 0 && Clock::now() - dead < std::chrono::seconds(5)) {
  }
  EXPECT_EQ(usedOn0(b.tenant("alpha")), 0u);
  for (int fd : idle) ::close(fd);
}
// ---- Tamper: a hostile tenant against the broker and its own ledger ----

// Waits until pred() holds or timeout passes; whether it held.
template <class F>
bool waitFor(F pred, std::chrono::milliseconds timeout = std::chrono::seconds(5)) {
  const auto end = Clock::now() + timeout;
  while (!pred()) {
    if (Clock::now() > end) return false;
    std::this_thread::sleep_for(milliseconds(5));
  }
  return true;
}

// Writes bytes at offset of a file, as a tenant's process can write its own ledger.
void rawWrite(const std::string& path, size_t offset, const void* data, size_t n) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0) << path;
  ASSERT_EQ(::pwrite(fd, data, n, static_cast<off_t>(offset)), static_cast<ssize_t>(n));
  ::close(fd);
}

// A process of the tenant (uid 1000) truncating path in a tight loop until stopped.
pid_t truncateLoop(const std::string& path) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    if (::setgid(1000) != 0 || ::setuid(1000) != 0) ::_exit(99);
    for (;;) (void)!::truncate(path.c_str(), 0);
  }
  return pid;
}

// The sum of what the device holds for these pids (simgpu's own accounting).
uint64_t deviceHeld(const std::vector<int>& pids) {
  const std::map<int, uint64_t> held = deviceMemoryOn0();
  uint64_t sum = 0;
  for (int p : pids)
    if (auto it = held.find(p); it != held.end()) sum += it->second;
  return sum;
}

// simgpu counts nothing the shim does not (no context memory): every untracked byte is reported
// as hidden (context_memory: 0), as well as charged. These tests watch the charge, so the
// tampering process is left running (tamper_response and hidden_memory_response charge; the
// defaults kill it, below).
const std::string kAlphaBeta =
    "context_memory: 0\ntamper_response: charge\nhidden_memory_response: charge\n"
    "tenants:\n  - {name: alpha, memory: 256MiB, uid: 1000}\n  - {name: beta, memory: 256MiB}\n";

// A process of the tenant truncating its ledger in a tight loop, from before the broker starts
// (the broker creates the file under attack) and across a restart (the broker opens a file under
// attack): the broker never dies (SIGBUS), answers, and manages the other tenant; when the loop
// stops, alpha's ledger is usable again and its error is gone.
TEST(Tamper, LedgerTruncatedInALoopCannotKillTheBroker) {
  if (::geteuid() != 0) GTEST_SKIP() << "switching users needs root (CI runs as root)";
  if (kUnderThreadSanitizer) GTEST_SKIP() << kSigbusUnderTsan;
  Broker b(testDir());
  ASSERT_EQ(::mkdir(b.ledgerDir().c_str(), 0711), 0);
  const std::string alphaLedger = b.ledgerDir() + "/alpha.ledger";
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE(round == 0 ? "the broker creates the ledger under attack" : "the broker opens it under attack");
    Forked attacker(truncateLoop(alphaLedger));
    ASSERT_TRUE(round == 0 ? b.start(kAlphaBeta) : b.startWithFile()) << b.log();
    Child beta = b.tenantProcess("beta");
    const auto until = Clock::now() + std::chrono::seconds(2);  // a few directory scans
    while (Clock::now() < until) {
      ASSERT_EQ(b.status().tenants(), 2u) << "the broker must keep answering\n" << b.log();
      std::this_thread::sleep_for(milliseconds(50));
    }
    EXPECT_EQ(beta.ask("fill " + std::to_string(16 * MiB)), "held " + std::to_string(256 * MiB)) << "beta is managed";
    EXPECT_EQ(usedOn0(b.tenant("beta")), 256 * MiB);
    attacker.stop();
    EXPECT_TRUE(waitFor([&] { return b.tenant("alpha").error().empty() && limitOn0(b.tenant("alpha")) == 256 * MiB; }))
        << b.tenant("alpha").error() << "\n" << b.log();
    ASSERT_EQ(::kill(b.pid(), 0), 0);
    EXPECT_EQ(b.stop(), 0) << b.log();
  }
}

// A process of the tenant that holds its ledger's flock forever, from before the broker (re)starts,
// so that the broker needs that lock every tick to open the ledger (a running broker never needs
// it for a ledger it has opened: the entries its limits file published are put back without it):
// the control socket answers promptly all along (the broker never waits under its lock, and waits
// at most once per tick), the other tenant is managed, alpha's error says why; it goes when the
// lock is released.
TEST(Tamper, HeldLedgerLockCostsOneBoundedWaitOutsideTheBrokersLock) {
  if (::geteuid() != 0) GTEST_SKIP() << "switching users needs root (CI runs as root)";
  Broker b(testDir());
  ASSERT_TRUE(b.start(kAlphaBeta)) << b.log();
  ASSERT_EQ(b.stop(), 0) << b.log();
  const std::string alphaLedger = b.ledgerDir() + "/alpha.ledger";
  int pipeFds[2];
  ASSERT_EQ(::pipe(pipeFds), 0);
  const pid_t holderPid = ::fork();
  if (holderPid == 0) {
    if (::setgid(1000) != 0 || ::setuid(1000) != 0) ::_exit(99);
    const int fd = ::open(alphaLedger.c_str(), O_RDWR);
    if (fd < 0 || ::flock(fd, LOCK_EX) != 0) ::_exit(98);
    (void)!::write(pipeFds[1], "x", 1);
    for (;;) ::pause();
  }
  Forked holder(holderPid);
  char c;
  ASSERT_EQ(::read(pipeFds[0], &c, 1), 1);
  ASSERT_TRUE(b.startWithFile()) << b.log();
  std::vector<double> ms;
  const auto until = Clock::now() + std::chrono::seconds(2);
  while (Clock::now() < until) {
    const auto t0 = Clock::now();
    ASSERT_EQ(b.status().tenants(), 2u) << b.log();
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    std::this_thread::sleep_for(milliseconds(10));
  }
  std::sort(ms.begin(), ms.end());
  const double p90 = ms[ms.size() * 9 / 10];
  EXPECT_LT(p90, 50.0) << "status round trip while a tenant holds its ledger's flock (90th percentile, "
                       << ms.size() << " calls, max " << ms.back() << " ms)";
  const std::string err = b.tenant("alpha").error();
  EXPECT_NE(err.find("is locked (flock) by another process for more than 100 ms"), std::string::npos) << err;
  Child beta = b.tenantProcess("beta");
  EXPECT_EQ(beta.ask("fill " + std::to_string(16 * MiB)), "held " + std::to_string(256 * MiB)) << "beta is managed";
  EXPECT_NE(b.metrics().find("cushare_tenant_ledger_error{tenant=\"alpha\"} 1\n"), std::string::npos);
  holder.stop();
  EXPECT_TRUE(waitFor([&] { return b.tenant("alpha").error().empty(); })) << b.tenant("alpha").error();
  EXPECT_EQ(limitOn0(b.tenant("alpha")), 256 * MiB);
  EXPECT_EQ(b.metrics().find("cushare_tenant_ledger_error{tenant=\"alpha\"}"), std::string::npos) << "the error is gone";
  EXPECT_TRUE(b.logHas("tenant alpha: ledger " + alphaLedger + " is usable again")) << b.log();
  ::close(pipeFds[0]);
  ::close(pipeFds[1]);
}

// A process zeroes every usage counter of its ledger (a raw write) and allocates past the limit.
// The device's own accounting shows it: the broker charges the difference, so the tenant's usage
// shows what the device holds, every further allocation of the tenant is denied, and the device
// never holds more than it did when the broker found out. Zeroing again (the charge included)
// changes nothing for long: the charge is re-asserted every tick.
TEST(Tamper, ZeroedCountersAreFoundInTheDevicesAccounting) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kAlphaBeta)) << b.log();
  Child a = b.tenantProcess("alpha");
  ASSERT_EQ(a.ask("alloc " + std::to_string(200 * MiB)), "ok");
  ASSERT_EQ(a.ask("zero"), "ok");
  ASSERT_EQ(a.ask("alloc " + std::to_string(200 * MiB)), "ok") << "the shim believes the ledger";
  const uint64_t atDetection = deviceHeld({a.pid()});
  EXPECT_EQ(atDetection, 400 * MiB);
  ASSERT_TRUE(waitFor([&] { return usedOn0(b.tenant("alpha")) == 400 * MiB; })) << usedOn0(b.tenant("alpha")) << "\n" << b.log();
  EXPECT_EQ(a.ask("alloc " + std::to_string(1 * MiB)), "oom");
  Child a2 = b.tenantProcess("alpha");
  EXPECT_EQ(a2.ask("alloc " + std::to_string(1 * MiB)), "oom") << "every process of the tenant";
  EXPECT_EQ(deviceHeld({a.pid(), a2.pid()}), atDetection);
  const std::string line = "tenant alpha device 0: its processes hold 400 MiB on the device, 200 MiB more than its ledger shows; pid " +
                           std::to_string(a.pid()) + ": 400 MiB on the device, 200 MiB in its ledger slot";
  EXPECT_NE(b.log().find(line), std::string::npos) << b.log();
  const std::string m = b.metrics();
  EXPECT_NE(m.find("cushare_tenant_hidden_bytes{tenant=\"alpha\",device=\"0\",uuid=\"" + kDevice0Uuid + "\"} " + std::to_string(200 * MiB) + "\n"),
            std::string::npos) << m;
  EXPECT_NE(m.find("cushare_tenant_tamper_total{tenant=\"alpha\",kind=\"hidden\"} 1\n"), std::string::npos) << m;
  EXPECT_NE(m.find("cushare_tenant_hidden_bytes{tenant=\"beta\",device=\"0\",uuid=\"" + kDevice0Uuid + "\"} 0\n"), std::string::npos) << m;
  // Again, the broker's charge zeroed too: re-asserted.
  ASSERT_EQ(a.ask("zero"), "ok");
  EXPECT_TRUE(waitFor([&] { return usedOn0(b.tenant("alpha")) == 400 * MiB; }, milliseconds(1000)));
  EXPECT_EQ(a.ask("alloc " + std::to_string(1 * MiB)), "oom");
  EXPECT_EQ(deviceHeld({a.pid(), a2.pid()}), atDetection);
  // Freed: nothing hidden any more, the tenant can allocate again.
  ASSERT_EQ(a.ask("freeall"), "ok");
  EXPECT_TRUE(waitFor([&] { return usedOn0(b.tenant("alpha")) == 0; })) << usedOn0(b.tenant("alpha"));
  EXPECT_EQ(a2.ask("alloc " + std::to_string(256 * MiB)), "ok");
}

// As kAlphaBeta, taking back what was allocated past the limit: the default for rewritten limits;
// for hidden memory kill takes the process down whether or not the tenant is past its limit (the
// default, kill_past_limit, only when it is: tests below).
const std::string kAlphaBetaKill =
    "context_memory: 0\nhidden_memory_response: kill\n"
    "tenants:\n  - {name: alpha, memory: 256MiB}\n  - {name: beta, memory: 256MiB}\n";

// The tampering process pid (c) was killed, the device freed what it held, alpha's usage is back
// to `remains`, and the kill was counted.
void expectKilledAndFreed(Broker& b, Child& c, int pid, uint64_t remains) {
  const int status = c.wait(5000);
  ASSERT_TRUE(status != -1 && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status << "\n" << b.log();
  EXPECT_TRUE(waitFor([&] { return deviceHeld({pid}) == 0; }, milliseconds(2000))) << "the device freed it";
  EXPECT_TRUE(waitFor([&] { return usedOn0(b.tenant("alpha")) == remains; }, milliseconds(2000)))
      << usedOn0(b.tenant("alpha"));
  EXPECT_NE(b.metrics().find("cushare_tenant_tamper_total{tenant=\"alpha\",kind=\"killed\"} 1\n"), std::string::npos);
}

// hidden_memory_response kill: a process that zeroes its counters and allocates past its limit
// is killed once the device's accounting shows it (five ticks), so the device frees what it took
// in the window (found by the second review: with the charge alone the device held 4096 MiB for a
// 512 MiB limit for as long as the process lived). Judged by the device's own count; the time from
// the broker's first look to the kill is printed (design: five 50 ms ticks). The broker is stopped
// while the attack is set up, so the device's count before the kill is certain. An honest process
// of the tenant beside it is left alone.
TEST(Tamper, ATamperingProcessIsKilledAndTheDeviceFreesWhatItTook) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kAlphaBetaKill)) << b.log();
  Child honest = b.tenantProcess("alpha");
  Child a = b.tenantProcess("alpha");
  ASSERT_EQ(a.ask("alloc " + std::to_string(200 * MiB)), "ok");
  ASSERT_TRUE(stopProcess(b.pid()));
  ASSERT_EQ(a.ask("zero"), "ok");  // every counter of the ledger: the honest one allocates after it
  ASSERT_EQ(a.ask("alloc " + std::to_string(200 * MiB)), "ok") << "the shim believes the ledger";
  ASSERT_EQ(honest.ask("alloc " + std::to_string(16 * MiB)), "ok");
  const int pid = a.pid();
  EXPECT_EQ(deviceHeld({pid, honest.pid()}), (400 + 16) * MiB) << "past the limit on the device";
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_EQ(::kill(b.pid(), SIGCONT), 0);
  ASSERT_NO_FATAL_FAILURE(expectKilledAndFreed(b, a, pid, 16 * MiB));
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  std::printf("the tampering process was killed and its memory freed %.0f ms after the broker could look\n", ms);
  EXPECT_EQ(honest.ask("alloc " + std::to_string(16 * MiB)), "ok") << "the honest process lives on";
  EXPECT_TRUE(b.logHas("tenant alpha device 0: pid " + std::to_string(pid) + " killed (hidden_memory_response: kill)")) << b.log();
}

// The default response to hidden memory (kill_past_limit): a process that zeroes its counters and
// allocates past its tenant's limit is killed once the device's accounting shows it, so the device
// frees what it took (before the default was charge: the device kept 400 MiB for a 256 MiB limit
// for as long as the process lived). An honest process of the tenant beside it lives on. Judged
// by the device's own count; the broker is stopped while the attack is set up.
TEST(Tamper, ByDefaultAProcessHidingMemoryPastTheLimitIsKilled) {
  Broker b(testDir());
  ASSERT_TRUE(b.start("context_memory: 0\ntenants:\n  - {name: alpha, memory: 256MiB}\n")) << b.log();
  Child honest = b.tenantProcess("alpha");
  Child a = b.tenantProcess("alpha");
  ASSERT_EQ(a.ask("alloc " + std::to_string(200 * MiB)), "ok");
  ASSERT_TRUE(stopProcess(b.pid()));
  ASSERT_EQ(a.ask("zero"), "ok");
  ASSERT_EQ(a.ask("alloc " + std::to_string(200 * MiB)), "ok") << "the shim believes the ledger";
  ASSERT_EQ(honest.ask("alloc " + std::to_string(16 * MiB)), "ok");
  const int pid = a.pid();
  EXPECT_EQ(deviceHeld({pid, honest.pid()}), (400 + 16) * MiB) << "past the limit on the device";
  ASSERT_EQ(::kill(b.pid(), SIGCONT), 0);
  ASSERT_NO_FATAL_FAILURE(expectKilledAndFreed(b, a, pid, 16 * MiB));
  EXPECT_EQ(honest.ask("alloc " + std::to_string(16 * MiB)), "ok") << "the honest process lives on";
  EXPECT_TRUE(b.logHas("tenant alpha device 0: pid " + std::to_string(pid) +
                       " killed (hidden_memory_response: kill_past_limit: 416 MiB on the device, past the 256 MiB its ledger "
                       "may hold)")) << b.log();
}

// kill_past_limit leaves memory hidden within the limit charged (a CUDA context larger than
// context_memory looks the same), and judges the tenant every tick while the memory stays hidden:
// the same process, once it zeroes the counters again (the broker's charge too) and allocates past
// the limit, is killed then.
TEST(Tamper, ByDefaultMemoryHiddenWithinTheLimitIsChargedUntilItPassesTheLimit) {
  Broker b(testDir());
  ASSERT_TRUE(b.start("context_memory: 0\ntenants:\n  - {name: alpha, memory: 512MiB}\n")) << b.log();
  Child a = b.tenantProcess("alpha");
  ASSERT_EQ(a.ask("alloc " + std::to_string(100 * MiB)), "ok");
  ASSERT_EQ(a.ask("zero"), "ok");
  ASSERT_EQ(a.ask("alloc " + std::to_string(200 * MiB)), "ok");
  ASSERT_TRUE(waitFor([&] {
    return b.metrics().find("cushare_tenant_tamper_total{tenant=\"alpha\",kind=\"hidden\"} 1\n") != std::string::npos;
  })) << b.log();
  EXPECT_TRUE(waitFor([&] { return usedOn0(b.tenant("alpha")) == 300 * MiB; })) << usedOn0(b.tenant("alpha"));
  std::this_thread::sleep_for(milliseconds(500));  // ten ticks with the memory hidden, within the limit
  EXPECT_EQ(a.ask("alloc " + std::to_string(16 * MiB)), "ok") << "alive, and held to what is left";
  EXPECT_EQ(deviceHeld({a.pid()}), 316 * MiB);
  EXPECT_EQ(b.metrics().find("kind=\"killed\""), std::string::npos) << b.log();
  const int pid = a.pid();
  ASSERT_TRUE(stopProcess(b.pid()));
  ASSERT_EQ(a.ask("zero"), "ok");  // the broker's charge slot too
  ASSERT_EQ(a.ask("alloc " + std::to_string(400 * MiB)), "ok") << "the shim believes the ledger";
  EXPECT_EQ(deviceHeld({pid}), 716 * MiB) << "past the limit on the device";
  ASSERT_EQ(::kill(b.pid(), SIGCONT), 0);
  ASSERT_NO_FATAL_FAILURE(expectKilledAndFreed(b, a, pid, 0));
}

// What hidden_memory_allowance exempts is not counted past the limit either: a process with
// 300 MiB outside its slot (charged 200 MiB with an allowance of 100 MiB) that then fills what
// admission leaves it is within its limit and lives (found by an attack review: it was killed at
// "612 MiB, past the 512 MiB").
TEST(Tamper, TheAllowanceIsNotCountedPastTheLimit) {
  Broker b(testDir());
  ASSERT_TRUE(b.start("context_memory: 0\nhidden_memory_allowance: 100MiB\ntenants:\n  - {name: alpha, memory: 512MiB}\n"))
      << b.log();
  Child a = b.tenantProcess("alpha");
  ASSERT_EQ(a.ask("alloc " + std::to_string(300 * MiB)), "ok");
  ASSERT_EQ(a.ask("zero"), "ok");
  ASSERT_TRUE(waitFor([&] { return usedOn0(b.tenant("alpha")) == 200 * MiB; })) << usedOn0(b.tenant("alpha")) << "\n" << b.log();
  ASSERT_EQ(a.ask("fill " + std::to_string(4 * MiB)), "held " + std::to_string(612 * MiB)) << "admission leaves 312 MiB";
  std::this_thread::sleep_for(milliseconds(500));  // ten ticks
  ASSERT_EQ(a.wait(0), -1) << "alive\n" << b.log();
  EXPECT_EQ(b.metrics().find("kind=\"killed\""), std::string::npos) << b.log();
}

// Idle processes' context headroom is not one process's to hide in: past its limit, a process
// holding more than context_memory beyond its slot is taken down even while the tenant's hidden
// total is within what its processes' contexts may hold (found by an attack review: 402 MiB for a
// 256 MiB limit, logged at info).
TEST(Tamper, IdleProcessesLendNoContextHeadroom) {
  Broker b(testDir());
  ASSERT_TRUE(b.start("context_memory: 100MiB\ntenants:\n  - {name: alpha, memory: 256MiB}\n")) << b.log();
  Child idle1 = b.tenantProcess("alpha"), idle2 = b.tenantProcess("alpha"), a = b.tenantProcess("alpha");
  ASSERT_EQ(idle1.ask("alloc " + std::to_string(1 * MiB)), "ok");
  ASSERT_EQ(idle2.ask("alloc " + std::to_string(1 * MiB)), "ok");
  ASSERT_EQ(a.ask("alloc " + std::to_string(200 * MiB)), "ok");
  ASSERT_TRUE(stopProcess(b.pid()));
  ASSERT_EQ(a.ask("zero"), "ok");
  ASSERT_EQ(a.ask("alloc " + std::to_string(200 * MiB)), "ok") << "the shim believes the ledger";
  const int pid = a.pid();
  EXPECT_EQ(deviceHeld({pid, idle1.pid(), idle2.pid()}), 402 * MiB) << "past the limit, within 3 x context_memory hidden";
  ASSERT_EQ(::kill(b.pid(), SIGCONT), 0);
  const int status = a.wait(5000);
  ASSERT_TRUE(status != -1 && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status << "\n" << b.log();
  EXPECT_TRUE(waitFor([&] { return deviceHeld({pid, idle1.pid(), idle2.pid()}) == 2 * MiB; }, milliseconds(2000)));
  EXPECT_EQ(idle1.ask("held"), "held " + std::to_string(1 * MiB)) << "the idle processes live on";
}

// A tenant that writes its true total into its slot now and then (here 60 ms of every 200 ms),
// so that some ticks find nothing hidden, is charged and taken down all the same: a tick whose
// row is above what it may hold measures nothing (found by an attack review: 600 MiB for 256 MiB,
// never charged, nothing logged).
TEST(Tamper, CountersFlickeredToTheTruthStillGetTheMemoryFound) {
  Broker b(testDir());
  ASSERT_TRUE(b.start("context_memory: 0\ntenants:\n  - {name: alpha, memory: 256MiB}\n")) << b.log();
  Child a = b.tenantProcess("alpha");
  ASSERT_EQ(a.ask("alloc " + std::to_string(200 * MiB)), "ok");
  const int slot = slotHolding(b, "alpha", 200 * MiB);
  ASSERT_GE(slot, 0);
  const std::string path = b.ledgerDir() + "/alpha.ledger";
  const size_t at = ledgerUsedOffset(0, static_cast<uint32_t>(slot));
  ASSERT_TRUE(stopProcess(b.pid()));
  ASSERT_EQ(a.ask("zero"), "ok");
  ASSERT_EQ(a.ask("alloc " + std::to_string(200 * MiB)), "ok") << "the shim believes the ledger";
  const int pid = a.pid();
  EXPECT_EQ(deviceHeld({pid}), 400 * MiB);
  std::atomic<bool> stop{false};
  std::thread flicker([&] {
    const uint64_t truth = 400 * MiB, shown = 200 * MiB;
    while (!stop) {
      rawWrite(path, at, &truth, 8);
      std::this_thread::sleep_for(milliseconds(60));
      rawWrite(path, at, &shown, 8);
      std::this_thread::sleep_for(milliseconds(140));
    }
  });
  ASSERT_EQ(::kill(b.pid(), SIGCONT), 0);
  const int status = a.wait(10000);
  stop = true;
  flicker.join();
  EXPECT_TRUE(status != -1 && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status << "\n" << b.log();
  EXPECT_TRUE(waitFor([&] { return deviceHeld({pid}) == 0; }, milliseconds(2000)));
}

// Two processes of a tenant in pid namespaces of their own (containers: both are pid 1 there) are
// told apart by the kernel's holder of each slot's lock, not by the slot's pid word: what one of
// them allocated past the limit after zeroing the ledger is found and taken back (before, each
// process's slot sum read both slots, neither was taken down: 400 MiB for 256 MiB).
TEST(Tamper, ProcessesThatArePidOneInTheirNamespacesAreToldApart) {
  if (::geteuid() != 0) GTEST_SKIP() << "pid namespaces need root (CI runs as root)";
  Broker b(testDir());
  ASSERT_TRUE(b.start("context_memory: 0\ntenants:\n  - {name: alpha, memory: 256MiB}\n")) << b.log();
  Child p1 = b.tenantProcessIn({"/usr/bin/unshare", "--pid", "--fork"}, "alpha");
  Child p2 = b.tenantProcessIn({"/usr/bin/unshare", "--pid", "--fork"}, "alpha");
  ASSERT_EQ(p1.ask("pid"), "pid 1");
  ASSERT_EQ(p2.ask("pid"), "pid 1");
  const uint64_t base = deviceUsed();
  ASSERT_EQ(p1.ask("alloc " + std::to_string(200 * MiB)), "ok");
  ASSERT_TRUE(stopProcess(b.pid()));
  ASSERT_EQ(p2.ask("zero"), "ok");
  ASSERT_EQ(p2.ask("alloc " + std::to_string(200 * MiB)), "ok") << "the shim believes the ledger";
  EXPECT_EQ(deviceUsed() - base, 400 * MiB);
  ASSERT_EQ(::kill(b.pid(), SIGCONT), 0);
  // Which process zeroed the ledger cannot be known: those holding untracked memory go. Here both:
  // p1's slot was zeroed, and p2 let go of its own slot's lock when it wrote the ledger through a
  // descriptor of its own (a pid word two processes share credits neither).
  EXPECT_TRUE(waitFor([&] { return deviceUsed() == base; }, milliseconds(5000)))
      << (deviceUsed() - base) / MiB << " MiB\n" << b.log();
  EXPECT_NE(b.metrics().find("cushare_tenant_tamper_total{tenant=\"alpha\",kind=\"killed\"} 2\n"), std::string::npos)
      << b.log();
}

// The same two containers, both having let go of their slots' pid locks (closing any descriptor of
// the ledger does): a slot nobody's lock names is credited by its pid word to one process at most,
// so the slot of one cannot cover what the other hides (a review found each process credited both
// slots: 600 MiB on the device for a 512 MiB limit, nothing taken down).
TEST(Tamper, ASlotNobodysLockNamesCoversOneProcessAtMost) {
  if (::geteuid() != 0) GTEST_SKIP() << "pid namespaces need root (CI runs as root)";
  Broker b(testDir());
  ASSERT_TRUE(b.start("context_memory: 0\ntenants:\n  - {name: alpha, memory: 512MiB}\n")) << b.log();
  Child p1 = b.tenantProcessIn({"/usr/bin/unshare", "--pid", "--fork"}, "alpha");
  Child p2 = b.tenantProcessIn({"/usr/bin/unshare", "--pid", "--fork"}, "alpha");
  ASSERT_EQ(p1.ask("pid"), "pid 1");
  ASSERT_EQ(p2.ask("pid"), "pid 1");
  ASSERT_EQ(p1.ask("zero"), "ok");  // nothing counted yet; its pid lock goes with the descriptor
  ASSERT_EQ(p2.ask("zero"), "ok");
  ASSERT_EQ(p1.ask("alloc " + std::to_string(200 * MiB)), "ok");
  ASSERT_EQ(p2.ask("alloc " + std::to_string(200 * MiB)), "ok");
  const int s2 = [&] {  // p2's slot: the second one counting 200 MiB
    auto ledger = observe(b.ledgerDir(), "alpha");
    int last = -1;
    for (const Ledger::SlotUsage& u : ledger->slots())
      if (u.used[0] == 200 * MiB) last = u.slot;
    return last;
  }();
  ASSERT_GE(s2, 0);
  const uint64_t base = deviceUsed() - 400 * MiB;
  ASSERT_TRUE(stopProcess(b.pid()));
  const uint64_t zero = 0;
  rawWrite(b.ledgerDir() + "/alpha.ledger", ledgerUsedOffset(0, static_cast<uint32_t>(s2)), &zero, 8);
  const std::string more = p2.ask("alloc " + std::to_string(200 * MiB));
  ASSERT_EQ(::kill(b.pid(), SIGCONT), 0);
  ASSERT_EQ(more, "ok") << "the shim believes the ledger";
  EXPECT_TRUE(waitFor([&] { return deviceUsed() - base <= 512 * MiB; }, milliseconds(5000)))
      << (deviceUsed() - base) / MiB << " MiB on the device\n" << b.log();
}

// With the default configuration (hidden_memory_allowance 0, context_memory 512 MiB) memory a
// process hides from its ledger is charged too, though it is no more than a CUDA context holds on
// a real GPU: the limit covers everything the device holds for the tenant, so no allowance is
// left to hide in. It is reported as context memory (info), not as tampering.
TEST(Tamper, MemoryWithinAContextsSizeIsChargedToo) {
  Broker b(testDir());
  ASSERT_TRUE(b.start("tenants:\n  - {name: alpha, memory: 256MiB}\n  - {name: beta, memory: 256MiB}\n")) << b.log();
  Child a = b.tenantProcess("alpha");
  ASSERT_EQ(a.ask("alloc " + std::to_string(200 * MiB)), "ok");
  ASSERT_EQ(a.ask("zero"), "ok");
  ASSERT_EQ(a.ask("alloc " + std::to_string(50 * MiB)), "ok") << "the shim believes the ledger";
  EXPECT_EQ(deviceHeld({a.pid()}), 250 * MiB);
  ASSERT_TRUE(waitFor([&] { return usedOn0(b.tenant("alpha")) == 250 * MiB; })) << usedOn0(b.tenant("alpha")) << "\n" << b.log();
  EXPECT_EQ(a.ask("alloc " + std::to_string(16 * MiB)), "oom") << "256 MiB limit, 250 MiB on the device";
  Child a2 = b.tenantProcess("alpha");
  EXPECT_EQ(a2.ask("alloc " + std::to_string(16 * MiB)), "oom") << "every process of the tenant";
  EXPECT_EQ(deviceHeld({a.pid(), a2.pid()}), 250 * MiB) << "the device holds no more than when it was found";
  const std::string m = b.metrics();
  EXPECT_NE(m.find("cushare_tenant_hidden_bytes{tenant=\"alpha\",device=\"0\",uuid=\"" + kDevice0Uuid + "\"} " + std::to_string(200 * MiB) + "\n"),
            std::string::npos) << m;
  EXPECT_EQ(m.find("kind=\"hidden\""), std::string::npos) << "within context_memory: not counted as tampering\n" << m;
  EXPECT_TRUE(b.logHas("tenant alpha device 0: 200 MiB on the device beyond its ledger, within what 1 process context(s) hold")) << b.log();
  ASSERT_EQ(a.ask("freeall"), "ok");
  EXPECT_TRUE(waitFor([&] { return usedOn0(b.tenant("alpha")) == 0; })) << usedOn0(b.tenant("alpha"));
  EXPECT_EQ(a2.ask("alloc " + std::to_string(256 * MiB)), "ok");
}

// Takes one descriptor sent over a Unix socket (SCM_RIGHTS); -1 on failure.
int receiveDescriptor(int listener) {
  pollfd p{listener, POLLIN, 0};
  if (::poll(&p, 1, 20000) != 1) return -1;
  const int c = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
  if (c < 0) return -1;
  const int fd = fdpass::recvFd(c);
  ::close(c);
  return fd;
}

// A process exports shareable memory as a POSIX descriptor, hands it to a process that never
// touches CUDA (here the test itself) and exits: its slot is reaped, but the device keeps the
// memory. The broker finds it in the device's accounting (its used memory rose by what the exited
// process held, and no process holds it) and charges it to the tenant until the descriptor is
// closed, so the tenant cannot allocate its limit again beside it.
TEST(Tamper, MemoryAnExitedExporterLeftBehindStaysCharged) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kAlphaBeta)) << b.log();
  const std::string path = socketFor(b.dir() + "/fd");  // short: a Unix socket address
  ::unlink(path.c_str());
  const int listener = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  ASSERT_LT(path.size(), sizeof addr.sun_path);
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  ASSERT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(::listen(listener, 1), 0);
  // Unattributed memory found at the broker's first look is nobody's (docs/security.md): let it
  // look at an empty device first.
  std::this_thread::sleep_for(milliseconds(500));
  const uint64_t base = deviceUsed();
  int fd = -1;
  {
    Child a = b.tenantProcess("alpha");
    ASSERT_TRUE(a.send("export " + std::to_string(128 * MiB) + " " + path));
    fd = receiveDescriptor(listener);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(a.readLine(), "exported");
    EXPECT_EQ(usedOn0(b.tenant("alpha")), 128 * MiB) << "charged while the exporter lives";
    ASSERT_TRUE(a.send("quit"));
    ASSERT_EQ(a.wait(), 0);
  }
  EXPECT_EQ(deviceUsed(), base + 128 * MiB) << "the descriptor alone keeps the memory on the device";
  ASSERT_TRUE(waitFor([&] {
    return b.metrics().find("cushare_tenant_left_behind_bytes{tenant=\"alpha\",device=\"0\",uuid=\"" + kDevice0Uuid + "\"} " +
                            std::to_string(128 * MiB) + "\n") != std::string::npos;
  })) << b.metrics() << b.log();
  EXPECT_EQ(usedOn0(b.tenant("alpha")), 128 * MiB);
  Child a2 = b.tenantProcess("alpha");
  EXPECT_EQ(a2.ask("alloc " + std::to_string(200 * MiB)), "oom") << "128 MiB of alpha's 256 are still on the device";
  EXPECT_EQ(a2.ask("alloc " + std::to_string(128 * MiB)), "ok");
  EXPECT_EQ(deviceUsed(), base + 256 * MiB) << "the device holds no more than alpha's limit for it";
  EXPECT_TRUE(b.logHas("tenant alpha device 0: its exited processes left 128 MiB on the device")) << b.log();
  EXPECT_NE(b.metrics().find("cushare_tenant_left_behind_bytes{tenant=\"beta\",device=\"0\",uuid=\"" + kDevice0Uuid + "\"} 0\n"), std::string::npos);
  // The descriptor closed: the device frees the memory, the broker returns the charge.
  ::close(fd);
  EXPECT_EQ(deviceUsed(), base + 128 * MiB);
  EXPECT_TRUE(waitFor([&] { return usedOn0(b.tenant("alpha")) == 128 * MiB &&
                                   b.metrics().find("cushare_tenant_left_behind_bytes{tenant=\"alpha\",device=\"0\",uuid=\"" + kDevice0Uuid + "\"} 0\n") !=
                                       std::string::npos; }))
      << usedOn0(b.tenant("alpha")) << "\n" << b.metrics();
  EXPECT_EQ(a2.ask("alloc " + std::to_string(128 * MiB)), "ok");
  ASSERT_EQ(a2.ask("freeall"), "ok");
  // Again with an exporter that lives long enough for NVML's process list to show it holding the
  // memory (the first one exited at once, before any look).
  {
    Child a = b.tenantProcess("alpha");
    ASSERT_TRUE(a.send("export " + std::to_string(64 * MiB) + " " + path));
    fd = receiveDescriptor(listener);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(a.readLine(), "exported");
    ASSERT_TRUE(waitFor([&] { return deviceMemoryOn0().count(a.pid()) != 0; })) << "listed by NVML";
    std::this_thread::sleep_for(milliseconds(200));  // several broker ticks
    ASSERT_TRUE(a.send("quit"));
    ASSERT_EQ(a.wait(), 0);
  }
  ASSERT_TRUE(waitFor([&] {
    return b.metrics().find("cushare_tenant_left_behind_bytes{tenant=\"alpha\",device=\"0\",uuid=\"" + kDevice0Uuid + "\"} " +
                            std::to_string(64 * MiB) + "\n") != std::string::npos;
  })) << b.metrics() << b.log();
  EXPECT_EQ(usedOn0(b.tenant("alpha")), 64 * MiB);
  EXPECT_EQ(a2.ask("alloc " + std::to_string(200 * MiB)), "oom");
  ::close(fd);
  EXPECT_TRUE(waitFor([&] { return usedOn0(b.tenant("alpha")) == 0; })) << usedOn0(b.tenant("alpha"));
  ::close(listener);
}

// Honest processes that allocate and exit, one after another and side by side, leave nothing
// behind: no left-behind charge, whatever the timing of their exits against the broker's ticks.
TEST(Tamper, HonestExitsLeaveNothingBehind) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kAlphaBeta)) << b.log();
  std::this_thread::sleep_for(milliseconds(200));
  for (int round = 0; round < 12; ++round) {
    std::vector<Child> procs;
    for (int i = 0; i < 2; ++i) procs.push_back(b.tenantProcess(i == 0 ? "alpha" : "beta"));
    for (Child& c : procs) ASSERT_EQ(c.ask("alloc " + std::to_string(32 * MiB)), "ok");
    std::this_thread::sleep_for(milliseconds(round * 10));
    for (Child& c : procs) ASSERT_TRUE(c.send("quit"));
    for (Child& c : procs) ASSERT_EQ(c.wait(), 0);
  }
  std::this_thread::sleep_for(milliseconds(400));  // every exit decided
  const std::string m = b.metrics();
  EXPECT_NE(m.find("cushare_tenant_left_behind_bytes{tenant=\"alpha\",device=\"0\",uuid=\"" + kDevice0Uuid + "\"} 0\n"), std::string::npos) << m;
  EXPECT_NE(m.find("cushare_tenant_left_behind_bytes{tenant=\"beta\",device=\"0\",uuid=\"" + kDevice0Uuid + "\"} 0\n"), std::string::npos) << m;
  EXPECT_EQ(usedOn0(b.tenant("alpha")), 0u);
  EXPECT_EQ(b.log().find("left "), std::string::npos) << b.log();
}

// Honest processes allocating and freeing as fast as they can are never charged, with no
// allowance at all: the ledger and the device are read at different instants, and the check
// must not take an allocation in flight for hidden memory.
TEST(Tamper, HonestChurnIsNeverChargedAsHidden) {
  // Under TSan the broker's reads of the ledger around NVML's list are far apart, and an honest
  // allocation that lives entirely between them was caught three ticks in a row about once in ten
  // runs (docs/security.md says so; five are needed now): this runs in the plain stage only. With
  // three it also failed once in a clean-clone CI run on a loaded 2-core host.
  if (kUnderThreadSanitizer) GTEST_SKIP() << "timing: the broker's read window widens under ThreadSanitizer (docs/security.md)";
  Broker b(testDir());
  ASSERT_TRUE(b.start(kAlphaBeta)) << b.log();
  std::vector<Child> churners;
  for (int i = 0; i < 4; ++i) churners.push_back(b.tenantProcess("alpha"));
  for (Child& c : churners) ASSERT_TRUE(c.send("churn " + std::to_string(4 * MiB) + " 8 2000"));
  const auto until = Clock::now() + std::chrono::milliseconds(1900);
  int looks = 0;
  while (Clock::now() < until) {
    const std::string m = b.metrics();
    ASSERT_EQ(m.find("kind=\"hidden\""), std::string::npos) << m;
    ASSERT_NE(m.find("cushare_tenant_hidden_bytes{tenant=\"alpha\",device=\"0\",uuid=\"" + kDevice0Uuid + "\"} 0\n"), std::string::npos) << m;
    ++looks;
    std::this_thread::sleep_for(milliseconds(20));
  }
  uint64_t held = 0;
  for (Child& c : churners) {
    const std::string r = c.readLine(60000);
    ASSERT_EQ(r.rfind("churned ", 0), 0u) << r;
    EXPECT_GT(field(r, 1), 100u) << "churned enough to matter: " << r;
    held += field(r, 4);
  }
  EXPECT_EQ(usedOn0(b.tenant("alpha")), held);
  EXPECT_GT(looks, 20);
}

// The same attack from a process in a pid namespace of its own (a container): its slot records
// its namespace's pid, the device reports the host's; the broker maps one to the other.
TEST(Tamper, HiddenMemoryIsFoundAcrossPidNamespaces) {
  if (::geteuid() != 0) GTEST_SKIP() << "pid namespaces need root (CI runs as root)";
  Broker b(testDir());
  ASSERT_TRUE(b.start(kAlphaBeta)) << b.log();
  Child a = b.tenantProcessIn({"/usr/bin/unshare", "--pid", "--fork"}, "alpha");
  const std::string pidLine = a.ask("pid");
  ASSERT_EQ(pidLine.rfind("pid ", 0), 0u) << pidLine;
  const int nsPid = std::stoi(pidLine.substr(4));
  ASSERT_EQ(a.ask("alloc " + std::to_string(200 * MiB)), "ok");
  // The device reports a host pid that is not the pid the process sees.
  int hostPid = 0;
  for (const auto& [pid, bytes] : deviceMemoryOn0())
    if (bytes == 200 * MiB) hostPid = pid;
  ASSERT_NE(hostPid, 0);
  ASSERT_NE(hostPid, nsPid);
  ASSERT_EQ(a.ask("zero"), "ok");
  ASSERT_EQ(a.ask("alloc " + std::to_string(200 * MiB)), "ok");
  ASSERT_TRUE(waitFor([&] { return usedOn0(b.tenant("alpha")) == 400 * MiB; })) << b.log();
  EXPECT_EQ(a.ask("alloc " + std::to_string(1 * MiB)), "oom");
  EXPECT_EQ(deviceHeld({hostPid}), 400 * MiB);
  EXPECT_NE(b.log().find("pid " + std::to_string(hostPid) + " (" + std::to_string(nsPid) + " in its pid namespace): 400 MiB on the device, 200 MiB in its ledger slot"),
            std::string::npos) << b.log();
}

// A process closes its ledger descriptor, which lets go of its slot's lock: the broker's reaper
// (and the other processes' reapers) must not take that for death while the process lives. Its
// usage stays in the ledger, the other processes of the tenant are held to the limit; once it
// exits, its usage is returned.
TEST(Tamper, ClosedLedgerDescriptorDoesNotReturnALiveProcesssUsage) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kAlphaBeta)) << b.log();
  Child a = b.tenantProcess("alpha");
  ASSERT_EQ(a.ask("alloc " + std::to_string(200 * MiB)), "ok");
  ASSERT_EQ(a.ask("closeledger"), "closed 1");
  ASSERT_TRUE(waitFor([&] { return b.metrics().find("cushare_tenant_tamper_total{tenant=\"alpha\",kind=\"descriptor\"} 1\n") != std::string::npos; }))
      << b.log();
  EXPECT_EQ(usedOn0(b.tenant("alpha")), 200 * MiB) << "a live process's slot is never reaped";
  Child a2 = b.tenantProcess("alpha");
  EXPECT_EQ(a2.ask("alloc " + std::to_string(100 * MiB)), "oom");
  EXPECT_EQ(deviceHeld({a.pid(), a2.pid()}), 200 * MiB);
  EXPECT_TRUE(b.logHas("tenant alpha: process " + std::to_string(a.pid()) + " let go of its ledger slot's lock")) << b.log();
  a.kill(SIGKILL);
  a.wait();
  EXPECT_TRUE(waitFor([&] { return usedOn0(b.tenant("alpha")) == 0; })) << "returned once it is gone";
  EXPECT_EQ(a2.ask("alloc " + std::to_string(256 * MiB)), "ok");
}

// A process rewrites the UUID and the limit of the device entry its tenant's processes use: the
// broker writes both back (a new entry for the device would leave the running processes on the
// renamed one, unwatched), and the limit holds on the device.
TEST(Tamper, RewrittenDeviceUuidAndLimitAreRestored) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kAlphaBeta)) << b.log();
  Child a = b.tenantProcess("alpha");
  const std::string path = b.ledgerDir() + "/alpha.ledger";
  const size_t entry0 = offsetof(LedgerHeader, devices);
  uint8_t uuid[16];
  {
    const int fd = ::open(path.c_str(), O_RDONLY);
    ASSERT_EQ(::pread(fd, uuid, 16, static_cast<off_t>(entry0 + offsetof(LedgerDevice, uuid))), 16);
    ::close(fd);
  }
  const uint8_t garbage[16] = {0xde, 0xad, 0xbe, 0xef};
  const uint64_t huge = 64ull << 30;
  rawWrite(path, entry0 + offsetof(LedgerDevice, uuid), garbage, 16);
  rawWrite(path, entry0 + offsetof(LedgerDevice, limit), &huge, 8);
  auto ledger = observe(b.ledgerDir(), "alpha");
  ASSERT_TRUE(ledger);
  EXPECT_TRUE(waitFor([&] {
    uint8_t now[16];
    return ledger->deviceUuid(0, now) && std::memcmp(now, uuid, 16) == 0 && ledger->limit(0) == 256 * MiB;
  })) << b.log();
  EXPECT_EQ(ledger->findDevice(uuid), 0) << "no second entry for the device";
  EXPECT_EQ(a.ask("alloc " + std::to_string(300 * MiB)), "oom");
  EXPECT_EQ(a.ask("fill " + std::to_string(16 * MiB)), "held " + std::to_string(256 * MiB));
  EXPECT_EQ(deviceHeld({a.pid()}), 256 * MiB);
  EXPECT_TRUE(b.logHas("tenant alpha: the device UUID of ledger entry 0 was rewritten outside the broker")) << b.log();
  const std::string m = b.metrics();
  EXPECT_NE(m.find("cushare_tenant_tamper_total{tenant=\"alpha\",kind=\"uuid\"} 1\n"), std::string::npos) << m;
  EXPECT_NE(m.find("cushare_tenant_tamper_total{tenant=\"alpha\",kind=\"limit\"} 1\n"), std::string::npos) << m;
}

// A tenant that frees its ledger's entry for a device and writes a new one for it further on (found
// by an attack review of the limits files): its running processes still count in the first entry,
// which its limits file published, so that entry is put back (tampering) and stays the one the
// broker keeps and changes. Before, the broker followed the ledger: a live limit change no longer
// reached the running processes, and the new entry was a fresh, empty row with the whole limit.
TEST(Tamper, AFreedLedgerEntryIsPutBack) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kAlphaBeta)) << b.log();
  Child a = b.tenantProcess("alpha");
  ASSERT_EQ(a.ask("alloc " + std::to_string(64 * MiB)), "ok");
  const std::string path = b.ledgerDir() + "/alpha.ledger";
  const size_t entry0 = offsetof(LedgerHeader, devices), entry1 = entry0 + sizeof(LedgerDevice);
  uint8_t uuid[16];
  {
    const int fd = ::open(path.c_str(), O_RDONLY);
    ASSERT_EQ(::pread(fd, uuid, 16, static_cast<off_t>(entry0)), 16);
    ::close(fd);
  }
  const uint64_t huge = 64ull << 30;
  const uint32_t ready = kLedgerDeviceReady, freed = kLedgerDeviceFree;
  ASSERT_TRUE(stopProcess(b.pid()));
  rawWrite(path, entry1 + offsetof(LedgerDevice, uuid), uuid, 16);
  rawWrite(path, entry1 + offsetof(LedgerDevice, limit), &huge, 8);
  rawWrite(path, entry1 + offsetof(LedgerDevice, state), &ready, 4);
  rawWrite(path, entry0 + offsetof(LedgerDevice, state), &freed, 4);
  ASSERT_EQ(::kill(b.pid(), SIGCONT), 0);
  EXPECT_TRUE(waitFor([&] { return b.logHas("tenant alpha: ledger entry 0 was freed outside the broker"); }))
      << b.log();
  ASSERT_TRUE(b.setLimit("alpha", "100MiB").ok());
  const std::string view = a.ask("info");
  EXPECT_EQ(view.substr(view.find("total")), "total " + std::to_string(100 * MiB)) << "the change reaches it";
  Child later = b.tenantProcess("alpha");
  EXPECT_EQ(later.ask("fill " + std::to_string(4 * MiB)), "held " + std::to_string(36 * MiB));
  EXPECT_EQ(deviceHeld({a.pid(), later.pid()}), 100 * MiB) << "the device's own count";
  auto ledger = observe(b.ledgerDir(), "alpha");
  ASSERT_TRUE(ledger);
  EXPECT_EQ(ledger->findDevice(uuid), 0) << "entry 0 names the device again";
  EXPECT_EQ(ledger->limit(1), 0u) << "the second entry has no budget";
}

// The same, through a truncation (found by the same review): the tenant truncates its ledger, under
// its flock, long enough for the broker to drop it and scan without it, then writes the old bytes back with entry 0 freed and a new
// entry 1 for the device. The broker's limits file for the ledger is kept while the ledger is
// named (before, the broker deleted it when it dropped the ledger, and published the new entry in a
// fresh file with the whole limit: a second budget beside the running process's frozen one).
TEST(Tamper, ATruncatedLedgerKeepsItsLimitsFile) {
  if (kUnderThreadSanitizer) GTEST_SKIP() << kSigbusUnderTsan;
  Broker b(testDir());
  ASSERT_TRUE(b.start(kAlphaBeta)) << b.log();
  Child a = b.tenantProcess("alpha");
  ASSERT_EQ(a.ask("alloc " + std::to_string(64 * MiB)), "ok");
  const std::string path = b.ledgerDir() + "/alpha.ledger";
  std::string bytes = readFile(path);
  ASSERT_EQ(bytes.size(), kLedgerFileSize);
  const size_t entry0 = offsetof(LedgerHeader, devices), entry1 = entry0 + sizeof(LedgerDevice);
  std::memcpy(&bytes[entry1], &bytes[entry0], sizeof(LedgerDevice));  // entry 1: the device, ready
  const uint32_t freed = kLedgerDeviceFree;
  std::memcpy(&bytes[entry0 + offsetof(LedgerDevice, state)], &freed, 4);
  // Truncated under the file's flock, so that the broker cannot open it again meanwhile: it goes
  // on without the ledger for a few scans.
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX), 0);
  ASSERT_EQ(::ftruncate(fd, 0), 0);
  EXPECT_TRUE(waitFor([&] { return !b.tenant("alpha").error().empty(); })) << "the broker dropped it";
  std::this_thread::sleep_for(milliseconds(1300));  // a directory scan (every 20 ticks) without it
  ASSERT_EQ(::pwrite(fd, bytes.data(), bytes.size(), 0), static_cast<ssize_t>(bytes.size()));
  ::close(fd);
  EXPECT_TRUE(waitFor([&] { return b.tenant("alpha").error().empty(); })) << b.tenant("alpha").error();
  ASSERT_TRUE(b.setLimit("alpha", "100MiB").ok());
  const std::string view = a.ask("info");
  EXPECT_EQ(view.substr(view.find("total")), "total " + std::to_string(100 * MiB)) << "its limits file is live";
  Child later = b.tenantProcess("alpha");
  EXPECT_EQ(later.ask("fill " + std::to_string(4 * MiB)), "held " + std::to_string(36 * MiB));
  EXPECT_EQ(deviceHeld({a.pid(), later.pid()}), 100 * MiB) << "the device's own count";
}

// A second entry for the device, written by the tenant (a shim adds one only when none is found,
// under flock): a process that found it first would have a second budget there. Found by an
// attack review: the broker gave every entry naming the device the tenant's limit. It gets 0.
TEST(Tamper, ASecondLedgerEntryForADeviceGetsNoBudget) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kAlphaBeta)) << b.log();
  Child a = b.tenantProcess("alpha");
  const std::string path = b.ledgerDir() + "/alpha.ledger";
  const size_t entry0 = offsetof(LedgerHeader, devices), entry1 = entry0 + sizeof(LedgerDevice);
  uint8_t uuid[16];
  {
    const int fd = ::open(path.c_str(), O_RDONLY);
    ASSERT_EQ(::pread(fd, uuid, 16, static_cast<off_t>(entry0 + offsetof(LedgerDevice, uuid))), 16);
    ::close(fd);
  }
  const uint64_t limit = 256 * MiB;
  const uint32_t ready = kLedgerDeviceReady;
  rawWrite(path, entry1 + offsetof(LedgerDevice, uuid), uuid, 16);
  rawWrite(path, entry1 + offsetof(LedgerDevice, limit), &limit, 8);
  rawWrite(path, entry1 + offsetof(LedgerDevice, state), &ready, 4);
  auto ledger = observe(b.ledgerDir(), "alpha");
  ASSERT_TRUE(ledger);
  EXPECT_TRUE(waitFor([&] { return ledger->limit(1) == 0; })) << b.log();
  EXPECT_EQ(ledger->limit(0), 256 * MiB);
  EXPECT_TRUE(b.logHas("tenant alpha device 0 (a second entry for it): the limit in its ledger was changed to")) << b.log();
  const std::string m = b.metrics();
  EXPECT_NE(m.find("cushare_tenant_tamper_total{tenant=\"alpha\",kind=\"limit\"} 1\n"), std::string::npos) << m;
  EXPECT_EQ(a.ask("fill " + std::to_string(16 * MiB)), "held " + std::to_string(256 * MiB));
}

// A limit rewritten in the ledger grants nothing, not even before the broker's next tick puts it
// back: under a broker a shim enforces the limit of the broker's limits file (limits_file.h), which
// the tenant cannot write. The broker is stopped (SIGSTOP) across the rewrite and the allocation,
// so the window is certain. Before, the shim believed the ledger: the device held 1040 MiB for a
// 256 MiB limit until the broker took it back (the second review: 4096 MiB for 512 MiB, kept for
// as long as the process lived, before tamper_response existed).
TEST(Tamper, ARewrittenLimitGrantsNothingBeforeTheBrokerPutsItBack) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kAlphaBeta)) << b.log();
  Child a = b.tenantProcess("alpha");
  ASSERT_EQ(a.ask("alloc " + std::to_string(16 * MiB)), "ok");
  const std::string path = b.ledgerDir() + "/alpha.ledger";
  const uint64_t huge = 64ull << 30;
  ASSERT_TRUE(stopProcess(b.pid()));
  rawWrite(path, offsetof(LedgerHeader, devices) + offsetof(LedgerDevice, limit), &huge, 8);
  const std::string r = a.ask("alloc " + std::to_string(1024 * MiB));
  Child later = b.tenantProcess("alpha");  // a process started while the ledger says 64 GiB
  const std::string r2 = later.ask("alloc " + std::to_string(1024 * MiB));
  const uint64_t held = deviceHeld({a.pid(), later.pid()});
  ASSERT_EQ(::kill(b.pid(), SIGCONT), 0);
  EXPECT_EQ(r, "oom") << "the shim believed the rewritten limit";
  EXPECT_EQ(r2, "oom") << "a new process believed the rewritten limit";
  EXPECT_EQ(held, 16 * MiB) << "the device's own count";
  EXPECT_EQ(later.ask("alloc " + std::to_string(240 * MiB)), "ok") << "the limit itself still holds";
  EXPECT_EQ(later.ask("alloc 1"), "oom");
  EXPECT_TRUE(waitFor([&] { return b.log().find("the limit in its ledger was changed to 64 GiB outside the broker; "
                                                "restored to 256 MiB") != std::string::npos; })) << b.log();
  const std::string m = b.metrics();
  EXPECT_NE(m.find("cushare_tenant_tamper_total{tenant=\"alpha\",kind=\"limit\"} 1\n"), std::string::npos) << m;
}

// What tamper_response kill does when a ledger entry holds more than its restored limit (the shim
// never reserves past the broker's limit; a process that wrote its counters, or a shim of an older
// cushare that believed its ledger, can): the tenant's processes holding memory there are killed
// and the device frees what they held. Here the counters are written by hand while the broker is
// stopped, beside a rewritten limit.
TEST(Tamper, AnEntryPastItsRestoredLimitIsTakenBack) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kAlphaBetaKill)) << b.log();
  Child a = b.tenantProcess("alpha");
  Child other = b.tenantProcess("beta");
  ASSERT_EQ(other.ask("alloc " + std::to_string(16 * MiB)), "ok");
  ASSERT_EQ(a.ask("alloc " + std::to_string(16 * MiB)), "ok");
  const int pid = a.pid();
  const int slot = slotHolding(b, "alpha", 16 * MiB);
  ASSERT_GE(slot, 0);
  const std::string path = b.ledgerDir() + "/alpha.ledger";
  const uint64_t huge = 64ull << 30, counted = 1040 * MiB;
  ASSERT_TRUE(stopProcess(b.pid()));
  rawWrite(path, offsetof(LedgerHeader, devices) + offsetof(LedgerDevice, limit), &huge, 8);
  rawWrite(path, ledgerUsedOffset(0, static_cast<uint32_t>(slot)), &counted, 8);
  ASSERT_EQ(::kill(b.pid(), SIGCONT), 0);
  ASSERT_NO_FATAL_FAILURE(expectKilledAndFreed(b, a, pid, 0));
  EXPECT_EQ(other.ask("alloc " + std::to_string(16 * MiB)), "ok") << "another tenant is not touched";
  EXPECT_TRUE(b.logHas("tenant alpha: ledger entry 0 holds 1.02 GiB past its restored limit 256 MiB: pid " +
                         std::to_string(pid) + " killed (tamper_response: kill)")) << b.log();
}

// A process that takes bytes off its own slot's counter around an allocation and puts them back
// (found by the second attack review of the limits files): its row then holds more than the limit
// honestly, as the device does, so the hidden-memory check sees nothing. An honest row never grows
// above its limit by reserving; one found above it five ticks in a row is tampering, taken back
// with tamper_response kill. The broker is stopped across the writes so the window is certain.
// forgePid: the slot's pid word is rewritten too; spinLimit: the ledger's limit word is rewritten
// to "no limit" in a loop the whole time.
void expectCountersWrittenAroundTakenBack(bool forgePid, bool spinLimit = false) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kAlphaBetaKill)) << b.log();
  Child a = b.tenantProcess("alpha");
  ASSERT_EQ(a.ask("alloc " + std::to_string(200 * MiB)), "ok");
  const int pid = a.pid();
  const int slot = slotHolding(b, "alpha", 200 * MiB);
  ASSERT_GE(slot, 0);
  std::this_thread::sleep_for(milliseconds(300));  // ticks that see the row as it honestly is
  const std::string path = b.ledgerDir() + "/alpha.ledger";
  const uint64_t zero = 0, both = 400 * MiB;
  const int32_t forged = 1;
  ASSERT_TRUE(stopProcess(b.pid()));
  rawWrite(path, ledgerUsedOffset(0, static_cast<uint32_t>(slot)), &zero, 8);
  const std::string second = a.ask("alloc " + std::to_string(200 * MiB));
  rawWrite(path, ledgerUsedOffset(0, static_cast<uint32_t>(slot)), &both, 8);
  if (forgePid) rawWrite(path, ledgerPidOffset(static_cast<uint32_t>(slot)), &forged, 4);
  const uint64_t held = deviceHeld({pid});
  std::atomic<bool> stop{false};
  std::thread spinner([&] {  // through a mapping, as a tenant's process would: every few nanoseconds
    if (!spinLimit) return;
    const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    void* m = fd < 0 ? MAP_FAILED : ::mmap(nullptr, sizeof(LedgerHeader), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (fd >= 0) ::close(fd);
    if (m == MAP_FAILED) return;
    auto* limit = reinterpret_cast<std::atomic<uint64_t>*>(static_cast<char*>(m) + offsetof(LedgerHeader, devices) +
                                                           offsetof(LedgerDevice, limit));
    while (!stop) limit->store(kLedgerNoLimit, std::memory_order_relaxed);
    ::munmap(m, sizeof(LedgerHeader));
  });
  ASSERT_EQ(::kill(b.pid(), SIGCONT), 0);
  ASSERT_EQ(second, "ok") << "the shim believed its own counter";
  EXPECT_EQ(held, 400 * MiB) << "past the limit on the device";
  const int status = a.wait(5000);
  stop = true;
  spinner.join();
  ASSERT_TRUE(status != -1 && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status << "\n" << b.log();
  EXPECT_TRUE(waitFor([&] { return deviceHeld({pid}) == 0; }, milliseconds(2000))) << "the device freed it";
  if (spinLimit) return;  // taken back as a rewritten limit's entry, by the published limit
  EXPECT_TRUE(b.logHas("tenant alpha: ledger entry 0 holds 400 MiB against a limit of 256 MiB")) << b.log();
  EXPECT_NE(b.metrics().find("cushare_tenant_tamper_total{tenant=\"alpha\",kind=\"counters\"} 1\n"), std::string::npos);
}

TEST(Tamper, CountersWrittenAroundAnAllocationAreFound) { expectCountersWrittenAroundTakenBack(false); }

// The same, the slot's pid word rewritten too: which processes to take down is the device's word,
// not the ledger's (found by an attack review: the broker matched processes by the slot's pid,
// which the tenant writes, and killed nothing; the device kept 600 MiB for a 512 MiB limit).
TEST(Tamper, CountersWrittenUnderAForgedSlotPidAreStillTakenBack) { expectCountersWrittenAroundTakenBack(true); }

// The same, the ledger's limit word rewritten to "no limit" in a loop: the broker judges the row
// by the published limit (the limits file's), not by the word it has just put back (found by a
// review: the take-back read the tenant's word and killed nothing).
TEST(Tamper, CountersWrittenWhileTheLimitWordIsRewrittenInALoopAreTakenBack) {
  expectCountersWrittenAroundTakenBack(false, true);
}

// A row written up before the broker's first look (here: across a restart) is no allowance beyond
// what the device holds for the tenant: the row is found above it and taken back. Before, the
// first look's row became the ceiling, and counters then written around each allocation let the
// device hold 900 MiB for a 512 MiB limit, nothing logged (found by an attack review).
TEST(Tamper, ARowInflatedBeforeTheBrokersFirstLookIsNoAllowance) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kAlphaBetaKill)) << b.log();
  Child a = b.tenantProcess("alpha");
  ASSERT_EQ(a.ask("alloc " + std::to_string(100 * MiB)), "ok");
  const int pid = a.pid();
  const int slot = slotHolding(b, "alpha", 100 * MiB);
  ASSERT_GE(slot, 0);
  ASSERT_EQ(b.stop(), 0);
  const uint64_t inflated = 2048 * MiB;
  rawWrite(b.ledgerDir() + "/alpha.ledger", ledgerUsedOffset(0, static_cast<uint32_t>(slot)), &inflated, 8);
  ASSERT_TRUE(b.start(kAlphaBetaKill)) << b.log();
  ASSERT_NO_FATAL_FAILURE(expectKilledAndFreed(b, a, pid, 0));
  EXPECT_TRUE(b.logHas("tenant alpha: ledger entry 0 holds 2 GiB against a limit of 256 MiB")) << b.log();
}

// A live limit lowered below what a tenant's row holds is not tampering: the row only drains.
TEST(Tamper, ARowAboveALoweredLimitIsNotTampering) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kAlphaBetaKill)) << b.log();
  Child a = b.tenantProcess("alpha");
  ASSERT_EQ(a.ask("alloc " + std::to_string(200 * MiB)), "ok");
  ASSERT_EQ(a.ask("alloc " + std::to_string(40 * MiB)), "ok");
  ASSERT_TRUE(b.setLimit("alpha", "100MiB").ok());
  std::this_thread::sleep_for(milliseconds(500));  // ten ticks
  EXPECT_EQ(a.ask("alloc " + std::to_string(1 * MiB)), "oom");
  std::this_thread::sleep_for(milliseconds(500));
  EXPECT_EQ(a.ask("held"), "held " + std::to_string(240 * MiB)) << "alive, holding what it had";
  EXPECT_EQ(b.log().find("wrote its usage counters"), std::string::npos) << b.log();
}

// A hard link to the ledger (made by the tenant's user, anywhere on the same filesystem) must not
// make the broker let go of it, at a restart or a reload: the limit is still restored.
TEST(Tamper, HardLinkDoesNotStopTheBrokerWatching) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kAlphaBeta)) << b.log();
  const std::string path = b.ledgerDir() + "/alpha.ledger";
  ASSERT_EQ(::link(path.c_str(), (b.dir() + "/alpha.link").c_str()), 0);
  ASSERT_EQ(b.stop(), 0);
  ASSERT_TRUE(b.startWithFile()) << b.log();
  ASSERT_TRUE(b.reload().ok());
  EXPECT_EQ(b.tenant("alpha").error(), "");
  const uint64_t huge = 64ull << 30;
  rawWrite(path, offsetof(LedgerHeader, devices) + offsetof(LedgerDevice, limit), &huge, 8);
  EXPECT_TRUE(waitFor([&] { return b.log().find("the limit in its ledger was changed to 64 GiB outside the broker; restored to 256 MiB") != std::string::npos; }))
      << b.log();
  Child a = b.tenantProcess("alpha");
  EXPECT_EQ(a.ask("fill " + std::to_string(16 * MiB)), "held " + std::to_string(256 * MiB));
  EXPECT_TRUE(waitFor([&] { return b.metrics().find("cushare_tenant_tamper_total{tenant=\"alpha\",kind=\"link\"} 1\n") != std::string::npos; }))
      << b.metrics();
}


// Everything the broker sends on fd until it closes (or timeoutMs), parsed as one framed response.
bool readResponse(int fd, rpc::Response* r, int timeoutMs = 5000) {
  std::string answer;
  char buf[4096];
  const auto end = Clock::now() + milliseconds(timeoutMs);
  for (;;) {
    const auto left = std::chrono::duration_cast<milliseconds>(end - Clock::now()).count();
    pollfd p{fd, POLLIN, 0};
    if (left <= 0 || ::poll(&p, 1, static_cast<int>(left)) != 1) break;
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n <= 0) break;
    answer.append(buf, static_cast<size_t>(n));
  }
  return answer.size() >= 4 && r->ParseFromString(answer.substr(4));
}

rpc::Request statusRequest() {
  rpc::Request r;
  r.set_version(1);
  r.mutable_status();
  return r;
}

// A truncated frame followed by shutdown(SHUT_WR): the client is told what was missing, rather
// than getting a closed connection.
TEST(Security, HalfClosedTruncatedFrameGetsItsError) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kTwoTenants)) << b.log();
  const std::pair<std::string, std::string> cases[] = {
      {std::string("\x10\x00\x00\x00" "ab", 6), "malformed request: truncated message: got 2 of 16 bytes"},
      {std::string("\x10\x00", 2), "malformed request: truncated message: got 2 of the 4 length bytes"},
      {"", "malformed request: no message: the connection closed before its first byte"}};
  for (const auto& [bytes, error] : cases) {
    const int fd = connectUnix(b.socket());
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
    ASSERT_EQ(::shutdown(fd, SHUT_WR), 0);
    rpc::Response r;
    EXPECT_TRUE(readResponse(fd, &r)) << error;
    EXPECT_FALSE(r.ok());
    EXPECT_EQ(r.error(), error);
    ::close(fd);
  }
  EXPECT_EQ(b.status().tenants(), 2u) << "still answering";
}

// Runs `cushare --socket SOCKET ARGS` as uid:gid in the background; its output goes to out. The
// CLI runs from a stage every user can read (the checkout may lie where uid cannot enter).
pid_t cliAs(uid_t uid, const std::string& socket, const std::string& args, const std::string& out) {
  static UserStage stage;  // staged once, removed at exit
  static const std::string cli = stage.copy(CLI_BIN, "cushare");
  const pid_t pid = ::fork();
  if (pid == 0) {
    if (::setgroups(0, nullptr) != 0 || ::setgid(uid) != 0 || ::setuid(uid) != 0) ::_exit(99);
    const std::string cmd = cli + " --socket " + socket + " " + args + " > " + out + " 2>&1";
    ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  return pid;
}

int exitOf(pid_t pid) {
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// Four users hold all 64 connection slots with silent connections. A fifth is told, in one line
// and at once, that the broker is busy; the CLI tries again for about 2 s and then says so with
// exit status 1, and succeeds when a slot frees up while it is trying.
TEST(Security, FullSocketSaysBusyAndTheCliRetries) {
  if (::geteuid() != 0) GTEST_SKIP() << "switching users needs root (CI runs as root)";
  Broker b(testDir());
  ASSERT_TRUE(b.start(kTwoTenants)) << b.log();
  const std::string sock = b.socket();
  const std::string outDir = b.dir() + "/cli";
  ASSERT_EQ(::mkdir(outDir.c_str(), 0777), 0);
  ASSERT_EQ(::chmod(outDir.c_str(), 0777), 0);
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  std::vector<pid_t> hogs;
  for (uid_t uid = 2001; uid <= 2004; ++uid) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      if (::setgid(uid) != 0 || ::setuid(uid) != 0) ::_exit(99);
      std::vector<int> fds;
      for (int i = 0; i < 16; ++i) {
        fds.push_back(connectUnix(sock));
        if (fds.back() < 0) ::_exit(98);
      }
      (void)!::write(ready[1], "r", 1);
      ::pause();
      ::_exit(0);
    }
    hogs.push_back(pid);
  }
  for (size_t i = 0; i < hogs.size(); ++i) {
    char c;
    ASSERT_EQ(::read(ready[0], &c, 1), 1);
  }
  // Queued behind the 64 (a listen backlog is first come, first served): refused with busy.
  EXPECT_EQ(asUser(3000, 3000, {}, [&] {
              rpc::Response r;
              std::string err;
              if (!rpc::call(sock, statusRequest(), &r, &err)) return 2;
              return !r.ok() && r.busy() &&
                             r.error() == "broker busy: all 64 connections are in use; try again shortly"
                         ? 0
                         : 1;
            }),
            0);
  const std::string out = outDir + "/out.txt";
  auto t0 = Clock::now();
  EXPECT_EQ(exitOf(cliAs(3000, sock, "status", out)), 1);
  const auto took = Clock::now() - t0;
  EXPECT_GE(took, milliseconds(1500)) << "it retried";
  EXPECT_LT(took, milliseconds(4000)) << "briefly";
  EXPECT_NE(readFile(out).find("cushare: broker busy: all 64 connections are in use"), std::string::npos)
      << readFile(out);
  // A slot frees up while the CLI retries: it gets its answer.
  const pid_t cli = cliAs(3000, sock, "status", out);
  std::this_thread::sleep_for(milliseconds(300));
  ::kill(hogs.back(), SIGKILL);
  ::waitpid(hogs.back(), nullptr, 0);
  hogs.pop_back();
  EXPECT_EQ(exitOf(cli), 0) << readFile(out);
  EXPECT_NE(readFile(out).find("ledger dir"), std::string::npos) << readFile(out);
  for (pid_t pid : hogs) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
  }
  EXPECT_EQ(b.status().tenants(), 2u);
}

// One user sending requests as fast as it can from four processes (so always at its 16
// connections), and connecting and hanging up as fast as it can from four more, delays another
// user's answers by milliseconds, not seconds.
TEST(Security, ARequestFloodDoesNotStarveOtherUsers) {
  if (::geteuid() != 0) GTEST_SKIP() << "switching users needs root (CI runs as root)";
  Broker b(testDir());
  ASSERT_TRUE(b.start(kTwoTenants)) << b.log();
  const std::string sock = b.socket();
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  std::vector<pid_t> flood;
  for (int i = 0; i < 8; ++i) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      if (::setgid(2000) != 0 || ::setuid(2000) != 0) ::_exit(99);
      for (int n = 0;; ++n) {
        if (i % 2 == 0) {
          rpc::Response r;
          std::string err;
          rpc::call(sock, statusRequest(), &r, &err);
        } else {
          const int fd = connectUnix(sock);
          if (fd >= 0) ::close(fd);
        }
        if (n == 20) (void)!::write(ready[1], "r", 1);
      }
    }
    flood.push_back(pid);
  }
  for (size_t i = 0; i < flood.size(); ++i) {
    char c;
    ASSERT_EQ(::read(ready[0], &c, 1), 1);
  }
  EXPECT_EQ(asUser(3000, 3000, {}, [&] {
              // Starved, answers took seconds (or never came); on a loaded 2-core host one
              // scheduling gap can take a few hundred ms, so the worst is bounded at 2 s and the
              // median, which one gap cannot move, at 250 ms.
              std::vector<Clock::duration> took;
              for (int i = 0; i < 21; ++i) {
                const auto t0 = Clock::now();
                rpc::Response r;
                std::string err;
                if (!rpc::call(sock, statusRequest(), &r, &err) || !r.ok()) return 2;
                took.push_back(Clock::now() - t0);
              }
              std::sort(took.begin(), took.end());
              const auto ms = [](Clock::duration d) {
                return static_cast<long long>(std::chrono::duration_cast<milliseconds>(d).count());
              };
              std::printf("answers under the flood: median %lld ms, worst %lld ms\n", ms(took[10]), ms(took.back()));
              std::fflush(stdout);  // the child ends in _exit
              return took[10] < milliseconds(250) && took.back() < milliseconds(2000) ? 0 : 1;
            }),
            0);
  EXPECT_TRUE(b.setLimit("alpha", "256MiB").ok()) << "an administrator too";
  for (pid_t pid : flood) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
  }
}

// A tenant writes another process's pid into its ledger slot: `cushare processes` does not name
// that process as the tenant's. It names the process the kernel says holds the slot, and reports
// the slot's claim as unverified.
TEST(Security, ProcessesCannotBeMadeToNameAnotherProcess) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kTwoTenants)) << b.log();
  Child alpha = b.tenantProcess("alpha");
  ASSERT_EQ(alpha.ask("alloc " + std::to_string(64 * MiB)), "ok");
  rpc::Request req;
  req.set_version(1);
  req.mutable_processes()->set_tenant("alpha");
  rpc::ProcessesReply before = b.call(req).processes();
  ASSERT_EQ(before.processes_size(), 1);
  EXPECT_EQ(before.processes(0).pid(), alpha.pid());
  EXPECT_EQ(before.processes(0).host_pid(), alpha.pid());
  EXPECT_TRUE(before.processes(0).pid_verified());
  // The raw write: pid[s] (offset 17536 + 4 s, docs/ledger-abi.md) of alpha's slot := the broker's.
  const int fd = ::open((b.ledgerDir() + "/alpha.ledger").c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  int slot = -1;
  for (int s = 0; s < 128 && slot < 0; ++s) {
    int32_t pid = 0;
    ASSERT_EQ(::pread(fd, &pid, 4, 17536 + 4 * s), 4);
    if (pid == alpha.pid()) slot = s;
  }
  ASSERT_GE(slot, 0);
  const int32_t other = b.pid();
  ASSERT_EQ(::pwrite(fd, &other, 4, 17536 + 4 * slot), 4);
  ::close(fd);
  rpc::ProcessesReply after = b.call(req).processes();
  ASSERT_EQ(after.processes_size(), 1);
  EXPECT_EQ(after.processes(0).pid(), b.pid()) << "the slot's claim, reported as a claim";
  EXPECT_FALSE(after.processes(0).pid_verified());
  EXPECT_EQ(after.processes(0).host_pid(), alpha.pid()) << "the real holder";
  EXPECT_EQ(usedOn0(b.tenant("alpha")), 64 * MiB);
  // The CLI's table names alpha's process; the broker's pid appears only as the slot's claim.
  const std::string out = b.dir() + "/out.txt";
  EXPECT_EQ(exitOf(cliAs(0, b.socket(), "processes", out)), 0);
  const std::string table = readFile(out);
  EXPECT_NE(table.find("alpha   " + std::to_string(alpha.pid()) + " (slot says " + std::to_string(b.pid()) + ")"),
            std::string::npos)
      << table;
  EXPECT_EQ(table.find("alpha   " + std::to_string(b.pid()) + " "), std::string::npos) << table;
}

// ---- The CLI ----

TEST(Cli, RunEnvAndTables) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kTwoTenants)) << b.log();
  auto sh = [&](const std::string& cmd) {
    const std::string full = std::string(CLI_BIN) + " --socket " + b.socket() + " " + cmd + " > " + b.dir() +
                             "/out.txt 2>&1";
    const int st = std::system(full.c_str());
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  };
  EXPECT_EQ(sh("run --tenant alpha -- sh -c 'exit 7'"), 7) << "the command's own exit status";
  EXPECT_EQ(sh("run --tenant alpha -- sh -c 'echo $CUSHARE_TENANT $CUSHARE_LEDGER_DIR'"), 0);
  EXPECT_EQ(readFile(b.dir() + "/out.txt"), "alpha " + b.ledgerDir() + "\n");
  EXPECT_EQ(sh(std::string("run --tenant alpha --memory 128MiB -- ") + WORKER_BIN + " < /dev/null"), 0);
  EXPECT_EQ(sh("run --tenant gamma -- true"), 1);
  EXPECT_NE(readFile(b.dir() + "/out.txt").find("not configured"), std::string::npos);
  EXPECT_EQ(sh("env --tenant beta"), 0);
  const std::string env = readFile(b.dir() + "/out.txt");
  EXPECT_NE(env.find("CUSHARE_TENANT=beta\n"), std::string::npos) << env;
  EXPECT_NE(env.find("CUSHARE_THREAD_PERCENTAGE=25\n"), std::string::npos) << env;
  EXPECT_NE(env.find("LD_PRELOAD=" + std::string(SHIM_LIB) + "\n"), std::string::npos) << env;
  EXPECT_EQ(sh("--json env --tenant beta"), 0);
  EXPECT_NE(readFile(b.dir() + "/out.txt").find("{\"CUSHARE_TENANT\": \"beta\", "), std::string::npos)
      << readFile(b.dir() + "/out.txt");
  EXPECT_EQ(sh("set-limit alpha --memory 300MiB"), 0);
  EXPECT_EQ(sh("tenants"), 0);
  const std::string table = readFile(b.dir() + "/out.txt");
  EXPECT_NE(table.find("300 MiB*"), std::string::npos) << table;
  EXPECT_EQ(sh("--json tenants alpha"), 0);
  const std::string json = readFile(b.dir() + "/out.txt");
  EXPECT_NE(json.find("\"limit_bytes\":314572800,"), std::string::npos) << "a number, not a string: " << json;
  EXPECT_NE(json.find("\"used_bytes\":0,"), std::string::npos) << json;
  EXPECT_EQ(sh("tenants alpha --json"), 0) << "--json after the verb";
  // The same answer, but for the process count (the worker run above may be reaped in between)
  // and the device's own count (the broker's first reading of it may land in between: a loaded
  // CI machine saw it appear between the two calls).
  const std::regex processes("\"processes\":[0-9]+"), deviceUsed("\"device_used_bytes\":[0-9]+,");
  const auto same = [&](const std::string& t) {
    return std::regex_replace(std::regex_replace(t, processes, "P"), deviceUsed, "");  // present or not
  };
  EXPECT_EQ(same(readFile(b.dir() + "/out.txt")), same(json));
  EXPECT_EQ(sh("status --json"), 0);
  EXPECT_NE(readFile(b.dir() + "/out.txt").find("\"config_generation\":1,"), std::string::npos)
      << readFile(b.dir() + "/out.txt");
  // Empty once the broker has reaped the worker run above (a loaded host may take a tick or two).
  for (const auto end = Clock::now() + std::chrono::seconds(5);;) {
    EXPECT_EQ(sh("processes --json"), 0);
    if (readFile(b.dir() + "/out.txt") == "{\"processes\":[]}\n" || Clock::now() >= end) break;
    std::this_thread::sleep_for(milliseconds(20));
  }
  EXPECT_EQ(readFile(b.dir() + "/out.txt"), "{\"processes\":[]}\n");
  EXPECT_EQ(sh("tenants nosuch --json"), 1);
  EXPECT_EQ(readFile(b.dir() + "/out.txt"), "{\"error\": \"no tenant 'nosuch' on this host\"}\n");
  EXPECT_EQ(sh("run --tenant alpha -- echo --json"), 0) << "after --, the command's own argument";
  EXPECT_EQ(readFile(b.dir() + "/out.txt"), "--json\n");
  EXPECT_EQ(sh("set-limit alpha --memory lots"), 2) << "refused before it is sent";
  EXPECT_EQ(sh("set-limit nosuch --memory 1GiB"), 1) << "refused by the broker";
  EXPECT_EQ(sh("frobnicate"), 2);
  EXPECT_EQ(sh("probe --device 3"), 1) << "a device the host does not have";
  EXPECT_EQ(readFile(b.dir() + "/out.txt"), "cushare: probe: device 3 does not exist (this host has 1 device: 0)\n");
  EXPECT_EQ(sh("probe --device 0"), 0);
}

// A server on a socket its own user made, answering like a broker: the CLI does not believe it
// unless told that the broker runs as that user.
TEST(Cli, RefusesAFakeBrokerOfAnotherUser) {
  if (::geteuid() != 0) GTEST_SKIP() << "switching users needs root (CI runs as root)";
  // A directory of uid 2000's own, where it may listen (short: sockaddr_un holds 107 bytes).
  const std::string dir = testDir(), evil = socketFor(dir) + ".d", path = evil + "/broker.sock";
  std::filesystem::remove_all(evil);
  ASSERT_EQ(::mkdir(evil.c_str(), 0755), 0);
  ASSERT_EQ(::chown(evil.c_str(), 2000, 2000), 0);
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t fake = ::fork();
  if (fake == 0) {
    if (::setgid(2000) != 0 || ::setuid(2000) != 0) ::_exit(99);
    ::signal(SIGPIPE, SIG_IGN);  // a client that hangs up (as a distrustful one does) is no reason to die
    const int l = ::socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path.c_str());
    if (::bind(l, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(l, 8) != 0) ::_exit(98);
    (void)!::write(ready[1], "r", 1);
    for (;;) {
      const int c = ::accept(l, nullptr, nullptr);
      if (c < 0) continue;
      uint32_t len = 0;
      std::string payload;
      if (::read(c, &len, 4) == 4 && len < 65536) {
        payload.resize(len);
        size_t got = 0;
        for (ssize_t n; got < len && (n = ::read(c, payload.data() + got, len - got)) > 0;) got += static_cast<size_t>(n);
      }
      rpc::Response r;
      r.set_ok(true);
      r.mutable_status()->set_version("fake");
      r.mutable_status()->set_pid(4242);
      r.mutable_status()->set_ledger_dir("/tmp/not-the-ledgers");
      const std::string bytes = rpc::frame(r);
      (void)!::write(c, bytes.data(), bytes.size());
      ::close(c);
    }
  }
  char c;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  const std::string out = dir + "/out.txt";
  auto cli = [&](const std::string& args) {
    const std::string cmd = std::string(CLI_BIN) + " " + args + " > " + out + " 2>&1";
    const int st = std::system(cmd.c_str());
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  };
  EXPECT_EQ(cli("--socket " + path + " status"), 1);
  EXPECT_EQ(readFile(out), "cushare: not trusting the server at " + path + ": it runs as uid 2000 (pid " +
                               std::to_string(fake) + "), not as root or as you (uid 0); if cushare-broker "
                               "runs as that user, name it with --broker-user or CUSHARE_BROKER_USER\n");
  EXPECT_EQ(cli("--socket " + path + " env --tenant alpha"), 1) << "no ledger_dir from it either";
  EXPECT_EQ(readFile(out).find("CUSHARE_LEDGER_DIR"), std::string::npos) << readFile(out);
  EXPECT_EQ(cli("--socket " + path + " --broker-user 2000 status"), 0) << readFile(out);
  EXPECT_NE(readFile(out).find("pid 4242"), std::string::npos) << readFile(out);
  EXPECT_EQ(cli("--socket " + path + " --broker-user nosuchuser status"), 2);
  EXPECT_EQ(cli("--socket " + path + " status"), 1);
  ::kill(fake, SIGKILL);
  ::waitpid(fake, nullptr, 0);
  std::filesystem::remove_all(evil);
}

// `cushare --socket <b's> args`: its exit status and what it printed (stdout and stderr).
std::pair<int, std::string> runCli(Broker& b, const std::string& args) {
  const std::string cmd = std::string(CLI_BIN) + " --socket " + b.socket() + " " + args + " > " + b.dir() + "/out.txt 2>&1";
  const int st = std::system(cmd.c_str());
  return std::make_pair(WIFEXITED(st) ? WEXITSTATUS(st) : -1, readFile(b.dir() + "/out.txt"));
}

// A misspelt verb or tenant name is answered with the nearest one (issue 26, point 11).
TEST(Cli, TyposGetADidYouMean) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kTwoTenants)) << b.log();
  const auto cli = [&](const std::string& args) { return runCli(b, args); };
  auto [rc, out] = cli("statsu");
  EXPECT_EQ(rc, 2);
  EXPECT_EQ(out, "cushare: unknown verb 'statsu' (see 'cushare --help'); did you mean 'status'?\n");
  std::tie(rc, out) = cli("set-limit alpah --memory 1GiB");
  EXPECT_EQ(rc, 1);
  EXPECT_NE(out.find("no tenant 'alpah' on this host (see cushare tenants); did you mean 'alpha'?"), std::string::npos) << out;
  std::tie(rc, out) = cli("tenants alpah");
  EXPECT_EQ(rc, 1);
  EXPECT_NE(out.find("no tenant 'alpah' on this host; did you mean 'alpha'?"), std::string::npos) << out;
  std::tie(rc, out) = cli("tenants zzzzzz");
  EXPECT_EQ(out.find("did you mean"), std::string::npos) << "nothing near: " << out;
}

// A live limit lowered below what the tenant holds is accepted (limits are live) and said so: the
// reply notes it, the tenants table flags USED with '!' and explains it; the table shows each
// tenant's priority (issue 26, point 6: the change was silent, the priority nowhere).
TEST(Cli, ALimitLoweredBelowUsageIsSaidAndFlagged) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kTwoTenants)) << b.log();
  Child a = b.tenantProcess("alpha");
  ASSERT_EQ(a.ask("alloc " + std::to_string(300 * MiB)), "ok");
  const auto cli = [&](const std::string& args) { return runCli(b, args); };
  auto [rc, out] = cli("set-limit alpha --memory 128MiB");
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("note: alpha holds 300 MiB on device 0, above its new limit of 128 MiB: its allocations there are "
                     "denied until it frees below it; nothing it holds is taken"),
            std::string::npos) << out;
  std::tie(rc, out) = cli("tenants");
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("PRIORITY"), std::string::npos) << out;
  EXPECT_NE(out.find("300 MiB!"), std::string::npos) << out;
  EXPECT_NE(out.find("! holds more than its limit"), std::string::npos) << out;
  EXPECT_NE(out.find(" high "), std::string::npos) << "alpha's priority\n" << out;
  EXPECT_EQ(a.ask("alloc " + std::to_string(1 * MiB)), "oom");
  EXPECT_EQ(a.ask("held"), "held " + std::to_string(300 * MiB)) << "nothing taken";
  // Within the limit again: no flag, no note.
  ASSERT_EQ(a.ask("freeall"), "ok");
  std::tie(rc, out) = cli("set-limit alpha --memory 256MiB");
  ASSERT_EQ(rc, 0) << out;
  EXPECT_EQ(out.find("note:"), std::string::npos) << out;
  EXPECT_EQ(out.find("!"), std::string::npos) << out;
}

// Memory held by a program outside cushare (no shim, no ledger) is shown to operators: `cushare
// status` (OUTSIDE and the device's own DEVICE-USED, and a line naming the process), `cushare
// tenants` (the same line), the metrics cushare_device_memory_outside_bytes and
// cushare_device_memory_reported_used_bytes, and a warning once it stays. Before, status showed the
// device's used memory as 0 B and the broker logged one info line (issue 26, point 3).
TEST(Cli, MemoryHeldOutsideCushareIsShown) {
  if (::geteuid() != 0) GTEST_SKIP() << "switching users needs root (CI runs as root)";
  Broker b(testDir());
  ASSERT_TRUE(b.start(kTwoTenants)) << b.log();
  Child tenant = b.tenantProcess("alpha");
  ASSERT_EQ(tenant.ask("alloc " + std::to_string(64 * MiB)), "ok");
  // Another user of the host, without the shim (as docs/security.md deploys: tenants and others
  // on uids of their own; the broker reads its process through /proc as root).
  UidTenants users;
  Child outside = users.spawn(2000, WORKER_BIN, b, "", {{"LD_PRELOAD", ""}});
  ASSERT_EQ(outside.readLine(), "ready") << readFile(b.dir() + "/tenants.log");
  ASSERT_EQ(outside.ask("alloc " + std::to_string(1536 * MiB)), "ok");
  const std::string pid = std::to_string(outside.pid());
  const std::string line = "device 0: 1.50 GiB held by 1 process(es) outside cushare (pid " + pid +
                           "): no tenant's limit counts it";
  ASSERT_TRUE(waitFor([&] { return b.logHas("device 0: 1.50 GiB held by 1 process(es) outside cushare (pid " + pid); },
                      milliseconds(5000)))
      << b.log();
  const rpc::StatusReply st = b.status();
  ASSERT_EQ(st.devices_size(), 1);
  EXPECT_EQ(st.devices(0).used_bytes(), 64 * MiB) << "the tenants'";
  EXPECT_EQ(st.devices(0).outside_bytes(), 1536 * MiB);
  EXPECT_EQ(st.devices(0).device_used_bytes(), (1536 + 64) * MiB) << "the device's own figure";
  ASSERT_EQ(st.devices(0).outside_pids_size(), 1);
  EXPECT_EQ(st.devices(0).outside_pids(0), outside.pid());
  const std::string m = b.metrics();
  EXPECT_NE(m.find("cushare_device_memory_outside_bytes{device=\"0\",uuid=\"" + st.devices(0).uuid() + "\"} " +
                   std::to_string(1536 * MiB) + "\n"),
            std::string::npos) << m;
  EXPECT_NE(m.find("cushare_device_memory_reported_used_bytes{device=\"0\",uuid=\"" + st.devices(0).uuid() + "\"} " +
                   std::to_string(1600 * MiB) + "\n"),
            std::string::npos) << m;
  for (const char* verb : {"status", "tenants"}) {
    const auto [rc, out] = runCli(b, verb);
    ASSERT_EQ(rc, 0) << verb << "\n" << out;
    EXPECT_NE(out.find(line), std::string::npos) << verb << ":\n" << out;
    if (std::string(verb) == "status") {
      EXPECT_NE(out.find("OUTSIDE"), std::string::npos) << out;
      EXPECT_NE(out.find("1.56 GiB"), std::string::npos) << "DEVICE-USED\n" << out;
    }
  }
  // Gone: nothing shown, and said so.
  outside.kill(SIGKILL);
  outside.wait();
  EXPECT_TRUE(waitFor([&] { return b.status().devices(0).outside_bytes() == 0; })) << b.log();
  EXPECT_TRUE(waitFor([&] { return b.logHas("device 0: no memory held outside cushare any more"); })) << b.log();
  const auto [rc, out] = runCli(b, "tenants");
  ASSERT_EQ(rc, 0) << out;
  EXPECT_EQ(out.find("outside cushare"), std::string::npos) << out;
}

// `cushare env` carries the tenant's limit and requires the broker: a process started from its
// variables without the broker's ledger directory (not mounted, or misspelt) fails closed and
// says why; with the switch removed, the limit in the environment still holds on the device.
TEST(Cli, EnvCarriesTheLimitAndRequiresTheBroker) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kTwoTenants)) << b.log();
  auto sh = [&](const std::string& cmd) {
    const std::string full = std::string(CLI_BIN) + " --socket " + b.socket() + " " + cmd + " > " + b.dir() +
                             "/out.txt 2>&1";
    const int st = std::system(full.c_str());
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  };
  const std::string limit = std::to_string(512 * MiB);
  EXPECT_EQ(sh("env --tenant alpha"), 0);
  std::string env = readFile(b.dir() + "/out.txt");
  EXPECT_NE(env.find("\nCUSHARE_MEMORY_LIMIT=" + limit + "\n"), std::string::npos) << env;
  EXPECT_NE(env.find("\nCUSHARE_REQUIRE_BROKER=1\n"), std::string::npos) << env;
  EXPECT_EQ(sh("env --tenant alpha --memory 128MiB"), 0);
  env = readFile(b.dir() + "/out.txt");
  EXPECT_NE(env.find("\nCUSHARE_MEMORY_LIMIT=" + std::to_string(128 * MiB) + "\n"), std::string::npos) << env;
  EXPECT_EQ(sh("env --tenant alpha --memory 1GiB"), 0);
  env = readFile(b.dir() + "/out.txt");
  EXPECT_NE(env.find("\nCUSHARE_MEMORY_LIMIT=" + limit + "\n"), std::string::npos) << "never above the broker's: " << env;
  // ... and said so (issue 26, point 11: it was capped silently), for run too.
  const std::string note = "cushare: note: --memory 1GiB is above tenant alpha's limit of 512 MiB on device 0; the "
                           "broker's limit holds there (raise it with cushare set-limit)\n";
  EXPECT_NE(env.find(note), std::string::npos) << env;
  EXPECT_EQ(sh("run --tenant alpha --memory 1GiB -- true"), 0);
  EXPECT_EQ(readFile(b.dir() + "/out.txt"), note);
  EXPECT_EQ(sh("env --tenant alpha --memory 256MiB"), 0);
  EXPECT_EQ(readFile(b.dir() + "/out.txt").find("note:"), std::string::npos) << "below the limit: nothing to say";
  // `cushare run` runs on this host, in the broker's directory: it requires the broker and does not
  // carry the limit, which would cap live raises (--memory is still passed).
  EXPECT_EQ(sh("run --tenant alpha -- sh -c 'echo ${CUSHARE_REQUIRE_BROKER}:${CUSHARE_MEMORY_LIMIT-unset}'"), 0);
  EXPECT_EQ(readFile(b.dir() + "/out.txt"), "1:unset\n");
  EXPECT_EQ(sh("env --tenant alpha"), 0);
  env = readFile(b.dir() + "/out.txt");

  // A container started with these variables, its ledger directory misspelt (or not mounted).
  std::string vars;
  const std::string lines = "\n" + env;
  ASSERT_NE(lines.find("\nCUSHARE_REQUIRE_BROKER=1\n"), std::string::npos) << env;
  for (const char* name : {"CUSHARE_TENANT", "CUSHARE_MEMORY_LIMIT", "LD_PRELOAD"}) {
    const size_t at = lines.find(std::string("\n") + name + "=");
    ASSERT_NE(at, std::string::npos) << name << " missing from: " << env;
    vars += " " + lines.substr(at + 1, lines.find('\n', at + 1) - at - 1);
  }
  const std::string typo = b.ledgerDir() + "-typo";
  vars += " CUSHARE_LEDGER_DIR=" + typo;
  EXPECT_EQ(sh("run --tenant alpha -- env CUSHARE_REQUIRE_BROKER=1" + vars + " " + WORKER_BIN + " < /dev/null"), 3);
  const std::string refused = readFile(b.dir() + "/out.txt");
  EXPECT_NE(refused.find("CUSHARE_REQUIRE_BROKER=1, but no broker owns the ledger directory " + typo), std::string::npos)
      << refused;
  EXPECT_NE(refused.find("init-failed 3"), std::string::npos) << refused;
  // Without the switch the process runs standalone, still held to the broker's limit: it gets
  // exactly 512 MiB of the 4 GiB device, 64 MiB at a time.
  EXPECT_EQ(sh("run --tenant alpha -- sh -c 'echo fill " + std::to_string(64 * MiB) + " | env -u CUSHARE_REQUIRE_BROKER" +
               vars + " " + WORKER_BIN + "'"),
            0);
  const std::string filled = readFile(b.dir() + "/out.txt");
  EXPECT_NE(filled.find("held " + limit), std::string::npos) << filled;
  EXPECT_EQ(b.status().tenants(), 2u) << "the broker answers";
}

// ---- Several devices (this suite runs with SIMGPU_DEVICES=2) ----

TEST(Devices, PerDeviceLimitsAndLiveChangesOfOneDevice) {
  Broker b(testDir());
  ASSERT_TRUE(b.start("tenants:\n  - {name: alpha, memory: {0: 256MiB, 1: 25%}}\n  - {name: beta, memory: 1GiB}\n"))
      << b.log();
  ASSERT_EQ(b.status().devices_size(), 2);
  rpc::Tenant a = b.tenant("alpha");
  ASSERT_EQ(a.devices_size(), 2);
  EXPECT_EQ(a.devices(0).limit_bytes(), 256 * MiB);
  EXPECT_EQ(a.devices(1).limit_bytes(), 1024 * MiB) << "25% of 4 GiB";
  // `cushare env` names each device's limit by UUID when they differ.
  const std::string envCmd = std::string(CLI_BIN) + " --socket " + b.socket() + " env --tenant alpha > " + b.dir() + "/env.txt";
  ASSERT_EQ(std::system(envCmd.c_str()), 0);
  const rpc::StatusReply st = b.status();
  EXPECT_NE(readFile(b.dir() + "/env.txt")
                .find("\nCUSHARE_MEMORY_LIMIT=" + st.devices(0).uuid() + "=" + std::to_string(256 * MiB) + "," +
                      st.devices(1).uuid() + "=" + std::to_string(1024 * MiB) + "\n"),
            std::string::npos)
      << readFile(b.dir() + "/env.txt");
  ASSERT_TRUE(b.setLimit("alpha", "512MiB", 1).ok());
  a = b.tenant("alpha");
  EXPECT_EQ(a.devices(0).limit_bytes(), 256 * MiB) << "device 0 untouched";
  EXPECT_FALSE(a.devices(0).overridden());
  EXPECT_EQ(a.devices(1).limit_bytes(), 512 * MiB);
  EXPECT_TRUE(a.devices(1).overridden());
  const rpc::Response bad = b.setLimit("alpha", "1GiB", 2);
  EXPECT_FALSE(bad.ok());
  EXPECT_EQ(bad.error(), "device 2 does not exist (this host has 2 devices: 0..1)");
  // The process sees both devices; device 0 is the one the worker uses.
  Child p = b.tenantProcess("alpha");
  EXPECT_EQ(p.ask("fill " + std::to_string(64 * MiB)), "held " + std::to_string(256 * MiB));
  ASSERT_TRUE(b.setLimit("alpha", "reset", 1).ok());
  EXPECT_EQ(b.tenant("alpha").devices(1).limit_bytes(), 1024 * MiB);
  EXPECT_FALSE(b.tenant("alpha").devices(1).overridden());
}


// A reload that drops a device from a tenant's per-device map lifts its limit there (the map
// limits only the devices it names), the running process's too: the broker says so, never
// silently; a device whose limit only changes is not named.
TEST(Devices, AReloadThatLiftsALimitSaysSo) {
  Broker b(testDir());
  ASSERT_TRUE(b.start("tenants:\n  - {name: alpha, memory: {0: 256MiB, 1: 512MiB}}\n")) << b.log();
  Child p = b.tenantProcess("alpha");
  ASSERT_EQ(p.ask("alloc " + std::to_string(128 * MiB)), "ok");
  writeConfig(b, "tenants:\n  - {name: alpha, memory: {1: 256MiB}}\n");
  ASSERT_TRUE(b.reload().ok()) << b.log();
  EXPECT_FALSE(b.tenant("alpha").devices(0).has_limit_bytes());
  EXPECT_TRUE(b.logHas("tenant alpha: the reload lifts its memory limit on device 0 (it was 268435456 bytes): its "
                       "processes there are no longer limited"))
      << b.log();
  EXPECT_EQ(b.log().find("memory limit on device 1"), std::string::npos) << "device 1 keeps a limit";
  EXPECT_EQ(p.ask("alloc " + std::to_string(256 * MiB)), "ok") << "what the log says: no limit on device 0 now";
}

// Bytes in use on host device `index`, as the device itself counts them: simgpu's NVML in this
// process, which sees the whole host (no container, and NVML ignores CUDA_VISIBLE_DEVICES).
uint64_t hostUsed(unsigned index) {
  nvmlDevice_t d;
  nvmlMemory_t m{};
  if (nvmlInit_v2() != NVML_SUCCESS) return UINT64_MAX;
  const bool ok = nvmlDeviceGetHandleByIndex_v2(index, &d) == NVML_SUCCESS && nvmlDeviceGetMemoryInfo(d, &m) == NVML_SUCCESS;
  nvmlShutdown();
  return ok ? m.used : UINT64_MAX;
}

// A tenant hiding memory past its limit on both devices at once, one process on each: each is
// taken down (a review found the consecutive-ticks rule kept per process across devices, so each
// device's pass reset the other's culprit and neither was ever killed).
TEST(Devices, ProcessesHidingOnTwoDevicesAreBothTakenDown) {
  Broker b(testDir());
  ASSERT_TRUE(b.start("context_memory: 0\ntenants:\n  - {name: alpha, memory: 256MiB}\n")) << b.log();
  const uint64_t base0 = hostUsed(0), base1 = hostUsed(1);
  Child p0 = b.tenantProcess("alpha");
  Child p1 = b.tenantProcess("alpha", {{"CUDA_VISIBLE_DEVICES", "1"}});
  ASSERT_EQ(p0.ask("alloc " + std::to_string(200 * MiB)), "ok");
  ASSERT_EQ(p1.ask("alloc " + std::to_string(200 * MiB)), "ok");
  ASSERT_TRUE(stopProcess(b.pid()));
  ASSERT_EQ(p0.ask("zero"), "ok");  // every device's counters
  ASSERT_EQ(p0.ask("alloc " + std::to_string(200 * MiB)), "ok");
  ASSERT_EQ(p1.ask("alloc " + std::to_string(200 * MiB)), "ok");
  EXPECT_EQ(hostUsed(0) - base0, 400 * MiB);
  EXPECT_EQ(hostUsed(1) - base1, 400 * MiB);
  ASSERT_EQ(::kill(b.pid(), SIGCONT), 0);
  for (Child* c : {&p0, &p1}) {
    const int status = c->wait(5000);
    EXPECT_TRUE(status != -1 && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status << "\n" << b.log();
  }
  EXPECT_TRUE(waitFor([&] { return hostUsed(0) == base0 && hostUsed(1) == base1; }, milliseconds(2000))) << b.log();
}

// A tenant that keeps rewriting its entries' state words (entry 0 freed, entry 1 marked ready) in a
// loop while the broker runs: found by a second attack review, the broker re-read the ledger after
// writing an entry back, lost the race, skipped the published entries and gave entry 0 device 1's
// limit (or left it frozen). Published entries are now the broker's word, never re-read: device
// 0's budget, and live changes to it, hold throughout. Judged by the device's own count.
TEST(Devices, EntryStatesRewrittenInALoopGainNothing) {
  Broker b(testDir());
  // tamper_response charge: with kill, the tenant's processes go once the lowered limit is below
  // what the (tampered) entry holds, which is not what this test is about.
  ASSERT_TRUE(b.start("tamper_response: charge\ntenants:\n  - {name: alpha, memory: {0: 256MiB, 1: 1GiB}}\n"))
      << b.log();
  const uint64_t base = hostUsed(0);
  Child first = b.tenantProcess("alpha");
  ASSERT_EQ(first.ask("alloc " + std::to_string(64 * MiB)), "ok");
  const std::string path = b.ledgerDir() + "/alpha.ledger";
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  void* m = ::mmap(nullptr, sizeof(LedgerHeader), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  ASSERT_NE(m, MAP_FAILED);
  auto* h = static_cast<LedgerHeader*>(m);
  std::atomic<bool> stop{false};
  std::thread spinner([&] {
    while (!stop.load()) {
      h->devices[0].state.store(kLedgerDeviceFree);
      h->devices[1].state.store(kLedgerDeviceFree);
    }
  });
  // A second process fills device 0 again and again across thirty ticks of it; the most device 0
  // ever held is the verdict.
  Child second = b.tenantProcess("alpha");
  std::string got;
  uint64_t most = 0;
  for (const auto until = Clock::now() + milliseconds(1500); Clock::now() < until;) {
    got = second.ask("fill " + std::to_string(16 * MiB));
    most = std::max(most, hostUsed(0) - base);
    ASSERT_EQ(second.ask("freeall"), "ok");
  }
  got = second.ask("fill " + std::to_string(16 * MiB));
  const bool lowered = b.setLimit("alpha", "128MiB", 0).ok();
  std::this_thread::sleep_for(milliseconds(300));
  const std::string view = first.ask("info");
  stop = true;
  spinner.join();
  ::munmap(m, sizeof(LedgerHeader));
  EXPECT_EQ(got, "held " + std::to_string(192 * MiB)) << "device 0's limit, whatever the ledger says";
  EXPECT_LE(most, 256 * MiB + 2 * 64 * MiB) << "device 0's own count, at its highest (contexts aside)";
  EXPECT_TRUE(lowered);
  EXPECT_EQ(view.substr(view.find("total")), "total " + std::to_string(128 * MiB)) << "a live change still reaches it";
}

// A tenant that swaps the UUIDs of its ledger's two device entries, while the broker is stopped
// (SIGSTOP: the window is certain), gains no second budget: a process started then on device 0
// takes its entry and limit from the broker's limits file, not from the ledger, whose entry for
// device 0 would now be device 1's (1 GiB, nothing counted in it). Before, it got 1 GiB more on
// device 0. Judged by the device's own count.
TEST(Devices, SwappedLedgerUuidsGiveNoSecondBudget) {
  Broker b(testDir());
  ASSERT_TRUE(b.start("tenants:\n  - {name: alpha, memory: {0: 256MiB, 1: 1GiB}}\n")) << b.log();
  const uint64_t base = hostUsed(0);
  Child first = b.tenantProcess("alpha");
  ASSERT_EQ(first.ask("fill " + std::to_string(64 * MiB)), "held " + std::to_string(256 * MiB));
  const std::string path = b.ledgerDir() + "/alpha.ledger";
  const size_t entry0 = offsetof(LedgerHeader, devices), entry1 = entry0 + sizeof(LedgerDevice);
  uint8_t uuid0[16], uuid1[16];
  {
    const int fd = ::open(path.c_str(), O_RDONLY);
    ASSERT_EQ(::pread(fd, uuid0, 16, static_cast<off_t>(entry0)), 16);
    ASSERT_EQ(::pread(fd, uuid1, 16, static_cast<off_t>(entry1)), 16);
    ::close(fd);
  }
  ASSERT_NE(std::memcmp(uuid0, uuid1, 16), 0);
  ASSERT_TRUE(stopProcess(b.pid()));
  rawWrite(path, entry0, uuid1, 16);
  rawWrite(path, entry1, uuid0, 16);
  Child second = b.tenantProcess("alpha");
  const std::string got = second.ask("fill " + std::to_string(64 * MiB));
  const uint64_t onDevice = hostUsed(0) - base;
  ASSERT_EQ(::kill(b.pid(), SIGCONT), 0);
  EXPECT_EQ(got, "held 0") << "device 0's budget is spent, whatever the ledger's entries say";
  EXPECT_LE(onDevice, 256 * MiB + 2 * 64 * MiB) << "device 0's own count (two processes' contexts aside)";
  EXPECT_TRUE(waitFor([&] { return b.logHas("tenant alpha: the device UUID of ledger entry 0 was rewritten"); })) << b.log();
}

// Processes of a tenant that see the host's two devices (2 GiB and 4 GiB) renumbered: a container
// given only host device 1, CUDA_VISIBLE_DEVICES=1,0, and `cushare env`'s list inside such a
// container. The broker's limits, configured by host index, land on the physical device behind
// the process's ordinal 0, judged by the device's own count; `cushare env`'s list names every host
// device, so a container that sees only an unlimited one starts, and sees that device whole.
TEST(Devices, LimitsFollowThePhysicalDeviceWhateverTheNumbering) {
  Broker b(testDir());
  ASSERT_TRUE(b.start("tenants:\n  - {name: alpha, memory: {0: 256MiB, 1: 25%}}\n  - {name: beta, memory: {0: 128MiB}}\n"))
      << b.log();
  const rpc::StatusReply st = b.status();
  ASSERT_EQ(st.devices_size(), 2);
  const std::string uuid0 = st.devices(0).uuid(), uuid1 = st.devices(1).uuid();
  auto envLimitOf = [&](const std::string& tenant) {
    const std::string out = b.dir() + "/env-" + tenant + ".txt";
    const std::string cmd = std::string(CLI_BIN) + " --socket " + b.socket() + " env --tenant " + tenant + " > " + out;
    EXPECT_EQ(std::system(cmd.c_str()), 0);
    const std::string text = readFile(out);
    const std::string key = "\nCUSHARE_MEMORY_LIMIT=";
    const size_t at = text.find(key);
    return at == std::string::npos ? std::string() : text.substr(at + key.size(), text.find('\n', at + key.size()) - at - key.size());
  };
  const std::string alphaList = envLimitOf("alpha"), betaList = envLimitOf("beta");
  EXPECT_EQ(alphaList, uuid0 + "=" + std::to_string(256 * MiB) + "," + uuid1 + "=" + std::to_string(1024 * MiB));
  EXPECT_EQ(betaList, uuid0 + "=" + std::to_string(128 * MiB) + "," + uuid1 + "=18446744073709551615");

  const std::vector<std::map<std::string, std::string>> host1Views = {
      {{"SIMGPU_CONTAINER_DEVICES", "1"}},
      {{"CUDA_VISIBLE_DEVICES", "1,0"}},
      {{"SIMGPU_CONTAINER_DEVICES", uuid1}, {"CUSHARE_MEMORY_LIMIT", alphaList}},
  };
  for (const auto& view : host1Views) {
    SCOPED_TRACE(view.begin()->first + "=" + view.begin()->second);
    Child p = b.tenantProcess("alpha", view);
    EXPECT_EQ(p.ask("fill " + std::to_string(64 * MiB)), "held " + std::to_string(1024 * MiB)) << "host device 1's limit";
    EXPECT_EQ(hostUsed(1), 1024 * MiB);
    EXPECT_EQ(hostUsed(0), 0u);
    EXPECT_EQ(b.tenant("alpha").devices(1).used_bytes(), 1024 * MiB);
    EXPECT_EQ(p.ask("freeall"), "ok");
    EXPECT_EQ(hostUsed(1), 0u);
  }
  // beta: limited on host device 0 only. Its list in a container of host device 0, and of host
  // device 1 (unlimited there: the whole 4 GiB device).
  Child on0 = b.tenantProcess("beta", {{"SIMGPU_CONTAINER_DEVICES", "0"}, {"CUSHARE_MEMORY_LIMIT", betaList}});
  EXPECT_EQ(on0.ask("fill " + std::to_string(64 * MiB)), "held " + std::to_string(128 * MiB));
  EXPECT_EQ(hostUsed(0), 128 * MiB);
  Child on1 = b.tenantProcess("beta", {{"SIMGPU_CONTAINER_DEVICES", "1"}, {"CUSHARE_MEMORY_LIMIT", betaList}});
  EXPECT_EQ(on1.ask("info"), "free " + std::to_string(4096 * MiB) + " total " + std::to_string(4096 * MiB));
  EXPECT_EQ(b.status().tenants(), 2u) << "the broker answers";
}
}  // namespace
}  // namespace cushare::test
