// The signal table as the engine takes it (ABI 1.2): validated completely, then handed to the mode's
// rule; what a budgeted mode reports (get_unit_costs, get_budget_status); and the rule registry's
// lookups (decision_rule.h).
#include "sp/policy/budget.h"
#include "sp/policy/decision_rule.h"
#include "sp/policy/engine.h"
#include "sp/policy/errors.h"
#include "sp/policy/routes.h"

#include <fmt/format.h>

#include <array>
#include <cmath>
#include <cstring>

namespace sp::policy {
namespace {

// The columns of a table, beyond which no plugin reads: a bound on the names it compares.
constexpr std::uint32_t kMaxSignalColumns = 4096;

}  // namespace

std::int64_t SignalTable::column(const char *name) const {
  for (std::uint32_t c = 0; c < table_.n_signals; ++c) {
    if (std::strcmp(table_.signal_names[c], name) == 0) return c;
  }
  return -1;
}

double SignalTable::value(std::uint32_t unit, std::int64_t column) const {
  return column < 0 ? ScoreParts::kNever
                    : table_.values[static_cast<std::size_t>(unit) * table_.n_signals + static_cast<std::size_t>(column)];
}

bool takes_budget(Mode mode) {
  const RuleModule &module = rule_module(mode);
  return module.takes_bytes_budget || module.takes_loss_budget;
}

double rule_setting(const PolicySettings &config, Mode mode, const char *key) {
  const auto given = config.rule_settings.find(key);
  if (given != config.rule_settings.end()) return given->second;
  for (const RuleKey &rule_key : rule_module(mode).keys) {
    if (std::strcmp(rule_key.name, key) == 0) return rule_key.fallback;
  }
  throw std::logic_error(fmt::format("rule_setting: mode {} registers no key '{}'", mode_name(mode), key));
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
  for (std::uint32_t c = 0; c < columns; ++c) {
    const char *name = signals->signal_names[c];
    if (name == nullptr) throw InvalidArgument(fmt::format("set_unit_signals: signal_names[{}] is null", c));
    for (std::uint32_t earlier = 0; earlier < c; ++earlier) {
      if (std::strcmp(signals->signal_names[earlier], name) == 0) {
        throw InvalidArgument(fmt::format("set_unit_signals: signal_names[{}] repeats '{}'", c, name));
      }
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

  const SignalTable table(*signals);
  record_predicted_costs(step, table);
  rule_->take_signals(step, table);
  proposal_.clear();  // the next decision may move the allocation it was of
}

// What 3.x did with every table, in every mode: v3's smoothed loss_cost per tier and the two
// terms, for get_unit_costs, the state blob and a later v3. A table with no loss_cost column
// (v4's measured costs) predicts nothing, and is not counted as one.
void PolicyEngine::record_predicted_costs(std::int64_t step, const SignalTable &table) {
  std::array<std::int64_t, kTiers.size()> cost{}, first{}, second{};
  bool predicts = false;
  for (std::size_t t = 0; t < kTiers.size(); ++t) {
    cost[t] = table.column(loss_cost_column(kTiers[t]));
    first[t] = table.column(first_order_column(kTiers[t]));
    second[t] = table.column(second_order_column(kTiers[t]));
    predicts = predicts || cost[t] >= 0;
  }
  if (!predicts) return;
  // Editions before 3 (no v3 module) have no set_unit_signals: their engine never gets here.
  const double smoothing = kPolicyEdition >= 3 ? rule_setting(config_, Mode::budget, kSignalSmoothing) : 0.5;
  BudgetState &budget = state_.budget;
  for (std::uint32_t u = 0; u < n_blocks(); ++u) {
    UnitSignals &unit = budget.units[u];
    for (std::size_t t = 0; t < kTiers.size(); ++t) {
      unit.cost.values[t] = smoothed(unit.cost.values[t], table.value(u, cost[t]), smoothing);
      if (first[t] >= 0) unit.first_order.values[t] = table.value(u, first[t]);
      if (second[t] >= 0) unit.second_order.values[t] = table.value(u, second[t]);
    }
  }
  ++budget.tables_received;
  budget.last_table_samples = table.samples();
  budget.last_signal_step = step;
  budget.signals_pending = true;
  if (std::isfinite(table.loss())) budget.table_loss = table.loss();
}

void PolicyEngine::unit_costs(sp_precision precision, double *costs_out, std::uint32_t n) const {
  if (!from_abi(precision)) {
    throw InvalidArgument(
        fmt::format("get_unit_costs: precision {} is unknown to this plugin ({})", precision, route_codes_text()));
  }
  if (n != n_blocks()) {
    throw InvalidArgument(fmt::format("get_unit_costs: n = {}, but the policy was created for {} blocks", n, n_blocks()));
  }
  if (costs_out == nullptr) throw InvalidArgument("get_unit_costs: costs_out is null");
  for (std::uint32_t u = 0; u < n; ++u) {
    costs_out[u] = rule_->own_cost(u, precision).value_or(state_.budget.units[u].cost[precision]);
  }
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
  const bool has_budget = takes_budget(mode_);
  const bool allocated = has_budget && budget.source != AllocationSource::none;
  const double reference = reference_loss();
  const std::uint64_t all_bf16 = all_bf16_bytes(block_bytes_);
  out->kind = static_cast<sp_budget_kind>(has_budget ? config_.budget.kind : BudgetKind::none);
  out->limit = has_budget ? config_.budget.limit : ScoreParts::kNever;
  out->planned_bytes_fraction =
      allocated && all_bf16 > 0 ? static_cast<double>(budget.planned_bytes) / static_cast<double>(all_bf16)
                                : ScoreParts::kNever;
  out->planned_cost = allocated ? budget.planned_cost : ScoreParts::kNever;
  out->planned_loss_fraction = allocated && reference > 0.0 && rule_->cost_is_loss() ? budget.planned_cost / reference
                                                                                      : ScoreParts::kNever;
  out->reference_loss = reference;
  out->decided_at_step = allocated ? budget.decided_at_step : -1;
  out->met = allocated && budget.met ? 1 : 0;
  out->reserved0 = 0;
#if SP_PLUGIN_ABI_TARGET_MINOR >= 4
  if (out->struct_size >= SP_BUDGET_STATUS_V1_4_SIZE) {
    out->reads_step_signals = rule_->reads_step_signals() ? 1 : 0;
    out->reserved1 = 0;
  }
#endif
}

BudgetRecord PolicyEngine::budget_record() const {
  return BudgetRecord{config_.budget.kind, config_.budget.limit, reference_loss(), all_bf16_bytes(block_bytes_)};
}

}  // namespace sp::policy
