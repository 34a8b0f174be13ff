// Fused per-block gradient moments over many tensors (CPU). The CUDA version is
// sp/kernels/cuda/moments.h; both fill the plugin ABI's sp_grad_moments_v1 directly.
#pragma once

#include <cstddef>
#include <cstdint>

#include "sp/kernels/dtype.h"
#include "sp/plugin_abi_v1.h"

namespace sp::kernels {

// One gradient tensor of one block. `data` holds `count` elements of `dtype`
// (fp32, bf16 or fp16).
struct GradTensor {
  const void *data = nullptr;
  std::size_t count = 0;
  DType dtype = DType::kFloat32;
  uint32_t block_id = 0;
};

// out[b] for b in [0, n_blocks) receives the moments of all tensors tagged with block b:
// block_id = b, sum_sq / sum / max_abs over finite elements, count = all elements,
// nonfinite = NaN and +-Inf elements. A block without tensors gets count 0 and zero moments.
// Several tensors may share a block id, in any order.
//
// kReference accumulates in double, element by element. kVectorized accumulates in fp32
// within fixed chunks of kGradMomentsChunk elements and in double across chunks, in chunk
// order, so its result is bit-identical for any thread count.
// Throws std::invalid_argument for a block id >= n_blocks, a null pointer with a non-zero
// count, or a null `out` with n_blocks > 0.
void grad_moments(const GradTensor *tensors, std::size_t n_tensors, uint32_t n_blocks, sp_grad_moments_v1 *out,
                  const CpuExec &exec = {});

constexpr std::size_t kGradMomentsChunk = 16384;

}  // namespace sp::kernels
