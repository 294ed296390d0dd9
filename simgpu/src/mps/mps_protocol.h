// The simulated MPS's wire protocol: what the control daemon (simgpu/mps/), its servers, the
// control client and simgpu's driver (an MPS client) say to each other on <pipe>/control.
//
// Invariants:
// - One AF_UNIX SOCK_SEQPACKET socket, as the real daemon's: every message is one packet of
//   text, at most kMpsMaxMessage bytes. The daemon learns who is calling from the first packet
//   ("ui", "client ...", "server") and the caller's pid and uid from SO_PEERCRED, never from the
//   message.
// - A UI sends one command per packet and gets exactly one answer packet per command (the text
//   the control client prints; empty for commands that print nothing).
// - A client's first packet is "client <pct|-> <priority|->" (its CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
//   and CUDA_MPS_CLIENT_PRIORITY). The answer comes when the daemon admits or refuses it (a
//   pending client waits): "ok <server pid> <pct x10> <priority> <dev>=<bytes>..." (the server's
//   pinned limits, 0 bytes = none) or "err <CUresult>". Then the connection stays open for the
//   client's life: the daemon sends "terminate" (answered "terminated") or "fault <CUresult>";
//   the client sends "fault <CUresult>" when it faults. Its hang-up is its exit (kill -9 too).
// - A server's first packet is "server"; then "log <line>" packets (the daemon writes them to
//   server.log, as the real server's log FIFO) and "ready" once started (INITIALIZING -> ACTIVE);
//   the daemon sends "quit", "client <pid> <pct x10> <priority>" when it admits a client (before
//   the client's "ok", so the server knows the client before the client can reach it) and
//   "terminate <pid>" for terminate_client (the server drops that client's work and answers
//   "terminated <pid>").
// - Each server also listens on its own SOCK_SEQPACKET socket, <pipe>/mps-server-<pid> (mode 0666;
//   the server takes only its admitted clients, by SO_PEERCRED pid and uid). An admitted client
//   connects once and speaks in binary, fixed-size packets (below, host byte order: the socket is
//   local): MpsHello, answered by an MpsDone with id 0 (status 0, or why it is refused); then one
//   MpsKernel per kernel, answered by an MpsDone with the same id when the server's engine
//   completed it (several may be outstanding: one per stream). A kernel sent with kMpsTraceBlocks
//   (a probe kernel's twin: simgpu/src/probe_twin.h) gets, right before its MpsDone, one MpsTrace
//   packet: a header and one BlockTrace per block (what the engine gave each block). A packet of another size or type,
//   or with values out of range, ends the connection. A hang-up is the client's exit: the server
//   drops its waiting work. The server's hang-up fails the client's kernels (sticky
//   CUDA_ERROR_MPS_RPC_FAILURE).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace simgpu {

inline constexpr size_t kMpsMaxMessage = 65536;  // `ps` of 1024 clients fits
inline constexpr const char* kMpsDefaultPipeDir = "/tmp/nvidia-mps";
inline constexpr const char* kMpsDefaultLogDir = "/var/log/nvidia-mps";
inline constexpr const char* kMpsControlSocket = "control";
inline constexpr const char* kMpsPidFile = "nvidia-cuda-mps-control.pid";
inline constexpr int kMpsBinaryVersion = 13000;
inline constexpr const char* kMpsServerSocketPrefix = "mps-server-";

// The daemon binds the server's socket before it execs the server (the pipe directory is the
// daemon user's) and hands it over as this descriptor.
inline constexpr int kMpsServerListenFd = 3;

inline std::string mpsServerSocket(const std::string& pipeDir, int pid) {
  return pipeDir + "/" + kMpsServerSocketPrefix + std::to_string(pid);
}

// The SMs an active thread percentage gives a client on a device of `sms` SMs: ceil(pct x SMs)
// rounded up to an even number (a TPC is two SMs), at least 1, at most SMs (a guess to fit on a
// GPU: docs/simgpu.md, "Constants to fit").
inline uint32_t mpsSmCap(uint32_t pctX10, uint32_t sms) {
  uint64_t cap = (static_cast<uint64_t>(pctX10) * sms + 999) / 1000;
  cap += cap & 1;
  if (cap > sms) cap = sms;
  return cap < 1 ? 1 : static_cast<uint32_t>(cap);
}

inline constexpr uint32_t kMpsWireVersion = 3;
enum MpsWireType : uint32_t {
  kMpsHelloType = 0x4f4c4548,
  kMpsKernelType = 0x4e52454b,
  kMpsDoneType = 0x454e4f44,
  kMpsTraceType = 0x43415254,
};
inline constexpr uint32_t kMpsTraceBlocks = 1u << 0;  // MpsKernel::flags: answer its blocks' traces

struct MpsHello {  // client -> server, first packet
  uint32_t type = kMpsHelloType;
  uint32_t version = kMpsWireVersion;
  uint32_t sms = 0;           // SIMGPU_SMS (a MIG device's SMs inside one): must be the server's
  uint32_t mig = 0;           // the client's MIG device (mig::migTag), 0: none; must be the server's
  double timeScale = 1;       // SIMGPU_TIME_SCALE: device time must mean the same on both sides
};
struct MpsKernel {  // client -> server
  uint32_t type = kMpsKernelType;
  uint32_t device = 0;        // host device index
  uint64_t id = 0;            // the client's, echoed in the answer
  uint64_t context = 0;       // the client's context id: one engine context per client context
  uint64_t blocks = 0;
  uint32_t threadsPerBlock = 0;
  uint32_t registersPerThread = 0;
  uint32_t sharedPerBlock = 0;
  int32_t streamPriority = 0;
  uint64_t blockNs = 0;
  uint64_t startNs = 0;       // device time its stream reached
  uint32_t queuedBehind = 0;  // kernels the client launched on the device, not yet sent
  uint32_t flags = 0;         // kMpsTraceBlocks
  uint64_t timeBoxNs = 0;     // KernelShape::timeBoxNs (0: blocks last blockNs)
};
struct MpsDone {  // server -> client
  uint32_t type = kMpsDoneType;
  int32_t status = 0;  // CUresult
  uint64_t id = 0;
  uint64_t endNs = 0;  // device time the kernel ended
};
struct MpsTrace {  // server -> client, before the MpsDone of a kernel sent with kMpsTraceBlocks
  uint32_t type = kMpsTraceType;
  uint32_t count = 0;  // BlockTrace records after this header: the kernel's blocks
  uint64_t id = 0;
};
static_assert(sizeof(MpsHello) == 24 && sizeof(MpsKernel) == 80 && sizeof(MpsDone) == 24 && sizeof(MpsTrace) == 16);

}  // namespace simgpu
