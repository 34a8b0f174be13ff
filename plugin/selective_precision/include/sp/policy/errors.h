// Exceptions of the policy core. Each carries the sp_status that the C boundary of the
// plugin returns for it, so the mapping lives in one place.
#pragma once

#include <sp/error.h>
#include <sp/plugin_abi_v1.h>

#include <stdexcept>
#include <string>

namespace sp::policy {

class PolicyError : public ErrorAs<std::runtime_error> {
 public:
  PolicyError(sp_status status, ErrorKind kind, const std::string &message)
      : ErrorAs(kind, message), status_(status) {}
  sp_status status() const noexcept { return status_; }

 private:
  sp_status status_;
};

// The configuration text was rejected. The message names the full key path.
class PolicyConfigError : public PolicyError {
 public:
  explicit PolicyConfigError(const std::string &message) : PolicyError(SP_ERR_CONFIG, ErrorKind::bad_input, message) {}
};

// A state blob was rejected. The policy state is untouched when this is thrown.
class StateError : public PolicyError {
 public:
  explicit StateError(const std::string &message) : PolicyError(SP_ERR_STATE, ErrorKind::bad_input, message) {}
};

// A null pointer, a bad count, an unknown or duplicate block id, or an invalid value.
class InvalidArgument : public PolicyError {
 public:
  explicit InvalidArgument(const std::string &message)
      : PolicyError(SP_ERR_INVALID_ARGUMENT, ErrorKind::bad_input, message) {}
};

// A hook was called out of lifecycle order (steps going backwards, a hook twice in a step).
class OrderError : public PolicyError {
 public:
  explicit OrderError(const std::string &message) : PolicyError(SP_ERR_ORDER, ErrorKind::internal, message) {}
};

}  // namespace sp::policy
