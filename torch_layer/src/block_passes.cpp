// A call of a block: the evaluation and training forwards a block at a time, the order the
// passes call the blocks in, and what the two backward strategies share (the checks of a
// backward, the weights' gradients on their way to the masters).
#include "streamed_model_impl.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

#if SP_TORCH_LAYER_HAVE_CUDA && __has_include(<c10/cuda/CUDAStream.h>)
#include <c10/cuda/CUDAStream.h>
#define SP_TORCH_LAYER_FOLLOWS_CUDA_STREAMS 1
#endif

namespace sp::torch_layer {

std::vector<torch::Tensor> StreamedModel::Impl::train_forward(std::uint32_t b, const std::vector<torch::Tensor>& inputs,
                                                              BlockCall call, bool opening) {
  if (torch::autograd::get_current_graph_task_id() != -1) return checkpoint_recompute(b, inputs, call);
  refuse_training_while_measuring(b);
  if (!opening) {
    refuse_second_call(b, engines.train->schedule(), passes.forwarded().next_forward, "training pass", block_name());
    if (!passes.engine_serves_forward()) {
      throw std::logic_error(fmt::format(
          "StreamedModel: {} was called after another training pass's backward ran while this pass's forward was "
          "under way (the engine serves one pass at a time): finish a pass's forward before a backward",
          blocks[b].block.name));
    }
  }
  step_state.require_step("forward");
  if (step_state.after_backward()) {
    throw std::logic_error("StreamedModel::forward: post_backward() already ran in this step; call end_step()");
  }
  if (opening) {
    if (updater.is_armed() && (!passes.empty() || updater.any_begun())) {
      throw std::logic_error(
          "StreamedModel::forward: update_masters_during_backward() armed the update of the pass whose backward runs "
          "next; call post_backward() after it (a pass after it would add gradients that no update sees)");
    }
    end_stopped_backwards("forward");
    // Passes whose graphs the host dropped without a backward (evaluations in grad mode) end here.
    passes.close_dropped_graphs();
    wait_for_updates();  // the pass fetches the blocks they update
    rebuild_changed_images("forward");
    if (options.recalibrate_every != 0) last_input = inputs.at(0).detach();
    step_state.count_examples(inputs.at(0).dim() > 0 ? static_cast<std::uint64_t>(inputs.at(0).size(0)) : 1);
    backward->prepare(passes.at(passes.open(blocks.size())), blocks.size());
  }
  const std::uint64_t id = *passes.forwarding();
  TrainingPass& current = passes.at(id);
  try {
    passes.follow_call(id, b, blocks[b].block.name, current.next_forward, opening);
  } catch (...) {
    if (opening) passes.drop(id);
    throw;
  }
  current.calls[b] = std::move(call);
  std::vector<torch::Tensor> out;
  bool reaches = false;  // the backward reaches down to the lowest block it runs through
  try {
    out = backward->forward(b, id, inputs, reaches);
  } catch (...) {
    passes.drop(id);
    throw;
  }
  if (reaches && !current.end_block) current.end_block = b;
  ++current.next_forward;
  for (const torch::Tensor& y : out) {
    if (!y.defined() || !y.grad_fn()) continue;
    current.nodes[b].emplace(y.grad_fn());  // one node gives every output of the block
    break;
  }
  current.first_inputs[b] = TensorIdentity(inputs);
  return out;
}

std::vector<torch::Tensor> StreamedModel::Impl::checkpoint_recompute(std::uint32_t b,
                                                                     const std::vector<torch::Tensor>& inputs,
                                                                     const BlockCall& call) {
  // The pass whose forward called the block on these very inputs: a checkpoint without
  // reentrance gives them again.
  const std::optional<std::uint64_t> id = passes.called_with(b, first_defined(inputs), blocks.size());
  if (!id) {
    throw std::logic_error(fmt::format(
        "StreamedModel: {} was called in grad mode inside a backward, on inputs that no training pass's forward "
        "gave it: a checkpoint recomputes it from inputs it computed again (one that wraps more than this one "
        "block, or torch.utils.checkpoint with use_reentrant=True). Checkpoint each streamed block on its own, "
        "with use_reentrant=False (Hugging Face's gradient checkpointing does)",
        blocks[b].block.name));
  }
  return backward->recompute_for_checkpoint(b, *id, inputs, call);
}

void StreamedModel::Impl::end_stopped_backwards(const char* call) {
  if (!passes.backward_under_way()) return;
  if (torch::autograd::get_current_graph_task_id() != -1) {
    throw std::logic_error(fmt::format(
        "StreamedModel::{}: called inside the backward of a training pass, before it reached its last block", call));
  }
  // Autograd is done with it: an error stopped it, or it was asked for a gradient above the
  // pass's lowest block. The gradients it gave stay, as autograd's would.
  log->warn("StreamedModel::{}: the backward of a training pass stopped before its last block (an error in it, or a "
            "gradient asked of a tensor above it); the pass ends here",
            call);
  abandon_passes();
}

void StreamedModel::Impl::close_passes_without_backward(const char* why) {
  end_stopped_backwards(why);
  passes.close_all();
}

void StreamedModel::Impl::begin_eval_pass(const ad::RuntimeLimitHints& limits) {
  for (std::uint32_t b = 0; b < blocks.size(); ++b) {
    if (!blocks[b].evaluation_image_stale()) continue;
    refresh_eval_image(b);
    blocks[b].mark_evaluation_image_fresh();
  }
  evaluation.begin_pass(limits);
}

std::vector<torch::Tensor> StreamedModel::Impl::eval_forward(std::uint32_t b, const std::vector<torch::Tensor>& inputs,
                                                             const BlockCall& call, bool opening) {
  if (opening) {
    wait_for_updates();  // the evaluation engine reads the masters
    rebuild_changed_images("forward");
    if (evaluation.is_open()) evaluation.end_pass();  // one the host left before its last block
    if (engines.eval->schedule().uses().front().block != b) move_block(*engines.eval, b, 0);
    begin_eval_pass(evaluation.limits());
  } else {
    const std::uint32_t at = evaluation.called();
    refuse_second_call(b, engines.eval->schedule(), at, "evaluation pass (no grad)", block_name());
    if (engines.eval->schedule().uses()[at].block != b) {
      evaluation.end_engine_step(step_state);
      move_block(*engines.eval, b, at);
      evaluation.begin_engine_step_at_next();
    }
  }
  std::vector<torch::Tensor> out = eval_block(b, [&](const NamedParameters& weights) { return call(inputs, weights); });
  if (evaluation.called() == blocks.size()) evaluation.close_open_pass(step_state);
  return out;
}

void StreamedModel::Impl::follow_caller_stream() {
#ifdef SP_TORCH_LAYER_FOLLOWS_CUDA_STREAMS
  if (!options.device.is_cuda()) return;
  const c10::DeviceIndex index = options.device.has_index() ? options.device.index() : 0;
  static_cast<ad::CudaBackend&>(*engines.backend).set_compute_stream(c10::cuda::getCurrentCUDAStream(index).stream());
#endif
}

TrainingPass& StreamedModel::Impl::pass_for_backward(std::uint32_t b, std::uint64_t of_pass) {
  TrainingPass* found = passes.find(of_pass);
  if (found == nullptr) {
    throw std::logic_error(fmt::format(
        "StreamedModel: backward through {} of a training pass that has ended (post_backward() closed it: the "
        "optimizer step ended the step); run a pass's backwards before post_backward()",
        blocks[b].block.name));
  }
  TrainingPass& pass = *found;
  if (pass.next_forward != blocks.size()) {
    std::string stopped;
    for (std::uint32_t other = 0; other < blocks.size() && stopped.empty(); ++other) {
      if (!pass.calls[other]) stopped = blocks[other].block.name;
    }
    abandon_passes();
    throw std::logic_error(fmt::format(
        "StreamedModel: the backward reached {} of a training pass whose forward never called {}: a training "
        "pass calls every streamed block before its backward (a call of the block the passes begin with begins "
        "another pass, so a block applied twice in one forward cannot stream)",
        blocks[b].block.name, stopped));
  }
  BlockGroup& block = blocks[b];
  for (std::size_t i = 0; i < block.streamed.size(); ++i) {
    if (block.streamed[i].master._version() == pass.versions[b][i]) continue;
    abandon_passes();
    throw std::logic_error(fmt::format(
        "StreamedModel: {}'s master '{}' was modified in place after the forward that the backward now "
        "differentiates (an update before loss.backward()?): the gradient would be of other weights than the "
        "forward computed with, as PyTorch refuses for a tensor saved for the backward",
        block.block.name, block.streamed[i].name));
  }
  return pass;
}

void StreamedModel::Impl::end_pass_backward(std::uint64_t id) {
  finish_pass(id);
  // The statistics wait for the whole backward: autograd accumulates the resident parameters'
  // gradients (and the host's hooks run) after the pass's last node returns.
  torch::autograd::Engine::get_default_engine().queue_callback([model = self] {
    if (const std::shared_ptr<StreamedModel::Impl> impl = model.lock()) impl->take_backward_statistics();
  });
}

bool StreamedModel::Impl::fold_weight_gradients(std::uint32_t b, const std::vector<torch::Tensor>& grads,
                                                std::function<void()>& gradient_ready) {
  BlockGroup& block = blocks[b];
  GradientReducer::Bucket bucket;
  std::vector<torch::Tensor> flat;
  std::vector<StreamedParameter*> staged_here;
  for (std::size_t i = 0; i < block.streamed.size(); ++i) {
    StreamedParameter& p = block.streamed[i];
    torch::Tensor g = grads[i];
    if (!p.master.requires_grad()) {
      if (!policy_link.frozen_gradients_wanted() || !g.defined()) continue;
      torch::Tensor host = g.reshape(p.shape).to(torch::kCPU, torch::kFloat32);
      p.signal_grad = p.signal_grad.defined() ? p.signal_grad.add_(host) : host.clone();
      continue;
    }
    // Every rank's bucket holds every trainable parameter, whether or not it got a gradient here.
    if (!g.defined() && shards.group()) g = torch::zeros(p.shape, p.master.options());
    if (!g.defined()) continue;
    if (shards.group() && !p.staging.defined()) {
      bucket.params.push_back(&p);
      flat.push_back(g.reshape({-1}).to(gradient_reduction_device(), torch::kFloat32));
      continue;
    }
    reducer.stage(p, g.reshape(p.shape));
    if (p.staged) staged_here.push_back(&p);
  }
  // The update during the backward: what must happen, on the worker, before the block's
  // gradient is final on the host.
  const bool update_now = updater.waits_for(b) && block.trainable_masters && shards.owns(b);
  if (!flat.empty()) {
    // Started now, so that it runs while the backward goes on through the blocks before.
    bucket.bucket = torch::cat(flat);
    const std::string what = fmt::format("gradients of {}", block.block.name);
    bucket.pending = shards.sharded() ? shards.group()->reduce(bucket.bucket, shards.owner(b), Reduction::sum, what)
                                      : shards.group()->all_reduce(bucket.bucket, Reduction::sum, what);
    if (update_now) {
      auto owned = std::make_shared<GradientReducer::Bucket>(std::move(bucket));
      gradient_ready = [this, owned] {
        owned->pending->wait();
        reducer.fold_averaged(owned->params, owned->bucket);
      };
    } else {
      reducer.add_pending(std::move(bucket));
    }
  }
  if (update_now && !staged_here.empty()) {
    if (shards.group()) {
      // Staged gradients of several ranks are reduced in one bucket at the pass's end.
      blocks[b].defer_update();
    } else {
      ad::Event& copied = blocks[b].gradient_copied(*engines.backend);
      engines.backend->record(copied, ad::Queue::compute);
      for (StreamedParameter* p : staged_here) p->staged = false;
      gradient_ready = [this, &copied, staged_here] {
        engines.backend->synchronize(copied);
        for (StreamedParameter* p : staged_here) GradientReducer::add_to_master_grad(*p, p->staging);
      };
    }
  }
  return update_now;
}

void StreamedModel::Impl::refuse_unsupported_backward(std::uint32_t b) const {
  if (torch::GradMode::is_enabled()) {
    throw std::logic_error(fmt::format(
        "StreamedModel: a backward with create_graph=True reached {}: a double backward would need the block's "
        "weights after its backward released them. Take the higher-order gradient outside the streamed blocks",
        blocks[b].block.name));
  }
  // backward(inputs=...) or autograd.grad() asking for a master: its gradient comes from the
  // layer, not from a graph autograd could follow to it.
  const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
  if (exec_info == nullptr || exec_info->empty()) return;
  for (const StreamedParameter& p : blocks[b].streamed) {
    if (!p.accumulator || exec_info->count(p.accumulator.get()) == 0) continue;
    throw std::logic_error(fmt::format(
        "StreamedModel: a backward with inputs= (or autograd.grad) asks for the gradient of {}'s streamed master "
        "'{}', which the layer gives only to a full backward (loss.backward() without inputs=)",
        blocks[b].block.name, p.name));
  }
}

torch::Tensor StreamedModel::forward(const torch::Tensor& x) {
  torch::Tensor h = x;
  for (std::uint32_t b = 0; b < impl_->blocks.size(); ++b) h = forward_block(b, {h}).at(0);
  return h;
}

std::vector<torch::Tensor> StreamedModel::forward_block(std::uint32_t block, const std::vector<torch::Tensor>& inputs,
                                                        BlockCall call) {
  Impl& m = *impl_;
  if (block >= m.blocks.size()) {
    throw std::invalid_argument(
        fmt::format("StreamedModel::forward_block({}): there are {} blocks", block, m.blocks.size()));
  }
  const bool training = torch::GradMode::is_enabled();
  const bool opening = training ? m.passes.opens_pass(block) : m.evaluation.opens_pass(block);
  if (opening) m.check_parameters_unchanged();
  if (!call) call = m.blocks[block].call;
  if (!training) return m.eval_forward(block, inputs, call, opening);
  return m.train_forward(block, inputs, std::move(call), opening);
}

bool StreamedModel::opens_training_pass(std::uint32_t block) const {
  if (block >= impl_->blocks.size()) {
    throw std::invalid_argument(
        fmt::format("StreamedModel::opens_training_pass({}): there are {} blocks", block, impl_->blocks.size()));
  }
  // A host that begins its step when a pass opens asks first: refused here, before it begins one.
  impl_->refuse_training_while_measuring(block);
  return impl_->passes.opens_pass(block);
}

}  // namespace sp::torch_layer
