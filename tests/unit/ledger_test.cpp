// The tenant ledger: its ABI against docs/ledger-abi.md and the bytes on disk, creation and
// fail-closed validation, exact reservations, and the cross-process properties: many processes
// racing for one quota never exceed it, kill -9 at random instants leaks nothing, a forked child
// gets a slot of its own, and a dead parent is reaped while its forked child lives.
//
// Helpers run in forked children of this test process (no gtest in a child: it reports through
// its exit status, shared anonymous memory or a pipe, and ends with _exit).
#include "cushare/host_segment.h"
#include "cushare/limits_file.h"
#include "cushare/ledger.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <new>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <algorithm>
#include <vector>

namespace cushare {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint8_t kUuidA[16] = {0xa0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
constexpr uint8_t kUuidB[16] = {0xb0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

// A fresh directory under the test temp dir, removed afterwards. Ledgers go to <path>/ledgers,
// which the Ledger creates itself.
class TempDir {
 public:
  TempDir() {
    std::string base = ::testing::TempDir();
    if (base.empty() || base.back() != '/') base += '/';
    std::string tmpl = base + "cushare_ledger_XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) std::abort();
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string ledgers() const { return path_ + "/ledgers"; }

 private:
  std::string path_;
};

std::unique_ptr<Ledger> mustOpen(const std::string& dir, const std::string& tenant) {
  std::string err;
  auto l = Ledger::open(dir, tenant, &err);
  EXPECT_NE(l, nullptr) << err;
  return l;
}

// Memory shared with forked children.
template <class T>
T* sharedObject() {
  void* p = ::mmap(nullptr, sizeof(T), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) std::abort();
  return new (p) T();
}
template <class T>
void freeShared(T* p) {
  p->~T();
  ::munmap(p, sizeof(T));
}

// Forks; the child runs fn and _exits with its result (destructors of the test's objects never
// run in the child). fn may _exit itself to skip its own destructors.
pid_t spawn(const std::function<int()>& fn) {
  const pid_t pid = ::fork();
  if (pid < 0) std::abort();
  if (pid == 0) {
    int rc = 99;
    try {
      rc = fn();
    } catch (...) {
      rc = 98;
    }
    ::_exit(rc);
  }
  return pid;
}

// Exit status, or 128 + signal.
int waitExit(pid_t pid) {
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

void cpuPause() { std::this_thread::yield(); }

template <class T>
void atomicMax(std::atomic<T>& a, T v) {
  T cur = a.load();
  while (v > cur && !a.compare_exchange_weak(cur, v)) {
  }
}

std::string readFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

template <class T>
T readAt(const std::string& bytes, size_t offset) {
  T v{};
  if (offset + sizeof(T) <= bytes.size()) std::memcpy(&v, bytes.data() + offset, sizeof(T));
  return v;
}

// ---------------------------------------------------------------------------------------------
// The ABI

// docs/ledger-abi.md, found from this file's path (tests/unit/ -> repository root).
std::string abiDoc() {
  const auto root = std::filesystem::path(__FILE__).parent_path().parent_path().parent_path();
  return readFile((root / "docs" / "ledger-abi.md").string());
}

std::vector<std::string> cells(const std::string& line) {
  std::vector<std::string> out;
  std::string cur;
  for (size_t i = 1; i < line.size(); ++i) {
    if (line[i] == '|') {
      const size_t b = cur.find_first_not_of(' '), e = cur.find_last_not_of(' ');
      out.push_back(b == std::string::npos ? "" : cur.substr(b, e - b + 1));
      cur.clear();
    } else {
      cur += line[i];
    }
  }
  return out;
}

std::string unquote(const std::string& s) {
  return s.size() >= 2 && s.front() == '`' && s.back() == '`' ? s.substr(1, s.size() - 2) : "";
}

bool isNumber(const std::string& s) {
  return !s.empty() && s.find_first_not_of("0123456789") == std::string::npos;
}

TEST(LedgerAbi, LayoutMatchesTheDocumentation) {
  const std::string doc = abiDoc();
  ASSERT_FALSE(doc.empty()) << "docs/ledger-abi.md not found from " << __FILE__;
  std::map<std::string, std::pair<uint64_t, uint64_t>> layout;  // field -> offset, size
  std::map<std::string, uint64_t> constants;
  std::istringstream in(doc);
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] != '|') continue;
    const auto c = cells(line);
    if (c.size() >= 3 && isNumber(c[0]) && isNumber(c[1]) && !unquote(c[2]).empty()) {
      EXPECT_EQ(layout.count(unquote(c[2])), 0u) << "documented twice: " << c[2];
      layout[unquote(c[2])] = {std::stoull(c[0]), std::stoull(c[1])};
    } else if (c.size() >= 2 && !unquote(c[0]).empty() && !c[1].empty()) {
      constants[unquote(c[0])] = std::stoull(c[1], nullptr, 0);
    }
  }
  const std::map<std::string, std::pair<uint64_t, uint64_t>> code = {
      {"magic", {offsetof(LedgerHeader, magic), sizeof(LedgerHeader::magic)}},
      {"version", {offsetof(LedgerHeader, version), sizeof(LedgerHeader::version)}},
      {"header_size", {offsetof(LedgerHeader, header_size), sizeof(LedgerHeader::header_size)}},
      {"file_size", {offsetof(LedgerHeader, file_size), sizeof(LedgerHeader::file_size)}},
      {"max_devices", {offsetof(LedgerHeader, max_devices), sizeof(LedgerHeader::max_devices)}},
      {"max_slots", {offsetof(LedgerHeader, max_slots), sizeof(LedgerHeader::max_slots)}},
      {"tenant", {offsetof(LedgerHeader, tenant), sizeof(LedgerHeader::tenant)}},
      {"slot_hwm", {offsetof(LedgerHeader, slot_hwm), sizeof(LedgerHeader::slot_hwm)}},
      {"reserved0", {offsetof(LedgerHeader, reserved0), sizeof(LedgerHeader::reserved0)}},
      {"reserved1", {offsetof(LedgerHeader, reserved1), sizeof(LedgerHeader::reserved1)}},
      {"devices", {offsetof(LedgerHeader, devices), sizeof(LedgerHeader::devices)}},
      {"used", {kLedgerUsedOffset, kLedgerUsedBytes}},
      {"pid", {kLedgerPidOffset, kLedgerPidBytes}},
      {"compute", {kLedgerComputeOffset, kLedgerComputeBytes}},
      {"compute_slots", {kLedgerComputeSlotOffset, kLedgerComputeSlotBytes}},
#define CD(f) {"compute[d]." #f, {offsetof(LedgerComputeDevice, f), sizeof(LedgerComputeDevice::f)}}
      CD(mode), CD(gate), CD(gate_epoch), CD(cap), CD(priority), CD(others), CD(probe_seq), CD(probe_slot),
      CD(probe_at_ns), CD(probe_what), CD(probe_budget_us), CD(reserved1),
#undef CD
#define CS(f) {"compute_slots[d][s]." #f, {offsetof(LedgerComputeSlot, f), sizeof(LedgerComputeSlot::f)}}
      CS(busy_ns), CS(throttled_ns), CS(activity_ns), CS(activity), CS(inflight),
#undef CS
      {"devices[d].uuid", {offsetof(LedgerDevice, uuid), sizeof(LedgerDevice::uuid)}},
      {"devices[d].limit", {offsetof(LedgerDevice, limit), sizeof(LedgerDevice::limit)}},
      {"devices[d].peak", {offsetof(LedgerDevice, peak), sizeof(LedgerDevice::peak)}},
      {"devices[d].denied", {offsetof(LedgerDevice, denied), sizeof(LedgerDevice::denied)}},
      {"devices[d].state", {offsetof(LedgerDevice, state), sizeof(LedgerDevice::state)}},
      {"devices[d].reserved0",
       {offsetof(LedgerDevice, reserved0), sizeof(LedgerDevice::reserved0)}},
      {"devices[d].want_bytes", {offsetof(LedgerDevice, want_bytes), sizeof(LedgerDevice::want_bytes)}},
      {"devices[d].want_ns", {offsetof(LedgerDevice, want_ns), sizeof(LedgerDevice::want_ns)}},
#define HOST_FIELD(f) {"host." #f, {offsetof(HostSegmentLayout, f), sizeof(HostSegmentLayout::f)}}
      HOST_FIELD(magic), HOST_FIELD(version), HOST_FIELD(header_size), HOST_FIELD(file_size),
      HOST_FIELD(broker_pid), HOST_FIELD(device_count), HOST_FIELD(config_generation),
      HOST_FIELD(unknown_policy), HOST_FIELD(reserved0), HOST_FIELD(unknown_profile),
      HOST_FIELD(devices), HOST_FIELD(metering), HOST_FIELD(reserved1), HOST_FIELD(cupti_library),
#undef HOST_FIELD
#define HOST_DEVICE_FIELD(f) {"host.devices[d]." #f, {offsetof(HostDeviceLayout, f), sizeof(HostDeviceLayout::f)}}
      HOST_DEVICE_FIELD(uuid), HOST_DEVICE_FIELD(capacity), HOST_DEVICE_FIELD(unknown_limit),
      HOST_DEVICE_FIELD(reserved),
#undef HOST_DEVICE_FIELD
#define LIMITS_FIELD(f) {"limits." #f, {offsetof(LimitsHeader, f), sizeof(LimitsHeader::f)}}
      LIMITS_FIELD(magic), LIMITS_FIELD(version), LIMITS_FIELD(header_size), LIMITS_FIELD(file_size),
      LIMITS_FIELD(ledger_ino), LIMITS_FIELD(tenant), LIMITS_FIELD(plain_mask), LIMITS_FIELD(reclaim_wait_ms),
      LIMITS_FIELD(reserved), LIMITS_FIELD(entries),
#undef LIMITS_FIELD
#define LIMITS_ENTRY_FIELD(f) {"limits.entries[e]." #f, {offsetof(LimitsEntry, f), sizeof(LimitsEntry::f)}}
      LIMITS_ENTRY_FIELD(uuid), LIMITS_ENTRY_FIELD(limit), LIMITS_ENTRY_FIELD(state), LIMITS_ENTRY_FIELD(reserved0),
      LIMITS_ENTRY_FIELD(burst_above), LIMITS_ENTRY_FIELD(evictable),
      LIMITS_ENTRY_FIELD(reclaim_target), LIMITS_ENTRY_FIELD(reclaim_seq),
#undef LIMITS_ENTRY_FIELD
  };
  EXPECT_EQ(layout, code) << "docs/ledger-abi.md and ledger_abi.h disagree";
  const std::map<std::string, uint64_t> codeConstants = {
      {"kLedgerMagic", kLedgerMagic},
      {"kLedgerVersion", kLedgerVersion},
      {"kLedgerMaxDevices", kLedgerMaxDevices},
      {"kLedgerMaxSlots", kLedgerMaxSlots},
      {"kLedgerSlotLockBase", static_cast<uint64_t>(kLedgerSlotLockBase)},
      {"kLedgerSlotPidLockBase", static_cast<uint64_t>(kLedgerSlotPidLockBase)},
      {"header_size", sizeof(LedgerHeader)},
      {"kLedgerFileSize", kLedgerFileSize},
      {"kLedgerLimitPending", kLedgerLimitPending},
      {"kComputeNoCap", kComputeNoCap},
      {"kHostMagic", kHostMagic},
      {"kHostVersion", kHostVersion},
      {"kHostMaxDevices", kHostMaxDevices},
      {"kLimitsMagic", kLimitsMagic},
      {"kLimitsVersion", kLimitsVersion},
  };
  EXPECT_EQ(constants, codeConstants);
  // The sizes add up: fields tile the header, the device entry and the file without holes.
  EXPECT_EQ(sizeof(LedgerDevice) * kLedgerMaxDevices, sizeof(LedgerHeader::devices));
  EXPECT_EQ(kLedgerUsedOffset + kLedgerUsedBytes + kLedgerPidBytes, kLedgerComputeOffset);
  EXPECT_EQ(sizeof(LedgerComputeDevice) * kLedgerMaxDevices, kLedgerComputeBytes);
  EXPECT_EQ(kLedgerComputeOffset + kLedgerComputeBytes + kLedgerComputeSlotBytes, kLedgerFileSize);
  char magic[8];
  std::memcpy(magic, &kLedgerMagic, 8);
  EXPECT_EQ(std::string(magic, 8), std::string("CUSHLDG\0", 8));
}

TEST(LedgerAbi, FileBytesAreWhereTheDocumentationSays) {
  TempDir tmp;
  auto l = mustOpen(tmp.ledgers(), "bytes");
  ASSERT_NE(l, nullptr);
  std::string err;
  ASSERT_EQ(l->deviceIndex(kUuidA, 100 * kMiB, &err), 0) << err;
  ASSERT_EQ(l->deviceIndex(kUuidB, 200 * kMiB, &err), 1) << err;
  ASSERT_TRUE(l->reserve(1, 3 * kMiB, 200 * kMiB));
  const int slot = l->slot();
  ASSERT_GE(slot, 0);

  const std::string f = readFile(l->path());
  ASSERT_EQ(f.size(), 84608u);
  EXPECT_EQ(f.substr(0, 8), std::string("CUSHLDG\0", 8));
  EXPECT_EQ(readAt<uint32_t>(f, 8), 3u);
  EXPECT_EQ(readAt<uint32_t>(f, 12), 1152u);
  EXPECT_EQ(readAt<uint64_t>(f, 16), 84608u);
  EXPECT_EQ(readAt<uint32_t>(f, 24), 16u);
  EXPECT_EQ(readAt<uint32_t>(f, 28), 128u);
  EXPECT_EQ(std::string(f.data() + 32), "bytes");
  EXPECT_EQ(readAt<uint32_t>(f, 96), static_cast<uint32_t>(slot + 1));
  const size_t dev1 = 128 + 64 * 1;
  EXPECT_EQ(f.substr(dev1, 16), std::string(reinterpret_cast<const char*>(kUuidB), 16));
  EXPECT_EQ(readAt<uint64_t>(f, dev1 + 16), 200 * kMiB);
  EXPECT_EQ(readAt<uint64_t>(f, dev1 + 24), 3 * kMiB);    // peak
  EXPECT_EQ(readAt<uint64_t>(f, dev1 + 32), 0u);          // denied
  EXPECT_EQ(readAt<uint32_t>(f, dev1 + 40), 2u);          // ready
  EXPECT_EQ(readAt<uint32_t>(f, 128 + 64 * 2 + 40), 0u);  // free
  EXPECT_EQ(readAt<uint64_t>(f, 1152 + 8 * (128 * 1 + slot)), 3 * kMiB);
  EXPECT_EQ(readAt<uint64_t>(f, 1152 + 8 * (128 * 0 + slot)), 0u);
  EXPECT_EQ(readAt<int32_t>(f, 17536 + 4 * slot), static_cast<int32_t>(::getpid()));
  // The compute region: the broker's words of entry 1, this slot's counters on entry 1.
  l->compute(1)->cap.store(2500);
  l->compute(1)->mode.store(kComputeMetered | kComputePaced);
  l->computeSlotAt(1, slot)->busy_ns.store(123456789);
  l->computeSlotAt(1, slot)->inflight.store(3);
  const std::string g = readFile(l->path());
  EXPECT_EQ(readAt<uint32_t>(g, 18048 + 64 * 1 + 0), 3u);     // mode
  EXPECT_EQ(readAt<uint32_t>(g, 18048 + 64 * 1 + 12), 2500u); // cap
  EXPECT_EQ(readAt<uint64_t>(g, 19072 + 32 * (128 * 1 + slot)), 123456789u);
  EXPECT_EQ(readAt<uint32_t>(g, 19072 + 32 * (128 * 1 + slot) + 28), 3u);
}

// ---------------------------------------------------------------------------------------------
// Creation, reopening, validation

TEST(Ledger, CreatesPrivateFilesAndSharesState) {
  TempDir tmp;
  ::umask(022);
  auto a = mustOpen(tmp.ledgers(), "team-a");
  ASSERT_NE(a, nullptr);
  struct stat st;
  ASSERT_EQ(::stat(tmp.ledgers().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  ASSERT_EQ(::stat(a->path().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(a->path(), tmp.ledgers() + "/team-a.ledger");

  std::string err;
  const int dev = a->deviceIndex(kUuidA, 64 * kMiB, &err);
  ASSERT_EQ(dev, 0) << err;
  EXPECT_EQ(a->limit(dev), 64 * kMiB);
  EXPECT_TRUE(a->reserve(dev, 5 * kMiB, a->limit(dev)));

  // A second mapping (as another process would have): its own slot, the same counters.
  auto b = mustOpen(tmp.ledgers(), "team-a");
  ASSERT_NE(b, nullptr);
  EXPECT_NE(a->slot(), b->slot());
  EXPECT_EQ(b->deviceIndex(kUuidA, 1 * kMiB, &err), dev) << "the limit is set only when adding";
  EXPECT_EQ(b->limit(dev), 64 * kMiB);
  EXPECT_EQ(b->used(dev), 5 * kMiB);
  b->setLimit(dev, 32 * kMiB);
  EXPECT_EQ(a->limit(dev), 32 * kMiB);
  EXPECT_EQ(b->deviceIndex(kUuidB, kLedgerNoLimit, &err), 1) << err;
  EXPECT_EQ(a->deviceIndex(kUuidB, 0, &err), 1);
  EXPECT_EQ(a->limit(1), kLedgerNoLimit);

  const auto procs = b->processes(dev);
  ASSERT_EQ(procs.size(), 2u);
  uint64_t total = 0;
  for (const auto& p : procs) {
    EXPECT_EQ(p.pid, ::getpid());
    total += p.bytes;
  }
  EXPECT_EQ(total, 5 * kMiB);

  // Closing a returns what it held; limits and device entries persist across reopening.
  a.reset();
  EXPECT_EQ(b->used(dev), 0u);
  b.reset();
  auto c = mustOpen(tmp.ledgers(), "team-a");
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->deviceIndex(kUuidA, 1, &err), 0);
  EXPECT_EQ(c->limit(0), 32 * kMiB);
  EXPECT_EQ(c->peak(0), 5 * kMiB);
  EXPECT_EQ(c->used(0), 0u);
  EXPECT_EQ(c->processes(0).size(), 1u);
}

TEST(Ledger, DeviceTableHasSixteenEntries) {
  TempDir tmp;
  auto l = mustOpen(tmp.ledgers(), "devices");
  ASSERT_NE(l, nullptr);
  std::string err;
  uint8_t uuid[16] = {};
  for (int i = 0; i < 16; ++i) {
    uuid[0] = static_cast<uint8_t>(i);
    ASSERT_EQ(l->deviceIndex(uuid, 1000 + i, &err), i) << err;
  }
  uuid[0] = 16;
  EXPECT_EQ(l->deviceIndex(uuid, 1, &err), -1);
  EXPECT_NE(err.find("all 16 device entries"), std::string::npos) << err;
  uuid[0] = 7;
  EXPECT_EQ(l->deviceIndex(uuid, 1, &err), 7);
  EXPECT_EQ(l->limit(7), 1007u);
  EXPECT_FALSE(l->reserve(16, 1, kLedgerNoLimit));
  EXPECT_FALSE(l->reserve(-1, 1, kLedgerNoLimit));
}

TEST(Ledger, TenantNames) {
  for (const char* ok : {"a", "default", "team-a.prod_1", "A9"}) {
    std::string err;
    EXPECT_TRUE(Ledger::validTenantName(ok, &err)) << ok << ": " << err;
  }
  EXPECT_TRUE(Ledger::validTenantName(std::string(63, 'x'), nullptr));
  const std::string bad[] = {"",           std::string(64, 'x'), "a/b", "../etc",
                             "with space", "t\xc3\xa9",          "a:b", std::string("nul\0x", 5),
                             "semi;colon"};
  TempDir tmp;
  for (const std::string& name : bad) {
    std::string err;
    EXPECT_FALSE(Ledger::validTenantName(name, &err)) << name;
    EXPECT_NE(err.find("tenant name"), std::string::npos) << err;
    err.clear();
    EXPECT_EQ(Ledger::open(tmp.ledgers(), name, &err), nullptr) << name;
    EXPECT_NE(err.find("tenant name"), std::string::npos) << err;
  }
  EXPECT_FALSE(std::filesystem::exists(tmp.ledgers())) << "nothing is created for a bad name";
}

struct Corruption {
  const char* field;
  std::function<void(int fd)> apply;
};

template <class T>
std::function<void(int)> writeAt(size_t offset, T value) {
  return [=](int fd) {
    ASSERT_EQ(::pwrite(fd, &value, sizeof(value), offset), (ssize_t)sizeof(value));
  };
}

TEST(Ledger, RefusesEveryCorruptedHeaderNamingTheField) {
  const std::vector<Corruption> cases = {
      {"magic", writeAt<uint64_t>(0, 0x52474C544F4EULL)},
      {"magic",
       [](int fd) {  // no magic, wrong size: not an unfinished creation
         writeAt<uint64_t>(0, 0)(fd);
         ASSERT_EQ(::ftruncate(fd, 4096), 0);
       }},
      {"version", writeAt<uint32_t>(8, 2)},
      {"version", writeAt<uint32_t>(8, 4)},
      {"version", writeAt<uint32_t>(8, 0)},
      {"header_size", writeAt<uint32_t>(12, 1024)},
      {"file_size", writeAt<uint64_t>(16, 20000)},
      {"file_size", [](int fd) { ASSERT_EQ(::ftruncate(fd, 4096), 0); }},
      {"file_size", [](int fd) { ASSERT_EQ(::ftruncate(fd, 65536), 0); }},
      {"max_devices", writeAt<uint32_t>(24, 8)},
      {"max_slots", writeAt<uint32_t>(28, 256)},
      {"tenant", [](int fd) { ASSERT_EQ(::pwrite(fd, "mallory", 8, 32), 8); }},
      {"tenant",
       [](int fd) {  // not NUL-terminated
         const std::string full(64, 'v');
         ASSERT_EQ(::pwrite(fd, full.data(), 64, 32), 64);
       }},
  };
  for (const Corruption& c : cases) {
    TempDir tmp;
    std::string path;
    {
      auto l = mustOpen(tmp.ledgers(), "victim");
      ASSERT_NE(l, nullptr);
      path = l->path();
    }
    const int fd = ::open(path.c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    c.apply(fd);
    ::close(fd);
    const std::string before = readFile(path);
    std::string err;
    EXPECT_EQ(Ledger::open(tmp.ledgers(), "victim", &err), nullptr) << c.field;
    EXPECT_NE(err.find(std::string("field '") + c.field + "'"), std::string::npos) << err;
    EXPECT_NE(err.find(path), std::string::npos) << err;
    EXPECT_EQ(readFile(path), before) << "a refused file is left as it was";
  }

  // Another tenant's ledger under this tenant's name.
  TempDir tmp;
  std::string alpha;
  {
    auto l = mustOpen(tmp.ledgers(), "alpha");
    ASSERT_NE(l, nullptr);
    alpha = l->path();
  }
  ASSERT_EQ(::rename(alpha.c_str(), (tmp.ledgers() + "/beta.ledger").c_str()), 0);
  std::string err;
  EXPECT_EQ(Ledger::open(tmp.ledgers(), "beta", &err), nullptr);
  EXPECT_NE(err.find("field 'tenant' is \"alpha\", expected \"beta\""), std::string::npos) << err;
}

TEST(Ledger, FinishesACreationWhoseCreatorDied) {
  // Full size, magic never written: the creator died holding the flock; start over.
  TempDir tmp;
  ASSERT_EQ(::mkdir(tmp.ledgers().c_str(), 0700), 0);
  const std::string path = tmp.ledgers() + "/half.ledger";
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, kLedgerFileSize), 0);
  writeAt<uint32_t>(8, 1)(fd);
  writeAt<uint64_t>(1152, 12345)(fd);  // junk where used[0][0] lives
  ::close(fd);
  auto l = mustOpen(tmp.ledgers(), "half");
  ASSERT_NE(l, nullptr);
  std::string err;
  const int dev = l->deviceIndex(kUuidA, 10, &err);
  ASSERT_GE(dev, 0) << err;
  EXPECT_EQ(l->used(dev), 0u);
  EXPECT_EQ(readFile(path).substr(0, 8), std::string("CUSHLDG\0", 8));
}

// The refusal must name the file and say it is a permission problem.
TEST(Ledger, PermissionDeniedIsExplained) {
  TempDir tmp;
  std::string path;
  {
    auto l = mustOpen(tmp.ledgers(), "private");
    ASSERT_NE(l, nullptr);
    path = l->path();
  }
  ASSERT_EQ(::chmod(tmp.path().c_str(), 0755), 0);  // the ledger directory itself stays 0700
  int pipefd[2];
  ASSERT_EQ(::pipe(pipefd), 0);
  const std::string dir = tmp.ledgers();
  const pid_t pid = spawn([&]() {
    ::close(pipefd[0]);
    if (::geteuid() == 0) {
      if (::setgid(65534) != 0 || ::setuid(65534) != 0) return 77;
    } else if (::chmod(path.c_str(), 0) != 0) {
      return 77;
    }
    std::string err;
    auto l = Ledger::open(dir, "private", &err);
    (void)!::write(pipefd[1], err.data(), err.size());
    return l == nullptr ? 0 : 1;
  });
  ::close(pipefd[1]);
  std::string err;
  char buf[512];
  for (ssize_t n; (n = ::read(pipefd[0], buf, sizeof(buf))) > 0;) err.append(buf, n);
  ::close(pipefd[0]);
  const int rc = waitExit(pid);
  if (rc == 77) GTEST_SKIP() << "cannot drop privileges here";
  EXPECT_EQ(rc, 0) << "opened a ledger it has no permission for";
  EXPECT_NE(err.find(path), std::string::npos) << err;
  EXPECT_NE(err.find("Permission denied"), std::string::npos) << err;
  EXPECT_NE(err.find("tenant's user"), std::string::npos) << err;
}

// ---------------------------------------------------------------------------------------------
// Reservations in one process

TEST(Ledger, ReservesExactlyUpToTheLimit) {
  TempDir tmp;
  auto l = mustOpen(tmp.ledgers(), "exact");
  ASSERT_NE(l, nullptr);
  std::string err;
  const int dev = l->deviceIndex(kUuidA, 10 * kMiB, &err);
  ASSERT_GE(dev, 0) << err;
  const uint64_t limit = l->limit(dev);

  EXPECT_FALSE(l->reserve(dev, limit + 1, limit)) << "larger than the limit";
  EXPECT_EQ(l->denied(dev), 1u);
  EXPECT_EQ(l->used(dev), 0u);
  EXPECT_TRUE(l->reserve(dev, limit - 1, limit));
  EXPECT_TRUE(l->reserve(dev, 1, limit));
  EXPECT_EQ(l->used(dev), limit);
  EXPECT_FALSE(l->reserve(dev, 1, limit)) << "one byte over";
  EXPECT_EQ(l->denied(dev), 2u);
  EXPECT_EQ(l->used(dev), limit) << "a refused reservation leaves nothing behind";
  EXPECT_TRUE(l->reserve(dev, 0, limit));
  l->release(dev, 1);
  EXPECT_EQ(l->used(dev), limit - 1);
  EXPECT_TRUE(l->reserve(dev, 1, limit)) << "a release makes room";
  EXPECT_EQ(l->peak(dev), limit);

  // A limit lowered live: nothing is taken back, nothing new fits until usage drops below it.
  l->setLimit(dev, 4 * kMiB);
  EXPECT_FALSE(l->reserve(dev, 1, l->limit(dev)));
  l->release(dev, limit - 3 * kMiB);
  EXPECT_EQ(l->used(dev), 3 * kMiB);
  EXPECT_TRUE(l->reserve(dev, kMiB, l->limit(dev)));
  EXPECT_FALSE(l->reserve(dev, 1, l->limit(dev)));

  // Releasing more than held is a caller bug: clamped, never wrapped.
  l->release(dev, 100 * kMiB);
  EXPECT_EQ(l->used(dev), 0u);
  EXPECT_TRUE(l->reserve(dev, 4 * kMiB, l->limit(dev)));

  // No limit: accounted, always granted.
  EXPECT_TRUE(l->reserve(dev, uint64_t{1} << 50, kLedgerNoLimit));
  EXPECT_EQ(l->used(dev), (uint64_t{1} << 50) + 4 * kMiB);
}

// The peak is what was granted within the limit: a charge forced past it (a pool that grew by
// more than was reserved, undone right after) never shows as a peak above the limit.
TEST(Ledger, PeakNeverRecordsAboveTheLimit) {
  TempDir tmp;
  auto l = mustOpen(tmp.ledgers(), "peak");
  ASSERT_NE(l, nullptr);
  std::string err;
  const int dev = l->deviceIndex(kUuidA, 10 * kMiB, &err);
  ASSERT_GE(dev, 0) << err;
  ASSERT_TRUE(l->reserve(dev, 9 * kMiB, l->limit(dev)));
  EXPECT_EQ(l->peak(dev), 9 * kMiB);
  ASSERT_TRUE(l->reserve(dev, 3 * kMiB, kLedgerNoLimit));  // forced: the driver took more
  EXPECT_EQ(l->used(dev), 12 * kMiB);
  EXPECT_EQ(l->peak(dev), 9 * kMiB) << "a forced charge past the limit raised the peak";
  l->release(dev, 3 * kMiB);  // undone
  ASSERT_TRUE(l->reserve(dev, kMiB, l->limit(dev)));
  EXPECT_EQ(l->peak(dev), 10 * kMiB) << "a grant up to the limit raises the peak";
  // With no limit at all every total is a grant.
  auto u = mustOpen(tmp.ledgers(), "unlimited");
  const int ud = u->deviceIndex(kUuidA, kLedgerNoLimit, &err);
  ASSERT_TRUE(u->reserve(ud, uint64_t{1} << 40, kLedgerNoLimit));
  EXPECT_EQ(u->peak(ud), uint64_t{1} << 40);
}

TEST(Ledger, ThreadsOfOneProcessShareItsSlotExactly) {
  TempDir tmp;
  auto l = mustOpen(tmp.ledgers(), "threads");
  ASSERT_NE(l, nullptr);
  std::string err;
  const int dev = l->deviceIndex(kUuidA, 3 * kMiB, &err);
  ASSERT_GE(dev, 0) << err;
  std::atomic<int> held{0}, maxHeld{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 6; ++t)
    threads.emplace_back([&]() {
      for (int i = 0; i < 20000; ++i) {
        if (!l->reserve(dev, kMiB, 3 * kMiB)) continue;
        atomicMax(maxHeld, held.fetch_add(1) + 1);
        held.fetch_sub(1);
        l->release(dev, kMiB);
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_LE(maxHeld.load(), 3);
  EXPECT_EQ(l->used(dev), 0u);
  EXPECT_LE(l->peak(dev), 3 * kMiB);
}

// ---------------------------------------------------------------------------------------------
// Across processes

// 8 processes each keep up to 4 chunks of 1 MiB (demand 32 MiB) on a 10 MiB limit, for 0.4 s
// (time-sliced on small machines, so reservations interleave at every instruction). Each counts
// what it holds in `held` right after a granted reservation and before releasing, so `held` is
// never above what the ledger granted: it must never exceed 10 chunks. An observer process checks
// the same while also bounding the ledger's raw sum (held + at most one in-flight intent per
// process). Half of the workers exit holding chunks (their slots are reaped).
struct RaceShared {
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::atomic<bool> stopWorkers{false};
  std::atomic<bool> stop{false};
  std::atomic<int64_t> held{0};
  std::atomic<int64_t> maxHeld{0};
  std::atomic<int64_t> violations{0};
  std::atomic<uint64_t> maxRawSum{0};
  std::atomic<uint64_t> grants{0};
  std::atomic<uint64_t> denials{0};
  std::atomic<uint64_t> observations{0};
};

TEST(Ledger, ProcessesRacingForOneQuotaNeverExceedIt) {
  constexpr int kWorkers = 8;
  constexpr auto kDuration = std::chrono::milliseconds(400);
  constexpr uint64_t kLimit = 10 * kMiB;
  constexpr int64_t kMaxChunks = kLimit / kMiB;
  TempDir tmp;
  auto l = mustOpen(tmp.ledgers(), "race");
  ASSERT_NE(l, nullptr);
  std::string err;
  const int dev = l->deviceIndex(kUuidA, kLimit, &err);
  ASSERT_GE(dev, 0) << err;
  RaceShared* sh = sharedObject<RaceShared>();
  const std::string dir = tmp.ledgers();

  std::vector<pid_t> pids;
  pids.push_back(spawn([&]() {  // the observer
    std::string e;
    auto o = Ledger::open(dir, "race", &e);
    if (!o) return 10;
    sh->ready.fetch_add(1);
    while (!sh->stop.load()) {
      const int64_t h = sh->held.load();
      const uint64_t raw = o->used(dev);
      if (h > kMaxChunks || raw > kLimit + kWorkers * kMiB) sh->violations.fetch_add(1);
      atomicMax(sh->maxRawSum, raw);
      sh->observations.fetch_add(1);
      std::this_thread::sleep_for(std::chrono::microseconds(20));  // leave the CPUs to the workers
    }
    return 0;
  }));
  for (int w = 0; w < kWorkers; ++w) {
    pids.push_back(spawn([&, w]() {
      std::string e;
      auto me = Ledger::open(dir, "race", &e);
      if (!me || me->deviceIndex(kUuidA, 1, &e) != dev) return 11;
      std::mt19937 rng(1234 + w);
      sh->ready.fetch_add(1);
      while (!sh->go.load()) cpuPause();
      int mine = 0;
      uint64_t grants = 0, denials = 0;
      while (!sh->stopWorkers.load(std::memory_order_relaxed)) {
        if (mine == 0 || (mine < 4 && rng() % 2 == 0)) {
          if (me->reserve(dev, kMiB, kLimit)) {
            const int64_t h = sh->held.fetch_add(1) + 1;
            atomicMax(sh->maxHeld, h);
            if (h > kMaxChunks) sh->violations.fetch_add(1);
            ++mine;
            ++grants;
          } else {
            ++denials;
          }
        } else {
          sh->held.fetch_sub(1);
          me->release(dev, kMiB);
          --mine;
        }
      }
      sh->grants.fetch_add(grants);
      sh->denials.fetch_add(denials);
      if (w % 2 == 1) {  // die holding: the ledger keeps the chunks until a reaper returns them
        sh->held.fetch_sub(mine);
        ::_exit(0);
      }
      for (; mine > 0; --mine) {
        sh->held.fetch_sub(1);
        me->release(dev, kMiB);
      }
      return 0;
    }));
  }
  while (sh->ready.load() < kWorkers + 1) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  sh->go.store(true);
  std::this_thread::sleep_for(kDuration);
  sh->stopWorkers.store(true);
  for (size_t i = 1; i < pids.size(); ++i) EXPECT_EQ(waitExit(pids[i]), 0) << "worker " << i;
  sh->stop.store(true);
  EXPECT_EQ(waitExit(pids[0]), 0) << "observer";

  EXPECT_EQ(sh->violations.load(), 0);
  EXPECT_LE(sh->maxHeld.load(), kMaxChunks);
  EXPECT_GE(sh->maxHeld.load(), kMaxChunks - 2) << "the quota was hardly contended";
  EXPECT_GT(sh->denials.load(), 0u);
  EXPECT_GT(sh->observations.load(), 0u);
  EXPECT_LE(l->peak(dev), kLimit);
  EXPECT_EQ(l->denied(dev), sh->denials.load()) << "every refusal counted once";
  // All gone: what the dead held comes back, nothing more (no underflow), nothing less.
  l->reapDead();
  EXPECT_EQ(l->used(dev), 0u);
  EXPECT_TRUE(l->reserve(dev, kLimit, kLimit));
  EXPECT_EQ(l->used(dev), kLimit);
  l->release(dev, kLimit);
  EXPECT_EQ(l->processes(dev).size(), 1u);
  freeShared(sh);
}

// Workers churn reservations of random sizes; the test kills one at a random instant, starts a
// replacement, 100 times (about a second), then kills the rest. Afterwards the full limit must be
// reservable and, once released, the ledger must read exactly zero.
struct ChurnShared {
  std::atomic<uint64_t> ops{0};
  std::atomic<int> started{0};
};

TEST(Ledger, KillNineAtRandomInstantsLeaksNothing) {
  constexpr int kWorkers = 8;
  constexpr int kKills = 100;
  constexpr uint64_t kLimit = 16 * kMiB;
  TempDir tmp;
  auto l = mustOpen(tmp.ledgers(), "churn");
  ASSERT_NE(l, nullptr);
  std::string err;
  const int dev = l->deviceIndex(kUuidA, kLimit, &err);
  ASSERT_GE(dev, 0) << err;
  ChurnShared* sh = sharedObject<ChurnShared>();
  const std::string dir = tmp.ledgers();

  auto worker = [&]() {
    return spawn([&]() {
      std::string e;
      auto me = Ledger::open(dir, "churn", &e);
      if (!me) return 10;
      const int d = me->deviceIndex(kUuidA, 1, &e);
      sh->started.fetch_add(1);
      std::mt19937 rng(static_cast<unsigned>(::getpid()));
      uint64_t held[8];
      int n = 0;
      for (;;) {
        if (n == 0 || (n < 8 && rng() % 2 == 0)) {
          const uint64_t b = (1 + rng() % 32) * 64 * 1024;
          if (me->reserve(d, b, kLimit)) held[n++] = b;
        } else {
          me->release(d, held[--n]);
        }
        sh->ops.fetch_add(1, std::memory_order_relaxed);
      }
    });
  };
  std::vector<pid_t> pids;
  for (int w = 0; w < kWorkers; ++w) pids.push_back(worker());
  std::mt19937 rng(20240601);
  const auto start = std::chrono::steady_clock::now();
  int kills = 0, killedWhileHolding = 0;
  // 100 kills take about a second; the deadline only bounds a slow (sanitizer, loaded) run.
  const auto deadline = start + std::chrono::seconds(4);
  for (; kills < kKills && std::chrono::steady_clock::now() < deadline; ++kills) {
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 8000));
    const size_t victim = rng() % pids.size();
    ASSERT_EQ(::kill(pids[victim], SIGKILL), 0);
    EXPECT_EQ(waitExit(pids[victim]), 128 + SIGKILL);
    killedWhileHolding += l->used(dev) > 0;
    pids[victim] = worker();
  }
  for (pid_t p : pids) ::kill(p, SIGKILL);
  for (pid_t p : pids) EXPECT_EQ(waitExit(p), 128 + SIGKILL);
  EXPECT_GE(kills, 20);
  EXPECT_GT(sh->started.load(), kills / 2) << "most workers were killed after they started";
  EXPECT_GT(sh->ops.load(), 10000u);
  EXPECT_GT(killedWhileHolding, kills / 2) << "the kills hardly ever hit a holder";

  // Everything the dead held is still in their slots; a full-limit reservation reaps it.
  EXPECT_LE(l->peak(dev), kLimit);
  EXPECT_TRUE(l->reserve(dev, kLimit, kLimit)) << "leaked: " << l->used(dev);
  EXPECT_EQ(l->used(dev), kLimit);
  l->release(dev, kLimit);
  EXPECT_EQ(l->used(dev), 0u);
  EXPECT_EQ(l->reapDead(), 0);
  const auto procs = l->processes(dev);
  ASSERT_EQ(procs.size(), 1u);
  EXPECT_EQ(procs[0].pid, ::getpid());
  freeShared(sh);
}

TEST(Ledger, ClaimingADeadSlotReturnsItsLeftovers) {
  TempDir tmp;
  const std::string dir = tmp.ledgers();
  const pid_t pid = spawn([&]() {
    std::string e;
    auto l = Ledger::open(dir, "leftovers", &e);
    const int dev = l ? l->deviceIndex(kUuidA, 100 * kMiB, &e) : -1;
    if (dev < 0 || !l->reserve(dev, 5 * kMiB, 100 * kMiB) || l->slot() != 0) return 1;
    ::_exit(0);  // dies holding 5 MiB in slot 0
  });
  ASSERT_EQ(waitExit(pid), 0);
  auto l = mustOpen(dir, "leftovers");  // takes the lowest free slot: the dead one
  ASSERT_NE(l, nullptr);
  EXPECT_EQ(l->slot(), 0);
  std::string err;
  const int dev = l->deviceIndex(kUuidA, 1, &err);
  EXPECT_EQ(l->used(dev), 0u);
  EXPECT_EQ(l->reapDead(), 0);
  EXPECT_TRUE(l->reserve(dev, 100 * kMiB, 100 * kMiB));
}

// Standalone sessions (LedgerOpenOptions::renewLimits): the environment's limit of the tenant's
// first live process sets the device's limit; while a process of the tenant lives, a later one
// cannot change it; once all have exited (or were killed), the next one sets it again.
std::unique_ptr<Ledger> openSession(const std::string& dir, const std::string& tenant) {
  LedgerOpenOptions o;
  o.renewLimits = true;
  std::string err;
  auto l = Ledger::open(dir, tenant, o, &err);
  EXPECT_NE(l, nullptr) << err;
  return l;
}

uint64_t sessionLimit(Ledger& l, uint64_t wanted) {
  std::string err;
  const int dev = l.sessionDeviceIndex(kUuidA, wanted, &err);
  EXPECT_GE(dev, 0) << err;
  return dev >= 0 ? l.limit(dev) : 0;
}

TEST(LedgerSession, TheNextSessionsLimitAppliesOnlyOnceAllProcessesExited) {
  TempDir tmp;
  auto a = openSession(tmp.ledgers(), "sess");
  EXPECT_EQ(sessionLimit(*a, 10 * kMiB), 10 * kMiB);
  {
    auto b = openSession(tmp.ledgers(), "sess");  // a lives: same session
    EXPECT_EQ(sessionLimit(*b, 20 * kMiB), 10 * kMiB) << "a higher limit took over while a process lives";
    EXPECT_EQ(sessionLimit(*b, 5 * kMiB), 10 * kMiB) << "a lower one applies to its process only";
  }
  a.reset();  // every process has exited
  auto c = openSession(tmp.ledgers(), "sess");
  EXPECT_EQ(sessionLimit(*c, 20 * kMiB), 20 * kMiB) << "the limit of the tenant's previous session stuck";
  c.reset();
  auto d = openSession(tmp.ledgers(), "sess");
  EXPECT_EQ(sessionLimit(*d, kLedgerNoLimit), kLedgerNoLimit);
  // A process killed with -9 ends its session too.
  d.reset();
  const std::string dir = tmp.ledgers();
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t pid = spawn([&]() {
    auto k = openSession(dir, "sess");
    if (sessionLimit(*k, 7 * kMiB) != 7 * kMiB || !k->reserve(0, kMiB, 7 * kMiB)) return 1;
    (void)!::write(ready[1], "r", 1);
    ::pause();
    return 0;
  });
  char c1 = 0;
  ASSERT_EQ(::read(ready[0], &c1, 1), 1);
  auto e = openSession(dir, "sess");
  EXPECT_EQ(sessionLimit(*e, 30 * kMiB), 7 * kMiB) << "the killed process is still alive here";
  e.reset();
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
  auto f = openSession(dir, "sess");
  EXPECT_EQ(sessionLimit(*f, 30 * kMiB), 30 * kMiB) << "a killed process's session did not end";
  EXPECT_EQ(f->used(0), 0u) << "the killed process's usage was not reaped";
  ::close(ready[0]);
  ::close(ready[1]);
}

// Processes that start at the same instant, each asking for its own limit, after a session with
// another limit: exactly one of them sets the new session's limit and all of them see it.
TEST(LedgerSession, ConcurrentStartsAgreeOnOneNewLimit) {
  TempDir tmp;
  const std::string dir = tmp.ledgers();
  openSession(dir, "race")->sessionDeviceIndex(kUuidA, 999 * kMiB, nullptr);  // a previous session
  constexpr int kProcs = 8;
  struct Seen {
    std::atomic<int> go{0};
    std::atomic<int> resolved{0};
    std::atomic<uint64_t> limit[kProcs];
  };
  Seen* sh = sharedObject<Seen>();
  std::vector<pid_t> pids;
  for (int i = 0; i < kProcs; ++i)
    pids.push_back(spawn([&, i]() {
      while (sh->go.load() == 0) std::this_thread::yield();
      auto l = openSession(dir, "race");
      if (!l) return 1;
      sh->limit[i].store(sessionLimit(*l, (i + 1) * kMiB));
      sh->resolved.fetch_add(1);
      while (sh->resolved.load() < kProcs) std::this_thread::yield();  // all alive till all resolved
      return 0;
    }));
  sh->go.store(1);
  for (pid_t p : pids) EXPECT_EQ(waitExit(p), 0);
  const uint64_t first = sh->limit[0].load();
  EXPECT_GE(first, kMiB);
  EXPECT_LE(first, kProcs * kMiB) << "the previous session's limit stuck, or a pending limit was read";
  for (int i = 0; i < kProcs; ++i) EXPECT_EQ(sh->limit[i].load(), first) << "process " << i;
  freeShared(sh);
}

struct ForkShared {
  std::atomic<int> childSlotBefore{-2};
  std::atomic<int> childSlot{-2};
  std::atomic<uint64_t> usedAfterStrayRelease{0};
  std::atomic<uint64_t> usedSeen{0};
  std::atomic<int> procsSeen{0};
};

TEST(Ledger, ForkedChildGetsItsOwnSlot) {
  TempDir tmp;
  auto l = mustOpen(tmp.ledgers(), "forky");
  ASSERT_NE(l, nullptr);
  std::string err;
  const int dev = l->deviceIndex(kUuidA, 100 * kMiB, &err);
  ASSERT_GE(dev, 0) << err;
  ASSERT_TRUE(l->reserve(dev, kMiB, 100 * kMiB));
  const int parentSlot = l->slot();
  ForkShared* sh = sharedObject<ForkShared>();
  const pid_t pid = spawn([&]() {
    sh->childSlotBefore.store(l->slot());
    l->release(dev, kMiB);  // the parent's memory: not the child's to release
    sh->usedAfterStrayRelease.store(l->used(dev));
    if (!l->reserve(dev, 2 * kMiB, 100 * kMiB)) return 1;
    sh->childSlot.store(l->slot());
    sh->usedSeen.store(l->used(dev));
    sh->procsSeen.store(static_cast<int>(l->processes(dev).size()));
    ::_exit(0);  // dies holding 2 MiB
  });
  ASSERT_EQ(waitExit(pid), 0);
  EXPECT_EQ(sh->childSlotBefore.load(), -1);
  EXPECT_EQ(sh->usedAfterStrayRelease.load(), kMiB);
  EXPECT_GE(sh->childSlot.load(), 0);
  EXPECT_NE(sh->childSlot.load(), parentSlot);
  EXPECT_EQ(sh->usedSeen.load(), 3 * kMiB);
  EXPECT_EQ(sh->procsSeen.load(), 2);
  EXPECT_EQ(l->slot(), parentSlot) << "the parent keeps its slot";
  EXPECT_EQ(l->used(dev), 3 * kMiB);
  EXPECT_EQ(l->reapDead(), 1);
  EXPECT_EQ(l->used(dev), kMiB) << "the child's 2 MiB came back, the parent's 1 MiB stayed";
  freeShared(sh);
}

// The kernel names a slot's holder (its POSIX pid lock), whatever the slot's pid field says: a
// process that writes another pid there is still the one named, and a dead one is named no more.
TEST(Ledger, SlotHolderIsTheKernelsWordNotThePidField) {
  TempDir tmp;
  const std::string dir = tmp.ledgers();
  auto l = mustOpen(dir, "holders");
  ASSERT_NE(l, nullptr);
  int report[2], hold[2];
  ASSERT_EQ(::pipe(report), 0);
  ASSERT_EQ(::pipe(hold), 0);
  const pid_t child = spawn([&]() {
    // The raw descriptor stays open: closing any descriptor of the file drops a process's POSIX
    // locks (the holder would only read as unknown then).
    const int raw = ::open((dir + "/holders.ledger").c_str(), O_RDWR);
    std::string e;
    auto c = Ledger::open(dir, "holders", &e);
    if (raw < 0 || !c) return 11;
    const int32_t again = c->slot(), fake = 1;  // init's pid, written raw into its own slot
    if (::pwrite(raw, &fake, 4, kLedgerPidOffset + 4 * again) != 4) return 12;
    (void)!::write(report[1], &again, sizeof again);
    ::close(hold[1]);
    char b;
    while (::read(hold[0], &b, 1) > 0) {
    }
    return 0;
  });
  ::close(hold[0]);
  int32_t slot = -1;
  ASSERT_EQ(::read(report[0], &slot, sizeof slot), static_cast<ssize_t>(sizeof slot));
  bool found = false;
  for (const Ledger::SlotUsage& u : l->slots()) {
    if (u.slot != slot) continue;
    found = true;
    EXPECT_EQ(u.pid, 1) << "the field says what the process wrote";
  }
  EXPECT_TRUE(found);
  EXPECT_EQ(l->slotHolderPid(slot), child) << "the kernel says who holds the slot";
  EXPECT_EQ(l->slotHolderPid(static_cast<int>(kLedgerMaxSlots) - 1), 0) << "a free slot";
  ::close(hold[1]);
  ASSERT_EQ(waitExit(child), 0);
  EXPECT_EQ(l->slotHolderPid(slot), 0) << "a dead process holds nothing";
}

// A parent dies while its forked child (which never used the ledger) lives on: the child must not
// keep the parent's slot locked through the inherited open file description.
TEST(Ledger, DeadParentIsReapedWhileItsForkedChildLives) {
  TempDir tmp;
  const std::string dir = tmp.ledgers();
  auto l = mustOpen(dir, "orphans");  // first, so that the dead parent's slot is not claimed anew
  ASSERT_NE(l, nullptr);
  std::string err;
  const int dev = l->deviceIndex(kUuidA, 100 * kMiB, &err);
  ASSERT_GE(dev, 0) << err;
  ASSERT_EQ(::prctl(PR_SET_CHILD_SUBREAPER, 1), 0);  // the orphaned grandchild becomes ours
  int hold[2], grandchild[2];
  ASSERT_EQ(::pipe(hold), 0);
  ASSERT_EQ(::pipe(grandchild), 0);
  const pid_t parent = spawn([&]() {
    std::string e;
    auto p = Ledger::open(dir, "orphans", &e);
    if (!p || p->deviceIndex(kUuidA, 1, &e) != dev || !p->reserve(dev, 4 * kMiB, 100 * kMiB))
      return 11;
    if (::fork() == 0) {
      // Past fork, so the atfork handlers have run: tell the test, then block until it closes the
      // pipe. (Until its handler ran, a child does share its parent's description: that window
      // is inherent to fork.)
      const pid_t self = ::getpid();
      (void)!::write(grandchild[1], &self, sizeof(self));
      ::close(hold[1]);
      char c;
      while (::read(hold[0], &c, 1) > 0) {
      }
      ::_exit(0);
    }
    ::_exit(0);  // dies holding 4 MiB
  });
  ::close(hold[0]);
  ::close(grandchild[1]);
  pid_t child = 0;
  // However the test ends, the grandchild sees EOF and exits; as the subreaper, the test reaps it.
  struct Cleanup {
    int fd;
    const pid_t* child;
    ~Cleanup() {
      ::close(fd);
      if (*child > 0) waitExit(*child);
      ::prctl(PR_SET_CHILD_SUBREAPER, 0);
    }
  } cleanup{hold[1], &child};
  ASSERT_EQ(waitExit(parent), 0);
  ASSERT_EQ(::read(grandchild[0], &child, sizeof(child)), (ssize_t)sizeof(child));
  ::close(grandchild[0]);
  ASSERT_EQ(::kill(child, 0), 0) << "the forked child is alive";

  EXPECT_EQ(l->used(dev), 4 * kMiB);
  EXPECT_EQ(l->reapDead(), 1);
  EXPECT_EQ(l->used(dev), 0u);
}

// Observers (the broker) open ledgers a tenant's processes can truncate at any moment: open() must
// create and initialise a file without a store through the mapping (this process has no SIGBUS
// handler: a fault kills the test).
TEST(Ledger, OpenNeverStoresThroughTheMappingOfAFileBeingTruncated) {
  TempDir tmp;
  const std::string dir = tmp.ledgers(), path = dir + "/trunc.ledger";
  ASSERT_TRUE(mustOpen(dir, "trunc"));
  std::atomic<bool> stop{false};
  std::thread attacker([&] {
    while (!stop.load()) (void)!::truncate(path.c_str(), 0);
  });
  LedgerOpenOptions o;
  o.createDir = false;
  o.claimSlot = false;
  int opened = 0;
  for (int i = 0; i < 2000; ++i) {
    std::string err;
    opened += Ledger::open(dir, "trunc", o, &err) != nullptr;  // refused when truncated midway
  }
  stop.store(true);
  attacker.join();
  EXPECT_GT(opened, 0);
}

// A process holding a ledger's flock forever cannot make an observer wait: it fails at once and
// says the lock was busy (the broker then waits once per tick, outside its own lock).
TEST(Ledger, ObserverNeverWaitsForTheFlock) {
  TempDir tmp;
  const std::string dir = tmp.ledgers();
  ASSERT_TRUE(mustOpen(dir, "locked"));
  const int fd = ::open((dir + "/locked.ledger").c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX), 0);
  LedgerOpenOptions o;
  o.createDir = false;
  o.claimSlot = false;
  bool busy = false;
  o.busy = &busy;
  std::string err;
  // A wait for the lock (blocking, or a bounded one of 100 ms) would show in every try; one
  // preemption on a loaded host shows in one: the fastest of five is judged.
  auto fastest = std::chrono::steady_clock::duration::max();
  for (int i = 0; i < 5; ++i) {
    busy = false;
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_EQ(Ledger::open(dir, "locked", o, &err), nullptr);
    fastest = std::min(fastest, std::chrono::steady_clock::now() - t0);
    EXPECT_TRUE(busy) << err;
  }
  EXPECT_LT(fastest, std::chrono::milliseconds(20));
  ::flock(fd, LOCK_UN);
  busy = false;
  auto observer = Ledger::open(dir, "locked", o, &err);
  ASSERT_TRUE(observer) << err;
  EXPECT_FALSE(busy);
  // Adding a device entry needs the flock too.
  ASSERT_EQ(::flock(fd, LOCK_EX), 0);
  EXPECT_EQ(observer->deviceIndex(kUuidB, 1, &err, &busy), -1);
  EXPECT_TRUE(busy);
  ::close(fd);
  busy = false;
  EXPECT_GE(observer->deviceIndex(kUuidB, 1, &err, &busy), 0) << err;
  EXPECT_FALSE(busy);
}

// A live process that closes its ledger descriptor lets go of its slot's lock. Neither a reaper
// nor a new process may take that for death: its usage stays until it exits.
TEST(Ledger, LiveProcessThatClosedItsDescriptorKeepsItsSlot) {
  TempDir tmp;
  const std::string dir = tmp.ledgers(), path = dir + "/closer.ledger";
  auto l = mustOpen(dir, "closer");
  ASSERT_NE(l, nullptr);
  std::string err;
  const int dev = l->deviceIndex(kUuidA, 100 * kMiB, &err);
  int ready[2], hold[2];
  ASSERT_EQ(::pipe(ready), 0);
  ASSERT_EQ(::pipe(hold), 0);
  const pid_t pid = spawn([&]() {
    ::close(hold[1]);  // so that the parent's close is an end of file here
    std::string e;
    auto mine = Ledger::open(dir, "closer", &e);
    if (!mine || !mine->reserve(dev, 60 * kMiB, 100 * kMiB)) return 1;
    // Every descriptor of the ledger file goes (the slot's lock with it); the mapping stays.
    const std::string want = std::filesystem::canonical(path).string();
    for (const auto& fdEntry : std::filesystem::directory_iterator("/proc/self/fd")) {
      std::error_code ec;
      if (std::filesystem::read_symlink(fdEntry.path(), ec).string() == want)
        ::close(std::stoi(fdEntry.path().filename().string()));
    }
    char c = 'x';
    (void)!::write(ready[1], &c, 1);
    (void)!::read(hold[0], &c, 1);
    ::_exit(0);
  });
  char c;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  std::vector<int32_t> kept;
  EXPECT_EQ(l->reapDead(nullptr, &kept), 0);
  EXPECT_EQ(kept, std::vector<int32_t>{pid});
  EXPECT_EQ(l->used(dev), 60 * kMiB);
  EXPECT_FALSE(l->reserve(dev, 50 * kMiB, 100 * kMiB)) << "the live process's 60 MiB still count";
  auto newcomer = mustOpen(dir, "closer");
  ASSERT_NE(newcomer, nullptr);
  EXPECT_EQ(l->used(dev), 60 * kMiB) << "a new process does not claim the live process's slot";
  ::close(hold[1]);
  ASSERT_EQ(waitExit(pid), 0);
  EXPECT_EQ(l->reapDead(), 1);
  EXPECT_EQ(l->used(dev), 0u);
  for (int fd : {ready[0], ready[1], hold[0]}) ::close(fd);
}

// An observer's charge (memory the device holds for the tenant that its ledger does not show) is
// part of every reservation's sum, survives a tenant lowering slot_hwm when re-asserted, and is
// never reaped while the observer lives.
TEST(Ledger, ObserverChargeCountsInEveryReservation) {
  TempDir tmp;
  const std::string dir = tmp.ledgers();
  auto tenant = mustOpen(dir, "charged");
  ASSERT_NE(tenant, nullptr);
  std::string err;
  const int dev = tenant->deviceIndex(kUuidA, 100 * kMiB, &err);
  LedgerOpenOptions o;
  o.createDir = false;
  o.claimSlot = false;
  auto observer = Ledger::open(dir, "charged", o, &err);
  ASSERT_TRUE(observer) << err;
  EXPECT_EQ(observer->chargeSlot(), -1);
  ASSERT_TRUE(observer->setCharge(dev, 70 * kMiB));
  EXPECT_GE(observer->chargeSlot(), 0);
  EXPECT_EQ(observer->charge(dev), 70 * kMiB);
  // The one process is the tenant's: the charge slot is not a process, not even in the tenant's
  // own lists.
  ASSERT_EQ(observer->slots().size(), 1u);
  EXPECT_EQ(observer->slots()[0].pid, static_cast<int>(::getpid()));
  ASSERT_EQ(tenant->processes(dev).size(), 1u);
  EXPECT_EQ(tenant->processes(dev)[0].bytes, 0u);
  EXPECT_EQ(tenant->used(dev), 70 * kMiB);
  EXPECT_FALSE(tenant->reserve(dev, 40 * kMiB, 100 * kMiB));
  EXPECT_TRUE(tenant->reserve(dev, 30 * kMiB, 100 * kMiB));
  EXPECT_EQ(tenant->reapDead(), 0) << "the observer's slot is held";
  // The tenant hides the charge by lowering slot_hwm; re-asserting raises it again.
  const int fd = ::open((dir + "/charged.ledger").c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  writeAt<uint32_t>(offsetof(LedgerHeader, slot_hwm), 0)(fd);
  ::close(fd);
  EXPECT_EQ(tenant->used(dev), 0u) << "hidden";
  ASSERT_TRUE(observer->setCharge(dev, 70 * kMiB));
  EXPECT_EQ(tenant->used(dev), 100 * kMiB);
}

}  // namespace
}  // namespace cushare
