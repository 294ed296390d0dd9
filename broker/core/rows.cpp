// Ledger rows that hold more than their limit allows (Broker::checkRowsLocked, broker.h).
//
// A shim reserves in its slot's counter only while the row's sum stays within the limit, so an
// honest row grows above its limit never: it is above only after the operator lowered the limit
// below what it held, and then it can only shrink. The ceiling is therefore the limit, or what the
// row held when it was last found above the limit, whichever is higher; it follows the row down.
// A row above its ceiling in kHiddenTicks ticks in a row (both reads of a tick: an allocation's
// momentary intent is in at most one) was written by a process of the tenant: it took bytes off
// its own counter around an allocation and put them back. The device holds what the counters say,
// so the hidden-memory check sees nothing; this is what finds it. It is counted and logged once,
// and taken back (tamper_response) every tick for as long as the row stays above.
//
// A ceiling taken at the broker's first look (a restart, an adoption) from a row above its limit
// does not stay above what the device's own accounting shows the tenant's processes holding
// there (when it shows them holding anything): otherwise a row written up before that look would
// be an allowance up to its value, which a tenant could fill by writing its counters around each
// allocation (found by an attack review: 900 MiB on the device for a 512 MiB limit, nothing
// logged). Only then: after the first look the ceiling is what the row itself showed under the
// limit, and the device may show less than an honest row (managed memory not resident).
#include <algorithm>
#include <set>

#include "core/broker.h"
#include "core/bus_guard.h"
#include "core/log.h"
#include "cushare/limits_file.h"
#include "cushare/parse.h"

namespace cushare::broker {

bool Broker::limitOfEntryLocked(TenantState& t, int e, uint64_t* out) {
  if (const LimitsFile* limits = t.ledger->limitsFile(); limits != nullptr) {
    *out = limits->limit(e);
    return true;
  }
  return guarded([&] { *out = t.ledger->limit(e); });
}

bool Broker::entryAllowanceLocked(TenantState& t, int e, uint64_t* out) {
  if (!t.ledger || e < 0 || static_cast<size_t>(e) >= kLedgerMaxDevices || !limitOfEntryLocked(t, e, out))
    return false;
  const size_t i = static_cast<size_t>(e);
  if (i < t.rowCeiling.size() && t.rowCeiling[i] != UINT64_MAX) *out = std::max(*out, t.rowCeiling[i]);
  return true;
}

void Broker::checkRowsLocked(const std::map<std::string, ShownSums>& before,
                             const std::map<std::string, ShownSums>& after) {
  for (auto& [name, tp] : tenants_) {
    TenantState& t = *tp;
    t.rowCeiling.resize(kLedgerMaxDevices, UINT64_MAX);
    t.rowOver.resize(kLedgerMaxDevices, 0);
    t.rowFirstLook.resize(kLedgerMaxDevices, 0);
    t.rowSeen.resize(kLedgerMaxDevices, 0);
    const auto b = before.find(name), a = after.find(name);
    if (!t.ledger || b == before.end() || a == after.end() || b->second.ledger != t.ledger.get() ||
        a->second.ledger != t.ledger.get())
      continue;
    std::set<int> over;
    for (size_t d = 0; d < t.entry.size(); ++d) {
      const int e = t.entry[d];
      if (e < 0) continue;
      const size_t i = static_cast<size_t>(e);
      uint64_t limit = 0;
      if (!limitOfEntryLocked(t, e, &limit)) continue;
      const uint64_t held = std::min(b->second.bytes[i], a->second.bytes[i]);
      uint64_t& ceiling = t.rowCeiling[i];
      if (!t.rowSeen[i]) {  // first look: whatever it holds, as far as the device shows it
        t.rowSeen[i] = 1;
        ceiling = std::max(limit, held);
        t.rowFirstLook[i] = held > limit ? 1 : 0;
      }
      if (t.rowFirstLook[i] && held <= limit) t.rowFirstLook[i] = 0;
      if (t.rowFirstLook[i] && t.deviceHeldTick == ticks_ && d < t.deviceHeld.size() && t.deviceHeld[d] != 0)
        ceiling = std::max(limit, std::min(ceiling, t.deviceHeld[d]));
      if (held > std::max(limit, ceiling)) {
        if (t.rowOver[i] < INT32_MAX) ++t.rowOver[i];
        if (t.rowOver[i] == static_cast<int>(kHiddenTicks)) {
          tamperLocked(&t, "counters");
          CUSHARE_BLOG(warn, "tenant {}: ledger entry {} holds {} against a limit of {} although it cannot grow above it "
                       "by reserving: a process of the tenant wrote its usage counters",
                       name, e, formatSize(held), formatSize(limit));
        }
        if (t.rowOver[i] >= static_cast<int>(kHiddenTicks)) over.insert(e);
        continue;  // the ceiling does not follow a row that broke it
      }
      t.rowOver[i] = 0;
      ceiling = std::max(limit, std::min(ceiling, held));
    }
    if (!over.empty()) takeBackLocked(&t, over);
  }
}

}  // namespace cushare::broker
