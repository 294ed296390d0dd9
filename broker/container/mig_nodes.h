// The device nodes a container needs to run CUDA in one MIG device: its GPU's /dev/nvidiaN and the
// two capability nodes of its GPU instance and compute instance, /dev/nvidia-caps/nvidia-cap<N>,
// N read from the driver's table /proc/driver/nvidia-caps/mig-minors (docs/mig.md, "Containers").
// The control nodes (/dev/nvidiactl, /dev/nvidia-uvm*) and the driver's libraries come with the
// driver's own container support (NVIDIA's runtime or its CDI spec), as they do for a whole GPU.
//
// Invariants:
// - The table's lines are "<capability> <minor>" ("config 1", "gpu0/gi1/access 12",
//   "gpu0/gi1/ci0/access 13"...): a line not of that shape (no minor, a minor of more than 7
//   digits, a capability named twice) refuses the whole table (a damaged or foreign file never
//   names a node); capabilities are only ever looked up by the exact names above, so others are
//   kept and never used.
// - The driver's table is fixed (every gpu 0..31, gi 0..14, ci 0..7, numbered in order from 3);
//   kMigMinorsFormula gives the same numbers where the table cannot be read. A GPU minor, GI or CI
//   outside those ranges has no node: false, never a guess.
// - Pure code but loadMigMinors, which only reads the file.
#pragma once

#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace cushare::container {

inline constexpr char kMigMinorsFile[] = "/proc/driver/nvidia-caps/mig-minors";
inline constexpr char kCapsNodeDir[] = "/dev/nvidia-caps";

struct MigMinors {
  // "gpu0/gi1/access" -> 12, "gpu0/gi1/ci0/access" -> 13 ... Empty: the fixed numbering.
  std::map<std::string, unsigned> minors;
  bool fromFile = false;
};

// Parses the driver's table. False with *err (one line, naming the line) on a malformed line.
bool parseMigMinors(std::string_view text, MigMinors* out, std::string* err);

// Reads path (kMigMinorsFile on a host). A missing file gives the fixed numbering (fromFile false)
// and true; a file that cannot be read or parsed: false with *err.
bool loadMigMinors(const std::string& path, MigMinors* out, std::string* err);

// The minor of a capability node: ci < 0 for the GPU instance's own. False with *err when the
// table has no such line (or, without a table, the IDs are outside the driver's ranges).
bool migCapMinor(const MigMinors& table, unsigned gpuMinor, unsigned gi, int ci, unsigned* out, std::string* err);

// The nodes of MIG device (gpuMinor, gi, ci), in the order /dev/nvidiaN, GI capability, CI
// capability. False with *err as migCapMinor.
bool migDeviceNodes(const MigMinors& table, unsigned gpuMinor, unsigned gi, unsigned ci,
                    std::vector<std::string>* nodes, std::string* err);

}  // namespace cushare::container
