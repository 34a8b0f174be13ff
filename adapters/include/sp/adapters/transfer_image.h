// What the data path moves: a block's tensors, its transfer image in pinned memory, and the
// dequantization work that turns a staged INT8 image into bf16 compute weights.
//
// The image format is the kernels' slab (sp/kernels/slab.h). The compute weights in a device
// slot always use the offsets of the block's BF16 image, whichever route the block took, so
// the views handed to the trainer do not depend on the precision.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace sp::adapters {

enum class Precision : std::uint8_t { bf16, int8 };

const char *precision_name(Precision precision);

// One fp32 master tensor of a block, owned by the trainer. The engine reads it when it
// builds the block's transfer image (at startup, after on_weights_updated(), and before the
// first fetch after a precision switch); it must stay valid for the engine's lifetime.
struct TensorSpec {
  std::string name;
  const float *master = nullptr;
  std::uint64_t rows = 0;  // row-major rows x cols; a 1-D tensor of n elements is 1 x n
  std::uint64_t cols = 0;
};

// One streamed block: all tensors that share its precision, in the order the trainer expects.
struct BlockSpec {
  std::string name;
  std::vector<TensorSpec> tensors;
};

// Dequantization of one tensor of a staged INT8 image. Every pointer is in device memory.
struct DequantTensor {
  const std::int8_t *codes = nullptr;
  const float *scales = nullptr;
  std::uint64_t rows = 0;
  std::uint64_t cols = 0;
  std::uint16_t *bf16_out = nullptr;
};

// All tensors of one block; group_size as in sp::kernels::QuantizeOptions (0 = per row).
struct DequantJob {
  std::uint32_t group_size = 0;
  std::vector<DequantTensor> tensors;
};

}  // namespace sp::adapters
