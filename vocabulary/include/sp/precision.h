// The precisions a block's weights can cross the link in, as every C++ layer names them: the
// enum, the one table of what differs between routes (kRouteTraits, in the way ggml's
// type_traits[GGML_TYPE_COUNT] describes its types) and the one per-precision container. Code
// outside the kernels loops over the table or indexes it instead of naming a route, so a new
// route is its enumerator, its row, its ABI code and slab code, and its kernels. The two wire
// formats' codes are translated in one place each, from the row: the plugin ABI's sp_precision
// (sp/precision_abi.h) and the slab's on-disk SlabPrecision (adapters' route_encoding.cpp).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "sp/plugin_abi_v1.h"

namespace sp {

// From the most to the least precise: BF16 (copied as is), INT8 (codes and fp32 scales, about
// 0.5x the bytes) and NF4 (packed 4-bit codes and bf16 scales, about 0.27x at group size 64).
#ifndef SP_TEST_ALIAS_ROUTE
enum class Precision : std::uint8_t { bf16, int8, nf4 };
inline constexpr std::array kPrecisions = {Precision::bf16, Precision::int8, Precision::nf4};
#else
// A test build's fourth route (the CMake option SP_TEST_ALIAS_ROUTE): INT8's images under a name
// and an ABI code of their own, placed as precise as INT8, before NF4, so that NF4's enumerator
// moves while its ABI code stays. Nothing outside this table, the ABI code below and the kernels
// knows it: StreamedModel.TheTestBuildsAliasRouteStreamsIsReportedAndIsCheckpointed.
enum class Precision : std::uint8_t { bf16, int8, int8_alias, nf4 };
inline constexpr std::array kPrecisions = {Precision::bf16, Precision::int8, Precision::int8_alias, Precision::nf4};
#define SP_PRECISION_INT8_ALIAS 3
#endif
inline constexpr std::size_t kPrecisionCount = kPrecisions.size();

// One route's facts outside its kernels. The rows are indexed by Precision.
struct RouteTraits {
  Precision precision;
  const char* name;                  // "nf4": the name of configs, reports, JSON and Python
  const char* label;                 // "NF4": the name in logs and messages to people
  sp_precision abi_code;             // the plugin ABI's code (sp/precision_abi.h)
  const char* abi_name;              // "SP_PRECISION_NF4": the code's name, for messages
  std::uint32_t abi_minor;           // the plugin ABI minor that added the code (1.1 for NF4)
  std::uint32_t slab_code;           // the kernels' SlabPrecision (adapters' route_encoding.cpp)
  const char* group_size_option;     // "nf4_group_size": the option naming its scale group;
                                     // nullptr for a route without scales
  std::uint32_t default_group_size;  // 0: one scale per row
  bool per_row_scales;               // whether group size 0 (one scale per row) is accepted
  std::uint32_t code_bits;           // bits per weight in the image's codes
  std::uint32_t scale_bytes;         // bytes per scale; 0 without scales
};

inline constexpr std::array<RouteTraits, kPrecisionCount> kRouteTraits = {{
    {Precision::bf16, "bf16", "BF16", SP_PRECISION_BF16, "SP_PRECISION_BF16", 0, 1, nullptr, 0, false, 16, 0},
    {Precision::int8, "int8", "INT8", SP_PRECISION_INT8, "SP_PRECISION_INT8", 0, 2, "int8_group_size", 0, true, 8, 4},
#ifdef SP_TEST_ALIAS_ROUTE
    {Precision::int8_alias, "int8_alias", "INT8_ALIAS", SP_PRECISION_INT8_ALIAS, "SP_PRECISION_INT8_ALIAS",
     SP_PLUGIN_ABI_MINOR, 2, "int8_alias_group_size", 0, true, 8, 4},
#endif
    {Precision::nf4, "nf4", "NF4", SP_PRECISION_NF4, "SP_PRECISION_NF4", 1, 4, "nf4_group_size", 64, false, 4, 2},
}};

constexpr const RouteTraits& route_traits(Precision precision) noexcept {
  return kRouteTraits[static_cast<std::size_t>(precision)];
}

constexpr bool rows_follow_the_enum() noexcept {
  for (std::size_t i = 0; i < kPrecisionCount; ++i) {
    if (kRouteTraits[i].precision != kPrecisions[i]) return false;
  }
  return true;
}
static_assert(rows_follow_the_enum(), "kRouteTraits and kPrecisions must list the routes in Precision's order");

// "bf16", "int8", "nf4": the names of configs, reports, JSON and Python.
constexpr const char* precision_name(Precision precision) noexcept { return route_traits(precision).name; }

// The precision precision_name() gives `name`; nullopt for any other text.
constexpr std::optional<Precision> precision_named(std::string_view name) noexcept {
  for (Precision precision : kPrecisions) {
    if (name == precision_name(precision)) return precision;
  }
  return std::nullopt;
}

// True for the routes that are staged and dequantized on the device: those with scales.
constexpr bool is_quantized(Precision precision) noexcept { return route_traits(precision).scale_bytes != 0; }

constexpr std::size_t quantized_count() noexcept {
  std::size_t count = 0;
  for (Precision precision : kPrecisions) count += is_quantized(precision) ? 1 : 0;
  return count;
}

// The quantized routes, from the most to the least precise: the tiers a policy can narrow a
// block to, and the columns of every per-tier table.
inline constexpr std::array<Precision, quantized_count()> kQuantizedPrecisions = [] {
  std::array<Precision, quantized_count()> routes{};
  std::size_t next = 0;
  for (Precision precision : kPrecisions) {
    if (is_quantized(precision)) routes[next++] = precision;
  }
  return routes;
}();

// The nominal bits one weight costs on `precision` at `group_size` (codes plus scales, without a
// slab's headers and padding): what a planner estimates before an image exists. For one scale
// per row (group size 0) the scales are left out, as they are a row's, not a weight's.
constexpr double nominal_bits_per_weight(Precision precision, std::uint32_t group_size) noexcept {
  const RouteTraits& route = route_traits(precision);
  const double scales = group_size == 0 ? 0.0 : 8.0 * route.scale_bytes / group_size;
  return route.code_bits + scales;
}

// Whether `group_size` is one the route's codec takes: 32, 64, 128 or 256, and 0 where the route
// has per-row scales. A route without scales takes only 0.
constexpr bool is_supported_group_size(Precision precision, std::uint32_t group_size) noexcept {
  const RouteTraits& route = route_traits(precision);
  if (route.scale_bytes == 0) return group_size == 0;
  if (group_size == 0) return route.per_row_scales;
  return group_size == 32 || group_size == 64 || group_size == 128 || group_size == 256;
}

// "32, 64, 128 or 256", with "0 (one scale per row), " first where the route accepts it: the
// expectation a message about a route's group size states.
inline std::string group_size_expectation(Precision precision) {
  std::string text = route_traits(precision).per_row_scales ? "0 (one scale per row), " : "";
  return text + "32, 64, 128 or 256";
}

// "'bf16', 'int8' or 'nf4'": the routes listed for a message, each name written by
// `word(route)`, the quantized ones only when asked.
template <class Word>
std::string list_routes(Word&& word, bool quantized_only = false) {
  std::string text;
  std::size_t listed = 0, count = 0;
  for (Precision precision : kPrecisions) count += (!quantized_only || is_quantized(precision)) ? 1 : 0;
  for (Precision precision : kPrecisions) {
    if (quantized_only && !is_quantized(precision)) continue;
    if (listed > 0) text += listed + 1 == count ? " or " : ", ";
    text += word(route_traits(precision));
    ++listed;
  }
  return text;
}
inline std::string quoted_route_names(bool quantized_only = false) {
  return list_routes([](const RouteTraits& route) { return std::string("'") + route.name + "'"; }, quantized_only);
}

// One T per precision, indexed by Precision: a struct that counts something per route holds
// one of these instead of a field per precision, so a new route adds no field anywhere.
template <typename T>
struct PerPrecision {
  std::array<T, kPrecisionCount> values{};

  constexpr T& operator[](Precision precision) { return values[static_cast<std::size_t>(precision)]; }
  constexpr const T& operator[](Precision precision) const { return values[static_cast<std::size_t>(precision)]; }
  constexpr PerPrecision& operator+=(const PerPrecision& other) {
    for (std::size_t i = 0; i < kPrecisionCount; ++i) values[i] += other.values[i];
    return *this;
  }
  // Over every precision.
  constexpr T total() const {
    T sum{};
    for (const T& value : values) sum += value;
    return sum;
  }
  friend constexpr bool operator==(const PerPrecision& a, const PerPrecision& b) { return a.values == b.values; }
  friend constexpr bool operator!=(const PerPrecision& a, const PerPrecision& b) { return !(a == b); }
};

}  // namespace sp
