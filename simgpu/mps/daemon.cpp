// The simulated MPS control daemon (its commands: commands.cpp; its state: daemon_impl.h): one
// process per pipe directory, a single-threaded poll loop
// over <pipe>/control (SOCK_SEQPACKET, protocol in src/mps/mps_protocol.h). It keeps what the real
// daemon keeps (docs/simgpu.md, "MPS"; sources in shared/docs/mps-facts.md):
// - the defaults (active thread percentage, pinned memory limits per device identifier, client
//   priority), which a server takes when it starts and never again;
// - at most one live server, owned by one uid; a client of another uid waits in the pending list
//   until the current server has no clients, then that server is stopped and one for the new uid
//   is started (control.log says so with the real daemon's lines); with -multiuser-server the one
//   server is the daemon's user's and takes clients of every uid;
// - per server: its state (INITIALIZING until its process says hello, ACTIVE, FAULT after a client
//   fault until all its clients are gone), its percentage and limits for its next clients, its
//   clients (at most SIMGPU_MPS_MAX_CLIENTS, default 48 as in CUDA 13.0).
// Invariants: a client is in exactly one of `pending_` or one server's `clients`; a UI waiting for
// terminate_client gets its one answer when the client acknowledges or hangs up, whichever is
// first; every peer's pid and uid come from SO_PEERCRED.
#include "daemon.h"
#include "daemon_impl.h"

#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <deque>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "config.h"
#include "mps_protocol.h"
#include "mps_util.h"

namespace simgpu::mps {
namespace {

std::string timestamp() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  tm t;
  localtime_r(&ts.tv_sec, &t);
  char b[64];
  const size_t n = strftime(b, sizeof b, "%Y-%m-%d %H:%M:%S", &t);
  std::snprintf(b + n, sizeof b - n, ".%03ld", ts.tv_nsec / 1000000);
  return b;
}

void writeLog(FILE* f, const char* who, pid_t pid, const std::string& msg, bool toStdout) {
  char head[96];
  std::snprintf(head, sizeof head, "[%s %s %5d] ", timestamp().c_str(), who, static_cast<int>(pid));
  if (f) {
    std::fprintf(f, "%s%s\n", head, msg.c_str());
    std::fflush(f);
  }
  if (toStdout) {
    std::printf("%s%s\n", head, msg.c_str());
    std::fflush(stdout);
  }
}

}  // namespace

void Daemon::logControl(const std::string& msg) { writeLog(controlLog_, "Control", getpid(), msg, opt_.foreground); }
void Daemon::logServer(pid_t pid, const std::string& msg) { writeLog(serverLog_, "Server", pid, msg, false); }

bool Daemon::start(std::string* error) {
  if (const char* v = std::getenv("SIMGPU_MPS_MAX_CLIENTS")) {
    if (!parseCount(v, 1, 1024, &maxClients_)) {
      *error = std::string("SIMGPU_MPS_MAX_CLIENTS=\"") + v + "\": expected a number of clients from 1 to 1024";
      return false;
    }
  }
  if (const char* v = std::getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")) {
    if (!parsePercentage(v, &defaultPct_)) {
      *error = std::string("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=\"") + v + "\": expected a percentage above 0, at most 100";
      return false;
    }
  }
  if (const char* v = std::getenv("CUDA_MPS_CLIENT_PRIORITY")) {
    if (!parseCount(v, 0, 1, &defaultPriority_)) {
      *error = std::string("CUDA_MPS_CLIENT_PRIORITY=\"") + v + "\": expected 0 (normal) or 1 (below normal)";
      return false;
    }
  }
  if (!makeDirs(opt_.pipeDir, 0755) || !makeDirs(opt_.logDir, 0755)) {
    *error = "cannot create " + opt_.pipeDir + " or " + opt_.logDir + ": " + std::strerror(errno);
    return false;
  }
  const std::string sock = opt_.pipeDir + "/" + kMpsControlSocket;
  sockaddr_un addr{};
  if (sock.size() >= sizeof addr.sun_path) {
    *error = "the control socket path " + sock + " is longer than a Unix socket path may be";
    return false;
  }
  lockFd_ = ::open((opt_.pipeDir + "/control_lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lockFd_ < 0 || flock(lockFd_, LOCK_EX | LOCK_NB) != 0) {
    *error = "An instance of this daemon is already running";
    return false;
  }
  controlLog_ = std::fopen((opt_.logDir + "/control.log").c_str(), "ae");
  serverLog_ = std::fopen((opt_.logDir + "/server.log").c_str(), "ae");
  if (!controlLog_ || !serverLog_) {
    *error = "cannot open the logs in " + opt_.logDir + ": " + std::strerror(errno);
    return false;
  }
  ::unlink(sock.c_str());
  listenFd_ = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, sock.c_str(), sock.size() + 1);
  if (listenFd_ < 0 || bind(listenFd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::chmod(sock.c_str(), 0666) != 0 || listen(listenFd_, 128) != 0) {
    *error = "cannot listen on " + sock + ": " + std::strerror(errno);
    return false;
  }
  FILE* pf = std::fopen((opt_.pipeDir + "/" + kMpsPidFile).c_str(), "we");
  if (!pf) {
    *error = "cannot write the pid file in " + opt_.pipeDir + ": " + std::strerror(errno);
    return false;
  }
  std::fprintf(pf, "%d\n", static_cast<int>(getpid()));
  std::fclose(pf);
  sigset_t set;
  sigemptyset(&set);
  for (int s : {SIGCHLD, SIGTERM, SIGINT, SIGHUP}) sigaddset(&set, s);
  sigprocmask(SIG_BLOCK, &set, nullptr);
  sigFd_ = signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
  signal(SIGPIPE, SIG_IGN);
  // The servers are found beside this binary and inherit where the daemon lives.
  serverPath_ = selfDir() + "/nvidia-cuda-mps-server";
  setenv("CUDA_MPS_PIPE_DIRECTORY", opt_.pipeDir.c_str(), 1);
  setenv("CUDA_MPS_LOG_DIRECTORY", opt_.logDir.c_str(), 1);
  logControl("Starting control daemon using socket " + sock);
  logControl("To connect CUDA applications to this daemon, set env CUDA_MPS_PIPE_DIRECTORY=" + opt_.pipeDir);
  logControl("CUDA MPS Control binary version: " + std::to_string(kMpsBinaryVersion));
  return true;
}

int Daemon::run(int readyFd) {
  std::string error;
  if (!start(&error)) {
    std::fprintf(stderr, "%s\n", error.c_str());
    if (readyFd >= 0) (void)!write(readyFd, (error + "\n").data(), error.size() + 1);
    return 1;
  }
  if (readyFd >= 0) {
    (void)!write(readyFd, "ok\n", 3);
    ::close(readyFd);
  }
  loop();
  return 0;
}

void Daemon::loop() {
  std::vector<pollfd> fds;
  std::vector<uint64_t> ids;
  while (!quit_) {
    fds.clear();
    ids.clear();
    fds.push_back({listenFd_, POLLIN, 0});
    fds.push_back({sigFd_, POLLIN, 0});
    for (auto& [id, c] : conns_) {
      fds.push_back({c.fd, POLLIN, 0});
      ids.push_back(id);
    }
    if (poll(fds.data(), fds.size(), -1) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (fds[1].revents) onSignal();
    if (fds[0].revents & POLLIN) accept();
    for (size_t i = 0; i < ids.size() && !quit_; ++i) {
      if (!fds[i + 2].revents || !conns_.count(ids[i])) continue;
      char buf[kMpsMaxMessage + 1];
      const ssize_t n = recv(fds[i + 2].fd, buf, kMpsMaxMessage, MSG_DONTWAIT);
      if (n > 0) {
        onMessage(ids[i], std::string(buf, static_cast<size_t>(n)));
      } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
        onHangup(ids[i]);
      }
    }
  }
  shutdown();
}

void Daemon::accept() {
  for (;;) {
    const int fd = accept4(listenFd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) return;
    ucred cred{};
    socklen_t len = sizeof cred;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
      logControl("User did not send valid credentials");
      ::close(fd);
      continue;
    }
    Conn c;
    c.fd = fd;
    c.pid = cred.pid;
    c.uid = cred.uid;
    conns_[nextConn_++] = c;
    logControl("Accepting connection...");
  }
}

void Daemon::send(uint64_t id, const std::string& msg) {
  auto it = conns_.find(id);
  if (it == conns_.end()) return;
  // Seqpacket sends to a live peer do not block for messages this small; a dead peer's hang-up
  // arrives through poll.
  (void)!::send(it->second.fd, msg.data(), msg.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
}

void Daemon::closeConn(uint64_t id) {
  auto it = conns_.find(id);
  if (it == conns_.end()) return;
  ::close(it->second.fd);
  conns_.erase(it);
}

Server* Daemon::current() {
  for (auto& s : servers_)
    if (!s.quitting) return &s;
  return nullptr;
}

Server* Daemon::server(pid_t pid) {
  for (auto& s : servers_)
    if (s.pid == pid) return &s;
  return nullptr;
}

void Daemon::onMessage(uint64_t id, const std::string& msg) {
  Conn& c = conns_[id];
  const std::vector<std::string> w = words(msg);
  if (c.kind == Kind::kUnknown) {
    if (msg == "ui") {
      c.kind = Kind::kUi;
      logControl("NEW UI");
    } else if (!w.empty() && w[0] == "client") {
      c.kind = Kind::kClient;
      clientHello(id, w);
    } else if (msg == "server" && server(c.pid)) {
      c.kind = Kind::kServer;
      server(c.pid)->conn = id;
    } else {
      logControl("User did not send valid credentials");
      closeConn(id);
    }
    return;
  }
  if (c.kind == Kind::kServer) {
    Server* sp = server(c.pid);
    if (msg.compare(0, 4, "log ") == 0) {
      logServer(c.pid, msg.substr(4));
    } else if (w.size() == 2 && w[0] == "terminated" && sp) {
      for (uint64_t cl : sp->clients)
        if (std::to_string(conns_[cl].pid) == w[1]) terminateAck(cl, false);
    } else if (msg == "ready" && sp && sp->state == ServerState::kInitializing) {
      Server& s = *sp;
      s.state = ServerState::kActive;
      logControl("NEW SERVER " + std::to_string(s.pid) + ": Ready");
      for (auto& [dev, bytes] : s.limits) {
        char b[128];
        std::snprintf(b, sizeof b, "Device pinned memory limit for device %d set to 0x%llx bytes", dev,
                      static_cast<unsigned long long>(bytes));
        logServer(s.pid, b);
      }
      logServer(s.pid, "Active Threads Percentage set to " + formatPercentage(s.pct));
      logServer(s.pid, "Server Priority set to 0");
      schedule();
    }
    return;
  }
  if (c.kind == Kind::kUi) {
    bool deferred = false;
    logControl("Cmd:" + msg);
    const std::string out = command(c, id, msg, &deferred);
    if (deferred) return;
    if (!out.empty()) logControl(out);
    send(id, out);
    return;
  }
  // A client.
  if (w.size() == 1 && w[0] == "terminated") {
    terminateAck(id, false);
    schedule();
  } else if (w.size() == 2 && w[0] == "fault") {
    Server* s = server(c.server);
    if (!s) return;
    s->state = ServerState::kFault;
    logServer(s->pid, "Client {PID: " + std::to_string(c.pid) + "} encountered a fatal GPU error " + w[1]);
    logControl("Server " + std::to_string(s->pid) + " is in FAULT state after client " + std::to_string(c.pid) +
               " faulted; new clients are refused until its clients exit");
    for (uint64_t other : s->clients)
      if (other != id) send(other, "fault " + w[1]);
  }
}

void Daemon::clientHello(uint64_t id, const std::vector<std::string>& w) {
  Conn& c = conns_[id];
  if (w.size() >= 2 && w[1] != "-") parsePercentage(w[1].c_str(), &c.envPct);
  if (w.size() >= 3 && w[2] != "-") parseCount(w[2].c_str(), 0, 1, &c.envPriority);
  const std::string who = "NEW CLIENT " + std::to_string(c.pid) + " from user " + std::to_string(c.uid) + ": ";
  Server* s = current();
  const uid_t want = serverUidFor(c.uid);
  if (s && s->uid == want && (s->state == ServerState::kFault || s->terminating > 0)) {
    logControl(who + (s->terminating ? "a client is being terminated" : "Server is in FAULT state") +
               ", refusing the client");
    refuse(id, 807);  // CUDA_ERROR_MPS_SERVER_NOT_READY
    return;
  }
  if (s && s->uid == want && s->state == ServerState::kActive && s->terminating == 0) {
    logControl(who + "Server already exists");
  } else {
    logControl(who + "Server is not ready, push client to pending list");
  }
  pending_.push_back(id);
  schedule();
}

void Daemon::refuse(uint64_t id, int code) {
  send(id, "err " + std::to_string(code));
  closeConn(id);
}

void Daemon::admit(uint64_t id, Server& s) {
  Conn& c = conns_[id];
  if (static_cast<int>(s.clients.size()) >= maxClients_) {
    logServer(s.pid, "Client {PID: " + std::to_string(c.pid) + "} refused: the maximum of " +
                         std::to_string(maxClients_) + " clients is reached");
    refuse(id, 808);  // CUDA_ERROR_MPS_MAX_CLIENTS_REACHED
    return;
  }
  c.server = s.pid;
  c.contextId = s.nextContextId++;
  c.pct = (c.envPct > 0 && c.envPct < s.pct) ? c.envPct : s.pct;  // the client can only lower it
  c.priority = c.envPriority >= 0 ? c.envPriority : defaultPriority_;
  s.clients.push_back(id);
  std::string msg = "ok " + std::to_string(s.pid) + " " + std::to_string(std::lround(c.pct * 10)) + " " +
                    std::to_string(c.priority);
  for (auto& [dev, bytes] : s.limits) msg += " " + std::to_string(dev) + "=" + std::to_string(bytes);
  // The server hears of the client (what it was granted) before the client hears where to go.
  if (s.conn)
    send(s.conn, "client " + std::to_string(c.pid) + " " + std::to_string(std::lround(c.pct * 10)) + " " +
                     std::to_string(c.priority));
  logServer(s.pid, "Client {PID: " + std::to_string(c.pid) + ", Context ID: " + std::to_string(c.contextId) +
                       "} connected");
  send(id, msg);  // after the log line: a client that runs has been logged
}

// Moves pending clients forward; see the file comment for the rules.
void Daemon::schedule() {
  for (auto it = pending_.begin(); it != pending_.end();) {
    Conn& c = conns_[*it];
    Server* s = current();
    if (!s) {
      startServer(serverUidFor(c.uid));
      ++it;
    } else if (s->uid == serverUidFor(c.uid)) {
      if (s->state == ServerState::kActive && s->terminating == 0) {
        const uint64_t id = *it;
        it = pending_.erase(it);
        admit(id, *s);
      } else if (s->state == ServerState::kFault || s->terminating > 0) {
        const uint64_t id = *it;
        it = pending_.erase(it);
        refuse(id, 807);
      } else {
        ++it;
      }
    } else if (s->clients.empty() && s->state != ServerState::kInitializing) {
      stopServer(*s);  // then the same client starts the next server
    } else {
      ++it;
    }
  }
}

namespace {
// In the forked server-to-be: binds <pipe>/mps-server-<pid> (mode 0666) and moves it to
// kMpsServerListenFd, kept across exec. Returns that descriptor, -1 on failure.
int listenServerSocket(const std::string& pipeDir, pid_t pid) {
  const std::string path = mpsServerSocket(pipeDir, pid);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof addr.sun_path) return -1;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  ::unlink(path.c_str());
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET, 0);
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::chmod(path.c_str(), 0666) != 0 ||
      ::listen(fd, 128) != 0)
    return -1;
  if (fd == kMpsServerListenFd) return fd;
  const int moved = dup2(fd, kMpsServerListenFd);
  ::close(fd);
  return moved;
}
}  // namespace

void Daemon::startServer(uid_t uid) {
  Server s;
  s.uid = uid;
  s.pct = defaultPct_;
  s.limits = resolveLimits();
  const pid_t pid = fork();
  if (pid == 0) {
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    // The server's own socket (mps_protocol.h), made here with the daemon's rights: the pipe
    // directory belongs to the daemon's user, the server may run as another. It reaches the
    // server as descriptor kMpsServerListenFd.
    if (listenServerSocket(opt_.pipeDir, getpid()) != kMpsServerListenFd) _exit(126);
    if (uid != getuid()) {
      const gid_t g = primaryGid(uid);
      if (setgroups(0, nullptr) != 0 || setgid(g) != 0 || setuid(uid) != 0) _exit(127);
    }
    if (opt_.multiuser) setenv("SIMGPU_MPS_MULTIUSER", "1", 1);  // it serves clients of every uid
    execl(serverPath_.c_str(), "nvidia-cuda-mps-server", static_cast<char*>(nullptr));
    _exit(127);
  }
  if (pid < 0) {
    logControl(std::string("Cannot start a server: ") + std::strerror(errno));
    return;
  }
  s.pid = pid;
  servers_.push_back(s);
  logControl("Starting new server " + std::to_string(pid) + " for user " + std::to_string(uid));
}

void Daemon::stopServer(Server& s) {
  s.quitting = true;
  if (s.conn) send(s.conn, "quit");
  else kill(s.pid, SIGTERM);
}

std::map<int, uint64_t> Daemon::resolveLimits() const {
  // An identifier is an ordinal or a device UUID; the one set last wins; one that names no
  // device is ignored (mps-facts.md §2).
  std::map<int, uint64_t> out;
  for (auto& [dev, bytes] : defaultLimits_) {
    int ordinal = -1;
    if (!parseCount(dev.c_str(), 0, kMaxDevices - 1, &ordinal)) {
      for (int d = 0; d < kMaxDevices; ++d)
        if (deviceUuidString(d) == dev) ordinal = d;
    }
    if (ordinal >= 0) out[ordinal] = bytes;
  }
  return out;
}

void Daemon::onHangup(uint64_t id) {
  Conn& c = conns_[id];
  if (c.kind == Kind::kUi) logControl("UI closed");
  if (c.kind == Kind::kClient) clientGone(c, id);
  if (c.kind == Kind::kServer) {
    if (Server* s = server(c.pid)) {
      s->conn = 0;
      const std::vector<uint64_t> clients = s->clients;
      for (uint64_t cl : clients) terminateAck(cl, true);  // no server: no work left to end
    }
  }
  closeConn(id);
  schedule();
}

void Daemon::clientGone(Conn& c, uint64_t id) {
  pending_.erase(std::remove(pending_.begin(), pending_.end(), id), pending_.end());
  Server* s = server(c.server);
  if (!s) return;
  s->clients.erase(std::remove(s->clients.begin(), s->clients.end(), id), s->clients.end());
  logServer(s->pid, "Client {PID: " + std::to_string(c.pid) + ", Context ID: " + std::to_string(c.contextId) +
                        "} disconnected");
  if (c.terminatingUi) {
    logControl("0");
    send(c.terminatingUi, "0");
    c.terminatingUi = 0;
    --s->terminating;
  }
  if (s->state == ServerState::kFault && s->clients.empty()) {
    s->state = ServerState::kActive;
    logControl("Server " + std::to_string(s->pid) + ": all faulted clients exited, ACTIVE again");
  }
}

void Daemon::terminateAck(uint64_t clientId, bool all) {
  Conn& c = conns_[clientId];
  if (!c.terminatingUi) return;
  c.terminateAcks = all ? 0 : c.terminateAcks - 1;
  if (c.terminateAcks > 0) return;
  logControl("0");
  send(c.terminatingUi, "0");
  c.terminatingUi = 0;
  if (Server* s = server(c.server)) --s->terminating;
}

void Daemon::onSignal() {
  signalfd_siginfo si;
  while (read(sigFd_, &si, sizeof si) == sizeof si) {
    if (si.ssi_signo != SIGCHLD) quit_ = true;
  }
  int status = 0;
  pid_t pid;
  while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    logControl("Server " + std::to_string(pid) + " exited with status " + std::to_string(code));
    auto it = std::find_if(servers_.begin(), servers_.end(), [&](const Server& s) { return s.pid == pid; });
    if (it == servers_.end()) continue;
    // Clients of a server that died lose their GPU work, as with a server crash.
    for (uint64_t cl : it->clients) {
      send(cl, "fault 806");  // CUDA_ERROR_MPS_RPC_FAILURE
      conns_[cl].server = 0;
    }
    if (it->conn) closeConn(it->conn);
    if (it->state == ServerState::kInitializing && !it->quitting) {
      // It never started (its binary missing or failing): its waiting clients are refused
      // rather than started a server for again and again.
      logControl("Server " + std::to_string(pid) + " failed to start");
      const uid_t uid = it->uid;
      for (auto p = pending_.begin(); p != pending_.end();) {
        const uint64_t cl = *p;
        if (serverUidFor(conns_[cl].uid) != uid) {
          ++p;
          continue;
        }
        p = pending_.erase(p);
        refuse(cl, 805);  // CUDA_ERROR_MPS_CONNECTION_FAILED
      }
    }
    ::unlink(mpsServerSocket(opt_.pipeDir, pid).c_str());  // the server may not be allowed to
    servers_.erase(std::find_if(servers_.begin(), servers_.end(), [&](const Server& s) { return s.pid == pid; }));
  }
  schedule();
}


void Daemon::shutdown() {
  logControl("Exiting control daemon");
  for (auto& s : servers_) stopServer(s);
  // Servers exit on "quit"; give them a moment, then make sure.
  for (int i = 0; i < 200 && !servers_.empty(); ++i) {
    int status = 0;
    const pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      servers_.erase(std::remove_if(servers_.begin(), servers_.end(), [&](const Server& s) { return s.pid == pid; }),
                     servers_.end());
      logControl("Server " + std::to_string(pid) + " exited with status " +
                 std::to_string(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status)));
      continue;
    }
    usleep(10000);  // bounded wait for our own children at exit; nothing else to wait on
  }
  for (auto& s : servers_) kill(s.pid, SIGKILL);
  while (!conns_.empty()) closeConn(conns_.begin()->first);
  ::unlink((opt_.pipeDir + "/" + kMpsControlSocket).c_str());
  ::unlink((opt_.pipeDir + "/" + kMpsPidFile).c_str());
  ::close(listenFd_);
}

int runDaemon(const DaemonOptions& options, int readyFd) {
  Daemon d(options);
  return d.run(readyFd);
}

}  // namespace simgpu::mps
