// Gradient moments, apex multi_tensor_apply style. Chunk kernel: one CUDA block per chunk of
// kGradMomentsChunk elements; each thread accumulates in fp32 over a fixed set of elements;
// the block combines its threads in a fixed tree, in double, and writes one partial per chunk.
// Cleanup kernel: one CUDA block per model block walks that block's contiguous chunk range
// with a fixed thread assignment and tree. No atomics anywhere, so results are bit-identical
// run after run.
#include "sp/kernels/cuda/moments.h"

#include <algorithm>
#include <numeric>
#include <string>

#include "common.cuh"

namespace sp::kernels::cuda {
namespace {

constexpr unsigned kChunkThreads = 256;
constexpr unsigned kCleanupThreads = 256;
constexpr std::size_t kTableAlignment = 256;

struct ChunkPartial {
  double sum;
  double sum_sq;
  float max_abs;
  uint32_t nonfinite;
};

struct ThreadMoments {
  float sum = 0.0f;
  float sum_sq = 0.0f;
  float max_abs = 0.0f;
  uint32_t nonfinite = 0;

  __device__ __forceinline__ void add(float x) {
    const bool finite = (kernels::detail::float_bits(x) & kernels::detail::kInfBits) != kernels::detail::kInfBits;
    const float v = finite ? x : 0.0f;
    sum += v;
    sum_sq += v * v;
    max_abs = fmaxf(max_abs, fabsf(v));
    nonfinite += finite ? 0u : 1u;
  }
};

std::size_t align_up(std::size_t value) { return (value + kTableAlignment - 1) / kTableAlignment * kTableAlignment; }

struct WorkspaceLayout {
  std::size_t tensors_offset;
  std::size_t blocks_offset;
  std::size_t partials_offset;
  std::size_t total;
};

WorkspaceLayout layout_for(std::size_t n_tensors, std::size_t n_blocks, std::size_t n_chunks) {
  WorkspaceLayout layout{};
  layout.tensors_offset = 0;
  layout.blocks_offset = align_up(n_tensors * sizeof(GradMomentsPlan::TensorEntry));
  layout.partials_offset = layout.blocks_offset + align_up(n_blocks * sizeof(GradMomentsPlan::BlockEntry));
  layout.total = layout.partials_offset + align_up(n_chunks * sizeof(ChunkPartial));
  return layout;
}

// Block-wide reduction in double (sums) and fp32 (max) with a fixed tree; result in thread 0.
template <unsigned kThreads>
__device__ void block_reduce(double &sum, double &sum_sq, float &max_abs, unsigned long long &nonfinite) {
  __shared__ double shared_sum[kThreads / 32];
  __shared__ double shared_sq[kThreads / 32];
  __shared__ float shared_max[kThreads / 32];
  __shared__ unsigned long long shared_bad[kThreads / 32];
  sum = detail::warp_sum(sum);
  sum_sq = detail::warp_sum(sum_sq);
  max_abs = detail::warp_max(max_abs);
  nonfinite = detail::warp_sum(nonfinite);
  const unsigned warp = threadIdx.x / 32;
  const unsigned lane = threadIdx.x % 32;
  if (lane == 0) {
    shared_sum[warp] = sum;
    shared_sq[warp] = sum_sq;
    shared_max[warp] = max_abs;
    shared_bad[warp] = nonfinite;
  }
  __syncthreads();
  if (warp == 0) {
    const bool present = lane < kThreads / 32;
    sum = present ? shared_sum[lane] : 0.0;
    sum_sq = present ? shared_sq[lane] : 0.0;
    max_abs = present ? shared_max[lane] : 0.0f;
    nonfinite = present ? shared_bad[lane] : 0ull;
    sum = detail::warp_sum(sum);
    sum_sq = detail::warp_sum(sum_sq);
    max_abs = detail::warp_max(max_abs);
    nonfinite = detail::warp_sum(nonfinite);
  }
}

template <typename Word, int kPerWord>
__device__ __forceinline__ void add_word(ThreadMoments &m, const Word &word, uint32_t dtype) {
  const uint32_t *parts = reinterpret_cast<const uint32_t *>(&word);
#pragma unroll
  for (int k = 0; k < static_cast<int>(sizeof(Word) / 4); ++k) {
    if (kPerWord == 4) {
      m.add(kernels::detail::bits_float(parts[k]));
    } else {
      const uint16_t lo = static_cast<uint16_t>(parts[k]);
      const uint16_t hi = static_cast<uint16_t>(parts[k] >> 16);
      if (dtype == static_cast<uint32_t>(DType::kBFloat16)) {
        m.add(kernels::detail::bf16_bits_to_float(lo));
        m.add(kernels::detail::bf16_bits_to_float(hi));
      } else {
        m.add(kernels::detail::fp16_bits_to_float(lo));
        m.add(kernels::detail::fp16_bits_to_float(hi));
      }
    }
  }
}

__global__ void __launch_bounds__(kChunkThreads)
    chunk_kernel(const GradMomentsPlan::TensorEntry *tensors, uint32_t n_tensors, ChunkPartial *partials) {
  __shared__ uint32_t tensor_index;
  const uint64_t chunk = blockIdx.x;
  if (threadIdx.x == 0) {
    // Last tensor whose first chunk is <= this chunk (tensors are sorted by first_chunk;
    // empty tensors share their successor's first_chunk and are skipped by taking the last).
    uint32_t lo = 0, hi = n_tensors;
    while (hi - lo > 1) {
      const uint32_t mid = (lo + hi) / 2;
      if (tensors[mid].first_chunk <= chunk)
        lo = mid;
      else
        hi = mid;
    }
    tensor_index = lo;
  }
  __syncthreads();
  const GradMomentsPlan::TensorEntry tensor = tensors[tensor_index];
  const uint64_t begin = (chunk - tensor.first_chunk) * kGradMomentsChunk;
  const uint64_t end = min(tensor.count, begin + kGradMomentsChunk);
  const uint32_t element_bytes = tensor.dtype == static_cast<uint32_t>(DType::kFloat32) ? 4 : 2;
  ThreadMoments m;
  uint64_t scalar_from = begin;
  // Chunk starts are multiples of kGradMomentsChunk elements, so a 16-byte aligned tensor has
  // 16-byte aligned chunks; a misaligned one takes the scalar loop below.
  if (reinterpret_cast<uintptr_t>(tensor.data) % 16 == 0) {
    const uint32_t per_vector = 16 / element_bytes;
    const uint64_t vectors = (end - begin) / per_vector;
    const uint4 *base =
        reinterpret_cast<const uint4 *>(static_cast<const uint8_t *>(tensor.data) + begin * element_bytes);
    for (uint64_t v = threadIdx.x; v < vectors; v += kChunkThreads) {
      const uint4 word = __ldg(base + v);
      if (element_bytes == 4) {
        add_word<uint4, 4>(m, word, tensor.dtype);
      } else {
        add_word<uint4, 2>(m, word, tensor.dtype);
      }
    }
    scalar_from = begin + vectors * per_vector;
  }
  for (uint64_t i = scalar_from + threadIdx.x; i < end; i += kChunkThreads) {
    m.add(detail::load_element(tensor.data, tensor.dtype, i));
  }
  double sum = m.sum;
  double sum_sq = m.sum_sq;
  float max_abs = m.max_abs;
  unsigned long long nonfinite = m.nonfinite;
  block_reduce<kChunkThreads>(sum, sum_sq, max_abs, nonfinite);
  if (threadIdx.x == 0) {
    partials[chunk] = ChunkPartial{sum, sum_sq, max_abs, static_cast<uint32_t>(nonfinite)};
  }
}

__global__ void __launch_bounds__(kCleanupThreads)
    cleanup_kernel(const GradMomentsPlan::BlockEntry *blocks, const ChunkPartial *partials, sp_grad_moments_v1 *out) {
  const uint32_t block_id = blockIdx.x;
  const GradMomentsPlan::BlockEntry block = blocks[block_id];
  double sum = 0.0;
  double sum_sq = 0.0;
  float max_abs = 0.0f;
  unsigned long long nonfinite = 0;
  for (uint64_t c = block.first_chunk + threadIdx.x; c < block.end_chunk; c += kCleanupThreads) {
    const ChunkPartial p = partials[c];
    sum += p.sum;
    sum_sq += p.sum_sq;
    max_abs = fmaxf(max_abs, p.max_abs);
    nonfinite += p.nonfinite;
  }
  block_reduce<kCleanupThreads>(sum, sum_sq, max_abs, nonfinite);
  if (threadIdx.x == 0) {
    out[block_id] = sp_grad_moments_v1{block_id, 0, sum_sq, sum, static_cast<double>(max_abs), block.count, nonfinite};
  }
}

}  // namespace

GradMomentsPlan::GradMomentsPlan(const GradTensor *tensors, std::size_t n_tensors, uint32_t n_blocks)
    : n_blocks_(n_blocks) {
  detail::require(n_tensors == 0 || tensors != nullptr, "GradMomentsPlan: null tensor list");
  detail::require(n_tensors < 0xFFFFFFFFull, "GradMomentsPlan: too many tensors");
  std::vector<std::size_t> order(n_tensors);
  std::iota(order.begin(), order.end(), std::size_t{0});
  for (std::size_t t = 0; t < n_tensors; ++t) {
    const GradTensor &tensor = tensors[t];
    const std::string where = "GradMomentsPlan: tensor " + std::to_string(t);
    detail::require(tensor.block_id < n_blocks, where + ": block_id " + std::to_string(tensor.block_id) +
                                                    " is not below n_blocks = " + std::to_string(n_blocks));
    detail::require(tensor.count == 0 || tensor.data != nullptr,
                    where + ": null data with count = " + std::to_string(tensor.count));
    detail::require(
        tensor.dtype == DType::kFloat32 || tensor.dtype == DType::kBFloat16 || tensor.dtype == DType::kFloat16,
        where + ": unknown dtype value " + std::to_string(static_cast<int>(tensor.dtype)));
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return tensors[a].block_id < tensors[b].block_id; });
  block_table_.assign(n_blocks, BlockEntry{0, 0, 0});
  uint64_t next_chunk = 0;
  for (const std::size_t t : order) {
    const GradTensor &tensor = tensors[t];
    const uint64_t chunks = (tensor.count + kGradMomentsChunk - 1) / kGradMomentsChunk;
    tensor_table_.push_back(
        TensorEntry{tensor.data, tensor.count, next_chunk, static_cast<uint32_t>(tensor.dtype), tensor.block_id});
    BlockEntry &block = block_table_[tensor.block_id];
    block.count += tensor.count;
    block.end_chunk = next_chunk + chunks;
    next_chunk += chunks;
  }
  // Blocks are contiguous in chunk order; a block's range starts where the previous ends.
  uint64_t start = 0;
  for (BlockEntry &block : block_table_) {
    block.first_chunk = start;
    block.end_chunk = std::max(block.end_chunk, start);
    start = block.end_chunk;
  }
  n_chunks_ = next_chunk;
  detail::require(n_chunks_ < 0x7FFFFFFFull, "GradMomentsPlan: more than 2^31 - 1 chunks");
}

std::size_t GradMomentsPlan::workspace_bytes() const {
  return layout_for(tensor_table_.size(), block_table_.size(), n_chunks_).total;
}

void GradMomentsPlan::upload(void *workspace, cudaStream_t stream) const {
  detail::require(workspace != nullptr || workspace_bytes() == 0, "GradMomentsPlan::upload: null workspace");
  const WorkspaceLayout layout = layout_for(tensor_table_.size(), block_table_.size(), n_chunks_);
  auto *base = static_cast<uint8_t *>(workspace);
  const auto copy = [&](std::size_t offset, const void *src, std::size_t bytes) {
    if (bytes == 0) return;
    check(cudaMemcpyAsync(base + offset, src, bytes, cudaMemcpyHostToDevice, stream),
          "cudaMemcpyAsync (GradMomentsPlan::upload)");
  };
  copy(layout.tensors_offset, tensor_table_.data(), tensor_table_.size() * sizeof(TensorEntry));
  copy(layout.blocks_offset, block_table_.data(), block_table_.size() * sizeof(BlockEntry));
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize (GradMomentsPlan::upload)");
}

void GradMomentsPlan::launch(void *workspace, sp_grad_moments_v1 *out_device, cudaStream_t stream) const {
  if (n_blocks_ == 0) return;
  detail::require(workspace != nullptr && out_device != nullptr, "GradMomentsPlan::launch: null workspace or output");
  const WorkspaceLayout layout = layout_for(tensor_table_.size(), block_table_.size(), n_chunks_);
  auto *base = static_cast<uint8_t *>(workspace);
  auto *partials = reinterpret_cast<ChunkPartial *>(base + layout.partials_offset);
  if (n_chunks_ != 0) {
    chunk_kernel<<<static_cast<unsigned>(n_chunks_), kChunkThreads, 0, stream>>>(
        reinterpret_cast<const TensorEntry *>(base + layout.tensors_offset),
        static_cast<uint32_t>(tensor_table_.size()), partials);
    check_launch("GradMomentsPlan::launch (chunk kernel)");
  }
  cleanup_kernel<<<n_blocks_, kCleanupThreads, 0, stream>>>(
      reinterpret_cast<const BlockEntry *>(base + layout.blocks_offset), partials, out_device);
  check_launch("GradMomentsPlan::launch (cleanup kernel)");
}

}  // namespace sp::kernels::cuda
