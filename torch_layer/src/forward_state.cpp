#include "forward_state.h"

#include <mutex>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/autocast_mode.h>

namespace sp::torch_layer {
namespace {

at::Generator generator_of(const c10::Device& device) {
  return device.is_cpu() ? at::detail::getDefaultCPUGenerator() : at::globalContext().defaultGenerator(device);
}

at::Tensor state_of(const c10::Device& device) {
  at::Generator generator = generator_of(device);
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

void set_state(const c10::Device& device, const at::Tensor& state) {
  at::Generator generator = generator_of(device);
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

}  // namespace

ForwardState::Autocast ForwardState::autocast_of(c10::DeviceType type) {
  return Autocast{at::autocast::is_autocast_enabled(type), at::autocast::get_autocast_dtype(type)};
}

ForwardState ForwardState::capture(const c10::Device& device) {
  ForwardState s;
  s.device_ = device;
  s.cpu_rng_ = state_of(c10::kCPU);
  if (!device.is_cpu()) s.device_rng_ = state_of(device);
  s.cpu_autocast_ = autocast_of(c10::DeviceType::CPU);
  if (!device.is_cpu()) s.device_autocast_ = autocast_of(device.type());
  s.autocast_cache_ = at::autocast::is_autocast_cache_enabled();
  return s;
}

void ForwardState::apply() const {
  set_state(c10::kCPU, cpu_rng_);
  if (device_rng_) set_state(device_, *device_rng_);
  at::autocast::set_autocast_enabled(c10::DeviceType::CPU, cpu_autocast_.enabled);
  at::autocast::set_autocast_dtype(c10::DeviceType::CPU, cpu_autocast_.dtype);
  if (!device_.is_cpu()) {
    at::autocast::set_autocast_enabled(device_.type(), device_autocast_.enabled);
    at::autocast::set_autocast_dtype(device_.type(), device_autocast_.dtype);
  }
  at::autocast::set_autocast_cache_enabled(autocast_cache_);
}

// Nested as torch.autocast is: leaving the outermost autocast region drops the casts it cached.
ReplayedForward::ReplayedForward(const ForwardState& forward) : caller_(ForwardState::capture(forward.device_)) {
  forward.apply();
  at::autocast::increment_nesting();
}

ReplayedForward::~ReplayedForward() {
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  caller_.apply();
}

}  // namespace sp::torch_layer
