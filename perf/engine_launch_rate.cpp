// Device-time engine throughput (docs/performance.md): P processes each launch short
// kernels (1 block, the default 1 us block time) at R kernels per second for D seconds on one
// simulated device, then synchronise. A process keeps up when all its kernels complete within
// the D seconds plus a little: the figure printed per run is the ratio of the kernels per second
// achieved (launched and completed, to the end of synchronisation) to the target R.
//
// With --mps CONTROL (the path of nvidia-cuda-mps-control), the same run is repeated with every
// process an MPS client of one simulated server (a daemon started in a temporary pipe directory),
// so each kernel makes a round trip to the server; the figures of both runs and their ratio are
// printed. Both modes also time the round trip of one kernel alone (launch + synchronise, 2,000
// times in one process): its mean without and with MPS, and their ratio.
//
// usage: engine_launch_rate [processes=8] [rate=10000] [seconds=1] [--mps CONTROL]
#include <cuda.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
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

// One kernel at a time: launch, synchronise; writes the mean round trip in us.
int latency(int fd, int rounds) {
  CUcontext ctx;
  CUmodule m;
  CUfunction f;
  CUstream s;
  static const char kPtx[] = ".version 8.0\n.target sm_90\n.address_size 64\n";
  if (cuInit(0) || cuDevicePrimaryCtxRetain(&ctx, 0) || cuCtxSetCurrent(ctx) || cuModuleLoadData(&m, kPtx) ||
      cuModuleGetFunction(&f, m, "short_kernel") || cuStreamCreate(&s, CU_STREAM_NON_BLOCKING))
    return 1;
  for (int i = 0; i < 100; ++i)  // warm up: the stream's worker, the engine, the connection
    if (cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, s, nullptr, nullptr) || cuStreamSynchronize(s)) return 1;
  const auto t0 = Clock::now();
  for (int i = 0; i < rounds; ++i)
    if (cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, s, nullptr, nullptr) || cuStreamSynchronize(s)) return 1;
  const double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / rounds;
  char line[64];
  const int n = std::snprintf(line, sizeof line, "%.2f\n", us);
  (void)!write(fd, line, n);
  return 0;
}

struct Figures {
  double mean = 0, worst = 0, latencyUs = 0;
  bool ok = false;
};

// Runs the launch-rate processes, then the latency process; each a fresh fork (no CUDA here).
Figures measure(int procs, long rate, double seconds) {
  Figures out;
  int fds[2];
  if (pipe(fds)) return out;
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
  double launched, done, sumRatio = 0;
  out.worst = 1e9;
  int n = 0;
  while (in && std::fscanf(in, "%ld %lf %lf", &total, &launched, &done) == 3) {
    const double ratio = (total / done) / rate;
    out.worst = std::min(out.worst, ratio);
    sumRatio += ratio;
    ++n;
  }
  if (in) fclose(in);
  out.mean = n ? sumRatio / n : 0;
  if (pipe(fds)) return out;
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    _exit(latency(fds[1], 2000));
  }
  close(fds[1]);
  int st = 0;
  waitpid(pid, &st, 0);
  in = fdopen(fds[0], "r");
  if (!in || std::fscanf(in, "%lf", &out.latencyUs) != 1) failed = 1;
  if (in) fclose(in);
  out.ok = failed == 0 && n == procs;
  return out;
}

// Runs `control` with args, the command on its stdin; its exit status.
int runControl(const char* control, const char* arg, const char* command) {
  int in[2];
  if (pipe(in)) return -1;
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(in[0], 0);
    close(in[0]);
    close(in[1]);
    if (arg) execl(control, control, arg, static_cast<char*>(nullptr));
    else execl(control, control, static_cast<char*>(nullptr));
    _exit(127);
  }
  close(in[0]);
  if (command) (void)!write(in[1], command, std::strlen(command));
  close(in[1]);
  int st = 0;
  waitpid(pid, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

}  // namespace

int main(int argc, char** argv) {
  const char* mps = nullptr;
  std::vector<const char*> pos;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--mps") == 0 && i + 1 < argc) mps = argv[++i];
    else pos.push_back(argv[i]);
  }
  const int procs = pos.size() > 0 ? std::atoi(pos[0]) : 8;
  const long rate = pos.size() > 1 ? std::atol(pos[1]) : 10000;
  const double seconds = pos.size() > 2 ? std::atof(pos[2]) : 1.0;
  setenv("CUDA_MPS_PIPE_DIRECTORY", "/nonexistent/simgpu-no-mps", 1);  // the baseline: no daemon
  const Figures base = measure(procs, rate, seconds);
  std::printf("processes %d, target %ld kernels/s each for %.1f s: achieved/target mean %.3f, worst %.3f%s\n", procs,
              rate, seconds, base.mean, base.worst, base.ok ? "" : " (some workers failed)");
  std::printf("one kernel's round trip (launch + synchronise): %.1f us\n", base.latencyUs);
  if (!mps) return base.ok ? 0 : 1;
  char dir[] = "/tmp/elr-mps-XXXXXX";
  if (!mkdtemp(dir)) return 1;
  const std::string pipeDir = std::string(dir) + "/pipe", logDir = std::string(dir) + "/log";
  setenv("CUDA_MPS_PIPE_DIRECTORY", pipeDir.c_str(), 1);
  setenv("CUDA_MPS_LOG_DIRECTORY", logDir.c_str(), 1);
  if (runControl(mps, "-d", nullptr) != 0) {
    std::fprintf(stderr, "engine_launch_rate: cannot start %s -d\n", mps);
    return 1;
  }
  const Figures m = measure(procs, rate, seconds);
  runControl(mps, nullptr, "quit");
  std::printf("as MPS clients of one server: achieved/target mean %.3f (%.3f x the baseline), worst %.3f%s\n", m.mean,
              base.mean > 0 ? m.mean / base.mean : 0.0, m.worst, m.ok ? "" : " (some workers failed)");
  std::printf("one kernel's round trip as an MPS client: %.1f us (%.2f x the baseline)\n", m.latencyUs,
              base.latencyUs > 0 ? m.latencyUs / base.latencyUs : 0.0);
  return base.ok && m.ok ? 0 : 1;
}
