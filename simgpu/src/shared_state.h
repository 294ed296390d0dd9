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
// - The layout is versioned (kStateVersion); a file with another magic/version/size or another
//   device configuration is refused with a clear error, never reinterpreted.
#pragma once

#include <pthread.h>

#include <atomic>
#include <cstdint>
#include <string>

namespace simgpu {

inline constexpr uint64_t kStateMagic = 0x5354415447504953ull;  // "SIMGPSTAT" (little endian)
inline constexpr uint32_t kStateVersion = 2;
inline constexpr int kMaxDevices = 16;
inline constexpr int kMaxSlots = 1024;

struct ProcSlot {
  std::atomic<int32_t> pid;  // 0: free
  uint32_t reserved;
  std::atomic<uint64_t> used[kMaxDevices];
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
};

static_assert(std::atomic<uint64_t>::is_always_lock_free);
static_assert(sizeof(ProcSlot) == 8 + 8 * kMaxDevices);

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

  // Reserves bytes on dev for this process; false if the device is full (after reaping the dead).
  bool reserve(int dev, uint64_t bytes);
  // Returns bytes previously reserved by this process.
  void release(int dev, uint64_t bytes);
  // Returns the usage of dead processes; true if anything was returned.
  bool reap();

  struct ProcUsage {
    int32_t pid;
    uint64_t used;
  };
  // Live processes with memory on dev (reaps first). Returns the number written (<= max), and
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
  void lockDevice(int dev);
  void unlockDevice(int dev);

  std::string path_;
  int fd_ = -1;           // this process's own open file description (holds the slot lock)
  int fdPid_ = 0;         // pid that opened fd_ (a forked child opens its own)
  int slot_ = -1;
  StateHeader* hdr_ = nullptr;
  ProcSlot* slots_ = nullptr;
};

}  // namespace simgpu
