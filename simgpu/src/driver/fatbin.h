// Reading what simgpu needs from a CUDA module image: kernel names with their parameter layout
// (so a launch captured into a graph can copy its arguments, and cuFuncGetParamInfo answers) and
// the sizes of module globals. Accepts a fatbin wrapper (0x466243b1), a fatbin (0xBA55ED50), a
// cubin (ELF) or PTX text (each .entry's declared parameters); compressed fatbin entries are
// skipped: their kernels still launch, only without parameter layout.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "driver.h"

namespace simgpu {

// What a kernel asks of an SM, from its cubin (for occupancy).
struct KernelResources {
  uint32_t registers = 0;     // per thread (EIATTR_REGCOUNT in .nv.info); 0 unknown
  uint32_t staticShared = 0;  // bytes of the .nv.shared.<kernel> section (the reserved 1 KiB included)
};

struct ImageInfo {
  std::map<std::string, std::vector<ParamInfo>> kernels;  // by mangled name, params by ordinal
  std::map<std::string, KernelResources> resources;       // by mangled name, where the cubin says
  std::map<std::string, size_t> globals;                  // object symbols and their sizes
  bool globalsKnown = false;  // a cubin was read (PTX text alone does not list its globals here)
};

// Parses image; `size` may be 0 when unknown (then only self-describing formats are read).
void parseImage(const void* image, size_t size, ImageInfo* out);

}  // namespace simgpu
