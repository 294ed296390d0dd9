// The simulated MPS control daemon's state, shared by daemon.cpp (lifecycle, clients, servers)
// and commands.cpp (what the control client's commands do). See daemon.cpp for the model.
#pragma once

#include <unistd.h>

#include <sys/types.h>

#include <cstdint>
#include <cstdio>
#include <deque>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "daemon.h"

namespace simgpu::mps {

constexpr int kDefaultMaxClients = 48;  // per server, CUDA 13.0 (mps-facts.md: 60 in newer docs)

enum class Kind { kUnknown, kUi, kClient, kServer };
enum class ServerState { kInitializing, kActive, kFault };

struct Conn {
  int fd = -1;
  Kind kind = Kind::kUnknown;
  pid_t pid = 0;
  uid_t uid = 0;
  // client
  double envPct = -1;   // CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, -1: unset
  int envPriority = -1;  // CUDA_MPS_CLIENT_PRIORITY, -1: unset
  pid_t server = 0;     // admitted to this server
  int contextId = 0;
  double pct = 100;
  int priority = 0;
  uint64_t terminatingUi = 0;  // the UI waiting for terminate_client's answer
  int terminateAcks = 0;       // acknowledgements still awaited: the client's and its server's
};

struct Server {
  pid_t pid = 0;
  uid_t uid = 0;
  ServerState state = ServerState::kInitializing;
  uint64_t conn = 0;  // its connection, once it said hello
  double pct = 100;   // for its next clients
  std::map<int, uint64_t> limits;  // device ordinal -> bytes, for its next clients
  int nextContextId = 0;
  int terminating = 0;  // terminate_client in progress: new clients are refused
  bool quitting = false;
  std::vector<uint64_t> clients;
};

inline const char* stateName(ServerState s) {
  switch (s) {
    case ServerState::kInitializing: return "INITIALIZING";
    case ServerState::kActive: return "ACTIVE";
    case ServerState::kFault: return "FAULT";
  }
  return "?";
}

class Daemon {
 public:
  explicit Daemon(const DaemonOptions& o) : opt_(o) {}
  int run(int readyFd);

 private:
  bool start(std::string* error);
  void loop();
  void accept();
  void onMessage(uint64_t id, const std::string& msg);
  void onHangup(uint64_t id);
  void onSignal();
  std::string command(Conn& ui, uint64_t uiId, const std::string& line, bool* deferred);
  void clientHello(uint64_t id, const std::vector<std::string>& w);
  void schedule();
  void admit(uint64_t id, Server& s);
  void refuse(uint64_t id, int code);
  void startServer(uid_t uid);
  void stopServer(Server& s);
  void clientGone(Conn& c, uint64_t id);
  void terminateAck(uint64_t clientId, bool all);  // one (or every) acknowledgement of terminate_client
  Server* current();
  Server* server(pid_t pid);
  void send(uint64_t id, const std::string& msg);
  void closeConn(uint64_t id);
  void logControl(const std::string& msg);
  void logServer(pid_t pid, const std::string& msg);
  std::map<int, uint64_t> resolveLimits() const;
  void shutdown();

  DaemonOptions opt_;
  // The uid of the server a client needs: its own, or under -multiuser-server the daemon's.
  uid_t serverUidFor(uid_t clientUid) const { return opt_.multiuser ? ::getuid() : clientUid; }
  int listenFd_ = -1, sigFd_ = -1, lockFd_ = -1;
  FILE* controlLog_ = nullptr;
  FILE* serverLog_ = nullptr;
  std::string serverPath_;
  int maxClients_ = kDefaultMaxClients;
  double defaultPct_ = 100;
  int defaultPriority_ = 0;
  std::vector<std::pair<std::string, uint64_t>> defaultLimits_;  // in the order they were set
  std::map<uint64_t, Conn> conns_;
  uint64_t nextConn_ = 1;
  std::deque<uint64_t> pending_;
  std::vector<Server> servers_;
  bool quit_ = false;
};

}  // namespace simgpu::mps
