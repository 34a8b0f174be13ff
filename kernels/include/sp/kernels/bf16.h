// BF16 transfer image: fp32 master weights to bf16 (raw uint16_t bit patterns).
#pragma once

#include <cstddef>
#include <cstdint>

#include "sp/kernels/dtype.h"

namespace sp::kernels {

struct Bf16Options {
  Rounding rounding = Rounding::kNearestEven;
  uint64_t seed = 0;  // used by Rounding::kStochastic only
};

// dst[i] = bf16(src[i]) for i in [0, n). NaN becomes the canonical quiet NaN 0x7FFF
// (what CUDA's __float2bfloat16_rn produces); +-Inf stay +-Inf. Stochastic rounding of a
// finite value may round up to +-Inf only when it lies above the largest finite bf16.
// The element index used for stochastic rounding is i.
void fp32_to_bf16(const float *src, uint16_t *dst, std::size_t n, const Bf16Options &options = {},
                  const CpuExec &exec = {});

// dst[i] = float(src[i]); exact.
void bf16_to_fp32(const uint16_t *src, float *dst, std::size_t n, const CpuExec &exec = {});

}  // namespace sp::kernels
