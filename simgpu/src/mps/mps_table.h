// The host-wide table of simulated MPS clients: <SIMGPU_STATE_DIR>/mps-clients, mapped by every
// client, so that anything on the host (the device-time engine, simgpu-smi, tests) can see which
// server each client process belongs to, its SM cap and its priority.
// Interface notes for the engine: /work/notes/mps-engine-interface.md, docs/simgpu.md "MPS".
//
// Invariants:
// - A separate file from the `state` file, with its own magic and version (bump kMpsTableVersion
//   when the layout changes); a file of another layout is refused, never reinterpreted.
// - An entry is written only by its client. It claims an entry whose pid is 0 or names a dead
//   process by a CAS to -its pid, fills the fields, then stores its pid with release; a reader
//   that loads pid > 0 with acquire sees the fields. A client clears its entry at exit; a killed
//   client's entry stays until reclaimed, so readers treat an entry of a dead pid as free.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>

namespace simgpu {

inline constexpr uint64_t kMpsTableMagic = 0x53504d5550474953ull;  // "SIGPUMPS"
inline constexpr uint32_t kMpsTableVersion = 1;
inline constexpr int kMpsTableEntries = 1024;
inline constexpr int kMpsTableLimits = 12;  // devices whose pinned limit the entry records

enum MpsClientState : uint32_t { kMpsActive = 1, kMpsTerminated = 2, kMpsFaulted = 3 };

struct MpsTableHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t entry_count;
  uint64_t file_size;
  uint64_t reserved;
};

struct MpsClientEntry {
  std::atomic<int32_t> pid;  // > 0: the client; 0: free; < 0: being written
  int32_t server_pid;        // the server: one context to the time-slicing scheduler
  uint32_t uid;
  uint32_t sm_cap;           // SMs its blocks may occupy at once
  uint32_t thread_pct_x10;   // effective active thread percentage x 10
  int32_t priority;          // 0 normal, 1 below normal
  std::atomic<uint32_t> state;  // MpsClientState
  uint32_t reserved;
  uint64_t pinned_limit[kMpsTableLimits];  // bytes per device, 0: none
};
static_assert(sizeof(MpsTableHeader) == 32);
static_assert(sizeof(MpsClientEntry) == 128);
static_assert(std::atomic<int32_t>::is_always_lock_free && std::atomic<uint32_t>::is_always_lock_free);

class MpsTable {
 public:
  // Maps (creating if needed) the table in dir; nullptr and *error on a mismatch or system error.
  static MpsTable* open(const std::string& dir, std::string* error);
  // Claims an entry for this process and publishes e (its pid field is ignored); nullptr if full.
  MpsClientEntry* publish(const MpsClientEntry& e);
  // Every live client's entry.
  void forEach(const std::function<void(const MpsClientEntry&)>& f) const;
  // The live entry of pid, or nullptr.
  const MpsClientEntry* find(pid_t pid) const;

 private:
  MpsTableHeader* hdr_ = nullptr;
  MpsClientEntry* entries_ = nullptr;
};

}  // namespace simgpu
