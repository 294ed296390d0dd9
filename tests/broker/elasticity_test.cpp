// Memory elasticity (docs/memory-elasticity.md) end to end, on a 1 GiB simgpu device
// (SIMGPU_MEMORY=1GiB): a tenant with a guarantee below its limit bursts above it into managed
// memory; another tenant's guarantee holds at the moment it needs it, because the device evicts
// the burst to host memory; the burster's data is intact. Judged by the device's own count
// (simgpu's NVML) and by the data, with the tenants on uids of their own (docs/security.md).
#include <signal.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <thread>
#include <vector>
#include <sstream>
#include <string>

#include "harness.h"

namespace cushare::test {
namespace {

constexpr uint64_t MiB = uint64_t{1} << 20;

std::string readAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The value of family's first sample whose labels hold `label` (sampleWith), or tenant's (sample),
// in the metrics text ("" if none).
std::string sampleWith(const std::string& metrics, const std::string& family, const std::string& label) {
  std::istringstream in(metrics);
  for (std::string line; std::getline(in, line);)
    if (line.rfind(family + "{", 0) == 0 && line.find(label) != std::string::npos)
      return line.substr(line.rfind(' ') + 1);
  return "";
}
std::string sample(const std::string& metrics, const std::string& family, const std::string& tenant) {
  return sampleWith(metrics, family, "tenant=\"" + tenant + "\"");
}

std::string mib(uint64_t n) { return std::to_string(n * MiB); }

// burster: 256 MiB guaranteed, bursts to 768 MiB; steady: 768 MiB, no bursting. Admission sums
// 256 + 768 = 1024 MiB: the device exactly.
const char kTenants[] =
    "tenants:\n"
    "  - {name: burster, uid: 1000, memory: 768MiB, guarantee: 256MiB}\n"
    "  - {name: steady, uid: 1001, memory: 768MiB}\n";

TEST(Elastic, AGuaranteeHoldsWhileAnotherTenantBurstsAndTheBurstKeepsItsData) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run tenants on uids of their own";
  Broker b(testDir());
  ASSERT_TRUE(b.start(kTenants)) << b.log();
  ASSERT_EQ(deviceUsed(), 0u) << "the device is not empty at the start";
  UidTenants users;
  Child burster = users.spawn(1000, WORKER_BIN, b, "burster");
  ASSERT_EQ(burster.readLine(), "ready") << readAll(b.dir() + "/tenants.log");
  Child steady = users.spawn(1001, WORKER_BIN, b, "steady");
  ASSERT_EQ(steady.readLine(), "ready") << readAll(b.dir() + "/tenants.log");

  // Within its guarantee: ordinary device memory. Above it: managed memory, resident while the
  // device has room.
  for (int i = 0; i < 3; ++i) ASSERT_EQ(burster.ask("pattern " + mib(256)), "ok") << i;
  EXPECT_EQ(burster.ask("kinds"), "managed " + mib(512) + " plain " + mib(256));
  EXPECT_EQ(deviceUsed(), 768 * MiB) << "the burst is resident: the device had room";
  EXPECT_EQ(burster.ask("alloc " + mib(64)), "oom") << "its limit (768 MiB) holds, bursts included";
  EXPECT_EQ(usedOn0(b.tenant("burster")), 768 * MiB);
  // The operator sees the guarantee and the burst: control API, metrics, cushare tenants.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // a few ticks: the host estimate
  const rpc::Tenant bt = b.tenant("burster");
  ASSERT_EQ(bt.devices_size(), 1);
  EXPECT_EQ(bt.devices(0).guarantee_bytes(), 256 * MiB);
  EXPECT_EQ(bt.devices(0).burst_bytes(), 512 * MiB);
  EXPECT_EQ(bt.devices(0).burst_host_bytes(), 0u) << "resident: the device had room";
  EXPECT_EQ(bt.devices(0).reclaimed_bytes(), 0u);
  EXPECT_FALSE(b.tenant("steady").devices(0).has_guarantee_bytes()) << "it does not burst";
  const std::string m = b.metrics();
  EXPECT_EQ(sample(m, "cushare_tenant_memory_guarantee_bytes", "burster"), mib(256)) << m;
  EXPECT_EQ(sample(m, "cushare_tenant_memory_burst_bytes", "burster"), mib(512));
  EXPECT_EQ(sample(m, "cushare_tenant_memory_guarantee_bytes", "steady"), "") << "no sample: it does not burst";

  // The steady tenant's view shows the 768 MiB reserved for it although the device's own free
  // figure is 256 MiB while the burst is resident: the broker publishes what bursts hold that the
  // device would evict (frameworks size themselves from this figure).
  EXPECT_TRUE(eventually([&] { return steady.ask("info") == "free " + mib(768) + " total " + mib(768); }, 3000))
      << steady.ask("info");
  // The steady tenant's 768 MiB, which admission reserved for it, is there when it asks: the
  // device evicts the burst to host memory at once.
  for (int i = 0; i < 3; ++i) ASSERT_EQ(steady.ask("alloc " + mib(256)), "ok") << "allocation " << i;
  EXPECT_EQ(steady.ask("kinds"), "managed 0 plain " + mib(768)) << "a tenant that does not burst gets ordinary memory";
  EXPECT_EQ(deviceUsed(), 1024 * MiB) << "768 MiB of the steady tenant's, 256 MiB of the burster's guarantee";
  EXPECT_EQ(steady.ask("alloc " + mib(64)), "oom") << "its own limit holds";

  // The operator is told where the burst went: all 512 MiB of it on host memory now.
  EXPECT_TRUE(eventually([&] { return b.tenant("burster").devices(0).burst_host_bytes() == 512 * MiB; }, 3000))
      << b.tenant("burster").DebugString();
  EXPECT_EQ(b.tenant("burster").devices(0).reclaimed_bytes(), 512 * MiB);
  EXPECT_TRUE(b.logHas("tenant burster device 0: about 512 MiB of its bursts are on host memory")) << b.log();
  EXPECT_EQ(sample(b.metrics(), "cushare_tenant_reclaimed_bytes_total", "burster"), mib(512));
  // Nothing the burster wrote was lost, the evicted part included; it keeps running.
  EXPECT_EQ(burster.ask("check"), "intact 3");
  EXPECT_EQ(burster.ask("alloc " + mib(64)), "oom");

  // Room again: the burster's memory is all there, and it can burst again.
  EXPECT_EQ(steady.ask("freeall"), "ok");
  EXPECT_EQ(burster.ask("check"), "intact 3");
  EXPECT_EQ(burster.ask("freeall"), "ok");
  EXPECT_EQ(deviceUsed(), 0u);
  for (Child* c : {&burster, &steady}) c->send("quit");
}

// A broker and a process of each of two tenants on uids of their own, 1000 and 1001 (by default
// burster and steady); start(body) starts the broker with body and both workers, ready.
struct TwoUids {
  explicit TwoUids(const std::string& dir, std::string first = "burster", std::string second = "steady")
      : b(dir), names{std::move(first), std::move(second)} {}
  void start(const std::string& body) {
    ASSERT_TRUE(b.start(body)) << b.log();
    burster = users.spawn(1000, WORKER_BIN, b, names[0]);
    ASSERT_EQ(burster.readLine(), "ready") << readAll(b.dir() + "/tenants.log");
    steady = users.spawn(1001, WORKER_BIN, b, names[1]);
    ASSERT_EQ(steady.readLine(), "ready") << readAll(b.dir() + "/tenants.log");
  }
  Broker b;
  std::string names[2];
  UidTenants users;
  Child burster, steady;
};

// A burst that finds no room from the start (the device is full of memory it cannot evict) is on
// host memory, and the operator is told so, but nothing was taken back from it: it is not counted
// as reclaimed. (Before, every rise of the estimate counted, so a burst not yet prefetched when
// the broker looked, as under ThreadSanitizer, was counted as reclaimed too.)
TEST(Elastic, ABurstThatFoundNoRoomIsOnHostMemoryButNotReclaimed) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run tenants on uids of their own";
  TwoUids u(testDir());
  ASSERT_NO_FATAL_FAILURE(u.start(kTenants));
  Broker& b = u.b;
  Child& burster = u.burster;
  Child& steady = u.steady;
  for (int i = 0; i < 3; ++i) ASSERT_EQ(steady.ask("alloc " + mib(256)), "ok") << i;
  ASSERT_EQ(burster.ask("pattern " + mib(256)), "ok") << "its guarantee";
  ASSERT_EQ(deviceUsed(), 1024 * MiB) << "the device is full of ordinary memory";
  ASSERT_EQ(burster.ask("pattern " + mib(256)), "ok") << "a burst: managed memory, with no room to be resident in";
  EXPECT_EQ(burster.ask("kinds"), "managed " + mib(256) + " plain " + mib(256));
  EXPECT_TRUE(eventually([&] { return b.tenant("burster").devices(0).burst_host_bytes() == 256 * MiB; }, 3000))
      << b.tenant("burster").DebugString();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // several ticks
  EXPECT_EQ(b.tenant("burster").devices(0).reclaimed_bytes(), 0u) << "nothing was taken back";
  EXPECT_EQ(sample(b.metrics(), "cushare_tenant_reclaimed_bytes_total", "burster"), "0");
  EXPECT_EQ(burster.ask("check"), "intact 2");
  // Room again: the steady tenant frees; then taken back for its allocation: that is a reclaim.
  ASSERT_EQ(steady.ask("freeall"), "ok");
  ASSERT_EQ(burster.ask("touch 100").rfind("touched ", 0), 0u) << "its kernels fault the burst in";
  EXPECT_TRUE(eventually([&] { return b.tenant("burster").devices(0).burst_host_bytes() == 0; }, 3000))
      << b.tenant("burster").DebugString();
  for (int i = 0; i < 3; ++i) ASSERT_EQ(steady.ask("alloc " + mib(256)), "ok") << i;
  EXPECT_TRUE(eventually([&] { return b.tenant("burster").devices(0).reclaimed_bytes() == 256 * MiB; }, 3000))
      << b.tenant("burster").DebugString();
  EXPECT_EQ(burster.ask("check"), "intact 2");
}

// A tenant that bursts gets ordinary memory up to its guarantee and never more: what it holds
// above it is memory the device can take back.
TEST(Elastic, OrdinaryMemoryOnlyUpToTheGuarantee) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kTenants)) << b.log();
  Child burster = b.tenantProcess("burster");
  EXPECT_EQ(burster.ask("alloc " + mib(200)), "ok");
  EXPECT_EQ(burster.ask("alloc " + mib(56)), "ok");
  EXPECT_EQ(burster.ask("kinds"), "managed 0 plain " + mib(256)) << "within its guarantee";
  EXPECT_EQ(burster.ask("alloc " + mib(1)), "ok");
  EXPECT_EQ(burster.ask("kinds"), "managed " + mib(1) + " plain " + mib(256)) << "one byte above it is a burst";
  EXPECT_EQ(burster.ask("freeall"), "ok");
  burster.send("quit");
}

// Every road to memory the device cannot evict stops at the guarantee, not at the limit.
TEST(Elastic, PoolsAndVirtualMemoryStopAtTheGuarantee) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kTenants)) << b.log();
  Child burster = b.tenantProcess("burster");
  EXPECT_EQ(burster.ask("pool " + mib(300)), "oom") << "stream-ordered memory above the guarantee";
  EXPECT_EQ(burster.ask("pool " + mib(200)), "ok");
  EXPECT_EQ(burster.ask("vmm " + mib(100)), "oom") << "200 + 100 MiB of VMM memory is above 256 MiB";
  EXPECT_EQ(burster.ask("vmm " + mib(50)), "ok");
  EXPECT_EQ(burster.ask("alloc " + mib(200)), "ok") << "cuMemAlloc still bursts, into managed memory";
  EXPECT_EQ(burster.ask("kinds"), "managed " + mib(200) + " plain 0") << "the one cuMemAlloc allocation";
  EXPECT_EQ(burster.ask("freeall"), "ok");
  burster.send("quit");
}

// A bursting tenant that hides memory from its ledger to get more ordinary memory than its
// guarantee is found by the device's count (which leaves its managed memory out) and, by default
// (hidden_memory_response: kill_past_limit), taken down: the device frees what it took.
TEST(Elastic, OrdinaryMemoryHiddenAboveTheGuaranteeIsTakenBack) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run the tenant on its own uid";
  Broker b(testDir());
  // simgpu's contexts hold nothing: every untracked byte counts (as the Tamper tests run).
  ASSERT_TRUE(b.start(std::string("context_memory: 0\n") + kTenants)) << b.log();
  UidTenants users;  // the broker takes down only the tenant's own processes (its uid)
  Child burster = users.spawn(1000, WORKER_BIN, b, "burster");
  ASSERT_EQ(burster.readLine(), "ready") << readAll(b.dir() + "/tenants.log");
  ASSERT_EQ(burster.ask("alloc " + mib(256)), "ok");
  ASSERT_EQ(burster.ask("alloc " + mib(256)), "ok");  // above its guarantee: managed
  EXPECT_EQ(burster.ask("kinds"), "managed " + mib(256) + " plain " + mib(256));
  ASSERT_EQ(burster.ask("zero"), "ok");  // its ledger now shows nothing
  // Its shim now believes it holds nothing: ordinary memory again, up to the guarantee.
  ASSERT_EQ(burster.ask("alloc " + mib(256)), "ok");
  EXPECT_EQ(burster.ask("kinds"), "managed " + mib(256) + " plain " + mib(512));
  // The device shows 512 MiB of ordinary memory for a tenant that may have 256.
  EXPECT_EQ(burster.wait(10000) & 0x7f, SIGKILL) << b.log();
  EXPECT_TRUE(b.logHas("killed (hidden_memory_response: kill_past_limit: 512 MiB on the device, past the 256 MiB its "
                       "ledger may hold)"))
      << b.log();
  EXPECT_TRUE(eventually([] { return deviceUsed() == 0; }, 3000)) << deviceUsed();
}

// A reload that lowers a guarantee below what the tenant's processes hold as ordinary memory:
// the broker says so, takes nothing back (they keep it until they free it, never judged as hidden
// memory), and their new allocations above the new guarantee are managed memory.
TEST(Elastic, LoweringAGuaranteeBelowWhatIsHeldIsSaidAndTakesNothing) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run the tenant on its own uid";
  Broker b(testDir());
  const std::string tenants = "  - {name: steady, uid: 1001, memory: 256MiB}\n";
  ASSERT_TRUE(b.start("context_memory: 0\ntenants:\n  - {name: burster, uid: 1000, memory: 768MiB, guarantee: 512MiB}\n" +
                      tenants))
      << b.log();
  UidTenants users;
  Child burster = users.spawn(1000, WORKER_BIN, b, "burster");
  ASSERT_EQ(burster.readLine(), "ready") << readAll(b.dir() + "/tenants.log");
  ASSERT_EQ(burster.ask("alloc " + mib(400)), "ok");
  EXPECT_EQ(burster.ask("kinds"), "managed 0 plain " + mib(400));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the broker sees it held
  std::ofstream(b.dir() + "/config.yaml")
      << brokerConfig(b.dir(), "context_memory: 0\ntenants:\n  - {name: burster, uid: 1000, memory: 768MiB, guarantee: 256MiB}\n" +
                                   tenants);
  ASSERT_TRUE(b.reload().ok()) << b.log();
  EXPECT_TRUE(b.logHas("tenant burster device 0: its processes hold 400 MiB the device cannot evict, above its new "
                       "guarantee of 256 MiB"))
      << b.log();
  EXPECT_EQ(burster.ask("alloc " + mib(64)), "ok");
  EXPECT_EQ(burster.ask("kinds"), "managed " + mib(64) + " plain " + mib(400)) << "above the new guarantee: managed";
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // ten ticks: judged, not taken down
  EXPECT_EQ(burster.ask("held"), "held " + mib(464)) << b.log();
  EXPECT_FALSE(b.logHas("killed", 100)) << b.log();
  burster.send("quit");
}

// burst: plain. A tenant guaranteed 256 MiB bursts in ordinary memory to its 768 MiB limit; the
// other tenant's allocation within its guarantee, which the driver refuses while the device is
// full, waits; the broker asks the burster to give back; the burster (cooperating: it polls
// cushare_reclaim_fd) frees its newest allocation and the waiting allocation succeeds. Judged by the
// device's own count and the burster's data.
TEST(Elastic, APlainBurstIsGivenBackForAGuaranteedAllocation) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run tenants on uids of their own";
  TwoUids u(testDir());
  ASSERT_NO_FATAL_FAILURE(u.start("elasticity: {reclaim_wait_ms: 3000, reclaim_deadline_ms: 2000}\n"
                                  "tenants:\n"
                                  "  - {name: burster, uid: 1000, memory: 768MiB, guarantee: 256MiB, burst: plain}\n"
                                  "  - {name: steady, uid: 1001, memory: 768MiB}\n"));
  Broker& b = u.b;
  Child& burster = u.burster;
  Child& steady = u.steady;
  ASSERT_EQ(burster.ask("cooperate"), "cooperating");
  for (int i = 0; i < 3; ++i) ASSERT_EQ(burster.ask("pattern " + mib(256)), "ok") << i;
  EXPECT_EQ(burster.ask("kinds"), "managed 0 plain " + mib(768)) << "plain bursts are ordinary memory";
  ASSERT_EQ(steady.ask("alloc " + mib(256)), "ok");
  EXPECT_EQ(deviceUsed(), 1024 * MiB) << "full";
  const rpc::Tenant bt = b.tenant("burster");
  EXPECT_EQ(bt.devices(0).guarantee_bytes(), 256 * MiB);
  EXPECT_EQ(bt.devices(0).burst_bytes(), 512 * MiB);
  // Within its guarantee, refused by the driver: it waits, the burster gives 256 MiB back (once the
  // broker has seen the burst: a tick).
  EXPECT_TRUE(eventually([&] { return b.tenant("burster").devices(0).burst_bytes() == 512 * MiB; }, 1000));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const std::string got = steady.ask("talloc " + mib(256), 10000);
  ASSERT_EQ(got.rfind("ok ", 0), 0u) << got << "\n" << b.log();
  std::printf("guaranteed allocation granted after %s ms\n", got.c_str() + 3);
  EXPECT_EQ(deviceUsed(), 1024 * MiB) << "512 MiB each: the device never held more than its size";
  EXPECT_EQ(burster.ask("check"), "intact 2") << "what it kept is intact (it freed its newest)";
  EXPECT_EQ(burster.ask("held"), "held " + mib(512));
  EXPECT_TRUE(b.logHas("tenant burster device 0: asked to give back plain bursts down to 512 MiB")) << b.log();
  EXPECT_TRUE(b.logHas("tenant burster device 0: reclaim over: gave back 256 MiB, its target reached within")) << b.log();
  EXPECT_TRUE(eventually([&] { return b.tenant("burster").devices(0).reclaimed_bytes() == 256 * MiB; }, 3000))
      << b.tenant("burster").DebugString();
  EXPECT_GT(b.tenant("burster").devices(0).reclaim_seconds(), 0.0);
  // ... and cushare tenants says it.
  const std::string out = b.dir() + "/tenants.txt";
  ASSERT_EQ(std::system((std::string(CLI_BIN) + " --socket " + b.socket() + " tenants > " + out + " 2>&1").c_str()), 0);
  const std::string text = readAll(out);
  EXPECT_NE(text.find("burster on 0: plain, guarantee 256 MiB, 256 MiB above it, 256 MiB taken back so far, the last "
                      "reclaim reached its target in "),
            std::string::npos)
      << text;
  // Over: it may burst again into what is free.
  EXPECT_EQ(steady.ask("freeall"), "ok");
  EXPECT_EQ(burster.ask("alloc " + mib(256)), "ok");
  // A stream-ordered allocation from a pool within the guarantee waits for plain bursts too.
  ASSERT_EQ(steady.ask("pool " + mib(256)), "ok");
  EXPECT_EQ(deviceUsed(), 1024 * MiB) << "full again";
  const std::string pooled = steady.ask("pool " + mib(256), 10000);
  EXPECT_EQ(pooled, "ok") << b.log() << readAll(b.dir() + "/tenants.log");
  EXPECT_EQ(burster.ask("held"), "held " + mib(512)) << "it gave 256 MiB back a second time";
  EXPECT_EQ(deviceUsed(), 1024 * MiB);
  for (Child* c : {&burster, &steady}) c->send("quit");
}

// A plain burster that does not give back: past the deadline its allocations above its guarantee
// are refused (its published limit is its guarantee) until the reclaim is over; the waiting
// allocation fails after reclaim_wait_ms; nothing is taken, nothing lost.
TEST(Elastic, APlainBursterThatDoesNotGiveBackIsRefusedPastTheDeadlineAndLosesNothing) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run tenants on uids of their own";
  TwoUids u(testDir());
  ASSERT_NO_FATAL_FAILURE(u.start("elasticity: {reclaim_wait_ms: 1500, reclaim_deadline_ms: 300}\n"
                                  "tenants:\n"
                                  "  - {name: burster, uid: 1000, memory: 1GiB, guarantee: 256MiB, burst: plain}\n"
                                  "  - {name: steady, uid: 1001, memory: 768MiB}\n"));
  Broker& b = u.b;
  Child& burster = u.burster;
  Child& steady = u.steady;
  for (int i = 0; i < 3; ++i) ASSERT_EQ(burster.ask("pattern " + mib(256)), "ok") << i;
  ASSERT_EQ(steady.ask("alloc " + mib(256)), "ok");
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the broker has seen the burst (a tick)
  ASSERT_TRUE(steady.send("talloc " + mib(256)));  // waits
  // Past the deadline: held to its guarantee, by the limit it is published.
  EXPECT_TRUE(eventually([&] { return limitOn0(b.tenant("burster")) == 256 * MiB; }, 1200)) << b.log();
  const uint64_t deniedBefore = b.tenant("burster").devices(0).denied();
  EXPECT_EQ(burster.ask("alloc " + mib(1)), "oom");
  EXPECT_EQ(b.tenant("burster").devices(0).denied(), deniedBefore + 1) << "refused by its limit, not by a full device";
  const std::string got = steady.readLine(5000);
  EXPECT_EQ(got.rfind("oom ", 0), 0u) << got;
  EXPECT_GE(std::atoi(got.c_str() + 4), 1400) << got << ": it waited reclaim_wait_ms";
  EXPECT_TRUE(b.logHas("tenant burster device 0: did not give back its plain bursts within 300 ms")) << b.log();
  // The reclaim is over: its limit is back, and nothing it holds was taken.
  EXPECT_TRUE(eventually([&] { return limitOn0(b.tenant("burster")) == 1024 * MiB; }, 2000)) << b.log();
  EXPECT_TRUE(b.logHas("tenant burster device 0: reclaim over: gave back 0 B, its target never reached")) << b.log();
  EXPECT_EQ(burster.ask("check"), "intact 3");
  EXPECT_EQ(deviceUsed(), 1024 * MiB);
  for (Child* c : {&burster, &steady}) c->send("quit");
}

// A tenant that writes waits into its own ledger makes nobody give back: not for memory it does
// not hold, not while the device has room (attack review of plain bursting, 2026-12-07: forged
// waits were believed up to the tenant's guarantee and kept bursters clamped).
TEST(Elastic, ForgedWaitsMakeNobodyGiveBack) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run tenants on uids of their own";
  TwoUids u(testDir());
  ASSERT_NO_FATAL_FAILURE(u.start("elasticity: {reclaim_wait_ms: 1000, reclaim_deadline_ms: 100}\n"
                                  "tenants:\n"
                                  "  - {name: burster, uid: 1000, memory: 768MiB, guarantee: 256MiB, burst: plain}\n"
                                  "  - {name: steady, uid: 1001, memory: 768MiB}\n"));
  ASSERT_EQ(u.burster.ask("alloc " + mib(512)), "ok");  // 256 MiB of plain bursts
  EXPECT_EQ(u.steady.ask("forgewant " + mib(512) + " 400"), "forged") << "holding nothing";
  ASSERT_EQ(u.steady.ask("alloc " + mib(256)), "ok");
  EXPECT_EQ(u.steady.ask("forgewant " + mib(256) + " 400"), "forged") << "holding 256 MiB, with 256 MiB free";
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_FALSE(u.b.logHas("asked to give back", 100)) << u.b.log();
  EXPECT_EQ(limitOn0(u.b.tenant("burster")), 768 * MiB) << "never clamped";
  EXPECT_EQ(u.burster.ask("alloc " + mib(64)), "ok") << "it may still burst";
  for (Child* c : {&u.burster, &u.steady}) c->send("quit");
}

// A broker killed during a reclaim ends it: the next broker, adopting the limits files, clears
// the targets the first one set (no process is told to give back for a wait that is over), and
// the burster's limit is its own again (the clamp lived in the broker).
TEST(Elastic, ABrokerRestartedDuringAReclaimEndsIt) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run tenants on uids of their own";
  TwoUids u(testDir());
  ASSERT_NO_FATAL_FAILURE(u.start("elasticity: {reclaim_wait_ms: 800, reclaim_deadline_ms: 200}\n"
                                  "tenants:\n"
                                  "  - {name: burster, uid: 1000, memory: 1GiB, guarantee: 256MiB, burst: plain}\n"
                                  "  - {name: steady, uid: 1001, memory: 768MiB}\n"));
  ASSERT_EQ(u.burster.ask("alloc " + mib(768)), "ok");
  ASSERT_EQ(u.steady.ask("alloc " + mib(256)), "ok");
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the broker has seen the burst (a tick)
  ASSERT_TRUE(u.steady.send("talloc " + mib(256)));  // waits; the burster does not give back
  EXPECT_TRUE(eventually([&] { return u.burster.ask("target") == "target " + mib(512) + " held " + mib(768); }, 1000))
      << u.burster.ask("target") << "\n" << u.b.log();
  EXPECT_TRUE(eventually([&] { return limitOn0(u.b.tenant("burster")) == 256 * MiB; }, 1000)) << "clamped";
  u.b.kill9();
  EXPECT_EQ(u.steady.readLine(5000).rfind("oom ", 0), 0u) << "the wait ends without a broker";
  ASSERT_TRUE(u.b.startWithFile()) << u.b.log();
  EXPECT_EQ(u.burster.ask("target"), "none held " + mib(768)) << "the old target is cleared";
  EXPECT_EQ(limitOn0(u.b.tenant("burster")), 1024 * MiB) << "no clamp survives the broker";
  EXPECT_EQ(u.burster.ask("alloc " + mib(1)), "oom") << "the device is full";
  EXPECT_EQ(u.b.tenant("burster").devices(0).denied(), 0u) << "refused by the device, not by a clamp";
  for (Child* c : {&u.burster, &u.steady}) c->send("quit");
}

// Not a test (ctest runs Elastic.* only): perf/burst_overhead.sh runs it and docs/performance.md
// reports it. What an allocation and free pair costs a tenant without the shim, under the shim
// without bursting (the broker's tenant, so the burst checks run), and bursting (every allocation
// above its guarantee: managed memory and its prefetch); medians of BURST_BENCH_ROUNDS rounds
// (default 5), the three interleaved in each round, so host drift hits them alike. simgpu's own
// work (mmap, its stream worker) is in every figure: the ratios, not the times, carry over.
TEST(ElasticBench, AllocationCost) {
  const char* r = std::getenv("BURST_BENCH_ROUNDS");
  const int rounds = r && *r ? std::atoi(r) : 5;
  Broker b(testDir());
  ASSERT_TRUE(b.start("tenants:\n  - {name: plain, memory: 1GiB}\n  - {name: burst, memory: 1GiB, guarantee: 16MiB}\n"))
      << b.log();
  Child none = Child::spawn({WORKER_BIN}, {{"LD_PRELOAD", ""}}, b.dir() + "/tenants.log");
  ASSERT_EQ(none.readLine(), "ready");
  Child plain = b.tenantProcess("plain");
  Child burst = b.tenantProcess("burst");
  ASSERT_EQ(burst.ask("alloc " + mib(16)), "ok");  // its guarantee held: every allocation now bursts
  for (uint64_t bytes : {uint64_t{4096}, uint64_t{1} << 20}) {
    std::vector<double> t[3];
    for (int i = 0; i < rounds; ++i)
      for (int k = 0; k < 3; ++k) {
        Child& c = k == 0 ? none : k == 1 ? plain : burst;
        const std::string a = c.ask("time " + std::to_string(bytes) + " 20000", 120000);
        ASSERT_EQ(a.rfind("ns ", 0), 0u) << k << ": " << a;
        t[k].push_back(std::strtod(a.c_str() + 3, nullptr));
      }
    double med[3];
    for (int k = 0; k < 3; ++k) {
      std::sort(t[k].begin(), t[k].end());
      med[k] = t[k][t[k].size() / 2];
    }
    std::printf("alloc-pair bytes=%llu none_ns=%.1f shim_ns=%.1f burst_ns=%.1f shim_ratio=%.2f burst_ratio=%.2f\n",
                static_cast<unsigned long long>(bytes), med[0], med[1], med[2], med[1] / med[0], med[2] / med[0]);
    std::fflush(stdout);
  }
  EXPECT_EQ(burst.ask("kinds"), "managed 0 plain " + mib(16)) << "the timed pairs were all freed";
  for (Child* c : {&none, &plain, &burst}) c->send("quit");
}

// ---- The thrashing guard (docs/memory-elasticity.md, "Thrashing") ----

// Device 0's number `key` in simgpu-smi --json (the device's own count), or -1.
double smiDevice(const std::string& key) {
  std::string json;
  if (FILE* p = ::popen(SIMGPU_SMI " --json", "r")) {
    char buf[4096];
    for (size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) json.append(buf, n);
    ::pclose(p);
  }
  const size_t f = json.find("\"" + key + "\": ");
  return f == std::string::npos ? -1 : std::strtod(json.c_str() + f + key.size() + 4, nullptr);
}

// The value of a device family's sample for device 0 ("" if none).
std::string deviceSample(const std::string& metrics, const std::string& family) {
  return sampleWith(metrics, family, "device=\"0\"");
}

// The tenants of u, each 256 MiB guaranteed and a 640 MiB limit (first, second: more settings).
std::string bursterTenants(const TwoUids& u, const std::string& first = "", const std::string& second = "") {
  return "tenants:\n  - {name: " + u.names[0] + ", uid: 1000, memory: 640MiB, guarantee: 256MiB" + first +
         "}\n  - {name: " + u.names[1] + ", uid: 1001, memory: 640MiB, guarantee: 256MiB" + second + "}\n";
}

// Starts u's broker on head + bursterTenants(...), and each tenant takes 256 MiB of ordinary
// memory and 384 MiB of burst (managed), each with a pattern of its own.
void startBursting(TwoUids& u, const std::string& head = "", const std::string& first = "",
                   const std::string& second = "") {
  ASSERT_NO_FATAL_FAILURE(u.start(head + bursterTenants(u, first, second)));
  for (Child* c : {&u.burster, &u.steady}) {
    ASSERT_EQ(c->ask("pattern " + mib(256)), "ok");
    ASSERT_EQ(c->ask("pattern " + mib(384)), "ok");
    ASSERT_EQ(c->ask("kinds"), "managed " + mib(384) + " plain " + mib(256));
  }
}

// Two managed bursters on a 1 GiB device, each 256 MiB guaranteed (ordinary memory) and 384 MiB
// of burst (managed): 512 MiB of room for 768 MiB of bursts. Touching their bursts side by side,
// each kernel's launch faults back what the other's evicted (simgpu charges 200 us of device time
// per 2 MiB chunk migrated, as a page fault's migration costs on a GPU). With the guard they take
// turns: the device migrates a working set once per turn, not once per kernel, and both get far
// more done. Judged by the device's own migration count (simgpu-smi) and the tenants' own rounds
// of work; live: the guard is off, then switched on by a reload. Tenants on uids of their own.
TEST(ElasticThrash, BurstersThatDoNotFitTakeTurnsInsteadOfEvictingEachOther) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run tenants on uids of their own";
  TwoUids u(testDir(), "left", "right");
  ASSERT_NO_FATAL_FAILURE(startBursting(u, "elasticity: {thrash_guard: off}\n"));
  const std::string tenants = bursterTenants(u);
  Broker& b = u.b;
  Child& left = u.burster;
  Child& right = u.steady;
  // Both touch their bursts for `ms`: their rounds, and what the device evicted meanwhile.
  struct Run {
    uint64_t left = 0, right = 0;
    double evicted = 0;
  };
  auto run = [&](int ms, Run* r, const std::function<void()>& during = {}) {
    const double e0 = smiDevice("managed_evicted_bytes");
    ASSERT_GE(e0, 0) << "simgpu-smi gave no migration count";
    for (Child* c : {&left, &right}) ASSERT_TRUE(c->send("touch " + std::to_string(ms)));
    if (during) during();
    const std::string a = left.readLine(60000), c = right.readLine(60000);
    ASSERT_EQ(a.rfind("touched ", 0), 0u) << a;
    ASSERT_EQ(c.rfind("touched ", 0), 0u) << c;
    r->left = field(a, 1);
    r->right = field(c, 1);
    r->evicted = smiDevice("managed_evicted_bytes") - e0;
  };
  Run off;
  ASSERT_NO_FATAL_FAILURE(run(2000, &off));
  std::printf("guard off: rounds %llu + %llu, evicted %.0f MiB\n", static_cast<unsigned long long>(off.left),
              static_cast<unsigned long long>(off.right), off.evicted / MiB);
  EXPECT_FALSE(b.logHas("take turns", 0)) << "thrash_guard: off";
  // Side by side, the bursts evict each other: more than a whole burst every half second.
  EXPECT_GT(off.evicted, 4 * 384.0 * MiB) << "the test's premise: without the guard the bursters thrash";

  std::ofstream(b.dir() + "/config.yaml") << brokerConfig(b.dir(), "elasticity: {thrash_quantum_ms: 500}\n" + tenants);
  ASSERT_TRUE(b.reload().ok()) << b.log();
  Run on;
  std::string gauge;
  std::string status;
  ASSERT_NO_FATAL_FAILURE(run(3000, &on, [&] {
    eventually([&] { return deviceSample(b.metrics(), "cushare_device_thrash_guard") == "1"; }, 2500);
    gauge = deviceSample(b.metrics(), "cushare_device_thrash_guard");
    const std::string out = b.dir() + "/status.txt";  // what an operator sees meanwhile
    EXPECT_EQ(std::system((std::string(CLI_BIN) + " --socket " + b.socket() + " status > " + out + " 2>&1").c_str()), 0);
    status = readAll(out);
  }));
  const double turns = std::strtod(deviceSample(b.metrics(), "cushare_device_thrash_turns_total").c_str(), nullptr);
  std::printf("guard on: rounds %llu + %llu, evicted %.0f MiB, turns %.0f\n", static_cast<unsigned long long>(on.left),
              static_cast<unsigned long long>(on.right), on.evicted / MiB, turns);
  EXPECT_TRUE(b.logHas("device 0: the managed bursts of left, right (768 MiB together) do not fit in the 512 MiB the "
                       "device has for them"))
      << b.log();
  EXPECT_EQ(gauge, "1") << "cushare_device_thrash_guard while they take turns";
  EXPECT_NE(status.find("device 0: the tenants bursting into managed memory take turns on it"), std::string::npos)
      << status;
  // The device moves a working set once per turn (at most a whole burst each), not per kernel.
  EXPECT_GE(turns, 2) << "both had turns";
  EXPECT_LE(on.evicted, (turns + 1) * 384.0 * MiB);
  EXPECT_GT(on.left, 0u) << "each gets turns";
  EXPECT_GT(on.right, 0u);
  // Per second, far more work done than while they thrashed (both together).
  const double perSecOff = static_cast<double>(off.left + off.right) / 2.0;
  const double perSecOn = static_cast<double>(on.left + on.right) / 3.0;
  EXPECT_GT(perSecOn, 3 * perSecOff) << "turns beat thrashing";
  // Nothing either wrote was lost; once neither has work, the turns end.
  EXPECT_EQ(left.ask("check"), "intact 2");
  EXPECT_EQ(right.ask("check"), "intact 2");
  EXPECT_TRUE(b.logHas("device 0: the managed bursters' turns end", 5000)) << b.log();
  EXPECT_TRUE(eventually([&] { return deviceSample(b.metrics(), "cushare_device_thrash_guard") == "0"; }, 3000));
  // A tenant with work alone is never held: it runs at once.
  EXPECT_EQ(left.ask("touch 200").rfind("touched ", 0), 0u);
  for (Child* c : {&left, &right}) c->send("quit");
}

// A hostile burster that holds a real burst beside another's and claims work in its ledger
// without running anything (launches "in flight" that never complete) cannot idle the device for
// whole turns: its turn ends when its busy time does not move for half a quantum, and it keeps
// nobody waiting until it runs something. The honest burster keeps most of what it gets alone.
TEST(ElasticThrash, ABursterClaimingWorkItDoesNotRunLosesItsTurn) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run tenants on uids of their own";
  TwoUids u(testDir(), "honest", "idler");
  ASSERT_NO_FATAL_FAILURE(startBursting(u));
  Broker& b = u.b;
  Child& honest = u.burster;
  Child& idler = u.steady;
  const double alone = static_cast<double>(field(honest.ask("touch 2000", 60000), 1)) / 2;
  ASSERT_TRUE(idler.send("forgework 6000"));
  const double beside = static_cast<double>(field(honest.ask("touch 4000", 60000), 1)) / 4;
  EXPECT_EQ(idler.readLine(20000), "forged");
  std::printf("honest burster: %.0f rounds per second alone, %.0f beside the idler (%.2f)\n", alone, beside,
              beside / alone);
  EXPECT_TRUE(b.logHas("do not fit in the 512 MiB the device has for them", 0)) << "the guard started" << b.log();
  EXPECT_TRUE(b.logHas("thrashing guard: idler claimed work for")) << b.log();
  // Its turns of a second would leave the device idle half the time; it costs one stall window
  // (half a quantum) and a drain, then waits for its busy time to move: the honest one keeps most.
  EXPECT_GT(beside, 0.7 * alone);
  EXPECT_EQ(honest.ask("check"), "intact 2");
  for (Child* c : {&honest, &idler}) c->send("quit");
}

// The guard beside the scheduler: a burster of high priority under a compute cap and one of low
// priority. While the low one holds the guard's turn, the high one is held back and out of the
// scheduler's reckoning, so its waiting launches neither keep the scheduler's turn nor hold the
// low one to its priority floor: the low one runs its turns at full speed, the device not idle.
TEST(ElasticThrash, TurnsHoldBesideCapsAndPriorities) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run tenants on uids of their own";
  TwoUids u(testDir(), "high", "low");
  ASSERT_NO_FATAL_FAILURE(startBursting(u, "", ", priority: high, thread_percentage: 50", ", priority: low"));
  Broker& b = u.b;
  Child& high = u.burster;
  Child& low = u.steady;
  const uint64_t alone = field(low.ask("touch 2000", 60000), 1);
  for (Child* c : {&high, &low}) ASSERT_TRUE(c->send("touch 3000"));
  const uint64_t h = field(high.readLine(60000), 1), l = field(low.readLine(60000), 1);
  std::printf("low alone: %llu rounds in 2 s; side by side in 3 s: high %llu, low %llu\n",
              static_cast<unsigned long long>(alone), static_cast<unsigned long long>(h),
              static_cast<unsigned long long>(l));
  EXPECT_TRUE(b.logHas("do not fit in the 512 MiB the device has for them", 0)) << b.log();
  EXPECT_GT(h, 0u);
  // About half of 3 s at full speed is 0.75 of what it did alone in 2 s; held to its floor in its
  // own turns it would get next to nothing.
  EXPECT_GT(static_cast<double>(l), 0.25 * static_cast<double>(alone)) << b.log();
  for (Child* c : {&high, &low}) c->send("quit");
}

}  // namespace
}  // namespace cushare::test
