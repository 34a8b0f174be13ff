// What a block's recompute reads that the layer was not told about: tensors that require a
// gradient, reached by the block's graph, and neither its input nor one of its parameters (a
// tensor kept as a plain attribute, or captured by a C++ closure). Plain autograd gives them a
// gradient; the layer's backward, which differentiates the recompute itself, must too.
#pragma once

#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>

namespace sp::torch_layer {

// How autograd holds its nodes: std::shared_ptr in torch 2.4, c10::intrusive_ptr in 2.15.
using NodePtr = decltype(torch::autograd::Edge::function);

struct UnlistedLeaf {
  at::Tensor tensor;
  // The node that accumulates its gradient, as autograd would (its hooks included).
  NodePtr accumulate;
};

// The leaves of `output`'s graph that require a gradient, other than those in `known`, each once.
std::vector<UnlistedLeaf> unlisted_leaves(const at::Tensor& output, const std::vector<at::Tensor>& known);

}  // namespace sp::torch_layer
