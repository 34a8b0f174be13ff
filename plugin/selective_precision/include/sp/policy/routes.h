// The plugin's one mapping between a block's Assignment, the sp_precision it travels at and the
// order of the routes by bytes. It goes through sp/precision_abi.h, so a route added there is
// added here without a list to extend.
#pragma once

#include "sp/policy/state.h"

#include <sp/precision.h>
#include <sp/precision_abi.h>

#include <cstddef>
#include <string>

namespace sp::policy {

// Assignment k > 0 is sp::kPrecisions[k - 1]; an unassigned block travels as BF16.
inline sp_precision travels_as(Assignment assignment) {
  if (assignment == Assignment::unassigned) return SP_PRECISION_BF16;
  return to_abi(kPrecisions[static_cast<std::size_t>(assignment) - 1]);
}

// A precision the ABI does not define is BF16's assignment: the validated inputs never carry one.
inline Assignment assignment_for(sp_precision precision) {
  const std::optional<Precision> route = from_abi(precision);
  return static_cast<Assignment>(1 + static_cast<int>(route ? *route : Precision::bf16));
}

// The routes from the fewest bytes (0) up: a lower rank is a move down. sp::Precision lists them
// from the most precise, which is the most bytes.
inline int cost_rank(sp_precision precision) {
  const std::optional<Precision> route = from_abi(precision);
  return static_cast<int>(kPrecisionCount) - 1 - static_cast<int>(route ? *route : Precision::bf16);
}

// "bf16 = 0, int8 = 1, nf4 = 2": the codes a message about an unknown precision lists; with
// `quantized_only`, "int8 (1) or nf4 (2)".
inline std::string route_codes_text(bool quantized_only = false) {
  if (quantized_only) {
    return list_routes(
        [](const RouteTraits &r) { return std::string(r.name) + " (" + std::to_string(r.abi_code) + ")"; }, true);
  }
  std::string text;
  for (const RouteTraits &r : kRouteTraits) {
    text += (text.empty() ? "" : ", ") + std::string(r.name) + " = " + std::to_string(r.abi_code);
  }
  return text;
}

}  // namespace sp::policy
