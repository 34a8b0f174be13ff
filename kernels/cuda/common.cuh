// Helpers shared by the CUDA kernels: argument checks, element loads and warp/block reductions.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "grid_stride.h"
#include "scalar_math.h"
#include "sp/kernels/cuda/check.h"
#include "sp/kernels/dtype.h"

namespace sp::kernels::cuda::detail {

// Launch checks: sp::kernels::cuda::check_launch (sp/kernels/cuda/check.h).

inline void require(bool condition, const std::string &message) {
  if (!condition) throw std::invalid_argument(message);
}

using kernels::detail::grid_for;
using kernels::detail::uint32_indices_fit;

inline bool aligned16(const void *p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

__device__ __forceinline__ float load_element(const void *data, uint32_t dtype, uint64_t i) {
  if (dtype == static_cast<uint32_t>(DType::kFloat32)) return static_cast<const float *>(data)[i];
  const uint16_t bits = static_cast<const uint16_t *>(data)[i];
  return dtype == static_cast<uint32_t>(DType::kBFloat16) ? kernels::detail::bf16_bits_to_float(bits)
                                                          : kernels::detail::fp16_bits_to_float(bits);
}

template <typename T>
__device__ __forceinline__ T warp_sum(T value) {
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xFFFFFFFFu, value, offset);
  return value;
}

template <typename T>
__device__ __forceinline__ T warp_max(T value) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const T other = __shfl_xor_sync(0xFFFFFFFFu, value, offset);
    value = other > value ? other : value;
  }
  return value;
}

}  // namespace sp::kernels::cuda::detail
