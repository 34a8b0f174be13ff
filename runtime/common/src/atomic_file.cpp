#include "sp/runtime/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <system_error>

#include <fmt/core.h>
#include <fmt/std.h>

namespace sp::runtime {
namespace {

std::filesystem::path make_temp_path(const std::filesystem::path& target) {
  const std::filesystem::path dir = target.has_parent_path() ? target.parent_path() : std::filesystem::path(".");
  std::string pattern = (dir / ("." + target.filename().string() + ".tmp-XXXXXX")).string();
  const int fd = ::mkstemp(pattern.data());
  if (fd < 0) {
    throw std::runtime_error(
        fmt::format("{}: cannot create a temporary file in {}: {}", target, dir, std::strerror(errno)));
  }
  // mkstemp creates 0600; outputs are ordinary files that other users may read.
  ::fchmod(fd, 0644);
  ::close(fd);
  return pattern;
}

void fsync_path(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

}  // namespace

AtomicFileWriter::AtomicFileWriter(std::filesystem::path target)
    : target_(std::move(target)), temp_(make_temp_path(target_)) {
  out_.open(temp_, std::ios::binary | std::ios::trunc);
  if (!out_) {
    std::error_code ignored;
    std::filesystem::remove(temp_, ignored);
    throw std::runtime_error(fmt::format("{}: cannot open {} for writing", target_, temp_));
  }
}

AtomicFileWriter::~AtomicFileWriter() {
  if (!committed_) {
    out_.close();
    std::error_code ignored;
    std::filesystem::remove(temp_, ignored);
  }
}

void AtomicFileWriter::commit() {
  out_.flush();
  const bool written = static_cast<bool>(out_);
  out_.close();
  if (!written || out_.fail()) {
    throw std::runtime_error(fmt::format("{}: writing failed (disk full?); the previous file is kept", target_));
  }
  fsync_path(temp_);
  std::error_code ec;
  std::filesystem::rename(temp_, target_, ec);
  if (ec) {
    throw std::runtime_error(fmt::format("{}: cannot rename {} over it: {}", target_, temp_, ec.message()));
  }
  committed_ = true;
  fsync_path(target_.has_parent_path() ? target_.parent_path() : std::filesystem::path("."));
}

void write_file_atomically(const std::filesystem::path& target, const std::string& contents) {
  AtomicFileWriter writer(target);
  writer.stream() << contents;
  writer.commit();
}

std::string output_file_problem(const std::filesystem::path& target) {
  if (target.empty()) return "expected a file path, found an empty string";
  std::error_code error;
  if (std::filesystem::is_directory(target, error)) return target.string() + " is a directory; expected a file path";
  const std::filesystem::path parent = target.has_parent_path() ? target.parent_path() : ".";
  if (!std::filesystem::is_directory(parent, error)) {
    return "the directory " + parent.string() + " of " + target.string() + " does not exist";
  }
  return {};
}

}  // namespace sp::runtime
