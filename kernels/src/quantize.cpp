// INT8 quantization on the CPU: argument checks, dispatch to the reference, and
// the vectorized multi-threaded implementation (simple restrict loops over the shared scalar
// functions; this file is compiled with -O3 so GCC vectorizes them).
#include "sp/kernels/quantize.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "elements.h"
#include "parallel.h"
#include "quantize_arguments.h"
#include "reference.h"
#include "row_encoders.h"
#include "scalar_math.h"
#include "simd.h"

namespace sp::kernels {
namespace {

constexpr std::size_t kMinElementsPerThread = 1 << 15;

using detail::Bf16Bits;
using detail::to_float;

template <typename In>
SP_SIMD_CLONES void encode_int8(const In *__restrict src, std::size_t n, float inv, int8_t *__restrict codes) {
  for (std::size_t i = 0; i < n; ++i) codes[i] = detail::int8_code_nearest_even(to_float(src[i]), inv);
}

template <typename In>
SP_SIMD_CLONES void encode_int8_stochastic(const In *__restrict src, std::size_t n, float inv, int8_t *__restrict codes,
                                           uint64_t seed, std::size_t first_index) {
  for (std::size_t i = 0; i < n; ++i) {
    codes[i] = detail::int8_code_stochastic(to_float(src[i]), inv, detail::random_bits(seed, first_index + i));
  }
}

struct Layout {
  std::size_t rows;
  std::size_t cols;
  std::size_t groups_per_row;
  std::size_t width;  // elements per group (cols for per-row)
};

Layout make_layout(std::size_t rows, std::size_t cols, uint32_t group_size) {
  return Layout{rows, cols, group_size == 0 ? 1 : (cols + group_size - 1) / group_size,
                group_size == 0 ? cols : group_size};
}

// Row `row` of the tensor (src_row, codes_row and scales_row point at its start).
template <typename In>
void quantize_row_of(const In *src_row, std::size_t row, const Layout &layout, const QuantizeOptions &options,
                     int8_t *codes_row, float *scales_row) {
  constexpr float kMaxCode = 127.0f;
  for (std::size_t g = 0; g < layout.groups_per_row; ++g) {
    const std::size_t column = g * layout.width;
    const std::size_t n = std::min(layout.width, layout.cols - column);
    const uint32_t abs_bits = detail::max_abs_bits(src_row + column, n);
    const float scale = detail::quant_scale(abs_bits, kMaxCode);
    scales_row[g] = scale;
    if (abs_bits >= detail::kInfBits) {
      std::fill(codes_row + column, codes_row + column + n, int8_t{0});
      continue;
    }
    const float inv = detail::reciprocal(scale);
    if (options.rounding == Rounding::kStochastic) {
      encode_int8_stochastic(src_row + column, n, inv, codes_row + column, options.seed, row * layout.cols + column);
    } else {
      encode_int8(src_row + column, n, inv, codes_row + column);
    }
  }
}

template <typename In>
void quantize_rows(const In *src, const Layout &layout, const QuantizeOptions &options, int8_t *codes, float *scales,
                   const CpuExec &exec) {
  const std::size_t min_rows = std::max<std::size_t>(1, kMinElementsPerThread / std::max<std::size_t>(1, layout.cols));
  detail::parallel_ranges(layout.rows, exec, min_rows, [&](std::size_t row_begin, std::size_t row_end) {
    for (std::size_t r = row_begin; r < row_end; ++r) {
      quantize_row_of(src + r * layout.cols, r, layout, options, codes + r * layout.cols,
                      scales + r * layout.groups_per_row);
    }
  });
}

inline void store(float x, float *dst) { *dst = x; }
inline void store(float x, uint16_t *dst) { *dst = detail::bf16_round_nearest_even(x); }

template <typename Out>
SP_SIMD_CLONES void dequantize_int8_segment(const int8_t *__restrict codes, std::size_t n, float scale,
                                            Out *__restrict dst) {
  for (std::size_t i = 0; i < n; ++i) store(static_cast<float>(codes[i]) * scale, dst + i);
}

template <typename Out>
void dequantize_rows(const int8_t *codes, const float *scales, const Layout &layout, Out *dst, const CpuExec &exec) {
  const std::size_t min_rows = std::max<std::size_t>(1, kMinElementsPerThread / std::max<std::size_t>(1, layout.cols));
  detail::parallel_ranges(layout.rows, exec, min_rows, [&](std::size_t row_begin, std::size_t row_end) {
    for (std::size_t r = row_begin; r < row_end; ++r) {
      for (std::size_t g = 0; g < layout.groups_per_row; ++g) {
        const std::size_t first = r * layout.cols + g * layout.width;
        const std::size_t n = std::min(layout.width, layout.cols - g * layout.width);
        const float scale = scales[r * layout.groups_per_row + g];
        dequantize_int8_segment(codes + first, n, scale, dst + first);
      }
    }
  });
}

}  // namespace

void quantize_int8(const void *src, DType src_dtype, std::size_t rows, std::size_t cols, const QuantizeOptions &options,
                   int8_t *codes, float *scales, const CpuExec &exec) {
  const char *function = "quantize_int8";
  detail::check_quantize_arguments(src, src_dtype, rows, cols, options, codes, scales, function);
  if (detail::has_empty_rows(rows, cols, options.group_size)) {
    std::fill(scales, scales + rows, 1.0f);  // an empty row is an all-zero row
    return;
  }
  if (rows == 0 || cols == 0) return;
  if (exec.impl == CpuImpl::kReference) {
    reference::quantize_int8(src, src_dtype, rows, cols, options, codes, scales);
    return;
  }
  const Layout layout = make_layout(rows, cols, options.group_size);
  if (src_dtype == DType::kFloat32) {
    quantize_rows(static_cast<const float *>(src), layout, options, codes, scales, exec);
  } else {
    quantize_rows(static_cast<const Bf16Bits *>(src), layout, options, codes, scales, exec);
  }
}

namespace {

template <typename Out>
void dequantize_int8(const int8_t *codes, const float *scales, std::size_t rows, std::size_t cols, uint32_t group_size,
                     Out *dst, const CpuExec &exec, const char *function) {
  detail::check_dequantize_arguments(codes, scales, rows, cols, group_size, dst, function);
  if (rows == 0 || cols == 0) return;
  if (exec.impl == CpuImpl::kReference) {
    if constexpr (std::is_same_v<Out, uint16_t>) {
      reference::dequantize_int8(codes, scales, rows, cols, group_size, dst, nullptr);
    } else {
      reference::dequantize_int8(codes, scales, rows, cols, group_size, nullptr, dst);
    }
    return;
  }
  dequantize_rows(codes, scales, make_layout(rows, cols, group_size), dst, exec);
}

}  // namespace

bool is_supported_group_size(uint32_t group_size) {
  return group_size == 0 || std::find(std::begin(kSupportedGroupSizes), std::end(kSupportedGroupSizes), group_size) !=
                                std::end(kSupportedGroupSizes);
}

std::size_t scale_count(std::size_t rows, std::size_t cols, uint32_t group_size) {
  if (!is_supported_group_size(group_size)) {
    throw std::invalid_argument("scale_count: group_size " + std::to_string(group_size) +
                                " is not supported (expected 0 = per row, 32, 64, 128 or 256)");
  }
  return rows * make_layout(rows, cols, group_size).groups_per_row;
}

void dequantize_int8_to_bf16(const int8_t *codes, const float *scales, std::size_t rows, std::size_t cols,
                             uint32_t group_size, uint16_t *dst, const CpuExec &exec) {
  dequantize_int8(codes, scales, rows, cols, group_size, dst, exec, "dequantize_int8_to_bf16");
}

void dequantize_int8_to_fp32(const int8_t *codes, const float *scales, std::size_t rows, std::size_t cols,
                             uint32_t group_size, float *dst, const CpuExec &exec) {
  dequantize_int8(codes, scales, rows, cols, group_size, dst, exec, "dequantize_int8_to_fp32");
}

namespace detail {
namespace {

// Signed compares: |x| bit patterns fit in 31 bits, and SSE2 has a signed 32-bit compare only.
template <typename In>
SP_SIMD_CLONES uint32_t max_abs_bits_of(const In *__restrict src, std::size_t n) {
  int32_t result = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const auto bits = static_cast<int32_t>(float_bits(to_float(src[i])) & kAbsMask);
    result = bits > result ? bits : result;
  }
  return static_cast<uint32_t>(result);
}

}  // namespace

uint32_t max_abs_bits(const float *src, std::size_t n) { return max_abs_bits_of(src, n); }

void quantize_int8_row(const float *src_row, std::size_t row, std::size_t cols, const QuantizeOptions &options,
                       int8_t *codes_row, float *scales_row) {
  quantize_row_of(src_row, row, make_layout(1, cols, options.group_size), options, codes_row, scales_row);
}
uint32_t max_abs_bits(const Bf16Bits *src, std::size_t n) { return max_abs_bits_of(src, n); }

}  // namespace detail

}  // namespace sp::kernels
