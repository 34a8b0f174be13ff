// sp-replay's inputs: a JSONL trace of per-block gradient moments and an optional
// calibration file. Both are user-written files, so every defect is reported with the
// file, the line and the field, and nothing is guessed.
#pragma once

#include <cstdint>
#include <istream>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "sp/error.h"
#include "sp/plugin_abi_v1.h"
#include "sp/precision.h"

namespace sp::replay {

// An input file that cannot be used. what() reads "FILE:LINE: FIELD: problem".
class InputError : public ErrorAs<std::runtime_error> {
 public:
  explicit InputError(const std::string& what) : ErrorAs(ErrorKind::bad_input, what) {}
};

struct TraceStep {
  int64_t step = 0;
  std::vector<sp_grad_moments_v1> moments;                 // blocks without a gradient this step are absent
  double loss = std::numeric_limits<double>::quiet_NaN();  // the step's training loss; NaN = unknown
};

// Reads {"step": s, "blocks": [{"id", "sum_sq", "sum", "max_abs", "count", "nonfinite"}],
// "loss": l} one line at a time; "loss" is optional, a finite number or null (unknown). Steps must be 0, 1, 2, ... in
// order, because the policy's windows, warm-up and cooldown count steps. Blank lines are skipped.
class TraceReader {
 public:
  TraceReader(std::istream& in, std::string source_name, uint32_t n_blocks);

  // The next step, or nullopt at the end of the file. Throws InputError.
  std::optional<TraceStep> next();

 private:
  std::istream& in_;
  std::string source_name_;
  uint32_t n_blocks_;
  uint64_t line_number_ = 0;
  int64_t expected_step_ = 0;
};

// One precision's calibration errors from the file: the blocks it names, and their errors.
struct BlockErrors {
  std::vector<uint32_t> block_ids;
  std::vector<double> errors;
};

// Relative output errors against BF16 per quantized route, as a calibration pass measures them.
struct CalibrationFile {
  sp::PerPrecision<BlockErrors> errors;
};

// The file's key of a route's errors: "<route>_block_errors" ("nf4_block_errors"), except
// INT8's "block_errors", which the format named before there was a second quantized route.
std::string calibration_errors_key(sp::Precision route);

// Reads {"block_errors": {"<id>": err, ...}, "nf4_block_errors": {"<id>": err, ...}}: each
// route's object optional but not all absent, every id in [0, n_blocks), every error a finite
// number >= 0. Throws InputError.
CalibrationFile read_calibration_file(const std::string& path, uint32_t n_blocks);

}  // namespace sp::replay
