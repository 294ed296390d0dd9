// One probe launch's records to numbers, the SM factors, and the solo baselines
// (common/include/cushare/probe_analysis.h). Records come from the model in probe_model.h and
// from a hand-written simulated fixture (data/probe_records_simulated.txt).
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>

#include "cushare/probe_analysis.h"
#include "probe_model.h"

namespace cushare::probe {
namespace {

using model::Device;

LaunchOutcome analyze(const ProbeLaunch& l, uint64_t round, LaunchNumbers* n, std::string* err) {
  LaunchContext ctx = l.ctx;
  ctx.round_start_ns = round;
  return analyzeLaunch(l.records, ctx, n, err);
}

const ProbeLaunch& launchOf(const ContextProbes& c, ProbeKind kind) {
  for (const ProbeLaunch& l : c.launches)
    if (l.ctx.kind == kind) return l;
  throw std::runtime_error("no such launch");
}

TEST(ProbeAnalysis, SoloCalibrationMatchesTheDevice) {
  Device d;
  std::mt19937_64 rng(1);
  const SoloBaseline b = model::calibrate(d, rng);
  ASSERT_TRUE(b.hasSm() && b.hasMem() && b.hasLatency());
  EXPECT_EQ(b.sm_distinct, d.sms);
  EXPECT_NEAR(b.sm_cycles_per_step, d.cycles_per_step, d.cycles_per_step * 0.01);
  EXPECT_NEAR(b.sm_cycles_per_ns, d.cycles_per_ns, 0.02);
  // Every SM for the window less the start stagger (about 1 us of 200 us on average).
  EXPECT_GT(b.sm_resident_fraction, 0.98);
  EXPECT_NEAR(b.sm_steps_per_us,
              d.sms * d.cycles_per_ns / d.cycles_per_step * 1000 * b.sm_resident_fraction, 1.0);
  EXPECT_NEAR(b.mem_bytes_per_us, d.mem_bytes_per_ns * 1000, d.mem_bytes_per_ns * 1000 * 0.03);
  // Launch latency 8 us + up to 4 us of jitter, timer quantised to 1 us; a round's earliest of
  // its three launches.
  EXPECT_GE(b.latency_p95_ns, 8'000);
  EXPECT_LE(b.latency_p95_ns, 11'000);
  EXPECT_EQ(b.tick_ns, d.tick_ns);
  EXPECT_EQ(b.launches, 40u);
}

// An MPS client with a cap of 25 % launches one block per SM of the device (132): they land on
// its 34 SMs, three at a time, and the rest are late. Each stacked block gets a third of the SM;
// dividing out the stack gives the SM's whole rate back.
TEST(ProbeAnalysis, SelfStackedBlocksAreDividedOutAndLateBlocksIgnored) {
  Device d;
  std::mt19937_64 rng(2);
  const SoloBaseline b = model::calibrate(d, rng);
  const model::MpsLayout m = model::mpsLayout(d, {0.25});
  const ContextProbes c = model::mpsProbes(d, m, 0, 1e9, 1.0, false, rng);
  LaunchNumbers n;
  std::string err;
  ASSERT_EQ(analyze(launchOf(c, kProbeSm), 1'000'000'000, &n, &err), LaunchOutcome::kNumbers)
      << err;
  EXPECT_EQ(n.distinct_sms, 34u);
  EXPECT_EQ(n.ran, 102u);
  EXPECT_EQ(n.late, 30u);
  EXPECT_EQ(n.max_stack, 3u);
  EXPECT_NEAR(n.mean_stack, 3.0, 0.05);
  SmFactors f;
  ASSERT_TRUE(smFactors(n, b, &f, &err)) << err;
  EXPECT_NEAR(f.spatial, 34.0 / 132, 1e-9);
  EXPECT_NEAR(f.intra, 1.0, 0.03) << "stacked blocks not divided out";
  EXPECT_NEAR(f.temporal, 1.0, 0.02);
  EXPECT_NEAR(f.clock, 1.0, 0.02);
  EXPECT_NEAR(f.share(), 34.0 / 132, 0.01);
  EXPECT_NEAR(f.rate, f.spatial * f.temporal * f.intra * f.clock, 0.01);
  // Without the correction a block's cycles per step is three times solo's.
  const BlockRecord& r = launchOf(c, kProbeSm).records[0];
  EXPECT_NEAR(double(r.cycles) / double(r.work) / b.sm_cycles_per_step, 3.0, 0.05);
}

// A context time-sliced out in the middle of its probe's window: the gaps show in the temporal
// factor, the rate falls by as much, the intra-SM and clock factors stay at 1.
TEST(ProbeAnalysis, TimeSlicedOutMidWindowShowsInTheTemporalFactor) {
  Device d;
  std::mt19937_64 rng(3);
  const SoloBaseline b = model::calibrate(d, rng);
  // Context 0 holds the device 100 us of every 150 us. The round comes while context 1 holds it,
  // so the probe starts with context 0's next slice, runs 100 us, is out 50 us and runs 50 us more.
  const model::Schedule s({{0, 100'000}, {1, 50'000}});
  const uint64_t round = 150'000ull * 10'000 + 130'000;
  const ContextProbes c = model::exclusiveProbes(d, s, 0, double(round), rng);
  LaunchNumbers n;
  std::string err;
  ASSERT_EQ(analyze(launchOf(c, kProbeSm), round, &n, &err), LaunchOutcome::kNumbers) << err;
  SmFactors f;
  ASSERT_TRUE(smFactors(n, b, &f, &err)) << err;
  EXPECT_NEAR(n.window_ns, 200'000, 1'000);
  EXPECT_NEAR(n.start_latency_ns, 20'000, 1'000) << "waited for its slice";
  EXPECT_NEAR(f.temporal, 0.75, 0.02);
  EXPECT_NEAR(f.intra, 1.0, 0.02);
  EXPECT_NEAR(f.clock, 1.0, 0.02);
  EXPECT_NEAR(f.rate, 0.75, 0.02);
  EXPECT_NEAR(f.share(), 0.75, 0.02);
  EXPECT_GE(n.max_gap_ns, 49'000u);
  EXPECT_GT(n.gap_ns, 49'000ull * d.sms);
}

// One defect per case, each refused with its own reason.
TEST(ProbeAnalysis, BadRecordsGiveAReasonNeverANumber) {
  Device d;
  d.sms = 8;
  std::mt19937_64 rng(4);
  const model::Schedule alone({{0, 1e9}});
  const ContextProbes good = model::exclusiveProbes(d, alone, 0, 1e8, rng);
  const ProbeLaunch sm = launchOf(good, kProbeSm);
  const ProbeLaunch tick = launchOf(good, kProbeTick);
  LaunchNumbers n;
  std::string err;
  ASSERT_EQ(analyze(sm, 100'000'000, &n, &err), LaunchOutcome::kNumbers) << err;
  ASSERT_EQ(analyze(tick, 100'000'000, &n, &err), LaunchOutcome::kNumbers) << err;
  struct Case {
    const char* what;
    std::function<void(ProbeLaunch*)> spoil;
    const char* reason;
  };
  const Case cases[] = {
      {"bad args", [](ProbeLaunch* l) { l->records[0].flags = kProbeBadArgs; }, "kProbeBadArgs"},
      {"end before start",
       [](ProbeLaunch* l) { l->records[3].end_ns = l->records[3].start_ns - 1; },
       "before it starts"},
      {"one record short", [](ProbeLaunch* l) { l->records.pop_back(); },
       "7 records for a grid of 8"},
      {"no record written", [](ProbeLaunch* l) { l->records[2] = BlockRecord{}; },
       "wrote no record"},
      {"ran and late", [](ProbeLaunch* l) { l->records[1].flags |= kProbeLate; },
       "both ran and late"},
      {"unknown flag", [](ProbeLaunch* l) { l->records[1].flags |= 1u << 9; },
       "unknown flag bits 0x200"},
      {"20 GHz", [](ProbeLaunch* l) { l->records[1].cycles *= 10; }, "over 10 GHz"},
      {"steps faster than FMAs", [](ProbeLaunch* l) { l->records[1].work = l->records[1].cycles; },
       "under one cycle each"},
      {"migrated without flag", [](ProbeLaunch* l) { l->records[1].sm_end = 5; },
       "migrated flag disagrees"},
      {"absurd SM id",
       [](ProbeLaunch* l) { l->records[1].sm_start = l->records[1].sm_end = 70000; },
       "SM id 70000 is absurd"},
      {"late with work", [](ProbeLaunch* l) { l->records[1].flags = kProbeLate; },
       "late but reports work"},
      {"gap longer than the block", [](ProbeLaunch* l) { l->records[1].gap_ns = 1'000'000; },
       "longer than the block ran"},
      {"ends an hour later", [](ProbeLaunch* l) { l->records[1].end_ns += 3'600'000'000'000; },
       "far past its budget"},
      {"more SMs than the device", [](ProbeLaunch* l) { l->ctx.sm_count = 4; },
       "8 distinct SMs on a device of 4"},
      {"timer garbage", [](ProbeLaunch* l) { l->records[1].end_ns = ~0ull; },
       "is absurd (over 146"},
      {"zero budget", [](ProbeLaunch* l) { l->ctx.budget_ns = 0; }, "budget 0 ns"},
      {"started before the round",
       [](ProbeLaunch* l) {
         for (BlockRecord& r : l->records) r.start_ns -= 50'000'000, r.end_ns -= 50'000'000;
       },
       "before its round's instant"},
  };
  for (const Case& c : cases) {
    ProbeLaunch l = sm;
    c.spoil(&l);
    err.clear();
    EXPECT_EQ(analyze(l, 100'000'000, &n, &err), LaunchOutcome::kBad) << c.what;
    EXPECT_NE(err.find(c.reason), std::string::npos) << c.what << ": " << err;
  }
  ProbeLaunch t = tick;
  t.records[0].tick_ns = t.ctx.budget_ns + 1;
  EXPECT_EQ(analyze(t, 100'000'000, &n, &err), LaunchOutcome::kBad);
  EXPECT_NE(err.find("timer tick"), std::string::npos) << err;
  ProbeLaunch mem = launchOf(good, kProbeMem);
  mem.records[0].work = 1ull << 62;
  EXPECT_EQ(analyze(mem, 100'000'000, &n, &err), LaunchOutcome::kBad);
  EXPECT_NE(err.find("over 100 TB/s"), std::string::npos) << err;
}

TEST(ProbeAnalysis, EveryBlockLateIsAMissingSampleNotZero) {
  Device d;
  std::mt19937_64 rng(5);
  const SoloBaseline b = model::calibrate(d, rng);
  const model::MpsLayout m = model::mpsLayout(d, {0.5});
  const ContextProbes c = model::mpsProbes(d, m, 0, 1e9, 1.0, /*all_late=*/true, rng);
  LaunchNumbers n;
  std::string err;
  ASSERT_EQ(analyze(launchOf(c, kProbeSm), 1'000'000'000, &n, &err), LaunchOutcome::kMissing);
  EXPECT_EQ(n.ran, 0u);
  EXPECT_EQ(n.late, d.sms);
  EXPECT_TRUE(n.has_latency);
  SmFactors f;
  EXPECT_FALSE(smFactors(n, b, &f, &err));
  EXPECT_NE(err.find("missing sample"), std::string::npos) << err;
}

TEST(ProbeAnalysis, DecodeRecordsReadsTheAbiLayout) {
  BlockRecord r{};
  r.start_ns = 0x0102030405060708ull;
  r.end_ns = 0x1112131415161718ull;
  r.sm_start = 7;
  r.sm_end = 9;
  r.flags = kProbeRan | kProbeMigrated;
  r.cycles = 123456789;
  r.work = 42;
  r.max_gap_ns = 5;
  r.gap_ns = 6;
  r.tick_ns = 1024;
  std::vector<uint8_t> bytes(2 * sizeof r);
  std::memcpy(bytes.data(), &r, sizeof r);
  std::memcpy(bytes.data() + sizeof r, &r, sizeof r);
  // The byte of start_ns stored first is its lowest (little-endian ABI).
  EXPECT_EQ(bytes[0], 0x08);
  std::vector<BlockRecord> out;
  std::string err;
  ASSERT_TRUE(decodeRecords(bytes, 2, &out, &err)) << err;
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(std::memcmp(&out[1], &r, sizeof r), 0);
  EXPECT_FALSE(decodeRecords(std::span(bytes).first(100), 2, &out, &err));
  EXPECT_NE(err.find("100 bytes for 2 records of 72 bytes"), std::string::npos) << err;
  EXPECT_FALSE(decodeRecords(bytes, 0, &out, &err));
}

// --- the simulated fixture -----------------------------------------------------------------

struct FixtureLaunch {
  std::string description;
  LaunchContext ctx;
  std::vector<BlockRecord> records;
};

std::vector<FixtureLaunch> readFixture() {
  std::ifstream in(std::string(CUSHARE_UNIT_DATA_DIR) + "/probe_records_simulated.txt");
  EXPECT_TRUE(in) << "fixture missing";
  std::vector<FixtureLaunch> out;
  std::vector<uint8_t> bytes;
  auto flush = [&] {
    if (out.empty()) return;
    std::string err;
    EXPECT_TRUE(decodeRecords(bytes, out.back().ctx.grid_blocks, &out.back().records, &err)) << err;
    bytes.clear();
  };
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("launch ", 0) == 0) {
      flush();
      out.push_back({line.substr(7), {}, {}});
    } else if (line.rfind("context ", 0) == 0) {
      std::istringstream s(line.substr(8));
      std::string key;
      uint64_t v;
      LaunchContext& c = out.back().ctx;
      while (s >> key >> v) {
        if (key == "kind")
          c.kind = ProbeKind(v);
        else if (key == "budget_ns")
          c.budget_ns = v;
        else if (key == "grid")
          c.grid_blocks = uint32_t(v);
        else if (key == "work_per_step")
          c.work_per_step = uint32_t(v);
        else if (key == "sm_count")
          c.sm_count = uint32_t(v);
        else if (key == "round_start_ns")
          c.round_start_ns = v;
        else
          ADD_FAILURE() << "fixture key " << key;
      }
    } else if (line.rfind("record ", 0) == 0) {
      const std::string hex = line.substr(7);
      EXPECT_EQ(hex.size(), 144u);
      for (size_t i = 0; i + 1 < hex.size(); i += 2)
        bytes.push_back(uint8_t(std::stoul(hex.substr(i, 2), nullptr, 16)));
    }
  }
  flush();
  return out;
}

TEST(ProbeFixture, SimulatedRecordsGiveTheHandComputedNumbers) {
  const std::vector<FixtureLaunch> f = readFixture();
  ASSERT_EQ(f.size(), 6u);
  LaunchNumbers n;
  std::string err;
  // 1. Blocks of 200 us on SMs 0, 1 and (two stacked) 2 at 2 cycles/ns, 800 steps per SM; one late.
  ASSERT_EQ(analyzeLaunch(f[0].records, f[0].ctx, &n, &err), LaunchOutcome::kNumbers) << err;
  EXPECT_EQ(n.ran, 4u);
  EXPECT_EQ(n.late, 1u);
  EXPECT_EQ(n.distinct_sms, 3u);
  EXPECT_EQ(n.max_stack, 2u);
  EXPECT_DOUBLE_EQ(n.mean_stack, 800'000.0 / 600'000.0);
  EXPECT_DOUBLE_EQ(n.window_ns, 200'000);
  EXPECT_DOUBLE_EQ(n.steps_per_us, 12.0);      // 2400 steps / 200 us
  EXPECT_DOUBLE_EQ(n.cycles_per_step, 500.0);  // (400k + 400k + 800k / 2) / 2400
  EXPECT_DOUBLE_EQ(n.cycles_per_ns, 2.0);
  EXPECT_DOUBLE_EQ(n.resident_fraction, 1.0);
  EXPECT_DOUBLE_EQ(n.start_latency_ns, 10'000);
  // 2. 400 MB in 100 us.
  ASSERT_EQ(analyzeLaunch(f[1].records, f[1].ctx, &n, &err), LaunchOutcome::kNumbers) << err;
  EXPECT_DOUBLE_EQ(n.bytes_per_us, 4e6);
  EXPECT_DOUBLE_EQ(n.start_latency_ns, 20'000);
  // 3. Tick probe.
  ASSERT_EQ(analyzeLaunch(f[2].records, f[2].ctx, &n, &err), LaunchOutcome::kNumbers) << err;
  EXPECT_EQ(n.tick_ns, 1000u);
  EXPECT_EQ(n.gap_ns, 8000u);
  EXPECT_EQ(n.max_gap_ns, 8000u);
  EXPECT_EQ(n.samples, 1250u);
  EXPECT_DOUBLE_EQ(n.start_latency_ns, 12'000);
  // 4. Rejected arguments.
  EXPECT_EQ(analyzeLaunch(f[3].records, f[3].ctx, &n, &err), LaunchOutcome::kBad);
  EXPECT_NE(err.find("block 0: the kernel rejected its arguments"), std::string::npos) << err;
  // 5. Every block late: missing, with its latency (300 us).
  ASSERT_EQ(analyzeLaunch(f[4].records, f[4].ctx, &n, &err), LaunchOutcome::kMissing);
  EXPECT_EQ(n.late, 2u);
  EXPECT_DOUBLE_EQ(n.start_latency_ns, 300'000);
  // 6. A migrated block counts for the SM it entered on.
  ASSERT_EQ(analyzeLaunch(f[5].records, f[5].ctx, &n, &err), LaunchOutcome::kNumbers) << err;
  EXPECT_EQ(n.migrated, 1u);
  EXPECT_EQ(n.distinct_sms, 2u);
  EXPECT_DOUBLE_EQ(n.cycles_per_step, 500.0);
}

// --- baselines -----------------------------------------------------------------------------

TEST(ProbeBaseline, TextRoundTripsAndDamageIsRefused) {
  Device d;
  std::mt19937_64 rng(6);
  const SoloBaseline b = model::calibrate(d, rng);
  SoloBaseline back;
  std::string err;
  ASSERT_TRUE(parseSoloBaseline(formatSoloBaseline(b), &back, &err)) << err;
  EXPECT_EQ(std::memcmp(&back, &b, sizeof b), 0) << formatSoloBaseline(back);
  const std::string text = formatSoloBaseline(b);
  auto replaced = [&](const std::string& from, const std::string& to) {
    std::string t = text;
    t.replace(t.find(from), from.size(), to);
    return t;
  };
  const std::pair<std::string, const char*> bad[] = {
      {"", "empty"},
      {replaced("format 1", "format 2"), "expected \"format 1\" first"},
      {replaced("tick_ns", "tock_ns"), "unknown key \"tock_ns\""},
      {text + "launches 3\n", "\"launches\" given twice"},
      {replaced("sm_count 132\n", ""), "\"sm_count\" missing"},
      {replaced("sm_count 132", "sm_count 13x"), "is not a number"},
      {replaced("sm_count 132", "sm_count -1"), "is not a count"},
      {replaced("sm_count 132", "sm_count 5000"), "out of range"},
      {replaced("sm_distinct 132", "sm_distinct 133"), "consistent SM count"},
      {replaced("sm_resident_fraction ", "sm_resident_fraction 2#"), "is not a number"},
  };
  for (const auto& [t, reason] : bad) {
    EXPECT_FALSE(parseSoloBaseline(t, &back, &err)) << reason;
    EXPECT_NE(err.find(reason), std::string::npos) << reason << ": " << err;
  }
}

TEST(ProbeBaseline, CalibrationNeedsEnoughLaunchesWithOneSetOfParameters) {
  Device d;
  std::mt19937_64 rng(7);
  const model::Schedule alone({{0, 1e9}});
  BaselineCalibration cal;
  SoloBaseline b;
  std::string err;
  for (int i = 0; i < 4; ++i)
    for (const ProbeLaunch& l : model::exclusiveProbes(d, alone, 0, 1e8 * (i + 1), rng).launches) {
      LaunchNumbers n;
      ASSERT_EQ(analyze(l, uint64_t(1e8 * (i + 1)), &n, &err), LaunchOutcome::kNumbers) << err;
      cal.add(n);
    }
  EXPECT_FALSE(cal.build(d.sms, &b, &err));
  EXPECT_NE(err.find("4 SM probe launches ran, at least 5"), std::string::npos) << err;
  Device other = d;
  other.work_per_step = 64;
  LaunchNumbers n;
  ASSERT_EQ(analyze(launchOf(model::exclusiveProbes(other, alone, 0, 9e8, rng), kProbeSm),
                    900'000'000, &n, &err),
            LaunchOutcome::kNumbers)
      << err;
  cal.add(n);
  EXPECT_FALSE(cal.build(d.sms, &b, &err));
  EXPECT_NE(err.find("different parameters"), std::string::npos) << err;
}

// A baseline calibrated at a low (idle) clock is raised by a round that found the device otherwise
// idle, and contended rounds never lower it.
TEST(ProbeBaseline, RollingMaximumRaisesToTheBestSoloLikeRound) {
  Device d;
  std::mt19937_64 rng(8);
  Device idle_clock = d;
  idle_clock.cycles_per_ns = 0.35;
  const SoloBaseline low = model::calibrate(idle_clock, rng);
  RollingBaseline rolling(16);
  const model::MpsLayout half = model::mpsLayout(d, {0.5, 0.5});
  std::string err;
  for (int i = 0; i < 20; ++i) {
    LaunchNumbers n;
    ASSERT_EQ(analyze(launchOf(model::mpsProbes(d, half, 0, 1e9, 0.5, false, rng), kProbeSm),
                      1'000'000'000, &n, &err),
              LaunchOutcome::kNumbers)
        << err;
    rolling.observe(n);
  }
  SoloBaseline merged = rolling.merged(low);
  EXPECT_NEAR(merged.sm_cycles_per_ns, d.cycles_per_ns, 0.02) << "clock raised to the loaded one";
  EXPECT_NEAR(merged.sm_steps_per_us, low.sm_steps_per_us * d.cycles_per_ns / 0.35 / 2, 3.0)
      << "half the SMs at the loaded clock beat the idle-clock solo";
  const model::Schedule alone({{0, 1e9}});
  LaunchNumbers solo;
  ASSERT_EQ(analyze(launchOf(model::exclusiveProbes(d, alone, 0, 1e9, rng), kProbeSm),
                    1'000'000'000, &solo, &err),
            LaunchOutcome::kNumbers);
  rolling.observe(solo);
  merged = rolling.merged(low);
  EXPECT_NEAR(merged.sm_steps_per_us, solo.steps_per_us, 1e-9);
  EXPECT_EQ(merged.sm_distinct, d.sms);
  EXPECT_NEAR(merged.sm_cycles_per_step, d.cycles_per_step, d.cycles_per_step * 0.01);
  EXPECT_DOUBLE_EQ(merged.latency_p95_ns, low.latency_p95_ns) << "calibrated latency kept";
  // Uncalibrated latency: the p95 of each round's fastest start.
  SoloBaseline none = low;
  none.latency_p95_ns = -1;
  for (int i = 1; i <= 20; ++i) rolling.observeRoundFastestStart(1000.0 * i);
  // The ring keeps the last 16 (5..20 us); nearest-rank p95 of 16 is the 16th.
  EXPECT_DOUBLE_EQ(rolling.merged(none).latency_p95_ns, 20'000);
}

// A launch whose blocks were stacked (several on one SM at once) is no observation of the solo
// cycles per step: its SM cycles are divided by the depth, and blocks that do not slow each other
// (the SM probe's latency-bound chain) then read 1/depth of solo. Taken as the best, it made every
// unstacked launch after it read an intra-SM factor of 1/depth (0.83 on simgpu's MPS).
TEST(ProbeBaseline, AStackedLaunchDoesNotLowerTheSoloCyclesPerStep) {
  Device d;
  std::mt19937_64 rng(9);
  const SoloBaseline solo = model::calibrate(d, rng);
  RollingBaseline rolling(16);
  LaunchNumbers stacked;
  stacked.kind = kProbeSm;
  stacked.ran = d.sms;
  stacked.work_per_step = solo.sm_work_per_step;
  stacked.sm_count = solo.sm_count;
  stacked.budget_ns = solo.sm_budget_ns;
  stacked.distinct_sms = d.sms / 2;
  stacked.max_stack = 2;
  stacked.cycles_per_step = solo.sm_cycles_per_step / 2;
  stacked.cycles_per_ns = solo.sm_cycles_per_ns;
  rolling.observe(stacked);
  EXPECT_DOUBLE_EQ(rolling.merged(solo).sm_cycles_per_step, solo.sm_cycles_per_step);
  stacked.max_stack = 1;  // the same numbers from blocks that each had their SM: taken
  rolling.observe(stacked);
  EXPECT_DOUBLE_EQ(rolling.merged(solo).sm_cycles_per_step, solo.sm_cycles_per_step / 2);
}

}  // namespace
}  // namespace cushare::probe
