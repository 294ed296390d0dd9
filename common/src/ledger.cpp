// The tenant ledger (see ledger.h for the contract, ledger_abi.h for the layout).
//
// Why reserve() is exact without a lock between processes ("announce, then validate"):
// every access to used[][] and slot_hwm is a sequentially consistent atomic, so all of them fall
// into one total order S. A reservation r of b bytes on device d by slot s
//   (1) adds b to used[d][s]          (announce: from now on every sum sees r's intent),
//   (2) loads slot_hwm, then loads used[d][0..hwm) and sums them,
//   (3) keeps r if the sum <= limit, else subtracts b again (retract).
// Take any moment t and the reservations held at t (passed (3), not yet released). Let r* be the
// one whose (1) comes last in S. Every other held r did its (1) before r*'s (1), and does not
// subtract its bytes before t, which is after r*'s loads; its slot was claimed, and slot_hwm raised
// past it, before its (1). So r*'s loads in (2) saw slot_hwm covering every slot involved and
// counters that include every held reservation's bytes: the sum r* checked is >= the total held
// at t, and r* was kept, so the total held at t <= limit. Intents that are later retracted only
// make sums larger (a reservation may be refused spuriously, never granted wrongly), and
// releases and reaping only lower counters. Of two concurrent reservers, the later to announce
// sees both intents.
// Why kill -9 is exact: the counters are the only truth (there is no separate total to update in
// a second step), so a process killed at any instant leaves in its slot exactly what it holds,
// its in-flight intent included. The kernel drops the dead process's OFD lock on its slot byte;
// whoever takes that lock next zeroes the slot. The lock is exclusive, so that happens once, and
// nobody can claim the slot while it is being zeroed.
#include "cushare/ledger.h"
#include "cushare/limits_file.h"

#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>

#include "cushare/atomic_file.h"

namespace cushare {
namespace {

constexpr auto kSeq = std::memory_order_seq_cst;

// Every Ledger of the process (an intrusive list through prev_/next_), so the atfork child handler
// can drop the inherited descriptors. Guarded by a spin lock that the prepare handler holds across
// fork (jemalloc's prefork idiom), so the child never sees the list half-changed. Constant-
// initialised and trivially destructible: no static destructors.
constinit std::atomic<bool> gRegistryLock{false};
constinit Ledger* gFirstLedger = nullptr;

void registryLock() noexcept {
  while (gRegistryLock.exchange(true, std::memory_order_acquire)) ::sched_yield();
}
void registryUnlock() noexcept { gRegistryLock.store(false, std::memory_order_release); }

// A reservation refused only because of others' in-flight intents gets this many more tries.
constexpr int kTransientRetries = 3;

std::string errnoText(const std::string& what, int err) {
  std::string s = what + ": " + std::strerror(err);
  if (err == EACCES || err == EPERM)
    s += " (a ledger belongs to its tenant's user or group: run the process as that user, or, "
         "with a broker, as the uid/gid its configuration gives the tenant)";
  return s;
}

void cpuRelax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

int flockRetry(int fd, int op) noexcept {
  int r;
  do r = ::flock(fd, op);
  while (r != 0 && errno == EINTR);
  return r;
}

// The exclusive flock of the init path. A tenant process holds it for microseconds; an observer
// (the broker, which serves every tenant) never waits on it, since a hostile process of a tenant
// could hold it forever: it tries once and fails with EWOULDBLOCK (*busy set), and the broker waits
// for the lock, bounded, outside its own lock (Broker::tick), before trying again.
int flockExclusive(int fd, bool observer, bool* busy) noexcept {
  if (!observer) return flockRetry(fd, LOCK_EX);
  const int r = flockRetry(fd, LOCK_EX | LOCK_NB);
  if (r != 0 && errno == EWOULDBLOCK && busy != nullptr) *busy = true;
  return r;
}

}  // namespace

int mappedFileOf(int pid, const FileId* files, size_t n) noexcept {
  if (pid <= 0) return -1;
  char path[40];
  std::snprintf(path, sizeof(path), "/proc/%d/maps", pid);
  FILE* f = std::fopen(path, "re");
  if (f == nullptr) return -1;
  char line[512];
  int found = -1;
  while (found < 0 && std::fgets(line, sizeof(line), f) != nullptr) {
    unsigned major = 0, minor = 0;
    unsigned long long inode = 0;
    // address perms offset major:minor inode [path]
    if (std::sscanf(line, "%*s %*s %*s %x:%x %llu", &major, &minor, &inode) == 3 && inode != 0)
      for (size_t i = 0; found < 0 && i < n; ++i)
        if (files[i].ino == inode && files[i].dev == makedev(major, minor)) found = static_cast<int>(i);
    // The rest of a line longer than the buffer (a long path): skip it.
    while (std::strchr(line, '\n') == nullptr && std::fgets(line, sizeof(line), f) != nullptr) {
    }
  }
  std::fclose(f);
  return found;
}

namespace {

// A slot whose lock is free but whose process still maps the ledger belongs to a live process
// that closed its descriptor (by mistake, or to have its usage reaped while it keeps the memory):
// never reaped. A dead process (or a zombie) maps nothing.
bool mapsFile(int32_t pid, uint64_t dev, uint64_t ino) noexcept {
  const FileId id{dev, ino};
  return mappedFileOf(pid, &id, 1) == 0;
}

// A record lock of the one byte at `byte` (all the ledger's locks are one byte past the end).
struct flock byteLock(short type, int64_t byte) noexcept {
  struct flock fl = {};
  fl.l_type = type;
  fl.l_whence = SEEK_SET;
  fl.l_start = byte;
  fl.l_len = 1;
  return fl;
}

// 1: we hold slot's lock now (through fd's open file description); 0: another description holds
// it; -1: error (errno set), e.g. a filesystem or kernel without OFD locks.
int tryLockSlot(int fd, uint32_t slot) noexcept {
  struct flock fl = byteLock(F_WRLCK, kLedgerSlotLockBase + slot);
  int r;
  do r = ::fcntl(fd, F_OFD_SETLK, &fl);
  while (r != 0 && errno == EINTR);
  if (r == 0) return 1;
  return errno == EAGAIN || errno == EACCES ? 0 : -1;
}

// The POSIX lock that names slot's holder (see kLedgerSlotPidLockBase). Best effort: without it
// the broker reports the slot's pid as unverified, nothing else changes.
void lockSlotPid(int fd, uint32_t slot) noexcept {
  struct flock fl = byteLock(F_WRLCK, kLedgerSlotPidLockBase + slot);
  while (::fcntl(fd, F_SETLK, &fl) != 0 && errno == EINTR) {
  }
}

void unlockSlot(int fd, uint32_t slot) noexcept {
  struct flock fl = byteLock(F_UNLCK, kLedgerSlotLockBase + slot);
  ::fcntl(fd, F_OFD_SETLK, &fl);
}

template <class T>
T fieldAt(const unsigned char* raw, size_t offset) {
  T v;
  std::memcpy(&v, raw + offset, sizeof(v));
  return v;
}

std::string printable(const char* s, size_t n) {
  std::string out;
  for (size_t i = 0; i < n && s[i] != '\0'; ++i) out += (s[i] >= 0x20 && s[i] < 0x7f) ? s[i] : '?';
  return out;
}

std::string hex64(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "0x%016" PRIx64, v);
  return buf;
}

// Checks an existing header (read with pread, never mapped before it passed). Returns "" or the
// reason, naming the field.
std::string checkHeader(const unsigned char* raw, uint64_t fileBytes, const std::string& tenant) {
  auto u32 = [&](size_t off) { return fieldAt<uint32_t>(raw, off); };
  auto u64 = [&](size_t off) { return fieldAt<uint64_t>(raw, off); };
  auto mismatch = [](const char* field, uint64_t got, uint64_t want) {
    return std::string("field '") + field + "' is " + std::to_string(got) + ", expected " +
           std::to_string(want);
  };
  if (const uint64_t m = u64(offsetof(LedgerHeader, magic)); m != kLedgerMagic)
    return "field 'magic' is " + hex64(m) + ", expected " + hex64(kLedgerMagic) +
           " (\"CUSHLDG\"): not a cushare ledger";
  if (const uint32_t v = u32(offsetof(LedgerHeader, version)); v != kLedgerVersion)
    return mismatch("version", v, kLedgerVersion) + " (this cushare reads layout version " +
           std::to_string(kLedgerVersion) + " only)";
  if (const uint32_t v = u32(offsetof(LedgerHeader, header_size)); v != sizeof(LedgerHeader))
    return mismatch("header_size", v, sizeof(LedgerHeader));
  if (const uint64_t v = u64(offsetof(LedgerHeader, file_size)); v != kLedgerFileSize)
    return mismatch("file_size", v, kLedgerFileSize);
  if (fileBytes != kLedgerFileSize)
    return "field 'file_size' says " + std::to_string(kLedgerFileSize) +
           " bytes but the file has " + std::to_string(fileBytes) + " (truncated or extended)";
  if (const uint32_t v = u32(offsetof(LedgerHeader, max_devices)); v != kLedgerMaxDevices)
    return mismatch("max_devices", v, kLedgerMaxDevices);
  if (const uint32_t v = u32(offsetof(LedgerHeader, max_slots)); v != kLedgerMaxSlots)
    return mismatch("max_slots", v, kLedgerMaxSlots);
  const char* name = reinterpret_cast<const char*>(raw + offsetof(LedgerHeader, tenant));
  if (std::memchr(name, '\0', kLedgerTenantBytes) == nullptr || tenant != name)
    return "field 'tenant' is \"" + printable(name, kLedgerTenantBytes) + "\", expected \"" +
           tenant + "\"";
  return "";
}

bool writeAll(int fd, const void* data, size_t n, off_t at) {
  for (size_t done = 0; done < n;) {
    const ssize_t w = ::pwrite(fd, static_cast<const char*>(data) + done, n - done, at + static_cast<off_t>(done));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    done += static_cast<size_t>(w);
  }
  return true;
}

// Writes a fresh, zeroed ledger through the descriptor, the magic last. Never through a mapping:
// the file is writable by the tenant's processes, which may truncate it at any moment, and a store
// into a mapping past the end of the file raises SIGBUS (in the broker, outside any guard); a
// write() just extends the file again.
bool initialise(int fd, const std::string& tenant) {
  static constexpr unsigned char kZeros[4096] = {};
  for (size_t at = 0; at < kLedgerFileSize; at += sizeof(kZeros))
    if (!writeAll(fd, kZeros, std::min(sizeof(kZeros), kLedgerFileSize - at), static_cast<off_t>(at))) return false;
  alignas(8) unsigned char raw[sizeof(LedgerHeader)] = {};
  auto put = [&](size_t offset, const void* v, size_t n) { std::memcpy(raw + offset, v, n); };
  const uint32_t version = kLedgerVersion, headerSize = sizeof(LedgerHeader);
  const uint64_t fileSize = kLedgerFileSize, magic = kLedgerMagic;
  const uint32_t maxDevices = kLedgerMaxDevices, maxSlots = kLedgerMaxSlots;
  put(offsetof(LedgerHeader, version), &version, 4);
  put(offsetof(LedgerHeader, header_size), &headerSize, 4);
  put(offsetof(LedgerHeader, file_size), &fileSize, 8);
  put(offsetof(LedgerHeader, max_devices), &maxDevices, 4);
  put(offsetof(LedgerHeader, max_slots), &maxSlots, 4);
  put(offsetof(LedgerHeader, tenant), tenant.data(), tenant.size());  // validated: < kLedgerTenantBytes
  return writeAll(fd, raw, sizeof(raw), 0) && writeAll(fd, &magic, sizeof(magic), 0);
}

}  // namespace

bool Ledger::validTenantName(std::string_view tenant, std::string* err) {
  if (tenant.empty() || tenant.size() >= kLedgerTenantBytes) {
    if (err)
      *err = "tenant name must have 1 to " + std::to_string(kLedgerTenantBytes - 1) +
             " characters, got " + std::to_string(tenant.size());
    return false;
  }
  for (char c : tenant) {
    const bool ok = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) {
      if (err) {
        char code[8];
        std::snprintf(code, sizeof(code), "0x%02x", static_cast<unsigned char>(c));
        *err = "tenant name \"" + printable(tenant.data(), tenant.size()) + "\": character " +
               code + " is not allowed (use A-Z a-z 0-9 . _ -)";
      }
      return false;
    }
  }
  return true;
}

std::unique_ptr<Ledger> Ledger::open(const std::string& dir, const std::string& tenant,
                                     std::string* err) {
  return open(dir, tenant, LedgerOpenOptions{}, err);
}

std::unique_ptr<Ledger> Ledger::open(const std::string& dir, const std::string& tenant,
                                     const LedgerOpenOptions& options, std::string* err) {
  std::string ignored;
  if (err == nullptr) err = &ignored;
  if (!validTenantName(tenant, err)) return nullptr;
  if (dir.empty()) {
    *err = "ledger directory is empty (CUSHARE_LEDGER_DIR)";
    return nullptr;
  }
  // mkdir -p; only the ledger directory itself gets 0700 (as `mkdir -p -m 0700`).
  if (options.createDir && !makeDirectories(dir, 0700, "ledger directory ", err)) return nullptr;
  const std::string path = dir + "/" + (options.fileName.empty() ? tenant + ".ledger" : options.fileName);

  // O_NOFOLLOW: the directory may be shared; never follow a link planted in it.
  int fd = -1;
  if (options.createFile)
    fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  const bool created = fd >= 0;
  if (fd < 0 && (!options.createFile || errno == EEXIST))
    fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    *err = errno == ELOOP ? "ledger " + path + " is a symbolic link: refused"
                          : errnoText("cannot open ledger " + path, errno);
    return nullptr;
  }
  if (created) {
    // Ownership before anything else: until then only the creator can open it.
    if ((options.ownerUid >= 0 || options.ownerGid >= 0) &&
        ::fchown(fd, options.ownerUid >= 0 ? static_cast<uid_t>(options.ownerUid) : uid_t(-1),
                 options.ownerGid >= 0 ? static_cast<gid_t>(options.ownerGid) : gid_t(-1)) != 0) {
      *err = errnoText("cannot give ledger " + path + " to its tenant's user", errno);
      ::unlink(path.c_str());
      ::close(fd);
      return nullptr;
    }
    ::fchmod(fd, options.mode & 07777);  // exactly this mode whatever the umask
  }
  auto fail = [&](std::string why, void* map) {
    *err = std::move(why);
    if (map != nullptr) ::munmap(map, kLedgerFileSize);
    ::close(fd);  // also drops the flock
    return nullptr;
  };

  // Creation and validation are serialised by flock on the file (init path only). Whoever holds
  // it first initialises; every later opener validates the finished header under the same lock.
  if (flockExclusive(fd, !options.claimSlot, options.busy) != 0)
    return fail(errnoText("cannot flock ledger " + path, errno), nullptr);
  struct stat st;
  if (::fstat(fd, &st) != 0) return fail(errnoText("cannot stat ledger " + path, errno), nullptr);
  if (!S_ISREG(st.st_mode)) return fail("ledger " + path + " is not a regular file", nullptr);
  alignas(8) unsigned char raw[sizeof(LedgerHeader)] = {};
  const size_t want = std::min<uint64_t>(static_cast<uint64_t>(st.st_size), sizeof(raw));
  for (size_t got = 0; got < want;) {
    const ssize_t n = ::pread(fd, raw + got, want - got, static_cast<off_t>(got));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return fail(errnoText("cannot read ledger " + path, n < 0 ? errno : EIO), nullptr);
    got += static_cast<size_t>(n);
  }
  // The magic is written last, so a full-size file without it is a creation that never finished
  // (its creator died holding the flock): nobody can have used it, start over. Any other file
  // without the magic is refused like any foreign file.
  const uint64_t bytes = static_cast<uint64_t>(st.st_size);
  const bool empty = bytes == 0;
  const bool unfinished =
      bytes == kLedgerFileSize && fieldAt<uint64_t>(raw, offsetof(LedgerHeader, magic)) == 0;
  if (empty || unfinished) {
    // Allocated, not only sized: on a full tmpfs a sparse file would fault (SIGBUS) at the first
    // write through the mapping; this fails here, with ENOSPC, instead.
    if (const int e = ::posix_fallocate(fd, 0, kLedgerFileSize); e != 0)
      return fail(errnoText("cannot allocate ledger " + path, e), nullptr);
    if (!initialise(fd, tenant)) return fail(errnoText("cannot write ledger " + path, errno), nullptr);
  } else {
    if (std::string why = checkHeader(raw, bytes, tenant); !why.empty())
      return fail("ledger " + path + ": " + why +
                      " (written by another cushare version, or damaged; remove it when no "
                      "process of tenant \"" +
                      tenant + "\" runs)",
                  nullptr);
  }
  // Map through a second open file description, never the one that holds the slot lock: a
  // mapping keeps its description alive, and it is inherited by fork, so a forked child would
  // keep the parent's slot locked after the parent died (its usage never reaped) however the
  // child closed its descriptors.
  const int mapFd = ::open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
  struct stat mapSt;
  if (mapFd < 0 || ::fstat(mapFd, &mapSt) != 0) {
    const int e = errno;
    if (mapFd >= 0) ::close(mapFd);
    return fail(errnoText("cannot open ledger " + path, e), nullptr);
  }
  if (mapSt.st_dev != st.st_dev || mapSt.st_ino != st.st_ino) {
    ::close(mapFd);
    return fail("ledger " + path + " was replaced while it was being opened", nullptr);
  }
  void* map = ::mmap(nullptr, kLedgerFileSize, PROT_READ | PROT_WRITE, MAP_SHARED, mapFd, 0);
  const int mapErrno = errno;
  ::close(mapFd);  // the mapping keeps what it needs
  if (map == MAP_FAILED) return fail(errnoText("cannot map ledger " + path, mapErrno), nullptr);

  std::unique_ptr<Ledger> l(new Ledger);
  l->path_ = path;
  l->tenant_ = tenant;
  l->hdr_ = static_cast<LedgerHeader*>(map);
  l->used_ = reinterpret_cast<std::atomic<uint64_t>*>(static_cast<char*>(map) + kLedgerUsedOffset);
  l->pid_ = reinterpret_cast<std::atomic<int32_t>*>(static_cast<char*>(map) + kLedgerPidOffset);
  l->compute_ = reinterpret_cast<LedgerComputeDevice*>(static_cast<char*>(map) + kLedgerComputeOffset);
  l->computeSlots_ = reinterpret_cast<LedgerComputeSlot*>(static_cast<char*>(map) + kLedgerComputeSlotOffset);
  l->fd_ = fd;  // from here on, ~Ledger unmaps and closes
  l->fileDev_ = st.st_dev;
  l->fileIno_ = st.st_ino;
  l->registerSelf();
  if (!options.claimSlot) {
    flockRetry(fd, LOCK_UN);
    l->observer_ = true;
    return l;
  }
  // The slot is claimed under the flock too: of two processes that start at once, the second sees
  // the first alive, so exactly one of them can start a new session (renewLimits).
  l->lockLocal();
  const int slot = l->claimSlotLocked(err);
  bool othersAlive = true;
  if (slot >= 0 && options.renewLimits) l->reapDeadLocked(nullptr, nullptr, &othersAlive);
  if (!othersAlive) {
    for (LedgerDevice& e : l->hdr_->devices)
      if (e.state.load(std::memory_order_acquire) == kLedgerDeviceReady) e.limit.store(kLedgerLimitPending, kSeq);
  }
  l->unlockLocal();
  flockRetry(fd, LOCK_UN);
  if (slot < 0) return nullptr;
  return l;
}

Ledger::~Ledger() {
  unregisterSelf();
  const int s = slot_.load(kSeq);
  // An observer's charge slot is left to the reapers (its lock goes with fd_): an observer never
  // writes the mapping outside its own guard (the broker drops a ledger whose file was truncated,
  // and a store here would fault).
  if (s >= 0 && !observer_) {
    // Return what this process still holds, as if it had died (the counters are the truth, so the
    // order is: usage, then pid, then the lock).
    for (uint32_t d = 0; d < kLedgerMaxDevices; ++d) usedAt(static_cast<int>(d), s).store(0, kSeq);
    pid_[s].store(0, kSeq);
  }
  if (hdr_ != nullptr) ::munmap(hdr_, kLedgerFileSize);
  if (fd_ >= 0) ::close(fd_);  // drops the slot lock
}

// ---- Registry and fork ----

void Ledger::registerSelf() noexcept {
  static const bool handlers =
      (::pthread_atfork(&Ledger::onForkPrepare, &Ledger::onForkParent, &Ledger::onForkChild), true);
  (void)handlers;
  registryLock();
  next_ = gFirstLedger;
  if (next_ != nullptr) next_->prev_ = this;
  gFirstLedger = this;
  registryUnlock();
}

void Ledger::unregisterSelf() noexcept {
  registryLock();
  if (prev_ != nullptr) prev_->next_ = next_;
  if (next_ != nullptr) next_->prev_ = prev_;
  if (gFirstLedger == this) gFirstLedger = next_;
  prev_ = next_ = nullptr;
  registryUnlock();
}

void Ledger::onForkPrepare() noexcept { registryLock(); }
void Ledger::onForkParent() noexcept { registryUnlock(); }

void Ledger::onForkChild() noexcept {
  // Runs in the child right after fork, on its only thread; async-signal-safe calls only.
  for (Ledger* l = gFirstLedger; l != nullptr; l = l->next_) l->forgetParentSlot();
  registryUnlock();
}

void Ledger::forgetParentSlot() noexcept {
  // The child shares its parent's open file description, hence the parent's slot lock: using it
  // would make the two one process in the ledger. Close the child's reference (OFD locks live until
  // the description's last reference goes, so the parent keeps its lock; and a parent that dies
  // before this child can be reaped: the mapping the child inherited holds another description,
  // see open()). The child claims its own slot on first use. A parent thread that held
  // lock_ at the fork does not exist here: reset it.
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  slot_.store(-1, std::memory_order_relaxed);
  lock_.store(false, std::memory_order_relaxed);
}

// ---- Slow path (process-local lock) ----

void Ledger::lockLocal() noexcept {
  while (lock_.exchange(true, std::memory_order_acquire))
    while (lock_.load(std::memory_order_relaxed)) ::sched_yield();
}

void Ledger::unlockLocal() noexcept { lock_.store(false, std::memory_order_release); }

bool Ledger::ensureFdLocked(std::string* err) noexcept {
  if (fd_ >= 0) return true;
  // A forked child: a description of its own.
  const int fd = ::open(path_.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
  struct stat st;
  if (fd < 0 || ::fstat(fd, &st) != 0) {
    if (err) *err = errnoText("cannot reopen ledger " + path_, errno);
    if (fd >= 0) ::close(fd);
    return false;
  }
  if (st.st_dev != fileDev_ || st.st_ino != fileIno_) {
    // Locking bytes of another file than the one mapped would protect nothing.
    if (err) *err = "ledger " + path_ + " was replaced since this process mapped it";
    ::close(fd);
    return false;
  }
  fd_ = fd;
  return true;
}

int Ledger::ensureSlot() noexcept {
  if (const int s = slot_.load(std::memory_order_acquire); s >= 0) return s;
  lockLocal();
  const int s = ensureSlotLocked(nullptr);
  unlockLocal();
  return s;
}

int Ledger::ensureSlotLocked(std::string* err) noexcept {
  const int s = slot_.load(std::memory_order_relaxed);
  if (s >= 0) return s;
  if (observer_) {
    if (err) *err = "ledger " + path_ + " was opened without a process slot";
    return -1;
  }
  if (!ensureFdLocked(err)) return -1;
  return claimSlotLocked(err);
}

int Ledger::claimSlotLocked(std::string* err) noexcept {
  const int32_t pid = static_cast<int32_t>(::getpid());
  for (uint32_t s = 0; s < kLedgerMaxSlots; ++s) {
    const int r = tryLockSlot(fd_, s);
    if (r < 0) {
      if (err)
        *err = errnoText("cannot lock a process slot of ledger " + path_ +
                             " (the ledger directory needs a local filesystem with OFD locks, "
                             "Linux >= 3.15)",
                         errno);
      return -1;
    }
    if (r == 0) continue;  // a live process's slot
    if (unlockedButLiveLocked(s, nullptr)) {  // a live process that closed its descriptor
      unlockSlot(fd_, s);
      continue;
    }
    const int slot = static_cast<int>(s);
    // Ours now. A previous owner that died and was not reaped yet left its usage: return it.
    for (uint32_t d = 0; d < kLedgerMaxDevices; ++d)
      usedAt(static_cast<int>(d), slot).store(0, kSeq);
    // Its compute counters start again from zero (the broker keeps the totals of the slot's
    // previous owners: a counter that goes down is a new owner's).
    for (uint32_t d = 0; d < kLedgerMaxDevices; ++d) {
      LedgerComputeSlot* c = computeSlotAt(static_cast<int>(d), slot);
      c->busy_ns.store(0, kSeq);
      c->throttled_ns.store(0, kSeq);
      c->activity_ns.store(0, kSeq);
      c->activity.store(0, kSeq);
      c->inflight.store(0, kSeq);
    }
    // An observer's slot holds a charge, not a process: pid 0, so that process lists leave it out
    // (its lock still keeps it from being claimed or reaped).
    pid_[s].store(observer_ ? 0 : pid, kSeq);
    lockSlotPid(fd_, s);
    // Raise slot_hwm past us before our first announce (the correctness argument needs it).
    uint32_t hwm = hdr_->slot_hwm.load(kSeq);
    while (hwm < s + 1 && !hdr_->slot_hwm.compare_exchange_weak(hwm, s + 1, kSeq)) {
    }
    slot_.store(slot, std::memory_order_release);
    return slot;
  }
  if (err)
    *err = "ledger " + path_ + ": all " + std::to_string(kLedgerMaxSlots) +
           " process slots are held by live processes of the tenant";
  return -1;
}

// A slot is live while its process lives, not only while its lock is held: a slot whose lock we
// just took but whose process still maps this ledger (it closed its descriptor) is kept, unless
// another slot with the same pid is locked (then that one is the process's, and this one a dead
// process's whose pid was reused).
bool Ledger::unlockedButLiveLocked(uint32_t s, const std::function<bool(int32_t)>* alsoLive) noexcept {
  const int32_t pid = pid_[s].load(kSeq);
  if (pid == 0 || !(mapsFile(pid, fileDev_, fileIno_) || (alsoLive != nullptr && (*alsoLive)(pid)))) return false;
  const int own = slot_.load(std::memory_order_relaxed);
  const uint32_t hwm = slotHwm();
  for (uint32_t o = 0; o < hwm; ++o) {
    if (o == s || pid_[o].load(kSeq) != pid) continue;
    if (static_cast<int>(o) == own) return false;
    const int r = tryLockSlot(fd_, o);
    if (r == 1) unlockSlot(fd_, o);
    if (r == 0) return false;
  }
  return true;
}

int Ledger::reapDeadLocked(const std::function<bool(int32_t)>* alsoLive, std::vector<int32_t>* kept,
                           bool* othersAlive) noexcept {
  if (othersAlive) *othersAlive = false;
  if (fd_ < 0) return 0;
  const int own = slot_.load(std::memory_order_relaxed);
  auto occupied = [&](uint32_t s) {
    if (pid_[s].load(kSeq) != 0) return true;
    for (uint32_t d = 0; d < kLedgerMaxDevices; ++d)
      if (usedAt(static_cast<int>(d), static_cast<int>(s)).load(kSeq) != 0) return true;
    return false;
  };
  int reaped = 0;
  const uint32_t hwm = slotHwm();
  for (uint32_t s = 0; s < hwm; ++s) {
    // Our own lock byte would be "taken" again through our own description: never reap ourselves.
    if (static_cast<int>(s) == own || (!othersAlive && !occupied(s))) continue;
    if (tryLockSlot(fd_, s) != 1) {  // alive, or being claimed or reaped by another
      if (othersAlive) *othersAlive = true;
      continue;
    }
    if (unlockedButLiveLocked(s, alsoLive)) {
      unlockSlot(fd_, s);
      if (kept != nullptr) kept->push_back(pid_[s].load(kSeq));
      if (othersAlive) *othersAlive = true;
      continue;
    }
    // We hold a dead owner's lock: nobody else can claim or reap this slot until we unlock, so
    // its usage is returned exactly once. Re-check: another reaper may have finished just before.
    if (occupied(s)) {
      for (uint32_t d = 0; d < kLedgerMaxDevices; ++d)
        usedAt(static_cast<int>(d), static_cast<int>(s)).store(0, kSeq);
      // A dead process has nothing in flight and waits at no gate (its counters stay: they are
      // the tenant's history until a new process claims the slot).
      for (uint32_t d = 0; d < kLedgerMaxDevices; ++d) {
        LedgerComputeSlot* c = computeSlotAt(static_cast<int>(d), static_cast<int>(s));
        c->inflight.store(0, kSeq);
        c->activity.store(0, kSeq);
      }
      pid_[s].store(0, kSeq);
      ++reaped;
    }
    unlockSlot(fd_, s);
  }
  return reaped;
}

int Ledger::reapDead() noexcept { return reapDead(nullptr, nullptr); }

int Ledger::reapDead(const std::function<bool(int32_t)>* alsoLive, std::vector<int32_t>* kept) noexcept {
  lockLocal();
  const bool ready = observer_ ? ensureFdLocked(nullptr) : ensureSlotLocked(nullptr) >= 0;
  const int n = ready ? reapDeadLocked(alsoLive, kept) : 0;
  unlockLocal();
  return n;
}

// ---- Devices ----

int Ledger::deviceIndex(const uint8_t uuid[16], uint64_t limitIfNew, std::string* err, bool* busy) noexcept {
  return deviceIndexImpl(uuid, limitIfNew, false, err, busy);
}

int Ledger::sessionDeviceIndex(const uint8_t uuid[16], uint64_t limit, std::string* err) noexcept {
  return deviceIndexImpl(uuid, limit, true, err, nullptr);
}

int Ledger::deviceIndexImpl(const uint8_t uuid[16], uint64_t limitIfNew, bool fillPending,
                            std::string* err, bool* busy) noexcept {
  auto find = [&]() { return findDevice(uuid); };
  auto pending = [&](int i) { return fillPending && limit(i) == kLedgerLimitPending; };
  if (const int i = find(); i >= 0 && !pending(i)) return i;  // lock-free when known
  lockLocal();
  int result = -1;
  if (observer_ ? ensureFdLocked(err) : ensureSlotLocked(err) >= 0) {
    if (flockExclusive(fd_, observer_, busy) != 0) {
      if (err) *err = errnoText("cannot flock ledger " + path_, errno);
    } else {
      result = find();  // another process may have added it (or set its limit) meanwhile
      if (result >= 0 && pending(result)) hdr_->devices[result].limit.store(limitIfNew, kSeq);
      for (uint32_t i = 0; result < 0 && i < kLedgerMaxDevices; ++i) {
        LedgerDevice& e = hdr_->devices[i];
        if (e.state.load(std::memory_order_acquire) != kLedgerDeviceFree) continue;
        std::memcpy(e.uuid, uuid, sizeof(e.uuid));
        e.limit.store(limitIfNew, kSeq);
        e.peak.store(0, kSeq);
        e.denied.store(0, kSeq);
        e.state.store(kLedgerDeviceReady, std::memory_order_release);  // publishes the entry
        result = static_cast<int>(i);
      }
      if (result < 0 && err)
        *err = "ledger " + path_ + ": all " + std::to_string(kLedgerMaxDevices) +
               " device entries are in use";
      flockRetry(fd_, LOCK_UN);
    }
  }
  unlockLocal();
  return result;
}

void Ledger::setLimit(int dev, uint64_t bytes) noexcept {
  if (static_cast<uint32_t>(dev) >= kLedgerMaxDevices) return;
  hdr_->devices[dev].limit.store(bytes, std::memory_order_release);
}

void Ledger::attachLimits(std::unique_ptr<LimitsFile> f) {
  if (!limits_) limits_ = std::move(f);
}

LimitsFile* Ledger::limitsFile() const noexcept { return limits_.get(); }

// ---- Hot path: atomics only ----

bool Ledger::announceAndValidate(int dev, int slot, uint64_t bytes, uint64_t limit) noexcept {
  std::atomic<uint64_t>& mine = usedAt(dev, slot);
  mine.fetch_add(bytes, kSeq);        // (1) announce
  const uint64_t sum = sumUsed(dev);  // (2) validate: includes every intent announced before ours
  if (sum > limit) {
    mine.fetch_sub(bytes, kSeq);  // (3) retract
    return false;
  }
  // The peak records totals granted within the tenant's limit. A charge forced past it (limit
  // kLedgerNoLimit: the driver took more than was reserved, e.g. a pool that grew by a large chunk,
  // which its caller then undoes) is not a grant and never raises it.
  std::atomic<uint64_t>& peak = hdr_->devices[dev].peak;
  uint64_t p = peak.load(std::memory_order_relaxed);
  if (sum > p && sum <= hdr_->devices[dev].limit.load(std::memory_order_relaxed))
    while (sum > p && !peak.compare_exchange_weak(p, sum, std::memory_order_relaxed)) {
    }
  return true;
}

bool Ledger::reserve(int dev, uint64_t bytes, uint64_t limit) noexcept {
  if (static_cast<uint32_t>(dev) >= kLedgerMaxDevices) return false;
  if (bytes == 0) return true;
  if (observer_) return false;
  int slot = slot_.load(std::memory_order_acquire);
  if (slot < 0) {  // first use in a forked child: claim its own slot (system calls, once)
    lockLocal();
    slot = ensureSlotLocked(nullptr);
    unlockLocal();
    if (slot < 0) {
      hdr_->devices[dev].denied.fetch_add(1, std::memory_order_relaxed);
      return false;
    }
  }
  if (bytes <= limit && announceAndValidate(dev, slot, bytes, limit)) return true;
  return reserveSlow(dev, slot, bytes, limit);
}

bool Ledger::tryReserve(int dev, uint64_t bytes, uint64_t limit) noexcept {
  if (static_cast<uint32_t>(dev) >= kLedgerMaxDevices || observer_) return false;
  if (bytes == 0) return true;
  int slot = slot_.load(std::memory_order_acquire);
  if (slot < 0) {
    lockLocal();
    slot = ensureSlotLocked(nullptr);
    unlockLocal();
    if (slot < 0) return false;
  }
  return bytes <= limit && announceAndValidate(dev, slot, bytes, limit);
}

bool Ledger::reserveSlow(int dev, int slot, uint64_t bytes, uint64_t limit) noexcept {
  if (bytes <= limit) {
    // (a) Dead processes: return what they hold, then try again. The only system calls on the
    // reservation path, and only on the way to a denial.
    if (reapDead() > 0 && announceAndValidate(dev, slot, bytes, limit)) return true;
    // (b) The excess may be other processes' intents in flight (announced, about to be retracted).
    // Pause briefly and try again, but only when what is held now leaves room. Bounded: a real
    // shortage is denied after a few microseconds. (No sched_yield here: on a busy host it can
    // cost a whole time slice, and an intent outlives its few-hundred-nanosecond window only if
    // its process is preempted inside it.)
    for (int i = 0; i < kTransientRetries; ++i) {
      for (int k = 0; k < (64 << i); ++k) cpuRelax();
      if (sumUsed(dev) <= limit - bytes && announceAndValidate(dev, slot, bytes, limit))
        return true;
    }
  }
  hdr_->devices[dev].denied.fetch_add(1, std::memory_order_relaxed);
  return false;
}

void Ledger::release(int dev, uint64_t bytes) noexcept {
  if (static_cast<uint32_t>(dev) >= kLedgerMaxDevices || bytes == 0) return;
  const int slot = slot_.load(std::memory_order_acquire);
  if (slot < 0) return;  // a forked child before its first reservation: the memory is the parent's
  // A CAS clamped at zero instead of a bare fetch_sub: releasing more than was reserved is a caller
  // bug, and a wrapped counter would make every sum huge and deny the whole tenant until this
  // process exits. Only this process's threads write its slot, so the loop rarely repeats.
  std::atomic<uint64_t>& mine = usedAt(dev, slot);
  uint64_t cur = mine.load(std::memory_order_relaxed);
  while (!mine.compare_exchange_weak(cur, cur >= bytes ? cur - bytes : 0, kSeq,
                                     std::memory_order_relaxed)) {
  }
}

uint64_t Ledger::peak(int dev) const noexcept {
  if (static_cast<uint32_t>(dev) >= kLedgerMaxDevices) return 0;
  return hdr_->devices[dev].peak.load(std::memory_order_relaxed);
}

uint64_t Ledger::denied(int dev) const noexcept {
  if (static_cast<uint32_t>(dev) >= kLedgerMaxDevices) return 0;
  return hdr_->devices[dev].denied.load(std::memory_order_relaxed);
}

std::vector<Ledger::ProcUsage> Ledger::processes(int dev) {
  std::vector<ProcUsage> out;
  if (static_cast<uint32_t>(dev) >= kLedgerMaxDevices) return out;
  reapDead();
  const uint32_t hwm = slotHwm();
  for (uint32_t s = 0; s < hwm; ++s) {
    const int32_t pid = pid_[s].load(kSeq);
    if (pid != 0) out.push_back({pid, usedAt(dev, static_cast<int>(s)).load(kSeq)});
  }
  return out;
}

std::vector<Ledger::SlotUsage> Ledger::slots() const {
  std::vector<SlotUsage> out;
  const uint32_t hwm = slotHwm();
  const int own = chargeSlot();
  for (uint32_t s = 0; s < hwm; ++s) {
    if (static_cast<int>(s) == own) continue;
    SlotUsage u{pid_[s].load(kSeq), {}, static_cast<int>(s)};
    bool any = u.pid != 0;
    for (uint32_t d = 0; d < kLedgerMaxDevices; ++d) {
      u.used[d] = usedAt(static_cast<int>(d), static_cast<int>(s)).load(kSeq);
      any = any || u.used[d] != 0;
    }
    if (any) out.push_back(u);
  }
  return out;
}

int Ledger::slotHolderPid(int slot) const noexcept {
  if (fd_ < 0 || slot < 0 || static_cast<uint32_t>(slot) >= kLedgerMaxSlots) return 0;
  struct flock fl = byteLock(F_WRLCK, kLedgerSlotPidLockBase + slot);
  if (::fcntl(fd_, F_GETLK, &fl) != 0 || fl.l_type == F_UNLCK) return 0;
  return fl.l_pid > 0 ? static_cast<int>(fl.l_pid) : 0;  // an OFD lock there reports -1
}

int Ledger::findDevice(const uint8_t uuid[16]) const noexcept {
  for (uint32_t i = 0; i < kLedgerMaxDevices; ++i) {
    const LedgerDevice& e = hdr_->devices[i];
    if (e.state.load(std::memory_order_acquire) == kLedgerDeviceReady &&
        std::memcmp(e.uuid, uuid, sizeof(e.uuid)) == 0)
      return static_cast<int>(i);
  }
  return -1;
}

void Ledger::restoreDeviceUuid(int dev, const uint8_t uuid[16]) noexcept {
  if (static_cast<uint32_t>(dev) >= kLedgerMaxDevices) return;
  LedgerDevice& e = hdr_->devices[dev];
  std::memcpy(e.uuid, uuid, sizeof(e.uuid));
  e.state.store(kLedgerDeviceReady, std::memory_order_release);
}

bool Ledger::setCharge(int dev, uint64_t bytes) noexcept {
  if (!observer_ || static_cast<uint32_t>(dev) >= kLedgerMaxDevices) return false;
  lockLocal();
  int s = slot_.load(std::memory_order_relaxed);
  if (s < 0 && ensureFdLocked(nullptr)) s = claimSlotLocked(nullptr);
  unlockLocal();
  if (s < 0) return false;
  // The tenant can write the whole file, slot_hwm included: the sums must still reach this slot.
  uint32_t hwm = hdr_->slot_hwm.load(kSeq);
  while (hwm < static_cast<uint32_t>(s) + 1 && !hdr_->slot_hwm.compare_exchange_weak(hwm, static_cast<uint32_t>(s) + 1, kSeq)) {
  }
  usedAt(dev, s).store(bytes, kSeq);
  return true;
}

uint64_t Ledger::charge(int dev) const noexcept {
  const int s = slot_.load(std::memory_order_acquire);
  if (!observer_ || s < 0 || static_cast<uint32_t>(dev) >= kLedgerMaxDevices) return 0;
  return usedAt(dev, s).load(kSeq);
}

int Ledger::links() const noexcept {
  struct stat st;
  return fd_ >= 0 && ::fstat(fd_, &st) == 0 ? static_cast<int>(st.st_nlink) : -1;
}

bool Ledger::deviceUuid(int dev, uint8_t uuid[16]) const noexcept {
  if (static_cast<uint32_t>(dev) >= kLedgerMaxDevices) return false;
  const LedgerDevice& e = hdr_->devices[dev];
  if (e.state.load(std::memory_order_acquire) != kLedgerDeviceReady) return false;
  std::memcpy(uuid, e.uuid, sizeof(e.uuid));
  return true;
}

bool Ledger::fileStat(struct stat* st) const noexcept { return fd_ >= 0 && ::fstat(fd_, st) == 0; }

bool Ledger::setOwner(int uid, int gid, unsigned mode, bool* changed, std::string* err) noexcept {
  *changed = false;
  lockLocal();
  const bool haveFd = ensureFdLocked(err);
  struct stat st;
  const bool ok = haveFd && ::fstat(fd_, &st) == 0;
  unlockLocal();
  if (!ok) {
    if (haveFd) *err = errnoText("cannot stat ledger " + path_, errno);
    return false;
  }
  // Extra hard links are no reason to refuse: the descriptor is the file this process validated
  // as the tenant's ledger, and refusing would let a tenant stop the broker from managing its
  // ledger with one link(2) (the broker reports links(), see Broker::tickLocked).
  if (!S_ISREG(st.st_mode)) {
    *err = "ledger " + path_ + " is not a regular file: refused";
    return false;
  }
  const bool ownerDiffers = (uid >= 0 && st.st_uid != static_cast<uid_t>(uid)) ||
                            (gid >= 0 && st.st_gid != static_cast<gid_t>(gid));
  if (ownerDiffers && ::fchown(fd_, uid >= 0 ? static_cast<uid_t>(uid) : uid_t(-1),
                               gid >= 0 ? static_cast<gid_t>(gid) : gid_t(-1)) != 0) {
    *err = errnoText("cannot give ledger " + path_ + " to its tenant's user", errno);
    return false;
  }
  if ((st.st_mode & 07777) != (mode & 07777) && ::fchmod(fd_, mode & 07777) != 0) {
    *err = errnoText("cannot set the mode of ledger " + path_, errno);
    return false;
  }
  *changed = ownerDiffers || (st.st_mode & 07777) != (mode & 07777);
  return true;
}

}  // namespace cushare
