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
//   the daemon sends "quit".
#pragma once

#include <cstddef>

namespace simgpu {

inline constexpr size_t kMpsMaxMessage = 65536;  // `ps` of 1024 clients fits
inline constexpr const char* kMpsDefaultPipeDir = "/tmp/nvidia-mps";
inline constexpr const char* kMpsDefaultLogDir = "/var/log/nvidia-mps";
inline constexpr const char* kMpsControlSocket = "control";
inline constexpr const char* kMpsPidFile = "nvidia-cuda-mps-control.pid";
inline constexpr int kMpsBinaryVersion = 13000;

}  // namespace simgpu
