// NF4 quantize and dequantize on the GPU. The arithmetic is scalar_math.h's (nf4_absmax,
// nf4_inverse_absmax, nf4_code, nf4_level, nf4_nibble), shared verbatim with the CPU code; this
// file only arranges the threads.
#include "sp/kernels/cuda/nf4.h"

#include <cuda_runtime.h>

#include "common.cuh"
#include "quantize_arguments.h"

namespace sp::kernels::cuda {
namespace detail {
namespace {

namespace math = kernels::detail;

struct Nf4Layout {
  uint64_t rows;
  uint64_t cols;
  uint64_t groups_per_row;
  uint32_t group_size;
};

Nf4Layout make_layout(uint64_t rows, uint64_t cols, uint32_t group_size) {
  return Nf4Layout{rows, cols, (cols + group_size - 1) / group_size, group_size};
}

// One warp per group: absmax by warp shuffle, lane 0 writes it (NaN for a poisoned group).
__global__ void nf4_scales_kernel(const void *src, uint32_t dtype, Nf4Layout layout, float *scales) {
  const uint64_t warps = static_cast<uint64_t>(gridDim.x) * (blockDim.x / 32);
  const uint64_t first_warp = (static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const unsigned lane = threadIdx.x % 32;
  const uint64_t segments = layout.rows * layout.groups_per_row;
  for (uint64_t segment = first_warp; segment < segments; segment += warps) {
    const uint64_t row = segment / layout.groups_per_row;
    const uint64_t column = (segment - row * layout.groups_per_row) * layout.group_size;
    const uint64_t first = row * layout.cols + column;
    const uint64_t remaining = layout.cols - column;
    const uint64_t n = remaining < layout.group_size ? remaining : layout.group_size;
    uint32_t abs_bits = 0;
    for (uint64_t i = lane; i < n; i += 32) {
      const uint32_t bits = math::float_bits(load_element(src, dtype, first + i)) & math::kAbsMask;
      abs_bits = bits > abs_bits ? bits : abs_bits;
    }
    abs_bits = warp_max(abs_bits);
    if (lane == 0) scales[segment] = math::nf4_absmax(abs_bits);
  }
}

template <typename Index>
__device__ __forceinline__ uint32_t code_of_element(const void *src, uint32_t dtype, const float *scales, Index e,
                                                    Index cols, Index groups_per_row, Index group_size) {
  const Index row = e / cols;
  const Index col = e - row * cols;
  const float absmax = scales[row * groups_per_row + col / group_size];
  if (isnan(absmax)) return math::kNf4ZeroCode;  // poisoned group
  return math::nf4_code(load_element(src, dtype, e), math::nf4_inverse_absmax(absmax));
}

// One thread per code byte: elements 2b (high nibble) and 2b + 1 (low), each with the absmax of
// its own group (the two may sit in different rows when cols is odd). Runs after
// nf4_scales_kernel on the stream.
template <typename Index>
__global__ void nf4_codes_kernel(const void *src, uint32_t dtype, Nf4Layout layout, const float *scales,
                                 uint8_t *codes) {
  const Index n = static_cast<Index>(layout.rows * layout.cols);
  const Index bytes = n / 2 + n % 2;
  const Index cols = static_cast<Index>(layout.cols);
  const Index groups = static_cast<Index>(layout.groups_per_row);
  const Index group_size = static_cast<Index>(layout.group_size);
  const Index stride = static_cast<Index>(gridDim.x) * blockDim.x;
  for (Index b = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; b < bytes; b += stride) {
    const Index e = 2 * b;
    uint32_t byte = code_of_element<Index>(src, dtype, scales, e, cols, groups, group_size) << 4;
    if (e + 1 < n) byte |= code_of_element<Index>(src, dtype, scales, e + 1, cols, groups, group_size);
    codes[b] = static_cast<uint8_t>(byte);
  }
}

__device__ __forceinline__ void store(float x, float *dst) { *dst = x; }
__device__ __forceinline__ void store(float x, uint16_t *dst) { *dst = math::bf16_round_nearest_even(x); }

__device__ __forceinline__ void load_levels(float *levels) {
  if (threadIdx.x < 16) levels[threadIdx.x] = math::nf4_level(threadIdx.x);
  __syncthreads();
}

// Any layout, one element per thread per step.
template <typename Out, typename Scale, typename Index>
__global__ void nf4_dequantize_scalar_kernel(const uint8_t *codes, const Scale *scales, Nf4Layout layout, Out *dst) {
  __shared__ float levels[16];
  load_levels(levels);
  const Index n = static_cast<Index>(layout.rows * layout.cols);
  const Index cols = static_cast<Index>(layout.cols);
  const Index groups = static_cast<Index>(layout.groups_per_row);
  const Index group_size = static_cast<Index>(layout.group_size);
  const Index stride = static_cast<Index>(gridDim.x) * blockDim.x;
  for (Index e = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += stride) {
    const Index row = e / cols;
    const Index col = e - row * cols;
    const float scale = math::nf4_scale_value(__ldg(&scales[row * groups + col / group_size]));
    const uint32_t code = math::nf4_nibble(__ldg(&codes[e / 2]), e);
    store(levels[code] * scale, dst + e);
  }
}

// cols % 8 == 0, codes 4-byte and dst 16-byte aligned: vector v is elements [8 v, 8 v + 8),
// one 32-bit word of codes, inside one row and one group (every group size is a multiple of 8),
// so one scale serves all 8. Consecutive threads take consecutive words, so a warp's loads
// (128 bytes) and each of its stores (512 bytes of bf16) are contiguous.
template <typename Out, typename Scale, typename Index>
__global__ void nf4_dequantize_vector_kernel(const uint8_t *codes, const Scale *scales, Nf4Layout layout, Out *dst) {
  __shared__ float levels[16];
  load_levels(levels);
  const Index vectors = static_cast<Index>(layout.rows * layout.cols / 8);
  const Index cols = static_cast<Index>(layout.cols);
  const Index groups = static_cast<Index>(layout.groups_per_row);
  const Index group_size = static_cast<Index>(layout.group_size);
  const Index stride = static_cast<Index>(gridDim.x) * blockDim.x;
  for (Index v = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; v < vectors; v += stride) {
    const Index e = v * 8;
    const Index row = e / cols;
    const Index col = e - row * cols;
    const float scale = math::nf4_scale_value(__ldg(&scales[row * groups + col / group_size]));
    const uint32_t word = __ldg(reinterpret_cast<const uint32_t *>(codes) + v);
    // Element k of the 8 sits in byte k / 2 (little-endian), the even one in the high nibble.
    float values[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) values[k] = levels[(word >> (4 * (k ^ 1))) & 15u] * scale;
    if constexpr (sizeof(Out) == 2) {
      uint32_t out[4];
#pragma unroll
      for (int pair = 0; pair < 4; ++pair) {
        out[pair] = math::bf16_round_nearest_even(values[2 * pair]) |
                    (static_cast<uint32_t>(math::bf16_round_nearest_even(values[2 * pair + 1])) << 16);
      }
      *reinterpret_cast<uint4 *>(dst + e) = make_uint4(out[0], out[1], out[2], out[3]);
    } else {
      float4 *target = reinterpret_cast<float4 *>(dst + e);
      target[0] = make_float4(values[0], values[1], values[2], values[3]);
      target[1] = make_float4(values[4], values[5], values[6], values[7]);
    }
  }
}

template <typename Out, typename Scale>
void launch_dequantize(const uint8_t *codes, const Scale *scales, uint64_t rows, uint64_t cols, uint32_t group_size,
                       Out *dst, cudaStream_t stream, const char *function) {
  kernels::detail::check_nf4_dequantize_arguments(codes, scales, rows, cols, group_size, dst, function);
  if (rows == 0 || cols == 0) return;
  const Nf4Layout layout = make_layout(rows, cols, group_size);
  const uint64_t n = rows * cols;
  const uint64_t segments = rows * layout.groups_per_row;
  constexpr unsigned kThreads = 256;
  // 32-bit indices only where the grid-stride loop cannot wrap (grid_stride.h).
  if (cols % 8 == 0 && reinterpret_cast<uintptr_t>(codes) % 4 == 0 && aligned16(dst)) {
    const unsigned grid = grid_for(n / 8, kThreads);
    if (uint32_indices_fit(n, segments, n / 8, grid, kThreads)) {
      nf4_dequantize_vector_kernel<Out, Scale, uint32_t><<<grid, kThreads, 0, stream>>>(codes, scales, layout, dst);
    } else {
      nf4_dequantize_vector_kernel<Out, Scale, uint64_t><<<grid, kThreads, 0, stream>>>(codes, scales, layout, dst);
    }
  } else {
    const unsigned grid = grid_for(n, kThreads * 4);
    if (uint32_indices_fit(n, segments, n, grid, kThreads)) {
      nf4_dequantize_scalar_kernel<Out, Scale, uint32_t><<<grid, kThreads, 0, stream>>>(codes, scales, layout, dst);
    } else {
      nf4_dequantize_scalar_kernel<Out, Scale, uint64_t><<<grid, kThreads, 0, stream>>>(codes, scales, layout, dst);
    }
  }
  check_launch(function);
}

}  // namespace
}  // namespace detail

void quantize_nf4(const void *src, DType src_dtype, std::size_t rows, std::size_t cols, uint32_t group_size,
                  uint8_t *codes, float *scales, cudaStream_t stream) {
  const char *function = "cuda::quantize_nf4";
  kernels::detail::check_nf4_quantize_arguments(src, src_dtype, rows, cols, group_size, codes, scales, function);
  if (rows == 0 || cols == 0) return;
  const detail::Nf4Layout layout = detail::make_layout(rows, cols, group_size);
  constexpr unsigned kThreads = 256;
  const uint64_t segments = rows * layout.groups_per_row;
  const auto dtype = static_cast<uint32_t>(src_dtype);
  detail::nf4_scales_kernel<<<detail::grid_for(segments, kThreads / 32), kThreads, 0, stream>>>(src, dtype, layout,
                                                                                                scales);
  check_launch(function);
  const uint64_t n = static_cast<uint64_t>(rows) * cols;
  const uint64_t bytes = n / 2 + n % 2;
  const unsigned grid = detail::grid_for(bytes, kThreads * 4);
  // Element indices reach n (2b + 1 for the last byte), the loop's index bytes - 1 + stride.
  if (n < (1ull << 32) - 1 && detail::uint32_indices_fit(n, segments, bytes, grid, kThreads)) {
    detail::nf4_codes_kernel<uint32_t><<<grid, kThreads, 0, stream>>>(src, dtype, layout, scales, codes);
  } else {
    detail::nf4_codes_kernel<uint64_t><<<grid, kThreads, 0, stream>>>(src, dtype, layout, scales, codes);
  }
  check_launch(function);
}

void dequantize_nf4_to_bf16(const uint8_t *codes, const uint16_t *scales, std::size_t rows, std::size_t cols,
                            uint32_t group_size, uint16_t *dst, cudaStream_t stream) {
  detail::launch_dequantize(codes, scales, rows, cols, group_size, dst, stream, "cuda::dequantize_nf4_to_bf16");
}

void dequantize_nf4_to_bf16(const uint8_t *codes, const float *scales, std::size_t rows, std::size_t cols,
                            uint32_t group_size, uint16_t *dst, cudaStream_t stream) {
  detail::launch_dequantize(codes, scales, rows, cols, group_size, dst, stream, "cuda::dequantize_nf4_to_bf16");
}

void dequantize_nf4_to_fp32(const uint8_t *codes, const uint16_t *scales, std::size_t rows, std::size_t cols,
                            uint32_t group_size, float *dst, cudaStream_t stream) {
  detail::launch_dequantize(codes, scales, rows, cols, group_size, dst, stream, "cuda::dequantize_nf4_to_fp32");
}

void dequantize_nf4_to_fp32(const uint8_t *codes, const float *scales, std::size_t rows, std::size_t cols,
                            uint32_t group_size, float *dst, cudaStream_t stream) {
  detail::launch_dequantize(codes, scales, rows, cols, group_size, dst, stream, "cuda::dequantize_nf4_to_fp32");
}

}  // namespace sp::kernels::cuda
