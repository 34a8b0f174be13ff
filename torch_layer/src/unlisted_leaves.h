// What a block's recompute reads that the layer was not told about: tensors that require a
// gradient, reached by the block's graph, and neither its input nor one of its parameters (a
// tensor kept as a plain attribute, or captured by a C++ closure). Plain autograd gives them a
// gradient; the layer's backward, which differentiates the recompute itself, must too.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "autograd_nodes.h"

namespace sp::torch_layer {

struct UnlistedLeaf {
  at::Tensor tensor;
  // The node that adds a gradient to its .grad, as autograd's engine uses it.
  NodePtr accumulate;
};

// Where the recompute's own nodes start: those it creates on this thread from here on.
struct RecomputeMark {
  std::uint64_t first_sequence_nr;
  std::uint64_t thread_id;
  static RecomputeMark now();
};

struct UnlistedInputs {
  // Leaves reached through the recompute's own nodes only: differentiable where they are.
  std::vector<UnlistedLeaf> leaves;
  // A node of an earlier graph through which the recompute reaches a leaf it does not know (a
  // tensor computed outside the block, such as a scale derived from a parameter): its name, or
  // empty. Differentiating through it would run, and free, part of that other graph.
  std::string foreign_node;
};

// The leaves of the graph of `outputs` that require a gradient, other than those in `known`,
// each once.
UnlistedInputs unlisted_inputs(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& known,
                               const RecomputeMark& recompute);

}  // namespace sp::torch_layer
