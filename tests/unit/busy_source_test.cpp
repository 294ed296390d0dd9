// The shim's busy-time accounting (shim/policy/busy_source.h): the union of busy intervals shared
// by the events and CUPTI sources, and the production parser of CUPTI activity buffers, fed with
// buffers laid out as CUPTI lays them out: records of cupti_activity.h's structs, back to back at
// their sizes (8-byte aligned), walked by a fake of cuptiActivityGetNextRecord that steps by the
// size of each record's kind as CUPTI does. Unrelated fields hold values that would change the
// result if the parser read a record with the wrong struct.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "policy/busy_source.h"

namespace cushare::shim {
namespace {

// ---- BusyUnion ----

TEST(BusyUnion, CountsOverlapOnceInAnyOrder) {
  BusyUnion u;
  EXPECT_EQ(u.add(100, 200), 100u);
  EXPECT_EQ(u.add(150, 250), 50u) << "only the part past what was counted";
  EXPECT_EQ(u.add(120, 180), 0u) << "inside: nothing";
  EXPECT_EQ(u.add(300, 400), 100u);
  EXPECT_EQ(u.add(240, 320), 50u) << "the gap 250..300 only";
  EXPECT_EQ(u.size(), 1u) << "merged into one interval 100..400";
  EXPECT_EQ(u.add(50, 450), 100u) << "both ends";
  EXPECT_EQ(u.add(10, 10), 0u);
  EXPECT_EQ(u.add(20, 10), 0u) << "an inverted interval is empty";
}

TEST(BusyUnion, MatchesABruteForceUnionWithinItsWindow) {
  std::mt19937 rng(11);
  for (int round = 0; round < 200; ++round) {
    BusyUnion u;
    std::vector<bool> busy(4000, false);
    uint64_t counted = 0;
    for (int i = 0; i < 30; ++i) {  // at most 30 disjoint pieces: within the window
      const uint64_t s = rng() % 3900, len = 1 + rng() % 100;
      counted += u.add(s, s + len);
      for (uint64_t t = s; t < s + len; ++t) busy[t] = true;
      uint64_t truth = 0;
      for (bool b : busy) truth += b;
      ASSERT_EQ(counted, truth) << "round " << round << " interval " << i;
    }
  }
}

TEST(BusyUnion, ForgetsTheOldestBeyondItsWindowAndNeverCountsTwice) {
  BusyUnion u;
  uint64_t counted = 0;
  for (uint64_t i = 0; i < BusyUnion::kWindow + 4; ++i) counted += u.add(i * 100, i * 100 + 10);
  EXPECT_EQ(counted, (BusyUnion::kWindow + 4) * 10);
  EXPECT_EQ(u.size(), BusyUnion::kWindow);
  EXPECT_EQ(u.floor(), 310u) << "the end of the fourth interval, the last one forgotten";
  EXPECT_EQ(u.add(0, 310), 0u) << "before the floor: counted as counted";
  EXPECT_EQ(u.add(0, 420), 100u) << "400..410 was remembered; 310..400 and 410..420 are new";
}

// ---- activity buffers ----

// The sizes cuptiActivityGetNextRecord steps by: the record struct of each kind (cupti_activity.h).
size_t recordSize(CUpti_ActivityKind kind) {
  switch (kind) {
    case CUPTI_ACTIVITY_KIND_KERNEL:
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: return sizeof(CUpti_ActivityKernel10);
    case CUPTI_ACTIVITY_KIND_CDP_KERNEL: return sizeof(CUpti_ActivityCdpKernel);
    case CUPTI_ACTIVITY_KIND_MEMCPY: return sizeof(CUpti_ActivityMemcpy6);
    case CUPTI_ACTIVITY_KIND_MEMCPY2: return sizeof(CUpti_ActivityMemcpyPtoP4);
    case CUPTI_ACTIVITY_KIND_MEMSET: return sizeof(CUpti_ActivityMemset4);
    case CUPTI_ACTIVITY_KIND_DRIVER:
    case CUPTI_ACTIVITY_KIND_RUNTIME: return sizeof(CUpti_ActivityAPI);
    case CUPTI_ACTIVITY_KIND_MARKER: return sizeof(CUpti_ActivityMarker2);
    default: return 0;
  }
}

// The fake walker: the first record at the buffer's start, each next one right after the last.
CUptiResult fakeNextRecord(uint8_t* buffer, size_t valid, CUpti_Activity** record) {
  if (buffer == nullptr) return CUPTI_ERROR_INVALID_PARAMETER;
  size_t off = 0;
  if (*record != nullptr) {
    off = static_cast<size_t>(reinterpret_cast<uint8_t*>(*record) - buffer) + recordSize((*record)->kind);
  }
  if (off >= valid) return CUPTI_ERROR_MAX_LIMIT_REACHED;
  auto* next = reinterpret_cast<CUpti_Activity*>(buffer + off);
  const size_t size = recordSize(next->kind);
  if (size == 0 || off + size > valid) return CUPTI_ERROR_INVALID_KIND;
  *record = next;
  return CUPTI_SUCCESS;
}

size_t gDropped = 0;
CUcontext gDroppedCtx = nullptr;
uint32_t gDroppedStream = 0;
CUptiResult fakeDropped(CUcontext ctx, uint32_t stream, size_t* dropped) {
  *dropped = ctx == gDroppedCtx && stream == gDroppedStream ? gDropped : 0;
  return CUPTI_SUCCESS;
}

uint64_t gBusy[ActivityBusy::kDevices];
void sink(int device, uint64_t ns) { gBusy[device] += ns; }
bool allMetered(int) { return true; }
bool notDevice1(int device) { return device != 1; }

// A buffer of records, each at the next multiple of 8, as CUPTI writes them.
class Buffer {
 public:
  template <class R>
  R& add(CUpti_ActivityKind kind) {
    static_assert(alignof(R) == ACTIVITY_RECORD_ALIGNMENT && sizeof(R) % ACTIVITY_RECORD_ALIGNMENT == 0);
    const size_t off = used_;
    used_ += sizeof(R);
    EXPECT_LE(used_, sizeof bytes_);
    auto* r = reinterpret_cast<R*>(bytes_ + off);
    std::memset(static_cast<void*>(r), 0x5a, sizeof(R));  // every field not set below is garbage
    r->kind = kind;
    return *r;
  }
  uint8_t* data() { return bytes_; }
  size_t used() const { return used_; }

 private:
  alignas(8) uint8_t bytes_[16384];
  size_t used_ = 0;
};

template <class R>
void timed(R& r, uint32_t dev, uint32_t stream, uint64_t start, uint64_t end) {
  r.deviceId = dev;
  r.contextId = 17;  // not a device ordinal: a parser reading it as one would count nothing
  r.streamId = stream;
  r.start = start;
  r.end = end;
}

CuptiApi fakeApi() {
  CuptiApi api;
  api.getNextRecord = fakeNextRecord;
  api.getNumDroppedRecords = fakeDropped;
  return api;
}

class ActivityBuffer : public ::testing::Test {
 protected:
  void SetUp() override {
    std::memset(gBusy, 0, sizeof gBusy);
    gDropped = 0;
  }
};

TEST_F(ActivityBuffer, KernelsOnTwoStreamsCountOnceCopiesCountOtherDevicesApart) {
  ActivityBusy src;
  src.configure(fakeApi(), 2, sink, allMetered);
  Buffer b;
  auto& k1 = b.add<CUpti_ActivityKernel10>(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  timed(k1, 0, 7, 1'000, 5'000);
  k1.completed = 900'000;  // after end (device-side launches): not the kernel's end
  k1.queued = 1;
  k1.submitted = 2;
  auto& k2 = b.add<CUpti_ActivityKernel10>(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  timed(k2, 0, 9, 3'000, 8'000);  // overlaps k1 on another stream: 1000..8000 is 7000
  k2.completed = 0;
  auto& api = b.add<CUpti_ActivityAPI>(CUPTI_ACTIVITY_KIND_DRIVER);  // host-side: skipped
  api.start = 0;
  api.end = 1'000'000;
  auto& cp = b.add<CUpti_ActivityMemcpy6>(CUPTI_ACTIVITY_KIND_MEMCPY);
  timed(cp, 0, 9, 10'000, 12'000);  // 2000
  cp.bytes = 1 << 20;
  auto& ms = b.add<CUpti_ActivityMemset4>(CUPTI_ACTIVITY_KIND_MEMSET);
  timed(ms, 0, 7, 11'000, 13'000);  // 1000 past the copy
  auto& k3 = b.add<CUpti_ActivityKernel10>(CUPTI_ACTIVITY_KIND_KERNEL);
  timed(k3, 1, 3, 1'000, 2'500);  // device 1: 1500
  auto& mk = b.add<CUpti_ActivityMarker2>(CUPTI_ACTIVITY_KIND_MARKER);
  mk.timestamp = 123;
  auto& p2p = b.add<CUpti_ActivityMemcpyPtoP4>(CUPTI_ACTIVITY_KIND_MEMCPY2);
  timed(p2p, 1, 3, 2'000, 4'000);  // device 1: 1500 past k3
  auto& cdp = b.add<CUpti_ActivityCdpKernel>(CUPTI_ACTIVITY_KIND_CDP_KERNEL);
  timed(cdp, 0, 7, 4'000, 9'000);  // a child kernel: 8000..9000 new
  auto& far = b.add<CUpti_ActivityKernel10>(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  timed(far, 5, 1, 1, 1'000'000);  // device 5 of 2: not this process's
  auto& untimed = b.add<CUpti_ActivityKernel10>(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  timed(untimed, 0, 7, 0, 0);  // no timestamps (CUPTI had no device memory for them)
  gDroppedCtx = reinterpret_cast<CUcontext>(0x1000);
  gDroppedStream = 4;
  gDropped = 3;

  const BufferReport rep = src.consume(gDroppedCtx, 4, b.data(), b.used());
  EXPECT_EQ(rep.records, 11u);
  EXPECT_EQ(rep.work, 7u);
  EXPECT_EQ(rep.skipped, 2u) << "the driver API record and the marker";
  EXPECT_EQ(rep.otherDevice, 1u);
  EXPECT_EQ(rep.untimed, 1u);
  EXPECT_EQ(rep.dropped, 3u);
  EXPECT_FALSE(rep.walkFailed);
  EXPECT_EQ(gBusy[0], 7'000u + 1'000u + 2'000u + 1'000u) << "1000..9000, 10000..13000";
  EXPECT_EQ(gBusy[1], 3'000u) << "1000..4000";
  EXPECT_EQ(gBusy[5], 0u);
  EXPECT_EQ(src.totalWork(), 7u);
  EXPECT_EQ(src.totalDropped(), 3u);

  // The dropped count is the one of the buffer's own context and stream.
  const BufferReport other = src.consume(reinterpret_cast<CUcontext>(0x2000), 4, b.data(), 0);
  EXPECT_EQ(other.records, 0u);
  EXPECT_EQ(other.dropped, 0u);
}

TEST_F(ActivityBuffer, LaterBuffersAddOnlyTimeNotCountedBefore) {
  ActivityBusy src;
  src.configure(fakeApi(), 1, sink, allMetered);
  Buffer a;
  timed(a.add<CUpti_ActivityKernel10>(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), 0, 1, 10'000, 20'000);
  timed(a.add<CUpti_ActivityKernel10>(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), 0, 1, 30'000, 40'000);
  src.consume(nullptr, 1, a.data(), a.used());
  EXPECT_EQ(gBusy[0], 20'000u);
  // Another stream's buffer, delivered later, with work that ran meanwhile.
  Buffer b;
  timed(b.add<CUpti_ActivityKernel10>(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), 0, 2, 15'000, 35'000);
  timed(b.add<CUpti_ActivityMemcpy6>(CUPTI_ACTIVITY_KIND_MEMCPY), 0, 2, 12'000, 18'000);
  const BufferReport rep = src.consume(nullptr, 2, b.data(), b.used());
  EXPECT_EQ(rep.work, 2u);
  EXPECT_EQ(gBusy[0], 30'000u) << "10000..40000: only the gap 20000..30000 was new";
}

TEST_F(ActivityBuffer, UnmeteredDevicesAndAnInvalidRecordStopCounting) {
  ActivityBusy src;
  src.configure(fakeApi(), 2, sink, notDevice1);
  Buffer b;
  timed(b.add<CUpti_ActivityKernel10>(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), 1, 1, 1'000, 2'000);
  timed(b.add<CUpti_ActivityMemset4>(CUPTI_ACTIVITY_KIND_MEMSET), 0, 1, 1'000, 2'000);
  b.add<CUpti_Activity>(static_cast<CUpti_ActivityKind>(0x7ffffff0));  // a kind nobody knows the size of
  timed(b.add<CUpti_ActivityKernel10>(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), 0, 1, 5'000, 9'000);
  const BufferReport rep = src.consume(nullptr, 1, b.data(), b.used());
  EXPECT_EQ(rep.records, 2u);
  EXPECT_TRUE(rep.walkFailed) << "the walker's CUPTI_ERROR_INVALID_KIND is reported";
  EXPECT_EQ(rep.otherDevice, 1u) << "device 1 is not metered";
  EXPECT_EQ(gBusy[1], 0u);
  EXPECT_EQ(gBusy[0], 1'000u) << "nothing after the invalid record";
}

TEST_F(ActivityBuffer, RecordsAreParsedWithTheirKindsStruct) {
  // Each kind alone, with garbage everywhere but the fields of its struct.
  struct Case {
    CUpti_ActivityKind kind;
    RecordUse use;
  };
  for (const Case c : {Case{CUPTI_ACTIVITY_KIND_KERNEL, RecordUse::kWork},
                       Case{CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, RecordUse::kWork},
                       Case{CUPTI_ACTIVITY_KIND_CDP_KERNEL, RecordUse::kWork},
                       Case{CUPTI_ACTIVITY_KIND_MEMCPY, RecordUse::kWork},
                       Case{CUPTI_ACTIVITY_KIND_MEMCPY2, RecordUse::kWork},
                       Case{CUPTI_ACTIVITY_KIND_MEMSET, RecordUse::kWork},
                       Case{CUPTI_ACTIVITY_KIND_DRIVER, RecordUse::kSkipped},
                       Case{CUPTI_ACTIVITY_KIND_MARKER, RecordUse::kSkipped}}) {
    Buffer b;
    switch (c.kind) {
      case CUPTI_ACTIVITY_KIND_KERNEL:
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: timed(b.add<CUpti_ActivityKernel10>(c.kind), 3, 44, 111, 222); break;
      case CUPTI_ACTIVITY_KIND_CDP_KERNEL: timed(b.add<CUpti_ActivityCdpKernel>(c.kind), 3, 44, 111, 222); break;
      case CUPTI_ACTIVITY_KIND_MEMCPY: timed(b.add<CUpti_ActivityMemcpy6>(c.kind), 3, 44, 111, 222); break;
      case CUPTI_ACTIVITY_KIND_MEMCPY2: timed(b.add<CUpti_ActivityMemcpyPtoP4>(c.kind), 3, 44, 111, 222); break;
      case CUPTI_ACTIVITY_KIND_MEMSET: timed(b.add<CUpti_ActivityMemset4>(c.kind), 3, 44, 111, 222); break;
      case CUPTI_ACTIVITY_KIND_DRIVER: b.add<CUpti_ActivityAPI>(c.kind); break;
      default: b.add<CUpti_ActivityMarker2>(c.kind); break;
    }
    ActivityInterval iv;
    ASSERT_EQ(activityInterval(reinterpret_cast<const CUpti_Activity*>(b.data()), &iv), c.use) << c.kind;
    if (c.use != RecordUse::kWork) continue;
    EXPECT_EQ(iv.device, 3u) << c.kind;
    EXPECT_EQ(iv.context, 17u) << c.kind;
    EXPECT_EQ(iv.stream, 44u) << c.kind;
    EXPECT_EQ(iv.start, 111u) << c.kind;
    EXPECT_EQ(iv.end, 222u) << c.kind;
  }
}

}  // namespace
}  // namespace cushare::shim
