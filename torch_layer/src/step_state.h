// The step's state (issue 51; as FSDP2's TrainingState with its FSDPStateContext): where the
// host is in the step protocol (streamed_model.h, "The rules of a step"), what the step's passes
// did, and the statistics its backward left. One value, built anew by begin(); the only writer
// of the step's StepReport, which the passes and the updates report to through it.
// Not installed: the layer's insides (streamed_model_impl.h holds one).
#pragma once

#include "sp/torch_layer/streamed_model.h"

#include <chrono>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "sp/adapters/metrics.h"

namespace sp::torch_layer {

// Adds the counters of `m` to `into` (a pass's fetches over the engine steps that served it, or
// the step's over its passes).
inline void add_transfer(adapters::StepTransferMetrics& into, const adapters::StepTransferMetrics& m) {
  into.h2d_bytes += m.h2d_bytes;
  into.h2d_bytes_all_bf16 += m.h2d_bytes_all_bf16;
  into.fetches += m.fetches;
  into.fetches_by_transfer_policy += m.fetches_by_transfer_policy;
  into.fetches_pinned += m.fetches_pinned;
  into.prefetch_hits += m.prefetch_hits;
  into.prefetch_misses += m.prefetch_misses;
  into.prefetch_unused += m.prefetch_unused;
  into.stalls += m.stalls;
  into.stall_seconds += m.stall_seconds;
  into.image_rebuilds += m.image_rebuilds;
}

class StepState {
 public:
  using Phase = StreamedModel::StepPhase;
  using Clock = std::chrono::steady_clock;

  // ---- where the host is -------------------------------------------------------------------

  Phase phase() const { return phase_; }
  bool in_step() const { return phase_ != Phase::between_steps; }
  bool after_backward() const { return phase_ == Phase::after_backward; }
  // The step under way, or the last one.
  std::int64_t number() const { return number_; }
  // The last step begun, in this run or the one whose state was restored: steps must increase,
  // as the plugin's window and its switch counts are measured in steps.
  const std::optional<std::int64_t>& last_begun() const { return last_begun_; }
  std::int64_t next() const { return last_begun_ ? *last_begun_ + 1 : 0; }
  void restore_last_begun(std::optional<std::int64_t> step) { last_begun_ = step; }

  void require_step(const char* call) const {
    if (!in_step())
      throw std::logic_error(fmt::format("StreamedModel::{}: no step is active; call begin_step()", call));
  }
  // Throws when `step` cannot begin now: one is under way, it is negative, or not after the last.
  void check_can_begin(std::int64_t step) const {
    if (in_step()) {
      throw std::logic_error(
          fmt::format("StreamedModel::begin_step({}): step {} has not ended; call end_step()", step, number_));
    }
    if (step < 0) throw std::invalid_argument(fmt::format("StreamedModel::begin_step({}): steps start at 0", step));
    if (last_begun_ && step <= *last_begun_) {
      throw std::invalid_argument(fmt::format(
          "StreamedModel::begin_step({}): step {} already began, and steps must increase over the whole run (the "
          "policy's windows are counted in steps): number them across epochs, and after restore_state() go on "
          "from step {}",
          step, *last_begun_, *last_begun_ + 1));
    }
  }

  // Step `step` begins: everything of the last step is dropped. `versions`: the version counters
  // of the blocks' trainable parameters now (trained() compares against them). The step is
  // open once open() says so; until then a failure leaves the layer between steps.
  void begin(std::int64_t step, std::optional<sp::host::SwapResult> swap, std::vector<std::int64_t> versions) {
    StepState next(last_begun_);
    next.moments_ = std::move(moments_);  // post_backward's reference stays good until the next one
    *this = std::move(next);
    last_begun_ = step;
    number_ = step;
    start_ = Clock::now();
    transfer_.step = step;
    report_.step = step;
    report_.swap = std::move(swap);
    versions_ = std::move(versions);
  }
  void open() { phase_ = Phase::open; }
  void end_backward() { phase_ = Phase::after_backward; }
  void end() { phase_ = Phase::between_steps; }

  // ---- what the step's passes did ------------------------------------------------------------

  // The leading dimension of a training pass's first block input (the batch size of the
  // signal table's Fisher stand-in).
  void count_examples(std::uint64_t examples) { examples_ += examples; }
  std::uint64_t examples() const { return examples_; }
  // Fetches of the step's training passes, or of an engine step that served none.
  void add_training_transfer(const adapters::StepTransferMetrics& m) { add_transfer(transfer_, m); }
  void count_training_pass() { ++report_.training_passes; }
  void count_eval_bytes(std::uint64_t bytes) { report_.eval_h2d_bytes += bytes; }
  void skip_update(std::uint32_t block) { report_.updates_skipped.push_back(block); }
  void set_calibration(CalibrationErrors errors, double seconds) {
    report_.calibration = std::move(errors);
    report_.calibration_seconds = seconds;
  }
  bool swapped() const { return report_.swap && report_.swap->outcome == sp::host::SwapResult::Outcome::swapped; }

  // ---- what its backward left -----------------------------------------------------------------

  // A training pass's backward finished in this step.
  void note_backward() { backward_ran_ = true; }
  // Whether the trainable parameters moved since begin() after a backward: `versions` now
  // against those begin() took.
  bool backward_ran() const { return backward_ran_; }
  const std::vector<std::int64_t>& versions_at_begin() const { return versions_; }

  // The moments, and the signal table where the policy reads one, of the gradients as the
  // step's latest backward left them, taken when they are final (as a post-accumulate-grad hook
  // would): a host that updates and clears them itself before post_backward still gives the
  // policy its step.
  void keep_statistics(std::vector<sp_grad_moments_v1> moments, std::optional<sp::host::UnitSignalTable> signals) {
    kept_moments_ = std::move(moments);
    kept_signals_ = std::move(signals);
  }
  // An armed update's pass: its updates still write the masters, so post_backward measures.
  void drop_statistics() {
    kept_moments_.reset();
    kept_signals_.reset();
  }
  bool has_statistics() const { return kept_moments_.has_value(); }
  std::pair<std::vector<sp_grad_moments_v1>, std::optional<sp::host::UnitSignalTable>> take_statistics() {
    auto taken = std::make_pair(std::move(*kept_moments_), std::move(kept_signals_));
    drop_statistics();
    return taken;
  }
  // The moments post_backward gave the plugin, returned to the host by reference: kept until the
  // next post_backward.
  const std::vector<sp_grad_moments_v1>& set_moments(std::vector<sp_grad_moments_v1> moments) {
    moments_ = std::move(moments);
    return moments_;
  }

  // ---- its end ---------------------------------------------------------------------------------

  // The plugin's end_step: the step's fetches, its loss and its time.
  sp_step_feedback_v1 feedback(double loss) const {
    sp_step_feedback_v1 out = transfer_.to_feedback();
    out.loss = loss;
    out.step_seconds = std::chrono::duration<double>(Clock::now() - start_).count();
    return out;
  }
  // The step's report, with `routes` (per block, for the next step) and the same per unit.
  StepReport report(std::vector<Precision> routes, std::vector<std::vector<Precision>> unit_routes) const {
    StepReport out = report_;
    out.h2d_bytes = transfer_.h2d_bytes;
    out.h2d_bytes_all_bf16 = transfer_.h2d_bytes_all_bf16;
    out.prefetch_hits = transfer_.prefetch_hits;
    out.prefetch_misses = transfer_.prefetch_misses;
    out.prefetch_unused = transfer_.prefetch_unused;
    out.routes = std::move(routes);
    out.unit_routes = std::move(unit_routes);
    return out;
  }

  StepState() = default;

 private:
  explicit StepState(std::optional<std::int64_t> last_begun) : last_begun_(last_begun) {}

  Phase phase_ = Phase::between_steps;
  std::int64_t number_ = 0;
  std::optional<std::int64_t> last_begun_;
  Clock::time_point start_;
  adapters::StepTransferMetrics transfer_;
  StepReport report_;
  std::uint64_t examples_ = 0;
  std::vector<std::int64_t> versions_;
  bool backward_ran_ = false;
  std::optional<std::vector<sp_grad_moments_v1>> kept_moments_;
  std::optional<sp::host::UnitSignalTable> kept_signals_;
  std::vector<sp_grad_moments_v1> moments_;
};

}  // namespace sp::torch_layer
