#include "sp/kernels/cuda/bf16.h"

#include "common.cuh"

namespace sp::kernels::cuda {
namespace {

__device__ __forceinline__ uint16_t round_one(float x, Rounding rounding, uint64_t seed, uint64_t index) {
  return rounding == Rounding::kStochastic
             ? kernels::detail::bf16_round_stochastic(x, kernels::detail::random_bits(seed, index))
             : kernels::detail::bf16_round_nearest_even(x);
}

// 8 elements per thread per step: two 16-byte loads, one 16-byte store.
__global__ void fp32_to_bf16_vector_kernel(const float *src, uint16_t *dst, uint64_t n, Rounding rounding,
                                           uint64_t seed) {
  const uint64_t vectors = n / 8;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t v = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < vectors; v += stride) {
    const float4 a = __ldg(reinterpret_cast<const float4 *>(src) + 2 * v);
    const float4 b = __ldg(reinterpret_cast<const float4 *>(src) + 2 * v + 1);
    const float x[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    uint32_t packed[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      packed[k] = static_cast<uint32_t>(round_one(x[2 * k], rounding, seed, 8 * v + 2 * k)) |
                  (static_cast<uint32_t>(round_one(x[2 * k + 1], rounding, seed, 8 * v + 2 * k + 1)) << 16);
    }
    reinterpret_cast<uint4 *>(dst)[v] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  }
  // The last n % 8 elements.
  const uint64_t tail = vectors * 8 + static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (tail < n) dst[tail] = round_one(src[tail], rounding, seed, tail);
}

__global__ void fp32_to_bf16_scalar_kernel(const float *src, uint16_t *dst, uint64_t n, Rounding rounding,
                                           uint64_t seed) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    dst[i] = round_one(src[i], rounding, seed, i);
  }
}

__global__ void bf16_to_fp32_kernel(const uint16_t *src, float *dst, uint64_t n) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    dst[i] = kernels::detail::bf16_bits_to_float(src[i]);
  }
}

}  // namespace

void fp32_to_bf16(const float *src, uint16_t *dst, std::size_t n, const Bf16Options &options, cudaStream_t stream) {
  detail::require(n == 0 || (src != nullptr && dst != nullptr),
                  "cuda::fp32_to_bf16: null pointer with n = " + std::to_string(n));
  if (n == 0) return;
  constexpr unsigned kThreads = 256;
  if (detail::aligned16(src) && detail::aligned16(dst)) {
    fp32_to_bf16_vector_kernel<<<detail::grid_for(n / 8 + 1, kThreads), kThreads, 0, stream>>>(
        src, dst, n, options.rounding, options.seed);
  } else {
    fp32_to_bf16_scalar_kernel<<<detail::grid_for(n, kThreads * 4), kThreads, 0, stream>>>(
        src, dst, n, options.rounding, options.seed);
  }
  check_launch("cuda::fp32_to_bf16");
}

void bf16_to_fp32(const uint16_t *src, float *dst, std::size_t n, cudaStream_t stream) {
  detail::require(n == 0 || (src != nullptr && dst != nullptr),
                  "cuda::bf16_to_fp32: null pointer with n = " + std::to_string(n));
  if (n == 0) return;
  bf16_to_fp32_kernel<<<detail::grid_for(n, 256 * 4), 256, 0, stream>>>(src, dst, n);
  check_launch("cuda::bf16_to_fp32");
}

}  // namespace sp::kernels::cuda
