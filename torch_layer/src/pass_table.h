// The pass table (issue 51): the step's open training passes, by id, and the training engine's
// steps that serve them. Every change of a pass's state is a method here: a pass opens, follows
// its calls, enters its backward, and ends. It ends in one of four ways, each reached from
// these places (docs/architecture.md, "Inside the LibTorch layer"):
//   - finish(): its backward reached its end block (the recompute's last node, or the kept
//     activations' input node there), its backward was over without that node, or another
//     pass's backward began after it (kept activations);
//   - close(): its graph was dropped before a next pass opened, or the step went on to
//     post_backward(); if its backward never ran, its bytes are an evaluation's;
//   - drop(): a call of its forward failed;
//   - abandon(): an error in a backward, a backward that stopped before its end, a failed end,
//     or abort_step(). What the backward strategy and the gradients hold goes first
//     (StreamedModel::Impl::abandon_passes()).
// The table does not fetch, compute or reduce: the training engine's steps are its only effect.
// Not installed: the layer's insides (streamed_model_impl.h holds one).
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <spdlog/logger.h>
#include <torch/torch.h>

#include "sp/adapters/streaming_engine.h"
#include "sp/torch_layer/streamed_model.h"
#include "autograd_nodes.h"
#include "evaluation_session.h"
#include "forward_state.h"
#include "step_state.h"

namespace sp::torch_layer {

// The first defined tensor of a block's inputs, by identity (null: none).
inline const c10::TensorImpl* first_defined(const std::vector<torch::Tensor>& inputs) {
  for (const torch::Tensor& x : inputs) {
    if (x.defined()) return x.unsafeGetTensorImpl();
  }
  return nullptr;
}

// A tensor's identity held weakly. The weak reference keeps the TensorImpl's memory from being
// reused after the tensor dies, so no later tensor can take its address and pass for it.
class TensorIdentity {
 public:
  TensorIdentity() = default;
  explicit TensorIdentity(const std::vector<torch::Tensor>& inputs) {
    for (const torch::Tensor& x : inputs) {
      if (x.defined()) {
        held.emplace(x.getIntrusivePtr());
        return;
      }
    }
  }
  // Whether `impl` is the very tensor this one names (null matches none held).
  bool is(const c10::TensorImpl* impl) const {
    if (!held) return impl == nullptr;
    return !held->expired() && held->_unsafe_get_target() == impl;
  }

 private:
  std::optional<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>> held;
};

// What a pass that keeps its activations (StreamedModelOptions::recompute false) holds for its
// backward (kept_backward.cpp): per block, the node the weights' gradients reach (null: no
// weight takes one) and each streamed weight's input of it (-1: none), whether a node at the
// block's inputs ends its backward (else the pass's end does), and the block whose fetch the
// backward holds. An armed update waits for both the weights' gradients and the block's
// release: one that came while the block was held waits in `update_after_release`.
struct KeptPassState {
  std::vector<NodePtr> weight_nodes;
  std::vector<std::vector<std::int64_t>> weight_inputs;
  std::vector<bool> input_nodes;
  std::vector<std::optional<std::function<void()>>> update_after_release;
  std::optional<std::uint32_t> held;
};

// A training pass: a grad-mode forward through the blocks, then its backward. Several may be
// open in a step (two forwards before their backwards, as a contrastive loss runs them): each
// keeps what its backward needs, per block.
struct TrainingPass {
  // How many blocks its forward called: the training engine's schedule's first ones, which it
  // follows (PassTable::follow_call()).
  std::uint32_t next_forward = 0;
  // The lowest block whose autograd node runs (whose inputs need a gradient, or which trains
  // something itself): its backward ends the pass. Unset while no block of the pass has one.
  std::optional<std::uint32_t> end_block;
  bool in_backward = false;
  // A backward of it finished. The pass stays while its graph lives, for another backward
  // through the graph (retain_graph=True, or a second loss over the same forward), until the
  // step's post_backward() or the first pass after the graph was dropped.
  bool backward_ran = false;
  std::vector<BlockCall> calls;                     // the forward's call of each block
  std::vector<std::optional<ForwardState>> states;  // its random streams and autocast (forward_state.h)
  // The blocks' masters' version counters at the forward: changed before the backward, it would
  // differentiate other weights than the forward computed with.
  std::vector<std::vector<std::int64_t>> versions;
  adapters::StepTransferMetrics transfer;  // its fetches, over the engine steps that served them
  // Per block: its forward's autograd node, held weakly (the host's graph keeps the pass alive:
  // once it is dropped, the pass is closed), and its first tensor input, which a checkpoint's
  // recompute gives again. A backward frees the graph's saved inputs while its nodes live on
  // (the host still holds the loss), so the input is held weakly, never by address alone.
  std::vector<std::optional<WeakNodePtr>> nodes;
  std::vector<TensorIdentity> first_inputs;
  std::uint32_t next_backward_use = 0;  // the engine's schedule use after the last block the backward reached
  KeptPassState kept;                   // kept activations only

  bool graph_alive() const {
    return std::any_of(nodes.begin(), nodes.end(), [](const auto& node) { return node && !node->expired(); });
  }
};

// Between the engine's steps (a training or an evaluation engine's): its order with `block`
// moved to position `at`, the others keeping theirs relative to each other. The pass's calls so
// far are the order's first `at` blocks, so `block` lies after them.
void move_block(adapters::StreamingEngine& engine, std::uint32_t block, std::uint32_t at);

// Throws std::logic_error when a pass (a `pass_kind`) that has called `called` blocks, the
// first ones of `schedule`, called block b already: each pass calls a block once. `name(i)`
// names block i.
template <class Name>
void refuse_second_call(std::uint32_t b, const adapters::StepSchedule& schedule, std::uint32_t called,
                        const char* pass_kind, Name&& name) {
  if (schedule.forward_use(b) >= called) return;
  throw std::logic_error(fmt::format(
      "StreamedModel: {} was called twice in one {}, before {} was called: a pass calls every streamed block once, "
      "in any order (a block applied twice, as a layer shared across depth is, cannot stream)",
      name(b), pass_kind, name(schedule.uses()[called].block)));
}

class PassTable {
 public:
  // `step` and `evaluation` outlive the table (StreamedModel::Impl declares them first).
  PassTable(StepState& step, EvaluationSession& evaluation) : step_(step), evaluation_(evaluation) {}
  // The training engine the passes are fetched by, and the layer's logger; both outlive the table.
  void use_engine(adapters::StreamingEngine& engine, spdlog::logger& log) {
    engine_ = &engine;
    log_ = &log;
  }

  // ---- what is open ------------------------------------------------------------------------

  bool empty() const { return passes_.empty(); }
  TrainingPass* find(std::uint64_t id);
  TrainingPass& at(std::uint64_t id) { return passes_.at(id); }
  // The pass whose forward is under way, if any.
  const std::optional<std::uint64_t>& forwarding() const { return forwarding_; }
  const TrainingPass& forwarded() const { return passes_.at(*forwarding_); }
  // Whether the engine's open step serves the pass whose forward is under way.
  bool engine_serves_forward() const { return engine_pass_ == forwarding_; }
  // Whether a grad-mode call of block b opens a pass: none is under way, the one under way
  // called every block, b is the block the engine's schedule begins with, or the one under way
  // stopped early (the host dropped its latest outputs). One still holding them goes on, so a
  // block called again in it is a block applied twice, refused by name (refuse_second_call).
  bool opens_pass(std::uint32_t b) const;
  // Open passes whose backward never ran.
  std::size_t awaiting_backward() const;
  // Whether a pass's backward began and has not reached its end block.
  bool backward_under_way() const;
  // The pass whose forward called every one of `blocks` blocks, whose graph lives, and which
  // gave block b the tensor `first` (a checkpoint's recompute gives the forward's inputs again).
  std::optional<std::uint64_t> called_with(std::uint32_t b, const c10::TensorImpl* first, std::size_t blocks) const;
  // Every open pass but `id` whose backward began and holds a block (kept activations).
  std::vector<std::uint64_t> others_holding(std::uint64_t id) const;
  void for_each(const std::function<void(TrainingPass&)>& visit);

  // ---- a pass's life -----------------------------------------------------------------------

  // A new pass for `blocks` blocks: its forward is the one under way.
  std::uint64_t open(std::size_t blocks);
  // The training engine serves pass `id`'s call of block `name` (its id b), its `at`-th: from
  // an engine step begun here, at that use, when the schedule has another block there (or
  // `opening`), with the schedule moved to follow.
  void follow_call(std::uint64_t id, std::uint32_t b, const std::string& name, std::uint32_t at, bool opening);
  // The engine serves pass `id`'s backward from block b on (an engine step of its own when
  // another pass came between its forward and this, or the backward skips blocks). A second
  // backward interleaved is refused. `first_backward_use`: the schedule's (the number of
  // blocks), where a backward right after its forward goes on in the same engine step.
  void enter_backward(std::uint64_t id, std::uint32_t b, std::uint32_t first_backward_use);
  // The engine's open step ends, its fetches counted to the pass it served (to the step when
  // that pass is gone).
  void release_engine();

  // ---- the ends ----------------------------------------------------------------------------

  // The pass's backward ran: its fetches go to the step, its first backward counts a training
  // pass. It stays open while its graph lives (another backward through it).
  void finish(std::uint64_t id);
  // The pass leaves the table (its graph was dropped, or the step goes on to post_backward()).
  // One whose backward never ran trained nothing: its fetches are an evaluation's.
  void close(std::uint64_t id);
  void close_dropped_graphs();
  void close_all();
  // A pass one of whose forward's calls failed: its backward could not run.
  void drop(std::uint64_t id);
  // Every pass goes, the engine's step ends with them (its fetches counted nowhere).
  void abandon();

  // ---- state ---------------------------------------------------------------------------------

  // The training engine's steps begun, in this run or the one whose state was restored.
  std::int64_t engine_steps() const { return engine_steps_; }
  void restore_engine_steps(std::int64_t steps) { engine_steps_ = steps; }

 private:
  void begin_engine_step(std::uint64_t id, std::uint32_t at);

  StepState& step_;
  EvaluationSession& evaluation_;
  adapters::StreamingEngine* engine_ = nullptr;
  spdlog::logger* log_ = nullptr;
  std::map<std::uint64_t, TrainingPass> passes_;
  std::uint64_t last_id_ = 0;
  std::optional<std::uint64_t> forwarding_;   // the pass whose forward is under way
  std::optional<std::uint64_t> engine_pass_;  // the pass the engine's open step serves
  std::int64_t engine_steps_ = 0;
};

}  // namespace sp::torch_layer
