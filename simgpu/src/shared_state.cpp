// Host-wide simulated device state; see shared_state.h for the invariants.
#include "shared_state.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <signal.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <mutex>

namespace simgpu {
namespace {

constexpr size_t kSlotsOffset = 4096;  // slots start on their own page
constexpr size_t kSharedOffset = kSlotsOffset + sizeof(ProcSlot) * kMaxSlots;
constexpr size_t kFileSize = kSharedOffset + sizeof(SharedAlloc) * kMaxShared;
// Lock bytes live past the end of the mapped data: OFD locks do not need the bytes to exist.
constexpr off_t kLockBase = 1 << 20;

static_assert(sizeof(StateHeader) <= kSlotsOffset);

std::string errnoText(const char* what, const std::string& path) {
  return std::string(what) + " " + path + ": " + std::strerror(errno);
}

// The pid NVML reports for this process. A real driver reports the host's pid whatever pid
// namespace (container) the process runs in; simgpu reports the pid the /proc mounted in the
// process shows for it (/proc/self names that pid): the host's when a process runs in a pid
// namespace of its own with the host's /proc (unshare --pid --fork), as tests of the broker's
// container handling do; getpid() otherwise.
int32_t reportedPid() {
  char buf[32];
  const ssize_t n = ::readlink("/proc/self", buf, sizeof(buf) - 1);
  if (n <= 0) return static_cast<int32_t>(getpid());
  buf[n] = '\0';
  const long v = std::strtol(buf, nullptr, 10);
  return v > 0 ? static_cast<int32_t>(v) : static_cast<int32_t>(getpid());
}

std::mutex& claimMutex() {
  static std::mutex* m = new std::mutex;  // leaked: used until the very end of the process
  return *m;
}

}  // namespace

bool SharedState::tryLockSlot(int i, int fd) {
  struct flock fl = {};
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = kLockBase + i;
  fl.l_len = 1;
  return fcntl(fd, F_OFD_SETLK, &fl) == 0;
}

void SharedState::unlockSlot(int i, int fd) {
  struct flock fl = {};
  fl.l_type = F_UNLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = kLockBase + i;
  fl.l_len = 1;
  fcntl(fd, F_OFD_SETLK, &fl);
}

SharedState* SharedState::open(const std::string& dir, int deviceCount, const uint64_t* capacity,
                               uint32_t smCount, std::string* error) {
  // Parents first (mkdir -p); only the state directory itself is opened to every user.
  for (size_t i = 1; i < dir.size(); ++i)
    if (dir[i] == '/') ::mkdir(dir.substr(0, i).c_str(), 0755);
  if (::mkdir(dir.c_str(), 01777) == 0) {
    ::chmod(dir.c_str(), 01777);  // every user of the host shares the device, as on real hardware
  } else if (errno != EEXIST) {
    *error = errnoText("cannot create SIMGPU_STATE_DIR", dir);
    return nullptr;
  }
  auto* s = new SharedState;
  s->path_ = dir + "/state";
  int fd = ::open(s->path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666);
  if (fd < 0) {
    *error = errnoText("cannot open", s->path_);
    delete s;
    return nullptr;
  }
  ::fchmod(fd, 0666);
  // Initialisation is serialised with flock; the magic is written last so a reader never sees a
  // half-initialised header.
  flock(fd, LOCK_EX);
  struct stat st;
  fstat(fd, &st);
  bool fresh = st.st_size == 0;
  if (fresh && ftruncate(fd, kFileSize) != 0) {
    *error = errnoText("cannot size", s->path_);
    flock(fd, LOCK_UN);
    ::close(fd);
    delete s;
    return nullptr;
  }
  if (!fresh && static_cast<size_t>(st.st_size) != kFileSize) {
    *error = s->path_ + " has size " + std::to_string(st.st_size) + ", expected " +
             std::to_string(kFileSize) + " (another simgpu version?); remove it when no simgpu process runs";
    flock(fd, LOCK_UN);
    ::close(fd);
    delete s;
    return nullptr;
  }
  void* p = mmap(nullptr, kFileSize, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    *error = errnoText("cannot map", s->path_);
    flock(fd, LOCK_UN);
    ::close(fd);
    delete s;
    return nullptr;
  }
  s->hdr_ = static_cast<StateHeader*>(p);
  s->slots_ = reinterpret_cast<ProcSlot*>(static_cast<char*>(p) + kSlotsOffset);
  s->shared_ = reinterpret_cast<SharedAlloc*>(static_cast<char*>(p) + kSharedOffset);
  s->dir_ = dir;
  StateHeader* h = s->hdr_;
  if (fresh || h->magic == 0) {
    h->version = kStateVersion;
    h->header_size = sizeof(StateHeader);
    h->file_size = kFileSize;
    h->device_count = static_cast<uint32_t>(deviceCount);
    h->slot_count = kMaxSlots;
    h->sm_count = smCount;
    for (int d = 0; d < kMaxDevices; ++d) {
      h->capacity[d] = d < deviceCount ? capacity[d] : 0;
      pthread_mutexattr_t attr;
      pthread_mutexattr_init(&attr);
      pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
      pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
      pthread_mutex_init(&h->lock[d], &attr);
      pthread_mutexattr_destroy(&attr);
    }
    std::atomic_thread_fence(std::memory_order_release);
    h->magic = kStateMagic;
  }
  std::string why;
  if (h->magic != kStateMagic)
    why = "bad magic";
  else if (h->version != kStateVersion)
    why = "layout version " + std::to_string(h->version) + ", this simgpu uses " + std::to_string(kStateVersion);
  else if (h->header_size != sizeof(StateHeader) || h->file_size != kFileSize)
    why = "header or file size differs from this simgpu build";
  const bool layout = !why.empty();  // a layout problem, as opposed to a configuration mismatch
  if (layout)
    ;
  else if (h->device_count != static_cast<uint32_t>(deviceCount) || h->sm_count != smCount)
    why = "it was created for " + std::to_string(h->device_count) + " device(s) with " +
          std::to_string(h->sm_count) + " SMs, this process asks for " + std::to_string(deviceCount) +
          " with " + std::to_string(smCount);
  else
    for (int d = 0; d < deviceCount; ++d)
      if (h->capacity[d] != capacity[d])
        why = "device " + std::to_string(d) + " was created with " + std::to_string(h->capacity[d]) +
              " bytes, this process asks for " + std::to_string(capacity[d]);
  flock(fd, LOCK_UN);
  if (!why.empty()) {
    *error = "simgpu state " + s->path_ + ": " + why +
             (layout ? " (written by another simgpu version: remove the file when no simgpu process runs)"
                     : " (all processes sharing SIMGPU_STATE_DIR need the same SIMGPU_DEVICES, SIMGPU_MEMORY and SIMGPU_SMS)");
    munmap(p, kFileSize);
    ::close(fd);
    delete s;
    return nullptr;
  }
  s->fd_ = fd;
  s->fdPid_ = getpid();
  registerForFork(s);
  return s;
}

void SharedState::lockDevice(int dev) {
  const int r = pthread_mutex_lock(&hdr_->lock[dev]);
  if (r == EOWNERDEAD) {
    // Its owner died inside the critical section, possibly between the slot and header updates:
    // the slots are the truth, rebuild the total from them.
    uint64_t sum = 0;
    for (int i = 0; i < kMaxSlots; ++i) sum += slots_[i].used[dev].load(std::memory_order_acquire);
    for (int i = 0; i < kMaxShared; ++i)
      if (const uint64_t id = shared_[i].id.load(std::memory_order_acquire); id && id != UINT64_MAX && shared_[i].device == dev)
        sum += shared_[i].bytes;  // counted entries (a claimed one, UINT64_MAX, is not counted yet)
    hdr_->used[dev].store(sum, std::memory_order_release);
    pthread_mutex_consistent(&hdr_->lock[dev]);
  }
}

void SharedState::unlockDevice(int dev) { pthread_mutex_unlock(&hdr_->lock[dev]); }

bool SharedState::reapSlot(int i) {
  // Only called with the slot's lock held by us (through fd_): the owner is dead.
  ProcSlot& sl = slots_[i];
  bool returned = false;
  for (int d = 0; d < static_cast<int>(hdr_->device_count); ++d) {
    if (sl.used[d].load(std::memory_order_acquire) == 0) continue;
    lockDevice(d);
    const uint64_t u = sl.used[d].load(std::memory_order_acquire);
    hdr_->used[d].fetch_sub(u, std::memory_order_acq_rel);
    sl.used[d].store(0, std::memory_order_release);
    sl.managed[d].store(0, std::memory_order_release);
    unlockDevice(d);
    returned |= u != 0;
  }
  for (int d = 0; d < kMaxDevices; ++d) {
    sl.managed[d].store(0, std::memory_order_release);
    sl.evicted[d].store(0, std::memory_order_release);
    sl.oldestIn[d].store(UINT64_MAX, std::memory_order_release);
  }
  sl.contexts.store(0, std::memory_order_release);
  sl.mig.store(0, std::memory_order_release);
  sl.pid.store(0, std::memory_order_release);
  return returned;
}

namespace {
// Every SharedState of the process (the driver's and NVML's), for the fork handler.
constexpr int kMaxInstances = 8;
std::atomic<SharedState*> gInstances[kMaxInstances];
}  // namespace

void SharedState::registerForFork(SharedState* s) {
  static const int once = pthread_atfork(nullptr, nullptr, [] {
    for (auto& slot : gInstances)
      if (SharedState* st = slot.load()) st->dropInheritedLockFd();
  });
  (void)once;
  for (auto& slot : gInstances) {
    SharedState* expected = nullptr;
    if (slot.compare_exchange_strong(expected, s)) return;
  }
}

void SharedState::dropInheritedLockFd() {
  // In a forked child: the inherited descriptor shares the parent's open file description, and
  // an OFD lock lasts while any descriptor of it is open. Keeping it would keep the parent's slot
  // "alive" after the parent dies (kill -9 included) for as long as this child lives, and its
  // memory would never be returned. The child opens its own description when it needs one.
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

int SharedState::ownFd() {
  // Caller holds claimMutex(). A forked child must not lock through its parent's open file
  // description (that would look like owning the parent's slot): it opens the file again to get a
  // description (and later a slot) of its own.
  const int pid = getpid();
  if (fdPid_ != pid) {
    if (fd_ >= 0) ::close(fd_);  // the parent's description, if the fork handler did not run
    int fd = ::open(path_.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) return -1;
    fd_ = fd;
    fdPid_ = pid;
    slot_ = -1;
  }
  return fd_;
}

bool SharedState::claimSlot() {
  // Caller holds claimMutex().
  if (ownFd() < 0) return false;
  if (slot_ >= 0) return true;
  const int32_t pid = reportedPid();
  for (int i = 0; i < kMaxSlots; ++i) {
    if (!tryLockSlot(i, fd_)) continue;
    reapSlot(i);  // a dead owner's leftovers, if any
    for (uint64_t& e : settled_) e = 0;
    slots_[i].mig.store(migTag_, std::memory_order_release);
    slots_[i].pid.store(pid, std::memory_order_release);
    slot_ = i;
    return true;
  }
  return false;
}

bool SharedState::setContext(int dev, bool on) {
  std::lock_guard<std::mutex> g(claimMutex());
  if (!claimSlot()) return false;
  const uint32_t bit = 1u << dev;
  if (on)
    slots_[slot_].contexts.fetch_or(bit, std::memory_order_acq_rel);
  else
    slots_[slot_].contexts.fetch_and(~bit, std::memory_order_acq_rel);
  return true;
}

uint64_t SharedState::shortfallLocked(int dev, uint64_t bytes) const {
  const uint64_t cap = hdr_->capacity[dev];
  const uint64_t cur = hdr_->used[dev].load(std::memory_order_relaxed);
  uint64_t need = bytes > cap ? UINT64_MAX : (cur > cap - bytes ? cur - (cap - bytes) : 0);
  if (migTag_ != 0 && static_cast<int>(migTag_ & 0xff) == dev + 1) {
    // And within the GPU instance (the slots are the truth; under dev's lock).
    const uint64_t inst = instanceUsedLocked(dev, ((migTag_ >> 8) & 0xff) - 1);
    const uint64_t inInstance =
        bytes > giCapacity_ ? UINT64_MAX : (inst > giCapacity_ - bytes ? inst - (giCapacity_ - bytes) : 0);
    need = std::max(need, inInstance);
  }
  return need;
}

// Whether a process of MIG tag `tag` shares this process's memory on dev: the same GPU instance
// inside a MIG device, else the whole GPU (not a MIG device of it).
bool SharedState::sameMemory(uint32_t tag, int dev) const {
  const bool mineInMig = migTag_ != 0 && static_cast<int>(migTag_ & 0xff) == dev + 1;
  const bool itsInMig = tag != 0 && static_cast<int>(tag & 0xff) == dev + 1;
  if (mineInMig) return itsInMig && (tag & 0xffff) == (migTag_ & 0xffff);
  return !itsInMig;
}

bool SharedState::evictLocked(int dev, uint64_t need) {
  if (need == 0) return true;
  if (need == UINT64_MAX) return false;
  struct Victim {
    uint64_t oldest;
    int slot;
  };
  Victim victims[kMaxSlots];
  int n = 0;
  uint64_t evictable = 0;
  for (int i = 0; i < kMaxSlots; ++i) {
    if (slots_[i].pid.load(std::memory_order_acquire) == 0) continue;
    const uint64_t m = slots_[i].managed[dev].load(std::memory_order_acquire);
    if (m == 0 || !sameMemory(slots_[i].mig.load(std::memory_order_acquire), dev)) continue;
    victims[n++] = {slots_[i].oldestIn[dev].load(std::memory_order_acquire), i};
    evictable += m;
  }
  if (evictable < need) return false;  // never half: a failed allocation moves nothing
  std::sort(victims, victims + n, [](const Victim& a, const Victim& b) { return a.oldest < b.oldest; });
  for (int k = 0; k < n && need > 0; ++k) {
    ProcSlot& sl = slots_[victims[k].slot];
    const uint64_t m = sl.managed[dev].load(std::memory_order_acquire);
    const uint64_t t = std::min(m, need);
    // used before managed: NVML's per-process figure (used - managed, read without the lock)
    // never shows resident managed memory as ordinary, not even for an instant.
    sl.used[dev].fetch_sub(t, std::memory_order_acq_rel);
    sl.managed[dev].store(m - t, std::memory_order_release);
    sl.evicted[dev].fetch_add(t, std::memory_order_acq_rel);
    hdr_->used[dev].fetch_sub(t, std::memory_order_acq_rel);
    hdr_->evicted_out[dev].fetch_add(t, std::memory_order_acq_rel);
    need -= t;
  }
  return true;
}

bool SharedState::reserve(int dev, uint64_t bytes) {
  {
    std::lock_guard<std::mutex> g(claimMutex());
    if (!claimSlot()) return false;
  }
  for (int attempt = 0; attempt < 2; ++attempt) {
    lockDevice(dev);
    const bool fits = evictLocked(dev, shortfallLocked(dev, bytes));
    if (fits) {
      slots_[slot_].used[dev].fetch_add(bytes, std::memory_order_acq_rel);
      hdr_->used[dev].fetch_add(bytes, std::memory_order_acq_rel);
    }
    unlockDevice(dev);
    if (fits) return true;
    if (!reap()) return false;  // nothing came back: the device really is full
  }
  return false;
}

void SharedState::settleLocked(int dev, const ManagedOwner& owner) {
  ProcSlot& sl = slots_[slot_];
  const uint64_t ev = sl.evicted[dev].load(std::memory_order_acquire);
  const uint64_t delta = ev - settled_[dev];
  settled_[dev] = ev;
  if (delta != 0) {
    const uint64_t dropped = owner.dropOldest(delta);
    if (dropped > delta) {  // whole chunks went: the part the evictor did not take is returned now
      const uint64_t extra = std::min(dropped - delta, sl.managed[dev].load(std::memory_order_acquire));
      sl.used[dev].fetch_sub(extra, std::memory_order_acq_rel);  // used first (see evictLocked)
      sl.managed[dev].fetch_sub(extra, std::memory_order_acq_rel);
      hdr_->used[dev].fetch_sub(extra, std::memory_order_acq_rel);
      hdr_->evicted_out[dev].fetch_add(extra, std::memory_order_acq_rel);
    }
  }
  sl.oldestIn[dev].store(owner.oldest(), std::memory_order_release);
}

bool SharedState::makeResident(int dev, uint64_t bytes, const ManagedOwner& owner, uint64_t* seq) {
  {
    std::lock_guard<std::mutex> g(claimMutex());
    if (!claimSlot()) return false;
  }
  for (int attempt = 0; attempt < 2; ++attempt) {
    lockDevice(dev);
    settleLocked(dev, owner);
    const bool fits = evictLocked(dev, shortfallLocked(dev, bytes));
    if (fits) {
      settleLocked(dev, owner);  // this process's own chunks may have gone to make room
      ProcSlot& sl = slots_[slot_];
      sl.managed[dev].fetch_add(bytes, std::memory_order_acq_rel);
      sl.used[dev].fetch_add(bytes, std::memory_order_acq_rel);
      hdr_->used[dev].fetch_add(bytes, std::memory_order_acq_rel);
      hdr_->migrated_in[dev].fetch_add(bytes, std::memory_order_acq_rel);
      *seq = hdr_->migrate_seq.fetch_add(1, std::memory_order_acq_rel) + 1;
      sl.oldestIn[dev].store(std::min(owner.oldest(), *seq), std::memory_order_release);
    }
    unlockDevice(dev);
    if (fits) return true;
    if (!reap()) return false;
  }
  return false;
}

void SharedState::dropResident(int dev, const ManagedOwner& owner, const std::function<uint64_t()>& change) {
  if (slot_ < 0 || fdPid_ != getpid()) return;
  lockDevice(dev);
  settleLocked(dev, owner);
  ProcSlot& sl = slots_[slot_];
  const uint64_t gone = std::min(change(), sl.managed[dev].load(std::memory_order_acquire));
  sl.used[dev].fetch_sub(gone, std::memory_order_acq_rel);  // used first (see evictLocked)
  sl.managed[dev].fetch_sub(gone, std::memory_order_acq_rel);
  hdr_->used[dev].fetch_sub(gone, std::memory_order_acq_rel);
  sl.oldestIn[dev].store(owner.oldest(), std::memory_order_release);
  unlockDevice(dev);
}

void SharedState::settleManaged(int dev, const ManagedOwner& owner) {
  if (slot_ < 0 || fdPid_ != getpid()) return;
  lockDevice(dev);
  settleLocked(dev, owner);
  unlockDevice(dev);
}

void SharedState::release(int dev, uint64_t bytes) {
  if (slot_ < 0 || fdPid_ != getpid()) return;  // memory inherited through fork belongs to the parent
  lockDevice(dev);
  slots_[slot_].used[dev].fetch_sub(bytes, std::memory_order_acq_rel);
  hdr_->used[dev].fetch_sub(bytes, std::memory_order_acq_rel);
  unlockDevice(dev);
}

bool SharedState::reap() {
  std::lock_guard<std::mutex> g(claimMutex());
  const int fd = ownFd();
  if (fd < 0) return false;
  bool returned = false;
  for (int i = 0; i < kMaxSlots; ++i) {
    if (i == slot_) continue;
    if (slots_[i].pid.load(std::memory_order_acquire) == 0) continue;
    if (!tryLockSlot(i, fd)) continue;  // alive
    returned |= reapSlot(i);
    unlockSlot(i, fd);
  }
  if (hdr_->next_shared_id.load(std::memory_order_acquire) != 0)  // shareable memory ever made
    for (int i = 0; i < kMaxShared; ++i) returned |= reapSharedEntry(i);
  if (returned) hdr_->generation.fetch_add(1, std::memory_order_acq_rel);
  return returned;
}

// ---- shareable memory ----
namespace {
bool lockByte0(int fd, short type) {
  struct flock fl = {};
  fl.l_type = type;
  fl.l_whence = SEEK_SET;
  fl.l_start = 0;
  fl.l_len = 1;
  return fcntl(fd, F_OFD_SETLK, &fl) == 0;
}
constexpr char kSharedPrefix[] = "/vmm-";
}  // namespace

std::string SharedState::sharedPath(uint64_t id) const { return dir_ + kSharedPrefix + std::to_string(id); }

int SharedState::reserveShared(int dev, uint64_t bytes, uint64_t* id) {
  {
    std::lock_guard<std::mutex> g(claimMutex());
    if (!claimSlot()) return -1;  // the process is listed (processes()) while it lives
  }
  int slot = -1;
  for (int i = 0; i < kMaxShared && slot < 0; ++i) {
    uint64_t expected = 0;
    // A placeholder id claims the entry before it is counted (never matched by reapers: not ready).
    if (shared_[i].id.compare_exchange_strong(expected, UINT64_MAX, std::memory_order_acq_rel)) slot = i;
  }
  if (slot < 0) return -1;
  SharedAlloc& e = shared_[slot];
  e.ready.store(0, std::memory_order_release);
  e.device = dev;
  e.creator = getpid();
  e.bytes = bytes;
  const uint64_t newId = hdr_->next_shared_id.fetch_add(1, std::memory_order_acq_rel) + 1;
  bool fits = false;
  for (int attempt = 0; attempt < 2 && !fits; ++attempt) {
    lockDevice(dev);
    const uint64_t cur = hdr_->used[dev].load(std::memory_order_relaxed);
    fits = bytes <= hdr_->capacity[dev] && cur <= hdr_->capacity[dev] - bytes;
    if (fits) {
      hdr_->used[dev].store(cur + bytes, std::memory_order_release);
      e.id.store(newId, std::memory_order_release);  // counted: an EOWNERDEAD rebuild sees it
    }
    unlockDevice(dev);
    if (!fits && !reap()) break;
  }
  if (!fits) {
    e.id.store(0, std::memory_order_release);
    return -1;
  }
  const std::string path = sharedPath(newId);
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  if (fd < 0 || ::fchmod(fd, 0666) != 0 || ftruncate(fd, static_cast<off_t>(bytes)) != 0 || !lockByte0(fd, F_RDLCK)) {
    if (fd >= 0) {
      ::close(fd);
      ::unlink(path.c_str());
    }
    lockDevice(dev);
    hdr_->used[dev].fetch_sub(bytes, std::memory_order_acq_rel);
    e.id.store(0, std::memory_order_release);
    unlockDevice(dev);
    return -1;
  }
  e.ready.store(1, std::memory_order_release);
  *id = newId;
  return fd;
}

int SharedState::openShared(int fd, uint64_t* id, int* dev) {
  char link[64], target[4096];
  std::snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  const ssize_t n = readlink(link, target, sizeof target - 1);
  if (n <= 0) return -1;
  target[n] = 0;
  const std::string t(target);
  const std::string prefix = dir_ + kSharedPrefix;
  if (t.compare(0, prefix.size(), prefix) != 0) return -1;
  const uint64_t want = std::strtoull(t.c_str() + prefix.size(), nullptr, 10);
  for (int i = 0; i < kMaxShared; ++i) {
    if (shared_[i].id.load(std::memory_order_acquire) != want || !want) continue;
    const int own = ::open(link, O_RDWR | O_CLOEXEC);  // a new open file description
    if (own < 0) return -1;
    if (!lockByte0(own, F_RDLCK)) {
      ::close(own);
      return -1;
    }
    *id = want;
    *dev = shared_[i].device;
    return own;
  }
  return -1;
}

bool SharedState::reapSharedEntry(int i) {
  SharedAlloc& e = shared_[i];
  const uint64_t id = e.id.load(std::memory_order_acquire);
  if (id == 0 || id == UINT64_MAX) return false;
  if (!e.ready.load(std::memory_order_acquire)) {
    // Counted but not yet published: only a creator that died in between leaves it so.
    if (::kill(e.creator, 0) == 0 || errno != ESRCH) return false;
  } else {
    const int fd = ::open(sharedPath(id).c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) return false;  // being removed by another reaper
    const bool unreferenced = lockByte0(fd, F_WRLCK);
    if (unreferenced) ::unlink(sharedPath(id).c_str());
    ::close(fd);
    if (!unreferenced) return false;
  }
  // Returned exactly once: the entry is freed and uncounted in one step under the device lock.
  const int dev = e.device;
  lockDevice(dev);
  const bool mine = e.id.load(std::memory_order_acquire) == id;
  if (mine) {
    hdr_->used[dev].fetch_sub(e.bytes, std::memory_order_acq_rel);
    e.id.store(0, std::memory_order_release);
  }
  unlockDevice(dev);
  return mine;
}

bool SharedState::reapShared(uint64_t id) {
  for (int i = 0; i < kMaxShared; ++i)
    if (shared_[i].id.load(std::memory_order_acquire) == id) return reapSharedEntry(i);
  return false;
}

bool SharedState::enterMig(int dev, unsigned gi, unsigned ci, uint64_t giCapacity) {
  std::lock_guard<std::mutex> g(claimMutex());
  migTag_ = static_cast<uint32_t>(dev + 1) | (gi + 1) << 8 | (ci + 1) << 16;
  giCapacity_ = giCapacity;
  if (!claimSlot()) return false;
  slots_[slot_].mig.store(migTag_, std::memory_order_release);
  return true;
}

void SharedState::leaveMig() {
  std::lock_guard<std::mutex> g(claimMutex());
  migTag_ = 0;
  if (slot_ >= 0) slots_[slot_].mig.store(0, std::memory_order_release);
}

bool SharedState::instanceInUse(int dev, unsigned gi, unsigned ci) {
  reap();
  const uint32_t want = static_cast<uint32_t>(dev + 1) | (gi + 1) << 8 | (ci == ~0u ? 0 : (ci + 1) << 16);
  const uint32_t mask = ci == ~0u ? 0xffffu : 0xffffffu;
  for (int i = 0; i < kMaxSlots; ++i)
    if (slots_[i].pid.load(std::memory_order_acquire) != 0 && (slots_[i].mig.load(std::memory_order_acquire) & mask) == want)
      return true;
  return false;
}

uint64_t SharedState::instanceUsedLocked(int dev, unsigned gi) const {
  const uint32_t want = static_cast<uint32_t>(dev + 1) | (gi + 1) << 8;
  uint64_t sum = 0;
  for (int i = 0; i < kMaxSlots; ++i)
    if ((slots_[i].mig.load(std::memory_order_acquire) & 0xffff) == want)
      sum += slots_[i].used[dev].load(std::memory_order_acquire);
  return sum;
}

uint64_t SharedState::instanceUsed(int dev, unsigned gi) {
  lockDevice(dev);
  const uint64_t u = instanceUsedLocked(dev, gi);
  unlockDevice(dev);
  return u;
}

int SharedState::processes(int dev, ProcUsage* out, int max, int* total) {
  reap();
  int n = 0, t = 0;
  for (int i = 0; i < kMaxSlots; ++i) {
    const int32_t pid = slots_[i].pid.load(std::memory_order_acquire);
    if (pid == 0) continue;
    // NVML's per-process figure leaves managed memory out (resident or not), as the real one.
    const uint64_t all = slots_[i].used[dev].load(std::memory_order_acquire);
    const uint64_t managed = slots_[i].managed[dev].load(std::memory_order_acquire);
    uint64_t u = all - std::min(all, managed);
    // Shareable memory is the process's that made it, while that process lives.
    for (int k = 0; k < kMaxShared && hdr_->next_shared_id.load(std::memory_order_acquire); ++k) {
      const uint64_t id = shared_[k].id.load(std::memory_order_acquire);
      if (id && id != UINT64_MAX && shared_[k].device == dev && shared_[k].creator == pid) u += shared_[k].bytes;
    }
    const bool context = (slots_[i].contexts.load(std::memory_order_acquire) >> dev) & 1u;
    if (u == 0 && !context) continue;
    ++t;
    ProcUsage p{pid, u, 0xFFFFFFFFu, 0xFFFFFFFFu};
    const uint32_t tag = slots_[i].mig.load(std::memory_order_acquire);
    if (tag != 0 && static_cast<int>(tag & 0xff) == dev + 1) {
      p.gi = ((tag >> 8) & 0xff) - 1;
      p.ci = ((tag >> 16) & 0xff) - 1;
    }
    if (n < max) out[n++] = p;
  }
  if (total) *total = t;
  return n;
}

}  // namespace simgpu
