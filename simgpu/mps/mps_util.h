// Small pieces shared by the simulated MPS binaries: parsing of command arguments in the real
// daemon's syntax, their display, and facts about processes and paths.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace simgpu::mps {

std::vector<std::string> words(const std::string& line);
// A decimal integer in [min, max], nothing else.
bool parseCount(const char* text, int min, int max, int* out);
// An active thread percentage: a number above 0 and at most 100 ("25", "33.3").
bool parsePercentage(const char* text, double* out);
std::string formatPercentage(double pct);  // "25.0"
// A pinned memory limit: an integer followed by G or M ("10G", "1044M").
bool parseMemLimit(const std::string& text, uint64_t* bytes);
// Whole GiB rounded down when at least 1 GiB ("1044M" reads back "1G"), else MiB; 0 is "0".
std::string formatMemLimit(uint64_t bytes);
bool makeDirs(const std::string& path, mode_t mode);
std::string selfDir();  // the directory of this executable
std::string pidNamespace(pid_t pid);   // the inode of its pid namespace, "4026531836"
std::string processCommand(pid_t pid);  // its argv[0]
gid_t primaryGid(uid_t uid);

}  // namespace simgpu::mps
