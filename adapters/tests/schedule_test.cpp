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
constexpr Phase R = Phase::recompute;
constexpr Phase B = Phase::backward;

TEST(StepSchedule, ForwardThenBackwardSharesTheTurningBlock) {
  StepSchedule schedule(ScheduleOptions{4, true, 0});
  EXPECT_EQ(uses_of(schedule), (Uses{{0, F}, {1, F}, {2, F}, {3, F}, {3, B}, {2, B}, {1, B}, {0, B}}));
  ASSERT_EQ(schedule.fetches().size(), 7u);
  EXPECT_EQ(schedule.fetches()[3].block, 3u);
  EXPECT_EQ(schedule.fetches()[3].first_use, 3u);
  EXPECT_EQ(schedule.fetches()[3].last_use, 4u);
  EXPECT_EQ(schedule.uses()[4].fetch, 3u);
  EXPECT_EQ(schedule.fetches()[4].phase, B);
}

TEST(StepSchedule, ForwardOnly) {
  StepSchedule schedule(ScheduleOptions{3, false, 0});
  EXPECT_EQ(uses_of(schedule), (Uses{{0, F}, {1, F}, {2, F}}));
  EXPECT_EQ(schedule.fetches().size(), 3u);
}

TEST(StepSchedule, RecomputeReRunsEverySegmentButTheLast) {
  StepSchedule schedule(ScheduleOptions{5, true, 2});
  // Segments [0,2) [2,4) [4,5); the last one keeps its activations.
  EXPECT_EQ(uses_of(schedule), (Uses{{0, F},
                                     {1, F},
                                     {2, F},
                                     {3, F},
                                     {4, F},
                                     {4, B},
                                     {2, R},
                                     {3, R},
                                     {3, B},
                                     {2, B},
                                     {0, R},
                                     {1, R},
                                     {1, B},
                                     {0, B}}));
  // 4F+4B, 3R+3B and 1R+1B share fetches.
  EXPECT_EQ(schedule.fetches().size(), 11u);
}

TEST(StepSchedule, RecomputeOfSingleBlockSegments) {
  StepSchedule schedule(ScheduleOptions{3, true, 1});
  EXPECT_EQ(uses_of(schedule), (Uses{{0, F}, {1, F}, {2, F}, {2, B}, {1, R}, {1, B}, {0, R}, {0, B}}));
  EXPECT_EQ(schedule.fetches().size(), 5u);
  EXPECT_EQ(schedule.describe_use(4), "block 1 (recompute) at use 4");
}

TEST(StepSchedule, RejectsInconsistentOptions) {
  EXPECT_THROW(StepSchedule(ScheduleOptions{0, true, 0}), std::invalid_argument);
  EXPECT_THROW(StepSchedule(ScheduleOptions{4, false, 2}), std::invalid_argument);
  EXPECT_THROW(StepSchedule(ScheduleOptions{4, true, 5}), std::invalid_argument);
}

}  // namespace
}  // namespace sp::adapters
