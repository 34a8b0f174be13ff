#include "sp/runtime/atomic_file.h"

#include "sp/runtime/write_all.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <system_error>
#include <vector>

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

// A std::streambuf over a file descriptor that remembers why the first write failed, which
// std::ofstream forgets: the error a user sees names the cause, not a guess.
class AtomicFileWriter::FileBuffer : public std::streambuf {
 public:
  explicit FileBuffer(int fd) : fd_(fd), buffer_(1 << 16) { setp(buffer_.data(), buffer_.data() + buffer_.size()); }
  ~FileBuffer() override {
    if (fd_ >= 0) ::close(fd_);
  }
  int error() const { return error_; }
  // Flushes and fsyncs; false (with error()) when either failed.
  bool finish() {
    if (sync() != 0) return false;
    if (::fsync(fd_) != 0 && error_ == 0) error_ = errno;
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0 && error_ == 0) error_ = errno;
    return error_ == 0;
  }

 protected:
  int_type overflow(int_type c) override {
    if (sync() != 0) return traits_type::eof();
    if (!traits_type::eq_int_type(c, traits_type::eof())) {
      *pptr() = traits_type::to_char_type(c);
      pbump(1);
    }
    return traits_type::not_eof(c);
  }
  int sync() override {
    if (error_ != 0) return -1;
    error_ = write_all(fd_, pbase(), static_cast<std::size_t>(pptr() - pbase()));
    if (error_ != 0) return -1;
    setp(buffer_.data(), buffer_.data() + buffer_.size());
    return 0;
  }

 private:
  int fd_;
  std::vector<char> buffer_;
  int error_ = 0;
};

AtomicFileWriter::AtomicFileWriter(std::filesystem::path target)
    : target_(std::move(target)), temp_(make_temp_path(target_)), out_(nullptr) {
  const int fd = ::open(temp_.c_str(), O_WRONLY | O_TRUNC | O_CLOEXEC);
  if (fd < 0) {
    const int error = errno;
    std::error_code ignored;
    std::filesystem::remove(temp_, ignored);
    throw std::runtime_error(fmt::format("{}: cannot open {} for writing: {}", target_, temp_, std::strerror(error)));
  }
  buffer_ = std::make_unique<FileBuffer>(fd);
  out_.rdbuf(buffer_.get());
}

AtomicFileWriter::~AtomicFileWriter() {
  if (!committed_) {
    out_.rdbuf(nullptr);
    buffer_.reset();
    std::error_code ignored;
    std::filesystem::remove(temp_, ignored);
  }
}

void AtomicFileWriter::commit() {
  if (!out_ || !buffer_->finish()) {
    throw std::runtime_error(fmt::format("{}: writing {} failed: {}; the previous file is kept", target_, temp_,
                                         buffer_->error() != 0 ? std::strerror(buffer_->error()) : "stream error"));
  }
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
