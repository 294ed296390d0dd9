// The CUSHARE_* environment: every accepted form with its exact value, every refusal with the
// variable and the offending piece in its one-line message, matching limits to devices
// (resolveMemoryLimits), and the defaults.
#include "cushare/shim_config.h"

#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include "cushare/parse.h"

namespace cushare {
namespace {

constexpr uint64_t kKiB = 1ull << 10, kMiB = 1ull << 20, kGiB = 1ull << 30, kTiB = 1ull << 40;
constexpr const char* kUuidA = "GPU-5e1a90c0-0000-4000-8000-000000000000";
constexpr const char* kUuidB = "GPU-5e1a90c0-0001-4000-8000-0000000000ab";

// An environment for loadShimConfig.
struct Env {
  std::map<std::string, std::string> vars;
  std::vector<std::string> asked;
  std::function<const char*(const char*)> getenv() {
    return [this](const char* name) -> const char* {
      asked.push_back(name);
      auto it = vars.find(name);
      return it == vars.end() ? nullptr : it->second.c_str();
    };
  }
};

// Loads a config with one variable set; returns the error line ("" on success).
std::string loadError(const char* var, const std::string& value, ShimConfig* out = nullptr) {
  Env env;
  env.vars[var] = value;
  ShimConfig c;
  std::string error;
  const bool ok = loadShimConfig(env.getenv(), out ? out : &c, &error);
  EXPECT_EQ(ok, error.empty()) << error;
  return ok ? "" : error;
}

MemoryLimitSpec parseOk(const std::string& text) {
  MemoryLimitSpec s;
  std::string reason;
  EXPECT_TRUE(parseMemoryLimit(text, &s, &reason)) << text << ": " << reason;
  return s;
}

uint64_t allBytes(const std::string& text) {
  const MemoryLimitSpec s = parseOk(text);
  EXPECT_EQ(s.kind, MemoryLimitSpec::kAll) << text;
  EXPECT_TRUE(s.entries.empty());
  return s.all;
}

// The error line for CUSHARE_MEMORY_LIMIT=text, checked for the common shape and for every piece
// in `mentions`.
std::string memoryError(const std::string& text, std::initializer_list<const char*> mentions) {
  const std::string e = loadError("CUSHARE_MEMORY_LIMIT", text);
  EXPECT_EQ(e.rfind("cushare: invalid CUSHARE_MEMORY_LIMIT='" + text + "': ", 0), 0u)
      << "for '" << text << "': " << e;
  EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  for (const char* m : mentions)
    EXPECT_NE(e.find(m), std::string::npos) << "'" << m << "' not in: " << e;
  return e;
}

// ---------------------------------------------------------------------------------------------
// CUSHARE_MEMORY_LIMIT: accepted forms

TEST(MemoryLimit, OneSizeForAllDevices) {
  EXPECT_EQ(allBytes("8GiB"), 8 * kGiB);
  EXPECT_EQ(allBytes("8GiB"), 8589934592ull);
  EXPECT_EQ(allBytes("512MiB"), 536870912ull);
  EXPECT_EQ(allBytes("1.5G"), 1610612736ull);
  EXPECT_EQ(allBytes("1.5GiB"), 1610612736ull);
  EXPECT_EQ(allBytes("1048576"), 1048576ull);
  EXPECT_EQ(allBytes("1"), 1ull);
  EXPECT_EQ(allBytes("8GB"), 8000000000ull);
  EXPECT_EQ(allBytes("500MB"), 500000000ull);
  EXPECT_EQ(allBytes("64K"), 64 * kKiB);
  EXPECT_EQ(allBytes("2T"), 2 * kTiB);
  EXPECT_EQ(allBytes("8gib"), 8 * kGiB);
  EXPECT_EQ(allBytes("  8 GiB\t"), 8 * kGiB);
  EXPECT_EQ(allBytes("18446744073709551615"), UINT64_MAX);
}

TEST(MemoryLimit, PerDeviceOrdinals) {
  const MemoryLimitSpec s = parseOk("0=8GiB,1=4GiB");
  ASSERT_EQ(s.kind, MemoryLimitSpec::kPerDevice);
  ASSERT_EQ(s.entries.size(), 2u);
  EXPECT_EQ(s.entries[0].ordinal, 0);
  EXPECT_TRUE(s.entries[0].uuid.empty());
  EXPECT_EQ(s.entries[0].bytes, 8589934592ull);
  EXPECT_EQ(s.entries[1].ordinal, 1);
  EXPECT_EQ(s.entries[1].bytes, 4294967296ull);
}

TEST(MemoryLimit, PerDeviceSingleEntry) {
  const MemoryLimitSpec s = parseOk("3=1.5G");
  ASSERT_EQ(s.kind, MemoryLimitSpec::kPerDevice);
  ASSERT_EQ(s.entries.size(), 1u);
  EXPECT_EQ(s.entries[0].ordinal, 3);
  EXPECT_EQ(s.entries[0].bytes, 1610612736ull);
}

TEST(MemoryLimit, PerDeviceUuidIsNormalisedToLowerCase) {
  const MemoryLimitSpec s = parseOk("GPU-5E1A90C0-0001-4000-8000-0000000000AB=8GiB");
  ASSERT_EQ(s.kind, MemoryLimitSpec::kPerDevice);
  ASSERT_EQ(s.entries.size(), 1u);
  EXPECT_EQ(s.entries[0].ordinal, -1);
  EXPECT_EQ(s.entries[0].uuid, kUuidB);
  EXPECT_EQ(s.entries[0].bytes, 8 * kGiB);
  // The prefix in any case too; it is stored as nvidia-smi prints it.
  EXPECT_EQ(parseOk("gpu-5e1a90c0-0001-4000-8000-0000000000ab=1G").entries[0].uuid, kUuidB);
}

TEST(MemoryLimit, MixedOrdinalsAndUuidsWithWhitespace) {
  const MemoryLimitSpec s = parseOk(std::string(" 0 = 8GiB ,\t") + kUuidA + "=512MiB , 2=1048576 ");
  ASSERT_EQ(s.kind, MemoryLimitSpec::kPerDevice);
  ASSERT_EQ(s.entries.size(), 3u);
  EXPECT_EQ(s.entries[0].ordinal, 0);
  EXPECT_EQ(s.entries[0].bytes, 8 * kGiB);
  EXPECT_EQ(s.entries[1].uuid, kUuidA);
  EXPECT_EQ(s.entries[1].bytes, 512 * kMiB);
  EXPECT_EQ(s.entries[2].ordinal, 2);
  EXPECT_EQ(s.entries[2].bytes, 1048576ull);
}

TEST(MemoryLimit, LoadedIntoShimConfig) {
  ShimConfig c;
  EXPECT_EQ(loadError("CUSHARE_MEMORY_LIMIT", "1.5G", &c), "");
  EXPECT_EQ(c.memory.kind, MemoryLimitSpec::kAll);
  EXPECT_EQ(c.memory.all, 1610612736ull);
}

// parse.cpp used to keep 12 digits after '.' and drop the rest, so a size that is not a whole
// number of bytes was silently rounded down, and an exact one was refused.
TEST(MemoryLimit, FractionDigitsAreNeverSilentlyDropped) {
  uint64_t v = 0;
  std::string err;
  EXPECT_FALSE(parseSize("1.0000000000001T", &v, &err)) << v;
  EXPECT_FALSE(parseSize("0.0000000000001T", &v, &err)) << v;
  ASSERT_TRUE(parseSize("0.0001220703125T", &v, &err)) << err;  // 2^-13 TiB
  EXPECT_EQ(v, 128 * kMiB);
  ASSERT_TRUE(parseSize("1.50000000000000000000000000G", &v, &err)) << err;  // zeros are fine
  EXPECT_EQ(v, 1610612736ull);
  memoryError("1.0000000000001T", {"'1.0000000000001T'", "not a whole number of bytes"});
  memoryError("1.00000000000000000001G", {"more than 19 significant digits after '.'"});
}

// ---------------------------------------------------------------------------------------------
// CUSHARE_MEMORY_LIMIT: refusals. Each kind of mistake has its own reason.

TEST(MemoryLimit, EmptyIsRefused) {
  memoryError("", {"empty", "unset the variable for no limit"});
  memoryError("   ", {"empty"});
}

TEST(MemoryLimit, UnparseableSizeIsRefused) {
  memoryError("8XB", {"'8XB'", "unknown unit 'XB'"});
  memoryError("lots", {"'lots'", "expected a number"});
  memoryError("1.5", {"'1.5'", "not a whole number of bytes"});
  memoryError("8GiB trailing", {"unknown unit"});
  memoryError("99999999999TiB", {"too large"});
  memoryError("0=8GiB,1=lots", {"device '1'", "'lots'", "expected a number"});
  memoryError("1=", {"device '1'", "empty"});
}

TEST(MemoryLimit, NegativeIsRefused) {
  memoryError("-1G", {"'-1G'", "negative"});
  memoryError("0=-4GiB", {"device '0'", "'-4GiB'", "negative"});
}

TEST(MemoryLimit, ZeroIsRefused) {
  for (const char* z : {"0", "0B", "0GiB", "0.0G"})
    memoryError(z, {"would deny every allocation", "unset the variable for no limit"});
  memoryError("0=8GiB,1=0", {"device '1'", "'0'", "would deny every allocation"});
}

TEST(MemoryLimit, DuplicateDeviceIsRefused) {
  memoryError("0=8GiB,0=4GiB", {"duplicate device '0'", "ordinal 0"});
  memoryError("1=8GiB,01=4GiB", {"duplicate device '01'", "ordinal 1"});
  memoryError(std::string(kUuidB) + "=1G,GPU-5E1A90C0-0001-4000-8000-0000000000AB=2G",
              {"duplicate device 'GPU-5E1A90C0-0001-4000-8000-0000000000AB'", kUuidB,
               "case-insensitively"});
}

TEST(MemoryLimit, MalformedUuidIsRefused) {
  memoryError("GPU-1234=8GiB", {"malformed UUID 'GPU-1234'", "GPU-xxxxxxxx-xxxx"});
  memoryError("GPU-5e1a90c0-0001-4000-8000-0000000000zz=8GiB",
              {"malformed UUID 'GPU-5e1a90c0-0001-4000-8000-0000000000zz'"});
  memoryError("GPU-5e1a90c00-001-4000-8000-0000000000ab=8GiB", {"malformed UUID"});   // dash moved
  memoryError("GPU-5e1a90c0-0001-4000-8000-0000000000ab0=8GiB", {"malformed UUID"});  // too long
  memoryError("GPU-=8GiB", {"malformed UUID 'GPU-'"});
  memoryError("MIG-5e1a90c0-0001-4000-8000-0000000000zz=8GiB",
              {"malformed UUID 'MIG-5e1a90c0-0001-4000-8000-0000000000zz': expected MIG-xxxxxxxx"});
  memoryError("MIG-GPU-5e1a90c0-0001-4000-8000-0000000000ab/1/0=8GiB",
              {"malformed UUID", "not the legacy MIG-GPU-<uuid>/<gi>/<ci> form"});
}

// A MIG device by its own UUID, as nvidia-smi -L prints it; it names the same device as its bytes
// spelled with GPU- (a driver's first cuDeviceGetUuid ABI may spell it so), and twice is refused.
TEST(MemoryLimit, MigDeviceUuid) {
  const MemoryLimitSpec s = parseOk("MIG-5E1A90C0-0001-5000-8000-0000000000AB=2GiB");
  ASSERT_EQ(s.entries.size(), 1u);
  EXPECT_EQ(s.entries[0].uuid, "MIG-5e1a90c0-0001-5000-8000-0000000000ab");
  uint64_t limit = 0;
  std::string error;
  ASSERT_TRUE(memoryLimitOfUuid(s, "MIG-5e1a90c0-0001-5000-8000-0000000000ab", &limit, &error)) << error;
  EXPECT_EQ(limit, 2 * kGiB);
  ASSERT_TRUE(memoryLimitOfUuid(s, "GPU-5e1a90c0-0001-5000-8000-0000000000ab", &limit, &error)) << error;
  EXPECT_EQ(limit, 2 * kGiB);
  ASSERT_TRUE(memoryLimitOfUuid(s, kUuidB, &limit, &error)) << error;
  EXPECT_EQ(limit, kUnlimited) << "another device";
  EXPECT_TRUE(sameDeviceUuid("MIG-5e1a90c0-0001-5000-8000-0000000000ab", "gpu-5E1A90C0-0001-5000-8000-0000000000AB"));
  EXPECT_FALSE(sameDeviceUuid("MIG-5e1a90c0-0001-5000-8000-0000000000ab", "MIG-5e1a90c0-0001-5000-8000-0000000000ac"));
  EXPECT_FALSE(sameDeviceUuid("MIG-x", "MIG-x")) << "not UUIDs";
  memoryError("MIG-5e1a90c0-0001-5000-8000-0000000000ab=1G,GPU-5e1a90c0-0001-5000-8000-0000000000ab=2G",
              {"duplicate device"});
}

TEST(MemoryLimit, OrdinalMustBeANonNegativeInteger) {
  memoryError("-1=8GiB", {"device '-1'", "non-negative integer ordinal"});
  memoryError("a=8GiB", {"device 'a'", "non-negative integer ordinal"});
  memoryError("1.5=8GiB", {"device '1.5'", "non-negative integer ordinal"});
  memoryError("+1=8GiB", {"device '+1'", "non-negative integer ordinal"});
  memoryError("0x1=8GiB", {"device '0x1'"});
  memoryError("99999999999=8GiB", {"ordinal '99999999999'", "too large"});
  memoryError("=8GiB", {"no device before '='"});
}

TEST(MemoryLimit, EmptyItemIsRefused) {
  memoryError("0=8GiB,,1=4GiB", {"item 2 is empty"});
  memoryError("0=8GiB,", {"item 2 is empty"});
  memoryError(",0=8GiB", {"item 1 is empty"});
  memoryError("0=8GiB, ,1=4GiB", {"item 2 is empty"});
}

TEST(MemoryLimit, ItemWithoutEqualsIsRefused) {
  memoryError("8GiB,4GiB", {"item '8GiB' has no '='"});
  memoryError("0=8GiB,4GiB", {"item '4GiB' has no '='"});
}

TEST(MemoryLimit, EveryKindOfMistakeHasItsOwnReason) {
  const std::vector<std::string> cases = {
      "",     "8XB",        "-1G",       "0",   "0=1G,0=2G",      "GPU-1=1G",
      "a=1G", "0=1G,,1=1G", "8GiB,4GiB", "=1G", "99999999999=1G",
  };
  std::set<std::string> reasons;
  for (const std::string& c : cases) {
    MemoryLimitSpec s;
    std::string reason;
    EXPECT_FALSE(parseMemoryLimit(c, &s, &reason)) << c;
    EXPECT_FALSE(reason.empty()) << c;
    reasons.insert(reason);
  }
  EXPECT_EQ(reasons.size(), cases.size());
}

TEST(MemoryLimit, FailureLeavesSpecUntouched) {
  MemoryLimitSpec s = parseOk("0=1G");
  std::string reason;
  EXPECT_FALSE(parseMemoryLimit("0=2G,1=0", &s, &reason));
  ASSERT_EQ(s.kind, MemoryLimitSpec::kPerDevice);
  ASSERT_EQ(s.entries.size(), 1u);
  EXPECT_EQ(s.entries[0].bytes, kGiB);
}

// ---------------------------------------------------------------------------------------------
// resolveMemoryLimits

struct Devices {
  std::vector<std::string> uuids;
  int lookups = 0;
  std::function<bool(int, std::string*)> lookup() {
    return [this](int d, std::string* u) {
      ++lookups;
      if (d < 0 || d >= static_cast<int>(uuids.size()) || uuids[d].empty()) return false;
      *u = uuids[d];
      return true;
    };
  }
};

std::vector<uint64_t> resolveOk(const MemoryLimitSpec& s, Devices* d) {
  std::vector<uint64_t> limits;
  std::string error;
  EXPECT_TRUE(
      resolveMemoryLimits(s, static_cast<int>(d->uuids.size()), d->lookup(), &limits, &error))
      << error;
  return limits;
}

std::string resolveError(const std::string& text, Devices* d) {
  std::vector<uint64_t> limits = {42};
  std::string error;
  EXPECT_FALSE(resolveMemoryLimits(parseOk(text), static_cast<int>(d->uuids.size()), d->lookup(),
                                   &limits, &error))
      << text;
  EXPECT_EQ(limits, std::vector<uint64_t>{42}) << "limits changed on failure";
  EXPECT_EQ(error.rfind("cushare: CUSHARE_MEMORY_LIMIT: ", 0), 0u) << error;
  EXPECT_EQ(error.find('\n'), std::string::npos) << error;
  return error;
}

TEST(MemoryLimitResolve, NoneIsUnlimitedEverywhere) {
  Devices d{{kUuidA, kUuidB}};
  EXPECT_EQ(resolveOk(MemoryLimitSpec{}, &d), (std::vector<uint64_t>{kUnlimited, kUnlimited}));
  EXPECT_EQ(d.lookups, 0);
}

TEST(MemoryLimitResolve, AllAppliesToEveryDevice) {
  Devices d{{kUuidA, kUuidB, "GPU-x"}};
  EXPECT_EQ(resolveOk(parseOk("8GiB"), &d), (std::vector<uint64_t>(3, 8 * kGiB)));
  EXPECT_EQ(d.lookups, 0);
}

TEST(MemoryLimitResolve, ZeroDevices) {
  Devices d;
  EXPECT_TRUE(resolveOk(parseOk("8GiB"), &d).empty());
  const std::string e = resolveError("0=8GiB", &d);
  EXPECT_NE(e.find("names device 0, but the process sees no devices"), std::string::npos) << e;
}

TEST(MemoryLimitResolve, OrdinalsLeaveOtherDevicesUnlimited) {
  Devices d{{kUuidA, kUuidB, ""}};
  EXPECT_EQ(resolveOk(parseOk("2=1G,0=8GiB"), &d),
            (std::vector<uint64_t>{8 * kGiB, kUnlimited, kGiB}));
  EXPECT_EQ(d.lookups, 0) << "UUIDs are read only when the spec names one";
}

TEST(MemoryLimitResolve, OrdinalOutOfRangeFails) {
  Devices d{{kUuidA, kUuidB}};
  std::string e = resolveError("0=1G,2=1G", &d);
  EXPECT_NE(e.find("names device 2, but the process sees 2 devices (ordinals 0..1)"),
            std::string::npos)
      << e;
  Devices one{{kUuidA}};
  e = resolveError("1=1G", &one);
  EXPECT_NE(e.find("sees 1 device (ordinals 0..0)"), std::string::npos) << e;
}

TEST(MemoryLimitResolve, UuidMatchesItsDevice) {
  Devices d{{kUuidA, kUuidB}};
  EXPECT_EQ(resolveOk(parseOk("GPU-5E1A90C0-0001-4000-8000-0000000000AB=4GiB"), &d),
            (std::vector<uint64_t>{kUnlimited, 4 * kGiB}));
}

TEST(MemoryLimitResolve, UnknownUuidFails) {
  Devices d{{kUuidA, kUuidB}};
  const std::string e = resolveError("GPU-00000000-0000-0000-0000-000000000000=1G", &d);
  EXPECT_NE(e.find("unknown device GPU-00000000-0000-0000-0000-000000000000"), std::string::npos)
      << e;
  EXPECT_EQ(e.find("could not be read"), std::string::npos) << e;
}

// A list shared by processes that see different subsets (CUDA_VISIBLE_DEVICES, containers): the
// UUIDs of devices a process cannot see are harmless while every device it sees is named.
TEST(MemoryLimitResolve, HiddenDeviceUuidAcceptedWhenEveryVisibleDeviceIsNamed) {
  Devices d{{kUuidB}};  // the process sees only B
  EXPECT_EQ(resolveOk(parseOk(std::string(kUuidA) + "=1G," + kUuidB + "=2G"), &d),
            (std::vector<uint64_t>{2 * kGiB}));
  EXPECT_EQ(resolveOk(parseOk(std::string(kUuidA) + "=1G,0=3G"), &d), (std::vector<uint64_t>{3 * kGiB}));
  // Nothing visible: nothing to leave unlimited.
  Devices none;
  EXPECT_TRUE(resolveOk(parseOk(std::string(kUuidA) + "=1G"), &none).empty());
}

TEST(MemoryLimitResolve, UnknownUuidWithAnUnnamedVisibleDeviceFails) {
  Devices d{{kUuidA, kUuidB}};
  const std::string e = resolveError(std::string("GPU-00000000-0000-0000-0000-000000000000=1G,") + kUuidA + "=1G", &d);
  EXPECT_NE(e.find("unknown device GPU-00000000-0000-0000-0000-000000000000"), std::string::npos) << e;
  EXPECT_NE(e.find(std::string("device 1 (") + kUuidB + ") is not named"), std::string::npos) << e;
}

TEST(MemoryLimitResolve, UnreadableUuidFailsClosed) {
  Devices d{{kUuidA, ""}};  // device 1's UUID cannot be read
  const std::string e = resolveError(std::string(kUuidB) + "=1G", &d);
  EXPECT_NE(e.find("unknown device"), std::string::npos) << e;
  EXPECT_NE(e.find("the UUID of device 1 could not be read"), std::string::npos) << e;
  // A null lookup cannot match anything either.
  std::vector<uint64_t> limits;
  std::string error;
  EXPECT_FALSE(
      resolveMemoryLimits(parseOk(std::string(kUuidA) + "=1G"), 1, nullptr, &limits, &error));
  EXPECT_NE(error.find("unknown device"), std::string::npos) << error;
}

TEST(MemoryLimitResolve, MixedOrdinalsAndUuids) {
  Devices d{{kUuidA, kUuidB, "GPU-5e1a90c0-0002-4000-8000-000000000000",
             "GPU-5e1a90c0-0003-4000-8000-000000000000"}};
  EXPECT_EQ(resolveOk(parseOk(std::string(kUuidB) + "=2G,0=1G,3=4G"), &d),
            (std::vector<uint64_t>{kGiB, 2 * kGiB, kUnlimited, 4 * kGiB}));
}

TEST(MemoryLimitResolve, DeviceNamedByOrdinalAndUuidFails) {
  Devices d{{kUuidA, kUuidB}};
  const std::string e = resolveError(std::string("1=2G,") + kUuidB + "=1G", &d);
  EXPECT_NE(e.find("device 1 is named twice, as ordinal 1 and as " + std::string(kUuidB)),
            std::string::npos)
      << e;
}

TEST(MemoryLimitResolve, FormatGpuUuidMatchesTheParsedForm) {
  const unsigned char bytes[16] = {0x5e, 0x1a, 0x90, 0xc0, 0x00, 0x01, 0x40, 0x00,
                                   0x80, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xab};
  EXPECT_EQ(formatGpuUuid(bytes), kUuidB);
  EXPECT_EQ(parseOk(formatGpuUuid(bytes) + "=1G").entries[0].uuid, kUuidB);
}

// An NVML-only process resolves one device by UUID; ordinals cannot be matched without CUDA.
TEST(MemoryLimitOfUuid, ResolvesByUuidAndFailsClosedOnOrdinals) {
  uint64_t l = 0;
  std::string err;
  EXPECT_TRUE(memoryLimitOfUuid(parseOk("8GiB"), kUuidB, &l, &err));
  EXPECT_EQ(l, 8 * kGiB);
  EXPECT_TRUE(memoryLimitOfUuid(MemoryLimitSpec{}, kUuidB, &l, &err));
  EXPECT_EQ(l, kUnlimited);
  EXPECT_TRUE(memoryLimitOfUuid(parseOk(std::string(kUuidB) + "=1GiB"), kUuidB, &l, &err));
  EXPECT_EQ(l, kGiB);
  EXPECT_TRUE(memoryLimitOfUuid(parseOk(std::string(kUuidA) + "=1GiB"), kUuidB, &l, &err));
  EXPECT_EQ(l, kUnlimited) << "a device the list does not name has no limit";
  EXPECT_TRUE(memoryLimitOfUuid(parseOk("0=2GiB," + std::string(kUuidB) + "=1GiB"), kUuidB, &l, &err));
  EXPECT_EQ(l, kGiB) << "named by UUID: the ordinals do not matter";
  EXPECT_FALSE(memoryLimitOfUuid(parseOk("0=2GiB"), kUuidB, &l, &err));
  EXPECT_NE(err.find("names devices by ordinal"), std::string::npos) << err;
  EXPECT_EQ(err.find('\n'), std::string::npos);
}

TEST(MemoryLimitOfUuid, ParseGpuUuidBytesIsTheReverseOfFormat) {
  unsigned char bytes[16] = {};
  ASSERT_TRUE(parseGpuUuidBytes("GPU-5E1A90C0-0001-4000-8000-0000000000AB", bytes));
  EXPECT_EQ(formatGpuUuid(bytes), kUuidB);
  EXPECT_FALSE(parseGpuUuidBytes("GPU-5e1a90c0-0001-4000-8000-0000000000a", bytes));
  ASSERT_TRUE(parseGpuUuidBytes("MIG-5e1a90c0-0001-4000-8000-0000000000ab", bytes)) << "a MIG device's UUID";
  EXPECT_EQ(formatGpuUuid(bytes), kUuidB);
  EXPECT_EQ(formatDeviceUuid(bytes, true), "MIG-5e1a90c0-0001-4000-8000-0000000000ab");
  EXPECT_FALSE(parseGpuUuidBytes("MIG-GPU-5e1a90c0-0001-4000-8000-0000000000ab/1/0", bytes));
  EXPECT_FALSE(parseGpuUuidBytes("XYZ-5e1a90c0-0001-4000-8000-0000000000ab", bytes));
  EXPECT_FALSE(parseGpuUuidBytes("GPU-5e1a90c000014000-8000-0000000000ab--", bytes));
}

// ---------------------------------------------------------------------------------------------
// The whole configuration

TEST(ShimConfig, DefaultsWhenNothingIsSet) {
  Env env;
  ShimConfig c;
  c.tenant = "junk";
  std::string error = "untouched";
  ASSERT_TRUE(loadShimConfig(env.getenv(), &c, &error));
  EXPECT_EQ(error, "untouched");
  EXPECT_EQ(c.tenant, "default");
  EXPECT_EQ(c.memory.kind, MemoryLimitSpec::kNone);
  EXPECT_FALSE(c.threadPercentage.has_value());
  EXPECT_EQ(c.priority, Priority::kNormal);
  EXPECT_EQ(c.ledgerDir, "/dev/shm/cushare");
  EXPECT_EQ(c.logLevel, LogLevel::kWarn);
}

TEST(ShimConfig, ReadsEveryVariableItNames) {
  Env env;
  ShimConfig c;
  std::string error;
  ASSERT_TRUE(loadShimConfig(env.getenv(), &c, &error));
  EXPECT_EQ(std::set<std::string>(env.asked.begin(), env.asked.end()),
            std::set<std::string>(std::begin(kShimVariables), std::end(kShimVariables)));
  for (const char* v : kShimVariables) EXPECT_TRUE(isShimVariable(v)) << v;
  EXPECT_FALSE(isShimVariable("CUSHARE_MEMORY_LIMT"));
  EXPECT_FALSE(isShimVariable("CUSHARE_"));
  EXPECT_FALSE(isShimVariable("cushare_tenant"));
}

TEST(ShimConfig, AllSet) {
  Env env;
  env.vars = {{"CUSHARE_TENANT", "team-a.prod_1"},     {"CUSHARE_MEMORY_LIMIT", "0=8GiB,1=4GiB"},
              {"CUSHARE_THREAD_PERCENTAGE", "50"},     {"CUSHARE_PRIORITY", "high"},
              {"CUSHARE_LEDGER_DIR", "/run/cushare/"}, {"CUSHARE_LOG_LEVEL", "trace"}};
  ShimConfig c;
  std::string error;
  ASSERT_TRUE(loadShimConfig(env.getenv(), &c, &error)) << error;
  EXPECT_EQ(c.tenant, "team-a.prod_1");
  ASSERT_EQ(c.memory.kind, MemoryLimitSpec::kPerDevice);
  EXPECT_EQ(c.memory.entries.size(), 2u);
  EXPECT_EQ(c.threadPercentage, 50);
  EXPECT_EQ(c.priority, Priority::kHigh);
  EXPECT_EQ(c.ledgerDir, "/run/cushare");
  EXPECT_EQ(c.logLevel, LogLevel::kTrace);
}

TEST(ShimConfig, Tenant) {
  ShimConfig c;
  EXPECT_EQ(loadError("CUSHARE_TENANT", "A.b_c-9", &c), "");
  EXPECT_EQ(c.tenant, "A.b_c-9");
  EXPECT_EQ(loadError("CUSHARE_TENANT", std::string(63, 'x'), &c), "");
  EXPECT_EQ(c.tenant.size(), 63u);

  std::string e = loadError("CUSHARE_TENANT", std::string(64, 'x'));
  EXPECT_NE(e.find("64 characters, at most 63"), std::string::npos) << e;
  e = loadError("CUSHARE_TENANT", "");
  EXPECT_EQ(e,
            "cushare: invalid CUSHARE_TENANT='': empty; unset the variable for tenant 'default'");
  e = loadError("CUSHARE_TENANT", "team a");
  EXPECT_EQ(e,
            "cushare: invalid CUSHARE_TENANT='team a': character ' ' at position 5 is not allowed "
            "(use A-Z a-z 0-9 . _ -)");
  e = loadError("CUSHARE_TENANT", "a/b");
  EXPECT_NE(e.find("character '/' at position 2"), std::string::npos) << e;
  e = loadError("CUSHARE_TENANT", "..");
  EXPECT_NE(e.find("'..' is not allowed"), std::string::npos) << e;
  e = loadError("CUSHARE_TENANT", "caf\xc3\xa9");
  EXPECT_NE(e.find("at position 4"), std::string::npos) << e;
}

TEST(ShimConfig, ThreadPercentage) {
  ShimConfig c;
  EXPECT_EQ(loadError("CUSHARE_THREAD_PERCENTAGE", "1", &c), "");
  EXPECT_EQ(c.threadPercentage, 1);
  EXPECT_EQ(loadError("CUSHARE_THREAD_PERCENTAGE", " 100 ", &c), "");
  EXPECT_EQ(c.threadPercentage, 100);
  for (const char* bad : {"0", "101", "-5", "abc", "50%", "12.5", "99999999999999999999999"}) {
    const std::string e = loadError("CUSHARE_THREAD_PERCENTAGE", bad);
    EXPECT_EQ(e.rfind(std::string("cushare: invalid CUSHARE_THREAD_PERCENTAGE='") + bad + "': ", 0),
              0u)
        << e;
    EXPECT_NE(e.find("1..100"), std::string::npos) << e;
  }
  EXPECT_EQ(loadError("CUSHARE_THREAD_PERCENTAGE", "101"),
            "cushare: invalid CUSHARE_THREAD_PERCENTAGE='101': 101 is out of range 1..100");
  EXPECT_EQ(loadError("CUSHARE_THREAD_PERCENTAGE", "50%"),
            "cushare: invalid CUSHARE_THREAD_PERCENTAGE='50%': expected a whole percentage "
            "1..100 (without '%')");
  const std::string e = loadError("CUSHARE_THREAD_PERCENTAGE", "");
  EXPECT_NE(e.find("empty"), std::string::npos) << e;
}

TEST(ShimConfig, Priority) {
  ShimConfig c;
  for (auto [text, p] : {std::pair{"high", Priority::kHigh},
                         {"normal", Priority::kNormal},
                         {"low", Priority::kLow}}) {
    EXPECT_EQ(loadError("CUSHARE_PRIORITY", text, &c), "");
    EXPECT_EQ(c.priority, p);
    EXPECT_STREQ(priorityName(p), text);
  }
  EXPECT_EQ(loadError("CUSHARE_PRIORITY", "HIGH"),
            "cushare: invalid CUSHARE_PRIORITY='HIGH': 'HIGH' is not one of high, normal, low "
            "(lower case); did you mean 'high'?");
  std::string e = loadError("CUSHARE_PRIORITY", "urgent");
  EXPECT_NE(e.find("'urgent' is not one of high, normal, low"), std::string::npos) << e;
  EXPECT_EQ(e.find("did you mean"), std::string::npos) << e;
  e = loadError("CUSHARE_PRIORITY", " low");
  EXPECT_NE(e.find("' low' is not one of"), std::string::npos) << e;
  e = loadError("CUSHARE_PRIORITY", "");
  EXPECT_NE(e.find("empty"), std::string::npos) << e;
}

TEST(ShimConfig, Metering) {
  ShimConfig c;
  EXPECT_EQ(c.metering, MeteringSource::kAuto) << "default: CUPTI if it starts, else events";
  for (auto [text, m] : {std::pair{"events", MeteringSource::kEvents},
                         {"cupti", MeteringSource::kCupti},
                         {"auto", MeteringSource::kAuto}}) {
    c.metering = m == MeteringSource::kAuto ? MeteringSource::kEvents : MeteringSource::kAuto;
    EXPECT_EQ(loadError("CUSHARE_METERING", text, &c), "");
    EXPECT_EQ(c.metering, m);
    EXPECT_STREQ(meteringName(m), text);
  }
  EXPECT_EQ(loadError("CUSHARE_METERING", "CUPTI"),
            "cushare: invalid CUSHARE_METERING='CUPTI': 'CUPTI' is not one of events, cupti, auto "
            "(lower case); did you mean 'cupti'?");
  std::string e = loadError("CUSHARE_METERING", "nvml");
  EXPECT_NE(e.find("'nvml' is not one of events, cupti, auto"), std::string::npos) << e;
  e = loadError("CUSHARE_METERING", "events ");
  EXPECT_NE(e.find("'events ' is not one of"), std::string::npos) << e;
  e = loadError("CUSHARE_METERING", "");
  EXPECT_NE(e.find("empty"), std::string::npos) << e;
  EXPECT_TRUE(isShimVariable("CUSHARE_METERING"));
  EXPECT_FALSE(isShimVariable("CUSHARE_METERNG"));
}

TEST(ShimConfig, LedgerDir) {
  ShimConfig c;
  EXPECT_EQ(loadError("CUSHARE_LEDGER_DIR", "/tmp/x", &c), "");
  EXPECT_EQ(c.ledgerDir, "/tmp/x");
  EXPECT_EQ(loadError("CUSHARE_LEDGER_DIR", "/tmp/x//", &c), "");
  EXPECT_EQ(c.ledgerDir, "/tmp/x");
  EXPECT_EQ(loadError("CUSHARE_LEDGER_DIR", "/", &c), "");
  EXPECT_EQ(c.ledgerDir, "/");
  EXPECT_EQ(loadError("CUSHARE_LEDGER_DIR", "cushare"),
            "cushare: invalid CUSHARE_LEDGER_DIR='cushare': not an absolute path (it must start "
            "with '/')");
  std::string e = loadError("CUSHARE_LEDGER_DIR", "");
  EXPECT_NE(e.find("empty"), std::string::npos) << e;
  e = loadError("CUSHARE_LEDGER_DIR", "/" + std::string(4095, 'd'));
  EXPECT_NE(e.find("4096 bytes, at most 4095"), std::string::npos) << e;
  e = loadError("CUSHARE_LEDGER_DIR", "/a\tb");
  EXPECT_NE(e.find("control character at position 3"), std::string::npos) << e;
}

TEST(ShimConfig, LogLevel) {
  ShimConfig c;
  const std::pair<const char*, LogLevel> levels[] = {{"error", LogLevel::kError},
                                                     {"warn", LogLevel::kWarn},
                                                     {"info", LogLevel::kInfo},
                                                     {"debug", LogLevel::kDebug},
                                                     {"trace", LogLevel::kTrace}};
  for (auto [text, l] : levels) {
    EXPECT_EQ(loadError("CUSHARE_LOG_LEVEL", text, &c), "");
    EXPECT_EQ(c.logLevel, l);
    EXPECT_STREQ(logLevelName(l), text);
  }
  EXPECT_EQ(loadError("CUSHARE_LOG_LEVEL", "verbose"),
            "cushare: invalid CUSHARE_LOG_LEVEL='verbose': 'verbose' is not one of error, warn, "
            "info, debug, trace (lower case)");
  std::string e = loadError("CUSHARE_LOG_LEVEL", "Warn");
  EXPECT_NE(e.find("did you mean 'warn'?"), std::string::npos) << e;
  e = loadError("CUSHARE_LOG_LEVEL", "warning");
  EXPECT_NE(e.find("'warning' is not one of"), std::string::npos) << e;
}

TEST(ShimConfig, RequireBroker) {
  ShimConfig c;
  EXPECT_FALSE(c.requireBroker);
  EXPECT_EQ(loadError("CUSHARE_REQUIRE_BROKER", "1", &c), "");
  EXPECT_TRUE(c.requireBroker);
  EXPECT_EQ(loadError("CUSHARE_REQUIRE_BROKER", "0", &c), "");
  EXPECT_FALSE(c.requireBroker);
  for (const char* bad : {"yes", "true", "", " 1", "2"})
    EXPECT_NE(loadError("CUSHARE_REQUIRE_BROKER", bad).find("invalid CUSHARE_REQUIRE_BROKER"), std::string::npos) << bad;
}

TEST(ShimConfig, ErrorIsOneLineEvenForHostileValues) {
  std::string e = loadError("CUSHARE_MEMORY_LIMIT", "0=1G\n1=2G");
  EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  EXPECT_NE(e.find("'0=1G\\n1=2G'"), std::string::npos) << e;
  e = loadError("CUSHARE_TENANT", std::string("a\x1b[31mb", 7));
  EXPECT_EQ(e.find('\x1b'), std::string::npos) << e;
  EXPECT_NE(e.find("\\x1b"), std::string::npos) << e;
  // A huge value is shortened, with its length, so one line stays readable.
  e = loadError("CUSHARE_MEMORY_LIMIT", std::string(100000, '9') + "Q");
  EXPECT_LT(e.size(), 1000u) << e;
  EXPECT_NE(e.find("...(100001 bytes)"), std::string::npos) << e;
}

TEST(ShimConfig, FirstInvalidVariableIsReportedAndOutputIsUntouched) {
  Env env;
  env.vars = {{"CUSHARE_MEMORY_LIMIT", "0"},
              {"CUSHARE_PRIORITY", "urgent"},
              {"CUSHARE_LOG_LEVEL", "debug"}};
  ShimConfig c;
  c.tenant = "before";
  c.logLevel = LogLevel::kError;
  std::string error;
  ASSERT_FALSE(loadShimConfig(env.getenv(), &c, &error));
  EXPECT_EQ(error.rfind("cushare: invalid CUSHARE_MEMORY_LIMIT='0': ", 0), 0u) << error;
  EXPECT_EQ(c.tenant, "before");
  EXPECT_EQ(c.logLevel, LogLevel::kError);
}

// CUSHARE_MPS_PIPE_DIR: a container's view of the broker's MPS pipe directory (docs/containers.md).
TEST(ShimConfig, MpsPipeDir) {
  ShimConfig c;
  EXPECT_EQ(loadError("CUSHARE_MPS_PIPE_DIR", "/run/cushare/mps/", &c), "");
  EXPECT_EQ(c.mpsPipeDir, "/run/cushare/mps");
  EXPECT_TRUE(isShimVariable("CUSHARE_MPS_PIPE_DIR"));
  std::string e = loadError("CUSHARE_MPS_PIPE_DIR", "run/mps");
  EXPECT_NE(e.find("not an absolute path"), std::string::npos) << e;
  e = loadError("CUSHARE_MPS_PIPE_DIR", "");
  EXPECT_NE(e.find("empty"), std::string::npos) << e;
  e = loadError("CUSHARE_MPS_PIPE_DIR", "/" + std::string(99, 'x'));
  EXPECT_NE(e.find("at most 99"), std::string::npos) << e;
  EXPECT_EQ(loadError("CUSHARE_MPS_PIPE_DIR", "/" + std::string(98, 'x')), "");
}

}  // namespace
}  // namespace cushare
