// NF4 quantization on the CPU: argument checks, dispatch to the reference, and the vectorized
// multi-threaded implementation (restrict loops over the shared scalar functions of
// scalar_math.h; compiled with -O3 so GCC vectorizes them).
#include "sp/kernels/nf4.h"

#include <algorithm>
#include <array>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "elements.h"
#include "parallel.h"
#include "quantize_arguments.h"
#include "reference.h"
#include "row_encoders.h"
#include "scalar_math.h"
#include "simd.h"

namespace sp::kernels {

// The levels of detail::nf4_level (scalar_math.h), their one definition.
const float kNf4Levels[16] = {
    detail::nf4_level(0),  detail::nf4_level(1),  detail::nf4_level(2),  detail::nf4_level(3),
    detail::nf4_level(4),  detail::nf4_level(5),  detail::nf4_level(6),  detail::nf4_level(7),
    detail::nf4_level(8),  detail::nf4_level(9),  detail::nf4_level(10), detail::nf4_level(11),
    detail::nf4_level(12), detail::nf4_level(13), detail::nf4_level(14), detail::nf4_level(15)};

namespace {

constexpr std::size_t kMinElementsPerThread = 1 << 15;

using detail::Bf16Bits;
using detail::to_float;

#if SP_HAVE_VECTOR_SHUFFLE
typedef float F32x8 __attribute__((vector_size(32)));
typedef int32_t I32x8 __attribute__((vector_size(32)));
typedef uint32_t U32x8 __attribute__((vector_size(32)));
typedef uint16_t U16x8 __attribute__((vector_size(16)));
typedef uint8_t U8x32 __attribute__((vector_size(32)));
#endif

// One code per byte into `out` (packed afterwards). On GCC/x86-64, eight lanes at a time in GCC
// vector types: the same fp32 multiply and the same 15 strict compares as detail::nf4_code,
// each compare's all-ones mask subtracted from the count, then one byte shuffle (the plain loop
// vectorizes too, but GCC narrows its bytes one lane at a time). The tail, and other
// compilers, use detail::nf4_code itself.
template <typename In>
SP_SIMD_CLONES void encode_nf4(const In *__restrict src, std::size_t n, float inverse, uint8_t *__restrict out) {
  std::size_t i = 0;
#if SP_HAVE_VECTOR_SHUFFLE
  static constexpr std::array<float, 15> kMidpoints = detail::nf4_midpoints();
  for (; i + 8 <= n; i += 8) {
    F32x8 x;
    if constexpr (std::is_same_v<In, float>) {
      std::memcpy(&x, src + i, sizeof x);
    } else {  // bf16 -> fp32 is a 16-bit shift, exact
      U16x8 bits;
      std::memcpy(&bits, src + i, sizeof bits);
      x = reinterpret_cast<F32x8>(__builtin_convertvector(bits, U32x8) << 16);
    }
    const F32x8 v = x * inverse;
    I32x8 count = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int m = 0; m < 15; ++m) count -= (v > kMidpoints[m]);
    // Counts are 0..15: the low byte of each lane, gathered by one constant shuffle.
    const U8x32 bytes = __builtin_shuffle(
        reinterpret_cast<U8x32>(count),
        U8x32{0, 4, 8, 12, 16, 20, 24, 28, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0});
    std::memcpy(out + i, &bytes, 8);
  }
#endif
  for (; i < n; ++i) out[i] = static_cast<uint8_t>(detail::nf4_code(to_float(src[i]), inverse));
}

// Packs n one-per-byte codes of elements [first, first + n) into nibbles, even elements high.
// When `first` is odd the high nibble of the first byte belongs to the previous element,
// written earlier by the same thread (ranges start at even elements), and is kept. When
// first + n is odd the low nibble of the last byte is written as zero (the next row, if any,
// ORs its first code in).
SP_SIMD_CLONES void pack_nibbles(const uint8_t *__restrict one_per_byte, std::size_t n, std::size_t first,
                                 uint8_t *__restrict codes) {
  std::size_t i = 0;
  if (first % 2 == 1 && n > 0) {
    uint8_t &byte = codes[first / 2];
    byte = static_cast<uint8_t>((byte & 0xF0u) | one_per_byte[0]);
    i = 1;
  }
  uint8_t *__restrict out = codes + (first + i) / 2;
  const std::size_t pairs = (n - i) / 2;
  const uint8_t *__restrict in = one_per_byte + i;
  for (std::size_t j = 0; j < pairs; ++j) {
    out[j] = static_cast<uint8_t>((in[2 * j] << 4) | in[2 * j + 1]);
  }
  if ((n - i) % 2 == 1) out[pairs] = static_cast<uint8_t>(in[2 * pairs] << 4);
}

inline void store_scale(uint32_t abs_bits, uint16_t *scale) { *scale = detail::nf4_scale_bits(abs_bits); }
inline void store_scale(uint32_t abs_bits, float *scale) { *scale = detail::nf4_absmax(abs_bits); }

template <typename In, typename Scale>
void quantize_row_of(const In *src_row, std::size_t row, std::size_t cols, uint32_t group_size, uint8_t *scratch,
                     uint8_t *codes, Scale *scales_row) {
  for (std::size_t column = 0, g = 0; column < cols; column += group_size, ++g) {
    const std::size_t n = std::min<std::size_t>(group_size, cols - column);
    const uint32_t abs_bits = detail::max_abs_bits(src_row + column, n);
    store_scale(abs_bits, scales_row + g);
    if (abs_bits >= detail::kInfBits) {  // NaN or Inf: the group is poisoned
      std::fill(scratch + column, scratch + column + n, static_cast<uint8_t>(detail::kNf4ZeroCode));
    } else {
      encode_nf4(src_row + column, n, detail::nf4_inverse_absmax(detail::bits_float(abs_bits)), scratch + column);
    }
  }
  pack_nibbles(scratch, cols, row * cols, codes);
}

template <typename In, typename Scale>
void quantize_rows(const In *src, std::size_t rows, std::size_t cols, uint32_t group_size, uint8_t *codes,
                   Scale *scales, const CpuExec &exec) {
  const std::size_t groups = (cols + group_size - 1) / group_size;
  // Ranges hold whole units (row pairs when cols is odd): every range then starts at an even
  // element and no byte is written by two threads.
  const std::size_t rows_per_unit = detail::nf4_rows_per_unit(cols);
  const std::size_t units = (rows + rows_per_unit - 1) / rows_per_unit;
  const std::size_t min_units =
      std::max<std::size_t>(1, kMinElementsPerThread / std::max<std::size_t>(1, cols * rows_per_unit));
  detail::parallel_ranges(units, exec, min_units, [&](std::size_t unit_begin, std::size_t unit_end) {
    std::vector<uint8_t> scratch(cols);
    const std::size_t row_end = std::min(rows, unit_end * rows_per_unit);
    for (std::size_t r = unit_begin * rows_per_unit; r < row_end; ++r) {
      quantize_row_of(src + r * cols, r, cols, group_size, scratch.data(), codes, scales + r * groups);
    }
  });
}

inline void store(float x, float *dst) { *dst = x; }
inline void store(float x, uint16_t *dst) { *dst = detail::bf16_round_nearest_even(x); }

// Elements [first, first + n) of one group, through a 16-entry table of level * scale (the
// same fp32 product the per-element formula computes, and its bf16 rounding for bf16 output).
template <typename Out>
SP_SIMD_CLONES void dequantize_segment(const uint8_t *__restrict codes, std::size_t first, std::size_t n,
                                       const Out *__restrict table, Out *__restrict dst) {
  std::size_t i = 0;
  if (first % 2 == 1 && n > 0) {
    dst[0] = table[codes[first / 2] & 0x0Fu];
    i = 1;
  }
  const uint8_t *__restrict in = codes + (first + i) / 2;
  Out *__restrict out = dst + i;
  const std::size_t pairs = (n - i) / 2;
  for (std::size_t j = 0; j < pairs; ++j) {
    const uint8_t byte = in[j];
    out[2 * j] = table[byte >> 4];
    out[2 * j + 1] = table[byte & 0x0Fu];
  }
  if ((n - i) % 2 == 1) out[2 * pairs] = table[in[pairs] >> 4];
}

#if SP_HAVE_VECTOR_SHUFFLE
typedef uint8_t U8x16 __attribute__((vector_size(16)));

// One row to bf16 when its first element is even: per group a 16-entry table of
// bf16(level * scale) (the per-element formula's exact result), split into low and high
// bytes, then 16 code bytes (32 elements) at a time through four byte shuffles (pshufb) and
// three interleaves; the row's tail (cols % 32) through the scalar loop.
template <typename Scale>
SP_SHUFFLE_CLONES void dequantize_row_bf16(const uint8_t *__restrict codes, std::size_t cols,
                                           const Scale *__restrict scales, std::size_t group_size,
                                           const float *__restrict levels, uint16_t *__restrict dst) {
  const U8x16 low_nibble = {15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15};
  const U8x32 kLowBytes = {0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60,
                           0, 0, 0, 0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0};
  const U8x32 kHighBytes = {1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 53, 57, 61,
                            0, 0, 0, 0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0};
  F32x8 levels_lower, levels_upper;
  std::memcpy(&levels_lower, levels, sizeof levels_lower);
  std::memcpy(&levels_upper, levels + 8, sizeof levels_upper);
  for (std::size_t column = 0, g = 0; column < cols; column += group_size, ++g) {
    const float scale = detail::nf4_scale_value(scales[g]);
    U8x16 table_low, table_high;
    if (!(std::fabs(scale) <= FLT_MAX)) {  // NaN or Inf scale: the scalar rounding (NaN rule)
      for (int k = 0; k < 16; ++k) {
        const uint16_t value = detail::bf16_round_nearest_even(levels[k] * scale);
        table_low[k] = static_cast<uint8_t>(value);
        table_high[k] = static_cast<uint8_t>(value >> 8);
      }
    } else {
      // Finite products: bf16_round_nearest_even's integer rounding, eight lanes at a time.
      U32x8 lower = reinterpret_cast<U32x8>(levels_lower * scale);
      U32x8 upper = reinterpret_cast<U32x8>(levels_upper * scale);
      lower = (lower + 0x7FFFu + ((lower >> 16) & 1u)) >> 16;
      upper = (upper + 0x7FFFu + ((upper >> 16) & 1u)) >> 16;
      const U8x32 low = __builtin_shuffle(reinterpret_cast<U8x32>(lower), reinterpret_cast<U8x32>(upper), kLowBytes);
      const U8x32 high = __builtin_shuffle(reinterpret_cast<U8x32>(lower), reinterpret_cast<U8x32>(upper), kHighBytes);
      std::memcpy(&table_low, &low, sizeof table_low);
      std::memcpy(&table_high, &high, sizeof table_high);
    }
    const std::size_t n = std::min(group_size, cols - column);
    const std::size_t vectors = n / 32;
    const uint8_t *in = codes + column / 2;
    uint16_t *out = dst + column;
    for (std::size_t v = 0; v < vectors; ++v) {
      U8x16 bytes;
      std::memcpy(&bytes, in + 16 * v, 16);
      const U8x16 even = bytes >> 4;
      const U8x16 odd = bytes & low_nibble;
      const U8x16 even_low = __builtin_shuffle(table_low, even);
      const U8x16 even_high = __builtin_shuffle(table_high, even);
      const U8x16 odd_low = __builtin_shuffle(table_low, odd);
      const U8x16 odd_high = __builtin_shuffle(table_high, odd);
      const U8x16 first_half = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
      const U8x16 second_half = {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
      const auto even0 = reinterpret_cast<U16x8>(__builtin_shuffle(even_low, even_high, first_half));
      const auto even1 = reinterpret_cast<U16x8>(__builtin_shuffle(even_low, even_high, second_half));
      const auto odd0 = reinterpret_cast<U16x8>(__builtin_shuffle(odd_low, odd_high, first_half));
      const auto odd1 = reinterpret_cast<U16x8>(__builtin_shuffle(odd_low, odd_high, second_half));
      const U16x8 words_first = {0, 8, 1, 9, 2, 10, 3, 11};
      const U16x8 words_second = {4, 12, 5, 13, 6, 14, 7, 15};
      const U16x8 r0 = __builtin_shuffle(even0, odd0, words_first);
      const U16x8 r1 = __builtin_shuffle(even0, odd0, words_second);
      const U16x8 r2 = __builtin_shuffle(even1, odd1, words_first);
      const U16x8 r3 = __builtin_shuffle(even1, odd1, words_second);
      std::memcpy(out + 32 * v, &r0, 16);
      std::memcpy(out + 32 * v + 8, &r1, 16);
      std::memcpy(out + 32 * v + 16, &r2, 16);
      std::memcpy(out + 32 * v + 24, &r3, 16);
    }
    for (std::size_t i = vectors * 32; i < n; ++i) {
      const uint8_t byte = in[i / 2];
      const unsigned code = detail::nf4_nibble(byte, i);
      out[i] = static_cast<uint16_t>(table_low[code] | (table_high[code] << 8));
    }
  }
}
#endif

template <typename Out, typename Scale>
void dequantize_rows(const uint8_t *codes, const Scale *scales, std::size_t rows, std::size_t cols,
                     uint32_t group_size, Out *dst, const CpuExec &exec) {
  const std::size_t groups = (cols + group_size - 1) / group_size;
  std::array<float, 16> levels{};
  for (uint32_t k = 0; k < 16; ++k) levels[k] = detail::nf4_level(k);
  const std::size_t min_rows = std::max<std::size_t>(1, kMinElementsPerThread / std::max<std::size_t>(1, cols));
  detail::parallel_ranges(rows, exec, min_rows, [&](std::size_t row_begin, std::size_t row_end) {
    Out table[16];
    for (std::size_t r = row_begin; r < row_end; ++r) {
#if SP_HAVE_VECTOR_SHUFFLE
      if constexpr (std::is_same_v<Out, uint16_t>) {
        if ((r * cols) % 2 == 0) {
          dequantize_row_bf16(codes + r * cols / 2, cols, scales + r * groups, group_size, levels.data(),
                              dst + r * cols);
          continue;
        }
      }
#endif
      for (std::size_t g = 0; g < groups; ++g) {
        const float scale = detail::nf4_scale_value(scales[r * groups + g]);
        for (uint32_t k = 0; k < 16; ++k) store(levels[k] * scale, table + k);
        const std::size_t first = r * cols + g * group_size;
        const std::size_t n = std::min<std::size_t>(group_size, cols - g * group_size);
        dequantize_segment(codes, first, n, table, dst + first);
      }
    }
  });
}

template <typename Out, typename Scale>
void dequantize(const uint8_t *codes, const Scale *scales, std::size_t rows, std::size_t cols, uint32_t group_size,
                Out *dst, const CpuExec &exec, const char *function) {
  detail::check_nf4_dequantize_arguments(codes, scales, rows, cols, group_size, dst, function);
  if (rows == 0 || cols == 0) return;
  if (exec.impl == CpuImpl::kReference) {
    std::vector<float> scale_values(nf4_scale_count(rows, cols, group_size));
    for (std::size_t i = 0; i < scale_values.size(); ++i) scale_values[i] = detail::nf4_scale_value(scales[i]);
    if constexpr (std::is_same_v<Out, uint16_t>) {
      reference::dequantize_nf4(codes, scale_values.data(), rows, cols, group_size, dst, nullptr);
    } else {
      reference::dequantize_nf4(codes, scale_values.data(), rows, cols, group_size, nullptr, dst);
    }
    return;
  }
  dequantize_rows(codes, scales, rows, cols, group_size, dst, exec);
}

}  // namespace

bool is_supported_nf4_group_size(uint32_t group_size) {
  return group_size == 32 || group_size == 64 || group_size == 128 || group_size == 256;
}

std::size_t nf4_code_bytes(std::size_t rows, std::size_t cols) { return (rows * cols + 1) / 2; }

std::size_t nf4_scale_count(std::size_t rows, std::size_t cols, uint32_t group_size) {
  if (!is_supported_nf4_group_size(group_size)) {
    throw std::invalid_argument("nf4_scale_count: group_size " + std::to_string(group_size) +
                                " is not supported for NF4 (expected 32, 64, 128 or 256)");
  }
  return rows * ((cols + group_size - 1) / group_size);
}

void detail::quantize_nf4_row(const float *src_row, std::size_t row, std::size_t cols, uint32_t group_size,
                              uint8_t *scratch, uint8_t *codes, uint16_t *scales_row) {
  quantize_row_of(src_row, row, cols, group_size, scratch, codes, scales_row);
}

namespace {

template <typename Scale>
void quantize(const void *src, DType src_dtype, std::size_t rows, std::size_t cols, uint32_t group_size,
              uint8_t *codes, Scale *scales, const CpuExec &exec) {
  detail::check_nf4_quantize_arguments(src, src_dtype, rows, cols, group_size, codes, scales, "quantize_nf4");
  if (rows == 0 || cols == 0) return;
  if (exec.impl == CpuImpl::kReference) {
    if constexpr (std::is_same_v<Scale, float>) {
      reference::quantize_nf4(src, src_dtype, rows, cols, group_size, codes, scales);
    } else {
      std::vector<float> absmax(nf4_scale_count(rows, cols, group_size));
      reference::quantize_nf4(src, src_dtype, rows, cols, group_size, codes, absmax.data());
      for (std::size_t i = 0; i < absmax.size(); ++i) scales[i] = reference::nf4_bf16_scale(absmax[i]);
    }
    return;
  }
  if (src_dtype == DType::kFloat32) {
    quantize_rows(static_cast<const float *>(src), rows, cols, group_size, codes, scales, exec);
  } else {
    quantize_rows(static_cast<const Bf16Bits *>(src), rows, cols, group_size, codes, scales, exec);
  }
}

}  // namespace

void quantize_nf4(const void *src, DType src_dtype, std::size_t rows, std::size_t cols, uint32_t group_size,
                  uint8_t *codes, uint16_t *scales, const CpuExec &exec) {
  quantize(src, src_dtype, rows, cols, group_size, codes, scales, exec);
}

void quantize_nf4(const void *src, DType src_dtype, std::size_t rows, std::size_t cols, uint32_t group_size,
                  uint8_t *codes, float *scales, const CpuExec &exec) {
  quantize(src, src_dtype, rows, cols, group_size, codes, scales, exec);
}

void dequantize_nf4_to_bf16(const uint8_t *codes, const uint16_t *scales, std::size_t rows, std::size_t cols,
                            uint32_t group_size, uint16_t *dst, const CpuExec &exec) {
  dequantize(codes, scales, rows, cols, group_size, dst, exec, "dequantize_nf4_to_bf16");
}

void dequantize_nf4_to_bf16(const uint8_t *codes, const float *scales, std::size_t rows, std::size_t cols,
                            uint32_t group_size, uint16_t *dst, const CpuExec &exec) {
  dequantize(codes, scales, rows, cols, group_size, dst, exec, "dequantize_nf4_to_bf16");
}

void dequantize_nf4_to_fp32(const uint8_t *codes, const uint16_t *scales, std::size_t rows, std::size_t cols,
                            uint32_t group_size, float *dst, const CpuExec &exec) {
  dequantize(codes, scales, rows, cols, group_size, dst, exec, "dequantize_nf4_to_fp32");
}

void dequantize_nf4_to_fp32(const uint8_t *codes, const float *scales, std::size_t rows, std::size_t cols,
                            uint32_t group_size, float *dst, const CpuExec &exec) {
  dequantize(codes, scales, rows, cols, group_size, dst, exec, "dequantize_nf4_to_fp32");
}

}  // namespace sp::kernels
