#include "budgeted_rule.h"

#include "sp/policy/knapsack.h"
#include "sp/policy/routes.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace sp::policy {

BudgetedRule::BudgetedRule(PolicyEngine &engine) : engine_(engine), decided_by_rule_(engine.n_blocks(), 0) {}

double BudgetedRule::cheapest_tier_cost(std::uint32_t unit) const {
  double found = ScoreParts::kNever;
  for (sp_precision tier : kTiers) {
    const double measured = has_costs() ? cost(unit, tier) : ScoreParts::kNever;
    if (tier != SP_PRECISION_BF16 && engine_.config().tier(tier) && !std::isnan(measured)) {
      found = std::max(measured, 0.0);
    }
  }
  return found;
}

bool BudgetedRule::decide(std::int64_t step, bool decision_step) {
  PolicyState &state = engine_.rule_state();
  std::vector<sp_hint_v1> &hints = engine_.hints();
  bool rules_moved_a_unit = false;
  for (sp_hint_v1 &hint : hints) {
    const std::uint32_t b = hint.block_id;
    BlockState &block = state.blocks[b];
    const sp_precision before = travels_as(block.assignment);
    // Before the first step no gradient, loss or revert exists yet: only the force lists act.
    const std::optional<sp_reason> reason =
        step >= 0 ? engine_.apply_standing_rules(block, b, step)
                  : engine_.forced(b) >= 0 ? std::optional<sp_reason>(SP_REASON_FORCED) : std::nullopt;
    if (step < 0 && reason) block.assignment = assignment_for(engine_.forced(b));
    decided_by_rule_[b] = reason ? 1 : 0;
    if (reason) hint.reason = *reason;
    rules_moved_a_unit = rules_moved_a_unit || travels_as(block.assignment) != before;
  }
  const BudgetState &budget = state.budget;
  const bool new_costs = costs_call_for_allocation(step, decision_step);
  if (new_costs) adopt_new_costs();
  const bool reallocate = budget.source == AllocationSource::none || replan_ || rules_moved_a_unit || new_costs;
  if (reallocate) {
    allocate(step);
  } else {
    const bool from_costs = budget.source != AllocationSource::none && budget.source != AllocationSource::prior;
    const sp_reason kept = from_costs ? SP_REASON_BUDGET : SP_REASON_NO_DATA;
    for (sp_hint_v1 &hint : hints) {
      if (!decided_by_rule_[hint.block_id]) hint.reason = kept;
    }
  }
  // Sensitivity: the unit's cheapest_tier_cost over the largest of any unit, so 1 marks the
  // unit a cheap image would hurt most; NaN without a cost.
  double largest = 0.0;
  for (std::uint32_t u = 0; u < engine_.n_blocks(); ++u) {
    const double unit_cost = cheapest_tier_cost(u);
    if (!std::isnan(unit_cost)) largest = std::max(largest, unit_cost);
  }
  for (sp_hint_v1 &hint : hints) {
    const double unit_cost = cheapest_tier_cost(hint.block_id);
    hint.precision = travels_as(state.blocks[hint.block_id].assignment);
    hint.sensitivity = std::isnan(unit_cost) ? ScoreParts::kNever : largest > 0.0 ? unit_cost / largest : 0.0;
  }
  return reallocate;
}

void BudgetedRule::allocate(std::int64_t step) {
  const PolicySettings &config = engine_.config();
  const std::vector<BlockBytes> &block_bytes = engine_.block_bytes();
  PolicyState &state = engine_.rule_state();
  std::vector<sp_hint_v1> &hints = engine_.hints();
  BudgetState &budget = state.budget;
  const std::uint32_t n = engine_.n_blocks();
  const bool measured = has_costs();
  const double reference = engine_.reference_loss();
  const bool loss_budget = config.budget.kind == BudgetKind::loss;
  if (loss_budget && !(measured && reference > 0.0)) {
    // Nothing to weigh a loss budget with yet: every unit keeps what it has (BF16 at first).
    for (sp_hint_v1 &hint : hints) {
      if (!decided_by_rule_[hint.block_id]) hint.reason = SP_REASON_NO_DATA;
    }
    return;
  }
  const auto unit_cost = [&](std::uint32_t u, sp_precision tier) {
    if (!measured) return prior_cost(block_bytes, u, tier, config.nf4_group_size);
    const double value = cost(u, tier);
    return std::isnan(value) ? 0.0 : value;
  };

  std::vector<KnapsackUnit> units(n);
  std::vector<std::vector<sp_precision>> tiers_of(n);
  std::vector<sp_reason> reasons(n, measured ? SP_REASON_BUDGET : SP_REASON_NO_DATA);
  for (std::uint32_t u = 0; u < n; ++u) {
    const BlockState &block = state.blocks[u];
    const sp_precision current = travels_as(block.assignment);
    const auto add = [&](sp_precision tier) {
      units[u].push_back({tier_bytes(block_bytes[u], tier, config.nf4_group_size),
                          unit_cost(u, tier) + (tier == current ? 0.0 : switch_penalty(u, tier))});
      tiers_of[u].push_back(tier);
    };
    if (decided_by_rule_[u]) {
      add(current);
      reasons[u] = hints[u].reason;
      continue;
    }
    if (step >= 0 && !engine_.cooldown_passed(block, step)) {
      add(current);
      reasons[u] = SP_REASON_COOLDOWN;
      continue;
    }
    const bool penalized = step >= 0 && engine_.under_penalty(block, step);
    for (sp_precision tier : kTiers) {
      if (!config.tier(tier)) continue;
      if (penalized && cost_rank(tier) < cost_rank(current)) continue;
      // With costs: a tier is open only where the unit's cost at it is known (BF16 always).
      if (measured && tier != SP_PRECISION_BF16 && std::isnan(cost(u, tier))) continue;
      add(tier);
    }
    if (penalized) reasons[u] = SP_REASON_PENALTY;
  }

  const std::uint64_t all_bf16 = all_bf16_bytes(block_bytes);
  const KnapsackSolution solution = loss_budget
                                        ? least_bytes_within_cost(units, config.budget.limit * reference)
                                        : least_cost_within_bytes(units, byte_limit(config.budget.limit, all_bf16));
  std::vector<sp_precision> choice(n);
  for (std::uint32_t u = 0; u < n; ++u) choice[u] = tiers_of[u][solution.choice[u]];
  if (measured) {
    bool taken = false;
    if (const std::vector<sp_precision> *measured_tiers = measured_choice(choice)) {
      bool open = true;
      for (std::uint32_t u = 0; u < n; ++u) {
        open = open && std::find(tiers_of[u].begin(), tiers_of[u].end(), (*measured_tiers)[u]) != tiers_of[u].end();
      }
      taken = open && !loss_budget &&
              allocation_bytes(block_bytes, *measured_tiers, config.nf4_group_size) <=
                  byte_limit(config.budget.limit, all_bf16_bytes(block_bytes));
      if (taken) choice = *measured_tiers;
    }
    if (!taken) drop_measured_choice();
  }
  double planned_cost = 0.0;
  for (std::uint32_t u = 0; u < n; ++u) {
    BlockState &block = state.blocks[u];
    const sp_precision chosen = choice[u];
    const sp_precision current = travels_as(block.assignment);
    if (reasons[u] == SP_REASON_PENALTY && chosen != current) reasons[u] = SP_REASON_BUDGET;
    if (chosen != current || block.assignment == Assignment::unassigned) {
      // Before the first step a route is where the run starts, not a switch a cooldown counts.
      if (step >= 0) {
        engine_.assign(block, assignment_for(chosen), step);
      } else {
        block.assignment = assignment_for(chosen);
      }
    }
    if (!decided_by_rule_[u]) hints[u].reason = reasons[u];
    planned_cost += unit_cost(u, chosen);
  }
  budget.source = measured ? costs_source() : AllocationSource::prior;
  budget.decided_at_step = step;
  budget.planned_bytes = 0;
  for (std::uint32_t u = 0; u < n; ++u) {
    budget.planned_bytes += tier_bytes(block_bytes[u], travels_as(state.blocks[u].assignment), config.nf4_group_size);
  }
  budget.planned_cost = measured ? planned_cost : ScoreParts::kNever;
  budget.met = loss_budget ? planned_cost <= config.budget.limit * reference
                           : budget.planned_bytes <= byte_limit(config.budget.limit, all_bf16);
  budget.bucket_bytes = solution.bucket_bytes;
  costs_taken();
  replan_ = false;
  LogSink *log = engine_.log();
  if (!budget.met && log != nullptr && log->wants(SP_LOG_WARN)) {
    log->write(SP_LOG_WARN,
               fmt::format("step {}: the {} budget {} cannot be met (pinned units: cooldowns, force lists, unsafe "
                           "gradients, loss-guard reverts); the allocation plans {} of {} all-BF16 bytes and a "
                           "cost of {}",
                           step, loss_budget ? "loss" : "bytes", config.budget.limit, budget.planned_bytes, all_bf16,
                           planned_cost));
  }
}

}  // namespace sp::policy
