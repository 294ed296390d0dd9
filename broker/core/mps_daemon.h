// The broker's NVIDIA MPS control daemons (docs/mps.md): one for the whole GPUs at pipe_dir, and
// one per MIG device at pipe_dir/MIG-<uuid> started with CUDA_VISIBLE_DEVICES naming it (each as
// below); started with the broker, kept running, quit with it. The supervisor runs on a thread of its own and never holds the broker's lock while
// it talks to the daemon: it reads the broker through snapshot() and pushes what it saw back with
// setMpsSnapshot().
//
//  - start: resolves the control binary (mps.control, else simgpu's beside the NVML library the
//    broker loaded, else nvidia-cuda-mps-control on PATH), creates pipe_dir and log_dir, runs
//    `<control> -d` with CUDA_MPS_PIPE_DIRECTORY / CUDA_MPS_LOG_DIRECTORY (and CUDA_DEVICE_ORDER=
//    PCI_BUS_ID, so the daemon's ordinals are the broker's NVML indices) through posix_spawn, or
//    adopts a daemon already answering on pipe_dir (a restarted broker); sets the server defaults;
//    publishes the tenants' client settings (mps_settings.h) and then mps.conf. mode auto: any
//    failure there leaves MPS off, logged with the reason.
//  - every second: one control session with get_server_list (bounded: 3 s, then the control
//    client is killed), then get_server_status and get_client_list for each server. No answer:
//    the daemon is restarted at once when its pid file's process is gone, or after two silent
//    checks in a row when it hangs (killed first); each restart is logged and counted. A server in
//    FAULT is logged with its clients and counted once per fault. Tenant settings changed by a
//    reload or a live change are republished, and the server defaults (and the running server's
//    values for its next clients) follow.
//  - stop: `quit`, a bounded wait for the daemon to go, mps.conf removed (new processes are then
//    not MPS clients of a daemon that is gone).
//
// Every control command is a fresh control client with the commands on stdin and stdout read
// until it exits; its exit status is what counts (as NVIDIA's own tooling does).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "config/config.h"
#include "core/snapshot.h"
#include "cushare/mps_settings.h"

namespace cushare::broker {

class Broker;

// One run of the control client: `<control>` with lines on stdin, or `<control> <args>` with
// stdin closed. Returns the exit status (0..255), -1 when it could not be started, -2 when it
// ran past timeoutMs (then killed). *out: stdout and stderr, in order of arrival.
struct MpsControl {
  std::string binary, pipeDir, logDir;
  std::string visible;  // CUDA_VISIBLE_DEVICES for the daemon (a MIG device's UUID); empty: not set
  int run(const std::vector<std::string>& args, const std::string& input, int timeoutMs, std::string* out) const;
  // Commands one per line; true when the client exited 0 (and *out holds its answers).
  bool ask(const std::string& commands, int timeoutMs, std::string* out) const;
};

// The control binary the configuration names: mps.control resolved on PATH, or the default.
// Empty (with *why) when there is none that can be executed.
std::string resolveMpsControl(const MpsConfig& c, std::string* why);
// What the start's making of mps.pipe_dir and mps.log_dir would say, without making them
// (--check): each is a directory of this user that others cannot write, or can be created.
bool checkMpsDirs(const MpsConfig& c, std::string* why);
// With MIG devices (a control daemon each, at <pipe_dir>/MIG-<uuid>): why pipe_dir is too long
// for their sockets, or "".
std::string migPipeProblem(const MpsConfig& c, const std::vector<DeviceSnapshot>& devices);

class MpsSupervisor {
 public:
  MpsSupervisor(Broker& broker, std::string configPath);
  ~MpsSupervisor();

  // Reads the mps block of the configuration. Off: nothing runs (any mps.conf left is removed).
  // On: false with *err when the daemon cannot be started. Auto: off when it cannot.
  bool start(std::string* err);
  // Republishes the tenants' settings now (after a reload).
  void refresh();
  void stop();
  // Stops supervising but leaves the daemons running and their settings published, as a killed
  // broker does: the broker starting next in this process (a MIG layout change) adopts them.
  void detach();
  bool active() const { return active_; }
  // The daemon's pipe directory while active (fixed from start to stop); empty when MPS is off.
  std::string pipeDir() const { return active_ ? config_.pipeDir : std::string(); }

 private:
  // Ends the supervising thread; false when it was ended already.
  bool stopThread();
  // One control daemon: the whole GPUs' (at pipe_dir), or a MIG device's (at pipe_dir/<uuid>,
  // started with CUDA_VISIBLE_DEVICES naming it: one per MIG device, as NVIDIA runs MPS on MIG).
  struct Daemon {
    std::string name;             // "" for the whole GPUs' daemon, else the MIG device's ("0:1")
    std::string uuid, gpuUuid;    // a MIG device's UUID and its GPU's; empty for the whole GPUs
    unsigned gi = 0, ci = 0;
    MpsControl control;
    std::vector<size_t> devices;  // the broker's devices it serves, in its own ordinal order
    int pid = 0;
    bool up = false;
    int silentChecks = 0;
    std::string defaultsKey;                // the server defaults last applied
    std::vector<MpsServerSnapshot> servers;
    std::map<int, bool> faulted;            // server pid -> logged as FAULT
    std::string lastError;
    std::string label() const { return name.empty() ? std::string("the control daemon") : "the control daemon of MIG device " + name; }
  };
  bool startMps(std::string* err);  // mode on or auto: false when MPS stays off (*err: fatal)
  void run();
  void check();
  void checkOne(Daemon& d);
  bool startDaemon(Daemon& d, bool adoptRunning, std::string* err);
  void quitDaemon(Daemon& d);
  void quitStaleDaemons();
  void publish(bool force);
  int pidFromFile(const Daemon& d) const;
  void gather();  // the daemons' state into snap_
  void push();

  Broker& broker_;
  const std::string configPath_;
  MpsConfig config_;
  Config full_;  // the configuration at start or last reload (unknown-tenant profile)
  std::string binary_;  // the control binary
  std::vector<Daemon> daemons_;
  size_t deviceCount_ = 0;  // the broker's devices (fixed from start)
  std::string ledgerDir_;
  bool active_ = false;

  std::mutex mu_;  // guards snap_, the published files and stop_
  std::condition_variable cv_;
  bool stop_ = false;
  bool refreshWanted_ = false;
  MpsSnapshot snap_;
  std::map<std::string, std::string> written_;  // file name -> contents last written
  std::string hostText_;                        // mps.conf as last written
  // Per tenant, when (boot clock ticks) each percentage was published, oldest first.
  std::map<std::string, std::vector<std::pair<uint64_t, std::optional<int>>>> history_;
  std::thread thread_;
};

}  // namespace cushare::broker
