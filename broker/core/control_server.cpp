// See control_server.h.
#include "core/control_server.h"

#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <sstream>

#include "core/broker.h"
#include "core/log.h"
#include "cushare/parse.h"
#include "rpc/codec.h"
#include "rpc/convert.h"

namespace cushare::broker {
namespace {

constexpr size_t kMaxConnections = 64;
constexpr size_t kMaxPerUser = 16;
constexpr size_t kAdminReserve = 16;
constexpr auto kConnectionDeadline = std::chrono::seconds(5);
// Connections taken per wake-up: a client that connects as fast as it can (each one refused or
// served) cannot keep the thread in accept() while accepted clients wait for their answers.
constexpr int kAcceptBatch = 64;

using Clock = std::chrono::steady_clock;

std::string sysErr(const std::string& what) { return what + ": " + std::strerror(errno); }

bool peerOf(int fd, Peer* p) {
  ucred cred{};
  socklen_t len = sizeof cred;
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return false;
  p->uid = cred.uid;
  p->gid = cred.gid;
  p->pid = cred.pid;
  std::vector<gid_t> groups(64);
  for (;;) {
    len = static_cast<socklen_t>(groups.size() * sizeof(gid_t));
    if (::getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &len) == 0) break;
    if (errno != ERANGE) return false;  // without the groups an admin could be refused: fail closed
    groups.resize(len / sizeof(gid_t) + 1);
  }
  groups.resize(len / sizeof(gid_t));
  p->groups = std::move(groups);
  return true;
}

rpc::Response failure(const std::string& why) {
  rpc::Response r;
  r.set_ok(false);
  r.set_error(why);
  return r;
}

rpc::Response busy(const std::string& why) {
  rpc::Response r = failure("broker busy: " + why + "; try again shortly");
  r.set_busy(true);
  return r;
}

// The pid hostPid has in its own innermost pid namespace (the last field of NSpid in
// /proc/PID/status, which anyone may read), or 0 when the process is gone. Kernels before 4.1
// have no NSpid line: no nested namespaces to look through, the pid is hostPid's own.
int innermostPid(int hostPid) {
  std::ifstream status("/proc/" + std::to_string(hostPid) + "/status");
  if (!status) return 0;
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("NSpid:", 0) != 0) continue;
    std::istringstream fields(line.substr(6));
    int pid = 0;
    for (int v; fields >> v;) pid = v;
    return pid;
  }
  return hostPid;
}

std::string who(const Peer& p) {
  return "uid " + std::to_string(p.uid) + " pid " + std::to_string(p.pid);
}

// "no tenant 'x' on this host", and the nearest name of the host's tenants when there is one.
std::string noTenant(Broker& b, const std::string& name) {
  std::vector<std::string> names;
  for (const broker::TenantSnapshot& t : b.snapshot().tenants) names.push_back(t.name);
  return "no tenant '" + printable(name, 64) + "' on this host" + didYouMean(name, names);
}

rpc::Response handle(Broker& b, const std::function<bool(std::string*)>& reload, const rpc::Request& req,
                     const Peer& peer) {
  rpc::Response r;
  r.set_ok(true);
  std::string err;
  const bool mutates = req.has_set_limit() || req.has_reload();
  if (mutates && !b.isAdmin(peer))
    return failure("permission denied: changing limits or reloading needs root, the broker's user or its "
                   "admin_group (you are " + who(peer) + ")");
  switch (req.body_case()) {
    case rpc::Request::kStatus:
      rpc::toProto(b.snapshot(), r.mutable_status());
      return r;
    case rpc::Request::kTenants:
      if (!rpc::tenantsToProto(b.snapshot(), req.tenants().tenant(), r.mutable_tenants()))
        return failure(noTenant(b, req.tenants().tenant()));
      return r;
    case rpc::Request::kProcesses:
      // A slot's pid is the tenant's own claim; each is checked against the kernel's (the
      // slot's POSIX pid lock and /proc), here, outside the broker's lock.
      if (!rpc::processesToProto(b.snapshotWithPods(), req.processes().tenant(), innermostPid,
                                 r.mutable_processes()))
        return failure(noTenant(b, req.processes().tenant()));
      return r;
    case rpc::Request::kSetLimit: {
      const rpc::SetLimitRequest& s = req.set_limit();
      Broker::LimitChange c;
      c.device = s.has_device() ? s.device() : -1;
      c.memory = s.reset() || !s.memory().empty();
      if (!s.memory().empty()) {
        rpc::MemoryValue v;
        if (!rpc::parseMemoryAmount(s.memory(), &v, &err)) return failure(err);
        c.amount = MemoryAmount{v.bytes, v.milliPercent};
      }
      c.resetCompute = s.reset() && c.device == -1;
      if (s.has_threads()) c.threads = s.threads();
      Priority p;
      if (!s.priority().empty()) {
        if (!parsePriority(s.priority(), &p, &err)) return failure("priority: " + err);
        c.priority = p;
      }
      if (!b.setLimit(s.tenant(), c, &err)) return failure(err);
      CUSHARE_BLOG(info, "set-limit {} device {} memory {} threads {} priority {} by {}", s.tenant(), c.device,
                   s.reset() ? "reset" : s.memory().empty() ? "-" : s.memory(),
                   c.resetCompute ? "reset" : s.has_threads() ? std::to_string(s.threads()) : "-",
                   c.resetCompute ? "reset" : s.priority().empty() ? "-" : s.priority(), who(peer));
      const BrokerSnapshot snap = b.snapshot();
      for (const TenantSnapshot& t : snap.tenants)
        if (t.name == s.tenant()) rpc::toProto(t, snap, r.mutable_set_limit()->mutable_tenant());
      return r;
    }
    case rpc::Request::kReload:
      CUSHARE_BLOG(info, "reload requested by {}", who(peer));
      if (!reload(&err)) return failure(err);
      r.mutable_reload()->set_config_generation(b.snapshot().configGeneration);
      return r;
    case rpc::Request::kEnv: {
      EnvInfo e;
      if (!b.env(req.env().tenant(), &e, &err)) return failure(err);
      rpc::EnvReply* out = r.mutable_env();
      out->set_tenant(e.tenant);
      out->set_ledger_dir(e.ledgerDir);
      out->set_source(e.source);
      if (e.threadPercentage) out->set_thread_percentage(*e.threadPercentage);
      out->set_priority(priorityName(e.priority));
      for (size_t d = 0; d < e.limits.size(); ++d) {
        rpc::TenantDevice* td = out->add_devices();
        td->set_device(static_cast<int32_t>(d));
        td->set_uuid(e.limits[d].first);
        if (e.limits[d].second != kNoLimit) td->set_limit_bytes(e.limits[d].second);
      }
      return r;
    }
    case rpc::Request::BODY_NOT_SET:
      break;
  }
  return failure("request without a body");  // decodeRequest refuses these; kept for safety
}

}  // namespace

struct ControlServer::Connection {
  int fd = -1;
  Peer peer;
  rpc::FrameReader reader{rpc::kMaxRequestBytes};
  std::string out;
  size_t written = 0;
  bool responding = false;
  Clock::time_point deadline = Clock::now() + kConnectionDeadline;
};

ControlServer::ControlServer(Broker& broker, std::function<bool(std::string*)> reload)
    : broker_(broker), reload_(std::move(reload)) {}

ControlServer::~ControlServer() {
  stop();
  for (int fd : {listen_, epoll_, stop_})
    if (fd >= 0) ::close(fd);
}

bool ControlServer::start(const std::string& path, std::string* err) {
  path_ = path;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof addr.sun_path) {
    *err = "socket path " + path + " is too long";
    return false;
  }
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  for (size_t i = 1; i < path.size(); ++i)
    if (path[i] == '/') ::mkdir(path.substr(0, i).c_str(), 0755);
  // A socket file left by a broker that died: replace it. One that answers: another broker.
  struct stat st;
  if (::lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      *err = "socket path " + path + " exists and is not a socket";
      return false;
    }
    const int probe = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const bool answered = ::connect(probe, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
    ::close(probe);
    if (answered) {
      *err = "another broker is listening on " + path;
      return false;
    }
    ::unlink(path.c_str());
  }
  listen_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  epoll_ = ::epoll_create1(EPOLL_CLOEXEC);
  stop_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (listen_ < 0 || epoll_ < 0 || stop_ < 0) {
    *err = sysErr("control socket");
    return false;
  }
  if (::bind(listen_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::chmod(path.c_str(), 0666) != 0 || ::listen(listen_, 128) != 0) {
    *err = sysErr("cannot listen on " + path);
    return false;
  }
  for (int fd : {listen_, stop_}) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    ::epoll_ctl(epoll_, EPOLL_CTL_ADD, fd, &ev);
  }
  thread_ = std::thread([this] { run(); });
  return true;
}

void ControlServer::stop() {
  if (!thread_.joinable()) return;
  const uint64_t one = 1;
  (void)!::write(stop_, &one, sizeof one);
  thread_.join();
  for (auto& [fd, c] : conns_) ::close(fd);
  conns_.clear();
  ::unlink(path_.c_str());
}

void ControlServer::close(int fd) {
  ::close(fd);  // also leaves the epoll set
  conns_.erase(fd);
}

// Room for one more connection from this peer? Every user gets at most kMaxPerUser, so one user
// cannot take all kMaxConnections; administrators have kAdminReserve more beyond the total, so
// readers holding every slot never lock them out of set-limit and reload. When there is none,
// *why says so (for the busy answer).
bool ControlServer::admit(const Peer& p, std::string* why) const {
  size_t mine = 0;
  for (const auto& [fd, c] : conns_) mine += c->peer.uid == p.uid;
  const bool admin = broker_.isAdmin(p);
  const size_t room = admin ? kMaxConnections + kAdminReserve : kMaxConnections;
  if (conns_.size() >= room) {
    *why = "all " + std::to_string(room) + " connections are in use";
    return false;
  }
  if (!admin && mine >= kMaxPerUser) {
    *why = "uid " + std::to_string(p.uid) + " already has " + std::to_string(mine) +
           " connections open, the most one user may";
    return false;
  }
  return true;
}

void ControlServer::accept() {
  for (int i = 0; i < kAcceptBatch; ++i) {
    const int fd = ::accept4(listen_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) return;  // EAGAIN: all taken; other errors: the client is gone
    auto c = std::make_unique<Connection>();
    c->fd = fd;
    std::string why;
    const bool known = peerOf(fd, &c->peer);
    if (!known || !admit(c->peer, &why)) {
      // One non-blocking send of a small frame into an empty socket buffer: it fits. The client
      // reads it even after the close (and even if its own send failed because of the close).
      const std::string bytes = rpc::frame(
          known ? busy(why) : failure(sysErr("the broker cannot read this client's credentials")));
      (void)!::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      ::close(fd);
      continue;
    }
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    ::epoll_ctl(epoll_, EPOLL_CTL_ADD, fd, &ev);
    conns_[fd] = std::move(c);
  }
}

void ControlServer::respond(Connection& c, const std::string& bytes) {
  c.out = bytes;
  c.responding = true;
  epoll_event ev{};
  ev.events = EPOLLOUT;
  ev.data.fd = c.fd;
  ::epoll_ctl(epoll_, EPOLL_CTL_MOD, c.fd, &ev);
}

bool ControlServer::flush(Connection& c) {
  while (c.written < c.out.size()) {
    const ssize_t n = ::send(c.fd, c.out.data() + c.written, c.out.size() - c.written, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) return true;
    if (n <= 0) return false;
    c.written += static_cast<size_t>(n);
  }
  return false;
}

void ControlServer::onReadable(Connection& c) {
  char buf[16384];
  for (;;) {
    const ssize_t n = ::recv(c.fd, buf, sizeof buf, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) return;
    if (n == 0) {
      // The client half-closed (or closed) before a whole request: tell it what was missing. A
      // client that sent nothing gets the same line but no log line (a probe, not an attack).
      const std::string why = c.reader.incompleteReason();
      if (std::string more; why.rfind("no message", 0) != 0 && malformedLog_.allow(&more))
        CUSHARE_BLOG(warn, "control socket: malformed request from {}: {}{}", who(c.peer), why, more);
      respond(c, rpc::frame(failure("malformed request: " + why)));
      if (!flush(c)) close(c.fd);
      return;
    }
    if (n < 0) {
      close(c.fd);
      return;
    }
    std::string err;
    const auto status = c.reader.feed(buf, static_cast<size_t>(n), &err);
    if (status == rpc::FrameReader::kNeedMore) continue;
    rpc::Response resp;
    rpc::Request req;
    if (status == rpc::FrameReader::kError || !rpc::decodeRequest(c.reader.payload(), &req, &err)) {
      if (std::string more; malformedLog_.allow(&more))
        CUSHARE_BLOG(warn, "control socket: malformed request from {}: {}{}", who(c.peer), err, more);
      resp = failure("malformed request: " + err);
    } else {
      resp = handle(broker_, reload_, req, c.peer);
    }
    respond(c, rpc::frame(resp));
    if (!flush(c)) close(c.fd);
    return;
  }
}

void ControlServer::run() {
  epoll_event events[64];
  for (;;) {
    const int n = ::epoll_wait(epoll_, events, 64, 500);
    if (n < 0 && errno != EINTR) {
      CUSHARE_BLOG(error, "control socket: epoll_wait: {}", std::strerror(errno));
      return;
    }
    for (int i = 0; i < n; ++i) {
      const int fd = events[i].data.fd;
      if (fd == stop_) return;
      if (fd == listen_) {
        accept();
        continue;
      }
      auto it = conns_.find(fd);
      if (it == conns_.end()) continue;
      Connection& c = *it->second;
      if (c.responding) {
        if (!flush(c)) close(fd);
      } else {
        onReadable(c);
      }
    }
    const auto now = Clock::now();
    for (auto it = conns_.begin(); it != conns_.end();) {
      if (it->second->deadline > now) {
        ++it;
        continue;
      }
      ::close(it->first);
      it = conns_.erase(it);
    }
  }
}

}  // namespace cushare::broker
