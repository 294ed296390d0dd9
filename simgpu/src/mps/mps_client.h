// simgpu's driver as a client of the simulated MPS (the daemon: simgpu/mps/).
//
// At cuInit, if a control daemon answers at CUDA_MPS_PIPE_DIRECTORY (default /tmp/nvidia-mps),
// the process becomes a client of the server for its uid (waiting while the daemon keeps it
// pending), as the real driver does. What the daemon grants is fixed for the process's life:
// the active thread percentage (the lower of the server's and CUDA_MPS_ACTIVE_THREAD_PERCENTAGE),
// hence its SM cap and the multiprocessor count it sees; its priority; and its pinned device
// memory limits (each the lower of the server's and CUDA_MPS_PINNED_DEVICE_MEM_LIMIT's), which
// make allocations beyond them fail with CUDA_ERROR_OUT_OF_MEMORY. The connection stays open:
// its hang-up is the client's exit for the daemon (kill -9 included); through it the daemon
// terminates the client or reports its server's fault, which become the process's sticky error.
// The client's kernels run in its server's one engine (a direct connection to the server,
// mps_protocol.h): side by side with the other clients', each on at most its SM cap, in the order
// of client priority; the server is one context to the time slicer.
//
// Hot-path cost: mpsReserve/mpsRelease (device memory accounting) load one pointer when the
// process is not a client; as a client, one atomic add on a process-local counter.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <vector>

#include "config.h"

namespace simgpu {

struct KernelShape;
struct BlockTrace;

struct MpsClientInfo {
  int32_t serverPid = 0;      // to the time-slicing scheduler the whole server is one context
  uint32_t uid = 0;
  uint32_t smCap = 0;         // ceil(pct/100 x SMs) rounded up to a TPC (2 SMs), at most SMs
  uint32_t threadPctX10 = 0;  // effective active thread percentage x 10
  int32_t priority = 0;       // 0 normal, 1 below normal
  uint64_t pinnedLimit[kMaxDevices] = {};  // bytes, 0: none
};

// Becomes a client if a daemon answers (called once by cuInit, after the configuration is read
// and the MIG device chosen). migTag: the process's MIG device (mig::migTag), 0: none; a server
// admits only clients of its own MIG device (one server per MIG device, as on the real driver).
void mpsAttach(const Config& cfg, uint32_t migTag);
// nullptr unless this process is an MPS client; never changes after cuInit returned.
const MpsClientInfo* mpsClient();
// Context creation: CUDA_SUCCESS, or the MPS error the daemon refused this process with
// (CUDA_ERROR_MPS_SERVER_NOT_READY while the server is in FAULT, ..._MAX_CLIENTS_REACHED), or
// CUDA_ERROR_MPS_CONNECTION_FAILED for a malformed CUDA_MPS_* variable.
CUresult mpsContextStatus();
// The multiprocessor count the process sees: its SM cap as a client, else the device's.
int mpsVisibleSms(int deviceSms);
// The pinned memory limit check around the device's accounting (memory-limit check).
bool mpsReserve(int dev, uint64_t bytes);
void mpsRelease(int dev, uint64_t bytes);
// The client's sticky error (terminated, or its server faulted), CUDA_SUCCESS otherwise.
CUresult mpsClientStatus();
// Runs one kernel (of the client's context `context` on host device hostDev) in the server's
// engine and waits for its end (*endNs, device time). Several stream workers may wait at once.
// Fails with the client's sticky error, or CUDA_ERROR_MPS_RPC_FAILURE (sticky) once the server is
// gone, or the server's answer (CUDA_ERROR_MPS_CLIENT_TERMINATED for work terminate_client ended).
// traces (probe twins: k.traceBlocks): what the server's engine gave each block.
CUresult mpsRunKernel(int hostDev, uint64_t context, int streamPriority, const KernelShape& k, uint64_t startNs,
                      uint32_t queuedBehind, uint64_t* endNs, std::vector<BlockTrace>* traces = nullptr);

}  // namespace simgpu
