#include "reference.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>

#include "scalar_math.h"

namespace sp::kernels::reference {
namespace {

uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

float fp16_to_float(uint16_t h) {
  const bool negative = (h & 0x8000u) != 0;
  const int exponent = (h >> 10) & 0x1F;
  const int mantissa = h & 0x3FF;
  double magnitude;
  if (exponent == 0x1F) {
    magnitude = mantissa != 0 ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  } else if (exponent == 0) {
    magnitude = std::ldexp(static_cast<double>(mantissa), -24);
  } else {
    magnitude = std::ldexp(1.0 + mantissa / 1024.0, exponent - 15);
  }
  return static_cast<float>(negative ? -magnitude : magnitude);
}

std::size_t groups_per_row(std::size_t cols, uint32_t group_size) {
  return group_size == 0 ? 1 : (cols + group_size - 1) / group_size;
}

}  // namespace

float load(const void *src, DType dtype, std::size_t index) {
  switch (dtype) {
    case DType::kFloat32:
      return static_cast<const float *>(src)[index];
    case DType::kBFloat16:
      return float_of(static_cast<uint32_t>(static_cast<const uint16_t *>(src)[index]) << 16);
    case DType::kFloat16:
      return fp16_to_float(static_cast<const uint16_t *>(src)[index]);
  }
  return std::numeric_limits<float>::quiet_NaN();
}

uint16_t bf16_from_float(float x) {
  if (std::isnan(x)) return 0x7FFF;
  const uint32_t u = bits_of(x);
  const uint32_t truncated = u & 0xFFFF0000u;
  if (truncated == u || std::isinf(x)) return static_cast<uint16_t>(u >> 16);
  // The two bf16 neighbours of x (same sign), compared by distance in double.
  const double lower = std::fabs(static_cast<double>(float_of(truncated)));
  const double upper_magnitude = (truncated & 0x7FFFFFFFu) + 0x10000u >= 0x7F800000u
                                     ? std::numeric_limits<double>::infinity()
                                     : std::fabs(static_cast<double>(float_of(truncated + 0x10000u)));
  const double magnitude = std::fabs(static_cast<double>(x));
  // Between the largest finite bf16 and infinity, the midpoint is 2^128 * (1 - 2^-9).
  const double upper_for_distance = std::isinf(upper_magnitude) ? std::ldexp(1.0, 128) : upper_magnitude;
  const double below = magnitude - lower;
  const double above = upper_for_distance - magnitude;
  const bool round_up = above < below || (above == below && ((u >> 16) & 1u) != 0);
  return static_cast<uint16_t>((round_up ? truncated + 0x10000u : truncated) >> 16);
}

uint16_t bf16_from_float_stochastic(float x, uint32_t random) {
  if (std::isnan(x)) return 0x7FFF;
  const uint32_t u = bits_of(x);
  if (std::isinf(x)) return static_cast<uint16_t>(u >> 16);
  // Round the magnitude up with probability (discarded bits) / 2^16.
  const uint32_t discarded = u & 0xFFFFu;
  const uint32_t draw = random & 0xFFFFu;
  const bool round_up = discarded != 0 && draw >= 0x10000u - discarded;
  return static_cast<uint16_t>(((u & 0xFFFF0000u) + (round_up ? 0x10000u : 0u)) >> 16);
}

void fp32_to_bf16(const float *src, uint16_t *dst, std::size_t n, const Bf16Options &options) {
  for (std::size_t i = 0; i < n; ++i) {
    dst[i] = options.rounding == Rounding::kStochastic
                 ? bf16_from_float_stochastic(src[i], detail::random_bits(options.seed, i))
                 : bf16_from_float(src[i]);
  }
}

namespace {

// Largest |x| over elements [begin, end), and whether all of them are finite: the first pass
// of every absmax quantizer.
struct GroupAbsmax {
  bool finite = true;
  float absmax = 0.0f;
};

GroupAbsmax group_absmax(const void *src, DType src_dtype, std::size_t begin, std::size_t end) {
  GroupAbsmax group;
  for (std::size_t i = begin; i < end; ++i) {
    const float x = load(src, src_dtype, i);
    if (!std::isfinite(x)) {
      group.finite = false;
    } else {
      group.absmax = std::max(group.absmax, std::fabs(x));
    }
  }
  return group;
}

}  // namespace

void quantize_int8(const void *src, DType src_dtype, std::size_t rows, std::size_t cols, const QuantizeOptions &options,
                   int8_t *codes, float *scales) {
  constexpr float kMaxCode = 127.0f;
  const std::size_t groups = groups_per_row(cols, options.group_size);
  const std::size_t width = options.group_size == 0 ? cols : options.group_size;
  for (std::size_t r = 0; r < rows; ++r) {
    for (std::size_t g = 0; g < groups; ++g) {
      const std::size_t begin = r * cols + g * width;
      const std::size_t end = r * cols + std::min(cols, (g + 1) * width);
      const auto [finite, absmax] = group_absmax(src, src_dtype, begin, end);
      float scale = std::numeric_limits<float>::quiet_NaN();
      if (finite) scale = absmax == 0.0f ? 1.0f : std::max(absmax / kMaxCode, FLT_MIN);
      scales[r * groups + g] = scale;
      const float inv = 1.0f / scale;
      for (std::size_t i = begin; i < end; ++i) {
        if (!finite) {
          codes[i] = 0;
          continue;
        }
        const float v = load(src, src_dtype, i) * inv;
        float q;
        if (options.rounding == Rounding::kStochastic) {
          const float lower = std::floor(v);
          const uint32_t random = detail::random_bits(options.seed, i);
          const float threshold = std::ldexp(static_cast<float>(random >> 8), -24);
          q = threshold < v - lower ? lower + 1.0f : lower;
        } else {
          q = std::nearbyint(v);
        }
        codes[i] = static_cast<int8_t>(std::clamp(q, -127.0f, 127.0f));
      }
    }
  }
}

namespace {

// The NF4 levels and midpoints: scalar_math.h's single definition (nf4_test.cpp checks both
// against the published decimal values and the bitsandbytes tie rule).
float nf4_level_of(unsigned code) { return kernels::detail::nf4_level(code); }
float nf4_midpoint(unsigned k) { return kernels::detail::nf4_midpoint(k); }

void set_nibble(uint8_t *codes, std::size_t element, unsigned code) {
  uint8_t &byte = codes[element / 2];
  if (element % 2 == 0) {
    byte = static_cast<uint8_t>((byte & 0x0Fu) | (code << 4));
  } else {
    byte = static_cast<uint8_t>((byte & 0xF0u) | code);
  }
}

unsigned get_nibble(const uint8_t *codes, std::size_t element) {
  return element % 2 == 0 ? codes[element / 2] >> 4 : codes[element / 2] & 0x0Fu;
}

}  // namespace

uint16_t nf4_bf16_scale(float absmax) {
  const uint16_t nearest = bf16_from_float(absmax);
  return (nearest & 0x7FFFu) == 0x7F80u ? uint16_t{0x7F7F} : nearest;  // absmax >= 0: +Inf only
}

void quantize_nf4(const void *src, DType src_dtype, std::size_t rows, std::size_t cols, uint32_t group_size,
                  uint8_t *codes, float *absmax_out) {
  const std::size_t groups = groups_per_row(cols, group_size);
  const std::size_t n = rows * cols;
  std::fill(codes, codes + (n + 1) / 2, uint8_t{0});  // the unused low nibble stays zero
  for (std::size_t r = 0; r < rows; ++r) {
    for (std::size_t g = 0; g < groups; ++g) {
      const std::size_t begin = r * cols + g * group_size;
      const std::size_t end = r * cols + std::min<std::size_t>(cols, (g + 1) * group_size);
      const auto [finite, absmax] = group_absmax(src, src_dtype, begin, end);
      absmax_out[r * groups + g] = finite ? absmax : std::numeric_limits<float>::quiet_NaN();
      // bitsandbytes: x * (1 / absmax.clamp(min=1e-38)), all in fp32.
      const float inverse = 1.0f / std::max(absmax, 1e-38f);
      for (std::size_t i = begin; i < end; ++i) {
        unsigned code = 7;  // level 0.0, for poisoned groups
        if (finite) {
          const float v = load(src, src_dtype, i) * inverse;
          code = 0;
          while (code < 15 && v > nf4_midpoint(code)) ++code;
        }
        set_nibble(codes, i, code);
      }
    }
  }
}

void dequantize_nf4(const uint8_t *codes, const float *scales, std::size_t rows, std::size_t cols,
                    uint32_t group_size, uint16_t *dst_bf16, float *dst_fp32) {
  const std::size_t groups = groups_per_row(cols, group_size);
  for (std::size_t r = 0; r < rows; ++r) {
    for (std::size_t c = 0; c < cols; ++c) {
      const std::size_t i = r * cols + c;
      const float x = nf4_level_of(get_nibble(codes, i)) * scales[r * groups + c / group_size];
      if (dst_bf16 != nullptr) {
        dst_bf16[i] = bf16_from_float(x);
      } else {
        dst_fp32[i] = x;
      }
    }
  }
}

void dequantize_int8(const int8_t *codes, const float *scales, std::size_t rows, std::size_t cols, uint32_t group_size,
                     uint16_t *dst_bf16, float *dst_fp32) {
  const std::size_t groups = groups_per_row(cols, group_size);
  const std::size_t width = group_size == 0 ? cols : group_size;
  for (std::size_t r = 0; r < rows; ++r) {
    for (std::size_t c = 0; c < cols; ++c) {
      const std::size_t i = r * cols + c;
      const float x = static_cast<float>(codes[i]) * scales[r * groups + c / width];
      if (dst_bf16 != nullptr) {
        dst_bf16[i] = bf16_from_float(x);
      } else {
        dst_fp32[i] = x;
      }
    }
  }
}

void grad_moments(const GradTensor *tensors, std::size_t n_tensors, uint32_t n_blocks, sp_grad_moments_v1 *out) {
  for (uint32_t b = 0; b < n_blocks; ++b) out[b] = sp_grad_moments_v1{b, 0, 0.0, 0.0, 0.0, 0, 0};
  for (std::size_t t = 0; t < n_tensors; ++t) {
    sp_grad_moments_v1 &m = out[tensors[t].block_id];
    m.count += tensors[t].count;
    for (std::size_t i = 0; i < tensors[t].count; ++i) {
      const double x = load(tensors[t].data, tensors[t].dtype, i);
      if (!std::isfinite(x)) {
        ++m.nonfinite;
        continue;
      }
      m.sum += x;
      m.sum_sq += x * x;
      m.max_abs = std::max(m.max_abs, std::fabs(x));
    }
  }
}

double relative_error(const void *a, DType a_dtype, const void *b, DType b_dtype, std::size_t n) {
  double norm_a = 0.0;
  double norm_diff = 0.0;
  for (std::size_t i = 0; i < n; ++i) {
    const double x = load(a, a_dtype, i);
    const double y = load(b, b_dtype, i);
    if (!std::isfinite(x) || !std::isfinite(y)) return std::numeric_limits<double>::quiet_NaN();
    norm_a += x * x;
    norm_diff += (x - y) * (x - y);
  }
  if (norm_a == 0.0) return norm_diff == 0.0 ? 0.0 : std::numeric_limits<double>::infinity();
  return std::sqrt(norm_diff / norm_a);
}

void adamw_update(const AdamWStep &step, const AdamWTensor &tensor) {
  const float decay = tensor.decay ? step.decay : 1.0f;
  const std::size_t n = tensor.shape.rows * tensor.shape.cols;
  const bool bf16 = tensor.moment_dtype == DType::kBFloat16;
  const uint64_t seed = detail::derive_seed(tensor.moment_seed, static_cast<uint64_t>(step.t));
  const auto load = [&](void *moments, std::size_t i) {
    return bf16 ? float_of(static_cast<uint32_t>(static_cast<uint16_t *>(moments)[i]) << 16)
                : static_cast<float *>(moments)[i];
  };
  const auto store = [&](void *moments, std::size_t i, float x, unsigned k) {
    if (!bf16) {
      static_cast<float *>(moments)[i] = x;
    } else if (tensor.moment_rounding == Rounding::kStochastic) {
      static_cast<uint16_t *>(moments)[i] = bf16_from_float_stochastic(x, detail::random_bits(seed, 2 * i + k));
    } else {
      static_cast<uint16_t *>(moments)[i] = bf16_from_float(x);
    }
  };
  for (std::size_t i = 0; i < n; ++i) {
    const float grad = tensor.grad[i] * step.grad_scale;
    const float m = step.beta1 * load(tensor.exp_avg, i) + (1.0f - step.beta1) * grad;
    const float v = step.beta2 * load(tensor.exp_avg_sq, i) + (1.0f - step.beta2) * grad * grad;
    store(tensor.exp_avg, i, m, 0);
    store(tensor.exp_avg_sq, i, v, 1);
    const float denominator = std::sqrt(v) * step.inv_bias2 + step.eps;
    tensor.master[i] = tensor.master[i] * decay - step.step_size * m / denominator;
  }
}

}  // namespace sp::kernels::reference
