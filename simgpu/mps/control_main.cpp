// nvidia-cuda-mps-control, simulated: `-d` starts the daemon in the background (returning 0 once
// it listens, 1 with a reason if it cannot start), `-f` runs it in the foreground (control.log
// lines on stdout too), and without options it is the control client: it reads commands from
// stdin, one per line (the last one may lack its newline, as the k8s device plugin sends it),
// sends each to the daemon at CUDA_MPS_PIPE_DIRECTORY and prints the answer. No daemon answering:
// "Cannot find MPS control daemon process" and exit status 1, as the real client.
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>

#include "daemon.h"
#include "mps_protocol.h"

namespace {

std::string envOr(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v && *v ? v : fallback;
}

int controlClient(const std::string& pipeDir) {
  const std::string path = pipeDir + "/" + simgpu::kMpsControlSocket;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (fd < 0 || path.size() >= sizeof addr.sun_path ||
      (std::memcpy(addr.sun_path, path.c_str(), path.size() + 1),
       connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) ||
      send(fd, "ui", 2, MSG_NOSIGNAL) != 2) {
    std::fprintf(stderr, "Cannot find MPS control daemon process\n");
    return 1;
  }
  std::string line;
  while (std::getline(std::cin, line)) {
    while (!line.empty() && (line.back() == '\r' || line.back() == ' ' || line.back() == '\t')) line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    if (send(fd, line.data(), line.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(line.size())) {
      std::fprintf(stderr, "Cannot find MPS control daemon process\n");
      return 1;
    }
    char buf[simgpu::kMpsMaxMessage + 1];
    const ssize_t n = recv(fd, buf, simgpu::kMpsMaxMessage, 0);
    if (n < 0) {
      std::fprintf(stderr, "Cannot find MPS control daemon process\n");
      return 1;
    }
    if (n > 0) std::printf("%.*s\n", static_cast<int>(n), buf);
    std::fflush(stdout);
  }
  return 0;
}

// -d: the daemon runs in a grandchild in its own session; the caller returns once it listens.
int background(const simgpu::mps::DaemonOptions& o) {
  int ready[2];
  if (pipe2(ready, O_CLOEXEC) != 0) return 1;
  const pid_t child = fork();
  if (child < 0) return 1;
  if (child == 0) {
    ::close(ready[0]);
    setsid();
    if (fork() != 0) _exit(0);
    const int null = ::open("/dev/null", O_RDWR);
    if (null >= 0) {
      dup2(null, 0);
      dup2(null, 1);
      dup2(null, 2);
      if (null > 2) ::close(null);
    }
    (void)!chdir("/");
    _exit(simgpu::mps::runDaemon(o, ready[1]));
  }
  ::close(ready[1]);
  waitpid(child, nullptr, 0);
  char buf[512];
  std::string answer;
  ssize_t n;
  while ((n = read(ready[0], buf, sizeof buf)) > 0) {
    answer.append(buf, static_cast<size_t>(n));
    if (answer.find('\n') != std::string::npos) break;
  }
  if (answer == "ok\n") return 0;
  std::fprintf(stderr, "%s", answer.empty() ? "the MPS control daemon did not start\n" : answer.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  simgpu::mps::DaemonOptions o;
  o.pipeDir = envOr("CUDA_MPS_PIPE_DIRECTORY", simgpu::kMpsDefaultPipeDir);
  o.logDir = envOr("CUDA_MPS_LOG_DIRECTORY", simgpu::kMpsDefaultLogDir);
  if (argc == 1) return controlClient(o.pipeDir);
  // -d or -f, each alone or with -multiuser-server (either order).
  std::string a = argv[1];
  if (argc == 3) {
    const std::string b = argv[2];
    if (b == "-multiuser-server" && (a == "-d" || a == "-f")) o.multiuser = true;
    else if (a == "-multiuser-server" && (b == "-d" || b == "-f")) o.multiuser = true, a = b;
    else a.clear();
  }
  if (argc <= 3 && a == "-d") return background(o);
  if (argc <= 3 && a == "-f") {
    o.foreground = true;
    return simgpu::mps::runDaemon(o, -1);
  }
  if (argc == 2 && a == "-v") {
    std::printf("NVIDIA CUDA MPS Control Daemon (simgpu), binary version %d\n", simgpu::kMpsBinaryVersion);
    return 0;
  }
  std::fprintf(stderr, "usage: nvidia-cuda-mps-control [-d | -f [-multiuser-server] | -v]   (without options: commands on stdin)\n");
  return 1;
}
