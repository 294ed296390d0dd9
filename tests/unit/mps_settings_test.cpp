// The broker's MPS settings files and the client environment the shim derives from them
// (common/include/cushare/mps_settings.h), and the mps: block of the broker's configuration.
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <map>

#include "config/config.h"
#include "cushare/mps_settings.h"

namespace cushare {
namespace {

const std::string kUuid = "GPU-11111111-2222-3333-4444-555555555555";
const std::string kUuid2 = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee";
constexpr uint64_t kMiB = 1ull << 20;

MpsHostSettings host() {
  MpsHostSettings h;
  h.pipeDir = "/run/cushare/mps";
  h.contextReserve = 256 * kMiB;
  return h;
}

MpsTenantSettings tenant(std::optional<int> threads, Priority p = Priority::kNormal) {
  MpsTenantSettings t;
  t.threads = threads;
  t.priority = p;
  t.memory = {{kUuid, 1024 * kMiB}, {kUuid2, kUnlimited}};
  return t;
}

bool clientEnv(const MpsHostSettings& h, const MpsTenantSettings& t, const std::map<std::string, std::string>& env,
               MpsClientEnv* out, std::string* err, ShimConfig c = {}) {
  return mpsClientEnv(
      h, t, c, [&](const char* n) { return env.count(n) ? env.at(n).c_str() : nullptr; }, out, err);
}

TEST(MpsSettings, RoundTrip) {
  MpsHostSettings h = host();
  h.unknown = tenant(25, Priority::kLow);
  MpsHostSettings back;
  std::string err;
  ASSERT_TRUE(parseMpsHost(formatMpsHost(h), "mps.conf", &back, &err)) << err;
  EXPECT_EQ(back.pipeDir, h.pipeDir);
  EXPECT_EQ(back.contextReserve, h.contextReserve);
  ASSERT_TRUE(back.unknown);
  EXPECT_EQ(back.unknown->threads, 25);
  EXPECT_EQ(back.unknown->priority, Priority::kLow);
  ASSERT_EQ(back.unknown->memory.size(), 1u) << "an unlimited device is not written";
  EXPECT_EQ(back.unknown->memory[0].second, 1024 * kMiB);
  MpsTenantSettings t;
  ASSERT_TRUE(parseMpsTenant(formatMpsTenant(tenant(std::nullopt)), "a.mps", &t, &err)) << err;
  EXPECT_FALSE(t.threads);
  EXPECT_EQ(t.memory.size(), 1u);
}

TEST(MpsSettings, EveryDamageIsRefusedWithItsLine) {
  const std::string good = formatMpsTenant(tenant(30));
  const std::pair<std::string, std::string> cases[] = {
      {"", "the first setting must be 'format 1'"},
      {"format 2\nthreads 30\npriority normal\n", "format '2' is not 1"},
      {"format 1\nthreads 101\npriority normal\n", "a.mps:2: threads:"},
      {"format 1\nthreads 30\npriority urgent\n", "a.mps:3: priority:"},
      {"format 1\nthreads 30\npriority normal\nmemory GPU-12 5\n", "a.mps:4: memory: expected 'GPU-<uuid> <bytes>'"},
      {"format 1\nthreads 30\npriority normal\nmemory " + kUuid + " -5\n", "a.mps:4: memory:"},
      {"format 1\nthreads 30\nthreads 40\npriority normal\n", "a.mps:3: threads: set twice"},
      {"format 1\nthreads 30\n", "missing priority"},
      {"format 1\nthreads 30\npriority normal\ncolour red\n", "a.mps:4: colour: unknown setting"},
      {good.substr(0, good.size() - 1), "the last line has no newline"},
      {"format 1\nthreads\t30\npriority normal\n", "a control character"},
  };
  for (const auto& [text, message] : cases) {
    MpsTenantSettings t;
    std::string err;
    EXPECT_FALSE(parseMpsTenant(text, "a.mps", &t, &err)) << text;
    EXPECT_NE(err.find(message), std::string::npos) << err;
  }
  MpsHostSettings h;
  std::string err;
  EXPECT_FALSE(parseMpsHost("format 1\npipe_dir relative\ncontext_reserve 0\nunknown_tenants refuse\n", "m", &h, &err));
  EXPECT_NE(err.find("m:2: pipe_dir: expected an absolute path"), std::string::npos) << err;
  EXPECT_FALSE(parseMpsHost("format 1\npipe_dir /p\ncontext_reserve 0\nunknown_tenants refuse\nunknown_threads 5\n", "m",
                            &h, &err));
  EXPECT_NE(err.find("unknown_* settings while unknown_tenants is refuse"), std::string::npos) << err;
  EXPECT_FALSE(parseMpsHost("format 1\npipe_dir /p\nunknown_tenants refuse\n", "m", &h, &err));
  EXPECT_NE(err.find("missing context_reserve"), std::string::npos) << err;
}

TEST(MpsSettings, OnlyTheDirectoryOwnersFileIsRead) {
  char tmpl[] = "/tmp/mps-settings-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  MpsHostSettings h;
  std::string err;
  EXPECT_EQ(readMpsHost(dir, &h, &err), 0) << "absent: MPS off";
  EXPECT_EQ(readMpsHost(dir + "/not-yet", &h, &err), 0) << "no directory yet (standalone): MPS off";
  ASSERT_TRUE(writeMpsFile(dir, kMpsHostFile, formatMpsHost(host()), &err)) << err;
  EXPECT_EQ(readMpsHost(dir, &h, &err), 1) << err;
  ::chmod((dir + "/" + kMpsHostFile).c_str(), 0666);
  EXPECT_EQ(readMpsHost(dir, &h, &err), -1);
  EXPECT_NE(err.find("was not written by the broker"), std::string::npos) << err;
  ::chmod((dir + "/" + kMpsHostFile).c_str(), 0644);
  if (::geteuid() == 0) {
    // Another user's entry (anyone may create one in a sticky directory when unknown tenants are
    // admitted) is not the broker's word: as good as absent, never a reason to refuse every process.
    ASSERT_EQ(::chown((dir + "/" + kMpsHostFile).c_str(), 65534, 65534), 0);
    EXPECT_EQ(readMpsHost(dir, &h, &err), 0) << "another user's file is ignored";
    ::unlink((dir + "/" + kMpsHostFile).c_str());
    ASSERT_EQ(::mkfifo((dir + "/" + kMpsHostFile).c_str(), 0644), 0);
    ASSERT_EQ(::lchown((dir + "/" + kMpsHostFile).c_str(), 65534, 65534), 0);
    EXPECT_EQ(readMpsHost(dir, &h, &err), 0) << "another user's FIFO is ignored, and never blocks";
    ASSERT_EQ(::symlink("/etc/passwd", (dir + "/u.mps").c_str()), 0);
    ASSERT_EQ(::lchown((dir + "/u.mps").c_str(), 65534, 65534), 0);
    MpsTenantSettings u;
    EXPECT_EQ(readMpsTenant(dir, "u", &u, &err), 0) << "another user's link is ignored";
  }
  ::unlink((dir + "/" + kMpsHostFile).c_str());
  ASSERT_EQ(::symlink("/etc/passwd", (dir + "/t.mps").c_str()), 0);
  MpsTenantSettings t;
  EXPECT_EQ(readMpsTenant(dir, "t", &t, &err), -1) << "a link is not followed";
  std::system(("rm -rf " + dir).c_str());
}

TEST(MpsSettings, TheClientEnvironmentOnlyLowers) {
  MpsClientEnv e;
  std::string err;
  ASSERT_TRUE(clientEnv(host(), tenant(30, Priority::kLow), {}, &e, &err)) << err;
  EXPECT_EQ(e.pipeDir, "/run/cushare/mps");
  EXPECT_EQ(e.threads, "30");
  EXPECT_EQ(e.priority, "1");
  EXPECT_EQ(e.pinnedMem, kUuid + "=1280M") << "limit plus reserve; the unlimited device is left out";
  // The process's own values win only where lower.
  ASSERT_TRUE(clientEnv(host(), tenant(30),
                        {{"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "12.5"},
                         {"CUDA_MPS_CLIENT_PRIORITY", "1"},
                         {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", kUuid + "=1G," + kUuid2 + "=512MB"}},
                        &e, &err))
      << err;
  EXPECT_EQ(e.threads, "12.5");
  EXPECT_EQ(e.priority, "1");
  EXPECT_EQ(e.pinnedMem, kUuid + "=1024M," + kUuid2 + "=512M");
  ASSERT_TRUE(clientEnv(host(), tenant(30),
                        {{"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "90"},
                         {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", kUuid + "=8G"}},
                        &e, &err));
  EXPECT_EQ(e.threads, "30");
  EXPECT_EQ(e.pinnedMem, kUuid + "=1280M");
  // CUSHARE_THREAD_PERCENTAGE and CUSHARE_PRIORITY lower too.
  ShimConfig c;
  c.threadPercentage = 10;
  c.priority = Priority::kLow;
  ASSERT_TRUE(clientEnv(host(), tenant(std::nullopt), {}, &e, &err, c));
  EXPECT_EQ(e.threads, "10");
  EXPECT_EQ(e.priority, "1");
  ASSERT_TRUE(clientEnv(host(), tenant(std::nullopt), {}, &e, &err));
  EXPECT_EQ(e.threads, "") << "no cap: the server's percentage";
  EXPECT_EQ(e.priority, "0");
}

TEST(MpsSettings, MalformedClientValuesFailClosed) {
  MpsClientEnv e;
  std::string err;
  const std::pair<std::map<std::string, std::string>, std::string> cases[] = {
      {{{"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "0"}}, "invalid CUDA_MPS_ACTIVE_THREAD_PERCENTAGE='0'"},
      {{{"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "half"}}, "invalid CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"},
      {{{"CUDA_MPS_CLIENT_PRIORITY", "2"}}, "invalid CUDA_MPS_CLIENT_PRIORITY='2'"},
      {{{"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=1G"}}, "name each device by its full UUID"},
      {{{"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", kUuid + "=lots"}}, "is not a size such as 1G"},
      {{{"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", kUuid}}, "is not <device>=<size>"},
  };
  for (const auto& [env, message] : cases) {
    EXPECT_FALSE(clientEnv(host(), tenant(30), env, &e, &err)) << message;
    EXPECT_NE(err.find(message), std::string::npos) << err;
  }
}

// MIG devices, each with a daemon of its own at <pipe_dir>/<uuid> (docs/mig.md): the process's
// first MIG- entry of CUDA_VISIBLE_DEVICES picks it (by UUID or the legacy GPU/GI/CI form), with
// that MIG device's pinned limit only; a MIG device without a daemon fails closed; a process on
// whole GPUs keeps pipe_dir and the whole GPUs' limits.
TEST(MpsSettings, AMigDevicesProcessIsItsOwnDaemonsClient) {
  const std::string migA = "MIG-0a0a0a0a-0000-5000-8000-000000000001", migB = "MIG-0b0b0b0b-0000-5000-8000-000000000002";
  MpsHostSettings h = host();
  h.mig = {{migA, kUuid, 1, 0}, {migB, kUuid, 13, 0}};
  MpsHostSettings back;
  std::string err;
  ASSERT_TRUE(parseMpsHost(formatMpsHost(h), "mps.conf", &back, &err)) << err;
  ASSERT_EQ(back.mig.size(), 2u);
  EXPECT_EQ(back.mig[1].uuid, migB);
  EXPECT_EQ(back.mig[1].gi, 13u);
  EXPECT_TRUE(back.wholeGpus);
  h.wholeGpus = false;
  ASSERT_TRUE(parseMpsHost(formatMpsHost(h), "mps.conf", &back, &err)) << err;
  EXPECT_FALSE(back.wholeGpus);
  MpsTenantSettings t = tenant(30);
  t.memory.emplace_back(migA, 512 * kMiB);
  t.memory.emplace_back(migB, 2048 * kMiB);
  MpsTenantSettings tb;
  ASSERT_TRUE(parseMpsTenant(formatMpsTenant(t), "a.mps", &tb, &err)) << err;
  ASSERT_EQ(tb.memory.size(), 3u) << "MIG devices' limits are kept";
  EXPECT_EQ(tb.memory[1].first, migA);

  MpsClientEnv e;
  // A host of MIG devices only: a process that names none would run outside MPS.
  EXPECT_FALSE(clientEnv(h, t, {{"CUDA_VISIBLE_DEVICES", kUuid}}, &e, &err));
  EXPECT_NE(err.find("this host's devices are MIG devices, each with its own MPS control daemon, and "
                     "CUDA_VISIBLE_DEVICES names none"),
            std::string::npos)
      << err;
  EXPECT_FALSE(clientEnv(h, t, {}, &e, &err)) << "unset: the driver would pick a MIG device";
  h.wholeGpus = true;  // whole GPUs beside the MIG devices
  ASSERT_TRUE(clientEnv(h, t, {{"CUDA_VISIBLE_DEVICES", migB}}, &e, &err)) << err;
  EXPECT_EQ(e.pipeDir, "/run/cushare/mps/" + migB);
  EXPECT_EQ(e.pinnedMem, migB + "=2304M") << "its MIG device's limit plus the reserve, nothing else";
  ASSERT_TRUE(clientEnv(h, t, {{"CUDA_VISIBLE_DEVICES", " mig-0A0A0A0A-0000-5000-8000-000000000001 ,0"}}, &e, &err)) << err;
  EXPECT_EQ(e.pipeDir, "/run/cushare/mps/" + migA) << "any case, trimmed, the first MIG entry";
  ASSERT_TRUE(clientEnv(h, t, {{"CUDA_VISIBLE_DEVICES", "MIG-" + kUuid + "/13/0"}}, &e, &err)) << err;
  EXPECT_EQ(e.pipeDir, "/run/cushare/mps/" + migB) << "the legacy MIG-<GPU-UUID>/<gi>/<ci>";
  ASSERT_TRUE(clientEnv(h, t, {{"CUDA_VISIBLE_DEVICES", kUuid}}, &e, &err)) << err;
  EXPECT_EQ(e.pipeDir, "/run/cushare/mps");
  EXPECT_EQ(e.pinnedMem, kUuid + "=1280M") << "the whole GPUs' limits only";
  ASSERT_TRUE(clientEnv(h, t, {{"CUDA_VISIBLE_DEVICES", migA}, {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", migA + "=256M"}},
                        &e, &err))
      << err;
  EXPECT_EQ(e.pinnedMem, migA + "=256M") << "its own lower value wins";
  const std::pair<std::map<std::string, std::string>, std::string> refused[] = {
      {{{"CUDA_VISIBLE_DEVICES", "MIG-0c0c0c0c-0000-5000-8000-000000000003"}}, "for which the broker runs no MPS control daemon"},
      {{{"CUDA_VISIBLE_DEVICES", "MIG-" + kUuid + "/14/0"}}, "for which the broker runs no MPS control daemon"},
      {{{"CUDA_VISIBLE_DEVICES", migA}, {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", migB + "=1G"}},
       "is not the MIG device this process runs in"},
      {{{"CUDA_VISIBLE_DEVICES", migA}, {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", kUuid + "=1G"}},
       "this process runs in the MIG device " + migA},
      {{{"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", migA + "=1G"}}, "it names none in CUDA_VISIBLE_DEVICES"},
  };
  for (const auto& [env, message] : refused) {
    EXPECT_FALSE(clientEnv(h, t, env, &e, &err)) << message;
    EXPECT_NE(err.find(message), std::string::npos) << err;
  }
  // Damage: a bad mig_daemon line, one listed twice, a pipe_dir too long for MIG sockets.
  const std::string base = formatMpsHost(host());
  for (const auto& [text, message] : std::vector<std::pair<std::string, std::string>>{
           {base + "mig_daemon " + migA + " " + kUuid + " 1\n", "expected MIG-<uuid> GPU-<uuid>"},
           {base + "mig_daemon " + kUuid + " " + kUuid + " 1 0\n", "expected MIG-<uuid> GPU-<uuid>"},
           {base + "mig_daemon " + migA + " " + kUuid + " 15 0\n", "expected MIG-<uuid> GPU-<uuid>"},
           {base + "mig_daemon " + migA + " " + kUuid + " 1 0\nmig_daemon " + migA + " " + kUuid + " 2 0\n", "listed twice"},
           {base + "whole_gpus maybe\n", "expected 'yes' or 'no'"},
       }) {
    EXPECT_FALSE(parseMpsHost(text, "mps.conf", &back, &err)) << message;
    EXPECT_NE(err.find(message), std::string::npos) << err;
  }
  MpsHostSettings longPipe = h;
  longPipe.pipeDir = "/" + std::string(70, 'p');
  EXPECT_FALSE(parseMpsHost(formatMpsHost(longPipe), "mps.conf", &back, &err));
  EXPECT_NE(err.find("leave room for a MIG device's daemon"), std::string::npos) << err;
}

TEST(MpsConfig, DefaultsAndValues) {
  broker::Config c;
  std::string err;
  ASSERT_TRUE(broker::parseConfig("{}\n", "c.yaml", &c, &err)) << err;
  EXPECT_EQ(c.mps.mode, broker::MpsConfig::Mode::kOff);
  EXPECT_EQ(c.mps.pipeDir, "/run/cushare/mps");
  EXPECT_EQ(c.mps.logDir, "/var/log/cushare/mps");
  EXPECT_EQ(c.mps.contextReserve, 512 * kMiB);
  EXPECT_TRUE(c.mps.control.empty());
  ASSERT_TRUE(broker::parseConfig("mps:\n  mode: auto\n  control: my-mps-control\n  pipe_dir: /p/\n  log_dir: /l\n"
                                  "  context_reserve: 1GiB\n",
                                  "c.yaml", &c, &err))
      << err;
  EXPECT_EQ(c.mps.mode, broker::MpsConfig::Mode::kAuto);
  EXPECT_EQ(c.mps.control, "my-mps-control");
  EXPECT_EQ(c.mps.pipeDir, "/p");
  EXPECT_EQ(c.mps.contextReserve, 1024 * kMiB);
  EXPECT_FALSE(broker::parseConfig("mps:\n  pipe_dir: /same\n  log_dir: /same\n", "c.yaml", &c, &err));
  EXPECT_NE(err.find("mps: pipe_dir and log_dir are the same directory"), std::string::npos) << err;
}

// In a container the pipe directory is mounted elsewhere: CUSHARE_MPS_PIPE_DIR names it there.
TEST(MpsSettings, PipeDirOfTheProcessView) {
  MpsClientEnv e;
  std::string err;
  ASSERT_TRUE(clientEnv(host(), tenant(50), {}, &e, &err)) << err;
  EXPECT_EQ(e.pipeDir, host().pipeDir);
  ShimConfig c;
  c.mpsPipeDir = "/run/cushare/mps-in-container";
  ASSERT_TRUE(clientEnv(host(), tenant(50), {}, &e, &err, c)) << err;
  EXPECT_EQ(e.pipeDir, "/run/cushare/mps-in-container");
  EXPECT_EQ(e.threads, "50");
}

// Where the broker published its pipe directory's identity, CUSHARE_MPS_PIPE_DIR must name that
// same directory (a bind mount keeps device and inode): a directory of the process's own choosing
// would take it out of MPS, so it is refused. The identity survives mps.conf's format and parser.
TEST(MpsSettings, APipeDirOfTheProcessesOwnChoosingIsRefused) {
  char real[] = "/tmp/cushare-pipe-XXXXXX", other[] = "/tmp/cushare-pipe-XXXXXX";
  ASSERT_NE(::mkdtemp(real), nullptr);
  ASSERT_NE(::mkdtemp(other), nullptr);
  struct stat st{};
  ASSERT_EQ(::stat(real, &st), 0);
  MpsHostSettings h = host();
  h.pipeDir = real;
  h.pipeDev = static_cast<uint64_t>(st.st_dev);
  h.pipeIno = static_cast<uint64_t>(st.st_ino);
  MpsHostSettings back;
  std::string err;
  ASSERT_TRUE(parseMpsHost(formatMpsHost(h), "mps.conf", &back, &err)) << err;
  EXPECT_EQ(back.pipeDev, h.pipeDev);
  EXPECT_EQ(back.pipeIno, h.pipeIno);
  MpsClientEnv e;
  ShimConfig c;
  c.mpsPipeDir = real;  // the same directory (as a bind mount shows it)
  EXPECT_TRUE(clientEnv(back, tenant(50), {}, &e, &err, c)) << err;
  c.mpsPipeDir = other;  // a directory of its own
  EXPECT_FALSE(clientEnv(back, tenant(50), {}, &e, &err, c));
  EXPECT_NE(err.find("is not the broker's MPS pipe directory"), std::string::npos) << err;
  c.mpsPipeDir = std::string(real) + "/missing";
  EXPECT_FALSE(clientEnv(back, tenant(50), {}, &e, &err, c));
  for (const char* bad : {"pipe_id 12\n", "pipe_id a:b\n", "pipe_id 1:0\n"}) {
    std::string text = formatMpsHost(host());
    text.insert(text.find("context_reserve"), bad);
    EXPECT_FALSE(parseMpsHost(text, "mps.conf", &back, &err)) << bad;
    EXPECT_NE(err.find("pipe_id") == std::string::npos ? err.find("expected <device>:<inode>") : 0, std::string::npos)
        << err;
  }
  ::rmdir(real);
  ::rmdir(other);
}

}  // namespace
}  // namespace cushare
