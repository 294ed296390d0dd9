// Memory a tenant hides from its ledger, found in the device's own accounting and charged.
//
// A tenant's processes can write their ledger: zero their counters, lower slot_hwm, close the
// descriptor that holds their slot's lock (so a reaper zeroes it), and then allocate past the
// limit through the shim, which believes the ledger. The device cannot be fooled: every tick the
// broker reads NVML's per-process used memory (host pids), attributes each process to the tenant
// whose ledger file it maps (/proc/<pid>/maps, by device and inode; sticky for the process's
// life, so unmapping later hides nothing), and for each device entry of the tenant's ledger
// writes into the broker's own slot of that ledger (Ledger::setCharge) what the device holds for
// the tenant beyond what the processes' slots show (less hidden_memory_allowance per process, 0
// by default: the limit covers everything the device holds for the tenant, its CUDA contexts and
// module images included, so a tenant can hide nothing). Every reservation's sum includes that
// slot, so the tenant's admission sees its real total and denies what would pass the limit. The
// slot is rewritten every tick (the tenant can zero it). Untracked memory up to context_memory per
// process is what an honest process's context holds: charged, reported as such (info), not as
// tampering; beyond it, a warning and cushare_tenant_tamper_total{kind="hidden"}, and then each
// of the tenant's own processes (its uid, its current ledger) holding more than a context beyond
// its own slot is killed, so the device frees what it allocated in the window (kind="killed";
// which process zeroed the counters cannot be known: the ones holding the untracked memory are
// the ones taken down): with hidden_memory_response kill_past_limit (the default) while the
// device holds more for the tenant (less the allowance) than its ledger may, whether or not the
// hidden total is within its processes' contexts (so what a context larger than context_memory
// holds within the limit, which looks the same, is only charged), with kill whenever it is
// reported, with charge never. A slot is a process's by the kernel's holder of its pid lock (the
// pid word is the tenant's to write, and every container's first process is pid 1).
//
// No false charge for an honest tenant: its slots never show less than the device holds (the
// shim reserves before the driver allocates and releases after it frees), but the ledger and the
// device cannot be read at one instant. So the ledger is read just before and just after NVML and
// the larger sum is taken (an allocation made, or a free done, in between is in one of them), and
// an amount is charged only when kHiddenTicks (5) consecutive ticks found it (the smallest of
// them): an allocation that lived entirely between the two reads of one tick is seen on the device
// and in neither read, and honest churn on a loaded host did that three ticks in a row (CI, once;
// Tamper.HonestChurnIsNeverChargedAsHidden). A real hidden amount stays until it is freed, so it
// is charged within five ticks (250 ms).
//
// Pid namespaces: NVML reports host pids and the broker reads the host's /proc, so containers
// change nothing for attribution. A slot records its process's pid in the process's own
// namespace; the broker maps it through /proc/<pid>/status NSpid (the innermost pid) when it
// decides whether a slot with a free lock still has a live process (liveElsewhereLocked).
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <set>

#include "core/broker.h"
#include "core/bus_guard.h"
#include "core/log.h"
#include "cushare/parse.h"

namespace cushare::broker {
namespace {

// An unattributed process (one that maps no tenant's ledger) is looked for again this often, in
// ticks: it may map one later, or never (a GPU process that does not run under cushare).
constexpr uint64_t kLookEveryTicks = 20;

// The process's start time (/proc/<pid>/stat field 22, clock ticks since boot); 0 if it is gone or
// not visible from the broker's pid namespace. With the pid, it names one process.
uint64_t startTimeOf(int pid) {
  char path[40], buf[1024];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "re");
  if (f == nullptr) return 0;
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* p = std::strrchr(buf, ')');  // the command may contain spaces and parentheses
  if (p == nullptr) return 0;
  // After ") ": field 3 (state) ... field 22 (starttime).
  unsigned long long start = 0;
  int field = 2;
  for (const char* c = p + 1; *c != '\0'; ++c) {
    if (*c != ' ') continue;
    if (++field == 22) {
      start = std::strtoull(c + 1, nullptr, 10);
      break;
    }
  }
  return start;
}

// The process's pid in its innermost pid namespace (the last NSpid field): what the shim records
// in its slot. 0 if unknown.
int32_t innermostPidOf(int pid) {
  char path[40], line[256];
  std::snprintf(path, sizeof(path), "/proc/%d/status", pid);
  FILE* f = std::fopen(path, "re");
  if (f == nullptr) return 0;
  int32_t last = 0;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::strncmp(line, "NSpid:", 6) != 0) continue;
    for (char* c = line + 6; *c != '\0';) {
      char* end;
      const long v = std::strtol(c, &end, 10);
      if (end == c) break;
      last = static_cast<int32_t>(v);
      c = end;
    }
    break;
  }
  std::fclose(f);
  return last;
}

}  // namespace

bool Broker::ofTenantsUser(const TenantState& t, int pid) {
  char path[40], line[4096];
  std::snprintf(path, sizeof(path), "/proc/%d/status", pid);
  FILE* f = std::fopen(path, "re");
  if (f == nullptr) return false;
  bool uidKnown = false, ours = false;
  const std::optional<uint32_t> gid = t.config.gid;
  while (!ours && std::fgets(line, sizeof(line), f) != nullptr) {
    unsigned long id = 0;
    if (std::sscanf(line, "Uid: %lu", &id) == 1) {
      uidKnown = true;
      ours = static_cast<uid_t>(id) == t.owner;
    } else if (gid && std::sscanf(line, "Gid: %lu", &id) == 1) {
      ours = id == *gid;
    } else if (gid && std::strncmp(line, "Groups:", 7) == 0) {
      for (char* c = line + 7; *c != '\0' && !ours;) {
        char* end;
        const unsigned long g = std::strtoul(c, &end, 10);
        if (end == c) break;
        ours = g == *gid;
        c = end;
      }
    }
  }
  std::fclose(f);
  return uidKnown && ours;
}

bool Broker::killProcessIfStill(int pid, uint64_t startTime) {
  const int fd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  if (fd < 0) return false;
  const bool ok = startTime != 0 && startTimeOf(pid) == startTime &&
                  ::syscall(SYS_pidfd_send_signal, fd, SIGKILL, nullptr, 0) == 0;
  ::close(fd);
  return ok;
}

void Broker::attributeLocked(const std::vector<std::map<int, uint64_t>>& onDevice) {
  std::set<int> reported;
  std::map<int, uint64_t> devicesOf;
  for (size_t d = 0; d < onDevice.size(); ++d)
    for (const auto& [pid, bytes] : onDevice[d]) {
      reported.insert(pid);
      if (d < 64) devicesOf[pid] |= uint64_t{1} << d;
    }
  // A process last seen on a device that could not be read this tick (a MIG device gone after a
  // layout change) is kept while it lives: its device is not known to have let it go.
  uint64_t unreadMask = 0;
  for (size_t d = 0; d < 64 && d < devices_.size(); ++d)
    if (unreadLocked(d)) unreadMask |= uint64_t{1} << d;
  for (auto it = deviceProcesses_.begin(); it != deviceProcesses_.end();) {
    const bool keep = reported.count(it->first) ||
                      ((it->second.devices & unreadMask) != 0 && startTimeOf(it->first) == it->second.startTime);
    it = keep ? std::next(it) : deviceProcesses_.erase(it);
  }
  // The tenants' ledgers first; a process that maps none of them is looked for among their former
  // ledgers (a process mapping its own tenant's ledger never passes for another tenant's by also
  // mapping one of that tenant's former ledgers, which their creator can map at will).
  std::vector<FileId> files, formerFiles;
  std::vector<std::string> owners, formerOwners;
  for (const auto& [name, t] : tenants_) {
    if (!t->ledger) continue;
    files.push_back({t->ledger->fileDev(), t->ledger->fileIno()});
    owners.push_back(name);
    for (const TenantState::Shadow& sh : t->shadows) {
      formerFiles.push_back({sh.ledger->fileDev(), sh.ledger->fileIno()});
      formerOwners.push_back(name);
    }
  }
  for (int pid : reported) {
    const uint64_t start = startTimeOf(pid);
    DeviceProcess& p = deviceProcesses_[pid];
    if (p.startTime != start) {  // a new process, or the pid reused
      p = DeviceProcess();
      p.startTime = start;
    }
    p.devices = devicesOf[pid] | (p.devices & unreadMask);
    if (start == 0 || !p.tenant.empty()) continue;
    const bool first = p.lastLook == 0;
    if (!first && ticks_ - p.lastLook < kLookEveryTicks) continue;
    p.lastLook = ticks_;
    int i = mappedFileOf(pid, files.data(), files.size());
    const bool viaFormer = i < 0;
    if (viaFormer) i = mappedFileOf(pid, formerFiles.data(), formerFiles.size());
    if (i < 0) {
      // Any user of the host can start GPU processes: within a budget.
      if (std::string more; first && strangersLog_.allow(&more))
        CUSHARE_BLOG(info,
                     "process {} holds device memory and maps no tenant's ledger: not a cushare "
                     "tenant's process{}",
                     pid, more);
      continue;
    }
    const size_t k = static_cast<size_t>(i);
    p.tenant = viaFormer ? formerOwners[k] : owners[k];
    p.file = viaFormer ? formerFiles[k] : files[k];
    p.viaFormer = viaFormer;
    p.nsPid = innermostPidOf(pid);
  }
}

bool Broker::liveElsewhereLocked(const TenantState& t, int32_t slotPid) const {
  for (const auto& [pid, p] : deviceProcesses_)
    if (p.tenant == t.name && p.nsPid == slotPid && startTimeOf(pid) == p.startTime) return true;
  return false;
}

std::map<std::string, Broker::ShownSums> Broker::shownLocked() {
  std::map<std::string, ShownSums> out;
  for (auto& [name, t] : tenants_) {
    if (!t->ledger) continue;
    ShownSums& s = out[name];
    s.ledger = t->ledger.get();
    if (!guarded([&] {
          for (const Ledger::SlotUsage& u : t->ledger->slots())  // the broker's own slot left out
            for (uint32_t e = 0; e < kLedgerMaxDevices; ++e) s.bytes[e] = addSaturated(s.bytes[e], u.used[e]);
        })) {
      out.erase(name);
      faultLocked(t.get());
    }
  }
  return out;
}

void Broker::checkHiddenLocked(const std::vector<std::map<int, uint64_t>>& onDevice,
                               const std::map<std::string, ShownSums>& before,
                               const std::map<std::string, ShownSums>& after, bool mayJudge) {
  const size_t n = devices_.size();
  for (auto& [name, tp] : tenants_) {
    TenantState& t = *tp;
    t.hidden.resize(n, 0);
    t.hiddenReported.resize(n, 0);
    t.hiddenCharge.resize(kLedgerMaxDevices, 0);
    t.leftBehind.resize(n, 0);
    t.hiddenSeen.resize(kLedgerMaxDevices, {});
    if (!t.ledger || t.entry.size() != n) continue;
    const auto b = before.find(name), a = after.find(name);
    const bool measured = b != before.end() && a != after.end() &&
                          b->second.ledger == t.ledger.get() && a->second.ledger == t.ledger.get();
    std::vector<uint64_t> held(n, 0), allowed(n, 0);  // what the device holds for the tenant
    std::vector<uint64_t> processes(n, 0);            // the tenant's processes on the device
    // Processes whose ledger file is one of the tenant's former ledgers (attributed through it, or
    // through its ledger before it was moved aside): what they hold is explained by the former
    // ledgers' charge and charged beyond it only up to what those were charged when attached. One
    // attributed through a former ledger that is gone is not the tenant's any more.
    std::vector<uint64_t> heldFormer(n, 0);
    const auto formerFile = [&](const FileId& f) {
      for (const TenantState::Shadow& sh : t.shadows)
        if (sh.ledger->fileDev() == f.dev && sh.ledger->fileIno() == f.ino) return true;
      return false;
    };
    for (const auto& [pid, p] : deviceProcesses_) {
      if (p.tenant != name) continue;
      const bool former = formerFile(p.file);
      if (!former && p.viaFormer) continue;
      for (size_t d = 0; d < n; ++d) {
        const auto it = onDevice[d].find(pid);
        if (it == onDevice[d].end()) continue;
        (former ? heldFormer : held)[d] += it->second;
        if (!former) allowed[d] += config_.hiddenMemoryAllowance;
        ++processes[d];
      }
    }
    // A bursting tenant (docs/memory-elasticity.md): NVML's per-process figures leave managed
    // memory out, its ledger counts it. What its processes hold that the device cannot evict may
    // reach its guarantee, not its limit: its ledger's rows are believed only up to that
    // (ordinaryCeiling: the guarantee, or what they held beyond it at the first look or when it
    // was lowered, going down as they free), and what the device shows beyond is hidden memory.
    t.ordinaryCeiling.resize(n, kNoLimit);
    t.ordinarySet.resize(n, 0);
    for (size_t d = 0; d < n; ++d) {
      const uint64_t g = d < t.burstAbove.size() ? t.burstAbove[d] : kNoLimit;
      if (g == kNoLimit) {
        t.ordinaryCeiling[d] = kNoLimit;
        t.ordinarySet[d] = 0;
        continue;
      }
      if (!measured || unreadLocked(d)) continue;  // kept as it was
      const uint64_t counted = held[d] - std::min(held[d], allowed[d]);
      // The first look after the guarantee took effect believes what processes started before it
      // hold (they may have allocated under the limit alone); one started since is held to it.
      bool older = false;
      for (const auto& [pid, p] : deviceProcesses_)
        if (p.tenant == name && onDevice[d].count(pid) && p.startTime != 0 && p.startTime <= t.burstSinceTicks)
          older = true;
      const uint64_t from = t.ordinarySet[d] ? std::min(t.ordinaryCeiling[d], counted) : older ? counted : g;
      t.ordinaryCeiling[d] = std::max(g, from);
      t.ordinarySet[d] = 1;
    }
    const std::vector<uint64_t> was = t.hidden;
    t.deviceHeld = held;
    t.deviceHeldTick = ticks_;
    // Per entry: the most its row may hold (rows.cpp), read outside the guarded block below.
    std::map<int, uint64_t> rowAllowed;
    for (const auto& [e, d] : t.entryDevice)
      if (uint64_t v = 0; entryAllowanceLocked(t, e, &v)) rowAllowed[e] = v;
    bool charged = true;
    const bool ok = guarded([&] {
      for (const auto& [e, d] : t.entryDevice) {
        const size_t i = static_cast<size_t>(e);
        uint64_t charge = t.hiddenCharge[i];  // not measured this tick: kept as it was
        // A row shows at most what it may hold: an honest row is above that only for an instant
        // (an intent being retracted), and a tenant that writes its true total into its slot now
        // and then, to make ticks find nothing hidden, is there on purpose (found by an attack
        // review: 600 MiB for 256 MiB, never charged). rows.cpp judges a row that stays above.
        const auto ra = rowAllowed.find(e);
        if (measured && !unreadLocked(d)) {
          uint64_t shown = std::max(b->second.bytes[i], a->second.bytes[i]);
          if (ra != rowAllowed.end()) shown = std::min(shown, ra->second);
          shown = std::min(shown, t.ordinaryCeiling[d]);  // a bursting tenant's managed memory is not shown
          const uint64_t explained = shown + allowed[d];
          // What former ledgers' processes hold is charged to the tenant already (their charge
          // lowers its ledger's limit): explained, not hidden. Beyond it they hide like any, up
          // to what the former ledgers were charged when attached (a former ledger's creator,
          // another user, can zero its counters and map it at will: it must not raise the
          // tenant's charge past what it already carried).
          uint64_t formerly = 0, initially = 0;
          for (const TenantState::Shadow& sh : t.shadows) {
            formerly += sh.charge[d];
            initially += sh.initial[d];
          }
          const uint64_t beyond = heldFormer[d] > formerly ? heldFormer[d] - formerly : 0;
          const uint64_t room = initially > formerly ? initially - formerly : 0;
          const uint64_t found = (held[d] > explained ? held[d] - explained : 0) + std::min(beyond, room);
          auto& seen = t.hiddenSeen[i];
          charge = std::min(found, *std::min_element(seen.begin(), seen.end()));
          std::copy_backward(seen.begin(), seen.end() - 1, seen.end());
          seen.front() = found;
        }
        t.hiddenCharge[i] = charge;
        // Written every tick, changed or not: a process of the tenant can zero it. It also holds
        // what the tenant's exited processes left on the device (left_behind.cpp).
        const uint64_t left = e == t.entry[d] ? t.leftBehind[d] : 0;
        charged &= t.ledger->setCharge(e, charge + left);
        if (e == t.entry[d]) t.hidden[d] = charge;
      }
    });
    if (!ok) {
      faultLocked(&t);
      continue;
    }
    if (!charged && t.error.empty())
      CUSHARE_BLOG(error,
                   "tenant {}: memory hidden from its ledger cannot be charged: all {} process "
                   "slots are held",
                   name, kLedgerMaxSlots);
    for (size_t d = 0; d < n; ++d) {
      const bool contextOnly = t.hidden[d] <= processes[d] * config_.contextMemory;
      if (t.hidden[d] != 0 && contextOnly && (was[d] == 0 || t.hiddenReported[d]))
        CUSHARE_BLOG(info,
                     "tenant {} device {}: {} on the device beyond its ledger, within what {} "
                     "process context(s) hold ({} each, context_memory); charged to the tenant",
                     name, devices_[d].name(), formatSize(t.hidden[d]), processes[d],
                     formatSize(config_.contextMemory));
      const bool report = t.hidden[d] != 0 && !contextOnly;
      const bool changed = report != static_cast<bool>(t.hiddenReported[d]);
      t.hiddenReported[d] = report ? 1 : 0;
      if (changed && !report)
        CUSHARE_BLOG(info, "tenant {} device {}: no memory hidden from its ledger any more", name,
                     devices_[d].name());
      // The response, judged every tick while memory is charged as hidden (a tenant that passes
      // its limit only later, by allocating more, is taken back then). kill_past_limit: while
      // the device holds more for the tenant (less the allowance) than its ledger may hold,
      // whether or not the total is within its processes' contexts (idle processes' headroom is
      // not one process's to use); kill: while it is reported.
      bool judge = false;
      std::string response = "kill";
      if (config_.hiddenMemoryResponse == Config::TamperResponse::kKill) {
        judge = report;
      } else if (config_.hiddenMemoryResponse == Config::TamperResponse::kKillPastLimit && t.hidden[d] != 0) {
        uint64_t may = 0;
        const uint64_t counted = held[d] - std::min(held[d], allowed[d]);
        judge = entryAllowanceLocked(t, t.entry[d], &may) && counted > std::min(may, t.ordinaryCeiling[d]);
        may = std::min(may, t.ordinaryCeiling[d]);
        if (judge)
          response = "kill_past_limit: " + formatSize(counted) + " on the device, past the " + formatSize(may) +
                     " its ledger may hold";
      }
      // Another tenant holding its ledger's flock delays this pass: the figures are then too old
      // to take anyone down by (an honest process that freed meanwhile would look a culprit).
      if (!mayJudge) judge = false;
      t.hiddenPastLimitSaid.resize(n, 0);
      if (!judge) t.hiddenPastLimitSaid[d] = 0;
      if (!(changed && report) && !judge) {
        if (d < t.culpritRun.size()) t.culpritRun[d] = 0;
        continue;
      }
      std::vector<Ledger::SlotUsage> slots;
      std::vector<int> holders;  // per slot: the process the kernel names holding it (host pid)
      if (!guarded([&] { slots = t.ledger->slots(); })) {
        faultLocked(&t);
        break;
      }
      uint64_t rowNow = 0;
      for (const Ledger::SlotUsage& u : slots) {
        holders.push_back(t.ledger->slotHolderPid(u.slot));
        if (t.entry[d] >= 0) rowNow = addSaturated(rowNow, u.used[t.entry[d]]);
      }
      // A row above what it may hold in this read credits its slots more than any process can
      // hold honestly: the processes are not judged from it (a tenant that times its writes to
      // the broker's reads stays charged; an honest row is there only for an instant).
      uint64_t rowMay = UINT64_MAX;
      if (judge && entryAllowanceLocked(t, t.entry[d], &rowMay) && rowNow > rowMay) judge = false;
      // A slot nobody's lock names is credited by its pid word to one process at most (every
      // container's first process is pid 1).
      std::map<int32_t, int> byPidWord;
      for (const auto& [pid, p] : deviceProcesses_)
        if (p.tenant == name) ++byPidWord[p.nsPid];
      std::string who;
      std::vector<int> culprits;  // host pids holding more than a context beyond their slots
      for (const auto& [pid, p] : deviceProcesses_) {
        if (p.tenant != name) continue;
        const auto it = onDevice[d].find(pid);
        const uint64_t onDev = it == onDevice[d].end() ? 0 : it->second;
        // A slot is a process's by the kernel's holder of its pid lock: the pid word is the
        // process's own (in its pid namespace, where every container's first process is 1) and
        // the tenant's to write. Only a process that holds no slot's lock (it let go of it:
        // closing any descriptor of the ledger does) is matched by the pid word, and then only to
        // slots nobody's lock names.
        uint64_t inSlot = 0;
        bool holds = false;
        for (size_t k = 0; k < slots.size(); ++k)
          if (holders[k] == pid && t.entry[d] >= 0) {
            holds = true;
            inSlot = addSaturated(inSlot, slots[k].used[t.entry[d]]);
          }
        for (size_t k = 0; k < slots.size() && !holds && byPidWord[p.nsPid] == 1; ++k)
          if (holders[k] <= 0 && slots[k].pid == p.nsPid && t.entry[d] >= 0)
            inSlot = addSaturated(inSlot, slots[k].used[t.entry[d]]);
        if (onDev <= inSlot) continue;
        who += "; pid " + std::to_string(pid) +
               (p.nsPid != pid ? " (" + std::to_string(p.nsPid) + " in its pid namespace)" : "") +
               ": " + formatSize(onDev) + " on the device, " + formatSize(inSlot) +
               " in its ledger slot";
        // An honest process holds at most its context beyond its slot. Only the tenant's own
        // processes: of its ledger (not a former one, whose creator is another user) and of its
        // user (or group).
        if (onDev - inSlot > config_.contextMemory + config_.hiddenMemoryAllowance && !p.viaFormer &&
            !formerFile(p.file) && ofTenantsUser(t, pid))
          culprits.push_back(pid);
      }
      if (changed && report) {
        tamperLocked(&t, "hidden");
        CUSHARE_BLOG(warn,
                     "tenant {} device {}: its processes hold {} on the device, {} more than its "
                     "ledger shows{}; "
                     "charged to the tenant (counted in its usage) while the device holds it",
                     name, devices_[d].name(), formatSize(held[d]), formatSize(t.hidden[d]), who);
      }
      t.culpritRun.resize(n, 0);
      if (!judge) continue;
      // Culprits two judged ticks in a row on this device (whichever processes: two that take
      // turns holding the untracked memory do not reset it): one tick's figures can disagree by
      // what a process freed between NVML's read and the slots' (the device frees first).
      t.culpritRun[d] = culprits.empty() ? 0 : t.culpritRun[d] + 1;
      const bool any = !culprits.empty();
      for (int pid : culprits) {
        DeviceProcess& p = deviceProcesses_.find(pid)->second;
        if (p.killTried || t.culpritRun[d] < 2) continue;  // listed a tick or two more while freed
        p.killTried = true;
        const bool killed = killProcessIfStill(pid, p.startTime);
        if (killed) tamperLocked(&t, "killed");
        // What it allocated in the window goes with it.
        CUSHARE_BLOG(warn, "tenant {} device {}: pid {} {} (hidden_memory_response: {}): the device frees what it hid",
                     name, devices_[d].name(), pid, killed ? "killed" : "could not be killed (gone already?)", response);
      }
      if (!any && !t.hiddenPastLimitSaid[d]) {
        // Honest too: a limit lowered below what the tenant holds, contexts and all.
        t.hiddenPastLimitSaid[d] = 1;
        CUSHARE_BLOG(info,
                     "tenant {} device {}: nothing to take down ({}): no process of the tenant's user holds more "
                     "than context_memory ({}) beyond its ledger slot{}; what they hold is charged",
                     name, devices_[d].name(), response, formatSize(config_.contextMemory), who);
      }
    }
  }
}

}  // namespace cushare::broker
