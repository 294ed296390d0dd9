// See limits_file.h.
#include "cushare/limits_file.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace cushare {
namespace {

std::string sysErr(const std::string& what) { return what + ": " + std::strerror(errno); }

std::string dirOf(const std::string& ledgerDir) { return ledgerDir + "/" + kLimitsDirName; }

// "" when h is a complete limits file of this version for this ledger and tenant.
std::string check(const LimitsHeader& h, uint64_t fileBytes, uint64_t ledgerIno, const std::string& tenant) {
  if (fileBytes != sizeof(LimitsHeader))
    return "its size is " + std::to_string(fileBytes) + " bytes, expected " + std::to_string(sizeof(LimitsHeader));
  if (h.magic != kLimitsMagic) return "field 'magic' does not read \"CUSHLIM\": not a limits file";
  if (h.version != kLimitsVersion)
    return "field 'version' is " + std::to_string(h.version) + ", this cushare reads version " +
           std::to_string(kLimitsVersion) + " only";
  if (h.header_size != sizeof(LimitsHeader) || h.file_size != sizeof(LimitsHeader))
    return "field 'header_size' or 'file_size' is not " + std::to_string(sizeof(LimitsHeader));
  if (h.ledger_ino != ledgerIno)
    return "it speaks for ledger inode " + std::to_string(h.ledger_ino) + ", not " + std::to_string(ledgerIno);
  if (std::memchr(h.tenant, '\0', sizeof h.tenant) == nullptr || tenant != h.tenant)
    return "it speaks for another tenant";
  for (const LimitsEntry& e : h.entries) {
    const uint32_t s = e.state.load(std::memory_order_acquire);
    if (s != kLimitsEntryFree && s != kLimitsEntryReady) return "an entry's 'state' is " + std::to_string(s);
  }
  return "";
}

}  // namespace

LimitsFile::~LimitsFile() {
  if (hdr_ != nullptr) ::munmap(hdr_, sizeof(LimitsHeader));
}

std::unique_ptr<LimitsFile> LimitsFile::openForBroker(const std::string& ledgerDir, uint64_t ledgerIno,
                                                      const std::string& tenant, std::string* err) {
  if (tenant.size() >= kLedgerTenantBytes) {
    *err = "tenant name too long for a limits file";
    return nullptr;
  }
  std::unique_ptr<LimitsFile> f(new LimitsFile);
  f->path_ = dirOf(ledgerDir) + "/" + std::to_string(ledgerIno);
  f->writable_ = true;
  f->ino_ = ledgerIno;
  // A restarted broker keeps its own valid file: the tenant's running processes map it.
  int fd = ::open(f->path_.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC);
  if (fd >= 0) {
    struct stat st;
    void* m = MAP_FAILED;
    if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == ::geteuid() &&
        static_cast<uint64_t>(st.st_size) == sizeof(LimitsHeader))
      m = ::mmap(nullptr, sizeof(LimitsHeader), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    if (m != MAP_FAILED) {
      auto* h = static_cast<LimitsHeader*>(m);
      if (check(*h, sizeof(LimitsHeader), ledgerIno, tenant).empty()) {
        f->hdr_ = h;
        // A reclaim the previous broker asked for is over with it: no target outlives the broker
        // that set it (nor a word an earlier build left at 0).
        for (int e = 0; e < static_cast<int>(kLedgerMaxDevices); ++e) f->setReclaimTarget(e, kLedgerNoLimit);
        return f;
      }
      ::munmap(m, sizeof(LimitsHeader));
    }
    if (::unlink(f->path_.c_str()) != 0 && errno != ENOENT) {
      *err = sysErr("cannot replace the limits file " + f->path_);
      return nullptr;
    }
  } else if (errno != ENOENT) {
    if (errno != ELOOP || ::unlink(f->path_.c_str()) != 0) {
      *err = sysErr("cannot open the limits file " + f->path_);
      return nullptr;
    }
  }
  // Made whole under a temporary name and renamed into place: a shim polling for the file never
  // sees it half made (it refuses a file of the wrong size for good).
  const std::string tmp = dirOf(ledgerDir) + "/." + std::to_string(ledgerIno) + ".new";
  ::unlink(tmp.c_str());
  fd = ::open(tmp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) {
    *err = sysErr("cannot create the limits file " + tmp);
    return nullptr;
  }
  // Allocated, not only sized: on a full tmpfs a sparse file would fault (SIGBUS) at the first
  // write through the mapping; this fails here, with ENOSPC, instead.
  void* m = MAP_FAILED;
  int saved = ::fchmod(fd, 0644) == 0 ? ::posix_fallocate(fd, 0, sizeof(LimitsHeader)) : errno;
  if (saved == 0) {
    m = ::mmap(nullptr, sizeof(LimitsHeader), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    saved = errno;
  }
  ::close(fd);
  if (m == MAP_FAILED) {
    errno = saved;
    *err = sysErr("cannot size and map the limits file " + tmp);
    ::unlink(tmp.c_str());
    return nullptr;
  }
  auto* h = static_cast<LimitsHeader*>(m);  // zero-filled: every entry free
  for (LimitsEntry& e : h->entries) {
    e.burst_above.store(kLedgerNoLimit, std::memory_order_relaxed);  // no bursting
    e.reclaim_target.store(kLedgerNoLimit, std::memory_order_relaxed);  // nothing asked
  }
  h->version = kLimitsVersion;
  h->header_size = sizeof(LimitsHeader);
  h->file_size = sizeof(LimitsHeader);
  h->ledger_ino = ledgerIno;
  std::memcpy(h->tenant, tenant.data(), tenant.size());
  std::atomic_thread_fence(std::memory_order_release);
  reinterpret_cast<std::atomic<uint64_t>*>(&h->magic)->store(kLimitsMagic, std::memory_order_release);
  if (::rename(tmp.c_str(), f->path_.c_str()) != 0) {
    *err = sysErr("cannot put the limits file " + f->path_ + " in place");
    ::munmap(m, sizeof(LimitsHeader));
    ::unlink(tmp.c_str());
    return nullptr;
  }
  f->hdr_ = h;
  return f;
}

int LimitsFile::openForShim(const std::string& ledgerDir, uint64_t ledgerIno, const std::string& tenant,
                            uint32_t brokerUid, std::unique_ptr<LimitsFile>* out, std::string* err) {
  const std::string dir = dirOf(ledgerDir);
  const std::string path = dir + "/" + std::to_string(ledgerIno);
  // O_PATH: the directory is 0711, searchable but not readable by tenants.
  const int dfd = ::open(dir.c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (dfd < 0) {
    if (errno == ENOENT) {
      *err = "the broker has no limits directory " + dir + " yet";
      return 0;
    }
    *err = sysErr("cannot open the broker's limits directory " + dir);
    return -1;
  }
  struct stat ds;
  if (::fstat(dfd, &ds) != 0 || ds.st_uid != brokerUid || (ds.st_mode & 022) != 0) {
    ::close(dfd);
    *err = "the limits directory " + dir + " is not the broker's (uid " + std::to_string(brokerUid) +
           ") or is writable by others: refused";
    return -1;
  }
  const int fd = ::openat(dfd, std::to_string(ledgerIno).c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  const int openErrno = errno;
  ::close(dfd);
  if (fd < 0) {
    errno = openErrno;
    if (errno == ENOENT) {
      *err = "the broker has not published this ledger's limits (" + path + ") yet";
      return 0;
    }
    *err = sysErr("cannot open the limits file " + path);
    return -1;
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != brokerUid || (st.st_mode & 022) != 0) {
    ::close(fd);
    *err = "the limits file " + path + " is not a regular file of the broker's (uid " + std::to_string(brokerUid) +
           ") or is writable by others: refused";
    return -1;
  }
  if (static_cast<uint64_t>(st.st_size) != sizeof(LimitsHeader)) {
    ::close(fd);
    *err = "the limits file " + path + " has " + std::to_string(st.st_size) + " bytes, expected " +
           std::to_string(sizeof(LimitsHeader)) + ": refused";
    return -1;
  }
  void* m = ::mmap(nullptr, sizeof(LimitsHeader), PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (m == MAP_FAILED) {
    *err = sysErr("cannot map the limits file " + path);
    return -1;
  }
  auto* h = static_cast<LimitsHeader*>(m);
  if (reinterpret_cast<std::atomic<uint64_t>*>(&h->magic)->load(std::memory_order_acquire) == 0) {
    ::munmap(m, sizeof(LimitsHeader));
    *err = "the broker is still writing the limits file " + path;
    return 0;
  }
  if (std::string why = check(*h, sizeof(LimitsHeader), ledgerIno, tenant); !why.empty()) {
    ::munmap(m, sizeof(LimitsHeader));
    *err = "the limits file " + path + " is refused: " + why;
    return -1;
  }
  std::unique_ptr<LimitsFile> f(new LimitsFile);
  f->hdr_ = h;
  f->ino_ = ledgerIno;
  f->path_ = path;
  *out = std::move(f);
  return 1;
}

int LimitsFile::find(const uint8_t uuid[16]) const noexcept {
  for (uint32_t e = 0; e < kLedgerMaxDevices; ++e) {
    const LimitsEntry& x = hdr_->entries[e];
    if (x.state.load(std::memory_order_acquire) == kLimitsEntryReady && std::memcmp(x.uuid, uuid, 16) == 0)
      return static_cast<int>(e);
  }
  return -1;
}

bool LimitsFile::readyUuid(int e, uint8_t uuid[16]) const noexcept {
  if (static_cast<uint32_t>(e) >= kLedgerMaxDevices) return false;
  const LimitsEntry& x = hdr_->entries[e];
  if (x.state.load(std::memory_order_acquire) != kLimitsEntryReady) return false;
  std::memcpy(uuid, x.uuid, 16);
  return true;
}

void LimitsFile::publish(int e, const uint8_t uuid[16], uint64_t limit) noexcept {
  if (!writable_ || static_cast<uint32_t>(e) >= kLedgerMaxDevices) return;
  LimitsEntry& x = hdr_->entries[e];
  if (x.state.load(std::memory_order_acquire) == kLimitsEntryReady) {
    if (std::memcmp(x.uuid, uuid, 16) == 0) x.limit.store(limit, std::memory_order_release);
    return;  // published for another device: its UUID and limit stay
  }
  x.limit.store(limit, std::memory_order_release);
  std::memcpy(x.uuid, uuid, 16);
  x.state.store(kLimitsEntryReady, std::memory_order_release);
}

void LimitsFile::setBurstAbove(int e, uint64_t bytes) noexcept {
  if (writable_ && static_cast<uint32_t>(e) < kLedgerMaxDevices &&
      hdr_->entries[e].burst_above.load(std::memory_order_relaxed) != bytes)
    hdr_->entries[e].burst_above.store(bytes, std::memory_order_release);
}

void LimitsFile::setReclaimTarget(int e, uint64_t bytes) noexcept {
  if (!writable_ || static_cast<uint32_t>(e) >= kLedgerMaxDevices) return;
  LimitsEntry& x = hdr_->entries[e];
  if (x.reclaim_target.load(std::memory_order_relaxed) == bytes) return;
  x.reclaim_target.store(bytes, std::memory_order_release);
  x.reclaim_seq.fetch_add(1, std::memory_order_acq_rel);
}

void LimitsFile::setPlainMask(uint64_t mask, uint64_t waitMs) noexcept {
  if (!writable_) return;
  if (hdr_->reclaim_wait_ms.load(std::memory_order_relaxed) != waitMs) hdr_->reclaim_wait_ms.store(waitMs, std::memory_order_release);
  if (hdr_->plain_mask.load(std::memory_order_relaxed) != mask) hdr_->plain_mask.store(mask, std::memory_order_release);
}

void LimitsFile::setEvictable(int e, uint64_t bytes) noexcept {
  if (writable_ && static_cast<uint32_t>(e) < kLedgerMaxDevices &&
      hdr_->entries[e].evictable.load(std::memory_order_relaxed) != bytes)
    hdr_->entries[e].evictable.store(bytes, std::memory_order_release);
}

void LimitsFile::setLimit(int e, uint64_t limit) noexcept {
  if (writable_ && static_cast<uint32_t>(e) < kLedgerMaxDevices)
    hdr_->entries[e].limit.store(limit, std::memory_order_release);
}

bool prepareLimitsDir(const std::string& ledgerDir, std::string* err) {
  const std::string dir = dirOf(ledgerDir);
  struct stat st;
  if (::lstat(dir.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode) && st.st_uid == ::geteuid()) {
      if ((st.st_mode & 07777) != 0711 && ::chmod(dir.c_str(), 0711) != 0) {
        *err = sysErr("cannot make the limits directory " + dir + " mode 0711");
        return false;
      }
      return true;
    }
    // Someone else's (planted while an older broker left the name free): swapped atomically with a
    // fresh directory of the broker's, so nothing can take the name in between; what was there
    // stays, unread, under the other name.
    std::string aside = dir + ".aside-XXXXXX";
    const bool made = ::mkdtemp(aside.data()) != nullptr;
    const bool swapped = made && ::chmod(aside.c_str(), 0711) == 0 &&
                         ::renameat2(AT_FDCWD, aside.c_str(), AT_FDCWD, dir.c_str(), RENAME_EXCHANGE) == 0;
    if (!swapped) {
      const int e = errno;
      if (made) ::rmdir(aside.c_str());
      errno = e;
      *err = sysErr("cannot move aside " + dir + " (uid " + std::to_string(st.st_uid) + ", not the broker's)");
      return false;
    }
    return true;
  }
  if (errno != ENOENT) {
    *err = sysErr("cannot look at the limits directory " + dir);
    return false;
  }
  if (::mkdir(dir.c_str(), 0711) != 0 || ::chmod(dir.c_str(), 0711) != 0) {
    *err = sysErr("cannot create the limits directory " + dir);
    return false;
  }
  return true;
}

}  // namespace cushare
