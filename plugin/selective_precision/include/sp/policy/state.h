// The complete mutable state of one policy instance: exactly what export_state writes and
// import_state restores, so that a hot swap continues with identical decisions.
#pragma once

#include "sp/policy/tiers.h"

#include <sp/plugin_abi_v1.h>
#include <sp/precision.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

namespace sp::policy {

// One finite gradient sample of a block, derived from its moments.
struct GradSample {
  double l2 = 0.0;
  double variance = 0.0;
  double max_abs = 0.0;
};

// The last `capacity` samples of every block, in one flat allocation so that pushing a
// sample never allocates.
class SampleWindows {
 public:
  SampleWindows() = default;
  SampleWindows(std::uint32_t n_blocks, std::uint32_t capacity);

  std::uint32_t n_blocks() const { return static_cast<std::uint32_t>(sizes_.size()); }
  std::uint32_t capacity() const { return capacity_; }
  std::uint32_t size(std::uint32_t block) const { return sizes_[block]; }

  void push(std::uint32_t block, const GradSample &sample);
  // The i-th oldest sample of a block, i < size(block).
  const GradSample &at(std::uint32_t block, std::uint32_t i) const;

 private:
  std::uint32_t capacity_ = 0;
  std::vector<GradSample> samples_;
  std::vector<std::uint32_t> oldest_;
  std::vector<std::uint32_t> sizes_;
};

// Assignment k > 0 is the route sp::kPrecisions[k - 1] (routes.h maps it): the named ones are
// those the threshold rule's model names (1, 2 and 3 in the state blob's formats).
enum class Assignment : std::uint8_t {
  unassigned = 0,
  bf16 = 1 + static_cast<int>(Precision::bf16),
  int8 = 1 + static_cast<int>(Precision::int8),
  nf4 = 1 + static_cast<int>(Precision::nf4),
};

// The parts of a block's sensitivity at the last decision step that scored it.
struct ScoreParts {
  static constexpr double kNever = std::numeric_limits<double>::quiet_NaN();
  double avg_l2 = kNever;
  double relative_magnitude = kNever;
  double grad_score = kNever;
  double error_score = kNever;
  double sensitivity = kNever;  // s8, the v1 sensitivity
  // v2: e4 and s4, the block's sensitivity to NF4.
  double nf4_error_score = kNever;
  double nf4_sensitivity = kNever;
};

// v2: a block's last move to a cheaper precision, and the precision it had before.
struct DownMove {
  std::int64_t step = 0;
  sp_precision from = SP_PRECISION_BF16;
};

struct BlockState {
  Assignment assignment = Assignment::unassigned;
  // A non-finite gradient arrived since the last compute_hints.
  bool unsafe = false;
  std::optional<std::int64_t> last_switch_step;
  std::optional<double> calibration_error;
  // Effective precision that the previous compute_hints returned (BF16 before the first).
  sp_precision previous_precision = SP_PRECISION_BF16;
  ScoreParts score;
  // ---- v2 ----
  std::optional<double> nf4_calibration_error;
  std::optional<DownMove> last_down_move;
  // A loss spike blamed the block: at the next compute_hints it goes back to this precision.
  std::optional<sp_precision> pending_revert;
  // Under penalty (no move down) while step < penalty_until.
  std::optional<std::int64_t> penalty_until;
};

// v2: the last accepted losses of the loss guard, oldest first.
struct LossWindow {
  std::vector<double> losses;
};

// What the current allocation was made from: v3's signal table, or v4's measured costs.
enum class AllocationSource : std::uint8_t { none = 0, prior = 1, signals = 2, measured = 3 };

// v3: one value per tier, looked up by sp_precision; NaN = none.
using TierValues = PerTier<double>;
inline constexpr TierValues kNoTierValues = [] {
  TierValues none;
  for (double &value : none) value = ScoreParts::kNever;
  return none;
}();

// v3: a unit's signals: the smoothed loss_cost per tier it decides with, and the last first-
// and second-order terms the host sent, which it only records.
struct UnitSignals {
  TierValues cost = kNoTierValues;
  TierValues first_order = kNoTierValues;
  TierValues second_order = kNoTierValues;
};

// v3: the budget's state (docs/policy.md, "Policy v3").
struct BudgetState {
  std::vector<UnitSignals> units;
  std::uint64_t tables_received = 0;
  std::uint64_t last_table_samples = 0;
  std::optional<std::int64_t> last_signal_step;  // -1 = a calibration pass
  // A table arrived since the last allocation.
  bool signals_pending = false;
  double table_loss = ScoreParts::kNever;     // the last table's finite loss
  double feedback_loss = ScoreParts::kNever;  // smoothed end_step loss (mode budget only)
  AllocationSource source = AllocationSource::none;
  // The current allocation: when it was made, its bytes and predicted cost (NaN from the prior),
  // whether it keeps the budget, and the solver's bucket (1 = exact).
  std::int64_t decided_at_step = -1;
  std::uint64_t planned_bytes = 0;
  double planned_cost = ScoreParts::kNever;
  bool met = false;
  std::uint64_t bucket_bytes = 1;

  // Whether anything here differs from a fresh state: only then does a blob need format 3.
  bool holds_state() const {
    return tables_received > 0 || source != AllocationSource::none || !std::isnan(feedback_loss);
  }
};

// A decision rule's own section of the state blob (decision_rule.h), carried as its bytes: the
// codec writes the sections after the shared ones and keeps those of other rules as they came,
// so that a swap through another mode and back loses nothing.
struct RuleSection {
  std::uint32_t tag = 0;
  std::vector<std::uint8_t> payload;
};

enum class StepPhase : std::uint8_t {
  before_first_step = 0,
  begun = 1,
  backward_done = 2,
  hints_done = 3,
  ended = 4,
};

// Transfer bytes the host reported through end_step since the last telemetry record.
struct MeasuredBytes {
  std::uint64_t steps = 0;
  std::uint64_t bf16 = 0;
  std::uint64_t int8 = 0;
  std::uint64_t all_bf16 = 0;
  std::uint64_t nf4 = 0;  // v2
};

struct PolicyState {
  std::vector<BlockState> blocks;
  SampleWindows windows;
  // -1 before the first begin_step.
  std::int64_t current_step = -1;
  StepPhase phase = StepPhase::before_first_step;
  MeasuredBytes measured_since_record;
  LossWindow loss_window;
  BudgetState budget;  // v3, and v4's allocation record
  std::vector<RuleSection> rule_sections;  // format 4

  PolicyState() = default;
  PolicyState(std::uint32_t n_blocks, std::uint32_t window_capacity)
      : blocks(n_blocks), windows(n_blocks, window_capacity) {
    budget.units.resize(n_blocks);
  }
};

}  // namespace sp::policy
