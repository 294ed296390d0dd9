// Modules and libraries (loaded, never compiled: kernels are found by name), functions and
// kernels, module globals backed by memory, and kernel launch. A launch runs the kernel's host
// body if the program supplies one (see simgpu.h), then takes the device time the engine models
// for its blocks (device_time.cpp): the block time comes from the cost table, fixed at launch.
#include <dlfcn.h>
#include <sys/mman.h>

#include <cstring>
#include <fstream>
#include <iterator>

#include "driver.h"
#include "fatbin.h"
#include "simgpu/simgpu.h"

namespace simgpu {

struct Module {
  std::mutex mu;
  ImageInfo info;
  std::map<std::string, Function*> functions;
  std::map<std::string, std::pair<CUdeviceptr, size_t>> globals;
  bool isLibrary = false;
  Context* ctx = nullptr;
};

namespace {

constexpr size_t kUnknownGlobalSize = 64 * 1024;  // when the image does not say (PTX, compressed)

CUresult loadModule(const void* image, size_t size, bool library, Module** out) {
  if (!image) return CUDA_ERROR_INVALID_VALUE;
  auto* m = new Module;
  m->isLibrary = library;
  m->ctx = currentContext();
  parseImage(image, size, &m->info);
  handleAdd(m, library ? HandleType::kLibrary : HandleType::kModule);
  *out = m;
  return CUDA_SUCCESS;
}

CUresult loadFile(const char* path, std::vector<char>* data) {
  if (!path) return CUDA_ERROR_INVALID_VALUE;
  std::ifstream f(path, std::ios::binary);
  if (!f) return CUDA_ERROR_FILE_NOT_FOUND;
  data->assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  data->resize(data->size() + 8, 0);  // PTX text is read as a C string
  return CUDA_SUCCESS;
}

void unloadModule(Module* m) {
  handleRemove(m);
  std::lock_guard g(m->mu);
  for (auto& [name, f] : m->functions) handleRemove(f);  // Function objects leak: stale handles stay readable
  for (auto& [name, gl] : m->globals) {
    Allocation a;
    if (registryRemove(gl.first, &a)) hostUnmap(a.mapping, a.mappingSize);
  }
  m->globals.clear();
}

void* findHostBody(const std::string& name) {
  const std::string sym = SIMGPU_HOST_PREFIX + name;
  return dlsym(RTLD_DEFAULT, sym.c_str());
}

CUresult getFunction(Module* m, const char* name, Function** out) {
  if (!name || !out) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard g(m->mu);
  auto it = m->functions.find(name);
  if (it == m->functions.end()) {
    // Without a parsed image simgpu cannot tell a missing kernel from a present one: it trusts the
    // caller, as the kernel will do nothing (or run its host body) anyway.
    auto k = m->info.kernels.find(name);
    if (!m->info.kernels.empty() && k == m->info.kernels.end() && !findHostBody(name)) return CUDA_ERROR_NOT_FOUND;
    auto* f = new Function;
    f->module = m;
    f->name = name;
    f->hostFn = findHostBody(name);
    if (k != m->info.kernels.end()) {
      f->params = k->second;
      f->paramsKnown = true;
    }
    if (auto r = m->info.resources.find(name); r != m->info.resources.end()) {
      f->registers = r->second.registers;
      f->staticShared = r->second.staticShared;
    }
    f->blockNs = kDefaultBlockNs;
    if (const CostRule* rule = drv().cfg.costs.match(name)) {
      f->blockNs = rule->blockNs;
      f->costParam = rule->param;
    }
    if ((f->probeKind = probeKindOf(f->name))) {
      // A probe kernel runs as its native twin (its time comes from its time box, not the cost
      // table), which reads its one ProbeArgs: the layout is the ABI's, parsed image or not.
      f->costParam = -1;
      f->params = {ParamInfo{0, sizeof(cushare::probe::ProbeArgs)}};
      f->paramsKnown = true;
    }
    it = m->functions.emplace(name, f).first;
    handleAdd(f, HandleType::kFunction);
  }
  *out = it->second;
  return CUDA_SUCCESS;
}

CUresult getGlobal(Module* m, const char* name, CUdeviceptr* dptr, size_t* bytes) {
  if (!name) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard g(m->mu);
  auto it = m->globals.find(name);
  if (it == m->globals.end()) {
    size_t size = kUnknownGlobalSize;
    if (m->info.globalsKnown) {
      auto s = m->info.globals.find(name);
      if (s == m->info.globals.end()) return CUDA_ERROR_NOT_FOUND;
      size = s->second;
    }
    size_t mapped;
    void* p = hostMap(size, &mapped);
    if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
    Allocation a;
    a.base = reinterpret_cast<uintptr_t>(p);
    a.size = size;
    a.device = m->ctx ? m->ctx->device : 0;
    a.kind = MemKind::kGlobal;
    a.ctx = m->ctx;
    a.mapping = p;
    a.mappingSize = mapped;
    a.id = nextId();
    registryAdd(a);
    it = m->globals.emplace(name, std::make_pair(a.base, size)).first;
  }
  if (dptr) *dptr = it->second.first;
  if (bytes) *bytes = it->second.second;
  return CUDA_SUCCESS;
}

Module* moduleOf(void* h, HandleType t) { return handleGet<Module>(h, t); }

}  // namespace

void runHostBody(const KernelParams& k, void** params, void** extra);

namespace {
// The block time of a launch: the cost rule's, or the integer value of the parameter it names
// (read from the caller's arguments, so only at launch). A parameter simgpu cannot locate (no
// layout, out of range) leaves the default.
uint64_t launchBlockNs(const Function* f, void** params, void** extra) {
  if (f->costParam < 0) return f->blockNs;
  const size_t i = static_cast<size_t>(f->costParam);
  if (!f->paramsKnown || i >= f->params.size()) return kDefaultBlockNs;
  const ParamInfo& p = f->params[i];
  const char* src = nullptr;
  if (params) {
    src = static_cast<const char*>(params[i]);
  } else if (extra) {
    const char* buf = nullptr;
    size_t size = 0;
    for (int j = 0; extra[j] != CU_LAUNCH_PARAM_END; j += 2) {
      if (extra[j] == CU_LAUNCH_PARAM_BUFFER_POINTER) buf = static_cast<const char*>(extra[j + 1]);
      else if (extra[j] == CU_LAUNCH_PARAM_BUFFER_SIZE) size = *static_cast<size_t*>(extra[j + 1]);
    }
    if (buf && p.offset + p.size <= size) src = buf + p.offset;
  }
  if (!src) return kDefaultBlockNs;
  int64_t v = 0;
  switch (p.size) {
    case 1: v = *reinterpret_cast<const int8_t*>(src); break;
    case 2: { int16_t x; std::memcpy(&x, src, 2); v = x; break; }
    case 4: { int32_t x; std::memcpy(&x, src, 4); v = x; break; }
    case 8: std::memcpy(&v, src, 8); break;
    default: return kDefaultBlockNs;
  }
  return v < 0 ? 0 : static_cast<uint64_t>(v);
}
}  // namespace

CUresult runKernel(const KernelParams& k, void** params, void** extra) {
  if (k.fn->hostFn) runHostBody(k, params, extra);
  return deviceExecute(k);
}

void runHostBody(const KernelParams& k, void** params, void** extra) {
  simgpu_launch l;
  l.name = k.fn->name.c_str();
  for (int i = 0; i < 3; ++i) {
    l.grid[i] = k.grid[i];
    l.block[i] = k.block[i];
  }
  l.shared_mem = k.sharedMem;
  l.device = k.device;
  l.params = params;
  l.extra = extra;
  reinterpret_cast<simgpu_host_kernel>(k.fn->hostFn)(&l);
}

CUresult copyKernelArgs(KernelParams* k, void** params, void** extra) {
  // A graph must own copies of the arguments: the caller's storage is gone after the call.
  Function* f = k->fn;
  k->args.clear();
  k->blockNs = launchBlockNs(f, params, extra);
  if (extra) {
    // {CU_LAUNCH_PARAM_BUFFER_POINTER, buf, CU_LAUNCH_PARAM_BUFFER_SIZE, &size, CU_LAUNCH_PARAM_END}
    const void* buf = nullptr;
    size_t size = 0;
    for (int i = 0; extra[i] != CU_LAUNCH_PARAM_END; i += 2) {
      if (extra[i] == CU_LAUNCH_PARAM_BUFFER_POINTER) buf = extra[i + 1];
      else if (extra[i] == CU_LAUNCH_PARAM_BUFFER_SIZE) size = *static_cast<size_t*>(extra[i + 1]);
      else return CUDA_ERROR_INVALID_VALUE;
    }
    if (!buf) return CUDA_ERROR_INVALID_VALUE;
    k->args.emplace_back(static_cast<const char*>(buf), static_cast<const char*>(buf) + size);
    k->extraBuffer = true;
    return CUDA_SUCCESS;
  }
  if (!params) return CUDA_SUCCESS;
  if (!f->paramsKnown) {
    if (!f->hostFn) return CUDA_SUCCESS;  // nothing will read them
    if (!k->forGraph) return CUDA_ERROR_NOT_SUPPORTED;  // the launch runs it synchronously instead
    std::fprintf(stderr, "simgpu: cannot copy the arguments of %s: its parameter layout is unknown (PTX or compressed image)\n",
                 f->name.c_str());
    return CUDA_ERROR_NOT_SUPPORTED;
  }
  // Nothing will read them, unless managed memory they may point into is to be populated.
  if (!f->hostFn && !f->probeKind && !managedInUse()) return CUDA_SUCCESS;
  for (size_t i = 0; i < f->params.size(); ++i)
    k->args.emplace_back(static_cast<const char*>(params[i]), static_cast<const char*>(params[i]) + f->params[i].size);
  return CUDA_SUCCESS;
}

CUresult runKernelCopy(KernelParams& k) {
  if (k.extraBuffer) {
    size_t size = k.args[0].size();
    void* extra[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, k.args[0].data(), CU_LAUNCH_PARAM_BUFFER_SIZE, &size,
                     CU_LAUNCH_PARAM_END};
    return runKernel(k, nullptr, extra);
  }
  k.argPtrs.clear();
  for (auto& a : k.args) k.argPtrs.push_back(a.data());
  return runKernel(k, k.argPtrs.data(), nullptr);
}

CUresult launchKernel(Stream* s, Function* f, const unsigned grid[3], const unsigned block[3], unsigned sharedMem,
                      void** params, void** extra) {
  if (!f) return CUDA_ERROR_INVALID_HANDLE;
  for (int i = 0; i < 3; ++i)
    if (grid[i] == 0 || block[i] == 0) return CUDA_ERROR_INVALID_VALUE;
  if (static_cast<uint64_t>(block[0]) * block[1] * block[2] > 1024 || block[2] > 64 || grid[1] > 65535 ||
      grid[2] > 65535 || grid[0] > 2147483647u)
    return CUDA_ERROR_INVALID_VALUE;
  if (sharedMem > 232448) return CUDA_ERROR_INVALID_VALUE;
  if (params && extra) return CUDA_ERROR_INVALID_VALUE;
  if (!blockFitsSm(f, block, sharedMem)) return CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES;
  auto* k = new KernelParams;
  k->fn = f;
  for (int i = 0; i < 3; ++i) {
    k->grid[i] = grid[i];
    k->block[i] = block[i];
  }
  k->sharedMem = sharedMem;
  k->device = s->ctx->device;
  Op op;
  op.type = Op::kKernel;
  op.kernel = k;
  // The worker runs the kernel after this call returns: it needs its own copy of the arguments.
  k->forGraph = s->captureStatus == CU_STREAM_CAPTURE_STATUS_ACTIVE;
  if (CUresult r = copyKernelArgs(k, params, extra); r != CUDA_SUCCESS) {
    delete k;
    if (r != CUDA_ERROR_NOT_SUPPORTED || s->captureStatus == CU_STREAM_CAPTURE_STATUS_ACTIVE) return r;
    // Layout unknown but a host body wants the arguments: run it now, in order, while the
    // caller's arguments are still valid.
    KernelParams direct;
    direct.fn = f;
    for (int i = 0; i < 3; ++i) {
      direct.grid[i] = grid[i];
      direct.block[i] = block[i];
    }
    direct.sharedMem = sharedMem;
    direct.device = s->ctx->device;
    direct.blockNs = launchBlockNs(f, params, extra);
    Op now;
    now.type = Op::kKernel;
    now.run = [&direct, params, extra] { return runKernel(direct, params, extra); };
    return submitAndWait(s, std::move(now));
  }
  if (s->captureStatus == CU_STREAM_CAPTURE_STATUS_ACTIVE) return submit(s, std::move(op));
  k->faultNs = managedTouch(s->ctx->device, k->args);  // managed memory the arguments reach is populated now
  k->queued = true;  // counted below once queued (the worker may take it first: the count dips)
  const int device = k->device;
  op.run = [k] {
    const CUresult r = runKernelCopy(*k);
    delete k;
    return r;
  };
  const CUresult r = submit(s, std::move(op));
  if (r == CUDA_SUCCESS) deviceKernelQueued(device);
  return r;
}

}  // namespace simgpu

using namespace simgpu;

// ---- modules ----
CU_EXPORT CUresult cuModuleLoadData(CUmodule* m, const void* image) {
  API_ENTER(m, image);
  if (!m) return CUDA_ERROR_INVALID_VALUE;
  Context* c;
  CU_TRY(requireContext(&c));
  Module* mod;
  CU_TRY(loadModule(image, 0, false, &mod));
  *m = reinterpret_cast<CUmodule>(mod);
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuModuleLoadDataEx(CUmodule* m, const void* image, unsigned n, CUjit_option* o, void** v) {
  API_ENTER(m, image, n, o, v);
  return cuModuleLoadData(m, image);
}

CU_EXPORT CUresult cuModuleLoadFatBinary(CUmodule* m, const void* fatCubin) {
  API_ENTER(m, fatCubin);
  return cuModuleLoadData(m, fatCubin);
}

CU_EXPORT CUresult cuModuleLoad(CUmodule* m, const char* fname) {
  API_ENTER(m, fname);
  if (!m) return CUDA_ERROR_INVALID_VALUE;
  std::vector<char> data;
  CU_TRY(loadFile(fname, &data));
  Context* c;
  CU_TRY(requireContext(&c));
  Module* mod;
  CU_TRY(loadModule(data.data(), data.size(), false, &mod));
  *m = reinterpret_cast<CUmodule>(mod);
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuModuleUnload(CUmodule h) {
  API_ENTER(h);
  Module* m = moduleOf(h, HandleType::kModule);
  if (!m) return CUDA_ERROR_INVALID_HANDLE;
  unloadModule(m);
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuModuleGetFunction(CUfunction* f, CUmodule h, const char* name) {
  API_ENTER(f, h, name);
  Module* m = moduleOf(h, HandleType::kModule);
  if (!m) return CUDA_ERROR_INVALID_HANDLE;
  Function* fn;
  CU_TRY(getFunction(m, name, &fn));
  *f = fn->asFunction();
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuModuleGetGlobal_v2(CUdeviceptr* dptr, size_t* bytes, CUmodule h, const char* name) {
  API_ENTER(dptr, bytes, h, name);
  Module* m = moduleOf(h, HandleType::kModule);
  if (!m) return CUDA_ERROR_INVALID_HANDLE;
  return getGlobal(m, name, dptr, bytes);
}

CU_EXPORT CUresult cuModuleGetLoadingMode(CUmoduleLoadingMode* mode) {
  API_ENTER(mode);
  if (!mode) return CUDA_ERROR_INVALID_VALUE;
  *mode = CU_MODULE_LAZY_LOADING;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuModuleGetFunctionCount(unsigned int* count, CUmodule h) {
  API_ENTER(count, h);
  Module* m = moduleOf(h, HandleType::kModule);
  if (!m || !count) return m ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_INVALID_HANDLE;
  *count = static_cast<unsigned>(m->info.kernels.size());
  return CUDA_SUCCESS;
}

// ---- libraries ----
CU_EXPORT CUresult cuLibraryLoadData(CUlibrary* lib, const void* code, CUjit_option* jo, void** jv, unsigned nj,
                                     CUlibraryOption* lo, void** lv, unsigned nl) {
  API_ENTER(lib, code, jo, jv, nj, lo, lv, nl);
  if (!lib) return CUDA_ERROR_INVALID_VALUE;
  Module* m;
  CU_TRY(loadModule(code, 0, true, &m));
  *lib = reinterpret_cast<CUlibrary>(m);
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuLibraryLoadFromFile(CUlibrary* lib, const char* fname, CUjit_option* jo, void** jv, unsigned nj,
                                         CUlibraryOption* lo, void** lv, unsigned nl) {
  API_ENTER(lib, fname, jo, jv, nj, lo, lv, nl);
  if (!lib) return CUDA_ERROR_INVALID_VALUE;
  std::vector<char> data;
  CU_TRY(loadFile(fname, &data));
  Module* m;
  CU_TRY(loadModule(data.data(), data.size(), true, &m));
  *lib = reinterpret_cast<CUlibrary>(m);
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuLibraryUnload(CUlibrary h) {
  API_ENTER(h);
  Module* m = moduleOf(h, HandleType::kLibrary);
  if (!m) return CUDA_ERROR_INVALID_HANDLE;
  unloadModule(m);
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuLibraryGetKernel(CUkernel* k, CUlibrary h, const char* name) {
  API_ENTER(k, h, name);
  if (!k) return CUDA_ERROR_INVALID_VALUE;
  Module* m = moduleOf(h, HandleType::kLibrary);
  if (!m) return CUDA_ERROR_INVALID_HANDLE;
  Function* fn;
  CU_TRY(getFunction(m, name, &fn));
  *k = reinterpret_cast<CUkernel>(fn);  // cudart launches a CUkernel as a CUfunction
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuLibraryGetModule(CUmodule* mod, CUlibrary h) {
  API_ENTER(mod, h);
  if (!mod) return CUDA_ERROR_INVALID_VALUE;
  Module* m = moduleOf(h, HandleType::kLibrary);
  if (!m) return CUDA_ERROR_INVALID_HANDLE;
  handleAdd(m, HandleType::kModule);  // the same object answers as a module from now on
  *mod = reinterpret_cast<CUmodule>(m);
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuLibraryGetGlobal(CUdeviceptr* dptr, size_t* bytes, CUlibrary h, const char* name) {
  API_ENTER(dptr, bytes, h, name);
  Module* m = moduleOf(h, HandleType::kLibrary);
  if (!m) m = moduleOf(h, HandleType::kModule);
  if (!m) return CUDA_ERROR_INVALID_HANDLE;
  if (!m->ctx) m->ctx = currentContext();
  return getGlobal(m, name, dptr, bytes);
}

CU_EXPORT CUresult cuLibraryGetManaged(CUdeviceptr* dptr, size_t* bytes, CUlibrary h, const char* name) {
  API_ENTER(dptr, bytes, h, name);
  return cuLibraryGetGlobal(dptr, bytes, h, name);
}

CU_EXPORT CUresult cuLibraryGetKernelCount(unsigned int* count, CUlibrary h) {
  API_ENTER(count, h);
  Module* m = moduleOf(h, HandleType::kLibrary);
  if (!m || !count) return m ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_INVALID_HANDLE;
  *count = static_cast<unsigned>(m->info.kernels.size());
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuLibraryEnumerateKernels(CUkernel* kernels, unsigned int n, CUlibrary h) {
  API_ENTER(kernels, n, h);
  Module* m = moduleOf(h, HandleType::kLibrary);
  if (!m || !kernels) return m ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_INVALID_HANDLE;
  unsigned i = 0;
  for (auto& [name, params] : m->info.kernels) {
    if (i >= n) break;
    Function* f;
    CU_TRY(getFunction(m, name.c_str(), &f));
    kernels[i++] = reinterpret_cast<CUkernel>(f);
  }
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuKernelGetFunction(CUfunction* f, CUkernel k) {
  API_ENTER(f, k);
  if (!f) return CUDA_ERROR_INVALID_VALUE;
  if (!handleIs(k, HandleType::kFunction)) return CUDA_ERROR_INVALID_HANDLE;
  Context* c;
  CU_TRY(requireContext(&c));
  *f = reinterpret_cast<CUfunction>(k);
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuKernelGetName(const char** name, CUkernel k) {
  API_ENTER(name, k);
  Function* f = handleGet<Function>(k, HandleType::kFunction);
  if (!f) return CUDA_ERROR_INVALID_HANDLE;
  if (!name) return CUDA_ERROR_INVALID_VALUE;
  *name = f->name.c_str();
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuKernelGetLibrary(CUlibrary* lib, CUkernel k) {
  API_ENTER(lib, k);
  Function* f = handleGet<Function>(k, HandleType::kFunction);
  if (!f) return CUDA_ERROR_INVALID_HANDLE;
  if (!lib) return CUDA_ERROR_INVALID_VALUE;
  *lib = reinterpret_cast<CUlibrary>(f->module);
  return CUDA_SUCCESS;
}

// ---- function attributes ----
namespace {
CUresult functionAttribute(int* v, CUfunction_attribute a, Function* f) {
  switch (a) {
    case CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *v = f->maxThreads; break;
    case CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES: *v = f->sharedSizeBytes; break;
    case CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES: *v = 0; break;
    case CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES: *v = 0; break;
    case CU_FUNC_ATTRIBUTE_NUM_REGS: *v = 32; break;
    case CU_FUNC_ATTRIBUTE_PTX_VERSION: *v = 90; break;
    case CU_FUNC_ATTRIBUTE_BINARY_VERSION: *v = 90; break;
    case CU_FUNC_ATTRIBUTE_CACHE_MODE_CA: *v = 0; break;
    case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: *v = f->maxDynamicShared; break;
    case CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT: *v = -1; break;
    default: *v = 0; if (a < 0 || a >= CU_FUNC_ATTRIBUTE_MAX) return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}
}  // namespace

CU_EXPORT CUresult cuFuncGetAttribute(int* v, CUfunction_attribute a, CUfunction h) {
  API_ENTER(v, a, h);
  Function* f = handleGet<Function>(h, HandleType::kFunction);
  if (!f) return CUDA_ERROR_INVALID_HANDLE;
  if (!v) return CUDA_ERROR_INVALID_VALUE;
  return functionAttribute(v, a, f);
}

CU_EXPORT CUresult cuFuncSetAttribute(CUfunction h, CUfunction_attribute a, int v) {
  API_ENTER(h, a, v);
  Function* f = handleGet<Function>(h, HandleType::kFunction);
  if (!f) return CUDA_ERROR_INVALID_HANDLE;
  if (a == CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) {
    if (v < 0 || v > 232448) return CUDA_ERROR_INVALID_VALUE;
    f->maxDynamicShared = v;
  } else if (a == CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED) {
    f->nonPortableClusters = v != 0;
  }
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuKernelGetAttribute(int* v, CUfunction_attribute a, CUkernel k, CUdevice dev) {
  API_ENTER(v, a, k, dev);
  Function* f = handleGet<Function>(k, HandleType::kFunction);
  if (!f) return CUDA_ERROR_INVALID_HANDLE;
  if (!v) return CUDA_ERROR_INVALID_VALUE;
  if (!validDevice(dev)) return CUDA_ERROR_INVALID_DEVICE;
  return functionAttribute(v, a, f);
}

CU_EXPORT CUresult cuKernelSetAttribute(CUfunction_attribute a, int v, CUkernel k, CUdevice dev) {
  API_ENTER(a, v, k, dev);
  if (!validDevice(dev)) return CUDA_ERROR_INVALID_DEVICE;
  return cuFuncSetAttribute(reinterpret_cast<CUfunction>(k), a, v);
}

CU_EXPORT CUresult cuKernelSetCacheConfig(CUkernel k, CUfunc_cache c, CUdevice dev) {
  API_ENTER(k, c, dev);
  if (!handleIs(k, HandleType::kFunction)) return CUDA_ERROR_INVALID_HANDLE;
  return validDevice(dev) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

CU_EXPORT CUresult cuFuncSetCacheConfig(CUfunction h, CUfunc_cache c) {
  API_ENTER(h, c);
  return handleIs(h, HandleType::kFunction) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CU_EXPORT CUresult cuFuncSetSharedMemConfig(CUfunction h, CUsharedconfig c) {
  API_ENTER(h, c);
  return handleIs(h, HandleType::kFunction) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CU_EXPORT CUresult cuFuncGetModule(CUmodule* m, CUfunction h) {
  API_ENTER(m, h);
  Function* f = handleGet<Function>(h, HandleType::kFunction);
  if (!f) return CUDA_ERROR_INVALID_HANDLE;
  if (!m) return CUDA_ERROR_INVALID_VALUE;
  *m = reinterpret_cast<CUmodule>(f->module);
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuFuncGetName(const char** name, CUfunction h) {
  API_ENTER(name, h);
  return cuKernelGetName(name, reinterpret_cast<CUkernel>(h));
}

CU_EXPORT CUresult cuFuncGetParamInfo(CUfunction h, size_t index, size_t* offset, size_t* size) {
  API_ENTER(h, index, offset, size);
  Function* f = handleGet<Function>(h, HandleType::kFunction);
  if (!f) return CUDA_ERROR_INVALID_HANDLE;
  if (!f->paramsKnown) return CUDA_ERROR_NOT_SUPPORTED;
  if (index >= f->params.size()) return CUDA_ERROR_INVALID_VALUE;
  if (offset) *offset = f->params[index].offset;
  if (size) *size = f->params[index].size;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuKernelGetParamInfo(CUkernel k, size_t index, size_t* offset, size_t* size) {
  API_ENTER(k, index, offset, size);
  return cuFuncGetParamInfo(reinterpret_cast<CUfunction>(k), index, offset, size);
}

CU_EXPORT CUresult cuFuncIsLoaded(CUfunctionLoadingState* state, CUfunction h) {
  API_ENTER(state, h);
  if (!handleIs(h, HandleType::kFunction)) return CUDA_ERROR_INVALID_HANDLE;
  if (!state) return CUDA_ERROR_INVALID_VALUE;
  *state = CU_FUNCTION_LOADING_STATE_LOADED;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuFuncLoad(CUfunction h) {
  API_ENTER(h);
  return handleIs(h, HandleType::kFunction) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

// ---- occupancy: one block per SM slot limited by threads, as a plain model ----
CU_EXPORT CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int* n, CUfunction h, int blockSize, size_t dyn) {
  API_ENTER(n, h, blockSize, dyn);
  if (!handleIs(h, HandleType::kFunction)) return CUDA_ERROR_INVALID_HANDLE;
  if (!n || blockSize <= 0) return CUDA_ERROR_INVALID_VALUE;
  int byThreads = 2048 / blockSize;
  int byShared = dyn ? static_cast<int>(233472 / dyn) : 32;
  *n = std::max(0, std::min({byThreads, byShared, 32}));
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int* n, CUfunction h, int bs, size_t dyn, unsigned f) {
  API_ENTER(n, h, bs, dyn, f);
  return cuOccupancyMaxActiveBlocksPerMultiprocessor(n, h, bs, dyn);
}

CU_EXPORT CUresult cuOccupancyMaxPotentialBlockSize(int* minGrid, int* blockSize, CUfunction h,
                                                    CUoccupancyB2DSize fn, size_t dyn, int limit) {
  API_ENTER(minGrid, blockSize, h, dyn, limit);
  if (!handleIs(h, HandleType::kFunction)) return CUDA_ERROR_INVALID_HANDLE;
  if (!minGrid || !blockSize) return CUDA_ERROR_INVALID_VALUE;
  int bs = limit > 0 && limit < 1024 ? limit : 1024;
  *blockSize = bs;
  *minGrid = static_cast<int>(drv().cfg.smCount) * (2048 / bs);
  (void)fn;
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuOccupancyAvailableDynamicSMemPerBlock(size_t* s, CUfunction h, int numBlocks, int blockSize) {
  API_ENTER(s, h, numBlocks, blockSize);
  if (!handleIs(h, HandleType::kFunction)) return CUDA_ERROR_INVALID_HANDLE;
  if (!s || numBlocks <= 0) return CUDA_ERROR_INVALID_VALUE;
  *s = 233472 / static_cast<size_t>(numBlocks);
  return CUDA_SUCCESS;
}

CU_EXPORT CUresult cuOccupancyMaxActiveClusters(int* n, CUfunction h, const CUlaunchConfig* cfg) {
  API_ENTER(n, h, cfg);
  Function* f = handleGet<Function>(h, HandleType::kFunction);
  if (!f) return CUDA_ERROR_INVALID_HANDLE;
  if (!n || !cfg) return CUDA_ERROR_INVALID_VALUE;
  unsigned cluster = 1;
  for (unsigned i = 0; i < cfg->numAttrs; ++i)
    if (cfg->attrs && cfg->attrs[i].id == CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION)
      cluster = cfg->attrs[i].value.clusterDim.x * cfg->attrs[i].value.clusterDim.y * cfg->attrs[i].value.clusterDim.z;
  // Hopper: clusters of up to 8 blocks are portable, up to 16 with the non-portable opt-in.
  if (cluster == 0 || cluster > (f->nonPortableClusters ? 16u : 8u)) return CUDA_ERROR_INVALID_CLUSTER_SIZE;
  const uint64_t threads = static_cast<uint64_t>(cfg->blockDimX) * cfg->blockDimY * cfg->blockDimZ;
  if (threads == 0 || threads > 1024) return CUDA_ERROR_INVALID_VALUE;
  const uint64_t perSm = std::min<uint64_t>(32, 2048 / threads);
  *n = static_cast<int>(drv().cfg.smCount * perSm / cluster);
  return CUDA_SUCCESS;
}

// ---- launch ----
CU_EXPORT CUresult cuLaunchKernel(CUfunction h, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                  unsigned bz, unsigned shmem, CUstream hs, void** params, void** extra) {
  API_ENTER(h, gx, gy, gz, bx, by, bz, shmem, hs, params, extra);
  Function* f = handleGet<Function>(h, HandleType::kFunction);
  if (!f) return CUDA_ERROR_INVALID_HANDLE;
  Stream* s;
  CU_TRY(resolveStream(hs, &s));
  const unsigned grid[3] = {gx, gy, gz}, block[3] = {bx, by, bz};
  return launchKernel(s, f, grid, block, shmem, params, extra);
}

CU_EXPORT CUresult cuLaunchCooperativeKernel(CUfunction h, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                             unsigned by, unsigned bz, unsigned shmem, CUstream hs, void** params) {
  API_ENTER(h, gx, gy, gz, bx, by, bz, shmem, hs, params);
  Function* f = handleGet<Function>(h, HandleType::kFunction);
  if (!f) return CUDA_ERROR_INVALID_HANDLE;
  // All blocks must be co-resident: at most 32 blocks of this size per SM.
  const uint64_t threads = static_cast<uint64_t>(bx) * by * bz;
  const uint64_t perSm = threads ? std::min<uint64_t>(32, 2048 / threads) : 0;
  if (static_cast<uint64_t>(gx) * gy * gz > perSm * drv().cfg.smCount) return CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE;
  Stream* s;
  CU_TRY(resolveStream(hs, &s));
  const unsigned grid[3] = {gx, gy, gz}, block[3] = {bx, by, bz};
  return launchKernel(s, f, grid, block, shmem, params, nullptr);
}

CU_EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig* cfg, CUfunction h, void** params, void** extra) {
  API_ENTER(cfg, h, params, extra);
  if (!cfg) return CUDA_ERROR_INVALID_VALUE;
  Function* f = handleGet<Function>(h, HandleType::kFunction);
  if (!f) return CUDA_ERROR_INVALID_HANDLE;
  for (unsigned i = 0; i < cfg->numAttrs; ++i) {
    if (!cfg->attrs) return CUDA_ERROR_INVALID_VALUE;
    if (cfg->attrs[i].id == CU_LAUNCH_ATTRIBUTE_COOPERATIVE && cfg->attrs[i].value.cooperative)
      return cuLaunchCooperativeKernel(h, cfg->gridDimX, cfg->gridDimY, cfg->gridDimZ, cfg->blockDimX, cfg->blockDimY,
                                       cfg->blockDimZ, cfg->sharedMemBytes, cfg->hStream, params);
  }
  Stream* s;
  CU_TRY(resolveStream(cfg->hStream, &s));
  const unsigned grid[3] = {cfg->gridDimX, cfg->gridDimY, cfg->gridDimZ};
  const unsigned block[3] = {cfg->blockDimX, cfg->blockDimY, cfg->blockDimZ};
  return launchKernel(s, f, grid, block, cfg->sharedMemBytes, params, extra);
}

// ---- linker: simgpu runs nothing it would link, so linking is not offered ----
CU_EXPORT CUresult cuLinkCreate_v2(unsigned n, CUjit_option* o, void** v, CUlinkState* st) {
  API_ENTER(n, o, v, st);
  return CUDA_ERROR_NOT_SUPPORTED;
}
