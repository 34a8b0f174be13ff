// CUDA twins of sp/kernels/quantize.h. Same layout and the same arithmetic, so codes, scales
// and dequantized values are bit-identical to the CPU versions.
//
// All pointers are device pointers. Every call only enqueues work on `stream`: no host sync,
// no allocation. Throws std::invalid_argument for bad arguments (checked on the host) and
// std::runtime_error naming the CUDA error when a launch fails.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "sp/kernels/quantize.h"

namespace sp::kernels::cuda {

void quantize_int8(const void *src, DType src_dtype, std::size_t rows, std::size_t cols, const QuantizeOptions &options,
                   int8_t *codes, float *scales, cudaStream_t stream);

// The step after every INT8 transfer: reads 1 byte + 1/G scale per element, writes 2 bytes.
void dequantize_int8_to_bf16(const int8_t *codes, const float *scales, std::size_t rows, std::size_t cols,
                             uint32_t group_size, uint16_t *dst, cudaStream_t stream);

void dequantize_int8_to_fp32(const int8_t *codes, const float *scales, std::size_t rows, std::size_t cols,
                             uint32_t group_size, float *dst, cudaStream_t stream);

}  // namespace sp::kernels::cuda
