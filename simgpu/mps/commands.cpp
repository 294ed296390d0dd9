// The control client's commands, as the simulated daemon answers them (daemon.cpp has the model;
// docs/simgpu.md lists each command and which answers are guesses). One answer per command: the
// text the control client prints, empty for commands that print nothing; terminate_client's answer
// is deferred until the client acknowledges or hangs up.
#include <algorithm>
#include <string>
#include <vector>

#include "config.h"
#include "daemon_impl.h"
#include "mps_util.h"

namespace simgpu::mps {

std::string Daemon::command(Conn& ui, uint64_t uiId, const std::string& line, bool* deferred) {
  (void)ui;
  const std::vector<std::string> w = words(line);
  if (w.empty()) return "";
  const std::string& cmd = w[0];
  auto srvArg = [&](size_t i) -> Server* {
    int pid = 0;
    if (w.size() <= i || !parseCount(w[i].c_str(), 1, 1 << 30, &pid)) return nullptr;
    Server* s = server(pid);
    return s && !s->quitting ? s : nullptr;
  };
  auto noServer = [&](size_t i) { return "Server " + (w.size() > i ? w[i] : std::string()) + " not found"; };
  if (cmd == "get_server_list" && w.size() == 1) {
    std::string out;
    for (auto& s : servers_)
      if (!s.quitting) out += (out.empty() ? "" : "\n") + std::to_string(s.pid);
    return out;
  }
  if (cmd == "start_server" && w.size() == 3 && w[1] == "-uid") {
    int uid = 0;
    if (!parseCount(w[2].c_str(), 0, 1 << 30, &uid)) return "Invalid uid " + w[2];
    if (!current()) startServer(static_cast<uid_t>(uid));
    return "";
  }
  if (cmd == "get_server_status" && w.size() == 2) {
    Server* s = srvArg(1);
    return s ? stateName(s->state) : noServer(1);
  }
  if (cmd == "get_client_list" && w.size() == 2) {
    Server* s = srvArg(1);
    if (!s) return noServer(1);
    std::string out;
    for (uint64_t id : s->clients) out += (out.empty() ? "" : "\n") + std::to_string(conns_[id].pid);
    return out;
  }
  if (cmd == "set_default_active_thread_percentage" && w.size() == 2) {
    if (!parsePercentage(w[1].c_str(), &defaultPct_)) return "Invalid percentage " + w[1];
    return formatPercentage(defaultPct_);
  }
  if (cmd == "get_default_active_thread_percentage" && w.size() == 1) return formatPercentage(defaultPct_);
  if (cmd == "set_active_thread_percentage" && w.size() == 3) {
    Server* s = srvArg(1);
    if (!s) return noServer(1);
    if (!parsePercentage(w[2].c_str(), &s->pct)) return "Invalid percentage " + w[2];
    return formatPercentage(s->pct);
  }
  if (cmd == "get_active_thread_percentage" && w.size() == 2) {
    Server* s = srvArg(1);
    return s ? formatPercentage(s->pct) : noServer(1);
  }
  if (cmd == "set_default_device_pinned_mem_limit" && w.size() == 3) {
    uint64_t bytes = 0;
    if (!parseMemLimit(w[2], &bytes)) return "Invalid memory limit " + w[2];
    defaultLimits_.erase(std::remove_if(defaultLimits_.begin(), defaultLimits_.end(),
                                        [&](auto& e) { return e.first == w[1]; }),
                         defaultLimits_.end());
    defaultLimits_.emplace_back(w[1], bytes);
    return "";
  }
  if (cmd == "get_default_device_pinned_mem_limit" && w.size() == 2) {
    for (auto& [dev, bytes] : defaultLimits_)
      if (dev == w[1]) return formatMemLimit(bytes);
    return formatMemLimit(0);
  }
  if (cmd == "set_device_pinned_mem_limit" && w.size() == 4) {
    Server* s = srvArg(1);
    if (!s) return noServer(1);
    uint64_t bytes = 0;
    int dev = -1;
    if (!parseMemLimit(w[3], &bytes)) return "Invalid memory limit " + w[3];
    if (!parseCount(w[2].c_str(), 0, kMaxDevices - 1, &dev))
      for (int d = 0; d < kMaxDevices; ++d)
        if (deviceUuidString(d) == w[2]) dev = d;
    if (dev >= 0) s->limits[dev] = bytes;
    return "";
  }
  if (cmd == "get_device_pinned_mem_limit" && w.size() == 3) {
    Server* s = srvArg(1);
    if (!s) return noServer(1);
    int dev = -1;
    if (!parseCount(w[2].c_str(), 0, kMaxDevices - 1, &dev))
      for (int d = 0; d < kMaxDevices; ++d)
        if (deviceUuidString(d) == w[2]) dev = d;
    auto it = s->limits.find(dev);
    return formatMemLimit(it == s->limits.end() ? 0 : it->second);
  }
  if (cmd == "set_default_client_priority" && w.size() == 2) {
    if (!parseCount(w[1].c_str(), 0, 1, &defaultPriority_)) return "Invalid priority " + w[1];
    return "";
  }
  if (cmd == "get_default_client_priority" && w.size() == 1) return std::to_string(defaultPriority_);
  if (cmd == "terminate_client" && w.size() == 3) {
    Server* s = srvArg(1);
    if (!s) return noServer(1);
    int pid = 0;
    parseCount(w[2].c_str(), 1, 1 << 30, &pid);
    for (uint64_t id : s->clients) {
      Conn& c = conns_[id];
      if (c.pid != pid || c.terminatingUi) continue;
      c.terminatingUi = uiId;
      ++s->terminating;
      // The server ends the client's outstanding work in its engine; the client takes the sticky
      // error. The answer comes when both have acknowledged (or hung up).
      c.terminateAcks = 1;
      if (s->conn) {
        send(s->conn, "terminate " + std::to_string(c.pid));
        ++c.terminateAcks;
      }
      send(id, "terminate");
      *deferred = true;
      return "";
    }
    return "Client " + w[2] + " not found";
  }
  if (cmd == "ps" && (w.size() == 1 || (w.size() == 3 && w[1] == "-p"))) {
    int only = 0;
    if (w.size() == 3 && !parseCount(w[2].c_str(), 1, 1 << 30, &only)) return "Invalid pid " + w[2];
    std::string out = "PID ID SERVER DEVICE NAMESPACE COMMAND";
    for (auto& s : servers_)
      for (uint64_t id : s.clients) {
        const Conn& c = conns_[id];
        if (only && c.pid != only) continue;
        out += "\n" + std::to_string(c.pid) + " " + std::to_string(c.contextId) + " " + std::to_string(s.pid) + " " +
               deviceUuidString(0).substr(0, 22) + " " + pidNamespace(c.pid) + " " + processCommand(c.pid);
      }
    return out;
  }
  if (cmd == "quit" && w.size() == 1) {
    quit_ = true;
    return "";
  }
  return "Unrecognized command: " + line;
}

}  // namespace simgpu::mps
