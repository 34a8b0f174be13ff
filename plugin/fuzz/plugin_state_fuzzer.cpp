// Fuzzes the policy plugin's state blob reader: PolicyEngine::import_state (decode_state in
// state_codec.cpp), which the plugin's import_state hook calls with the bytes a host hands over
// during a hot swap or a resume.
//
// Input: one flags byte, then the blob. Flags bit 0: re-seal the CRC-32 trailer before importing
// (so that mutations reach the field checks behind the checksum); bit 1: import into an engine
// whose loss guard is enabled (mode dynamic), else into one like the state fixtures' (guard off).
//
// Contract checked (state_codec.h, docs/architecture.md "Hot swap"):
//   - import_state either succeeds or throws sp::policy::StateError; anything else escapes and
//     the fuzzer reports it;
//   - a rejected blob leaves the engine exactly as it was (its exported state is unchanged);
//   - an accepted blob gives a usable policy: its export imports again into a fresh engine and
//     exports the same bytes (a fixed point), and a whole step (begin_step, post_backward,
//     compute_hints, end_step) runs on it without any exception and gives valid hints.
// Any violation aborts.
#include "state_configs.h"
#include "fuzz_support.h"
#include "sp/policy/config.h"
#include "sp/policy/engine.h"
#include "sp/policy/errors.h"

#include <boost/crc.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <string>
#include <vector>

namespace {

using sp::policy::PolicySettings;
using sp::policy::PolicyEngine;

constexpr std::uint32_t kBlocks = sp::fuzz::kStateBlocks;
constexpr const char *kFixtureConfig = sp::fuzz::kStateFixtureConfig;
constexpr const char *kGuardConfig = sp::fuzz::kStateGuardConfig;

[[noreturn]] void fail(const std::string &what) { sp::fuzz::contract_violated("plugin_state_fuzzer", what); }

const PolicySettings &config(bool guard) {
  static const PolicySettings fixture = sp::policy::parse_policy_config(kFixtureConfig, kBlocks).config;
  static const PolicySettings with_guard = sp::policy::parse_policy_config(kGuardConfig, kBlocks).config;
  return guard ? with_guard : fixture;
}

std::unique_ptr<PolicyEngine> make_engine(bool guard) {
  std::vector<sp::policy::BlockBytes> bytes(kBlocks, sp::policy::BlockBytes{2000, 1000, 0});
  auto engine = std::make_unique<PolicyEngine>(config(guard), std::move(bytes), nullptr, "");
  const std::uint64_t nf4[kBlocks] = {600, 600, 600, 600, 600, 600};
  engine->set_transfer_bytes(SP_PRECISION_NF4, nf4, kBlocks);
  return engine;
}

// One whole step after an accepted import: the hooks a host calls next must work.
void run_step(PolicyEngine &engine) {
  const std::int64_t current = engine.state().current_step;
  if (current == std::numeric_limits<std::int64_t>::max()) return;  // no later step exists
  const std::int64_t step = current < 0 ? 0 : current + 1;
  engine.begin_step(step);
  std::vector<sp_grad_moments_v1> moments;
  for (std::uint32_t b = 0; b < kBlocks; ++b) {
    if (b == 2) continue;  // a block without gradient this step
    const double l2 = 0.3 + 0.5 * b;
    moments.push_back(sp_grad_moments_v1{b, 0, l2 * l2, 0.01, l2, 1000, b == 4 ? 1u : 0u});
  }
  engine.post_backward(step, moments.data(), static_cast<std::uint32_t>(moments.size()));
  std::vector<sp_hint_v1> hints(kBlocks);
  engine.compute_hints(step, hints.data(), kBlocks);
  for (std::uint32_t b = 0; b < kBlocks; ++b) {
    const sp_hint_v1 &hint = hints[b];
    if (hint.block_id != b) fail("compute_hints after import: hints out of block order");
    if (hint.precision != SP_PRECISION_BF16 && hint.precision != SP_PRECISION_INT8 &&
        hint.precision != SP_PRECISION_NF4) {
      fail("compute_hints after import: a hint with an unknown precision");
    }
  }
  sp_step_feedback_v1 feedback{};
  feedback.struct_size = sizeof feedback;
  feedback.loss = 2.5;
  feedback.step_seconds = std::numeric_limits<double>::quiet_NaN();
  engine.end_step(step, &feedback);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t *data, std::size_t size) {
  if (size == 0) return 0;
  const std::uint8_t flags = data[0];
  std::vector<std::uint8_t> blob(data + 1, data + size);
  if ((flags & 1u) && blob.size() >= 4) {
    boost::crc_32_type crc;
    crc.process_bytes(blob.data(), blob.size() - 4);
    const std::uint32_t sum = crc.checksum();
    for (int i = 0; i < 4; ++i) blob[blob.size() - 4 + i] = static_cast<std::uint8_t>(sum >> (8 * i));
  }
  const bool guard = (flags & 2u) != 0;

  std::unique_ptr<PolicyEngine> engine = make_engine(guard);
  const std::vector<std::uint8_t> before = engine->export_state();
  try {
    engine->import_state(blob.data(), blob.size());
  } catch (const sp::policy::StateError &) {
    if (engine->export_state() != before) fail("a rejected blob changed the engine's state");
    return 0;
  }

  const std::vector<std::uint8_t> exported = engine->export_state();
  std::unique_ptr<PolicyEngine> again = make_engine(guard);
  try {
    again->import_state(exported.data(), exported.size());
  } catch (const sp::policy::StateError &error) {
    fail(std::string("the export of an accepted blob was rejected: ") + error.what());
  }
  if (again->export_state() != exported) fail("export -> import -> export is not a fixed point");

  run_step(*engine);
  return 0;
}
