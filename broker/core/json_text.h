// Text inside a JSON string, for the broker's JSON log lines (--log-format json).
#pragma once

#include <string>
#include <string_view>

namespace cushare::broker {

// Appends text to *out as the inside of a JSON string: quotes, backslashes and control characters
// escaped, well-formed UTF-8 (RFC 3629: no overlong forms, no surrogates, at most U+10FFFF) kept
// as it is, and every byte of anything else as U+FFFD, so that every line parses.
void appendJsonEscaped(std::string_view text, std::string* out);

}  // namespace cushare::broker
