// The answer to cudart's integrity check (export table INTEGRITY_CHECK, slot 1), as a pure
// function of its inputs so it can be unit-tested without a driver.
//
// cudart 13 asks three times, with versions 13000, 13001 and 13002, and compares the answer with
// what it computes itself; a wrong answer makes every runtime call fail with 103
// (cudaErrorSoftwareValidityNotEstablished). Versions ending in 0 and 1 get a fixed pair; the others
// get a keyed hash over the process, the driver's table addresses and every device's identity.
// The algorithm and its mixing table follow ZLUDA (vosen/ZLUDA, dark_api/src/lib.rs,
// `integrity_check`); see NOTICE.d/zluda.txt. Written independently from that description: the hash
// is HMAC (RFC 2104) over MD2 (RFC 1319) with a fixed 16-byte key, and the mixing table is MD2's
// substitution table.
//
// Invariants: the bytes hashed are exactly ZLUDA's #[repr(C)] structs in native byte order
// (pid and thread id truncated to 32 bits, pointers at their native 64-bit width), so the result
// matches the runtime's own computation on a 64-bit little- or big-endian host alike.
#pragma once

#include <cstddef>
#include <cstdint>

namespace simgpu {

// One device's contribution to the hash; the values must equal what the driver's own
// cuDeviceGetUuid_v2 and cuDeviceGetAttribute(PCI_DOMAIN_ID / PCI_BUS_ID / PCI_DEVICE_ID) report,
// because cudart hashes those too.
struct IntegrityDevice {
  unsigned char uuid[16];
  unsigned pci_domain, pci_bus, pci_device;
};

// The fixed answers for versions ending in 0 and 1 (the first word differs, the second does not).
inline constexpr uint64_t kIntegrityAnswerVersion0[2] = {0x3341181C03CB675Cull, 0x8ED383AA1F4CD1E8ull};
inline constexpr uint64_t kIntegrityAnswerVersion1[2] = {0x1841181C03CB675Cull, 0x8ED383AA1F4CD1E8ull};

// The integrity answer for `cudart_version` (the runtime's version argument). For versions ending
// in 0 or 1 the fixed pair; otherwise (the runtime uses ...2) the keyed hash of every other input.
// `devices` may be null when device_count is 0.
void integrityHash(uint32_t cudart_version, uint64_t unix_seconds, int driver_version, uint64_t pid, uint64_t tid,
                   const void* cudart_interface_table, const void* integrity_table, const void* integrity_fn,
                   const IntegrityDevice* devices, int device_count, uint64_t out[2]) noexcept;

namespace detail {

// MD2's running state, laid out as the runtime (and ZLUDA) keep it, so unit tests can load and
// compare recorded intermediate states byte for byte. The block being filled lives inside x:
// byte i of a block is stored at x[16 + i] and x[32 + i] = x[i] ^ byte, and the 18-round
// compression runs over all 48 bytes once the 16th byte arrives.
struct Md2State {
  uint8_t x[48];         // [0,16): chaining value (the digest at the end); [16,48): working block
  uint8_t checksum[16];  // RFC 1319's running checksum C
  uint8_t count;         // bytes of the current block absorbed so far, 0..15
  uint8_t last;          // the last checksum byte written (RFC 1319's L)
};
static_assert(sizeof(Md2State) == 66, "Md2State must have no padding");

// MD2's 256-byte substitution table ("mixing table" in ZLUDA), built from the digits of pi.
extern const uint8_t kMd2Substitution[256];

void md2Init(Md2State* s) noexcept;
void md2Update(Md2State* s, const void* data, size_t size) noexcept;
// Pads, absorbs the checksum and writes the 16-byte digest (also left in s->x[0..16)).
void md2Final(Md2State* s, uint8_t digest[16]) noexcept;

}  // namespace detail
}  // namespace simgpu
