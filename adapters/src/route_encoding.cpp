#include "sp/adapters/route_encoding.h"

namespace sp::adapters {
namespace {

constexpr bool slab_codes_are_the_kernels() {
  for (const RouteTraits &route : kRouteTraits) {
    const auto code = static_cast<sp::kernels::SlabPrecision>(route.slab_code);
    if (code != sp::kernels::SlabPrecision::kBf16 && code != sp::kernels::SlabPrecision::kInt8 &&
        code != sp::kernels::SlabPrecision::kNf4) {
      return false;
    }
    if ((code == sp::kernels::SlabPrecision::kBf16) == is_quantized(route.precision)) return false;
  }
  return true;
}
static_assert(slab_codes_are_the_kernels(),
              "every route's slab_code (sp/precision.h) must be a SlabPrecision, kBf16 exactly for the unquantized");

}  // namespace

sp::kernels::SlabEncoding slab_encoding(Precision precision, std::uint32_t group_size) {
  sp::kernels::SlabEncoding encoding;
  encoding.precision = static_cast<sp::kernels::SlabPrecision>(route_traits(precision).slab_code);
  encoding.group_size = is_quantized(precision) ? group_size : 0;  // BF16 has no group size
  return encoding;
}

}  // namespace sp::adapters
