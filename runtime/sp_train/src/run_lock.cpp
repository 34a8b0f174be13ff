#include "run_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <string_view>

#include <fmt/format.h>

#include "train_error.h"

namespace sp::train {
namespace fs = std::filesystem;

RunDirectoryLock::RunDirectoryLock(const fs::path& run_dir) {
  const fs::path file = run_dir / ".sp-train.lock";
  fd_ = ::open(file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) {
    throw ConfigError(fmt::format("run directory '{}' (--out): cannot create its lock file {}: {}", run_dir.string(),
                                  file.string(), std::strerror(errno)));
  }
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    std::ifstream in(file);
    std::string holder;
    std::getline(in, holder);
    ::close(fd_);
    fd_ = -1;
    if (error == EWOULDBLOCK) {
      throw ConfigError(
          fmt::format("run directory '{}' (--out) is in use by another sp-train (pid {}); wait for it, stop it, or use "
                      "another --out",
                      run_dir.string(), holder.empty() ? "unknown" : holder));
    }
    throw ConfigError(fmt::format("run directory '{}' (--out): cannot lock {}: {}", run_dir.string(), file.string(),
                                  std::strerror(error)));
  }
  // The lock file may be ours in a directory we may no longer write (made read-only, or on a
  // read-only mount): every file of the run is written by a rename into it, so find out now,
  // before a resume says it resumed.
  if (::faccessat(AT_FDCWD, run_dir.c_str(), W_OK, AT_EACCESS) != 0) {
    const int error = errno;
    ::close(fd_);
    fd_ = -1;
    throw ConfigError(fmt::format("run directory '{}' (--out): cannot write in it: {}", run_dir.string(),
                                  std::strerror(error)));
  }
  // Who holds it, for the message of the run that is refused.
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd_, 0) == 0) {
    [[maybe_unused]] const ssize_t written = ::pwrite(fd_, pid.data(), pid.size(), 0);
  }
}

RunDirectoryLock::~RunDirectoryLock() {
  if (fd_ >= 0) ::close(fd_);
}

std::vector<fs::path> remove_stale_temporaries(const fs::path& run_dir, const std::vector<std::string>& names,
                                               const std::vector<std::string>& name_prefixes) {
  constexpr std::string_view kTemporary = ".tmp-";
  constexpr std::size_t kSuffix = 6;  // mkstemp's XXXXXX
  // ".<target>.tmp-XXXXXX": the target's name, or "" when it is not a temporary.
  const auto target_of = [&](const std::string& file) -> std::string {
    if (file.size() < 1 + kTemporary.size() + kSuffix || file[0] != '.') return {};
    const std::size_t marker = file.size() - kSuffix - kTemporary.size();
    if (file.compare(marker, kTemporary.size(), kTemporary) != 0) return {};
    return file.substr(1, marker - 1);
  };
  std::vector<fs::path> removed;
  std::error_code error;
  for (const fs::directory_entry& entry : fs::directory_iterator(run_dir, error)) {
    const std::string target = target_of(entry.path().filename().string());
    if (target.empty() || !entry.is_regular_file(error)) continue;
    const bool ours = std::find(names.begin(), names.end(), target) != names.end() ||
                      std::any_of(name_prefixes.begin(), name_prefixes.end(),
                                  [&](const std::string& prefix) { return target.rfind(prefix, 0) == 0; });
    if (ours && fs::remove(entry.path(), error)) removed.push_back(entry.path());
  }
  return removed;
}

}  // namespace sp::train
