// The one translation between sp::Precision and the plugin ABI's sp_precision, the wire format
// of hints and calibration errors. Nothing else converts between the two.
#pragma once

#include <optional>

#include "sp/plugin_abi_v1.h"
#include "sp/precision.h"

namespace sp {

constexpr sp_precision to_abi(Precision precision) noexcept {
  switch (precision) {
    case Precision::int8:
      return SP_PRECISION_INT8;
    case Precision::nf4:
      return SP_PRECISION_NF4;
    case Precision::bf16:
      break;
  }
  return SP_PRECISION_BF16;
}

// nullopt for a value the ABI does not define (a plugin's hint is checked with this).
constexpr std::optional<Precision> from_abi(sp_precision precision) noexcept {
  switch (precision) {
    case SP_PRECISION_BF16:
      return Precision::bf16;
    case SP_PRECISION_INT8:
      return Precision::int8;
    case SP_PRECISION_NF4:
      return Precision::nf4;
  }
  return std::nullopt;
}

}  // namespace sp
