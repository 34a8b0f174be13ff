// A LLaMA-style language model (RMSNorm, rotary attention, SwiGLU) in plain LibTorch,
// trained on the bytes of /usr/share/common-licenses with every block's matrices streamed
// through Selective Precision. Lines that concern Selective Precision end in "// [sp]".
// Usage: llama_streamed [steps] [policy.yaml] [recalibrate every N steps]
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "sp/torch_layer/streamed_model.h"  // [sp]

namespace {

constexpr std::int64_t kVocab = 256, kDim = 64, kHeads = 4, kHidden = 172, kBlocks = 4, kSeq = 32, kBatch = 8;

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight) {
  return x * torch::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + 1e-5) * weight;
}

// Rotates each (even, odd) pair of a head's channels by its position's angle.
torch::Tensor rotate(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const auto pairs = x.reshape({x.size(0), x.size(1), x.size(2), x.size(3) / 2, 2});
  const auto even = pairs.select(-1, 0), odd = pairs.select(-1, 1);
  return torch::stack({even * cos - odd * sin, even * sin + odd * cos}, -1).flatten(-2);
}

struct LlamaBlockImpl : torch::nn::Module {
  LlamaBlockImpl() {
    const auto linear = [&](const char* name, std::int64_t in, std::int64_t out) {
      return register_module(name, torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false)));
    };
    wq = linear("wq", kDim, kDim), wk = linear("wk", kDim, kDim), wv = linear("wv", kDim, kDim);
    wo = linear("wo", kDim, kDim);
    w1 = linear("w1", kDim, kHidden), w3 = linear("w3", kDim, kHidden), w2 = linear("w2", kHidden, kDim);
    attn_norm = register_parameter("attn_norm", torch::ones({kDim}));
    mlp_norm = register_parameter("mlp_norm", torch::ones({kDim}));
    const auto inv = torch::pow(10000.0, -torch::arange(0, kDim / kHeads, 2, torch::kFloat32) / (kDim / kHeads));
    const auto angles = torch::outer(torch::arange(kSeq, torch::kFloat32), inv);
    cos = register_buffer("cos", angles.cos()), sin = register_buffer("sin", angles.sin());
    mask = register_buffer("mask", torch::ones({kSeq, kSeq}, torch::kBool).triu(1));
  }

  torch::Tensor forward(const torch::Tensor& x) {
    const std::int64_t b = x.size(0), t = x.size(1), hd = kDim / kHeads;
    const auto heads = [&](const torch::Tensor& y) { return y.view({b, t, kHeads, hd}).transpose(1, 2); };
    const auto h = rms_norm(x, attn_norm);
    const auto c = cos.narrow(0, 0, t), s = sin.narrow(0, 0, t);
    const auto q = rotate(heads(wq(h)), c, s), k = rotate(heads(wk(h)), c, s), v = heads(wv(h));
    auto scores = q.matmul(k.transpose(-2, -1)) / std::sqrt(static_cast<double>(hd));
    scores = scores.masked_fill(mask.narrow(0, 0, t).narrow(1, 0, t), -INFINITY);
    const auto attended = torch::softmax(scores, -1).matmul(v).transpose(1, 2).reshape({b, t, kDim});
    const auto x1 = x + wo(attended);
    const auto m = rms_norm(x1, mlp_norm);
    return x1 + w2(torch::silu(w1(m)) * w3(m));
  }

  torch::nn::Linear wq{nullptr}, wk{nullptr}, wv{nullptr}, wo{nullptr}, w1{nullptr}, w3{nullptr}, w2{nullptr};
  torch::Tensor attn_norm, mlp_norm, cos, sin, mask;
};
TORCH_MODULE(LlamaBlock);

std::string read_corpus(const std::filesystem::path& dir) {
  std::string text;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (!entry.is_regular_file()) continue;
    std::ifstream in(entry.path(), std::ios::binary);
    text.append(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  return text;
}

}  // namespace

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 20;
  std::string policy =
      "selective_precision:\n  mode: static\n  tiers: [bf16, int8, nf4]\n"
      "  force_int8_blocks: [0, 3]\n  force_nf4_blocks: [1, 2]\n  telemetry_enabled: false\n";
  if (argc > 2 && argv[2][0] != '\0') {
    std::ifstream in(argv[2]);
    if (!in) return std::fprintf(stderr, "llama_streamed: cannot read %s\n", argv[2]), 2;
    policy.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  torch::manual_seed(0);
  const std::string corpus = read_corpus("/usr/share/common-licenses");
  const auto bytes =
      torch::from_blob(const_cast<char*>(corpus.data()), {static_cast<std::int64_t>(corpus.size())}, torch::kUInt8)
          .to(torch::kInt64);
  torch::nn::Embedding embed(kVocab, kDim);
  torch::nn::Linear head(torch::nn::LinearOptions(kDim, kVocab).bias(false));
  const torch::Tensor final_norm = torch::ones({kDim}, torch::requires_grad());

  std::vector<sp::torch_layer::Block> blocks;                                                          // [sp]
  for (int i = 0; i < kBlocks; ++i) {                                                                  // [sp]
    blocks.push_back(sp::torch_layer::make_block(LlamaBlock(),                                         // [sp]
                                                 {"wq.weight", "wk.weight", "wv.weight", "wo.weight",  // [sp]
                                                  "w1.weight", "w3.weight", "w2.weight"}));            // [sp]
  }                                                                                                    // [sp]
  sp::torch_layer::StreamedModelOptions options;                                                       // [sp]
  options.plugin_file = SP_PLUGIN_DIR "/libsp_selective_precision.so";                                 // [sp]
  options.config_yaml = policy;                                                                        // [sp]
  options.recalibrate_every = argc > 3 ? std::atoi(argv[3]) : 0;                                       // [sp]
  sp::torch_layer::StreamedModel model(std::move(blocks), options);                                    // [sp]

  std::vector<torch::Tensor> params = model.master_parameters();          // [sp]
  for (const auto& p : model.resident_parameters()) params.push_back(p);  // [sp]
  for (const auto& p : embed->parameters()) params.push_back(p);
  for (const auto& p : head->parameters()) params.push_back(p);
  params.push_back(final_norm);
  torch::optim::AdamW optimizer(params, torch::optim::AdamWOptions(3e-3).weight_decay(0.01));

  const auto batch = [&](int seed) {
    const auto starts =
        torch::randint(bytes.size(0) - kSeq - 1, {kBatch}, torch::Generator(at::detail::createCPUGenerator(seed)));
    std::vector<torch::Tensor> rows;
    for (int i = 0; i < kBatch; ++i) rows.push_back(bytes.narrow(0, starts[i].item<std::int64_t>(), kSeq + 1));
    return torch::stack(rows);
  };
  const auto loss_of = [&](const torch::Tensor& tokens) {
    const auto hidden = model.forward(embed(tokens.narrow(1, 0, kSeq)));  // [sp]
    const auto logits = head(rms_norm(hidden, final_norm));
    return torch::cross_entropy_loss(logits.reshape({-1, kVocab}), tokens.narrow(1, 1, kSeq).reshape(-1));
  };
  {
    torch::NoGradGuard no_grad;
    const auto errors = model.calibrate({embed(batch(-1).narrow(1, 0, kSeq))});                             // [sp]
    std::printf("calibration: block 0 output error INT8 %.4f, NF4 %.4f\n", errors[sp::Precision::int8][0],
                errors[sp::Precision::nf4][0]);  // [sp]
  }

  std::uint64_t sent = 0, as_bf16 = 0;
  double first = NAN, loss_value = NAN, calibration_seconds = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int step = 0; step < steps; ++step) {
    optimizer.zero_grad();
    model.begin_step(step);  // [sp]
    const auto loss = loss_of(batch(step));
    loss.backward();
    model.post_backward();  // [sp]
    optimizer.step();
    loss_value = loss.item<double>();
    const auto report = model.end_step(loss_value);                                // [sp]
    sent += report.h2d_bytes.total();                                              // [sp]
    as_bf16 += report.h2d_bytes_all_bf16;                                          // [sp]
    calibration_seconds += report.calibration_seconds;                             // [sp]
    if (step == 0) first = loss_value;
    std::printf("step %d: loss %.4f\n", step, loss_value);
  }
  std::printf("loss %.4f -> %.4f; H2D bytes %llu of %llu as BF16 (%.1f%% saved)\n", first, loss_value,
              static_cast<unsigned long long>(sent), static_cast<unsigned long long>(as_bf16),
              as_bf16 ? 100.0 * (1.0 - static_cast<double>(sent) / as_bf16) : 0.0);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("%.1f ms per step, of which re-calibration %.1f ms\n", 1e3 * seconds / steps,
              1e3 * calibration_seconds / steps);
  return std::isfinite(loss_value) && loss_value < first ? 0 : 1;
}
