// Memory a tenant's exited processes left on the device, found in the device's own accounting and
// charged to the tenant.
//
// VMM memory made shareable lives as long as any handle or exported descriptor refers to it. A
// process can export a POSIX descriptor, pass it to a process that never imports it (no CUDA at
// all), and exit: its slot is reaped and its charge returned, yet the device keeps the memory. No
// live process holds it, so the per-process cross-check (hidden_memory.cpp) cannot see it. The
// device can: its used memory as a whole minus what its processes hold (the "unattributed" memory,
// U) rises, when the exporter exits, by what it left behind.
//
// Exits are seen two ways: a process leaves NVML's process list (with what it held there), or a
// slot leaves a tenant's ledger (reaped; with what the slot showed). The second sees processes
// that lived less than a tick, which NVML's list may never have shown, and processes of the
// tenant that zeroed their slot.
//
// Every tick, per device: U = NVML used - the sum of the processes' used, with NVML used the
// smaller of two reads, before and after the process list, and where that leaves U above zero the
// least of up to three such readings (processMemory: a process allocating between the list and a
// later total would raise U, and so would one freeing before the list and allocating again before
// the second total. Before, honest churners were charged to tenants whose processes exited then:
// Reaping.SimultaneousKillsUnderLoadLeakNothing, 4 MiB, in two flake hunts); smoothed as the
// smallest of the last three ticks. Falls (charges
// returned) are judged on U from the larger read, the largest of the last three ticks, so that
// allocations racing the reads cannot make a charge look freed either. U is explained as base (memory no
// tenant left: the driver's own reservations, other programs' orphans) plus what is charged to
// tenants. When processes exit, their tick opens a pending decision; three ticks later the rise of
// smoothed U over what is explained is charged to the exited processes' tenants and logged:
// first to processes NVML never listed (short-lived), each up to its slot's bytes plus one; then
// to those it listed, each up to what the device showed it holding; the rest to the unlisted ones
// (a zeroed slot does not escape), else into base; an exited process of no tenant opens no
// decision (what it left goes into base as a rise with no exit pending). When smoothed U falls below what is explained, the memory was freed:
// charges are returned, oldest first, then base falls. A rise with no exit pending goes into base
// (it is nobody's leaving). The charge is added to the tenant's charge slot, so admission sees it.
//
// Limits (docs/security.md): processes of several tenants exiting in one tick share the rise in
// proportion; a tenant that imports its own exported memory is charged twice while the importer
// lives (over-counts); what the tenant allocates between its exporter's exit and the charge (at
// most four ticks, 200 ms) stays allocated (detection, not prevention). On a real GPU this relies
// on NVML counting such memory in the device's used memory and in no process's, which simgpu
// models and perf/vmm_export_probe measures on a GPU (perf/gpu_check.sh) [unverified].
#include <algorithm>
#include <numeric>

#include "core/broker.h"
#include "core/bus_guard.h"
#include "core/log.h"
#include "cushare/parse.h"

namespace cushare::broker {
namespace {

constexpr int kDecideAfterTicks = 3;

uint64_t sumOf(const std::vector<std::pair<std::string, uint64_t>>& v) {
  uint64_t s = 0;
  for (const auto& e : v) s += e.second;
  return s;
}

}  // namespace

void Broker::checkLeftBehindLocked(const std::vector<std::map<int, uint64_t>>& onDevice,
                                   const std::vector<uint64_t>& deviceUsed,
                                   const std::vector<uint64_t>& deviceUsedHigh) {
  const size_t n = std::min({onDevice.size(), deviceUsed.size(), deviceUsedHigh.size()});
  leftBehind_.resize(n);
  for (size_t d = 0; d < n; ++d) {
    LeftBehindDevice& L = leftBehind_[d];
    // A MIG device not read this tick, or one whose GPU instance other compute instances share
    // (what no process holds there is one figure for all of them, and cannot say whose exit left
    // it: charging it on each would charge it twice, docs/mig.md): nothing is judged.
    if (unreadLocked(d)) continue;  // charges made before are kept
    if (sharedMemoryLocked(d)) {
      L = LeftBehindDevice{};
      continue;
    }
    uint64_t attributed = 0;
    for (const auto& [pid, bytes] : onDevice[d]) attributed += bytes;
    const uint64_t u = deviceUsed[d] > attributed ? deviceUsed[d] - attributed : 0;
    L.recent.push_back(u);
    if (L.recent.size() > static_cast<size_t>(kDecideAfterTicks)) L.recent.erase(L.recent.begin());
    const uint64_t smooth = *std::min_element(L.recent.begin(), L.recent.end());
    // Falls are judged on the larger reading, held for three ticks: allocations racing the reads
    // (which lower the smaller one) cannot make a charge look freed.
    const uint64_t uHigh = deviceUsedHigh[d] > attributed ? deviceUsedHigh[d] - attributed : 0;
    L.recentHigh.push_back(uHigh);
    if (L.recentHigh.size() > static_cast<size_t>(kDecideAfterTicks)) L.recentHigh.erase(L.recentHigh.begin());
    const uint64_t smoothHigh = *std::max_element(L.recentHigh.begin(), L.recentHigh.end());

    // Processes gone since the last tick open a decision: from NVML's list, and from the ledgers.
    LeftBehindDevice::Pending exits;
    // A listed process that was never attributed to a tenant opens nothing: a rise with no exit
    // pending goes into base anyway, and a tenant's short-lived process that the broker first
    // looked at while it was exiting (its maps already gone, so unattributed) must not have its
    // rise taken into base before its reaped slot is decided.
    for (const auto& [pid, who] : L.last)
      if (!onDevice[d].count(pid) && !who.first.empty()) {
        exits.seen[who.first] += who.second;
        L.lastListExit[who.first] = ticks_;
      }
    std::map<std::string, std::map<std::pair<int, int>, uint64_t>> slotsNow;
    for (auto& [name, t] : tenants_) {
      if (!t->ledger || d >= t->entry.size() || t->entry[d] < 0) continue;
      const size_t e = static_cast<size_t>(t->entry[d]);
      std::vector<Ledger::SlotUsage> slots;
      if (!guarded([&] { slots = t->ledger->slots(); })) continue;  // faulted: found by the tick
      auto& now = slotsNow[name];
      for (const Ledger::SlotUsage& u : slots) now[{u.slot, u.pid}] = u.used[e];
      const auto was = L.lastSlots.find(name);
      if (was == L.lastSlots.end()) continue;
      // A slot is reaped up to a tick after its process left NVML's list: that exit was seen.
      const auto listed = L.lastListExit.find(name);
      if (listed != L.lastListExit.end() && ticks_ - listed->second <= 2) continue;
      for (const auto& [key, bytes] : was->second)
        if (!now.count(key)) exits.unseen[name] += bytes + 1;
    }
    L.lastSlots = std::move(slotsNow);
    if ((!exits.seen.empty() || !exits.unseen.empty()) && L.haveBase) L.pending.push_back(std::move(exits));

    if (!L.haveBase) {
      L.haveBase = true;
      L.base = smooth;
    }
    uint64_t charged = sumOf(L.charged);
    for (auto& p : L.pending) ++p.ticks;
    while (!L.pending.empty() && L.pending.front().ticks >= kDecideAfterTicks) {
      const LeftBehindDevice::Pending p = std::move(L.pending.front());
      L.pending.erase(L.pending.begin());
      const uint64_t explained = L.base + charged;
      const uint64_t rise = smooth > explained ? smooth - explained : 0;
      if (rise == 0) continue;
      // Who left it: first the processes NVML never listed (they lived less than a tick), each up
      // to what its slot showed (+1); then those it listed, each up to what the device showed
      // them holding; what is still unexplained goes to the unlisted ones in proportion (their
      // slots may have been zeroed), else into base. So a process that was seen holding nothing
      // is never charged, and a short job of another tenant exiting meanwhile takes no more than
      // its slot showed unless nobody else can explain the rise.
      std::map<std::string, uint64_t> share;
      uint64_t left = rise;
      auto spread = [&](const std::map<std::string, uint64_t>& who, bool capped) {
        uint64_t weight = 0;
        for (const auto& [tenant, w] : who) weight += w;
        if (weight == 0 || left == 0) return;
        const uint64_t pool = left;
        for (const auto& [tenant, w] : who) {
          uint64_t x = static_cast<uint64_t>(static_cast<unsigned __int128>(pool) * w / weight);
          if (capped) x = std::min(x, w);
          x = std::min(x, left);
          share[tenant] += x;
          left -= x;
        }
      };
      spread(p.unseen, true);
      spread(p.seen, true);
      spread(p.unseen, false);
      uint64_t given = 0;
      for (const auto& [tenant, x] : share) {
        given += x;
        if (x == 0) continue;
        if (tenant.empty() || !tenants_.count(tenant)) {
          L.base += x;
          continue;
        }
        L.charged.emplace_back(tenant, x);
        charged += x;
        CUSHARE_BLOG(warn,
                     "tenant {} device {}: its exited processes left {} on the device (memory kept "
                     "alive by an exported descriptor or handle); charged to the tenant until the "
                     "device frees it",
                     tenant, devices_[d].name(), formatSize(x));
      }
      L.base += rise - given;  // rounding, and what no exited process can explain
    }

    const uint64_t explained = L.base + charged;
    if (smoothHigh < explained) {  // freed: return charges, oldest first, then lower the base
      uint64_t gone = explained - smoothHigh;
      for (auto it = L.charged.begin(); it != L.charged.end() && gone > 0;) {
        const uint64_t take = std::min(gone, it->second);
        it->second -= take;
        gone -= take;
        if (it->second == 0) {
          CUSHARE_BLOG(info, "tenant {} device {}: memory its exited processes left is freed", it->first,
                       devices_[d].name());
          it = L.charged.erase(it);
        } else {
          ++it;
        }
      }
      L.base -= std::min(L.base, gone);
    } else if (L.pending.empty() && smooth > explained) {
      L.base = smooth - charged;  // a rise nobody's exit explains is not a tenant's leaving
    }
    // Charges of tenants that are gone are dropped.
    L.charged.erase(std::remove_if(L.charged.begin(), L.charged.end(),
                                   [&](const auto& e) { return !tenants_.count(e.first); }),
                    L.charged.end());

    L.last.clear();
    for (const auto& [pid, bytes] : onDevice[d]) {
      const auto it = deviceProcesses_.find(pid);
      L.last[pid] = {it == deviceProcesses_.end() ? std::string() : it->second.tenant, bytes};
    }
  }
  for (auto& [name, t] : tenants_) {
    t->leftBehind.assign(devices_.size(), 0);
    for (size_t d = 0; d < n && d < devices_.size(); ++d)
      for (const auto& [tenant, bytes] : leftBehind_[d].charged)
        if (tenant == name) t->leftBehind[d] += bytes;
  }
}

}  // namespace cushare::broker
