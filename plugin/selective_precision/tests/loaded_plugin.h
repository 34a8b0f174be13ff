// A policy plugin loaded from its file the way a host loads it (dlopen, then the versioned entry
// symbol), for the tests that drive the plugins through their C tables, and a host description
// that offers every route.
#pragma once

#include <sp/plugin_abi_v1.h>

#include <dlfcn.h>

namespace sp::policy::testing {

class LoadedPlugin {
 public:
  explicit LoadedPlugin(const char *path) : handle_(dlopen(path, RTLD_NOW | RTLD_LOCAL)) {
    if (handle_ == nullptr) return;
    const auto entry = reinterpret_cast<sp_policy_plugin_entry_v1_fn>(dlsym(handle_, SP_PLUGIN_ENTRY_SYMBOL_V1));
    if (entry != nullptr) table_ = entry();
  }
  ~LoadedPlugin() {
    if (handle_ != nullptr) dlclose(handle_);
  }
  LoadedPlugin(const LoadedPlugin &) = delete;
  LoadedPlugin &operator=(const LoadedPlugin &) = delete;

  // Null when the file or its entry symbol could not be loaded.
  const sp_policy_plugin_v1_table *table() const { return table_; }
  const sp_policy_plugin_v1_table *operator->() const { return table_; }
  bool loaded() const { return table_ != nullptr; }

 private:
  void *handle_;
  const sp_policy_plugin_v1_table *table_ = nullptr;
};

// A host of this header's minor that transfers BF16, INT8 and NF4.
inline sp_host_api_v1 all_routes_host() {
  sp_host_api_v1 host{};
  host.struct_size = sizeof host;
  host.abi_major = SP_PLUGIN_ABI_MAJOR;
  host.abi_minor = SP_PLUGIN_ABI_MINOR;
  host.host_name = "sp_policy_tests";
  host.host_version = "0";
  host.supported_precisions =
      SP_PRECISION_BIT(SP_PRECISION_BF16) | SP_PRECISION_BIT(SP_PRECISION_INT8) | SP_PRECISION_BIT(SP_PRECISION_NF4);
  return host;
}

}  // namespace sp::policy::testing
