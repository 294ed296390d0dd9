// The control socket: a Unix stream socket on which each connection carries one request and one
// response (wire format: broker/rpc/codec.h). Anyone who can connect may read; changing anything
// (set-limit, reload) needs Broker::isAdmin of the peer's credentials, which the kernel reports
// (SO_PEERCRED, SO_PEERGROUPS): a client cannot claim to be someone else.
//
// One thread with epoll, non-blocking sockets: a client that connects and sends nothing, or sends
// slowly, holds a connection slot (at most kMaxConnections, each dropped after 5 s) and never the
// thread, so neither the other clients nor the broker's reaping wait for it. One user holds at
// most 16 connections, and administrators have 16 more beyond the 64, so nobody can lock the
// administrators out. A client refused a slot gets a one-line answer with busy set (docs/
// operations.md), never a silent close. Fairness: each connection carries one request, read and
// answered in one wake-up once complete; one wake-up accepts at most 64 connections, so a user
// that connects as fast as it can delays another user's answer by at most its 16 requests.
// A client that half-closes (shutdown(SHUT_WR)) before a whole request gets the error too.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "core/log_limit.h"

namespace cushare::broker {

class Broker;
struct Peer;

class ControlServer {
 public:
  // reload: what a reload request runs (main's, shared with SIGHUP).
  ControlServer(Broker& broker, std::function<bool(std::string*)> reload);
  ~ControlServer();

  // Creates the socket's directory (0755) if missing, replaces a stale socket file (refuses if a
  // broker answers on it), binds, makes it connectable by everyone (0666), starts the thread.
  bool start(const std::string& path, std::string* err);
  void stop();  // idempotent; removes the socket file

 private:
  struct Connection;
  void run();
  void accept();
  bool admit(const Peer& p, std::string* why) const;
  void onReadable(Connection& c);
  void respond(Connection& c, const std::string& bytes);
  bool flush(Connection& c);  // false when done (written or failed)
  void close(int fd);

  Broker& broker_;
  std::function<bool(std::string*)> reload_;
  std::string path_;
  int listen_ = -1, epoll_ = -1, stop_ = -1;
  std::map<int, std::unique_ptr<Connection>> conns_;
  // Any local user can send malformed requests: their lines within a budget (log_limit.h). Used
  // by the server's thread only.
  LogLimit malformedLog_{20, std::chrono::milliseconds(6000)};
  std::thread thread_;
};

}  // namespace cushare::broker
