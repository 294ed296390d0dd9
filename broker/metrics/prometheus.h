// The broker's state in the Prometheus text exposition format, version 0.0.4: what GET /metrics
// returns. Reference of every family: docs/operations.md.
//
// Invariants:
// - Pure code: a function of the snapshot only (no clock, no I/O, no global state), so the same
//   snapshot always renders to the same bytes and tests can compare exact text.
// - Every family has exactly one `# HELP` and one `# TYPE` line, written even when it has no
//   sample (so the set of families does not depend on the state), followed by all its samples.
// - Integer values are printed exactly (a uint64 never goes through a double); label values are
//   escaped as the format requires (backslash, double quote, newline).
// - A tenant whose ledger the broker cannot manage (TenantSnapshot::error) has only
//   cushare_tenant_info, cushare_tenant_processes and cushare_tenant_ledger_error: its counters
//   would be unknown, and a made-up 0 would read as a reset.
#pragma once

#include <string>
#include <string_view>

#include "core/snapshot.h"

namespace cushare::broker {

// The full /metrics body, ending in a newline.
std::string renderMetrics(const BrokerSnapshot& s);

// A label value as the exposition format writes it between double quotes: `\` -> `\\`,
// `"` -> `\"`, newline -> `\n`. Exposed for tests.
std::string escapeLabelValue(std::string_view value);

}  // namespace cushare::broker
