// The masters' gradients: the gradient reducer (gradient_reducer.h: staged, reduced across ranks
// in buckets, folded into .grad), and the ends of a training pass.
#include "streamed_model_impl.h"

namespace sp::torch_layer {

void StreamedModel::Impl::wait_for_updates() {
  updater.wait(*engines.train, [&](std::uint32_t b, bool skipped) {
    if (skipped) {
      step_state.skip_update(b);
      log->warn("StreamedModel: step {}: {} was not updated: its gradient holds a non-finite element",
                step_state.number(), blocks[b].block.name);
    }
    blocks[b].mark_updated(/*image_written=*/!skipped);
  });
}

void StreamedModel::Impl::update_block(std::uint32_t b, const kn::AdamWStep& adam,
                                       const std::map<std::string, MasterMoments>& moments, bool skip_nonfinite) {
  std::vector<kn::AdamWTensor> tensors = blocks[b].fused_update_tensors(moments);
  const bool skip = skip_nonfinite && !blocks[b].gradients_finite();
  if (skip) {
    step_state.skip_update(b);
    log->warn("StreamedModel: step {}: {} was not updated: its gradient holds a non-finite element",
              step_state.number(), blocks[b].block.name);
  } else {
    engines.train->update_weights(b, adam, tensors);
  }
  blocks[b].mark_updated(/*image_written=*/!skip);
}

void StreamedModel::Impl::abandon_passes() noexcept {
  try {
    wait_for_updates();
  } catch (const std::exception& e) {
    log->warn("StreamedModel: an update during the backward of an abandoned pass failed: {}", e.what());
  }
  updater.disarm();
  for (BlockGroup& block : blocks) block.cancel_deferred_update();
  reducer.abandon(*log);
  try {
    passes.for_each([&](TrainingPass& pass) { backward->let_go(pass); });
  } catch (const std::exception& e) {
    log->warn("StreamedModel: releasing the block an abandoned pass held: {}", e.what());
  }
  try {
    passes.abandon();
  } catch (const std::exception& e) {
    log->warn("StreamedModel: ending an abandoned pass: {}", e.what());
  }
  for (BlockGroup& b : blocks) {
    for (StreamedParameter& p : b.streamed) p.staged = false;
  }
}

void StreamedModel::Impl::finish_pass(std::uint64_t id) {
  try {
    reducer.wait_pending();
    reducer.accumulate_unlisted();
  } catch (...) {
    abandon_passes();
    throw;
  }
  passes.finish(id);
  reducer.fold_pending();
  if (!reducer.any_staged()) return;
  engines.backend->record(*engines.compute_done, ad::Queue::compute);
  engines.backend->synchronize(*engines.compute_done);
  std::vector<StreamedParameter*> staged;
  for (BlockGroup& b : blocks) {
    for (StreamedParameter& p : b.streamed) {
      if (!p.staged) continue;
      staged.push_back(&p);
    }
  }
  reducer.fold_staged(std::move(staged));
  std::vector<std::uint32_t> deferred;
  for (std::uint32_t b = 0; b < blocks.size(); ++b) {
    if (blocks[b].take_deferred_update()) deferred.push_back(b);
  }
  try {
    for (std::uint32_t b : deferred) begin_block_update(b, {});
  } catch (...) {
    abandon_passes();
    throw;
  }
}

void GradientReducer::probe(const torch::Device& compute, spdlog::logger& log) {
  try {
    torch::Tensor one = torch::zeros({1}, torch::kFloat32);
    collectives_->all_reduce(one, Reduction::sum, "a probe of CPU tensors")->wait();
  } catch (const CollectiveError&) {
    throw;  // a rank failed: not an answer about the group
  } catch (const std::exception& e) {
    const std::string why = e.what();
    throw std::invalid_argument(fmt::format(
        "StreamedModelOptions::collectives: rank {} of {}: the group refused an all-reduce of a CPU tensor ({}). "
        "The layer's collectives run on host tensors: give it a group that takes them, as Gloo does, or "
        "one with a backend per device (init_process_group(\"cpu:gloo,cuda:nccl\")); NCCL alone takes "
        "device tensors only",
        collectives_->rank(), collectives_->size(), why.substr(0, why.find('\n'))));
  }
  if (!compute.is_cuda()) return;
  const bool here = collectives_->reduces_on(compute);
  torch::Tensor everywhere = torch::tensor({here ? 1 : 0}, torch::kInt32);
  collectives_->all_reduce(everywhere, Reduction::min, "whether every rank's group reduces device tensors")->wait();
  device_reductions_ = everywhere.item<std::int32_t>() == 1;
  log.info("StreamedModel: the masters' gradients are reduced across ranks {}",
           device_reductions_ ? fmt::format("on {}, before they cross to the host", compute.str())
           : here             ? std::string("on the host: another rank's group does not reduce device tensors")
                              : std::string("on the host: the group does not reduce device tensors without it"));
}

void GradientReducer::stage(StreamedParameter& p, const torch::Tensor& g) {
  if (p.staging.defined()) {
    p.staging.copy_(g, /*non_blocking=*/true);
    p.staged = true;
    staged_ = true;
    return;
  }
  add_to_master_grad(p, g.to(torch::kCPU, torch::kFloat32));
}

void GradientReducer::add_to_master_grad(StreamedParameter& p, const torch::Tensor& g) {
  torch::Tensor& grad = p.master.mutable_grad();
  if (grad.defined()) {
    grad.add_(g);
  } else {
    grad = g.clone();
  }
}

void GradientReducer::fold_staged(std::vector<StreamedParameter*> staged) {
  for (StreamedParameter* p : staged) p->staged = false;
  if (collectives_) {
    // On a GPU the gradients reach the host only here: one bucket for the whole pass.
    std::vector<torch::Tensor> flat;
    for (StreamedParameter* p : staged) flat.push_back(p->staging.reshape({-1}));
    torch::Tensor bucket = torch::cat(flat);
    collectives_->all_reduce(bucket, Reduction::sum, "gradients of the pass")->wait();
    fold_averaged(staged, bucket);
  } else {
    for (StreamedParameter* p : staged) add_to_master_grad(*p, p->staging);
  }
  staged_ = false;
}

void GradientReducer::fold_averaged(const std::vector<StreamedParameter*>& params, const torch::Tensor& summed) {
  if (std::none_of(params.begin(), params.end(), [&](const StreamedParameter* p) { return keeps_(p->block); })) return;
  torch::Tensor bucket = summed.to(torch::kCPU);
  bucket.div_(collectives_->size());
  std::int64_t offset = 0;
  for (StreamedParameter* p : params) {
    const std::int64_t n = c10::multiply_integers(p->shape);
    if (keeps_(p->block)) add_to_master_grad(*p, bucket.narrow(0, offset, n).view(p->shape));
    offset += n;
  }
}

void GradientReducer::add_unlisted(const UnlistedLeaf& leaf, torch::Tensor g) {
  const auto same = [&](const UnlistedLeaf& l) { return l.tensor.is_same(leaf.tensor); };
  const auto it = std::find_if(unlisted_.begin(), unlisted_.end(), same);
  if (it == unlisted_.end()) {
    unlisted_.push_back(leaf);
    unlisted_grads_.push_back(std::move(g));
  } else {
    torch::Tensor& sum = unlisted_grads_[static_cast<std::size_t>(it - unlisted_.begin())];
    sum = sum + g;
  }
}

void GradientReducer::accumulate_unlisted() {
  std::vector<UnlistedLeaf> leaves = std::exchange(unlisted_, {});
  std::vector<torch::Tensor> sums = std::exchange(unlisted_grads_, {});
  for (std::size_t i = 0; i < leaves.size(); ++i) (*leaves[i].accumulate)({std::move(sums[i])});
}

std::vector<torch::Tensor> GradientReducer::averaged(const std::vector<torch::Tensor>& tensors,
                                                     const std::string& what) {
  if (!collectives_ || tensors.empty()) return tensors;
  std::vector<torch::Tensor> flat;
  for (const torch::Tensor& t : tensors) flat.push_back(t.reshape({-1}).to(torch::kFloat32));
  torch::Tensor bucket = torch::cat(flat);
  collectives_->all_reduce(bucket, Reduction::sum, what)->wait();
  bucket.div_(collectives_->size());
  std::vector<torch::Tensor> out;
  std::int64_t offset = 0;
  for (const torch::Tensor& t : tensors) {
    out.push_back(bucket.narrow(0, offset, t.numel()).view(t.sizes()).to(t.scalar_type()).clone());
    offset += t.numel();
  }
  return out;
}

void GradientReducer::average_in_place(const std::vector<torch::Tensor>& tensors, const std::string& what) {
  if (!collectives_ || tensors.empty()) return;
  const std::vector<torch::Tensor> means = averaged(tensors, what);
  torch::NoGradGuard no_grad;
  for (std::size_t i = 0; i < tensors.size(); ++i) tensors[i].copy_(means[i]);
}

void GradientReducer::abandon(spdlog::logger& log) noexcept {
  unlisted_.clear();
  unlisted_grads_.clear();
  for (Bucket& r : reducing_) {
    try {
      r.pending->wait();
    } catch (const std::exception& e) {
      log.warn("StreamedModel: dropping an all-reduce of an abandoned pass: {}", e.what());
    }
  }
  reducing_.clear();
  staged_ = false;
}

void StreamedModel::Impl::check_ranks_agree(const std::vector<std::int32_t>& values, const std::string& what) {
  if (!shards.group()) return;
  const torch::Tensor mine = torch::tensor(values, torch::kInt32);
  torch::Tensor high = mine.clone(), low = mine.clone();
  auto max = shards.group()->all_reduce(high, Reduction::max, what);
  auto min = shards.group()->all_reduce(low, Reduction::min, what);
  max->wait();
  min->wait();
  std::vector<std::string> differ;
  for (std::size_t b = 0; b < values.size(); ++b) {
    if (high[b].item<std::int32_t>() != low[b].item<std::int32_t>()) {
      differ.push_back(fmt::format("{} ({} to {})", b < blocks.size() ? blocks[b].block.name : "plugin",
                                   low[b].item<std::int32_t>(), high[b].item<std::int32_t>()));
    }
  }
  if (!differ.empty()) {
    throw RankMismatchError(fmt::format("step {}: rank {} of {}: {} differ across ranks for {}", step_state.number(),
                                        shards.group()->rank(), shards.group()->size(), what, fmt::join(differ, ", ")));
  }
}

}  // namespace sp::torch_layer
