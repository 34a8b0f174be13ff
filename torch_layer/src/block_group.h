// A streamed block as the layer holds it (issue 51; FSDP2's FSDPParam and FSDPParamGroup):
// - StreamedParameter: one streamed weight, its fp32 host master, the tensor the block computes
//   with and what carries its gradient;
// - BlockGroup: one block's StreamedParameters and resident tensors, how it computes, attach and
//   detach around each of its calls, and whether its transfer images are fresh.
// The images themselves are the engines'; a BlockGroup keeps what says when they must be built
// again, written here only (the layer's files ask through its methods). Not installed.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "sp/adapters/streaming_engine.h"
#include "sp/kernels/adamw.h"
#include "sp/torch_layer/streamed_model.h"
#include "autograd_nodes.h"

namespace sp::torch_layer {

// One streamed parameter: the tensor its block computes with (the module's own Parameter, or
// for a Block::call block the layer's own), pointed at delivered weights while the block
// computes and at an empty tensor otherwise, and its fp32 host master.
struct StreamedParameter {
  std::string name;
  std::uint32_t block = 0;
  torch::Tensor param;
  torch::Tensor master;   // sharded, on a rank that does not own the block: an empty placeholder
  torch::Tensor staging;  // CUDA: pinned fp32, the gradient's way to the host without a sync
  bool staged = false;    // staging holds this pass's gradient
  // A frozen master's gradient, taken in the backward for policy v3's signal table alone
  // (PolicyLink::frozen_gradients_wanted()), summed over the step's passes; never the master's .grad.
  torch::Tensor signal_grad;
  std::vector<std::int64_t> shape;
  std::uint64_t rows = 0, cols = 0;
  torch::TensorOptions placeholder;  // the empty tensor's dtype and device between uses
  // Activations kept (StreamedModelOptions::recompute false): the storage every tensor of this
  // weight that a pass computes with shares, so that autograd's saved tensors (the weight, or
  // views of it) read whatever the storage holds when the backward reaches them: the delivered
  // weights while the block is fetched, no memory otherwise (a read then fails, "data is not
  // allocated", instead of reading a slot another block reuses), as FSDP2 frees and refills
  // its unsharded parameters.
  c10::Storage kept;
  // The trainable master's gradient accumulator, held so that a backward with inputs= naming the
  // master finds it (else autograd stands an Identity in for it) and can be refused by name.
  NodePtr accumulator;

  // The tensor the module holds for this weight: the master itself (Block::call), else `param`.
  const torch::Tensor& held(bool params_are_masters) const { return params_are_masters ? master : param; }
  // Whether the master's storage is still the one the engines read (build_engines()): set_data()
  // or `.data = ` swaps it.
  bool reads_engine_storage() const { return master.data_ptr() == engine_data_; }
  void note_engine_storage() { engine_data_ = master.data_ptr(); }

  // The master changed in place since the images were built from it (its version counter moved).
  bool changed_since_images() const { return image_version_ && master._version() != *image_version_; }

 private:
  friend class BlockGroup;
  const void* engine_data_ = nullptr;
  // The master's version counter when the images were last built from it; none on a rank that
  // does not own the block (its images come from the owner).
  std::optional<std::int64_t> image_version_;
};

class BlockGroup {
 public:
  // What adopting a block needs to know of the layer.
  struct Adoption {
    torch::Device device;          // where the blocks compute
    torch::TensorOptions compute;  // the streamed weights' dtype and device there
    bool recomputes = true;        // the backward strategy: recompute, or kept activations
    // Trainable masters get a pinned staging buffer (CUDA, gradients reduced on the host).
    bool stage_gradients = false;
  };

  // Takes the block's streamed parameters from its module: each gets its fp32 host master (the
  // parameter itself with Block::call), and the module's tensor is emptied until a call attaches
  // weights. Throws std::invalid_argument naming the block and parameter for a block the layer
  // cannot stream.
  BlockGroup(Block in, std::uint32_t index, const Adoption& adoption);

  Block block;
  std::vector<StreamedParameter> streamed;
  std::map<std::string, torch::Tensor> masters;
  std::vector<torch::Tensor> resident;
  std::vector<torch::Tensor> trainable_resident;  // resident parameters that require grad
  std::vector<torch::Tensor> moment_sources;      // Block::moments_from; empty: the default rule
  // What the block's autograd node takes as inputs besides x: its trainable resident
  // parameters, and one trainable master, so that a block whose only trainable weights stream
  // still gets a backward when its input needs no gradient.
  std::vector<torch::Tensor> autograd_inputs;
  bool trainable_masters = false;
  // How it computes: Block::call, or Block::forward adapted to one. With Block::call the
  // module's streamed parameters are the masters, and `weights` the tensors the delivered
  // weights are put in.
  BlockCall call;
  bool params_are_masters = false;
  NamedParameters weights;

  // ---- around a call: attach and detach --------------------------------------------------
  // The delivered weights of `view` (bf16) become the streamed parameters, in `dtype` on
  // `device`; each takes a gradient when `trainable` and its master trains or `frozen_gradients`
  // (a frozen master's gradient wanted for the signal table).
  void attach(const adapters::BlockView& view, const torch::Device& device, torch::Dtype dtype, bool trainable,
              bool frozen_gradients);
  // The streamed parameters hold empty tensors of `compute` again.
  void detach(const torch::TensorOptions& compute);

  // The compute dtype changed (StreamedModel::set_compute_dtype): what the module's tensors
  // must stay becomes it.
  void set_compute_dtype(const torch::TensorOptions& compute);

  // A parameter the host replaced under the layer (module->weight = new tensor), a master whose
  // storage it swapped (set_data(), on the rank that `owned` it), or a .to() of the model after
  // wrapping, would be computed with stale values and trained without the layer knowing:
  // refused by name (std::logic_error).
  void check_parameters_unchanged(bool owned) const;

  // Sharded, on a rank that does not own the block: its masters become empty placeholders (a
  // Block::call block's are emptied in place, staying the module's), and its moments come from
  // the owner.
  void forget_masters();

  // The version counters of the block's trainable masters and resident parameters, appended.
  void append_trainable_versions(std::vector<std::int64_t>& versions) const;

  // ---- the update --------------------------------------------------------------------------
  // The trainable masters as the fused update takes them, each with its gradient and `moments`
  // entry. Throws std::invalid_argument naming the parameter that has no fp32 host gradient of
  // its size, or no moments.
  std::vector<kernels::AdamWTensor> fused_update_tensors(const std::map<std::string, MasterMoments>& moments) const;
  // Whether every element of the masters' gradients is finite (an absent gradient counts as
  // finite: fused_update_tensors() refuses it by name).
  bool gradients_finite() const;

  // The armed update (update_masters_during_backward()) waits for the pass's end, its gradient
  // reaching the host only then.
  void defer_update() { deferred_update_ = true; }
  bool update_deferred() const { return deferred_update_; }
  // Whether it was deferred; it no longer is.
  bool take_deferred_update() { return std::exchange(deferred_update_, false); }
  void cancel_deferred_update() { deferred_update_ = false; }
  // CUDA: the event that says the block's staged gradient is on the host, made once.
  adapters::Event& gradient_copied(adapters::TransferBackend& backend);
  // Before the backend goes.
  void drop_events() { gradient_copied_.reset(); }

  // ---- whether its images are fresh ---------------------------------------------------------
  // The images were built from the masters as they are now (`owned`: this rank builds them).
  void note_image_versions(bool owned);
  // The first master changed in place since its images were built, or null.
  const StreamedParameter* changed_master() const;
  // The training engine rebuilt its images from the masters as they are now.
  void images_rebuilt();

  // The evaluation engine's image no longer matches the masters or the route in force.
  void mark_evaluation_image_stale() { evaluation_image_stale_ = true; }
  bool evaluation_image_stale() const { return evaluation_image_stale_; }
  void mark_evaluation_image_fresh() { evaluation_image_stale_ = false; }

  // The block's update ran this step: update_masters() or the update during the backward, which
  // wrote the training image when `image_written` (else a non-finite gradient skipped it).
  void mark_updated(bool image_written);
  bool updated_in_step() const { return updated_in_step_; }
  // Whether it was updated this step; from now on it counts as not.
  bool take_updated_in_step() { return std::exchange(updated_in_step_, false); }
  void begin_step() { updated_in_step_ = false; }

  // Sharded: whether the ranks last shared its image on `route`; now they did.
  bool shared_on(Precision route) const { return shared_route_ == route; }
  void mark_shared(Precision route);

 private:
  void set_autograd_inputs();
  // `now`, the module's tensor named `name`, is no longer of the dtype and device it was wrapped
  // in: refused (a .to() after wrapping).
  void refuse_converted(const std::string& name, const torch::Tensor& now, const torch::TensorOptions& wrapped) const;

  std::vector<std::string> resident_names_;           // of `resident`, for messages
  std::vector<torch::TensorOptions> resident_kinds_;  // their dtype and device when wrapped
  Precision shared_route_ = Precision::bf16;          // every engine starts on BF16
  bool evaluation_image_stale_ = false;
  bool updated_in_step_ = false;
  bool deferred_update_ = false;
  std::unique_ptr<adapters::Event> gradient_copied_;
};

// The moments of master `name`, or null when `moments` lacks them or either buffer.
inline const MasterMoments* moments_of(const std::map<std::string, MasterMoments>& moments, const std::string& name) {
  const auto found = moments.find(name);
  if (found == moments.end() || found->second.exp_avg == nullptr || found->second.exp_avg_sq == nullptr) return nullptr;
  return &found->second;
}

inline std::string master_key(const BlockGroup& b, const StreamedParameter& p) {
  return "master/" + b.block.name + "." + p.name;
}

}  // namespace sp::torch_layer
