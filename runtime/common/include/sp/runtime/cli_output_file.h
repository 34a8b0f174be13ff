// A CLI11 check for options that name a file the tool will write.
#pragma once

#include <string>

#include <CLI/CLI.hpp>

#include "sp/runtime/atomic_file.h"

namespace sp::runtime {

// Refuses, at parse time, a path that output_file_problem() rejects.
inline CLI::Validator output_file() {
  return CLI::Validator([](std::string& path) { return output_file_problem(path); }, "FILE", "output_file");
}

}  // namespace sp::runtime
