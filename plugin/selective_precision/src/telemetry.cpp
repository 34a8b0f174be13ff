#include "sp/policy/telemetry.h"

#include "sp/policy/decision_rule.h"
#include "sp/policy/routes.h"
#include "json_values.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>

namespace sp::policy {
namespace {

const char *assignment_name(Assignment assignment) {
  if (assignment == Assignment::unassigned) return "unassigned";
  return precision_name(from_abi(travels_as(assignment)).value_or(Precision::bf16));
}

}  // namespace

// What an NF4 transfer moves relative to BF16 when the host has not described NF4 bytes
// (set_transfer_bytes): per element half a byte of codes plus one BF16 scale (2 bytes) per
// group, over BF16's 2 bytes: 0.25 + 1/group, 0.265625x at group 64 (docs/kernels.md
// measures 0.2666x on real images, whose rows round up to whole groups).
double nominal_ratio(sp_precision tier, std::int64_t nf4_group_size) {
  const RouteTraits &route = route_traits(from_abi(tier).value());
  const std::uint32_t group_size =
      tier == SP_PRECISION_NF4 ? static_cast<std::uint32_t>(nf4_group_size) : route.default_group_size;
  return nominal_bits_per_weight(route.precision, group_size) / nominal_bits_per_weight(Precision::bf16, 0);
}

double nominal_nf4_ratio(std::int64_t nf4_group_size) { return nominal_ratio(SP_PRECISION_NF4, nf4_group_size); }

std::uint64_t tier_bytes(const BlockBytes &bytes, sp_precision tier, std::int64_t nf4_group_size) {
  if (bytes[tier] > 0 || route_traits(from_abi(tier).value()).abi_minor == 0) return bytes[tier];
  return static_cast<std::uint64_t>(
      std::ceil(nominal_ratio(tier, nf4_group_size) * static_cast<double>(bytes[SP_PRECISION_BF16])));
}

namespace {

// The seed's estimate from each block's real bytes per precision (BF16 and INT8 from the
// block descs, NF4 from set_transfer_bytes); when the host declared no sizes, the nominal
// ratios (an INT8 block moves half the bytes, an NF4 block nominal_nf4_ratio) over block counts.
double estimated_saving_pct(const std::vector<sp_hint_v1> &hints, const std::vector<BlockBytes> &block_bytes,
                            std::int64_t nf4_group_size) {
  double total_bf16 = 0.0;
  double saved = 0.0;
  double saved_fraction_by_count = 0.0;
  for (std::size_t b = 0; b < hints.size(); ++b) {
    const double bf16 = static_cast<double>(block_bytes[b][SP_PRECISION_BF16]);
    total_bf16 += bf16;
    const sp_precision tier = hints[b].precision;
    if (tier == SP_PRECISION_BF16 || !tier_position(tier)) continue;
    saved_fraction_by_count += 1.0 - nominal_ratio(tier, nf4_group_size);
    saved += bf16 - static_cast<double>(tier_bytes(block_bytes[b], tier, nf4_group_size));
  }
  if (total_bf16 > 0.0) return 100.0 * saved / total_bf16;
  return hints.empty() ? 0.0 : 100.0 * saved_fraction_by_count / static_cast<double>(hints.size());
}

nlohmann::ordered_json spike_json(const std::optional<SpikeRecord> &spike) {
  if (!spike) return nullptr;
  return {{"loss", spike->loss}, {"mu", spike->mu}, {"sd", spike->sd}, {"blocks_blamed", spike->blamed}};
}

const char *source_name(AllocationSource source) {
  switch (source) {
    case AllocationSource::prior:
      return "prior";
    case AllocationSource::signals:
      return "signals";
    case AllocationSource::measured:
      return "measured";
    default:
      return "none";
  }
}

// v3: the budget and where the current allocation stands against it.
nlohmann::ordered_json budget_json(const BudgetRecord &record, const BudgetState &budget) {
  const bool allocated = budget.source != AllocationSource::none;
  const double all_bf16 = static_cast<double>(record.all_bf16_bytes);
  const double planned_fraction = allocated && all_bf16 > 0 ? static_cast<double>(budget.planned_bytes) / all_bf16
                                                            : ScoreParts::kNever;
  return {
      {"kind", record.kind == BudgetKind::loss ? "loss" : "bytes"},
      {"limit", record.limit},
      {"reference_loss", number_or_null(record.reference_loss)},
      {"source", source_name(budget.source)},
      {"decided_at_step", allocated ? nlohmann::ordered_json(budget.decided_at_step) : nullptr},
      {"planned_bytes", allocated ? nlohmann::ordered_json(budget.planned_bytes) : nullptr},
      {"all_bf16_bytes", record.all_bf16_bytes},
      {"planned_bytes_fraction", number_or_null(planned_fraction)},
      {"planned_cost", number_or_null(allocated ? budget.planned_cost : ScoreParts::kNever)},
      {"planned_loss_fraction",
       number_or_null(allocated && record.reference_loss > 0.0 ? budget.planned_cost / record.reference_loss
                                                               : ScoreParts::kNever)},
      {"met", allocated && budget.met},
      // 1: the allocation is exact; otherwise it is exact at this many bytes (sizes rounded up).
      {"granularity_bytes", budget.bucket_bytes},
      {"signal_tables", budget.tables_received},
      {"last_signal_step",
       budget.last_signal_step ? nlohmann::ordered_json(*budget.last_signal_step) : nlohmann::ordered_json(nullptr)},
      {"last_signal_samples", budget.last_table_samples},
  };
}

nlohmann::ordered_json measured_bandwidth(const MeasuredBytes &measured) {
  if (measured.steps == 0 || measured.all_bf16 == 0) return nullptr;
  const double moved =
      static_cast<double>(measured.bf16) + static_cast<double>(measured.int8) + static_cast<double>(measured.nf4);
  const double saved = static_cast<double>(measured.all_bf16) - moved;
  nlohmann::ordered_json out = {
      {"steps", measured.steps}, {"h2d_bytes_bf16", measured.bf16}, {"h2d_bytes_int8", measured.int8}};
  if (kPolicyEdition >= 2) out["h2d_bytes_nf4"] = measured.nf4;
  out["h2d_bytes_all_bf16"] = measured.all_bf16;
  out["bytes_saved"] = saved;
  out["saving_pct"] = 100.0 * saved / static_cast<double>(measured.all_bf16);
  return out;
}

}  // namespace

const char *reason_name(sp_reason reason) {
  switch (reason) {
    case SP_REASON_NO_DATA:
      return "no_data";
    case SP_REASON_THRESHOLD:
      return "threshold";
    case SP_REASON_HYSTERESIS_HOLD:
      return "hysteresis_hold";
    case SP_REASON_COOLDOWN:
      return "cooldown";
    case SP_REASON_UNSAFE:
      return "unsafe";
    case SP_REASON_FORCED:
      return "forced";
    case SP_REASON_MODE:
      return "mode";
    case SP_REASON_NOT_DECISION_STEP:
      return "not_decision_step";
    case SP_REASON_LOSS_GUARD:
      return "loss_guard";
    case SP_REASON_PENALTY:
      return "penalty";
    case SP_REASON_BUDGET:
      return "budget";
    default:
      return "unknown";
  }
}

// The 1.0.0 edition (kPolicyEdition 1) writes the records of the real 1.0.0: none of the
// fields that docs/policy.md lists under "Telemetry added by 2.0.0" (blocks_nf4, loss_spike,
// measured_bandwidth.h2d_bytes_nf4, per block s4, nf4_error_score, nf4_calibration_error,
// last_down_move_step, penalty_until). The shared engine tracks their values in both editions,
// but 1.0.0 never wrote them, and its state format 1 cannot carry them across a live upgrade.
std::string telemetry_record_line(const StepRecord &record, Mode mode, const DecisionRule &rule, const PolicyState &state,
                                  const std::vector<sp_hint_v1> &hints, const std::vector<BlockBytes> &block_bytes,
                                  const MeasuredBytes &measured, std::int64_t nf4_group_size, double unix_seconds) {
  std::uint32_t blocks_int8 = 0;
  std::uint32_t blocks_nf4 = 0;
  std::uint32_t scored = 0;
  double sensitivity_sum = 0.0;
  double sensitivity_max = -1.0;
  double sensitivity_min = 2.0;
  nlohmann::ordered_json details = nlohmann::ordered_json::object();
  for (std::uint32_t b = 0; b < hints.size(); ++b) {
    const sp_hint_v1 &hint = hints[b];
    const BlockState &block = state.blocks[b];
    if (hint.precision == SP_PRECISION_INT8) ++blocks_int8;
    if (hint.precision == SP_PRECISION_NF4) ++blocks_nf4;
    if (!std::isnan(hint.sensitivity)) {
      ++scored;
      sensitivity_sum += hint.sensitivity;
      sensitivity_max = std::max(sensitivity_max, hint.sensitivity);
      sensitivity_min = std::min(sensitivity_min, hint.sensitivity);
    }
    const std::uint32_t window_size = state.windows.size(b);
    double variance_sum = 0.0;
    double window_max_abs = 0.0;
    for (std::uint32_t i = 0; i < window_size; ++i) {
      variance_sum += state.windows.at(b, i).variance;
      window_max_abs = std::max(window_max_abs, state.windows.at(b, i).max_abs);
    }
    nlohmann::ordered_json detail = {
        {"precision", precision_name(hint.precision)},
        {"reason", reason_name(hint.reason)},
        {"assignment", assignment_name(block.assignment)},
        {"sensitivity", number_or_null(hint.sensitivity)},
        {"avg_l2", number_or_null(block.score.avg_l2)},
        {"relative_magnitude", number_or_null(block.score.relative_magnitude)},
        {"grad_score", number_or_null(block.score.grad_score)},
        {"error_score", number_or_null(block.score.error_score)},
        {"calibration_error", block.calibration_error ? nlohmann::ordered_json(*block.calibration_error) : nullptr},
        {"window_size", window_size},
        {"window_mean_variance", window_size ? nlohmann::ordered_json(variance_sum / window_size) : nullptr},
        {"window_max_abs", window_size ? nlohmann::ordered_json(window_max_abs) : nullptr},
        {"last_switch_step", block.last_switch_step ? nlohmann::ordered_json(*block.last_switch_step) : nullptr},
    };
    if (kPolicyEdition >= 2) {
      detail["s4"] = number_or_null(block.score.nf4_sensitivity);
      detail["nf4_error_score"] = number_or_null(block.score.nf4_error_score);
      detail["nf4_calibration_error"] =
          block.nf4_calibration_error ? nlohmann::ordered_json(*block.nf4_calibration_error) : nullptr;
      detail["last_down_move_step"] =
          block.last_down_move ? nlohmann::ordered_json(block.last_down_move->step) : nullptr;
      detail["penalty_until"] = block.penalty_until ? nlohmann::ordered_json(*block.penalty_until) : nullptr;
    }
    rule.describe_unit(b, detail);
    details[std::to_string(b)] = std::move(detail);
  }
  nlohmann::ordered_json line = {
      {"step_id", record.step},
      {"timestamp", unix_seconds},
      {"mode", mode_name(mode)},
      {"decision_step", record.decision_step},
      {"blocks_bf16", hints.size() - blocks_int8 - blocks_nf4},
      {"blocks_int8", blocks_int8},
  };
  if (kPolicyEdition >= 2) line["blocks_nf4"] = blocks_nf4;
  line["mean_sensitivity"] = scored ? nlohmann::ordered_json(sensitivity_sum / scored) : nullptr;
  line["max_sensitivity"] = scored ? nlohmann::ordered_json(sensitivity_max) : nullptr;
  line["min_sensitivity"] = scored ? nlohmann::ordered_json(sensitivity_min) : nullptr;
  line["precision_changes"] = record.precision_changes;
  line["estimated_bandwidth_saving_pct"] = estimated_saving_pct(hints, block_bytes, nf4_group_size);
  line["measured_bandwidth"] = measured_bandwidth(measured);
  if (kPolicyEdition >= 2) line["loss_spike"] = spike_json(record.spike);
  if (record.budget) line["budget"] = budget_json(*record.budget, state.budget);
  rule.describe(line);
  line["block_details"] = std::move(details);
  return line.dump();
}

TelemetryWriter::TelemetryWriter(std::string path, LogSink *log) : path_(std::move(path)), log_(log) {
  std::error_code ignored;
  const std::filesystem::path parent = std::filesystem::path(path_).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent, ignored);
  file_ = std::fopen(path_.c_str(), "a");
  if (file_ == nullptr) fail("cannot open it for appending");
}

TelemetryWriter::~TelemetryWriter() {
  if (file_ != nullptr) std::fclose(file_);
}

void TelemetryWriter::append(const std::string &line) {
  if (file_ == nullptr) return;
  const bool written = std::fwrite(line.data(), 1, line.size(), file_) == line.size() &&
                       std::fputc('\n', file_) != EOF && std::fflush(file_) == 0;
  if (!written) {
    fail("a write failed");
    std::fclose(file_);
    file_ = nullptr;
  }
}

void TelemetryWriter::fail(const std::string &what) {
  const int error = errno;
  if (log_ != nullptr && log_->wants(SP_LOG_WARN)) {
    log_->write(SP_LOG_WARN, fmt::format("telemetry file '{}': {} ({}); telemetry is off for the rest of this run, "
                                         "the policy carries on",
                                         path_, what, std::strerror(error)));
  }
}

}  // namespace sp::policy
