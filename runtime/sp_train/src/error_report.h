// What sp-train's main() says and returns for the exception that ended a run, kept apart from
// main() so that the mapping is tested: sp-train's own errors (TrainError) with their exit
// codes, the libraries' sp::Error exceptions with the exit code of their kind, everything else
// as an internal error (exit code 1), a std::logic_error and a non-standard exception named as
// a bug.
#pragma once

#include <exception>
#include <stdexcept>
#include <string>

#include <sp/error.h>

#include "train_error.h"

namespace sp::train {

struct ErrorReport {
  ExitCode exit_code = ExitCode::internal;
  std::string message;
};

inline constexpr const char* kBugReportPrefix =
    "internal error (a bug in sp-train; please report it with the command line): ";

inline ErrorReport report_error(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const TrainError& e) {  // the user's to fix: command line, config, data, checkpoint, divergence
    return {e.exit_code(), e.what()};
  } catch (const sp::Error& e) {  // before std::logic_error: a rejected state entry is bad input, not a bug
    switch (e.kind()) {
      case ErrorKind::bad_input:
        return {ExitCode::bad_input, e.what()};
      case ErrorKind::plugin:
        return {ExitCode::plugin, e.what()};
      case ErrorKind::collective:
        return {ExitCode::distributed, e.what()};
      case ErrorKind::device:
        return {ExitCode::device, e.what()};
      case ErrorKind::internal:
        break;
    }
    return {ExitCode::internal, kBugReportPrefix + std::string(e.what())};
  } catch (const std::logic_error& e) {  // std::out_of_range, std::invalid_argument, ...
    return {ExitCode::internal, kBugReportPrefix + std::string(e.what())};
  } catch (const std::exception& e) {  // outside sp-train's checks: a file it writes, LibTorch, CUDA
    return {ExitCode::internal, "internal error: " + std::string(e.what())};
  } catch (...) {
    return {ExitCode::internal, kBugReportPrefix + std::string("an exception that is not a std::exception")};
  }
}

}  // namespace sp::train
