// PolicySession's hints: translated once from the ABI, after PolicyHost validated them, and
// kept in one place (hints()) for the runtime to route by.
#include <sp/host/policy_session.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "test_support.h"

namespace sp::host {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

constexpr std::uint32_t kBlocks = 6;
const std::string kPolicy = "int8_max_l2: 1.5\nmin_samples: 2\n";
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

PolicyHostOptions options(const testing::CapturedLog& log) {
  PolicyHostOptions result;
  result.logger = log.logger();
  return result;
}

TEST(UnitHints, TranslateFromTheAbiAndBackAndNameABadEntry) {
  const std::vector<sp_hint_v1> abi = {{0, SP_PRECISION_NF4, 0.25, SP_REASON_BUDGET, 0},
                                       {1, SP_PRECISION_BF16, kNaN, SP_REASON_NO_DATA, 0},
                                       {2, SP_PRECISION_INT8, 1.0, SP_REASON_FORCED, 0}};
  const std::vector<UnitHint> hints = hints_from_abi(abi);
  EXPECT_EQ(hints, (std::vector<UnitHint>{{Precision::nf4, 0.25, SP_REASON_BUDGET},
                                          {Precision::bf16, kNaN, SP_REASON_NO_DATA},
                                          {Precision::int8, 1.0, SP_REASON_FORCED}}));
  EXPECT_EQ(hints_from_abi(hints_to_abi(hints)), hints);
  EXPECT_EQ(hints_to_abi(hints)[2].block_id, 2u);

  std::vector<sp_hint_v1> wrong_id = abi;
  wrong_id[1].block_id = 0;
  EXPECT_THAT([&] { hints_from_abi(wrong_id); },
              ThrowsMessage<std::invalid_argument>(HasSubstr("hints[1].block_id is 0, expected 1")));
  std::vector<sp_hint_v1> wrong_precision = abi;
  wrong_precision[2].precision = 7;
  EXPECT_THAT([&] { hints_from_abi(wrong_precision); },
              ThrowsMessage<std::invalid_argument>(HasSubstr(
                  "hints[2].precision is 7; expected SP_PRECISION_BF16 (0), SP_PRECISION_INT8 (1) or SP_PRECISION_NF4 (2)")));
}

TEST(PolicySession, KeepsThePluginsHintsTranslatedOnceAsTheHostGaveThem) {
  testing::CapturedLog log;
  std::vector<std::vector<sp_hint_v1>> expected;  // the host's own, step by step
  {
    PolicyHost host(SP_FIXTURE_SCRIPTED, {kPolicy, "scripted.yaml"}, testing::make_blocks(kBlocks), options(log));
    for (std::int64_t step = 0; step < 6; ++step) expected.push_back(testing::run_step(host, step));
  }
  PolicySession session(SP_FIXTURE_SCRIPTED, {kPolicy, "scripted.yaml"}, testing::make_blocks(kBlocks), options(log));
  EXPECT_TRUE(session.hints().empty());
  EXPECT_FALSE(session.take_initial_hints());  // a 1.0 plugin has none
  EXPECT_TRUE(session.hints().empty());
  const sp_step_feedback_v1 feedback{0, 0, 2.5, 1000, 500, 2000, std::nan(""), 250};  // run_step's
  bool some_int8 = false;
  for (std::int64_t step = 0; step < 6; ++step) {
    session.begin_step(step);
    session.post_backward(step, testing::synthetic_moments(step, kBlocks));
    const std::vector<UnitHint>& hints = session.compute_hints(step);
    EXPECT_EQ(&hints, &session.hints());
    EXPECT_EQ(hints, hints_from_abi(expected[static_cast<std::size_t>(step)])) << "step " << step;
    session.end_step(step, feedback);
    for (const UnitHint& h : hints) some_int8 |= h.precision == Precision::int8;
  }
  EXPECT_TRUE(some_int8);  // the steps decided something besides the default

  const std::vector<UnitHint> before = session.hints();
  EXPECT_THAT([&] { session.restore_hints(std::vector<UnitHint>(kBlocks - 1)); },
              ThrowsMessage<std::invalid_argument>(HasSubstr("5 hints for 6 policy units: expected one per unit, or none")));
  EXPECT_EQ(session.hints(), before);
  session.restore_hints({});
  EXPECT_TRUE(session.hints().empty());
}

}  // namespace
}  // namespace sp::host
