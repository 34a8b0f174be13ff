// The device slots a block's weights land in, one allocation made at startup.
//
// Each slot has a compute region, where the trainer's bf16 views point, and a staging region
// for INT8 or NF4 images waiting for their dequantization. Its release event is recorded on the
// compute queue after the slot's last use; the next copy into the slot waits for it on the
// device, so reusing a slot never blocks the host.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "sp/adapters/backend.h"

namespace sp::adapters {

struct DeviceSlot {
  std::byte *compute = nullptr;
  std::byte *staging = nullptr;
  std::unique_ptr<Event> released;
};

class DeviceSlotRing {
 public:
  // Throws std::invalid_argument for a zero compute size or count.
  DeviceSlotRing(TransferBackend &backend, std::uint64_t compute_bytes, std::uint64_t staging_bytes,
                 std::uint32_t slot_count);

  std::uint32_t size() const { return static_cast<std::uint32_t>(slots_.size()); }
  std::uint64_t compute_bytes() const { return compute_bytes_; }
  std::uint64_t staging_bytes() const { return staging_bytes_; }
  DeviceSlot &slot(std::uint32_t index) { return slots_.at(index); }

 private:
  std::uint64_t compute_bytes_;
  std::uint64_t staging_bytes_;
  Region memory_;
  std::vector<DeviceSlot> slots_;
};

}  // namespace sp::adapters
