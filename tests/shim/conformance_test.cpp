// Conformance of libcushare.so's three roads into the driver (DESIGN decision 1), generated from
// the hook tables themselves: shim/interpose/hooks.def and nvml_hooks.def are included below with
// X-macros, so a symbol added there is checked here without touching this file. Runs with the
// shim preloaded on simgpu (CMakeLists.txt); nothing in it needs simgpu, so it also runs as is
// on a real driver.
//
// For every driver entry (symbol, base name, first version, per-thread flag):
//  (a) export road: dlsym(RTLD_DEFAULT, symbol) is the shim's own definition (dladdr names
//      libcushare.so and the symbol; the address is the one in libcushare.so's .dynsym);
//  (b) cuGetProcAddress_v2 and the first ABI cuGetProcAddress, at the entry's first version and at
//      13000, with CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM for a per-thread entry and the
//      default flag otherwise (and then every flag, which catches a hooked name whose other stream
//      variant is missing from the table): the shim answers the driver's result and status and
//      exactly its wrapper of the function the real driver picks. The oracle is the real driver's
//      own cuGetProcAddress_v2, called directly; its answer is named through libcuda's .dynsym;
//  (c) dlsym road: dlsym on a libcuda.so.1 handle (RTLD_NOLOAD and a fresh dlopen) and on the
//      program's handle gives the wrapper, where glibc alone gives the real function;
//  (d) NVML entries likewise, on a libnvidia-ml.so.1 handle.
// The oracle for "what would glibc's dlsym answer" is glibc's dlsym itself, found in the C
// library's own symbol table (every lookup of dlsym through the loader answers the shim's).
//
// RTLD_NEXT, as the shim defines it (checked below): for a hooked name it gives the shim's wrapper
// whoever asks. From the test executable that is also glibc's own answer (the preloaded shim comes
// right after the executable in the search order); from a library after the shim glibc would
// give the real function, and the shim substitutes its wrapper as it does on every road. For any
// other name RTLD_NEXT keeps glibc's meaning, relative to the caller (rtld_next_lib.cpp).
#include <cuda.h>
#include <dlfcn.h>
#include <elf.h>
#include <gtest/gtest.h>
#include <link.h>

#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <ostream>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "simgpu/nvml.h"

// The test executable's probe (exported: ENABLE_EXPORTS); rtld_next_lib.cpp defines 2 and 3.
extern "C" __attribute__((visibility("default"))) int cushare_test_probe() { return 1; }
extern "C" int cushare_test_next_probe_a();
extern "C" int cushare_test_next_probe_b();
extern "C" void* cushare_test_next_a(const char* name);
extern "C" void* cushare_test_next_b(const char* name);

namespace {

// ---- the tables under test ----
struct DriverHook {
  const char* symbol;
  const char* base;
  int version;
  bool perThread;
};

void PrintTo(const DriverHook& e, std::ostream* os) {
  *os << e.symbol << " (" << e.base << ", " << e.version << (e.perThread ? ", per-thread)" : ")");
}

constexpr DriverHook kDriverHooks[] = {
#define CUSHARE_DRIVER_HOOK(sym, base, ver, pt, params, args) {#sym, #base, ver, (pt) != 0},
#include "interpose/hooks.def"
#undef CUSHARE_DRIVER_HOOK
};

constexpr const char* kNvmlHooks[] = {
#define CUSHARE_NVML_HOOK(sym, params, args) #sym,
#include "interpose/nvml_hooks.def"
#undef CUSHARE_NVML_HOOK
};

constexpr int kNewestVersion = 13000;
constexpr cuuint64_t kAllFlags[] = {CU_GET_PROC_ADDRESS_DEFAULT, CU_GET_PROC_ADDRESS_LEGACY_STREAM,
                                    CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM};

using DlsymFn = void* (*)(void*, const char*);
using ProcV2 = CUresult (*)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);
using ProcV1 = CUresult (*)(const char*, void**, int, cuuint64_t);

const char* flagName(cuuint64_t f) {
  switch (f) {
    case CU_GET_PROC_ADDRESS_DEFAULT:
      return "DEFAULT";
    case CU_GET_PROC_ADDRESS_LEGACY_STREAM:
      return "LEGACY_STREAM";
    case CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM:
      return "PER_THREAD_DEFAULT_STREAM";
    default:
      return "?";
  }
}

std::string baseName(const char* path) {
  const char* s = std::strrchr(path, '/');
  return s ? s + 1 : path;
}

// ---- a small ELF .dynsym reader (the file on disk) ----
struct ElfSymbol {
  std::string name;
  uint64_t value;
};

// The defined global and weak symbols of an ELF64 object's .dynsym; empty and *error on failure.
std::vector<ElfSymbol> readDynamicSymbols(const std::string& path, std::string* error) {
  std::ifstream in(path, std::ios::binary);
  const std::string d((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  Elf64_Ehdr eh;
  if (d.size() < sizeof eh || std::memcmp(d.data(), ELFMAG, SELFMAG) != 0 ||
      d[EI_CLASS] != ELFCLASS64) {
    *error = path + ": not an ELF64 file";
    return {};
  }
  std::memcpy(&eh, d.data(), sizeof eh);
  auto section = [&](unsigned i, Elf64_Shdr* sh) {
    const uint64_t off = eh.e_shoff + uint64_t{i} * eh.e_shentsize;
    if (i >= eh.e_shnum || off + sizeof *sh > d.size()) return false;
    std::memcpy(sh, d.data() + off, sizeof *sh);
    return sh->sh_offset + sh->sh_size <= d.size() || sh->sh_type == SHT_NOBITS;
  };
  std::vector<ElfSymbol> out;
  for (unsigned i = 0; i < eh.e_shnum; ++i) {
    Elf64_Shdr sh, str;
    if (!section(i, &sh) || sh.sh_type != SHT_DYNSYM) continue;
    if (!section(sh.sh_link, &str)) break;
    for (uint64_t k = 1; k < sh.sh_size / sizeof(Elf64_Sym); ++k) {  // entry 0 is the null symbol
      Elf64_Sym s;
      std::memcpy(&s, d.data() + sh.sh_offset + k * sizeof s, sizeof s);
      const unsigned bind = ELF64_ST_BIND(s.st_info);
      if (s.st_shndx == SHN_UNDEF ||
          (bind != STB_GLOBAL && bind != STB_WEAK && bind != STB_GNU_UNIQUE))
        continue;
      if (s.st_name >= str.sh_size) continue;
      out.push_back({std::string(d.c_str() + str.sh_offset + s.st_name), s.st_value});
    }
    return out;
  }
  *error = path + ": no .dynsym section";
  return {};
}

// A loaded object: its file, load base and exported symbols.
struct LoadedObject {
  std::string path;
  uintptr_t base = 0;
  std::vector<ElfSymbol> symbols;

  void* address(const std::string& name) const {
    for (const auto& s : symbols)
      if (s.name == name) return reinterpret_cast<void*>(base + s.value);
    return nullptr;
  }
  std::vector<std::string> namesAt(const void* p) const {
    std::vector<std::string> names;
    for (const auto& s : symbols)
      if (base + s.value == reinterpret_cast<uintptr_t>(p)) names.push_back(s.name);
    return names;
  }
};

// The first loaded object whose file name starts with `prefix`.
bool findLoaded(const char* prefix, LoadedObject* out, std::string* error) {
  struct Search {
    const char* prefix;
    LoadedObject* out;
    bool found;
  } s{prefix, out, false};
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* arg) {
        auto* s = static_cast<Search*>(arg);
        if (!info->dlpi_name || baseName(info->dlpi_name).rfind(s->prefix, 0) != 0) return 0;
        s->out->path = info->dlpi_name;
        s->out->base = info->dlpi_addr;
        s->found = true;
        return 1;
      },
      &s);
  if (!s.found) {
    *error = std::string(prefix) + " is not loaded in this process";
    return false;
  }
  out->symbols = readDynamicSymbols(out->path, error);
  return !out->symbols.empty();
}

// ---- what the process looks like, gathered once ----
struct World {
  std::string error;  // non-empty: the process is not set up as the tests need
  LoadedObject shim, cuda, nvml;
  void* cudaHandle = nullptr;  // dlopen("libcuda.so.1", RTLD_NOLOAD)
  void* nvmlHandle = nullptr;  // dlopen("libnvidia-ml.so.1", RTLD_NOLOAD)
  DlsymFn glibcDlsym = nullptr;
  ProcV2 realProcV2 = nullptr, shimProcV2 = nullptr;
  ProcV1 realProcV1 = nullptr, shimProcV1 = nullptr;
  std::set<std::string> hooked;  // every table symbol, driver and NVML

  void* wrapper(const std::string& name) const { return shim.address(name); }
  bool isHooked(const std::string& name) const { return hooked.count(name) != 0; }
};

World gather() {
  World w;
  for (const auto& e : kDriverHooks) w.hooked.insert(e.symbol);
  for (const char* n : kNvmlHooks) w.hooked.insert(n);
  if (!findLoaded("libcushare.so", &w.shim, &w.error)) {
    w.error += " (run with LD_PRELOAD=libcushare.so, as ctest does)";
    return w;
  }
  // The executable links both (a reference keeps libnvidia-ml.so.1 under --as-needed).
  static void* volatile keepNvmlLinked = reinterpret_cast<void*>(&nvmlInit_v2);
  (void)keepNvmlLinked;
  w.cudaHandle = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  w.nvmlHandle = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (!w.cudaHandle || !w.nvmlHandle) {
    w.error = "libcuda.so.1 and libnvidia-ml.so.1 must already be loaded (the test links both)";
    return w;
  }
  if (!findLoaded("libcuda.so", &w.cuda, &w.error) ||
      !findLoaded("libnvidia-ml.so", &w.nvml, &w.error))
    return w;
  LoadedObject libc;
  if (!findLoaded("libc.so.6", &libc, &w.error)) return w;
  w.glibcDlsym = reinterpret_cast<DlsymFn>(libc.address("dlsym"));
  if (!w.glibcDlsym) {
    w.error = libc.path + " does not define dlsym";
    return w;
  }
  w.realProcV2 = reinterpret_cast<ProcV2>(w.glibcDlsym(w.cudaHandle, "cuGetProcAddress_v2"));
  w.realProcV1 = reinterpret_cast<ProcV1>(w.glibcDlsym(w.cudaHandle, "cuGetProcAddress"));
  w.shimProcV2 = reinterpret_cast<ProcV2>(w.wrapper("cuGetProcAddress_v2"));
  w.shimProcV1 = reinterpret_cast<ProcV1>(w.wrapper("cuGetProcAddress"));
  if (!w.realProcV2 || !w.realProcV1 || !w.shimProcV2 || !w.shimProcV1)
    w.error = "cuGetProcAddress/_v2 missing from the driver or the shim";
  return w;
}

const World& world() {
  static const World w = gather();
  return w;
}

// "0x... libcuda.so.1:cuMemAlloc_v2" for messages.
std::string describe(const void* p) {
  if (!p) return "null";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%p ", p);
  Dl_info i{};
  if (!dladdr(p, &i) || !i.dli_fname) return std::string(buf) + "(no object)";
  return std::string(buf) + baseName(i.dli_fname) + ":" + (i.dli_sname ? i.dli_sname : "?");
}

bool in(const void* p, const char* objectPrefix) {
  Dl_info i{};
  return p && dladdr(p, &i) && i.dli_fname && baseName(i.dli_fname).rfind(objectPrefix, 0) == 0;
}

// dlsym(RTLD_NEXT, ...) asked from the test executable, through the shim and through glibc alone.
// The calls must not be tail calls: the return address has to be in this executable.
__attribute__((noinline)) void* nextFromExecutable(const char* name) {
  void* volatile p = dlsym(RTLD_NEXT, name);
  return p;
}
__attribute__((noinline)) void* glibcNextFromExecutable(const char* name) {
  void* volatile p = world().glibcDlsym(RTLD_NEXT, name);
  return p;
}

// The functions the shim may answer when the driver answered `realFn`: the real function itself,
// unless it is one the shim hooks (by any of its names in libcuda), then the shim's wrapper of it.
std::set<void*> acceptableShimAnswers(void* realFn, std::vector<std::string>* realNames) {
  const World& w = world();
  *realNames = realFn ? w.cuda.namesAt(realFn) : std::vector<std::string>{};
  std::set<void*> ok;
  for (const auto& n : *realNames)
    if (w.isHooked(n)) ok.insert(w.wrapper(n));
  if (ok.empty()) ok.insert(realFn);
  return ok;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ",") + x;
  return s.empty() ? "(none)" : s;
}

// One cuGetProcAddress request asked of the real driver and of the shim, through both ABIs. The
// shim must give the driver's result and status and exactly the expected function. Returns the
// driver's names for its answer (empty when it found none).
std::vector<std::string> checkProcAddress(const char* name, int version, cuuint64_t flags) {
  const World& w = world();
  SCOPED_TRACE(std::string("cuGetProcAddress(\"") + name + "\", " + std::to_string(version) + ", " +
               flagName(flags) + ")");
  void* realFn = nullptr;
  void* shimFn = nullptr;
  auto realStatus = static_cast<CUdriverProcAddressQueryResult>(-1);
  auto shimStatus = static_cast<CUdriverProcAddressQueryResult>(-1);
  const CUresult realR = w.realProcV2(name, &realFn, version, flags, &realStatus);
  const CUresult shimR = w.shimProcV2(name, &shimFn, version, flags, &shimStatus);
  EXPECT_EQ(realR, shimR);
  EXPECT_EQ(realStatus, shimStatus);
  std::vector<std::string> names;
  const std::set<void*> ok = acceptableShimAnswers(realFn, &names);
  EXPECT_EQ(1u, ok.count(shimFn)) << "v2: the driver answered " << describe(realFn) << " ("
                                  << join(names) << "), the shim " << describe(shimFn);
  // The first ABI: same choice, errors reported as a result instead of a status.
  void* realFn1 = nullptr;
  void* shimFn1 = nullptr;
  const CUresult realR1 = w.realProcV1(name, &realFn1, version, flags);
  const CUresult shimR1 = w.shimProcV1(name, &shimFn1, version, flags);
  EXPECT_EQ(realR1, shimR1);
  EXPECT_EQ(realFn, realFn1) << "the driver's two ABIs disagree";
  EXPECT_EQ(1u, ok.count(shimFn1))
      << "v1: the driver answered " << describe(realFn1) << ", the shim " << describe(shimFn1);
  return names;
}

bool containsHooked(const std::vector<std::string>& names) {
  for (const auto& n : names)
    if (world().isHooked(n)) return true;
  return false;
}

class Roads : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ("", world().error); }
};

// ---- the table itself and the export list ----
using Table = Roads;

TEST_F(Table, ListsEverySymbolOnce) {
  std::set<std::string> seen;
  for (const auto& e : kDriverHooks)
    EXPECT_TRUE(seen.insert(e.symbol).second) << e.symbol << " listed twice";
  for (const char* n : kNvmlHooks) EXPECT_TRUE(seen.insert(n).second) << n << " listed twice";
  EXPECT_GT(seen.size(), 2u);
}

TEST_F(Table, LibraryExportsExactlyTheTableAndDlsym) {
  const World& w = world();
  std::set<std::string> expected = w.hooked;
  expected.insert({"dlsym", "dlvsym", "dlmopen"});
  // The tenant-facing reclaim API (common/include/cushare/reclaim.h, docs/memory-elasticity.md).
  expected.insert({"cushare_reclaim_fd", "cushare_reclaim_target"});
  std::set<std::string> exported;
  for (const auto& s : w.shim.symbols) exported.insert(s.name);
  for (const auto& n : exported)
    EXPECT_EQ(1u, expected.count(n)) << w.shim.path << " exports " << n << ", not in the table";
  for (const auto& n : expected)
    EXPECT_EQ(1u, exported.count(n)) << w.shim.path << " does not export " << n;
}

// ---- every driver entry, through every road ----
class DriverHookRoads : public ::testing::TestWithParam<DriverHook> {
 protected:
  void SetUp() override { ASSERT_EQ("", world().error); }
};

TEST_P(DriverHookRoads, ExportRoadIsTheShimsDefinition) {
  const DriverHook& e = GetParam();
  const World& w = world();
  void* p = dlsym(RTLD_DEFAULT, e.symbol);
  ASSERT_NE(nullptr, p);
  EXPECT_EQ(w.wrapper(e.symbol), p) << describe(p);
  Dl_info i{};
  ASSERT_NE(0, dladdr(p, &i));
  EXPECT_EQ("libcushare.so", baseName(i.dli_fname));
  ASSERT_NE(nullptr, i.dli_sname);
  EXPECT_STREQ(e.symbol, i.dli_sname);
  // What glibc alone finds first is the same definition: the shim really is in front.
  EXPECT_EQ(p, w.glibcDlsym(RTLD_DEFAULT, e.symbol));
  // And the driver has the function the wrapper stands for.
  EXPECT_TRUE(in(w.glibcDlsym(w.cudaHandle, e.symbol), "libcuda.so"))
      << e.symbol << " missing from the driver";
}

TEST_P(DriverHookRoads, ProcAddressAnswersTheWrapperOfTheDriversChoice) {
  const DriverHook& e = GetParam();
  const cuuint64_t flags =
      e.perThread ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM : CU_GET_PROC_ADDRESS_DEFAULT;
  for (int version : {e.version, kNewestVersion}) {
    const auto names = checkProcAddress(e.base, version, flags);
    if (version == e.version) {
      EXPECT_NE(names.end(), std::find(names.begin(), names.end(), std::string(e.symbol)))
          << "at its first version " << e.version << " with " << flagName(flags)
          << " the driver answers " << join(names) << " for " << e.base << ", not " << e.symbol
          << ": hooks.def has the wrong base, "
          << "version or per-thread flag";
    }
    EXPECT_TRUE(containsHooked(names))
        << "the driver answers " << join(names) << " for " << e.base << " at " << version
        << ": not in hooks.def, so that road bypasses the shim";
  }
}

TEST_P(DriverHookRoads, ProcAddressWrapsEveryStreamVariantOfAHookedName) {
  const DriverHook& e = GetParam();
  for (int version : {e.version, kNewestVersion})
    for (cuuint64_t flags : kAllFlags) {
      const auto names = checkProcAddress(e.base, version, flags);
      EXPECT_TRUE(containsHooked(names))
          << e.base << " at " << version << " with " << flagName(flags) << ": the driver answers "
          << join(names) << ", not in hooks.def, so that road bypasses the shim";
    }
}

TEST_P(DriverHookRoads, TheTablesFirstVersionIsTheDriversFirstVersion) {
  const DriverHook& e = GetParam();
  const cuuint64_t flags =
      e.perThread ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM : CU_GET_PROC_ADDRESS_DEFAULT;
  const auto names = checkProcAddress(e.base, e.version - 1, flags);  // an older ABI, or none
  EXPECT_EQ(names.end(), std::find(names.begin(), names.end(), std::string(e.symbol)))
      << "the driver already answers " << e.symbol << " at " << e.version - 1;
}

TEST_P(DriverHookRoads, DlsymRoadGivesTheWrapper) {
  const DriverHook& e = GetParam();
  const World& w = world();
  void* wrapper = w.wrapper(e.symbol);
  ASSERT_NE(nullptr, wrapper);
  // glibc alone gives the driver's function on the driver's handle: the shim substitutes it.
  EXPECT_TRUE(in(w.glibcDlsym(w.cudaHandle, e.symbol), "libcuda.so"));
  dlerror();
  EXPECT_EQ(wrapper, dlsym(w.cudaHandle, e.symbol)) << describe(dlsym(w.cudaHandle, e.symbol));
  EXPECT_EQ(nullptr, dlerror()) << "a successful dlsym must leave no error behind";
  void* fresh = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
  ASSERT_NE(nullptr, fresh);
  EXPECT_EQ(wrapper, dlsym(fresh, e.symbol));
  dlclose(fresh);
  void* program = dlopen(nullptr, RTLD_NOW);
  EXPECT_EQ(wrapper, dlsym(program, e.symbol));
  EXPECT_EQ(wrapper, dlsym(RTLD_DEFAULT, e.symbol));
  // RTLD_NEXT from the executable: the wrapper, which is also glibc's own answer from here.
  EXPECT_EQ(wrapper, nextFromExecutable(e.symbol));
  EXPECT_EQ(wrapper, glibcNextFromExecutable(e.symbol));
  // RTLD_NEXT from a library after the shim: glibc alone would give libcuda's function; the shim
  // gives its wrapper (every road into a hooked function is limited).
  EXPECT_EQ(wrapper, cushare_test_next_a(e.symbol)) << describe(cushare_test_next_a(e.symbol));
  // A handle whose scope lacks the name: glibc's answer (null), nothing substituted.
  EXPECT_EQ(w.glibcDlsym(w.nvmlHandle, e.symbol), dlsym(w.nvmlHandle, e.symbol));
}

INSTANTIATE_TEST_SUITE_P(HooksDef, DriverHookRoads, ::testing::ValuesIn(kDriverHooks),
                         [](const ::testing::TestParamInfo<DriverHook>& i) {
                           return std::string(i.param.symbol);
                         });

// ---- every NVML entry ----
class NvmlHookRoads : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override { ASSERT_EQ("", world().error); }
};

TEST_P(NvmlHookRoads, ExportAndDlsymRoadsGiveTheWrapper) {
  const char* sym = GetParam();
  const World& w = world();
  void* wrapper = w.wrapper(sym);
  ASSERT_NE(nullptr, wrapper);
  Dl_info i{};
  ASSERT_NE(0, dladdr(dlsym(RTLD_DEFAULT, sym), &i));
  EXPECT_EQ("libcushare.so", baseName(i.dli_fname));
  EXPECT_STREQ(sym, i.dli_sname);
  EXPECT_EQ(wrapper, dlsym(RTLD_DEFAULT, sym));
  void* real = w.glibcDlsym(w.nvmlHandle, sym);
  EXPECT_TRUE(in(real, "libnvidia-ml.so")) << describe(real);
  EXPECT_EQ(w.nvml.address(sym), real);
  dlerror();
  EXPECT_EQ(wrapper, dlsym(w.nvmlHandle, sym)) << describe(dlsym(w.nvmlHandle, sym));
  EXPECT_EQ(nullptr, dlerror());
  void* fresh = dlopen("libnvidia-ml.so.1", RTLD_LAZY | RTLD_LOCAL);
  ASSERT_NE(nullptr, fresh);
  EXPECT_EQ(wrapper, dlsym(fresh, sym));
  dlclose(fresh);
  EXPECT_EQ(wrapper, nextFromExecutable(sym));
  EXPECT_EQ(wrapper, cushare_test_next_a(sym));
  EXPECT_EQ(w.glibcDlsym(w.cudaHandle, sym), dlsym(w.cudaHandle, sym));  // not in libcuda's scope
}

INSTANTIATE_TEST_SUITE_P(NvmlHooksDef, NvmlHookRoads, ::testing::ValuesIn(kNvmlHooks),
                         [](const ::testing::TestParamInfo<const char*>& i) {
                           return std::string(i.param);
                         });

// ---- what the shim must leave alone ----
using Unhooked = Roads;

TEST_F(Unhooked, DriverNameComesFromTheDriverThroughEveryRoad) {
  const World& w = world();
  const char* name = "cuStreamCreate";
  ASSERT_FALSE(w.isHooked(name)) << "pick another unhooked name";
  void* real = w.cuda.address(name);
  ASSERT_TRUE(in(real, "libcuda.so")) << describe(real);
  EXPECT_EQ(real, dlsym(RTLD_DEFAULT, name)) << describe(dlsym(RTLD_DEFAULT, name));
  EXPECT_EQ(real, dlsym(w.cudaHandle, name));
  EXPECT_EQ(real, nextFromExecutable(name));
  EXPECT_EQ(real, cushare_test_next_a(name));
  EXPECT_EQ(real, cushare_test_next_b(name));
  for (int version : {2000, 12000, kNewestVersion})
    for (cuuint64_t flags : kAllFlags) {
      const auto names = checkProcAddress(name, version, flags);
      EXPECT_FALSE(names.empty());
    }
  void* viaProc = nullptr;
  CUdriverProcAddressQueryResult st;
  ASSERT_EQ(CUDA_SUCCESS,
            w.shimProcV2(name, &viaProc, kNewestVersion, CU_GET_PROC_ADDRESS_DEFAULT, &st));
  EXPECT_EQ(real, viaProc) << describe(viaProc);
}

TEST_F(Unhooked, NvmlNameComesFromNvml) {
  const World& w = world();
  for (const char* name : {"nvmlShutdown", "nvmlDeviceGetCount_v2", "nvmlDeviceGetUUID"}) {
    ASSERT_FALSE(w.isHooked(name));
    void* real = w.nvml.address(name);
    ASSERT_TRUE(in(real, "libnvidia-ml.so")) << name;
    EXPECT_EQ(real, dlsym(w.nvmlHandle, name)) << name;
    EXPECT_EQ(real, dlsym(RTLD_DEFAULT, name)) << name;
    EXPECT_EQ(real, nextFromExecutable(name)) << name;
  }
}

TEST_F(Unhooked, UnknownNameIsNotFoundThroughEveryRoad) {
  const World& w = world();
  for (const char* name :
       {"cuNoSuchFunction", "cuMemAlloc_v9", "nvmlNoSuchFunction", "cushare_no_such_symbol"}) {
    SCOPED_TRACE(name);
    for (void* h : {RTLD_DEFAULT, w.cudaHandle, w.nvmlHandle}) {
      dlerror();
      EXPECT_EQ(nullptr, dlsym(h, name));
      EXPECT_NE(nullptr, dlerror()) << "a failed dlsym must set dlerror";
    }
    EXPECT_EQ(nullptr, nextFromExecutable(name));
    EXPECT_EQ(nullptr, cushare_test_next_a(name));
    void* fn = reinterpret_cast<void*>(&dlerror);  // must be overwritten with null
    auto st = static_cast<CUdriverProcAddressQueryResult>(-1);
    EXPECT_EQ(CUDA_SUCCESS,
              w.shimProcV2(name, &fn, kNewestVersion, CU_GET_PROC_ADDRESS_DEFAULT, &st));
    EXPECT_EQ(CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND, st);
    EXPECT_EQ(nullptr, fn);
    fn = reinterpret_cast<void*>(&dlerror);
    EXPECT_EQ(CUDA_ERROR_NOT_FOUND,
              w.shimProcV1(name, &fn, kNewestVersion, CU_GET_PROC_ADDRESS_DEFAULT));
    checkProcAddress(name, kNewestVersion, CU_GET_PROC_ADDRESS_DEFAULT);
  }
}

TEST_F(Unhooked, HookedNameBelowItsFirstVersionKeepsTheDriversStatus) {
  // cuMemAllocAsync exists from 11020 only: the driver answers VERSION_NOT_SUFFICIENT below.
  const auto names = checkProcAddress("cuMemAllocAsync", 11000, CU_GET_PROC_ADDRESS_DEFAULT);
  EXPECT_TRUE(names.empty());
  void* fn = nullptr;
  CUdriverProcAddressQueryResult st;
  ASSERT_EQ(CUDA_SUCCESS,
            world().shimProcV2("cuMemAllocAsync", &fn, 11000, CU_GET_PROC_ADDRESS_DEFAULT, &st));
  EXPECT_EQ(CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT, st);
  EXPECT_EQ(nullptr, fn);
}

// ---- RTLD_NEXT keeps its meaning for other libraries ----
using RtldNext = Roads;

TEST_F(RtldNext, IsRelativeToTheCallingLibrary) {
  // Search order: executable (1), libcushare.so (none), A (2), B (3).
  EXPECT_EQ(1, cushare_test_probe());
  auto call = [](void* p) { return p ? reinterpret_cast<int (*)()>(p)() : -1; };
  EXPECT_EQ(2, call(glibcNextFromExecutable("cushare_test_probe")))
      << "the search order is not the one assumed";
  EXPECT_EQ(2, call(nextFromExecutable("cushare_test_probe")));
  EXPECT_EQ(3, cushare_test_next_probe_a())
      << "RTLD_NEXT from library A must find B's probe, not A's own: "
         "the shim's dlsym resolved it from the wrong position";
  EXPECT_EQ(-1, cushare_test_next_probe_b()) << "nothing after B defines the probe";
}

TEST_F(RtldNext, NonCudaNamesKeepTheirMeaning) {
  // A name that does not start with "cu" or "nvml" takes the shim's shortest path.
  for (const char* name : {"dlsym", "malloc", "pthread_create"}) {
    EXPECT_EQ(glibcNextFromExecutable(name), nextFromExecutable(name)) << name;
  }
}

// ---- the same after cuInit (the shim's device phase has run) ----
using AfterInit = Roads;

TEST_F(AfterInit, RoadsAnswerTheSame) {
  ASSERT_EQ(CUDA_SUCCESS, cuInit(0));
  const World& w = world();
  for (const auto& e : kDriverHooks) {
    const cuuint64_t flags =
        e.perThread ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM : CU_GET_PROC_ADDRESS_DEFAULT;
    checkProcAddress(e.base, e.version, flags);
    checkProcAddress(e.base, kNewestVersion, flags);
    EXPECT_EQ(w.wrapper(e.symbol), dlsym(w.cudaHandle, e.symbol)) << e.symbol;
  }
  for (const char* n : kNvmlHooks) EXPECT_EQ(w.wrapper(n), dlsym(w.nvmlHandle, n)) << n;
}

// ---- first use from several threads at once (run alone: conformance_first_use) ----
// The shim loads the real driver lazily from three places: the first hooked call, the first
// dlsym of a hooked name on a driver handle and the first NVML call. They must agree and must not
// race (a TSan build checks the second part).
TEST(FirstUse, ConcurrentFirstCallsAgree) {
  void* cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  void* nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_NOLOAD);
  ASSERT_NE(nullptr, cuda);
  ASSERT_NE(nullptr, nvml);
  // Through RTLD_DEFAULT the shim answers its own definition without loading anything.
  void* const allocWrapper = dlsym(RTLD_DEFAULT, "cuMemAlloc_v2");
  void* const nvmlWrapper = dlsym(RTLD_DEFAULT, "nvmlDeviceGetMemoryInfo");
  auto procV2 = reinterpret_cast<ProcV2>(dlsym(RTLD_DEFAULT, "cuGetProcAddress_v2"));
  ASSERT_TRUE(in(allocWrapper, "libcushare.so"));
  ASSERT_TRUE(in(nvmlWrapper, "libcushare.so"));
  ASSERT_NE(nullptr, procV2);
  constexpr int kThreads = 8;
  std::atomic<int> ready{0};
  std::vector<void*> got(kThreads, nullptr);
  std::vector<int> result(kThreads, -1);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      ready.fetch_add(1);
      while (ready.load() < kThreads) {
      }
      switch (t % 4) {
        case 0:
          got[t] = dlsym(cuda, "cuMemAlloc_v2");
          break;
        case 1: {
          CUdriverProcAddressQueryResult st;
          result[t] = procV2("cuMemAlloc", &got[t], 12000, CU_GET_PROC_ADDRESS_DEFAULT, &st);
          break;
        }
        case 2:
          result[t] = cuInit(0);
          break;
        case 3:
          got[t] = dlsym(nvml, "nvmlDeviceGetMemoryInfo");
          break;
      }
    });
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) {
    SCOPED_TRACE(t);
    switch (t % 4) {
      case 0:
        EXPECT_EQ(allocWrapper, got[t]) << describe(got[t]);
        break;
      case 1:
        EXPECT_EQ(CUDA_SUCCESS, result[t]);
        EXPECT_EQ(allocWrapper, got[t]) << describe(got[t]);
        break;
      case 2:
        EXPECT_EQ(CUDA_SUCCESS, result[t]);
        break;
      case 3:
        EXPECT_EQ(nvmlWrapper, got[t]) << describe(got[t]);
        break;
    }
  }
}

}  // namespace
