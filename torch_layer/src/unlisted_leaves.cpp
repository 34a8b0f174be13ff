#include "unlisted_leaves.h"

#include <unordered_set>
#include <utility>

#include <ATen/SequenceNumber.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

namespace sp::torch_layer {

RecomputeMark RecomputeMark::now() {
  return RecomputeMark{at::sequence_number::peek(), at::RecordFunction::currentThreadId()};
}

UnlistedInputs unlisted_inputs(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& known,
                               const RecomputeMark& recompute) {
  UnlistedInputs found;
  std::unordered_set<const c10::TensorImpl*> listed, taken;
  for (const at::Tensor& t : known) listed.insert(t.unsafeGetTensorImpl());
  // A node is walked once from the recompute's side and once from a foreign node's side at most.
  std::unordered_set<const torch::autograd::Node*> visited[2];
  std::vector<std::pair<NodePtr, const torch::autograd::Node*>> pending;
  for (const at::Tensor& output : outputs) {
    if (output.defined() && output.grad_fn()) pending.emplace_back(output.grad_fn(), nullptr);
  }
  while (!pending.empty()) {
    auto [node, foreign] = std::move(pending.back());
    pending.pop_back();
    if (!node || !visited[foreign != nullptr].insert(node.get()).second) continue;
    if (const auto* accumulate = dynamic_cast<const torch::autograd::AccumulateGrad*>(node.get())) {
      const at::Tensor& leaf = accumulate->variable;
      if (!leaf.defined() || listed.count(leaf.unsafeGetTensorImpl())) continue;
      if (foreign) {
        if (found.foreign_node.empty()) found.foreign_node = foreign->name();
        continue;
      }
      if (taken.insert(leaf.unsafeGetTensorImpl()).second) found.leaves.push_back({leaf, node});
      continue;
    }
    const bool ours = node->thread_id() == recompute.thread_id && node->sequence_nr() >= recompute.first_sequence_nr;
    const torch::autograd::Node* through = foreign ? foreign : ours ? nullptr : node.get();
    for (const torch::autograd::Edge& edge : node->next_edges()) {
      if (edge.function) pending.emplace_back(edge.function, through);
    }
  }
  return found;
}

}  // namespace sp::torch_layer
