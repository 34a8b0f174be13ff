// One test per rule of POLICY_SEMANTICS.md (docs/policy.md), in the order of that document.
#include "policy_test_support.h"

#include "sp/policy/errors.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

namespace sp::policy::testing {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// ---- Inputs ----

TEST(PolicyInputs, SampleDerivesL2VarianceAndMaxAbs) {
  Driver driver(standalone(immediate_settings()), 1);
  driver.step(0, {sp_grad_moments_v1{0, 0, 50.0, 10.0, 3.5, 10, 0}});
  const GradSample &sample = driver.engine().state().windows.at(0, 0);
  EXPECT_DOUBLE_EQ(sample.l2, std::sqrt(50.0));
  EXPECT_DOUBLE_EQ(sample.variance, 50.0 / 10 - 1.0);
  EXPECT_DOUBLE_EQ(sample.max_abs, 3.5);
}

TEST(PolicyInputs, VarianceIsClampedAtZero) {
  Driver driver(standalone(immediate_settings()), 1);
  // sum_sq/count - mean^2 = 1 - 100 < 0, e.g. from rounding on the device.
  driver.step(0, {sp_grad_moments_v1{0, 0, 1.0, 10.0, 1.0, 1, 0}});
  EXPECT_EQ(driver.engine().state().windows.at(0, 0).variance, 0.0);
}

TEST(PolicyInputs, BlockAbsentFromTheListAddsNoSample) {
  Driver driver(standalone(immediate_settings()), 2);
  driver.step_l2(0, {1.0, kNaN});
  EXPECT_EQ(driver.engine().state().windows.size(0), 1u);
  EXPECT_EQ(driver.engine().state().windows.size(1), 0u);
}

// ---- Window ----

TEST(PolicyWindow, KeepsTheLastHistoryWindowSamples) {
  Driver driver(standalone(immediate_settings() + "  history_window: 3\n"), 1);
  for (int step = 0; step < 5; ++step) driver.step_l2(step, {static_cast<double>(step + 1)});
  const SampleWindows &windows = driver.engine().state().windows;
  ASSERT_EQ(windows.size(0), 3u);
  EXPECT_DOUBLE_EQ(windows.at(0, 0).l2, 3.0);
  EXPECT_DOUBLE_EQ(windows.at(0, 2).l2, 5.0);
  EXPECT_DOUBLE_EQ(driver.block(0).score.avg_l2, 4.0);
}

TEST(PolicyWindow, NonFiniteSamplesStayOutAndMarkTheBlockUnsafe) {
  Driver driver(standalone(immediate_settings()), 4);
  driver.engine().begin_step(0);
  const std::vector<sp_grad_moments_v1> moments = {
      nonfinite_moments(0),
      sp_grad_moments_v1{1, 0, kNaN, 0.0, 1.0, 10, 0},
      sp_grad_moments_v1{2, 0, 1.0, kInf, 1.0, 10, 0},
      moments_with_l2(3, 1.0),
  };
  driver.engine().post_backward(0, moments.data(), 4);
  for (std::uint32_t b = 0; b < 3; ++b) {
    EXPECT_EQ(driver.engine().state().windows.size(b), 0u) << b;
    EXPECT_TRUE(driver.block(b).unsafe) << b;
  }
  EXPECT_EQ(driver.engine().state().windows.size(3), 1u);
  EXPECT_FALSE(driver.block(3).unsafe);
}

// ---- Score ----

TEST(PolicyScore, AvgL2IsTheMeanOfTheWindowAndRelDividesByTheMeanOverBlocks) {
  Driver driver(standalone(immediate_settings()), 3);
  driver.step_l2(0, {1.0, 3.0, kNaN});
  driver.step_l2(1, {3.0, 5.0, kNaN});
  // avg_l2 = {2, 4}; block 2 has no sample and is left out of mean_all = 3.
  EXPECT_DOUBLE_EQ(driver.block(0).score.avg_l2, 2.0);
  EXPECT_DOUBLE_EQ(driver.block(1).score.avg_l2, 4.0);
  EXPECT_DOUBLE_EQ(driver.block(0).score.relative_magnitude, 2.0 / 3.0);
  EXPECT_DOUBLE_EQ(driver.block(1).score.relative_magnitude, 4.0 / 3.0);
  EXPECT_TRUE(std::isnan(driver.block(2).score.sensitivity));
}

TEST(PolicyScore, MeanAllCountsForcedAndUnsafeBlocksWithSamples) {
  Driver driver(standalone(immediate_settings() + "  force_bf16_blocks: [1]\n"), 3);
  driver.step_l2(0, {1.0, 1.0, 1.0});
  // Step 1: block 1 (forced) has l2 5 and block 2 turns unsafe; both keep samples.
  driver.step(1, {moments_with_l2(0, 1.0), moments_with_l2(1, 5.0), nonfinite_moments(2)});
  // avg_l2 = {1, 3, 1}; mean_all = 5/3.
  EXPECT_DOUBLE_EQ(driver.block(0).score.relative_magnitude, 1.0 / (5.0 / 3.0));
}

TEST(PolicyScore, RelIsZeroWhenMeanAllIsZero) {
  Driver driver(standalone(immediate_settings()), 2);
  const auto &hints = driver.step_l2(0, {0.0, 0.0});
  EXPECT_EQ(driver.block(0).score.relative_magnitude, 0.0);
  EXPECT_EQ(hints[0].sensitivity, 0.0);
  EXPECT_EQ(hints[0].precision, SP_PRECISION_INT8);
}

TEST(PolicyScore, GradScoreIsCappedAtOne) {
  Driver driver(standalone(immediate_settings()), 4);
  driver.step_l2(0, {100.0, 1.0, 1.0, 1.0});
  // rel = 100 / 25.75 > grad_sensitivity_threshold 2.
  EXPECT_EQ(driver.block(0).score.grad_score, 1.0);
  EXPECT_DOUBLE_EQ(driver.block(1).score.grad_score, (1.0 / 25.75) / 2.0);
}

TEST(PolicyScore, ErrorScoreUsesTheCalibrationErrorOrZeroWithoutRenormalising) {
  Driver driver(standalone(immediate_settings()), 2);
  const std::uint32_t ids[] = {0};
  const double errors[] = {0.02};
  driver.engine().set_calibration_errors(ids, errors, 1);
  const auto &hints = driver.step_l2(0, {1.0, 1.0});
  // rel = 1 for both: grad_score = 0.5.
  EXPECT_DOUBLE_EQ(driver.block(0).score.error_score, 0.02 / 0.05);
  EXPECT_DOUBLE_EQ(hints[0].sensitivity, 0.7 * 0.5 + 0.3 * (0.02 / 0.05));
  EXPECT_EQ(driver.block(1).score.error_score, 0.0);
  EXPECT_DOUBLE_EQ(hints[1].sensitivity, 0.7 * 0.5);
}

TEST(PolicyScore, SensitivityIsClampedToOne) {
  Driver driver(standalone(immediate_settings() + "  grad_weight: 1\n  error_weight: 1\n"), 2);
  const std::uint32_t ids[] = {0};
  const double errors[] = {1.0};
  driver.engine().set_calibration_errors(ids, errors, 1);
  const auto &hints = driver.step_l2(0, {10.0, 1.0});
  EXPECT_EQ(hints[0].sensitivity, 1.0);
}

TEST(PolicyScore, IsComputedInDoublePrecision) {
  Driver driver(standalone(immediate_settings() + "  grad_sensitivity_threshold: 3\n"), 3);
  const auto &hints = driver.step_l2(0, {0.1, 0.7, 1.3});
  const double avg[] = {std::sqrt(0.1 * 0.1), std::sqrt(0.7 * 0.7), std::sqrt(1.3 * 1.3)};
  const double mean_all = (avg[0] + avg[1] + avg[2]) / 3;
  for (int b = 0; b < 3; ++b) {
    EXPECT_EQ(hints[b].sensitivity, std::clamp(0.7 * std::min(avg[b] / mean_all / 3.0, 1.0), 0.0, 1.0)) << b;
  }
}

// ---- When decisions happen ----

TEST(PolicyDecisionSteps, FollowWarmupAndInterval) {
  Driver driver(standalone("  warmup_steps: 10\n  update_interval_steps: 4\n  telemetry_enabled: false\n"), 1);
  const PolicyEngine &engine = driver.engine();
  EXPECT_FALSE(engine.is_decision_step(0));
  EXPECT_FALSE(engine.is_decision_step(9));
  EXPECT_TRUE(engine.is_decision_step(10));
  EXPECT_FALSE(engine.is_decision_step(11));
  EXPECT_TRUE(engine.is_decision_step(14));
  EXPECT_TRUE(engine.is_decision_step(10 + 4 * 1'000'000'000'000LL));
  EXPECT_FALSE(engine.is_decision_step(std::numeric_limits<std::int64_t>::max()));
}

TEST(PolicyDecisionSteps, BetweenDecisionStepsThePreviousDecisionStands) {
  Driver driver(standalone(error_driven_settings() + "  warmup_steps: 0\n  update_interval_steps: 5\n"
                                                     "  telemetry_enabled: false\n"),
                1);
  EXPECT_EQ(driver.step_with_sensitivity(0, {0.1})[0].precision, SP_PRECISION_INT8);
  const auto &hints = driver.step_with_sensitivity(1, {0.9});
  EXPECT_EQ(hints[0].precision, SP_PRECISION_INT8);
  EXPECT_EQ(hints[0].reason, SP_REASON_NOT_DECISION_STEP);
  EXPECT_DOUBLE_EQ(hints[0].sensitivity, 0.1);
}

TEST(PolicyDecisionSteps, NoDecisionDuringWarmup) {
  Driver driver(standalone(error_driven_settings() + "  warmup_steps: 3\n  telemetry_enabled: false\n"), 1);
  for (int step = 0; step < 3; ++step) {
    const auto &hints = driver.step_with_sensitivity(step, {0.0});
    EXPECT_EQ(hints[0].precision, SP_PRECISION_BF16);
    EXPECT_EQ(hints[0].reason, SP_REASON_NOT_DECISION_STEP);
    EXPECT_TRUE(std::isnan(hints[0].sensitivity));
  }
  EXPECT_EQ(driver.step_with_sensitivity(3, {0.0})[0].precision, SP_PRECISION_INT8);
}

// ---- Assignment, mode dynamic ----

class PolicyDynamic : public ::testing::Test {
 protected:
  static std::string settings(const std::string &extra = "", int cooldown_steps = 0) {
    return standalone(error_driven_settings() + extra + "  warmup_steps: 0\n  update_interval_steps: 1\n" +
                      "  min_steps_between_switches: " + std::to_string(cooldown_steps) +
                      "\n  telemetry_enabled: false\n  log_decisions: false\n");
  }
};

TEST_F(PolicyDynamic, BlocksStartUnassignedAtBf16) {
  Driver driver(settings(), 2);
  EXPECT_EQ(driver.block(0).assignment, Assignment::unassigned);
  EXPECT_EQ(driver.block(0).previous_precision, SP_PRECISION_BF16);
}

TEST_F(PolicyDynamic, UnassignedBelowInt8ThresholdGoesInt8AndThatIsASwitch) {
  Driver driver(settings(), 1);
  const auto &hints = driver.step_with_sensitivity(0, {0.29});
  EXPECT_EQ(hints[0].precision, SP_PRECISION_INT8);
  EXPECT_EQ(hints[0].reason, SP_REASON_THRESHOLD);
  EXPECT_EQ(driver.block(0).last_switch_step, 0);
}

TEST_F(PolicyDynamic, UnassignedAtBf16ThresholdGoesBf16WithoutASwitch) {
  Driver driver(settings(), 1);
  const auto &hints = driver.step_with_sensitivity(0, {0.6});
  EXPECT_EQ(hints[0].precision, SP_PRECISION_BF16);
  EXPECT_EQ(driver.block(0).assignment, Assignment::bf16);
  EXPECT_FALSE(driver.block(0).last_switch_step.has_value());
}

TEST_F(PolicyDynamic, UnassignedBetweenThresholdsTakesAmbiguousDefault) {
  Driver bf16_default(settings(), 1);
  bf16_default.step_with_sensitivity(0, {0.3});
  EXPECT_EQ(bf16_default.block(0).assignment, Assignment::bf16);
  Driver int8_default(settings("  ambiguous_default: int8\n"), 1);
  int8_default.step_with_sensitivity(0, {0.59});
  EXPECT_EQ(int8_default.block(0).assignment, Assignment::int8);
  EXPECT_EQ(int8_default.block(0).last_switch_step, 0);
}

TEST_F(PolicyDynamic, Bf16GoesInt8OnlyBelowInt8ThresholdMinusMargin) {
  Driver driver(settings(), 1);
  driver.step_with_sensitivity(0, {0.7});
  // 0.25 would make an unassigned block INT8, but a BF16 block needs < 0.3 - 0.1.
  auto hints = driver.step_with_sensitivity(1, {0.25});
  EXPECT_EQ(hints[0].precision, SP_PRECISION_BF16);
  EXPECT_EQ(hints[0].reason, SP_REASON_HYSTERESIS_HOLD);
  hints = driver.step_with_sensitivity(2, {0.2});
  EXPECT_EQ(hints[0].reason, SP_REASON_HYSTERESIS_HOLD) << "0.2 is not below 0.3 - 0.1";
  hints = driver.step_with_sensitivity(3, {0.19});
  EXPECT_EQ(hints[0].precision, SP_PRECISION_INT8);
  EXPECT_EQ(hints[0].reason, SP_REASON_THRESHOLD);
}

TEST_F(PolicyDynamic, Int8GoesBf16OnlyAtBf16Threshold) {
  Driver driver(settings(), 1);
  driver.step_with_sensitivity(0, {0.1});
  auto hints = driver.step_with_sensitivity(1, {0.59});
  EXPECT_EQ(hints[0].precision, SP_PRECISION_INT8);
  EXPECT_EQ(hints[0].reason, SP_REASON_HYSTERESIS_HOLD);
  hints = driver.step_with_sensitivity(2, {0.6});
  EXPECT_EQ(hints[0].precision, SP_PRECISION_BF16);
  EXPECT_EQ(driver.block(0).last_switch_step, 2);
}

TEST_F(PolicyDynamic, CooldownHoldsASwitchUntilMinStepsHavePassed) {
  Driver driver(settings("", 3), 1);
  driver.step_with_sensitivity(0, {0.1});  // unassigned -> INT8: a switch at step 0
  for (int step = 1; step < 3; ++step) {
    const auto &hints = driver.step_with_sensitivity(step, {0.9});
    EXPECT_EQ(hints[0].precision, SP_PRECISION_INT8) << step;
    EXPECT_EQ(hints[0].reason, SP_REASON_COOLDOWN) << step;
  }
  const auto &hints = driver.step_with_sensitivity(3, {0.9});
  EXPECT_EQ(hints[0].precision, SP_PRECISION_BF16);
  EXPECT_EQ(hints[0].reason, SP_REASON_THRESHOLD);
}

TEST_F(PolicyDynamic, CooldownHasPassedWhenTheBlockNeverSwitched) {
  Driver driver(settings("", 100), 1);
  driver.step_with_sensitivity(0, {0.9});  // unassigned -> BF16 is no switch
  EXPECT_EQ(driver.step_with_sensitivity(1, {0.0})[0].precision, SP_PRECISION_INT8);
}

TEST_F(PolicyDynamic, BlockWithoutSamplesKeepsWhatItHas) {
  Driver driver(settings(), 2);
  driver.step_with_sensitivity(0, {0.1, 0.9});
  const auto &hints = driver.step_l2(1, {kNaN, 1.0});
  EXPECT_EQ(hints[0].precision, SP_PRECISION_INT8);
  EXPECT_EQ(hints[0].reason, SP_REASON_THRESHOLD) << "the window still holds step 0";
  Driver empty(settings(), 2);
  const auto &empty_hints = empty.step_l2(0, {kNaN, 1.0});
  EXPECT_EQ(empty_hints[0].reason, SP_REASON_NO_DATA);
  EXPECT_EQ(empty.block(0).assignment, Assignment::unassigned);
}

TEST_F(PolicyDynamic, UnsafeSendsAnInt8BlockToBf16OnAnyStepIgnoringCooldown) {
  Driver driver(standalone(error_driven_settings() + "  warmup_steps: 0\n  update_interval_steps: 10\n"
                                                     "  min_steps_between_switches: 50\n  telemetry_enabled: false\n"),
                2);
  driver.step_with_sensitivity(0, {0.1, 0.1});
  ASSERT_EQ(driver.hints()[0].precision, SP_PRECISION_INT8);
  const auto &hints = driver.step(3, {nonfinite_moments(0), moments_with_l2(1, 1.0)});
  EXPECT_EQ(hints[0].precision, SP_PRECISION_BF16);
  EXPECT_EQ(hints[0].reason, SP_REASON_UNSAFE);
  EXPECT_EQ(driver.block(0).last_switch_step, 3);
  EXPECT_EQ(hints[1].precision, SP_PRECISION_INT8);
}

TEST_F(PolicyDynamic, UnsafeAssignsAnUnassignedBlockBf16SoHysteresisAppliesAfterwards) {
  Driver driver(settings(), 1);
  driver.step(0, {nonfinite_moments(0)});
  EXPECT_EQ(driver.block(0).assignment, Assignment::bf16);
  EXPECT_FALSE(driver.block(0).last_switch_step.has_value());
  // 0.25 would make an unassigned block INT8; an assigned BF16 block holds.
  EXPECT_EQ(driver.step_with_sensitivity(1, {0.25})[0].reason, SP_REASON_HYSTERESIS_HOLD);
}

TEST_F(PolicyDynamic, UnsafeBlockIsNotScoredAtThatStep) {
  Driver driver(settings(), 2);
  driver.step_with_sensitivity(0, {0.5, 0.5});
  const std::uint32_t ids[] = {0};
  const double errors[] = {0.9};
  driver.engine().set_calibration_errors(ids, errors, 1);
  const auto &hints = driver.step(1, {nonfinite_moments(0), moments_with_l2(1, 1.0)});
  EXPECT_DOUBLE_EQ(hints[0].sensitivity, 0.5);
}

TEST_F(PolicyDynamic, UnsafeFlagIsClearedAfterCompute) {
  Driver driver(settings(), 1);
  driver.step_with_sensitivity(0, {0.5});
  driver.step(1, {nonfinite_moments(0)});
  EXPECT_FALSE(driver.block(0).unsafe);
  // The next step is scored again; the window still holds step 0's sample.
  EXPECT_EQ(driver.step_l2(2, {kNaN})[0].reason, SP_REASON_HYSTERESIS_HOLD);
}

TEST_F(PolicyDynamic, NonfiniteToBf16FalseTurnsTheUnsafeRuleOff) {
  Driver driver(settings("  nonfinite_to_bf16: false\n"), 1);
  driver.step_with_sensitivity(0, {0.1});
  const auto &hints = driver.step(1, {nonfinite_moments(0)});
  EXPECT_EQ(hints[0].precision, SP_PRECISION_INT8);
  EXPECT_NE(hints[0].reason, SP_REASON_UNSAFE);
  EXPECT_EQ(driver.engine().state().windows.size(0), 1u) << "the non-finite sample still stays out";
}

TEST_F(PolicyDynamic, ForcedBlocksWinOverScoreCooldownAndUnsafe) {
  Driver driver(settings("  force_bf16_blocks: [0]\n  force_int8_blocks: [1]\n", 100), 2);
  for (int step = 0; step < 3; ++step) {
    const auto &hints = step == 1 ? driver.step(1, {nonfinite_moments(0), nonfinite_moments(1)})
                                  : driver.step_with_sensitivity(step, {0.0, 1.0});
    EXPECT_EQ(hints[0].precision, SP_PRECISION_BF16) << step;
    EXPECT_EQ(hints[1].precision, SP_PRECISION_INT8) << step;
    EXPECT_EQ(hints[0].reason, SP_REASON_FORCED);
    EXPECT_EQ(hints[1].reason, SP_REASON_FORCED);
  }
}

// ---- Other modes ----

TEST(PolicyModes, StaticUsesTheForceInt8ListFromStepZero) {
  Driver driver(standalone("  mode: static\n  force_int8_blocks: [1]\n  force_bf16_blocks: [2]\n"
                           "  telemetry_enabled: false\n"),
                3);
  const auto &hints = driver.step_l2(0, {100.0, 100.0, 0.0});
  EXPECT_EQ(hints[0].precision, SP_PRECISION_BF16);
  EXPECT_EQ(hints[0].reason, SP_REASON_MODE);
  EXPECT_EQ(hints[1].precision, SP_PRECISION_INT8);
  EXPECT_EQ(hints[1].reason, SP_REASON_FORCED);
  EXPECT_EQ(hints[2].precision, SP_PRECISION_BF16);
  EXPECT_TRUE(std::isnan(hints[1].sensitivity)) << "static mode does not score";
}

TEST(PolicyModes, OffSendsEveryBlockBf16AndWarnsThatForceListsAreIgnored) {
  const std::string yaml = standalone("  mode: off\n  force_int8_blocks: [0]\n");
  const ParsedConfig parsed = parse_policy_config(yaml, 2);
  ASSERT_EQ(parsed.warnings.size(), 1u);
  EXPECT_NE(parsed.warnings[0].find("ignored"), std::string::npos);
  Driver driver(yaml, 2);
  for (const sp_hint_v1 &hint : driver.step_l2(0, {0.0, 1.0})) {
    EXPECT_EQ(hint.precision, SP_PRECISION_BF16);
    EXPECT_EQ(hint.reason, SP_REASON_MODE);
  }
}

TEST(PolicyModes, EnabledFalseBehavesAsOff) {
  Driver driver(standalone(immediate_settings() + "  enabled: false\n  force_int8_blocks: [0]\n"), 2);
  for (int step = 0; step < 3; ++step) {
    for (const sp_hint_v1 &hint : driver.step_l2(step, {0.0, 1.0})) {
      EXPECT_EQ(hint.precision, SP_PRECISION_BF16);
      EXPECT_EQ(hint.reason, SP_REASON_MODE);
    }
  }
}

// ---- Input validation: a rejected call changes nothing ----

class PolicyValidation : public ::testing::Test {
 protected:
  PolicyValidation() : driver(standalone(immediate_settings()), 3) {
    driver.step_l2(0, {1.0, 2.0, 3.0});
    driver.engine().begin_step(1);
    before = driver.engine().export_state();
  }
  void expect_unchanged() { EXPECT_EQ(driver.engine().export_state(), before); }

  Driver driver;
  std::vector<std::uint8_t> before;
};

TEST_F(PolicyValidation, UnknownBlockIdIsRejected) {
  const sp_grad_moments_v1 moments[] = {moments_with_l2(0, 1.0), moments_with_l2(3, 1.0)};
  EXPECT_THROW(driver.engine().post_backward(1, moments, 2), InvalidArgument);
  expect_unchanged();
}

TEST_F(PolicyValidation, DuplicateBlockIdIsRejected) {
  const sp_grad_moments_v1 moments[] = {moments_with_l2(1, 1.0), moments_with_l2(1, 2.0)};
  EXPECT_THROW(driver.engine().post_backward(1, moments, 2), InvalidArgument);
  expect_unchanged();
}

TEST_F(PolicyValidation, ZeroCountAndImpossibleMomentsAreRejected) {
  const sp_grad_moments_v1 zero_count[] = {sp_grad_moments_v1{0, 0, 1.0, 0.0, 1.0, 0, 0}};
  const sp_grad_moments_v1 negative[] = {sp_grad_moments_v1{0, 0, -1.0, 0.0, 1.0, 10, 0}};
  const sp_grad_moments_v1 too_many_nonfinite[] = {sp_grad_moments_v1{0, 0, 1.0, 0.0, 1.0, 10, 11}};
  EXPECT_THROW(driver.engine().post_backward(1, zero_count, 1), InvalidArgument);
  EXPECT_THROW(driver.engine().post_backward(1, negative, 1), InvalidArgument);
  EXPECT_THROW(driver.engine().post_backward(1, too_many_nonfinite, 1), InvalidArgument);
  EXPECT_THROW(driver.engine().post_backward(1, nullptr, 1), InvalidArgument);
  expect_unchanged();
}

TEST_F(PolicyValidation, HintCountMismatchIsRejected) {
  std::vector<sp_hint_v1> hints(2);
  EXPECT_THROW(driver.engine().compute_hints(1, hints.data(), 2), InvalidArgument);
  expect_unchanged();
}

TEST_F(PolicyValidation, StepsOutOfOrderAreRejected) {
  EXPECT_THROW(driver.engine().begin_step(1), OrderError);
  EXPECT_THROW(driver.engine().begin_step(0), OrderError);
  EXPECT_THROW(driver.engine().post_backward(2, nullptr, 0), OrderError);
  EXPECT_THROW(driver.engine().end_step(0, nullptr), OrderError);
  driver.engine().post_backward(1, nullptr, 0);
  EXPECT_THROW(driver.engine().post_backward(1, nullptr, 0), OrderError) << "twice in one step";
  std::vector<sp_hint_v1> hints(3);
  driver.engine().compute_hints(1, hints.data(), 3);
  EXPECT_THROW(driver.engine().compute_hints(1, hints.data(), 3), OrderError);
  EXPECT_THROW(driver.engine().begin_step(-1), InvalidArgument);
}

TEST_F(PolicyValidation, BadCalibrationErrorsAreRejected) {
  const std::uint32_t ids[] = {0, 5};
  const double errors[] = {0.1, 0.1};
  EXPECT_THROW(driver.engine().set_calibration_errors(ids, errors, 2), InvalidArgument);
  const std::uint32_t good_ids[] = {0, 1};
  const double nan_errors[] = {0.1, kNaN};
  EXPECT_THROW(driver.engine().set_calibration_errors(good_ids, nan_errors, 2), InvalidArgument);
  const double negative_errors[] = {0.1, -0.5};
  EXPECT_THROW(driver.engine().set_calibration_errors(good_ids, negative_errors, 2), InvalidArgument);
  expect_unchanged();
}

TEST(PolicySteps, AFailedEndStepDoesNotWedgeThePolicy) {
  Driver driver(standalone(immediate_settings()), 1);
  driver.engine().begin_step(0);
  sp_step_feedback_v1 truncated{};
  truncated.struct_size = 8;
  EXPECT_THROW(driver.engine().end_step(0, &truncated), InvalidArgument);
  EXPECT_NO_THROW(driver.step_l2(1, {1.0}));
}

TEST(PolicySteps, VeryLargeStepNumbersWork) {
  Driver driver(standalone(error_driven_settings() + "  warmup_steps: 0\n  update_interval_steps: 1\n"
                                                     "  min_steps_between_switches: 1000000\n"
                                                     "  telemetry_enabled: false\n"),
                1);
  const std::int64_t big = std::numeric_limits<std::int64_t>::max() - 2;
  driver.step_with_sensitivity(big, {0.1});
  EXPECT_EQ(driver.hints()[0].precision, SP_PRECISION_INT8);
  EXPECT_EQ(driver.step_with_sensitivity(big + 2, {0.9})[0].reason, SP_REASON_COOLDOWN);
}

// ---- Determinism ----

std::vector<sp_grad_moments_v1> pseudo_random_moments(std::uint64_t &seed, std::uint32_t n_blocks) {
  std::vector<sp_grad_moments_v1> moments;
  for (std::uint32_t b = 0; b < n_blocks; ++b) {
    seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
    const double value = static_cast<double>(seed >> 11) / 9007199254740992.0;
    if (value < 0.1) continue;
    moments.push_back(value > 0.98 ? nonfinite_moments(b) : moments_with_l2(b, value * (1 + b % 5)));
  }
  return moments;
}

TEST(PolicyDeterminism, IdenticalInputsGiveIdenticalDecisionsAndState) {
  const std::string yaml = standalone(
      "  warmup_steps: 3\n  update_interval_steps: 2\n"
      "  min_steps_between_switches: 4\n  telemetry_enabled: false\n");
  Driver first(yaml, 48);
  Driver second(yaml, 48);
  std::uint64_t seed_first = 42;
  std::uint64_t seed_second = 42;
  for (int step = 0; step < 200; ++step) {
    const auto &a = first.step(step, pseudo_random_moments(seed_first, 48));
    const auto &b = second.step(step, pseudo_random_moments(seed_second, 48));
    for (std::uint32_t block = 0; block < 48; ++block) {
      ASSERT_EQ(a[block].precision, b[block].precision);
      ASSERT_EQ(a[block].reason, b[block].reason);
      ASSERT_TRUE(a[block].sensitivity == b[block].sensitivity ||
                  (std::isnan(a[block].sensitivity) && std::isnan(b[block].sensitivity)));
    }
  }
  EXPECT_EQ(first.engine().export_state(), second.engine().export_state());
}

}  // namespace
}  // namespace sp::policy::testing
