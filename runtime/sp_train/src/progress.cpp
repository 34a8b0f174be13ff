#include "progress.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <vector>

#include <fmt/format.h>
#include <spdlog/details/log_msg.h>
#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/base_sink.h>

namespace sp::train {
namespace {

// "BF16 12 INT8 34 NF4 56": the routes as the log names them, each with its blocks.
std::string blocks_per_route(const PerPrecision<std::uint32_t>& blocks) {
  std::string text;
  for (const RouteTraits& route : kRouteTraits) {
    text += fmt::format("{}{} {}", text.empty() ? "" : " ", route.label, blocks[route.precision]);
  }
  return text;
}

}  // namespace

std::string format_bytes(std::uint64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (b >= 1e9) return fmt::format("{:.2f} GB", b / 1e9);
  if (b >= 1e6) return fmt::format("{:.1f} MB", b / 1e6);
  if (b >= 1e3) return fmt::format("{:.1f} kB", b / 1e3);
  return fmt::format("{} B", bytes);
}

std::string format_progress(const ProgressState& s, std::size_t columns) {
  const int width = 20;
  const int filled = s.total > 0 ? static_cast<int>(width * s.step / s.total) : width;
  const double saved_pct = s.bytes_all_bf16 ? 100.0 * s.bytes_saved / s.bytes_all_bf16 : 0.0;
  // In display order, each with the separator before it; `drop` orders what goes first when the
  // line is wider than the terminal (1 first; 0: kept): the bar's picture, the routes, the
  // bytes, the speed, the validation loss, the time left. The step and the loss stay.
  struct Field {
    const char* separator;
    std::string text;
    int drop;
  };
  std::vector<Field> fields = {
      {"", fmt::format("[{}{}]", std::string(filled, '#'), std::string(width - filled, '.')), 1},
      {" ", fmt::format("step {}/{}", s.step, s.total), 0},
      {" | ", fmt::format("loss {:.4f}", s.loss), 0},
      {" ", s.val_loss ? fmt::format("val {:.4f}", *s.val_loss) : std::string(), 5},
      {" | ", fmt::format("{:.0f} tok/s", s.tokens_per_second), 4},
      {" | ", blocks_per_route(s.blocks), 2},
      {" | ", fmt::format("saved {} ({:.1f}%)", format_bytes(s.bytes_saved), saved_pct), 3},
      {" | ", fmt::format("eta {:.0f}s", s.eta_seconds), 6}};
  const auto join = [&fields] {
    std::string line;
    for (const Field& field : fields) {
      if (field.text.empty()) continue;
      line += line.empty() ? "" : field.separator;
      line += field.text;
    }
    return line;
  };
  std::string line = join();
  for (int drop = 1; columns != 0 && line.size() > columns && drop <= 6; ++drop) {
    for (Field& field : fields) {
      if (field.drop == drop) field.text.clear();
    }
    line = join();
  }
  if (columns != 0 && line.size() > columns) line.resize(columns);
  return line;
}

std::size_t terminal_columns(std::FILE* out) {
  winsize size{};
  if (::ioctl(::fileno(out), TIOCGWINSZ, &size) != 0) return 0;
  return size.ws_col;
}

ProgressLine::ProgressLine(std::FILE* out, bool enabled)
    : out_(out), enabled_(enabled), interactive_(enabled && ::isatty(::fileno(out)) == 1) {}

namespace {
constexpr std::string_view kClearLine = "\r\033[2K";
}

void ProgressLine::update(const ProgressState& state) {
  if (!enabled_) return;
  const std::lock_guard<std::mutex> lock(mutex_);
  if (interactive_) {
    // One column short of the width: a line that fills the last column wraps on some
    // terminals, and each redraw would then scroll instead of rewriting the line.
    const std::size_t columns = terminal_columns(out_);
    drawn_ = format_progress(state, columns > 1 ? columns - 1 : 0);
    fmt::print(out_, "{}{}", kClearLine, drawn_);
    line_open_ = true;
  } else if (state.step == state.total || state.step % 10 == 0) {
    fmt::print(out_, "{}\n", format_progress(state));
  }
  std::fflush(out_);
}

void ProgressLine::finish() {
  const std::lock_guard<std::mutex> lock(mutex_);
  if (line_open_) fmt::print(out_, "\n");
  line_open_ = false;
  std::fflush(out_);
}

void ProgressLine::write_lines(std::FILE* stream, std::string_view text) {
  const std::lock_guard<std::mutex> lock(mutex_);
  const bool lift = line_open_ && ::isatty(::fileno(stream)) == 1;
  if (lift) {
    fmt::print(out_, "{}", kClearLine);
    std::fflush(out_);
  }
  std::fwrite(text.data(), 1, text.size(), stream);
  std::fflush(stream);
  if (lift) {
    fmt::print(out_, "{}", drawn_);
    std::fflush(out_);
  }
}

namespace {

class ProgressAwareSink final : public spdlog::sinks::base_sink<std::mutex> {
 public:
  ProgressAwareSink(std::shared_ptr<ProgressLine> progress, std::FILE* stream)
      : progress_(std::move(progress)), stream_(stream), colour_(::isatty(::fileno(stream)) == 1) {
    set_pattern_("[%H:%M:%S.%e] [%^%l%$] %v");
  }

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    spdlog::memory_buf_t formatted;
    formatter_->format(msg, formatted);
    std::string text(formatted.data(), formatted.size());
    if (colour_ && msg.color_range_end > msg.color_range_start) {
      text.insert(msg.color_range_end, "\033[m");
      text.insert(msg.color_range_start, level_colour(msg.level));
    }
    progress_->write_lines(stream_, text);
  }
  void flush_() override { std::fflush(stream_); }

 private:
  // The codes of spdlog's own colour sinks.
  static const char* level_colour(spdlog::level::level_enum level) {
    switch (level) {
      case spdlog::level::trace:
        return "\033[37m";
      case spdlog::level::debug:
        return "\033[36m";
      case spdlog::level::info:
        return "\033[32m";
      case spdlog::level::warn:
        return "\033[33m\033[1m";
      default:
        return "\033[31m\033[1m";
    }
  }

  std::shared_ptr<ProgressLine> progress_;
  std::FILE* stream_;
  bool colour_;
};

}  // namespace

std::shared_ptr<spdlog::sinks::sink> make_progress_aware_sink(std::shared_ptr<ProgressLine> progress,
                                                              std::FILE* stream) {
  return std::make_shared<ProgressAwareSink>(std::move(progress), stream);
}

}  // namespace sp::train
