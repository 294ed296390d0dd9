// A small, strict YAML reader for the broker's configuration: libyaml's event parser turned into a
// tree of maps, lists and scalars that keeps each node's line and column.
//
// Invariants:
// - The subset is deliberately small so that a file means what it looks like: one document;
//   anchors, aliases and explicit tags are refused; map keys are scalars and unique (compared as
//   written); nesting is at most kMaxDepth levels (so no recursion over the tree can run deep).
// - Scalars are kept as text. YAML 1.1 type guessing (yes/no, 0x10, 1e3) never happens here; the
//   schema code parses the text of each field itself.
// - Every error is one line: `<name>:<line>:<column>: [<field path>: ]<reason>`, lines and
//   columns counted from 1.
#pragma once

#include "cushare/parse.h"

#include <string>
#include <string_view>
#include <vector>

namespace cushare::broker::yaml {

inline constexpr int kMaxDepth = 32;

struct Mark {
  int line = 1;    // 1-based
  int column = 1;  // 1-based, in characters
};

struct Node {
  enum Kind { kScalar, kMap, kList };
  Kind kind = kScalar;
  Mark mark;                // where the node starts (for a map entry's value: the value)
  std::string text;         // kScalar: the value, escapes resolved
  bool plain = false;       // kScalar: written without quotes (an empty plain scalar is YAML null)
  std::vector<Node> keys;   // kMap: keys, all kScalar, in the order written
  std::vector<Node> items;  // kMap: values, parallel to keys; kList: the items
};

// Parses text as exactly one YAML document into *root. On failure sets *error to one line
// (name is the file name used in it) and returns false; *root is then unspecified.
bool parseDocument(std::string_view text, const std::string& name, Node* root, std::string* error);

// "<name>:<line>:<column>: <path>: <reason>" (the "<path>: " part only when path is not empty),
// with control characters escaped so the result is always one line.
std::string errorLine(const std::string& name, Mark mark, const std::string& path,
                      const std::string& reason);

// Escapes control characters and shortens s to max bytes, for quoting values in messages.
inline std::string printable(std::string_view s, size_t max = 64) { return ::cushare::printable(s, max); }

// "a map", "a list", "an empty value", "a scalar": what a node is, for "expected X, found Y".
std::string describe(const Node& node);

// True for a plain scalar that YAML reads as null: empty, "~", "null", "Null", "NULL".
bool isNull(const Node& node);

}  // namespace cushare::broker::yaml
