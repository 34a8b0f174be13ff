// AdamW over fp32 weights on the CPU (decoupled weight decay, bias-corrected moments in fp32 or
// bf16): the
// trainer's bookkeeping (parameters, moments, step count, checkpoint access) around the
// kernels' element update (sp/kernels/adamw.h), whose arithmetic does not depend on the thread
// count, so a resumed run reproduces the same weights bit for bit. In full mode the streamed
// masters' update can instead run fused with their image rebuild (StreamedModel::update_masters)
// on these same moments.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "sp/kernels/adamw.h"

namespace sp::train {

// How the two moments are stored: fp32, or bf16 rounded to nearest even or stochastically.
struct MomentStorage {
  sp::kernels::DType dtype = sp::kernels::DType::kFloat32;  // kFloat32 or kBFloat16
  sp::kernels::Rounding rounding = sp::kernels::Rounding::kNearestEven;
};

class AdamW {
 public:
  explicit AdamW(sp::kernels::AdamWHyperparameters settings, MomentStorage moments = {})
      : settings_(settings), moments_(moments) {}

  // Registers a parameter: `weights` and `grads` (n floats each) are owned by the caller and
  // must outlive the optimizer. Biases and norms are registered without weight decay.
  // Returns the parameter's index, the handle for step_parameter().
  std::size_t add(std::string name, float* weights, const float* grads, std::size_t n, bool decay);

  // Starts an optimizer step (advances the bias-correction step count) at learning rate `lr`;
  // `grad_scale` multiplies every gradient (global-norm clipping).
  void begin_step(double lr, double grad_scale);
  // The constants of the step begun last, for a fused update of registered parameters.
  const sp::kernels::AdamWStep& step_constants() const { return step_; }
  // Updates one parameter in place. Called at most once per parameter per step, in any order.
  void step_parameter(std::size_t index);

  std::int64_t steps_taken() const { return steps_; }
  std::size_t size() const { return params_.size(); }
  const std::string& name(std::size_t index) const { return params_.at(index).name; }
  bool decay(std::size_t index) const { return params_.at(index).decay; }

  // Parameter `index` as the kernels take it: weights, gradient, moments and their storage.
  sp::kernels::AdamWTensor tensor(std::size_t index);
  // The raw bytes of parameter `index`'s moments (checkpoints): fp32 or bf16 elements.
  std::vector<std::uint8_t>& exp_avg_bytes(std::size_t index) { return params_.at(index).exp_avg; }
  std::vector<std::uint8_t>& exp_avg_sq_bytes(std::size_t index) { return params_.at(index).exp_avg_sq; }
  void set_steps_taken(std::int64_t steps) { steps_ = steps; }

 private:
  struct Param {
    std::string name;
    float* weights;
    const float* grads;
    std::size_t n;
    bool decay;
    std::vector<std::uint8_t> exp_avg;
    std::vector<std::uint8_t> exp_avg_sq;
  };
  sp::kernels::AdamWHyperparameters settings_;
  MomentStorage moments_;
  std::vector<Param> params_;
  std::int64_t steps_ = 0;
  sp::kernels::AdamWStep step_;
};

}  // namespace sp::train
