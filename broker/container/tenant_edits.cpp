// A tenant's environment and mounts; see tenant_edits.h.
#include "tenant_edits.h"

#include <filesystem>
#include <string_view>

#include "cushare/parse.h"
#include "cushare/shim_config.h"

namespace cushare::container {
namespace {

namespace fs = std::filesystem;

bool fail(std::string* err, std::string why) {
  if (err) *err = std::move(why);
  return false;
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

}  // namespace

std::string withoutShimPrefix(std::string message) {
  constexpr std::string_view kPrefix = "cushare: ";
  if (message.starts_with(kPrefix)) message.erase(0, kPrefix.size());
  return message;
}

bool checkLikeShim(const EnvVars& vars, std::string* err) {
  auto lookup = [&](const char* name) -> const char* {
    for (const auto& [key, value] : vars)
      if (key == name) return value.c_str();
    return nullptr;
  };
  ShimConfig ignored;
  std::string why;
  if (!loadShimConfig(lookup, &ignored, &why)) return fail(err, withoutShimPrefix(why));
  return true;
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

bool tenantEdits(const std::string& tenant, const HostPlaces& host, View view, TenantEdits* out,
                 std::string* err) {
  const bool container = view == View::kContainer;
  TenantEdits e;
  // The broker answers for this tenant: a process started with these variables must find it (a
  // ledger directory not mounted, or misspelt, fails closed rather than running standalone).
  e.env = {{"CUSHARE_TENANT", tenant},
           {"CUSHARE_LEDGER_DIR", container ? kContainerLedgerDir : host.ledgerDir},
           {"CUSHARE_REQUIRE_BROKER", "1"}};
  // On the host the shim finds the pipe directory in mps.conf; a container has it elsewhere.
  if (container && !host.mpsPipeDir.empty()) e.env.emplace_back("CUSHARE_MPS_PIPE_DIR", kContainerMpsPipeDir);
  // The host's paths must be ones the shim accepts too: mps.conf carries the pipe directory.
  EnvVars hostSide = {{"CUSHARE_LEDGER_DIR", host.ledgerDir}};
  if (!host.mpsPipeDir.empty()) hostSide.emplace_back("CUSHARE_MPS_PIPE_DIR", host.mpsPipeDir);
  if (!checkLikeShim(e.env, err) || !checkLikeShim(hostSide, err)) return false;
  if (!preloadable(host.shim, err)) return false;
  if (container && host.shim.front() != '/')
    return fail(err, "shim path '" + printable(host.shim, 200) + "' is not absolute: a container runtime "
                     "resolves mounts from the host's root");
  e.env.emplace_back("LD_PRELOAD", container ? kContainerShim : host.shim);
  if (container) {
    e.mounts.push_back({host.shim, kContainerShim, true});
    e.mounts.push_back({host.ledgerDir, kContainerLedgerDir, false});
    if (!host.mpsPipeDir.empty()) e.mounts.push_back({host.mpsPipeDir, kContainerMpsPipeDir, false});
    if (!host.cuptiLibrary.empty()) {
      if (host.cuptiLibrary.front() != '/')
        return fail(err, "compute.cupti_library '" + printable(host.cuptiLibrary, 200) + "' is not absolute");
      e.mounts.push_back({host.cuptiLibrary, host.cuptiLibrary, true});
    }
  }
  *out = std::move(e);
  return true;
}

}  // namespace cushare::container
