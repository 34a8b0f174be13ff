// The budget's vocabulary that policies v3 and v4 share with the engine, the state codec, the
// telemetry and the plugin entry: the tiers' column names, bytes per tier, the byte limit,
// the structural prior, and the feasibility check of a bytes budget at create (docs/policy.md).
#pragma once

#include "sp/policy/config.h"
#include "sp/policy/telemetry.h"
#include "sp/policy/tiers.h"

#include <sp/plugin_abi_v1.h>
#include <sp/precision_abi.h>

#include <array>
#include <cstdint>
#include <vector>

namespace sp::policy {

// v3's key: the weight of the previous average when a signal table arrives (cost = s*cost +
// (1-s)*new), read by the engine, which records every table, and by the budget rule.
inline constexpr const char *kSignalSmoothing = "signal_smoothing";

// "<before><route><after>" for every route, indexed by sp_precision: the signal table's column
// names ("loss_cost.nf4") and the force lists' keys ("force_nf4_blocks"). Plain characters, so
// that a static one needs no destructor (the plugin is dlclose()d at every hot swap).
class TierColumns {
 public:
  explicit TierColumns(const char *before, const char *after = "");
  const char *operator()(sp_precision tier) const;

 private:
  static constexpr std::size_t kLongest = 32;
  PerTier<std::array<char, kLongest>> names_{};
};

// The signal table's column names that v3 reads (loss_cost) and records (the two terms).
const char *loss_cost_column(sp_precision tier);
const char *first_order_column(sp_precision tier);
const char *second_order_column(sp_precision tier);

// What one transfer of every block moves when block b travels at routes[b].
std::uint64_t allocation_bytes(const std::vector<BlockBytes> &blocks, const std::vector<sp_precision> &routes,
                               std::int64_t nf4_group_size);

// What every block moves as BF16, and the byte limit of a bytes budget `fraction` of it, rounded
// down so that it is never exceeded.
std::uint64_t all_bf16_bytes(const std::vector<BlockBytes> &blocks);
std::uint64_t byte_limit(double fraction, std::uint64_t all_bf16);

// One step of v3's exponential moving average: `value` when there is no average yet (NaN),
// `smoothing * average + (1 - smoothing) * value` after; a NaN value leaves the average.
double smoothed(double average, double value, double smoothing);

// llama.cpp's use_more_bits pattern (docs/policy.md): the first and last eighth of the units,
// and every third unit between, with integer division as llama.cpp has it.
bool gets_more_bits(std::uint32_t unit, std::uint32_t n_units);

// The structural prior used before any signal: every byte a unit saves costs the same, twice
// as much in a use_more_bits unit; in units of a reference loss of 1.
double prior_cost(const std::vector<BlockBytes> &blocks, std::uint32_t unit, sp_precision tier,
                  std::int64_t nf4_group_size);

// A bytes budget below what the force lists and the cheapest tiers allow is a PolicyConfigError
// naming budget.bytes and the smallest feasible fraction. Other configs pass.
void check_budget_feasible(const ParsedConfig &parsed, const std::vector<BlockBytes> &block_bytes);

}  // namespace sp::policy
