// Whole-file reads for the files a user hands in (the reference host tools' configs,
// checkpoints, caches and traces; the adapters' transfer reports and policies), with the one
// error wording they share.
#pragma once

#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <string_view>

#include "sp/error.h"

namespace sp::input_files {

class FileReadError : public ErrorAs<std::runtime_error> {
 public:
  explicit FileReadError(const std::string& what) : ErrorAs(ErrorKind::bad_input, what) {}
  // True when the file does not exist (as opposed to existing and being unreadable).
  bool missing() const { return missing_; }

 private:
  friend std::ifstream open_input_file(const std::filesystem::path&, std::string_view);
  bool missing_ = false;
};

// An input stream on `file`, for inputs read piece by piece (traces). Throws FileReadError
// "<file>: cannot open the <what>: <reason>" or "<file>: is a directory; expected the <what>"
// (std::ifstream opens a directory and fails only on the first read, which callers would see
// as an empty input or an internal error).
std::ifstream open_input_file(const std::filesystem::path& file, std::string_view what);

// The file's bytes; throws FileReadError as open_input_file() does, when the file is not a
// regular file (a FIFO or a device has no end to read to), or when reading fails.
std::string read_whole_file(const std::filesystem::path& file, std::string_view what);

}  // namespace sp::input_files
