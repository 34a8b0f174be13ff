#include "progress.hpp"

#include <unistd.h>

#include <fmt/format.h>

namespace sp::train {

std::string format_bytes(std::uint64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (b >= 1e9) return fmt::format("{:.2f} GB", b / 1e9);
  if (b >= 1e6) return fmt::format("{:.1f} MB", b / 1e6);
  if (b >= 1e3) return fmt::format("{:.1f} kB", b / 1e3);
  return fmt::format("{} B", bytes);
}

std::string format_progress(const ProgressState& s) {
  const int width = 20;
  const int filled = s.total > 0 ? static_cast<int>(width * s.step / s.total) : width;
  const double saved_pct = s.bytes_all_bf16 ? 100.0 * s.bytes_saved / s.bytes_all_bf16 : 0.0;
  return fmt::format("[{}{}] step {}/{} | loss {:.4f}{} | {:.0f} tok/s | BF16 {} INT8 {} | saved {} ({:.1f}%) | eta {:.0f}s",
                     std::string(filled, '#'), std::string(width - filled, '.'), s.step, s.total, s.loss,
                     s.val_loss ? fmt::format(" val {:.4f}", *s.val_loss) : std::string(),
                     s.tokens_per_second, s.bf16_blocks, s.int8_blocks, format_bytes(s.bytes_saved),
                     saved_pct, s.eta_seconds);
}

ProgressLine::ProgressLine(std::FILE* out, bool enabled)
    : out_(out), enabled_(enabled), interactive_(enabled && ::isatty(::fileno(out)) == 1) {}

void ProgressLine::update(const ProgressState& state) {
  if (!enabled_) return;
  if (interactive_) {
    fmt::print(out_, "\r\033[2K{}", format_progress(state));
    line_open_ = true;
  } else if (state.step == state.total || state.step % 10 == 0) {
    fmt::print(out_, "{}\n", format_progress(state));
  }
  std::fflush(out_);
}

void ProgressLine::finish() {
  if (line_open_) fmt::print(out_, "\n");
  line_open_ = false;
  std::fflush(out_);
}

}  // namespace sp::train
