#include <sp/host/policy_host.h>

#include "test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <spdlog/logger.h>

#include <stdexcept>
#include <string>

namespace sp::host {
namespace {

using ::testing::AllOf;
using testing::CapturedLog;
using testing::Decision;
using testing::decisions_of;
using ::testing::HasSubstr;
using testing::make_blocks;
using testing::run_step;

constexpr std::uint32_t kBlocks = 8;
constexpr std::int64_t kSteps = 40;
const PolicyConfig kConfig{"int8_max_l2: 1.5\nmin_samples: 2\n", "example.yaml"};

PolicyHostOptions quiet_options(const CapturedLog& log) {
  PolicyHostOptions options;
  options.logger = log.logger();
  return options;
}

std::vector<Decision> uninterrupted_run() {
  CapturedLog log;
  PolicyHost host(SP_EXAMPLE_MINIMAL_C, kConfig, make_blocks(kBlocks), quiet_options(log));
  std::vector<Decision> decisions;
  for (std::int64_t step = 0; step < kSteps; ++step) {
    const auto step_decisions = decisions_of(step, run_step(host, step));
    decisions.insert(decisions.end(), step_decisions.begin(), step_decisions.end());
  }
  return decisions;
}

class SwapAtStep : public ::testing::TestWithParam<std::int64_t> {};

// The scripted fixture runs the example's policy, so a swap that carries the state over
// must not change a single decision.
TEST_P(SwapAtStep, GivesTheDecisionsOfAnUninterruptedRun) {
  const std::int64_t swap_step = GetParam();
  const std::vector<Decision> expected = uninterrupted_run();
  ASSERT_GT(testing::count_switches(expected, kBlocks), 0u) << "the trace must make blocks switch";

  CapturedLog log;
  PolicyHost host(SP_EXAMPLE_MINIMAL_C, kConfig, make_blocks(kBlocks), quiet_options(log));
  std::vector<Decision> decisions;
  for (std::int64_t step = 0; step < kSteps; ++step) {
    if (step == swap_step) {
      const SwapResult result = host.swap_now(SP_FIXTURE_SCRIPTED);
      ASSERT_EQ(result.outcome, SwapResult::Outcome::swapped) << result.message;
      EXPECT_FALSE(result.first_step.has_value()) << "known only when the next step begins";
      EXPECT_TRUE(result.old_library_unloaded) << result.message;
      EXPECT_EQ(host.plugin_name(), "scripted_fixture");
    }
    const auto step_decisions = decisions_of(step, run_step(host, step));
    if (step == swap_step) {
      EXPECT_EQ(host.last_swap_result()->first_step, swap_step);
    }
    decisions.insert(decisions.end(), step_decisions.begin(), step_decisions.end());
  }
  EXPECT_EQ(decisions, expected);
}

INSTANTIATE_TEST_SUITE_P(EarlyMiddleLate, SwapAtStep, ::testing::Values(0, 1, 13, 39));

TEST(HotSwap, RequestedSwapTakesOverAtTheNextBeginStep) {
  CapturedLog log;
  PolicyHost host(SP_EXAMPLE_MINIMAL_C, kConfig, make_blocks(kBlocks), quiet_options(log));
  for (std::int64_t step = 0; step < 5; ++step) run_step(host, step);

  host.begin_step(5);
  const SwapResult requested = host.request_swap(SP_FIXTURE_SCRIPTED);
  EXPECT_EQ(requested.outcome, SwapResult::Outcome::pending) << requested.message;
  EXPECT_TRUE(host.swap_pending());
  host.post_backward(5, testing::synthetic_moments(5, kBlocks));
  host.compute_hints(5);
  host.end_step(5);
  EXPECT_EQ(host.plugin_name(), "minimal_c") << "the swap happened inside a step";
  EXPECT_FALSE(host.last_swap_result().has_value());

  host.begin_step(6);
  EXPECT_FALSE(host.swap_pending());
  EXPECT_EQ(host.plugin_name(), "scripted_fixture");
  ASSERT_TRUE(host.last_swap_result().has_value());
  EXPECT_EQ(host.last_swap_result()->outcome, SwapResult::Outcome::swapped);
  EXPECT_EQ(host.last_swap_result()->first_step, 6);
  EXPECT_TRUE(host.last_swap_result()->old_library_unloaded);
  EXPECT_EQ(testing::mapped_regions_containing("libsp_example_minimal_c.so"), 0u);
  EXPECT_THAT(log.text(), HasSubstr("scripted_fixture 1.0.0 replaced minimal_c 1.0.0 from step 6"));
}

// A staged swap can be dropped before it takes over (data parallel: another rank could not
// stage it): the new version is unloaded, the old one keeps deciding, the reason is recorded.
TEST(HotSwap, ACancelledSwapUnloadsTheNewVersionAndKeepsTheOld) {
  CapturedLog log;
  PolicyHost host(SP_EXAMPLE_MINIMAL_C, kConfig, make_blocks(kBlocks), quiet_options(log));
  run_step(host, 0);
  EXPECT_FALSE(host.cancel_swap("nothing pending").has_value());
  ASSERT_EQ(host.request_swap(SP_FIXTURE_SCRIPTED).outcome, SwapResult::Outcome::pending);
  const std::optional<SwapResult> cancelled = host.cancel_swap("rank 1 of 2 could not load it");
  ASSERT_TRUE(cancelled.has_value());
  EXPECT_EQ(cancelled->outcome, SwapResult::Outcome::failed);
  EXPECT_EQ(cancelled->message, "rank 1 of 2 could not load it");
  EXPECT_FALSE(host.swap_pending());
  EXPECT_EQ(testing::mapped_regions_containing("libsp_fixture_scripted.so"), 0u);
  run_step(host, 1);
  EXPECT_EQ(host.plugin_name(), "minimal_c");
  EXPECT_EQ(host.last_swap_result()->outcome, SwapResult::Outcome::failed);
  EXPECT_THAT(log.text(), HasSubstr("cancelled, minimal_c 1.0.0 stays: rank 1 of 2 could not load it"));
}

TEST(HotSwap, SwapNowInsideAStepIsACallerBug) {
  PolicyHost host(SP_EXAMPLE_MINIMAL_C, kConfig, make_blocks(kBlocks));
  host.begin_step(0);
  EXPECT_THROW(host.swap_now(SP_FIXTURE_SCRIPTED), std::logic_error);
}

TEST(HotSwap, AFileThatFailsToLoadLeavesTheOldPluginActive) {
  CapturedLog log;
  PolicyHost host(SP_EXAMPLE_MINIMAL_C, kConfig, make_blocks(kBlocks), quiet_options(log));
  run_step(host, 0);
  const SwapResult result = host.request_swap(SP_FIXTURE_BAD_ABI_MAJOR);
  EXPECT_EQ(result.outcome, SwapResult::Outcome::failed);
  EXPECT_THAT(result.message, AllOf(HasSubstr(SP_FIXTURE_BAD_ABI_MAJOR), HasSubstr("minimal_c 1.0.0 stays active"),
                                    HasSubstr("built for plugin ABI 2.0")));
  EXPECT_FALSE(host.swap_pending());
  run_step(host, 1);
  EXPECT_EQ(host.plugin_name(), "minimal_c");
  EXPECT_EQ(host.last_hint_source(), HintSource::plugin);
  EXPECT_THAT(log.text(), HasSubstr(result.message));
}

TEST(HotSwap, ARejectedConfigurationLeavesTheOldPluginActive) {
  CapturedLog log;
  PolicyHost host(SP_EXAMPLE_MINIMAL_C, kConfig, make_blocks(kBlocks), quiet_options(log));
  const SwapResult result = host.swap_now(SP_FIXTURE_SCRIPTED, PolicyConfig{"min_samples: 0\n", "new.yaml"});
  EXPECT_EQ(result.outcome, SwapResult::Outcome::failed);
  EXPECT_THAT(result.message, AllOf(HasSubstr("new.yaml"), HasSubstr("min_samples is '0'")));
  EXPECT_EQ(host.plugin_name(), "minimal_c");
}

TEST(HotSwap, AFailedImportLeavesTheOldPluginActiveAndUnloadsTheNewOne) {
  CapturedLog log;
  PolicyHost host(SP_EXAMPLE_MINIMAL_C, kConfig, make_blocks(kBlocks), quiet_options(log));
  for (std::int64_t step = 0; step < 10; ++step) run_step(host, step);

  const PolicyConfig rejecting{kConfig.text + "fixture_reject_import: 1\n", "rejecting.yaml"};
  const SwapResult result = host.swap_now(SP_FIXTURE_SCRIPTED, rejecting);
  EXPECT_EQ(result.outcome, SwapResult::Outcome::failed);
  EXPECT_THAT(result.message, AllOf(HasSubstr("could not import the state of minimal_c 1.0.0"),
                                    HasSubstr("SP_ERR_STATE"), HasSubstr("scripted rejection of the state blob")));
  EXPECT_EQ(host.plugin_name(), "minimal_c");
  EXPECT_EQ(testing::mapped_regions_containing("libsp_fixture_scripted.so"), 0u);
  EXPECT_EQ(host.last_swap_result()->outcome, SwapResult::Outcome::failed);

  // Training goes on with the old plugin and the state it had.
  const std::vector<Decision> expected = uninterrupted_run();
  for (std::int64_t step = 10; step < kSteps; ++step) {
    const auto decisions = decisions_of(step, run_step(host, step));
    for (std::uint32_t id = 0; id < kBlocks; ++id) {
      EXPECT_EQ(decisions[id], expected[static_cast<std::size_t>(step) * kBlocks + id]) << "step " << step;
    }
  }
}

TEST(HotSwap, ABogusStateSizeFailsTheSwapInsteadOfTheHost) {
  CapturedLog log;
  const PolicyConfig huge{kConfig.text + "fixture_huge_export: 1\n", "huge.yaml"};
  PolicyHost host(SP_FIXTURE_SCRIPTED, huge, make_blocks(kBlocks), quiet_options(log));
  run_step(host, 0);
  ASSERT_EQ(host.request_swap(SP_EXAMPLE_MINIMAL_C, kConfig).outcome, SwapResult::Outcome::pending);
  host.begin_step(1);  // the swap is applied here, inside the training loop
  EXPECT_EQ(host.last_swap_result()->outcome, SwapResult::Outcome::failed);
  EXPECT_THAT(host.last_swap_result()->message, HasSubstr("asks for a 4611686018427387904-byte buffer"));
  EXPECT_EQ(host.plugin_name(), "scripted_fixture");
  EXPECT_EQ(testing::mapped_regions_containing("libsp_example_minimal_c.so"), 0u);
  host.end_step(1);
}

// What a checkpoint does: the state leaves one host and enters a fresh one (a resumed process).
TEST(PolicyState, ExportedIntoAFreshHostContinuesWithIdenticalDecisions) {
  const std::vector<Decision> expected = uninterrupted_run();
  constexpr std::int64_t kCheckpointStep = 17;
  CapturedLog log;
  std::vector<std::uint8_t> blob;
  {
    PolicyHost first(SP_EXAMPLE_MINIMAL_C, kConfig, make_blocks(kBlocks), quiet_options(log));
    for (std::int64_t step = 0; step < kCheckpointStep; ++step) run_step(first, step);
    blob = first.export_state();
  }
  ASSERT_FALSE(blob.empty());
  PolicyHost resumed(SP_EXAMPLE_MINIMAL_C, kConfig, make_blocks(kBlocks), quiet_options(log));
  ASSERT_TRUE(resumed.import_state(blob));
  for (std::int64_t step = kCheckpointStep; step < kSteps; ++step) {
    const auto decisions = decisions_of(step, run_step(resumed, step));
    for (std::uint32_t id = 0; id < kBlocks; ++id) {
      EXPECT_EQ(decisions[id], expected[static_cast<std::size_t>(step) * kBlocks + id]) << "step " << step;
    }
  }
}

TEST(PolicyState, ARejectedBlobLeavesTheStateAndIsReported) {
  CapturedLog log;
  PolicyHost host(SP_EXAMPLE_MINIMAL_C, kConfig, make_blocks(kBlocks), quiet_options(log));
  for (std::int64_t step = 0; step < 12; ++step) run_step(host, step);
  const std::vector<std::uint8_t> before = host.export_state();
  std::vector<std::uint8_t> corrupted = before;
  corrupted[corrupted.size() / 2] ^= 0x5a;
  EXPECT_FALSE(host.import_state(corrupted));
  EXPECT_FALSE(host.import_state({}));
  EXPECT_THAT(log.text(), HasSubstr("rejected a 0-byte state"));
  EXPECT_EQ(host.export_state(), before);
}

TEST(PolicyState, ExportAndImportInsideAStepAreCallerBugs) {
  CapturedLog log;
  PolicyHost host(SP_EXAMPLE_MINIMAL_C, kConfig, make_blocks(kBlocks), quiet_options(log));
  const std::vector<std::uint8_t> blob = host.export_state();
  host.begin_step(0);
  EXPECT_THROW(host.export_state(), std::logic_error);
  EXPECT_THROW(host.import_state(blob), std::logic_error);
}

TEST(HotSwap, ANewerRequestReplacesAPendingOne) {
  CapturedLog log;
  PolicyHost host(SP_EXAMPLE_MINIMAL_C, kConfig, make_blocks(kBlocks), quiet_options(log));
  ASSERT_EQ(host.request_swap(SP_FIXTURE_SCRIPTED).outcome, SwapResult::Outcome::pending);
  ASSERT_EQ(host.request_swap(SP_EXAMPLE_MINIMAL_C).outcome, SwapResult::Outcome::pending);
  EXPECT_EQ(testing::mapped_regions_containing("libsp_fixture_scripted.so"), 0u);
  host.begin_step(0);
  EXPECT_EQ(host.plugin_name(), "minimal_c");
  EXPECT_EQ(host.last_swap_result()->outcome, SwapResult::Outcome::swapped);
  EXPECT_EQ(host.last_swap_result()->plugin_file, SP_EXAMPLE_MINIMAL_C);
}

TEST(HotSwap, RepeatedSwapsHoldNoExtraFilesMappingsOrMemory) {
  CapturedLog log;
  // Keep warnings (a library that failed to unload) but not the per-swap info lines,
  // whose growing buffer would itself show up as memory and mappings.
  log.logger()->set_level(spdlog::level::warn);
  PolicyHost host(SP_EXAMPLE_MINIMAL_C, kConfig, make_blocks(kBlocks), quiet_options(log));
  const char* versions[] = {SP_FIXTURE_SCRIPTED, SP_EXAMPLE_MINIMAL_C};
  std::int64_t step = 0;
  auto swap_cycle = [&] {
    const SwapResult result = host.swap_now(versions[step % 2]);
    ASSERT_EQ(result.outcome, SwapResult::Outcome::swapped) << result.message;
    ASSERT_TRUE(result.old_library_unloaded) << result.message;
    run_step(host, step++);
  };
  // The first cycles allocate what stays for the life of the process (logger buffers,
  // the loader's caches); growth is measured after them.
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
  EXPECT_EQ(host.hook_failures().total(), 0u);
}

}  // namespace
}  // namespace sp::host
