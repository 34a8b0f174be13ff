// What train_config.cpp (the sections) shares with train_config_overrides.cpp (the --set overrides,
// and where each value came from) and train_config_yaml.cpp (guards around yaml-cpp). Private to sp-train.
#pragma once

#include "train_config.h"

#include <cstddef>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <yaml-cpp/yaml.h>

namespace sp::train::detail {

// Where a key's value came from: the config file, or the command-line flag that overrode it.
class Origins {
 public:
  // A section an override created because the file did not have it (`trian` for
  // `--set trian.steps=3`), with the override that created it.
  using Created = std::vector<std::pair<std::string, const Override*>>;

  Origins(const std::string& file, const std::vector<Override>& overrides, Created created)
      : file_(file), overrides_(overrides), created_(std::move(created)) {}

  // The last override that set `key_path` or a key above it, or that created the section
  // `key_path`; else the file.
  std::string of(std::string_view key_path) const;

 private:
  // `inner` is `outer` or a key below it.
  static bool within(std::string_view inner, std::string_view outer);

  const std::string& file_;
  const std::vector<Override>& overrides_;
  Created created_;
};

// Sets the override's key in `root`, creating the sections on its path that are missing (each
// recorded in `created`); `source` names the config in messages.
void apply_override(YAML::Node& root, const Override& override, const std::string& source, Origins::Created& created);

// The number of YAML documents in `text`, without yaml-cpp's LoadAll.
std::size_t count_documents(const std::string& text, const std::string& source_name);

// Throws ConfigError at a carriage return that ends no line.
void refuse_lone_carriage_returns(const std::string& text, const std::string& source_name);

// A copy of the map `node` in which `key` holds a map of its own (train_config_yaml.cpp).
YAML::Node with_own_map(const YAML::Node& node, const std::string& key);

// The first key path whose value or key the run's config.yaml could not keep, and why; nullopt
// when there is none. `visited` starts empty.
std::optional<std::pair<std::string, std::string>> find_unkeepable(const YAML::Node& node, const std::string& path,
                                                                   std::multimap<int, YAML::Node>& visited);

}  // namespace sp::train::detail
