// A tenant's edits (broker/container/tenant_edits.h) and the CDI spec built from them
// (broker/container/cdi.h): container paths fixed whatever the host's layout, the mounts that put
// things there, and values the shim would refuse refused here.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "cushare/parse.h"
#include "container/cdi.h"
#include "container/mig_nodes.h"
#include "container/tenant_edits.h"

namespace cushare::container {
namespace {

const HostPlaces kHost = {"/opt/x/lib/libcushare.so", "/dev/shm/cushare", ""};

std::string envOf(const TenantEdits& e, const std::string& key) {
  for (const auto& [k, v] : e.env)
    if (k == key) return v;
  return "<unset>";
}

TEST(TenantEdits, ContainerPathsDoNotDependOnTheHost) {
  TenantEdits a, b;
  std::string err;
  ASSERT_TRUE(tenantEdits("alpha", kHost, View::kContainer, &a, &err)) << err;
  ASSERT_TRUE(tenantEdits("alpha", {"/usr/lib/cushare/libcushare.so", "/srv/ledgers", ""}, View::kContainer, &b, &err))
      << err;
  EXPECT_EQ(a.env, b.env) << "the environment names container paths only";
  EXPECT_EQ(a.env, (EnvVars{{"CUSHARE_TENANT", "alpha"},
                            {"CUSHARE_LEDGER_DIR", kContainerLedgerDir},
                            {"CUSHARE_REQUIRE_BROKER", "1"},
                            {"LD_PRELOAD", kContainerShim}}));
  EXPECT_EQ(a.mounts, (std::vector<Mount>{{kHost.shim, kContainerShim, true},
                                          {kHost.ledgerDir, kContainerLedgerDir, false}}));
  EXPECT_EQ(b.mounts[1].hostPath, "/srv/ledgers");
}

TEST(TenantEdits, MpsAddsThePipeDirectory) {
  TenantEdits e;
  std::string err;
  HostPlaces h = kHost;
  h.mpsPipeDir = "/run/cushare/mps-host";
  ASSERT_TRUE(tenantEdits("alpha", h, View::kContainer, &e, &err)) << err;
  EXPECT_EQ(envOf(e, "CUSHARE_MPS_PIPE_DIR"), kContainerMpsPipeDir);
  ASSERT_EQ(e.mounts.size(), 3u);
  EXPECT_EQ(e.mounts[2], (Mount{"/run/cushare/mps-host", kContainerMpsPipeDir, false}));
  EXPECT_EQ(e.env.back().first, "LD_PRELOAD");
  // On the host the shim reads the pipe directory from mps.conf: nothing to add, nothing to mount.
  ASSERT_TRUE(tenantEdits("alpha", h, View::kHost, &e, &err)) << err;
  EXPECT_EQ(envOf(e, "CUSHARE_MPS_PIPE_DIR"), "<unset>");
  EXPECT_EQ(envOf(e, "LD_PRELOAD"), kHost.shim);
  EXPECT_EQ(envOf(e, "CUSHARE_LEDGER_DIR"), kHost.ledgerDir);
  EXPECT_TRUE(e.mounts.empty());
}

// The operator's CUPTI (compute.cupti_library) is mounted read-only at the path the host segment
// names, the same as on the host; a tenant image's file there is hidden by the mount.
TEST(TenantEdits, TheOperatorsCuptiIsMountedReadOnlyAtItsOwnPath) {
  TenantEdits e;
  std::string err;
  HostPlaces h = kHost;
  h.cuptiLibrary = "/usr/local/cuda-13.0/targets/x86_64-linux/lib/libcupti.so.13";
  ASSERT_TRUE(tenantEdits("alpha", h, View::kContainer, &e, &err)) << err;
  ASSERT_EQ(e.mounts.size(), 3u);
  EXPECT_EQ(e.mounts[2], (Mount{h.cuptiLibrary, h.cuptiLibrary, true}));
  ASSERT_TRUE(tenantEdits("alpha", h, View::kHost, &e, &err)) << err;
  EXPECT_TRUE(e.mounts.empty()) << "on the host it is where the segment says";
  h.cuptiLibrary = "libcupti.so.13";
  EXPECT_FALSE(tenantEdits("alpha", h, View::kContainer, &e, &err));
  EXPECT_NE(err.find("compute.cupti_library 'libcupti.so.13' is not absolute"), std::string::npos) << err;
}

TEST(TenantEdits, RefusesWhatTheShimWouldRefuse) {
  TenantEdits e;
  std::string err;
  EXPECT_FALSE(tenantEdits("al/pha", kHost, View::kContainer, &e, &err));
  EXPECT_NE(err.find("invalid CUSHARE_TENANT='al/pha'"), std::string::npos) << err;
  EXPECT_FALSE(tenantEdits("alpha", {"/a b/libcushare.so", "/dev/shm/cushare", ""}, View::kContainer, &e, &err));
  EXPECT_NE(err.find("cannot go in LD_PRELOAD"), std::string::npos) << err;
  EXPECT_FALSE(tenantEdits("alpha", {"lib/libcushare.so", "/dev/shm/cushare", ""}, View::kContainer, &e, &err));
  EXPECT_NE(err.find("not absolute"), std::string::npos) << err;
  EXPECT_FALSE(tenantEdits("alpha", {kHost.shim, "relative", ""}, View::kContainer, &e, &err));
  EXPECT_NE(err.find("CUSHARE_LEDGER_DIR='relative'"), std::string::npos) << err;
  EXPECT_FALSE(tenantEdits("alpha", {kHost.shim, "/dev/shm/cushare", "/" + std::string(120, 'p')}, View::kContainer,
                           &e, &err));
  EXPECT_NE(err.find("at most 99"), std::string::npos) << err;
}

TEST(Cdi, DeviceNames) {
  std::string why;
  EXPECT_TRUE(validCdiDeviceName("alpha", &why));
  EXPECT_TRUE(validCdiDeviceName("a", &why));
  EXPECT_TRUE(validCdiDeviceName("team.a_b-1", &why));
  EXPECT_TRUE(validCdiDeviceName("7up", &why));
  EXPECT_FALSE(validCdiDeviceName("-x", &why));
  EXPECT_FALSE(validCdiDeviceName("x.", &why));
  EXPECT_FALSE(validCdiDeviceName("_", &why));
  EXPECT_FALSE(validCdiDeviceName("a/b", &why));
  EXPECT_FALSE(validCdiDeviceName("", &why));
  EXPECT_EQ(cdiDeviceName("alpha"), "cushare.io/tenant=alpha");
}

TEST(Cdi, TheLowestVersionThatCoversTheFields) {
  CdiSpec s;
  std::string err;
  ASSERT_TRUE(buildCdiSpec({{"alpha"}, {"beta"}}, kHost, &s, &err)) << err;
  EXPECT_EQ(s.version, "0.3.0");
  EXPECT_EQ(s.devices, (std::vector<std::string>{"alpha", "beta"}));
  EXPECT_NE(s.json.find("\"options\": [\"ro\", \"nosuid\", \"nodev\", \"bind\"]"), std::string::npos) << s.json;
  EXPECT_EQ(s.json.find("\"type\""), std::string::npos) << "a mount type needs CDI 0.4.0";
  ASSERT_TRUE(buildCdiSpec({{"alpha"}, {"9lives"}, {"x-"}}, kHost, &s, &err)) << err;
  EXPECT_EQ(s.version, "0.5.0");
  EXPECT_EQ(s.devices, (std::vector<std::string>{"alpha", "9lives"}));
  ASSERT_EQ(s.leftOut.size(), 1u);
  EXPECT_TRUE(s.leftOut[0].starts_with("x-: ")) << s.leftOut[0];
  ASSERT_TRUE(buildCdiSpec({{"x-"}}, kHost, &s, &err)) << err;
  EXPECT_TRUE(s.json.empty()) << "no device: no spec (CDI needs at least one)";
}

TEST(Cdi, PathsAreEscapedInJson) {
  CdiSpec s;
  std::string err;
  ASSERT_TRUE(buildCdiSpec({{"alpha"}}, {"/opt/q\"uote\\/libcushare.so", "/dev/shm/cushare", ""}, &s, &err)) << err;
  EXPECT_NE(s.json.find("\"hostPath\": \"/opt/q\\\"uote\\\\/libcushare.so\""), std::string::npos) << s.json;
}

// A tenant placed on MIG devices gets a device per MIG device, "<tenant>:<gpu>:<mig>", with its
// edits, CUDA_VISIBLE_DEVICES naming the MIG device (before LD_PRELOAD, which stays last) and the
// MIG device's nodes; one whose nodes are unknown is left out with the reason. Checked against the
// CDI rules by tests/containers/cdi_spec.py in broker_containers_mig.
TEST(Cdi, ATenantInMigDevicesGetsADevicePerMigDeviceWithItsNodes) {
  const std::string mig = "MIG-11111111-2222-5333-8444-555555555555";
  CdiSpec s;
  std::string err;
  ASSERT_TRUE(buildCdiSpec({{"alpha", {{"0:1", mig, {"/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap12",
                                                     "/dev/nvidia-caps/nvidia-cap13"}, ""},
                                       {"0:2", "MIG-x", {}, "no minor"}}},
                            {"beta"}},
                           kHost, &s, &err))
      << err;
  EXPECT_EQ(s.version, "0.3.0") << "deviceNodes with only a path are CDI 0.3.0";
  EXPECT_EQ(s.devices, (std::vector<std::string>{"alpha", "beta"}));
  EXPECT_EQ(s.migDevices, (std::vector<std::string>{"alpha:0:1"}));
  ASSERT_EQ(s.leftOut, (std::vector<std::string>{"alpha:0:2: no minor"}));
  const size_t at = s.json.find("\"name\": \"alpha:0:1\"");
  ASSERT_NE(at, std::string::npos) << s.json;
  const std::string dev = s.json.substr(at, s.json.find("\"name\": \"beta\"") - at);
  const size_t cvd = dev.find("\"CUDA_VISIBLE_DEVICES=" + mig + "\""), pre = dev.find("\"LD_PRELOAD=");
  ASSERT_NE(cvd, std::string::npos) << dev;
  EXPECT_LT(cvd, pre) << "LD_PRELOAD stays last";
  EXPECT_NE(dev.find("\"CUSHARE_TENANT=alpha\""), std::string::npos) << dev;
  EXPECT_NE(dev.find("\"deviceNodes\": [\n          {\"path\": \"/dev/nvidia0\"},\n          {\"path\": "
                     "\"/dev/nvidia-caps/nvidia-cap12\"},\n          {\"path\": \"/dev/nvidia-caps/nvidia-cap13\"}"),
            std::string::npos)
      << dev;
  EXPECT_EQ(s.json.find("deviceNodes", s.json.find("\"name\": \"beta\"")), std::string::npos)
      << "a tenant device carries no nodes";
  EXPECT_EQ(s.json.substr(0, at).find("deviceNodes"), std::string::npos) << "nor does alpha's own";
}

// The driver's table /proc/driver/nvidia-caps/mig-minors, written as the MIG user guide lists it
// ("config 1", "monitor 2", then per GPU and GPU instance its access line and its eight compute
// instances' lines), gives the numbers of the guide's example (GI 1 with CIs 0..2 on gpu0:
// nvidia-cap12..15) and its last line (gpu31/gi14/ci7: 4322), and agrees everywhere with the fixed
// numbering used where the file cannot be read.
TEST(MigNodes, TheDriversTableAndTheFixedNumberingAgree) {
  std::string text = "config 1\nmonitor 2\n";
  unsigned n = 3;
  for (unsigned g = 0; g < 32; ++g)
    for (unsigned gi = 0; gi < 15; ++gi) {
      text += "gpu" + std::to_string(g) + "/gi" + std::to_string(gi) + "/access " + std::to_string(n++) + "\n";
      for (unsigned ci = 0; ci < 8; ++ci)
        text += "gpu" + std::to_string(g) + "/gi" + std::to_string(gi) + "/ci" + std::to_string(ci) + "/access " +
                std::to_string(n++) + "\n";
    }
  MigMinors table, fixed;
  std::string err;
  ASSERT_TRUE(parseMigMinors(text, &table, &err)) << err;
  EXPECT_TRUE(table.fromFile);
  std::vector<std::string> nodes;
  ASSERT_TRUE(migDeviceNodes(table, 0, 1, 2, &nodes, &err)) << err;
  EXPECT_EQ(nodes, (std::vector<std::string>{"/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap12",
                                             "/dev/nvidia-caps/nvidia-cap15"}));
  unsigned a = 0, b = 0;
  ASSERT_TRUE(migCapMinor(table, 31, 14, 7, &a, &err)) << err;
  EXPECT_EQ(a, 4322u);
  for (unsigned g = 0; g < 32; ++g)
    for (unsigned gi = 0; gi < 15; ++gi)
      for (int ci = -1; ci < 8; ++ci) {
        ASSERT_TRUE(migCapMinor(table, g, gi, ci, &a, &err)) << err;
        ASSERT_TRUE(migCapMinor(fixed, g, gi, ci, &b, &err)) << err;
        ASSERT_EQ(a, b) << g << "/" << gi << "/" << ci;
      }
  EXPECT_FALSE(migCapMinor(fixed, 32, 0, 0, &a, &err)) << "no GPU 32 in the driver's numbering";
  EXPECT_FALSE(migCapMinor(fixed, 0, 15, -1, &a, &err));
  EXPECT_FALSE(migCapMinor(fixed, 0, 0, 8, &a, &err));
  EXPECT_NE(err.find("gpu0/gi0/ci8/access"), std::string::npos) << err;
  // A table read from a driver is believed over the numbering: a GPU it does not list has no node.
  ASSERT_TRUE(parseMigMinors("config 1\ngpu0/gi0/access 40\ngpu0/gi0/ci0/access 41\nfuture-key 9\n", &table, &err));
  ASSERT_TRUE(migDeviceNodes(table, 0, 0, 0, &nodes, &err)) << err;
  EXPECT_EQ(nodes[1], "/dev/nvidia-caps/nvidia-cap40");
  EXPECT_FALSE(migDeviceNodes(table, 1, 0, 0, &nodes, &err));
  EXPECT_NE(err.find("has no gpu1/gi0/access"), std::string::npos) << err;
}

TEST(MigNodes, ADamagedTableIsRefusedWhole) {
  MigMinors t;
  std::string err;
  EXPECT_FALSE(parseMigMinors("config 1\ngpu0/gi0/access\n", &t, &err));
  EXPECT_NE(err.find("line 2"), std::string::npos) << err;
  EXPECT_FALSE(parseMigMinors("gpu0/gi0/access x3\n", &t, &err));
  EXPECT_FALSE(parseMigMinors("gpu0/gi0/access 3 4\n", &t, &err));
  EXPECT_FALSE(parseMigMinors("gpu0/gi0/access 99999999\n", &t, &err));
  EXPECT_FALSE(parseMigMinors("gpu0/gi0/access 3\ngpu0/gi0/access 4\n", &t, &err));
  EXPECT_NE(err.find("again"), std::string::npos) << err;
  // Missing: the fixed numbering; present: parsed; damaged: refused with the path.
  const std::string dir = std::filesystem::temp_directory_path() / ("cushare-minors-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  ASSERT_TRUE(loadMigMinors(dir + "/absent", &t, &err)) << err;
  EXPECT_FALSE(t.fromFile);
  std::ofstream(dir + "/good") << "config 1\nmonitor 2\ngpu0/gi0/access 3\n";
  ASSERT_TRUE(loadMigMinors(dir + "/good", &t, &err)) << err;
  EXPECT_TRUE(t.fromFile);
  EXPECT_EQ(t.minors.at("gpu0/gi0/access"), 3u);
  std::ofstream(dir + "/bad") << "config one\n";
  EXPECT_FALSE(loadMigMinors(dir + "/bad", &t, &err));
  EXPECT_NE(err.find(dir + "/bad: line 1"), std::string::npos) << err;
  std::filesystem::remove_all(dir);
}

// The escaper the spec and the CLI's --json share (cushare/parse.h).
TEST(Cdi, JsonQuotedEscapesQuotesBackslashesAndControls) {
  EXPECT_EQ(cushare::jsonQuoted("plain"), "\"plain\"");
  EXPECT_EQ(cushare::jsonQuoted("a\"b\\c"), "\"a\\\"b\\\\c\"");
  EXPECT_EQ(cushare::jsonQuoted(std::string("\n\x01\x7f", 3)), "\"\\u000a\\u0001\\u007f\"");
  EXPECT_EQ(cushare::jsonQuoted("\xc3\xa9"), "\"\xc3\xa9\"") << "UTF-8 passes through";
}

TEST(Cdi, WritesAtomicallyAndRemoves) {
  const std::string dir = std::filesystem::temp_directory_path() / ("cushare-cdi-unit-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::string err;
  ASSERT_TRUE(writeCdiSpec(dir + "/a/b", "{}\n", &err)) << err;
  std::ifstream in(dir + "/a/b/" + kCdiSpecFile);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, "{}\n");
  ASSERT_TRUE(writeCdiSpec(dir + "/a/b", "{\"x\": 1}\n", &err)) << err;
  int files = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir + "/a/b")) ++files;
  EXPECT_EQ(files, 1) << "no temporary left";
  EXPECT_TRUE(removeCdiSpec(dir + "/a/b", &err)) << err;
  EXPECT_TRUE(removeCdiSpec(dir + "/a/b", &err)) << "gone already is fine";
  std::ofstream(dir + "/file") << "x";
  EXPECT_FALSE(writeCdiSpec(dir + "/file/cdi", "{}", &err));
  EXPECT_NE(err.find("cannot create " + dir + "/file/cdi"), std::string::npos) << err;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace cushare::container
