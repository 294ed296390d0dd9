// The verbs of the `cushare` CLI; see commands.h.
#include "commands.h"


#include <algorithm>
#include <cctype>
#include <cstddef>
#include <functional>

#include "config/config.h"
#include "cushare/parse.h"
#include "mig/mig_layout.h"
#include "cushare/shim_config.h"
#include <poll.h>
#include <signal.h>
#include <termios.h>
#include <unistd.h>

#include <chrono>
#include <cmath>

#include "environment.h"
#include "output.h"
#include "rpc/codec.h"
#include "top.h"

namespace cushare::cli {
namespace {

// A verb's arguments: options by name ("--memory" -> "8GiB"; flags map to ""), positional
// arguments, and for `run` the command.
struct Args {
  std::vector<std::pair<std::string, std::string>> options;
  std::vector<std::string> positional;
  std::vector<std::string> command;
  bool help = false;  // --help before the command: print the verb's usage, nothing else
  bool json = false;  // --json among the verb's options (as good as before the verb)

  const std::string* find(const std::string& name) const {
    for (const auto& [key, value] : options)
      if (key == name) return &value;
    return nullptr;
  }
  std::string get(const std::string& name) const {
    const std::string* v = find(name);
    return v ? *v : "";
  }
};

struct Verb {
  const char* name;
  const char* usage;    // after "cushare "
  const char* summary;  // for --help
  std::vector<std::string> valueOptions;
  std::vector<std::string> flagOptions;
  std::vector<std::string> requiredOptions;
  size_t minPositional = 0;
  size_t maxPositional = 0;
  bool takesCommand = false;  // everything after "--" or the first positional is the command
  int (*handler)(const Globals&, const Verb&, const Args&) = nullptr;
};

bool contains(const std::vector<std::string>& list, const std::string& s) {
  return std::find(list.begin(), list.end(), s) != list.end();
}

bool fail(std::string* err, std::string why) {
  *err = std::move(why);
  return false;
}

// Takes the option at in[*i] ("--name", "--name=value" or "--name value").
bool parseOption(const Verb& v, const std::vector<std::string>& in, size_t* i, Args* out,
                 std::string* err) {
  const std::string& arg = in[*i];
  const size_t eq = arg.find('=');
  const std::string name = arg.substr(0, eq);
  if (arg == "--json") {  // the global flag, also accepted after the verb
    out->json = true;
    return true;
  }
  if (out->find(name)) return fail(err, name + " is given twice");
  if (contains(v.flagOptions, name)) {
    if (eq != std::string::npos) return fail(err, name + " takes no value");
    out->options.emplace_back(name, "");
    return true;
  }
  if (!contains(v.valueOptions, name)) {
    const bool global = name == "--socket" || name == "--broker-user";
    return fail(err, "unknown option '" + printable(name, 40) + "'" +
                         (global ? " here: global options go before the verb" : ""));
  }
  std::string value;
  if (eq != std::string::npos) {
    value = arg.substr(eq + 1);
  } else if (*i + 1 < in.size()) {
    value = in[++*i];
  }
  if (value.empty()) return fail(err, name + " needs a value");
  out->options.emplace_back(name, value);
  return true;
}

bool parseArgs(const Verb& v, const std::vector<std::string>& in, Args* out, std::string* err) {
  for (size_t i = 0; i < in.size(); ++i) {
    const std::string& arg = in[i];
    const bool isOption = arg.size() > 1 && arg[0] == '-';
    if (v.takesCommand && (arg == "--" || !isOption)) {
      out->command.assign(in.begin() + static_cast<std::ptrdiff_t>(i + (arg == "--")), in.end());
      break;
    }
    if (arg == "--") {  // the rest is positional, even a tenant name that starts with '-'
      out->positional.insert(out->positional.end(), in.begin() + static_cast<std::ptrdiff_t>(i + 1),
                             in.end());
      break;
    }
    if (arg == "--help" || arg == "-h") {
      out->help = true;
      return true;
    }
    if (!isOption) {
      out->positional.push_back(arg);
    } else if (!parseOption(v, in, &i, out, err)) {
      return false;
    }
  }
  if (out->positional.size() > v.maxPositional)
    return fail(err,
                "unexpected argument '" + printable(out->positional[v.maxPositional], 40) + "'");
  if (out->positional.size() < v.minPositional) return fail(err, "missing arguments");
  for (const std::string& name : v.requiredOptions)
    if (!out->find(name)) return fail(err, name + " is required");
  if (v.takesCommand && out->command.empty()) return fail(err, "missing the command to run");
  return true;
}

int usageError(const Globals& g, const Verb& v, const std::string& why) {
  return report(g, kExitUsage,
                v.name + std::string(": ") + why + " (usage: cushare " + v.usage + ")");
}

rpc::Request newRequest() {
  rpc::Request req;
  req.set_version(rpc::kProtocolVersion);
  return req;
}

// Checks req as the broker will (so a typo fails without a round trip), sends it and checks the
// reply. Returns 0 with *resp an ok response carrying the expected body, or the exit code after
// reporting why not.
int exchange(const Globals& g, const rpc::Request& req, rpc::Response::BodyCase expected,
             rpc::Response* resp) {
  std::string err;
  if (!rpc::validateRequest(req, &err)) return report(g, kExitUsage, err);
  rpc::CallOptions options;
  options.busyRetryMs = kBusyRetryMs;
  options.trustedUids = g.brokerUids;
  if (!rpc::call(g.socket, req, resp, &err, options)) return report(g, kExitFailed, err);
  if (!resp->ok())
    return report(g, kExitFailed,
                  resp->error().empty() ? "the broker refused the request" : resp->error());
  if (resp->body_case() != expected)
    return report(g, kExitFailed,
                  "the broker's reply lacks the expected body (a broker of "
                  "another version?)");
  return 0;
}

// The reply as JSON with --json, else through printHuman.
int show(const Globals& g, const google::protobuf::Message& reply,
         const std::function<void()>& printHuman) {
  if (g.json) {
    printJson(reply);
  } else {
    printHuman();
  }
  return 0;
}

int statusVerb(const Globals& g, const Verb&, const Args&) {
  rpc::Request req = newRequest();
  req.mutable_status();
  rpc::Response resp;
  if (const int rc = exchange(g, req, rpc::Response::kStatus, &resp)) return rc;
  return show(g, resp.status(), [&] { printStatus(resp.status()); });
}

int tenantsVerb(const Globals& g, const Verb&, const Args& a) {
  rpc::Request req = newRequest();
  req.mutable_tenants()->set_tenant(a.positional.empty() ? "" : a.positional[0]);
  rpc::Response resp;
  if (const int rc = exchange(g, req, rpc::Response::kTenants, &resp)) return rc;
  return show(g, resp.tenants(), [&] {
    printTenants(resp.tenants().tenants());
    printOutside(resp.tenants().devices());
  });
}

// "0, 1, ..., n-1".
std::string contiguous(int n) {
  std::string s;
  for (int i = 0; i < n; ++i) s += (i ? ", " : "") + std::to_string(i);
  return s;
}

// --device TEXT: the broker's device number of the device TEXT names: its name as the broker
// lists it ("0", or "0:1" for a MIG device) or its UUID (GPU-... or MIG-..., any case). 0 with
// *number set, or the exit status after reporting why not (a device the host does not have is an
// error, not an empty answer).
int deviceNumber(const Globals& g, const std::string& verb, const std::string& text, int64_t* number) {
  // A number in any form parseInt takes ("00", "+1") names the whole GPU of that index.
  int64_t n = -1;
  const bool numeric = parseInt(text, 0, INT32_MAX, &n, nullptr);
  const std::string name = numeric ? std::to_string(n) : text;
  rpc::Request st = newRequest();
  st.mutable_status();
  rpc::Response sr;
  if (const int rc = exchange(g, st, rpc::Response::kStatus, &sr)) return rc;
  std::string lower = text, names, migOf;
  int count = 0;
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (const rpc::Device& d : sr.status().devices()) {
    const std::string dn = d.name().empty() ? std::to_string(d.index()) : d.name();
    std::string uuid = d.uuid();
    for (char& c : uuid) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (dn == name || uuid == lower) {
      *number = d.index();
      return 0;
    }
    names += (count++ ? ", " : "") + dn;
    if (d.mig() && (dn.rfind(name + ":", 0) == 0 || sameDeviceUuid(d.gpu_uuid(), text)))
      migOf += (migOf.empty() ? "" : ", ") + dn;
  }
  if (!migOf.empty())
    return report(g, kExitFailed, verb + ": GPU " + printable(text, 64) + " is in MIG mode; name one of its MIG devices (" +
                                      migOf + ") or its MIG-<uuid>");
  return report(g, kExitFailed, verb + ": device " + printable(text, 64) + " does not exist (this host has " +
                                    (count == 0 ? std::string("no devices)")
                                                : std::to_string(count) + (count == 1 ? " device: " : " devices: ") +
                                                      (count > 1 && names == contiguous(count)
                                                           ? "0.." + std::to_string(count - 1)
                                                           : names) +
                                                      ")"));
}

// cushare probe [--device N]: each tenant's share of each device as its probes measured it.
int probeVerb(const Globals& g, const Verb&, const Args& a) {
  int64_t device = -1;
  if (a.find("--device"))
    if (const int rc = deviceNumber(g, "probe", a.get("--device"), &device)) return rc;
  rpc::Request req = newRequest();
  req.mutable_tenants()->set_tenant("");
  rpc::Response resp;
  if (const int rc = exchange(g, req, rpc::Response::kTenants, &resp)) return rc;
  rpc::ProbeTable table;
  for (const rpc::Tenant& t : resp.tenants().tenants())
    for (const rpc::TenantDevice& d : t.devices()) {
      if (!d.has_probe() || (device >= 0 && d.device() != device)) continue;
      rpc::ProbeRow* row = table.add_rows();
      row->set_tenant(t.name());
      row->set_device(d.device());
      row->set_device_name(d.device_name());
      row->set_uuid(d.uuid());
      *row->mutable_probe() = d.probe();
    }
  return show(g, table, [&] { printProbeTable(table); });
}

// cushare top: a frame every --interval seconds (rates over that interval) until Ctrl-C, `q` on the
// terminal or --count frames; --once is --count 1. On a terminal each frame replaces the last.
volatile sig_atomic_t gTopStop = 0;
void topStop(int) { gTopStop = 1; }

// The terminal's mode while top reads single keys; restored by the destructor.
class KeyReader {
 public:
  KeyReader() {
    if (!isatty(STDIN_FILENO) || tcgetattr(STDIN_FILENO, &saved_) != 0) return;
    termios raw = saved_;
    raw.c_lflag &= ~static_cast<tcflag_t>(ICANON | ECHO);
    raw.c_cc[VMIN] = 0;
    raw.c_cc[VTIME] = 0;
    on_ = tcsetattr(STDIN_FILENO, TCSANOW, &raw) == 0;
  }
  ~KeyReader() {
    if (on_) tcsetattr(STDIN_FILENO, TCSANOW, &saved_);
  }
  KeyReader(const KeyReader&) = delete;
  KeyReader& operator=(const KeyReader&) = delete;
  // Waits `seconds`; false if the user asked to stop meanwhile (a signal, or q).
  bool wait(double seconds) const {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (!gTopStop) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return true;
      pollfd p{STDIN_FILENO, POLLIN, 0};
      const int n = poll(on_ ? &p : nullptr, on_ ? 1 : 0, static_cast<int>(std::min<int64_t>(left.count(), 250)));
      char c = 0;
      if (n > 0 && read(STDIN_FILENO, &c, 1) == 1 && (c == 'q' || c == 'Q')) return false;
    }
    return false;
  }

 private:
  termios saved_{};
  bool on_ = false;
};

int topVerb(const Globals& g, const Verb& v, const Args& a) {
  double interval = 1;
  if (a.find("--interval")) {
    const std::string text = a.get("--interval");
    char* end = nullptr;
    interval = std::strtod(text.c_str(), &end);
    if (end == text.c_str() || *end != 0 || !std::isfinite(interval) || interval < 0.1 || interval > 3600)
      return usageError(g, v, "--interval: '" + printable(text, 40) + "' is not a number of seconds from 0.1 to 3600");
  }
  int64_t count = 0;  // 0: until stopped
  std::string err;
  if (a.find("--count") && !parseInt(a.get("--count"), 1, INT32_MAX, &count, &err))
    return usageError(g, v, "--count: " + printable(err, 120));
  if (a.find("--once")) {
    if (a.find("--count")) return usageError(g, v, "--once is --count 1: give one of them");
    count = 1;
  }
  const auto fetch = [&](rpc::TenantsReply* out) {
    rpc::Request req = newRequest();
    req.mutable_tenants()->set_tenant("");
    rpc::Response resp;
    if (const int rc = exchange(g, req, rpc::Response::kTenants, &resp)) return rc;
    *out = resp.tenants();
    return 0;
  };
  // Every way out runs the key reader's destructor, which gives the terminal its mode back: the
  // signals that end a program at a terminal (a closed pipe, `| head`, included) stop the loop.
  struct sigaction sa{};
  sa.sa_handler = topStop;  // no SA_RESTART: the wait returns at once
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGQUIT, SIGHUP, SIGPIPE}) sigaction(sig, &sa, nullptr);
  const bool redraw = !g.json && count != 1 && isatty(STDOUT_FILENO);
  const KeyReader keys;
  rpc::TenantsReply before, after;
  if (const int rc = fetch(&before)) return rc;
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t frame = 0; count == 0 || frame < count; ++frame) {
    if (!keys.wait(interval)) break;
    if (const int rc = fetch(&after)) return rc;
    const auto t1 = std::chrono::steady_clock::now();
    const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    const rpc::TopFrame f = topFrame(before, after, std::chrono::duration<double>(t1 - t0).count(), now);
    if (g.json) {
      printJson(f);
    } else {
      if (redraw) std::printf("\033[H\033[2J");
      else if (frame > 0) std::printf("\n");
      printTopFrame(f);
      if (redraw) std::printf("\n(q or Ctrl-C to quit)\n");
    }
    if (std::fflush(stdout) != 0 || std::ferror(stdout) || gTopStop) break;  // nobody reads any more
    before = std::move(after);
    after.Clear();
    t0 = t1;
  }
  return 0;
}

int processesVerb(const Globals& g, const Verb&, const Args& a) {
  rpc::Request req = newRequest();
  req.mutable_processes()->set_tenant(a.get("--tenant"));
  rpc::Response resp;
  if (const int rc = exchange(g, req, rpc::Response::kProcesses, &resp)) return rc;
  return show(g, resp.processes(), [&] { printProcesses(resp.processes()); });
}

int setLimitVerb(const Globals& g, const Verb& v, const Args& a) {
  const bool change = a.find("--memory") || a.find("--threads") || a.find("--priority");
  if (change == (a.find("--reset") != nullptr))
    return usageError(g, v, "give --memory, --threads or --priority, or --reset alone");
  int64_t device = -1;  // every device; the protocol's default of 0 would mean the first one
  std::string err;
  const bool allDevices = !a.find("--device") || parseInt(a.get("--device"), -1, -1, &device, nullptr);
  if (!allDevices && !a.find("--memory") && !a.find("--reset"))
    return usageError(g, v, "--device goes with --memory or --reset: threads and priority are per tenant");
  int64_t threads = 0;
  if (a.find("--threads") && !parseInt(a.get("--threads"), 1, 100, &threads, &err))
    return usageError(g, v, "--threads: " + printable(err, 120) + " (a percentage of the device's SMs, 1..100)");
  Priority priority;
  if (a.find("--priority") && !parsePriority(a.get("--priority"), &priority, &err))
    return usageError(g, v, "--priority: " + printable(err, 120));
  if (!allDevices)
    if (const int rc = deviceNumber(g, "set-limit", a.get("--device"), &device)) return rc;
  rpc::Request req = newRequest();
  rpc::SetLimitRequest* s = req.mutable_set_limit();
  s->set_tenant(a.positional[0]);
  s->set_memory(a.get("--memory"));
  s->set_reset(a.find("--reset") != nullptr);
  if (a.find("--threads")) s->set_threads(static_cast<int32_t>(threads));
  s->set_priority(a.get("--priority"));
  s->set_device(static_cast<int32_t>(device));
  rpc::Response resp;
  if (const int rc = exchange(g, req, rpc::Response::kSetLimit, &resp)) return rc;
  return show(g, resp.set_limit(), [&] {
    google::protobuf::RepeatedPtrField<rpc::Tenant> one;
    *one.Add() = resp.set_limit().tenant();
    printTenants(one);
    // A limit below what the tenant holds is accepted (limits are live), and said so plainly.
    for (const rpc::TenantDevice& d : resp.set_limit().tenant().devices())
      if (d.has_limit_bytes() && d.used_bytes() > d.limit_bytes())
        std::printf("\nnote: %s holds %s on device %s, above its new limit of %s: its allocations there are denied "
                    "until it frees below it; nothing it holds is taken\n",
                    resp.set_limit().tenant().name().c_str(), formatSize(d.used_bytes()).c_str(),
                    (d.device_name().empty() ? std::to_string(d.device()) : d.device_name()).c_str(),
                    formatSize(d.limit_bytes()).c_str());
  });
}

// Where operations.md installs the broker's configuration.
constexpr const char* kDefaultBrokerConfig = "/etc/cushare/broker.yaml";

// A JSON string.
std::string jsonString(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') out += std::string("\\") + c;
    else if (static_cast<unsigned char>(c) < 0x20) {
      char b[8];
      std::snprintf(b, sizeof b, "\\u%04x", c);
      out += b;
    } else out += c;
  }
  return out + "\"";
}

std::string jsonList(const std::vector<std::string>& v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) out += (i ? "," : "") + jsonString(v[i]);
  return out + "]";
}

// cushare mig assert|apply [--config FILE] [--dry-run]: the broker configuration's mig: layout
// (docs/mig.md, "Declarative layout"), through NVML on this host, not through the broker. assert:
// 0 when every GPU the layout names has it, 1 with the differences. apply: 0 when the GPUs have
// it, 1 when it was refused (processes on an affected GPU, tenants' keys it would break, a layout
// that does not fit) or waits for a GPU reset; nothing is changed unless every affected GPU can be.
int migVerb(const Globals& g, const Verb& v, const Args& a) {
  const std::string action = a.positional[0];
  if (action != "assert" && action != "apply") return usageError(g, v, "expected assert or apply, found '" + printable(action, 20) + "'");
  if (a.find("--dry-run") && action != "apply") return usageError(g, v, "--dry-run goes with apply");
  const std::string path = a.find("--config") ? a.get("--config") : std::string(kDefaultBrokerConfig);
  broker::Config c;
  std::string err;
  if (!broker::loadConfig(path, &c, &err)) return report(g, kExitFailed, err);
  if (!c.mig.set) return report(g, kExitFailed, path + ": no MIG layout (a mig: block with layout or config_file; docs/mig.md, \"Declarative layout\")");
  std::vector<broker::MigLayoutEntry> layout;
  if (!broker::migLayoutOf(c.mig, &layout, &err)) return report(g, kExitFailed, err);
  broker::mig::Host host;
  if (action == "assert") {
    std::vector<std::string> diffs;
    if (!broker::mig::assertLayout(host, layout, &diffs, &err)) return report(g, kExitFailed, err);
    if (g.json) std::printf("{\"matches\":%s,\"differences\":%s}\n", diffs.empty() ? "true" : "false", jsonList(diffs).c_str());
    else if (diffs.empty()) std::printf("the MIG layout is applied\n");
    else for (const std::string& d : diffs) std::printf("%s\n", d.c_str());
    return diffs.empty() ? 0 : kExitFailed;
  }
  broker::mig::Report r;
  const bool dry = a.find("--dry-run") != nullptr;
  broker::mig::ApplyLock lock;  // a dry run changes nothing: it takes no lock
  if (!dry && !lock.acquire(broker::mig::applyLockPath(c), 0, &err)) return report(g, kExitFailed, "mig apply: " + err);
  // What was done before a failure is said too (a GPU may be half-way).
  if (!broker::mig::applyLayout(host, c, layout, dry, &r, &err)) r.problems.push_back("stopped: " + err);
  if (g.json) {
    std::printf("{\"dry_run\":%s,\"steps\":%s,\"problems\":%s,\"pending_reset\":%s}\n", dry ? "true" : "false",
                jsonList(r.steps).c_str(), jsonList(r.problems).c_str(), r.pendingReset ? "true" : "false");
  } else {
    for (const std::string& s : r.steps) std::printf("%s\n", s.c_str());
    for (const std::string& p : r.problems) std::fprintf(stderr, "cushare: mig apply: %s\n", p.c_str());
    if (r.problems.empty() && !dry)
      std::printf("applied; restart cushare-broker so that it lists the new MIG devices (docs/mig.md)\n");
  }
  return r.problems.empty() ? 0 : kExitFailed;
}

int reloadVerb(const Globals& g, const Verb&, const Args&) {
  rpc::Request req = newRequest();
  req.mutable_reload();
  rpc::Response resp;
  if (const int rc = exchange(g, req, rpc::Response::kReload, &resp)) return rc;
  return show(g, resp.reload(), [&] {
    std::printf("configuration reloaded (generation %llu)\n",
                static_cast<unsigned long long>(resp.reload().config_generation()));
  });
}

// The environment of env and run: checks first (a typo or a missing shim fails before the broker
// is asked), then the broker's settings for the tenant. Returns 0 or the exit code after a report.
// run: the shim must exist here, and the command runs on this host, in the broker's own ledger
// directory, so the limit is not carried in the environment (it would cap live raises).
int tenantVars(const Globals& g, const Verb& v, const Args& a, bool run, EnvVars* out) {
  const bool shimMustExist = run;
  const std::string memory = a.get("--memory");
  std::string err, shim;
  if (!memory.empty() && !checkMemoryLimit(memory, &err)) return usageError(g, v, err);
  if (!findShim(a.get("--shim"), shimMustExist, &shim, &err)) return report(g, kExitFailed, err);
  rpc::Request req = newRequest();
  req.mutable_env()->set_tenant(a.get("--tenant"));
  rpc::Response resp;
  if (const int rc = exchange(g, req, rpc::Response::kEnv, &resp)) return rc;
  if (!tenantEnvironment(resp.env(), memory, shim, !run, out, &err)) return report(g, kExitFailed, err);
  // --memory only lowers the broker's limit (the shim takes the lower of the two): above it on a
  // device, the broker's holds there, and the user hears so rather than finding out at an
  // out-of-memory error.
  MemoryLimitSpec spec;
  if (!memory.empty() && parseMemoryLimit(memory, &spec, &err) && spec.kind == MemoryLimitSpec::kAll)
    for (const rpc::TenantDevice& d : resp.env().devices())
      if (d.has_limit_bytes() && d.limit_bytes() < spec.all)
        std::fprintf(stderr,
                     "cushare: note: --memory %s is above tenant %s's limit of %s on device %d; the broker's limit "
                     "holds there (raise it with cushare set-limit)\n",
                     printable(memory, 40).c_str(), printable(resp.env().tenant(), 64).c_str(),
                     formatSize(d.limit_bytes()).c_str(), d.device());
  return 0;
}

int envVerb(const Globals& g, const Verb& v, const Args& a) {
  EnvVars vars;
  if (const int rc = tenantVars(g, v, a, false, &vars)) return rc;
  if (g.json) {
    printJsonObject(vars);
    return 0;
  }
  for (const auto& [key, value] : vars) std::printf("%s=%s\n", key.c_str(), value.c_str());
  return 0;
}

int runCommandVerb(const Globals& g, const Verb& v, const Args& a) {
  EnvVars vars;
  if (const int rc = tenantVars(g, v, a, true, &vars)) return rc;
  std::fflush(stdout);  // exec discards what stdio still holds
  std::string err;
  const int rc = execWith(vars, a.command, &err);
  return report(g, rc, err);
}

const std::vector<Verb>& verbs() {
  static const std::vector<Verb> kVerbs = {
      {"status",
       "status",
       "the broker, its configuration and its devices",
       {},
       {},
       {},
       0,
       0,
       false,
       statusVerb},
      {"tenants",
       "tenants [NAME]",
       "memory use and limits per tenant and device",
       {},
       {},
       {},
       0,
       1,
       false,
       tenantsVerb},
      {"probe",
       "probe [--device N|N:M|UUID]",
       "each tenant's share of each device, as its probe kernels measured it",
       {"--device"},
       {},
       {},
       0,
       0,
       false,
       probeVerb},
      {"top",
       "top [--interval SECONDS] [--count N | --once]",
       "a live view of each device and its tenants (memory, share of the device's time, waits, refusals, "
       "probe share); q quits",
       {"--interval", "--count"},
       {"--once"},
       {},
       0,
       0,
       false,
       topVerb},
      {"processes",
       "processes [--tenant NAME]",
       "live tenant processes and their memory",
       {"--tenant"},
       {},
       {},
       0,
       0,
       false,
       processesVerb},
      {"set-limit",
       "set-limit TENANT ([--memory SIZE|PCT%] [--threads PCT] [--priority high|normal|low] | --reset) [--device N|N:M|UUID]",
       "change a tenant's memory limit, compute cap or priority live (admin)",
       {"--memory", "--device", "--threads", "--priority"},
       {"--reset"},
       {},
       1,
       1,
       false,
       setLimitVerb},
      {"reload",
       "reload",
       "re-read the broker's configuration file (admin)",
       {},
       {},
       {},
       0,
       0,
       false,
       reloadVerb},
      {"env",
       "env --tenant NAME [--memory SIZE] [--shim PATH]",
       "print a tenant's environment as KEY=VALUE lines (docker run --env-file)",
       {"--tenant", "--memory", "--shim"},
       {},
       {"--tenant"},
       0,
       0,
       false,
       envVerb},
      {"mig",
       "mig assert|apply [--config FILE] [--dry-run]",
       "check or bring this host's GPUs to the MIG layout of the broker's configuration (root; through NVML)",
       {"--config"},
       {"--dry-run"},
       {},
       1,
       1,
       false,
       migVerb},
      {"run",
       "run --tenant NAME [--memory SIZE] [--shim PATH] -- COMMAND [ARGS...]",
       "run a command as a tenant, with the shim preloaded",
       {"--tenant", "--memory", "--shim"},
       {},
       {"--tenant"},
       0,
       0,
       true,
       runCommandVerb},
  };
  return kVerbs;
}

const Verb* findVerb(const std::string& name) {
  for (const Verb& v : verbs())
    if (name == v.name) return &v;
  return nullptr;
}

}  // namespace

int report(const Globals& g, int exitCode, const std::string& message) {
  if (g.json) {
    printJsonError(message);
  } else {
    std::fprintf(stderr, "cushare: %s\n", message.c_str());
  }
  return exitCode;
}

int runVerb(const Globals& g, const std::string& verb, const std::vector<std::string>& args) {
  const Verb* v = findVerb(verb);
  if (!v) {
    std::vector<std::string> names;
    for (const Verb& known : verbs()) names.emplace_back(known.name);
    return report(g, kExitUsage,
                  "unknown verb '" + printable(verb, 40) + "' (see 'cushare --help')" + didYouMean(verb, names));
  }
  Args parsed;
  std::string err;
  Globals local = g;
  const bool ok = parseArgs(*v, args, &parsed, &err);
  local.json = local.json || parsed.json;
  if (!ok) return usageError(local, *v, err);
  if (parsed.help) {
    std::printf("usage: cushare %s\n  %s\n", v->usage, v->summary);
    return 0;
  }
  return v->handler(local, *v, parsed);
}

void printVerbs(FILE* out) {
  for (const Verb& v : verbs()) std::fprintf(out, "  %s\n      %s\n", v.usage, v.summary);
}

}  // namespace cushare::cli
