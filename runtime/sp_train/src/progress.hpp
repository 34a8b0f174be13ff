// The one-line progress display of sp-train: redrawn in place on a terminal, printed as a
// plain line every `every` steps otherwise (logs, CI).
#pragma once

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>

namespace sp::train {

struct ProgressState {
  std::int64_t step = 0;  // steps done
  std::int64_t total = 0;
  double loss = 0.0;
  std::optional<double> val_loss;
  double tokens_per_second = 0.0;
  std::uint32_t bf16_blocks = 0;
  std::uint32_t int8_blocks = 0;
  std::uint64_t bytes_saved = 0;     // against all-BF16, so far
  std::uint64_t bytes_all_bf16 = 0;  // so far
  double eta_seconds = 0.0;
};

std::string format_progress(const ProgressState& state);
std::string format_bytes(std::uint64_t bytes);

class ProgressLine {
 public:
  ProgressLine(std::FILE* out, bool enabled);
  void update(const ProgressState& state);
  // Ends the in-place line so that the next output starts on a fresh one.
  void finish();

 private:
  std::FILE* out_;
  bool enabled_;
  bool interactive_;
  bool line_open_ = false;
};

}  // namespace sp::train
