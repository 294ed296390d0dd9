// See mps_client.h. The sticky error of a terminated or faulted client is the driver's own
// initialisation status turned into that error: every later API call returns it, as a real
// context's sticky error, at no cost to the calls themselves.
#include "mps_client.h"

#include "mig.h"
#include "probe_twin.h"

#include <pthread.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <unordered_map>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <thread>

#include "driver.h"
#include "engine.h"
#include "mps_protocol.h"
#include "mps_table.h"

namespace simgpu {
namespace {

MpsClientInfo gInfo;
uint32_t gMigTag = 0;  // this process's MIG device, said in the hello
std::atomic<const MpsClientInfo*> gClient{nullptr};
std::atomic<CUresult> gContextStatus{CUDA_SUCCESS};
std::atomic<CUresult> gSticky{CUDA_SUCCESS};
std::atomic<uint64_t> gUsed[kMaxDevices];
std::atomic<int> gFd{-1};
// What the daemon sends a client is short ("ok" with 16 limits at most); cuInit may run on a
// thread with a small stack, so no 64 KiB buffer here.
constexpr size_t kClientMessage = 4096;
MpsTable* gTable = nullptr;  // never unmapped: gEntry points into it until exit
MpsClientEntry* gEntry = nullptr;

// The direct connection to the server that runs this client's kernels (mps_protocol.h). Stream
// workers send their kernels and wait for the answer with the same id. No reader thread: one
// waiting worker at a time receives (the leader) and hands answers that are not its own to their
// waiters; when its own arrives it passes the role on. So a process with one busy stream pays one
// thread wake-up per kernel, not two. Leaked: workers may wait during exit.
struct ServerLink {
  std::atomic<int> fd{-1};
  std::atomic<uint64_t> nextId{1};
  std::mutex mu;
  std::condition_variable cv;
  std::unordered_map<uint64_t, MpsDone> done;  // answers not yet taken by their waiter
  std::unordered_map<uint64_t, std::vector<BlockTrace>> traces;  // traced kernels' blocks (MpsTrace)
  bool receiving = false;                      // under mu: a worker is in recv
  // The receiving worker's buffer: the largest answer (an MpsTrace) and one byte more.
  std::vector<char> rx = std::vector<char>(sizeof(MpsTrace) + kProbeMaxTracedBlocks * sizeof(BlockTrace) + 1);
  bool gone = false;                           // under mu: the server hung up
};
ServerLink* gLink = nullptr;

// A count with an optional binary unit: "1G", "512MB", "512M", "1048576".
bool parseLimit(const std::string& v, uint64_t* out) {
  char* end = nullptr;
  if (v.empty() || v[0] < '0' || v[0] > '9') return false;
  const unsigned long long n = std::strtoull(v.c_str(), &end, 10);
  std::string unit(end);
  if (!unit.empty() && (unit.back() == 'B' || unit.back() == 'b') && unit.size() == 2) unit.pop_back();
  int shift = 0;
  if (unit == "K" || unit == "k") shift = 10;
  else if (unit == "M" || unit == "m") shift = 20;
  else if (unit == "G" || unit == "g") shift = 30;
  else if (unit == "T" || unit == "t") shift = 40;
  else if (!unit.empty()) return false;
  if (n > (~0ull >> shift)) return false;
  *out = static_cast<uint64_t>(n) << shift;
  return true;
}

// CUDA_MPS_PINNED_DEVICE_MEM_LIMIT: "0=1G,1=512MB" (an ordinal or a device UUID before '=').
bool parseEnvLimits(const char* v, uint64_t out[kMaxDevices], std::string* why) {
  std::stringstream in(v);
  for (std::string item; std::getline(in, item, ',');) {
    const size_t eq = item.find('=');
    if (eq == std::string::npos) return *why = "\"" + item + "\" is not <device>=<size>", false;
    const std::string dev = item.substr(0, eq);
    int ordinal = -1;
    for (int d = 0; d < kMaxDevices; ++d)
      if (dev == std::to_string(d) || dev == deviceUuidString(d)) ordinal = d;
    // Inside a MIG device its own UUID names it (the process's device 0).
    if (ordinal < 0 && gMigTag != 0) {
      const int host = static_cast<int>(gMigTag & 0xff) - 1;
      const unsigned gi = ((gMigTag >> 8) & 0xff) - 1, ci = ((gMigTag >> 16) & 0xff) - 1;
      if (strcasecmp(dev.c_str(), mig::migUuid(host, gi, ci).c_str()) == 0) ordinal = 0;
    }
    uint64_t bytes = 0;
    if (ordinal < 0) return *why = "\"" + dev + "\" is not a device", false;
    if (!parseLimit(item.substr(eq + 1), &bytes) || bytes == 0)
      return *why = "\"" + item.substr(eq + 1) + "\" is not a size such as 1G or 512M", false;
    out[ordinal] = bytes;
  }
  return true;
}

void setSticky(CUresult r) {
  CUresult none = CUDA_SUCCESS;
  if (!gSticky.compare_exchange_strong(none, r)) return;
  Driver& d = drv();
  d.initResult = r;  // published by the release store below (initStatus loads with acquire)
  d.initState.store(2, std::memory_order_release);
}

void listen(int fd) {
  char buf[kClientMessage];
  for (;;) {
    const ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n <= 0) return;  // the daemon went away (quit): work already granted goes on
    const std::string msg(buf, static_cast<size_t>(n));
    if (msg == "terminate") {
      setSticky(CUDA_ERROR_MPS_CLIENT_TERMINATED);
      if (gEntry) gEntry->state.store(kMpsTerminated, std::memory_order_release);
      (void)!send(fd, "terminated", 10, MSG_NOSIGNAL);
    } else if (msg.compare(0, 6, "fault ") == 0) {
      setSticky(static_cast<CUresult>(std::atoi(msg.c_str() + 6)));
      if (gEntry) gEntry->state.store(kMpsFaulted, std::memory_order_release);
    }
  }
}

void clearEntry() {
  if (gEntry && gEntry->pid.load() == static_cast<int32_t>(getpid())) gEntry->pid.store(0, std::memory_order_release);
}

// A forked child is not the client: it gives the connection back so that the daemon sees the
// client's own exit.
void atforkChild() {
  const int fd = gFd.exchange(-1);
  if (fd >= 0) ::close(fd);
  if (gLink) {
    const int sfd = gLink->fd.exchange(-1);
    if (sfd >= 0) ::close(sfd);
    gLink = nullptr;  // the parent's (leaked); the child runs its own engine
  }
  gClient.store(nullptr);
  gEntry = nullptr;
}

// The server hung up (it died or quit): every waiting and later kernel fails with the sticky
// CUDA_ERROR_MPS_RPC_FAILURE, as the client's RPCs to a gone server would. Caller holds link->mu.
void serverGone(ServerLink* link) {
  setSticky(CUDA_ERROR_MPS_RPC_FAILURE);
  if (gEntry) gEntry->state.store(kMpsFaulted, std::memory_order_release);
  link->gone = true;
  link->cv.notify_all();
}

// Waits for the answer to kernel `id`, receiving as the leader when no other worker does.
bool awaitAnswer(ServerLink* link, uint64_t id, MpsDone* out) {
  std::unique_lock l(link->mu);
  for (;;) {
    if (auto it = link->done.find(id); it != link->done.end()) {
      *out = it->second;
      link->done.erase(it);
      return true;
    }
    if (link->gone) return false;
    if (link->receiving) {
      link->cv.wait(l);
      continue;
    }
    link->receiving = true;
    l.unlock();
    ssize_t n;
    do {
      n = recv(link->fd.load(), link->rx.data(), link->rx.size(), 0);
    } while (n < 0 && errno == EINTR);
    l.lock();
    link->receiving = false;
    uint32_t type = 0;
    if (n >= 4) std::memcpy(&type, link->rx.data(), 4);
    MpsTrace th;
    if (n >= static_cast<ssize_t>(sizeof th)) std::memcpy(&th, link->rx.data(), sizeof th);
    if (n == static_cast<ssize_t>(sizeof(MpsDone)) && type == kMpsDoneType) {
      MpsDone m;
      std::memcpy(&m, link->rx.data(), sizeof m);
      link->done[m.id] = m;
    } else if (type == kMpsTraceType && n >= static_cast<ssize_t>(sizeof th) && th.count <= kProbeMaxTracedBlocks &&
               static_cast<size_t>(n) == sizeof th + th.count * sizeof(BlockTrace)) {
      std::vector<BlockTrace>& t = link->traces[th.id];
      t.resize(th.count);
      if (th.count) std::memcpy(t.data(), link->rx.data() + sizeof th, th.count * sizeof(BlockTrace));
    } else {
      if (n > 0) std::fprintf(stderr, "simgpu: the MPS server sent a malformed answer; dropping the connection\n");
      serverGone(link);
    }
    link->cv.notify_all();  // the answer's waiter, or the next leader
  }
}

// Connects to the server that admitted this client and says hello; CUDA_SUCCESS or why not.
CUresult connectServer(const Config& cfg, const std::string& pipeDir, int serverPid) {
  const std::string path = mpsServerSocket(pipeDir, serverPid);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof addr.sun_path) return CUDA_ERROR_MPS_CONNECTION_FAILED;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (fd < 0) return CUDA_ERROR_MPS_CONNECTION_FAILED;
  MpsHello h;
  h.sms = cfg.smCount;
  h.mig = gMigTag;
  h.timeScale = cfg.timeScale;
  MpsDone answer;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      send(fd, &h, sizeof h, MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof h) ||
      recv(fd, &answer, sizeof answer, 0) != static_cast<ssize_t>(sizeof answer) || answer.type != kMpsDoneType) {
    std::fprintf(stderr, "simgpu: cannot reach the MPS server at %s: %s\n", path.c_str(), std::strerror(errno));
    ::close(fd);
    return CUDA_ERROR_MPS_CONNECTION_FAILED;
  }
  if (answer.status != CUDA_SUCCESS) {
    std::fprintf(stderr,
                 "simgpu: the MPS server refused this client (%d): SIMGPU_SMS and SIMGPU_TIME_SCALE must be the "
                 "control daemon's, and the MIG device it runs in this process's (its server.log says which)\n",
                 answer.status);
    ::close(fd);
    return static_cast<CUresult>(answer.status);
  }
  gLink = new ServerLink;
  gLink->fd.store(fd);
  return CUDA_SUCCESS;
}

void refuseContexts(const std::string& line) {
  std::fprintf(stderr, "simgpu: %s\n", line.c_str());
  gContextStatus.store(CUDA_ERROR_MPS_CONNECTION_FAILED);
}

}  // namespace

void mpsAttach(const Config& cfg, uint32_t migTag) {
  gMigTag = migTag;
  const char* dir = std::getenv("CUDA_MPS_PIPE_DIRECTORY");
  const std::string path = std::string(dir && *dir ? dir : kMpsDefaultPipeDir) + "/" + kMpsControlSocket;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof addr.sun_path) return;  // as the real driver: no daemon found
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (fd < 0) return;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    return;  // no daemon: not a client
  }
  // The client's own variables, read once here, as the real driver reads them at start.
  std::string pct = "-", prio = "-";
  if (const char* v = std::getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")) {
    char* end = nullptr;
    const double p = std::strtod(v, &end);
    if (!*v || *end || !(p > 0) || p > 100) {
      ::close(fd);
      return refuseContexts(std::string("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=\"") + v +
                            "\": expected a percentage above 0, at most 100");
    }
    pct = v;
  }
  if (const char* v = std::getenv("CUDA_MPS_CLIENT_PRIORITY")) {
    if (std::strcmp(v, "0") != 0 && std::strcmp(v, "1") != 0) {
      ::close(fd);
      return refuseContexts(std::string("CUDA_MPS_CLIENT_PRIORITY=\"") + v + "\": expected 0 or 1");
    }
    prio = v;
  }
  uint64_t envLimits[kMaxDevices] = {};
  if (const char* v = std::getenv("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")) {
    std::string why;
    if (!parseEnvLimits(v, envLimits, &why)) {
      ::close(fd);
      return refuseContexts(std::string("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=\"") + v + "\": " + why);
    }
  }
  const std::string hello = "client " + pct + " " + prio;
  char buf[kClientMessage];
  ssize_t n = send(fd, hello.data(), hello.size(), MSG_NOSIGNAL);
  if (n == static_cast<ssize_t>(hello.size())) n = recv(fd, buf, sizeof buf, 0);  // waits while pending
  if (n <= 0) {
    ::close(fd);
    gContextStatus.store(CUDA_ERROR_MPS_CONNECTION_FAILED);
    return;
  }
  std::istringstream in(std::string(buf, static_cast<size_t>(n)));
  std::string kind;
  in >> kind;
  if (kind != "ok") {
    int code = CUDA_ERROR_MPS_CONNECTION_FAILED;
    in >> code;
    ::close(fd);
    gContextStatus.store(static_cast<CUresult>(code));
    return;
  }
  long long pctX10 = 1000;
  in >> gInfo.serverPid >> pctX10 >> gInfo.priority;
  gInfo.uid = getuid();
  gInfo.threadPctX10 = static_cast<uint32_t>(std::clamp<long long>(pctX10, 1, 1000));
  gInfo.smCap = mpsSmCap(gInfo.threadPctX10, cfg.smCount);
  for (std::string item; in >> item;) {
    const size_t eq = item.find('=');
    const int dev = std::atoi(item.substr(0, eq).c_str());
    if (eq != std::string::npos && dev >= 0 && dev < kMaxDevices)
      gInfo.pinnedLimit[dev] = std::strtoull(item.c_str() + eq + 1, nullptr, 10);
  }
  for (int d = 0; d < kMaxDevices; ++d)  // the client's own limit can only lower the server's
    if (envLimits[d] && (gInfo.pinnedLimit[d] == 0 || envLimits[d] < gInfo.pinnedLimit[d]))
      gInfo.pinnedLimit[d] = envLimits[d];
  if (const CUresult r = connectServer(cfg, dir && *dir ? dir : kMpsDefaultPipeDir, gInfo.serverPid); r != CUDA_SUCCESS) {
    ::close(fd);  // the daemon sees this client leave
    gContextStatus.store(r);
    return;
  }
  std::string err;
  if (MpsTable* t = gTable = MpsTable::open(cfg.stateDir, &err)) {
    MpsClientEntry e{};
    e.server_pid = gInfo.serverPid;
    e.uid = gInfo.uid;
    e.sm_cap = gInfo.smCap;
    e.thread_pct_x10 = gInfo.threadPctX10;
    e.priority = gInfo.priority;
    e.state.store(kMpsActive);
    for (int d = 0; d < kMpsTableLimits; ++d) e.pinned_limit[d] = gInfo.pinnedLimit[d];
    gEntry = t->publish(e);
    std::atexit(clearEntry);
  } else {
    std::fprintf(stderr, "simgpu: MPS client table: %s\n", err.c_str());
  }
  gFd.store(fd);
  pthread_atfork(nullptr, nullptr, atforkChild);
  gClient.store(&gInfo, std::memory_order_release);
  std::thread(listen, fd).detach();
}

const MpsClientInfo* mpsClient() { return gClient.load(std::memory_order_acquire); }

CUresult mpsRunKernel(int hostDev, uint64_t context, int streamPriority, const KernelShape& k, uint64_t startNs,
                      uint32_t queuedBehind, uint64_t* endNs, std::vector<BlockTrace>* traces) {
  ServerLink* link = gLink;
  *endNs = startNs;
  if (const CUresult sticky = mpsClientStatus(); sticky != CUDA_SUCCESS) return sticky;
  if (!link) return CUDA_ERROR_MPS_RPC_FAILURE;
  MpsKernel m;
  m.device = static_cast<uint32_t>(hostDev);
  m.id = link->nextId.fetch_add(1, std::memory_order_relaxed);
  m.context = context;
  m.blocks = k.blocks;
  m.threadsPerBlock = k.threadsPerBlock;
  m.registersPerThread = k.registersPerThread;
  m.sharedPerBlock = k.sharedPerBlock;
  m.streamPriority = streamPriority;
  m.blockNs = k.blockNs;
  m.startNs = startNs;
  m.queuedBehind = queuedBehind;
  m.timeBoxNs = k.timeBoxNs;
  m.flags = traces ? kMpsTraceBlocks : 0;
  // One packet per kernel: concurrent sends from several stream workers never interleave.
  if (send(link->fd.load(), &m, sizeof m, MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof m)) {
    std::lock_guard l(link->mu);
    serverGone(link);
    return CUDA_ERROR_MPS_RPC_FAILURE;
  }
  MpsDone d;
  if (!awaitAnswer(link, m.id, &d)) return CUDA_ERROR_MPS_RPC_FAILURE;
  *endNs = std::max(startNs, d.endNs);
  if (traces) {
    // Sent before the MpsDone on the same connection: here by now, unless the kernel failed.
    std::lock_guard l(link->mu);
    if (auto t = link->traces.find(m.id); t != link->traces.end()) {
      *traces = std::move(t->second);
      link->traces.erase(t);
    }
    if (d.status == 0 && traces->size() != k.blocks) traces->assign(k.blocks, BlockTrace{});  // lost: no block ran
  }
  return static_cast<CUresult>(d.status);
}
CUresult mpsContextStatus() { return gContextStatus.load(std::memory_order_relaxed); }
CUresult mpsClientStatus() { return gSticky.load(std::memory_order_relaxed); }

int mpsVisibleSms(int deviceSms) {
  const MpsClientInfo* c = mpsClient();
  return c ? static_cast<int>(c->smCap) : deviceSms;
}

bool mpsReserve(int dev, uint64_t bytes) {
  const MpsClientInfo* c = mpsClient();
  if (!c) return true;
  const uint64_t limit = c->pinnedLimit[dev];
  uint64_t used = gUsed[dev].load(std::memory_order_relaxed);
  do {
    if (limit && (bytes > limit || used > limit - bytes)) return false;
  } while (!gUsed[dev].compare_exchange_weak(used, used + bytes, std::memory_order_relaxed));
  return true;
}

void mpsRelease(int dev, uint64_t bytes) {
  if (mpsClient()) gUsed[dev].fetch_sub(bytes, std::memory_order_relaxed);
}

}  // namespace simgpu

// A simulated device fault, for tests and host kernel bodies (simgpu.h): this process's context
// takes `error` as its sticky error and, as an MPS client, its server enters the FAULT state.
extern "C" SIMGPU_EXPORT void simgpu_debug_fault(int error) {
  using namespace simgpu;
  setSticky(static_cast<CUresult>(error));
  if (gEntry) gEntry->state.store(kMpsFaulted, std::memory_order_release);
  const int fd = gFd.load();
  if (fd >= 0 && mpsClient()) {
    const std::string m = "fault " + std::to_string(error);
    (void)!send(fd, m.data(), m.size(), MSG_NOSIGNAL);
  }
}
