// BlockGroup (src/block_group.h) on its own: adoption, attach and detach, the checks of its
// parameters, its update's tensors, and the freshness of its images, which only its methods
// write. The layer's own tests (streamed_model_test.cpp) reach the same code through
// StreamedModel; these pin the group's contract where it is defined.
#include "block_group.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace {
namespace tl = sp::torch_layer;
namespace ad = sp::adapters;
using ::testing::HasSubstr;

constexpr std::int64_t kIn = 4, kOut = 3;

tl::BlockGroup::Adoption on_cpu(bool recomputes = true) {
  return {torch::Device(torch::kCPU), torch::TensorOptions().dtype(torch::kFloat32), recomputes, false};
}

// A Linear whose weight streams and whose bias stays resident.
struct Adopted {
  torch::nn::Linear module{kIn, kOut};
  tl::BlockGroup group;
  explicit Adopted(std::vector<std::string> streamed = {"weight"})
      : group(tl::make_block(module, std::move(streamed), "linear"), 0, on_cpu()) {}
};

template <typename F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(nothing thrown)";
}

// Delivered weights as the engine hands them: bf16 bits, rows x cols per streamed tensor.
struct Delivered {
  std::vector<torch::Tensor> bf16;
  ad::BlockView view;
  explicit Delivered(const tl::BlockGroup& group) {
    for (const tl::StreamedParameter& p : group.streamed) {
      bf16.push_back(p.master.to(torch::kBFloat16).contiguous());
      view.tensors.push_back(
          ad::TensorView{&p.name, reinterpret_cast<std::uint16_t*>(bf16.back().data_ptr()), p.rows, p.cols});
    }
  }
};

TEST(BlockGroup, AdoptionKeepsAnFp32HostMasterAndEmptiesTheModulesStreamedTensor) {
  torch::manual_seed(0);
  torch::nn::Linear module(kIn, kOut);
  const torch::Tensor before = module->weight.detach().clone();
  const tl::BlockGroup group(tl::make_block(module, {"weight"}, "linear"), 0, on_cpu());
  ASSERT_EQ(group.streamed.size(), 1u);
  const tl::StreamedParameter& weight = group.streamed[0];
  EXPECT_EQ(weight.name, "weight");
  EXPECT_EQ(weight.master.scalar_type(), torch::kFloat32);
  EXPECT_TRUE(weight.master.device().is_cpu());
  EXPECT_TRUE(weight.master.requires_grad());
  EXPECT_EQ(weight.rows, static_cast<std::uint64_t>(kOut));
  EXPECT_EQ(weight.cols, static_cast<std::uint64_t>(kIn));
  EXPECT_EQ(module->weight.numel(), 0) << "the module's weight is a placeholder between calls";
  EXPECT_TRUE(group.masters.at("weight").equal(before));
  ASSERT_EQ(group.resident.size(), 1u);
  EXPECT_EQ(group.resident[0].unsafeGetTensorImpl(), module->bias.unsafeGetTensorImpl());
  EXPECT_TRUE(group.trainable_masters);
  // One trainable master is the block's autograd anchor, beside its trainable resident bias.
  EXPECT_EQ(group.autograd_inputs.size(), 2u);
}

TEST(BlockGroup, AdoptionRefusesWhatItCannotStreamByName) {
  torch::nn::Linear module(kIn, kOut);
  const auto adopt = [&](std::vector<std::string> streamed, std::string name, std::uint32_t index) {
    return message_of(
        [&] { (void)tl::BlockGroup(tl::make_block(module, std::move(streamed), name), index, on_cpu()); });
  };
  EXPECT_THAT(adopt({"weight", "weight"}, "lin", 0), HasSubstr("lin: parameter 'weight' is listed twice"));
  EXPECT_THAT(adopt({"wieght"}, "lin", 0), HasSubstr("lin has no parameter 'wieght' (it has: weight, bias)"));
  EXPECT_THAT(adopt({}, "", 7), HasSubstr("block7 streams no parameter"));
  EXPECT_EQ(module->weight.numel(), kIn * kOut) << "a refused block's module is left as it was";
}

TEST(BlockGroup, AttachPutsTheDeliveredWeightsInTheModuleAndDetachEmptiesIt) {
  torch::manual_seed(1);
  Adopted a;
  const Delivered delivered(a.group);
  a.group.attach(delivered.view, torch::Device(torch::kCPU), torch::kFloat32, /*trainable=*/true,
                 /*frozen_gradients=*/false);
  EXPECT_TRUE(a.module->weight.equal(delivered.bf16[0].to(torch::kFloat32)));
  EXPECT_TRUE(a.module->weight.requires_grad());
  const torch::Tensor x = torch::randn({2, kIn});
  EXPECT_TRUE(a.group.block.forward(x).allclose(torch::nn::functional::linear(x, a.module->weight, a.module->bias)));
  a.group.detach(torch::TensorOptions().dtype(torch::kFloat32));
  EXPECT_EQ(a.module->weight.numel(), 0);

  // Not trainable (an evaluation, a recompute's forward): the weights take no gradient.
  a.group.attach(delivered.view, torch::Device(torch::kCPU), torch::kFloat32, /*trainable=*/false,
                 /*frozen_gradients=*/false);
  EXPECT_FALSE(a.module->weight.requires_grad());
  a.group.detach(torch::TensorOptions().dtype(torch::kFloat32));
}

TEST(BlockGroup, AFrozenMastersWeightTakesAGradientOnlyWhenTheSignalTableWantsIt) {
  torch::nn::Linear module(kIn, kOut);
  module->weight.set_requires_grad(false);
  tl::BlockGroup group(tl::make_block(module, {"weight"}, "frozen"), 0, on_cpu());
  EXPECT_FALSE(group.trainable_masters);
  const Delivered delivered(group);
  group.attach(delivered.view, torch::Device(torch::kCPU), torch::kFloat32, true, /*frozen_gradients=*/false);
  EXPECT_FALSE(module->weight.requires_grad());
  group.attach(delivered.view, torch::Device(torch::kCPU), torch::kFloat32, true, /*frozen_gradients=*/true);
  EXPECT_TRUE(module->weight.requires_grad());
}

TEST(BlockGroup, AMasterChangedInPlaceIsSeenUntilItsImagesAreRebuilt) {
  Adopted a;
  a.group.note_image_versions(/*owned=*/true);
  EXPECT_EQ(a.group.changed_master(), nullptr);
  EXPECT_FALSE(a.group.evaluation_image_stale());
  {
    torch::NoGradGuard no_grad;
    a.group.streamed[0].master.add_(1.0f);
  }
  ASSERT_NE(a.group.changed_master(), nullptr);
  EXPECT_EQ(a.group.changed_master()->name, "weight");
  a.group.images_rebuilt();
  EXPECT_EQ(a.group.changed_master(), nullptr);
  EXPECT_TRUE(a.group.evaluation_image_stale()) << "the evaluation engine's image is older than the training one's";
  a.group.mark_evaluation_image_fresh();
  EXPECT_FALSE(a.group.evaluation_image_stale());
}

TEST(BlockGroup, ARankThatDoesNotOwnTheBlockTracksNoVersions) {
  Adopted a;
  a.group.note_image_versions(/*owned=*/false);
  {
    torch::NoGradGuard no_grad;
    a.group.streamed[0].master.add_(1.0f);
  }
  EXPECT_EQ(a.group.changed_master(), nullptr) << "its images come from the owner";
  a.group.images_rebuilt();
  a.group.note_image_versions(/*owned=*/true);
  EXPECT_EQ(a.group.changed_master(), nullptr);
}

TEST(BlockGroup, AnUpdateThatWroteTheImageMakesTheEvaluationImageStaleAndASkippedOneDoesNot) {
  Adopted a;
  a.group.mark_updated(/*image_written=*/false);
  EXPECT_TRUE(a.group.updated_in_step());
  EXPECT_FALSE(a.group.evaluation_image_stale());
  EXPECT_TRUE(a.group.take_updated_in_step());
  EXPECT_FALSE(a.group.take_updated_in_step()) << "taken once";
  a.group.mark_updated(/*image_written=*/true);
  EXPECT_TRUE(a.group.evaluation_image_stale());
  a.group.begin_step();
  EXPECT_FALSE(a.group.updated_in_step());
}

TEST(BlockGroup, TheRouteTheRanksLastSharedStartsOnBf16) {
  Adopted a;
  EXPECT_TRUE(a.group.shared_on(sp::Precision::bf16));
  a.group.mark_shared(sp::Precision::int8);
  EXPECT_TRUE(a.group.shared_on(sp::Precision::int8));
  EXPECT_FALSE(a.group.shared_on(sp::Precision::bf16));
  EXPECT_TRUE(a.group.evaluation_image_stale());
}

TEST(BlockGroup, ADeferredUpdateIsTakenOnce) {
  Adopted a;
  EXPECT_FALSE(a.group.update_deferred());
  a.group.defer_update();
  EXPECT_TRUE(a.group.update_deferred());
  EXPECT_TRUE(a.group.take_deferred_update());
  EXPECT_FALSE(a.group.take_deferred_update());
  a.group.defer_update();
  a.group.cancel_deferred_update();
  EXPECT_FALSE(a.group.update_deferred());
}

TEST(BlockGroup, ParametersChangedUnderTheLayerAreRefusedByName) {
  {
    Adopted a;
    a.group.streamed[0].note_engine_storage();
    EXPECT_NO_THROW(a.group.check_parameters_unchanged(true));
    {
      torch::NoGradGuard no_grad;
      a.group.streamed[0].master.set_data(torch::zeros({kOut, kIn}));
    }
    EXPECT_THAT(message_of([&] { a.group.check_parameters_unchanged(/*owned=*/true); }),
                HasSubstr("linear: master 'weight' no longer holds the storage the layer streams from"));
    EXPECT_NO_THROW(a.group.check_parameters_unchanged(/*owned=*/false)) << "a rank that does not own it streams none";
  }
  {
    Adopted a;
    a.group.streamed[0].note_engine_storage();
    // The module's parameter list now holds another tensor under the name (module->weight = ...).
    a.group.block.parameters = [bias = a.module->bias] {
      return tl::NamedParameters{{"weight", torch::zeros({kOut, kIn})}, {"bias", bias}};
    };
    EXPECT_THAT(message_of([&] { a.group.check_parameters_unchanged(true); }),
                HasSubstr("linear: parameter 'weight' was replaced or removed after the model was wrapped"));
  }
  {
    Adopted a;
    a.group.streamed[0].note_engine_storage();
    a.module->to(torch::kFloat64);
    EXPECT_THAT(message_of([&] { a.group.check_parameters_unchanged(true); }),
                HasSubstr("linear: parameter 'weight' is now Double on cpu, and was Float on cpu"));
  }
}

TEST(BlockGroup, TheFusedUpdateNamesAMasterWithoutAGradientAndSeesANonFiniteOne) {
  Adopted a;
  std::map<std::string, tl::MasterMoments> moments;
  EXPECT_THAT(message_of([&] { a.group.fused_update_tensors(moments); }),
              HasSubstr("linear.weight has no fp32 contiguous host gradient"));
  tl::StreamedParameter& weight = a.group.streamed[0];
  weight.master.mutable_grad() = torch::zeros({kOut, kIn});
  EXPECT_THAT(message_of([&] { a.group.fused_update_tensors(moments); }),
              HasSubstr("linear.weight has no AdamW moments"));
  EXPECT_TRUE(a.group.gradients_finite());
  weight.master.mutable_grad()[1][2] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_FALSE(a.group.gradients_finite());
}

TEST(BlockGroup, DroppingTheMastersOfABlockAnotherRankOwnsKeepsAnAnchorForItsBackward) {
  Adopted a;
  a.group.forget_masters();
  EXPECT_EQ(a.group.streamed[0].master.numel(), 0);
  EXPECT_TRUE(a.group.streamed[0].master.requires_grad());
  EXPECT_TRUE(a.group.masters.empty());
  EXPECT_EQ(a.group.autograd_inputs.size(), 2u) << "the bias and the empty trainable master";
  EXPECT_TRUE(a.group.evaluation_image_stale());
}

}  // namespace
