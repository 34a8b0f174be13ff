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
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "train_error.h"

namespace sp::train {

// CheckpointError: train_error.h.

namespace detail {
class CheckpointSource;  // checkpoint_file.cpp: a validated file, open
}

using Bytes = std::vector<std::uint8_t>;

// Not thread-safe: one thread reads or writes a CheckpointSections.
class CheckpointSections {
 public:
  void put(const std::string& name, Bytes payload);
  void put(const std::string& name, const void* data, std::size_t bytes);
  // A section written from the caller's bytes, not copied (the weights and optimizer moments,
  // the bulk of a checkpoint): they must stay alive and unchanged until write_atomically()
  // returns. Only written: get() and get_into() do not see it.
  void put_view(const std::string& name, const void* data, std::size_t bytes);
  bool has(const std::string& name) const;
  // Every section get() can return, in name order.
  std::vector<std::string> names() const;
  // Throws CheckpointError naming `source` and the section when it is missing. A section read
  // from a file is loaded into memory at its first get() and kept.
  const Bytes& get(const std::string& name) const;
  // Copies a section into `dst`, which must hold exactly its size; a section read from a file
  // goes from the file straight into `dst`.
  void get_into(const std::string& name, void* dst, std::size_t bytes) const;
  // Takes `other`'s sections (moved, not copied), replacing any of the same names.
  void merge(CheckpointSections other);

  // Written through a temporary file and renamed over `file`, section by section (no copy of
  // the whole checkpoint is assembled in memory).
  void write_atomically(const std::filesystem::path& file) const;
  // Validates the whole file (its checksum, then its structure) before returning, reading it
  // piece by piece, and loads no section: each is read from the file when asked for, through
  // the descriptor opened here, so a file renamed over this one afterwards (the next
  // checkpoint) changes nothing of what is read. Memory: a read buffer, not the file.
  // Throws CheckpointError.
  static CheckpointSections read(const std::filesystem::path& file);

 private:
  struct View {
    const std::uint8_t* data;
    std::size_t bytes;
  };
  struct Stored {  // a section of a validated file, not loaded
    std::shared_ptr<detail::CheckpointSource> file;
    std::uint64_t offset, bytes;
  };
  void forget(const std::string& name);
  std::uint64_t size_of(const std::string& name) const;

  mutable std::map<std::string, Bytes> sections_;  // put, or loaded from stored_ by get()
  std::map<std::string, View> views_;
  std::map<std::string, Stored> stored_;
  std::string source_ = "<checkpoint being written>";
};

}  // namespace sp::train
