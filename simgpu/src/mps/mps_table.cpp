// See mps_table.h.
#include "mps_table.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace simgpu {
namespace {
constexpr size_t kFileSize = sizeof(MpsTableHeader) + sizeof(MpsClientEntry) * kMpsTableEntries;

bool alive(int32_t pid) { return pid > 0 && (kill(pid, 0) == 0 || errno != ESRCH); }
}  // namespace

MpsTable* MpsTable::open(const std::string& dir, std::string* error) {
  const std::string path = dir + "/mps-clients";
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666);
  if (fd < 0) {
    *error = "cannot open " + path + ": " + std::strerror(errno);
    return nullptr;
  }
  ::fchmod(fd, 0666);
  flock(fd, LOCK_EX);  // one initialiser; the lock goes with the descriptor
  struct stat st;
  bool ok = fstat(fd, &st) == 0;
  const bool fresh = ok && st.st_size == 0;
  if (fresh) ok = ftruncate(fd, static_cast<off_t>(kFileSize)) == 0;
  void* m = ok ? mmap(nullptr, kFileSize, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  if (m != MAP_FAILED && fresh) {
    auto* h = static_cast<MpsTableHeader*>(m);
    h->version = kMpsTableVersion;
    h->entry_count = kMpsTableEntries;
    h->file_size = kFileSize;
    h->magic = kMpsTableMagic;
  }
  flock(fd, LOCK_UN);  // explicitly: the mapping keeps the open file description (and its lock) alive
  ::close(fd);
  if (m == MAP_FAILED) {
    *error = "cannot map " + path + ": " + std::strerror(errno);
    return nullptr;
  }
  auto* h = static_cast<MpsTableHeader*>(m);
  if (static_cast<uint64_t>(st.st_size) != kFileSize && !fresh) {
    munmap(m, kFileSize);
    *error = path + " has another size: not a simgpu MPS table of version " + std::to_string(kMpsTableVersion);
    return nullptr;
  }
  if (h->magic != kMpsTableMagic || h->version != kMpsTableVersion || h->entry_count != kMpsTableEntries ||
      h->file_size != kFileSize) {
    munmap(m, kFileSize);
    *error = path + " is not a simgpu MPS table of version " + std::to_string(kMpsTableVersion);
    return nullptr;
  }
  auto* t = new MpsTable;
  t->hdr_ = h;
  t->entries_ = reinterpret_cast<MpsClientEntry*>(h + 1);
  return t;
}

MpsClientEntry* MpsTable::publish(const MpsClientEntry& e) {
  const int32_t self = static_cast<int32_t>(getpid());
  for (int i = 0; i < kMpsTableEntries; ++i) {
    MpsClientEntry& slot = entries_[i];
    int32_t seen = slot.pid.load(std::memory_order_acquire);
    if (seen < 0 || (seen > 0 && alive(seen))) continue;
    if (!slot.pid.compare_exchange_strong(seen, -self, std::memory_order_acq_rel)) continue;
    slot.server_pid = e.server_pid;
    slot.uid = e.uid;
    slot.sm_cap = e.sm_cap;
    slot.thread_pct_x10 = e.thread_pct_x10;
    slot.priority = e.priority;
    slot.state.store(e.state.load(std::memory_order_relaxed), std::memory_order_relaxed);
    std::memcpy(slot.pinned_limit, e.pinned_limit, sizeof slot.pinned_limit);
    slot.pid.store(self, std::memory_order_release);
    return &slot;
  }
  return nullptr;
}

void MpsTable::forEach(const std::function<void(const MpsClientEntry&)>& f) const {
  for (int i = 0; i < kMpsTableEntries; ++i)
    if (alive(entries_[i].pid.load(std::memory_order_acquire))) f(entries_[i]);
}

const MpsClientEntry* MpsTable::find(pid_t pid) const {
  for (int i = 0; i < kMpsTableEntries; ++i)
    if (entries_[i].pid.load(std::memory_order_acquire) == pid && alive(pid)) return &entries_[i];
  return nullptr;
}

}  // namespace simgpu
