// Files that appear whole or not at all: the reference host's outputs (replay decisions,
// checkpoints, caches, summaries) are written to a temporary file beside the target and
// renamed over it only after everything was written and flushed.
#pragma once

#include <filesystem>
#include <memory>
#include <ostream>
#include <string>

namespace sp::runtime {

class AtomicFileWriter {
 public:
  // Opens a temporary file in the target's directory. Throws std::runtime_error naming
  // the target when the directory does not exist or is not writable.
  explicit AtomicFileWriter(std::filesystem::path target);
  ~AtomicFileWriter();  // removes the temporary file unless commit() succeeded
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  std::ostream& stream() { return out_; }
  // Flushes, fsyncs and renames over the target. Throws std::runtime_error naming the target
  // and the system's reason (errno: "No space left on device", "File too large", ...) on
  // failure, leaving any previous target file untouched.
  void commit();

  const std::filesystem::path& target() const { return target_; }

 private:
  class FileBuffer;  // writes to the temporary file's descriptor, keeping the first errno

  std::filesystem::path target_;
  std::filesystem::path temp_;
  std::unique_ptr<FileBuffer> buffer_;
  std::ostream out_;
  bool committed_ = false;
};

// Convenience for small files.
void write_file_atomically(const std::filesystem::path& target, const std::string& contents);

// Empty when `target` can be written as a file: a non-empty path, not a directory, whose
// parent directory exists. Otherwise what is wrong with it, for a command-line message, so
// that a tool refuses a bad output path before it does the work, not after.
std::string output_file_problem(const std::filesystem::path& target);

}  // namespace sp::runtime
