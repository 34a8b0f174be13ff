// Per-step transfer metrics of the streaming engine, and their JSONL sink.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "sp/plugin_abi_v1.h"
#include "sp/precision.h"

namespace sp::adapters {

struct StepTransferMetrics {
  std::int64_t step = 0;
  // Bytes of the copies actually enqueued, and the fetches, per route.
  PerPrecision<std::uint64_t> h2d_bytes;
  PerPrecision<std::uint32_t> fetches;
  // What the same fetches would have moved as BF16 images.
  std::uint64_t h2d_bytes_all_bf16 = 0;
  // Per route, the fetches the transfer policy sent on it instead of the less precise route the
  // plugin wanted, because that one does not pay for the block's size here (BF16: no quantized
  // route pays; INT8: NF4 does not, INT8 does). The least precise route is never one. Then the
  // fetches routed by a runtime pin.
  PerPrecision<std::uint32_t> fetches_by_transfer_policy;
  std::uint32_t fetches_pinned = 0;
  // A use whose fetch was issued before the trainer asked for it is a hit.
  std::uint32_t prefetch_hits = 0;
  std::uint32_t prefetch_misses = 0;
  std::uint32_t prefetch_unused = 0;  // issued, then the step ended without using it
  // The host blocked: an image had to be rewritten while its previous copy was in flight
  // and no spare slab was free, or timing events were still pending when recycled.
  std::uint32_t stalls = 0;
  double stall_seconds = 0.0;
  std::uint32_t image_rebuilds = 0;
  std::uint32_t slabs_total = 0;
  std::uint32_t slabs_in_use_peak = 0;
  std::uint64_t slab_bytes = 0;
  std::uint32_t slots_total = 0;
  std::uint32_t slots_in_flight_peak = 0;  // fetches issued and not yet used
  std::uint64_t slot_bytes = 0;
  // From the backend's events, known once the step's copies have completed.
  bool timings_complete = false;
  double copy_seconds = 0.0;
  double dequant_seconds = 0.0;

  nlohmann::json to_json() const;
  // The transfer part of the plugin's end_step() feedback (loss and step time stay NaN).
  sp_step_feedback_v1 to_feedback() const;
};

// Appends one JSON object per line, each written whole or not at all, so that a reader never
// meets a torn line. A record that cannot be written (disk full, file too large, I/O error)
// is counted lost, the file is cut back to its last complete record, and the next record is
// tried again: once space is free the log goes on. The first loss of a streak and the
// recovery are logged; nothing throws, the training continues.
class MetricsJsonlWriter {
 public:
  explicit MetricsJsonlWriter(std::filesystem::path path);
  ~MetricsJsonlWriter();
  MetricsJsonlWriter(const MetricsJsonlWriter &) = delete;
  MetricsJsonlWriter &operator=(const MetricsJsonlWriter &) = delete;

  const std::filesystem::path &path() const { return path_; }
  // No record lost so far (and the file could be opened).
  bool healthy() const { return lost_ == 0 && fd_ >= 0; }
  std::uint64_t lost() const { return lost_; }
  void append(const nlohmann::json &record) noexcept;

 private:
  bool open_file() noexcept;
  void lose(const char *what, int error) noexcept;

  std::filesystem::path path_;
  int fd_ = -1;
  std::uint64_t complete_bytes_ = 0;  // the file's size up to its last complete record
  std::uint64_t lost_ = 0;
  bool losing_ = false;  // the last record was lost
};

}  // namespace sp::adapters
