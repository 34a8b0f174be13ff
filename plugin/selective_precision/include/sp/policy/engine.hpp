// The Selective Precision policy v1 decision engine: exactly the rules of docs/policy.md.
// One instance per plugin context; not thread-safe (the host calls a context from one
// thread at a time). Every method validates its input completely before it changes
// anything, so a call that throws leaves the engine as it was.
#pragma once

#include "sp/policy/config.hpp"
#include "sp/policy/log_sink.hpp"
#include "sp/policy/state.hpp"
#include "sp/policy/telemetry.hpp"

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
  PolicyEngine(PolicyConfig config, std::vector<BlockBytes> block_bytes, LogSink *log,
               const std::string &output_dir);
  // Writes the telemetry record of a step that never reached end_step.
  ~PolicyEngine();
  PolicyEngine(const PolicyEngine &) = delete;
  PolicyEngine &operator=(const PolicyEngine &) = delete;

  std::uint32_t n_blocks() const { return static_cast<std::uint32_t>(block_bytes_.size()); }
  const PolicyConfig &config() const { return config_; }
  const PolicyState &state() const { return state_; }
  bool is_decision_step(std::int64_t step) const;

  void begin_step(std::int64_t step);
  void post_backward(std::int64_t step, const sp_grad_moments_v1 *moments, std::uint32_t n);
  void compute_hints(std::int64_t step, sp_hint_v1 *hints_out, std::uint32_t n);
  void end_step(std::int64_t step, const sp_step_feedback_v1 *feedback);
  void set_calibration_errors(const std::uint32_t *block_ids, const double *errors, std::uint32_t n);

  std::vector<std::uint8_t> export_state() const;
  void import_state(const std::uint8_t *blob, std::size_t size);

 private:
  void require_phase(const char *hook, std::int64_t step, std::initializer_list<StepPhase> allowed) const;
  void decide_dynamic(std::int64_t step, bool decision_step);
  void decide_static();
  void decide_off();
  void score_blocks();
  sp_reason apply_thresholds(BlockState &block, double sensitivity, std::int64_t step) const;
  bool cooldown_passed(const BlockState &block, std::int64_t step) const;
  void assign(BlockState &block, Assignment target, std::int64_t step) const;
  void log_change(std::int64_t step, std::uint32_t block, sp_precision from, const sp_hint_v1 &hint);
  void write_pending_record() noexcept;

  PolicyConfig config_;
  Mode mode_;
  std::vector<BlockBytes> block_bytes_;
  LogSink *log_;
  // -1 = free, otherwise the forced sp_precision of the block.
  std::vector<std::int8_t> forced_;
  PolicyState state_;
  std::unique_ptr<TelemetryWriter> telemetry_;
  std::optional<StepRecord> pending_record_;

  // Scratch space reused every step so that the steady state allocates nothing.
  std::vector<sp_hint_v1> hints_;
  std::vector<ScoreParts> step_scores_;
  std::vector<std::uint64_t> seen_in_call_;
  std::uint64_t call_serial_ = 0;
};

}  // namespace sp::policy
