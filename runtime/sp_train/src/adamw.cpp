#include "adamw.h"

#include <stdexcept>

#include <fmt/format.h>

namespace sp::train {

std::size_t AdamW::add(std::string name, float* weights, const float* grads, std::size_t n, bool decay) {
  if (n != 0 && (weights == nullptr || grads == nullptr)) {
    throw std::invalid_argument(fmt::format("AdamW: parameter '{}' has no weights or gradients", name));
  }
  // Zero bytes are a zero moment in both storages.
  const std::size_t bytes = n * sp::kernels::dtype_size(moments_.dtype);
  params_.push_back(Param{std::move(name), weights, grads, n, decay, std::vector<std::uint8_t>(bytes, 0),
                          std::vector<std::uint8_t>(bytes, 0)});
  return params_.size() - 1;
}

void AdamW::begin_step(double lr, double grad_scale) {
  ++steps_;
  step_ = sp::kernels::make_adamw_step(settings_, lr, steps_, grad_scale);
}

sp::kernels::AdamWTensor AdamW::tensor(std::size_t index) {
  Param& p = params_.at(index);
  sp::kernels::AdamWTensor t{p.weights, p.grads, p.exp_avg.data(), p.exp_avg_sq.data(), sp::kernels::TensorShape{1, p.n},
                             p.decay};
  t.moment_dtype = moments_.dtype;
  t.moment_rounding = moments_.rounding;
  t.moment_seed = index;  // each parameter its own stream
  return t;
}

void AdamW::step_parameter(std::size_t index) { sp::kernels::adamw_update(step_, tensor(index)); }

}  // namespace sp::train
