#include "sp/adapters/schedule.h"

#include <stdexcept>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

namespace sp::adapters {
namespace {

using Uses = std::vector<std::pair<std::uint32_t, Phase>>;

Uses uses_of(const StepSchedule &schedule) {
  Uses uses;
  for (const BlockUse &use : schedule.uses()) {
    uses.emplace_back(use.block, use.phase);
  }
  return uses;
}

constexpr Phase F = Phase::forward;
constexpr Phase B = Phase::backward;

TEST(StepSchedule, ForwardThenBackwardSharesTheTurningBlock) {
  StepSchedule schedule(ScheduleOptions{4, true});
  EXPECT_EQ(uses_of(schedule), (Uses{{0, F}, {1, F}, {2, F}, {3, F}, {3, B}, {2, B}, {1, B}, {0, B}}));
  ASSERT_EQ(schedule.fetches().size(), 7u);
  EXPECT_EQ(schedule.fetches()[3].block, 3u);
  EXPECT_EQ(schedule.fetches()[3].first_use, 3u);
  EXPECT_EQ(schedule.fetches()[3].last_use, 4u);
  EXPECT_EQ(schedule.uses()[4].fetch, 3u);
  EXPECT_EQ(schedule.fetches()[4].phase, B);
}

TEST(StepSchedule, ForwardOnly) {
  StepSchedule schedule(ScheduleOptions{3, false});
  EXPECT_EQ(uses_of(schedule), (Uses{{0, F}, {1, F}, {2, F}}));
  EXPECT_EQ(schedule.fetches().size(), 3u);
}

TEST(StepSchedule, RejectsAStepWithoutBlocks) {
  EXPECT_THROW(StepSchedule(ScheduleOptions{0, true}), std::invalid_argument);
}

}  // namespace
}  // namespace sp::adapters
