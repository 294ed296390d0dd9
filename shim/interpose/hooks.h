// Declarations of the policy functions behind every hooked symbol (hooks.def, nvml_hooks.def).
#pragma once

#include <cuda.h>

#include <atomic>
#include <cstdint>

#include "cushare/nvml_api.h"

namespace cushare::shim {
#define CUSHARE_DRIVER_HOOK(sym, base, ver, pt, params, args) CUresult hook_##sym params noexcept;
// The launch hooks under assembler names: their trampolines (interpose.cpp) jump to them.
#define CUSHARE_LAUNCH_HOOK(sym, base, ver, pt, params, args) \
  CUresult hook_##sym params noexcept __asm__("cushare_hook_" #sym);
#include "hooks.def"
#undef CUSHARE_LAUNCH_HOOK
#undef CUSHARE_DRIVER_HOOK
#define CUSHARE_NVML_HOOK(sym, params, args) nvmlReturn_t hook_##sym params noexcept;
#include "nvml_hooks.def"
#undef CUSHARE_NVML_HOOK

// The launch word (launch.cpp), read by the launch trampolines (interpose.cpp): a word whose
// kComputeModeMask bits are zero when launches are plain (no compute mode in force). It points at
// gLaunchUnready (all bits set) until the devices are ready, then at the single device's mode
// word in the ledger, or at a word with all bits set when the process sees several devices (the
// hook then finds the launch's device). Set once, with a release store, by launch.cpp. (An assembler
// name: GCC does not take a non-const object's address as an asm immediate.)
extern std::atomic<const std::atomic<uint32_t>*> gLaunchWord __asm__("cushare_launch_word");
extern const std::atomic<uint32_t> gLaunchUnready __asm__("cushare_launch_unready");
}  // namespace cushare::shim
