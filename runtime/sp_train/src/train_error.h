// The errors sp-train reports to its user, under one base, each with the exit code it ends the
// run with (docs/training.md, --help). The libraries' own sp::Error exceptions end the run with
// the exit code of their kind (error_report.h). Anything else that reaches main() is an internal
// error (exit code 1): a std::logic_error (std::out_of_range, std::invalid_argument, ...) is a
// bug in sp-train and is reported as one; any other exception is a failure outside sp-train's
// checks (a file the run writes, LibTorch). Code that turns a lower-level exception into one of
// these must not catch a std::logic_error: a bug would then read as the user's mistake.
#pragma once

#include <stdexcept>
#include <string>

#include <sp/error.h>

namespace sp::train {

// Exit codes, also in --help and docs/training.md.
enum class ExitCode : int {
  ok = 0,
  internal = 1,
  bad_config = 2,
  plugin = 3,
  bad_input = 4,
  diverged = 5,
  distributed = 6,
  device = 7,  // the CUDA runtime or driver failed
  interrupted = 130,  // by SIGINT, after writing a checkpoint
  terminated = 143,   // by SIGTERM, after writing a checkpoint
};

constexpr ErrorKind kind_of_exit_code(ExitCode code) {
  switch (code) {
    case ExitCode::bad_config:
    case ExitCode::bad_input:
    case ExitCode::diverged:  // the config's settings (a learning rate too high, ...) diverge
      return ErrorKind::bad_input;
    case ExitCode::plugin:
      return ErrorKind::plugin;
    case ExitCode::distributed:
      return ErrorKind::collective;
    case ExitCode::device:
      return ErrorKind::device;
    default:
      return ErrorKind::internal;
  }
}

class TrainError : public ErrorAs<std::runtime_error> {
 public:
  TrainError(ExitCode exit_code, const std::string& what)
      : ErrorAs(kind_of_exit_code(exit_code), what), exit_code_(exit_code) {}
  ExitCode exit_code() const noexcept { return exit_code_; }

 private:
  ExitCode exit_code_;
};

// A rejected command line, configuration or override, or a run directory that cannot hold the
// run. what() names the file, the full key path, what was expected and what was found.
// Exit code 2.
class ConfigError : public TrainError {
 public:
  explicit ConfigError(const std::string& what) : TrainError(ExitCode::bad_config, what) {}
};

// The data path cannot be used: missing, unreadable, empty or too short for one sequence.
// Exit code 4.
class DataError : public TrainError {
 public:
  explicit DataError(const std::string& what) : TrainError(ExitCode::bad_input, what) {}
};

// A checkpoint file that cannot be read back exactly as written (checkpoint_file.h). The
// trainer reports it as a ResumeError naming what it was reading for; exit code 4 either way.
class CheckpointError : public TrainError {
 public:
  explicit CheckpointError(const std::string& what) : TrainError(ExitCode::bad_input, what) {}
};

// A checkpoint that cannot be used for this run (corrupt, or another model). Exit code 4.
class ResumeError : public TrainError {
 public:
  explicit ResumeError(const std::string& what) : TrainError(ExitCode::bad_input, what) {}
};

// The loss stopped being finite for too many consecutive steps. Exit code 5.
class DivergedError : public TrainError {
 public:
  explicit DivergedError(const std::string& what) : TrainError(ExitCode::diverged, what) {}
};

// Data-parallel training stopped: another rank died, stalled or left (a collective failed or
// timed out), or the ranks' plugins decided differently. Exit code 6.
class DistributedError : public TrainError {
 public:
  explicit DistributedError(const std::string& what) : TrainError(ExitCode::distributed, what) {}
};

}  // namespace sp::train
