// What the layer's autograd nodes hold of their model: a weak reference, so that a graph that
// outlives its model (destroyed while a loss was kept) finds it gone instead of reading freed
// memory, and a backward keeps its model alive until it returns. Not installed.
#pragma once

#include "streamed_model_impl.h"

namespace sp::torch_layer {

struct ModelRef : torch::CustomClassHolder {
  explicit ModelRef(std::weak_ptr<StreamedModel::Impl> held) : model(std::move(held)) {}
  std::weak_ptr<StreamedModel::Impl> model;
};

inline c10::IValue model_ref(const StreamedModel::Impl& impl) {
  return c10::IValue::make_capsule(c10::make_intrusive<ModelRef>(impl.self));
}

inline std::shared_ptr<StreamedModel::Impl> live_model_for_backward(const std::weak_ptr<StreamedModel::Impl>& model,
                                                                    std::uint32_t block) {
  std::shared_ptr<StreamedModel::Impl> impl = model.lock();
  if (!impl) {
    throw std::logic_error(
        fmt::format("StreamedModel: backward through block {} of a model that was destroyed or closed", block));
  }
  return impl;
}

inline std::shared_ptr<StreamedModel::Impl> live_model_for_backward(const c10::IValue& ref, std::uint32_t block) {
  return live_model_for_backward(c10::static_intrusive_pointer_cast<ModelRef>(ref.toCapsule())->model, block);
}

}  // namespace sp::torch_layer
