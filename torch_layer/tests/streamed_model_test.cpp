#include "sp/torch_layer/streamed_model.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sp/testing/gpu_gate.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <cstdlib>
#include <filesystem>
#include <thread>
#include <limits>
#include <map>
#include <string>
#include <tuple>
#include <vector>

namespace {
namespace tl = sp::torch_layer;

// A pre-norm residual MLP block: the two matrices stream, the norm and the biases stay.
struct TinyBlockImpl : torch::nn::Module {
  TinyBlockImpl(std::int64_t d, std::int64_t hidden)
      : ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        fc1(register_module("fc1", torch::nn::Linear(d, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, d))) {}
  torch::Tensor forward(const torch::Tensor& x) { return x + fc2(torch::gelu(fc1(ln(x)))); }
  torch::nn::LayerNorm ln;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(TinyBlock);

constexpr std::int64_t kDim = 64, kHidden = 128, kBlocks = 3;

std::vector<TinyBlock> make_blocks(std::uint64_t seed) {
  torch::manual_seed(seed);
  std::vector<TinyBlock> blocks;
  for (int b = 0; b < kBlocks; ++b) blocks.emplace_back(kDim, kHidden);
  return blocks;
}

// The options every test starts from. The suite runs twice (CMakeLists.txt): as the layer's
// default, and with SP_TEST_RECOMPUTE set, recomputing every block in the backward.
tl::StreamedModelOptions test_options() {
  tl::StreamedModelOptions options;
  options.plugin_file = SP_PLUGIN_FILE;
  if (std::getenv("SP_TEST_RECOMPUTE") != nullptr) options.recompute = true;
  return options;
}

bool recomputing() { return test_options().recompute.value_or(false); }

std::string policy_yaml(const std::string& body) { return "selective_precision:\n  telemetry_enabled: false\n" + body; }

std::unique_ptr<tl::StreamedModel> wrap(const std::vector<TinyBlock>& blocks, const std::string& policy_body) {
  std::vector<tl::Block> list;
  for (const TinyBlock& b : blocks) list.push_back(tl::make_block(b, {"fc1.weight", "fc2.weight"}));
  tl::StreamedModelOptions options = test_options();
  options.config_yaml = policy_yaml(policy_body);
  options.config_source = "test policy";
  return std::make_unique<tl::StreamedModel>(std::move(list), options);
}

// The same blocks as plain modules, with the streamed weights rounded to bf16 as the BF16
// route delivers them.
std::vector<TinyBlock> plain_twins(const std::vector<TinyBlock>& blocks, const tl::StreamedModel& model) {
  std::vector<TinyBlock> twins = make_blocks(999);
  torch::NoGradGuard no_grad;
  for (std::size_t b = 0; b < blocks.size(); ++b) {
    auto from = blocks[b]->named_parameters();
    for (auto& item : twins[b]->named_parameters()) {
      const auto& masters = model.masters(static_cast<std::uint32_t>(b));
      const auto it = masters.find(item.key());
      item.value().copy_(it != masters.end() ? it->second.to(torch::kBFloat16).to(torch::kFloat32) : from[item.key()]);
    }
  }
  return twins;
}

torch::Tensor input(std::uint64_t seed) {
  torch::manual_seed(seed);
  return torch::randn({4, 8, kDim});
}

torch::Tensor run_plain(const std::vector<TinyBlock>& blocks, torch::Tensor x) {
  for (TinyBlock b : blocks) x = b->forward(x);
  return x;
}

TEST(StreamedModel, ForwardAndGradientsEqualThePlainModelOnBf16Weights) {
  const auto blocks = make_blocks(1);
  auto model = wrap(blocks, "  mode: off\n");
  const auto twins = plain_twins(blocks, *model);
  const torch::Tensor x = input(2);

  model->begin_step(0);
  const torch::Tensor y = model->forward(x);
  y.pow(2).mean().backward();
  const torch::Tensor expected = run_plain(twins, x);
  expected.pow(2).mean().backward();

  EXPECT_TRUE(torch::equal(y, expected));
  for (std::uint32_t b = 0; b < kBlocks; ++b) {
    const auto twin = twins[b]->named_parameters();
    for (const auto& [name, master] : model->masters(b)) {
      ASSERT_TRUE(master.grad().defined()) << name;
      EXPECT_TRUE(torch::allclose(master.grad(), twin[name].grad(), 1e-5, 1e-7)) << "block " << b << " " << name;
    }
    EXPECT_TRUE(torch::allclose(blocks[b]->fc1->bias.grad(), twin["fc1.bias"].grad(), 1e-5, 1e-7));
    EXPECT_TRUE(torch::allclose(blocks[b]->ln->weight.grad(), twin["ln.weight"].grad(), 1e-5, 1e-7));
  }
  model->post_backward();
  const tl::StepReport report = model->end_step(y.pow(2).mean().item<double>());
  EXPECT_EQ(report.training_passes, 1u);
  // Forward and backward fetch every block once, the last block's two uses sharing one fetch.
  EXPECT_EQ(report.h2d_bytes[sp::Precision::bf16], report.h2d_bytes_all_bf16);
  std::uint64_t one_pass = 0;
  for (std::uint32_t b = 0; b < kBlocks; ++b) one_pass += model->image_bytes(b, sp::Precision::bf16);
  EXPECT_EQ(report.h2d_bytes[sp::Precision::bf16], 2 * one_pass - model->image_bytes(kBlocks - 1, sp::Precision::bf16));
}

// Blocks called one at a time by the host's loop, through Block::call: two inputs (the hidden
// state and a gate that needs a gradient), two outputs (the next state and an auxiliary loss).
tl::BlockCall gated_call(TinyBlock block) {
  return [block](const std::vector<torch::Tensor>& in, const tl::NamedParameters& weights) mutable {
    const auto weight = [&](const std::string& name) {
      for (const auto& [key, value] : weights) {
        if (key == name) return value;
      }
      throw std::invalid_argument(name);
    };
    namespace F = torch::nn::functional;
    const torch::Tensor h = F::linear(torch::gelu(F::linear(block->ln(in[0]), weight("fc1.weight"), block->fc1->bias)),
                                      weight("fc2.weight"), block->fc2->bias);
    const torch::Tensor y = in[0] + h * in[1];
    return std::vector<torch::Tensor>{y, h.pow(2).mean()};
  };
}

TEST(StreamedModel, BlocksWithSeveralInputsAndOutputsCalledOneAtATimeTrainAsPlainAutograd) {
  const auto blocks = make_blocks(5);
  const auto twins = make_blocks(5);
  std::vector<tl::Block> list;
  for (const TinyBlock& b : blocks) {
    tl::Block block = tl::make_block(b, {"fc1.weight", "fc2.weight"});
    block.call = gated_call(b);
    list.push_back(std::move(block));
  }
  tl::StreamedModelOptions options = test_options();
  options.config_yaml = policy_yaml("  mode: off\n");
  tl::StreamedModel model(std::move(list), options);
  {
    torch::NoGradGuard no_grad;
    for (const TinyBlock& t : twins) {
      for (auto& p : t->parameters()) {
        if (p.dim() == 2) p.copy_(p.to(torch::kBFloat16).to(torch::kFloat32));
      }
    }
  }
  // The module's streamed parameters are the masters themselves.
  EXPECT_TRUE(model.masters(1).at("fc2.weight").is_same(blocks[1]->fc2->weight));
  const torch::Tensor x = input(6);
  const torch::Tensor gate = torch::full({kDim}, 0.5).requires_grad_(true);
  const torch::Tensor twin_gate = gate.detach().clone().requires_grad_(true);

  model.begin_step(0);
  torch::Tensor h = x, loss = torch::zeros({});
  for (std::uint32_t b = 0; b < kBlocks; ++b) {
    const std::vector<torch::Tensor> out = model.forward_block(b, {h, gate});
    h = out[0];
    loss = loss + out[1];
  }
  loss = loss + h.mean();
  loss.backward();
  torch::Tensor th = x, twin_loss = torch::zeros({});
  for (std::uint32_t b = 0; b < kBlocks; ++b) {
    const std::vector<torch::Tensor> out = gated_call(twins[b])(
        {th, twin_gate}, {{"fc1.weight", twins[b]->fc1->weight}, {"fc2.weight", twins[b]->fc2->weight}});
    th = out[0];
    twin_loss = twin_loss + out[1];
  }
  twin_loss = twin_loss + th.mean();
  twin_loss.backward();

  EXPECT_TRUE(torch::allclose(loss, twin_loss, 1e-6, 0));
  EXPECT_TRUE(torch::allclose(gate.grad(), twin_gate.grad(), 1e-5, 1e-7));
  for (std::uint32_t b = 0; b < kBlocks; ++b) {
    const auto twin = twins[b]->named_parameters();
    for (const auto& item : blocks[b]->named_parameters()) {
      ASSERT_TRUE(item.value().grad().defined()) << b << " " << item.key();
      EXPECT_TRUE(torch::allclose(item.value().grad(), twin[item.key()].grad(), 1e-5, 1e-7))
          << "block " << b << " " << item.key();
    }
  }
  model.post_backward();
  model.end_step(loss.item<double>());
}

// Several backwards through one forward (retain_graph=True, then a second loss over the same
// outputs): the gradients add up as plain autograd's, the step counts one training pass, and its
// bytes are the forward's and each backward's fetches.
TEST(StreamedModel, SeveralBackwardsThroughOneForwardAddUpAsPlainAutograd) {
  const auto blocks = make_blocks(13);
  auto model = wrap(blocks, "  mode: off\n");
  const auto twins = plain_twins(blocks, *model);
  const torch::Tensor x = input(14);
  const torch::Tensor expected = run_plain(twins, x);
  expected.mean().backward(torch::Tensor(), /*retain_graph=*/true);
  expected.pow(2).mean().backward();

  model->begin_step(0);
  const torch::Tensor y = model->forward(x);
  y.mean().backward(torch::Tensor(), /*retain_graph=*/true);
  y.pow(2).mean().backward();
  for (std::uint32_t b = 0; b < kBlocks; ++b) {
    const auto twin = twins[b]->named_parameters();
    for (const auto& [name, master] : model->masters(b)) {
      EXPECT_TRUE(torch::allclose(master.grad(), twin[name].grad(), 1e-5, 1e-7)) << "block " << b << " " << name;
    }
    EXPECT_TRUE(torch::allclose(blocks[b]->ln->weight.grad(), twin["ln.weight"].grad(), 1e-5, 1e-7));
  }
  model->post_backward();
  const tl::StepReport report = model->end_step(0.0);
  EXPECT_EQ(report.training_passes, 1u);
  EXPECT_EQ(report.eval_h2d_bytes, 0u);
  std::uint64_t one_pass = 0;
  for (std::uint32_t b = 0; b < kBlocks; ++b) one_pass += model->image_bytes(b, sp::Precision::bf16);
  // The first backward shares the last block's fetch with the forward; the second fetches all.
  EXPECT_EQ(report.h2d_bytes[sp::Precision::bf16],
            3 * one_pass - model->image_bytes(kBlocks - 1, sp::Precision::bf16));
}

// A host that calls its blocks in another order than their ids (a model whose layer list is not
// its call order), and changes it: every pass is plain autograd's; the prefetch learns the order
// from the first pass that calls a block elsewhere and follows it from then on, so that only
// that call's fetch ahead goes unused; a block called twice in one pass is refused by name.
TEST(StreamedModel, BlocksCalledInAnyOrderTrainAsPlainAutogradAndThePrefetchFollowsTheOrder) {
  const auto blocks = make_blocks(11);
  auto model = wrap(blocks, "  mode: off\n");
  const auto twins = plain_twins(blocks, *model);
  const torch::Tensor x = input(12);
  const std::vector<std::vector<std::uint32_t>> orders = {{0, 2, 1}, {0, 2, 1}, {1, 0, 2}};
  std::vector<tl::StepReport> reports;
  for (std::size_t step = 0; step < orders.size(); ++step) {
    const std::vector<std::uint32_t>& order = orders[step];
    for (std::uint32_t b = 0; b < kBlocks; ++b) {
      for (auto& [name, master] : model->masters(b)) master.mutable_grad() = torch::Tensor();
      for (auto& p : twins[b]->parameters()) p.mutable_grad() = torch::Tensor();
    }
    torch::Tensor expected = x;
    for (const std::uint32_t b : order) expected = TinyBlock(twins[b])->forward(expected);
    expected.pow(2).mean().backward();
    const auto run_streamed = [&] {
      torch::Tensor h = x;
      for (const std::uint32_t b : order) h = model->forward_block(b, {h}).at(0);
      return h;
    };

    model->begin_step(static_cast<std::int64_t>(step));
    const torch::Tensor y = run_streamed();
    y.pow(2).mean().backward();
    EXPECT_TRUE(torch::allclose(y, expected, 1e-5, 1e-6)) << "step " << step;
    for (std::uint32_t b = 0; b < kBlocks; ++b) {
      const auto twin = twins[b]->named_parameters();
      for (const auto& [name, master] : model->masters(b)) {
        ASSERT_TRUE(master.grad().defined()) << name;
        EXPECT_TRUE(torch::allclose(master.grad(), twin[name].grad(), 1e-5, 1e-7))
            << "step " << step << " block " << b << " " << name;
      }
    }
    model->post_backward();
    reports.push_back(model->end_step(0.0));
    // Without a gradient (the evaluation engine learns the order too).
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(torch::allclose(run_streamed(), expected.detach(), 1e-5, 1e-6)) << "step " << step;
  }
  // A step fetches each block for the forward and again for the backward, the turning block's
  // two uses sharing one fetch. The first pass called block 2 where block 1 was fetched ahead:
  // that fetch went unused, once. A pass that begins with another block moves the order before
  // the prefetch begins.
  std::uint64_t one_pass = 0;
  for (std::uint32_t b = 0; b < kBlocks; ++b) one_pass += model->image_bytes(b, sp::Precision::bf16);
  for (std::size_t step = 0; step < reports.size(); ++step) {
    const std::uint32_t turning = orders[step].back();
    const std::uint64_t unused = step == 0 ? 1 : 0;
    EXPECT_EQ(reports[step].prefetch_unused, unused) << "step " << step;
    EXPECT_EQ(reports[step].prefetch_hits, 2 * kBlocks - 1) << "step " << step;
    EXPECT_EQ(reports[step].prefetch_misses, 0u) << "step " << step;
    EXPECT_EQ(reports[step].h2d_bytes[sp::Precision::bf16],
              2 * one_pass - model->image_bytes(turning, sp::Precision::bf16) +
                  unused * model->image_bytes(1, sp::Precision::bf16))
        << "step " << step;
  }

  model->begin_step(static_cast<std::int64_t>(orders.size()));
  EXPECT_TRUE(model->opens_training_pass(1));
  const torch::Tensor h1 = model->forward_block(1, {x}).at(0);
  EXPECT_FALSE(model->opens_training_pass(2));
  torch::Tensor h0 = model->forward_block(0, {h1}).at(0);
  try {
    model->forward_block(0, {h0});
    FAIL() << "a block called twice in one pass was accepted";
  } catch (const std::logic_error& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("block0 was called twice in one training pass, before block2 was "
                                               "called: a pass calls every streamed block once, in any order"));
  }
  // The order's first block opens the next pass, leaving this one unfinished; so does any block
  // once the host dropped what the pass computed last (it exited early).
  EXPECT_TRUE(model->opens_training_pass(1));
  EXPECT_FALSE(model->opens_training_pass(2));
  h0 = torch::Tensor();
  EXPECT_TRUE(model->opens_training_pass(2));
  model->abort_step();
}

// A residual block that draws from the random stream (dropout) and records the dtype its
// matmul computed in, call by call: the forward, then the backward's recompute.
struct DropoutBlockImpl : torch::nn::Module {
  explicit DropoutBlockImpl(double p) : fc(register_module("fc", torch::nn::Linear(kDim, kDim))), p(p) {}
  torch::Tensor forward(const torch::Tensor& x) {
    const torch::Tensor h = fc(x);
    matmul_dtypes.push_back(h.scalar_type());
    return x + torch::dropout(torch::tanh(h), p, /*train=*/true);
  }
  torch::nn::Linear fc;
  double p;
  std::vector<torch::ScalarType> matmul_dtypes;
};
TORCH_MODULE(DropoutBlock);

struct DropoutRun {
  std::vector<DropoutBlock> streamed_blocks, plain;
  std::unique_ptr<tl::StreamedModel> model;
  explicit DropoutRun(double p) {
    torch::manual_seed(21);
    std::vector<tl::Block> list;
    for (int b = 0; b < kBlocks; ++b) {
      streamed_blocks.emplace_back(p);
      plain.emplace_back(p);
      torch::NoGradGuard no_grad;
      plain.back()->fc->weight.copy_(streamed_blocks.back()->fc->weight.to(torch::kBFloat16).to(torch::kFloat32));
      plain.back()->fc->bias.copy_(streamed_blocks.back()->fc->bias);
      list.push_back(tl::make_block(streamed_blocks.back(), {"fc.weight"}));
    }
    tl::StreamedModelOptions options = test_options();
    options.config_yaml = policy_yaml("  mode: off\n");
    model = std::make_unique<tl::StreamedModel>(std::move(list), options);
  }
  torch::Tensor run_plain(torch::Tensor x) {
    for (DropoutBlock b : plain) x = b->forward(x);
    return x;
  }
};

TEST(StreamedModel, TheRecomputeDrawsTheForwardsDropoutMasks) {
  DropoutRun run(0.5);
  const torch::Tensor x = input(3);

  torch::manual_seed(77);
  run.model->begin_step(0);
  const torch::Tensor y = run.model->forward(x);
  y.pow(2).mean().backward();
  run.model->post_backward();
  const torch::Tensor after_streamed = torch::randn({4});

  torch::manual_seed(77);
  const torch::Tensor expected = run.run_plain(x);
  expected.pow(2).mean().backward();
  const torch::Tensor after_plain = torch::randn({4});

  EXPECT_TRUE(torch::equal(y, expected));
  for (std::uint32_t b = 0; b < kBlocks; ++b) {
    const torch::Tensor& got = run.model->masters(b).at("fc.weight").grad();
    const torch::Tensor& want = run.plain[b]->fc->weight.grad();
    EXPECT_TRUE(torch::allclose(got, want, 1e-5, 1e-7))
        << "block " << b << ": " << ((got - want).norm() / want.norm()).item<double>() << " relative";
  }
  EXPECT_TRUE(torch::equal(after_streamed, after_plain)) << "the recompute left the caller's random stream moved";
  run.model->end_step(0.0);
}

// Kept activations: the forward alone computes; the recompute computes again, under the forward's
// autocast.
TEST(StreamedModel, ABlockUnderBf16AutocastComputesInBf16InEveryPass) {
  DropoutRun run(0.0);
  const torch::Tensor x = input(4);
  run.model->begin_step(0);
  torch::Tensor y;
  {
    at::autocast::set_autocast_enabled(c10::DeviceType::CPU, true);
    at::autocast::set_autocast_dtype(c10::DeviceType::CPU, at::kBFloat16);
    y = run.model->forward(x);
    at::autocast::set_autocast_enabled(c10::DeviceType::CPU, false);
    at::autocast::clear_cache();
  }
  y.to(torch::kFloat32).pow(2).mean().backward();  // outside autocast, as a training loop runs it
  run.model->post_backward();
  const std::vector<torch::ScalarType> expected(recomputing() ? 2 : 1, torch::kBFloat16);
  for (const DropoutBlock& b : run.streamed_blocks) EXPECT_EQ(b->matmul_dtypes, expected);
  EXPECT_FALSE(at::autocast::is_autocast_enabled(c10::DeviceType::CPU));
  run.model->end_step(0.0);
}

TEST(StreamedModel, MicroBatchesAccumulateAndEvaluationForwardsMayComeBetween) {
  const auto blocks = make_blocks(3);
  auto model = wrap(blocks, "  mode: off\n");
  const auto twins = plain_twins(blocks, *model);
  const torch::Tensor a = input(4), b = input(5);

  model->begin_step(0);
  model->forward(a).pow(2).mean().backward();
  {
    torch::NoGradGuard no_grad;
    const torch::Tensor eval = model->forward(b);
    EXPECT_TRUE(torch::equal(eval, run_plain(twins, b)));
  }
  model->forward(b).pow(2).mean().backward();
  run_plain(twins, a).pow(2).mean().backward();
  run_plain(twins, b).pow(2).mean().backward();
  for (std::uint32_t i = 0; i < kBlocks; ++i) {
    const auto twin = twins[i]->named_parameters();
    for (const auto& [name, master] : model->masters(i)) {
      EXPECT_TRUE(torch::allclose(master.grad(), twin[name].grad(), 1e-5, 1e-7)) << "block " << i << " " << name;
    }
  }
  model->post_backward();
  const tl::StepReport report = model->end_step(0.0);
  EXPECT_EQ(report.training_passes, 2u);
  EXPECT_GT(report.eval_h2d_bytes, 0u);
}

// Two grad-mode forwards before their backwards (a contrastive loss): each pass keeps its own
// forward's state, and the engine serves one pass's backward at a time, in the order autograd
// runs them: one loss over both (the later pass first), or a backward per pass in any order.
TEST(StreamedModel, TwoForwardsBeforeTheirBackwardsTrainAsPlainAutograd) {
  const auto blocks = make_blocks(6);
  auto model = wrap(blocks, "  mode: off\n");
  const auto twins = plain_twins(blocks, *model);
  const torch::Tensor a = input(7), b = input(8);
  const auto expect_plain_gradients = [&] {
    for (std::uint32_t i = 0; i < kBlocks; ++i) {
      const auto twin = twins[i]->named_parameters();
      for (const auto& [name, master] : model->masters(i)) {
        EXPECT_TRUE(torch::allclose(master.grad(), twin[name].grad(), 1e-5, 1e-7)) << "block " << i << " " << name;
      }
      EXPECT_TRUE(torch::allclose(blocks[i]->fc2->bias.grad(), twin["fc2.bias"].grad(), 1e-5, 1e-7));
    }
  };
  const auto zero = [&] {
    for (TinyBlock t : twins) t->zero_grad();
    for (TinyBlock blk : blocks) blk->zero_grad();
    for (torch::Tensor& master : model->master_parameters()) master.mutable_grad() = torch::Tensor();
  };
  for (std::int64_t step = 0; step < 3; ++step) {
    model->begin_step(step);
    const torch::Tensor ya = model->forward(a), yb = model->forward(b);
    if (step == 0) {
      (ya * yb).mean().backward();
    } else {
      // A backward per pass: the first pass's after the second's forward, then the second's.
      (step == 1 ? ya : yb).pow(2).mean().backward();
      (step == 1 ? yb : ya).pow(2).mean().backward();
    }
    if (step == 0) {
      (run_plain(twins, a) * run_plain(twins, b)).mean().backward();
    } else {
      run_plain(twins, a).pow(2).mean().backward();
      run_plain(twins, b).pow(2).mean().backward();
    }
    expect_plain_gradients();
    model->post_backward();
    const tl::StepReport report = model->end_step(0.0);
    EXPECT_EQ(report.training_passes, 2u);
    // Each pass fetched every block for its forward and its backward; an engine step that the
    // other pass ended early wasted at most its prefetch window (one fetch), twice a step.
    std::uint64_t one_pass = 0;
    for (std::uint32_t i = 0; i < kBlocks; ++i) one_pass += model->image_bytes(i, sp::Precision::bf16);
    EXPECT_LE(report.h2d_bytes.total(), 4 * one_pass + 2 * model->image_bytes(0, sp::Precision::bf16)) << step;
    EXPECT_GE(report.h2d_bytes.total(), 4 * one_pass - 2 * model->image_bytes(kBlocks - 1, sp::Precision::bf16));
    zero();
  }
}

TEST(StreamedModel, AForwardWhoseGraphIsDroppedCountsAsAnEvaluation) {
  const auto blocks = make_blocks(6);
  auto model = wrap(blocks, "  mode: off\n");
  model->begin_step(0);
  { const torch::Tensor dropped = model->forward(input(7)).sum(); }
  model->forward(input(8)).sum().backward();
  model->post_backward();
  const tl::StepReport report = model->end_step(0.0);
  // The forward without a backward trained nothing: an evaluation's bytes.
  EXPECT_EQ(report.training_passes, 1u);
  EXPECT_GT(report.eval_h2d_bytes, 0u);
  EXPECT_LT(report.eval_h2d_bytes, report.h2d_bytes.total());  // no backward's fetches
  EXPECT_EQ(model->evaluation_h2d_bytes(), report.eval_h2d_bytes);
}

TEST(StreamedModel, StaticPolicyRoutesBlocksThroughInt8AndNf4) {
  const auto blocks = make_blocks(9);
  auto model =
      wrap(blocks, "  mode: static\n  tiers: [bf16, int8, nf4]\n  force_int8_blocks: [1]\n  force_nf4_blocks: [2]\n");
  for (std::int64_t step = 0; step < 2; ++step) {
    model->begin_step(step);
    model->forward(input(10 + step)).pow(2).mean().backward();
    model->post_backward();
    const tl::StepReport report = model->end_step(1.0);
    EXPECT_EQ(report.routes, (std::vector<sp::Precision>{sp::Precision::bf16, sp::Precision::int8, sp::Precision::nf4}));
    if (step == 1) {
      EXPECT_GT(report.h2d_bytes[sp::Precision::int8], 0u);
      EXPECT_GT(report.h2d_bytes[sp::Precision::nf4], 0u);
      EXPECT_LT(report.h2d_bytes[sp::Precision::bf16] + report.h2d_bytes[sp::Precision::int8] + report.h2d_bytes[sp::Precision::nf4], report.h2d_bytes_all_bf16);
    }
  }
  EXPECT_LT(model->image_bytes(0, sp::Precision::nf4), model->image_bytes(0, sp::Precision::int8));
  EXPECT_LT(model->image_bytes(0, sp::Precision::int8), model->image_bytes(0, sp::Precision::bf16));
}

TEST(StreamedModel, CalibrationMeasuresEachFormatAgainstBf16) {
  const auto blocks = make_blocks(12);
  auto model = wrap(blocks, "  mode: off\n");
  // A gate under which nothing pays must not turn the measurement into BF16 against BF16.
  sp::adapters::TransferGate nothing_pays;
  nothing_pays.pays[sp::Precision::int8] = nothing_pays.pays[sp::Precision::nf4] = std::vector<bool>(kBlocks, false);
  model->set_transfer_gate(nothing_pays);
  const tl::CalibrationErrors errors = model->calibrate({input(13), input(14)});
  ASSERT_EQ(errors[sp::Precision::int8].size(), static_cast<std::size_t>(kBlocks));
  for (std::uint32_t b = 0; b < kBlocks; ++b) {
    EXPECT_GT(errors[sp::Precision::int8][b], 0.0) << b;
    EXPECT_LT(errors[sp::Precision::int8][b], 0.05) << b;
    EXPECT_GT(errors[sp::Precision::nf4][b], errors[sp::Precision::int8][b]) << b;
    EXPECT_LT(errors[sp::Precision::nf4][b], 0.5) << b;
  }
}

TEST(StreamedModel, StockOptimizerTrainsTheMastersAndImagesFollow) {
  const auto blocks = make_blocks(15);
  auto model = wrap(blocks, "  mode: off\n");
  std::vector<torch::Tensor> params = model->master_parameters();
  for (const torch::Tensor& r : model->resident_parameters()) params.push_back(r);
  torch::optim::AdamW optimizer(params, torch::optim::AdamWOptions(1e-2));
  const torch::Tensor x = input(16);
  const torch::Tensor target = torch::zeros({4, 8, kDim});
  double first = 0, last = 0;
  for (std::int64_t step = 0; step < 8; ++step) {
    optimizer.zero_grad();
    model->begin_step(step);
    const torch::Tensor loss = torch::mse_loss(model->forward(x), target);
    loss.backward();
    model->post_backward();
    optimizer.step();
    model->end_step(loss.item<double>());
    (step == 0 ? first : last) = loss.item<double>();
  }
  EXPECT_LT(last, 0.8 * first);
  // The evaluation engine delivers the updated masters too.
  const auto twins = plain_twins(blocks, *model);
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(torch::equal(model->forward(x), run_plain(twins, x)));
}

// Block b's INT8 image of `master` as its arithmetic defines it (sp/kernels/quantize.h): one
// scale per row, decoded to bf16, as the engines deliver it.
torch::Tensor int8_image(const torch::Tensor& master) {
  const torch::Tensor absmax = master.abs().amax({1}, /*keepdim=*/true);
  const torch::Tensor scale = torch::where(absmax == 0, torch::ones_like(absmax), absmax / 127.0f)
                                  .clamp_min(std::numeric_limits<float>::min());
  const torch::Tensor codes = torch::clamp(torch::round(master * (1.0f / scale)), -127, 127);
  return (codes * scale).to(torch::kBFloat16).to(torch::kFloat32);
}

// Each term for each quantized route of the table: "loss_cost.int8", "loss_cost.nf4",
// "first_order.int8", ... in the three-route build.
const std::vector<std::string> kSignalColumns = [] {
  std::vector<std::string> out;
  for (const char* term : {"loss_cost.", "first_order.", "second_order."}) {
    for (const sp::Precision tier : sp::kQuantizedPrecisions)
      out.push_back(term + std::string(sp::precision_name(tier)));
  }
  return out;
}();

std::size_t signal_column(const std::string& term, sp::Precision tier) {
  const auto found =
      std::find(kSignalColumns.begin(), kSignalColumns.end(), term + "." + std::string(sp::precision_name(tier)));
  return static_cast<std::size_t>(found - kSignalColumns.begin());
}

TEST(PolicyV3, TheSignalTableHoldsEachBlocksTaylorTermsPerTier) {
  const auto blocks = make_blocks(41);
  auto model = wrap(blocks, "  mode: budget\n  budget: {bytes: 0.6}\n  tiers: [bf16, int8, nf4]\n");
  EXPECT_TRUE(model->unit_signals().names.empty());
  model->begin_step(0);
  model->forward(input(42)).pow(2).mean().backward();
  model->post_backward();
  const sp::host::UnitSignalTable& table = model->unit_signals();
  ASSERT_EQ(table.names, kSignalColumns);
  EXPECT_EQ(table.samples, 4u);  // the leading dimension of input()
  ASSERT_EQ(table.values.size(), static_cast<std::size_t>(kBlocks) * kSignalColumns.size());
  const auto at = [&](std::int64_t b, std::size_t column) { return table.values[b * kSignalColumns.size() + column]; };
  using sp::Precision;
  const std::size_t first_int8 = signal_column("first_order", Precision::int8);
  const std::size_t second_int8 = signal_column("second_order", Precision::int8);
  sp::PerPrecision<double> mean_first{};
  for (std::int64_t b = 0; b < kBlocks; ++b) {
    double first = 0, second = 0;
    for (const auto& [name, master] : model->masters(static_cast<std::uint32_t>(b))) {
      const torch::Tensor d = (int8_image(master) - master).to(torch::kFloat64);
      const torch::Tensor g = master.grad().to(torch::kFloat64);
      first += (g * d).sum().item<double>();
      second += (g * g * d * d).sum().item<double>();
    }
    ASSERT_GT(second, 0.0);
    EXPECT_NEAR(at(b, first_int8), first, 1e-9 * std::abs(first) + 1e-18);
    EXPECT_NEAR(at(b, second_int8), 0.5 * 4 * second, 1e-9 * second);  // B/2 x the sum, B = 4 examples
    // NF4's images are the coarser.
    EXPECT_GT(at(b, signal_column("second_order", Precision::nf4)), at(b, second_int8));
    for (const Precision t : sp::kQuantizedPrecisions)
      mean_first[t] += at(b, signal_column("first_order", t)) / kBlocks;
  }
  for (std::int64_t b = 0; b < kBlocks; ++b) {
    for (const Precision t : sp::kQuantizedPrecisions) {
      const double second_t = at(b, signal_column("second_order", t));
      const double expected = second_t + at(b, signal_column("first_order", t)) - mean_first[t];
      EXPECT_NEAR(at(b, signal_column("loss_cost", t)), expected, 1e-12 * (std::abs(expected) + second_t));
    }
  }
  // The plugin took it: its first smoothed cost is the table's, and the allocation keeps the budget.
  const std::optional<std::vector<double>> int8_costs = model->unit_costs(sp::Precision::int8);
  ASSERT_TRUE(int8_costs.has_value());
  for (std::int64_t b = 0; b < kBlocks; ++b) {
    EXPECT_DOUBLE_EQ((*int8_costs)[b], at(b, signal_column("loss_cost", Precision::int8)));
  }
  const std::optional<sp_budget_status_v1> budget = model->budget_status();
  ASSERT_TRUE(budget.has_value());
  EXPECT_EQ(budget->kind, SP_BUDGET_BYTES);
  EXPECT_EQ(budget->met, 1u);
  EXPECT_EQ(budget->decided_at_step, 0);
  EXPECT_EQ(budget->reads_step_signals, 1u);
  const tl::StepReport report = model->end_step(1.0);
  std::uint64_t planned = 0, all_bf16 = 0;
  for (std::uint32_t b = 0; b < kBlocks; ++b) {
    planned += model->image_bytes(b, report.routes[b]);
    all_bf16 += model->image_bytes(b, sp::Precision::bf16);
  }
  EXPECT_LE(static_cast<double>(planned), 0.6 * static_cast<double>(all_bf16));
}

TEST(PolicyV3, APolicyWithoutABudgetGetsNoSignalTable) {
  const auto blocks = make_blocks(43);
  auto model = wrap(blocks, "  mode: dynamic\n");
  model->begin_step(0);
  model->forward(input(44)).pow(2).mean().backward();
  model->post_backward();
  model->end_step(1.0);
  EXPECT_TRUE(model->unit_signals().names.empty());
  const std::optional<sp_budget_status_v1> budget = model->budget_status();
  ASSERT_TRUE(budget.has_value());
  EXPECT_EQ(budget->kind, SP_BUDGET_NONE);
}

// Policy v4 takes a table measured outside any step (calibrate()'s): before the first step it
// routes the first fetch; a table the plugin refuses changes nothing; inside a step it is refused.
TEST(PolicyV4, AMeasuredTableBeforeTheFirstStepRoutesTheFirstFetch) {
  auto model = wrap(make_blocks(47), "  mode: measured\n  budget: {bytes: 0.9}\n  tiers: [bf16, nf4]\n");
  const auto nf4_blocks = [&] {
    std::vector<std::size_t> out;
    for (std::size_t b = 0; b < static_cast<std::size_t>(kBlocks); ++b) {
      if (model->routes()[b] == sp::Precision::nf4) out.push_back(b);
    }
    return out;
  };
  ASSERT_EQ(nf4_blocks().size(), 1u) << "the prior meets the budget from the first fetch";
  EXPECT_NE(nf4_blocks()[0], 2u) << "use_more_bits keeps the last unit wider";
  sp::host::UnitSignalTable table;
  table.names = {"measured_cost.nf4", "measured_cost_se.nf4", "measured_cost_upper.nf4"};
  table.values = {0.3, 0.01, 0.32, 0.1, 0.01, 0.12, 0.5, 0.01, 0.52};  // block 1 costs least
  table.samples = 64;
  ASSERT_TRUE(model->set_unit_signals(table));
  EXPECT_EQ(nf4_blocks(), std::vector<std::size_t>{1});
  EXPECT_EQ(model->unit_signals().names, table.names);
  const std::optional<std::vector<double>> costs = model->unit_costs(sp::Precision::nf4);
  ASSERT_TRUE(costs.has_value());
  EXPECT_DOUBLE_EQ(costs->at(1), 0.12);

  sp::host::UnitSignalTable broken = table;
  broken.values[5] = 0.05;  // block 1's upper bound below its mean
  EXPECT_FALSE(model->set_unit_signals(broken));
  EXPECT_EQ(nf4_blocks(), std::vector<std::size_t>{1});

  model->begin_step(0);
  EXPECT_THROW(model->set_unit_signals(table), std::logic_error);
  model->forward(input(48)).pow(2).mean().backward();
  model->post_backward();
  model->end_step(1.0);
  EXPECT_EQ(nf4_blocks(), std::vector<std::size_t>{1}) << "the step kept the measured routes";
  // v4 reads no Taylor table (ABI 1.4), so the step measured none: the last table is still the
  // measurement.
  const std::optional<sp_budget_status_v1> budget = model->budget_status();
  ASSERT_TRUE(budget.has_value());
  EXPECT_EQ(budget->reads_step_signals, 0u);
  EXPECT_EQ(model->unit_signals().names, table.names);
}

// AdamW moments for every master of a model, by block and parameter name.
struct Moments {
  std::vector<std::map<std::string, torch::Tensor>> exp_avg, exp_avg_sq;
  explicit Moments(const tl::StreamedModel& model) {
    for (std::uint32_t b = 0; b < model.num_blocks(); ++b) {
      exp_avg.emplace_back();
      exp_avg_sq.emplace_back();
      for (const auto& [name, master] : model.masters(b)) {
        exp_avg.back().emplace(name, torch::zeros_like(master));
        exp_avg_sq.back().emplace(name, torch::zeros_like(master));
      }
    }
  }
  std::map<std::string, tl::MasterMoments> of(std::uint32_t b) {
    std::map<std::string, tl::MasterMoments> out;
    for (auto& [name, m] : exp_avg[b]) {
      out.emplace(name, tl::MasterMoments{m.data_ptr<float>(), exp_avg_sq[b].at(name).data_ptr<float>(), true});
    }
    return out;
  }
  // Every block's, as update_masters_during_backward() takes them.
  std::vector<std::map<std::string, tl::MasterMoments>> all() {
    std::vector<std::map<std::string, tl::MasterMoments>> out;
    for (std::size_t b = 0; b < exp_avg.size(); ++b) out.push_back(of(static_cast<std::uint32_t>(b)));
    return out;
  }
};

void zero_master_grads(tl::StreamedModel& model) {
  for (torch::Tensor& p : model.master_parameters()) {
    if (p.grad().defined()) p.mutable_grad().zero_();
  }
}

// update_masters() against the kernels' AdamW on the masters followed by end_step's rebuild: the
// same masters bit for bit and the same delivered weights, on each route.
TEST(StreamedModel, FusedUpdateEqualsAdamWThenTheRebuild) {
  const auto blocks_fused = make_blocks(21);
  const auto blocks_unfused = make_blocks(21);
  const std::string policy =
      "  mode: static\n  tiers: [bf16, int8, nf4]\n  force_int8_blocks: [1]\n  force_nf4_blocks: [2]\n";
  auto fused = wrap(blocks_fused, policy);
  auto unfused = wrap(blocks_unfused, policy);
  Moments fused_moments(*fused), unfused_moments(*unfused);
  const torch::Tensor x = input(22);
  for (std::int64_t step = 0; step < 3; ++step) {
    const sp::kernels::AdamWStep adam =
        sp::kernels::make_adamw_step(sp::kernels::AdamWHyperparameters{0.9, 0.95, 1e-8, 0.1}, 1e-2, step + 1, 1.0);
    for (auto* model : {fused.get(), unfused.get()}) {
      zero_master_grads(*model);
      model->begin_step(step);
      model->forward(x).pow(2).mean().backward();
      model->post_backward();
    }
    for (std::uint32_t b = 0; b < kBlocks; ++b) {
      fused->update_masters(b, adam, fused_moments.of(b));
      for (const auto& [name, master] : unfused->masters(b)) {
        torch::Tensor grad = master.grad();
        sp::kernels::adamw_update(
            adam, sp::kernels::AdamWTensor{
                      master.data_ptr<float>(),
                      grad.data_ptr<float>(),
                      unfused_moments.exp_avg[b].at(name).data_ptr<float>(),
                      unfused_moments.exp_avg_sq[b].at(name).data_ptr<float>(),
                      {static_cast<std::uint64_t>(master.size(0)), static_cast<std::uint64_t>(master.size(1))},
                      true});
      }
    }
    const tl::StepReport fused_report = fused->end_step(1.0);
    unfused->end_step(1.0);
    EXPECT_EQ(fused_report.routes, (std::vector<sp::Precision>{sp::Precision::bf16, sp::Precision::int8, sp::Precision::nf4}));
    for (std::uint32_t b = 0; b < kBlocks; ++b) {
      for (const auto& [name, master] : fused->masters(b)) {
        EXPECT_TRUE(torch::equal(master, unfused->masters(b).at(name))) << "step " << step << " " << name;
      }
    }
  }
  // Both engines deliver the same weights: the training route and the evaluation engine.
  fused->begin_step(3);
  unfused->begin_step(3);
  EXPECT_TRUE(torch::equal(fused->forward(x), unfused->forward(x)));
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(torch::equal(fused->forward(x), unfused->forward(x)));
}

TEST(StreamedModel, FusedUpdateOutsideItsWindowOrWithoutMomentsIsRefused) {
  const auto blocks = make_blocks(23);
  auto model = wrap(blocks, "  mode: off\n");
  Moments moments(*model);
  const sp::kernels::AdamWStep adam = sp::kernels::make_adamw_step({}, 1e-2, 1, 1.0);
  model->begin_step(0);
  model->forward(input(24)).pow(2).mean().backward();
  EXPECT_THROW(model->update_masters(0, adam, moments.of(0)), std::logic_error);  // before post_backward
  model->post_backward();
  std::map<std::string, tl::MasterMoments> partial = moments.of(1);
  partial.erase("fc2.weight");
  const torch::Tensor before = model->masters(1).at("fc1.weight").clone();
  try {
    model->update_masters(1, adam, partial);
    ADD_FAILURE() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("fc2.weight"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(torch::equal(before, model->masters(1).at("fc1.weight")));
  model->update_masters(1, adam, moments.of(1));
  EXPECT_FALSE(torch::equal(before, model->masters(1).at("fc1.weight")));
  EXPECT_THROW(model->update_masters(1, adam, moments.of(1)), std::logic_error);  // twice in one step
  EXPECT_THROW(model->update_masters(kBlocks, adam, moments.of(1)), std::invalid_argument);
  model->end_step(1.0);
}

// The update during the backward against update_masters() after post_backward(), with the
// same step constants: the same masters bit for bit, the same delivered weights, on every
// route, over steps; then a block whose gradient is not finite is left as it was, the others
// are updated.
TEST(StreamedModel, UpdateDuringTheBackwardEqualsTheUpdateAfterIt) {
  const auto blocks_overlapped = make_blocks(31);
  const auto blocks_after = make_blocks(31);
  const std::string policy =
      "  mode: static\n  tiers: [bf16, int8, nf4]\n  force_int8_blocks: [1]\n  force_nf4_blocks: [2]\n";
  auto overlapped = wrap(blocks_overlapped, policy);
  auto after = wrap(blocks_after, policy);
  Moments overlapped_moments(*overlapped), after_moments(*after);
  const torch::Tensor x = input(32);
  for (std::int64_t step = 0; step < 3; ++step) {
    const sp::kernels::AdamWStep adam =
        sp::kernels::make_adamw_step(sp::kernels::AdamWHyperparameters{0.9, 0.95, 1e-8, 0.1}, 1e-2, step + 1, 0.7);
    zero_master_grads(*overlapped);
    overlapped->begin_step(step);
    overlapped->update_masters_during_backward(adam, overlapped_moments.all());
    const torch::Tensor first_master = overlapped->masters(0).at("fc1.weight").clone();
    overlapped->forward(x).pow(2).mean().backward();
    if (step == 0) {
      // The backward did the updates: an evaluation forward waits for them, and reads them.
      torch::NoGradGuard no_grad;
      overlapped->forward(x);
      EXPECT_FALSE(torch::equal(first_master, overlapped->masters(0).at("fc1.weight")));
    }
    overlapped->post_backward();
    const tl::StepReport report = overlapped->end_step(1.0);
    EXPECT_TRUE(report.updates_skipped.empty());

    zero_master_grads(*after);
    after->begin_step(step);
    after->forward(x).pow(2).mean().backward();
    after->post_backward();
    for (std::uint32_t b = 0; b < kBlocks; ++b) after->update_masters(b, adam, after_moments.of(b));
    after->end_step(1.0);
    for (std::uint32_t b = 0; b < kBlocks; ++b) {
      for (const auto& [name, master] : overlapped->masters(b)) {
        EXPECT_TRUE(torch::equal(master, after->masters(b).at(name))) << "step " << step << " " << name;
      }
    }
  }
  overlapped->begin_step(3);
  after->begin_step(3);
  EXPECT_TRUE(torch::equal(overlapped->forward(x), after->forward(x)));
  {
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(torch::equal(overlapped->forward(x), after->forward(x)));
  }
  overlapped->abort_step();

  // A NaN in the loss's gradient reaches every block: none is updated, in the backward's order.
  zero_master_grads(*overlapped);
  overlapped->begin_step(4);
  const sp::kernels::AdamWStep adam = sp::kernels::make_adamw_step({}, 1e-2, 5, 1.0);
  overlapped->update_masters_during_backward(adam, overlapped_moments.all());
  std::vector<torch::Tensor> before;
  for (std::uint32_t b = 0; b < kBlocks; ++b) before.push_back(overlapped->masters(b).at("fc1.weight").clone());
  const torch::Tensor y = overlapped->forward(x);
  (y.pow(2).mean() + y.sum() * std::numeric_limits<float>::quiet_NaN() * 0.0f).backward();
  overlapped->post_backward();
  const tl::StepReport report = overlapped->end_step(1.0);
  EXPECT_EQ(report.updates_skipped, (std::vector<std::uint32_t>{2, 1, 0}));
  for (std::uint32_t b = 0; b < kBlocks; ++b) {
    EXPECT_TRUE(torch::equal(before[b], overlapped->masters(b).at("fc1.weight"))) << b;
  }
}

TEST(StreamedModel, UpdateDuringTheBackwardIsArmedOncePerStepBeforeTheBackward) {
  const auto blocks = make_blocks(33);
  auto model = wrap(blocks, "  mode: off\n");
  Moments moments(*model);
  const sp::kernels::AdamWStep adam = sp::kernels::make_adamw_step({}, 1e-2, 1, 1.0);
  const std::vector<std::map<std::string, tl::MasterMoments>> all = moments.all();
  EXPECT_THROW(model->update_masters_during_backward(adam, all), std::logic_error);  // outside a step
  model->begin_step(0);
  std::vector<std::map<std::string, tl::MasterMoments>> partial = all;
  partial[1].erase("fc2.weight");
  try {
    model->update_masters_during_backward(adam, partial);
    ADD_FAILURE() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("fc2.weight"), std::string::npos) << e.what();
  }
  EXPECT_THROW(model->update_masters_during_backward(adam, {all[0]}), std::invalid_argument);  // one map per block
  model->update_masters_during_backward(adam, all);
  EXPECT_THROW(model->update_masters_during_backward(adam, all), std::logic_error);  // twice
  const torch::Tensor before = model->masters(0).at("fc1.weight").clone();
  // No backward runs: post_backward() is refused before it updates any armed block.
  EXPECT_THAT([&] { model->post_backward(); },
              ::testing::ThrowsMessage<std::logic_error>(::testing::HasSubstr("no block has a gradient")));
  model->abort_step();
  EXPECT_TRUE(torch::equal(before, model->masters(0).at("fc1.weight")));
  model->begin_step(1);
  model->forward(input(34)).pow(2).mean().backward();
  model->post_backward();
  EXPECT_THROW(model->update_masters_during_backward(adam, all), std::logic_error);  // after post_backward
  model->end_step(1.0);
  // The armed backward must be the step's last: a grad-mode pass after it is refused.
  model->begin_step(2);
  model->update_masters_during_backward(adam, all);
  model->forward(input(35)).pow(2).mean().backward();
  EXPECT_THROW(model->forward(input(36)), std::logic_error);
  model->post_backward();
  model->end_step(1.0);
}

TEST(StreamedModel, StateRoundTripResumesWithTheSameRoutesAndWeights) {
  const std::string policy = "  mode: static\n  tiers: [bf16, int8, nf4]\n  force_nf4_blocks: [0]\n";
  const auto blocks = make_blocks(17);
  auto model = wrap(blocks, policy);
  torch::optim::SGD optimizer(model->master_parameters(), torch::optim::SGDOptions(0.1));
  for (std::int64_t step = 0; step < 2; ++step) {
    optimizer.zero_grad();
    model->begin_step(step);
    model->forward(input(18)).pow(2).mean().backward();
    model->post_backward();
    optimizer.step();
    model->end_step(1.0);
  }
  const auto state = model->export_state();

  const auto fresh_blocks = make_blocks(99);
  auto resumed = wrap(fresh_blocks, policy);
  resumed->restore_state(state);
  {
    // Resident parameters are the host's to save and restore, as in any torch model.
    torch::NoGradGuard no_grad;
    const std::vector<torch::Tensor> from = model->resident_parameters(), to = resumed->resident_parameters();
    for (std::size_t i = 0; i < from.size(); ++i) to[i].copy_(from[i]);
  }
  EXPECT_EQ(resumed->routes(), model->routes());
  for (std::uint32_t b = 0; b < kBlocks; ++b) {
    for (const auto& [name, master] : model->masters(b))
      EXPECT_TRUE(torch::equal(resumed->masters(b).at(name), master));
  }
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(torch::equal(resumed->forward(input(19)), model->forward(input(19))));

  // A refused state names its entry and changes nothing: not the hints, not the masters.
  const auto refused_entry = [&](std::map<std::string, torch::Tensor> edited) -> std::string {
    try {
      resumed->restore_state(edited);
    } catch (const tl::StateEntryError& e) {
      return e.entry();
    }
    return "restored";
  };
  auto edited = state;
  edited.erase("policy/state");
  EXPECT_EQ(refused_entry(edited), "policy/state");
  edited = state;
  edited["master/block1.fc2.weight"] = torch::zeros({2, 2});
  EXPECT_EQ(refused_entry(edited), "master/block1.fc2.weight");
  edited = state;
  edited["policy/hints"] = state.at("policy/hints").clone();
  edited["policy/hints"].data_ptr<std::uint8_t>()[4] = 7;  // block 0's precision
  EXPECT_EQ(refused_entry(edited), "policy/hints");
  // A state the plugin itself rejects, on a model whose weights and hints differ from it.
  auto other = wrap(make_blocks(98), policy);
  const std::vector<sp::Precision> routes_before = other->routes();
  const std::vector<sp::host::UnitHint> hints_before = other->hints();  // its forced routes, from construction
  const torch::Tensor master_before = other->masters(0).at("fc1.weight").clone();
  edited = state;
  edited["policy/state"] = torch::full({16}, 0x5a, torch::kUInt8);
  EXPECT_THROW(other->restore_state(edited), std::runtime_error);
  ASSERT_EQ(other->hints().size(), hints_before.size());
  for (std::size_t b = 0; b < hints_before.size(); ++b) EXPECT_EQ(other->hints()[b].precision, hints_before[b].precision);
  EXPECT_EQ(other->routes(), routes_before);
  EXPECT_TRUE(torch::equal(other->masters(0).at("fc1.weight"), master_before));
}

// Where the streamed weights are frozen (LoRA), the host names the parameters whose gradients
// describe each block to the policy; by default every trainable resident one does.
TEST(StreamedModel, MomentsComeFromTheParametersTheHostNames) {
  const auto moments_of = [&](std::vector<std::string> moments_from) {
    const auto blocks = make_blocks(21);
    std::vector<tl::Block> list;
    for (const TinyBlock& b : blocks) {
      b->fc1->weight.set_requires_grad(false);
      b->fc2->weight.set_requires_grad(false);
      tl::Block block = tl::make_block(b, {"fc1.weight", "fc2.weight"});
      block.moments_from = moments_from;
      list.push_back(std::move(block));
    }
    tl::StreamedModelOptions options = test_options();
    options.config_yaml = policy_yaml("  mode: off\n");
    tl::StreamedModel model(std::move(list), options);
    for (const torch::Tensor& r : model.resident_parameters()) r.mutable_grad() = torch::Tensor();
    model.begin_step(0);
    model.forward(input(22)).pow(2).mean().backward();
    const std::vector<sp_grad_moments_v1> moments = model.post_backward();
    model.end_step(1.0);
    return moments;
  };
  const std::vector<sp_grad_moments_v1> by_default = moments_of({});
  const std::vector<sp_grad_moments_v1> fc1_bias = moments_of({"fc1.bias"});
  for (std::uint32_t b = 0; b < kBlocks; ++b) {
    EXPECT_EQ(by_default[b].count, static_cast<std::uint64_t>(2 * kDim + kHidden + kDim)) << "ln, fc1.bias, fc2.bias";
    EXPECT_EQ(fc1_bias[b].count, static_cast<std::uint64_t>(kHidden));
    EXPECT_GT(fc1_bias[b].sum_sq, 0.0);
    EXPECT_LT(fc1_bias[b].sum_sq, by_default[b].sum_sq);
  }
  EXPECT_THROW(moments_of({"fc9.bias"}), std::invalid_argument);
}

// Policy units over several blocks (a layer's attention and MLP, streamed as modules of their
// own): the plugin sees one unit per entry, its moments those of all its blocks' gradients, its
// bytes their sum; its hint routes every block of it; the state's hints are per unit.
TEST(StreamedModel, AUnitOfSeveralBlocksTakesOneRouteAndOneSetOfMoments) {
  // Forced NF4: block 0 and 1, or unit 0 (blocks 0 and 1): the same routes from the first fetch.
  const auto run = [&](std::vector<tl::PolicyUnit> units) {
    const auto blocks = make_blocks(21);
    std::vector<tl::Block> list;
    for (const TinyBlock& b : blocks) list.push_back(tl::make_block(b, {"fc1.weight", "fc2.weight"}));
    tl::StreamedModelOptions options = test_options();
    const bool by_block = units.empty();
    options.config_yaml = policy_yaml(std::string("  mode: static\n  tiers: [bf16, int8, nf4]\n  force_nf4_blocks: ") +
                                      (by_block ? "[0, 1]\n" : "[0]\n"));
    options.units = std::move(units);
    auto model = std::make_unique<tl::StreamedModel>(std::move(list), options);
    std::vector<sp_grad_moments_v1> first;  // of step 0
    for (std::int64_t step = 0; step < 2; ++step) {
      model->begin_step(step);
      model->forward(input(22)).pow(2).mean().backward();
      const std::vector<sp_grad_moments_v1>& moments = model->post_backward();
      if (step == 0) first = moments;
      const tl::StepReport report = model->end_step(1.0);
      EXPECT_EQ(report.unit_routes, model->unit_routes());
    }
    return std::make_pair(std::move(model), first);
  };
  // Named, not structured bindings: the refusals' lambdas below capture the models.
  auto block_run = run({});
  auto unit_run = run({{"0.front", 2}, {"0.back", 1}});
  const std::unique_ptr<tl::StreamedModel>& by_block = block_run.first;
  const std::unique_ptr<tl::StreamedModel>& by_unit = unit_run.first;
  const std::vector<sp_grad_moments_v1>& block_moments = block_run.second;
  const std::vector<sp_grad_moments_v1>& unit_moments = unit_run.second;
  EXPECT_EQ(by_block->num_units(), 3u);
  ASSERT_EQ(by_unit->num_units(), 2u);
  EXPECT_EQ(by_unit->unit_of(1), 0u);
  EXPECT_EQ(by_unit->unit_of(2), 1u);
  EXPECT_EQ(by_block->routes(), (std::vector<sp::Precision>{sp::Precision::nf4, sp::Precision::nf4, sp::Precision::bf16}));
  EXPECT_EQ(by_unit->routes(), (std::vector<sp::Precision>{sp::Precision::nf4, sp::Precision::nf4, sp::Precision::bf16}));
  using Routes = std::vector<std::vector<sp::Precision>>;
  EXPECT_EQ(by_block->unit_routes(), (Routes{{sp::Precision::nf4}, {sp::Precision::nf4}, {sp::Precision::bf16}}));
  EXPECT_EQ(by_unit->unit_routes(), (Routes{{sp::Precision::nf4}, {sp::Precision::bf16}}));
  ASSERT_EQ(unit_moments.size(), 2u);
  EXPECT_EQ(unit_moments[0].count, block_moments[0].count + block_moments[1].count);
  EXPECT_NEAR(unit_moments[0].sum_sq, block_moments[0].sum_sq + block_moments[1].sum_sq,
              1e-9 * unit_moments[0].sum_sq);
  EXPECT_EQ(unit_moments[0].max_abs, std::max(block_moments[0].max_abs, block_moments[1].max_abs));
  EXPECT_EQ(unit_moments[1].count, block_moments[2].count);
  EXPECT_EQ(by_unit->hints().size(), 2u);
  // The state carries one hint per unit, and a model of other units refuses it by name.
  const auto state = by_unit->export_state();
  EXPECT_THAT([&] { by_block->restore_state(state); },
              ::testing::ThrowsMessage<tl::StateEntryError>(::testing::HasSubstr("one per policy unit")));
  by_unit->restore_state(state);
  EXPECT_THAT([&] { by_unit->calibrate({input(25)}); },
              ::testing::ThrowsMessage<std::logic_error>(::testing::HasSubstr("calibration errors are measured per block")));
}

TEST(StreamedModel, UnitsThatDoNotCoverTheBlocksInOrderAreRefusedByName) {
  const auto blocks = make_blocks(21);
  // Before anything changes: the modules keep their parameters.
  const auto refused = [&](std::vector<tl::PolicyUnit> units, const std::string& message) {
    tl::StreamedModelOptions options = test_options();
    options.units = std::move(units);
    EXPECT_THAT(
        [&] {
          std::vector<tl::Block> list;
          for (const TinyBlock& b : blocks) list.push_back(tl::make_block(b, {"fc1.weight", "fc2.weight"}));
          tl::StreamedModel model(std::move(list), options);
        },
                ::testing::ThrowsMessage<std::invalid_argument>(::testing::HasSubstr(message)));
  };
  refused({{"a", 2}}, "units cover 2 of the 3 blocks");
  refused({{"a", 2}, {"b", 2}}, "units[1] ('b') takes 2 blocks from block 2, but there are 3");
  refused({{"a", 0}, {"b", 3}}, "units[0] ('a') takes 0 blocks");
  refused({{"a", 1}, {"", 2}}, "units[1] has no name");
  EXPECT_EQ(blocks[0]->fc1->weight.numel(), kHidden * kDim);
}

// Evaluation and calibration passes are counted apart, from each other and from the training
// passes, and the two halves of calibrate() measure and hand over what calibrate() does.
TEST(StreamedModel, EvaluationAndCalibrationBytesApartAndCalibrationInTwoHalves) {
  const auto blocks = make_blocks(23);
  auto model = wrap(blocks, "  mode: off\n");
  EXPECT_EQ(model->evaluation_h2d_bytes(), 0u);
  {
    torch::NoGradGuard no_grad;
    model->forward(input(24));
  }
  const auto pass_bytes = [&](sp::Precision precision) {
    std::uint64_t bytes = 0;
    for (std::uint32_t b = 0; b < kBlocks; ++b) bytes += model->image_bytes(b, precision);
    return bytes;
  };
  const std::uint64_t bf16 = pass_bytes(sp::Precision::bf16);
  EXPECT_EQ(model->evaluation_h2d_bytes(), bf16);
  const tl::CalibrationErrors measured = model->measure_calibration_errors({input(25)});
  // A BF16 reference pass, then one per quantized route (INT8, NF4), counted apart from evaluation.
  EXPECT_EQ(model->evaluation_h2d_bytes(), bf16);
  std::uint64_t calibration = bf16;
  for (const sp::Precision route : sp::kQuantizedPrecisions) calibration += pass_bytes(route);
  EXPECT_EQ(model->calibration_h2d_bytes(), calibration);
  EXPECT_TRUE(model->set_calibration_errors(measured));
  const tl::CalibrationErrors again = model->calibrate({input(25)});
  EXPECT_EQ(again[sp::Precision::int8], measured[sp::Precision::int8]);
  EXPECT_EQ(again[sp::Precision::nf4], measured[sp::Precision::nf4]);
}

// The yardstick: an allocation measured on a model that streams all-BF16 computes what a model
// whose policy forces that allocation computes, the state is left as it was, and the bytes are
// the measurement's own.
TEST(StreamedModel, CompareRoutesMeasuresAnAllocationAsAModelForcedToItComputes) {
  const auto blocks = make_blocks(31);
  auto model = wrap(blocks, "  mode: off\n");
  auto forced = wrap(make_blocks(31), "  mode: static\n  tiers: [bf16, int8, nf4]\n  force_nf4_blocks: [2]\n");
  const std::vector<torch::Tensor> xs{input(32), input(33), input(34)};
  const auto per_example_loss = [](const torch::Tensor& y) { return y.pow(2).mean({1, 2}); };
  std::vector<double> expected_a, expected_b;
  double expected_kl = 0.0;  // KL(b || a) per row of the outputs, b the reference: its mean
  {
    torch::NoGradGuard no_grad;
    for (const torch::Tensor& x : xs) {
      const torch::Tensor ya = forced->forward(x), yb = model->forward(x);
      const torch::Tensor a = per_example_loss(ya), b = per_example_loss(yb);
      expected_a.insert(expected_a.end(), a.data_ptr<float>(), a.data_ptr<float>() + a.numel());
      expected_b.insert(expected_b.end(), b.data_ptr<float>(), b.data_ptr<float>() + b.numel());
      const torch::Tensor la = torch::log_softmax(ya.flatten(0, 1).to(torch::kFloat64), -1);
      const torch::Tensor lb = torch::log_softmax(yb.flatten(0, 1).to(torch::kFloat64), -1);
      expected_kl += (lb.exp() * (lb - la)).sum(-1).sum().item<double>() / (4.0 * 8.0 * 3.0);
    }
  }
  const std::uint64_t evaluated = model->evaluation_h2d_bytes();
  torch::manual_seed(35);
  const std::vector<sp::Precision> a{sp::Precision::bf16, sp::Precision::bf16, sp::Precision::nf4};
  const std::vector<sp::Precision> b(kBlocks, sp::Precision::bf16);
  const tl::RouteComparison c = model->compare_routes(
      [&](std::size_t i) {
        const torch::Tensor y = model->forward(xs.at(i));
        return tl::MeasuredBatch{per_example_loss(y), y.flatten(0, 1)};
      },
      xs.size(), a, b);
  ASSERT_TRUE(c.paired_over_examples);
  ASSERT_EQ(c.loss_difference.n, expected_a.size());
  double mean_difference = 0.0, mean_a = 0.0;
  for (std::size_t i = 0; i < expected_a.size(); ++i) {
    mean_difference += (expected_a[i] - expected_b[i]) / static_cast<double>(expected_a.size());
    mean_a += expected_a[i] / static_cast<double>(expected_a.size());
  }
  EXPECT_NEAR(c.loss_a, mean_a, 1e-6);
  EXPECT_NEAR(c.loss_difference.mean, mean_difference, 1e-6);
  EXPECT_NE(c.loss_difference.mean, 0.0);
  EXPECT_LT(c.loss_difference.low, c.loss_difference.mean);
  EXPECT_GT(c.loss_difference.high, c.loss_difference.mean);
  ASSERT_TRUE(c.kl.has_value());
  EXPECT_EQ(c.kl->n, static_cast<std::size_t>(4 * 8 * 3));
  EXPECT_GT(c.kl->mean, 0.0);
  EXPECT_NEAR(c.kl->mean, expected_kl, 1e-9 * expected_kl);  // KL(b || a), not (a || b)
  EXPECT_EQ(c.batch_kl.size(), xs.size());
  // One pass per allocation and batch, counted apart from the evaluations.
  const auto pass_bytes = [&](const std::vector<sp::Precision>& routes) {
    std::uint64_t bytes = 0;
    for (std::uint32_t k = 0; k < kBlocks; ++k) bytes += model->image_bytes(k, routes[k]);
    return bytes;
  };
  EXPECT_EQ(c.bytes_a, pass_bytes(a));
  EXPECT_EQ(c.bytes_b, pass_bytes(b));
  EXPECT_EQ(c.h2d_bytes, xs.size() * (c.bytes_a + c.bytes_b));
  EXPECT_EQ(model->measurement_h2d_bytes(), c.h2d_bytes);
  EXPECT_EQ(model->evaluation_h2d_bytes(), evaluated);
  // The routes, the random stream and what an evaluation computes are as before.
  EXPECT_EQ(model->routes(), b);
  const torch::Tensor drawn_after = torch::randn({4});
  torch::manual_seed(35);
  EXPECT_TRUE(torch::equal(drawn_after, torch::randn({4})));
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(torch::equal(model->forward(xs[0]), run_plain(plain_twins(blocks, *model), xs[0])));
}

TEST(StreamedModel, CompareRoutesRefusesWhatItCannotMeasureAndStaysUsable) {
  auto model = wrap(make_blocks(36), "  mode: off\n");
  const std::vector<sp::Precision> bf16(kBlocks, sp::Precision::bf16), nf4(kBlocks, sp::Precision::nf4);
  const auto loss = [&](std::size_t) { return tl::MeasuredBatch{model->forward(input(37)).pow(2).mean(), {}}; };
  const auto refused = [&](auto&& call, const char* says) {
    try {
      call();
      ADD_FAILURE() << "accepted; expected: " << says;
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  refused([&] { model->compare_routes(loss, 1, {sp::Precision::nf4}, bf16); }, "routes_a holds 1 routes");
  refused([&] { model->compare_routes(loss, 0, nf4, bf16); }, "no batches");
  refused([&] { model->compare_routes(loss, 1, nf4, bf16, 1.5); }, "confidence 1.5");
  refused([&] { model->compare_routes([](std::size_t) { return tl::MeasuredBatch{torch::ones({1}), {}}; }, 1, nf4, bf16); },
          "called no streamed block");
  refused([&] {
    model->compare_routes([&](std::size_t) { return tl::MeasuredBatch{model->forward(input(38)).sum({1, 2}).to(torch::kLong), {}}; },
                          1, nf4, bf16);
  }, "expected a floating tensor");
  refused([&] {
    model->compare_routes([&](std::size_t) {
      torch::AutoGradMode grad(true);
      return tl::MeasuredBatch{model->forward(input(39)).sum(), {}};
    }, 1, nf4, bf16);
  }, "forward only");
  refused([&] {
    model->compare_routes([&](std::size_t) -> tl::MeasuredBatch {
      model->forward(input(40));
      throw std::runtime_error("the host's own failure");
    }, 2, nf4, bf16);
  }, "the host's own failure");
  model->begin_step(0);
  refused([&] { model->compare_routes(loss, 1, nf4, bf16); }, "between steps");
  model->forward(input(41)).pow(2).mean().backward();
  model->post_backward();
  model->end_step(1.0);
  // Nothing of the refusals stays: measured again, the same allocation gives the same figures.
  const tl::RouteComparison first = model->compare_routes(loss, 2, nf4, bf16);
  const tl::RouteComparison second = model->compare_routes(loss, 2, nf4, bf16);
  EXPECT_GT(first.loss_difference.mean, 0.0);
  EXPECT_EQ(first.batch_loss_differences, second.batch_loss_differences);
  EXPECT_FALSE(first.paired_over_examples);
  EXPECT_FALSE(first.kl.has_value());
  EXPECT_EQ(model->routes(), bf16);
  // Both allocations of a batch draw the same random numbers (dropout's masks): one allocation
  // against itself differs by nothing, however much noise the closure draws.
  const tl::RouteComparison itself = model->compare_routes(
      [&](std::size_t) {
        const torch::Tensor y = model->forward(input(42));
        return tl::MeasuredBatch{(y + torch::randn_like(y)).pow(2).mean(), {}};
      },
      3, nf4, nf4);
  EXPECT_EQ(itself.batch_loss_differences, std::vector<double>(3, 0.0));
  // Masked logits (-inf under both allocations) weigh nothing; -inf under routes_a alone where
  // routes_b gives mass is an infinite KL, refused by name. Each batch runs under routes_b first.
  const auto with_masks = [&](float mask_a, float mask_b) {
    int call = 0;
    return model->compare_routes(
        [&](std::size_t) {
          const torch::Tensor y = model->forward(input(43)).flatten(0, 1);
          torch::Tensor mask = torch::zeros({y.size(-1)});
          mask[0] = call++ % 2 == 0 ? mask_b : mask_a;
          return tl::MeasuredBatch{y.pow(2).mean(), y + mask};
        },
        1, nf4, bf16);
  };
  const float inf = std::numeric_limits<float>::infinity();
  const tl::RouteComparison masked = with_masks(-inf, -inf);
  ASSERT_TRUE(masked.kl.has_value());
  EXPECT_TRUE(std::isfinite(masked.kl->mean) && masked.kl->mean > 0.0);
  refused([&] { with_masks(-inf, 0.0f); }, "routes_a gives no probability");
  EXPECT_EQ(model->routes(), bf16);
}

// Several allocations against one reference: the reference runs once a batch, and each
// allocation's figures are those it gets measured alone, dropout's draws included.
TEST(StreamedModel, CompareRoutesOfSeveralAllocationsIsEachMeasuredAlone) {
  auto model = wrap(make_blocks(44), "  mode: off\n");
  const std::vector<sp::Precision> bf16(kBlocks, sp::Precision::bf16);
  const std::vector<std::vector<sp::Precision>> candidates{
      {sp::Precision::nf4, sp::Precision::bf16, sp::Precision::bf16},
      {sp::Precision::bf16, sp::Precision::int8, sp::Precision::nf4},
      std::vector<sp::Precision>(kBlocks, sp::Precision::nf4)};
  const std::vector<torch::Tensor> xs{input(45), input(46)};
  int passes = 0;
  const auto closure = [&](std::size_t i) {
    ++passes;
    const torch::Tensor y = model->forward(xs.at(i));
    const torch::Tensor noisy = y + 0.1 * torch::randn_like(y);
    return tl::MeasuredBatch{noisy.pow(2).mean({1, 2}), noisy.flatten(0, 1)};
  };
  const std::uint64_t before = model->measurement_h2d_bytes();
  const std::vector<tl::RouteComparison> together = model->compare_routes(closure, xs.size(), candidates, bf16);
  const std::uint64_t moved = model->measurement_h2d_bytes() - before;
  EXPECT_EQ(passes, static_cast<int>(xs.size() * (1 + candidates.size())));
  ASSERT_EQ(together.size(), candidates.size());
  std::uint64_t reference_bytes = 0, candidate_bytes = 0;
  for (std::size_t k = 0; k < candidates.size(); ++k) {
    const tl::RouteComparison alone = model->compare_routes(closure, xs.size(), candidates[k], bf16);
    EXPECT_EQ(together[k].routes_a, candidates[k]);
    EXPECT_EQ(together[k].example_loss_differences, alone.example_loss_differences) << k;
    EXPECT_EQ(together[k].example_kl, alone.example_kl) << k;
    EXPECT_EQ(together[k].loss_difference.mean, alone.loss_difference.mean) << k;
    EXPECT_EQ(together[k].kl->high, alone.kl->high) << k;
    EXPECT_EQ(together[k].h2d_bytes, alone.h2d_bytes) << k;
    EXPECT_EQ(together[k].example_kl.size(), static_cast<std::size_t>(4 * 8 * 2));
    EXPECT_EQ(together[k].example_loss_differences.size(), static_cast<std::size_t>(4 * 2));
    reference_bytes = xs.size() * together[k].bytes_b;
    candidate_bytes += xs.size() * together[k].bytes_a;
  }
  EXPECT_EQ(moved, reference_bytes + candidate_bytes);  // the reference's passes once
  EXPECT_NE(together[0].example_kl, together[2].example_kl);
  EXPECT_THROW(model->compare_routes(closure, 1, std::vector<std::vector<sp::Precision>>{}, bf16),
               std::invalid_argument);
  try {
    model->compare_routes(closure, 1, {candidates[0], {sp::Precision::nf4}}, bf16);
    ADD_FAILURE() << "a candidate of one route was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("candidates[1] holds 1 routes"), std::string::npos) << e.what();
  }
  EXPECT_EQ(model->routes(), bf16);
}

TEST(StreamedModel, NamedErrors) {
  const auto blocks = make_blocks(20);
  std::vector<tl::Block> list{tl::make_block(blocks[0], {"fc1.weight", "fc3.weight"})};
  tl::StreamedModelOptions options = test_options();
  options.config_yaml = policy_yaml("  mode: off\n");
  try {
    tl::StreamedModel model(list, options);
    FAIL() << "a missing parameter was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'fc3.weight'"), std::string::npos) << e.what();
  }

  auto model = wrap(make_blocks(21), "  mode: off\n");
  EXPECT_THROW(model->forward(input(22)), std::logic_error);  // no step
  model->begin_step(0);
  EXPECT_THROW(model->end_step(0.0), std::logic_error);  // no post_backward
  options.plugin_file = "/nonexistent/libnothing.so";
  EXPECT_ANY_THROW(
      tl::StreamedModel(std::vector<tl::Block>{tl::make_block(make_blocks(23)[0], {"fc1.weight"})}, options));
}

// Steps are counted over the whole run: one that does not increase (a count restarted at 0
// each epoch, or after a resume) is refused before the plugin sees it, and a restored state
// carries the count on.
TEST(StreamedModel, StepsThatDoNotIncreaseAreRefusedByNameAcrossAResume) {
  auto model = wrap(make_blocks(60), "  mode: off\n");
  const auto one_step = [](tl::StreamedModel& m, std::int64_t step) {
    m.begin_step(step);
    m.forward(input(61)).pow(2).mean().backward();
    m.post_backward();
    m.end_step(1.0);
  };
  one_step(*model, 4);
  EXPECT_THAT([&] { model->begin_step(4); }, ::testing::ThrowsMessage<std::invalid_argument>(::testing::HasSubstr(
                                                 "begin_step(4): step 4 already began, and steps must increase")));
  EXPECT_THAT([&] { model->begin_step(0); },
              ::testing::ThrowsMessage<std::invalid_argument>(::testing::HasSubstr("go on from step 5")));
  EXPECT_THROW(model->begin_step(-1), std::invalid_argument);
  one_step(*model, 5);  // the refusals left no step open

  auto resumed = wrap(make_blocks(60), "  mode: off\n");
  resumed->restore_state(model->export_state());
  EXPECT_THAT([&] { resumed->begin_step(0); },
              ::testing::ThrowsMessage<std::invalid_argument>(::testing::HasSubstr("step 5 already began")));
  one_step(*resumed, 6);
  // A state written before the count was kept restores, and the count starts afresh.
  auto state = model->export_state();
  state.erase("layer/last_step");
  auto older = wrap(make_blocks(60), "  mode: off\n");
  older->restore_state(state);
  EXPECT_NO_THROW(older->begin_step(0));
}

// An optimizer stepped after end_step() changes the masters after their images were rebuilt:
// the version counters tell the next pass, whose first fetch rebuilds them, so that an
// evaluation and the next step stream the stepped masters.
TEST(StreamedModel, MastersChangedAfterTheRebuildAreStreamedFromTheNextPass) {
  const auto blocks = make_blocks(65);
  auto model = wrap(blocks, "  mode: off\n");
  model->begin_step(0);
  model->forward(input(66)).pow(2).mean().backward();
  model->post_backward();
  model->end_step(1.0);
  {
    // After the rebuild of end_step(). In place, as torch.optim's SGD steps.
    torch::NoGradGuard no_grad;
    for (torch::Tensor& master : model->master_parameters()) master.add_(master.grad(), -0.1);
  }
  // The pass streams the stepped masters (BF16-rounded), as a plain model on them computes.
  const std::vector<TinyBlock> twins = plain_twins(blocks, *model);
  {
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(torch::allclose(model->forward(input(67)), run_plain(twins, input(67)), 1e-4, 1e-5));
  }
  model->begin_step(1);
  EXPECT_TRUE(torch::allclose(model->forward(input(68)), run_plain(twins, input(68)), 1e-4, 1e-5));
  model->abort_step();
}

// A host that updates the masters by hand inside the step, without post_backward() and
// end_step(), trains on the updated weights from the next pass, as plain PyTorch does; the
// moments the policy takes are those of the backward, taken before the host cleared them.
TEST(StreamedModel, AHandWrittenUpdateInsideTheStepIsStreamedByTheNextPass) {
  const auto blocks = make_blocks(69);
  auto model = wrap(blocks, "  mode: off\n");
  model->begin_step(0);
  model->forward(input(70)).pow(2).mean().backward();
  EXPECT_FALSE(model->trained_in_step());
  std::vector<double> squares;
  {
    torch::NoGradGuard no_grad;
    for (torch::Tensor& master : model->master_parameters()) {
      squares.push_back(master.grad().square().sum().item<double>());
      master.add_(master.grad(), -0.1);
      master.mutable_grad() = torch::Tensor();
    }
  }
  EXPECT_TRUE(model->trained_in_step());
  const std::vector<TinyBlock> twins = plain_twins(blocks, *model);
  EXPECT_TRUE(torch::allclose(model->forward(input(71)), run_plain(twins, input(71)), 1e-4, 1e-5));
  // The gradients are gone; the moments of the step's backward were taken when it ended.
  const std::vector<sp_grad_moments_v1>& moments = model->post_backward();
  ASSERT_EQ(moments.size(), static_cast<std::size_t>(kBlocks));
  for (std::size_t b = 0; b < moments.size(); ++b) {
    EXPECT_NEAR(moments[b].sum_sq, squares[2 * b] + squares[2 * b + 1], 1e-6 * moments[b].sum_sq) << b;
  }
  model->end_step(1.0);
}

// Changing a master between a block's forward and its backward would differentiate other
// weights than the forward used: refused by name, as PyTorch refuses it for a saved tensor.
TEST(StreamedModel, AMasterChangedBetweenTheForwardAndItsBackwardIsRefusedByName) {
  auto model = wrap(make_blocks(72), "  mode: off\n");
  model->begin_step(0);
  const torch::Tensor loss = model->forward(input(73)).pow(2).mean();
  {
    torch::NoGradGuard no_grad;
    model->masters(1).at("fc2.weight").mul_(0.5);
  }
  EXPECT_THAT([&] { loss.backward(); }, ::testing::ThrowsMessage<std::exception>(::testing::HasSubstr(
                                            "block1's master 'fc2.weight' was modified in place after the forward")));
  model->abort_step();
  model->begin_step(1);
  model->forward(input(74)).pow(2).mean().backward();
  EXPECT_NO_THROW(model->post_backward());
  model->end_step(1.0);
}

// post_backward() reports the blocks' gradient moments to the policy: with no backward in the
// step there are none, which is refused by name, and the step can still be dropped.
TEST(StreamedModel, PostBackwardWithoutABackwardIsRefusedByName) {
  auto model = wrap(make_blocks(62), "  mode: off\n");
  model->begin_step(0);
  EXPECT_THAT([&] { model->post_backward(); }, ::testing::ThrowsMessage<std::logic_error>(::testing::HasSubstr(
                                                   "no block has a gradient in step 0: no backward ran")));
  model->abort_step();
  model->begin_step(1);
  model->forward(input(63)).pow(2).mean().backward();
  EXPECT_EQ(model->post_backward().size(), static_cast<std::size_t>(kBlocks));
  model->end_step(1.0);
}

// A module in two blocks: its parameters would be updated once per block. Refused, naming both.
TEST(StreamedModel, AParameterSharedByTwoBlocksIsRefusedNamingBoth) {
  auto blocks = make_blocks(64);
  blocks[2]->ln = blocks[2]->replace_module("ln", blocks[0]->ln);
  std::vector<tl::Block> list;
  for (const TinyBlock& b : blocks) list.push_back(tl::make_block(b, {"fc1.weight", "fc2.weight"}));
  tl::StreamedModelOptions options = test_options();
  options.config_yaml = policy_yaml("  mode: off\n");
  EXPECT_THAT([&] { tl::StreamedModel model(std::move(list), options); },
              ::testing::ThrowsMessage<std::invalid_argument>(
                  ::testing::HasSubstr("block2's 'ln.weight' is block0's 'ln.weight' too")));
}

// Blocks whose forward multiplies by a tensor that requires a gradient and is none of their
// parameters (captured, as a plain attribute would be in Python).
std::vector<tl::Block> gated_blocks(const std::vector<TinyBlock>& blocks, const torch::Tensor& gate) {
  std::vector<tl::Block> list;
  for (const TinyBlock& b : blocks) {
    tl::Block block = tl::make_block(b, {"fc1.weight", "fc2.weight"});
    block.forward = [inner = block.forward, gate](const torch::Tensor& x) { return inner(x) * gate; };
    list.push_back(std::move(block));
  }
  return list;
}

// Plain autograd gives such a tensor its gradient; the layer does too, recomputing or not.
TEST(StreamedModel, ATensorABlockReadsWithoutListingItGetsItsGradientAsInPlainAutograd) {
  const auto blocks = make_blocks(70);
  const torch::Tensor gate = torch::full({kDim}, 0.9).requires_grad_(true);
  tl::StreamedModelOptions options = test_options();
  options.config_yaml = policy_yaml("  mode: off\n");
  int hook_calls = 0;
  gate.register_hook([&hook_calls](const torch::Tensor& g) {
    ++hook_calls;
    return g;
  });
  tl::StreamedModel model(gated_blocks(blocks, gate), options);
  model.begin_step(0);
  model.forward(input(71)).pow(2).mean().backward();
  ASSERT_TRUE(gate.grad().defined()) << "the gate got no gradient";
  // Once, on the sum, as in plain autograd; the recompute's autograd.grad() runs them on each
  // block's share.
  EXPECT_EQ(hook_calls, recomputing() ? kBlocks : 1);
  const torch::Tensor streamed = gate.grad().clone();
  gate.mutable_grad() = torch::Tensor();
  torch::Tensor h = input(71);
  for (TinyBlock b : plain_twins(blocks, model)) h = b->forward(h) * gate;
  h.pow(2).mean().backward();
  EXPECT_TRUE(torch::allclose(streamed, gate.grad(), 1e-4, 1e-6)) << (streamed - gate.grad()).abs().max();
  model.post_backward();
  model.end_step(1.0);
}

// A block that multiplies by its streamed weight itself (autograd saves the parameter, not a view
// of it, as torch::matmul(x, w) does) and computes an auxiliary loss on the side, kept on the module,
// as an MoE's load-balancing loss is.
struct SideLossBlockImpl : torch::nn::Module {
  SideLossBlockImpl()
      : w(register_parameter("w", torch::randn({kDim, kDim}) / 8)),
        router(register_parameter("router", torch::randn({kDim, 4}) / 8)) {}
  torch::Tensor forward(const torch::Tensor& x) {
    const torch::Tensor gates = torch::softmax(torch::matmul(x, router), -1);
    aux = gates.mean(std::vector<int64_t>{0, 1}).pow(2).sum();
    return x + torch::tanh(torch::matmul(x, w)) * gates.narrow(-1, 0, 1);
  }
  torch::Tensor w, router, aux;
};
TORCH_MODULE(SideLossBlock);

// Kept activations: the auxiliary loss carries its graph, as in plain LibTorch, and the
// gradients through it and through the saved parameter are plain autograd's.
TEST(StreamedModel, AnAuxiliaryLossABlockKeepsOnTheSideTrainsAsInPlainAutograd) {
  torch::manual_seed(91);
  std::vector<SideLossBlock> streamed_blocks, plain;
  std::vector<tl::Block> list;
  for (int b = 0; b < kBlocks; ++b) {
    streamed_blocks.emplace_back();
    plain.emplace_back();
    torch::NoGradGuard no_grad;
    plain.back()->w.copy_(streamed_blocks.back()->w.to(torch::kBFloat16).to(torch::kFloat32));
    plain.back()->router.copy_(streamed_blocks.back()->router.to(torch::kBFloat16).to(torch::kFloat32));
    list.push_back(tl::make_block(streamed_blocks.back(), {"w", "router"}));
  }
  tl::StreamedModelOptions options = test_options();
  options.recompute = false;
  options.config_yaml = policy_yaml("  mode: off\n");
  tl::StreamedModel model(std::move(list), options);
  const torch::Tensor x = input(92);
  model.begin_step(0);
  torch::Tensor loss = model.forward(x).pow(2).mean();
  for (const SideLossBlock& b : streamed_blocks) {
    ASSERT_TRUE(b->aux.requires_grad()) << "the auxiliary loss has no graph";
    loss = loss + 0.5 * b->aux;
  }
  loss.backward();
  model.post_backward();
  torch::Tensor h = x, plain_loss;
  for (SideLossBlock b : plain) h = b->forward(h);
  plain_loss = h.pow(2).mean();
  for (const SideLossBlock& b : plain) plain_loss = plain_loss + 0.5 * b->aux;
  plain_loss.backward();
  EXPECT_NEAR(loss.item<double>(), plain_loss.item<double>(), 1e-6);
  for (std::uint32_t b = 0; b < kBlocks; ++b) {
    for (const char* name : {"w", "router"}) {
      const torch::Tensor& got = model.masters(b).at(name).grad();
      const torch::Tensor want = plain[b]->named_parameters()[name].grad();
      EXPECT_TRUE(torch::allclose(got, want, 1e-4, 1e-6)) << "block " << b << " " << name << ": "
                                                          << (got - want).abs().max().item<double>();
    }
  }
  EXPECT_TRUE(streamed_blocks[0]->w.is_leaf()) << "a placeholder is a leaf between passes";
  model.end_step(loss.item<double>());
}

// A host about to cast its model says so first: the blocks then compute in the new dtype, the
// resident parameters may take it, and the masters stay fp32.
TEST(StreamedModel, ACastAnnouncedBetweenStepsComputesInTheNewDtype) {
  auto blocks = make_blocks(81);
  auto model = wrap(blocks, "  mode: off\n");
  model->begin_step(0);
  EXPECT_THAT([&] { model->set_compute_dtype(torch::kBFloat16); },
              ::testing::ThrowsMessage<std::logic_error>(::testing::HasSubstr("inside step 0")));
  model->abort_step();
  EXPECT_THAT([&] { model->set_compute_dtype(torch::kInt32); },
              ::testing::ThrowsMessage<std::invalid_argument>(::testing::HasSubstr("Int is not a floating-point")));
  model->set_compute_dtype(torch::kBFloat16);
  for (TinyBlock& b : blocks) {
    b->ln->to(torch::kBFloat16);
    b->fc1->bias.set_data(b->fc1->bias.to(torch::kBFloat16));
    b->fc2->bias.set_data(b->fc2->bias.to(torch::kBFloat16));
  }
  torch::NoGradGuard no_grad;
  const torch::Tensor y = model->forward(input(82).to(torch::kBFloat16));
  EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(model->masters(0).at("fc1.weight").scalar_type(), torch::kFloat32);
}

// A .to() after wrapping converts the placeholders and the resident parameters in place.
TEST(StreamedModel, AModelConvertedAfterWrappingIsRefusedNamingTheParameter) {
  auto blocks = make_blocks(77);
  auto model = wrap(blocks, "  mode: off\n");
  blocks[1]->to(torch::kBFloat16);
  torch::NoGradGuard no_grad;
  EXPECT_THAT([&] { model->forward(input(78)); },
              ::testing::ThrowsMessage<std::logic_error>(::testing::HasSubstr(
                  "block1: parameter 'fc1.weight' is now BFloat16 on cpu, and was Float on cpu when the blocks were "
                  "wrapped")));
  blocks[1]->to(torch::kFloat32);  // back as wrapped: the placeholders are empty again, and the model runs
  EXPECT_NO_THROW(model->forward(input(78)));
}

// A tensor computed outside the blocks from a parameter. With the activations kept its gradient
// runs back through the graph that computed it, as in plain autograd.
TEST(StreamedModel, ATensorComputedOutsideTheBlocksThatNeedsAGradientTrainsAsInPlainAutograd) {
  const auto blocks = make_blocks(79);
  const torch::Tensor theta = torch::zeros({kDim}).requires_grad_(true);
  tl::StreamedModelOptions options = test_options();
  options.recompute = false;
  options.config_yaml = policy_yaml("  mode: off\n");
  tl::StreamedModel model(gated_blocks(blocks, theta.exp() * 2), options);
  model.begin_step(0);
  model.forward(input(80)).pow(2).mean().backward();
  const torch::Tensor streamed = theta.grad().clone();
  theta.mutable_grad() = torch::Tensor();
  const torch::Tensor gate = theta.exp() * 2;
  torch::Tensor h = input(80);
  for (TinyBlock b : plain_twins(blocks, model)) h = b->forward(h) * gate;
  h.pow(2).mean().backward();
  EXPECT_TRUE(torch::allclose(streamed, theta.grad(), 1e-4, 1e-6)) << (streamed - theta.grad()).abs().max();
  model.post_backward();
  model.end_step(1.0);
}

// Recomputing, its gradient would have to run back through the graph that computed it, which the
// block's backward does not own. Refused by name.
TEST(StreamedModel, ATensorComputedOutsideTheBlocksIsRefusedByNameWhenRecomputing) {
  const auto blocks = make_blocks(79);
  const torch::Tensor theta = torch::zeros({kDim}).requires_grad_(true);
  const torch::Tensor gate = theta.exp() * 2;
  tl::StreamedModelOptions options = test_options();
  options.recompute = true;
  options.config_yaml = policy_yaml("  mode: off\n");
  tl::StreamedModel model(gated_blocks(blocks, gate), options);
  model.begin_step(0);
  try {
    model.forward(input(80)).pow(2).mean().backward();
    ADD_FAILURE() << "the backward ran";
  } catch (const std::exception& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("block2 reads a tensor computed outside it that requires a gradient "
                                               "(through MulBackward"));
  }
  EXPECT_FALSE(theta.grad().defined());
  model.abort_step();
}

// Blocks with nothing to train, before a head that trains: no block has a gradient to report,
// and post_backward() gives the policy none rather than refusing the step.
TEST(StreamedModel, FrozenBlocksBeforeATrainingHeadEndTheirSteps) {
  const auto blocks = make_blocks(81);
  for (const TinyBlock& b : blocks) {
    for (auto& p : b->parameters()) p.set_requires_grad(false);
  }
  auto model = wrap(blocks, "  mode: off\n");
  torch::Tensor head = torch::ones({kDim}).requires_grad_(true);
  for (std::int64_t step = 0; step < 2; ++step) {
    model->begin_step(step);
    (model->forward(input(82)) * head).pow(2).mean().backward();
    EXPECT_NO_THROW(model->post_backward());
    model->end_step(1.0);
  }
  EXPECT_TRUE(head.grad().defined());
}

TEST(StreamedModel, AReplacedParameterIsRefusedNotRead) {
  auto blocks = make_blocks(24);
  auto model = wrap(blocks, "  mode: off\n");
  blocks[1]->fc1 = blocks[1]->replace_module("fc1", torch::nn::Linear(kDim, kHidden));
  model->begin_step(0);
  try {
    model->forward(input(25));
    FAIL() << "a replaced parameter was used";
  } catch (const std::logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("'fc1.weight' was replaced"), std::string::npos) << e.what();
  }
}

// The NF4 group size is stated once: the layer's option, else the policy's; two that differ are
// refused, naming both.
TEST(StreamedModel, TheNf4GroupSizeIsThePoliciesUnlessTheOptionSaysOtherwise) {
  const auto nf4_bytes = [](std::uint32_t option, const std::string& policy) {
    std::vector<tl::Block> list;
    for (const TinyBlock& b : make_blocks(28)) list.push_back(tl::make_block(b, {"fc1.weight", "fc2.weight"}));
    tl::StreamedModelOptions options = test_options();
    options.config_yaml = policy_yaml("  mode: off\n" + policy);
    options.config_source = "test policy";
    options.nf4_group_size = option;
    return tl::StreamedModel(std::move(list), options).image_bytes(0, sp::Precision::nf4);
  };
  EXPECT_EQ(nf4_bytes(0, "  nf4_group_size: 128\n"), nf4_bytes(128, ""));
  EXPECT_EQ(nf4_bytes(0, ""), nf4_bytes(64, "  nf4_group_size: 64\n"));
  EXPECT_LT(nf4_bytes(128, ""), nf4_bytes(64, ""));
  EXPECT_THAT([&] { nf4_bytes(64, "  nf4_group_size: 128\n"); },
              ::testing::ThrowsMessage<std::invalid_argument>(::testing::HasSubstr(
                  "nf4_group_size is 64 (the layer's option), but test policy sets the policy's nf4_group_size to "
                  "128")));
}

// set_data() swaps a master's storage: the engines would go on reading the old one. Refused.
TEST(StreamedModel, AMasterWhoseStorageWasSwappedIsRefusedNotRead) {
  auto model = wrap(make_blocks(26), "  mode: off\n");
  {
    torch::NoGradGuard no_grad;
    torch::Tensor master = model->masters(2).at("fc1.weight");
    master.set_data(master.clone());
  }
  torch::NoGradGuard no_grad;
  EXPECT_THAT([&] { model->forward(input(27)); },
              ::testing::ThrowsMessage<std::logic_error>(::testing::HasSubstr(
                  "block2: master 'fc1.weight' no longer holds the storage the layer streams from")));
}

TEST(StreamedModel, AThrowingForwardLeavesTheModelUsable) {
  auto blocks = make_blocks(26);
  bool fail = true;
  std::vector<tl::Block> list;
  for (const TinyBlock& b : blocks) list.push_back(tl::make_block(b, {"fc1.weight", "fc2.weight"}));
  const auto inner = list[1].forward;
  list[1].forward = [&fail, inner](const torch::Tensor& x) {
    if (fail) throw std::runtime_error("block 1 failed");
    return inner(x);
  };
  tl::StreamedModelOptions options = test_options();
  options.config_yaml = policy_yaml("  mode: off\n");
  tl::StreamedModel model(std::move(list), options);
  {
    torch::NoGradGuard no_grad;
    EXPECT_THROW(model.forward(input(27)), std::runtime_error);
  }
  model.begin_step(0);
  EXPECT_THROW(model.forward(input(27)), std::runtime_error);
  EXPECT_THROW(model.calibrate({input(27)}), std::logic_error);  // inside a step
  fail = false;
  model.forward(input(27)).sum().backward();
  model.post_backward();
  EXPECT_EQ(model.end_step(0.0).training_passes, 1u);
  EXPECT_EQ(model.calibrate({input(28)})[sp::Precision::int8].size(), static_cast<std::size_t>(kBlocks));
  torch::NoGradGuard no_grad;
  EXPECT_EQ(model.forward(input(29)).sizes(), input(29).sizes());
}

TEST(StreamedModel, OnlineRecalibrationFollowsTheTrainedWeights) {
  const auto blocks = make_blocks(30);
  std::vector<tl::Block> list;
  for (const TinyBlock& b : blocks) list.push_back(tl::make_block(b, {"fc1.weight", "fc2.weight"}));
  tl::StreamedModelOptions options = test_options();
  options.config_yaml = policy_yaml("  mode: off\n");
  options.recalibrate_every = 2;
  tl::StreamedModel model(std::move(list), options);
  torch::optim::SGD optimizer(model.master_parameters(), torch::optim::SGDOptions(0.5));
  std::vector<tl::CalibrationErrors> measured;
  for (std::int64_t step = 0; step < 4; ++step) {
    optimizer.zero_grad();
    model.begin_step(step);
    const torch::Tensor x = input(31);
    model.forward(x).pow(2).mean().backward();
    model.post_backward();
    optimizer.step();
    const tl::StepReport report = model.end_step(0.0);
    EXPECT_EQ(report.calibration.has_value(), step % 2 == 1) << step;
    if (report.calibration) {
      EXPECT_GT(report.calibration_seconds, 0.0);
      measured.push_back(*report.calibration);
      // The same measurement as an explicit calibration on that input and those weights.
      const tl::CalibrationErrors again = model.calibrate({x});
      EXPECT_EQ(again[sp::Precision::int8], (*report.calibration)[sp::Precision::int8]);
      EXPECT_EQ(again[sp::Precision::nf4], (*report.calibration)[sp::Precision::nf4]);
    }
  }
  ASSERT_EQ(measured.size(), 2u);
  EXPECT_NE(measured[0][sp::Precision::int8],
            measured[1][sp::Precision::int8]);  // the weights moved, the errors followed
}

}  // namespace

namespace {

// A graph that outlives its model finds it gone, by name, instead of reading freed memory.
TEST(StreamedModel, ABackwardAfterTheModelIsGoneIsRefusedByName) {
  const auto blocks = make_blocks(30);
  auto model = wrap(blocks, "  mode: off\n");
  model->begin_step(0);
  const torch::Tensor loss = model->forward(input(31)).pow(2).mean();
  model.reset();
  try {
    loss.backward();
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("of a model that was destroyed or closed"), std::string::npos) << e.what();
  }
}

// An exception inside a step leaves the model usable: abort_step() drops the step, the next
// one trains as usual.
TEST(StreamedModel, AStepCutShortByAnExceptionIsAbortedAndTheNextOneRuns) {
  const auto blocks = make_blocks(32);
  std::vector<tl::Block> list;
  bool fail = false;
  for (const TinyBlock& b : blocks) {
    tl::Block block = tl::make_block(b, {"fc1.weight", "fc2.weight"});
    auto forward = block.forward;
    block.forward = [forward, &fail](const torch::Tensor& x) {
      // Fails only in the backward's recompute (grad mode on inside the layer's backward).
      if (fail && torch::GradMode::is_enabled()) throw std::runtime_error("a block failed");
      return forward(x);
    };
    list.push_back(std::move(block));
  }
  tl::StreamedModelOptions options = test_options();
  options.config_yaml = policy_yaml("  mode: off\n");
  tl::StreamedModel model(std::move(list), options);
  model.begin_step(0);
  fail = true;
  EXPECT_ANY_THROW(model.forward(input(33)).pow(2).mean().backward());
  fail = false;
  model.abort_step();
  model.abort_step();  // nothing open: a no-op
  for (std::int64_t step = 1; step < 3; ++step) {
    model.begin_step(step);
    model.forward(input(34)).pow(2).mean().backward();
    model.post_backward();
    EXPECT_EQ(model.end_step(1.0).training_passes, 1u);
  }
}

// A first block with nothing to train, fed an input that needs no gradient: the pass ends
// with the last block that has a backward, and the next steps run.
TEST(StreamedModel, AFrozenFirstBlockStillEndsThePass) {
  const auto blocks = make_blocks(35);
  for (auto& p : blocks[0]->parameters()) p.set_requires_grad(false);
  auto model = wrap(blocks, "  mode: off\n");
  for (std::int64_t step = 0; step < 2; ++step) {
    model->begin_step(step);
    model->forward(input(36)).pow(2).mean().backward();
    const auto& moments = model->post_backward();
    EXPECT_EQ(moments[0].count, 0u);
    EXPECT_GT(moments[1].count, 0u);
    model->end_step(1.0);
  }
  EXPECT_FALSE(model->masters(0).at("fc1.weight").grad().defined());
  EXPECT_TRUE(model->masters(1).at("fc1.weight").grad().defined());
}

// A frozen block's masters change only when the host loads or edits them: the next pass
// rebuilds the images of the ones that changed, and streams them.
TEST(StreamedModel, TheFrozenBlocksWhoseMastersTheHostChangedAreRebuiltAtTheNextPass) {
  const auto blocks = make_blocks(75);
  for (auto& p : blocks[0]->parameters()) p.set_requires_grad(false);
  auto model = wrap(blocks, "  mode: off\n");
  {
    torch::NoGradGuard no_grad;
    model->masters(0).at("fc1.weight").mul_(0.5);
  }
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(
      torch::allclose(model->forward(input(76)), run_plain(plain_twins(blocks, *model), input(76)), 1e-4, 1e-5));
}

// A forced route holds from the first fetch (ABI 1.3's initial hints): of an inference pass
// before any step, and of step 0.
TEST(StreamedModel, AForcedRouteHoldsFromTheFirstFetchOfAnyPass) {
  const std::string policy = "  mode: static\n  tiers: [bf16, int8, nf4]\n  force_nf4_blocks: [0]\n  force_int8_blocks: [2]\n";
  const auto model = wrap(make_blocks(37), policy);
  EXPECT_EQ(model->routes(), (std::vector<sp::Precision>{sp::Precision::nf4, sp::Precision::bf16, sp::Precision::int8}));
  const std::uint64_t forced_pass = model->image_bytes(0, sp::Precision::nf4) + model->image_bytes(1, sp::Precision::bf16) +
                                    model->image_bytes(2, sp::Precision::int8);
  {
    torch::NoGradGuard no_grad;
    model->forward(input(38));
  }
  EXPECT_EQ(model->evaluation_h2d_bytes(), forced_pass);
  model->begin_step(0);
  model->forward(input(38)).pow(2).mean().backward();
  model->post_backward();
  const tl::StepReport report = model->end_step(1.0);
  EXPECT_EQ(report.h2d_bytes[sp::Precision::nf4], 2 * model->image_bytes(0, sp::Precision::nf4));  // forward, backward
  EXPECT_EQ(report.h2d_bytes[sp::Precision::int8], model->image_bytes(2, sp::Precision::int8));     // the last is kept
}

#ifdef SP_TEST_ALIAS_ROUTE
// Issue 51's proof that a route is its row: the test build's int8_alias (sp/precision.h), INT8's
// images under a name and an ABI code of their own, is forced by its own force list, streams as
// INT8 does, is counted under its own name and comes back from a checkpoint, and no code outside
// the route table names it.
TEST(StreamedModel, TheTestBuildsAliasRouteStreamsIsReportedAndIsCheckpointed) {
  const std::string with_alias =
      "  mode: static\n  tiers: [bf16, int8, int8_alias, nf4]\n  force_int8_alias_blocks: [1]\n  force_nf4_blocks: "
      "[0]\n";
  const std::string with_int8 =
      "  mode: static\n  tiers: [bf16, int8, nf4]\n  force_int8_blocks: [1]\n  force_nf4_blocks: [0]\n";
  auto model = wrap(make_blocks(41), with_alias);
  auto twin = wrap(make_blocks(41), with_int8);  // the same weights, INT8 for block 1
  ASSERT_EQ(model->routes(),
            (std::vector<sp::Precision>{sp::Precision::nf4, sp::Precision::int8_alias, sp::Precision::bf16}));
  EXPECT_EQ(model->image_bytes(1, sp::Precision::int8_alias), twin->image_bytes(1, sp::Precision::int8));

  torch::optim::SGD optimizer(model->master_parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD twin_optimizer(twin->master_parameters(), torch::optim::SGDOptions(0.1));
  tl::StepReport report, twin_report;
  for (std::int64_t step = 0; step < 2; ++step) {
    for (auto [m, opt, out] :
         {std::tuple{model.get(), &optimizer, &report}, std::tuple{twin.get(), &twin_optimizer, &twin_report}}) {
      opt->zero_grad();
      m->begin_step(step);
      m->forward(input(42 + step)).pow(2).mean().backward();
      m->post_backward();
      opt->step();
      *out = m->end_step(1.0);
    }
  }
  // The same images as INT8's, so the same training.
  for (std::uint32_t b = 0; b < kBlocks; ++b) {
    for (const auto& [name, master] : model->masters(b)) EXPECT_TRUE(torch::equal(twin->masters(b).at(name), master));
  }
  // Counted under its own name.
  EXPECT_GT(report.h2d_bytes[sp::Precision::int8_alias], 0u);
  EXPECT_EQ(report.h2d_bytes[sp::Precision::int8_alias], twin_report.h2d_bytes[sp::Precision::int8]);
  EXPECT_EQ(report.h2d_bytes[sp::Precision::int8], 0u);
  EXPECT_EQ(report.h2d_bytes[sp::Precision::nf4], twin_report.h2d_bytes[sp::Precision::nf4]);

  // Back from a checkpoint, into a model whose policy forces nothing.
  const auto state = model->export_state();
  auto resumed = wrap(make_blocks(99), "  mode: static\n  tiers: [bf16, int8, int8_alias, nf4]\n");
  resumed->restore_state(state);
  torch::NoGradGuard no_grad;
  const std::vector<torch::Tensor> from = model->resident_parameters(), to = resumed->resident_parameters();
  for (std::size_t i = 0; i < from.size(); ++i) to[i].copy_(from[i]);
  EXPECT_EQ(resumed->routes(), model->routes());
  EXPECT_TRUE(torch::equal(resumed->forward(input(50)), model->forward(input(50))));
}
#endif

// A state exported before the plugin's first hints (by a plugin older than ABI 1.3, or by this
// layer before it asked for them) restores the default routes.
TEST(StreamedModel, RestoringAStateWithoutHintsRestoresTheDefaultRoutes) {
  const std::string policy = "  mode: static\n  tiers: [bf16, int8, nf4]\n  force_nf4_blocks: [0]\n";
  const auto fresh = wrap(make_blocks(37), policy);
  auto state = fresh->export_state();
  state["policy/hints"] = torch::empty({0}, torch::kUInt8);
  auto model = wrap(make_blocks(37), policy);
  model->begin_step(0);
  model->forward(input(38)).pow(2).mean().backward();
  model->post_backward();
  model->end_step(1.0);
  ASSERT_EQ(model->routes()[0], sp::Precision::nf4);
  model->restore_state(state);
  EXPECT_EQ(model->routes(), std::vector<sp::Precision>(kBlocks, sp::Precision::bf16));
  EXPECT_TRUE(model->hints().empty());
}

}  // namespace

namespace {

// A plugin that cannot export its state costs the checkpoint its policy state, not the rest:
// the entry is empty, and a restore from it keeps the masters and starts the policy over.
TEST(StreamedModel, AStateThePluginCannotExportKeepsEverythingElse) {
  const auto with_plugin = [](const std::vector<TinyBlock>& blocks, const std::string& config) {
    std::vector<tl::Block> list;
    for (const TinyBlock& b : blocks) list.push_back(tl::make_block(b, {"fc1.weight", "fc2.weight"}));
    tl::StreamedModelOptions options = test_options();
    options.plugin_file = SP_FIXTURE_SCRIPTED;  // the minimal example, failing on command
    options.config_yaml = config;
    return std::make_unique<tl::StreamedModel>(std::move(list), options);
  };
  const std::string config = "int8_max_l2: 1.5\nmin_samples: 2\n";
  auto model = with_plugin(make_blocks(40), config + "fixture_huge_export: 1\n");
  torch::optim::SGD optimizer(model->master_parameters(), torch::optim::SGDOptions(0.1));
  for (std::int64_t step = 0; step < 2; ++step) {
    optimizer.zero_grad();
    model->begin_step(step);
    model->forward(input(41)).pow(2).mean().backward();
    model->post_backward();
    optimizer.step();
    model->end_step(1.0);
  }
  const auto state = model->export_state();
  EXPECT_EQ(state.at("policy/state").numel(), 0);
  auto resumed = with_plugin(make_blocks(42), config);
  resumed->restore_state(state);
  EXPECT_TRUE(torch::equal(resumed->masters(1).at("fc2.weight"), model->masters(1).at("fc2.weight")));
  EXPECT_EQ(resumed->routes(), model->routes());
}

}  // namespace

// ---- sharded data parallelism: two ranks as two threads, Gloo over a store in memory --------

namespace {

// Runs body(rank, group, store) as ranks 0 and 1 on two threads, over one Gloo group whose
// store is in memory; what each threw, by rank ("" for nothing).
using RankBody =
    std::function<void(int, const c10::intrusive_ptr<c10d::ProcessGroupGloo>&, const c10::intrusive_ptr<c10d::Store>&)>;
std::vector<std::string> on_two_ranks(const RankBody& body) {
  const c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::string> failures(2);
  const auto rank_main = [&](int rank) {
    c10::intrusive_ptr<c10d::ProcessGroupGloo> group;
    try {
      auto options = c10d::ProcessGroupGloo::Options::create(std::chrono::seconds(30));
      options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
      group = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, 2, options);
      body(rank, group, store);
    } catch (const std::exception& e) {
      failures[rank] = e.what();
    }
    // A rank whose body makes no collective call can be done before the other has finished
    // connecting to it; closing its group then fails the other's constructor ("connection
    // closed by peer", seen on a 16-core machine). Each keeps its group until both are done.
    store->set("done/" + std::to_string(rank), std::vector<std::uint8_t>{});
    store->wait({"done/0", "done/1"});
  };
  std::thread other(rank_main, 1);
  rank_main(0);
  other.join();
  return failures;
}

// One rank's run: its losses, and the masters it keeps, by "block.parameter".
struct RankRun {
  std::vector<double> losses;
  std::map<std::string, torch::Tensor> masters;
};

// `steps` SGD steps of two ranks on the same blocks, each on its own input, replicated or
// sharded; `check(rank, model)` runs on each rank's model after the steps, on its thread.
std::vector<RankRun> run_two_ranks(bool shard, int steps,
                                   const std::function<void(int, tl::StreamedModel&)>& check = {},
                                   const std::vector<tl::PolicyUnit>& units = {}) {
  std::vector<std::vector<TinyBlock>> blocks{make_blocks(21), make_blocks(21)};
  std::vector<torch::Tensor> inputs{input(22), input(23)};
  std::vector<RankRun> runs(2);
  const std::vector<std::string> failures = on_two_ranks([&](int rank, const auto& group, const auto&) {
    std::vector<tl::Block> list;
    for (const TinyBlock& b : blocks[rank]) list.push_back(tl::make_block(b, {"fc1.weight", "fc2.weight"}));
    tl::StreamedModelOptions o = test_options();
    o.config_yaml = policy_yaml(units.empty() ? "  mode: static\n  tiers: [bf16, int8, nf4]\n  force_int8_blocks: [1]\n"
                                                "  force_nf4_blocks: [2]\n"
                                              : "  mode: static\n  tiers: [bf16, int8, nf4]\n  force_nf4_blocks: [1]\n");
    o.collectives = tl::over_process_group(group);
    o.shard_masters = shard;
    o.units = units;
    tl::StreamedModel model(std::move(list), o);
    std::vector<torch::Tensor> params = model.master_parameters();
    for (const torch::Tensor& r : model.resident_parameters()) params.push_back(r);
    torch::optim::SGD optimizer(params, torch::optim::SGDOptions(0.5));
    for (std::int64_t step = 0; step < steps; ++step) {
      optimizer.zero_grad();
      model.begin_step(step);
      const torch::Tensor loss = model.forward(inputs[rank]).pow(2).mean();
      loss.backward();
      const double mean = model.average(loss.item<double>());
      model.post_backward();
      optimizer.step();
      model.end_step(mean);
      runs[rank].losses.push_back(mean);
    }
    // What the evaluation engine delivers: the owners' updated weights on every rank.
    {
      torch::NoGradGuard no_grad;
      runs[rank].losses.push_back(model.forward(inputs[0]).pow(2).mean().item<double>());
    }
    for (std::uint32_t b = 0; b < model.num_blocks(); ++b) {
      for (const auto& [name, master] : model.masters(b)) {
        runs[rank].masters.emplace(std::to_string(b) + "." + name, master.clone());
      }
    }
    if (check) check(rank, model);
  });
  EXPECT_EQ(failures, (std::vector<std::string>{"", ""}));
  return runs;
}

}  // namespace

// Sharded, a measurement shares each allocation's images from their owners: every rank measures
// what a replicated rank measures, bit for bit.
TEST(ShardedMasters, CompareRoutesMeasuresWhatAReplicatedRankMeasures) {
  const std::vector<sp::Precision> a{sp::Precision::nf4, sp::Precision::int8, sp::Precision::bf16};
  const std::vector<sp::Precision> bf16(kBlocks, sp::Precision::bf16);
  const std::vector<torch::Tensor> xs{input(60), input(61)};
  std::vector<std::vector<double>> measured(4);
  const auto measure_into = [&](int slot) {
    return [&, slot](int rank, tl::StreamedModel& model) {
      const tl::RouteComparison c = model.compare_routes(
          [&](std::size_t i) { return tl::MeasuredBatch{model.forward(xs.at(i)).pow(2).mean(), {}}; }, xs.size(), a,
          bf16);
      measured[slot + rank] = c.batch_loss_differences;
      EXPECT_EQ(model.routes(), (std::vector<sp::Precision>{sp::Precision::bf16, sp::Precision::int8,
                                                           sp::Precision::nf4}));  // the policy's, as before
    };
  };
  run_two_ranks(false, 1, measure_into(0));
  run_two_ranks(true, 1, measure_into(2));
  ASSERT_EQ(measured[0].size(), xs.size());
  EXPECT_NE(measured[0][0], 0.0);
  for (std::size_t i = 1; i < measured.size(); ++i) EXPECT_EQ(measured[i], measured[0]) << i;
}

// Sharded, each rank keeps and updates every other block's masters and installs the others'
// images: the same two-way sums as replicated, so the same losses (training and evaluation,
// bit for bit on both ranks) and the same masters where a rank keeps them.
TEST(ShardedMasters, TwoRanksTrainAsReplicatedOnesKeepingHalfTheMasters) {
  const std::vector<RankRun> replicated = run_two_ranks(false, 3);
  const std::vector<RankRun> sharded = run_two_ranks(true, 3, [](int rank, tl::StreamedModel& model) {
    EXPECT_TRUE(model.sharded());
    EXPECT_EQ(model.gradient_reduction_device(), torch::Device(torch::kCPU));
    for (std::uint32_t b = 0; b < model.num_blocks(); ++b) {
      EXPECT_EQ(model.owner(b), static_cast<int>(b % 2));
      EXPECT_EQ(model.masters(b).empty(), model.owner(b) != rank) << b;
    }
    EXPECT_EQ(model.master_parameters().size(), rank == 0 ? 4u : 2u);  // blocks 0 and 2, or 1
    std::size_t master_entries = 0;
    for (const auto& [key, value] : model.export_state()) master_entries += key.rfind("master/", 0) == 0 ? 1 : 0;
    EXPECT_EQ(master_entries, rank == 0 ? 4u : 2u);
    // Another rank's block is updated there.
    model.begin_step(3);
    model.forward(input(24)).pow(2).mean().backward();
    model.post_backward();
    const std::uint32_t theirs = rank == 0 ? 1 : 0;
    EXPECT_THAT([&] { model.update_masters(theirs, sp::kernels::AdamWStep{}, {}); },
                ::testing::ThrowsMessage<std::logic_error>(::testing::HasSubstr("is owned by rank")));
    model.end_step(1.0);
  });
  ASSERT_EQ(replicated[0].losses.size(), 4u);
  for (int rank : {0, 1}) {
    EXPECT_EQ(sharded[rank].losses, replicated[0].losses) << "rank " << rank;
    for (const auto& [name, master] : sharded[rank].masters) {
      EXPECT_TRUE(torch::equal(master, replicated[0].masters.at(name))) << "rank " << rank << ": " << name;
    }
  }
  EXPECT_EQ(sharded[0].masters.size() + sharded[1].masters.size(), replicated[0].masters.size());
}

// A whole state dict of a sharded run: every rank gets every block's masters, each from its
// owner, equal to what the replicated run keeps (the owner's are its masters themselves).
TEST(ShardedMasters, GatherMastersGivesEveryRankEveryBlockWhole) {
  const std::vector<RankRun> replicated = run_two_ranks(false, 2);
  run_two_ranks(true, 2, [&](int rank, tl::StreamedModel& model) {
    for (std::uint32_t b = 0; b < model.num_blocks(); ++b) {
      const std::map<std::string, torch::Tensor> whole = model.gather_masters(b);
      ASSERT_EQ(whole.size(), 2u) << "rank " << rank << ", block " << b;
      for (const auto& [name, master] : whole) {
        EXPECT_TRUE(torch::equal(master, replicated[0].masters.at(std::to_string(b) + "." + name)))
            << "rank " << rank << ": " << b << "." << name;
        if (model.owner(b) == rank) {
          EXPECT_TRUE(master.is_same(model.masters(b).at(name)));
        }
      }
    }
    model.begin_step(2);
    EXPECT_THAT([&] { model.gather_masters(0); },
                ::testing::ThrowsMessage<std::logic_error>(::testing::HasSubstr("call it between steps")));
    model.abort_step();
  });
}

// A frozen block (LoRA's base) changes only when the host loads or edits it, which its owner
// alone sees: refresh_images() on every rank still sends the owner's new image to the others.
TEST(ShardedMasters, AFrozenBlockLoadedOnItsOwnerReachesEveryRankAtRefreshImages) {
  std::vector<std::vector<TinyBlock>> blocks{make_blocks(21), make_blocks(21)};
  const torch::Tensor x = input(26);  // drawn here: the ranks' threads share torch's generator
  std::vector<double> before(2), after(2);
  const std::vector<std::string> failures = on_two_ranks([&](int rank, const auto& group, const auto&) {
    std::vector<tl::Block> list;
    for (const TinyBlock& b : blocks[rank]) {
      b->fc1->weight.set_requires_grad(false);
      b->fc2->weight.set_requires_grad(false);
      list.push_back(tl::make_block(b, {"fc1.weight", "fc2.weight"}));
    }
    tl::StreamedModelOptions o = test_options();
    o.config_yaml = policy_yaml("  mode: off\n");
    o.collectives = tl::over_process_group(group);
    o.shard_masters = true;
    tl::StreamedModel model(std::move(list), o);
    torch::NoGradGuard no_grad;
    before[rank] = model.forward(x).pow(2).mean().item<double>();
    if (model.owner(0) == rank) model.masters(0).at("fc1.weight").mul_(0.5);
    model.refresh_images();
    after[rank] = model.forward(x).pow(2).mean().item<double>();
  });
  ASSERT_EQ(failures, (std::vector<std::string>{"", ""}));
  EXPECT_EQ(before[0], before[1]);
  EXPECT_NE(after[0], before[0]);
  EXPECT_EQ(after[1], after[0]);
}

// Units over blocks, sharded: a unit's blocks share their owner (unit u on rank u mod N), which
// computes the unit's moments; the run is the replicated one with the same units.
TEST(ShardedMasters, AUnitsBlocksShareTheirOwnerAndTrainAsReplicated) {
  const std::vector<tl::PolicyUnit> units = {{"front", 2}, {"back", 1}};
  const std::vector<RankRun> replicated = run_two_ranks(false, 3, {}, units);
  const std::vector<RankRun> sharded = run_two_ranks(
      true, 3,
      [](int, tl::StreamedModel& model) {
        EXPECT_EQ(model.owner(0), 0);
        EXPECT_EQ(model.owner(1), 0);
        EXPECT_EQ(model.owner(2), 1);
      },
      units);
  for (int rank : {0, 1}) EXPECT_EQ(sharded[rank].losses, replicated[0].losses) << "rank " << rank;
}

// A sharded restore is all or nothing across the ranks: the rank whose state lacks a master of
// its own names the entry, the other names that rank, and neither waits for the other.
TEST(ShardedMasters, ARestoreThatFailsOnOneRankFailsOnEveryRankByName) {
  run_two_ranks(true, 1, [](int rank, tl::StreamedModel& model) {
    std::map<std::string, torch::Tensor> state = model.export_state();
    if (rank == 1) state.erase("master/block1.fc1.weight");
    if (rank == 0) {
      EXPECT_THAT([&] { model.restore_state(state); }, ::testing::ThrowsMessage<tl::RankMismatchError>(
                                                           ::testing::HasSubstr("rank 1 of 2 could not restore")));
    } else {
      EXPECT_THAT([&] { model.restore_state(state); },
                  ::testing::ThrowsMessage<tl::StateEntryError>(::testing::HasSubstr("master/block1.fc1.weight")));
    }
    // Whole, it restores on both and the ranks go on.
    model.restore_state(model.export_state());
    model.begin_step(1);
    model.forward(input(25)).pow(2).mean().backward();
    model.post_backward();
    model.end_step(1.0);
  });
}

// Collectives::exchange: every rank's string on every rank, through a store (waiting as long
// as asked) or through broadcasts; a store exchange a rank never joins fails by name when its
// wait runs out, instead of hanging.
TEST(Collectives, ExchangeGivesEveryRankEveryRanksPart) {
  std::vector<std::vector<std::string>> through_store(2), through_broadcasts(2);
  const std::vector<std::string> failures = on_two_ranks([&](int rank, const auto& group, const auto& store) {
    const std::string mine = rank == 0 ? "rank 0 wrote it" : "";
    through_store[rank] = tl::over_process_group(group, store)->exchange("test", mine, std::chrono::seconds(30));
    through_broadcasts[rank] = tl::over_process_group(group)->exchange("test", mine, std::chrono::seconds(30));
  });
  ASSERT_EQ(failures, (std::vector<std::string>{"", ""}));
  const std::vector<std::string> expected{"rank 0 wrote it", ""};
  for (int rank : {0, 1}) {
    EXPECT_EQ(through_store[rank], expected) << rank;
    EXPECT_EQ(through_broadcasts[rank], expected) << rank;
  }

  // Rank 1 never comes.
  const auto lonely_store = c10::make_intrusive<c10d::HashStore>();
  EXPECT_THAT(
      [&] {
        tl::detail::exchange_through_store(*lonely_store, 0, 2, "checkpoint7/main", "", std::chrono::milliseconds(50));
      },
      ::testing::ThrowsMessage<tl::CollectiveError>(::testing::HasSubstr("exchange 'checkpoint7/main'")));
}

namespace {

// A group that takes no CPU tensors, as NCCL alone: what c10d says when a CPU tensor reaches it.
class DeviceOnlyCollectives final : public tl::Collectives {
 public:
  int rank() const override { return 0; }
  int size() const override { return 2; }
  std::unique_ptr<Pending> all_reduce(torch::Tensor tensor, tl::Reduction, std::string) override {
    refuse(tensor);
    return {};
  }
  void broadcast(torch::Tensor tensor, int, std::string) override { refuse(tensor); }

 private:
  static void refuse(const torch::Tensor& tensor) {
    if (tensor.device().is_cpu()) throw std::runtime_error("No backend type associated with device type cpu");
    throw std::logic_error("not reached: the test's model computes on the CPU");
  }
};

// Which group each call reached, by the group's name.
class NamedCollectives final : public tl::Collectives {
 public:
  NamedCollectives(std::string name, int rank, std::vector<std::string>& calls)
      : name_(std::move(name)), rank_(rank), calls_(calls) {}
  int rank() const override { return rank_; }
  int size() const override { return 2; }
  std::unique_ptr<Pending> all_reduce(torch::Tensor, tl::Reduction, std::string what) override {
    calls_.push_back(name_ + ": " + what);
    return {};
  }
  bool reduces_on(const torch::Device&) const override { return name_ == "device"; }
  std::unique_ptr<Pending> reduce(torch::Tensor, int, tl::Reduction, std::string what) override {
    calls_.push_back(name_ + ": " + what);
    return {};
  }
  void broadcast(torch::Tensor, int, std::string what) override { calls_.push_back(name_ + ": " + what); }
  std::vector<std::string> exchange(const std::string& key, const std::string&, std::chrono::milliseconds) override {
    calls_.push_back(name_ + ": " + key);
    return {};
  }

 private:
  std::string name_;
  int rank_;
  std::vector<std::string>& calls_;
};

}  // namespace

// The layer's own collectives run on host tensors: a group that refuses them is named at
// construction, with the fix, not met as a c10d error in the first backward.
TEST(Collectives, AGroupThatTakesNoCpuTensorsIsRefusedAtConstructionWithTheFix) {
  std::vector<tl::Block> list;
  for (const TinyBlock& b : make_blocks(31)) list.push_back(tl::make_block(b, {"fc1.weight", "fc2.weight"}));
  tl::StreamedModelOptions o = test_options();
  o.config_yaml = policy_yaml("  mode: off\n");
  o.collectives = std::make_shared<DeviceOnlyCollectives>();
  EXPECT_THAT([&] { tl::StreamedModel model(std::move(list), o); },
              ::testing::ThrowsMessage<std::invalid_argument>(::testing::AllOf(
                  ::testing::HasSubstr("refused an all-reduce of a CPU tensor (No backend type associated"),
                  ::testing::HasSubstr("cpu:gloo,cuda:nccl"))));
}

// by_device(): CPU tensors to the host group, any other device's to the device group (a meta
// tensor stands for a GPU's here), exchange() through the host group; groups over different
// ranks are refused.
TEST(Collectives, ByDeviceSendsEachTensorToItsDevicesGroup) {
  std::vector<std::string> calls;
  const auto both = tl::by_device(std::make_shared<NamedCollectives>("host", 1, calls),
                                  std::make_shared<NamedCollectives>("device", 1, calls));
  EXPECT_EQ(both->rank(), 1);
  EXPECT_EQ(both->size(), 2);
  both->all_reduce(torch::zeros({1}), tl::Reduction::sum, "moments");
  both->all_reduce(torch::empty({1}, torch::kMeta), tl::Reduction::sum, "gradients");
  both->reduce(torch::empty({1}, torch::kMeta), 0, tl::Reduction::sum, "owned gradients");
  both->broadcast(torch::zeros({1}), 0, "image");
  both->exchange("checkpoint", "", std::chrono::seconds(1));
  EXPECT_EQ(calls, (std::vector<std::string>{"host: moments", "device: gradients", "device: owned gradients",
                                             "host: image", "host: checkpoint"}));
  // Whether a device's tensors are reduced where they are is the device group's answer.
  EXPECT_TRUE(both->reduces_on(torch::Device(torch::kMeta)));
  EXPECT_FALSE(both->reduces_on(torch::kCPU));
  EXPECT_THAT(
      [&] {
        tl::by_device(std::make_shared<NamedCollectives>("host", 0, calls),
                      std::make_shared<NamedCollectives>("device", 1, calls));
      },
      ::testing::ThrowsMessage<std::invalid_argument>(::testing::HasSubstr("must span the same ranks")));
}

// With data parallelism such a tensor's gradient would differ from rank to rank: refused by
// name, on every rank, in the backward that meets it.
TEST(Collectives, ATensorABlockReadsWithoutListingItIsRefusedByName) {
  std::vector<std::vector<TinyBlock>> blocks{make_blocks(72), make_blocks(72)};
  const std::vector<std::string> failures = on_two_ranks([&](int rank, const auto& group, const auto&) {
    const torch::Tensor gate = torch::ones({kDim}).requires_grad_(true);
    tl::StreamedModelOptions o = test_options();
    o.config_yaml = policy_yaml("  mode: off\n");
    o.collectives = tl::over_process_group(group);
    tl::StreamedModel model(gated_blocks(blocks[rank], gate), o);
    model.begin_step(0);
    model.forward(input(73 + rank)).pow(2).mean().backward();
  });
  for (const std::string& failure : failures) {
    EXPECT_THAT(failure, ::testing::HasSubstr("block2 reads a tensor that requires a gradient and is none of its "
                                              "parameters (Float of shape [64])"));
  }
}

// A c10d group says which backend takes a device's tensors: Gloo, which stages them through the
// host, is not one the layer reduces on the device with.
TEST(Collectives, AGlooGroupDoesNotReduceDeviceTensorsWhereTheyAre) {
  const std::vector<std::string> failures = on_two_ranks([&](int, const auto& group, const auto&) {
    const auto collectives = tl::over_process_group(group);
    EXPECT_FALSE(collectives->reduces_on(torch::Device(torch::kCUDA, 0)));
    EXPECT_FALSE(collectives->reduces_on(torch::kCPU));
  });
  EXPECT_EQ(failures, (std::vector<std::string>{"", ""}));
  if (!tl::nccl_available()) {
    EXPECT_THROW(tl::nccl_group(c10::make_intrusive<c10d::HashStore>(), 0, 1, std::chrono::seconds(1)),
                 std::logic_error);
  }
}

// On a GPU with NCCL joined to Gloo (one rank: a lent test machine has one GPU, and NCCL takes
// one rank per GPU), each block's gradient is reduced on the device in the backward and crosses
// to the host once: the run equals the one without collectives (a sum over one rank, divided by
// one).
TEST(Collectives, WithNcclTheGradientsAreReducedOnTheGpuAndTheRunIsUnchanged) {
  SP_SKIP_UNLESS_GPU(torch::cuda::is_available() && tl::nccl_available(),
                     "LibTorch sees no CUDA device, or this build has no NCCL group (nccl_available())");
  const torch::Device gpu(torch::kCUDA, 0);
  const auto train = [&](std::shared_ptr<tl::Collectives> collectives) {
    std::vector<TinyBlock> blocks = make_blocks(41);
    std::vector<tl::Block> list;
    for (TinyBlock& b : blocks) {
      b->to(gpu);
      list.push_back(tl::make_block(b, {"fc1.weight", "fc2.weight"}));
    }
    tl::StreamedModelOptions o = test_options();
    o.config_yaml = policy_yaml("  mode: static\n  tiers: [bf16, int8, nf4]\n  force_int8_blocks: [1]\n");
    o.device = gpu;
    o.collectives = std::move(collectives);
    tl::StreamedModel model(std::move(list), o);
    EXPECT_EQ(model.gradient_reduction_device(), o.collectives ? gpu : torch::Device(torch::kCPU));
    std::vector<torch::Tensor> params = model.master_parameters();
    for (const torch::Tensor& r : model.resident_parameters()) params.push_back(r);
    torch::optim::SGD optimizer(params, torch::optim::SGDOptions(0.5));
    RankRun run;
    for (std::int64_t step = 0; step < 3; ++step) {
      optimizer.zero_grad();
      model.begin_step(step);
      const torch::Tensor loss = model.forward(input(42 + step).to(gpu)).pow(2).mean();
      loss.backward();
      model.post_backward();
      optimizer.step();
      run.losses.push_back(loss.item<double>());
      model.end_step(run.losses.back());
    }
    for (std::uint32_t b = 0; b < model.num_blocks(); ++b) {
      for (const auto& [name, master] : model.masters(b)) run.masters.emplace(std::to_string(b) + "." + name, master);
    }
    return run;
  };
  const auto store = c10::make_intrusive<c10d::HashStore>();
  auto options = c10d::ProcessGroupGloo::Options::create(std::chrono::seconds(30));
  options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  const auto gloo = tl::over_process_group(c10::make_intrusive<c10d::ProcessGroupGloo>(store, 0, 1, options));
  const RankRun grouped = train(tl::by_device(
      gloo, tl::nccl_group(c10::make_intrusive<c10d::PrefixStore>("nccl", store), 0, 1, std::chrono::seconds(30))));
  const RankRun alone = train(nullptr);
  ASSERT_EQ(grouped.losses.size(), alone.losses.size());
  for (std::size_t i = 0; i < alone.losses.size(); ++i) {
    EXPECT_NEAR(grouped.losses[i], alone.losses[i], 1e-6 * std::abs(alone.losses[i])) << "step " << i;
  }
  for (const auto& [name, master] : alone.masters) {
    EXPECT_TRUE(torch::allclose(grouped.masters.at(name), master, 1e-6, 1e-8)) << name;
  }
}
