// The kubelet device plugin (API v1beta1, gRPC on Unix sockets; docs/kubernetes.md): one resource
// cushare.io/<tenant> per configured tenant, devicesPerGpu devices (container slots) per device
// the tenant is placed on (a GPU or a MIG device), so a pod that asks for cushare.io/alpha: 1 gets
// tenant alpha's edits (the CDI device cushare.io/tenant=alpha, and the same environment and
// mounts for runtimes without CDI) on a device where alpha's limit holds.
//
// Invariants:
// - Each tenant's resource has its own socket and gRPC server in the plugin directory
//   (cushare-<tenant>.sock), serving before it registers with the kubelet (kubelet.sock).
// - When kubelet.sock is created again (a kubelet restart, which deletes every socket in the
//   directory), or a plugin's own socket disappears, the plugin serves anew and registers again.
//   Registrations that fail are retried every retry period while kubelet.sock exists. They are
//   sent only by the watcher thread, all wanted ones together with one deadline, without the
//   plugin's lock: start(), update() and stop() never wait for the kubelet.
// - Devices are Healthy while their GPU is present and MPS (when the broker runs it) is not
//   faulted, as the health probe says; a change is sent on every ListAndWatch stream at once.
// - Nothing here touches the broker's state: a kubelet that misbehaves or vanishes costs the
//   tenants nothing. Allocate refuses device IDs it did not advertise (INVALID_ARGUMENT).
// - gRPC lives only here (and in cushare-broker); never in the shim.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "container/tenant_edits.h"

namespace cushare::kubernetes {

inline constexpr char kResourcePrefix[] = "cushare.io/";

struct PluginTenant {
  std::string name;
  container::TenantEdits edits;  // the container view
  std::string cdiDevice;         // "cushare.io/tenant=<name>"; empty: CDI off
  // The devices (UUIDs, of PluginSettings::gpus) its resource is backed by: where the tenant is
  // placed (its memory limit applies there; docs/kubernetes.md). nullopt: every device.
  std::optional<std::vector<std::string>> gpus;
};

struct PluginSettings {
  std::string dir;                  // the kubelet's device plugin directory
  uint32_t devicesPerGpu = 1;
  std::vector<std::string> gpus;    // the broker's devices, by UUID, in index order
  std::vector<std::string> gpuNames;  // beside gpus: "0", or "0:1" for a MIG device (gpu_cdi_device's {index})
  std::vector<PluginTenant> tenants;
  // When set, Allocate also names the CDI device of each GPU of the IDs it is given
  // (container::gpuCdiDevice: {uuid}, {index}), so pods get the GPU through the resource.
  std::string gpuCdiDevice;
  // Per device UUID, the device nodes a container of that device needs from the plugin (a MIG
  // device's /dev/nvidiaN and nvidia-caps nodes: container/mig_nodes.h). Allocate hands them to the
  // runtime as device specs unless gpuCdiDevice names NVIDIA's CDI device, which carries them.
  std::map<std::string, std::vector<std::string>> deviceNodes;
  // Pod labels (core/pod_labels.h): when set, a directory <allocationDir>/<tenant>/<uuid>_<n> per
  // device ID, made at start and on update, and Allocate mounts the one of a container's first ID
  // read-only at kAllocationMountPoint. Empty: no mounts.
  std::string allocationDir;
};

// Per GPU UUID: healthy. A GPU missing from the answer is unhealthy.
using HealthProbe = std::function<std::map<std::string, bool>()>;

struct PluginTiming {
  std::chrono::milliseconds health{2000};  // how often the probe runs
  std::chrono::milliseconds retry{5000};   // how often a failed registration is tried again
};

// Whether a tenant's name can be a resource name (cushare.io/<name>: letters, digits, '-', '_',
// '.', starting and ending with a letter or a digit, at most 63 characters). False with *reason.
bool validResourceName(const std::string& tenant, std::string* reason);

class DevicePlugin {
 public:
  DevicePlugin(HealthProbe probe, PluginTiming timing = {});
  ~DevicePlugin();
  DevicePlugin(const DevicePlugin&) = delete;
  DevicePlugin& operator=(const DevicePlugin&) = delete;

  // Serves every tenant, registers them (a kubelet not there yet is not an error: it is
  // registered with when its socket appears) and starts watching. False with *err (one line) when
  // the directory cannot be watched or a socket cannot be served.
  bool start(const PluginSettings& s, std::string* err);
  // After a reload: serves new tenants, stops removed ones, updates the edits of the others.
  void update(const PluginSettings& s);
  // Stops every server (their sockets are removed) and the watcher.
  void stop();

  // For tests and status: registrations accepted by the kubelet so far (a counter).
  uint64_t registrations() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace cushare::kubernetes
