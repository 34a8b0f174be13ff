#include "overlapped_updater.h"

#include <algorithm>

#include "block_group.h"

namespace sp::torch_layer {

bool OverlappedUpdater::any_begun() const {
  return armed_ && std::find(armed_->begun.begin(), armed_->begun.end(), true) != armed_->begun.end();
}

void OverlappedUpdater::begin(adapters::StreamingEngine& engine, const BlockGroup& block, std::uint32_t b,
                              std::function<void()> gradient_ready) {
  // Everything that can fail to allocate comes before the engine marks the block busy, and
  // `running_` has room for every block (reserved by arm()), so that the entry is in place
  // before the task that uses it exists.
  Running running;
  running.block = b;
  running.update = std::make_unique<adapters::StreamingEngine::WeightUpdate>();
  running.skipped = std::make_shared<bool>(false);
  *running.update = engine.begin_update(b);
  armed_->begun[b] = true;
  adapters::StreamingEngine::WeightUpdate* update = running.update.get();
  bool* skipped = running.skipped.get();
  const BlockGroup* updated = &block;
  const std::map<std::string, MasterMoments>* moments = &armed_->moments[b];
  const kernels::AdamWStep step = armed_->step;
  running_.push_back(std::move(running));
  try {
    running_.back().done = worker_.submit([=, ready = std::move(gradient_ready)] {
      if (ready) ready();
      if (!updated->gradients_finite()) {
        *skipped = true;
        return;
      }
      update->run(step, updated->fused_update_tensors(*moments));
    });
  } catch (...) {
    engine.finish_update(*update);  // never ran: a cancel
    running_.pop_back();
    throw;
  }
}

void OverlappedUpdater::wait(adapters::StreamingEngine& engine,
                             const std::function<void(std::uint32_t, bool)>& finished) {
  std::exception_ptr first_error;
  for (Running& r : running_) {
    bool ok = true;
    try {
      r.done.get();
    } catch (...) {
      ok = false;
      if (!first_error) first_error = std::current_exception();
    }
    try {
      engine.finish_update(*r.update);
    } catch (...) {
      ok = false;
      if (!first_error) first_error = std::current_exception();
    }
    if (ok) finished(r.block, *r.skipped);
  }
  running_.clear();
  if (first_error) std::rethrow_exception(first_error);
}

}  // namespace sp::torch_layer
