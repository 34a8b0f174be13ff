// The model's compute tensors: what it reads when its math runs in another dtype (or on
// another device) than the fp32 host masters.
#include <array>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "gpt_model.h"

namespace sp::train {
namespace {

ModelConfig tiny_model() {
  ModelConfig m;
  m.d_model = 32;
  m.n_heads = 2;
  m.n_blocks = 2;
  m.seq_len = 8;
  return m;
}

const torch::TensorOptions kBf16OnHost = torch::TensorOptions().dtype(torch::kBFloat16);

// bf16 compute wraps the slot itself: no copy between what crossed the link and the matmul.
TEST(GptModelCompute, Bf16WeightsAreTheSlotInPlace) {
  GptModel model(tiny_model(), TrainMode::full, LoraConfig{}, 7, kBf16OnHost);
  const BlockWeights& masters = model.masters()[0];
  std::array<std::vector<std::uint16_t>, kStreamedPerBlock> slot;
  std::array<const std::uint16_t*, kStreamedPerBlock> slot_pointers{};
  for (std::size_t i = 0; i < kStreamedPerBlock; ++i) {
    slot[i].assign(static_cast<std::size_t>(masters[i].numel()), 0x3f80);  // bf16 1.0
    slot_pointers[i] = slot[i].data();
  }
  const BlockWeights delivered = model.delivered_weights(slot_pointers, /*requires_grad=*/true);
  for (std::size_t i = 0; i < kStreamedPerBlock; ++i) {
    EXPECT_EQ(delivered[i].data_ptr(), static_cast<const void*>(slot[i].data())) << "tensor " << i;
    EXPECT_EQ(delivered[i].sizes(), masters[i].sizes()) << "tensor " << i;
    EXPECT_EQ(delivered[i].scalar_type(), torch::kBFloat16);
    EXPECT_TRUE(delivered[i].requires_grad());
  }
  // The block's backward differentiates through the wrapped slot without writing it.
  const torch::Tensor x = torch::randn({1, 8, 32}, kBf16OnHost);
  torch::autograd::grad({model.block_forward(0, x, delivered).sum()}, {delivered[0]});
  for (std::size_t i = 0; i < kStreamedPerBlock; ++i) {
    for (std::uint16_t v : slot[i]) ASSERT_EQ(v, 0x3f80) << "tensor " << i;
  }
}

// Where the math does not run on the fp32 masters, each resident tensor has its own compute
// copy, which follows the master only through refresh_compute(), and an fp32 gradient
// accumulator beside it, apart from the host gradient the optimizer reads.
TEST(GptModelCompute, ResidentCopiesFollowTheMastersOnRefresh) {
  GptModel model(tiny_model(), TrainMode::lora, LoraConfig{}, 7, kBf16OnHost);
  for (ResidentParam& p : model.resident()) {
    ASSERT_NE(p.compute.data_ptr(), p.value.data_ptr()) << p.name;
    EXPECT_EQ(p.compute.scalar_type(), torch::kBFloat16) << p.name;
    ASSERT_TRUE(p.compute_grad.defined()) << p.name;
    EXPECT_EQ(p.compute_grad.scalar_type(), torch::kFloat32) << p.name;
    EXPECT_EQ(p.compute_grad.device(), p.compute.device()) << p.name;
    EXPECT_EQ(p.compute_grad.sizes(), p.value.sizes()) << p.name;
    EXPECT_NE(p.compute_grad.data_ptr(), p.grad.data_ptr()) << p.name;
    EXPECT_EQ(p.compute_grad.count_nonzero().item<std::int64_t>(), 0) << p.name;
    EXPECT_TRUE(torch::equal(p.compute, p.value.detach().to(torch::kBFloat16))) << p.name;
    p.value.detach().add_(1.0f);
  }
  const ResidentParam& first = model.resident()[0];
  EXPECT_FALSE(torch::equal(first.compute, first.value.detach().to(torch::kBFloat16)));
  model.refresh_compute();
  for (const ResidentParam& p : model.resident()) {
    EXPECT_TRUE(torch::equal(p.compute, p.value.detach().to(torch::kBFloat16))) << p.name;
  }
}

// fp32 on the host computes on the masters themselves, and widens the slot exactly.
TEST(GptModelCompute, Fp32OnTheHostUsesTheMastersAndWidensTheSlotExactly) {
  GptModel model(tiny_model(), TrainMode::full, LoraConfig{}, 7, torch::TensorOptions().dtype(torch::kFloat32));
  for (const ResidentParam& p : model.resident()) {
    EXPECT_EQ(p.compute.data_ptr(), p.value.data_ptr()) << p.name;
    // Gradients are accumulated straight into the host buffer the optimizer reads.
    EXPECT_FALSE(p.compute_grad.defined()) << p.name;
    EXPECT_EQ(p.grad.scalar_type(), torch::kFloat32) << p.name;
    EXPECT_EQ(p.grad.sizes(), p.value.sizes()) << p.name;
  }
  const BlockWeights& masters = model.masters()[0];
  std::array<torch::Tensor, kStreamedPerBlock> bf16;
  std::array<const std::uint16_t*, kStreamedPerBlock> slot_pointers{};
  for (std::size_t i = 0; i < kStreamedPerBlock; ++i) {
    bf16[i] = masters[i].to(torch::kBFloat16).contiguous();
    slot_pointers[i] = static_cast<const std::uint16_t*>(bf16[i].data_ptr());
  }
  const BlockWeights delivered = model.delivered_weights(slot_pointers, /*requires_grad=*/false);
  for (std::size_t i = 0; i < kStreamedPerBlock; ++i) {
    EXPECT_EQ(delivered[i].scalar_type(), torch::kFloat32);
    EXPECT_TRUE(torch::equal(delivered[i], bf16[i].to(torch::kFloat32))) << "tensor " << i;
  }
}

// The stress test's outlier channel: in a listed block one value row shrinks and the
// attn.proj column that reads it grows by the magnitude, so the block computes what it did
// while attn.proj's rows each carry one large weight; nothing else changes.
TEST(GptModelInit, OutlierChannelsMoveScaleWithoutChangingTheFunction) {
  const torch::TensorOptions fp32 = torch::TensorOptions().dtype(torch::kFloat32);
  ModelConfig stressed = tiny_model();
  stressed.outlier_blocks = {1};
  stressed.outlier_magnitude = 64.0;
  GptModel plain(stressed, TrainMode::full, LoraConfig{}, 7, fp32);
  GptModel with_outliers(stressed, TrainMode::full, LoraConfig{}, 7, fp32);
  with_outliers.plant_outlier_channels(7);
  const std::int64_t c = stressed.d_model;
  for (std::size_t i = 0; i < kStreamedPerBlock; ++i) {
    EXPECT_TRUE(torch::equal(plain.masters()[0][i], with_outliers.masters()[0][i])) << "tensor " << i;
  }
  const BlockWeights& before = plain.masters()[1];
  const BlockWeights& after = with_outliers.masters()[1];
  EXPECT_TRUE(torch::equal(before[2], after[2]));
  EXPECT_TRUE(torch::equal(before[3], after[3]));
  const torch::Tensor changed_rows = (before[0] != after[0]).any(1).nonzero().flatten();
  const torch::Tensor changed_columns = (before[1] != after[1]).any(0).nonzero().flatten();
  ASSERT_EQ(changed_rows.numel(), 1);
  ASSERT_EQ(changed_columns.numel(), 1);
  const std::int64_t channel = changed_columns.item<std::int64_t>();
  EXPECT_EQ(changed_rows.item<std::int64_t>(), 2 * c + channel) << "the value row of the same channel";
  EXPECT_TRUE(torch::allclose(after[0][2 * c + channel] * 64.0f, before[0][2 * c + channel]));
  EXPECT_TRUE(torch::allclose(after[1].select(1, channel), before[1].select(1, channel) * 64.0f));
  // Each attn.proj row's largest weight is now the planted one.
  EXPECT_TRUE(torch::equal(std::get<1>(after[1].abs().max(1)), torch::full({c}, channel, torch::kLong)));

  const torch::Tensor x = torch::randn({2, 8, c});
  const torch::Tensor y_plain = plain.block_forward(1, x, before);
  const torch::Tensor y_outliers = with_outliers.block_forward(1, x, after);
  EXPECT_TRUE(torch::allclose(y_plain, y_outliers, 1e-5, 1e-5));

  GptModel again(stressed, TrainMode::full, LoraConfig{}, 7, fp32);
  again.plant_outlier_channels(7);
  EXPECT_TRUE(torch::equal(again.masters()[1][1], after[1])) << "the channel is a function of the seed";
}

}  // namespace
}  // namespace sp::train
