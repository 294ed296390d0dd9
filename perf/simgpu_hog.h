// A saturating process beside the one under test on simgpu (simgpu's mps_hog, tests/simgpu), for
// the probe tests (tests/probes) and the probe-cost benchmark (perf/probe_cost.cpp). Header-only;
// not part of the product.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

namespace cushare::simhog {

struct Hog {
  pid_t pid = -1;
  int out = -1, in = -1;
  std::string pending;
  // Its next line of output ("" when none comes within ms).
  std::string line(int ms = 20000) {
    for (;;) {
      const size_t nl = pending.find('\n');
      if (nl != std::string::npos) {
        std::string l = pending.substr(0, nl);
        pending.erase(0, nl + 1);
        return l;
      }
      pollfd p{out, POLLIN, 0};
      if (poll(&p, 1, ms) <= 0) return "";
      char b[256];
      const ssize_t n = read(out, b, sizeof b);
      if (n <= 0) return "";
      pending.append(b, static_cast<size_t>(n));
    }
  }
  // The hog binary at `bin`: kernels of 2 x sms x 10 blocks (threads each, 1 ms per block) on two
  // streams, until this object goes. env: its CUDA_MPS_PIPE_DIRECTORY (default: none, a plain
  // process). True once it says it is running.
  bool start(const char* bin, uint32_t sms,
             const std::vector<std::string>& env = {"CUDA_MPS_PIPE_DIRECTORY=/nonexistent"}, uint32_t threads = 1024) {
    int o[2], i[2];
    if (pipe2(o, O_CLOEXEC) || pipe2(i, O_CLOEXEC)) return false;
    pid = fork();
    if (pid == 0) {
      dup2(o[1], 1);
      dup2(i[0], 0);
      for (const std::string& e : env) putenv(const_cast<char*>(e.c_str()));
      const std::string blocks = std::to_string(2 * sms * 10), t = std::to_string(threads);
      execl(bin, "hog", "loop", blocks.c_str(), t.c_str(), "1000000", "2", static_cast<char*>(nullptr));
      _exit(127);
    }
    ::close(o[1]);
    ::close(i[0]);
    out = o[0];
    in = i[1];
    const std::string ready = line();
    return ready.rfind("ready ", 0) == 0 && line() == "running";
  }
  ~Hog() {
    if (pid <= 0) return;
    (void)!write(in, "s", 1);
    ::close(in);
    ::close(out);
    int st;
    waitpid(pid, &st, 0);
  }
};

}  // namespace cushare::simhog
