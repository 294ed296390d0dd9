// The host segment (common/host_segment.h) and the broker's state file (broker/core/overrides.h):
// round trips, and refusal of every damaged field with a message naming it.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <fstream>

#include "core/overrides.h"
#include "cushare/host_segment.h"
#include "cushare/ledger.h"

namespace cushare {
namespace {

std::string freshDir(const std::string& name) {
  const char* root = std::getenv("SIMGPU_STATE_DIR");
  const std::string dir = std::string(root ? root : "/tmp") + "/host-segment-" + name;
  std::system(("rm -rf '" + dir + "' && mkdir -p '" + dir + "'").c_str());
  return dir;
}

HostInfo sample() {
  HostInfo h;
  h.brokerPid = 1234;
  h.configGeneration = 7;
  h.profileForUnknown = true;
  h.unknownProfile = "balanced";
  h.metering = kHostMeteringCupti;
  h.cuptiLibrary = "/usr/local/cuda/extras/CUPTI/lib64/libcupti.so.13";
  HostDevice d;
  for (int i = 0; i < 16; ++i) d.uuid[i] = static_cast<uint8_t>(i);
  d.capacity = 80ull << 30;
  d.unknownLimit = 20ull << 30;
  h.devices.push_back(d);
  return h;
}

TEST(HostSegment, RoundTrip) {
  const std::string dir = freshDir("roundtrip");
  HostInfo got;
  std::string err;
  EXPECT_EQ(readHostSegment(dir, &got, &err), 0) << "absent: no broker";
  ASSERT_TRUE(writeHostSegment(dir, sample(), &err)) << err;
  ASSERT_EQ(readHostSegment(dir, &got, &err), 1) << err;
  EXPECT_EQ(got.brokerPid, 1234u);
  EXPECT_EQ(got.configGeneration, 7u);
  EXPECT_TRUE(got.profileForUnknown);
  EXPECT_EQ(got.unknownProfile, "balanced");
  EXPECT_EQ(got.metering, kHostMeteringCupti);
  EXPECT_EQ(got.cuptiLibrary, "/usr/local/cuda/extras/CUPTI/lib64/libcupti.so.13");
  ASSERT_EQ(got.devices.size(), 1u);
  EXPECT_EQ(got.devices[0].unknownLimit, 20ull << 30);
  ASSERT_NE(got.device(sample().devices[0].uuid), nullptr);
  struct stat st;
  ASSERT_EQ(::stat((dir + "/host.segment").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0644u);
  EXPECT_EQ(st.st_size, static_cast<off_t>(sizeof(HostSegmentLayout)));
}

TEST(HostSegment, EveryDamagedFieldIsRefusedByName) {
  const std::string dir = freshDir("damaged");
  std::string err;
  ASSERT_TRUE(writeHostSegment(dir, sample(), &err));
  const std::string path = dir + "/host.segment";
  HostSegmentLayout good;
  {
    std::ifstream in(path, std::ios::binary);
    in.read(reinterpret_cast<char*>(&good), sizeof good);
  }
  struct Case {
    const char* field;
    void (*damage)(HostSegmentLayout*);
  };
  const Case cases[] = {
      {"magic", [](HostSegmentLayout* h) { h->magic ^= 1; }},
      {"version", [](HostSegmentLayout* h) { h->version = 1; }},
      {"header_size", [](HostSegmentLayout* h) { h->header_size = 16; }},
      {"file_size", [](HostSegmentLayout* h) { h->file_size = 1; }},
      {"device_count", [](HostSegmentLayout* h) { h->device_count = 17; }},
      {"unknown_policy", [](HostSegmentLayout* h) { h->unknown_policy = 9; }},
      {"unknown_profile", [](HostSegmentLayout* h) { std::memset(h->unknown_profile, 'x', 64); }},
      {"unknown_profile", [](HostSegmentLayout* h) { std::strcpy(h->unknown_profile, "a/b"); }},
      {"metering", [](HostSegmentLayout* h) { h->metering = 3; }},
      {"cupti_library", [](HostSegmentLayout* h) { std::memset(h->cupti_library, 'x', kHostCuptiPathBytes); }},
      {"cupti_library", [](HostSegmentLayout* h) { std::strcpy(h->cupti_library, "libcupti.so.13"); }},
  };
  for (const Case& c : cases) {
    HostSegmentLayout bad = good;
    c.damage(&bad);
    std::ofstream(path, std::ios::binary | std::ios::trunc).write(reinterpret_cast<char*>(&bad), sizeof bad);
    HostInfo got;
    EXPECT_EQ(readHostSegment(dir, &got, &err), -1) << c.field;
    EXPECT_NE(err.find(std::string("field '") + c.field + "'"), std::string::npos) << err;
  }
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(reinterpret_cast<char*>(&good), 100);
  HostInfo got;
  EXPECT_EQ(readHostSegment(dir, &got, &err), -1) << "truncated";
  EXPECT_NE(err.find("file_size"), std::string::npos) << err;
}

// Only the directory's owner (the broker) may speak for the host: a segment planted by anyone else,
// or one others could rewrite, is refused.
TEST(HostSegment, RefusedUnlessOwnedByTheDirectorysOwner) {
  const std::string dir = freshDir("owner");
  std::string err;
  ASSERT_TRUE(writeHostSegment(dir, sample(), &err)) << err;
  const std::string path = dir + "/host.segment";
  HostInfo got;
  ASSERT_EQ(::chmod(path.c_str(), 0666), 0);
  EXPECT_EQ(readHostSegment(dir, &got, &err), -1);
  EXPECT_NE(err.find("writable by others"), std::string::npos) << err;
  ASSERT_EQ(::chmod(path.c_str(), 0644), 0);
  if (::geteuid() == 0) {
    ASSERT_EQ(::chown(path.c_str(), 1000, 1000), 0);
    EXPECT_EQ(readHostSegment(dir, &got, &err), -1);
    EXPECT_NE(err.find("belongs to uid 1000"), std::string::npos) << err;
  }
}

TEST(BrokerState, RoundTripAndDamage) {
  const std::string dir = freshDir("overrides");
  const std::string path = dir + "/state";
  broker::BrokerState o, got;
  std::string err;
  ASSERT_TRUE(broker::loadState(path, &got, &err)) << "missing: empty";
  EXPECT_TRUE(got.limits.empty());
  o.ledgerDir = "/dev/shm/cushare with space";
  o.limits["alpha"]["GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"] = 123456789;
  o.last["beta"]["GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"] = UINT64_MAX;
  o.last["beta"]["GPU-00010203-0405-0607-0809-0a0b0c0d0e10"] = 42;
  o.files.push_back({"beta", "beta.ledger.removed", 7, 99});
  ASSERT_TRUE(broker::saveState(path, o, &err)) << err;
  ASSERT_TRUE(broker::loadState(path, &got, &err)) << err;
  EXPECT_EQ(got, o);
  std::ofstream(path, std::ios::trunc) << "cushare-broker-state 1\nlimit alpha GPU-000102030405060708090A0B0C0D0E0F 7\n";
  ASSERT_TRUE(broker::loadState(path, &got, &err)) << err;
  EXPECT_EQ(got.limits["alpha"].count("GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"), 1u) << "normalised spelling";
  EXPECT_EQ(got.ledgerDir, "") << "a file of an earlier version";
  const std::pair<std::string, std::string> bad[] = {
      {"garbage\n", ":1: expected the header"},
      {"cushare-broker-state 1\nlimit alpha GPU-zz 5\n", ":2: 'GPU-zz' is not a GPU or MIG device UUID"},
      {"cushare-broker-state 1\nlimit a/b GPU-00010203-0405-0607-0809-0a0b0c0d0e0f 5\n", ":2: tenant name"},
      {"cushare-broker-state 1\nlimit alpha GPU-00010203-0405-0607-0809-0a0b0c0d0e0f -5\n", ":2: bytes"},
      {"cushare-broker-state 1\nlimit alpha GPU-00010203-0405-0607-0809-0a0b0c0d0e0f 5 6\n", ":2: expected 'limit"},
      {"cushare-broker-state 1\nlast alpha GPU-00010203-0405-0607-0809-0a0b0c0d0e0f lots\n", ":2: bytes"},
      {"cushare-broker-state 1\nfile alpha ../beta.ledger 1 2\n", ":2: '../beta.ledger' is not a ledger of tenant alpha"},
      {"cushare-broker-state 1\nfile alpha alpha.ledger.removed 1\n", ":2: expected 'file"},
      {"", ":0: empty file"},
  };
  for (const auto& [text, want] : bad) {
    std::ofstream(path, std::ios::trunc) << text;
    EXPECT_FALSE(broker::loadState(path, &got, &err)) << text;
    EXPECT_NE(err.find(want), std::string::npos) << err;
  }
}

// A state file someone else could have written is refused: it would set a tenant's limits.
TEST(BrokerState, OnlyTheBrokersOwnFile) {
  const std::string dir = freshDir("state-owner");
  const std::string path = dir + "/state";
  broker::BrokerState s;
  std::string err;
  ASSERT_TRUE(broker::saveState(path, s, &err)) << err;
  ASSERT_EQ(::chmod(path.c_str(), 0666), 0);
  EXPECT_FALSE(broker::loadState(path, &s, &err));
  EXPECT_NE(err.find("writable by other users (mode 0666)"), std::string::npos) << err;
  ASSERT_EQ(::chmod(path.c_str(), 0600), 0);
  ASSERT_EQ(::symlink(path.c_str(), (dir + "/link").c_str()), 0);
  EXPECT_FALSE(broker::loadState(dir + "/link", &s, &err)) << "never followed";
  if (::geteuid() == 0) {
    ASSERT_EQ(::chown(path.c_str(), 1000, 1000), 0);
    EXPECT_FALSE(broker::loadState(path, &s, &err));
    EXPECT_NE(err.find("belongs to uid 1000"), std::string::npos) << err;
  }
}

// The broker's view of a ledger: no slot, never reserves, sees what the tenant's processes hold.
TEST(LedgerObserver, SeesWithoutTakingASlot) {
  const std::string dir = freshDir("observer");
  std::string err;
  LedgerOpenOptions o;
  o.claimSlot = false;
  o.mode = 0640;
  auto observer = Ledger::open(dir, "t", o, &err);
  ASSERT_TRUE(observer) << err;
  struct stat st;
  ASSERT_EQ(::stat((dir + "/t.ledger").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0640u);
  EXPECT_EQ(observer->slot(), -1);
  const uint8_t uuid[16] = {1};
  const int dev = observer->deviceIndex(uuid, 1000, &err);
  ASSERT_GE(dev, 0) << err;
  EXPECT_FALSE(observer->reserve(dev, 10, 1000)) << "an observer never reserves";
  auto tenant = Ledger::open(dir, "t", &err);
  ASSERT_TRUE(tenant) << err;
  EXPECT_EQ(tenant->slot(), 0) << "the observer took no slot";
  EXPECT_EQ(tenant->findDevice(uuid), dev);
  ASSERT_TRUE(tenant->reserve(dev, 600, tenant->limit(dev)));
  EXPECT_EQ(observer->used(dev), 600u);
  const auto slots = observer->slots();
  ASSERT_EQ(slots.size(), 1u);
  EXPECT_EQ(slots[0].pid, static_cast<int>(::getpid()));
  EXPECT_EQ(slots[0].used[dev], 600u);
  observer->setLimit(dev, 500);
  EXPECT_FALSE(tenant->reserve(dev, 1, tenant->limit(dev))) << "a live limit below use denies";
  LedgerOpenOptions none;
  none.createFile = false;
  none.claimSlot = false;
  EXPECT_FALSE(Ledger::open(dir, "missing", none, &err));
  EXPECT_NE(err.find("No such file"), std::string::npos) << err;
}

}  // namespace
}  // namespace cushare
