#include "sp/policy/state.h"

#include <cassert>

namespace sp::policy {

SampleWindows::SampleWindows(std::uint32_t n_blocks, std::uint32_t capacity)
    : capacity_(capacity),
      samples_(static_cast<std::size_t>(n_blocks) * capacity),
      oldest_(n_blocks, 0),
      sizes_(n_blocks, 0) {}

void SampleWindows::push(std::uint32_t block, const GradSample &sample) {
  const std::size_t base = static_cast<std::size_t>(block) * capacity_;
  if (sizes_[block] < capacity_) {
    samples_[base + (oldest_[block] + sizes_[block]) % capacity_] = sample;
    ++sizes_[block];
  } else {
    samples_[base + oldest_[block]] = sample;
    oldest_[block] = (oldest_[block] + 1) % capacity_;
  }
}

const GradSample &SampleWindows::at(std::uint32_t block, std::uint32_t i) const {
  assert(i < sizes_[block]);
  return samples_[static_cast<std::size_t>(block) * capacity_ + (oldest_[block] + i) % capacity_];
}

}  // namespace sp::policy
