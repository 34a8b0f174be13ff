// The --set overrides of the training config: reading one from the command line, applying it
// to the document, and naming the flag in messages about a key it set.
#include "train_config_impl.h"

#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include "sp/yaml_diagnostics/yaml_diagnostics.h"

namespace sp::train {
namespace detail {
namespace {

using yaml_diagnostics::describe;

// How the user wrote an override, for messages about it.
std::string given_as(const Override& override) {
  return override.given_as.empty() ? fmt::format("--set {}={}", override.key_path, override.value) : override.given_as;
}

}  // namespace

std::string Origins::of(std::string_view key_path) const {
  for (auto o = overrides_.rbegin(); o != overrides_.rend(); ++o) {
    if (within(key_path, o->key_path)) return given_as(*o);
  }
  for (const auto& [section, creator] : created_) {
    if (section == key_path) return given_as(*creator);
  }
  return file_;
}

bool Origins::within(std::string_view inner, std::string_view outer) {
  return inner == outer ||
         (inner.size() > outer.size() && inner.substr(0, outer.size()) == outer && inner[outer.size()] == '.');
}

void apply_override(YAML::Node& root, const Override& override, const std::string& source, Origins::Created& created) {
  YAML::Node value;
  if (override.literal) {
    value = YAML::Node(override.value);
  } else {
    try {
      value = YAML::Load(override.value);
    } catch (const YAML::Exception& e) {
      throw ConfigError(fmt::format("{}: the value is not valid YAML: {}", given_as(override), e.msg));
    }
  }
  if (!value.IsDefined()) value.reset(YAML::Node(YAML::NodeType::Null));
  std::vector<std::string> keys;
  std::stringstream path(override.key_path);
  for (std::string key; std::getline(path, key, '.');) {
    if (key.empty() || override.key_path.back() == '.') {
      throw ConfigError(fmt::format("{}: empty key in the key path", given_as(override)));
    }
    keys.push_back(key);
  }
  // yaml-cpp nodes are handles: operator[] on them edits the document itself.
  YAML::Node node = root;
  std::string walked;
  for (std::size_t i = 0; i + 1 < keys.size(); ++i) {
    walked += (i ? "." : "") + keys[i];
    YAML::Node child = node[keys[i]];
    if (!child.IsDefined() || child.IsNull()) {
      node[keys[i]] = YAML::Node(YAML::NodeType::Map);
      child.reset(node[keys[i]]);
      created.emplace_back(walked, &override);
    } else if (!child.IsMap()) {
      throw ConfigError(
          fmt::format("{}: {}: {} is {}, not a mapping", given_as(override), source, walked, describe(child)));
    }
    node.reset(child);
  }
  node[keys.back()] = value;
}

}  // namespace detail

Override parse_override(const std::string& argument) {
  const auto eq = argument.find('=');
  if (eq == std::string::npos || eq == 0) {
    throw ConfigError(fmt::format("--set {}: expected key.path=value", argument));
  }
  return Override{argument.substr(0, eq), argument.substr(eq + 1), "--set " + argument};
}

}  // namespace sp::train
