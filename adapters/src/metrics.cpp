#include "sp/adapters/metrics.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include <spdlog/spdlog.h>

namespace sp::adapters {

nlohmann::json StepTransferMetrics::to_json() const {
  nlohmann::json bytes = nlohmann::json::object();
  nlohmann::json fetch_counts = nlohmann::json::object();
  for (Precision precision : kPrecisions) {
    bytes[precision_name(precision)] = h2d_bytes[precision];
    fetch_counts[precision_name(precision)] = fetches[precision];
  }
  bytes["all_bf16"] = h2d_bytes_all_bf16;
  // The transfer policy falls back toward BF16, so the least precise route takes no fetch of it.
  for (Precision precision : kPrecisions) {
    if (precision == kPrecisions.back()) continue;
    fetch_counts[std::string(precision_name(precision)) + "_by_transfer_policy"] =
        fetches_by_transfer_policy[precision];
  }
  fetch_counts["pinned"] = fetches_pinned;
  nlohmann::json record = {
      {"step", step},
      {"h2d_bytes", std::move(bytes)},
      {"fetches", std::move(fetch_counts)},
      {"prefetch", {{"hits", prefetch_hits}, {"misses", prefetch_misses}, {"unused", prefetch_unused}}},
      {"stalls", {{"count", stalls}, {"seconds", stall_seconds}}},
      {"image_rebuilds", image_rebuilds},
      {"pool", {{"slabs", slabs_total}, {"in_use_peak", slabs_in_use_peak}, {"slab_bytes", slab_bytes}}},
      {"slots", {{"slots", slots_total}, {"in_flight_peak", slots_in_flight_peak}, {"slot_bytes", slot_bytes}}},
  };
  if (timings_complete) {
    record["copy_seconds"] = copy_seconds;
    record["dequant_seconds"] = dequant_seconds;
  } else {
    record["copy_seconds"] = nullptr;
    record["dequant_seconds"] = nullptr;
  }
  return record;
}

sp_step_feedback_v1 StepTransferMetrics::to_feedback() const {
  sp_step_feedback_v1 feedback;
  std::memset(&feedback, 0, sizeof feedback);
  feedback.struct_size = sizeof feedback;
  feedback.loss = std::numeric_limits<double>::quiet_NaN();
  feedback.h2d_bytes_bf16 = h2d_bytes[Precision::bf16];
  feedback.h2d_bytes_int8 = h2d_bytes[Precision::int8];
  feedback.h2d_bytes_all_bf16 = h2d_bytes_all_bf16;
  feedback.step_seconds = std::numeric_limits<double>::quiet_NaN();
  feedback.h2d_bytes_nf4 = h2d_bytes[Precision::nf4];
  return feedback;
}

MetricsJsonlWriter::MetricsJsonlWriter(std::filesystem::path path) : path_(std::move(path)) {
  if (!open_file()) lose("cannot open it for appending", errno);
}

MetricsJsonlWriter::~MetricsJsonlWriter() {
  if (fd_ >= 0) ::close(fd_);
}

bool MetricsJsonlWriter::open_file() noexcept {
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd_ < 0) return false;
  struct stat st {};
  complete_bytes_ = ::fstat(fd_, &st) == 0 ? static_cast<std::uint64_t>(st.st_size) : 0;
  return true;
}

void MetricsJsonlWriter::lose(const char *what, int error) noexcept {
  ++lost_;
  if (!losing_) {
    spdlog::error("{}: {}: {}; the record is lost, the next one is tried again", path_.string(), what,
                  std::strerror(error));
  }
  losing_ = true;
}

void MetricsJsonlWriter::append(const nlohmann::json &record) noexcept {
  if (fd_ < 0 && !open_file()) return lose("cannot open it for appending", errno);
  std::string line;
  try {
    line = record.dump() + '\n';
  } catch (const std::exception &) {
    return lose("a record could not be serialized", EINVAL);
  }
  // Where the last whole record ends now (a resume's cut may have moved it since the open).
  struct stat st {};
  if (::fstat(fd_, &st) == 0) complete_bytes_ = static_cast<std::uint64_t>(st.st_size);
  std::size_t written = 0;
  while (written < line.size()) {
    const ssize_t n = ::write(fd_, line.data() + written, line.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int error = n < 0 ? errno : ENOSPC;
      // No torn line: the file goes back to its last complete record.
      if (written > 0 && ::ftruncate(fd_, static_cast<off_t>(complete_bytes_)) != 0) {
        spdlog::error("{}: cannot cut a torn record back: {}", path_.string(), std::strerror(errno));
      }
      return lose("a write failed", error);
    }
    written += static_cast<std::size_t>(n);
  }
  complete_bytes_ += line.size();
  if (losing_) {
    spdlog::warn("{}: writing again; {} record(s) lost so far", path_.string(), lost_);
    losing_ = false;
  }
}

}  // namespace sp::adapters
