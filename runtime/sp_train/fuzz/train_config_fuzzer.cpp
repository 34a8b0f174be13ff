// Fuzzes sp-train's config reader (runtime/sp_train/src/train_config.h): parse_override on
// --set arguments and parse_train_config on the YAML text with those overrides applied.
//
// Input: the config text, optionally followed by a line "#--set" and then one override per
// line, as on the command line ("train.steps=3"); a line starting with "L:" is a literal
// override (the value taken as a string, as for sp-train's path options).
//
// Contract checked (train_config.h, train_error.h):
//   - parse_override and parse_train_config either succeed or throw sp::train::ConfigError
//     (exit code 2, "the user's mistake"); anything else, a std::logic_error above all (a bug
//     in sp-train by train_error.h's rule), escapes and the fuzzer reports it;
//   - an accepted config's resolved_yaml (what the run directory keeps as config.yaml) parses
//     again, with no overrides, to the same YAML document (compared node by node: the emitter
//     may lay out an empty mapping differently the second time), and a third parse gives the
//     second text exactly (a fixed point).
// Any violation aborts.
#include "fuzz_support.h"
#include "train_config.h"

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <yaml-cpp/yaml.h>

namespace {

[[noreturn]] void fail(const std::string &what) { sp::fuzz::contract_violated("train_config_fuzzer", what); }

constexpr const char *kSeparator = "\n#--set\n";

// A node-by-node comparison. YAML aliases can make a document recursive (sp-train accepts
// "memory: &m {stagehand: {selective_precision: *m}}": the policy section is the plugin's to
// refuse), so the walk stops at a depth and after a budget of nodes, counting what it has not
// disproved as equal.
bool same_node(const YAML::Node &a, const YAML::Node &b, int depth, long &budget) {
  if (depth > 64 || --budget < 0) return true;
  if (a.Type() != b.Type()) return false;
  switch (a.Type()) {
    case YAML::NodeType::Scalar:
      return a.Scalar() == b.Scalar();
    case YAML::NodeType::Sequence:
      if (a.size() != b.size()) return false;
      for (std::size_t i = 0; i < a.size(); ++i) {
        if (!same_node(a[i], b[i], depth + 1, budget)) return false;
      }
      return true;
    case YAML::NodeType::Map: {
      if (a.size() != b.size()) return false;
      auto ia = a.begin();
      auto ib = b.begin();
      for (; ia != a.end(); ++ia, ++ib) {
        if (!same_node(ia->first, ib->first, depth + 1, budget) || !same_node(ia->second, ib->second, depth + 1, budget)) {
          return false;
        }
      }
      return true;
    }
    default:
      return true;
  }
}

// Both texts were emitted by yaml-cpp from documents sp-train accepted, so they load.
bool same_document(const std::string &a, const std::string &b) {
  long budget = 100000;
  return same_node(YAML::Load(a), YAML::Load(b), 0, budget);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t *data, std::size_t size) {
  const std::string input(reinterpret_cast<const char *>(data), size);
  const std::size_t split = input.find(kSeparator);
  const std::string text = input.substr(0, split);
  std::vector<sp::train::Override> overrides;
  try {
    if (split != std::string::npos) {
      std::size_t pos = split + std::string(kSeparator).size();
      while (pos <= input.size() && overrides.size() < 16) {
        std::size_t end = input.find('\n', pos);
        if (end == std::string::npos) end = input.size();
        std::string line = input.substr(pos, end - pos);
        pos = end + 1;
        // A command-line argument is a C string: it can hold no NUL byte.
        if (line.empty() || line.find('\0') != std::string::npos) continue;
        const bool literal = line.rfind("L:", 0) == 0;
        if (literal) line.erase(0, 2);
        sp::train::Override override = sp::train::parse_override(line);
        override.literal = literal;
        overrides.push_back(std::move(override));
      }
    }
    const sp::train::TrainConfig config = sp::train::parse_train_config(text, "fuzz.yaml", overrides);
    sp::train::TrainConfig again;
    try {
      again = sp::train::parse_train_config(config.resolved_yaml, "config.yaml");
    } catch (const sp::train::ConfigError &error) {
      fail(std::string("an accepted config's resolved_yaml is rejected: ") + error.what() + "\n--- resolved_yaml:\n" +
           config.resolved_yaml);
    }
    if (!same_document(config.resolved_yaml, again.resolved_yaml)) {
      fail("resolved_yaml does not parse to the same document:\n--- first:\n" + config.resolved_yaml +
           "--- again:\n" + again.resolved_yaml);
    }
    const sp::train::TrainConfig third = sp::train::parse_train_config(again.resolved_yaml, "config.yaml");
    if (third.resolved_yaml != again.resolved_yaml) fail("resolved_yaml is no fixed point after one round");
  } catch (const sp::train::ConfigError &error) {
    if (std::string(error.what()).empty()) fail("a ConfigError without a message");
    if (error.exit_code() != sp::train::ExitCode::bad_config) fail("a ConfigError with another exit code");
  }
  return 0;
}
