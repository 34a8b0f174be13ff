// The Selective Precision policy engine: the hook order, input validation, state, telemetry and
// the rules every mode shares (force lists, unsafe gradients, the loss guard, cooldowns), exactly
// as docs/policy.md has them. The routes themselves are decided by the rule module of the
// configured mode (decision_rule.h): v1/v2's thresholds, v3's budget, v4's measured costs.
// One instance per plugin context; not thread-safe (the host calls a context from one
// thread at a time). Every method validates its input completely before it changes
// anything, so a call that throws leaves the engine as it was.
#pragma once

#include "sp/policy/config.h"
#include "sp/policy/decision_rule.h"
#include "sp/policy/log_sink.h"
#include "sp/policy/state.h"
#include "sp/policy/telemetry.h"

#include <sp/plugin_abi_v1.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace sp::policy {

class PolicyEngine {
 public:
  // `block_bytes` has one entry per block (block id = index). `log` may be null and must
  // outlive the engine. A relative telemetry_file is resolved against `output_dir`
  // (empty = the working directory).
  PolicyEngine(PolicySettings config, std::vector<BlockBytes> block_bytes, LogSink *log, const std::string &output_dir);
  // Writes the telemetry record of a step that never reached end_step.
  ~PolicyEngine();
  PolicyEngine(const PolicyEngine &) = delete;
  PolicyEngine &operator=(const PolicyEngine &) = delete;

  std::uint32_t n_blocks() const { return static_cast<std::uint32_t>(block_bytes_.size()); }
  const PolicySettings &config() const { return config_; }
  const PolicyState &state() const { return state_; }
  bool is_decision_step(std::int64_t step) const;

  void begin_step(std::int64_t step);
  void post_backward(std::int64_t step, const sp_grad_moments_v1 *moments, std::uint32_t n);
  void compute_hints(std::int64_t step, sp_hint_v1 *hints_out, std::uint32_t n);
  // Before the first begin_step: the forced routes, BF16 elsewhere (ABI 1.3 initial_hints).
  void initial_hints(sp_hint_v1 *hints_out, std::uint32_t n);
  void end_step(std::int64_t step, const sp_step_feedback_v1 *feedback);
  void set_calibration_errors(const std::uint32_t *block_ids, const double *errors, std::uint32_t n);
  // v2: INT8 is set_calibration_errors; NF4 sets the errors behind e4. BF16 or an unknown
  // precision is InvalidArgument.
  void set_precision_calibration_errors(sp_precision precision, const std::uint32_t *block_ids, const double *errors,
                                        std::uint32_t n);
  // v2: bytes one transfer of each block at `precision` puts on the wire (n = n_blocks()).
  void set_transfer_bytes(sp_precision precision, const std::uint64_t *bytes, std::uint32_t n);
  const std::vector<BlockBytes> &block_bytes() const { return block_bytes_; }
  // v2: the spike that the last end_step judged, if it judged one.
  const std::optional<SpikeRecord> &last_spike() const { return last_spike_; }

  // ABI 1.2: a table of per-unit signals, measured at `step` (-1: before the first step).
  // Validated completely first; the mode's rule reads the columns it knows.
  void set_unit_signals(std::int64_t step, const sp_unit_signals_v1 *signals);
  // The rule's cost of every unit at `precision`, NaN where none (n = n_blocks()).
  void unit_costs(sp_precision precision, double *costs_out, std::uint32_t n) const;
  // Fills the fields of 1.2 that out->struct_size covers.
  void budget_status(sp_budget_status_v1 *out) const;
  // ABI 1.4, between steps: the allocation in force, then the rule's alternatives to it, each a
  // route per block (n = n_blocks()); the proposal a measurement must answer. Empty: nothing to
  // measure.
  const std::vector<std::vector<sp_precision>> &propose_allocations(std::uint32_t n);
  // ABI 1.4, between steps: the host's measurement of the latest proposal, validated completely
  // (the allocations must be the proposal's, in its order), then the rule's to act on.
  void set_allocation_measurements(std::int64_t step, const sp_allocation_measurements_v1 *measurements);
  // The loss a loss budget is a fraction of: the smoothed end_step loss once one arrived in a
  // budgeted mode, else the last signal table's; NaN when neither is known.
  double reference_loss() const;

  std::vector<std::uint8_t> export_state() const;
  void import_state(const std::uint8_t *blob, std::size_t size);

 // ---- What a decision rule reads and changes (decision_rule.h) ----
  PolicyState &rule_state() { return state_; }
  // The hints compute_hints returns; a rule sets every one at decide().
  std::vector<sp_hint_v1> &hints() { return hints_; }
  LogSink *log() const { return log_; }
  Mode mode() const { return mode_; }
  // The precision a force list gives the block, or -1 when it is free (mode off forces nothing).
  std::int8_t forced(std::uint32_t block) const { return forced_[block]; }
  // The rules that act on every step in modes dynamic, budget and measured, before any scoring
  // or allocation: force lists, the unsafe rule, a loss-guard revert, a precision outside the
  // tiers. Returns the reason of the rule that decided the block, if one did.
  std::optional<sp_reason> apply_standing_rules(BlockState &block, std::uint32_t b, std::int64_t step);
  // Moves the block to `target` unless the cooldown (any move) or a penalty (a move down)
  // holds it; the cooldown is checked first, so a block held by both reports `cooldown`.
  sp_reason move_if_allowed(BlockState &block, Assignment target, std::int64_t step) const;
  bool under_penalty(const BlockState &block, std::int64_t step) const;
  bool cooldown_passed(const BlockState &block, std::int64_t step) const;
  void assign(BlockState &block, Assignment target, std::int64_t step) const;

 private:
  void require_phase(const char *hook, std::int64_t step, std::initializer_list<StepPhase> allowed) const;
  BudgetRecord budget_record() const;
  void record_predicted_costs(std::int64_t step, const SignalTable &table);
  bool guard_active() const;
  sp_precision nearest_tier_up(sp_precision precision) const;
  void judge_loss(std::int64_t step, double loss);
  void log_change(std::int64_t step, std::uint32_t block, sp_precision from, const sp_hint_v1 &hint);
  void write_pending_record() noexcept;

  PolicySettings config_;
  Mode mode_;
  std::vector<BlockBytes> block_bytes_;
  LogSink *log_;
  // -1 = free, otherwise the forced sp_precision of the block.
  std::vector<std::int8_t> forced_;
  PolicyState state_;
  std::unique_ptr<TelemetryWriter> telemetry_;
  std::optional<StepRecord> pending_record_;
  std::optional<SpikeRecord> last_spike_;

  std::unique_ptr<DecisionRule> rule_;
  // The latest propose_allocations() answer, which set_allocation_measurements() must match;
  // cleared when it is answered or a step changes the allocation.
  std::vector<std::vector<sp_precision>> proposal_;

  // Scratch space reused every step so that the steady state allocates nothing.
  std::vector<sp_hint_v1> hints_;
  std::vector<std::uint64_t> seen_in_call_;
  std::uint64_t call_serial_ = 0;
};

}  // namespace sp::policy
