#include "adamw.h"

#include <stdexcept>

#include <fmt/format.h>

namespace sp::train {

std::size_t AdamW::add(std::string name, float* weights, const float* grads, std::size_t n, bool decay) {
  if (n != 0 && (weights == nullptr || grads == nullptr)) {
    throw std::invalid_argument(fmt::format("AdamW: parameter '{}' has no weights or gradients", name));
  }
  params_.push_back(
      Param{std::move(name), weights, grads, n, decay, std::vector<float>(n, 0.0f), std::vector<float>(n, 0.0f)});
  return params_.size() - 1;
}

void AdamW::begin_step(double lr, double grad_scale) {
  ++steps_;
  step_ = sp::kernels::make_adamw_step(settings_, lr, steps_, grad_scale);
}

void AdamW::step_parameter(std::size_t index) {
  Param& p = params_.at(index);
  sp::kernels::adamw_update(step_, sp::kernels::AdamWTensor{p.weights, p.grads, p.exp_avg.data(), p.exp_avg_sq.data(),
                                                            sp::kernels::TensorShape{1, p.n}, p.decay});
}

}  // namespace sp::train
