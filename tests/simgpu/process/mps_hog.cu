// An nvcc-built program (static cudart) that keeps the device busy, for mps_test.cpp's device-time
// tests of the simulated MPS. Its kernel does nothing on the CPU; the cost table the tests run
// with (mps.costs: `mps_hog block_ns_param=0`) makes each block last `ns` of device time.
//
//   mps_hog loop <blocks> <threads> <ns> <streams>
//     prints "ready <multiprocessor count>", then keeps two kernels in flight on each stream until
//     stdin has a byte or closes (or a CUDA call fails); prints "running" once the first kernel of
//     each stream ended, then "done <kernels> <status>" (status: the first CUDA error, 0 if none),
//     and exits when stdin closes.
//   mps_hog once <blocks> <threads> <ns>
//     prints "ready <multiprocessor count>", waits for a line on stdin, runs one kernel between two
//     events and prints "elapsed <device us> <status>".
#include <cuda_runtime.h>
#include <poll.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

__global__ void mps_hog(long long ns) { (void)ns; }

namespace {

void say(const char* fmt, long long a, long long b = -1) {
  if (b < 0) std::printf(fmt, a);
  else std::printf(fmt, a, b);
  std::fflush(stdout);
}

bool stdinReady() {
  pollfd p{0, POLLIN | POLLHUP, 0};
  return poll(&p, 1, 0) > 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: mps_hog loop|once <blocks> <threads> <ns> [streams]\n");
    return 2;
  }
  const bool loop = std::strcmp(argv[1], "loop") == 0;
  const unsigned blocks = static_cast<unsigned>(std::atoi(argv[2]));
  const unsigned threads = static_cast<unsigned>(std::atoi(argv[3]));
  const long long ns = std::atoll(argv[4]);
  const int nStreams = argc > 5 ? std::atoi(argv[5]) : 1;
  int sms = -1;
  cudaError_t err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  say("ready %lld\n", err == cudaSuccess ? sms : -static_cast<long long>(err));
  if (err != cudaSuccess) return 1;
  if (!loop) {
    char line[16];
    if (!std::fgets(line, sizeof line, stdin)) return 0;
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    cudaEventRecord(a, 0);
    mps_hog<<<blocks, threads>>>(ns);
    cudaEventRecord(b, 0);
    err = cudaEventSynchronize(b);
    float ms = -1;
    if (err == cudaSuccess) err = cudaEventElapsedTime(&ms, a, b);
    say("elapsed %lld %lld\n", static_cast<long long>(ms * 1000), err);
    return 0;
  }
  std::vector<cudaStream_t> streams(nStreams);
  std::vector<cudaEvent_t> done(2 * nStreams);
  for (int s = 0; s < nStreams; ++s) cudaStreamCreateWithFlags(&streams[s], cudaStreamNonBlocking);
  for (auto& e : done) cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  long long launched = 0;
  bool running = false;
  for (long long i = 0; err == cudaSuccess && !stdinReady(); ++i) {
    for (int s = 0; s < nStreams && err == cudaSuccess; ++s) {
      cudaEvent_t& e = done[2 * s + i % 2];
      if (i >= 2) err = cudaEventSynchronize(e);  // at most two kernels in flight per stream
      if (err != cudaSuccess) break;
      mps_hog<<<blocks, threads, 0, streams[s]>>>(ns);
      err = cudaGetLastError();
      if (err == cudaSuccess) err = cudaEventRecord(e, streams[s]);
      ++launched;
    }
    if (i == 2 && !running && err == cudaSuccess) {
      running = true;
      std::printf("running\n");
      std::fflush(stdout);
    }
  }
  const cudaError_t sync = cudaDeviceSynchronize();
  if (err == cudaSuccess) err = sync;
  say("done %lld %lld\n", launched, err);
  char rest[64];
  while (read(0, rest, sizeof rest) > 0) {  // stays a client until its stdin closes
  }
  return 0;
}
