// Hot swaps of the real Selective Precision plugin. "V1" is the 1.0.0 edition fixture
// (build/test-fixtures/libsp_selective_precision_v1.so: the same sources built as 1.0.0, ABI
// 1.0, state format 1); "V2" is the shipped plugin, now 4.0.0 (build/plugins); "V2_COPY" is it
// under another file name. A run starts on 1.0.0 and upgrades live to the shipped plugin through
// export/import; with the v1 config, it decides exactly as 1.0.0 would have.
#include <sp/host/policy_host.h>

#include "test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <spdlog/logger.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace sp::host {
namespace {

using ::testing::AllOf;
using testing::CapturedLog;
using testing::Decision;
using testing::decisions_of;
using ::testing::HasSubstr;
using testing::make_blocks;
using testing::run_step;

constexpr std::uint32_t kBlocks = 12;
constexpr std::int64_t kSteps = 80;

// Short warmup, interval, window and cooldown, so that the synthetic trace makes blocks
// switch both ways within kSteps and every swap lands near some decision.
const PolicyConfig kConfig{R"(selective_precision:
  mode: dynamic
  warmup_steps: 3
  update_interval_steps: 2
  history_window: 3
  min_steps_between_switches: 4
  hysteresis_margin: 0.05
  force_bf16_blocks: [11]
  log_decisions: false
  telemetry_enabled: true
  telemetry_file: telemetry.jsonl
)",
                           "integration.yaml"};

// A private directory that outlives the host writing into it.
class ScratchDir {
 public:
  ScratchDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "sp-integration-XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = pattern;
  }
  ~ScratchDir() { std::filesystem::remove_all(path_); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

class RealPluginRun {
 public:
  // `supported_precisions`: what the host advertises (BF16 and INT8, PolicyHost's default,
  // unless a test transfers NF4 too). make_blocks describes the NF4 bytes of every block.
  explicit RealPluginRun(sp_precision_mask supported_precisions = PolicyHostOptions{}.supported_precisions)
      : host_(SP_SELECTIVE_PRECISION_V1, kConfig, make_blocks(kBlocks), options(supported_precisions)) {
    // Calibration errors are part of the plugin's state: the state blob must carry them,
    // so they keep steering decisions after a swap.
    EXPECT_TRUE(host_.set_calibration_errors({0, 4, 7}, {0.001, 0.08, 0.03}));
  }

  PolicyHost& host() { return host_; }
  // The plugin's telemetry so far, one JSON object per record, without the wall-clock
  // timestamp: the rest is a pure function of the trace and the state.
  std::vector<nlohmann::json> telemetry() const {
    std::vector<nlohmann::json> records;
    std::ifstream in(scratch_.path() / "telemetry.jsonl");
    for (std::string line; std::getline(in, line);) {
      nlohmann::json record = nlohmann::json::parse(line);
      record.erase("timestamp");
      records.push_back(std::move(record));
    }
    return records;
  }
  const CapturedLog& log() const { return log_; }
  const std::vector<Decision>& decisions() const { return decisions_; }
  void reserve_steps(std::size_t steps) { decisions_.reserve(steps * kBlocks); }

  void step(std::int64_t step) { record(step, run_step(host_, step)); }

  void record(std::int64_t step, const std::vector<sp_hint_v1>& hints) {
    const auto step_decisions = decisions_of(step, hints);
    decisions_.insert(decisions_.end(), step_decisions.begin(), step_decisions.end());
    EXPECT_EQ(host_.last_hint_source(), HintSource::plugin) << "step " << step;
  }

 private:
  PolicyHostOptions options(sp_precision_mask supported_precisions) {
    PolicyHostOptions result;
    result.logger = log_.logger();
    result.output_dir = scratch_.path();
    result.supported_precisions = supported_precisions;
    return result;
  }

  ScratchDir scratch_;
  CapturedLog log_;
  PolicyHost host_;
  std::vector<Decision> decisions_;
};

struct RunRecord {
  std::vector<Decision> decisions;
  std::vector<nlohmann::json> telemetry;
};

const RunRecord& uninterrupted_v1_run() {
  static const RunRecord record = [] {
    RealPluginRun run;
    for (std::int64_t step = 0; step < kSteps; ++step) run.step(step);
    return RunRecord{run.decisions(), run.telemetry()};
  }();
  return record;
}

const std::vector<Decision>& uninterrupted_v1_decisions() { return uninterrupted_v1_run().decisions; }

TEST(SelectivePrecisionTrace, SendsBlocksToBf16ForNonFiniteGradients) {
  std::size_t unsafe = 0;
  for (const Decision& d : uninterrupted_v1_decisions()) unsafe += d.reason == SP_REASON_UNSAFE;
  EXPECT_GE(unsafe, 3u) << "the trace must exercise the unsafe rule, so swaps must carry its flags";
}

TEST(SelectivePrecisionTrace, MakesBlocksSwitchBothWays) {
  const std::vector<Decision>& decisions = uninterrupted_v1_decisions();
  std::size_t to_int8 = 0;
  std::size_t to_bf16 = 0;
  for (std::size_t i = kBlocks; i < decisions.size(); ++i) {
    if (decisions[i].precision == decisions[i - kBlocks].precision) continue;
    (decisions[i].precision == SP_PRECISION_INT8 ? to_int8 : to_bf16) += 1;
  }
  EXPECT_GE(to_int8, 3u);
  EXPECT_GE(to_bf16, 3u);
}

// `record` restricted to the keys that `v1_record` has, recursively: a 2.0.0 record as 1.0.0
// would have written it (the 1.0.0 edition writes none of the fields 2.0.0 added).
nlohmann::json v1_fields(const nlohmann::json& record, const nlohmann::json& v1_record) {
  if (!record.is_object() || !v1_record.is_object()) return record;
  nlohmann::json out = nlohmann::json::object();
  for (auto it = v1_record.begin(); it != v1_record.end(); ++it) {
    if (record.contains(it.key())) out[it.key()] = v1_fields(record[it.key()], it.value());
  }
  return out;
}

class SwapV1ToV2AtStep : public ::testing::TestWithParam<std::int64_t> {};

TEST_P(SwapV1ToV2AtStep, GivesTheDecisionsOfAnUninterruptedV1Run) {
  const std::int64_t swap_step = GetParam();
  RealPluginRun run;
  for (std::int64_t step = 0; step < kSteps; ++step) {
    if (step == swap_step) {
      const SwapResult result = run.host().swap_now(SP_SELECTIVE_PRECISION_V2);
      ASSERT_EQ(result.outcome, SwapResult::Outcome::swapped) << result.message;
      EXPECT_TRUE(result.old_library_unloaded) << result.message;
      EXPECT_EQ(result.old_version, "1.0.0");
      EXPECT_EQ(result.new_version, "4.0.0");
      EXPECT_EQ(testing::mapped_regions_containing("libsp_selective_precision_v1.so"), 0u);
    }
    run.step(step);
  }
  EXPECT_EQ(run.host().plugin_version(), "4.0.0");
  EXPECT_EQ(run.decisions(), uninterrupted_v1_decisions());
  // Both versions appended to one telemetry file; together it is the uninterrupted one in
  // every field 1.0.0 writes (2.0.0 adds fields: blocks_nf4, s4, loss_spike, ...), with one
  // difference by design: the feedback of run_step reports 250 NF4 bytes a step, which the
  // host hands to 2.0.0 (ABI 1.1) but not to 1.0.0, whose 1.0-sized sp_step_feedback_v1 has
  // no h2d_bytes_nf4. So measured_bandwidth.bytes_saved (and saving_pct) of a record that
  // 2.0.0 wrote is that of 1.0.0 less the NF4 bytes 2.0.0 measured; everything else in
  // measured_bandwidth (steps and bytes carried across the swap in the state) is equal.
  const std::vector<nlohmann::json> telemetry = run.telemetry();
  ASSERT_EQ(telemetry.size(), uninterrupted_v1_run().telemetry.size());
  std::size_t records_with_nf4_bytes = 0;
  for (std::size_t i = 0; i < telemetry.size(); ++i) {
    const nlohmann::json& expected = uninterrupted_v1_run().telemetry[i];
    nlohmann::json got = v1_fields(telemetry[i], expected);
    const nlohmann::json& measured = telemetry[i]["measured_bandwidth"];
    if (measured.is_object()) {
      ASSERT_TRUE(expected["measured_bandwidth"].is_object()) << "record " << i;
      // Written by 2.0.0 exactly from the swap step on; 1.0.0 has no h2d_bytes_nf4 field.
      const bool by_v2 = telemetry[i]["step_id"].get<std::int64_t>() >= swap_step;
      EXPECT_EQ(measured.contains("h2d_bytes_nf4"), by_v2) << "record " << i;
      const double nf4 = measured.value("h2d_bytes_nf4", 0.0);
      const double all_bf16 = measured["h2d_bytes_all_bf16"].get<double>();
      records_with_nf4_bytes += nf4 > 0 ? 1 : 0;
      EXPECT_EQ(nf4 > 0, by_v2) << "record " << i;
      EXPECT_DOUBLE_EQ(measured["bytes_saved"].get<double>() + nf4,
                       expected["measured_bandwidth"]["bytes_saved"].get<double>())
          << "record " << i;
      EXPECT_DOUBLE_EQ(measured["saving_pct"].get<double>(), 100.0 * measured["bytes_saved"].get<double>() / all_bf16)
          << "record " << i;
      // Checked above; the rest must match exactly.
      got["measured_bandwidth"]["bytes_saved"] = expected["measured_bandwidth"]["bytes_saved"];
      got["measured_bandwidth"]["saving_pct"] = expected["measured_bandwidth"]["saving_pct"];
    }
    EXPECT_EQ(got, expected) << "record " << i << ", the patch from 1.0.0's record to this one: "
                             << nlohmann::json::diff(expected, got).dump();
  }
  EXPECT_GT(records_with_nf4_bytes, 0u);
}

// 0: before any state; 3: the first decision step; 4, 13: between decisions; 78: near the end.
INSTANTIATE_TEST_SUITE_P(AcrossTheRun, SwapV1ToV2AtStep, ::testing::Values(0, 3, 4, 13, 40, 78));

TEST(SelectivePrecisionHotSwap, RequestedMidStepTakesOverAtTheNextStepWithNoStepLost) {
  RealPluginRun run;
  for (std::int64_t step = 0; step < kSteps; ++step) {
    if (step == 21) {
      // Requested between compute_hints and end_step, as a file watcher might.
      run.host().begin_step(step);
      run.host().post_backward(step, testing::synthetic_moments(step, kBlocks));
      run.record(step, run.host().compute_hints(step));
      ASSERT_EQ(run.host().request_swap(SP_SELECTIVE_PRECISION_V2).outcome, SwapResult::Outcome::pending);
      run.host().end_step(step);
      EXPECT_EQ(run.host().plugin_version(), "1.0.0");
      continue;
    }
    run.step(step);
  }
  ASSERT_TRUE(run.host().last_swap_result().has_value());
  EXPECT_EQ(run.host().last_swap_result()->first_step, 22);
  EXPECT_EQ(run.host().plugin_version(), "4.0.0");
  EXPECT_EQ(run.decisions(), uninterrupted_v1_decisions());
}

TEST(SelectivePrecisionHotSwap, BackAndForthEverySevenStepsGivesTheUninterruptedDecisions) {
  RealPluginRun run;
  for (std::int64_t step = 0; step < kSteps; ++step) {
    if (step > 0 && step % 7 == 0) {
      // 1.0.0 upgrades to 2.0.0 at step 7; then 2.0.0 swaps between its two files (1.0.0 cannot
      // read the format-2 state of 2.0.0, as the real 1.0.0 could not).
      const char* next = step % 14 == 7 ? SP_SELECTIVE_PRECISION_V2 : SP_SELECTIVE_PRECISION_V2_COPY;
      const SwapResult result = run.host().swap_now(next);
      ASSERT_EQ(result.outcome, SwapResult::Outcome::swapped) << result.message;
    }
    run.step(step);
  }
  EXPECT_EQ(run.decisions(), uninterrupted_v1_decisions());
}

// Live upgrade on a host that transfers NF4: 1.0.0 -> 2.0.0 at a step boundary with the v1
// config (state migrated, identical decisions, no step lost), then a v2 config with the nf4
// tier, requested mid-step, takes over at the next step and sends blocks to NF4.
TEST(SelectivePrecisionHotSwap, LiveUpgradeFromOneDotZeroThenAnNf4ConfigTakesOver) {
  constexpr std::int64_t kUpgradeStep = 20;
  constexpr std::int64_t kNf4RequestStep = 50;
  RealPluginRun run(SP_PRECISION_BIT(SP_PRECISION_BF16) | SP_PRECISION_BIT(SP_PRECISION_INT8) |
                    SP_PRECISION_BIT(SP_PRECISION_NF4));
  // 1.0.0 cannot take NF4 errors: the host keeps them and hands them to 2.0.0 after the
  // upgrade, whence the format-2 state carries them. Block 4's error (e4 = 1, so s4 >= 0.3 >=
  // nf4_threshold) keeps it out of NF4; block 7's (e4 = 0) lets it go.
  ASSERT_TRUE(run.host().set_calibration_errors(SP_PRECISION_NF4, {4, 7}, {0.5, 0.0}));
  const PolicyConfig nf4_config{std::string(kConfig.text) + "  tiers: [bf16, int8, nf4]\n  nf4_threshold: 0.2\n",
                                "integration-v2.yaml"};
  const std::vector<Decision>& uninterrupted = uninterrupted_v1_decisions();
  for (std::int64_t step = 0; step < kSteps; ++step) {
    if (step == kUpgradeStep) {
      const SwapResult result = run.host().swap_now(SP_SELECTIVE_PRECISION_V2);
      ASSERT_EQ(result.outcome, SwapResult::Outcome::swapped) << result.message;
      EXPECT_EQ(result.old_version, "1.0.0");
      EXPECT_EQ(result.new_version, "4.0.0");
      EXPECT_TRUE(result.old_library_unloaded) << result.message;
      EXPECT_EQ(run.host().plugin_abi_minor(), 4u);
    }
    if (step == kNf4RequestStep) {
      // Requested between compute_hints and end_step; 2.0.0 takes over (from its other file)
      // with the new config at the next begin_step.
      run.host().begin_step(step);
      run.host().post_backward(step, testing::synthetic_moments(step, kBlocks));
      run.record(step, run.host().compute_hints(step));
      const SwapResult result = run.host().request_swap(SP_SELECTIVE_PRECISION_V2_COPY, nf4_config);
      ASSERT_EQ(result.outcome, SwapResult::Outcome::pending) << result.message;
      const sp_step_feedback_v1 feedback{0, 0, 2.5, 1000, 500, 2000, std::nan(""), 250};
      run.host().end_step(step, &feedback);
      continue;
    }
    run.step(step);
    if (step == kUpgradeStep) {
      ASSERT_TRUE(run.host().last_swap_result().has_value());
      EXPECT_EQ(run.host().last_swap_result()->first_step, kUpgradeStep);
    }
  }
  ASSERT_TRUE(run.host().last_swap_result().has_value());
  EXPECT_EQ(run.host().last_swap_result()->outcome, SwapResult::Outcome::swapped)
      << run.host().last_swap_result()->message;
  EXPECT_EQ(run.host().last_swap_result()->first_step, kNf4RequestStep + 1);
  EXPECT_EQ(run.host().plugin_version(), "4.0.0");
  EXPECT_EQ(run.host().hook_failures().total(), 0u);

  // Every step has its hints from a plugin (RealPluginRun::record checks the source), and up to
  // the step the nf4 config takes over they are those of the uninterrupted 1.0.0 run.
  const std::vector<Decision>& decisions = run.decisions();
  ASSERT_EQ(decisions.size(), uninterrupted.size());
  const std::size_t v1_config_end = static_cast<std::size_t>(kNf4RequestStep + 1) * kBlocks;
  EXPECT_TRUE(std::equal(decisions.begin(), decisions.begin() + static_cast<std::ptrdiff_t>(v1_config_end),
                         uninterrupted.begin()));
  std::size_t nf4_hints = 0;
  std::vector<bool> block_went_nf4(kBlocks, false);
  for (std::size_t i = 0; i < decisions.size(); ++i) {
    if (decisions[i].precision != SP_PRECISION_NF4) continue;
    EXPECT_GE(i, v1_config_end) << "NF4 before the nf4 config took over, step " << decisions[i].step;
    ++nf4_hints;
    block_went_nf4[decisions[i].block_id] = true;
  }
  EXPECT_GT(nf4_hints, 0u);
  EXPECT_TRUE(block_went_nf4[7]);
  EXPECT_FALSE(block_went_nf4[4]) << "block 4's NF4 calibration error did not reach 2.0.0";
  EXPECT_FALSE(block_went_nf4[11]) << "block 11 is forced to BF16";

  // The telemetry of 2.0.0 counts the NF4 blocks and shows the NF4 errors the host kept.
  std::size_t records_with_nf4_blocks = 0;
  for (const nlohmann::json& record : run.telemetry()) {
    if (record["step_id"].get<std::int64_t>() <= kNf4RequestStep) continue;
    records_with_nf4_blocks += record["blocks_nf4"].get<std::uint32_t>() > 0 ? 1 : 0;
    EXPECT_EQ(record["block_details"]["4"]["nf4_calibration_error"], 0.5);
  }
  EXPECT_GT(records_with_nf4_blocks, 0u);
}

TEST(SelectivePrecisionHotSwap, AFileWithAnotherAbiIsRefusedAndV1CarriesOn) {
  RealPluginRun run;
  for (std::int64_t step = 0; step < kSteps; ++step) {
    if (step == 30) {
      const SwapResult result = run.host().swap_now(SP_FIXTURE_BAD_ABI_MAJOR);
      EXPECT_EQ(result.outcome, SwapResult::Outcome::failed);
      EXPECT_THAT(result.message, AllOf(HasSubstr("selective_precision 1.0.0 stays active"),
                                        HasSubstr(SP_FIXTURE_BAD_ABI_MAJOR), HasSubstr("ABI 2.0")));
    }
    run.step(step);
  }
  EXPECT_EQ(run.host().plugin_version(), "1.0.0");
  EXPECT_EQ(run.decisions(), uninterrupted_v1_decisions());
}

TEST(SelectivePrecisionHotSwap, APluginThatCannotReadTheStateIsRefusedAndV1CarriesOn) {
  RealPluginRun run;
  for (std::int64_t step = 0; step < kSteps; ++step) {
    if (step == 30) {
      // The scripted fixture is another policy: it accepts its own config but not the
      // Selective Precision state blob.
      const SwapResult result =
          run.host().swap_now(SP_FIXTURE_SCRIPTED, PolicyConfig{"min_samples: 1\n", "other.yaml"});
      EXPECT_EQ(result.outcome, SwapResult::Outcome::failed);
      EXPECT_THAT(result.message, AllOf(HasSubstr("could not import the state of selective_precision 1.0.0"),
                                        HasSubstr("SP_ERR_STATE")));
      EXPECT_EQ(testing::mapped_regions_containing("libsp_fixture_scripted.so"), 0u);
    }
    run.step(step);
  }
  EXPECT_EQ(run.host().plugin_version(), "1.0.0");
  EXPECT_EQ(run.decisions(), uninterrupted_v1_decisions());
  EXPECT_THAT(run.log().text(), HasSubstr("could not import the state"));
}

TEST(SelectivePrecisionHotSwap, TwoHundredCyclesHoldNoExtraFilesMappingsOrMemory) {
  RealPluginRun run;
  // Keep warnings (a library that failed to unload) but not the per-swap info lines,
  // whose growing buffer would itself show up as memory and mappings.
  run.log().logger()->set_level(spdlog::level::warn);
  // The run records every decision; its storage must not count as growth.
  run.reserve_steps(256);
  std::int64_t step = 0;
  auto swap_cycle = [&] {
    const SwapResult result =
        run.host().swap_now(step % 2 == 0 ? SP_SELECTIVE_PRECISION_V2_COPY : SP_SELECTIVE_PRECISION_V2);
    ASSERT_EQ(result.outcome, SwapResult::Outcome::swapped) << result.message;
    ASSERT_TRUE(result.old_library_unloaded) << result.message;
    run.step(step++);
  };
  // Allocations that live as long as the process (the loader's caches, yaml-cpp and fmt
  // statics reached for the first time) happen in the first cycles.
  for (int warmup = 0; warmup < 4; ++warmup) swap_cycle();
  const testing::ProcessResources before = testing::process_resources();
  for (int cycle = 0; cycle < 200; ++cycle) swap_cycle();
  const testing::ProcessResources after = testing::process_resources();

  EXPECT_EQ(after.open_fds, before.open_fds);
  EXPECT_EQ(after.mapped_file_regions, before.mapped_file_regions);
  if (testing::kHeapStatisticsAreMeaningful) {
    EXPECT_LE(after.heap_bytes_in_use, before.heap_bytes_in_use + testing::kHeapGrowthLimit)
        << "grew by " << after.heap_bytes_in_use - std::min(after.heap_bytes_in_use, before.heap_bytes_in_use)
        << " bytes over 200 swaps";
  }
  EXPECT_EQ(run.host().hook_failures().total(), 0u);
}

}  // namespace
}  // namespace sp::host
