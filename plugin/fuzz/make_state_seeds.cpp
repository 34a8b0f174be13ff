// Writes the format-2 seeds of plugin_state_fuzzer (one flags byte, then a blob exported by the
// current policy core): fresh and mid-run engines of both harness configs. Run once by hand; the
// files are committed beside the 1.0.0 fixtures copied from plugin/selective_precision/tests/data:
//
//   build-fuzz/bin/plugin_state_seed_writer plugin/fuzz/corpus/plugin_state
#include "state_configs.h"
#include "sp/policy/config.h"
#include "sp/policy/engine.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

namespace {

constexpr std::uint32_t kBlocks = sp::fuzz::kStateBlocks;
constexpr const char *kFixtureConfig = sp::fuzz::kStateFixtureConfig;
constexpr const char *kGuardConfig = sp::fuzz::kStateGuardConfig;

void write_seed(const std::string &path, std::uint8_t flags, const std::vector<std::uint8_t> &blob) {
  std::ofstream out(path, std::ios::binary);
  out.put(static_cast<char>(flags));
  out.write(reinterpret_cast<const char *>(blob.data()), static_cast<std::streamsize>(blob.size()));
}

void run(sp::policy::PolicyEngine &engine, int steps, bool spike) {
  std::vector<sp_hint_v1> hints(kBlocks);
  for (std::int64_t step = 0; step < steps; ++step) {
    engine.begin_step(step);
    std::vector<sp_grad_moments_v1> moments;
    for (std::uint32_t b = 0; b < kBlocks; ++b) {
      if ((step + b) % 5 == 3) continue;
      const double l2 = 0.05 + std::fabs(std::sin(0.4 * static_cast<double>(step) + b)) * 0.6 * b;
      moments.push_back(sp_grad_moments_v1{b, 0, l2 * l2, 0.0, l2, 1000, (step * 3 + b) % 11 == 4 ? 1u : 0u});
    }
    engine.post_backward(step, moments.data(), static_cast<std::uint32_t>(moments.size()));
    engine.compute_hints(step, hints.data(), kBlocks);
    sp_step_feedback_v1 feedback{};
    feedback.struct_size = sizeof feedback;
    feedback.loss = spike && step == steps - 1 ? 50.0 : 3.0 - 0.01 * static_cast<double>(step);
    feedback.h2d_bytes_bf16 = 4000;
    feedback.h2d_bytes_int8 = 1000;
    feedback.h2d_bytes_all_bf16 = 6000;
    feedback.step_seconds = std::numeric_limits<double>::quiet_NaN();
    feedback.h2d_bytes_nf4 = 300;
    engine.end_step(step, &feedback);
  }
}

}  // namespace

int main(int argc, char **argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  const char *names[] = {"v2-fixture-config", "v2-guard-config"};
  const char *configs[] = {kFixtureConfig, kGuardConfig};
  for (int guard = 0; guard < 2; ++guard) {
    const auto config = sp::policy::parse_policy_config(configs[guard], kBlocks).config;
    for (int steps : {0, 9}) {
      sp::policy::PolicyEngine engine(config, std::vector<sp::policy::BlockBytes>(kBlocks, {2000, 1000, 0}), nullptr,
                                      "");
      const std::uint64_t nf4[kBlocks] = {600, 600, 600, 600, 600, 600};
      engine.set_transfer_bytes(SP_PRECISION_NF4, nf4, kBlocks);
      const std::uint32_t ids[] = {1, 3};
      const double errors[] = {0.01, 0.2};
      engine.set_calibration_errors(ids, errors, 2);
      engine.set_precision_calibration_errors(SP_PRECISION_NF4, ids, errors, 2);
      run(engine, steps, guard == 1);
      const std::string name = std::string(names[guard]) + (steps == 0 ? "-fresh" : "-mid-run");
      // Flags: bit 1 selects the guard engine; the blob is already sealed (bit 0 clear).
      write_seed(dir + "/" + name, static_cast<std::uint8_t>(guard << 1), engine.export_state());
    }
  }
  return 0;
}
