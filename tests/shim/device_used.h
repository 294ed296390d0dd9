// The simulated device's own accounting, read straight from simgpu's shared state file (the
// count every simgpu process updates, which NVML and cuMemGetInfo report without the shim): the
// truth a memory limit is judged by. Needs SIMGPU_STATE_DIR (set by cushare_sim_test).
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "shared_state.h"

namespace cushare::test {

// Bytes in use on simulated host device dev (the host index, whatever ordinal a process sees it
// under), all processes together; UINT64_MAX if unreadable.
inline uint64_t deviceUsed(int dev) {
  const char* dir = std::getenv("SIMGPU_STATE_DIR");
  if (!dir) return UINT64_MAX;
  const int fd = ::open((std::string(dir) + "/state").c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return UINT64_MAX;
  void* p = mmap(nullptr, sizeof(simgpu::StateHeader), PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) return UINT64_MAX;
  const auto* h = static_cast<const simgpu::StateHeader*>(p);
  const uint64_t used = h->magic == simgpu::kStateMagic ? h->used[dev].load() : UINT64_MAX;
  munmap(p, sizeof(simgpu::StateHeader));
  return used;
}

}  // namespace cushare::test
