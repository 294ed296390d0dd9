// cushare-broker: one per GPU host. Owns the tenants' ledgers and limits (core/broker.h), returns
// dead processes' quota (core/reaper.h), serves the control socket (core/control_server.h) and
// Prometheus metrics (metrics/). Runs in the foreground and logs to stderr (systemd: see
// examples/systemd/cushare-broker.service). SIGHUP reloads the configuration; SIGTERM and SIGINT
// stop it. Stopping (or killing) the broker never unlimits a tenant: the ledgers, with their
// limits, and the host segment stay, and a restarted broker adopts them.
#include <dirent.h>
#include <fcntl.h>
#include <sys/wait.h>
#include <linux/close_range.h>
#include <poll.h>
#include <signal.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <set>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <map>
#include <memory>
#include <mutex>
#include <string_view>
#include <vector>

#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include "config/layout_change.h"
#include "core/broker.h"
#include "core/bus_guard.h"
#include "container/cdi.h"
#include "container/mig_nodes.h"
#include "core/containers.h"
#include "core/control_server.h"
#include "core/devices.h"
#include "core/json_text.h"
#include "core/log.h"
#include "core/mps_daemon.h"
#include "core/places.h"
#include "core/compute_thread.h"
#include "core/reaper.h"
#if CUSHARE_DEVICE_PLUGIN
#include "kubernetes/device_plugin.h"
#include "kubernetes/pod_resources.h"
#endif
#include "metrics/http_server.h"
#include "metrics/prometheus.h"
#include "mig/mig_layout.h"

namespace {

constexpr char kUsage[] =
    "usage: cushare-broker --config FILE [--log-level error|warn|info|debug] [--log-format text|json] [--check]\n"
    "  --config FILE   the broker configuration (YAML; docs/broker-configuration.md)\n"
    "  --check         validate the configuration against this host's devices and exit\n"
    "  --log-level L   default info\n"
    "  --log-format F  text (default): one line per event; json: one JSON object per line\n"
    "                  (time, level, logger, message), for Loki, Elasticsearch and the like\n";

// %* in the JSON log pattern: the message as the inside of a JSON string (core/json_text.h).
class JsonEscapedMessage : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&, spdlog::memory_buf_t& dest) override {
    std::string out;
    cushare::broker::appendJsonEscaped(std::string_view(msg.payload.data(), msg.payload.size()), &out);
    dest.append(out.data(), out.data() + out.size());
  }
  std::unique_ptr<spdlog::custom_flag_formatter> clone() const override {
    return std::make_unique<JsonEscapedMessage>();
  }
};

// Set by a broker starting again on a changed MIG layout (below) for the one it becomes: the
// descriptor of the layout lock it holds ("-1": none). Read and removed at start.
constexpr char kFollowedEnv[] = "CUSHARE_BROKER_FOLLOWED_LAYOUT_LOCK";

// `cushare-broker --config path --check` as the next start would judge this host now (places,
// MPS, CDI, the device plugin), told that it judges a start on a followed layout (kFollowedEnv
// "-1": no apply_at_start): true when it passes; else false with its error lines (the last three)
// in *why. At most 30 s.
bool checkLikeAStart(const std::string& path, std::string* why) {
  // Everything the child needs is made before fork (this process has threads).
  const std::string mark = std::string(kFollowedEnv) + "=-1";
  std::vector<const char*> env;
  for (char** e = environ; *e != nullptr; ++e)
    if (std::strncmp(*e, kFollowedEnv, std::strlen(kFollowedEnv)) != 0 || (*e)[std::strlen(kFollowedEnv)] != '=')
      env.push_back(*e);
  env.push_back(mark.c_str());
  env.push_back(nullptr);
  const char* args[] = {"cushare-broker", "--config", path.c_str(), "--check", "--log-level", "error", nullptr};
  int out[2];
  if (::pipe2(out, O_CLOEXEC) != 0) {
    *why = std::string("cannot run --check: ") + std::strerror(errno);
    return false;
  }
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(out[1], 1);
    ::dup2(out[1], 2);
    ::execve("/proc/self/exe", const_cast<char* const*>(args), const_cast<char* const*>(env.data()));
    ::_exit(127);
  }
  ::close(out[1]);
  if (pid < 0) {
    ::close(out[0]);
    *why = std::string("cannot run --check: ") + std::strerror(errno);
    return false;
  }
  std::string text;
  bool late = false;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
    pollfd p{out[0], POLLIN, 0};
    const int r = left.count() <= 0 ? 0 : ::poll(&p, 1, static_cast<int>(left.count()));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      ::kill(pid, SIGKILL);
      late = true;
      break;
    }
    char buf[4096];
    const ssize_t n = ::read(out[0], buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    if (text.size() < 65536) text.append(buf, static_cast<size_t>(n));
  }
  ::close(out[0]);
  int st = 0;
  pid_t w;
  while ((w = ::waitpid(pid, &st, 0)) < 0 && errno == EINTR) {
  }
  if (w == pid && !late && WIFEXITED(st) && WEXITSTATUS(st) == 0) return true;
  std::vector<std::string> errors;
  for (size_t a = 0; a < text.size();) {
    size_t b = text.find('\n', a);
    if (b == std::string::npos) b = text.size();
    const std::string line = text.substr(a, b - a);
    if (const size_t e = line.find(" cushare-broker error: "); e != std::string::npos) errors.push_back(line.substr(e + 23));
    a = b + 1;
  }
  *why = "cushare-broker --check fails on it";
  if (late) *why += ": it took more than 30 s";
  else if (w != pid) *why += std::string(": its exit cannot be read (") + std::strerror(errno) + ")";
  for (size_t k = errors.size() > 3 ? errors.size() - 3 : 0; k < errors.size(); ++k) *why += ": " + errors[k];
  return false;
}

// The layout lock a broker that started again was handed: fd names a file "<...>.mig-lock".
bool isLayoutLock(int fd) {
  char target[4096];
  const ssize_t n = ::readlink(("/proc/self/fd/" + std::to_string(fd)).c_str(), target, sizeof target - 1);
  return n > 0 && std::string_view(target, static_cast<size_t>(n)).ends_with(cushare::broker::mig::kApplyLockSuffix);
}

int usage(const std::string& why) {
  std::fprintf(stderr, "cushare-broker: %s\n%s", why.c_str(), kUsage);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace cushare::broker;
  std::string configPath, level = "info", format = "text";
  bool checkOnly = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if ((a == "--config" || a == "--log-level" || a == "--log-format") && i + 1 < argc) {
      (a == "--config" ? configPath : a == "--log-level" ? level : format) = argv[++i];
    } else if (a == "--check") {
      checkOnly = true;
    } else if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    } else if (a == "--version") {
      std::printf("cushare-broker %s\n", CUSHARE_VERSION);
      return 0;
    } else {
      return usage("unknown or incomplete argument '" + a + "'");
    }
  }
  if (configPath.empty()) return usage("--config is required");
  const auto lvl = spdlog::level::from_str(level);
  if (lvl == spdlog::level::off && level != "off") return usage("unknown log level '" + level + "'");

  if (format != "text" && format != "json") return usage("unknown log format '" + format + "' (text or json)");

  auto logger = spdlog::stderr_logger_mt("cushare-broker");
  if (format == "json") {
    auto f = std::make_unique<spdlog::pattern_formatter>();
    f->add_flag<JsonEscapedMessage>('*').set_pattern(
        R"({"time":"%Y-%m-%dT%H:%M:%S.%e%z","level":"%l","logger":"cushare-broker","message":"%*"})");
    logger->set_formatter(std::move(f));
  } else {
    logger->set_pattern("%Y-%m-%dT%H:%M:%S.%e cushare-broker %l: %v");
  }
  logger->set_level(lvl);
  logger->flush_on(spdlog::level::trace);
  spdlog::set_default_logger(logger);

  // Signals are taken through a signalfd on this thread; every thread started below inherits the
  // mask, so none of them is interrupted.
  sigset_t sigs;
  sigemptyset(&sigs);
  for (int s : {SIGHUP, SIGTERM, SIGINT}) sigaddset(&sigs, s);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  ::signal(SIGPIPE, SIG_IGN);

  // A broker started again by itself on a MIG layout changed under it (below): it does not apply
  // the configured layout (the change was made on purpose), and it holds the layout lock it was
  // handed until it has listed its devices, so no `cushare mig apply` changes them in between.
  bool followed = false;
  int followedLock = -1;
  if (const char* f = std::getenv(kFollowedEnv)) {
    followed = true;
    char* end = nullptr;
    const long fd = std::strtol(f, &end, 10);
    if (end != f && *end == '\0' && fd >= 3 && fd < INT32_MAX && ::fcntl(static_cast<int>(fd), F_GETFD) >= 0 &&
        isLayoutLock(static_cast<int>(fd)))
      followedLock = static_cast<int>(fd);
    ::unsetenv(kFollowedEnv);
  }
  std::string err;
  // The mig: layout (docs/mig.md), before the devices are listed: mig.apply_at_start brings the
  // GPUs to it; then it is checked for the metrics. A layout that cannot be applied (processes on
  // the GPU, a failed NVML call) is logged as an error and the broker starts on the GPUs as they
  // are: tenants running there stay limited, and cushare_mig_layout_matches says 0. --check fails
  // on it instead. A configuration that does not load is reported by the start below.
  BrokerSnapshot::MigLayout migState;
  std::vector<MigLayoutEntry> layout;
  if (Config early; loadConfig(configPath, &early, &err) && early.mig.set && !migLayoutOf(early.mig, &layout, &err)) {
    spdlog::error("mig: {}; the MIG layout is neither applied nor checked", err);  // mig-parted's file
    if (checkOnly) return 1;
  } else if (early.mig.set) {
    mig::Host host;
    if (early.mig.applyAtStart && followed) {
      spdlog::info("mig: started again on a MIG layout changed under the broker: mig.apply_at_start is not run now "
                   "(it runs at the next start by hand or by the system)");
    } else if (early.mig.applyAtStart) {
      mig::Report r;
      // One change of layout at a time (a `cushare mig apply` running now): waited for, 60 s at most.
      mig::ApplyLock lock;
      const bool ran = (checkOnly || lock.acquire(mig::applyLockPath(early), 60000, &err,
                                                  [](const std::string& who) {
                                                    spdlog::warn("mig: {}: waiting for it, 60 s at most", who);
                                                  })) &&
                       mig::applyLayout(host, early, layout, checkOnly, &r, &err);
      for (const std::string& s : r.steps) {
        if (checkOnly) std::printf("%s: mig: %s\n", configPath.c_str(), s.c_str());
        else spdlog::info("mig: {}", s);
      }
      migState.changes = r.changes;
      if (!ran) r.problems.push_back(err);
      for (const std::string& p : r.problems) spdlog::error("mig: {}", p);
      if (!r.problems.empty() && checkOnly) return 1;
      if (!r.problems.empty())
        spdlog::error("mig.apply_at_start: the MIG layout was not (fully) applied; the broker starts on the GPUs as they are");
    }
    std::vector<std::string> diffs;
    if (checkOnly && !early.mig.applyAtStart) {
      if (!mig::assertLayout(host, layout, &diffs, &err)) {
        spdlog::error("mig: cannot check the configured layout: {}", err);
        return 1;
      }
      std::printf("%s: mig: %s\n", configPath.c_str(), diffs.empty() ? "the layout is applied" : "the layout differs:");
      for (const std::string& d : diffs) std::printf("%s: mig:   %s\n", configPath.c_str(), d.c_str());
    } else if (!checkOnly && mig::assertLayout(host, layout, &diffs, &err)) {
      migState.checked = true;
      migState.matches = diffs.empty();
      for (const std::string& d : diffs) spdlog::warn("mig: the GPUs differ from the configured layout: {}", d);
      migState.differences = std::move(diffs);
    } else if (!checkOnly) {
      spdlog::warn("mig: cannot check the configured layout: {}", err);
    }
  }
  err.clear();
  std::vector<cushare::broker::DeviceInfo> devices;
  std::vector<std::string> migIdle;
  const bool listed = listDevices(&devices, &err, &migIdle);
  if (followedLock >= 0) ::close(followedLock);  // the list is taken: `cushare mig apply` may run again
  if (!listed) {
    spdlog::error("{}", err);
    return 1;
  }
  // One broker shares at most kLedgerMaxDevices devices (the ledger's and the host segment's
  // tables); MIG devices count one each (docs/mig.md).
  if (devices.size() > cushare::kLedgerMaxDevices) {
    size_t mig = 0;
    for (const cushare::broker::DeviceInfo& d : devices) mig += d.mig();
    spdlog::error("this host has {} devices{}, more than the {} one broker can share; use fewer, larger MIG instances "
                  "(docs/mig.md)",
                  devices.size(), mig ? " (" + std::to_string(mig) + " of them MIG devices, each counts)" : std::string(),
                  cushare::kLedgerMaxDevices);
    return 1;
  }
  for (const std::string& gpu : migIdle)
    spdlog::warn("GPU {} is in MIG mode without MIG devices: CUDA cannot run on it and the broker shares nothing there "
                 "(create GPU and compute instances, then restart the broker; docs/mig.md)", gpu);
  for (const cushare::broker::DeviceInfo& d : devices)
    if (d.mig())
      spdlog::info("device {}: MIG {} (GPU instance {}, compute instance {}) of GPU {}, {}, {} bytes", d.name(), d.profile,
                   d.gpuInstance, d.computeInstance, d.parentUuid, d.uuid, d.totalBytes);
  installBusGuard();  // before any ledger is mapped and before the threads start
  Broker broker(configPath, devices);
  broker.setMigLayout(migState);
  if (checkOnly) {
    if (!broker.check(&err)) {
      spdlog::error("{}", err);
      return 1;
    }
    Config c;
    std::string why;
    if (loadConfig(configPath, &c, &err) && c.mps.mode != MpsConfig::Mode::kOff) {
      // As the start: the control daemon, then its directories (made there, only looked at here).
      why = migPipeProblem(c.mps, broker.snapshot().devices);
      std::string control = why.empty() ? resolveMpsControl(c.mps, &why) : "";
      if (!control.empty() && !checkMpsDirs(c.mps, &why)) control.clear();
      if (control.empty() && c.mps.mode == MpsConfig::Mode::kOn) {
        spdlog::error("{}: mps.mode on: {}", configPath, why);
        return 1;
      }
      std::printf("%s: mps %s: %s\n", configPath.c_str(), mpsModeName(c.mps.mode),
                  control.empty() ? ("off (" + why + ")").c_str() : ("control daemon " + control).c_str());
    }
    if (loadConfig(configPath, &c, &err)) {
#if !CUSHARE_DEVICE_PLUGIN
      if (c.kubernetes.enabled) {
        spdlog::error("{}: kubernetes: this cushare-broker was built without gRPC (libgrpc++-dev)", configPath);
        return 1;
      }
#endif
      if (c.kubernetes.enabled) {
        std::printf("%s: kubernetes: device plugin in %s, %u device(s) per GPU per tenant%s\n", configPath.c_str(),
                    c.kubernetes.devicePluginDir.c_str(), c.kubernetes.devicesPerGpu,
                    c.kubernetes.gpuCdiDevice.empty() ? ""
                                                      : ("; each GPU as the CDI device " + c.kubernetes.gpuCdiDevice).c_str());
        // As the start: the allocation directories are made there (a failure stops it).
        if (!c.kubernetes.podResourcesSocket.empty() &&
            (!checkParentsOf(c.kubernetes.allocationDir, "kubernetes.allocation_dir", true, &why) ||
             !checkDirWritable(c.kubernetes.allocationDir, "kubernetes.allocation_dir", &why))) {
          spdlog::error("{}: {}", configPath, why);
          return 1;
        }
        std::printf("%s: kubernetes: %s\n", configPath.c_str(),
                    c.kubernetes.podResourcesSocket.empty()
                        ? "pod labels off"
                        : ("pod labels from " + c.kubernetes.podResourcesSocket + " (" +
                           (::access(c.kubernetes.podResourcesSocket.c_str(), F_OK) == 0 ? "present" : "not there now") +
                           "), allocation directories in " + c.kubernetes.allocationDir)
                              .c_str());
      }
      std::string line;
      if (!describeCdi(c, devices, &line, &err)) {
        if (c.cdi.mark.line != 0) {  // asked for: the start would fail
          spdlog::error("{}", err);
          return 1;
        }
        line = err + " (cdi is on by default: the broker would warn and run without a spec; cdi: off silences it)";
      }
      std::printf("%s: %s\n", configPath.c_str(), line.c_str());
    }
    std::printf("%s: valid for this host's %zu device(s)\n", configPath.c_str(), devices.size());
    return 0;
  }
  if (!broker.start(&err)) {
    spdlog::error("{}", err);
    return 1;
  }
  // The MPS control daemon (mps: block), before the control socket answers: a tenant process
  // that sees a ready broker also finds its MPS settings.
  MpsSupervisor mps(broker, configPath);
  if (!mps.start(&err)) {
    spdlog::error("{}", err);
    return 1;
  }
  // The CDI spec (docs/containers.md), before the control socket answers. A failure stops the
  // broker when the configuration asks for CDI explicitly; the default only warns.
  // MIG devices changed since the list was taken (a layout changed under the broker that it does
  // not follow, below): the spec and the plugin give no nodes for them.
  // publishMu: the spec, the plugin's settings and staleMig change under it, from a reload (the
  // control server's thread, or SIGHUP) or from the layout watcher (this thread).
  std::set<std::string> staleMig;
  std::mutex publishMu;
  auto publishCdi = [&broker, &mps, &devices, &staleMig](bool atStart) {
    const Config c = broker.config();
    std::string why;
    if (publishCdiSpec(c, devices, mps.pipeDir(), staleMig, &why)) return true;
    const bool fatal = atStart && c.cdi.mark.line != 0;
    if (fatal) {
      spdlog::error("{}", why);
    } else if (!staleMig.empty() && c.cdi.enabled) {
      // The spec written before names nodes of MIG devices that changed: another instance's now.
      std::string gone;
      const bool removed = cushare::container::removeCdiSpec(c.cdi.specDir, &gone);
      spdlog::error("{}; the spec written before names MIG devices that changed, so it is {}", why,
                    removed ? "removed until one can be written" : "left (it cannot be removed: " + gone + ")");
    } else {
      spdlog::warn("{}{}", why, atStart ? " (cdi is on by default; cdi: off silences this)" : "; the spec written before stays");
    }
    return !fatal;
  };
  if (!publishCdi(true)) return 1;
#if CUSHARE_DEVICE_PLUGIN
  // The kubelet device plugin (docs/kubernetes.md): healthy while the GPU is listed by NVML and
  // MPS (when the broker runs it) answers and has no faulted server.
  std::vector<std::string> gpuUuids, gpuNames;
  // Per device: the UUIDs and names (<gpu>[:<mig>]) of its memory group at start (itself, or the
  // compute instances of its GPU instance).
  std::map<std::string, std::vector<std::pair<std::string, std::string>>> groupAtStart;
  for (size_t i = 0; i < devices.size(); ++i) {
    gpuUuids.push_back(devices[i].uuid);
    gpuNames.push_back(devices[i].name());
    for (size_t k = 0; k < devices.size(); ++k)
      if (devices[k].group(k) == devices[i].group(i))
        groupAtStart[devices[i].uuid].emplace_back(devices[k].uuid, devices[k].name());
  }
  // Healthy also needs the device, and the devices sharing its memory, where the broker listed
  // them: a MIG device renumbered or removed by a layout changed under the broker stops the
  // reading of its GPU instance's accounting (docs/mig.md), and {index} CDI names would give pods
  // another instance.
  auto health = [&broker, &mps, groupAtStart, gpuUuids] {
    std::map<std::string, bool> h;
    std::vector<DeviceInfo> now;
    std::string why;
    if (!listDevices(&now, &why)) return h;  // NVML gone: every GPU unhealthy
    // MPS, per device: its daemon (a MIG device's own, or the whole GPUs') answers and none of that
    // daemon's servers is in FAULT.
    std::map<std::string, bool> mpsOkOf;
    if (mps.active()) {
      const MpsSnapshot m = broker.snapshot().mps;
      for (size_t i = 0; i < gpuUuids.size(); ++i) {
        const bool mig = gpuUuids[i].rfind("MIG-", 0) == 0;
        bool ok = m.deviceUp.empty() ? m.up : i < m.deviceUp.size() && m.deviceUp[i] != 0;
        for (const MpsServerSnapshot& s : m.servers)
          if (s.daemon == (mig ? gpuUuids[i] : std::string())) ok = ok && s.state != "FAULT";
        mpsOkOf[gpuUuids[i]] = ok;
      }
    }
    const auto mpsOkOn = [&](const std::string& uuid) {
      const auto it = mpsOkOf.find(uuid);
      return !mps.active() || (it != mpsOkOf.end() && it->second);
    };
    std::map<std::string, std::string> nameNow;
    for (const DeviceInfo& d : now) nameNow[d.uuid] = d.name();
    for (const DeviceInfo& d : now) {
      const auto group = groupAtStart.find(d.uuid);
      bool same = group != groupAtStart.end();
      if (same)
        for (const auto& [uuid, name] : group->second) {
          const auto n = nameNow.find(uuid);
          same = same && n != nameNow.end() && n->second == name;
        }
      h[d.uuid] = mpsOkOn(d.uuid) && same;
    }
    return h;
  };
  cushare::kubernetes::DevicePlugin plugin(health);
  const Config startConfig = broker.config();
  // Pod labels (docs/kubernetes.md): set at start; moving the socket or the directory needs a restart.
  const std::string podSocket = startConfig.kubernetes.enabled ? startConfig.kubernetes.podResourcesSocket : "";
  const std::string allocationDir = podSocket.empty() ? "" : startConfig.kubernetes.allocationDir;
  auto pluginSettings = [&](const Config& c, cushare::kubernetes::PluginSettings* s, std::string* e) {
    std::vector<TenantEditsOf> edits;
    std::vector<std::string> leftOut;
    if (!containerEdits(c, mps.pipeDir(), &edits, &leftOut, e)) return false;
    for (const std::string& why : leftOut) spdlog::warn("kubernetes: tenant {} has no resource", why);
    s->dir = c.kubernetes.devicePluginDir;
    s->devicesPerGpu = c.kubernetes.devicesPerGpu;
    s->gpus = gpuUuids;
    s->gpuNames = gpuNames;
    s->gpuCdiDevice = c.kubernetes.gpuCdiDevice;
    s->allocationDir = allocationDir;
    bool minorsFromFile = false;
    for (const auto& [uuid, n] : migNodesOf(devices, cushare::container::kMigMinorsFile, &minorsFromFile)) {
      if (staleMig.count(uuid)) continue;  // another instance's nodes now; its devices are Unhealthy
      if (!n.nodes.empty()) s->deviceNodes[uuid] = n.nodes;
      else if (c.kubernetes.gpuCdiDevice.empty())
        spdlog::warn("kubernetes: pods of MIG device {} get no device nodes from the plugin: {}", uuid, n.why);
    }
    Placement placed;
    if (!placementOf(c, devices, &placed, e)) return false;
    for (TenantEditsOf& t : edits) {
      const auto& on = placed[t.tenant];
      // Placement keeps a pod off the other devices only when the pod gets its GPU from the
      // plugin (NVIDIA's CDI device of the allocated device); otherwise NVIDIA's runtime decides
      // which GPUs the container sees.
      if (on && c.kubernetes.gpuCdiDevice.empty() && devices.size() > 1)
        spdlog::warn("kubernetes: tenant {} is limited on some devices only, but without kubernetes.gpu_cdi_device its "
                     "pods get their GPUs from NVIDIA's runtime, not from the devices the plugin allocated: a pod can "
                     "reach a device where {} has no limit", t.tenant, t.tenant);
      s->tenants.push_back({t.tenant, std::move(t.edits), t.cdiDevice, on});
    }
    return true;
  };
  bool pluginOn = startConfig.kubernetes.enabled;
  // The allocation directories name pods: nobody but root and the broker's user may change what
  // lies above them (as for the ledger directory, docs/broker-configuration.md "Places").
  if (!allocationDir.empty() && !checkParentsOf(allocationDir, "kubernetes.allocation_dir", true, &err)) {
    spdlog::error("{}", err);
    return 1;
  }
  cushare::kubernetes::PluginSettings pluginNow;  // what the plugin serves
  if (pluginOn && (!pluginSettings(startConfig, &pluginNow, &err) || !plugin.start(pluginNow, &err))) {
    spdlog::error("{}", err);
    return 1;
  }
  // The plugin with each tenant's devices given by `placed` (the rest as it is); narrow: only
  // devices it has now and `placed` keeps (before a reload commits: the limits a reload lifts are
  // lifted only after the kubelet can no longer give a pod those devices).
  auto placePlugin = [&](const Placement& placed, bool narrow) {
    cushare::kubernetes::PluginSettings s = pluginNow;
    for (cushare::kubernetes::PluginTenant& t : s.tenants) {
      const auto it = placed.find(t.name);
      if (it == placed.end() || (narrow && !it->second)) continue;
      if (!narrow || !t.gpus) {
        t.gpus = it->second;
        continue;
      }
      std::vector<std::string> keep;
      for (const std::string& g : *t.gpus)
        if (std::find(it->second->begin(), it->second->end(), g) != it->second->end()) keep.push_back(g);
      t.gpus = std::move(keep);
    }
    plugin.update(s);
    pluginNow = std::move(s);
  };
  std::shared_ptr<cushare::kubernetes::PodResourcesClient> podResources;
  if (!podSocket.empty()) {
    podResources = std::make_shared<cushare::kubernetes::PodResourcesClient>(podSocket);
    podResources->start();
    broker.setPodLabeler(std::make_shared<cushare::broker::PodLabeler>(
        allocationDir, [podResources](const std::string& r, const std::string& id) { return podResources->find(r, id); },
        [podResources] { return podResources->status(); }));
  }
  auto refreshPlugin = [&] {
    const Config c = broker.config();
    if (c.kubernetes.enabled != pluginOn ||
        (pluginOn && (c.kubernetes.devicePluginDir != startConfig.kubernetes.devicePluginDir ||
                      c.kubernetes.podResourcesSocket != startConfig.kubernetes.podResourcesSocket ||
                      c.kubernetes.allocationDir != startConfig.kubernetes.allocationDir)))
      spdlog::warn("kubernetes: turning the device plugin on or off, moving its directory, the pod resources socket "
                   "or the allocation directory takes effect when the broker restarts");
    if (!pluginOn) return;
    cushare::kubernetes::PluginSettings s;
    std::string why;
    if (pluginSettings(c, &s, &why)) {
      plugin.update(s);
      pluginNow = std::move(s);
      return;
    }
    spdlog::error("{}; the device plugin keeps its tenants' edits", why);
    for (const std::string& u : staleMig) pluginNow.deviceNodes.erase(u);  // but not changed devices' nodes
    Placement placed;  // nor a device where a tenant is now unlimited
    if (placementOf(c, devices, &placed, &why)) placePlugin(placed, false);
    else plugin.update(pluginNow);
  };
  // Before a reload: the devices a tenant leaves go from its resource first.
  auto narrowPlugin = [&] {
    if (!pluginOn) return;
    Config next;
    Placement placed;
    std::string why;
    if (loadConfig(configPath, &next, &why) && placementOf(next, devices, &placed, &why)) placePlugin(placed, true);
  };
  auto restorePlugin = [&] {  // a refused reload: as the configuration in force says
    Placement placed;
    std::string why;
    if (pluginOn && placementOf(broker.config(), devices, &placed, &why)) placePlugin(placed, false);
  };
#else
  if (broker.config().kubernetes.enabled) {
    spdlog::error("kubernetes: this cushare-broker was built without gRPC (libgrpc++-dev), so it cannot serve the "
                  "kubelet device plugin; remove the kubernetes block or rebuild");
    return 1;
  }
  auto refreshPlugin = [] {};
  auto narrowPlugin = [] {};
  auto restorePlugin = [] {};
#endif
  auto reload = [&broker, &mps, &publishCdi, &refreshPlugin, &narrowPlugin, &restorePlugin, &publishMu](std::string* e) {
    std::lock_guard<std::mutex> g(publishMu);
    narrowPlugin();
    const bool ok = broker.reload(e);
    if (ok) {
      mps.refresh();
      publishCdi(false);
      refreshPlugin();
    } else {
      restorePlugin();
    }
    return ok;
  };
  Reaper reaper(broker);
  ControlServer control(broker, reload);
  MetricsServer metrics;
  if (!reaper.start(&err) || !control.start(broker.socketPath(), &err)) {
    spdlog::error("{}", err);
    return 1;
  }
  if (!broker.metricsHost().empty()) {
    if (!metrics.start(broker.metricsHost(), broker.metricsPort(),
                       [&broker] { return renderMetrics(broker.snapshotWithPods()); }, &err)) {
      spdlog::error("{}", err);
      return 1;
    }
    broker.setMetricsAddress(metrics.address());
  }
  ComputeThread compute(broker);
  compute.start();
  spdlog::info("ready: control socket {}, metrics {}", broker.socketPath(),
               broker.metricsHost().empty() ? "off" : "http://" + metrics.address() + "/metrics");

  const int sfd = ::signalfd(-1, &sigs, SFD_CLOEXEC);
  if (sfd < 0) {
    spdlog::error("cannot receive signals (signalfd): {}", std::strerror(errno));
    return 1;
  }
  // Following the MIG layout (docs/mig.md, "When the layout changes"): on a host with MIG devices
  // or a mig: layout, NVML's device list is compared every 2 s with the one this broker started
  // with (config/layout_change.h). MIG devices changed since are left out of the CDI spec's and the
  // plugin's nodes at once. A changed list of MIG devices on the same GPUs, unchanged for 10 s (30 s
  // when a GPU was left without MIG devices: a layout is often changed in steps), while no `cushare
  // mig apply` holds the layout lock (then held until the next start has listed its devices),
  // that gives every device present before and after the same limits, that the configuration and
  // live limits fit, and that `cushare-broker --check` passes on, makes the broker start again in
  // this process (below). One that does not is logged once, with the reason, and looked at again.
  bool startHadMig = !migIdle.empty();
  for (const DeviceInfo& d : devices) startHadMig = startHadMig || d.mig();
  const std::vector<std::string> startList = describeDevices(devices);
  const std::set<std::string> startGpus = gpusOf(devices, migIdle);
  std::vector<std::string> pendingList, refusedList;
  auto pendingSince = std::chrono::steady_clock::now(), refusedAt = pendingSince;
  std::string refusedWhy, refusedText, waitWhy;
  std::unique_ptr<mig::ApplyLock> followLock;
  const auto configText = [&configPath] {
    std::ifstream in(configPath, std::ios::binary);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    return text;
  };
  auto layoutChanged = [&]() {
    std::vector<DeviceInfo> now;
    std::vector<std::string> idle;
    std::string why;
    if (!listDevices(&now, &why, &idle)) return false;
    if (std::set<std::string> stale = changedMigDevices(devices, now); stale != staleMig) {
      std::lock_guard<std::mutex> g(publishMu);
      for (const std::string& u : stale)
        if (!staleMig.count(u))
          spdlog::warn("mig: MIG device {} changed since the broker listed it: its containers get no device nodes from "
                       "cushare until the broker starts again on the new layout", u);
      staleMig = std::move(stale);
      publishCdi(false);
      refreshPlugin();
    }
    const std::vector<std::string> list = describeDevices(now);
    const Config c = broker.config();
    if (list == startList || gpusOf(now, idle) != startGpus || !c.mig.followLayout) {
      pendingList.clear();  // the same, a GPU lost or added (not a layout), or not followed
      return false;
    }
    const auto t = std::chrono::steady_clock::now();
    if (list != pendingList) {
      pendingList = list;
      pendingSince = t;
      return false;
    }
    // A GPU whose MIG devices all went: most likely half-way through a change made by hand.
    bool emptied = false;
    for (const DeviceInfo& d : devices)
      if (d.mig())
        emptied = emptied || std::none_of(now.begin(), now.end(), [&](const DeviceInfo& n) {
          return n.mig() && n.parentUuid == d.parentUuid;
        });
    if (t - pendingSince < std::chrono::seconds(emptied ? 30 : 10)) return false;
    // Judged already, and refused: again when the list or the file changes, or after 30 s (live
    // limits, places on disk).
    const std::string text = configText();
    if (list == refusedList && text == refusedText && t - refusedAt < std::chrono::seconds(30)) return false;
    auto refuse = [&](const std::string& reason) {
      if (list != refusedList || reason != refusedWhy)
        spdlog::error("mig: the MIG layout changed, but the configuration does not fit it: {}; the broker keeps the "
                      "devices it started with until the configuration fits (looked at every 2 s) or it is "
                      "restarted (docs/mig.md)", reason);
      refusedList = list;
      refusedText = text;
      refusedAt = t;
      refusedWhy = reason;
      return false;
    };
    Config next;
    if (now.size() > cushare::kLedgerMaxDevices)
      return refuse("it has " + std::to_string(now.size()) + " devices, more than the " +
                    std::to_string(cushare::kLedgerMaxDevices) + " one broker can share");
    if (!loadConfig(configPath, &next, &why)) return refuse(why);
    if (next.ledgerDir != c.ledgerDir || next.stateFile != c.stateFile || next.socket != c.socket)
      return refuse("the configuration file changes ledger_dir, state_file or socket, which only a restart by hand "
                    "takes");
    if (!sameLimitsAcross(c, devices, next, now, &why)) return refuse(why);
    if (Broker probe(configPath, now); !probe.check(&why)) return refuse(why);
    if (!checkLikeAStart(configPath, &why)) return refuse(why);
    // The layout lock, and the list once more under it: what was judged is what the next start
    // lists (the lock is handed to it and held until it has).
    followLock = std::make_unique<mig::ApplyLock>();
    if (!followLock->acquire(mig::applyLockPath(c), 0, &why)) {
      if (why != waitWhy) spdlog::info("mig: the MIG layout changed; waiting to follow it: {}", why);
      waitWhy = why;
      followLock.reset();
      return false;
    }
    std::vector<DeviceInfo> again;
    if (!listDevices(&again, &why) || describeDevices(again) != list) {
      followLock.reset();
      return false;
    }
    const auto migOf = [](const std::vector<DeviceInfo>& list) {
      std::string out;
      for (const DeviceInfo& d : list)
        if (d.mig()) out += (out.empty() ? "" : ", ") + d.name() + " " + d.profile;
      return out.empty() ? std::string("none") : out;
    };
    spdlog::info("mig: the MIG layout changed (was: {}; now: {}): the broker starts again on it, in this process; "
                 "tenants keep running under their ledgers", migOf(devices), migOf(now));
    return true;
  };
  bool startAgain = false;
  auto lastLook = std::chrono::steady_clock::now();
  for (;;) {
    pollfd pfd{sfd, POLLIN, 0};
    const bool watchLayout = startHadMig || broker.config().mig.set;
    const int ready = ::poll(&pfd, 1, watchLayout ? 1000 : -1);
    if (ready < 0 && errno != EINTR) {
      spdlog::error("cannot receive signals (poll): {}", std::strerror(errno));
      break;
    }
    if (ready <= 0) {
      if (watchLayout && std::chrono::steady_clock::now() - lastLook >= std::chrono::seconds(2)) {
        lastLook = std::chrono::steady_clock::now();
        if (layoutChanged()) {
          startAgain = true;
          break;
        }
      }
      continue;
    }
    signalfd_siginfo si;
    const ssize_t n = ::read(sfd, &si, sizeof si);
    if (n < 0 && errno != EINTR && errno != EAGAIN) {
      spdlog::error("cannot receive signals (signalfd): {}", std::strerror(errno));
      break;
    }
    if (n != sizeof si) continue;
    if (si.ssi_signo == SIGHUP) {
      std::string why;
      reload(&why);  // logs either way
      continue;
    }
    spdlog::info("stopping on signal {}; the ledgers and their limits stay in force", si.ssi_signo);
    break;
  }
  compute.stop();
  broker.computeRelease();  // tenants keep running without the broker: no gate stays closed
  metrics.stop();
  control.stop();
  reaper.stop();
#if CUSHARE_DEVICE_PLUGIN
  plugin.stop();  // the kubelet sees the resources' sockets go
#endif
  if (startAgain) {  // a stop asked for meanwhile wins over the new start
    sigset_t pending;
    if (::sigpending(&pending) == 0 && (sigismember(&pending, SIGTERM) == 1 || sigismember(&pending, SIGINT) == 1)) {
      spdlog::info("stopping on a signal that came while the broker was about to start again on the new MIG layout");
      startAgain = false;
    }
  }
  Config onDisk;
  if (startAgain && loadConfig(configPath, &onDisk, &err) && onDisk.mps.mode == MpsConfig::Mode::kOff)
    mps.stop();  // the next start runs no MPS: nobody would adopt the daemons
  if (!startAgain) {
    mps.stop();  // quits the daemon
    unpublishCdiSpec(broker.config());
    return 0;
  }
  // Starting again on the new layout: as a restart (docs/operations.md), in this process, so that
  // a supervisor sees no exit. The MPS daemons stay for the next start to adopt (or quit, where
  // their MIG device went), the CDI spec for it to rewrite; of this image's files only the layout
  // lock stays open in the next (named in kFollowedEnv), until it has listed its devices.
  mps.detach();
  int lockFd = followLock ? followLock->release() : -1;
  if (lockFd >= 0 && lockFd < 3) {  // stdio was closed at start: above it, where the next start looks
    const int moved = ::fcntl(lockFd, F_DUPFD, 3);
    ::close(lockFd);
    lockFd = moved;
  }
  if (::close_range(3, ~0U, CLOSE_RANGE_CLOEXEC) != 0) {
    if (DIR* d = ::opendir("/proc/self/fd")) {
      std::vector<int> fds;
      while (const dirent* e = ::readdir(d))
        if (e->d_name[0] >= '0' && e->d_name[0] <= '9') fds.push_back(std::atoi(e->d_name));
      ::closedir(d);
      for (const int fd : fds)
        if (fd >= 3) ::fcntl(fd, F_SETFD, FD_CLOEXEC);
    }
  }
  if (lockFd >= 0) ::fcntl(lockFd, F_SETFD, 0);
  ::setenv(kFollowedEnv, std::to_string(lockFd).c_str(), 1);
  ::execv("/proc/self/exe", argv);
  spdlog::error("mig: cannot start again on the new MIG layout ({}): the broker stops; start it again",
                std::strerror(errno));
  return 1;
}
