// The gradient reducer (issue 51; as FSDP2's foreach_reduce with its state): the streamed
// masters' gradients of a training pass on their way to .grad (staged through pinned host
// memory, or reduced across ranks in one bucket per block, on the compute device where the
// group reduces there), the resident parameters' and the host's gradients averaged across
// ranks, and the gradients of the pass's unlisted inputs, summed over its blocks.
// Not installed: the layer's insides (streamed_model_impl.h holds one; gradient_reduction.cpp
// defines it).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <spdlog/logger.h>
#include <torch/torch.h>

#include "sp/torch_layer/collectives.h"
#include "unlisted_leaves.h"

namespace sp::torch_layer {

struct StreamedParameter;

class GradientReducer {
 public:
  // A block's master gradients of the current pass, flattened into one bucket, on their way
  // through a reduction started in the backward; folded into the masters at the pass's end.
  struct Bucket {
    std::vector<StreamedParameter*> params;
    torch::Tensor bucket;
    std::unique_ptr<Collectives::Pending> pending;
  };

  // `collectives` null: one process. `keeps(block)`: whether this rank keeps the block's
  // masters (sharded, their owner only).
  void connect(std::shared_ptr<Collectives> collectives, std::function<bool(std::uint32_t)> keeps) {
    collectives_ = std::move(collectives);
    keeps_ = std::move(keeps);
  }
  // The layer's collectives run on host tensors, so the group must take those. The masters'
  // gradients are born on the compute device: where every rank's group reduces tensors there
  // without the host (NCCL), each block's is reduced there in the backward, and only the result
  // crosses to the host (sharded, to its owner only). The ranks agree on a CPU tensor before
  // any device tensor is reduced, so that none waits on a device collective another rank never
  // starts. Throws std::invalid_argument, naming the option, for a group that refuses host
  // tensors.
  void probe(const torch::Device& compute, spdlog::logger& log);
  // Where a block's gradient bucket is reduced: the compute device, or the host.
  torch::Device reduction_device(const torch::Device& compute) const {
    return device_reductions_ ? compute : torch::Device(torch::kCPU);
  }
  bool reduces_on_device() const { return device_reductions_; }

  // ---- a pass's master gradients -------------------------------------------------------------

  // The master's gradient, accumulated across passes. On a GPU it travels to pinned staging
  // without a host sync; end_of_pass folds it in after one synchronization.
  void stage(StreamedParameter& p, const torch::Tensor& g);
  bool any_staged() const { return staged_; }
  // The staged gradients, now on the host (the caller synchronized), into their masters'
  // .grad; with ranks, reduced in one bucket first.
  void fold_staged(std::vector<StreamedParameter*> staged);
  // The first contribution is copied: it is a view (of the backward's result, reshaped) or the
  // staging buffer the next pass reuses, and a .grad must own its storage (zero_grad() detaches
  // it in place).
  static void add_to_master_grad(StreamedParameter& p, const torch::Tensor& g);

  void add_pending(Bucket bucket) { reducing_.push_back(std::move(bucket)); }
  // The reductions the backward started, waited for.
  void wait_pending() {
    for (Bucket& r : reducing_) r.pending->wait();
  }
  // Their sums, averaged, into the masters this rank keeps.
  void fold_pending() {
    for (Bucket& r : reducing_) fold_averaged(r.params, r.bucket);
    reducing_.clear();
  }
  // A bucket of summed gradients, one slice per parameter in order, divided by the ranks. A
  // bucket reduced on the device crosses to the host here, and only to a rank that keeps one of
  // its parameters.
  void fold_averaged(const std::vector<StreamedParameter*>& params, const torch::Tensor& summed);

  // ---- the pass's unlisted inputs ------------------------------------------------------------

  // Summed over the pass's blocks, and added to each one's .grad once, at the pass's end.
  void add_unlisted(const UnlistedLeaf& leaf, torch::Tensor g);
  // Into .grad as autograd accumulates it. (Its tensor hooks ran in each block's grad(), on that
  // block's share; post-accumulate-grad hooks do not run.)
  void accumulate_unlisted();

  // ---- averages across ranks -----------------------------------------------------------------

  // The mean across ranks of tensors of any dtype and shape (one bucket), as new tensors.
  std::vector<torch::Tensor> averaged(const std::vector<torch::Tensor>& tensors, const std::string& what);
  // The same, into the tensors themselves (gradients the host owns).
  void average_in_place(const std::vector<torch::Tensor>& tensors, const std::string& what);

  // Passes cut short: the reductions in flight are waited for (failures logged) and dropped,
  // with everything of the pass.
  void abandon(spdlog::logger& log) noexcept;

 private:
  std::shared_ptr<Collectives> collectives_;
  std::function<bool(std::uint32_t)> keeps_;
  bool device_reductions_ = false;
  bool staged_ = false;  // a master's staging holds this pass's gradient
  std::vector<Bucket> reducing_;
  std::vector<UnlistedLeaf> unlisted_;
  std::vector<torch::Tensor> unlisted_grads_;
};

}  // namespace sp::torch_layer
