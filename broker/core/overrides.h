// Live limits set with `cushare set-limit`, kept in the broker's state file so that a restarted
// broker keeps them (the file lives as long as the ledgers: both are on tmpfs by default).
// Format, one item a line: a header line "cushare-broker-state 1", then
// "limit <tenant> <GPU-uuid> <bytes>" lines. The broker writes it whole (temporary file + rename).
#pragma once

#include <cstdint>
#include <map>
#include <string>

namespace cushare::broker {

// tenant -> device UUID -> bytes
using Overrides = std::map<std::string, std::map<std::string, uint64_t>>;

// A missing file is an empty set. A damaged one fails with `<file>:<line>: <reason>`.
bool loadOverrides(const std::string& path, Overrides* out, std::string* err);
bool saveOverrides(const std::string& path, const Overrides& o, std::string* err);

}  // namespace cushare::broker
