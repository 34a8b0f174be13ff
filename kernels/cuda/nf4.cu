// NF4 quantize and dequantize on the GPU. The arithmetic is scalar_math.h's (nf4_scale_bits,
// nf4_code, nf4_level), shared verbatim with the CPU code; this file only arranges the threads.
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

// One warp per group: absmax by warp shuffle, lane 0 writes the bf16 scale.
__global__ void nf4_scales_kernel(const void *src, uint32_t dtype, Nf4Layout layout, uint16_t *scales) {
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
    if (lane == 0) scales[segment] = math::nf4_scale_bits(abs_bits);
  }
}

template <typename Index>
__device__ __forceinline__ uint32_t code_of_element(const void *src, uint32_t dtype, const uint16_t *scales, Index e,
                                                    Index cols, Index groups_per_row, Index group_size) {
  const Index row = e / cols;
  const Index col = e - row * cols;
  const uint16_t scale_bits = scales[row * groups_per_row + col / group_size];
  if (scale_bits == math::kBf16CanonicalNaN) return math::kNf4ZeroCode;  // poisoned group
  return math::nf4_code(load_element(src, dtype, e), math::bf16_bits_to_float(scale_bits));
}

// One thread per code byte: elements 2b and 2b + 1, each with the scale of its own group (the
// two may sit in different rows when cols is odd). Runs after nf4_scales_kernel on the stream.
template <typename Index>
__global__ void nf4_codes_kernel(const void *src, uint32_t dtype, Nf4Layout layout, const uint16_t *scales,
                                 uint8_t *codes) {
  const Index n = static_cast<Index>(layout.rows * layout.cols);
  const Index bytes = n / 2 + n % 2;
  const Index cols = static_cast<Index>(layout.cols);
  const Index groups = static_cast<Index>(layout.groups_per_row);
  const Index group_size = static_cast<Index>(layout.group_size);
  const Index stride = static_cast<Index>(gridDim.x) * blockDim.x;
  for (Index b = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; b < bytes; b += stride) {
    const Index e = 2 * b;
    uint32_t byte = code_of_element<Index>(src, dtype, scales, e, cols, groups, group_size);
    if (e + 1 < n) byte |= code_of_element<Index>(src, dtype, scales, e + 1, cols, groups, group_size) << 4;
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
template <typename Out, typename Index>
__global__ void nf4_dequantize_scalar_kernel(const uint8_t *codes, const uint16_t *scales, Nf4Layout layout, Out *dst) {
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
    const float scale = math::bf16_bits_to_float(__ldg(&scales[row * groups + col / group_size]));
    const uint32_t byte = __ldg(&codes[e / 2]);
    const uint32_t code = (e % 2 == 0 ? byte : byte >> 4) & 15u;
    store(levels[code] * scale, dst + e);
  }
}

// cols % 32 == 0, codes and dst 16-byte aligned: vector v is elements [32 v, 32 v + 32), one
// row and one group (every group size is a multiple of 32), so one scale serves all 32.
template <typename Out, typename Index>
__global__ void nf4_dequantize_vector_kernel(const uint8_t *codes, const uint16_t *scales, Nf4Layout layout, Out *dst) {
  __shared__ float levels[16];
  load_levels(levels);
  const Index vectors = static_cast<Index>(layout.rows * layout.cols / 32);
  const Index cols = static_cast<Index>(layout.cols);
  const Index groups = static_cast<Index>(layout.groups_per_row);
  const Index group_size = static_cast<Index>(layout.group_size);
  const Index stride = static_cast<Index>(gridDim.x) * blockDim.x;
  for (Index v = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; v < vectors; v += stride) {
    const Index e = v * 32;
    const Index row = e / cols;
    const Index col = e - row * cols;
    const float scale = math::bf16_bits_to_float(__ldg(&scales[row * groups + col / group_size]));
    const uint4 packed = __ldg(reinterpret_cast<const uint4 *>(codes) + v);
    const uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
    if constexpr (sizeof(Out) == 2) {
      uint4 *target = reinterpret_cast<uint4 *>(dst + e);
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        // One 32-bit word = 8 codes = 8 bf16 = one 16-byte store.
        uint32_t out[4];
#pragma unroll
        for (int pair = 0; pair < 4; ++pair) {
          const uint32_t lo = math::bf16_round_nearest_even(levels[(words[w] >> (8 * pair)) & 15u] * scale);
          const uint32_t hi = math::bf16_round_nearest_even(levels[(words[w] >> (8 * pair + 4)) & 15u] * scale);
          out[pair] = lo | (hi << 16);
        }
        target[w] = make_uint4(out[0], out[1], out[2], out[3]);
      }
    } else {
      float4 *target = reinterpret_cast<float4 *>(dst + e);
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        float out[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) out[k] = levels[(words[w] >> (4 * k)) & 15u] * scale;
        target[2 * w] = make_float4(out[0], out[1], out[2], out[3]);
        target[2 * w + 1] = make_float4(out[4], out[5], out[6], out[7]);
      }
    }
  }
}

template <typename Out>
void launch_dequantize(const uint8_t *codes, const uint16_t *scales, uint64_t rows, uint64_t cols, uint32_t group_size,
                       Out *dst, cudaStream_t stream, const char *function) {
  kernels::detail::check_nf4_dequantize_arguments(codes, scales, rows, cols, group_size, dst, function);
  if (rows == 0 || cols == 0) return;
  const Nf4Layout layout = make_layout(rows, cols, group_size);
  const uint64_t n = rows * cols;
  const uint64_t segments = rows * layout.groups_per_row;
  constexpr unsigned kThreads = 256;
  // 32-bit indices only where the grid-stride loop cannot wrap (grid_stride.h).
  if (cols % 32 == 0 && aligned16(codes) && aligned16(dst)) {
    const unsigned grid = grid_for(n / 32, kThreads);
    if (uint32_indices_fit(n, segments, n / 32, grid, kThreads)) {
      nf4_dequantize_vector_kernel<Out, uint32_t><<<grid, kThreads, 0, stream>>>(codes, scales, layout, dst);
    } else {
      nf4_dequantize_vector_kernel<Out, uint64_t><<<grid, kThreads, 0, stream>>>(codes, scales, layout, dst);
    }
  } else {
    const unsigned grid = grid_for(n, kThreads * 4);
    if (uint32_indices_fit(n, segments, n, grid, kThreads)) {
      nf4_dequantize_scalar_kernel<Out, uint32_t><<<grid, kThreads, 0, stream>>>(codes, scales, layout, dst);
    } else {
      nf4_dequantize_scalar_kernel<Out, uint64_t><<<grid, kThreads, 0, stream>>>(codes, scales, layout, dst);
    }
  }
  check_launch(function);
}

}  // namespace
}  // namespace detail

void quantize_nf4(const void *src, DType src_dtype, std::size_t rows, std::size_t cols, uint32_t group_size,
                  uint8_t *codes, uint16_t *scales, cudaStream_t stream) {
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

void dequantize_nf4_to_fp32(const uint8_t *codes, const uint16_t *scales, std::size_t rows, std::size_t cols,
                            uint32_t group_size, float *dst, cudaStream_t stream) {
  detail::launch_dequantize(codes, scales, rows, cols, group_size, dst, stream, "cuda::dequantize_nf4_to_fp32");
}

}  // namespace sp::kernels::cuda
