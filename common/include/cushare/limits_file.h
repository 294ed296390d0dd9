// A ledger's limits file: the broker's word on which device each of a tenant's ledger entries is
// and how much may be allocated through it, where the tenant cannot write it. The ledger itself is
// the tenant's file (its processes reserve in it), so a limit or a device UUID kept only there
// could be rewritten by the tenant and used before the broker puts it back; under a broker a shim
// takes both from this file instead. Layout and rules: docs/ledger-abi.md ("Limits files"); an
// ABI like the ledger, so every offset is asserted.
//
// Place: <ledger_dir>/limits/<inode of the ledger file>, in a directory and a file of the
// broker's user (0711 and 0644: a tenant can open its own ledger's file by the inode it knows,
// cannot list the others, and cannot create or change any). Named by the ledger's inode, not by
// the tenant's name, so the file follows the ledger when the broker renames it (a removed tenant,
// a replaced file) and a new file under the tenant's name never meets an old ledger's limits.
//
// Written only by the broker: an entry is published once (limit, then UUID, then state = ready,
// release) and its limit changed live afterwards; its UUID never changes. Readers map the file
// read-only and load the limit on every reservation (one acquire load, as the ledger's was).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "cushare/ledger_abi.h"

namespace cushare {

// "CUSHLIM\0" as a little-endian u64.
inline constexpr uint64_t kLimitsMagic = 0x004D494C48535543ull;
inline constexpr uint32_t kLimitsVersion = 2;  // 2: LimitsEntry::burst_above
inline constexpr char kLimitsDirName[] = "limits";  // under the ledger directory
inline constexpr uint32_t kLimitsEntryFree = 0;
inline constexpr uint32_t kLimitsEntryReady = 1;

// Entry e speaks for ledger device entry e.
struct LimitsEntry {
  uint8_t uuid[16];             // the device the broker judged entry e to be; constant once ready
  std::atomic<uint64_t> limit;  // bytes; kLedgerNoLimit = none
  std::atomic<uint32_t> state;  // kLimitsEntryFree or kLimitsEntryReady
  uint32_t reserved0;
  // Bursting (docs/memory-elasticity.md): an allocation that would take what the tenant holds on
  // the device above this many bytes is made managed memory (evictable to host memory) instead of
  // ordinary device memory; kLedgerNoLimit: the tenant does not burst. Written before state.
  std::atomic<uint64_t> burst_above;
  // Memory on the device (its memory group) that other tenants' bursts hold and the device would
  // evict for an ordinary allocation, as the broker last estimated it: a shim adds it to the
  // device's free memory in the tenant's view (cuMemGetInfo, NVML). 0: none known.
  std::atomic<uint64_t> evictable;
  // Reclaim of plain bursts (docs/memory-elasticity.md): the most the tenant should hold on the
  // device now (kLedgerNoLimit: nothing asked), and a count that moves with every new request
  // (what a process polling cushare_reclaim_fd's watcher compares).
  std::atomic<uint64_t> reclaim_target;
  std::atomic<uint64_t> reclaim_seq;
};

struct LimitsHeader {
  uint64_t magic;  // kLimitsMagic, written last at creation
  uint32_t version;
  uint32_t header_size;  // sizeof(LimitsHeader)
  uint64_t file_size;    // sizeof(LimitsHeader): the file has exactly this size
  uint64_t ledger_ino;   // the ledger file this speaks for (also the file's name)
  char tenant[kLedgerTenantBytes];  // that ledger's tenant, NUL-padded
  // Plain bursts (docs/memory-elasticity.md): bit e set while other tenants hold plain bursts in
  // entry e's memory group (an ordinary allocation the driver refuses there may wait for them to
  // be reclaimed), and how long such an allocation waits (ms).
  std::atomic<uint64_t> plain_mask;
  std::atomic<uint64_t> reclaim_wait_ms;
  uint64_t reserved[2];
  LimitsEntry entries[kLedgerMaxDevices];
};

static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<uint32_t>::is_always_lock_free);
static_assert(offsetof(LimitsEntry, limit) == 16);
static_assert(offsetof(LimitsEntry, state) == 24);
static_assert(offsetof(LimitsEntry, burst_above) == 32);
static_assert(offsetof(LimitsEntry, evictable) == 40);
static_assert(offsetof(LimitsEntry, reclaim_target) == 48);
static_assert(offsetof(LimitsEntry, reclaim_seq) == 56);
static_assert(offsetof(LimitsHeader, plain_mask) == 96);
static_assert(sizeof(LimitsEntry) == 64);
static_assert(offsetof(LimitsHeader, ledger_ino) == 24);
static_assert(offsetof(LimitsHeader, tenant) == 32);
static_assert(offsetof(LimitsHeader, entries) == 128);
static_assert(sizeof(LimitsHeader) == 1152);

class LimitsFile {
 public:
  // The broker: maps <ledgerDir>/limits/<ledgerIno> read-write, keeping a valid one of its own
  // user for this tenant and inode (a restarted broker; the running processes map it) and
  // replacing anything else there. Its entries are what the file says until the caller publishes.
  static std::unique_ptr<LimitsFile> openForBroker(const std::string& ledgerDir, uint64_t ledgerIno,
                                                   const std::string& tenant, std::string* err);
  // A shim: maps the file read-only. 1: mapped into *out. 0: not there yet (the broker has not
  // seen the ledger), *err says so. -1: refused, *err names the file and the reason: the
  // directory or file is not brokerUid's or is writable by others, not a regular file, not a
  // valid limits file of this version, or speaks for another ledger or tenant.
  static int openForShim(const std::string& ledgerDir, uint64_t ledgerIno, const std::string& tenant,
                         uint32_t brokerUid, std::unique_ptr<LimitsFile>* out, std::string* err);
  ~LimitsFile();
  LimitsFile(const LimitsFile&) = delete;
  LimitsFile& operator=(const LimitsFile&) = delete;

  // The first ready entry naming this device, or -1.
  int find(const uint8_t uuid[16]) const noexcept;
  // Entry e's UUID if it is ready.
  bool readyUuid(int e, uint8_t uuid[16]) const noexcept;
  const std::atomic<uint64_t>* limitWord(int e) const noexcept {
    return static_cast<uint32_t>(e) < kLedgerMaxDevices ? &hdr_->entries[e].limit : nullptr;
  }
  uint64_t limit(int e) const noexcept {
    return static_cast<uint32_t>(e) < kLedgerMaxDevices ? hdr_->entries[e].limit.load(std::memory_order_acquire) : 0;
  }
  // Entry e's burst_above (kLedgerNoLimit: no bursting; also for an entry out of range).
  uint64_t burstAbove(int e) const noexcept {
    return static_cast<uint32_t>(e) < kLedgerMaxDevices ? hdr_->entries[e].burst_above.load(std::memory_order_acquire)
                                                        : kLedgerNoLimit;
  }

  // The broker only. Publishes entry e with this limit; a ready entry keeps its UUID, and its
  // limit too when uuid names another device.
  void publish(int e, const uint8_t uuid[16], uint64_t limit) noexcept;
  void setLimit(int e, uint64_t limit) noexcept;
  void setBurstAbove(int e, uint64_t bytes) noexcept;
  void setEvictable(int e, uint64_t bytes) noexcept;
  uint64_t reclaimTarget(int e) const noexcept {
    return static_cast<uint32_t>(e) < kLedgerMaxDevices ? hdr_->entries[e].reclaim_target.load(std::memory_order_acquire)
                                                        : kLedgerNoLimit;
  }
  uint64_t reclaimSeq(int e) const noexcept {
    return static_cast<uint32_t>(e) < kLedgerMaxDevices ? hdr_->entries[e].reclaim_seq.load(std::memory_order_acquire) : 0;
  }
  bool plainBurstsOn(int e) const noexcept {
    return static_cast<uint32_t>(e) < kLedgerMaxDevices && ((hdr_->plain_mask.load(std::memory_order_acquire) >> e) & 1u);
  }
  uint64_t reclaimWaitMs() const noexcept { return hdr_->reclaim_wait_ms.load(std::memory_order_acquire); }
  // The broker: a new target for entry e (kLedgerNoLimit: none); the sequence moves when it changes.
  void setReclaimTarget(int e, uint64_t bytes) noexcept;
  void setPlainMask(uint64_t mask, uint64_t waitMs) noexcept;
  uint64_t evictable(int e) const noexcept {
    return static_cast<uint32_t>(e) < kLedgerMaxDevices ? hdr_->entries[e].evictable.load(std::memory_order_acquire) : 0;
  }
  // The file's path and identity.
  const std::string& path() const { return path_; }
  uint64_t ino() const noexcept { return ino_; }

 private:
  LimitsFile() = default;
  LimitsHeader* hdr_ = nullptr;
  bool writable_ = false;
  uint64_t ino_ = 0;
  std::string path_;
};

// The broker: creates <ledgerDir>/limits (0711, the caller's) or checks it is the caller's and
// writable by nobody else; anything else there (a file or directory a tenant planted while an
// older version left the name free) is swapped atomically with a fresh directory and stays under
// limits.aside-XXXXXX. False with *err.
bool prepareLimitsDir(const std::string& ledgerDir, std::string* err);

}  // namespace cushare
