// The kept-activations backward strategy (backward_strategy.h; StreamedModelOptions::recompute
// false): each block computes under autograd on weights whose storage is filled while the block
// is fetched and emptied after; autograd's saved tensors read it. Nodes at the block's outputs
// and inputs fetch it again for its backward and release it after, and one node per block and
// pass takes its weights' gradients.
#include <torch/csrc/autograd/engine.h>

#include "backward_strategy.h"
#include "model_ref.h"

namespace sp::torch_layer {

namespace {

class KeptActivationsBackward final : public BackwardStrategy {
 public:
  explicit KeptActivationsBackward(StreamedModel::Impl& model) : m(model) {}

  bool recomputes() const override { return false; }
  void prepare(TrainingPass& pass, std::size_t blocks) const override {
    pass.kept.weight_nodes.resize(blocks);
    pass.kept.weight_inputs.resize(blocks);
    pass.kept.input_nodes.assign(blocks, false);
    pass.kept.update_after_release.resize(blocks);
  }
  // The block computes under autograd on its delivered weights, between a node at its inputs
  // (the end of its backward) and one at its outputs (the start: the block is fetched again
  // there).
  std::vector<torch::Tensor> forward(std::uint32_t b, std::uint64_t id, const std::vector<torch::Tensor>& inputs,
                                     bool& reaches) override;
  // The backward that reached the block fetched it; the weights take their gradients as in the
  // forward, so that the checkpoint finds the tensors it saved.
  std::vector<torch::Tensor> recompute_for_checkpoint(std::uint32_t b, std::uint64_t id,
                                                      const std::vector<torch::Tensor>& inputs,
                                                      const BlockCall& call) override {
    TrainingPass& pass = m.passes.at(id);
    if (pass.kept.held != b) {
      throw std::logic_error(fmt::format(
          "StreamedModel: {} was recomputed inside a backward that had not reached it (a checkpoint's recompute "
          "runs when the block's backward needs its saved tensors)",
          m.blocks[b].block.name));
    }
    return call(inputs, kept_weights(m.blocks[b], pass.kept.weight_nodes[b], pass.kept.weight_inputs[b]));
  }
  void let_go(TrainingPass& pass) override {
    if (!pass.kept.held) return;
    empty_kept(m.blocks[*pass.kept.held]);
    m.engines.train->release(*pass.kept.held);  // the engine's step ends with no block in use
  }

  // The backward reaches block b of pass `id`: checks, then the block is fetched again.
  void begin_backward(std::uint32_t b, std::uint64_t id);
  // Block b's backward is done (its input node ran): released.
  void end_backward(std::uint32_t b, std::uint64_t id);
  // The weights' node of block b ran.
  void weight_gradients(std::uint32_t b, std::uint64_t id, const variable_list& grads);
  // The pass's backward is over: its last block's input node ran, another pass's backward began
  // after it, or autograd's backward is over (`backward_over`: the statistics are taken now).
  void finish_pass_of(std::uint64_t id, bool backward_over);

 private:
  // The tensors of `tensors` that need a gradient pass through block b's boundary node (at its
  // outputs when `begins`, else at its inputs): whether there was one.
  bool through_boundary(std::vector<torch::Tensor>& tensors, std::uint32_t b, std::uint64_t id, bool begins);
  // The block's weights as this call computes with them: tensors on the `kept` storages, whose
  // gradients reach `node` (as its inputs `edges`) where they need one.
  // `edges` unset (-1) are assigned (the forward); a checkpoint's recompute gives them again.
  NamedParameters kept_weights(BlockGroup& block, const NodePtr& node, std::vector<std::int64_t>& edges);
  // The `kept` storages hold the delivered weights of `view` (converted to the compute dtype
  // when it is not bf16), or nothing. A module's placeholders point at them through
  // kept_weights().
  void fill_kept(BlockGroup& block, const ad::BlockView& view);
  void empty_kept(BlockGroup& block);
  // The held block of pass `pass` is released, and its armed update begins if its gradients came.
  void release_held(TrainingPass& pass);

  StreamedModel::Impl& m;
};

KeptActivationsBackward& kept_of(StreamedModel::Impl& impl) {
  return static_cast<KeptActivationsBackward&>(*impl.backward);
}

}  // namespace

// In sp::torch_layer, not the anonymous namespace: autograd names the node after its type
// (grad_fn.name(), the profiler, the layer's own messages).
// The node at a block's outputs that need a gradient (`begins`), or at its inputs that do.
// Every node of the block leads to the outputs' one and from the inputs' one, so autograd runs
// the first before the block's nodes (the block is fetched again there) and the second after
// them all (the block is released).
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
      kept_of(*impl).begin_backward(block, pass);
    } else {
      kept_of(*impl).end_backward(block, pass);
    }
    variable_list out(4);
    out.insert(out.end(), grads.begin(), grads.end());
    return out;
  }
};

namespace {

// The node the delivered weights of one block in one pass lead to, where they take a gradient;
// it runs once autograd has summed every use's.
struct KeptBlockWeights : public torch::autograd::Node {
  KeptBlockWeights(std::weak_ptr<StreamedModel::Impl> model, std::uint32_t block, std::uint64_t pass)
      : model_(std::move(model)), block_(block), pass_(pass) {}

  variable_list apply(variable_list&& grads) override {
    kept_of(*live_model_for_backward(model_, block_)).weight_gradients(block_, pass_, grads);
    return {};
  }
  std::string name() const override { return "selective_precision::KeptBlockWeights"; }

 private:
  std::weak_ptr<StreamedModel::Impl> model_;
  std::uint32_t block_;
  std::uint64_t pass_;
};

std::vector<torch::Tensor> KeptActivationsBackward::forward(std::uint32_t b, std::uint64_t id,
                                                            const std::vector<torch::Tensor>& inputs, bool& reaches) {
  TrainingPass& pass = m.passes.at(id);
  BlockGroup& block = m.blocks[b];
  pass.versions[b].clear();
  for (StreamedParameter& p : block.streamed) {
    pass.versions[b].push_back(p.master._version());
    if (!p.accumulator && p.master.requires_grad()) p.accumulator = torch::autograd::impl::grad_accumulator(p.master);
  }
  std::vector<torch::Tensor> xs = inputs;
  pass.kept.input_nodes[b] = through_boundary(xs, b, id, /*begins=*/false);
  std::vector<std::int64_t> edges(block.streamed.size(), -1);
  NodePtr node;
  if (std::any_of(block.streamed.begin(), block.streamed.end(), [&](const StreamedParameter& p) {
        return p.master.requires_grad() || m.policy_link.frozen_gradients_wanted();
      })) {
    node = make_node<KeptBlockWeights>(m.self, b, id);
  }
  m.follow_caller_stream();
  const ad::BlockView& view = m.engines.train->acquire(b);
  std::vector<torch::Tensor> out;
  try {
    fill_kept(block, view);
    out = pass.calls[b](xs, kept_weights(block, node, edges));
    // An output that is a view of a weight (a block returning weight.t()) would read the storage
    // after the block lets go of it: it gets memory of its own.
    for (torch::Tensor& y : out) {
      if (!y.defined() || !y.has_storage()) continue;
      const auto aliases = [&](const StreamedParameter& p) { return y.storage().is_alias_of(p.kept); };
      if (std::any_of(block.streamed.begin(), block.streamed.end(), aliases)) y = y.clone();
    }
  } catch (...) {
    empty_kept(block);
    m.engines.train->release(b);
    throw;
  }
  empty_kept(block);
  m.engines.train->release(b);
  pass.kept.weight_nodes[b] = std::move(node);
  pass.kept.weight_inputs[b] = std::move(edges);
  through_boundary(out, b, id, /*begins=*/true);
  reaches =
      std::any_of(out.begin(), out.end(), [](const torch::Tensor& y) { return y.defined() && y.requires_grad(); });
  return out;
}

bool KeptActivationsBackward::through_boundary(std::vector<torch::Tensor>& tensors, std::uint32_t b, std::uint64_t id,
                                               bool begins) {
  std::vector<std::size_t> slots;
  std::vector<torch::Tensor> through;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i].defined() || !tensors[i].requires_grad()) continue;
    slots.push_back(i);
    through.push_back(tensors[i]);
  }
  if (through.empty()) return false;
  through = KeptBlockBoundary::apply(&m, static_cast<std::int64_t>(b), static_cast<std::int64_t>(id), begins,
                                     at::TensorList(through));
  for (std::size_t k = 0; k < slots.size(); ++k) tensors[slots[k]] = std::move(through[k]);
  return true;
}

NamedParameters KeptActivationsBackward::kept_weights(BlockGroup& block, const NodePtr& node,
                                                      std::vector<std::int64_t>& edges) {
  NamedParameters weights;
  for (std::size_t i = 0; i < block.streamed.size(); ++i) {
    StreamedParameter& p = block.streamed[i];
    torch::Tensor w = torch::empty({0}, m.compute).set_(p.kept, 0, p.shape);
    const bool takes_gradient = p.master.requires_grad() || m.policy_link.frozen_gradients_wanted();
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

void KeptActivationsBackward::fill_kept(BlockGroup& block, const ad::BlockView& view) {
  const torch::Device device = m.compute_device();
  for (std::size_t i = 0; i < block.streamed.size(); ++i) {
    StreamedParameter& p = block.streamed[i];
    if (!p.kept) {
      p.kept = c10::Storage(c10::Storage::use_byte_size_t(), 0, c10::DataPtr(nullptr, device), nullptr, false);
    }
    const auto count = static_cast<std::size_t>(p.rows * p.cols);
    if (m.options.compute_dtype == torch::kBFloat16) {
      p.kept.set_data_ptr_noswap(c10::DataPtr(view.tensors[i].bf16, device));
    } else {
      // The converted copy's memory, taken over by the storage (freed at empty_kept()).
      torch::Tensor converted =
          torch::from_blob(view.tensors[i].bf16, p.shape, torch::TensorOptions().dtype(torch::kBFloat16).device(device))
              .to(m.options.compute_dtype);
      p.kept.set_data_ptr_noswap(
          converted.storage().unsafeGetStorageImpl()->set_data_ptr(c10::DataPtr(nullptr, device)));
    }
    p.kept.set_nbytes(count * c10::elementSize(m.options.compute_dtype));
  }
}

void KeptActivationsBackward::empty_kept(BlockGroup& block) {
  for (StreamedParameter& p : block.streamed) {
    if (!p.kept) continue;
    p.kept.set_data_ptr_noswap(c10::DataPtr(nullptr, p.kept.device()));
    p.kept.set_nbytes(0);
    if (block.params_are_masters) continue;
    p.param.set_data(torch::empty({0}, m.compute));
    if (!p.param.is_leaf()) torch::autograd::impl::set_gradient_edge(p.param, {});
  }
}

void KeptActivationsBackward::begin_backward(std::uint32_t b, std::uint64_t id) {
  TrainingPass& pass = m.pass_for_backward(b, id);
  // Another pass whose backward waits only for its end (its last block's inputs took no
  // gradient): autograd finished its nodes before it began this one's.
  std::vector<std::uint64_t> ended;
  for (const std::uint64_t other : m.passes.others_holding(id)) {
    const KeptPassState& kept = m.passes.at(other).kept;
    if (!kept.input_nodes[*kept.held]) ended.push_back(other);
  }
  try {
    m.refuse_unsupported_backward(b);
    for (const std::uint64_t other : ended) finish_pass_of(other, /*backward_over=*/false);
    if (pass.kept.held) release_held(pass);  // a block whose inputs took no gradient, above this one
    m.enter_backward(id, b);
    m.follow_caller_stream();
    const ad::BlockView& view = m.engines.train->acquire(b);
    pass.kept.held = b;
    fill_kept(m.blocks[b], view);
    // A module's placeholders lead to the pass's node again: autograd refuses a saved one that
    // was not a leaf when saved and is one when unpacked.
    if (!m.blocks[b].params_are_masters)
      kept_weights(m.blocks[b], pass.kept.weight_nodes[b], pass.kept.weight_inputs[b]);
  } catch (...) {
    m.abandon_passes();
    throw;
  }
  if (!pass.kept.input_nodes[b]) {
    // No node at the block's inputs will run: the pass ends with autograd's backward.
    torch::autograd::Engine::get_default_engine().queue_callback([model = m.self, id] {
      const std::shared_ptr<StreamedModel::Impl> impl = model.lock();
      if (!impl) return;
      const TrainingPass* pass = impl->passes.find(id);
      if (pass != nullptr && pass->in_backward) kept_of(*impl).finish_pass_of(id, /*backward_over=*/true);
    });
  }
}

void KeptActivationsBackward::end_backward(std::uint32_t b, std::uint64_t id) {
  TrainingPass* found = m.passes.find(id);
  if (found == nullptr) return;  // abandoned: the error that did it is on its way
  TrainingPass& pass = *found;
  try {
    if (pass.kept.held == b) release_held(pass);
  } catch (...) {
    m.abandon_passes();
    throw;
  }
  if (pass.end_block && b == *pass.end_block) m.end_pass_backward(id);
}

void KeptActivationsBackward::weight_gradients(std::uint32_t b, std::uint64_t id, const variable_list& grads) {
  TrainingPass* found = m.passes.find(id);
  if (found == nullptr) {
    throw std::logic_error(fmt::format(
        "StreamedModel: the gradient of {}'s weights came after its training pass ended (post_backward() closed "
        "it)",
        m.blocks[b].block.name));
  }
  TrainingPass& pass = *found;
  std::vector<torch::Tensor> weight_grads(m.blocks[b].streamed.size());
  for (std::size_t i = 0; i < weight_grads.size(); ++i) {
    const std::int64_t input = pass.kept.weight_inputs[b][i];
    if (input >= 0 && static_cast<std::size_t>(input) < grads.size()) weight_grads[i] = grads[input];
  }
  try {
    std::function<void()> ready;
    if (!m.fold_weight_gradients(b, weight_grads, ready) || m.blocks[b].update_deferred()) return;
    if (pass.kept.held == b) {
      pass.kept.update_after_release[b] = std::move(ready);
    } else {
      m.begin_block_update(b, std::move(ready));
    }
  } catch (...) {
    m.abandon_passes();
    throw;
  }
}

void KeptActivationsBackward::release_held(TrainingPass& pass) {
  const std::uint32_t b = *pass.kept.held;
  pass.kept.held.reset();
  empty_kept(m.blocks[b]);
  m.engines.train->release(b);
  if (!pass.kept.update_after_release[b]) return;
  std::function<void()> ready = std::move(*pass.kept.update_after_release[b]);
  pass.kept.update_after_release[b].reset();
  m.begin_block_update(b, std::move(ready));
}

void KeptActivationsBackward::finish_pass_of(std::uint64_t id, bool backward_over) {
  TrainingPass& pass = m.passes.at(id);
  try {
    if (pass.kept.held) release_held(pass);
  } catch (...) {
    m.abandon_passes();
    throw;
  }
  if (!backward_over) {
    m.end_pass_backward(id);
    return;
  }
  m.finish_pass(id);
  m.take_backward_statistics();
}

}  // namespace

std::unique_ptr<BackwardStrategy> make_kept_backward(StreamedModel::Impl& model) {
  return std::make_unique<KeptActivationsBackward>(model);
}

}  // namespace sp::torch_layer
