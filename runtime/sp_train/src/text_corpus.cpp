#include "text_corpus.h"
#include "sp/runtime/hash.h"
#include "sp/input_files/read_file.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <set>

#include <fmt/format.h>

namespace sp::train {
namespace fs = std::filesystem;

namespace {

std::vector<fs::path> text_files(const fs::path& path) {
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (ec || !fs::exists(status)) {
    throw DataError(fmt::format("{}: data path {}", path.string(),
                                ec && ec != std::errc::no_such_file_or_directory ? "cannot be used: " + ec.message()
                                                                                 : std::string("does not exist")));
  }
  std::vector<fs::path> files;
  if (fs::is_regular_file(status)) {
    files.push_back(path);
    return files;
  }
  if (!fs::is_directory(status)) {
    throw DataError(fmt::format("{}: data path is neither a file nor a directory", path.string()));
  }
  std::vector<fs::path> found;
  for (auto it = fs::recursive_directory_iterator(path, fs::directory_options::follow_directory_symlink, ec);
       !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (it->is_regular_file(ec)) found.push_back(it->path());
  }
  if (ec) throw DataError(fmt::format("{}: cannot list the data directory: {}", path.string(), ec.message()));
  std::sort(found.begin(), found.end());
  // Debian's common-licenses links GPL -> GPL-3 etc.; each text is read once, under the first
  // of its names in sorted order.
  std::set<fs::path> seen;
  for (const fs::path& file : found) {
    const fs::path canonical = fs::canonical(file, ec);
    if (ec || seen.insert(canonical).second) files.push_back(file);
  }
  return files;
}

}  // namespace

TextCorpus::TextCorpus(const fs::path& path, double val_fraction, std::uint32_t chunk_bytes, std::uint32_t seq_len)
    : seq_len_(seq_len) {
  std::vector<std::uint8_t> text;
  std::uint64_t file_bytes = 0;  // without the newline that separates files
  for (const fs::path& file : text_files(path)) {
    try {
      const std::string bytes = sp::input_files::read_whole_file(file, "data file");
      file_bytes += bytes.size();
      text.insert(text.end(), bytes.begin(), bytes.end());
    } catch (const sp::input_files::FileReadError& e) {
      throw DataError(e.what());
    }
    text.push_back('\n');
    ++stats_.files;
  }
  const std::size_t chunks = (text.size() + chunk_bytes - 1) / chunk_bytes;
  for (std::size_t i = 0; i < chunks; ++i) {
    const bool to_val = std::floor((i + 1) * val_fraction) > std::floor(i * val_fraction);
    const auto begin = text.begin() + static_cast<std::ptrdiff_t>(i * chunk_bytes);
    const auto end = text.begin() + static_cast<std::ptrdiff_t>(std::min(text.size(), (i + 1) * chunk_bytes));
    (to_val ? val_ : train_).insert((to_val ? val_ : train_).end(), begin, end);
  }
  stats_.train_bytes = train_.size();
  stats_.val_bytes = val_.size();
  const std::uint64_t need = std::uint64_t{seq_len} + 1;
  if (train_.size() < need || val_.size() < need) {
    throw DataError(
        fmt::format("{}: {} bytes of text in {} file(s) give {} train and {} validation bytes; each split "
                    "needs at least model.seq_len + 1 = {} (lower data.val_fraction or data.chunk_bytes, or "
                    "give more text)",
                    path.string(), file_bytes, stats_.files, train_.size(), val_.size(), need));
  }
  fingerprint_ = sp::runtime::fnv1a64(train_.data(), train_.size());
  fingerprint_ = sp::runtime::fnv1a64(val_.data(), val_.size(), fingerprint_);
}

void TextCorpus::train_batch(std::uint64_t seed, std::int64_t step, std::uint32_t batch_size,
                             std::vector<std::int64_t>& tokens, std::uint64_t first_row) const {
  const std::size_t window = seq_len_ + 1;
  const std::uint64_t starts = train_.size() - window + 1;
  tokens.resize(std::size_t{batch_size} * window);
  for (std::uint32_t row = 0; row < batch_size; ++row) {
    const std::uint64_t offset =
        sp::runtime::mix64(sp::runtime::mix64(seed ^ sp::runtime::mix64(static_cast<std::uint64_t>(step))) + first_row +
                           row) %
        starts;
    std::copy_n(train_.begin() + static_cast<std::ptrdiff_t>(offset), window,
                tokens.begin() + static_cast<std::ptrdiff_t>(row * window));
  }
}

void TextCorpus::val_batch(std::uint32_t index, std::uint32_t batches, std::uint32_t batch_size,
                           std::vector<std::int64_t>& tokens, std::uint32_t first_row, std::uint32_t rows) const {
  if (rows == 0) rows = batch_size;
  const std::size_t window = seq_len_ + 1;
  const std::uint64_t starts = val_.size() - window + 1;
  const std::uint64_t total = std::uint64_t{batches} * batch_size;
  tokens.resize(std::size_t{rows} * window);
  for (std::uint32_t row = 0; row < rows; ++row) {
    const std::uint64_t k = std::uint64_t{index} * batch_size + first_row + row;
    const std::uint64_t offset = total > 1 ? k * (starts - 1) / (total - 1) : 0;
    std::copy_n(val_.begin() + static_cast<std::ptrdiff_t>(offset), window,
                tokens.begin() + static_cast<std::ptrdiff_t>(row * window));
  }
}

}  // namespace sp::train
