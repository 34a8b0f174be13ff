// Fuzzes the policy plugin's config reader: parse_policy_config (config.cpp), which the plugin's
// create hook runs on the YAML text a host hands over (a standalone policy file, or the
// memory.stagehand.selective_precision section of a training config).
//
// Input: the YAML text, for a model of 8 blocks.
//
// Contract checked (config.h, errors.h):
//   - parse_policy_config and check_host_precisions either succeed or throw
//     sp::policy::PolicyConfigError; anything else escapes and the fuzzer reports it;
//   - a PolicyConfigError has a message;
//   - an accepted config builds a PolicyEngine (telemetry switched off here, so that no fuzzed
//     path is ever written) on which two whole steps run without any exception and give hints
//     of a known precision for every block, in block order.
// Any violation aborts.
#include "fuzz_support.h"
#include "sp/policy/config.h"
#include "sp/policy/engine.h"
#include "sp/policy/errors.h"

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

namespace {

constexpr std::uint32_t kBlocks = 8;

[[noreturn]] void fail(const std::string &what) { sp::fuzz::contract_violated("policy_config_fuzzer", what); }

void run_steps(sp::policy::PolicyEngine &engine) {
  const std::uint32_t ids[] = {0, 3, 7};
  const double errors[] = {0.01, 0.2, 0.07};
  engine.set_calibration_errors(ids, errors, 3);
  engine.set_precision_calibration_errors(SP_PRECISION_NF4, ids, errors, 3);
  std::vector<sp_hint_v1> hints(kBlocks);
  for (std::int64_t step = 0; step < 2; ++step) {
    engine.begin_step(step);
    std::vector<sp_grad_moments_v1> moments;
    for (std::uint32_t b = 0; b < kBlocks; ++b) {
      const double l2 = 0.1 + 0.4 * b + 0.05 * static_cast<double>(step);
      moments.push_back(sp_grad_moments_v1{b, 0, l2 * l2, 0.0, l2, 512, b == 5 ? 2u : 0u});
    }
    engine.post_backward(step, moments.data(), kBlocks);
    engine.compute_hints(step, hints.data(), kBlocks);
    for (std::uint32_t b = 0; b < kBlocks; ++b) {
      if (hints[b].block_id != b) fail("hints out of block order");
      const sp_precision p = hints[b].precision;
      if (p != SP_PRECISION_BF16 && p != SP_PRECISION_INT8 && p != SP_PRECISION_NF4) fail("unknown hint precision");
    }
    sp_step_feedback_v1 feedback{};
    feedback.struct_size = sizeof feedback;
    feedback.loss = 3.0 - 0.1 * static_cast<double>(step);
    feedback.step_seconds = std::numeric_limits<double>::quiet_NaN();
    engine.end_step(step, &feedback);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t *data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char *>(data), size);
  sp::policy::ParsedConfig parsed;
  try {
    parsed = sp::policy::parse_policy_config(text, kBlocks);
  } catch (const sp::policy::PolicyConfigError &error) {
    if (std::string(error.what()).empty()) fail("a PolicyConfigError without a message");
    return 0;
  }
  // A host of ABI 1.0 (BF16 and INT8), then one that also transfers NF4.
  const sp_precision_mask int8_host = SP_PRECISION_BIT(SP_PRECISION_BF16) | SP_PRECISION_BIT(SP_PRECISION_INT8);
  bool fits_int8_host = true;
  try {
    sp::policy::check_host_precisions(parsed, int8_host);
  } catch (const sp::policy::PolicyConfigError &) {
    fits_int8_host = false;
  }
  try {
    sp::policy::check_host_precisions(parsed, int8_host | SP_PRECISION_BIT(SP_PRECISION_NF4));
  } catch (const sp::policy::PolicyConfigError &) {
    if (fits_int8_host) fail("a config that fits a BF16+INT8 host does not fit a BF16+INT8+NF4 host");
    return 0;
  }

  sp::policy::PolicySettings config = parsed.config;
  config.telemetry_enabled = false;  // never write a file the input names
  std::vector<sp::policy::BlockBytes> bytes(kBlocks, sp::policy::BlockBytes{4096, 2048, 0});
  sp::policy::PolicyEngine engine(config, std::move(bytes), nullptr, "");
  const std::vector<std::uint64_t> nf4(kBlocks, 1100);
  engine.set_transfer_bytes(SP_PRECISION_NF4, nf4.data(), kBlocks);
  run_steps(engine);
  return 0;
}
