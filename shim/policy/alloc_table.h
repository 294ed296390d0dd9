// Process-local record of what each live allocation charged to the tenant ledger, so a free
// returns exactly that (the driver's free calls carry no size). Sharded by address so threads
// allocating concurrently rarely share a lock; the locks are process-local and never held across
// a driver call.
#pragma once

#include <cstdint>
#include <mutex>
#include <unordered_map>

namespace cushare::shim {

struct Charge {
  int32_t device = -1;  // ledger device index
  uint64_t bytes = 0;
};

class AllocTable {
 public:
  void put(uintptr_t key, Charge c) noexcept {
    Shard& s = shard(key);
    std::lock_guard<std::mutex> g(s.mu);
    try {
      s.map[key] = c;
    } catch (...) {
      // Out of host memory: the charge stays in the ledger (over-counted, never under-counted).
    }
  }
  // Removes and returns the charge for key; false if there is none.
  bool take(uintptr_t key, Charge* out) noexcept {
    Shard& s = shard(key);
    std::lock_guard<std::mutex> g(s.mu);
    auto it = s.map.find(key);
    if (it == s.map.end()) return false;
    *out = it->second;
    s.map.erase(it);
    return true;
  }

 private:
  static constexpr int kShards = 64;
  struct alignas(64) Shard {
    std::mutex mu;
    std::unordered_map<uintptr_t, Charge> map;
  };
  Shard& shard(uintptr_t key) noexcept { return shards_[(key >> 12) % kShards]; }
  Shard shards_[kShards];
};

}  // namespace cushare::shim
