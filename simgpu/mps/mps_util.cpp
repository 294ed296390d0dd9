// See mps_util.h.
#include "mps_util.h"

#include <limits.h>
#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace simgpu::mps {

std::vector<std::string> words(const std::string& line) {
  std::vector<std::string> out;
  std::istringstream in(line);
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

bool parseCount(const char* text, int min, int max, int* out) {
  if (!text || !*text) return false;
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(text, &end, 10);
  if (errno || *end || v < min || v > max || !(text[0] >= '0' && text[0] <= '9')) return false;
  *out = static_cast<int>(v);
  return true;
}

bool parsePercentage(const char* text, double* out) {
  if (!text || !*text || !((text[0] >= '0' && text[0] <= '9') || text[0] == '.')) return false;
  char* end = nullptr;
  const double v = std::strtod(text, &end);
  if (*end || !(v > 0) || v > 100) return false;
  *out = v;
  return true;
}

std::string formatPercentage(double pct) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f", pct);
  return b;
}

bool parseMemLimit(const std::string& text, uint64_t* bytes) {
  if (text.size() < 2) return false;
  const char unit = text.back();
  const int shift = unit == 'G' ? 30 : unit == 'M' ? 20 : -1;
  if (shift < 0) return false;
  int n = 0;
  if (!parseCount(text.substr(0, text.size() - 1).c_str(), 0, 1 << 24, &n)) return false;
  *bytes = static_cast<uint64_t>(n) << shift;
  return true;
}

std::string formatMemLimit(uint64_t bytes) {
  if (bytes >= (uint64_t{1} << 30)) return std::to_string(bytes >> 30) + "G";
  if (bytes == 0) return "0";
  return std::to_string(bytes >> 20) + "M";
}

bool makeDirs(const std::string& path, mode_t mode) {
  for (size_t i = 1; i <= path.size(); ++i) {
    if (i < path.size() && path[i] != '/') continue;
    const std::string p = path.substr(0, i);
    if (::mkdir(p.c_str(), mode) != 0 && errno != EEXIST) return false;
  }
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::string selfDir() {
  char b[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", b, sizeof b - 1);
  if (n <= 0) return ".";
  std::string s(b, static_cast<size_t>(n));
  return s.substr(0, s.rfind('/'));
}

std::string pidNamespace(pid_t pid) {
  char b[128];
  const std::string link = "/proc/" + std::to_string(pid) + "/ns/pid";
  const ssize_t n = readlink(link.c_str(), b, sizeof b - 1);
  if (n <= 0) return "-";
  std::string s(b, static_cast<size_t>(n));  // "pid:[4026531836]"
  const size_t open = s.find('['), close = s.find(']');
  return open == std::string::npos || close == std::string::npos ? s : s.substr(open + 1, close - open - 1);
}

std::string processCommand(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/cmdline");
  std::string argv0;
  std::getline(in, argv0, '\0');
  return argv0.empty() ? "-" : argv0;
}

gid_t primaryGid(uid_t uid) {
  const passwd* pw = getpwuid(uid);
  return pw ? pw->pw_gid : static_cast<gid_t>(uid);
}

}  // namespace simgpu::mps
