#include "sp/adapters/route_encoding.h"

namespace sp::adapters {

sp::kernels::SlabEncoding slab_encoding(Precision precision, std::uint32_t group_size) {
  sp::kernels::SlabEncoding encoding;
  switch (precision) {
    case Precision::bf16:
      encoding.precision = sp::kernels::SlabPrecision::kBf16;
      return encoding;  // no group size
    case Precision::int8:
      encoding.precision = sp::kernels::SlabPrecision::kInt8;
      break;
    case Precision::nf4:
      encoding.precision = sp::kernels::SlabPrecision::kNf4;
      break;
  }
  encoding.group_size = group_size;
  return encoding;
}

}  // namespace sp::adapters
