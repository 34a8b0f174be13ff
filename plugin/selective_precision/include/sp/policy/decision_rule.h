// A policy's decision logic as one module, the way Linux's tcp_congestion_ops makes each
// congestion control one file: the engine (engine.h) keeps what every policy shares (the hook
// order, input validation, the force lists, the unsafe rule, the loss guard, cooldowns, state
// and telemetry), and the rule of the configured `mode:` decides the routes.
//
// A rule module is one .cpp file under src/rules/ that defines its RuleModule: the mode name
// that selects it, the config keys only it reads, and a factory. src/rules/registry.cpp lists
// the modules, one line each. A rule may keep private state, carried across a hot swap as its
// own section of the state blob, and add fields to the telemetry record.
#pragma once

#include "sp/policy/config.h"

#include <sp/plugin_abi_v1.h>

#include <nlohmann/json_fwd.hpp>

#include <cstddef>
#include <cstdint>
#include <array>
#include <memory>
#include <optional>
#include <vector>

namespace sp::policy {

class PolicyEngine;

// A signal table that set_unit_signals validated, as a rule reads it: borrowed for the call.
class SignalTable {
 public:
  explicit SignalTable(const sp_unit_signals_v1 &table) : table_(table) {}
  // The index of the column named `name`, or -1 when the table has none.
  std::int64_t column(const char *name) const;
  // The value of `unit` in `column`; NaN when the column is -1 or the value was not measured.
  double value(std::uint32_t unit, std::int64_t column) const;
  double loss() const { return table_.loss; }
  std::uint64_t samples() const { return table_.samples; }

 private:
  const sp_unit_signals_v1 &table_;
};

// One allocation the host measured (ABI 1.4): a route per unit, its cost against the reference
// with the upper confidence bound, and its paired difference from allocation 0 with its bound.
struct MeasuredAllocation {
  std::vector<sp_precision> routes;
  double cost;
  double cost_upper;
  double difference;
  double difference_upper;
};

// A validated sp_allocation_measurements_v1: row 0 is the allocation that was in force when it
// was proposed, the rest the rule's alternatives, in the order it gave them.
struct AllocationMeasurements {
  std::vector<MeasuredAllocation> rows;
  std::uint64_t samples;
  double confidence;
};

class DecisionRule {
 public:
  virtual ~DecisionRule() = default;

  // At compute_hints: sets every hint's precision, reason and sensitivity (PolicyEngine::hints())
  // for `step`. `decision_step` is the schedule of warmup_steps and update_interval_steps;
  // returns whether the step counts as a decision step in telemetry.
  virtual bool decide(std::int64_t step, bool decision_step) = 0;
  // A validated signal table (ABI 1.2) measured at `step` (-1: before the first step).
  virtual void take_signals(std::int64_t /*step*/, const SignalTable & /*table*/) {}
  // Whether the rule decides with the Taylor columns a host measures from each step's gradients
  // (loss_cost, first_order, second_order): a budget status says so (ABI 1.4), and a host that
  // is told no skips measuring them.
  virtual bool reads_step_signals() const { return false; }
  // ABI 1.4: alternatives to the allocation in force that the rule wants measured with it, each a
  // route per unit; none by default.
  virtual std::vector<std::vector<sp_precision>> alternatives() const { return {}; }
  // ABI 1.4: the host's measurement of the allocation in force and of alternatives(), measured at
  // `step` (-1: before the first step). Throws InvalidArgument naming the field it refuses.
  virtual void take_allocation_measurements(std::int64_t /*step*/, const AllocationMeasurements & /*measured*/) {}
  // Whether hints before the first step depend on what the rule was given: the engine then asks
  // decide() for initial_hints instead of giving the forced routes and BF16.
  virtual bool decides_initial_hints() const { return false; }
  // end_step's finite training loss.
  virtual void take_loss(double /*loss*/) {}
  // post_backward's moments of one block, every element of its gradient finite (the engine keeps
  // the others from the rules).
  virtual void take_moments(std::int64_t /*step*/, const sp_grad_moments_v1 & /*moments*/) {}
  // The cost of `unit` at `precision` that get_unit_costs reports, where the rule decides by costs
  // of its own; nullopt: the engine's record of v3's predicted costs (every mode records them).
  virtual std::optional<double> own_cost(std::uint32_t /*unit*/, sp_precision /*precision*/) const {
    return std::nullopt;
  }
  // Whether the planned cost is in units of the training loss (a budget status then gives it as
  // a fraction of the reference loss).
  virtual bool cost_is_loss() const { return true; }
  // Block sizes changed (set_transfer_bytes) or a state was imported: the next decide re-plans.
  virtual void replan() {}

  // The rule's own section of the state blob: a tag no other rule uses, or 0 for none.
  virtual std::uint32_t state_tag() const { return 0; }
  // The payload of its section; an empty payload writes no section.
  virtual std::vector<std::uint8_t> export_section() const { return {}; }
  // Validates the whole payload before it changes anything; throws StateError naming the field.
  // Null when the blob has no section of this rule (another mode's): the rule starts afresh.
  virtual void import_section(const std::vector<std::uint8_t> * /*payload*/) {}
  // Adds the rule's fields to a telemetry record, and to the record's block `unit`.
  virtual void describe(nlohmann::ordered_json & /*record*/) const {}
  virtual void describe_unit(std::uint32_t /*unit*/, nlohmann::ordered_json & /*detail*/) const {}
};

// A number only one rule reads: its key, range and default. The config parser reads it wherever
// the rule's module is part of the edition, and rejects a value outside [low, high] (or
// [low, high) when high_excluded).
struct RuleKey {
  const char *name;
  const char *expected;  // e.g. "a finite number >= 0"
  double low;
  double high;
  double fallback;  // the default
  bool integer;
  bool high_excluded;
};

// A module's keys: a view of its constant array (the core builds as C++17, which has no std::span).
class RuleKeys {
 public:
  constexpr RuleKeys() = default;
  template <std::size_t N>
  constexpr RuleKeys(const RuleKey (&keys)[N]) : begin_(keys), size_(N) {}  // NOLINT: implicit, as a span's
  constexpr const RuleKey *begin() const { return begin_; }
  constexpr const RuleKey *end() const { return begin_ + size_; }

 private:
  const RuleKey *begin_ = nullptr;
  std::size_t size_ = 0;
};

// Every field is a constant, so that a module is constant-initialized and nothing of it is
// registered for destruction: the plugin is dlclose()d at every hot swap, and an exit handler per
// load would grow the host's heap.
struct RuleModule {
  Mode mode;
  const char *name;   // the value of `mode:` that selects the rule
  int first_edition;  // the first SP_POLICY_EDITION that has it
  // The budgets it takes; a rule with neither refuses `budget:`.
  bool takes_bytes_budget;
  bool takes_loss_budget;
  RuleKeys keys;
  std::unique_ptr<DecisionRule> (*create)(PolicyEngine &engine);
};

// The modules of one edition, in the order of the registry.
struct RuleModules {
  std::array<const RuleModule *, 8> modules{};
  std::size_t count = 0;
  const RuleModule *const *begin() const { return modules.data(); }
  const RuleModule *const *end() const { return modules.data() + count; }
};

// The modules of this edition.
const RuleModules &rule_modules();
// The module of `mode`; every Mode has one.
const RuleModule &rule_module(Mode mode);
// Whether the mode's rule takes a budget (budget: is then required).
bool takes_budget(Mode mode);
// A rule's key as configured, or its default.
double rule_setting(const PolicySettings &config, Mode mode, const char *key);

}  // namespace sp::policy
