// The broker's state (core/snapshot.h) as control API replies (control.proto). Pure mapping: no
// I/O, no state, so the broker fills replies from one snapshot and tests check them directly.
//
// Invariants:
// - Device numbers in replies are the broker's device indexes (DeviceSnapshot::index), never
//   positions in the snapshot's vectors.
// - A limit of kNoLimit is an absent limit_bytes, not UINT64_MAX.
#pragma once

#include <functional>
#include <string>

#include "control.pb.h"
#include "core/snapshot.h"

namespace cushare::rpc {

void toProto(const broker::BrokerSnapshot& snap, StatusReply* out);
void toProto(const broker::TenantSnapshot& tenant, const broker::BrokerSnapshot& snap, Tenant* out);

// Every tenant, or only the one named (empty: all). Returns false, with an empty reply, when a
// name is given and the snapshot has no such tenant, so the broker can say so.
bool tenantsToProto(const broker::BrokerSnapshot& snap, const std::string& tenantOrEmpty,
                    TenantsReply* out);

// Every live process of every tenant, or of the one named; each lists the devices where it uses
// memory. Returns false, with an empty reply, for a name the snapshot does not have.
// innermostPid(hostPid): that process's pid in its own innermost pid namespace, 0 if it is gone
// (the I/O stays with the caller); a slot's pid is verified when it equals innermostPid(hostPid).
bool processesToProto(const broker::BrokerSnapshot& snap, const std::string& tenantOrEmpty,
                      const std::function<int(int hostPid)>& innermostPid, ProcessesReply* out);

}  // namespace cushare::rpc
