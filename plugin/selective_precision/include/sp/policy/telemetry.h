// Telemetry of the policy: one JSON object per line, appended and flushed per record.
#pragma once

#include "sp/policy/config.h"
#include "sp/policy/log_sink.h"
#include "sp/policy/state.h"

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

namespace sp::policy {

// Bytes one transfer of a block moves at each tier, looked up by ABI code: BF16's and INT8's from
// the block descs, a later route's from set_transfer_bytes; 0 = not described by the host.
using BlockBytes = PerTier<std::uint64_t>;

// v2: a loss spike that end_step judged.
struct SpikeRecord {
  double loss = 0.0;
  double mu = 0.0;
  double sd = 0.0;
  std::vector<std::uint32_t> blamed;
};

// v3: the budget as a record states it; the allocation itself is in PolicyState::budget.
struct BudgetRecord {
  BudgetKind kind = BudgetKind::none;
  double limit = 0.0;
  double reference_loss = 0.0;     // NaN when unknown
  std::uint64_t all_bf16_bytes = 0;
};

// What a telemetry record says about one step, beyond the policy state itself.
struct StepRecord {
  std::int64_t step = 0;
  bool decision_step = false;  // mode budget: the step re-allocated
  std::uint32_t precision_changes = 0;
  std::optional<SpikeRecord> spike;    // v2
  std::optional<BudgetRecord> budget;  // v3, mode budget
};

// Builds one JSONL line (without the newline) for `record`. `hints` are the hints that
// compute_hints returned at that step; `measured` are the bytes the host reported since the
// previous record; `nf4_group_size` gives the nominal NF4 bytes of a block whose NF4 bytes
// the host never sent (nominal_nf4_ratio).
class DecisionRule;

// The mode's `rule` adds its own fields (DecisionRule::describe).
std::string telemetry_record_line(const StepRecord &record, Mode mode, const DecisionRule &rule, const PolicyState &state,
                                  const std::vector<sp_hint_v1> &hints, const std::vector<BlockBytes> &block_bytes,
                                  const MeasuredBytes &measured, std::int64_t nf4_group_size, double unix_seconds);

// A tier's bytes over BF16's in theory (sp::nominal_bits_per_weight): 0.5 for INT8, (0.5 +
// 2/nf4_group_size) / 2 for NF4; a route without the config's group size takes its default.
double nominal_ratio(sp_precision tier, std::int64_t nf4_group_size);
double nominal_nf4_ratio(std::int64_t nf4_group_size);

// What one transfer of a block moves at `tier`: the bytes the host described, or for a route it
// did not describe (a host older than the ABI minor that added it) the nominal image, rounded up.
std::uint64_t tier_bytes(const BlockBytes &bytes, sp_precision tier, std::int64_t nf4_group_size);

const char *reason_name(sp_reason reason);

// Appends lines to a file. An open or write failure is logged once through `log`; the
// writer then goes quiet and the policy carries on.
class TelemetryWriter {
 public:
  TelemetryWriter(std::string path, LogSink *log);
  ~TelemetryWriter();
  TelemetryWriter(const TelemetryWriter &) = delete;
  TelemetryWriter &operator=(const TelemetryWriter &) = delete;

  bool healthy() const { return file_ != nullptr; }
  const std::string &path() const { return path_; }
  void append(const std::string &line);

 private:
  void fail(const std::string &what);

  std::string path_;
  LogSink *log_;
  std::FILE *file_ = nullptr;
};

}  // namespace sp::policy
