// The broker configuration schema on top of yaml_tree (see config.h for the contract and
// docs/broker-configuration.md for every key). Parsing runs in two passes: the first reads every
// key in the order written and checks each value on its own; the second resolves names (a
// tenant's profile, unknown_tenants) and applies profiles to tenants. The first problem found
// ends the parse. Single values reuse the shim's parsers so a value means the same thing in the
// file and in a tenant's environment.
#include "config.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>

#include "container/cdi.h"
#include "cushare/host_segment.h"
#include "cushare/mps_settings.h"
#include "cushare/parse.h"
#include "mig_layout.h"
#include "yaml_tree.h"

namespace cushare::broker {
namespace {

using yaml::Node;

constexpr size_t kMaxSocketPath = 107;  // sizeof(sockaddr_un::sun_path) - 1
constexpr size_t kMaxGroupName = 32;
constexpr int64_t kMaxUnknownTenants = 65536;  // a bound on the counts, far above any real host

SourceMark sourceMark(yaml::Mark m) { return SourceMark{m.line, m.column}; }
yaml::Mark yamlMark(SourceMark m) { return yaml::Mark{m.line, m.column}; }

std::string join(const std::string& parent, const std::string& key) {
  const std::string k = yaml::printable(key);
  return parent.empty() ? k : parent + "." + k;
}

std::string quote(std::string_view s) { return "'" + yaml::printable(s) + "'"; }

bool isDigit(char c) { return c >= '0' && c <= '9'; }
bool isHex(char c) { return isDigit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }
bool isAlnum(char c) { return isDigit(c) || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }

std::string listOf(const std::vector<std::string>& names) {
  std::string r;
  for (const std::string& n : names) r += (r.empty() ? "" : ", ") + n;
  return r;
}

const std::vector<std::string> kTopKeys = {"ledger_dir",      "socket",      "metrics_listen",
                                           "unknown_tenants", "admin_group", "state_file",
                                           "hidden_memory_allowance", "context_memory", "tamper_response",
                                           "hidden_memory_response",
                                           "profiles", "tenants",
                                           "max_unknown_tenants", "max_unknown_tenants_per_uid",
                                           "mps", "compute", "probes", "cdi", "kubernetes", "mig", "elasticity"};
const std::vector<std::string> kElasticityKeys = {"reclaim_wait_ms", "reclaim_deadline_ms", "thrash_guard",
                                                  "thrash_quantum_ms"};
const std::vector<std::string> kProbeKeys = {"interval_ms", "window_s", "budget_us", "kinds"};
const std::vector<std::string> kComputeKeys = {"period_ms", "priority_floor_percent", "priority_guard_ms", "metering", "fair_share",
                                               "mps_weights", "metering_source", "cupti_library"};
const std::vector<std::string> kProfileKeys = {"memory", "guarantee", "burst", "thread_percentage", "priority", "weight"};
const std::vector<std::string> kTenantKeys = {"name",     "profile", "memory", "guarantee", "burst", "thread_percentage",
                                              "priority", "weight",  "uid",    "gid"};

// The limit fields a profile or a tenant may set; unset ones are taken from elsewhere.
struct Fields {
  MemorySpec memory;
  MemorySpec guarantee;
  std::optional<BurstMode> burst;
  SourceMark burstMark;
  std::optional<int> threadPercentage;
  std::optional<Priority> priority;
  std::optional<uint32_t> weight;
};

struct TenantDraft {
  Tenant tenant;
  Fields own;
  SourceMark profileMark;
};

class Parser {
 public:
  explicit Parser(const std::string& file) : file_(file) {}

  bool parse(const Node& root, Config* c) {
    c->file = file_;
    if (root.kind != Node::kMap) {
      if (yaml::isNull(root)) return fail(root.mark, "", "the file is empty: it holds no settings");
      return fail(
          root.mark, "",
          "the top level must be a map of settings (key: value), found " + yaml::describe(root));
    }
    for (size_t i = 0; i < root.keys.size(); ++i) {
      if (!topLevel(root.keys[i], root.items[i], c)) return false;
    }
    return resolve(c);
  }

  const std::string& error() const { return error_; }

 private:
  bool fail(yaml::Mark mark, const std::string& path, const std::string& why) {
    error_ = yaml::errorLine(file_, mark, path, why);
    return false;
  }

  bool unknownKey(const Node& key, const std::string& path, const std::vector<std::string>& known) {
    return fail(key.mark, path,
                "unknown key " + quote(key.text) + didYouMean(key.text, known) +
                    " (known keys: " + listOf(known) + ")");
  }

  // A non-empty scalar; what describes the expected value for the message.
  bool scalar(const Node& n, const std::string& path, const std::string& what, std::string* text) {
    if (n.kind != Node::kScalar || yaml::isNull(n) || trim(n.text).empty())
      return fail(
          n.mark, path,
          "expected " + what + ", found " +
              (n.kind == Node::kScalar ? std::string("an empty value") : yaml::describe(n)));
    *text = n.text;
    return true;
  }

  bool map(const Node& n, const std::string& path, const std::string& what) {
    if (n.kind == Node::kMap) return true;
    return fail(n.mark, path, "expected " + what + ", found " + yaml::describe(n));
  }

  // A tenant or profile name: the CUSHARE_TENANT rules (they name files).
  bool name(const Node& n, const std::string& path, const std::string& what, std::string* out) {
    std::string text, reason;
    if (!scalar(n, path, what, &text)) return false;
    if (!parseTenant(text, out, &reason)) return fail(n.mark, path, "invalid name: " + reason);
    return true;
  }

  bool topLevel(const Node& key, const Node& v, Config* c) {
    const std::string& k = key.text;
    const std::string path = join("", k);
    std::string text, reason;
    if (k == "ledger_dir") {
      if (!scalar(v, path, "an absolute path", &text)) return false;
      if (!parseLedgerDir(text, &c->ledgerDir, &reason)) return fail(v.mark, path, reason);
      return true;
    }
    if (k == "socket") {
      if (!scalar(v, path, "an absolute path", &text)) return false;
      if (!socketPath(text, &reason)) return fail(v.mark, path, reason);
      c->socket = text;
      return true;
    }
    if (k == "state_file") {
      if (!scalar(v, path, "an absolute path", &text)) return false;
      if (!parseLedgerDir(text, &c->stateFile, &reason)) return fail(v.mark, path, reason);
      return true;
    }
    if (k == "metrics_listen") {
      if (v.kind == Node::kScalar && v.text == "off") {
        c->metricsHost.clear();
        c->metricsPort = 0;
        return true;
      }
      if (!scalar(v, path, "host:port", &text)) return false;
      if (!listenAddress(text, &c->metricsHost, &c->metricsPort, &reason))
        return fail(v.mark, path, reason);
      return true;
    }
    if (k == "unknown_tenants") {
      if (!scalar(v, path, "'refuse' or the name of a profile", &text)) return false;
      if (text == "refuse") {
        c->unknownTenantsProfile.clear();
        return true;
      }
      unknownTenantsMark_ = v.mark;
      return name(v, path, "'refuse' or the name of a profile", &c->unknownTenantsProfile);
    }
    if (k == "max_unknown_tenants" || k == "max_unknown_tenants_per_uid") {
      if (!scalar(v, path, "a count", &text)) return false;
      int64_t n = 0;
      if (!parseInt(text, 0, kMaxUnknownTenants, &n, &reason)) return fail(v.mark, path, reason);
      (k == "max_unknown_tenants" ? c->maxUnknownTenants : c->maxUnknownTenantsPerUid) = static_cast<uint32_t>(n);
      return true;
    }
    if (k == "admin_group") {
      if (!scalar(v, path, "a group name", &text)) return false;
      if (!groupName(text, &reason)) return fail(v.mark, path, reason);
      c->adminGroup = text;
      return true;
    }
    if (k == "hidden_memory_allowance") {
      if (!scalar(v, path, "a size per process (e.g. 512MiB, 0)", &text)) return false;
      if (!parseSize(text, &c->hiddenMemoryAllowance, &reason)) return fail(v.mark, path, reason);
      return true;
    }
    if (k == "context_memory") {
      if (!scalar(v, path, "a size per process (e.g. 512MiB, 0)", &text)) return false;
      if (!parseSize(text, &c->contextMemory, &reason)) return fail(v.mark, path, reason);
      return true;
    }
    if (k == "tamper_response" || k == "hidden_memory_response") {
      const bool hidden = k == "hidden_memory_response";
      const char* expected = hidden ? "kill_past_limit, kill or charge" : "kill or charge";
      if (!scalar(v, path, expected, &text)) return false;
      Config::TamperResponse* r = hidden ? &c->hiddenMemoryResponse : &c->tamperResponse;
      if (text == "kill") *r = Config::TamperResponse::kKill;
      else if (text == "charge") *r = Config::TamperResponse::kCharge;
      else if (hidden && text == "kill_past_limit") *r = Config::TamperResponse::kKillPastLimit;
      else
        return fail(v.mark, path,
                    std::string("expected ") + expected + ", found " + quote(text) +
                        (hidden ? didYouMean(text, {"kill_past_limit", "kill", "charge"}) : ""));
      return true;
    }
    if (k == "mps") return mps(v, &c->mps);
    if (k == "profiles") return profiles(v, c);
    if (k == "tenants") return tenants(v);
    if (k == "compute") return compute(v, &c->compute);
    if (k == "probes") return probes(v, &c->probes);
    if (k == "elasticity") return elasticity(v, &c->elasticity);
    if (k == "cdi") return cdi(v, &c->cdi);
    if (k == "kubernetes") return kubernetes(v, &c->kubernetes);
    if (k == "mig") return mig(v, &c->mig);
    return unknownKey(key, path, kTopKeys);
  }

  // mig: {layout: [mig-parted entries]} or {config_file: PATH, config: NAME}, and apply_at_start;
  // follow_layout, which may stand alone (then no layout is set).
  bool mig(const Node& n, MigConfig* out) {
    static const std::vector<std::string> kKeys = {"layout", "config_file", "config", "apply_at_start", "follow_layout"};
    MigConfig m;
    m.set = true;
    m.mark = sourceMark(n.mark);
    if (!map(n, "mig", "a map (layout, or config_file and config; apply_at_start; follow_layout)")) return false;
    bool onlyFollow = true;
    for (size_t i = 0; i < n.keys.size(); ++i) {
      const Node& key = n.keys[i];
      const Node& v = n.items[i];
      const std::string path = join("mig", key.text);
      std::string text;
      onlyFollow = onlyFollow && key.text == "follow_layout";
      if (key.text == "layout") {
        if (!parseMigLayoutEntries(v, file_, path, &m.layout, &error_)) return false;
      } else if (key.text == "config_file") {
        if (!scalar(v, path, "the absolute path of mig-parted's configuration file", &text)) return false;
        if (text.front() != '/') return fail(v.mark, path, "expected an absolute path, found " + quote(text));
        m.configFile = text;
      } else if (key.text == "config") {
        if (!scalar(v, path, "the name of a config in config_file (e.g. all-1g.10gb)", &text)) return false;
        m.configName = text;
      } else if (key.text == "apply_at_start" || key.text == "follow_layout") {
        if (!scalar(v, path, "true or false", &text)) return false;
        if (text != "true" && text != "false") return fail(v.mark, path, "expected true or false, found " + quote(text));
        (key.text == "apply_at_start" ? m.applyAtStart : m.followLayout) = text == "true";
      } else {
        return unknownKey(key, path, kKeys);
      }
    }
    if (onlyFollow && !n.keys.empty()) {
      m.set = false;  // no layout: only how the broker meets a changed one
      *out = std::move(m);
      return true;
    }
    if (m.layout.empty() == m.configFile.empty())
      return fail(n.mark, "mig", "give either layout or config_file (with config), not both or neither");
    if (m.configFile.empty() != m.configName.empty())
      return fail(n.mark, "mig", "config_file and config go together");
    *out = std::move(m);
    return true;
  }

  // probes: off | on | {interval_ms: 20..600000, window_s: 1..3600, budget_us: 20..10000,
  //                     kinds: [sm, mem, tick]}
  bool elasticity(const Node& n, ElasticityConfig* out) {
    ElasticityConfig e;
    if (!map(n, "elasticity", "a map of settings (reclaim_wait_ms, reclaim_deadline_ms, thrash_guard, thrash_quantum_ms)"))
      return false;
    for (size_t i = 0; i < n.keys.size(); ++i) {
      const Node& key = n.keys[i];
      const Node& v = n.items[i];
      const std::string path = join("elasticity", key.text);
      std::string text, reason;
      if (key.text == "thrash_guard") {
        if (!scalar(v, path, "on or off", &text)) return false;
        if (text != "on" && text != "off") return fail(v.mark, path, "expected on or off, found '" + text + "'");
        e.thrashGuard = text == "on";
        continue;
      }
      if (key.text != "reclaim_wait_ms" && key.text != "reclaim_deadline_ms" && key.text != "thrash_quantum_ms")
        return unknownKey(key, path, kElasticityKeys);
      const bool wait = key.text == "reclaim_wait_ms", quantum = key.text == "thrash_quantum_ms";
      const int64_t lo = wait ? 0 : quantum ? 100 : 10, hi = wait ? 60000 : 600000;
      if (!scalar(v, path, "a whole number " + std::to_string(lo) + ".." + std::to_string(hi), &text)) return false;
      int64_t x = 0;
      if (!parseInt(text, lo, hi, &x, &reason)) return fail(v.mark, path, reason);
      (wait ? e.reclaimWaitMs : quantum ? e.thrashQuantumMs : e.reclaimDeadlineMs) = static_cast<uint32_t>(x);
    }
    *out = e;
    return true;
  }

  bool probes(const Node& n, ProbeConfig* out) {
    ProbeConfig p;
    p.on = true;  // a probes: block turns them on unless it says off
    if (n.kind == Node::kScalar) {
      if (n.text != "off" && n.text != "on")
        return fail(n.mark, "probes", "expected off, on or a map of settings, found '" + n.text + "'");
      p.on = n.text == "on";
      *out = p;
      return true;
    }
    if (!map(n, "probes", "off, on or a map of settings (interval_ms, window_s, budget_us, kinds)"))
      return false;
    for (size_t i = 0; i < n.keys.size(); ++i) {
      const Node& key = n.keys[i];
      const Node& v = n.items[i];
      const std::string path = join("probes", key.text);
      std::string text, reason;
      if (key.text == "interval_ms" || key.text == "window_s" || key.text == "budget_us") {
        const int64_t lo = key.text == "interval_ms" ? 20 : key.text == "window_s" ? 1 : 20;
        const int64_t hi = key.text == "interval_ms" ? 600000 : key.text == "window_s" ? 3600 : 10000;
        if (!scalar(v, path, "a whole number " + std::to_string(lo) + ".." + std::to_string(hi), &text)) return false;
        int64_t x = 0;
        if (!parseInt(text, lo, hi, &x, &reason)) return fail(v.mark, path, reason);
        (key.text == "interval_ms" ? p.intervalMs : key.text == "window_s" ? p.windowS : p.budgetUs) =
            static_cast<uint32_t>(x);
      } else if (key.text == "kinds") {
        if (v.kind != Node::kList || v.items.empty())
          return fail(v.mark, path, "expected a list of probes from sm, mem and tick, e.g. [sm, tick]");
        p.kinds = 0;
        for (const Node& k : v.items) {
          const uint32_t bit = k.kind != Node::kScalar ? 0 : k.text == "sm" ? 1u : k.text == "mem" ? 2u : k.text == "tick" ? 4u : 0;
          if (bit == 0) return fail(k.mark, path, "unknown probe '" + k.text + "' (probes: sm, mem, tick)");
          if (p.kinds & bit) return fail(k.mark, path, "probe '" + k.text + "' listed twice");
          p.kinds |= bit;
        }
      } else {
        return unknownKey(key, path, kProbeKeys);
      }
    }
    *out = p;
    return true;
  }

  // The mps: block (MpsConfig). Kept apart from the other top-level keys.
  bool mps(const Node& n, MpsConfig* m) {
    static const std::vector<std::string> kMpsKeys = {"mode", "control", "pipe_dir", "log_dir", "context_reserve",
                                                       "multiuser"};
    if (!map(n, "mps", "a map of MPS settings (mode, control, pipe_dir, log_dir, context_reserve, multiuser)"))
      return false;
    m->mark = sourceMark(n.mark);
    for (size_t i = 0; i < n.keys.size(); ++i) {
      const Node& key = n.keys[i];
      const Node& v = n.items[i];
      const std::string path = join("mps", key.text);
      std::string text, reason;
      if (key.text == "mode") {
        if (!scalar(v, path, "off, on or auto", &text)) return false;
        if (text == "off") m->mode = MpsConfig::Mode::kOff;
        else if (text == "on") m->mode = MpsConfig::Mode::kOn;
        else if (text == "auto") m->mode = MpsConfig::Mode::kAuto;
        else return fail(v.mark, path, "expected off, on or auto, found " + quote(text));
      } else if (key.text == "control") {
        if (!scalar(v, path, "the control binary (an absolute path or a name on PATH)", &text)) return false;
        if (text.find('/') != std::string::npos && text[0] != '/')
          return fail(v.mark, path, "a relative path " + quote(text) + " would depend on the broker's working "
                                    "directory: give an absolute path, or a bare name to look up on PATH");
        for (char ch : text)
          if (static_cast<unsigned char>(ch) < 0x20) return fail(v.mark, path, "a control character in the path");
        m->control = text;
      } else if (key.text == "pipe_dir" || key.text == "log_dir") {
        std::string* dir = key.text == "pipe_dir" ? &m->pipeDir : &m->logDir;
        if (!scalar(v, path, "an absolute path", &text)) return false;
        if (!parseLedgerDir(text, dir, &reason)) return fail(v.mark, path, reason);
        if (key.text == "pipe_dir" && dir->size() > kMaxMpsPipeDir)
          return fail(v.mark, path, "longer than " + std::to_string(kMaxMpsPipeDir) + " bytes: the daemon's socket "
                                    "<pipe_dir>/control must fit a Unix socket address (107 bytes)");
      } else if (key.text == "context_reserve") {
        if (!scalar(v, path, "a size (e.g. 512MiB, 0)", &text)) return false;
        if (!parseSize(text, &m->contextReserve, &reason)) return fail(v.mark, path, reason);
      } else if (key.text == "multiuser") {
        if (!scalar(v, path, "on or off", &text)) return false;
        if (text == "on") m->multiuser = true;
        else if (text == "off") m->multiuser = false;
        else return fail(v.mark, path, "expected on or off, found " + quote(text));
      } else {
        return unknownKey(key, path, kMpsKeys);
      }
    }
    if (m->pipeDir == m->logDir)
      return fail(n.mark, "mps", "pipe_dir and log_dir are the same directory " + quote(m->pipeDir));
    return true;
  }

  // cdi: off, or {spec_dir: DIR, shim: PATH, remove_on_stop: on|off}. Kept apart from the rest.
  bool cdi(const Node& n, CdiConfig* out) {
    static const std::vector<std::string> kCdiKeys = {"spec_dir", "shim", "remove_on_stop"};
    CdiConfig c;
    c.mark = sourceMark(n.mark);
    if (n.kind == Node::kScalar && n.text == "off") {
      c.enabled = false;
      *out = c;
      return true;
    }
    if (!map(n, "cdi", "off, or a map of CDI settings (spec_dir, shim, remove_on_stop)")) return false;
    for (size_t i = 0; i < n.keys.size(); ++i) {
      const Node& key = n.keys[i];
      const Node& v = n.items[i];
      const std::string path = join("cdi", key.text);
      std::string text, reason;
      if (key.text == "spec_dir" || key.text == "shim") {
        std::string* dest = key.text == "shim" ? &c.shim : &c.specDir;
        if (!scalar(v, path, "an absolute path", &text)) return false;
        if (!parseLedgerDir(text, dest, &reason)) return fail(v.mark, path, reason);
        if (key.text == "shim")
          for (const char ch : *dest)
            if (ch == ':' || ch == ' ' || ch == '\t')
              return fail(v.mark, path, "a ':' or a space in the path: LD_PRELOAD splits paths there");
      } else if (key.text == "remove_on_stop") {
        if (!scalar(v, path, "on or off", &text)) return false;
        if (text != "on" && text != "off") return fail(v.mark, path, "expected on or off, found " + quote(text));
        c.removeOnStop = text == "on";
      } else {
        return unknownKey(key, path, kCdiKeys);
      }
    }
    *out = c;
    return true;
  }

  // kubernetes: {device_plugin_dir: DIR, devices_per_gpu: 1..100, gpu_cdi_device: TEMPLATE,
  //              pod_resources_socket: PATH|off, allocation_dir: DIR}.
  bool kubernetes(const Node& n, KubernetesConfig* out) {
    static const std::vector<std::string> kKeys = {"device_plugin_dir", "devices_per_gpu", "gpu_cdi_device",
                                                   "pod_resources_socket", "allocation_dir"};
    KubernetesConfig k;
    k.enabled = true;
    k.mark = sourceMark(n.mark);
    if (yaml::isNull(n)) {  // "kubernetes:" alone: the defaults
      *out = k;
      return true;
    }
    if (!map(n, "kubernetes", "a map of device plugin settings (device_plugin_dir, devices_per_gpu)")) return false;
    for (size_t i = 0; i < n.keys.size(); ++i) {
      const Node& key = n.keys[i];
      const Node& v = n.items[i];
      const std::string path = join("kubernetes", key.text);
      std::string text, reason;
      if (key.text == "device_plugin_dir") {
        if (!scalar(v, path, "an absolute path", &text)) return false;
        if (!parseLedgerDir(text, &k.devicePluginDir, &reason)) return fail(v.mark, path, reason);
        if (k.devicePluginDir.size() > kMaxDevicePluginDir)
          return fail(v.mark, path, "longer than " + std::to_string(kMaxDevicePluginDir) +
                                    " bytes: the plugins' sockets in it must fit a Unix socket address (107 bytes)");
      } else if (key.text == "devices_per_gpu") {
        if (!scalar(v, path, "a count, 1..100", &text)) return false;
        int64_t x = 0;
        if (!parseInt(text, 1, 100, &x, &reason)) return fail(v.mark, path, reason);
        k.devicesPerGpu = static_cast<uint32_t>(x);
      } else if (key.text == "gpu_cdi_device") {
        if (!scalar(v, path, "a CDI device name with {uuid} or {index}, e.g. nvidia.com/gpu={uuid}", &text)) return false;
        std::string sample;
        if (!container::gpuCdiDevice(text, "GPU-00000000-0000-0000-0000-000000000000", "0", &sample, &reason))
          return fail(v.mark, path, reason);
        k.gpuCdiDevice = text;
      } else if (key.text == "pod_resources_socket") {
        if (!scalar(v, path, "the kubelet's pod resources socket (an absolute path) or off", &text)) return false;
        if (text == "off") {
          k.podResourcesSocket.clear();
          continue;
        }
        if (!parseLedgerDir(text, &k.podResourcesSocket, &reason)) return fail(v.mark, path, reason + ", or off");
        if (k.podResourcesSocket.size() > 107)
          return fail(v.mark, path, "longer than 107 bytes, the limit of a Unix socket address");
      } else if (key.text == "allocation_dir") {
        if (!scalar(v, path, "an absolute path", &text)) return false;
        if (!parseLedgerDir(text, &k.allocationDir, &reason)) return fail(v.mark, path, reason);
        if (k.allocationDir == "/")
          return fail(v.mark, path, "the root directory: name a directory of its own, e.g. /run/cushare/allocations");
        if (k.allocationDir.size() > kMaxAllocationDir)
          return fail(v.mark, path, "longer than " + std::to_string(kMaxAllocationDir) + " bytes");
      } else {
        return unknownKey(key, path, kKeys);
      }
    }
    *out = k;
    return true;
  }

  // compute: {period_ms: 5..1000, priority_floor_percent: 0..100, priority_guard_ms: 0..1000,
  //           metering: on|off, fair_share: on|off, mps_weights: on|off,
  //           metering_source: events|cupti|auto, cupti_library: absolute path}
  bool compute(const Node& n, ComputeConfig* out) {
    if (!map(n, "compute",
             "a map of settings (period_ms, priority_floor_percent, priority_guard_ms, metering, fair_share, "
             "mps_weights, metering_source, cupti_library)"))
      return false;
    const Node* sourceValue = nullptr;
    ComputeConfig c;
    for (size_t i = 0; i < n.keys.size(); ++i) {
      const Node& key = n.keys[i];
      const Node& v = n.items[i];
      const std::string path = join("compute", key.text);
      std::string text, reason;
      if (key.text == "period_ms" || key.text == "priority_floor_percent") {
        const bool period = key.text == "period_ms";
        if (!scalar(v, path, period ? "milliseconds, 5..1000" : "a percentage, 0..100, no % sign", &text)) return false;
        int64_t x = 0;
        if (!parseInt(text, period ? 5 : 0, period ? 1000 : 100, &x, &reason)) return fail(v.mark, path, reason);
        (period ? c.periodMs : c.priorityFloorPercent) = static_cast<uint32_t>(x);
      } else if (key.text == "priority_guard_ms") {
        if (!scalar(v, path, "milliseconds, 0..1000", &text)) return false;
        int64_t x = 0;
        if (!parseInt(text, 0, 1000, &x, &reason)) return fail(v.mark, path, reason);
        c.priorityGuardMs = static_cast<uint32_t>(x);
      } else if (key.text == "metering" || key.text == "fair_share" || key.text == "mps_weights") {
        if (!scalar(v, path, "on or off", &text)) return false;
        if (text != "on" && text != "off") return fail(v.mark, path, "expected on or off, found '" + text + "'");
        (key.text == "metering" ? c.metering : key.text == "fair_share" ? c.fairShare : c.mpsWeights) = text == "on";
      } else if (key.text == "metering_source") {
        if (!scalar(v, path, "events, cupti or auto", &text)) return false;
        if (!parseMetering(text, &c.meteringSource, &reason)) return fail(v.mark, path, reason);
        sourceValue = &v;
      } else if (key.text == "cupti_library") {
        if (!scalar(v, path, "an absolute path to libcupti.so.13", &text)) return false;
        if (text.empty() || text.front() != '/' || text.back() == '/')
          return fail(v.mark, path, "expected an absolute path to a file, found '" + text + "'");
        if (text.size() >= kHostCuptiPathBytes)
          return fail(v.mark, path, "longer than " + std::to_string(kHostCuptiPathBytes - 1) + " bytes");
        if (text.find_first_of(std::string("\n\0", 2)) != std::string::npos)
          return fail(v.mark, path, "a path with a newline or NUL");
        c.cuptiLibrary = text;
      } else {
        return unknownKey(key, path, kComputeKeys);
      }
    }
    if (c.meteringSource == MeteringSource::kCupti && c.cuptiLibrary.empty())
      return fail(sourceValue->mark, "compute.metering_source",
                  "cupti needs compute.cupti_library: the one file tenant processes may load CUPTI from");
    *out = c;
    return true;
  }

  bool profiles(const Node& n, Config* c) {
    if (!map(n, "profiles", "a map of profile name to settings")) return false;
    for (size_t i = 0; i < n.keys.size(); ++i) {
      const Node& key = n.keys[i];
      const std::string path = join("profiles", key.text);
      Profile p;
      if (!name(key, path, "a profile name", &p.name)) return false;
      if (p.name == "refuse")
        return fail(key.mark, path,
                    "'refuse' cannot name a profile (unknown_tenants: refuse means refusing)");
      p.mark = sourceMark(key.mark);
      const Node& v = n.items[i];
      if (!map(v, path, "a map of settings (memory, thread_percentage, priority, weight)")) return false;
      Fields f;
      for (size_t j = 0; j < v.keys.size(); ++j) {
        bool known = false;
        if (!field(v.keys[j], v.items[j], path, &f, &known)) return false;
        if (!known) return unknownKey(v.keys[j], join(path, v.keys[j].text), kProfileKeys);
      }
      if (!burstFits(f, path, p.mark)) return false;
      p.memory = std::move(f.memory);
      p.guarantee = std::move(f.guarantee);
      p.burst = f.burst;
      p.threadPercentage = f.threadPercentage;
      p.priority = f.priority;
      p.weight = f.weight;
      c->profiles.push_back(std::move(p));
    }
    return true;
  }

  bool tenants(const Node& n) {
    if (n.kind != Node::kList)
      return fail(n.mark, "tenants", "expected a list of tenants, found " + yaml::describe(n));
    for (size_t i = 0; i < n.items.size(); ++i) {
      const Node& item = n.items[i];
      TenantDraft d;
      Tenant& t = d.tenant;
      t.path = "tenants[" + std::to_string(i) + "]";
      t.mark = sourceMark(item.mark);
      if (!map(item, t.path, "a map of tenant settings (name, profile, memory, ...)")) return false;
      bool named = false;
      for (size_t j = 0; j < item.keys.size(); ++j) {
        const Node& key = item.keys[j];
        const Node& v = item.items[j];
        const std::string path = join(t.path, key.text);
        bool known = false;
        if (!field(key, v, t.path, &d.own, &known)) return false;
        if (known) continue;
        if (key.text == "name") {
          if (!name(v, path, "a tenant name", &t.name)) return false;
          for (const TenantDraft& prev : drafts_) {
            if (prev.tenant.name == t.name)
              return fail(v.mark, path,
                          "duplicate tenant " + quote(t.name) + " (first at line " +
                              std::to_string(prev.tenant.mark.line) + ", " + prev.tenant.path +
                              ")");
          }
          named = true;
        } else if (key.text == "profile") {
          if (!name(v, path, "a profile name", &t.profile)) return false;
          d.profileMark = sourceMark(v.mark);
        } else if (key.text == "uid" || key.text == "gid") {
          std::string text, reason;
          int64_t id = 0;
          if (!scalar(v, path, "a numeric id", &text)) return false;
          if (!parseInt(text, 0, UINT32_MAX - 1, &id, &reason)) return fail(v.mark, path, reason);
          (key.text == "uid" ? t.uid : t.gid) = static_cast<uint32_t>(id);
        } else {
          return unknownKey(key, path, kTenantKeys);
        }
      }
      if (!named) return fail(item.mark, t.path, "missing key 'name'");
      drafts_.push_back(std::move(d));
    }
    return true;
  }

  // A guarantee means bursting above it (managed unless burst says otherwise) and needs a memory
  // limit to burst to; burst: managed needs a guarantee. Checked on the effective fields.
  bool burstFits(const Fields& f, const std::string& path, SourceMark at) {
    const bool guaranteed = f.guarantee.kind != MemorySpec::kNone;
    const BurstMode b = f.burst.value_or(guaranteed ? BurstMode::kManaged : BurstMode::kOff);
    if (guaranteed && b == BurstMode::kOff)
      return fail(yamlMark(f.guarantee.mark), f.guarantee.path,
                  "a guarantee with burst: off means nothing: the memory limit is already reserved; remove one of them");
    if (!guaranteed && b != BurstMode::kOff)
      return fail(yamlMark(f.burstMark.line ? f.burstMark : at), path + ".burst",
                  std::string("burst: ") + burstModeName(b) +
                      " needs a guarantee (the memory reserved for it; above it, up to memory, it bursts)");
    if (guaranteed && f.memory.kind == MemorySpec::kNone)
      return fail(yamlMark(f.guarantee.mark), f.guarantee.path,
                  "a guarantee needs a memory limit (the most it may burst to)");
    return true;
  }

  // memory, thread_percentage, priority or weight, into *f; *known false for any other key.
  bool field(const Node& key, const Node& v, const std::string& parent, Fields* f, bool* known) {
    const std::string path = join(parent, key.text);
    std::string text, reason;
    *known = true;
    if (key.text == "memory") return memory(v, path, &f->memory);
    if (key.text == "guarantee") return memory(v, path, &f->guarantee);
    if (key.text == "burst") {
      if (!scalar(v, path, "off, managed or plain", &text)) return false;
      f->burstMark = sourceMark(v.mark);
      if (text == "off") {
        f->burst = BurstMode::kOff;
      } else if (text == "managed") {
        f->burst = BurstMode::kManaged;
      } else if (text == "plain") {
        f->burst = BurstMode::kPlain;
      } else {
        return fail(v.mark, path, "expected off, managed or plain, found " + quote(text));
      }
      return true;
    }
    if (key.text == "thread_percentage") {
      int p = 0;
      if (!scalar(v, path, "a whole percentage 1..100", &text)) return false;
      if (!parseThreadPercentage(text, &p, &reason)) return fail(v.mark, path, reason);
      f->threadPercentage = p;
      return true;
    }
    if (key.text == "priority") {
      Priority p = Priority::kNormal;
      if (!scalar(v, path, "high, normal or low", &text)) return false;
      if (!parsePriority(text, &p, &reason)) return fail(v.mark, path, reason);
      f->priority = p;
      return true;
    }
    if (key.text == "weight") {
      if (!scalar(v, path, "a whole number 1..1000", &text)) return false;
      int64_t w = 0;
      if (!parseInt(text, 1, 1000, &w, &reason)) return fail(v.mark, path, reason);
      f->weight = static_cast<uint32_t>(w);
      return true;
    }
    *known = false;
    return true;
  }

  bool memory(const Node& n, const std::string& path, MemorySpec* out) {
    MemorySpec m;
    m.mark = sourceMark(n.mark);
    m.path = path;
    if (n.kind == Node::kList)
      return fail(n.mark, path,
                  "expected a size, a percentage or a map of device to size, found a list");
    if (n.kind == Node::kScalar) {
      if (!amount(n, path, &m.all)) return false;
      m.kind = MemorySpec::kAll;
      *out = std::move(m);
      return true;
    }
    if (n.keys.empty())
      return fail(n.mark, path, "an empty map names no device; remove the key for no limit");
    for (size_t i = 0; i < n.keys.size(); ++i) {
      const Node& key = n.keys[i];
      const std::string kpath = join(path, key.text);
      MemorySpec::Entry e;
      e.key = key.text;
      e.mark = sourceMark(key.mark);
      if (!deviceKey(key, kpath, &e)) return false;
      if (!amount(n.items[i], kpath, &e.amount)) return false;
      for (const MemorySpec::Entry& prev : m.entries) {
        const bool same =
            e.uuid.empty() ? prev.ordinal == e.ordinal && prev.migIndex == e.migIndex : prev.uuid == e.uuid;
        if (same)
          return fail(key.mark, kpath,
                      "duplicate device " + quote(key.text) + ": " + quote(prev.key) + " at line " +
                          std::to_string(prev.mark.line) + " already names it" +
                          (e.uuid.empty() ? "" : " (UUIDs compare case-insensitively)"));
      }
      m.entries.push_back(std::move(e));
    }
    m.kind = MemorySpec::kPerDevice;
    *out = std::move(m);
    return true;
  }

  // A device key: by the CUSHARE_MEMORY_LIMIT rules an ordinal, GPU-<uuid> or MIG-<uuid>; or a
  // MIG device of a GPU as <gpu>:<mig> (NVIDIA's naming, e.g. "0:1").
  bool deviceKey(const Node& key, const std::string& path, MemorySpec::Entry* e) {
    const std::string_view k = trim(key.text);
    const auto notADevice = [&] {
      return fail(key.mark, path,
                  "device " + quote(key.text) +
                      " is neither a non-negative integer ordinal, <gpu>:<mig> (a MIG device), GPU-<uuid> nor "
                      "MIG-<uuid>");
    };
    if (k.empty() || k.find_first_of(",=") != std::string_view::npos) return notADevice();
    const auto prefixed = [&](const char* p) {
      return k.size() >= 4 && std::equal(k.begin(), k.begin() + 4, p, [](char a, char b) {
               return std::tolower(static_cast<unsigned char>(a)) == b;
             });
    };
    if (k.find(':') == std::string_view::npos && !prefixed("gpu-") && !prefixed("mig-") &&
        !std::all_of(k.begin(), k.end(), [](char c) { return c >= '0' && c <= '9'; }))
      return notADevice();
    if (const size_t colon = k.find(':'); colon != std::string_view::npos) {
      int64_t gpu = 0, mig = 0;
      const std::string_view g = k.substr(0, colon), m = k.substr(colon + 1);
      const auto digits = [](std::string_view v) {
        return !v.empty() && std::all_of(v.begin(), v.end(), [](char c) { return c >= '0' && c <= '9'; });
      };
      if (!digits(g) || !digits(m)) return notADevice();
      if (!parseInt(g, 0, 1023, &gpu, nullptr) || !parseInt(m, 0, 1023, &mig, nullptr))
        return fail(key.mark, path, "device " + quote(key.text) + ": GPU or MIG index too large");
      e->ordinal = static_cast<int>(gpu);
      e->migIndex = static_cast<int>(mig);
      return true;
    }
    MemoryLimitSpec one;
    std::string reason;
    if (!parseMemoryLimit(std::string(k) + "=1", &one, &reason) || one.entries.size() != 1)
      return fail(key.mark, path, reason);
    e->ordinal = one.entries[0].ordinal;
    e->uuid = one.entries[0].uuid;
    return true;
  }

  bool amount(const Node& n, const std::string& path, MemoryAmount* out) {
    std::string text, reason;
    if (!scalar(n, path, "a size (e.g. 8GiB) or a percentage of the device (e.g. 25%)", &text))
      return false;
    const std::string_view s = trim(text);
    if (s.back() == '%') {
      uint32_t milli = 0;
      if (!parsePercent(s, &milli, &reason))
        return fail(n.mark, path, "invalid percentage " + quote(s) + ": " + reason);
      out->bytes = 0;
      out->milliPercent = milli;
      return true;
    }
    if (s.find_first_of(",=") != std::string_view::npos)
      return fail(n.mark, path,
                  "invalid size " + quote(s) +
                      ": per-device limits are written as a map, e.g. {0: 8GiB, 1: 4GiB}");
    uint64_t bytes = 0;
    if (!parseSize(s, &bytes, &reason)) return fail(n.mark, path, reason);
    if (bytes == 0)
      return fail(n.mark, path,
                  "a limit of " + quote(s) +
                      " would deny every allocation; remove the key for "
                      "no limit");
    // 2^64 - 1 bytes is how the broker and the shim spell "no limit": written as a limit it
    // would make the tenant unlimited (and escape admission) without saying so.
    if (bytes == kUnlimited)
      return fail(n.mark, path,
                  "a limit of " + quote(s) + " is the value that means no limit; remove the key for no limit");
    out->bytes = bytes;
    out->milliPercent = 0;
    return true;
  }

  static bool socketPath(const std::string& s, std::string* reason) {
    if (s.front() != '/') return (*reason = "not an absolute path (it must start with '/')", false);
    if (s.size() > kMaxSocketPath)
      return (*reason = "path of " + std::to_string(s.size()) + " bytes, at most " +
                        std::to_string(kMaxSocketPath) + " allowed for a Unix socket",
              false);
    if (s.back() == '/') return (*reason = "names a directory (ends with '/')", false);
    for (char c : s) {
      const unsigned char u = static_cast<unsigned char>(c);
      if (u < 0x20 || u == 0x7f) return (*reason = "control character in the path", false);
    }
    return true;
  }

  static bool listenAddress(const std::string& s, std::string* host, uint16_t* port,
                            std::string* reason) {
    const std::string expect = "expected host:port (e.g. 127.0.0.1:9464, [::1]:9464)";
    const size_t colon = s.rfind(':');
    if (colon == std::string::npos) return (*reason = quote(s) + ": " + expect, false);
    std::string h = s.substr(0, colon);
    const std::string p = s.substr(colon + 1);
    if (!h.empty() && h.front() == '[') {
      if (h.size() < 3 || h.back() != ']') return (*reason = quote(s) + ": " + expect, false);
      h = h.substr(1, h.size() - 2);
      for (char c : h)
        if (!isHex(c) && c != ':' && c != '.')
          return (*reason = "invalid IPv6 address " + quote(h), false);
    } else {
      if (h.empty())
        return (*reason = quote(s) + ": empty host (use 0.0.0.0 for every address)", false);
      if (h.find(':') != std::string::npos)
        return (*reason = quote(s) + ": an IPv6 address needs brackets, e.g. [::1]:9464", false);
      for (char c : h)
        if (!isAlnum(c) && c != '.' && c != '-' && c != '_')
          return (*reason = "invalid host " + quote(h), false);
    }
    int64_t v = 0;
    bool digits = !p.empty() && p.size() <= 5;
    for (char c : p) digits = digits && isDigit(c);
    if (!digits || !parseInt(p, 0, 65535, &v, nullptr))
      return (*reason = "port " + quote(p) + " is not a number 0..65535 (0: any free port)", false);
    *host = std::move(h);
    *port = static_cast<uint16_t>(v);
    return true;
  }

  static bool groupName(const std::string& s, std::string* reason) {
    if (s.size() > kMaxGroupName)
      return (*reason = "group name of " + std::to_string(s.size()) + " characters, at most " +
                        std::to_string(kMaxGroupName) + " allowed",
              false);
    if (s.front() == '-') return (*reason = "a group name cannot start with '-'", false);
    for (char c : s)
      if (!isAlnum(c) && c != '_' && c != '.' && c != '-')
        return (*reason = "invalid group name " + quote(s) + " (use A-Z a-z 0-9 _ . -)", false);
    return true;
  }

  const Profile* findProfile(const Config& c, const std::string& n) const {
    for (const Profile& p : c.profiles)
      if (p.name == n) return &p;
    return nullptr;
  }

  std::string noProfile(const Config& c, const std::string& n) const {
    std::vector<std::string> names;
    for (const Profile& p : c.profiles) names.push_back(p.name);
    return "no profile " + quote(n) + didYouMean(n, names) +
           (names.empty() ? " (no profiles are defined)" : " (profiles: " + listOf(names) + ")");
  }

  // Second pass: profile references, then the effective fields of each tenant.
  bool resolve(Config* c) {
    for (TenantDraft& d : drafts_) {
      Tenant& t = d.tenant;
      Fields eff;
      if (!t.profile.empty()) {
        const Profile* p = findProfile(*c, t.profile);
        if (!p) return fail(yamlMark(d.profileMark), t.path + ".profile", noProfile(*c, t.profile));
        eff.memory = p->memory;
        eff.guarantee = p->guarantee;
        eff.burst = p->burst;
        eff.threadPercentage = p->threadPercentage;
        eff.priority = p->priority;
        eff.weight = p->weight;
      }
      if (d.own.memory.kind != MemorySpec::kNone) eff.memory = std::move(d.own.memory);
      if (d.own.guarantee.kind != MemorySpec::kNone && d.own.burst == BurstMode::kOff)
        return fail(yamlMark(d.own.guarantee.mark), d.own.guarantee.path,
                    "a guarantee with burst: off means nothing: the memory limit is already reserved; remove one of them");
      if (d.own.guarantee.kind != MemorySpec::kNone) {
        eff.guarantee = std::move(d.own.guarantee);
        if (!d.own.burst) eff.burst.reset();  // the tenant's own guarantee bursts as managed by default
      }
      if (d.own.burst) {
        eff.burst = d.own.burst;
        eff.burstMark = d.own.burstMark;
        if (*d.own.burst == BurstMode::kOff) eff.guarantee = MemorySpec{};  // off: no guarantee below the limit
      }
      if (!burstFits(eff, t.path, t.mark)) return false;
      if (d.own.threadPercentage) eff.threadPercentage = d.own.threadPercentage;
      if (d.own.priority) eff.priority = d.own.priority;
      if (d.own.weight) eff.weight = d.own.weight;
      t.memory = std::move(eff.memory);
      t.burst = eff.guarantee.kind == MemorySpec::kNone ? BurstMode::kOff : eff.burst.value_or(BurstMode::kManaged);
      t.guarantee = std::move(eff.guarantee);
      t.threadPercentage = eff.threadPercentage;
      t.priority = eff.priority.value_or(Priority::kNormal);
      t.weight = eff.weight.value_or(1);
      c->tenants.push_back(std::move(t));
    }
    if (!c->unknownTenantsProfile.empty() && !findProfile(*c, c->unknownTenantsProfile))
      return fail(unknownTenantsMark_, "unknown_tenants", noProfile(*c, c->unknownTenantsProfile));
    if (const Profile* u = c->unknownTenantsProfile.empty() ? nullptr : findProfile(*c, c->unknownTenantsProfile);
        u && u->guarantee.kind != MemorySpec::kNone)
      return fail(unknownTenantsMark_, "unknown_tenants",
                  "the profile " + quote(u->name) + " has a guarantee: unknown tenants cannot burst (their pool is "
                  "admitted at the profile's memory limit); name a profile without one");
    return true;
  }

  const std::string& file_;
  std::vector<TenantDraft> drafts_;
  yaml::Mark unknownTenantsMark_;
  std::string error_;
};

std::string deviceName(const DeviceInfo& d) {
  return d.name() + (d.uuid.empty() ? "" : " (" + d.uuid + (d.mig() ? ", MIG " + d.profile : "") + ")");
}

}  // namespace

std::string memoryName(const std::vector<DeviceInfo>& devices, size_t d) {
  std::string members;
  int n = 0;
  for (size_t x = 0; x < devices.size(); ++x)
    if (devices[x].group(x) == devices[d].group(d)) members += (n++ ? ", " : "") + devices[x].name();
  if (n <= 1) return "device " + deviceName(devices[d]);
  return "GPU instance " + std::to_string(devices[d].gpuInstance) + " of GPU " + std::to_string(devices[d].ordinal) +
         " (MIG devices " + members + ", sharing its memory)";
}

namespace {

std::string sizeText(uint64_t bytes) {
  return std::to_string(bytes) + " bytes (" + formatSize(bytes) + ")";
}

}  // namespace

uint64_t bytesOn(const MemoryAmount& a, uint64_t total) {
  if (!a.isPercent()) return a.bytes;
  return static_cast<uint64_t>(static_cast<unsigned __int128>(total) * a.milliPercent / 100000);
}

const char* mpsModeName(MpsConfig::Mode m) {
  return m == MpsConfig::Mode::kOn ? "on" : m == MpsConfig::Mode::kAuto ? "auto" : "off";
}

std::string formatPercent(uint32_t milliPercent) {
  std::string s = std::to_string(milliPercent / 1000);
  uint32_t frac = milliPercent % 1000;
  if (frac != 0) {
    std::string f = std::to_string(1000 + frac).substr(1);
    while (f.back() == '0') f.pop_back();
    s += "." + f;
  }
  return s + "%";
}

bool parseConfig(std::string_view text, const std::string& nameForErrors, Config* out,
                 std::string* error) {
  std::string err;
  if (text.size() > kMaxConfigBytes) {
    err = yaml::errorLine(nameForErrors, yaml::Mark{}, "",
                          "the file is " + std::to_string(text.size()) + " bytes, at most " +
                              std::to_string(kMaxConfigBytes) + " allowed");
  } else {
    Node root;
    if (yaml::parseDocument(text, nameForErrors, &root, &err)) {
      Config c;
      Parser p(nameForErrors);
      if (p.parse(root, &c)) {
        *out = std::move(c);
        return true;
      }
      err = p.error();
    }
  }
  if (error) *error = std::move(err);
  return false;
}

bool loadConfig(const std::string& path, Config* out, std::string* error) {
  auto failIo = [&](const std::string& why) {
    if (error) *error = yaml::errorLine(path, yaml::Mark{}, "", why);
    return false;
  };
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return failIo(std::string("cannot open: ") + std::strerror(errno));
  std::string text;
  char buf[65536];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) {
    text.append(buf, n);
    if (text.size() > kMaxConfigBytes) break;  // parseConfig reports the size
  }
  const bool readError = std::ferror(f) != 0;
  const int savedErrno = errno;
  std::fclose(f);
  if (readError) return failIo(std::string("cannot read: ") + std::strerror(savedErrno));
  return parseConfig(text, path, out, error);
}

namespace {

// resolveMemory, also telling which per-device entry (if any) set each device's limit.
bool resolveImpl(const Config& config, const MemorySpec& spec,
                 const std::vector<DeviceInfo>& devices, std::vector<uint64_t>* limits,
                 std::vector<const MemorySpec::Entry*>* entryOf, std::string* error) {
  std::vector<uint64_t> r(devices.size(), kUnlimited);
  std::vector<const MemorySpec::Entry*> namedBy(devices.size(), nullptr);
  if (spec.kind == MemorySpec::kAll) {
    for (size_t d = 0; d < devices.size(); ++d) r[d] = bytesOn(spec.all, devices[d].totalBytes);
  } else if (spec.kind == MemorySpec::kPerDevice) {
    for (const MemorySpec::Entry& e : spec.entries) {
      const std::string path = spec.path + "." + yaml::printable(e.key);
      size_t found = devices.size();
      for (size_t d = 0; d < devices.size(); ++d) {
        const bool match = e.uuid.empty()
                               ? devices[d].ordinal == e.ordinal && devices[d].migIndex == e.migIndex
                               : devices[d].uuid == e.uuid;
        if (match) found = d;
      }
      if (found == devices.size()) {
        std::string have;
        for (const DeviceInfo& d : devices) have += (have.empty() ? "" : ", ") + deviceName(d);
        // A GPU in MIG mode is named, by ordinal or UUID: its MIG devices are what can be limited.
        std::string migOf;
        for (const DeviceInfo& d : devices)
          if (d.mig() && (e.uuid.empty() ? e.migIndex < 0 && d.ordinal == e.ordinal : d.parentUuid == e.uuid))
            migOf += (migOf.empty() ? "" : ", ") + d.name();
        if (error)
          *error = yaml::errorLine(
              config.file, yamlMark(e.mark), path,
              !migOf.empty()
                  ? "GPU " + quote(e.key) + " is in MIG mode: CUDA runs only in its MIG devices (" + migOf +
                        "); name one of them as <gpu>:<mig> or MIG-<uuid>"
                  : "no device " + quote(e.key) + " on this host (" +
                        (have.empty() ? "it has no devices" : "devices: " + have) + ")");
        return false;
      }
      if (namedBy[found]) {
        if (error)
          *error = yaml::errorLine(config.file, yamlMark(e.mark), path,
                                   "device " + deviceName(devices[found]) + " is named twice, as " +
                                       quote(namedBy[found]->key) + " and as " + quote(e.key));
        return false;
      }
      namedBy[found] = &e;
      r[found] = bytesOn(e.amount, devices[found].totalBytes);
    }
  }
  *limits = std::move(r);
  *entryOf = std::move(namedBy);
  return true;
}

}  // namespace

bool resolveMemory(const Config& config, const MemorySpec& spec,
                   const std::vector<DeviceInfo>& devices, std::vector<uint64_t>* limits,
                   std::string* error) {
  std::vector<const MemorySpec::Entry*> entryOf;
  return resolveImpl(config, spec, devices, limits, &entryOf, error);
}

const char* burstModeName(BurstMode m) {
  return m == BurstMode::kManaged ? "managed" : m == BurstMode::kPlain ? "plain" : "off";
}

bool resolveGuarantee(const Config& config, const Tenant& t, const std::vector<DeviceInfo>& devices,
                      std::vector<uint64_t>* guarantees, std::string* error) {
  std::vector<const MemorySpec::Entry*> entryOf;
  std::vector<uint64_t> limits, g;
  if (!resolveImpl(config, t.memory, devices, &limits, &entryOf, error)) return false;
  if (t.burst == BurstMode::kOff || t.guarantee.kind == MemorySpec::kNone) {
    *guarantees = std::move(limits);
    return true;
  }
  if (!resolveImpl(config, t.guarantee, devices, &g, &entryOf, error)) return false;
  for (size_t d = 0; d < devices.size(); ++d) {
    if (g[d] == kUnlimited) {
      g[d] = limits[d];  // a per-device guarantee map leaves this device out: its limit is reserved
      continue;
    }
    if (limits[d] == kUnlimited || g[d] > limits[d]) {
      SourceMark at = entryOf[d] ? entryOf[d]->mark : t.guarantee.mark;
      if (error)
        *error = yaml::errorLine(config.file, yamlMark(at), t.guarantee.path,
                                 "tenant " + quote(t.name) + ": the guarantee on device " + deviceName(devices[d]) + ", " +
                                     sizeText(g[d]) + ", is above its memory limit there, " +
                                     (limits[d] == kUnlimited ? std::string("none") : sizeText(limits[d])) +
                                     ": a guarantee is the part of the limit reserved for it");
      return false;
    }
  }
  *guarantees = std::move(g);
  return true;
}

bool checkAgainstDevices(const Config& config, const std::vector<DeviceInfo>& devices,
                         std::string* error) {
  // Per memory group (a GPU, or a GPU instance whose compute instances share its memory).
  std::vector<unsigned __int128> sum(devices.size(), 0);
  std::vector<uint64_t> limits;
  std::vector<const MemorySpec::Entry*> entryOf;
  for (const Tenant& t : config.tenants) {
    // What is admitted is what the tenant is guaranteed: its limit, or its guarantee if it bursts.
    const bool bursts = t.burst != BurstMode::kOff;
    if (!resolveGuarantee(config, t, devices, &limits, error)) return false;
    std::vector<uint64_t> written;  // for entryOf: which map entry names each device
    if (!resolveImpl(config, bursts ? t.guarantee : t.memory, devices, &written, &entryOf, error)) return false;
    for (size_t d = 0; d < devices.size(); ++d) {
      if (limits[d] == kUnlimited) continue;
      const size_t g = std::min(devices[d].group(d), devices.size() - 1);
      sum[g] += limits[d];
      if (sum[g] <= devices[d].totalBytes) continue;
      // Name the tenant: at its own memory value (the device's entry of a per-device map), or at
      // the tenant itself when its memory comes from a profile.
      const MemorySpec& spec = bursts ? t.guarantee : t.memory;
      const bool own = spec.path.rfind(t.path + ".", 0) == 0;
      SourceMark at = own ? spec.mark : t.mark;
      std::string path = own ? spec.path : t.path;
      if (own && entryOf[d]) {
        at = entryOf[d]->mark;
        path += "." + yaml::printable(entryOf[d]->key);
      }
      const uint64_t total = sum[g] > UINT64_MAX ? UINT64_MAX : static_cast<uint64_t>(sum[g]);
      if (error)
        *error = yaml::errorLine(
            config.file, yamlMark(at), path,
            "tenant " + quote(t.name) + (own ? "" : std::string(bursts ? " (guarantee" : " (memory") + " from " + spec.path + ")") +
                (bursts ? " brings the memory reserved (limits, and guarantees of bursting tenants) on "
                        : " brings the memory limits on ") +
                memoryName(devices, d) + " to " + sizeText(total) + ", over the device's total of " + sizeText(devices[d].totalBytes) + "; this tenant's " +
                (bursts ? "guarantee" : "limit") + " there is " + sizeText(limits[d]));
      return false;
    }
  }
  // The unknown tenants' pool: at most max_unknown_tenants of them, each at the profile's limit.
  const Profile* unknown = nullptr;
  for (const Profile& p : config.profiles)
    if (p.name == config.unknownTenantsProfile) unknown = &p;
  if (unknown == nullptr || config.maxUnknownTenants == 0) return true;
  if (!resolveImpl(config, unknown->memory, devices, &limits, &entryOf, error)) return false;
  const bool own = unknown->memory.kind != MemorySpec::kNone;
  const SourceMark at = own ? unknown->memory.mark : unknown->mark;
  const std::string path = own ? unknown->memory.path : "profiles." + unknown->name;
  std::vector<unsigned __int128> pools(devices.size(), 0);
  for (size_t d = 0; d < devices.size(); ++d) {
    const std::string who = "the unknown_tenants profile " + quote(unknown->name);
    if (limits[d] == kUnlimited) {
      if (error)
        *error = yaml::errorLine(config.file, yamlMark(at), path,
                                 who + " has no memory limit on device " + deviceName(devices[d]) +
                                     ": unknown tenants could take the configured tenants' memory; give it one");
      return false;
    }
    const size_t g = std::min(devices[d].group(d), devices.size() - 1);
    pools[g] += static_cast<unsigned __int128>(limits[d]) * config.maxUnknownTenants;
    if (sum[g] + pools[g] <= devices[d].totalBytes) continue;
    const unsigned __int128 all = sum[g] + pools[g];
    if (error)
      *error = yaml::errorLine(
          config.file, yamlMark(at), path,
          who + ": its pool of max_unknown_tenants (" + std::to_string(config.maxUnknownTenants) + ") x " +
              sizeText(limits[d]) + " brings the memory limits on " + memoryName(devices, d) + " to " +
              sizeText(all > UINT64_MAX ? UINT64_MAX : static_cast<uint64_t>(all)) +
              ", over the device's total of " + sizeText(devices[d].totalBytes) +
              "; lower max_unknown_tenants or the profile's memory");
    return false;
  }
  return true;
}

}  // namespace cushare::broker
