// The broker's face to container runtimes: the CDI spec (container/cdi.h) written from the
// configuration in force, at start and after every reload. Reference: docs/containers.md.
#pragma once

#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "config/config.h"
#include "container/tenant_edits.h"

namespace cushare::broker {

// The host's places of a tenant's edits: the shim (cdi.shim, else the one beside this broker), the
// ledger directory, the MPS pipe directory (mpsPipeDir; empty: MPS off). With mustExist, a shim
// that is not a file here fails.
bool hostPlaces(const Config& c, const std::string& mpsPipeDir, bool mustExist, container::HostPlaces* out,
                std::string* err);

// Writes the spec for c's tenants (or removes it when none can go in). Logs what it wrote and the
// tenants it left out. False with *err (one line) when it cannot; the caller decides whether that
// stops the broker (an explicit cdi: block at start) or is logged (a default, a reload).
// devices: the broker's; each MIG device a tenant is placed on adds a device with its nodes.
// staleMig: MIG devices (UUIDs) changed since the broker listed devices: their nodes are left out.
bool publishCdiSpec(const Config& c, const std::vector<DeviceInfo>& devices, const std::string& mpsPipeDir,
                    const std::set<std::string>& staleMig, std::string* err);

// The device nodes of each MIG device of devices (container/mig_nodes.h), by UUID: its nodes, or
// none and why they are unknown (no GPU minor from NVML, a table without the capability). Reads
// the driver's table from minorsFile; *fromFile says whether it was there.
struct MigNodes {
  std::vector<std::string> nodes;  // empty: unknown
  std::string why;
};
std::map<std::string, MigNodes> migNodesOf(const std::vector<DeviceInfo>& devices, const std::string& minorsFile,
                                           bool* fromFile);

// The tenants' edits for the device plugin's Allocate (container view) and their CDI device names
// (when CDI is on), in c's order. Tenants whose edits cannot be made are left out with *leftOut.
struct TenantEditsOf {
  std::string tenant;
  container::TenantEdits edits;
  std::string cdiDevice;  // empty when CDI is off
};
bool containerEdits(const Config& c, const std::string& mpsPipeDir, std::vector<TenantEditsOf>* out,
                    std::vector<std::string>* leftOut, std::string* err);

// Where each of c's tenants is placed (docs/kubernetes.md, "Tenants, resources and quotas"): the
// UUIDs of the devices its memory limit applies to, when a per-device map names them; nullopt
// (every device) for one size, a percentage or no limit. False with *err when a tenant's memory
// does not resolve on these devices.
using Placement = std::map<std::string, std::optional<std::vector<std::string>>>;
bool placementOf(const Config& c, const std::vector<DeviceInfo>& devices, Placement* out, std::string* err);

// At stop: removes the spec when cdi.remove_on_stop says so.
void unpublishCdiSpec(const Config& c);

// For --check: one line saying what the broker would write ("cdi: off", "cdi: DIR/FILE with N
// tenants ..."). False with *err when the spec cannot be built.
bool describeCdi(const Config& c, const std::vector<DeviceInfo>& devices, std::string* line, std::string* err);

}  // namespace cushare::broker
