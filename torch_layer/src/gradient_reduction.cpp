// The masters' gradients: staged, reduced across ranks in buckets, folded into .grad.
#include "streamed_model_impl.h"

namespace sp::torch_layer {

void StreamedModel::Impl::probe_collectives() {
  try {
    torch::Tensor one = torch::zeros({1}, torch::kFloat32);
    collectives->all_reduce(one, Reduction::sum, "a probe of CPU tensors")->wait();
  } catch (const CollectiveError&) {
    throw;  // a rank failed: not an answer about the group
  } catch (const std::exception& e) {
    const std::string why = e.what();
    throw std::invalid_argument(fmt::format(
        "StreamedModelOptions::collectives: rank {} of {}: the group refused an all-reduce of a CPU tensor ({}). "
        "The layer's collectives run on host tensors: give it a group that takes them, as Gloo does, or "
        "one with a backend per device (init_process_group(\"cpu:gloo,cuda:nccl\")); NCCL alone takes "
        "device tensors only",
        collectives->rank(), collectives->size(), why.substr(0, why.find('\n'))));
  }
  if (!options.device.is_cuda()) return;
  const bool here = collectives->reduces_on(options.device);
  torch::Tensor everywhere = torch::tensor({here ? 1 : 0}, torch::kInt32);
  collectives->all_reduce(everywhere, Reduction::min, "whether every rank's group reduces device tensors")->wait();
  device_reductions = everywhere.item<std::int32_t>() == 1;
  log->info("StreamedModel: the masters' gradients are reduced across ranks {}",
            device_reductions ? fmt::format("on {}, before they cross to the host", options.device.str())
            : here            ? std::string("on the host: another rank's group does not reduce device tensors")
                              : std::string("on the host: the group does not reduce device tensors without it"));
}

ad::Event& StreamedModel::Impl::gradient_copied_event(std::uint32_t b) {
  std::unique_ptr<ad::Event>& event = blocks[b].gradient_copied;
  if (!event) event = backend->create_event();
  return *event;
}

void StreamedModel::Impl::wait_for_updates() {
  updater.wait(*engine, [&](std::uint32_t b, bool skipped) {
    if (skipped) {
      step_state.skip_update(b);
      log->warn("StreamedModel: step {}: {} was not updated: its gradient holds a non-finite element",
                step_state.number(), blocks[b].block.name);
    } else {
      blocks[b].eval_image_stale = true;
    }
    blocks[b].updated_in_step = true;
  });
}

void StreamedModel::Impl::update_block(std::uint32_t b, const kn::AdamWStep& adam,
                                       const std::map<std::string, MasterMoments>& moments, bool skip_nonfinite) {
  std::vector<kn::AdamWTensor> tensors = fused_update_tensors(blocks[b], moments);
  if (skip_nonfinite && !gradients_finite(blocks[b])) {
    step_state.skip_update(b);
    log->warn("StreamedModel: step {}: {} was not updated: its gradient holds a non-finite element",
              step_state.number(), blocks[b].block.name);
  } else {
    engine->update_weights(b, adam, tensors);
    blocks[b].eval_image_stale = true;
  }
  blocks[b].updated_in_step = true;
}

void StreamedModel::Impl::stage_master_gradient(StreamedParam& p, const torch::Tensor& g) {
  if (p.staging.defined()) {
    p.staging.copy_(g, /*non_blocking=*/true);
    p.staged = true;
    grads_staged = true;
    return;
  }
  add_to_master_grad(p, g.to(torch::kCPU, torch::kFloat32));
}

void StreamedModel::Impl::add_to_master_grad(StreamedParam& p, const torch::Tensor& g) {
  torch::Tensor& grad = p.master.mutable_grad();
  if (grad.defined()) {
    grad.add_(g);
  } else {
    grad = g.clone();
  }
}

void StreamedModel::Impl::abandon_passes() noexcept {
  try {
    wait_for_updates();
  } catch (const std::exception& e) {
    log->warn("StreamedModel: an update during the backward of an abandoned pass failed: {}", e.what());
  }
  updater.disarm();
  pass_unlisted.clear();
  pass_unlisted_grads.clear();
  for (BlockState& block : blocks) block.deferred_update = false;
  for (ReducingBucket& r : reducing) {
    try {
      r.pending->wait();
    } catch (const std::exception& e) {
      log->warn("StreamedModel: dropping an all-reduce of an abandoned pass: {}", e.what());
    }
  }
  reducing.clear();
  try {
    for (const auto& [id, pass] : passes) {
      if (!pass.held) continue;
      empty_kept(blocks[*pass.held]);
      engine->release(*pass.held);  // the engine's step ends with no block in use
    }
    if (engine_pass) engine->end_step();
  } catch (const std::exception& e) {
    log->warn("StreamedModel: ending an abandoned pass: {}", e.what());
  }
  engine_pass.reset();
  passes.clear();
  forwarding.reset();
  grads_staged = false;
  for (BlockState& b : blocks) {
    for (StreamedParam& p : b.streamed) p.staged = false;
  }
}

void StreamedModel::Impl::finish_pass(std::uint64_t id) {
  try {
    for (ReducingBucket& r : reducing) r.pending->wait();
    // Into .grad as autograd accumulates it. (Its tensor hooks ran in each block's grad(), on that
    // block's share; post-accumulate-grad hooks do not run.)
    std::vector<UnlistedLeaf> leaves = std::move(pass_unlisted);
    std::vector<torch::Tensor> sums = std::move(pass_unlisted_grads);
    pass_unlisted.clear();
    pass_unlisted_grads.clear();
    for (std::size_t i = 0; i < leaves.size(); ++i) (*leaves[i].accumulate)({std::move(sums[i])});
  } catch (...) {
    abandon_passes();
    throw;
  }
  release_engine();
  TrainingPass& pass = passes.at(id);
  step_state.add_training_transfer(pass.transfer);
  pass.transfer = ad::StepTransferMetrics{};
  if (!pass.backward_ran) step_state.count_training_pass();
  pass.backward_ran = true;
  pass.in_backward = false;
  for (ReducingBucket& r : reducing) fold_averaged(r.params, r.bucket);
  reducing.clear();
  if (!grads_staged) return;
  backend->record(*compute_done, ad::Queue::compute);
  backend->synchronize(*compute_done);
  std::vector<StreamedParam*> staged;
  for (BlockState& b : blocks) {
    for (StreamedParam& p : b.streamed) {
      if (!p.staged) continue;
      staged.push_back(&p);
      p.staged = false;
    }
  }
  if (collectives) {
    // On a GPU the gradients reach the host only here: one bucket for the whole pass.
    std::vector<torch::Tensor> flat;
    for (StreamedParam* p : staged) flat.push_back(p->staging.reshape({-1}));
    torch::Tensor bucket = torch::cat(flat);
    collectives->all_reduce(bucket, Reduction::sum, "gradients of the pass")->wait();
    fold_averaged(staged, bucket);
  } else {
    for (StreamedParam* p : staged) add_to_master_grad(*p, p->staging);
  }
  grads_staged = false;
  std::vector<std::uint32_t> deferred;
  for (std::uint32_t b = 0; b < blocks.size(); ++b) {
    if (blocks[b].deferred_update) deferred.push_back(b);
    blocks[b].deferred_update = false;
  }
  try {
    for (std::uint32_t b : deferred) begin_block_update(b, {});
  } catch (...) {
    abandon_passes();
    throw;
  }
}

void StreamedModel::Impl::fold_averaged(const std::vector<StreamedParam*>& params, const torch::Tensor& summed) {
  if (std::none_of(params.begin(), params.end(), [&](const StreamedParam* p) { return owns(p->block); })) return;
  torch::Tensor bucket = summed.to(torch::kCPU);
  bucket.div_(collectives->size());
  std::int64_t offset = 0;
  for (StreamedParam* p : params) {
    const std::int64_t n = c10::multiply_integers(p->shape);
    if (owns(p->block)) add_to_master_grad(*p, bucket.narrow(0, offset, n).view(p->shape));
    offset += n;
  }
}

std::vector<torch::Tensor> StreamedModel::Impl::averaged(const std::vector<torch::Tensor>& tensors,
                                                         const std::string& what) {
  if (!collectives || tensors.empty()) return tensors;
  std::vector<torch::Tensor> flat;
  for (const torch::Tensor& t : tensors) flat.push_back(t.reshape({-1}).to(torch::kFloat32));
  torch::Tensor bucket = torch::cat(flat);
  collectives->all_reduce(bucket, Reduction::sum, what)->wait();
  bucket.div_(collectives->size());
  std::vector<torch::Tensor> out;
  std::int64_t offset = 0;
  for (const torch::Tensor& t : tensors) {
    out.push_back(bucket.narrow(0, offset, t.numel()).view(t.sizes()).to(t.scalar_type()).clone());
    offset += t.numel();
  }
  return out;
}

void StreamedModel::Impl::average_in_place(const std::vector<torch::Tensor>& tensors, const std::string& what) {
  if (!collectives || tensors.empty()) return;
  const std::vector<torch::Tensor> means = averaged(tensors, what);
  torch::NoGradGuard no_grad;
  for (std::size_t i = 0; i < tensors.size(); ++i) tensors[i].copy_(means[i]);
}

void StreamedModel::Impl::check_ranks_agree(const std::vector<std::int32_t>& values, const std::string& what) {
  if (!collectives) return;
  const torch::Tensor mine = torch::tensor(values, torch::kInt32);
  torch::Tensor high = mine.clone(), low = mine.clone();
  auto max = collectives->all_reduce(high, Reduction::max, what);
  auto min = collectives->all_reduce(low, Reduction::min, what);
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
                                        collectives->rank(), collectives->size(), what, fmt::join(differ, ", ")));
  }
}

}  // namespace sp::torch_layer
