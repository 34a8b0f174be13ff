// The overlapped updater (issue 51): StreamedModel::update_masters_during_backward()'s fused
// AdamW updates, armed before a backward and begun block by block as the backward makes each
// block's gradients final, each sweep on one worker thread while the backward goes on; and the
// waits for them. Not installed: the layer's insides (streamed_model_impl.h holds one, last).
#pragma once

#include <cstdint>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "serial_worker.h"
#include "sp/adapters/streaming_engine.h"
#include "sp/kernels/adamw.h"
#include "sp/torch_layer/streamed_model.h"

namespace sp::torch_layer {

class BlockGroup;

class OverlappedUpdater {
 public:
  // The step's constants and per-block moments while armed, and which blocks' updates began.
  struct Armed {
    kernels::AdamWStep step;
    std::vector<std::map<std::string, MasterMoments>> moments;  // per block
    std::vector<bool> begun;                                    // per block
  };

  // For the backward to come, over `moments.size()` blocks.
  void arm(const kernels::AdamWStep& step, std::vector<std::map<std::string, MasterMoments>> moments) {
    running_.reserve(moments.size());  // begin() then never reallocates while a task runs
    const std::size_t blocks = moments.size();
    armed_ = Armed{step, std::move(moments), std::vector<bool>(blocks, false)};
  }
  bool is_armed() const { return armed_.has_value(); }
  // Armed, and block b's update has not begun: the backward begins it when b's gradients are final.
  bool waits_for(std::uint32_t b) const { return armed_ && !armed_->begun[b]; }
  bool any_begun() const;
  // The armed state, taken (post_backward updates the blocks no backward reached), or dropped.
  std::optional<Armed> disarm() { return std::exchange(armed_, std::nullopt); }

  // Begins block b's armed update: its slab is picked here, in `engine`, and the sweep runs on
  // the worker once `gradient_ready` (if any) has made the gradient final on the host. A block
  // whose gradient holds a non-finite element is left as it was (reported by wait()).
  void begin(adapters::StreamingEngine& engine, const BlockGroup& block, std::uint32_t b,
             std::function<void()> gradient_ready);
  // Waits for every update begun and installs their images; `finished(block, skipped)` for each
  // that completed. Every update is waited for before the first error is rethrown.
  void wait(adapters::StreamingEngine& engine, const std::function<void(std::uint32_t, bool)>& finished);

 private:
  struct Running {
    std::uint32_t block = 0;
    std::unique_ptr<adapters::StreamingEngine::WeightUpdate> update;
    std::shared_ptr<bool> skipped;  // the task found a non-finite gradient
    std::future<void> done;
  };
  std::optional<Armed> armed_;
  std::vector<Running> running_;
  SerialWorker worker_;  // last: destroyed first, after its tasks ran
};

}  // namespace sp::torch_layer
