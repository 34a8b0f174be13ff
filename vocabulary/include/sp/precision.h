// The precisions a block's weights can cross the link in, as every C++ layer names them, with
// the one name function and the one per-precision container. Two wire formats keep their own
// codes and are translated in one place each: the plugin ABI's sp_precision
// (sp/precision_abi.h) and the slab's on-disk SlabPrecision (adapters' route_encoding.cpp).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace sp {

// From the most to the least precise: BF16 (copied as is), INT8 (codes and fp32 scales, about
// 0.5x the bytes) and NF4 (packed 4-bit codes and bf16 scales, about 0.27x at group size 64).
enum class Precision : std::uint8_t { bf16, int8, nf4 };

inline constexpr std::size_t kPrecisionCount = 3;
inline constexpr std::array<Precision, kPrecisionCount> kPrecisions = {Precision::bf16, Precision::int8,
                                                                       Precision::nf4};

// "bf16", "int8", "nf4": the names of configs, reports, JSON and Python.
constexpr const char* precision_name(Precision precision) noexcept {
  switch (precision) {
    case Precision::bf16:
      return "bf16";
    case Precision::int8:
      return "int8";
    case Precision::nf4:
      return "nf4";
  }
  return "unknown";
}

// The precision precision_name() gives `name`; nullopt for any other text.
constexpr std::optional<Precision> precision_named(std::string_view name) noexcept {
  for (Precision precision : kPrecisions) {
    if (name == precision_name(precision)) return precision;
  }
  return std::nullopt;
}

// True for the routes that are staged and dequantized on the device.
constexpr bool is_quantized(Precision precision) noexcept { return precision != Precision::bf16; }

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
