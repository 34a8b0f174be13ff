// Typed views of the 16-bit storage formats, so the vectorized loops are templates over the
// element type with an inlined conversion to float.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "scalar_math.h"
#include "sp/kernels/dtype.h"

namespace sp::kernels::detail {

struct Bf16Bits {
  uint16_t bits;
};
struct Fp16Bits {
  uint16_t bits;
};
static_assert(sizeof(Bf16Bits) == 2 && sizeof(Fp16Bits) == 2, "16-bit storage");

inline float to_float(float x) { return x; }
inline float to_float(Bf16Bits x) { return bf16_bits_to_float(x.bits); }
inline float to_float(Fp16Bits x) { return fp16_bits_to_float(x.bits); }

// The largest |x| bit pattern of n elements (NaN and Inf compare above every finite value),
// vectorized; the absmax pass of the INT8 and NF4 quantizers (defined in quantize.cpp).
uint32_t max_abs_bits(const float *src, std::size_t n);
uint32_t max_abs_bits(const Bf16Bits *src, std::size_t n);

// Calls visit(typed pointer) for fp32, bf16 or fp16 data.
template <typename Visit>
decltype(auto) visit_elements(const void *data, DType dtype, Visit &&visit) {
  switch (dtype) {
    case DType::kFloat32:
      return visit(static_cast<const float *>(data));
    case DType::kBFloat16:
      return visit(static_cast<const Bf16Bits *>(data));
    case DType::kFloat16:
      return visit(static_cast<const Fp16Bits *>(data));
  }
  throw std::invalid_argument("unknown DType value " + std::to_string(static_cast<int>(dtype)));
}

}  // namespace sp::kernels::detail
