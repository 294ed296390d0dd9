// The environment of a tenant process; see environment.h.
#include "environment.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "cushare/parse.h"
#include "cushare/shim_config.h"

extern char** environ;

namespace cushare::cli {
namespace {

bool fail(std::string* err, std::string why) {
  if (err) *err = std::move(why);
  return false;
}

// Unknown CUSHARE_* names in the final environment: the shim refuses them (a misspelt variable
// would otherwise mean no limit). CUSHARE_SOCKET is the CLI's and the shim lets it pass.
bool checkNames(std::string* err) {
  for (char** e = environ; e && *e; ++e) {
    const std::string_view entry(*e);
    if (!entry.starts_with("CUSHARE_")) continue;
    const std::string_view name = entry.substr(0, entry.find('='));
    if (!isShimVariable(name) && name != "CUSHARE_SOCKET")
      return fail(err, "unknown variable " + std::string(name) +
                           " in the environment (misspelt?); the shim would refuse to start");
  }
  return true;
}

// CUSHARE_MEMORY_LIMIT for the tenant: the broker's limit on each device, lowered by --memory when
// that is one size. With the broker present it can only lower the broker's limits (the shim takes
// the lower of the two); without one it is what holds. One size when every device has the same
// limit, else GPU-<uuid>=BYTES for every device of the host, an unlimited one with the largest
// size (2^64-1, which is no limit): a process that sees only some of them (a container's subset,
// CUDA_VISIBLE_DEVICES) finds each of its devices named, which the shim requires when the list
// names devices it cannot see. "" when nothing is limited. A per-device --memory (ordinals are the
// process's, unknown here) is passed as given.
std::string memoryLimit(const rpc::EnvReply& reply, const std::string& memory) {
  MemoryLimitSpec spec;
  std::string ignored;
  if (!memory.empty() && (!parseMemoryLimit(memory, &spec, &ignored) || spec.kind == MemoryLimitSpec::kPerDevice))
    return memory;  // a malformed value is refused by checkLikeShim with the shim's message
  std::vector<std::pair<std::string, uint64_t>> limits;
  for (const rpc::TenantDevice& d : reply.devices()) {
    uint64_t bytes = d.has_limit_bytes() ? d.limit_bytes() : kUnlimited;
    if (spec.kind == MemoryLimitSpec::kAll && spec.all < bytes) bytes = spec.all;
    limits.emplace_back(d.uuid(), bytes);
  }
  if (limits.empty()) return memory;
  const bool same = std::all_of(limits.begin(), limits.end(), [&](const auto& l) { return l.second == limits[0].second; });
  if (same) return limits[0].second == kUnlimited ? "" : std::to_string(limits[0].second);
  std::string out;
  for (const auto& [uuid, bytes] : limits) out += (out.empty() ? "" : ",") + uuid + "=" + std::to_string(bytes);
  return out;
}

}  // namespace

bool checkMemoryLimit(const std::string& value, std::string* err) {
  return checkLikeShim({{"CUSHARE_MEMORY_LIMIT", value}}, err);
}

bool tenantEnvironment(const rpc::EnvReply& reply, const std::string& memory,
                       const std::string& shim, bool carryLimit, EnvVars* out, std::string* err) {
  // Who the process is (container/tenant_edits.h, this host's view), then the broker's settings.
  container::TenantEdits edits;
  if (!container::tenantEdits(reply.tenant(), {shim, reply.ledger_dir(), ""}, container::View::kHost, &edits, err))
    return false;
  EnvVars vars = std::move(edits.env);
  const auto preload = vars.back();  // LD_PRELOAD stays last
  vars.pop_back();
  if (const std::string limit = carryLimit ? memoryLimit(reply, memory) : memory; !limit.empty())
    vars.emplace_back("CUSHARE_MEMORY_LIMIT", limit);
  if (reply.has_thread_percentage())
    vars.emplace_back("CUSHARE_THREAD_PERCENTAGE", std::to_string(reply.thread_percentage()));
  if (!reply.priority().empty()) vars.emplace_back("CUSHARE_PRIORITY", reply.priority());
  if (!checkLikeShim(vars, err)) return false;
  vars.push_back(preload);
  *out = std::move(vars);
  return true;
}

int execWith(const EnvVars& vars, const std::vector<std::string>& command, std::string* err) {
  for (const auto& [key, value] : vars) {
    std::string v = value;
    const char* inherited = std::getenv(key.c_str());
    if (key == "LD_PRELOAD" && inherited && *inherited) v += std::string(":") + inherited;
    ::setenv(key.c_str(), v.c_str(), 1);
  }
  ShimConfig ignored;
  std::string why;
  if (!loadShimConfig(std::getenv, &ignored, &why)) {
    *err = container::withoutShimPrefix(why);  // the CLI adds "cushare: " itself
    return 1;
  }
  if (!checkNames(err)) return 1;

  std::vector<char*> argv;
  for (const std::string& a : command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  ::execvp(argv[0], argv.data());
  const int e = errno;
  fail(err, "cannot run '" + printable(command[0], 200) + "': " + std::strerror(e));
  return 127;
}

}  // namespace cushare::cli
