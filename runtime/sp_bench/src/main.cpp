// sp-bench: measures the transfer paths on this machine and turns the measurements into a
// transfer policy ("never slower than BF16"). See docs/performance.md.

#include <iostream>

#include <CLI/CLI.hpp>
#include <fmt/core.h>

#include "sp/bench/transfer_policy.hpp"
#include "sp/runtime/atomic_file.hpp"

namespace {

constexpr int kExitOk = 0;
constexpr int kExitBadInput = 2;

std::string describe_bytes(uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 4) {
    value /= 1024;
    ++unit;
  }
  return fmt::format("{:.4g} {}", value, units[unit]);
}

int merge_policy(const std::vector<std::string>& report_paths, const std::string& output, double threshold) {
  std::vector<sp::bench::TransferReport> reports;
  for (const std::string& path : report_paths) reports.push_back(sp::bench::load_report(path));
  const sp::bench::TransferPolicy policy = sp::bench::TransferPolicy::merge(reports, threshold);
  sp::runtime::write_file_atomically(output, policy.to_json());
  for (auto path : {sp::bench::TransferPath::kInt8Frozen, sp::bench::TransferPath::kInt8Trained}) {
    const auto& rules = policy.rules(path);
    if (rules.empty()) {
      fmt::print("{}: INT8 never measured >= {}x faster: every block stays BF16\n",
                 sp::bench::transfer_path_name(path), threshold);
    }
    for (const auto& rule : rules) {
      fmt::print("{}: INT8 from {} {} (measured speedup >= {:.2f}x)\n", sp::bench::transfer_path_name(path),
                 describe_bytes(rule.min_bytes),
                 rule.max_bytes ? "below " + describe_bytes(*rule.max_bytes) : std::string("upwards"),
                 rule.measured_speedup);
    }
  }
  fmt::print("policy from {} report(s) written to {}\n", reports.size(), output);
  return kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"sp-bench: benchmark-driven transfer policy for Selective Precision"};
  app.footer("Exit codes: 0 success; 1 internal error; 2 bad arguments or unusable input file.");
  app.require_subcommand(1);

  std::vector<std::string> reports;
  std::string output;
  double threshold = 1.0;
  CLI::App* merge = app.add_subcommand(
      "merge-policy",
      "fold transfer reports (one per machine) into a transfer policy file: per path, the block "
      "sizes where every report measured INT8 at least --speedup-threshold times faster than BF16");
  merge->add_option("--reports", reports, "transfer report JSON files")->required()->expected(1, -1);
  merge->add_option("--output", output, "policy file to write (atomically)")->required();
  merge->add_option("--speedup-threshold", threshold, "minimum INT8 speedup over BF16")->capture_default_str();

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? kExitOk : kExitBadInput;
  }
  try {
    if (*merge) return merge_policy(reports, output, threshold);
  } catch (const sp::bench::TransferPolicyError& e) {
    fmt::print(stderr, "sp-bench: {}\n", e.what());
    return kExitBadInput;
  } catch (const std::exception& e) {
    fmt::print(stderr, "sp-bench: {}\n", e.what());
    return 1;
  }
  return kExitOk;
}
