// Assertions on driver-API results for the simgpu driver tests: the failing call and the error's
// name are printed.
#pragma once

#include <cuda.h>
#include <gtest/gtest.h>

#include <string>

inline std::string errName(CUresult r) {
  const char* s = nullptr;
  if (cuGetErrorName(r, &s) != CUDA_SUCCESS || !s) return "CUresult " + std::to_string(static_cast<int>(r));
  return s;
}

#define CU_ASSERT(expr)                                                                \
  do {                                                                                 \
    const CUresult cu_assert_r_ = (expr);                                              \
    ASSERT_EQ(CUDA_SUCCESS, cu_assert_r_) << #expr << " -> " << errName(cu_assert_r_); \
  } while (0)
#define CU_EXPECT(expr)                                                                \
  do {                                                                                 \
    const CUresult cu_expect_r_ = (expr);                                              \
    EXPECT_EQ(CUDA_SUCCESS, cu_expect_r_) << #expr << " -> " << errName(cu_expect_r_); \
  } while (0)
#define CU_EXPECT_ERR(code, expr)                                                \
  do {                                                                           \
    const CUresult cu_expect_r_ = (expr);                                        \
    EXPECT_EQ((code), cu_expect_r_) << #expr << " -> " << errName(cu_expect_r_); \
  } while (0)
