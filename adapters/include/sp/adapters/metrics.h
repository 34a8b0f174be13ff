// Per-step transfer metrics of the streaming engine, and their JSONL sink.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "sp/plugin_abi_v1.h"

namespace sp::adapters {

struct StepTransferMetrics {
  std::int64_t step = 0;
  // Bytes of the copies actually enqueued, per route.
  std::uint64_t h2d_bytes_bf16 = 0;
  std::uint64_t h2d_bytes_int8 = 0;
  // What the same fetches would have moved as BF16 images.
  std::uint64_t h2d_bytes_all_bf16 = 0;
  std::uint32_t fetches_bf16 = 0;
  std::uint32_t fetches_int8 = 0;
  // BF16 fetches of blocks the plugin wanted as INT8 or NF4, kept BF16 by the transfer policy
  // because no quantized route pays for their size here, and fetches routed by a runtime pin.
  std::uint32_t fetches_bf16_by_transfer_policy = 0;
  std::uint32_t fetches_pinned = 0;
  // The NF4 route (appended in ABI 1.1): bytes and fetches, and INT8 fetches of blocks the
  // plugin wanted as NF4, sent as INT8 because NF4 does not pay for their size but INT8 does.
  std::uint64_t h2d_bytes_nf4 = 0;
  std::uint32_t fetches_nf4 = 0;
  std::uint32_t fetches_int8_by_transfer_policy = 0;
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

// Appends one JSON object per line and flushes after each, so a crash loses at most the line
// being written. A failure to open or write is logged once and the training continues.
class MetricsJsonlWriter {
 public:
  explicit MetricsJsonlWriter(std::filesystem::path path);

  const std::filesystem::path &path() const { return path_; }
  bool healthy() const { return healthy_; }
  void append(const nlohmann::json &record) noexcept;

 private:
  void fail(const std::string &what) noexcept;

  std::filesystem::path path_;
  std::ofstream out_;
  bool healthy_ = true;
};

}  // namespace sp::adapters
