// Configuration of the Selective Precision policy: v1's keys (the seed's table with the
// seed's defaults, plus `nonfinite_to_bf16`), v2's (tiers, NF4, loss guard), v3's (mode
// budget and its budget), and the keys each rule module registers for itself (decision_rule.h:
// v3's signal_smoothing and switch_margin, v4's switch_sigmas and decide_until_step). Parsed from YAML text and validated
// completely; see docs/policy.md for every key and its range.
//
// SP_POLICY_EDITION selects what the build is: 4 (default) is policy v4; 3 would be 3.x; 2
// builds the same sources as the 2.0.0 edition (a v3 key is an unknown key), 1 as the 1.0.0
// edition, which knows only v1's keys (a v2 key is an unknown key).
#pragma once

#include "sp/policy/tiers.h"

#include <sp/plugin_abi_v1.h>

#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#ifndef SP_POLICY_EDITION
#define SP_POLICY_EDITION 4
#endif

namespace sp::policy {

inline constexpr int kPolicyEdition = SP_POLICY_EDITION;

// Each mode is one rule module (decision_rule.h). `budget` is policy v3: an exact allocation
// under the user's budget of predicted costs; `measured` is policy v4: the same under measured
// costs and their confidence bounds (docs/policy.md).
enum class Mode : std::uint8_t { off, static_lists, dynamic, budget, measured };

// What a v3 budget limits; the codes are the ABI's sp_budget_kind.
enum class BudgetKind : std::int32_t { none = SP_BUDGET_NONE, bytes = SP_BUDGET_BYTES, loss = SP_BUDGET_LOSS };

// The largest history_window accepted. It bounds the memory of the window
// (n_blocks * history_window samples) and the size of a state blob.
inline constexpr std::int64_t kMaxHistoryWindow = 65536;

struct PolicySettings {
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
  // The blocks forced to each tier, by tier: the keys force_<route>_blocks (force_list_key), v1's
  // for BF16 and INT8, v2's for NF4. A block is in at most one list.
  PerTier<std::vector<std::uint32_t>> force_blocks;
  bool log_decisions = true;
  bool telemetry_enabled = true;
  std::string telemetry_file = "selective_precision_telemetry.jsonl";
  bool nonfinite_to_bf16 = true;

  // ---- v2 ----
  // The precisions the dynamic policy may choose, as a mask of SP_PRECISION_BIT; always
  // holds BF16. The default is v1's pair.
  sp_precision_mask tiers = SP_PRECISION_BIT(SP_PRECISION_BF16) | SP_PRECISION_BIT(SP_PRECISION_INT8);
  // Provisional defaults (docs/policy.md): the experiments choose the final values.
  double nf4_threshold = 0.15;
  double nf4_quant_error_threshold = 0.15;
  // Read by the host's NF4 packer; the policy only validates it.
  std::int64_t nf4_group_size = 64;
  struct LossGuard {
    bool enabled = false;
    std::int64_t window = 20;
    double sigmas = 3.0;
    double min_rise = 0.05;
    std::int64_t blame_steps = 10;
    std::int64_t penalty_steps = 100;
  } loss_guard;

  // ---- v3 ----
  struct Budget {
    BudgetKind kind = BudgetKind::none;
    // bytes: the fraction of all-BF16 bytes a step may move, in (0, 1]; loss: the predicted
    // loss increase allowed, as a fraction of the current loss, finite and > 0.
    double limit = std::numeric_limits<double>::quiet_NaN();
  } budget;

  // The keys a rule module registered (decision_rule.h's RuleKey) that the config gave, by name;
  // read them with rule_setting(), which supplies the module's default.
  std::map<std::string, double> rule_settings;

  bool tier(sp_precision precision) const { return (tiers & SP_PRECISION_BIT(precision)) != 0; }
  // Whether the configuration can make any block travel as NF4.

  // `enabled: false` is the same as `mode: off`.
  Mode effective_mode() const { return enabled ? mode : Mode::off; }
};

struct ParsedConfig {
  PolicySettings config;
  // Where the section was found: "memory.stagehand.selective_precision" or "selective_precision".
  std::string section_path;
  // Accepted but suspicious settings, e.g. force lists that mode off ignores.
  std::vector<std::string> warnings;
};

// Parses and validates the policy section of `yaml_text` for a model of `n_blocks` blocks.
// Throws PolicyConfigError naming the full key path, the expected type or range, and what was found.
ParsedConfig parse_policy_config(std::string_view yaml_text, std::uint32_t n_blocks);

// A configuration that uses a route (a tier, or its force list) that a host's
// supported_precisions lack is a PolicyConfigError naming the key.
void check_host_precisions(const ParsedConfig &parsed, sp_precision_mask supported);

// "force_nf4_blocks": the key of the list of blocks forced to `tier`; nullptr for a tier whose
// list this edition does not know (edition 1 knew ABI 1.0's routes only).
const char *force_list_key(sp_precision tier);

const char *mode_name(Mode mode);
const char *precision_name(sp_precision precision);

}  // namespace sp::policy
