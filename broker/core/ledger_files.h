// The files of ledger_dir, as the broker names them, and how it opens ledgers it did not create.
//   <tenant>.ledger                 a tenant's ledger (created by the broker, or by the shim of an
//                                   unknown tenant)
//   <tenant>.ledger.removed         a removed tenant's ledger while its processes run
//   <tenant>.ledger.replaced.<n>    a former ledger renamed away because another user owned it
// Renamed files are trusted after a restart only as the state file recorded them (overrides.h).
#pragma once

#include <string>

#include "cushare/ledger.h"

namespace cushare::broker {

inline constexpr char kLedgerSuffix[] = ".ledger";
inline constexpr char kRemovedSuffix[] = ".removed";
inline constexpr char kReplacedInfix[] = ".replaced.";
inline constexpr int kMaxReplaced = 64;  // former ledgers of one tenant alive at a time
// Former ledgers of an unknown tenant whose file was replaced under its name (nameless: removed by
// its creator) alive at a time; one more replacement is refused (each costs the broker a descriptor,
// a mapping and a look at its processes every tick).
inline constexpr size_t kMaxUnknownShadows = 8;

// An observer (no slot) that never creates anything.
inline LedgerOpenOptions observing(const std::string& fileName) {
  LedgerOpenOptions o;
  o.createDir = false;
  o.createFile = false;
  o.claimSlot = false;
  o.fileName = fileName;
  return o;
}

}  // namespace cushare::broker
