// The little-endian writer and the bounds-checked reader of the state blob's payloads, shared by
// the state codec and the decision rules that keep a section of their own (decision_rule.h).
#pragma once

#include "sp/policy/errors.h"

#include <fmt/format.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

namespace sp::policy {

class Writer {
 public:
  void bytes(const void *data, std::size_t size) {
    const auto *p = static_cast<const std::uint8_t *>(data);
    out_.insert(out_.end(), p, p + size);
  }
  void u8(std::uint8_t value) { out_.push_back(value); }
  void u32(std::uint32_t value) {
    for (int i = 0; i < 4; ++i) out_.push_back(static_cast<std::uint8_t>(value >> (8 * i)));
  }
  void u64(std::uint64_t value) {
    for (int i = 0; i < 8; ++i) out_.push_back(static_cast<std::uint8_t>(value >> (8 * i)));
  }
  void i64(std::int64_t value) { u64(static_cast<std::uint64_t>(value)); }
  void f64(double value) {
    std::uint64_t bits = 0;
    std::memcpy(&bits, &value, sizeof bits);
    u64(bits);
  }
  void patch_u64(std::size_t offset, std::uint64_t value) {
    for (int i = 0; i < 8; ++i) out_[offset + i] = static_cast<std::uint8_t>(value >> (8 * i));
  }
  std::size_t size() const { return out_.size(); }
  std::vector<std::uint8_t> take() { return std::move(out_); }

 private:
  std::vector<std::uint8_t> out_;
};

// A bounds-checked cursor: every read names the field it is for, so a truncated or
// inconsistent blob says where it went wrong.
class Reader {
 public:
  Reader(const std::uint8_t *data, std::size_t size, std::size_t offset = 0)
      : data_(data), size_(size), offset_(offset) {}

  std::size_t offset() const { return offset_; }
  std::size_t remaining() const { return size_ - offset_; }

  void need(std::size_t bytes, const char *what) const {
    if (bytes > remaining()) {
      throw StateError(fmt::format("state blob is truncated: {} needs {} bytes at offset {}, only {} left", what, bytes,
                                   offset_, remaining()));
    }
  }
  std::uint8_t u8(const char *what) {
    need(1, what);
    return data_[offset_++];
  }
  std::uint32_t u32(const char *what) {
    need(4, what);
    std::uint32_t value = 0;
    for (int i = 0; i < 4; ++i) value |= static_cast<std::uint32_t>(data_[offset_ + i]) << (8 * i);
    offset_ += 4;
    return value;
  }
  std::uint64_t u64(const char *what) {
    need(8, what);
    std::uint64_t value = 0;
    for (int i = 0; i < 8; ++i) value |= static_cast<std::uint64_t>(data_[offset_ + i]) << (8 * i);
    offset_ += 8;
    return value;
  }
  std::int64_t i64(const char *what) { return static_cast<std::int64_t>(u64(what)); }
  double f64(const char *what) {
    const std::uint64_t bits = u64(what);
    double value = 0.0;
    std::memcpy(&value, &bits, sizeof value);
    return value;
  }
  bool flag(const char *what) {
    const std::uint8_t value = u8(what);
    if (value > 1) throw StateError(fmt::format("state blob: {} must be 0 or 1, found {}", what, value));
    return value == 1;
  }

 private:
  const std::uint8_t *data_;
  std::size_t size_;
  std::size_t offset_;
};

}  // namespace sp::policy
