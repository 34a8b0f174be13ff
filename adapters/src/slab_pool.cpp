#include "sp/adapters/slab_pool.h"

#include <stdexcept>

#include <fmt/format.h>

#include "image_alignment.h"

namespace sp::adapters {

PinnedSlabPool::PinnedSlabPool(TransferBackend &backend, std::uint64_t slab_bytes, std::uint32_t slab_count)
    : slab_bytes_(slab_bytes), stride_(image_stride(slab_bytes)) {
  if (slab_bytes == 0) {
    throw std::invalid_argument("PinnedSlabPool: the slab size must be > 0");
  }
  if (slab_count == 0) {
    throw std::invalid_argument("PinnedSlabPool: the slab count must be > 0");
  }
  memory_ = backend.allocate_pinned_host(stride_ * slab_count);
  in_use_.assign(slab_count, false);
  free_.reserve(slab_count);
  for (std::uint32_t slab = slab_count; slab-- > 0;) {
    free_.push_back(slab);
  }
}

std::optional<std::uint32_t> PinnedSlabPool::try_acquire() {
  if (free_.empty()) {
    return std::nullopt;
  }
  const std::uint32_t slab = free_.back();
  free_.pop_back();
  in_use_[slab] = true;
  ++in_use_count_;
  peak_in_use_ = std::max(peak_in_use_, in_use_count_);
  return slab;
}

std::uint32_t PinnedSlabPool::acquire(const std::string &requester) {
  if (auto slab = try_acquire()) {
    return *slab;
  }
  throw std::runtime_error(
      fmt::format("pinned slab pool exhausted: {} needs a slab but all {} slabs of {} bytes are in use", requester,
                  capacity(), slab_bytes_));
}

void PinnedSlabPool::release(std::uint32_t slab) {
  if (slab >= in_use_.size() || !in_use_[slab]) {
    throw std::logic_error(fmt::format("PinnedSlabPool: slab {} is not in use", slab));
  }
  in_use_[slab] = false;
  --in_use_count_;
  free_.push_back(slab);
}

std::byte *PinnedSlabPool::data(std::uint32_t slab) const {
  if (slab >= in_use_.size()) {
    throw std::out_of_range(fmt::format("PinnedSlabPool: no slab {}", slab));
  }
  return memory_.data() + static_cast<std::size_t>(slab) * stride_;
}

}  // namespace sp::adapters
