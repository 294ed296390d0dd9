// How the device accounts VMM memory that only an exported descriptor keeps alive (issue 9's open
// case: a tenant exports a POSIX file descriptor, passes it to a process that never imports it,
// and the exporter exits). Run by perf/gpu_check.sh on a real GPU, and by a test on simgpu so it is
// known to work. Prints one `key=value` line per step:
//   step=<name> device_used=<bytes> processes=<pid:bytes,...> [fd_target=<readlink of the fd>]
// Steps: baseline (nothing allocated), exported (the exporter holds 256 MiB and has sent the
// descriptor), orphaned (the exporter has exited; only the descriptor in this process, which never
// touches CUDA, keeps the memory), closed (the descriptor closed too).
// What a real driver shows at `orphaned` decides how the broker can charge such memory: whether
// NVML attributes it to any process, whether device-wide `used` still counts it, and what the
// descriptor links to in /proc (something the broker could find by scanning /proc/*/fd).
//
// This process loads only NVML (dlopen); the exporter is a child that uses the driver API.
#include <cuda.h>
#include <dlfcn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>

#include "cushare/nvml_api.h"
#include "fd_passing.h"

namespace {

constexpr size_t kBytes = size_t{256} << 20;

// The exporter: allocates shareable memory, exports it, sends the descriptor, waits for "exit".
int exporter(int sock) {
  CUdevice dev;
  CUcontext ctx;
  if (cuInit(0) != CUDA_SUCCESS || cuDeviceGet(&dev, 0) != CUDA_SUCCESS ||
      cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS || cuCtxSetCurrent(ctx) != CUDA_SUCCESS)
    return 10;
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t gran = 0;
  if (cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS) return 11;
  const size_t size = (kBytes + gran - 1) / gran * gran;
  CUmemGenericAllocationHandle h;
  if (cuMemCreate(&h, size, &prop, 0) != CUDA_SUCCESS) return 12;
  int fd = -1;
  if (cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0) != CUDA_SUCCESS) return 13;
  if (cushare::fdpass::sendFd(sock, fd) != 0) return 14;
  char buf[8];
  (void)!read(sock, buf, sizeof buf);  // "exit": leave without releasing anything
  return 0;
}

struct Nvml {
  void* lib = nullptr;
  nvmlReturn_t (*init)() = nullptr;
  nvmlReturn_t (*handle)(unsigned, nvmlDevice_t*) = nullptr;
  nvmlReturn_t (*memory)(nvmlDevice_t, nvmlMemory_t*) = nullptr;
  nvmlReturn_t (*procs)(nvmlDevice_t, unsigned*, nvmlProcessInfo_t*) = nullptr;
  nvmlDevice_t dev = nullptr;
};

void report(Nvml& n, const char* step, int fd) {
  nvmlMemory_t m{};
  const nvmlReturn_t r = n.memory(n.dev, &m);
  std::string list;
  nvmlProcessInfo_t infos[64];
  unsigned count = 64;
  if (n.procs(n.dev, &count, infos) == NVML_SUCCESS)
    for (unsigned i = 0; i < count; ++i)
      list += (list.empty() ? "" : ",") + std::to_string(infos[i].pid) + ":" + std::to_string(infos[i].usedGpuMemory);
  std::printf("step=%s device_used=%llu processes=%s", step, r == NVML_SUCCESS ? static_cast<unsigned long long>(m.used) : 0ull,
              list.empty() ? "-" : list.c_str());
  if (fd >= 0) {
    char link[256] = {};
    const std::string path = "/proc/self/fd/" + std::to_string(fd);
    const ssize_t k = readlink(path.c_str(), link, sizeof link - 1);
    std::printf(" fd_target=%s", k > 0 ? link : "?");
  }
  std::printf("\n");
  std::fflush(stdout);
}

}  // namespace

int main() {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) return 2;
  Nvml n;
  n.lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!n.lib) {
    std::printf("error=no-nvml %s\n", dlerror());
    return 2;
  }
  n.init = reinterpret_cast<nvmlReturn_t (*)()>(dlsym(n.lib, "nvmlInit_v2"));
  n.handle = reinterpret_cast<nvmlReturn_t (*)(unsigned, nvmlDevice_t*)>(dlsym(n.lib, "nvmlDeviceGetHandleByIndex_v2"));
  n.memory = reinterpret_cast<nvmlReturn_t (*)(nvmlDevice_t, nvmlMemory_t*)>(dlsym(n.lib, "nvmlDeviceGetMemoryInfo"));
  n.procs = reinterpret_cast<nvmlReturn_t (*)(nvmlDevice_t, unsigned*, nvmlProcessInfo_t*)>(
      dlsym(n.lib, "nvmlDeviceGetComputeRunningProcesses_v3"));
  if (!n.init || !n.handle || !n.memory || !n.procs || n.init() != NVML_SUCCESS || n.handle(0, &n.dev) != NVML_SUCCESS) {
    std::printf("error=nvml-init\n");
    return 2;
  }
  report(n, "baseline", -1);
  const pid_t child = fork();
  if (child == 0) {
    close(sv[0]);
    _exit(exporter(sv[1]));
  }
  close(sv[1]);
  const int fd = cushare::fdpass::recvFd(sv[0]);
  if (fd < 0) {
    int st = 0;
    waitpid(child, &st, 0);
    std::printf("error=exporter-failed status=%d\n", WIFEXITED(st) ? WEXITSTATUS(st) : -1);
    return 1;
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // NVML's view settles
  report(n, "exported", fd);
  (void)!write(sv[0], "exit", 4);
  int st = 0;
  waitpid(child, &st, 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  report(n, "orphaned", fd);
  close(fd);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  report(n, "closed", -1);
  return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : 1;
}
