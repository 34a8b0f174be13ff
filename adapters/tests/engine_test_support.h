// Synthetic blocks and bit-exact expectations shared by the host and CUDA engine tests.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "sp/adapters/streaming_engine.h"
#include "sp/kernels/nf4.h"

namespace sp::adapters::testing {

// A transfer gate with these INT8 and NF4 verdicts (empty: the route pays nowhere).
inline TransferGate gate_of(std::vector<bool> int8_pays, std::vector<bool> nf4_pays = {}) {
  TransferGate gate;
  gate.pays[Precision::int8] = std::move(int8_pays);
  gate.pays[Precision::nf4] = std::move(nf4_pays);
  return gate;
}

// Blocks of three tensors with odd shapes and seeded Gaussian master weights.
class SyntheticModel {
 public:
  SyntheticModel(std::uint32_t num_blocks, std::uint32_t seed);

  const std::vector<BlockSpec> &blocks() const { return blocks_; }
  // Changes every master weight of `block` (as an optimizer step would).
  void update_weights(std::uint32_t block, float delta);
  // The master of tensor `tensor` of `block`, writable (the model owns it).
  float *master(std::uint32_t block, std::size_t tensor);

 private:
  std::vector<std::unique_ptr<std::vector<float>>> storage_;
  std::vector<BlockSpec> blocks_;
};

// The bf16 values a device slot must hold for `tensor` on `precision`, from the kernels' CPU
// reference: fp32 -> bf16, or dequant(quant()) for INT8 and NF4.
std::vector<std::uint16_t> expected_bf16(const TensorSpec &tensor, Precision precision, std::uint32_t int8_group_size,
                                         std::uint32_t nf4_group_size = sp::kernels::kNf4DefaultGroupSize);

// Reads every tensor of `view` back from the device and compares bit for bit.
void expect_view_holds(TransferBackend &backend, const BlockView &view, const BlockSpec &block,
                       std::uint32_t int8_group_size, std::uint32_t nf4_group_size = sp::kernels::kNf4DefaultGroupSize);

// One full step through the schedule, checking every use against the current master weights.
StepTransferMetrics run_checked_step(StreamingEngine &engine, TransferBackend &backend,
                                     const std::vector<BlockSpec> &blocks, std::int64_t step,
                                     std::uint32_t int8_group_size,
                                     std::uint32_t nf4_group_size = sp::kernels::kNf4DefaultGroupSize);

StreamingConfig config_for(const std::vector<BlockSpec> &blocks, std::uint32_t prefetch_window,
                           std::uint32_t spare_slabs = 0);

void set_routes(StreamingEngine &engine, const std::vector<Precision> &routes);

}  // namespace sp::adapters::testing
