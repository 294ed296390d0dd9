// Device-time engine throughput (perf/engine_launch_rate.sh): P processes each launch short
// kernels (1 block, the default 1 us block time) at R kernels per second for D seconds on one
// simulated device, then synchronise. A process keeps up when all its kernels complete within
// the D seconds plus a little: the figure printed per run is the ratio of the kernels per second
// achieved (launched and completed, to the end of synchronisation) to the target R.
//
// usage: engine_launch_rate [processes=8] [rate=10000] [seconds=1]
#include <cuda.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

int worker(int fd, long rate, double seconds) {
  CUcontext ctx;
  CUmodule m;
  CUfunction f;
  CUstream s;
  static const char kPtx[] = ".version 8.0\n.target sm_90\n.address_size 64\n";
  if (cuInit(0) || cuDevicePrimaryCtxRetain(&ctx, 0) || cuCtxSetCurrent(ctx) || cuModuleLoadData(&m, kPtx) ||
      cuModuleGetFunction(&f, m, "short_kernel") || cuStreamCreate(&s, CU_STREAM_NON_BLOCKING))
    return 1;
  const long total = static_cast<long>(rate * seconds);
  const auto t0 = Clock::now();
  for (long i = 0; i < total; ++i) {
    // Paced: kernel i is launched no earlier than i / rate seconds after the start.
    const auto due = t0 + std::chrono::nanoseconds(static_cast<long long>(1e9 * i / rate));
    if (Clock::now() < due) std::this_thread::sleep_until(due);
    if (cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, s, nullptr, nullptr)) return 1;
  }
  const double launched = std::chrono::duration<double>(Clock::now() - t0).count();
  if (cuStreamSynchronize(s)) return 1;
  const double done = std::chrono::duration<double>(Clock::now() - t0).count();
  char line[128];
  const int n = std::snprintf(line, sizeof line, "%ld %.4f %.4f\n", total, launched, done);
  (void)!write(fd, line, n);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const int procs = argc > 1 ? std::atoi(argv[1]) : 8;
  const long rate = argc > 2 ? std::atol(argv[2]) : 10000;
  const double seconds = argc > 3 ? std::atof(argv[3]) : 1.0;
  int fds[2];
  if (pipe(fds)) return 1;
  std::vector<pid_t> kids;
  for (int i = 0; i < procs; ++i) {
    const pid_t pid = fork();  // before any CUDA call in the parent: each child initialises its own
    if (pid == 0) {
      close(fds[0]);
      _exit(worker(fds[1], rate, seconds));
    }
    kids.push_back(pid);
  }
  close(fds[1]);
  int failed = 0;
  for (pid_t k : kids) {
    int st = 0;
    waitpid(k, &st, 0);
    failed += !(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  }
  FILE* in = fdopen(fds[0], "r");
  long total;
  double launched, done, worst = 1e9, sumRatio = 0;
  int n = 0;
  while (in && std::fscanf(in, "%ld %lf %lf", &total, &launched, &done) == 3) {
    const double ratio = (total / done) / rate;
    worst = std::min(worst, ratio);
    sumRatio += ratio;
    ++n;
  }
  std::printf("processes %d, target %ld kernels/s each for %.1f s: achieved/target mean %.3f, worst %.3f%s\n", procs,
              rate, seconds, n ? sumRatio / n : 0.0, n ? worst : 0.0, failed ? " (some workers failed)" : "");
  return failed ? 1 : 0;
}
