#include "sp/kernels/cuda/quantize.h"

#include "quantize_kernels.cuh"

namespace sp::kernels::cuda {

void quantize_int8(const void *src, DType src_dtype, std::size_t rows, std::size_t cols, const QuantizeOptions &options,
                   int8_t *codes, float *scales, cudaStream_t stream) {
  detail::launch_quantize<detail::CodeFormat::kInt8>(
      src, src_dtype, rows, cols, options, reinterpret_cast<uint8_t *>(codes), scales, stream, "cuda::quantize_int8");
}

void dequantize_int8_to_bf16(const int8_t *codes, const float *scales, std::size_t rows, std::size_t cols,
                             uint32_t group_size, uint16_t *dst, cudaStream_t stream) {
  detail::launch_dequantize<detail::CodeFormat::kInt8>(reinterpret_cast<const uint8_t *>(codes), scales, rows, cols,
                                                       group_size, dst, stream, "cuda::dequantize_int8_to_bf16");
}

void dequantize_int8_to_fp32(const int8_t *codes, const float *scales, std::size_t rows, std::size_t cols,
                             uint32_t group_size, float *dst, cudaStream_t stream) {
  detail::launch_dequantize<detail::CodeFormat::kInt8>(reinterpret_cast<const uint8_t *>(codes), scales, rows, cols,
                                                       group_size, dst, stream, "cuda::dequantize_int8_to_fp32");
}

}  // namespace sp::kernels::cuda
