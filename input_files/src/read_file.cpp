#include "sp/input_files/read_file.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <system_error>

#include <fmt/format.h>

namespace sp::input_files {

std::ifstream open_input_file(const std::filesystem::path& file, std::string_view what) {
  if (file.empty()) throw FileReadError(fmt::format("expected a path to the {}, found an empty string", what));
  std::error_code status_error;
  const std::filesystem::file_status status = std::filesystem::status(file, status_error);
  if (std::filesystem::is_directory(status)) {
    throw FileReadError(fmt::format("{}: is a directory; expected the {}", file.string(), what));
  }
  std::ifstream in(file, std::ios::binary);
  if (!in) {
    FileReadError error(fmt::format("{}: cannot open the {}: {}", file.string(), what, std::strerror(errno)));
    error.missing_ = status.type() == std::filesystem::file_type::not_found;
    throw error;
  }
  return in;
}

std::string read_whole_file(const std::filesystem::path& file, std::string_view what) {
  // A whole-file read needs an end: a FIFO would block and /dev/zero would fill memory.
  std::error_code status_error;
  const std::filesystem::file_status status = std::filesystem::status(file, status_error);
  if (std::filesystem::exists(status) && !std::filesystem::is_regular_file(status) &&
      !std::filesystem::is_directory(status)) {
    throw FileReadError(fmt::format("{}: is not a regular file; expected the {}", file.string(), what));
  }
  std::ifstream in = open_input_file(file, what);
  try {
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (in.bad()) throw std::ios_base::failure("the stream went bad");
    return bytes;
  } catch (const std::ios_base::failure&) {  // libstdc++'s filebuf throws on a read error such as EIO
    throw FileReadError(fmt::format("{}: reading the {} failed: {}", file.string(), what, std::strerror(errno)));
  }
}

}  // namespace sp::input_files
