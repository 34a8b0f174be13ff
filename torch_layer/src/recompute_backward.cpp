// The recompute backward strategy (backward_strategy.h): each block's forward runs in an
// autograd node of its own, without a graph; the node's backward fetches the block again,
// recomputes its forward on the same random streams and autocast, and differentiates that.
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

#include "backward_strategy.h"
#include "model_ref.h"

namespace sp::torch_layer {

namespace {

class RecomputeBackward final : public BackwardStrategy {
 public:
  explicit RecomputeBackward(StreamedModel::Impl& model) : m(model) {}

  bool recomputes() const override { return true; }
  void prepare(TrainingPass&, std::size_t) const override {}
  std::vector<torch::Tensor> forward(std::uint32_t b, std::uint64_t id, const std::vector<torch::Tensor>& inputs,
                                     bool& reaches) override;
  std::vector<torch::Tensor> recompute_for_checkpoint(std::uint32_t b, std::uint64_t id,
                                                      const std::vector<torch::Tensor>& inputs,
                                                      const BlockCall& call) override;
  void let_go(TrainingPass&) override {}

  // Inside the autograd node's forward: block b of pass `id` on its delivered weights, without a
  // graph (a checkpoint's recompute: by its own call, leaving the pass's state as it was).
  std::vector<torch::Tensor> forward_block(std::uint32_t b, std::uint64_t id, const std::vector<torch::Tensor>& inputs);
  // Recomputes block b's forward on the delivered weights and differentiates it. Returns the
  // gradient of each block input (undefined for those that need none), then one per trainable
  // resident parameter.
  variable_list backward_block(std::uint32_t b, std::uint64_t of_pass, const variable_list& xs,
                               const variable_list& grad_outs);

 private:
  StreamedModel::Impl& m;
  const BlockCall* replay_call_ = nullptr;  // set while recompute_for_checkpoint() computes
};

RecomputeBackward& recompute_of(StreamedModel::Impl& impl) { return static_cast<RecomputeBackward&>(*impl.backward); }

}  // namespace

// In sp::torch_layer, not the anonymous namespace: autograd names the node after its type
// (grad_fn.name(), the profiler, the layer's own messages).
// The autograd node of one streamed block: its forward fetches the block and runs it without
// a graph; its backward fetches it again, recomputes and differentiates (backward_block()).
struct StreamedBlockFunction : public torch::autograd::Function<StreamedBlockFunction> {
  // `anchors`: what the node takes besides the block's inputs (BlockGroup::autograd_inputs), so
  // that autograd routes their gradients.
  static variable_list forward(AutogradContext* ctx, StreamedModel::Impl* impl, std::int64_t block, std::int64_t pass,
                               at::TensorList inputs, at::TensorList anchors) {
    ctx->saved_data["block"] = block;
    ctx->saved_data["pass"] = pass;
    ctx->saved_data["model"] = model_ref(*impl);
    ctx->saved_data["anchors"] = static_cast<std::int64_t>(anchors.size());
    ctx->save_for_backward(inputs.vec());
    variable_list outputs = recompute_of(*impl).forward_block(static_cast<std::uint32_t>(block),
                                                              static_cast<std::uint64_t>(pass), inputs.vec());
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
    variable_list grads = recompute_of(*impl).backward_block(block, pass, inputs, grad_outputs);
    // One gradient per forward argument: impl, block, pass, then each input, then each anchor
    // (the master anchor, last when there is one, gets none: its gradient went to the master).
    variable_list out(3);
    out.insert(out.end(), grads.begin(), grads.end());
    out.resize(3 + inputs.size() + static_cast<std::size_t>(ctx->saved_data["anchors"].toInt()));
    return out;
  }
};

namespace {

std::vector<torch::Tensor> RecomputeBackward::forward(std::uint32_t b, std::uint64_t id,
                                                      const std::vector<torch::Tensor>& inputs, bool& reaches) {
  const auto needs_gradient = [](const torch::Tensor& t) { return t.defined() && t.requires_grad(); };
  // The node exists where the block's inputs need a gradient, or it trains something itself.
  reaches = !m.blocks[b].autograd_inputs.empty() || std::any_of(inputs.begin(), inputs.end(), needs_gradient);
  return StreamedBlockFunction::apply(&m, static_cast<std::int64_t>(b), static_cast<std::int64_t>(id),
                                      at::TensorList(inputs), at::TensorList(m.blocks[b].autograd_inputs));
}

std::vector<torch::Tensor> RecomputeBackward::recompute_for_checkpoint(std::uint32_t b, std::uint64_t id,
                                                                       const std::vector<torch::Tensor>& inputs,
                                                                       const BlockCall& call) {
  // The node is made as in the forward, so that the checkpoint finds the tensors it saved; its
  // graph is dropped, and the pass's own node differentiates the block.
  replay_call_ = &call;
  std::vector<torch::Tensor> out;
  try {
    m.enter_backward(id, b);
    out = StreamedBlockFunction::apply(&m, static_cast<std::int64_t>(b), static_cast<std::int64_t>(id),
                                       at::TensorList(inputs), at::TensorList(m.blocks[b].autograd_inputs));
  } catch (...) {
    // Not a failure of the pass: a checkpoint stops its recompute by throwing from its hook once
    // it has the tensors it needs (torch.utils.checkpoint's early stop), here after the node saved
    // its inputs. Whatever else failed fails the backward, whose pass stays open until the step is
    // aborted.
    replay_call_ = nullptr;
    throw;
  }
  replay_call_ = nullptr;
  return out;
}

std::vector<torch::Tensor> RecomputeBackward::forward_block(std::uint32_t b, std::uint64_t id,
                                                            const std::vector<torch::Tensor>& inputs) {
  TrainingPass& pass = m.passes.at(id);
  return m.with_block_fetched(*m.engines.train, b, /*trainable=*/false, [&] {
    if (replay_call_ == nullptr) {
      pass.states[b] = ForwardState::capture(m.options.device);
      pass.versions[b].clear();
      for (const StreamedParameter& p : m.blocks[b].streamed) pass.versions[b].push_back(p.master._version());
    }
    return (replay_call_ != nullptr ? *replay_call_ : pass.calls[b])(inputs, m.blocks[b].weights);
  });
}

variable_list RecomputeBackward::backward_block(std::uint32_t b, std::uint64_t of_pass, const variable_list& xs,
                                                const variable_list& grad_outs) {
  TrainingPass& pass = m.pass_for_backward(b, of_pass);
  BlockGroup& block = m.blocks[b];
  try {
    m.refuse_unsupported_backward(b);
    m.enter_backward(of_pass, b);
  } catch (...) {
    m.abandon_passes();
    throw;
  }
  // A backward that asks for some tensors' gradients only (autograd.grad, backward(inputs=...)):
  // the streamed weights, which autograd does not see here, take none, as a parameter left out
  // of `inputs` takes none in plain PyTorch.
  const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
  const bool weights_take_gradients = exec_info == nullptr || exec_info->empty();
  variable_list grads;
  std::vector<torch::Tensor> wrt;
  UnlistedInputs unlisted;
  std::vector<std::size_t> input_slots;  // of the inputs that need a gradient, in `wrt`'s order
  try {
    grads = m.with_block_fetched(*m.engines.train, b, weights_take_gradients, [&] {
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
      for (const StreamedParameter& p : block.streamed) {
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
      if (!unlisted.leaves.empty() && m.shards.group()) {
        const torch::Tensor& t = unlisted.leaves.front().tensor;
        throw std::logic_error(fmt::format(
            "StreamedModel: {} reads a tensor that requires a gradient and is none of its parameters ({} of shape "
            "[{}]): with data parallelism its gradient would not be averaged across the ranks. Register it as a "
            "parameter of the block",
            block.block.name, c10::toString(t.scalar_type()), fmt::join(t.sizes(), ", ")));
      }
      for (const UnlistedLeaf& leaf : unlisted.leaves) wrt.push_back(leaf.tensor);
      if (wrt.empty() || ys.empty()) return variable_list(wrt.size());
      return torch::autograd::grad(ys, wrt, gys, /*retain_graph=*/false, /*create_graph=*/false,
                                   /*allow_unused=*/true);
    });
  } catch (...) {
    m.abandon_passes();
    throw;
  }

  std::size_t next = input_slots.size();
  std::function<void()> gradient_ready;
  bool update_now = false;
  if (weights_take_gradients) {
    std::vector<torch::Tensor> weight_grads;
    for (const StreamedParameter& p : block.streamed) {
      weight_grads.push_back(p.param.requires_grad() ? grads[next++] : torch::Tensor());
    }
    update_now = m.fold_weight_gradients(b, weight_grads, gradient_ready);
  }
  variable_list out(xs.size());
  for (std::size_t i = 0; i < input_slots.size(); ++i) out[input_slots[i]] = grads[i];
  for (std::size_t i = 0; i < block.trainable_resident.size(); ++i) {
    torch::Tensor g = grads[next++];
    if (!g.defined() && m.shards.group()) g = torch::zeros_like(block.trainable_resident[i]);
    out.push_back(g);
  }
  // Summed over the pass's blocks, and added to each one's .grad once, at the pass's end.
  for (const UnlistedLeaf& leaf : unlisted.leaves) {
    torch::Tensor g = grads[next++];
    if (!g.defined()) continue;
    m.reducer.add_unlisted(leaf, std::move(g));
  }
  if (m.shards.group()) {
    // Averaged before autograd adds them to the .grad, into tensors of their own (autograd's
    // may alias the upstream gradient, or be expanded views): every rank's resident
    // parameters see the same gradient, whatever the host does next.
    const auto first_resident = out.begin() + static_cast<std::ptrdiff_t>(xs.size());
    std::vector<torch::Tensor> resident(first_resident, out.end());
    try {
      resident = m.reducer.averaged(resident, fmt::format("gradients of {}'s resident parameters", block.block.name));
    } catch (...) {
      m.abandon_passes();
      throw;
    }
    std::copy(resident.begin(), resident.end(), first_resident);
  }
  try {
    if (update_now && !m.blocks[b].update_deferred()) m.begin_block_update(b, std::move(gradient_ready));
  } catch (...) {
    m.abandon_passes();
    throw;
  }
  if (pass.end_block && b == *pass.end_block) m.end_pass_backward(of_pass);
  return out;
}

}  // namespace

std::unique_ptr<BackwardStrategy> make_recompute_backward(StreamedModel::Impl& model) {
  return std::make_unique<RecomputeBackward>(model);
}

}  // namespace sp::torch_layer
