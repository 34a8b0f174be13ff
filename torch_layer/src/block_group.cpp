// A streamed block as the layer holds it (block_group.h): its adoption, attach and detach, the
// checks of its parameters, its update's tensors, and the freshness of its images.
#include "block_group.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include <fmt/format.h>

namespace sp::torch_layer {

namespace {

const torch::Tensor* find(const NamedParameters& params, const std::string& name) {
  for (const auto& [key, value] : params) {
    if (key == name) return &value;
  }
  return nullptr;
}

}  // namespace

BlockGroup::BlockGroup(Block in, std::uint32_t index, const Adoption& adoption) {
  if (in.name.empty()) in.name = fmt::format("block{}", index);
  const std::string& name = in.name;
  if (!in.parameters) throw std::invalid_argument(fmt::format("StreamedModel: {} has no parameters callable", name));
  if (!in.forward && !in.call) {
    throw std::invalid_argument(fmt::format("StreamedModel: {} has neither a forward nor a call", name));
  }
  params_are_masters = static_cast<bool>(in.call);
  const NamedParameters params = in.parameters();
  for (const std::string& wanted : in.streamed) {
    if (std::count(in.streamed.begin(), in.streamed.end(), wanted) > 1) {
      throw std::invalid_argument(fmt::format("StreamedModel: {}: parameter '{}' is listed twice", name, wanted));
    }
    const torch::Tensor* found = find(params, wanted);
    if (!found) {
      std::string known;
      for (const auto& item : params) known += (known.empty() ? "" : ", ") + item.first;
      throw std::invalid_argument(
          fmt::format("StreamedModel: {} has no parameter '{}' (it has: {})", name, wanted, known));
    }
    if (!found->is_floating_point() || found->numel() == 0) {
      throw std::invalid_argument(
          fmt::format("StreamedModel: {}: parameter '{}' is {} with {} elements; a streamed parameter is a non-empty "
                      "floating-point tensor",
                      name, wanted, c10::toString(found->scalar_type()), found->numel()));
    }
    StreamedParameter p;
    p.name = wanted;
    p.block = index;
    p.param = *found;
    p.shape = found->sizes().vec();
    p.rows = found->dim() >= 2 ? static_cast<std::uint64_t>(found->size(0)) : 1;
    p.cols = static_cast<std::uint64_t>(found->numel()) / p.rows;
    torch::Tensor master;
    if (params_are_masters) {
      if (!found->device().is_cpu() || found->scalar_type() != torch::kFloat32 || !found->is_contiguous() ||
          !found->is_leaf()) {
        throw std::invalid_argument(fmt::format(
            "StreamedModel: {}: parameter '{}' is a {} tensor on {}; a block computing through Block::call keeps "
            "its streamed parameters as the fp32 masters: contiguous float32 leaf tensors on the CPU",
            name, wanted, c10::toString(found->scalar_type()), found->device().str()));
      }
      master = *found;
    } else {
      master = found->detach().to(torch::kCPU, torch::kFloat32, /*non_blocking=*/false, /*copy=*/true);
      if (adoption.device.is_cuda()) master = master.pin_memory();
      master.set_requires_grad(found->requires_grad());
    }
    trainable_masters = trainable_masters || found->requires_grad();
    if (adoption.stage_gradients && found->requires_grad()) p.staging = torch::empty_like(master).pin_memory();
    p.master = master;
    if (params_are_masters) {
      p.param = torch::empty({0}, adoption.compute);
      p.placeholder = master.options();  // what the module's parameter must stay
    } else {
      {
        torch::NoGradGuard no_grad;
        p.param.set_data(torch::empty({0}, adoption.compute));
      }
      // With the activations kept it takes a gradient only while a pass computes with it, as the
      // weights it stands for (KeptActivationsBackward's kept_weights()).
      if (!adoption.recomputes) p.param.set_requires_grad(false);
      p.placeholder = p.param.options();  // its device with an index, where `compute`'s may have none
    }
    masters.emplace(wanted, master);
    streamed.push_back(std::move(p));
  }
  for (const auto& [key, value] : params) {
    if (std::find(in.streamed.begin(), in.streamed.end(), key) != in.streamed.end()) continue;
    resident.push_back(value);
    resident_names_.push_back(key);
    resident_kinds_.push_back(value.options());
    if (value.requires_grad()) trainable_resident.push_back(value);
  }
  if (streamed.empty()) {
    throw std::invalid_argument(fmt::format("StreamedModel: {} streams no parameter; list at least one", name));
  }
  for (const std::string& wanted : in.moments_from) {
    const torch::Tensor* found = find(params, wanted);
    if (!found) {
      throw std::invalid_argument(
          fmt::format("StreamedModel: {}: moments_from names '{}', which is not one of its parameters", name, wanted));
    }
    const auto named = [&](const StreamedParameter& p) { return p.name == wanted; };
    const auto at_streamed = std::find_if(streamed.begin(), streamed.end(), named);
    moment_sources.push_back(at_streamed != streamed.end() ? at_streamed->master : *found);
  }
  set_autograd_inputs();
  for (const StreamedParameter& p : streamed) weights.emplace_back(p.name, p.param);
  if (params_are_masters) {
    call = in.call;
  } else {
    call = [forward = in.forward, name](const std::vector<torch::Tensor>& inputs, const NamedParameters&) {
      if (inputs.size() != 1) {
        throw std::invalid_argument(
            fmt::format("StreamedModel: {} takes one tensor (Block::forward), not {}; give the block a Block::call",
                        name, inputs.size()));
      }
      return std::vector<torch::Tensor>{forward(inputs[0])};
    };
  }
  block = std::move(in);
}

void BlockGroup::set_autograd_inputs() {
  autograd_inputs = trainable_resident;
  for (const StreamedParameter& p : streamed) {
    if (!p.master.requires_grad()) continue;
    autograd_inputs.push_back(p.master);
    break;
  }
}

void BlockGroup::attach(const adapters::BlockView& view, const torch::Device& device, torch::Dtype dtype,
                        bool trainable, bool frozen_gradients) {
  torch::NoGradGuard no_grad;
  for (std::size_t i = 0; i < streamed.size(); ++i) {
    StreamedParameter& p = streamed[i];
    torch::Tensor w =
        torch::from_blob(view.tensors[i].bf16, p.shape, torch::TensorOptions().dtype(torch::kBFloat16).device(device));
    if (dtype != torch::kBFloat16) w = w.to(dtype);
    p.param.set_data(w);
    // A placeholder that stands for the weights of a pass that keeps its activations is not a leaf.
    if (p.param.is_leaf()) p.param.set_requires_grad(trainable && (p.master.requires_grad() || frozen_gradients));
  }
}

void BlockGroup::detach(const torch::TensorOptions& compute) {
  torch::NoGradGuard no_grad;
  for (StreamedParameter& p : streamed) p.param.set_data(torch::empty({0}, compute));
}

void BlockGroup::set_compute_dtype(const torch::TensorOptions& compute) {
  const torch::Dtype dtype = c10::typeMetaToScalarType(compute.dtype());
  for (torch::TensorOptions& kind : resident_kinds_) {
    if (c10::isFloatingType(c10::typeMetaToScalarType(kind.dtype()))) kind = kind.dtype(dtype);
  }
  detach(compute);
  if (params_are_masters) return;
  for (StreamedParameter& p : streamed) p.placeholder = p.param.options();
}

void BlockGroup::check_parameters_unchanged(bool owned) const {
  const NamedParameters params = block.parameters();
  for (const StreamedParameter& p : streamed) {
    const torch::Tensor* now = find(params, p.name);
    const torch::Tensor& held = p.held(params_are_masters);
    if (!now || now->unsafeGetTensorImpl() != held.unsafeGetTensorImpl()) {
      throw std::logic_error(fmt::format(
          "StreamedModel: {}: parameter '{}' was replaced or removed after the model was wrapped; the layer "
          "owns streamed parameters ({})",
          block.name, p.name,
          params_are_masters ? "they are its masters: change them in place"
                             : "change the masters instead, then call refresh_images()"));
    }
    refuse_converted(p.name, held, p.placeholder);
    if (owned && !p.reads_engine_storage()) {
      throw std::logic_error(fmt::format(
          "StreamedModel: {}: master '{}' no longer holds the storage the layer streams from (set_data(), or "
          "`.data = ` in Python, swapped it), so the engines would read the old one. Change a master in place: "
          "under no_grad, master.copy_(new_value)",
          block.name, p.name));
    }
  }
  for (std::size_t i = 0; i < resident.size(); ++i)
    refuse_converted(resident_names_[i], resident[i], resident_kinds_[i]);
}

void BlockGroup::refuse_converted(const std::string& name, const torch::Tensor& now,
                                  const torch::TensorOptions& wrapped) const {
  if (now.scalar_type() == c10::typeMetaToScalarType(wrapped.dtype()) && now.device() == wrapped.device()) return;
  throw std::logic_error(fmt::format(
      "StreamedModel: {}: parameter '{}' is now {} on {}, and was {} on {} when the blocks were wrapped (a .to() "
      "after wrapping?). The layer keeps the blocks' parameters where they were: move and cast the model before "
      "wrapping it (StreamedModelOptions::device and compute_dtype say where and in what the streamed weights "
      "compute)",
      block.name, name, c10::toString(now.scalar_type()), now.device().str(),
      c10::toString(c10::typeMetaToScalarType(wrapped.dtype())), wrapped.device().str()));
}

void BlockGroup::forget_masters() {
  for (StreamedParameter& p : streamed) {
    if (params_are_masters) {
      // The module's parameter is the master: emptied in place, so that it stays the module's.
      torch::NoGradGuard no_grad;
      p.master.set_data(torch::empty({0}, torch::kFloat32));
      continue;
    }
    torch::Tensor placeholder = torch::empty({0}, torch::kFloat32);
    placeholder.set_requires_grad(p.master.requires_grad());
    p.master = placeholder;
  }
  masters.clear();
  // The owner computes the block's moments; an anchor keeps the block's backward running.
  moment_sources.clear();
  set_autograd_inputs();
  mark_evaluation_image_stale();
}

void BlockGroup::append_trainable_versions(std::vector<std::int64_t>& versions) const {
  for (const StreamedParameter& p : streamed) {
    if (p.master.requires_grad()) versions.push_back(p.master._version());
  }
  for (const torch::Tensor& r : trainable_resident) versions.push_back(r._version());
}

std::vector<kernels::AdamWTensor> BlockGroup::fused_update_tensors(
    const std::map<std::string, MasterMoments>& moments) const {
  std::vector<kernels::AdamWTensor> tensors;
  for (const StreamedParameter& p : streamed) {
    const auto problem = [&](const std::string& what) {
      return std::invalid_argument(fmt::format("StreamedModel::update_masters: {}.{} {}", block.name, p.name, what));
    };
    const torch::Tensor& grad = p.master.grad();
    if (!grad.defined() || grad.scalar_type() != torch::kFloat32 || !grad.is_contiguous() ||
        grad.numel() != p.master.numel() || !grad.device().is_cpu()) {
      throw problem("has no fp32 contiguous host gradient in .grad of the master's size");
    }
    const MasterMoments* found = moments_of(moments, p.name);
    if (found == nullptr) throw problem("has no AdamW moments (exp_avg and exp_avg_sq) in the map given");
    const MasterMoments& moment = *found;
    tensors.push_back(kernels::AdamWTensor{p.master.data_ptr<float>(), grad.data_ptr<float>(), moment.exp_avg,
                                           moment.exp_avg_sq, kernels::TensorShape{p.rows, p.cols}, moment.decay,
                                           moment.dtype, moment.rounding, moment.seed});
  }
  return tensors;
}

bool BlockGroup::gradients_finite() const {
  for (const StreamedParameter& p : streamed) {
    const torch::Tensor& grad = p.master.grad();
    if (!grad.defined() || grad.scalar_type() != torch::kFloat32 || !grad.is_contiguous()) continue;
    const float* g = grad.data_ptr<float>();
    const std::int64_t n = grad.numel();
    bool finite = true;
    for (std::int64_t i = 0; i < n; ++i) finite &= std::isfinite(g[i]);
    if (!finite) return false;
  }
  return true;
}

adapters::Event& BlockGroup::gradient_copied(adapters::TransferBackend& backend) {
  if (!gradient_copied_) gradient_copied_ = backend.create_event();
  return *gradient_copied_;
}

void BlockGroup::note_image_versions(bool owned) {
  for (StreamedParameter& p : streamed) {
    p.image_version_ = owned ? std::optional<std::int64_t>(p.master._version()) : std::nullopt;
  }
}

const StreamedParameter* BlockGroup::changed_master() const {
  for (const StreamedParameter& p : streamed) {
    if (p.changed_since_images()) return &p;
  }
  return nullptr;
}

void BlockGroup::images_rebuilt() {
  for (StreamedParameter& p : streamed) {
    if (p.image_version_) p.image_version_ = p.master._version();
  }
  mark_evaluation_image_stale();
}

void BlockGroup::mark_updated(bool image_written) {
  if (image_written) mark_evaluation_image_stale();
  updated_in_step_ = true;
}

void BlockGroup::mark_shared(Precision route) {
  shared_route_ = route;
  mark_evaluation_image_stale();
}

}  // namespace sp::torch_layer
