// The slab encoding of a route's transfer image: the one translation from a route (and its
// group size) to the kernels' image format, used by the streaming engine and by whoever builds
// the same images outside it (the Python module's adamw_step_).
#pragma once

#include <cstdint>

#include "sp/adapters/transfer_image.h"
#include "sp/kernels/slab.h"

namespace sp::adapters {

// BF16 has no group size; INT8 and NF4 take `group_size` (INT8: 0 = one scale per row, else
// 32..256; NF4: 32..256), checked where the encoding is used (sp/kernels/slab.h).
sp::kernels::SlabEncoding slab_encoding(Precision precision, std::uint32_t group_size);

}  // namespace sp::adapters
