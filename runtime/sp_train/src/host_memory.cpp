#include "host_memory.h"

#include <algorithm>
#include <fstream>
#include <string>

namespace sp::train {
namespace {

// A kB line of /proc/self/status ("VmRSS:", "VmHWM:"), in bytes; 0 where /proc does not say.
std::uint64_t process_status_bytes(const std::string& key) {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind(key, 0) == 0) return std::stoull(line.substr(key.size())) * 1024;
  }
  return 0;
}

}  // namespace

std::uint64_t estimated_host_bytes(const TrainConfig& c, std::uint32_t shards) {
  const ModelConfig& m = c.model;
  const std::uint64_t d = m.d_model, tokens = std::uint64_t{c.train.batch_size} * m.seq_len;
  const std::uint64_t attention = 4 * d * d, mlp = 2 * std::uint64_t{m.mlp_ratio} * d * d;
  const std::uint64_t streamed = (attention + mlp) * m.n_blocks;
  const bool sublayers = m.streaming_unit == StreamingUnit::sublayer;
  const std::uint64_t units = sublayers ? 2 * std::uint64_t{m.n_blocks} : m.n_blocks;
  const std::uint64_t largest_unit = sublayers ? std::max(attention, mlp) : attention + mlp;
  const bool full = c.train.mode == TrainMode::full, on_cpu = c.train.device == ComputeDevice::cpu;
  // Full mode: master and gradient in fp32, and the two moments (fp32, or bf16).
  const std::uint64_t moment_bytes = c.train.adam_moments == AdamMoments::fp32 ? 8 : 4;
  const std::uint64_t owned_units = (units + shards - 1) / shards;
  const std::uint64_t masters = std::max(streamed * 4, streamed * (full ? 8 + moment_bytes : 4) * owned_units / units) +
                                (full && !on_cpu ? streamed * 4 : 0);
  const std::uint64_t slabs = 2 * (units + c.streaming.spare_slabs) * largest_unit * 2;
  if (!on_cpu) return masters + slabs;
  // A quantized image is at most INT8's byte per weight and its scales.
  const std::uint64_t slots = 2 * (std::uint64_t{c.streaming.prefetch_window} + 2) * largest_unit * 3;
  const std::uint64_t scores = std::uint64_t{c.train.batch_size} * m.n_heads * m.seq_len * m.seq_len * 4;
  const std::uint64_t activations =
      tokens * d * 4 * (units + 3 * (7 + 2 * std::uint64_t{m.mlp_ratio}) / 2) + 4 * scores;
  return masters + slabs + slots + activations;
}

std::uint64_t resident_bytes() { return process_status_bytes("VmRSS:"); }

std::uint64_t peak_rss_bytes() { return process_status_bytes("VmHWM:"); }

std::uint64_t available_host_bytes() {
  std::ifstream meminfo("/proc/meminfo");
  for (std::string line; std::getline(meminfo, line);) {
    if (line.rfind("MemAvailable:", 0) == 0) return std::stoull(line.substr(13)) * 1024;
  }
  return 0;
}

}  // namespace sp::train
