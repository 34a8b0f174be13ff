// sp-bench: measures the transfer paths on this machine and turns the measurements into a
// transfer policy ("never slower than BF16"). See docs/performance.md.

#include <cerrno>
#include <charconv>
#include <cstdint>
#include <unistd.h>

#include <filesystem>
#include <iostream>
#include <new>

#include <CLI/CLI.hpp>
#include <fmt/core.h>

#include "sp/adapters/host_backend.h"
#include "sp/bench/transfer_measure.h"
#include "sp/adapters/transfer_policy.h"
#include "sp/kernels/nf4.h"
#include "sp/kernels/quantize.h"
#include "sp/runtime/atomic_file.h"
#include "sp/runtime/cli_output_file.h"
#ifdef SP_BENCH_WITH_CUDA
#include "sp/adapters/cuda_backend.h"
#endif

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

// A group-size option checked by the kernels' own rule (sp/kernels/quantize.h, nf4.h), so the
// CLI cannot drift from what the kernels accept.
CLI::Validator group_size_check(bool (*supported)(uint32_t), std::string expected) {
  return CLI::Validator(
      [supported, expected](std::string& text) {
        uint64_t value = 0;
        const char* end = text.data() + text.size();
        const auto [last, error] = std::from_chars(text.data(), end, value);
        const bool ok =
            error == std::errc() && last == end && value <= UINT32_MAX && supported(static_cast<uint32_t>(value));
        return ok ? std::string() : fmt::format("expected {}, found {}", expected, text);
      },
      "SIZE", "group_size");
}

struct TransferOptions {
  std::string backend = "auto";
  double cap_gbps = 25.0;
  uint64_t min_kib = 256;
  uint64_t max_kib = 0;  // 0: 512 MiB on a GPU, 64 MiB on the host backend
  std::vector<uint64_t> gpt_d_model;
  sp::bench::MeasureOptions measure;
  std::string machine;
  std::string output;
  std::string rebuild = "fused";
};

std::string host_name() {
  char name[256] = {};
  ::gethostname(name, sizeof(name) - 1);
  return name;
}

sp::adapters::TransferReport sweep(sp::adapters::TransferBackend& backend, const TransferOptions& options) {
  sp::adapters::TransferReport report;
  const auto measure = [&](const std::vector<sp::bench::MatrixShape>& shapes, const std::string& label) {
    sp::adapters::TransferPoint point = sp::bench::measure_transfer_point(backend, shapes, options.measure);
    const auto path_of = [](sp::Precision route, bool trained) {
      return sp::adapters::transfer_path(
          route, trained ? sp::adapters::BlockWeights::kTrained : sp::adapters::BlockWeights::kFrozen);
    };
    fmt::print(
        "{:>18}  bf16 {:>10}  raw {:7.2f} GB/s  bf16 path {:5.1f}% of raw  int8 {:5.2f}x faster "
        "(frozen), {:5.2f}x (trained)  nf4 {:5.2f}x (frozen), {:5.2f}x (trained)\n",
        label, describe_bytes(point.bf16_bytes), point.bf16_bytes / point.raw_copy_s / 1e9,
        100.0 * point.raw_copy_s / point.bf16_path_s, point.speedup(path_of(sp::Precision::int8, false)),
        point.speedup(path_of(sp::Precision::int8, true)), point.speedup(path_of(sp::Precision::nf4, false)),
        point.speedup(path_of(sp::Precision::nf4, true)));
    std::fflush(stdout);
    report.points.push_back(point);
  };
  for (uint64_t kib = options.min_kib; kib <= options.max_kib; kib *= 2) {
    measure(sp::bench::sweep_block_shapes(kib << 10), "sweep");
  }
  for (uint64_t d : options.gpt_d_model) measure(sp::bench::gpt_block_shapes(d), fmt::format("gpt d={}", d));
  double best = 0;
  for (const auto& p : report.points) best = std::max(best, p.bf16_bytes / p.raw_copy_s / 1e9);
  report.reference_h2d_gbps = best;
  return report;
}

int transfer(TransferOptions options) {
  bool use_cuda = options.backend == "cuda";
#ifdef SP_BENCH_WITH_CUDA
  if (options.backend == "auto") use_cuda = sp::adapters::CudaBackend::device_available();
  if (use_cuda && !sp::adapters::CudaBackend::device_available()) {
    throw sp::adapters::TransferPolicyError("--backend cuda: no CUDA device is available");
  }
#else
  if (use_cuda) throw sp::adapters::TransferPolicyError("--backend cuda: this build has no CUDA support");
#endif
  if (options.max_kib == 0) options.max_kib = use_cuda ? (512u << 10) : (64u << 10);
  if (options.min_kib > options.max_kib) {
    throw sp::adapters::TransferPolicyError(
        fmt::format("--min-kib {} is above --max-kib {}", options.min_kib, options.max_kib));
  }
  sp::adapters::TransferReport report;
  if (use_cuda) {
#ifdef SP_BENCH_WITH_CUDA
    sp::adapters::CudaBackend backend;
    report = sweep(backend, options);
    report.backend = "cuda";
    report.device = backend.device_name();
#endif
  } else {
    sp::adapters::HostBackendOptions host;
    host.bandwidth_cap_bytes_per_second = options.cap_gbps * 1e9;
    sp::adapters::HostBackend backend(host);
    report = sweep(backend, options);
    report.backend = "host";
    report.device = options.cap_gbps > 0 ? fmt::format("host memcpy, capped at {} GB/s (emulation)", options.cap_gbps)
                                         : std::string("host memcpy, uncapped (emulation)");
    if (options.cap_gbps > 0) report.bandwidth_cap_gbps = options.cap_gbps;
  }
  report.machine = options.machine.empty() ? host_name() : options.machine;
  report.rebuild = options.rebuild;
  sp::runtime::write_file_atomically(options.output, sp::adapters::report_to_json(report));
  fmt::print("report of {} sizes on {} ({}) written to {}\n", report.points.size(), report.machine, report.device,
             options.output);
  return kExitOk;
}

int merge_policy(const std::vector<std::string>& report_paths, const std::string& output, double threshold) {
  std::vector<sp::adapters::TransferReport> reports;
  for (const std::string& path : report_paths) {
    std::error_code ignored;
    if (std::filesystem::equivalent(path, output, ignored)) {
      throw sp::adapters::TransferPolicyError(
          fmt::format("--output {} is also one of the --reports; the report would be overwritten", output));
    }
    reports.push_back(sp::adapters::load_report(path));
  }
  const sp::adapters::TransferPolicy policy = sp::adapters::TransferPolicy::merge(reports, threshold);
  sp::runtime::write_file_atomically(output, policy.to_json());
  for (const sp::adapters::TransferPath path : sp::adapters::transfer_paths()) {
    const bool nf4 = path.route == sp::Precision::nf4;
    const char* route = nf4 ? "NF4" : "INT8";
    const auto& rules = policy.rules(path);
    if (rules.empty()) {
      fmt::print("{}: {} never measured >= {}x faster: no block takes {} ({})\n",
                 sp::adapters::transfer_path_name(path), route, threshold, route,
                 nf4 ? "NF4 hints fall back to INT8 where it pays, else BF16" : "BF16");
    }
    for (const auto& rule : rules) {
      fmt::print("{}: {} from {} {} (measured speedup >= {:.2f}x)\n", sp::adapters::transfer_path_name(path), route,
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

  TransferOptions transfer_options;
  CLI::App* measure = app.add_subcommand(
      "transfer",
      "measure the BF16, INT8 and NF4 transfer paths through the streaming engine for a sweep of block "
      "sizes (doubling from --min-kib to --max-kib) and for GPT blocks of the given widths, and "
      "write a report for merge-policy");
  measure->add_option("--backend", transfer_options.backend, "cuda, host (emulated link), or auto")
      ->check(CLI::IsMember({"auto", "cuda", "host"}))
      ->capture_default_str();
  measure
      ->add_option("--bandwidth-cap-gbps", transfer_options.cap_gbps,
                   "host backend: emulated link bandwidth in GB/s, 0 for none")
      ->check(CLI::Validator(
          [](std::string& text) {
            errno = 0;
            const double gbps = std::strtod(text.c_str(), nullptr);
            // errno: 1e-400 reads as 0 with ERANGE, and must not mean "no cap".
            return (gbps == 0.0 && errno == 0) || (gbps >= sp::adapters::kMinBandwidthCapGbps && gbps <= 1e6)
                       ? std::string()
                       : fmt::format("expected 0 (no cap) or a number in [{}, 1e6], found {}",
                                     sp::adapters::kMinBandwidthCapGbps, text);
          },
          "GBPS", "bandwidth_cap"))
      ->capture_default_str();
  measure->add_option("--min-kib", transfer_options.min_kib, "smallest BF16 block in KiB")
      ->check(CLI::Range(uint64_t{1}, uint64_t{1} << 30))
      ->capture_default_str();
  measure
      ->add_option("--max-kib", transfer_options.max_kib,
                   "largest BF16 block in KiB (default: 512 MiB on a GPU, 64 MiB on the host)")
      ->check(CLI::Range(uint64_t{1}, uint64_t{1} << 30));
  measure->add_option("--gpt-d-model", transfer_options.gpt_d_model, "also measure GPT blocks of these widths")
      ->check(CLI::Range(uint64_t{8}, uint64_t{65536}));
  measure->add_option("--blocks", transfer_options.measure.blocks, "blocks streamed per step")
      ->check(CLI::Range(2u, 1024u))
      ->capture_default_str();
  measure->add_option("--window", transfer_options.measure.window, "prefetch window")
      ->check(CLI::Range(0u, 64u))
      ->capture_default_str();
  measure->add_option("--warmup", transfer_options.measure.warmup_steps, "untimed steps per path")
      ->check(CLI::Range(0, 1000))
      ->capture_default_str();
  measure->add_option("--repeats", transfer_options.measure.repeats, "timed steps per path")
      ->check(CLI::Range(1, 10000))
      ->capture_default_str();
  measure
      ->add_option("--int8-group-size", transfer_options.measure.int8_group_size,
                   "INT8 scales: 0 per row, else 32, 64, 128 or 256")
      ->check(group_size_check(sp::kernels::is_supported_group_size, "0 (one scale per row), 32, 64, 128 or 256"))
      ->capture_default_str();
  measure
      ->add_option("--nf4-group-size", transfer_options.measure.nf4_group_size,
                   "NF4 scales: 32, 64, 128 or 256 elements per bf16 scale")
      ->check(group_size_check(sp::kernels::is_supported_nf4_group_size, "32, 64, 128 or 256"))
      ->capture_default_str();
  measure
      ->add_option("--rebuild", transfer_options.rebuild,
                   "trained paths: fused (what each image adds to the fused AdamW pass, as sp-train runs it) or "
                   "unfused (the rebuild from the masters after the optimizer)")
      ->check(CLI::IsMember({"fused", "unfused"}))
      ->capture_default_str();
  measure->add_option("--machine", transfer_options.machine,
                      "label of this machine in the report (default: host name)");
  measure->add_option("--out", transfer_options.output, "report file to write (atomically)")
      ->required()
      ->check(sp::runtime::output_file());

  std::vector<std::string> reports;
  std::string output;
  double threshold = 1.0;
  CLI::App* merge = app.add_subcommand(
      "merge-policy",
      "fold transfer reports (one per machine) into a transfer policy file: per path, the block "
      "sizes where every report measured INT8 (or NF4) at least --speedup-threshold times faster than BF16; "
      "reports without NF4 measurements allow NF4 nowhere");
  merge->add_option("--reports", reports, "transfer report JSON files")->required()->expected(1, -1);
  merge->add_option("--output", output, "policy file to write (atomically)")
      ->required()
      ->check(sp::runtime::output_file());
  merge->add_option("--speedup-threshold", threshold, "minimum INT8 / NF4 speedup over BF16")->capture_default_str();

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? kExitOk : kExitBadInput;
  }
  transfer_options.measure.fused_rebuild = transfer_options.rebuild == "fused";
  try {
    if (*measure) return transfer(transfer_options);
    if (*merge) return merge_policy(reports, output, threshold);
  } catch (const sp::adapters::TransferPolicyError& e) {
    fmt::print(stderr, "sp-bench: {}\n", e.what());
    return kExitBadInput;
  } catch (const std::bad_alloc&) {
    fmt::print(stderr, "sp-bench: not enough memory for these blocks; lower --max-kib, --blocks or --gpt-d-model\n");
    return kExitBadInput;
  } catch (const std::exception& e) {
    fmt::print(stderr, "sp-bench: {}\n", e.what());
    return 1;
  }
  return kExitOk;
}
