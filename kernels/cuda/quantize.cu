// INT8 quantize and dequantize on the GPU. One warp per row or group for quantization;
// dequantization, the step after every transfer, moves 16 codes per thread with 16-byte loads
// and stores when the layout allows.
#include "sp/kernels/cuda/quantize.h"

#include "common.cuh"
#include "quantize_arguments.h"

namespace sp::kernels::cuda {
namespace detail {
namespace {

struct Layout {
  uint64_t rows;
  uint64_t cols;
  uint64_t groups_per_row;
  uint64_t width;  // elements per group (cols for per row)
};

inline Layout make_layout(uint64_t rows, uint64_t cols, uint32_t group_size) {
  return Layout{rows, cols, group_size == 0 ? 1 : (cols + group_size - 1) / group_size,
                group_size == 0 ? cols : group_size};
}

__global__ void quantize_kernel(const void *src, uint32_t dtype, Layout layout, Rounding rounding, uint64_t seed,
                                uint8_t *codes, float *scales) {
  const uint64_t warps = static_cast<uint64_t>(gridDim.x) * (blockDim.x / 32);
  const uint64_t first_warp = (static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const unsigned lane = threadIdx.x % 32;
  constexpr float kMaxCode = 127.0f;
  const uint64_t segments = layout.rows * layout.groups_per_row;
  for (uint64_t segment = first_warp; segment < segments; segment += warps) {
    const uint64_t row = segment / layout.groups_per_row;
    const uint64_t group = segment - row * layout.groups_per_row;
    const uint64_t first = row * layout.cols + group * layout.width;
    const uint64_t remaining = layout.cols - group * layout.width;
    const uint64_t n = remaining < layout.width ? remaining : layout.width;
    uint32_t abs_bits = 0;
    for (uint64_t i = lane; i < n; i += 32) {
      const uint32_t bits =
          kernels::detail::float_bits(load_element(src, dtype, first + i)) & kernels::detail::kAbsMask;
      abs_bits = bits > abs_bits ? bits : abs_bits;
    }
    abs_bits = warp_max(abs_bits);
    const float scale = kernels::detail::quant_scale(abs_bits, kMaxCode);
    if (lane == 0) scales[segment] = scale;
    const bool poisoned = abs_bits >= kernels::detail::kInfBits;
    const float inv = kernels::detail::reciprocal(scale);
    for (uint64_t i = lane; i < n; i += 32) {
      const uint64_t index = first + i;
      uint8_t code = 0;
      if (!poisoned) {
        const float x = load_element(src, dtype, index);
        if (rounding == Rounding::kStochastic) {
          code = static_cast<uint8_t>(
              kernels::detail::int8_code_stochastic(x, inv, kernels::detail::random_bits(seed, index)));
        } else {
          code = static_cast<uint8_t>(kernels::detail::int8_code_nearest_even(x, inv));
        }
      }
      codes[index] = code;
    }
  }
}

__device__ __forceinline__ float decode(uint8_t code) { return static_cast<float>(static_cast<int8_t>(code)); }

__device__ __forceinline__ void store(float x, float *dst) { *dst = x; }
__device__ __forceinline__ void store(float x, uint16_t *dst) { *dst = kernels::detail::bf16_round_nearest_even(x); }

template <typename Index>
__device__ __forceinline__ float scale_of(const float *scales, Index i, Index cols, Index groups_per_row, Index width) {
  const Index row = i / cols;
  const Index col = i - row * cols;
  return __ldg(&scales[row * groups_per_row + col / width]);
}

// Any layout, one element per thread per step.
template <typename Out, typename Index>
__global__ void dequantize_scalar_kernel(const uint8_t *codes, const float *scales, Layout layout, Out *dst) {
  const Index n = static_cast<Index>(layout.rows * layout.cols);
  const Index stride = static_cast<Index>(gridDim.x) * blockDim.x;
  for (Index i = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float scale = scale_of<Index>(scales, i, static_cast<Index>(layout.cols),
                                        static_cast<Index>(layout.groups_per_row), static_cast<Index>(layout.width));
    store(decode(codes[i]) * scale, dst + i);
  }
}

// cols % 16 == 0, 16-byte aligned buffers and group width a multiple of 16: the 16 codes at
// vector v share one row and one group, so one scale serves them all.
template <typename Out, typename Index>
__device__ __forceinline__ void dequantize_vector(const uint8_t *codes, const float *scales, const Layout &layout,
                                                  Out *dst, Index v) {
  const Index i = v * 16;
  const float scale = scale_of<Index>(scales, i, static_cast<Index>(layout.cols),
                                      static_cast<Index>(layout.groups_per_row), static_cast<Index>(layout.width));
  const uint4 packed = __ldg(reinterpret_cast<const uint4 *>(codes) + v);
  const uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
  if constexpr (sizeof(Out) == 2) {
    uint32_t out[8];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      for (int pair = 0; pair < 2; ++pair) {
        const uint8_t lo = static_cast<uint8_t>(words[w] >> (16 * pair));
        const uint8_t hi = static_cast<uint8_t>(words[w] >> (16 * pair + 8));
        const uint32_t a = kernels::detail::bf16_round_nearest_even(decode(lo) * scale);
        const uint32_t b = kernels::detail::bf16_round_nearest_even(decode(hi) * scale);
        out[w * 2 + pair] = a | (b << 16);
      }
    }
    uint4 *target = reinterpret_cast<uint4 *>(dst + i);
    target[0] = make_uint4(out[0], out[1], out[2], out[3]);
    target[1] = make_uint4(out[4], out[5], out[6], out[7]);
  } else {
    float out[16];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      for (int b = 0; b < 4; ++b) out[w * 4 + b] = decode(static_cast<uint8_t>(words[w] >> (8 * b))) * scale;
    }
    float4 *target = reinterpret_cast<float4 *>(dst + i);
#pragma unroll
    for (int q = 0; q < 4; ++q) target[q] = make_float4(out[q * 4], out[q * 4 + 1], out[q * 4 + 2], out[q * 4 + 3]);
  }
}

// The fast path: 16 codes per thread per step, 16-byte loads and stores.
template <typename Out, typename Index>
__global__ void dequantize_vector_kernel(const uint8_t *codes, const float *scales, Layout layout, Out *dst) {
  const Index vectors = static_cast<Index>(layout.rows * layout.cols / 16);
  const Index stride = static_cast<Index>(gridDim.x) * blockDim.x;
  for (Index v = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; v < vectors; v += stride) {
    dequantize_vector<Out, Index>(codes, scales, layout, dst, v);
  }
}

__global__ void fill_kernel(float *dst, uint64_t n, float value) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) dst[i] = value;
}

template <typename Out>
void launch_dequantize(const uint8_t *codes, const float *scales, uint64_t rows, uint64_t cols, uint32_t group_size,
                       Out *dst, cudaStream_t stream, const char *function) {
  kernels::detail::check_dequantize_arguments(codes, scales, rows, cols, group_size, dst, function);
  if (rows == 0 || cols == 0) return;
  const Layout layout = make_layout(rows, cols, group_size);
  const uint64_t n = rows * cols;
  const uint64_t segments = rows * layout.groups_per_row;
  constexpr unsigned kThreads = 256;
  // 32-bit indices only where the grid-stride loop cannot wrap (grid_stride.h).
  if (cols % 16 == 0 && layout.width % 16 == 0 && aligned16(codes) && aligned16(dst)) {
    const unsigned grid = grid_for(n / 16, kThreads);
    if (uint32_indices_fit(n, segments, n / 16, grid, kThreads)) {
      dequantize_vector_kernel<Out, uint32_t><<<grid, kThreads, 0, stream>>>(codes, scales, layout, dst);
    } else {
      dequantize_vector_kernel<Out, uint64_t><<<grid, kThreads, 0, stream>>>(codes, scales, layout, dst);
    }
  } else {
    const unsigned grid = grid_for(n, kThreads * 4);
    if (uint32_indices_fit(n, segments, n, grid, kThreads)) {
      dequantize_scalar_kernel<Out, uint32_t><<<grid, kThreads, 0, stream>>>(codes, scales, layout, dst);
    } else {
      dequantize_scalar_kernel<Out, uint64_t><<<grid, kThreads, 0, stream>>>(codes, scales, layout, dst);
    }
  }
  check_launch(function);
}

}  // namespace
}  // namespace detail

void quantize_int8(const void *src, DType src_dtype, std::size_t rows, std::size_t cols, const QuantizeOptions &options,
                   int8_t *codes, float *scales, cudaStream_t stream) {
  const char *function = "cuda::quantize_int8";
  kernels::detail::check_quantize_arguments(src, src_dtype, rows, cols, options, codes, scales, function);
  if (kernels::detail::has_empty_rows(rows, cols, options.group_size)) {
    detail::fill_kernel<<<detail::grid_for(rows, 256), 256, 0, stream>>>(scales, rows, 1.0f);  // all-zero rows
    check_launch(function);
    return;
  }
  if (rows == 0 || cols == 0) return;
  const detail::Layout layout = detail::make_layout(rows, cols, options.group_size);
  constexpr unsigned kThreads = 256;
  const uint64_t segments = rows * layout.groups_per_row;
  detail::quantize_kernel<<<detail::grid_for(segments, kThreads / 32), kThreads, 0, stream>>>(
      src, static_cast<uint32_t>(src_dtype), layout, options.rounding, options.seed, reinterpret_cast<uint8_t *>(codes),
      scales);
  check_launch(function);
}

void dequantize_int8_to_bf16(const int8_t *codes, const float *scales, std::size_t rows, std::size_t cols,
                             uint32_t group_size, uint16_t *dst, cudaStream_t stream) {
  detail::launch_dequantize(reinterpret_cast<const uint8_t *>(codes), scales, rows, cols, group_size, dst, stream,
                            "cuda::dequantize_int8_to_bf16");
}

void dequantize_int8_to_fp32(const int8_t *codes, const float *scales, std::size_t rows, std::size_t cols,
                             uint32_t group_size, float *dst, cudaStream_t stream) {
  detail::launch_dequantize(reinterpret_cast<const uint8_t *>(codes), scales, rows, cols, group_size, dst, stream,
                            "cuda::dequantize_int8_to_fp32");
}

}  // namespace sp::kernels::cuda
