// simgpu's MIG (simgpu/src/mig.h, simgpu/nvml/nvml_mig.cpp, docs/simgpu.md "MIG"): the profile
// tables against NVIDIA's published numbers and naming rule, the placement and ID rules of the MIG
// guide, and NVML's MIG API as NVIDIA's tools use it, seen alike by other processes (simgpu-smi)
// and refused to other users. One program, two simulated hosts: an H100 (a mode change applies at
// once) and an A100-40GB (it waits for a GPU reset); each ctest run selects its suites.
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <regex>
#include <string>

#include "config.h"
#include "mig.h"
#include "simgpu/nvml.h"

namespace {

using namespace simgpu;

std::string run(const std::string& cmd, int* rc) {
  std::string out;
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  char buf[4096];
  size_t n;
  while (p && (n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int st = p ? ::pclose(p) : -1;
  *rc = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return out;
}

std::string smi(const std::string& args, int* rc) { return run(std::string(SIMGPU_SMI) + " " + args, rc); }

bool has(const std::string& text, const std::string& pattern) { return std::regex_search(text, std::regex(pattern)); }

// ---- The tables (no NVML) ----

// go-nvlib names a profile from NVML's numbers; each table's memory must give the documented name.
TEST(MigTables, EveryProfileIsNamedAsNvidiasToolsDeriveIt) {
  for (const char* key : {"a100-40gb", "a100-80gb", "h100-80gb", "h200"}) {
    const mig::Model* m = mig::findModel(key);
    ASSERT_NE(m, nullptr) << key;
    EXPECT_EQ(m->gi.size(), 7u) << key;
    for (const mig::GiProfile& p : m->gi) {
      std::string name = p.name;
      if (const size_t plus = name.find('+'); plus != std::string::npos) name.resize(plus);
      EXPECT_EQ(mig::derivedName(p.slices, p.memoryMiB, m->memoryMiB), name) << key << " " << p.name;
      EXPECT_LE(p.memoryMiB, m->memoryMiB);
      EXPECT_LE(p.sms, m->sms);
    }
  }
  EXPECT_EQ(mig::findModel("v100"), nullptr);
}

// Profile IDs and indexes as `nvidia-smi mig -lgip` and nvml.h give them, and the placements of
// `-lgipp` (the same on every model the guide lists).
TEST(MigTables, IdsIndexesAndPlacements) {
  const mig::Model& m = *mig::findModel("h100-80gb");
  const struct {
    unsigned index, id, memSlices, instances;
    std::vector<unsigned> starts;
  } want[] = {{0, 19, 1, 7, {0, 1, 2, 3, 4, 5, 6}}, {7, 20, 1, 1, {0, 1, 2, 3, 4, 5, 6}}, {9, 15, 2, 4, {0, 2, 4, 6}},
              {1, 14, 2, 3, {0, 2, 4}},           {2, 9, 4, 2, {0, 4}},                 {3, 5, 4, 1, {0}},
              {4, 0, 8, 1, {0}}};
  for (const auto& w : want) {
    const mig::GiProfile* p = mig::giProfileByIndex(m, w.index);
    ASSERT_NE(p, nullptr) << w.index;
    EXPECT_EQ(p->id, w.id);
    EXPECT_EQ(p->memSlices, w.memSlices);
    EXPECT_EQ(p->instances, w.instances);
    EXPECT_EQ(p->starts, w.starts);
  }
  for (unsigned missing : {5u, 6u, 8u, 10u, 17u}) EXPECT_EQ(mig::giProfileByIndex(m, missing), nullptr) << missing;
  // GI IDs: the MIG guide's examples (1g at 0:1 -> 7, at 6:1 -> 13; 2g at 2:2 -> 4, 4:2 -> 5).
  EXPECT_EQ(mig::giIdFor(0, 1), 7u);
  EXPECT_EQ(mig::giIdFor(6, 1), 13u);
  EXPECT_EQ(mig::giIdFor(2, 2), 4u);
  EXPECT_EQ(mig::giIdFor(4, 2), 5u);
  EXPECT_EQ(mig::giIdFor(0, 8), 0u);
  // CI profiles inside a 7g: 1c, 2c, 3c, 4c, 7c; inside a 4g: 1c, 2c, 4c; a 3g: 1c, 2c, 3c.
  auto cis = [&](unsigned id) {
    std::string out;
    for (unsigned i = 0; i < 5; ++i) {
      mig::CiProfile c;
      if (mig::ciProfile(*mig::giProfileById(m, id), i, &c)) out += std::to_string(c.slices) + "c ";
    }
    return out;
  };
  EXPECT_EQ(cis(0), "1c 2c 3c 4c 7c ");
  EXPECT_EQ(cis(5), "1c 2c 4c ");
  EXPECT_EQ(cis(9), "1c 2c 3c ");
  EXPECT_EQ(cis(14), "1c 2c ");
  EXPECT_EQ(cis(19), "1c ");
}

// The MIG guide: on an A100, `-cgi 19,19,14,9` fails on the 3g while `-cgi 9,19,14,19` succeeds,
// and the first default-placed 1g lands in slot 6.
TEST(MigTables, DefaultPlacementsFollowTheGuide) {
  const mig::Model& m = *mig::findModel("a100-40gb");
  auto create = [&](mig::DeviceMig& d, unsigned id) {
    const mig::GiProfile& p = *mig::giProfileById(m, id);
    const int s = mig::defaultStart(d, p);
    if (s < 0 || !mig::fits(m, d, p, static_cast<unsigned>(s))) return -1;
    mig::addGi(d, p, static_cast<unsigned>(s));
    return s;
  };
  mig::DeviceMig bad{};
  bad.current = 1;
  EXPECT_EQ(create(bad, 19), 6);
  EXPECT_GE(create(bad, 19), 0);
  EXPECT_GE(create(bad, 14), 0);
  EXPECT_EQ(create(bad, 9), -1);
  mig::DeviceMig good{};
  good.current = 1;
  for (unsigned id : {9u, 19u, 14u, 19u}) EXPECT_GE(create(good, id), 0) << id;
  // A full GPU: seven 1g, nothing more; and the remaining-capacity count agrees.
  mig::DeviceMig full{};
  full.current = 1;
  EXPECT_EQ(mig::remaining(m, full, *mig::giProfileById(m, 19)), 7u);
  for (int i = 0; i < 7; ++i) EXPECT_GE(create(full, 19), 0);
  EXPECT_EQ(create(full, 19), -1);
  EXPECT_EQ(mig::remaining(m, full, *mig::giProfileById(m, 19)), 0u);
  EXPECT_EQ(mig::remaining(m, good, *mig::giProfileById(m, 19)), 0u) << "3 + 1 + 2 + 1: all 7 compute slices";
}

// The state file is shared by every user of the simulated host: an entry the code would never
// write (an ID that is not its index, a placement off the axis) is refused whole, with the file named.
TEST(MigTables, AMalformedStateFileIsRefused) {
  char tmpl[] = "/tmp/simgpu-mig-test-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  std::string err;
  ASSERT_TRUE(mig::update(dir, [](mig::State* s) { s->dev[0].current = s->dev[0].pending = 1; return true; }, &err))
      << err;
  mig::State st;
  ASSERT_TRUE(mig::load(dir, &st, &err)) << err;
  EXPECT_EQ(st.dev[0].current, 1u);
  for (int bad = 0; bad < 3; ++bad) {
    mig::State b = st;
    if (bad == 0) b.dev[0].gi[3] = {1, 9, 19, 0, 1, {}};   // ID 9 at index 3
    if (bad == 1) b.dev[0].gi[7] = {1, 7, 19, 7, 4, {}};   // memory slices 7..10
    if (bad == 2) b.dev[0].gi[7] = {1, 7, 19, 0, 1, {}}, b.dev[0].gi[7].ci[0] = {1, 0, 9, 0, 1};  // CI profile 9
    FILE* f = std::fopen((dir + "/mig").c_str(), "r+b");
    ASSERT_NE(f, nullptr);
    ASSERT_EQ(std::fwrite(&b, sizeof b, 1, f), 1u);
    std::fclose(f);
    EXPECT_FALSE(mig::load(dir, &st, &err)) << bad;
    EXPECT_NE(err.find(dir + "/mig is not a MIG state file of this simgpu"), std::string::npos) << err;
    EXPECT_FALSE(mig::update(dir, [](mig::State*) { return true; }, &err)) << bad;
  }
  std::remove((dir + "/mig").c_str());
  ::rmdir(dir.c_str());
}

TEST(MigTables, TheModelVariableIsCheckedAndExclusive) {
  const char* was = std::getenv("SIMGPU_GPU_MODEL");
  const std::string before = was ? was : "";
  Config c;
  std::string err;
  ::setenv("SIMGPU_GPU_MODEL", "v100", 1);
  EXPECT_FALSE(loadConfig(&c, &err));
  EXPECT_NE(err.find("SIMGPU_GPU_MODEL='v100': not a model simgpu knows (a100-40gb, a100-80gb, h100-80gb, h200)"),
            std::string::npos)
      << err;
  ::setenv("SIMGPU_GPU_MODEL", "h200", 1);
  ::setenv("SIMGPU_MEMORY", "8GiB", 1);
  c = Config{};
  EXPECT_FALSE(loadConfig(&c, &err));
  EXPECT_NE(err.find("sets the memory itself; unset SIMGPU_MEMORY"), std::string::npos) << err;
  ::unsetenv("SIMGPU_MEMORY");
  c = Config{};
  ASSERT_TRUE(loadConfig(&c, &err)) << err;
  EXPECT_EQ(c.name, "NVIDIA H200");
  EXPECT_EQ(c.memory[0], 143771ull << 20);
  EXPECT_EQ(c.smCount, 132u);
  if (was) ::setenv("SIMGPU_GPU_MODEL", before.c_str(), 1);
  else ::unsetenv("SIMGPU_GPU_MODEL");
}

// ---- NVML on an H100 (SIMGPU_GPU_MODEL=h100-80gb) ----

class NvmlMig : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(nvmlInit_v2(), NVML_SUCCESS);
    ASSERT_EQ(nvmlDeviceGetHandleByIndex_v2(0, &dev), NVML_SUCCESS);
  }
  void TearDown() override {
    // Back to MIG off with nothing in it, for the next test.
    int rc;
    smi("mig -dgi", &rc);
    nvmlReturn_t act;
    nvmlDeviceSetMigMode(dev, NVML_DEVICE_MIG_DISABLE, &act);
    nvmlShutdown();
  }
  nvmlDevice_t dev = nullptr;
};

TEST_F(NvmlMig, ProfilesAreNvidiasWithMigOff) {
  unsigned cur = 9, pend = 9;
  ASSERT_EQ(nvmlDeviceGetMigMode(dev, &cur, &pend), NVML_SUCCESS);
  EXPECT_EQ(cur, 0u);
  EXPECT_EQ(pend, 0u);
  nvmlGpuInstanceProfileInfo_t info = {};
  ASSERT_EQ(nvmlDeviceGetGpuInstanceProfileInfo(dev, NVML_GPU_INSTANCE_PROFILE_1_SLICE, &info), NVML_SUCCESS);
  EXPECT_EQ(info.id, 19u);
  EXPECT_EQ(info.multiprocessorCount, 16u);
  EXPECT_EQ(info.memorySizeMB, 9984u);
  EXPECT_EQ(info.instanceCount, 7u);
  ASSERT_EQ(nvmlDeviceGetGpuInstanceProfileInfo(dev, NVML_GPU_INSTANCE_PROFILE_7_SLICE, &info), NVML_SUCCESS);
  EXPECT_EQ(info.id, 0u);
  EXPECT_EQ(info.multiprocessorCount, 132u);
  EXPECT_EQ(nvmlDeviceGetGpuInstanceProfileInfo(dev, NVML_GPU_INSTANCE_PROFILE_8_SLICE, &info), NVML_ERROR_NOT_SUPPORTED);
  EXPECT_EQ(nvmlDeviceGetGpuInstanceProfileInfo(dev, NVML_GPU_INSTANCE_PROFILE_COUNT, &info),
            NVML_ERROR_INVALID_ARGUMENT);
  nvmlGpuInstanceProfileInfo_v2_t v2 = {};
  v2.version = nvmlGpuInstanceProfileInfo_v2;
  ASSERT_EQ(nvmlDeviceGetGpuInstanceProfileInfoV(dev, NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2, &v2), NVML_SUCCESS);
  EXPECT_STREQ(v2.name, "MIG 1g.20gb");
  EXPECT_EQ(v2.multiprocessorCount, 26u);
  nvmlGpuInstanceProfileInfo_v3_t v3 = {};
  v3.version = nvmlGpuInstanceProfileInfo_v3;
  ASSERT_EQ(nvmlDeviceGetGpuInstanceProfileInfoByIdV(dev, 9, reinterpret_cast<nvmlGpuInstanceProfileInfo_v2_t*>(&v3)),
            NVML_SUCCESS);
  EXPECT_STREQ(v3.name, "MIG 3g.40gb");
  EXPECT_EQ(v3.memorySizeMB, 40448u);
  v2.version = 1;
  EXPECT_EQ(nvmlDeviceGetGpuInstanceProfileInfoV(dev, 0, &v2), NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
  // Placements need no MIG mode; capacity and creation do.
  nvmlGpuInstancePlacement_t pl[8];
  unsigned n = 8;
  ASSERT_EQ(nvmlDeviceGetGpuInstancePossiblePlacements_v2(dev, 15, pl, &n), NVML_SUCCESS);
  ASSERT_EQ(n, 4u);
  EXPECT_EQ(pl[3].start, 6u);
  EXPECT_EQ(pl[3].size, 2u);
  n = 1;
  EXPECT_EQ(nvmlDeviceGetGpuInstancePossiblePlacements_v2(dev, 15, pl, &n), NVML_ERROR_INSUFFICIENT_SIZE);
  EXPECT_EQ(n, 4u);
  EXPECT_EQ(nvmlDeviceGetGpuInstanceRemainingCapacity(dev, 19, &n), NVML_ERROR_NOT_SUPPORTED);
  nvmlGpuInstance_t gi;
  EXPECT_EQ(nvmlDeviceCreateGpuInstance(dev, 19, &gi), NVML_ERROR_NOT_SUPPORTED);
  EXPECT_EQ(nvmlDeviceGetMaxMigDeviceCount(dev, &n), NVML_SUCCESS);
  EXPECT_EQ(n, 0u);
  nvmlUtilization_t u;
  EXPECT_EQ(nvmlDeviceGetUtilizationRates(dev, &u), NVML_SUCCESS);
}

TEST_F(NvmlMig, InstancesAndMigDevicesAsNvidiasToolsSeeThem) {
  nvmlReturn_t act = NVML_ERROR_UNKNOWN;
  ASSERT_EQ(nvmlDeviceSetMigMode(dev, NVML_DEVICE_MIG_ENABLE, &act), NVML_SUCCESS);
  EXPECT_EQ(act, NVML_SUCCESS) << "an H100 changes mode without a reset";
  unsigned cur = 0, pend = 0, n = 0;
  ASSERT_EQ(nvmlDeviceGetMigMode(dev, &cur, &pend), NVML_SUCCESS);
  EXPECT_EQ(cur, 1u);
  EXPECT_EQ(pend, 1u);
  ASSERT_EQ(nvmlDeviceGetMaxMigDeviceCount(dev, &n), NVML_SUCCESS);
  EXPECT_EQ(n, 7u);
  nvmlUtilization_t u;
  EXPECT_EQ(nvmlDeviceGetUtilizationRates(dev, &u), NVML_ERROR_NOT_SUPPORTED) << "not on a MIG-enabled GPU";

  // A 3g.40gb (default placement: the highest free start, 4) and a 1g.10gb with its CIs.
  nvmlGpuInstance_t g3, g1;
  ASSERT_EQ(nvmlDeviceCreateGpuInstance(dev, 9, &g3), NVML_SUCCESS);
  nvmlGpuInstanceInfo_t info = {};
  ASSERT_EQ(nvmlGpuInstanceGetInfo(g3, &info), NVML_SUCCESS);
  EXPECT_EQ(info.device, dev);
  EXPECT_EQ(info.profileId, 9u);
  EXPECT_EQ(info.placement.start, 4u);
  EXPECT_EQ(info.placement.size, 4u);
  EXPECT_EQ(info.id, 1u);
  nvmlGpuInstancePlacement_t at = {0, 1};
  ASSERT_EQ(nvmlDeviceCreateGpuInstanceWithPlacement(dev, 19, &at, &g1), NVML_SUCCESS);
  ASSERT_EQ(nvmlGpuInstanceGetInfo(g1, &info), NVML_SUCCESS);
  EXPECT_EQ(info.id, 7u);
  EXPECT_EQ(nvmlDeviceCreateGpuInstanceWithPlacement(dev, 19, &at, &g1), NVML_ERROR_INSUFFICIENT_RESOURCES)
      << "the slot is taken";
  nvmlGpuInstancePlacement_t wrong = {1, 2};
  EXPECT_EQ(nvmlDeviceCreateGpuInstanceWithPlacement(dev, 19, &wrong, &g1), NVML_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(nvmlDeviceGetGpuInstanceRemainingCapacity(dev, 9, &n), NVML_SUCCESS);
  EXPECT_EQ(n, 0u) << "4:4 is taken, 0:4 overlaps the 1g";
  EXPECT_EQ(nvmlDeviceGetGpuInstanceRemainingCapacity(dev, 19, &n), NVML_SUCCESS);
  EXPECT_EQ(n, 3u) << "slots 1..3 free, and 3 of 7 compute slices left";
  nvmlGpuInstance_t byId;
  EXPECT_EQ(nvmlDeviceGetGpuInstanceById(dev, 7, &byId), NVML_SUCCESS);
  EXPECT_EQ(byId, g1);
  EXPECT_EQ(nvmlDeviceGetGpuInstanceById(dev, 8, &byId), NVML_ERROR_NOT_FOUND);
  nvmlGpuInstance_t list[8];
  n = 8;
  ASSERT_EQ(nvmlDeviceGetGpuInstances(dev, 9, list, &n), NVML_SUCCESS);
  ASSERT_EQ(n, 1u);
  EXPECT_EQ(list[0], g3);

  nvmlComputeInstanceProfileInfo_v2_t cp = {};
  cp.version = nvmlComputeInstanceProfileInfo_v2;
  ASSERT_EQ(nvmlGpuInstanceGetComputeInstanceProfileInfoV(g3, NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, 0, &cp),
            NVML_SUCCESS);
  EXPECT_STREQ(cp.name, "MIG 1c.3g.40gb");
  EXPECT_EQ(cp.instanceCount, 3u);
  EXPECT_EQ(nvmlGpuInstanceGetComputeInstanceProfileInfoV(g3, NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE, 0, &cp),
            NVML_ERROR_NOT_SUPPORTED);
  nvmlComputeInstance_t c3, c1a, c1b;
  ASSERT_EQ(nvmlGpuInstanceCreateComputeInstance(g3, NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE, &c3), NVML_SUCCESS);
  ASSERT_EQ(nvmlGpuInstanceCreateComputeInstance(g1, NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, &c1a), NVML_SUCCESS);
  EXPECT_EQ(nvmlGpuInstanceCreateComputeInstance(g1, NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, &c1b),
            NVML_ERROR_INSUFFICIENT_RESOURCES);
  nvmlComputeInstanceInfo_t ci = {};
  ASSERT_EQ(nvmlComputeInstanceGetInfo_v2(c3, &ci), NVML_SUCCESS);
  EXPECT_EQ(ci.gpuInstance, g3);
  EXPECT_EQ(ci.id, 0u);
  EXPECT_EQ(ci.placement.size, 3u);

  // MIG devices, by GI ID then CI ID: index 0 is GI 1 (the 3g), index 1 GI 7 (the 1g).
  nvmlDevice_t m0, m1, m2;
  ASSERT_EQ(nvmlDeviceGetMigDeviceHandleByIndex(dev, 0, &m0), NVML_SUCCESS);
  ASSERT_EQ(nvmlDeviceGetMigDeviceHandleByIndex(dev, 1, &m1), NVML_SUCCESS);
  EXPECT_EQ(nvmlDeviceGetMigDeviceHandleByIndex(dev, 2, &m2), NVML_ERROR_NOT_FOUND);
  EXPECT_EQ(nvmlDeviceGetMigDeviceHandleByIndex(dev, 7, &m2), NVML_ERROR_INVALID_ARGUMENT);
  unsigned is = 9, id = 9;
  ASSERT_EQ(nvmlDeviceIsMigDeviceHandle(m0, &is), NVML_SUCCESS);
  EXPECT_EQ(is, 1u);
  ASSERT_EQ(nvmlDeviceIsMigDeviceHandle(dev, &is), NVML_SUCCESS);
  EXPECT_EQ(is, 0u);
  ASSERT_EQ(nvmlDeviceGetGpuInstanceId(m1, &id), NVML_SUCCESS);
  EXPECT_EQ(id, 7u);
  ASSERT_EQ(nvmlDeviceGetComputeInstanceId(m1, &id), NVML_SUCCESS);
  EXPECT_EQ(id, 0u);
  EXPECT_EQ(nvmlDeviceGetGpuInstanceId(dev, &id), NVML_ERROR_NOT_SUPPORTED);
  nvmlDevice_t parentOf;
  ASSERT_EQ(nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m0, &parentOf), NVML_SUCCESS);
  EXPECT_EQ(parentOf, dev);
  ASSERT_EQ(nvmlDeviceGetIndex(m1, &id), NVML_SUCCESS);
  EXPECT_EQ(id, 1u);
  char name[96], uuid[96], parentUuid[96];
  ASSERT_EQ(nvmlDeviceGetName(m0, name, sizeof name), NVML_SUCCESS);
  EXPECT_STREQ(name, "NVIDIA H100 80GB HBM3 MIG 3g.40gb");
  ASSERT_EQ(nvmlDeviceGetUUID(m0, uuid, sizeof uuid), NVML_SUCCESS);
  EXPECT_TRUE(std::regex_match(uuid, std::regex("MIG-[0-9a-f]{8}-[0-9a-f]{4}-5[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")))
      << uuid;
  nvmlDevice_t found;
  ASSERT_EQ(nvmlDeviceGetHandleByUUID(uuid, &found), NVML_SUCCESS);
  EXPECT_EQ(found, m0);
  ASSERT_EQ(nvmlDeviceGetUUID(dev, parentUuid, sizeof parentUuid), NVML_SUCCESS);
  ASSERT_EQ(nvmlDeviceGetHandleByUUID((std::string("MIG-") + parentUuid + "/7/0").c_str(), &found), NVML_SUCCESS);
  EXPECT_EQ(found, m1) << "the legacy MIG-<GPU-UUID>/<GI>/<CI> form";
  nvmlMemory_t mem = {};
  ASSERT_EQ(nvmlDeviceGetMemoryInfo(m0, &mem), NVML_SUCCESS);
  EXPECT_EQ(mem.total, 40448ull << 20);
  nvmlDeviceAttributes_t attr = {};
  ASSERT_EQ(nvmlDeviceGetAttributes_v2(m0, &attr), NVML_SUCCESS);
  EXPECT_EQ(attr.multiprocessorCount, 60u);
  EXPECT_EQ(attr.gpuInstanceSliceCount, 3u);
  EXPECT_EQ(attr.computeInstanceSliceCount, 3u);
  EXPECT_EQ(attr.memorySizeMB, 40448u);
  EXPECT_EQ(nvmlDeviceGetAttributes_v2(dev, &attr), NVML_ERROR_NOT_SUPPORTED) << "MIG device handles only";
  // A MIG handle is not a GPU: queries that do not answer for MIG devices refuse it.
  unsigned minor;
  EXPECT_EQ(nvmlDeviceGetMinorNumber(m0, &minor), NVML_ERROR_INVALID_ARGUMENT);

  // Another process (simgpu-smi) sees the same instances and MIG devices.
  int rc;
  const std::string listed = smi("-L", &rc);
  EXPECT_EQ(rc, 0) << listed;
  EXPECT_TRUE(has(listed, std::string("MIG 3g\\.40gb +Device +0: \\(UUID: ") + uuid + "\\) GI 1 CI 0")) << listed;
  EXPECT_TRUE(has(listed, "MIG 1g\\.10gb +Device +1: \\(UUID: MIG-")) << listed;

  // Order of destruction: compute instances first; MIG mode off only once nothing is left.
  EXPECT_EQ(nvmlGpuInstanceDestroy(g3), NVML_ERROR_IN_USE);
  EXPECT_EQ(nvmlDeviceSetMigMode(dev, NVML_DEVICE_MIG_DISABLE, &act), NVML_ERROR_IN_USE);
  ASSERT_EQ(nvmlComputeInstanceDestroy(c3), NVML_SUCCESS);
  EXPECT_EQ(nvmlComputeInstanceDestroy(c3), NVML_ERROR_INVALID_ARGUMENT) << "gone";
  // MIG indexes are dense (docs/simgpu.md): the 1g is index 0 now, and index 1 names nothing.
  EXPECT_EQ(nvmlDeviceGetName(m0, name, sizeof name), NVML_SUCCESS);
  EXPECT_STREQ(name, "NVIDIA H100 80GB HBM3 MIG 1g.10gb");
  EXPECT_EQ(nvmlDeviceGetName(m1, name, sizeof name), NVML_ERROR_INVALID_ARGUMENT);
  ASSERT_EQ(nvmlGpuInstanceDestroy(g3), NVML_SUCCESS);
  EXPECT_EQ(nvmlGpuInstanceGetInfo(g3, &info), NVML_ERROR_INVALID_ARGUMENT);
  ASSERT_EQ(nvmlComputeInstanceDestroy(c1a), NVML_SUCCESS);
  ASSERT_EQ(nvmlGpuInstanceDestroy(g1), NVML_SUCCESS);
  ASSERT_EQ(nvmlDeviceSetMigMode(dev, NVML_DEVICE_MIG_DISABLE, &act), NVML_SUCCESS);
  EXPECT_EQ(nvmlDeviceGetUtilizationRates(dev, &u), NVML_SUCCESS);
}

// What NVIDIA's header marks root-only or privileged is refused to another user; the queries are not.
TEST_F(NvmlMig, OnlyRootChangesTheLayout) {
  nvmlReturn_t act;
  ASSERT_EQ(nvmlDeviceSetMigMode(dev, NVML_DEVICE_MIG_ENABLE, &act), NVML_SUCCESS);
  nvmlGpuInstance_t gi;
  ASSERT_EQ(nvmlDeviceCreateGpuInstance(dev, 14, &gi), NVML_SUCCESS);
  const pid_t child = ::fork();
  if (child == 0) {
    if (::setgid(2000) != 0 || ::setuid(2000) != 0) ::_exit(90);
    int bad = 0;
    nvmlGpuInstance_t g;
    nvmlReturn_t a;
    unsigned n = 8, cur, pend;
    nvmlGpuInstancePlacement_t pl[8];
    nvmlGpuInstanceInfo_t info;
    nvmlGpuInstanceProfileInfo_t p;
    bad |= nvmlDeviceCreateGpuInstance(dev, 19, &g) != NVML_ERROR_NO_PERMISSION;
    bad |= (nvmlDeviceSetMigMode(dev, NVML_DEVICE_MIG_DISABLE, &a) != NVML_ERROR_NO_PERMISSION) << 1;
    bad |= (nvmlGpuInstanceDestroy(gi) != NVML_ERROR_NO_PERMISSION) << 2;
    bad |= (nvmlDeviceGetGpuInstancePossiblePlacements_v2(dev, 19, pl, &n) != NVML_ERROR_NO_PERMISSION) << 3;
    bad |= (nvmlDeviceGetGpuInstances(dev, 14, &g, &n) != NVML_ERROR_NO_PERMISSION) << 4;
    bad |= (nvmlDeviceGetMigMode(dev, &cur, &pend) != NVML_SUCCESS || cur != 1) << 5;
    bad |= (nvmlGpuInstanceGetInfo(gi, &info) != NVML_SUCCESS) << 6;
    bad |= (nvmlDeviceGetGpuInstanceProfileInfo(dev, 0, &p) != NVML_SUCCESS) << 7;
    ::_exit(bad);
  }
  int st = 0;
  ASSERT_EQ(::waitpid(child, &st, 0), child);
  EXPECT_TRUE(WIFEXITED(st));
  EXPECT_EQ(WEXITSTATUS(st), 0) << "bit set: the call that answered wrongly as uid 2000";
  unsigned n = 8;
  nvmlGpuInstance_t list[8];
  ASSERT_EQ(nvmlDeviceGetGpuInstances(dev, 14, list, &n), NVML_SUCCESS);
  EXPECT_EQ(n, 1u) << "the other user destroyed nothing";
}

// A mode change needs the GPU idle: refused while a process has a context on it.
TEST_F(NvmlMig, ModeChangeWaitsForAnIdleGpu) {
  int toChild[2], fromChild[2];
  ASSERT_EQ(::pipe(toChild), 0);
  ASSERT_EQ(::pipe(fromChild), 0);
  const pid_t child = ::fork();
  if (child == 0) {
    Config c;
    std::string err;
    SharedState* s = loadConfig(&c, &err) ? SharedState::open(c.stateDir, c.deviceCount, c.memory, c.smCount, &err)
                                          : nullptr;
    const char ok = s && s->setContext(0, true) ? 'y' : 'n';
    [[maybe_unused]] ssize_t w = ::write(fromChild[1], &ok, 1);
    char x;
    [[maybe_unused]] ssize_t r = ::read(toChild[0], &x, 1);
    ::_exit(0);
  }
  char ok = 0;
  ASSERT_EQ(::read(fromChild[0], &ok, 1), 1);
  ASSERT_EQ(ok, 'y');
  nvmlReturn_t act;
  EXPECT_EQ(nvmlDeviceSetMigMode(dev, NVML_DEVICE_MIG_ENABLE, &act), NVML_ERROR_IN_USE);
  ASSERT_EQ(::write(toChild[1], "q", 1), 1);
  int st;
  ::waitpid(child, &st, 0);
  EXPECT_EQ(nvmlDeviceSetMigMode(dev, NVML_DEVICE_MIG_ENABLE, &act), NVML_SUCCESS) << "idle once it has gone";
}

// ---- NVML on an A100-40GB (SIMGPU_GPU_MODEL=a100-40gb): simgpu-smi, as an operator drives it ----

TEST(NvmlMigA100, ModeWaitsForAResetAndTheGuidesCreationOrderHolds) {
  ASSERT_EQ(nvmlInit_v2(), NVML_SUCCESS);
  int rc;
  std::string out = smi("-i 0 -mig 1", &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("Warning: MIG mode is in pending enable state"), std::string::npos) << out;
  nvmlDevice_t dev;
  ASSERT_EQ(nvmlDeviceGetHandleByIndex_v2(0, &dev), NVML_SUCCESS);
  unsigned cur = 9, pend = 9;
  ASSERT_EQ(nvmlDeviceGetMigMode(dev, &cur, &pend), NVML_SUCCESS);
  EXPECT_EQ(cur, 0u);
  EXPECT_EQ(pend, 1u);
  out = smi("mig -cgi 19", &rc);
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("Not Supported"), std::string::npos) << out;
  out = smi("--gpu-reset -i 0", &rc);
  EXPECT_EQ(rc, 0) << out;
  ASSERT_EQ(nvmlDeviceGetMigMode(dev, &cur, &pend), NVML_SUCCESS);
  EXPECT_EQ(cur, 1u);

  out = smi("mig -lgip", &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_TRUE(has(out, "MIG 1g\\.5gb +ID 19 +7/7 +4\\.75 GiB +SM +14 ")) << out;
  EXPECT_TRUE(has(out, "MIG 7g\\.40gb +ID +0 +1/1 +39\\.25 GiB +SM +98 ")) << out;
  out = smi("mig -lgipp", &rc);
  EXPECT_TRUE(has(out, "MIG 3g\\.20gb +ID +9 +placements: \\{0,4\\}:4")) << out;

  // The guide's known order problem: 19,19,14,9 fails on the 3g; 9,19,14,19 works.
  out = smi("mig -cgi 19,19,14,9", &rc);
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("creating a GPU instance of profile 9 on GPU 0: Ran out of critical resources"), std::string::npos)
      << out;
  out = smi("mig -dgi", &rc);
  EXPECT_EQ(rc, 0) << out;
  out = smi("mig -cgi 9,19,14,1g.5gb -C", &rc);
  EXPECT_EQ(rc, 0) << out;
  out = smi("-L", &rc);
  EXPECT_NE(out.find("GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-"), std::string::npos) << out;
  for (const char* p : {"MIG 3g.20gb ", "MIG 2g.10gb ", "MIG 1g.5gb "}) EXPECT_NE(out.find(p), std::string::npos) << out;
  unsigned n = 0;
  ASSERT_EQ(nvmlDeviceGetMaxMigDeviceCount(dev, &n), NVML_SUCCESS);
  nvmlDevice_t m;
  EXPECT_EQ(nvmlDeviceGetMigDeviceHandleByIndex(dev, 3, &m), NVML_SUCCESS);
  EXPECT_EQ(nvmlDeviceGetMigDeviceHandleByIndex(dev, 4, &m), NVML_ERROR_NOT_FOUND);
  out = smi("mig -lci", &rc);
  // The 3g was placed first, at the highest start (4:4): GI 1, as in the guide's example.
  EXPECT_TRUE(has(out, "GI +1 +CI 0 +MIG 3g\\.20gb +profile 2 +placement 0:3")) << out;
  EXPECT_TRUE(has(out, "GI +10 +CI 0 +MIG 1g\\.5gb ")) << out;
  // Compute instances smaller than their GI, by CI profile ID; at most three 1c in a 3g.
  out = smi("mig -dci -gi 1", &rc);
  EXPECT_EQ(rc, 0) << out;
  out = smi("mig -gi 1 -cci 0,0,0", &rc);
  EXPECT_EQ(rc, 0) << out;
  out = smi("mig -lci", &rc);
  EXPECT_TRUE(has(out, "GI +1 +CI 2 +MIG 1c\\.3g\\.20gb +profile 0 +placement 2:1")) << out;
  out = smi("mig -gi 1 -cci 0", &rc);
  EXPECT_EQ(rc, 1) << out;
  // Disabling waits for a reset too; the reset clears the instances.
  out = smi("mig -dgi", &rc);
  EXPECT_EQ(rc, 0) << out;
  out = smi("-mig 0", &rc);
  EXPECT_NE(out.find("pending disable"), std::string::npos) << out;
  out = smi("--gpu-reset", &rc);
  ASSERT_EQ(nvmlDeviceGetMigMode(dev, &cur, &pend), NVML_SUCCESS);
  EXPECT_EQ(cur, 0u);
  EXPECT_EQ(pend, 0u);
  nvmlShutdown();
}

}  // namespace
