// What the CLI prints; see output.h.
#include "output.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <vector>

#include "cushare/parse.h"
#include "top.h"

namespace cushare::cli {
namespace {

// Columns as wide as their widest cell, two spaces apart; the last column is not padded, so no
// line ends in blanks.
class Table {
 public:
  explicit Table(std::vector<std::string> header) { rows_.push_back(std::move(header)); }
  void add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }

  void print() const {
    std::vector<size_t> width(rows_.front().size(), 0);
    for (const auto& row : rows_)
      for (size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
    for (const auto& row : rows_) {
      std::string line;
      for (size_t c = 0; c < row.size(); ++c) {
        line += row[c];
        if (c + 1 < row.size()) line += std::string(width[c] - row[c].size() + 2, ' ');
      }
      std::printf("%s\n", line.c_str());
    }
  }

 private:
  std::vector<std::vector<std::string>> rows_;
};

void field(const char* name, const std::string& value) {
  std::printf("%-16s %s\n", name, value.c_str());
}

std::string limitCell(const rpc::TenantDevice& d) {
  if (!d.has_limit_bytes()) return "-";
  return formatSize(d.limit_bytes()) + (d.overridden() ? "*" : "");
}

// v through a printf format of one double ("%.2f").
std::string num(double v, const char* fmt) {
  char b[48];
  std::snprintf(b, sizeof b, fmt, v);
  return std::string(b);
}

// A probe window's share for people: "0.41 +-0.03", " ?" after it while too few rounds back it
// (*uncertain set then), "-" before a round with work.
std::string probeShareCell(const rpc::ProbeShare& p, bool* uncertain = nullptr) {
  if (p.rounds_with_work() == 0) return "-";
  std::string cell = num(p.compute_share(), "%.2f") + " +-" + num(p.compute_share_stderr(), "%.2f");
  if (!p.enough()) {
    cell += " ?";
    if (uncertain) *uncertain = true;
  }
  return cell;
}

// "1 reload", "2 reloads".
std::string count(uint64_t n, const std::string& what) {
  return std::to_string(n) + " " + what + (n == 1 ? "" : "s");
}

// A JSON string literal: quotes, backslashes and control characters escaped.

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;

std::string jsonNumber(double v) {
  // JSON has no NaN or infinity; proto3's JSON mapping writes them as these strings.
  if (std::isnan(v)) return "\"NaN\"";
  if (std::isinf(v)) return v > 0 ? "\"Infinity\"" : "\"-Infinity\"";
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);  // shortest exact form
  return std::string(buf, r.ptr);
}

void appendJson(const Message& m, std::string* out);

// Field f of m (element i of a repeated field, or -1 for a singular one) as a JSON value.
void appendValue(const Message& m, const FieldDescriptor* f, int i, std::string* out) {
  const auto* r = m.GetReflection();
  const bool rep = i >= 0;
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      *out += std::to_string(rep ? r->GetRepeatedInt32(m, f, i) : r->GetInt32(m, f));
      return;
    case FieldDescriptor::CPPTYPE_INT64:
      *out += std::to_string(rep ? r->GetRepeatedInt64(m, f, i) : r->GetInt64(m, f));
      return;
    case FieldDescriptor::CPPTYPE_UINT32:
      *out += std::to_string(rep ? r->GetRepeatedUInt32(m, f, i) : r->GetUInt32(m, f));
      return;
    case FieldDescriptor::CPPTYPE_UINT64:
      *out += std::to_string(rep ? r->GetRepeatedUInt64(m, f, i) : r->GetUInt64(m, f));
      return;
    case FieldDescriptor::CPPTYPE_DOUBLE:
      *out += jsonNumber(rep ? r->GetRepeatedDouble(m, f, i) : r->GetDouble(m, f));
      return;
    case FieldDescriptor::CPPTYPE_FLOAT:
      *out += jsonNumber(rep ? r->GetRepeatedFloat(m, f, i) : r->GetFloat(m, f));
      return;
    case FieldDescriptor::CPPTYPE_BOOL:
      *out += (rep ? r->GetRepeatedBool(m, f, i) : r->GetBool(m, f)) ? "true" : "false";
      return;
    case FieldDescriptor::CPPTYPE_ENUM:
      *out += jsonQuoted((rep ? r->GetRepeatedEnum(m, f, i) : r->GetEnum(m, f))->name());
      return;
    case FieldDescriptor::CPPTYPE_STRING:
      *out += jsonQuoted(rep ? r->GetRepeatedString(m, f, i) : r->GetString(m, f));
      return;
    case FieldDescriptor::CPPTYPE_MESSAGE:
      appendJson(rep ? r->GetRepeatedMessage(m, f, i) : r->GetMessage(m, f), out);
      return;
  }
}

// m as a JSON object: the field names of control.proto, every field but an absent optional one
// (an absent limit_bytes is "no limit"), zero values included, 64-bit integers as exact numbers.
void appendJson(const Message& m, std::string* out) {
  const auto* d = m.GetDescriptor();
  const auto* r = m.GetReflection();
  *out += '{';
  bool first = true;
  for (int k = 0; k < d->field_count(); ++k) {
    const FieldDescriptor* f = d->field(k);
    if (!f->is_repeated() && f->has_presence() && !r->HasField(m, f)) continue;
    *out += first ? "" : ",";
    first = false;
    *out += jsonQuoted(f->name()) + ":";
    if (!f->is_repeated()) {
      appendValue(m, f, -1, out);
      continue;
    }
    *out += '[';
    for (int i = 0; i < r->FieldSize(m, f); ++i) {
      if (i > 0) *out += ',';
      appendValue(m, f, i, out);
    }
    *out += ']';
  }
  *out += '}';
}

}  // namespace

std::string formatDuration(double seconds) {
  // Negative, NaN or absurd uptimes (a clock jump) read as 0s rather than as garbage.
  const uint64_t total = seconds > 0 && seconds < 1e15 ? static_cast<uint64_t>(seconds) : 0;
  const uint64_t parts[] = {total / 86400, total / 3600 % 24, total / 60 % 60, total % 60};
  const char* const units[] = {"d", "h", "m", "s"};
  // The largest unit present and the two after it: a day-long uptime's seconds are noise.
  size_t first = 0;
  while (first < 3 && parts[first] == 0) ++first;
  std::string out;
  for (size_t i = first; i < std::min<size_t>(first + 3, 4); ++i)
    out += (out.empty() ? "" : " ") + std::to_string(parts[i]) + units[i];
  return out;
}

// The MPS lines of `cushare status` (docs/mps.md).
void printMps(const rpc::Mps& m) {
  if (!m.active()) {
    field("mps", m.mode().empty() ? "off" : m.mode() == "auto" ? "off (auto: " + m.why() + ")" : m.mode());
    return;
  }
  field("mps", std::string(m.up() ? "up" : "DOWN") + ", daemon pid " + std::to_string(m.daemon_pid()) + ", " +
                   count(m.restarts(), "restart") + ", " + count(m.faults(), "fault") + " (mode " + m.mode() + ")");
  field("mps pipe dir", m.pipe_dir());
  field("mps log dir", m.log_dir());
  field("mps defaults", "active thread percentage " + std::to_string(m.default_thread_percentage()));
  for (const rpc::MpsServer& s : m.servers()) {
    std::string clients;
    for (int c : s.clients()) clients += " " + std::to_string(c);
    field("mps server", std::to_string(s.pid()) + " " + s.state() + ", clients:" + (clients.empty() ? " none" : clients) +
                            (s.state() == "FAULT" ? " (FAULT: its clients must exit before it serves again)" : ""));
  }
  if (!m.last_error().empty()) field("mps problem", m.last_error());
}

// A device as the broker names it: "0", or "0:1" for a MIG device (an older broker sends no name).
std::string deviceCell(const std::string& name, int number) { return name.empty() ? std::to_string(number) : name; }

void printOutside(const google::protobuf::RepeatedPtrField<rpc::Device>& devices) {
  for (const rpc::Device& d : devices)
    if (d.thrash_guard())
      std::printf("\ndevice %s: the tenants bursting into managed memory take turns on it (their bursts do not fit "
                  "together: the thrashing guard, docs/memory-elasticity.md), %llu turns so far\n",
                  deviceCell(d.name(), d.index()).c_str(), static_cast<unsigned long long>(d.thrash_turns()));
  for (const rpc::Device& d : devices) {
    if (d.outside_bytes() == 0) continue;
    std::string pids;
    for (int i = 0; i < d.outside_pids_size() && i < 8; ++i) pids += (i == 0 ? "" : " ") + std::to_string(d.outside_pids(i));
    if (d.outside_pids_size() > 8) pids += " ...";
    std::printf("\ndevice %s: %s held by %d process(es) outside cushare (pid %s): no tenant's limit counts it\n",
                deviceCell(d.name(), d.index()).c_str(), formatSize(d.outside_bytes()).c_str(), d.outside_pids_size(), pids.c_str());
  }
}

void printStatus(const rpc::StatusReply& s) {
  field("broker", "cushare " + s.version() + ", pid " + std::to_string(s.pid()) + ", up " +
                      formatDuration(s.uptime_seconds()));
  field("config", (s.config_file().empty() ? "(none)" : s.config_file()) + " (generation " +
                      std::to_string(s.config_generation()) + ", " +
                      count(s.reloads_refused(), "reload") + " refused)");
  field("ledger dir", s.ledger_dir());
  field("unknown tenants", s.unknown_tenants());
  field("metrics", s.metrics_address().empty() ? "off" : s.metrics_address());
  field("tenants", std::to_string(s.tenants()));
  field("processes", std::to_string(s.processes()) + " live, " +
                         std::to_string(s.reaped_processes()) + " reaped");
  printMps(s.mps());
  std::printf("\n");
  // USED: the tenants' (what their limits count); OUTSIDE: processes of no tenant; DEVICE-USED:
  // the device's own figure (every process, and what the driver keeps).
  Table t({"DEVICE", "UUID", "CAPACITY", "USED", "OUTSIDE", "DEVICE-USED"});
  for (const rpc::Device& d : s.devices())
    t.add({deviceCell(d.name(), d.index()), d.uuid(), formatSize(d.capacity_bytes()), formatSize(d.used_bytes()),
           d.has_device_used_bytes() ? formatSize(d.outside_bytes()) : "?",
           d.has_device_used_bytes() ? formatSize(d.device_used_bytes()) : "?"});
  t.print();
  // MIG devices: what each is (its capacity is its GPU instance's memory, shared by the compute
  // instances of that GPU instance).
  bool mig = false;
  for (const rpc::Device& d : s.devices()) {
    if (!d.mig()) continue;
    if (!mig) std::printf("\n");
    mig = true;
    std::printf("device %s: MIG %s, GPU instance %u, compute instance %u, of GPU %s\n", d.name().c_str(),
                d.mig_profile().c_str(), d.gpu_instance_id(), d.compute_instance_id(), d.gpu_uuid().c_str());
  }
  printOutside(s.devices());
}

// cushare probe: SHARE is the achieved share with its standard error ("0.31 +-0.02"; "?" before
// enough rounds), the indices "-" where the window could not measure them.
void printProbeTable(const rpc::ProbeTable& table) {
  if (table.rows().empty()) {
    std::printf("no probe windows yet (probes off, no tenant process on a device, or no round answered)\n");
    return;
  }
  Table t({"TENANT", "DEVICE", "REGIME", "SHARE", "ROUNDS", "WITH-WORK", "MISSING", "BANDWIDTH", "COMPUTE-IDX",
           "BW-IDX", "LATENCY-IDX", "WINDOW"});
  for (const rpc::ProbeRow& r : table.rows()) {
    const rpc::ProbeShare& p = r.probe();
    t.add({r.tenant(), deviceCell(r.device_name(), r.device()), p.regime().empty() ? "-" : p.regime(), probeShareCell(p),
           std::to_string(p.rounds()),
           std::to_string(p.rounds_with_work()), std::to_string(p.missing()),
           p.has_bandwidth_share() ? num(p.bandwidth_share(), "%.2f") : "-",
           p.has_compute_index() ? num(p.compute_index(), "%.2f") : "-",
           p.has_bandwidth_index() ? num(p.bandwidth_index(), "%.2f") : "-",
           p.has_latency_index_ns() ? num(p.latency_index_ns() / 1000.0, "%.0fus") : "-",
           p.complete() ? num(p.window_seconds(), "%.0fs") : "filling"});
  }
  t.print();
  // Concurrent (MPS) rows: the SM probe's factors the share is made of (docs/probe-analysis.md).
  for (const rpc::ProbeRow& r : table.rows())
    if (r.probe().has_spatial())
      std::printf("%s on device %s: spatial %.2f x temporal %.2f x intra-SM %.2f\n", r.tenant().c_str(),
                  deviceCell(r.device_name(), r.device()).c_str(),
                  r.probe().spatial(), r.probe().temporal(), r.probe().intra());
  for (const rpc::ProbeRow& r : table.rows()) {
    if (!r.probe().caveat().empty())
      std::printf("%s on device %s: %s\n", r.tenant().c_str(), deviceCell(r.device_name(), r.device()).c_str(),
                  r.probe().caveat().c_str());
    if (!r.probe().last_error().empty())
      std::printf("%s on device %s: %s\n", r.tenant().c_str(), deviceCell(r.device_name(), r.device()).c_str(),
                  r.probe().last_error().c_str());
  }
}

void printTenants(const google::protobuf::RepeatedPtrField<rpc::Tenant>& tenants) {
  Table t({"TENANT", "DEVICE", "USED", "LIMIT", "PEAK", "DENIED", "CAP", "PRIORITY", "BUSY", "THROTTLED", "SHARE", "PROCS",
           "SOURCE"});
  bool overridden = false, above = false;
  const auto seconds = [](uint64_t ns) {
    char b[32];
    std::snprintf(b, sizeof b, "%.3fs", static_cast<double>(ns) / 1e9);
    return std::string(b);
  };
  for (const rpc::Tenant& tn : tenants) {
    const std::string procs = std::to_string(tn.processes());
    std::string cap = tn.has_thread_percentage() ? std::to_string(tn.thread_percentage()) + "%" : "-";
    if (tn.threads_overridden()) cap += "*";
    const std::string priority = tn.priority() + (tn.priority_overridden() ? "*" : "");
    overridden = overridden || tn.threads_overridden() || tn.priority_overridden();
    // A tenant the broker cannot manage has no device rows; it still gets a line.
    // Fair share: "w2" for a weight other than 1; the share it got of what it was due, while it
    // contends ("0.49/0.50").
    if (tn.weight() > 1) cap += " w" + std::to_string(tn.weight());
    const auto share = [](const rpc::TenantDevice& d) {
      if (!d.contending() || d.fair_target() <= 0) return std::string("-");
      char b[32];
      std::snprintf(b, sizeof b, "%.2f/%.2f", d.fair_achieved(), d.fair_target());
      return std::string(b);
    };
    if (tn.devices().empty())
      t.add({tn.name(), "-", "-", "-", "-", "-", cap, priority, "-", "-", "-", procs, tn.source()});
    for (const rpc::TenantDevice& d : tn.devices()) {
      // '!': it holds more than its limit (one lowered below what it held): denied until it frees.
      const bool over = d.has_limit_bytes() && d.used_bytes() > d.limit_bytes();
      above = above || over;
      t.add({tn.name(), deviceCell(d.device_name(), d.device()), formatSize(d.used_bytes()) + (over ? "!" : ""), limitCell(d),
             formatSize(d.peak_bytes()), std::to_string(d.denied()), cap + (d.paced() ? " paced" : ""), priority,
             seconds(d.busy_ns()), seconds(d.throttled_ns()), share(d), procs, tn.source()});
      overridden = overridden || (d.overridden() && d.has_limit_bytes());
    }
  }
  t.print();
  bool bursting = false;
  for (const rpc::Tenant& tn : tenants)
    for (const rpc::TenantDevice& d : tn.devices()) {
      if (!d.has_guarantee_bytes()) continue;
      if (!bursting) std::printf("\nBursting (above the guarantee, up to the limit: managed memory the device may evict to host memory):\n");
      bursting = true;
      std::string more;
      if (d.burst_host_bytes()) more += " (about " + formatSize(d.burst_host_bytes()) + " of it on host memory)";
      if (d.reclaimed_bytes()) more += ", " + formatSize(d.reclaimed_bytes()) + " taken back so far";
      if (d.plain() && d.reclaim_seconds() > 0) {
        char b[64];
        std::snprintf(b, sizeof b, ", the last reclaim reached its target in %.0f ms", d.reclaim_seconds() * 1000);
        more += b;
      }
      std::printf("  %s on %s: %s, guarantee %s, %s above it%s\n", tn.name().c_str(),
                  deviceCell(d.device_name(), d.device()).c_str(), d.plain() ? "plain" : "managed",
                  formatSize(d.guarantee_bytes()).c_str(), formatSize(d.burst_bytes()).c_str(), more.c_str());
    }
  if (overridden) std::printf("\n* set live (cushare set-limit); undo with --reset\n");
  if (above)
    std::printf("%s! holds more than its limit (a limit lowered below what it held): its allocations there are "
                "denied until it frees below the limit; nothing it holds is taken\n",
                overridden ? "" : "\n");
  bool mps = false;
  for (const rpc::Tenant& tn : tenants) {
    if (!tn.mps()) continue;
    if (!mps) std::printf("\nMPS active thread percentage for new processes (running ones keep what they started with):\n");
    mps = true;
    const std::string now = tn.has_mps_thread_percentage() ? std::to_string(tn.mps_thread_percentage()) : "none";
    std::string running;
    for (const rpc::MpsRunning& r : tn.mps_running()) {
      const std::string cap = r.thread_percentage() == "none" ? "no cap" : r.thread_percentage() == "unknown"
                                  ? "unknown (started before this broker)" : r.thread_percentage() + "%";
      running += std::string(running.empty() ? "" : ", ") + std::to_string(r.processes()) + " at " + cap +
                 (r.thread_percentage() != now ? " (pending: the new cap applies when it restarts)" : "");
    }
    std::printf("  %s: %s%s\n", tn.name().c_str(), now == "none" ? "no cap" : (now + "%").c_str(),
                running.empty() ? "" : ("; running: " + running).c_str());
  }
  for (const rpc::Tenant& tn : tenants)
    if (!tn.error().empty()) std::printf("tenant %s: %s\n", tn.name().c_str(), tn.error().c_str());
}

// The pid a person can act on: the one the kernel names holding the slot, in the broker's pid
// namespace; what the slot itself records is the tenant's word and is shown as such.
std::string pidCell(const rpc::Process& p, bool* unverified) {
  const std::string claimed = std::to_string(p.pid());
  if (p.host_pid() == 0) {
    *unverified = true;
    return claimed + "?";
  }
  const std::string host = std::to_string(p.host_pid());
  if (!p.pid_verified()) return host + " (slot says " + claimed + ")";
  return p.host_pid() == p.pid() ? host : host + " (" + claimed + " in its namespace)";
}

void printProcesses(const rpc::ProcessesReply& p) {
  // A POD column (namespace/pod/container) once any process has one (docs/kubernetes.md).
  bool pods = false;
  for (const rpc::Process& proc : p.processes()) pods = pods || proc.has_pod();
  std::vector<std::string> head = {"TENANT", "PID", "DEVICE", "USED"};
  if (pods) head.push_back("POD");
  Table t(head);
  bool unverified = false;
  for (const rpc::Process& proc : p.processes()) {
    const std::string pid = pidCell(proc, &unverified);
    std::vector<std::string> extra;
    if (pods)
      extra.push_back(proc.has_pod() ? proc.pod().namespace_() + "/" + proc.pod().pod() + "/" + proc.pod().container()
                                     : "-");
    auto row = [&](std::vector<std::string> cells) {
      cells.insert(cells.end(), extra.begin(), extra.end());
      t.add(cells);
    };
    if (proc.usage().empty()) row({proc.tenant(), pid, "-", formatSize(0)});
    for (const rpc::ProcessUsage& u : proc.usage())
      row({proc.tenant(), pid, deviceCell(u.device_name(), u.device()), formatSize(u.used_bytes())});
  }
  t.print();
  if (unverified)
    std::printf(
        "\n? unverified: only what the process's ledger slot says (the kernel names no "
        "holder: an older shim, or a process the broker cannot see)\n");
}

void printJson(const google::protobuf::Message& m) {
  std::string json;
  appendJson(m, &json);
  std::printf("%s\n", json.c_str());
}

void printJsonError(const std::string& message) {
  std::printf("{\"error\": %s}\n", jsonQuoted(message).c_str());
}

void printJsonObject(const std::vector<std::pair<std::string, std::string>>& fields) {
  std::string json = "{";
  for (const auto& [key, value] : fields)
    json += (json.size() > 1 ? ", " : "") + jsonQuoted(key) + ": " + jsonQuoted(value);
  std::printf("%s}\n", json.c_str());
}

void printTopFrame(const rpc::TopFrame& f) {
  const std::time_t t = static_cast<std::time_t>(f.time());
  char when[16] = "?";
  std::tm tm{};
  if (localtime_r(&t, &tm)) std::strftime(when, sizeof when, "%H:%M:%S", &tm);
  std::printf("cushare top  %s  busy and waits over the last %.1f s\n", when, f.interval_seconds());
  const auto pct = [](double fraction) { return num(fraction * 100, "%.0f%%"); };
  bool uncertain = false;
  for (const rpc::TopDevice& d : f.devices()) {
    std::string memory = d.has_device_used_bytes() ? "device " + formatSize(d.device_used_bytes()) + " of "
                                                   : "device ? of ";
    memory += formatSize(d.capacity_bytes()) + ", tenants " + formatSize(d.used_bytes());
    if (d.outside_bytes() > 0) memory += ", outside cushare " + formatSize(d.outside_bytes());
    // Busy is the tenants' summed shares: above 100 % only when they run side by side (MPS).
    const std::string name = deviceCell(d.name(), d.index());
    std::printf("\n%s %s  %s  busy %s  memory: %s\n", name.find(':') == std::string::npos ? "GPU" : "MIG device",
                name.c_str(), d.uuid().c_str(), pct(d.busy()).c_str(), memory.c_str());
    if (d.tenants().empty()) {
      std::printf("  no tenant on this device\n");
      continue;
    }
    Table tbl({"  TENANT", "PRIORITY", "CAP", "PROCS", "USED", "LIMIT", "USE", "BUSY", "WAITED", "DENIED/S", "PROBE"});
    for (const rpc::TopTenant& tt : d.tenants()) {
      std::string use = "-";
      if (tt.has_limit_bytes() && tt.limit_bytes() > 0)
        use = pct(static_cast<double>(tt.used_bytes()) / static_cast<double>(tt.limit_bytes()));
      char denied[32];
      std::snprintf(denied, sizeof denied, tt.denied_per_second() == 0 ? "0" : "%.1f", tt.denied_per_second());
      const std::string probe = tt.has_probe() ? probeShareCell(tt.probe(), &uncertain) : "-";
      tbl.add({"  " + tt.tenant(), tt.priority(),
               tt.has_thread_percentage() ? std::to_string(tt.thread_percentage()) + "%" : "-",
               std::to_string(tt.processes()), formatSize(tt.used_bytes()),
               tt.has_limit_bytes() ? formatSize(tt.limit_bytes()) : "-", use, pct(tt.busy()),
               pct(tt.throttled()) + (tt.paced() ? " paced" : ""), denied, probe});
    }
    tbl.print();
  }
  if (uncertain) std::printf("\n? too few probe rounds yet for the share to be trusted (docs/probes.md)\n");
  for (const std::string& e : f.errors()) std::printf("%s\n", e.c_str());
}

}  // namespace cushare::cli
