// The control API on the wire: framing, request validation, and the client's call().
// Reference: docs/operations.md; schema: control.proto.
//
// Invariants:
// - A frame is a 4-byte little-endian length, then that many bytes of one serialised message.
//   A connection carries exactly one request frame and then one response frame.
// - decodeRequest is the broker's only way in: a request it accepts is well formed (version,
//   body, tenant names, memory amount, device >= -1). What needs the broker's state (does the
//   tenant exist, is the device index in range, may this peer change limits) is the broker's.
// - Every error is one line, with control characters of quoted input escaped.
// - Unknown fields are ignored, so an older broker accepts a newer client's additions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "control.pb.h"

namespace cushare::rpc {

inline constexpr size_t kMaxRequestBytes = 64 * 1024;
inline constexpr size_t kMaxResponseBytes = 16 << 20;
inline constexpr uint32_t kProtocolVersion = 1;

// The length prefix and the serialised message.
std::string frame(const google::protobuf::MessageLite& m);

// Reassembles one frame from the pieces a non-blocking socket delivers. After kDone, payload()
// holds the message bytes; after kError, *err says why and every later feed fails the same way.
class FrameReader {
 public:
  enum Status { kNeedMore, kDone, kError };

  explicit FrameReader(size_t maxPayload);

  // Takes the next n bytes. kError for a length over maxPayload or bytes after the frame.
  Status feed(const char* data, size_t n, std::string* err);
  const std::string& payload() const { return payload_; }
  // Why the bytes so far are not a frame, for a peer that closed the connection before kDone.
  std::string incompleteReason() const;

 private:
  size_t maxPayload_;
  char header_[4] = {};
  size_t headerBytes_ = 0;
  size_t length_ = 0;
  std::string payload_;
  Status status_ = kNeedMore;
  std::string error_;
};

// A memory amount of set-limit: exactly one of the two is non-zero.
struct MemoryValue {
  uint64_t bytes = 0;
  uint32_t milliPercent = 0;  // of the device's capacity; 25% is 25000, 100% is 100000
};

// "512MiB", "8GiB", "1073741824" (see cushare::parseSize; not zero), or "N%" / "N.NNN%" with
// 0 < N <= 100 and at most three decimals.
bool parseMemoryAmount(std::string_view text, MemoryValue* out, std::string* err);

// The checks of decodeRequest on a message already in memory (the CLI runs them before it sends).
bool validateRequest(const Request& req, std::string* err);

// Parses a request payload and validates it.
bool decodeRequest(std::string_view payload, Request* out, std::string* err);

// Decodes everything a client sent on one connection, as the broker does: exactly one frame of
// at most kMaxRequestBytes, then decodeRequest.
bool decodeRequestFrame(std::string_view bytes, Request* out, std::string* err);

// How call() deals with the broker.
struct CallOptions {
  int timeoutMs = 10000;  // per attempt: connecting, sending the request, reading the response
  // While the broker answers busy (or its listen backlog is full), try again with backoff (50 ms
  // doubling to 400 ms) for up to this long, then fail with "broker busy: ...". 0: no retry; a
  // busy answer is returned like any refusal (ok false, busy true).
  int busyRetryMs = 0;
  // Whom the answer is trusted from: the server's uid (SO_PEERCRED, reported by the kernel) must
  // be 0, the caller's own effective uid, or one of these. Anyone can listen on a socket in a
  // directory they own; an answer from such a server (a fake ledger_dir for `cushare env`, made-up
  // tables) is refused before the request is sent.
  std::vector<uint32_t> trustedUids;
};

// One round trip to the broker: connect, check who listens, send req, wait for the response.
// Returns false with *err set (one line) when there is no well-formed response from a trusted
// server; a response with ok == false is still a successful call, and the caller reports
// resp->error().
bool call(const std::string& socketPath, const Request& req, Response* resp, std::string* err,
          const CallOptions& options);
bool call(const std::string& socketPath, const Request& req, Response* resp, std::string* err,
          int timeoutMs = 10000);

// The fuzz target's body, shared with the unit tests that replay the corpus: decodes data as one
// connection's bytes, whole and again in pieces, and aborts if the two disagree or an error is not
// exactly one non-empty line. Returns 1 if the request was accepted, 0 if rejected.
int decodeForFuzzing(const uint8_t* data, size_t n);

}  // namespace cushare::rpc
