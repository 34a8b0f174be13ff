// The exact multiple-choice knapsack behind policy v3's budget (docs/policy.md, "Policy v3"):
// every unit takes exactly one of its options, each with a size in bytes and a cost, and the
// solver finds the best allocation under a limit on the other quantity. A pure function of its
// arguments: the same inputs give the same allocation on every rank.
//
// Method: dynamic programming over the total size. All sizes are divided by their greatest
// common divisor, so units of equal shape make the table small. When the table would still
// exceed `max_cells` (units x size steps), sizes are rounded UP to buckets of `bucket_bytes`
// and a byte limit DOWN, so a byte limit is never exceeded; the optimum is then exact at that
// granularity. Costs are summed in unit order, and floating-point addition is monotonic, so the
// optimum is exactly the one an exhaustive search summing in the same order finds.
//
// Ties: among allocations of equal objective the one with the fewest (bucketed) bytes wins;
// then, from the last unit to the first, each unit takes its earliest option that keeps an
// optimum (list options from most to least preferred, e.g. bf16, int8, nf4).
#pragma once

#include <cstdint>
#include <vector>

namespace sp::policy {

struct KnapsackOption {
  std::uint64_t bytes = 0;
  double cost = 0.0;  // finite
};

// The options of one unit, at least one.
using KnapsackUnit = std::vector<KnapsackOption>;

// About 16 MiB of choices; for 48 units a size resolution of 1/350000 of the largest total.
inline constexpr std::uint64_t kDefaultKnapsackCells = std::uint64_t{1} << 24;

struct KnapsackSolution {
  std::vector<std::uint32_t> choice;  // per unit, an index into its options
  std::uint64_t bytes = 0;            // exact total of the chosen options
  double cost = 0.0;                  // exact total, summed in unit order
  // The limit holds. When it cannot, the solution is the fallback the function names.
  bool feasible = false;
  // 1 when the sizes were used exactly (up to their common divisor); otherwise the bucket.
  std::uint64_t bucket_bytes = 1;
};

// The least total cost whose total bytes stay within `byte_limit`. Infeasible (every
// allocation is larger): the allocation with the fewest bytes, the least cost among those.
// Throws std::invalid_argument for a unit without options or with more than 255, a
// non-finite cost, or max_cells < units x (units + 1) (too small to bucket at all).
KnapsackSolution least_cost_within_bytes(const std::vector<KnapsackUnit> &units, std::uint64_t byte_limit,
                                         std::uint64_t max_cells = kDefaultKnapsackCells);

// The fewest total bytes whose total cost stays within `cost_limit`; the least cost among
// those. Infeasible (every allocation costs more): the allocation of least cost, the fewest
// bytes among those. Throws as least_cost_within_bytes, and for a NaN limit.
KnapsackSolution least_bytes_within_cost(const std::vector<KnapsackUnit> &units, double cost_limit,
                                         std::uint64_t max_cells = kDefaultKnapsackCells);

}  // namespace sp::policy
