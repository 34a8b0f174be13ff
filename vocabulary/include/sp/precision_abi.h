// The one translation between sp::Precision and the plugin ABI's sp_precision, the wire format
// of hints and calibration errors, read from the route table (sp/precision.h). Nothing else
// converts between the two.
#pragma once

#include <cstdint>
#include <optional>

#include "sp/plugin_abi_v1.h"
#include "sp/precision.h"

namespace sp {

constexpr sp_precision to_abi(Precision precision) noexcept { return route_traits(precision).abi_code; }

// nullopt for a value the ABI does not define (a plugin's hint is checked with this).
constexpr std::optional<Precision> from_abi(sp_precision precision) noexcept {
  for (const RouteTraits& route : kRouteTraits) {
    if (route.abi_code == precision) return route.precision;
  }
  return std::nullopt;
}

// Every route's bit: the mask of a host or plugin that takes them all.
constexpr sp_precision_mask abi_mask_of_all() noexcept {
  sp_precision_mask mask = 0;
  for (const RouteTraits& route : kRouteTraits) mask |= SP_PRECISION_BIT(route.abi_code);
  return mask;
}

// "SP_PRECISION_BF16 (0), SP_PRECISION_INT8 (1) or SP_PRECISION_NF4 (2)": what a message about
// an sp_precision expects.
// The codes a plugin of ABI 1.`minor` may hint: those of the routes that minor or an earlier
// one added.
constexpr sp_precision_mask abi_mask_since(std::uint32_t minor) noexcept {
  sp_precision_mask mask = 0;
  for (const RouteTraits& route : kRouteTraits) {
    if (route.abi_minor <= minor) mask |= SP_PRECISION_BIT(route.abi_code);
  }
  return mask;
}

inline std::string abi_code_expectation() {
  return list_routes([](const RouteTraits& route) {
    return std::string(route.abi_name) + " (" + std::to_string(static_cast<int>(route.abi_code)) + ")";
  });
}

}  // namespace sp
