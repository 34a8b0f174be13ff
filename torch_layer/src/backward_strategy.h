// The backward strategy (issue 51; as torch.utils.checkpoint's two implementations): how a
// training pass's blocks are differentiated, chosen once at construction
// (StreamedModelOptions::recompute):
//   - recompute (recompute_backward.cpp): each block's forward runs without a graph, and its
//     backward fetches the block again, recomputes it and differentiates the recompute;
//   - kept activations (kept_backward.cpp): each block computes under autograd, whose saved
//     tensors read the weights' storage; the backward fetches the block again into it.
// The model opens and follows the passes (StreamedModel::Impl::train_forward, the pass table);
// a strategy runs each block's call in them and ends its backward through the table. What both
// share (the checks of a backward, the weights' gradients on their way to the masters) is the
// model's. Not installed: the layer's insides.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <torch/torch.h>

#include "sp/torch_layer/streamed_model.h"
#include "pass_table.h"

namespace sp::torch_layer {

class BackwardStrategy {
 public:
  virtual ~BackwardStrategy() = default;

  virtual bool recomputes() const = 0;
  // A new pass's state of this strategy, for `blocks` blocks.
  virtual void prepare(TrainingPass& pass, std::size_t blocks) const = 0;
  // Block b's grad-mode call in pass `id`, on the fetch the training engine serves now: its
  // outputs, and in `reaches` whether the pass's backward runs through the block (its inputs
  // need a gradient, or it trains something itself).
  virtual std::vector<torch::Tensor> forward(std::uint32_t b, std::uint64_t id,
                                             const std::vector<torch::Tensor>& inputs, bool& reaches) = 0;
  // The host's checkpointing recomputing block b of pass `id` inside its backward, before the
  // block's backward: it computes as the forward did, on the same fetch as the backward.
  virtual std::vector<torch::Tensor> recompute_for_checkpoint(std::uint32_t b, std::uint64_t id,
                                                              const std::vector<torch::Tensor>& inputs,
                                                              const BlockCall& call) = 0;
  // The pass is abandoned: what it holds of the engine (a block fetched for its backward) goes.
  virtual void let_go(TrainingPass& pass) = 0;
};

// Each holds `model`, which owns it and outlives it.
std::unique_ptr<BackwardStrategy> make_recompute_backward(StreamedModel::Impl& model);
std::unique_ptr<BackwardStrategy> make_kept_backward(StreamedModel::Impl& model);

}  // namespace sp::torch_layer
