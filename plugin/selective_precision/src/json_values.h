// Numbers as the telemetry writes them, shared by telemetry.cpp and the rule modules' fields.
#pragma once

#include "sp/policy/budget.h"

#include <nlohmann/json.hpp>

#include <cmath>

namespace sp::policy {

// JSON has no NaN: a value that was never computed is written as null.
inline nlohmann::ordered_json number_or_null(double value) {
  return std::isfinite(value) ? nlohmann::ordered_json(value) : nlohmann::ordered_json(nullptr);
}

// {"bf16": x, "int8": y, "nf4": z}, null where NaN.
template <typename PerTier>
nlohmann::ordered_json per_tier(const PerTier &values) {
  nlohmann::ordered_json out = nlohmann::ordered_json::object();
  for (sp_precision tier : kTiers) out[precision_name(tier)] = number_or_null(values[tier]);
  return out;
}

}  // namespace sp::policy
