// The one base of every exception this project throws on purpose, and the kinds a caller
// reacts to. A mixin, as boost::exception is: each error class also derives from the standard
// exception it has always been (std::runtime_error, or std::invalid_argument for a rejected
// argument), so code that catches those keeps working, and `catch (const sp::Error&)` with
// kind() tells a host what to do (sp-train maps the kinds to its exit codes).
#pragma once

#include <stdexcept>
#include <string>

namespace sp {

enum class ErrorKind {
  bad_input,   // a file, config, argument or checkpoint the caller handed in: fix the input
  plugin,      // a policy plugin that cannot be loaded, refused its input or failed
  collective,  // data parallelism stopped: another rank died, stalled or decided otherwise
  device,      // the CUDA runtime or driver reported an error
  internal,    // a broken invariant: a bug in this project
};

constexpr const char* error_kind_name(ErrorKind kind) noexcept {
  switch (kind) {
    case ErrorKind::bad_input:
      return "bad input";
    case ErrorKind::plugin:
      return "plugin";
    case ErrorKind::collective:
      return "collective";
    case ErrorKind::device:
      return "device";
    case ErrorKind::internal:
      return "internal";
  }
  return "unknown";
}

class Error {
 public:
  virtual ~Error() = default;
  ErrorKind kind() const noexcept { return kind_; }
  // The message, as the standard exception it also is reports it.
  virtual const char* what() const noexcept = 0;

 protected:
  explicit Error(ErrorKind kind) noexcept : kind_(kind) {}
  Error(const Error&) = default;
  Error& operator=(const Error&) = default;

 private:
  ErrorKind kind_;
};

// An sp::Error that is also `StandardException`: what() answers for both bases.
template <typename StandardException>
class ErrorAs : public StandardException, public Error {
 public:
  ErrorAs(ErrorKind kind, const std::string& what) : StandardException(what), Error(kind) {}
  const char* what() const noexcept override { return StandardException::what(); }
};

}  // namespace sp
