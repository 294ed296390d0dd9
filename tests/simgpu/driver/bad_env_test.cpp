// An invalid SIMGPU_* value: cuInit fails (and with it every driver call) after one line on stderr
// naming the variable; never a crash, never a default. Each registration sets one bad value and
// EXPECT_BAD_VARIABLE to the name that line must contain.
#include <cuda.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>

namespace {

TEST(SimgpuBadEnv, CuInitFailsNamingTheVariable) {
  const char* var = std::getenv("EXPECT_BAD_VARIABLE");
  ASSERT_NE(nullptr, var);
  int fds[2];
  ASSERT_EQ(0, pipe(fds));
  const int saved = dup(2);
  dup2(fds[1], 2);
  const CUresult r = cuInit(0);
  int count = -1;
  const CUresult c = cuDeviceGetCount(&count);
  dup2(saved, 2);
  close(fds[1]);
  char buf[4096] = {};
  const ssize_t n = read(fds[0], buf, sizeof buf - 1);
  close(fds[0]);
  EXPECT_EQ(CUDA_ERROR_NOT_INITIALIZED, r);
  EXPECT_EQ(CUDA_ERROR_NOT_INITIALIZED, c);
  ASSERT_GT(n, 0);
  EXPECT_NE(nullptr, std::strstr(buf, var)) << buf;
  EXPECT_EQ(std::string(buf).find('\n'), std::string(buf).size() - 1) << "exactly one line: " << buf;
}

}  // namespace
