#include "adamw.h"

#include <cmath>
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
  lr_ = lr;
  grad_scale_ = grad_scale;
}

void AdamW::step_parameter(std::size_t index) {
  Param& p = params_.at(index);
  const auto b1 = static_cast<float>(settings_.beta1);
  const auto b2 = static_cast<float>(settings_.beta2);
  const auto eps = static_cast<float>(settings_.eps);
  const auto scale = static_cast<float>(grad_scale_);
  const auto step_size = static_cast<float>(lr_ / (1.0 - std::pow(settings_.beta1, static_cast<double>(steps_))));
  const auto inv_bias2 =
      static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(settings_.beta2, static_cast<double>(steps_))));
  const float decay = p.decay ? static_cast<float>(1.0 - lr_ * settings_.weight_decay) : 1.0f;
  float* __restrict w = p.weights;
  const float* __restrict g = p.grads;
  float* __restrict m = p.exp_avg.data();
  float* __restrict v = p.exp_avg_sq.data();
  const auto n = static_cast<std::int64_t>(p.n);
  // Small tensors (norms, biases) are not worth waking the thread team for.
#pragma omp parallel for simd schedule(static) if (n >= 65536)
  for (std::int64_t i = 0; i < n; ++i) {
    const float grad = g[i] * scale;
    m[i] = b1 * m[i] + (1.0f - b1) * grad;
    v[i] = b2 * v[i] + (1.0f - b2) * grad * grad;
    w[i] = w[i] * decay - step_size * m[i] / (std::sqrt(v[i]) * inv_bias2 + eps);
  }
}

}  // namespace sp::train
