// Mode budget (policy v3): the host's signal table predicts each unit's loss cost at each tier
// (loss_cost.<tier>, a Taylor estimate); the rule smooths it over tables and solves the budget
// with a switch margin in units of the loss (docs/policy.md, "Policy v3"). A table with no
// loss_cost column is not one it reads.
#include "budgeted_rule.h"

#include <algorithm>
#include <cmath>

namespace sp::policy {
namespace {

class BudgetRule final : public BudgetedRule {
 public:
  using BudgetedRule::BudgetedRule;

  void take_signals(std::int64_t step, const SignalTable &table) override {
    const PolicySettings &config = engine_.config();
    BudgetState &budget = engine_.rule_state().budget;
    std::array<std::int64_t, kTiers.size()> cost{}, first{}, second{};
    bool predicts = false;
    for (std::size_t t = 0; t < kTiers.size(); ++t) {
      cost[t] = table.column(loss_cost_column(kTiers[t]));
      first[t] = table.column(first_order_column(kTiers[t]));
      second[t] = table.column(second_order_column(kTiers[t]));
      predicts = predicts || cost[t] >= 0;
    }
    // A table without a loss_cost column (v4's measured costs) predicts nothing v3 reads.
    if (!predicts) return;
    for (std::uint32_t u = 0; u < engine_.n_blocks(); ++u) {
      UnitSignals &unit = budget.units[u];
      for (std::size_t t = 0; t < kTiers.size(); ++t) {
        unit.cost[t] = smoothed(unit.cost[t], table.value(u, cost[t]), config.signal_smoothing);
        if (first[t] >= 0) unit.first_order[t] = table.value(u, first[t]);
        if (second[t] >= 0) unit.second_order[t] = table.value(u, second[t]);
      }
    }
    ++budget.tables_received;
    budget.last_table_samples = table.samples();
    budget.last_signal_step = step;
    budget.signals_pending = true;
    if (std::isfinite(table.loss())) budget.table_loss = table.loss();
  }

  void take_loss(double loss) override {
    BudgetState &budget = engine_.rule_state().budget;
    budget.feedback_loss = smoothed(budget.feedback_loss, loss, engine_.config().signal_smoothing);
  }

  double unit_cost(std::uint32_t unit, sp_precision precision) const override {
    return engine_.state().budget.units[unit].cost[precision];
  }

 protected:
  bool has_costs() const override { return engine_.state().budget.tables_received > 0; }

  // A predicted gain is not taken as one: quantizing never counts as helping the loss.
  double cost(std::uint32_t unit, sp_precision tier) const override {
    const double predicted = engine_.state().budget.units[unit].cost[tier];
    return std::isnan(predicted) ? predicted : std::max(predicted, 0.0);
  }

  // The prior's costs are fractions of a reference loss of 1.
  double switch_penalty(std::uint32_t /*unit*/, sp_precision /*tier*/) const override {
    const double reference = engine_.reference_loss();
    return engine_.config().switch_margin * (has_costs() ? (reference > 0.0 ? reference : 0.0) : 1.0);
  }

  bool costs_call_for_allocation(std::int64_t /*step*/, bool decision_step) const override {
    return decision_step && engine_.state().budget.signals_pending;
  }

  AllocationSource costs_source() const override { return AllocationSource::signals; }

  void costs_taken() override { engine_.rule_state().budget.signals_pending = false; }
};

}  // namespace

extern const RuleModule kBudgetRule{Mode::budget, "budget", 3, true, true, {},
                                    [](PolicyEngine &engine) -> std::unique_ptr<DecisionRule> {
                                      return std::make_unique<BudgetRule>(engine);
                                    }};

}  // namespace sp::policy
