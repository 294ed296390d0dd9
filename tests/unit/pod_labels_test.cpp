// Pod labels (broker/core/pod_labels.h): device IDs as directory names and back, and a process's
// allocation mount found in its mount table as proc(5) writes it, only when every part holds.
#include "core/pod_labels.h"

#include <gtest/gtest.h>

namespace cushare::broker {
namespace {

TEST(PodLabels, DeviceIdsAreDirectoryNamesAndBack) {
  EXPECT_EQ(allocationDirName("GPU-5e1a90c0-513d::3"), "GPU-5e1a90c0-513d_3");
  std::string id;
  ASSERT_TRUE(deviceIdOfDirName("GPU-5e1a90c0-513d_3", &id));
  EXPECT_EQ(id, "GPU-5e1a90c0-513d::3");
  ASSERT_TRUE(deviceIdOfDirName("GPU-a_b_12", &id)) << "the last '_' splits";
  EXPECT_EQ(id, "GPU-a_b::12");
  for (const char* bad : {"GPU-abc_", "_3", "GPU-abc_x", "GPU-abc_-1", "GPU:abc_1", "a/b_1", ".._1", "._1", "GPU abc_1",
                          "GPU-abc_1234567890", "GPU-abc", ""})
    EXPECT_FALSE(deviceIdOfDirName(bad, &id)) << bad;
}

// A container's table: overlay root, /proc, the runtime's mounts, and the allocation directory
// bound from the host's /run (tmpfs 0:26) with optional fields.
constexpr char kDir[] = "/cushare/allocations";  // the allocation directory within the host's /run
constexpr char kContainer[] =
    "1391 1300 0:312 / / rw,relatime master:405 - overlay overlay rw,lowerdir=/l,upperdir=/u,workdir=/w\n"
    "1392 1391 0:315 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw\n"
    "1401 1391 0:26 /cushare/mps /run/cushare/mps rw,nosuid,nodev master:7 - tmpfs tmpfs rw,mode=755\n"
    "1402 1391 0:26 /cushare/allocations/alpha/GPU-5e1a90c0_1 /run/cushare/allocation ro,nosuid,nodev shared:9 "
    "master:7 - tmpfs tmpfs rw,mode=755\n"
    "1403 1391 0:27 / /dev/shm rw,nosuid,nodev - tmpfs shm rw\n";

TEST(PodLabels, TheAllocationMountNamesTenantAndDeviceId) {
  const auto m = allocationFromMountinfo(kContainer, 0, 26, kDir);
  ASSERT_TRUE(m);
  EXPECT_EQ(m->tenant, "alpha");
  EXPECT_EQ(m->deviceId, "GPU-5e1a90c0::1");
  EXPECT_FALSE(allocationFromMountinfo(kContainer, 0, 27, kDir)) << "another filesystem than the allocation directory's";
  EXPECT_FALSE(allocationFromMountinfo(kContainer, 8, 26, kDir));
  // Octal escapes are decoded (a space in the path above).
  const auto e = allocationFromMountinfo(
      "7 1 8:1 /my\\040run/alloc/beta/GPU-x_0 /run/cushare/allocation ro - ext4 /dev/sda1 rw\n", 8, 1, "/my run/alloc");
  ASSERT_TRUE(e);
  EXPECT_EQ(e->tenant, "beta");
  EXPECT_EQ(e->deviceId, "GPU-x::0");
  // No final newline; a tab in the mount point escaped.
  EXPECT_TRUE(allocationFromMountinfo("7 1 8:1 /a/beta/GPU-x_0 /run/cushare/allocation ro - ext4 /dev/sda1 rw", 8, 1, "/a"));
  EXPECT_FALSE(
      allocationFromMountinfo("7 1 8:1 /a/beta/GPU-x_0 /run/cushare/allocation\\011 ro - ext4 /dev/sda1 rw", 8, 1, "/a"));
  // The allocation directory at the filesystem's root.
  EXPECT_TRUE(allocationFromMountinfo("7 1 8:1 /beta/GPU-x_0 /run/cushare/allocation ro - ext4 /dev/sda1 rw", 8, 1, "/"));
}

TEST(PodLabels, NothingElseNamesAContainer) {
  // No mount at the mount point; one beside or below it.
  EXPECT_FALSE(allocationFromMountinfo("1 0 0:26 /c/alpha/GPU-a_1 /run/cushare/allocations ro - tmpfs t rw\n", 0, 26, "/c"));
  EXPECT_FALSE(allocationFromMountinfo("1 0 0:26 /c/alpha/GPU-a_1 /run/cushare/allocation/x ro - tmpfs t rw\n", 0, 26, "/c"));
  EXPECT_FALSE(allocationFromMountinfo("", 0, 26, kDir));
  // A later mount over the mount point hides the allocation (a process that mounted its own
  // tmpfs there in a user namespace of its own), whatever it names.
  EXPECT_FALSE(allocationFromMountinfo(std::string(kContainer) +
                                           "1500 1402 0:99 /alpha/GPU-5e1a90c0_2 /run/cushare/allocation rw - tmpfs "
                                           "tmpfs rw\n",
                                       0, 26, kDir));
  // ... and a later mount of the right filesystem is the one that counts.
  const auto later = allocationFromMountinfo(
      "1 0 0:99 /alpha/GPU-a_2 /run/cushare/allocation rw - tmpfs t rw\n"
      "2 1 0:26 /x/alpha/GPU-a_3 /run/cushare/allocation ro - tmpfs t rw\n",
      0, 26, "/x");
  ASSERT_TRUE(later);
  EXPECT_EQ(later->deviceId, "GPU-a::3");
  // Roots that name no tenant and ID.
  for (const char* root : {"/", "/x", "/x/", "/x/GPU-a_1", "/x/alpha/", "/x/alpha/GPU-a", "/x/./GPU-a_1", "/x/../GPU-a_1",
                           "/x//GPU-a_1", "/x/alpha/GPU-a_1/y", "/x/a/b/GPU-a_1", "/xy/alpha/GPU-a_1"})
    EXPECT_FALSE(allocationFromMountinfo(std::string("1 0 0:26 ") + root + " /run/cushare/allocation ro - tmpfs t rw\n",
                                         0, 26, "/x"))
        << root;
  // Malformed lines are skipped, not misread.
  EXPECT_TRUE(allocationFromMountinfo("1 0 0:26 /x/alpha/GPU-a_1 /run/cushare/allocation ro - tmpfs t rw\n", 0, 26, "/x"));
  EXPECT_FALSE(allocationFromMountinfo("1 0 0:26 /x/alpha/GPU-a_1\n", 0, 26, "/x"));
  EXPECT_FALSE(allocationFromMountinfo("1 0 0-26 /x/alpha/GPU-a_1 /run/cushare/allocation ro - tmpfs t rw\n", 0, 26, "/x"));
  EXPECT_FALSE(allocationFromMountinfo("1 0 :26 /x/alpha/GPU-a_1 /run/cushare/allocation ro - tmpfs t rw\n", 0, 26, "/x"));
}

// A look-alike: a directory named <tenant>/<uuid>_<n> elsewhere on the allocation directory's
// filesystem (one a tenant could make and bind in a user namespace of its own) names nothing.
TEST(PodLabels, ALookAlikeDirectoryOnTheSameFilesystemNamesNothing) {
  const char* lookAlike =
      "1 0 0:26 /tmp/mine/alpha/GPU-5e1a90c0_1 /run/cushare/allocation ro - tmpfs t rw\n";
  EXPECT_FALSE(allocationFromMountinfo(lookAlike, 0, 26, kDir));
  EXPECT_FALSE(allocationFromMountinfo("1 0 0:26 /cushare/allocations/x/alpha/GPU-5e1a90c0_1 /run/cushare/allocation "
                                       "ro - tmpfs t rw\n",
                                       0, 26, kDir));
  EXPECT_TRUE(allocationFromMountinfo(kContainer, 0, 26, kDir));
}

// The allocation directory's path within its filesystem, from the broker's own mount table.
TEST(PodLabels, TheAllocationDirectoryIsFoundWithinItsFilesystem) {
  // In the broker's container: the host's /run/cushare bound at /run/cushare.
  const char* broker =
      "20 1 0:312 / / rw - overlay overlay rw\n"
      "21 20 0:26 /cushare /run/cushare rw,nosuid - tmpfs tmpfs rw\n"
      "22 20 0:27 / /dev/shm rw - tmpfs shm rw\n";
  EXPECT_EQ(pathWithinFilesystem(broker, "/run/cushare/allocations", 0, 26), "/cushare/allocations");
  EXPECT_EQ(pathWithinFilesystem(broker, "/run/cushare", 0, 26), "/cushare");
  EXPECT_EQ(pathWithinFilesystem(broker, "/var/lib/x", 0, 312), "/var/lib/x");
  EXPECT_FALSE(pathWithinFilesystem(broker, "/run/cushare/allocations", 0, 312)) << "dir is not on the root's filesystem";
  EXPECT_FALSE(pathWithinFilesystem(broker, "/run/cushare-other/a", 0, 26)) << "/run/cushare does not hold it";
  // On the host: /run itself is the tmpfs.
  const char* host = "1 0 8:1 / / rw - ext4 /dev/sda1 rw\n25 1 0:26 / /run rw - tmpfs tmpfs rw\n";
  EXPECT_EQ(pathWithinFilesystem(host, "/run/cushare/allocations", 0, 26), "/cushare/allocations");
  // A later mount on the same mount point hides the earlier one.
  EXPECT_FALSE(pathWithinFilesystem(std::string(host) + "26 25 0:44 / /run rw - tmpfs tmpfs rw\n",
                                    "/run/cushare/allocations", 0, 26));
  // Escapes are decoded.
  EXPECT_EQ(pathWithinFilesystem("1 0 0:26 /a\\040b /srv\\040x rw - tmpfs t rw\n", "/srv x/alloc", 0, 26), "/a b/alloc");
}

}  // namespace
}  // namespace cushare::broker
