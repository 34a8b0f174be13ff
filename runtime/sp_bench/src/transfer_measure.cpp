#include "sp/bench/transfer_measure.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>

#include <fmt/core.h>

#include "sp/adapters/route_encoding.h"
#include "sp/kernels/slab.h"
#include "sp/precision_abi.h"

namespace sp::bench {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

constexpr uint64_t kSweepCols = 4096;

}  // namespace

SyntheticBlocks::SyntheticBlocks(uint32_t num_blocks, std::vector<MatrixShape> shapes, uint64_t seed) {
  uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
  for (uint32_t b = 0; b < num_blocks; ++b) {
    adapters::BlockSpec block{fmt::format("block{}", b), {}};
    for (size_t t = 0; t < shapes.size(); ++t) {
      auto values = std::make_unique<std::vector<float>>(shapes[t].rows * shapes[t].cols);
      for (float& v : *values) {
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        v = (static_cast<float>(state >> 40) / static_cast<float>(1 << 24) - 0.5f) * 0.1f;
      }
      block.tensors.push_back({fmt::format("w{}", t), values->data(), shapes[t].rows, shapes[t].cols});
      auto grads = std::make_unique<std::vector<float>>(values->size());
      for (std::size_t i = 0; i < grads->size(); ++i) (*grads)[i] = (*values)[i] * 1e-2f;
      grads_.push_back(std::move(grads));
      exp_avg_.push_back(std::make_unique<std::vector<float>>(values->size(), 0.0f));
      exp_avg_sq_.push_back(std::make_unique<std::vector<float>>(values->size(), 0.0f));
      storage_.push_back(std::move(values));
    }
    blocks_.push_back(std::move(block));
  }
}

uint64_t SyntheticBlocks::bf16_payload_bytes() const {
  uint64_t bytes = 0;
  for (const adapters::TensorSpec& t : blocks_.front().tensors) bytes += t.rows * t.cols * 2;
  return bytes;
}

std::vector<kernels::AdamWTensor> SyntheticBlocks::adamw_tensors(uint32_t block) {
  const std::size_t per_block = blocks_.at(block).tensors.size();
  std::vector<kernels::AdamWTensor> tensors;
  for (std::size_t t = 0; t < per_block; ++t) {
    const std::size_t i = block * per_block + t;
    const adapters::TensorSpec& spec = blocks_[block].tensors[t];
    tensors.push_back({storage_[i]->data(), grads_[i]->data(), exp_avg_[i]->data(), exp_avg_sq_[i]->data(),
                       {spec.rows, spec.cols}, true});
  }
  return tensors;
}

std::vector<MatrixShape> sweep_block_shapes(uint64_t bf16_bytes) {
  const uint64_t elements = std::max<uint64_t>(bf16_bytes / 2, 1);
  if (elements < kSweepCols) return {{1, elements}};
  return {{elements / kSweepCols, kSweepCols}};
}

std::vector<MatrixShape> gpt_block_shapes(uint64_t d) { return {{3 * d, d}, {d, d}, {4 * d, d}, {d, 4 * d}}; }

adapters::StreamingConfig streaming_config_for(const SyntheticBlocks& blocks, uint32_t window, bool backward) {
  std::vector<kernels::TensorShape> shapes;
  for (const adapters::TensorSpec& t : blocks.blocks().front().tensors) shapes.push_back({t.rows, t.cols});
  const uint64_t image = kernels::slab_image_bytes(adapters::slab_encoding(Precision::bf16, 0), shapes.data(), shapes.size());
  adapters::StreamingConfig config;
  config.host_slab_bytes = image;
  config.host_slab_count = 2 * static_cast<uint32_t>(blocks.blocks().size());
  config.device_slot_bytes = image;
  config.prefetch_window = window;
  config.backward = backward;
  return config;
}

void route_all(adapters::StreamingEngine& engine, Precision precision) {
  engine.policy_bridge().set_plugin_routes(std::vector<Precision>(engine.policy_bridge().num_blocks(), precision));
}

double raw_copy_seconds(adapters::TransferBackend& backend, uint64_t bytes, uint32_t sources, uint32_t destinations,
                        int repeats) {
  std::vector<adapters::Region> host;
  std::vector<adapters::Region> device;
  for (uint32_t i = 0; i < sources; ++i) {
    host.push_back(backend.allocate_pinned_host(bytes));
    std::memset(host.back().data(), 1, bytes);
  }
  for (uint32_t i = 0; i < destinations; ++i) device.push_back(backend.allocate_device(bytes));
  auto start = backend.create_event();
  auto end = backend.create_event();
  backend.copy_host_to_device_async(device[0].data(), host[0].data(), bytes);  // warm-up
  backend.record(*start, adapters::Queue::copy);
  const int copies = repeats * static_cast<int>(sources);
  for (int i = 0; i < copies; ++i) {
    backend.copy_host_to_device_async(device[i % destinations].data(), host[i % sources].data(), bytes);
  }
  backend.record(*end, adapters::Queue::copy);
  backend.synchronize(*end);
  return backend.elapsed_seconds(*start, *end) / copies;
}

double run_transfer_step(adapters::StreamingEngine& engine, int64_t step) {
  const Clock::time_point start = Clock::now();
  engine.begin_step(step);
  for (const adapters::BlockUse& use : engine.schedule().uses()) {
    engine.acquire(use.block);
    engine.release(use.block);
  }
  engine.end_step();
  engine.flush_metrics();
  return seconds_since(start);
}

adapters::TimingStats timing_stats(std::vector<double> samples) {
  if (samples.empty()) throw std::invalid_argument("timing_stats: no samples");
  std::sort(samples.begin(), samples.end());
  return {samples[samples.size() / 2], samples.front(), samples.back(), static_cast<uint32_t>(samples.size())};
}

namespace {

struct PathSamples {
  std::vector<double> per_block;  // wall seconds of a step / fetches
  std::vector<double> copy;       // event seconds per fetch
  std::vector<double> dequant;
  // Host seconds the image adds after an optimizer step, per block: fused, update_weights minus
  // AdamW alone on the same block; unfused, on_weights_updated.
  std::vector<double> rebuild;
};

PathSamples measure_path(adapters::TransferBackend& backend, SyntheticBlocks& blocks, Precision precision,
                         const MeasureOptions& options) {
  adapters::StreamingConfig config = streaming_config_for(blocks, options.window, /*backward=*/false);
  config.int8_group_size = options.int8_group_size;
  config.nf4_group_size = options.nf4_group_size;
  adapters::StreamingEngine engine(backend, config, blocks.blocks());
  route_all(engine, precision);
  const double fetches = static_cast<double>(engine.schedule().fetches().size());
  PathSamples samples;
  int64_t step = 0;
  for (; step < options.warmup_steps; ++step) run_transfer_step(engine, step);
  for (int r = 0; r < options.repeats; ++r, ++step) {
    samples.per_block.push_back(run_transfer_step(engine, step) / fetches);
    const adapters::StepTransferMetrics& m = *engine.last_completed_metrics();
    samples.copy.push_back(m.copy_seconds / fetches);
    samples.dequant.push_back(m.dequant_seconds / fetches);
    // Between steps, as after an optimizer pass: every block's image is rebuilt.
    const uint32_t n_blocks = engine.policy_bridge().num_blocks();
    if (!options.fused_rebuild) {
      for (uint32_t block = 0; block < n_blocks; ++block) {
        const Clock::time_point start = Clock::now();
        engine.on_weights_updated(block);
        samples.rebuild.push_back(seconds_since(start));
      }
      continue;
    }
    // AdamW alone over every block, then the fused pass over every block, in the same order:
    // each pass finds a block's data as long untouched as the other does (run back to back on
    // one block, the second would find it in cache).
    const kernels::AdamWStep adam = kernels::make_adamw_step({0.9, 0.95, 1e-8, 0.1}, 1e-4, step + 1, 1.0);
    std::vector<double> adamw_alone(n_blocks);
    for (uint32_t block = 0; block < n_blocks; ++block) {
      const Clock::time_point start = Clock::now();
      for (const kernels::AdamWTensor& tensor : blocks.adamw_tensors(block)) kernels::adamw_update(adam, tensor);
      adamw_alone[block] = seconds_since(start);
    }
    for (uint32_t block = 0; block < n_blocks; ++block) {
      const std::vector<kernels::AdamWTensor> tensors = blocks.adamw_tensors(block);
      const Clock::time_point start = Clock::now();
      engine.update_weights(block, adam, tensors);
      // The image can cost less than the noise of the AdamW pass it rides on: a difference
      // below zero counts as free, not as a trained path faster than the frozen one.
      samples.rebuild.push_back(std::max(0.0, seconds_since(start) - adamw_alone[block]));
    }
  }
  return samples;
}

}  // namespace

adapters::TransferPoint measure_transfer_point(adapters::TransferBackend& backend,
                                               const std::vector<MatrixShape>& shapes, const MeasureOptions& options) {
  if (options.repeats < 1) throw std::invalid_argument("measure_transfer_point: repeats must be >= 1");
  SyntheticBlocks blocks(options.blocks, shapes, /*seed=*/shapes.front().rows * 131 + shapes.size());
  std::vector<kernels::TensorShape> slab_shapes;
  for (const MatrixShape& s : shapes) slab_shapes.push_back({s.rows, s.cols});
  const auto image_bytes = [&](Precision precision, uint32_t group_size) {
    return kernels::slab_image_bytes(adapters::slab_encoding(precision, group_size), slab_shapes.data(),
                                     slab_shapes.size());
  };
  adapters::TransferPoint point;
  point.bf16_bytes = image_bytes(Precision::bf16, 0);
  point.int8_bytes = image_bytes(Precision::int8, options.int8_group_size);
  adapters::Nf4Measurement nf4;
  nf4.group_size = options.nf4_group_size;
  nf4.nf4_bytes = image_bytes(Precision::nf4, options.nf4_group_size);
  point.raw_copy_s =
      raw_copy_seconds(backend, point.bf16_bytes, options.blocks, options.window + 2, std::max(options.repeats, 3));
  const PathSamples bf16 = measure_path(backend, blocks, Precision::bf16, options);
  const PathSamples int8 = measure_path(backend, blocks, Precision::int8, options);
  const PathSamples nf4_samples = measure_path(backend, blocks, Precision::nf4, options);
  point.bf16_copy = timing_stats(bf16.copy);
  point.int8_copy = timing_stats(int8.copy);
  point.int8_dequant = timing_stats(int8.dequant);
  point.bf16_rebuild = timing_stats(bf16.rebuild);
  point.int8_rebuild = timing_stats(int8.rebuild);
  point.bf16_path_s = timing_stats(bf16.per_block).median_s;
  point.int8_frozen_path_s = timing_stats(int8.per_block).median_s;
  point.bf16_trained_path_s = point.bf16_path_s + point.bf16_rebuild.median_s;
  point.int8_trained_path_s = point.int8_frozen_path_s + point.int8_rebuild.median_s;
  nf4.copy = timing_stats(nf4_samples.copy);
  nf4.dequant = timing_stats(nf4_samples.dequant);
  nf4.rebuild = timing_stats(nf4_samples.rebuild);
  nf4.frozen_path_s = timing_stats(nf4_samples.per_block).median_s;
  nf4.trained_path_s = nf4.frozen_path_s + nf4.rebuild.median_s;
  point.nf4 = nf4;
  return point;
}

}  // namespace sp::bench
