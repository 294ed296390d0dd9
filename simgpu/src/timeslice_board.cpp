// The time-slice board's file (see timeslice_board.h).
#include "timeslice_board.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

namespace simgpu {

bool pidAlive(int32_t pid) { return pid > 0 && (kill(pid, 0) == 0 || errno == EPERM); }

Board* openBoard(const std::string& dir, int dev, std::string* error) {
  const std::string path = dir + "/timeslice-" + std::to_string(dev);
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666);
  if (fd < 0) {
    *error = "cannot open " + path + ": " + std::strerror(errno);
    return nullptr;
  }
  fchmod(fd, 0666);  // shared by every user of the simulated host, like the state file
  struct stat st {};
  // Growing a file to its size is idempotent: racing creators all see zeros, then one magic.
  if (fstat(fd, &st) != 0 || (st.st_size < static_cast<off_t>(sizeof(Board)) && ftruncate(fd, sizeof(Board)) != 0)) {
    *error = "cannot size " + path + ": " + std::strerror(errno);
    close(fd);
    return nullptr;
  }
  void* p = mmap(nullptr, sizeof(Board), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    *error = "cannot map " + path + ": " + std::strerror(errno);
    return nullptr;
  }
  auto* b = static_cast<Board*>(p);
  uint64_t zero = 0;
  if (b->magic.load(std::memory_order_acquire) == 0) {
    b->version = kBoardVersion;
    b->slots = kBoardSlots;
    b->magic.compare_exchange_strong(zero, kBoardMagic, std::memory_order_acq_rel);
  }
  if (b->magic.load(std::memory_order_acquire) != kBoardMagic || b->version != kBoardVersion) {
    *error = path + " has another layout (an older simgpu?): remove the state directory";
    munmap(p, sizeof(Board));
    return nullptr;
  }
  return b;
}

}  // namespace simgpu
