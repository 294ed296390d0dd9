// The environment of a tenant process; see environment.h.
#include "environment.h"

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string_view>

#include "cushare/parse.h"
#include "cushare/shim_config.h"

extern char** environ;

namespace cushare::cli {
namespace {

namespace fs = std::filesystem;

bool fail(std::string* err, std::string why) {
  if (err) *err = std::move(why);
  return false;
}

// The shim's messages start with "cushare: "; the CLI adds that prefix to every error itself.
std::string withoutPrefix(std::string message) {
  constexpr std::string_view kPrefix = "cushare: ";
  if (message.starts_with(kPrefix)) message.erase(0, kPrefix.size());
  return message;
}

// Runs the shim's own parser over vars (nothing else is looked up), so a value fails with the
// message the shim would print.
bool checkLikeShim(const EnvVars& vars, std::string* err) {
  auto lookup = [&](const char* name) -> const char* {
    for (const auto& [key, value] : vars)
      if (key == name) return value.c_str();
    return nullptr;
  };
  ShimConfig ignored;
  std::string why;
  if (!loadShimConfig(lookup, &ignored, &why)) return fail(err, withoutPrefix(why));
  return true;
}

// ld.so splits LD_PRELOAD at ':' and spaces; such a path would preload something else, or
// nothing, and the tenant would run without limits.
bool preloadable(const std::string& path, std::string* err) {
  for (const char c : path)
    if (c == ':' || c == ' ' || c == '\t' || static_cast<unsigned char>(c) < 0x20)
      return fail(err, "shim path '" + printable(path, 200) +
                           "' cannot go in LD_PRELOAD (it splits paths at ':' and spaces)");
  return !path.empty() || fail(err, "the shim path is empty");
}

bool isFile(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}

// The shim that belongs to this cushare, found from where the executable lies.
bool shimNextToExe(std::string* out, std::string* err) {
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (ec)
    return fail(err, "cannot find this program's path (/proc/self/exe): " + ec.message() +
                         "; use --shim PATH");
  const fs::path prefix = exe.parent_path().parent_path();
  const fs::path candidates[] = {prefix / "lib/cushare/libcushare.so",  // installed
                                 prefix / "lib/libcushare.so"};         // build tree
  for (const fs::path& c : candidates) {
    if (isFile(c)) {
      *out = fs::canonical(c, ec).string();
      return !ec || fail(err, c.string() + ": " + ec.message());
    }
  }
  return fail(err, "cannot find the shim: neither " + candidates[0].string() + " nor " +
                       candidates[1].string() + " exists; use --shim PATH");
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

}  // namespace

bool checkMemoryLimit(const std::string& value, std::string* err) {
  return checkLikeShim({{"CUSHARE_MEMORY_LIMIT", value}}, err);
}

bool findShim(const std::string& given, bool mustExist, std::string* out, std::string* err) {
  std::string path = given;
  if (path.empty()) {
    if (!shimNextToExe(&path, err)) return false;
  } else if (mustExist) {
    // A missing preload is only a warning from ld.so: the command would run unlimited.
    if (!isFile(path)) return fail(err, "shim not found at " + given);
    std::error_code ec;
    path = fs::absolute(path, ec).string();  // the command may change directory
  }
  if (!preloadable(path, err)) return false;
  *out = std::move(path);
  return true;
}

bool tenantEnvironment(const rpc::EnvReply& reply, const std::string& memory,
                       const std::string& shim, EnvVars* out, std::string* err) {
  EnvVars vars = {{"CUSHARE_TENANT", reply.tenant()}, {"CUSHARE_LEDGER_DIR", reply.ledger_dir()}};
  if (!memory.empty()) vars.emplace_back("CUSHARE_MEMORY_LIMIT", memory);
  if (reply.has_thread_percentage())
    vars.emplace_back("CUSHARE_THREAD_PERCENTAGE", std::to_string(reply.thread_percentage()));
  if (!reply.priority().empty()) vars.emplace_back("CUSHARE_PRIORITY", reply.priority());
  if (!checkLikeShim(vars, err)) return false;
  vars.emplace_back("LD_PRELOAD", shim);
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
    *err = withoutPrefix(why);
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
