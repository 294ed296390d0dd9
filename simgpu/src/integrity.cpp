// cudart's integrity answer: HMAC-MD2 with a fixed key over the driver's identity (see integrity.h).
//
// Invariant: no driver calls here. Everything the hash depends on arrives as an argument, so the
// unit tests can check it against recorded vectors and the export-table code owns all gathering.
#include "integrity.h"

#include <cstring>

namespace simgpu {
namespace detail {

// MD2's substitution table (RFC 1319, "PI_SUBST"). The runtime mixes with exactly these bytes;
// ZLUDA's dark_api/src/lib.rs lists the same 256 values as MIXING_TABLE.
const uint8_t kMd2Substitution[256] = {
    0x29, 0x2E, 0x43, 0xC9, 0xA2, 0xD8, 0x7C, 0x01, 0x3D, 0x36, 0x54, 0xA1, 0xEC, 0xF0, 0x06, 0x13,
    0x62, 0xA7, 0x05, 0xF3, 0xC0, 0xC7, 0x73, 0x8C, 0x98, 0x93, 0x2B, 0xD9, 0xBC, 0x4C, 0x82, 0xCA,
    0x1E, 0x9B, 0x57, 0x3C, 0xFD, 0xD4, 0xE0, 0x16, 0x67, 0x42, 0x6F, 0x18, 0x8A, 0x17, 0xE5, 0x12,
    0xBE, 0x4E, 0xC4, 0xD6, 0xDA, 0x9E, 0xDE, 0x49, 0xA0, 0xFB, 0xF5, 0x8E, 0xBB, 0x2F, 0xEE, 0x7A,
    0xA9, 0x68, 0x79, 0x91, 0x15, 0xB2, 0x07, 0x3F, 0x94, 0xC2, 0x10, 0x89, 0x0B, 0x22, 0x5F, 0x21,
    0x80, 0x7F, 0x5D, 0x9A, 0x5A, 0x90, 0x32, 0x27, 0x35, 0x3E, 0xCC, 0xE7, 0xBF, 0xF7, 0x97, 0x03,
    0xFF, 0x19, 0x30, 0xB3, 0x48, 0xA5, 0xB5, 0xD1, 0xD7, 0x5E, 0x92, 0x2A, 0xAC, 0x56, 0xAA, 0xC6,
    0x4F, 0xB8, 0x38, 0xD2, 0x96, 0xA4, 0x7D, 0xB6, 0x76, 0xFC, 0x6B, 0xE2, 0x9C, 0x74, 0x04, 0xF1,
    0x45, 0x9D, 0x70, 0x59, 0x64, 0x71, 0x87, 0x20, 0x86, 0x5B, 0xCF, 0x65, 0xE6, 0x2D, 0xA8, 0x02,
    0x1B, 0x60, 0x25, 0xAD, 0xAE, 0xB0, 0xB9, 0xF6, 0x1C, 0x46, 0x61, 0x69, 0x34, 0x40, 0x7E, 0x0F,
    0x55, 0x47, 0xA3, 0x23, 0xDD, 0x51, 0xAF, 0x3A, 0xC3, 0x5C, 0xF9, 0xCE, 0xBA, 0xC5, 0xEA, 0x26,
    0x2C, 0x53, 0x0D, 0x6E, 0x85, 0x28, 0x84, 0x09, 0xD3, 0xDF, 0xCD, 0xF4, 0x41, 0x81, 0x4D, 0x52,
    0x6A, 0xDC, 0x37, 0xC8, 0x6C, 0xC1, 0xAB, 0xFA, 0x24, 0xE1, 0x7B, 0x08, 0x0C, 0xBD, 0xB1, 0x4A,
    0x78, 0x88, 0x95, 0x8B, 0xE3, 0x63, 0xE8, 0x6D, 0xE9, 0xCB, 0xD5, 0xFE, 0x3B, 0x00, 0x1D, 0x39,
    0xF2, 0xEF, 0xB7, 0x0E, 0x66, 0x58, 0xD0, 0xE4, 0xA6, 0x77, 0x72, 0xF8, 0xEB, 0x75, 0x4B, 0x0A,
    0x31, 0x44, 0x50, 0xB4, 0x8F, 0xED, 0x1F, 0x1A, 0xDB, 0x99, 0x8D, 0x33, 0x9F, 0x11, 0x83, 0x14,
};

namespace {

constexpr int kMd2Block = 16;
constexpr int kMd2Rounds = 18;

// RFC 1319 step 4: 18 rounds over the 48-byte state once a block is complete.
void md2Compress(Md2State* s) noexcept {
  uint8_t t = 0;
  for (int round = 0; round < kMd2Rounds; ++round) {
    for (uint8_t& b : s->x) {
      b ^= kMd2Substitution[t];
      t = b;
    }
    t = static_cast<uint8_t>(t + round);
  }
}

// Absorbs one byte: places it in the working block, folds it into the checksum, and compresses
// when the block is full. Byte-at-a-time because the checksum chains byte to byte anyway.
void md2Absorb(Md2State* s, uint8_t byte) noexcept {
  const int i = s->count;
  s->x[kMd2Block + i] = byte;
  s->x[2 * kMd2Block + i] = static_cast<uint8_t>(s->x[i] ^ byte);
  s->last = s->checksum[i] ^= kMd2Substitution[byte ^ s->last];
  s->count = static_cast<uint8_t>((i + 1) % kMd2Block);
  if (s->count == 0) md2Compress(s);
}

}  // namespace

void md2Init(Md2State* s) noexcept { std::memset(s, 0, sizeof(*s)); }

void md2Update(Md2State* s, const void* data, size_t size) noexcept {
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < size; ++i) md2Absorb(s, p[i]);
}

void md2Final(Md2State* s, uint8_t digest[16]) noexcept {
  // Padding: n bytes of value n, 1 <= n <= 16, so a full block of 16s when already aligned.
  const uint8_t pad = static_cast<uint8_t>(kMd2Block - s->count);
  for (int i = 0; i < pad; ++i) md2Absorb(s, pad);
  // Absorbing the checksum also updates it; copy it first so each byte is read before it changes
  // (reading it in place gives the same bytes, since byte i is absorbed before it is rewritten).
  uint8_t checksum[kMd2Block];
  std::memcpy(checksum, s->checksum, sizeof(checksum));
  md2Update(s, checksum, sizeof(checksum));
  std::memcpy(digest, s->x, kMd2Block);
}

}  // namespace detail

namespace {

// The HMAC key. The runtime derives it in a first pass that takes no input, so it is a constant.
constexpr uint8_t kIntegrityKey[16] = {0x14, 0x6A, 0xDD, 0xAE, 0x53, 0xA9, 0xA7, 0x52,
                                       0xAA, 0x08, 0x41, 0x36, 0x0B, 0xF5, 0x5A, 0x9F};
constexpr uint8_t kInnerPad = 0x36;  // RFC 2104 ipad
constexpr uint8_t kOuterPad = 0x5C;  // RFC 2104 opad

// The hashed values are raw in-memory images of C structs; pointers are hashed at 64 bits.
static_assert(sizeof(void*) == 8, "the integrity hash layout assumes 64-bit pointers");

template <typename T>
void absorbValue(detail::Md2State* s, T value) noexcept {
  detail::md2Update(s, &value, sizeof(value));  // native byte order, as the runtime hashes it
}

void absorbKey(detail::Md2State* s, uint8_t pad) noexcept {
  for (uint8_t k : kIntegrityKey) absorbValue<uint8_t>(s, static_cast<uint8_t>(k ^ pad));
}

}  // namespace

void integrityHash(uint32_t cudart_version, uint64_t unix_seconds, int driver_version, uint64_t pid, uint64_t tid,
                   const void* cudart_interface_table, const void* integrity_table, const void* integrity_fn,
                   const IntegrityDevice* devices, int device_count, uint64_t out[2]) noexcept {
  switch (cudart_version % 10) {
    case 0:
      out[0] = kIntegrityAnswerVersion0[0];
      out[1] = kIntegrityAnswerVersion0[1];
      return;
    case 1:
      out[0] = kIntegrityAnswerVersion1[0];
      out[1] = kIntegrityAnswerVersion1[1];
      return;
    default:
      break;  // 2 is what cudart 13 asks; like ZLUDA, any other digit also gets the hash
  }

  // Inner hash: key ^ ipad, then the 48-byte record (u32 driver version, u32 runtime version,
  // u32 pid, u32 thread id, the CUDART_INTERFACE table, the INTEGRITY_CHECK table, its slot-1
  // function, u64 seconds), then 28 bytes per device (uuid, i32 domain, i32 bus, i32 device).
  detail::Md2State s;
  detail::md2Init(&s);
  absorbKey(&s, kInnerPad);
  absorbValue(&s, static_cast<uint32_t>(driver_version));
  absorbValue(&s, cudart_version);
  absorbValue(&s, static_cast<uint32_t>(pid));  // 32-bit fields: higher bits are dropped
  absorbValue(&s, static_cast<uint32_t>(tid));
  absorbValue(&s, reinterpret_cast<uint64_t>(cudart_interface_table));
  absorbValue(&s, reinterpret_cast<uint64_t>(integrity_table));
  absorbValue(&s, reinterpret_cast<uint64_t>(integrity_fn));
  absorbValue(&s, unix_seconds);
  for (int d = 0; d < device_count && devices != nullptr; ++d) {
    detail::md2Update(&s, devices[d].uuid, sizeof(devices[d].uuid));
    absorbValue(&s, static_cast<uint32_t>(devices[d].pci_domain));
    absorbValue(&s, static_cast<uint32_t>(devices[d].pci_bus));
    absorbValue(&s, static_cast<uint32_t>(devices[d].pci_device));
  }
  uint8_t inner[16];
  detail::md2Final(&s, inner);

  // Outer hash: key ^ opad, then the inner digest.
  detail::md2Init(&s);
  absorbKey(&s, kOuterPad);
  detail::md2Update(&s, inner, sizeof(inner));
  uint8_t digest[16];
  detail::md2Final(&s, digest);
  std::memcpy(&out[0], digest, 8);  // the runtime reads the digest as two native u64 words
  std::memcpy(&out[1], digest + 8, 8);
}

}  // namespace simgpu
