// The LibTorch layer: streams the blocks of any LibTorch model through Selective Precision.
//
// A host hands over an ordered list of blocks (a torch::nn::Module, or anything that lists its
// named parameters and computes a forward: see Block) and
// says which named parameters of each block stream; the rest stay resident, untouched. The
// layer then
//   - keeps each streamed parameter's fp32 master on the host (master_parameters(): the
//     tensors the optimizer steps; their .grad receives the gradients);
//   - sizes and runs the streaming engine: every forward fetches each block's weights over
//     the route the policy chose (BF16, INT8 or NF4), dequantized into the block's own
//     parameters for the duration of its forward;
//   - plugs into autograd: a plain loss.backward() fetches the blocks again in reverse, as it
//     reaches each, and differentiates them on the activations their forward kept (or
//     recomputes each block first: StreamedModelOptions::recompute); the gradient with respect
//     to the delivered weights lands straight-through in the masters' .grad (accumulated, so
//     micro-batches add up), resident parameters get theirs the usual way;
//   - drives the policy plugin (PolicySession): hooks in order, hints to the engines before
//     the images are rebuilt, hot-swap polling, state for checkpoints, calibration.
//
// The rules of a step (what a host must do; sp-train is one such host):
//   begin_step(step);
//   any number of forward(x) calls: under grad mode each opens a training pass whose
//     backward must run before the next grad-mode forward (gradient accumulation: forward,
//     backward, forward, backward); under torch::NoGradGuard a forward is an evaluation pass
//     that may come at any time;
//   post_backward();          after the last backward: moments to the plugin, its hints to
//                             the engines; returns the moments (e.g. for clipping);
//   optimizer.step();         updates the masters (any torch::optim optimizer, or your own),
//                             or update_masters(): AdamW fused with the image rebuild, or
//                             update_masters_during_backward() before the backward
//   end_step(loss);           rebuilds the transfer images of the updated masters for the
//                             routes just decided, and ends the plugin's step.
// Whoever changes the masters in place (an optimizer, a hand-written update, a state dict loaded,
// an edit), each pass's first fetch notices it by their version counters and rebuilds their
// images (sharded: refused outside begin_step and end_step, where the ranks share them). A change
// between a block's forward and its backward is refused, as PyTorch refuses it for a tensor saved
// for the backward. Writes through `.data` (Python) or Tensor::data() bypass the version counter,
// as they bypass autograd's checks: call refresh_images() after them.
// The policy takes each step's gradient moments when its backward ends (post_backward() sends
// those of the step's latest backward), so a host may clear the gradients before post_backward().
//
// Threads: one thread drives a StreamedModel. Autograd may run the backward of its blocks on
// another thread; the layer is only ever entered by one at a time.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "sp/adapters/metrics.h"
#include "sp/torch_layer/paired_interval.h"
#include "sp/adapters/policy_bridge.h"
#include "sp/adapters/streaming_engine.h"
#include "sp/error.h"
#include "sp/precision.h"
#include "sp/host/policy_session.h"
#include "sp/kernels/adamw.h"
#include "sp/torch_layer/collectives.h"

namespace sp::torch_layer {

// The named parameters of a block, as torch::nn::Module::named_parameters() lists them.
using NamedParameters = std::vector<std::pair<std::string, torch::Tensor>>;

// A block's computation with any number of tensor inputs and outputs, on the streamed weights
// `weights` hands over (by parameter name, on the compute device, valid for the call). Any
// non-tensor arguments are the callable's own: it is called again, with the same inputs, for
// a recompute in the backward (StreamedModelOptions::recompute, or the host's checkpointing).
using BlockCall =
    std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>& inputs, const NamedParameters& weights)>;

// One block of the model, described by callables so that any module system can supply it (a
// torch::nn::Module through make_block(), a Python module through a binding): `parameters`
// lists the block's parameters by name, and the block computes in one of two ways:
//   - `forward`: one tensor in, one out, reading those same parameter tensors, since the layer
//     points the streamed ones at the delivered weights (the module's streamed parameters are
//     then empty placeholders between uses, and the masters are the layer's copies);
//   - `call` (BlockCall): any tensors in and out, reading the streamed weights from `weights`.
//     The layer does not touch the module's parameters: the streamed ones `parameters` lists
//     are the masters themselves (fp32, contiguous, on the CPU; refused otherwise), so the
//     module's parameters, state and optimizer see the real weights.
// The callables keep the module alive.
struct Block {
  std::string name;  // for messages and the plugin; empty: "block<i>"
  std::function<NamedParameters()> parameters;
  std::function<torch::Tensor(const torch::Tensor&)> forward;
  // Names as `parameters` lists them (e.g. "attn.wq.weight"). Every other parameter stays
  // resident.
  std::vector<std::string> streamed;
  // The parameters whose gradients describe the block to the policy (its gradient moments),
  // in this order. Empty: the streamed ones when they train, else every trainable resident
  // one. A LoRA host names the adapters, so that the norms beside them do not dilute the
  // signal.
  std::vector<std::string> moments_from = {};
  BlockCall call = {};  // set: the block computes through it (and `forward` may be empty)
};

// A block from a torch::nn module holder whose forward takes and returns one tensor.
template <typename ModuleHolder>
Block make_block(ModuleHolder module, std::vector<std::string> streamed, std::string name = {}) {
  auto shared = module.ptr();
  return Block{std::move(name),
               [shared] {
                 NamedParameters out;
                 for (const auto& item : shared->named_parameters(/*recurse=*/true))
                   out.emplace_back(item.key(), item.value());
                 return out;
               },
               [shared](const torch::Tensor& x) { return shared->forward(x); }, std::move(streamed)};
}

// A unit of the policy: consecutive blocks that take one route. A host that streams a model's
// layer as several blocks (its attention and its MLP, each a module of its own, called in turn)
// hands the policy one unit per part, or one per layer.
struct PolicyUnit {
  std::string name;         // for the plugin and its telemetry, e.g. "3.mlp"
  std::uint32_t blocks = 1; // how many blocks, from the one after the previous unit's last
};

struct StreamedModelOptions {
  // The policy plugin and its YAML config (the whole document; the plugin reads its section,
  // memory.stagehand.selective_precision). config_source names it in error messages.
  std::filesystem::path plugin_file;
  std::string config_yaml;
  std::string config_source = "<config>";
  // Where the plugin writes its relative output files (telemetry); empty: the working dir.
  std::filesystem::path output_dir;
  std::shared_ptr<spdlog::logger> logger;    // null: spdlog's default logger
  std::string host_name = "sp-torch-layer";  // how the plugin's create() names its host
  // A deadline for the plugin's step hooks (PolicyHostOptions::hook_deadline); 0: none.
  std::chrono::milliseconds plugin_hook_deadline{0};

  // Where and in what dtype the blocks compute. CPU uses the host backend (a bandwidth cap
  // emulates a link); CUDA the CUDA backend, computing on the caller's current stream
  // (c10::cuda::getCurrentCUDAStream() when each block is called, as PyTorch's own ops do):
  // the layer orders its copies and dequantization before, and a slot's reuse after, the
  // kernels launched there.
  torch::Device device = torch::kCPU;
  torch::Dtype compute_dtype = torch::kFloat32;
  double host_bandwidth_cap_gbps = 0.0;  // CPU only; 0: memcpy speed

  // Streaming engine.
  std::uint32_t prefetch_window = 1;
  std::uint32_t spare_slabs = 2;
  std::uint32_t int8_group_size = 0;  // 0: one scale per row; else 32, 64, 128 or 256
  // 32, 64, 128 or 256; 0: the policy section's nf4_group_size, else 64. Stated in both, the two
  // must agree (the constructor refuses them, naming both).
  std::uint32_t nf4_group_size = 0;
  std::string metrics_path;           // JSONL of the training passes' transfers; empty: none
  // sp-bench's transfer policy for this machine (docs/streaming.md): a quantized route is taken
  // only for the block sizes it measured faster than BF16, on the path of the block's weights
  // (trained ones also pay an image rebuild per step). A missing or unusable file is logged
  // and allows no quantized route. Empty: none, the plugin's hints stand.
  std::filesystem::path transfer_policy;

  // Data parallelism (collectives.h): the ranks this model trains on; null: one process.
  std::shared_ptr<Collectives> collectives;
  // Sharded data parallelism, ZeRO-1/2 applied to the host (needs `collectives`; one rank: no
  // effect). Block b belongs to rank owner(b) = b mod N, which alone keeps its fp32 masters,
  // receives its averaged gradient (a reduce, not an all-reduce), computes its moments, runs
  // its update and builds its transfer images; the host keeps the optimizer state of those
  // masters only (master_parameters()). Every rank still streams every block: after each
  // step's update (and whenever a route changes) the owner broadcasts the block's image to the
  // others, which install it as it is. Per rank the masters, their gradients and the
  // optimizer state shrink to about 1/N; the images stay whole. At construction every rank
  // takes the owners' weights, whatever its own module held.
  // Collective in this mode (every rank calls them at the same point): the constructor,
  // begin_step, end_step, refresh_images, calibrate / measure_calibration_errors and
  // restore_state.
  bool shard_masters = false;

  // What a training pass keeps for its backward. false: the activations, as plain autograd keeps
  // them; each block's weights are fetched again when the backward reaches it (before its first
  // node) and released after its last, and no forward runs twice. true: the block's inputs only;
  // the backward recomputes each block's forward under the forward's random streams and
  // autocast, so a block holds its activations only while its backward runs (less memory, a
  // third more compute). Unset: false in one process, true with `collectives`, where the block's
  // backward also averages its resident parameters' gradients across the ranks (false is
  // refused there). A host's own checkpointing of a block (torch.utils.checkpoint without
  // reentrance) works either way: with false the layer adds no recompute of its own.
  std::optional<bool> recompute;

  // Online re-calibration: every this many steps (0: never), end_step() measures the blocks'
  // INT8 and NF4 output errors again, on the first-block input of the step's last training
  // pass, and gives them to the plugin, so its error term follows the weights as they train.
  std::uint32_t recalibrate_every = 0;

  // The policy's units over the blocks, in order, covering each block once. The plugin sees one
  // unit per entry: its bytes, gradient moments and signal table rows are its blocks' summed,
  // its hint routes every one of them, and its index is the plugin's block id (the hints, a
  // static policy's force_*_blocks, the state's hints). Sharded, a unit's blocks share their
  // owner. Empty: each block is a unit, named after it. Units of several blocks take no
  // calibration errors (measured per block): policy v3 decides without them.
  std::vector<PolicyUnit> units;
};

using CalibrationErrors = sp::host::CalibrationErrors;

// What one step moved and decided.
struct StepReport {
  std::int64_t step = 0;
  // Training passes are the grad-mode forwards whose backward ran; a grad-mode forward that no
  // backward followed (an evaluation under model.eval() without no_grad) counts as evaluation.
  PerPrecision<std::uint64_t> h2d_bytes;  // of the step's training passes, per route
  std::uint64_t h2d_bytes_all_bf16 = 0;  // what the same fetches would have moved as BF16
  std::uint64_t eval_h2d_bytes = 0;      // of the evaluation passes
  std::uint32_t training_passes = 0;
  // The training passes' fetches: issued ahead of their block's call (hits), only at it
  // (misses: a prefetch window of 0), and issued ahead for a block the pass then called
  // elsewhere (unused: once per change of the order the passes call the blocks in).
  std::uint64_t prefetch_hits = 0;
  std::uint64_t prefetch_misses = 0;
  std::uint64_t prefetch_unused = 0;
  std::vector<Precision> routes;  // per block, for the next step
  // The same per policy unit (StreamedModelOptions::units): the distinct routes of its blocks,
  // in block order, one where they agree (StreamedModel::unit_routes()).
  std::vector<std::vector<Precision>> unit_routes;
  std::optional<sp::host::SwapResult> swap;  // a hot swap applied (or failed) at begin_step
  // Blocks that update_masters_during_backward() left as they were: their gradient held a
  // non-finite element.
  std::vector<std::uint32_t> updates_skipped;
  // Set on the steps that re-calibrated (StreamedModelOptions::recalibrate_every).
  std::optional<CalibrationErrors> calibration;
  double calibration_seconds = 0.0;
};

// One batch of a route measurement (StreamedModel::compare_routes): the loss the closure
// computed through the model, one value or one per example (a 1-D tensor), and optionally
// scores whose last dimension holds logits (a classifier's, or a query's similarities), whose
// distribution under the measured routes is compared with the reference's by KL divergence.
struct MeasuredBatch {
  torch::Tensor loss;
  torch::Tensor scores;  // undefined: none
};

// What one allocation of routes costs against another, measured forward only on the same
// batches, with the same random streams for both (so dropout left on draws the same masks).
struct RouteComparison {
  std::vector<Precision> routes_a, routes_b;  // per block
  double confidence = 0.95;
  // Paired over examples when every batch gave one loss per example (of the same length under
  // both allocations), else over batches.
  bool paired_over_examples = false;
  double loss_a = 0.0, loss_b = 0.0;  // the mean loss (per example, else per batch)
  PairedInterval loss_difference;     // loss_a - loss_b, with its interval
  std::vector<double> batch_loss_differences;
  // KL(b || a) of the scores' softmax, per example (every leading index of the scores), where
  // every batch gave scores: its mean with its interval over the examples.
  std::optional<PairedInterval> kl;
  std::vector<double> batch_kl;  // the mean per batch
  // The values the intervals are taken over, in batch order: loss_a - loss_b per example when
  // paired over examples (else empty), and the KL per example where the closure gave scores.
  // Two allocations measured against one reference pair up example by example.
  std::vector<double> example_loss_differences, example_kl;
  // One fetch of every block under each allocation, and as BF16; what the measurement moved:
  // routes_a's passes and routes_b's (which the comparisons of one call share).
  std::uint64_t bytes_a = 0, bytes_b = 0, bytes_all_bf16 = 0;
  std::uint64_t h2d_bytes = 0;
};

// A state entry restore_state() cannot take: `entry` names it, `detail` says why, so a host
// can name the place it stored the entry (sp-train: the checkpoint section).
class StateEntryError : public ErrorAs<std::invalid_argument> {
 public:
  StateEntryError(std::string entry, const std::string& detail);
  const std::string& entry() const { return entry_; }
  const std::string& detail() const { return detail_; }

 private:
  std::string entry_, detail_;
};

// A policy session for `engine`'s blocks as a training loop runs one: the plugin is offered
// every route the engine streams (BF16, INT8, NF4), and keeps its last good hints when a hook
// fails. StreamedModel opens its own here; a host driving the engine itself (sp-train) too.
// Throws as PolicySession's constructor does.
std::unique_ptr<sp::host::PolicySession> open_policy_session(const sp::adapters::StreamingEngine& engine,
                                                             const std::filesystem::path& plugin_file,
                                                             sp::host::PolicyConfig config, std::string host_name,
                                                             std::filesystem::path output_dir,
                                                             std::shared_ptr<spdlog::logger> logger,
                                                             std::chrono::milliseconds hook_deadline = {});

// The AdamW moments of one master for update_masters(), as many elements as the master has
// each, fp32 or bf16 (sp/kernels/adamw.h). Owned by the caller, updated in place.
struct MasterMoments {
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  bool decay = true;  // decoupled weight decay applies to this master
  sp::kernels::DType dtype = sp::kernels::DType::kFloat32;
  sp::kernels::Rounding rounding = sp::kernels::Rounding::kNearestEven;
  std::uint64_t seed = 0;  // stochastic rounding of bf16 moments: this master's stream
};

class StreamedModel {
 public:
  // Takes the streamed parameters' values as the masters and points the module parameters
  // at (empty, then delivered) compute tensors. Throws std::invalid_argument naming the
  // block and parameter for a missing or duplicated name, a block without `parameters` or
  // `forward`, or a streamed parameter that is not floating point; sp::host::PluginError when
  // the plugin cannot be loaded or rejects the config.
  StreamedModel(std::vector<Block> blocks, StreamedModelOptions options);
  ~StreamedModel();
  StreamedModel(const StreamedModel&) = delete;
  StreamedModel& operator=(const StreamedModel&) = delete;

  std::uint32_t num_blocks() const;
  // The policy's units (StreamedModelOptions::units; without them one per block), and the unit
  // block `block` belongs to.
  std::uint32_t num_units() const;
  std::uint32_t unit_of(std::uint32_t block) const;
  // The fp32 host masters of the streamed parameters, block by block (requires_grad as the
  // module's parameter had it). Give them to the optimizer with the resident parameters.
  // Sharded: those of the blocks this rank owns.
  std::vector<torch::Tensor> master_parameters() const;
  // One block's masters, by parameter name (sharded: empty for a block another rank owns).
  const std::map<std::string, torch::Tensor>& masters(std::uint32_t block) const;
  // Block `block`'s masters in full, by parameter name, as a whole state dict holds them: on the
  // block's owner (every rank when not sharded) its masters themselves; on the other ranks fresh
  // fp32 host tensors, filled by the owner's broadcast. Sharded, every rank calls it for the same
  // block at the same point (collective). Between steps: std::logic_error inside one.
  std::map<std::string, torch::Tensor> gather_masters(std::uint32_t block);
  // Sharded data parallelism (StreamedModelOptions::shard_masters on more than one rank), and
  // the rank that keeps block `block`'s masters: this rank for every block when not sharded.
  // Throws std::invalid_argument for a block out of range.
  bool sharded() const;
  // Whether the backward recomputes each block (StreamedModelOptions::recompute, resolved).
  bool recomputes() const;
  // The blocks compute in `dtype` from the next pass on, for a host about to cast its model
  // (Python's model.to(torch.bfloat16)): the floating-point resident parameters may then be
  // `dtype`, and the masters stay fp32 on the host. Between steps: std::logic_error inside one,
  // std::invalid_argument for a dtype that is not floating point; nothing changes then.
  void set_compute_dtype(torch::Dtype dtype);
  int owner(std::uint32_t block) const;
  // The resident parameters of every block (the module parameters not streamed).
  std::vector<torch::Tensor> resident_parameters() const;

  // Runs the blocks in order on x (see the step rules above).
  torch::Tensor forward(const torch::Tensor& x);
  // Runs block `block` alone on `inputs`, for a host whose own loop calls the blocks (a Hugging
  // Face model's `for layer in self.layers`): forward(x) is this for every block in turn. A pass,
  // training (grad mode, inside a step) or evaluation, calls every block once, in any order. The
  // prefetch follows the order the passes last called them in (the ids' until one calls them
  // otherwise): a call out of it costs that call's prefetch, once. The pass's first block in
  // that order opens the next pass (dropping one the host left unfinished); a second call of
  // another block in one pass is refused (std::logic_error naming it). The outputs that are floating point
  // are differentiable. With StreamedModelOptions::recompute, the backward's recompute calls
  // `call` (the block's own when empty) on the same inputs, kept by autograd, under the forward's
  // random streams and autocast.
  std::vector<torch::Tensor> forward_block(std::uint32_t block, const std::vector<torch::Tensor>& inputs,
                                           BlockCall call = {});
  // Whether forward_block(block, ...) in grad mode would open a training pass now: a host's
  // once-a-pass work (Python's stream() begins the step there) keys on it. Throws std::logic_error
  // inside a compare_routes() closure, where no training pass may open.
  bool opens_training_pass(std::uint32_t block) const;
  // The step the next begin_step() may take at the earliest: after the last one begun in this
  // run or in the state restored, else 0.
  std::int64_t next_step() const;

  void begin_step(std::int64_t step);
  // Where the host is in the step protocol: between two steps; inside one (begin_step() ran);
  // after its post_backward(), until end_step(). abort_step() and restore_state() return it
  // between steps. A host that drives the step from hooks (Python's stream()) reads it here
  // rather than keeping its own.
  enum class StepPhase { between_steps, open, after_backward };
  StepPhase step_phase() const;
  // Block gradient moments (of the streamed masters' gradients, or of the block's trainable
  // resident parameters when its streamed weights are frozen) to the plugin; to a plugin with a
  // budget (policy v3), the signal table too (unit_signals()); then its hints to the engines.
  // Call once per step, after the backward passes. A step whose backward is not followed by an
  // update (no update_masters(), no optimizer step) is a calibration step: the plugin decides
  // from its gradients, and the host zeroes them before the next.
  // `loss`: the step's loss when the host knows it (NaN: unknown); the signal table carries it,
  // which policy v3 takes as its reference loss before the first end_step().
  const std::vector<sp_grad_moments_v1>& post_backward(double loss = std::numeric_limits<double>::quiet_NaN());
  // The step's sequence from its last backward to the optimizer's update, one for every host
  // (sp-train, the Python layer): the mean across ranks of the gradients no one else averages
  // (`rest_to_average`, the host's own parameters: average_gradients()), then `read_loss()`,
  // the step's one host synchronization (a host queues first what must be finished by it:
  // sp-train its resident gradients' copies to the host), the loss's mean across ranks
  // (average()), and post_backward() with it. Returns that mean (NaN where read_loss() gave
  // NaN: unknown) and post_backward()'s moments, valid until the next begin_step().
  struct UpdateInputs {
    double loss;
    const std::vector<sp_grad_moments_v1>& moments;
  };
  UpdateInputs prepare_update(const std::vector<torch::Tensor>& rest_to_average,
                              const std::function<double()>& read_loss);
  StepReport end_step(double loss);
  // Ends a step that an exception cut short, wherever it was (a forward or backward thrown
  // out, a collective that failed): the pass in flight is dropped, the plugin's step ends with a
  // NaN loss, and the model takes a new begin_step(). The masters' .grad may hold part of the
  // step's gradient: zero them. Safe to call when no step is open.
  void abort_step();
  // Rebuilds the transfer images of blocks whose trainable masters changed outside a step.
  void refresh_images();
  // Inside a step whose backward ran: whether a trainable parameter of the blocks (a master, or a
  // resident one) changed in place since begin_step(), i.e. the host updated them without
  // post_backward() and end_step() (a hand-written loop, an optimizer without torch.optim's step
  // hooks). Python's stream() ends such a step before the next one's first forward. False
  // between steps.
  bool trained_in_step() const;
  // The fused host optimizer, in place of an optimizer step on the block's masters and of
  // end_step's rebuild of its image: one AdamW step (sp/kernels/adamw.h) on every master of
  // `block`, reading its .grad (fp32, as the layer accumulates it) and `moments` (by parameter
  // name), while the image of the route the block takes next is written in the same sweep, so
  // each master byte is read once. Call after post_backward() and before end_step(), at most
  // once per block and step. Throws std::logic_error outside that window, and
  // std::invalid_argument naming the block and parameter, with nothing changed, when a master
  // has no gradient or no moments; std::logic_error for a block another rank owns (sharded).
  void update_masters(std::uint32_t block, const sp::kernels::AdamWStep& step,
                      const std::map<std::string, MasterMoments>& moments);

  // The fused update overlapped with the backward: arms the step's training pass whose backward
  // runs next (its forward may have run already) so that each block is updated as soon as its
  // gradient is final, on a worker thread, while the backward goes on through the blocks
  // before it. That pass must be the step's last, and it replaces update_masters() for every
  // block with trainable masters: `moments[b]` is what update_masters(b, ...) would take (empty
  // for a block without trainable masters or, sharded, owned by another rank), and the caller keeps the moments alive
  // until post_backward() returns. Since `step` is fixed before the backward, it cannot clip by this step's gradient
  // norm: the host picks a rule (sp-train: the previous step's norm).
  //   - A block whose gradient holds a non-finite element is left as it was
  //     (StepReport::updates_skipped): the whole-step skip of a host that checks the norm first
  //     cannot be had, since blocks after it are updated already.
  //   - The image is written for the route in force during the backward; a block whose route
  //     post_backward() changes gets its new image at its next fetch.
  //   - post_backward() waits for the updates; an armed block whose backward did not run there
  //     is updated in post_backward(), for the route just decided. An evaluation forward
  //     before it waits too, and reads the updated masters; a grad-mode forward after the
  //     armed backward throws std::logic_error (its gradients would reach no update).
  //   - Errors of an update (a missing gradient, a failed all-reduce) are thrown by the call
  //     that waits, once every update of the step has ended; blocks updated by then stay so.
  // Throws std::logic_error outside a step, after post_backward(), while a backward runs, or
  // when already armed in this step; std::invalid_argument naming the block and parameter, with
  // nothing armed, when moments are missing or `moments` has not one entry per block.
  void update_masters_during_backward(const sp::kernels::AdamWStep& step,
                                      std::vector<std::map<std::string, MasterMoments>> moments);

  // Measures, on the first-block inputs `samples`, each block's output error with INT8 and
  // with NF4 weights against BF16 weights (all through the engine's routes, pinned), and
  // gives them to the plugin. Call between steps.
  CalibrationErrors calibrate(const std::vector<torch::Tensor>& samples);
  // The two halves of calibrate(), for a host that caches the errors: measuring alone, and
  // giving errors (measured now or read back) to the plugin. Returns false for each
  // precision the plugin rejected (logged), which it then decides without.
  CalibrationErrors measure_calibration_errors(const std::vector<torch::Tensor>& samples);
  bool set_calibration_errors(const CalibrationErrors& errors);

  // Measures what running on `routes_a` instead of `routes_b` (one precision per block) costs:
  // for each batch i in [0, batches), closure(i) runs the model forward under each allocation,
  // with grad mode off and the same random state, and returns its loss (and scores). The
  // layer's masters, images, routes and policy state, and the random streams of the CPU and of
  // the model's device, are left as they were (its pass counters advance); the bytes it moved
  // count to measurement_h2d_bytes(), not to the evaluations'. Between steps, on every rank
  // alike when sharded (the ranks share each allocation's images; a rank whose closure throws
  // leaves the others waiting in that collective until its timeout).
  // Throws std::invalid_argument for routes not one per block, no batches, a confidence outside
  // (0, 1), a closure that calls no streamed block, whose loss is not a non-empty floating 0-D
  // or 1-D tensor of finite values, or whose scores are given for some batches only, differ in
  // shape between the allocations, or give an infinite KL; std::logic_error inside a step, or
  // when the closure runs a grad-mode forward of the blocks. What the closure throws passes
  // through, the state restored.
  using MeasureClosure = std::function<MeasuredBatch(std::size_t batch)>;
  RouteComparison compare_routes(const MeasureClosure& closure, std::size_t batches,
                                 const std::vector<Precision>& routes_a, const std::vector<Precision>& routes_b,
                                 double confidence = 0.95);
  // Several allocations against one reference, on the same batches: per batch the reference
  // runs once, then each allocation of `candidates` in turn, each from the reference's random
  // state. Entry k is what compare_routes(closure, batches, candidates[k], reference) returns,
  // for 1 + candidates.size() passes a batch instead of 2 * candidates.size(). Throws as
  // compare_routes, and std::invalid_argument for no candidates.
  std::vector<RouteComparison> compare_routes(const MeasureClosure& closure, std::size_t batches,
                                              const std::vector<std::vector<Precision>>& candidates,
                                              const std::vector<Precision>& reference, double confidence = 0.95);

  // The benchmark-driven half of the route (sp-bench's transfer policy).
  void set_transfer_gate(sp::adapters::TransferGate gate);
  // Between steps: requests a swap when the plugin file changed (or `force`); it happens at
  // the next begin_step, whose StepReport tells the outcome.
  std::optional<sp::host::SwapResult> poll_plugin(bool force = false);

  // Everything the layer needs to resume with identical decisions: the masters (by
  // "master/<block>.<parameter>"; sharded, those of this rank's blocks: the host keeps every
  // rank's), the plugin state ("policy/state"), the routes in force
  // ("policy/hints") and the pass counters ("layer/passes"), as named CPU tensors a host saves
  // with torch::save or its own format. The masters are the live tensors, detached, not
  // copies: save them before the next step changes them. Byte blobs are 1-D kUInt8 of any
  // length; every other entry has a fixed dtype and shape, which a fresh export shows. A
  // plugin that cannot export its state (it fails, or is quarantined) leaves "policy/state"
  // empty, logged, and a restore from it starts the policy over: the run's own state is kept.
  std::map<std::string, torch::Tensor> export_state() const;
  // Throws StateEntryError naming an entry that is missing, of the wrong dtype or shape, or
  // holds hints the bridge refuses, before anything changes; what the plugin throws when it
  // rejects its state, with the layer left as it was. Sharded, each rank reads the masters of
  // its own blocks (others' entries may be present, unread), then the ranks share the images;
  // when any rank fails, every rank throws (the others RankMismatchError naming it).
  void restore_state(const std::map<std::string, torch::Tensor>& state);

  // Bytes of one transfer of the block on each route (image header, payload, scales).
  std::uint64_t image_bytes(std::uint32_t block, Precision precision) const;
  const sp::host::PolicySession& policy() const;
  // The route each block's next fetch takes (the plugin's hint through the transfer gate).
  std::vector<Precision> routes() const;
  // The same per policy unit: the distinct routes of each unit's blocks, in block order; one
  // route where they agree, which is always so unless the transfer policy sends a block apart.
  std::vector<std::vector<Precision>> unit_routes() const;
  // Policy v3. The signal table post_backward() last sent the plugin: per block (the policy's
  // unit) and quantized tier t, the predicted loss change of computing with the tier's image
  // instead of the fp32 master, from the step's master gradients g and the image error d:
  // first_order.t = sum g*d, second_order.t = B/2 * sum g^2*d^2 (the per-example Fisher taken
  // as B times the square of the mean gradient, B the leading dimension of the step's
  // first-block inputs, summed over its passes; with collectives, times the ranks), and
  // loss_cost.t = second_order.t + first_order.t - its mean over the blocks (docs/signals.md).
  // Frozen masters (a LoRA base) are differentiated for the table alone in the steps of such a
  // plugin (the backward computes their weight gradients too; their .grad stays empty); with
  // collectives they are not, and their blocks are NaN (not measured). Sent only to a plugin
  // with a budget (ABI 1.2, mode budget); empty before the first.
  const sp::host::UnitSignalTable& unit_signals() const;
  // Gives the plugin a table of per-unit signals measured outside a step (ABI 1.2), such as
  // calibrate()'s measured costs for policy v4 (measured_cost.<tier>, measured_cost_se.<tier>,
  // measured_cost_upper.<tier>). Before the first step the plugin's initial hints are asked for
  // again and route the first fetch; after one, the plugin decides at its next compute_hints.
  // Between steps only. Returns false when the plugin refused it (logged); with collectives,
  // every rank must send the same table (the ranks' routes are checked to agree).
  bool set_unit_signals(const sp::host::UnitSignalTable& table);
  // ABI 1.4, between steps: the allocations the policy wants measured jointly, a route per policy
  // unit each; row 0 is the one it holds, the others its alternatives (policy v4: the swaps at
  // its knapsack's boundary). Empty when it proposes none, or its plugin is older than 1.4. With
  // collectives every rank's proposal must be the same (checked).
  std::vector<std::vector<Precision>> propose_allocations();
  // ABI 1.4, between steps: what those allocations cost, measured on the same examples against
  // one reference: per allocation, in the proposal's order, its cost per example (as
  // compare_routes() of several allocations gives them: RouteComparison::example_kl, or
  // example_loss_differences). Each allocation's mean cost gets its `confidence` interval
  // (paired_interval) here, and its paired difference from allocation 0 one Bonferroni-corrected
  // over the K alternatives (1 - (1 - confidence) / K), since the policy takes the best of them:
  // noise alone makes any one win with at most the chance of one interval. Returns whether the
  // policy took them (false, logged, when it refused them); before the first step its routes
  // follow at once, after one at its next compute_hints. Throws std::invalid_argument for costs
  // of unequal lengths, none, or not finite (one example bounds nothing: sent as not measured);
  // with collectives every rank must give the same.
  bool set_allocation_measurements(const std::vector<std::vector<Precision>>& allocations,
                                   const std::vector<std::vector<double>>& example_costs, double confidence);
  // The plugin's smoothed predicted cost per block at `precision` (NaN: none yet), and where its
  // budget stands; nullopt from a plugin older than ABI 1.2 (or one that fails: logged).
  std::optional<std::vector<double>> unit_costs(Precision precision);
  std::optional<sp_budget_status_v1> budget_status();
  // The plugin's hints in force, one per policy unit (empty until its first hints, or the
  // state's): validated and translated once, by the policy session.
  const std::vector<sp::host::UnitHint>& hints() const;
  // Bytes the evaluation passes (no-grad forwards, and grad-mode ones that no backward followed)
  // moved since construction, and apart from
  // them those of the calibration passes (calibrate(), online re-calibration) and of the route
  // measurements (compare_routes()).
  std::uint64_t evaluation_h2d_bytes() const;
  std::uint64_t calibration_h2d_bytes() const;
  std::uint64_t measurement_h2d_bytes() const;
  // Data parallelism (collectives.h). rank() 0 and world_size() 1 without collectives.
  int rank() const;
  int world_size() const;
  Collectives* collectives() const;  // null without; owned by the model
  // Where the masters' gradients are reduced across ranks: the compute device when every
  // rank's group reduces tensors there without the host (NCCL: Collectives::reduces_on, asked
  // by the constructor), so that only the reduced gradient crosses to the host, and sharded
  // only to the block's owner; else the host (the CPU; also in one process).
  torch::Device gradient_reduction_device() const;
  // Replaces each parameter's .grad by its mean across ranks (one bucket); for the host's own
  // parameters (embedding, head) after the backward. A no-op in one process.
  void average_gradients(const std::vector<torch::Tensor>& parameters);
  // The mean of `value` across ranks (the step's loss for end_step()); `value` in one process.
  double average(double value);
  // Writes the training engine's pending per-pass metrics records (metrics_path), waiting for
  // their timings.
  void flush_metrics();
  // Records of metrics_path that could not be written (disk full, ...), each logged.
  std::uint64_t metrics_records_lost() const;

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;  // shared with the backward of a graph in flight
};

}  // namespace sp::torch_layer
