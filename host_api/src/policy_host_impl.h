// PolicyHost::Impl, shared by policy_host.cpp (loading, the step hooks, fallback hints, calibration errors)
// and policy_host_swap.cpp (hot swaps and the state they carry). Private to the host library.
#pragma once

#include <sp/host/policy_host.h>

#include "hook_watchdog.h"
#include "plugin_instance.h"

#include <spdlog/spdlog.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define SP_HOST_HAS_LSAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SP_HOST_HAS_LSAN 1
#endif
#endif
#ifdef SP_HOST_HAS_LSAN
#include <sanitizer/lsan_interface.h>
#endif

namespace sp::host {
namespace detail {

// Gives up ownership for good: a thread may still run inside the object (a plugin stuck in a
// hook, or the supervisor waiting on that hook), so it must never be destroyed. Under
// AddressSanitizer, LeakSanitizer is told that this is on purpose.
template <typename T>
void abandon(std::unique_ptr<T>& owner) {
  [[maybe_unused]] T* kept = owner.release();
#ifdef SP_HOST_HAS_LSAN
  if (kept != nullptr) __lsan_ignore_object(kept);
#endif
}

}  // namespace detail

struct PolicyHost::Impl {
  PolicyHostOptions options;
  std::shared_ptr<spdlog::logger> logger;
  std::vector<BlockDescription> blocks;
  std::unique_ptr<detail::PluginInstance> active;
  std::unique_ptr<detail::PluginInstance> pending;
  SwapResult pending_result;
  // PolicyHostOptions::hook_deadline: the step hooks' supervisor (null: none), and why the
  // active plugin is quarantined (empty: it is not).
  std::unique_ptr<HookWatchdog> watchdog;
  std::string quarantine;
  std::optional<SwapResult> last_swap;
  std::optional<std::int64_t> open_step;
  std::optional<std::int64_t> last_ended_step;
  // A swap between steps (swap_now) happened; the next begin_step is its first step.
  bool first_step_unknown = false;
  std::vector<sp_hint_v1> hints;
  std::vector<sp_hint_v1> plugin_hints;
  std::vector<sp_hint_v1> last_good_hints;
  HintSource hint_source = HintSource::fallback;
  HookFailureCounts failures;
  // Per route after ABI 1.0's (NF4), the calibration errors the caller gave, by block (later
  // calls replace earlier values). A 1.0 plugin cannot take them and its state blob cannot
  // carry them, so a 1.1 plugin that a swap brings in after a 1.0 one receives them from here.
  // INT8's errors travel in the state blob, as they always have, and are not kept.
  PerPrecision<std::map<std::uint32_t, double>> kept_calibration_errors;
  // The last signal table the caller gave and no plugin rejected, with its step. A plugin
  // older than 1.2 cannot take it, so a 1.2 plugin that a swap brings in after one receives it.
  std::optional<std::pair<std::int64_t, UnitSignalTable>> unit_signals;

  std::uint32_t block_count() const { return static_cast<std::uint32_t>(blocks.size()); }

  // The step hooks (policy_host.cpp).

  std::string now_text() const;
  void require_open_step(const char* hook, std::int64_t step) const;
  // A step hook, under the deadline when there is one. A quarantined plugin is not called; a
  // hook that passes the deadline quarantines it. Either way the hook counts as failed.
  sp_status supervised(const char* hook, std::int64_t step, std::function<sp_status()> call);
  void start_watchdog();
  // True when the hook succeeded; otherwise logs the plugin's reason and counts it.
  bool check_hook(const char* hook, std::string_view when, sp_status status, std::uint64_t& failure_count);
  bool check_hook(const char* hook, std::int64_t step, sp_status status, std::uint64_t& failure_count);
  void use_fallback_hints(std::int64_t step);

  // Hot swaps and the state they carry (policy_host_swap.cpp).

  // Hands the kept errors of each later route to `instance`, a 1.1 plugin. Returns the labels of
  // the routes whose errors it rejected ("NF4"), each logged with the plugin's reason and
  // counted; empty when it took them all (or there were none).
  std::string resend_calibration_errors(detail::PluginInstance& instance);
  // Hands `table` to `instance`, a 1.2 plugin; the plugin's status.
  sp_status send_unit_signals(detail::PluginInstance& instance, std::int64_t step, const UnitSignalTable& table);
  // The kept table to a 1.2 plugin after a swap: as resend_calibration_errors.
  bool resend_unit_signals(detail::PluginInstance& instance);
  // A 1.2 query of the active plugin; false when it has none or failed (logged, counted).
  bool query(const char* function, const std::function<sp_status(detail::PluginInstance&)>& call);
  SwapResult stage_swap(const std::filesystem::path& plugin_file, std::optional<PolicyConfig> config);
  void require_between_steps(const char* call) const;
  SwapResult fail_swap(SwapResult result, std::string_view reason);
  std::optional<std::vector<std::uint8_t>> export_active_state(std::string& error);
  // Migrates the state into the pending instance and makes it active. The caller
  // guarantees a step boundary. Whatever goes wrong, the old plugin stays active.
  // `first_step` is the step about to begin, or nullopt for a swap between steps, whose
  // first step is recorded when it begins.
  SwapResult apply_pending_swap(std::optional<std::int64_t> first_step);
  SwapResult migrate_and_switch(SwapResult result, std::optional<std::int64_t> first_step);
  // The quarantined plugin cannot hand over its state (it is stuck in a hook): the new version
  // starts fresh, and the old one is left loaded, since its thread may still run its code.
  SwapResult replace_quarantined(SwapResult result, std::optional<std::int64_t> first_step);
};

}  // namespace sp::host
