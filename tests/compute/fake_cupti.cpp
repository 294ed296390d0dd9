// A stand-in libcupti.so.13 for the shim's CUPTI source on simgpu (where the real CUPTI does not
// start): the Activity API entry points the shim resolves, with records it makes up. Each
// cuptiActivityFlushAll delivers one buffer, laid out as CUPTI lays one out, holding a kernel of
// 1 ms on stream 1, a kernel on stream 2 overlapping its second half, and a 250 us memcpy right
// after: 1.25 ms of busy time on device 0 per flush, for the first FAKE_CUPTI_FLUSHES flushes
// (default 40), then empty buffers. So the busy time a tenant is metered is exactly the made-up
// total, whatever its kernels really ran: proof that CUPTI's records, not the events, were
// counted. FAKE_CUPTI_FAIL_ENABLE=1: cuptiActivityEnable(MEMSET) fails (the fallback).
#include <cupti.h>

#include <cstdlib>
#include <cstring>
#include <mutex>

namespace {

CUpti_BuffersCallbackRequestFunc gRequest = nullptr;
CUpti_BuffersCallbackCompleteFunc gComplete = nullptr;
std::mutex gMutex;
int gFlushes = 0;
uint64_t gClock = 1'000'000'000;  // the made-up device clock, ns

size_t recordSize(CUpti_ActivityKind kind) {
  switch (kind) {
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: return sizeof(CUpti_ActivityKernel10);
    case CUPTI_ACTIVITY_KIND_MEMCPY: return sizeof(CUpti_ActivityMemcpy6);
    default: return 0;
  }
}

template <class R>
size_t put(uint8_t* buffer, size_t at, size_t size, CUpti_ActivityKind kind, uint32_t stream, uint64_t start,
           uint64_t end) {
  if (at + sizeof(R) > size) return at;
  R r;
  std::memset(static_cast<void*>(&r), 0, sizeof r);
  r.kind = kind;
  r.deviceId = 0;
  r.contextId = 1;
  r.streamId = stream;
  r.start = start;
  r.end = end;
  std::memcpy(buffer + at, &r, sizeof r);
  return at + sizeof r;
}

}  // namespace

extern "C" {

CUptiResult cuptiActivityRegisterCallbacks(CUpti_BuffersCallbackRequestFunc request,
                                           CUpti_BuffersCallbackCompleteFunc complete) {
  gRequest = request;
  gComplete = complete;
  return CUPTI_SUCCESS;
}

CUptiResult cuptiActivityEnable(CUpti_ActivityKind kind) {
  const char* fail = std::getenv("FAKE_CUPTI_FAIL_ENABLE");
  if (fail != nullptr && std::strcmp(fail, "1") == 0 && kind == CUPTI_ACTIVITY_KIND_MEMSET)
    return CUPTI_ERROR_NOT_COMPATIBLE;
  return CUPTI_SUCCESS;
}

CUptiResult cuptiActivityDisable(CUpti_ActivityKind) { return CUPTI_SUCCESS; }

CUptiResult cuptiActivityFlushAll(uint32_t) {
  std::lock_guard<std::mutex> lock(gMutex);
  if (gRequest == nullptr || gComplete == nullptr) return CUPTI_ERROR_INVALID_OPERATION;
  uint8_t* buffer = nullptr;
  size_t size = 0, maxRecords = 0;
  gRequest(&buffer, &size, &maxRecords);
  if (buffer == nullptr) return CUPTI_SUCCESS;
  const char* limitEnv = std::getenv("FAKE_CUPTI_FLUSHES");
  const int limit = limitEnv ? std::atoi(limitEnv) : 40;
  size_t used = 0;
  if (gFlushes < limit) {
    ++gFlushes;
    const uint64_t t = gClock;
    gClock += 2'000'000;
    used = put<CUpti_ActivityKernel10>(buffer, used, size, CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, 1, t, t + 1'000'000);
    used = put<CUpti_ActivityKernel10>(buffer, used, size, CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, 2, t + 500'000,
                                       t + 1'000'000);
    used = put<CUpti_ActivityMemcpy6>(buffer, used, size, CUPTI_ACTIVITY_KIND_MEMCPY, 2, t + 1'000'000, t + 1'250'000);
  }
  gComplete(nullptr, 0, buffer, size, used);
  return CUPTI_SUCCESS;
}

CUptiResult cuptiActivityGetNextRecord(uint8_t* buffer, size_t valid, CUpti_Activity** record) {
  if (buffer == nullptr) return CUPTI_ERROR_INVALID_PARAMETER;
  size_t at = 0;
  if (*record != nullptr) at = static_cast<size_t>(reinterpret_cast<uint8_t*>(*record) - buffer) + recordSize((*record)->kind);
  if (at >= valid) return CUPTI_ERROR_MAX_LIMIT_REACHED;
  auto* next = reinterpret_cast<CUpti_Activity*>(buffer + at);
  if (recordSize(next->kind) == 0 || at + recordSize(next->kind) > valid) return CUPTI_ERROR_INVALID_KIND;
  *record = next;
  return CUPTI_SUCCESS;
}

CUptiResult cuptiActivityGetNumDroppedRecords(CUcontext, uint32_t, size_t* dropped) {
  *dropped = 0;
  return CUPTI_SUCCESS;
}

CUptiResult cuptiGetResultString(CUptiResult result, const char** str) {
  *str = result == CUPTI_ERROR_NOT_COMPATIBLE ? "CUPTI_ERROR_NOT_COMPATIBLE (fake)" : "fake CUPTI result";
  return CUPTI_SUCCESS;
}

}  // extern "C"
