// Parsing of sizes and small enums shared by the shim, the broker and simgpu.
// Pure functions: no allocation beyond the error string, no global state, so they are safe to call
// before main and from a forked child. Every failure returns a specific, human-readable reason.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace cushare {

// Parses a byte size: plain bytes ("1048576"), binary units ("512MiB", "8GiB", "1.5Gi", and the
// bare letters "K", "M", "G", "T", which are binary as in docker and most GPU tools), or decimal
// units ("8GB", "500MB"). Unit letters are case-insensitive; whitespace around the number and
// between number and unit is allowed. Rejects empty input, negative numbers, fractions of a byte
// (e.g. "1.5" with no unit), overflow past 2^64-1, and trailing garbage.
bool parseSize(std::string_view text, uint64_t* out, std::string* error);

// Parses a decimal integer in [min, max]. Rejects signs outside the range, garbage and overflow.
bool parseInt(std::string_view text, int64_t min, int64_t max, int64_t* out, std::string* error);

// Parses a share of a device in percent, "25%", "12.5%", "0.001%" (whitespace around the number
// allowed), into thousandths of a percent (25% is 25000). At most three decimals; more than 0%
// and at most 100%. *reason is a fragment ("missing digits after '.'") that callers prefix with
// what they were parsing.
bool parsePercent(std::string_view text, uint32_t* milliPercent, std::string* reason);

// Formats bytes for humans: "512 MiB", "1.50 GiB", "100 B".
std::string formatSize(uint64_t bytes);

// For quoting a value in a one-line message: control characters escaped (\n, \t, \r, \xNN) and
// the text shortened to max bytes, with its full length noted.
std::string printable(std::string_view text, size_t max);

// A JSON string literal of text: quotes, backslashes and control characters (DEL too) escaped.
std::string jsonQuoted(std::string_view text);

// "; did you mean 'x'?" for the candidate closest to word within two edits (Levenshtein), or "".
std::string didYouMean(std::string_view word, const std::vector<std::string>& candidates);

// Removes leading and trailing ASCII whitespace.
std::string_view trim(std::string_view text);

}  // namespace cushare
