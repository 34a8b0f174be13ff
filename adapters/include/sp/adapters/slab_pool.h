// Fixed pool of equally sized pinned host slabs, one allocation made at startup.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "sp/adapters/backend.h"

namespace sp::adapters {

class PinnedSlabPool {
 public:
  // Throws std::invalid_argument for a zero size or count.
  PinnedSlabPool(TransferBackend &backend, std::uint64_t slab_bytes, std::uint32_t slab_count);

  std::uint64_t slab_bytes() const { return slab_bytes_; }
  std::uint32_t capacity() const { return static_cast<std::uint32_t>(in_use_.size()); }
  std::uint32_t in_use() const { return in_use_count_; }
  std::uint32_t peak_in_use() const { return peak_in_use_; }
  void reset_peak() { peak_in_use_ = in_use_count_; }

  std::optional<std::uint32_t> try_acquire();
  // Throws std::runtime_error naming `requester` when every slab is in use.
  std::uint32_t acquire(const std::string &requester);
  void release(std::uint32_t slab);
  std::byte *data(std::uint32_t slab) const;

 private:
  std::uint64_t slab_bytes_;
  std::uint64_t stride_;  // slab_bytes_ rounded up so that every slab starts image-aligned
  Region memory_;
  std::vector<bool> in_use_;
  std::vector<std::uint32_t> free_;
  std::uint32_t in_use_count_ = 0;
  std::uint32_t peak_in_use_ = 0;
};

}  // namespace sp::adapters
