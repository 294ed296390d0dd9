// How the broker judges a MIG layout changed under it (docs/mig.md, "When the layout changes"):
// pure comparisons of two device lists (config.h's DeviceInfo) and of what a configuration gives
// each device on them. main.cpp follows a change only when these say it is safe.
//
// Invariants:
// - A device is the same only when its UUID, name (<gpu>:<mig>), memory, memory group, profile,
//   GPU and compute instance IDs and GPU minor are: a change of any is a change of layout.
// - The GPUs of a list are its whole GPUs, the parents of its MIG devices and the GPUs in MIG
//   mode without MIG devices: a list with other GPUs is a GPU lost or added, not a layout.
// - A configuration is followed onto a new list only if every device present in both keeps the
//   same limit and guarantee for every tenant (and the unknown tenants' profile): a key by index
//   (`'0:0'`, a GPU ordinal) that would name another device after the change is refused, never
//   moved silently.
#pragma once

#include <set>
#include <string>
#include <vector>

#include "config/config.h"

namespace cushare::broker {

// One line per device, comparable between lists.
std::vector<std::string> describeDevices(const std::vector<DeviceInfo>& list);

// The GPUs of a list; idle: listDevices' "<index> (<uuid>)" lines of GPUs in MIG mode without MIG
// devices.
std::set<std::string> gpusOf(const std::vector<DeviceInfo>& list, const std::vector<std::string>& idle);

// MIG devices of `start` that `now` no longer has as they were (UUID, name, GPU and compute
// instance, GPU minor): their device nodes and `<tenant>:<gpu>:<mig>` names are stale.
std::set<std::string> changedMigDevices(const std::vector<DeviceInfo>& start, const std::vector<DeviceInfo>& now);

// False with *why (naming the tenant and device) when `next` (the configuration file now) gives a
// device present in both lists another limit or guarantee on `after` than `now` (the
// configuration in force) gives it on `before`, or when either does not resolve. Tenants are
// matched by name; one in only one of the two is judged against no limit in the other.
bool sameLimitsAcross(const Config& now, const std::vector<DeviceInfo>& before, const Config& next,
                      const std::vector<DeviceInfo>& after, std::string* why);

}  // namespace cushare::broker
