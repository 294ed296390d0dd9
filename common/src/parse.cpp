// Size and integer parsing shared by every part of cushare (see parse.h for the accepted forms).
#include "cushare/parse.h"

#include <algorithm>

#include <cctype>
#include <cmath>
#include <cstdio>

namespace cushare {
namespace {

bool isSpace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

std::string lower(std::string_view s) {
  std::string r(s);
  for (char& c : r) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return r;
}

// Multiplier for a unit suffix, or 0 if the suffix is unknown.
uint64_t unitMultiplier(std::string_view unit) {
  const std::string u = lower(unit);
  if (u.empty() || u == "b") return 1;
  struct Unit {
    const char* name;
    uint64_t mult;
  };
  static constexpr Unit kUnits[] = {
      {"k", 1ull << 10},  {"ki", 1ull << 10},  {"kib", 1ull << 10},  {"kb", 1000ull},
      {"m", 1ull << 20},  {"mi", 1ull << 20},  {"mib", 1ull << 20},  {"mb", 1000000ull},
      {"g", 1ull << 30},  {"gi", 1ull << 30},  {"gib", 1ull << 30},  {"gb", 1000000000ull},
      {"t", 1ull << 40},  {"ti", 1ull << 40},  {"tib", 1ull << 40},  {"tb", 1000000000000ull},
  };
  for (const Unit& k : kUnits)
    if (u == k.name) return k.mult;
  return 0;
}

}  // namespace

std::string_view trim(std::string_view s) {
  while (!s.empty() && isSpace(s.front())) s.remove_prefix(1);
  while (!s.empty() && isSpace(s.back())) s.remove_suffix(1);
  return s;
}

bool parseSize(std::string_view text, uint64_t* out, std::string* error) {
  const std::string_view s = trim(text);
  auto fail = [&](const std::string& why) {
    if (error) *error = "invalid size '" + std::string(text) + "': " + why;
    return false;
  };
  if (s.empty()) return fail("empty");
  if (s.front() == '-') return fail("negative");
  if (s.front() == '+') return fail("a sign is not allowed");
  size_t i = 0;
  uint64_t whole = 0;
  bool digits = false;
  for (; i < s.size() && std::isdigit(static_cast<unsigned char>(s[i])); ++i) {
    digits = true;
    const uint64_t d = static_cast<uint64_t>(s[i] - '0');
    if (whole > (UINT64_MAX - d) / 10) return fail("too large");
    whole = whole * 10 + d;
  }
  // Fraction: kept as digits so that "1.5GiB" is exact. Up to 19 digits fit in frac (10^19 <
  // 2^64) and frac * mult in 128 bits; a nonzero digit past those is refused rather than dropped,
  // since dropping it would round a limit silently.
  static constexpr int kMaxFracDigits = 19;
  uint64_t frac = 0, fracScale = 1;
  bool hasFrac = false;
  if (i < s.size() && s[i] == '.') {
    hasFrac = true;
    ++i;
    int fracDigits = 0;
    for (; i < s.size() && std::isdigit(static_cast<unsigned char>(s[i])); ++i, ++fracDigits) {
      const uint64_t d = static_cast<uint64_t>(s[i] - '0');
      if (fracDigits < kMaxFracDigits) {
        frac = frac * 10 + d;
        fracScale *= 10;
      } else if (d != 0) {
        return fail("more than 19 significant digits after '.'");
      }
    }
    if (fracDigits == 0) return fail("missing digits after '.'");
  }
  if (!digits) return fail("expected a number");
  std::string_view unit = trim(s.substr(i));
  const uint64_t mult = unitMultiplier(unit);
  if (mult == 0) return fail("unknown unit '" + std::string(unit) + "' (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)");
  if (whole != 0 && mult > UINT64_MAX / whole) return fail("too large");
  uint64_t bytes = whole * mult;
  if (hasFrac && frac != 0) {
    // frac/fracScale * mult must be a whole number of bytes.
    const unsigned __int128 num = static_cast<unsigned __int128>(frac) * mult;
    if (num % fracScale != 0) return fail("not a whole number of bytes");
    const unsigned __int128 add = num / fracScale;
    if (add > UINT64_MAX - bytes) return fail("too large");
    bytes += static_cast<uint64_t>(add);
  }
  *out = bytes;
  return true;
}

bool parseInt(std::string_view text, int64_t min, int64_t max, int64_t* out, std::string* error) {
  const std::string_view s = trim(text);
  auto fail = [&](const std::string& why) {
    if (error) *error = "invalid integer '" + std::string(text) + "': " + why;
    return false;
  };
  if (s.empty()) return fail("empty");
  size_t i = 0;
  bool neg = false;
  if (s[0] == '-' || s[0] == '+') {
    neg = s[0] == '-';
    i = 1;
  }
  if (i == s.size()) return fail("expected digits");
  unsigned __int128 v = 0;
  for (; i < s.size(); ++i) {
    if (!std::isdigit(static_cast<unsigned char>(s[i]))) return fail("not a number");
    v = v * 10 + static_cast<unsigned>(s[i] - '0');
    if (v > (static_cast<unsigned __int128>(1) << 64)) return fail("too large");
  }
  const __int128 sv = neg ? -static_cast<__int128>(v) : static_cast<__int128>(v);
  if (sv < min || sv > max)
    return fail("out of range " + std::to_string(min) + ".." + std::to_string(max));
  *out = static_cast<int64_t>(sv);
  return true;
}

std::string jsonQuoted(std::string_view text) {
  std::string out = "\"";
  for (const char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (u < 0x20 || u == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", u);
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

std::string printable(std::string_view s, size_t max) {
  std::string r;
  const size_t n = s.size() < max ? s.size() : max;
  r.reserve(n + 16);
  for (size_t i = 0; i < n; ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c == '\n') {
      r += "\\n";
    } else if (c == '\t') {
      r += "\\t";
    } else if (c == '\r') {
      r += "\\r";
    } else if (c < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      r += buf;
    } else {
      r += static_cast<char>(c);
    }
  }
  if (s.size() > max) r += "...(" + std::to_string(s.size()) + " bytes)";
  return r;
}

namespace {

// Levenshtein distance; words are short (keys, verbs, profile and tenant names).
size_t editDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      const size_t sub = diag + (a[i - 1] == b[j - 1] ? 0 : 1);
      row[j] = std::min(std::min(row[j - 1] + 1, up + 1), sub);
      diag = up;
    }
  }
  return row[b.size()];
}

}  // namespace

std::string didYouMean(std::string_view word, const std::vector<std::string>& candidates) {
  if (word.size() > 64) return "";
  size_t best = 3;
  std::string bestName;
  for (const std::string& c : candidates) {
    const size_t d = editDistance(word, c);
    if (d < best && d < c.size()) {
      best = d;
      bestName = c;
    }
  }
  return bestName.empty() ? "" : "; did you mean '" + bestName + "'?";
}

std::string formatSize(uint64_t bytes) {
  static constexpr const char* kNames[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  double v = static_cast<double>(bytes);
  while (v >= 1024.0 && u < 6) {
    v /= 1024.0;
    ++u;
  }
  char buf[32];
  if (u == 0)
    std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(bytes));
  else if (v == std::floor(v))
    std::snprintf(buf, sizeof buf, "%.0f %s", v, kNames[u]);
  else
    std::snprintf(buf, sizeof buf, "%.2f %s", v, kNames[u]);
  return buf;
}

bool parsePercent(std::string_view text, uint32_t* milliPercent, std::string* reason) {
  const std::string expected = "expected a percentage such as '25%' or '12.5%'";
  std::string_view t = trim(text);
  if (t.empty() || t.back() != '%') return (*reason = expected, false);
  const std::string_view s = trim(t.substr(0, t.size() - 1));
  uint64_t whole = 0;
  size_t i = 0;
  for (; i < s.size() && s[i] >= '0' && s[i] <= '9'; ++i)
    whole = std::min<uint64_t>(whole * 10 + static_cast<uint64_t>(s[i] - '0'), 1000);  // saturates: over 100 anyway
  if (i == 0) return (*reason = expected, false);
  uint64_t frac = 0;
  size_t fracDigits = 0;
  if (i < s.size() && s[i] == '.') {
    for (++i; i < s.size() && s[i] >= '0' && s[i] <= '9'; ++i, ++fracDigits)
      if (fracDigits < 3) frac = frac * 10 + static_cast<uint64_t>(s[i] - '0');
    if (fracDigits == 0) return (*reason = "missing digits after '.'", false);
    if (fracDigits > 3) return (*reason = "at most 3 digits after '.'", false);
  }
  if (i != s.size()) return (*reason = expected, false);
  for (size_t d = fracDigits; d < 3; ++d) frac *= 10;
  const uint64_t value = whole * 1000 + frac;
  if (value == 0 || value > 100'000)
    return (*reason = "a percentage must be more than 0% and at most 100%", false);
  *milliPercent = static_cast<uint32_t>(value);
  return true;
}

}  // namespace cushare
