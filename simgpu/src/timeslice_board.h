// The host-wide time-slice board of one simulated device: <SIMGPU_STATE_DIR>/timeslice-<dev>.
//
// Every process runs its own device engine (engine.h) for its own contexts; the board decides
// which process may dispatch (without MPS, contexts of different processes never run at the same
// time, and the one that runs has every SM, so per-process engines are exact for it). Lock-free:
// one 64-bit word, `holder`, names the holding slot and the device time its window ends; every
// change is one compare-and-swap, so a process killed at any instant (kill -9 included) leaves a
// valid board: its window simply expires and the next process takes the device. No daemon exists
// that could die. Slots are claimed by CAS on pid and reclaimed from dead pids (kill(pid, 0)).
//
// Protocol (device_time.cpp): a slot with work publishes `wants`. The holder renews its window
// by one slice while nobody else wants; it releases at once (holder = 0, freeSinceNs = when) when
// it has no work. Any other slot with work takes the device once the window has ended (or the
// holder is dead), starting at max(its engine's time, the end) plus the switch cost when the
// device last ran another slot; the previous holder waits a grace period before taking it back.
// Each slot also publishes what its engine ran (ground truth for NVML and simgpu-smi).
//
// ABI: bump kBoardVersion when the layout changes; sizes are static_asserted.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

namespace simgpu {

inline constexpr uint64_t kBoardMagic = 0x3144524f4254534dull;  // "MSTBORD1"
inline constexpr uint32_t kBoardVersion = 1;
inline constexpr uint32_t kBoardSlots = 128;

struct BoardSlot {
  std::atomic<int32_t> pid;     // 0: free
  std::atomic<uint32_t> wants;  // 1: has work for the device
  // What this process's engine ran on the device, cumulative (engine.h ContextStats, summed).
  std::atomic<uint64_t> busyNs;
  std::atomic<uint64_t> busySmNs;
  std::atomic<uint64_t> blocksRun;
  std::atomic<uint64_t> kernelsRun;
  std::atomic<uint64_t> slicedOutNs;
  std::atomic<uint64_t> updatedNs;  // device time of the last update
  uint64_t reserved;
};
static_assert(sizeof(BoardSlot) == 64);

struct Board {
  std::atomic<uint64_t> magic;
  uint32_t version;
  uint32_t slots;
  std::atomic<uint64_t> holder;       // 0 free, else (slot + 1) << 56 | window end in us
  std::atomic<uint64_t> freeSinceNs;  // device time the last holder released the device
  std::atomic<uint32_t> lastRan;      // slot + 1 whose context state is on the device
  uint32_t pad;
  std::atomic<uint64_t> switches;
  uint64_t reserved[2];
  BoardSlot slot[kBoardSlots];
};
static_assert(sizeof(Board) == 64 + 64 * kBoardSlots);

inline uint64_t boardPack(int slot, uint64_t endNs) {
  return (static_cast<uint64_t>(slot + 1) << 56) | ((endNs + 999) / 1000 & ((1ull << 56) - 1));
}
inline int boardSlotOf(uint64_t h) { return static_cast<int>(h >> 56) - 1; }
inline uint64_t boardEndOf(uint64_t h) { return (h & ((1ull << 56) - 1)) * 1000; }

// Maps the board of device `dev` under `dir` (created on first use); nullptr with *error.
Board* openBoard(const std::string& dir, int dev, std::string* error);
// Whether process pid lives (a slot or holder of a dead process is free).
bool pidAlive(int32_t pid);

}  // namespace simgpu
