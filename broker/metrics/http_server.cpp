// The metrics HTTP server (see http_server.h for the behaviour it promises).
//
// Structure: answer() is the pure part (received bytes -> the response, once one is decided);
// Connection moves one client through reading -> writing -> draining with non-blocking calls;
// serve() is the thread's poll loop. Nothing in the loop blocks but poll() itself.
#include "metrics/http_server.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <exception>
#include <list>
#include <map>
#include <optional>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

namespace cushare::broker {
namespace {

using Clock = std::chrono::steady_clock;
using Render = std::function<std::string()>;

constexpr size_t kMaxHead = 8 * 1024;  // request line + headers
constexpr size_t kMaxConnections = 64;
constexpr size_t kMaxPerAddress = 16;  // connections of one client address
constexpr int kAcceptBatch = 16;       // accepted per wake-up, then the open ones get their turn
// Deep, so that a client connecting as fast as it can while this thread waits for a CPU does not
// fill the accept queue at once: a full queue drops everyone's SYNs (a second's retransmit).
// Linux caps it at net.core.somaxconn (4096 by default since 5.4).
constexpr int kBacklog = 4096;
constexpr auto kTimeout = std::chrono::seconds(5);  // to send the head; to take the response
constexpr auto kLinger = std::chrono::seconds(1);   // to close after the response (drain)
constexpr auto kAcceptPause = std::chrono::milliseconds(100);  // after EMFILE and the like

constexpr std::string_view kMetricsType = "text/plain; version=0.0.4; charset=utf-8";
constexpr std::string_view kTextType = "text/plain; charset=utf-8";

// ---- Requests and responses (pure) ----

std::string response(int status, std::string_view reason, std::string_view type,
                     std::string_view body, bool withBody, std::string_view extraHeaders = {}) {
  std::string r;
  r.append("HTTP/1.1 ").append(std::to_string(status)).append(" ").append(reason).append("\r\n");
  r.append("Content-Type: ").append(type).append("\r\n");
  r.append("Content-Length: ").append(std::to_string(body.size())).append("\r\n");
  r.append(extraHeaders).append("Connection: close\r\n\r\n");
  if (withBody) r.append(body);
  return r;
}

std::string textResponse(int status, std::string_view reason, std::string_view body,
                         bool withBody = true, std::string_view extraHeaders = {}) {
  return response(status, reason, kTextType, body, withBody, extraHeaders);
}

// Lines end in CRLF or, as RFC 9112 section 2.2 lets a server accept, in a bare LF.
std::string_view withoutCr(std::string_view line) {
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  return line;
}

// The offset just past the empty line that ends the request head, or npos while it is not all
// there.
size_t headEnd(std::string_view buf) {
  size_t start = 0;
  for (size_t nl; (nl = buf.find('\n', start)) != std::string_view::npos; start = nl + 1)
    if (start > 0 && withoutCr(buf.substr(start, nl - start)).empty()) return nl + 1;
  return std::string_view::npos;
}

bool isTokenChar(char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
         std::string_view("!#$%&'*+-.^_`|~").find(c) != std::string_view::npos;
}

bool isVisible(char c) { return c > ' ' && c < 0x7f; }

struct RequestLine {
  std::string_view method, target, version;
};

// Splits "METHOD SP target SP HTTP/d.d" (RFC 9112 section 3). False when it is not of that form.
bool parseRequestLine(std::string_view line, RequestLine* out) {
  const size_t sp1 = line.find(' ');
  const size_t sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
  if (sp2 == std::string_view::npos) return false;
  out->method = line.substr(0, sp1);
  out->target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  out->version = line.substr(sp2 + 1);
  const std::string_view v = out->version;
  const bool versionOk = v.size() == 8 && v.substr(0, 5) == "HTTP/" && v[5] >= '0' && v[5] <= '9' &&
                         v[6] == '.' && v[7] >= '0' && v[7] <= '9';
  bool methodOk = !out->method.empty(), targetOk = !out->target.empty();
  for (const char c : out->method) methodOk = methodOk && isTokenChar(c);
  for (const char c : out->target) targetOk = targetOk && isVisible(c);
  return versionOk && methodOk && targetOk;
}

// The path of a request target: origin form ("/metrics?x") or absolute form
// ("http://host:9464/metrics", which RFC 9112 section 3.2.2 requires servers to accept), without
// the query. Empty when the target is neither.
std::string_view targetPath(std::string_view target) {
  if (target.front() != '/') {
    const size_t scheme = target.find("://");
    if (scheme == std::string_view::npos) return {};
    const size_t slash = target.find('/', scheme + 3);
    if (slash == std::string_view::npos) return "/";
    target.remove_prefix(slash);
  }
  return target.substr(0, target.find('?'));
}

std::string metricsResponse(const Render& render, bool withBody) {
  try {
    return response(200, "OK", kMetricsType, render(), withBody);
  } catch (const std::exception& e) {
    return textResponse(500, "Internal Server Error",
                        std::string("cannot render metrics: ") + e.what() + "\n", withBody);
  }
}

// The response to a request head that is complete and within the size limit.
std::string answerHead(std::string_view head, const Render& render) {
  RequestLine r;
  if (!parseRequestLine(withoutCr(head.substr(0, head.find('\n'))), &r))
    return textResponse(400, "Bad Request", "malformed request line\n");
  if (r.version != "HTTP/1.0" && r.version != "HTTP/1.1")
    return textResponse(505, "HTTP Version Not Supported", "HTTP/1.0 and HTTP/1.1 only\n");
  const bool headOnly = r.method == "HEAD";
  if (r.method != "GET" && !headOnly)
    return textResponse(405, "Method Not Allowed", "only GET and HEAD\n", true,
                        "Allow: GET, HEAD\r\n");
  const std::string_view path = targetPath(r.target);
  if (path.empty()) return textResponse(400, "Bad Request", "malformed request target\n");
  if (path == "/metrics") return metricsResponse(render, !headOnly);
  if (path == "/")
    return textResponse(200, "OK", "cushare broker: Prometheus metrics at /metrics\n", !headOnly);
  return textResponse(404, "Not Found", "not found; the metrics are at /metrics\n", !headOnly);
}

// The response to what a client has sent so far, or nullopt while more is needed. A malformed
// request line is answered as soon as it is complete, without waiting for the headers.
std::optional<std::string> answer(std::string_view received, const Render& render) {
  const size_t end = headEnd(received);
  if (received.size() > kMaxHead && (end == std::string_view::npos || end > kMaxHead))
    return textResponse(431, "Request Header Fields Too Large", "request head over 8 KiB\n");
  if (end != std::string_view::npos) return answerHead(received.substr(0, end), render);
  const size_t nl = received.find('\n');
  RequestLine r;
  if (nl != std::string_view::npos && !parseRequestLine(withoutCr(received.substr(0, nl)), &r))
    return textResponse(400, "Bad Request", "malformed request line\n");
  return std::nullopt;
}

// ---- Connections ----

// One client, from accept to close. Owns its socket.
class Connection {
 public:
  Connection(int fd, std::string address, Clock::time_point now)
      : fd_(fd), address_(std::move(address)), accepted_(now), deadline_(now + kTimeout) {}
  ~Connection() { ::close(fd_); }
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  int fd() const { return fd_; }
  const std::string& address() const { return address_; }
  Clock::time_point accepted() const { return accepted_; }
  // Still waiting for its request head: may be closed to make room for a newcomer.
  bool reading() const { return state_ == State::kReading; }
  short events() const { return state_ == State::kWriting ? POLLOUT : POLLIN; }
  Clock::time_point deadline() const { return deadline_; }

  // Acts on poll's revents. Returns false when the connection is done and can be closed.
  bool onReady(short revents, Clock::time_point now, const Render& render) {
    if (revents & (POLLERR | POLLNVAL)) return false;
    switch (state_) {
      case State::kReading:
        return readRequest(now, render);
      case State::kWriting:
        return writeResponse(now);
      case State::kDraining:
        return drain();
    }
    return false;
  }

 private:
  enum class State { kReading, kWriting, kDraining };

  bool readRequest(Clock::time_point now, const Render& render) {
    char buf[4096];
    const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
    if (n == 0) return false;  // closed before a whole request: nothing to answer
    if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
    in_.append(buf, static_cast<size_t>(n));
    std::optional<std::string> out = answer(in_, render);
    if (!out) return true;
    out_ = std::move(*out);
    in_.clear();
    in_.shrink_to_fit();
    state_ = State::kWriting;
    return writeResponse(now);  // most responses fit the socket buffer: no poll round trip
  }

  bool writeResponse(Clock::time_point now) {
    while (sent_ < out_.size()) {
      const ssize_t n = ::send(fd_, out_.data() + sent_, out_.size() - sent_, MSG_NOSIGNAL);
      if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
      sent_ += static_cast<size_t>(n);
      deadline_ = now + kTimeout;  // a slow reader is fine, one that stopped reading is not
    }
    // Closing a socket with unread input sends a reset, which can destroy the response before
    // the client reads it (a request body, the rest of an oversized head). So: send FIN, then
    // read and discard until the client closes, for at most kLinger.
    ::shutdown(fd_, SHUT_WR);
    state_ = State::kDraining;
    deadline_ = now + kLinger;
    return drain();
  }

  // One read per wake-up, like readRequest, so a client that keeps sending cannot hold the
  // thread; the kLinger deadline ends it.
  bool drain() {
    char buf[4096];
    const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
    if (n == 0) return false;
    return n > 0 || errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
  }

  int fd_;
  std::string address_;  // the client's IP address, raw bytes (the port left out)
  Clock::time_point accepted_;
  State state_ = State::kReading;
  Clock::time_point deadline_;
  std::string in_;
  std::string out_;
  size_t sent_ = 0;
};

// The client's IP address without the port, as raw bytes: what "one client" means here.
std::string addressKey(const sockaddr_storage& ss) {
  if (ss.ss_family == AF_INET6) {
    const auto& a = reinterpret_cast<const sockaddr_in6&>(ss).sin6_addr;
    return std::string(reinterpret_cast<const char*>(&a), sizeof a);
  }
  const auto& a = reinterpret_cast<const sockaddr_in&>(ss).sin_addr;
  return std::string(reinterpret_cast<const char*>(&a), sizeof a);
}

bool anyReading(const std::list<Connection>& conns) {
  for (const Connection& c : conns)
    if (c.reading()) return true;
  return false;
}

// Closes one connection that is still waiting for its request head, to make room: one of
// `address` when given, else one of the address holding the most connections; the oldest of
// those. So a client that opens connections and sends nothing (slow loris), or opens them as fast
// as it can, displaces its own, and only they wait. False when none may go.
bool evictOne(std::list<Connection>* conns, const std::string* address) {
  std::map<std::string, size_t> held;
  for (const Connection& c : *conns) ++held[c.address()];
  auto victim = conns->end();
  for (auto it = conns->begin(); it != conns->end(); ++it) {
    if (!it->reading() || (address && it->address() != *address)) continue;
    if (victim == conns->end() || held[it->address()] > held[victim->address()])
      victim = it;  // the list is in accept order: the first of an address is its oldest
  }
  if (victim == conns->end()) return false;
  conns->erase(victim);
  return true;
}

// Accepts up to kAcceptBatch pending clients. Called only when there is room or a connection can
// make room. One address holds at most kMaxPerAddress connections: past that its oldest waiting
// one goes, or (none waiting) the newcomer gets a 503. A newcomer's request is read at once: a
// client that sent it with the connection (every HTTP client) is answered before any later
// newcomer could displace it. On a shortage of file descriptors or memory the listening socket
// stays readable, so accepting pauses for kAcceptPause instead of spinning.
void acceptClients(int listenFd, std::list<Connection>* conns, const Render& render,
                   Clock::time_point now, Clock::time_point* pausedUntil) {
  for (int i = 0; i < kAcceptBatch; ++i) {
    if (conns->size() >= kMaxConnections && !anyReading(*conns)) return;
    sockaddr_storage ss{};
    socklen_t len = sizeof ss;
    const int fd = ::accept4(listenFd, reinterpret_cast<sockaddr*>(&ss), &len,
                             SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      // A client that went away while queued (or any network error Linux passes on from the new
      // socket): try the next one, as accept(2) recommends.
      if (errno == ECONNABORTED || errno == EINTR || errno == EPROTO) continue;
      *pausedUntil = now + kAcceptPause;
      return;
    }
    std::string address = addressKey(ss);
    size_t mine = 0;
    for (const Connection& c : *conns) mine += c.address() == address;
    const bool room = mine < kMaxPerAddress || evictOne(conns, &address);
    if (!room || (conns->size() >= kMaxConnections && !evictOne(conns, nullptr))) {
      const std::string busy =
          textResponse(503, "Service Unavailable", "too many connections from your address\n",
                       true, "Retry-After: 1\r\n");
      (void)!::send(fd, busy.data(), busy.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      ::close(fd);
      continue;
    }
    conns->emplace_back(fd, std::move(address), now);
    if (!conns->back().onReady(POLLIN, now, render)) conns->pop_back();
  }
}

// Milliseconds for poll() until the earliest deadline, rounded up; -1 (no timeout) when none.
int pollTimeout(const std::list<Connection>& conns, std::optional<Clock::time_point> other,
                Clock::time_point now) {
  std::optional<Clock::time_point> first = other;
  for (const Connection& c : conns)
    if (!first || c.deadline() < *first) first = c.deadline();
  if (!first) return -1;
  if (*first <= now) return 0;
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(*first - now).count();
  return static_cast<int>(ms);
}

// The server thread: returns when wakeFd becomes readable (stop()). The connections close when
// the list goes out of scope.
void serve(int listenFd, int wakeFd, const Render& render) {
  std::list<Connection> conns;
  Clock::time_point acceptPausedUntil{};
  std::vector<pollfd> fds;
  for (;;) {
    Clock::time_point now = Clock::now();
    const bool paused = now < acceptPausedUntil;
    const bool full = conns.size() >= kMaxConnections && !anyReading(conns);
    const bool accepting = !full && !paused;
    fds.clear();
    fds.push_back({wakeFd, POLLIN, 0});
    fds.push_back({accepting ? listenFd : -1, POLLIN, 0});  // poll skips a negative fd
    for (const Connection& c : conns) fds.push_back({c.fd(), c.events(), 0});
    const int timeout =
        pollTimeout(conns, paused ? std::optional(acceptPausedUntil) : std::nullopt, now);
    // poll fails only for EINTR (unlikely: every signal is blocked) or ENOMEM: try again.
    if (::poll(fds.data(), fds.size(), timeout) < 0) continue;
    if (fds[0].revents != 0) return;

    now = Clock::now();
    size_t i = 2;
    for (auto it = conns.begin(); it != conns.end(); ++i) {
      const short revents = fds[i].revents;
      const bool keep = (revents == 0 || it->onReady(revents, now, render)) && it->deadline() > now;
      it = keep ? std::next(it) : conns.erase(it);
    }
    if (fds[1].revents != 0) acceptClients(listenFd, &conns, render, now, &acceptPausedUntil);
  }
}

// ---- Addresses ----

std::string joinHostPort(const std::string& host, uint16_t port) {
  const bool v6 = host.find(':') != std::string::npos;
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

// The address a socket is bound to, "127.0.0.1:45123" or "[::1]:9464".
std::string boundAddress(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "";
  char host[INET6_ADDRSTRLEN] = {};
  uint16_t port = 0;
  if (ss.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    ::inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
    port = ntohs(a->sin6_port);
  } else {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    ::inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
    port = ntohs(a->sin_port);
  }
  return joinHostPort(host, port);
}

// A listening socket on one resolved address, or -1 with errno set.
int listenOn(const addrinfo& ai) {
  const int fd =
      ::socket(ai.ai_family, ai.ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai.ai_protocol);
  if (fd < 0) return -1;
  const int one = 1;
  // SO_REUSEADDR: a restarted broker can bind again while its old connections sit in TIME_WAIT.
  if (::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) == 0 &&
      ::bind(fd, ai.ai_addr, ai.ai_addrlen) == 0 && ::listen(fd, kBacklog) == 0)
    return fd;
  const int saved = errno;
  ::close(fd);
  errno = saved;
  return -1;
}

// Resolves host:port and listens on the first address that works. -1 and *err on failure.
int openListener(const std::string& host, uint16_t port, std::string* err) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* list = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &list);
  if (rc != 0) {
    *err = "cannot listen on " + joinHostPort(host, port) + ": cannot resolve '" + host +
           "': " + ::gai_strerror(rc);
    return -1;
  }
  int fd = -1, firstErrno = 0;
  for (const addrinfo* ai = list; ai && fd < 0; ai = ai->ai_next) {
    fd = listenOn(*ai);
    if (fd < 0 && firstErrno == 0) firstErrno = errno;  // the preferred address's reason
  }
  ::freeaddrinfo(list);
  if (fd < 0)
    *err = "cannot listen on " + joinHostPort(host, port) + ": " + std::strerror(firstErrno);
  return fd;
}

}  // namespace

MetricsServer::~MetricsServer() { stop(); }

bool MetricsServer::start(const std::string& host, uint16_t port,
                          std::function<std::string()> render, std::string* err) {
  if (thread_.joinable()) {
    *err = "metrics server already listening on " + address_;
    return false;
  }
  const int listenFd = openListener(host, port, err);
  if (listenFd < 0) return false;
  const int wakeFd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wakeFd < 0) {
    *err = std::string("cannot create the metrics server's eventfd: ") + std::strerror(errno);
    ::close(listenFd);
    return false;
  }
  listenFd_ = listenFd;
  wakeFd_ = wakeFd;
  address_ = boundAddress(listenFd);
  // The thread starts with every signal blocked (it inherits the mask), so signals meant for the
  // broker are never delivered to it and poll() is never interrupted.
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  try {
    thread_ = std::thread(
        [listenFd, wakeFd, render = std::move(render)] { serve(listenFd, wakeFd, render); });
  } catch (const std::system_error& e) {
    *err = std::string("cannot start the metrics server's thread: ") + e.what();
  }
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  if (!thread_.joinable()) closeSockets();
  return thread_.joinable();
}

std::string MetricsServer::address() const { return address_; }

void MetricsServer::stop() {
  if (!thread_.joinable()) return;
  const uint64_t one = 1;
  // Cannot fail: the counter is far from overflow and the fd is ours.
  [[maybe_unused]] const ssize_t n = ::write(wakeFd_, &one, sizeof one);
  thread_.join();
  closeSockets();
}

void MetricsServer::closeSockets() {
  ::close(listenFd_);
  ::close(wakeFd_);
  listenFd_ = wakeFd_ = -1;
  address_.clear();
}

}  // namespace cushare::broker
