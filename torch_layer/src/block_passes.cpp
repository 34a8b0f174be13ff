// The passes: evaluation and training forwards a block at a time, the autograd node of a block,
// and its backward (the recompute, differentiated).
#include "streamed_model_impl.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

#if SP_TORCH_LAYER_HAVE_CUDA && __has_include(<c10/cuda/CUDAStream.h>)
#include <c10/cuda/CUDAStream.h>
#define SP_TORCH_LAYER_FOLLOWS_CUDA_STREAMS 1
#endif

namespace sp::torch_layer {

// The autograd node of one streamed block: its forward fetches the block and runs it without
// a graph; its backward fetches it again, recomputes and differentiates (see backward_block).
namespace {

// What the layer's autograd nodes hold of their model: a weak reference, so that a graph that
// outlives its model (destroyed while a loss was kept) finds it gone instead of reading freed
// memory, and a backward keeps its model alive until it returns.
struct ModelRef : torch::CustomClassHolder {
  explicit ModelRef(std::weak_ptr<StreamedModel::Impl> held) : model(std::move(held)) {}
  std::weak_ptr<StreamedModel::Impl> model;
};

c10::IValue model_ref(const StreamedModel::Impl& impl) {
  return c10::IValue::make_capsule(c10::make_intrusive<ModelRef>(impl.self));
}

std::shared_ptr<StreamedModel::Impl> live_model_for_backward(const std::weak_ptr<StreamedModel::Impl>& model,
                                                             std::uint32_t block) {
  std::shared_ptr<StreamedModel::Impl> impl = model.lock();
  if (!impl) {
    throw std::logic_error(
        fmt::format("StreamedModel: backward through block {} of a model that was destroyed or closed", block));
  }
  return impl;
}

std::shared_ptr<StreamedModel::Impl> live_model_for_backward(const c10::IValue& ref, std::uint32_t block) {
  return live_model_for_backward(c10::static_intrusive_pointer_cast<ModelRef>(ref.toCapsule())->model, block);
}

}  // namespace

struct StreamedBlockFunction : public torch::autograd::Function<StreamedBlockFunction> {
  // `anchors`: what the node takes besides the block's inputs (BlockState::autograd_inputs), so
  // that autograd routes their gradients.
  static variable_list forward(AutogradContext* ctx, StreamedModel::Impl* impl, std::int64_t block, std::int64_t pass,
                               at::TensorList inputs, at::TensorList anchors) {
    ctx->saved_data["block"] = block;
    ctx->saved_data["pass"] = pass;
    ctx->saved_data["model"] = model_ref(*impl);
    ctx->saved_data["anchors"] = static_cast<std::int64_t>(anchors.size());
    ctx->save_for_backward(inputs.vec());
    variable_list outputs =
        impl->forward_block(static_cast<std::uint32_t>(block), static_cast<std::uint64_t>(pass), inputs.vec());
    variable_list integral;
    for (const torch::Tensor& y : outputs) {
      if (y.defined() && !y.is_floating_point() && !y.is_complex()) integral.push_back(y);
    }
    ctx->mark_non_differentiable(integral);
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto block = static_cast<std::uint32_t>(ctx->saved_data["block"].toInt());
    const std::shared_ptr<StreamedModel::Impl> impl = live_model_for_backward(ctx->saved_data["model"], block);
    const auto pass = static_cast<std::uint64_t>(ctx->saved_data["pass"].toInt());
    const variable_list inputs = ctx->get_saved_variables();
    variable_list grads = impl->backward_block(block, pass, inputs, grad_outputs);
    // One gradient per forward argument: impl, block, pass, then each input, then each anchor
    // (the master anchor, last when there is one, gets none: its gradient went to the master).
    variable_list out(3);
    out.insert(out.end(), grads.begin(), grads.end());
    out.resize(3 + inputs.size() + static_cast<std::size_t>(ctx->saved_data["anchors"].toInt()));
    return out;
  }
};

// Activations kept: the node at a block's outputs that need a gradient (`begins`), or at its
// inputs that do. Every node of the block leads to the outputs' one and from the inputs' one, so
// autograd runs the first before the block's nodes (the block is fetched again there) and the
// second after them all (the block is released).
struct KeptBlockBoundary : public torch::autograd::Function<KeptBlockBoundary> {
  static variable_list forward(AutogradContext* ctx, StreamedModel::Impl* impl, std::int64_t block, std::int64_t pass,
                               bool begins, at::TensorList tensors) {
    ctx->set_materialize_grads(false);
    ctx->saved_data["model"] = model_ref(*impl);
    ctx->saved_data["block"] = block;
    ctx->saved_data["pass"] = pass;
    ctx->saved_data["begins"] = begins;
    // Aliases that are not views (detach() shares the storage and the version counter), so that
    // the host may change a block's output in place, as it may a plain block's.
    variable_list out;
    for (const torch::Tensor& t : tensors) out.push_back(t.detach());
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto block = static_cast<std::uint32_t>(ctx->saved_data["block"].toInt());
    const auto pass = static_cast<std::uint64_t>(ctx->saved_data["pass"].toInt());
    const std::shared_ptr<StreamedModel::Impl> impl = live_model_for_backward(ctx->saved_data["model"], block);
    if (ctx->saved_data["begins"].toBool()) {
      impl->begin_kept_backward(block, pass);
    } else {
      impl->end_kept_backward(block, pass);
    }
    variable_list out(4);
    out.insert(out.end(), grads.begin(), grads.end());
    return out;
  }
};

// Activations kept: the node the delivered weights of one block in one pass lead to, where they
// take a gradient; it runs once autograd has summed every use's.
struct KeptBlockWeights : public torch::autograd::Node {
  KeptBlockWeights(std::weak_ptr<StreamedModel::Impl> model, std::uint32_t block, std::uint64_t pass)
      : model_(std::move(model)), block_(block), pass_(pass) {}

  variable_list apply(variable_list&& grads) override {
    live_model_for_backward(model_, block_)->kept_weight_gradients(block_, pass_, grads);
    return {};
  }
  std::string name() const override { return "selective_precision::KeptBlockWeights"; }

 private:
  std::weak_ptr<StreamedModel::Impl> model_;
  std::uint32_t block_;
  std::uint64_t pass_;
};

std::vector<torch::Tensor> StreamedModel::Impl::train_forward(std::uint32_t b, const std::vector<torch::Tensor>& inputs,
                                                              BlockCall call, bool opening) {
  if (torch::autograd::get_current_graph_task_id() != -1) return checkpoint_recompute(b, inputs, call);
  refuse_training_while_measuring(b);
  if (!opening) {
    refuse_second_call(b, engines.train->schedule(), passes.at(*forwarding).next_forward, "training pass");
    if (engine_pass != forwarding) {
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
    std::vector<std::uint64_t> dropped;
    for (const auto& [id, open] : passes) {
      if (!open.graph_alive()) dropped.push_back(id);
    }
    for (const std::uint64_t id : dropped) close_pass_without_backward(id);
    wait_for_updates();  // the pass fetches the blocks they update
    rebuild_changed_images("forward");
    if (options.recalibrate_every != 0) last_input = inputs.at(0).detach();
    step_state.count_examples(inputs.at(0).dim() > 0 ? static_cast<std::uint64_t>(inputs.at(0).size(0)) : 1);
    const std::uint64_t id = ++last_pass_id;
    TrainingPass& opened = passes[id];
    opened.calls.resize(blocks.size());
    opened.states.resize(blocks.size());
    opened.versions.resize(blocks.size());
    opened.nodes.resize(blocks.size());
    opened.first_inputs.assign(blocks.size(), TensorIdentity());
    if (!recompute) {
      opened.weight_nodes.resize(blocks.size());
      opened.weight_inputs.resize(blocks.size());
      opened.input_nodes.assign(blocks.size(), false);
      opened.update_after_release.resize(blocks.size());
    }
    forwarding = id;
  }
  const std::uint64_t id = *forwarding;
  TrainingPass& current = passes.at(id);
  try {
    follow_training_call(id, b, current.next_forward, opening);
  } catch (...) {
    if (opening) {
      passes.erase(id);
      forwarding.reset();
    }
    throw;
  }
  current.calls[b] = std::move(call);
  const auto needs_gradient = [](const torch::Tensor& t) { return t.defined() && t.requires_grad(); };
  std::vector<torch::Tensor> out;
  bool node = false;  // the backward reaches down to the lowest block that has one
  try {
    if (recompute) {
      // The node exists where the block's inputs need a gradient, or it trains something itself.
      node = !blocks[b].autograd_inputs.empty() || std::any_of(inputs.begin(), inputs.end(), needs_gradient);
      out = StreamedBlockFunction::apply(this, static_cast<std::int64_t>(b), static_cast<std::int64_t>(id),
                                         at::TensorList(inputs), at::TensorList(blocks[b].autograd_inputs));
    } else {
      out = kept_forward(b, id, inputs);
      node = std::any_of(out.begin(), out.end(), needs_gradient);
    }
  } catch (...) {
    release_engine();
    passes.erase(id);
    forwarding.reset();
    throw;
  }
  if (node && !current.end_block) current.end_block = b;
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
  const c10::TensorImpl* first = first_defined(inputs);
  std::optional<std::uint64_t> id;
  for (const auto& [open, pass] : passes) {
    if (pass.next_forward == blocks.size() && pass.first_inputs[b].is(first) && pass.graph_alive()) id = open;
  }
  if (!id) {
    throw std::logic_error(fmt::format(
        "StreamedModel: {} was called in grad mode inside a backward, on inputs that no training pass's forward "
        "gave it: a checkpoint recomputes it from inputs it computed again (one that wraps more than this one "
        "block, or torch.utils.checkpoint with use_reentrant=True). Checkpoint each streamed block on its own, "
        "with use_reentrant=False (Hugging Face's gradient checkpointing does)",
        blocks[b].block.name));
  }
  if (!recompute) {
    // The backward that reached the block fetched it; the weights take their gradients as in the
    // forward, so that the checkpoint finds the tensors it saved.
    TrainingPass& pass = passes.at(*id);
    if (pass.held != b) {
      throw std::logic_error(fmt::format(
          "StreamedModel: {} was recomputed inside a backward that had not reached it (a checkpoint's recompute "
          "runs when the block's backward needs its saved tensors)",
          blocks[b].block.name));
    }
    return call(inputs, kept_weights(blocks[b], pass.weight_nodes[b], pass.weight_inputs[b]));
  }
  // The node is made as in the forward, so that the checkpoint finds the tensors it saved; its
  // graph is dropped, and the pass's own node differentiates the block.
  replay_call = &call;
  std::vector<torch::Tensor> out;
  try {
    enter_backward(*id, b);
    out = StreamedBlockFunction::apply(this, static_cast<std::int64_t>(b), static_cast<std::int64_t>(*id),
                                       at::TensorList(inputs), at::TensorList(blocks[b].autograd_inputs));
  } catch (...) {
    // Not a failure of the pass: a checkpoint stops its recompute by throwing from its hook once
    // it has the tensors it needs (torch.utils.checkpoint's early stop), here after the node saved
    // its inputs. Whatever else failed fails the backward, whose pass stays open until the step is
    // aborted.
    replay_call = nullptr;
    throw;
  }
  replay_call = nullptr;
  return out;
}

void StreamedModel::Impl::release_engine() {
  if (!engine_pass) return;
  const ad::StepTransferMetrics m = engines.train->end_step();
  const auto served = passes.find(*engine_pass);
  engine_pass.reset();
  // Prefetches after a pass ended (into its backward's turn) count to the step.
  if (served == passes.end()) {
    step_state.add_training_transfer(m);
  } else {
    add_transfer(served->second.transfer, m);
  }
}

void StreamedModel::Impl::enter_backward(std::uint64_t id, std::uint32_t b) {
  TrainingPass& pass = passes.at(id);
  const std::uint32_t use = engines.train->schedule().backward_use(b);
  if (pass.in_backward) {
    // A backward that skipped the blocks between (their outputs reached no loss), or that runs
    // in another order than the schedule's (the pass's forward called the blocks in another
    // order than the one the schedule follows now), resumes the engine at this block's use; the
    // same block again (a checkpoint's recompute) is served again.
    if (use != pass.next_backward_use && use + 1 != pass.next_backward_use) {
      release_engine();
      engines.train->begin_step(engine_steps++, {}, use);
      engine_pass = id;
      pass.next_backward_use = use + 1;
    }
    pass.next_backward_use = std::max(pass.next_backward_use, use + 1);
    return;
  }
  if (backward_under_way()) {
    throw std::logic_error(
        "StreamedModel: the backwards of two training passes interleave (a loss over both, with the blocks' "
        "gradients reached by turns?): the engine fetches one pass's backward at a time. Run one backward per pass, "
        "or one backward of a loss whose passes autograd finishes one after the other");
  }
  // The backward begins at this block's use: after the forward in the same engine step when it
  // is the last block, else in a step of its own begun there.
  if (engine_pass != id || use != blocks.size()) {
    release_engine();
    engines.train->begin_step(engine_steps++, {}, use);
    engine_pass = id;
  }
  if (forwarding == id) forwarding.reset();
  pass.in_backward = true;
  pass.next_backward_use = use + 1;
}

bool StreamedModel::Impl::backward_under_way() const {
  return std::any_of(passes.begin(), passes.end(), [](const auto& open) { return open.second.in_backward; });
}

void StreamedModel::Impl::end_stopped_backwards(const char* call) {
  if (!backward_under_way()) return;
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
  while (!passes.empty()) close_pass_without_backward(passes.begin()->first);
}

void StreamedModel::Impl::close_pass_without_backward(std::uint64_t id) {
  if (engine_pass == id) release_engine();
  if (!passes.at(id).backward_ran) {
    log->debug("StreamedModel: a training pass ended without a backward");
    // A grad-mode forward without a backward (an evaluation that left grad mode on, under
    // model.eval() say) trained nothing: its bytes are an evaluation's.
    evaluation.count(passes.at(id).transfer.h2d_bytes.total(), step_state);
  }
  passes.erase(id);
  if (forwarding == id) forwarding.reset();
}

bool StreamedModel::Impl::opens_pass(std::uint32_t b, bool training) const {
  const ad::StepSchedule& schedule = training ? engines.train->schedule() : engines.eval->schedule();
  if (training ? !forwarding : !evaluation.is_open()) return true;
  const std::uint32_t called = training ? passes.at(*forwarding).next_forward : evaluation.called();
  if (called == blocks.size() || schedule.uses().front().block == b) return true;
  // An evaluation that stopped early (an early exit): a block it called already begins the next.
  if (!training) return schedule.forward_use(b) < called;
  // A training pass whose latest outputs the host dropped stopped early: whatever comes next
  // begins another pass. (One still holding them goes on, so a block called again in it is a
  // block applied twice, refused by name.)
  const auto& latest = passes.at(*forwarding).nodes[schedule.uses()[called - 1].block];
  return latest && latest->expired();
}

void StreamedModel::Impl::refuse_second_call(std::uint32_t b, const ad::StepSchedule& schedule, std::uint32_t called,
                                             const char* pass_kind) const {
  if (schedule.forward_use(b) >= called) return;
  throw std::logic_error(fmt::format(
      "StreamedModel: {} was called twice in one {}, before {} was called: a pass calls every streamed block once, "
      "in any order (a block applied twice, as a layer shared across depth is, cannot stream)",
      blocks[b].block.name, pass_kind, blocks[schedule.uses()[called].block].block.name));
}

namespace {

// Between the engine's steps: its order with `block` moved to position `at`, the others keeping
// theirs relative to each other. The pass's calls so far are the order's first `at` blocks, so
// `block` lies after them.
void move_block(ad::StreamingEngine& engine, std::uint32_t block, std::uint32_t at) {
  std::vector<std::uint32_t> order = engine.schedule().options().order;
  order.erase(std::find(order.begin(), order.end(), block));
  order.insert(order.begin() + static_cast<std::ptrdiff_t>(at), block);
  engine.set_block_order(std::move(order));
}

}  // namespace

void StreamedModel::Impl::follow_training_call(std::uint64_t id, std::uint32_t b, std::uint32_t at, bool opening) {
  const bool moves = engines.train->schedule().uses()[at].block != b;
  if (!opening && !moves) return;
  release_engine();  // another pass's forward, the fetches ahead of a finished one, or of another block
  if (moves) {
    log->debug("StreamedModel: training passes call {} at position {}: the prefetch follows", blocks[b].block.name, at);
    move_block(*engines.train, b, at);
  }
  engines.train->begin_step(engine_steps++, {}, at);
  engine_pass = id;
}

void StreamedModel::Impl::begin_eval_pass(const ad::RuntimeLimitHints& limits) {
  for (std::uint32_t b = 0; b < blocks.size(); ++b) {
    if (!blocks[b].eval_image_stale) continue;
    refresh_eval_image(b);
    blocks[b].eval_image_stale = false;
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
    refuse_second_call(b, engines.eval->schedule(), at, "evaluation pass (no grad)");
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

std::vector<torch::Tensor> StreamedModel::Impl::forward_block(std::uint32_t b, std::uint64_t id,
                                                              const std::vector<torch::Tensor>& inputs) {
  TrainingPass& pass = passes.at(id);
  follow_caller_stream();
  const ad::BlockView& view = engines.train->acquire(b);
  attach(blocks[b], view, false);
  if (replay_call == nullptr) {
    pass.states[b] = ForwardState::capture(options.device);
    pass.versions[b].clear();
    for (const StreamedParam& p : blocks[b].streamed) pass.versions[b].push_back(p.master._version());
  }
  std::vector<torch::Tensor> out;
  try {
    out = (replay_call != nullptr ? *replay_call : pass.calls[b])(inputs, blocks[b].weights);
  } catch (...) {
    detach(blocks[b]);
    engines.train->release(b);
    throw;
  }
  detach(blocks[b]);
  engines.train->release(b);
  return out;
}

TrainingPass& StreamedModel::Impl::pass_for_backward(std::uint32_t b, std::uint64_t of_pass) {
  const auto found = passes.find(of_pass);
  if (found == passes.end()) {
    throw std::logic_error(fmt::format(
        "StreamedModel: backward through {} of a training pass that has ended (post_backward() closed it: the "
        "optimizer step ended the step); run a pass's backwards before post_backward()",
        blocks[b].block.name));
  }
  TrainingPass& pass = found->second;
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
  BlockState& block = blocks[b];
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

variable_list StreamedModel::Impl::backward_block(std::uint32_t b, std::uint64_t of_pass, const variable_list& xs,
                                                  const variable_list& grad_outs) {
  TrainingPass& pass = pass_for_backward(b, of_pass);
  BlockState& block = blocks[b];
  try {
    refuse_unsupported_backward(b);
    enter_backward(of_pass, b);
  } catch (...) {
    abandon_passes();
    throw;
  }
  // A backward that asks for some tensors' gradients only (autograd.grad, backward(inputs=...)):
  // the streamed weights, which autograd does not see here, take none, as a parameter left out
  // of `inputs` takes none in plain PyTorch.
  const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
  const bool weights_take_gradients = exec_info == nullptr || exec_info->empty();
  follow_caller_stream();
  const ad::BlockView& view = engines.train->acquire(b);
  attach(block, view, weights_take_gradients);
  variable_list grads;
  std::vector<torch::Tensor> wrt;
  UnlistedInputs unlisted;
  std::vector<std::size_t> input_slots;  // of the inputs that need a gradient, in `wrt`'s order
  try {
    torch::AutoGradMode enable(true);
    std::vector<torch::Tensor> inputs;
    for (std::size_t i = 0; i < xs.size(); ++i) {
      const bool needs = xs[i].defined() && xs[i].requires_grad();
      inputs.push_back(xs[i].defined() ? xs[i].detach().requires_grad_(needs) : xs[i]);
      if (needs) {
        input_slots.push_back(i);
        wrt.push_back(inputs.back());
      }
    }
    std::vector<torch::Tensor> outputs;
    const RecomputeMark recompute = RecomputeMark::now();
    {
      const ReplayedForward replayed(*pass.states[b]);
      outputs = pass.calls[b](inputs, block.weights);
    }
    if (outputs.size() != grad_outs.size()) {
      throw std::logic_error(
          fmt::format("StreamedModel: {}'s recompute returned {} tensors where its forward returned {}",
                      block.block.name, outputs.size(), grad_outs.size()));
    }
    // The outputs the loss reaches, with their gradients.
    std::vector<torch::Tensor> ys, gys;
    for (std::size_t i = 0; i < outputs.size(); ++i) {
      if (!outputs[i].defined() || !outputs[i].requires_grad() || !grad_outs[i].defined()) continue;
      ys.push_back(outputs[i]);
      gys.push_back(grad_outs[i]);
    }
    for (const StreamedParam& p : block.streamed) {
      if (weights_take_gradients && p.param.requires_grad()) wrt.push_back(p.param);
    }
    for (const torch::Tensor& r : block.trainable_resident) wrt.push_back(r);
    unlisted = unlisted_inputs(ys, wrt, recompute);
    if (!unlisted.foreign_node.empty()) {
      throw std::logic_error(fmt::format(
          "StreamedModel: {} reads a tensor computed outside it that requires a gradient (through {}): its "
          "gradient would have to run back through the graph that computed it, which the block's backward does "
          "not own. Compute it inside the block, pass it detached, or make it a parameter of the block",
          block.block.name, unlisted.foreign_node));
    }
    if (!unlisted.leaves.empty() && shards.group()) {
      const torch::Tensor& t = unlisted.leaves.front().tensor;
      throw std::logic_error(fmt::format(
          "StreamedModel: {} reads a tensor that requires a gradient and is none of its parameters ({} of shape "
          "[{}]): with data parallelism its gradient would not be averaged across the ranks. Register it as a "
          "parameter of the block",
          block.block.name, c10::toString(t.scalar_type()), fmt::join(t.sizes(), ", ")));
    }
    for (const UnlistedLeaf& leaf : unlisted.leaves) wrt.push_back(leaf.tensor);
    if (!wrt.empty() && !ys.empty()) {
      grads = torch::autograd::grad(ys, wrt, gys, /*retain_graph=*/false, /*create_graph=*/false,
                                    /*allow_unused=*/true);
    } else {
      grads.resize(wrt.size());
    }
  } catch (...) {
    detach(block);
    engines.train->release(b);
    abandon_passes();
    throw;
  }
  detach(block);
  engines.train->release(b);

  std::size_t next = input_slots.size();
  std::function<void()> gradient_ready;
  bool update_now = false;
  if (weights_take_gradients) {
    std::vector<torch::Tensor> weight_grads;
    for (const StreamedParam& p : block.streamed) {
      weight_grads.push_back(p.param.requires_grad() ? grads[next++] : torch::Tensor());
    }
    update_now = fold_weight_gradients(b, weight_grads, gradient_ready);
  }
  variable_list out(xs.size());
  for (std::size_t i = 0; i < input_slots.size(); ++i) out[input_slots[i]] = grads[i];
  for (std::size_t i = 0; i < block.trainable_resident.size(); ++i) {
    torch::Tensor g = grads[next++];
    if (!g.defined() && shards.group()) g = torch::zeros_like(block.trainable_resident[i]);
    out.push_back(g);
  }
  // Summed over the pass's blocks, and added to each one's .grad once, at the pass's end.
  for (const UnlistedLeaf& leaf : unlisted.leaves) {
    torch::Tensor g = grads[next++];
    if (!g.defined()) continue;
    reducer.add_unlisted(leaf, std::move(g));
  }
  if (shards.group()) {
    // Averaged before autograd adds them to the .grad, into tensors of their own (autograd's
    // may alias the upstream gradient, or be expanded views): every rank's resident
    // parameters see the same gradient, whatever the host does next.
    const auto first_resident = out.begin() + static_cast<std::ptrdiff_t>(xs.size());
    std::vector<torch::Tensor> resident(first_resident, out.end());
    try {
      resident = reducer.averaged(resident, fmt::format("gradients of {}'s resident parameters", block.block.name));
    } catch (...) {
      abandon_passes();
      throw;
    }
    std::copy(resident.begin(), resident.end(), first_resident);
  }
  try {
    if (update_now && !blocks[b].deferred_update) begin_block_update(b, std::move(gradient_ready));
  } catch (...) {
    abandon_passes();
    throw;
  }
  if (pass.end_block && b == *pass.end_block) end_pass_backward(of_pass);
  return out;
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
  BlockState& block = blocks[b];
  GradientReducer::Bucket bucket;
  std::vector<torch::Tensor> flat;
  std::vector<StreamedParam*> staged_here;
  for (std::size_t i = 0; i < block.streamed.size(); ++i) {
    StreamedParam& p = block.streamed[i];
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
      blocks[b].deferred_update = true;
    } else {
      ad::Event& copied = gradient_copied_event(b);
      engines.backend->record(copied, ad::Queue::compute);
      for (StreamedParam* p : staged_here) p->staged = false;
      gradient_ready = [this, &copied, staged_here] {
        engines.backend->synchronize(copied);
        for (StreamedParam* p : staged_here) GradientReducer::add_to_master_grad(*p, p->staging);
      };
    }
  }
  return update_now;
}

std::vector<torch::Tensor> StreamedModel::Impl::kept_forward(std::uint32_t b, std::uint64_t id,
                                                             const std::vector<torch::Tensor>& inputs) {
  TrainingPass& pass = passes.at(id);
  BlockState& block = blocks[b];
  pass.versions[b].clear();
  for (StreamedParam& p : block.streamed) {
    pass.versions[b].push_back(p.master._version());
    if (!p.accumulator && p.master.requires_grad()) p.accumulator = torch::autograd::impl::grad_accumulator(p.master);
  }
  std::vector<torch::Tensor> xs = inputs;
  pass.input_nodes[b] = through_boundary(xs, b, id, /*begins=*/false);
  std::vector<std::int64_t> edges(block.streamed.size(), -1);
  NodePtr node;
  if (std::any_of(block.streamed.begin(), block.streamed.end(), [&](const StreamedParam& p) {
        return p.master.requires_grad() || policy_link.frozen_gradients_wanted();
      })) {
    node = make_node<KeptBlockWeights>(self, b, id);
  }
  follow_caller_stream();
  const ad::BlockView& view = engines.train->acquire(b);
  std::vector<torch::Tensor> out;
  try {
    fill_kept(block, view);
    out = pass.calls[b](xs, kept_weights(block, node, edges));
    // An output that is a view of a weight (a block returning weight.t()) would read the storage
    // after the block lets go of it: it gets memory of its own.
    for (torch::Tensor& y : out) {
      if (!y.defined() || !y.has_storage()) continue;
      const auto aliases = [&](const StreamedParam& p) { return y.storage().is_alias_of(p.kept); };
      if (std::any_of(block.streamed.begin(), block.streamed.end(), aliases)) y = y.clone();
    }
  } catch (...) {
    empty_kept(block);
    engines.train->release(b);
    throw;
  }
  empty_kept(block);
  engines.train->release(b);
  pass.weight_nodes[b] = std::move(node);
  pass.weight_inputs[b] = std::move(edges);
  through_boundary(out, b, id, /*begins=*/true);
  return out;
}

bool StreamedModel::Impl::through_boundary(std::vector<torch::Tensor>& tensors, std::uint32_t b, std::uint64_t id,
                                           bool begins) {
  std::vector<std::size_t> slots;
  std::vector<torch::Tensor> through;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i].defined() || !tensors[i].requires_grad()) continue;
    slots.push_back(i);
    through.push_back(tensors[i]);
  }
  if (through.empty()) return false;
  through = KeptBlockBoundary::apply(this, static_cast<std::int64_t>(b), static_cast<std::int64_t>(id), begins,
                                     at::TensorList(through));
  for (std::size_t k = 0; k < slots.size(); ++k) tensors[slots[k]] = std::move(through[k]);
  return true;
}

NamedParameters StreamedModel::Impl::kept_weights(BlockState& block, const NodePtr& node,
                                                  std::vector<std::int64_t>& edges) {
  NamedParameters weights;
  for (std::size_t i = 0; i < block.streamed.size(); ++i) {
    StreamedParam& p = block.streamed[i];
    torch::Tensor w = torch::empty({0}, compute).set_(p.kept, 0, p.shape);
    const bool takes_gradient = p.master.requires_grad() || policy_link.frozen_gradients_wanted();
    // A module that computes with its own parameters (Block::forward) reads the placeholder:
    // it becomes the weights, leading to the node as they would while the block is fetched
    // (empty_kept() makes it a leaf again, so that between passes the module's parameters are
    // leaves, as a state dict loaded with assign=True requires).
    torch::Tensor& used = block.params_are_masters ? w : p.param;
    if (!block.params_are_masters) p.param.set_data(w);
    if (takes_gradient) {
      if (edges[i] < 0) edges[i] = static_cast<std::int64_t>(node->add_input_metadata(w));
      torch::autograd::impl::set_gradient_edge(used, {node, static_cast<std::uint32_t>(edges[i])});
    }
    weights.emplace_back(p.name, used);
  }
  return weights;
}

void StreamedModel::Impl::fill_kept(BlockState& block, const ad::BlockView& view) {
  const torch::Device device = compute_device();
  for (std::size_t i = 0; i < block.streamed.size(); ++i) {
    StreamedParam& p = block.streamed[i];
    if (!p.kept) {
      p.kept = c10::Storage(c10::Storage::use_byte_size_t(), 0, c10::DataPtr(nullptr, device), nullptr, false);
    }
    const auto count = static_cast<std::size_t>(p.rows * p.cols);
    if (options.compute_dtype == torch::kBFloat16) {
      p.kept.set_data_ptr_noswap(c10::DataPtr(view.tensors[i].bf16, device));
    } else {
      // The converted copy's memory, taken over by the storage (freed at empty_kept()).
      torch::Tensor converted = torch::from_blob(view.tensors[i].bf16, p.shape,
                                                 torch::TensorOptions().dtype(torch::kBFloat16).device(device))
                                    .to(options.compute_dtype);
      p.kept.set_data_ptr_noswap(converted.storage().unsafeGetStorageImpl()->set_data_ptr(c10::DataPtr(nullptr, device)));
    }
    p.kept.set_nbytes(count * c10::elementSize(options.compute_dtype));
  }
}

void StreamedModel::Impl::empty_kept(BlockState& block) {
  for (StreamedParam& p : block.streamed) {
    if (!p.kept) continue;
    p.kept.set_data_ptr_noswap(c10::DataPtr(nullptr, p.kept.device()));
    p.kept.set_nbytes(0);
    if (block.params_are_masters) continue;
    p.param.set_data(torch::empty({0}, compute));
    if (!p.param.is_leaf()) torch::autograd::impl::set_gradient_edge(p.param, {});
  }
}

void StreamedModel::Impl::begin_kept_backward(std::uint32_t b, std::uint64_t id) {
  TrainingPass& pass = pass_for_backward(b, id);
  // Another pass whose backward waits only for its end (its last block's inputs took no
  // gradient): autograd finished its nodes before it began this one's.
  std::vector<std::uint64_t> ended;
  for (const auto& [other, open] : passes) {
    if (other != id && open.in_backward && open.held && !open.input_nodes[*open.held]) ended.push_back(other);
  }
  try {
    refuse_unsupported_backward(b);
    for (const std::uint64_t other : ended) finish_kept_pass(other, /*backward_over=*/false);
    if (pass.held) release_held(pass);  // a block whose inputs took no gradient, above this one
    enter_backward(id, b);
    follow_caller_stream();
    const ad::BlockView& view = engines.train->acquire(b);
    pass.held = b;
    fill_kept(blocks[b], view);
    // A module's placeholders lead to the pass's node again: autograd refuses a saved one that
    // was not a leaf when saved and is one when unpacked.
    if (!blocks[b].params_are_masters) kept_weights(blocks[b], pass.weight_nodes[b], pass.weight_inputs[b]);
  } catch (...) {
    abandon_passes();
    throw;
  }
  if (!pass.input_nodes[b]) {
    // No node at the block's inputs will run: the pass ends with autograd's backward.
    torch::autograd::Engine::get_default_engine().queue_callback([model = self, id] {
      const std::shared_ptr<StreamedModel::Impl> impl = model.lock();
      if (impl && impl->passes.count(id) != 0 && impl->passes.at(id).in_backward) {
        impl->finish_kept_pass(id, /*backward_over=*/true);
      }
    });
  }
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
  for (const StreamedParam& p : blocks[b].streamed) {
    if (!p.accumulator || exec_info->count(p.accumulator.get()) == 0) continue;
    throw std::logic_error(fmt::format(
        "StreamedModel: a backward with inputs= (or autograd.grad) asks for the gradient of {}'s streamed master "
        "'{}', which the layer gives only to a full backward (loss.backward() without inputs=)",
        blocks[b].block.name, p.name));
  }
}

void StreamedModel::Impl::end_kept_backward(std::uint32_t b, std::uint64_t id) {
  const auto found = passes.find(id);
  if (found == passes.end()) return;  // abandoned: the error that did it is on its way
  TrainingPass& pass = found->second;
  try {
    if (pass.held == b) release_held(pass);
  } catch (...) {
    abandon_passes();
    throw;
  }
  if (pass.end_block && b == *pass.end_block) end_pass_backward(id);
}

void StreamedModel::Impl::kept_weight_gradients(std::uint32_t b, std::uint64_t id, const variable_list& grads) {
  const auto found = passes.find(id);
  if (found == passes.end()) {
    throw std::logic_error(fmt::format(
        "StreamedModel: the gradient of {}'s weights came after its training pass ended (post_backward() closed "
        "it)",
        blocks[b].block.name));
  }
  TrainingPass& pass = found->second;
  std::vector<torch::Tensor> weight_grads(blocks[b].streamed.size());
  for (std::size_t i = 0; i < weight_grads.size(); ++i) {
    const std::int64_t input = pass.weight_inputs[b][i];
    if (input >= 0 && static_cast<std::size_t>(input) < grads.size()) weight_grads[i] = grads[input];
  }
  try {
    std::function<void()> ready;
    if (!fold_weight_gradients(b, weight_grads, ready) || blocks[b].deferred_update) return;
    if (pass.held == b) {
      pass.update_after_release[b] = std::move(ready);
    } else {
      begin_block_update(b, std::move(ready));
    }
  } catch (...) {
    abandon_passes();
    throw;
  }
}

void StreamedModel::Impl::release_held(TrainingPass& pass) {
  const std::uint32_t b = *pass.held;
  pass.held.reset();
  empty_kept(blocks[b]);
  engines.train->release(b);
  if (!pass.update_after_release[b]) return;
  std::function<void()> ready = std::move(*pass.update_after_release[b]);
  pass.update_after_release[b].reset();
  begin_block_update(b, std::move(ready));
}

void StreamedModel::Impl::finish_kept_pass(std::uint64_t id, bool backward_over) {
  TrainingPass& pass = passes.at(id);
  try {
    if (pass.held) release_held(pass);
  } catch (...) {
    abandon_passes();
    throw;
  }
  if (!backward_over) {
    end_pass_backward(id);
    return;
  }
  finish_pass(id);
  take_backward_statistics();
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
  const bool opening = m.opens_pass(block, training);
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
  return impl_->opens_pass(block, /*training=*/true);
}

}  // namespace sp::torch_layer
