// What makes a process a tenant: its environment (LD_PRELOAD of the shim, CUSHARE_TENANT, the
// ledger directory, CUSHARE_REQUIRE_BROKER=1 and, in a container with MPS on, where the MPS pipe
// directory is) and, for a container, the mounts that bring the shim, the ledger directory, the
// MPS pipe directory and the operator's CUPTI library in. One function for `cushare env`/`cushare run` (this host's paths), the CDI
// spec and the device plugin's Allocate (container paths). Reference: docs/containers.md.
//
// Invariants:
// - Container paths are fixed (below), whatever the host's layout: an image, a pod spec or a
//   support script can rely on them.
// - Every variable produced is checked with the shim's own parser, so a value the shim would
//   refuse fails here, with the shim's message, instead of in the tenant's cuInit.
// - Pure code: nothing but findShim touches the file system.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace cushare::container {

using EnvVars = std::vector<std::pair<std::string, std::string>>;

// Where a container finds what the edits mount.
inline constexpr char kContainerShim[] = "/usr/local/cushare/lib/libcushare.so";
inline constexpr char kContainerLedgerDir[] = "/run/cushare/ledgers";
inline constexpr char kContainerMpsPipeDir[] = "/run/cushare/mps";

struct Mount {
  std::string hostPath;
  std::string containerPath;
  bool readOnly = false;
  bool operator==(const Mount&) const = default;
};

// The host's side of a tenant's edits.
struct HostPlaces {
  std::string shim;        // libcushare.so, absolute
  std::string ledgerDir;   // the broker's ledger_dir
  std::string mpsPipeDir;  // the broker's MPS pipe_dir while it runs MPS; empty: MPS off
  // compute.cupti_library, resolved: mounted read-only at the same path (the host segment names
  // it for host processes and containers alike); empty: none.
  std::string cuptiLibrary;
};

struct TenantEdits {
  EnvVars env;  // LD_PRELOAD last
  std::vector<Mount> mounts;
};

enum class View {
  kHost,       // a process on this host: the host's paths, nothing to mount (the shim reads the
               // MPS pipe directory from the broker's mps.conf itself)
  kContainer,  // a container: the container paths above and the mounts that put things there
};

// The edits that make a process tenant `tenant` of the broker described by host. False with *err
// (one line) for a tenant name, ledger directory or MPS pipe directory the shim would refuse, or a
// shim path LD_PRELOAD cannot carry.
bool tenantEdits(const std::string& tenant, const HostPlaces& host, View view, TenantEdits* out,
                 std::string* err);

// Runs the shim's parser over vars (nothing else is looked up): false with the shim's reason,
// without its "cushare: " prefix.
bool checkLikeShim(const EnvVars& vars, std::string* err);

// A shim message without its "cushare: " prefix (callers add their own).
std::string withoutShimPrefix(std::string message);

// The shim to preload: `given` when not empty (it must exist when mustExist), else the first
// existing of <exe dir>/../lib/cushare/libcushare.so (installed) and <exe dir>/../lib/libcushare.so
// (build tree). With mustExist, or when found next to the executable, the result is absolute.
bool findShim(const std::string& given, bool mustExist, std::string* out, std::string* err);

}  // namespace cushare::container
