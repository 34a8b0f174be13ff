// Fused per-block gradient moments on the GPU, in the style of apex multi_tensor_apply:
// every tensor of every block is cut into chunks of kGradMomentsChunk elements; ONE launch
// covers all chunks and writes one partial per chunk into the workspace (fp32 per thread,
// double per chunk); a cleanup kernel then reduces the chunks of each block in a fixed
// order, in double. No atomics: the result is bit-identical run after run.
//
// Usage:
//   GradMomentsPlan plan(tensors, n_tensors, n_blocks);     // host only, once per model
//   cudaMalloc(&workspace, plan.workspace_bytes());
//   plan.upload(workspace, stream);                          // once; synchronizes `stream`
//   every step: plan.launch(workspace, moments_device, stream);
//               cudaMemcpyAsync(host_pinned, moments_device, n_blocks * sizeof(...), D2H, stream);
// launch() enqueues two kernels and nothing else: no host sync, no allocation, no copy.
// The gradient buffers named in the plan must stay at the same addresses.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "sp/kernels/moments.h"

namespace sp::kernels::cuda {

class GradMomentsPlan {
 public:
  // Validates the tensors (device pointers; dtype fp32, bf16 or fp16; block_id < n_blocks)
  // and lays out the chunks. Touches no GPU. Throws std::invalid_argument on bad input.
  GradMomentsPlan(const GradTensor *tensors, std::size_t n_tensors, uint32_t n_blocks);

  // Device bytes the caller allocates for the tensor table and the per-chunk partials.
  std::size_t workspace_bytes() const;

  // Copies the tensor table into `workspace` and waits for the copy. Setup time only.
  void upload(void *workspace, cudaStream_t stream) const;

  // Enqueues the chunk kernel and the cleanup kernel on `stream`. out_device receives
  // n_blocks() entries of sp_grad_moments_v1, with the meaning of sp::kernels::grad_moments.
  void launch(void *workspace, sp_grad_moments_v1 *out_device, cudaStream_t stream) const;

  uint32_t n_blocks() const { return n_blocks_; }
  std::size_t n_chunks() const { return n_chunks_; }

  // Device-side table layout; public so the kernels in the .cu file can read it.
  struct TensorEntry {
    const void *data;
    uint64_t count;
    uint64_t first_chunk;  // global index of the tensor's first chunk
    uint32_t dtype;        // DType
    uint32_t block_id;
  };
  struct BlockEntry {
    uint64_t first_chunk;  // chunks of a block are contiguous: tensors are sorted by block
    uint64_t end_chunk;
    uint64_t count;
  };

 private:
  uint32_t n_blocks_ = 0;
  std::size_t n_chunks_ = 0;
  std::vector<TensorEntry> tensor_table_;  // sorted by block id, then by input order
  std::vector<BlockEntry> block_table_;
};

}  // namespace sp::kernels::cuda
