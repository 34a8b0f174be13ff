#include <sp/host/policy_host.h>

#include <fmt/format.h>
#include <fmt/std.h>
#include <spdlog/spdlog.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <utility>

namespace sp::host {
namespace {

// A state blob larger than this is taken for a plugin bug, not a state: the swap fails and
// the old plugin stays instead of the host trying to allocate whatever it was told.
constexpr std::uint64_t kMaxStateBytes = std::uint64_t{1} << 30;

const char* status_name(sp_status status) {
  switch (status) {
    case SP_OK: return "SP_OK";
    case SP_ERR_INVALID_ARGUMENT: return "SP_ERR_INVALID_ARGUMENT";
    case SP_ERR_CONFIG: return "SP_ERR_CONFIG";
    case SP_ERR_STATE: return "SP_ERR_STATE";
    case SP_ERR_BUFFER_TOO_SMALL: return "SP_ERR_BUFFER_TOO_SMALL";
    case SP_ERR_INTERNAL: return "SP_ERR_INTERNAL";
    case SP_ERR_ORDER: return "SP_ERR_ORDER";
    default: return "an unknown status";
  }
}

std::string status_text(sp_status status) { return fmt::format("status {} ({})", status, status_name(status)); }

spdlog::level::level_enum to_spdlog_level(sp_log_level level) {
  switch (level) {
    case SP_LOG_DEBUG: return spdlog::level::debug;
    case SP_LOG_INFO: return spdlog::level::info;
    case SP_LOG_WARN: return spdlog::level::warn;
    default: return spdlog::level::err;
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
    sp_host_api_v1 host{};
    host.struct_size = sizeof(sp_host_api_v1);
    host.abi_major = SP_PLUGIN_ABI_MAJOR;
    host.abi_minor = SP_PLUGIN_ABI_MINOR;
    host.host_name = options.host_name.c_str();
    host.host_version = SP_HOST_VERSION;
    host.output_dir = output_dir.empty() ? nullptr : output_dir.c_str();
    host.log = &forward_plugin_log;
    host.log_user_data = instance->log_route_.get();
    host.min_log_level = to_abi_level(logger->level());

    const sp_policy_plugin_v1_table& table = instance->table();
    sp_policy_ctx* ctx = nullptr;
    const sp_status status = table.create(&host, instance->config_.text.c_str(), descs.data(),
                                          static_cast<std::uint32_t>(descs.size()), &ctx);
    if (status != SP_OK || ctx == nullptr) {
      const std::string reason =
          status != SP_OK ? fmt::format("{}: {}", status_text(status), safe_message(table.last_error(nullptr)))
                          : std::string("create() returned SP_OK but no context");
      if (ctx != nullptr) table.destroy(ctx);
      throw PluginError(fmt::format("{}: policy plugin {} ({}) rejected the configuration: {}",
                                    instance->config_.source_name, instance->log_route_->label,
                                    instance->library_.source_path(), reason));
    }
    instance->ctx_ = ctx;
    return instance;
  }

  PluginInstance(const PluginInstance&) = delete;
  PluginInstance& operator=(const PluginInstance&) = delete;
  ~PluginInstance() { close(); }

  // Destroys the context, then unloads the library and reports whether it really left.
  UnloadReport close() {
    if (ctx_ != nullptr) {
      const sp_status status = table().destroy(ctx_);
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
  const PolicyConfig& config() const { return config_; }

 private:
  PluginInstance(PluginLibrary library, PolicyConfig config)
      : library_(std::move(library)), config_(std::move(config)) {}

  static std::string safe_message(const char* message) {
    return message != nullptr ? message : "(the plugin gave no message)";
  }

  PluginLibrary library_;
  PolicyConfig config_;
  std::unique_ptr<LogRoute> log_route_;
  sp_policy_ctx* ctx_ = nullptr;
};

bool is_valid_sensitivity(double sensitivity) {
  return std::isnan(sensitivity) || (sensitivity >= 0.0 && sensitivity <= 1.0);
}

// Empty when the hints keep the ABI contract, otherwise what is wrong with the first bad one.
std::string hint_contract_violation(const std::vector<sp_hint_v1>& hints) {
  for (std::size_t i = 0; i < hints.size(); ++i) {
    const sp_hint_v1& hint = hints[i];
    if (hint.block_id != i) {
      return fmt::format("hints[{}].block_id is {}, expected {}", i, hint.block_id, i);
    }
    if (hint.precision != SP_PRECISION_BF16 && hint.precision != SP_PRECISION_INT8) {
      return fmt::format("hints[{}].precision is {}, expected SP_PRECISION_BF16 ({}) or SP_PRECISION_INT8 ({})", i,
                         hint.precision, SP_PRECISION_BF16, SP_PRECISION_INT8);
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

  std::uint32_t block_count() const { return static_cast<std::uint32_t>(blocks.size()); }

  void require_open_step(const char* hook, std::int64_t step) const {
    if (open_step != step) {
      throw std::logic_error(
          open_step ? fmt::format("PolicyHost::{}({}) called while step {} is open", hook, step, *open_step)
                    : fmt::format("PolicyHost::{}({}) called outside a step; call begin_step({}) first", hook, step,
                                  step));
    }
  }

  // True when the hook succeeded; otherwise logs the plugin's reason and counts it.
  bool check_hook(const char* hook, std::string_view when, sp_status status, std::uint64_t& failure_count) {
    if (status == SP_OK) return true;
    ++failure_count;
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
        hints[id] = sp_hint_v1{id, SP_PRECISION_BF16, std::numeric_limits<double>::quiet_NaN(),
                               SP_REASON_HOST_FALLBACK, 0};
      }
    }
    hint_source = HintSource::fallback;
    logger->warn("step {}: using {} hints instead of the plugin's", step,
                 options.fallback == FallbackMode::last_good && !last_good_hints.empty() ? "the last good"
                                                                                        : "all-BF16");
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
    result.message = fmt::format("hot swap to {} failed; {} stays active: {}", result.plugin_file, active->label(),
                                 reason);
    logger->error("{}", result.message);
    last_swap = result;
    return result;
  }

  std::optional<std::vector<std::uint8_t>> export_active_state(std::string& error) {
    const sp_policy_plugin_v1_table& table = active->table();
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
    std::string error;
    const std::optional<std::vector<std::uint8_t>> blob = export_active_state(error);
    if (!blob) return fail_swap(std::move(result), error);

    const sp_status status = pending->table().import_state(pending->ctx(), blob->data(), blob->size());
    if (status != SP_OK) {
      return fail_swap(std::move(result), fmt::format("{} could not import the state of {} ({} bytes) with {}: {}",
                                                      pending->label(), active->label(), blob->size(),
                                                      status_text(status), pending->last_error()));
    }

    std::unique_ptr<PluginInstance> retired = std::exchange(active, std::move(pending));
    const std::string retired_label = retired->label();
    const UnloadReport unload = retired->close();
    result.outcome = SwapResult::Outcome::swapped;
    result.first_step = first_step;
    first_step_unknown = !first_step;
    result.old_library_unloaded = unload.unloaded;
    const std::string when = first_step ? fmt::format("from step {}", *first_step)
                             : last_ended_step ? fmt::format("after step {}", *last_ended_step)
                                               : std::string("before the first step");
    result.message = fmt::format("hot swap: {} replaced {} {} with {} bytes of state", active->label(), retired_label,
                                 when, blob->size());
    logger->info("{}", result.message);
    if (!unload.unloaded) {
      result.message += "; warning: " + unload.detail;
      logger->warn("{}", unload.detail);
    }
    last_swap = result;
    return result;
  }
};

PolicyHost::PolicyHost(const std::filesystem::path& plugin_file, PolicyConfig config,
                       std::vector<BlockDescription> blocks, PolicyHostOptions options)
    : impl_(std::make_unique<Impl>()) {
  if (blocks.size() > std::numeric_limits<std::uint32_t>::max()) {
    throw std::invalid_argument(fmt::format("PolicyHost: {} blocks exceed the ABI's 32-bit block count", blocks.size()));
  }
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    if (blocks[i].id != i) {
      throw std::invalid_argument(
          fmt::format("PolicyHost: block {} has id {}; ids must run 0..n-1 in order", i, blocks[i].id));
    }
  }
  impl_->logger = options.logger ? options.logger : spdlog::default_logger();
  impl_->options = std::move(options);
  impl_->blocks = std::move(blocks);
  impl_->active = PluginInstance::create(PluginLibrary::load(plugin_file), std::move(config), impl_->blocks,
                                         impl_->options, impl_->logger);
}

PolicyHost::~PolicyHost() {
  if (impl_->pending) impl_->pending->close();
  const UnloadReport unload = impl_->active->close();
  if (!unload.unloaded) impl_->logger->warn("{}", unload.detail);
}

void PolicyHost::begin_step(std::int64_t step) {
  if (impl_->open_step) {
    throw std::logic_error(fmt::format("PolicyHost::begin_step({}) called while step {} is open; call end_step({}) first",
                                       step, *impl_->open_step, *impl_->open_step));
  }
  if (impl_->pending) {
    impl_->apply_pending_swap(step);
  } else if (impl_->first_step_unknown && impl_->last_swap) {
    impl_->last_swap->first_step = step;
    impl_->first_step_unknown = false;
  }
  impl_->open_step = step;
  impl_->check_hook("begin_step", step, impl_->active->table().begin_step(impl_->active->ctx(), step),
                    impl_->failures.begin_step);
}

void PolicyHost::post_backward(std::int64_t step, const std::vector<sp_grad_moments_v1>& moments) {
  impl_->require_open_step("post_backward", step);
  if (moments.size() > impl_->blocks.size()) {
    throw std::invalid_argument(fmt::format("PolicyHost::post_backward({}): {} moments for {} blocks", step,
                                            moments.size(), impl_->blocks.size()));
  }
  impl_->check_hook("post_backward", step,
                    impl_->active->table().post_backward(impl_->active->ctx(), step, moments.data(),
                                                         static_cast<std::uint32_t>(moments.size())),
                    impl_->failures.post_backward);
}

const std::vector<sp_hint_v1>& PolicyHost::compute_hints(std::int64_t step) {
  impl_->require_open_step("compute_hints", step);
  Impl& impl = *impl_;
  impl.plugin_hints.assign(impl.blocks.size(), sp_hint_v1{});
  const sp_status status = impl.active->table().compute_hints(impl.active->ctx(), step, impl.plugin_hints.data(),
                                                              impl.block_count());
  if (!impl.check_hook("compute_hints", step, status, impl.failures.compute_hints)) {
    impl.use_fallback_hints(step);
    return impl.hints;
  }
  const std::string violation = hint_contract_violation(impl.plugin_hints);
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
    stamped->struct_size = sizeof(sp_step_feedback_v1);
  }
  impl_->check_hook("end_step", step,
                    impl_->active->table().end_step(impl_->active->ctx(), step, stamped ? &*stamped : nullptr),
                    impl_->failures.end_step);
  impl_->open_step.reset();
  impl_->last_ended_step = step;
}

bool PolicyHost::set_calibration_errors(const std::vector<std::uint32_t>& block_ids,
                                        const std::vector<double>& errors) {
  if (block_ids.size() != errors.size()) {
    throw std::invalid_argument(fmt::format("PolicyHost::set_calibration_errors: {} block ids but {} errors",
                                            block_ids.size(), errors.size()));
  }
  Impl& impl = *impl_;
  const sp_status status = impl.active->table().set_calibration_errors(
      impl.active->ctx(), block_ids.data(), errors.data(), static_cast<std::uint32_t>(block_ids.size()));
  const std::string when = impl.open_step          ? fmt::format("during step {}", *impl.open_step)
                           : impl.last_ended_step ? fmt::format("after step {}", *impl.last_ended_step)
                                                  : std::string("before the first step");
  return impl.check_hook("set_calibration_errors", when, status, impl.failures.set_calibration_errors);
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
  std::string error;
  std::optional<std::vector<std::uint8_t>> blob = impl_->export_active_state(error);
  if (!blob) throw PluginError(error);
  return std::move(*blob);
}

bool PolicyHost::import_state(const std::vector<std::uint8_t>& blob) {
  impl_->require_between_steps("import_state");
  const sp_status status = impl_->active->table().import_state(impl_->active->ctx(), blob.data(), blob.size());
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
HintSource PolicyHost::last_hint_source() const { return impl_->hint_source; }
const HookFailureCounts& PolicyHost::hook_failures() const { return impl_->failures; }
std::string_view PolicyHost::plugin_name() const { return impl_->active->name(); }
std::string_view PolicyHost::plugin_version() const { return impl_->active->version(); }
const std::filesystem::path& PolicyHost::plugin_file() const { return impl_->active->file(); }
std::uint32_t PolicyHost::block_count() const { return impl_->block_count(); }

}  // namespace sp::host
