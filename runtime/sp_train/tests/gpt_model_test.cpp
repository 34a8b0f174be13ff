// The model's compute tensors: what it reads when its math runs in another dtype (or on
// another device) than the fp32 host masters.
#include <string>
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

// Where the math does not run on the fp32 masters, each resident tensor has its own compute
// copy, which follows the master only through refresh_compute(); its gradient reaches the
// host buffer the optimizer reads only through queue_resident_gradients_to_host().
TEST(GptModelCompute, ResidentCopiesFollowTheMastersOnRefresh) {
  GptModel model(tiny_model(), TrainMode::lora, LoraConfig{}, 7, kBf16OnHost);
  for (ResidentParam& p : model.resident()) {
    ASSERT_NE(p.compute.data_ptr(), p.value.data_ptr()) << p.name;
    EXPECT_EQ(p.compute.scalar_type(), torch::kBFloat16) << p.name;
    EXPECT_TRUE(p.compute.requires_grad()) << p.name;
    EXPECT_EQ(p.grad.scalar_type(), torch::kFloat32) << p.name;
    EXPECT_TRUE(torch::equal(p.compute, p.value.detach().to(torch::kBFloat16))) << p.name;
    p.value.detach().add_(1.0f);
  }
  const ResidentParam& first = model.resident()[0];
  EXPECT_FALSE(torch::equal(first.compute, first.value.detach().to(torch::kBFloat16)));
  model.refresh_compute();
  for (const ResidentParam& p : model.resident()) {
    EXPECT_TRUE(torch::equal(p.compute, p.value.detach().to(torch::kBFloat16))) << p.name;
  }

  {
    // What the layer does while the block computes: its streamed weights in the compute dtype.
    torch::NoGradGuard no_grad;
    for (torch::Tensor& w : model.streamed()[0]) w.set_data(w.to(torch::kBFloat16));
  }
  const torch::Tensor x = torch::randn({1, 8, 32}, kBf16OnHost);
  model.block_forward(0, x).sum().backward();
  ResidentParam& norm = model.resident()[2];  // block0.ln1.weight
  ASSERT_EQ(norm.name, "block0.ln1.weight");
  ASSERT_TRUE(norm.compute.grad().defined());
  const torch::Tensor computed = norm.compute.grad().to(torch::kFloat32);
  EXPECT_EQ(norm.grad.count_nonzero().item<std::int64_t>(), 0) << "the host buffer waits for the queue";
  model.queue_resident_gradients_to_host();
  EXPECT_TRUE(torch::equal(norm.grad, computed));
  EXPECT_TRUE(norm.compute.grad().defined()) << "kept for the moments (LoRA adapters) until the next step";
  model.clear_gradients();
  EXPECT_FALSE(norm.compute.grad().defined()) << "the next backward starts from no gradient";
  EXPECT_EQ(norm.grad.count_nonzero().item<std::int64_t>(), 0);
}

// fp32 on the host computes on the masters themselves, and the backward accumulates into the
// host buffer the optimizer reads.
TEST(GptModelCompute, Fp32OnTheHostAccumulatesIntoTheOptimizersBuffers) {
  GptModel model(tiny_model(), TrainMode::full, LoraConfig{}, 7, torch::TensorOptions().dtype(torch::kFloat32));
  for (const ResidentParam& p : model.resident()) {
    EXPECT_EQ(p.compute.data_ptr(), p.value.data_ptr()) << p.name;
    ASSERT_TRUE(p.value.grad().defined()) << p.name;
    EXPECT_EQ(p.value.grad().data_ptr(), p.grad.data_ptr()) << p.name;
  }
  const torch::Tensor x = torch::randn({1, 8, 32});
  model.block_forward(1, x).sum().backward();
  model.block_forward(1, x).sum().backward();
  const ResidentParam& norm = model.resident()[6];  // block1.ln1.weight
  ASSERT_EQ(norm.name, "block1.ln1.weight");
  EXPECT_GT(norm.grad.abs().sum().item<double>(), 0.0);
  EXPECT_EQ(norm.value.grad().data_ptr(), norm.grad.data_ptr()) << "accumulated in place, twice";
}

// What the layer takes: per block the four streamed matrices, then the block's norms and
// adapters by block-relative name, the model's own tensors, and in LoRA mode the adapters as
// the source of the block's gradient moments.
TEST(GptModelLayerBlocks, ListTheModelsOwnTensorsByBlockRelativeName) {
  GptModel model(tiny_model(), TrainMode::lora, LoraConfig{}, 7, torch::TensorOptions().dtype(torch::kFloat32));
  const std::vector<sp::torch_layer::Block> blocks = model.layer_blocks();
  ASSERT_EQ(blocks.size(), 2u);
  EXPECT_EQ(blocks[1].name, "block1");
  EXPECT_EQ(blocks[1].streamed, (std::vector<std::string>{"attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"}));
  EXPECT_EQ(blocks[1].moments_from.size(), 8u);
  EXPECT_EQ(blocks[1].moments_from.front(), "attn.qkv.lora_a");
  const sp::torch_layer::NamedParameters params = blocks[1].parameters();
  ASSERT_EQ(params.size(), 4u + 4u + 8u);
  for (std::size_t i = 0; i < kStreamedPerBlock; ++i) {
    EXPECT_EQ(params[i].first, kStreamedNames[i]);
    EXPECT_TRUE(params[i].second.is_same(model.streamed()[1][i]));
    EXPECT_FALSE(params[i].second.requires_grad()) << "frozen under LoRA";
  }
  EXPECT_EQ(params[4].first, "ln1.weight");
  const torch::Tensor x = torch::randn({2, 8, 32});
  EXPECT_TRUE(torch::equal(blocks[1].forward(x), model.block_forward(1, x)));
  EXPECT_TRUE(model.layer_blocks()[0].moments_from.size() == 8u);
  GptModel full(tiny_model(), TrainMode::full, LoraConfig{}, 7, torch::TensorOptions().dtype(torch::kFloat32));
  EXPECT_TRUE(full.layer_blocks()[0].moments_from.empty()) << "full mode: the streamed masters' gradients";
  EXPECT_TRUE(full.streamed()[0][0].requires_grad());
}

// The same initialization twice, the second with the outlier stress test planted.
struct PlantedModels {
  explicit PlantedModels(const ModelConfig& config)
      : plain(config, TrainMode::full, LoraConfig{}, 7, torch::TensorOptions().dtype(torch::kFloat32)),
        with_outliers(config, TrainMode::full, LoraConfig{}, 7, torch::TensorOptions().dtype(torch::kFloat32)) {
    with_outliers.plant_outlier_channels(7);
  }
  GptModel plain;
  GptModel with_outliers;
};

// The stress test's outlier channel: in a listed block one value row shrinks and the
// attn.proj column that reads it grows by the magnitude, so the block computes what it did
// while attn.proj's rows each carry one large weight; nothing else changes.
TEST(GptModelInit, OutlierChannelsMoveScaleWithoutChangingTheFunction) {
  const torch::TensorOptions fp32 = torch::TensorOptions().dtype(torch::kFloat32);
  ModelConfig stressed = tiny_model();
  stressed.outlier_blocks = {1};
  stressed.outlier_magnitude = 64.0;
  PlantedModels models(stressed);
  GptModel& plain = models.plain;
  GptModel& with_outliers = models.with_outliers;
  const std::int64_t c = stressed.d_model;
  for (std::size_t i = 0; i < kStreamedPerBlock; ++i) {
    EXPECT_TRUE(torch::equal(plain.streamed()[0][i], with_outliers.streamed()[0][i])) << "tensor " << i;
  }
  const BlockWeights& before = plain.streamed()[1];
  const BlockWeights& after = with_outliers.streamed()[1];
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
  const torch::Tensor y_plain = plain.block_forward(1, x);
  const torch::Tensor y_outliers = with_outliers.block_forward(1, x);
  EXPECT_TRUE(torch::allclose(y_plain, y_outliers, 1e-5, 1e-5));

  GptModel again(stressed, TrainMode::full, LoraConfig{}, 7, fp32);
  again.plant_outlier_channels(7);
  EXPECT_TRUE(torch::equal(again.streamed()[1][1], after[1])) << "the channel is a function of the seed";
}

// model.outliers.channels: n channels, one in each of n equal spans of the row, so that each
// of n groups of an image row holds one; the function is still the block's.
TEST(GptModelInit, OutlierChannelsAreSpreadOnePerSpan) {
  ModelConfig stressed = tiny_model();
  stressed.outlier_blocks = {0};
  stressed.outlier_channels = 4;
  PlantedModels models(stressed);
  const std::int64_t c = stressed.d_model;
  const torch::Tensor columns =
      (models.plain.streamed()[0][1] != models.with_outliers.streamed()[0][1]).any(0).nonzero().flatten();
  ASSERT_EQ(columns.numel(), 4);
  for (std::int64_t k = 0; k < 4; ++k) {
    const std::int64_t channel = columns[k].item<std::int64_t>();
    EXPECT_GE(channel, k * c / 4);
    EXPECT_LT(channel, (k + 1) * c / 4);
  }
  const torch::Tensor x = torch::randn({2, 8, c});
  EXPECT_TRUE(
      torch::allclose(models.plain.block_forward(0, x), models.with_outliers.block_forward(0, x), 1e-5, 1e-5));
}

}  // namespace
}  // namespace sp::train
