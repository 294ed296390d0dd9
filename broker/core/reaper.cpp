// See reaper.h.
#include "core/reaper.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/inotify.h>
#include <sys/syscall.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <set>

#include "core/broker.h"
#include "core/log.h"

namespace cushare::broker {
namespace {

// Scan the directory at least this often even without an inotify event (events can overflow).
constexpr int kScanEveryTicks = 20;

// glibc 2.36's <sys/pidfd.h> lacks C++ linkage; the system call is simple enough.
int pidfdOpen(int pid) { return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)); }

}  // namespace

Reaper::Reaper(Broker& broker, std::chrono::milliseconds period) : broker_(broker), period_(period) {}

Reaper::~Reaper() {
  stop();
  for (int fd : {epoll_, timer_, inotify_, stop_})
    if (fd >= 0) ::close(fd);
  for (auto& [pid, fd] : pidfds_) ::close(fd);
}

void Reaper::watch(int fd) {
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = fd;
  ::epoll_ctl(epoll_, EPOLL_CTL_ADD, fd, &ev);
}

bool Reaper::start(std::string* err) {
  epoll_ = ::epoll_create1(EPOLL_CLOEXEC);
  timer_ = ::timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC | TFD_NONBLOCK);
  stop_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  inotify_ = ::inotify_init1(IN_CLOEXEC | IN_NONBLOCK);
  if (epoll_ < 0 || timer_ < 0 || stop_ < 0 || inotify_ < 0) {
    *err = std::string("reaper: cannot create its descriptors: ") + std::strerror(errno);
    return false;
  }
  if (::inotify_add_watch(inotify_, broker_.ledgerDir().c_str(), IN_CREATE | IN_MOVED_TO) < 0) {
    *err = "reaper: cannot watch " + broker_.ledgerDir() + ": " + std::strerror(errno);
    return false;
  }
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(period_).count();
  itimerspec its{};
  its.it_interval.tv_sec = ns / 1000000000;
  its.it_interval.tv_nsec = ns % 1000000000;
  its.it_value = its.it_interval;
  ::timerfd_settime(timer_, 0, &its, nullptr);
  for (int fd : {timer_, stop_, inotify_}) watch(fd);
  refreshPidfds();
  thread_ = std::thread([this] { run(); });
  return true;
}

void Reaper::stop() {
  if (!thread_.joinable()) return;
  const uint64_t one = 1;
  (void)!::write(stop_, &one, sizeof one);
  thread_.join();
}

// Holds a pidfd for every pid now in a ledger slot, and only for those.
void Reaper::refreshPidfds() {
  const std::vector<int> now = broker_.pids();
  const std::set<int> live(now.begin(), now.end());
  for (auto it = pidfds_.begin(); it != pidfds_.end();) {
    if (live.count(it->first)) {
      ++it;
      continue;
    }
    ::close(it->second);  // also leaves the epoll set
    it = pidfds_.erase(it);
  }
  // A pid that has exited but is still in a slot (a zombie nobody waited for, or a pid a process
  // wrote into its slot) is not watched again: its pidfd would be readable at once, forever. The
  // periodic tick covers it.
  for (auto it = exited_.begin(); it != exited_.end();) it = live.count(*it) ? std::next(it) : exited_.erase(it);
  for (int pid : live) {
    if (pidfds_.count(pid) || exited_.count(pid)) continue;
    const int fd = pidfdOpen(pid);
    if (fd < 0) continue;  // gone already (the next tick reaps it) or not in our pid namespace
    pidfds_[pid] = fd;
    watch(fd);
  }
}

void Reaper::run() {
  int ticks = 0;
  epoll_event events[64];
  for (;;) {
    const int n = ::epoll_wait(epoll_, events, 64, -1);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      CUSHARE_BLOG(error, "reaper: epoll_wait: {}", std::strerror(errno));
      return;
    }
    bool tick = false, scan = false;
    for (int i = 0; i < n; ++i) {
      const int fd = events[i].data.fd;
      if (fd == stop_) return;
      if (fd == timer_) {
        uint64_t expirations;
        (void)!::read(timer_, &expirations, sizeof expirations);
        tick = true;
        scan = scan || ++ticks % kScanEveryTicks == 0;
      } else if (fd == inotify_) {
        alignas(inotify_event) char buf[4096];
        while (::read(inotify_, buf, sizeof buf) > 0) {
        }
        tick = scan = true;
      } else {
        tick = true;  // a pidfd: that process has exited (its OFD locks are gone already)
        for (auto it = pidfds_.begin(); it != pidfds_.end(); ++it) {
          if (it->second != fd) continue;
          exited_.insert(it->first);
          ::close(fd);
          pidfds_.erase(it);
          break;
        }
      }
    }
    if (!tick) continue;
    broker_.tick(scan);
    refreshPidfds();
  }
}

}  // namespace cushare::broker
