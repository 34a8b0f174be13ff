// Launch arithmetic of the CUDA grid-stride loops, in plain C++ so the CPU tests can check it
// (kernels/tests/grid_stride_test.cpp). No CUDA here.
#pragma once

#include <cstdint>
#include <limits>

namespace sp::kernels::detail {

// Blocks for `items` work items at `per_block` items per block, at least 1, at most 2^31 - 1.
inline unsigned grid_for(uint64_t items, unsigned per_block) {
  const uint64_t blocks = (items + per_block - 1) / per_block;
  return static_cast<unsigned>(blocks < 0x7FFFFFFFull ? (blocks == 0 ? 1 : blocks) : 0x7FFFFFFFull);
}

// Whether the loop
//   for (Index i = first; i < items; i += stride)   // first < stride = grid * threads
// runs without wrapping Index. Its largest value is the last index below `items` plus the
// stride, items - 1 + stride, so that must fit: items < 2^32 alone is not enough (with the
// scalar kernels' stride of about items / 4, items above ~3.4e9 wrapped to small indices and
// rewrote elements).
template <typename Index>
constexpr bool grid_stride_fits(uint64_t items, unsigned grid, unsigned threads) {
  constexpr uint64_t kMax = std::numeric_limits<Index>::max();
  const uint64_t stride = static_cast<uint64_t>(grid) * threads;  // < 2^63
  if (stride == 0 || stride > kMax) return false;
  return items == 0 || items - 1 <= kMax - stride;
}

// Whether a dequantize or quantize launch may use 32-bit indices: every element index
// (`elements`), every scale index (`segments`) and the grid-stride loop over `loop_items`
// (elements, bytes or 16/32-element vectors) fit in uint32_t.
inline bool uint32_indices_fit(uint64_t elements, uint64_t segments, uint64_t loop_items, unsigned grid,
                               unsigned threads) {
  return elements <= std::numeric_limits<uint32_t>::max() && segments <= std::numeric_limits<uint32_t>::max() &&
         grid_stride_fits<uint32_t>(loop_items, grid, threads);
}

}  // namespace sp::kernels::detail
