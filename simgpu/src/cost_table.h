// The kernel cost table (SIMGPU_KERNEL_COSTS=FILE): how long each block of a kernel lasts.
//
// One rule per line: `PATTERN key=value...`; `#` starts a comment; blank lines are skipped.
// PATTERN is a glob (fnmatch: * ? [...]) matched against the kernel's name as written in its
// source (demangled, without return type and parameter list, e.g. `ns::spin<float>`) and against
// its mangled name; the first rule that matches either wins. Keys:
//   block_ns=N         each block lasts N ns (0..1e12)
//   block_ns_param=I   each block lasts as many ns as the kernel's I-th parameter (from 0), an
//                      integer of 1, 2, 4 or 8 bytes read at launch
// Exactly one of them per rule. A malformed file is refused whole, with the line that is wrong.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace simgpu {

// Kernels no rule matches: each block lasts this long (small, so programs without a table run
// almost as fast as before).
inline constexpr uint64_t kDefaultBlockNs = 1000;

struct CostRule {
  std::string pattern;
  uint64_t blockNs = kDefaultBlockNs;
  int param = -1;  // >= 0: block_ns_param
};

struct CostTable {
  std::vector<CostRule> rules;
  // The first rule matching the kernel (mangled name), or nullptr.
  const CostRule* match(const std::string& mangled) const;
};

// Parses a cost table's text. On error returns false and sets *error to "line N: why".
bool parseCostTable(const std::string& text, CostTable* out, std::string* error);
// Reads and parses `path` (false with *error when unreadable or malformed).
bool loadCostTable(const std::string& path, CostTable* out, std::string* error);

// `_ZN2ns4spinIfEEvPT_x` -> `ns::spin<float>`; a name that does not demangle is returned as is.
std::string kernelSourceName(const std::string& mangled);

}  // namespace simgpu
