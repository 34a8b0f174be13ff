// Mode budget (policy v3): the host's signal table predicts each unit's loss cost at each tier
// (loss_cost.<tier>, a Taylor estimate); the rule smooths it over tables and solves the budget
// with a switch margin in units of the loss (docs/policy.md, "Policy v3"). The engine records the
// tables (PolicyEngine::set_unit_signals), in every mode, as 3.x did.
#include "budgeted_rule.h"
#include "../json_values.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace sp::policy {
namespace {

constexpr const char *kSwitchMargin = "switch_margin";

class BudgetRule final : public BudgetedRule {
 public:
  explicit BudgetRule(PolicyEngine &engine)
      : BudgetedRule(engine),
        // Weight of the previous average when a signal table arrives: cost = s*cost + (1-s)*new.
        signal_smoothing_(rule_setting(engine.config(), Mode::budget, kSignalSmoothing)),
        // Hysteresis: switch_margin x the reference loss is added to the cost of every tier other
        // than a unit's current one.
        switch_margin_(rule_setting(engine.config(), Mode::budget, kSwitchMargin)) {}

  void take_loss(double loss) override {
    BudgetState &budget = engine_.rule_state().budget;
    budget.feedback_loss = smoothed(budget.feedback_loss, loss, signal_smoothing_);
  }

 protected:
  bool reads_step_signals() const override { return true; }
  bool has_costs() const override { return engine_.state().budget.tables_received > 0; }

  // A predicted gain is not taken as one: quantizing never counts as helping the loss.
  double cost(std::uint32_t unit, sp_precision tier) const override {
    const double predicted = engine_.state().budget.units[unit].cost[tier];
    return std::isnan(predicted) ? predicted : std::max(predicted, 0.0);
  }

  // The prior's costs are fractions of a reference loss of 1.
  double switch_penalty(std::uint32_t /*unit*/, sp_precision /*tier*/) const override {
    const double reference = engine_.reference_loss();
    return switch_margin_ * (has_costs() ? (reference > 0.0 ? reference : 0.0) : 1.0);
  }

  bool costs_call_for_allocation(std::int64_t /*step*/, bool decision_step) const override {
    return decision_step && engine_.state().budget.signals_pending;
  }

  AllocationSource costs_source() const override { return AllocationSource::signals; }

  void costs_taken() override { engine_.rule_state().budget.signals_pending = false; }

  void describe_unit(std::uint32_t unit, nlohmann::ordered_json &detail) const override {
    const UnitSignals &signals = engine_.state().budget.units[unit];
    detail["predicted_cost"] = per_tier(signals.cost);
    detail["first_order"] = per_tier(signals.first_order);
    detail["second_order"] = per_tier(signals.second_order);
  }

 private:
  double signal_smoothing_;
  double switch_margin_;
};

constexpr RuleKey kKeys[] = {
    {kSignalSmoothing, "a number in [0, 1)", 0.0, 1.0, 0.5, false, true},
    {kSwitchMargin, "a finite number >= 0", 0.0, std::numeric_limits<double>::max(), 0.0005, false, false}};

}  // namespace

extern const RuleModule kBudgetRule{Mode::budget, "budget", 3, true, true, kKeys,
                                    [](PolicyEngine &engine) -> std::unique_ptr<DecisionRule> {
                                      return std::make_unique<BudgetRule>(engine);
                                    }};

}  // namespace sp::policy
