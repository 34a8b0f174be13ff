// Fused per-block gradient moments on the CPU. The vectorized version cuts every tensor into
// chunks of kGradMomentsChunk elements, computes each chunk with 16 fp32 lanes (a fixed lane
// assignment, so SIMD width never changes the sums), and adds the chunk partials of each block
// in double, in chunk order, after all threads are done.
#include "sp/kernels/moments.h"

#include <algorithm>
#include <cstring>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "elements.h"
#include "parallel.h"
#include "reference.h"
#include "simd.h"

namespace sp::kernels {
namespace {

constexpr std::size_t kLanes = 16;
constexpr std::size_t kMinChunksPerThread = 8;

struct ChunkPartial {
  double sum = 0.0;
  double sum_sq = 0.0;
  float max_abs = 0.0f;
  uint64_t nonfinite = 0;
};

struct ChunkRef {
  std::size_t tensor;
  std::size_t offset;
};

// 16 lanes, held as two 8-wide GCC vectors (one AVX2 register each, two SSE registers on the
// baseline): every operation is lane-wise by definition, so the lane assignment, hence the
// sums, never depend on the instruction set.
constexpr std::size_t kWidth = 8;
constexpr std::size_t kVectors = kLanes / kWidth;
using Floats = float __attribute__((vector_size(kWidth * sizeof(float))));
using Ints = int32_t __attribute__((vector_size(kWidth * sizeof(int32_t))));
using Uints = uint32_t __attribute__((vector_size(kWidth * sizeof(uint32_t))));
using Halves = uint16_t __attribute__((vector_size(kWidth * sizeof(uint16_t))));

// Loads write through a reference: returning a 32-byte vector by value has an ISA-dependent ABI.
inline void load(const float *src, Floats &x) { std::memcpy(&x, src, sizeof x); }

inline void load(const detail::Bf16Bits *src, Floats &x) {
  Halves half;
  std::memcpy(&half, src, sizeof half);
  const Uints widened = __builtin_convertvector(half, Uints) << 16;
  std::memcpy(&x, &widened, sizeof x);
}

inline void load(const detail::Fp16Bits *src, Floats &x) {
  for (std::size_t j = 0; j < kWidth; ++j) x[j] = detail::to_float(src[j]);
}

struct Accumulators {
  Floats sum[kVectors] = {};
  Floats sum_sq[kVectors] = {};
  Floats max_abs[kVectors] = {};
  Ints nonfinite[kVectors] = {};

  void add(std::size_t k, const Floats &x) {
    Uints bits;
    std::memcpy(&bits, &x, sizeof bits);
    const Uints abs_bits = bits & detail::kAbsMask;
    const Ints finite = abs_bits < detail::kInfBits;  // -1 (true) or 0 per lane
    Floats a;
    std::memcpy(&a, &abs_bits, sizeof a);
    const Floats v = finite ? x : Floats{};
    const Floats finite_abs = finite ? a : Floats{};
    sum[k] += v;
    sum_sq[k] += v * v;
    max_abs[k] = max_abs[k] > finite_abs ? max_abs[k] : finite_abs;
    nonfinite[k] += finite + 1;  // 0 for finite, 1 for NaN / Inf
  }
};

template <typename In>
SP_SIMD_CLONES ChunkPartial chunk_moments(const In *src, std::size_t n) {
  Accumulators acc;
  const std::size_t full = n - n % kLanes;
  Floats x = {};
  for (std::size_t i = 0; i < full; i += kLanes) {
    for (std::size_t k = 0; k < kVectors; ++k) {
      load(src + i + k * kWidth, x);
      acc.add(k, x);
    }
  }
  if (full != n) {
    // The tail fills lanes 0.. with the remaining elements and zeros elsewhere.
    float tail[kLanes] = {};
    for (std::size_t i = full; i < n; ++i) tail[i - full] = detail::to_float(src[i]);
    for (std::size_t k = 0; k < kVectors; ++k) {
      load(tail + k * kWidth, x);
      acc.add(k, x);
    }
  }
  ChunkPartial partial;
  for (std::size_t lane = 0; lane < kLanes; ++lane) {
    const std::size_t k = lane / kWidth, j = lane % kWidth;
    partial.sum += acc.sum[k][j];
    partial.sum_sq += acc.sum_sq[k][j];
    partial.max_abs = std::max(partial.max_abs, acc.max_abs[k][j]);
    partial.nonfinite += static_cast<uint64_t>(acc.nonfinite[k][j]);
  }
  return partial;
}

void vectorized(const GradTensor *tensors, std::size_t n_tensors, uint32_t n_blocks, sp_grad_moments_v1 *out,
                const CpuExec &exec) {
  std::vector<ChunkRef> chunks;
  for (std::size_t t = 0; t < n_tensors; ++t) {
    for (std::size_t offset = 0; offset < tensors[t].count; offset += kGradMomentsChunk) {
      chunks.push_back(ChunkRef{t, offset});
    }
  }
  std::vector<ChunkPartial> partials(chunks.size());
  detail::parallel_ranges(chunks.size(), exec, kMinChunksPerThread, [&](std::size_t begin, std::size_t end) {
    for (std::size_t c = begin; c < end; ++c) {
      const GradTensor &tensor = tensors[chunks[c].tensor];
      const std::size_t n = std::min(kGradMomentsChunk, tensor.count - chunks[c].offset);
      partials[c] = detail::visit_elements(
          tensor.data, tensor.dtype, [&](const auto *typed) { return chunk_moments(typed + chunks[c].offset, n); });
    }
  });
  for (uint32_t b = 0; b < n_blocks; ++b) out[b] = sp_grad_moments_v1{b, 0, 0.0, 0.0, 0.0, 0, 0};
  for (std::size_t t = 0; t < n_tensors; ++t) out[tensors[t].block_id].count += tensors[t].count;
  for (std::size_t c = 0; c < chunks.size(); ++c) {
    sp_grad_moments_v1 &m = out[tensors[chunks[c].tensor].block_id];
    m.sum += partials[c].sum;
    m.sum_sq += partials[c].sum_sq;
    m.max_abs = std::max(m.max_abs, static_cast<double>(partials[c].max_abs));
    m.nonfinite += partials[c].nonfinite;
  }
}

}  // namespace

void grad_moments(const GradTensor *tensors, std::size_t n_tensors, uint32_t n_blocks, sp_grad_moments_v1 *out,
                  const CpuExec &exec) {
  if (n_tensors != 0 && tensors == nullptr) {
    throw std::invalid_argument("grad_moments: null tensor list with n_tensors = " + std::to_string(n_tensors));
  }
  if (n_blocks != 0 && out == nullptr) {
    throw std::invalid_argument("grad_moments: null output with n_blocks = " + std::to_string(n_blocks));
  }
  for (std::size_t t = 0; t < n_tensors; ++t) {
    const GradTensor &tensor = tensors[t];
    const std::string where = "grad_moments: tensor " + std::to_string(t);
    if (tensor.block_id >= n_blocks) {
      throw std::invalid_argument(where + ": block_id " + std::to_string(tensor.block_id) +
                                  " is not below n_blocks = " + std::to_string(n_blocks));
    }
    if (tensor.count != 0 && tensor.data == nullptr) {
      throw std::invalid_argument(where + ": null data with count = " + std::to_string(tensor.count));
    }
    if (tensor.dtype != DType::kFloat32 && tensor.dtype != DType::kBFloat16 && tensor.dtype != DType::kFloat16) {
      throw std::invalid_argument(where + ": unknown dtype value " + std::to_string(static_cast<int>(tensor.dtype)));
    }
  }
  if (exec.impl == CpuImpl::kReference) {
    reference::grad_moments(tensors, n_tensors, n_blocks, out);
  } else {
    vectorized(tensors, n_tensors, n_blocks, out, exec);
  }
}

}  // namespace sp::kernels
