// Reproduces the worked example of docs/policy.md step by step. If this test changes,
// the document changes with it.
#include "policy_test_support.h"

#include <gtest/gtest.h>

#include <fstream>
#include <limits>
#include <sstream>

namespace sp::policy::testing {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

std::string read_file(const std::string &path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

struct Expected {
  sp_precision precision;
  sp_reason reason;
  double sensitivity;
};

void expect_hints(const std::vector<sp_hint_v1> &hints, const std::vector<Expected> &expected, int step) {
  for (std::size_t b = 0; b < expected.size(); ++b) {
    EXPECT_EQ(hints[b].precision, expected[b].precision) << "step " << step << " block " << b;
    EXPECT_EQ(hints[b].reason, expected[b].reason) << "step " << step << " block " << b;
    if (std::isnan(expected[b].sensitivity)) {
      EXPECT_TRUE(std::isnan(hints[b].sensitivity)) << "step " << step << " block " << b;
    } else {
      EXPECT_NEAR(hints[b].sensitivity, expected[b].sensitivity, 1e-12) << "step " << step << " block " << b;
    }
  }
}

TEST(PolicyWorkedExample, MatchesTheDocument) {
  Driver driver(read_file(SP_POLICY_CONFIG_DIR "/worked_example.yaml"), 4);
  const std::uint32_t ids[] = {0, 3};
  const double errors[] = {0.01, 0.05};
  driver.engine().set_calibration_errors(ids, errors, 2);

  constexpr sp_precision BF16 = SP_PRECISION_BF16;
  constexpr sp_precision INT8 = SP_PRECISION_INT8;
  const double never = kNaN;

  // Steps 0 and 1: warmup, every block BF16 and unscored.
  for (int step = 0; step < 2; ++step) {
    expect_hints(driver.step_l2(step, {1, 2, 4, 8}),
                 {{BF16, SP_REASON_NOT_DECISION_STEP, never},
                  {BF16, SP_REASON_NOT_DECISION_STEP, never},
                  {BF16, SP_REASON_NOT_DECISION_STEP, never},
                  {BF16, SP_REASON_NOT_DECISION_STEP, never}},
                 step);
  }
  // Step 2: avg_l2 = 1, 2, 4, 8; mean_all = 3.75.
  const double s2[] = {0.7 * (1 / 3.75 / 2) + 0.3 * 0.2, 0.7 * (2 / 3.75 / 2), 0.7 * (4 / 3.75 / 2), 1.0};
  expect_hints(driver.step_l2(2, {1, 2, 4, 8}),
               {{INT8, SP_REASON_THRESHOLD, s2[0]},
                {INT8, SP_REASON_THRESHOLD, s2[1]},
                {BF16, SP_REASON_THRESHOLD, s2[2]},
                {BF16, SP_REASON_THRESHOLD, s2[3]}},
               2);
  // Step 3: block 1's gradient is non-finite.
  expect_hints(
      driver.step(3, {moments_with_l2(0, 1), nonfinite_moments(1), moments_with_l2(2, 1), moments_with_l2(3, 8)}),
      {{INT8, SP_REASON_NOT_DECISION_STEP, s2[0]},
       {BF16, SP_REASON_UNSAFE, s2[1]},
       {BF16, SP_REASON_NOT_DECISION_STEP, s2[2]},
       {BF16, SP_REASON_NOT_DECISION_STEP, s2[3]}},
      3);
  // Step 4: windows 1,1 | 2,2 | 1,1 | 8,8; mean_all = 3.
  const double s4[] = {0.7 * (1 / 3.0 / 2) + 0.3 * 0.2, 0.7 * (2 / 3.0 / 2), 0.7 * (1 / 3.0 / 2), 1.0};
  expect_hints(driver.step_l2(4, {1, 2, 1, 8}),
               {{INT8, SP_REASON_THRESHOLD, s4[0]},
                {BF16, SP_REASON_HYSTERESIS_HOLD, s4[1]},
                {INT8, SP_REASON_THRESHOLD, s4[2]},
                {BF16, SP_REASON_THRESHOLD, s4[3]}},
               4);
  // Steps 5 and 6: windows 1,1 | 0.5,0.5 | 8,8 | 8,8; mean_all = 4.375.
  driver.step_l2(5, {1, 0.5, 8, 8});
  const double s6[] = {0.7 * (1 / 4.375 / 2) + 0.3 * 0.2, 0.7 * (0.5 / 4.375 / 2), 0.7 * (8 / 4.375 / 2),
                       0.7 * (8 / 4.375 / 2) + 0.3};
  expect_hints(driver.step_l2(6, {1, 0.5, 8, 8}),
               {{INT8, SP_REASON_THRESHOLD, s6[0]},
                {BF16, SP_REASON_COOLDOWN, s6[1]},
                {INT8, SP_REASON_COOLDOWN, s6[2]},
                {BF16, SP_REASON_THRESHOLD, s6[3]}},
               6);
  // Steps 7 and 8: same gradients; the cooldowns (switches at 3 and 4) have passed at 8.
  driver.step_l2(7, {1, 0.5, 8, 8});
  expect_hints(driver.step_l2(8, {1, 0.5, 8, 8}),
               {{INT8, SP_REASON_THRESHOLD, s6[0]},
                {INT8, SP_REASON_THRESHOLD, s6[1]},
                {BF16, SP_REASON_THRESHOLD, s6[2]},
                {BF16, SP_REASON_THRESHOLD, s6[3]}},
               8);
  EXPECT_EQ(driver.block(1).last_switch_step, 8);
  EXPECT_EQ(driver.block(2).last_switch_step, 8);
}

}  // namespace
}  // namespace sp::policy::testing
