// nvidia-cuda-mps-server, simulated: started by the control daemon (under the uid it serves), it
// connects back on <pipe>/control, writes its startup lines to server.log through the daemon (as
// the real server's log FIFO) and lives until the daemon says "quit" or goes away.
//
// As the real server runs all its clients' work in one GPU context, this process runs ONE device
// engine per device for all its clients (src/device_runner.h): it joins each device's time-slice
// board as one slot (the whole server is one context to the time slicer) and gives every client
// context an engine context with that client's SM cap and priority, so clients run side by side
// and share the SMs (caps summing over 100 % contend for them). Clients send each kernel's shape
// on their own connection to <pipe>/mps-server-<pid> and wait for its completion time (protocol:
// src/mps/mps_protocol.h); what each client got is published beside the board (BoardClient).
//
// A single thread: one epoll loop over the daemon's connection, the listening socket, the
// clients' connections and a timer set to the engines' next event (CLOCK_MONOTONIC, absolute).
// Invariants: only clients the daemon admitted (by SO_PEERCRED pid, and this server's uid) get a
// connection; every kernel a live client sent is answered exactly once (its end, or an error when
// terminate_client ended it); a client's hang-up drops its waiting work (its running blocks
// finish) and its published stats.
#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/timerfd.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <atomic>
#include <ctime>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "config.h"
#include "device_runner.h"
#include "mig.h"
#include "mps_protocol.h"
#include "probe_twin.h"

namespace simgpu::mps {
namespace {

constexpr int kMaxContextsPerClient = 64;  // per device; beyond: CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED
constexpr uint64_t kMaxBlockNs = uint64_t{1} << 50;
constexpr uint32_t kMaxQueuedHint = 1 << 16;  // about 13 days: beyond it the engine's times could wrap
constexpr int kCudaSuccess = 0;
constexpr int kCudaInvalidValue = 1;
constexpr int kMpsConnectionFailed = 805;
constexpr int kMpsMaxConnectionsReached = 809;
constexpr int kMpsClientTerminated = 810;

uint64_t monotonicNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1'000'000'000ull + static_cast<uint64_t>(ts.tv_nsec);
}

struct Admitted {  // what the daemon granted a client
  uint32_t pctX10 = 1000;
  int priority = 0;
};

struct Client {
  int fd = -1;
  int32_t pid = 0;
  bool hello = false;
  bool terminated = false;  // terminate_client: its kernels are answered with the error at once
  uint32_t smCap = 0;
  int priority = 0;
  std::map<std::pair<uint32_t, uint64_t>, int> contexts;  // (device, its context id) -> engine context
  uint32_t queued[kMaxDevices] = {};                       // its last queuedBehind per device
  BoardClient* stats[kMaxDevices] = {};                    // its published stats per device
};

struct Pending {  // a kernel in an engine, waiting for its answer
  int client;     // fd of the client's connection
  uint64_t id;    // the client's id
  bool traced = false;  // answer its blocks' traces (MpsTrace) before its MpsDone
  uint64_t blocks = 0;
};

struct Device {
  std::unique_ptr<DeviceRunner> runner;
  std::atomic<int64_t> queued{0};  // sum of its clients' queuedBehind
  std::unordered_map<uint64_t, Pending> pending;  // engine kernel id -> who waits
  std::vector<std::pair<uint64_t, uint64_t>> completed;  // (engine id, end) since the last answer
  std::unordered_map<uint64_t, std::vector<BlockEvent>> traces;  // traced kernels' block events
};

// The MIG device a server runs in (its daemon's CUDA_VISIBLE_DEVICES names one): all its
// clients' work runs there, on that compute instance's SMs and time-slice board.
struct MigPlace {
  uint32_t tag = 0;  // mig::migTag; 0: a whole GPU
  int host = 0;
  unsigned gi = 0, ci = 0;
  std::string name;  // "MIG-..." for messages
};

class Server {
 public:
  Server(const Config& cfg, int daemonFd, std::string pipeDir, MigPlace mig)
      : cfg_(cfg), daemon_(daemonFd), pipeDir_(std::move(pipeDir)), mig_(std::move(mig)) {}
  int run();

 private:
  bool say(const std::string& m) {
    return send(daemon_, m.data(), m.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(m.size());
  }
  void log(const std::string& m) { say("log " + m); }
  bool listenSocket(std::string* why);
  bool drainDaemon();  // false: quit or the daemon is gone
  void accept();
  void onClient(int fd);
  void onHello(Client& c, const MpsHello& h);
  void onKernel(Client& c, const MpsKernel& k);
  void answer(int fd, uint64_t id, int status, uint64_t endNs);
  void answerTrace(int fd, uint64_t id, uint64_t blocks, const std::vector<BlockEvent>& events);
  void dropClient(Client& c, int status);  // drops its waiting work; answers it with status (0: it is gone)
  void closeClient(int fd);
  void terminate(int32_t pid);
  Device& device(uint32_t dev);
  BoardClient* claimStats(Device& d, int32_t pid);
  void stepAll();
  void publish(Device& d, uint32_t dev);
  uint64_t deviceNow() const { return static_cast<uint64_t>(static_cast<double>(monotonicNs()) / cfg_.timeScale); }

  Config cfg_;
  int daemon_;
  std::string pipeDir_;
  MigPlace mig_;
  std::string socketPath_;
  int listen_ = -1, epoll_ = -1, timer_ = -1;
  std::map<int32_t, Admitted> admitted_;
  std::unordered_map<int, Client> clients_;  // by fd
  Device devices_[kMaxDevices];
  bool quit_ = false;
  // Started by a daemon run with -multiuser-server: clients of every uid, not only its own.
  const bool multiuser_ = [] {
    const char* v = std::getenv("SIMGPU_MPS_MULTIUSER");
    return v != nullptr && std::string(v) == "1";
  }();
};

bool Server::listenSocket(std::string* why) {
  // The daemon made it (kMpsServerListenFd); this server only owns it.
  socketPath_ = mpsServerSocket(pipeDir_, getpid());
  int listening = 0;
  socklen_t len = sizeof listening;
  if (getsockopt(kMpsServerListenFd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0 || !listening) {
    *why = "no listening socket at descriptor " + std::to_string(kMpsServerListenFd) +
           ": nvidia-cuda-mps-server is started by nvidia-cuda-mps-control";
    return false;
  }
  listen_ = kMpsServerListenFd;
  fcntl(listen_, F_SETFD, FD_CLOEXEC);
  fcntl(listen_, F_SETFL, fcntl(listen_, F_GETFL) | O_NONBLOCK);
  return true;
}

bool Server::drainDaemon() {
  char buf[kMpsMaxMessage];
  for (;;) {
    const ssize_t n = recv(daemon_, buf, sizeof buf, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;  // the daemon went away
    std::istringstream in(std::string(buf, static_cast<size_t>(n)));
    std::string word;
    in >> word;
    if (word == "quit") {
      log("Server is shutting down");
      return false;
    }
    int32_t pid = 0;
    if (word == "client") {
      Admitted a;
      if (in >> pid >> a.pctX10 >> a.priority && pid > 0 && a.pctX10 >= 1 && a.pctX10 <= 1000) admitted_[pid] = a;
    } else if (word == "terminate" && in >> pid) {
      terminate(pid);
      say("terminated " + std::to_string(pid));
    }
  }
}

void Server::accept() {
  for (;;) {
    const int fd = accept4(listen_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) return;
    ucred cred{};
    socklen_t len = sizeof cred;
    // The daemon tells this server about a client before it tells the client where to go: read
    // what it said so far before judging this one.
    if (!drainDaemon()) quit_ = true;
    const bool known = getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0;
    bool connected = false;  // one connection per client process
    for (auto& [other, c] : clients_) connected = connected || (known && c.pid == cred.pid);
    if (!known || (cred.uid != getuid() && !multiuser_) || !admitted_.count(cred.pid) || connected || quit_) {
      log("Refused a connection from PID " + std::to_string(cred.pid) + ": not an admitted client of this server");
      ::close(fd);
      continue;
    }
    Client c;
    c.fd = fd;
    c.pid = cred.pid;
    const Admitted& a = admitted_[cred.pid];
    c.smCap = mpsSmCap(a.pctX10, cfg_.smCount);
    c.priority = a.priority;
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    epoll_ctl(epoll_, EPOLL_CTL_ADD, fd, &ev);
    clients_[fd] = c;
  }
}

void Server::answer(int fd, uint64_t id, int status, uint64_t endNs) {
  MpsDone d;
  d.status = status;
  d.id = id;
  d.endNs = endNs;
  // A client's receive buffer holds hundreds of answers; one that lets it fill up (it stopped
  // reading) loses the answer, as a dead client would.
  (void)!send(fd, &d, sizeof d, MSG_NOSIGNAL | MSG_DONTWAIT);
}

void Server::answerTrace(int fd, uint64_t id, uint64_t blocks, const std::vector<BlockEvent>& events) {
  std::vector<BlockTrace> traces;
  foldBlockEvents(events, blocks, &traces);
  MpsTrace h;
  h.count = static_cast<uint32_t>(traces.size());
  h.id = id;
  std::vector<char> m(sizeof h + traces.size() * sizeof(BlockTrace));
  std::memcpy(m.data(), &h, sizeof h);
  if (!traces.empty()) std::memcpy(m.data() + sizeof h, traces.data(), traces.size() * sizeof(BlockTrace));
  (void)!send(fd, m.data(), m.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
}

void Server::onClient(int fd) {
  for (;;) {
    auto it = clients_.find(fd);
    if (it == clients_.end()) return;
    Client& c = it->second;
    alignas(8) char buf[sizeof(MpsKernel) + 8];  // one more than the largest: a longer packet is malformed
    const ssize_t n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    uint32_t type = 0;
    if (n >= 4) std::memcpy(&type, buf, 4);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {  // the client exited or was killed: its waiting work goes
      closeClient(fd);
      return;
    }
    if (!c.hello && n == sizeof(MpsHello) && type == kMpsHelloType) {
      MpsHello h;
      std::memcpy(&h, buf, sizeof h);
      onHello(c, h);
    } else if (c.hello && n == sizeof(MpsKernel) && type == kMpsKernelType) {
      MpsKernel k;
      std::memcpy(&k, buf, sizeof k);
      onKernel(c, k);
    } else {
      log("Client {PID: " + std::to_string(c.pid) + "} sent a malformed message (" + std::to_string(n) +
          " bytes); dropping its connection");
      closeClient(fd);
      return;
    }
  }
}

void Server::onHello(Client& c, const MpsHello& h) {
  // One server per MIG device (the MIG guide's "MIG with CUDA MPS"): a client of another MIG
  // device, or of a whole GPU, has no context here.
  if (h.version == kMpsWireVersion && h.mig != mig_.tag) {
    log("Client {PID: " + std::to_string(c.pid) + "} refused: it runs " +
        (h.mig ? "in another MIG device" : std::string("outside MIG devices")) + ", this server " +
        (mig_.tag ? "in MIG device " + mig_.name : std::string("on whole GPUs")) +
        " (one MPS control daemon per MIG device, each with its own pipe directory)");
    answer(c.fd, 0, kMpsConnectionFailed, 0);
    closeClient(c.fd);
    return;
  }
  if (h.version != kMpsWireVersion || h.sms != cfg_.smCount || h.timeScale != cfg_.timeScale) {
    log("Client {PID: " + std::to_string(c.pid) + "} refused: it runs with SIMGPU_SMS=" + std::to_string(h.sms) +
        " and SIMGPU_TIME_SCALE=" + std::to_string(h.timeScale) + ", this server with " +
        std::to_string(cfg_.smCount) + " and " + std::to_string(cfg_.timeScale));
    answer(c.fd, 0, kMpsConnectionFailed, 0);
    closeClient(c.fd);
    return;
  }
  c.hello = true;
  answer(c.fd, 0, kCudaSuccess, 0);
}

Device& Server::device(uint32_t dev) {
  Device& d = devices_[dev];
  if (!d.runner) {
    EngineParams p;
    p.sms = cfg_.smCount;
    p.sliceNs = cfg_.sliceNs;
    p.switchNs = cfg_.switchNs;
    d.runner = std::make_unique<DeviceRunner>(
        p, [&d](uint64_t id, uint64_t end) { d.completed.emplace_back(id, end); }, &d.queued);
    d.runner->engine().setBlockObserver([&d](const BlockEvent& e) { d.traces[e.kernel].push_back(e); });
    std::string err;
    Board* b = openBoard(cfg_.stateDir, mig_.tag ? mig::migBoard(mig_.host, mig_.gi, mig_.ci) : static_cast<int>(dev), &err);
    if (!b || !d.runner->joinBoard(b, getpid(), true, &err))
      log("Device " + std::to_string(dev) + ": " + err + "; this server does not take turns with other processes");
  }
  return d;
}

BoardClient* Server::claimStats(Device& d, int32_t pid) {
  Board* b = d.runner->board();
  if (!b) return nullptr;
  const int32_t self = getpid();
  for (BoardClient& e : b->client) {
    int32_t seen = e.pid.load(std::memory_order_acquire);
    const bool free = seen == 0 || (seen < 0 && !pidAlive(-seen)) ||
                      (seen > 0 && (!pidAlive(seen) || !pidAlive(e.server.load(std::memory_order_relaxed))));
    if (!free || !e.pid.compare_exchange_strong(seen, -self, std::memory_order_acq_rel)) continue;
    e.server.store(self, std::memory_order_relaxed);
    e.busyNs.store(0), e.busySmNs.store(0), e.blocksRun.store(0), e.kernelsRun.store(0), e.slicedOutNs.store(0);
    e.updatedNs.store(0);
    e.pid.store(pid, std::memory_order_release);
    return &e;
  }
  log("No room to publish the statistics of client {PID: " + std::to_string(pid) + "}");
  return nullptr;
}

void Server::onKernel(Client& c, const MpsKernel& k) {
  if (c.terminated) return answer(c.fd, k.id, kMpsClientTerminated, k.startNs);
  if (k.device >= static_cast<uint32_t>(cfg_.deviceCount) || (mig_.tag && k.device != static_cast<uint32_t>(mig_.host)) ||
      k.blocks == 0 || k.threadsPerBlock == 0 ||
      k.threadsPerBlock > 1024 || k.blockNs > kMaxBlockNs || k.timeBoxNs > kMaxBlockNs ||
      (k.flags & ~kMpsTraceBlocks) || ((k.flags & kMpsTraceBlocks) && k.blocks > kProbeMaxTracedBlocks))
    return answer(c.fd, k.id, kCudaInvalidValue, k.startNs);
  Device& d = device(k.device);
  auto key = std::make_pair(k.device, k.context);
  auto it = c.contexts.find(key);
  if (it == c.contexts.end()) {
    int onDevice = 0;
    for (auto& [dk, ctx] : c.contexts) onDevice += dk.first == k.device;
    if (onDevice >= kMaxContextsPerClient) return answer(c.fd, k.id, kMpsMaxConnectionsReached, k.startNs);
    it = c.contexts.emplace(key, d.runner->engine().addContext(0, c.smCap, c.priority)).first;
    if (!c.stats[k.device]) c.stats[k.device] = claimStats(d, c.pid);
  }
  // Only whether it is above 0 matters (the server wants the device); bounded all the same.
  const uint32_t behind = std::min<uint32_t>(k.queuedBehind, kMaxQueuedHint);
  d.queued.fetch_add(static_cast<int64_t>(behind) - c.queued[k.device]);
  c.queued[k.device] = behind;
  KernelShape s;
  s.blocks = k.blocks;
  s.threadsPerBlock = k.threadsPerBlock;
  s.registersPerThread = k.registersPerThread;
  s.sharedPerBlock = k.sharedPerBlock;
  s.blockNs = k.blockNs;
  s.timeBoxNs = k.timeBoxNs;
  s.traceBlocks = (k.flags & kMpsTraceBlocks) != 0;
  // Its stream cannot have reached a time beyond now (same clock); a later claim starts now.
  const uint64_t start = std::min(k.startNs, deviceNow());
  const uint64_t id = d.runner->submit(it->second, k.streamPriority, s, start);
  // A kernel that completes inside submit (no SM fits its block) is answered after the step too.
  d.pending[id] = Pending{c.fd, k.id, s.traceBlocks, s.blocks};
}

void Server::dropClient(Client& c, int status) {
  for (auto& [key, ctx] : c.contexts) {
    Device& d = devices_[key.first];
    d.runner->engine().dropContext(ctx);
  }
  for (uint32_t dev = 0; dev < kMaxDevices; ++dev) {
    Device& d = devices_[dev];
    if (c.queued[dev]) d.queued.fetch_sub(c.queued[dev]);
    c.queued[dev] = 0;
    for (auto it = d.pending.begin(); it != d.pending.end();) {
      if (it->second.client != c.fd) {
        ++it;
        continue;
      }
      if (status) answer(c.fd, it->second.id, status, deviceNow());
      d.traces.erase(it->first);
      it = d.pending.erase(it);
    }
  }
}

void Server::closeClient(int fd) {
  auto it = clients_.find(fd);
  if (it == clients_.end()) return;
  Client& c = it->second;
  dropClient(c, 0);
  for (BoardClient* s : c.stats)
    if (s) s->pid.store(0, std::memory_order_release);
  admitted_.erase(c.pid);
  epoll_ctl(epoll_, EPOLL_CTL_DEL, fd, nullptr);
  ::close(fd);
  clients_.erase(it);
}

void Server::terminate(int32_t pid) {
  for (auto& [fd, c] : clients_) {
    if (c.pid != pid) continue;
    c.terminated = true;
    dropClient(c, kMpsClientTerminated);
    log("Client {PID: " + std::to_string(pid) + "} terminated: its outstanding work is ended");
  }
}

void Server::publish(Device& d, uint32_t dev) {
  for (auto& [fd, c] : clients_) {
    BoardClient* e = c.stats[dev];
    if (!e) continue;
    ContextStats sum;
    for (auto& [key, ctx] : c.contexts) {
      if (key.first != dev) continue;
      const ContextStats& s = d.runner->engine().stats(ctx);
      sum.busyNs += s.busyNs;
      sum.busySmNs += s.busySmNs;
      sum.blocksRun += s.blocksRun;
      sum.kernelsRun += s.kernelsRun;
      sum.slicedOutNs += s.slicedOutNs;
    }
    e->updatedNs.store(kBoardWriting, std::memory_order_relaxed);  // the seqlock (timeslice_board.h)
    std::atomic_thread_fence(std::memory_order_release);
    e->busyNs.store(sum.busyNs, std::memory_order_relaxed);
    e->busySmNs.store(sum.busySmNs, std::memory_order_relaxed);
    e->blocksRun.store(sum.blocksRun, std::memory_order_relaxed);
    e->kernelsRun.store(sum.kernelsRun, std::memory_order_relaxed);
    e->slicedOutNs.store(sum.slicedOutNs, std::memory_order_relaxed);
    e->updatedNs.store(d.runner->engine().now(), std::memory_order_release);
  }
}

void Server::stepAll() {
  uint64_t next = DeviceRunner::kNever;
  for (uint32_t dev = 0; dev < kMaxDevices; ++dev) {
    Device& d = devices_[dev];
    if (!d.runner) continue;
    next = std::min(next, d.runner->step(deviceNow()));
    for (auto [id, end] : d.completed) {
      auto it = d.pending.find(id);
      auto tr = d.traces.find(id);
      std::vector<BlockEvent> events;
      if (tr != d.traces.end()) events = std::move(tr->second), d.traces.erase(tr);
      if (it == d.pending.end()) continue;  // its client is gone
      if (it->second.traced) answerTrace(it->second.client, it->second.id, it->second.blocks, events);
      answer(it->second.client, it->second.id, kCudaSuccess, end);
      d.pending.erase(it);
    }
    d.completed.clear();
    publish(d, dev);
  }
  itimerspec t{};
  if (next != DeviceRunner::kNever) {
    const uint64_t real = static_cast<uint64_t>(static_cast<double>(next) * cfg_.timeScale) + 1;
    t.it_value.tv_sec = static_cast<time_t>(real / 1'000'000'000ull);
    t.it_value.tv_nsec = static_cast<long>(real % 1'000'000'000ull);
  }
  timerfd_settime(timer_, TFD_TIMER_ABSTIME, &t, nullptr);  // all zero: disarmed
}

int Server::run() {
  std::string why;
  if (!listenSocket(&why)) {
    log(why);
    return 1;
  }
  log("Server has started");
  if (!say("ready")) return 1;
  epoll_ = epoll_create1(EPOLL_CLOEXEC);
  timer_ = timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC | TFD_NONBLOCK);
  if (epoll_ < 0 || timer_ < 0) {
    log(std::string("cannot create the event loop: ") + std::strerror(errno));
    return 1;
  }
  for (int fd : {daemon_, listen_, timer_}) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    epoll_ctl(epoll_, EPOLL_CTL_ADD, fd, &ev);
  }
  epoll_event evs[64];
  while (!quit_) {
    const int n = epoll_wait(epoll_, evs, 64, -1);
    if (n < 0 && errno != EINTR) break;
    for (int i = 0; i < n && !quit_; ++i) {
      const int fd = evs[i].data.fd;
      if (fd == daemon_) {
        if (!drainDaemon()) quit_ = true;
      } else if (fd == listen_) {
        accept();
      } else if (fd == timer_) {
        uint64_t expirations;
        (void)!read(timer_, &expirations, sizeof expirations);
      } else {
        onClient(fd);
      }
    }
    stepAll();
  }
  ::unlink(socketPath_.c_str());  // the daemon does it too, when this server's user may not
  for (auto& [fd, c] : clients_)
    for (BoardClient* s : c.stats)
      if (s) s->pid.store(0, std::memory_order_release);
  return 0;
}

}  // namespace
}  // namespace simgpu::mps

int main() {
  const char* dir = std::getenv("CUDA_MPS_PIPE_DIRECTORY");
  const std::string pipeDir = dir && *dir ? dir : simgpu::kMpsDefaultPipeDir;
  const std::string path = pipeDir + "/" + simgpu::kMpsControlSocket;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (fd < 0 || path.size() >= sizeof addr.sun_path) return 1;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) return 1;
  auto say = [&](const std::string& m) { return send(fd, m.data(), m.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(m.size()); };
  simgpu::Config cfg;
  std::string err;
  const bool configured = simgpu::loadConfig(&cfg, &err);
  if (!say("server")) return 1;
  say("log Startup");
  say("log Connecting to control daemon on socket: " + path);
  say("log Initializing server process");
  if (!configured) {
    say("log " + err);
    return 1;
  }
  // Started by a daemon whose CUDA_VISIBLE_DEVICES names a MIG device: the server runs there (its
  // SMs are the compute instance's). One that names no MIG device has no device to run on.
  simgpu::mps::MigPlace place;
  if (const std::string entry = simgpu::mig::firstMigEntry(std::getenv("CUDA_VISIBLE_DEVICES"));
      !entry.empty() && cfg.model) {
    simgpu::mig::State st;
    simgpu::mig::MigDevice m;
    int host = 0;
    if (!simgpu::mig::load(cfg.stateDir, &st, &err) ||
        !simgpu::mig::findMigDevice(*cfg.model, st, cfg.container, cfg.containerCount, entry, &host, &m)) {
      say("log Server could not start: CUDA_VISIBLE_DEVICES=" + entry + " names no MIG device" +
          (err.empty() ? "" : " (" + err + ")"));
      return 1;
    }
    place = {simgpu::mig::migTag(host, m.gi, m.ci), host, m.gi, m.ci, simgpu::mig::migUuid(host, m.gi, m.ci)};
    cfg.smCount = m.ciProfile.sms;
    cfg.name = simgpu::mig::migDeviceName(*cfg.model, m);
    say("log Creating server context on MIG device " + place.name + " (" + cfg.name + ")");
  } else {
    for (int d = 0; d < cfg.deviceCount; ++d)
      say("log Creating server context on device " + std::to_string(d) + " (" + cfg.name + ")");
  }
  say("log CUDA MPS Server for Linux/Unix. Binary version: " + std::to_string(simgpu::kMpsBinaryVersion));
  // The server's socket listens before the daemon hears "ready" (so before any client is admitted).
  simgpu::mps::Server server(cfg, fd, pipeDir, place);
  return server.run();
}
