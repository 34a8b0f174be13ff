#include "sp/adapters/schedule.h"

#include <stdexcept>
#include <string>
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
  StepSchedule schedule(ScheduleOptions{4, true, {}});
  EXPECT_EQ(uses_of(schedule), (Uses{{0, F}, {1, F}, {2, F}, {3, F}, {3, B}, {2, B}, {1, B}, {0, B}}));
  ASSERT_EQ(schedule.fetches().size(), 7u);
  EXPECT_EQ(schedule.fetches()[3].block, 3u);
  EXPECT_EQ(schedule.fetches()[3].first_use, 3u);
  EXPECT_EQ(schedule.fetches()[3].last_use, 4u);
  EXPECT_EQ(schedule.uses()[4].fetch, 3u);
  EXPECT_EQ(schedule.fetches()[4].phase, B);
}

TEST(StepSchedule, ForwardOnly) {
  StepSchedule schedule(ScheduleOptions{3, false, {}});
  EXPECT_EQ(uses_of(schedule), (Uses{{0, F}, {1, F}, {2, F}}));
  EXPECT_EQ(schedule.fetches().size(), 3u);
}

TEST(StepSchedule, RejectsAStepWithoutBlocks) {
  EXPECT_THROW(StepSchedule(ScheduleOptions{0, true, {}}), std::invalid_argument);
}

TEST(StepSchedule, FollowsAnOrderAndReversesItForTheBackward) {
  StepSchedule schedule(ScheduleOptions{4, true, {2, 0, 3, 1}});
  EXPECT_EQ(uses_of(schedule), (Uses{{2, F}, {0, F}, {3, F}, {1, F}, {1, B}, {3, B}, {0, B}, {2, B}}));
  ASSERT_EQ(schedule.fetches().size(), 7u);
  EXPECT_EQ(schedule.fetches()[3].block, 1u);
  EXPECT_EQ(schedule.fetches()[3].last_use, 4u);
  EXPECT_EQ(schedule.forward_use(2), 0u);
  EXPECT_EQ(schedule.forward_use(1), 3u);
  EXPECT_EQ(schedule.backward_use(1), 4u);
  EXPECT_EQ(schedule.backward_use(2), 7u);
  EXPECT_EQ(schedule.options().order, (std::vector<std::uint32_t>{2, 0, 3, 1}));
}

TEST(StepSchedule, TheDefaultOrderIsTheBlocksIds) {
  StepSchedule schedule(ScheduleOptions{3, false, {}});
  EXPECT_EQ(schedule.options().order, (std::vector<std::uint32_t>{0, 1, 2}));
  EXPECT_EQ(schedule.forward_use(2), 2u);
  EXPECT_THROW(schedule.backward_use(0), std::logic_error);
}

TEST(StepSchedule, RejectsAnOrderThatDoesNotListEachBlockOnce) {
  const auto message = [](std::vector<std::uint32_t> order) {
    try {
      StepSchedule(ScheduleOptions{3, true, std::move(order)});
    } catch (const std::invalid_argument &e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_EQ(message({0, 1}), "ScheduleOptions.order lists 2 blocks where there are 3: it lists each block once");
  EXPECT_EQ(message({0, 2, 0}), "ScheduleOptions.order: block 0 at position 2 is listed twice (also at 0)");
  EXPECT_EQ(message({0, 3, 1}), "ScheduleOptions.order: block 3 at position 1 is out of range (there are 3 blocks)");
}

}  // namespace
}  // namespace sp::adapters
