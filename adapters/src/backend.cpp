#include "sp/adapters/backend.h"

#include <utility>

namespace sp::adapters {

const char *queue_name(Queue queue) {
  switch (queue) {
    case Queue::copy:
      return "copy";
    case Queue::dequant:
      return "dequant";
    case Queue::compute:
      return "compute";
  }
  return "unknown";
}

Region::Region(std::byte *data, std::size_t bytes, Deleter deleter)
    : data_(data), bytes_(bytes), deleter_(std::move(deleter)) {}

Region::Region(Region &&other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      deleter_(std::move(other.deleter_)) {}

Region &Region::operator=(Region &&other) noexcept {
  if (this != &other) {
    free_now();
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    deleter_ = std::move(other.deleter_);
  }
  return *this;
}

Region::~Region() { free_now(); }

void Region::free_now() noexcept {
  if (data_ != nullptr && deleter_) {
    deleter_(data_);
  }
  data_ = nullptr;
  bytes_ = 0;
}

}  // namespace sp::adapters
