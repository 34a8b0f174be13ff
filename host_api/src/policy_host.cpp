#include <sp/host/policy_host.h>

#include "abi_minor.h"
#include "plugin_call_scope.h"
#include "policy_host_impl.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "sp/precision_abi.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace sp::host {
namespace {

std::string mask_text(sp_precision_mask mask) {
  std::string text;
  for (const RouteTraits& route : kRouteTraits) {
    if (!detail::in_mask(mask, route.abi_code)) continue;
    if (!text.empty()) text += ", ";
    text += route.abi_name;
  }
  return text;
}

bool is_valid_sensitivity(double sensitivity) {
  return std::isnan(sensitivity) || (sensitivity >= 0.0 && sensitivity <= 1.0);
}

// Empty when the hints keep the ABI contract of the plugin's minor and name only precisions
// the host supports, otherwise what is wrong with the first bad one.
std::string hint_contract_violation(const std::vector<sp_hint_v1>& hints, const detail::AbiMinorLayout& plugin_abi,
                                    sp_precision_mask supported) {
  const sp_precision_mask defined = plugin_abi.precisions;
  for (std::size_t i = 0; i < hints.size(); ++i) {
    const sp_hint_v1& hint = hints[i];
    if (hint.block_id != i) {
      return fmt::format("hints[{}].block_id is {}, expected {}", i, hint.block_id, i);
    }
    if (!detail::in_mask(defined, hint.precision)) {
      return fmt::format("hints[{}].precision is {} ({}), which plugin ABI {}.{} does not define; expected one of {}",
                         i, hint.precision, detail::precision_name(hint.precision), SP_PLUGIN_ABI_MAJOR,
                         plugin_abi.minor, mask_text(defined & supported));
    }
    if (!detail::in_mask(supported, hint.precision)) {
      return fmt::format("hints[{}].precision is {} ({}), which this host does not support; expected one of {}", i,
                         hint.precision, detail::precision_name(hint.precision), mask_text(defined & supported));
    }
    if (!is_valid_sensitivity(hint.sensitivity)) {
      return fmt::format("hints[{}].sensitivity is {}, expected a value in [0, 1] or NaN", i, hint.sensitivity);
    }
  }
  return {};
}

}  // namespace

std::uint64_t HookFailureCounts::total() const {
  return begin_step + post_backward + compute_hints + invalid_hints + end_step + set_calibration_errors +
         set_unit_signals + budget_queries + initial_hints + allocation_measurements;
}

std::string PolicyHost::Impl::now_text() const {
  return open_step         ? fmt::format("during step {}", *open_step)
         : last_ended_step ? fmt::format("after step {}", *last_ended_step)
                           : std::string("before the first step");
}

void PolicyHost::Impl::require_open_step(const char* hook, std::int64_t step) const {
  if (open_step != step) {
    throw std::logic_error(
        open_step
            ? fmt::format("PolicyHost::{}({}) called while step {} is open", hook, step, *open_step)
            : fmt::format("PolicyHost::{}({}) called outside a step; call begin_step({}) first", hook, step, step));
  }
}

sp_status PolicyHost::Impl::supervised(const char* hook, std::int64_t step, std::function<sp_status()> call) {
  if (!quarantine.empty()) return SP_ERR_INTERNAL;
  const detail::PluginCallScope scope(active->label(), hook, step);
  if (!watchdog) return call();
  if (const std::optional<sp_status> status = watchdog->run(std::move(call))) return *status;
  quarantine = fmt::format("{} did not return from {} at step {} within {} ms", active->label(), hook, step,
                           watchdog->deadline().count());
  logger->error(
      "policy plugin {}; it is quarantined: its hooks are no longer called and the steps go on with "
      "fallback hints until a new version is swapped in",
      quarantine);
  return SP_ERR_INTERNAL;
}

void PolicyHost::Impl::start_watchdog() {
  // An abandoned supervisor keeps its thread (and the plugin it is stuck in) alive.
  if (watchdog && watchdog->abandoned()) detail::abandon(watchdog);
  watchdog = options.hook_deadline.count() > 0 ? std::make_unique<HookWatchdog>(options.hook_deadline) : nullptr;
}

bool PolicyHost::Impl::check_hook(const char* hook, std::string_view when, sp_status status,
                                  std::uint64_t& failure_count) {
  if (status == SP_OK) return true;
  ++failure_count;
  if (!quarantine.empty()) {
    // Logged once, when it happened; the plugin itself must not be asked (it may hold a lock).
    logger->debug("policy plugin {} skipped in {} {}: quarantined", active->label(), hook, when);
    return false;
  }
  logger->error("policy plugin {} failed in {} {} with {}: {}", active->label(), hook, when,
                detail::status_text(status), active->last_error());
  return false;
}

bool PolicyHost::Impl::check_hook(const char* hook, std::int64_t step, sp_status status, std::uint64_t& failure_count) {
  return check_hook(hook, fmt::format("at step {}", step), status, failure_count);
}

void PolicyHost::Impl::use_fallback_hints(std::int64_t step) {
  if (options.fallback == FallbackMode::last_good && !last_good_hints.empty()) {
    hints = last_good_hints;
    for (sp_hint_v1& hint : hints) hint.reason = SP_REASON_HOST_FALLBACK;
  } else {
    hints.assign(blocks.size(), sp_hint_v1{});
    for (std::uint32_t id = 0; id < block_count(); ++id) {
      hints[id] =
          sp_hint_v1{id, SP_PRECISION_BF16, std::numeric_limits<double>::quiet_NaN(), SP_REASON_HOST_FALLBACK, 0};
    }
  }
  hint_source = HintSource::fallback;
  logger->warn("step {}: using {} hints instead of the plugin's", step,
               options.fallback == FallbackMode::last_good && !last_good_hints.empty() ? "the last good" : "all-BF16");
}

PolicyHost::PolicyHost(const std::filesystem::path& plugin_file, PolicyConfig config,
                       std::vector<BlockDescription> blocks, PolicyHostOptions options)
    : impl_(std::make_unique<Impl>()) {
  if (blocks.size() > std::numeric_limits<std::uint32_t>::max()) {
    throw std::invalid_argument(
        fmt::format("PolicyHost: {} blocks exceed the ABI's 32-bit block count", blocks.size()));
  }
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    if (blocks[i].id != i) {
      throw std::invalid_argument(
          fmt::format("PolicyHost: block {} has id {}; ids must run 0..n-1 in order", i, blocks[i].id));
    }
  }
  const sp_precision_mask known = detail::abi_minor_layout(SP_PLUGIN_ABI_MINOR).precisions;
  if (!detail::in_mask(options.supported_precisions, SP_PRECISION_BF16) ||
      (options.supported_precisions & ~known) != 0) {
    throw std::invalid_argument(fmt::format(
        "PolicyHost: supported_precisions is {:#x}; it must contain SP_PRECISION_BIT(SP_PRECISION_BF16) and no "
        "bits but those of {} ({:#x})",
        options.supported_precisions, mask_text(known), known));
  }
  impl_->logger = options.logger ? options.logger : spdlog::default_logger();
  impl_->options = std::move(options);
  impl_->blocks = std::move(blocks);
  impl_->active = detail::PluginInstance::create(PluginLibrary::load(plugin_file), std::move(config), impl_->blocks,
                                                 impl_->options, impl_->logger);
  impl_->start_watchdog();
}

PolicyHost::~PolicyHost() {
  if (impl_->pending) impl_->pending->close();
  if (!impl_->quarantine.empty()) {
    // Its supervisor's thread may still be inside the plugin: neither is destroyed.
    impl_->logger->warn("policy plugin {} is left loaded: it is quarantined ({})", impl_->active->label(),
                        impl_->quarantine);
    detail::abandon(impl_->active);
    detail::abandon(impl_->watchdog);
    return;
  }
  const UnloadReport unload = impl_->active->close();
  if (!unload.unloaded) impl_->logger->warn("{}", unload.detail);
}

void PolicyHost::begin_step(std::int64_t step) {
  if (impl_->open_step) {
    throw std::logic_error(
        fmt::format("PolicyHost::begin_step({}) called while step {} is open; call end_step({}) first", step,
                    *impl_->open_step, *impl_->open_step));
  }
  if (impl_->pending) {
    impl_->apply_pending_swap(step);
  } else if (impl_->first_step_unknown && impl_->last_swap) {
    impl_->last_swap->first_step = step;
    impl_->first_step_unknown = false;
  }
  impl_->open_step = step;
  const sp_policy_plugin_v1_table& table = impl_->active->table();
  sp_policy_ctx* ctx = impl_->active->ctx();
  impl_->check_hook("begin_step", step,
                    impl_->supervised("begin_step", step, [&table, ctx, step] { return table.begin_step(ctx, step); }),
                    impl_->failures.begin_step);
}

void PolicyHost::post_backward(std::int64_t step, const std::vector<sp_grad_moments_v1>& moments) {
  impl_->require_open_step("post_backward", step);
  if (moments.size() > impl_->blocks.size()) {
    throw std::invalid_argument(fmt::format("PolicyHost::post_backward({}): {} moments for {} blocks", step,
                                            moments.size(), impl_->blocks.size()));
  }
  const sp_policy_plugin_v1_table& table = impl_->active->table();
  sp_policy_ctx* ctx = impl_->active->ctx();
  // The call owns its copy: an abandoned call may still read it after this returns.
  auto copy = std::make_shared<const std::vector<sp_grad_moments_v1>>(moments);
  impl_->check_hook("post_backward", step,
                    impl_->supervised("post_backward", step,
                                      [&table, ctx, step, copy] {
                                        return table.post_backward(ctx, step, copy->data(),
                                                                   static_cast<std::uint32_t>(copy->size()));
                                      }),
                    impl_->failures.post_backward);
}

const std::vector<sp_hint_v1>& PolicyHost::compute_hints(std::int64_t step) {
  impl_->require_open_step("compute_hints", step);
  Impl& impl = *impl_;
  const sp_policy_plugin_v1_table& table = impl.active->table();
  sp_policy_ctx* ctx = impl.active->ctx();
  // Written by the call into a buffer it owns: an abandoned call may write it later.
  auto buffer = std::make_shared<std::vector<sp_hint_v1>>(impl.blocks.size(), sp_hint_v1{});
  const std::uint32_t n = impl.block_count();
  const sp_status status = impl.supervised("compute_hints", step, [&table, ctx, step, buffer, n] {
    return table.compute_hints(ctx, step, buffer->data(), n);
  });
  if (status == SP_OK) impl.plugin_hints = *buffer;
  if (!impl.check_hook("compute_hints", step, status, impl.failures.compute_hints)) {
    impl.use_fallback_hints(step);
    return impl.hints;
  }
  const std::string violation =
      hint_contract_violation(impl.plugin_hints, impl.active->abi(), impl.options.supported_precisions);
  if (!violation.empty()) {
    ++impl.failures.invalid_hints;
    impl.logger->error("policy plugin {} returned invalid hints at step {}: {}", impl.active->label(), step, violation);
    impl.use_fallback_hints(step);
    return impl.hints;
  }
  impl.hints.swap(impl.plugin_hints);
  if (impl.options.fallback == FallbackMode::last_good) impl.last_good_hints = impl.hints;
  impl.hint_source = HintSource::plugin;
  return impl.hints;
}

void PolicyHost::end_step(std::int64_t step, const sp_step_feedback_v1* feedback) {
  impl_->require_open_step("end_step", step);
  std::optional<sp_step_feedback_v1> stamped;
  if (feedback != nullptr) {
    stamped = *feedback;
    stamped->struct_size = impl_->active->abi().step_feedback_size;
  }
  const sp_policy_plugin_v1_table& table = impl_->active->table();
  sp_policy_ctx* ctx = impl_->active->ctx();
  auto copy = std::make_shared<const std::optional<sp_step_feedback_v1>>(stamped);
  impl_->check_hook("end_step", step,
                    impl_->supervised("end_step", step,
                                      [&table, ctx, step, copy] {
                                        return table.end_step(ctx, step, copy->has_value() ? &**copy : nullptr);
                                      }),
                    impl_->failures.end_step);
  impl_->open_step.reset();
  impl_->last_ended_step = step;
}

bool PolicyHost::set_calibration_errors(const std::vector<std::uint32_t>& block_ids,
                                        const std::vector<double>& errors) {
  return set_calibration_errors(SP_PRECISION_INT8, block_ids, errors);
}

bool PolicyHost::set_calibration_errors(sp_precision precision, const std::vector<std::uint32_t>& block_ids,
                                        const std::vector<double>& errors) {
  if (block_ids.size() != errors.size()) {
    throw std::invalid_argument(
        fmt::format("PolicyHost::set_calibration_errors: {} block ids but {} errors", block_ids.size(), errors.size()));
  }
  const std::optional<Precision> route = from_abi(precision);
  if (!route || !is_quantized(*route)) {
    const std::string quantized =
        list_routes([](const RouteTraits& r) { return std::string(r.abi_name); }, /*quantized_only=*/true);
    throw std::invalid_argument(
        fmt::format("PolicyHost::set_calibration_errors: precision {} ({}); calibration errors exist for {} only",
                    precision, detail::precision_name(precision), quantized));
  }
  const char* label = route_traits(*route).label;
  Impl& impl = *impl_;
  if (!impl.quarantine.empty()) {
    impl.logger->error("calibration errors not set: the plugin is quarantined ({})", impl.quarantine);
    return false;
  }
  detail::PluginInstance& active = *impl.active;
  const auto n = static_cast<std::uint32_t>(block_ids.size());
  // ABI 1.0's quantized route (INT8) has 1.0's own hook, and its errors travel in the state blob.
  if (detail::in_mask(detail::abi_minor_layout(0).precisions, precision)) {
    const sp_status status = [&] {
      const detail::PluginCallScope scope(active.label(), "set_calibration_errors");
      return active.table().set_calibration_errors(active.ctx(), block_ids.data(), errors.data(), n);
    }();
    return impl.check_hook("set_calibration_errors", impl.now_text(), status, impl.failures.set_calibration_errors);
  }
  bool accepted = true;
  if (active.abi().has_precision_routes) {
    const sp_status status = [&] {
      const detail::PluginCallScope scope(active.label(), "set_precision_calibration_errors");
      return active.table().set_precision_calibration_errors(active.ctx(), precision, block_ids.data(), errors.data(),
                                                             n);
    }();
    accepted = impl.check_hook("set_precision_calibration_errors", fmt::format("({}) {}", label, impl.now_text()),
                               status, impl.failures.set_calibration_errors);
  } else {
    // Checked here as the plugin would, so that a later 1.1 plugin is not handed ids it must reject.
    for (std::uint32_t i = 0; i < n; ++i) {
      if (block_ids[i] >= impl.block_count()) {
        ++impl.failures.set_calibration_errors;
        impl.logger->error("{} calibration errors {}: block_ids[{}] is {}, but there are {} blocks", label,
                           impl.now_text(), i, block_ids[i], impl.block_count());
        return false;
      }
    }
    impl.logger->debug(
        "policy plugin {} implements ABI 1.0, which has no {}: its {} calibration errors of {} "
        "blocks are kept for a later 1.1 plugin, not sent",
        active.label(), label, label, n);
  }
  if (accepted) {
    for (std::uint32_t i = 0; i < n; ++i) impl.kept_calibration_errors[*route][block_ids[i]] = errors[i];
  }
  return accepted;
}

sp_status PolicyHost::Impl::send_unit_signals(detail::PluginInstance& instance, std::int64_t step,
                                              const UnitSignalTable& table) {
  std::vector<const char*> names;
  names.reserve(table.names.size());
  for (const std::string& name : table.names) names.push_back(name.c_str());
  const sp_unit_signals_v1 signals{static_cast<std::uint32_t>(sizeof(sp_unit_signals_v1)),
                                   block_count(),
                                   static_cast<std::uint32_t>(table.names.size()),
                                   0,
                                   names.data(),
                                   table.values.data(),
                                   table.loss,
                                   table.samples};
  const detail::PluginCallScope scope(instance.label(), "set_unit_signals");
  return instance.table().set_unit_signals(instance.ctx(), step, &signals);
}

bool PolicyHost::set_unit_signals(std::int64_t step, const UnitSignalTable& table) {
  Impl& impl = *impl_;
  if (table.names.size() > std::numeric_limits<std::uint32_t>::max() ||
      table.values.size() != table.names.size() * impl.block_count()) {
    throw std::invalid_argument(fmt::format(
        "PolicyHost::set_unit_signals: {} values for {} blocks x {} columns", table.values.size(),
        impl.block_count(), table.names.size()));
  }
  if (!impl.quarantine.empty()) {
    impl.logger->error("signal table not set: the plugin is quarantined ({})", impl.quarantine);
    return false;
  }
  detail::PluginInstance& active = *impl.active;
  if (!active.abi().has_unit_signals) {
    impl.logger->debug("policy plugin {} implements ABI 1.{}, which has no signal table: the table of step {} is kept "
                       "for a later 1.2 plugin, not sent",
                       active.label(), active.abi_minor(), step);
    impl.unit_signals.emplace(step, table);
    return true;
  }
  const sp_status status = impl.send_unit_signals(active, step, table);
  if (!impl.check_hook("set_unit_signals", fmt::format("(step {}) {}", step, impl.now_text()), status,
                       impl.failures.set_unit_signals)) {
    return false;
  }
  impl.unit_signals.emplace(step, table);
  return true;
}

bool PolicyHost::Impl::query(const char* function, const std::function<sp_status(detail::PluginInstance&)>& call) {
  if (!quarantine.empty() || !active->abi().has_unit_signals) return false;
  const sp_status status = [&] {
    const detail::PluginCallScope scope(active->label(), function);
    return call(*active);
  }();
  return check_hook(function, now_text(), status, failures.budget_queries);
}

std::optional<std::vector<double>> PolicyHost::unit_costs(sp_precision precision) {
  std::vector<double> costs(impl_->block_count());
  const bool answered = impl_->query("get_unit_costs", [&](detail::PluginInstance& plugin) {
    return plugin.table().get_unit_costs(plugin.ctx(), precision, costs.data(), impl_->block_count());
  });
  if (!answered) return std::nullopt;
  return costs;
}

std::optional<sp_budget_status_v1> PolicyHost::budget_status() {
  sp_budget_status_v1 status{};
  // What a plugin older than 1.4 leaves unwritten reads as the behaviour before 1.4.
  status.reads_step_signals = 1;
  const bool answered = impl_->query("get_budget_status", [&](detail::PluginInstance& plugin) {
    status.struct_size = plugin.abi().budget_status_size;
    return plugin.table().get_budget_status(plugin.ctx(), &status);
  });
  if (!answered) return std::nullopt;
  return status;
}

std::optional<std::vector<sp_hint_v1>> PolicyHost::initial_hints() {
  Impl& impl = *impl_;
  if (impl.open_step || impl.last_ended_step) {
    throw std::logic_error("PolicyHost::initial_hints: a step began already; compute_hints gives the hints now");
  }
  if (!impl.quarantine.empty() || !impl.active->abi().has_initial_hints) return std::nullopt;
  std::vector<sp_hint_v1> hints(impl.blocks.size(), sp_hint_v1{});
  const sp_status status = [&] {
    const detail::PluginCallScope scope(impl.active->label(), "initial_hints");
    return impl.active->table().initial_hints(impl.active->ctx(), hints.data(), impl.block_count());
  }();
  if (!impl.check_hook("initial_hints", impl.now_text(), status, impl.failures.initial_hints)) return std::nullopt;
  const std::string violation = hint_contract_violation(hints, impl.active->abi(), impl.options.supported_precisions);
  if (!violation.empty()) {
    ++impl.failures.initial_hints;
    impl.logger->error("policy plugin {} returned invalid initial hints: {}", impl.active->label(), violation);
    return std::nullopt;
  }
  impl.hints = hints;
  if (impl.options.fallback == FallbackMode::last_good) impl.last_good_hints = hints;
  impl.hint_source = HintSource::plugin;
  return hints;
}

const std::string& PolicyHost::quarantine_reason() const { return impl_->quarantine; }

HintSource PolicyHost::last_hint_source() const { return impl_->hint_source; }
const HookFailureCounts& PolicyHost::hook_failures() const { return impl_->failures; }
std::string_view PolicyHost::plugin_name() const { return impl_->active->name(); }
std::string_view PolicyHost::plugin_version() const { return impl_->active->version(); }
const std::filesystem::path& PolicyHost::plugin_file() const { return impl_->active->file(); }
std::uint32_t PolicyHost::block_count() const { return impl_->block_count(); }
std::uint32_t PolicyHost::plugin_abi_minor() const { return impl_->active->abi_minor(); }

}  // namespace sp::host
