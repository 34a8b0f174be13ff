// What policies v3 and v4 share: a budget solved exactly by the knapsack (knapsack.h) over the
// units that no standing rule, cooldown or penalty pins, re-solved when the rule has new costs,
// the sizes change or a standing rule moved a unit. A rule says what a unit costs at a tier,
// what leaving its current tier costs, and when new costs call for a new allocation.
#pragma once

#include "sp/policy/budget.h"
#include "sp/policy/decision_rule.h"
#include "sp/policy/engine.h"

#include <cstdint>
#include <vector>

namespace sp::policy {

class BudgetedRule : public DecisionRule {
 public:
  explicit BudgetedRule(PolicyEngine &engine);

  bool decide(std::int64_t step, bool decision_step) final;
  void replan() final { replan_ = true; }

 protected:
  // Whether the costs are the rule's own (measured or predicted from data), not the prior's.
  virtual bool has_costs() const = 0;
  // The unit's cost at `tier` when has_costs(); NaN closes the tier (BF16 is always open).
  virtual double cost(std::uint32_t unit, sp_precision tier) const = 0;
  // What moving the unit off its current tier to `tier` adds to the cost (hysteresis).
  virtual double switch_penalty(std::uint32_t unit, sp_precision tier) const = 0;
  // Whether new costs call for a new allocation at this step.
  virtual bool costs_call_for_allocation(std::int64_t step, bool decision_step) const = 0;
  // They do: the rule takes them as the costs it allocates by, now and until the next new ones.
  virtual void adopt_new_costs() {}
  // What an allocation from the rule's costs records as its source.
  virtual AllocationSource costs_source() const = 0;
  // The allocation took the costs: what called for it is answered.
  virtual void costs_taken() = 0;
  // An allocation the rule measured to beat `knapsack`, the knapsack's answer now (a tier per unit),
  // or null. allocate() takes it where every unit's tier in it is open to the unit and it keeps the
  // bytes budget; otherwise the knapsack decides and the rule is told to drop its choice.
  virtual const std::vector<sp_precision> *measured_choice(const std::vector<sp_precision> & /*knapsack*/) const {
    return nullptr;
  }
  virtual void drop_measured_choice() {}
  // The unit's sensitivity in [0, 1] relative to the others, from its cost at its cheapest tier.
  double cheapest_tier_cost(std::uint32_t unit) const;

  PolicyEngine &engine_;

 private:
  void allocate(std::int64_t step);

  bool replan_ = true;
  // A standing rule decided the unit at this step (it is pinned for the allocation).
  std::vector<std::uint8_t> decided_by_rule_;
};

}  // namespace sp::policy
