#include "gpt_model.h"

#include <cmath>
#include <limits>
#include <random>

#include <fmt/format.h>

namespace sp::train {

namespace {

// Output rows x input columns of each streamed matrix.
std::array<std::array<std::int64_t, 2>, kStreamedPerBlock> streamed_shapes(const ModelConfig& config) {
  const std::int64_t c = config.d_model;
  const std::int64_t hidden = c * config.mlp_ratio;
  return {{{3 * c, c}, {c, c}, {hidden, c}, {c, hidden}}};
}

bool computes_on_masters(const torch::TensorOptions& compute) {
  return compute.device().is_cpu() && compute.dtype() == torch::kFloat32;
}

}  // namespace

GptModel::GptModel(const ModelConfig& config, TrainMode mode, const LoraConfig& lora, std::uint64_t seed,
                   const torch::TensorOptions& compute)
    : config_(config), mode_(mode), compute_(compute), lora_scale_(lora.alpha / lora.rank) {
  torch::manual_seed(seed);
  const std::int64_t c = config.d_model;
  const auto shapes = streamed_shapes(config);
  // GPT-2's scaled init of the residual projections keeps the residual stream's variance flat
  // in depth.
  const double residual_std = config.init_std / std::sqrt(2.0 * config.n_blocks);
  wte_ = add_resident("wte", torch::randn({kVocab, c}) * config.init_std, true);
  wpe_ =
      add_resident("wpe", torch::randn({static_cast<std::int64_t>(config.seq_len), c}) * (config.init_std / 2), false);
  streamed_.resize(config.n_blocks);
  block_resident_.resize(config.n_blocks);
  block_adapters_.resize(config.n_blocks);
  for (std::uint32_t b = 0; b < config.n_blocks; ++b) {
    for (std::size_t t = 0; t < kStreamedPerBlock; ++t) {
      const double std = (t == 1 || t == 3) ? residual_std : config.init_std;
      // Trained through the layer's masters in full mode, frozen under LoRA.
      streamed_[b][t] =
          (torch::randn({shapes[t][0], shapes[t][1]}) * std).contiguous().requires_grad_(mode == TrainMode::full);
    }
    for (const char* norm : {"ln1", "ln2"}) {
      block_resident_[b].push_back(add_resident(fmt::format("block{}.{}.weight", b, norm), torch::ones({c}), false));
      block_resident_[b].push_back(add_resident(fmt::format("block{}.{}.bias", b, norm), torch::zeros({c}), false));
    }
    if (mode == TrainMode::lora) {
      const std::int64_t r = lora.rank;
      for (std::size_t t = 0; t < kStreamedPerBlock; ++t) {
        // B starts at zero so that the adapted model starts as the base model.
        const std::size_t a =
            add_resident(fmt::format("block{}.{}.lora_a", b, kStreamedNames[t]),
                         torch::randn({r, shapes[t][1]}) / std::sqrt(static_cast<double>(shapes[t][1])), false);
        const std::size_t bb = add_resident(fmt::format("block{}.{}.lora_b", b, kStreamedNames[t]),
                                            torch::zeros({shapes[t][0], r}), false);
        block_resident_[b].push_back(a);
        block_resident_[b].push_back(bb);
        block_adapters_[b].push_back(a);
        block_adapters_[b].push_back(bb);
      }
    }
  }
  lnf_w_ = add_resident("ln_f.weight", torch::ones({c}), false);
  lnf_b_ = add_resident("ln_f.bias", torch::zeros({c}), false);
  const std::int64_t t = config.seq_len;
  causal_mask_ = torch::ones({t, t}, compute.dtype(torch::kBool)).triu(1);
}

std::size_t GptModel::add_resident(std::string name, torch::Tensor value, bool decay) {
  value = value.contiguous().requires_grad_(true);
  torch::Tensor grad = host_gradient_buffer(value);
  torch::Tensor compute = value;
  if (computes_on_masters(compute_)) {
    value.mutable_grad() = grad;  // autograd accumulates into a defined .grad in place
  } else {
    compute = value.detach().to(compute_, /*non_blocking=*/false, /*copy=*/true).requires_grad_(true);
  }
  resident_.push_back(ResidentParam{std::move(name), value, std::move(grad), decay, std::move(compute)});
  return resident_.size() - 1;
}

void GptModel::refresh_compute() {
  if (computes_on_masters(compute_)) return;
  torch::NoGradGuard no_grad;
  const bool pinned = compute_.device().is_cuda();
  for (ResidentParam& p : resident_) {
    if (!pinned) {
      p.compute.copy_(p.value);
      continue;
    }
    // Converted on the host into a pinned buffer first: a copy from pageable memory, or one
    // that converts the dtype on the way, would make the host wait for it.
    const torch::Tensor staged =
        torch::empty(p.value.sizes(), torch::TensorOptions().dtype(p.compute.dtype()).pinned_memory(true));
    staged.copy_(p.value);
    p.compute.copy_(staged, /*non_blocking=*/true);
  }
}

void GptModel::queue_resident_gradients_to_host() {
  if (computes_on_masters(compute_)) return;
  for (ResidentParam& p : resident_) {
    torch::Tensor& computed = p.compute.mutable_grad();
    if (!computed.defined()) continue;
    p.grad.copy_(computed, /*non_blocking=*/true);
  }
}

void GptModel::clear_gradients() {
  for (ResidentParam& p : resident_) {
    p.grad.zero_();
    if (!computes_on_masters(compute_)) p.compute.mutable_grad().reset();
  }
}

void GptModel::plant_outlier_channels(std::uint64_t seed) {
  const std::int64_t c = config_.d_model;
  const float magnitude = static_cast<float>(config_.outlier_magnitude);
  const std::int64_t spans = config_.outlier_channels;
  for (std::uint32_t b : config_.outlier_blocks) {
    // A generator of its own: the channels must not depend on, nor change, the init's draws.
    std::mt19937_64 generator(seed ^ (0x9e3779b97f4a7c15ull * (b + 1)));
    torch::NoGradGuard no_grad;
    BlockWeights& w = streamed_[b];
    // One channel in each of `spans` equal spans of the row, so that n channels reach n
    // groups of an image whose groups are c / n wide.
    for (std::int64_t k = 0; k < spans; ++k) {
      const std::int64_t first = k * c / spans, last = (k + 1) * c / spans - 1;
      const std::int64_t channel = std::uniform_int_distribution<std::int64_t>(first, last)(generator);
      w[0].select(0, 2 * c + channel).div_(magnitude);  // the channel's value row
      w[1].select(1, channel).mul_(magnitude);          // the column of attn.proj that reads it
    }
  }
}

torch::Tensor GptModel::host_gradient_buffer(const torch::Tensor& like) const {
  return torch::zeros(like.sizes(),
                      torch::TensorOptions().dtype(torch::kFloat32).pinned_memory(compute_.device().is_cuda()));
}

sp::torch_layer::Block GptModel::unit(std::string name, std::uint32_t block, std::vector<std::size_t> tensors,
                                      std::vector<std::size_t> resident,
                                      std::function<torch::Tensor(const torch::Tensor&)> forward) {
  const std::string prefix = fmt::format("block{}.", block);
  std::vector<std::string> streamed, moments_from;
  for (std::size_t t : tensors) {
    streamed.push_back(kStreamedNames[t]);
    if (mode_ != TrainMode::lora) continue;
    for (std::size_t a : {block_adapters_[block][2 * t], block_adapters_[block][2 * t + 1]}) {
      resident.push_back(a);
      moments_from.push_back(resident_[a].name.substr(prefix.size()));
    }
  }
  return sp::torch_layer::Block{std::move(name),
                                [this, block, tensors, resident, prefix] {
                                  sp::torch_layer::NamedParameters params;
                                  for (std::size_t t : tensors)
                                    params.emplace_back(kStreamedNames[t], streamed_[block][t]);
                                  for (std::size_t r : resident)
                                    params.emplace_back(resident_[r].name.substr(prefix.size()), resident_[r].compute);
                                  return params;
                                },
                                std::move(forward), std::move(streamed), std::move(moments_from)};
}

std::vector<sp::torch_layer::Block> GptModel::layer_blocks() {
  std::vector<sp::torch_layer::Block> units;
  for (std::uint32_t b = 0; b < config_.n_blocks; ++b) {
    const std::vector<std::size_t>& norms = block_resident_[b];  // ln1 weight, bias, ln2 weight, bias
    if (config_.streaming_unit == StreamingUnit::block) {
      units.push_back(unit(unit_name(b), b, {0, 1, 2, 3}, {norms[0], norms[1], norms[2], norms[3]},
                           [this, b](const torch::Tensor& x) { return block_forward(b, x); }));
    } else {
      units.push_back(unit(unit_name(2 * b), b, {0, 1}, {norms[0], norms[1]},
                           [this, b](const torch::Tensor& x) { return attention_sublayer(b, x); }));
      units.push_back(unit(unit_name(2 * b + 1), b, {2, 3}, {norms[2], norms[3]},
                           [this, b](const torch::Tensor& x) { return mlp_sublayer(b, x); }));
    }
  }
  return units;
}

std::vector<torch::Tensor> GptModel::outside_blocks() const {
  std::vector<torch::Tensor> out;
  for (std::size_t r : {wte_, wpe_, lnf_w_, lnf_b_}) out.push_back(resident_[r].compute);
  return out;
}

std::uint32_t GptModel::num_units() const {
  return config_.streaming_unit == StreamingUnit::block ? config_.n_blocks : 2 * config_.n_blocks;
}

std::string GptModel::unit_name(std::uint32_t unit) const {
  if (config_.streaming_unit == StreamingUnit::block) return fmt::format("block{}", unit);
  return fmt::format("block{}.{}", unit / 2, unit % 2 == 0 ? "attn" : "mlp");
}

std::uint32_t GptModel::unit_of(std::uint32_t block, std::size_t tensor) const {
  return config_.streaming_unit == StreamingUnit::block ? block : 2 * block + (tensor >= 2 ? 1 : 0);
}

torch::Tensor GptModel::embed(const torch::Tensor& idx) {
  const std::int64_t t = idx.size(1);
  return torch::embedding(resident_[wte_].compute, idx) + resident_[wpe_].compute.narrow(0, 0, t);
}

torch::Tensor GptModel::head_loss(const torch::Tensor& h, const torch::Tensor& targets) {
  const std::int64_t c = config_.d_model;
  const torch::Tensor normed = torch::layer_norm(h, {c}, resident_[lnf_w_].compute, resident_[lnf_b_].compute);
  // The loss is reduced in fp32 whatever the compute dtype.
  const torch::Tensor logits = torch::matmul(normed, resident_[wte_].compute.t()).to(torch::kFloat32);
  return torch::nn::functional::cross_entropy(logits.view({-1, kVocab}), targets.view({-1}));
}

torch::Tensor GptModel::linear(std::uint32_t block, std::size_t which, const torch::Tensor& x) {
  torch::Tensor y = torch::matmul(x, streamed_[block][which].t());
  if (mode_ == TrainMode::lora) {
    const torch::Tensor& a = resident_[block_adapters_[block][2 * which]].compute;
    const torch::Tensor& b = resident_[block_adapters_[block][2 * which + 1]].compute;
    y = y + torch::matmul(torch::matmul(x, a.t()), b.t()) * lora_scale_;
  }
  return y;
}

torch::Tensor GptModel::block_forward(std::uint32_t block, const torch::Tensor& x) {
  return mlp_sublayer(block, attention_sublayer(block, x));
}

torch::Tensor GptModel::attention_sublayer(std::uint32_t block, const torch::Tensor& x) {
  const std::int64_t batch = x.size(0), t = x.size(1), c = x.size(2);
  const std::int64_t heads = config_.n_heads, head_dim = c / heads;
  const auto& norms = block_resident_[block];
  const torch::Tensor h1 = torch::layer_norm(x, {c}, resident_[norms[0]].compute, resident_[norms[1]].compute);
  const torch::Tensor qkv = linear(block, 0, h1).view({batch, t, 3, heads, head_dim}).permute({2, 0, 3, 1, 4});
  const torch::Tensor scores =
      torch::matmul(qkv[0], qkv[1].transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(head_dim)));
  const torch::Tensor attention = torch::softmax(
      scores.masked_fill(causal_mask_.narrow(0, 0, t).narrow(1, 0, t), -std::numeric_limits<float>::infinity()), -1);
  const torch::Tensor mixed = torch::matmul(attention, qkv[2]).transpose(1, 2).reshape({batch, t, c});
  return x + linear(block, 1, mixed);
}

torch::Tensor GptModel::mlp_sublayer(std::uint32_t block, const torch::Tensor& x) {
  const std::int64_t c = x.size(2);
  const auto& norms = block_resident_[block];
  const torch::Tensor h2 = torch::layer_norm(x, {c}, resident_[norms[2]].compute, resident_[norms[3]].compute);
  return x + linear(block, 3, torch::gelu(linear(block, 2, h2)));
}

}  // namespace sp::train
