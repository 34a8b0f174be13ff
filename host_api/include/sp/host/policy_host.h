// Drives one policy plugin through the training loop, survives its failures with safe
// hints, and hot-swaps it for another version at a step boundary.
#ifndef SP_HOST_POLICY_HOST_H
#define SP_HOST_POLICY_HOST_H

#include <sp/host/plugin_library.h>
#include <sp/plugin_abi_v1.h>

#include <cstdint>
#include <filesystem>
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
  std::uint64_t bf16_bytes = 0;
  std::uint64_t int8_bytes = 0;
  std::string name;
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
};

/// Failed hook calls since the host was created, per hook. A compute_hints call whose
/// output broke the contract counts under invalid_hints, not compute_hints.
struct HookFailureCounts {
  std::uint64_t begin_step = 0;
  std::uint64_t post_backward = 0;
  std::uint64_t compute_hints = 0;
  std::uint64_t invalid_hints = 0;
  std::uint64_t end_step = 0;
  std::uint64_t set_calibration_errors = 0;
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
  /// order). Throws PluginError when the file cannot be loaded or the plugin rejects the
  /// configuration; the message names the file, the config source and the plugin's reason.
  PolicyHost(const std::filesystem::path& plugin_file, PolicyConfig config,
             std::vector<BlockDescription> blocks, PolicyHostOptions options = {});
  ~PolicyHost();
  PolicyHost(const PolicyHost&) = delete;
  PolicyHost& operator=(const PolicyHost&) = delete;

  /// Applies a pending swap first, then starts the step in the active plugin.
  void begin_step(std::int64_t step);
  void post_backward(std::int64_t step, const std::vector<sp_grad_moments_v1>& moments);
  /// One hint per block, hints[i].block_id == i. Borrowed; valid until the next call.
  const std::vector<sp_hint_v1>& compute_hints(std::int64_t step);
  /// `feedback` may be null; its struct_size is set by the host.
  void end_step(std::int64_t step, const sp_step_feedback_v1* feedback = nullptr);
  /// Returns false (after logging and counting) when the plugin rejects the errors.
  bool set_calibration_errors(const std::vector<std::uint32_t>& block_ids,
                              const std::vector<double>& errors);

  /// The active plugin's state blob (export_state), for a checkpoint. Only between steps;
  /// otherwise throws std::logic_error. Throws PluginError when the plugin cannot export.
  std::vector<std::uint8_t> export_state() const;
  /// Replaces the active plugin's state with a blob from export_state (of this or an
  /// earlier version), e.g. when resuming from a checkpoint. Only between steps; otherwise
  /// throws std::logic_error. Returns false (after logging the plugin's reason) when the
  /// plugin rejects the blob, whose state then stays as it was.
  bool import_state(const std::vector<std::uint8_t>& blob);

  /// Loads `plugin_file` and creates its context now (with `config`, or the active
  /// configuration when none is given); the state migration and the switch happen at the
  /// next begin_step. Returns pending, or failed with the reason; either way it is logged.
  /// A newer request replaces a pending one.
  SwapResult request_swap(const std::filesystem::path& plugin_file,
                          std::optional<PolicyConfig> config = std::nullopt);
  /// The whole swap at once. Only between steps (before the first begin_step or after an
  /// end_step); otherwise throws std::logic_error.
  SwapResult swap_now(const std::filesystem::path& plugin_file,
                      std::optional<PolicyConfig> config = std::nullopt);
  /// Outcome of the most recent swap that was applied or failed at a step boundary.
  const std::optional<SwapResult>& last_swap_result() const;
  bool swap_pending() const;

  HintSource last_hint_source() const;
  const HookFailureCounts& hook_failures() const;
  std::string_view plugin_name() const;
  std::string_view plugin_version() const;
  const std::filesystem::path& plugin_file() const;
  std::uint32_t block_count() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace sp::host

#endif  // SP_HOST_POLICY_HOST_H
