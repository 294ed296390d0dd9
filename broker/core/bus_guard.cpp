// See bus_guard.h.
#include "core/bus_guard.h"

#include <signal.h>

namespace cushare::broker {
namespace detail {

sigjmp_buf*& busGuard() {
  static thread_local sigjmp_buf* guard = nullptr;
  return guard;
}

}  // namespace detail

namespace {

void onBus(int sig, siginfo_t*, void*) {
  if (sigjmp_buf* env = detail::busGuard()) siglongjmp(*env, 1);
  ::signal(sig, SIG_DFL);  // not in a guarded section: a real bug, die as SIGBUS would
  ::raise(sig);
}

}  // namespace

void installBusGuard() {
  struct sigaction sa = {};
  sa.sa_sigaction = onBus;
  sa.sa_flags = SA_SIGINFO;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGBUS, &sa, nullptr);
}

}  // namespace cushare::broker
