#include "test_support.h"

#include <spdlog/logger.h>
#include <spdlog/sinks/base_sink.h>

#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <malloc.h>

#include <fstream>
#include <mutex>
#include <stdexcept>
#include <utility>

namespace sp::host::testing {

TempDir::TempDir() {
  const char* tmpdir = std::getenv("TMPDIR");
  std::string dir_template =
      (std::filesystem::path(tmpdir != nullptr && *tmpdir != '\0' ? tmpdir : "/tmp") / "sp-host-test-XXXXXX").string();
  if (::mkdtemp(dir_template.data()) == nullptr) {
    throw std::runtime_error("mkdtemp failed for " + dir_template);
  }
  path_ = dir_template;
}

TempDir::~TempDir() {
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

class CapturedLog::StringSink : public spdlog::sinks::base_sink<std::mutex> {
 public:
  std::string text() {
    std::lock_guard<std::mutex> lock(mutex_);
    return text_;
  }

 protected:
  void sink_it_(const spdlog::details::log_msg& message) override {
    spdlog::memory_buf_t formatted;
    formatter_->format(message, formatted);
    text_.append(formatted.data(), formatted.size());
  }
  void flush_() override {}

 private:
  std::string text_;
};

CapturedLog::CapturedLog() : sink_(std::make_shared<StringSink>()) {
  sink_->set_pattern("%l %v");
  // Not registered with spdlog: tests may create many loggers with the same name.
  logger_ = std::make_shared<spdlog::logger>("captured", sink_);
  logger_->set_level(spdlog::level::debug);
}

std::string CapturedLog::text() const { return sink_->text(); }

std::vector<BlockDescription> make_blocks(std::uint32_t count) {
  std::vector<BlockDescription> blocks;
  for (std::uint32_t id = 0; id < count; ++id) {
    const std::uint64_t params = 1'000'000 + 1000ULL * id;
    BlockDescription block{id, params, {}, "block." + std::to_string(id)};
    block.bytes[Precision::bf16] = 2 * params;
    block.bytes[Precision::int8] = params + params / 64;
    block.bytes[Precision::nf4] = params / 2 + params / 32;  // two codes a byte, a 2-byte scale per 64
    blocks.push_back(std::move(block));
  }
  return blocks;
}

std::vector<sp_grad_moments_v1> synthetic_moments(std::int64_t step, std::uint32_t block_count) {
  std::vector<sp_grad_moments_v1> moments;
  for (std::uint32_t id = 0; id < block_count; ++id) {
    if ((step + id) % 7 == 3) continue;
    const std::int64_t phase_length = 9 + 4 * (id % 3);
    const bool active = ((step + 5 * id) / phase_length) % 2 == 1;
    const double l2 = active ? 4.0 + 0.25 * id : 0.1 + 0.02 * id;
    const std::uint64_t count = 4096;
    // Now and then a non-finite gradient, so that unsafe flags are part of the state a swap
    // has to carry.
    const std::uint64_t nonfinite = step > 0 && (3 * step + 2 * id) % 29 == 11 ? 2 : 0;
    moments.push_back(sp_grad_moments_v1{id, 0, l2 * l2, 0.01 * l2 * static_cast<double>(id % 2 == 0 ? 1 : -1),
                                         l2 / 8.0, count, nonfinite});
  }
  return moments;
}

std::vector<sp_hint_v1> run_step(PolicyHost& host, std::int64_t step) {
  host.begin_step(step);
  host.post_backward(step, synthetic_moments(step, host.block_count()));
  std::vector<sp_hint_v1> hints = host.compute_hints(step);
  const sp_step_feedback_v1 feedback{0, 0, 2.5, 1000, 500, 2000, std::nan(""), 250};
  host.end_step(step, &feedback);
  return hints;
}

bool Decision::operator==(const Decision& other) const {
  return step == other.step && block_id == other.block_id && precision == other.precision && reason == other.reason &&
         sensitivity_bits == other.sensitivity_bits;
}

std::vector<Decision> decisions_of(std::int64_t step, const std::vector<sp_hint_v1>& hints) {
  std::vector<Decision> decisions;
  for (const sp_hint_v1& hint : hints) {
    std::uint64_t bits = 0;
    std::memcpy(&bits, &hint.sensitivity, sizeof bits);
    if (std::isnan(hint.sensitivity)) bits = 0x7ff8000000000000ULL;
    decisions.push_back(Decision{step, hint.block_id, hint.precision, hint.reason, bits});
  }
  return decisions;
}

std::size_t count_switches(const std::vector<Decision>& decisions, std::uint32_t block_count) {
  std::size_t switches = 0;
  for (std::size_t i = block_count; i < decisions.size(); ++i) {
    if (decisions[i].precision != decisions[i - block_count].precision) ++switches;
  }
  return switches;
}

ProcessResources process_resources() {
  ProcessResources resources;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    ++resources.open_fds;
  }
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    if (line.find(" /") != std::string::npos) ++resources.mapped_file_regions;
  }
  const struct mallinfo2 heap = ::mallinfo2();
  resources.heap_bytes_in_use = heap.uordblks + heap.hblkhd;
  return resources;
}

std::size_t mapped_regions_containing(const std::string& needle) {
  std::ifstream maps("/proc/self/maps");
  std::size_t matches = 0;
  for (std::string line; std::getline(maps, line);) {
    if (line.find(needle) != std::string::npos) ++matches;
  }
  return matches;
}

}  // namespace sp::host::testing
