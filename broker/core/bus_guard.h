// Protection against SIGBUS from ledger mappings. A ledger is a file its tenant's processes can
// write, and so truncate; touching a mapping past the end of its file raises SIGBUS, which would
// kill the broker (and every tenant's reaping, metrics and control with it). The broker touches
// ledger memory only inside guarded(): a fault there unwinds to guarded(), which returns false,
// and the caller drops that tenant's mapping and reports the ledger as damaged.
//
// The unwinding is a siglongjmp: destructors of the frames it skips do not run (a temporary may
// leak), and any lock a skipped frame held inside the faulting Ledger stays held, which is why the
// caller must drop that Ledger object rather than use it again.
#pragma once

#include <setjmp.h>

namespace cushare::broker {

// Installs the SIGBUS handler (once, before the broker's threads start). A SIGBUS outside
// guarded() keeps its default action.
void installBusGuard();

namespace detail {
sigjmp_buf*& busGuard();
}

template <class F>
bool guarded(F&& f) {
  sigjmp_buf env;
  sigjmp_buf* const outer = detail::busGuard();
  if (sigsetjmp(env, 1) != 0) {
    detail::busGuard() = outer;
    return false;
  }
  detail::busGuard() = &env;
  f();
  detail::busGuard() = outer;
  return true;
}

}  // namespace cushare::broker
