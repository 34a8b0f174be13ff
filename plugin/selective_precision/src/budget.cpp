// The budget's vocabulary that policies v3 and v4 share (budget.h): bytes per tier, the byte
// limit, the structural prior and the feasibility check at create.
#include "sp/policy/budget.h"
#include "sp/policy/decision_rule.h"
#include "sp/policy/errors.h"

#include <fmt/format.h>
#include <sp/precision_abi.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <string_view>

namespace sp::policy {

std::uint64_t all_bf16_bytes(const std::vector<BlockBytes> &blocks) {
  std::uint64_t total = 0;
  for (const BlockBytes &block : blocks) total += block[SP_PRECISION_BF16];
  return total;
}

std::uint64_t byte_limit(double fraction, std::uint64_t all_bf16) {
  return static_cast<std::uint64_t>(std::floor(fraction * static_cast<double>(all_bf16)));
}

double smoothed(double average, double value, double smoothing) {
  if (std::isnan(value)) return average;
  return std::isnan(average) ? value : smoothing * average + (1.0 - smoothing) * value;
}

TierColumns::TierColumns(const char *before, const char *after) {
  for (Precision route : kPrecisions) {
    char *name = names_[to_abi(route)].data();
    *fmt::format_to_n(name, kLongest - 1, "{}{}{}", before, sp::precision_name(route), after).out = '\0';
  }
}

const char *TierColumns::operator()(sp_precision tier) const { return names_[tier].data(); }

const char *loss_cost_column(sp_precision tier) {
  static const TierColumns columns("loss_cost.");
  return columns(tier);
}
const char *first_order_column(sp_precision tier) {
  static const TierColumns columns("first_order.");
  return columns(tier);
}
const char *second_order_column(sp_precision tier) {
  static const TierColumns columns("second_order.");
  return columns(tier);
}

std::uint64_t allocation_bytes(const std::vector<BlockBytes> &blocks, const std::vector<sp_precision> &routes,
                               std::int64_t nf4_group_size) {
  std::uint64_t total = 0;
  for (std::size_t b = 0; b < routes.size(); ++b) total += tier_bytes(blocks[b], routes[b], nf4_group_size);
  return total;
}

bool gets_more_bits(std::uint32_t unit, std::uint32_t n_units) {
  const std::uint32_t eighth = n_units / 8;
  return unit < eighth || unit >= 7 * n_units / 8 || (unit >= eighth && (unit - eighth) % 3 == 2);
}

double prior_cost(const std::vector<BlockBytes> &blocks, std::uint32_t unit, sp_precision tier,
                  std::int64_t nf4_group_size) {
  const std::uint64_t bf16 = blocks[unit][SP_PRECISION_BF16];
  const std::uint64_t bytes = tier_bytes(blocks[unit], tier, nf4_group_size);
  const double saved = bf16 > bytes ? static_cast<double>(bf16 - bytes) : 0.0;
  const double weight = gets_more_bits(unit, static_cast<std::uint32_t>(blocks.size())) ? 2.0 : 1.0;
  return weight * saved / static_cast<double>(all_bf16_bytes(blocks));
}

void check_budget_feasible(const ParsedConfig &parsed, const std::vector<BlockBytes> &block_bytes) {
  const PolicySettings &config = parsed.config;
  if (!takes_budget(config.effective_mode())) return;
  for (std::size_t b = 0; b < block_bytes.size(); ++b) {
    const std::uint64_t bf16 = block_bytes[b][SP_PRECISION_BF16], int8 = block_bytes[b][SP_PRECISION_INT8];
    if (bf16 == 0 || (config.tier(SP_PRECISION_INT8) && int8 == 0)) {
      throw InvalidArgument(
          fmt::format("create: block {} has bf16_bytes {} and int8_bytes {}; mode budget needs the "
                      "size of every block at every tier",
                      b, bf16, int8));
    }
  }
  if (config.budget.kind != BudgetKind::bytes) return;
  std::vector<std::int8_t> forced(block_bytes.size(), -1);
  for (sp_precision tier : kTiers) {
    for (std::uint32_t b : config.force_blocks[tier]) forced[b] = static_cast<std::int8_t>(tier);
  }
  std::uint64_t fewest = 0;
  for (std::size_t b = 0; b < block_bytes.size(); ++b) {
    std::uint64_t least = block_bytes[b][SP_PRECISION_BF16];
    for (sp_precision tier : kTiers) {
      const bool allowed = forced[b] >= 0 ? tier == forced[b] : config.tier(tier);
      if (allowed) least = std::min(least, tier_bytes(block_bytes[b], tier, config.nf4_group_size));
    }
    if (forced[b] >= 0) least = tier_bytes(block_bytes[b], forced[b], config.nf4_group_size);
    fewest += least;
  }
  const std::uint64_t all_bf16 = all_bf16_bytes(block_bytes);
  if (fewest > byte_limit(config.budget.limit, all_bf16)) {
    // At four digits, the smallest fraction that is itself feasible.
    double smallest = std::ceil(1e4 * static_cast<double>(fewest) / static_cast<double>(all_bf16)) / 1e4;
    while (byte_limit(smallest, all_bf16) < fewest) smallest += 1e-4;
    throw PolicyConfigError(fmt::format(
        "{}.budget.bytes: expected at least {} (the fewest bytes the tiers {} and the force lists allow: {} of {} "
        "all-BF16 bytes), found {}",
        parsed.section_path, smallest, config.tier(SP_PRECISION_NF4) ? "with nf4" : "without nf4", fewest, all_bf16,
        config.budget.limit));
  }
}

}  // namespace sp::policy
