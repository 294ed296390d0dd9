// Road 4: dlmopen into another link-map namespace. A preloaded library is loaded into the base
// namespace only, so a driver or NVML loaded into another namespace would be a copy the shim never
// sees: its allocations and its memory view would bypass the limit. And any library loaded there
// can load the driver later with that namespace's own dlopen (a libcudart does, on first use),
// out of the shim's reach. So the shim's dlmopen (dlsym_x86_64.S) leaves base-namespace loads to
// glibc untouched and, for any other namespace, loads nothing there:
//  - the driver or NVML itself (by soname, or a file that defines cuInit / nvmlInit, found by
//    reading its symbol table, so a renamed copy or a symbolic link is recognised): the caller gets
//    a handle to the process's own copy in the base namespace, the one the shim wraps; dlsym and
//    dlvsym on it answer the shim's entry points, and the process keeps one driver state and one
//    ledger slot;
//  - anything else: refused, before glibc maps it (no constructor of it runs): null, a dlerror
//    naming the reason, one log line.
// Not seen from here (docs/security.md): a namespace made without this dlmopen (glibc's found by
// other means), and code that resolves entry points without the dynamic linker.
#include <dlfcn.h>
#include <fcntl.h>
#include <link.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "interpose/real.h"
#include "runtime/log.h"

extern "C" void* cushare_dlmopen_other(Lmid_t nsid, const char* file, int mode) noexcept;

namespace cushare::shim {
namespace {

void* realDlmopenFn() noexcept {
  static void* real = nullptr;
  void* p = __atomic_load_n(&real, __ATOMIC_ACQUIRE);
  if (!p) {
    p = realDlsym(RTLD_NEXT, "dlmopen");  // after the shim: another interposer's, else glibc's
    __atomic_store_n(&real, p, __ATOMIC_RELEASE);
  }
  return p;
}

// glibc searches for a bare library name along the calling object's RPATH and RUNPATH, which it
// finds from the return address: the shim's C code calling glibc would search along the shim's.
// So the caller's search path (without the system directories, which come after ld.so.cache and
// are the same for everyone) is walked here first, and a hit is loaded by its path.
bool findAlongCallersPath(const char* file, void* caller, std::string* path) noexcept {
  Dl_info info;
  link_map* map = nullptr;
  if (!dladdr1(caller, &info, reinterpret_cast<void**>(&map), RTLD_DL_LINKMAP) || !map)
    return false;
  Dl_serinfo size;
  if (dlinfo(map, RTLD_DI_SERINFOSIZE, &size) != 0) return false;
  std::vector<char> buffer(size.dls_size);
  auto* list = reinterpret_cast<Dl_serinfo*>(buffer.data());
  *list = size;
  if (dlinfo(map, RTLD_DI_SERINFO, list) != 0) return false;
  for (unsigned i = 0; i < list->dls_cnt; ++i) {
    if (list->dls_serpath[i].dls_flags & LA_SER_DEFAULT) continue;
    std::string candidate = std::string(list->dls_serpath[i].dls_name) + "/" + file;
    if (access(candidate.c_str(), F_OK) == 0) {
      *path = std::move(candidate);
      return true;
    }
  }
  return false;
}

enum class Library { kOther, kDriver, kNvml };

// What the ELF file at path defines: the driver (cuInit) or NVML (nvmlInit), read from its dynamic
// symbol table without loading it. Anything unreadable is kOther (and refused).
Library libraryAt(const char* path) noexcept {
  const int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Library::kOther;
  Library kind = Library::kOther;
  struct stat st;
  void* map = fstat(fd, &st) == 0 && st.st_size > static_cast<off_t>(sizeof(ElfW(Ehdr)))
                  ? mmap(nullptr, st.st_size, PROT_READ, MAP_PRIVATE, fd, 0)
                  : MAP_FAILED;
  close(fd);
  if (map == MAP_FAILED) return kind;
  const auto* base = static_cast<const char*>(map);
  const size_t size = static_cast<size_t>(st.st_size);
  const auto* eh = reinterpret_cast<const ElfW(Ehdr)*>(base);
  const bool elf = std::memcmp(eh->e_ident, ELFMAG, SELFMAG) == 0 &&
                   eh->e_ident[EI_CLASS] == ELFCLASS64 && eh->e_shentsize == sizeof(ElfW(Shdr)) &&
                   eh->e_shoff < size && eh->e_shnum <= (size - eh->e_shoff) / sizeof(ElfW(Shdr));
  const auto* sh = elf ? reinterpret_cast<const ElfW(Shdr)*>(base + eh->e_shoff) : nullptr;
  for (unsigned i = 0; sh && i < eh->e_shnum && kind == Library::kOther; ++i) {
    if (sh[i].sh_type != SHT_DYNSYM || sh[i].sh_link >= eh->e_shnum) continue;
    const ElfW(Shdr)& strs = sh[sh[i].sh_link];
    if (sh[i].sh_offset > size || sh[i].sh_size > size - sh[i].sh_offset || strs.sh_offset > size ||
        strs.sh_size > size - strs.sh_offset)
      continue;
    const auto* syms = reinterpret_cast<const ElfW(Sym)*>(base + sh[i].sh_offset);
    const char* names = base + strs.sh_offset;
    for (size_t k = 0; k < sh[i].sh_size / sizeof(ElfW(Sym)); ++k) {
      if (syms[k].st_shndx == SHN_UNDEF || syms[k].st_name >= strs.sh_size) continue;
      const char* n = names + syms[k].st_name;
      const size_t room = strs.sh_size - syms[k].st_name;
      if (strnlen(n, room) == room) continue;
      if (std::strcmp(n, "cuInit") == 0) kind = Library::kDriver;
      if (std::strcmp(n, "nvmlInit") == 0 || std::strcmp(n, "nvmlInit_v2") == 0)
        kind = Library::kNvml;
      if (kind != Library::kOther) break;
    }
  }
  munmap(map, size);
  return kind;
}

// Leaves a dlerror message for a refused load: glibc keeps the message of the last failed call, so
// the shim fails one whose message names the reason (a path that cannot exist).
void failWithReason() noexcept {
  const char* path =
      "/proc/self/cushare: loading into another link-map namespace is refused (only the "
      "CUDA driver and NVML, answered with the process's own)";
  if (void* h = dlopen(path, RTLD_LAZY)) dlclose(h);
}

void* refuse(const char* file, const char* why) noexcept {
  CUSHARE_LOG(LogLevel::kError, "dlmopen of %s into another link-map namespace refused: %s",
              file ? file : "(null)", why);
  failWithReason();
  return nullptr;
}

}  // namespace
}  // namespace cushare::shim

// Where the shim's dlmopen goes (dlsym_x86_64.S): glibc's for the base namespace, the check below
// for any other.
extern "C" __attribute__((visibility("hidden"))) void* cushare_dlmopen_route(Lmid_t nsid,
                                                                             const char*, int) {
  if (nsid == LM_ID_BASE) return cushare::shim::realDlmopenFn();
  return reinterpret_cast<void*>(&cushare_dlmopen_other);
}

extern "C" __attribute__((visibility("hidden"))) void* cushare_dlmopen_other(Lmid_t,
                                                                             const char* file,
                                                                             int) noexcept {
  using namespace cushare::shim;
  if (!file) return refuse(file, "no file named");
  // Jumped to from dlmopen: the return address is the caller's, whose search path a bare name
  // is looked up along, as glibc would.
  std::string path;
  Library kind = Library::kOther;
  const char* base = std::strrchr(file, '/');
  base = base ? base + 1 : file;
  if (std::strncmp(base, "libcuda.so", 10) == 0 && (base[10] == '\0' || base[10] == '.'))
    kind = Library::kDriver;
  if (std::strncmp(base, "libnvidia-ml.so", 15) == 0 && (base[15] == '\0' || base[15] == '.'))
    kind = Library::kNvml;
  if (kind == Library::kOther) {
    if (std::strchr(file, '/'))
      kind = libraryAt(file);
    else if (findAlongCallersPath(file, __builtin_return_address(0), &path))
      kind = libraryAt(path.c_str());
  }
  if (kind == Library::kOther)
    return refuse(
        file,
        "only the CUDA driver and NVML are loaded there (answered with the process's own); "
        "the shim cannot follow any other library into another namespace");
  std::string error;
  const bool isDriver = kind == Library::kDriver;
  if (isDriver ? !loadRealDriver(&error) : !loadRealNvml())
    return refuse(file, isDriver ? error.c_str()
                                 : "the process's own NVML (libnvidia-ml.so.1) cannot be loaded");
  void* own = dlopen(isDriver ? "libcuda.so.1" : "libnvidia-ml.so.1", RTLD_NOW | RTLD_NOLOAD);
  CUSHARE_LOG(LogLevel::kInfo,
              "dlmopen of %s into another link-map namespace answered with the process's %s", file,
              isDriver ? "CUDA driver" : "NVML");
  return own;
}
