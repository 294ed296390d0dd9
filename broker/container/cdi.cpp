// The broker's CDI spec; see cdi.h.
#include "cdi.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "cushare/atomic_file.h"
#include "cushare/parse.h"

namespace cushare::container {
namespace {

bool fail(std::string* err, std::string why) {
  if (err) *err = std::move(why);
  return false;
}

bool alnum(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'); }

std::string sysErr(const std::string& what) { return what + ": " + std::strerror(errno); }

}  // namespace

std::string cdiDeviceName(const std::string& tenant) { return std::string(kCdiKind) + "=" + tenant; }

bool validCdiDeviceName(std::string_view name, std::string* reason) {
  if (name.empty()) return fail(reason, "an empty name");
  if (!alnum(name.front()) || !alnum(name.back()))
    return fail(reason, "a CDI device name must start and end with a letter or a digit");
  for (const char c : name)
    if (!alnum(c) && c != '_' && c != '-' && c != '.' && c != ':')
      return fail(reason, std::string("character '") + c + "' is not allowed in a CDI device name");
  return true;
}

bool gpuCdiDevice(std::string_view tmpl, const std::string& uuid, std::string_view index, std::string* out,
                  std::string* err) {
  std::string name;
  for (size_t i = 0; i < tmpl.size();) {
    if (tmpl[i] != '{') {
      name += tmpl[i++];
      continue;
    }
    const size_t close = tmpl.find('}', i);
    const std::string_view word = tmpl.substr(i, close == std::string_view::npos ? std::string_view::npos : close - i + 1);
    if (word == "{uuid}") name += uuid;
    else if (word == "{index}") name += index;
    else return fail(err, "'" + std::string(word.substr(0, 40)) + "' is not {uuid} or {index}");
    i += word.size();
  }
  const size_t slash = name.find('/'), eq = name.find('=');
  if (slash == std::string::npos || eq == std::string::npos || slash > eq)
    return fail(err, "'" + name.substr(0, 200) + "' is not a qualified CDI device name (vendor/class=name)");
  const std::string_view vendor = std::string_view(name).substr(0, slash),
                         cls = std::string_view(name).substr(slash + 1, eq - slash - 1),
                         dev = std::string_view(name).substr(eq + 1);
  auto part = [&](std::string_view p, const char* what, std::string_view extra) {
    if (p.empty() || !alnum(p.front()) || !alnum(p.back()))
      return fail(err, std::string("the CDI ") + what + " in '" + name.substr(0, 200) +
                           "' must start and end with a letter or a digit");
    for (const char c : p)
      if (!alnum(c) && extra.find(c) == std::string_view::npos)
        return fail(err, std::string("character '") + c + "' is not allowed in the CDI " + what + " of '" +
                             name.substr(0, 200) + "'");
    return true;
  };
  std::string why;
  if (!part(vendor, "vendor", "-_.") || !part(cls, "class", "-_")) return false;
  if (!validCdiDeviceName(dev, &why)) return fail(err, why + " ('" + name.substr(0, 200) + "')");
  *out = std::move(name);
  return true;
}

std::string cdiMigDeviceName(const std::string& tenant, const std::string& migName) { return tenant + ":" + migName; }

bool buildCdiSpec(const std::vector<CdiTenant>& tenants, const HostPlaces& host, CdiSpec* out,
                  std::string* err) {
  CdiSpec spec;
  spec.version = "0.3.0";
  std::string devices;
  const auto device = [&](const std::string& name, const EnvVars& env, const std::vector<Mount>& mounts,
                          const std::vector<std::string>& nodes) {
    std::string e, m, n;
    for (const auto& [k, v] : env) e += std::string(e.empty() ? "" : ",") + "\n          " + jsonQuoted(k + "=" + v);
    for (const Mount& x : mounts)
      m += std::string(m.empty() ? "" : ",") + "\n          {\"hostPath\": " + jsonQuoted(x.hostPath) +
           ", \"containerPath\": " + jsonQuoted(x.containerPath) + ", \"options\": [" +
           (x.readOnly ? "\"ro\"" : "\"rw\"") + ", \"nosuid\", \"nodev\", \"bind\"]}";
    for (const std::string& p : nodes) n += std::string(n.empty() ? "" : ",") + "\n          {\"path\": " + jsonQuoted(p) + "}";
    devices += std::string(devices.empty() ? "" : ",") + "\n    {\n      \"name\": " + jsonQuoted(name) +
               ",\n      \"containerEdits\": {\n        \"env\": [" + e + "\n        ],\n        \"mounts\": [" + m +
               "\n        ]" + (nodes.empty() ? "" : ",\n        \"deviceNodes\": [" + n + "\n        ]") + "\n      }\n    }";
  };
  for (const CdiTenant& t : tenants) {
    std::string why;
    if (!validCdiDeviceName(t.name, &why)) {
      spec.leftOut.push_back(t.name + ": " + why);
      continue;
    }
    TenantEdits e;
    if (!tenantEdits(t.name, host, View::kContainer, &e, err)) return false;
    // CDI 0.5.0 allowed device names that start with a digit.
    if (t.name.front() >= '0' && t.name.front() <= '9') spec.version = "0.5.0";
    device(t.name, e.env, e.mounts, {});
    spec.devices.push_back(t.name);
    for (const CdiMigDevice& m : t.mig) {
      const std::string name = cdiMigDeviceName(t.name, m.name);
      if (m.nodes.empty()) {
        spec.leftOut.push_back(name + ": " + m.nodesUnknown);
        continue;
      }
      if (!validCdiDeviceName(name, &why)) {
        spec.leftOut.push_back(name + ": " + why);
        continue;
      }
      // The MIG device by UUID (what CUDA_VISIBLE_DEVICES accepts however the runtime numbers
      // devices), before LD_PRELOAD, which stays last.
      EnvVars env = e.env;
      env.insert(env.empty() ? env.end() : env.end() - 1, {"CUDA_VISIBLE_DEVICES", m.uuid});
      device(name, env, e.mounts, m.nodes);
      spec.migDevices.push_back(name);
    }
  }
  if (!spec.devices.empty())
    spec.json = "{\n  \"cdiVersion\": " + jsonQuoted(spec.version) + ",\n  \"kind\": " + jsonQuoted(kCdiKind) +
                ",\n  \"devices\": [" + devices + "\n  ]\n}\n";
  *out = std::move(spec);
  return true;
}

bool writeCdiSpec(const std::string& dir, const std::string& text, std::string* err) {
  if (!makeDirectories(dir, 0755, "", err)) return false;
  // Hidden and without the .json ending: runtimes scanning the directory skip the temporary.
  return writeFileAtomically(dir + "/" + kCdiSpecFile, dir + "/." + kCdiSpecFile + ".XXXXXX", text, 0644, err);
}

bool removeCdiSpec(const std::string& dir, std::string* err) {
  const std::string path = dir + "/" + kCdiSpecFile;
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) return fail(err, sysErr("cannot remove " + path));
  return true;
}

}  // namespace cushare::container
