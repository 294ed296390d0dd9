// See broker.h.
#include "core/broker.h"
#include "core/probes.h"

#include <dirent.h>
#include <fcntl.h>
#include <grp.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <set>
#include <functional>

#include "core/bus_guard.h"
#include "core/devices.h"
#include "core/ledger_files.h"
#include "core/log.h"
#include "core/places.h"
#include "cushare/host_segment.h"
#include "cushare/limits_file.h"
#include "cushare/parse.h"

namespace cushare::broker {
namespace {

// The one bounded wait per tick for ledgers whose flock another process holds (a tenant's process
// holds it for microseconds while it initialises; a hostile one may hold it forever).
constexpr auto kFlockWait = std::chrono::milliseconds(100);
constexpr char kLockPending[] = "its ledger is locked (flock) by another process; the broker retries";

// Waits, together and at most kFlockWait, until no other process holds the flock of these files.
void waitForFlocks(const std::vector<std::string>& paths) {
  std::vector<int> fds;
  for (const std::string& p : paths) {
    const int fd = ::open(p.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    struct stat st;
    if (fd >= 0 && ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) fds.push_back(fd);
    else if (fd >= 0) ::close(fd);
  }
  const auto deadline = std::chrono::steady_clock::now() + kFlockWait;
  while (!fds.empty() && std::chrono::steady_clock::now() < deadline) {
    for (auto it = fds.begin(); it != fds.end();) {
      if (::flock(*it, LOCK_SH | LOCK_NB) != 0) {
        ++it;
        continue;
      }
      ::close(*it);  // drops the shared lock too
      it = fds.erase(it);
    }
    if (!fds.empty()) ::usleep(1000);
  }
  for (int fd : fds) ::close(fd);
}

std::string sysErr(const std::string& what) { return what + ": " + std::strerror(errno); }

std::string describeLimit(uint64_t v) { return v == kNoLimit ? "none" : formatSize(v); }

// The settings of a tenant admitted under the unknown-tenant profile.
Tenant unknownTenantConfig(const Config& c, const std::string& name) {
  Tenant t;
  t.name = name;
  for (const Profile& p : c.profiles) {
    if (p.name != c.unknownTenantsProfile) continue;
    t.profile = p.name;
    t.memory = p.memory;
    t.threadPercentage = p.threadPercentage;
    t.priority = p.priority.value_or(Priority::kNormal);
    t.weight = p.weight.value_or(1);
  }
  return t;
}

// Live limits of tenants the configuration no longer has (and that are not admitted as unknown
// tenants either) are dropped.
// Live limits of tenants the configuration no longer knows (memory, compute cap, priority).
template <class Map>
void dropStaleOverrides(const Config& c, const std::map<std::string, std::vector<uint64_t>>& configured,
                        Map* o) {
  for (auto it = o->begin(); it != o->end();) {
    const bool known = configured.count(it->first) != 0 || !c.unknownTenantsProfile.empty();
    if (!known) CUSHARE_BLOG(warn, "dropping the live limits of tenant {}, no longer configured", it->first);
    it = known ? std::next(it) : o->erase(it);
  }
}

// Tenants reach their own ledger by name but cannot list the others (no read bit). With an
// unknown-tenant profile they may also create their ledger (write bit), and the sticky bit keeps
// them from removing or renaming anyone else's.
mode_t directoryMode(const Config& c) { return c.unknownTenantsProfile.empty() ? 0711 : 01733; }

}  // namespace

Broker::Broker(std::string configPath, std::vector<DeviceInfo> devices)
    : configPath_(std::move(configPath)), devices_(std::move(devices)) {
  startedUnix_ = static_cast<double>(std::time(nullptr));
}

Broker::~Broker() = default;

bool Broker::resolveAdmin(const Config& c, std::optional<gid_t>* gid, std::string* err) const {
  gid->reset();
  if (c.adminGroup.empty()) return true;
  struct group g, *found = nullptr;
  std::vector<char> buf(16384);
  const int r = ::getgrnam_r(c.adminGroup.c_str(), &g, buf.data(), buf.size(), &found);
  if (r != 0 || found == nullptr) {
    *err = c.file + ": admin_group: no group named '" + c.adminGroup + "' on this host";
    return false;
  }
  *gid = g.gr_gid;
  return true;
}

bool Broker::limitsFor(const Config& c, const MemorySpec& spec, std::vector<uint64_t>* out,
                       std::string* err) const {
  return resolveMemory(c, spec, devices_, out, err);
}

uint64_t Broker::expectedLocked(const TenantState& t, size_t device, bool reclaim) const {
  uint64_t v = t.configured[device];
  if (auto it = overrides_.find(t.name); it != overrides_.end())
    if (auto d = it->second.find(devices_[device].uuid); d != it->second.end()) v = d->second;
  // A plain burster past its reclaim deadline: held to its guarantee until the reclaim is over.
  if (reclaim && device < t.reclaimClamp.size()) v = std::min(v, t.reclaimClamp[device]);
  return device < t.ceiling.size() ? std::min(v, t.ceiling[device]) : v;
}

uint64_t Broker::ledgerLimitLocked(const TenantState& t, size_t device) const {
  const uint64_t v = expectedLocked(t, device);
  if (v == kNoLimit) return v;
  uint64_t charged = 0;
  for (const TenantState::Shadow& sh : t.shadows) charged += sh.charge[device];
  return charged >= v ? 0 : v - charged;
}

std::map<std::string, std::vector<uint64_t>> Broker::effectiveLimitsLocked(
    const Config& c, const std::map<std::string, std::vector<uint64_t>>& configured,
    const Overrides& o) const {
  std::map<std::string, std::vector<uint64_t>> eff = configured;
  for (const Tenant& t : c.tenants) {
    auto it = o.find(t.name);
    if (it == o.end()) continue;
    for (size_t d = 0; d < devices_.size(); ++d)
      if (auto v = it->second.find(devices_[d].uuid); v != it->second.end()) eff[t.name][d] = v->second;
  }
  return eff;
}

// The configuration checks the configured limits; live overrides must fit beside them too.
bool Broker::checkEffective(const Config& c, const std::map<std::string, std::vector<uint64_t>>& limits,
                            const std::vector<uint64_t>& unknown, std::string* err) const {
  // Per memory group: a GPU, or a GPU instance whose compute instances (MIG devices) share it.
  std::vector<unsigned __int128> sums(devices_.size(), 0);
  for (size_t d = 0; d < devices_.size(); ++d) {
    const size_t g = std::min(devices_[d].group(d), devices_.size() - 1);
    unsigned __int128& sum = sums[g];
    for (const Tenant& t : c.tenants) {
      uint64_t v = limits.at(t.name)[d];
      // A bursting tenant is admitted at its guarantee (below its limit, live or configured).
      if (std::vector<uint64_t> g; t.burst != BurstMode::kOff && resolveGuarantee(c, t, devices_, &g, nullptr) &&
                                   g[d] != kNoLimit)
        v = std::min(v, g[d]);
      if (v != kNoLimit) sum += v;
    }
    // The unknown tenants' pool (checkAgainstDevices refuses a profile without a limit).
    if (!c.unknownTenantsProfile.empty() && unknown[d] != kNoLimit)
      sum += static_cast<unsigned __int128>(unknown[d]) * c.maxUnknownTenants;
    if (sum > devices_[d].totalBytes) {
      *err = "the limits on " + memoryName(devices_, d) + " would add up to " +
             formatSize(static_cast<uint64_t>(std::min<unsigned __int128>(sum, UINT64_MAX))) + ", more than its " +
             formatSize(devices_[d].totalBytes) +
             " (live limits set with cushare set-limit count too, and the unknown tenants' pool; see cushare tenants)";
      return false;
    }
  }
  return true;
}

void Broker::openLedgerLocked(TenantState* t) {
  const std::string name = t->name + kLedgerSuffix;
  const std::string path = ledgerDir_ + "/" + name, removed = path + kRemovedSuffix;
  struct stat st;
  const bool exists = ::lstat(path.c_str(), &st) == 0;
  if (exists && !S_ISREG(st.st_mode)) {
    // A link or anything else planted under a ledger's name: never follow or reuse it.
    CUSHARE_BLOG(warn, "tenant {}: {} is not a regular file: removing it", t->name, path);
    ::unlink(path.c_str());
  } else if (!exists && ::lstat(removed.c_str(), &st) == 0 && S_ISREG(st.st_mode) &&
             keptFileLocked(t->name, name + kRemovedSuffix, st)) {
    // A tenant removed earlier is configured again: its running processes' ledger comes back
    // (only the file the broker renamed itself, as the state file recorded it).
    ::rename(removed.c_str(), path.c_str());
  }
  LedgerOpenOptions o;
  o.createDir = false;
  o.claimSlot = false;
  o.ownerUid = t->config.uid ? static_cast<int>(*t->config.uid) : -1;
  o.ownerGid = t->config.gid ? static_cast<int>(*t->config.gid) : -1;
  o.mode = t->config.gid ? 0660 : 0600;
  bool busy = false;
  o.busy = &busy;
  std::string err;
  t->ledger = Ledger::open(ledgerDir_, t->name, o, &err);
  t->fileName = name;
  t->entryDevice.clear();
  t->lockBusy = busy;
  if (busy) {
    if (!t->lockHeld) t->error = kLockPending;  // reported after the tick's bounded wait
  } else if (!t->ledger) {
    t->lockHeld = false;
    noteError(t, err);
  } else {
    t->lockHeld = false;
    claimChargeLocked(t);
  }
}

// The broker's own slot in the ledger, for the memory it charges (hidden_memory.cpp), taken as soon
// as the ledger is open: before the first reaping, which would otherwise take a slot an earlier
// mapping of the same file left with the broker's pid for a live process's.
void Broker::claimChargeLocked(TenantState* t) {
  if (t->ledger && !guarded([&] { t->ledger->setCharge(0, t->ledger->charge(0)); })) faultLocked(t);
}

// Gives a configured tenant's ledger the owner and mode of the configuration, through the broker's
// own descriptor. A file another user owns (created first while unknown tenants are admitted, or
// under the tenant's former uid) is not handed over, since its creator keeps a writable descriptor:
// it is renamed away (its processes stay charged to the tenant, see supersedeLocked) and a fresh
// ledger takes its name.
void Broker::ownLocked(TenantState* t) {
  if (!t->ledger) return;
  const uid_t want = t->config.uid ? static_cast<uid_t>(*t->config.uid) : ::geteuid();
  struct stat st;
  // Bounded: another user may create the name again between the rename and the creation.
  for (int attempt = 0; t->ledger && t->ledger->fileStat(&st) && st.st_uid != want; ++attempt) {
    if (attempt == 3) {
      t->ledger.reset();
      noteError(t, "its ledger " + ledgerDir_ + "/" + t->fileName + " keeps being created by uid " +
                       std::to_string(st.st_uid) + " instead of the tenant's user; it is tried again at the next scan");
      return;
    }
    supersedeLocked(t, st.st_uid);
  }
  if (!t->ledger) return;
  const int uid = static_cast<int>(want);
  const int gid = t->config.gid ? static_cast<int>(*t->config.gid) : -1;
  bool changed = false;
  std::string err;
  if (!t->ledger->setOwner(uid, gid, t->config.gid ? 0660 : 0600, &changed, &err)) {
    t->ledger.reset();
    noteError(t, err);
    return;
  }
  t->owner = want;  // the tenant's other files (its probe file) go to the same user
  if (changed)
    CUSHARE_BLOG(warn, "tenant {}: {} given mode {}{} (it had another group or mode)", t->name, t->ledger->path(),
                 t->config.gid ? "0660" : "0600", gid >= 0 ? " and group " + std::to_string(gid) : "");
}

void Broker::noteError(TenantState* t, const std::string& err) {
  if (t->error != err) CUSHARE_BLOG(error, "tenant {}: {}", t->name, err);
  t->error = err;
}
// Makes sure every device has its entry and the limit the broker expects there. A limit someone
// else wrote (a tenant can write its own ledger) is put back, with a warning; so is the UUID of an
// entry the broker saw naming a device (the tenant's running processes keep using the entry they
// found at start, so a renamed entry would escape its device's limit). An entry naming no device of
// this host gets limit 0: nothing can be allocated through it. Success clears the tenant's error
// (only this function reports errors while the ledger is open).
void Broker::applyLimitsLocked(TenantState* t, bool watchdog) {
  if (!t->ledger) return;
  // Its guarantee on each device where it bursts (the configuration was checked: it resolves).
  std::vector<uint64_t> guarantee(devices_.size(), kNoLimit);
  if (t->config.burst != BurstMode::kOff) {
    std::vector<uint64_t> g;
    std::string err;
    if (resolveGuarantee(config_, t->config, devices_, &g, &err))
      guarantee = std::move(g);
    else  // cannot happen for a checked configuration; fail safe: no bursting, its limit holds
      CUSHARE_BLOG(error, "tenant {}: {}", t->name, err);
  }
  t->guaranteeOf = guarantee;
  // Managed bursting: its shims make memory above the guarantee managed. Plain: ordinary memory
  // up to its limit, reclaimed cooperatively (elasticity.cpp): no word for its shims.
  std::vector<uint64_t> burst =
      t->config.burst == BurstMode::kManaged ? guarantee : std::vector<uint64_t>(devices_.size(), kNoLimit);
  if (burst != t->burstAbove) {
    // A guarantee set or changed (start, reload): what the device cannot evict is judged afresh
    // (hidden_memory.cpp), and an operator lowering it below what the processes hold is told.
    t->ordinarySet.assign(devices_.size(), 0);
    timespec boot{};
    ::clock_gettime(CLOCK_BOOTTIME, &boot);
    const long hz = ::sysconf(_SC_CLK_TCK);
    t->burstSinceTicks = static_cast<uint64_t>(boot.tv_sec) * static_cast<uint64_t>(hz > 0 ? hz : 100) +
                         static_cast<uint64_t>(boot.tv_nsec) / (1000000000ull / static_cast<uint64_t>(hz > 0 ? hz : 100));
    for (size_t d = 0; d < devices_.size() && !t->burstAbove.empty(); ++d)
      if (burst[d] != kNoLimit && d < t->deviceHeld.size() && t->deviceHeld[d] > burst[d])
        CUSHARE_BLOG(warn,
                     "tenant {} device {}: its processes hold {} the device cannot evict, above its new guarantee of "
                     "{}: the memory admission now counts as free is not free until they release it (restart "
                     "them); their new allocations above the guarantee are managed memory",
                     t->name, devices_[d].name(), formatSize(t->deviceHeld[d]), formatSize(burst[d]));
    t->burstAbove = std::move(burst);
  }
  t->entry.assign(devices_.size(), -1);
  std::vector<std::array<uint8_t, 16>> uuids(devices_.size());
  for (size_t d = 0; d < devices_.size(); ++d) parseGpuUuid(devices_[d].uuid, uuids[d].data());
  auto deviceOf = [&](const uint8_t* u) {
    for (size_t d = 0; d < devices_.size(); ++d)
      if (std::memcmp(u, uuids[d].data(), 16) == 0) return static_cast<int>(d);
    return -1;
  };
  bool failed = false, busy = false;
  std::set<int> rewritten;  // entries whose limit or UUID someone else wrote (the watchdog's finds)
  // What the tenant's processes enforce (limits_file.h): which device each entry is and its limit,
  // where the tenant cannot write. Its published entries are the broker's earlier judgement (a
  // restarted broker's too), trusted over the ledger's UUIDs.
  LimitsFile* limits = limitsOfLocked(t->ledger.get(), t->name);
  std::map<int, uint64_t> wants;  // entry -> the limit the broker put there
  // Per device: the entry its processes count in, the first published one naming it (as a shim
  // finds it, LimitsFile::find); -1 where none is published yet.
  std::vector<int> primary(devices_.size(), -1);
  for (int e = static_cast<int>(kLedgerMaxDevices) - 1; limits != nullptr && e >= 0; --e)
    if (uint8_t u[16]; limits->readyUuid(e, u))
      if (const int d = deviceOf(u); d >= 0) primary[static_cast<size_t>(d)] = e;
  const bool ok = guarded([&] {
    // first: an entry the broker has not seen before (a shim of an unknown tenant adds its entries
    // at 0 and waits for the broker to set them); only a limit above the one due is tampering.
    auto enforce = [&](int e, const std::string& what, uint64_t want, bool first) {
      wants[e] = want;
      const uint64_t have = t->ledger->limit(e);
      if (have == want) return;
      t->ledger->setLimit(e, want);
      if (watchdog && (!first || have > want)) {
        rewritten.insert(e);
        tamperLocked(t, "limit");
        if (std::string more; tamperLog_.allow(&more))
          CUSHARE_BLOG(warn, "tenant {} {}: the limit in its ledger was changed to {} outside the broker; restored to {}{}",
                       t->name, what, describeLimit(have), describeLimit(want), more);
      } else {
        CUSHARE_BLOG(info, "tenant {} {}: limit {} (was {})", t->name, what, describeLimit(want), describeLimit(have));
      }
    };
    for (int e = 0; e < static_cast<int>(kLedgerMaxDevices); ++e) {
      uint8_t have[16];
      // A published entry is the broker's word, whatever the ledger says now or a moment later (a
      // restarted broker's too): the tenant's processes count in it. Freed or renamed in the
      // ledger, it is written back; its device is the published one, never read again from the
      // ledger (a tenant that keeps rewriting the entry would win a re-read).
      const bool first = !t->entryDevice.count(e);
      int d = -1;
      if (uint8_t published[16]; limits != nullptr && limits->readyUuid(e, published))
        d = deviceOf(published);
      if (d >= 0) {
        const bool ready = t->ledger->deviceUuid(e, have);
        if (!ready || std::memcmp(have, uuids[static_cast<size_t>(d)].data(), 16) != 0) {
          t->ledger->restoreDeviceUuid(e, uuids[static_cast<size_t>(d)].data());
          rewritten.insert(e);
          tamperLocked(t, "uuid");
          if (std::string more; ready && tamperLog_.allow(&more))
            CUSHARE_BLOG(warn, "tenant {}: the device UUID of ledger entry {} was rewritten outside the broker; "
                         "restored to {}{}", t->name, e, devices_[static_cast<size_t>(d)].uuid, more);
          else if (!ready && tamperLog_.allow(&more))
            CUSHARE_BLOG(warn, "tenant {}: ledger entry {} was freed outside the broker; it names {} again{}",
                         t->name, e, devices_[static_cast<size_t>(d)].uuid, more);
        }
      } else if (limits != nullptr && limits->readyUuid(e, have)) {
        continue;  // published for a device this host no longer has: nothing is due there
      } else {
        if (!t->ledger->deviceUuid(e, have)) continue;
        d = deviceOf(have);
        if (auto known = t->entryDevice.find(e); known != t->entryDevice.end() && d != static_cast<int>(known->second)) {
          d = static_cast<int>(known->second);
          t->ledger->restoreDeviceUuid(e, uuids[static_cast<size_t>(d)].data());
          rewritten.insert(e);
          tamperLocked(t, "uuid");
          if (std::string more; tamperLog_.allow(&more))
            CUSHARE_BLOG(warn, "tenant {}: the device UUID of ledger entry {} was rewritten outside the broker; restored to {}{}",
                         t->name, e, devices_[static_cast<size_t>(d)].uuid, more);
        }
      }
      if (d < 0) {
        if (t->ledger->limit(e) != 0) {
          t->ledger->setLimit(e, 0);
          rewritten.insert(e);
          tamperLocked(t, "uuid");
          CUSHARE_BLOG(warn, "tenant {}: ledger entry {} names no device of this host: its limit is set to 0", t->name, e);
        }
        continue;
      }
      const size_t dev = static_cast<size_t>(d);
      t->entryDevice[e] = dev;
      // The first, as processes find it: the first published entry naming the device (the limits
      // file's), else the ledger's first (Ledger::findDevice, before the broker has published).
      if (t->entry[dev] < 0) t->entry[dev] = primary[dev] >= 0 ? primary[dev] : e;
      // A second entry naming the device is never a shim's (it adds one under flock only when none
      // is found): a tenant that wrote one would have a second budget there. Its limit is 0.
      const bool duplicate = t->entry[dev] != e;
      enforce(e, "device " + devices_[d].name() + (duplicate ? " (a second entry for it)" : ""),
              duplicate ? 0 : ledgerLimitLocked(*t, dev), first && !duplicate);
    }
    for (size_t d = 0; d < devices_.size() && !failed; ++d) {
      if (t->entry[d] >= 0) continue;
      std::string err;
      const int e = t->ledger->deviceIndex(uuids[d].data(), ledgerLimitLocked(*t, d), &err, &busy);
      // An entry the limits file published for something else is never reused (the tenant freed
      // it in its ledger between the loop above and now): tried again at the next tick.
      if (uint8_t published[16]; e >= 0 && limits != nullptr && limits->readyUuid(e, published)) {
        failed = true;
        continue;
      }
      t->entry[d] = e;
      if (t->entry[d] < 0) {
        failed = true;
        if (!busy) noteError(t, err);
        continue;
      }
      t->entryDevice[t->entry[d]] = d;
      enforce(t->entry[d], "device " + devices_[d].name(), ledgerLimitLocked(*t, d), false);
    }
  });
  if (!ok) {
    faultLocked(t);
    return;
  }
  // Published: each device's entry (a second entry naming a device never is: shims never bind it).
  if (limits != nullptr)
    for (const auto& [e, want] : wants) {
      const auto d = t->entryDevice.find(e);
      if (d == t->entryDevice.end() || t->entry[d->second] != e) continue;
      uint8_t uuid[16];
      parseGpuUuid(devices_[d->second].uuid, uuid);
      // Bursting: above its guarantee (never above the limit written now), allocations become
      // managed memory. Written before the entry is published, so a shim never sees it unset.
      // Its former ledgers' processes hold memory charged to it (their charge lowers `want` too).
      uint64_t g = d->second < t->burstAbove.size() ? t->burstAbove[d->second] : kNoLimit;
      if (g != kNoLimit)
        for (const TenantState::Shadow& sh : t->shadows) g -= std::min(g, sh.charge[d->second]);
      limits->setBurstAbove(e, g == kNoLimit ? kNoLimit : std::min(g, want));
      limits->publish(e, uuid, want);
    }
  takeBackLocked(t, rewritten);
  if (!t->ledger) return;
  t->lockBusy = busy;
  if (busy) {
    if (!t->lockHeld) t->error = kLockPending;  // reported after the tick's bounded wait
    return;
  }
  t->lockHeld = false;
  if (failed) return;
  if (!t->error.empty()) CUSHARE_BLOG(info, "tenant {}: ledger {} is usable again", t->name, t->ledger->path());
  t->error.clear();
}

void Broker::tamperLocked(TenantState* t, const std::string& kind) { ++t->tamper[kind]; }

LimitsFile* Broker::limitsOfLocked(Ledger* l, const std::string& tenant) {
  if (l == nullptr) return nullptr;
  if (LimitsFile* f = l->limitsFile()) return f;
  std::string err;
  auto f = LimitsFile::openForBroker(ledgerDir_, l->fileIno(), tenant, &err);
  if (!f) {
    // Its processes find no limits and allocate nothing (they wait, then deny): fail closed.
    CUSHARE_BLOG(error, "tenant {}: {}; its processes can allocate nothing until it can be written", tenant, err);
    return nullptr;
  }
  l->attachLimits(std::move(f));
  return l->limitsFile();
}

void Broker::collectLimitsFilesLocked(const std::set<uint64_t>& named) {
  std::set<uint64_t> held;
  for (const auto& [name, t] : tenants_) {
    if (t->ledger) held.insert(t->ledger->fileIno());
    for (const TenantState::Shadow& sh : t->shadows)
      if (sh.ledger) held.insert(sh.ledger->fileIno());
  }
  // Kept: a file of a ledger the broker holds, or of any file named in the directory (a ledger it
  // has not adopted yet, or dropped for a moment, as a truncated one: its processes map the file,
  // and the broker takes it up again when it opens the ledger). Only a file whose ledger is both
  // nameless and let go of goes: no new process can find that ledger any more.
  std::set<uint64_t> keep = held;
  keep.insert(named.begin(), named.end());
  const std::string dir = ledgerDir_ + "/" + kLimitsDirName;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return;
  while (const dirent* e = ::readdir(d)) {
    char* end = nullptr;
    const unsigned long long ino = std::strtoull(e->d_name, &end, 10);
    if (e->d_name[0] < '0' || e->d_name[0] > '9' || *end != '\0' || keep.count(ino)) continue;
    ::unlinkat(::dirfd(d), e->d_name, 0);  // its ledger is gone: no process can map it any more
  }
  ::closedir(d);
}

// A limit or device UUID rewritten in a tenant's ledger is put back within a tick (above), but what
// its processes allocated past the limit in between would stay on the device. With tamper_response
// kill (the default) it is taken back: when an entry's usage exceeds its restored limit, every
// process of the tenant the device lists on that entry's device is killed (the ledger cannot say
// which allocation came in the window), and the device frees what they held. Which processes is
// the device's word, not the ledger's: a slot's pid word is the tenant's to write (an attack
// review found a tenant escaping the kill by rewriting it).
void Broker::takeBackLocked(TenantState* t, const std::set<int>& entries) {
  if (entries.empty() || config_.tamperResponse != Config::TamperResponse::kKill || !t->ledger) return;
  // The published limit (the limits file's), not the ledger's word, which the tenant can keep
  // rewriting between the broker's restoring it and reading it here (a review found that).
  std::map<int, uint64_t> limits;
  for (int e : entries)
    if (!limitOfEntryLocked(*t, e, &limits[e])) return;
  std::vector<Ledger::SlotUsage> slots;
  if (!guarded([&] { slots = t->ledger->slots(); })) {
    faultLocked(t);
    return;
  }
  for (int e : entries) {
    uint64_t used = 0;
    for (const Ledger::SlotUsage& u : slots) used += u.used[e];
    if (used <= limits[e]) continue;
    const auto dev = t->entryDevice.find(e);
    if (dev == t->entryDevice.end() || dev->second >= 64) continue;
    for (auto& [pid, p] : deviceProcesses_) {
      // Only the tenant's own processes on that device: attributed through its ledger (not a
      // former one, whose creator is another user) and running as its user.
      if (p.tenant != t->name || p.viaFormer || (p.devices >> dev->second & 1) == 0 || p.killTried ||
          !ofTenantsUser(*t, pid))
        continue;
      p.killTried = true;
      const bool killed = killProcessIfStill(pid, p.startTime);
      if (killed) tamperLocked(t, "killed");
      CUSHARE_BLOG(warn,
                   "tenant {}: ledger entry {} holds {} past its restored limit {}: pid {} {} (tamper_response: "
                   "kill), so the device frees what it allocated while the limit was rewritten",
                   t->name, e, formatSize(used), describeLimit(limits[e]), pid,
                   killed ? "killed" : "could not be killed (gone already?)");
    }
  }
}

// A ledger whose mapping faulted (its file was truncated): drop the mapping; the next scan opens
// the file again (and refuses it, or finds it re-initialised, like any ledger).
void Broker::faultLocked(TenantState* t) {
  t->ledger.reset();
  t->entry.clear();
  t->entryDevice.clear();
  noteError(t, "its ledger " + ledgerDir_ + "/" + t->fileName +
                   " became unreadable (truncated by a process of the tenant?); it is opened again at the next scan");
}
uint32_t Broker::unknownAdoptedLocked() const {
  uint32_t n = 0;
  for (const auto& [name, t] : tenants_) n += t->source == "unknown-tenant" ? 1 : 0;
  return n;
}

bool Broker::writeHostLocked(std::string* err) { return writeHostFor(config_, unknownLimits_, generation_, err); }

// While max_unknown_tenants are adopted the segment offers new unknown tenants no memory (limit
// 0): a shim creating one more ledger then denies its allocations at once, before the broker's
// scan refuses the file.
bool Broker::writeHostFor(const Config& c, const std::vector<uint64_t>& unknown, uint64_t generation,
                          std::string* err) {
  const bool full = unknownAdoptedLocked() >= c.maxUnknownTenants;
  HostInfo h;
  h.brokerPid = static_cast<uint32_t>(::getpid());
  h.configGeneration = generation;
  h.profileForUnknown = !c.unknownTenantsProfile.empty();
  h.unknownProfile = c.unknownTenantsProfile;
  static_assert(static_cast<uint32_t>(MeteringSource::kEvents) == kHostMeteringEvents &&
                static_cast<uint32_t>(MeteringSource::kCupti) == kHostMeteringCupti &&
                static_cast<uint32_t>(MeteringSource::kAuto) == kHostMeteringAuto);
  h.metering = static_cast<uint32_t>(c.compute.meteringSource);
  // Checked at start (checkPlaces) and at each reload (refused there); a library that no longer
  // passes when the segment is written again is not offered (the shims meter with events), never
  // handed on unchecked.
  if (std::string why; !checkCuptiLibrary(c, &h.cuptiLibrary, &why)) {
    h.cuptiLibrary.clear();
    if (why != cuptiRefused_) CUSHARE_BLOG(warn, "{}: tenant processes meter with events", why);
    cuptiRefused_ = why;
  } else {
    cuptiRefused_.clear();
  }
  for (size_t d = 0; d < devices_.size(); ++d) {
    HostDevice hd;
    parseGpuUuid(devices_[d].uuid, hd.uuid);
    hd.capacity = devices_[d].totalBytes;
    hd.unknownLimit = h.profileForUnknown && !full ? unknown[d] : 0;
    h.devices.push_back(hd);
  }
  if (!writeHostSegment(ledgerDir_, h, err)) return false;
  if (full != unknownFull_ && h.profileForUnknown)
    CUSHARE_BLOG(info, "unknown tenants: {} max_unknown_tenants ({}); new ones get {}", full ? "at" : "below again",
                 c.maxUnknownTenants, full ? "no memory until one goes" : "the profile's limits");
  unknownFull_ = full;
  return true;
}

void Broker::refuseUnknownLocked(const std::string& name, const std::string& file, const struct stat& st,
                                 const std::string& why) {
  refused_[file] = static_cast<uint64_t>(st.st_ino);
  ++unknownRefused_;
  // Any user who may write the ledger directory can cause this line: within a budget.
  if (std::string more; refusedLog_.allow(&more))
    CUSHARE_BLOG(warn, "ledger {} (uid {}): refused, {}; not adopted (its processes get no memory) until the "
                 "file is removed{}", file, st.st_uid, why, more);
  if (file != name + kLedgerSuffix) return;
  // The shim created it with the unknown-tenant profile's limit: set every device to 0, once,
  // through a descriptor held only for this.
  std::string err;
  auto l = Ledger::open(ledgerDir_, name, observing(file), &err);
  if (!l) return;
  guarded([&] {
    for (size_t d = 0; d < devices_.size(); ++d) {
      uint8_t uuid[16];
      parseGpuUuid(devices_[d].uuid, uuid);
      const int e = l->deviceIndex(uuid, 0, &err);
      if (e >= 0) l->setLimit(e, 0);
    }
  });
}

void Broker::adoptLocked(const std::string& name, const std::string& fileName, const struct stat& st,
                         std::vector<std::string>* busy) {
  const bool removedFile = fileName != name + kLedgerSuffix;
  const bool admitted = !config_.unknownTenantsProfile.empty() && !removedFile;
  if (admitted) {
    uint32_t all = 0, mine = 0;
    for (const auto& [n, t] : tenants_) {
      if (t->source != "unknown-tenant") continue;
      ++all;
      mine += t->owner == st.st_uid ? 1 : 0;
    }
    if (all >= config_.maxUnknownTenants)
      return refuseUnknownLocked(name, fileName, st,
                                 "max_unknown_tenants (" + std::to_string(config_.maxUnknownTenants) + ") reached");
    if (mine >= config_.maxUnknownTenantsPerUid)
      return refuseUnknownLocked(name, fileName, st, "max_unknown_tenants_per_uid (" +
                                 std::to_string(config_.maxUnknownTenantsPerUid) + ") reached for uid " +
                                 std::to_string(st.st_uid));
  }
  auto t = std::make_unique<TenantState>();
  t->name = name;
  t->fileName = fileName;
  t->owner = st.st_uid;
  t->source = admitted ? "unknown-tenant" : "removed";
  t->configured = admitted ? unknownLimits_ : std::vector<uint64_t>(devices_.size(), kNoLimit);
  if (admitted) t->config = unknownTenantConfig(config_, name);
  LedgerOpenOptions o = observing(fileName);
  bool locked = false;
  o.busy = &locked;
  std::string err;
  t->ledger = Ledger::open(ledgerDir_, name, o, &err);
  if (locked && busy != nullptr && adoptErrors_.count(fileName) == 0) {
    busy->push_back(ledgerDir_ + "/" + fileName);  // being initialised, probably: wait once first
    return;
  }
  if (!t->ledger) {
    // Not retried until the file changes name or the broker restarts: logged once, within the
    // budget of lines other users can cause (any user may write files into a 1733 ledger_dir).
    if (std::string more; adoptErrors_[fileName] != err && refusedLog_.allow(&more))
      CUSHARE_BLOG(error, "ledger {}: {}{}", fileName, err, more);
    adoptErrors_[fileName] = err;
    return;
  }
  adoptErrors_.erase(fileName);
  // A tenant that left the configuration keeps at most what it last had (the state file's record,
  // and its ledger's limit); a removed one with neither gets nothing new.
  ceilingFromRecordLocked(t.get(), /*required=*/!admitted);
  claimChargeLocked(t.get());
  if (!t->ledger) return;
  if (admitted) {
    CUSHARE_BLOG(info, "tenant {}: adopted (unknown tenant, profile {})", name, config_.unknownTenantsProfile);
  } else if (!removedFile) {
    retireLocked(t.get());
  }
  // An unknown tenant's file is its own shim's, whose entries start at 0: one above its due limit
  // was written by something else, and is tampering (taken back as such).
  applyLimitsLocked(t.get(), /*watchdog=*/admitted);
  tenants_[name] = std::move(t);
}

void Broker::retireLocked(TenantState* t) {
  if (t->source != "removed")
    CUSHARE_BLOG(info, "tenant {}: removed; its running processes keep their ledger until they exit", t->name);
  t->source = "removed";
  // Renamed, not unlinked: new processes are refused (no file by the tenant's name), and if the
  // tenant is configured again the same file, with its running processes, comes back.
  const std::string path = ledgerDir_ + "/" + t->name + kLedgerSuffix;
  if (t->fileName == t->name + kLedgerSuffix && ::rename(path.c_str(), (path + kRemovedSuffix).c_str()) == 0) {
    t->fileName += kRemovedSuffix;
    stateDirty_ = true;  // a renamed file is trusted again after a restart only if recorded
  }
}

// Reads and checks the configuration file: everything start, check and reload need before they
// may change anything.
bool Broker::prepare(Prepared* out, std::string* err) const {
  Config& c = out->config;
  if (!loadConfig(configPath_, &c, err) || !checkAgainstDevices(c, devices_, err)) return false;
  if (!resolveAdmin(c, &out->adminGid, err)) return false;
  for (const Tenant& t : c.tenants)
    if (!limitsFor(c, t.memory, &out->configured[t.name], err)) return false;
  out->unknown.assign(devices_.size(), kNoLimit);
  for (const Profile& p : c.profiles)
    if (p.name == c.unknownTenantsProfile && !limitsFor(c, p.memory, &out->unknown, err)) return false;
  return true;
}

bool Broker::check(std::string* err) const {
  Prepared p;
  BrokerState st;
  if (!prepare(&p, err) || !checkPlaces(p.config, err) || !checkLedgerOwners(p.config, err) ||
      !loadStateFor(p.config, &st, err))
    return false;
  struct stat ls;
  if (::lstat(p.config.ledgerDir.c_str(), &ls) == 0 && ls.st_uid != ::geteuid())
    CUSHARE_BLOG(warn, "ledger_dir {} belongs to uid {}: the broker will move it aside, unread, when it starts",
                 p.config.ledgerDir, ls.st_uid);
  std::lock_guard<std::mutex> g(mu_);
  return checkEffective(p.config, effectiveLimitsLocked(p.config, p.configured, st.limits), p.unknown, err);
}

namespace {

// Weights among MPS clients act only with compute.mps_weights on (docs/compute.md, "Weights under
// MPS"): an operator who configured different weights with MPS on (or auto) is told once per
// load. The weights compared are the tenants' and, with unknown tenants admitted, their
// profile's.
void noteWeightsUnderMps(const Config& c) {
  if (c.mps.mode == MpsConfig::Mode::kOff || !c.compute.fairShare || c.compute.mpsWeights) return;
  std::set<uint32_t> weights;
  for (const Tenant& t : c.tenants) weights.insert(t.weight);
  if (!c.unknownTenantsProfile.empty()) weights.insert(unknownTenantConfig(c, "").weight);
  if (weights.size() < 2) return;
  CUSHARE_BLOG(warn, "tenants' weights differ, but with MPS {} they do not gate MPS clients (compute.mps_weights "
               "is off): clients share the SMs they both reach side by side, whatever their weights "
               "(docs/compute.md, \"Weights under MPS\")",
               c.mps.mode == MpsConfig::Mode::kAuto ? "on where it runs (mps: auto)" : "on");
}

}  // namespace

bool Broker::start(std::string* err) {
  Prepared p;
  if (!prepare(&p, err)) return false;
  const Config& c = p.config;
  std::optional<gid_t>& admin = p.adminGid;
  std::map<std::string, std::vector<uint64_t>>& configured = p.configured;
  std::vector<uint64_t>& unknown = p.unknown;
  BrokerState state;
  if (!checkPlaces(c, err) || !checkLedgerOwners(c, err) || !loadStateFor(c, &state, err)) return false;
  Overrides o = state.limits;
  dropStaleOverrides(c, configured, &o);
  dropStaleOverrides(c, configured, &state.threads);
  dropStaleOverrides(c, configured, &state.priorities);
  if (!checkEffective(c, effectiveLimitsLocked(c, configured, o), unknown, err)) return false;
  if (!prepareLedgerDir(c, err)) return false;

  std::lock_guard<std::mutex> g(mu_);
  config_ = c;
  noteWeightsUnderMps(c);
  adminGid_ = admin;
  ledgerDir_ = c.ledgerDir;
  overrides_ = std::move(o);
  threadOverrides_ = state.threads;
  priorityOverrides_ = state.priorities;
  unknownLimits_ = unknown;
  state_ = std::move(state);  // the records of the last run, for the ledgers found below
  generation_ = 1;
  for (const Tenant& t : c.tenants) {
    auto ts = std::make_unique<TenantState>();
    ts->name = t.name;
    ts->source = "config";
    ts->config = t;
    ts->configured = configured[t.name];
    openLedgerLocked(ts.get());
    ownLocked(ts.get());
    // Its former ledgers still in use are charged before its limit is written (no window).
    for (const KeptFile& f : state_.files)
      if (f.tenant == t.name && f.file.find(kReplacedInfix) != std::string::npos) reattachLocked(ts.get(), f.file);
    applyLimitsLocked(ts.get());
    tenants_[t.name] = std::move(ts);
  }
  std::vector<std::string> busy;  // retried by the reaper's first tick, after its bounded wait
  tickLocked(true, &busy);  // adopts (or retires) the ledgers of tenants not in the configuration
  if (!saveStateLocked(err) || !writeHostLocked(err)) return false;
  if (::chmod(ledgerDir_.c_str(), directoryMode(c)) != 0) {
    *err = sysErr("cannot set the mode of ledger_dir " + ledgerDir_);
    return false;
  }
  CUSHARE_BLOG(info, "started: {} tenants, {} devices, ledger_dir {}, generation {}", c.tenants.size(),
               devices_.size(), ledgerDir_, generation_);
  return true;
}

bool Broker::reload(std::string* err) {
  auto refuse = [&](const std::string& why) {
    std::lock_guard<std::mutex> g(mu_);
    ++reloadsRefused_;
    *err = "reload refused, the running configuration is unchanged: " + why;
    CUSHARE_BLOG(error, "{}", *err);
    return false;
  };
  Prepared p;
  std::string why;
  if (!prepare(&p, &why)) return refuse(why);
  const Config& c = p.config;
  // The places that may change on reload and are checked at start: the CUPTI library tenants load.
  if (std::string cupti; !checkCuptiLibrary(c, &cupti, &why)) return refuse(why);
  if (!checkLedgerOwners(c, &why)) return refuse(why);
  const std::optional<gid_t>& admin = p.adminGid;
  const std::map<std::string, std::vector<uint64_t>>& configured = p.configured;
  const std::vector<uint64_t>& unknown = p.unknown;

  std::unique_lock<std::mutex> g(mu_);
  auto fixed = [&](const char* key, bool same) {
    if (!same) why = std::string(key) + " cannot change on reload (restart the broker to change it)";
    return same;
  };
  if (!fixed("ledger_dir", c.ledgerDir == config_.ledgerDir) || !fixed("socket", c.socket == config_.socket) ||
      !fixed("metrics_listen", c.metricsHost == config_.metricsHost && c.metricsPort == config_.metricsPort) ||
      !fixed("state_file", c.stateFile == config_.stateFile)) {
    g.unlock();
    return refuse(why);
  }
  Overrides o = overrides_;
  dropStaleOverrides(c, configured, &o);
  const auto effective = effectiveLimitsLocked(c, configured, o);
  if (!checkEffective(c, effective, unknown, &why)) {
    g.unlock();
    return refuse(why);
  }
  // Tenants leaving the configuration keep at most what they have now (with the live limits and
  // ceilings in force before this reload).
  std::map<std::string, std::vector<uint64_t>> leaving;
  for (const auto& [name, t] : tenants_) {
    if (t->source != "config" || configured.count(name)) continue;
    for (size_t d = 0; d < devices_.size(); ++d) leaving[name].push_back(expectedLocked(*t, d, /*reclaim=*/false));
  }
  BrokerState next = stateLocked(c, o, effective);
  dropStaleOverrides(c, configured, &next.threads);
  dropStaleOverrides(c, configured, &next.priorities);
  for (const auto& [name, limits] : leaving)
    for (size_t d = 0; d < devices_.size(); ++d) next.last[name][devices_[d].uuid] = limits[d];
  const BrokerState before = state_;
  if (next != before && !saveState(c.stateFile, next, &why)) {
    g.unlock();
    return refuse(why);
  }
  // The host segment before anything else changes: a reload whose segment cannot be written is
  // refused as a whole (the state file is put back), so shims and broker never disagree.
  if (!writeHostFor(c, unknown, generation_ + 1, &why)) {
    std::string back;
    if (next != before && !saveState(c.stateFile, before, &back)) CUSHARE_BLOG(error, "{}", back);
    g.unlock();
    return refuse("the host segment could not be written: " + why);
  }
  state_ = next;

  // Committed from here on: nothing below can refuse the configuration.
  config_ = c;
  noteWeightsUnderMps(c);
  adminGid_ = admin;
  overrides_ = std::move(o);
  threadOverrides_ = next.threads;
  priorityOverrides_ = next.priorities;
  unknownLimits_ = unknown;
  ++generation_;
  if (::chmod(ledgerDir_.c_str(), directoryMode(c)) != 0)
    CUSHARE_BLOG(error, "cannot set the mode of ledger_dir {}: {}", ledgerDir_, std::strerror(errno));
  // Tenants no longer configured: admitted under the unknown-tenant profile if there is one,
  // otherwise removed; either way never above what they had.
  for (auto& [name, t] : tenants_) {
    if (auto l = leaving.find(name); l != leaving.end()) {
      if (t->ceiling.empty()) t->ceiling.assign(devices_.size(), kNoLimit);
      for (size_t d = 0; d < devices_.size(); ++d) t->ceiling[d] = std::min(t->ceiling[d], l->second[d]);
    }
    if (t->source == "removed" || configured.count(name)) continue;
    if (c.unknownTenantsProfile.empty()) {
      retireLocked(t.get());
      applyLimitsLocked(t.get());
      continue;
    }
    t->source = "unknown-tenant";
    t->config = unknownTenantConfig(c, name);
    t->configured = unknown;
    struct stat st;
    if (t->ledger && t->ledger->fileStat(&st)) t->owner = st.st_uid;  // counted per uid from now on
    applyLimitsLocked(t.get());
  }
  for (const Tenant& ct : c.tenants) {
    auto& slot = tenants_[ct.name];
    if (!slot) slot = std::make_unique<TenantState>();
    // What the tenant had before the reload, to say where the reload lifts its limit.
    std::vector<uint64_t> had;
    if (!slot->source.empty() && slot->source != "removed" && slot->configured.size() == devices_.size())
      for (size_t d = 0; d < devices_.size(); ++d) had.push_back(expectedLocked(*slot, d));
    slot->name = ct.name;
    slot->config = ct;
    slot->configured = configured.at(ct.name);
    slot->ceiling.clear();  // configured again: the configuration says what it gets
    // An unknown tenant's ledger, or a removed tenant's, is kept (with its running processes) and
    // taken over; a removed one gets its name back.
    const std::string path = ledgerDir_ + "/" + ct.name + kLedgerSuffix;
    if (slot->ledger && slot->fileName != ct.name + kLedgerSuffix &&
        ::rename((ledgerDir_ + "/" + slot->fileName).c_str(), path.c_str()) == 0)
      slot->fileName = ct.name + kLedgerSuffix;
    if (slot->ledger && slot->fileName != ct.name + kLedgerSuffix) {  // not renamed back
      CUSHARE_BLOG(warn, "tenant {}: a new {} appeared while it was removed; the processes still using {} "
                   "leave the broker's accounting", ct.name, path, slot->fileName);
      slot->ledger.reset();
    }
    slot->source = "config";
    if (!slot->ledger) openLedgerLocked(slot.get());
    ownLocked(slot.get());
    if (slot->ledger) slot->error.clear();
    applyLimitsLocked(slot.get());
    // A device dropped from a per-device map leaves the tenant unlimited there, its running
    // processes included (docs/broker-configuration.md): said, so that it is never silent.
    for (size_t d = 0; d < had.size(); ++d)
      if (had[d] != kNoLimit && expectedLocked(*slot, d) == kNoLimit)
        CUSHARE_BLOG(warn, "tenant {}: the reload lifts its memory limit on device {} (it was {} bytes): its "
                     "processes there are no longer limited (the configuration sets none there now)",
                     ct.name, devices_[d].name(), had[d]);
  }
  if (!saveStateLocked(&why)) CUSHARE_BLOG(error, "{}", why);
  CUSHARE_BLOG(info, "configuration reloaded: generation {}, {} tenants", generation_, c.tenants.size());
  return true;
}

bool Broker::setLimit(const std::string& tenant, const LimitChange& change, std::string* err) {
  const int device = change.device;
  const std::optional<MemoryAmount>& amount = change.amount;
  std::lock_guard<std::mutex> g(mu_);
  auto it = tenants_.find(tenant);
  if (it == tenants_.end() || it->second->source == "removed") {
    std::vector<std::string> names;
    for (const auto& [name, known] : tenants_)
      if (known->source != "removed") names.push_back(name);
    *err = "no tenant '" + printable(tenant, 64) + "' on this host (see cushare tenants)" + didYouMean(tenant, names);
    return false;
  }
  TenantState& t = *it->second;
  if (!t.ledger || !t.error.empty()) {
    *err = "tenant '" + tenant + "' cannot be managed: " + t.error;
    return false;
  }
  const int n = static_cast<int>(devices_.size());
  if (change.memory && (device < -1 || device >= n)) {
    *err = "device " + std::to_string(device) + " does not exist (this host has " + std::to_string(n) +
           (n == 1 ? " device: 0)" : " devices: 0.." + std::to_string(n - 1) + ")");
    return false;
  }
  Overrides o = overrides_;
  for (int d = 0; change.memory && d < n; ++d) {
    if (device != -1 && d != device) continue;
    const DeviceInfo& dev = devices_[static_cast<size_t>(d)];
    if (!amount) {
      if (o.count(tenant)) o[tenant].erase(dev.uuid);
      continue;
    }
    const uint64_t bytes = bytesOn(*amount, dev.totalBytes);
    // An unknown tenant's share is its place in the unknown tenants' pool: lower only.
    if (t.source != "config" && bytes > t.configured[static_cast<size_t>(d)]) {
      *err = "tenant '" + tenant + "' is not configured: its limit can be lowered, not raised above its " +
             describeLimit(t.configured[static_cast<size_t>(d)]) + " (configure it to give it more)";
      return false;
    }
    if (bytes > dev.totalBytes) {
      *err = "a limit of " + formatSize(bytes) + " is more than device " + devices_[d].name() + "'s " +
             formatSize(dev.totalBytes);
      return false;
    }
    o[tenant][dev.uuid] = bytes;
  }
  if (o.count(tenant) && o[tenant].empty()) o.erase(tenant);
  const auto configured = configuredLocked();
  const auto effective = effectiveLimitsLocked(config_, configured, o);
  if (!checkEffective(config_, effective, unknownLimits_, err)) return false;
  // Compute: an unknown tenant's cap and priority are its profile's at most, like its memory.
  std::map<std::string, int> threads = threadOverrides_;
  std::map<std::string, Priority> priorities = priorityOverrides_;
  if (change.resetCompute) {
    threads.erase(tenant);
    priorities.erase(tenant);
  }
  if (change.threads) {
    if (*change.threads < 1 || *change.threads > 100) {
      *err = "threads " + std::to_string(*change.threads) + " is not valid: a compute cap is a percentage from 1 to 100";
      return false;
    }
    if (t.source != "config" && t.config.threadPercentage && *change.threads > *t.config.threadPercentage) {
      *err = "tenant '" + tenant + "' is not configured: its compute cap can be lowered, not raised above its " +
             std::to_string(*t.config.threadPercentage) + "% (configure it to give it more)";
      return false;
    }
    threads[tenant] = *change.threads;
  }
  if (change.priority) {
    if (t.source != "config" && *change.priority < t.config.priority) {
      *err = "tenant '" + tenant + "' is not configured: its priority can be lowered, not raised above " +
             priorityName(t.config.priority) + " (configure it to give it more)";
      return false;
    }
    priorities[tenant] = *change.priority;
  }
  BrokerState next = stateLocked(config_, o, effective);
  next.threads = threads;
  next.priorities = priorities;
  if (next != state_ && !saveState(config_.stateFile, next, err)) return false;
  state_ = std::move(next);
  overrides_ = std::move(o);
  threadOverrides_ = std::move(threads);
  priorityOverrides_ = std::move(priorities);
  applyLimitsLocked(&t);
  return true;
}

std::optional<int> Broker::threadsLocked(const TenantState& t) const {
  const auto it = threadOverrides_.find(t.name);
  if (it == threadOverrides_.end()) return t.config.threadPercentage;
  if (t.source != "config" && t.config.threadPercentage) return std::min(it->second, *t.config.threadPercentage);
  return it->second;
}

Priority Broker::priorityLocked(const TenantState& t) const {
  const auto it = priorityOverrides_.find(t.name);
  if (it == priorityOverrides_.end()) return t.config.priority;
  // Priority orders high < normal < low: the larger is the lower priority.
  if (t.source != "config") return std::max(it->second, t.config.priority);
  return it->second;
}

bool Broker::env(const std::string& tenant, EnvInfo* out, std::string* err) const {
  std::lock_guard<std::mutex> g(mu_);
  EnvInfo e;
  e.tenant = tenant;
  e.ledgerDir = ledgerDir_;
  auto it = tenants_.find(tenant);
  if (it != tenants_.end() && it->second->source != "removed") {
    const TenantState& t = *it->second;
    e.source = t.source;
    e.threadPercentage = threadsLocked(t);
    e.priority = priorityLocked(t);
    for (size_t d = 0; d < devices_.size(); ++d) e.limits.emplace_back(devices_[d].uuid, expectedLocked(t, d));
  } else if (!config_.unknownTenantsProfile.empty()) {
    e.source = "unknown-tenant";
    for (size_t d = 0; d < devices_.size(); ++d) e.limits.emplace_back(devices_[d].uuid, unknownLimits_[d]);
    for (const Profile& p : config_.profiles) {
      if (p.name != config_.unknownTenantsProfile) continue;
      e.threadPercentage = p.threadPercentage;
      e.priority = p.priority.value_or(Priority::kNormal);
    }
  } else {
    *err = "tenant '" + tenant + "' is not configured on this host (unknown_tenants: refuse)";
    return false;
  }
  *out = std::move(e);
  return true;
}

Config Broker::config() const {
  std::lock_guard<std::mutex> g(mu_);
  return config_;
}

bool Broker::isAdmin(const Peer& p) const {
  if (p.uid == 0 || p.uid == ::geteuid()) return true;
  std::lock_guard<std::mutex> g(mu_);
  if (!adminGid_) return false;
  return p.gid == *adminGid_ || std::find(p.groups.begin(), p.groups.end(), *adminGid_) != p.groups.end();
}

TenantSnapshot Broker::tenantSnapshotLocked(TenantState* tp) {
  const TenantState& t = *tp;
  TenantSnapshot s;
  s.name = t.name;
  s.profile = t.config.profile;
  s.source = t.source;
  s.threadPercentage = threadsLocked(t);
  s.priority = priorityLocked(t);
  s.weight = t.config.weight;
  s.threadsOverridden = threadOverrides_.count(t.name) != 0;
  s.priorityOverridden = priorityOverrides_.count(t.name) != 0;
  s.ledgerPath = ledgerDir_ + "/" + t.fileName;
  s.tamper = t.tamper;
  for (size_t d = 0; d < devices_.size(); ++d)
    s.limits.push_back(d < t.configured.size() ? expectedLocked(t, d) : kNoLimit);
  if (!t.ledger) {
    s.error = t.error;
    return s;
  }
  const auto ov = overrides_.find(t.name);
  const bool ok = guarded([&] {
    for (size_t d = 0; d < devices_.size() && d < t.entry.size(); ++d) {
      const int e = t.entry[d];
      if (e < 0) continue;
      TenantDeviceSnapshot td;
      td.device = static_cast<int>(d);
      td.uuid = devices_[d].uuid;
      td.used = t.ledger->used(e);
      td.limit = t.ledger->limit(e);
      td.peak = t.ledger->peak(e);
      td.denied = t.ledger->denied(e);
      td.overridden = ov != overrides_.end() && ov->second.count(devices_[d].uuid) != 0;
      // Bursting: its guarantee (never above the limit now) and what it holds above it.
      if (d < t.guaranteeOf.size() && t.guaranteeOf[d] != kNoLimit) {
        td.guarantee = std::min(t.guaranteeOf[d], td.limit);
        td.plain = t.config.burst == BurstMode::kPlain;
        td.reclaimSeconds = d < t.reclaimSeconds.size() ? t.reclaimSeconds[d] : 0;
        td.burst = td.used > td.guarantee ? td.used - td.guarantee : 0;
        td.burstHost = d < t.burstHost.size() ? std::min(t.burstHost[d], td.burst) : 0;
        td.reclaimed = d < t.reclaimed.size() ? t.reclaimed[d] : 0;
      }
      td.hidden = d < t.hidden.size() ? t.hidden[d] : 0;
      td.leftBehind = d < t.leftBehind.size() ? t.leftBehind[d] : 0;
      computeSnapshotLocked(t.name, d, &td);
      s.devices.push_back(td);
    }
    for (const Ledger::SlotUsage& u : t.ledger->slots()) {
      if (u.pid == 0) continue;
      ProcessSnapshot p;
      p.pid = u.pid;
      p.hostPid = t.ledger->slotHolderPid(u.slot);
      p.used.assign(devices_.size(), 0);
      for (size_t d = 0; d < devices_.size() && d < t.entry.size(); ++d)
        if (t.entry[d] >= 0) p.used[d] = u.used[t.entry[d]];
      s.processes.push_back(std::move(p));
    }
  });
  if (!ok) {
    faultLocked(tp);
    s.devices.clear();
    s.processes.clear();
  }
  // Former ledgers still charged to it: their usage is the tenant's (its ledger's limit is lowered
  // by as much), and their processes are its processes.
  for (TenantDeviceSnapshot& td : s.devices)
    for (const TenantState::Shadow& sh : t.shadows) {
      const uint64_t c = sh.charge[static_cast<size_t>(td.device)];
      td.used += c;
      if (td.limit != kNoLimit) td.limit += c;
    }
  for (const TenantState::Shadow& sh : t.shadows)
    guarded([&] {
      std::vector<int> entry(devices_.size(), -1);
      for (size_t d = 0; d < devices_.size(); ++d) {
        uint8_t uuid[16];
        parseGpuUuid(devices_[d].uuid, uuid);
        entry[d] = sh.ledger->findDevice(uuid);
      }
      for (const Ledger::SlotUsage& u : sh.ledger->slots()) {
        if (u.pid == 0) continue;
        ProcessSnapshot p;
        p.pid = u.pid;
        p.used.assign(devices_.size(), 0);
        for (size_t d = 0; d < devices_.size(); ++d)
          if (entry[d] >= 0) p.used[d] = u.used[entry[d]];
        s.processes.push_back(std::move(p));
      }
    });
  s.error = t.error;
  return s;
}

void Broker::setMpsSnapshot(MpsSnapshot m) {
  std::lock_guard<std::mutex> g(mu_);
  mps_ = std::move(m);
}

void Broker::setMigLayout(BrokerSnapshot::MigLayout m) {
  std::lock_guard<std::mutex> g(mu_);
  migLayout_ = std::move(m);
}

BrokerSnapshot Broker::snapshot() {
  std::lock_guard<std::mutex> g(mu_);
  BrokerSnapshot s;
  s.version = CUSHARE_VERSION;
  s.pid = static_cast<int>(::getpid());
  s.configFile = configPath_;
  s.configGeneration = generation_;
  s.startedAt = startedUnix_;
  s.uptimeSeconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count();
  s.ledgerDir = ledgerDir_;
  s.unknownTenants = config_.unknownTenantsProfile.empty() ? "refuse" : config_.unknownTenantsProfile;
  s.metricsAddress = metricsAddress_;
  s.reapedProcesses = reaped_;
  s.reloadsRefused = reloadsRefused_;
  s.ledgersRefused = unknownRefused_;
  s.logLinesDropped = gLogLinesDropped.load(std::memory_order_relaxed);
  s.mps = mps_;
  s.migLayout = migLayout_;
  for (size_t i = 0; i < devices_.size(); ++i) {
    DeviceSnapshot d;
    d.index = devices_[i].ordinal;
    d.name = devices_[i].name();
    d.uuid = devices_[i].uuid;
    d.migIndex = devices_[i].migIndex;
    d.parentUuid = devices_[i].parentUuid;
    d.migProfile = devices_[i].profile;
    d.gpuInstance = devices_[i].gpuInstance;
    d.computeInstance = devices_[i].computeInstance;
    d.capacity = devices_[i].totalBytes;
    d.busyNs = i < deviceBusyNs_.size() ? deviceBusyNs_[i] : 0;
    if (const size_t g = std::min(devices_[i].group(i), devices_.size() - 1); g < thrash_.size()) {
      d.thrashGuard = thrash_[g].on;
      d.thrashTurns = thrash_[g].turns;
    }
    if (i < outside_.size() && outside_[i].read) {
      d.read = true;
      d.deviceUsed = outside_[i].deviceUsed;
      d.outside = outside_[i].bytes;
      d.outsidePids = outside_[i].pids;
    }
    s.devices.push_back(std::move(d));
  }
  auto add = [&](TenantState& t) {
    TenantSnapshot ts = tenantSnapshotLocked(&t);
    for (const TenantDeviceSnapshot& td : ts.devices) s.devices[static_cast<size_t>(td.device)].used += td.used;
    s.tenants.push_back(std::move(ts));
  };
  for (const Tenant& ct : config_.tenants)
    if (auto it = tenants_.find(ct.name); it != tenants_.end()) add(*it->second);
  for (const auto& [name, t] : tenants_)
    if (t->source != "config") add(*t);
  return s;
}

BrokerSnapshot Broker::snapshotWithPods() {
  std::shared_ptr<PodLabeler> labeler;
  {
    std::lock_guard<std::mutex> g(mu_);
    labeler = podLabeler_;
  }
  BrokerSnapshot s = snapshot();
  if (labeler) labeler->label(&s);  // without the broker's lock: it reads /proc
  return s;
}

void Broker::setPodLabeler(std::shared_ptr<PodLabeler> labeler) {
  std::lock_guard<std::mutex> g(mu_);
  podLabeler_ = std::move(labeler);
}

int Broker::tick(bool scanDirectory) {
  // The device's own accounting, read without the broker's lock (NVML may take milliseconds),
  // between two reads of what the ledgers show (hidden_memory.cpp says why).
  std::map<std::string, ShownSums> before, after;
  {
    std::lock_guard<std::mutex> g(mu_);
    before = shownLocked();
  }
  std::vector<std::map<int, uint64_t>> onDevice;
  std::vector<uint64_t> deviceUsed, deviceUsedHigh;
  std::vector<std::string> unread;
  std::string err;
  const bool device = processMemory(devices_, &onDevice, &err, &deviceUsed, &deviceUsedHigh, &unread);
  std::vector<std::map<int, uint64_t>> deviceBusy;
  std::string busyErr;
  const bool busyRead = device && busyReader_.read(devices_, &deviceBusy, &busyErr);
  std::vector<std::string> busy;
  int reaped = 0;
  {
    std::lock_guard<std::mutex> g(mu_);
    after = shownLocked();
    if (!device && deviceError_ != err)
      CUSHARE_BLOG(error, "the device's per-process memory cannot be read, hidden memory goes unnoticed: {}", err);
    deviceError_ = device ? "" : err;
    if (!device)
      for (OutsideDevice& o : outside_) o.read = false;
    // MIG devices that cannot be read (a layout changed under the broker): each said once, and
    // judged by nothing this tick (outside_memory.cpp, hidden_memory.cpp, left_behind.cpp).
    deviceUnread_.assign(devices_.size(), false);
    for (size_t d = 0; device && d < unread.size() && d < devices_.size(); ++d) {
      deviceUnread_[d] = !unread[d].empty();
      if (d < unreadError_.size() && unread[d] != unreadError_[d] && !unread[d].empty())
        CUSHARE_BLOG(error, "the device's per-process memory of {} cannot be read, hidden memory there goes unnoticed: {}",
                     devices_[d].name(), unread[d]);
    }
    if (device) unreadError_ = unread;
    ++ticks_;
    if (device) {
      attributeLocked(onDevice);
      checkOutsideLocked(onDevice, deviceUsed);
      publishEvictableLocked(onDevice, deviceUsed);
      checkLeftBehindLocked(onDevice, deviceUsed, deviceUsedHigh);
      if (!busyErr.empty() && busyError_ != busyErr)
        CUSHARE_BLOG(error, "the device's per-process busy time cannot be read, metering is not checked against it: {}",
                     busyErr);
      busyError_ = busyErr;
      if (busyRead) checkBusyLocked(deviceBusy);
    } else {
      for (ThrashGroup& tg : thrash_) tg.room = kNoLimit;  // unknown: the thrashing guard ends (compute.cpp)
    }
    // Reclaim of plain bursts every tick: with the device's figures when they were read (a wait is
    // believed only while the device is full), without them nobody's (so a reclaim ends and its
    // targets and clamps are lifted even while NVML cannot be read).
    reclaimLocked(device ? deviceUsed : std::vector<uint64_t>());
    reaped = tickLocked(scanDirectory, &busy);
    mpsClientsLocked();
    if (device && busy.empty()) checkHiddenLocked(onDevice, before, after);
    if (busy.empty()) checkRowsLocked(before, after);
  }
  if (busy.empty()) return reaped;
  // Ledgers whose flock another process holds: one bounded wait for all of them, then once more.
  waitForFlocks(busy);
  std::lock_guard<std::mutex> g(mu_);
  reaped += tickLocked(scanDirectory, nullptr);
  mpsClientsLocked();
  if (device) checkHiddenLocked(onDevice, before, after, false);  // NVML's figures are ~100 ms old now
  checkRowsLocked(before, after);
  return reaped;
}

int Broker::tickLocked(bool scanDirectory, std::vector<std::string>* busy) {
  int reaped = 0;
  for (auto it = tenants_.begin(); it != tenants_.end();) {
    TenantState& t = *it->second;
    if (!t.ledger && t.source == "config" && (scanDirectory || t.lockBusy)) {
      openLedgerLocked(&t);  // a ledger that failed before (damaged, locked, truncated): again
      ownLocked(&t);
    }
    bool empty = false;
    std::vector<int32_t> kept;
    const std::function<bool(int32_t)> live = [&](int32_t pid) { return liveElsewhereLocked(t, pid); };
    if (t.ledger && !guarded([&] {
          reaped += t.ledger->reapDead(&live, &kept);
          empty = t.ledger->slots().empty();
        }))
      faultLocked(&t);
    for (int32_t pid : kept)
      if (t.keptPids[pid]++ == 0) {
        tamperLocked(&t, "descriptor");
        CUSHARE_BLOG(warn, "tenant {}: process {} let go of its ledger slot's lock (closed its descriptor) but still runs "
                     "with the ledger mapped: its slot and usage are kept until it exits", t.name, pid);
      }
    for (auto k = t.keptPids.begin(); k != t.keptPids.end();)
      k = std::find(kept.begin(), kept.end(), k->first) == kept.end() ? t.keptPids.erase(k) : std::next(k);
    if (t.ledger && scanDirectory) {
      // A hard link elsewhere changes nothing for the broker (it holds the file open), but says a
      // process of the tenant is up to something.
      const int links = t.ledger->links();
      if (links > 1 && links != t.links) {
        tamperLocked(&t, "link");
        CUSHARE_BLOG(warn, "tenant {}: its ledger {} has {} hard links (made by a process of the tenant?); still managed",
                     t.name, t.ledger->path(), links);
      }
      if (links > 0) t.links = links;
    }
    if (t.source != "config" && (!t.ledger || (t.source == "removed" && empty))) {
      // Gone with its last process, or unusable: forget it (a scan adopts what is still there).
      if (t.source == "removed" && t.ledger) {
        CUSHARE_BLOG(info, "tenant {}: removed, last process gone", t.name);
        if (t.fileName != t.name + kLedgerSuffix) ::unlink((ledgerDir_ + "/" + t.fileName).c_str());
      }
      stateDirty_ = true;  // its records (last limit, renamed file) go too
      it = tenants_.erase(it);
      continue;
    }
    watchShadowsLocked(&t);
    applyLimitsLocked(&t, /*watchdog=*/true);  // removed tenants too: their processes still run
    if (t.lockBusy && busy != nullptr && !t.lockHeld) {
      busy->push_back(ledgerDir_ + "/" + t.fileName);
    } else if (t.lockBusy && !t.lockHeld) {
      t.lockHeld = true;
      t.error.clear();
      noteError(&t, "its ledger " + ledgerDir_ + "/" + t.fileName + " is locked (flock) by another process for more than " +
                        std::to_string(kFlockWait.count()) + " ms (a process of the tenant?); the broker retries every tick");
    }
    ++it;
  }
  if (scanDirectory) {
    scanLocked(busy);
    std::string err;
    if (!config_.unknownTenantsProfile.empty() &&
        (unknownAdoptedLocked() >= config_.maxUnknownTenants) != unknownFull_ &&
        !writeHostLocked(&err))
      CUSHARE_BLOG(error, "{}", err);  // tried again at the next scan
  }
  if (stateDirty_) {
    std::string err;
    if (!saveStateLocked(&err)) CUSHARE_BLOG(error, "{}", err);  // retried at the next tick
  }
  if (reaped > 0) CUSHARE_BLOG(debug, "returned the usage of {} dead processes", reaped);
  reaped_ += static_cast<uint64_t>(reaped);
  return reaped;
}

// The ledger files in the directory: adopts new ones (within the unknown tenants' caps), trusts
// renamed ones only as the state file recorded them, and forgets what is gone.
void Broker::scanLocked(std::vector<std::string>* busy) {
  DIR* dir = ::opendir(ledgerDir_.c_str());
  if (dir == nullptr) return;
  std::set<std::string> seen;
  std::vector<std::pair<std::string, std::string>> former;  // tenant, <tenant>.ledger.replaced.N
  std::set<uint64_t> named;  // inodes of every file under the directory's names
  while (const dirent* e = ::readdir(dir)) {
    const std::string file = e->d_name;
    named.insert(e->d_ino);
    const size_t at = file.find(kLedgerSuffix);
    if (at == std::string::npos || at == 0) continue;
    const std::string name = file.substr(0, at), rest = file.substr(at + std::strlen(kLedgerSuffix));
    const bool replaced = rest.rfind(kReplacedInfix, 0) == 0 && rest.size() > std::strlen(kReplacedInfix);
    if ((!rest.empty() && rest != kRemovedSuffix && !replaced) || !Ledger::validTenantName(name, nullptr)) continue;
    seen.insert(file);
    if (tenants_.count(name) && (!replaced || tenants_[name]->fileName == file)) continue;
    struct stat st;
    if (::fstatat(::dirfd(dir), file.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
    if (auto r = refused_.find(file); r != refused_.end()) {
      if (r->second == static_cast<uint64_t>(st.st_ino)) continue;  // refused already
      refused_.erase(r);
    }
    if (replaced) {
      former.emplace_back(name, file);
    } else if (rest.empty() || keptFileLocked(name, file, st)) {
      adoptLocked(name, file, st, busy);
    } else {
      refuseUnknownLocked(name, file, st, "a renamed ledger the broker has no record of");
    }
  }
  // Former ledgers of a tenant (renamed away because another user owned them) are charged to it
  // again after a restart, if the state file recorded them.
  for (const auto& [name, file] : former) {
    auto it = tenants_.find(name);
    struct stat st;
    if (it != tenants_.end() && reattachLocked(it->second.get(), file)) continue;
    if (::fstatat(::dirfd(dir), file.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
    refuseUnknownLocked(name, file, st, it == tenants_.end() ? "a former ledger of a tenant the broker no longer has"
                                                             : "a renamed ledger the broker has no record of");
  }
  // An unknown tenant's file replaced under its name (its owner may unlink it in the sticky
  // directory, and a shim then creates a new one): the new file is its ledger from now on, and
  // what the old one's processes still hold is charged against it, never a second budget.
  for (auto& [name, t] : tenants_) {
    struct stat now, mine;
    if (t->source != "unknown-tenant" || !t->ledger || t->fileName != name + kLedgerSuffix ||
        ::fstatat(::dirfd(dir), t->fileName.c_str(), &now, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(now.st_mode) ||
        !t->ledger->fileStat(&mine) || (now.st_dev == mine.st_dev && now.st_ino == mine.st_ino))
      continue;
    if (auto r = refused_.find(t->fileName); r != refused_.end() && r->second == static_cast<uint64_t>(now.st_ino))
      continue;  // refused already (below)
    // Another user's file under the name (the old one's creator removed it; the sticky directory
    // lets anyone create the name): not this tenant's, whose processes may still run. And a name
    // replaced again and again while the old files' processes hold them open: at most
    // kMaxUnknownShadows former ledgers are watched.
    if (now.st_uid != t->owner) {
      refuseUnknownLocked(name, t->fileName, now, "the name belongs to uid " + std::to_string(t->owner) +
                                                      "'s unknown tenant, whose processes still run");
      continue;
    }
    if (t->shadows.size() >= kMaxUnknownShadows) {
      refuseUnknownLocked(name, t->fileName, now, "the tenant's ledger was replaced " +
                                                      std::to_string(kMaxUnknownShadows) +
                                                      " times while the old files' processes still run");
      continue;
    }
    std::string err;
    auto fresh = Ledger::open(ledgerDir_, name, observing(t->fileName), &err);
    if (!fresh) continue;  // tried again at the next scan
    attachShadowLocked(t.get(), std::move(t->ledger), "");  // nameless: not found again after a restart
    t->ledger = std::move(fresh);
    // The new file's entries are its own: which device each names, and the hidden charge the
    // broker keeps in them (the old file's moved with it to the shadow).
    t->entryDevice.clear();
    std::fill(t->hiddenCharge.begin(), t->hiddenCharge.end(), 0);
    for (auto& seen : t->hiddenSeen) seen.fill(0);
    t->fileGone = false;
    t->owner = now.st_uid;
    applyLimitsLocked(t.get(), /*watchdog=*/true);  // as at adoption: its entries start at 0
    // Said once it holds (the new file's limits lowered by what the old one's processes hold): a
    // reader of the log may act on it at once.
    CUSHARE_BLOG(warn, "tenant {}: its ledger file was replaced (by uid {}); what the old one's processes hold "
                 "still counts against it until they exit", name, now.st_uid);
  }
  ::closedir(dir);
  collectLimitsFilesLocked(named);
  // Forget what is gone: refusals and errors by name, and unknown tenants whose file was removed.
  for (auto r = refused_.begin(); r != refused_.end();) r = seen.count(r->first) ? std::next(r) : refused_.erase(r);
  for (auto r = adoptErrors_.begin(); r != adoptErrors_.end();)
    r = seen.count(r->first) ? std::next(r) : adoptErrors_.erase(r);
  // One whose processes still hold memory (its own ledger's or a former one's) is kept, and
  // charged, until they exit: forgetting it would free its name for a new file with a whole new
  // budget while the old file's processes keep what they hold.
  for (auto it = tenants_.begin(); it != tenants_.end();) {
    TenantState& t = *it->second;
    if (t.source != "unknown-tenant" || seen.count(t.fileName)) {
      ++it;
      continue;
    }
    // Its processes: by its ledger's slots (which it can zero) and by the device's own list
    // (attributed through the ledger they map), and what the broker charges it for them.
    size_t processes = 0, onDevice = 0;
    if (t.ledger && !guarded([&] { processes = t.ledger->slots().size(); })) processes = 0;  // unreadable
    for (const auto& [pid, p] : deviceProcesses_) onDevice += p.tenant == it->first;
    uint64_t charged = 0;
    for (const uint64_t v : t.hidden) charged += v;
    for (const uint64_t v : t.leftBehind) charged += v;
    if (processes > 0 || onDevice > 0 || charged > 0 || !t.shadows.empty()) {
      if (!t.fileGone)
        CUSHARE_BLOG(warn, "tenant {}: its ledger file was removed while its processes still run ({} in its ledger, "
                     "{} on the device); kept, and what they hold still counts against it, until they exit",
                     it->first, processes, onDevice);
      t.fileGone = true;
      ++it;
      continue;
    }
    CUSHARE_BLOG(info, "tenant {}: its ledger file was removed; forgotten", it->first);
    it = tenants_.erase(it);
  }
}

std::vector<int> Broker::pids() {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<int> out;
  for (auto& [name, t] : tenants_) {
    if (!t->ledger) continue;
    std::vector<Ledger::SlotUsage> slots;
    if (!guarded([&] { slots = t->ledger->slots(); })) {
      faultLocked(t.get());
      continue;
    }
    for (const Ledger::SlotUsage& u : slots)
      if (u.pid > 0) out.push_back(u.pid);
  }
  return out;
}

void Broker::setMetricsAddress(std::string a) {
  std::lock_guard<std::mutex> g(mu_);
  metricsAddress_ = std::move(a);
}

std::string Broker::socketPath() const {
  std::lock_guard<std::mutex> g(mu_);
  return config_.socket;
}
std::string Broker::metricsHost() const {
  std::lock_guard<std::mutex> g(mu_);
  return config_.metricsHost;
}
uint16_t Broker::metricsPort() const {
  std::lock_guard<std::mutex> g(mu_);
  return config_.metricsPort;
}

}  // namespace cushare::broker
