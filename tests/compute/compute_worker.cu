// A tenant process for the compute tests (docs/compute.md), an nvcc-built cudart program driven
// line by line over stdin; its kernel's device time comes from the cost table (compute.costs:
// each block of `spin` lasts its parameter, in ns).
//
//   run MS US             -> launches 1-block kernels of US microseconds back to back (the queue
//                            never empty, at most 4 deep) for MS ms of wall time, then waits: "done N"
//   duty MS US PERIOD_US  -> every PERIOD_US one kernel of US, waited for: "done N"
//   lat MS US GAP_US      -> like duty with a GAP_US pause after each kernel: "lat N P50_US P99_US"
//                            (launch-to-completion latency of each kernel, host wall time)
//   many N MS US          -> like run, round robin over N streams of its own (all alive until the
//                            end): "done N"
//   loop MS US DEPTH T    -> a launch-bound loop: T threads (1..16), each on a stream of its own,
//                            launch 1-block kernels of US microseconds in batches of DEPTH/2 with
//                            an event after each batch, waiting only for the batch before the last
//                            (at most DEPTH queued per stream), for MS ms: "done N" (all threads)
//   graph N US            -> N graph launches of a one-kernel graph: "done N"
//   prio P                -> a stream created with priority P: "prio GOT" (its priority)
//   range                 -> "range LEAST GREATEST"
//   pid                   -> "pid PID"
//   reset                 -> cudaDeviceReset (every allocation and stream of the device goes): "reset CODE"
//   quit
// At start it prints "ready" (after the context exists), or "init-failed CODE".
#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

__global__ void spin(int* flag, long long ns) {
  if (threadIdx.x == 0 && blockIdx.x == 0 && flag) flag[0] = 1;
  (void)ns;
}

namespace {
using Clock = std::chrono::steady_clock;
double msSince(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}
}  // namespace

int main() {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  if (cudaError_t e = cudaFree(nullptr); e != cudaSuccess) {
    std::printf("init-failed %d\n", static_cast<int>(e));
    return 3;
  }
  int* flag = nullptr;
  cudaMalloc(&flag, sizeof(int));
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  std::printf("ready\n");
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    if (cmd == "run" || cmd == "many") {
      long long streams = 1, ms = 0, us = 0;
      if (cmd == "many") in >> streams;
      in >> ms >> us;
      std::vector<cudaStream_t> own(static_cast<size_t>(cmd == "many" ? std::max(1LL, streams) : 0));
      for (cudaStream_t& s : own) cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
      const auto on = [&](long long n) { return own.empty() ? stream : own[static_cast<size_t>(n) % own.size()]; };
      // At most kDepth kernels queued (an unpaced process would otherwise queue far more device
      // time than MS): the queue never runs dry, and the run ends about when MS says.
      constexpr int kDepth = 4;
      cudaEvent_t ev[kDepth];
      for (cudaEvent_t& e : ev) cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
      const auto t0 = Clock::now();
      long long n = 0;
      while (msSince(t0) < static_cast<double>(ms)) {
        if (n >= kDepth) cudaEventSynchronize(ev[n % kDepth]);
        spin<<<1, 32, 0, on(n)>>>(flag, us * 1000);
        cudaEventRecord(ev[n % kDepth], on(n));
        ++n;
      }
      for (cudaEvent_t& e : ev) cudaEventDestroy(e);
      cudaStreamSynchronize(stream);
      for (cudaStream_t& s : own) {
        cudaStreamSynchronize(s);
        cudaStreamDestroy(s);
      }
      std::printf("done %lld\n", n);
    } else if (cmd == "duty" || cmd == "lat") {
      long long ms = 0, us = 0, period = 0;
      in >> ms >> us >> period;
      const auto t0 = Clock::now();
      std::vector<double> lat;
      while (msSince(t0) < static_cast<double>(ms)) {
        const auto k = Clock::now();
        spin<<<1, 32, 0, stream>>>(flag, us * 1000);
        cudaStreamSynchronize(stream);
        const double took = msSince(k) * 1000.0;
        lat.push_back(took);
        const double rest = cmd == "lat" ? static_cast<double>(period) : static_cast<double>(period) - took;
        if (rest > 0) std::this_thread::sleep_for(std::chrono::microseconds(static_cast<long long>(rest)));
      }
      if (cmd == "duty") {
        std::printf("done %zu\n", lat.size());
      } else {
        std::sort(lat.begin(), lat.end());
        const auto at = [&](double q) { return lat.empty() ? 0.0 : lat[std::min(lat.size() - 1, static_cast<size_t>(q * lat.size()))]; };
        std::printf("lat %zu %.0f %.0f\n", lat.size(), at(0.5), at(0.99));
      }
    } else if (cmd == "loop") {
      long long ms = 0, us = 0, depth = 0, threads = 0;
      in >> ms >> us >> depth >> threads;
      threads = std::clamp(threads, 1LL, 16LL);
      const long long batch = std::max(1LL, depth / 2);
      std::vector<long long> done(static_cast<size_t>(threads), 0);
      std::vector<std::thread> ts;
      const auto t0 = Clock::now();
      for (long long t = 0; t < threads; ++t)
        ts.emplace_back([&, t] {
          cudaStream_t s;
          cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
          cudaEvent_t ev[2];
          for (cudaEvent_t& e : ev) cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
          long long n = 0;
          for (long long b = 0; msSince(t0) < static_cast<double>(ms); ++b) {
            if (b >= 2) cudaEventSynchronize(ev[b % 2]);  // the batch before the last is done
            for (long long i = 0; i < batch; ++i, ++n) spin<<<1, 32, 0, s>>>(flag, us * 1000);
            cudaEventRecord(ev[b % 2], s);
          }
          cudaStreamSynchronize(s);
          for (cudaEvent_t& e : ev) cudaEventDestroy(e);
          cudaStreamDestroy(s);
          done[static_cast<size_t>(t)] = n;
        });
      for (std::thread& th : ts) th.join();
      long long n = 0;
      for (long long d : done) n += d;
      std::printf("done %lld\n", n);
    } else if (cmd == "graph") {
      long long n = 0, us = 0;
      in >> n >> us;
      cudaGraph_t g;
      cudaGraphExec_t exec;
      cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal);
      spin<<<1, 32, 0, stream>>>(flag, us * 1000);
      cudaStreamEndCapture(stream, &g);
      cudaGraphInstantiate(&exec, g, 0);
      for (long long i = 0; i < n; ++i) cudaGraphLaunch(exec, stream);
      cudaStreamSynchronize(stream);
      std::printf("done %lld\n", n);
    } else if (cmd == "prio") {
      int want = 0, got = 99;
      in >> want;
      cudaStream_t st;
      if (cudaStreamCreateWithPriority(&st, cudaStreamNonBlocking, want) == cudaSuccess &&
          cudaStreamGetPriority(st, &got) == cudaSuccess) {
        cudaStreamDestroy(st);
        std::printf("prio %d\n", got);
      } else {
        std::printf("prio-failed\n");
      }
    } else if (cmd == "range") {
      int least = 0, greatest = 0;
      cudaDeviceGetStreamPriorityRange(&least, &greatest);
      std::printf("range %d %d\n", least, greatest);
    } else if (cmd == "reset") {
      std::printf("reset %d\n", static_cast<int>(cudaDeviceReset()));
    } else if (cmd == "pid") {
      std::printf("pid %d\n", static_cast<int>(getpid()));
    } else if (cmd == "quit") {
      break;
    } else {
      std::printf("unknown %s\n", cmd.c_str());
    }
  }
  return 0;
}
