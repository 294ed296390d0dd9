// The simulated devices' host-wide state: one file under SIMGPU_STATE_DIR, mapped by every process
// that uses simgpu (the driver and NVML), so that one process's allocations lower the free memory
// that all processes see, as on a real GPU.
//
// Invariants:
// - used[d] in the header is the sum of used[d] over all process slots not yet reaped. Both are
//   changed together under the device's lock, a process-shared robust mutex in the file: a
//   process killed inside that critical section (kill -9 between the two updates) hands the lock
//   to the next taker with EOWNERDEAD, who rebuilds used[d] from the slots, the source of truth.
//   So no interleaving over-commits and no kill leaks or double-frees accounting. The lock is a
//   futex: uncontended it costs two atomic operations and no system call.
// - A slot is owned by whoever holds an OFD write lock on its lock byte. The kernel drops the lock
//   when the owner dies (kill -9 included), so a slot whose lock can be taken belongs to a dead
//   process: whoever takes it first returns its usage to the header (exactly once, because the lock
//   is exclusive) and frees the slot. reap() does this for all slots.
// - Shareable physical memory (VMM allocations made exportable as a file descriptor) outlives
//   the process that made it, as on a real device, for as long as any handle or exported
//   descriptor refers to it anywhere. Such memory is counted in used[d] through a shared entry
//   rather than a process slot. Its backing file (<dir>/vmm-<id>) is the witness: every open file
//   description that keeps the memory alive (a driver handle's, an exported descriptor's, with
//   all its duplicates, across fork and SCM_RIGHTS) holds an OFD read lock on it, so the memory is
//   unreferenced exactly when a write lock can be taken. Whoever takes it (reapShared) returns the
//   bytes and removes the file, exactly once.
// - Managed memory takes device memory only while resident (populated on the device by a touch or
//   a prefetch): a slot's managed[d] is the resident part of its used[d]. Ordinary allocations and
//   populations that find the device full evict resident managed memory (never anything else) to
//   host memory, under the device's lock: from the processes whose oldest resident chunk migrated
//   in first (the driver's "least recently migrated in"), taken from their managed[d] and used[d]
//   and added to their evicted[d]. The owner applies evicted[d] to its own chunk table (its oldest
//   chunks go to the host) under the same lock the next time it handles managed memory
//   (SharedState::settleManaged), so what its table shows resident always matches managed[d]
//   after settling.
// - The layout is versioned (kStateVersion); a file with another magic/version/size or another
//   device configuration is refused with a clear error, never reinterpreted.
#pragma once

#include <pthread.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>

namespace simgpu {

inline constexpr uint64_t kStateMagic = 0x5354415447504953ull;  // "SIMGPSTAT" (little endian)
inline constexpr uint32_t kStateVersion = 6;  // 5: resident managed memory (ProcSlot::managed...); 6: migration counts
inline constexpr int kMaxDevices = 16;
inline constexpr int kMaxSlots = 1024;
inline constexpr int kMaxShared = 4096;

struct ProcSlot {
  std::atomic<int32_t> pid;  // 0: free
  std::atomic<uint32_t> contexts;  // bit d: the process has a live context on host device d
  std::atomic<uint64_t> used[kMaxDevices];
  // The MIG device the process runs in (SharedState::enterMig): (host device + 1) | (GI + 1) << 8 |
  // (CI + 1) << 16; 0 for none. Its memory on that device counts to the GPU instance's too.
  std::atomic<uint32_t> mig;
  uint32_t reserved;
  // Managed memory on host device d (see the invariants): bytes resident (part of used[d]); bytes
  // evicted from this process by the driver, cumulative (the owner settles them); the migration
  // sequence of its oldest resident chunk (UINT64_MAX: none), which the owner publishes.
  std::atomic<uint64_t> managed[kMaxDevices];
  std::atomic<uint64_t> evicted[kMaxDevices];
  std::atomic<uint64_t> oldestIn[kMaxDevices];
};

struct StateHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t header_size;
  uint64_t file_size;
  uint32_t device_count;
  uint32_t slot_count;
  uint64_t capacity[kMaxDevices];
  uint32_t sm_count;
  uint32_t reserved0;
  std::atomic<uint64_t> used[kMaxDevices];
  std::atomic<uint64_t> generation;  // bumped on every reap that returned memory
  pthread_mutex_t lock[kMaxDevices];  // robust, process-shared; guards used[d] and slots' used[d]
  std::atomic<uint64_t> next_shared_id;
  std::atomic<uint64_t> migrate_seq;  // +1 for every managed chunk made resident (LRU order)
  // Managed memory moved on host device d, cumulative since the file was made: bytes made resident
  // (populated by a touch or a prefetch), and bytes the driver evicted to the host for room.
  std::atomic<uint64_t> migrated_in[kMaxDevices];
  std::atomic<uint64_t> evicted_out[kMaxDevices];
};

// A shareable allocation's entry: id 0 is free; `ready` once its backing file exists and its
// creator's lock is on it (before that, only a dead creator frees it).
struct SharedAlloc {
  std::atomic<uint64_t> id;
  std::atomic<uint32_t> ready;
  int32_t device;
  int32_t creator;  // pid
  uint32_t reserved;
  uint64_t bytes;
};

static_assert(std::atomic<uint64_t>::is_always_lock_free);
static_assert(sizeof(ProcSlot) == 8 + 8 * kMaxDevices + 8 + 3 * 8 * kMaxDevices);

struct DeviceConfig;  // config.h

class SharedState {
 public:
  // Maps (creating if needed) the state file for this configuration. Returns nullptr and sets
  // *error on any mismatch or system error.
  static SharedState* open(const std::string& dir, int deviceCount, const uint64_t* capacity,
                           uint32_t smCount, std::string* error);

  int deviceCount() const { return static_cast<int>(hdr_->device_count); }
  uint64_t capacity(int dev) const { return hdr_->capacity[dev]; }
  uint64_t used(int dev) const { return hdr_->used[dev].load(std::memory_order_acquire); }
  // Managed memory moved on dev since the state file was made (every process): bytes made resident
  // and bytes evicted to the host for room (simgpu-smi --json shows them: thrashing is judged by them).
  uint64_t migratedIn(int dev) const { return hdr_->migrated_in[dev].load(std::memory_order_acquire); }
  uint64_t evictedOut(int dev) const { return hdr_->evicted_out[dev].load(std::memory_order_acquire); }

  // Reserves bytes on dev for this process; false if the device is full after reaping the dead
  // and evicting resident managed memory (of any process sharing the memory) to the host.
  bool reserve(int dev, uint64_t bytes);

  // Managed memory residency of this process on host device dev (the owner's side; see the
  // invariants). The owner keeps its chunks in a table of its own and passes two callbacks, both
  // called under dev's lock: dropOldest(bytes) sends its oldest resident chunks on dev to the host
  // until at least bytes went (or none is left) and returns how many bytes went; oldest() returns
  // the migration sequence of its oldest resident chunk on dev (UINT64_MAX: none).
  struct ManagedOwner {
    std::function<uint64_t(uint64_t)> dropOldest;
    std::function<uint64_t()> oldest;
  };
  // Makes bytes resident for this process (a chunk being populated): evicts other resident managed
  // memory (this process's own oldest chunks included) if the device is full; false if even that
  // leaves no room. *seq receives the chunk's migration sequence.
  bool makeResident(int dev, uint64_t bytes, const ManagedOwner& owner, uint64_t* seq);
  // Chunks of this process leave dev (sent to the host or freed): settles first, then runs change,
  // which marks them on the host in the owner's table and returns their bytes (only those still
  // resident after the settle), which are returned to the device. Both under dev's lock.
  void dropResident(int dev, const ManagedOwner& owner, const std::function<uint64_t()>& change);
  // Applies what the driver evicted from this process since the last call to its table.
  void settleManaged(int dev, const ManagedOwner& owner);

  // Returns bytes previously reserved by this process.
  void release(int dev, uint64_t bytes);
  // Returns the usage of dead processes and of unreferenced shareable memory; true if anything
  // was returned.
  bool reap();

  // Shareable memory (see the invariants above). reserveShared counts bytes on dev in a new
  // entry and creates its backing file, sized, with a read lock held through the returned
  // descriptor (O_CLOEXEC); -1 if the device is full or on a system error.
  int reserveShared(int dev, uint64_t bytes, uint64_t* id);
  // Opens a new open file description of the backing file behind fd (any descriptor of it) with
  // a read lock of its own; -1 if fd is not simgpu shareable memory. *id and *dev describe it.
  int openShared(int fd, uint64_t* id, int* dev);
  // Returns entry id's bytes if nothing refers to its memory any more; true if it did.
  bool reapShared(uint64_t id);

  // Trivially constructible (callers keep arrays of kMaxSlots on their stacks; processes() writes
  // every field of what it returns).
  struct ProcUsage {
    int32_t pid;
    uint64_t used;
    uint32_t gi, ci;  // its MIG device on dev; none: 0xFFFFFFFF
  };
  // This process runs in MIG device (gi, ci) of host device dev, whose GPU instance has
  // giCapacity bytes: from now on its reservations on dev also fit in what the GPU instance's
  // processes hold (every process of the host, counted from the slots). A forked child carries it.
  // It claims the process's slot at once, so that the instance is in use from then on
  // (instanceInUse) even before the process holds memory or a context. False if no slot.
  bool enterMig(int dev, unsigned gi, unsigned ci, uint64_t giCapacity);
  void leaveMig();  // undoes enterMig (the instance went while the process was entering it)
  // Whether a live process entered GPU instance gi (and compute instance ci; ~0u: any) of dev.
  bool instanceInUse(int dev, unsigned gi, unsigned ci);
  // Bytes the processes in GPU instance gi of host device dev hold (dead ones not reaped yet
  // included: callers reap first, as for used()).
  uint64_t instanceUsed(int dev, unsigned gi);
  // The calling process has (on) or no longer has (off) a live context on device dev: NVML lists
  // a process with a context on a device even when it holds no memory there, as the real driver
  // does. False if the process could get no slot.
  bool setContext(int dev, bool on);
  // Live processes with a context or memory on dev (reaps first); shareable memory counts for
  // the process that made it while that process lives. Returns the number written (<= max), and
  // the total number found in *total.
  int processes(int dev, ProcUsage* out, int max, int* total);

  const std::string& path() const { return path_; }

 private:
  int ownFd();
  static void registerForFork(SharedState* s);
  void dropInheritedLockFd();
  bool claimSlot();
  bool tryLockSlot(int i, int fd);
  void unlockSlot(int i, int fd);
  bool reapSlot(int i);
  bool reapSharedEntry(int i);
  std::string sharedPath(uint64_t id) const;
  void lockDevice(int dev);
  void unlockDevice(int dev);
  // Under dev's lock: frees need bytes of resident managed memory (processes sharing this one's
  // memory, oldest migration first) or none; true if it did.
  bool evictLocked(int dev, uint64_t need);
  void settleLocked(int dev, const ManagedOwner& owner);
  // How many bytes must go for bytes more to fit on dev (and in this process's GPU instance).
  uint64_t shortfallLocked(int dev, uint64_t bytes) const;
  bool sameMemory(uint32_t tag, int dev) const;
  uint64_t settled_[kMaxDevices] = {};  // evicted[d] already applied to the owner's table

  std::string dir_;
  std::string path_;
  int fd_ = -1;           // this process's own open file description (holds the slot lock)
  int fdPid_ = 0;         // pid that opened fd_ (a forked child opens its own)
  int slot_ = -1;
  uint32_t migTag_ = 0;          // enterMig's, stored in every slot this process claims
  uint64_t giCapacity_ = 0;
  uint64_t instanceUsedLocked(int dev, unsigned gi) const;
  StateHeader* hdr_ = nullptr;
  ProcSlot* slots_ = nullptr;
  SharedAlloc* shared_ = nullptr;
};

}  // namespace simgpu
