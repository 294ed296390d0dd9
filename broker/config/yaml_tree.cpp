// libyaml events -> yaml::Node tree (see yaml_tree.h for the subset accepted). The tree is built
// with an explicit stack, never by recursion, and its depth is capped, so hostile input can
// neither overflow the stack here nor in the recursive destructor of Node.
#include "yaml_tree.h"

#include <yaml.h>

#include <climits>
#include <cstdio>
#include <utility>

namespace cushare::broker::yaml {
namespace {

Mark toMark(const yaml_mark_t& m) {
  Mark r;
  r.line = m.line < static_cast<size_t>(INT_MAX) ? static_cast<int>(m.line) + 1 : INT_MAX;
  r.column = m.column < static_cast<size_t>(INT_MAX) ? static_cast<int>(m.column) + 1 : INT_MAX;
  return r;
}

// Line and column of a byte offset (reader errors carry an offset, not a mark).
Mark markAtOffset(std::string_view text, size_t offset) {
  if (offset > text.size()) offset = text.size();
  Mark m;
  size_t lineStart = 0;
  for (size_t i = 0; i < offset; ++i) {
    if (text[i] == '\n') {
      if (m.line < INT_MAX) ++m.line;
      lineStart = i + 1;
    }
  }
  const size_t col = offset - lineStart + 1;
  m.column = col < static_cast<size_t>(INT_MAX) ? static_cast<int>(col) : INT_MAX;
  return m;
}

std::string str(const char* s) { return s ? std::string(s) : std::string("unknown problem"); }

std::string syntaxError(const yaml_parser_t& p, std::string_view text, const std::string& name) {
  if (p.error == YAML_MEMORY_ERROR) return errorLine(name, Mark{}, "", "out of memory");
  if (p.error == YAML_READER_ERROR) {
    std::string why = "invalid input: " + str(p.problem);
    if (p.problem_value >= 0) {
      char buf[32];
      std::snprintf(buf, sizeof buf, " (0x%x)", static_cast<unsigned>(p.problem_value));
      why += buf;
    }
    return errorLine(name, markAtOffset(text, p.problem_offset), "", why);
  }
  std::string why = "YAML syntax error: " + str(p.problem);
  if (p.context) {
    const Mark c = toMark(p.context_mark);
    why += " (" + std::string(p.context) + " at line " + std::to_string(c.line) + " column " +
           std::to_string(c.column) + ")";
  }
  return errorLine(name, toMark(p.problem_mark), "", why);
}

std::string join(const std::string& parent, const std::string& key) {
  const std::string k = printable(key, 64);
  return parent.empty() ? k : parent + "." + k;
}

struct Frame {
  Node node;
  std::string path;
  bool expectKey = true;  // kMap: the next node is a key
};

// Turns the event stream into a tree. event() returns false with error_ set on the first problem.
class Builder {
 public:
  explicit Builder(const std::string& name) : name_(name) {}

  bool event(const yaml_event_t& e) {
    const Mark mark = toMark(e.start_mark);
    switch (e.type) {
      case YAML_DOCUMENT_START_EVENT:
        if (documents_++ > 0)
          return fail(mark, "",
                      "a second YAML document ('---'): the configuration is one document");
        return true;
      case YAML_STREAM_END_EVENT:
        done_ = true;
        return true;
      case YAML_ALIAS_EVENT:
        return fail(mark, pathOfNext(""),
                    "aliases (*" + printable(reinterpret_cast<const char*>(e.data.alias.anchor)) +
                        ") are not allowed: write the value out");
      case YAML_SCALAR_EVENT: {
        Node n;
        n.kind = Node::kScalar;
        n.mark = mark;
        n.text.assign(reinterpret_cast<const char*>(e.data.scalar.value), e.data.scalar.length);
        n.plain = e.data.scalar.style == YAML_PLAIN_SCALAR_STYLE;
        if (!checkProperties(mark, pathOfNext(n.text), e.data.scalar.anchor, e.data.scalar.tag))
          return false;
        return add(std::move(n));
      }
      case YAML_SEQUENCE_START_EVENT:
        return open(Node::kList, mark, e.data.sequence_start.anchor, e.data.sequence_start.tag);
      case YAML_MAPPING_START_EVENT:
        return open(Node::kMap, mark, e.data.mapping_start.anchor, e.data.mapping_start.tag);
      case YAML_SEQUENCE_END_EVENT:
      case YAML_MAPPING_END_EVENT: {
        if (stack_.empty()) return fail(mark, "", "unbalanced end of a collection");
        Frame f = std::move(stack_.back());
        stack_.pop_back();
        return add(std::move(f.node));
      }
      default:  // stream start, document end, no event
        return true;
    }
  }

  bool done() const { return done_; }
  bool hasRoot() const { return hasRoot_; }
  Node& root() { return root_; }
  const std::string& error() const { return error_; }

 private:
  bool fail(Mark mark, const std::string& path, const std::string& why) {
    error_ = errorLine(name_, mark, path, why);
    return false;
  }

  bool nextIsKey() const {
    return !stack_.empty() && stack_.back().node.kind == Node::kMap && stack_.back().expectKey;
  }

  // The field path of the node about to be added (keyText: its text, if it turns out to be a key).
  std::string pathOfNext(const std::string& keyText) const {
    if (stack_.empty()) return "";
    const Frame& top = stack_.back();
    if (top.node.kind == Node::kList)
      return top.path + "[" + std::to_string(top.node.items.size()) + "]";
    if (top.expectKey) return join(top.path, keyText);
    return join(top.path, top.node.keys.back().text);
  }

  bool checkProperties(Mark mark, const std::string& path, const yaml_char_t* anchor,
                       const yaml_char_t* tag) {
    if (anchor)
      return fail(mark, path,
                  "anchors (&" + printable(reinterpret_cast<const char*>(anchor)) +
                      ") are not allowed: write each value out");
    if (tag)
      return fail(mark, path,
                  "tags (" + printable(reinterpret_cast<const char*>(tag)) +
                      ") are not allowed: values are read as plain text");
    return true;
  }

  bool open(Node::Kind kind, Mark mark, const yaml_char_t* anchor, const yaml_char_t* tag) {
    const std::string path = pathOfNext("");
    if (nextIsKey())
      return fail(mark, stack_.back().path.empty() ? "" : stack_.back().path,
                  std::string("a map key must be a scalar, not ") +
                      (kind == Node::kMap ? "a map" : "a list"));
    if (!checkProperties(mark, path, anchor, tag)) return false;
    if (stack_.size() >= static_cast<size_t>(kMaxDepth))
      return fail(mark, path, "nested deeper than " + std::to_string(kMaxDepth) + " levels");
    Frame f;
    f.node.kind = kind;
    f.node.mark = mark;
    f.path = path;
    stack_.push_back(std::move(f));
    return true;
  }

  bool add(Node n) {
    if (stack_.empty()) {
      root_ = std::move(n);
      hasRoot_ = true;
      return true;
    }
    Frame& top = stack_.back();
    if (top.node.kind == Node::kList) {
      top.node.items.push_back(std::move(n));
      return true;
    }
    if (!top.expectKey) {
      top.node.items.push_back(std::move(n));
      top.expectKey = true;
      return true;
    }
    for (const Node& k : top.node.keys) {
      if (k.text == n.text)
        return fail(n.mark, join(top.path, n.text),
                    "duplicate key '" + printable(n.text) + "' (first at line " +
                        std::to_string(k.mark.line) + " column " + std::to_string(k.mark.column) +
                        ")");
    }
    top.node.keys.push_back(std::move(n));
    top.expectKey = false;
    return true;
  }

  const std::string& name_;
  std::vector<Frame> stack_;
  Node root_;
  bool hasRoot_ = false;
  bool done_ = false;
  int documents_ = 0;
  std::string error_;
};

}  // namespace


std::string errorLine(const std::string& name, Mark mark, const std::string& path,
                      const std::string& reason) {
  std::string line = name + ":" + std::to_string(mark.line) + ":" + std::to_string(mark.column) +
                     ": " + (path.empty() ? "" : path + ": ") + reason;
  return printable(line, 4096);  // reasons from shared parsers may quote raw values
}

std::string describe(const Node& node) {
  if (node.kind == Node::kMap) return "a map";
  if (node.kind == Node::kList) return "a list";
  if (isNull(node)) return "an empty value";
  return "'" + printable(node.text) + "'";
}

bool isNull(const Node& node) {
  if (node.kind != Node::kScalar || !node.plain) return false;
  const std::string& t = node.text;
  return t.empty() || t == "~" || t == "null" || t == "Null" || t == "NULL";
}

bool parseDocument(std::string_view text, const std::string& name, Node* root, std::string* error) {
  yaml_parser_t parser;
  if (!yaml_parser_initialize(&parser)) {
    if (error) *error = errorLine(name, Mark{}, "", "out of memory");
    return false;
  }
  yaml_parser_set_input_string(&parser, reinterpret_cast<const unsigned char*>(text.data()),
                               text.size());
  Builder b(name);
  std::string err;
  while (!b.done()) {
    yaml_event_t e;
    if (!yaml_parser_parse(&parser, &e)) {
      err = syntaxError(parser, text, name);
      break;
    }
    const bool ok = b.event(e);
    yaml_event_delete(&e);
    if (!ok) {
      err = b.error();
      break;
    }
  }
  yaml_parser_delete(&parser);
  if (err.empty() && !b.hasRoot())
    err = errorLine(name, Mark{}, "", "the file is empty: it holds no settings");
  if (!err.empty()) {
    if (error) *error = std::move(err);
    return false;
  }
  *root = std::move(b.root());
  return true;
}

}  // namespace cushare::broker::yaml
