// nvidia-cuda-mps-server, simulated: started by the control daemon (under the uid it serves), it
// connects back on <pipe>/control, writes its startup lines to server.log through the daemon (as
// the real server's log FIFO) and lives until the daemon says "quit" or goes away. It holds no
// GPU work itself: its clients' driver runs their work, grouped under this server's pid (see
// src/mps/mps_client.h); this process is what get_server_list, ps and NVML's process list show.
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "config.h"
#include "mps_protocol.h"

int main() {
  const char* dir = std::getenv("CUDA_MPS_PIPE_DIRECTORY");
  const std::string path = std::string(dir && *dir ? dir : simgpu::kMpsDefaultPipeDir) + "/" + simgpu::kMpsControlSocket;
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
  for (int d = 0; d < cfg.deviceCount; ++d)
    say("log Creating server context on device " + std::to_string(d) + " (" + cfg.name + ")");
  say("log CUDA MPS Server for Linux/Unix. Binary version: " + std::to_string(simgpu::kMpsBinaryVersion));
  say("log Server has started");
  if (!say("ready")) return 1;
  char buf[simgpu::kMpsMaxMessage];
  for (;;) {
    const ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n <= 0) return n == 0 ? 0 : 1;  // the daemon went away
    if (std::string(buf, static_cast<size_t>(n)) == "quit") {
      say("log Server is shutting down");
      return 0;
    }
  }
}
