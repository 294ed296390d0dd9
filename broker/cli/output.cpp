// What the CLI prints; see output.h.
#include "output.h"

#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "cushare/parse.h"

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

// "1 reload", "2 reloads".
std::string count(uint64_t n, const std::string& what) {
  return std::to_string(n) + " " + what + (n == 1 ? "" : "s");
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
  std::printf("\n");
  Table t({"DEVICE", "UUID", "CAPACITY", "USED"});
  for (const rpc::Device& d : s.devices())
    t.add({std::to_string(d.index()), d.uuid(), formatSize(d.capacity_bytes()),
           formatSize(d.used_bytes())});
  t.print();
}

void printTenants(const google::protobuf::RepeatedPtrField<rpc::Tenant>& tenants) {
  Table t({"TENANT", "DEVICE", "USED", "LIMIT", "PEAK", "DENIED", "PROCS", "SOURCE"});
  bool overridden = false;
  for (const rpc::Tenant& tn : tenants) {
    const std::string procs = std::to_string(tn.processes());
    // A tenant the broker cannot manage has no device rows; it still gets a line.
    if (tn.devices().empty()) t.add({tn.name(), "-", "-", "-", "-", "-", procs, tn.source()});
    for (const rpc::TenantDevice& d : tn.devices()) {
      t.add({tn.name(), std::to_string(d.device()), formatSize(d.used_bytes()), limitCell(d),
             formatSize(d.peak_bytes()), std::to_string(d.denied()), procs, tn.source()});
      overridden = overridden || (d.overridden() && d.has_limit_bytes());
    }
  }
  t.print();
  if (overridden) std::printf("\n* set live (cushare set-limit); undo with --reset\n");
  for (const rpc::Tenant& tn : tenants)
    if (!tn.error().empty()) std::printf("tenant %s: %s\n", tn.name().c_str(), tn.error().c_str());
}

void printProcesses(const rpc::ProcessesReply& p) {
  Table t({"TENANT", "PID", "DEVICE", "USED"});
  for (const rpc::Process& proc : p.processes()) {
    const std::string pid = std::to_string(proc.pid());
    if (proc.usage().empty()) t.add({proc.tenant(), pid, "-", formatSize(0)});
    for (const rpc::ProcessUsage& u : proc.usage())
      t.add({proc.tenant(), pid, std::to_string(u.device()), formatSize(u.used_bytes())});
  }
  t.print();
}

bool printJson(const google::protobuf::Message& m, std::string* err) {
  google::protobuf::util::JsonPrintOptions options;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;  // the names of control.proto and the docs
  std::string json;
  const auto status = google::protobuf::util::MessageToJsonString(m, &json, options);
  if (!status.ok()) {
    *err = "cannot print the reply as JSON: " + status.ToString();
    return false;
  }
  std::printf("%s\n", json.c_str());
  return true;
}

// A JSON string literal: quotes, backslashes and control characters escaped.
std::string jsonString(const std::string& text) {
  std::string json = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      json += '\\';
      json += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      json += buf;
    } else {
      json += c;
    }
  }
  return json + "\"";
}

void printJsonError(const std::string& message) {
  std::printf("{\"error\": %s}\n", jsonString(message).c_str());
}

void printJsonObject(const std::vector<std::pair<std::string, std::string>>& fields) {
  std::string json = "{";
  for (const auto& [key, value] : fields)
    json += (json.size() > 1 ? ", " : "") + jsonString(key) + ": " + jsonString(value);
  std::printf("%s}\n", json.c_str());
}

}  // namespace cushare::cli
