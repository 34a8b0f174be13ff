// AdamW over fp32 master weights on the CPU (decoupled weight decay, bias-corrected moments).
// The update is element-wise, vectorized by the compiler and split across threads with
// OpenMP; every element sees the same arithmetic whatever the thread count, so a resumed run
// reproduces the same weights bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace sp::train {

struct AdamWSettings {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.0;
};

class AdamW {
 public:
  explicit AdamW(AdamWSettings settings) : settings_(settings) {}

  // Registers a parameter: `weights` and `grads` (n floats each) are owned by the caller and
  // must outlive the optimizer. Biases and norms are registered without weight decay.
  // Returns the parameter's index, the handle for step_parameter().
  std::size_t add(std::string name, float* weights, const float* grads, std::size_t n, bool decay);

  // Starts an optimizer step (advances the bias-correction step count) at learning rate `lr`;
  // `grad_scale` multiplies every gradient (global-norm clipping).
  void begin_step(double lr, double grad_scale);
  // Updates one parameter in place. Called once per parameter per step, in any order, so
  // that the trainer can rebuild a block's transfer image as soon as its weights are done.
  void step_parameter(std::size_t index);

  std::int64_t steps_taken() const { return steps_; }
  std::size_t size() const { return params_.size(); }
  const std::string& name(std::size_t index) const { return params_.at(index).name; }

  // Checkpoint access: the moments of parameter `index` and the step count.
  std::vector<float>& exp_avg(std::size_t index) { return params_.at(index).exp_avg; }
  std::vector<float>& exp_avg_sq(std::size_t index) { return params_.at(index).exp_avg_sq; }
  void set_steps_taken(std::int64_t steps) { steps_ = steps; }

 private:
  struct Param {
    std::string name;
    float* weights;
    const float* grads;
    std::size_t n;
    bool decay;
    std::vector<float> exp_avg;
    std::vector<float> exp_avg_sq;
  };
  AdamWSettings settings_;
  std::vector<Param> params_;
  std::int64_t steps_ = 0;
  double lr_ = 0.0;
  double grad_scale_ = 1.0;
};

}  // namespace sp::train
