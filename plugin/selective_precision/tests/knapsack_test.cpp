// The budget allocation's solver against an exhaustive search on many small random problems,
// and its edge cases (docs/policy.md, "Policy v3").
#include "sp/policy/knapsack.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <stdexcept>
#include <vector>

namespace sp::policy {
namespace {

struct Candidate {
  std::uint64_t bytes = 0;
  double cost = 0.0;
};

// Every allocation, its cost summed in unit order as the solver sums it.
std::vector<Candidate> every_allocation(const std::vector<KnapsackUnit> &units) {
  std::vector<Candidate> all{Candidate{}};
  for (const KnapsackUnit &unit : units) {
    std::vector<Candidate> next;
    for (const Candidate &prefix : all) {
      for (const KnapsackOption &option : unit) next.push_back({prefix.bytes + option.bytes, prefix.cost + option.cost});
    }
    all = std::move(next);
  }
  return all;
}

Candidate total_of(const std::vector<KnapsackUnit> &units, const KnapsackSolution &solution) {
  Candidate total;
  for (std::size_t u = 0; u < units.size(); ++u) {
    total.bytes += units[u].at(solution.choice.at(u)).bytes;
    total.cost += units[u].at(solution.choice.at(u)).cost;
  }
  return total;
}

std::vector<KnapsackUnit> random_problem(std::mt19937_64 &rng, bool integer_costs) {
  std::uniform_int_distribution<int> unit_count(1, 6);
  std::uniform_int_distribution<int> option_count(1, 3);
  std::uniform_int_distribution<std::uint64_t> size(0, 40);
  std::uniform_int_distribution<int> small_cost(-2, 9);
  std::uniform_real_distribution<double> real_cost(-0.5, 3.0);
  std::vector<KnapsackUnit> units(static_cast<std::size_t>(unit_count(rng)));
  for (KnapsackUnit &unit : units) {
    const int options = option_count(rng);
    for (int k = 0; k < options; ++k) {
      // Multiples of 8 often, so that the common divisor is exercised.
      const std::uint64_t bytes = (rng() % 2 == 0 ? 8 : 1) * size(rng);
      unit.push_back({bytes, integer_costs ? small_cost(rng) : real_cost(rng)});
    }
  }
  return units;
}

TEST(Knapsack, LeastCostWithinBytesMatchesExhaustiveSearch) {
  std::mt19937_64 rng(20260401);
  for (int trial = 0; trial < 3000; ++trial) {
    const std::vector<KnapsackUnit> units = random_problem(rng, trial % 2 == 0);
    const std::vector<Candidate> all = every_allocation(units);
    const std::uint64_t limit = rng() % 200;
    std::optional<Candidate> best;
    for (const Candidate &c : all) {
      if (c.bytes <= limit && (!best || c.cost < best->cost || (c.cost == best->cost && c.bytes < best->bytes))) best = c;
    }
    const KnapsackSolution solution = least_cost_within_bytes(units, limit);
    const Candidate got = total_of(units, solution);
    EXPECT_EQ(got.bytes, solution.bytes);
    EXPECT_EQ(got.cost, solution.cost);
    EXPECT_EQ(solution.bucket_bytes, 1u);
    ASSERT_EQ(solution.feasible, best.has_value()) << "trial " << trial;
    if (best) {
      EXPECT_EQ(solution.cost, best->cost) << "trial " << trial;
      EXPECT_EQ(solution.bytes, best->bytes) << "trial " << trial;
    } else {
      std::uint64_t fewest = std::numeric_limits<std::uint64_t>::max();
      for (const Candidate &c : all) fewest = std::min(fewest, c.bytes);
      EXPECT_EQ(solution.bytes, fewest) << "trial " << trial;
    }
  }
}

TEST(Knapsack, LeastBytesWithinCostMatchesExhaustiveSearch) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 3000; ++trial) {
    const std::vector<KnapsackUnit> units = random_problem(rng, trial % 2 == 1);
    const std::vector<Candidate> all = every_allocation(units);
    const double limit = static_cast<double>(rng() % 25) - 3.0 + (trial % 3 == 0 ? 0.5 : 0.0);
    std::optional<Candidate> best;
    for (const Candidate &c : all) {
      if (c.cost <= limit && (!best || c.bytes < best->bytes || (c.bytes == best->bytes && c.cost < best->cost))) best = c;
    }
    const KnapsackSolution solution = least_bytes_within_cost(units, limit);
    EXPECT_EQ(total_of(units, solution).cost, solution.cost);
    ASSERT_EQ(solution.feasible, best.has_value()) << "trial " << trial;
    if (best) {
      EXPECT_EQ(solution.bytes, best->bytes) << "trial " << trial;
      EXPECT_EQ(solution.cost, best->cost) << "trial " << trial;
    } else {
      double least = std::numeric_limits<double>::infinity();
      for (const Candidate &c : all) least = std::min(least, c.cost);
      EXPECT_EQ(solution.cost, least) << "trial " << trial;
    }
  }
}

TEST(Knapsack, BucketsNeverExceedAByteLimitAndSayTheirGranularity) {
  std::mt19937_64 rng(99);
  for (int trial = 0; trial < 500; ++trial) {
    std::vector<KnapsackUnit> units(5);
    for (KnapsackUnit &unit : units) {
      const std::uint64_t bf16 = 1000 + rng() % 997;
      unit = {{bf16, 0.0}, {bf16 / 2 + 7, 1.0 + static_cast<double>(rng() % 5)}, {bf16 / 4 + 3, 4.0}};
    }
    const std::uint64_t limit = 2000 + rng() % 6000;
    // 5 units x 60 steps: the sizes (coprime, thousands of bytes) must be bucketed.
    const KnapsackSolution solution = least_cost_within_bytes(units, limit, 5 * 60);
    EXPECT_GT(solution.bucket_bytes, 1u);
    if (solution.feasible) {
      EXPECT_LE(solution.bytes, limit) << "trial " << trial;
    }
    // Exact search at the same granularity never finds a cheaper allocation that the
    // bucketed sizes also fit.
    const std::uint64_t q = solution.bucket_bytes;
    std::vector<KnapsackUnit> bucketed = units;
    for (KnapsackUnit &unit : bucketed) {
      for (KnapsackOption &option : unit) option.bytes = (option.bytes + q - 1) / q * q;
    }
    const KnapsackSolution exact = least_cost_within_bytes(bucketed, limit / q * q);
    EXPECT_EQ(exact.feasible, solution.feasible);
    if (exact.feasible) {
      EXPECT_EQ(exact.cost, solution.cost) << "trial " << trial;
    }
  }
}

TEST(Knapsack, TiesGoToFewerBytesThenToTheEarlierOptionOfTheLastUnits) {
  // Two identical units, room for one to shrink: the last unit keeps its earlier option 0, so
  // the first one shrinks.
  const std::vector<KnapsackUnit> twins = {{{10, 0.0}, {5, 1.0}}, {{10, 0.0}, {5, 1.0}}};
  const KnapsackSolution solution = least_cost_within_bytes(twins, 15);
  EXPECT_EQ(solution.choice, (std::vector<std::uint32_t>{1, 0}));
  // Equal cost, different sizes: the smaller total wins.
  const std::vector<KnapsackUnit> free_options = {{{10, 0.0}, {5, 0.0}}};
  EXPECT_EQ(least_cost_within_bytes(free_options, 100).bytes, 5u);
  // Equal cost and size: the earlier option.
  const std::vector<KnapsackUnit> same = {{{4, 1.0}, {4, 1.0}}};
  EXPECT_EQ(least_cost_within_bytes(same, 4).choice, (std::vector<std::uint32_t>{0}));
  EXPECT_EQ(least_bytes_within_cost(same, 1.0).choice, (std::vector<std::uint32_t>{0}));
}

TEST(Knapsack, InfeasibleLimitsFallBackAsDocumented) {
  const std::vector<KnapsackUnit> units = {{{10, 0.0}, {6, 2.0}, {4, 5.0}}, {{8, 0.0}, {4, 1.0}}};
  const KnapsackSolution too_small = least_cost_within_bytes(units, 7);
  EXPECT_FALSE(too_small.feasible);
  EXPECT_EQ(too_small.bytes, 8u);  // the fewest bytes there are
  EXPECT_EQ(too_small.cost, 6.0);
  const KnapsackSolution too_cheap = least_bytes_within_cost(units, -1.0);
  EXPECT_FALSE(too_cheap.feasible);
  EXPECT_EQ(too_cheap.cost, 0.0);  // the least cost there is
  EXPECT_EQ(too_cheap.bytes, 18u);
}

TEST(Knapsack, OneUnitAndPinnedUnits) {
  const std::vector<KnapsackUnit> one = {{{10, 0.0}, {5, 0.25}, {3, 0.75}}};
  EXPECT_EQ(least_cost_within_bytes(one, 5).choice, (std::vector<std::uint32_t>{1}));
  EXPECT_EQ(least_bytes_within_cost(one, 0.5).choice, (std::vector<std::uint32_t>{1}));
  // Every unit pinned to one option: that is the allocation, feasible or not.
  const std::vector<KnapsackUnit> pinned = {{{10, 1.0}}, {{6, 2.0}}};
  const KnapsackSolution within = least_cost_within_bytes(pinned, 16);
  EXPECT_TRUE(within.feasible);
  EXPECT_EQ(within.bytes, 16u);
  EXPECT_FALSE(least_cost_within_bytes(pinned, 15).feasible);
  EXPECT_EQ(least_cost_within_bytes(pinned, 15).bytes, 16u);
  EXPECT_TRUE(least_cost_within_bytes({}, 0).feasible);
}

TEST(Knapsack, RejectsWhatItCannotSolve) {
  EXPECT_THROW(least_cost_within_bytes({{}}, 10), std::invalid_argument);
  EXPECT_THROW(least_cost_within_bytes({{{1, std::numeric_limits<double>::quiet_NaN()}}}, 10), std::invalid_argument);
  EXPECT_THROW(least_cost_within_bytes({{{1, 0.0}}, {{1, 0.0}}}, 10, 5), std::invalid_argument);
  EXPECT_THROW(least_bytes_within_cost({{{1, 0.0}}}, std::numeric_limits<double>::quiet_NaN()), std::invalid_argument);
}

}  // namespace
}  // namespace sp::policy
