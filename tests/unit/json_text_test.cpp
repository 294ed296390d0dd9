// The broker's JSON log text (broker/core/json_text.cpp): escapes, UTF-8 kept when well formed,
// U+FFFD for every byte of anything else (overlongs, surrogates, beyond U+10FFFF, truncated).
#include <gtest/gtest.h>

#include "core/json_text.h"

namespace cushare::broker {
namespace {

std::string esc(std::string_view s) {
  std::string out;
  appendJsonEscaped(s, &out);
  return out;
}

TEST(JsonText, EscapesQuotesBackslashesAndControls) {
  EXPECT_EQ(esc("a\"b\\c"), "a\\\"b\\\\c");
  EXPECT_EQ(esc(std::string("x\n\t\x01\x7fy", 6)), "x\\u000a\\u0009\\u0001\\u007fy");
  EXPECT_EQ(esc(std::string("nul\0!", 5)), "nul\\u0000!");
}

TEST(JsonText, KeepsWellFormedUtf8) {
  EXPECT_EQ(esc("\xc3\xa9"), "\xc3\xa9");                  // U+00E9
  EXPECT_EQ(esc("\xe2\x82\xac"), "\xe2\x82\xac");          // U+20AC
  EXPECT_EQ(esc("\xed\x9f\xbf"), "\xed\x9f\xbf");          // U+D7FF, the last before the surrogates
  EXPECT_EQ(esc("\xf0\x9f\x98\x80"), "\xf0\x9f\x98\x80");  // U+1F600
  EXPECT_EQ(esc("\xf4\x8f\xbf\xbf"), "\xf4\x8f\xbf\xbf");  // U+10FFFF
}

TEST(JsonText, ReplacesEveryByteOfWhatIsNotUtf8) {
  const std::string r = "\\ufffd";
  EXPECT_EQ(esc("\xc0\xaf"), r + r);              // overlong '/'
  EXPECT_EQ(esc("\xe0\x80\xaf"), r + r + r);      // overlong
  EXPECT_EQ(esc("\xed\xa0\x80"), r + r + r);      // a surrogate
  EXPECT_EQ(esc("\xf0\x80\x80\xaf"), r + r + r + r);  // overlong
  EXPECT_EQ(esc("\xf4\x90\x80\x80"), r + r + r + r);  // beyond U+10FFFF
  EXPECT_EQ(esc("\xf5\x80\x80\x80"), r + r + r + r);
  EXPECT_EQ(esc("\xe2\x82"), r + r);              // truncated
  EXPECT_EQ(esc("\x80x"), r + "x");               // a lone continuation byte
}

}  // namespace
}  // namespace cushare::broker
