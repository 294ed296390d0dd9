// The hold of weighted turns among MPS clients (broker/core/mps_turns.h; docs/compute.md,
// "Weights under MPS"), step by step on a made-up clock.
#include "core/mps_turns.h"

#include <gtest/gtest.h>

namespace cushare::broker {
namespace {

constexpr uint64_t kMs = 1'000'000;
constexpr uint64_t kHold = 500 * kMs;

TEST(MpsTurnsHold, ReasonsThatFlickerEndTurnsOnlyAfterTheHoldKeepingOnlyTheClientsInThem) {
  MpsTurnsHold h;
  EXPECT_FALSE(h.step(false, false, 1000 * kMs, kHold)) << "never wanted: off";
  EXPECT_FALSE(h.member(true, true, false));
  ASSERT_TRUE(h.step(true, false, 1100 * kMs, kHold));
  EXPECT_TRUE(h.member(true, true, false)) << "a contending client is taken while the reasons hold";
  EXPECT_FALSE(h.member(false, true, false)) << "a tenant outside MPS is not a client in turns";
  EXPECT_FALSE(h.member(true, false, true)) << "a client that does not contend takes no turn";
  // The reasons go (a contender's work or process count flickered): turns hold for 500 ms.
  EXPECT_TRUE(h.step(false, false, 1200 * kMs, kHold));
  EXPECT_TRUE(h.member(true, true, true)) << "a client in turns keeps its place during the hold";
  EXPECT_FALSE(h.member(true, true, false)) << "no new client is taken during the hold";
  EXPECT_TRUE(h.step(false, false, 1699 * kMs, kHold)) << "499 ms after the reasons went";
  EXPECT_FALSE(h.step(false, false, 1700 * kMs, kHold)) << "500 ms after: over";
  EXPECT_FALSE(h.member(true, true, true));
  // Reasons back within the hold start it anew when they go again.
  ASSERT_TRUE(h.step(true, false, 2000 * kMs, kHold));
  EXPECT_TRUE(h.step(false, false, 2100 * kMs, kHold));
  EXPECT_TRUE(h.step(true, false, 2400 * kMs, kHold));
  EXPECT_TRUE(h.step(false, false, 2500 * kMs, kHold));
  EXPECT_TRUE(h.step(false, false, 2999 * kMs, kHold)) << "the hold counts anew from the first step without the reasons after they came back (2500 ms)";
  EXPECT_FALSE(h.step(false, false, 3000 * kMs, kHold));
}

TEST(MpsTurnsHold, WhatRulesTurnsOutEndsThemAtOnce) {
  MpsTurnsHold h;
  ASSERT_TRUE(h.step(true, false, 1000 * kMs, kHold));
  EXPECT_FALSE(h.step(false, true, 1001 * kMs, kHold)) << "barred: no hold";
  EXPECT_FALSE(h.member(true, true, true));
  // Barred wins over wanting (the caller's want already excludes it; the hold must not rely on it).
  EXPECT_FALSE(h.step(true, true, 1002 * kMs, kHold));
  // Barred during a hold ends it too.
  ASSERT_TRUE(h.step(true, false, 2000 * kMs, kHold));
  EXPECT_TRUE(h.step(false, false, 2100 * kMs, kHold));
  EXPECT_FALSE(h.step(false, true, 2101 * kMs, kHold));
  EXPECT_FALSE(h.step(false, false, 2102 * kMs, kHold)) << "no hold revived after a bar";
}

}  // namespace
}  // namespace cushare::broker
