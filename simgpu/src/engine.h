// The device-time engine: a discrete-event model of one simulated GPU's multiprocessors.
//
// Pure logic with an explicit clock: nothing here reads the wall clock, sleeps or takes a lock.
// The caller owns time: it submits kernels at now() and moves time forward with advanceTo(t);
// in the driver device_time.cpp does that against the steady clock, in unit
// tests the test does it (the virtual clock). Deterministic: the same calls give the same times.
//
// What is modelled (docs/simgpu.md, "Device time"):
// - SMs with occupancy limits (threads, blocks, registers, shared memory per SM). A kernel's
//   blocks are placed on SMs breadth-first (round-robin over the SMs that have room), so a grid
//   larger than the device runs in waves; each block lasts the kernel's block time.
// - Contexts. Each belongs to a time-slice group: without MPS a group is one context; an MPS
//   server with all its clients is one group. Only the active group dispatches. A group keeps
//   the device for a slice while others wait; at the slice's end its running blocks are saved
//   (compute preemption) and resume, with the time they had left, in its next slice. Switching
//   costs switchNs of idle device. Work-conserving: a group with nothing to run yields at once.
// - Within the active group: waiting blocks are dispatched in order of the context's client
//   priority (MPS; lower value first), then stream priority (lower value first, as CUDA), then
//   submission order. Running blocks are never preempted by priority. Blocks saved at a slice's
//   end are restored first when their group runs again (a context switch restores the context
//   as it was), whatever the priorities of work that arrived meanwhile.
// - A context's smCap (MPS active thread percentage) bounds how many distinct SMs hold its blocks
//   at once; not a reservation (contexts may share SMs).
// - Time-boxed kernels (the probe kernels' twins, probe_twin.h): blocks run until the kernel's
//   first block's start + timeBoxNs, whenever they (re)start; a traced kernel's blocks' starts,
//   saves and ends go to the BlockObserver (block indices are kept through saves and restores).
// Invariants: every kernel completes exactly once; counters only grow; now() never goes back.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <queue>
#include <vector>

namespace simgpu {

// Per-SM limits of an H100/H200 (compute capability 9.0), from NVIDIA's CUDA C++ Programming
// Guide ("Features and Technical Specifications") and the Hopper tuning guide.
struct SmLimits {
  uint32_t threads = 2048;     // resident threads per SM
  uint32_t blocks = 32;        // resident blocks per SM
  uint32_t registers = 65536;  // 32-bit registers per SM
  uint32_t sharedBytes = 233472;  // 228 KiB of shared memory per SM available to blocks
};

struct EngineParams {
  uint32_t sms = 132;
  SmLimits limits;
  uint64_t sliceNs = 2'000'000;  // time slice between groups (a guess, see docs/simgpu.md)
  uint64_t switchNs = 25'000;    // cost of a context switch (a guess)
};

// What one launch asks of the device.
struct KernelShape {
  uint64_t blocks = 1;
  uint32_t threadsPerBlock = 1;
  uint32_t registersPerThread = 0;  // 0: unknown (not limiting)
  uint32_t sharedPerBlock = 0;      // bytes: static + dynamic (+ the reserved 1 KiB)
  uint64_t blockNs = 0;             // how long each block runs
  // Time-boxed blocks (the probe kernels' twins): > 0 makes each block run until the kernel's
  // first block's start + timeBoxNs instead of blockNs; a block (re)started after that instant
  // runs blockNs (a late block writing its record), or what it had left of it.
  uint64_t timeBoxNs = 0;
  // Report every block's start, save and end to the engine's BlockObserver (setBlockObserver).
  bool traceBlocks = false;
};

// What the engine did with blocks of a traced kernel (KernelShape::traceBlocks): blocks
// [firstBlock, firstBlock + count) (indices in the grid, 0-based) started or resumed on SM `sm`,
// were saved out of it (a slice or the process's window ended), or ended, at device time `ns`.
struct BlockEvent {
  enum Kind : uint8_t { kStart, kSave, kEnd };
  Kind kind;
  uint32_t sm;
  uint32_t count;
  uint64_t kernel;
  uint64_t firstBlock;
  uint64_t ns;
};

// How many blocks of `k` fit on one empty SM (0: the kernel can never run).
uint32_t blocksPerSm(const KernelShape& k, const SmLimits& l);

// Ground truth per context (what the engine really gave it).
struct ContextStats {
  uint64_t busySmNs = 0;     // sum over time of the SMs holding at least one of its blocks
  uint64_t busyNs = 0;       // time with at least one of its blocks running
  uint64_t blocksRun = 0;    // blocks completed
  uint64_t kernelsRun = 0;   // kernels completed
  uint64_t slicedOutNs = 0;  // time it had work while another group held the device (or switching)
};

class Engine {
 public:
  // Called when a kernel completes, with its id and completion time (inside advanceTo/submit).
  using Completion = std::function<void(uint64_t kernel, uint64_t endNs)>;

  // Called for each BlockEvent of traced kernels (inside submit/advanceTo/setWindow), in time
  // order; a kernel's kEnd events all come before its Completion.
  using BlockObserver = std::function<void(const BlockEvent&)>;

  explicit Engine(const EngineParams& p, Completion done = {});
  void setBlockObserver(BlockObserver o) { observe_ = std::move(o); }

  // A context. group: its time-slice group; smCap: most SMs it may occupy at once (0 or >= sms:
  // all); clientPriority: MPS client priority (0 normal, 1 below normal).
  int addContext(uint64_t group, uint32_t smCap = 0, int clientPriority = 0);
  // Drops a context's waiting work (its process died or it was destroyed); its running blocks
  // finish. Kernels dropped never complete. The context stays known to its stats.
  void dropContext(int ctx);

  // Queues a kernel at now(); returns its id (> 0). A kernel whose block cannot fit an SM, or with
  // no blocks, completes at once (the driver refuses such launches before they get here).
  uint64_t submit(int ctx, int streamPriority, const KernelShape& k);

  // The process-wide gate of cross-process time slicing: blocks dispatch only while now() is in
  // [start, end); at `end` every running block is saved (as at a slice's end) and resumes in the
  // next window. Default: always open.
  void setWindow(uint64_t start, uint64_t end);
  uint64_t windowEnd() const { return winEnd_; }
  bool windowOpen() const { return now_ >= winStart_ && now_ < winEnd_; }

  // Runs the model up to time t (>= now()).
  void advanceTo(uint64_t t);
  uint64_t now() const { return now_; }
  // The next time something happens (a block ends, a slice ends, a switch completes);
  // UINT64_MAX when nothing is running or waiting.
  uint64_t nextEventTime() const;
  bool idle() const { return kernels_.empty(); }

  const ContextStats& stats(int ctx) const { return ctxs_[ctx].stats; }
  int contextCount() const { return static_cast<int>(ctxs_.size()); }
  uint64_t deviceBusyNs() const { return deviceBusyNs_; }  // time with any block running
  // The whole engine as one process's ground truth: busyNs and busySmNs count time and SMs with a
  // block of any context (SMs shared by contexts once), blocks and kernels of every context,
  // slicedOutNs the time some context had work while the process's window was closed or a
  // switch was in progress.
  const ContextStats& totals() const { return totals_; }
  uint64_t switches() const { return switches_; }
  // SMs holding at least one block of ctx right now.
  uint32_t smsInUse(int ctx) const { return ctxs_[ctx].smsUsed; }

 private:
  struct Pending {  // blocks waiting to (re)start, each with remainingNs to run
    uint64_t count;
    uint64_t remainingNs;
    bool saved = false;  // preempted at a slice's end: restored before anything new dispatches
    uint64_t firstBlock = 0;  // grid indices [firstBlock, firstBlock + count)
  };
  struct Kernel {
    uint64_t id;
    int ctx;
    int streamPriority;
    KernelShape shape;
    uint32_t perSm;               // blocks per empty SM
    std::deque<Pending> waiting;  // preempted blocks first, then fresh ones
    uint64_t waitingBlocks = 0;
    uint64_t running = 0;         // blocks on SMs
    uint64_t deadline = 0;        // time-boxed: the first block's start + timeBoxNs (0: none yet)
  };
  struct Run {  // `count` blocks of one kernel on one SM, ending at `end`
    uint64_t end;
    uint64_t kernel;
    uint32_t sm;
    uint32_t count;
    uint64_t seq;  // tie-break for determinism
    uint64_t firstBlock;  // grid indices [firstBlock, firstBlock + count)
    bool operator>(const Run& o) const { return end != o.end ? end > o.end : seq > o.seq; }
  };
  struct Sm {
    uint32_t threads = 0, blocks = 0, registers = 0, shared = 0;
  };
  struct Ctx {
    uint64_t group;
    uint32_t smCap;
    int clientPriority;
    bool dropped = false;
    std::vector<uint32_t> perSm;  // blocks of this context on each SM
    uint32_t smsUsed = 0;
    uint64_t runningBlocks = 0;
    uint64_t waitingBlocks = 0;
    ContextStats stats;
  };

  bool groupHasWork(uint64_t g) const;
  bool othersWaiting(uint64_t g) const;
  void schedule();  // slice and switch decisions at now_
  void dispatch();  // places waiting blocks of the active group
  void place(Kernel& k, Ctx& c, bool savedOnly);
  uint32_t fits(const Sm& sm, const KernelShape& s) const;
  void take(uint32_t sm, Kernel& k, Ctx& c, uint32_t n, const Pending& p, uint64_t firstBlock);
  void observe(BlockEvent::Kind kind, const Kernel& k, uint32_t sm, uint32_t count, uint64_t firstBlock) const;
  void release(const Run& r, Kernel& k, Ctx& c);
  void preemptGroup(uint64_t g, bool all = false);
  void account(uint64_t dt);
  void finishIfDone(uint64_t id);

  EngineParams p_;
  Completion done_;
  BlockObserver observe_;
  uint64_t now_ = 0;
  uint64_t nextKernel_ = 1;
  uint64_t runSeq_ = 0;
  std::vector<Sm> sms_;
  std::vector<Ctx> ctxs_;
  std::map<uint64_t, Kernel> kernels_;  // by id = submission order
  std::priority_queue<Run, std::vector<Run>, std::greater<Run>> runs_;
  // Time slicing
  bool haveActive_ = false;
  uint64_t active_ = 0;        // the group that may dispatch
  uint64_t lastRan_ = 0;       // the group whose state is on the device (switch cost when it changes)
  bool haveLastRan_ = false;
  uint64_t sliceEnd_ = 0;
  uint64_t switchEnd_ = 0;     // no dispatch before this (a switch in progress)
  uint64_t rrCursor_ = 0;      // round-robin: the next group to consider after `active_`
  uint64_t winStart_ = 0;
  uint64_t winEnd_ = UINT64_MAX;
  uint64_t deviceBusyNs_ = 0;
  uint32_t smsBusy_ = 0;  // SMs holding at least one block
  ContextStats totals_;
  uint64_t switches_ = 0;
  uint64_t runningTotal_ = 0;
};

}  // namespace simgpu
