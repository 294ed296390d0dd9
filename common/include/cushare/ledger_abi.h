// The tenant ledger's binary layout: a versioned ABI shared by every process of a tenant (the shim
// in each CUDA process, the broker, the CLI), possibly built from different cushare versions.
// docs/ledger-abi.md is the reference; tests/unit/ledger_test.cpp checks both agree.
//
// Rules:
// - Plain structs of fixed-width integers and lock-free std::atomic of the same width; explicit
//   padding, no implicit holes; little-endian hosts only (x86-64, aarch64).
// - Every offset and size is static_asserted below. BUMP kLedgerVersion WHEN THE LAYOUT CHANGES
//   (any field moved, resized, re-purposed, or a constant below changed), and update
//   docs/ledger-abi.md. A process refuses a file of any other version; it never reinterprets one.
// - Reserved fields are written as zero and ignored by readers of this version.
#pragma once

#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace cushare {

// "CUSHLDG\0" as a little-endian u64: the file's first eight bytes read "CUSHLDG".
inline constexpr uint64_t kLedgerMagic = 0x0047444C48535543ull;
inline constexpr uint32_t kLedgerVersion = 3;  // 2: the compute region; 3: want_bytes, want_ns
inline constexpr uint32_t kLedgerMaxDevices = 16;
inline constexpr uint32_t kLedgerMaxSlots = 128;
inline constexpr uint32_t kLedgerTenantBytes = 64;  // 63 characters + NUL, zero-padded
// A process slot s is owned by whoever holds an OFD write lock on byte kLedgerSlotLockBase + s of
// the file. The byte lies past the end of the file: record locks do not need the bytes to exist.
inline constexpr int64_t kLedgerSlotLockBase = int64_t{1} << 20;
// The owner of slot s also holds a classic POSIX write lock (F_SETLK) on byte
// kLedgerSlotPidLockBase + s. Unlike the OFD lock, the kernel reports a POSIX lock's holder pid
// (F_GETLK), translated into the asker's pid namespace, so the broker can name the process that
// really holds a slot instead of trusting pid[s], which the tenant can write. Informational only:
// ownership and reaping rest on the OFD lock alone.
inline constexpr int64_t kLedgerSlotPidLockBase = kLedgerSlotLockBase + kLedgerMaxSlots;

inline constexpr uint64_t kLedgerNoLimit = UINT64_MAX;  // LedgerDevice::limit: no limit
// LedgerDevice::limit in a standalone ledger (no broker): a new session of the tenant began (its
// first live process opened the ledger) and the first process that resolves the device sets the
// limit from its environment. Zero, so that any reader that did not resolve it is denied, never
// unlimited. A broker's ledger never holds it with this meaning (there 0 is a limit of 0 bytes).
inline constexpr uint64_t kLedgerLimitPending = 0;

// LedgerDevice::state
inline constexpr uint32_t kLedgerDeviceFree = 0;
inline constexpr uint32_t kLedgerDeviceReady = 2;  // 1 is reserved (never written by version 1)

// One device of the tenant, identified by its UUID: processes of one tenant may number devices
// differently (CUDA_VISIBLE_DEVICES), the UUID is the same everywhere. An entry is added under
// flock and published by storing state = ready last (release); it is never removed in version 1.
struct LedgerDevice {
  uint8_t uuid[16];              // written before state becomes ready, constant afterwards
  std::atomic<uint64_t> limit;   // bytes; kLedgerNoLimit = none. The broker may change it live
  std::atomic<uint64_t> peak;    // highest sum a granted reservation observed, never > limit
  std::atomic<uint64_t> denied;  // reservations refused
  std::atomic<uint32_t> state;   // kLedgerDeviceFree or kLedgerDeviceReady
  uint32_t reserved0;
  // A guaranteed allocation waiting for other tenants' plain bursts to be reclaimed
  // (docs/memory-elasticity.md): its bytes, and when it asked (CLOCK_MONOTONIC ns; refreshed while
  // it waits). Written by the tenant's shims, read by the broker; 0: nobody waits.
  std::atomic<uint64_t> want_bytes;
  std::atomic<uint64_t> want_ns;
};

// The file starts with this header; header_size == sizeof(LedgerHeader).
struct LedgerHeader {
  uint64_t magic;  // kLedgerMagic, written last at creation (a reader never sees half a header)
  uint32_t version;
  uint32_t header_size;
  uint64_t file_size;
  uint32_t max_devices;  // kLedgerMaxDevices
  uint32_t max_slots;    // kLedgerMaxSlots
  char tenant[kLedgerTenantBytes];
  std::atomic<uint32_t> slot_hwm;  // highest slot index ever claimed + 1; never decreases
  uint32_t reserved0;
  uint64_t reserved1[3];  // devices start on a cache line
  LedgerDevice devices[kLedgerMaxDevices];
};

// After the header:
//   used[kLedgerMaxDevices][kLedgerMaxSlots]  std::atomic<uint64_t>: bytes slot s holds on device
//                                             d, announced intents included; a device's row is
//                                             contiguous so its sum scans few cache lines
//   pid[kLedgerMaxSlots]                      std::atomic<int32_t>: the slot owner's pid, 0 free
inline constexpr size_t kLedgerUsedOffset = 1152;
inline constexpr size_t kLedgerUsedBytes = size_t{8} * kLedgerMaxDevices * kLedgerMaxSlots;
inline constexpr size_t kLedgerPidOffset = kLedgerUsedOffset + kLedgerUsedBytes;
inline constexpr size_t kLedgerPidBytes = size_t{4} * kLedgerMaxSlots;

// ---- Compute region (version 2; docs/compute.md) ----
// Broker-written, one per device entry: whether the tenant's launches are metered and paced there,
// its cap and priority, and the gate the broker's scheduler opens and closes. The shim validates
// everything it reads (a tenant can write its own ledger; it may only hurt itself).
inline constexpr uint32_t kComputeMetered = 1;  // LedgerComputeDevice::mode: measure busy time
inline constexpr uint32_t kComputePaced = 2;    // launches wait for the gate, in-flight bounded
inline constexpr uint32_t kComputeTight = 4;    // paced with one launch in flight (a lower priority)
inline constexpr uint32_t kComputeModeMask = kComputeMetered | kComputePaced | kComputeTight;
inline constexpr uint32_t kGateOpen = 0;  // LedgerComputeDevice::gate
inline constexpr uint32_t kGateClosed = 1;
inline constexpr uint32_t kComputeNoCap = 10000;  // LedgerComputeDevice::cap: percent x 100
inline constexpr uint32_t kOthersValid = 1u << 31;  // LedgerComputeDevice::others
inline constexpr uint32_t kOthersNone = 3;          // no other tenant active
inline constexpr uint32_t othersWord(uint32_t topBand, uint32_t floorPercent) {
  return kOthersValid | (topBand & 3u) | ((floorPercent & 0xFFu) << 8);
}
// LedgerComputeSlot::activity bits
inline constexpr uint32_t kActivityInFlight = 1;  // launched work not known complete
inline constexpr uint32_t kActivityBlocked = 2;   // a launch waits at the closed gate

struct LedgerComputeDevice {
  std::atomic<uint32_t> mode;        // kComputeMetered | kComputePaced | kComputeTight; others zero
  std::atomic<uint32_t> gate;        // kGateOpen / kGateClosed; a shared futex word (waited on)
  std::atomic<uint32_t> gate_epoch;  // +1 on every opening and every 500 ms (the broker's heartbeat)
  std::atomic<uint32_t> cap;         // effective cap, percent x 100 (1..10000); kComputeNoCap
  std::atomic<uint32_t> priority;    // 0 high, 1 normal, 2 low (as the broker applies it)
  // What a process that lowers its own priority (CUSHARE_PRIORITY) yields to: kOthersValid, the
  // highest priority active among the device's other tenants (bits 0..1: 0..2, 3 none) and the
  // floor percent (bits 8..15). 0: not published (an older broker): nothing to yield to.
  std::atomic<uint32_t> others;
  // A probe round (docs/probes.md): the broker asks the process of ledger slot probe_slot to run
  // the probes in probe_what (ProbeSet bits, cushare/probe_abi.h) at CLOCK_REALTIME probe_at_ns,
  // the SM probe time-boxed to probe_budget_us, and to write the records to the tenant's probe
  // file. probe_seq moves last (+1 a request); 0: never asked (formerly reserved, so an older
  // broker asks nothing and an older shim ignores the words).
  std::atomic<uint32_t> probe_seq;
  std::atomic<uint32_t> probe_slot;
  std::atomic<uint64_t> probe_at_ns;
  std::atomic<uint32_t> probe_what;
  std::atomic<uint32_t> probe_budget_us;
  uint64_t reserved1[2];  // pads the entry to one 64-byte cache line
};

// Shim-written, one per device entry and process slot (the broker reads them, clamped, and keeps
// the totals of slots that are reset when a new process claims them).
struct LedgerComputeSlot {
  std::atomic<uint64_t> busy_ns;       // cumulative GPU busy time measured on the slot's streams
  std::atomic<uint64_t> throttled_ns;  // cumulative time launches waited at the closed gate
  std::atomic<uint64_t> activity_ns;   // CLOCK_MONOTONIC ns of the last launch (informational)
  std::atomic<uint32_t> activity;      // kActivityInFlight | kActivityBlocked
  std::atomic<uint32_t> inflight;      // launches not yet known complete
};

//   compute[kLedgerMaxDevices]                      LedgerComputeDevice, after pid
//   compute_slots[kLedgerMaxDevices][kLedgerMaxSlots]  LedgerComputeSlot (device-major)
inline constexpr size_t kLedgerComputeOffset = kLedgerPidOffset + kLedgerPidBytes;
inline constexpr size_t kLedgerComputeBytes = sizeof(LedgerComputeDevice) * kLedgerMaxDevices;
inline constexpr size_t kLedgerComputeSlotOffset = kLedgerComputeOffset + kLedgerComputeBytes;
inline constexpr size_t kLedgerComputeSlotBytes = sizeof(LedgerComputeSlot) * kLedgerMaxDevices * kLedgerMaxSlots;
inline constexpr size_t kLedgerFileSize = kLedgerComputeSlotOffset + kLedgerComputeSlotBytes;

// Byte offset of used[dev][slot].
constexpr size_t ledgerUsedOffset(uint32_t dev, uint32_t slot) {
  return kLedgerUsedOffset + 8 * (size_t{dev} * kLedgerMaxSlots + slot);
}
// Byte offset of pid[slot].
constexpr size_t ledgerPidOffset(uint32_t slot) { return kLedgerPidOffset + 4 * size_t{slot}; }

// ---- The layout, asserted (bump kLedgerVersion when any of these change) ----
static_assert(std::endian::native == std::endian::little, "the ledger layout is little-endian");
static_assert(std::atomic<uint64_t>::is_always_lock_free && sizeof(std::atomic<uint64_t>) == 8 &&
              alignof(std::atomic<uint64_t>) == 8);
static_assert(std::atomic<uint32_t>::is_always_lock_free && sizeof(std::atomic<uint32_t>) == 4);
static_assert(std::atomic<int32_t>::is_always_lock_free && sizeof(std::atomic<int32_t>) == 4);
static_assert(std::is_standard_layout_v<LedgerDevice> && std::is_standard_layout_v<LedgerHeader>);

static_assert(offsetof(LedgerDevice, uuid) == 0);
static_assert(offsetof(LedgerDevice, limit) == 16);
static_assert(offsetof(LedgerDevice, peak) == 24);
static_assert(offsetof(LedgerDevice, denied) == 32);
static_assert(offsetof(LedgerDevice, state) == 40);
static_assert(offsetof(LedgerDevice, reserved0) == 44);
static_assert(offsetof(LedgerDevice, want_bytes) == 48);
static_assert(offsetof(LedgerDevice, want_ns) == 56);
static_assert(sizeof(LedgerDevice) == 64);

static_assert(offsetof(LedgerHeader, magic) == 0);
static_assert(offsetof(LedgerHeader, version) == 8);
static_assert(offsetof(LedgerHeader, header_size) == 12);
static_assert(offsetof(LedgerHeader, file_size) == 16);
static_assert(offsetof(LedgerHeader, max_devices) == 24);
static_assert(offsetof(LedgerHeader, max_slots) == 28);
static_assert(offsetof(LedgerHeader, tenant) == 32);
static_assert(offsetof(LedgerHeader, slot_hwm) == 96);
static_assert(offsetof(LedgerHeader, reserved0) == 100);
static_assert(offsetof(LedgerHeader, reserved1) == 104);
static_assert(offsetof(LedgerHeader, devices) == 128);
static_assert(sizeof(LedgerHeader) == 1152);

static_assert(kLedgerUsedOffset == sizeof(LedgerHeader) && kLedgerUsedOffset % 64 == 0);
static_assert(kLedgerUsedBytes == 16384);
static_assert(kLedgerPidOffset == 17536 && kLedgerPidOffset % 64 == 0);
static_assert(kLedgerPidBytes == 512);
static_assert(std::is_standard_layout_v<LedgerComputeDevice> && std::is_standard_layout_v<LedgerComputeSlot>);
static_assert(offsetof(LedgerComputeDevice, mode) == 0);
static_assert(offsetof(LedgerComputeDevice, gate) == 4);
static_assert(offsetof(LedgerComputeDevice, gate_epoch) == 8);
static_assert(offsetof(LedgerComputeDevice, cap) == 12);
static_assert(offsetof(LedgerComputeDevice, priority) == 16);
static_assert(offsetof(LedgerComputeDevice, others) == 20);
static_assert(offsetof(LedgerComputeDevice, probe_seq) == 24);
static_assert(offsetof(LedgerComputeDevice, probe_slot) == 28);
static_assert(offsetof(LedgerComputeDevice, probe_at_ns) == 32);
static_assert(offsetof(LedgerComputeDevice, probe_what) == 40);
static_assert(offsetof(LedgerComputeDevice, probe_budget_us) == 44);
static_assert(offsetof(LedgerComputeDevice, reserved1) == 48);
static_assert(sizeof(LedgerComputeDevice) == 64);
static_assert(offsetof(LedgerComputeSlot, busy_ns) == 0);
static_assert(offsetof(LedgerComputeSlot, throttled_ns) == 8);
static_assert(offsetof(LedgerComputeSlot, activity_ns) == 16);
static_assert(offsetof(LedgerComputeSlot, activity) == 24);
static_assert(offsetof(LedgerComputeSlot, inflight) == 28);
static_assert(sizeof(LedgerComputeSlot) == 32);
static_assert(kLedgerComputeOffset == 18048 && kLedgerComputeOffset % 64 == 0);
static_assert(kLedgerComputeBytes == 1024);
static_assert(kLedgerComputeSlotOffset == 19072 && kLedgerComputeSlotOffset % 64 == 0);
static_assert(kLedgerComputeSlotBytes == 65536);
static_assert(kLedgerFileSize == 84608);
static_assert(kLedgerSlotLockBase >= int64_t{kLedgerFileSize});

}  // namespace cushare
