// The part of building a slab that does not depend on where the tensors' values come from:
// checks, header, tensor table and zero gaps. build_slab() (from fp32 masters) and
// adamw_update_slab() (from masters it updates on the way) then fill the payloads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "sp/kernels/slab.h"

namespace sp::kernels::detail {

// Where one tensor's payload and scales go in the image being built.
struct SlabTensorTarget {
  TensorShape shape;
  uint8_t *data = nullptr;
  uint8_t *scales = nullptr;  // fp32 scales, or bf16 bit patterns for kNf4; none for kBf16
  uint64_t seed = 0;          // the tensor's stochastic-rounding seed (derive_seed)
};

struct SlabLayout {
  uint64_t total_bytes = 0;
  std::vector<SlabTensorTarget> tensors;
};

// Validates the encoding, the shapes' sizes, the capacity and the image's alignment, naming
// `function` in the std::invalid_argument it throws; nothing is written before every check
// passed. Then writes the header, the table and the zero padding, and returns the image size
// and one target per tensor (payloads and scales are left for the caller to fill in full).
SlabLayout lay_out_slab(const SlabEncoding &encoding, const TensorShape *shapes, std::size_t n_tensors,
                        uint8_t *image, uint64_t capacity, const char *function);

}  // namespace sp::kernels::detail
