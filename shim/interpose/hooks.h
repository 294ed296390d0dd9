// Declarations of the policy functions behind every hooked symbol (hooks.def, nvml_hooks.def).
#pragma once

#include <cuda.h>

#include "cushare/nvml_api.h"

namespace cushare::shim {
#define CUSHARE_DRIVER_HOOK(sym, base, ver, pt, params, args) CUresult hook_##sym params noexcept;
#include "hooks.def"
#undef CUSHARE_DRIVER_HOOK
#define CUSHARE_NVML_HOOK(sym, params, args) nvmlReturn_t hook_##sym params noexcept;
#include "nvml_hooks.def"
#undef CUSHARE_NVML_HOOK
}  // namespace cushare::shim
