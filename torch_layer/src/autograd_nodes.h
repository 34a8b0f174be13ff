// How autograd holds its nodes, across the torch minors the layer builds against: a
// std::shared_ptr up to torch 2.11 (the GPU machines' torch), a c10::intrusive_ptr in 2.15 (the
// pinned one). The layer names nodes through these three words only, so that one source builds
// against both (docs/integration.md, "Which torch").
#pragma once

#include <memory>
#include <type_traits>
#include <utility>

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>

namespace sp::torch_layer {

using NodePtr = decltype(torch::autograd::Edge::function);

namespace node_ptr_detail {
template <class Strong>
struct WeakOf;
template <class T>
struct WeakOf<std::shared_ptr<T>> {
  using type = std::weak_ptr<T>;
};
template <class T, class Null>
struct WeakOf<c10::intrusive_ptr<T, Null>> {
  using type = c10::weak_intrusive_ptr<T, Null>;
};
}  // namespace node_ptr_detail

// A node held without keeping it alive; expired() once autograd has let go of it.
using WeakNodePtr = typename node_ptr_detail::WeakOf<NodePtr>::type;

// A node of the layer's own type T, held as autograd holds nodes.
template <class T, class... Args>
NodePtr make_node(Args&&... args) {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>) {
    return std::make_shared<T>(std::forward<Args>(args)...);
  } else {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  }
}

}  // namespace sp::torch_layer
