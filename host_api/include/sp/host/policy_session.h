// A training loop's side of the policy plugin: drives PolicyHost through the step lifecycle,
// watches the plugin file for a newer version (hot swap at the next step boundary), and
// carries the plugin's state (its export_state blob) in and out of a checkpoint. Torch-free:
// any host (the LibTorch layer, sp-train, a Python binding) uses it as is.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "sp/host/policy_host.h"
#include "sp/precision.h"

namespace sp::host {

// What calibration measures: per quantized precision, one value per block, the relative output
// error of the block's weights in that precision against its BF16 weights. BF16's entry stays
// empty (its error against itself is zero).
using CalibrationErrors = PerPrecision<std::vector<double>>;

class PolicySession {
 public:
  // Loads `plugin_file` with `config` for `blocks`. Throws PluginError when the plugin cannot
  // be loaded or rejects the config, std::invalid_argument on bad options.
  PolicySession(std::filesystem::path plugin_file, PolicyConfig config, std::vector<BlockDescription> blocks,
                PolicyHostOptions options);
  ~PolicySession();

  // One relative output error per block against BF16, at `precision` (INT8 or NF4).
  bool set_calibration_errors(sp_precision precision, const std::vector<double>& errors);
  void begin_step(std::int64_t step);
  void post_backward(std::int64_t step, const std::vector<sp_grad_moments_v1>& moments);
  const std::vector<sp_hint_v1>& compute_hints(std::int64_t step);
  void end_step(std::int64_t step, const sp_step_feedback_v1& feedback);

  // ABI 1.2 (PolicyHost::set_unit_signals, unit_costs, budget_status): a signal table measured
  // at `step` (-1 before the first step), and what the policy decided from it, for a report.
  // A plugin older than 1.2 takes no table (true) and reports nothing (nullopt).
  bool set_unit_signals(std::int64_t step, const UnitSignalTable& table);
  std::optional<std::vector<double>> unit_costs(sp_precision precision) { return host_->unit_costs(precision); }
  std::optional<sp_budget_status_v1> budget_status() { return host_->budget_status(); }
  // ABI 1.3 (PolicyHost::initial_hints): the hints before the first step, nullopt without.
  std::optional<std::vector<sp_hint_v1>> initial_hints() { return host_->initial_hints(); }

  // Between steps: if the plugin file changed since it was loaded (or `force`, after
  // SIGHUP), asks the host library to swap to it at the next begin_step. Returns the
  // request's outcome when one was made.
  std::optional<SwapResult> check_for_new_version(bool force);
  // Drops the swap requested by check_for_new_version() before it takes over (PolicyHost::
  // cancel_swap); its failed result is what take_swap_outcome() then reports.
  std::optional<SwapResult> cancel_swap(const std::string& why);
  // The swap applied (or failed) by the latest begin_step, if any, once.
  std::optional<SwapResult> take_swap_outcome();

  // The plugin's state blob for a checkpoint, and its restoration on resume (between steps).
  // restore_state throws std::runtime_error when the plugin rejects the blob.
  std::vector<std::uint8_t> export_state() const { return host_->export_state(); }
  void restore_state(const std::vector<std::uint8_t>& blob);

  const PolicyHost& host() const { return *host_; }
  std::string_view plugin_version() const { return host_->plugin_version(); }

 private:
  struct FileIdentity {
    std::uintmax_t size = 0;
    std::int64_t mtime_ns = 0;
    std::uint64_t inode = 0;
    bool operator==(const FileIdentity& o) const {
      return size == o.size && mtime_ns == o.mtime_ns && inode == o.inode;
    }
  };
  static std::optional<FileIdentity> identify(const std::filesystem::path& file);

  std::filesystem::path plugin_file_;
  std::shared_ptr<spdlog::logger> logger_;
  std::unique_ptr<PolicyHost> host_;
  std::optional<FileIdentity> loaded_identity_;
  bool swap_requested_ = false;
};

}  // namespace sp::host
