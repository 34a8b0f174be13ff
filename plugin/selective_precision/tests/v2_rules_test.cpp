// Policy v2 (POLICY_V2_SEMANTICS.md, docs/policy.md "Policy v2"): one named test per rule,
// in the order of that document.
#include "policy_test_support.h"

#include "sp/policy/errors.h"
#include "sp/policy/state_codec.h"

#include <boost/crc.hpp>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace sp::policy::testing {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Every step a decision step; s8 = INT8 error, s4 = NF4 error (grad_weight 0, error_weight 1,
// both error thresholds 1). B = 0.6, I = 0.3, N = 0.15, m = 0.1.
std::string v2_settings(const std::string &extra = "", int cooldown = 0) {
  return standalone(
      "  warmup_steps: 0\n  update_interval_steps: 1\n  telemetry_enabled: false\n"
      "  log_decisions: false\n  grad_weight: 0\n  error_weight: 1\n  quant_error_threshold: 1\n"
      "  nf4_quant_error_threshold: 1\n  nf4_threshold: 0.15\n  min_steps_between_switches: " +
      std::to_string(cooldown) + "\n" + extra);
}
const std::string kThreeTiers = "  tiers: [bf16, int8, nf4]\n";
const std::string kNoInt8 = "  tiers: [bf16, nf4]\n";
// window 4, a spike is > mu + 2 sd and > 1.1 mu; blame 3 steps back; penalty 5 steps.
const std::string kGuard =
    "  loss_guard: {enabled: true, window: 4, sigmas: 2, min_rise: 0.1, blame_steps: 3, penalty_steps: 5}\n";

sp_step_feedback_v1 loss_feedback(double loss) {
  sp_step_feedback_v1 feedback{};
  feedback.struct_size = sizeof feedback;
  feedback.loss = loss;
  feedback.step_seconds = kNaN;
  return feedback;
}

// One whole step with the given s8 (INT8 error) and s4 (NF4 error) per block and a loss
// (NaN = no feedback at all).
const std::vector<sp_hint_v1> &run(Driver &driver, std::int64_t step, const std::vector<double> &s8,
                                   const std::vector<double> &s4, double loss = kNaN) {
  std::vector<std::uint32_t> ids(s8.size());
  for (std::uint32_t b = 0; b < ids.size(); ++b) ids[b] = b;
  const auto n = static_cast<std::uint32_t>(ids.size());
  driver.engine().set_precision_calibration_errors(SP_PRECISION_INT8, ids.data(), s8.data(), n);
  driver.engine().set_precision_calibration_errors(SP_PRECISION_NF4, ids.data(), s4.data(), n);
  std::vector<sp_grad_moments_v1> moments;
  for (std::uint32_t b = 0; b < n; ++b) moments.push_back(moments_with_l2(b, 1.0));
  const sp_step_feedback_v1 feedback = loss_feedback(loss);
  return driver.step(step, moments, std::isnan(loss) ? nullptr : &feedback);
}

void expect_hint(const sp_hint_v1 &hint, sp_precision precision, sp_reason reason) {
  EXPECT_EQ(hint.precision, precision) << "block " << hint.block_id;
  EXPECT_EQ(hint.reason, reason) << "block " << hint.block_id;
}

// ---- Scores ----

TEST(V2Rules, S4UsesTheNf4ErrorAndS8StaysTheV1Sensitivity) {
  Driver driver(standalone("  warmup_steps: 0\n  update_interval_steps: 1\n  telemetry_enabled: false\n"
                           "  grad_weight: 0.5\n  error_weight: 0.5\n  quant_error_threshold: 0.1\n"
                           "  nf4_quant_error_threshold: 0.4\n"),
                1);
  run(driver, 0, {0.05}, {0.1});
  const ScoreParts &score = driver.block(0).score;
  EXPECT_DOUBLE_EQ(score.error_score, 0.5);
  EXPECT_DOUBLE_EQ(score.nf4_error_score, 0.25);
  EXPECT_DOUBLE_EQ(score.sensitivity, 0.5 * score.grad_score + 0.25);
  EXPECT_DOUBLE_EQ(score.nf4_sensitivity, 0.5 * score.grad_score + 0.125);
  EXPECT_EQ(driver.hints()[0].sensitivity, score.sensitivity);
}

TEST(V2Rules, E4IsZeroWithoutAnNf4Error) {
  Driver driver(v2_settings(kThreeTiers), 1);
  driver.step_with_sensitivity(0, {0.5});
  EXPECT_EQ(driver.block(0).score.nf4_error_score, 0.0);
  EXPECT_EQ(driver.block(0).score.nf4_sensitivity, 0.0);
  expect_hint(driver.hints()[0], SP_PRECISION_NF4, SP_REASON_THRESHOLD);
}

// ---- Assignment of an unassigned block ----

TEST(V2Rules, UnassignedGoesToBf16WhenS8ReachesBEvenIfS4IsLow) {
  Driver driver(v2_settings(kThreeTiers), 1);
  expect_hint(run(driver, 0, {0.6}, {0.0})[0], SP_PRECISION_BF16, SP_REASON_THRESHOLD);
}

TEST(V2Rules, UnassignedGoesToNf4WhenS4BelowN) {
  Driver driver(v2_settings(kThreeTiers), 1);
  expect_hint(run(driver, 0, {0.2}, {0.149})[0], SP_PRECISION_NF4, SP_REASON_THRESHOLD);
  EXPECT_EQ(driver.block(0).last_switch_step, 0);
  ASSERT_TRUE(driver.block(0).last_down_move);
  EXPECT_EQ(driver.block(0).last_down_move->from, SP_PRECISION_BF16);
}

TEST(V2Rules, UnassignedGoesToInt8WhenS4NotBelowNAndS8BelowI) {
  Driver driver(v2_settings(kThreeTiers), 1);
  expect_hint(run(driver, 0, {0.29}, {0.15})[0], SP_PRECISION_INT8, SP_REASON_THRESHOLD);
}

TEST(V2Rules, UnassignedTakesAmbiguousDefaultOtherwise) {
  Driver driver(v2_settings(kThreeTiers + "  ambiguous_default: int8\n"), 1);
  expect_hint(run(driver, 0, {0.4}, {0.4})[0], SP_PRECISION_INT8, SP_REASON_THRESHOLD);
}

TEST(V2Rules, AmbiguousDefaultInt8IsBf16WhenInt8NotATier) {
  Driver driver(v2_settings(kNoInt8 + "  ambiguous_default: int8\n"), 1);
  expect_hint(run(driver, 0, {0.1}, {0.4})[0], SP_PRECISION_BF16, SP_REASON_THRESHOLD);
}

TEST(V2Rules, Nf4NotATierIsNeverChosen) {
  Driver driver(v2_settings(), 1);
  expect_hint(run(driver, 0, {0.2}, {0.0})[0], SP_PRECISION_INT8, SP_REASON_THRESHOLD);
}

// ---- Assigned bf16 ----

TEST(V2Rules, Bf16GoesToNf4WhenS4BelowNMinusM) {
  Driver driver(v2_settings(kThreeTiers), 1);
  run(driver, 0, {0.7}, {0.7});
  expect_hint(run(driver, 1, {0.25}, {0.051})[0], SP_PRECISION_BF16, SP_REASON_HYSTERESIS_HOLD);
  expect_hint(run(driver, 2, {0.1}, {0.049})[0], SP_PRECISION_NF4, SP_REASON_THRESHOLD);
}

TEST(V2Rules, Bf16GoesToInt8WhenS8BelowIMinusMAndNf4NotDue) {
  Driver driver(v2_settings(kThreeTiers), 1);
  run(driver, 0, {0.7}, {0.7});
  expect_hint(run(driver, 1, {0.19}, {0.06})[0], SP_PRECISION_INT8, SP_REASON_THRESHOLD);
}

// ---- Assigned int8 ----

TEST(V2Rules, Int8GoesToBf16WhenS8ReachesB) {
  Driver driver(v2_settings(kThreeTiers), 1);
  run(driver, 0, {0.2}, {0.2});
  expect_hint(run(driver, 1, {0.6}, {0.0})[0], SP_PRECISION_BF16, SP_REASON_THRESHOLD);
}

TEST(V2Rules, Int8GoesToNf4WhenS4BelowNMinusM) {
  Driver driver(v2_settings(kThreeTiers), 1);
  run(driver, 0, {0.2}, {0.2});
  expect_hint(run(driver, 1, {0.2}, {0.06})[0], SP_PRECISION_INT8, SP_REASON_THRESHOLD);
  expect_hint(run(driver, 2, {0.2}, {0.04})[0], SP_PRECISION_NF4, SP_REASON_THRESHOLD);
}

// ---- Assigned nf4 ----

TEST(V2Rules, Nf4GoesBackToBf16WhenS8ReachesB) {
  Driver driver(v2_settings(kThreeTiers), 1);
  run(driver, 0, {0.2}, {0.0});
  expect_hint(run(driver, 1, {0.6}, {0.0})[0], SP_PRECISION_BF16, SP_REASON_THRESHOLD);
  EXPECT_FALSE(driver.block(0).last_down_move);
}

TEST(V2Rules, Nf4ToInt8WhenS4ReachesI) {
  Driver driver(v2_settings(kThreeTiers), 1);
  run(driver, 0, {0.2}, {0.0});
  expect_hint(run(driver, 1, {0.2}, {0.29})[0], SP_PRECISION_NF4, SP_REASON_HYSTERESIS_HOLD);
  expect_hint(run(driver, 2, {0.2}, {0.3})[0], SP_PRECISION_INT8, SP_REASON_THRESHOLD);
}

TEST(V2Rules, Nf4ToBf16WhenS4ReachesIAndInt8NotATier) {
  Driver driver(v2_settings(kNoInt8), 1);
  run(driver, 0, {0.2}, {0.0});
  expect_hint(run(driver, 1, {0.2}, {0.3})[0], SP_PRECISION_BF16, SP_REASON_THRESHOLD);
}

TEST(V2Rules, Nf4KeepsBelowNAsThreshold) {
  Driver driver(v2_settings(kThreeTiers), 1);
  run(driver, 0, {0.2}, {0.0});
  expect_hint(run(driver, 1, {0.5}, {0.1})[0], SP_PRECISION_NF4, SP_REASON_THRESHOLD);
}

TEST(V2Rules, CooldownHoldsEveryTierMove) {
  Driver driver(v2_settings(kThreeTiers, 3), 1);
  run(driver, 0, {0.2}, {0.0});  // nf4 at step 0 (a switch)
  expect_hint(run(driver, 1, {0.2}, {0.3})[0], SP_PRECISION_NF4, SP_REASON_COOLDOWN);
  expect_hint(run(driver, 3, {0.2}, {0.3})[0], SP_PRECISION_INT8, SP_REASON_THRESHOLD);
}

// ---- Forced, static, off ----

TEST(V2Rules, ForceNf4BlocksWinEvenOutsideTiers) {
  Driver driver(v2_settings("  force_nf4_blocks: [1]\n"), 2);
  const auto &hints = run(driver, 0, {0.9, 0.9}, {0.9, 0.9});
  expect_hint(hints[0], SP_PRECISION_BF16, SP_REASON_THRESHOLD);
  expect_hint(hints[1], SP_PRECISION_NF4, SP_REASON_FORCED);
}

TEST(V2Rules, StaticModeUsesTheForceListsIncludingNf4) {
  Driver driver(v2_settings(kThreeTiers + "  mode: static\n  force_nf4_blocks: [0]\n  force_int8_blocks: [1]\n"), 3);
  const auto &hints = run(driver, 0, {0.0, 0.0, 0.0}, {0.0, 0.0, 0.0});
  expect_hint(hints[0], SP_PRECISION_NF4, SP_REASON_FORCED);
  expect_hint(hints[1], SP_PRECISION_INT8, SP_REASON_FORCED);
  expect_hint(hints[2], SP_PRECISION_BF16, SP_REASON_MODE);
}

TEST(V2Rules, OffModeIsBf16Everywhere) {
  const ParsedConfig parsed =
      parse_policy_config(v2_settings(kThreeTiers + "  mode: off\n  force_nf4_blocks: [0]\n"), 2);
  EXPECT_EQ(parsed.warnings.size(), 1u);
  Driver driver(v2_settings(kThreeTiers + "  mode: off\n  force_nf4_blocks: [0]\n"), 2);
  const auto &hints = run(driver, 0, {0.0, 0.0}, {0.0, 0.0});
  expect_hint(hints[0], SP_PRECISION_BF16, SP_REASON_MODE);
  expect_hint(hints[1], SP_PRECISION_BF16, SP_REASON_MODE);
}

// ---- Imported precision outside the tiers ----

TEST(V2Rules, ImportedPrecisionOutsideTiersMovesUp) {
  Driver three(v2_settings(kThreeTiers, 50), 2);
  run(three, 0, {0.2, 0.2}, {0.0, 0.2});  // block 0 nf4, block 1 int8
  const std::vector<std::uint8_t> blob = three.engine().export_state();

  Driver two(v2_settings("", 50), 2);  // tiers [bf16, int8]
  two.engine().import_state(blob.data(), blob.size());
  const auto &hints = run(two, 1, {0.2, 0.2}, {0.0, 0.2});  // not past the cooldown: still moves
  expect_hint(hints[0], SP_PRECISION_INT8, SP_REASON_MODE);
  expect_hint(hints[1], SP_PRECISION_INT8, SP_REASON_THRESHOLD);
  EXPECT_EQ(two.block(0).last_switch_step, 1);

  Driver bf16_only(v2_settings("  tiers: [bf16]\n", 50), 2);
  bf16_only.engine().import_state(blob.data(), blob.size());
  const auto &up = run(bf16_only, 1, {0.2, 0.2}, {0.0, 0.2});
  expect_hint(up[0], SP_PRECISION_BF16, SP_REASON_MODE);
  expect_hint(up[1], SP_PRECISION_BF16, SP_REASON_MODE);
}

// ---- Loss guard ----

// Block 0 sits in bf16 for steps 0-3 (losses 1.0, 1.2, 1.0, 1.2 fill the window: mu 1.1,
// sd 0.1), moves down to int8 at step 4.
Driver guarded_after_down_move(const std::string &extra = "", int cooldown = 0, double loss_at_4 = 1.1) {
  Driver driver(v2_settings(kGuard + extra, cooldown), 2);
  for (int step = 0; step < 4; ++step) run(driver, step, {0.7, 0.7}, {0.7, 0.7}, step % 2 ? 1.2 : 1.0);
  run(driver, 4, {0.1, 0.7}, {0.7, 0.7}, loss_at_4);
  return driver;
}

TEST(V2Rules, LossWindowFillsBeforeAnythingIsJudged) {
  Driver driver(v2_settings(kGuard), 1);
  run(driver, 0, {0.1}, {0.7}, 1.0);
  run(driver, 1, {0.1}, {0.7}, 100.0);  // not judged: the window is not full
  EXPECT_FALSE(driver.engine().last_spike());
  EXPECT_EQ(driver.engine().state().loss_window.losses, (std::vector<double>{1.0, 100.0}));
}

TEST(V2Rules, SpikeNeedsBothSigmaAndMinRise) {
  // 1.25 is above mu*(1+min_rise) = 1.21 but not above mu + 2 sd = 1.3.
  Driver rise_only = guarded_after_down_move("", 0, 1.25);
  EXPECT_FALSE(rise_only.engine().last_spike());
  // A flat window: 1.05 is above mu + 2*0 but not above 1.1.
  Driver flat(v2_settings(kGuard), 1);
  for (int step = 0; step < 4; ++step) run(flat, step, {0.7}, {0.7}, 1.0);
  run(flat, 4, {0.1}, {0.7}, 1.05);
  EXPECT_FALSE(flat.engine().last_spike());
  // 1.35 is above both.
  Driver both = guarded_after_down_move("", 0, 1.35);
  ASSERT_TRUE(both.engine().last_spike());
  EXPECT_DOUBLE_EQ(both.engine().last_spike()->mu, 1.1);
  EXPECT_NEAR(both.engine().last_spike()->sd, 0.1, 1e-12);
  EXPECT_EQ(both.engine().last_spike()->blamed, (std::vector<std::uint32_t>{0}));
}

TEST(V2Rules, SpikeDoesNotEnterWindow) {
  Driver driver = guarded_after_down_move("", 0, 5.0);
  EXPECT_EQ(driver.engine().state().loss_window.losses, (std::vector<double>{1.0, 1.2, 1.0, 1.2}));
}

TEST(V2Rules, NonSpikeEntersWindowAndOldestLeaves) {
  Driver driver = guarded_after_down_move("", 0, 1.1);
  EXPECT_EQ(driver.engine().state().loss_window.losses, (std::vector<double>{1.2, 1.0, 1.2, 1.1}));
}

TEST(V2Rules, MissingOrNonFiniteLossIsIgnored) {
  Driver driver(v2_settings(kGuard), 1);
  run(driver, 0, {0.7}, {0.7}, 1.0);
  run(driver, 1, {0.7}, {0.7});  // no feedback
  run(driver, 2, {0.7}, {0.7}, std::numeric_limits<double>::infinity());
  run(driver, 3, {0.7}, {0.7}, -std::numeric_limits<double>::infinity());
  EXPECT_EQ(driver.engine().state().loss_window.losses, (std::vector<double>{1.0}));
}

TEST(V2Rules, SpikeBlamesOnlyDownMovesWithinBlameSteps) {
  Driver driver = guarded_after_down_move();
  for (int step = 5; step <= 7; ++step) run(driver, step, {0.1, 0.7}, {0.7, 0.7}, 1.1);
  run(driver, 8, {0.1, 0.7}, {0.7, 0.7}, 9.0);  // 8 - 4 = 4 > blame_steps 3
  ASSERT_TRUE(driver.engine().last_spike());
  EXPECT_TRUE(driver.engine().last_spike()->blamed.empty());
  EXPECT_FALSE(driver.block(0).pending_revert);
  Driver recent = guarded_after_down_move();
  for (int step = 5; step <= 6; ++step) run(recent, step, {0.1, 0.7}, {0.7, 0.7}, 1.1);
  run(recent, 7, {0.1, 0.7}, {0.7, 0.7}, 9.0);  // 7 - 4 = 3 <= 3
  EXPECT_EQ(recent.engine().last_spike()->blamed, (std::vector<std::uint32_t>{0}));
  EXPECT_EQ(recent.block(0).pending_revert, SP_PRECISION_BF16);
}

TEST(V2Rules, LossGuardRevertIgnoresCooldown) {
  Driver driver = guarded_after_down_move("", 10, 5.0);  // down at 4, cooldown 10
  const auto &hints = run(driver, 5, {0.1, 0.7}, {0.7, 0.7}, 1.1);
  expect_hint(hints[0], SP_PRECISION_BF16, SP_REASON_LOSS_GUARD);
  EXPECT_EQ(driver.block(0).last_switch_step, 5);
  EXPECT_EQ(driver.block(0).assignment, Assignment::bf16);
  EXPECT_FALSE(driver.block(0).last_down_move);
  EXPECT_FALSE(driver.block(0).pending_revert);
  EXPECT_EQ(driver.block(0).penalty_until, 10);
}

TEST(V2Rules, LossGuardRevertIsNotScored) {
  Driver driver = guarded_after_down_move("", 0, 5.0);
  const double before = driver.block(0).score.sensitivity;
  const auto &hints = run(driver, 5, {0.05, 0.7}, {0.7, 0.7}, 1.1);
  EXPECT_EQ(hints[0].sensitivity, before);
}

TEST(V2Rules, LossGuardRevertGoesToThePrecisionBeforeTheLastDownMove) {
  Driver driver(v2_settings(kGuard + kThreeTiers), 1);
  for (int step = 0; step < 4; ++step) run(driver, step, {0.2}, {0.2}, step % 2 ? 1.2 : 1.0);  // int8
  run(driver, 4, {0.2}, {0.0}, 5.0);                                                           // int8 -> nf4, spike
  expect_hint(run(driver, 5, {0.2}, {0.0}, 1.1)[0], SP_PRECISION_INT8, SP_REASON_LOSS_GUARD);
}

TEST(V2Rules, PenaltyBlocksMoveDown) {
  Driver driver = guarded_after_down_move("", 0, 5.0);
  run(driver, 5, {0.1, 0.7}, {0.7, 0.7}, 1.1);  // revert, penalty until 10
  for (int step = 6; step < 10; ++step) {
    expect_hint(run(driver, step, {0.1, 0.7}, {0.7, 0.7}, 1.1)[0], SP_PRECISION_BF16, SP_REASON_PENALTY);
  }
  expect_hint(run(driver, 10, {0.1, 0.7}, {0.7, 0.7}, 1.1)[0], SP_PRECISION_INT8, SP_REASON_THRESHOLD);
}

TEST(V2Rules, PenaltyDoesNotBlockMoveUp) {
  Driver driver(v2_settings(kGuard + kThreeTiers), 1);
  for (int step = 0; step < 4; ++step) run(driver, step, {0.2}, {0.2}, step % 2 ? 1.2 : 1.0);
  run(driver, 4, {0.2}, {0.0}, 5.0);
  run(driver, 5, {0.2}, {0.0}, 1.1);  // back to int8, penalty until 10
  expect_hint(run(driver, 6, {0.2}, {0.0}, 1.1)[0], SP_PRECISION_INT8, SP_REASON_PENALTY);
  expect_hint(run(driver, 7, {0.7}, {0.0}, 1.1)[0], SP_PRECISION_BF16, SP_REASON_THRESHOLD);
}

TEST(V2Rules, CooldownIsReportedBeforePenalty) {
  Driver driver = guarded_after_down_move("", 3, 5.0);
  run(driver, 5, {0.1, 0.7}, {0.7, 0.7}, 1.1);  // revert at 5: cooldown until 8, penalty until 10
  expect_hint(run(driver, 6, {0.1, 0.7}, {0.7, 0.7}, 1.1)[0], SP_PRECISION_BF16, SP_REASON_COOLDOWN);
  expect_hint(run(driver, 8, {0.1, 0.7}, {0.7, 0.7}, 1.1)[0], SP_PRECISION_BF16, SP_REASON_PENALTY);
}

TEST(V2Rules, UnsafeDropsPendingRevertButPenaltyStarts) {
  Driver driver(v2_settings(kGuard + kThreeTiers), 1);
  for (int step = 0; step < 4; ++step) run(driver, step, {0.2}, {0.2}, step % 2 ? 1.2 : 1.0);  // int8
  run(driver, 4, {0.2}, {0.0}, 5.0);  // int8 -> nf4, spike: pending revert to int8
  ASSERT_EQ(driver.block(0).pending_revert, SP_PRECISION_INT8);
  driver.engine().begin_step(5);
  const sp_grad_moments_v1 bad = nonfinite_moments(0);
  driver.engine().post_backward(5, &bad, 1);
  driver.engine().compute_hints(5, driver.mutable_hints().data(), 1);
  driver.engine().end_step(5, nullptr);
  expect_hint(driver.hints()[0], SP_PRECISION_BF16, SP_REASON_UNSAFE);
  EXPECT_FALSE(driver.block(0).pending_revert);
  EXPECT_EQ(driver.block(0).penalty_until, 10);
  expect_hint(run(driver, 6, {0.1}, {0.0}, 1.1)[0], SP_PRECISION_BF16, SP_REASON_PENALTY);
}

TEST(V2Rules, ForcedBlocksAreNeverBlamed) {
  Driver driver(v2_settings(kGuard + "  force_int8_blocks: [1]\n"), 2);
  for (int step = 0; step < 4; ++step) run(driver, step, {0.7, 0.7}, {0.7, 0.7}, step % 2 ? 1.2 : 1.0);
  run(driver, 4, {0.7, 0.7}, {0.7, 0.7}, 5.0);
  ASSERT_TRUE(driver.engine().last_spike());
  EXPECT_TRUE(driver.engine().last_spike()->blamed.empty());
  EXPECT_FALSE(driver.block(1).pending_revert);
}

TEST(V2Rules, NoBlockToBlameChangesNothing) {
  Driver driver(v2_settings(kGuard), 1);
  for (int step = 0; step < 4; ++step) run(driver, step, {0.7}, {0.7}, step % 2 ? 1.2 : 1.0);
  const std::vector<std::uint8_t> before = driver.engine().export_state();
  run(driver, 4, {0.7}, {0.7}, 5.0);
  EXPECT_TRUE(driver.engine().last_spike());
  EXPECT_FALSE(driver.block(0).pending_revert);
  EXPECT_EQ(driver.engine().state().loss_window.losses, (std::vector<double>{1.0, 1.2, 1.0, 1.2}));
}

TEST(V2Rules, MoveUpClearsTheDownMoveRecord) {
  Driver driver = guarded_after_down_move();
  ASSERT_TRUE(driver.block(0).last_down_move);
  run(driver, 5, {0.7, 0.7}, {0.7, 0.7}, 1.1);  // int8 -> bf16
  EXPECT_FALSE(driver.block(0).last_down_move);
  run(driver, 6, {0.7, 0.7}, {0.7, 0.7}, 9.0);
  EXPECT_TRUE(driver.engine().last_spike()->blamed.empty());
}

TEST(V2Rules, DisabledGuardJudgesNothing) {
  Driver driver(v2_settings(), 1);
  for (int step = 0; step < 30; ++step) run(driver, step, {0.1}, {0.7}, step == 25 ? 1e9 : 1.0);
  EXPECT_FALSE(driver.engine().last_spike());
  EXPECT_TRUE(driver.engine().state().loss_window.losses.empty());
  EXPECT_FALSE(driver.block(0).pending_revert);
}

// The guard acts only when enabled and the mode is dynamic: a blob holding a pending revert
// or a penalty, imported under a disabled guard, neither reverts nor holds a block back (the
// compatibility rule: no revert, no penalty), and the import drops both.
TEST(V2Rules, DisabledGuardDropsImportedRevertsAndPenalties) {
  Driver spiked = guarded_after_down_move("", 0, 5.0);  // block 0 int8, pending revert to bf16
  ASSERT_EQ(spiked.block(0).pending_revert, SP_PRECISION_BF16);
  const std::vector<std::uint8_t> pending = spiked.engine().export_state();
  Driver disabled(v2_settings(), 2);
  disabled.engine().import_state(pending.data(), pending.size());
  EXPECT_FALSE(disabled.block(0).pending_revert);
  expect_hint(run(disabled, 5, {0.1, 0.7}, {0.7, 0.7}, 1.1)[0], SP_PRECISION_INT8, SP_REASON_THRESHOLD);

  run(spiked, 5, {0.1, 0.7}, {0.7, 0.7}, 1.1);  // reverted to bf16, penalty until 10
  ASSERT_EQ(spiked.block(0).penalty_until, 10);
  const std::vector<std::uint8_t> penalised = spiked.engine().export_state();
  Driver disabled_too(v2_settings(), 2);
  disabled_too.engine().import_state(penalised.data(), penalised.size());
  EXPECT_FALSE(disabled_too.block(0).penalty_until);
  expect_hint(run(disabled_too, 6, {0.1, 0.7}, {0.7, 0.7}, 1.1)[0], SP_PRECISION_INT8, SP_REASON_THRESHOLD);
}

// In static (or off) mode an enabled guard judges nothing: no loss enters the window and no
// revert is left behind to fire once a later config makes the mode dynamic.
TEST(V2Rules, GuardJudgesOnlyInDynamicMode) {
  Driver dynamic = guarded_after_down_move();  // block 0 moved down at step 4, window full
  const std::vector<std::uint8_t> blob = dynamic.engine().export_state();
  Driver fixed(v2_settings(kGuard + "  mode: static\n"), 2);
  fixed.engine().import_state(blob.data(), blob.size());
  const std::vector<double> window = fixed.engine().state().loss_window.losses;
  run(fixed, 5, {0.1, 0.7}, {0.7, 0.7}, 9.0);
  EXPECT_FALSE(fixed.engine().last_spike());
  EXPECT_FALSE(fixed.block(0).pending_revert);
  EXPECT_EQ(fixed.engine().state().loss_window.losses, window);
  Driver off(v2_settings(kGuard + "  mode: off\n"), 1);
  for (int step = 0; step < 6; ++step) run(off, step, {0.1}, {0.7}, step == 5 ? 9.0 : 1.0);
  EXPECT_TRUE(off.engine().state().loss_window.losses.empty());

  const std::vector<std::uint8_t> after = fixed.engine().export_state();
  Driver back(v2_settings(kGuard), 2);
  back.engine().import_state(after.data(), after.size());
  expect_hint(run(back, 6, {0.1, 0.7}, {0.7, 0.7}, 1.1)[0], SP_PRECISION_INT8, SP_REASON_THRESHOLD);
}

// A block the importing config forces never reverts; its pending revert goes at import.
TEST(V2Rules, ImportDropsThePendingRevertOfAForcedBlock) {
  Driver spiked = guarded_after_down_move("", 0, 5.0);
  const std::vector<std::uint8_t> blob = spiked.engine().export_state();
  Driver forced(v2_settings(kGuard + "  force_int8_blocks: [0]\n"), 2);
  forced.engine().import_state(blob.data(), blob.size());
  EXPECT_FALSE(forced.block(0).pending_revert);
  expect_hint(run(forced, 5, {0.1, 0.7}, {0.7, 0.7}, 1.1)[0], SP_PRECISION_INT8, SP_REASON_FORCED);
}

// ---- Calibration and transfer bytes ----

TEST(V2Rules, PrecisionCalibrationErrorsKeepPrecisionsApart) {
  Driver driver(v2_settings(kThreeTiers), 2);
  const std::uint32_t ids[] = {1};
  const double errors[] = {0.25};
  driver.engine().set_precision_calibration_errors(SP_PRECISION_NF4, ids, errors, 1);
  EXPECT_FALSE(driver.block(1).calibration_error);
  EXPECT_EQ(driver.block(1).nf4_calibration_error, 0.25);
  EXPECT_THROW(driver.engine().set_precision_calibration_errors(SP_PRECISION_BF16, ids, errors, 1), InvalidArgument);
  EXPECT_THROW(driver.engine().set_precision_calibration_errors(7, ids, errors, 1), InvalidArgument);
  const double negative[] = {-1.0};
  EXPECT_THROW(driver.engine().set_precision_calibration_errors(SP_PRECISION_NF4, ids, negative, 1), InvalidArgument);
  EXPECT_EQ(driver.block(1).nf4_calibration_error, 0.25);
}

TEST(V2Rules, TransferBytesNeedOneEntryPerBlock) {
  Driver driver(v2_settings(kThreeTiers), 2);
  const std::uint64_t bytes[] = {560, 600};
  driver.engine().set_transfer_bytes(SP_PRECISION_NF4, bytes, 2);
  EXPECT_EQ(driver.engine().block_bytes()[1][SP_PRECISION_NF4], 600u);
  EXPECT_THROW(driver.engine().set_transfer_bytes(SP_PRECISION_NF4, bytes, 1), InvalidArgument);
  EXPECT_THROW(driver.engine().set_transfer_bytes(9, bytes, 2), InvalidArgument);
  EXPECT_THROW(driver.engine().set_transfer_bytes(SP_PRECISION_NF4, nullptr, 2), InvalidArgument);
}

// ---- State ----

TEST(V2Rules, StateV2CarriesEveryV2Field) {
  Driver driver = guarded_after_down_move(kThreeTiers, 0, 5.0);
  const std::vector<std::uint8_t> blob = driver.engine().export_state();
  Driver other(v2_settings(kGuard + kThreeTiers), 2);
  other.engine().import_state(blob.data(), blob.size());
  EXPECT_EQ(other.engine().export_state(), blob);
  EXPECT_EQ(other.engine().state().loss_window.losses, driver.engine().state().loss_window.losses);
  EXPECT_EQ(other.block(0).pending_revert, driver.block(0).pending_revert);
  EXPECT_EQ(other.block(0).last_down_move->step, driver.block(0).last_down_move->step);
  EXPECT_EQ(other.block(0).nf4_calibration_error, driver.block(0).nf4_calibration_error);
  EXPECT_EQ(other.block(0).score.nf4_sensitivity, driver.block(0).score.nf4_sensitivity);
  // The continuation is identical.
  for (int step = 5; step < 15; ++step) {
    const std::vector<sp_hint_v1> a = run(driver, step, {0.1, 0.05}, {0.04, 0.2}, 1.1);
    const std::vector<sp_hint_v1> b = run(other, step, {0.1, 0.05}, {0.04, 0.2}, 1.1);
    for (std::size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(a[i].precision, b[i].precision);
      EXPECT_EQ(a[i].reason, b[i].reason);
    }
  }
}

// The BLK2 record of `block` (state_codec.cpp): flags down-move at +1 and pending at +2,
// precision before the down move at +20, pending revert precision at +21. The edited blob is
// re-sealed so that the field checks, not the checksum, judge it.
std::vector<std::uint8_t> with_blk2(std::vector<std::uint8_t> blob, std::uint32_t n_blocks, std::uint32_t block,
                                    std::uint8_t has_down, std::uint8_t down_from, std::uint8_t has_pending,
                                    std::uint8_t pending) {
  constexpr std::size_t kRecord = 46;
  const std::size_t record = blob.size() - 4 - kRecord * (n_blocks - block);
  blob[record + 1] = has_down;
  blob[record + 2] = has_pending;
  blob[record + 20] = down_from;
  blob[record + 21] = pending;
  if (has_down) blob[record + 12] = 4;  // down move step 4 (<= the blob's step)
  boost::crc_32_type crc;
  crc.process_bytes(blob.data(), blob.size() - 4);
  for (int i = 0; i < 4; ++i) blob[blob.size() - 4 + i] = static_cast<std::uint8_t>(crc.checksum() >> (8 * i));
  return blob;
}

void expect_state_rejected(const std::vector<std::uint8_t> &blob, const std::string &message_part) {
  Driver target(v2_settings(kGuard + kThreeTiers), 2);
  const std::vector<std::uint8_t> before = target.engine().export_state();
  try {
    target.engine().import_state(blob.data(), blob.size());
    ADD_FAILURE() << "accepted a blob that should say: " << message_part;
  } catch (const StateError &error) {
    EXPECT_NE(std::string(error.what()).find(message_part), std::string::npos) << error.what();
  }
  EXPECT_EQ(target.engine().export_state(), before);
}

// A pending revert or a recorded move down must point above the block's assignment: a
// "revert" to nf4 on a bf16 block would be a move down that skips the cooldown and the penalty.
TEST(V2Rules, StateRejectsRevertsAndDownMovesThatDoNotPointUp) {
  Driver driver = guarded_after_down_move("", 0, 5.0);  // block 0 int8 (down from bf16, pending bf16), 1 bf16
  const std::vector<std::uint8_t> blob = driver.engine().export_state();
  {
    Driver target(v2_settings(kGuard + kThreeTiers), 2);  // the untouched blob is fine
    target.engine().import_state(blob.data(), blob.size());
    EXPECT_EQ(target.block(0).pending_revert, SP_PRECISION_BF16);
  }
  expect_state_rejected(with_blk2(blob, 2, 1, 1, SP_PRECISION_NF4, 1, SP_PRECISION_NF4),
                        "block 1: the precision before the down move (nf4) must be more precise than the block's "
                        "assignment (bf16)");
  expect_state_rejected(with_blk2(blob, 2, 1, 0, 0, 1, SP_PRECISION_NF4),
                        "block 1: the pending revert precision (nf4) must be more precise than the block's "
                        "assignment (bf16)");
  expect_state_rejected(with_blk2(blob, 2, 0, 1, SP_PRECISION_BF16, 1, SP_PRECISION_INT8),
                        "block 0: the pending revert precision (int8) must be more precise than the block's "
                        "assignment (int8)");
  expect_state_rejected(with_blk2(blob, 2, 0, 1, SP_PRECISION_INT8, 0, 0),
                        "block 0: the precision before the down move (int8) must be more precise");
  expect_state_rejected(with_blk2(blob, 2, 0, 0, 0, 1, SP_PRECISION_BF16),
                        "block 0: a pending revert to bf16 needs a recorded down move from bf16");
}

TEST(V2Rules, StateV2AShorterLossWindowKeepsTheNewestLosses) {
  Driver driver = guarded_after_down_move("", 0, 1.1);
  const std::vector<std::uint8_t> blob = driver.engine().export_state();
  Driver other(v2_settings("  loss_guard: {enabled: true, window: 2}\n"), 2);
  other.engine().import_state(blob.data(), blob.size());
  EXPECT_EQ(other.engine().state().loss_window.losses, (std::vector<double>{1.2, 1.1}));
}

}  // namespace
}  // namespace sp::policy::testing
