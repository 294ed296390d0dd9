// Returns a dead tenant process's quota within milliseconds, no allocation needed: a thread that
// holds a pidfd for every pid in the ledgers and calls Broker::tick when one of them exits, plus a
// periodic tick (every 50 ms) that catches what pidfds cannot (a pid from another pid namespace,
// i.e. a process in a container, or one that came and went between two scans). Correctness never
// rests on the pid: tick() reaps exactly the slots whose OFD lock is free, so a pid that names an
// unrelated process only costs a useless tick. The directory is watched with inotify so that a
// ledger an unknown tenant creates is adopted at once.
#pragma once

#include <chrono>
#include <map>
#include <set>
#include <string>
#include <thread>

namespace cushare::broker {

class Broker;

class Reaper {
 public:
  explicit Reaper(Broker& broker, std::chrono::milliseconds period = std::chrono::milliseconds(50));
  ~Reaper();
  bool start(std::string* err);
  void stop();

 private:
  void run();
  void refreshPidfds();
  void watch(int fd);

  Broker& broker_;
  const std::chrono::milliseconds period_;
  int epoll_ = -1, timer_ = -1, inotify_ = -1, stop_ = -1;
  std::map<int, int> pidfds_;  // pid -> pidfd
  std::set<int> exited_;       // pids whose exit was seen while they were still in a slot
  std::thread thread_;
};

}  // namespace cushare::broker
