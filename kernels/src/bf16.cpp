#include "sp/kernels/bf16.h"

#include <stdexcept>
#include <string>

#include "parallel.h"
#include "reference.h"
#include "row_encoders.h"
#include "scalar_math.h"
#include "simd.h"

namespace sp::kernels {
namespace {

constexpr std::size_t kMinElementsPerThread = 1 << 16;

void check_pointers(const void *src, const void *dst, std::size_t n, const char *function) {
  if (n != 0 && (src == nullptr || dst == nullptr)) {
    throw std::invalid_argument(std::string(function) + ": null pointer with n = " + std::to_string(n));
  }
}

SP_SIMD_CLONES void round_nearest_even(const float *__restrict src, uint16_t *__restrict dst, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) dst[i] = detail::bf16_round_nearest_even(src[i]);
}

SP_SIMD_CLONES void round_stochastic(const float *__restrict src, uint16_t *__restrict dst, std::size_t first,
                                     std::size_t n, uint64_t seed) {
  for (std::size_t i = 0; i < n; ++i) {
    dst[i] = detail::bf16_round_stochastic(src[i], detail::random_bits(seed, first + i));
  }
}

SP_SIMD_CLONES void widen(const uint16_t *__restrict src, float *__restrict dst, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) dst[i] = detail::bf16_bits_to_float(src[i]);
}

}  // namespace

void detail::fp32_to_bf16_span(const float *src, uint16_t *dst, std::size_t n, std::size_t first_index,
                               const Bf16Options &options) {
  if (options.rounding == Rounding::kStochastic) {
    round_stochastic(src, dst, first_index, n, options.seed);
  } else {
    round_nearest_even(src, dst, n);
  }
}

void fp32_to_bf16(const float *src, uint16_t *dst, std::size_t n, const Bf16Options &options, const CpuExec &exec) {
  check_pointers(src, dst, n, "fp32_to_bf16");
  if (exec.impl == CpuImpl::kReference) {
    reference::fp32_to_bf16(src, dst, n, options);
    return;
  }
  detail::parallel_ranges(n, exec, kMinElementsPerThread, [&](std::size_t begin, std::size_t end) {
    detail::fp32_to_bf16_span(src + begin, dst + begin, end - begin, begin, options);
  });
}

void bf16_to_fp32(const uint16_t *src, float *dst, std::size_t n, const CpuExec &exec) {
  check_pointers(src, dst, n, "bf16_to_fp32");
  detail::parallel_ranges(n, exec, kMinElementsPerThread,
                          [&](std::size_t begin, std::size_t end) { widen(src + begin, dst + begin, end - begin); });
}

}  // namespace sp::kernels
