// See harness.h.
#include "harness.h"

#include <arpa/inet.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "rpc/codec.h"
#include "simgpu/nvml.h"

extern char** environ;

namespace cushare::test {
namespace {

using Clock = std::chrono::steady_clock;

int msSince(Clock::time_point t) {
  return static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t).count());
}

}  // namespace

std::string testDir() {
  const char* root = std::getenv("BROKER_TEST_DIR");
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string dir = std::string(root ? root : "/tmp/cushare-broker-test") + "/" +
                          info->test_suite_name() + "." + info->name();
  std::system(("rm -rf '" + dir + "' && mkdir -p '" + dir + "'").c_str());
  ::chmod(dir.c_str(), 0755);  // other uids (permission tests) must reach the ledger directory
  for (size_t i = 1; i < dir.size(); ++i) {
    if (dir[i] != '/') continue;
    struct stat st;
    if (::stat(dir.substr(0, i).c_str(), &st) == 0 && (st.st_mode & 0001) == 0)
      ::chmod(dir.substr(0, i).c_str(), st.st_mode | 0111);
  }
  return dir;
}

Child::Child(Child&& o) noexcept { *this = std::move(o); }

Child& Child::operator=(Child&& o) noexcept {
  std::swap(pid_, o.pid_);
  std::swap(in_, o.in_);
  std::swap(out_, o.out_);
  std::swap(buffer_, o.buffer_);
  return *this;
}

void Forked::stop() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  ::waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

Child::~Child() {
  if (in_ >= 0) ::close(in_);
  if (out_ >= 0) ::close(out_);
  if (pid_ > 0) {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }
}

Child Child::spawn(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
                   const std::string& errPath) {
  int in[2], out[2];
  if (::pipe2(in, O_CLOEXEC) != 0 || ::pipe2(out, O_CLOEXEC) != 0) return Child();
  std::vector<std::string> envStrings;
  for (char** e = environ; *e; ++e) {
    const std::string kv = *e;
    const std::string key = kv.substr(0, kv.find('='));
    if (!env.count(key)) envStrings.push_back(kv);
  }
  for (const auto& [k, v] : env)
    if (!v.empty()) envStrings.push_back(k + "=" + v);  // an empty value removes the variable
  std::vector<char*> args, envp;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  for (std::string& e : envStrings) envp.push_back(e.data());
  envp.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(in[0], 0);
    ::dup2(out[1], 1);
    const int err = ::open(errPath.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (err >= 0) ::dup2(err, 2);
    ::execve(args[0], args.data(), envp.data());
    ::_exit(127);
  }
  ::close(in[0]);
  ::close(out[1]);
  Child c;
  c.pid_ = pid;
  c.in_ = in[1];
  c.out_ = out[0];
  return c;
}

bool Child::send(const std::string& line) {
  const std::string l = line + "\n";
  return ::write(in_, l.data(), l.size()) == static_cast<ssize_t>(l.size());
}

std::string Child::readLine(int timeoutMs) {
  const auto start = Clock::now();
  for (;;) {
    if (const size_t nl = buffer_.find('\n'); nl != std::string::npos) {
      std::string line = buffer_.substr(0, nl);
      buffer_.erase(0, nl + 1);
      return line;
    }
    const int left = timeoutMs - msSince(start);
    if (left <= 0) return "";
    pollfd p{out_, POLLIN, 0};
    if (::poll(&p, 1, left) <= 0) continue;
    char buf[4096];
    const ssize_t n = ::read(out_, buf, sizeof buf);
    if (n <= 0) return "";
    buffer_.append(buf, static_cast<size_t>(n));
  }
}

void Child::kill(int sig) {
  if (pid_ > 0) ::kill(pid_, sig);
}

int Child::wait(int timeoutMs) {
  const auto start = Clock::now();
  while (pid_ > 0) {
    int status = 0;
    const pid_t r = ::waitpid(pid_, &status, WNOHANG);
    if (r == pid_ || (r < 0 && errno == ECHILD)) {
      const bool exited = r == pid_;
      pid_ = -1;
      return exited ? status : -1;
    }
    if (msSince(start) > timeoutMs) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return -1;
}

std::string socketFor(const std::string& dir) {
  // sockaddr_un holds 107 bytes: a short name derived from the test's directory, in a directory
  // only root can write (the broker refuses a socket in one others can write, such as /tmp).
  ::mkdir("/tmp/cushare-test-sockets", 0755);
  char name[80];
  std::snprintf(name, sizeof name, "/tmp/cushare-test-sockets/%016zx.sock", std::hash<std::string>()(dir));
  return name;
}

std::string brokerConfig(const std::string& dir, const std::string& body) {
  // The CDI spec goes in the test's directory (never the host's /var/run/cdi) unless body says.
  const bool ownCdi = body.starts_with("cdi:") || body.find("\ncdi:") != std::string::npos;
  return "ledger_dir: " + dir + "/ledgers\n" + "socket: " + socketFor(dir) + "\n" +
         "state_file: " + dir + "/broker.state\n" + "metrics_listen: 127.0.0.1:0\n" + body +
         // last, so that the line numbers of body's errors stay what the tests expect
         (ownCdi ? "" : std::string(body.empty() || body.back() == '\n' ? "" : "\n") + "cdi: {spec_dir: " + dir + "/cdi}\n");
}

Broker::~Broker() {
  if (proc_.pid() > 0) stop();
}

bool Broker::start(const std::string& body) {
  std::ofstream(dir_ + "/config.yaml") << brokerConfig(dir_, body);
  return startWithFile();
}

bool Broker::startWithFile() {
  // The broker must not run under the shim (its NVML view would be a tenant's).
  proc_ = Child::spawn({BROKER_BIN, "--config", dir_ + "/config.yaml", "--log-level", "debug"},
                       {{"LD_PRELOAD", ""}}, dir_ + "/broker.log");
  const auto start = Clock::now();
  while (msSince(start) < 20000) {
    rpc::Request r;
    r.set_version(1);
    r.mutable_status();
    rpc::Response resp;
    std::string err;
    if (rpc::call(socket(), r, &resp, &err, 2000) && resp.ok()) {
      // The metrics endpoint binds just after the control socket answers (main.cpp): a test that
      // reads metrics at once must find it. Configurations here always listen (127.0.0.1:0).
      const auto answered = Clock::now();  // at most 3 s more (a hand-written file may turn metrics off)
      while (resp.status().metrics_address().empty() && msSince(answered) < 3000 && proc_.wait(0) == -1) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        if (!rpc::call(socket(), r, &resp, &err, 2000) || !resp.ok()) break;
      }
      return true;
    }
    if (proc_.wait(0) != -1) return false;  // it exited
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

void Broker::kill9() {
  proc_.kill(SIGKILL);
  proc_.wait();
}

int Broker::stop() {
  proc_.kill(SIGTERM);
  return proc_.wait();
}

std::string Broker::log() const {
  std::ifstream in(dir_ + "/broker.log");
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

bool Broker::logHas(const std::string& text, int ms) const {
  return eventually([&] { return log().find(text) != std::string::npos; }, ms);
}

rpc::Response Broker::call(const rpc::Request& req) {
  rpc::Response resp;
  std::string err;
  if (!rpc::call(socket(), req, &resp, &err)) {
    resp.set_ok(false);
    resp.set_error("call failed: " + err);
  }
  return resp;
}

rpc::StatusReply Broker::status() {
  rpc::Request r;
  r.set_version(1);
  r.mutable_status();
  return call(r).status();
}

rpc::Tenant Broker::tenant(const std::string& name) {
  rpc::Request r;
  r.set_version(1);
  r.mutable_tenants()->set_tenant(name);
  const rpc::Response resp = call(r);
  if (!resp.ok() || resp.tenants().tenants_size() != 1) return rpc::Tenant();
  return resp.tenants().tenants(0);
}

rpc::Response Broker::setLimit(const std::string& tenant, const std::string& memory, int device) {
  rpc::Request r;
  r.set_version(1);
  r.mutable_set_limit()->set_tenant(tenant);
  if (memory == "reset")
    r.mutable_set_limit()->set_reset(true);
  else
    r.mutable_set_limit()->set_memory(memory);
  r.mutable_set_limit()->set_device(device);
  return call(r);
}

rpc::Response Broker::reload() {
  rpc::Request r;
  r.set_version(1);
  r.mutable_reload();
  return call(r);
}

Child Broker::tenantProcess(const std::string& tenant, const std::map<std::string, std::string>& env,
                            std::string* first) {
  return tenantProcessWith({}, tenant, env, first);
}

Child Broker::tenantProcessIn(const std::vector<std::string>& wrapper, const std::string& tenant) {
  return tenantProcessWith(wrapper, tenant, {}, nullptr);
}

Child Broker::tenantProcessWith(const std::vector<std::string>& wrapper, const std::string& tenant,
                                const std::map<std::string, std::string>& env, std::string* first) {
  std::map<std::string, std::string> e = {{"LD_PRELOAD", SHIM_LIB},
                                          {"CUSHARE_TENANT", tenant},
                                          {"CUSHARE_LEDGER_DIR", ledgerDir()},
                                          {"CUSHARE_LOG_LEVEL", "error"}};
  for (const auto& [k, v] : env) e[k] = v;
  std::vector<std::string> argv = wrapper;
  argv.push_back(WORKER_BIN);
  Child c = Child::spawn(argv, e, dir_ + "/tenants.log");
  const std::string line = c.readLine();
  if (first != nullptr) *first = line;
  else EXPECT_EQ(line, "ready") << "tenant " << tenant << ": see " << dir_ << "/tenants.log";
  return c;
}

UidTenants::UidTenants() {
  // Laid out as installed: the shim, its probes in cushare/ beside it, simgpu's libcuda in simgpu/.
  const std::string lib = std::filesystem::path(SHIM_LIB).parent_path().string();
  shim_ = stage_.copy(SHIM_LIB, "lib/libcushare.so");
  stage_.copy(lib + "/cushare", "lib/cushare");
  lib_ = stage_.copy(lib + "/simgpu", "lib/simgpu");
  // simgpu's kernel cost table, read by each process (it lies in the source tree).
  if (const char* costs = std::getenv("SIMGPU_KERNEL_COSTS"); costs != nullptr && *costs != '\0')
    costs_ = stage_.copy(costs, "kernel.costs");
}

Child UidTenants::spawn(uid_t uid, const std::string& program, Broker& b, const std::string& tenant,
                        const std::map<std::string, std::string>& env, const std::vector<std::string>& args,
                        const std::vector<std::string>& wrapper) {
  std::string& staged = programs_[program];
  if (staged.empty()) staged = stage_.copy(program, "bin/" + std::filesystem::path(program).filename().string());
  std::map<std::string, std::string> e = {{"LD_PRELOAD", shim_},
                                          {"LD_LIBRARY_PATH", lib_},
                                          {"CUSHARE_TENANT", tenant},
                                          {"CUSHARE_LEDGER_DIR", b.ledgerDir()},
                                          {"CUSHARE_LOG_LEVEL", "warn"}};
  if (!costs_.empty()) e["SIMGPU_KERNEL_COSTS"] = costs_;
  for (const auto& [k, v] : env) {
    // What the staged copies replace must stay theirs: a path into the checkout works from a
    // world-readable development tree and fails silently from a private clone (ld.so ignores a
    // preload it cannot open: the process runs without the shim). Empty: none (no shim).
    if ((k == "LD_PRELOAD" || k == "LD_LIBRARY_PATH" || k == "SIMGPU_KERNEL_COSTS") && !v.empty() && v != e[k]) {
      ADD_FAILURE() << "UidTenants::spawn: " << k << "=" << v << " would replace the staged " << e[k];
      continue;
    }
    e[k] = v;
  }
  const std::string id = std::to_string(uid);
  std::vector<std::string> argv = wrapper;
  for (const std::string& a : {std::string("/usr/bin/setpriv"), "--reuid=" + id, "--regid=" + id,
                               std::string("--clear-groups"), staged})
    argv.push_back(a);
  argv.insert(argv.end(), args.begin(), args.end());
  return Child::spawn(argv, e, b.dir() + "/tenants.log");
}

int connectUnix(const std::string& path) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  std::snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path.c_str());
  if (fd >= 0 && ::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0) return fd;
  if (fd >= 0) ::close(fd);
  return -1;
}

std::string Broker::metrics() {
  const std::string addr = status().metrics_address();
  const size_t colon = addr.rfind(':');
  if (colon == std::string::npos) return "";
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(std::stoi(addr.substr(colon + 1))));
  ::inet_pton(AF_INET, addr.substr(0, colon).c_str(), &sa.sin_addr);
  std::string body;
  const std::string get = "GET /metrics HTTP/1.0\r\n\r\n";
  if (fd >= 0 && ::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0 &&
      ::write(fd, get.data(), get.size()) == static_cast<ssize_t>(get.size())) {
    char buf[4096];
    for (ssize_t n; (n = ::read(fd, buf, sizeof buf)) > 0;) body.append(buf, static_cast<size_t>(n));
  }
  if (fd >= 0) ::close(fd);
  return body;
}

std::map<int, uint64_t> deviceMemoryOn0() {
  using Init = nvmlReturn_t (*)();
  using Handle = nvmlReturn_t (*)(unsigned, nvmlDevice_t*);
  using List = nvmlReturn_t (*)(nvmlDevice_t, unsigned*, nvmlProcessInfo_t*);
  static void* lib = ::dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  std::map<int, uint64_t> out;
  if (lib == nullptr) return out;
  static const bool started = reinterpret_cast<Init>(::dlsym(lib, "nvmlInit_v2"))() == NVML_SUCCESS;
  auto handle = reinterpret_cast<Handle>(::dlsym(lib, "nvmlDeviceGetHandleByIndex_v2"));
  auto list = reinterpret_cast<List>(::dlsym(lib, "nvmlDeviceGetComputeRunningProcesses_v3"));
  nvmlDevice_t h;
  nvmlProcessInfo_t infos[256];
  unsigned n = 256;
  if (!started || handle(0, &h) != NVML_SUCCESS || list(h, &n, infos) != NVML_SUCCESS) return out;
  for (unsigned i = 0; i < n; ++i) out[static_cast<int>(infos[i].pid)] += infos[i].usedGpuMemory;
  return out;
}

uint64_t deviceUsed() {
  nvmlDevice_t d;
  nvmlMemory_t m{};
  if (nvmlInit_v2() != NVML_SUCCESS || nvmlDeviceGetHandleByIndex_v2(0, &d) != NVML_SUCCESS ||
      nvmlDeviceGetMemoryInfo(d, &m) != NVML_SUCCESS)
    return UINT64_MAX;
  nvmlShutdown();
  return m.used;
}

uint64_t usedOn0(const rpc::Tenant& t) { return t.devices_size() ? t.devices(0).used_bytes() : UINT64_MAX; }
uint64_t limitOn0(const rpc::Tenant& t) {
  return t.devices_size() && t.devices(0).has_limit_bytes() ? t.devices(0).limit_bytes() : UINT64_MAX;
}

bool eventually(const std::function<bool()>& pred, int ms) {
  for (const auto start = std::chrono::steady_clock::now();
       std::chrono::steady_clock::now() - start < std::chrono::milliseconds(ms);) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return pred();
}

bool stopProcess(pid_t pid) {
  if (::kill(pid, SIGSTOP) != 0) return false;
  const std::string tasks = "/proc/" + std::to_string(pid) + "/task";
  return eventually(
      [&] {
        bool all = true, any = false;
        for (const auto& t : std::filesystem::directory_iterator(tasks, std::filesystem::directory_options::skip_permission_denied)) {
          std::ifstream in(t.path() / "stat");
          std::string line;
          std::getline(in, line);
          const size_t paren = line.rfind(')');  // the state follows the command's closing parenthesis
          if (paren == std::string::npos || paren + 2 >= line.size()) continue;
          any = true;
          all = all && (line[paren + 2] == 'T' || line[paren + 2] == 't');
        }
        return any && all;
      },
      5000);
}

double probeShareOn0(Broker& b, const std::string& tenant, rpc::ProbeShare* share_out) {
  const rpc::Tenant t = b.tenant(tenant);
  if (t.devices_size() < 1 || !t.devices(0).has_probe()) return -1;
  const rpc::ProbeShare& p = t.devices(0).probe();
  std::printf("probe %s: share %.3f +- %.3f over %u rounds (%u with work, %u missing, %u bad), regime %s%s%s\n",
              tenant.c_str(), p.compute_share(), p.compute_share_stderr(), p.rounds(), p.rounds_with_work(),
              p.missing(), p.bad(), p.regime().c_str(), p.last_error().empty() ? "" : ", last error: ",
              p.last_error().c_str());
  if (p.has_spatial())
    std::printf("  factors: spatial %.3f temporal %.3f intra %.3f\n", p.spatial(), p.temporal(), p.intra());
  if (share_out) *share_out = p;
  return p.compute_share();
}

uint64_t hiddenOf(Broker& b, const std::string& tenant) {
  const std::string m = b.metrics();
  const std::string key = "cushare_tenant_hidden_bytes{tenant=\"" + tenant + "\",device=\"0\",uuid=\"" + kDevice0Uuid + "\"} ";
  const size_t at = m.find(key);
  return at == std::string::npos ? UINT64_MAX : std::strtoull(m.c_str() + at + key.size(), nullptr, 10);
}

uint64_t field(const std::string& line, int index) {
  std::istringstream in(line);
  std::string w;
  for (int i = 0; i <= index && (in >> w); ++i) {
  }
  return std::strtoull(w.c_str(), nullptr, 10);
}

}  // namespace cushare::test
