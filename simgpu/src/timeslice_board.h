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
// by one slice while nobody else wants (from its own step's time when that is past the window's
// end: a process kept off the CPU loses nothing nobody else wanted); it releases at once
// (holder = 0, freeSinceNs = when) when it has no work. Any other slot with work takes the device
// once the window has ended (or the holder is dead), starting at max(its engine's time, the end)
// plus the switch cost when the device last ran another slot; the previous holder waits a grace
// period before taking it back.
// Each slot also publishes what its engine ran (ground truth for NVML and simgpu-smi).
//
// MPS: a simulated MPS server (simgpu/mps/server_main.cpp) runs all its clients' work in one
// engine and takes part as ONE slot (mpsServer = 1), as the real server is one context to the time
// slicer. It publishes what each client got in `client` entries: pid = the client, server = its
// server's pid. An entry is written only by its server: it claims one whose pid is 0, or whose
// client or server is dead, by a CAS of pid to -(server pid), fills it, then stores the client's
// pid (release); it clears pid when the client hangs up. Readers take an entry as live only when
// both its client and its server live, so a server killed at any moment leaves nothing visible.
//
// ABI: bump kBoardVersion when the layout changes; sizes are static_asserted.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

namespace simgpu {

inline constexpr uint64_t kBoardMagic = 0x3144524f4254534dull;  // "MSTBORD1"
inline constexpr uint32_t kBoardVersion = 2;
inline constexpr uint32_t kBoardSlots = 128;
inline constexpr uint32_t kBoardClients = 1024;  // MPS clients with published stats, all servers

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
  std::atomic<uint32_t> mpsServer;  // 1: an MPS server, its clients' stats in Board::client
  uint32_t reserved;
};
static_assert(sizeof(BoardSlot) == 64);

// What one MPS client got from its server's engine on this device (summed over its contexts).
struct BoardClient {
  std::atomic<int32_t> pid;     // the client; 0 free; < 0 being written by server -pid
  std::atomic<int32_t> server;  // its server's pid
  std::atomic<uint64_t> busyNs;
  std::atomic<uint64_t> busySmNs;
  std::atomic<uint64_t> blocksRun;
  std::atomic<uint64_t> kernelsRun;
  std::atomic<uint64_t> slicedOutNs;
  std::atomic<uint64_t> updatedNs;
  uint64_t reserved;
};
static_assert(sizeof(BoardClient) == 64);

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
  BoardClient client[kBoardClients];
};
static_assert(sizeof(Board) == 64 + 64 * kBoardSlots + 64 * kBoardClients);

inline uint64_t boardPack(int slot, uint64_t endNs) {
  return (static_cast<uint64_t>(slot + 1) << 56) | ((endNs + 999) / 1000 & ((1ull << 56) - 1));
}
inline int boardSlotOf(uint64_t h) { return static_cast<int>(h >> 56) - 1; }
inline uint64_t boardEndOf(uint64_t h) { return (h & ((1ull << 56) - 1)) * 1000; }

// Maps the board of device `dev` under `dir` (created on first use); nullptr with *error.
Board* openBoard(const std::string& dir, int dev, std::string* error);
// Whether process pid lives (a slot or holder of a dead process is free).
bool pidAlive(int32_t pid);

// One process's ground truth on a device, as NVML and simgpu-smi show it.
struct ProcessDeviceStats {
  int32_t pid = 0;
  int32_t mpsServer = 0;  // an MPS client: its server's pid
  bool isMpsServer = false;  // the server's own slot: the sum of its clients
  uint64_t busyNs = 0, busySmNs = 0, blocksRun = 0, kernelsRun = 0, slicedOutNs = 0;
  uint64_t updatedNs = 0;  // the engine's device time the counters are of
};

// Counters are published under a seqlock on updatedNs: the writer stores kBoardWriting, a release
// fence, the counters, then the engine's time (release). A reader retries while it sees
// kBoardWriting or updatedNs changed under it, so it gets one update's counters, consistent with
// their time (after 100 tries it takes what it read).
inline constexpr uint64_t kBoardWriting = UINT64_MAX;
template <typename Entry>
void readCounters(const Entry& e, ProcessDeviceStats* p) {
  for (int i = 0; i < 100; ++i) {
    const uint64_t t = e.updatedNs.load(std::memory_order_acquire);
    if (t == kBoardWriting) continue;
    p->busyNs = e.busyNs.load(std::memory_order_relaxed);
    p->busySmNs = e.busySmNs.load(std::memory_order_relaxed);
    p->blocksRun = e.blocksRun.load(std::memory_order_relaxed);
    p->kernelsRun = e.kernelsRun.load(std::memory_order_relaxed);
    p->slicedOutNs = e.slicedOutNs.load(std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_acquire);
    p->updatedNs = t;
    if (e.updatedNs.load(std::memory_order_relaxed) == t) return;
  }
}
// Every live process of the board: each slot (non-MPS processes and MPS servers), then each live
// MPS client of a live server.
template <typename F>
void forEachProcess(const Board& b, F&& f) {
  for (const BoardSlot& s : b.slot) {
    ProcessDeviceStats p;
    p.pid = s.pid.load(std::memory_order_acquire);
    if (!pidAlive(p.pid)) continue;
    p.isMpsServer = s.mpsServer.load(std::memory_order_relaxed) != 0;
    readCounters(s, &p);
    f(p);
  }
  for (const BoardClient& c : b.client) {
    ProcessDeviceStats p;
    p.pid = c.pid.load(std::memory_order_acquire);
    if (p.pid <= 0) continue;
    p.mpsServer = c.server.load(std::memory_order_relaxed);
    if (!pidAlive(p.pid) || !pidAlive(p.mpsServer)) continue;
    readCounters(c, &p);
    f(p);
  }
}

}  // namespace simgpu
