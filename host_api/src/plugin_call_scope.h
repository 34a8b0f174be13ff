// The record behind describe_plugin_call() (sp/host/plugin_call.h): PolicyHost opens a scope
// around every call into a plugin.
#pragma once

#include <cstdint>
#include <string_view>

namespace sp::host::detail {

// Marks the process as inside `call` of the plugin `label` until destroyed. `call` must be a
// string literal (the record keeps the pointer). Scopes do not nest: a plugin call never makes
// another. The record is one per process, for a signal handler to read: where plugin calls
// run on several threads at once (two hosts, e.g. data-parallel ranks as threads), the scope
// opened first holds it, and the others mark nothing until it closes.
class PluginCallScope {
 public:
  static constexpr std::int64_t kNoStep = INT64_MIN;
  PluginCallScope(std::string_view label, const char* call, std::int64_t step = kNoStep) noexcept;
  ~PluginCallScope();
  PluginCallScope(const PluginCallScope&) = delete;
  PluginCallScope& operator=(const PluginCallScope&) = delete;

 private:
  bool holds_record_ = false;
};

}  // namespace sp::host::detail
