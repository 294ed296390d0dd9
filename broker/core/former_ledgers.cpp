// Former ledgers of a tenant (Broker::TenantState::Shadow): a ledger another user owned, renamed
// away and replaced, or an unknown tenant's ledger replaced under its name. What their processes
// still hold is charged against the tenant and only ever shrinks; see broker.h.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "core/broker.h"

#include "cushare/limits_file.h"
#include "core/bus_guard.h"
#include "core/devices.h"
#include "core/ledger_files.h"
#include "core/log.h"

namespace cushare::broker {

void Broker::supersedeLocked(TenantState* t, uid_t foundOwner) {
  const std::string path = ledgerDir_ + "/" + t->fileName;
  std::string aside;
  int renameErrno = 0;
  for (int k = 1; k <= kMaxReplaced; ++k) {
    const std::string name = t->name + kLedgerSuffix + kReplacedInfix + std::to_string(k);
    bool used = false;
    for (const TenantState::Shadow& sh : t->shadows) used = used || sh.fileName == name;
    if (used) continue;
    if (::renameat2(AT_FDCWD, path.c_str(), AT_FDCWD, (ledgerDir_ + "/" + name).c_str(), RENAME_NOREPLACE) == 0) {
      aside = name;
      break;
    }
    renameErrno = errno;
    if (errno != EEXIST) break;
  }
  if (aside.empty()) {
    t->ledger.reset();
    errno = renameErrno;
    noteError(t, "its ledger " + path + " belongs to uid " + std::to_string(foundOwner) +
                     " and cannot be moved aside: " + std::strerror(errno) + "; it is tried again at the next scan");
    return;
  }
  CUSHARE_BLOG(warn, "tenant {}: {} belonged to uid {}, not the tenant's user: renamed to {} and replaced by a "
               "fresh ledger; what its processes hold counts against the tenant until they exit",
               t->name, path, foundOwner, aside);
  attachShadowLocked(t, std::move(t->ledger), aside);
  stateDirty_ = true;
  openLedgerLocked(t);
}

namespace {

// The entry a ledger's processes count in for a device: the one its limits file published (they
// bind that one, whatever the ledger says), else the ledger's own, added (at 0) when err is given.
int entryOf(Ledger& l, const uint8_t uuid[16], std::string* err) {
  if (const LimitsFile* f = l.limitsFile())
    if (const int e = f->find(uuid); e >= 0) return e;
  return err != nullptr ? l.deviceIndex(uuid, 0, err) : l.findDevice(uuid);
}

}  // namespace

void Broker::attachShadowLocked(TenantState* t, std::unique_ptr<Ledger> l, const std::string& fileName) {
  TenantState::Shadow sh;
  sh.fileName = fileName;
  sh.charge.assign(devices_.size(), 0);
  limitsOfLocked(l.get(), t->name);  // a former ledger found again after a restart: its file
  // What its processes hold now, at most the tenant's whole limit; from now on they cannot grow:
  // every device entry gets that as its limit (a device they have not used yet gets 0).
  const bool ok = guarded([&] {
    for (size_t d = 0; d < devices_.size(); ++d) {
      uint8_t uuid[16];
      parseGpuUuid(devices_[d].uuid, uuid);
      std::string err;
      const int e = entryOf(*l, uuid, &err);
      if (e < 0) continue;
      sh.charge[d] = std::min(l->used(e), expectedLocked(*t, d));
      l->setLimit(e, sh.charge[d]);
    }
  });
  if (!ok) {
    // Unreadable (truncated by its creator): its processes lose their mapping's backing anyway.
    CUSHARE_BLOG(warn, "tenant {}: its former ledger {} is unreadable; not charged", t->name, fileName);
    return;
  }
  sh.initial = sh.charge;
  sh.ledger = std::move(l);
  shadowLimitsLocked(sh);
  t->shadows.push_back(std::move(sh));
}

void Broker::shadowLimitsLocked(const TenantState::Shadow& sh) {
  LimitsFile* f = sh.ledger ? sh.ledger->limitsFile() : nullptr;
  if (f == nullptr) return;
  for (int e = 0; e < static_cast<int>(kLedgerMaxDevices); ++e) {
    uint8_t uuid[16], dev[16];
    if (!f->readyUuid(e, uuid)) continue;
    uint64_t limit = 0;
    for (size_t d = 0; d < devices_.size(); ++d)
      if (parseGpuUuid(devices_[d].uuid, dev) && std::memcmp(dev, uuid, 16) == 0) limit = sh.charge[d];
    if (f->limit(e) != limit) f->setLimit(e, limit);
  }
}

// Each tick: what a former ledger's processes hold only shrinks (charge and limit follow it down);
// once its last process is gone it is deleted and no longer charged.
// The tenant's own ledger's limits follow (raised by what the former ledgers no longer hold): the
// broker's own change, made here so that the watchdog does not report it as tampering.
void Broker::watchShadowsLocked(TenantState* t) {
  bool changed = false;
  for (auto it = t->shadows.begin(); it != t->shadows.end();) {
    TenantState::Shadow& sh = *it;
    bool empty = false;
    const bool ok = guarded([&] {
      sh.ledger->reapDead();
      empty = sh.ledger->slots().empty();
      for (size_t d = 0; d < devices_.size() && !empty; ++d) {
        uint8_t uuid[16];
        parseGpuUuid(devices_[d].uuid, uuid);
        const int e = entryOf(*sh.ledger, uuid, nullptr);
        const uint64_t now = std::min(sh.charge[d], e >= 0 ? sh.ledger->used(e) : 0);
        changed = changed || now != sh.charge[d];
        sh.charge[d] = now;
        if (e >= 0 && sh.ledger->limit(e) != sh.charge[d]) sh.ledger->setLimit(e, sh.charge[d]);
      }
    });
    if (ok && !empty) shadowLimitsLocked(sh);
    if (ok && !empty) {
      ++it;
      continue;
    }
    CUSHARE_BLOG(info, "tenant {}: former ledger {} {}", t->name, sh.fileName,
                 ok ? "has no process left: deleted, no longer charged" : "became unreadable: no longer charged");
    if (ok && !sh.fileName.empty()) ::unlink((ledgerDir_ + "/" + sh.fileName).c_str());
    it = t->shadows.erase(it);
    stateDirty_ = true;
    changed = true;
  }
  if (changed) applyLimitsLocked(t, /*watchdog=*/false);
}

// A former ledger of t found in the directory: charged to t again if it is the file the state
// file recorded (or already is). False: not one of t's.
bool Broker::reattachLocked(TenantState* t, const std::string& file) {
  for (const TenantState::Shadow& sh : t->shadows)
    if (sh.fileName == file) return true;
  struct stat st;
  if (::lstat((ledgerDir_ + "/" + file).c_str(), &st) != 0 || !keptFileLocked(t->name, file, st)) return false;
  std::string err;
  auto l = Ledger::open(ledgerDir_, t->name, observing(file), &err);
  if (!l) {
    CUSHARE_BLOG(error, "ledger {}: {}", file, err);
    return true;  // recorded, unusable now: tried again at the next scan
  }
  CUSHARE_BLOG(info, "tenant {}: former ledger {} found again; what its processes hold counts against the tenant",
               t->name, file);
  attachShadowLocked(t, std::move(l), file);
  applyLimitsLocked(t);
  stateDirty_ = true;
  return true;
}

}  // namespace cushare::broker
