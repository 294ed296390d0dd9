// cushare::Ledger: one tenant's shared-memory ledger (layout: ledger_abi.h, docs/ledger-abi.md),
// mapped by every CUDA process of the tenant to enforce one device-memory limit across all of them.
//
// Invariants (the argument is written out in ledger.cpp and docs/ledger-abi.md):
// - Each process owns one slot, held by an OFD lock the kernel drops when the process dies. The
//   slot's counters used[dev][slot] are the only truth: there is no separate total to keep in step.
// - reserve() announces, then validates: add to the own counter, sum every counter, retract if
//   the sum exceeds the limit. With sequentially consistent atomics the reservations held at any
//   moment never exceed the limit, without any lock between processes, and a process killed at
//   any instant leaves exactly what it holds, which a reaper (any process that takes the dead
//   slot's lock) returns exactly once.
// - Hot path (reserve, release, used, limit): no allocation, lock, log or system call. The only
//   exceptions: a reservation about to be denied first reaps dead slots (system calls), and the
//   first use in a forked child claims that child's own slot.
// - A forked child never uses its parent's slot: a pthread_atfork handler drops the inherited
//   descriptor (so a dead parent's slot can be reaped even while the child lives) and the child
//   claims a slot of its own on first use.
// - No static destructors; a Ledger must outlive every thread that uses it.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "cushare/ledger_abi.h"

struct stat;

namespace cushare {

class LimitsFile;

// A file's identity: st_dev, st_ino.
struct FileId {
  uint64_t dev;
  uint64_t ino;
};
// The index of the first of files that process pid (in this process's pid namespace) maps, read
// from /proc/<pid>/maps; -1 if none, or the process is gone. No allocation.
int mappedFileOf(int pid, const FileId* files, size_t n) noexcept;

// How Ledger::open treats a missing directory or file, and whether the caller takes a slot.
struct LedgerOpenOptions {
  bool createDir = true;   // create the directory (0700) if missing: standalone shim
  bool createFile = true;  // create the file if missing (the shim standalone or for an unknown
                           // tenant a broker admits; the broker for its tenants)
  bool claimSlot = true;   // false: an observer (the broker): it reads, reaps and sets limits but
                           // holds no slot and never reserves
  // A file this call creates gets this owner, group and mode (-1: the caller's own). The mode is
  // applied exactly, whatever the umask.
  int ownerUid = -1;
  int ownerGid = -1;
  unsigned mode = 0600;
  // The file's name in the directory; empty: "<tenant>.ledger". The broker keeps a removed
  // tenant's ledger under another name while its processes run.
  std::string fileName;
  // Standalone shim: the limits come from the tenant's environment, per session. A process that
  // finds no other live process of the tenant when it claims its slot (under the file's flock,
  // dead ones reaped first) starts a new session: every device entry's limit becomes
  // kLedgerLimitPending, and sessionDeviceIndex() sets it from the first process that resolves
  // the device. So a limit raised in the environment applies once every process of the tenant has
  // exited, and never while one still runs.
  bool renewLimits = false;
  // Observers never wait for the file's flock (a tenant's process may hold it forever): when it is
  // held, open() fails at once and sets *busy (if given), and the caller may wait and retry.
  bool* busy = nullptr;
};

class Ledger {
 public:
  // Maps <dir>/<tenant>.ledger, creating the directory (0700) and the file (0600) if missing, and
  // claims a process slot. Refuses (nullptr, *err naming the file and the field) a file whose
  // layout or tenant differs from this build's: it never reinterprets one.
  static std::unique_ptr<Ledger> open(const std::string& dir, const std::string& tenant,
                                      std::string* err);
  static std::unique_ptr<Ledger> open(const std::string& dir, const std::string& tenant,
                                      const LedgerOpenOptions& options, std::string* err);

  // Tenant names: [A-Za-z0-9._-]{1,63}.
  static bool validTenantName(std::string_view tenant, std::string* err);

  ~Ledger();  // returns what this process still holds (as if it died) and releases the slot
  Ledger(const Ledger&) = delete;
  Ledger& operator=(const Ledger&) = delete;

  // The entry of the device with this UUID, added (under flock) with limitIfNew if missing.
  // Returns -1 with *err set if all kLedgerMaxDevices entries are taken, or (an observer, which
  // never waits) if another process holds the flock: then *busy is set too, if given.
  int deviceIndex(const uint8_t uuid[16], uint64_t limitIfNew, std::string* err,
                  bool* busy = nullptr) noexcept;
  // Standalone (see LedgerOpenOptions::renewLimits): as deviceIndex, and an entry whose limit is
  // kLedgerLimitPending gets `limit` (under flock: the first process of a session to resolve the
  // device sets it; later ones find it set).
  int sessionDeviceIndex(const uint8_t uuid[16], uint64_t limit, std::string* err) noexcept;
  uint64_t limit(int dev) const noexcept {  // kLedgerNoLimit: none
    if (static_cast<uint32_t>(dev) >= kLedgerMaxDevices) return 0;
    return hdr_->devices[dev].limit.load(std::memory_order_acquire);
  }
  void setLimit(int dev, uint64_t bytes) noexcept;
  // The word limit(dev) reads: a standalone shim enforces it (under a broker the limits file's).
  const std::atomic<uint64_t>* limitWord(int dev) const noexcept {
    return static_cast<uint32_t>(dev) < kLedgerMaxDevices ? &hdr_->devices[dev].limit : nullptr;
  }
  // The broker: the limits file that speaks for this ledger (limits_file.h), kept with it (a
  // renamed ledger keeps its file). Attached once; the broker writes it, setLimit does not.
  void attachLimits(std::unique_ptr<LimitsFile> f);
  LimitsFile* limitsFile() const noexcept;

  // Reserves bytes on dev for this process if everything the tenant holds stays <= limit.
  // Exact across processes; false (and denied(dev) counts it) when it does not fit after dead
  // processes' usage was returned.
  bool reserve(int dev, uint64_t bytes, uint64_t limit) noexcept;
  // As reserve, but a quick question rather than a demand: no reaping, no waiting for intents in
  // flight, and a refusal is not counted in denied(dev). For a caller with a fallback.
  bool tryReserve(int dev, uint64_t bytes, uint64_t limit) noexcept;
  // A guaranteed allocation waiting for plain bursts to be reclaimed (docs/memory-elasticity.md):
  // posts (or refreshes) its bytes and the time (CLOCK_MONOTONIC ns), or clears them (0). Any
  // process of the tenant; the broker reads them (wantBytes, wantNs).
  void postWant(int dev, uint64_t bytes, uint64_t nowNs) noexcept {
    if (static_cast<uint32_t>(dev) >= kLedgerMaxDevices) return;
    hdr_->devices[dev].want_bytes.store(bytes, std::memory_order_release);
    hdr_->devices[dev].want_ns.store(nowNs, std::memory_order_release);
  }
  uint64_t wantBytes(int dev) const noexcept {
    return static_cast<uint32_t>(dev) < kLedgerMaxDevices ? hdr_->devices[dev].want_bytes.load(std::memory_order_acquire) : 0;
  }
  uint64_t wantNs(int dev) const noexcept {
    return static_cast<uint32_t>(dev) < kLedgerMaxDevices ? hdr_->devices[dev].want_ns.load(std::memory_order_acquire) : 0;
  }
  // Returns bytes this process reserved on dev (clamped at what it holds).
  void release(int dev, uint64_t bytes) noexcept;

  // What all slots hold on dev, in-flight intents and not-yet-reaped dead processes included.
  // Inline, as limit(): both are on the hot path of the shim's hooks.
  uint64_t used(int dev) const noexcept {
    return static_cast<uint32_t>(dev) < kLedgerMaxDevices ? sumUsed(dev) : 0;
  }
  // What this process's own slot holds on dev (0 before it has a slot): used(dev) minus this is
  // what the tenant's other processes, live or dead, hold.
  uint64_t usedHere(int dev) const noexcept {
    const int s = slot_.load(std::memory_order_acquire);
    if (static_cast<uint32_t>(dev) >= kLedgerMaxDevices || s < 0) return 0;
    return usedAt(dev, s).load(std::memory_order_seq_cst);
  }
  uint64_t peak(int dev) const noexcept;
  uint64_t denied(int dev) const noexcept;

  // Returns dead processes' usage; the number of dead slots reaped. A slot is dead when its lock
  // is free and its process no longer maps this ledger (a live process that closed its descriptor
  // keeps its slot). alsoLive: the caller knows more live processes (the broker: pids of other
  // pid namespaces); kept: the pids of slots kept for a live process although their lock was free.
  int reapDead() noexcept;
  int reapDead(const std::function<bool(int32_t pid)>* alsoLive, std::vector<int32_t>* kept) noexcept;

  struct ProcUsage {
    int pid;
    uint64_t bytes;
  };
  // Live processes of the tenant (those with a slot) and what each holds on dev; reaps first.
  std::vector<ProcUsage> processes(int dev);

  struct SlotUsage {
    int pid;
    uint64_t used[kLedgerMaxDevices];  // by device entry
    int slot = -1;
  };
  // Every occupied slot (a live process, or a dead one not reaped yet) and what it holds on each
  // device entry, the observer's own charge slot excluded. No system call: for the broker's scans.
  std::vector<SlotUsage> slots() const;
  // The pid, in the caller's pid namespace, of the process the kernel reports holding slot's
  // POSIX pid lock (kLedgerSlotPidLockBase); 0 when nobody visible holds it (a shim of an older
  // version, a holder in a pid namespace the caller cannot see). Unlike pid[slot] a tenant cannot
  // forge it: only a process with the ledger open can hold the lock. One fcntl(F_GETLK).
  int slotHolderPid(int slot) const noexcept;

  // The entry of the device with this UUID, or -1 (never adds one).
  int findDevice(const uint8_t uuid[16]) const noexcept;
  // The UUID of entry dev, if it is in use.
  bool deviceUuid(int dev, uint8_t uuid[16]) const noexcept;
  // Writes back the UUID of entry dev, which a process of the tenant rewrote or freed, and marks it
  // ready: processes keep using the entry they found at start, so the entry, not a new one, must
  // name the device.
  void restoreDeviceUuid(int dev, const uint8_t uuid[16]) noexcept;

  // Observers (the broker) only: bytes the observer charges the tenant on entry dev beyond what
  // the processes' slots show (memory the device holds for the tenant that its ledger hides). Kept
  // in a slot of the observer's own, which it holds locked like a process, so every reservation's
  // sum includes it; claimed on first use, with pid 0 (no process: process lists leave it out).
  // False if no slot could be claimed.
  bool setCharge(int dev, uint64_t bytes) noexcept;
  uint64_t charge(int dev) const noexcept;
  // The observer's slot (-1: none yet): not a process of the tenant.
  int chargeSlot() const noexcept { return observer_ ? slot_.load(std::memory_order_acquire) : -1; }
  // The mapped file's identity (st_dev, st_ino) and its number of hard links now (-1: unknown).
  uint64_t fileDev() const noexcept { return fileDev_; }
  uint64_t fileIno() const noexcept { return fileIno_; }
  int links() const noexcept;

  // Gives the file this owner, group (-1: leave) and mode, through this process's own descriptor
  // (never by path: the directory may be writable by tenants). Refuses a file that is not a
  // regular file with exactly one link. *changed tells whether anything was different.
  bool setOwner(int uid, int gid, unsigned mode, bool* changed, std::string* err) noexcept;

  // fstat of the file through this process's own descriptor (false without one).
  bool fileStat(struct stat* st) const noexcept;

  // The compute region (docs/compute.md): entry dev's broker-written words, and slot s's
  // shim-written counters on entry dev; null when out of range. Every value read there may have
  // been written by any process of the tenant: callers validate or clamp it.
  LedgerComputeDevice* compute(int dev) const noexcept {
    return static_cast<uint32_t>(dev) < kLedgerMaxDevices ? &compute_[dev] : nullptr;
  }
  LedgerComputeSlot* computeSlotAt(int dev, int slot) const noexcept {
    if (static_cast<uint32_t>(dev) >= kLedgerMaxDevices || static_cast<uint32_t>(slot) >= kLedgerMaxSlots)
      return nullptr;
    return &computeSlots_[static_cast<size_t>(dev) * kLedgerMaxSlots + static_cast<size_t>(slot)];
  }
  // Slots ever claimed (slot_hwm, clamped to the table).
  uint32_t slotsInUse() const noexcept { return slotHwm(); }

  const std::string& path() const { return path_; }
  // This process's slot, or -1 in a forked child that has not used the ledger yet.
  int slot() const noexcept { return slot_.load(std::memory_order_acquire); }
  // The process's slot, claimed first if it has none (a forked child): -1 if none can be had.
  int ensureSlot() noexcept;

 private:
  Ledger() = default;

  std::atomic<uint64_t>& usedAt(int dev, int slot) const noexcept {
    return used_[static_cast<size_t>(dev) * kLedgerMaxSlots + static_cast<size_t>(slot)];
  }
  uint32_t slotHwm() const noexcept {
    // Clamped: the file is writable by every process of the tenant; never index past the table.
    const uint32_t hwm = hdr_->slot_hwm.load(std::memory_order_seq_cst);
    return hwm < kLedgerMaxSlots ? hwm : kLedgerMaxSlots;
  }
  uint64_t sumUsed(int dev) const noexcept {  // saturating
    const uint32_t hwm = slotHwm();
    const std::atomic<uint64_t>* row = &usedAt(dev, 0);
    uint64_t sum = 0;
    for (uint32_t s = 0; s < hwm; ++s)
      if (__builtin_add_overflow(sum, row[s].load(std::memory_order_seq_cst), &sum)) return UINT64_MAX;
    return sum;
  }
  bool announceAndValidate(int dev, int slot, uint64_t bytes, uint64_t limit) noexcept;
  bool reserveSlow(int dev, int slot, uint64_t bytes, uint64_t limit) noexcept;

  // Slow path, under lock_ (process-local; OFD locks and flock do not exclude threads of one
  // process, which share the open file description).
  void lockLocal() noexcept;
  void unlockLocal() noexcept;
  int ensureSlotLocked(std::string* err) noexcept;  // opens fd_ and claims a slot if needed
  bool ensureFdLocked(std::string* err) noexcept;   // opens fd_ if needed (a forked child)
  int claimSlotLocked(std::string* err) noexcept;
  // *othersAlive (optional): whether any other slot's owner is alive (every slot below slot_hwm
  // is tried, not only the occupied ones).
  int reapDeadLocked(const std::function<bool(int32_t)>* alsoLive, std::vector<int32_t>* kept,
                     bool* othersAlive = nullptr) noexcept;
  bool unlockedButLiveLocked(uint32_t slot, const std::function<bool(int32_t)>* alsoLive) noexcept;
  int deviceIndexImpl(const uint8_t uuid[16], uint64_t limit, bool fillPending, std::string* err,
                      bool* busy) noexcept;
  void forgetParentSlot() noexcept;  // in a forked child, from the atfork handler

  static void onForkPrepare() noexcept;
  static void onForkParent() noexcept;
  static void onForkChild() noexcept;
  void registerSelf() noexcept;
  void unregisterSelf() noexcept;

  std::string path_;
  std::unique_ptr<LimitsFile> limits_;
  std::string tenant_;
  LedgerHeader* hdr_ = nullptr;
  std::atomic<uint64_t>* used_ = nullptr;  // used[dev][slot]
  std::atomic<int32_t>* pid_ = nullptr;    // pid[slot]
  LedgerComputeDevice* compute_ = nullptr;  // compute[dev]
  LedgerComputeSlot* computeSlots_ = nullptr;  // compute_slots[dev][slot]
  int fd_ = -1;                            // this process's own open file description
  uint64_t fileDev_ = 0, fileIno_ = 0;     // identity of the file mapped (checked on re-open)
  std::atomic<int> slot_{-1};
  bool observer_ = false;  // opened without a slot: never reserves
  std::atomic<bool> lock_{false};
  Ledger* prev_ = nullptr;  // every Ledger of the process, for the fork handlers
  Ledger* next_ = nullptr;
};

}  // namespace cushare
