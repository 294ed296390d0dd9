// The simulated NVIDIA MPS end to end: the real binaries (nvidia-cuda-mps-control -d, the control
// client on stdin, the server it starts) and simgpu processes that become its clients through the
// driver API, as a CUDA program does.
//
// Each test starts its own daemon in a private pipe and log directory (a short path under /tmp:
// a Unix socket path has 107 bytes) and quits it at the end. The parent never initialises CUDA;
// clients are this executable started again with `--child` (fork + exec, optionally setuid), and
// talk through fixed descriptors: 3 the report pipe (lines the child writes), 4 the command pipe
// (lines the parent writes; EOF: the child exits). What a test asserts comes from the daemon's
// answers and logs, the client's own CUDA results, and simgpu's device accounting read by an
// observer process that is not a client.
#include <cuda.h>
#include <fcntl.h>
#include <gtest/gtest.h>

#include <csignal>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <grp.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "mps_table.h"
#include "user_stage.h"
#include "simgpu/nvml.h"
#include "timeslice_board.h"
#include "mig.h"

extern "C" void simgpu_debug_fault(int error);

namespace {

constexpr int kReportFd = 3;
constexpr int kControlFd = 4;
constexpr size_t kMiB = size_t{1} << 20;
const std::string kBin = SIMGPU_MPS_BIN;

// ---------------------------------------------------------------------------------------------
// Child side: attach (cuInit + the primary context, as cudart does), then obey commands.
void report(const std::string& line) {
  const std::string l = line + "\n";
  (void)!write(kReportFd, l.data(), l.size());
}

int visibleSms() {
  int sms = -1;
  cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 0);
  return sms;
}

int childMain() {
  CUresult r = cuInit(0);
  CUcontext ctx = nullptr;
  if (r == CUDA_SUCCESS) r = cuDevicePrimaryCtxRetain(&ctx, 0);
  if (r == CUDA_SUCCESS) r = cuCtxSetCurrent(ctx);
  report("attached " + std::to_string(r) + " " + std::to_string(visibleSms()));
  FILE* in = fdopen(kControlFd, "r");
  char line[256];
  while (in && std::fgets(line, sizeof line, in)) {
    std::istringstream cmd(line);
    std::string op;
    cmd >> op;
    if (op == "alloc") {
      size_t bytes = 0;
      cmd >> bytes;
      CUdeviceptr p = 0;
      report("alloc " + std::to_string(cuMemAlloc(&p, bytes)));
    } else if (op == "vmm") {  // shareable (exportable) physical memory, counted apart
      size_t bytes = 0;
      cmd >> bytes;
      CUmemAllocationProp prop{};
      prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
      prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      prop.location.id = 0;
      prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
      CUmemGenericAllocationHandle h = 0;
      report("vmm " + std::to_string(cuMemCreate(&h, bytes, &prop, 0)));
    } else if (op == "sync") {
      report("sync " + std::to_string(cuCtxSynchronize()));
    } else if (op == "sms") {
      CUexecAffinityParam a{};
      const CUresult ar = cuCtxGetExecAffinity(&a, CU_EXEC_AFFINITY_TYPE_SM_COUNT);
      report("sms " + std::to_string(visibleSms()) + " " + std::to_string(ar == CUDA_SUCCESS ? a.param.smCount.val : 0));
    } else if (op == "used") {
      size_t free = 0, total = 0;
      const CUresult ur = cuMemGetInfo(&free, &total);
      report("used " + std::to_string(ur) + " " + std::to_string(total - free));
    } else if (op == "fault") {
      simgpu_debug_fault(CUDA_ERROR_ILLEGAL_ADDRESS);
      report("faulted");
    }
  }
  return 0;
}

// ---------------------------------------------------------------------------------------------
// Parent side
struct Child {
  pid_t pid = -1;
  int report = -1;  // read end
  int control = -1;  // write end
  std::string pending;
};

// A child or daemon that hangs up while the test writes to it is an answer the test checks, not a
// reason for the test binary to die of SIGPIPE.
const bool kSigpipeIgnored = (std::signal(SIGPIPE, SIG_IGN), true);

template <typename F>
bool waitFor(F cond, int ms = 10000) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  while (!cond()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));  // polling a condition with a deadline
  }
  return true;
}

struct Result {
  int rc = -1;
  std::string out, err;
};

std::string readAll(int fd) {
  std::string s;
  char b[4096];
  ssize_t n;
  while ((n = read(fd, b, sizeof b)) > 0) s.append(b, static_cast<size_t>(n));
  ::close(fd);
  return s;
}

class Mps : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/simgpu-mps-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    root_ = tmpl;
    chmod(root_.c_str(), 0755);
    pipe_ = root_ + "/pipe";
    log_ = root_ + "/log";
    setenv("CUDA_MPS_PIPE_DIRECTORY", pipe_.c_str(), 1);
    setenv("CUDA_MPS_LOG_DIRECTORY", log_.c_str(), 1);
  }

  void TearDown() override {
    for (Child& c : children_) stop(c);
    if (started_) {
      control("quit");
      int status = 0;
      EXPECT_EQ(waitpid(daemonPid_, &status, 0), daemonPid_) << "the daemon did not quit";
    }
    while (waitpid(-1, nullptr, WNOHANG) > 0) {  // servers a quitting daemon left to us
    }
    (void)!system(("rm -rf " + root_).c_str());
  }

  // Runs nvidia-cuda-mps-control with args, input on stdin (closed afterwards).
  Result run(const std::vector<std::string>& args, const std::string& input,
             const std::vector<std::string>& env = {}) {
    return runProgram(controlPath_, args, input, env);
  }
  // Runs program with args, input on stdin (closed afterwards); its output and exit status.
  static Result runProgram(const std::string& program, const std::vector<std::string>& args,
                           const std::string& input, const std::vector<std::string>& env) {
    // Close-on-exec: a program started by another thread meanwhile (ForegroundDaemon...) must not
    // inherit these ends, or this one's stdin never reaches EOF (dup2 clears the flag on 0-2).
    int in[2], out[2], err[2];
    EXPECT_EQ(pipe2(in, O_CLOEXEC), 0);
    EXPECT_EQ(pipe2(out, O_CLOEXEC), 0);
    EXPECT_EQ(pipe2(err, O_CLOEXEC), 0);
    const pid_t pid = fork();
    if (pid == 0) {
      dup2(in[0], 0);
      dup2(out[1], 1);
      dup2(err[1], 2);
      for (int fd : {in[0], in[1], out[0], out[1], err[0], err[1]}) ::close(fd);
      for (const std::string& e : env) putenv(const_cast<char*>(e.c_str()));
      std::vector<char*> argv{const_cast<char*>(program.c_str())};
      for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      execv(program.c_str(), argv.data());
      _exit(127);
    }
    ::close(in[0]);
    ::close(out[1]);
    ::close(err[1]);
    (void)!write(in[1], input.data(), input.size());
    ::close(in[1]);
    Result r;
    r.out = readAll(out[0]);
    r.err = readAll(err[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    return r;
  }
  std::string control(const std::string& commands) { return run({}, commands).out; }

  void startDaemon(const std::vector<std::string>& env = {}, const std::vector<std::string>& args = {"-d"}) {
    const Result r = run(args, "", env);
    ASSERT_EQ(r.rc, 0) << r.err;
    started_ = true;
    std::ifstream pf(pipe_ + "/nvidia-cuda-mps-control.pid");
    pf >> daemonPid_;
    ASSERT_GT(daemonPid_, 0);
  }

  // A client: this program again (or its staged copy, for another uid: see UserStage).
  Child& spawn(const std::vector<std::string>& env = {}, uid_t uid = 0, const std::string& exe = "/proc/self/exe") {
    int rep[2], ctl[2];
    EXPECT_EQ(pipe2(rep, O_CLOEXEC), 0);
    EXPECT_EQ(pipe2(ctl, O_CLOEXEC), 0);
    const pid_t pid = fork();
    if (pid == 0) {
      dup2(rep[1], kReportFd);
      dup2(ctl[0], kControlFd);
      for (const std::string& e : env) putenv(const_cast<char*>(e.c_str()));
      if (uid != 0 && (setgroups(0, nullptr) != 0 || setgid(uid) != 0 || setuid(uid) != 0)) _exit(126);
      execl(exe.c_str(), "mps_child", "--child", static_cast<char*>(nullptr));
      _exit(127);
    }
    ::close(rep[1]);
    ::close(ctl[0]);
    Child c;
    c.pid = pid;
    c.report = rep[0];
    c.control = ctl[1];
    children_.push_back(c);
    return children_.back();
  }

  // Starts program with args; its stdout is the report pipe, its stdin the command pipe.
  Child& spawnProgram(const std::string& program, const std::vector<std::string>& args,
                      const std::vector<std::string>& env = {}) {
    int rep[2], ctl[2];
    EXPECT_EQ(pipe2(rep, O_CLOEXEC), 0);
    EXPECT_EQ(pipe2(ctl, O_CLOEXEC), 0);
    std::vector<std::string> strs{program};
    strs.insert(strs.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (std::string& a : strs) argv.push_back(a.data());
    argv.push_back(nullptr);
    const pid_t pid = fork();
    if (pid == 0) {
      dup2(rep[1], 1);
      dup2(ctl[0], 0);
      for (const std::string& e : env) putenv(const_cast<char*>(e.c_str()));
      execv(argv[0], argv.data());
      _exit(127);
    }
    ::close(rep[1]);
    ::close(ctl[0]);
    Child c;
    c.pid = pid;
    c.report = rep[0];
    c.control = ctl[1];
    children_.push_back(c);
    return children_.back();
  }

  // The child's next report line ("" on timeout or EOF).
  static std::string line(Child& c, int ms = 10000) {
    for (;;) {
      const size_t nl = c.pending.find('\n');
      if (nl != std::string::npos) {
        std::string l = c.pending.substr(0, nl);
        c.pending.erase(0, nl + 1);
        return l;
      }
      pollfd p{c.report, POLLIN, 0};
      if (poll(&p, 1, ms) <= 0) return "";
      char b[256];
      const ssize_t n = read(c.report, b, sizeof b);
      if (n <= 0) return "";
      c.pending.append(b, static_cast<size_t>(n));
    }
  }
  static std::string ask(Child& c, const std::string& cmd) {
    const std::string l = cmd + "\n";
    (void)!write(c.control, l.data(), l.size());
    return line(c);
  }
  // Closes its command pipe (the child exits normally) and reaps it.
  static void stop(Child& c) {
    if (c.pid <= 0) return;
    ::close(c.control);
    ::close(c.report);
    int status;
    waitpid(c.pid, &status, 0);
    c.pid = -1;
  }

  std::string logText(const char* name) {
    std::ifstream f(log_ + "/" + name);
    std::stringstream s;
    s << f.rdbuf();
    return s.str();
  }
  bool logHas(const char* name, const std::string& text) { return logText(name).find(text) != std::string::npos; }
  // The one live server's pid (as get_server_list says).
  std::string serverPid() {
    std::string s = control("get_server_list");
    while (!s.empty() && s.back() == '\n') s.pop_back();
    return s;
  }
  // Device memory used on device 0 as simgpu counts it, read by a process that is not a client.
  uint64_t deviceUsed() {
    Child& o = spawn({"CUDA_MPS_PIPE_DIRECTORY=/nonexistent"});
    EXPECT_EQ(line(o), "attached 0 132");
    std::istringstream in(ask(o, "used"));
    std::string word;
    int r = -1;
    uint64_t used = 0;
    in >> word >> r >> used;
    EXPECT_EQ(r, 0);
    stop(o);
    return used;
  }

  // A daemon and two attached clients of its one server; returns the server's pid ("" on failure).
  std::tuple<std::string, Child*, Child*> daemonWithTwoClients() {
    startDaemon();
    Child* a = &spawn();
    Child* b = &spawn();
    const bool ok = line(*a) == "attached 0 132" && line(*b) == "attached 0 132";
    return {ok ? serverPid() : "", a, b};
  }
  // pid's entry in the host-wide client table (what the device-time engine reads).
  static const simgpu::MpsClientEntry* tableEntry(pid_t pid) {
    std::string err;
    static simgpu::MpsTable* t = simgpu::MpsTable::open(std::getenv("SIMGPU_STATE_DIR"), &err);
    EXPECT_NE(t, nullptr) << err;
    return t ? t->find(pid) : nullptr;
  }

  std::string root_, pipe_, log_;
  bool started_ = false;
  std::string controlPath_ = kBin + "/nvidia-cuda-mps-control";
  std::unique_ptr<cushare::test::UserStage> stage_;  // programs another uid runs (if any)
  pid_t daemonPid_ = 0;  // our descendant: this test is its subreaper
  std::vector<Child> children_;  // reserved so references stay valid
 public:
  Mps() { children_.reserve(128); }
};

// ---------------------------------------------------------------------------------------------
TEST_F(Mps, NoDaemonAnswersWithExitStatusOneAndProcessesAreNotClients) {
  const Result r = run({}, "get_server_list\n");
  EXPECT_EQ(r.rc, 1);
  EXPECT_EQ(r.err, "Cannot find MPS control daemon process\n");
  Child& c = spawn();
  EXPECT_EQ(line(c), "attached 0 132");  // a plain simgpu process: the whole device
}

TEST_F(Mps, ControlDaemonTranscript) {
  startDaemon();
  // The pid file holds the daemon's pid, a live process; a second daemon is refused.
  const pid_t daemonPid = daemonPid_;
  EXPECT_EQ(kill(daemonPid, 0), 0);
  const Result again = run({"-d"}, "");
  EXPECT_EQ(again.rc, 1);
  EXPECT_EQ(again.err, "An instance of this daemon is already running\n");

  // Commands one per line; the last one without its newline (as the k8s device plugin sends).
  const Result r = run({}, "get_default_active_thread_percentage\nset_default_active_thread_percentage 25\n"
                           "get_server_list\nset_default_device_pinned_mem_limit 0 10G\n"
                           "get_default_device_pinned_mem_limit 0\nset_default_device_pinned_mem_limit 0 1044M\n"
                           "get_default_device_pinned_mem_limit 0\nset_default_client_priority 1\n"
                           "get_default_client_priority\nget_default_active_thread_percentage");
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(r.out, "100.0\n25.0\n10G\n1G\n1\n25.0\n");  // get_server_list: empty, no server yet

  // The daemon logs the UI's hang-up once it sees it, maybe after the control client exited.
  ASSERT_TRUE(waitFor([&] { return logHas("control.log", "UI closed"); }));
  const std::string log = logText("control.log");
  const std::string prefix = "Control " + std::string(std::max<int>(0, 5 - static_cast<int>(std::to_string(daemonPid).size())), ' ') +
                             std::to_string(daemonPid) + "] ";
  for (const std::string& l :
       {"Starting control daemon using socket " + pipe_ + "/control",
        "To connect CUDA applications to this daemon, set env CUDA_MPS_PIPE_DIRECTORY=" + pipe_,
        std::string("Accepting connection..."), std::string("NEW UI"),
        std::string("Cmd:set_default_active_thread_percentage 25"), std::string("25.0"), std::string("UI closed")})
    EXPECT_NE(log.find(prefix + l + "\n"), std::string::npos) << l << "\n" << log;
  // set_default_device_pinned_mem_limit prints nothing: the next line is the next command.
  EXPECT_NE(log.find("Cmd:set_default_device_pinned_mem_limit 0 10G\n"), std::string::npos);
  EXPECT_NE(log.find("] Cmd:get_default_device_pinned_mem_limit 0\n"), std::string::npos);

  // quit: the daemon goes, its socket and pid file with it, and then nothing answers.
  EXPECT_EQ(run({}, "quit").rc, 0);
  int status = -1;
  ASSERT_EQ(waitpid(daemonPid, &status, 0), daemonPid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_NE(access((pipe_ + "/control").c_str(), F_OK), 0);
  EXPECT_NE(access((pipe_ + "/nvidia-cuda-mps-control.pid").c_str(), F_OK), 0);
  started_ = false;
  EXPECT_EQ(run({}, "get_server_list").rc, 1);
}

TEST_F(Mps, ForegroundDaemonAlsoLogsToStdout) {
  Result fg;
  std::thread daemon([&] { fg = runProgram(controlPath_, {"-f"}, "", {}); });
  EXPECT_TRUE(waitFor([&] { return run({}, "get_default_active_thread_percentage").out == "100.0\n"; }));
  EXPECT_EQ(run({}, "quit").rc, 0);
  daemon.join();
  EXPECT_EQ(fg.rc, 0);
  EXPECT_NE(fg.out.find("] Starting control daemon using socket " + pipe_ + "/control\n"), std::string::npos) << fg.out;
  EXPECT_NE(fg.out.find("] Cmd:get_default_active_thread_percentage\n"), std::string::npos) << fg.out;
  EXPECT_EQ(fg.out, logText("control.log"));
}

TEST_F(Mps, ClientsAttachToOneServerWithThePercentageCapInTheirAttribute) {
  startDaemon();
  control("set_default_active_thread_percentage 25");
  Child& a = spawn();
  // ceil(25 % x 132) = 33 SMs, rounded up to a TPC: 34.
  EXPECT_EQ(line(a), "attached 0 34");
  EXPECT_EQ(ask(a, "sms"), "sms 34 34");  // the attribute and the context's execution affinity
  const std::string srv = serverPid();
  ASSERT_FALSE(srv.empty());
  EXPECT_EQ(control("get_server_status " + srv), "ACTIVE\n");
  EXPECT_EQ(control("get_client_list " + srv), std::to_string(a.pid) + "\n");
  EXPECT_EQ(control("get_active_thread_percentage " + srv), "25.0\n");
  EXPECT_TRUE(logHas("control.log", "NEW CLIENT " + std::to_string(a.pid) +
                                        " from user 0: Server is not ready, push client to pending list"));
  EXPECT_TRUE(logHas("control.log", "Starting new server " + srv + " for user 0"));
  EXPECT_TRUE(logHas("control.log", "NEW SERVER " + srv + ": Ready"));
  // Log lines carry the pid as the real daemon's do, right-aligned in 5 columns.
  EXPECT_TRUE(waitFor([&] { return logHas("server.log", "Server " + std::string(srv.size() < 5 ? 5 - srv.size() : 0, ' ') + srv + "] Active Threads Percentage set to 25.0"); }));
  EXPECT_TRUE(waitFor([&] { return logHas("server.log", "Client {PID: " + std::to_string(a.pid) + ", Context ID: 0} connected"); }));

  // A new default is for the next server only; the running server's percentage is for its next
  // clients only; a client keeps what it got.
  control("set_default_active_thread_percentage 50");
  Child& b = spawn();
  EXPECT_EQ(line(b), "attached 0 34");
  EXPECT_TRUE(logHas("control.log", "NEW CLIENT " + std::to_string(b.pid) + " from user 0: Server already exists"));
  EXPECT_EQ(control("set_active_thread_percentage " + srv + " 10"), "10.0\n");
  Child& c = spawn();
  EXPECT_EQ(line(c), "attached 0 14");  // ceil(13.2) = 14
  EXPECT_EQ(ask(a, "sms"), "sms 34 34");

  // ps lists the clients with their server; the host-wide table says the same to the engine.
  const std::string ps = control("ps");
  EXPECT_EQ(ps.rfind("PID ID SERVER DEVICE NAMESPACE COMMAND\n", 0), 0u) << ps;
  EXPECT_NE(ps.find(std::to_string(c.pid) + " 2 " + srv + " GPU-"), std::string::npos) << ps;
  const simgpu::MpsClientEntry* e = tableEntry(c.pid);
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(std::to_string(e->server_pid), srv);
  EXPECT_EQ(e->sm_cap, 14u);
  EXPECT_EQ(e->thread_pct_x10, 100u);
  EXPECT_EQ(e->state.load(), simgpu::kMpsActive);
}

TEST_F(Mps, AnNvccBuiltProgramIsAClientThroughCudart) {
  startDaemon();
  control("set_default_active_thread_percentage 25\nset_default_device_pinned_mem_limit 0 1G");
  // cudaGetDeviceProperties, the attribute, then 768 MiB twice: the second is beyond 1 GiB.
  const Result r = runProgram(SIMGPU_MPS_CUDART_CLIENT, {std::to_string(768 * kMiB)}, "", {});
  EXPECT_EQ(r.out, "0 34 34 0 2\n") << r.err;  // 2: cudaErrorMemoryAllocation
  EXPECT_TRUE(waitFor([&] { return logHas("server.log", "disconnected"); }));
}

TEST_F(Mps, ClientEnvironmentOnlyLowersThePercentage) {
  startDaemon();
  control("set_default_active_thread_percentage 25");
  Child& low = spawn({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=10"});
  EXPECT_EQ(line(low), "attached 0 14");
  Child& high = spawn({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=80"});
  EXPECT_EQ(line(high), "attached 0 34");  // ineffective above the server's 25 %
  Child& bad = spawn({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=lots"});
  EXPECT_EQ(line(bad), "attached " + std::to_string(CUDA_ERROR_MPS_CONNECTION_FAILED) + " 132");
}

TEST_F(Mps, PinnedMemoryLimitIsOutOfMemoryOnTheDevicesCount) {
  startDaemon();
  control("set_default_device_pinned_mem_limit 0 1G");
  const uint64_t before = deviceUsed();
  Child& a = spawn();
  ASSERT_EQ(line(a), "attached 0 132");
  EXPECT_EQ(ask(a, "alloc " + std::to_string(768 * kMiB)), "alloc 0");
  EXPECT_EQ(ask(a, "alloc " + std::to_string(512 * kMiB)), "alloc 2");  // CUDA_ERROR_OUT_OF_MEMORY
  EXPECT_EQ(ask(a, "alloc " + std::to_string(256 * kMiB)), "alloc 0");  // exactly 1 GiB
  EXPECT_EQ(ask(a, "alloc 256"), "alloc 2");
  EXPECT_EQ(deviceUsed() - before, 1024 * kMiB);
  // The client's own limit lowers the server's; above it, it is ineffective.
  Child& low = spawn({"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=512M"});
  ASSERT_EQ(line(low), "attached 0 132");
  EXPECT_EQ(ask(low, "alloc " + std::to_string(768 * kMiB)), "alloc 2");
  EXPECT_EQ(ask(low, "alloc " + std::to_string(512 * kMiB)), "alloc 0");
  Child& high = spawn({"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4G"});
  ASSERT_EQ(line(high), "attached 0 132");
  EXPECT_EQ(ask(high, "alloc " + std::to_string(1536 * kMiB)), "alloc 2");
  EXPECT_EQ(deviceUsed() - before, 1536 * kMiB);
  // A per-server limit applies to that server's next clients, and may be higher.
  const std::string srv = serverPid();
  control("set_device_pinned_mem_limit " + srv + " 0 2G");
  EXPECT_EQ(control("get_device_pinned_mem_limit " + srv + " 0"), "2G\n");
  Child& next = spawn();
  ASSERT_EQ(line(next), "attached 0 132");
  EXPECT_EQ(ask(next, "alloc " + std::to_string(1536 * kMiB)), "alloc 0");
  // Shareable VMM memory counts against the same limit.
  EXPECT_EQ(ask(next, "vmm " + std::to_string(1024 * kMiB)), "vmm 2");
  EXPECT_EQ(ask(next, "vmm " + std::to_string(512 * kMiB)), "vmm 0");
  EXPECT_EQ(ask(next, "alloc 256"), "alloc 2");
  EXPECT_EQ(deviceUsed() - before, 3584 * kMiB);
}

TEST_F(Mps, FortyEightClientsAndNoMore) {
  startDaemon();
  std::vector<Child*> clients;
  for (int i = 0; i < 48; ++i) clients.push_back(&spawn());
  for (Child* c : clients) ASSERT_EQ(line(*c), "attached 0 132");
  Child& extra = spawn();
  EXPECT_EQ(line(extra), "attached " + std::to_string(CUDA_ERROR_MPS_MAX_CLIENTS_REACHED) + " 132");
  const std::string srv = serverPid();
  stop(*clients[0]);
  ASSERT_TRUE(waitFor([&] { return control("get_client_list " + srv).find(std::to_string(clients[0]->pid)) == std::string::npos; }));
  Child& again = spawn();
  EXPECT_EQ(line(again), "attached 0 132");
}

TEST_F(Mps, AClientFaultPutsTheServerInFaultUntilItsClientsExit) {
  const auto [srv, pa, pb] = daemonWithTwoClients();
  ASSERT_FALSE(srv.empty());
  Child &a = *pa, &b = *pb;
  EXPECT_EQ(ask(a, "fault"), "faulted");
  EXPECT_EQ(ask(a, "sync"), "sync " + std::to_string(CUDA_ERROR_ILLEGAL_ADDRESS));
  // The other client of the server gets the error too.
  ASSERT_TRUE(waitFor([&] { return ask(b, "sync") == "sync " + std::to_string(CUDA_ERROR_ILLEGAL_ADDRESS); }));
  EXPECT_EQ(control("get_server_status " + srv), "FAULT\n");
  Child& refused = spawn();
  EXPECT_EQ(line(refused), "attached " + std::to_string(CUDA_ERROR_MPS_SERVER_NOT_READY) + " 132");
  stop(a);
  stop(b);
  ASSERT_TRUE(waitFor([&] { return control("get_server_status " + srv) == "ACTIVE\n"; }));
  Child& c = spawn();
  EXPECT_EQ(line(c), "attached 0 132");
  EXPECT_EQ(ask(c, "sync"), "sync 0");
}

TEST_F(Mps, TerminateClientLeavesItTheStickyError) {
  const auto [srv, pa, pb] = daemonWithTwoClients();
  ASSERT_FALSE(srv.empty());
  Child &a = *pa, &b = *pb;
  EXPECT_EQ(control("terminate_client " + srv + " " + std::to_string(a.pid)), "0\n");
  EXPECT_EQ(ask(a, "sync"), "sync " + std::to_string(CUDA_ERROR_MPS_CLIENT_TERMINATED));
  EXPECT_EQ(ask(a, "alloc 256"), "alloc " + std::to_string(CUDA_ERROR_MPS_CLIENT_TERMINATED));
  EXPECT_EQ(ask(b, "sync"), "sync 0");  // the others are untouched
  ASSERT_NE(tableEntry(a.pid), nullptr);
  EXPECT_EQ(tableEntry(a.pid)->state.load(), simgpu::kMpsTerminated);
  EXPECT_EQ(control("terminate_client " + srv + " 1"), "Client 1 not found\n");
}

TEST_F(Mps, AKilledClientIsReapedAndItsMemoryReturned) {
  startDaemon();
  const uint64_t before = deviceUsed();
  Child& a = spawn();
  ASSERT_EQ(line(a), "attached 0 132");
  EXPECT_EQ(ask(a, "alloc " + std::to_string(256 * kMiB)), "alloc 0");
  const std::string srv = serverPid();
  const pid_t pid = a.pid;
  kill(pid, SIGKILL);
  stop(a);
  ASSERT_TRUE(waitFor([&] { return control("get_client_list " + srv).empty(); }));
  EXPECT_TRUE(waitFor([&] { return logHas("server.log", "Client {PID: " + std::to_string(pid) + ", Context ID: 0} disconnected"); }));
  EXPECT_EQ(deviceUsed(), before);
  Child& b = spawn();
  EXPECT_EQ(line(b), "attached 0 132");  // the server goes on
  EXPECT_EQ(serverPid(), srv);
}

TEST_F(Mps, TheServerTakesOnlyItsAdmittedClientsOnItsSocket) {
  startDaemon();
  Child& a = spawn();
  ASSERT_EQ(line(a), "attached 0 132");
  const std::string srv = serverPid();
  ASSERT_FALSE(srv.empty());
  // This test process was never admitted: the server's socket (mode 0666) hangs up on it.
  const std::string path = pipe_ + "/mps-server-" + srv;
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0) << path;
  char b[64];
  EXPECT_EQ(recv(fd, b, sizeof b, 0), 0) << "refused: the connection is closed";
  ::close(fd);
  EXPECT_TRUE(waitFor([&] { return logHas("server.log", "Refused a connection from PID " + std::to_string(getpid())); }));
  EXPECT_EQ(ask(a, "sync"), "sync 0");  // the client goes on
}

TEST_F(Mps, AServerThatCannotStartRefusesItsClientsInsteadOfRespawning) {
  // The daemon alone, without the server binary beside it.
  controlPath_ = root_ + "/nvidia-cuda-mps-control";
  ASSERT_EQ(system(("cp " + kBin + "/nvidia-cuda-mps-control " + controlPath_).c_str()), 0);
  startDaemon();
  Child& a = spawn();
  EXPECT_EQ(line(a), "attached " + std::to_string(CUDA_ERROR_MPS_CONNECTION_FAILED) + " 132");
  EXPECT_TRUE(waitFor([&] { return logHas("control.log", "failed to start"); }));
  EXPECT_EQ(serverPid(), "");
}

TEST_F(Mps, AClientOfAnotherUserWaitsUntilTheServersClientsExit) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a client as uid 1000";
  // uid 1000 runs the client and its server: both from a stage it can read, since the checkout
  // may lie where it cannot enter (a 0700 directory); the daemon too, which starts the server
  // from beside itself.
  stage_ = std::make_unique<cushare::test::UserStage>();  // kept until TearDown has quit the daemon
  const std::string lib = stage_->copy(std::filesystem::path(kBin).parent_path().string(), "simgpu");
  const std::string exe = stage_->copy("/proc/self/exe", "mps_child");
  const std::string libPath = "LD_LIBRARY_PATH=" + lib;
  controlPath_ = lib + "/bin/nvidia-cuda-mps-control";
  startDaemon({libPath});
  Child& root = spawn({libPath});
  ASSERT_EQ(line(root), "attached 0 132");
  const char* state = std::getenv("SIMGPU_STATE_DIR");
  ASSERT_TRUE(state == nullptr || cushare::test::UserStage::reachable(std::string(state) + "/.", 1000))
      << "uid 1000 cannot reach the simulated host's state " << state << " (a directory on its way is private)";
  ASSERT_TRUE(cushare::test::UserStage::reachable(pipe_ + "/.", 1000)) << "uid 1000 cannot reach " << pipe_;
  const std::string first = serverPid();
  Child& user = spawn({libPath}, 1000, exe);
  EXPECT_TRUE(waitFor([&] {
    return logHas("control.log", "NEW CLIENT " + std::to_string(user.pid) +
                                     " from user 1000: Server is not ready, push client to pending list");
  }));
  EXPECT_EQ(line(user, 200), "");  // pending: cuInit has not returned
  stop(root);
  EXPECT_EQ(line(user), "attached 0 132");
  EXPECT_TRUE(waitFor([&] { return logHas("control.log", "Server " + first + " exited with status 0"); }));
  const std::string second = serverPid();
  EXPECT_NE(second, first);
  EXPECT_TRUE(logHas("control.log", "Starting new server " + second + " for user 1000"));
  EXPECT_EQ(control("get_client_list " + second), std::to_string(user.pid) + "\n");
}

// -multiuser-server: one server, of the daemon's user, takes clients of every uid at once (no
// client waits for another uid's clients to exit, as above).
TEST_F(Mps, AMultiuserServerTakesClientsOfEveryUidAtOnce) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a client as uid 1000";
  stage_ = std::make_unique<cushare::test::UserStage>();
  const std::string lib = stage_->copy(std::filesystem::path(kBin).parent_path().string(), "simgpu");
  const std::string exe = stage_->copy("/proc/self/exe", "mps_child");
  const std::string libPath = "LD_LIBRARY_PATH=" + lib;
  controlPath_ = lib + "/bin/nvidia-cuda-mps-control";
  startDaemon({libPath}, {"-d", "-multiuser-server"});
  Child& root = spawn({libPath});
  ASSERT_EQ(line(root), "attached 0 132");
  const std::string server = serverPid();
  Child& user = spawn({libPath}, 1000, exe);
  EXPECT_EQ(line(user), "attached 0 132") << "uid 1000 does not wait for root's client";
  EXPECT_EQ(ask(user, "sync"), "sync 0");
  EXPECT_EQ(serverPid(), server) << "the same server";
  const std::string clients = control("get_client_list " + server);
  EXPECT_NE(clients.find(std::to_string(root.pid)), std::string::npos) << clients;
  EXPECT_NE(clients.find(std::to_string(user.pid)), std::string::npos) << clients;
  EXPECT_TRUE(logHas("control.log", "Starting new server " + server + " for user 0"));
  EXPECT_TRUE(logHas("control.log", "NEW CLIENT " + std::to_string(user.pid) + " from user 1000: Server already exists"));
  // Without the option the daemon keeps its usage line: a wrong flag is refused.
  EXPECT_NE(run({"-d", "-multiuser"}, "").rc, 0);
}

// ---------------------------------------------------------------------------------------------
// Device time under MPS: nvcc-built programs (mps_hog.cu) as clients, judged by simgpu's ground
// truth: the device's time-slice board, where the server publishes its own slot (one context to
// the slicer) and what its engine gave each client (timeslice_board.h).
constexpr long long kBlockNs = 1'000'000;  // each mps_hog block: 1 ms (mps.costs reads the parameter)
constexpr int kSms = 132;
constexpr int kBlocksPerSm = 2;  // blocks of 1024 threads

uint64_t deviceNow() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());  // SIMGPU_TIME_SCALE is 1 in these tests
}

struct Snapshot {
  uint64_t t = 0;
  std::map<int32_t, simgpu::ProcessDeviceStats> procs;
  uint64_t switches = 0;
};

simgpu::Board* board() {
  std::string err;
  static simgpu::Board* b = simgpu::openBoard(std::getenv("SIMGPU_STATE_DIR"), 0, &err);
  EXPECT_NE(b, nullptr) << err;
  return b;
}

Snapshot snapshot() {
  Snapshot s;
  s.t = deviceNow();
  if (simgpu::Board* b = board()) {
    simgpu::forEachProcess(*b, [&](const simgpu::ProcessDeviceStats& p) { s.procs[p.pid] = p; });
    s.switches = b->switches.load();
  }
  return s;
}

// What pid got between two snapshots.
struct Delta {
  double busy = 0;      // fraction of the window with its blocks running
  double smShare = 0;   // SM-time, in SMs on average
  double smEquiv = 0;   // throughput: blocks run x block time / blocks per SM / window, in SMs
  double slicedOut = 0;  // fraction of the window it waited for another process's slice
  uint64_t blocks = 0;
  uint64_t busyNs = 0;        // time with its blocks running...
  uint64_t from = 0, to = 0;  // ...between these device times (its engine's publications)
};
Delta delta(const Snapshot& a, const Snapshot& b, int32_t pid) {
  Delta d;
  auto x = a.procs.find(pid), y = b.procs.find(pid);
  EXPECT_TRUE(x != a.procs.end() && y != b.procs.end()) << "pid " << pid << " is not on the board";
  if (x == a.procs.end() || y == b.procs.end()) return d;
  // The window is the engine's own: its device time at each of the two publications read.
  const double w = static_cast<double>(y->second.updatedNs - x->second.updatedNs);
  if (w <= 0) return d;
  d.busyNs = y->second.busyNs - x->second.busyNs;
  d.from = x->second.updatedNs;
  d.to = y->second.updatedNs;
  d.busy = (y->second.busyNs - x->second.busyNs) / w;
  d.smShare = (y->second.busySmNs - x->second.busySmNs) / w;
  d.blocks = y->second.blocksRun - x->second.blocksRun;
  d.smEquiv = static_cast<double>(d.blocks) * kBlockNs / kBlocksPerSm / w;
  d.slicedOut = (y->second.slicedOutNs - x->second.slicedOutNs) / w;
  return d;
}

class MpsTime : public Mps {
 protected:
  void SetUp() override {
    Mps::SetUp();
    if (!std::getenv("SIMGPU_KERNEL_COSTS")) GTEST_SKIP() << "registered with SIMGPU_KERNEL_COSTS=mps.costs";
  }
  // A client (or, with CUDA_MPS_PIPE_DIRECTORY elsewhere, a plain process) keeping the device busy
  // with kernels of `blocks` blocks of 1024 threads on two streams.
  Child& hog(const std::vector<std::string>& env, int blocks = 1320, long long ns = kBlockNs) {
    return spawnProgram(SIMGPU_MPS_HOG, {"loop", std::to_string(blocks), "1024", std::to_string(ns), "2"}, env);
  }
  // Waits until the hog runs; its "ready" line says the multiprocessor count it sees.
  static int running(Child& c) {
    const std::string ready = line(c);
    EXPECT_EQ(ready.rfind("ready ", 0), 0u) << ready;
    EXPECT_EQ(line(c), "running");
    return ready.size() > 6 ? std::atoi(ready.c_str() + 6) : -1;
  }
  // Stops a hog; its "done" line's status.
  static long long finish(Child& c) {
    (void)!write(c.control, "s", 1);
    const std::string done = line(c, 20000);
    EXPECT_EQ(done.rfind("done ", 0), 0u) << done;
    stop(c);
    std::istringstream in(done);
    std::string word;
    long long kernels = 0, status = -1;
    in >> word >> kernels >> status;
    return status;
  }
  // Two snapshots `ms` apart, taken once the hogs have run for a moment.
  static std::pair<Snapshot, Snapshot> window(int ms = 300) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the hogs' queues fill
    Snapshot a = snapshot();
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));  // the measured window
    return {a, snapshot()};
  }
  // A window in which every one of `pids` had work all the time (busy >= 0.9): the precondition
  // of a share measurement. A loaded host can starve a hog of CPU so that its queue runs dry for a
  // while (not what is measured): then the window is taken again, up to 5 times.
  // (With time slicing, "had work" is busy or sliced out: wanting = true.)
  static std::pair<Snapshot, Snapshot> busyWindow(const std::vector<pid_t>& pids, int ms = 300, bool wanting = false) {
    std::pair<Snapshot, Snapshot> w;
    for (int attempt = 0; attempt < 5; ++attempt) {
      w = window(ms);
      bool busy = true;
      for (pid_t p : pids) {
        const Delta d = delta(w.first, w.second, p);
        busy = busy && d.busy + (wanting ? d.slicedOut : 0) >= 0.9;
      }
      if (busy) break;
      std::printf("a hog was starved of CPU in this window: measuring again\n");
    }
    return w;
  }
  int32_t server() { return std::atoi(serverPid().c_str()); }
  // Runs one of perf/gpu_check.sh's probes; its output.
  static std::string runProbe(const std::string& name, const std::vector<std::string>& args,
                              const std::vector<std::string>& env) {
    const Result r = runProgram(std::string(SIMGPU_PROBES) + "/" + name, args, "", env);
    EXPECT_EQ(r.rc, 0) << r.err;
    return r.out;
  }
};

// ---------------------------------------------------------------------------------------------
// MPS inside MIG devices (docs/simgpu.md, "MIG"; the MIG guide's "MIG with CUDA MPS"): one control
// daemon per MIG device, started with CUDA_VISIBLE_DEVICES naming it; its server runs its clients
// side by side on that compute instance's SMs (thread percentages of its SM count), on the
// instance's own time-slice board, while another MIG device runs apart; a client of another MIG
// device is refused. On simgpu's H100 (ctest simgpu_mps_mig_test_time): a 3g.40gb (60 SMs) and a
// 1g.10gb (16 SMs) on GPU 0.
class MpsMigTime : public MpsTime {
 protected:
  struct Place {
    std::string uuid;
    int board = 0;
  };
  void SetUp() override {
    MpsTime::SetUp();
    if (IsSkipped()) return;
    if (!std::getenv("SIMGPU_GPU_MODEL")) GTEST_SKIP() << "registered with SIMGPU_GPU_MODEL=h100-80gb";
    ASSERT_EQ(nvmlInit_v2(), NVML_SUCCESS);
    ASSERT_EQ(nvmlDeviceGetHandleByIndex_v2(0, &gpu_), NVML_SUCCESS);
    nvmlReturn_t act;
    ASSERT_EQ(nvmlDeviceSetMigMode(gpu_, NVML_DEVICE_MIG_ENABLE, &act), NVML_SUCCESS);
    migOn_ = true;
    ASSERT_EQ(nvmlDeviceCreateGpuInstance(gpu_, 9, &g3_), NVML_SUCCESS);  // 3g.40gb
    ASSERT_EQ(nvmlGpuInstanceCreateComputeInstance(g3_, NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE, &c3_), NVML_SUCCESS);
    ASSERT_EQ(nvmlDeviceCreateGpuInstance(gpu_, 19, &g1_), NVML_SUCCESS);  // 1g.10gb
    ASSERT_EQ(nvmlGpuInstanceCreateComputeInstance(g1_, NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, &c1_), NVML_SUCCESS);
    big_ = place(g3_, c3_);
    small_ = place(g1_, c1_);
  }
  void TearDown() override {
    MpsTime::TearDown();  // clients and the daemon first: instances in use cannot be destroyed
    for (nvmlComputeInstance_t c : {c3_, c1_})
      if (c) EXPECT_EQ(nvmlComputeInstanceDestroy(c), NVML_SUCCESS);
    for (nvmlGpuInstance_t g : {g3_, g1_})
      if (g) EXPECT_EQ(nvmlGpuInstanceDestroy(g), NVML_SUCCESS);
    nvmlReturn_t act;
    if (migOn_) EXPECT_EQ(nvmlDeviceSetMigMode(gpu_, NVML_DEVICE_MIG_DISABLE, &act), NVML_SUCCESS);
    if (gpu_) nvmlShutdown();
  }
  static Place place(nvmlGpuInstance_t g, nvmlComputeInstance_t c) {
    nvmlGpuInstanceInfo_t gi{};
    nvmlComputeInstanceInfo_t ci{};
    EXPECT_EQ(nvmlGpuInstanceGetInfo(g, &gi), NVML_SUCCESS);
    EXPECT_EQ(nvmlComputeInstanceGetInfo_v2(c, &ci), NVML_SUCCESS);
    return {simgpu::mig::migUuid(0, gi.id, ci.id), simgpu::mig::migBoard(0, gi.id, ci.id)};
  }
  // Two snapshots of a MIG device's board `ms` apart, in which every one of pids was busy (up to
  // five tries, as busyWindow).
  static std::pair<Snapshot, Snapshot> busyWindowOn(int boardId, const std::vector<pid_t>& pids, int ms = 300) {
    std::string err;
    simgpu::Board* b = simgpu::openBoard(std::getenv("SIMGPU_STATE_DIR"), boardId, &err);
    EXPECT_NE(b, nullptr) << err;
    auto snap = [b] {
      Snapshot s;
      s.t = deviceNow();
      if (b) simgpu::forEachProcess(*b, [&](const simgpu::ProcessDeviceStats& p) { s.procs[p.pid] = p; });
      return s;
    };
    std::pair<Snapshot, Snapshot> w;
    for (int attempt = 0; attempt < 5; ++attempt) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      w.first = snap();
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
      w.second = snap();
      bool busy = true;
      for (pid_t p : pids) busy = busy && delta(w.first, w.second, p).busy >= 0.9;
      if (busy) break;
      std::printf("a hog was starved of CPU in this window: measuring again\n");
    }
    return w;
  }
  nvmlDevice_t gpu_ = nullptr;
  bool migOn_ = false;
  nvmlGpuInstance_t g3_ = nullptr, g1_ = nullptr;
  nvmlComputeInstance_t c3_ = nullptr, c1_ = nullptr;
  Place big_, small_;
};

TEST_F(MpsMigTime, AServerPerMigDeviceRunsItsClientsSideBySideOnItsSms) {
  startDaemon({"CUDA_VISIBLE_DEVICES=" + big_.uuid});
  Child& a = hog({"CUDA_VISIBLE_DEVICES=" + big_.uuid, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30"});
  Child& b = hog({"CUDA_VISIBLE_DEVICES=" + big_.uuid, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=70"});
  EXPECT_EQ(running(a), 18);  // 30 % of the 3g's 60 SMs
  EXPECT_EQ(running(b), 42);
  // The 1g beside it, without MPS (no daemon answers at its pipe directory): apart, all its own.
  Child& c = hog({"CUDA_VISIBLE_DEVICES=" + small_.uuid, "CUDA_MPS_PIPE_DIRECTORY=" + root_ + "/no-daemon"});
  EXPECT_EQ(running(c), 16);
  const int32_t srv = server();
  const auto [s0, s1] = busyWindowOn(big_.board, {a.pid, b.pid});
  const Delta da = delta(s0, s1, a.pid), db = delta(s0, s1, b.pid), ds = delta(s0, s1, srv);
  std::printf("3g.40gb under MPS: 30%%: busy %.2f, %.1f SMs; 70%%: busy %.2f, %.1f SMs; server %.1f SMs\n", da.busy,
              da.smShare, db.busy, db.smShare, ds.smShare);
  EXPECT_GT(da.busy, 0.9);
  EXPECT_GT(db.busy, 0.9);
  EXPECT_LT(da.slicedOut + db.slicedOut, 0.01) << "side by side, not sliced";
  EXPECT_NEAR(da.smShare / (da.smShare + db.smShare), 0.30, 0.03);
  EXPECT_LE(da.smShare, 18.5);
  EXPECT_LE(ds.smShare, 60.5) << "the instance's SMs, not the GPU's 132";
  const auto [t0, t1] = busyWindowOn(small_.board, {c.pid});
  const Delta dc = delta(t0, t1, c.pid);
  EXPECT_GT(dc.busy, 0.9) << "the 1g runs apart";
  EXPECT_LE(dc.smShare, 16.5);
  // A process of the 1g sent to the 3g's daemon: that server refuses it (one per MIG device).
  Child& d = hog({"CUDA_VISIBLE_DEVICES=" + small_.uuid});
  // cudart's first call fails (it reports the driver's CUDA_ERROR_MPS_CONNECTION_FAILED at its
  // initialisation as cudaErrorInitializationError); admitted, it would say "ready 16".
  const std::string ready = line(d);
  EXPECT_TRUE(ready.starts_with("ready -")) << ready;
  ASSERT_TRUE(waitFor([&] { return logHas("server.log", "refused: it runs in another MIG device"); }))
      << logText("server.log");
  const std::string log = logText("server.log");
  EXPECT_NE(log.find("this server in MIG device " + big_.uuid), std::string::npos) << log;
  EXPECT_NE(log.find("Creating server context on MIG device " + big_.uuid + " (NVIDIA H100 80GB HBM3 MIG 3g.40gb)"),
            std::string::npos)
      << log;
  EXPECT_EQ(finish(a), 0);
  EXPECT_EQ(finish(b), 0);
  EXPECT_EQ(finish(c), 0);
}

TEST_F(MpsTime, ClientsAt30And70PercentRunSideBySideAndShareTheSmsBySMCap) {
  startDaemon();
  Child& a = hog({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30"});
  Child& b = hog({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=70"});
  EXPECT_EQ(running(a), 40);  // ceil(39.6) = 40
  EXPECT_EQ(running(b), 94);  // ceil(92.4) = 93, a pair: 94
  const int32_t srv = server();
  ASSERT_EQ(nvmlInit_v2(), NVML_SUCCESS);
  nvmlDevice_t dev;
  ASSERT_EQ(nvmlDeviceGetHandleByIndex_v2(0, &dev), NVML_SUCCESS);
  nvmlProcessUtilizationSample_t samples[16];
  unsigned n = 16;
  ASSERT_EQ(nvmlDeviceGetProcessUtilization(dev, samples, &n, 0), NVML_SUCCESS);  // the period starts
  const auto [s0, s1] = busyWindow({a.pid, b.pid});
  const Delta da = delta(s0, s1, a.pid), db = delta(s0, s1, b.pid), ds = delta(s0, s1, srv);
  std::printf("30%%: busy %.2f, %.1f SMs, %.1f SM-equivalents; 70%%: busy %.2f, %.1f SMs, %.1f; server %.1f SMs\n",
              da.busy, da.smShare, da.smEquiv, db.busy, db.smShare, db.smEquiv, ds.smShare);
  // Side by side: each is busy all the time, nobody is sliced out, together they fill the device.
  EXPECT_GT(da.busy, 0.9);
  EXPECT_GT(db.busy, 0.9);
  EXPECT_LT(da.slicedOut + db.slicedOut, 0.01);
  EXPECT_GT(ds.smShare, 0.9 * kSms);
  EXPECT_GT(da.smEquiv + db.smEquiv, 0.85 * kSms) << "the whole device's throughput";
  // Shares by SM cap: 40 and 94 SMs of 132 (two contended): about 30/70.
  const double share = da.smShare / (da.smShare + db.smShare);
  EXPECT_NEAR(share, 0.30, 0.03);
  EXPECT_NEAR(da.smEquiv / (da.smEquiv + db.smEquiv), 0.30, 0.04);
  EXPECT_LE(da.smShare, 40.5);
  EXPECT_LE(db.smShare, 94.5);

  // The same ground truth for scripts and NVML: per client, the server apart.
  FILE* smi = popen(SIMGPU_SMI " --json", "r");
  ASSERT_TRUE(smi);
  char buf[16384] = {};
  const std::string json(buf, fread(buf, 1, sizeof buf - 1, smi));
  pclose(smi);
  for (pid_t p : {a.pid, b.pid})
    EXPECT_NE(json.find("{\"pid\": " + std::to_string(p) + ", "), std::string::npos) << json;
  EXPECT_NE(json.find("\"mps\": \"client\", \"server\": " + std::to_string(srv) + "}"), std::string::npos) << json;
  EXPECT_NE(json.find("{\"pid\": " + std::to_string(srv) + ", "), std::string::npos) << json;
  EXPECT_NE(json.find("\"mps\": \"server\"}"), std::string::npos) << json;
  n = 16;
  ASSERT_EQ(nvmlDeviceGetProcessUtilization(dev, samples, &n, 0), NVML_SUCCESS);
  std::map<unsigned, unsigned> util;
  for (unsigned i = 0; i < n; ++i) util[samples[i].pid] = samples[i].smUtil;
  EXPECT_GT(util[static_cast<unsigned>(a.pid)], 80u) << "busy all the time since the previous sample";
  EXPECT_GT(util[static_cast<unsigned>(b.pid)], 80u);
  EXPECT_EQ(util.count(static_cast<unsigned>(srv)), 0u) << "the server is its clients, not a process of its own";
  nvmlShutdown();
  EXPECT_EQ(finish(a), 0);
  EXPECT_EQ(finish(b), 0);
}

TEST_F(MpsTime, AClientAt25PercentGetsAQuarterOfTheSms) {
  startDaemon();
  control("set_default_active_thread_percentage 25");
  Child& a = hog({});
  EXPECT_EQ(running(a), 34);
  const auto [s0, s1] = busyWindow({a.pid});
  const Delta d = delta(s0, s1, a.pid);
  std::printf("25%%: busy %.2f, %.1f SMs, %.1f SM-equivalents\n", d.busy, d.smShare, d.smEquiv);
  EXPECT_GT(d.busy, 0.9);
  EXPECT_NEAR(d.smShare / d.busy, 34, 0.5);  // all of its cap, never more
  EXPECT_NEAR(d.smEquiv / d.busy, 34, 34 * 0.1);
  EXPECT_EQ(finish(a), 0);
}

TEST_F(MpsTime, TwoClientsAt100PercentShareTheSmsNotDoubleTheDevice) {
  startDaemon();
  Child& a = hog({});
  Child& b = hog({});
  EXPECT_EQ(running(a), kSms);
  EXPECT_EQ(running(b), kSms);
  const auto [s0, s1] = busyWindow({a.pid, b.pid});
  const Delta da = delta(s0, s1, a.pid), db = delta(s0, s1, b.pid);
  std::printf("100%% + 100%%: %.1f and %.1f SM-equivalents\n", da.smEquiv, db.smEquiv);
  EXPECT_NEAR(da.smEquiv + db.smEquiv, kSms, kSms * 0.1) << "one device's throughput between them";
  EXPECT_NEAR(da.smEquiv / (da.smEquiv + db.smEquiv), 0.5, 0.15);
  EXPECT_EQ(finish(a), 0);
  EXPECT_EQ(finish(b), 0);
}

// A normal client's kernel arrives while a client keeps the device full of waiting blocks: below
// normal, that client's waiting blocks go after it (it runs in the next wave); normal, before.
TEST_F(MpsTime, ClientPriorityOrdersWaitingBlocks) {
  startDaemon();
  auto elapsedWith = [&](const char* hogPriority) {
    Child& h = hog({std::string("CUDA_MPS_CLIENT_PRIORITY=") + hogPriority}, 13200);  // 50 waves a kernel
    running(h);
    Child& n = spawnProgram(SIMGPU_MPS_HOG, {"once", "264", "1024", std::to_string(kBlockNs)}, {"CUDA_MPS_CLIENT_PRIORITY=0"});
    EXPECT_EQ(line(n), "ready " + std::to_string(kSms));
    (void)!write(n.control, "go\n", 3);
    const std::string e = line(n, 20000);
    EXPECT_EQ(e.rfind("elapsed ", 0), 0u) << e;
    stop(n);
    EXPECT_EQ(finish(h), 0);
    return std::atoll(e.c_str() + 8);
  };
  const long long below = elapsedWith("1"), normal = elapsedWith("0");
  std::printf("a one-wave kernel beside a full device: %lld us (other client below normal), %lld us (normal)\n",
              below, normal);
  // Below normal: at most one running wave (1 ms) to wait, then its own wave: about 2 ms, and
  // up to 20 ms for a host that delays the kernel on its way to the server. Normal: behind the
  // other client's queued kernels, at least 100 ms of waves.
  EXPECT_LT(below, 20000);
  EXPECT_GT(normal, 40000);
}

TEST_F(MpsTime, TheServerTakesTurnsWithAProcessOutsideMpsAsOneContext) {
  startDaemon();
  Child& a = hog({});
  Child& b = hog({});
  Child& plain = hog({"CUDA_MPS_PIPE_DIRECTORY=/nonexistent"});
  running(a);
  running(b);
  running(plain);
  const int32_t srv = server();
  const auto [s0, s1] = busyWindow({srv, plain.pid}, 400, true);
  const Delta ds = delta(s0, s1, srv), dp = delta(s0, s1, plain.pid), da = delta(s0, s1, a.pid);
  std::printf("server busy %.2f sliced out %.2f; plain process busy %.2f sliced out %.2f; %llu switches\n", ds.busy,
              ds.slicedOut, dp.busy, dp.slicedOut, static_cast<unsigned long long>(s1.switches - s0.switches));
  // Never side by side: their busy times fit in the span of both windows together.
  EXPECT_LE(ds.busyNs + dp.busyNs, std::max(ds.to, dp.to) - std::min(ds.from, dp.from)) << "never side by side";
  EXPECT_GT(ds.busy, 0.2);
  EXPECT_GT(dp.busy, 0.2);
  EXPECT_GT(ds.slicedOut, 0.2);
  EXPECT_GT(dp.slicedOut, 0.2);
  EXPECT_GT(da.slicedOut, 0.2) << "a client waits while its server is sliced out";
  // They took turns (about 100 switches when the host keeps up; the slice length itself is
  // measured by GpuCheckProbeReadsTheSliceLengthAndSwitchCost).
  EXPECT_GE(s1.switches - s0.switches, 2u);
  EXPECT_EQ(finish(a), 0);
  EXPECT_EQ(finish(b), 0);
  EXPECT_EQ(finish(plain), 0);
}

TEST_F(MpsTime, AClientKilledMidKernelLeavesTheOthersAndTheServerRunning) {
  startDaemon();
  Child& a = hog({}, 2640);
  Child& b = hog({}, 2640);
  running(a);
  running(b);
  const int32_t srv = server();
  kill(a.pid, SIGKILL);
  stop(a);
  ASSERT_TRUE(waitFor([&] { return snapshot().procs.count(a.pid) == 0; })) << "its statistics stay published";
  const auto [s0, s1] = window(200);
  const Delta db = delta(s0, s1, b.pid), ds = delta(s0, s1, srv);
  EXPECT_GT(db.blocks, 0u) << "the other client goes on";
  EXPECT_NEAR(ds.smShare, db.smShare, 1) << "the killed client's waiting work was dropped";
  EXPECT_EQ(server(), srv);
  EXPECT_EQ(kill(srv, 0), 0);
  EXPECT_EQ(finish(b), 0);
  Child& c = hog({});
  running(c);
  EXPECT_EQ(finish(c), 0);
}

TEST_F(MpsTime, TerminateClientDropsItsQueuedWork) {
  startDaemon();
  Child& a = hog({}, 2640, 50 * kBlockNs);  // 10 waves of 50 ms a kernel: 2 s of work queued
  running(a);
  const int32_t srv = server();
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(control("terminate_client " + std::to_string(srv) + " " + std::to_string(a.pid)), "0\n");
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(1000));
  const std::string done = line(a);
  EXPECT_EQ(done.rfind("done ", 0), 0u) << done;
  EXPECT_NE(done.find(" " + std::to_string(CUDA_ERROR_MPS_CLIENT_TERMINATED)), std::string::npos) << done;
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // its running blocks end (50 ms)
  const auto [s0, s1] = window(300);
  EXPECT_EQ(delta(s0, s1, srv).blocks, 0u) << "nothing of its queued work ran";
  EXPECT_EQ(delta(s0, s1, a.pid).blocks, 0u);
  stop(a);
}

TEST_F(MpsTime, KillingTheServerFailsItsClientsWithAStickyError) {
  startDaemon();
  Child& a = hog({}, 2640);
  running(a);
  const int32_t srv = server();
  ASSERT_GT(srv, 0);
  kill(srv, SIGKILL);
  const std::string done = line(a, 5000);  // no hang
  EXPECT_EQ(done, "done " + done.substr(5, done.find(' ', 5) - 5) + " " + std::to_string(CUDA_ERROR_MPS_RPC_FAILURE)) << done;
  stop(a);
  EXPECT_TRUE(waitFor([&] { return logHas("control.log", "Server " + std::to_string(srv) + " exited with status 137"); }));
}

// The probes perf/gpu_check.sh runs on a real GPU to fit simgpu's guessed constants, run here on
// simgpu so that they are known to work and to read simgpu's own constants back.
double field(const std::string& line, const std::string& key) {
  const size_t at = line.find(" " + key + "=");
  return at == std::string::npos ? -1 : std::atof(line.c_str() + at + key.size() + 2);
}

TEST_F(MpsTime, GpuCheckProbeReadsTheSliceLengthAndSwitchCost) {
  // Two plain processes at once, 4 ms slices, 100 us switches, kernels of 500 us.
  const std::vector<std::string> env{"CUDA_MPS_PIPE_DIRECTORY=/nonexistent", "SIMGPU_TIME_SLICE_US=4000",
                                     "SIMGPU_SWITCH_US=100"};
  std::string other;
  std::thread t([&] { other = runProbe("timeslice_probe", {"1", "500"}, env); });
  const std::string mine = runProbe("timeslice_probe", {"1", "500"}, env);
  t.join();
  std::printf("%s%s", mine.c_str(), other.c_str());
  for (const std::string& l : {mine, other}) {
    EXPECT_GE(field(l, "runs"), 20) << l;
    EXPECT_NEAR(field(l, "slice_us"), 4000, 600) << l;  // whole kernels: a slice holds 8
    EXPECT_GE(field(l, "gap_us"), 3500) << l;          // the other's slice and the switches
  }
}

TEST_F(MpsTime, GpuCheckProbeReadsTheEventResolution) {
  const std::string out = runProbe("event_resolution", {}, {"CUDA_MPS_PIPE_DIRECTORY=/nonexistent"});
  EXPECT_EQ(out.rfind("events resolution_us=0.500 min_us=", 0), 0u) << out;  // elapsed times in 0.5 us steps
  EXPECT_GE(field(out, "min_us"), 0) << out;  // the kernel, plus the host's time to launch it
}

TEST_F(MpsTime, GpuCheckProbeReadsThePercentageToSmRule) {
  startDaemon();
  for (const auto& [pct, sms] : std::vector<std::pair<std::string, int>>{{"1", 2}, {"10", 14}, {"25", 34}, {"33.3", 44}, {"50", 66}, {"100", 132}})
    EXPECT_EQ(runProbe("mps_sm_probe", {}, {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=" + pct}),
              "sms attribute=" + std::to_string(sms) + " properties=" + std::to_string(sms) + "\n")
        << pct << " %";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 2 && std::strcmp(argv[1], "--child") == 0) return childMain();
  // The daemon detaches (-d) from its starter; as its subreaper this test reaps it when it quits.
  prctl(PR_SET_CHILD_SUBREAPER, 1);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
