// Configuration of the Selective Precision policy v1: the parameters of the seed's table
// with the seed's defaults, plus `nonfinite_to_bf16`. Parsed from YAML text and validated
// completely; see docs/policy.md for every key and its range.
#pragma once

#include <sp/plugin_abi_v1.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace sp::policy {

enum class Mode : std::uint8_t { off, static_lists, dynamic };

// The largest history_window accepted. It bounds the memory of the window
// (n_blocks * history_window samples) and the size of a state blob.
inline constexpr std::int64_t kMaxHistoryWindow = 65536;

struct PolicyConfig {
  bool enabled = true;
  Mode mode = Mode::dynamic;
  double bf16_threshold = 0.6;
  double int8_threshold = 0.3;
  sp_precision ambiguous_default = SP_PRECISION_BF16;
  double hysteresis_margin = 0.1;
  double grad_weight = 0.7;
  double error_weight = 0.3;
  double grad_sensitivity_threshold = 2.0;
  // Read by the host, which runs the calibration pass; the policy only validates them.
  bool run_calibration = true;
  std::int64_t calibration_samples = 4;
  double quant_error_threshold = 0.05;
  std::int64_t warmup_steps = 10;
  std::int64_t history_window = 5;
  std::int64_t update_interval_steps = 10;
  std::int64_t min_steps_between_switches = 20;
  std::vector<std::uint32_t> force_bf16_blocks;
  std::vector<std::uint32_t> force_int8_blocks;
  bool log_decisions = true;
  bool telemetry_enabled = true;
  std::string telemetry_file = "selective_precision_telemetry.jsonl";
  bool nonfinite_to_bf16 = true;

  // `enabled: false` is the same as `mode: off`.
  Mode effective_mode() const { return enabled ? mode : Mode::off; }
};

struct ParsedConfig {
  PolicyConfig config;
  // Where the section was found: "memory.stagehand.selective_precision" or "selective_precision".
  std::string section_path;
  // Accepted but suspicious settings, e.g. force lists that mode off ignores.
  std::vector<std::string> warnings;
};

// Parses and validates the policy section of `yaml_text` for a model of `n_blocks` blocks.
// Throws ConfigError naming the full key path, the expected type or range, and what was found.
ParsedConfig parse_policy_config(std::string_view yaml_text, std::uint32_t n_blocks);

const char *mode_name(Mode mode);
const char *precision_name(sp_precision precision);

}  // namespace sp::policy
