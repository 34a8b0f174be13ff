// The complete mutable state of one policy instance: exactly what export_state writes and
// import_state restores, so that a hot swap continues with identical decisions.
#pragma once

#include <sp/plugin_abi_v1.h>

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

enum class Assignment : std::uint8_t { unassigned = 0, bf16 = 1, int8 = 2 };

// The parts of a block's sensitivity at the last decision step that scored it.
struct ScoreParts {
  static constexpr double kNever = std::numeric_limits<double>::quiet_NaN();
  double avg_l2 = kNever;
  double relative_magnitude = kNever;
  double grad_score = kNever;
  double error_score = kNever;
  double sensitivity = kNever;
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
};

struct PolicyState {
  std::vector<BlockState> blocks;
  SampleWindows windows;
  // -1 before the first begin_step.
  std::int64_t current_step = -1;
  StepPhase phase = StepPhase::before_first_step;
  MeasuredBytes measured_since_record;

  PolicyState() = default;
  PolicyState(std::uint32_t n_blocks, std::uint32_t window_capacity)
      : blocks(n_blocks), windows(n_blocks, window_capacity) {}
};

}  // namespace sp::policy
