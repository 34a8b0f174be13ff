#include "engine_test_support.h"

#include <random>

#include <gtest/gtest.h>

#include "sp/kernels/bf16.h"
#include "sp/kernels/nf4.h"
#include "sp/kernels/quantize.h"

namespace sp::adapters::testing {
namespace kn = sp::kernels;

SyntheticModel::SyntheticModel(std::uint32_t num_blocks, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  const struct {
    const char *name;
    std::uint64_t rows, cols;
  } shapes[] = {{"attn.qkv", 17, 259}, {"mlp.up", 8, 128}, {"norm.bias", 1, 7}};
  for (std::uint32_t b = 0; b < num_blocks; ++b) {
    BlockSpec block;
    block.name = "layer" + std::to_string(b);
    for (const auto &shape : shapes) {
      auto values = std::make_unique<std::vector<float>>(shape.rows * shape.cols);
      for (float &v : *values) {
        v = normal(rng);
      }
      block.tensors.push_back(TensorSpec{shape.name, values->data(), shape.rows, shape.cols});
      storage_.push_back(std::move(values));
    }
    blocks_.push_back(std::move(block));
  }
}

float *SyntheticModel::master(std::uint32_t block, std::size_t tensor) {
  return storage_.at(block * blocks_.at(block).tensors.size() + tensor)->data();
}

void SyntheticModel::update_weights(std::uint32_t block, float delta) {
  for (std::size_t t = 0; t < blocks_.at(block).tensors.size(); ++t) {
    const TensorSpec &tensor = blocks_[block].tensors[t];
    float *values = master(block, t);
    for (std::uint64_t i = 0; i < tensor.rows * tensor.cols; ++i) {
      values[i] += delta * static_cast<float>(i % 5 + 1);
    }
  }
}

std::vector<std::uint16_t> expected_bf16(const TensorSpec &tensor, Precision precision, std::uint32_t int8_group_size,
                                         std::uint32_t nf4_group_size) {
  const std::uint64_t n = tensor.rows * tensor.cols;
  const kn::CpuExec reference{kn::CpuImpl::kReference, 1};
  std::vector<std::uint16_t> out(n);
  if (precision == Precision::bf16) {
    kn::fp32_to_bf16(tensor.master, out.data(), n, {}, reference);
    return out;
  }
  if (precision == Precision::nf4) {
    std::vector<std::uint8_t> codes(kn::nf4_code_bytes(tensor.rows, tensor.cols));
    std::vector<std::uint16_t> scales(kn::nf4_scale_count(tensor.rows, tensor.cols, nf4_group_size));
    kn::quantize_nf4(tensor.master, kn::DType::kFloat32, tensor.rows, tensor.cols, nf4_group_size, codes.data(),
                     scales.data(), reference);
    kn::dequantize_nf4_to_bf16(codes.data(), scales.data(), tensor.rows, tensor.cols, nf4_group_size, out.data(),
                               reference);
    return out;
  }
  kn::QuantizeOptions options;
  options.group_size = int8_group_size;
  std::vector<std::int8_t> codes(n);
  std::vector<float> scales(kn::scale_count(tensor.rows, tensor.cols, int8_group_size));
  kn::quantize_int8(tensor.master, kn::DType::kFloat32, tensor.rows, tensor.cols, options, codes.data(), scales.data(),
                    reference);
  kn::dequantize_int8_to_bf16(codes.data(), scales.data(), tensor.rows, tensor.cols, int8_group_size, out.data(),
                              reference);
  return out;
}

void expect_view_holds(TransferBackend &backend, const BlockView &view, const BlockSpec &block,
                       std::uint32_t int8_group_size, std::uint32_t nf4_group_size) {
  ASSERT_EQ(view.tensors.size(), block.tensors.size());
  for (std::size_t t = 0; t < block.tensors.size(); ++t) {
    const TensorSpec &tensor = block.tensors[t];
    std::vector<std::uint16_t> actual(tensor.rows * tensor.cols);
    backend.read_device(reinterpret_cast<std::byte *>(actual.data()),
                        reinterpret_cast<const std::byte *>(view.tensors[t].bf16),
                        actual.size() * sizeof(std::uint16_t));
    EXPECT_EQ(actual, expected_bf16(tensor, view.precision, int8_group_size, nf4_group_size))
        << block.name << " tensor " << tensor.name << " on the " << precision_name(view.precision) << " path, "
        << phase_name(view.phase);
  }
}

StepTransferMetrics run_checked_step(StreamingEngine &engine, TransferBackend &backend,
                                     const std::vector<BlockSpec> &blocks, std::int64_t step,
                                     std::uint32_t int8_group_size, std::uint32_t nf4_group_size) {
  engine.begin_step(step);
  for (const BlockUse &use : engine.schedule().uses()) {
    const BlockView &view = engine.acquire(use.block);
    expect_view_holds(backend, view, blocks[use.block], int8_group_size, nf4_group_size);
    engine.release(use.block);
  }
  return engine.end_step();
}

StreamingConfig config_for(const std::vector<BlockSpec> &blocks, std::uint32_t prefetch_window,
                           std::uint32_t spare_slabs) {
  StreamingConfig config;
  config.host_slab_bytes = 64 * 1024;
  config.host_slab_count = static_cast<std::uint32_t>(blocks.size()) + spare_slabs;
  config.device_slot_bytes = 64 * 1024;
  config.prefetch_window = prefetch_window;
  return config;
}

void set_routes(StreamingEngine &engine, const std::vector<Precision> &routes) {
  engine.policy_bridge().set_plugin_routes(routes);
}

}  // namespace sp::adapters::testing
