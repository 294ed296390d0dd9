// simgpu's entry-point lookup: cuGetProcAddress (both ABIs), the exported symbol set, unimplemented exports, SIMGPU_TRACE.
//
// cudart finds every driver function through cuGetProcAddress_v2 by base name, cudaVersion and
// flags; libraries and interposers dlsym the real ABI names. Both roads must lead to the same
// functions. The symbol list the real driver exports is read from the toolkit's stub libcuda.so
// (SIMGPU_TEST_STUB_LIBCUDA) with a small ELF .dynsym reader.
#include <cuda.h>
#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "cu_check.h"

namespace {


// The simulated driver as a dlopen handle: already loaded (the test links it).
void* driverHandle() {
  static void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  return h;
}

void* sym(const char* name) { return dlsym(driverHandle(), name); }

struct Lookup {
  CUresult result;
  void* fn;
  CUdriverProcAddressQueryResult status;
};
Lookup lookup(const char* name, int version, cuuint64_t flags = CU_GET_PROC_ADDRESS_DEFAULT) {
  Lookup l{CUDA_ERROR_UNKNOWN, reinterpret_cast<void*>(0x1), static_cast<CUdriverProcAddressQueryResult>(-1)};
  l.result = cuGetProcAddress_v2(name, &l.fn, version, flags, &l.status);
  return l;
}

// Function symbols defined in an ELF shared object's .dynsym (what `nm -D --defined-only` lists as T).
std::vector<std::string> definedFunctions(const char* path) {
  std::ifstream f(path, std::ios::binary);
  const std::vector<char> data((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<std::string> out;
  if (data.size() < sizeof(Elf64_Ehdr)) return out;
  Elf64_Ehdr eh;
  std::memcpy(&eh, data.data(), sizeof eh);
  if (std::memcmp(eh.e_ident, ELFMAG, SELFMAG) != 0 || eh.e_ident[EI_CLASS] != ELFCLASS64) return out;
  if (eh.e_shoff + static_cast<size_t>(eh.e_shnum) * sizeof(Elf64_Shdr) > data.size()) return out;
  auto section = [&](size_t i) {
    Elf64_Shdr s;
    std::memcpy(&s, data.data() + eh.e_shoff + i * sizeof(Elf64_Shdr), sizeof s);
    return s;
  };
  for (size_t i = 0; i < eh.e_shnum; ++i) {
    const Elf64_Shdr s = section(i);
    if (s.sh_type != SHT_DYNSYM || s.sh_link >= eh.e_shnum) continue;
    const Elf64_Shdr strs = section(s.sh_link);
    if (s.sh_offset + s.sh_size > data.size() || strs.sh_offset + strs.sh_size > data.size()) return out;
    for (size_t k = 0; k < s.sh_size / sizeof(Elf64_Sym); ++k) {
      Elf64_Sym y;
      std::memcpy(&y, data.data() + s.sh_offset + k * sizeof(Elf64_Sym), sizeof y);
      if (y.st_shndx == SHN_UNDEF || ELF64_ST_TYPE(y.st_info) != STT_FUNC) continue;
      if (ELF64_ST_BIND(y.st_info) != STB_GLOBAL || y.st_name >= strs.sh_size) continue;
      out.emplace_back(data.data() + strs.sh_offset + y.st_name);
    }
  }
  return out;
}

// Runs this executable again on `filter` with extra environment; returns its stderr.
std::string runSelfStderr(const std::string& filter, const std::vector<std::string>& env, int* status) {
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) return {};
  self[n] = 0;
  int fds[2];
  if (pipe(fds) != 0) return {};
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(fds[1], 2);
    const int devnull = open("/dev/null", O_WRONLY);
    if (devnull >= 0) dup2(devnull, 1);  // the child's own test report is not wanted
    close(fds[0]);
    close(fds[1]);
    for (const std::string& e : env) putenv(const_cast<char*>(e.c_str()));
    const std::string arg = "--gtest_filter=" + filter;
    execl(self, self, arg.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  close(fds[1]);
  std::string out;
  char buf[4096];
  ssize_t r;
  while ((r = read(fds[0], buf, sizeof buf)) > 0) out.append(buf, static_cast<size_t>(r));
  close(fds[0]);
  waitpid(pid, status, 0);
  return out;
}

class ProcAddress : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ASSERT_EQ(CUDA_SUCCESS, cuInit(0));
    ASSERT_NE(driverHandle(), nullptr) << "libcuda.so.1 is not loaded";
  }
};

TEST_F(ProcAddress, TheDriverIsSimgpu) {
  Dl_info info{};
  ASSERT_NE(dladdr(sym("cuInit"), &info), 0);
  EXPECT_NE(std::string(info.dli_fname).find("simgpu"), std::string::npos) << info.dli_fname;
}

TEST_F(ProcAddress, CudartProbe) {
  // cudart's first call: empty name, version 0, no flags.
  const Lookup l = lookup("", 0, 0);
  EXPECT_EQ(l.result, CUDA_SUCCESS);
  EXPECT_EQ(l.status, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
  EXPECT_EQ(l.fn, nullptr);
}

TEST_F(ProcAddress, VersionSelectsTheAbi) {
  void* v2 = sym("cuMemAlloc_v2");
  void* v1 = sym("cuMemAlloc");
  ASSERT_NE(v2, nullptr);
  ASSERT_NE(v1, nullptr);
  EXPECT_NE(v1, v2);
  Lookup l = lookup("cuMemAlloc", 3020);
  EXPECT_EQ(l.result, CUDA_SUCCESS);
  EXPECT_EQ(l.status, CU_GET_PROC_ADDRESS_SUCCESS);
  EXPECT_EQ(l.fn, v2);
  l = lookup("cuMemAlloc", 13000);
  EXPECT_EQ(l.fn, v2);
  l = lookup("cuMemAlloc", 2000);
  EXPECT_EQ(l.status, CU_GET_PROC_ADDRESS_SUCCESS);
  EXPECT_EQ(l.fn, v1);
  l = lookup("cuMemAlloc", 3010);  // between the ABIs: the older one
  EXPECT_EQ(l.fn, v1);

  const Lookup old = lookup("cuCtxGetDevice", 2000);
  const Lookup cur = lookup("cuCtxGetDevice", 13000);
  EXPECT_EQ(old.status, CU_GET_PROC_ADDRESS_SUCCESS);
  EXPECT_EQ(cur.status, CU_GET_PROC_ADDRESS_SUCCESS);
  EXPECT_NE(old.fn, cur.fn) << "cuCtxGetDevice has a different signature from 13.0";
  EXPECT_EQ(old.fn, sym("cuCtxGetDevice"));
  EXPECT_EQ(cur.fn, sym("cuCtxGetDevice_v2"));
  EXPECT_EQ(lookup("cuCtxGetDevice", 12090).fn, old.fn);

  // The symbol status argument is optional.
  void* fn = nullptr;
  CU_ASSERT(cuGetProcAddress_v2("cuInit", &fn, 12000, 0, nullptr));
  EXPECT_EQ(fn, sym("cuInit"));
}

TEST_F(ProcAddress, PerThreadDefaultStreamVariants) {
  Lookup l = lookup("cuMemcpyHtoD", 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM);
  EXPECT_EQ(l.status, CU_GET_PROC_ADDRESS_SUCCESS);
  ASSERT_NE(sym("cuMemcpyHtoD_v2_ptds"), nullptr);
  EXPECT_EQ(l.fn, sym("cuMemcpyHtoD_v2_ptds"));
  l = lookup("cuMemcpyHtoD", 12000, CU_GET_PROC_ADDRESS_LEGACY_STREAM);
  EXPECT_EQ(l.fn, sym("cuMemcpyHtoD_v2"));
  l = lookup("cuMemcpyHtoD", 12000);
  EXPECT_EQ(l.fn, sym("cuMemcpyHtoD_v2"));
  l = lookup("cuLaunchKernel", 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM);
  EXPECT_EQ(l.fn, sym("cuLaunchKernel_ptsz"));
  l = lookup("cuStreamSynchronize", 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM);
  EXPECT_EQ(l.fn, sym("cuStreamSynchronize_ptsz"));
  // No per-thread variant: the ordinary function.
  l = lookup("cuMemAlloc", 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM);
  EXPECT_EQ(l.status, CU_GET_PROC_ADDRESS_SUCCESS);
  EXPECT_EQ(l.fn, sym("cuMemAlloc_v2"));
  // Undefined flag bits are refused.
  void* fn = nullptr;
  CUdriverProcAddressQueryResult st;
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuGetProcAddress_v2("cuMemAlloc", &fn, 12000, 0x100, &st));
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuGetProcAddress_v2(nullptr, &fn, 12000, 0, &st));
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_VALUE, cuGetProcAddress_v2("cuMemAlloc", nullptr, 12000, 0, &st));
}

// Requests cudart 13 makes, and the ABI each must get (the symbol the real driver exports for it).
TEST_F(ProcAddress, KnownRequestsMapToTheirAbi) {
  struct Case {
    const char* name;
    int version;
    cuuint64_t flags;
    const char* symbol;
  };
  const Case cases[] = {
      {"cuCtxCreate", 3020, 0, "cuCtxCreate_v2"},
      {"cuCtxCreate", 11040, 0, "cuCtxCreate_v3"},
      {"cuCtxCreate", 13000, 0, "cuCtxCreate_v4"},
      {"cuEventElapsedTime", 2000, 0, "cuEventElapsedTime"},
      {"cuEventElapsedTime", 12080, 0, "cuEventElapsedTime_v2"},
      {"cuGraphInstantiate", 10000, 0, "cuGraphInstantiate"},
      {"cuGraphInstantiate", 11000, 0, "cuGraphInstantiate_v2"},
      {"cuGraphInstantiateWithParams", 12000, 2, "cuGraphInstantiateWithParams_ptsz"},
      {"cuStreamGetCaptureInfo", 10010, 2, "cuStreamGetCaptureInfo_ptsz"},
      {"cuStreamGetCaptureInfo", 11030, 0, "cuStreamGetCaptureInfo_v2"},
      {"cuStreamGetCaptureInfo", 11030, 2, "cuStreamGetCaptureInfo_v2_ptsz"},
      {"cuStreamGetCaptureInfo", 12030, 0, "cuStreamGetCaptureInfo_v3"},
      {"cuStreamGetCaptureInfo", 12030, 2, "cuStreamGetCaptureInfo_v3_ptsz"},
      {"cuDeviceTotalMem", 3020, 0, "cuDeviceTotalMem_v2"},
      {"cuDeviceGetUuid", 9020, 0, "cuDeviceGetUuid"},
      {"cuDeviceGetUuid", 11040, 0, "cuDeviceGetUuid_v2"},
      {"cuDevicePrimaryCtxRelease", 11000, 0, "cuDevicePrimaryCtxRelease_v2"},
      {"cuMemcpyAsync", 7000, 2, "cuMemcpyAsync_ptsz"},
      {"cuMemcpy", 7000, 2, "cuMemcpy_ptds"},
      {"cuStreamBeginCapture", 10010, 0, "cuStreamBeginCapture_v2"},
      {"cuStreamBeginCapture", 10010, 2, "cuStreamBeginCapture_v2_ptsz"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(c.name) + "@" + std::to_string(c.version) + " flags " + std::to_string(c.flags));
    const Lookup l = lookup(c.name, c.version, c.flags);
    EXPECT_EQ(l.result, CUDA_SUCCESS);
    EXPECT_EQ(l.status, CU_GET_PROC_ADDRESS_SUCCESS);
    void* want = sym(c.symbol);
    ASSERT_NE(want, nullptr) << c.symbol << " is not exported";
    Dl_info got{};
    EXPECT_EQ(l.fn, want) << "got " << (l.fn && dladdr(l.fn, &got) && got.dli_sname ? got.dli_sname : "?")
                          << ", want " << c.symbol;
  }
}

TEST_F(ProcAddress, UnknownAndTooOld) {
  Lookup l = lookup("cuNoSuchFunction", 13000);
  EXPECT_EQ(l.result, CUDA_SUCCESS);
  EXPECT_EQ(l.status, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
  EXPECT_EQ(l.fn, nullptr);
  l = lookup("cuMemAlloc_v2", 13000);  // ABI names are not base names
  EXPECT_EQ(l.status, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
  l = lookup("cuMemAllocAsync", 11000);
  EXPECT_EQ(l.result, CUDA_SUCCESS);
  EXPECT_EQ(l.status, CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT);
  EXPECT_EQ(l.fn, nullptr);
  l = lookup("cuMemAllocAsync", 11020);
  EXPECT_EQ(l.status, CU_GET_PROC_ADDRESS_SUCCESS);
  EXPECT_EQ(l.fn, sym("cuMemAllocAsync"));
}

TEST_F(ProcAddress, FirstAbi) {
  // cuGetProcAddress (11.3 ABI): no status argument; a missing symbol is an error.
  using V1 = CUresult (*)(const char*, void**, int, cuuint64_t);
  auto v1 = reinterpret_cast<V1>(sym("cuGetProcAddress"));
  ASSERT_NE(v1, nullptr);
  EXPECT_NE(reinterpret_cast<void*>(v1), sym("cuGetProcAddress_v2"));
  void* fn = reinterpret_cast<void*>(0x1);
  CU_EXPECT_ERR(CUDA_ERROR_NOT_FOUND, v1("cuNoSuchFunction", &fn, 12000, 0));
  EXPECT_EQ(fn, nullptr);
  CU_EXPECT_ERR(CUDA_ERROR_NOT_FOUND, v1("cuMemAllocAsync", &fn, 11000, 0));
  CU_ASSERT(v1("cuMemAlloc", &fn, 11030, 0));
  EXPECT_EQ(fn, sym("cuMemAlloc_v2"));
  // What cudart does right after cuInit: look up cuGetProcAddress itself.
  Lookup l = lookup("cuGetProcAddress", 12000);
  EXPECT_EQ(l.fn, sym("cuGetProcAddress_v2"));
  l = lookup("cuGetProcAddress", 11030);
  EXPECT_EQ(l.fn, reinterpret_cast<void*>(v1));
}

TEST_F(ProcAddress, ReturnedFunctionsWork) {
  using GetVersion = CUresult (*)(int*);
  Lookup l = lookup("cuDriverGetVersion", 2020);
  ASSERT_NE(l.fn, nullptr);
  int v = 0;
  CU_ASSERT(reinterpret_cast<GetVersion>(l.fn)(&v));
  EXPECT_EQ(v, 13000);

  CUcontext ctx = nullptr;
  CU_ASSERT(cuDevicePrimaryCtxRetain(&ctx, 0));
  CU_ASSERT(cuCtxSetCurrent(ctx));
  using Alloc = CUresult (*)(CUdeviceptr*, size_t);
  using HtoD = CUresult (*)(CUdeviceptr, const void*, size_t);
  using DtoH = CUresult (*)(void*, CUdeviceptr, size_t);
  auto alloc = reinterpret_cast<Alloc>(lookup("cuMemAlloc", 3020).fn);
  auto htod = reinterpret_cast<HtoD>(lookup("cuMemcpyHtoD", 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM).fn);
  auto dtoh = reinterpret_cast<DtoH>(lookup("cuMemcpyDtoH", 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM).fn);
  ASSERT_TRUE(alloc && htod && dtoh);
  CUdeviceptr d = 0;
  CU_ASSERT(alloc(&d, 4096));
  std::vector<int> in(1024), out(1024, 0);
  for (int i = 0; i < 1024; ++i) in[i] = i * 7;
  CU_ASSERT(htod(d, in.data(), 4096));  // through the per-thread default stream
  CU_ASSERT(dtoh(out.data(), d, 4096));
  EXPECT_EQ(in, out);
  CU_ASSERT(cuMemFree(d));
  CU_ASSERT(cuDevicePrimaryCtxRelease(0));
}

TEST_F(ProcAddress, EveryRealDriverExportIsDefined) {
  const std::vector<std::string> names = definedFunctions(SIMGPU_TEST_STUB_LIBCUDA);
  ASSERT_GT(names.size(), 600u) << "cannot read the stub's symbols from " << SIMGPU_TEST_STUB_LIBCUDA;
  Dl_info self{};
  ASSERT_NE(dladdr(sym("cuInit"), &self), 0);
  std::vector<std::string> missing, elsewhere;
  size_t perThread = 0;
  for (const std::string& n : names) {
    void* p = sym(n.c_str());
    if (!p) {
      missing.push_back(n);
      continue;
    }
    Dl_info info{};
    if (!dladdr(p, &info) || info.dli_fbase != self.dli_fbase) elsewhere.push_back(n);
    if (n.size() > 5 && (n.ends_with("_ptds") || n.ends_with("_ptsz"))) ++perThread;
  }
  std::string m;
  for (const std::string& n : missing) m += n + " ";
  EXPECT_TRUE(missing.empty()) << missing.size() << " exports missing: " << m;
  EXPECT_TRUE(elsewhere.empty()) << elsewhere.size() << " exports resolve outside simgpu, e.g. " << elsewhere.front();
  EXPECT_GT(perThread, 50u);
  // Base names of the exports are known to cuGetProcAddress (at the newest version).
  std::set<std::string> unknown;
  for (const std::string& n : names) {
    std::string base = n;
    for (const char* suffix : {"_ptds", "_ptsz"})
      if (base.ends_with(suffix)) base.resize(base.size() - 5);
    const size_t v = base.rfind("_v");
    if (v != std::string::npos && v + 2 < base.size() && base.find_first_not_of("0123456789", v + 2) == std::string::npos)
      base.resize(v);
    if (lookup(base.c_str(), 13000).status == CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND) unknown.insert(base);
  }
  std::string u;
  for (const std::string& n : unknown) u += n + " ";
  EXPECT_TRUE(unknown.empty()) << unknown.size() << " exported names unknown to cuGetProcAddress: " << u;
}

TEST_F(ProcAddress, UnimplementedExportsAnswerAsListed) {
  // A gap (the JIT linker) and an absent feature (no graphics resource can exist on simgpu).
  CU_EXPECT_ERR(CUDA_ERROR_NOT_SUPPORTED, cuLinkDestroy(nullptr));
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_HANDLE, cuGraphicsUnregisterResource(nullptr));
  // The same through cuGetProcAddress and dlsym.
  using Unreg = CUresult (*)(CUgraphicsResource);
  auto viaLookup = reinterpret_cast<Unreg>(lookup("cuGraphicsUnregisterResource", 13000).fn);
  ASSERT_NE(viaLookup, nullptr);
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_HANDLE, viaLookup(nullptr));
  auto viaDlsym = reinterpret_cast<Unreg>(sym("cuGraphicsUnregisterResource"));
  ASSERT_NE(viaDlsym, nullptr);
  CU_EXPECT_ERR(CUDA_ERROR_INVALID_HANDLE, viaDlsym(nullptr));
}

// ---------------------------------------------------------------------------------------------
// simgpu/driver_api_cuda13.txt: every export of the real driver classified once, and the built
// library as the list says: what is modelled is the library's own code (not the generated stub),
// what is not answers its listed error (CUDA_ERROR_NOT_INITIALIZED before cuInit), and each
// `when` attribute is what the device reports.
struct ApiEntry {
  std::string name, cls, answer;
  int whenAttr = -1, whenValue = 0;
};

std::vector<ApiEntry> readApiList() {
  std::vector<ApiEntry> out;
  std::ifstream in(SIMGPU_DRIVER_API_LIST);
  std::string line;
  while (std::getline(in, line)) {
    line = line.substr(0, line.find('#'));
    std::istringstream ws(line);
    ApiEntry e;
    if (!(ws >> e.name)) continue;
    ws >> e.cls;
    if (e.cls != "modelled") ws >> e.answer;
    std::string when;
    if (ws >> when) {
      const size_t open = when.find('('), close = when.find(")=");
      if (open != std::string::npos && close != std::string::npos) {
        e.whenAttr = std::atoi(when.c_str() + open + 1);
        e.whenValue = std::atoi(when.c_str() + close + 2);
      }
    }
    out.push_back(e);
  }
  return out;
}

// CUresult's names and values, from the toolkit's cuda.h.
std::map<std::string, int> cuResults() {
  std::ifstream in(SIMGPU_TEST_CUDA_H);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::map<std::string, int> out;
  const std::regex re(R"(\b(CUDA_SUCCESS|CUDA_ERROR_\w+)\s*=\s*(\d+))");
  for (auto it = std::sregex_iterator(text.begin(), text.end(), re); it != std::sregex_iterator(); ++it)
    out[(*it)[1]] = std::stoi((*it)[2]);
  return out;
}

using ApiClass = int (*)(const char*, int*);
ApiClass apiClass() { return reinterpret_cast<ApiClass>(sym("simgpu_driver_api_class")); }

TEST(DriverApi, EveryExportIsClassifiedOnce) {
  const std::vector<ApiEntry> list = readApiList();
  ASSERT_GT(list.size(), 600u) << "cannot read " << SIMGPU_DRIVER_API_LIST;
  std::set<std::string> listed, twice;
  for (const ApiEntry& e : list) {
    if (!listed.insert(e.name).second) twice.insert(e.name);
    EXPECT_TRUE(e.cls == "modelled" || e.cls == "absent" || e.cls == "legacy" || e.cls == "gap") << e.name << ": " << e.cls;
  }
  EXPECT_TRUE(twice.empty()) << *twice.begin() << " is listed twice";
  const std::vector<std::string> exported = definedFunctions(SIMGPU_TEST_STUB_LIBCUDA);
  const std::set<std::string> real(exported.begin(), exported.end());
  std::string missing, extra;
  for (const std::string& n : real)
    if (!listed.count(n)) missing += n + " ";
  for (const std::string& n : listed)
    if (!real.count(n)) extra += n + " ";
  EXPECT_EQ(missing, "") << "exported by the real driver, not classified";
  EXPECT_EQ(extra, "") << "classified, not exported by the real driver";
}

TEST_F(ProcAddress, TheLibraryModelsWhatTheListSays) {
  const ApiClass cls = apiClass();
  ASSERT_NE(cls, nullptr) << "simgpu_driver_api_class is not exported";
  const std::map<std::string, int> codes = cuResults();
  ASSERT_GT(codes.size(), 90u);
  size_t modelled = 0, answered = 0;
  for (const ApiEntry& e : readApiList()) {
    int answer = -1;
    const int got = cls(e.name.c_str(), &answer);
    if (e.cls == "modelled") {
      ++modelled;
      EXPECT_EQ(got, 1) << e.name << " is listed as modelled, but the library has only the generated stub";
      continue;
    }
    EXPECT_EQ(got, 0) << e.name << " is listed as " << e.cls << ", but the library defines it: list it as modelled";
    ASSERT_TRUE(codes.count(e.answer)) << e.name << ": " << e.answer;
    EXPECT_EQ(answer, codes.at(e.answer)) << e.name;
    // And the call itself answers so. Every stub ignores its arguments, so none are passed.
    auto fn = reinterpret_cast<CUresult (*)()>(sym(e.name.c_str()));
    ASSERT_NE(fn, nullptr) << e.name;
    EXPECT_EQ(static_cast<int>(fn()), codes.at(e.answer)) << e.name;
    ++answered;
  }
  EXPECT_GE(modelled, 370u);
  EXPECT_GT(answered, 0u);
  EXPECT_EQ(cls("cuNoSuchFunction", nullptr), -1);
}

TEST_F(ProcAddress, AbsentFeaturesAreAbsentOnTheDevice) {
  size_t checked = 0;
  for (const ApiEntry& e : readApiList()) {
    if (e.whenAttr < 0) continue;
    int v = -12345;
    ASSERT_EQ(CUDA_SUCCESS, cuDeviceGetAttribute(&v, static_cast<CUdevice_attribute>(e.whenAttr), 0)) << e.name;
    EXPECT_EQ(v, e.whenValue) << e.name << " is absent because attribute " << e.whenAttr << " says so";
    ++checked;
  }
  EXPECT_GT(checked, 10u);
}

// Run alone (ctest simgpu_proc_address_test_before_init): no cuInit in this process.
TEST(DriverApiBeforeInit, UnmodelledEntryPointsAreNotInitialized) {
  size_t checked = 0;
  for (const ApiEntry& e : readApiList()) {
    if (e.cls == "modelled") continue;
    auto fn = reinterpret_cast<CUresult (*)()>(sym(e.name.c_str()));
    ASSERT_NE(fn, nullptr) << e.name;
    EXPECT_EQ(fn(), CUDA_ERROR_NOT_INITIALIZED) << e.name;
    ++checked;
  }
  EXPECT_GT(checked, 0u);
}

// SIMGPU_TRACE=1: each call is logged with its arguments on stderr.
TEST_F(ProcAddress, TraceLogsCallsWithArguments) {
  int status = -1;
  const std::string traced =
      runSelfStderr("ProcAddress.TraceChild", {"SIMGPU_TRACE=1", "SIMGPU_TEST_TRACE_CHILD=1"}, &status);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << traced;
  EXPECT_NE(traced.find("cuMemAlloc_v2("), std::string::npos) << traced;
  EXPECT_NE(traced.find("0x12340"), std::string::npos) << "the size argument is logged: " << traced;
  EXPECT_NE(traced.find("cuInit(0)"), std::string::npos) << traced;
  EXPECT_NE(traced.find("cuMemFree_v2("), std::string::npos) << traced;
  EXPECT_NE(traced.find("cuGraphicsUnregisterResource"), std::string::npos) << traced;
  const std::string quiet = runSelfStderr("ProcAddress.TraceChild", {"SIMGPU_TEST_TRACE_CHILD=1"}, &status);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << quiet;
  EXPECT_EQ(quiet.find("cuMemAlloc_v2("), std::string::npos) << "traced without SIMGPU_TRACE: " << quiet;
}

// Child half of TraceLogsCallsWithArguments.
TEST_F(ProcAddress, TraceChild) {
  if (!std::getenv("SIMGPU_TEST_TRACE_CHILD")) GTEST_SKIP() << "run by TraceLogsCallsWithArguments";
  CUcontext ctx = nullptr;
  CU_ASSERT(cuDevicePrimaryCtxRetain(&ctx, 0));
  CU_ASSERT(cuCtxSetCurrent(ctx));
  CUdeviceptr d = 0;
  CU_ASSERT(cuMemAlloc(&d, 0x12340));
  CU_ASSERT(cuMemFree(d));
  (void)cuGraphicsUnregisterResource(nullptr);
  CU_ASSERT(cuDevicePrimaryCtxRelease(0));
}

}  // namespace
