// The kernel cost table (see cost_table.h).
#include "cost_table.h"

#include <cxxabi.h>
#include <fnmatch.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "cushare/parse.h"

namespace simgpu {

std::string kernelSourceName(const std::string& mangled) {
  int status = 0;
  char* d = abi::__cxa_demangle(mangled.c_str(), nullptr, nullptr, &status);
  if (status != 0 || !d) return mangled;
  std::string s(d);
  std::free(d);
  // Cut the parameter list: the '(' that matches the last top-level ')'.
  int depth = 0;
  size_t open = std::string::npos;
  for (size_t i = s.size(); i-- > 0;) {
    if (s[i] == ')') ++depth;
    if (s[i] == '(' && --depth == 0) {
      open = i;
      break;
    }
  }
  if (open != std::string::npos) s.resize(open);
  // Drop a return type (templates carry one): the text up to the last top-level space.
  depth = 0;
  size_t cut = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '<' || s[i] == '(') ++depth;
    if (s[i] == '>' || s[i] == ')') --depth;
    if (s[i] == ' ' && depth == 0) cut = i + 1;
  }
  return s.substr(cut);
}

const CostRule* CostTable::match(const std::string& mangled) const {
  if (rules.empty()) return nullptr;
  const std::string source = kernelSourceName(mangled);
  for (const CostRule& r : rules)
    if (fnmatch(r.pattern.c_str(), source.c_str(), 0) == 0 || fnmatch(r.pattern.c_str(), mangled.c_str(), 0) == 0)
      return &r;
  return nullptr;
}

bool parseCostTable(const std::string& text, CostTable* out, std::string* error) {
  std::istringstream in(text);
  std::string line;
  int n = 0;
  auto bad = [&](const std::string& why) {
    *error = "line " + std::to_string(n) + ": " + why;
    return false;
  };
  out->rules.clear();
  while (std::getline(in, line)) {
    ++n;
    if (const size_t hash = line.find('#'); hash != std::string::npos) line.resize(hash);
    std::istringstream words(line);
    CostRule r;
    if (!(words >> r.pattern)) continue;
    if (r.pattern.find('=') != std::string::npos) return bad("expected a kernel name pattern before '" + r.pattern + "'");
    bool haveNs = false, haveParam = false;
    std::string kv;
    while (words >> kv) {
      const size_t eq = kv.find('=');
      if (eq == std::string::npos) return bad("expected key=value, got '" + kv + "'");
      const std::string key = kv.substr(0, eq), value = kv.substr(eq + 1);
      int64_t v;
      std::string why;
      if (key == "block_ns") {
        if (haveNs) return bad("block_ns given twice");
        if (!cushare::parseInt(value, 0, 1'000'000'000'000, &v, &why)) return bad("block_ns='" + value + "': " + why);
        r.blockNs = static_cast<uint64_t>(v);
        haveNs = true;
      } else if (key == "block_ns_param") {
        if (haveParam) return bad("block_ns_param given twice");
        if (!cushare::parseInt(value, 0, 255, &v, &why)) return bad("block_ns_param='" + value + "': " + why);
        r.param = static_cast<int>(v);
        haveParam = true;
      } else {
        return bad("unknown key '" + key + "' (expected block_ns or block_ns_param)");
      }
    }
    if (haveNs == haveParam) return bad("a rule needs exactly one of block_ns=N and block_ns_param=I");
    out->rules.push_back(std::move(r));
  }
  return true;
}

bool loadCostTable(const std::string& path, CostTable* out, std::string* error) {
  std::ifstream f(path);
  if (!f) {
    *error = "cannot read the file";
    return false;
  }
  std::ostringstream s;
  s << f.rdbuf();
  return parseCostTable(s.str(), out, error);
}

}  // namespace simgpu
