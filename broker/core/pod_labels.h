// Pods in the metrics (docs/kubernetes.md, "Pods, namespaces and containers"): which pod and
// container of Kubernetes a tenant process belongs to, for the per-container metrics and
// `cushare processes`.
//
// How a process is tied to its container, without trusting anything the tenant writes:
// - the device plugin makes, for every device ID it advertises, an empty directory
//   <allocation_dir>/<tenant>/<uuid>_<n>, and Allocate mounts the one of the container's first
//   ID read-only at kAllocationMountPoint in the container;
// - the broker reads the process's /proc/<pid>/mountinfo (readable by every user, unlike its
//   environment) and takes the last mount at that mount point (a later mount hides an earlier):
//   it must be on the allocation directory's filesystem, its root must end in
//   /<tenant>/<uuid>_<n>, that directory must exist under allocation_dir, and the tenant must be
//   the process's own;
// - the kubelet's pod resources API (List) names the namespace, pod and container holding that
//   device ID of cushare.io/<tenant>.
// A tenant's process cannot change its container's mounts (the runtime made them; without
// CAP_SYS_ADMIN over the mount namespace nothing can be unmounted or added there), and in a user
// namespace of its own it can only bind what it already sees: at most its own container's.
//
// Invariants: a process is labelled only when every step above holds; nothing here blocks on the
// kubelet (the lookup answers from a cache its own thread refreshes); nothing changes the broker's
// accounting: the labels only name processes the ledgers already count.
#pragma once

#include <functional>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <tuple>

#include "core/log_limit.h"

namespace cushare::broker {

struct BrokerSnapshot;

// Where a container sees its allocation directory.
inline constexpr char kAllocationMountPoint[] = "/run/cushare/allocation";

struct PodRef {
  std::string ns, pod, container;
  bool operator==(const PodRef&) const = default;
  bool operator<(const PodRef& o) const {
    return std::tie(ns, pod, container) < std::tie(o.ns, o.pod, o.container);
  }
};

// A device plugin's ID ("<uuid>::<n>") as a directory name ("<uuid>_<n>"; ':' is kept out of host
// paths that runtimes bind) and back. False when name is not such a name.
inline std::string allocationDirName(const std::string& deviceId) {
  const size_t sep = deviceId.rfind("::");
  if (sep == std::string::npos) return deviceId;
  return deviceId.substr(0, sep) + "_" + deviceId.substr(sep + 2);
}
bool deviceIdOfDirName(std::string_view name, std::string* deviceId);

struct AllocationMount {
  std::string tenant, deviceId;
  bool operator==(const AllocationMount&) const = default;
};

// The allocation mount of a process, from its mountinfo text (proc(5)): the last mount at
// kAllocationMountPoint, when it is on the filesystem major:minor and its root is exactly
// <dirInFs>/<tenant>/<uuid>_<n>, dirInFs being the allocation directory's path within that
// filesystem (pathWithinFilesystem): a look-alike directory elsewhere on the same filesystem does
// not pass. Octal escapes (\040 and the like) are decoded.
std::optional<AllocationMount> allocationFromMountinfo(std::string_view mountinfo, unsigned major, unsigned minor,
                                                       std::string_view dirInFs);

// The path of dir (absolute, links resolved) within its filesystem, from the broker's own
// mountinfo: the mount whose mount point holds dir most closely and is on major:minor, its root
// joined with the rest of dir ("/run/cushare/allocations" under a bind of the host's /run/cushare
// at /run/cushare, on the host's /run: "/cushare/allocations"). nullopt when no mount fits.
std::optional<std::string> pathWithinFilesystem(std::string_view selfMountinfo, const std::string& dir,
                                                unsigned major, unsigned minor);

class PodLabeler {
 public:
  // The container holding device ID `id` of `resource` (cushare.io/<tenant>), from a cache;
  // nullopt when it is not known (yet).
  using Lookup = std::function<std::optional<PodRef>(const std::string& resource, const std::string& id)>;
  struct Status {
    bool up = false;    // the last List of the kubelet's pod resources answered
    std::string error;  // why not (empty while up)
  };

  PodLabeler(std::string allocationDir, Lookup lookup, std::function<Status()> status);

  // Sets the pod of every process of s that has one (ProcessSnapshot::pod) and s->podLabels.
  void label(BrokerSnapshot* s);

 private:
  const std::string dir_;
  const Lookup lookup_;
  const std::function<Status()> status_;
  std::mutex mu_;         // guards warned_ and logLimit_ (label() runs on the metrics and control threads)
  std::set<int> warned_;  // host pids with another tenant's allocation mounted, warned about once
  LogLimit logLimit_{20, std::chrono::seconds(6)};
};

}  // namespace cushare::broker
