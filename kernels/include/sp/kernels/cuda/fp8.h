// CUDA twins of sp/kernels/fp8.h, built on cuda_fp8.h's __nv_fp8_e4m3 conversions.
// Device pointers, asynchronous on `stream`; errors as in sp/kernels/cuda/quantize.h.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "sp/kernels/fp8.h"

namespace sp::kernels::cuda {

// Raw conversions, element by element: dst[i] = e4m3(src[i]) with __NV_SATFINITE, and back.
// They exist so the CPU software twin can be checked against the hardware conversion.
void fp8_e4m3_encode(const float *src, uint8_t *dst, std::size_t n, cudaStream_t stream);
void fp8_e4m3_decode(const uint8_t *src, float *dst, std::size_t n, cudaStream_t stream);

void quantize_fp8_e4m3(const void *src, DType src_dtype, std::size_t rows, std::size_t cols, uint32_t group_size,
                       uint8_t *codes, float *scales, cudaStream_t stream);

void dequantize_fp8_e4m3_to_bf16(const uint8_t *codes, const float *scales, std::size_t rows, std::size_t cols,
                                 uint32_t group_size, uint16_t *dst, cudaStream_t stream);

void dequantize_fp8_e4m3_to_fp32(const uint8_t *codes, const float *scales, std::size_t rows, std::size_t cols,
                                 uint32_t group_size, float *dst, cudaStream_t stream);

}  // namespace sp::kernels::cuda
