// A GPT-style byte-level decoder whose transformer blocks are the streaming unit.
//
// Streamed per block: the four matrices attn.qkv, attn.proj, mlp.fc, mlp.proj. The model
// creates them with their initial values; layer_blocks() hands the blocks to the LibTorch
// layer (sp/torch_layer/streamed_model.h), which from then on keeps their fp32 masters and
// points these tensors at the weights each fetch delivered. Resident (small): token and
// position embeddings, the tied output head, every LayerNorm, and in LoRA mode the adapters of
// each streamed matrix.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "sp/torch_layer/streamed_model.h"
#include "train_config.h"

namespace sp::train {

inline constexpr std::size_t kStreamedPerBlock = 4;
inline constexpr std::array<const char*, kStreamedPerBlock> kStreamedNames = {"attn.qkv", "attn.proj", "mlp.fc",
                                                                              "mlp.proj"};
inline constexpr std::int64_t kVocab = 256;

using BlockWeights = std::array<torch::Tensor, kStreamedPerBlock>;

// A trainable resident tensor. `value` is the fp32 master that the CPU optimizer updates and
// `grad` its gradient buffer (same shape, zeroed every step), both on the host. `compute` is
// what the model reads and autograd differentiates: `value` itself when computing in fp32 on
// the CPU (its .grad is then `grad`, so the backward accumulates straight into the buffer the
// optimizer reads), else a copy on the compute device in the compute dtype, refreshed by
// refresh_compute(), whose gradient queue_resident_gradients_to_host() sends to `grad`.
struct ResidentParam {
  std::string name;
  torch::Tensor value;
  torch::Tensor grad;
  bool decay = false;
  torch::Tensor compute;
};

class GptModel {
 public:
  // `compute`: the device and dtype of the forward and backward math.
  GptModel(const ModelConfig& config, TrainMode mode, const LoraConfig& lora, std::uint64_t seed,
           const torch::TensorOptions& compute);

  const ModelConfig& config() const { return config_; }
  const torch::TensorOptions& compute_options() const { return compute_; }
  // Queues a copy of every resident master into its compute tensor (after an update or a
  // load); a no-op where they are the same tensor. On a GPU the copies leave from freshly
  // pinned buffers without blocking the host; the caching host allocator keeps each buffer
  // until its copy has run.
  void refresh_compute();
  // After a backward: queues each resident gradient from its compute tensor to the host buffer;
  // a no-op where they are the same tensor. The host buffers are complete once the compute
  // stream has run past this point (reading the loss waits for it). The compute gradients stay
  // (the LoRA adapters' are the blocks' gradient moments) until clear_gradients().
  void queue_resident_gradients_to_host();
  // Before a step: zeroes the host gradient buffers and drops the compute gradients.
  void clear_gradients();
  // The stress test of model.outliers, for a fresh run once its initial weights are in place:
  // in each listed block, the value rows of model.outliers.channels attention channels (one
  // in each of as many equal spans of the channels) are divided by the magnitude and the
  // attn.proj columns that read them multiplied by it. Attention is linear in the
  // values, so the block computes what it did (to rounding; LoRA adapters start at zero), but
  // every row of attn.proj now carries one large weight per span, which stretches the scale of
  // its INT8 or NF4 group over the others: the outlier channels trained LLMs develop.
  void plant_outlier_channels(std::uint64_t seed);
  // An fp32 host buffer of zeros shaped like `like`, for gradients that the backward sends
  // back from the compute device: pinned when that device is a GPU, so that the copy into it
  // is queued on the compute stream instead of blocking the host.
  torch::Tensor host_gradient_buffer(const torch::Tensor& like) const;
  TrainMode mode() const { return mode_; }
  // [block][tensor] the streamed weights the blocks' forward reads, rows = out features: the
  // initial fp32 values until layer_blocks() hands them over, then what the layer delivers.
  std::vector<BlockWeights>& streamed() { return streamed_; }
  std::vector<ResidentParam>& resident() { return resident_; }

  // The streaming units as the LibTorch layer takes them (model.streaming_unit): per
  // transformer block one unit "block<b>" with its four streamed matrices, or two,
  // "block<b>.attn" (qkv, proj) and "block<b>.mlp" (fc, proj). Each lists its streamed
  // matrices, then its resident norms and adapters under block-relative names ("ln1.weight",
  // "attn.qkv.lora_a"), and computes its part of block_forward(); in LoRA mode its adapters
  // are its gradient moments. The model must outlive the StreamedModel built on them.
  std::vector<sp::torch_layer::Block> layer_blocks();
  std::uint32_t num_units() const;
  std::string unit_name(std::uint32_t unit) const;
  // The unit that streams matrix `tensor` (an index into kStreamedNames) of block `block`.
  std::uint32_t unit_of(std::uint32_t block, std::size_t tensor) const;

  // Token + position embedding of idx [B, T]; differentiable in the embedding tables.
  torch::Tensor embed(const torch::Tensor& idx);
  // Mean next-byte cross-entropy of the final norm + tied head over h [B, T, C].
  torch::Tensor head_loss(const torch::Tensor& h, const torch::Tensor& targets);
  // One block on its streamed weights (and its resident norms and adapters): the attention
  // sublayer, then the MLP sublayer, each a residual step.
  torch::Tensor block_forward(std::uint32_t block, const torch::Tensor& x);
  torch::Tensor attention_sublayer(std::uint32_t block, const torch::Tensor& x);
  torch::Tensor mlp_sublayer(std::uint32_t block, const torch::Tensor& x);

  // The compute tensors of the parameters outside every block: embeddings and final norm (the
  // tied head is the token embedding).
  std::vector<torch::Tensor> outside_blocks() const;
  // In LoRA mode, the adapter indices of the block (the source of its gradient moments).
  const std::vector<std::size_t>& block_adapters(std::uint32_t block) const { return block_adapters_[block]; }

 private:
  std::size_t add_resident(std::string name, torch::Tensor value, bool decay);
  // A unit streaming the block's matrices `tensors`, with the block's resident tensors
  // `resident` (indices into resident_) and, in LoRA mode, the adapters of those matrices.
  sp::torch_layer::Block unit(std::string name, std::uint32_t block, std::vector<std::size_t> tensors,
                              std::vector<std::size_t> resident,
                              std::function<torch::Tensor(const torch::Tensor&)> forward);
  torch::Tensor linear(std::uint32_t block, std::size_t which, const torch::Tensor& x);

  ModelConfig config_;
  TrainMode mode_;
  torch::TensorOptions compute_;
  double lora_scale_ = 0.0;
  std::vector<BlockWeights> streamed_;
  std::vector<ResidentParam> resident_;
  // Resident tensors a block's forward reads, in a fixed order: its norms, then its LoRA
  // adapters (A, B per streamed matrix) in LoRA mode. Indices into resident_.
  std::vector<std::vector<std::size_t>> block_resident_;
  std::vector<std::vector<std::size_t>> block_adapters_;
  std::size_t wte_ = 0, wpe_ = 0, lnf_w_ = 0, lnf_b_ = 0;
  torch::Tensor causal_mask_;
};

}  // namespace sp::train
