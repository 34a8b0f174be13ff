#include "sp/policy/knapsack.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <optional>
#include <stdexcept>

namespace sp::policy {
namespace {

constexpr double kUnreachable = std::numeric_limits<double>::infinity();
constexpr std::size_t kMaxOptionsPerUnit = 255;  // choices are stored as bytes

void check_units(const std::vector<KnapsackUnit> &units, std::uint64_t max_cells) {
  for (std::size_t u = 0; u < units.size(); ++u) {
    if (units[u].empty() || units[u].size() > kMaxOptionsPerUnit) {
      throw std::invalid_argument(
          fmt::format("knapsack: unit {} has {} options; expected 1 to {}", u, units[u].size(), kMaxOptionsPerUnit));
    }
    for (std::size_t k = 0; k < units[u].size(); ++k) {
      if (!std::isfinite(units[u][k].cost)) {
        throw std::invalid_argument(fmt::format("knapsack: unit {} option {} has cost {}", u, k, units[u][k].cost));
      }
    }
  }
  const std::uint64_t n = units.size();
  if (n > 0 && max_cells / n < n + 1) {
    throw std::invalid_argument(
        fmt::format("knapsack: max_cells {} cannot hold {} units; expected at least {}", max_cells, n, n * (n + 1)));
  }
}

// The DP over total size in steps of `step_bytes`: best[w] is the least cost of an allocation
// of every unit whose sizes sum to exactly w steps, choice[u * (max_steps + 1) + w] the option
// unit u takes in it.
struct SizeTable {
  std::uint64_t step_bytes = 1;
  bool bucketed = false;
  std::vector<std::vector<std::uint64_t>> steps;  // per unit, per option
  std::uint64_t max_steps = 0;
  std::vector<double> best;
  std::vector<std::uint8_t> choice;
};

std::uint64_t steps_of(std::uint64_t bytes, std::uint64_t step_bytes, bool round_up) {
  return round_up ? bytes / step_bytes + (bytes % step_bytes != 0 ? 1 : 0) : bytes / step_bytes;
}

std::uint64_t max_steps_at(const std::vector<KnapsackUnit> &units, std::uint64_t step_bytes, bool round_up) {
  std::uint64_t total = 0;
  for (const KnapsackUnit &unit : units) {
    std::uint64_t largest = 0;
    for (const KnapsackOption &option : unit) largest = std::max(largest, steps_of(option.bytes, step_bytes, round_up));
    total += largest;
  }
  return total;
}

SizeTable build_table(const std::vector<KnapsackUnit> &units, std::uint64_t max_cells) {
  SizeTable table;
  const std::uint64_t n = units.size();
  std::uint64_t divisor = 0;
  for (const KnapsackUnit &unit : units) {
    for (const KnapsackOption &option : unit) divisor = std::gcd(divisor, option.bytes);
  }
  table.step_bytes = std::max<std::uint64_t>(divisor, 1);
  table.max_steps = max_steps_at(units, table.step_bytes, false);
  const std::uint64_t allowed_steps = n == 0 ? table.max_steps : max_cells / n - 1;
  if (table.max_steps > allowed_steps) {
    // Rounding each size up adds at most one step per unit, so a bucket of total/allowed fits
    // after a doubling or two at most; check_units guaranteed allowed_steps >= n.
    const std::uint64_t total_bytes = table.max_steps * table.step_bytes;
    table.bucketed = true;
    table.step_bytes = std::max<std::uint64_t>(total_bytes / allowed_steps, 1);
    while ((table.max_steps = max_steps_at(units, table.step_bytes, true)) > allowed_steps) table.step_bytes *= 2;
  }
  table.steps.resize(units.size());
  for (std::size_t u = 0; u < units.size(); ++u) {
    for (const KnapsackOption &option : units[u]) {
      table.steps[u].push_back(steps_of(option.bytes, table.step_bytes, table.bucketed));
    }
  }

  const std::size_t width = static_cast<std::size_t>(table.max_steps) + 1;
  std::vector<double> previous(width, kUnreachable);
  previous[0] = 0.0;
  std::vector<double> current(width);
  table.choice.assign(units.size() * width, 0);
  std::uint64_t reachable = 0;  // the largest total the units so far can reach
  for (std::size_t u = 0; u < units.size(); ++u) {
    std::uint64_t largest = 0;
    for (std::uint64_t s : table.steps[u]) largest = std::max(largest, s);
    reachable += largest;
    std::fill(current.begin(), current.end(), kUnreachable);
    std::uint8_t *choices = table.choice.data() + u * width;
    for (std::uint64_t w = 0; w <= reachable; ++w) {
      for (std::size_t k = 0; k < units[u].size(); ++k) {
        const std::uint64_t s = table.steps[u][k];
        if (s > w || previous[w - s] == kUnreachable) continue;
        const double candidate = previous[w - s] + units[u][k].cost;
        // Strictly less: at equal cost the earlier option stays.
        if (candidate < current[w]) {
          current[w] = candidate;
          choices[w] = static_cast<std::uint8_t>(k);
        }
      }
    }
    previous.swap(current);
  }
  table.best = std::move(previous);
  return table;
}

KnapsackSolution trace_back(const std::vector<KnapsackUnit> &units, const SizeTable &table, std::uint64_t total,
                            bool feasible) {
  KnapsackSolution solution;
  solution.feasible = feasible;
  solution.bucket_bytes = table.bucketed ? table.step_bytes : 1;
  solution.choice.resize(units.size());
  const std::size_t width = static_cast<std::size_t>(table.max_steps) + 1;
  for (std::size_t u = units.size(); u-- > 0;) {
    const std::uint8_t k = table.choice[u * width + total];
    solution.choice[u] = k;
    total -= table.steps[u][k];
  }
  for (std::size_t u = 0; u < units.size(); ++u) {
    solution.bytes += units[u][solution.choice[u]].bytes;
    solution.cost += units[u][solution.choice[u]].cost;
  }
  return solution;
}

// The total of least cost among those with `accept(total)`, the smallest at equal cost.
template <typename Accept>
std::optional<std::uint64_t> least_cost_total(const SizeTable &table, Accept accept) {
  std::optional<std::uint64_t> chosen;
  for (std::uint64_t w = 0; w <= table.max_steps; ++w) {
    if (table.best[w] == kUnreachable || !accept(w)) continue;
    if (!chosen || table.best[w] < table.best[*chosen]) chosen = w;
  }
  return chosen;
}

}  // namespace

KnapsackSolution least_cost_within_bytes(const std::vector<KnapsackUnit> &units, std::uint64_t byte_limit,
                                         std::uint64_t max_cells) {
  check_units(units, max_cells);
  const SizeTable table = build_table(units, max_cells);
  const std::uint64_t limit_steps = byte_limit / table.step_bytes;
  if (const auto within = least_cost_total(table, [&](std::uint64_t w) { return w <= limit_steps; })) {
    return trace_back(units, table, *within, true);
  }
  // Every allocation is larger: the smallest total, at its least cost.
  std::uint64_t smallest = 0;
  while (table.best[smallest] == kUnreachable) ++smallest;
  return trace_back(units, table, smallest, false);
}

KnapsackSolution least_bytes_within_cost(const std::vector<KnapsackUnit> &units, double cost_limit,
                                         std::uint64_t max_cells) {
  if (std::isnan(cost_limit)) throw std::invalid_argument("knapsack: the cost limit is NaN");
  check_units(units, max_cells);
  const SizeTable table = build_table(units, max_cells);
  for (std::uint64_t w = 0; w <= table.max_steps; ++w) {
    if (table.best[w] <= cost_limit) return trace_back(units, table, w, true);
  }
  return trace_back(units, table, *least_cost_total(table, [](std::uint64_t) { return true; }), false);
}

}  // namespace sp::policy
