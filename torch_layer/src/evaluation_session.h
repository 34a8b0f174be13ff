// The evaluation session (issue 51): the forward-only passes on the evaluation engine (the
// host's no-grad calls, calibration's passes and a route measurement's), the pass under way,
// the routes a measurement pins every pass to, and the bytes they fetch, counted apart by kind.
// Not installed: the layer's insides (streamed_model_impl.h holds one; it attaches and
// detaches the blocks, which the session does not own).
#pragma once

#include <cstdint>
#include <optional>
#include <utility>

#include "sp/adapters/streaming_engine.h"
#include "step_state.h"

namespace sp::torch_layer {

class EvaluationSession {
 public:
  void use_engine(adapters::StreamingEngine& engine) { engine_ = &engine; }

  // ---- the pass under way ------------------------------------------------------------------

  // An evaluation pass is open, and has called called() blocks: the engine's schedule's first ones.
  bool is_open() const { return open_; }
  std::uint32_t called() const { return called_; }
  // Whether a no-grad call of block b opens a pass: none is open, the open one called every
  // block, b is the block the engine's schedule begins with, or the open one stopped early (an
  // early exit: it called b already). An open pass is left unfinished.
  bool opens_pass(std::uint32_t b) const {
    if (!open_) return true;
    const adapters::StepSchedule& schedule = engine_->schedule();
    if (called_ == schedule.options().num_blocks || schedule.uses().front().block == b) return true;
    return schedule.forward_use(b) < called_;
  }
  // With none open. `limits`: a whole pass's (calibration's pins), else the session's.
  void begin_pass(const adapters::RuntimeLimitHints& limits) {
    engine_->begin_step(engine_steps_++, limits);
    open_ = true;
    called_ = 0;
  }
  adapters::StepTransferMetrics end_pass() {
    open_ = false;
    return engine_->end_step();
  }
  // The open pass's next block is another than the schedule has there: the engine's step ends
  // (its bytes counted), the caller moves the block to that use, and another step begins there.
  void end_engine_step(StepState& step) { count(engine_->end_step().h2d_bytes.total(), step); }
  void begin_engine_step_at_next() { engine_->begin_step(engine_steps_++, limits(), called_); }
  void block_called() { ++called_; }
  // The open pass, if any, ends here and its bytes count (a pass the host left before its last
  // block, or one a measurement's closure left open).
  void close_open_pass(StepState& step) {
    if (open_) count(end_pass().h2d_bytes.total(), step);
  }

  // ---- a route measurement (StreamedModel::compare_routes) -----------------------------------

  bool measuring() const { return pins_.has_value(); }
  // Every pass the host opens from here is pinned to `pins`, and its bytes are a measurement's.
  void pin(adapters::RuntimeLimitHints pins) { pins_ = std::move(pins); }
  void unpin() { pins_.reset(); }
  // The limits of a pass the host opens: a measurement's pins, else none.
  adapters::RuntimeLimitHints limits() const { return pins_ ? *pins_ : adapters::RuntimeLimitHints{}; }

  // ---- the bytes, by kind ------------------------------------------------------------------

  // An evaluation's fetched bytes: a route measurement's while one runs, else the host's
  // evaluations' (and the step's report's, through `step`).
  void count(std::uint64_t bytes, StepState& step) {
    if (pins_) {
      measurement_bytes_ += bytes;
      return;
    }
    evaluation_bytes_ += bytes;
    step.count_eval_bytes(bytes);
  }
  void count_calibration(std::uint64_t bytes) { calibration_bytes_ += bytes; }
  std::uint64_t evaluation_bytes() const { return evaluation_bytes_; }
  std::uint64_t calibration_bytes() const { return calibration_bytes_; }
  std::uint64_t measurement_bytes() const { return measurement_bytes_; }

  // The engine steps begun, in this run or the one whose state was restored (the engine's
  // metrics number them).
  std::int64_t engine_steps() const { return engine_steps_; }
  void restore_engine_steps(std::int64_t steps) { engine_steps_ = steps; }

 private:
  adapters::StreamingEngine* engine_ = nullptr;  // the layer's evaluation engine, which outlives the session
  bool open_ = false;
  std::uint32_t called_ = 0;
  std::int64_t engine_steps_ = 0;
  std::optional<adapters::RuntimeLimitHints> pins_;
  std::uint64_t evaluation_bytes_ = 0, calibration_bytes_ = 0, measurement_bytes_ = 0;
};

}  // namespace sp::torch_layer
