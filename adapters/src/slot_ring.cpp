#include "sp/adapters/slot_ring.h"

#include <stdexcept>

namespace sp::adapters {
namespace {
constexpr std::uint64_t kSlotAlignment = 256;  // slab payloads are 256-aligned within an image

std::uint64_t aligned(std::uint64_t bytes) {
  return (bytes + kSlotAlignment - 1) / kSlotAlignment * kSlotAlignment;
}
}  // namespace

DeviceSlotRing::DeviceSlotRing(TransferBackend &backend, std::uint64_t compute_bytes,
                               std::uint64_t staging_bytes, std::uint32_t slot_count)
    : compute_bytes_(compute_bytes), staging_bytes_(staging_bytes) {
  if (compute_bytes == 0) {
    throw std::invalid_argument("DeviceSlotRing: the slot size must be > 0");
  }
  if (slot_count == 0) {
    throw std::invalid_argument("DeviceSlotRing: the slot count must be > 0");
  }
  const std::uint64_t stride = aligned(compute_bytes) + aligned(staging_bytes);
  memory_ = backend.allocate_device(stride * slot_count);
  slots_.reserve(slot_count);
  for (std::uint32_t i = 0; i < slot_count; ++i) {
    std::byte *base = memory_.data() + i * stride;
    slots_.push_back(DeviceSlot{base, base + aligned(compute_bytes), backend.create_event()});
  }
}

}  // namespace sp::adapters
