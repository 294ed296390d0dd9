// What the CLI prints: aligned tables for people, JSON for scripts (--json). Sizes read like
// cushare::formatSize ("512 MiB"); a missing limit is "-"; a limit set live carries a '*'.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include <google/protobuf/message.h>

#include "control.pb.h"

namespace cushare::cli {

void printStatus(const rpc::StatusReply& s);
void printTenants(const google::protobuf::RepeatedPtrField<rpc::Tenant>& tenants);
// A line per device whose managed bursters take turns (the thrashing guard), and one per device where
// processes outside cushare hold memory (no tenant's limit counts it).
void printOutside(const google::protobuf::RepeatedPtrField<rpc::Device>& devices);
void printProbeTable(const rpc::ProbeTable& table);
void printProcesses(const rpc::ProcessesReply& p);

// One message as JSON on stdout, zero values included so every field is there to read, 64-bit
// integers as JSON numbers (not proto3's JSON strings), an absent optional field left out.
void printJson(const google::protobuf::Message& m);
// {"error": "..."} on stdout.
void printJsonError(const std::string& message);
// {"key": "value", ...} in the order given (the environment of `cushare env --json`). Written
// here rather than through protobuf's Struct, whose map gains nothing for a flat list.
void printJsonObject(const std::vector<std::pair<std::string, std::string>>& fields);

// "3d 4h 5m", "4h 5m 6s", "5m 6s", "6s".
std::string formatDuration(double seconds);

}  // namespace cushare::cli
