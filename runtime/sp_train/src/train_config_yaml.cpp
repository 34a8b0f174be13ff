// Guards around yaml-cpp, each for a way fuzzing found it to mistake the training config's text
// or to write back a config.yaml that does not read back as the config the run read.
#include "train_config_impl.h"

#include <algorithm>
#include <sstream>
#include <string>

#include <fmt/format.h>
#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

namespace sp::train::detail {

// YAML reads a carriage return that ends no line (no line feed after it) as a line break, but
// yaml-cpp keeps it as part of a plain scalar, and writes the scalar back unquoted: one such
// return before a line end then reads back as a line break, so the config.yaml a run keeps
// would not read back as the config it ran (found by fuzzing, docs/fuzzing.md). Refused
// rather than guessed at: no config needs one.
void refuse_lone_carriage_returns(const std::string& text, const std::string& source_name) {
  std::size_t line = 1, line_start = 0;
  for (std::size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '\r' && (i + 1 == text.size() || text[i + 1] != '\n')) {
      throw ConfigError(
          fmt::format("{}: line {}, column {}: a carriage return that ends no line (expected \\n or \\r\\n line ends)",
                      source_name, line, i - line_start + 1));
    }
    if (text[i] == '\n') {
      ++line;
      line_start = i + 1;
    }
  }
}

namespace {

// Counts the YAML documents of `text`. Not YAML::LoadAll: on some malformed text (a stray ','
// where a document's first node should start) yaml-cpp 0.7's parser reports empty documents
// forever without consuming anything, and LoadAll collects them until memory runs out (found
// by fuzzing, docs/fuzzing.md). Each document must start past the one before.
class DocumentStarts final : public YAML::EventHandler {
 public:
  void OnDocumentStart(const YAML::Mark& mark) override { last = mark; }
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark&, YAML::anchor_t) override {}
  void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t, const std::string&) override {}
  void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {}
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {}
  void OnMapEnd() override {}
  YAML::Mark last = YAML::Mark::null_mark();
};

}  // namespace

std::size_t count_documents(const std::string& text, const std::string& source_name) {
  std::istringstream in(text);
  YAML::Parser parser(in);
  DocumentStarts starts;
  std::size_t documents = 0;
  int previous_pos = -1;
  while (parser.HandleNextDocument(starts)) {
    if (starts.last.pos <= previous_pos) {
      throw ConfigError(fmt::format("{}: not valid YAML: line {}, column {}: no node can start here", source_name,
                                    starts.last.line + 1, starts.last.column + 1));
    }
    previous_pos = starts.last.pos;
    ++documents;
  }
  return documents;
}

// A new map with `node`'s entries in order (their values shared, not copied), in which `key`
// holds a new map of its own: the old value's entries if it was a map, else none. Neither
// `node` nor its old value is written.
YAML::Node with_own_map(const YAML::Node& node, const std::string& key) {
  const auto shallow_copy = [](const YAML::Node& map) {
    YAML::Node copy(YAML::NodeType::Map);
    if (map.IsMap()) {
      for (const auto& entry : map) copy.force_insert(entry.first, entry.second);
    }
    return copy;
  };
  YAML::Node copy(YAML::NodeType::Map);
  bool found = false;
  if (node.IsMap()) {
    for (const auto& entry : node) {
      const bool is_key = entry.first.IsScalar() && entry.first.Scalar() == key;
      copy.force_insert(entry.first, is_key ? shallow_copy(entry.second) : entry.second);
      found = found || is_key;
    }
  }
  if (!found) copy.force_insert(key, YAML::Node(YAML::NodeType::Map));
  return copy;
}

namespace {

// Well-formed UTF-8 (RFC 3629: no overlong forms, no surrogates, nothing past U+10FFFF).
// yaml-cpp keeps other bytes as they are when it reads them, writes them back as they are,
// and reads its own output with each bad sequence replaced by U+FFFD: the scalar changes.
bool is_utf8(const std::string& text) {
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  const auto* end = p + text.size();
  while (p < end) {
    const unsigned char lead = *p++;
    if (lead < 0x80) continue;
    int more = 0;
    unsigned char low = 0x80, high = 0xbf;  // the allowed range of the first continuation byte
    if (lead >= 0xc2 && lead <= 0xdf) {
      more = 1;
    } else if (lead >= 0xe0 && lead <= 0xef) {
      more = 2;
      if (lead == 0xe0) low = 0xa0;
      if (lead == 0xed) high = 0x9f;
    } else if (lead >= 0xf0 && lead <= 0xf4) {
      more = 3;
      if (lead == 0xf0) low = 0x90;
      if (lead == 0xf4) high = 0x8f;
    } else {
      return false;
    }
    if (end - p < more || *p < low || *p > high) return false;
    for (++p, --more; more > 0; --more, ++p) {
      if ((*p & 0xc0) != 0x80) return false;
    }
  }
  return true;
}

}  // namespace

// What the run's config.yaml, written by yaml-cpp's emitter, could not keep, as a key path and
// why (found by fuzzing, docs/fuzzing.md):
//   - bytes that are not UTF-8 in a scalar (is_utf8());
//   - a carriage return in a scalar, key or value, however it got there (a quoted "\r", or
//     yaml-cpp's reading of a NUL byte before an 'r'): the emitter writes it unquoted;
//   - a key longer than kMaxKeyBytes or with control characters: the emitter writes it as an
//     implicit key, which YAML limits to 1024 characters (escapes count four each), so the
//     text would not read back. Keys are names; none needs either.
// The walk visits each parsed node once (an alias points at a node already seen), so an aliased
// or recursive document costs its size, not its expansion. `visited` holds the nodes seen by
// their position (a map and its first key share one), compared by identity.
constexpr std::size_t kMaxKeyBytes = 256;

std::optional<std::pair<std::string, std::string>> find_unkeepable(const YAML::Node& node, const std::string& path,
                                                                   std::multimap<int, YAML::Node>& visited) {
  const YAML::Mark mark = node.Mark();
  if (!mark.is_null()) {
    const auto [first, last] = visited.equal_range(mark.pos);
    if (std::any_of(first, last, [&](const auto& seen) { return seen.second.is(node); })) return std::nullopt;
    visited.emplace(mark.pos, node);
  }
  if (node.IsScalar()) {
    if (!is_utf8(node.Scalar())) {
      return std::pair{path, std::string("holds bytes that are not UTF-8, which the run's config.yaml could not keep")};
    }
    if (node.Scalar().find('\r') == std::string::npos) return std::nullopt;
    return std::pair{path,
                     std::string("holds a carriage return, which the run's config.yaml could not keep; expected none")};
  }
  std::size_t index = 0;
  for (auto it = node.begin(); it != node.end(); ++it, ++index) {
    if (node.IsSequence()) {
      if (auto found = find_unkeepable(*it, fmt::format("{}[{}]", path, index), visited)) return found;
      continue;
    }
    const std::string key = it->first.IsScalar() ? it->first.Scalar() : fmt::format("<key {}>", index);
    const std::string child = path.empty() ? key : path + "." + key;
    if (auto found = find_unkeepable(it->first, child, visited)) return found;
    if (it->first.IsScalar()) {
      const bool control =
          std::any_of(key.begin(), key.end(), [](char c) { return static_cast<unsigned char>(c) < 0x20 || c == 0x7f; });
      if (key.size() > kMaxKeyBytes || control) {
        const std::string shown = key.size() > 40 ? key.substr(0, 40) + "..." : key;
        return std::pair{path.empty() ? shown : path + "." + shown,
                         fmt::format("a key of {} bytes{}; expected a name of at most {} bytes without control "
                                     "characters",
                                     key.size(), control ? " with control characters" : "", kMaxKeyBytes)};
      }
    }
    if (auto found = find_unkeepable(it->second, child, visited)) return found;
  }
  return std::nullopt;
}

}  // namespace sp::train::detail
