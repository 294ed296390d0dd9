// See mps_daemon.h.
#include "core/mps_daemon.h"

#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include "core/broker.h"
#include "core/log.h"
#include "core/places.h"

extern char** environ;

namespace cushare::broker {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kCheckTimeoutMs = 3000;   // one health check's control session
constexpr int kStartTimeoutMs = 10000;  // `-d` until it returns
constexpr int kQuitWaitMs = 5000;       // after quit, for the daemon to be gone
constexpr auto kPeriod = std::chrono::seconds(1);

int msSince(Clock::time_point t) {
  return static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t).count());
}

bool executable(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(path.c_str(), X_OK) == 0;
}

std::string onPath(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::stringstream in(path ? path : "/usr/local/bin:/usr/bin:/bin");
  for (std::string dir; std::getline(in, dir, ':');)
    if (!dir.empty() && executable(dir + "/" + name)) return dir + "/" + name;
  return "";
}

// simgpu's control binary: bin/ beside the NVML library this process loaded, if that is simgpu's.
std::string besideNvml() {
  void* lib = ::dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (lib == nullptr) return "";
  Dl_info info{};
  void* sym = ::dlsym(lib, "nvmlInit_v2");
  std::string r;
  if (sym != nullptr && ::dladdr(sym, &info) != 0 && info.dli_fname != nullptr) {
    const std::string file = info.dli_fname;
    const size_t slash = file.rfind('/');
    const std::string candidate = (slash == std::string::npos ? "." : file.substr(0, slash)) + "/bin/nvidia-cuda-mps-control";
    if (executable(candidate)) r = candidate;
  }
  ::dlclose(lib);
  return r;
}

// mkdir -p with mode 0755; the last component must be a directory of this user that others cannot
// write (clients find the daemon's socket there: nobody else may plant one).
bool makeDir(const std::string& dir, const std::string& what, std::string* err) {
  for (size_t i = 1; i <= dir.size(); ++i) {
    if (i < dir.size() && dir[i] != '/') continue;
    const std::string p = dir.substr(0, i);
    if (::mkdir(p.c_str(), 0755) != 0 && errno != EEXIST) {
      // Worded as --check words it (checkMpsDirs): the directory asked for, and where it failed.
      *err = "mps." + what + " " + dir + " cannot be created in " + p.substr(0, std::max<size_t>(1, p.rfind('/'))) +
             ": " + std::strerror(errno);
      return false;
    }
  }
  struct stat st;
  if (::lstat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    *err = "mps." + what + ": " + dir + " is not a directory";
    return false;
  }
  if (st.st_uid != ::geteuid() || (st.st_mode & 022) != 0) {
    *err = "mps." + what + ": " + dir + " belongs to uid " + std::to_string(st.st_uid) +
           " or is writable by others: the broker needs a directory of its own (mode 0755)";
    return false;
  }
  return true;
}

// makeDir's verdict without making anything.
bool checkMpsDir(const std::string& dir, const std::string& what, std::string* err) {
  struct stat st;
  if (::lstat(dir.c_str(), &st) != 0) return checkDirWritable(dir, "mps." + what, err);
  if (!S_ISDIR(st.st_mode)) {
    *err = "mps." + what + ": " + dir + " is not a directory";
    return false;
  }
  if (st.st_uid != ::geteuid() || (st.st_mode & 022) != 0) {
    *err = "mps." + what + ": " + dir + " belongs to uid " + std::to_string(st.st_uid) +
           " or is writable by others: the broker needs a directory of its own (mode 0755)";
    return false;
  }
  return true;
}

bool allDigits(const std::string& s) {
  if (s.empty()) return false;
  for (char c : s)
    if (c < '0' || c > '9') return false;
  return true;
}

std::vector<std::string> lines(const std::string& text) {
  std::vector<std::string> r;
  std::stringstream in(text);
  for (std::string l; std::getline(in, l);) {
    while (!l.empty() && (l.back() == '\r' || l.back() == ' ')) l.pop_back();
    if (!l.empty()) r.push_back(l);
  }
  return r;
}

std::string oneLine(std::string s) {
  for (char& c : s)
    if (c == '\n' || c == '\r') c = ' ';
  while (!s.empty() && s.back() == ' ') s.pop_back();
  return s.size() > 300 ? s.substr(0, 300) + "..." : s;
}

// Is pid the control daemon (argv[0] names the control binary)? Guards every signal sent to a pid
// read from the pid file: a stale file may name an unrelated process.
bool isControlDaemon(int pid, const std::string& binary) {
  if (pid <= 0) return false;
  std::ifstream in("/proc/" + std::to_string(pid) + "/cmdline");
  std::string argv0;
  std::getline(in, argv0, '\0');
  const auto base = [](const std::string& p) { return p.substr(p.rfind('/') == std::string::npos ? 0 : p.rfind('/') + 1); };
  return !argv0.empty() && base(argv0) == base(binary);
}

std::string mib(uint64_t bytes) { return std::to_string(bytes >> 20) + "M"; }

// Now and a process's start, in clock ticks since boot (/proc/<pid>/stat field 22); 0: unknown.
uint64_t bootTicksNow() {
  timespec ts{};
  ::clock_gettime(CLOCK_BOOTTIME, &ts);
  const uint64_t hz = static_cast<uint64_t>(::sysconf(_SC_CLK_TCK));
  return static_cast<uint64_t>(ts.tv_sec) * hz + static_cast<uint64_t>(ts.tv_nsec) * hz / 1000000000ull;
}

uint64_t startTicks(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  std::getline(in, stat);
  const size_t paren = stat.rfind(')');  // the command name may hold spaces and parentheses
  if (paren == std::string::npos) return 0;
  std::istringstream rest(stat.substr(paren + 2));
  std::string field;
  for (int i = 3; i <= 22 && (rest >> field); ++i) {
  }
  return allDigits(field) ? std::strtoull(field.c_str(), nullptr, 10) : 0;
}

std::string capText(const std::optional<int>& c) { return c ? std::to_string(*c) : "none"; }

}  // namespace

int MpsControl::run(const std::vector<std::string>& args, const std::string& input, int timeoutMs,
                    std::string* out) const {
  out->clear();
  int in[2], res[2];
  if (::pipe2(in, O_CLOEXEC) != 0) return -1;
  if (::pipe2(res, O_CLOEXEC) != 0) {
    ::close(in[0]);
    ::close(in[1]);
    return -1;
  }
  std::vector<std::string> env;
  for (char** e = environ; e && *e; ++e) {
    const std::string kv = *e;
    if (kv.rfind("CUDA_MPS_", 0) != 0 && kv.rfind("CUDA_DEVICE_ORDER=", 0) != 0 && kv.rfind("LD_PRELOAD=", 0) != 0 &&
        (visible.empty() || kv.rfind("CUDA_VISIBLE_DEVICES=", 0) != 0))
      env.push_back(kv);
  }
  if (!visible.empty()) env.push_back("CUDA_VISIBLE_DEVICES=" + visible);
  env.push_back("CUDA_MPS_PIPE_DIRECTORY=" + pipeDir);
  env.push_back("CUDA_MPS_LOG_DIRECTORY=" + logDir);
  env.push_back("CUDA_DEVICE_ORDER=PCI_BUS_ID");
  std::vector<char*> argv{const_cast<char*>(binary.c_str())}, envp;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  for (std::string& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);

  posix_spawn_file_actions_t fa;
  posix_spawnattr_t attr;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, in[0], 0);
  posix_spawn_file_actions_adddup2(&fa, res[1], 1);
  posix_spawn_file_actions_adddup2(&fa, res[1], 2);
  posix_spawnattr_init(&attr);
  // The broker blocks its stop signals and ignores SIGPIPE; the daemon must not inherit either.
  sigset_t none, defaults;
  sigemptyset(&none);
  sigemptyset(&defaults);
  for (int s : {SIGHUP, SIGTERM, SIGINT, SIGPIPE}) sigaddset(&defaults, s);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &defaults);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  pid_t pid = -1;
  const int rc = ::posix_spawn(&pid, binary.c_str(), &fa, &attr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  posix_spawnattr_destroy(&attr);
  ::close(in[0]);
  ::close(res[1]);
  if (rc != 0) {
    ::close(in[1]);
    ::close(res[0]);
    *out = std::string("cannot run ") + binary + ": " + std::strerror(rc);
    return -1;
  }
  // The commands are short (far below a pipe's buffer): written at once, then EOF.
  for (size_t done = 0; done < input.size();) {
    const ssize_t n = ::write(in[1], input.data() + done, input.size() - done);
    if (n <= 0 && errno != EINTR) break;
    if (n > 0) done += static_cast<size_t>(n);
  }
  ::close(in[1]);
  // Read until the client exits (a daemonising `-d` may leave the pipe open in its child) or the
  // time is up.
  const auto start = Clock::now();
  int status = 0;
  bool exited = false, eof = false;
  char buf[4096];
  while (!exited) {
    const int left = timeoutMs - msSince(start);
    if (left <= 0) break;
    if (!eof) {
      pollfd p{res[0], POLLIN, 0};
      if (::poll(&p, 1, std::min(left, 20)) > 0) {
        const ssize_t n = ::read(res[0], buf, sizeof buf);
        if (n > 0) out->append(buf, static_cast<size_t>(n));
        else if (n == 0) eof = true;
        continue;
      }
    } else {
      ::usleep(2000);
    }
    exited = ::waitpid(pid, &status, WNOHANG) == pid;
  }
  if (!exited) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
    ::close(res[0]);
    return -2;
  }
  ::fcntl(res[0], F_SETFL, O_NONBLOCK);
  for (ssize_t n; (n = ::read(res[0], buf, sizeof buf)) > 0;) out->append(buf, static_cast<size_t>(n));
  ::close(res[0]);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

bool MpsControl::ask(const std::string& commands, int timeoutMs, std::string* out) const {
  return run({}, commands, timeoutMs, out) == 0;
}

std::string resolveMpsControl(const MpsConfig& c, std::string* why) {
  if (!c.control.empty()) {
    const std::string path = c.control[0] == '/' ? c.control : onPath(c.control);
    if (!path.empty() && executable(path)) return path;
    *why = "mps.control " + c.control + (c.control[0] == '/' ? " is not an executable file" : " is not on PATH");
    return "";
  }
  if (std::string s = besideNvml(); !s.empty()) return s;
  if (std::string p = onPath("nvidia-cuda-mps-control"); !p.empty()) return p;
  *why = "nvidia-cuda-mps-control is not on PATH (and the broker does not run on simgpu)";
  return "";
}

MpsSupervisor::MpsSupervisor(Broker& broker, std::string configPath)
    : broker_(broker), configPath_(std::move(configPath)) {}

MpsSupervisor::~MpsSupervisor() { stop(); }

std::string migPipeProblem(const MpsConfig& c, const std::vector<DeviceSnapshot>& devices) {
  bool mig = false;
  for (const DeviceSnapshot& d : devices) mig = mig || d.migIndex >= 0;
  if (!mig || c.pipeDir.size() <= kMaxMpsPipeDirWithMig) return "";
  return "mps.pipe_dir " + c.pipeDir + " is " + std::to_string(c.pipeDir.size()) + " bytes: with MIG devices (a " +
         "control daemon each, at <pipe_dir>/MIG-<uuid>) it may be at most " + std::to_string(kMaxMpsPipeDirWithMig);
}

bool MpsSupervisor::start(std::string* err) {
  if (!loadConfig(configPath_, &full_, err)) return false;
  err->clear();
  config_ = full_.mps;
  ledgerDir_ = broker_.ledgerDir();
  snap_.mode = mpsModeName(config_.mode);
  snap_.pipeDir = config_.pipeDir;
  snap_.logDir = config_.logDir;
  if (::unlink((ledgerDir_ + "/" + kMpsHostFile).c_str()) != 0 && errno != ENOENT) {
    *err = "cannot remove " + ledgerDir_ + "/" + kMpsHostFile + ": " + std::strerror(errno);
    return false;
  }
  // Tenant settings a previous broker left: rewritten or removed by the first publication (a
  // stale file must not outlive its tenant), or removed now when MPS is off.
  if (DIR* d = ::opendir(ledgerDir_.c_str())) {
    const std::string suffix = kMpsTenantSuffix;
    while (const dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
        written_[name] = "";
    }
    ::closedir(d);
  }
  if (config_.mode == MpsConfig::Mode::kOff || !startMps(err)) {
    for (const auto& [name, text] : written_) ::unlink((ledgerDir_ + "/" + name).c_str());
    written_.clear();
    push();
    return err->empty();
  }
  return true;
}

bool MpsSupervisor::startMps(std::string* err) {
  err->clear();
  const std::vector<DeviceSnapshot> devices = broker_.snapshot().devices;
  deviceCount_ = devices.size();
  std::string why = migPipeProblem(config_, devices);
  binary_ = why.empty() ? resolveMpsControl(config_, &why) : "";
  snap_.control = binary_;
  // The daemons: one for the whole GPUs (at pipe_dir), one per MIG device (at pipe_dir/<uuid>,
  // started with CUDA_VISIBLE_DEVICES naming it: the MIG guide's "MIG with CUDA MPS").
  daemons_.clear();
  Daemon whole;
  std::string wholeVisible;
  bool mig = false;
  for (size_t i = 0; i < devices.size(); ++i) {
    const DeviceSnapshot& d = devices[i];
    if (d.migIndex < 0) {
      whole.devices.push_back(i);
      wholeVisible += (wholeVisible.empty() ? "" : ",") + d.uuid;
      continue;
    }
    mig = true;
    Daemon m;
    m.name = d.name;
    m.uuid = d.uuid;
    m.gpuUuid = d.parentUuid;
    m.gi = d.gpuInstance;
    m.ci = d.computeInstance;
    m.control = {binary_, config_.pipeDir + "/" + d.uuid, config_.logDir + "/" + d.uuid, d.uuid};
    m.devices.push_back(i);
    daemons_.push_back(std::move(m));
  }
  if (!whole.devices.empty()) {
    // Beside MIG devices the whole GPUs' daemon sees only the whole GPUs (else it leaves them as
    // the environment has them, as before MIG).
    whole.control = {binary_, config_.pipeDir, config_.logDir, mig ? wholeVisible : std::string()};
    daemons_.insert(daemons_.begin(), std::move(whole));
  }
  bool ok = why.empty() && makeDir(config_.pipeDir, "pipe_dir", &why) && makeDir(config_.logDir, "log_dir", &why);
  if (ok) quitStaleDaemons();
  size_t started = 0;
  for (Daemon& d : daemons_) {
    if (!ok) break;
    ok = (d.name.empty() || (makeDir(d.control.pipeDir, "pipe_dir", &why) && makeDir(d.control.logDir, "log_dir", &why))) &&
         startDaemon(d, true, &why);
    if (!ok && !d.name.empty()) why = "MIG device " + d.name + " (" + d.uuid + "): " + why;
    started += ok;
  }
  if (!ok) {
    for (size_t k = 0; k < started; ++k) quitDaemon(daemons_[k]);
    daemons_.clear();
    if (config_.mode == MpsConfig::Mode::kOn) {
      *err = "mps.mode on: " + why;
      return false;
    }
    snap_.why = why;
    CUSHARE_BLOG(warn, "mps: mode auto and the control daemon cannot run, so MPS is off: {}", why);
    return false;
  }
  active_ = true;
  snap_.active = true;
  gather();
  {
    std::lock_guard<std::mutex> g(mu_);
    publish(true);
  }
  if (hostText_.empty()) {  // the settings could not be published: a client could not get its cap
    *err = "mps: " + snap_.lastError;
    stop();
    return false;
  }
  push();
  const std::string users = config_.multiuser ? "one server for every uid (multiuser)"
                                              : "one server per uid at a time (multiuser off: another uid waits for its clients)";
  for (const Daemon& d : daemons_)
    CUSHARE_BLOG(info, "mps: {} pid {} ({}), pipe directory {}, log directory {}, {}", d.label(), d.pid, binary_,
                 d.control.pipeDir, d.control.logDir, users);
  thread_ = std::thread([this] { run(); });
  return true;
}

// The CUDA_VISIBLE_DEVICES a running process was started with ("" when unset or unreadable).
static std::string visibleOf(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/environ", std::ios::binary);
  for (std::string kv; std::getline(in, kv, '\0');)
    if (kv.rfind("CUDA_VISIBLE_DEVICES=", 0) == 0) return kv.substr(21);
  return "";
}

void MpsSupervisor::quitStaleDaemons() {
  // A MIG device's daemon from an earlier layout (its directory under pipe_dir, no longer a MIG
  // device of this host), or a whole-GPU daemon where there are no whole GPUs now: quit, so that
  // no process finds a daemon the broker does not watch.
  std::vector<std::string> stale;
  bool whole = false;
  for (const Daemon& d : daemons_) whole = whole || d.name.empty();
  if (!whole) stale.push_back(config_.pipeDir);
  if (DIR* dir = ::opendir(config_.pipeDir.c_str())) {
    while (const dirent* e = ::readdir(dir)) {
      const std::string name = e->d_name;
      if (name.rfind("MIG-", 0) != 0) continue;
      bool current = false;
      for (const Daemon& d : daemons_) current = current || d.uuid == name;
      if (!current) stale.push_back(config_.pipeDir + "/" + name);
    }
    ::closedir(dir);
  }
  for (const std::string& pipe : stale) {
    Daemon old;
    old.name = pipe == config_.pipeDir ? "" : pipe.substr(config_.pipeDir.size() + 1);  // its MIG UUID
    old.control = {binary_, pipe, config_.logDir, ""};
    std::string out;
    if (!old.control.ask("get_server_list\n", kCheckTimeoutMs, &out)) continue;  // nobody there
    CUSHARE_BLOG(warn, "mps: quit the control daemon on {} (pid {}): no device of this host is served there now (the "
                 "MIG layout changed)", pipe, pidFromFile(old));
    quitDaemon(old);
  }
}

bool MpsSupervisor::startDaemon(Daemon& d, bool adoptRunning, std::string* err) {
  std::string out;
  std::vector<std::string> args{"-d"};
  if (config_.multiuser) args.push_back("-multiuser-server");
  int rc = d.control.run(args, "", kStartTimeoutMs, &out);
  // A daemon already there that was started for other devices (an earlier layout): quit it and
  // start one for these.
  if (rc != 0 && adoptRunning && out.find("already running") != std::string::npos && !d.control.visible.empty()) {
    const int pid = pidFromFile(d);
    if (isControlDaemon(pid, binary_) && visibleOf(pid) != d.control.visible) {
      CUSHARE_BLOG(warn, "mps: {} already running on {} (pid {}) serves CUDA_VISIBLE_DEVICES={}, not {}: restarting it",
                   d.label(), d.control.pipeDir, pid, visibleOf(pid), d.control.visible);
      quitDaemon(d);
      rc = d.control.run(args, "", kStartTimeoutMs, &out);
    }
  }
  if (rc != 0) {
    std::string probe;
    if (adoptRunning && out.find("already running") != std::string::npos &&
        d.control.ask("get_server_list\n", kCheckTimeoutMs, &probe)) {
      CUSHARE_BLOG(info, "mps: adopted {} already running on {} (pid {})", d.label(), d.control.pipeDir, pidFromFile(d));
    } else {
      *err = binary_ + (config_.multiuser ? " -d -multiuser-server " : " -d ") +
             (rc == -2 ? "did not return within " + std::to_string(kStartTimeoutMs / 1000) + " s"
                       : rc == -1 ? "could not be started" : "exited with status " + std::to_string(rc)) +
             (out.empty() ? "" : ": " + oneLine(out));
      return false;
    }
  }
  d.pid = pidFromFile(d);
  d.up = true;
  d.defaultsKey.clear();  // a new daemon has none of them
  return true;
}

int MpsSupervisor::pidFromFile(const Daemon& d) const {
  std::ifstream in(d.control.pipeDir + "/nvidia-cuda-mps-control.pid");
  std::string s;
  in >> s;
  return allDigits(s) && s.size() < 10 ? std::stoi(s) : 0;
}

void MpsSupervisor::publish(bool force) {
  const BrokerSnapshot b = broker_.snapshot();
  std::vector<DeviceInfo> devices;
  for (const DeviceSnapshot& d : b.devices) {
    DeviceInfo i;
    i.ordinal = d.index;
    i.migIndex = d.migIndex;
    i.uuid = d.uuid;
    i.totalBytes = d.capacity;
    devices.push_back(std::move(i));
  }
  std::map<std::string, std::string> files;
  std::map<std::string, std::optional<int>> published;
  bool anyUncapped = false;
  int maxThreads = 0;
  // Per device the largest limit plus reserve; nullopt: some tenant has no limit there; 0: no tenant.
  std::vector<std::optional<uint64_t>> maxMemory(devices.size(), uint64_t{0});
  auto account = [&](const MpsTenantSettings& s) {
    if (!s.threads) anyUncapped = true;
    else maxThreads = std::max(maxThreads, *s.threads);
    for (size_t i = 0; i < devices.size(); ++i) {
      uint64_t limit = kUnlimited;
      for (const auto& [uuid, bytes] : s.memory)
        if (uuid == devices[i].uuid) limit = bytes;
      if (limit == kUnlimited) maxMemory[i].reset();
      else if (maxMemory[i]) maxMemory[i] = std::max(*maxMemory[i], limit + config_.contextReserve);
    }
  };
  // From the configuration (and live changes), whatever the state of the tenant's ledger: a
  // process of the tenant that damages or locks it must not take the settings away from the
  // tenant's new processes. Only a tenant no longer configured loses them.
  for (const TenantSnapshot& t : b.tenants) {
    if (t.source == "removed") continue;
    MpsTenantSettings s;
    s.threads = t.threadPercentage;
    s.priority = t.priority;
    for (size_t i = 0; i < devices.size() && i < t.limits.size(); ++i) s.memory.emplace_back(devices[i].uuid, t.limits[i]);
    files[t.name + kMpsTenantSuffix] = formatMpsTenant(s);
    published[t.name] = s.threads;
    account(s);
  }
  MpsHostSettings host;
  host.pipeDir = config_.pipeDir;
  host.contextReserve = config_.contextReserve;
  host.wholeGpus = false;
  for (const Daemon& d : daemons_) {
    if (d.name.empty()) host.wholeGpus = true;
    else host.mig.push_back({d.uuid, d.gpuUuid, d.gi, d.ci});
  }
  // The directory's identity: a process told (CUSHARE_MPS_PIPE_DIR) that the pipe directory is
  // mounted elsewhere must find this same directory there (a bind mount keeps both numbers).
  if (struct stat st{}; ::stat(config_.pipeDir.c_str(), &st) == 0) {
    host.pipeDev = static_cast<uint64_t>(st.st_dev);
    host.pipeIno = static_cast<uint64_t>(st.st_ino);
  }
  if (!full_.unknownTenantsProfile.empty()) {
    for (const Profile& p : full_.profiles) {
      if (p.name != full_.unknownTenantsProfile) continue;
      MpsTenantSettings u;
      u.threads = p.threadPercentage;
      u.priority = p.priority.value_or(Priority::kNormal);
      std::vector<uint64_t> limits;
      std::string e;
      if (resolveMemory(full_, p.memory, devices, &limits, &e))
        for (size_t i = 0; i < devices.size(); ++i) u.memory.emplace_back(devices[i].uuid, limits[i]);
      host.unknown = u;
      published[""] = u.threads;
      account(u);
    }
  }
  std::string err;
  bool ok = true;
  for (const auto& [file, text] : files)
    if ((force || written_[file] != text) && (ok = writeMpsFile(ledgerDir_, file, text, &err))) written_[file] = text;
    else if (!ok) break;
  for (auto it = written_.begin(); ok && it != written_.end();) {
    if (files.count(it->first)) {
      ++it;
      continue;
    }
    ::unlink((ledgerDir_ + "/" + it->first).c_str());  // no longer a tenant: new processes are refused anyway
    it = written_.erase(it);
  }
  const std::string hostText = formatMpsHost(host);
  if (ok && (force || hostText != hostText_)) {
    if ((ok = writeMpsFile(ledgerDir_, kMpsHostFile, hostText, &err))) hostText_ = hostText;
  }
  if (!ok) {
    snap_.lastError = "cannot publish the tenants' MPS settings: " + err;
    CUSHARE_BLOG(error, "mps: {}", snap_.lastError);
  }
  snap_.published = published;
  // What the tenants' running processes started with (a change applies to new processes only).
  const uint64_t now = bootTicksNow();
  std::map<std::string, std::map<std::string, uint32_t>> running;
  for (const TenantSnapshot& t : b.tenants) {
    auto p = published.find(t.name);
    if (p == published.end()) continue;
    auto& h = history_[t.name];
    if (h.empty() || h.back().second != p->second) h.emplace_back(now, p->second);
    for (const ProcessSnapshot& proc : t.processes) {
      const uint64_t started = startTicks(proc.hostPid ? proc.hostPid : proc.pid);
      std::string cap = "unknown";
      for (const auto& [at, value] : h)
        if (started > at) cap = capText(value);  // started after that publication (to a tick)
      ++running[t.name][cap];
    }
  }
  for (auto it = history_.begin(); it != history_.end();) it = published.count(it->first) ? std::next(it) : history_.erase(it);
  snap_.running = std::move(running);
  // Server defaults: the most any tenant gets, so that a process that leaves out the shim (but
  // finds the pipe directory) gets no more than the largest cap and memory limit.
  const int threads = anyUncapped || maxThreads == 0 ? 100 : maxThreads;
  snap_.defaultThreads = threads;
  for (Daemon& d : daemons_) {
    std::string cmds = "set_default_active_thread_percentage " + std::to_string(threads) + "\n";
    std::string perServer;
    for (size_t k = 0; k < d.devices.size(); ++k) {
      const size_t i = d.devices[k];
      if (i >= devices.size() || !maxMemory[i] || *maxMemory[i] == 0) continue;
      // How the daemon names the device: NVML's index (PCI order) when it sees every GPU; by UUID
      // when it sees some GPUs only (beside MIG devices); a MIG device's daemon sees one: 0.
      const std::string ordinal = d.control.visible.empty() ? std::to_string(devices[i].ordinal)
                                  : d.name.empty()          ? devices[i].uuid
                                                            : std::to_string(k);
      const std::string size = mib(std::max<uint64_t>(*maxMemory[i], uint64_t{1} << 20));
      cmds += "set_default_device_pinned_mem_limit " + ordinal + " " + size + "\n";
      perServer += " " + ordinal + " " + size;
    }
    if (cmds == d.defaultsKey && !force) continue;
    // The running servers' next clients get the new values too (running clients keep theirs).
    std::string all = cmds;
    for (const MpsServerSnapshot& srv : d.servers) {
      all += "set_active_thread_percentage " + std::to_string(srv.pid) + " " + std::to_string(threads) + "\n";
      std::stringstream in(perServer);
      for (std::string dev, size; in >> dev >> size;)
        all += "set_device_pinned_mem_limit " + std::to_string(srv.pid) + " " + dev + " " + size + "\n";
    }
    std::string out;
    if (d.control.ask(all, kCheckTimeoutMs, &out)) {
      d.defaultsKey = cmds;
      CUSHARE_BLOG(info, "mps: server defaults{}: active thread percentage {}{}",
                   d.name.empty() ? "" : " of MIG device " + d.name, threads,
                   perServer.empty() ? "" : ", pinned memory (device size)" + perServer);
    } else {
      CUSHARE_BLOG(warn, "mps: cannot set the server defaults{}: {}", d.name.empty() ? "" : " of MIG device " + d.name,
                   oneLine(out));
    }
  }
}

void MpsSupervisor::refresh() {
  if (!active_) return;
  std::lock_guard<std::mutex> g(mu_);
  Config c;
  std::string err;
  if (loadConfig(configPath_, &c, &err)) {
    if (c.mps.mode != config_.mode || c.mps.pipeDir != config_.pipeDir || c.mps.logDir != config_.logDir ||
        c.mps.control != config_.control || c.mps.contextReserve != config_.contextReserve ||
        c.mps.multiuser != config_.multiuser)
      CUSHARE_BLOG(warn, "mps: the mps settings changed; they take effect when the broker restarts");
    const MpsConfig keep = config_;
    full_ = std::move(c);
    full_.mps = keep;
  }
  publish(false);
  push();
}

void MpsSupervisor::run() {
  std::unique_lock<std::mutex> g(mu_);
  while (!stop_) {
    cv_.wait_for(g, kPeriod, [this] { return stop_; });
    if (stop_) break;
    check();
    publish(false);
    push();
  }
}

void MpsSupervisor::check() {
  for (Daemon& d : daemons_) checkOne(d);
  gather();
}

void MpsSupervisor::gather() {
  snap_.up = !daemons_.empty();
  snap_.servers.clear();
  snap_.deviceUp.assign(deviceCount_, 0);
  for (const Daemon& d : daemons_)
    for (size_t i : d.devices)
      if (i < snap_.deviceUp.size()) snap_.deviceUp[i] = d.up ? 1 : 0;
  std::string errors;
  for (const Daemon& d : daemons_) {
    snap_.up = snap_.up && d.up;
    snap_.servers.insert(snap_.servers.end(), d.servers.begin(), d.servers.end());
    if (!d.lastError.empty()) errors += (errors.empty() ? "" : "; ") + (d.name.empty() ? "" : "MIG device " + d.name + ": ") + d.lastError;
  }
  if (!daemons_.empty()) {
    snap_.daemonPid = daemons_.front().pid;
    snap_.pipeDir = daemons_.front().control.pipeDir;
  }
  snap_.lastError = errors;
}

void MpsSupervisor::checkOne(Daemon& d) {
  std::string out;
  const int rc = d.control.run({}, "get_server_list\n", kCheckTimeoutMs, &out);
  if (rc == 0) {
    if (!d.up) CUSHARE_BLOG(info, "mps: {} answers again", d.label());
    d.up = true;
    d.lastError.clear();
    d.silentChecks = 0;
    d.pid = pidFromFile(d);
    std::vector<MpsServerSnapshot> servers;
    for (const std::string& l : lines(out)) {
      if (!allDigits(l) || l.size() > 9) continue;
      MpsServerSnapshot srv;
      srv.pid = std::stoi(l);
      srv.daemon = d.uuid;
      std::string answer;
      if (d.control.ask("get_server_status " + l + "\nget_client_list " + l + "\n", kCheckTimeoutMs, &answer)) {
        const std::vector<std::string> ls = lines(answer);
        if (!ls.empty()) srv.state = ls[0];
        for (size_t i = 1; i < ls.size(); ++i)
          if (allDigits(ls[i]) && ls[i].size() < 10) srv.clients.push_back(std::stoi(ls[i]));
      } else {
        // No answer this time: the clients it had (a client stays one until it exits; a new
        // process missing from the list has its tenant paced, never the other way round).
        for (const MpsServerSnapshot& before : d.servers)
          if (before.pid == srv.pid) srv.clients = before.clients;
      }
      servers.push_back(std::move(srv));
    }
    std::set<int> live;
    for (const MpsServerSnapshot& srv : servers) {
      live.insert(srv.pid);
      if (srv.state == "FAULT" && !d.faulted[srv.pid]) {
        d.faulted[srv.pid] = true;
        ++snap_.faults;
        // Name the tenants whose processes are the server's clients.
        std::map<int, std::string> owner;
        for (const TenantSnapshot& t : broker_.snapshot().tenants)
          for (const ProcessSnapshot& p : t.processes) owner[p.hostPid ? p.hostPid : p.pid] = t.name;
        std::string who;
        for (int c : srv.clients) who += " " + std::to_string(c) + (owner.count(c) ? "(" + owner[c] + ")" : "");
        CUSHARE_BLOG(error, "mps: server {}{} is in FAULT: its clients{} get errors and must exit; until they have, "
                     "new clients are refused (CUDA_ERROR_MPS_SERVER_NOT_READY)", srv.pid,
                     d.name.empty() ? "" : " of MIG device " + d.name, who.empty() ? " (none)" : who);
      } else if (srv.state != "FAULT" && d.faulted.count(srv.pid)) {
        d.faulted.erase(srv.pid);
        CUSHARE_BLOG(info, "mps: server {} is {} again after its FAULT", srv.pid, srv.state);
      }
    }
    for (auto it = d.faulted.begin(); it != d.faulted.end();) it = live.count(it->first) ? std::next(it) : d.faulted.erase(it);
    d.servers = std::move(servers);
    return;
  }
  ++snap_.checkFailures;
  const int pid = pidFromFile(d);
  const bool alive = isControlDaemon(pid, binary_) && ::kill(pid, 0) == 0;
  d.up = false;
  d.servers.clear();
  d.lastError = rc == -2 ? d.label() + " did not answer within " + std::to_string(kCheckTimeoutMs / 1000) + " s"
                         : d.label() + " does not answer: " + (out.empty() ? "exit status " + std::to_string(rc) : oneLine(out));
  if (alive && ++d.silentChecks < 2) {
    CUSHARE_BLOG(warn, "mps: {} (pid {}); checking again", d.lastError, pid);
    return;
  }
  if (alive) {
    CUSHARE_BLOG(error, "mps: {} (pid {}) hangs: killing it", d.label(), pid);
    ::kill(pid, SIGKILL);
    // Gone once its /proc entry no longer names the binary (a zombie has no command line).
    for (const auto t = Clock::now(); isControlDaemon(pid, binary_) && msSince(t) < 2000;) ::usleep(10000);
  }
  d.silentChecks = 0;
  std::string why;
  if (startDaemon(d, false, &why)) {
    ++snap_.restarts;
    d.lastError.clear();
    CUSHARE_BLOG(warn, "mps: {} was gone ({}); restarted it, pid {} (restart {})", d.label(), alive ? "hung" : "exited",
                 d.pid, snap_.restarts);
  } else {
    d.lastError += "; restart failed: " + why;
    CUSHARE_BLOG(error, "mps: cannot restart {}: {}", d.label(), why);
  }
}

void MpsSupervisor::push() { broker_.setMpsSnapshot(snap_); }

bool MpsSupervisor::stopThread() {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (stop_) return false;
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  return true;
}

void MpsSupervisor::stop() {
  if (!stopThread() || !active_) return;
  // New processes must not look for a daemon that is going.
  ::unlink((ledgerDir_ + "/" + kMpsHostFile).c_str());
  for (Daemon& d : daemons_) quitDaemon(d);
  active_ = false;
}

void MpsSupervisor::detach() {
  if (stopThread()) active_ = false;
}

void MpsSupervisor::quitDaemon(Daemon& d) {
  const int pid = pidFromFile(d);
  std::string out;
  if (!d.control.ask("quit\n", kCheckTimeoutMs, &out))
    CUSHARE_BLOG(warn, "mps: quit was not answered by {}: {}", d.label(), oneLine(out));
  const auto t = Clock::now();
  while (isControlDaemon(pid, binary_) && ::kill(pid, 0) == 0 && msSince(t) < kQuitWaitMs) ::usleep(10000);
  if (isControlDaemon(pid, binary_) && ::kill(pid, 0) == 0)
    CUSHARE_BLOG(warn, "mps: {} (pid {}) is still running {} s after quit", d.label(), pid, kQuitWaitMs / 1000);
  else
    CUSHARE_BLOG(info, "mps: {} stopped", d.label());
}

bool checkMpsDirs(const MpsConfig& c, std::string* why) {
  return checkMpsDir(c.pipeDir, "pipe_dir", why) && checkMpsDir(c.logDir, "log_dir", why);
}

}  // namespace cushare::broker
