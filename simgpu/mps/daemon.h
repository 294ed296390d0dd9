// The simulated nvidia-cuda-mps-control daemon (see daemon.cpp for what it models).
#pragma once

#include <string>

namespace simgpu::mps {

struct DaemonOptions {
  std::string pipeDir;   // CUDA_MPS_PIPE_DIRECTORY
  std::string logDir;    // CUDA_MPS_LOG_DIRECTORY
  bool foreground = false;  // -f: control.log lines go to stdout too
  // -multiuser-server: one server, of the daemon's user, serves clients of every uid (no uid
  // waits for another's clients to exit). The server learns it from SIMGPU_MPS_MULTIUSER=1.
  bool multiuser = false;
};

// Runs the daemon until `quit` (or SIGTERM/SIGINT). Once it listens it writes "ok\n" to readyFd;
// if it cannot start it writes the reason as one line there (and to stderr) and returns 1.
// readyFd < 0: no one waits.
int runDaemon(const DaemonOptions& options, int readyFd);

}  // namespace simgpu::mps
