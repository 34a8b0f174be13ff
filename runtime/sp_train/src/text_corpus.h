// Byte-level training text: every regular file under a path, read in sorted order, split into
// train and validation deterministically, and sampled into batches that depend only on
// (seed, step), so that a resumed run sees exactly the batches it would have seen.
#pragma once

#include <cstdint>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include "train_error.h"

namespace sp::train {

// DataError: train_error.h.

struct CorpusStats {
  std::uint64_t files = 0;
  std::uint64_t train_bytes = 0;
  std::uint64_t val_bytes = 0;
};

class TextCorpus {
 public:
  // `path` is a file or a directory (searched recursively; symlinks to files already read are
  // read once). Chunk i of `chunk_bytes` goes to validation when floor((i+1)*f) > floor(i*f),
  // f = val_fraction: an even stride through the text. Throws DataError when either split is
  // shorter than seq_len + 1 bytes.
  TextCorpus(const std::filesystem::path& path, double val_fraction, std::uint32_t chunk_bytes, std::uint32_t seq_len);

  const CorpusStats& stats() const { return stats_; }
  // A fingerprint of the text and the split, for checkpoints and the calibration cache.
  std::uint64_t fingerprint() const { return fingerprint_; }

  // batch_size windows of seq_len + 1 bytes (inputs are [0, seq_len), targets [1, seq_len]),
  // row-major into `tokens` (resized). Train windows start at offsets drawn from (seed, step,
  // row); validation batch `index` takes evenly spaced fixed windows.
  // Rows first_row .. first_row + batch_size - 1 of the step's draw: data-parallel rank r of a
  // per-rank batch b takes first_row = r * b, so that N ranks see what one process with batch
  // N * b sees.
  void train_batch(std::uint64_t seed, std::int64_t step, std::uint32_t batch_size, std::vector<std::int64_t>& tokens,
                   std::uint64_t first_row = 0) const;
  // Validation rows: of batch `index` of `batches` batches of batch_size, the `rows` rows from
  // first_row on (all of them by default); data-parallel ranks split each batch this way.
  void val_batch(std::uint32_t index, std::uint32_t batches, std::uint32_t batch_size,
                 std::vector<std::int64_t>& tokens, std::uint32_t first_row = 0, std::uint32_t rows = 0) const;

 private:
  std::vector<std::uint8_t> train_;
  std::vector<std::uint8_t> val_;
  std::uint32_t seq_len_;
  CorpusStats stats_;
  std::uint64_t fingerprint_ = 0;
};

}  // namespace sp::train
