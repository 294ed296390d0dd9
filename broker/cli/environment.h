// The environment of a tenant process, for `cushare env` (printed) and `cushare run` (exec'd):
// the broker's settings for the tenant as CUSHARE_* variables, and LD_PRELOAD of the shim.
//
// Invariants:
// - Only variables the shim knows are produced (it refuses unknown CUSHARE_* names), and every
//   value is checked with the shim's own parser first, so a value the shim would refuse fails
//   here, with the shim's message, instead of in the tenant's cuInit.
// - Values are single-line, so `KEY=VALUE` lines are a valid `docker run --env-file`.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "container/tenant_edits.h"
#include "control.pb.h"

namespace cushare::cli {

using container::EnvVars;
using container::checkLikeShim;
using container::findShim;

// Checks a --memory value as the shim checks CUSHARE_MEMORY_LIMIT.
bool checkMemoryLimit(const std::string& value, std::string* err);

// The identity of container/tenant_edits.h (this host's view: CUSHARE_TENANT, CUSHARE_LEDGER_DIR,
// CUSHARE_REQUIRE_BROKER=1, LD_PRELOAD last) and the broker's settings: CUSHARE_MEMORY_LIMIT,
// CUSHARE_THREAD_PERCENTAGE and CUSHARE_PRIORITY (when the broker sets them), LD_PRELOAD.
// CUSHARE_MEMORY_LIMIT: with carryLimit (`cushare env`: a container, where the ledger directory
// may be missing), the broker's limits, lowered by `memory` when it is one size (a per-device
// `memory` as given); without it (`cushare run`), `memory` when given.
bool tenantEnvironment(const rpc::EnvReply& reply, const std::string& memory,
                       const std::string& shim, bool carryLimit, EnvVars* out, std::string* err);

// Sets vars in this process's environment (LD_PRELOAD goes in front of an inherited one; other
// inherited variables stay), checks the result as the shim will, and execs command. Returns only
// on failure, with *err set: 1 when the environment would make the shim refuse to start, 127
// when the command cannot be executed.
int execWith(const EnvVars& vars, const std::vector<std::string>& command, std::string* err);

}  // namespace cushare::cli
