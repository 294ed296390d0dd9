// One process of perf/alloc_throughput.cpp: T threads, each doing N cuMemAlloc + cuMemFree pairs
// of one size, started together.
//   usage: alloc_worker THREADS ITERATIONS BYTES
// Protocol with the parent (stdin and stdout are pipes): once every thread has made its first
// allocation (the shim claims the process's ledger slot and registers the device on the first one:
// system calls that are no part of the steady state) and waits at the start line, the worker
// prints "ready". It then blocks until it reads one byte from stdin, so the parent can start all
// workers at once, runs, and prints "START_NS END_NS CPU_NS FAILED": CLOCK_MONOTONIC times (one
// clock for every process of the host, so the parent can take the span from the first start to the
// last end across processes), the CPU time its threads spent in the timed loop (unlike the span,
// it does not grow when threads wait for a core: time slicing and other load on the host do not
// count, cache-line contention and spinning do), and the number of pairs that failed, the warm-up
// included. A failure is counted, not retried: the parent must never report figures of a path that
// denies.
#include <cuda.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <latch>
#include <numeric>
#include <thread>
#include <vector>

namespace {

uint64_t clockNs(clockid_t clock) {
  timespec ts;
  clock_gettime(clock, &ts);
  return uint64_t(ts.tv_sec) * 1'000'000'000u + uint64_t(ts.tv_nsec);
}

[[noreturn]] void usage() {
  std::fprintf(stderr, "usage: alloc_worker THREADS ITERATIONS BYTES (positive integers)\n");
  std::exit(2);
}

uint64_t positiveArg(const char* s) {
  char* end = nullptr;
  const unsigned long long v = std::strtoull(s, &end, 10);
  if (*s == '\0' || *end != '\0' || v == 0) usage();
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) usage();
  const auto threads = static_cast<unsigned>(positiveArg(argv[1]));
  const uint64_t iterations = positiveArg(argv[2]);
  const size_t bytes = positiveArg(argv[3]);

  CUcontext ctx = nullptr;
  if (cuInit(0) != CUDA_SUCCESS || cuDevicePrimaryCtxRetain(&ctx, 0) != CUDA_SUCCESS) {
    std::fprintf(stderr,
                 "alloc_worker: cuInit or context retain failed (is the shim refusing its "
                 "environment?)\n");
    return 1;
  }

  std::latch warmed(threads);
  std::latch go(1);  // waiting threads sleep in the kernel: no spinning while others start
  std::atomic<uint64_t> failed{0};
  std::vector<uint64_t> endNs(threads), cpuNs(threads);
  std::vector<std::thread> pool;
  pool.reserve(threads);
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      // The current context is per thread in the driver API. Should this fail, every allocation
      // fails and is counted.
      cuCtxSetCurrent(ctx);
      uint64_t myFailed = 0;
      auto pair = [&] {
        CUdeviceptr p;
        if (cuMemAlloc(&p, bytes) != CUDA_SUCCESS || cuMemFree(p) != CUDA_SUCCESS) ++myFailed;
      };
      pair();  // warm-up, untimed: see the header
      warmed.count_down();
      go.wait();
      const uint64_t cpu0 = clockNs(CLOCK_THREAD_CPUTIME_ID);
      for (uint64_t i = 0; i < iterations; ++i) pair();
      endNs[t] = clockNs(CLOCK_MONOTONIC);
      cpuNs[t] = clockNs(CLOCK_THREAD_CPUTIME_ID) - cpu0;
      failed.fetch_add(myFailed, std::memory_order_relaxed);
    });
  }
  warmed.wait();
  std::printf("ready\n");
  std::fflush(stdout);
  char byte;
  if (::read(STDIN_FILENO, &byte, 1) != 1) {
    std::fprintf(stderr, "alloc_worker: no start signal on stdin\n");
    std::_Exit(1);  // the threads are parked on the latch and cannot be joined
  }
  const uint64_t startNs = clockNs(CLOCK_MONOTONIC);
  go.count_down();
  for (std::thread& th : pool) th.join();
  std::printf("%llu %llu %llu %llu\n", static_cast<unsigned long long>(startNs),
              static_cast<unsigned long long>(*std::max_element(endNs.begin(), endNs.end())),
              static_cast<unsigned long long>(std::accumulate(cpuNs.begin(), cpuNs.end(), 0ull)),
              static_cast<unsigned long long>(failed.load()));
  return 0;
}
