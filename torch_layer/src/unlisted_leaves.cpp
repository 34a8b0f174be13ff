#include "unlisted_leaves.h"

#include <unordered_set>

#include <torch/csrc/autograd/functions/accumulate_grad.h>

namespace sp::torch_layer {

std::vector<UnlistedLeaf> unlisted_leaves(const at::Tensor& output, const std::vector<at::Tensor>& known) {
  std::vector<UnlistedLeaf> found;
  if (!output.defined() || !output.grad_fn()) return found;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const at::Tensor& t : known) seen.insert(t.unsafeGetTensorImpl());
  std::unordered_set<const torch::autograd::Node*> visited;
  std::vector<NodePtr> pending{output.grad_fn()};
  while (!pending.empty()) {
    const NodePtr node = std::move(pending.back());
    pending.pop_back();
    if (!node || !visited.insert(node.get()).second) continue;
    if (const auto* accumulate = dynamic_cast<const torch::autograd::AccumulateGrad*>(node.get())) {
      if (seen.insert(accumulate->variable.unsafeGetTensorImpl()).second) {
        found.push_back({accumulate->variable, node});
      }
      continue;
    }
    for (const torch::autograd::Edge& edge : node->next_edges()) {
      if (edge.function) pending.push_back(edge.function);
    }
  }
  return found;
}

}  // namespace sp::torch_layer
