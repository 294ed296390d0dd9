// Live limits as the broker will set them: the limit is a field of the tenant's ledger, read by
// the shim on every allocation and every view, so a change made by another process applies to a
// running tenant at once. Memory already above a lowered limit is not revoked; new allocations are
// denied until usage falls below it. Run with no CUSHARE_MEMORY_LIMIT (the ledger's limit rules).
#include <cuda.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <memory>
#include <string>

#include "cushare/ledger.h"

namespace {

constexpr size_t kMiB = size_t{1} << 20;

#define CU_ASSERT(x) ASSERT_EQ(CUDA_SUCCESS, (x)) << #x

// Sets the tenant's limit on the ledger's first device from another process, as a broker would.
void setLimitFromAnotherProcess(uint64_t bytes) {
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    std::string err;
    auto ledger = cushare::Ledger::open(std::getenv("CUSHARE_LEDGER_DIR"), std::getenv("CUSHARE_TENANT"), &err);
    if (!ledger) _exit(2);
    ledger->setLimit(0, bytes);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(pid, waitpid(pid, &status, 0));
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

size_t total() {
  size_t f = 0, t = 0;
  EXPECT_EQ(CUDA_SUCCESS, cuMemGetInfo(&f, &t));
  return t;
}

TEST(LiveLimit, AppliesToARunningTenantAtOnce) {
  ASSERT_EQ(nullptr, std::getenv("CUSHARE_MEMORY_LIMIT"));
  CU_ASSERT(cuInit(0));
  CUcontext ctx;
  CU_ASSERT(cuDevicePrimaryCtxRetain(&ctx, 0));
  CU_ASSERT(cuCtxSetCurrent(ctx));
  EXPECT_EQ(4096 * kMiB, total()) << "no limit yet: the device's own size";

  setLimitFromAnotherProcess(256 * kMiB);
  EXPECT_EQ(256 * kMiB, total());
  CUdeviceptr a = 0, b = 0;
  EXPECT_EQ(CUDA_ERROR_OUT_OF_MEMORY, cuMemAlloc(&a, 300 * kMiB));
  CU_ASSERT(cuMemAlloc(&a, 200 * kMiB));

  // Lowered below what the tenant holds: nothing is revoked, new allocations wait for frees.
  setLimitFromAnotherProcess(100 * kMiB);
  EXPECT_EQ(CUDA_ERROR_OUT_OF_MEMORY, cuMemAlloc(&b, 1 * kMiB));
  size_t f = 1, t = 0;
  CU_ASSERT(cuMemGetInfo(&f, &t));
  EXPECT_EQ(100 * kMiB, t);
  EXPECT_EQ(0u, f) << "free never goes below zero";
  CU_ASSERT(cuMemFree(a));
  CU_ASSERT(cuMemAlloc(&b, 50 * kMiB));
  CU_ASSERT(cuMemFree(b));

  // Raised again: the room comes back without restarting the tenant.
  setLimitFromAnotherProcess(1024 * kMiB);
  CU_ASSERT(cuMemAlloc(&a, 900 * kMiB));
  CU_ASSERT(cuMemFree(a));
}

}  // namespace
