// SIMGPU_* environment parsing and stable device identities.
#include "config.h"

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "cushare/parse.h"
#include "mig.h"

namespace simgpu {

namespace {

bool equalsNoCase(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(a[i])) != std::tolower(static_cast<unsigned char>(b[i])))
      return false;
  return true;
}

// SIMGPU_CONTAINER_DEVICES: comma-separated host indices or full UUIDs (any case), each at most
// once; empty: a container given no GPU. Stored in host order, as the driver and NVML inside a
// container enumerate the device nodes they were given, whatever order the runtime listed them in.
bool parseContainerDevices(std::string_view v, Config* c, std::string* why) {
  bool given[kMaxDevices] = {};
  while (!v.empty()) {
    const size_t comma = v.find(',');
    std::string_view item = v.substr(0, comma);
    while (!item.empty() && item.front() == ' ') item.remove_prefix(1);
    while (!item.empty() && item.back() == ' ') item.remove_suffix(1);
    int dev = -1;
    if (item.size() > 4 && equalsNoCase(item.substr(0, 4), "GPU-")) {
      for (int d = 0; d < c->deviceCount && dev < 0; ++d)
        if (equalsNoCase(item, deviceUuidString(d))) dev = d;
      if (dev < 0) return *why = "no host device has UUID '" + std::string(item) + "'", false;
    } else {
      int64_t n;
      if (!cushare::parseInt(item, 0, c->deviceCount - 1, &n, why))
        return *why = "'" + std::string(item) + "' is neither a host device index (0.." +
                      std::to_string(c->deviceCount - 1) + ") nor a full GPU UUID",
               false;
      dev = static_cast<int>(n);
    }
    if (given[dev]) return *why = "device " + std::to_string(dev) + " is listed twice", false;
    given[dev] = true;
    if (comma == std::string_view::npos) break;
    v.remove_prefix(comma + 1);
    if (v.empty()) return *why = "ends with ','", false;
  }
  c->containerCount = 0;
  for (int d = 0; d < c->deviceCount; ++d)
    if (given[d]) c->container[c->containerCount++] = d;
  return true;
}

}  // namespace

bool loadConfig(Config* c, std::string* error) {
  auto bad = [&](const char* var, const char* value, const std::string& why) {
    *error = std::string("simgpu: invalid ") + var + "='" + value + "': " + why;
    return false;
  };
  std::string why;
  if (const char* v = std::getenv("SIMGPU_DEVICES")) {
    int64_t n;
    if (!cushare::parseInt(v, 1, kMaxDevices, &n, &why)) return bad("SIMGPU_DEVICES", v, why);
    c->deviceCount = static_cast<int>(n);
  }
  c->containerCount = c->deviceCount;
  for (int d = 0; d < c->deviceCount; ++d) c->container[d] = d;
  if (const char* v = std::getenv("SIMGPU_CONTAINER_DEVICES"))
    if (!parseContainerDevices(v, c, &why)) return bad("SIMGPU_CONTAINER_DEVICES", v, why);
  for (int d = 0; d < kMaxDevices; ++d) c->memory[d] = 16ull << 30;
  if (const char* v = std::getenv("SIMGPU_MEMORY")) {
    std::string_view rest(v);
    int d = 0;
    uint64_t last = 0;
    while (true) {
      const size_t comma = rest.find(',');
      const std::string_view item = rest.substr(0, comma);
      uint64_t bytes;
      if (!cushare::parseSize(item, &bytes, &why)) return bad("SIMGPU_MEMORY", v, why);
      if (bytes < (1ull << 20)) return bad("SIMGPU_MEMORY", v, "a device needs at least 1 MiB");
      if (bytes > (1ull << 46)) return bad("SIMGPU_MEMORY", v, "more than 64 TiB per device");
      if (d >= kMaxDevices) return bad("SIMGPU_MEMORY", v, "more sizes than devices");
      c->memory[d++] = last = bytes;
      if (comma == std::string_view::npos) break;
      rest.remove_prefix(comma + 1);
    }
    if (d > 1 && d != c->deviceCount)
      return bad("SIMGPU_MEMORY", v,
                 "lists " + std::to_string(d) + " sizes for " + std::to_string(c->deviceCount) +
                     " device(s) (give one size for all, or one per device)");
    for (int k = d; k < kMaxDevices; ++k) c->memory[k] = last;
  }
  if (const char* v = std::getenv("SIMGPU_SMS")) {
    int64_t n;
    if (!cushare::parseInt(v, 1, 1024, &n, &why)) return bad("SIMGPU_SMS", v, why);
    c->smCount = static_cast<uint32_t>(n);
  }
  c->name = "NVIDIA H100 80GB HBM3 (simgpu)";
  if (const char* v = std::getenv("SIMGPU_GPU_MODEL")) {
    // A board of a known model: its name, memory, SMs and MIG profiles (mig.h). It sets what
    // SIMGPU_MEMORY and SIMGPU_SMS would, so a value for either as well is refused, not ignored.
    c->model = mig::findModel(v);
    if (!c->model) return bad("SIMGPU_GPU_MODEL", v, "not a model simgpu knows (" + mig::modelKeys() + ")");
    if (std::getenv("SIMGPU_MEMORY"))
      return bad("SIMGPU_GPU_MODEL", v, "sets the memory itself; unset SIMGPU_MEMORY");
    if (std::getenv("SIMGPU_SMS")) return bad("SIMGPU_GPU_MODEL", v, "sets the SM count itself; unset SIMGPU_SMS");
    for (int d = 0; d < kMaxDevices; ++d) c->memory[d] = c->model->memoryMiB << 20;
    c->smCount = c->model->sms;
    c->name = c->model->name;
  }
  if (const char* v = std::getenv("SIMGPU_NAME")) {
    std::string_view s(v);
    if (s.empty() || s.size() > 95) return bad("SIMGPU_NAME", v, "must be 1 to 95 characters");
    c->name = v;
  }
  c->stateDir = "/dev/shm/simgpu";
  if (const char* v = std::getenv("SIMGPU_STATE_DIR")) {
    if (v[0] != '/') return bad("SIMGPU_STATE_DIR", v, "must be an absolute path");
    c->stateDir = v;
  }
  if (const char* v = std::getenv("SIMGPU_TRACE")) {
    std::string_view s(v);
    if (s == "1" || s == "true")
      c->trace = true;
    else if (s == "0" || s == "false" || s.empty())
      c->trace = false;
    else
      return bad("SIMGPU_TRACE", v, "expected 0 or 1");
  }
  if (const char* v = std::getenv("SIMGPU_KERNEL_COSTS")) {
    if (v[0] != '/') return bad("SIMGPU_KERNEL_COSTS", v, "must be an absolute path to a cost table");
    if (!loadCostTable(v, &c->costs, &why)) return bad("SIMGPU_KERNEL_COSTS", v, why);
    c->costsPath = v;
  }
  if (const char* v = std::getenv("SIMGPU_TIME_SCALE")) {
    char* end = nullptr;
    const double d = std::strtod(v, &end);
    if (end == v || *end != '\0' || !(d >= 0.01 && d <= 1000))
      return bad("SIMGPU_TIME_SCALE", v, "expected a number from 0.01 to 1000 (real time per device time)");
    c->timeScale = d;
  }
  if (const char* v = std::getenv("SIMGPU_TIME_SLICE_US")) {
    int64_t n;
    if (!cushare::parseInt(v, 1, 10'000'000, &n, &why)) return bad("SIMGPU_TIME_SLICE_US", v, why);
    c->sliceNs = static_cast<uint64_t>(n) * 1000;
  }
  if (const char* v = std::getenv("SIMGPU_TEST_SM_CAP")) {
    int64_t n;
    if (!cushare::parseInt(v, 1, 1024, &n, &why)) return bad("SIMGPU_TEST_SM_CAP", v, why);
    c->testSmCap = static_cast<uint32_t>(n);
  }
  if (const char* v = std::getenv("SIMGPU_SWITCH_US")) {
    int64_t n;
    if (!cushare::parseInt(v, 0, 1'000'000, &n, &why)) return bad("SIMGPU_SWITCH_US", v, why);
    c->switchNs = static_cast<uint64_t>(n) * 1000;
  }
  if (const char* v = std::getenv("SIMGPU_FAULT_US")) {
    int64_t n;
    if (!cushare::parseInt(v, 0, 1'000'000, &n, &why)) return bad("SIMGPU_FAULT_US", v, why);
    c->faultChunkNs = static_cast<uint64_t>(n) * 1000;
  }
  return true;
}

int visibleDevices(const Config& c, const char* visible, int out[kMaxDevices]) {
  // The driver's enumeration order: simgpu's devices are equally fast, so FASTEST_FIRST (the
  // default) and PCI_BUS_ID agree, and CUDA_DEVICE_ORDER changes nothing here.
  if (!visible) {
    for (int i = 0; i < c.containerCount; ++i) out[i] = c.container[i];
    return c.containerCount;
  }
  std::string_view rest(visible);
  int n = 0;
  bool byUuid = false;
  while (n < kMaxDevices) {
    const size_t comma = rest.find(',');
    std::string_view item = rest.substr(0, comma);
    while (!item.empty() && std::isspace(static_cast<unsigned char>(item.front()))) item.remove_prefix(1);
    // An entry names a device by index (strtoul-like: optional '+', the leading digits, anything
    // after them ignored) or by a prefix of its UUID including "GPU-". The first entry decides
    // which; an entry of the other kind ends the list like an invalid one.
    const bool uuid = item.substr(0, 4) == "GPU-";
    if (n == 0) byUuid = uuid;
    int dev = -1;
    if (uuid && byUuid) {
      for (int i = 0; i < c.containerCount; ++i)
        if (deviceUuidString(c.container[i]).compare(0, item.size(), item) == 0) {
          if (dev >= 0) return n;  // ambiguous prefix: the list ends here
          dev = c.container[i];
        }
    } else if (!uuid && !byUuid) {
      if (!item.empty() && item.front() == '+') item.remove_prefix(1);
      size_t digits = 0;
      uint64_t index = 0;
      while (digits < item.size() && std::isdigit(static_cast<unsigned char>(item[digits])) && index < kMaxDevices)
        index = index * 10 + static_cast<uint64_t>(item[digits++] - '0');
      if (digits > 0 && index < static_cast<uint64_t>(c.containerCount)) dev = c.container[index];
    }
    if (dev < 0) return n;  // invalid, unknown, or of the other kind: the list ends here
    for (int i = 0; i < n; ++i)
      if (out[i] == dev) return 0;  // a repeated device: no device at all
    out[n++] = dev;
    if (comma == std::string_view::npos) break;
    rest.remove_prefix(comma + 1);
  }
  return n;
}

void deviceUuid(int ordinal, unsigned char out[16]) {
  // Fixed prefix + ordinal: stable across processes and runs, distinct per device, version-4 shape.
  static constexpr unsigned char kBase[16] = {0x5e, 0x1a, 0x90, 0xc0, 0x51, 0x3d, 0x4b, 0x1e,
                                              0x8a, 0x7f, 0x2c, 0x61, 0x00, 0x00, 0x00, 0x00};
  for (int i = 0; i < 16; ++i) out[i] = kBase[i];
  out[14] = static_cast<unsigned char>(ordinal >> 8);
  out[15] = static_cast<unsigned char>(ordinal);
}

unsigned devicePciBus(int ordinal) { return 0x18u + static_cast<unsigned>(ordinal); }

std::string deviceUuidString(int ordinal) {
  unsigned char u[16];
  deviceUuid(ordinal, u);
  char buf[48];
  std::snprintf(buf, sizeof buf,
                "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1],
                u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
  return buf;
}

std::string devicePciBusId(int ordinal) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "00000000:%02X:00.0", devicePciBus(ordinal));
  return buf;
}

}  // namespace simgpu
