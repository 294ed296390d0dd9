// The file and directory helpers the broker's writers share (common/include/cushare/atomic_file.h).
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "cushare/atomic_file.h"

namespace cushare {
namespace {

mode_t modeOf(const std::string& path) {
  struct stat st{};
  return ::stat(path.c_str(), &st) == 0 ? st.st_mode & 07777 : 0;
}

// mkdir -p with the last directory's own mode, the ones on the way 0755, existing ones left as
// they are; a component that is a file is named in the error.
TEST(Directories, MadeOnTheWayWithTheirModesAndFilesInTheWayNamed) {
  const std::string dir = std::filesystem::temp_directory_path() / ("cushare-dirs-unit-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  const mode_t mask = ::umask(0);
  std::string err;
  ASSERT_TRUE(makeDirectories(dir + "/a/b", 0700, "ledger directory ", &err)) << err;
  EXPECT_EQ(modeOf(dir + "/a"), 0755u);
  EXPECT_EQ(modeOf(dir + "/a/b"), 0700u);
  ASSERT_EQ(::chmod((dir + "/a").c_str(), 0750), 0);
  ASSERT_TRUE(makeDirectories(dir + "/a/b", 0711, "", &err)) << err;
  EXPECT_EQ(modeOf(dir + "/a"), 0750u) << "an existing directory is left as it is";
  EXPECT_EQ(modeOf(dir + "/a/b"), 0700u);
  std::ofstream(dir + "/file") << "x";
  EXPECT_FALSE(makeDirectories(dir + "/file/c", 0755, "ledger directory ", &err));
  EXPECT_EQ(err.rfind("cannot create ledger directory " + dir + "/file/c: ", 0), 0u) << err;
  EXPECT_FALSE(makeDirectories(dir + "/file", 0755, "", &err));
  EXPECT_EQ(err, dir + "/file is not a directory");
  ASSERT_TRUE(makeParentDirectories(dir + "/p/q/state.json", &err)) << err;
  EXPECT_EQ(modeOf(dir + "/p/q"), 0755u);
  EXPECT_FALSE(std::filesystem::exists(dir + "/p/q/state.json")) << "the last component is the caller's";
  EXPECT_TRUE(makeParentDirectories("state.json", &err)) << "the working directory: nothing to make";
  ::umask(mask);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace cushare
