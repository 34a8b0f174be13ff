// Where the policy core sends its log lines. The plugin forwards them to the host's
// sp_log_fn; tests capture them. The core never logs anywhere else.
#pragma once

#include <sp/plugin_abi_v1.h>

#include <string_view>

namespace sp::policy {

class LogSink {
 public:
  virtual ~LogSink() = default;
  // Lets callers skip formatting a message nobody will read.
  virtual bool wants(sp_log_level level) const = 0;
  // Must not throw.
  virtual void write(sp_log_level level, std::string_view message) noexcept = 0;
};

}  // namespace sp::policy
