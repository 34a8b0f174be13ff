// ||a - b|| / ||a|| on the CPU. The vectorized version sums fixed chunks with 16 double lanes
// (calibration errors span many decades, and fp32 squares over- or underflow outside about
// 1e-19..1e19) and adds the chunk partials in chunk order.
#include "sp/kernels/relative_error.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "elements.h"
#include "parallel.h"
#include "reference.h"
#include "simd.h"

namespace sp::kernels {
namespace {

constexpr std::size_t kChunk = 16384;
constexpr std::size_t kLanes = 16;
constexpr std::size_t kMinChunksPerThread = 8;

struct ChunkNorms {
  double norm_a = 0.0;
  double norm_diff = 0.0;
  bool finite = true;
};

template <typename A, typename B>
SP_SIMD_CLONES ChunkNorms chunk_norms(const A *__restrict a, const B *__restrict b, std::size_t n) {
  double norm_a[kLanes] = {};
  double norm_diff[kLanes] = {};
  uint32_t nonfinite[kLanes] = {};
  const auto accumulate = [&](std::size_t lane, float x, float y) {
    const bool x_bad = (detail::float_bits(x) & detail::kInfBits) == detail::kInfBits;
    const bool y_bad = (detail::float_bits(y) & detail::kInfBits) == detail::kInfBits;
    nonfinite[lane] |= (x_bad || y_bad) ? 1u : 0u;
    const double d = static_cast<double>(x) - static_cast<double>(y);
    norm_a[lane] += static_cast<double>(x) * x;
    norm_diff[lane] += d * d;
  };
  const std::size_t full = n - n % kLanes;
  for (std::size_t i = 0; i < full; i += kLanes) {
    for (std::size_t lane = 0; lane < kLanes; ++lane) {
      accumulate(lane, detail::to_float(a[i + lane]), detail::to_float(b[i + lane]));
    }
  }
  for (std::size_t i = full; i < n; ++i) accumulate(i - full, detail::to_float(a[i]), detail::to_float(b[i]));
  ChunkNorms chunk;
  for (std::size_t lane = 0; lane < kLanes; ++lane) {
    chunk.norm_a += norm_a[lane];
    chunk.norm_diff += norm_diff[lane];
    chunk.finite = chunk.finite && nonfinite[lane] == 0;
  }
  return chunk;
}

}  // namespace

double relative_error(const void *a, DType a_dtype, const void *b, DType b_dtype, std::size_t n, const CpuExec &exec) {
  if (n != 0 && (a == nullptr || b == nullptr)) {
    throw std::invalid_argument("relative_error: null pointer with n = " + std::to_string(n));
  }
  if (exec.impl == CpuImpl::kReference) return reference::relative_error(a, a_dtype, b, b_dtype, n);
  const std::size_t n_chunks = (n + kChunk - 1) / kChunk;
  std::vector<ChunkNorms> chunks(n_chunks);
  detail::visit_elements(a, a_dtype, [&](const auto *typed_a) {
    detail::visit_elements(b, b_dtype, [&](const auto *typed_b) {
      detail::parallel_ranges(n_chunks, exec, kMinChunksPerThread, [&](std::size_t begin, std::size_t end) {
        for (std::size_t c = begin; c < end; ++c) {
          const std::size_t first = c * kChunk;
          chunks[c] = chunk_norms(typed_a + first, typed_b + first, std::min(kChunk, n - first));
        }
      });
    });
  });
  double norm_a = 0.0;
  double norm_diff = 0.0;
  for (const ChunkNorms &chunk : chunks) {
    if (!chunk.finite) return std::numeric_limits<double>::quiet_NaN();
    norm_a += chunk.norm_a;
    norm_diff += chunk.norm_diff;
  }
  if (norm_a == 0.0) return norm_diff == 0.0 ? 0.0 : std::numeric_limits<double>::infinity();
  return std::sqrt(norm_diff / norm_a);
}

}  // namespace sp::kernels
