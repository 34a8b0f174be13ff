// One loaded plugin library with one live context made from it: PolicyHost holds the active one
// and, during a hot swap, the pending one. Private to the host library.
#pragma once

#include <sp/host/plugin_library.h>
#include <sp/host/policy_host.h>
#include <sp/plugin_abi_v1.h>

#include "abi_minor.h"

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace sp::host::detail {

// How the host's messages name what a plugin answers, shared by every file that calls one.
std::string status_text(sp_status status);
const char* precision_name(sp_precision precision);
bool in_mask(sp_precision_mask mask, sp_precision precision);

// Where one plugin instance's log messages go. Heap-allocated so that the address the
// plugin holds as log_user_data stays valid while the instance moves around.
struct LogRoute {
  std::shared_ptr<spdlog::logger> logger;
  std::string label;
};

// A plugin library with one live context created from it.
class PluginInstance {
 public:
  static std::unique_ptr<PluginInstance> create(PluginLibrary library, PolicyConfig config,
                                                const std::vector<BlockDescription>& blocks,
                                                const PolicyHostOptions& options,
                                                const std::shared_ptr<spdlog::logger>& logger);

  PluginInstance(const PluginInstance&) = delete;
  PluginInstance& operator=(const PluginInstance&) = delete;
  ~PluginInstance() { close(); }

  // Destroys the context, then unloads the library and reports whether it really left.
  UnloadReport close();

  const sp_policy_plugin_v1_table& table() const { return library_.table(); }
  sp_policy_ctx* ctx() const { return ctx_; }
  std::string last_error() const { return safe_message(table().last_error(ctx_)); }
  const std::string& label() const { return log_route_->label; }
  std::string_view version() const { return library_.plugin_version(); }
  std::string_view name() const { return library_.plugin_name(); }
  const std::filesystem::path& file() const { return library_.source_path(); }
  std::uint32_t abi_minor() const { return library_.abi_minor(); }
  const AbiMinorLayout& abi() const { return *abi_; }
  const PolicyConfig& config() const { return config_; }

 private:
  PluginInstance(PluginLibrary library, PolicyConfig config)
      : library_(std::move(library)), config_(std::move(config)), abi_(&abi_minor_layout(library_.abi_minor())) {}

  static std::string safe_message(const char* message) {
    return message != nullptr ? message : "(the plugin gave no message)";
  }

  PluginLibrary library_;
  PolicyConfig config_;
  const AbiMinorLayout* abi_;
  std::unique_ptr<LogRoute> log_route_;
  sp_policy_ctx* ctx_ = nullptr;
};

}  // namespace sp::host::detail
