// The verbs of the `cushare` CLI: argument checks, one request to the broker, the printed reply.
//
// Exit codes: 0 success; 1 the broker (or the connection to it) failed, with its message; 2 a
// usage error, one line with a hint; `run` ends with the command's own status, or 127 when it
// cannot be executed.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace cushare::cli {

inline constexpr int kExitFailed = 1;
inline constexpr int kExitUsage = 2;

// How long the CLI keeps trying while the broker says busy.
inline constexpr int kBusyRetryMs = 2000;

struct Globals {
  std::string socket;
  bool json = false;  // replies and errors as JSON on stdout (--json before or after the verb)
  std::vector<uint32_t> brokerUids;  // trusted besides root and the caller (--broker-user)
};

// Runs verb with the arguments that follow it.
int runVerb(const Globals& g, const std::string& verb, const std::vector<std::string>& args);

// An error line: "cushare: message" on stderr, or {"error": "message"} on stdout with --json.
int report(const Globals& g, int exitCode, const std::string& message);

// The verbs' usage lines and summaries, for --help.
void printVerbs(FILE* out);

}  // namespace cushare::cli
