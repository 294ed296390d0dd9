// The probes' one check: a call that does not return ok names itself, what it returned (name turns
// the status into text) and ends the probe with exit status 1. kProbe names the probe.
#pragma once

#include <cstdio>

#define PROBE_CHECK(call, ok, name)                                                  \
  do {                                                                               \
    const auto s_ = (call);                                                          \
    if (s_ != (ok)) {                                                                \
      std::fprintf(stderr, "%s: %s failed: %s\n", kProbe, #call, name(s_));         \
      return 1;                                                                      \
    }                                                                                \
  } while (0)
#define CUDA_CHECK(call) PROBE_CHECK(call, cudaSuccess, cudaGetErrorName)
