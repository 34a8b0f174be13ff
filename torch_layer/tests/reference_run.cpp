// The C++ side of the Python binding's equivalence test (python/tests): a few training steps of
// a small residual MLP model through StreamedModel, written out as JSON (each step's loss and
// the routes decided after it). python/tests/test_streamed.py builds the same model from the
// same random draws in Python and must take the same decisions.
//
// usage: sp_torch_layer_reference <plugin file> <output json>
#include <fstream>
#include <iostream>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "sp/torch_layer/streamed_model.h"

namespace {
namespace tl = sp::torch_layer;

constexpr std::int64_t kDim = 32, kHidden = 64, kBlocks = 3, kSteps = 12;
constexpr double kLr = 0.05;

// Parameters in the order the Python twin creates them, from the same draws.
struct ReferenceBlockImpl : torch::nn::Module {
  ReferenceBlockImpl() {
    ln_weight = register_parameter("ln_weight", torch::ones({kDim}));
    ln_bias = register_parameter("ln_bias", torch::zeros({kDim}));
    fc1_weight = register_parameter("fc1_weight", torch::randn({kHidden, kDim}) * 0.1);
    fc1_bias = register_parameter("fc1_bias", torch::zeros({kHidden}));
    fc2_weight = register_parameter("fc2_weight", torch::randn({kDim, kHidden}) * 0.1);
    fc2_bias = register_parameter("fc2_bias", torch::zeros({kDim}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const torch::Tensor h = torch::layer_norm(x, {kDim}, ln_weight, ln_bias);
    return x + torch::linear(torch::gelu(torch::linear(h, fc1_weight, fc1_bias)), fc2_weight, fc2_bias);
  }
  torch::Tensor ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias;
};
TORCH_MODULE(ReferenceBlock);

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: sp_torch_layer_reference <plugin file> <output json>\n";
    return 2;
  }
  torch::manual_seed(7);
  std::vector<ReferenceBlock> modules;
  std::vector<tl::Block> blocks;
  for (int b = 0; b < kBlocks; ++b) {
    modules.emplace_back();
    blocks.push_back(tl::make_block(modules.back(), {"fc1_weight", "fc2_weight"}));
  }
  tl::StreamedModelOptions options;
  options.plugin_file = argv[1];
  // The same policy text as the Python test's.
  options.config_yaml =
      "selective_precision:\n  telemetry_enabled: false\n  mode: dynamic\n  warmup_steps: 2\n"
      "  update_interval_steps: 2\n  history_window: 2\n  min_steps_between_switches: 2\n"
      "  int8_threshold: 0.5\n  bf16_threshold: 0.7\n  quant_error_threshold: 1.0\n";
  tl::StreamedModel model(std::move(blocks), options);
  std::vector<torch::Tensor> params = model.master_parameters();
  for (const torch::Tensor& r : model.resident_parameters()) params.push_back(r);

  nlohmann::json out = {{"losses", nlohmann::json::array()}, {"routes", nlohmann::json::array()}};
  for (std::int64_t step = 0; step < kSteps; ++step) {
    torch::manual_seed(1000 + step);
    const torch::Tensor x = torch::randn({4, 8, kDim});
    const torch::Tensor target = torch::randn({4, 8, kDim});
    model.begin_step(step);
    const torch::Tensor loss = torch::mse_loss(model.forward(x), target);
    loss.backward();
    model.post_backward();
    {
      torch::NoGradGuard no_grad;
      for (torch::Tensor& p : params) {
        if (!p.grad().defined()) continue;
        p.add_(p.grad(), -kLr);
        p.mutable_grad().zero_();
      }
    }
    const tl::StepReport report = model.end_step(loss.item<double>());
    out["losses"].push_back(loss.item<double>());
    nlohmann::json routes = nlohmann::json::array();
    for (sp::Precision p : report.routes) routes.push_back(sp::precision_name(p));
    out["routes"].push_back(routes);
  }
  std::ofstream(argv[2]) << out.dump(2) << "\n";
  return 0;
}
