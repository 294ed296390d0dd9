// Makes a tenant process an MPS client of the broker's control daemon (docs/mps.md): when the
// broker's ledger directory holds mps.conf, the shim sets CUDA_MPS_PIPE_DIRECTORY,
// CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, CUDA_MPS_CLIENT_PRIORITY and CUDA_MPS_PINNED_DEVICE_MEM_LIMIT
// from the tenant's settings before the driver reads them (at cuInit).
//
// When it runs: once, from the shim's constructor (the library is LD_PRELOADed, so this is before
// main and, in every ordinary program, before any other thread exists: setenv is then safe), or,
// if a hook runs first (another library's constructor calling CUDA), from the shim's phase 1,
// which precedes the real cuInit. In that late case another thread could be reading the
// environment at the same moment; glibc's setenv takes a lock of its own, but a getenv in another
// thread is not protected by it. That is the documented limit (docs/mps.md).
//
// Failure is recorded, not acted on here: phase 1 (state.cpp) fails closed with mpsEnvError().
#pragma once

#include <string>

namespace cushare::shim {

// Runs the set-up once (later calls return at once).
void setUpMpsEnv() noexcept;
// After setUpMpsEnv: "" when fine (MPS off, or the variables are set), else the one-line error.
const std::string& mpsEnvError() noexcept;
// After setUpMpsEnv: the process was made an MPS client (its percentage and priority are the MPS
// server's to enforce, so the launch path applies no lower cap of its own).
bool mpsClient() noexcept;

}  // namespace cushare::shim
