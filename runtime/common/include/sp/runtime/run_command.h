// Runs a shell command and collects what it printed and how it ended: how the tests drive
// the project's command-line tools and inspect its binaries (nm), as a user would.
#pragma once

#include <string>

namespace sp::runtime {

struct CommandResult {
  int exit_code = -1;  // -1 when the command could not start or was killed by a signal
  std::string output;  // stdout, plus stderr when the command redirects it (2>&1)
};

CommandResult run_command(const std::string& command);

}  // namespace sp::runtime
