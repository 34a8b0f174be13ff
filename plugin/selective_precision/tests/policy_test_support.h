// Helpers shared by the policy tests: a capturing log sink, config text builders and a
// driver that runs the engine through whole steps.
#pragma once

#include "sp/policy/config.h"
#include "sp/policy/engine.h"

#include <sp/plugin_abi_v1.h>

#include <boost/crc.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace sp::policy::testing {

class CapturingLog final : public LogSink {
 public:
  bool wants(sp_log_level) const override { return true; }
  void write(sp_log_level level, std::string_view message) noexcept override {
    lines.emplace_back(level, std::string(message));
  }
  std::size_t count_containing(const std::string &needle) const {
    std::size_t n = 0;
    for (const auto &line : lines) n += line.second.find(needle) != std::string::npos ? 1 : 0;
    return n;
  }
  std::vector<std::pair<sp_log_level, std::string>> lines;
};

// A standalone policy file whose section holds `settings` (YAML lines, already indented by 2).
inline std::string standalone(const std::string &settings) { return "selective_precision:\n" + settings; }

// Moments whose l2 norm is exactly `l2` (sum_sq = l2^2, mean 0).
inline sp_grad_moments_v1 moments_with_l2(std::uint32_t block, double l2, std::uint64_t count = 1000) {
  return sp_grad_moments_v1{block, 0, l2 * l2, 0.0, l2, count, 0};
}

inline sp_grad_moments_v1 nonfinite_moments(std::uint32_t block) {
  return sp_grad_moments_v1{block, 0, 1.0, 0.0, 1.0, 1000, 3};
}

// Settings that make every step a decision step with no cooldown and no telemetry, so a
// test states only the rule it is about.
inline std::string immediate_settings() {
  return "  warmup_steps: 0\n  update_interval_steps: 1\n  min_steps_between_switches: 0\n"
         "  telemetry_enabled: false\n  log_decisions: false\n";
}

// The score reduces to the calibration error: sensitivity = min(error / 1, 1).
inline std::string error_driven_settings() {
  return "  grad_weight: 0\n  error_weight: 1\n  quant_error_threshold: 1\n";
}

inline void store_u32(std::vector<std::uint8_t> &blob, std::size_t offset, std::uint32_t value) {
  for (int i = 0; i < 4; ++i) blob[offset + i] = static_cast<std::uint8_t>(value >> (8 * i));
}

inline void store_f64(std::vector<std::uint8_t> &blob, std::size_t offset, double value) {
  std::uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof bits);
  for (int i = 0; i < 8; ++i) blob[offset + i] = static_cast<std::uint8_t>(bits >> (8 * i));
}

// Re-seals a deliberately edited blob so that the field checks, not the checksum, reject it.
inline void reseal(std::vector<std::uint8_t> &blob) {
  boost::crc_32_type crc;
  crc.process_bytes(blob.data(), blob.size() - 4);
  store_u32(blob, blob.size() - 4, crc.checksum());
}

class Driver {
 public:
  Driver(const std::string &yaml, std::uint32_t n_blocks, LogSink *log = nullptr, const std::string &output_dir = "")
      : engine_(std::make_unique<PolicyEngine>(parse_policy_config(yaml, n_blocks).config,
                                               std::vector<BlockBytes>(n_blocks, BlockBytes{2000, 1000, 0}), log,
                                               output_dir)),
        hints_(n_blocks) {}

  // Runs begin_step, post_backward, compute_hints and end_step for `step`.
  const std::vector<sp_hint_v1> &step(std::int64_t step, const std::vector<sp_grad_moments_v1> &moments,
                                      const sp_step_feedback_v1 *feedback = nullptr) {
    engine_->begin_step(step);
    engine_->post_backward(step, moments.data(), static_cast<std::uint32_t>(moments.size()));
    engine_->compute_hints(step, hints_.data(), static_cast<std::uint32_t>(hints_.size()));
    engine_->end_step(step, feedback);
    return hints_;
  }

  // Runs `step` with the given l2 per block (NaN = block absent).
  const std::vector<sp_hint_v1> &step_l2(std::int64_t at_step, const std::vector<double> &l2_per_block) {
    std::vector<sp_grad_moments_v1> moments;
    for (std::uint32_t b = 0; b < l2_per_block.size(); ++b) {
      if (!std::isnan(l2_per_block[b])) moments.push_back(moments_with_l2(b, l2_per_block[b]));
    }
    return step(at_step, moments);
  }

  // Runs `at_step` with every block present (l2 = 1) after setting the calibration error of
  // each block; with error_driven_settings() the error is exactly the block's sensitivity.
  const std::vector<sp_hint_v1> &step_with_sensitivity(std::int64_t at_step, const std::vector<double> &errors) {
    std::vector<std::uint32_t> ids(errors.size());
    for (std::uint32_t b = 0; b < ids.size(); ++b) ids[b] = b;
    engine_->set_calibration_errors(ids.data(), errors.data(), static_cast<std::uint32_t>(ids.size()));
    return step_l2(at_step, std::vector<double>(errors.size(), 1.0));
  }

  PolicyEngine &engine() { return *engine_; }
  const BlockState &block(std::uint32_t b) const { return engine_->state().blocks[b]; }
  const std::vector<sp_hint_v1> &hints() const { return hints_; }
  std::vector<sp_hint_v1> &mutable_hints() { return hints_; }
  void destroy() { engine_.reset(); }

 private:
  std::unique_ptr<PolicyEngine> engine_;
  std::vector<sp_hint_v1> hints_;
};

}  // namespace sp::policy::testing
