// What the CLI prints: aligned tables for people, JSON for scripts (--json). Sizes read like
// cushare::formatSize ("512 MiB"); a missing limit is "-"; a limit set live carries a '*'.
#pragma once

#include <string>

#include <google/protobuf/message.h>

#include "control.pb.h"

namespace cushare::cli {

void printStatus(const rpc::StatusReply& s);
void printTenants(const google::protobuf::RepeatedPtrField<rpc::Tenant>& tenants);
void printProcesses(const rpc::ProcessesReply& p);

// One message as JSON on stdout, zero values included so every field is there to read.
bool printJson(const google::protobuf::Message& m, std::string* err);
// {"error": "..."} on stdout.
void printJsonError(const std::string& message);

// "3d 4h 5m", "4h 5m 6s", "5m 6s", "6s".
std::string formatDuration(double seconds);

}  // namespace cushare::cli
