#include "sp/policy/config.h"

#include "sp/policy/budget.h"
#include "sp/policy/decision_rule.h"
#include "sp/policy/errors.h"
#include "sp/yaml_diagnostics/yaml_diagnostics.h"

#include <fmt/format.h>
#include <sp/precision_abi.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <optional>
#include <string_view>
#include <set>
#include <utility>

namespace sp::policy {
namespace {

using yaml_diagnostics::describe;
using yaml_diagnostics::is_plain_scalar;

constexpr const char *kTopLevelSection = "selective_precision";
constexpr const char *kTrainingConfigSection = "memory.stagehand.selective_precision";

#if SP_POLICY_EDITION >= 3
constexpr std::size_t kKnownKeyCount = 26;
#elif SP_POLICY_EDITION >= 2
constexpr std::size_t kKnownKeyCount = 25;
#else
constexpr std::size_t kKnownKeyCount = 20;
#endif
constexpr std::array<const char *, kKnownKeyCount> kKnownKeys = {
    "enabled",
    "mode",
    "bf16_threshold",
    "int8_threshold",
    "ambiguous_default",
    "hysteresis_margin",
    "grad_weight",
    "error_weight",
    "grad_sensitivity_threshold",
    "run_calibration",
    "calibration_samples",
    "quant_error_threshold",
    "warmup_steps",
    "history_window",
    "update_interval_steps",
    "min_steps_between_switches",
    "log_decisions",
    "telemetry_enabled",
    "telemetry_file",
    "nonfinite_to_bf16",
#if SP_POLICY_EDITION >= 2
    "tiers",
    "nf4_threshold",
    "nf4_quant_error_threshold",
    "nf4_group_size",
    "loss_guard",
#endif
#if SP_POLICY_EDITION >= 3
    "budget",
#endif
};

constexpr std::array<const char *, 6> kLossGuardKeys = {"enabled",  "window",      "sigmas",
                                                        "min_rise", "blame_steps", "penalty_steps"};
constexpr std::array<const char *, 2> kBudgetKeys = {"bytes", "loss"};

// "one of off, static, ...": the modes of this edition's rule modules.
std::string mode_choices() {
  std::string text;
  for (const RuleModule *module : rule_modules()) text += fmt::format("{}{}", text.empty() ? "one of " : ", ", module->name);
  return text;
}

// The rule key called `name` of any module of this edition, or null.
const RuleKey *rule_key_named(std::string_view name) {
  for (const RuleModule *module : rule_modules()) {
    for (const RuleKey &key : module->keys) {
      if (name == key.name) return &key;
    }
  }
  return nullptr;
}

// "bf16, int8, nf4": the tiers of a mask, in the routes' order. Built at each call, not kept in
// a namespace-scope string, whose static destructor would take an exit-handler slot at every
// load of the plugin (docs/plugin-abi.md, hot swaps).
std::string tier_list(sp_precision_mask tiers) {
  std::string text;
  for (Precision route : kPrecisions) {
    if ((tiers & SP_PRECISION_BIT(to_abi(route))) == 0) continue;
    text += text.empty() ? "" : ", ";
    text += sp::precision_name(route);
  }
  return text;
}

std::string tiers_text(sp_precision_mask tiers) { return "[" + tier_list(tiers) + "]"; }

class SectionReader {
 public:
  explicit SectionReader(std::string section_path) : section_path_(std::move(section_path)) {}

  std::string path(std::string_view key) const { return fmt::format("{}.{}", section_path_, key); }

  [[noreturn]] void fail(std::string_view key, std::string_view expected, const YAML::Node &found) const {
    throw PolicyConfigError(fmt::format("{}: expected {}, found {}", path(key), expected, describe(found)));
  }

  bool read_bool(std::string_view key, const YAML::Node &node) const {
    bool value = false;
    if (!is_plain_scalar(node) || !YAML::convert<bool>::decode(node, value)) {
      fail(key, "true or false", node);
    }
    return value;
  }

  double read_number(std::string_view key, const YAML::Node &node, std::string_view expected) const {
    double value = 0.0;
    if (!is_plain_scalar(node) || !YAML::convert<double>::decode(node, value)) {
      fail(key, expected, node);
    }
    return value;
  }

  std::int64_t read_integer(std::string_view key, const YAML::Node &node, std::string_view expected) const {
    std::int64_t value = 0;
    if (!is_plain_scalar(node) || !YAML::convert<std::int64_t>::decode(node, value)) {
      fail(key, expected, node);
    }
    return value;
  }

  std::string read_string(std::string_view key, const YAML::Node &node, std::string_view expected) const {
    if (!node.IsScalar()) fail(key, expected, node);
    return node.Scalar();
  }

  // A file name written as a plain scalar that YAML reads as a number or a boolean (`5`,
  // `true`) is a type error, as a string where a number belongs is one elsewhere; quoting
  // it makes it text.
  std::string read_file_name(std::string_view key, const YAML::Node &node) const {
    constexpr std::string_view kExpected = "a file name";
    double as_number = 0.0;
    bool as_bool = false;
    if (is_plain_scalar(node) &&
        (YAML::convert<double>::decode(node, as_number) || YAML::convert<bool>::decode(node, as_bool))) {
      fail(key, kExpected, node);
    }
    return read_string(key, node, kExpected);
  }

  std::vector<std::uint32_t> read_block_ids(std::string_view key, const YAML::Node &node,
                                            std::uint32_t n_blocks) const {
    const std::string expected = fmt::format("a list of block ids in [0, {}]", static_cast<std::int64_t>(n_blocks) - 1);
    if (node.IsNull()) return {};
    if (!node.IsSequence()) fail(key, expected, node);
    std::vector<std::uint32_t> ids;
    for (std::size_t i = 0; i < node.size(); ++i) {
      const std::string element = fmt::format("{}[{}]", key, i);
      const std::int64_t id = read_integer(element, node[i], expected);
      if (id < 0 || id >= static_cast<std::int64_t>(n_blocks)) {
        throw PolicyConfigError(fmt::format("{}: expected a block id in [0, {}] (the model has {} blocks), found {}",
                                      path(element), static_cast<std::int64_t>(n_blocks) - 1, n_blocks, id));
      }
      const auto block = static_cast<std::uint32_t>(id);
      if (std::find(ids.begin(), ids.end(), block) != ids.end()) {
        throw PolicyConfigError(fmt::format("{}: block {} is listed twice", path(element), block));
      }
      ids.push_back(block);
    }
    return ids;
  }

 private:
  std::string section_path_;
};

void require_range(const SectionReader &reader, std::string_view key, double value, double low, double high) {
  if (!(value >= low && value <= high)) {
    throw PolicyConfigError(fmt::format("{}: expected a number in [{}, {}], found {}", reader.path(key), low, high, value));
  }
}

void require_positive_finite(const SectionReader &reader, std::string_view key, double value) {
  if (!(value > 0.0 && std::isfinite(value))) {
    throw PolicyConfigError(fmt::format("{}: expected a finite number > 0, found {}", reader.path(key), value));
  }
}

void require_non_negative_finite(const SectionReader &reader, std::string_view key, double value) {
  if (!(value >= 0.0 && std::isfinite(value))) {
    throw PolicyConfigError(fmt::format("{}: expected a finite number >= 0, found {}", reader.path(key), value));
  }
}

void require_at_least(const SectionReader &reader, std::string_view key, std::int64_t value, std::int64_t low) {
  if (value < low) {
    throw PolicyConfigError(fmt::format("{}: expected an integer >= {}, found {}", reader.path(key), low, value));
  }
}

// Checks that relate several keys; single-key ranges were checked while reading.
void validate_relations(const SectionReader &reader, const PolicySettings &config) {
  if (config.int8_threshold >= config.bf16_threshold) {
    throw PolicyConfigError(fmt::format("{}: expected a value below bf16_threshold ({}), found {}",
                                  reader.path("int8_threshold"), config.bf16_threshold, config.int8_threshold));
  }
  if (!(config.hysteresis_margin >= 0.0 && config.hysteresis_margin <= config.int8_threshold)) {
    throw PolicyConfigError(fmt::format("{}: expected a number in [0, int8_threshold = {}], found {}",
                                  reader.path("hysteresis_margin"), config.int8_threshold, config.hysteresis_margin));
  }
  if (config.grad_weight == 0.0 && config.error_weight == 0.0) {
    throw PolicyConfigError(
        fmt::format("{}: grad_weight and error_weight are both 0, so every block would score 0; "
                    "expected at least one weight > 0",
                    reader.path("grad_weight")));
  }
  // Each block in at most one list: a later tier's list is checked against the earlier ones.
  for (std::size_t later = 1; later < kTiers.size(); ++later) {
    const std::vector<std::uint32_t> &blocks = config.force_blocks.values[later];
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      for (std::size_t earlier = 0; earlier < later; ++earlier) {
        const std::vector<std::uint32_t> &other = config.force_blocks.values[earlier];
        if (std::find(other.begin(), other.end(), blocks[i]) != other.end()) {
          throw PolicyConfigError(
              fmt::format("{}[{}]: block {} is also in {}; expected each block in at most one "
                          "force list",
                          reader.path(force_list_key(kTiers[later])), i, blocks[i], force_list_key(kTiers[earlier])));
        }
      }
    }
  }
  if (!config.tier(SP_PRECISION_BF16)) {
    throw PolicyConfigError(
        fmt::format("{}: expected a list that contains bf16 (the precision every block can fall "
                    "back to), found {}",
                    reader.path("tiers"), tiers_text(config.tiers)));
  }
  if (config.tier(SP_PRECISION_NF4)) {
    if (!(config.nf4_threshold < config.int8_threshold)) {
      throw PolicyConfigError(fmt::format("{}: expected a value below int8_threshold ({}) when nf4 is a tier, found {}",
                                    reader.path("nf4_threshold"), config.int8_threshold, config.nf4_threshold));
    }
    if (!(config.hysteresis_margin <= config.nf4_threshold)) {
      throw PolicyConfigError(fmt::format("{}: expected a number in [0, nf4_threshold = {}] when nf4 is a tier, found {}",
                                    reader.path("hysteresis_margin"), config.nf4_threshold, config.hysteresis_margin));
    }
  }
  const RuleModule &rule = rule_module(config.mode);
  const std::string budgets = rule.takes_loss_budget ? "budget: {bytes: F} or budget: {loss: F}" : "budget: {bytes: F}";
  if (takes_budget(config.mode) && config.budget.kind == BudgetKind::none) {
    throw PolicyConfigError(fmt::format("{}: mode is {}, but no budget is given; expected {}", reader.path("budget"),
                                        rule.name, budgets));
  }
  if (!takes_budget(config.mode) && config.budget.kind != BudgetKind::none) {
    std::string modes;
    for (const RuleModule *module : rule_modules()) {
      if (module->takes_bytes_budget || module->takes_loss_budget) modes += fmt::format("{}{}", modes.empty() ? "" : " or ", module->name);
    }
    throw PolicyConfigError(fmt::format("{}: a budget needs mode: {}, found mode: {}", reader.path("budget"), modes,
                                        mode_name(config.mode)));
  }
  if (config.budget.kind == BudgetKind::loss && !rule.takes_loss_budget) {
    throw PolicyConfigError(fmt::format("{}: mode {} decides by a cost that is not the training loss; expected {}, "
                                        "found a loss budget",
                                        reader.path("budget"), rule.name, budgets));
  }
  if (config.telemetry_enabled && config.telemetry_file.empty()) {
    throw PolicyConfigError(fmt::format("{}: expected a file name when telemetry_enabled is true, found an empty string",
                                  reader.path("telemetry_file")));
  }
}

[[maybe_unused]] sp_precision_mask read_tiers(const SectionReader &reader, const std::string &key,
                                              const YAML::Node &node) {
  const std::string expected = "a list of precisions from " + tiers_text(abi_mask_of_all()) + " that contains bf16";
  const std::string choices = "one of " + tier_list(abi_mask_of_all());
  if (!node.IsSequence()) reader.fail(key, expected, node);
  sp_precision_mask tiers = 0;
  for (std::size_t i = 0; i < node.size(); ++i) {
    const std::string element = fmt::format("{}[{}]", key, i);
    const std::string name = reader.read_string(element, node[i], choices);
    const std::optional<Precision> route = precision_named(name);
    if (!route) reader.fail(element, choices, node[i]);
    const sp_precision precision = to_abi(*route);
    if ((tiers & SP_PRECISION_BIT(precision)) != 0) {
      throw PolicyConfigError(
          fmt::format("{}: {} is listed twice; expected each precision at most once", reader.path(element), name));
    }
    tiers |= SP_PRECISION_BIT(precision);
  }
  return tiers;
}

[[maybe_unused]] void read_loss_guard(const SectionReader &section, const std::string &key, const YAML::Node &node,
                                      PolicySettings::LossGuard &guard) {
  if (node.IsNull()) return;
  if (!node.IsMap())
    section.fail(key, "a mapping with enabled, window, sigmas, min_rise, blame_steps, penalty_steps", node);
  const SectionReader reader(section.path(key));
  std::set<std::string> seen;
  for (const auto &entry : node) {
    if (!entry.first.IsScalar()) {
      throw PolicyConfigError(
          fmt::format("{}: expected setting names, found {} as a key", section.path(key), describe(entry.first)));
    }
    const std::string name = entry.first.Scalar();
    const YAML::Node &value = entry.second;
    if (!seen.insert(name).second) throw PolicyConfigError(fmt::format("{}: the key is given twice", reader.path(name)));
    if (name == "enabled") {
      guard.enabled = reader.read_bool(name, value);
    } else if (name == "window") {
      guard.window = reader.read_integer(name, value, "an integer in [2, 65536]");
      if (guard.window < 2 || guard.window > kMaxHistoryWindow) {
        throw PolicyConfigError(fmt::format("{}: expected an integer in [2, {}], found {}", reader.path(name),
                                      kMaxHistoryWindow, guard.window));
      }
    } else if (name == "sigmas") {
      guard.sigmas = reader.read_number(name, value, "a finite number > 0");
      require_positive_finite(reader, name, guard.sigmas);
    } else if (name == "min_rise") {
      guard.min_rise = reader.read_number(name, value, "a finite number >= 0");
      require_non_negative_finite(reader, name, guard.min_rise);
    } else if (name == "blame_steps") {
      guard.blame_steps = reader.read_integer(name, value, "an integer >= 1");
      require_at_least(reader, name, guard.blame_steps, 1);
    } else if (name == "penalty_steps") {
      guard.penalty_steps = reader.read_integer(name, value, "an integer >= 0");
      require_at_least(reader, name, guard.penalty_steps, 0);
    } else {
      const std::optional<std::string_view> suggestion = yaml_diagnostics::closest_key(name, kLossGuardKeys);
      throw PolicyConfigError(fmt::format("{}: unknown key{}", reader.path(name),
                                    suggestion ? fmt::format("; did you mean '{}'?", *suggestion) : ""));
    }
  }
}

// `budget: {bytes: F}` or `budget: {loss: F}`, exactly one of the two.
[[maybe_unused]] void read_budget(const SectionReader &section, const std::string &key, const YAML::Node &node,
                                  PolicySettings::Budget &budget) {
  constexpr const char *kExpected = "a mapping with exactly one of bytes (a fraction in (0, 1]) or loss (a fraction > 0)";
  if (!node.IsMap()) section.fail(key, kExpected, node);
  const SectionReader reader(section.path(key));
  std::set<std::string> seen;
  for (const auto &entry : node) {
    if (!entry.first.IsScalar()) {
      throw PolicyConfigError(
          fmt::format("{}: expected bytes or loss, found {} as a key", section.path(key), describe(entry.first)));
    }
    const std::string name = entry.first.Scalar();
    const YAML::Node &value = entry.second;
    if (!seen.insert(name).second) throw PolicyConfigError(fmt::format("{}: the key is given twice", reader.path(name)));
    if (name == "bytes" || name == "loss") {
      if (budget.kind != BudgetKind::none) {
        throw PolicyConfigError(fmt::format("{}: {} and {} are both given; expected exactly one budget",
                                            reader.path(name), budget.kind == BudgetKind::bytes ? "bytes" : "loss",
                                            name));
      }
    }
    if (name == "bytes") {
      constexpr const char *kFraction = "a fraction of the all-BF16 bytes in (0, 1]";
      budget.limit = reader.read_number(name, value, kFraction);
      if (!(budget.limit > 0.0 && budget.limit <= 1.0)) {
        throw PolicyConfigError(fmt::format("{}: expected {}, found {}", reader.path(name), kFraction, budget.limit));
      }
      budget.kind = BudgetKind::bytes;
    } else if (name == "loss") {
      constexpr const char *kFraction = "a finite fraction of the current loss > 0";
      budget.limit = reader.read_number(name, value, kFraction);
      if (!(budget.limit > 0.0 && std::isfinite(budget.limit))) {
        throw PolicyConfigError(fmt::format("{}: expected {}, found {}", reader.path(name), kFraction, budget.limit));
      }
      budget.kind = BudgetKind::loss;
    } else {
      const std::optional<std::string_view> suggestion = yaml_diagnostics::closest_key(name, kBudgetKeys);
      throw PolicyConfigError(fmt::format("{}: unknown key{}", reader.path(name),
                                          suggestion ? fmt::format("; did you mean '{}'?", *suggestion) : ""));
    }
  }
  if (budget.kind == BudgetKind::none) section.fail(key, kExpected, node);
}

// The tier whose force list `key` is, in this edition.
std::optional<sp_precision> tier_forced_by(std::string_view key) {
  for (sp_precision tier : kTiers) {
    const char *force_key = force_list_key(tier);
    if (force_key != nullptr && key == force_key) return tier;
  }
  return std::nullopt;
}

void read_key(const SectionReader &reader, const std::string &key, const YAML::Node &value, std::uint32_t n_blocks,
              PolicySettings &config) {
  constexpr const char *kUnit = "a number in [0, 1]";
  constexpr const char *kNonNegative = "a finite number >= 0";
  constexpr const char *kPositive = "a finite number > 0";
  if (key == "enabled") {
    config.enabled = reader.read_bool(key, value);
  } else if (key == "mode") {
    const std::string mode = reader.read_string(key, value, mode_choices());
    const auto &modules = rule_modules();
    const auto found = std::find_if(modules.begin(), modules.end(),
                                    [&](const RuleModule *module) { return mode == module->name; });
    if (found == modules.end()) reader.fail(key, mode_choices(), value);
    config.mode = (*found)->mode;
  } else if (key == "bf16_threshold") {
    config.bf16_threshold = reader.read_number(key, value, kUnit);
    require_range(reader, key, config.bf16_threshold, 0.0, 1.0);
  } else if (key == "int8_threshold") {
    config.int8_threshold = reader.read_number(key, value, kUnit);
    require_range(reader, key, config.int8_threshold, 0.0, 1.0);
  } else if (key == "ambiguous_default") {
    const std::string precision = reader.read_string(key, value, "bf16 or int8");
    if (precision == "bf16") {
      config.ambiguous_default = SP_PRECISION_BF16;
    } else if (precision == "int8") {
      config.ambiguous_default = SP_PRECISION_INT8;
    } else {
      reader.fail(key, "bf16 or int8", value);
    }
  } else if (key == "hysteresis_margin") {
    config.hysteresis_margin = reader.read_number(key, value, "a number in [0, int8_threshold]");
  } else if (key == "grad_weight") {
    config.grad_weight = reader.read_number(key, value, kNonNegative);
    require_non_negative_finite(reader, key, config.grad_weight);
  } else if (key == "error_weight") {
    config.error_weight = reader.read_number(key, value, kNonNegative);
    require_non_negative_finite(reader, key, config.error_weight);
  } else if (key == "grad_sensitivity_threshold") {
    config.grad_sensitivity_threshold = reader.read_number(key, value, kPositive);
    require_positive_finite(reader, key, config.grad_sensitivity_threshold);
  } else if (key == "run_calibration") {
    config.run_calibration = reader.read_bool(key, value);
  } else if (key == "calibration_samples") {
    config.calibration_samples = reader.read_integer(key, value, "an integer >= 1");
    require_at_least(reader, key, config.calibration_samples, 1);
  } else if (key == "quant_error_threshold") {
    config.quant_error_threshold = reader.read_number(key, value, kPositive);
    require_positive_finite(reader, key, config.quant_error_threshold);
  } else if (key == "warmup_steps") {
    config.warmup_steps = reader.read_integer(key, value, "an integer >= 0");
    require_at_least(reader, key, config.warmup_steps, 0);
  } else if (key == "history_window") {
    const std::string expected = fmt::format("an integer in [1, {}]", kMaxHistoryWindow);
    config.history_window = reader.read_integer(key, value, expected);
    if (config.history_window < 1 || config.history_window > kMaxHistoryWindow) {
      throw PolicyConfigError(fmt::format("{}: expected {}, found {}", reader.path(key), expected, config.history_window));
    }
  } else if (key == "update_interval_steps") {
    config.update_interval_steps = reader.read_integer(key, value, "an integer >= 1");
    require_at_least(reader, key, config.update_interval_steps, 1);
  } else if (key == "min_steps_between_switches") {
    config.min_steps_between_switches = reader.read_integer(key, value, "an integer >= 0");
    require_at_least(reader, key, config.min_steps_between_switches, 0);
  } else if (const std::optional<sp_precision> forced = tier_forced_by(key)) {
    config.force_blocks[*forced] = reader.read_block_ids(key, value, n_blocks);
  } else if (key == "log_decisions") {
    config.log_decisions = reader.read_bool(key, value);
  } else if (key == "telemetry_enabled") {
    config.telemetry_enabled = reader.read_bool(key, value);
  } else if (key == "telemetry_file") {
    config.telemetry_file = reader.read_file_name(key, value);
  } else if (key == "nonfinite_to_bf16") {
    config.nonfinite_to_bf16 = reader.read_bool(key, value);
#if SP_POLICY_EDITION >= 2
  } else if (key == "tiers") {
    config.tiers = read_tiers(reader, key, value);
  } else if (key == "nf4_threshold") {
    config.nf4_threshold = reader.read_number(key, value, kUnit);
    require_range(reader, key, config.nf4_threshold, 0.0, 1.0);
  } else if (key == "nf4_quant_error_threshold") {
    config.nf4_quant_error_threshold = reader.read_number(key, value, kPositive);
    require_positive_finite(reader, key, config.nf4_quant_error_threshold);
  } else if (key == "nf4_group_size") {
    // The sizes the NF4 kernels take (the route table's); the host packs with it.
    const std::string expected = group_size_expectation(Precision::nf4);
    config.nf4_group_size = reader.read_integer(key, value, expected);
    if (config.nf4_group_size < 0 || config.nf4_group_size > 256 ||
        !is_supported_group_size(Precision::nf4, static_cast<std::uint32_t>(config.nf4_group_size))) {
      throw PolicyConfigError(
          fmt::format("{}: expected {}, found {}", reader.path(key), expected, config.nf4_group_size));
    }
  } else if (key == "loss_guard") {
    read_loss_guard(reader, key, value, config.loss_guard);
#endif
#if SP_POLICY_EDITION >= 3
  } else if (key == "budget") {
    read_budget(reader, key, value, config.budget);
#endif
  } else if (const RuleKey *rule_key = rule_key_named(key)) {
    const double number = rule_key->integer ? static_cast<double>(reader.read_integer(key, value, rule_key->expected))
                                            : reader.read_number(key, value, rule_key->expected);
    if (!(number >= rule_key->low && (rule_key->high_excluded ? number < rule_key->high : number <= rule_key->high))) {
      throw PolicyConfigError(fmt::format("{}: expected {}, found {}", reader.path(key), rule_key->expected, number));
    }
    config.rule_settings[key] = number;
  } else {
    std::vector<const char *> known(kKnownKeys.begin(), kKnownKeys.end());
    for (sp_precision tier : kTiers) {
      if (const char *force_key = force_list_key(tier)) known.push_back(force_key);
    }
    for (const RuleModule *module : rule_modules()) {
      for (const RuleKey &rule_key : module->keys) known.push_back(rule_key.name);
    }
    const std::optional<std::string_view> suggestion = yaml_diagnostics::closest_key(key, known);
    throw PolicyConfigError(fmt::format("{}: unknown key{}", reader.path(key),
                                  suggestion ? fmt::format("; did you mean '{}'?", *suggestion) : ""));
  }
}

// Follows `keys` from `node`. A missing key yields a node whose IsDefined() is false; such
// a node must not be indexed again, so the walk stops there.
YAML::Node lookup(const YAML::Node &node, std::initializer_list<const char *> keys) {
  YAML::Node found = node;
  for (const char *key : keys) {
    if (!found.IsDefined() || !found.IsMap()) return YAML::Node(YAML::NodeType::Undefined);
    const YAML::Node next = std::as_const(found)[key];
    if (!next.IsDefined()) return next;
    found.reset(next);
  }
  return found;
}

}  // namespace

ParsedConfig parse_policy_config(std::string_view yaml_text, std::uint32_t n_blocks) {
  YAML::Node root;
  try {
    root = YAML::Load(std::string(yaml_text));
  } catch (const YAML::ParserException &error) {
    throw PolicyConfigError(fmt::format("YAML syntax error at line {}, column {}: {}", error.mark.line + 1,
                                  error.mark.column + 1, error.msg));
  }
  if (!root.IsDefined() || root.IsNull()) {
    throw PolicyConfigError(
        fmt::format("the configuration is empty; expected a '{}' section (standalone policy file) "
                    "or '{}' (training config)",
                    kTopLevelSection, kTrainingConfigSection));
  }
  if (!root.IsMap()) {
    throw PolicyConfigError(fmt::format("the configuration must be a YAML mapping with a '{}' or '{}' section, found {}",
                                  kTopLevelSection, kTrainingConfigSection, describe(root)));
  }
  const YAML::Node top_level = lookup(root, {kTopLevelSection});
  const YAML::Node nested = lookup(root, {"memory", "stagehand", kTopLevelSection});
  if (top_level.IsDefined() && nested.IsDefined()) {
    throw PolicyConfigError(fmt::format("both '{}' and '{}' are present; expected exactly one policy section",
                                  kTopLevelSection, kTrainingConfigSection));
  }
  if (!top_level.IsDefined() && !nested.IsDefined()) {
    throw PolicyConfigError(
        fmt::format("no policy section; expected '{}' (standalone policy file) or '{}' "
                    "(training config)",
                    kTopLevelSection, kTrainingConfigSection));
  }

  ParsedConfig parsed;
  parsed.section_path = top_level.IsDefined() ? kTopLevelSection : kTrainingConfigSection;
  const YAML::Node section = top_level.IsDefined() ? top_level : nested;
  const SectionReader reader(parsed.section_path);
  if (!section.IsNull() && !section.IsMap()) {
    throw PolicyConfigError(
        fmt::format("{}: expected a mapping of policy settings, found {}", parsed.section_path, describe(section)));
  }
  if (section.IsMap()) {
    std::set<std::string> seen;
    for (const auto &entry : section) {
      if (!entry.first.IsScalar()) {
        throw PolicyConfigError(
            fmt::format("{}: expected setting names, found {} as a key", parsed.section_path, describe(entry.first)));
      }
      const std::string key = entry.first.Scalar();
      if (!seen.insert(key).second) {
        throw PolicyConfigError(fmt::format("{}: the key is given twice", reader.path(key)));
      }
      read_key(reader, key, entry.second, n_blocks, parsed.config);
    }
  }
  validate_relations(reader, parsed.config);

  const PolicySettings &config = parsed.config;
  const RuleModule &rule = rule_module(config.mode);
  for (const auto &setting : config.rule_settings) {
    const std::string &key = setting.first;
    const bool read = std::any_of(rule.keys.begin(), rule.keys.end(), [&](const RuleKey &k) { return key == k.name; });
    if (!read) {
      parsed.warnings.push_back(fmt::format("{}: mode {} does not read this key, so its value {} is ignored",
                                            reader.path(key), rule.name, setting.second));
    }
  }
  if (config.effective_mode() == Mode::off &&
      std::any_of(config.force_blocks.begin(), config.force_blocks.end(),
                  [](const std::vector<std::uint32_t> &blocks) { return !blocks.empty(); })) {
    parsed.warnings.push_back(
        fmt::format("{}: the policy is off ({}), so the force lists "
                    "are ignored and every block streams as BF16",
                    parsed.section_path, config.enabled ? "mode: off" : "enabled: false"));
  }
  return parsed;
}

const char *mode_name(Mode mode) { return rule_module(mode).name; }

const char *precision_name(sp_precision precision) {
  const std::optional<Precision> route = from_abi(precision);
  return sp::precision_name(route ? *route : Precision::bf16);
}

void check_host_precisions(const ParsedConfig &parsed, sp_precision_mask supported) {
  const PolicySettings &config = parsed.config;
  // A quantized route the host lacks (a 1.1 host that lists BF16 only; a 1.0 host transfers BF16
  // and INT8) would have every hint of it refused and replaced by the host's fallback.
  for (const Precision route : kQuantizedPrecisions) {
    const sp_precision tier = to_abi(route);
    if ((supported & SP_PRECISION_BIT(tier)) != 0) continue;
    const RouteTraits &traits = route_traits(route);
    if (config.tier(tier)) {
      throw PolicyConfigError(
          fmt::format("{}.tiers: {} is a tier, but the host cannot transfer {} (it supports {}); "
                      "expected tiers from {}",
                      parsed.section_path, traits.name, traits.label, tiers_text(supported), tiers_text(supported)));
    }
    if (!config.force_blocks[tier].empty()) {
      throw PolicyConfigError(
          fmt::format("{}.{}: {} block(s) forced to {}, but the host cannot transfer {} (it "
                      "supports {}); expected an empty list",
                      parsed.section_path, force_list_key(tier), config.force_blocks[tier].size(), traits.name,
                      traits.label, tiers_text(supported)));
    }
  }
}

const char *force_list_key(sp_precision tier) {
  static const TierColumns keys("force_", "_blocks");
  const std::optional<Precision> route = from_abi(tier);
  if (!route || (SP_POLICY_EDITION < 2 && route_traits(*route).abi_minor > 0)) return nullptr;
  return keys(tier);
}

}  // namespace sp::policy
