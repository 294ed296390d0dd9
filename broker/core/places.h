// The places where the broker keeps what others must not replace: ledger_dir, the state file, the
// control socket (docs/broker-configuration.md, "Places").
//
// Invariants:
// - Every existing directory above them belongs to root or the broker's user and is writable by
//   others only with the sticky bit; the directories holding the state file and the socket are
//   not writable by others at all.
// - ledger_dir is a directory of the broker's user, mode 0711 when prepared. Whatever another user
//   put at its path first is never entered, read or followed: it is swapped aside atomically.
#pragma once

#include <string>

#include "config/config.h"

namespace cushare::broker {

// Checks the places without touching anything (start, --check): one line on failure, naming the
// path, the directory at fault and what to do.
bool checkPlaces(const Config& c, std::string* err);

// Refuses a place another user could replace: every existing directory above path belongs to root
// or the broker's user and is writable by others only with the sticky bit; with strict, the
// directory holding path is not writable by others at all. `what` names it in the message.
bool checkParentsOf(const std::string& path, const std::string& what, bool strict, std::string* err);

// Refuses a file that another user could replace or change: after symlinks, its directories as
// checkParentsOf with strict, and the file itself a regular file of root or the broker's user,
// writable by neither group nor others. *resolved: the path with every link resolved (what to
// hand on: a link someone else may repoint later must not be); a missing file is not refused
// here, but the directories it would appear in are checked.
bool checkTrustedFile(const std::string& path, const std::string& what, std::string* resolved, std::string* err);

// A directory the broker will create or write into (mps.pipe_dir, mps.log_dir, cdi.spec_dir), as
// --check sees it without creating anything: it is a directory this process may write into, or it
// is missing and the nearest existing directory above it lets this process create it.
bool checkDirWritable(const std::string& dir, const std::string& what, std::string* err);

// The tenants' uid and gid keys: the broker gives each such tenant's ledger to that user or group
// when it creates it, which a process may do for another user only with CAP_CHOWN (root has it),
// and for a group only with CAP_CHOWN or if it is one of its groups.
bool checkLedgerOwners(const Config& c, std::string* err);

// compute.cupti_library, when set: it must exist and be a trusted file (checkTrustedFile); its
// resolved path (what the host segment names and containers mount) in *resolved, empty when unset.
bool checkCuptiLibrary(const Config& c, std::string* resolved, std::string* err);

// Creates ledger_dir (and the directories above it, the state file's and the socket's), moving
// aside, unread, anything of another user found at its path, and checks the places again.
bool prepareLedgerDir(const Config& c, std::string* err);

}  // namespace cushare::broker
