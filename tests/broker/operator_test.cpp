// End-to-end tests of operator mistakes and of what unknown users can do before and around the
// broker: a ledger directory someone else created first, tenants taken out of the configuration,
// a ledger another user created for a name that becomes a tenant, floods of unknown-tenant
// ledgers, state file and socket places, a host segment that cannot be written, --check. Users
// are separate uids (fork + setuid, or setpriv for tenant processes); the limits are judged by the
// device's own accounting (simgpu's NVML) as well as the broker's.
#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <grp.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <thread>
#include <tuple>

#include "cushare/host_segment.h"
#include "cushare/ledger.h"
#include "cushare/shim_config.h"
#include "harness.h"
#include "simgpu/nvml.h"

namespace cushare::test {
namespace {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

constexpr uid_t kOther = 2000;  // a user that is not the broker's and not a tenant's

std::string fileText(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Runs fn in a child process as uid/gid; its exit status.
int runAs(uid_t uid, const std::function<int()>& fn) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    if (::setgroups(0, nullptr) != 0 || ::setgid(uid) != 0 || ::setuid(uid) != 0) ::_exit(99);
    ::_exit(fn());
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 100;
}

// Programs other uids run, staged once where every user can read them (the checkout may lie
// where they cannot enter); removed at exit.
UidTenants& users() {
  static UidTenants u;
  return u;
}

// A tenant process (tenant_worker under the shim) run as uid; its first line in *first.
Child workerAs(Broker& b, uid_t uid, const std::string& tenant, std::string* first) {
  Child c = users().spawn(uid, WORKER_BIN, b, tenant, {{"CUSHARE_LOG_LEVEL", "error"}});
  *first = c.readLine();
  return c;
}

bool waitFor(const std::function<bool()>& cond, int ms = 5000) {
  const auto start = Clock::now();
  while (!cond()) {
    if (Clock::now() - start > std::chrono::milliseconds(ms)) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

// A process of uid 2000 running tenant as an unknown tenant, holding mib MiB, once adopted.
Child unknownHolding(Broker& b, const std::string& tenant, uint64_t mib) {
  std::string first;
  Child c = workerAs(b, kOther, tenant, &first);
  EXPECT_EQ(first, "ready") << fileText(b.dir() + "/tenants.log");
  EXPECT_EQ(c.ask("alloc " + std::to_string(mib * MiB)), "ok");
  // Adopted, with its device entry (which may follow the adoption by a tick).
  EXPECT_TRUE(waitFor([&] {
    const rpc::Tenant t = b.tenant(tenant);
    return t.source() == "unknown-tenant" && t.devices_size() > 0;
  }));
  return c;
}

// cushare-broker --check on <dir>/config.yaml: its exit status; what it wrote is in <dir>/check.log.
int runCheck(const std::string& dir) {
  ::unlink((dir + "/check.log").c_str());
  Child c = Child::spawn({BROKER_BIN, "--config", dir + "/config.yaml", "--check"}, {{"LD_PRELOAD", ""}},
                         dir + "/check.log");
  const int status = c.wait();
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

void rewriteConfig(const Broker& b, const std::string& body) {
  std::ofstream(b.dir() + "/config.yaml") << brokerConfig(b.dir(), body);
}

int openDescriptors(pid_t pid) {
  int n = 0;
  if (DIR* d = ::opendir(("/proc/" + std::to_string(pid) + "/fd").c_str())) {
    while (const dirent* e = ::readdir(d)) n += e->d_name[0] != '.';
    ::closedir(d);
  }
  return n;
}

// What the host segment offers a new unknown tenant on device 0.
uint64_t hostUnknownLimit(const Broker& b) {
  HostInfo h;
  std::string err;
  if (readHostSegment(b.ledgerDir(), &h, &err) != 1 || h.devices.empty()) return UINT64_MAX - 1;
  return h.devices[0].unknownLimit;
}

std::string held(uint64_t mib) { return "held " + std::to_string(mib * MiB); }
std::string fill() { return "fill " + std::to_string(64 * MiB); }

// ---- The ledger directory, created first by someone else ----

// A user creates the ledger directory before the broker starts, with a link where a ledger will be,
// a host segment of its own and a fake ledger. The broker swaps it aside unread and starts on a
// fresh one of its own; the link's target is untouched.
TEST(Operator, LedgerDirCreatedFirstByAnotherUserIsMovedAside) {
  if (::geteuid() != 0) GTEST_SKIP() << "switching users needs root (CI runs as root)";
  Broker b(testDir());
  const std::string victim = b.dir() + "/victim";
  std::ofstream(victim) << "precious";
  const std::string dir = b.ledgerDir();
  // Its parent is writable by everyone for a moment (as /dev/shm always is, with the sticky bit).
  ASSERT_EQ(::chmod(b.dir().c_str(), 01777), 0);
  ASSERT_EQ(runAs(kOther, [&] {
              if (::mkdir(dir.c_str(), 0777) != 0 || ::chmod(dir.c_str(), 0777) != 0) return 1;
              if (::symlink(victim.c_str(), (dir + "/alpha.ledger").c_str()) != 0) return 2;
              std::ofstream(dir + "/host.segment") << "planted";
              std::ofstream(dir + "/beta.ledger") << "not a ledger";
              return 0;
            }),
            0);
  ASSERT_EQ(::chmod(b.dir().c_str(), 0755), 0);  // the state file's directory must be the broker's alone
  ASSERT_TRUE(b.start("tenants:\n  - {name: alpha, memory: 512MiB}\n  - {name: beta, memory: 256MiB}\n")) << b.log();
  struct stat st;
  ASSERT_EQ(::lstat(dir.c_str(), &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  EXPECT_EQ(st.st_uid, 0u);
  EXPECT_EQ(st.st_mode & 07777, 0711u);
  ASSERT_EQ(::lstat((dir + "/host.segment").c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, 0u) << "the broker's own segment";
  EXPECT_EQ(fileText(victim), "precious") << "the planted link was never followed";
  std::string aside;
  for (const auto& e : fs::directory_iterator(b.dir()))
    if (e.path().filename().string().rfind("ledgers.untrusted-", 0) == 0) aside = e.path();
  ASSERT_FALSE(aside.empty()) << "the old directory is kept, unread";
  EXPECT_EQ(fileText(aside + "/host.segment"), "planted");
  EXPECT_NE(b.log().find("belonged to uid 2000 (created before the broker by someone else): moved aside"),
            std::string::npos)
      << b.log();
  Child alpha = b.tenantProcess("alpha");
  EXPECT_EQ(alpha.ask(fill()), held(512));
  EXPECT_EQ(b.tenant("beta").source(), "config");
}

// The same with a link planted as the ledger directory itself.
TEST(Operator, LedgerDirPlantedAsALinkIsMovedAside) {
  if (::geteuid() != 0) GTEST_SKIP() << "switching users needs root (CI runs as root)";
  Broker b(testDir());
  const std::string target = b.dir() + "/theirs";
  ASSERT_EQ(::chmod(b.dir().c_str(), 01777), 0);
  ASSERT_EQ(runAs(kOther, [&] { return ::symlink(target.c_str(), b.ledgerDir().c_str()); }), 0);
  ASSERT_EQ(::chmod(b.dir().c_str(), 0755), 0);
  ASSERT_EQ(::mkdir(target.c_str(), 0777), 0);
  rewriteConfig(b, "tenants:\n  - {name: alpha, memory: 512MiB}\n");
  EXPECT_EQ(runCheck(b.dir()), 0);
  EXPECT_NE(fileText(b.dir() + "/check.log").find("belongs to uid 2000: the broker will move it aside, unread"),
            std::string::npos)
      << fileText(b.dir() + "/check.log");
  ASSERT_TRUE(b.startWithFile()) << b.log();
  struct stat st;
  ASSERT_EQ(::lstat(b.ledgerDir().c_str(), &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode)) << "a directory of the broker's, not the link";
  EXPECT_FALSE(fs::exists(target + "/alpha.ledger")) << "nothing created through the link";
}

// ---- Tenants taken out of the configuration ----

// A tenant with a live limit below its configured one is removed from the configuration while a
// process of it holds memory; admitted again under a larger unknown-tenant profile it keeps the
// lower limit, and so after a restart without it. The device counts exactly that much.
TEST(Operator, RemovedTenantNeverGetsAHigherLimit) {
  Broker b(testDir());
  const uint64_t base = deviceUsed();
  ASSERT_TRUE(b.start("tenants:\n  - {name: alpha, memory: 512MiB}\n  - {name: beta, memory: 256MiB}\n")) << b.log();
  Child alpha = b.tenantProcess("alpha");
  ASSERT_EQ(alpha.ask("alloc " + std::to_string(128 * MiB)), "ok");
  ASSERT_TRUE(b.setLimit("alpha", "256MiB").ok());
  // Reload: alpha is no longer listed; unknown tenants get 1 GiB.
  rewriteConfig(b, "unknown_tenants: big\nmax_unknown_tenants: 2\nprofiles:\n  big: {memory: 1GiB}\n"
                   "tenants:\n  - {name: beta, memory: 256MiB}\n");
  ASSERT_TRUE(b.reload().ok()) << b.log();
  EXPECT_EQ(b.tenant("alpha").source(), "unknown-tenant");
  EXPECT_EQ(limitOn0(b.tenant("alpha")), 256 * MiB);
  EXPECT_EQ(alpha.ask(fill()), held(256)) << "not the profile's 1 GiB";
  EXPECT_EQ(deviceUsed() - base, 256 * MiB);
  // Reload again, unknown tenants refused: removed, still 256 MiB.
  rewriteConfig(b, "tenants:\n  - {name: beta, memory: 256MiB}\n");
  ASSERT_TRUE(b.reload().ok()) << b.log();
  EXPECT_EQ(b.tenant("alpha").source(), "removed");
  EXPECT_EQ(alpha.ask("alloc " + std::to_string(64 * MiB)), "oom");
  ASSERT_EQ(alpha.ask("freeall"), "ok");
  ASSERT_EQ(alpha.ask("alloc " + std::to_string(128 * MiB)), "ok");
  // Restart: the removed tenant's ledger is found again with its limit, not unlimited.
  b.stop();
  ASSERT_TRUE(b.startWithFile()) << b.log();
  EXPECT_EQ(b.tenant("alpha").source(), "removed");
  EXPECT_EQ(limitOn0(b.tenant("alpha")), 256 * MiB);
  EXPECT_EQ(alpha.ask(fill()), held(256));
  EXPECT_EQ(deviceUsed() - base, 256 * MiB);
}

// Removed while the broker was down: the restarted broker keeps the limit it last applied (the
// state file), even if the tenant raised its own ledger's limit meanwhile.
TEST(Operator, TenantRemovedWhileTheBrokerWasDownKeepsItsLimit) {
  const std::string root = testDir();
  // Restarted without alpha: unknown tenants refused (alpha is removed), or admitted under a
  // profile of 1 GiB (alpha is an unknown tenant, still held to 512 MiB).
  for (const auto& [name, unknown, source] :
       {std::tuple<std::string, std::string, std::string>{"refused", "", "removed"},
        {"admitted", "unknown_tenants: big\nmax_unknown_tenants: 2\nprofiles:\n  big: {memory: 1GiB}\n",
         "unknown-tenant"}}) {
    SCOPED_TRACE(name);
    Broker b(root + "/" + name);
    fs::create_directories(b.dir());
    const uint64_t base = deviceUsed();
    ASSERT_TRUE(b.start("tenants:\n  - {name: alpha, memory: 512MiB}\n  - {name: beta, memory: 256MiB}\n")) << b.log();
    Child alpha = b.tenantProcess("alpha");
    ASSERT_EQ(alpha.ask("alloc " + std::to_string(64 * MiB)), "ok");
    b.stop();
    {
      LedgerOpenOptions o;
      o.createDir = o.createFile = o.claimSlot = false;
      std::string err;
      auto l = Ledger::open(b.ledgerDir(), "alpha", o, &err);
      ASSERT_TRUE(l) << err;
      l->setLimit(0, kLedgerNoLimit);  // the tenant raises its own limit while nobody watches
    }
    rewriteConfig(b, unknown + "tenants:\n  - {name: beta, memory: 256MiB}\n");
    ASSERT_TRUE(b.startWithFile()) << b.log();
    EXPECT_EQ(b.tenant("alpha").source(), source);
    EXPECT_EQ(limitOn0(b.tenant("alpha")), 512 * MiB);
    EXPECT_EQ(alpha.ask(fill()), held(512)) << "not unlimited, not the profile's 1 GiB";
    EXPECT_EQ(deviceUsed() - base, 512 * MiB);
  }
}

// ---- A ledger another user created for a name that becomes a tenant ----

// Unknown tenants admitted under a profile; then delta configured for uid 1000.
const std::string kUnknownAllowed = "unknown_tenants: small\nprofiles:\n  small: {memory: 256MiB}\n"
                                    "tenants:\n  - {name: alpha, memory: 512MiB}\n";
const std::string kDeltaConfigured = kUnknownAllowed + "  - {name: delta, memory: 512MiB, uid: 1000}\n";

TEST(Operator, LedgerOfAnotherUserIsReplacedAndItsUsageStillCounts) {
  if (::geteuid() != 0) GTEST_SKIP() << "switching users needs root (CI runs as root)";
  Broker b(testDir());
  const uint64_t base = deviceUsed();
  ASSERT_TRUE(b.start(kUnknownAllowed)) << b.log();
  // uid 2000 runs "delta" as an unknown tenant and holds 192 MiB.
  Child squatter = unknownHolding(b, "delta", 192);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the broker sees it on the device
  std::string first;
  struct stat before;
  ASSERT_EQ(::stat((b.ledgerDir() + "/delta.ledger").c_str(), &before), 0);
  EXPECT_EQ(before.st_uid, kOther);
  // The operator now configures delta for uid 1000.
  rewriteConfig(b, kDeltaConfigured);
  ASSERT_TRUE(b.reload().ok()) << b.log();
  struct stat after;
  ASSERT_EQ(::stat((b.ledgerDir() + "/delta.ledger").c_str(), &after), 0);
  EXPECT_EQ(after.st_uid, 1000u) << "a fresh ledger of the tenant's user";
  EXPECT_NE(after.st_ino, before.st_ino) << "replaced, not handed over";
  ASSERT_EQ(::stat((b.ledgerDir() + "/delta.ledger.replaced.1").c_str(), &after), 0);
  EXPECT_EQ(after.st_ino, before.st_ino);
  EXPECT_EQ(usedOn0(b.tenant("delta")), 192 * MiB) << "the squatter's usage still counts";
  EXPECT_EQ(limitOn0(b.tenant("delta")), 512 * MiB);
  // Charged once: the broker's check for memory hidden from the ledger (five ticks) counts what
  // the former ledger's processes hold as explained.
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  EXPECT_EQ(hiddenOf(b, "delta"), 0u) << b.log();
  EXPECT_EQ(usedOn0(b.tenant("delta")), 192 * MiB) << "not charged twice";
  // The tenant's own processes get what is left; the squatter cannot grow.
  Child own = workerAs(b, 1000, "delta", &first);
  ASSERT_EQ(first, "ready") << fileText(b.dir() + "/tenants.log");
  EXPECT_EQ(own.ask(fill()), held(320)) << "512 MiB in all, the squatter's 192 MiB included";
  EXPECT_EQ(squatter.ask("alloc " + std::to_string(64 * MiB)), "oom");
  EXPECT_EQ(deviceUsed() - base, 512 * MiB);
  EXPECT_EQ(b.tenant("delta").processes(), 2u) << "the squatter's process is listed with the tenant's";
  // A restart finds the renamed ledger again (the state file recorded it): still charged.
  b.stop();
  ASSERT_TRUE(b.startWithFile()) << b.log();
  EXPECT_EQ(usedOn0(b.tenant("delta")), 512 * MiB) << b.log();
  EXPECT_EQ(own.ask("alloc " + std::to_string(64 * MiB)), "oom");
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  EXPECT_EQ(hiddenOf(b, "delta"), 0u) << b.log();
  // The squatter owns its former ledger and zeroes its counters: the former ledger's charge falls
  // with them, but the device still holds its 192 MiB for a process that maps a ledger of delta's:
  // found as hidden and charged (after a restart too, when the broker learns whose it is anew).
  EXPECT_EQ(squatter.ask("zero delta.ledger.replaced.1"), "ok");
  EXPECT_TRUE(waitFor([&] { return hiddenOf(b, "delta") == 192 * MiB; })) << hiddenOf(b, "delta") << "\n" << b.log();
  EXPECT_EQ(usedOn0(b.tenant("delta")), 512 * MiB);
  EXPECT_EQ(own.ask("alloc " + std::to_string(64 * MiB)), "oom");
  EXPECT_EQ(deviceUsed() - base, 512 * MiB);
  // Once the squatter exits, its share comes back to the tenant.
  squatter.kill(SIGKILL);
  squatter.wait();
  ASSERT_TRUE(waitFor([&] { return usedOn0(b.tenant("delta")) == 320 * MiB; })) << usedOn0(b.tenant("delta"));
  EXPECT_FALSE(fs::exists(b.ledgerDir() + "/delta.ledger.replaced.1"));
  EXPECT_EQ(own.ask(fill()), held(512));
  EXPECT_EQ(deviceUsed() - base, 512 * MiB);
  // The limit rose as the former ledger's charge fell: the broker's own doing, not tampering.
  EXPECT_EQ(b.log().find("outside the broker"), std::string::npos) << b.log();
}

// The creator of a former ledger (another user) can map it from any process of its own: such a
// process, allocating without the shim, is attributed to the tenant through the former ledger,
// but what it holds is charged only up to what that ledger carried when attached (already
// charged: nothing more), and a process of its own tenant that maps it too stays its own.
TEST(Operator, AFormerLedgersCreatorCannotChargeTheTenantMore) {
  if (::geteuid() != 0) GTEST_SKIP() << "switching users needs root (CI runs as root)";
  Broker b(testDir());
  const uint64_t base = deviceUsed();
  ASSERT_TRUE(b.start(kUnknownAllowed)) << b.log();
  Child squatter = unknownHolding(b, "delta", 192);
  rewriteConfig(b, kDeltaConfigured);
  ASSERT_TRUE(b.reload().ok()) << b.log();
  ASSERT_TRUE(fs::exists(b.ledgerDir() + "/delta.ledger.replaced.1"));
  EXPECT_EQ(usedOn0(b.tenant("delta")), 192 * MiB);
  // A fresh process of uid 2000, without the shim, maps the former ledger and allocates 256 MiB.
  Child raw = users().spawn(kOther, WORKER_BIN, b, "delta", {{"LD_PRELOAD", ""}, {"CUSHARE_LOG_LEVEL", ""}});
  ASSERT_EQ(raw.readLine(), "ready") << fileText(b.dir() + "/tenants.log");
  ASSERT_EQ(raw.ask("mapfile delta.ledger.replaced.1"), "mapped");
  ASSERT_EQ(raw.ask("alloc " + std::to_string(256 * MiB)), "ok");
  ASSERT_EQ(deviceUsed() - base, 448 * MiB) << "the device holds both";
  std::this_thread::sleep_for(std::chrono::milliseconds(600));  // a dozen ticks: found if it would be
  EXPECT_EQ(hiddenOf(b, "delta"), 0u) << b.log();
  EXPECT_EQ(usedOn0(b.tenant("delta")), 192 * MiB) << "charged no more than the former ledger carried";
  // The squatter zeroes its former ledger: what its processes hold is charged up to that 192 MiB,
  // never more (before: the whole 448 MiB).
  EXPECT_EQ(squatter.ask("zero delta.ledger.replaced.1"), "ok");
  EXPECT_TRUE(waitFor([&] { return hiddenOf(b, "delta") == 192 * MiB; })) << hiddenOf(b, "delta") << "\n" << b.log();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_EQ(hiddenOf(b, "delta"), 192 * MiB);
  EXPECT_EQ(usedOn0(b.tenant("delta")), 192 * MiB);
}

// A process of uid that holds `bytes` on device 0 in <dir>/<file> (a ledger of tenant), created as
// an attacker would, until the returned pipe is closed.
int holdInPlantedLedger(uid_t uid, const std::string& dir, const std::string& tenant, const std::string& file,
                        const std::string& deviceUuid, uint64_t bytes) {
  int ready[2], hold[2];
  if (::pipe(ready) != 0 || ::pipe(hold) != 0) return -1;
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(hold[1]);
    if (::setgroups(0, nullptr) != 0 || ::setgid(uid) != 0 || ::setuid(uid) != 0) ::_exit(99);
    LedgerOpenOptions o;
    o.createDir = false;
    o.fileName = file;
    std::string err;
    auto l = Ledger::open(dir, tenant, o, &err);
    uint8_t uuid[16] = {};
    const std::string hex = [&] {
      std::string h;
      for (char c : deviceUuid.substr(4)) if (c != '-') h += c;
      return h;
    }();
    for (int i = 0; i < 16; ++i) uuid[i] = static_cast<uint8_t>(std::stoi(hex.substr(2 * i, 2), nullptr, 16));
    const int e = l ? l->deviceIndex(uuid, kLedgerNoLimit, &err) : -1;
    const char ok = e >= 0 && l->reserve(e, bytes, kLedgerNoLimit) ? 'y' : 'n';
    (void)!::write(ready[1], &ok, 1);
    char c;
    (void)!::read(hold[0], &c, 1);  // until the test closes its end
    ::_exit(0);
  }
  ::close(ready[1]);
  ::close(hold[0]);
  char ok = 'n';
  (void)!::read(ready[0], &ok, 1);
  ::close(ready[0]);
  if (ok != 'y') {
    ::close(hold[1]);
    return -1;
  }
  return hold[1];
}

// Renamed-ledger names planted by a user, with a live process claiming usage in them, are not
// trusted: not charged to the tenant (".replaced.N"), not given a tenant's name (".removed").
TEST(Operator, PlantedFormerLedgersAreNotCharged) {
  if (::geteuid() != 0) GTEST_SKIP() << "switching users needs root (CI runs as root)";
  Broker b(testDir());
  const std::string config = "unknown_tenants: small\nprofiles:\n  small: {memory: 256MiB}\n"
                             "tenants:\n  - {name: alpha, memory: 512MiB}\n";
  ASSERT_TRUE(b.start(config)) << b.log();
  const std::string uuid = b.status().devices(0).uuid();
  const int a = holdInPlantedLedger(kOther, b.ledgerDir(), "alpha", "alpha.ledger.replaced.1", uuid, 384 * MiB);
  const int g = holdInPlantedLedger(kOther, b.ledgerDir(), "gamma", "gamma.ledger.removed", uuid, 384 * MiB);
  ASSERT_GE(a, 0);
  ASSERT_GE(g, 0);
  ASSERT_TRUE(waitFor([&] { return b.log().find("alpha.ledger.replaced.1 (uid 2000): refused") != std::string::npos; }))
      << b.log();
  rewriteConfig(b, config + "  - {name: gamma, memory: 512MiB}\n");
  ASSERT_TRUE(b.reload().ok()) << b.log();
  EXPECT_TRUE(fs::exists(b.ledgerDir() + "/gamma.ledger.removed")) << "not given gamma's name";
  EXPECT_EQ(usedOn0(b.tenant("alpha")), 0u);
  EXPECT_EQ(usedOn0(b.tenant("gamma")), 0u);
  Child alpha = b.tenantProcess("alpha");
  EXPECT_EQ(alpha.ask(fill()), held(512));
  Child gamma = b.tenantProcess("gamma");
  EXPECT_EQ(gamma.ask(fill()), held(512));
  ::close(a);
  ::close(g);
}

// ---- Unknown tenants: pool, caps, forgetting ----

// Unknown tenants admitted with 256 MiB each, beside a configured one.
constexpr const char* kSmallUnknown =
    "unknown_tenants: small\nprofiles:\n  small: {memory: 256MiB}\ntenants:\n  - {name: alpha, memory: 512MiB}\n";

// An unknown tenant that removes its ledger file (it owns it, in the sticky directory) and starts
// again does not get a second budget: what the old file's processes hold still counts.
TEST(Operator, UnknownTenantRecreatingItsLedgerGetsNoSecondBudget) {
  if (::geteuid() != 0) GTEST_SKIP() << "switching users needs root (CI runs as root)";
  Broker b(testDir());
  const uint64_t base = deviceUsed();
  ASSERT_TRUE(b.start(kSmallUnknown)) << b.log();
  Child old = unknownHolding(b, "zeta", 192);
  std::string first;
  ASSERT_EQ(runAs(kOther, [&] { return ::unlink((b.ledgerDir() + "/zeta.ledger").c_str()); }), 0);
  Child again = workerAs(b, kOther, "zeta", &first);
  ASSERT_EQ(first, "ready") << fileText(b.dir() + "/tenants.log");
  ASSERT_TRUE(waitFor([&] { return b.log().find("tenant zeta: its ledger file was replaced (by uid 2000)") !=
                                   std::string::npos; }))
      << b.log();
  EXPECT_EQ(again.ask(fill()), held(64)) << "256 MiB in all, the old file's 192 MiB included";
  EXPECT_EQ(usedOn0(b.tenant("zeta")), 256 * MiB);
  EXPECT_EQ(deviceUsed() - base, 256 * MiB);
  old.kill(SIGKILL);
  old.wait();
  ASSERT_TRUE(waitFor([&] { return usedOn0(b.tenant("zeta")) == 64 * MiB; })) << usedOn0(b.tenant("zeta"));
  EXPECT_EQ(again.ask(fill()), held(256));
}

// A scan of the ledger directory after the moment of calling: uid kOther creates another unknown
// tenant's (empty) file, which the broker adopts only by scanning.
bool scanned(Broker& b, const std::string& marker) {
  if (runAs(kOther, [&] {
        return ::close(::open((b.ledgerDir() + "/" + marker + ".ledger").c_str(), O_RDWR | O_CREAT, 0600));
      }) != 0)
    return false;
  return waitFor([&] { return b.tenant(marker).source() == "unknown-tenant"; });
}

// Found by a clean-clone CI run: a scan between the removal of an unknown tenant's file and its
// re-creation forgot the tenant, and the old file's processes' memory with it; the new file then
// had a whole budget of its own (192 + 256 MiB on the device for a 256 MiB profile).
TEST(Operator, UnknownTenantWhoseFileIsRemovedIsKeptWhileItsProcessesHoldMemory) {
  if (::geteuid() != 0) GTEST_SKIP() << "switching users needs root (CI runs as root)";
  Broker b(testDir());
  const uint64_t base = deviceUsed();
  ASSERT_TRUE(b.start(kSmallUnknown)) << b.log();
  Child old = unknownHolding(b, "zeta", 192);
  ASSERT_EQ(runAs(kOther, [&] { return ::unlink((b.ledgerDir() + "/zeta.ledger").c_str()); }), 0);
  ASSERT_TRUE(scanned(b, "marker")) << b.log();
  EXPECT_EQ(b.log().find("tenant zeta: its ledger file was removed; forgotten"), std::string::npos) << b.log();
  EXPECT_NE(b.log().find("tenant zeta: its ledger file was removed while its processes still run (1 in its ledger, "
                         "1 on the device); kept"),
            std::string::npos)
      << b.log();
  EXPECT_EQ(usedOn0(b.tenant("zeta")), 192 * MiB);
  std::string first;
  Child again = workerAs(b, kOther, "zeta", &first);
  ASSERT_EQ(first, "ready") << fileText(b.dir() + "/tenants.log");
  EXPECT_EQ(again.ask(fill()), held(64)) << "256 MiB in all, the old file's 192 MiB included";
  EXPECT_EQ(deviceUsed() - base, 256 * MiB) << "the device's own count";
  old.kill(SIGKILL);
  old.wait();
  ASSERT_TRUE(waitFor([&] { return usedOn0(b.tenant("zeta")) == 64 * MiB; })) << usedOn0(b.tenant("zeta"));
  EXPECT_EQ(again.ask(fill()), held(256));
  // Once no process holds anything the removed name is forgotten.
  ASSERT_EQ(runAs(kOther, [&] { return ::unlink((b.ledgerDir() + "/zeta.ledger").c_str()); }), 0);
  again.kill(SIGKILL);
  again.wait();
  ASSERT_TRUE(waitFor([&] { return b.log().find("tenant zeta: its ledger file was removed; forgotten") !=
                                   std::string::npos; }))
      << b.log();
  EXPECT_EQ(deviceUsed(), base);
}

// The same, its process emptying its slot first (pid and usage zeroed through its own mapping, as
// a tenant may): the ledger then shows no process, the device still does. Found by an attack
// review: the broker went by the ledger's slots alone and forgot the tenant.
TEST(Operator, AnUnknownTenantThatEmptiesItsLedgerIsStillKept) {
  if (::geteuid() != 0) GTEST_SKIP() << "switching users needs root (CI runs as root)";
  Broker b(testDir());
  const uint64_t base = deviceUsed();
  ASSERT_TRUE(b.start(kSmallUnknown)) << b.log();
  Child old = unknownHolding(b, "zeta", 192);
  // The worker's descriptor of its ledger: writes through it reach the file after its name goes.
  std::string fdPath;
  for (const auto& e : fs::directory_iterator("/proc/" + std::to_string(old.pid()) + "/fd")) {
    std::error_code ec;
    if (fs::read_symlink(e.path(), ec).string() == b.ledgerDir() + "/zeta.ledger") fdPath = e.path().string();
  }
  ASSERT_FALSE(fdPath.empty());
  ASSERT_EQ(runAs(kOther, [&] { return ::unlink((b.ledgerDir() + "/zeta.ledger").c_str()); }), 0);
  const int fd = ::open(fdPath.c_str(), O_WRONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  const std::vector<char> zeros(kLedgerUsedBytes + kLedgerPidBytes, 0);
  ASSERT_EQ(::pwrite(fd, zeros.data(), zeros.size(), kLedgerUsedOffset), static_cast<ssize_t>(zeros.size()));
  ::close(fd);
  ASSERT_TRUE(scanned(b, "marker")) << b.log();
  EXPECT_EQ(b.log().find("tenant zeta: its ledger file was removed; forgotten"), std::string::npos) << b.log();
  EXPECT_EQ(b.tenant("zeta").source(), "unknown-tenant");
  // What the device holds for it is charged to it (the hidden-memory check), not left to no one.
  EXPECT_TRUE(waitFor([&] { return usedOn0(b.tenant("zeta")) == 192 * MiB; })) << usedOn0(b.tenant("zeta"));
  EXPECT_EQ(deviceUsed() - base, 192 * MiB);
}

// The other half of that CI failure: a process re-creating the file got the unknown tenants'
// profile limit in its new device entry, and could allocate it all before the broker saw the new
// file. Entries a shim adds start at 0 and wait for the broker; here the broker is stopped meanwhile.
TEST(Operator, ARecreatedUnknownLedgerGrantsNothingBeforeTheBrokerSeesIt) {
  if (::geteuid() != 0) GTEST_SKIP() << "switching users needs root (CI runs as root)";
  Broker b(testDir());
  const uint64_t base = deviceUsed();
  ASSERT_TRUE(b.start(kSmallUnknown)) << b.log();
  Child old = unknownHolding(b, "zeta", 192);
  ASSERT_TRUE(stopProcess(b.pid()));
  ASSERT_EQ(runAs(kOther, [&] { return ::unlink((b.ledgerDir() + "/zeta.ledger").c_str()); }), 0);
  std::string first;
  const auto start = Clock::now();
  Child again = workerAs(b, kOther, "zeta", &first);
  ASSERT_EQ(first, "ready") << fileText(b.dir() + "/tenants.log");
  EXPECT_GE(Clock::now() - start, std::chrono::milliseconds(2000)) << "it waited for the broker, in vain";
  const std::string stopped = again.ask(fill());
  const uint64_t onDevice = deviceUsed() - base;
  ASSERT_EQ(::kill(b.pid(), SIGCONT), 0);
  EXPECT_EQ(stopped, held(0)) << "nothing before the broker has seen the new file";
  EXPECT_EQ(onDevice, 192 * MiB) << "the device's own count";
  ASSERT_TRUE(waitFor([&] { return b.log().find("tenant zeta: its ledger file was replaced (by uid 2000)") !=
                                   std::string::npos; }))
      << b.log();
  EXPECT_EQ(again.ask(fill()), held(64)) << fileText(b.dir() + "/tenants.log");
  EXPECT_EQ(deviceUsed() - base, 256 * MiB);
  EXPECT_EQ(b.log().find("outside the broker"), std::string::npos) << "entries a shim adds at 0 are not tampering";
}

// A ledger made by hand (any user may write one in the 1733 directory) with a limit of its own,
// whose creator holds its flock so that the broker never adopts it, grants its processes nothing:
// under a broker a shim takes its limits only from the broker's limits file for that ledger, which
// does not exist for a ledger the broker has not adopted. Before limits files the shim believed the
// ledger and allocated by the hand-written limit, seen by the broker only as a GPU process of no
// tenant. The broker is stopped while the file is made and locked, so it cannot adopt it first.
TEST(Operator, AHandMadeLedgerWhoseLockIsHeldGrantsNothing) {
  if (::geteuid() != 0) GTEST_SKIP() << "switching users needs root (CI runs as root)";
  Broker b(testDir());
  const uint64_t base = deviceUsed();
  ASSERT_TRUE(b.start(kSmallUnknown)) << b.log();
  uint8_t uuid[16];
  ASSERT_TRUE(parseGpuUuidBytes(b.status().devices(0).uuid(), uuid));
  const std::string dir = b.ledgerDir();
  int toTest[2], toHolder[2];
  ASSERT_EQ(::pipe(toTest), 0);
  ASSERT_EQ(::pipe(toHolder), 0);
  ASSERT_TRUE(stopProcess(b.pid()));
  // The holder makes the ledger (device 0 at 64 GiB), waits while a worker opens it, then takes
  // its flock for good.
  const pid_t holderPid = ::fork();
  if (holderPid == 0) {
    if (::setgroups(0, nullptr) != 0 || ::setgid(kOther) != 0 || ::setuid(kOther) != 0) ::_exit(99);
    LedgerOpenOptions o;
    o.createDir = false;
    o.claimSlot = false;
    std::string err;
    auto l = Ledger::open(dir, "zeta", o, &err);
    if (!l || l->deviceIndex(uuid, 64ull << 30, &err) != 0) ::_exit(98);
    char go = 0;
    (void)!::write(toTest[1], "m", 1);
    if (::read(toHolder[0], &go, 1) != 1) ::_exit(97);
    const int fd = ::open((dir + "/zeta.ledger").c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0 || ::flock(fd, LOCK_EX) != 0) ::_exit(96);
    (void)!::write(toTest[1], "l", 1);
    for (;;) ::pause();
  }
  Forked holder(holderPid);
  char c = 0;
  const bool made = ::read(toTest[0], &c, 1) == 1;
  std::string first;
  Child p = made ? workerAs(b, kOther, "zeta", &first) : Child();
  const bool locked = ::write(toHolder[1], "g", 1) == 1 && ::read(toTest[0], &c, 1) == 1;
  ASSERT_EQ(::kill(b.pid(), SIGCONT), 0);
  ASSERT_TRUE(made && locked) << "the hand-made ledger, then its lock";
  ASSERT_EQ(first, "ready") << fileText(b.dir() + "/tenants.log");
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // ticks in which the broker tries it
  EXPECT_EQ(p.ask(fill()), held(0)) << fileText(b.dir() + "/tenants.log");
  EXPECT_LE(deviceUsed() - base, 64 * MiB) << "the device's own count: a context at most";
}

// The sticky directory lets any user create a removed name: another user's file under the name of
// an unknown tenant whose processes still run is not that tenant's new ledger (it would carry the
// old processes' charge, and a second tenant past the other user's cap). Refused until removed.
TEST(Operator, AnotherUsersFileUnderAKeptUnknownTenantsNameIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "switching users needs root (CI runs as root)";
  Broker b(testDir());
  const uint64_t base = deviceUsed();
  ASSERT_TRUE(b.start(kSmallUnknown)) << b.log();
  Child old = unknownHolding(b, "zeta", 192);
  ASSERT_EQ(runAs(kOther, [&] { return ::unlink((b.ledgerDir() + "/zeta.ledger").c_str()); }), 0);
  std::string first;
  Child stranger = workerAs(b, kOther + 1, "zeta", &first);
  ASSERT_EQ(first, "ready") << fileText(b.dir() + "/tenants.log");
  ASSERT_TRUE(waitFor([&] { return b.log().find("ledger zeta.ledger (uid 2001): refused, the name belongs to uid 2000") !=
                                   std::string::npos; }))
      << b.log();
  EXPECT_EQ(stranger.ask(fill()), held(0));
  EXPECT_EQ(usedOn0(b.tenant("zeta")), 192 * MiB);
  EXPECT_EQ(deviceUsed() - base, 192 * MiB);
}

// A name replaced again and again while each old file's processes hold it open costs the broker a
// descriptor, a mapping and a look at processes every tick for each: at most 8 are kept, the next
// file is refused (and its processes get nothing).
TEST(Operator, AnUnknownTenantReplacedTooOftenIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "switching users needs root (CI runs as root)";
  Broker b(testDir());
  const uint64_t base = deviceUsed();
  ASSERT_TRUE(b.start(kSmallUnknown)) << b.log();
  std::vector<Child> held;
  held.push_back(unknownHolding(b, "zeta", 8));
  const auto replaced = [&] {
    const std::string log = b.log();
    size_t n = 0;
    for (size_t at = log.find("tenant zeta: its ledger file was replaced"); at != std::string::npos;
         at = log.find("tenant zeta: its ledger file was replaced", at + 1))
      ++n;
    return n;
  };
  for (size_t i = 1; i <= 8; ++i) {
    ASSERT_EQ(runAs(kOther, [&] { return ::unlink((b.ledgerDir() + "/zeta.ledger").c_str()); }), 0);
    std::string first;
    held.push_back(workerAs(b, kOther, "zeta", &first));
    ASSERT_EQ(first, "ready") << fileText(b.dir() + "/tenants.log");
    ASSERT_TRUE(waitFor([&] { return replaced() == i; })) << b.log();
    EXPECT_EQ(held.back().ask("alloc " + std::to_string(8 * MiB)), "ok") << i;
  }
  ASSERT_EQ(runAs(kOther, [&] { return ::unlink((b.ledgerDir() + "/zeta.ledger").c_str()); }), 0);
  std::string first;
  Child ninth = workerAs(b, kOther, "zeta", &first);
  ASSERT_EQ(first, "ready") << fileText(b.dir() + "/tenants.log");
  ASSERT_TRUE(waitFor([&] { return b.log().find("refused, the tenant's ledger was replaced 8 times") != std::string::npos; }))
      << b.log();
  EXPECT_EQ(ninth.ask("alloc " + std::to_string(8 * MiB)), "oom");
  EXPECT_EQ(replaced(), 8u);
  EXPECT_EQ(usedOn0(b.tenant("zeta")), 72 * MiB);
  EXPECT_EQ(deviceUsed() - base, 72 * MiB);
}

// Files another user writes into the ledger directory that are no ledger at all (here 100 of
// garbage) are logged within the budget of lines other users can cause, like refused ledgers:
// before, every one was logged (found by an attack review: 100 files, 100 error lines).
TEST(Operator, GarbageLedgerFilesAreLoggedWithinTheBudget) {
  if (::geteuid() != 0) GTEST_SKIP() << "switching users needs root (CI runs as root)";
  Broker b(testDir());
  ASSERT_TRUE(b.start(kSmallUnknown)) << b.log();
  constexpr int kFiles = 100;
  ASSERT_EQ(runAs(kOther, [&] {
              const std::string junk(8192, 'x');
              for (int i = 0; i < kFiles; ++i) {  // each whole when it appears under its name
                const std::string p = b.ledgerDir() + "/g" + std::to_string(i) + ".ledger", tmp = p + ".tmp";
                const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0600);
                if (fd < 0 || ::write(fd, junk.data(), junk.size()) != static_cast<ssize_t>(junk.size())) return 1;
                ::close(fd);
                if (::rename(tmp.c_str(), p.c_str()) != 0) return 1;
              }
              return 0;
            }),
            0);
  const auto lines = [&] {
    const std::string log = b.log();
    size_t n = 0;
    for (size_t at = log.find("error: ledger g"); at != std::string::npos; at = log.find("error: ledger g", at + 1)) ++n;
    return n;
  };
  // Dropped: one line per file past the first 20.
  const auto dropped = [&] {
    const std::string m = b.metrics();
    const std::string key = "\ncushare_broker_log_lines_dropped_total ";
    const size_t at = m.find(key);
    return at == std::string::npos ? 0ull : std::stoull(m.substr(at + key.size()));
  };
  ASSERT_TRUE(waitFor([&] { return dropped() >= kFiles - 20; }, 10000)) << lines() << " lines\n" << b.log();
  EXPECT_EQ(lines(), 20u) << b.log();
}

TEST(Operator, UnknownTenantsAreCappedAndForgottenWhenTheirFilesGo) {
  if (::geteuid() != 0) GTEST_SKIP() << "switching users needs root (CI runs as root)";
  Broker b(testDir());
  ASSERT_TRUE(b.start("unknown_tenants: small\nmax_unknown_tenants: 3\nmax_unknown_tenants_per_uid: 2\n"
                      "profiles:\n  small: {memory: 64MiB}\ntenants:\n  - {name: alpha, memory: 512MiB}\n"))
      << b.log();
  ASSERT_TRUE(waitFor([&] { return b.status().tenants() == 1u; }));
  const int fds = openDescriptors(b.pid());
  // uid 2000 floods the directory with ledger files, as the shim would create them.
  constexpr int kFiles = 300;
  ASSERT_EQ(runAs(kOther, [&] {
              for (int i = 0; i < kFiles; ++i) {
                const std::string p = b.ledgerDir() + "/u" + std::to_string(i) + ".ledger";
                const int fd = ::open(p.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
                if (fd < 0) return 1;
                ::close(fd);
              }
              return 0;
            }),
            0);
  ASSERT_TRUE(waitFor([&] { return b.metrics().find("cushare_broker_ledgers_refused_total " +
                                                   std::to_string(kFiles - 2) + "\n") != std::string::npos; },
                      20000))
      << b.metrics().substr(0, 400);
  EXPECT_EQ(b.status().tenants(), 3u) << "alpha and two of uid 2000's";
  // The log does not grow with another user's files: 20 refusal lines, the rest counted.
  const auto refusals = [&] {
    const std::string log = b.log();
    size_t n = 0;
    for (size_t at = log.find("): refused, max_unknown"); at != std::string::npos; at = log.find("): refused, max_unknown", at + 1)) ++n;
    return n;
  };
  EXPECT_EQ(refusals(), 20u) << b.log();
  EXPECT_NE(b.metrics().find("cushare_broker_log_lines_dropped_total " + std::to_string(kFiles - 2 - 20) + "\n"),
            std::string::npos);
  EXPECT_LE(openDescriptors(b.pid()), fds + 2 + 2) << "two adopted ledgers; nothing kept for the refused";
  // Another user gets the last place; a third finds the pool full: from then on the host segment
  // offers new unknown tenants no memory, so even before the broker refuses its file a new one
  // cannot allocate.
  EXPECT_EQ(hostUnknownLimit(b), 64 * MiB);
  ASSERT_EQ(runAs(2001, [&] { return ::close(::open((b.ledgerDir() + "/v.ledger").c_str(), O_RDWR | O_CREAT, 0600)); }), 0);
  ASSERT_TRUE(waitFor([&] { return b.tenant("v").source() == "unknown-tenant"; })) << b.log();
  ASSERT_TRUE(waitFor([&] { return hostUnknownLimit(b) == 0; })) << b.log();
  std::string first;
  Child late = workerAs(b, 2002, "w", &first);
  ASSERT_EQ(first, "ready") << fileText(b.dir() + "/tenants.log");
  // Refused (counted; its log line waits for the budget: one every 6 s, saying how many were held).
  ASSERT_TRUE(waitFor([&] { return b.metrics().find("cushare_broker_ledgers_refused_total " +
                                                   std::to_string(kFiles - 2 + 1) + "\n") != std::string::npos; }))
      << b.log();
  EXPECT_EQ(b.tenant("w").source(), "") << "not adopted";
  EXPECT_EQ(late.ask("alloc " + std::to_string(2 * MiB)), "oom") << "refused: no memory";
  EXPECT_EQ(b.status().tenants(), 4u);
  // uid 2000 removes its files: forgotten, and the broker still answers.
  ASSERT_EQ(runAs(kOther, [&] {
              for (int i = 0; i < kFiles; ++i) ::unlink((b.ledgerDir() + "/u" + std::to_string(i) + ".ledger").c_str());
              return 0;
            }),
            0);
  ASSERT_TRUE(waitFor([&] { return b.status().tenants() == 2u; })) << "alpha and v";
  EXPECT_LE(openDescriptors(b.pid()), fds + 1 + 2);
  EXPECT_TRUE(waitFor([&] { return hostUnknownLimit(b) == 64 * MiB; })) << "places free again";
  EXPECT_EQ(b.tenant("u0").source(), "");
}

// ---- State file and socket ----

TEST(Operator, StateFileAndSocketInDirectoriesOthersCanWriteAreRefused) {
  Broker b(testDir());
  const std::string shared = b.dir() + "/shared";
  ASSERT_EQ(::mkdir(shared.c_str(), 01777), 0);
  ASSERT_EQ(::chmod(shared.c_str(), 01777), 0);
  std::ofstream(b.dir() + "/config.yaml") << "ledger_dir: " << b.ledgerDir() << "\nsocket: " << b.socket()
                                          << "\nstate_file: " << shared << "/broker.state\nmetrics_listen: off\n";
  EXPECT_FALSE(b.startWithFile());
  EXPECT_NE(b.log().find("state_file " + shared + "/broker.state refused: the directory " + shared +
                         " is writable by other users (mode 1777)"),
            std::string::npos)
      << b.log();
  const std::string sockDir = "/tmp/cushare-test-open-" + std::to_string(::getpid());
  ::mkdir(sockDir.c_str(), 0777);
  ::chmod(sockDir.c_str(), 0777);
  std::ofstream(b.dir() + "/config.yaml") << "ledger_dir: " << b.ledgerDir() << "\nsocket: " << sockDir
                                          << "/b.sock\nstate_file: " << b.dir() << "/broker.state\nmetrics_listen: off\n";
  const int status = runCheck(b.dir());
  ::rmdir(sockDir.c_str());
  EXPECT_EQ(status, 1);
  EXPECT_NE(fileText(b.dir() + "/check.log").find("socket " + sockDir + "/b.sock refused: the directory " + sockDir +
                                                  " is writable by other users (mode 0777)"),
            std::string::npos)
      << fileText(b.dir() + "/check.log");
}

// Two brokers, one state file: the second (another ledger_dir) must not take the first's live limits.
TEST(Operator, StateFileBelongsToItsLedgerDirectory) {
  Broker first(testDir());
  ASSERT_TRUE(first.start("tenants:\n  - {name: alpha, memory: 512MiB}\n")) << first.log();
  ASSERT_TRUE(first.setLimit("alpha", "3GiB").ok());
  Broker second(first.dir() + "/second");
  fs::create_directories(second.dir());
  std::ofstream(second.dir() + "/config.yaml")
      << "ledger_dir: " << second.ledgerDir() << "\nsocket: " << second.socket() << "\nstate_file: " << first.dir()
      << "/broker.state\nmetrics_listen: off\ntenants:\n  - {name: alpha, memory: 512MiB}\n";
  EXPECT_FALSE(second.startWithFile());
  EXPECT_NE(second.log().find("state_file " + first.dir() + "/broker.state belongs to the broker of ledger_dir " +
                              first.ledgerDir() + ", not " + second.ledgerDir()),
            std::string::npos)
      << second.log();
  EXPECT_FALSE(fs::exists(second.ledgerDir() + "/alpha.ledger")) << "refused before touching anything";
  EXPECT_EQ(limitOn0(first.tenant("alpha")), 3072 * MiB);
}

// ---- Reload and --check ----

TEST(Operator, ReloadThatCannotWriteTheHostSegmentChangesNothing) {
  Broker b(testDir());
  ASSERT_TRUE(b.start("tenants:\n  - {name: alpha, memory: 512MiB}\n")) << b.log();
  ASSERT_TRUE(b.setLimit("alpha", "384MiB").ok());
  const std::string state = fileText(b.dir() + "/broker.state");
  const std::string seg = b.ledgerDir() + "/host.segment";
  ASSERT_EQ(::unlink(seg.c_str()), 0);
  ASSERT_EQ(::mkdir(seg.c_str(), 0755), 0);
  std::ofstream(seg + "/x") << "in the way";
  rewriteConfig(b, "unknown_tenants: small\nprofiles:\n  small: {memory: 64MiB}\ntenants:\n  - {name: beta, memory: 1GiB}\n");
  const rpc::Response r = b.reload();
  EXPECT_FALSE(r.ok());
  EXPECT_NE(r.error().find("reload refused, the running configuration is unchanged: the host segment could not be written"),
            std::string::npos)
      << r.error();
  EXPECT_EQ(b.status().config_generation(), 1u);
  EXPECT_EQ(b.status().reloads_refused(), 1u);
  EXPECT_EQ(b.tenant("alpha").source(), "config");
  EXPECT_EQ(b.tenant("beta").source(), "");
  EXPECT_EQ(limitOn0(b.tenant("alpha")), 384 * MiB);
  EXPECT_EQ(fileText(b.dir() + "/broker.state"), state) << "the state file is put back";
  fs::remove_all(seg);
  ASSERT_TRUE(b.reload().ok()) << b.log();
  EXPECT_EQ(b.status().config_generation(), 2u);
  EXPECT_TRUE(fs::is_regular_file(seg));
}

TEST(Operator, CheckTellsWhetherTheLedgerDirCanBeCreated) {
  const std::string dir = testDir();
  std::ofstream(dir + "/plain") << "a file";
  auto check = [&](const std::string& ledgerDir) {
    std::ofstream(dir + "/config.yaml") << "ledger_dir: " << ledgerDir << "\nsocket: " << socketFor(dir)
                                        << "\nstate_file: " << dir << "/broker.state\nmetrics_listen: off\n";
    return runCheck(dir);
  };
  EXPECT_EQ(check(dir + "/plain/ledgers"), 1);
  EXPECT_NE(fileText(dir + "/check.log").find("ledger_dir " + dir + "/plain/ledgers cannot be created: " + dir +
                                              "/plain is not a directory"),
            std::string::npos)
      << fileText(dir + "/check.log");
  EXPECT_EQ(check(dir + "/plain"), 1);
  EXPECT_NE(fileText(dir + "/check.log").find("ledger_dir " + dir + "/plain is not a directory"), std::string::npos)
      << fileText(dir + "/check.log");
  EXPECT_EQ(check(dir + "/new/ledgers"), 0) << fileText(dir + "/check.log");
  EXPECT_FALSE(fs::exists(dir + "/new")) << "--check creates nothing";
}

// `cushare-broker --check` as an ordinary user runs the checks the start would fail on (issue 26,
// point 5: it passed configurations the start then rejected or half-applied): MPS directories it
// cannot create, a tenant uid or gid it cannot give ledgers to, a CDI spec directory it cannot
// write. Each refusal names the place and why; the start refuses the same way; nothing is created.
TEST(Operator, CheckRunsTheStartsChecksAsAnOrdinaryUser) {
  if (::geteuid() != 0) GTEST_SKIP() << "switching users needs root (CI runs as root)";
  ASSERT_NE(deviceUsed(), UINT64_MAX) << "simgpu's state, made here so that uid 2000 finds it";
  // Short places (the MPS pipe directory's socket must fit sockaddr_un's 107 bytes, and CI's test
  // directories are long): a directory of its own under /tmp, removed at the end.
  char tmpl[] = "/tmp/cushare-chk-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  struct Remove {
    std::string path;
    ~Remove() { std::filesystem::remove_all(path); }
  } remove{dir};
  const std::string own = dir + "/user", rootOnly = dir + "/rootonly";
  ASSERT_EQ(::mkdir(own.c_str(), 0755), 0);
  ASSERT_EQ(::chown(own.c_str(), kOther, kOther), 0);
  ASSERT_EQ(::mkdir(rootOnly.c_str(), 0755), 0);
  ASSERT_EQ(::chmod(dir.c_str(), 0755), 0);
  // The broker and simgpu's libraries where uid 2000 can read them (the checkout may be private).
  UserStage stage;
  const std::string broker = stage.copy(BROKER_BIN, "bin/cushare-broker");
  const std::string lib = std::filesystem::path(SHIM_LIB).parent_path().string();
  const std::string simgpu = stage.copy(lib + "/simgpu", "lib/simgpu");
  stage.copy(SHIM_LIB, "lib/libcushare.so");  // the CDI spec names the shim beside the broker
  stage.copy(lib + "/cushare", "lib/cushare");
  // Runs the staged broker as uid 2000 on body (places under own/ unless body moves them);
  // --check or a start that must end by itself (a refusal), bounded by `timeout`.
  auto run = [&](const std::string& body, bool check, const std::vector<std::string>& caps = {}) {
    std::ofstream(own + "/config.yaml") << "ledger_dir: " << own << "/ledgers\nsocket: " << own << "/broker.sock\n"
                                        << "state_file: " << own << "/broker.state\nmetrics_listen: off\n" << body;
    ::unlink((own + "/out.log").c_str());
    // stdout (--check's report) joins stderr (the log lines) in out.log.
    std::vector<std::string> argv = {"/bin/sh", "-c", "exec \"$@\" 1>&2", "sh", "/usr/bin/timeout", "10",
                                     "/usr/bin/setpriv", "--reuid=2000", "--regid=2000", "--clear-groups"};
    argv.insert(argv.end(), caps.begin(), caps.end());
    argv.insert(argv.end(), {broker, "--config", own + "/config.yaml"});
    if (check) argv.push_back("--check");
    Child c = Child::spawn(argv, {{"LD_PRELOAD", ""}, {"LD_LIBRARY_PATH", simgpu}}, own + "/out.log");
    const int status = c.wait();
    return std::make_pair(WIFEXITED(status) ? WEXITSTATUS(status) : -1, fileText(own + "/out.log"));
  };
  // The places of its own: valid.
  auto [rc, out] = run("cdi: {spec_dir: " + own + "/cdi}\n", true);
  EXPECT_EQ(rc, 0) << out;
  struct Case {
    std::string body, message;
    std::string startMessage = "";  // when the start words it otherwise
  };
  const std::vector<Case> cases = {
      {"mps: {mode: on, pipe_dir: " + rootOnly + "/pipe, log_dir: " + own + "/mpslog}\ncdi: off\n",
       "mps.mode on: mps.pipe_dir " + rootOnly + "/pipe cannot be created in " + rootOnly + ": Permission denied"},
      {"mps: {mode: on, pipe_dir: " + own + "/pipe, log_dir: " + rootOnly + "/log}\ncdi: off\n",
       "mps.mode on: mps.log_dir " + rootOnly + "/log cannot be created in " + rootOnly + ": Permission denied"},
      {"cdi: {spec_dir: " + rootOnly + "/cdi}\ntenants:\n  - {name: alpha}\n",
       "cdi.spec_dir " + rootOnly + "/cdi cannot be created in " + rootOnly + ": Permission denied",
       "cdi: cannot create " + rootOnly + "/cdi: Permission denied"},
      {"cdi: off\ntenants:\n  - {name: alpha, uid: 2001}\n",
       "tenant alpha: uid 2001: the broker runs as uid 2000 without CAP_CHOWN and cannot give the tenant's ledger to another user"},
      {"cdi: off\ntenants:\n  - {name: alpha, gid: 2001}\n",
       "tenant alpha: gid 2001: the broker runs as uid 2000 without CAP_CHOWN, not in that group"},
  };
  for (const Case& k : cases) {
    std::tie(rc, out) = run(k.body, true);
    EXPECT_EQ(rc, 1) << k.body << out;
    EXPECT_NE(out.find(k.message), std::string::npos) << "--check: " << k.body << out;
    std::tie(rc, out) = run(k.body, false);
    EXPECT_EQ(rc, 1) << "the start refuses too: " << k.body << out;
    EXPECT_NE(out.find(k.startMessage.empty() ? k.message : k.startMessage), std::string::npos)
        << "start: " << k.body << out;
  }
  // The default CDI (not asked for; /var/run/cdi, root's): the start would warn and run without a
  // spec; --check says so and passes.
  std::tie(rc, out) = run("tenants:\n  - {name: alpha}\n", true);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("cdi.spec_dir /var/run/cdi cannot be"), std::string::npos) << out;
  EXPECT_NE(out.find("(cdi is on by default: the broker would warn and run without a spec; cdi: off silences it)"),
            std::string::npos) << out;
  EXPECT_TRUE(::access((rootOnly + "/pipe").c_str(), F_OK) != 0 && ::access((rootOnly + "/cdi").c_str(), F_OK) != 0)
      << "nothing created";
  // A tenant uid the broker's own, or a group it is in, is fine; so is any with CAP_CHOWN (a broker
  // given it by systemd's AmbientCapabilities without being root).
  std::tie(rc, out) = run("cdi: off\ntenants:\n  - {name: alpha, uid: 2000, gid: 2000}\n", true);
  EXPECT_EQ(rc, 0) << out;
  std::tie(rc, out) = run("cdi: off\ntenants:\n  - {name: alpha, uid: 2001, gid: 2001}\n", true,
                          {"--inh-caps=+chown", "--ambient-caps=+chown"});
  EXPECT_EQ(rc, 0) << "with CAP_CHOWN: " << out;
}

// --log-format json (issue 26, point 10): every line the broker logs is one JSON object with time,
// level, logger and message, whatever the message holds (here a ledger_dir with a quote, a
// backslash and a non-ASCII letter; a refused reload's multi-part error); text stays the default.
TEST(Operator, JsonLogsAreOneObjectPerLine) {
  const std::string dir = testDir();
  // A quote, a backslash and an e-acute (the configuration refuses bytes that are not UTF-8; the
  // escaping of those is JsonText.* in the unit tests).
  const std::string ledgers = dir + "/le\"dg\\ers-\xc3\xa9";
  std::ofstream(dir + "/config.yaml") << "ledger_dir: '" << ledgers << "'\nsocket: " << socketFor(dir)
                                      << "\nstate_file: " << dir << "/broker.state\nmetrics_listen: off\ncdi: off\n"
                                      << "tenants:\n  - {name: alpha, memory: 256MiB}\n";
  Child b = Child::spawn({BROKER_BIN, "--config", dir + "/config.yaml", "--log-format", "json"}, {{"LD_PRELOAD", ""}},
                         dir + "/broker.log");
  ASSERT_TRUE(waitFor([&] { return fileText(dir + "/broker.log").find("ready: control socket") != std::string::npos; }))
      << fileText(dir + "/broker.log");
  std::ofstream(dir + "/config.yaml", std::ios::app) << "tenantz: []\n";  // a refused reload logs an error
  ::kill(b.pid(), SIGHUP);
  ASSERT_TRUE(waitFor([&] { return fileText(dir + "/broker.log").find("\"level\":\"error\"") != std::string::npos; }))
      << fileText(dir + "/broker.log");
  ::kill(b.pid(), SIGTERM);
  b.wait();
  const std::string log = fileText(dir + "/broker.log");
  // Each line parses as JSON with exactly these keys (Python's json, as a log shipper would).
  const std::string check = std::string("python3") + " -c 'import json, sys\n"
                            "n = 0\n"
                            "for line in open(sys.argv[1], encoding=\"utf-8\"):\n"
                            "    o = json.loads(line); n += 1\n"
                            "    assert sorted(o) == [\"level\", \"logger\", \"message\", \"time\"], o\n"
                            "    assert o[\"logger\"] == \"cushare-broker\" and o[\"level\"] in (\"debug\", \"info\", \"warning\", \"error\"), o\n"
                            "print(n)' " + dir + "/broker.log > " + dir + "/lines.txt 2>&1";
  EXPECT_EQ(std::system(check.c_str()), 0) << fileText(dir + "/lines.txt") << log;
  EXPECT_GE(std::atoi(fileText(dir + "/lines.txt").c_str()), 4) << log;
  EXPECT_NE(log.find("le\\\"dg\\\\ers-\xc3\xa9"), std::string::npos) << "the path, escaped\n" << log;
  EXPECT_NE(log.find("tenantz"), std::string::npos) << "the refused reload's reason\n" << log;
  // A format it does not know is a usage error.
  Child bad = Child::spawn({BROKER_BIN, "--config", dir + "/config.yaml", "--log-format", "yaml"}, {{"LD_PRELOAD", ""}},
                           dir + "/bad.log");
  const int st = bad.wait();
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 2) << fileText(dir + "/bad.log");
  EXPECT_NE(fileText(dir + "/bad.log").find("unknown log format 'yaml' (text or json)"), std::string::npos);
}

// The secure deployment (docs/security.md: a uid per tenant, or a group per tenant): the default
// hidden-memory response takes down a process of the tenant's user that zeroes its ledger's
// counters and allocates past its limit, and leaves the tenant's honest process alone. Judged by
// the device's own count; the broker is stopped while the attack is set up. body: the tenant
// "alpha" (256 MiB) run as uid; whether the broker's judgement of "the tenant's user" holds.
void expectAHiderRunningAsKilled(const std::string& body, uid_t uid) {
  Broker b(testDir());
  const uint64_t base = deviceUsed();
  ASSERT_TRUE(b.start("context_memory: 0\n" + body)) << b.log();
  std::string first;
  Child honest = workerAs(b, uid, "alpha", &first);
  ASSERT_EQ(first, "ready") << fileText(b.dir() + "/tenants.log");
  Child hider = workerAs(b, uid, "alpha", &first);
  ASSERT_EQ(first, "ready") << fileText(b.dir() + "/tenants.log");
  ASSERT_EQ(hider.ask("alloc " + std::to_string(200 * MiB)), "ok");
  ASSERT_TRUE(stopProcess(b.pid()));
  ASSERT_EQ(hider.ask("zero"), "ok");  // every slot: the honest process allocates after it
  ASSERT_EQ(hider.ask("alloc " + std::to_string(200 * MiB)), "ok") << "the shim believes the ledger";
  ASSERT_EQ(honest.ask("alloc " + std::to_string(16 * MiB)), "ok");
  EXPECT_EQ(deviceUsed() - base, 416 * MiB) << "past the limit on the device";
  ASSERT_EQ(::kill(b.pid(), SIGCONT), 0);
  const int status = hider.wait(5000);
  EXPECT_TRUE(status != -1 && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status << "\n" << b.log();
  EXPECT_TRUE(waitFor([&] { return deviceUsed() - base == 16 * MiB; })) << "the device freed what it hid: "
                                                                      << (deviceUsed() - base) / MiB << " MiB";
  ASSERT_EQ(honest.wait(0), -1) << "the honest process lives on";
  EXPECT_EQ(honest.ask("alloc " + std::to_string(16 * MiB)), "ok");
  EXPECT_NE(b.metrics().find("cushare_tenant_tamper_total{tenant=\"alpha\",kind=\"killed\"} 1\n"), std::string::npos);
}

TEST(Operator, ATenantOnItsOwnUidHidingMemoryPastItsLimitIsKilled) {
  if (::geteuid() != 0) GTEST_SKIP() << "switching users needs root (CI runs as root)";
  expectAHiderRunningAsKilled("tenants:\n  - {name: alpha, memory: 256MiB, uid: 2001}\n", 2001);
}

// A tenant given by its group (its ledger root's, mode 0660, group 2002): its processes run as
// members of that group. Before, the broker took only the ledger owner's uid for the tenant's user
// and killed nothing (found by an attack review: 400 MiB on the device for 256 MiB).
TEST(Operator, ATenantByGroupHidingMemoryPastItsLimitIsKilled) {
  if (::geteuid() != 0) GTEST_SKIP() << "switching users needs root (CI runs as root)";
  expectAHiderRunningAsKilled("tenants:\n  - {name: alpha, memory: 256MiB, gid: 2002}\n", 2002);
}

}  // namespace
}  // namespace cushare::test
