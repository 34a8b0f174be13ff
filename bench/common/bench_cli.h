// The command-line conventions every benchmark program shares with the project's tools:
// a mistake on the command line is exit 2 with CLI11's message, and the JSON report goes
// through the atomic writer to a path checked before the benchmark runs.
#pragma once

#include <filesystem>
#include <string>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "sp/runtime/atomic_file.h"
#include "sp/runtime/cli_output_file.h"

namespace sp::bench {

inline constexpr const char* kBenchExitCodes =
    "Exit codes: 0 report written; 1 the benchmark failed; 2 bad command line (checked before "
    "anything runs).";

// Returns the exit code to leave with, or -1 to go on.
inline int parse_command_line(CLI::App& app, int argc, char** argv) {
  app.footer(kBenchExitCodes);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    return app.exit(error) == 0 ? 0 : 2;
  }
  return -1;
}

// The options every report-writing benchmark takes: where the JSON goes (checked before the run)
// and the commit it records.
inline void add_report_options(CLI::App& app, std::string& output, std::string& commit) {
  app.add_option("-o,--output", output, "JSON result path")->capture_default_str()->check(sp::runtime::output_file());
  app.add_option("--commit", commit, "commit the binary was built from (recorded in the JSON)");
}

// Labels given on the command line may hold any bytes; the report replaces invalid UTF-8
// rather than failing after the whole run.
inline void write_report(const std::filesystem::path& path, const nlohmann::json& report) {
  sp::runtime::write_file_atomically(path, report.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n");
}

}  // namespace sp::bench
