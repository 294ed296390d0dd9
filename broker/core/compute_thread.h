// The compute scheduler's thread: calls Broker::computeTick() about every millisecond while a
// device is scheduled (250 us while a turn drains), every 20 ms otherwise (metering only).
#pragma once

#include <condition_variable>
#include <mutex>
#include <thread>

namespace cushare::broker {

class Broker;

class ComputeThread {
 public:
  explicit ComputeThread(Broker& broker) : broker_(broker) {}
  ~ComputeThread() { stop(); }
  void start();
  void stop();

 private:
  Broker& broker_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace cushare::broker
