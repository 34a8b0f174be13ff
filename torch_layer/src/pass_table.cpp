// The pass table: the open training passes and the training engine's steps that serve them.
#include "pass_table.h"

#include <fmt/format.h>

namespace sp::torch_layer {

namespace ad = sp::adapters;

void move_block(ad::StreamingEngine& engine, std::uint32_t block, std::uint32_t at) {
  std::vector<std::uint32_t> order = engine.schedule().options().order;
  order.erase(std::find(order.begin(), order.end(), block));
  order.insert(order.begin() + static_cast<std::ptrdiff_t>(at), block);
  engine.set_block_order(std::move(order));
}

TrainingPass* PassTable::find(std::uint64_t id) {
  const auto found = passes_.find(id);
  return found == passes_.end() ? nullptr : &found->second;
}

bool PassTable::opens_pass(std::uint32_t b) const {
  if (!forwarding_) return true;
  const adapters::StepSchedule& schedule = engine_->schedule();
  const std::uint32_t called = forwarded().next_forward;
  if (called == schedule.options().num_blocks || schedule.uses().front().block == b) return true;
  const auto& latest = forwarded().nodes[schedule.uses()[called - 1].block];
  return latest && latest->expired();
}

std::size_t PassTable::awaiting_backward() const {
  return static_cast<std::size_t>(
      std::count_if(passes_.begin(), passes_.end(), [](const auto& open) { return !open.second.backward_ran; }));
}

bool PassTable::backward_under_way() const {
  return std::any_of(passes_.begin(), passes_.end(), [](const auto& open) { return open.second.in_backward; });
}

std::optional<std::uint64_t> PassTable::called_with(std::uint32_t b, const c10::TensorImpl* first,
                                                    std::size_t blocks) const {
  std::optional<std::uint64_t> id;
  for (const auto& [open, pass] : passes_) {
    if (pass.next_forward == blocks && pass.first_inputs[b].is(first) && pass.graph_alive()) id = open;
  }
  return id;
}

std::vector<std::uint64_t> PassTable::others_holding(std::uint64_t id) const {
  std::vector<std::uint64_t> others;
  for (const auto& [other, open] : passes_) {
    if (other != id && open.in_backward && open.kept.held) others.push_back(other);
  }
  return others;
}

void PassTable::for_each(const std::function<void(TrainingPass&)>& visit) {
  for (auto& [id, pass] : passes_) visit(pass);
}

std::uint64_t PassTable::open(std::size_t blocks) {
  const std::uint64_t id = ++last_id_;
  TrainingPass& opened = passes_[id];
  opened.calls.resize(blocks);
  opened.states.resize(blocks);
  opened.versions.resize(blocks);
  opened.nodes.resize(blocks);
  opened.first_inputs.assign(blocks, TensorIdentity());
  forwarding_ = id;
  return id;
}

void PassTable::begin_engine_step(std::uint64_t id, std::uint32_t at) {
  engine_->begin_step(engine_steps_++, {}, at);
  engine_pass_ = id;
}

void PassTable::follow_call(std::uint64_t id, std::uint32_t b, const std::string& name, std::uint32_t at,
                            bool opening) {
  const bool moves = engine_->schedule().uses()[at].block != b;
  if (!opening && !moves) return;
  release_engine();  // another pass's forward, the fetches ahead of a finished one, or of another block
  if (moves) {
    log_->debug("StreamedModel: training passes call {} at position {}: the prefetch follows", name, at);
    move_block(*engine_, b, at);
  }
  begin_engine_step(id, at);
}

void PassTable::enter_backward(std::uint64_t id, std::uint32_t b, std::uint32_t first_backward_use) {
  TrainingPass& pass = passes_.at(id);
  const std::uint32_t use = engine_->schedule().backward_use(b);
  if (pass.in_backward) {
    // A backward that skipped the blocks between (their outputs reached no loss), or that runs
    // in another order than the schedule's (the pass's forward called the blocks in another
    // order than the one the schedule follows now), resumes the engine at this block's use; the
    // same block again (a checkpoint's recompute) is served again.
    if (use != pass.next_backward_use && use + 1 != pass.next_backward_use) {
      release_engine();
      begin_engine_step(id, use);
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
  if (engine_pass_ != id || use != first_backward_use) {
    release_engine();
    begin_engine_step(id, use);
  }
  if (forwarding_ == id) forwarding_.reset();
  pass.in_backward = true;
  pass.next_backward_use = use + 1;
}

void PassTable::release_engine() {
  if (!engine_pass_) return;
  const ad::StepTransferMetrics m = engine_->end_step();
  TrainingPass* served = find(*engine_pass_);
  engine_pass_.reset();
  // Prefetches after a pass ended (into its backward's turn) count to the step.
  if (served == nullptr) {
    step_.add_training_transfer(m);
  } else {
    add_transfer(served->transfer, m);
  }
}

void PassTable::finish(std::uint64_t id) {
  release_engine();
  TrainingPass& pass = passes_.at(id);
  step_.add_training_transfer(pass.transfer);
  pass.transfer = ad::StepTransferMetrics{};
  if (!pass.backward_ran) step_.count_training_pass();
  pass.backward_ran = true;
  pass.in_backward = false;
}

void PassTable::close(std::uint64_t id) {
  if (engine_pass_ == id) release_engine();
  const TrainingPass& pass = passes_.at(id);
  if (!pass.backward_ran) {
    log_->debug("StreamedModel: a training pass ended without a backward");
    // A grad-mode forward without a backward (an evaluation that left grad mode on, under
    // model.eval() say) trained nothing: its bytes are an evaluation's.
    evaluation_.count(pass.transfer.h2d_bytes.total(), step_);
  }
  passes_.erase(id);
  if (forwarding_ == id) forwarding_.reset();
}

void PassTable::close_dropped_graphs() {
  std::vector<std::uint64_t> dropped;
  for (const auto& [id, open] : passes_) {
    if (!open.graph_alive()) dropped.push_back(id);
  }
  for (const std::uint64_t id : dropped) close(id);
}

void PassTable::close_all() {
  while (!passes_.empty()) close(passes_.begin()->first);
}

void PassTable::drop(std::uint64_t id) {
  if (engine_pass_ == id) release_engine();
  passes_.erase(id);
  if (forwarding_ == id) forwarding_.reset();
}

void PassTable::abandon() {
  const bool engine_step_open = engine_pass_.has_value();
  engine_pass_.reset();
  passes_.clear();
  forwarding_.reset();
  if (engine_step_open) engine_->end_step();
}

}  // namespace sp::torch_layer
