// The device-time engine (see engine.h for the model and its invariants).
#include "engine.h"

#include <algorithm>
#include <limits>

namespace simgpu {
namespace {
constexpr uint64_t kNever = std::numeric_limits<uint64_t>::max();
constexpr uint32_t kRegisterUnit = 256;  // registers are allocated per warp in units of 256

uint32_t registersPerBlock(const KernelShape& k) {
  if (k.registersPerThread == 0) return 0;
  const uint32_t warps = (k.threadsPerBlock + 31) / 32;
  const uint32_t perWarp = (k.registersPerThread * 32 + kRegisterUnit - 1) / kRegisterUnit * kRegisterUnit;
  return warps * perWarp;
}
}  // namespace

uint32_t blocksPerSm(const KernelShape& k, const SmLimits& l) {
  if (k.threadsPerBlock == 0 || k.threadsPerBlock > l.threads) return 0;
  uint32_t n = std::min(l.blocks, l.threads / k.threadsPerBlock);
  if (const uint32_t r = registersPerBlock(k)) n = std::min(n, l.registers / r);
  if (k.sharedPerBlock) n = std::min(n, l.sharedBytes / k.sharedPerBlock);
  return n;
}

Engine::Engine(const EngineParams& p, Completion done) : p_(p), done_(std::move(done)), sms_(p.sms) {}

int Engine::addContext(uint64_t group, uint32_t smCap, int clientPriority) {
  Ctx c;
  c.group = group;
  c.smCap = smCap == 0 || smCap > p_.sms ? p_.sms : smCap;
  c.clientPriority = clientPriority;
  c.perSm.assign(p_.sms, 0);
  ctxs_.push_back(std::move(c));
  return static_cast<int>(ctxs_.size()) - 1;
}

void Engine::dropContext(int ctx) {
  Ctx& c = ctxs_[ctx];
  c.dropped = true;
  for (auto it = kernels_.begin(); it != kernels_.end();) {
    Kernel& k = it->second;
    if (k.ctx != ctx) {
      ++it;
      continue;
    }
    c.waitingBlocks -= k.waitingBlocks;
    k.waitingBlocks = 0;
    k.waiting.clear();
    it = k.running == 0 ? kernels_.erase(it) : std::next(it);
  }
}

uint64_t Engine::submit(int ctx, int streamPriority, const KernelShape& s) {
  const uint64_t id = nextKernel_++;
  const uint32_t perSm = blocksPerSm(s, p_.limits);
  Ctx& c = ctxs_[ctx];
  if (s.blocks == 0 || perSm == 0 || c.dropped) {
    if (!c.dropped && done_) done_(id, now_);
    return id;
  }
  Kernel k{id, ctx, streamPriority, s, perSm, {}, s.blocks, 0};
  k.waiting.push_back(Pending{s.blocks, s.blockNs, false, 0});
  c.waitingBlocks += s.blocks;
  kernels_.emplace(id, std::move(k));
  schedule();
  dispatch();
  return id;
}

bool Engine::groupHasWork(uint64_t g) const {
  for (const Ctx& c : ctxs_)
    if (c.group == g && (c.waitingBlocks || c.runningBlocks)) return true;
  return false;
}

bool Engine::othersWaiting(uint64_t g) const {
  for (const Ctx& c : ctxs_)
    if (c.group != g && (c.waitingBlocks || c.runningBlocks)) return true;
  return false;
}

void Engine::setWindow(uint64_t start, uint64_t end) {
  winStart_ = start;
  winEnd_ = end;
  schedule();  // an open window dispatches at once
  dispatch();
}

void Engine::schedule() {
  if (!windowOpen()) {
    if (now_ >= winEnd_ && runningTotal_) preemptGroup(0, true);  // the process's window closed
    return;
  }
  if (switchEnd_ > now_) return;  // a switch is in progress
  const bool activeBusy = haveActive_ && groupHasWork(active_);
  if (activeBusy && (now_ < sliceEnd_ || !othersWaiting(active_))) {
    if (now_ >= sliceEnd_) sliceEnd_ = now_ + p_.sliceNs;  // nobody waits: a fresh slice
    return;
  }
  if (activeBusy) preemptGroup(active_);  // its slice is over and another group waits
  // Round robin over the groups with work: the first group id after the active one, wrapping.
  bool found = false;
  uint64_t best = 0, first = 0;
  bool haveFirst = false;
  for (const Ctx& c : ctxs_) {
    if (!(c.waitingBlocks || c.runningBlocks)) continue;
    if (activeBusy && c.group == active_) continue;
    if (!haveFirst || c.group < first) first = c.group, haveFirst = true;
    if (haveActive_ && c.group > active_ && (!found || c.group < best)) best = c.group, found = true;
  }
  if (!found && haveFirst) best = first, found = true;
  if (!found) {
    haveActive_ = false;
    return;
  }
  active_ = best;
  haveActive_ = true;
  if (haveLastRan_ && lastRan_ != best) {
    ++switches_;
    switchEnd_ = now_ + p_.switchNs;
  }
  lastRan_ = best;
  haveLastRan_ = true;
  sliceEnd_ = std::max(now_, switchEnd_) + p_.sliceNs;
}

void Engine::preemptGroup(uint64_t g, bool all) {
  std::vector<Run> keep;
  while (!runs_.empty()) {
    Run r = runs_.top();
    runs_.pop();
    Kernel& k = kernels_.at(r.kernel);
    Ctx& c = ctxs_[k.ctx];
    if (c.group != g && !all) {
      keep.push_back(r);
      continue;
    }
    release(r, k, c);
    if (c.dropped) {
      finishIfDone(k.id);
      continue;
    }
    observe(BlockEvent::kSave, k, r.sm, r.count, r.firstBlock);
    // Resumes with the time it had left.
    k.waiting.push_front(Pending{r.count, r.end - now_, true, r.firstBlock});
    k.waitingBlocks += r.count;
    c.waitingBlocks += r.count;
  }
  for (const Run& r : keep) runs_.push(r);
}

void Engine::dispatch() {
  if (!haveActive_ || switchEnd_ > now_ || !windowOpen()) return;
  std::vector<Kernel*> order;
  for (auto& [id, k] : kernels_)
    if (k.waitingBlocks && ctxs_[k.ctx].group == active_) order.push_back(&k);
  std::stable_sort(order.begin(), order.end(), [this](const Kernel* a, const Kernel* b) {
    const int pa = ctxs_[a->ctx].clientPriority, pb = ctxs_[b->ctx].clientPriority;
    if (pa != pb) return pa < pb;
    return a->streamPriority < b->streamPriority;  // then submission order (map order, stable)
  });
  for (Kernel* k : order) place(*k, ctxs_[k->ctx], true);  // restore the saved state first
  for (Kernel* k : order) place(*k, ctxs_[k->ctx], false);
}

uint32_t Engine::fits(const Sm& sm, const KernelShape& s) const {
  const SmLimits& l = p_.limits;
  uint32_t n = std::min(l.blocks - sm.blocks, (l.threads - sm.threads) / s.threadsPerBlock);
  if (const uint32_t r = registersPerBlock(s)) n = std::min(n, (l.registers - sm.registers) / r);
  if (s.sharedPerBlock) n = std::min(n, (l.sharedBytes - sm.shared) / s.sharedPerBlock);
  return n;
}

void Engine::place(Kernel& k, Ctx& c, bool savedOnly) {
  std::vector<uint32_t> room(p_.sms);
  while (k.waitingBlocks) {
    Pending& p = k.waiting.front();
    if (savedOnly && !p.saved) return;
    uint64_t total = 0;
    uint32_t newAllowed = c.smCap > c.smsUsed ? c.smCap - c.smsUsed : 0;
    // SMs this context does not use yet, fullest room first, are taken while the cap allows.
    std::vector<uint32_t> fresh;
    for (uint32_t i = 0; i < p_.sms; ++i) {
      room[i] = fits(sms_[i], k.shape);
      if (room[i] && c.perSm[i] == 0) fresh.push_back(i);
    }
    if (fresh.size() > newAllowed) {
      std::stable_sort(fresh.begin(), fresh.end(), [&](uint32_t a, uint32_t b) { return room[a] > room[b]; });
      for (size_t j = newAllowed; j < fresh.size(); ++j) room[fresh[j]] = 0;
    }
    uint32_t most = 0;
    for (uint32_t i = 0; i < p_.sms; ++i) total += room[i], most = std::max(most, room[i]);
    if (total == 0) return;
    const uint64_t n = std::min<uint64_t>(p.count, total);
    // Breadth first: the lowest level L with sum(min(room, L)) >= n, then one more block on the
    // first SMs that have room for it.
    uint32_t level = 1;
    for (; level < most; ++level) {
      uint64_t sum = 0;
      for (uint32_t r : room) sum += std::min(r, level);
      if (sum >= n) break;
    }
    uint64_t placed = 0;
    std::vector<uint32_t> give(p_.sms);
    for (uint32_t i = 0; i < p_.sms; ++i) placed += give[i] = std::min(room[i], level - 1);
    for (uint32_t i = 0; i < p_.sms && placed < n; ++i)
      if (room[i] >= level) ++give[i], ++placed;
    uint64_t block = p.firstBlock;
    for (uint32_t i = 0; i < p_.sms; ++i)
      if (give[i]) take(i, k, c, give[i], p, block), block += give[i];
    p.firstBlock += n;
    p.count -= n;
    k.waitingBlocks -= n;
    c.waitingBlocks -= n;
    if (p.count == 0) k.waiting.pop_front();
  }
}

void Engine::observe(BlockEvent::Kind kind, const Kernel& k, uint32_t sm, uint32_t count, uint64_t firstBlock) const {
  if (k.shape.traceBlocks && observe_) observe_(BlockEvent{kind, sm, count, k.id, firstBlock, now_});
}

void Engine::take(uint32_t i, Kernel& k, Ctx& c, uint32_t n, const Pending& p, uint64_t firstBlock) {
  uint64_t durNs = p.remainingNs;
  if (k.shape.timeBoxNs) {
    if (k.deadline == 0)  // the first block to start sets t0 (a box past the end of time: never ends)
      k.deadline = k.shape.timeBoxNs > kNever - now_ ? kNever : now_ + k.shape.timeBoxNs;
    // Until the deadline the block works; after it, it only writes its record (or finishes that).
    durNs = now_ < k.deadline ? k.deadline - now_ : p.saved ? std::min(p.remainingNs, k.shape.blockNs) : k.shape.blockNs;
  }
  Sm& sm = sms_[i];
  if (sm.blocks == 0) ++smsBusy_;
  sm.blocks += n;
  sm.threads += n * k.shape.threadsPerBlock;
  sm.registers += n * registersPerBlock(k.shape);
  sm.shared += n * k.shape.sharedPerBlock;
  if (c.perSm[i] == 0) ++c.smsUsed;
  c.perSm[i] += n;
  c.runningBlocks += n;
  k.running += n;
  runningTotal_ += n;
  runs_.push(Run{now_ + durNs, k.id, i, n, runSeq_++, firstBlock});
  observe(BlockEvent::kStart, k, i, n, firstBlock);
}

void Engine::release(const Run& r, Kernel& k, Ctx& c) {
  Sm& sm = sms_[r.sm];
  sm.blocks -= r.count;
  if (sm.blocks == 0) --smsBusy_;
  sm.threads -= r.count * k.shape.threadsPerBlock;
  sm.registers -= r.count * registersPerBlock(k.shape);
  sm.shared -= r.count * k.shape.sharedPerBlock;
  c.perSm[r.sm] -= r.count;
  if (c.perSm[r.sm] == 0) --c.smsUsed;
  c.runningBlocks -= r.count;
  k.running -= r.count;
  runningTotal_ -= r.count;
}

void Engine::finishIfDone(uint64_t id) {
  auto it = kernels_.find(id);
  if (it == kernels_.end() || it->second.running || it->second.waitingBlocks) return;
  Ctx& c = ctxs_[it->second.ctx];
  kernels_.erase(it);
  if (c.dropped) return;
  ++c.stats.kernelsRun;
  ++totals_.kernelsRun;
  if (done_) done_(id, now_);
}

uint64_t Engine::nextEventTime() const {
  uint64_t t = runs_.empty() ? kNever : runs_.top().end;
  if (switchEnd_ > now_) t = std::min(t, switchEnd_);
  // A slice's end is an event only while the window is open: schedule() switches groups only
  // then (a closed window's next event is its opening, below, or the runner's next setWindow).
  if (haveActive_ && othersWaiting(active_) && windowOpen()) t = std::min(t, std::max(sliceEnd_, now_));
  if (!kernels_.empty()) {
    if (now_ < winStart_) t = std::min(t, winStart_);
    else if (now_ < winEnd_ && winEnd_ != kNever) t = std::min(t, winEnd_);
  }
  return t;
}

void Engine::account(uint64_t dt) {
  if (dt == 0) return;
  if (runningTotal_) deviceBusyNs_ += dt;
  totals_.busyNs = deviceBusyNs_;
  totals_.busySmNs += static_cast<uint64_t>(smsBusy_) * dt;
  const bool switching = switchEnd_ > now_ || !windowOpen();
  if (!kernels_.empty() && (switching || !haveActive_)) totals_.slicedOutNs += dt;
  for (Ctx& c : ctxs_) {
    c.stats.busySmNs += static_cast<uint64_t>(c.smsUsed) * dt;
    if (c.runningBlocks) c.stats.busyNs += dt;
    if ((c.waitingBlocks || c.runningBlocks) && (!haveActive_ || c.group != active_ || switching))
      c.stats.slicedOutNs += dt;
  }
}

void Engine::advanceTo(uint64_t t) {
  for (;;) {
    schedule();
    dispatch();
    const uint64_t next = nextEventTime();
    if (next > t) break;
    account(next - now_);
    now_ = next;
    while (!runs_.empty() && runs_.top().end <= now_) {
      const Run r = runs_.top();
      runs_.pop();
      Kernel& k = kernels_.at(r.kernel);
      Ctx& c = ctxs_[k.ctx];
      release(r, k, c);
      observe(BlockEvent::kEnd, k, r.sm, r.count, r.firstBlock);
      c.stats.blocksRun += r.count;
      totals_.blocksRun += r.count;
      finishIfDone(r.kernel);
    }
  }
  if (t > now_) {
    account(t - now_);
    now_ = t;
  }
}

}  // namespace simgpu
