// A ledger's limits file (cushare/limits_file.h): what the broker publishes is what a shim reads,
// a restarted broker keeps its own file, and a shim refuses every file it must not trust.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "cushare/limits_file.h"

namespace cushare {
namespace {

const uint8_t kUuidA[16] = {0xa0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
const uint8_t kUuidB[16] = {0xb0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

struct Dir {
  std::string path;
  Dir() {
    char tmpl[] = "/tmp/cushare-limits-XXXXXX";
    path = ::mkdtemp(tmpl);
  }
  ~Dir() { std::filesystem::remove_all(path); }
  std::string limits() const { return path + "/" + kLimitsDirName; }
};

int shimOpen(const Dir& d, uint64_t ino, const std::string& tenant, std::unique_ptr<LimitsFile>* out,
             std::string* err, uint32_t uid = ::geteuid()) {
  return LimitsFile::openForShim(d.path, ino, tenant, uid, out, err);
}

TEST(LimitsFile, WhatTheBrokerPublishesIsWhatAShimReads) {
  Dir d;
  std::string err;
  ASSERT_TRUE(prepareLimitsDir(d.path, &err)) << err;
  struct stat st;
  ASSERT_EQ(::stat(d.limits().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0711u);
  auto broker = LimitsFile::openForBroker(d.path, 1234, "alpha", &err);
  ASSERT_TRUE(broker) << err;
  ASSERT_EQ(::stat(broker->path().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0644u);
  std::unique_ptr<LimitsFile> shim;
  ASSERT_EQ(shimOpen(d, 1234, "alpha", &shim, &err), 1) << err;
  EXPECT_EQ(shim->find(kUuidA), -1) << "nothing published yet";
  broker->publish(2, kUuidA, 100);
  EXPECT_EQ(shim->find(kUuidA), 2);
  EXPECT_EQ(shim->limit(2), 100u);
  EXPECT_EQ(shim->limitWord(2)->load(), 100u);
  broker->setLimit(2, 50);
  EXPECT_EQ(shim->limit(2), 50u) << "a live change reaches the mapped file";
  broker->publish(2, kUuidB, 70);
  EXPECT_EQ(shim->find(kUuidA), 2) << "a published entry keeps its UUID";
  EXPECT_EQ(shim->find(kUuidB), -1);
  EXPECT_EQ(shim->limit(2), 50u) << "and its limit, asked for another device";
  broker->publish(2, kUuidA, 70);
  EXPECT_EQ(shim->limit(2), 70u);
  shim->setLimit(2, 1ull << 40);  // a reader's write is ignored (and its mapping is read-only)
  EXPECT_EQ(broker->limit(2), 70u);
}

TEST(LimitsFile, NotPublishedYetIsNotARefusal) {
  Dir d;
  std::string err;
  std::unique_ptr<LimitsFile> shim;
  EXPECT_EQ(shimOpen(d, 1, "alpha", &shim, &err), 0) << err;
  EXPECT_NE(err.find("no limits directory"), std::string::npos) << err;
  ASSERT_TRUE(prepareLimitsDir(d.path, &err)) << err;
  EXPECT_EQ(shimOpen(d, 1, "alpha", &shim, &err), 0) << err;
  EXPECT_NE(err.find("has not published"), std::string::npos) << err;
  EXPECT_FALSE(shim);
}

TEST(LimitsFile, AShimRefusesWhatItMustNotTrust) {
  Dir d;
  std::string err;
  ASSERT_TRUE(prepareLimitsDir(d.path, &err)) << err;
  auto broker = LimitsFile::openForBroker(d.path, 7, "alpha", &err);
  ASSERT_TRUE(broker) << err;
  broker->publish(0, kUuidA, 100);
  std::unique_ptr<LimitsFile> shim;
  EXPECT_EQ(shimOpen(d, 7, "beta", &shim, &err), -1);
  EXPECT_NE(err.find("another tenant"), std::string::npos) << err;
  EXPECT_EQ(shimOpen(d, 7, "alpha", &shim, &err, ::geteuid() + 1), -1) << "another owner than the broker's";
  EXPECT_NE(err.find("not the broker's"), std::string::npos) << err;
  // Another ledger's file under this ledger's inode number.
  ASSERT_EQ(::link(broker->path().c_str(), (d.limits() + "/8").c_str()), 0);
  EXPECT_EQ(shimOpen(d, 8, "alpha", &shim, &err), -1);
  EXPECT_NE(err.find("speaks for ledger inode 7"), std::string::npos) << err;
  ASSERT_EQ(::chmod(broker->path().c_str(), 0666), 0);
  EXPECT_EQ(shimOpen(d, 7, "alpha", &shim, &err), -1) << "writable by others";
  ASSERT_EQ(::chmod(broker->path().c_str(), 0644), 0);
  ASSERT_EQ(::chmod(d.limits().c_str(), 0777), 0);
  EXPECT_EQ(shimOpen(d, 7, "alpha", &shim, &err), -1) << "a directory others can write";
  ASSERT_EQ(::chmod(d.limits().c_str(), 0711), 0);
  ASSERT_EQ(::truncate(broker->path().c_str(), 100), 0);
  EXPECT_EQ(shimOpen(d, 7, "alpha", &shim, &err), -1) << "a short file";
  ASSERT_EQ(::symlink("7", (d.limits() + "/9").c_str()), 0);
  EXPECT_EQ(shimOpen(d, 9, "alpha", &shim, &err), -1) << "a link is never followed";
  EXPECT_FALSE(shim);
}

TEST(LimitsFile, ARestartedBrokerKeepsItsFileAndReplacesAnythingElse) {
  Dir d;
  std::string err;
  ASSERT_TRUE(prepareLimitsDir(d.path, &err)) << err;
  {
    auto first = LimitsFile::openForBroker(d.path, 5, "alpha", &err);
    ASSERT_TRUE(first) << err;
    first->publish(1, kUuidB, 300);
  }
  std::unique_ptr<LimitsFile> shim;
  ASSERT_EQ(shimOpen(d, 5, "alpha", &shim, &err), 1) << err;
  auto again = LimitsFile::openForBroker(d.path, 5, "alpha", &err);
  ASSERT_TRUE(again) << err;
  uint8_t uuid[16];
  ASSERT_TRUE(again->readyUuid(1, uuid));
  EXPECT_EQ(std::memcmp(uuid, kUuidB, 16), 0);
  again->setLimit(1, 200);
  EXPECT_EQ(shim->limit(1), 200u) << "the running process's mapping is the same file";
  // Another tenant's (or a garbled) file under the name is replaced by a fresh one.
  auto other = LimitsFile::openForBroker(d.path, 5, "beta", &err);
  ASSERT_TRUE(other) << err;
  EXPECT_FALSE(other->readyUuid(1, uuid));
  std::ofstream(d.limits() + "/6") << "garbage";
  auto fresh = LimitsFile::openForBroker(d.path, 6, "alpha", &err);
  ASSERT_TRUE(fresh) << err;
  EXPECT_EQ(shimOpen(d, 6, "alpha", &shim, &err), 1) << err;
}

TEST(LimitsFile, AnythingPlantedUnderTheDirectorysNameIsMovedAside) {
  Dir d;
  std::string err;
  std::ofstream(d.limits()) << "planted";
  ASSERT_TRUE(prepareLimitsDir(d.path, &err)) << err;
  struct stat st;
  ASSERT_EQ(::lstat(d.limits().c_str(), &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  int aside = 0;
  for (const auto& e : std::filesystem::directory_iterator(d.path))
    aside += e.path().filename().string().rfind("limits.aside-", 0) == 0 && e.is_regular_file();
  EXPECT_EQ(aside, 1) << "the planted file, kept under another name";
  ASSERT_EQ(::chmod(d.limits().c_str(), 0777), 0);
  ASSERT_TRUE(prepareLimitsDir(d.path, &err)) << err;
  ASSERT_EQ(::lstat(d.limits().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0711u) << "its own directory is made private again";
}

}  // namespace
}  // namespace cushare
