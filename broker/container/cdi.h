// The broker's CDI spec (Container Device Interface): one file of kind cushare.io/tenant with a
// device per configured tenant, whose container edits are tenantEdits' (tenant_edits.h), so that
// `podman run --device cushare.io/tenant=alpha` (or any CDI runtime) makes the container tenant
// alpha. Reference: docs/containers.md.
//
// Invariants:
// - The spec uses only cdiVersion, kind, devices[].name and containerEdits.env/mounts (hostPath,
//   containerPath, options; no mount type), and declares the lowest version that has them:
//   0.3.0, or 0.5.0 when a device name starts with a digit. Runtimes refuse a spec that declares
//   a version they do not know (podman 4.3 refuses 0.6.0) or lower than its fields need.
// - A tenant placed on MIG devices also gets a device per MIG device, "<tenant>:<gpu>:<mig>" (tenant
//   names hold no ':'), with its edits, CUDA_VISIBLE_DEVICES naming the MIG device by UUID, and the
//   MIG device's nodes (mig_nodes.h); a MIG device whose nodes are unknown is left out, with the
//   reason.
// - A tenant whose name is not a valid CDI device name (it must start and end with a letter or a
//   digit) is left out, with the reason, never written half-valid.
// - The file is replaced atomically (a hidden temporary beside it, fsync, rename): a runtime
//   reading the directory sees the old spec or the new one, never a part.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "container/tenant_edits.h"

namespace cushare::container {

inline constexpr char kCdiKind[] = "cushare.io/tenant";
inline constexpr char kCdiSpecFile[] = "cushare.io-tenant.json";

// "cushare.io/tenant=<tenant>": what a runtime's --device, or the device plugin's Allocate, names.
std::string cdiDeviceName(const std::string& tenant);

// CDI's rule for a device name: letters, digits, '_', '-', '.', ':', starting and ending with a
// letter or a digit. False with *reason.
bool validCdiDeviceName(std::string_view name, std::string* reason);

// The qualified CDI device that gives a container GPU `index` (UUID `uuid`), from a template in
// which {uuid} and {index} stand for them: "nvidia.com/gpu={uuid}" names the devices NVIDIA's
// `nvidia-ctk cdi generate` writes. A MIG device's index is "<gpu>:<mig>" and its UUID "MIG-...",
// as nvidia-ctk names MIG devices. False with *err when the template holds another {...} or the
// result is not vendor/class=name by CDI's rules.
bool gpuCdiDevice(std::string_view tmpl, const std::string& uuid, std::string_view index, std::string* out,
                  std::string* err);

struct CdiMigDevice {
  std::string name;                // "0:1"
  std::string uuid;                // "MIG-..."
  std::vector<std::string> nodes;  // its device nodes (mig_nodes.h); empty: unknown, left out
  std::string nodesUnknown;        // why, when nodes is empty
};

struct CdiTenant {
  std::string name;
  std::vector<CdiMigDevice> mig = {};  // the MIG devices it is placed on
};

// "<tenant>:<gpu>:<mig>": the CDI device name of a tenant in a MIG device.
std::string cdiMigDeviceName(const std::string& tenant, const std::string& migName);

struct CdiSpec {
  std::string version;                // cdiVersion written
  std::vector<std::string> devices;   // the tenants in it
  std::vector<std::string> migDevices;  // "<tenant>:<gpu>:<mig>" devices in it
  std::vector<std::string> leftOut;   // "<tenant>: <reason>" for the tenants left out
  std::string json;                   // the file's contents; empty when no tenant could go in
};

// The spec for tenants (in this order). False with *err (one line) when the host's places are
// ones the shim would refuse (tenantEdits).
bool buildCdiSpec(const std::vector<CdiTenant>& tenants, const HostPlaces& host, CdiSpec* out,
                  std::string* err);

// Writes json as dir/kCdiSpecFile atomically, creating dir (mode 0755) when missing; mode 0644.
bool writeCdiSpec(const std::string& dir, const std::string& json, std::string* err);
// Removes dir/kCdiSpecFile; true when it is gone (or never was).
bool removeCdiSpec(const std::string& dir, std::string* err);

}  // namespace cushare::container
