// Busy time from intervals of device work (busy_source.h).
#include "policy/busy_source.h"

namespace cushare::shim {

uint64_t BusyUnion::add(uint64_t start, uint64_t end) noexcept {
  if (start < floor_) start = floor_;
  if (end <= start) return 0;
  // [i, j): the remembered intervals that overlap or touch [start, end).
  size_t i = 0;
  while (i < n_ && end_[i] < start) ++i;
  size_t j = i;
  uint64_t covered = 0, lo = start, hi = end;
  for (; j < n_ && start_[j] <= end; ++j) {
    const uint64_t s = start_[j] > start ? start_[j] : start;
    const uint64_t e = end_[j] < end ? end_[j] : end;
    if (e > s) covered += e - s;
    if (start_[j] < lo) lo = start_[j];
    if (end_[j] > hi) hi = end_[j];
  }
  // They become one: [lo, hi) at i.
  if (j == i) {
    for (size_t k = n_; k > i; --k) start_[k] = start_[k - 1], end_[k] = end_[k - 1];
    ++n_;
  } else if (j > i + 1) {
    const size_t gone = j - i - 1;
    for (size_t k = i + 1; k + gone < n_; ++k) start_[k] = start_[k + gone], end_[k] = end_[k + gone];
    n_ -= gone;
  }
  start_[i] = lo;
  end_[i] = hi;
  if (n_ > kWindow) {  // the oldest is forgotten: time before its end counts as counted
    floor_ = end_[0];
    for (size_t k = 0; k + 1 < n_; ++k) start_[k] = start_[k + 1], end_[k] = end_[k + 1];
    --n_;
  }
  return (end - start) - covered;
}

namespace {
template <class R>
RecordUse timed(const R* r, ActivityInterval* out) noexcept {
  out->device = r->deviceId;
  out->context = r->contextId;
  out->stream = r->streamId;
  out->start = r->start;
  out->end = r->end;
  return r->start != 0 && r->end > r->start ? RecordUse::kWork : RecordUse::kUntimed;
}
}  // namespace

RecordUse activityInterval(const CUpti_Activity* record, ActivityInterval* out) noexcept {
  switch (record->kind) {
    case CUPTI_ACTIVITY_KIND_KERNEL:
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
      return timed(reinterpret_cast<const CUpti_ActivityKernel10*>(record), out);
    case CUPTI_ACTIVITY_KIND_CDP_KERNEL:
      return timed(reinterpret_cast<const CUpti_ActivityCdpKernel*>(record), out);
    case CUPTI_ACTIVITY_KIND_MEMCPY:
      return timed(reinterpret_cast<const CUpti_ActivityMemcpy6*>(record), out);
    case CUPTI_ACTIVITY_KIND_MEMCPY2:
      return timed(reinterpret_cast<const CUpti_ActivityMemcpyPtoP4*>(record), out);
    case CUPTI_ACTIVITY_KIND_MEMSET:
      return timed(reinterpret_cast<const CUpti_ActivityMemset4*>(record), out);
    default:
      return RecordUse::kSkipped;
  }
}

void ActivityBusy::configure(const CuptiApi& api, int devices, Sink sink, Metered metered) noexcept {
  pthread_mutex_lock(&mutex_);
  api_ = api;
  devices_ = devices < kDevices ? devices : kDevices;
  sink_ = sink;
  metered_ = metered;
  for (BusyUnion& u : unions_) u.reset();
  work_.store(0, std::memory_order_relaxed);
  dropped_.store(0, std::memory_order_relaxed);
  pthread_mutex_unlock(&mutex_);
}

BufferReport ActivityBusy::consume(CUcontext ctx, uint32_t streamId, uint8_t* buffer, size_t valid) noexcept {
  BufferReport rep;
  pthread_mutex_lock(&mutex_);
  if (api_.getNextRecord != nullptr && buffer != nullptr && valid != 0) {
    CUpti_Activity* record = nullptr;
    for (;;) {
      const CUptiResult r = api_.getNextRecord(buffer, valid, &record);
      if (r == CUPTI_ERROR_MAX_LIMIT_REACHED) break;
      if (r != CUPTI_SUCCESS || record == nullptr) {
        rep.walkFailed = true;  // CUPTI_ERROR_INVALID_KIND: an incomplete or invalid record
        break;
      }
      ++rep.records;
      ActivityInterval iv;
      switch (activityInterval(record, &iv)) {
        case RecordUse::kSkipped:
          ++rep.skipped;
          break;
        case RecordUse::kUntimed:
          ++rep.untimed;
          break;
        case RecordUse::kWork: {
          const int dev = static_cast<int>(iv.device);
          if (iv.device >= static_cast<uint32_t>(devices_) || (metered_ != nullptr && !metered_(dev))) {
            ++rep.otherDevice;
            break;
          }
          ++rep.work;
          if (const uint64_t ns = unions_[dev].add(iv.start, iv.end); ns != 0 && sink_ != nullptr) sink_(dev, ns);
          break;
        }
      }
    }
  }
  size_t dropped = 0;
  if (api_.getNumDroppedRecords != nullptr && api_.getNumDroppedRecords(ctx, streamId, &dropped) == CUPTI_SUCCESS)
    rep.dropped = dropped;
  work_.fetch_add(rep.work, std::memory_order_relaxed);
  dropped_.fetch_add(rep.dropped, std::memory_order_relaxed);
  pthread_mutex_unlock(&mutex_);
  return rep;
}

}  // namespace cushare::shim
