#include "sp/adapters/metrics.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include <spdlog/spdlog.h>

namespace sp::adapters {

nlohmann::json StepTransferMetrics::to_json() const {
  nlohmann::json record = {
      {"step", step},
      {"h2d_bytes",
       {{"bf16", h2d_bytes_bf16}, {"int8", h2d_bytes_int8}, {"nf4", h2d_bytes_nf4}, {"all_bf16", h2d_bytes_all_bf16}}},
      {"fetches",
       {{"bf16", fetches_bf16},
        {"int8", fetches_int8},
        {"nf4", fetches_nf4},
        {"bf16_by_transfer_policy", fetches_bf16_by_transfer_policy},
        {"int8_by_transfer_policy", fetches_int8_by_transfer_policy},
        {"pinned", fetches_pinned}}},
      {"prefetch", {{"hits", prefetch_hits}, {"misses", prefetch_misses}, {"unused", prefetch_unused}}},
      {"stalls", {{"count", stalls}, {"seconds", stall_seconds}}},
      {"image_rebuilds", image_rebuilds},
      {"pool", {{"slabs", slabs_total}, {"in_use_peak", slabs_in_use_peak}, {"slab_bytes", slab_bytes}}},
      {"slots", {{"slots", slots_total}, {"in_flight_peak", slots_in_flight_peak}, {"slot_bytes", slot_bytes}}},
  };
  if (timings_complete) {
    record["copy_seconds"] = copy_seconds;
    record["dequant_seconds"] = dequant_seconds;
  } else {
    record["copy_seconds"] = nullptr;
    record["dequant_seconds"] = nullptr;
  }
  return record;
}

sp_step_feedback_v1 StepTransferMetrics::to_feedback() const {
  sp_step_feedback_v1 feedback;
  std::memset(&feedback, 0, sizeof feedback);
  feedback.struct_size = sizeof feedback;
  feedback.loss = std::numeric_limits<double>::quiet_NaN();
  feedback.h2d_bytes_bf16 = h2d_bytes_bf16;
  feedback.h2d_bytes_int8 = h2d_bytes_int8;
  feedback.h2d_bytes_all_bf16 = h2d_bytes_all_bf16;
  feedback.step_seconds = std::numeric_limits<double>::quiet_NaN();
  feedback.h2d_bytes_nf4 = h2d_bytes_nf4;
  return feedback;
}

MetricsJsonlWriter::MetricsJsonlWriter(std::filesystem::path path) : path_(std::move(path)) {
  out_.open(path_, std::ios::out | std::ios::app);
  if (!out_) {
    fail(std::string("cannot open for appending: ") + std::strerror(errno));
  }
}

void MetricsJsonlWriter::fail(const std::string &what) noexcept {
  if (healthy_) {
    spdlog::error("transfer metrics {}: {}; no further records are written", path_.string(), what);
  }
  healthy_ = false;
}

void MetricsJsonlWriter::append(const nlohmann::json &record) noexcept {
  if (!healthy_) {
    return;
  }
  try {
    out_ << record.dump() << '\n';
    out_.flush();
    if (!out_) {
      fail("write failed");
    }
  } catch (const std::exception &error) {
    fail(error.what());
  }
}

}  // namespace sp::adapters
