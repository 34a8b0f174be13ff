// What the data path moves: a block's tensors, its transfer image in pinned memory, and the
// dequantization work that turns a staged INT8 or NF4 image into bf16 compute weights.
//
// The image format is the kernels' slab (sp/kernels/slab.h). The compute weights in a device
// slot always use the offsets of the block's BF16 image, whichever route the block took, so
// the views handed to the trainer do not depend on the precision.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

// The transfer routes are sp::Precision; the quantized ones (is_quantized) go through the
// staging region and the dequant queue.
#include "sp/precision.h"

namespace sp::adapters {

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

// Dequantization of one tensor of a staged quantized image. Every pointer is in device memory,
// and what the codes and scales hold depends on the job's precision:
//   int8: one std::int8_t code per element; fp32 scales (sp/kernels/quantize.h)
//   nf4:  two codes per byte, sp::kernels::nf4_code_bytes(rows, cols) bytes; bf16 scales as
//         std::uint16_t bit patterns (sp/kernels/nf4.h)
struct DequantTensor {
  const void *codes = nullptr;
  const void *scales = nullptr;
  std::uint64_t rows = 0;
  std::uint64_t cols = 0;
  std::uint16_t *bf16_out = nullptr;
};

// All tensors of one block, one precision and one group size: for int8 as in
// sp::kernels::QuantizeOptions (0 = per row), for nf4 32, 64, 128 or 256. A backend
// dequantizes every tensor in order on its dequant queue.
struct DequantJob {
  std::uint32_t group_size = 0;
  std::vector<DequantTensor> tensors;
  Precision precision = Precision::int8;  // a quantized route
};

// One slab format's dequantization on one backend: a tensor of a job into bf16, on whatever queue
// `context` names (the backend's stream, or nothing). Each backend keeps one per quantized format
// in a DequantCodecs table indexed by the slab code (sp::kernels::SlabPrecision) that a route's
// row names, as ggml keeps type_traits_cpu beside type_traits: routes over one format share its
// codec, and no backend switches on the route.
using DequantFn = void (*)(const DequantTensor &tensor, std::uint32_t group_size, void *context);
struct DequantCodecs {
  std::array<DequantFn, 8> by_slab_code{};

  constexpr DequantFn &operator[](std::uint32_t slab_code) { return by_slab_code.at(slab_code); }
  // The codec of `route`'s slab format; nullptr for none.
  constexpr DequantFn of(Precision route) const {
    const std::uint32_t code = route_traits(route).slab_code;
    return code < by_slab_code.size() ? by_slab_code[code] : nullptr;
  }
};

// Runs the codec of the job's route's format over its tensors in order. Throws
// std::invalid_argument for a route the table has no codec for (BF16 needs none).
inline void dequantize_job(const DequantJob &job, const DequantCodecs &codecs, void *context) {
  const DequantFn codec = codecs.of(job.precision);
  if (codec == nullptr) {
    throw std::invalid_argument(std::string("DequantJob: no dequantization for a ") + precision_name(job.precision) +
                                " image");
  }
  for (const DequantTensor &tensor : job.tensors) codec(tensor, job.group_size, context);
}

}  // namespace sp::adapters
