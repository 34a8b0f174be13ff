// A training loop's side of the policy plugin: drives PolicyHost through the step lifecycle,
// watches the plugin file for a newer version (hot swap at the next step boundary), and
// carries the plugin's state (its export_state blob) in and out of a checkpoint. Torch-free:
// any host (the LibTorch layer, sp-train, a Python binding) uses it as is.
#pragma once

#include <cstdint>
#include <filesystem>
#include <limits>
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

// One policy unit's hint as a runtime takes it: the plugin's sp_hint_v1 once PolicyHost has
// validated it, translated once, here. Its unit is its index in the session's hints.
struct UnitHint {
  Precision precision = Precision::bf16;  // the route of the unit's next fetches
  double sensitivity = std::numeric_limits<double>::quiet_NaN();  // in [0, 1]; NaN: never scored
  sp_reason reason = SP_REASON_NO_DATA;
  bool operator==(const UnitHint& o) const;  // NaN sensitivities compare equal
};

// The ABI form of hints, for a host that stores them (a checkpoint), and back. hints_from_abi
// throws std::invalid_argument naming the first entry that is not hints[i].block_id == i with a
// precision this runtime streams.
std::vector<sp_hint_v1> hints_to_abi(const std::vector<UnitHint>& hints);
std::vector<UnitHint> hints_from_abi(const std::vector<sp_hint_v1>& hints);

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
  // The plugin's hints for the next step (PolicyHost::compute_hints, with its fallback), which
  // become hints().
  const std::vector<UnitHint>& compute_hints(std::int64_t step);
  void end_step(std::int64_t step, const sp_step_feedback_v1& feedback);

  // ABI 1.2 (PolicyHost::set_unit_signals, unit_costs, budget_status): a signal table measured
  // at `step` (-1 before the first step), and what the policy decided from it, for a report.
  // A plugin older than 1.2 takes no table (true) and reports nothing (nullopt).
  bool set_unit_signals(std::int64_t step, const UnitSignalTable& table);
  std::optional<std::vector<double>> unit_costs(sp_precision precision) { return host_->unit_costs(precision); }
  std::optional<sp_budget_status_v1> budget_status() { return host_->budget_status(); }
  // ABI 1.4 (PolicyHost::propose_allocations, set_allocation_measurements): the allocations the
  // policy wants measured jointly, and their measurement; between steps.
  std::optional<std::vector<std::vector<sp_precision>>> propose_allocations() { return host_->propose_allocations(); }
  bool set_allocation_measurements(std::int64_t step, const AllocationMeasurements& measurements) {
    return host_->set_allocation_measurements(step, measurements);
  }
  // ABI 1.3 (PolicyHost::initial_hints): the hints before the first step, which become hints();
  // false, with hints() unchanged, when the plugin has none.
  bool take_initial_hints();
  // The hints in force, one per unit: the latest of compute_hints(), take_initial_hints() and
  // restore_hints(); empty before any. The one copy a runtime routes by.
  const std::vector<UnitHint>& hints() const { return hints_; }
  // A resume's hints (a checkpoint's, or none): one per unit, or empty. Throws
  // std::invalid_argument, with hints() unchanged, for another count.
  void restore_hints(std::vector<UnitHint> hints);

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
  std::vector<UnitHint> hints_;
  std::optional<FileIdentity> loaded_identity_;
  bool swap_requested_ = false;
};

}  // namespace sp::host
