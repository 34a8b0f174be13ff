// Measuring the transfer paths (BF16, INT8, NF4) through the real streaming engine, on any backend: the
// pieces `sp-bench transfer` and the adapters benchmark share.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "sp/kernels/adamw.h"
#include "sp/adapters/backend.h"
#include "sp/adapters/streaming_engine.h"
#include "sp/adapters/transfer_policy.h"

namespace sp::bench {

struct MatrixShape {
  uint64_t rows = 0;
  uint64_t cols = 0;
};

// Blocks of the given tensor shapes with seeded pseudo-random fp32 master weights in
// [-0.05, 0.05), which quantize like trained weights (no all-zero rows, no outliers).
class SyntheticBlocks {
 public:
  SyntheticBlocks(uint32_t num_blocks, std::vector<MatrixShape> shapes, uint64_t seed);
  const std::vector<adapters::BlockSpec>& blocks() const { return blocks_; }
  // The BF16 payload of one block (what the image carries besides its header).
  uint64_t bf16_payload_bytes() const;
  // Block `block`'s masters with seeded gradients and AdamW moments, for an optimizer step.
  std::vector<kernels::AdamWTensor> adamw_tensors(uint32_t block);

 private:
  std::vector<std::unique_ptr<std::vector<float>>> storage_;
  // Per tensor, in storage_'s order: gradient, exp_avg, exp_avg_sq.
  std::vector<std::unique_ptr<std::vector<float>>> grads_, exp_avg_, exp_avg_sq_;
  std::vector<adapters::BlockSpec> blocks_;
};

// One rows x 4096 tensor (narrower when the size asks for fewer than one row) whose BF16
// payload is about `bf16_bytes`.
std::vector<MatrixShape> sweep_block_shapes(uint64_t bf16_bytes);
// The weight matrices of a GPT block of width d: fused QKV (3d x d), attention output
// (d x d), MLP up (4d x d) and down (d x 4d).
std::vector<MatrixShape> gpt_block_shapes(uint64_t d_model);

// Room for every block, `window` fetches ahead, and a spare slab per block so that image
// rebuilds never wait for an in-flight copy.
adapters::StreamingConfig streaming_config_for(const SyntheticBlocks& blocks, uint32_t window, bool backward);

// Hints every block to `precision`, as if the plugin had said so.
void route_all(adapters::StreamingEngine& engine, Precision precision);

// Seconds per copy of `bytes` from pinned host memory into device memory, back to back on the
// copy queue and timed by the backend's events: the physical limit of this run. Copies rotate
// over `sources` x `destinations` buffers so neither side is measured cache-hot when the
// engine's copies are not.
double raw_copy_seconds(adapters::TransferBackend& backend, uint64_t bytes, uint32_t sources, uint32_t destinations,
                        int repeats);

// Runs one forward-only step with no compute and waits for its transfers (through the
// engine's own events, so any backend works). Returns wall seconds.
double run_transfer_step(adapters::StreamingEngine& engine, int64_t step);

struct MeasureOptions {
  uint32_t blocks = 4;  // blocks streamed per step
  uint32_t window = 2;  // prefetch window
  int warmup_steps = 2;
  int repeats = 7;  // timed steps per path; the report keeps median, min and max
  uint32_t int8_group_size = 0;
  uint32_t nf4_group_size = 64;
  // Trained paths: true measures what writing each route's image adds to the fused host
  // optimizer's sweep (StreamingEngine::update_weights minus AdamW alone on the same block),
  // false the rebuild from the masters after the optimizer (on_weights_updated).
  bool fused_rebuild = true;
};

// All three paths for blocks of `shapes`: copy and dequant times from events, rebuild times
// on the host, and the streaming time per block measured whole.
adapters::TransferPoint measure_transfer_point(adapters::TransferBackend& backend,
                                               const std::vector<MatrixShape>& shapes, const MeasureOptions& options);

adapters::TimingStats timing_stats(std::vector<double> samples);

}  // namespace sp::bench
