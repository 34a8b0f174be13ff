// The one-line progress display of sp-train: redrawn in place on a terminal, printed as a
// plain line every 10 steps otherwise (logs, CI). Log lines reach the terminal through the
// same object, so that a line never lands on the bar.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

#include "sp/precision.h"

namespace spdlog::sinks {
class sink;
}

namespace sp::train {

struct ProgressState {
  std::int64_t step = 0;  // steps done
  std::int64_t total = 0;
  double loss = 0.0;
  std::optional<double> val_loss;
  double tokens_per_second = 0.0;
  PerPrecision<std::uint32_t> blocks;  // on each route at this step
  std::uint64_t bytes_saved = 0;     // against all-BF16, so far
  std::uint64_t bytes_all_bf16 = 0;  // so far
  double eta_seconds = 0.0;
};

// The line, at most `columns` wide (0: no limit): the least useful fields are left out first
// (the bar's picture, then the routes, the bytes saved, the speed, the validation loss, the
// time left); the step and the loss always stay.
std::string format_progress(const ProgressState& state, std::size_t columns = 0);

// The width of the terminal `out` is, or 0 when it is not one (or does not say).
std::size_t terminal_columns(std::FILE* out);
std::string format_bytes(std::uint64_t bytes);

// Thread-safe: log lines may come from any thread while the training loop updates the bar.
class ProgressLine {
 public:
  ProgressLine(std::FILE* out, bool enabled);
  void update(const ProgressState& state);
  // Ends the in-place line so that the next output starts on a fresh one.
  void finish();
  // Writes `text` (whole lines, newline included) to `stream`. While the bar is drawn in
  // place and `stream` is a terminal too, the bar is cleared first and redrawn after, as
  // tqdm.write does.
  void write_lines(std::FILE* stream, std::string_view text);

 private:
  std::mutex mutex_;
  std::FILE* out_;
  bool enabled_;
  bool interactive_;
  bool line_open_ = false;
  std::string drawn_;  // the bar as last drawn, for the redraw
};

// The one sink of sp-train's logger: formats like spdlog's colour sink ("[time] [level]
// message", the level coloured on a terminal) and writes through `progress` to `stream`.
std::shared_ptr<spdlog::sinks::sink> make_progress_aware_sink(std::shared_ptr<ProgressLine> progress,
                                                              std::FILE* stream);

}  // namespace sp::train
