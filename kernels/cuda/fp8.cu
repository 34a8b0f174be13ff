#include "sp/kernels/cuda/fp8.h"

#include "quantize_kernels.cuh"

namespace sp::kernels::cuda {
namespace {

__global__ void encode_kernel(const float *src, uint8_t *dst, uint64_t n) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    dst[i] = detail::encode_fp8(src[i]);
  }
}

__global__ void decode_kernel(const uint8_t *src, float *dst, uint64_t n) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    dst[i] = detail::decode_fp8(src[i]);
  }
}

}  // namespace

void fp8_e4m3_encode(const float *src, uint8_t *dst, std::size_t n, cudaStream_t stream) {
  detail::require(n == 0 || (src != nullptr && dst != nullptr), "cuda::fp8_e4m3_encode: null pointer");
  if (n == 0) return;
  encode_kernel<<<detail::grid_for(n, 256 * 8), 256, 0, stream>>>(src, dst, n);
  check_launch("cuda::fp8_e4m3_encode");
}

void fp8_e4m3_decode(const uint8_t *src, float *dst, std::size_t n, cudaStream_t stream) {
  detail::require(n == 0 || (src != nullptr && dst != nullptr), "cuda::fp8_e4m3_decode: null pointer");
  if (n == 0) return;
  decode_kernel<<<detail::grid_for(n, 256 * 8), 256, 0, stream>>>(src, dst, n);
  check_launch("cuda::fp8_e4m3_decode");
}

void quantize_fp8_e4m3(const void *src, DType src_dtype, std::size_t rows, std::size_t cols, uint32_t group_size,
                       uint8_t *codes, float *scales, cudaStream_t stream) {
  QuantizeOptions options;
  options.group_size = group_size;
  detail::launch_quantize<detail::CodeFormat::kFp8E4M3>(src, src_dtype, rows, cols, options, codes, scales, stream,
                                                        "cuda::quantize_fp8_e4m3");
}

void dequantize_fp8_e4m3_to_bf16(const uint8_t *codes, const float *scales, std::size_t rows, std::size_t cols,
                                 uint32_t group_size, uint16_t *dst, cudaStream_t stream) {
  detail::launch_dequantize<detail::CodeFormat::kFp8E4M3>(codes, scales, rows, cols, group_size, dst, stream,
                                                          "cuda::dequantize_fp8_e4m3_to_bf16");
}

void dequantize_fp8_e4m3_to_fp32(const uint8_t *codes, const float *scales, std::size_t rows, std::size_t cols,
                                 uint32_t group_size, float *dst, cudaStream_t stream) {
  detail::launch_dequantize<detail::CodeFormat::kFp8E4M3>(codes, scales, rows, cols, group_size, dst, stream,
                                                          "cuda::dequantize_fp8_e4m3_to_fp32");
}

}  // namespace sp::kernels::cuda
