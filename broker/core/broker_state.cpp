// What the broker keeps in its state file beyond live limits (overrides.h): the ledger directory
// it belongs to, the limits tenants last had (ceilings of tenants that left the configuration),
// the files it renamed. See broker.h.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "core/broker.h"
#include "core/bus_guard.h"
#include "core/devices.h"
#include "core/ledger_files.h"
#include "core/log.h"

namespace cushare::broker {

bool Broker::loadStateFor(const Config& c, BrokerState* s, std::string* err) const {
  if (!loadState(c.stateFile, s, err)) return false;
  if (!s->ledgerDir.empty() && s->ledgerDir != c.ledgerDir) {
    *err = "state_file " + c.stateFile + " belongs to the broker of ledger_dir " + s->ledgerDir + ", not " +
           c.ledgerDir + ": its live limits are not this broker's; give this broker a state_file of its own";
    return false;
  }
  return true;
}

bool Broker::keptFileLocked(const std::string& tenant, const std::string& file, const struct stat& st) const {
  for (const KeptFile& f : state_.files)
    if (f.tenant == tenant && f.file == file && f.dev == static_cast<uint64_t>(st.st_dev) &&
        f.ino == static_cast<uint64_t>(st.st_ino))
      return true;
  return false;
}

void Broker::ceilingFromRecordLocked(TenantState* t, bool required) {
  const auto rec = state_.last.find(t->name);
  const bool have = rec != state_.last.end();
  if (!have && !required) return;
  t->ceiling.assign(devices_.size(), kNoLimit);
  const bool ok = guarded([&] {
    for (size_t d = 0; d < devices_.size(); ++d) {
      uint64_t last = kNoLimit;
      bool known = false;
      if (have)
        if (auto v = rec->second.find(devices_[d].uuid); v != rec->second.end()) last = v->second, known = true;
      uint8_t uuid[16];
      parseGpuUuid(devices_[d].uuid, uuid);
      const int e = t->ledger->findDevice(uuid);
      // No record and no entry: nothing says what it may have there, so nothing. An admitted
      // unknown tenant's file (not required) is its shim's, whose entries start at 0 and wait for
      // the broker: only the record counts there.
      const uint64_t now = !required ? last : e >= 0 ? t->ledger->limit(e) : known ? last : 0;
      t->ceiling[d] = std::min(last, now);
    }
  });
  if (!ok) faultLocked(t);
}

BrokerState Broker::stateLocked(const Config& c, const Overrides& o,
                                const std::map<std::string, std::vector<uint64_t>>& effective) const {
  BrokerState s;
  s.ledgerDir = c.ledgerDir;
  s.limits = o;
  s.threads = threadOverrides_;
  s.priorities = priorityOverrides_;
  for (const auto& [name, limits] : effective)
    for (size_t d = 0; d < devices_.size(); ++d) s.last[name][devices_[d].uuid] = limits[d];
  for (const auto& [name, t] : tenants_) {
    if (!effective.count(name) && !t->ceiling.empty())
      for (size_t d = 0; d < devices_.size(); ++d) s.last[name][devices_[d].uuid] = t->ceiling[d];
    struct stat st;
    if (t->ledger && t->fileName != name + kLedgerSuffix && t->ledger->fileStat(&st))
      s.files.push_back({name, t->fileName, static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino)});
    for (const TenantState::Shadow& sh : t->shadows)
      if (!sh.fileName.empty() && sh.ledger->fileStat(&st))
        s.files.push_back({name, sh.fileName, static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino)});
  }
  return s;
}

std::map<std::string, std::vector<uint64_t>> Broker::configuredLocked() const {
  std::map<std::string, std::vector<uint64_t>> configured;
  for (const auto& [name, ts] : tenants_)
    if (ts->source == "config") configured[name] = ts->configured;
  return configured;
}

bool Broker::saveStateLocked(std::string* err) {
  const BrokerState s =
      stateLocked(config_, overrides_, effectiveLimitsLocked(config_, configuredLocked(), overrides_));
  stateDirty_ = false;
  if (s == state_) return true;
  if (!saveState(config_.stateFile, s, err)) {
    stateDirty_ = true;
    return false;
  }
  state_ = s;
  return true;
}

}  // namespace cushare::broker
