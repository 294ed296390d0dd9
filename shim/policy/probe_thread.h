// Probe rounds in a tenant process (probe_thread.cpp; docs/probes.md, "In the shim").
#pragma once

#include <cuda.h>

#include "cushare/ledger_abi.h"

namespace cushare::shim {

// Called by the pacer at every pass for each device with the broker's compute words: a new
// request for this process's slot goes to the probe thread (started at the first). Under the
// pacer's lock; no system call unless a request is new.
void probeCheck(int ordinal, LedgerComputeDevice* words, int slot) noexcept;
// Held by the shim's hooks across a program's release or reset of a device's primary context
// (contexts.cpp). It keeps the probe thread off every context meanwhile: a round in progress ends
// first (one waiting at the tenant's gate gives up within 50 ms), and no round loads or runs
// until the program's call has returned. The probe thread holds its own reference to the
// context, so:
// - before a reset, letGoBeforeReset frees the probes' runner there (its memory's charges return
//   through the shim's hooks) and drops that reference: the reset finds no probe using the
//   context, and the next round loads again if the program uses the context then;
// - after the program's release, afterRelease drops that reference too and looks: if the context
//   went with it (the program held no more), the runner's handles died with it and are forgotten,
//   as the program meant; if it lives on (the program still holds it), the reference is taken
//   back and the runner kept (a program that pairs retain and release around its calls does not
//   make the probes reload).
class ProbeContextGuard {
 public:
  explicit ProbeContextGuard(CUdevice dev) noexcept;
  ~ProbeContextGuard();
  ProbeContextGuard(const ProbeContextGuard&) = delete;
  ProbeContextGuard& operator=(const ProbeContextGuard&) = delete;
  void letGoBeforeReset() noexcept;
  void afterRelease(CUresult programsRelease) noexcept;

 private:
  CUdevice dev_;
};
// In the child after fork (the pacer's atfork handler).
void probeResetAfterFork() noexcept;
// The probe runner's launches (policy/probe_driver.h): wait at the tenant's gate, then the real
// driver's cuLaunchKernel, unmetered.
CUresult probeLaunch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                     unsigned shared, CUstream s, void** params, void** extra) noexcept;

}  // namespace cushare::shim
