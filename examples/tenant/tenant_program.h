// What the demo's tenant programs share: their output label, option parsing and CUDA error lines.
#pragma once

#include <cuda.h>

#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <string_view>

#include "cushare/parse.h"

namespace tenant_program {

// The label that starts every line of output: $CUSHARE_TENANT, else "default" (--name replaces it).
inline std::string defaultLabel() {
  const char* tenant = std::getenv("CUSHARE_TENANT");
  return tenant && *tenant ? tenant : "default";
}

// Walks argv as "--option value" pairs of the known options, calling set(option, value, &why)
// for each. On a usage error (an unknown option, one without a value, a value set refuses)
// returns false with *err set to one line.
template <class Set>
bool parseOptions(int argc, char** argv, std::initializer_list<std::string_view> known, Set set, std::string* err) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view opt = argv[i];
    bool isKnown = false;
    for (const std::string_view k : known) isKnown = isKnown || opt == k;
    if (!isKnown) {
      *err = "unknown argument '" + cushare::printable(opt, 64) + "'";
      return false;
    }
    if (i + 1 == argc) {
      *err = std::string(opt) + " needs a value";
      return false;
    }
    std::string why;
    if (!set(opt, std::string_view(argv[++i]), &why)) {
      *err = std::string(opt) + ": " + why;
      return false;
    }
  }
  return true;
}

// The start of main: stdout a line at a time (also into a pipe or a log); --help or -h prints the
// usage (0); parse(&err) failing prints "<program>: <err>" and the usage on stderr (2). -1: go on.
template <class Parse>
int begin(const char* program, const char* usage, int argc, char** argv, Parse parse) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  if (argc == 2 && (std::string_view(argv[1]) == "--help" || std::string_view(argv[1]) == "-h")) {
    std::fputs(usage, stdout);
    return 0;
  }
  std::string err;
  if (!parse(&err)) {
    std::fprintf(stderr, "%s: %s\n%s", program, err.c_str(), usage);
    return 2;
  }
  return -1;
}

// True for CUDA_SUCCESS; otherwise prints "<program>: <what>: <text> (<name>)" on stderr.
inline bool cudaOk(const char* program, CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return true;
  const char* name = nullptr;
  const char* text = nullptr;
  cuGetErrorName(r, &name);
  cuGetErrorString(r, &text);
  std::fprintf(stderr, "%s: %s: %s (%s)\n", program, what, text ? text : "unknown error",
               name ? name : "unknown CUresult");
  return false;
}

}  // namespace tenant_program
