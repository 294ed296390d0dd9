// Containers end to end on simgpu (docs/containers.md): the real broker writes its CDI spec; the
// spec passes the CDI rules cushare relies on (tests/containers/cdi_spec.py, which also proves each
// rule can fail); and a process started with exactly the spec's edits of a tenant's device (its
// environment, its mounts made as bind mounts in a private mount namespace at the spec's container
// paths) is that tenant: its allocations count in the tenant's ledger and on the device, and the
// tenant's limit holds, with nothing set by hand. The MPS case: the pipe directory mounted at the
// container path makes the process a client of the broker's MPS daemon.
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "cushare/host_segment.h"
#include "harness.h"

namespace cushare::test {
namespace {

std::string readFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// cdi_spec.py's exit status for args (output appended to log).
int cdiSpec(const std::string& args, const std::string& log) {
  const int st = std::system((PYTHON3 " " CDI_SPEC_PY " " + args + " >>'" + log + "' 2>&1").c_str());
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

std::string specPath(const Broker& b) { return b.dir() + "/cdi/cushare.io-tenant.json"; }

// A program run with exactly the container edits of the spec's device `device`; the environment
// besides is the test's own (simgpu's libraries), with no CUSHARE_* or LD_PRELOAD of its own.
Child withEdits(const Broker& b, const std::string& device, const std::vector<std::string>& program,
                const std::map<std::string, std::string>& env = {}) {
  std::vector<std::string> argv = {PYTHON3, CDI_SPEC_PY, "run", specPath(b), device, "--"};
  argv.insert(argv.end(), program.begin(), program.end());
  std::map<std::string, std::string> e = env;
  e["LD_PRELOAD"] = "";  // replaced by the spec's
  return Child::spawn(argv, e, b.dir() + "/tenants.log");
}

constexpr char kTenants[] =
    "tenants:\n"
    "  - {name: alpha, memory: 256MiB}\n"
    "  - {name: beta, memory: 1GiB, thread_percentage: 40}\n"
    "  - {name: gamma-, memory: 64MiB}\n";

TEST(Containers, TheSpecFollowsTheCdiRules) {
  const std::string log = testDir() + "/check.log";
  ASSERT_EQ(cdiSpec("self-test", log), 0) << readFile(log);
  Broker b(testDir());
  ASSERT_TRUE(b.start(kTenants)) << b.log();
  const std::string spec = readFile(specPath(b));
  ASSERT_FALSE(spec.empty()) << b.log();
  // podman 4.3 (Debian 12) knows CDI up to 0.5.0.
  EXPECT_EQ(cdiSpec("check " + specPath(b) + " --max-version 0.5.0", log), 0) << readFile(log) << spec;
  EXPECT_NE(spec.find("\"cdiVersion\": \"0.3.0\""), std::string::npos) << spec;
  EXPECT_NE(spec.find("\"kind\": \"cushare.io/tenant\""), std::string::npos);
  EXPECT_NE(spec.find("\"name\": \"alpha\""), std::string::npos);
  EXPECT_NE(spec.find("\"name\": \"beta\""), std::string::npos);
  // gamma- cannot be a CDI device name (it must end with a letter or a digit): left out, said.
  EXPECT_EQ(spec.find("gamma"), std::string::npos) << spec;
  EXPECT_NE(b.log().find("cdi: tenant gamma-: a CDI device name must start and end with a letter or a digit"),
            std::string::npos)
      << b.log();
  // Limits are the broker's, through the ledger: none is written into the spec.
  EXPECT_EQ(spec.find("CUSHARE_MEMORY_LIMIT"), std::string::npos);
  EXPECT_EQ(spec.find("CUSHARE_THREAD_PERCENTAGE"), std::string::npos);
  // No host path appears as a container path.
  EXPECT_NE(spec.find("\"CUSHARE_LEDGER_DIR=/run/cushare/ledgers\""), std::string::npos) << spec;
  EXPECT_NE(spec.find("\"LD_PRELOAD=/usr/local/cushare/lib/libcushare.so\""), std::string::npos) << spec;
  EXPECT_NE(spec.find("\"hostPath\": \"" + b.ledgerDir() + "\""), std::string::npos) << spec;
  struct stat st{};
  ASSERT_EQ(::stat(specPath(b).c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0644u);
}

TEST(Containers, AReloadRewritesTheSpecAndADigitNeedsVersion050) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kTenants)) << b.log();
  std::ofstream(b.dir() + "/config.yaml")
      << brokerConfig(b.dir(), "tenants:\n  - {name: alpha, memory: 256MiB}\n  - {name: 7up, memory: 64MiB}\n");
  ASSERT_TRUE(b.reload().ok());
  const std::string spec = readFile(specPath(b));
  EXPECT_NE(spec.find("\"name\": \"7up\""), std::string::npos) << spec;
  EXPECT_EQ(spec.find("\"name\": \"beta\""), std::string::npos) << "beta is no longer configured";
  EXPECT_NE(spec.find("\"cdiVersion\": \"0.5.0\""), std::string::npos) << spec;
  const std::string log = b.dir() + "/check.log";
  EXPECT_EQ(cdiSpec("check " + specPath(b) + " --max-version 0.5.0", log), 0) << readFile(log);
  // No temporary is left beside it.
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(b.dir() + "/cdi")) files += e.is_regular_file();
  EXPECT_EQ(files, 1);
  // The spec stays when the broker stops (remove_on_stop is off by default).
  EXPECT_EQ(b.stop(), 0);
  EXPECT_FALSE(readFile(specPath(b)).empty());
}

TEST(Containers, RemoveOnStopAndOff) {
  Broker b(testDir());
  ASSERT_TRUE(b.start("cdi: {spec_dir: " + b.dir() + "/cdi, remove_on_stop: on}\n" + kTenants)) << b.log();
  ASSERT_FALSE(readFile(specPath(b)).empty());
  EXPECT_EQ(b.stop(), 0);
  EXPECT_FALSE(std::filesystem::exists(specPath(b))) << b.log();
  Broker off(testDir() + "/off");
  std::filesystem::create_directories(off.dir());
  ASSERT_TRUE(off.start(std::string("cdi: off\n") + kTenants)) << off.log();
  EXPECT_FALSE(std::filesystem::exists(specPath(off)));
}

// An explicit cdi block that cannot be written stops the broker with the reason.
TEST(Containers, AnExplicitSpecDirThatCannotBeWrittenStopsTheBroker) {
  Broker b(testDir());
  std::ofstream(b.dir() + "/plain") << "a file";
  EXPECT_FALSE(b.start("cdi: {spec_dir: " + b.dir() + "/plain/cdi}\n" + kTenants));
  EXPECT_NE(b.log().find("cdi: cdi.spec_dir " + b.dir() + "/plain/cdi/cushare.io-tenant.json cannot be created: " +
                         b.dir() + "/plain is not a directory"),
            std::string::npos)
      << b.log();
  Broker c(testDir() + "/noshim");
  std::filesystem::create_directories(c.dir());
  EXPECT_FALSE(c.start("cdi: {spec_dir: " + c.dir() + "/cdi, shim: " + c.dir() + "/none.so}\n" + kTenants));
  EXPECT_NE(c.log().find("cdi: shim not found at " + c.dir() + "/none.so"), std::string::npos) << c.log();
}

// Every tenant's container preloads the shim, and runtimes trust every spec in the spec
// directory: a shim or a spec directory that another user could replace or change is refused,
// naming the path and why (a review found both accepted).
TEST(Containers, AShimOrSpecDirAnotherUserCouldChangeIsRefused) {
  namespace fs = std::filesystem;
  const std::string dir = testDir();
  fs::create_directories(dir + "/open");
  fs::permissions(dir + "/open", fs::perms::all);  // 0777, no sticky bit
  Broker a(dir + "/a");
  fs::create_directories(a.dir());
  EXPECT_FALSE(a.start("cdi: {spec_dir: " + dir + "/open/cdi}\n" + kTenants));
  EXPECT_NE(a.log().find("cdi: cdi.spec_dir " + dir + "/open/cdi/cushare.io-tenant.json refused: the directory " +
                         dir + "/open is writable by other users without the sticky bit"),
            std::string::npos)
      << a.log();
  fs::create_directories(dir + "/specs");
  fs::permissions(dir + "/specs", fs::perms::all | fs::perms::sticky_bit);  // 1777: still anyone's
  Broker s(dir + "/s");
  fs::create_directories(s.dir());
  EXPECT_FALSE(s.start("cdi: {spec_dir: " + dir + "/specs}\n" + kTenants));
  EXPECT_NE(s.log().find("the directory " + dir + "/specs is writable by other users (mode 1777)"), std::string::npos)
      << s.log();
  // A shim others may write, or another user's.
  const std::string shim = dir + "/libcushare.so";
  fs::copy_file(SHIM_LIB, shim, fs::copy_options::overwrite_existing);
  fs::permissions(shim, fs::perms::owner_all | fs::perms::group_read | fs::perms::others_read | fs::perms::others_write);
  Broker w(dir + "/w");
  fs::create_directories(w.dir());
  EXPECT_FALSE(w.start("cdi: {spec_dir: " + w.dir() + "/cdi, shim: " + shim + "}\n" + kTenants));
  EXPECT_NE(w.log().find("cdi: cdi.shim " + shim + " refused: it is writable by other users (mode 0746)"),
            std::string::npos)
      << w.log();
  fs::permissions(shim, fs::perms::owner_all | fs::perms::group_read | fs::perms::others_read);
  if (::geteuid() == 0) {
    ASSERT_EQ(::chown(shim.c_str(), 4242, 4242), 0);
    Broker o(dir + "/o");
    fs::create_directories(o.dir());
    EXPECT_FALSE(o.start("cdi: {spec_dir: " + o.dir() + "/cdi, shim: " + shim + "}\n" + kTenants));
    EXPECT_NE(o.log().find("refused: it belongs to uid 4242"), std::string::npos) << o.log();
    ASSERT_EQ(::chown(shim.c_str(), 0, 0), 0);
  }
  // Through a link, the file it leads to is judged; a good one starts, and the spec names the file
  // itself: a link could be repointed later by whoever may write where it lies.
  fs::create_symlink(shim, dir + "/link.so");
  Broker g(dir + "/g");
  fs::create_directories(g.dir());
  EXPECT_TRUE(g.start("cdi: {spec_dir: " + g.dir() + "/cdi, shim: " + dir + "/link.so}\n" + kTenants)) << g.log();
  const std::string spec = readFile(g.dir() + "/cdi/cushare.io-tenant.json");
  EXPECT_NE(spec.find("\"hostPath\": \"" + shim + "\""), std::string::npos) << spec;
  EXPECT_EQ(spec.find("link.so"), std::string::npos) << spec;
}

// The operator's CUPTI (compute.cupti_library) is what every tenant process loads CUPTI from: a
// file another user could change is refused at start, naming it; a missing one too. A trusted
// one is named, resolved, in the host segment with the broker's metering source, and mounted
// read-only at that path in the CDI spec.
TEST(Containers, TheCuptiLibraryIsTrustedPublishedAndMounted) {
  namespace fs = std::filesystem;
  const std::string dir = testDir();
  const std::string lib = dir + "/cupti/libcupti.so.13";
  fs::create_directories(dir + "/cupti");
  fs::permissions(dir + "/cupti", fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
                                      fs::perms::others_read | fs::perms::others_exec);
  fs::copy_file(SHIM_LIB, lib, fs::copy_options::overwrite_existing);
  fs::permissions(lib, fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read |
                           fs::perms::others_read | fs::perms::others_write);  // 0646
  Broker w(dir + "/w");
  fs::create_directories(w.dir());
  EXPECT_FALSE(w.start("compute: {cupti_library: " + lib + "}\n" + kTenants));
  EXPECT_NE(w.log().find("compute.cupti_library " + lib + " refused: it is writable by other users (mode 0646)"),
            std::string::npos)
      << w.log();
  Broker m(dir + "/m");
  fs::create_directories(m.dir());
  EXPECT_FALSE(m.start("compute: {cupti_library: " + dir + "/none/libcupti.so.13}\n" + kTenants));
  EXPECT_NE(m.log().find("compute.cupti_library " + dir + "/none/libcupti.so.13: No such file or directory"),
            std::string::npos)
      << m.log();
  fs::permissions(lib, fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read | fs::perms::others_read);
  fs::create_symlink(lib, dir + "/link.so.13");
  Broker g(dir + "/g");
  fs::create_directories(g.dir());
  ASSERT_TRUE(g.start("cdi: {spec_dir: " + g.dir() + "/cdi}\ncompute: {metering_source: cupti, cupti_library: " +
                      dir + "/link.so.13}\n" + kTenants))
      << g.log();
  HostInfo h;
  std::string err;
  ASSERT_EQ(readHostSegment(g.ledgerDir(), &h, &err), 1) << err;
  EXPECT_EQ(h.cuptiLibrary, lib) << "the file itself, not the link another user might repoint";
  EXPECT_EQ(h.metering, kHostMeteringCupti);
  const std::string spec = readFile(g.dir() + "/cdi/cushare.io-tenant.json");
  EXPECT_NE(spec.find("{\"hostPath\": \"" + lib + "\", \"containerPath\": \"" + lib + "\", \"options\": [\"ro\""),
            std::string::npos)
      << spec;
  // A reload to a library another user could change is refused, naming it; the old one stays.
  const std::string open = dir + "/cupti/open.so.13";
  fs::copy_file(lib, open, fs::copy_options::overwrite_existing);
  fs::permissions(open, fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read |
                            fs::perms::others_read | fs::perms::others_write);  // 0646
  std::ofstream(g.dir() + "/config.yaml")
      << brokerConfig(g.dir(), "cdi: {spec_dir: " + g.dir() + "/cdi}\ncompute: {cupti_library: " + open + "}\n" +
                                   kTenants);
  const rpc::Response r = g.reload();
  EXPECT_FALSE(r.ok());
  EXPECT_NE(r.error().find("compute.cupti_library " + open + " refused: it is writable by other users (mode 0646)"),
            std::string::npos)
      << r.DebugString();
  ASSERT_EQ(readHostSegment(g.ledgerDir(), &h, &err), 1) << err;
  EXPECT_EQ(h.cuptiLibrary, lib);
}

TEST(Containers, AProcessWithTheSpecsEditsIsTheTenant) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kTenants)) << b.log();
  Child alpha = withEdits(b, "alpha", {WORKER_BIN});
  const std::string first = alpha.readLine();
  if (first.empty() && readFile(b.dir() + "/tenants.log").find("no mount namespace") != std::string::npos)
    GTEST_SKIP() << "no mount namespaces here: " << readFile(b.dir() + "/tenants.log");
  ASSERT_EQ(first, "ready") << readFile(b.dir() + "/tenants.log");
  // The tenant's view: its 256 MiB limit is the device (the shim read it from the mounted ledger).
  EXPECT_EQ(alpha.ask("info"), "free " + std::to_string(256 * MiB) + " total " + std::to_string(256 * MiB));
  ASSERT_EQ(alpha.ask("alloc " + std::to_string(100 * MiB)), "ok");
  // Counted in alpha's ledger, as the broker reads it, and held on the device by this very pid.
  EXPECT_EQ(usedOn0(b.tenant("alpha")), 100 * MiB);
  EXPECT_EQ(usedOn0(b.tenant("beta")), 0u);
  const auto onDevice = deviceMemoryOn0();
  ASSERT_TRUE(onDevice.count(alpha.pid())) << "the worker runs in the pid the test started (exec, no fork)";
  EXPECT_GE(onDevice.at(alpha.pid()), 100 * MiB);
  // The limit holds: 200 MiB more would pass 256 MiB.
  EXPECT_EQ(alpha.ask("alloc " + std::to_string(200 * MiB)), "oom");
  EXPECT_EQ(usedOn0(b.tenant("alpha")), 100 * MiB);
  // A live raise applies: the limit is the broker's, not baked into the spec.
  ASSERT_TRUE(b.setLimit("alpha", "512MiB").ok());
  EXPECT_EQ(alpha.ask("alloc " + std::to_string(200 * MiB)), "ok");
  EXPECT_EQ(usedOn0(b.tenant("alpha")), 300 * MiB);
  EXPECT_EQ(alpha.ask("quit"), "");
  EXPECT_EQ(alpha.wait(), 0);
  EXPECT_EQ(usedOn0(b.tenant("alpha")), 0u);
}

// With MPS on, the spec mounts the daemon's pipe directory at the container path and the shim makes
// the process a client there: the daemon lists it, and it gets its tenant's 40% (40 of 100 SMs).
TEST(Containers, WithMpsTheProcessIsAClientOfTheBrokersDaemon) {
  Broker b(testDir());
  ::mkdir("/tmp/cushare-test-mps", 0755);
  const std::string pipe = "/tmp/cushare-test-mps/containers-" + std::to_string(::getpid());
  std::filesystem::remove_all(pipe);
  ASSERT_TRUE(b.start("mps: {mode: on, control: " SIMGPU_MPS_BIN "/nvidia-cuda-mps-control, pipe_dir: " + pipe +
                      ", log_dir: " + b.dir() + "/mps-log, context_reserve: 256MiB}\n" + kTenants))
      << b.log();
  const std::string spec = readFile(specPath(b));
  EXPECT_NE(spec.find("\"CUSHARE_MPS_PIPE_DIR=/run/cushare/mps\""), std::string::npos) << spec;
  EXPECT_NE(spec.find("\"hostPath\": \"" + pipe + "\", \"containerPath\": \"/run/cushare/mps\""), std::string::npos);
  Child beta = withEdits(b, "beta", {MPS_WORKER_BIN});
  const std::string first = beta.readLine();
  if (first.empty() && readFile(b.dir() + "/tenants.log").find("no mount namespace") != std::string::npos)
    GTEST_SKIP() << "no mount namespaces here";
  EXPECT_EQ(first, "ready 40") << readFile(b.dir() + "/tenants.log");
  EXPECT_EQ(beta.ask("env CUDA_MPS_PIPE_DIRECTORY"), "env /run/cushare/mps");
  // The daemon itself (asked on the host's path) has it as a client.
  const std::string ask = "printf 'get_server_list\\n' | CUDA_MPS_PIPE_DIRECTORY=" + pipe + " " SIMGPU_MPS_BIN
                          "/nvidia-cuda-mps-control 2>&1";
  std::string servers;
  if (FILE* p = ::popen(ask.c_str(), "r")) {
    char buf[256];
    for (size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) servers.append(buf, n);
    ::pclose(p);
  }
  std::string clients;
  const std::string listAsk = "printf 'get_client_list " + servers.substr(0, servers.find('\n')) +
                              "\\n' | CUDA_MPS_PIPE_DIRECTORY=" + pipe + " " SIMGPU_MPS_BIN "/nvidia-cuda-mps-control 2>&1";
  if (FILE* p = ::popen(listAsk.c_str(), "r")) {
    char buf[256];
    for (size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) clients.append(buf, n);
    ::pclose(p);
  }
  EXPECT_NE(clients.find(std::to_string(beta.pid())), std::string::npos) << "servers: " << servers << " clients: " << clients;
  beta.ask("quit");
  beta.wait();
  EXPECT_EQ(b.stop(), 0);  // quits the daemon
  std::filesystem::remove_all(pipe);
}

// --check says what would be written, writes nothing, and names a shim that is not on this host
// (a ConfigMap names the node's path) without refusing the configuration.
TEST(Containers, CheckDescribesTheSpec) {
  const std::string dir = testDir();
  auto check = [&](const std::string& cdi, int* status) {
    std::ofstream(dir + "/config.yaml") << brokerConfig(dir, cdi + kTenants);
    Child c = Child::spawn({BROKER_BIN, "--config", dir + "/config.yaml", "--check"}, {{"LD_PRELOAD", ""}},
                           dir + "/check.log");
    std::string out;
    for (std::string line; !(line = c.readLine(10000)).empty();) out += line + "\n";
    const int st = c.wait();
    *status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    return out;
  };
  int status = -1;
  std::string out = check("cdi: {spec_dir: " + dir + "/cdi}\n", &status);
  EXPECT_EQ(status, 0) << out << readFile(dir + "/check.log");
  EXPECT_NE(out.find("cdi: " + dir + "/cdi/cushare.io-tenant.json with 2 tenant device(s), cdiVersion 0.3.0, shim "),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("left out: gamma-: "), std::string::npos) << out;
  EXPECT_FALSE(std::filesystem::exists(dir + "/cdi")) << "--check writes nothing";
  out = check("cdi: {spec_dir: " + dir + "/cdi, shim: /nonexistent/libcushare.so}\n", &status);
  EXPECT_EQ(status, 0) << out;
  EXPECT_NE(out.find("shim /nonexistent/libcushare.so (not found on this host"), std::string::npos) << out;
  out = check("cdi: off\n", &status);
  EXPECT_NE(out.find(": cdi: off"), std::string::npos) << out;
}

// The spec's environment alone, without its ledger mount: the shim refuses to run standalone
// (CUSHARE_REQUIRE_BROKER=1), so a container whose mount went missing fails closed.
TEST(Containers, WithoutTheLedgerMountTheProcessFailsClosed) {
  Broker b(testDir());
  ASSERT_TRUE(b.start(kTenants)) << b.log();
  std::map<std::string, std::string> env = {{"LD_PRELOAD", SHIM_LIB},
                                            {"CUSHARE_TENANT", "alpha"},
                                            {"CUSHARE_LEDGER_DIR", b.dir() + "/not-mounted"},
                                            {"CUSHARE_REQUIRE_BROKER", "1"}};
  Child c = Child::spawn({WORKER_BIN}, env, b.dir() + "/tenants.log");
  const std::string first = c.readLine();
  EXPECT_TRUE(first.starts_with("init-failed")) << first;
  EXPECT_EQ(deviceMemoryOn0().count(c.pid()), 0u);
}

}  // namespace
}  // namespace cushare::test
