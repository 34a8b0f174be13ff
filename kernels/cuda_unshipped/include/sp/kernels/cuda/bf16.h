// CUDA twin of sp/kernels/bf16.h. Device pointers, asynchronous on `stream`; errors as in
// sp/kernels/cuda/quantize.h. Bit-identical to the CPU version for both rounding modes.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "sp/kernels/bf16.h"

namespace sp::kernels::cuda {

void fp32_to_bf16(const float *src, uint16_t *dst, std::size_t n, const Bf16Options &options, cudaStream_t stream);

void bf16_to_fp32(const uint16_t *src, float *dst, std::size_t n, cudaStream_t stream);

}  // namespace sp::kernels::cuda
