#include "sp/adapters/slot_ring.h"

#include <stdexcept>

#include "image_alignment.h"

namespace sp::adapters {

DeviceSlotRing::DeviceSlotRing(TransferBackend &backend, std::uint64_t compute_bytes, std::uint64_t staging_bytes,
                               std::uint32_t slot_count)
    : compute_bytes_(compute_bytes), staging_bytes_(staging_bytes) {
  if (compute_bytes == 0) {
    throw std::invalid_argument("DeviceSlotRing: the slot size must be > 0");
  }
  if (slot_count == 0) {
    throw std::invalid_argument("DeviceSlotRing: the slot count must be > 0");
  }
  const std::uint64_t stride = image_stride(compute_bytes) + image_stride(staging_bytes);
  memory_ = backend.allocate_device(stride * slot_count);
  slots_.reserve(slot_count);
  for (std::uint32_t i = 0; i < slot_count; ++i) {
    std::byte *base = memory_.data() + i * stride;
    slots_.push_back(DeviceSlot{base, base + image_stride(compute_bytes), backend.create_event()});
  }
}

}  // namespace sp::adapters
