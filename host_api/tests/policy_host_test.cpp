#include <sp/host/policy_host.h>
#include <sp/host/plugin_call.h>

#include <unistd.h>

#include <csignal>

#include "test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <cmath>
#include <stdexcept>
#include <string>

namespace sp::host {
namespace {

using ::testing::AllOf;
using testing::CapturedLog;
using ::testing::HasSubstr;
using testing::make_blocks;
using testing::run_step;

constexpr std::uint32_t kBlocks = 6;
// Between the synthetic trace's quiet (< 0.3) and active (>= 4) L2 norms, so a block's
// precision follows how much of its history was active.
const std::string kExampleConfig = "int8_max_l2: 1.5\nmin_samples: 2\n";

PolicyHostOptions options_with(const CapturedLog& log, FallbackMode fallback = FallbackMode::all_bf16) {
  PolicyHostOptions options;
  options.fallback = fallback;
  options.logger = log.logger();
  return options;
}

bool all_bf16(const std::vector<sp_hint_v1>& hints) {
  for (const sp_hint_v1& hint : hints) {
    if (hint.precision != SP_PRECISION_BF16) return false;
  }
  return true;
}

TEST(PolicyHost, DrivesTheMinimalExampleThroughSteps) {
  CapturedLog log;
  PolicyHost host(SP_EXAMPLE_MINIMAL_C, {kExampleConfig, "example.yaml"}, make_blocks(kBlocks), options_with(log));
  EXPECT_EQ(host.plugin_name(), "minimal_c");
  EXPECT_EQ(host.block_count(), kBlocks);

  const std::vector<sp_hint_v1> first = run_step(host, 0);
  ASSERT_EQ(first.size(), kBlocks);
  for (const sp_hint_v1& hint : first) EXPECT_EQ(hint.reason, SP_REASON_NO_DATA) << "block " << hint.block_id;

  bool saw_int8 = false;
  for (std::int64_t step = 1; step < 20; ++step) {
    for (const sp_hint_v1& hint : run_step(host, step)) saw_int8 |= hint.precision == SP_PRECISION_INT8;
  }
  EXPECT_TRUE(saw_int8);
  EXPECT_EQ(host.last_hint_source(), HintSource::plugin);
  EXPECT_EQ(host.hook_failures().total(), 0u);
  // The plugin's create() message came through the ABI log callback.
  EXPECT_THAT(log.text(), HasSubstr("[minimal_c 1.0.0] minimal_c 1.0.0: 6 blocks, int8_max_l2=1.5"));
}

TEST(PolicyHost, RejectedConfigurationNamesTheSourceAndThePluginsReason) {
  try {
    PolicyHost host(SP_EXAMPLE_MINIMAL_C, {"int8_max_l2: -1\n", "configs/policy.yaml"}, make_blocks(kBlocks));
    FAIL() << "the configuration was accepted";
  } catch (const PluginError& error) {
    EXPECT_THAT(error.what(),
                AllOf(HasSubstr("configs/policy.yaml"), HasSubstr("minimal_c 1.0.0"), HasSubstr("SP_ERR_CONFIG"),
                      HasSubstr("int8_max_l2 is '-1', expected a finite number > 0")));
  }
}

TEST(PolicyHost, RefusesBlockIdsOutOfOrder) {
  std::vector<BlockDescription> blocks = make_blocks(3);
  blocks[1].id = 2;
  EXPECT_THROW(PolicyHost(SP_EXAMPLE_MINIMAL_C, {"", "<inline>"}, blocks), std::invalid_argument);
}

TEST(PolicyHost, CallsOutOfLifecycleOrderAreCallerBugs) {
  PolicyHost host(SP_EXAMPLE_MINIMAL_C, {"", "<inline>"}, make_blocks(kBlocks));
  EXPECT_THROW(host.compute_hints(0), std::logic_error);
  host.begin_step(0);
  EXPECT_THROW(host.begin_step(1), std::logic_error);
  EXPECT_THROW(host.end_step(1), std::logic_error);
  host.end_step(0);
  EXPECT_THROW(host.post_backward(0, {}), std::logic_error);
}

// A hint run where the scripted fixture fails `hook` at step 4 and the host must carry on.
struct HookFailureCase {
  const char* hook;
  std::uint64_t HookFailureCounts::*counter;
  bool hints_fall_back;
};

class FailingHook : public ::testing::TestWithParam<HookFailureCase> {};

TEST_P(FailingHook, IsLoggedCountedAndTrainingContinues) {
  const HookFailureCase& failure = GetParam();
  CapturedLog log;
  const std::string config = kExampleConfig + "fixture_fail_hook: " + failure.hook + "\nfixture_fail_at_step: 4\n";
  PolicyHost host(SP_FIXTURE_SCRIPTED, {config, "scripted.yaml"}, make_blocks(kBlocks), options_with(log));
  for (std::int64_t step = 0; step < 8; ++step) {
    run_step(host, step);
    EXPECT_EQ(host.last_hint_source(), failure.hints_fall_back && step == 4 ? HintSource::fallback : HintSource::plugin)
        << "step " << step;
  }
  EXPECT_EQ(host.hook_failures().*failure.counter, 1u);
  EXPECT_EQ(host.hook_failures().total(), 1u);
  EXPECT_THAT(log.text(),
              AllOf(HasSubstr(std::string("failed in ") + failure.hook + " at step 4 with status 5 (SP_ERR_INTERNAL)"),
                    HasSubstr(std::string("scripted failure of ") + failure.hook + " at step 4")));
}

INSTANTIATE_TEST_SUITE_P(EveryStepHook, FailingHook,
                         ::testing::Values(HookFailureCase{"begin_step", &HookFailureCounts::begin_step, false},
                                           HookFailureCase{"post_backward", &HookFailureCounts::post_backward, false},
                                           HookFailureCase{"compute_hints", &HookFailureCounts::compute_hints, true},
                                           HookFailureCase{"end_step", &HookFailureCounts::end_step, false}),
                         [](const ::testing::TestParamInfo<HookFailureCase>& info) {
                           return std::string(info.param.hook);
                         });

// Runs the scripted fixture with `fixture_lines`, returning the hints of steps 0..7.
std::vector<std::vector<sp_hint_v1>> hints_with(const std::string& fixture_lines, FallbackMode fallback,
                                                const CapturedLog& log, HookFailureCounts& failures) {
  PolicyHost host(SP_FIXTURE_SCRIPTED, {kExampleConfig + fixture_lines, "scripted.yaml"}, make_blocks(kBlocks),
                  options_with(log, fallback));
  std::vector<std::vector<sp_hint_v1>> hints;
  for (std::int64_t step = 0; step < 8; ++step) hints.push_back(run_step(host, step));
  failures = host.hook_failures();
  return hints;
}

bool same_precisions(const std::vector<sp_hint_v1>& a, const std::vector<sp_hint_v1>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i].precision != b[i].precision || a[i].block_id != b[i].block_id) return false;
  }
  return true;
}

TEST(FallbackHints, AllBf16ReplacesAFailedComputeHints) {
  CapturedLog log;
  HookFailureCounts failures;
  const auto hints =
      hints_with("fixture_fail_hook: compute_hints\nfixture_fail_at_step: 5\n", FallbackMode::all_bf16, log, failures);
  ASSERT_FALSE(all_bf16(hints[4])) << "the trace must give the plugin INT8 blocks before the failure";
  EXPECT_TRUE(all_bf16(hints[5]));
  for (const sp_hint_v1& hint : hints[5]) {
    EXPECT_TRUE(std::isnan(hint.sensitivity));
    EXPECT_EQ(hint.reason, SP_REASON_HOST_FALLBACK);
  }
  EXPECT_EQ(failures.compute_hints, 1u);
  EXPECT_THAT(log.text(), HasSubstr("step 5: using all-BF16 hints instead of the plugin's"));
}

TEST(FallbackHints, LastGoodRepeatsThePreviousHints) {
  CapturedLog log;
  HookFailureCounts failures;
  const auto hints =
      hints_with("fixture_fail_hook: compute_hints\nfixture_fail_at_step: 5\n", FallbackMode::last_good, log, failures);
  ASSERT_FALSE(all_bf16(hints[4]));
  EXPECT_TRUE(same_precisions(hints[5], hints[4]));
  for (const sp_hint_v1& hint : hints[5]) EXPECT_EQ(hint.reason, SP_REASON_HOST_FALLBACK);
  EXPECT_EQ(failures.compute_hints, 1u);
  EXPECT_THAT(log.text(), HasSubstr("step 5: using the last good hints instead of the plugin's"));
}

// A hook that never returns costs one deadline, not the run: the plugin is quarantined, the
// steps go on with fallback hints without calling it, its state is not exported, and a new
// version swapped in takes over (without the old state).
TEST(HookDeadline, AHookThatNeverReturnsQuarantinesThePluginAndTheStepsGoOn) {
  CapturedLog log;
  PolicyHostOptions options = options_with(log, FallbackMode::last_good);
  options.hook_deadline = std::chrono::milliseconds(200);
  const std::string config = kExampleConfig + "fixture_block_hook: compute_hints\nfixture_fail_at_step: 5\n";
  // A quarantined plugin is never unloaded, so this library stays mapped for the life of the
  // process: a copy under its own name keeps the other tests' checks that the fixture was
  // unmapped true when the whole binary runs in one process.
  testing::TempDir dir;
  const std::filesystem::path hanging = dir.path() / "libsp_fixture_hanging.so";
  std::filesystem::copy_file(SP_FIXTURE_SCRIPTED, hanging);
  PolicyHost host(hanging, {config, "scripted.yaml"}, make_blocks(kBlocks), options);
  std::vector<std::vector<sp_hint_v1>> hints;
  for (std::int64_t step = 0; step < 8; ++step) hints.push_back(run_step(host, step));
  ASSERT_FALSE(all_bf16(hints[4])) << "the trace must give the plugin INT8 blocks before the hang";
  for (std::int64_t step = 5; step < 8; ++step) {
    EXPECT_TRUE(same_precisions(hints[step], hints[4])) << "step " << step << ": the last good hints";
    EXPECT_EQ(hints[step][0].reason, SP_REASON_HOST_FALLBACK);
  }
  EXPECT_EQ(host.last_hint_source(), HintSource::fallback);
  EXPECT_THAT(host.quarantine_reason(), HasSubstr("did not return from compute_hints at step 5 within 200 ms"));
  EXPECT_THAT(log.text(), HasSubstr("it is quarantined"));
  // Every later hook is skipped and counted, not called (a call would block again).
  EXPECT_EQ(host.hook_failures().compute_hints, 3u);
  EXPECT_EQ(host.hook_failures().end_step, 3u);
  EXPECT_THROW(host.export_state(), PluginError);

  const SwapResult swapped = host.swap_now(SP_EXAMPLE_MINIMAL_C, PolicyConfig{kExampleConfig, "example.yaml"});
  EXPECT_EQ(swapped.outcome, SwapResult::Outcome::swapped) << swapped.message;
  EXPECT_THAT(swapped.message, HasSubstr("replaced the quarantined"));
  EXPECT_TRUE(host.quarantine_reason().empty());
  run_step(host, 8);
  EXPECT_EQ(host.last_hint_source(), HintSource::plugin);
}

// What a fatal-signal handler learns from describe_plugin_call(): the plugin and the call it
// crashed in (here a write through NULL in compute_hints, run on the watchdog's thread), and
// nothing outside plugin calls.
void print_plugin_call_and_exit(int) {
  char text[256];
  const std::size_t n = describe_plugin_call(text, sizeof text);
  (void)!::write(2, "crashed in [", 12);
  (void)!::write(2, text, n);
  (void)!::write(2, "]\n", 2);
  ::_exit(42);
}

TEST(PluginCallDeathTest, AHandlerLearnsWhichPluginCallCrashed) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  char outside[64] = "x";
  EXPECT_EQ(describe_plugin_call(outside, sizeof outside), 0u);
  EXPECT_STREQ(outside, "");
  for (const bool watchdog : {false, true}) {
    EXPECT_EXIT(
        {
          ::signal(SIGSEGV, print_plugin_call_and_exit);
          PolicyHostOptions options;
          if (watchdog) options.hook_deadline = std::chrono::milliseconds(10000);
          const std::string config = kExampleConfig + "fixture_crash_hook: compute_hints\nfixture_fail_at_step: 2\n";
          PolicyHost host(SP_FIXTURE_SCRIPTED, {config, "scripted.yaml"}, make_blocks(kBlocks), options);
          for (std::int64_t step = 0; step < 4; ++step) run_step(host, step);
        },
        ::testing::ExitedWithCode(42), "crashed in \\[scripted_fixture [0-9.]+ in compute_hints at step 2\\]")
        << (watchdog ? "on the watchdog's thread" : "on the calling thread");
  }
  EXPECT_EQ(describe_plugin_call(outside, sizeof outside), 0u);
}

TEST(FallbackHints, LastGoodBeforeAnyGoodHintsIsAllBf16) {
  CapturedLog log;
  HookFailureCounts failures;
  const auto hints = hints_with("fixture_fail_hook: compute_hints\n", FallbackMode::last_good, log, failures);
  for (const auto& step_hints : hints) EXPECT_TRUE(all_bf16(step_hints));
  EXPECT_EQ(failures.compute_hints, 8u);
}

TEST(FallbackHints, HintsThatBreakTheContractAreReplaced) {
  CapturedLog log;
  HookFailureCounts failures;
  const auto hints = hints_with("fixture_invalid_hints_at_step: 6\n", FallbackMode::last_good, log, failures);
  ASSERT_FALSE(all_bf16(hints[5])) << "last-good hints must be distinguishable from all-BF16 ones";
  EXPECT_TRUE(same_precisions(hints[6], hints[5]));
  EXPECT_EQ(failures.invalid_hints, 1u);
  EXPECT_EQ(failures.compute_hints, 0u);
  EXPECT_THAT(log.text(), HasSubstr("returned invalid hints at step 6: hints[0].precision is 42"));
}

TEST(PolicyHost, RejectedCalibrationErrorsReturnFalseAndAreCounted) {
  CapturedLog log;
  PolicyHost host(SP_EXAMPLE_MINIMAL_C, {"", "<inline>"}, make_blocks(kBlocks), options_with(log));
  EXPECT_TRUE(host.set_calibration_errors({0, 5}, {0.01, 0.02}));
  EXPECT_FALSE(host.set_calibration_errors({6}, {0.01}));
  EXPECT_EQ(host.hook_failures().set_calibration_errors, 1u);
  EXPECT_THAT(log.text(), HasSubstr("failed in set_calibration_errors before the first step with status 1 "
                                    "(SP_ERR_INVALID_ARGUMENT): block_ids[0] is 6, but there are 6 blocks"));
  EXPECT_THROW(host.set_calibration_errors({1, 2}, {0.5}), std::invalid_argument);
}

}  // namespace
}  // namespace sp::host
