// The broker's configuration file (broker/config): the example parsed to exact values,
// defaults, profiles applied to tenants, every refusal with its exact file:line:column and field
// path, percentages resolved against devices, the device-capacity check (exactly full accepted,
// one byte over refused), loadConfig on real files, and truncated / byte-flipped input that must
// yield either a config or one well-formed error line.
#include <gtest/gtest.h>

#include <cstdio>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "config/config.h"
#include "config/layout_change.h"
#include "cushare/shim_config.h"

namespace cushare::broker {
namespace {

constexpr uint64_t kMiB = 1ull << 20, kGiB = 1ull << 30;
constexpr const char* kUuidA = "GPU-5e1a90c0-0000-4000-8000-000000000000";
constexpr const char* kUuidB = "GPU-5e1a90c0-0001-4000-8000-0000000000ab";

constexpr const char* kExample =
    "ledger_dir: /dev/shm/cushare        # tenant ledgers; what containers mount\n"
    "socket: /run/cushare/broker.sock    # control socket\n"
    "metrics_listen: 127.0.0.1:9464      # Prometheus text endpoint at /metrics\n"
    "unknown_tenants: refuse             # or the name of a profile applied to them\n"
    "admin_group: cushare                # optional\n"
    "profiles:\n"
    "  balanced: {memory: 25%, thread_percentage: 25, priority: normal}\n"
    "tenants:\n"
    "  - {name: alpha, memory: 512MiB, thread_percentage: 30, priority: high, uid: 1000}\n"
    "  - {name: beta, profile: balanced}\n";

Config parseOk(const std::string& text) {
  Config c;
  std::string error;
  EXPECT_TRUE(parseConfig(text, "b.yaml", &c, &error)) << text << "\n=> " << error;
  return c;
}

// The error line for text, checked to be a single line; "" if it parsed.
std::string parseError(const std::string& text) {
  Config c;
  std::string error;
  if (parseConfig(text, "b.yaml", &c, &error)) return "";
  EXPECT_EQ(error.find('\n'), std::string::npos) << error;
  return error;
}

DeviceInfo gpu(int ordinal, const std::string& uuid, uint64_t bytes) {
  DeviceInfo d;
  d.ordinal = ordinal;
  d.uuid = uuid;
  d.totalBytes = bytes;
  return d;
}

std::vector<DeviceInfo> twoDevices() { return {gpu(0, kUuidA, 16 * kGiB), gpu(1, kUuidB, 8 * kGiB)}; }

std::string capacityError(const std::string& text, const std::vector<DeviceInfo>& devices) {
  const Config c = parseOk(text);
  std::string error;
  if (checkAgainstDevices(c, devices, &error)) return "";
  EXPECT_EQ(error.find('\n'), std::string::npos) << error;
  return error;
}

TEST(BrokerConfig, ExampleParsesToExpectedValues) {
  const Config c = parseOk(kExample);
  EXPECT_EQ(c.file, "b.yaml");
  EXPECT_EQ(c.ledgerDir, "/dev/shm/cushare");
  EXPECT_EQ(c.socket, "/run/cushare/broker.sock");
  EXPECT_EQ(c.metricsHost, "127.0.0.1");
  EXPECT_EQ(c.metricsPort, 9464);
  EXPECT_EQ(c.unknownTenantsProfile, "");
  EXPECT_EQ(c.adminGroup, "cushare");

  ASSERT_EQ(c.profiles.size(), 1u);
  const Profile& p = c.profiles[0];
  EXPECT_EQ(p.name, "balanced");
  EXPECT_EQ(p.mark.line, 7);
  EXPECT_EQ(p.mark.column, 3);
  EXPECT_EQ(p.memory.kind, MemorySpec::kAll);
  EXPECT_EQ(p.memory.all.milliPercent, 25000u);
  EXPECT_EQ(p.threadPercentage, 25);
  EXPECT_EQ(p.priority, Priority::kNormal);

  ASSERT_EQ(c.tenants.size(), 2u);
  const Tenant& a = c.tenants[0];
  EXPECT_EQ(a.name, "alpha");
  EXPECT_EQ(a.path, "tenants[0]");
  EXPECT_EQ(a.mark.line, 9);
  EXPECT_EQ(a.mark.column, 5);
  EXPECT_EQ(a.profile, "");
  EXPECT_EQ(a.memory.kind, MemorySpec::kAll);
  EXPECT_FALSE(a.memory.all.isPercent());
  EXPECT_EQ(a.memory.all.bytes, 512 * kMiB);
  EXPECT_EQ(a.memory.path, "tenants[0].memory");
  EXPECT_EQ(a.memory.mark.line, 9);
  EXPECT_EQ(a.memory.mark.column, 27);
  EXPECT_EQ(a.threadPercentage, 30);
  EXPECT_EQ(a.priority, Priority::kHigh);
  EXPECT_EQ(a.uid, 1000u);
  EXPECT_FALSE(a.gid.has_value());

  const Tenant& b = c.tenants[1];
  EXPECT_EQ(b.name, "beta");
  EXPECT_EQ(b.profile, "balanced");
  EXPECT_EQ(b.memory.kind, MemorySpec::kAll);
  EXPECT_EQ(b.memory.all.milliPercent, 25000u);
  EXPECT_EQ(b.memory.path, "profiles.balanced.memory");
  EXPECT_EQ(b.threadPercentage, 25);
  EXPECT_EQ(b.priority, Priority::kNormal);
  EXPECT_FALSE(b.uid.has_value());
}

TEST(BrokerConfig, UntrackedMemorySettings) {
  const Config c = parseOk("hidden_memory_allowance: 64MiB\ncontext_memory: 1GiB\n");
  EXPECT_EQ(c.hiddenMemoryAllowance, 64 * kMiB);
  EXPECT_EQ(c.contextMemory, kGiB);
  const Config z = parseOk("context_memory: 0\n");
  EXPECT_EQ(z.contextMemory, 0u);
  EXPECT_EQ(z.hiddenMemoryAllowance, 0u);
  EXPECT_EQ(z.tamperResponse, Config::TamperResponse::kKill) << "the default takes the tampering process down";
  EXPECT_EQ(parseOk("tamper_response: charge\n").tamperResponse, Config::TamperResponse::kCharge);
  EXPECT_EQ(parseOk("tamper_response: kill\n").tamperResponse, Config::TamperResponse::kKill);
  EXPECT_EQ(parseError("tamper_response: shoot\n"),
            "b.yaml:1:18: tamper_response: expected kill or charge, found 'shoot'");
  EXPECT_EQ(parseError("tamper_response: kill_past_limit\n"),
            "b.yaml:1:18: tamper_response: expected kill or charge, found 'kill_past_limit'")
      << "only hidden memory can be past the limit";
  EXPECT_EQ(z.hiddenMemoryResponse, Config::TamperResponse::kKillPastLimit)
      << "the default takes back what passes the limit";
  EXPECT_EQ(parseOk("hidden_memory_response: charge\n").hiddenMemoryResponse, Config::TamperResponse::kCharge);
  EXPECT_EQ(parseOk("hidden_memory_response: kill\n").hiddenMemoryResponse, Config::TamperResponse::kKill);
  EXPECT_EQ(parseOk("hidden_memory_response: kill_past_limit\n").hiddenMemoryResponse,
            Config::TamperResponse::kKillPastLimit);
  EXPECT_EQ(parseError("hidden_memory_response: kill-past-limit\n"),
            "b.yaml:1:25: hidden_memory_response: expected kill_past_limit, kill or charge, found "
            "'kill-past-limit'; did you mean 'kill_past_limit'?");
  EXPECT_TRUE(parseOk("mps: {mode: on, multiuser: off}\n").mps.multiuser == false);
  EXPECT_TRUE(parseOk("mps: {mode: on}\n").mps.multiuser) << "one server for every uid by default";
  EXPECT_EQ(parseError("mps: {multiuser: yes}\n"), "b.yaml:1:18: mps.multiuser: expected on or off, found 'yes'");
}

TEST(BrokerConfig, DefaultsAndOptionalForms) {
  const Config d = parseOk("{}\n");
  EXPECT_EQ(d.ledgerDir, "/dev/shm/cushare");
  EXPECT_EQ(d.socket, "/run/cushare/broker.sock");
  EXPECT_EQ(d.metricsHost, "127.0.0.1");
  EXPECT_EQ(d.metricsPort, 9464);
  EXPECT_EQ(d.unknownTenantsProfile, "");
  EXPECT_EQ(d.adminGroup, "");
  EXPECT_EQ(d.hiddenMemoryAllowance, 0u);
  EXPECT_EQ(d.contextMemory, 512 * kMiB);
  EXPECT_TRUE(d.profiles.empty());
  EXPECT_TRUE(d.tenants.empty());

  const Config c = parseOk(
      "ledger_dir: /srv/ledgers/\n"
      "metrics_listen: '[::1]:1'\n"
      "hidden_memory_allowance: 64MiB\n"
      "unknown_tenants: guest\n"
      "profiles:\n"
      "  guest:\n"
      "    memory: 12.5%\n"
      "tenants:\n"
      "  - name: x\n"
      "    gid: 42\n"
      "    memory: {0: 8GiB, GPU-5E1A90C0-0001-4000-8000-0000000000AB: 0.5%}\n");
  EXPECT_EQ(c.ledgerDir, "/srv/ledgers");  // trailing '/' removed, as for CUSHARE_LEDGER_DIR
  EXPECT_EQ(c.metricsHost, "::1");
  EXPECT_EQ(c.metricsPort, 1);
  EXPECT_EQ(c.unknownTenantsProfile, "guest");
  EXPECT_EQ(c.hiddenMemoryAllowance, 64 * kMiB);
  ASSERT_EQ(c.tenants.size(), 1u);
  const Tenant& t = c.tenants[0];
  EXPECT_EQ(t.gid, 42u);
  EXPECT_EQ(t.priority, Priority::kNormal);
  EXPECT_FALSE(t.threadPercentage.has_value());
  ASSERT_EQ(t.memory.kind, MemorySpec::kPerDevice);
  ASSERT_EQ(t.memory.entries.size(), 2u);
  EXPECT_EQ(t.memory.entries[0].ordinal, 0);
  EXPECT_EQ(t.memory.entries[0].amount.bytes, 8 * kGiB);
  EXPECT_EQ(t.memory.entries[1].ordinal, -1);
  EXPECT_EQ(t.memory.entries[1].uuid, kUuidB);  // normalised to lower case
  EXPECT_EQ(t.memory.entries[1].amount.milliPercent, 500u);
  EXPECT_EQ(t.memory.entries[1].mark.line, 11);
  EXPECT_EQ(t.memory.entries[1].mark.column, 23);
}

TEST(BrokerConfig, TenantFieldsOverrideProfileFields) {
  const Config c = parseOk(
      "profiles:\n"
      "  gold: {memory: 50%, thread_percentage: 50, priority: high}\n"
      "tenants:\n"
      "  - {name: a, profile: gold, memory: 1GiB, priority: low}\n"
      "  - {name: b, profile: gold}\n"
      "  - {name: c}\n"
      "  - {name: d, profile: gold, memory: {1: 2GiB}, thread_percentage: 10}\n");
  ASSERT_EQ(c.tenants.size(), 4u);
  const Tenant& a = c.tenants[0];
  EXPECT_EQ(a.memory.kind, MemorySpec::kAll);
  EXPECT_EQ(a.memory.all.bytes, kGiB);
  EXPECT_EQ(a.memory.all.milliPercent, 0u);
  EXPECT_EQ(a.threadPercentage, 50);      // from the profile
  EXPECT_EQ(a.priority, Priority::kLow);  // the tenant's own
  const Tenant& b = c.tenants[1];
  EXPECT_EQ(b.memory.all.milliPercent, 50000u);
  EXPECT_EQ(b.threadPercentage, 50);
  EXPECT_EQ(b.priority, Priority::kHigh);
  const Tenant& t = c.tenants[2];
  EXPECT_EQ(t.memory.kind, MemorySpec::kNone);
  EXPECT_FALSE(t.threadPercentage.has_value());
  EXPECT_EQ(t.priority, Priority::kNormal);
  const Tenant& d = c.tenants[3];  // a per-device map replaces the profile's memory as a whole
  EXPECT_EQ(d.memory.kind, MemorySpec::kPerDevice);
  ASSERT_EQ(d.memory.entries.size(), 1u);
  EXPECT_EQ(d.memory.entries[0].ordinal, 1);
  EXPECT_EQ(d.threadPercentage, 10);
  EXPECT_EQ(d.priority, Priority::kHigh);
}

struct Refusal {
  const char* text;
  const char* prefix;    // "b.yaml:<line>:<column>: <path>: "
  const char* contains;  // a piece of the reason
};

TEST(BrokerConfig, RefusesWithFileLineColumnAndFieldPath) {
  const Refusal cases[] = {
      // unknown keys, at every level, with a suggestion
      {"ledger_dri: /x\n",
       "b.yaml:1:1: ledger_dri: ", "unknown key 'ledger_dri'; did you mean 'ledger_dir'?"},
      {"tenants:\n  - {name: a, memroy: 1GiB}\n",
       "b.yaml:2:15: tenants[0].memroy: ", "did you mean 'memory'?"},
      {"profiles:\n  p: {priorty: high}\n",
       "b.yaml:2:7: profiles.p.priorty: ", "did you mean 'priority'?"},
      {"profiles:\n  p: {uid: 1}\n",
       "b.yaml:2:7: profiles.p.uid: ", "unknown key 'uid' (known keys: memory,"},
      {"zzz: 1\n", "b.yaml:1:1: zzz: ", "unknown key 'zzz' (known keys"},
      // wrong types
      {"tenants: {a: 1}\n", "b.yaml:1:10: tenants: ", "expected a list of tenants, found a map"},
      {"profiles: [a]\n", "b.yaml:1:11: profiles: ", "found a list"},
      {"profiles:\n  p: [a]\n", "b.yaml:2:6: profiles.p: ", "found a list"},
      {"tenants:\n  - alpha\n", "b.yaml:2:5: tenants[0]: ", "found 'alpha'"},
      {"ledger_dir: [a]\n", "b.yaml:1:13: ledger_dir: ", "expected an absolute path, found a list"},
      {"tenants:\n  - {name: a, memory: [1GiB]}\n",
       "b.yaml:2:23: tenants[0].memory: ", "found a list"},
      {"- a\n",
       "b.yaml:1:1: ", "the top level must be a map of settings (key: value), found a list"},
      {"hello\n", "b.yaml:1:1: ", "the top level must be a map"},
      {"socket:\n", "b.yaml:1:8: socket: ", "expected an absolute path, found an empty value"},
      {"hidden_memory_allowance: lots\n", "b.yaml:1:26: hidden_memory_allowance: ", ""},
      {"context_memory: -1\n", "b.yaml:1:17: context_memory: ", ""},
      {"socket: ''\n", "b.yaml:1:9: socket: ", "found an empty value"},
      // duplicates
      {"socket: /a\nsocket: /b\n",
       "b.yaml:2:1: socket: ", "duplicate key 'socket' (first at line 1 column 1)"},
      {"tenants:\n  - {name: a, name: b}\n",
       "b.yaml:2:15: tenants[0].name: ", "duplicate key 'name'"},
      {"profiles:\n  p: {}\n  p: {}\n", "b.yaml:3:3: profiles.p: ", "duplicate key 'p'"},
      {"tenants:\n  - {name: a}\n  - {name: a}\n",
       "b.yaml:3:12: tenants[1].name: ", "duplicate tenant 'a' (first at line 2, tenants[0])"},
      {"tenants:\n  - {name: a, memory: {0: 1GiB, 00: 2GiB}}\n",
       "b.yaml:2:33: tenants[0].memory.00: ",
       "duplicate device '00': '0' at line 2 already names it"},
      {"tenants:\n  - {name: a, memory: {GPU-5e1a90c0-0000-4000-8000-000000000000: 1GiB, "
       "GPU-5E1A90C0-0000-4000-8000-000000000000: 1GiB}}\n",
       "b.yaml:2:72: tenants[0].memory.GPU-5E1A90C0-0000-4000-8000-000000000000: ",
       "duplicate device"},
      // names and references
      {"tenants:\n  - {memory: 1GiB}\n", "b.yaml:2:5: tenants[0]: ", "missing key 'name'"},
      {"tenants:\n  - {name: a/b}\n",
       "b.yaml:2:12: tenants[0].name: ", "character '/' at position 2 is not allowed"},
      {"profiles:\n  balanced: {priority: low}\ntenants:\n  - {name: a, profile: balance}\n",
       "b.yaml:4:24: tenants[0].profile: ",
       "no profile 'balance'; did you mean 'balanced'? (profiles: balanced)"},
      {"unknown_tenants: gold\n",
       "b.yaml:1:18: unknown_tenants: ", "no profile 'gold' (no profiles are defined)"},
      {"profiles:\n  refuse: {}\n",
       "b.yaml:2:3: profiles.refuse: ", "'refuse' cannot name a profile"},
      // values
      {"tenants:\n  - {name: a, memory: lots}\n",
       "b.yaml:2:23: tenants[0].memory: ", "invalid size 'lots'"},
      {"tenants:\n  - {name: a, memory: 0}\n",
       "b.yaml:2:23: tenants[0].memory: ", "would deny every allocation"},
      {"tenants:\n  - {name: a, memory: 18446744073709551615}\n",
       "b.yaml:2:23: tenants[0].memory: ", "is the value that means no limit"},
      {"tenants:\n  - {name: a, memory: {0: 18446744073709551615B}}\n",
       "b.yaml:2:27: tenants[0].memory.0: ", "is the value that means no limit"},
      {"tenants:\n  - {name: a, memory: '0=1GiB'}\n",
       "b.yaml:2:23: tenants[0].memory: ", "per-device limits are written as a map"},
      {"tenants:\n  - {name: a, memory: {}}\n",
       "b.yaml:2:23: tenants[0].memory: ", "an empty map names no device"},
      {"tenants:\n  - {name: a, memory: 150%}\n",
       "b.yaml:2:23: tenants[0].memory: ",
       "invalid percentage '150%': a percentage must be more than 0% and at most 100%"},
      {"tenants:\n  - {name: a, memory: 100.001%}\n",
       "b.yaml:2:23: tenants[0].memory: ", "at most 100%"},
      {"tenants:\n  - {name: a, memory: 12.3456%}\n",
       "b.yaml:2:23: tenants[0].memory: ", "invalid percentage '12.3456%': at most 3 digits after '.'"},
      {"tenants:\n  - {name: a, memory: -5%}\n",
       "b.yaml:2:23: tenants[0].memory: ", "invalid percentage"},
      {"tenants:\n  - {name: a, memory: 0%}\n",
       "b.yaml:2:23: tenants[0].memory: ", "invalid percentage '0%': a percentage must be more than 0%"},
      {"profiles:\n  p: {memory: {x: 1GiB}}\n", "b.yaml:2:16: profiles.p.memory.x: ",
       "device 'x' is neither a non-negative integer ordinal, <gpu>:<mig> (a MIG device), GPU-<uuid> nor MIG-<uuid>"},
      {"tenants:\n  - {name: a, memory: {GPU-xyz: 1GiB}}\n",
       "b.yaml:2:24: tenants[0].memory.GPU-xyz: ", "malformed UUID 'GPU-xyz'"},
      {"tenants:\n  - {name: a, memory: {MIG-1: 1GiB}}\n",
       "b.yaml:2:24: tenants[0].memory.MIG-1: ", "malformed UUID 'MIG-1': expected MIG-xxxxxxxx"},
      {"tenants:\n  - {name: a, memory: {MIG-GPU-5e1a90c0-513d-4b1e-8a7f-2c6100000000/1/0: 1GiB}}\n",
       "b.yaml:2:24: tenants[0].memory.MIG-GPU-5e1a90c0-513d-4b1e-8a7f-2c6100000000/1/0: ",
       "(not the legacy MIG-GPU-<uuid>/<gi>/<ci> form)"},
      {"tenants:\n  - {name: a, memory: {'0:x': 1GiB}}\n", "b.yaml:2:24: tenants[0].memory.0:x: ",
       "device '0:x' is neither a non-negative integer ordinal, <gpu>:<mig>"},
      {"tenants:\n  - {name: a, memory: {'0:1': 1GiB, '0:01': 2GiB}}\n", "b.yaml:2:37: tenants[0].memory.0:01: ",
       "duplicate device '0:01'"},
      {"tenants:\n  - {name: a, memory: {0: lots}}\n",
       "b.yaml:2:27: tenants[0].memory.0: ", "invalid size 'lots'"},
      {"tenants:\n  - {name: a, priority: urgent}\n",
       "b.yaml:2:25: tenants[0].priority: ", "'urgent' is not one of high, normal, low"},
      {"tenants:\n  - {name: a, thread_percentage: 25%}\n",
       "b.yaml:2:34: tenants[0].thread_percentage: ", "without '%'"},
      {"tenants:\n  - {name: a, thread_percentage: 0}\n",
       "b.yaml:2:34: tenants[0].thread_percentage: ", "0 is out of range 1..100"},
      {"profiles:\n  p: {thread_percentage: 101}\n",
       "b.yaml:2:26: profiles.p.thread_percentage: ", "101 is out of range 1..100"},
      {"tenants:\n  - {name: a, uid: -1}\n",
       "b.yaml:2:20: tenants[0].uid: ", "out of range 0..4294967294"},
      {"tenants:\n  - {name: a, gid: abc}\n", "b.yaml:2:20: tenants[0].gid: ", "not a number"},
      {"socket: run/b.sock\n", "b.yaml:1:9: socket: ", "not an absolute path"},
      {"socket: \"/a\\0b\"\n", "b.yaml:1:9: socket: ", "control character"},
      {"ledger_dir: shm\n", "b.yaml:1:13: ledger_dir: ", "not an absolute path"},
      {"metrics_listen: localhost\n", "b.yaml:1:17: metrics_listen: ", "expected host:port"},
      {"metrics_listen: h:-1\n",
       "b.yaml:1:17: metrics_listen: ", "port '-1' is not a number 0..65535"},
      {"metrics_listen: h:65536\n",
       "b.yaml:1:17: metrics_listen: ", "port '65536' is not a number 0..65535"},
      {"state_file: run/x\n", "b.yaml:1:13: state_file: ", "not an absolute path"},
      {"metrics_listen: ':80'\n", "b.yaml:1:17: metrics_listen: ", "empty host"},
      {"metrics_listen: ::1:80\n",
       "b.yaml:1:17: metrics_listen: ", "an IPv6 address needs brackets"},
      {"admin_group: -x\n", "b.yaml:1:14: admin_group: ", "cannot start with '-'"},
      // YAML itself and the subset
      {"tenants: [a, b\n", "b.yaml:2:1: ",
       "YAML syntax error: did not find expected ',' or ']' (while parsing a flow sequence at line "
       "1 column 10)"},
      {"a: b: c\n",
       "b.yaml:1:5: ", "YAML syntax error: mapping values are not allowed in this context"},
      {"\xff\n", "b.yaml:1:1: ", "invalid input: invalid leading UTF-8 octet (0xff)"},
      {"profiles:\n  p: &x {priority: low}\n",
       "b.yaml:2:6: profiles.p: ", "anchors (&x) are not allowed"},
      {"socket: *x\n", "b.yaml:1:9: socket: ", "aliases (*x) are not allowed"},
      {"socket: !!str /a\n",
       "b.yaml:1:9: socket: ", "tags (tag:yaml.org,2002:str) are not allowed"},
      {"? [a]\n: b\n", "b.yaml:1:3: ", "a map key must be a scalar, not a list"},
      {"socket: /a\n---\nsocket: /b\n", "b.yaml:2:1: ", "a second YAML document"},
      {"a: "
       "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]\n",
       "b.yaml:1:35: a", "nested deeper than 32 levels"},
      {"", "b.yaml:1:1: ", "the file is empty"},
      {"# only a comment\n", "b.yaml:1:1: ", "the file is empty"},
      {"---\n", "b.yaml:2:1: ", "the file is empty"},
  };
  for (const Refusal& r : cases) {
    const std::string e = parseError(r.text);
    EXPECT_EQ(e.rfind(r.prefix, 0), 0u) << "input:\n" << r.text << "\nerror: " << e;
    EXPECT_NE(e.find(r.contains), std::string::npos) << "input:\n" << r.text << "\nerror: " << e;
  }
}

TEST(BrokerConfig, ErrorLeavesOutputUntouchedAndIsOneLine) {
  Config c;
  c.socket = "/sentinel";
  c.tenants.push_back(Tenant{});
  std::string error;
  EXPECT_FALSE(parseConfig("socket: /a\ntenants: [{name: \"x\\ny\"}]\n", "b.yaml", &c, &error));
  EXPECT_EQ(c.socket, "/sentinel");
  EXPECT_EQ(c.tenants.size(), 1u);
  EXPECT_EQ(error,
            "b.yaml:2:18: tenants[0].name: invalid name: character '\\n' at position 2 "
            "is not allowed (use A-Z a-z 0-9 . _ -)");
  EXPECT_FALSE(parseConfig(std::string(kMaxConfigBytes + 1, '#'), "big.yaml", &c, &error));
  EXPECT_EQ(error.rfind("big.yaml:1:1: the file is 1048577 bytes", 0), 0u) << error;
}

TEST(BrokerConfig, LoadConfigReadsFilesAndNamesThemInErrors) {
  const std::string dir = testing::TempDir();
  const std::string good = dir + "/broker_config_test_good.yaml";
  const std::string bad = dir + "/broker_config_test_bad.yaml";
  for (const auto& [path, text] : {std::pair{good, std::string(kExample)},
                                   std::pair{bad, std::string("socket: /a\nsockte: /b\n")}}) {
    std::FILE* f = std::fopen(path.c_str(), "wb");
    ASSERT_NE(f, nullptr);
    ASSERT_EQ(std::fwrite(text.data(), 1, text.size(), f), text.size());
    std::fclose(f);
  }
  Config c;
  std::string error;
  ASSERT_TRUE(loadConfig(good, &c, &error)) << error;
  EXPECT_EQ(c.file, good);
  EXPECT_EQ(c.tenants.size(), 2u);
  EXPECT_FALSE(loadConfig(bad, &c, &error));
  EXPECT_EQ(error.rfind(bad + ":2:1: sockte: unknown key 'sockte'; did you mean 'socket'?", 0), 0u)
      << error;
  EXPECT_FALSE(loadConfig(dir + "/no_such_broker_config.yaml", &c, &error));
  EXPECT_EQ(error, dir + "/no_such_broker_config.yaml:1:1: cannot open: No such file or directory");
  EXPECT_EQ(c.file, good);  // untouched by the failures
  std::remove(good.c_str());
  std::remove(bad.c_str());
}

TEST(BrokerConfig, PercentagesResolveAgainstEachDevice) {
  const Config c = parseOk(
      "tenants:\n"
      "  - {name: a, memory: 12.5%}\n"
      "  - {name: b, memory: 33.333%}\n"
      "  - {name: c, memory: 0.001%}\n"
      "  - {name: d, memory: {1: 100%}}\n"
      "  - {name: e}\n");
  const std::vector<DeviceInfo> devices = {gpu(0, kUuidA, 8 * kGiB), gpu(1, kUuidB, 1000)};
  std::vector<uint64_t> l;
  std::string error;
  ASSERT_TRUE(resolveMemory(c, c.tenants[0].memory, devices, &l, &error)) << error;
  EXPECT_EQ(l, (std::vector<uint64_t>{kGiB, 125}));
  ASSERT_TRUE(resolveMemory(c, c.tenants[1].memory, devices, &l, &error)) << error;
  EXPECT_EQ(l, (std::vector<uint64_t>{8 * kGiB * 33333 / 100000, 333}));  // rounded down
  ASSERT_TRUE(resolveMemory(c, c.tenants[2].memory, devices, &l, &error)) << error;
  EXPECT_EQ(l, (std::vector<uint64_t>{8 * kGiB / 100000, 0}));
  ASSERT_TRUE(resolveMemory(c, c.tenants[3].memory, devices, &l, &error)) << error;
  EXPECT_EQ(l, (std::vector<uint64_t>{kUnlimited, 1000}));
  ASSERT_TRUE(resolveMemory(c, c.tenants[4].memory, devices, &l, &error)) << error;
  EXPECT_EQ(l, (std::vector<uint64_t>{kUnlimited, kUnlimited}));
  EXPECT_EQ(formatPercent(12500), "12.5%");
  EXPECT_EQ(formatPercent(1), "0.001%");
  EXPECT_EQ(formatPercent(100000), "100%");
}

TEST(BrokerConfig, CapacityAcceptsExactlyFullAndRefusesOneByteOver) {
  const std::string full =
      "tenants:\n"
      "  - {name: a, memory: 50%}\n"
      "  - {name: b, memory: {0: 8GiB, GPU-5e1a90c0-0001-4000-8000-0000000000ab: 4GiB}}\n"
      "  - {name: c}\n";
  EXPECT_EQ(capacityError(full, twoDevices()), "");
  const std::string over =
      "tenants:\n"
      "  - {name: a, memory: 50%}\n"
      "  - {name: b, memory: {0: 8589934593, GPU-5e1a90c0-0001-4000-8000-0000000000ab: 4GiB}}\n";
  EXPECT_EQ(capacityError(over, twoDevices()),
            "b.yaml:3:24: tenants[1].memory.0: tenant 'b' brings the memory limits on device 0 "
            "(GPU-5e1a90c0-0000-4000-8000-000000000000) to 17179869185 bytes (16.00 GiB), over "
            "the device's total of 17179869184 bytes (16 GiB); this tenant's limit there is "
            "8589934593 bytes (8.00 GiB)");
  // One size for every device: fits device 0 (9 of 16 GiB), overflows device 1 (9 of 8 GiB).
  const std::string e = capacityError(
      "tenants:\n  - {name: a, memory: 5GiB}\n  - {name: b, memory: 4GiB}\n", twoDevices());
  EXPECT_EQ(e.rfind("b.yaml:3:23: tenants[1].memory: tenant 'b' brings the memory limits on "
                    "device 1 (GPU-5e1a90c0-0001-4000-8000-0000000000ab) to 9663676416 bytes",
                    0),
            0u)
      << e;
}

TEST(BrokerConfig, CapacityNamesTheTenantWhoseProfileOverflows) {
  const std::string e = capacityError(
      "profiles:\n"
      "  big: {memory: 60%}\n"
      "tenants:\n"
      "  - {name: a, profile: big}\n"
      "  - {name: b, profile: big}\n",
      twoDevices());
  EXPECT_EQ(e.rfind("b.yaml:5:5: tenants[1]: tenant 'b' (memory from profiles.big.memory) brings "
                    "the memory limits on device 0",
                    0),
            0u)
      << e;
}

TEST(BrokerConfig, CapacityCountsTheUnknownTenantsPool) {
  const Config d = parseOk("{}\n");
  EXPECT_EQ(d.maxUnknownTenants, 8u);
  EXPECT_EQ(d.maxUnknownTenantsPerUid, 4u);
  const Config c = parseOk("max_unknown_tenants: 3\nmax_unknown_tenants_per_uid: 1\n");
  EXPECT_EQ(c.maxUnknownTenants, 3u);
  EXPECT_EQ(c.maxUnknownTenantsPerUid, 1u);
  EXPECT_NE(parseError("max_unknown_tenants: -1\n").find("b.yaml:1:22: max_unknown_tenants: "), std::string::npos);
  EXPECT_NE(parseError("max_unknown_tenants_per_uid: many\n").find("max_unknown_tenants_per_uid"), std::string::npos);
  // 2 x 4 GiB configured + 2 x 4 GiB of unknown tenants fill the 16 GiB device exactly; one more
  // unknown tenant would take the configured tenants' memory. (Device 1, 8 GiB: its own map.)
  const std::string fits =
      "unknown_tenants: guest\nmax_unknown_tenants: 2\nprofiles:\n  guest: {memory: {0: 4GiB, 1: 1GiB}}\n"
      "tenants:\n  - {name: a, memory: {0: 4GiB, 1: 1GiB}}\n  - {name: b, memory: {0: 4GiB, 1: 1GiB}}\n";
  EXPECT_EQ(capacityError(fits, twoDevices()), "");
  std::string over = fits;
  over.replace(over.find("max_unknown_tenants: 2"), 22, "max_unknown_tenants: 3");
  const std::string e = capacityError(over, twoDevices());
  EXPECT_EQ(e.rfind("b.yaml:4:19: profiles.guest.memory: the unknown_tenants profile 'guest': its pool of "
                    "max_unknown_tenants (3) x 4294967296 bytes (4 GiB) brings the memory limits on device 0",
                    0),
            0u)
      << e;
  EXPECT_NE(e.find("lower max_unknown_tenants or the profile's memory"), std::string::npos) << e;
  // A profile without a limit would let unknown tenants take everything.
  const std::string none = capacityError("unknown_tenants: guest\nprofiles:\n  guest: {priority: low}\n", twoDevices());
  EXPECT_NE(none.find("profiles.guest: the unknown_tenants profile 'guest' has no memory limit on device 0"),
            std::string::npos)
      << none;
  EXPECT_EQ(capacityError("unknown_tenants: guest\nmax_unknown_tenants: 0\nprofiles:\n  guest: {priority: low}\n",
                          twoDevices()),
            "")
      << "no unknown tenant admitted: no pool";
}

TEST(BrokerConfig, CapacityRefusesDevicesThatDoNotExist) {
  EXPECT_EQ(capacityError("tenants:\n  - {name: a, memory: {2: 1GiB}}\n", twoDevices()),
            "b.yaml:2:24: tenants[0].memory.2: no device '2' on this host (devices: 0 "
            "(GPU-5e1a90c0-0000-4000-8000-000000000000), 1 "
            "(GPU-5e1a90c0-0001-4000-8000-0000000000ab))");
  EXPECT_EQ(capacityError("profiles:\n  p: {memory: {GPU-00000000-0000-0000-0000-000000000000: "
                          "1GiB}}\ntenants:\n  - {name: a, profile: p}\n",
                          twoDevices()),
            "b.yaml:2:16: profiles.p.memory.GPU-00000000-0000-0000-0000-000000000000: no device "
            "'GPU-00000000-0000-0000-0000-000000000000' on this host (devices: 0 "
            "(GPU-5e1a90c0-0000-4000-8000-000000000000), 1 "
            "(GPU-5e1a90c0-0001-4000-8000-0000000000ab))");
  EXPECT_EQ(capacityError("tenants:\n  - {name: a, memory: {0: 1GiB}}\n", {}),
            "b.yaml:2:24: tenants[0].memory.0: no device '0' on this host (it has no devices)");
  const std::string twice = capacityError(
      "tenants:\n  - {name: a, memory: {0: 1GiB, GPU-5e1a90c0-0000-4000-8000-000000000000: "
      "1GiB}}\n",
      twoDevices());
  EXPECT_EQ(twice.rfind("b.yaml:2:33: tenants[0].memory.GPU-5e1a90c0-0000-4000-8000-000000000000: "
                        "device 0 (GPU-5e1a90c0-0000-4000-8000-000000000000) is named twice, as "
                        "'0' and as 'GPU-5e1a90c0-0000-4000-8000-000000000000'",
                        0),
            0u)
      << twice;
}

// A host whose GPU 0 is in MIG mode: a 3g.40gb GPU instance split into two compute instances
// (0:0, 0:1, sharing its 40448 MiB) and a 1g.10gb (0:2); GPU 1 whole.
constexpr const char* kMig0 = "MIG-aaaaaaaa-0000-5000-8000-000000000000";
constexpr const char* kMig1 = "MIG-aaaaaaaa-0001-5000-8000-000000000000";
constexpr const char* kMig2 = "MIG-aaaaaaaa-0002-5000-8000-000000000000";
std::vector<DeviceInfo> migHost() {
  std::vector<DeviceInfo> v;
  const auto mig = [&](int index, const char* uuid, const char* profile, unsigned gi, unsigned ci, uint64_t mib,
                       size_t group) {
    DeviceInfo d = gpu(0, uuid, mib << 20);
    d.migIndex = index;
    d.parentUuid = kUuidA;
    d.profile = profile;
    d.gpuInstance = gi;
    d.computeInstance = ci;
    d.memoryGroup = group;
    v.push_back(d);
  };
  mig(0, kMig0, "1c.3g.40gb", 1, 0, 40448, 0);
  mig(1, kMig1, "2c.3g.40gb", 1, 1, 40448, 0);
  mig(2, kMig2, "1g.10gb", 7, 0, 9984, 2);
  v.push_back(gpu(1, kUuidB, 8 * kGiB));
  return v;
}

// A layout changed under the broker (config/layout_change.h): the compute instance at 0:0 went, so
// the one after it is 0:0 now. A key by index would move alpha's limit onto another device: the
// broker must not follow; keys by UUID, one size and percentages give every remaining device what
// it had. Device descriptions tell a change of profile or IDs; the GPUs include those in MIG mode
// without MIG devices; the changed MIG devices are the ones whose nodes went stale.
TEST(BrokerConfig, ALayoutChangeIsFollowedOnlyWhereNoLimitMoves) {
  const std::vector<DeviceInfo> before = migHost();
  std::vector<DeviceInfo> after = {before[1], before[2], before[3]};
  after[0].migIndex = 0;
  after[1].migIndex = 1;
  after[0].memoryGroup = 0;
  after[1].memoryGroup = 1;
  std::string why;
  const Config byIndex = parseOk("tenants:\n  - {name: alpha, memory: {'0:0': 1GiB}}\n");
  EXPECT_FALSE(sameLimitsAcross(byIndex, before, byIndex, after, &why));
  EXPECT_NE(why.find("alpha's memory on " + std::string(kMig1) + " (0:1, now 0:0) would change"), std::string::npos)
      << why;
  for (const char* fine : {"tenants:\n  - {name: alpha, memory: {MIG-aaaaaaaa-0002-5000-8000-000000000000: 1GiB}}\n",
                           "tenants:\n  - {name: alpha, memory: 1GiB}\n", "tenants:\n  - {name: alpha, memory: 10%}\n"})
    EXPECT_TRUE(sameLimitsAcross(parseOk(fine), before, parseOk(fine), after, &why)) << fine << why;
  // '0:2' names nothing after the change: refused (it does not resolve), not followed.
  const Config gone = parseOk("tenants:\n  - {name: alpha, memory: {'0:2': 1GiB}}\n");
  EXPECT_FALSE(sameLimitsAcross(gone, before, gone, after, &why));
  // An operator who renamed the key to the device's new index (in the file, before the change is
  // followed) keeps alpha where it was: followed.
  EXPECT_TRUE(sameLimitsAcross(parseOk("tenants:\n  - {name: alpha, memory: {'0:1': 1GiB}}\n"), before,
                               parseOk("tenants:\n  - {name: alpha, memory: {'0:0': 1GiB}}\n"), after, &why))
      << why;
  // A limit changed in the file but not reloaded is not taken silently by following.
  EXPECT_FALSE(sameLimitsAcross(parseOk("tenants:\n  - {name: alpha, memory: 1GiB}\n"), before,
                                parseOk("tenants:\n  - {name: alpha, memory: 2GiB}\n"), after, &why));
  // The unknown tenants' profile counts too.
  const Config profile = parseOk("profiles:\n  p: {memory: {'0:0': 1GiB}}\nunknown_tenants: p\n"
                                 "tenants:\n  - {name: alpha, memory: 1GiB}\n");
  EXPECT_FALSE(sameLimitsAcross(profile, before, profile, after, &why));
  EXPECT_NE(why.find("unknown tenants' profile"), std::string::npos) << why;

  EXPECT_NE(describeDevices(before), describeDevices(after));
  std::vector<DeviceInfo> reprofiled = before;
  reprofiled[2].profile = "1g.10gb+me";
  EXPECT_NE(describeDevices(before), describeDevices(reprofiled)) << "a profile changed at the same IDs";
  reprofiled = before;
  reprofiled[2].computeInstance = 1;
  EXPECT_NE(describeDevices(before), describeDevices(reprofiled));
  EXPECT_EQ(changedMigDevices(before, reprofiled), (std::set<std::string>{kMig2}));
  EXPECT_EQ(changedMigDevices(before, after), (std::set<std::string>{kMig0, kMig1, kMig2}))
      << "gone, or at another index (its <tenant>:<gpu>:<mig> name is another device's now)";
  EXPECT_TRUE(changedMigDevices(before, before).empty());
  EXPECT_EQ(gpusOf(after, {}), (std::set<std::string>{kUuidA, kUuidB}));
  EXPECT_EQ(gpusOf({before[3]}, {"0 (" + std::string(kUuidA) + ")"}), (std::set<std::string>{kUuidA, kUuidB}))
      << "a GPU in MIG mode without MIG devices is still there";
}

// MIG devices are named as <gpu>:<mig> or by their MIG- UUID (any case), a percentage is of the
// GPU instance's memory, and a GPU in MIG mode is refused with its MIG devices named.
TEST(BrokerConfig, MigDevicesAreNamedByIndexOrUuid) {
  const Config c = parseOk(
      "tenants:\n"
      "  - {name: a, memory: {'0:0': 1GiB, 'MIG-AAAAAAAA-0002-5000-8000-000000000000': 50%, 1: 2GiB}}\n"
      "  - {name: b, memory: 10%}\n");
  std::vector<uint64_t> l;
  std::string error;
  ASSERT_TRUE(resolveMemory(c, c.tenants[0].memory, migHost(), &l, &error)) << error;
  EXPECT_EQ(l, (std::vector<uint64_t>{kGiB, kUnlimited, 4992ull << 20, 2 * kGiB}));
  ASSERT_TRUE(resolveMemory(c, c.tenants[1].memory, migHost(), &l, &error)) << error;
  EXPECT_EQ(l, (std::vector<uint64_t>{(40448ull << 20) / 10, (40448ull << 20) / 10, (9984ull << 20) / 10,
                                      8 * kGiB / 10}));
  EXPECT_EQ(capacityError("tenants:\n  - {name: a, memory: {0: 1GiB}}\n", migHost()),
            "b.yaml:2:24: tenants[0].memory.0: GPU '0' is in MIG mode: CUDA runs only in its MIG devices (0:0, "
            "0:1, 0:2); name one of them as <gpu>:<mig> or MIG-<uuid>");
  EXPECT_EQ(capacityError(std::string("tenants:\n  - {name: a, memory: {") + kUuidA + ": 1GiB}}\n", migHost()),
            "b.yaml:2:24: tenants[0].memory." + std::string(kUuidA) +
                ": GPU '" + kUuidA + "' is in MIG mode: CUDA runs only in its MIG devices (0:0, 0:1, 0:2); name "
                "one of them as <gpu>:<mig> or MIG-<uuid>");
  const std::string missing = capacityError("tenants:\n  - {name: a, memory: {'0:3': 1GiB}}\n", migHost());
  EXPECT_EQ(missing.rfind("b.yaml:2:24: tenants[0].memory.0:3: no device '0:3' on this host (devices: 0:0 (" +
                              std::string(kMig0) + ", MIG 1c.3g.40gb), 0:1 (",
                          0),
            0u)
      << missing;
  const std::string twice =
      capacityError(std::string("tenants:\n  - {name: a, memory: {'0:1': 1GiB, ") + kMig1 + ": 1GiB}}\n", migHost());
  EXPECT_NE(twice.find("device 0:1 (" + std::string(kMig1) + ", MIG 2c.3g.40gb) is named twice"), std::string::npos)
      << twice;
}

// Compute instances of one GPU instance share its memory: their tenants' limits are admitted
// against it together; another GPU instance is apart.
TEST(BrokerConfig, MigCapacityIsPerGpuInstance) {
  EXPECT_EQ(capacityError("tenants:\n"
                          "  - {name: a, memory: {'0:0': 20224MiB, '0:2': 9984MiB}}\n"
                          "  - {name: b, memory: {'0:1': 20224MiB}}\n",
                          migHost()),
            "")
      << "exactly full";
  const std::string over = capacityError(
      "tenants:\n  - {name: a, memory: {'0:0': 20224MiB}}\n  - {name: b, memory: {'0:1': 20225MiB}}\n", migHost());
  EXPECT_EQ(over.rfind("b.yaml:3:24: tenants[1].memory.0:1: tenant 'b' brings the memory limits on GPU instance 1 of "
                       "GPU 0 (MIG devices 0:0, 0:1, sharing its memory) to 42413850624 bytes",
                       0),
            0u)
      << over;
  // The unknown tenants' pool counts per GPU instance too: 2 x 25% of each compute instance's
  // view is the whole 3g.
  EXPECT_EQ(capacityError("profiles:\n  guest: {memory: 25%}\nunknown_tenants: guest\nmax_unknown_tenants: 2\n",
                          migHost()),
            "");
  const std::string pool = capacityError(
      "profiles:\n  guest: {memory: 25%}\nunknown_tenants: guest\nmax_unknown_tenants: 2\n"
      "tenants:\n  - {name: a, memory: {'0:1': 1MiB}}\n",
      migHost());
  EXPECT_NE(pool.find("brings the memory limits on GPU instance 1 of GPU 0 (MIG devices 0:0, 0:1, sharing its "
                      "memory)"),
            std::string::npos)
      << pool;
}

// The mig: block (docs/mig.md, "Declarative layout"): mig-parted's entries inline, or its file and a
// config name; every refusal names the field.
TEST(BrokerConfig, MigBlock) {
  const Config c = parseOk(
      "mig:\n  apply_at_start: true\n  layout:\n"
      "    - {devices: [0, 2], mig-enabled: true, mig-devices: {\"3g.40gb\": 1, \"1g.10gb+me\": 1, \"2g.20gb\": 0}}\n"
      "    - {devices: [1], mig-enabled: false}\n");
  ASSERT_TRUE(c.mig.set);
  EXPECT_TRUE(c.mig.applyAtStart);
  ASSERT_EQ(c.mig.layout.size(), 2u);
  EXPECT_FALSE(c.mig.layout[0].allDevices);
  EXPECT_EQ(c.mig.layout[0].devices, (std::vector<int>{0, 2}));
  EXPECT_EQ(c.mig.layout[0].profiles,
            (std::vector<std::pair<std::string, uint32_t>>{{"3g.40gb", 1}, {"1g.10gb+me", 1}}))
      << "a count of 0 is left out";
  EXPECT_FALSE(c.mig.layout[1].enabled);
  const Config f = parseOk("mig: {config_file: /etc/mig.yaml, config: all-1g.10gb}\n");
  EXPECT_EQ(f.mig.configFile, "/etc/mig.yaml");
  EXPECT_EQ(f.mig.configName, "all-1g.10gb");
  EXPECT_FALSE(f.mig.applyAtStart);
  EXPECT_TRUE(f.mig.followLayout) << "the broker follows a changed layout by default";
  // follow_layout alone: no layout is set (assert and apply have none to bring about).
  const Config o = parseOk("mig: {follow_layout: false}\n");
  EXPECT_FALSE(o.mig.set);
  EXPECT_FALSE(o.mig.followLayout);
  const Config l = parseOk("mig: {follow_layout: false, config_file: /etc/mig.yaml, config: x}\n");
  EXPECT_TRUE(l.mig.set);
  EXPECT_FALSE(l.mig.followLayout);
  const struct {
    const char* text;
    const char* error;
  } bad[] = {
      {"mig: {follow_layout: no}\n", "mig.follow_layout: expected true or false, found 'no'"},
      {"mig: {follow_layout: true, apply_at_start: true}\n", "not both or neither"},
      {"mig: {layout: [{devices: all, mig-enabled: true, device-filter: '0x233010DE'}]}\n",
       "b.yaml:1:50: mig.layout[0].device-filter: device-filter is not supported"},
      {"mig: {layout: [{devices: all, mig-enabled: true, mig-devices: {1c.3g.40gb: 1}}]}\n",
       "b.yaml:1:64: mig.layout[0].mig-devices.1c.3g.40gb: compute instance profile '1c.3g.40gb' is not supported"},
      {"mig: {layout: [{devices: all, mig-enabled: true, mig-devices: {big: 1}}]}\n",
       "b.yaml:1:64: mig.layout[0].mig-devices.big: 'big' is not a MIG profile name"},
      {"mig: {layout: [{devices: all, mig-enabled: true, mig-devices: {1g.10gb: 8}}]}\n",
       "mig.layout[0].mig-devices.1g.10gb: expected a count of instances, 0..7"},
      {"mig: {layout: [{devices: all, mig-enabled: false, mig-devices: {1g.10gb: 1}}]}\n",
       "mig.layout[0]: mig-devices with mig-enabled: false"},
      {"mig: {layout: [{devices: [0], mig-enabled: true}, {devices: [1, 0], mig-enabled: false}]}\n",
       "mig.layout[1]: its devices overlap those of mig.layout[0]"},
      {"mig: {layout: [{devices: [0, 0], mig-enabled: true}]}\n", "GPU 0 is listed twice"},
      {"mig: {layout: [{mig-enabled: true}]}\n", "mig.layout[0]: devices is missing"},
      {"mig: {layout: [{devices: all}]}\n", "mig.layout[0]: mig-enabled is missing"},
      {"mig: {layout: [{devices: all, mig-enabled: yes}]}\n", "mig.layout[0].mig-enabled: expected true or false"},
      {"mig: {config_file: /etc/mig.yaml}\n", "mig: config_file and config go together"},
      {"mig: {config_file: mig.yaml, config: x}\n", "mig.config_file: expected an absolute path"},
      {"mig: {apply_at_start: true}\n", "mig: give either layout or config_file (with config), not both or neither"},
      {"mig: {layout: [{devices: all, mig-enabled: true}], config_file: /m.yaml, config: x}\n",
       "not both or neither"},
      {"mig: {layouts: []}\n", "mig.layouts: unknown key 'layouts'"},
  };
  for (const auto& b : bad) {
    const std::string e = parseError(b.text);
    EXPECT_NE(e.find(b.error), std::string::npos) << b.text << "\n" << e;
  }
}

// Truncations and random byte flips of a valid file: parseConfig must return either a config or
// one error line of the documented shape (and never crash; run under ASan to see memory errors).
TEST(BrokerConfig, TruncatedAndCorruptedInputNeverCrashes) {
  const std::string base = std::string(kExample) +
                           "  - {name: gamma, memory: {0: 1GiB, GPU-5e1a90c0-0001-4000-8000-"
                           "0000000000ab: 10%}, gid: 7}\n"
                           "  - name: delta\n"
                           "    profile: \"balanced\"\n"
                           "    priority: 'low'\n";
  ASSERT_EQ(parseError(base), "");
  const std::regex shape("^[^:]+:[0-9]+:[0-9]+: [^\\n]*$");
  int ok = 0, refused = 0;
  auto check = [&](const std::string& text) {
    Config c;
    std::string error;
    if (parseConfig(text, "f.yaml", &c, &error)) {
      ++ok;
      std::string capacity;
      if (!checkAgainstDevices(c, twoDevices(), &capacity)) {
        EXPECT_TRUE(std::regex_match(capacity, shape)) << capacity;
      }
      return;
    }
    ++refused;
    EXPECT_TRUE(std::regex_match(error, shape)) << "input:\n" << text << "\nerror: " << error;
  };
  for (size_t n = 0; n <= base.size(); ++n) check(base.substr(0, n));
  std::mt19937 rng(12345);
  const char kInteresting[] = {'\0', '\n', '\t', ':', '[', ']', '{', '}', '&', '*',  '!',
                               '%',  '\'', '"',  '-', ',', '?', '#', '|', '>', '\\', '@'};
  for (int i = 0; i < 3000; ++i) {
    std::string t = base;
    const int flips = 1 + static_cast<int>(rng() % 3);
    for (int f = 0; f < flips; ++f) {
      const size_t pos = rng() % t.size();
      t[pos] =
          (rng() % 2) ? kInteresting[rng() % sizeof kInteresting] : static_cast<char>(rng() % 256);
    }
    check(t);
  }
  EXPECT_GT(ok, 0);
  EXPECT_GT(refused, 0);
}

// The compute block (docs/compute.md): defaults, values, and refusals naming the field.
TEST(BrokerConfig, ComputeBlock) {
  const Config d = parseOk("{}\n");
  EXPECT_EQ(d.compute.periodMs, 100u);
  EXPECT_EQ(d.compute.priorityFloorPercent, 10u);
  EXPECT_TRUE(d.compute.metering);
  const Config c = parseOk("compute: {period_ms: 100, priority_floor_percent: 0, metering: off}\n");
  EXPECT_EQ(c.compute.periodMs, 100u);
  EXPECT_EQ(c.compute.priorityFloorPercent, 0u);
  EXPECT_FALSE(c.compute.metering);
  EXPECT_NE(parseError("compute: {period_ms: 4}\n").find("compute.period_ms"), std::string::npos);
  EXPECT_NE(parseError("compute: {period_ms: 1001}\n").find("compute.period_ms"), std::string::npos);
  EXPECT_NE(parseError("compute: {priority_floor_percent: 10%}\n").find("compute.priority_floor_percent"),
            std::string::npos);
  EXPECT_EQ(d.compute.priorityGuardMs, 2u);
  EXPECT_EQ(parseOk("compute: {priority_guard_ms: 0}\n").compute.priorityGuardMs, 0u);
  EXPECT_EQ(parseOk("compute: {priority_guard_ms: 1000}\n").compute.priorityGuardMs, 1000u);
  EXPECT_NE(parseError("compute: {priority_guard_ms: 1001}\n").find("compute.priority_guard_ms"), std::string::npos);
  EXPECT_NE(parseError("compute: {priority_guard_ms: 2ms}\n").find("compute.priority_guard_ms"), std::string::npos);
  EXPECT_NE(parseError("compute: {priority_gaurd_ms: 2}\n").find("did you mean 'priority_guard_ms'"), std::string::npos);
  EXPECT_NE(parseError("compute: {metering: yes}\n").find("expected on or off"), std::string::npos);
  // The metering source is the broker's (host segment), CUPTI only from the operator's file.
  EXPECT_EQ(d.compute.meteringSource, MeteringSource::kAuto);
  EXPECT_EQ(d.compute.cuptiLibrary, "");
  const Config m = parseOk("compute: {metering_source: cupti, cupti_library: /opt/cupti/libcupti.so.13}\n");
  EXPECT_EQ(m.compute.meteringSource, MeteringSource::kCupti);
  EXPECT_EQ(m.compute.cuptiLibrary, "/opt/cupti/libcupti.so.13");
  EXPECT_EQ(parseOk("compute: {metering_source: events}\n").compute.meteringSource, MeteringSource::kEvents);
  EXPECT_NE(parseError("compute: {metering_source: cupti}\n").find("compute.metering_source: cupti needs "
                                                                 "compute.cupti_library"),
            std::string::npos);
  EXPECT_NE(parseError("compute: {metering_source: nvml}\n").find("compute.metering_source"), std::string::npos);
  EXPECT_NE(parseError("compute: {cupti_library: libcupti.so.13}\n").find("expected an absolute path to a file"),
            std::string::npos);
  EXPECT_NE(parseError("compute: {cupti_library: /opt/cupti/}\n").find("expected an absolute path to a file"),
            std::string::npos);
  EXPECT_NE(parseError("compute: {cupti_library: /" + std::string(300, 'x') + "}\n").find("longer than 255 bytes"),
            std::string::npos);
  EXPECT_NE(parseError("compute: {perod_ms: 50}\n").find("unknown key 'perod_ms'"), std::string::npos);
  EXPECT_NE(parseError("compute: 50\n").find("compute"), std::string::npos);
  EXPECT_TRUE(d.compute.fairShare);
  EXPECT_FALSE(parseOk("compute: {fair_share: off}\n").compute.fairShare);
  EXPECT_FALSE(parseOk("compute: {fair_share: on}\n").compute.mpsWeights);
  EXPECT_TRUE(parseOk("compute: {mps_weights: on}\n").compute.mpsWeights);
  EXPECT_NE(parseError("compute: {mps_weights: yes}\n").find("compute.mps_weights: expected on or off, found 'yes'"),
            std::string::npos);
  EXPECT_NE(parseError("compute: {fair_share: weighted}\n").find("compute.fair_share: expected on or off"),
            std::string::npos);
}

// The probes block (docs/probes.md): defaults, off/on, each key's range, the kinds list.
TEST(BrokerConfig, ProbesBlock) {
  const Config d = parseOk("{}\n");
  EXPECT_TRUE(d.probes.on) << "on by default (docs/probes.md)";
  EXPECT_TRUE(parseOk("probes: {}\n").probes.on);
  EXPECT_EQ(d.probes.intervalMs, 1000u);
  EXPECT_EQ(d.probes.windowS, 10u);
  EXPECT_EQ(d.probes.budgetUs, 200u);
  EXPECT_EQ(d.probes.kinds, 5u);  // sm and tick
  EXPECT_FALSE(parseOk("probes: off\n").probes.on);
  EXPECT_TRUE(parseOk("probes: on\n").probes.on);
  const Config c = parseOk("probes: {interval_ms: 25, window_s: 60, budget_us: 100, kinds: [tick, mem]}\n");
  EXPECT_EQ(c.probes.intervalMs, 25u);
  EXPECT_EQ(c.probes.windowS, 60u);
  EXPECT_EQ(c.probes.budgetUs, 100u);
  EXPECT_EQ(c.probes.kinds, 6u);
  for (const char* bad : {"probes: {interval_ms: 19}\n", "probes: {interval_ms: 600001}\n", "probes: {window_s: 0}\n",
                          "probes: {budget_us: 10001}\n", "probes: {budget_us: 1.5}\n"}) {
    const std::string e = parseError(bad);
    EXPECT_NE(e.find("probes."), std::string::npos) << bad << ": " << e;
  }
  EXPECT_NE(parseError("probes: {kinds: [sm, gpu]}\n").find("unknown probe 'gpu'"), std::string::npos);
  EXPECT_NE(parseError("probes: {kinds: [sm, sm]}\n").find("listed twice"), std::string::npos);
  EXPECT_NE(parseError("probes: {kinds: []}\n").find("probes.kinds"), std::string::npos);
  EXPECT_NE(parseError("probes: {kinds: sm}\n").find("expected a list"), std::string::npos);
  EXPECT_NE(parseError("probes: sometimes\n").find("expected off, on or a map"), std::string::npos);
  EXPECT_NE(parseError("probes: {rate: 1}\n").find("unknown key 'rate'"), std::string::npos);
}

// Weights (docs/compute.md, "Fair share"): 1 by default, from the profile unless the tenant sets
// its own, whole numbers 1..1000 only.
TEST(BrokerConfig, Weights) {
  const Config c = parseOk(
      "profiles:\n  heavy: {weight: 4}\n"
      "tenants:\n  - {name: a}\n  - {name: b, profile: heavy}\n  - {name: c, profile: heavy, weight: 2}\n");
  ASSERT_EQ(c.tenants.size(), 3u);
  EXPECT_EQ(c.tenants[0].weight, 1u);
  EXPECT_EQ(c.tenants[1].weight, 4u);
  EXPECT_EQ(c.tenants[2].weight, 2u);
  for (const char* bad : {"0", "1001", "1.5", "-1", "heavy", "2x"}) {
    const std::string e = parseError(std::string("tenants:\n  - {name: a, weight: ") + bad + "}\n");
    EXPECT_NE(e.find("tenants[0].weight"), std::string::npos) << bad << ": " << e;
  }
  EXPECT_NE(parseError("profiles:\n  p: {weight: 0}\n").find("profiles.p.weight"), std::string::npos);
}


// The cdi block (docs/containers.md): on by default in /var/run/cdi, off, its fields, refusals.
TEST(BrokerConfig, CdiBlock) {
  const Config d = parseOk("{}\n");
  EXPECT_TRUE(d.cdi.enabled);
  EXPECT_EQ(d.cdi.specDir, "/var/run/cdi");
  EXPECT_TRUE(d.cdi.shim.empty());
  EXPECT_FALSE(d.cdi.removeOnStop);
  EXPECT_EQ(d.cdi.mark.line, 0) << "not written: the default";
  EXPECT_FALSE(parseOk("cdi: off\n").cdi.enabled);
  const Config c = parseOk("cdi: {spec_dir: /etc/cdi/, shim: /opt/cushare/lib/libcushare.so, remove_on_stop: on}\n");
  EXPECT_TRUE(c.cdi.enabled);
  EXPECT_EQ(c.cdi.specDir, "/etc/cdi");
  EXPECT_EQ(c.cdi.shim, "/opt/cushare/lib/libcushare.so");
  EXPECT_TRUE(c.cdi.removeOnStop);
  EXPECT_EQ(c.cdi.mark.line, 1);
  EXPECT_NE(parseError("cdi: {spec_dir: cdi}\n").find("cdi.spec_dir: not an absolute path"), std::string::npos);
  EXPECT_NE(parseError("cdi: {shim: /a:b/libcushare.so}\n").find("cdi.shim: a ':' or a space"), std::string::npos);
  EXPECT_NE(parseError("cdi: {remove_on_stop: yes}\n").find("cdi.remove_on_stop: expected on or off"),
            std::string::npos);
  EXPECT_NE(parseError("cdi: {specdir: /x}\n").find("unknown key 'specdir'; did you mean 'spec_dir'?"),
            std::string::npos);
  EXPECT_NE(parseError("cdi: on\n").find("cdi: expected off, or a map"), std::string::npos);
}

// The kubernetes block (docs/kubernetes.md): off unless written; its fields and refusals.
TEST(BrokerConfig, KubernetesBlock) {
  EXPECT_FALSE(parseOk("{}\n").kubernetes.enabled);
  const Config d = parseOk("kubernetes:\n");
  EXPECT_TRUE(d.kubernetes.enabled);
  EXPECT_EQ(d.kubernetes.devicePluginDir, "/var/lib/kubelet/device-plugins");
  EXPECT_EQ(d.kubernetes.devicesPerGpu, 8u);
  const Config c = parseOk("kubernetes: {device_plugin_dir: /tmp/dp/, devices_per_gpu: 100}\n");
  EXPECT_EQ(c.kubernetes.devicePluginDir, "/tmp/dp");
  EXPECT_EQ(c.kubernetes.devicesPerGpu, 100u);
  EXPECT_NE(parseError("kubernetes: {devices_per_gpu: 0}\n").find("kubernetes.devices_per_gpu"), std::string::npos);
  EXPECT_NE(parseError("kubernetes: {devices_per_gpu: 101}\n").find("kubernetes.devices_per_gpu"), std::string::npos);
  EXPECT_NE(parseError("kubernetes: {device_plugin_dir: dp}\n").find("not an absolute path"), std::string::npos);
  EXPECT_NE(parseError("kubernetes: {device_plugin_dir: /" + std::string(70, 'd') + "}\n").find("longer than 70"),
            std::string::npos);
  EXPECT_NE(parseError("kubernetes: {device_plugins_dir: /x}\n").find("did you mean 'device_plugin_dir'?"),
            std::string::npos);
  EXPECT_NE(parseError("kubernetes: on\n").find("kubernetes: expected a map"), std::string::npos);
  // The GPU's own CDI device, named by a template.
  EXPECT_TRUE(d.kubernetes.gpuCdiDevice.empty());
  EXPECT_EQ(parseOk("kubernetes: {gpu_cdi_device: 'nvidia.com/gpu={uuid}'}\n").kubernetes.gpuCdiDevice,
            "nvidia.com/gpu={uuid}");
  EXPECT_EQ(parseOk("kubernetes: {gpu_cdi_device: nvidia.com/gpu=all}\n").kubernetes.gpuCdiDevice, "nvidia.com/gpu=all");
  EXPECT_NE(parseError("kubernetes: {gpu_cdi_device: 'nvidia.com/gpu={id}'}\n").find("'{id}' is not {uuid} or {index}"),
            std::string::npos);
  EXPECT_NE(parseError("kubernetes: {gpu_cdi_device: 'gpu={uuid}'}\n").find("not a qualified CDI device name"),
            std::string::npos);
  EXPECT_NE(parseError("kubernetes: {gpu_cdi_device: 'nvidia.com/g pu={index}'}\n")
                .find("character ' ' is not allowed in the CDI class"),
            std::string::npos);
  EXPECT_NE(parseError("kubernetes: {gpu_cdi_device: 'nvidia.com/gpu='}\n").find("kubernetes.gpu_cdi_device"),
            std::string::npos);
  // Pod labels: the kubelet's pod resources socket (off: none) and the allocation directories.
  EXPECT_EQ(d.kubernetes.podResourcesSocket, "/var/lib/kubelet/pod-resources/kubelet.sock");
  EXPECT_EQ(d.kubernetes.allocationDir, "/run/cushare/allocations");
  EXPECT_TRUE(parseOk("kubernetes: {pod_resources_socket: off}\n").kubernetes.podResourcesSocket.empty());
  const Config p = parseOk("kubernetes: {pod_resources_socket: /tmp/pr/kubelet.sock, allocation_dir: /tmp/al/}\n");
  EXPECT_EQ(p.kubernetes.podResourcesSocket, "/tmp/pr/kubelet.sock");
  EXPECT_EQ(p.kubernetes.allocationDir, "/tmp/al");
  EXPECT_NE(parseError("kubernetes: {pod_resources_socket: kubelet.sock}\n").find("not an absolute path"),
            std::string::npos);
  EXPECT_NE(parseError("kubernetes: {pod_resources_socket: ''}\n").find("pod_resources_socket: expected the kubelet's pod resources socket (an absolute path) or off, found an empty value"),
            std::string::npos);
  EXPECT_NE(parseError("kubernetes: {pod_resources_socket: /" + std::string(107, 's') + "}\n").find("longer than 107"),
            std::string::npos);
  EXPECT_NE(parseError("kubernetes: {allocation_dir: /}\n").find("the root directory"), std::string::npos);
  EXPECT_NE(parseError("kubernetes: {allocation_dir: run/x}\n").find("kubernetes.allocation_dir"), std::string::npos);
  EXPECT_NE(parseError("kubernetes: {allocation_dirs: /x}\n").find("did you mean 'allocation_dir'?"),
            std::string::npos);
}

}  // namespace
}  // namespace cushare::broker

// ---- guarantees and bursting (docs/memory-elasticity.md) ----
namespace elastic {
using namespace cushare::broker;

TEST(BrokerConfigBurst, AGuaranteeMeansManagedBurstingUpToTheLimit) {
  const Config c = parseOk(
      "profiles:\n"
      "  elastic: {memory: 8GiB, guarantee: 2GiB}\n"
      "tenants:\n"
      "  - {name: a, memory: 4GiB, guarantee: 1GiB}\n"
      "  - {name: b, profile: elastic}\n"
      "  - {name: c, profile: elastic, burst: off}\n"
      "  - {name: d, memory: 4GiB}\n"
      "  - {name: e, memory: 4GiB, guarantee: 1GiB, burst: managed}\n");
  ASSERT_EQ(c.tenants.size(), 5u);
  EXPECT_EQ(c.tenants[0].burst, BurstMode::kManaged);
  EXPECT_EQ(c.tenants[0].guarantee.all.bytes, kGiB);
  EXPECT_EQ(c.tenants[1].burst, BurstMode::kManaged) << "from its profile";
  EXPECT_EQ(c.tenants[1].guarantee.all.bytes, 2 * kGiB);
  EXPECT_EQ(c.tenants[2].burst, BurstMode::kOff) << "burst: off drops the profile's guarantee";
  EXPECT_EQ(c.tenants[2].guarantee.kind, MemorySpec::kNone);
  EXPECT_EQ(c.tenants[3].burst, BurstMode::kOff) << "the default keeps today's hard limits";
  EXPECT_EQ(c.tenants[4].burst, BurstMode::kManaged);
}

TEST(BrokerConfigBurst, InconsistentSettingsAreRefusedWithTheReason) {
  EXPECT_EQ(parseError("tenants:\n  - {name: a, memory: 4GiB, burst: managed}\n"),
            "b.yaml:2:36: tenants[0].burst: burst: managed needs a guarantee (the memory reserved for it; above it, up to "
            "memory, it bursts)");
  EXPECT_EQ(parseError("tenants:\n  - {name: a, guarantee: 1GiB}\n"),
            "b.yaml:2:26: tenants[0].guarantee: a guarantee needs a memory limit (the most it may burst to)");
  EXPECT_EQ(parseError("tenants:\n  - {name: a, memory: 4GiB, guarantee: 1GiB, burst: off}\n"),
            "b.yaml:2:40: tenants[0].guarantee: a guarantee with burst: off means nothing: the memory limit is already "
            "reserved; remove one of them");
  EXPECT_EQ(parseError("tenants:\n  - {name: a, memory: 4GiB, burst: plain, guarantee: 1GiB}\n"), "");
  EXPECT_NE(parseError("tenants:\n  - {name: a, memory: 4GiB, burst: plain}\n").find("burst: plain needs a guarantee"),
            std::string::npos);
  EXPECT_NE(parseError("tenants:\n  - {name: a, memory: 4GiB, burst: sometimes, guarantee: 1GiB}\n")
                .find("expected off, managed or plain, found 'sometimes'"),
            std::string::npos);
  EXPECT_NE(parseError("elasticity: {reclaim_wait_ms: 70000}\ntenants: []\n").find("elasticity.reclaim_wait_ms"),
            std::string::npos);
  EXPECT_NE(parseError("elasticity: {reclaim_deadline: 5}\ntenants: []\n").find("reclaim_deadline_ms"),
            std::string::npos) << "did you mean";
  const Config c = parseOk("elasticity: {reclaim_wait_ms: 0, reclaim_deadline_ms: 250}\ntenants: []\n");
  EXPECT_EQ(c.elasticity.reclaimWaitMs, 0u);
  EXPECT_EQ(c.elasticity.reclaimDeadlineMs, 250u);
  EXPECT_TRUE(c.elasticity.thrashGuard) << "the thrashing guard is on unless said";
  EXPECT_EQ(c.elasticity.thrashQuantumMs, 1000u);
  const Config off = parseOk("elasticity: {thrash_guard: off, thrash_quantum_ms: 5000}\ntenants: []\n");
  EXPECT_FALSE(off.elasticity.thrashGuard);
  EXPECT_EQ(off.elasticity.thrashQuantumMs, 5000u);
  EXPECT_NE(parseError("elasticity: {thrash_guard: maybe}\ntenants: []\n").find("expected on or off, found 'maybe'"),
            std::string::npos);
  EXPECT_NE(parseError("elasticity: {thrash_quantum_ms: 10}\ntenants: []\n").find("elasticity.thrash_quantum_ms"),
            std::string::npos) << "below 100 ms a turn is shorter than its drain";
  EXPECT_NE(parseError("profiles:\n  p: {memory: 1GiB, guarantee: 512MiB}\nunknown_tenants: p\n")
                .find("unknown tenants cannot burst"),
            std::string::npos);
}

TEST(BrokerConfigBurst, AdmissionSumsGuaranteesNotBurstLimits) {
  // 16 GiB device 0: 12 GiB guaranteed to b plus a's 4 GiB guarantee fit; a's 16 GiB ceiling does not count.
  EXPECT_EQ(capacityError("tenants:\n"
                          "  - {name: a, memory: 16GiB, guarantee: 4GiB}\n"
                          "  - {name: b, memory: {0: 12GiB}}\n",
                          {gpu(0, kUuidA, 16 * kGiB)}),
            "");
  const std::string e = capacityError("tenants:\n"
                                      "  - {name: a, memory: 16GiB, guarantee: 5GiB}\n"
                                      "  - {name: b, memory: {0: 12GiB}}\n",
                                      {gpu(0, kUuidA, 16 * kGiB)});
  EXPECT_NE(e.find("tenant 'b' brings the memory limits on device 0"), std::string::npos) << e;
  const std::string g = capacityError("tenants:\n"
                                      "  - {name: b, memory: {0: 12GiB}}\n"
                                      "  - {name: a, memory: 16GiB, guarantee: 5GiB}\n",
                                      {gpu(0, kUuidA, 16 * kGiB)});
  EXPECT_NE(g.find("b.yaml:3:41: tenants[1].guarantee: tenant 'a' brings the memory reserved (limits, and guarantees "
                   "of bursting tenants) on device 0"),
            std::string::npos)
      << "[" << g << "]";
  EXPECT_NE(g.find("this tenant's guarantee there is 5368709120 bytes"), std::string::npos) << g;
  // A guarantee above the limit on a device is refused, naming both.
  const std::string over = capacityError("tenants:\n  - {name: a, memory: {0: 2GiB}, guarantee: 3GiB}\n",
                                         {gpu(0, kUuidA, 16 * kGiB)});
  EXPECT_NE(over.find("b.yaml:2:45: tenants[0].guarantee: tenant 'a': the guarantee on device 0 ("), std::string::npos) << "[" << over << "]";
  EXPECT_NE(over.find("is above its memory limit there"), std::string::npos) << over;
}

}  // namespace elastic
