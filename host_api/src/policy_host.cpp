#include <sp/host/policy_host.h>

#include "abi_minor.h"
#include "hook_watchdog.h"
#include "plugin_call_scope.h"

#include <fmt/format.h>
#include <fmt/std.h>
#include <spdlog/spdlog.h>

#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <stdexcept>
#include <utility>

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
namespace {

// A state blob larger than this is taken for a plugin bug, not a state: the swap fails and
// the old plugin stays instead of the host trying to allocate whatever it was told.
constexpr std::uint64_t kMaxStateBytes = std::uint64_t{1} << 30;

const char* status_name(sp_status status) {
  switch (status) {
    case SP_OK:
      return "SP_OK";
    case SP_ERR_INVALID_ARGUMENT:
      return "SP_ERR_INVALID_ARGUMENT";
    case SP_ERR_CONFIG:
      return "SP_ERR_CONFIG";
    case SP_ERR_STATE:
      return "SP_ERR_STATE";
    case SP_ERR_BUFFER_TOO_SMALL:
      return "SP_ERR_BUFFER_TOO_SMALL";
    case SP_ERR_INTERNAL:
      return "SP_ERR_INTERNAL";
    case SP_ERR_ORDER:
      return "SP_ERR_ORDER";
    default:
      return "an unknown status";
  }
}

std::string status_text(sp_status status) { return fmt::format("status {} ({})", status, status_name(status)); }

spdlog::level::level_enum to_spdlog_level(sp_log_level level) {
  switch (level) {
    case SP_LOG_DEBUG:
      return spdlog::level::debug;
    case SP_LOG_INFO:
      return spdlog::level::info;
    case SP_LOG_WARN:
      return spdlog::level::warn;
    default:
      return spdlog::level::err;
  }
}

sp_log_level to_abi_level(spdlog::level::level_enum level) {
  if (level <= spdlog::level::debug) return SP_LOG_DEBUG;
  if (level == spdlog::level::info) return SP_LOG_INFO;
  if (level == spdlog::level::warn) return SP_LOG_WARN;
  return SP_LOG_ERROR;
}

// Where one plugin instance's log messages go. Heap-allocated so that the address the
// plugin holds as log_user_data stays valid while the instance moves around.
struct LogRoute {
  std::shared_ptr<spdlog::logger> logger;
  std::string label;
};

void forward_plugin_log(void* user_data, sp_log_level level, const char* message) noexcept {
  try {
    const auto* route = static_cast<const LogRoute*>(user_data);
    route->logger->log(to_spdlog_level(level), "[{}] {}", route->label, message != nullptr ? message : "");
  } catch (...) {
    // The ABI forbids exceptions from crossing back into the plugin; a lost log line is
    // the lesser harm.
  }
}

const char* precision_name(sp_precision precision) {
  switch (precision) {
    case SP_PRECISION_BF16:
      return "SP_PRECISION_BF16";
    case SP_PRECISION_INT8:
      return "SP_PRECISION_INT8";
    case SP_PRECISION_NF4:
      return "SP_PRECISION_NF4";
    default:
      return "an unknown precision";
  }
}

bool in_mask(sp_precision_mask mask, sp_precision precision) {
  return precision >= 0 && precision < 32 && (mask & SP_PRECISION_BIT(precision)) != 0;
}

std::string mask_text(sp_precision_mask mask) {
  std::string text;
  for (const sp_precision precision : {SP_PRECISION_BF16, SP_PRECISION_INT8, SP_PRECISION_NF4}) {
    if (!in_mask(mask, precision)) continue;
    if (!text.empty()) text += ", ";
    text += precision_name(precision);
  }
  return text;
}

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

// A plugin library with one live context created from it.
class PluginInstance {
 public:
  static std::unique_ptr<PluginInstance> create(PluginLibrary library, PolicyConfig config,
                                                const std::vector<BlockDescription>& blocks,
                                                const PolicyHostOptions& options,
                                                const std::shared_ptr<spdlog::logger>& logger) {
    std::unique_ptr<PluginInstance> instance(new PluginInstance(std::move(library), std::move(config)));
    instance->log_route_ = std::make_unique<LogRoute>(
        LogRoute{logger, fmt::format("{} {}", instance->library_.plugin_name(), instance->library_.plugin_version())});

    std::vector<sp_block_desc_v1> descs;
    descs.reserve(blocks.size());
    for (const BlockDescription& block : blocks) {
      descs.push_back(sp_block_desc_v1{sizeof(sp_block_desc_v1), block.id, block.num_params, block.bf16_bytes,
                                       block.int8_bytes, block.name.empty() ? nullptr : block.name.c_str()});
    }
    const std::string output_dir = options.output_dir.string();
    const detail::AbiMinorLayout& abi = instance->abi();
    sp_host_api_v1 host{};
    host.struct_size = abi.host_api_size;
    host.abi_major = SP_PLUGIN_ABI_MAJOR;
    host.abi_minor = SP_PLUGIN_ABI_MINOR;
    host.host_name = options.host_name.c_str();
    host.host_version = SP_HOST_VERSION;
    host.output_dir = output_dir.empty() ? nullptr : output_dir.c_str();
    host.log = &forward_plugin_log;
    host.log_user_data = instance->log_route_.get();
    host.min_log_level = to_abi_level(logger->level());
    if (abi.has_precision_routes) host.supported_precisions = options.supported_precisions;

    const sp_policy_plugin_v1_table& table = instance->table();
    sp_policy_ctx* ctx = nullptr;
    const sp_status status = [&] {
      const detail::PluginCallScope scope(instance->log_route_->label, "create");
      return table.create(&host, instance->config_.text.c_str(), descs.data(),
                          static_cast<std::uint32_t>(descs.size()), &ctx);
    }();
    if (status != SP_OK || ctx == nullptr) {
      const std::string reason =
          status != SP_OK ? fmt::format("{}: {}", status_text(status), safe_message(table.last_error(nullptr)))
                          : std::string("create() returned SP_OK but no context");
      if (ctx != nullptr) {
        const detail::PluginCallScope scope(instance->log_route_->label, "destroy");
        table.destroy(ctx);
      }
      throw PluginError(fmt::format("{}: policy plugin {} ({}) rejected the configuration: {}",
                                    instance->config_.source_name, instance->log_route_->label,
                                    instance->library_.source_path(), reason));
    }
    instance->ctx_ = ctx;

    // sp_block_desc_v1 is frozen, so the NF4 sizes travel through set_transfer_bytes, before
    // anything else reaches the new context (a swap's import_state included).
    if (abi.has_precision_routes && in_mask(options.supported_precisions, SP_PRECISION_NF4)) {
      std::vector<std::uint64_t> nf4_bytes;
      nf4_bytes.reserve(blocks.size());
      for (const BlockDescription& block : blocks) nf4_bytes.push_back(block.nf4_bytes);
      const sp_status bytes_status = [&] {
        const detail::PluginCallScope scope(instance->log_route_->label, "set_transfer_bytes");
        return table.set_transfer_bytes(ctx, SP_PRECISION_NF4, nf4_bytes.data(),
                                        static_cast<std::uint32_t>(nf4_bytes.size()));
      }();
      if (bytes_status != SP_OK) {
        const std::string reason = fmt::format("{}: {}", status_text(bytes_status), instance->last_error());
        // The destructor destroys the context and unloads the library.
        throw PluginError(fmt::format(
            "{}: policy plugin {} ({}) rejected the NF4 transfer bytes of its {} blocks (set_transfer_bytes): {}",
            instance->config_.source_name, instance->log_route_->label, instance->library_.source_path(),
            nf4_bytes.size(), reason));
      }
    }
    return instance;
  }

  PluginInstance(const PluginInstance&) = delete;
  PluginInstance& operator=(const PluginInstance&) = delete;
  ~PluginInstance() { close(); }

  // Destroys the context, then unloads the library and reports whether it really left.
  UnloadReport close() {
    if (ctx_ != nullptr) {
      const sp_status status = [&] {
        const detail::PluginCallScope scope(log_route_->label, "destroy");
        return table().destroy(ctx_);
      }();
      if (status != SP_OK) {
        log_route_->logger->warn("policy plugin {}: destroy() returned {}", log_route_->label, status_text(status));
      }
      ctx_ = nullptr;
    }
    return library_.unload();
  }

  const sp_policy_plugin_v1_table& table() const { return library_.table(); }
  sp_policy_ctx* ctx() const { return ctx_; }
  std::string last_error() const { return safe_message(table().last_error(ctx_)); }
  const std::string& label() const { return log_route_->label; }
  std::string_view version() const { return library_.plugin_version(); }
  std::string_view name() const { return library_.plugin_name(); }
  const std::filesystem::path& file() const { return library_.source_path(); }
  std::uint32_t abi_minor() const { return library_.abi_minor(); }
  const detail::AbiMinorLayout& abi() const { return *abi_; }
  const PolicyConfig& config() const { return config_; }

 private:
  PluginInstance(PluginLibrary library, PolicyConfig config)
      : library_(std::move(library)),
        config_(std::move(config)),
        abi_(&detail::abi_minor_layout(library_.abi_minor())) {}

  static std::string safe_message(const char* message) {
    return message != nullptr ? message : "(the plugin gave no message)";
  }

  PluginLibrary library_;
  PolicyConfig config_;
  const detail::AbiMinorLayout* abi_;
  std::unique_ptr<LogRoute> log_route_;
  sp_policy_ctx* ctx_ = nullptr;
};

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
    if (!in_mask(defined, hint.precision)) {
      return fmt::format("hints[{}].precision is {} ({}), which plugin ABI {}.{} does not define; expected one of {}",
                         i, hint.precision, precision_name(hint.precision), SP_PLUGIN_ABI_MAJOR, plugin_abi.minor,
                         mask_text(defined & supported));
    }
    if (!in_mask(supported, hint.precision)) {
      return fmt::format("hints[{}].precision is {} ({}), which this host does not support; expected one of {}", i,
                         hint.precision, precision_name(hint.precision), mask_text(defined & supported));
    }
    if (!is_valid_sensitivity(hint.sensitivity)) {
      return fmt::format("hints[{}].sensitivity is {}, expected a value in [0, 1] or NaN", i, hint.sensitivity);
    }
  }
  return {};
}

}  // namespace

std::uint64_t HookFailureCounts::total() const {
  return begin_step + post_backward + compute_hints + invalid_hints + end_step + set_calibration_errors;
}

struct PolicyHost::Impl {
  PolicyHostOptions options;
  std::shared_ptr<spdlog::logger> logger;
  std::vector<BlockDescription> blocks;
  std::unique_ptr<PluginInstance> active;
  std::unique_ptr<PluginInstance> pending;
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
  // NF4 calibration errors the caller gave, by block (later calls replace earlier values).
  // A 1.0 plugin cannot take them and its state blob cannot carry them, so a 1.1 plugin that
  // a swap brings in after a 1.0 one receives them from here. INT8 errors travel in the
  // state blob, as they always have, and are not kept.
  std::map<std::uint32_t, double> nf4_calibration_errors;

  std::uint32_t block_count() const { return static_cast<std::uint32_t>(blocks.size()); }

  std::string now_text() const {
    return open_step         ? fmt::format("during step {}", *open_step)
           : last_ended_step ? fmt::format("after step {}", *last_ended_step)
                             : std::string("before the first step");
  }

  // Hands the kept NF4 errors to `instance`, a 1.1 plugin. True when it took them (or there
  // were none); otherwise logs the plugin's reason and counts it.
  bool resend_nf4_calibration_errors(PluginInstance& instance) {
    if (nf4_calibration_errors.empty()) return true;
    std::vector<std::uint32_t> ids;
    std::vector<double> errors;
    for (const auto& [id, error] : nf4_calibration_errors) {
      ids.push_back(id);
      errors.push_back(error);
    }
    const sp_status status = [&] {
      const detail::PluginCallScope scope(instance.label(), "set_precision_calibration_errors");
      return instance.table().set_precision_calibration_errors(instance.ctx(), SP_PRECISION_NF4, ids.data(),
                                                               errors.data(), static_cast<std::uint32_t>(ids.size()));
    }();
    if (status == SP_OK) {
      logger->debug("policy plugin {}: re-sent the NF4 calibration errors of {} blocks", instance.label(), ids.size());
      return true;
    }
    ++failures.set_calibration_errors;
    logger->error(
        "policy plugin {} failed in set_precision_calibration_errors (NF4 errors of {} blocks, re-sent "
        "after a hot swap from an ABI 1.0 plugin) with {}: {}",
        instance.label(), ids.size(), status_text(status), instance.last_error());
    return false;
  }

  void require_open_step(const char* hook, std::int64_t step) const {
    if (open_step != step) {
      throw std::logic_error(
          open_step
              ? fmt::format("PolicyHost::{}({}) called while step {} is open", hook, step, *open_step)
              : fmt::format("PolicyHost::{}({}) called outside a step; call begin_step({}) first", hook, step, step));
    }
  }

  // A step hook, under the deadline when there is one. A quarantined plugin is not called; a
  // hook that passes the deadline quarantines it. Either way the hook counts as failed.
  sp_status supervised(const char* hook, std::int64_t step, std::function<sp_status()> call) {
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

  void start_watchdog() {
    // An abandoned supervisor keeps its thread (and the plugin it is stuck in) alive.
    if (watchdog && watchdog->abandoned()) abandon(watchdog);
    watchdog = options.hook_deadline.count() > 0 ? std::make_unique<HookWatchdog>(options.hook_deadline) : nullptr;
  }

  // True when the hook succeeded; otherwise logs the plugin's reason and counts it.
  bool check_hook(const char* hook, std::string_view when, sp_status status, std::uint64_t& failure_count) {
    if (status == SP_OK) return true;
    ++failure_count;
    if (!quarantine.empty()) {
      // Logged once, when it happened; the plugin itself must not be asked (it may hold a lock).
      logger->debug("policy plugin {} skipped in {} {}: quarantined", active->label(), hook, when);
      return false;
    }
    logger->error("policy plugin {} failed in {} {} with {}: {}", active->label(), hook, when, status_text(status),
                  active->last_error());
    return false;
  }

  bool check_hook(const char* hook, std::int64_t step, sp_status status, std::uint64_t& failure_count) {
    return check_hook(hook, fmt::format("at step {}", step), status, failure_count);
  }

  void use_fallback_hints(std::int64_t step) {
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
    logger->warn(
        "step {}: using {} hints instead of the plugin's", step,
        options.fallback == FallbackMode::last_good && !last_good_hints.empty() ? "the last good" : "all-BF16");
  }

  SwapResult stage_swap(const std::filesystem::path& plugin_file, std::optional<PolicyConfig> config) {
    SwapResult result;
    result.plugin_file = plugin_file;
    result.old_version = std::string(active->version());
    try {
      PluginLibrary library = PluginLibrary::load(plugin_file);
      result.new_version = std::string(library.plugin_version());
      pending = PluginInstance::create(std::move(library), config ? std::move(*config) : active->config(), blocks,
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

  void require_between_steps(const char* call) const {
    if (open_step) {
      throw std::logic_error(
          fmt::format("PolicyHost::{} called inside step {}; call it between steps", call, *open_step));
    }
  }

  SwapResult fail_swap(SwapResult result, std::string_view reason) {
    if (pending) pending->close();
    pending.reset();
    result.outcome = SwapResult::Outcome::failed;
    result.message =
        fmt::format("hot swap to {} failed; {} stays active: {}", result.plugin_file, active->label(), reason);
    logger->error("{}", result.message);
    last_swap = result;
    return result;
  }

  std::optional<std::vector<std::uint8_t>> export_active_state(std::string& error) {
    const sp_policy_plugin_v1_table& table = active->table();
    const detail::PluginCallScope scope(active->label(), "export_state");
    std::uint64_t size = 0;
    sp_status status = table.export_state(active->ctx(), nullptr, 0, &size);
    std::vector<std::uint8_t> blob;
    if (status == SP_OK && size != 0) {
      error = fmt::format("export_state of {} reported success for a {}-byte state without a buffer", active->label(),
                          size);
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
      error = fmt::format("export_state of {} failed with {}: {}", active->label(), status_text(status),
                          active->last_error());
      return std::nullopt;
    }
    return blob;
  }

  // Migrates the state into the pending instance and makes it active. The caller
  // guarantees a step boundary. Whatever goes wrong, the old plugin stays active.
  // `first_step` is the step about to begin, or nullopt for a swap between steps, whose
  // first step is recorded when it begins.
  SwapResult apply_pending_swap(std::optional<std::int64_t> first_step) {
    SwapResult result = pending_result;
    try {
      return migrate_and_switch(std::move(pending_result), first_step);
    } catch (const std::exception& error) {
      return fail_swap(std::move(result), error.what());
    }
  }

  SwapResult migrate_and_switch(SwapResult result, std::optional<std::int64_t> first_step) {
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
                                   active->label(), blob->size(), status_text(status), pending->last_error()));
    }

    // A 1.0 plugin held no NF4 calibration errors, so its blob brought none: the new 1.1
    // plugin gets the host's copy. A rejection is logged and counted like any rejected
    // calibration errors; it does not undo the swap.
    const bool resend_nf4 = !active->abi().has_precision_routes && pending->abi().has_precision_routes;
    const bool nf4_resent = !resend_nf4 || resend_nf4_calibration_errors(*pending);

    std::unique_ptr<PluginInstance> retired = std::exchange(active, std::move(pending));
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
    if (!nf4_resent) result.message += "; warning: the new plugin rejected the NF4 calibration errors (see the log)";
    if (!unload.unloaded) {
      result.message += "; warning: " + unload.detail;
      logger->warn("{}", unload.detail);
    }
    last_swap = result;
    return result;
  }

  // The quarantined plugin cannot hand over its state (it is stuck in a hook): the new version
  // starts fresh, and the old one is left loaded, since its thread may still run its code.
  SwapResult replace_quarantined(SwapResult result, std::optional<std::int64_t> first_step) {
    const std::string retired_label = active->label();
    abandon(active);
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
};

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
  if (!in_mask(options.supported_precisions, SP_PRECISION_BF16) || (options.supported_precisions & ~known) != 0) {
    throw std::invalid_argument(fmt::format(
        "PolicyHost: supported_precisions is {:#x}; it must contain SP_PRECISION_BIT(SP_PRECISION_BF16) and no "
        "bits but those of BF16, INT8 and NF4 ({:#x})",
        options.supported_precisions, known));
  }
  impl_->logger = options.logger ? options.logger : spdlog::default_logger();
  impl_->options = std::move(options);
  impl_->blocks = std::move(blocks);
  impl_->active = PluginInstance::create(PluginLibrary::load(plugin_file), std::move(config), impl_->blocks,
                                         impl_->options, impl_->logger);
  impl_->start_watchdog();
}

PolicyHost::~PolicyHost() {
  if (impl_->pending) impl_->pending->close();
  if (!impl_->quarantine.empty()) {
    // Its supervisor's thread may still be inside the plugin: neither is destroyed.
    impl_->logger->warn("policy plugin {} is left loaded: it is quarantined ({})", impl_->active->label(),
                        impl_->quarantine);
    abandon(impl_->active);
    abandon(impl_->watchdog);
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
  if (precision != SP_PRECISION_INT8 && precision != SP_PRECISION_NF4) {
    throw std::invalid_argument(fmt::format(
        "PolicyHost::set_calibration_errors: precision {} ({}); calibration errors exist for SP_PRECISION_INT8 and "
        "SP_PRECISION_NF4 only",
        precision, precision_name(precision)));
  }
  Impl& impl = *impl_;
  if (!impl.quarantine.empty()) {
    impl.logger->error("calibration errors not set: the plugin is quarantined ({})", impl.quarantine);
    return false;
  }
  PluginInstance& active = *impl.active;
  const auto n = static_cast<std::uint32_t>(block_ids.size());
  if (precision == SP_PRECISION_INT8) {
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
      return active.table().set_precision_calibration_errors(active.ctx(), SP_PRECISION_NF4, block_ids.data(),
                                                             errors.data(), n);
    }();
    accepted = impl.check_hook("set_precision_calibration_errors", fmt::format("(NF4) {}", impl.now_text()), status,
                               impl.failures.set_calibration_errors);
  } else {
    // Checked here as the plugin would, so that a later 1.1 plugin is not handed ids it must reject.
    for (std::uint32_t i = 0; i < n; ++i) {
      if (block_ids[i] >= impl.block_count()) {
        ++impl.failures.set_calibration_errors;
        impl.logger->error("NF4 calibration errors {}: block_ids[{}] is {}, but there are {} blocks", impl.now_text(),
                           i, block_ids[i], impl.block_count());
        return false;
      }
    }
    impl.logger->debug(
        "policy plugin {} implements ABI 1.0, which has no NF4: its NF4 calibration errors of {} "
        "blocks are kept for a later 1.1 plugin, not sent",
        active.label(), n);
  }
  if (accepted) {
    for (std::uint32_t i = 0; i < n; ++i) impl.nf4_calibration_errors[block_ids[i]] = errors[i];
  }
  return accepted;
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
                       status_text(status), impl_->active->last_error());
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

const std::string& PolicyHost::quarantine_reason() const { return impl_->quarantine; }

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
HintSource PolicyHost::last_hint_source() const { return impl_->hint_source; }
const HookFailureCounts& PolicyHost::hook_failures() const { return impl_->failures; }
std::string_view PolicyHost::plugin_name() const { return impl_->active->name(); }
std::string_view PolicyHost::plugin_version() const { return impl_->active->version(); }
const std::filesystem::path& PolicyHost::plugin_file() const { return impl_->active->file(); }
std::uint32_t PolicyHost::block_count() const { return impl_->block_count(); }
std::uint32_t PolicyHost::plugin_abi_minor() const { return impl_->active->abi_minor(); }

}  // namespace sp::host
