// The LibTorch layer's insides, shared by its translation units:
// - streamed_model.cpp: the layer's construction and the public accessors;
// - block_group.{h,cpp}: one block and its streamed parameters: adoption, attach and detach,
//   the freshness of its images;
// - block_passes.cpp: a call of a block: the evaluation and training forwards, and what the
//   two backward strategies share; pass_table.{h,cpp}: the open training passes and their ends;
// - backward_strategy.h: how a pass is differentiated, recompute_backward.cpp (the recompute)
//   or kept_backward.cpp (kept activations);
// - gradient_reducer.h, gradient_reduction.cpp: the masters' gradients, and a pass's end;
// - overlapped_updater.{h,cpp}: the update during the backward;
// - layer_state.cpp: sharding, state and calibration;
// - step_driver.cpp: the step and the policy's hooks; step_state.h: the step's state and report;
// - policy_link.{h,cpp}: the plugin's session and units; shard_plan.h: who owns which block;
// - evaluation_session.h: the forward-only passes and their bytes; route_comparison.cpp: the
//   forward-only measurement of an allocation.
// Not installed: the public face is sp/torch_layer/streamed_model.h.
#pragma once

#include "sp/torch_layer/streamed_model.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <cmath>
#include <functional>
#include <future>
#include <limits>
#include <mutex>
#include <tuple>
#include <unordered_map>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "sp/adapters/host_backend.h"
#include "sp/adapters/streaming_engine.h"
#include "sp/kernels/moments.h"
#include "sp/kernels/relative_error.h"
#include "sp/precision_abi.h"
#include "backward_strategy.h"
#include "block_group.h"
#include "evaluation_session.h"
#include "forward_state.h"
#include "gradient_reducer.h"
#include "sp/torch_layer/intra_op_pool.h"
#include "overlapped_updater.h"
#include "pass_table.h"
#include "policy_link.h"
#include "serial_worker.h"
#include "shard_plan.h"
#include "step_state.h"
#include "unlisted_leaves.h"
#include "build_config.h"
#if SP_TORCH_LAYER_HAVE_CUDA
#include "sp/adapters/cuda_backend.h"
#endif

namespace sp::torch_layer {
namespace ad = sp::adapters;
namespace kn = sp::kernels;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Clock = std::chrono::steady_clock;

inline std::unique_ptr<ad::TransferBackend> make_backend(const StreamedModelOptions& options) {
  if (options.device.is_cpu()) {
    ad::HostBackendOptions host;
    host.bandwidth_cap_bytes_per_second = options.host_bandwidth_cap_gbps * 1e9;
    return std::make_unique<ad::HostBackend>(host);
  }
#if SP_TORCH_LAYER_HAVE_CUDA
  if (options.device.is_cuda()) {
    if (!ad::CudaBackend::device_available()) {
      throw std::invalid_argument("StreamedModelOptions::device is CUDA, but no CUDA device is visible");
    }
    ad::CudaBackendOptions cuda;
    cuda.device = options.device.has_index() ? options.device.index() : 0;
    // LibTorch computes on its current stream, the legacy default stream unless the host set
    // another; the engine orders its copies against that one.
    cuda.compute_stream = cudaStreamLegacy;
    return std::make_unique<ad::CudaBackend>(cuda);
  }
#endif
  throw std::invalid_argument(fmt::format(
      "StreamedModelOptions::device is {}, but this build streams to the CPU{} only", options.device.str(),
#if SP_TORCH_LAYER_HAVE_CUDA
      " and CUDA"
#else
      ""
#endif
      ));
}

// The engines (issue 51): the transfer backend, the training engine (a training pass's forward
// and backward), the evaluation engine (forward-only passes), and the event the compute queue
// records before the host reads the gradients staged there. Declared in the order they are
// built: the backend outlives the engines that copy through it.
struct Engines {
  std::unique_ptr<ad::TransferBackend> backend;
  std::unique_ptr<ad::StreamingEngine> train;
  std::unique_ptr<ad::StreamingEngine> eval;
  std::unique_ptr<ad::Event> compute_done;
};

struct StreamedModel::Impl {
  StreamedModelOptions options;
  std::shared_ptr<spdlog::logger> log;
  torch::TensorOptions compute;
  std::vector<BlockGroup> blocks;
  std::uint32_t num_units() const { return policy_link.num_units(); }
  bool units_are_blocks() const { return policy_link.units_are_blocks(); }
  Engines engines;  // after the blocks: their events go while the backend is there
  // The policy's units (StreamedModelOptions::units), its session, and what it reads.
  PolicyLink policy_link;
  // The ranks' group (null: one process), and who owns which unit's masters. After the units.
  ShardPlan shards;
  // The masters' gradients on their way to .grad, and the averages across ranks.
  GradientReducer reducer;

  // The forward-only passes on eval_engine, a measurement's pins, and their bytes.
  EvaluationSession evaluation;
  std::weak_ptr<Impl> self;  // what the layer's autograd nodes hold of it (model_ref.h)

  StepState step_state;      // where the step is, what its passes did, its report
  // The step's open training passes, by id. The training engine serves one pass at a time: a
  // pass's forward and backward share one engine step, unless another pass came between, when
  // the backward gets one of its own (begun at the schedule's first backward use).
  PassTable passes{step_state, evaluation};
  // How the passes are differentiated: the recompute, or kept activations
  // (StreamedModelOptions::recompute as resolved at construction).
  std::unique_ptr<BackwardStrategy> backward;
  torch::Tensor last_input;  // first-block input of the latest training pass, for re-calibration

  Impl(std::vector<Block> in, StreamedModelOptions opts);

  // The images were built from every block's masters as they are now.
  void note_image_versions() {
    for (std::uint32_t b = 0; b < blocks.size(); ++b) blocks[b].note_image_versions(shards.owns(b));
  }

  // Masters changed since their images were built, by anyone (an optimizer step, a hand-written
  // update, a state dict loaded, an edit in place): their images are rebuilt here, at the pass's
  // first fetch. Sharded, the ranks share each image at collective points only: refused.
  void rebuild_changed_images(const std::string& call);

  // The version counters of every trainable parameter of the blocks, in a fixed order.
  std::vector<std::int64_t> trainable_versions() const;

  // The statistics the policy takes from the step's gradients (StepState::keep_statistics).
  void take_backward_statistics();

  ~Impl();

  bool recomputes() const { return backward->recomputes(); }
  // The compute device with its index (a CUDA device without one is device 0, as the backend's).
  torch::Device compute_device() const {
    return options.device.is_cuda() && !options.device.has_index() ? torch::Device(torch::kCUDA, 0) : options.device;
  }

  // A parameter in two blocks would get a master per block (streamed), or be listed, reduced and
  // stepped once per block (resident): refused, naming both places.
  static void refuse_shared_parameters(const std::vector<Block>& in);

  void build_engines();

  void build_policy();
  // Hints that stand before any step (a plugin's initial hints) route the engines, and their
  // images go out to the ranks.
  void route_first_hints() {
    route_by_hints();
    share_images(/*all=*/false);
  }

  // ---- data parallelism ----------------------------------------------------------------------

  torch::Device gradient_reduction_device() const { return reducer.reduction_device(options.device); }

  // ---- sharded data parallelism ------------------------------------------------------------

  // The policy's units from StreamedModelOptions::units, checked against the blocks.
  void assign_units(const std::vector<Block>& in);
  void require_units_are_blocks(const char* call) const;

  // Every rank starts from the owners' weights, whatever its host initialized, and keeps only
  // the masters of its own blocks. The module's parameters were freed at adoption already.
  void shard_masters();

  // Block b's image on `precision` from its owner into `target` on every other rank (each
  // rank's engine of the same role: the training engines, or the evaluation engines).
  void share_image(ad::StreamingEngine& target, std::uint32_t b, Precision precision);

  // After the owners rebuilt their images (end_step, refresh_images, restore_state), or at a
  // step's start: every block whose image changed since the ranks last shared it goes out
  // again, in the route it takes next. Which ones is decided alike on every rank: all blocks
  // when `all`, else those `rebuilt` names (empty: none) and those whose route moved.
  void share_images(bool all, const std::vector<bool>& rebuilt = {});

  // Sharded: the evaluation engines' images of each block on its route in `routes` (the pinned passes
  // of calibration and of route measurements).
  void share_eval_images(const std::vector<Precision>& routes);

  // A block's evaluation image after its masters changed: rebuilt by its owner, copied from the
  // training engine's (which the owner sent) elsewhere.
  void refresh_eval_image(std::uint32_t b);

  // The moments of the blocks this rank owns, added across ranks: the other ranks give zeros,
  // so every rank ends with the owner's numbers exactly.
  void gather_moments(std::vector<sp_grad_moments_v1>& moments);

  // StreamedModel::restore_state() on this rank: everything checked before anything changes.
  void restore_state(const std::map<std::string, torch::Tensor>& state);

  // ---- a block's call: attach and detach ----------------------------------------------------

  // Every block's parameters are as the layer wrapped them (BlockGroup::check_parameters_unchanged).
  void check_parameters_unchanged() const {
    for (std::uint32_t b = 0; b < blocks.size(); ++b) blocks[b].check_parameters_unchanged(shards.owns(b));
  }

  // What run() returns, with block b fetched from `engine` and its weights attached
  // (`trainable`: they take gradients, BlockGroup::attach); the block is detached and released
  // after, and when run() throws.
  template <typename Run>
  auto with_block_fetched(ad::StreamingEngine& engine, std::uint32_t b, bool trainable, Run&& run) {
    follow_caller_stream();
    const ad::BlockView& view = engine.acquire(b);
    const auto let_go = [&] {
      blocks[b].detach(compute);
      engine.release(b);
    };
    auto out = [&] {
      try {
        blocks[b].attach(view, options.device, options.compute_dtype, trainable, policy_link.frozen_gradients_wanted());
        return run();
      } catch (...) {
        let_go();
        throw;
      }
    }();
    let_go();
    return out;
  }

  // ---- passes --------------------------------------------------------------------------------

  // The plugin's step ends too, marked as failed (a NaN loss), so that its hooks stay paired.
  void end_plugin_step_as_failed();

  // A pass whose backward began and has not reached its end block, outside autograd's backward,
  // stopped (an error, or a gradient asked above its end): it is abandoned, with a warning;
  // inside one, `call` is refused.
  void end_stopped_backwards(const char* call);
  // The passes whose backward never ran (their graphs were dropped, or they were evaluations in
  // grad mode) end here, their bytes an evaluation's; one whose backward stopped before its end
  // is refused.
  void close_passes_without_backward(const char* why);

  // ---- evaluation passes: the evaluation engine, forward only, one block at a time ----------

  // With none open (evaluation.end_pass() first): the images of masters changed since are
  // refreshed first.
  void begin_eval_pass(const ad::RuntimeLimitHints& limits);

  // Block b's turn in the open evaluation pass: run(weights) computes it on its delivered
  // weights. The block is released, and the pass ended, even when run() throws.
  template <typename Run>
  auto eval_block(std::uint32_t b, Run&& run) {
    try {
      auto out = with_block_fetched(*engines.eval, b, /*trainable=*/false, [&] { return run(blocks[b].weights); });
      evaluation.block_called();
      return out;
    } catch (...) {
      evaluation.end_pass();
      throw;
    }
  }

  // A whole calibration pass under `limits`; run(b) computes block b on its attached weights.
  void calibration_pass(const ad::RuntimeLimitHints& limits, const std::function<void(std::uint32_t)>& run);

  void refuse_training_while_measuring(std::uint32_t b) const {
    if (!evaluation.measuring()) return;
    throw std::logic_error(fmt::format(
        "StreamedModel::compare_routes: the closure called {} in grad mode; the measurement is forward only (it "
        "runs the closure under no_grad: do not enable grad inside it)",
        blocks[b].block.name));
  }
  // StreamedModel::compare_routes, both forms (route_comparison.cpp): the arguments named in
  // its errors as the caller named them.
  std::vector<RouteComparison> compare_routes(const StreamedModel::MeasureClosure& closure, std::size_t batches,
                                              const std::vector<std::vector<Precision>>& candidates,
                                              const std::vector<Precision>& reference, double confidence,
                                              const char* candidate_name, const char* reference_name);

  // A no-grad call of block b: it opens an evaluation pass (`opening`, from
  // EvaluationSession::opens_pass()), or
  // continues the open one; the pass's last block ends it.
  std::vector<torch::Tensor> eval_forward(std::uint32_t b, const std::vector<torch::Tensor>& inputs,
                                          const BlockCall& call, bool opening);

  // ---- the order the passes call the blocks in ---------------------------------------------
  // A pass may call the blocks in any order, each once; each engine's schedule follows the
  // order its passes last called them in (the blocks' ids until one calls them otherwise), as
  // FSDP2's prefetch follows the order it observed. A call out of the schedule's order moves the
  // block there and begins an engine step at it: the fetches issued ahead for the other block
  // go unused, once.

  // Whether a call opens a pass is PassTable::opens_pass (grad mode) or
  // EvaluationSession::opens_pass; a block called twice in one is refused by refuse_second_call
  // (pass_table.h). `block_name()` names a block there.
  auto block_name() const {
    return [this](std::uint32_t b) -> const std::string& { return blocks[b].block.name; };
  }
  // On CUDA, the engine's compute queue becomes the caller's current stream: called before each
  // block's fetch, so that the layer orders its copies around the kernels the caller launches.
  void follow_caller_stream();

  // ---- training passes: their forward and what both backward strategies share -----------

  // A grad-mode call of block b, inside a step: it opens a training pass (`opening`, from
  // PassTable::opens_pass()), or continues the one under way.
  std::vector<torch::Tensor> train_forward(std::uint32_t b, const std::vector<torch::Tensor>& inputs, BlockCall call,
                                           bool opening);

  // A grad-mode call of block b inside a backward: the host's checkpointing (torch.utils.checkpoint
  // without reentrance, Hugging Face's gradient checkpointing) recomputing the block before its
  // backward, for the pass whose forward gave the block these inputs. It computes as the forward
  // did, on the same fetch as the backward that follows (the engine serves a use twice), and
  // leaves the pass's state as it was.
  std::vector<torch::Tensor> checkpoint_recompute(std::uint32_t b, const std::vector<torch::Tensor>& inputs,
                                                  const BlockCall& call);

  // The pass whose backward reached block b, once checked: it exists, its forward called every
  // block, and the block's masters are as its forward used them. Refused by name otherwise.
  TrainingPass& pass_for_backward(std::uint32_t b, std::uint64_t of_pass);
  // A backward the layer cannot serve right reaching block b, refused by name: create_graph, or
  // inputs= naming one of its masters.
  void refuse_unsupported_backward(std::uint32_t b) const;
  // The engine serves pass `id`'s backward from block b on (PassTable::enter_backward()).
  void enter_backward(std::uint64_t id, std::uint32_t b) {
    passes.enter_backward(id, b, static_cast<std::uint32_t>(blocks.size()));
  }
  // The pass's backward reached its last block: the pass ends, and the statistics are taken when
  // autograd's backward is over.
  void end_pass_backward(std::uint64_t id);

  // Block b's streamed weights' gradients of one pass (`grads`: per streamed parameter in order,
  // undefined where none came): a frozen one's into signal_grad, a trainable one's on its way to
  // its master's .grad (staged, or in a reducing bucket). Returns whether the armed update of
  // the block begins once the block is released, with what it waits for first in `ready`.
  bool fold_weight_gradients(std::uint32_t b, const std::vector<torch::Tensor>& grads, std::function<void()>& ready);

  // Begins block b's armed update (OverlappedUpdater::begin), once `gradient_ready` made its
  // gradient final on the host.
  void begin_block_update(std::uint32_t b, std::function<void()> gradient_ready) {
    updater.begin(*engines.train, blocks[b], b, std::move(gradient_ready));
  }

  // Waits for the updates begun in the backward and installs their images. Every update is
  // waited for before the first error is rethrown.
  void wait_for_updates();

  // The fused update of one block now, for the route in force (update_masters(), and the armed
  // blocks the backward did not reach), skipping a non-finite gradient when `skip_nonfinite`.
  void update_block(std::uint32_t b, const kn::AdamWStep& adam, const std::map<std::string, MasterMoments>& moments,
                    bool skip_nonfinite);

  // Passes cut short (an exception in a backward, or a step aborted): the collectives in flight
  // are waited for and dropped, the engine's step ends, every open pass is dropped, and the
  // model takes new passes. Gradients already folded into the masters stay: the host discards
  // the step's.
  void abandon_passes() noexcept;

  // The pass's backward ran (PassTable::finish()): the reductions in flight are waited for, the
  // staged gradients reach the masters' .grad, and the deferred updates begin.
  void finish_pass(std::uint64_t id);

  // Every rank's plugin hints must be the same: the blocks where they differ, by name.
  void check_ranks_agree(const std::vector<std::int32_t>& values, const std::string& what);

  // ---- policy --------------------------------------------------------------------------------

  // The engines route each block by its unit's hint in force (the policy session's hints(), the
  // one copy of the hints), BF16 everywhere before the first.
  void route_by_hints();

  std::vector<sp_grad_moments_v1> block_moments();

  // The signal table of policy v3 (docs/policy.md, "The signal table"), when the plugin reads
  // one (PolicyLink::signals_wanted(): a budget, and ABI 1.4's reads_step_signals), else
  // nullopt: per block whose masters have gradients (a frozen master's: signal_grad) and per
  // quantized tier t, with d = the tier's image - the master and g the step's gradient,
  //   first_order.t  = sum g*d,  second_order.t = B/2 * sum g^2*d^2 (B: StepState::examples()),
  //   loss_cost.t    = second_order.t + first_order.t - the mean first_order.t over the blocks
  // (the recommendation of docs/signals.md). Other blocks' values are NaN (not measured).
  std::optional<sp::host::UnitSignalTable> measure_unit_signals();

  // StreamedModelOptions::transfer_policy, as the gate of both engines.
  void apply_transfer_policy(const std::filesystem::path& file);

  std::vector<Precision> current_routes() const;

  // ---- calibration ---------------------------------------------------------------------------

  // Every block of the evaluation engine on one route for a whole pass: a runtime pin, which
  // neither the plugin's hints nor a transfer gate override, since the errors describe the
  // formats, not what pays on this machine.
  ad::RuntimeLimitHints pinned_to(Precision precision) const {
    ad::RuntimeLimitHints limits;
    for (std::uint32_t b = 0; b < blocks.size(); ++b) limits.block_precision_map[b] = precision;
    return limits;
  }

  CalibrationErrors measure_calibration_errors(const std::vector<torch::Tensor>& samples);

  bool set_calibration_errors(CalibrationErrors& errors);

  // update_masters_during_backward()'s updates. Last: its worker is destroyed first, after its
  // tasks (which read the blocks) ran.
  OverlappedUpdater updater;
};

}  // namespace sp::torch_layer
