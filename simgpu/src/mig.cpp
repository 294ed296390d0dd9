// MIG tables and state; see mig.h. Sources of the numbers: docs/simgpu.md, "MIG".
#include "mig.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string_view>
#include <strings.h>

#include "config.h"
#include "cushare/shim_config.h"

namespace simgpu::mig {
namespace {

constexpr uint64_t kMagic = 0x4749444d55504753ull;  // "SGPUMDIG"
constexpr uint32_t kVersion = 1;

// Placements on the memory-slice axis, the same on every model the MIG guide lists.
const std::vector<unsigned> k1{0, 1, 2, 3, 4, 5, 6}, k2mem{0, 2, 4, 6}, k2g{0, 2, 4}, k3g{0, 4}, k0{0};

// NVML indexes: 0 1_SLICE, 1 2_SLICE, 2 3_SLICE, 3 4_SLICE, 4 7_SLICE, 7 1_SLICE_REV1 (+me),
// 9 1_SLICE_REV2 (twice the memory). Columns: index, id, name, slices, memory slices, instances,
// SMs, MiB, CE, DEC, ENC, JPEG, OFA, starts.
const std::vector<Model> kModels = {
    {"a100-40gb", "NVIDIA A100-SXM4-40GB", 40960, 108, false,
     {{0, 19, "1g.5gb", 1, 1, 7, 14, 4864, 1, 0, 0, 0, 0, k1},
      {7, 20, "1g.5gb+me", 1, 1, 1, 14, 4864, 1, 1, 0, 1, 1, k1},
      {9, 15, "1g.10gb", 1, 2, 4, 14, 9856, 1, 1, 0, 0, 0, k2mem},
      {1, 14, "2g.10gb", 2, 2, 3, 28, 9856, 2, 1, 0, 0, 0, k2g},
      {2, 9, "3g.20gb", 3, 4, 2, 42, 20096, 3, 2, 0, 0, 0, k3g},
      {3, 5, "4g.20gb", 4, 4, 1, 56, 20096, 4, 2, 0, 0, 0, k0},
      {4, 0, "7g.40gb", 7, 8, 1, 98, 40192, 7, 5, 0, 1, 1, k0}}},
    {"a100-80gb", "NVIDIA A100-SXM4-80GB", 81920, 108, false,
     {{0, 19, "1g.10gb", 1, 1, 7, 14, 9728, 1, 0, 0, 0, 0, k1},
      {7, 20, "1g.10gb+me", 1, 1, 1, 14, 9728, 1, 1, 0, 1, 1, k1},
      {9, 15, "1g.20gb", 1, 2, 4, 14, 19968, 1, 1, 0, 0, 0, k2mem},
      {1, 14, "2g.20gb", 2, 2, 3, 28, 19968, 2, 1, 0, 0, 0, k2g},
      {2, 9, "3g.40gb", 3, 4, 2, 42, 40192, 3, 2, 0, 0, 0, k3g},
      {3, 5, "4g.40gb", 4, 4, 1, 56, 40192, 4, 2, 0, 0, 0, k0},
      {4, 0, "7g.80gb", 7, 8, 1, 98, 80896, 7, 5, 0, 1, 1, k0}}},
    {"h100-80gb", "NVIDIA H100 80GB HBM3", 81559, 132, true,
     {{0, 19, "1g.10gb", 1, 1, 7, 16, 9984, 1, 1, 0, 1, 0, k1},
      {7, 20, "1g.10gb+me", 1, 1, 1, 16, 9984, 1, 1, 0, 1, 1, k1},
      {9, 15, "1g.20gb", 1, 2, 4, 26, 20096, 1, 1, 0, 1, 0, k2mem},
      {1, 14, "2g.20gb", 2, 2, 3, 32, 20096, 2, 2, 0, 2, 0, k2g},
      {2, 9, "3g.40gb", 3, 4, 2, 60, 40448, 3, 3, 0, 3, 0, k3g},
      {3, 5, "4g.40gb", 4, 4, 1, 64, 40448, 4, 4, 0, 4, 0, k0},
      {4, 0, "7g.80gb", 7, 8, 1, 132, 81152, 8, 7, 0, 7, 1, k0}}},
    {"h200", "NVIDIA H200", 143771, 132, true,
     {{0, 19, "1g.18gb", 1, 1, 7, 16, 16384, 1, 1, 0, 1, 0, k1},
      {7, 20, "1g.18gb+me", 1, 1, 1, 16, 16384, 1, 1, 0, 1, 1, k1},
      {9, 15, "1g.35gb", 1, 2, 4, 26, 33024, 1, 1, 0, 1, 0, k2mem},
      {1, 14, "2g.35gb", 2, 2, 3, 32, 33024, 2, 2, 0, 2, 0, k2g},
      {2, 9, "3g.71gb", 3, 4, 2, 60, 71168, 3, 3, 0, 3, 0, k3g},
      {3, 5, "4g.71gb", 4, 4, 1, 64, 71168, 4, 4, 0, 4, 0, k0},
      {4, 0, "7g.141gb", 7, 8, 1, 132, 143104, 8, 7, 0, 7, 1, k0}}},
};

// CI sizes by NVML index (NVML_COMPUTE_INSTANCE_PROFILE_1/2/3/4/7_SLICE).
constexpr unsigned kCiSlices[] = {1, 2, 3, 4, 7};

std::string path(const std::string& dir) { return dir + "/mig"; }

// Every entry as the code writes it (the file is shared with every user of the simulated host):
// an entry's ID is its index, placements lie on their axes, profiles in range.
bool wellFormed(const State& s) {
  for (const DeviceMig& d : s.dev) {
    if (d.current > 1 || d.pending > 1) return false;
    for (unsigned g = 0; g < kMaxGpuInstances; ++g) {
      const Gi& gi = d.gi[g];
      if (gi.used > 1) return false;
      if (!gi.used) continue;
      if (gi.id != g || gi.profileId >= 32 || gi.size == 0 || gi.start >= kMemorySlices ||
          gi.size > kMemorySlices - gi.start)
        return false;
      for (unsigned c = 0; c < kMaxComputeInstances; ++c) {
        const Ci& ci = gi.ci[c];
        if (ci.used > 1) return false;
        if (ci.used && (ci.id != c || ci.profile >= 5 || ci.size == 0 || ci.start >= kComputeSlices ||
                        ci.size > kComputeSlices - ci.start))
          return false;
      }
    }
  }
  return true;
}

bool overlaps(unsigned a, unsigned as, unsigned b, unsigned bs) { return a < b + bs && b < a + as; }

uint64_t mix(uint64_t x) {  // splitmix64's finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

const Model* findModel(const std::string& key) {
  for (const Model& m : kModels)
    if (key == m.key) return &m;
  return nullptr;
}

std::string modelKeys() {
  std::string out;
  for (const Model& m : kModels) out += std::string(out.empty() ? "" : ", ") + m.key;
  return out;
}

const GiProfile* giProfileByIndex(const Model& m, unsigned index) {
  for (const GiProfile& p : m.gi)
    if (p.index == index) return &p;
  return nullptr;
}

const GiProfile* giProfileById(const Model& m, unsigned id) {
  for (const GiProfile& p : m.gi)
    if (p.id == id) return &p;
  return nullptr;
}

bool ciProfile(const GiProfile& gi, unsigned index, CiProfile* out) {
  if (index >= sizeof kCiSlices / sizeof kCiSlices[0]) return false;
  const unsigned c = kCiSlices[index];
  // As go-nvlib lists them: at most the GI's slices, and a smaller CI only where 2c <= g + 1.
  if (c > gi.slices || (c < gi.slices && 2 * c > gi.slices + 1)) return false;
  out->index = index;
  out->slices = c;
  out->instances = gi.slices / c;
  out->sms = gi.sms * c / gi.slices;
  return true;
}

std::vector<unsigned> ciStarts(const GiProfile& gi, const CiProfile& ci) {
  std::vector<unsigned> s;
  for (unsigned start = 0; start + ci.slices <= gi.slices; start += ci.slices) s.push_back(start);
  return s;
}

std::string derivedName(unsigned slices, uint64_t memoryMiB, uint64_t gpuMemoryMiB) {
  const double fraction = std::ceil(static_cast<double>(memoryMiB) / static_cast<double>(gpuMemoryMiB) * 8.0) / 8.0;
  const double gib = std::ceil(static_cast<double>(gpuMemoryMiB) / 1024.0);
  return std::to_string(slices) + "g." + std::to_string(static_cast<long long>(std::round(fraction * gib))) + "gb";
}

unsigned giIdFor(unsigned start, unsigned memSlices) {
  switch (memSlices) {
    case 8: return 0;
    case 4: return start == 4 ? 1 : 2;
    case 2: return 3 + start / 2;
    default: return 7 + start;
  }
}

std::vector<MigDevice> migDevices(const Model& m, const DeviceMig& d) {
  std::vector<MigDevice> out;
  if (d.current != 1) return out;
  for (unsigned g = 0; g < kMaxGpuInstances; ++g) {
    const Gi& gi = d.gi[g];
    if (!gi.used) continue;
    const GiProfile* gp = giProfileById(m, gi.profileId);
    if (!gp) continue;
    for (unsigned c = 0; c < kMaxComputeInstances; ++c) {
      const Ci& ci = gi.ci[c];
      CiProfile cp;
      if (!ci.used || !ciProfile(*gp, ci.profile, &cp)) continue;
      out.push_back({static_cast<unsigned>(out.size()), gi.id, ci.id, gp, cp});
    }
  }
  return out;
}

void migUuidBytes(int hostDevice, unsigned gi, unsigned ci, unsigned char u[16]) {
  unsigned char parent[16];
  deviceUuid(hostDevice, parent);
  uint64_t seed = 0;
  for (unsigned char b : parent) seed = mix(seed ^ b);
  const uint64_t hi = mix(seed ^ (uint64_t{gi} << 8 | ci)), lo = mix(hi ^ 0x4d4947u);
  for (int i = 0; i < 8; ++i) {
    u[i] = static_cast<unsigned char>(hi >> (8 * i));
    u[8 + i] = static_cast<unsigned char>(lo >> (8 * i));
  }
  u[6] = static_cast<unsigned char>((u[6] & 0x0f) | 0x50);  // version 5 (name-based), as NVIDIA's
  u[8] = static_cast<unsigned char>((u[8] & 0x3f) | 0x80);  // RFC 4122 variant
}

std::string migUuid(int hostDevice, unsigned gi, unsigned ci) {
  unsigned char u[16];
  migUuidBytes(hostDevice, gi, ci, u);
  char s[48];
  std::snprintf(s, sizeof s, "MIG-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1],
                u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
  return s;
}

bool findMigDevice(const Model& m, const State& s, const int* hosts, int n, const std::string& entry, int* host,
                   MigDevice* out) {
  if (strncasecmp(entry.c_str(), "MIG-", 4) != 0) return false;
  for (int i = 0; i < n; ++i)
    for (const MigDevice& d : migDevices(m, s.dev[hosts[i]])) {
      const std::string legacy = "MIG-" + deviceUuidString(hosts[i]) + "/" + std::to_string(d.gi) + "/" +
                                 std::to_string(d.ci);
      if (strcasecmp(migUuid(hosts[i], d.gi, d.ci).c_str(), entry.c_str()) == 0 ||
          strcasecmp(legacy.c_str(), entry.c_str()) == 0) {
        *host = hosts[i];
        *out = d;
        return true;
      }
    }
  return false;
}

std::string profileName(const GiProfile& gp, const CiProfile& cp) {
  return cp.slices == gp.slices ? std::string(gp.name) : std::to_string(cp.slices) + "c." + gp.name;
}

std::string migDeviceName(const Model& m, const MigDevice& d) {
  return std::string(m.name) + " MIG " + profileName(*d.giProfile, d.ciProfile);
}

bool load(const std::string& stateDir, State* out, std::string* err) {
  *out = State{};
  const int fd = ::open(path(stateDir).c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    if (errno == ENOENT) return true;
    *err = "simgpu: cannot open " + path(stateDir) + ": " + std::strerror(errno);
    return false;
  }
  ::flock(fd, LOCK_SH);
  const ssize_t n = ::pread(fd, out, sizeof *out, 0);
  ::close(fd);
  if (n == 0) {
    *out = State{};
    return true;
  }
  if (n != static_cast<ssize_t>(sizeof *out) || out->magic != kMagic || out->version != kVersion ||
      out->size != sizeof *out || !wellFormed(*out)) {
    *err = "simgpu: " + path(stateDir) + " is not a MIG state file of this simgpu (version " +
           std::to_string(kVersion) + "); remove it";
    *out = State{};
    return false;
  }
  return true;
}

namespace detail {
bool updateImpl(const std::string& stateDir, bool (*f)(State*, void*), void* ctx, std::string* err) {
  const int fd = ::open(path(stateDir).c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0) {
    *err = "simgpu: cannot open " + path(stateDir) + ": " + std::strerror(errno);
    return false;
  }
  ::flock(fd, LOCK_EX);
  State s;
  const ssize_t n = ::pread(fd, &s, sizeof s, 0);
  if (n == 0) {
    s = State{};
    s.magic = kMagic;
    s.version = kVersion;
    s.size = sizeof s;
  } else if (n != static_cast<ssize_t>(sizeof s) || s.magic != kMagic || s.version != kVersion || s.size != sizeof s ||
             !wellFormed(s)) {
    ::close(fd);
    *err = "simgpu: " + path(stateDir) + " is not a MIG state file of this simgpu; remove it";
    return false;
  }
  const bool changed = f(&s, ctx);
  bool ok = true;
  if (changed && ::pwrite(fd, &s, sizeof s, 0) != static_cast<ssize_t>(sizeof s)) {
    *err = "simgpu: cannot write " + path(stateDir) + ": " + std::strerror(errno);
    ok = false;
  }
  ::close(fd);  // drops the flock
  return ok && changed;
}
}  // namespace detail

namespace {

// Memory slices and compute slices the GIs of d occupy, and instances per profile ID.
struct Occupancy {
  bool mem[kMemorySlices] = {};
  unsigned computeSlices = 0;
  unsigned count[32] = {};
};

Occupancy occupancy(const Model& m, const DeviceMig& d) {
  Occupancy o;
  for (const Gi& gi : d.gi) {
    if (!gi.used) continue;
    for (unsigned s = gi.start; s < gi.start + gi.size && s < kMemorySlices; ++s) o.mem[s] = true;
    if (const GiProfile* p = giProfileById(m, gi.profileId)) o.computeSlices += p->slices;
    if (gi.profileId < 32) ++o.count[gi.profileId];
  }
  return o;
}

}  // namespace

bool fits(const Model& m, const DeviceMig& d, const GiProfile& p, unsigned start) {
  bool valid = false;
  for (unsigned s : p.starts) valid = valid || s == start;
  if (!valid) return false;
  const Occupancy o = occupancy(m, d);
  if (o.count[p.id] >= p.instances || o.computeSlices + p.slices > kComputeSlices) return false;
  for (unsigned s = start; s < start + p.memSlices; ++s)
    if (s >= kMemorySlices || o.mem[s]) return false;
  return true;
}

int defaultStart(const DeviceMig& d, const GiProfile& p) {
  // (fits() needs the model for the compute slices; callers check that separately via fits.)
  for (auto it = p.starts.rbegin(); it != p.starts.rend(); ++it) {
    bool free = true;
    for (const Gi& gi : d.gi)
      if (gi.used && overlaps(gi.start, gi.size, *it, p.memSlices)) free = false;
    if (free) return static_cast<int>(*it);
  }
  return -1;
}

unsigned addGi(DeviceMig& d, const GiProfile& p, unsigned start) {
  const unsigned id = giIdFor(start, p.memSlices);
  Gi& gi = d.gi[id];
  gi = Gi{};
  gi.used = 1;
  gi.id = id;
  gi.profileId = p.id;
  gi.start = start;
  gi.size = p.memSlices;
  return id;
}

int addCi(Gi& gi, const CiProfile& cp, unsigned start) {
  for (unsigned c = 0; c < kMaxComputeInstances; ++c)
    if (!gi.ci[c].used) {
      gi.ci[c] = {1, c, cp.index, start, cp.slices};
      return static_cast<int>(c);
    }
  return -1;
}

unsigned remaining(const Model& m, const DeviceMig& d, const GiProfile& p) {
  DeviceMig t = d;
  unsigned n = 0;
  for (;;) {
    const int s = defaultStart(t, p);
    if (s < 0 || !fits(m, t, p, static_cast<unsigned>(s))) return n;
    addGi(t, p, static_cast<unsigned>(s));
    ++n;
  }
}

bool ciFits(const Gi& gi, const GiProfile& gp, const CiProfile& cp, unsigned start) {
  bool valid = false;
  for (unsigned s : ciStarts(gp, cp)) valid = valid || s == start;
  if (!valid) return false;
  unsigned same = 0;
  for (const Ci& c : gi.ci) {
    if (!c.used) continue;
    if (overlaps(c.start, c.size, start, cp.slices)) return false;
    if (c.profile == cp.index) ++same;
  }
  return same < cp.instances;
}

int defaultCiStart(const Gi& gi, const GiProfile& gp, const CiProfile& cp) {
  for (unsigned s : ciStarts(gp, cp))  // lowest free start, as nvidia-smi's examples show CI 0 at 0
    if (ciFits(gi, gp, cp, s)) return static_cast<int>(s);
  return -1;
}

unsigned ciRemaining(const Gi& gi, const GiProfile& gp, const CiProfile& cp) {
  Gi t = gi;
  unsigned n = 0;
  for (;;) {
    const int s = defaultCiStart(t, gp, cp);
    if (s < 0 || addCi(t, cp, static_cast<unsigned>(s)) < 0) return n;  // no place or no CI ID left
    ++n;
  }
}

std::string firstMigEntry(const char* visible) { return cushare::firstMigEntry(visible ? visible : ""); }

}  // namespace simgpu::mig
