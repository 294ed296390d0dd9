// The control API on the wire: framing, request validation, the client's round trip and the
// fuzz entry. See codec.h for the invariants.
#include "rpc/codec.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include <google/protobuf/stubs/logging.h>

#include "cushare/parse.h"
#include "cushare/shim_config.h"

namespace cushare::rpc {
namespace {

constexpr size_t kHeaderBytes = 4;
constexpr size_t kMaxQuoted = 80;  // of a user's value inside an error line

bool fail(std::string* err, std::string why) {
  if (err) *err = std::move(why);
  return false;
}

std::string quoted(std::string_view text) { return "'" + printable(text, kMaxQuoted) + "'"; }

}  // namespace

// ---- framing ---------------------------------------------------------------------------------

std::string frame(const google::protobuf::MessageLite& m) {
  // Protobuf refuses messages of 2 GiB or more, so the size always fits the 32-bit prefix.
  const auto size = static_cast<uint32_t>(m.ByteSizeLong());
  std::string out(kHeaderBytes, '\0');
  for (size_t i = 0; i < kHeaderBytes; ++i) out[i] = static_cast<char>((size >> (8 * i)) & 0xff);
  m.AppendToString(&out);
  return out;
}

FrameReader::FrameReader(size_t maxPayload) : maxPayload_(maxPayload) {}

FrameReader::Status FrameReader::feed(const char* data, size_t n, std::string* err) {
  auto failWith = [&](std::string why) {
    status_ = kError;
    error_ = std::move(why);
    if (err) *err = error_;
    return kError;
  };
  if (status_ == kError) return failWith(error_);
  if (n == 0) return status_;
  if (status_ == kDone)
    return failWith("bytes after the end of the " + std::to_string(length_) +
                    "-byte message (a connection carries one message)");

  if (headerBytes_ < kHeaderBytes) {
    const size_t take = std::min(n, kHeaderBytes - headerBytes_);
    std::memcpy(header_ + headerBytes_, data, take);
    headerBytes_ += take;
    data += take;
    n -= take;
    if (headerBytes_ < kHeaderBytes) return kNeedMore;
    length_ = 0;
    for (size_t i = 0; i < kHeaderBytes; ++i)
      length_ |= static_cast<size_t>(static_cast<unsigned char>(header_[i])) << (8 * i);
    // Checked before any byte of the payload is buffered, so a peer cannot make us hold more.
    if (length_ > maxPayload_)
      return failWith("message length " + std::to_string(length_) +
                      " bytes exceeds the maximum of " + std::to_string(maxPayload_) + " bytes");
  }

  const size_t take = std::min(n, length_ - payload_.size());
  payload_.append(data, take);
  n -= take;
  if (payload_.size() < length_) return kNeedMore;
  status_ = kDone;
  if (n > 0) return feed(data + take, n, err);  // reports the bytes after the frame
  return kDone;
}

std::string FrameReader::incompleteReason() const {
  if (status_ == kError) return error_;
  if (status_ == kDone) return "";
  if (headerBytes_ == 0) return "no message: the connection closed before its first byte";
  if (headerBytes_ < kHeaderBytes)
    return "truncated message: got " + std::to_string(headerBytes_) + " of the " +
           std::to_string(kHeaderBytes) + " length bytes";
  return "truncated message: got " + std::to_string(payload_.size()) + " of " +
         std::to_string(length_) + " bytes";
}

// ---- validation ------------------------------------------------------------------------------

namespace {

// "N%" or "N.NNN%" (the '%' already removed) as thousandths of a percent, 0 < p <= 100%.
bool checkTenant(std::string_view name, bool required, std::string* err) {
  if (name.empty()) return !required || fail(err, "a tenant name is required");
  // The shim's rule for CUSHARE_TENANT: the names a process can actually use (it also refuses
  // "." and "..", which Ledger::validTenantName lets through).
  std::string ignored, reason;
  if (!parseTenant(name, &ignored, &reason))
    return fail(err, "invalid tenant name " + quoted(name) + ": " + reason);
  return true;
}

bool checkSetLimit(const SetLimitRequest& r, std::string* err) {
  if (!checkTenant(r.tenant(), true, err)) return false;
  const bool change = !r.memory().empty() || r.has_threads() || !r.priority().empty();
  if (change == r.reset())
    return fail(err, r.reset() ? "set_limit takes reset alone, without memory, threads or priority"
                               : "set_limit needs a memory amount, threads, a priority or reset");
  MemoryValue ignored;
  if (!r.memory().empty() && !parseMemoryAmount(r.memory(), &ignored, err)) return false;
  if (r.has_threads() && (r.threads() < 1 || r.threads() > 100))
    return fail(err, "threads " + std::to_string(r.threads()) +
                         " is not valid: a compute cap is a percentage from 1 to 100");
  Priority p;
  std::string why;
  if (!r.priority().empty() && !parsePriority(r.priority(), &p, &why)) return fail(err, "priority: " + why);
  if (r.has_device() && r.device() != -1 && r.memory().empty() && !r.reset())
    return fail(err, "device applies to memory limits; threads and priority are the tenant's on every device");
  if (r.device() < -1)
    return fail(err, "device " + std::to_string(r.device()) +
                         " is not valid: use a device index, or -1 for every device");
  return true;
}

}  // namespace

bool parseMemoryAmount(std::string_view text, MemoryValue* out, std::string* err) {
  const std::string_view s = trim(text);
  MemoryValue v;
  if (!s.empty() && s.back() == '%') {
    std::string why;
    if (!parsePercent(s, &v.milliPercent, &why)) return fail(err, "memory " + quoted(text) + ": " + why);
  } else {
    std::string why;
    // parseSize quotes the text as it is; printable keeps the line one line.
    if (!parseSize(s, &v.bytes, &why))
      return fail(err, "memory: " + printable(why, 3 * kMaxQuoted));
    if (v.bytes == 0)
      return fail(err, "memory " + quoted(text) +
                           ": a limit of 0 bytes would deny every allocation (to drop a live limit: "
                           "cushare set-limit TENANT --reset)");
  }
  *out = v;
  return true;
}

bool validateRequest(const Request& req, std::string* err) {
  const std::string speaks = "; this broker speaks version " + std::to_string(kProtocolVersion);
  if (req.version() == 0) return fail(err, "the request has no protocol version" + speaks);
  if (req.version() != kProtocolVersion)
    return fail(err,
                "protocol version " + std::to_string(req.version()) + " is not supported" + speaks);
  switch (req.body_case()) {
    case Request::kStatus:
    case Request::kReload:
      return true;
    case Request::kTenants:
      return checkTenant(req.tenants().tenant(), false, err);
    case Request::kProcesses:
      return checkTenant(req.processes().tenant(), false, err);
    case Request::kSetLimit:
      return checkSetLimit(req.set_limit(), err);
    case Request::kEnv:
      return checkTenant(req.env().tenant(), true, err);
    case Request::BODY_NOT_SET:
      break;
  }
  // A body added after this broker was built arrives as an unknown field: no body either.
  return fail(err,
              "the request has no body this broker knows (status, tenants, processes, set_limit, "
              "reload, env)");
}

bool decodeRequest(std::string_view payload, Request* out, std::string* err) {
  if (payload.size() > kMaxRequestBytes)
    return fail(err, "request of " + std::to_string(payload.size()) +
                         " bytes exceeds the maximum of " + std::to_string(kMaxRequestBytes));
  // Protobuf logs a second line of its own for a string that is not UTF-8; ours is the report.
  google::protobuf::LogSilencer quiet;
  if (!out->ParseFromArray(payload.data(), static_cast<int>(payload.size())))
    return fail(err, "the request is not a valid cushare.rpc.Request (" +
                         std::to_string(payload.size()) +
                         " bytes: malformed protobuf, or a string that is not UTF-8)");
  return validateRequest(*out, err);
}

bool decodeRequestFrame(std::string_view bytes, Request* out, std::string* err) {
  FrameReader reader(kMaxRequestBytes);
  switch (reader.feed(bytes.data(), bytes.size(), err)) {
    case FrameReader::kError:
      return false;
    case FrameReader::kNeedMore:
      return fail(err, reader.incompleteReason());
    case FrameReader::kDone:
      break;
  }
  return decodeRequest(reader.payload(), out, err);
}

// ---- client ----------------------------------------------------------------------------------

namespace {

using Clock = std::chrono::steady_clock;

class Socket {
 public:
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket() {
    if (fd_ >= 0) ::close(fd_);
  }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  int fd() const { return fd_; }

 private:
  int fd_;
};

std::string seconds(int ms) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g s", ms / 1000.0);
  return buf;
}

std::string connectHint(int e) {
  if (e == ENOENT || e == ECONNREFUSED)
    return " (is cushare-broker running? set --socket or CUSHARE_SOCKET)";
  if (e == EACCES || e == EPERM) return " (the socket's permissions do not admit this user)";
  if (e == EAGAIN) return " (the broker is not accepting connections)";
  return "";
}

bool connectTo(const std::string& path, const Socket& s, int timeoutMs, bool* busy,
               std::string* err) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof addr.sun_path)
    return fail(err, "socket path " + quoted(path) + " must have 1 to " +
                         std::to_string(sizeof addr.sun_path - 1) + " bytes");
  std::memcpy(addr.sun_path, path.data(), path.size());
  // A Unix socket's connect waits (for a full backlog) up to the send timeout, then says EAGAIN.
  const timeval tv{timeoutMs / 1000, (timeoutMs % 1000) * 1000};
  ::setsockopt(s.fd(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  int rc;
  do {
    rc = ::connect(s.fd(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    const int e = errno;
    *busy = e == EAGAIN;
    if (*busy) return fail(err, "broker busy: its listen backlog at " + path + " is full");
    return fail(
        err, "cannot connect to the broker at " + path + ": " + std::strerror(e) + connectHint(e));
  }
  return true;
}

// The kernel's word on who listens at the other end; see CallOptions::trustedUids.
bool checkServer(const std::string& path, int fd, const std::vector<uint32_t>& trusted,
                 std::string* err) {
  ucred cred{};
  socklen_t len = sizeof cred;
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0)
    return fail(err, "cannot tell who listens at " + path + ": " + std::strerror(errno));
  const uid_t self = ::geteuid();
  if (cred.uid == 0 || cred.uid == self ||
      std::find(trusted.begin(), trusted.end(), cred.uid) != trusted.end())
    return true;
  return fail(err, "not trusting the server at " + path + ": it runs as uid " +
                       std::to_string(cred.uid) + " (pid " + std::to_string(cred.pid) +
                       "), not as root or as you (uid " + std::to_string(self) +
                       "); if cushare-broker runs as that user, name it with --broker-user or "
                       "CUSHARE_BROKER_USER");
}

// Waits until fd is ready for events or the deadline passes.
bool waitFor(int fd, short events, Clock::time_point deadline, const std::string& what,
             int timeoutMs, std::string* err) {
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    pollfd p{fd, events, 0};
    const int rc = left > 0 ? ::poll(&p, 1, static_cast<int>(left)) : 0;
    if (rc > 0) return true;
    if (rc == 0) return fail(err, "the broker did not " + what + " within " + seconds(timeoutMs));
    if (errno != EINTR) return fail(err, std::string("poll: ") + std::strerror(errno));
  }
}

bool sendAll(int fd, const std::string& bytes, Clock::time_point deadline, int timeoutMs,
             std::string* err) {
  for (size_t sent = 0; sent < bytes.size();) {
    if (!waitFor(fd, POLLOUT, deadline, "take the request", timeoutMs, err)) return false;
    // MSG_NOSIGNAL: a broker that hung up is an error line here, not SIGPIPE for the CLI.
    const ssize_t n =
        ::send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n >= 0) {
      sent += static_cast<size_t>(n);
    } else if (errno != EINTR && errno != EAGAIN) {
      return fail(err,
                  std::string("cannot send the request to the broker: ") + std::strerror(errno));
    }
  }
  return true;
}

bool receiveFrame(int fd, FrameReader* reader, Clock::time_point deadline, int timeoutMs,
                  std::string* err) {
  char buf[64 * 1024];
  for (;;) {
    if (!waitFor(fd, POLLIN, deadline, "answer", timeoutMs, err)) return false;
    const ssize_t n = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    if (n == 0)
      return fail(err, "the broker closed the connection early: " + reader->incompleteReason());
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return fail(err, std::string("cannot read the broker's response: ") + std::strerror(errno));
    }
    std::string why;
    switch (reader->feed(buf, static_cast<size_t>(n), &why)) {
      case FrameReader::kNeedMore:
        break;
      case FrameReader::kDone:
        return true;
      case FrameReader::kError:
        return fail(err, "bad response from the broker: " + why);
    }
  }
}

// One connection: false with *err when there is no response; *busy when the broker could not
// take the connection (a full backlog; a busy answer is a response, resp->busy()).
bool attempt(const std::string& socketPath, const std::string& request, const CallOptions& o,
             int connectTimeoutMs, Response* resp, bool* busy, std::string* err) {
  const Socket s(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (s.fd() < 0) return fail(err, std::string("cannot create a socket: ") + std::strerror(errno));
  if (!connectTo(socketPath, s, connectTimeoutMs, busy, err) ||
      !checkServer(socketPath, s.fd(), o.trustedUids, err))
    return false;

  const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(o.timeoutMs);
  FrameReader reader(kMaxResponseBytes);
  std::string sendErr;
  // A broker that refuses the connection answers at once and closes, perhaps before the request
  // is sent (EPIPE here): its answer is still there to read.
  const bool sent = sendAll(s.fd(), request, deadline, o.timeoutMs, &sendErr);
  if (!receiveFrame(s.fd(), &reader, deadline, o.timeoutMs, err)) {
    if (!sent) *err = sendErr;
    return false;
  }
  if (!resp->ParseFromString(reader.payload()))
    return fail(err, "the broker's response is not a valid cushare.rpc.Response (" +
                         std::to_string(reader.payload().size()) + " bytes)");
  return true;
}

}  // namespace

bool call(const std::string& socketPath, const Request& req, Response* resp, std::string* err,
          const CallOptions& options) {
  const std::string request = frame(req);
  if (request.size() - kHeaderBytes > kMaxRequestBytes)
    return fail(err, "the request has " + std::to_string(request.size() - kHeaderBytes) +
                         " bytes, more than the broker accepts (" +
                         std::to_string(kMaxRequestBytes) + ")");
  const Clock::time_point giveUp = Clock::now() + std::chrono::milliseconds(options.busyRetryMs);
  // With retries, a full backlog is waited out in short connects, so the budget holds.
  const int connectTimeoutMs =
      options.busyRetryMs > 0 ? std::min(options.timeoutMs, 250) : options.timeoutMs;
  int backoffMs = 50, tries = 0;
  for (;;) {
    bool busy = false;
    resp->Clear();
    const bool answered = attempt(socketPath, request, options, connectTimeoutMs, resp, &busy, err);
    busy = busy || (answered && resp->busy());
    ++tries;
    if (!busy || options.busyRetryMs <= 0) return answered;
    const std::string why = answered ? resp->error() : *err;
    const Clock::time_point now = Clock::now();
    if (now >= giveUp)
      return fail(err, why + " (still busy after " + std::to_string(tries) + " tries in " +
                           seconds(options.busyRetryMs) + ")");
    // The last wait is cut short so that the last try falls on the deadline.
    std::this_thread::sleep_for(
        std::min<Clock::duration>(std::chrono::milliseconds(backoffMs), giveUp - now));
    backoffMs = std::min(backoffMs * 2, 400);
  }
}

bool call(const std::string& socketPath, const Request& req, Response* resp, std::string* err,
          int timeoutMs) {
  CallOptions o;
  o.timeoutMs = timeoutMs;
  return call(socketPath, req, resp, err, o);
}

// ---- fuzzing ---------------------------------------------------------------------------------

namespace {

// Feeds bytes in pieces of 1..32 bytes. The sizes come from a hash of the input, so a corpus
// file always splits the same way (a crash reproduces) while different inputs split differently.
FrameReader::Status feedInPieces(std::string_view bytes, FrameReader* reader, std::string* err) {
  uint64_t h = 14695981039346656037ull;  // FNV-1a
  for (const char c : bytes) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  FrameReader::Status status = FrameReader::kNeedMore;
  for (size_t pos = 0; pos < bytes.size() && status != FrameReader::kError;) {
    h = h * 6364136223846793005ull + 1442695040888963407ull;  // an LCG step per piece
    const size_t piece = std::min<size_t>(1 + (h >> 59), bytes.size() - pos);
    status = reader->feed(bytes.data() + pos, piece, err);
    pos += piece;
  }
  return status;
}

bool isOneLine(const std::string& s) { return !s.empty() && s.find('\n') == std::string::npos; }

}  // namespace

int decodeForFuzzing(const uint8_t* data, size_t n) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), n);
  Request whole;
  std::string wholeErr;
  const bool accepted = decodeRequestFrame(bytes, &whole, &wholeErr);
  if (!accepted && !isOneLine(wholeErr)) std::abort();

  // The broker reads from a non-blocking socket: any split of the bytes must decide the same.
  FrameReader reader(kMaxRequestBytes);
  std::string err;
  Request pieces;
  const bool piecesAccepted = feedInPieces(bytes, &reader, &err) == FrameReader::kDone &&
                              decodeRequest(reader.payload(), &pieces, &err);
  if (piecesAccepted != accepted) std::abort();

  // What the broker accepts, a client must be able to send again (frame() and the parser agree).
  Request again;
  if (accepted && !decodeRequestFrame(frame(whole), &again, &err)) std::abort();
  return accepted ? 1 : 0;
}

}  // namespace cushare::rpc
