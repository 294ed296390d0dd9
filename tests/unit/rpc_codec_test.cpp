// The control API's codec (broker/rpc/codec.h) and snapshot mapping (convert.h): framing in any
// split, every validation error, memory amounts, the client's round trip against an in-process
// server, and the checked-in corpus of hostile requests (tests/broker/corpus, also replayed through
// the fuzz entry so the normal suite exercises it).
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <thread>

#include "rpc/codec.h"
#include "rpc/convert.h"

namespace cushare::rpc {
namespace {

namespace fs = std::filesystem;

bool isOneLine(const std::string& s) { return !s.empty() && s.find('\n') == std::string::npos; }

Request statusRequest() {
  Request r;
  r.set_version(kProtocolVersion);
  r.mutable_status();
  return r;
}

Request setLimit(const std::string& tenant, const std::string& memory, bool reset, int device) {
  Request r;
  r.set_version(kProtocolVersion);
  SetLimitRequest* s = r.mutable_set_limit();
  s->set_tenant(tenant);
  s->set_memory(memory);
  s->set_reset(reset);
  s->set_device(device);
  return r;
}

// The error of validating r, or "" if it is accepted.
std::string rejection(const Request& r) {
  std::string err;
  Request out;
  if (decodeRequest(r.SerializeAsString(), &out, &err)) return "";
  EXPECT_TRUE(isOneLine(err)) << err;
  return err;
}

// ---- framing ---------------------------------------------------------------------------------

TEST(RpcFrame, LengthPrefixIsLittleEndian) {
  const std::string f = frame(statusRequest());
  const std::string body = statusRequest().SerializeAsString();
  ASSERT_EQ(f.size(), 4 + body.size());
  EXPECT_EQ(static_cast<unsigned char>(f[0]), body.size());
  EXPECT_EQ(f.substr(1, 3), std::string(3, '\0'));
  EXPECT_EQ(f.substr(4), body);
}

TEST(RpcFrame, ReassemblesFromAnySplit) {
  Request big = setLimit("team-a", "8GiB", false, -1);
  big.mutable_set_limit()->set_tenant(std::string(40, 't'));
  const std::string f = frame(big);
  for (size_t piece = 1; piece <= f.size(); ++piece) {
    FrameReader r(kMaxRequestBytes);
    std::string err;
    FrameReader::Status s = FrameReader::kNeedMore;
    for (size_t pos = 0; pos < f.size(); pos += piece)
      s = r.feed(f.data() + pos, std::min(piece, f.size() - pos), &err);
    ASSERT_EQ(s, FrameReader::kDone) << "piece " << piece << ": " << err;
    EXPECT_EQ(r.payload(), f.substr(4));
  }
}

TEST(RpcFrame, EmptyFeedsChangeNothing) {
  FrameReader r(kMaxRequestBytes);
  std::string err;
  EXPECT_EQ(r.feed(nullptr, 0, &err), FrameReader::kNeedMore);
  const std::string f = frame(statusRequest());
  EXPECT_EQ(r.feed(f.data(), f.size(), &err), FrameReader::kDone);
  EXPECT_EQ(r.feed(nullptr, 0, &err), FrameReader::kDone);
}

TEST(RpcFrame, ZeroLengthFrameIsAnEmptyPayload) {
  FrameReader r(kMaxRequestBytes);
  std::string err;
  EXPECT_EQ(r.feed("\0\0\0\0", 4, &err), FrameReader::kDone);
  EXPECT_EQ(r.payload(), "");
}

TEST(RpcFrame, LengthOverTheMaximumNamesBoth) {
  FrameReader r(100);
  std::string err;
  EXPECT_EQ(r.feed("\x65\x00\x00\x00", 4, &err), FrameReader::kError);
  EXPECT_EQ(err, "message length 101 bytes exceeds the maximum of 100 bytes");
  // The reader stays failed.
  err.clear();
  EXPECT_EQ(r.feed("x", 1, &err), FrameReader::kError);
  EXPECT_EQ(err, "message length 101 bytes exceeds the maximum of 100 bytes");
}

TEST(RpcFrame, ExactlyTheMaximumIsAccepted) {
  FrameReader r(100);
  std::string err;
  const std::string f = std::string("\x64\0\0\0", 4) + std::string(100, 'x');
  EXPECT_EQ(r.feed(f.data(), f.size(), &err), FrameReader::kDone) << err;
}

TEST(RpcFrame, BytesAfterTheFrameAreAnError) {
  const std::string f = frame(statusRequest());
  const std::string twice = f + f;
  FrameReader same(kMaxRequestBytes);
  std::string err;
  EXPECT_EQ(same.feed(twice.data(), twice.size(), &err), FrameReader::kError);
  EXPECT_NE(err.find("bytes after the end of the 4-byte message"), std::string::npos) << err;

  FrameReader later(kMaxRequestBytes);
  ASSERT_EQ(later.feed(f.data(), f.size(), &err), FrameReader::kDone);
  EXPECT_EQ(later.feed("x", 1, &err), FrameReader::kError);
  EXPECT_TRUE(isOneLine(err));
}

TEST(RpcFrame, IncompleteReasonSaysHowFarItGot) {
  FrameReader r(kMaxRequestBytes);
  std::string err;
  EXPECT_EQ(r.incompleteReason(), "no message: the connection closed before its first byte");
  r.feed("\x0a\x00", 2, &err);
  EXPECT_EQ(r.incompleteReason(), "truncated message: got 2 of the 4 length bytes");
  r.feed(
      "\x00\x00"
      "abc",
      5, &err);
  EXPECT_EQ(r.incompleteReason(), "truncated message: got 3 of 10 bytes");
}

// ---- validation ------------------------------------------------------------------------------

TEST(RpcValidate, AcceptsEveryWellFormedBody) {
  EXPECT_EQ(rejection(statusRequest()), "");
  Request r;
  r.set_version(1);
  r.mutable_reload();
  EXPECT_EQ(rejection(r), "");
  r.mutable_tenants();  // empty tenant: all
  EXPECT_EQ(rejection(r), "");
  r.mutable_tenants()->set_tenant("team-a");
  EXPECT_EQ(rejection(r), "");
  r.mutable_processes();
  EXPECT_EQ(rejection(r), "");
  r.mutable_processes()->set_tenant("A.b_c-9");
  EXPECT_EQ(rejection(r), "");
  r.mutable_env()->set_tenant(std::string(63, 'x'));
  EXPECT_EQ(rejection(r), "");
  EXPECT_EQ(rejection(setLimit("t", "8GiB", false, -1)), "");
  EXPECT_EQ(rejection(setLimit("t", "100%", false, 0)), "");
  EXPECT_EQ(rejection(setLimit("t", "", true, 3)), "");
}

TEST(RpcValidate, NotAMessage) {
  Request out;
  std::string err;
  EXPECT_FALSE(decodeRequest("\xff\xff\xff", &out, &err));
  EXPECT_EQ(err,
            "the request is not a valid cushare.rpc.Request (3 bytes: malformed protobuf, or a "
            "string that is not UTF-8)");
}

TEST(RpcValidate, PayloadOverTheMaximum) {
  Request out;
  std::string err;
  EXPECT_FALSE(decodeRequest(std::string(kMaxRequestBytes + 1, '\0'), &out, &err));
  EXPECT_EQ(err, "request of 65537 bytes exceeds the maximum of 65536");
}

TEST(RpcValidate, Version) {
  Request r = statusRequest();
  r.set_version(0);
  EXPECT_EQ(rejection(r), "the request has no protocol version; this broker speaks version 1");
  r.set_version(2);
  EXPECT_EQ(rejection(r), "protocol version 2 is not supported; this broker speaks version 1");
}

TEST(RpcValidate, Body) {
  Request r;
  r.set_version(1);
  EXPECT_EQ(rejection(r),
            "the request has no body this broker knows (status, tenants, processes, set_limit, "
            "reload, env)");
}

TEST(RpcValidate, UnknownFieldsAreIgnored) {
  // version 1, status {}, then field 100 (varint 7): a newer client's addition.
  const std::string payload = std::string("\x08\x01\x12\x00", 4) + "\xa0\x06\x07";
  Request out;
  std::string err;
  EXPECT_TRUE(decodeRequest(payload, &out, &err)) << err;
  EXPECT_TRUE(out.has_status());
}

TEST(RpcValidate, TenantNames) {
  Request r;
  r.set_version(1);
  r.mutable_tenants()->set_tenant("a/b");
  EXPECT_EQ(rejection(r),
            "invalid tenant name 'a/b': character '/' at position 2 is not allowed (use A-Z a-z "
            "0-9 . _ -)");
  r.mutable_processes()->set_tenant("..");
  EXPECT_EQ(rejection(r),
            "invalid tenant name '..': '..' is not allowed (tenant names are used in file names)");
  r.mutable_processes()->set_tenant(std::string("a\0b", 3));
  EXPECT_EQ(rejection(r),
            "invalid tenant name 'a\\x00b': character '\\x00' at position 2 is not allowed (use "
            "A-Z a-z 0-9 . _ -)");
  r.mutable_env()->set_tenant(std::string(64, 'x'));
  EXPECT_NE(rejection(r).find(": 64 characters, at most 63 allowed"), std::string::npos);
  r.mutable_env()->set_tenant("a\nb");
  EXPECT_NE(rejection(r).find("'a\\nb'"), std::string::npos);
  r.mutable_env()->clear_tenant();
  EXPECT_EQ(rejection(r), "a tenant name is required");
  EXPECT_EQ(rejection(setLimit("", "1GiB", false, -1)), "a tenant name is required");
  EXPECT_NE(rejection(setLimit(" t", "1GiB", false, -1)).find("invalid tenant name ' t'"),
            std::string::npos);
}

TEST(RpcValidate, SetLimitNeedsMemoryOrReset) {
  EXPECT_EQ(rejection(setLimit("t", "", false, -1)),
            "set_limit needs a memory amount, threads, a priority or reset");
  EXPECT_EQ(rejection(setLimit("t", "1GiB", true, -1)),
            "set_limit takes reset alone, without memory, threads or priority");
  Request threads = setLimit("t", "", true, -1);
  threads.mutable_set_limit()->set_threads(50);
  EXPECT_EQ(rejection(threads), "set_limit takes reset alone, without memory, threads or priority");
}

TEST(RpcValidate, SetLimitThreadsAndPriority) {
  Request r = setLimit("t", "", false, -1);
  r.mutable_set_limit()->set_threads(1);
  EXPECT_EQ(rejection(r), "");
  r.mutable_set_limit()->set_threads(100);
  r.mutable_set_limit()->set_priority("low");
  EXPECT_EQ(rejection(r), "");
  for (int bad : {0, 101, -5}) {
    r.mutable_set_limit()->set_threads(bad);
    EXPECT_EQ(rejection(r),
              "threads " + std::to_string(bad) + " is not valid: a compute cap is a percentage from 1 to 100");
  }
  r.mutable_set_limit()->set_threads(50);
  r.mutable_set_limit()->set_priority("urgent");
  EXPECT_EQ(rejection(r).rfind("priority: ", 0), 0u) << rejection(r);
  r.mutable_set_limit()->set_priority("");
  r.mutable_set_limit()->set_device(0);
  EXPECT_EQ(rejection(r),
            "device applies to memory limits; threads and priority are the tenant's on every device");
}

TEST(RpcValidate, SetLimitMemoryAndDevice) {
  EXPECT_EQ(rejection(setLimit("t", "12x", false, -1)),
            "memory: invalid size '12x': unknown unit 'x' (use B, KiB, MiB, GiB, TiB, KB, MB, "
            "GB, TB)");
  EXPECT_EQ(rejection(setLimit("t", "101%", false, -1)),
            "memory '101%': a percentage must be more than 0% and at most 100%");
  EXPECT_EQ(rejection(setLimit("t", "1GiB", false, -2)),
            "device -2 is not valid: use a device index, or -1 for every device");
  EXPECT_EQ(rejection(setLimit("t", "1GiB", false, INT32_MIN)),
            "device -2147483648 is not valid: use a device index, or -1 for every device");
}

// ---- memory amounts --------------------------------------------------------------------------

TEST(RpcMemoryAmount, SizesAndPercentages) {
  struct Case {
    const char* text;
    uint64_t bytes;
    uint32_t milli;
  };
  const Case cases[] = {
      {"512MiB", 512ull << 20, 0},
      {"8GiB", 8ull << 30, 0},
      {" 1.5G ", 3ull << 29, 0},
      {"1048576", 1 << 20, 0},
      {"25%", 0, 25000},
      {"12.5%", 0, 12500},
      {"0.001%", 0, 1},
      {"100%", 0, 100000},
      {"100.000%", 0, 100000},
      {" 33.33 %", 0, 33330},
      {"007%", 0, 7000},
  };
  for (const Case& c : cases) {
    MemoryValue v;
    std::string err;
    ASSERT_TRUE(parseMemoryAmount(c.text, &v, &err)) << c.text << ": " << err;
    EXPECT_EQ(v.bytes, c.bytes) << c.text;
    EXPECT_EQ(v.milliPercent, c.milli) << c.text;
  }
}

TEST(RpcMemoryAmount, Rejections) {
  const std::pair<const char*, const char*> cases[] = {
      {"", "memory: invalid size '': empty"},
      {"0",
       "memory '0': a limit of 0 bytes would deny every allocation (to drop a live limit: "
       "cushare set-limit TENANT --reset)"},
      {"-1G", "memory: invalid size '-1G': negative"},
      {"1.5", "memory: invalid size '1.5': not a whole number of bytes"},
      {"%", "memory '%': expected a percentage such as '25%' or '12.5%'"},
      {"0%", "memory '0%': a percentage must be more than 0% and at most 100%"},
      {"0.0001%", "memory '0.0001%': at most 3 digits after '.'"},
      {"100.001%", "memory '100.001%': a percentage must be more than 0% and at most 100%"},
      {"99999999999999999999%",
       "memory '99999999999999999999%': a percentage must be more than 0% and at most 100%"},
      {"5.%", "memory '5.%': missing digits after '.'"},
      {"-5%", "memory '-5%': expected a percentage such as '25%' or '12.5%'"},
      {"5%%", "memory '5%%': expected a percentage such as '25%' or '12.5%'"},
      {"1G\niB",
       "memory: invalid size '1G\\niB': unknown unit 'G\\niB' (use B, KiB, MiB, GiB, "
       "TiB, KB, MB, GB, TB)"},
  };
  for (const auto& [text, want] : cases) {
    MemoryValue v;
    std::string err;
    EXPECT_FALSE(parseMemoryAmount(text, &v, &err)) << text;
    EXPECT_EQ(err, want);
  }
}

// ---- snapshot mapping ------------------------------------------------------------------------

broker::BrokerSnapshot sampleSnapshot() {
  broker::BrokerSnapshot s;
  s.version = "0.1.0";
  s.pid = 42;
  s.configFile = "/etc/cushare/broker.yaml";
  s.configGeneration = 3;
  s.uptimeSeconds = 12.5;
  s.ledgerDir = "/dev/shm/cushare";
  s.unknownTenants = "refuse";
  s.metricsAddress = "127.0.0.1:9400";
  s.devices.resize(2);
  s.devices[0].index = 4;
  s.devices[0].uuid = "GPU-a";
  s.devices[0].capacity = 80ull << 30;
  s.devices[0].used = 3ull << 30;
  s.devices[0].deviceUsed = 9ull << 30;
  s.devices[0].outside = 5ull << 30;
  s.devices[0].outsidePids = {77, 78};
  s.devices[0].read = true;
  s.devices[1].index = 7;  // its accounting not read; a MIG device of GPU 7
  s.devices[1].name = "7:2";
  s.devices[1].migIndex = 2;
  s.devices[1].parentUuid = "GPU-p";
  s.devices[1].migProfile = "1g.10gb";
  s.devices[1].gpuInstance = 9;
  s.devices[1].uuid = "GPU-b";
  s.devices[1].capacity = 40ull << 30;
  s.reapedProcesses = 5;
  s.reloadsRefused = 1;

  broker::TenantSnapshot a;
  a.name = "team-a";
  a.profile = "small";
  a.source = "config";
  a.threadPercentage = 30;
  a.priority = Priority::kHigh;
  a.ledgerPath = "/dev/shm/cushare/team-a.ledger";
  a.devices = {{0, "GPU-a", 3ull << 30, 8ull << 30, 4ull << 30, 2, true},
               {1, "GPU-b", 0, broker::kNoLimit, 0, 0, false}};
  a.processes = {{100, {1ull << 30, 0}}, {101, {2ull << 30, 0}}, {102, {0, 0}}};

  broker::TenantSnapshot b;
  b.name = "team-b";
  b.source = "unknown-tenant";
  b.error = "damaged ledger";
  s.tenants = {a, b};
  return s;
}

TEST(RpcConvert, Status) {
  StatusReply r;
  toProto(sampleSnapshot(), &r);
  EXPECT_EQ(r.version(), "0.1.0");
  EXPECT_EQ(r.pid(), 42);
  EXPECT_EQ(r.config_file(), "/etc/cushare/broker.yaml");
  EXPECT_EQ(r.config_generation(), 3u);
  EXPECT_DOUBLE_EQ(r.uptime_seconds(), 12.5);
  EXPECT_EQ(r.ledger_dir(), "/dev/shm/cushare");
  EXPECT_EQ(r.unknown_tenants(), "refuse");
  EXPECT_EQ(r.metrics_address(), "127.0.0.1:9400");
  ASSERT_EQ(r.devices_size(), 2);
  // The broker's device number is the position in its list (the NVML index on a host without MIG,
  // whose devices are listed in NVML's order); the name is NVML's index, or <gpu>:<mig>.
  EXPECT_EQ(r.devices(1).index(), 1);
  EXPECT_EQ(r.devices(0).name(), "4");
  EXPECT_EQ(r.devices(1).name(), "7:2");
  EXPECT_EQ(r.devices(1).uuid(), "GPU-b");
  EXPECT_FALSE(r.devices(0).mig());
  EXPECT_TRUE(r.devices(1).mig());
  EXPECT_EQ(r.devices(1).gpu_uuid(), "GPU-p");
  EXPECT_EQ(r.devices(1).mig_profile(), "1g.10gb");
  EXPECT_EQ(r.devices(1).gpu_instance_id(), 9u);
  EXPECT_EQ(r.devices(1).compute_instance_id(), 0u);
  EXPECT_EQ(r.devices(0).capacity_bytes(), 80ull << 30);
  EXPECT_EQ(r.devices(0).used_bytes(), 3ull << 30);
  ASSERT_TRUE(r.devices(0).has_device_used_bytes());
  EXPECT_EQ(r.devices(0).device_used_bytes(), 9ull << 30);
  EXPECT_EQ(r.devices(0).outside_bytes(), 5ull << 30);
  ASSERT_EQ(r.devices(0).outside_pids_size(), 2);
  EXPECT_EQ(r.devices(0).outside_pids(1), 78);
  EXPECT_FALSE(r.devices(1).has_device_used_bytes()) << "not read: absent, not 0";
  EXPECT_EQ(r.tenants(), 2u);
  EXPECT_EQ(r.processes(), 3u);
  EXPECT_EQ(r.reaped_processes(), 5u);
  EXPECT_EQ(r.reloads_refused(), 1u);
}

TEST(RpcConvert, TenantLimitsAndDeviceIndexes) {
  const broker::BrokerSnapshot s = sampleSnapshot();
  Tenant t;
  toProto(s.tenants[0], s, &t);
  EXPECT_EQ(t.name(), "team-a");
  EXPECT_EQ(t.profile(), "small");
  EXPECT_EQ(t.source(), "config");
  ASSERT_TRUE(t.has_thread_percentage());
  EXPECT_EQ(t.thread_percentage(), 30);
  EXPECT_EQ(t.priority(), "high");
  EXPECT_EQ(t.ledger(), "/dev/shm/cushare/team-a.ledger");
  EXPECT_EQ(t.processes(), 3u);
  ASSERT_EQ(t.devices_size(), 2);
  EXPECT_EQ(t.devices(0).device(), 0);  // the broker's device number, and its name
  EXPECT_EQ(t.devices(0).device_name(), "4");
  ASSERT_TRUE(t.devices(0).has_limit_bytes());
  EXPECT_EQ(t.devices(0).limit_bytes(), 8ull << 30);
  EXPECT_EQ(t.devices(0).used_bytes(), 3ull << 30);
  EXPECT_EQ(t.devices(0).peak_bytes(), 4ull << 30);
  EXPECT_EQ(t.devices(0).denied(), 2u);
  EXPECT_TRUE(t.devices(0).overridden());
  EXPECT_EQ(t.devices(1).device(), 1);
  EXPECT_EQ(t.devices(1).device_name(), "7:2");
  EXPECT_FALSE(t.devices(1).has_limit_bytes());  // kNoLimit: absent, not UINT64_MAX

  Tenant b;
  toProto(s.tenants[1], s, &b);
  EXPECT_FALSE(b.has_thread_percentage());
  EXPECT_EQ(b.priority(), "normal");
  EXPECT_EQ(b.error(), "damaged ledger");
  EXPECT_EQ(b.devices_size(), 0);
}

TEST(RpcConvert, TenantsFilter) {
  const broker::BrokerSnapshot s = sampleSnapshot();
  TenantsReply all, one, none;
  EXPECT_TRUE(tenantsToProto(s, "", &all));
  EXPECT_EQ(all.tenants_size(), 2);
  EXPECT_TRUE(tenantsToProto(s, "team-b", &one));
  ASSERT_EQ(one.tenants_size(), 1);
  EXPECT_EQ(one.tenants(0).name(), "team-b");
  ASSERT_EQ(one.devices_size(), 2) << "every device, for the memory outside cushare";
  EXPECT_EQ(one.devices(0).outside_bytes(), 5ull << 30);
  EXPECT_FALSE(tenantsToProto(s, "nobody", &none));
  EXPECT_EQ(none.tenants_size(), 0);
}

// The innermost-namespace pid of each host pid, as /proc would say (0: gone).
int fakeInnermost(int hostPid) { return hostPid == 5000 ? 7 : hostPid == 5001 ? 5001 : 0; }

TEST(RpcConvert, ProcessesListOnlyDevicesInUse) {
  const broker::BrokerSnapshot s = sampleSnapshot();
  ProcessesReply r;
  EXPECT_TRUE(processesToProto(s, "", fakeInnermost, &r));
  ASSERT_EQ(r.processes_size(), 3);  // every live process, even one without memory
  EXPECT_EQ(r.processes(0).tenant(), "team-a");
  EXPECT_EQ(r.processes(0).pid(), 100);
  ASSERT_EQ(r.processes(0).usage_size(), 1);
  EXPECT_EQ(r.processes(0).usage(0).device(), 0);
  EXPECT_EQ(r.processes(0).usage(0).device_name(), "4");
  EXPECT_EQ(r.processes(0).usage(0).used_bytes(), 1ull << 30);
  EXPECT_EQ(r.processes(2).usage_size(), 0);

  ProcessesReply b, none;
  EXPECT_TRUE(processesToProto(s, "team-b", fakeInnermost, &b));
  EXPECT_EQ(b.processes_size(), 0);
  EXPECT_FALSE(processesToProto(s, "nobody", fakeInnermost, &none));
}

// A slot's pid is verified only when the kernel's holder of the slot is that process (directly,
// or through its pid namespace); a pid a tenant wrote into its slot is not.
TEST(RpcConvert, ProcessPidsAreVerifiedAgainstTheKernelsHolder) {
  broker::BrokerSnapshot s = sampleSnapshot();
  s.tenants[0].processes = {{7, {0, 0}, 5000},      // in a container: 7 there, 5000 here
                            {5001, {0, 0}, 5001},   // no namespace
                            {1, {0, 0}, 5001},      // claims pid 1, held by 5001
                            {5002, {0, 0}, 0}};     // no holder the kernel names
  ProcessesReply r;
  ASSERT_TRUE(processesToProto(s, "team-a", fakeInnermost, &r));
  ASSERT_EQ(r.processes_size(), 4);
  EXPECT_TRUE(r.processes(0).pid_verified());
  EXPECT_EQ(r.processes(0).host_pid(), 5000);
  EXPECT_TRUE(r.processes(1).pid_verified());
  EXPECT_FALSE(r.processes(2).pid_verified());
  EXPECT_EQ(r.processes(2).host_pid(), 5001);
  EXPECT_FALSE(r.processes(3).pid_verified());
  EXPECT_EQ(r.processes(3).host_pid(), 0);
}

// ---- the client against an in-process server -------------------------------------------------

// A Unix stream socket listening at path (replacing a leftover file), with extra socket flags.
int listenUnix(const std::string& path, int flags) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | flags, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path.c_str());
  ::unlink(path.c_str());
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  EXPECT_EQ(::listen(fd, 16), 0);
  return fd;
}

// Listens on a fresh socket and answers one connection with `respond` (which gets the request
// payload and returns the raw bytes to send back).
class FakeBroker {
 public:
  explicit FakeBroker(std::function<std::string(const std::string&)> respond)
      : path_(fs::temp_directory_path() /
              ("cushare-rpc-test-" + std::to_string(::getpid()) + "-" + std::to_string(next_++))) {
    fd_ = listenUnix(path_, 0);
    thread_ = std::thread([this, respond] { serveOne(respond); });
  }
  ~FakeBroker() {
    thread_.join();
    ::close(fd_);
    ::unlink(path_.c_str());
  }
  const std::string& path() const { return path_; }

 private:
  void serveOne(const std::function<std::string(const std::string&)>& respond) {
    const int c = ::accept(fd_, nullptr, nullptr);
    if (c < 0) return;
    FrameReader reader(kMaxRequestBytes);
    std::string err;
    char buf[4096];
    FrameReader::Status s = FrameReader::kNeedMore;
    while (s == FrameReader::kNeedMore) {
      const ssize_t n = ::read(c, buf, sizeof buf);
      if (n <= 0) break;
      s = reader.feed(buf, static_cast<size_t>(n), &err);
    }
    const std::string out = respond(reader.payload());
    if (!out.empty()) {
      EXPECT_EQ(::write(c, out.data(), out.size()), static_cast<ssize_t>(out.size()));
    }
    ::close(c);
  }

  static inline std::atomic<int> next_{0};
  std::string path_;
  int fd_ = -1;
  std::thread thread_;
};

TEST(RpcCall, RoundTrip) {
  FakeBroker broker([](const std::string& payload) {
    Request req;
    std::string err;
    Response resp;
    resp.set_ok(decodeRequest(payload, &req, &err) && req.has_status());
    resp.mutable_status()->set_pid(77);
    return frame(resp);
  });
  Response resp;
  std::string err;
  ASSERT_TRUE(call(broker.path(), statusRequest(), &resp, &err)) << err;
  EXPECT_TRUE(resp.ok());
  EXPECT_EQ(resp.status().pid(), 77);
}

TEST(RpcCall, NoBroker) {
  Response resp;
  std::string err;
  EXPECT_FALSE(call("/nonexistent/cushare.sock", statusRequest(), &resp, &err));
  EXPECT_EQ(err,
            "cannot connect to the broker at /nonexistent/cushare.sock: No such file or directory "
            "(is cushare-broker running? set --socket or CUSHARE_SOCKET)");
  EXPECT_FALSE(call(std::string(200, 'x'), statusRequest(), &resp, &err));
  EXPECT_TRUE(isOneLine(err));
  EXPECT_NE(err.find("must have 1 to 107 bytes"), std::string::npos) << err;
}

TEST(RpcCall, BrokerClosesEarly) {
  FakeBroker broker([](const std::string&) {
    return std::string(
        "\x10\x00\x00\x00"
        "ab",
        6);
  });
  Response resp;
  std::string err;
  EXPECT_FALSE(call(broker.path(), statusRequest(), &resp, &err));
  EXPECT_EQ(err, "the broker closed the connection early: truncated message: got 2 of 16 bytes");
}

TEST(RpcCall, ResponseOverTheMaximum) {
  FakeBroker broker([](const std::string&) { return std::string("\x01\x00\x00\x01", 4); });
  Response resp;
  std::string err;
  EXPECT_FALSE(call(broker.path(), statusRequest(), &resp, &err));
  EXPECT_EQ(err,
            "bad response from the broker: message length 16777217 bytes exceeds the maximum of "
            "16777216 bytes");
}

TEST(RpcCall, ResponseNotAMessage) {
  FakeBroker broker([](const std::string&) { return std::string("\x02\x00\x00\x00\xff\xff", 6); });
  Response resp;
  std::string err;
  EXPECT_FALSE(call(broker.path(), statusRequest(), &resp, &err));
  EXPECT_EQ(err, "the broker's response is not a valid cushare.rpc.Response (2 bytes)");
}

TEST(RpcCall, Timeout) {
  FakeBroker broker([](const std::string&) {
    std::this_thread::sleep_for(std::chrono::milliseconds(400));
    return std::string();
  });
  Response resp;
  std::string err;
  EXPECT_FALSE(call(broker.path(), statusRequest(), &resp, &err, 100));
  EXPECT_EQ(err, "the broker did not answer within 0.1 s");
}

TEST(RpcCall, RequestOverTheMaximumIsNotSent) {
  Request r;
  r.set_version(1);
  r.mutable_env()->set_tenant(std::string(kMaxRequestBytes, 'x'));
  Response resp;
  std::string err;
  EXPECT_FALSE(call("/nonexistent/cushare.sock", r, &resp, &err));
  EXPECT_NE(err.find("more than the broker accepts (65536)"), std::string::npos) << err;
}

// A server that answers every connection at once with `answer` and closes, without reading the
// request: as the broker does when it has no slot for a client.
class RefusingServer {
 public:
  explicit RefusingServer(const Response& answer)
      : path_(fs::temp_directory_path() / ("cushare-rpc-busy-" + std::to_string(::getpid()))) {
    fd_ = listenUnix(path_, SOCK_NONBLOCK);
    thread_ = std::thread([this, bytes = frame(answer)] {
      while (!stop_) {
        pollfd p{fd_, POLLIN, 0};
        if (::poll(&p, 1, 20) != 1) continue;
        const int c = ::accept(fd_, nullptr, nullptr);
        if (c < 0) continue;
        ++connections_;
        (void)!::send(c, bytes.data(), bytes.size(), MSG_NOSIGNAL);
        ::close(c);
      }
    });
  }
  ~RefusingServer() {
    stop_ = true;
    thread_.join();
    ::close(fd_);
    ::unlink(path_.c_str());
  }
  const std::string& path() const { return path_; }
  int connections() const { return connections_; }

 private:
  std::string path_;
  int fd_ = -1;
  std::atomic<bool> stop_{false};
  std::atomic<int> connections_{0};
  std::thread thread_;
};

Response busyAnswer() {
  Response r;
  r.set_ok(false);
  r.set_busy(true);
  r.set_error("broker busy: all 64 connections are in use; try again shortly");
  return r;
}

// Without retries a busy answer is a refusal like any other, read even though the server closed
// before (or while) the request was sent.
TEST(RpcCall, BusyAnswerIsReadEvenIfTheServerClosedFirst) {
  RefusingServer server(busyAnswer());
  for (int i = 0; i < 20; ++i) {
    Response resp;
    std::string err;
    ASSERT_TRUE(call(server.path(), statusRequest(), &resp, &err)) << err;
    EXPECT_FALSE(resp.ok());
    EXPECT_TRUE(resp.busy());
    EXPECT_EQ(resp.error(), busyAnswer().error());
  }
}

// With retries, a broker that stays busy is asked again with backoff until the time is up, then
// reported busy in one line.
TEST(RpcCall, BusyIsRetriedWithBackoffThenReported) {
  RefusingServer server(busyAnswer());
  CallOptions o;
  o.busyRetryMs = 700;
  Response resp;
  std::string err;
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(call(server.path(), statusRequest(), &resp, &err, o));
  const auto took = std::chrono::steady_clock::now() - t0;
  // Tries at 0, 50, 150 and 350 ms, and a last one at 0.7 s (the 400 ms wait cut short): five,
  // or one or two fewer where a loaded host delays the tries (no backoff would make dozens, no
  // retry one).
  int tries = 0;
  ASSERT_EQ(std::sscanf(err.c_str(), (busyAnswer().error() + " (still busy after %d tries in 0.7 s)").c_str(), &tries), 1)
      << err;
  EXPECT_EQ(err, busyAnswer().error() + " (still busy after " + std::to_string(tries) + " tries in 0.7 s)");
  EXPECT_GE(tries, 3) << err;
  EXPECT_LE(tries, 5) << err;
  EXPECT_EQ(server.connections(), tries);
  EXPECT_GE(took, std::chrono::milliseconds(700));
  EXPECT_LT(took, std::chrono::milliseconds(1500));
}

// ---- corpus ----------------------------------------------------------------------------------

// tests/broker/corpus, found from this file (CMake compiles it by its absolute path).
const fs::path kCorpusDir = fs::path(__FILE__).parent_path().parent_path() / "broker" / "corpus";

std::string readFile(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST(RpcCorpus, ValidFilesDecodeAndOthersFailWithOneLine) {
  size_t valid = 0, invalid = 0;
  for (const fs::directory_entry& e : fs::directory_iterator(kCorpusDir)) {
    const std::string name = e.path().filename().string();
    const std::string bytes = readFile(e.path());
    Request req;
    std::string err;
    const bool accepted = decodeRequestFrame(bytes, &req, &err);
    const int fuzz = decodeForFuzzing(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
    EXPECT_EQ(fuzz, accepted ? 1 : 0) << name;
    if (name.starts_with("valid-")) {
      EXPECT_TRUE(accepted) << name << ": " << err;
      ++valid;
    } else {
      EXPECT_FALSE(accepted) << name;
      EXPECT_TRUE(isOneLine(err)) << name << ": '" << err << "'";
      ++invalid;
    }
  }
  EXPECT_GE(valid, 5u);
  EXPECT_GE(invalid, 25u);
}

TEST(RpcCorpus, FuzzEntryTakesAnyPrefixOfTheCorpus) {
  // Every prefix of every file: the truncations the fuzzer finds first, run here without it.
  for (const fs::directory_entry& e : fs::directory_iterator(kCorpusDir)) {
    const std::string bytes = readFile(e.path());
    for (size_t n = 0; n <= std::min<size_t>(bytes.size(), 512); ++n)
      decodeForFuzzing(reinterpret_cast<const uint8_t*>(bytes.data()), n);
  }
}

}  // namespace
}  // namespace cushare::rpc
