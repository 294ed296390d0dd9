// Probe rounds in a tenant process (probe_thread.cpp; docs/probes.md, "In the shim").
#pragma once

#include "cushare/ledger_abi.h"

namespace cushare::shim {

// Called by the pacer at every pass for each device with the broker's compute words: a new
// request for this process's slot goes to the probe thread (started at the first). Under the
// pacer's lock; no system call unless a request is new.
void probeCheck(int ordinal, LedgerComputeDevice* words, int slot) noexcept;
// In the child after fork (the pacer's atfork handler).
void probeResetAfterFork() noexcept;

}  // namespace cushare::shim
