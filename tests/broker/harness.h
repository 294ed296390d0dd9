// Helpers for the broker's end-to-end tests: a broker process, tenant processes (tenant_worker
// under the shim, driven over pipes) and control-API calls. Paths of the programs come from
// compile definitions; every test works in its own directory under BROKER_TEST_DIR.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "control.pb.h"
#include "user_stage.h"

namespace cushare::test {

// simgpu's UUID of host device 0: the broker's per-device metrics carry it (uuid label).
inline const std::string kDevice0Uuid = "GPU-5e1a90c0-513d-4b1e-8a7f-2c6100000000";

// A fresh, empty directory for one test: $BROKER_TEST_DIR/<suite>.<test>.
std::string testDir();

// A child process with its stdin and stdout on pipes.
class Child {
 public:
  Child() = default;
  Child(Child&& o) noexcept;
  Child& operator=(Child&& o) noexcept;
  ~Child();

  // argv[0] is the program's path; env entries are added to (or replace in) this process's
  // environment. stderr goes to errPath (appended).
  static Child spawn(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
                     const std::string& errPath);

  bool send(const std::string& line);
  // The next line of output, or "" after timeoutMs / end of output.
  std::string readLine(int timeoutMs = 20000);
  std::string ask(const std::string& line, int timeoutMs = 20000) {
    return send(line) ? readLine(timeoutMs) : "";
  }
  void kill(int sig);
  // Waits for the exit; the wait status (as waitpid reports it), -1 after timeoutMs.
  int wait(int timeoutMs = 20000);
  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = -1;
  int in_ = -1, out_ = -1;
  std::string buffer_;
};

// A forked process, killed (SIGKILL) and waited for when this goes, however the test ends.
class Forked {
 public:
  explicit Forked(pid_t pid) : pid_(pid) {}
  ~Forked() { stop(); }
  Forked(const Forked&) = delete;
  Forked& operator=(const Forked&) = delete;
  void stop();

 private:
  pid_t pid_;
};

// The control socket's path for a test directory (short enough for a Unix socket).
std::string socketFor(const std::string& dir);

// The configuration file text with every path inside dir: ledgers, socket, state file, metrics on
// a free port. body: the profiles/tenants/unknown_tenants part.
std::string brokerConfig(const std::string& dir, const std::string& body);

class Broker {
 public:
  explicit Broker(std::string dir) : dir_(std::move(dir)) {}
  ~Broker();
  // Writes config.yaml and starts cushare-broker on it; waits until the socket answers.
  bool start(const std::string& body);
  bool startWithFile();  // the config.yaml already in dir
  void kill9();
  int stop();  // SIGTERM, then the exit status
  std::string dir() const { return dir_; }
  std::string socket() const { return socketFor(dir_); }
  std::string ledgerDir() const { return dir_ + "/ledgers"; }
  std::string log() const;  // what the broker wrote to stderr
  // Whether the log holds `text` within `ms`: a line the broker writes after an effect the test
  // has already seen (a restored limit, a killed process) may reach the file a little later.
  bool logHas(const std::string& text, int ms = 3000) const;
  pid_t pid() const { return proc_.pid(); }

  // Control API. ok() false: resp.error() says why.
  rpc::Response call(const rpc::Request& req);
  rpc::StatusReply status();
  // used/limit/... of tenant on device 0 (limit UINT64_MAX: none); source "" if there is no such tenant
  rpc::Tenant tenant(const std::string& name);
  rpc::Response setLimit(const std::string& tenant, const std::string& memory, int device = -1);
  rpc::Response reload();
  // The metrics endpoint's whole answer (status line, headers, body); "" if it cannot be reached.
  std::string metrics();

  // A tenant process under the shim, ready for commands (its first line was "ready"), or one
  // whose first line is returned in *first (when not null) for tests of refusals.
  Child tenantProcess(const std::string& tenant, const std::map<std::string, std::string>& env = {},
                      std::string* first = nullptr);
  // The same, started through a wrapper command (e.g. {"unshare", "--pid", "--fork"}).
  Child tenantProcessIn(const std::vector<std::string>& wrapper, const std::string& tenant);

 private:
  Child tenantProcessWith(const std::vector<std::string>& wrapper, const std::string& tenant,
                          const std::map<std::string, std::string>& env, std::string* first);

  std::string dir_;
  Child proc_;
};

// Tenant processes on uids of their own, as docs/security.md deploys them (the suite runs as
// root). The program, the shim with its probes and simgpu's driver libraries are staged where any
// user can read them (UserStage: the checkout may lie where other users cannot enter), and each
// process starts through setpriv as that uid (its group the same number, no other groups). Files
// the test's environment names that a tenant reads (SIMGPU_KERNEL_COSTS) are staged too.
class UidTenants {
 public:
  UidTenants();
  // Stages program (once) and starts it as uid under the staged shim: env adds to the tenant's
  // variables (CUSHARE_TENANT, CUSHARE_LEDGER_DIR of b); its stderr goes to b.dir()/tenants.log.
  // args: the program's arguments; wrapper: a command (run as root) that execs the rest, e.g.
  // cdi_spec.py run SPEC DEVICE -- (a container's mounts before the uid changes).
  Child spawn(uid_t uid, const std::string& program, Broker& b, const std::string& tenant,
              const std::map<std::string, std::string>& env = {}, const std::vector<std::string>& args = {},
              const std::vector<std::string>& wrapper = {});
  const UserStage& stage() const { return stage_; }

 private:
  UserStage stage_;
  std::string shim_, lib_, costs_;
  std::map<std::string, std::string> programs_;  // build path -> staged path
};

// Waits up to ms for pred (polled every 50 ms); its last answer.
bool eventually(const std::function<bool()>& pred, int ms = 15000);

// SIGSTOP, then waits until every thread of pid is stopped (/proc/<pid>/task/*/stat): kill()
// returns before a thread running on another core has stopped, and under load the broker could
// still finish a tick (adopt a ledger the test is about to make) after it. False after 5 s.
bool stopProcess(pid_t pid);

// A connected Unix stream socket to path, or -1.
int connectUnix(const std::string& path);

// The device's own accounting (simgpu's NVML): bytes each process (host pid) holds on device 0.
std::map<int, uint64_t> deviceMemoryOn0();
// Device 0's used memory as a whole, as the device itself counts it (every process, with or
// without the shim, and shareable memory no process holds); UINT64_MAX if NVML does not answer.
uint64_t deviceUsed();

uint64_t usedOn0(const rpc::Tenant& t);
uint64_t limitOn0(const rpc::Tenant& t);
// The broker's probe estimate of tenant's share on device 0 (-1: none yet), printed with its
// rounds, regime and, for concurrent rounds, the SM factors; *share_out: the whole row.
double probeShareOn0(Broker& b, const std::string& tenant, rpc::ProbeShare* share_out = nullptr);
// cushare_tenant_hidden_bytes of tenant on device 0 (the broker's metrics); UINT64_MAX if absent.
uint64_t hiddenOf(Broker& b, const std::string& tenant);

// Number at the end of "held N" (or the given field of a reply line).
uint64_t field(const std::string& line, int index);

constexpr uint64_t MiB = 1ull << 20;

// ThreadSanitizer runs every atomic operation on a ledger mapping under a lock of its own; a
// SIGBUS inside one (the tenant truncated the file) unwinds past it (the broker's siglongjmp, see
// broker/core/bus_guard.h), the sanitizer's lock stays held and the broker's next atomic access to
// that address waits forever inside the sanitizer. Without it an atomic access takes no lock, so
// the truncation attacks run in the plain stage of the suite and are skipped under TSan.
#if defined(__SANITIZE_THREAD__)
inline constexpr bool kUnderThreadSanitizer = true;
#else
inline constexpr bool kUnderThreadSanitizer = false;
#endif
inline constexpr const char* kSigbusUnderTsan =
    "under ThreadSanitizer a SIGBUS inside an atomic access leaves the sanitizer's own lock held "
    "(see tests/broker/harness.h); this attack runs in the plain stage";

}  // namespace cushare::test
