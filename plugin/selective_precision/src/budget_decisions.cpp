// Policy v3: the signal table, the budget's allocation and what it reports (docs/policy.md,
// "Policy v3"). The rules every mode shares (force lists, unsafe, loss guard) live in engine.cpp.
#include "sp/policy/budget.h"
#include "sp/policy/engine.h"
#include "sp/policy/errors.h"
#include "sp/policy/knapsack.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string_view>

namespace sp::policy {
namespace {

// The columns of a table, beyond which no plugin reads: a bound on the names it compares.
constexpr std::uint32_t kMaxSignalColumns = 4096;

// Cost order, bf16 > int8 > nf4: a lower rank is a move down.
int rank_of(sp_precision precision) {
  return precision == SP_PRECISION_NF4 ? 0 : precision == SP_PRECISION_INT8 ? 1 : 2;
}

sp_precision travels_as(Assignment assignment) {
  return assignment == Assignment::int8  ? SP_PRECISION_INT8
         : assignment == Assignment::nf4 ? SP_PRECISION_NF4
                                         : SP_PRECISION_BF16;
}

Assignment assignment_of(sp_precision precision) {
  return precision == SP_PRECISION_INT8 ? Assignment::int8
         : precision == SP_PRECISION_NF4 ? Assignment::nf4
                                         : Assignment::bf16;
}

std::uint64_t all_bf16_bytes(const std::vector<BlockBytes> &blocks) {
  std::uint64_t total = 0;
  for (const BlockBytes &block : blocks) total += block.bf16;
  return total;
}

// The byte limit of a bytes budget, rounded down so that it is never exceeded.
std::uint64_t byte_limit(double fraction, std::uint64_t all_bf16) {
  return static_cast<std::uint64_t>(std::floor(fraction * static_cast<double>(all_bf16)));
}

// Where each known column sits in a table; -1 where it is absent.
struct ColumnIndex {
  std::array<std::int64_t, kTiers.size()> cost{-1, -1, -1};
  std::array<std::int64_t, kTiers.size()> first_order{-1, -1, -1};
  std::array<std::int64_t, kTiers.size()> second_order{-1, -1, -1};
};

}  // namespace

double smoothed(double average, double value, double smoothing) {
  if (std::isnan(value)) return average;
  return std::isnan(average) ? value : smoothing * average + (1.0 - smoothing) * value;
}

const char *loss_cost_column(sp_precision tier) {
  return tier == SP_PRECISION_NF4 ? "loss_cost.nf4" : tier == SP_PRECISION_INT8 ? "loss_cost.int8" : "loss_cost.bf16";
}
const char *first_order_column(sp_precision tier) {
  return tier == SP_PRECISION_NF4    ? "first_order.nf4"
         : tier == SP_PRECISION_INT8 ? "first_order.int8"
                                     : "first_order.bf16";
}
const char *second_order_column(sp_precision tier) {
  return tier == SP_PRECISION_NF4    ? "second_order.nf4"
         : tier == SP_PRECISION_INT8 ? "second_order.int8"
                                     : "second_order.bf16";
}

std::uint64_t tier_bytes(const BlockBytes &bytes, sp_precision tier, std::int64_t nf4_group_size) {
  switch (tier) {
    case SP_PRECISION_INT8:
      return bytes.int8;
    case SP_PRECISION_NF4:
      return bytes.nf4 > 0 ? bytes.nf4
                           : static_cast<std::uint64_t>(
                                 std::ceil(nominal_nf4_ratio(nf4_group_size) * static_cast<double>(bytes.bf16)));
    default:
      return bytes.bf16;
  }
}

bool gets_more_bits(std::uint32_t unit, std::uint32_t n_units) {
  const std::uint32_t eighth = n_units / 8;
  return unit < eighth || unit >= 7 * n_units / 8 || (unit >= eighth && (unit - eighth) % 3 == 2);
}

double prior_cost(const std::vector<BlockBytes> &blocks, std::uint32_t unit, sp_precision tier,
                  std::int64_t nf4_group_size) {
  const std::uint64_t bf16 = blocks[unit].bf16;
  const std::uint64_t bytes = tier_bytes(blocks[unit], tier, nf4_group_size);
  const double saved = bf16 > bytes ? static_cast<double>(bf16 - bytes) : 0.0;
  const double weight = gets_more_bits(unit, static_cast<std::uint32_t>(blocks.size())) ? 2.0 : 1.0;
  return weight * saved / static_cast<double>(all_bf16_bytes(blocks));
}

void check_budget_feasible(const ParsedConfig &parsed, const std::vector<BlockBytes> &block_bytes) {
  const PolicySettings &config = parsed.config;
  if (config.effective_mode() != Mode::budget) return;
  for (std::size_t b = 0; b < block_bytes.size(); ++b) {
    if (block_bytes[b].bf16 == 0 || (config.tier(SP_PRECISION_INT8) && block_bytes[b].int8 == 0)) {
      throw InvalidArgument(fmt::format("create: block {} has bf16_bytes {} and int8_bytes {}; mode budget needs the "
                                        "size of every block at every tier",
                                        b, block_bytes[b].bf16, block_bytes[b].int8));
    }
  }
  if (config.budget.kind != BudgetKind::bytes) return;
  std::vector<std::int8_t> forced(block_bytes.size(), -1);
  for (std::uint32_t b : config.force_bf16_blocks) forced[b] = SP_PRECISION_BF16;
  for (std::uint32_t b : config.force_int8_blocks) forced[b] = SP_PRECISION_INT8;
  for (std::uint32_t b : config.force_nf4_blocks) forced[b] = SP_PRECISION_NF4;
  std::uint64_t fewest = 0;
  for (std::size_t b = 0; b < block_bytes.size(); ++b) {
    std::uint64_t least = block_bytes[b].bf16;
    for (sp_precision tier : kTiers) {
      const bool allowed = forced[b] >= 0 ? tier == forced[b] : config.tier(tier);
      if (allowed) least = std::min(least, tier_bytes(block_bytes[b], tier, config.nf4_group_size));
    }
    if (forced[b] >= 0) least = tier_bytes(block_bytes[b], forced[b], config.nf4_group_size);
    fewest += least;
  }
  const std::uint64_t all_bf16 = all_bf16_bytes(block_bytes);
  if (fewest > byte_limit(config.budget.limit, all_bf16)) {
    // At four digits, the smallest fraction that is itself feasible.
    double smallest = std::ceil(1e4 * static_cast<double>(fewest) / static_cast<double>(all_bf16)) / 1e4;
    while (byte_limit(smallest, all_bf16) < fewest) smallest += 1e-4;
    throw PolicyConfigError(fmt::format(
        "{}.budget.bytes: expected at least {} (the fewest bytes the tiers {} and the force lists allow: {} of {} "
        "all-BF16 bytes), found {}",
        parsed.section_path, smallest, config.tier(SP_PRECISION_NF4) ? "with nf4" : "without nf4", fewest, all_bf16,
        config.budget.limit));
  }
}

void PolicyEngine::set_unit_signals(std::int64_t step, const sp_unit_signals_v1 *signals) {
  if (signals == nullptr) throw InvalidArgument("set_unit_signals: signals is null");
  if (signals->struct_size < SP_UNIT_SIGNALS_V1_2_SIZE) {
    throw InvalidArgument(fmt::format("set_unit_signals: struct_size is {}, smaller than the {} bytes of ABI 1.2",
                                      signals->struct_size, SP_UNIT_SIGNALS_V1_2_SIZE));
  }
  if (step < -1 || step > state_.current_step) {
    throw InvalidArgument(fmt::format("set_unit_signals: step {} is outside [-1, {}] (-1: before the first step; at "
                                      "most the current step)",
                                      step, state_.current_step));
  }
  if (signals->n_units != n_blocks()) {
    throw InvalidArgument(fmt::format("set_unit_signals: n_units = {}, but the policy was created for {} blocks",
                                      signals->n_units, n_blocks()));
  }
  const std::uint32_t columns = signals->n_signals;
  if (columns > kMaxSignalColumns) {
    throw InvalidArgument(
        fmt::format("set_unit_signals: n_signals = {}, more than the {} columns a table may have", columns,
                    kMaxSignalColumns));
  }
  if (columns > 0 && (signals->signal_names == nullptr || signals->values == nullptr)) {
    throw InvalidArgument(fmt::format("set_unit_signals: signal_names or values is null but n_signals = {}", columns));
  }
  ColumnIndex index;
  for (std::uint32_t c = 0; c < columns; ++c) {
    const char *name = signals->signal_names[c];
    if (name == nullptr) throw InvalidArgument(fmt::format("set_unit_signals: signal_names[{}] is null", c));
    for (std::uint32_t earlier = 0; earlier < c; ++earlier) {
      if (std::strcmp(signals->signal_names[earlier], name) == 0) {
        throw InvalidArgument(fmt::format("set_unit_signals: signal_names[{}] repeats '{}'", c, name));
      }
    }
    for (std::size_t t = 0; t < kTiers.size(); ++t) {
      if (std::strcmp(name, loss_cost_column(kTiers[t])) == 0) index.cost[t] = c;
      if (std::strcmp(name, first_order_column(kTiers[t])) == 0) index.first_order[t] = c;
      if (std::strcmp(name, second_order_column(kTiers[t])) == 0) index.second_order[t] = c;
    }
  }
  const std::size_t value_count = static_cast<std::size_t>(n_blocks()) * columns;
  for (std::size_t i = 0; i < value_count; ++i) {
    if (std::isinf(signals->values[i])) {
      throw InvalidArgument(fmt::format("set_unit_signals: unit {} has {} in column '{}'; expected a finite value or "
                                        "NaN (not measured)",
                                        i / columns, signals->values[i], signals->signal_names[i % columns]));
    }
  }
  if (std::isinf(signals->loss)) {
    throw InvalidArgument(fmt::format("set_unit_signals: loss is {}; expected a finite loss or NaN", signals->loss));
  }

  BudgetState &budget = state_.budget;
  const auto value = [&](std::uint32_t unit, std::int64_t column) {
    return column < 0 ? ScoreParts::kNever : signals->values[static_cast<std::size_t>(unit) * columns + column];
  };
  for (std::uint32_t u = 0; u < n_blocks(); ++u) {
    UnitSignals &unit = budget.units[u];
    for (std::size_t t = 0; t < kTiers.size(); ++t) {
      unit.cost[t] = smoothed(unit.cost[t], value(u, index.cost[t]), config_.signal_smoothing);
      if (index.first_order[t] >= 0) unit.first_order[t] = value(u, index.first_order[t]);
      if (index.second_order[t] >= 0) unit.second_order[t] = value(u, index.second_order[t]);
    }
  }
  ++budget.tables_received;
  budget.last_table_samples = signals->samples;
  budget.last_signal_step = step;
  budget.signals_pending = true;
  if (std::isfinite(signals->loss)) budget.table_loss = signals->loss;
}

void PolicyEngine::unit_costs(sp_precision precision, double *costs_out, std::uint32_t n) const {
  if (precision < SP_PRECISION_BF16 || precision > SP_PRECISION_NF4) {
    throw InvalidArgument(fmt::format("get_unit_costs: precision {} is unknown to this plugin (bf16 = 0, int8 = 1, "
                                      "nf4 = 2)",
                                      precision));
  }
  if (n != n_blocks()) {
    throw InvalidArgument(fmt::format("get_unit_costs: n = {}, but the policy was created for {} blocks", n, n_blocks()));
  }
  if (costs_out == nullptr) throw InvalidArgument("get_unit_costs: costs_out is null");
  for (std::uint32_t u = 0; u < n; ++u) costs_out[u] = state_.budget.units[u].cost[precision];
}

double PolicyEngine::reference_loss() const {
  const BudgetState &budget = state_.budget;
  return !std::isnan(budget.feedback_loss) ? budget.feedback_loss : budget.table_loss;
}

void PolicyEngine::budget_status(sp_budget_status_v1 *out) const {
  if (out == nullptr) throw InvalidArgument("get_budget_status: status_out is null");
  if (out->struct_size < SP_BUDGET_STATUS_V1_2_SIZE) {
    throw InvalidArgument(fmt::format("get_budget_status: struct_size is {}, smaller than the {} bytes of ABI 1.2",
                                      out->struct_size, SP_BUDGET_STATUS_V1_2_SIZE));
  }
  const BudgetState &budget = state_.budget;
  const bool has_budget = mode_ == Mode::budget;
  const bool allocated = has_budget && budget.source != AllocationSource::none;
  const double reference = reference_loss();
  const std::uint64_t all_bf16 = all_bf16_bytes(block_bytes_);
  out->kind = static_cast<sp_budget_kind>(has_budget ? config_.budget.kind : BudgetKind::none);
  out->limit = has_budget ? config_.budget.limit : ScoreParts::kNever;
  out->planned_bytes_fraction =
      allocated && all_bf16 > 0 ? static_cast<double>(budget.planned_bytes) / static_cast<double>(all_bf16)
                                : ScoreParts::kNever;
  out->planned_cost = allocated ? budget.planned_cost : ScoreParts::kNever;
  out->planned_loss_fraction = allocated && reference > 0.0 ? budget.planned_cost / reference : ScoreParts::kNever;
  out->reference_loss = reference;
  out->decided_at_step = allocated ? budget.decided_at_step : -1;
  out->met = allocated && budget.met ? 1 : 0;
  out->reserved0 = 0;
}

BudgetRecord PolicyEngine::budget_record() const {
  return BudgetRecord{config_.budget.kind, config_.budget.limit, reference_loss(), all_bf16_bytes(block_bytes_)};
}

// The unit's smoothed cost at its cheapest configured tier (clamped at 0), NaN without one.
double PolicyEngine::cheapest_tier_cost(std::uint32_t block) const {
  double cost = ScoreParts::kNever;
  for (sp_precision tier : kTiers) {
    const double measured = state_.budget.units[block].cost[tier];
    if (tier != SP_PRECISION_BF16 && config_.tier(tier) && !std::isnan(measured)) cost = std::max(measured, 0.0);
  }
  return cost;
}

bool PolicyEngine::decide_budget(std::int64_t step, bool decision_step) {
  bool rules_moved_a_unit = false;
  for (sp_hint_v1 &hint : hints_) {
    const std::uint32_t b = hint.block_id;
    BlockState &block = state_.blocks[b];
    const sp_precision before = travels_as(block.assignment);
    const std::optional<sp_reason> reason = apply_standing_rules(block, b, step);
    decided_by_rule_[b] = reason ? 1 : 0;
    if (reason) hint.reason = *reason;
    rules_moved_a_unit = rules_moved_a_unit || travels_as(block.assignment) != before;
  }
  const BudgetState &budget = state_.budget;
  const bool reallocate = budget.source == AllocationSource::none || sizes_changed_ || rules_moved_a_unit ||
                          (decision_step && budget.signals_pending);
  if (reallocate) {
    allocate(step);
  } else {
    const sp_reason kept = budget.source == AllocationSource::signals ? SP_REASON_BUDGET : SP_REASON_NO_DATA;
    for (sp_hint_v1 &hint : hints_) {
      if (!decided_by_rule_[hint.block_id]) hint.reason = kept;
    }
  }
  // Sensitivity: the unit's cheapest_tier_cost over the largest of any unit, so 1 marks the
  // unit a cheap image would hurt most; NaN without a measurement.
  double largest = 0.0;
  for (std::uint32_t u = 0; u < n_blocks(); ++u) {
    const double cost = cheapest_tier_cost(u);
    if (!std::isnan(cost)) largest = std::max(largest, cost);
  }
  for (sp_hint_v1 &hint : hints_) {
    const double cost = cheapest_tier_cost(hint.block_id);
    hint.precision = travels_as(state_.blocks[hint.block_id].assignment);
    hint.sensitivity = std::isnan(cost) ? ScoreParts::kNever : largest > 0.0 ? cost / largest : 0.0;
  }
  return reallocate;
}

void PolicyEngine::allocate(std::int64_t step) {
  BudgetState &budget = state_.budget;
  const bool measured = budget.tables_received > 0;
  const double reference = reference_loss();
  const bool loss_budget = config_.budget.kind == BudgetKind::loss;
  if (loss_budget && !(measured && reference > 0.0)) {
    // Nothing to weigh a loss budget with yet: every unit keeps what it has (BF16 at first).
    for (sp_hint_v1 &hint : hints_) {
      if (!decided_by_rule_[hint.block_id]) hint.reason = SP_REASON_NO_DATA;
    }
    return;
  }
  // The prior's costs are fractions of a reference loss of 1.
  const double margin = config_.switch_margin * (measured ? (reference > 0.0 ? reference : 0.0) : 1.0);
  const auto true_cost = [&](std::uint32_t u, sp_precision tier) {
    if (!measured) return prior_cost(block_bytes_, u, tier, config_.nf4_group_size);
    const double cost = budget.units[u].cost[tier];
    // A predicted gain is not taken as one: quantizing never counts as helping the loss.
    return std::isnan(cost) ? 0.0 : std::max(cost, 0.0);
  };

  std::vector<KnapsackUnit> units(n_blocks());
  std::vector<std::vector<sp_precision>> tiers_of(n_blocks());
  std::vector<sp_reason> reasons(n_blocks(), measured ? SP_REASON_BUDGET : SP_REASON_NO_DATA);
  for (std::uint32_t u = 0; u < n_blocks(); ++u) {
    const BlockState &block = state_.blocks[u];
    const sp_precision current = travels_as(block.assignment);
    const auto add = [&](sp_precision tier) {
      units[u].push_back({tier_bytes(block_bytes_[u], tier, config_.nf4_group_size),
                          true_cost(u, tier) + (tier == current ? 0.0 : margin)});
      tiers_of[u].push_back(tier);
    };
    if (decided_by_rule_[u]) {
      add(current);
      reasons[u] = hints_[u].reason;
      continue;
    }
    if (!cooldown_passed(block, step)) {
      add(current);
      reasons[u] = SP_REASON_COOLDOWN;
      continue;
    }
    const bool penalized = under_penalty(block, step);
    for (sp_precision tier : kTiers) {
      if (!config_.tier(tier)) continue;
      if (penalized && rank_of(tier) < rank_of(current)) continue;
      // Measured: a tier is open only where the unit's cost at it was measured (BF16 always).
      if (measured && tier != SP_PRECISION_BF16 && std::isnan(budget.units[u].cost[tier])) continue;
      add(tier);
    }
    if (penalized) reasons[u] = SP_REASON_PENALTY;
  }

  const std::uint64_t all_bf16 = all_bf16_bytes(block_bytes_);
  const KnapsackSolution solution = loss_budget
                                        ? least_bytes_within_cost(units, config_.budget.limit * reference)
                                        : least_cost_within_bytes(units, byte_limit(config_.budget.limit, all_bf16));
  double planned_cost = 0.0;
  for (std::uint32_t u = 0; u < n_blocks(); ++u) {
    BlockState &block = state_.blocks[u];
    const sp_precision chosen = tiers_of[u][solution.choice[u]];
    const sp_precision current = travels_as(block.assignment);
    if (reasons[u] == SP_REASON_PENALTY && chosen != current) reasons[u] = SP_REASON_BUDGET;
    if (chosen != current || block.assignment == Assignment::unassigned) assign(block, assignment_of(chosen), step);
    if (!decided_by_rule_[u]) hints_[u].reason = reasons[u];
    planned_cost += true_cost(u, chosen);
  }
  budget.source = measured ? AllocationSource::signals : AllocationSource::prior;
  budget.signals_pending = false;
  budget.decided_at_step = step;
  budget.planned_bytes = 0;
  for (std::uint32_t u = 0; u < n_blocks(); ++u) {
    budget.planned_bytes += tier_bytes(block_bytes_[u], travels_as(state_.blocks[u].assignment), config_.nf4_group_size);
  }
  budget.planned_cost = measured ? planned_cost : ScoreParts::kNever;
  budget.met = loss_budget ? planned_cost <= config_.budget.limit * reference
                           : budget.planned_bytes <= byte_limit(config_.budget.limit, all_bf16);
  budget.bucket_bytes = solution.bucket_bytes;
  sizes_changed_ = false;
  if (!budget.met && log_ != nullptr && log_->wants(SP_LOG_WARN)) {
    log_->write(SP_LOG_WARN,
                fmt::format("step {}: the {} budget {} cannot be met (pinned units: cooldowns, force lists, unsafe "
                            "gradients, loss-guard reverts); the allocation plans {} of {} all-BF16 bytes and a "
                            "predicted cost of {}",
                            step, loss_budget ? "loss" : "bytes", config_.budget.limit, budget.planned_bytes,
                            all_bf16, planned_cost));
  }
}

}  // namespace sp::policy
