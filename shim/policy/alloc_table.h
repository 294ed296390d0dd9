// Process-local record of what each live allocation charged to the tenant ledger, so a free
// returns exactly that (the driver's free calls carry no size).
//
// Hot path: one insert per allocation and one removal per free. The table is sharded by address
// and each shard is an open-addressing array with linear probing and backward-shift deletion, so
// an insert or removal is a short spinlock section with no heap allocation (the array doubles,
// rarely, when a shard is 3/4 full). Shard locks are process-local and never held across a driver
// call. Keys are never 0 (no allocation lives at address 0).
#pragma once

#include <sched.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace cushare::shim {

// What a key names, so that the driver can be asked whether it still exists (a context reset
// frees what the context owned without a free call per allocation).
enum class ChargeKind : uint8_t { kPointer, kArray, kMipmappedArray };

struct Charge {
  int32_t device = -1;  // ledger device index
  ChargeKind kind = ChargeKind::kPointer;
  uint64_t bytes = 0;
};

class AllocTable {
 public:
  AllocTable() = default;
  AllocTable(const AllocTable&) = delete;
  AllocTable& operator=(const AllocTable&) = delete;

  // Records key -> c. If the table cannot grow (no host memory), the charge is kept in the ledger
  // anyway (over-counted, never under-counted).
  void put(uintptr_t key, Charge c) noexcept {
    Shard& s = shard(key);
    Lock g(s);
    if ((s.count + 1) * 4 > s.capacity * 3 && !grow(s)) return;
    insert(s, key, c);
  }

  // Removes and returns the charge for key; false if there is none.
  bool take(uintptr_t key, Charge* out) noexcept {
    Shard& s = shard(key);
    Lock g(s);
    if (s.capacity == 0) return false;
    const size_t mask = s.capacity - 1;
    size_t i = hash(key) & mask;
    while (s.slots[i].key != 0) {
      if (s.slots[i].key == key) {
        *out = s.slots[i].charge;
        erase(s, i);
        return true;
      }
      i = (i + 1) & mask;
    }
    return false;
  }

  // Calls f(key, charge) for every entry, one shard at a time with that shard locked: f must not
  // call the driver or this table. Not for the hot path (context teardown only).
  template <typename F>
  void forEach(F&& f) noexcept {
    for (Shard& s : shards_) {
      Lock g(s);
      for (size_t i = 0; i < s.capacity; ++i)
        if (s.slots[i].key) f(s.slots[i].key, s.slots[i].charge);
    }
  }

 private:
  struct Slot {
    uintptr_t key;
    Charge charge;
  };
  struct alignas(64) Shard {
    std::atomic<bool> locked{false};
    size_t capacity = 0;  // power of two, or 0 before first use
    size_t count = 0;
    Slot* slots = nullptr;
  };
  struct Lock {
    // Sections are a few dozen instructions, so a short spin almost always wins. Past it, the
    // holder has most likely been preempted (more allocating threads than cores, or a CPU quota):
    // spinning on would burn the rest of the time slice while it cannot run, so yield the CPU.
    // (perf/alloc_throughput.sh: 16 threads on 2 cores, 748 -> 178 CPU ns a pair; docs/performance.md.)
    explicit Lock(Shard& s) : s_(s) {
      int spins = 0;
      while (s_.locked.exchange(true, std::memory_order_acquire))
        while (s_.locked.load(std::memory_order_relaxed)) {
          if (++spins < kSpinsBeforeYield)
            __builtin_ia32_pause();
          else
            ::sched_yield();
        }
    }
    ~Lock() { s_.locked.store(false, std::memory_order_release); }
    Shard& s_;
  };

  static constexpr int kShards = 64;
  static constexpr int kSpinsBeforeYield = 128;
  static size_t hash(uintptr_t k) { return static_cast<size_t>((k >> 8) * 0x9E3779B97F4A7C15ull >> 16); }
  Shard& shard(uintptr_t key) noexcept { return shards_[((key >> 12) ^ (key >> 21)) % kShards]; }

  static void insert(Shard& s, uintptr_t key, Charge c) noexcept {
    const size_t mask = s.capacity - 1;
    size_t i = hash(key) & mask;
    while (s.slots[i].key != 0 && s.slots[i].key != key) i = (i + 1) & mask;
    if (s.slots[i].key == 0) ++s.count;
    s.slots[i] = Slot{key, c};
  }

  // Backward-shift deletion keeps every probe sequence unbroken without tombstones.
  static void erase(Shard& s, size_t i) noexcept {
    const size_t mask = s.capacity - 1;
    size_t j = i;
    for (;;) {
      j = (j + 1) & mask;
      if (s.slots[j].key == 0) break;
      const size_t home = hash(s.slots[j].key) & mask;
      // Move j back to i if its home is not cyclically in (i, j].
      if ((i <= j) ? (home <= i || home > j) : (home <= i && home > j)) {
        s.slots[i] = s.slots[j];
        i = j;
      }
    }
    s.slots[i].key = 0;
    --s.count;
  }

  static bool grow(Shard& s) noexcept {
    const size_t cap = s.capacity ? s.capacity * 2 : 256;
    auto* fresh = static_cast<Slot*>(std::calloc(cap, sizeof(Slot)));
    if (!fresh) return false;
    Slot* old = s.slots;
    const size_t oldCap = s.capacity;
    s.slots = fresh;
    s.capacity = cap;
    s.count = 0;
    for (size_t k = 0; k < oldCap; ++k)
      if (old[k].key) insert(s, old[k].key, old[k].charge);
    std::free(old);
    return true;
  }

  Shard shards_[kShards];
};

}  // namespace cushare::shim
