#include "sp/policy/engine.h"

#include "sp/policy/budget.h"
#include "sp/policy/errors.h"
#include "sp/policy/routes.h"
#include "sp/policy/state_codec.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <filesystem>

namespace sp::policy {
namespace {

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

PolicyEngine::PolicyEngine(PolicySettings config, std::vector<BlockBytes> block_bytes, LogSink *log,
                           const std::string &output_dir)
    : config_(std::move(config)),
      mode_(config_.effective_mode()),
      block_bytes_(std::move(block_bytes)),
      log_(log),
      forced_(block_bytes_.size(), -1),
      state_(static_cast<std::uint32_t>(block_bytes_.size()), static_cast<std::uint32_t>(config_.history_window)),
      hints_(block_bytes_.size()),
      seen_in_call_(block_bytes_.size(), 0) {
  for (sp_precision tier : kTiers) {
    for (std::uint32_t block : config_.force_blocks[tier]) forced_.at(block) = static_cast<std::int8_t>(tier);
  }
  state_.loss_window.losses.reserve(static_cast<std::size_t>(config_.loss_guard.window));
  for (std::uint32_t b = 0; b < hints_.size(); ++b) {
    hints_[b] = sp_hint_v1{b, SP_PRECISION_BF16, ScoreParts::kNever, SP_REASON_NO_DATA, 0};
  }
  if (config_.telemetry_enabled && mode_ != Mode::off) {
    telemetry_ = std::make_unique<TelemetryWriter>(resolve_telemetry_path(config_.telemetry_file, output_dir), log_);
  }
  rule_ = rule_module(mode_).create(*this);
}

PolicyEngine::~PolicyEngine() { write_pending_record(); }

bool PolicyEngine::is_decision_step(std::int64_t step) const {
  return step >= config_.warmup_steps && (step - config_.warmup_steps) % config_.update_interval_steps == 0;
}

void PolicyEngine::require_phase(const char *hook, std::int64_t step, std::initializer_list<StepPhase> allowed) const {
  if (step != state_.current_step) {
    throw OrderError(fmt::format("{}({}) called while step {} is current; call begin_step({}) first", hook, step,
                                 state_.current_step, step));
  }
  if (std::find(allowed.begin(), allowed.end(), state_.phase) == allowed.end()) {
    throw OrderError(
        fmt::format("{}({}) called {} of step {}; the order is begin_step, post_backward, "
                    "compute_hints, end_step, each at most once",
                    hook, step, phase_name(state_.phase), step));
  }
}

void PolicyEngine::begin_step(std::int64_t step) {
  if (step < 0) throw InvalidArgument(fmt::format("begin_step({}): steps start at 0", step));
  if (state_.current_step >= 0 && step <= state_.current_step) {
    throw OrderError(fmt::format("begin_step({}) after step {}: steps must increase", step, state_.current_step));
  }
  proposal_.clear();  // a step may move the allocation the proposal was of
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
      throw InvalidArgument(
          fmt::format("post_backward: moments[{}] names block {}, but there are {} blocks", i, m.block_id, n_blocks()));
    }
    if (seen_in_call_[m.block_id] == call_serial_) {
      throw InvalidArgument(fmt::format("post_backward: moments[{}] repeats block {}", i, m.block_id));
    }
    seen_in_call_[m.block_id] = call_serial_;
    if (m.count == 0) {
      throw InvalidArgument(
          fmt::format("post_backward: block {} has count 0; a block without gradient elements "
                      "must be left out of the list",
                      m.block_id));
    }
    if (m.nonfinite > m.count) {
      throw InvalidArgument(fmt::format("post_backward: block {} reports {} non-finite elements out of {}", m.block_id,
                                        m.nonfinite, m.count));
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
      rule_->take_moments(step, m);
    } else if (config_.nonfinite_to_bf16) {
      state_.blocks[m.block_id].unsafe = true;
    }
  }
  state_.phase = StepPhase::backward_done;
}

void PolicyEngine::initial_hints(sp_hint_v1 *hints_out, std::uint32_t n) {
  if (state_.phase != StepPhase::before_first_step) {
    throw OrderError(fmt::format("initial_hints called {} of step {}: it gives the hints before the first step; "
                                 "compute_hints decides from then on",
                                 phase_name(state_.phase), state_.current_step));
  }
  if (n != n_blocks()) {
    throw InvalidArgument(
        fmt::format("initial_hints: n = {}, but the policy was created for {} blocks", n, n_blocks()));
  }
  if (hints_out == nullptr) throw InvalidArgument("initial_hints: hints_out is null");
  if (rule_->decides_initial_hints()) {
    rule_->decide(-1, false);
  } else {
    // What needs no measurement: a forced route (mode off forces nothing); the rest starts BF16.
    for (std::uint32_t b = 0; b < n_blocks(); ++b) {
      sp_hint_v1 &hint = hints_[b];
      const bool forced = mode_ != Mode::off && forced_[b] >= 0;
      hint.precision = forced ? forced_[b] : SP_PRECISION_BF16;
      hint.reason = forced ? SP_REASON_FORCED : SP_REASON_NO_DATA;
    }
  }
  for (std::uint32_t b = 0; b < n_blocks(); ++b) {
    state_.blocks[b].previous_precision = hints_[b].precision;
    hints_out[b] = hints_[b];
  }
}

void PolicyEngine::compute_hints(std::int64_t step, sp_hint_v1 *hints_out, std::uint32_t n) {
  require_phase("compute_hints", step, {StepPhase::begun, StepPhase::backward_done});
  if (n != n_blocks()) {
    throw InvalidArgument(
        fmt::format("compute_hints: n = {}, but the policy was created for {} blocks", n, n_blocks()));
  }
  if (hints_out == nullptr) throw InvalidArgument("compute_hints: hints_out is null");

  const bool decision_step = rule_->decide(step, is_decision_step(step));
  std::optional<BudgetRecord> budget;
  if (takes_budget(mode_)) budget = budget_record();

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
  if (telemetry_ && (decision_step || changes > 0))
    pending_record_ = StepRecord{step, decision_step, changes, std::nullopt, budget};
}

std::optional<sp_reason> PolicyEngine::apply_standing_rules(BlockState &block, std::uint32_t b, std::int64_t step) {
  if (forced_[b] >= 0) {
    assign(block, assignment_for(forced_[b]), step);
    block.pending_revert.reset();
    return SP_REASON_FORCED;
  }
  if (block.unsafe) {
    // A pending revert is dropped, but its penalty starts as if it had happened.
    if (block.pending_revert && guard_active()) {
      block.pending_revert.reset();
      block.penalty_until = step + config_.loss_guard.penalty_steps;
    }
    assign(block, Assignment::bf16, step);
    return SP_REASON_UNSAFE;
  }
  if (block.pending_revert && guard_active()) {
    const sp_precision target = nearest_tier_up(*block.pending_revert);
    block.pending_revert.reset();
    assign(block, assignment_for(target), step);
    block.last_switch_step = step;
    block.last_down_move.reset();
    block.penalty_until = step + config_.loss_guard.penalty_steps;
    return SP_REASON_LOSS_GUARD;
  }
  if (block.assignment != Assignment::unassigned && !config_.tier(travels_as(block.assignment))) {
    // Imported from a state whose precision this config does not allow.
    assign(block, assignment_for(nearest_tier_up(travels_as(block.assignment))), step);
    return SP_REASON_MODE;
  }
  return std::nullopt;
}

sp_precision PolicyEngine::nearest_tier_up(sp_precision precision) const {
  // Up the routes toward BF16, which is always a tier.
  for (auto route = static_cast<std::size_t>(from_abi(precision).value_or(Precision::bf16)); route > 0; --route) {
    if (config_.tier(to_abi(kPrecisions[route]))) return to_abi(kPrecisions[route]);
  }
  return SP_PRECISION_BF16;
}

// The loss guard acts only when it is enabled and the mode decides by data (docs/policy.md,
// "Loss guard"): otherwise no loss is judged and no revert or penalty has any effect.
// import_state drops reverts and penalties an inactive guard could not have made, so these
// checks only keep the rule local.
bool PolicyEngine::guard_active() const {
  return config_.loss_guard.enabled && (mode_ == Mode::dynamic || takes_budget(mode_));
}

bool PolicyEngine::under_penalty(const BlockState &block, std::int64_t step) const {
  return guard_active() && block.penalty_until && step < *block.penalty_until;
}

sp_reason PolicyEngine::move_if_allowed(BlockState &block, Assignment target, std::int64_t step) const {
  const sp_precision from = travels_as(block.assignment);
  const sp_precision to = travels_as(target);
  if (to != from) {
    if (!cooldown_passed(block, step)) return SP_REASON_COOLDOWN;
    if (cost_rank(to) < cost_rank(from) && under_penalty(block, step)) return SP_REASON_PENALTY;
  }
  assign(block, target, step);
  return SP_REASON_THRESHOLD;
}

bool PolicyEngine::cooldown_passed(const BlockState &block, std::int64_t step) const {
  return !block.last_switch_step || step - *block.last_switch_step >= config_.min_steps_between_switches;
}

// A switch is a change of the precision a block travels at; leaving the unassigned state
// for BF16 changes nothing on the wire and is not one. A switch to a cheaper precision is
// the block's last downward move (what the loss guard blames); a switch up clears it.
void PolicyEngine::assign(BlockState &block, Assignment target, std::int64_t step) const {
  const sp_precision from = travels_as(block.assignment);
  const sp_precision to = travels_as(target);
  if (to != from) {
    block.last_switch_step = step;
    if (cost_rank(to) < cost_rank(from)) {
      block.last_down_move = DownMove{step, from};
    } else {
      block.last_down_move.reset();
    }
  }
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
#if SP_PLUGIN_ABI_TARGET_MINOR >= 1
    if (feedback->struct_size >= offsetof(sp_step_feedback_v1, h2d_bytes_nf4) + sizeof(feedback->h2d_bytes_nf4)) {
      measured.nf4 += feedback->h2d_bytes_nf4;
    }
#endif
  }
  last_spike_.reset();
  if (guard_active() && feedback != nullptr && std::isfinite(feedback->loss)) {
    judge_loss(step, feedback->loss);
  }
  if (feedback != nullptr && std::isfinite(feedback->loss)) rule_->take_loss(feedback->loss);
  state_.phase = StepPhase::ended;
  if (last_spike_ && telemetry_) {
    if (!pending_record_) {
      pending_record_ = StepRecord{step, is_decision_step(step), 0, std::nullopt,
                                   takes_budget(mode_) ? std::optional(budget_record()) : std::nullopt};
    }
    pending_record_->spike = last_spike_;
  }
  write_pending_record();
}

// The loss guard (docs/policy.md): a full window judges each new finite loss.
void PolicyEngine::judge_loss(std::int64_t step, double loss) {
  std::vector<double> &window = state_.loss_window.losses;
  const auto capacity = static_cast<std::size_t>(config_.loss_guard.window);
  if (window.size() < capacity) {
    window.push_back(loss);
    return;
  }
  double sum = 0.0;
  for (double value : window) sum += value;
  const double mu = sum / static_cast<double>(window.size());
  double squares = 0.0;
  for (double value : window) squares += (value - mu) * (value - mu);
  const double sd = std::sqrt(squares / static_cast<double>(window.size()));
  const bool spike = loss > mu + config_.loss_guard.sigmas * sd && loss > mu * (1.0 + config_.loss_guard.min_rise);
  if (!spike) {
    // A window that outgrew this config's (imported) drops its oldest losses too.
    window.erase(window.begin(), window.begin() + static_cast<std::ptrdiff_t>(window.size() - capacity + 1));
    window.push_back(loss);
    return;
  }
  SpikeRecord record{loss, mu, sd, {}};
  for (std::uint32_t b = 0; b < n_blocks(); ++b) {
    BlockState &block = state_.blocks[b];
    if (forced_[b] >= 0 || !block.last_down_move) continue;
    if (step - block.last_down_move->step > config_.loss_guard.blame_steps) continue;
    block.pending_revert = block.last_down_move->from;
    record.blamed.push_back(b);
  }
  if (log_ != nullptr && log_->wants(SP_LOG_WARN)) {
    log_->write(SP_LOG_WARN, fmt::format("step {}: loss spike {} (window mean {}, sd {}); {} block(s) blamed", step,
                                         loss, mu, sd, record.blamed.size()));
  }
  last_spike_ = std::move(record);
}

void PolicyEngine::set_calibration_errors(const std::uint32_t *block_ids, const double *errors, std::uint32_t n) {
  set_precision_calibration_errors(SP_PRECISION_INT8, block_ids, errors, n);
}

void PolicyEngine::set_transfer_bytes(sp_precision precision, const std::uint64_t *bytes, std::uint32_t n) {
  if (n != n_blocks()) {
    throw InvalidArgument(
        fmt::format("set_transfer_bytes: n = {}, but the policy was created for {} blocks", n, n_blocks()));
  }
  if (bytes == nullptr) throw InvalidArgument("set_transfer_bytes: bytes is null");
  const std::optional<Precision> route = from_abi(precision);
  if (!route) {
    throw InvalidArgument(
        fmt::format("set_transfer_bytes: precision {} is unknown to this plugin ({})", precision, route_codes_text()));
  }
  if (takes_budget(mode_) && route_traits(*route).abi_minor == 0) {
    // A bytes budget is a fraction of these sizes; a later route's 0 means "not described"
    // (its nominal image, tier_bytes).
    for (std::uint32_t b = 0; b < n; ++b) {
      if (bytes[b] == 0) {
        throw InvalidArgument(fmt::format("set_transfer_bytes: block {} has 0 bytes at {}; mode budget needs the size "
                                          "of every block",
                                          b, precision_name(precision)));
      }
    }
  }
  for (std::uint32_t b = 0; b < n; ++b) block_bytes_[b][precision] = bytes[b];
  rule_->replan();
}

void PolicyEngine::set_precision_calibration_errors(sp_precision precision, const std::uint32_t *block_ids,
                                                    const double *errors, std::uint32_t n) {
  const std::optional<Precision> route = from_abi(precision);
  if (!route || !is_quantized(*route)) {
    throw InvalidArgument(
        fmt::format("set_precision_calibration_errors: precision {} has no calibration error; "
                    "expected {}",
                    precision, route_codes_text(true)));
  }
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
      throw InvalidArgument(
          fmt::format("set_calibration_errors: block {} has error {}; expected a finite "
                      "relative error >= 0",
                      block_ids[i], errors[i]));
    }
  }
  for (std::uint32_t i = 0; i < n; ++i) {
    BlockState &block = state_.blocks[block_ids[i]];
    (precision == SP_PRECISION_NF4 ? block.nf4_calibration_error : block.calibration_error) = errors[i];
  }
}

std::vector<std::uint8_t> PolicyEngine::export_state() const {
  const std::uint32_t tag = rule_->state_tag();
  if (tag == 0) return encode_state(state_);
  PolicyState state = state_;
  auto own = std::find_if(state.rule_sections.begin(), state.rule_sections.end(),
                          [&](const RuleSection &section) { return section.tag == tag; });
  std::vector<std::uint8_t> payload = rule_->export_section();
  if (payload.empty()) {
    if (own != state.rule_sections.end()) state.rule_sections.erase(own);
  } else if (own != state.rule_sections.end()) {
    own->payload = std::move(payload);
  } else {
    state.rule_sections.push_back(RuleSection{tag, std::move(payload)});
  }
  return encode_state(state);
}

void PolicyEngine::import_state(const std::uint8_t *blob, std::size_t size) {
  PolicyState imported = decode_state(blob, size, n_blocks(), state_.windows.capacity(),
                                      static_cast<std::uint32_t>(config_.loss_guard.window));
  // What this config could never have produced is dropped: with the guard inactive
  // (disabled, or a mode other than dynamic) every pending revert and penalty, and a block
  // this config forces never reverts. The loss window and the down-move records stay; they
  // only matter once a later config enables the guard.
  for (std::uint32_t b = 0; b < n_blocks(); ++b) {
    BlockState &block = imported.blocks[b];
    if (!guard_active()) {
      block.pending_revert.reset();
      block.penalty_until.reset();
    } else if (forced_[b] >= 0) {
      block.pending_revert.reset();
    }
  }
  // The rule takes its own section last: it validates before it changes anything, so a refusal
  // leaves the engine as it was. A blob without one (another mode's) starts the rule afresh.
  if (const std::uint32_t tag = rule_->state_tag(); tag != 0) {
    const auto own = std::find_if(imported.rule_sections.begin(), imported.rule_sections.end(),
                                  [&](const RuleSection &section) { return section.tag == tag; });
    rule_->import_section(own != imported.rule_sections.end() ? &own->payload : nullptr);
  }
  write_pending_record();
  state_ = std::move(imported);
  proposal_.clear();
  // The exporter's allocation was made for its sizes and its config: a budgeted rule
  // re-allocates at the next compute_hints (margins and cooldowns keep what still fits).
  rule_->replan();
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
    telemetry_->append(telemetry_record_line(record, mode_, *rule_, state_, hints_, block_bytes_, state_.measured_since_record,
                                             config_.nf4_group_size, now));
    state_.measured_since_record = MeasuredBytes{};
  } catch (const std::exception &error) {
    if (log_ != nullptr && log_->wants(SP_LOG_WARN)) {
      log_->write(SP_LOG_WARN, std::string("telemetry record dropped: ") + error.what());
    }
  }
}

}  // namespace sp::policy
