// Mode dynamic (policies v1 and v2): at each decision step, a block's sensitivity, from its
// gradient window and its calibration errors, crosses thresholds with a hysteresis margin
// (docs/policy.md, "Decision rules"). v1 is the case with tiers [bf16, int8].
#include "sp/policy/decision_rule.h"
#include "sp/policy/engine.h"
#include "sp/policy/routes.h"

#include <algorithm>
#include <vector>

namespace sp::policy {
namespace {

class ThresholdRule final : public DecisionRule {
 public:
  explicit ThresholdRule(PolicyEngine &engine) : engine_(engine), step_scores_(engine.n_blocks()) {}

  bool decide(std::int64_t step, bool decision_step) override {
    PolicyState &state = engine_.rule_state();
    if (decision_step) score_blocks();
    for (sp_hint_v1 &hint : engine_.hints()) {
      const std::uint32_t b = hint.block_id;
      BlockState &block = state.blocks[b];
      const bool has_samples = state.windows.size(b) > 0;
      // Forced blocks are still scored, for telemetry; the score never moves them.
      if (engine_.forced(b) >= 0 && decision_step && has_samples) block.score = step_scores_[b];
      if (const std::optional<sp_reason> reason = engine_.apply_standing_rules(block, b, step)) {
        hint.reason = *reason;
      } else if (!decision_step) {
        hint.reason = SP_REASON_NOT_DECISION_STEP;
      } else if (!has_samples) {
        hint.reason = SP_REASON_NO_DATA;
      } else {
        block.score = step_scores_[b];
        hint.reason = apply_thresholds(block, step);
      }
      hint.precision = travels_as(block.assignment);
      hint.sensitivity = block.score.sensitivity;
    }
    return decision_step;
  }

 private:
  void score_blocks() {
    const PolicySettings &config = engine_.config();
    const PolicyState &state = engine_.rule_state();
    const std::uint32_t n = engine_.n_blocks();
    double avg_sum = 0.0;
    std::uint32_t blocks_with_samples = 0;
    for (std::uint32_t b = 0; b < n; ++b) {
      const std::uint32_t samples = state.windows.size(b);
      if (samples == 0) continue;
      // Oldest to newest, so that a window rebuilt from a state blob sums identically.
      double l2_sum = 0.0;
      for (std::uint32_t i = 0; i < samples; ++i) l2_sum += state.windows.at(b, i).l2;
      step_scores_[b].avg_l2 = l2_sum / samples;
      avg_sum += step_scores_[b].avg_l2;
      ++blocks_with_samples;
    }
    const double mean_all = blocks_with_samples ? avg_sum / blocks_with_samples : 0.0;
    for (std::uint32_t b = 0; b < n; ++b) {
      if (state.windows.size(b) == 0) continue;
      ScoreParts &score = step_scores_[b];
      const std::optional<double> &calibration = state.blocks[b].calibration_error;
      const std::optional<double> &nf4_calibration = state.blocks[b].nf4_calibration_error;
      score.relative_magnitude = mean_all > 0.0 ? score.avg_l2 / mean_all : 0.0;
      score.grad_score = std::min(score.relative_magnitude / config.grad_sensitivity_threshold, 1.0);
      score.error_score = calibration ? std::min(*calibration / config.quant_error_threshold, 1.0) : 0.0;
      score.sensitivity =
          std::clamp(config.grad_weight * score.grad_score + config.error_weight * score.error_score, 0.0, 1.0);
      score.nf4_error_score =
          nf4_calibration ? std::min(*nf4_calibration / config.nf4_quant_error_threshold, 1.0) : 0.0;
      score.nf4_sensitivity =
          std::clamp(config.grad_weight * score.grad_score + config.error_weight * score.nf4_error_score, 0.0, 1.0);
    }
  }

  sp_reason apply_thresholds(BlockState &block, std::int64_t step) const {
    const PolicySettings &config = engine_.config();
    const double s8 = block.score.sensitivity;
    const double s4 = block.score.nf4_sensitivity;
    const double b16 = config.bf16_threshold;
    const double i8 = config.int8_threshold;
    const double n4 = config.nf4_threshold;
    const double m = config.hysteresis_margin;
    const bool int8_ok = config.tier(SP_PRECISION_INT8);
    const bool nf4_ok = config.tier(SP_PRECISION_NF4);
    switch (block.assignment) {
      case Assignment::unassigned: {
        Assignment target = Assignment::bf16;
        if (s8 >= b16) {
          target = Assignment::bf16;
        } else if (nf4_ok && s4 < n4) {
          target = Assignment::nf4;
        } else if (int8_ok && s8 < i8) {
          target = Assignment::int8;
        } else {
          const sp_precision fallback =
              config.ambiguous_default == SP_PRECISION_INT8 && !int8_ok ? SP_PRECISION_BF16 : config.ambiguous_default;
          target = assignment_for(fallback);
        }
        return engine_.move_if_allowed(block, target, step);
      }
      case Assignment::bf16:
        if (nf4_ok && s4 < n4 - m) return engine_.move_if_allowed(block, Assignment::nf4, step);
        if (int8_ok && s8 < i8 - m) return engine_.move_if_allowed(block, Assignment::int8, step);
        return s8 >= b16 ? SP_REASON_THRESHOLD : SP_REASON_HYSTERESIS_HOLD;
      case Assignment::int8:
        if (s8 >= b16) return engine_.move_if_allowed(block, Assignment::bf16, step);
        if (nf4_ok && s4 < n4 - m) return engine_.move_if_allowed(block, Assignment::nf4, step);
        return s8 < i8 ? SP_REASON_THRESHOLD : SP_REASON_HYSTERESIS_HOLD;
      case Assignment::nf4:
        if (s8 >= b16) return engine_.move_if_allowed(block, Assignment::bf16, step);
        if (s4 >= i8) return engine_.move_if_allowed(block, int8_ok ? Assignment::int8 : Assignment::bf16, step);
        return s4 < n4 ? SP_REASON_THRESHOLD : SP_REASON_HYSTERESIS_HOLD;
    }
    return SP_REASON_HYSTERESIS_HOLD;
  }

  PolicyEngine &engine_;
  // Scratch space reused every decision step, so that the steady state allocates nothing.
  std::vector<ScoreParts> step_scores_;
};

}  // namespace

extern const RuleModule kThresholdRule{Mode::dynamic, "dynamic", 1, false, false, {},
                                       [](PolicyEngine &engine) -> std::unique_ptr<DecisionRule> {
                                         return std::make_unique<ThresholdRule>(engine);
                                       }};

}  // namespace sp::policy
