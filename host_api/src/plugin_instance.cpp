// Creating and destroying a plugin's context: the host API and block descriptions it is made
// with, the NF4 sizes a 1.1 plugin is sent next, and where its log messages go.
#include "plugin_instance.h"

#include "abi_minor.h"
#include "plugin_call_scope.h"

#include <fmt/format.h>
#include <fmt/std.h>
#include <spdlog/spdlog.h>

#include "sp/precision_abi.h"

namespace sp::host::detail {
namespace {

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

void forward_plugin_log(void* user_data, sp_log_level level, const char* message) noexcept {
  try {
    const auto* route = static_cast<const LogRoute*>(user_data);
    route->logger->log(to_spdlog_level(level), "[{}] {}", route->label, message != nullptr ? message : "");
  } catch (...) {
    // The ABI forbids exceptions from crossing back into the plugin; a lost log line is
    // the lesser harm.
  }
}

}  // namespace

std::string status_text(sp_status status) { return fmt::format("status {} ({})", status, status_name(status)); }

const char* precision_name(sp_precision precision) {
  const std::optional<Precision> route = from_abi(precision);
  return route ? route_traits(*route).abi_name : "an unknown precision";
}

bool in_mask(sp_precision_mask mask, sp_precision precision) {
  return precision >= 0 && precision < 32 && (mask & SP_PRECISION_BIT(precision)) != 0;
}

std::unique_ptr<PluginInstance> PluginInstance::create(PluginLibrary library, PolicyConfig config,
                                                       const std::vector<BlockDescription>& blocks,
                                                       const PolicyHostOptions& options,
                                                       const std::shared_ptr<spdlog::logger>& logger) {
  std::unique_ptr<PluginInstance> instance(new PluginInstance(std::move(library), std::move(config)));
  instance->log_route_ = std::make_unique<LogRoute>(
      LogRoute{logger, fmt::format("{} {}", instance->library_.plugin_name(), instance->library_.plugin_version())});

  std::vector<sp_block_desc_v1> descs;
  descs.reserve(blocks.size());
  for (const BlockDescription& block : blocks) {
    descs.push_back(sp_block_desc_v1{sizeof(sp_block_desc_v1), block.id, block.num_params, block.bytes[Precision::bf16],
                                     block.bytes[Precision::int8], block.name.empty() ? nullptr : block.name.c_str()});
  }
  const std::string output_dir = options.output_dir.string();
  const AbiMinorLayout& abi = instance->abi();
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
    const PluginCallScope scope(instance->log_route_->label, "create");
    return table.create(&host, instance->config_.text.c_str(), descs.data(), static_cast<std::uint32_t>(descs.size()),
                        &ctx);
  }();
  if (status != SP_OK || ctx == nullptr) {
    const std::string reason = status != SP_OK
                                   ? fmt::format("{}: {}", status_text(status), safe_message(table.last_error(nullptr)))
                                   : std::string("create() returned SP_OK but no context");
    if (ctx != nullptr) {
      const PluginCallScope scope(instance->log_route_->label, "destroy");
      table.destroy(ctx);
    }
    throw PluginError(fmt::format("{}: policy plugin {} ({}) rejected the configuration: {}",
                                  instance->config_.source_name, instance->log_route_->label,
                                  instance->library_.source_path(), reason));
  }
  instance->ctx_ = ctx;

  // sp_block_desc_v1 is frozen with ABI 1.0's routes, so a later route's sizes travel through
  // set_transfer_bytes, before anything else reaches the new context (a swap's import_state
  // included).
  const sp_precision_mask in_block_desc = abi_minor_layout(0).precisions;
  for (const RouteTraits& route : kRouteTraits) {
    if (!abi.has_precision_routes || in_mask(in_block_desc, route.abi_code) ||
        !in_mask(options.supported_precisions, route.abi_code)) {
      continue;
    }
    std::vector<std::uint64_t> route_bytes;
    route_bytes.reserve(blocks.size());
    for (const BlockDescription& block : blocks) route_bytes.push_back(block.bytes[route.precision]);
    const sp_status bytes_status = [&] {
      const PluginCallScope scope(instance->log_route_->label, "set_transfer_bytes");
      return table.set_transfer_bytes(ctx, route.abi_code, route_bytes.data(),
                                      static_cast<std::uint32_t>(route_bytes.size()));
    }();
    if (bytes_status != SP_OK) {
      const std::string reason = fmt::format("{}: {}", status_text(bytes_status), instance->last_error());
      // The destructor destroys the context and unloads the library.
      throw PluginError(fmt::format(
          "{}: policy plugin {} ({}) rejected the {} transfer bytes of its {} blocks (set_transfer_bytes): {}",
          instance->config_.source_name, instance->log_route_->label, instance->library_.source_path(), route.label,
          route_bytes.size(), reason));
    }
  }
  return instance;
}

UnloadReport PluginInstance::close() {
  if (ctx_ != nullptr) {
    const sp_status status = [&] {
      const PluginCallScope scope(log_route_->label, "destroy");
      return table().destroy(ctx_);
    }();
    if (status != SP_OK) {
      log_route_->logger->warn("policy plugin {}: destroy() returned {}", log_route_->label, status_text(status));
    }
    ctx_ = nullptr;
  }
  return library_.unload();
}

}  // namespace sp::host::detail
