// What a streamed block's recompute in the backward must share with its forward, so that the
// two compute the same function: what torch.utils.checkpoint(preserve_rng_state=True) keeps.
//   - the random number generators: the CPU's default generator, and the compute device's
//     when it is not the CPU (dropout draws from them);
//   - autocast, for the CPU and for the compute device's type: enabled, and its dtype (a block
//     that computed in bf16 under torch.autocast recomputes in bf16, not fp32);
//   - autocast's cast cache flag.
// Grad mode needs no keeping: only a grad-mode forward leaves a backward to recompute, and the
// recompute runs with grad enabled.
#pragma once

#include <optional>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

namespace sp::torch_layer {

class ForwardState {
 public:
  // The state in force now, on this thread, for blocks computing on `device`.
  static ForwardState capture(const c10::Device& device);

 private:
  friend class ReplayedForward;
  struct Autocast {
    bool enabled = false;
    at::ScalarType dtype = at::kBFloat16;
  };
  static Autocast autocast_of(c10::DeviceType type);
  void apply() const;

  c10::Device device_ = c10::kCPU;
  at::Tensor cpu_rng_;
  std::optional<at::Tensor> device_rng_;
  Autocast cpu_autocast_, device_autocast_;
  bool autocast_cache_ = true;
};

// Puts a captured forward state in force on this thread for its lifetime, then the one it
// found (the caller's random streams go on as if the recompute had not drawn from them).
class ReplayedForward {
 public:
  explicit ReplayedForward(const ForwardState& forward);
  ~ReplayedForward();
  ReplayedForward(const ReplayedForward&) = delete;
  ReplayedForward& operator=(const ReplayedForward&) = delete;

 private:
  ForwardState caller_;
};

}  // namespace sp::torch_layer
