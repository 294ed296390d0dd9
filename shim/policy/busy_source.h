// GPU busy time of a process, per device (docs/compute.md: measuring GPU time). Two sources give
// intervals of device work: the pacer's marker events (launch.cpp) and CUPTI activity records
// (cupti_source.cpp, where CUPTI starts). Both count them through BusyUnion, so work on several
// streams at once is counted once. The activity-record parser here is free of the driver and of
// CUPTI's library (it takes CUPTI's record walker as a function pointer): tests/unit feeds it
// buffers laid out as CUPTI lays them out (busy_source_test.cpp).
#pragma once

#include <cupti_activity.h>
#include <pthread.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace cushare::shim {

// The union of the intervals added so far, counted once. Intervals may arrive in any order (the
// streams' markers complete in their own order; CUPTI delivers buffers per context and stream):
// the last kWindow disjoint intervals are remembered exactly, and time before the end of the
// oldest one forgotten counts as already counted (a late interval there adds nothing).
class BusyUnion {
 public:
  static constexpr size_t kWindow = 32;
  // Adds [start, end) (ns, one clock per union); returns the ns of it not counted before.
  uint64_t add(uint64_t start, uint64_t end) noexcept;
  void reset() noexcept { n_ = 0, floor_ = 0; }
  uint64_t floor() const noexcept { return floor_; }
  size_t size() const noexcept { return n_; }

 private:
  uint64_t floor_ = 0;
  size_t n_ = 0;
  uint64_t start_[kWindow + 1] = {}, end_[kWindow + 1] = {};  // sorted, disjoint, not touching
};

// One activity record, as busy time: device work with its interval, or something else.
struct ActivityInterval {
  uint32_t device = 0;  // CUDA device ordinal (CUPTI's deviceId)
  uint32_t context = 0, stream = 0;
  uint64_t start = 0, end = 0;  // CUPTI timestamps, ns
};
enum class RecordUse {
  kWork,     // a kernel, memcpy or memset with its interval
  kUntimed,  // one of those without timestamps (CUPTI had no device memory for them)
  kSkipped,  // another kind (not device work, or not one this parser knows)
};
// Parses one record by its kind, with the record struct cupti_activity.h defines for the kind
// (CUDA 13: CUpti_ActivityKernel10, CUpti_ActivityCdpKernel, CUpti_ActivityMemcpy6,
// CUpti_ActivityMemcpyPtoP4, CUpti_ActivityMemset4).
RecordUse activityInterval(const CUpti_Activity* record, ActivityInterval* out) noexcept;

// The CUPTI entry points the activity source uses: dlsym'd from libcupti (cupti_source.cpp) or
// fakes (tests). Only getNextRecord and getNumDroppedRecords are used to consume a buffer.
struct CuptiApi {
  CUptiResult (*getNextRecord)(uint8_t* buffer, size_t valid, CUpti_Activity** record) = nullptr;
  CUptiResult (*getNumDroppedRecords)(CUcontext ctx, uint32_t streamId, size_t* dropped) = nullptr;
  CUptiResult (*registerCallbacks)(CUpti_BuffersCallbackRequestFunc, CUpti_BuffersCallbackCompleteFunc) = nullptr;
  CUptiResult (*enable)(CUpti_ActivityKind) = nullptr;
  CUptiResult (*disable)(CUpti_ActivityKind) = nullptr;
  CUptiResult (*flushAll)(uint32_t flag) = nullptr;
  CUptiResult (*getResultString)(CUptiResult, const char**) = nullptr;  // optional
};

// What one completed buffer held.
struct BufferReport {
  size_t records = 0;      // records walked
  size_t work = 0;         // kernels, memcpys and memsets counted
  size_t untimed = 0;      // device work without timestamps (not counted)
  size_t skipped = 0;      // other kinds
  size_t otherDevice = 0;  // device work on a device ordinal this process does not meter
  size_t dropped = 0;      // records CUPTI dropped for the buffer's context and stream
  bool walkFailed = false; // the walker stopped on an error other than the buffer's end
};

// Turns completed activity buffers into busy time per device ordinal. Thread-safe: CUPTI calls
// the buffer callback from its worker thread or from the thread that flushes.
class ActivityBusy {
 public:
  static constexpr int kDevices = 64;  // = kMaxDevices (runtime/state.h)
  // sink(device, ns): ns newly busy on the device (called under the source's lock);
  // metered(device): whether the device's busy time is wanted (others count as otherDevice).
  using Sink = void (*)(int device, uint64_t ns);
  using Metered = bool (*)(int device);
  void configure(const CuptiApi& api, int devices, Sink sink, Metered metered) noexcept;
  // One completed buffer (CUpti_BuffersCallbackCompleteFunc's arguments): its records walked with
  // api.getNextRecord, the device work added to the device's union, dropped records asked for.
  BufferReport consume(CUcontext ctx, uint32_t streamId, uint8_t* buffer, size_t valid) noexcept;
  const CuptiApi& api() const noexcept { return api_; }
  // Totals since configure.
  uint64_t totalWork() const noexcept { return work_.load(std::memory_order_relaxed); }
  uint64_t totalDropped() const noexcept { return dropped_.load(std::memory_order_relaxed); }

 private:
  pthread_mutex_t mutex_ = PTHREAD_MUTEX_INITIALIZER;
  CuptiApi api_;
  int devices_ = 0;
  Sink sink_ = nullptr;
  Metered metered_ = nullptr;
  BusyUnion unions_[kDevices];
  std::atomic<uint64_t> work_{0}, dropped_{0};
};

}  // namespace cushare::shim
