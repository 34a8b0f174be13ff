// AdamW on the CPU, alone (adamw_update) and fused with the image rebuild (adamw_update_slab):
// the element update is one restrict loop, compiled for AVX-512, AVX2 and the baseline, and the
// fused pass runs it on one row or chunk at a time, then hands that row, still in cache, to the
// same row encoders the whole-tensor quantizers use (row_encoders.h).
#include "sp/kernels/adamw.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "parallel.h"
#include "quantize_arguments.h"
#include "reference.h"
#include "row_encoders.h"
#include "scalar_math.h"
#include "simd.h"
#include "slab_layout.h"
#include "sp/kernels/nf4.h"

namespace sp::kernels {
namespace {

constexpr std::size_t kMinElementsPerThread = 1 << 15;
// BF16 images are built chunk by chunk: 16 KiB of master, updated and then rounded from L1.
constexpr std::size_t kBf16Chunk = 4096;

inline float load_moment(float x) { return x; }
inline float load_moment(uint16_t bits) { return detail::bf16_bits_to_float(bits); }

// Stores moment k (0: m, 1: v) of element `index`.
template <bool kStochastic>
inline void store_moment(float x, float *dst, uint64_t, std::size_t, unsigned) {
  *dst = x;
}
template <bool kStochastic>
inline void store_moment(float x, uint16_t *dst, uint64_t seed, std::size_t index, unsigned k) {
  *dst = kStochastic ? detail::bf16_round_stochastic(x, detail::random_bits(seed, 2 * static_cast<uint64_t>(index) + k))
                     : detail::bf16_round_nearest_even(x);
}

// Elements [first, first + n) of a tensor (the pointers point at element `first`). The
// expression order is the header's, operation by operation; the loop must stay free of
// reassociation (no -ffast-math) for the bits to match.
template <typename Moment, bool kStochastic>
SP_WIDE_SIMD_CLONES void update_span(const AdamWStep &step, float decay, float *__restrict w,
                                     const float *__restrict g, Moment *__restrict m, Moment *__restrict v,
                                     std::size_t n, uint64_t seed, std::size_t first) {
  const float b1 = step.beta1;
  const float b2 = step.beta2;
  const float one_minus_b1 = 1.0f - b1;
  const float one_minus_b2 = 1.0f - b2;
  const float eps = step.eps;
  const float step_size = step.step_size;
  const float inv_bias2 = step.inv_bias2;
  const float scale = step.grad_scale;
  for (std::size_t i = 0; i < n; ++i) {
    const float grad = g[i] * scale;
    const float m_next = b1 * load_moment(m[i]) + one_minus_b1 * grad;
    const float v_next = b2 * load_moment(v[i]) + one_minus_b2 * grad * grad;
    store_moment<kStochastic>(m_next, m + i, seed, first + i, 0);
    store_moment<kStochastic>(v_next, v + i, seed, first + i, 1);
    w[i] = w[i] * decay - step_size * m_next / (std::sqrt(v_next) * inv_bias2 + eps);
  }
}

void update_elements(const AdamWStep &step, const AdamWTensor &t, std::size_t first, std::size_t n) {
  const float decay = t.decay ? step.decay : 1.0f;
  if (t.moment_dtype == DType::kFloat32) {
    update_span<float, false>(step, decay, t.master + first, t.grad + first, static_cast<float *>(t.exp_avg) + first,
                              static_cast<float *>(t.exp_avg_sq) + first, n, 0, first);
    return;
  }
  auto *m = static_cast<uint16_t *>(t.exp_avg) + first;
  auto *v = static_cast<uint16_t *>(t.exp_avg_sq) + first;
  const uint64_t seed = detail::derive_seed(t.moment_seed, static_cast<uint64_t>(step.t));
  if (t.moment_rounding == Rounding::kStochastic) {
    update_span<uint16_t, true>(step, decay, t.master + first, t.grad + first, m, v, n, seed, first);
  } else {
    update_span<uint16_t, false>(step, decay, t.master + first, t.grad + first, m, v, n, seed, first);
  }
}

std::size_t element_count(const TensorShape &shape, std::size_t index, const char *function) {
  std::size_t n;
  if (__builtin_mul_overflow(shape.rows, shape.cols, &n)) {
    throw std::invalid_argument(std::string(function) + ": tensor " + std::to_string(index) + " has " +
                                std::to_string(shape.rows) + " x " + std::to_string(shape.cols) +
                                " elements, which overflows");
  }
  return n;
}

void check_tensor(const AdamWTensor &t, std::size_t index, const char *function) {
  if (t.moment_dtype != DType::kFloat32 && t.moment_dtype != DType::kBFloat16) {
    throw std::invalid_argument(std::string(function) + ": tensor " + std::to_string(index) + " has " +
                                dtype_name(t.moment_dtype) + " moments (expected float32 or bfloat16)");
  }
  if (element_count(t.shape, index, function) == 0) return;
  const char *missing = t.master == nullptr       ? "master"
                        : t.grad == nullptr       ? "grad"
                        : t.exp_avg == nullptr    ? "exp_avg"
                        : t.exp_avg_sq == nullptr ? "exp_avg_sq"
                                                  : nullptr;
  if (missing != nullptr) {
    throw std::invalid_argument(std::string(function) + ": tensor " + std::to_string(index) + " (" +
                                std::to_string(t.shape.rows) + " x " + std::to_string(t.shape.cols) + ") has a null " +
                                missing + " pointer");
  }
}

void update_tensor(const AdamWStep &step, const AdamWTensor &t, const CpuExec &exec) {
  const std::size_t n = t.shape.rows * t.shape.cols;
  if (exec.impl == CpuImpl::kReference) {
    reference::adamw_update(step, t);
    return;
  }
  detail::parallel_ranges(n, exec, kMinElementsPerThread,
                          [&](std::size_t begin, std::size_t end) { update_elements(step, t, begin, end - begin); });
}

// The fused sweep over one tensor: every row (BF16: every chunk) is updated, then encoded.
void update_and_encode(const SlabEncoding &encoding, const AdamWStep &step, const AdamWTensor &t,
                       const detail::SlabTensorTarget &target, const CpuExec &exec) {
  const std::size_t rows = t.shape.rows;
  const std::size_t cols = t.shape.cols;
  const std::size_t n = rows * cols;
  switch (encoding.precision) {
    case SlabPrecision::kBf16: {
      const Bf16Options options{encoding.rounding, target.seed};
      auto *dst = reinterpret_cast<uint16_t *>(target.data);
      const std::size_t chunks = (n + kBf16Chunk - 1) / kBf16Chunk;
      detail::parallel_ranges(chunks, exec, kMinElementsPerThread / kBf16Chunk, [&](std::size_t begin, std::size_t end) {
        for (std::size_t c = begin; c < end; ++c) {
          const std::size_t first = c * kBf16Chunk;
          const std::size_t count = std::min(kBf16Chunk, n - first);
          update_elements(step, t, first, count);
          detail::fp32_to_bf16_span(t.master + first, dst + first, count, first, options);
        }
      });
      return;
    }
    case SlabPrecision::kInt8: {
      const QuantizeOptions options{encoding.group_size, encoding.rounding, target.seed};
      auto *scales = reinterpret_cast<float *>(target.scales);
      if (detail::has_empty_rows(rows, cols, encoding.group_size)) {
        std::fill(scales, scales + rows, 1.0f);  // an empty row is an all-zero row
        return;
      }
      const std::size_t groups_per_row = scale_count(1, cols, encoding.group_size);
      const std::size_t min_rows = std::max<std::size_t>(1, kMinElementsPerThread / std::max<std::size_t>(1, cols));
      detail::parallel_ranges(rows, exec, min_rows, [&](std::size_t begin, std::size_t end) {
        for (std::size_t r = begin; r < end; ++r) {
          update_elements(step, t, r * cols, cols);
          detail::quantize_int8_row(t.master + r * cols, r, cols, options,
                                    reinterpret_cast<int8_t *>(target.data) + r * cols, scales + r * groups_per_row);
        }
      });
      return;
    }
    case SlabPrecision::kNf4: {
      if (n == 0) return;
      const std::size_t groups_per_row = nf4_scale_count(1, cols, encoding.group_size);
      auto *scales = reinterpret_cast<uint16_t *>(target.scales);
      const std::size_t rows_per_unit = detail::nf4_rows_per_unit(cols);
      const std::size_t units = (rows + rows_per_unit - 1) / rows_per_unit;
      const std::size_t min_units = std::max<std::size_t>(1, kMinElementsPerThread / (cols * rows_per_unit));
      detail::parallel_ranges(units, exec, min_units, [&](std::size_t begin, std::size_t end) {
        std::vector<uint8_t> scratch(cols);
        for (std::size_t r = begin * rows_per_unit; r < std::min(rows, end * rows_per_unit); ++r) {
          update_elements(step, t, r * cols, cols);
          detail::quantize_nf4_row(t.master + r * cols, r, cols, encoding.group_size, scratch.data(), target.data,
                                   scales + r * groups_per_row);
        }
      });
      return;
    }
  }
}

}  // namespace

AdamWStep make_adamw_step(const AdamWHyperparameters &hyper, double lr, int64_t t, double grad_scale) {
  if (t < 1) {
    throw std::invalid_argument("make_adamw_step: step " + std::to_string(t) + " (expected 1 or more: the first step is 1)");
  }
  const auto steps = static_cast<double>(t);
  AdamWStep step;
  step.beta1 = static_cast<float>(hyper.beta1);
  step.beta2 = static_cast<float>(hyper.beta2);
  step.eps = static_cast<float>(hyper.eps);
  step.step_size = static_cast<float>(lr / (1.0 - std::pow(hyper.beta1, steps)));
  step.inv_bias2 = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(hyper.beta2, steps)));
  step.decay = static_cast<float>(1.0 - lr * hyper.weight_decay);
  step.grad_scale = static_cast<float>(grad_scale);
  step.t = t;
  return step;
}

void adamw_update(const AdamWStep &step, const AdamWTensor &tensor, const CpuExec &exec) {
  check_tensor(tensor, 0, "adamw_update");
  update_tensor(step, tensor, exec);
}

uint64_t adamw_update_slab(const SlabEncoding &encoding, const AdamWStep &step, const AdamWTensor *tensors,
                           std::size_t n_tensors, uint8_t *image, uint64_t capacity, const CpuExec &exec) {
  if (n_tensors != 0 && tensors == nullptr) {
    throw std::invalid_argument("adamw_update_slab: null tensor list with n_tensors = " + std::to_string(n_tensors));
  }
  std::vector<TensorShape> shapes(n_tensors);
  for (std::size_t i = 0; i < n_tensors; ++i) {
    check_tensor(tensors[i], i, "adamw_update_slab");
    shapes[i] = tensors[i].shape;
  }
  const detail::SlabLayout layout =
      detail::lay_out_slab(encoding, shapes.data(), n_tensors, image, capacity, "adamw_update_slab");
  if (exec.impl == CpuImpl::kReference) {
    // The definition: the unfused path, update then build.
    std::vector<SlabTensorSource> sources(n_tensors);
    for (std::size_t i = 0; i < n_tensors; ++i) {
      reference::adamw_update(step, tensors[i]);
      sources[i] = SlabTensorSource{tensors[i].master, shapes[i]};
    }
    return build_slab(encoding, sources.data(), n_tensors, image, capacity, exec);
  }
  for (std::size_t i = 0; i < n_tensors; ++i) update_and_encode(encoding, step, tensors[i], layout.tensors[i], exec);
  return layout.total_bytes;
}

}  // namespace sp::kernels
