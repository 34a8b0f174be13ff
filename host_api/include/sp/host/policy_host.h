// Drives one policy plugin through the training loop, survives its failures with safe
// hints, and hot-swaps it for another version at a step boundary.
#ifndef SP_HOST_POLICY_HOST_H
#define SP_HOST_POLICY_HOST_H

#include <sp/host/plugin_library.h>
#include <sp/plugin_abi_v1.h>
#include <sp/precision.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace spdlog {
class logger;
}

namespace sp::host {

/// Configuration text handed to the plugin's create(), and where it came from (a file
/// path or a description such as "<inline>"), so that errors can name it.
struct PolicyConfig {
  std::string text;
  std::string source_name;
};

/// One streamed block, described to the plugin at create(). Ids run 0..n-1.
struct BlockDescription {
  std::uint32_t id = 0;
  std::uint64_t num_params = 0;
  /// Per route, the bytes one transfer of the block puts on the wire (codes, scales, header);
  /// 0 = no image of that route known. The frozen sp_block_desc_v1 carries ABI 1.0's routes
  /// (BF16 and INT8); each later one reaches a 1.1 plugin through set_transfer_bytes right after
  /// create(), and only when PolicyHostOptions::supported_precisions includes it.
  PerPrecision<std::uint64_t> bytes;
  std::string name;
};

/// ABI 1.2: per-block signals the host measured, as named columns (sp_unit_signals_v1; column
/// names in plugin_abi_v1.h, e.g. "loss_cost.nf4"). A plugin reads the columns it knows.
struct UnitSignalTable {
  std::vector<std::string> names;
  /// block_count() x names.size() values, row-major (row = block id); NaN = not measured.
  std::vector<double> values;
  /// The loss of the batches measured; NaN when unknown.
  double loss = std::numeric_limits<double>::quiet_NaN();
  /// The examples behind the estimate; 0 when unknown.
  std::uint64_t samples = 0;
};

/// ABI 1.4: what the host measured of one allocation a plugin proposed: its route per block, its
/// mean cost against the reference (all-BF16) with the upper confidence bound, and its paired
/// difference from allocation 0 with its upper bound (0 for allocation 0).
struct AllocationMeasurement {
  std::vector<sp_precision> routes;
  double cost = std::numeric_limits<double>::quiet_NaN();
  double cost_upper = std::numeric_limits<double>::quiet_NaN();
  double difference = std::numeric_limits<double>::quiet_NaN();
  double difference_upper = std::numeric_limits<double>::quiet_NaN();
};

/// ABI 1.4: the measurement of a whole proposal, in the proposal's order.
struct AllocationMeasurements {
  std::vector<AllocationMeasurement> allocations;
  /// The examples (or batches) the intervals pair over.
  std::uint64_t samples = 0;
  /// Of every interval, in (0, 1).
  double confidence = 0.95;
};

/// What the host hands out when the plugin cannot answer.
enum class FallbackMode {
  all_bf16,   ///< every block BF16: always safe for convergence
  last_good,  ///< the last hints the plugin produced and the host accepted (BF16 before any)
};

enum class HintSource { plugin, fallback };

struct PolicyHostOptions {
  FallbackMode fallback = FallbackMode::all_bf16;
  std::string host_name = "sp-host";
  /// Empty means the plugin writes relative output files to the working directory.
  std::filesystem::path output_dir;
  /// Receives the host's messages and the plugin's (through the ABI log callback).
  /// Null means spdlog's default logger.
  std::shared_ptr<spdlog::logger> logger;
  /// The precisions this host can transfer (SP_PRECISION_BIT of each). Must contain BF16 and
  /// nothing but BF16, INT8 and NF4; the constructor throws std::invalid_argument otherwise.
  /// A 1.1 plugin receives it in sp_host_api_v1::supported_precisions (a 1.0 plugin assumes
  /// BF16 and INT8). A hint with a precision outside it, or outside what the plugin's ABI
  /// minor defines (NF4 from a 1.0 plugin), is refused: counted under invalid_hints and
  /// replaced by fallback hints.
  sp_precision_mask supported_precisions = SP_PRECISION_BIT(SP_PRECISION_BF16) | SP_PRECISION_BIT(SP_PRECISION_INT8);
  /// A deadline for the step hooks (begin_step, post_backward, compute_hints, end_step); 0:
  /// none, and they run on the caller's thread. With one they run on a supervised thread; a
  /// hook that has not returned when it passes leaves that thread behind and quarantines the
  /// plugin: its hooks are no longer called (the step goes on with fallback hints, the failure
  /// is counted and logged once), its state cannot be exported, and it is never unloaded,
  /// until a new version is swapped in (which then starts without the old state).
  std::chrono::milliseconds hook_deadline{0};
};

/// Failed hook calls since the host was created, per hook. A compute_hints call whose
/// output broke the contract counts under invalid_hints, not compute_hints.
struct HookFailureCounts {
  std::uint64_t begin_step = 0;
  std::uint64_t post_backward = 0;
  std::uint64_t compute_hints = 0;
  std::uint64_t invalid_hints = 0;
  std::uint64_t end_step = 0;
  /// set_calibration_errors and set_precision_calibration_errors together.
  std::uint64_t set_calibration_errors = 0;
  /// 1.2: set_unit_signals, and get_unit_costs and get_budget_status together.
  std::uint64_t set_unit_signals = 0;
  std::uint64_t budget_queries = 0;
  /// 1.3: initial_hints, failed or with hints that broke the contract.
  std::uint64_t initial_hints = 0;
  /// 1.4: propose_allocations (failed, or routes that broke the contract) and
  /// set_allocation_measurements together.
  std::uint64_t allocation_measurements = 0;
  std::uint64_t total() const;
};

struct SwapResult {
  enum class Outcome {
    pending,  ///< the new version is loaded and created; it takes over at the next begin_step
    swapped,  ///< the new version is active
    failed,   ///< the old version stays active; `message` says why
  };
  Outcome outcome = Outcome::failed;
  std::string message;
  std::filesystem::path plugin_file;
  std::string old_version;
  std::string new_version;  ///< empty when the new file could not be loaded
  /// First step driven by the new version. A swap applied at begin_step sets it at once;
  /// after swap_now it is unset in the returned result and filled in last_swap_result()
  /// when the next step begins (step numbers may skip, so it is not guessed).
  std::optional<std::int64_t> first_step;
  /// dlopen(RTLD_NOLOAD) found the old library gone after the swap.
  bool old_library_unloaded = false;
};

/// Owns the active plugin instance and calls its hooks in lifecycle order:
///   begin_step(s) → post_backward(s) → compute_hints(s) → end_step(s) → begin_step(s+1) …
/// Calls out of that order are caller bugs and throw std::logic_error. Hook failures are
/// not: they are logged with the plugin's last_error, counted, and compute_hints then
/// returns fallback hints, so training continues.
///
/// Not thread-safe: one thread drives a PolicyHost.
class PolicyHost {
 public:
  /// Loads `plugin_file` and creates a context with `config` and `blocks` (ids 0..n-1 in
  /// order); for a 1.1 plugin of a host that supports NF4 it then sends the blocks'
  /// nf4_bytes through set_transfer_bytes. Throws PluginError when the file cannot be
  /// loaded or the plugin rejects the configuration or the transfer bytes; the message
  /// names the file, the config source and the plugin's reason. Throws
  /// std::invalid_argument for bad block ids or bad options.supported_precisions.
  PolicyHost(const std::filesystem::path& plugin_file, PolicyConfig config, std::vector<BlockDescription> blocks,
             PolicyHostOptions options = {});
  ~PolicyHost();
  PolicyHost(const PolicyHost&) = delete;
  PolicyHost& operator=(const PolicyHost&) = delete;

  /// Applies a pending swap first, then starts the step in the active plugin.
  void begin_step(std::int64_t step);
  void post_backward(std::int64_t step, const std::vector<sp_grad_moments_v1>& moments);
  /// One hint per block, hints[i].block_id == i. Borrowed; valid until the next call.
  const std::vector<sp_hint_v1>& compute_hints(std::int64_t step);
  /// `feedback` may be null. The host passes a copy whose struct_size is that of the
  /// plugin's minor: SP_STEP_FEEDBACK_V1_0_SIZE for a 1.0 plugin, so h2d_bytes_nf4 reaches
  /// a 1.1 plugin only.
  void end_step(std::int64_t step, const sp_step_feedback_v1* feedback = nullptr);
  /// INT8 calibration errors: set_calibration_errors(SP_PRECISION_INT8, block_ids, errors).
  bool set_calibration_errors(const std::vector<std::uint32_t>& block_ids, const std::vector<double>& errors);
  /// Per-block relative output error of `precision` against BF16 (a calibration pass),
  /// for the listed blocks; other blocks keep theirs. INT8 goes to the plugin's 1.0
  /// set_calibration_errors, NF4 to a 1.1 plugin's set_precision_calibration_errors.
  /// A 1.0 plugin cannot take NF4 errors: they are not sent (a debug message says so) and
  /// the call returns true, as nothing was rejected. Either way the host keeps the NF4
  /// errors and hands them to a 1.1 plugin that a hot swap brings in after a 1.0 one
  /// (whose state blob cannot carry them). Returns false (after logging and counting under
  /// set_calibration_errors) when the plugin rejects the errors. Throws
  /// std::invalid_argument for BF16, an unknown precision, or arrays of different lengths.
  bool set_calibration_errors(sp_precision precision, const std::vector<std::uint32_t>& block_ids,
                              const std::vector<double>& errors);

  /// ABI 1.2: a signal table measured at `step` (-1: a calibration pass before the first
  /// step; at most the current step), for any block count of rows. A plugin older than 1.2
  /// is not called (a debug message says so) and the call returns true. Returns false (after
  /// logging and counting under set_unit_signals) when the plugin rejects the table. The host
  /// keeps the last table it did not see rejected and hands it to a 1.2 plugin that a hot swap
  /// brings in after an older one (whose state blob cannot carry it). Throws
  /// std::invalid_argument when values.size() != block_count() x names.size().
  bool set_unit_signals(std::int64_t step, const UnitSignalTable& table);
  /// ABI 1.2: the active plugin's predicted cost per block at `precision` (NaN = none), or
  /// nullopt from a plugin older than 1.2, a quarantined one, or one that fails (logged and
  /// counted under budget_queries).
  std::optional<std::vector<double>> unit_costs(sp_precision precision);
  /// ABI 1.2: where the active plugin's budget stands; nullopt as unit_costs. Its struct_size
  /// is the plugin's minor's; `reads_step_signals` (1.4) is 1 from an older plugin.
  std::optional<sp_budget_status_v1> budget_status();
  /// ABI 1.3: the hints the active plugin gives before the first step (its forced routes),
  /// one per block, which then stand as the last good hints; nullopt from a plugin older than
  /// 1.3, a quarantined one, or one that fails or breaks the hint contract (logged and counted
  /// under initial_hints). Before the first begin_step only: std::logic_error after it.
  std::optional<std::vector<sp_hint_v1>> initial_hints();
  /// ABI 1.4, between steps: the allocations the active plugin wants measured jointly, a route
  /// per block each; row 0 is the one it holds. Empty when it proposes none; nullopt from a
  /// plugin older than 1.4, a quarantined one, or one that fails or names a precision this host
  /// does not stream (logged and counted under allocation_measurements).
  std::optional<std::vector<std::vector<sp_precision>>> propose_allocations();
  /// ABI 1.4, between steps: the measurement of the latest proposal, `step` as in
  /// set_unit_signals. Returns whether the plugin took it: false from a plugin older than 1.4, a
  /// quarantined one, or one that rejects it (logged and counted). Throws std::invalid_argument
  /// when an allocation's routes are not one per block.
  bool set_allocation_measurements(std::int64_t step, const AllocationMeasurements& measurements);

  /// The active plugin's state blob (export_state), for a checkpoint. Only between steps;
  /// otherwise throws std::logic_error. Throws PluginError when the plugin cannot export.
  std::vector<std::uint8_t> export_state() const;
  /// Replaces the active plugin's state with a blob from export_state (of this or an
  /// earlier version), e.g. when resuming from a checkpoint. Only between steps; otherwise
  /// throws std::logic_error. Returns false (after logging the plugin's reason) when the
  /// plugin rejects the blob, whose state then stays as it was.
  bool import_state(const std::vector<std::uint8_t>& blob);

  /// Loads `plugin_file` and creates its context now (with `config`, or the active
  /// configuration when none is given; for a 1.1 plugin the NF4 transfer bytes follow, as
  /// at construction); the state migration and the switch happen at the next begin_step.
  /// The plugins may be of different minors: the new one is treated by its own. Calibration
  /// errors travel in the state blob; only when a 1.1 plugin replaces a 1.0 one does the
  /// host send it, after import_state, the NF4 errors it has kept (a rejection is logged,
  /// counted and noted in the result's message, and does not undo the swap).
  /// Returns pending, or failed with the reason; either way it is logged.
  /// A newer request replaces a pending one.
  SwapResult request_swap(const std::filesystem::path& plugin_file, std::optional<PolicyConfig> config = std::nullopt);
  /// Why the plugin is quarantined (a hook passed hook_deadline), or empty.
  const std::string& quarantine_reason() const;
  /// Drops a pending swap (the new version is unloaded, the active one stays), e.g. because
  /// other processes of a data-parallel run could not stage the same version. Returns the
  /// failed result with `why` as its message, also recorded as the last swap result; nullopt
  /// when no swap was pending.
  std::optional<SwapResult> cancel_swap(const std::string& why);
  /// The whole swap at once. Only between steps (before the first begin_step or after an
  /// end_step); otherwise throws std::logic_error.
  SwapResult swap_now(const std::filesystem::path& plugin_file, std::optional<PolicyConfig> config = std::nullopt);
  /// Outcome of the most recent swap that was applied or failed at a step boundary.
  const std::optional<SwapResult>& last_swap_result() const;
  bool swap_pending() const;

  HintSource last_hint_source() const;
  const HookFailureCounts& hook_failures() const;
  std::string_view plugin_name() const;
  std::string_view plugin_version() const;
  const std::filesystem::path& plugin_file() const;
  /// The ABI minor the active plugin's table reports (0, 1 or 2). The host hands that plugin
  /// nothing newer: struct sizes, table functions and precisions are those of its minor.
  std::uint32_t plugin_abi_minor() const;
  std::uint32_t block_count() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace sp::host

#endif  // SP_HOST_POLICY_HOST_H
