// Hot swaps: staging a new plugin version, carrying the old one's state across at a step
// boundary (export, import), and the state export and import the caller makes itself.
#include <sp/host/policy_host.h>

#include "plugin_call_scope.h"
#include "policy_host_impl.h"

#include <fmt/format.h>
#include <fmt/std.h>
#include <spdlog/spdlog.h>

#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace sp::host {
namespace {

// A state blob larger than this is taken for a plugin bug, not a state: the swap fails and
// the old plugin stays instead of the host trying to allocate whatever it was told.
constexpr std::uint64_t kMaxStateBytes = std::uint64_t{1} << 30;

}  // namespace

std::string PolicyHost::Impl::resend_calibration_errors(detail::PluginInstance& instance) {
  std::string rejected;
  for (const RouteTraits& route : kRouteTraits) {
    const std::map<std::uint32_t, double>& kept = kept_calibration_errors[route.precision];
    if (kept.empty()) continue;
    std::vector<std::uint32_t> ids;
    std::vector<double> errors;
    for (const auto& [id, error] : kept) {
      ids.push_back(id);
      errors.push_back(error);
    }
    const sp_status status = [&] {
      const detail::PluginCallScope scope(instance.label(), "set_precision_calibration_errors");
      return instance.table().set_precision_calibration_errors(instance.ctx(), route.abi_code, ids.data(),
                                                               errors.data(), static_cast<std::uint32_t>(ids.size()));
    }();
    if (status == SP_OK) {
      logger->debug("policy plugin {}: re-sent the {} calibration errors of {} blocks", instance.label(), route.label,
                    ids.size());
      continue;
    }
    ++failures.set_calibration_errors;
    logger->error(
        "policy plugin {} failed in set_precision_calibration_errors ({} errors of {} blocks, re-sent "
        "after a hot swap from an ABI 1.0 plugin) with {}: {}",
        instance.label(), route.label, ids.size(), detail::status_text(status), instance.last_error());
    rejected += (rejected.empty() ? "" : ", ") + std::string(route.label);
  }
  return rejected;
}

bool PolicyHost::Impl::resend_unit_signals(detail::PluginInstance& instance) {
  if (!unit_signals) return true;
  const auto& [step, table] = *unit_signals;
  const sp_status status = send_unit_signals(instance, step, table);
  if (status == SP_OK) {
    logger->debug("policy plugin {}: re-sent the signal table of step {}", instance.label(), step);
    return true;
  }
  ++failures.set_unit_signals;
  logger->error(
      "policy plugin {} failed in set_unit_signals (the table of step {}, re-sent after a hot swap from an ABI 1.{} "
      "plugin) with {}: {}",
      instance.label(), step, active->abi_minor(), detail::status_text(status), instance.last_error());
  return false;
}

SwapResult PolicyHost::Impl::stage_swap(const std::filesystem::path& plugin_file, std::optional<PolicyConfig> config) {
  SwapResult result;
  result.plugin_file = plugin_file;
  result.old_version = std::string(active->version());
  try {
    PluginLibrary library = PluginLibrary::load(plugin_file);
    result.new_version = std::string(library.plugin_version());
    pending = detail::PluginInstance::create(std::move(library), config ? std::move(*config) : active->config(), blocks,
                                             options, logger);
  } catch (const std::exception& error) {
    // PluginError, and anything else loading or creating may throw (allocation, files):
    // a swap that cannot be staged must never take training down.
    return fail_swap(std::move(result), error.what());
  }
  result.outcome = SwapResult::Outcome::pending;
  result.message = fmt::format("hot swap: {} loaded from {}; it takes over from {} at the next step boundary",
                               pending->label(), plugin_file, active->label());
  logger->info("{}", result.message);
  pending_result = result;
  return result;
}

void PolicyHost::Impl::require_between_steps(const char* call) const {
  if (open_step) {
    throw std::logic_error(
        fmt::format("PolicyHost::{} called inside step {}; call it between steps", call, *open_step));
  }
}

SwapResult PolicyHost::Impl::fail_swap(SwapResult result, std::string_view reason) {
  if (pending) pending->close();
  pending.reset();
  result.outcome = SwapResult::Outcome::failed;
  result.message =
      fmt::format("hot swap to {} failed; {} stays active: {}", result.plugin_file, active->label(), reason);
  logger->error("{}", result.message);
  last_swap = result;
  return result;
}

std::optional<std::vector<std::uint8_t>> PolicyHost::Impl::export_active_state(std::string& error) {
  const sp_policy_plugin_v1_table& table = active->table();
  const detail::PluginCallScope scope(active->label(), "export_state");
  std::uint64_t size = 0;
  sp_status status = table.export_state(active->ctx(), nullptr, 0, &size);
  std::vector<std::uint8_t> blob;
  if (status == SP_OK && size != 0) {
    error =
        fmt::format("export_state of {} reported success for a {}-byte state without a buffer", active->label(), size);
    return std::nullopt;
  }
  if (status == SP_ERR_BUFFER_TOO_SMALL) {
    if (size > kMaxStateBytes) {
      error = fmt::format("export_state of {} asks for a {}-byte buffer, more than the {} bytes a state may take",
                          active->label(), size, kMaxStateBytes);
      return std::nullopt;
    }
    blob.resize(size);
    status = table.export_state(active->ctx(), blob.data(), blob.size(), &size);
    if (status == SP_OK && size > blob.size()) {
      error = fmt::format("export_state reported {} bytes after filling a {}-byte buffer", size, blob.size());
      return std::nullopt;
    }
    blob.resize(size);
  }
  if (status != SP_OK) {
    error = fmt::format("export_state of {} failed with {}: {}", active->label(), detail::status_text(status),
                        active->last_error());
    return std::nullopt;
  }
  return blob;
}

SwapResult PolicyHost::Impl::apply_pending_swap(std::optional<std::int64_t> first_step) {
  SwapResult result = pending_result;
  try {
    return migrate_and_switch(std::move(pending_result), first_step);
  } catch (const std::exception& error) {
    return fail_swap(std::move(result), error.what());
  }
}

SwapResult PolicyHost::Impl::migrate_and_switch(SwapResult result, std::optional<std::int64_t> first_step) {
  if (!quarantine.empty()) return replace_quarantined(std::move(result), first_step);
  std::string error;
  const std::optional<std::vector<std::uint8_t>> blob = export_active_state(error);
  if (!blob) return fail_swap(std::move(result), error);

  const sp_status status = [&] {
    const detail::PluginCallScope scope(pending->label(), "import_state");
    return pending->table().import_state(pending->ctx(), blob->data(), blob->size());
  }();
  if (status != SP_OK) {
    return fail_swap(std::move(result),
                     fmt::format("{} could not import the state of {} ({} bytes) with {}: {}", pending->label(),
                                 active->label(), blob->size(), detail::status_text(status), pending->last_error()));
  }

  // A 1.0 plugin held no calibration errors of a later route (NF4), so its blob brought none:
  // the new 1.1 plugin gets the host's copy. A rejection is logged and counted like any
  // rejected calibration errors; it does not undo the swap.
  const bool resend_errors = !active->abi().has_precision_routes && pending->abi().has_precision_routes;
  const std::string errors_rejected = resend_errors ? resend_calibration_errors(*pending) : std::string();
  // Likewise the signal table, which a plugin older than 1.2 could not hold.
  const bool resend_signals = !active->abi().has_unit_signals && pending->abi().has_unit_signals;
  const bool signals_resent = !resend_signals || resend_unit_signals(*pending);

  std::unique_ptr<detail::PluginInstance> retired = std::exchange(active, std::move(pending));
  const std::string retired_label = retired->label();
  const UnloadReport unload = retired->close();
  result.outcome = SwapResult::Outcome::swapped;
  result.first_step = first_step;
  first_step_unknown = !first_step;
  result.old_library_unloaded = unload.unloaded;
  const std::string when = first_step        ? fmt::format("from step {}", *first_step)
                           : last_ended_step ? fmt::format("after step {}", *last_ended_step)
                                             : std::string("before the first step");
  result.message = fmt::format("hot swap: {} replaced {} {} with {} bytes of state", active->label(), retired_label,
                               when, blob->size());
  logger->info("{}", result.message);
  if (!errors_rejected.empty()) {
    result.message +=
        fmt::format("; warning: the new plugin rejected the {} calibration errors (see the log)", errors_rejected);
  }
  if (!signals_resent) result.message += "; warning: the new plugin rejected the kept signal table (see the log)";
  if (!unload.unloaded) {
    result.message += "; warning: " + unload.detail;
    logger->warn("{}", unload.detail);
  }
  last_swap = result;
  return result;
}

SwapResult PolicyHost::Impl::replace_quarantined(SwapResult result, std::optional<std::int64_t> first_step) {
  const std::string retired_label = active->label();
  detail::abandon(active);
  active = std::move(pending);
  start_watchdog();
  result.outcome = SwapResult::Outcome::swapped;
  result.first_step = first_step;
  first_step_unknown = !first_step;
  result.old_library_unloaded = false;
  result.message = fmt::format("hot swap: {} replaced the quarantined {} without its state ({})", active->label(),
                               retired_label, quarantine);
  quarantine.clear();
  logger->warn("{}", result.message);
  last_swap = result;
  return result;
}

SwapResult PolicyHost::request_swap(const std::filesystem::path& plugin_file, std::optional<PolicyConfig> config) {
  if (impl_->pending) {
    impl_->logger->info("hot swap: the request for {} replaces the pending swap to {}", plugin_file,
                        impl_->pending->file());
    impl_->pending->close();
    impl_->pending.reset();
  }
  return impl_->stage_swap(plugin_file, std::move(config));
}

std::vector<std::uint8_t> PolicyHost::export_state() const {
  impl_->require_between_steps("export_state");
  if (!impl_->quarantine.empty()) {
    throw PluginError(
        fmt::format("the policy state cannot be exported: the plugin is quarantined ({})", impl_->quarantine));
  }
  std::string error;
  std::optional<std::vector<std::uint8_t>> blob = impl_->export_active_state(error);
  if (!blob) throw PluginError(error);
  return std::move(*blob);
}

bool PolicyHost::import_state(const std::vector<std::uint8_t>& blob) {
  impl_->require_between_steps("import_state");
  if (!impl_->quarantine.empty()) {
    impl_->logger->error("policy state not imported: the plugin is quarantined ({})", impl_->quarantine);
    return false;
  }
  const sp_status status = [&] {
    const detail::PluginCallScope scope(impl_->active->label(), "import_state");
    return impl_->active->table().import_state(impl_->active->ctx(), blob.data(), blob.size());
  }();
  if (status == SP_OK) return true;
  impl_->logger->error("policy plugin {} rejected a {}-byte state with {}: {}", impl_->active->label(), blob.size(),
                       detail::status_text(status), impl_->active->last_error());
  return false;
}

SwapResult PolicyHost::swap_now(const std::filesystem::path& plugin_file, std::optional<PolicyConfig> config) {
  impl_->require_between_steps("swap_now");
  SwapResult staged = request_swap(plugin_file, std::move(config));
  if (staged.outcome == SwapResult::Outcome::failed) return staged;
  return impl_->apply_pending_swap(std::nullopt);
}

const std::optional<SwapResult>& PolicyHost::last_swap_result() const { return impl_->last_swap; }
bool PolicyHost::swap_pending() const { return impl_->pending != nullptr; }

std::optional<SwapResult> PolicyHost::cancel_swap(const std::string& why) {
  if (!impl_->pending) return std::nullopt;
  impl_->logger->warn("hot swap to {} cancelled, {} stays: {}", impl_->pending->label(), impl_->active->label(), why);
  impl_->pending.reset();
  SwapResult result = impl_->pending_result;
  result.outcome = SwapResult::Outcome::failed;
  result.message = why;
  impl_->last_swap = result;
  return result;
}

}  // namespace sp::host
