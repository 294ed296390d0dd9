// See host_segment.h.
#include "cushare/host_segment.h"

#include "cushare/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "cushare/ledger.h"

namespace cushare {
namespace {

std::string sysErr(const std::string& what) { return what + ": " + std::strerror(errno); }

std::string check(const HostSegmentLayout& h, uint64_t fileBytes) {
  auto field = [](const char* name, uint64_t got, uint64_t want) {
    return std::string("field '") + name + "' is " + std::to_string(got) + ", expected " +
           std::to_string(want);
  };
  if (h.magic != kHostMagic) return "field 'magic' does not read \"CUSHHST\": not a host segment";
  if (h.version != kHostVersion)
    return field("version", h.version, kHostVersion) + " (this cushare reads version " +
           std::to_string(kHostVersion) + " only)";
  if (h.header_size != sizeof(HostSegmentLayout))
    return field("header_size", h.header_size, sizeof(HostSegmentLayout));
  if (h.file_size != sizeof(HostSegmentLayout) || fileBytes != sizeof(HostSegmentLayout))
    return field("file_size", fileBytes, sizeof(HostSegmentLayout));
  if (h.device_count > kHostMaxDevices)
    return "field 'device_count' is " + std::to_string(h.device_count) + ", at most " +
           std::to_string(kHostMaxDevices);
  if (h.unknown_policy != kHostRefuseUnknown && h.unknown_policy != kHostProfileForUnknown)
    return "field 'unknown_policy' is " + std::to_string(h.unknown_policy) + ", expected 0 or 1";
  if (std::memchr(h.unknown_profile, '\0', sizeof h.unknown_profile) == nullptr)
    return "field 'unknown_profile' is not NUL-terminated";
  if (h.metering > kHostMeteringAuto)
    return "field 'metering' is " + std::to_string(h.metering) + ", expected 0 (events), 1 (cupti) or 2 (auto)";
  if (std::memchr(h.cupti_library, '\0', sizeof h.cupti_library) == nullptr)
    return "field 'cupti_library' is not NUL-terminated";
  if (h.cupti_library[0] != '\0' && h.cupti_library[0] != '/')
    return "field 'cupti_library' is not an absolute path";
  if (h.unknown_policy == kHostProfileForUnknown &&
      !Ledger::validTenantName(h.unknown_profile, nullptr))
    return "field 'unknown_profile' is not a valid profile name";
  return "";
}

}  // namespace

const HostDevice* HostInfo::device(const uint8_t uuid[16]) const {
  for (const HostDevice& d : devices)
    if (std::memcmp(d.uuid, uuid, 16) == 0) return &d;
  return nullptr;
}

int readHostSegment(const std::string& dir, HostInfo* out, std::string* err) {
  const std::string path = dir + "/" + kHostSegmentName;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    if (errno == ENOENT) return 0;
    *err = sysErr("cannot open the broker's host segment " + path);
    return -1;
  }
  HostSegmentLayout h{};
  struct stat st, dirSt;
  ssize_t n = -1;
  if (::fstat(fd, &st) == 0 && ::stat(dir.c_str(), &dirSt) == 0 &&
      (st.st_uid != dirSt.st_uid || (st.st_mode & 022) != 0)) {
    // Only the directory's owner (the broker) may speak for the host.
    ::close(fd);
    *err = "the broker's host segment " + path + " belongs to uid " + std::to_string(st.st_uid) +
           " or is writable by others, but the directory belongs to uid " + std::to_string(dirSt.st_uid) +
           ": refused";
    return -1;
  }
  if (::fstat(fd, &st) == 0) {
    do n = ::pread(fd, &h, sizeof h, 0);
    while (n < 0 && errno == EINTR);
  }
  const int readErrno = errno;
  ::close(fd);
  if (n < 0) {
    errno = readErrno;
    *err = sysErr("cannot read the broker's host segment " + path);
    return -1;
  }
  if (!S_ISREG(st.st_mode)) {
    *err = "the broker's host segment " + path + " is not a regular file";
    return -1;
  }
  // A short read leaves zeros, which check() refuses (magic or file_size).
  if (std::string why = check(h, static_cast<uint64_t>(st.st_size)); !why.empty()) {
    *err = "the broker's host segment " + path + ": " + why;
    return -1;
  }
  HostInfo info;
  info.brokerPid = h.broker_pid;
  info.configGeneration = h.config_generation;
  info.profileForUnknown = h.unknown_policy == kHostProfileForUnknown;
  if (info.profileForUnknown) info.unknownProfile = h.unknown_profile;
  info.ownerUid = st.st_uid;
  info.metering = h.metering;
  info.cuptiLibrary = h.cupti_library;
  for (uint32_t i = 0; i < h.device_count; ++i) {
    HostDevice d;
    std::memcpy(d.uuid, h.devices[i].uuid, 16);
    d.capacity = h.devices[i].capacity;
    d.unknownLimit = h.devices[i].unknown_limit;
    info.devices.push_back(d);
  }
  *out = std::move(info);
  return 1;
}

bool writeHostSegment(const std::string& dir, const HostInfo& info, std::string* err) {
  if (info.devices.size() > kHostMaxDevices) {
    *err = "more than " + std::to_string(kHostMaxDevices) + " devices";
    return false;
  }
  if (info.unknownProfile.size() >= sizeof(HostSegmentLayout::unknown_profile)) {
    *err = "profile name too long for the host segment";
    return false;
  }
  if (info.metering > kHostMeteringAuto) {
    *err = "metering " + std::to_string(info.metering) + " is not a source";
    return false;
  }
  if (info.cuptiLibrary.size() >= kHostCuptiPathBytes ||
      (!info.cuptiLibrary.empty() && info.cuptiLibrary.front() != '/') ||
      info.cuptiLibrary.find('\0') != std::string::npos) {
    *err = "the CUPTI library path must be absolute and under " + std::to_string(kHostCuptiPathBytes) + " bytes";
    return false;
  }
  HostSegmentLayout h{};
  h.magic = kHostMagic;
  h.version = kHostVersion;
  h.header_size = sizeof h;
  h.file_size = sizeof h;
  h.broker_pid = info.brokerPid;
  h.device_count = static_cast<uint32_t>(info.devices.size());
  h.config_generation = info.configGeneration;
  h.unknown_policy = info.profileForUnknown ? kHostProfileForUnknown : kHostRefuseUnknown;
  if (info.profileForUnknown)
    std::memcpy(h.unknown_profile, info.unknownProfile.data(), info.unknownProfile.size());
  h.metering = info.metering;
  std::memcpy(h.cupti_library, info.cuptiLibrary.data(), info.cuptiLibrary.size());
  for (size_t i = 0; i < info.devices.size(); ++i) {
    std::memcpy(h.devices[i].uuid, info.devices[i].uuid, 16);
    h.devices[i].capacity = info.devices[i].capacity;
    h.devices[i].unknown_limit = info.devices[i].unknownLimit;
  }
  const std::string path = dir + "/" + kHostSegmentName;
  // An unpredictable temporary name (mkostemp: O_EXCL, never follows a link): the directory may
  // be writable by tenants, who must not be able to block or redirect the write.
  std::string why;
  if (!writeFileAtomically(path, path + ".XXXXXX", std::string(reinterpret_cast<const char*>(&h), sizeof h), 0644,
                           &why)) {
    *err = "the host segment: " + why;
    return false;
  }
  return true;
}

}  // namespace cushare
