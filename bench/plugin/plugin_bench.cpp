// Costs of the policy plugin as a host sees them, written as JSON:
//   - compute_hints for 48 blocks at a decision step (every step is one here), through the ABI;
//   - what the ABI adds per hook over calling the policy engine directly (the same work,
//     driven in lockstep on two identical instances, one through the .so, one linked in);
//   - a full hot swap through the host library: load, create, export, import, switch,
//     unload and the unload check.
// Targets (issue 2): compute_hints <= 5 us, ABI overhead <= 100 ns, hot swap <= 20 ms.

#include <chrono>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <random>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <spdlog/sinks/null_sink.h>
#include <spdlog/spdlog.h>

#include "../common/bench_cli.h"
#include "../common/bench_report.h"
#include "sp/host/plugin_library.h"
#include "sp/host/policy_host.h"
#include "sp/policy/config.h"
#include "sp/policy/engine.h"
#include "sp/runtime/atomic_file.h"

namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

constexpr uint32_t kBlocks = 48;

// Every step a decision step and nothing written, so the figure is the policy's own work.
const char* kConfig = R"(selective_precision:
  mode: dynamic
  warmup_steps: 0
  update_interval_steps: 1
  min_steps_between_switches: 3
  history_window: 5
  log_decisions: false
  telemetry_enabled: false
)";

double elapsed_ns(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::nano>(b - a).count();
}

// The smallest step steady_clock shows on this machine: per-call figures below it, such as
// the ABI overhead, are differences of medians and read as "within the clock's resolution".
double clock_resolution_ns() {
  double smallest = 1e9;
  for (int i = 0; i < 10000; ++i) {
    const auto a = Clock::now();
    auto b = Clock::now();
    while (b == a) b = Clock::now();
    smallest = std::min(smallest, elapsed_ns(a, b));
  }
  return smallest;
}

// Moments whose relative magnitudes wander, so blocks keep crossing the thresholds.
class MomentSource {
 public:
  explicit MomentSource(uint64_t seed) : rng_(seed) {}
  const std::vector<sp_grad_moments_v1>& next() {
    moments_.resize(kBlocks);
    std::lognormal_distribution<double> noise(0.0, 0.6);
    for (uint32_t b = 0; b < kBlocks; ++b) {
      const double l2 = (0.2 + 2.0 * b / kBlocks) * noise(rng_);
      moments_[b] = {b, 0, l2 * l2, 1e-3 * l2, l2 * 1e-3, 1u << 20, 0};
    }
    return moments_;
  }

 private:
  std::mt19937_64 rng_;
  std::vector<sp_grad_moments_v1> moments_;
};

void check(sp_status status, const sp_policy_plugin_v1_table& t, const sp_policy_ctx* ctx, const char* what) {
  if (status != SP_OK) throw std::runtime_error(std::string(what) + ": " + t.last_error(ctx));
}

struct HookTimes {
  std::vector<double> begin_step, post_backward, compute_hints, end_step;
};

json hook_json(const HookTimes& direct, const HookTimes& abi) {
  json out;
  const auto one = [&](const char* name, const std::vector<double>& d, const std::vector<double>& a) {
    const auto pd = sp::bench::percentiles(d);
    const auto pa = sp::bench::percentiles(a);
    out[name] = {
        {"direct", pd.to_json("ns")}, {"abi", pa.to_json("ns")}, {"abi_overhead_median_ns", pa.median - pd.median}};
  };
  one("begin_step", direct.begin_step, abi.begin_step);
  one("post_backward", direct.post_backward, abi.post_backward);
  one("compute_hints", direct.compute_hints, abi.compute_hints);
  one("end_step", direct.end_step, abi.end_step);
  return out;
}

json bench_hooks(const std::filesystem::path& plugin_file, int steps) {
  sp::host::PluginLibrary library = sp::host::PluginLibrary::load(plugin_file);
  const sp_policy_plugin_v1_table& t = library.table();
  std::vector<sp_block_desc_v1> descs(kBlocks);
  std::vector<sp::policy::BlockBytes> bytes(kBlocks);
  for (uint32_t b = 0; b < kBlocks; ++b) {
    descs[b] = {sizeof(sp_block_desc_v1), b, 12u << 20, 24u << 20, (12u << 20) + (1u << 16), nullptr};
    bytes[b] = {descs[b].bf16_bytes, descs[b].int8_bytes};
  }
  sp_host_api_v1 host{};
  host.struct_size = sizeof(host);
  host.abi_major = SP_PLUGIN_ABI_MAJOR;
  host.abi_minor = SP_PLUGIN_ABI_MINOR;
  host.host_name = "sp-bench-plugin";
  host.host_version = "0";
  // The default tiers hint INT8; a host that left the mask out would be one moving BF16 alone.
  host.supported_precisions = SP_PRECISION_BIT(SP_PRECISION_BF16) | SP_PRECISION_BIT(SP_PRECISION_INT8);
  sp_policy_ctx* ctx = nullptr;
  check(t.create(&host, kConfig, descs.data(), kBlocks, &ctx), t, nullptr, "create");
  sp::policy::PolicyEngine engine(sp::policy::parse_policy_config(kConfig, kBlocks).config, bytes, nullptr, "");

  MomentSource source(7);
  std::vector<sp_hint_v1> hints_abi(kBlocks), hints_direct(kBlocks);
  sp_step_feedback_v1 feedback{sizeof(feedback), 0, 2.5, 1u << 30, 1u << 29, 1u << 31, NAN, 0};
  HookTimes direct, abi;
  uint64_t int8_hints = 0, disagreements = 0;
  const int warmup = steps / 10;
  for (int64_t s = 0; s < steps; ++s) {
    const auto& m = source.next();
    const bool keep = s >= warmup;
    const auto time = [&](std::vector<double>& into, auto&& call) {
      const auto t0 = Clock::now();
      call();
      const auto t1 = Clock::now();
      if (keep) into.push_back(elapsed_ns(t0, t1));
    };
    time(direct.begin_step, [&] { engine.begin_step(s); });
    time(abi.begin_step, [&] { check(t.begin_step(ctx, s), t, ctx, "begin_step"); });
    time(direct.post_backward, [&] { engine.post_backward(s, m.data(), kBlocks); });
    time(abi.post_backward, [&] { check(t.post_backward(ctx, s, m.data(), kBlocks), t, ctx, "post_backward"); });
    time(direct.compute_hints, [&] { engine.compute_hints(s, hints_direct.data(), kBlocks); });
    time(abi.compute_hints,
         [&] { check(t.compute_hints(ctx, s, hints_abi.data(), kBlocks), t, ctx, "compute_hints"); });
    time(direct.end_step, [&] { engine.end_step(s, &feedback); });
    time(abi.end_step, [&] { check(t.end_step(ctx, s, &feedback), t, ctx, "end_step"); });
    for (uint32_t b = 0; b < kBlocks; ++b) {
      int8_hints += hints_abi[b].precision == SP_PRECISION_INT8;
      disagreements += hints_abi[b].precision != hints_direct[b].precision;
    }
  }
  t.destroy(ctx);
  if (disagreements != 0) throw std::runtime_error("the .so and the linked engine disagreed: not the same code");

  json out = hook_json(direct, abi);
  out["steps_timed"] = steps - warmup;
  out["int8_share_of_hints"] = static_cast<double>(int8_hints) / (static_cast<double>(steps) * kBlocks);
  return out;
}

json bench_hot_swap(const std::filesystem::path& v1, const std::filesystem::path& v2, int swaps) {
  sp::host::PolicyHostOptions options;
  options.host_name = "sp-bench-plugin";
  options.logger = std::make_shared<spdlog::logger>("bench", std::make_shared<spdlog::sinks::null_sink_mt>());
  std::vector<sp::host::BlockDescription> blocks(kBlocks);
  for (uint32_t b = 0; b < kBlocks; ++b) blocks[b] = {b, 12u << 20, {{24u << 20, (12u << 20) + (1u << 16), 0}}, ""};
  sp::host::PolicyHost host(v1, {kConfig, "<bench>"}, blocks, options);
  MomentSource source(11);
  std::vector<double> swap_ms;
  uint64_t not_unloaded = 0;
  for (int i = 0; i < swaps; ++i) {
    host.begin_step(i);
    host.post_backward(i, source.next());
    host.compute_hints(i);
    host.end_step(i);
    const auto t0 = Clock::now();
    const sp::host::SwapResult result = host.swap_now(i % 2 == 0 ? v2 : v1);
    const auto t1 = Clock::now();
    if (result.outcome != sp::host::SwapResult::Outcome::swapped)
      throw std::runtime_error("swap failed: " + result.message);
    not_unloaded += !result.old_library_unloaded;
    swap_ms.push_back(elapsed_ns(t0, t1) / 1e6);
  }
  return {{"swaps", swaps},
          {"time", sp::bench::percentiles(swap_ms).to_json("ms")},
          {"old_library_still_loaded", not_unloaded}};
}

}  // namespace

int main(int argc, char** argv) {
  std::filesystem::path v1 = SP_BENCH_PLUGIN_V1, v2 = SP_BENCH_PLUGIN_V2, out = "bench/results/plugin-cpu.json";
  int steps = 20000, swaps = 100;
  std::string commit = "unknown";
  CLI::App app{"sp-bench-plugin: costs of the policy plugin's hooks, the ABI and a hot swap, as JSON"};
  app.add_option("--plugin", v1, "plugin .so (v1)")->capture_default_str();
  app.add_option("--plugin-v2", v2, "second version for the swap benchmark")->capture_default_str();
  app.add_option("--steps", steps, "steps to time")->check(CLI::Range(100, 10000000))->capture_default_str();
  app.add_option("--swaps", swaps, "hot swaps to time")->check(CLI::Range(2, 100000))->capture_default_str();
  app.add_option("--commit", commit, "commit measured, recorded in the JSON");
  app.add_option("--out", out, "JSON output")->capture_default_str()->check(sp::runtime::output_file());
  if (const int exit_code = sp::bench::parse_command_line(app, argc, argv); exit_code >= 0) return exit_code;

  try {
    json hooks = bench_hooks(v1, steps);
    json swap = bench_hot_swap(v1, v2, swaps);
    const double hints_us = hooks["compute_hints"]["abi"]["median_ns"].get<double>() / 1e3;
    double worst_overhead = 0;
    for (const char* hook : {"begin_step", "post_backward", "compute_hints", "end_step"}) {
      worst_overhead = std::max(worst_overhead, hooks[hook]["abi_overhead_median_ns"].get<double>());
    }
    const double swap_ms = swap["time"]["median_ms"].get<double>();
    json report = {{"benchmark", "plugin"},
                   {"commit", commit},
                   {"machine", sp::bench::machine_description()},
                   {"clock_resolution_ns", clock_resolution_ns()},
                   {"blocks", kBlocks},
                   {"hooks", hooks},
                   {"hot_swap", swap},
                   {"targets",
                    {{"compute_hints_48_blocks_us", {{"median", hints_us}, {"limit", 5.0}, {"met", hints_us <= 5.0}}},
                     {"abi_overhead_ns",
                      {{"worst_hook_median", worst_overhead}, {"limit", 100.0}, {"met", worst_overhead <= 100.0}}},
                     {"hot_swap_ms", {{"median", swap_ms}, {"limit", 20.0}, {"met", swap_ms <= 20.0}}}}}};
    if (!out.parent_path().empty()) std::filesystem::create_directories(out.parent_path());
    sp::bench::write_report(out, report);
    std::cout << report["targets"].dump(2) << "\nwritten to " << out.string() << "\n";
  } catch (const std::exception& e) {
    std::cerr << "sp-bench-plugin: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
