// The budget for log lines other users can cause (broker/core/log_limit.h): a burst passes, then
// one line per period; what is held back is said with the next line that passes, and counted.
#include "core/log_limit.h"

#include <gtest/gtest.h>

#include <string>

namespace cushare::broker {
namespace {

constexpr uint64_t kSecond = 1'000'000'000;

TEST(LogLimit, ABurstPassesThenOneLinePerPeriodWithWhatWasHeldBack) {
  LogLimit l(3, std::chrono::milliseconds(6000));
  std::string more;
  const uint64_t dropped0 = gLogLinesDropped.load();
  const uint64_t t0 = 100 * kSecond;
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(l.allowAt(t0, &more)) << i;
    EXPECT_EQ(more, "");
  }
  // 3000 more at once (a user dropping 3000 files): none passes.
  int passed = 0;
  for (int i = 0; i < 3000; ++i) passed += l.allowAt(t0 + 1, &more);
  EXPECT_EQ(passed, 0);
  EXPECT_EQ(gLogLinesDropped.load() - dropped0, 3000u);
  EXPECT_FALSE(l.allowAt(t0 + 5 * kSecond, &more)) << "not a whole period yet";
  ASSERT_TRUE(l.allowAt(t0 + 6 * kSecond, &more));
  EXPECT_EQ(more, " (3001 more like it were not logged)");
  EXPECT_FALSE(l.allowAt(t0 + 6 * kSecond, &more));
  // A quiet minute refills the burst (never beyond it).
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(l.allowAt(t0 + 100 * kSecond, &more)) << i;
  EXPECT_EQ(more, "");
  EXPECT_FALSE(l.allowAt(t0 + 100 * kSecond, &more));
}

}  // namespace
}  // namespace cushare::broker
