#include "sp/policy/state_codec.h"

#include "sp/policy/config.h"
#include "sp/policy/errors.h"
#include "byte_codec.h"
#include "sp/policy/routes.h"

#include <boost/crc.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace sp::policy {
namespace {

constexpr char kMagic[8] = {'S', 'P', 'P', 'O', 'L', 'S', 'T', '\0'};
constexpr std::size_t kHeaderSize = 8 + 4 + 4 + 8;
constexpr std::size_t kTrailerSize = 4;

constexpr std::uint32_t four_cc(char a, char b, char c, char d) {
  return static_cast<std::uint32_t>(static_cast<unsigned char>(a)) |
         static_cast<std::uint32_t>(static_cast<unsigned char>(b)) << 8 |
         static_cast<std::uint32_t>(static_cast<unsigned char>(c)) << 16 |
         static_cast<std::uint32_t>(static_cast<unsigned char>(d)) << 24;
}
// Instance-wide fields: block count, window capacity, step, lifecycle phase, measured bytes.
constexpr std::uint32_t kPolicySection = four_cc('P', 'L', 'C', 'Y');
// One record per block, in block-id order: decision state, score and window samples.
constexpr std::uint32_t kBlocksSection = four_cc('B', 'L', 'K', 'S');
// Format 2 (policy v2) appends two sections after those of format 1, which keep their layout:
// instance-wide v2 fields (measured NF4 bytes, the loss window) and one v2 record per block.
constexpr std::uint32_t kGuardSection = four_cc('L', 'O', 'S', 'S');
constexpr std::uint32_t kBlocksV2Section = four_cc('B', 'L', 'K', '2');
// Format 3 (policy v3) appends one section: the budget's instance fields, then one record of
// signals per unit.
constexpr std::uint32_t kBudgetSection = four_cc('B', 'D', 'G', 'T');
// Format 4 (policy v4) appends the sections of the decision rules that keep state of their own,
// each under its rule's tag (decision_rule.h), at least one.
constexpr std::uint32_t section_count_of(std::uint32_t version) { return version >= 3 ? 5 : version >= 2 ? 4 : 2; }
constexpr bool is_shared_tag(std::uint32_t tag) {
  return tag == kPolicySection || tag == kBlocksSection || tag == kGuardSection || tag == kBlocksV2Section ||
         tag == kBudgetSection;
}
// The first format this edition cannot write: the 1.0.0 edition writes and reads format 1 only.
constexpr std::uint32_t kOldestReadable = 1;
constexpr std::size_t kBlockV2Size = 4 * 1 + 8 + 8 + 1 + 1 + 8 + 2 * 8;
constexpr std::size_t kBudgetFixedSize = 8 + 8 + 1 + 8 + 1 + 8 + 8 + 1 + 8 + 8 + 8 + 1 + 8;
constexpr std::size_t kUnitSignalsSize = 3 * kTiers.size() * 8;  // cost, first and second order per tier

constexpr std::size_t kPolicyPayloadSize = 4 + 4 + 8 + 1 + 4 * 8;
constexpr std::size_t kBlockFixedSize = 5 * 1 + 8 + 8 + 5 * 8 + 4;
constexpr std::size_t kSampleSize = 3 * 8;

std::uint32_t crc32(const std::uint8_t *data, std::size_t size) {
  boost::crc_32_type crc;
  crc.process_bytes(data, size);
  return crc.checksum();
}

[[noreturn]] void reject_block(std::uint32_t block, const std::string &what) {
  throw StateError(fmt::format("state blob: block {}: {}", block, what));
}

double non_negative_finite(Reader &reader, std::uint32_t block, const char *what) {
  const double value = reader.f64(what);
  if (!(std::isfinite(value) && value >= 0.0)) {
    reject_block(block, fmt::format("{} must be a finite number >= 0, found {}", what, value));
  }
  return value;
}

void write_policy_section(Writer &out, const PolicyState &state) {
  out.u32(kPolicySection);
  out.u64(kPolicyPayloadSize);
  out.u32(state.windows.n_blocks());
  out.u32(state.windows.capacity());
  out.i64(state.current_step);
  out.u8(static_cast<std::uint8_t>(state.phase));
  out.u64(state.measured_since_record.steps);
  out.u64(state.measured_since_record.bf16);
  out.u64(state.measured_since_record.int8);
  out.u64(state.measured_since_record.all_bf16);
}

void write_blocks_section(Writer &out, const PolicyState &state) {
  out.u32(kBlocksSection);
  const std::size_t size_offset = out.size();
  out.u64(0);
  const std::size_t payload_begin = out.size();
  for (std::uint32_t b = 0; b < state.blocks.size(); ++b) {
    const BlockState &block = state.blocks[b];
    out.u8(static_cast<std::uint8_t>(block.assignment));
    out.u8(block.unsafe ? 1 : 0);
    out.u8(block.last_switch_step ? 1 : 0);
    out.u8(block.calibration_error ? 1 : 0);
    out.u8(static_cast<std::uint8_t>(block.previous_precision));
    out.i64(block.last_switch_step.value_or(0));
    out.f64(block.calibration_error.value_or(0.0));
    out.f64(block.score.avg_l2);
    out.f64(block.score.relative_magnitude);
    out.f64(block.score.grad_score);
    out.f64(block.score.error_score);
    out.f64(block.score.sensitivity);
    const std::uint32_t samples = state.windows.size(b);
    out.u32(samples);
    for (std::uint32_t i = 0; i < samples; ++i) {
      const GradSample &sample = state.windows.at(b, i);
      out.f64(sample.l2);
      out.f64(sample.variance);
      out.f64(sample.max_abs);
    }
  }
  out.patch_u64(size_offset, out.size() - payload_begin);
}

void write_guard_section(Writer &out, const PolicyState &state) {
  out.u32(kGuardSection);
  const std::vector<double> &losses = state.loss_window.losses;
  out.u64(8 + 4 + 8 * losses.size());
  out.u64(state.measured_since_record.nf4);
  out.u32(static_cast<std::uint32_t>(losses.size()));
  for (double loss : losses) out.f64(loss);
}

void write_blocks_v2_section(Writer &out, const PolicyState &state) {
  out.u32(kBlocksV2Section);
  out.u64(kBlockV2Size * state.blocks.size());
  for (const BlockState &block : state.blocks) {
    out.u8(block.nf4_calibration_error ? 1 : 0);
    out.u8(block.last_down_move ? 1 : 0);
    out.u8(block.pending_revert ? 1 : 0);
    out.u8(block.penalty_until ? 1 : 0);
    out.f64(block.nf4_calibration_error.value_or(0.0));
    out.i64(block.last_down_move ? block.last_down_move->step : 0);
    out.u8(static_cast<std::uint8_t>(block.last_down_move ? block.last_down_move->from : 0));
    out.u8(static_cast<std::uint8_t>(block.pending_revert.value_or(0)));
    out.i64(block.penalty_until.value_or(0));
    out.f64(block.score.nf4_error_score);
    out.f64(block.score.nf4_sensitivity);
  }
}

void write_tier_values(Writer &out, const TierValues &values) {
  for (double value : values) out.f64(value);
}

void write_budget_section(Writer &out, const PolicyState &state) {
  const BudgetState &budget = state.budget;
  out.u32(kBudgetSection);
  out.u64(kBudgetFixedSize + kUnitSignalsSize * budget.units.size());
  out.u64(budget.tables_received);
  out.u64(budget.last_table_samples);
  out.u8(budget.last_signal_step ? 1 : 0);
  out.i64(budget.last_signal_step.value_or(0));
  out.u8(budget.signals_pending ? 1 : 0);
  out.f64(budget.table_loss);
  out.f64(budget.feedback_loss);
  out.u8(static_cast<std::uint8_t>(budget.source));
  out.i64(budget.decided_at_step);
  out.u64(budget.planned_bytes);
  out.f64(budget.planned_cost);
  out.u8(budget.met ? 1 : 0);
  out.u64(budget.bucket_bytes);
  for (const UnitSignals &unit : budget.units) {
    write_tier_values(out, unit.cost);
    write_tier_values(out, unit.first_order);
    write_tier_values(out, unit.second_order);
  }
}

struct PolicyFields {
  std::uint32_t version = 1;
  std::uint32_t blob_window_capacity = 0;
};

PolicyFields read_policy_section(Reader &reader, std::uint32_t n_blocks, PolicyState &state) {
  const std::uint32_t blob_blocks = reader.u32("n_blocks");
  if (blob_blocks != n_blocks) {
    throw StateError(fmt::format("state blob is for {} blocks, but this policy has {}", blob_blocks, n_blocks));
  }
  PolicyFields fields;
  fields.blob_window_capacity = reader.u32("window capacity");
  if (fields.blob_window_capacity < 1 || fields.blob_window_capacity > kMaxHistoryWindow) {
    throw StateError(fmt::format("state blob: window capacity must be in [1, {}], found {}", kMaxHistoryWindow,
                                 fields.blob_window_capacity));
  }
  state.current_step = reader.i64("current step");
  const std::uint8_t phase = reader.u8("step phase");
  if (phase > static_cast<std::uint8_t>(StepPhase::ended)) {
    throw StateError(fmt::format("state blob: step phase must be in [0, 4], found {}", phase));
  }
  state.phase = static_cast<StepPhase>(phase);
  const bool started = state.phase != StepPhase::before_first_step;
  if (started ? state.current_step < 0 : state.current_step != -1) {
    throw StateError(fmt::format("state blob: current step {} does not fit step phase {}", state.current_step, phase));
  }
  state.measured_since_record.steps = reader.u64("measured steps");
  state.measured_since_record.bf16 = reader.u64("measured bf16 bytes");
  state.measured_since_record.int8 = reader.u64("measured int8 bytes");
  state.measured_since_record.all_bf16 = reader.u64("measured all-bf16 bytes");
  return fields;
}

void read_score(Reader &reader, std::uint32_t b, ScoreParts &score) {
  score.avg_l2 = reader.f64("avg_l2");
  score.relative_magnitude = reader.f64("relative magnitude");
  score.grad_score = reader.f64("grad_score");
  score.error_score = reader.f64("error_score");
  score.sensitivity = reader.f64("sensitivity");
  const double parts[] = {score.avg_l2, score.relative_magnitude, score.grad_score, score.error_score,
                          score.sensitivity};
  const bool never_scored = std::isnan(score.sensitivity);
  for (double part : parts) {
    if (never_scored ? !std::isnan(part) : !(std::isfinite(part) && part >= 0.0)) {
      reject_block(b, "score parts must all be NaN (never scored) or all finite and >= 0");
    }
  }
  if (!never_scored && (score.grad_score > 1.0 || score.error_score > 1.0 || score.sensitivity > 1.0)) {
    reject_block(b, "grad_score, error_score and sensitivity must lie in [0, 1]");
  }
}

// Whether a blob of format `version` may name `route`: format 1 (edition 1) knew ABI 1.0's.
bool format_names(std::uint32_t version, Precision route) { return version >= 2 || route_traits(route).abi_minor == 0; }

int assignment_code(Precision route) { return 1 + static_cast<int>(route); }
int abi_code(Precision route) { return to_abi(route); }

// "0 (unassigned), 1 (bf16), 2 (int8) or 3 (nf4)": the codes a blob of format `version` may
// hold, each `code(route)`, after `first` when given.
std::string codes_text(std::uint32_t version, int (*code)(Precision), const char *first = nullptr) {
  std::vector<std::string> words;
  if (first != nullptr) words.emplace_back(first);
  for (Precision route : kPrecisions) {
    if (format_names(version, route)) words.push_back(fmt::format("{} ({})", code(route), sp::precision_name(route)));
  }
  std::string text;
  for (std::size_t i = 0; i < words.size(); ++i) {
    text += (i == 0 ? "" : i + 1 == words.size() ? " or " : ", ") + words[i];
  }
  return text;
}

void read_blocks_section(Reader &reader, std::size_t payload_end, const PolicyFields &fields, PolicyState &state) {
  for (std::uint32_t b = 0; b < state.blocks.size(); ++b) {
    BlockState &block = state.blocks[b];
    reader.need(kBlockFixedSize, "a block record");
    const std::uint8_t assignment = reader.u8("assignment");
    if (assignment != 0 &&
        (assignment > kPrecisionCount || !format_names(fields.version, kPrecisions[assignment - 1]))) {
      reject_block(b, fmt::format("assignment code must be {}, found {}",
                                  codes_text(fields.version, assignment_code, "0 (unassigned)"), assignment));
    }
    block.assignment = static_cast<Assignment>(assignment);
    block.unsafe = reader.flag("unsafe flag");
    const bool has_switched = reader.flag("has-switched flag");
    const bool has_calibration = reader.flag("has-calibration flag");
    const std::uint8_t previous = reader.u8("previous precision");
    const std::optional<Precision> previous_route = from_abi(previous);
    if (!previous_route || !format_names(fields.version, *previous_route)) {
      reject_block(
          b, fmt::format("previous precision must be {}, found {}", codes_text(fields.version, abi_code), previous));
    }
    block.previous_precision = previous;
    const std::int64_t last_switch = reader.i64("last switch step");
    if (has_switched) {
      if (block.assignment == Assignment::unassigned) reject_block(b, "an unassigned block cannot have switched");
      if (last_switch < 0 || last_switch > state.current_step) {
        reject_block(b, fmt::format("last switch step must be in [0, {}], found {}", state.current_step, last_switch));
      }
      block.last_switch_step = last_switch;
    }
    const double calibration = non_negative_finite(reader, b, "calibration error");
    if (has_calibration) block.calibration_error = calibration;
    read_score(reader, b, block.score);
    const std::uint32_t samples = reader.u32("window size");
    if (samples > fields.blob_window_capacity) {
      reject_block(
          b, fmt::format("window holds {} samples, more than its capacity {}", samples, fields.blob_window_capacity));
    }
    if (static_cast<std::uint64_t>(samples) * kSampleSize > payload_end - reader.offset()) {
      reject_block(b, fmt::format("window of {} samples runs past the end of the blocks section", samples));
    }
    const std::uint32_t dropped = samples > state.windows.capacity() ? samples - state.windows.capacity() : 0;
    for (std::uint32_t i = 0; i < samples; ++i) {
      GradSample sample;
      sample.l2 = non_negative_finite(reader, b, "sample l2");
      sample.variance = non_negative_finite(reader, b, "sample variance");
      sample.max_abs = non_negative_finite(reader, b, "sample max_abs");
      if (i >= dropped) state.windows.push(b, sample);
    }
  }
  if (reader.offset() != payload_end) {
    throw StateError(
        fmt::format("state blob: the blocks section has {} bytes after the last block", payload_end - reader.offset()));
  }
}

void read_guard_section(Reader &reader, std::size_t payload_end, PolicyState &state,
                        std::uint32_t loss_window_capacity) {
  state.measured_since_record.nf4 = reader.u64("measured nf4 bytes");
  const std::uint32_t count = reader.u32("loss window size");
  if (count > kMaxHistoryWindow) {
    throw StateError(
        fmt::format("state blob: the loss window holds {} losses, more than {}", count, kMaxHistoryWindow));
  }
  if (static_cast<std::uint64_t>(count) * 8 != payload_end - reader.offset()) {
    throw StateError(fmt::format("state blob: the loss section holds {} bytes of losses, {} losses need {}",
                                 payload_end - reader.offset(), count, static_cast<std::uint64_t>(count) * 8));
  }
  const std::uint32_t dropped = count > loss_window_capacity ? count - loss_window_capacity : 0;
  std::vector<double> &losses = state.loss_window.losses;
  losses.clear();
  for (std::uint32_t i = 0; i < count; ++i) {
    const double loss = reader.f64("loss");
    if (!std::isfinite(loss)) throw StateError(fmt::format("state blob: loss {} of the window is {}", i, loss));
    if (i >= dropped) losses.push_back(loss);
  }
}

sp_precision read_precision(Reader &reader, std::uint32_t b, const char *what) {
  const std::uint8_t value = reader.u8(what);
  if (!from_abi(value)) reject_block(b, fmt::format("{} must be {}, found {}", what, codes_text(2, abi_code), value));
  return static_cast<sp_precision>(value);
}


void read_blocks_v2_section(Reader &reader, std::size_t payload_size, PolicyState &state) {
  if (payload_size != kBlockV2Size * state.blocks.size()) {
    throw StateError(fmt::format("state blob: the v2 blocks section is {} bytes, expected {} for {} blocks",
                                 payload_size, kBlockV2Size * state.blocks.size(), state.blocks.size()));
  }
  for (std::uint32_t b = 0; b < state.blocks.size(); ++b) {
    BlockState &block = state.blocks[b];
    const bool has_nf4_calibration = reader.flag("has-nf4-calibration flag");
    const bool has_down_move = reader.flag("has-down-move flag");
    const bool has_pending = reader.flag("has-pending-revert flag");
    const bool has_penalty = reader.flag("has-penalty flag");
    const double nf4_calibration = non_negative_finite(reader, b, "nf4 calibration error");
    if (has_nf4_calibration) block.nf4_calibration_error = nf4_calibration;
    const std::int64_t down_step = reader.i64("down move step");
    const sp_precision down_from = read_precision(reader, b, "precision before the down move");
    const sp_precision pending = read_precision(reader, b, "pending revert precision");
    const std::int64_t penalty_until = reader.i64("penalty end step");
    const sp_precision current = travels_as(block.assignment);
    if (has_down_move) {
      if (block.assignment == Assignment::unassigned) reject_block(b, "an unassigned block cannot have moved down");
      if (down_step < 0 || down_step > state.current_step) {
        reject_block(b, fmt::format("down move step must be in [0, {}], found {}", state.current_step, down_step));
      }
      // A move down left a more precise precision than the one the block holds now (a
      // later move up would have cleared the record).
      if (cost_rank(down_from) <= cost_rank(current)) {
        reject_block(b, fmt::format("the precision before the down move ({}) must be more precise than the "
                                    "block's assignment ({})",
                                    precision_name(down_from), precision_name(current)));
      }
      block.last_down_move = DownMove{down_step, down_from};
    }
    if (has_pending) {
      // A revert goes up, to the precision before the down move it undoes: anything else
      // would be a move down that skips the cooldown and the penalty.
      if (cost_rank(pending) <= cost_rank(current)) {
        reject_block(b, fmt::format("the pending revert precision ({}) must be more precise than the block's "
                                    "assignment ({})",
                                    precision_name(pending), precision_name(current)));
      }
      if (!has_down_move || down_from != pending) {
        reject_block(b, fmt::format("a pending revert to {} needs a recorded down move from {}",
                                    precision_name(pending), precision_name(pending)));
      }
      block.pending_revert = pending;
    }
    if (has_penalty) {
      if (penalty_until < 0) reject_block(b, fmt::format("penalty end step must be >= 0, found {}", penalty_until));
      block.penalty_until = penalty_until;
    }
    block.score.nf4_error_score = reader.f64("nf4 error score");
    block.score.nf4_sensitivity = reader.f64("nf4 sensitivity");
    for (double part : {block.score.nf4_error_score, block.score.nf4_sensitivity}) {
      const bool never = std::isnan(block.score.nf4_sensitivity);
      if (never ? !std::isnan(part) : !(part >= 0.0 && part <= 1.0)) {
        reject_block(b, "nf4 score parts must both be NaN (never scored) or both lie in [0, 1]");
      }
    }
  }
}

// A value the host measured or the policy derived from it: finite, or NaN for none.
double finite_or_nan(Reader &reader, const char *what) {
  const double value = reader.f64(what);
  if (std::isinf(value)) throw StateError(fmt::format("state blob: {} must be finite or NaN, found {}", what, value));
  return value;
}

void read_tier_values(Reader &reader, const char *what, TierValues &values) {
  for (double &value : values) value = finite_or_nan(reader, what);
}

void read_budget_section(Reader &reader, std::size_t payload_size, std::uint32_t version, PolicyState &state) {
  BudgetState &budget = state.budget;
  if (payload_size != kBudgetFixedSize + kUnitSignalsSize * budget.units.size()) {
    throw StateError(fmt::format("state blob: the budget section is {} bytes, expected {} for {} units", payload_size,
                                 kBudgetFixedSize + kUnitSignalsSize * budget.units.size(), budget.units.size()));
  }
  budget.tables_received = reader.u64("signal tables received");
  budget.last_table_samples = reader.u64("samples of the last signal table");
  const bool has_signal_step = reader.flag("has-signal-step flag");
  const std::int64_t signal_step = reader.i64("last signal step");
  if (has_signal_step != (budget.tables_received > 0)) {
    throw StateError("state blob: a last signal step must be recorded exactly when signal tables were received");
  }
  if (has_signal_step) {
    if (signal_step < -1 || signal_step > state.current_step) {
      throw StateError(
          fmt::format("state blob: the last signal step must be in [-1, {}], found {}", state.current_step, signal_step));
    }
    budget.last_signal_step = signal_step;
  }
  budget.signals_pending = reader.flag("signals-pending flag");
  if (budget.signals_pending && budget.tables_received == 0) {
    throw StateError("state blob: signals are pending, but no signal table was received");
  }
  budget.table_loss = finite_or_nan(reader, "signal table loss");
  budget.feedback_loss = finite_or_nan(reader, "smoothed feedback loss");
  const std::uint8_t source = reader.u8("allocation source");
  // Format 4 adds source 3: v4's measured costs, which its own section carries.
  const auto last_source = version >= 4 ? AllocationSource::measured : AllocationSource::signals;
  if (source > static_cast<std::uint8_t>(last_source)) {
    throw StateError(fmt::format("state blob: allocation source must be 0 (none), 1 (prior), 2 (signals){}, found {}",
                                 version >= 4 ? " or 3 (measured)" : "", source));
  }
  budget.source = static_cast<AllocationSource>(source);
  if (budget.source == AllocationSource::signals && budget.tables_received == 0) {
    throw StateError("state blob: an allocation from signals, but no signal table was received");
  }
  budget.decided_at_step = reader.i64("allocation step");
  const bool allocated = budget.source != AllocationSource::none;
  // Format 4: -1, allocated before the first step (v4 routes from its initial hints).
  const std::int64_t first_allocation_step = version >= 4 ? -1 : 0;
  if (allocated ? budget.decided_at_step < first_allocation_step || budget.decided_at_step > state.current_step
                : budget.decided_at_step != -1) {
    throw StateError(fmt::format("state blob: allocation step {} does not fit allocation source {} at step {}",
                                 budget.decided_at_step, source, state.current_step));
  }
  budget.planned_bytes = reader.u64("planned bytes");
  budget.planned_cost = finite_or_nan(reader, "planned cost");
  budget.met = reader.flag("budget-met flag");
  if (!allocated && budget.met) throw StateError("state blob: a budget is met without an allocation");
  budget.bucket_bytes = reader.u64("solver bucket bytes");
  if (budget.bucket_bytes == 0) throw StateError("state blob: the solver bucket must be at least 1 byte");
  for (UnitSignals &unit : budget.units) {
    read_tier_values(reader, "smoothed loss cost", unit.cost);
    read_tier_values(reader, "first-order term", unit.first_order);
    read_tier_values(reader, "second-order term", unit.second_order);
  }
}

}  // namespace

std::uint32_t state_format_for(const PolicyState &state) {
  if (kStateFormatVersion >= 4 && !state.rule_sections.empty()) return 4;
  if (kStateFormatVersion >= 3) return state.budget.holds_state() ? 3 : 2;
  return kStateFormatVersion;
}

std::vector<std::uint8_t> encode_state(const PolicyState &state) {
  const std::uint32_t version = state_format_for(state);
  Writer out;
  out.bytes(kMagic, sizeof kMagic);
  out.u32(version);
  out.u32(section_count_of(version) + (version >= 4 ? static_cast<std::uint32_t>(state.rule_sections.size()) : 0));
  out.u64(0);
  write_policy_section(out, state);
  write_blocks_section(out, state);
  if (version >= 2) {
    write_guard_section(out, state);
    write_blocks_v2_section(out, state);
  }
  if (version >= 3) write_budget_section(out, state);
  if (version >= 4) {
    for (const RuleSection &section : state.rule_sections) {
      out.u32(section.tag);
      out.u64(section.payload.size());
      out.bytes(section.payload.data(), section.payload.size());
    }
  }
  out.patch_u64(16, out.size() + kTrailerSize);
  std::vector<std::uint8_t> blob = out.take();
  const std::uint32_t crc = crc32(blob.data(), blob.size());
  for (int i = 0; i < 4; ++i) blob.push_back(static_cast<std::uint8_t>(crc >> (8 * i)));
  return blob;
}

PolicyState decode_state(const std::uint8_t *blob, std::size_t size, std::uint32_t n_blocks,
                         std::uint32_t window_capacity, std::uint32_t loss_window_capacity) {
  if (blob == nullptr || size < kHeaderSize + kTrailerSize) {
    throw StateError(fmt::format("state blob is {} bytes, shorter than its {}-byte header and checksum", size,
                                 kHeaderSize + kTrailerSize));
  }
  if (std::memcmp(blob, kMagic, sizeof kMagic) != 0) {
    throw StateError("not a Selective Precision policy state blob: the magic bytes do not match");
  }
  Reader header(blob, size, sizeof kMagic);
  const std::uint32_t version = header.u32("format version");
  if (version < kOldestReadable || version > kStateFormatVersion) {
    throw StateError(kOldestReadable == kStateFormatVersion
                         ? fmt::format("state blob format version {} is not supported; this plugin reads version {}",
                                       version, kStateFormatVersion)
                         : fmt::format("state blob format version {} is not supported; this plugin reads versions "
                                       "{} to {}",
                                       version, kOldestReadable, kStateFormatVersion));
  }
  const std::uint32_t section_count = header.u32("section count");
  const std::uint64_t total_size = header.u64("total size");
  if (total_size != size) {
    throw StateError(
        fmt::format("state blob header says {} bytes but {} were given (truncated or padded)", total_size, size));
  }
  const std::size_t body_end = size - kTrailerSize;
  Reader trailer(blob, size, body_end);
  const std::uint32_t stored_crc = trailer.u32("checksum");
  const std::uint32_t computed_crc = crc32(blob, body_end);
  if (stored_crc != computed_crc) {
    throw StateError(
        fmt::format("state blob is corrupted: checksum 0x{:08x} stored, 0x{:08x} computed", stored_crc, computed_crc));
  }
  if (version >= 4 ? section_count <= section_count_of(version) : section_count != section_count_of(version)) {
    throw StateError(fmt::format("state blob has {} sections; format version {} has {}{}", section_count, version,
                                 version >= 4 ? "more than " : "", section_count_of(version)));
  }

  PolicyState state(n_blocks, window_capacity);
  Reader reader(blob, body_end, header.offset());
  PolicyFields fields;
  fields.version = version;
  bool seen_policy = false;
  bool seen_blocks = false;
  bool seen_guard = false;
  bool seen_blocks_v2 = false;
  bool seen_budget = false;
  for (std::uint32_t s = 0; s < section_count; ++s) {
    const std::uint32_t tag = reader.u32("section tag");
    const std::uint64_t payload_size = reader.u64("section size");
    if (payload_size > reader.remaining()) {
      throw StateError(fmt::format("state blob is truncated: section {} declares {} bytes, only {} left", s,
                                   payload_size, reader.remaining()));
    }
    const std::size_t payload_end = reader.offset() + static_cast<std::size_t>(payload_size);
    Reader payload(blob, payload_end, reader.offset());
    if (tag == kPolicySection && !seen_policy) {
      if (payload_size != kPolicyPayloadSize) {
        throw StateError(
            fmt::format("state blob: the policy section is {} bytes, expected {}", payload_size, kPolicyPayloadSize));
      }
      fields = read_policy_section(payload, n_blocks, state);
      fields.version = version;
      seen_policy = true;
    } else if (tag == kBlocksSection && !seen_blocks) {
      // The blocks need the policy section (block count, capacity, step) to be checked.
      if (!seen_policy) throw StateError("state blob: the blocks section comes before the policy section");
      read_blocks_section(payload, payload_end, fields, state);
      seen_blocks = true;
    } else if (version >= 2 && tag == kGuardSection && !seen_guard) {
      read_guard_section(payload, payload_end, state, loss_window_capacity);
      seen_guard = true;
    } else if (version >= 2 && tag == kBlocksV2Section && !seen_blocks_v2) {
      // The v2 records refine the blocks (assignment, step) that the blocks section read.
      if (!seen_blocks) throw StateError("state blob: the v2 blocks section comes before the blocks section");
      read_blocks_v2_section(payload, static_cast<std::size_t>(payload_size), state);
      seen_blocks_v2 = true;
    } else if (version >= 3 && tag == kBudgetSection && !seen_budget) {
      // Its steps are checked against the current step of the policy section.
      if (!seen_policy) throw StateError("state blob: the budget section comes before the policy section");
      read_budget_section(payload, static_cast<std::size_t>(payload_size), version, state);
      seen_budget = true;
    } else if (version >= 4 && s >= section_count_of(version) && tag != 0 && !is_shared_tag(tag) &&
               std::none_of(state.rule_sections.begin(), state.rule_sections.end(),
                            [&](const RuleSection &seen) { return seen.tag == tag; })) {
      // A rule's section is its rule's to validate (PolicyEngine::import_state): carried as is.
      const std::uint8_t *begin = blob + reader.offset();
      state.rule_sections.push_back(RuleSection{tag, std::vector<std::uint8_t>(begin, begin + payload_size)});
    } else {
      throw StateError(fmt::format("state blob: section {} has an unknown or repeated tag 0x{:08x}", s, tag));
    }
    reader = Reader(blob, body_end, payload_end);
  }
  if (reader.remaining() != 0) {
    throw StateError(fmt::format("state blob has {} unexpected bytes after its sections", reader.remaining()));
  }
  return state;
}

}  // namespace sp::policy
