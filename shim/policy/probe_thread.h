// Probe rounds in a tenant process (probe_thread.cpp; docs/probes.md, "In the shim").
#pragma once

#include <cuda.h>

#include "cushare/ledger_abi.h"

namespace cushare::shim {

// Called by the pacer at every pass for each device with the broker's compute words: a new
// request for this process's slot goes to the probe thread (started at the first). Under the
// pacer's lock; no system call unless a request is new.
void probeCheck(int ordinal, LedgerComputeDevice* words, int slot) noexcept;
// The program releases or resets the device's primary context (the shim's hooks, before the real
// call): the probe thread frees its runner there and drops its own reference first, so the
// context goes when the program lets go of it (the thread's reference kept it, and on a GPU its
// memory, alive) and a reset finds no probe using it. Waits for a round in progress (its launches
// may wait at the tenant's gate, bounded by the broker's heartbeat). The next request loads the
// probes again if the process uses the context then.
void probeLetGoOfPrimaryContext(CUdevice dev) noexcept;
// In the child after fork (the pacer's atfork handler).
void probeResetAfterFork() noexcept;
// The probe runner's launches (policy/probe_driver.h): wait at the tenant's gate, then the real
// driver's cuLaunchKernel, unmetered.
CUresult probeLaunch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                     unsigned shared, CUstream s, void** params, void** extra) noexcept;

}  // namespace cushare::shim
