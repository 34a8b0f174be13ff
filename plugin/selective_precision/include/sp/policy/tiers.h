// The policy's tiers: the route table's routes by their ABI codes, in preference order, and the
// container of one value per tier that the plugin's tables use (budget, signals, measurements).
#pragma once

#include <sp/plugin_abi_v1.h>
#include <sp/precision_abi.h>

#include <array>
#include <cstddef>
#include <optional>
#include <stdexcept>
#include <string>

namespace sp::policy {

// The tiers in preference order (the route table's, from the most precise), by their ABI codes.
inline constexpr std::array<sp_precision, kPrecisionCount> kTiers = [] {
  std::array<sp_precision, kPrecisionCount> tiers{};
  for (std::size_t i = 0; i < kPrecisionCount; ++i) tiers[i] = to_abi(kPrecisions[i]);
  return tiers;
}();

// Where `code` stands in kTiers: the index of every per-tier array. An ABI code is a name, not an
// index (a route's code and its place in the order need not agree); nullopt for a code that is no
// route's.
constexpr std::optional<std::size_t> tier_position(sp_precision code) {
  for (std::size_t i = 0; i < kTiers.size(); ++i) {
    if (kTiers[i] == code) return i;
  }
  return std::nullopt;
}

// One T per tier, in kTiers' order, looked up by the tier's ABI code. A code that is no route's
// throws std::out_of_range, which the plugin's entry points turn into a status.
template <typename T>
struct PerTier {
  std::array<T, kTiers.size()> values{};

  constexpr T &operator[](sp_precision code) { return values[position(code)]; }
  constexpr const T &operator[](sp_precision code) const { return values[position(code)]; }
  // Only an sp_precision looks a tier up: a position (a std::size_t, say) is values[i], and would
  // otherwise convert silently into a code, which is the same number only while the codes follow
  // the table's order.
  template <typename Index>
  T &operator[](Index) = delete;
  template <typename Index>
  const T &operator[](Index) const = delete;
  constexpr auto begin() { return values.begin(); }
  constexpr auto end() { return values.end(); }
  constexpr auto begin() const { return values.begin(); }
  constexpr auto end() const { return values.end(); }
  friend constexpr bool operator==(const PerTier &a, const PerTier &b) { return a.values == b.values; }

 private:
  static constexpr std::size_t position(sp_precision code) {
    const std::optional<std::size_t> at = tier_position(code);
    if (!at) throw std::out_of_range("sp_precision " + std::to_string(code) + " is no route of this plugin's");
    return *at;
  }
};

}  // namespace sp::policy
