#include "sp/policy/engine.hpp"

#include "sp/policy/errors.hpp"
#include "sp/policy/state_codec.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <filesystem>

namespace sp::policy {
namespace {

sp_precision precision_of(Assignment assignment) {
  return assignment == Assignment::int8 ? SP_PRECISION_INT8 : SP_PRECISION_BF16;
}

Assignment assignment_for(sp_precision precision) {
  return precision == SP_PRECISION_INT8 ? Assignment::int8 : Assignment::bf16;
}

const char *phase_name(StepPhase phase) {
  switch (phase) {
    case StepPhase::before_first_step:
      return "before the first begin_step";
    case StepPhase::begun:
      return "after begin_step";
    case StepPhase::backward_done:
      return "after post_backward";
    case StepPhase::hints_done:
      return "after compute_hints";
    case StepPhase::ended:
      return "after end_step";
  }
  return "in an unknown phase";
}

bool moments_finite(const sp_grad_moments_v1 &m) {
  return m.nonfinite == 0 && std::isfinite(m.sum_sq) && std::isfinite(m.sum) && std::isfinite(m.max_abs);
}

GradSample sample_from(const sp_grad_moments_v1 &m) {
  const double count = static_cast<double>(m.count);
  const double mean = m.sum / count;
  GradSample sample;
  sample.l2 = std::sqrt(m.sum_sq);
  sample.variance = std::max(0.0, m.sum_sq / count - mean * mean);
  sample.max_abs = m.max_abs;
  return sample;
}

std::string resolve_telemetry_path(const std::string &file, const std::string &output_dir) {
  const std::filesystem::path path(file);
  if (path.is_absolute() || output_dir.empty()) return path.string();
  return (std::filesystem::path(output_dir) / path).string();
}

}  // namespace

PolicyEngine::PolicyEngine(PolicyConfig config, std::vector<BlockBytes> block_bytes, LogSink *log,
                           const std::string &output_dir)
    : config_(std::move(config)),
      mode_(config_.effective_mode()),
      block_bytes_(std::move(block_bytes)),
      log_(log),
      forced_(block_bytes_.size(), -1),
      state_(static_cast<std::uint32_t>(block_bytes_.size()), static_cast<std::uint32_t>(config_.history_window)),
      hints_(block_bytes_.size()),
      step_scores_(block_bytes_.size()),
      seen_in_call_(block_bytes_.size(), 0) {
  for (std::uint32_t block : config_.force_bf16_blocks) forced_.at(block) = SP_PRECISION_BF16;
  for (std::uint32_t block : config_.force_int8_blocks) forced_.at(block) = SP_PRECISION_INT8;
  for (std::uint32_t b = 0; b < hints_.size(); ++b) {
    hints_[b] = sp_hint_v1{b, SP_PRECISION_BF16, ScoreParts::kNever, SP_REASON_NO_DATA, 0};
  }
  if (config_.telemetry_enabled && mode_ != Mode::off) {
    telemetry_ = std::make_unique<TelemetryWriter>(resolve_telemetry_path(config_.telemetry_file, output_dir), log_);
  }
}

PolicyEngine::~PolicyEngine() { write_pending_record(); }

bool PolicyEngine::is_decision_step(std::int64_t step) const {
  return step >= config_.warmup_steps && (step - config_.warmup_steps) % config_.update_interval_steps == 0;
}

void PolicyEngine::require_phase(const char *hook, std::int64_t step,
                                 std::initializer_list<StepPhase> allowed) const {
  if (step != state_.current_step) {
    throw OrderError(fmt::format("{}({}) called while step {} is current; call begin_step({}) first", hook, step,
                                 state_.current_step, step));
  }
  if (std::find(allowed.begin(), allowed.end(), state_.phase) == allowed.end()) {
    throw OrderError(fmt::format("{}({}) called {} of step {}; the order is begin_step, post_backward, "
                                 "compute_hints, end_step, each at most once",
                                 hook, step, phase_name(state_.phase), step));
  }
}

void PolicyEngine::begin_step(std::int64_t step) {
  if (step < 0) throw InvalidArgument(fmt::format("begin_step({}): steps start at 0", step));
  if (state_.current_step >= 0 && step <= state_.current_step) {
    throw OrderError(fmt::format("begin_step({}) after step {}: steps must increase", step, state_.current_step));
  }
  write_pending_record();
  state_.current_step = step;
  state_.phase = StepPhase::begun;
}

void PolicyEngine::post_backward(std::int64_t step, const sp_grad_moments_v1 *moments, std::uint32_t n) {
  require_phase("post_backward", step, {StepPhase::begun});
  if (n > 0 && moments == nullptr) throw InvalidArgument(fmt::format("post_backward: moments is null but n = {}", n));
  ++call_serial_;
  for (std::uint32_t i = 0; i < n; ++i) {
    const sp_grad_moments_v1 &m = moments[i];
    if (m.block_id >= n_blocks()) {
      throw InvalidArgument(fmt::format("post_backward: moments[{}] names block {}, but there are {} blocks", i,
                                        m.block_id, n_blocks()));
    }
    if (seen_in_call_[m.block_id] == call_serial_) {
      throw InvalidArgument(fmt::format("post_backward: moments[{}] repeats block {}", i, m.block_id));
    }
    seen_in_call_[m.block_id] = call_serial_;
    if (m.count == 0) {
      throw InvalidArgument(fmt::format("post_backward: block {} has count 0; a block without gradient elements "
                                        "must be left out of the list",
                                        m.block_id));
    }
    if (m.nonfinite > m.count) {
      throw InvalidArgument(fmt::format("post_backward: block {} reports {} non-finite elements out of {}",
                                        m.block_id, m.nonfinite, m.count));
    }
    if (moments_finite(m) && (m.sum_sq < 0.0 || m.max_abs < 0.0)) {
      throw InvalidArgument(fmt::format("post_backward: block {} has sum_sq {} and max_abs {}; both must be >= 0",
                                        m.block_id, m.sum_sq, m.max_abs));
    }
  }
  for (std::uint32_t i = 0; i < n; ++i) {
    const sp_grad_moments_v1 &m = moments[i];
    if (moments_finite(m)) {
      state_.windows.push(m.block_id, sample_from(m));
    } else if (config_.nonfinite_to_bf16) {
      state_.blocks[m.block_id].unsafe = true;
    }
  }
  state_.phase = StepPhase::backward_done;
}

void PolicyEngine::compute_hints(std::int64_t step, sp_hint_v1 *hints_out, std::uint32_t n) {
  require_phase("compute_hints", step, {StepPhase::begun, StepPhase::backward_done});
  if (n != n_blocks()) {
    throw InvalidArgument(fmt::format("compute_hints: n = {}, but the policy was created for {} blocks", n,
                                      n_blocks()));
  }
  if (hints_out == nullptr) throw InvalidArgument("compute_hints: hints_out is null");

  const bool decision_step = is_decision_step(step);
  switch (mode_) {
    case Mode::off:
      decide_off();
      break;
    case Mode::static_lists:
      decide_static();
      break;
    case Mode::dynamic:
      decide_dynamic(step, decision_step);
      break;
  }

  std::uint32_t changes = 0;
  for (std::uint32_t b = 0; b < n_blocks(); ++b) {
    BlockState &block = state_.blocks[b];
    const sp_hint_v1 &hint = hints_[b];
    if (hint.precision != block.previous_precision) {
      ++changes;
      if (config_.log_decisions) log_change(step, b, block.previous_precision, hint);
      block.previous_precision = hint.precision;
    }
    block.unsafe = false;
    hints_out[b] = hint;
  }
  state_.phase = StepPhase::hints_done;
  if (telemetry_ && (decision_step || changes > 0)) pending_record_ = StepRecord{step, decision_step, changes};
}

void PolicyEngine::decide_off() {
  for (sp_hint_v1 &hint : hints_) {
    hint.precision = SP_PRECISION_BF16;
    hint.reason = SP_REASON_MODE;
    hint.sensitivity = state_.blocks[hint.block_id].score.sensitivity;
  }
}

void PolicyEngine::decide_static() {
  for (sp_hint_v1 &hint : hints_) {
    const std::int8_t forced = forced_[hint.block_id];
    hint.precision = forced >= 0 ? forced : SP_PRECISION_BF16;
    hint.reason = forced >= 0 ? SP_REASON_FORCED : SP_REASON_MODE;
    hint.sensitivity = state_.blocks[hint.block_id].score.sensitivity;
  }
}

void PolicyEngine::score_blocks() {
  double avg_sum = 0.0;
  std::uint32_t blocks_with_samples = 0;
  for (std::uint32_t b = 0; b < n_blocks(); ++b) {
    const std::uint32_t samples = state_.windows.size(b);
    if (samples == 0) continue;
    // Oldest to newest, so that a window rebuilt from a state blob sums identically.
    double l2_sum = 0.0;
    for (std::uint32_t i = 0; i < samples; ++i) l2_sum += state_.windows.at(b, i).l2;
    step_scores_[b].avg_l2 = l2_sum / samples;
    avg_sum += step_scores_[b].avg_l2;
    ++blocks_with_samples;
  }
  const double mean_all = blocks_with_samples ? avg_sum / blocks_with_samples : 0.0;
  for (std::uint32_t b = 0; b < n_blocks(); ++b) {
    if (state_.windows.size(b) == 0) continue;
    ScoreParts &score = step_scores_[b];
    const std::optional<double> &calibration = state_.blocks[b].calibration_error;
    score.relative_magnitude = mean_all > 0.0 ? score.avg_l2 / mean_all : 0.0;
    score.grad_score = std::min(score.relative_magnitude / config_.grad_sensitivity_threshold, 1.0);
    score.error_score = calibration ? std::min(*calibration / config_.quant_error_threshold, 1.0) : 0.0;
    score.sensitivity =
        std::clamp(config_.grad_weight * score.grad_score + config_.error_weight * score.error_score, 0.0, 1.0);
  }
}

void PolicyEngine::decide_dynamic(std::int64_t step, bool decision_step) {
  if (decision_step) score_blocks();
  for (sp_hint_v1 &hint : hints_) {
    const std::uint32_t b = hint.block_id;
    BlockState &block = state_.blocks[b];
    const bool has_samples = state_.windows.size(b) > 0;
    if (forced_[b] >= 0) {
      // Forced blocks are still scored, for telemetry; the score never moves them.
      if (decision_step && has_samples) block.score = step_scores_[b];
      assign(block, assignment_for(forced_[b]), step);
      hint.reason = SP_REASON_FORCED;
    } else if (block.unsafe) {
      assign(block, Assignment::bf16, step);
      hint.reason = SP_REASON_UNSAFE;
    } else if (!decision_step) {
      hint.reason = SP_REASON_NOT_DECISION_STEP;
    } else if (!has_samples) {
      hint.reason = SP_REASON_NO_DATA;
    } else {
      block.score = step_scores_[b];
      hint.reason = apply_thresholds(block, block.score.sensitivity, step);
    }
    hint.precision = precision_of(block.assignment);
    hint.sensitivity = block.score.sensitivity;
  }
}

sp_reason PolicyEngine::apply_thresholds(BlockState &block, double sensitivity, std::int64_t step) const {
  switch (block.assignment) {
    case Assignment::unassigned: {
      const sp_precision target = sensitivity < config_.int8_threshold    ? SP_PRECISION_INT8
                                  : sensitivity >= config_.bf16_threshold ? SP_PRECISION_BF16
                                                                          : config_.ambiguous_default;
      assign(block, assignment_for(target), step);
      return SP_REASON_THRESHOLD;
    }
    case Assignment::bf16:
      if (sensitivity < config_.int8_threshold - config_.hysteresis_margin) {
        if (!cooldown_passed(block, step)) return SP_REASON_COOLDOWN;
        assign(block, Assignment::int8, step);
        return SP_REASON_THRESHOLD;
      }
      return sensitivity >= config_.bf16_threshold ? SP_REASON_THRESHOLD : SP_REASON_HYSTERESIS_HOLD;
    case Assignment::int8:
      if (sensitivity >= config_.bf16_threshold) {
        if (!cooldown_passed(block, step)) return SP_REASON_COOLDOWN;
        assign(block, Assignment::bf16, step);
        return SP_REASON_THRESHOLD;
      }
      return sensitivity < config_.int8_threshold ? SP_REASON_THRESHOLD : SP_REASON_HYSTERESIS_HOLD;
  }
  return SP_REASON_HYSTERESIS_HOLD;
}

bool PolicyEngine::cooldown_passed(const BlockState &block, std::int64_t step) const {
  return !block.last_switch_step || step - *block.last_switch_step >= config_.min_steps_between_switches;
}

// A switch is a change of the precision a block travels at; leaving the unassigned state
// for BF16 changes nothing on the wire and is not one.
void PolicyEngine::assign(BlockState &block, Assignment target, std::int64_t step) const {
  if (precision_of(target) != precision_of(block.assignment)) block.last_switch_step = step;
  block.assignment = target;
}

void PolicyEngine::log_change(std::int64_t step, std::uint32_t block, sp_precision from, const sp_hint_v1 &hint) {
  if (log_ == nullptr || !log_->wants(SP_LOG_INFO)) return;
  log_->write(SP_LOG_INFO, fmt::format("step {}: block {} {} -> {} (sensitivity {}, reason {})", step, block,
                                       precision_name(from), precision_name(hint.precision),
                                       std::isnan(hint.sensitivity) ? std::string("not scored")
                                                                    : fmt::format("{:.4f}", hint.sensitivity),
                                       reason_name(hint.reason)));
}

void PolicyEngine::end_step(std::int64_t step, const sp_step_feedback_v1 *feedback) {
  require_phase("end_step", step, {StepPhase::begun, StepPhase::backward_done, StepPhase::hints_done});
  if (feedback != nullptr && feedback->struct_size < SP_STEP_FEEDBACK_V1_0_SIZE) {
    throw InvalidArgument(fmt::format("end_step: feedback struct_size is {}, smaller than the {} bytes of ABI v1.0",
                                      feedback->struct_size, SP_STEP_FEEDBACK_V1_0_SIZE));
  }
  if (telemetry_ && feedback != nullptr && feedback->h2d_bytes_all_bf16 > 0) {
    MeasuredBytes &measured = state_.measured_since_record;
    ++measured.steps;
    measured.bf16 += feedback->h2d_bytes_bf16;
    measured.int8 += feedback->h2d_bytes_int8;
    measured.all_bf16 += feedback->h2d_bytes_all_bf16;
  }
  state_.phase = StepPhase::ended;
  write_pending_record();
}

void PolicyEngine::set_calibration_errors(const std::uint32_t *block_ids, const double *errors, std::uint32_t n) {
  if (n > 0 && (block_ids == nullptr || errors == nullptr)) {
    throw InvalidArgument(fmt::format("set_calibration_errors: block_ids or errors is null but n = {}", n));
  }
  ++call_serial_;
  for (std::uint32_t i = 0; i < n; ++i) {
    if (block_ids[i] >= n_blocks()) {
      throw InvalidArgument(fmt::format("set_calibration_errors: block_ids[{}] = {}, but there are {} blocks", i,
                                        block_ids[i], n_blocks()));
    }
    if (seen_in_call_[block_ids[i]] == call_serial_) {
      throw InvalidArgument(fmt::format("set_calibration_errors: block_ids[{}] repeats block {}", i, block_ids[i]));
    }
    seen_in_call_[block_ids[i]] = call_serial_;
    if (!(std::isfinite(errors[i]) && errors[i] >= 0.0)) {
      throw InvalidArgument(fmt::format("set_calibration_errors: block {} has error {}; expected a finite "
                                        "relative error >= 0",
                                        block_ids[i], errors[i]));
    }
  }
  for (std::uint32_t i = 0; i < n; ++i) state_.blocks[block_ids[i]].calibration_error = errors[i];
}

std::vector<std::uint8_t> PolicyEngine::export_state() const { return encode_state(state_); }

void PolicyEngine::import_state(const std::uint8_t *blob, std::size_t size) {
  PolicyState imported = decode_state(blob, size, n_blocks(), state_.windows.capacity());
  write_pending_record();
  state_ = std::move(imported);
  for (sp_hint_v1 &hint : hints_) {
    const BlockState &block = state_.blocks[hint.block_id];
    hint.precision = block.previous_precision;
    hint.sensitivity = block.score.sensitivity;
  }
}

void PolicyEngine::write_pending_record() noexcept {
  if (!pending_record_) return;
  const StepRecord record = *pending_record_;
  pending_record_.reset();
  if (!telemetry_ || !telemetry_->healthy()) return;
  try {
    const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    telemetry_->append(
        telemetry_record_line(record, mode_, state_, hints_, block_bytes_, state_.measured_since_record, now));
    state_.measured_since_record = MeasuredBytes{};
  } catch (const std::exception &error) {
    if (log_ != nullptr && log_->wants(SP_LOG_WARN)) {
      log_->write(SP_LOG_WARN, std::string("telemetry record dropped: ") + error.what());
    }
  }
}

}  // namespace sp::policy
