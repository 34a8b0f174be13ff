// Fused per-block gradient moments on the CPU. The vectorized version cuts every tensor into
// chunks of kGradMomentsChunk elements, computes each chunk with 16 fp32 lanes (a fixed lane
// assignment, so SIMD width never changes the sums), and adds the chunk partials of each block
// in double, in chunk order, after all threads are done.
#include "sp/kernels/moments.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "elements.h"
#include "parallel.h"
#include "reference.h"

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

template <typename In>
ChunkPartial chunk_moments(const In *__restrict src, std::size_t n) {
  float sum[kLanes] = {};
  float sum_sq[kLanes] = {};
  float max_abs[kLanes] = {};
  uint32_t nonfinite[kLanes] = {};
  const auto accumulate = [&](std::size_t lane, float x) {
    const bool finite = (detail::float_bits(x) & detail::kInfBits) != detail::kInfBits;
    const float v = finite ? x : 0.0f;
    sum[lane] += v;
    sum_sq[lane] += v * v;
    const float a = std::fabs(v);
    max_abs[lane] = max_abs[lane] > a ? max_abs[lane] : a;
    nonfinite[lane] += finite ? 0u : 1u;
  };
  const std::size_t full = n - n % kLanes;
  for (std::size_t i = 0; i < full; i += kLanes) {
    for (std::size_t lane = 0; lane < kLanes; ++lane) accumulate(lane, detail::to_float(src[i + lane]));
  }
  for (std::size_t i = full; i < n; ++i) accumulate(i - full, detail::to_float(src[i]));
  ChunkPartial partial;
  for (std::size_t lane = 0; lane < kLanes; ++lane) {
    partial.sum += sum[lane];
    partial.sum_sq += sum_sq[lane];
    partial.max_abs = std::max(partial.max_abs, max_abs[lane]);
    partial.nonfinite += nonfinite[lane];
  }
  return partial;
}

void vectorized(const GradTensor *tensors, std::size_t n_tensors, uint32_t n_blocks,
                sp_grad_moments_v1 *out, const CpuExec &exec) {
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
      partials[c] = detail::visit_elements(tensor.data, tensor.dtype, [&](const auto *typed) {
        return chunk_moments(typed + chunks[c].offset, n);
      });
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

void grad_moments(const GradTensor *tensors, std::size_t n_tensors, uint32_t n_blocks,
                  sp_grad_moments_v1 *out, const CpuExec &exec) {
  if (n_tensors != 0 && tensors == nullptr) {
    throw std::invalid_argument("grad_moments: null tensor list with n_tensors = " +
                                std::to_string(n_tensors));
  }
  if (n_blocks != 0 && out == nullptr) {
    throw std::invalid_argument("grad_moments: null output with n_blocks = " +
                                std::to_string(n_blocks));
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
    if (tensor.dtype != DType::kFloat32 && tensor.dtype != DType::kBFloat16 &&
        tensor.dtype != DType::kFloat16) {
      throw std::invalid_argument(where + ": unknown dtype value " +
                                  std::to_string(static_cast<int>(tensor.dtype)));
    }
  }
  if (exec.impl == CpuImpl::kReference) {
    reference::grad_moments(tensors, n_tensors, n_blocks, out);
  } else {
    vectorized(tensors, n_tensors, n_blocks, out, exec);
  }
}

}  // namespace sp::kernels
