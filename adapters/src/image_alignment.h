// Where transfer images may start in a pinned slab pool or a device slot ring.
#pragma once

#include <cstdint>

#include "sp/kernels/slab.h"

namespace sp::adapters {

// Image payloads are 256-aligned relative to the image start, so each image must itself start
// on such a boundary: pools and rings lay theirs out at strides rounded up to it.
inline std::uint64_t image_stride(std::uint64_t bytes) {
  constexpr std::uint64_t alignment = sp::kernels::kSlabDataAlignment;
  return (bytes + alignment - 1) / alignment * alignment;
}

}  // namespace sp::adapters
