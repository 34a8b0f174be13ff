// The checkpoint container: named binary sections behind a magic, a version and a checksum.
// What goes in the sections (weights, optimizer moments, plugin state, data position, RNG) is
// the trainer's business; this file only guarantees that a checkpoint is read back exactly as
// written or rejected with a message naming the file and the defect.
//
// Layout (little-endian): "SPTRCKPT", u32 version, u32 section count, then per section
// u32 name length, name, u64 payload length, payload; then u64 FNV-1a of everything before.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "train_error.h"

namespace sp::train {

// CheckpointError: train_error.h.

using Bytes = std::vector<std::uint8_t>;

class CheckpointSections {
 public:
  void put(const std::string& name, Bytes payload);
  void put(const std::string& name, const void* data, std::size_t bytes);
  // A section written from the caller's bytes, not copied (the weights and optimizer moments,
  // the bulk of a checkpoint): they must stay alive and unchanged until write_atomically()
  // returns. Only written: get() and all() do not see it.
  void put_view(const std::string& name, const void* data, std::size_t bytes);
  bool has(const std::string& name) const { return sections_.count(name) != 0; }
  // Throws CheckpointError naming `source` and the section when it is missing.
  const Bytes& get(const std::string& name) const;
  // Copies a section into `dst`, which must hold exactly its size.
  void get_into(const std::string& name, void* dst, std::size_t bytes) const;
  const std::map<std::string, Bytes>& all() const { return sections_; }
  // Takes `other`'s sections (moved, not copied), replacing any of the same names.
  void merge(CheckpointSections other);

  // Written through a temporary file and renamed over `file`, section by section (no copy of
  // the whole checkpoint is assembled in memory).
  void write_atomically(const std::filesystem::path& file) const;
  // Validates everything before returning. Throws CheckpointError.
  static CheckpointSections read(const std::filesystem::path& file);

 private:
  std::map<std::string, Bytes> sections_;
  struct View {
    const std::uint8_t* data;
    std::size_t bytes;
  };
  std::map<std::string, View> views_;
  std::string source_ = "<checkpoint being written>";
};

}  // namespace sp::train
