// MIG layouts in mig-parted's vocabulary (config.h, MigLayoutEntry; docs/mig.md "Declarative
// layout"): the entries of the broker's mig.layout and of mig-parted's own file (version: v1,
// mig-configs: NAME: [entries]). An entry is
//   devices: all | [0, 1, ...]    the GPUs it applies to (NVML indexes)
//   mig-enabled: true | false
//   mig-devices: {"1g.10gb": 2, "3g.40gb": 1}   GPU instance profiles and counts (each instance
//                                               gets one compute instance spanning it)
// mig-parted's device-filter (PCI device IDs) is refused with a clear reason rather than ignored:
// an entry meant for another board must not be applied to this one.
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "config.h"
#include "cushare/parse.h"
#include "yaml_tree.h"

namespace cushare::broker {
namespace {

using yaml::Node;

constexpr size_t kMaxMigFileBytes = 1 << 20;

std::string quote(std::string_view s) { return "'" + yaml::printable(s) + "'"; }

struct EntryParser {
  const std::string& file;
  std::string* error;

  bool fail(yaml::Mark mark, const std::string& path, const std::string& why) {
    if (error) *error = yaml::errorLine(file, mark, path, why);
    return false;
  }

  // A GPU instance profile name as NVML names it without "MIG ": <g>g.<mem>gb with an optional
  // +me / +me.all / -me / +gfx suffix. A compute-instance-qualified name (1c.3g.40gb) is refused:
  // this layout gives each GPU instance one compute instance spanning it.
  bool profileName(const Node& key, const std::string& path) {
    std::string p = key.text;
    const auto digitsThen = [](const std::string& s, char c) {  // "<digits><c>." at the start
      size_t i = 0;
      while (i < s.size() && s[i] >= '0' && s[i] <= '9') ++i;
      return i > 0 && i + 1 < s.size() && s[i] == c && s[i + 1] == '.' ? i + 2 : 0;
    };
    if (const size_t c = digitsThen(p, 'c'); c > 0 && digitsThen(p.substr(c), 'g') > 0)
      return fail(key.mark, path, "compute instance profile " + quote(p) +
                                      " is not supported: name GPU instance profiles (e.g. 3g.40gb); each gets one "
                                      "compute instance spanning it");
    const size_t g = digitsThen(p, 'g');
    const bool ok = g > 0 && p.find("gb", g) != std::string::npos;
    if (!ok)
      return fail(key.mark, path, "'" + printable(p, 40) + "' is not a MIG profile name such as 1g.10gb or 3g.40gb");
    return true;
  }

  bool entry(const Node& n, const std::string& path, MigLayoutEntry* out) {
    if (n.kind != Node::kMap)
      return fail(n.mark, path, "expected a map (devices, mig-enabled, mig-devices), found " + yaml::describe(n));
    MigLayoutEntry e;
    e.mark = SourceMark{n.mark.line, n.mark.column};
    e.path = path;
    bool haveDevices = false, haveEnabled = false;
    for (size_t i = 0; i < n.keys.size(); ++i) {
      const Node& key = n.keys[i];
      const Node& v = n.items[i];
      const std::string kpath = path + "." + key.text;
      if (key.text == "devices") {
        haveDevices = true;
        if (v.kind == Node::kScalar && v.text == "all") {
          e.allDevices = true;
          continue;
        }
        if (v.kind != Node::kList || v.items.empty())
          return fail(v.mark, kpath, "expected all or a list of GPU indexes, found " + yaml::describe(v));
        e.allDevices = false;
        for (const Node& d : v.items) {
          int64_t x = 0;
          std::string reason;
          if (d.kind != Node::kScalar || !parseInt(d.text, 0, 1023, &x, &reason))
            return fail(d.mark, kpath, "expected a GPU index (0..1023), found " + yaml::describe(d) +
                                           (d.kind == Node::kScalar ? " '" + printable(d.text, 20) + "'" : ""));
          for (int prev : e.devices)
            if (prev == x) return fail(d.mark, kpath, "GPU " + std::to_string(x) + " is listed twice");
          e.devices.push_back(static_cast<int>(x));
        }
      } else if (key.text == "mig-enabled") {
        haveEnabled = true;
        if (v.kind != Node::kScalar || (v.text != "true" && v.text != "false"))
          return fail(v.mark, kpath, "expected true or false, found " + yaml::describe(v));
        e.enabled = v.text == "true";
      } else if (key.text == "mig-devices") {
        if (yaml::isNull(v)) continue;
        if (v.kind != Node::kMap) return fail(v.mark, kpath, "expected a map of profile: count, found " + yaml::describe(v));
        for (size_t j = 0; j < v.keys.size(); ++j) {
          const std::string ppath = kpath + "." + v.keys[j].text;
          if (!profileName(v.keys[j], ppath)) return false;
          int64_t count = 0;
          std::string reason;
          if (v.items[j].kind != Node::kScalar || !parseInt(v.items[j].text, 0, 7, &count, &reason))
            return fail(v.items[j].mark, ppath, "expected a count of instances, 0..7, found " + yaml::describe(v.items[j]));
          if (count > 0) e.profiles.emplace_back(v.keys[j].text, static_cast<uint32_t>(count));
        }
      } else if (key.text == "device-filter") {
        return fail(key.mark, kpath,
                    "device-filter is not supported: list the GPUs of this host in devices (an entry meant for "
                    "another board must not be applied here)");
      } else {
        return fail(key.mark, kpath,
                    "unknown key " + quote(key.text) + " (known keys: devices, mig-enabled, mig-devices)");
      }
    }
    if (!haveDevices) return fail(n.mark, path, "devices is missing (all, or a list of GPU indexes)");
    if (!haveEnabled) return fail(n.mark, path, "mig-enabled is missing (true or false)");
    if (!e.enabled && !e.profiles.empty())
      return fail(n.mark, path, "mig-devices with mig-enabled: false: MIG devices need MIG mode");
    *out = std::move(e);
    return true;
  }

  bool entries(const Node& n, const std::string& path, std::vector<MigLayoutEntry>* out) {
    if (n.kind != Node::kList || n.items.empty())
      return fail(n.mark, path, "expected a list of entries (devices, mig-enabled, mig-devices), found " +
                                    yaml::describe(n));
    std::vector<MigLayoutEntry> r;
    for (size_t i = 0; i < n.items.size(); ++i) {
      MigLayoutEntry e;
      if (!entry(n.items[i], path + "[" + std::to_string(i) + "]", &e)) return false;
      // A GPU named by two entries (or all twice) would get whichever came last: refused.
      for (const MigLayoutEntry& prev : r) {
        bool overlap = prev.allDevices || e.allDevices;
        for (int d : e.devices)
          for (int p : prev.devices) overlap = overlap || d == p;
        if (overlap)
          return fail(n.items[i].mark, path + "[" + std::to_string(i) + "]",
                      "its devices overlap those of " + prev.path + ": each GPU in one entry");
      }
      r.push_back(std::move(e));
    }
    *out = std::move(r);
    return true;
  }
};

}  // namespace

bool parseMigLayoutEntries(const yaml::Node& list, const std::string& file, const std::string& path,
                           std::vector<MigLayoutEntry>* out, std::string* error) {
  EntryParser p{file, error};
  return p.entries(list, path, out);
}

bool loadMigPartedConfig(const std::string& path, const std::string& name, std::vector<MigLayoutEntry>* out,
                         std::string* error) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) {
    if (error) *error = yaml::errorLine(path, yaml::Mark{}, "", std::string("cannot open: ") + std::strerror(errno));
    return false;
  }
  std::string text;
  char buf[65536];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0 && text.size() <= kMaxMigFileBytes) text.append(buf, n);
  std::fclose(f);
  if (text.size() > kMaxMigFileBytes) {
    if (error) *error = yaml::errorLine(path, yaml::Mark{}, "", "larger than 1 MiB");
    return false;
  }
  Node root;
  if (!yaml::parseDocument(text, path, &root, error)) return false;
  EntryParser p{path, error};
  if (root.kind != Node::kMap) return p.fail(root.mark, "", "expected mig-parted's map (version, mig-configs)");
  const Node* configs = nullptr;
  for (size_t i = 0; i < root.keys.size(); ++i) {
    if (root.keys[i].text == "version") {
      if (root.items[i].text != "v1")
        return p.fail(root.items[i].mark, "version", "expected v1, found '" + printable(root.items[i].text, 20) + "'");
    } else if (root.keys[i].text == "mig-configs") {
      configs = &root.items[i];
    }
  }
  if (configs == nullptr || configs->kind != Node::kMap) return p.fail(root.mark, "mig-configs", "missing, or not a map of named configs");
  std::string names;
  for (size_t i = 0; i < configs->keys.size(); ++i) {
    if (configs->keys[i].text == name)
      return p.entries(configs->items[i], "mig-configs." + name, out);
    names += (names.empty() ? "" : ", ") + configs->keys[i].text;
  }
  return p.fail(configs->mark, "mig-configs", "no config '" + printable(name, 64) + "' (it has " +
                                                  (names.empty() ? std::string("none") : printable(names, 300)) + ")");
}

bool migLayoutOf(const MigConfig& m, std::vector<MigLayoutEntry>* out, std::string* error) {
  if (!m.configFile.empty()) return loadMigPartedConfig(m.configFile, m.configName, out, error);
  *out = m.layout;
  return true;
}

}  // namespace cushare::broker
