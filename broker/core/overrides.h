// The broker's state file: what a restarted broker must know beside the configuration. Live limits
// set with `cushare set-limit`, the ledger directory the file belongs to, the highest limit each
// tenant's running processes may keep, and the ledgers the broker renamed and still watches. It
// lives as long as the ledgers (both on tmpfs by default).
// Format, one item a line: a header line "cushare-broker-state 1", then
//   "ledger_dir <path>"                         the broker's ledger directory (the rest of the line)
//   "limit <tenant> <GPU-uuid> <bytes>"         a live limit
//   "last <tenant> <GPU-uuid> <bytes|none>"     the limit the tenant's processes last had from the
//                                               configuration: a tenant that leaves it keeps at most this
//   "threads <tenant> <1..100>"                 a live compute cap (set-limit --threads)
//   "priority <tenant> <high|normal|low>"       a live priority (set-limit --priority)
//   "file <tenant> <file> <dev> <ino>"          a ledger renamed by the broker (<tenant>.ledger.removed,
//                                               <tenant>.ledger.replaced.N) and the identity of its inode
// The broker writes it whole (temporary file + rename), mode 0600. Files of earlier versions (only
// "limit" lines) load as they are.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "cushare/shim_config.h"

namespace cushare::broker {

// tenant -> device UUID -> bytes
using Overrides = std::map<std::string, std::map<std::string, uint64_t>>;

// A ledger the broker renamed while processes still use it: trusted again after a restart only if
// the file by that name is still the same inode.
struct KeptFile {
  std::string tenant;
  std::string file;  // name in ledger_dir
  uint64_t dev = 0, ino = 0;
  bool operator==(const KeptFile& o) const {
    return tenant == o.tenant && file == o.file && dev == o.dev && ino == o.ino;
  }
};

struct BrokerState {
  std::string ledgerDir;  // empty: written by an earlier version (accepted for any ledger_dir)
  Overrides limits;       // live limits
  Overrides last;         // tenant -> device UUID -> bytes (UINT64_MAX: none)
  std::vector<KeptFile> files;
  std::map<std::string, int> threads;          // tenant -> live compute cap, percent (1..100)
  std::map<std::string, Priority> priorities;  // tenant -> live priority
  bool operator==(const BrokerState& o) const {
    return ledgerDir == o.ledgerDir && limits == o.limits && last == o.last && files == o.files &&
           threads == o.threads && priorities == o.priorities;
  }
  bool operator!=(const BrokerState& o) const { return !(*this == o); }
};

// A missing file is an empty state. A damaged one fails with `<file>:<line>: <reason>`; so does
// one that is not a regular file of the broker's user that others cannot write.
bool loadState(const std::string& path, BrokerState* out, std::string* err);
bool saveState(const std::string& path, const BrokerState& s, std::string* err);

}  // namespace cushare::broker
