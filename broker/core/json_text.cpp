// Text inside a JSON string; see json_text.h.
#include "core/json_text.h"

#include <cstdio>

namespace cushare::broker {

void appendJsonEscaped(std::string_view text, std::string* out) {
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  for (size_t i = 0; i < n;) {
    const unsigned char c = p[i];
    if (c == '"' || c == '\\') {
      out->push_back('\\');
      out->push_back(static_cast<char>(c));
      ++i;
      continue;
    }
    if (c < 0x20 || c == 0x7f) {
      char e[8];
      std::snprintf(e, sizeof e, "\\u%04x", c);
      out->append(e);
      ++i;
      continue;
    }
    if (c < 0x80) {
      out->push_back(static_cast<char>(c));
      ++i;
      continue;
    }
    const size_t len = c >= 0xc2 && c <= 0xdf ? 2 : c >= 0xe0 && c <= 0xef ? 3 : c >= 0xf0 && c <= 0xf4 ? 4 : 0;
    bool ok = len != 0 && i + len <= n;
    for (size_t k = 1; ok && k < len; ++k) ok = (p[i + k] & 0xc0) == 0x80;
    if (ok) {
      const unsigned char d = p[i + 1];  // the second byte's range depends on the first
      ok = !(c == 0xe0 && d < 0xa0) && !(c == 0xed && d > 0x9f) && !(c == 0xf0 && d < 0x90) && !(c == 0xf4 && d > 0x8f);
    }
    if (ok) {
      out->append(reinterpret_cast<const char*>(p + i), len);
      i += len;
    } else {
      out->append("\\ufffd");
      ++i;
    }
  }
}

}  // namespace cushare::broker
