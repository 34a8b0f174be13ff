#include "sp/torch_layer/streamed_model.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <cmath>
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
#include "forward_state.h"
#include "serial_worker.h"
#include "unlisted_leaves.h"
#ifdef SP_TORCH_LAYER_HAVE_CUDA
#include "sp/adapters/cuda_backend.h"
#endif

namespace sp::torch_layer {
namespace ad = sp::adapters;
namespace kn = sp::kernels;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Clock = std::chrono::steady_clock;

namespace {

ad::Precision route_of(sp_precision precision) {
  if (const std::optional<ad::Precision> route = ad::route_of(precision)) return *route;
  throw std::invalid_argument(fmt::format("sp_precision {} is not BF16, INT8 or NF4", static_cast<int>(precision)));
}

std::unique_ptr<ad::TransferBackend> make_backend(const StreamedModelOptions& options) {
  if (options.device.is_cpu()) {
    ad::HostBackendOptions host;
    host.bandwidth_cap_bytes_per_second = options.host_bandwidth_cap_gbps * 1e9;
    return std::make_unique<ad::HostBackend>(host);
  }
#ifdef SP_TORCH_LAYER_HAVE_CUDA
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
#ifdef SP_TORCH_LAYER_HAVE_CUDA
      " and CUDA"
#else
      ""
#endif
      ));
}

const torch::Tensor* find(const NamedParameters& params, const std::string& name) {
  for (const auto& [key, value] : params) {
    if (key == name) return &value;
  }
  return nullptr;
}

// One streamed parameter: the tensor its block computes with (the module's own Parameter, or
// for a Block::call block the layer's own), pointed at delivered weights while the block
// computes and at an empty tensor otherwise, and its fp32 host master.
struct StreamedParam {
  std::string name;
  std::uint32_t block = 0;
  torch::Tensor param;
  torch::Tensor master;  // sharded, on a rank that does not own the block: an empty placeholder
  torch::Tensor staging;  // CUDA: pinned fp32, the gradient's way to the host without a sync
  bool staged = false;    // staging holds this pass's gradient
  std::vector<std::int64_t> shape;
  std::uint64_t rows = 0, cols = 0;
  torch::TensorOptions placeholder;  // the empty tensor's dtype and device between uses
};

struct BlockState {
  Block block;
  std::vector<StreamedParam> streamed;
  std::map<std::string, torch::Tensor> masters;
  std::vector<torch::Tensor> resident;
  std::vector<std::string> resident_names;        // of `resident`, for messages
  std::vector<torch::TensorOptions> resident_kinds;  // their dtype and device when wrapped
  std::vector<torch::Tensor> trainable_resident;  // resident parameters that require grad
  std::vector<torch::Tensor> moment_sources;      // Block::moments_from; empty: the default rule
  // What the block's autograd node takes as inputs besides x: its trainable resident
  // parameters, and one trainable master, so that a block whose only trainable weights stream
  // still gets a backward when its input needs no gradient.
  std::vector<torch::Tensor> autograd_inputs;
  bool trainable_masters = false;
  // Its training forward's random streams and autocast, for the recompute (forward_state.h).
  std::optional<ForwardState> forward_state;
  // How it computes: Block::call, or Block::forward adapted to one. With Block::call the
  // module's streamed parameters are the masters, and `weights` the tensors the delivered
  // weights are put in.
  BlockCall call;
  bool params_are_masters = false;
  NamedParameters weights;
  // The call of the current training pass's forward, which its recompute makes again.
  BlockCall pass_call;
};

std::string master_key(const BlockState& b, const StreamedParam& p) { return "master/" + b.block.name + "." + p.name; }

// The moments of master `name`, or null when `moments` lacks them or either buffer.
const MasterMoments* moments_of(const std::map<std::string, MasterMoments>& moments, const std::string& name) {
  const auto found = moments.find(name);
  if (found == moments.end() || found->second.exp_avg == nullptr || found->second.exp_avg_sq == nullptr) return nullptr;
  return &found->second;
}

// The block's trainable masters as the fused update takes them, each with its gradient and
// `moments` entry. Throws std::invalid_argument naming the parameter that has no fp32 host
// gradient of its size, or no moments.

std::vector<kn::AdamWTensor> fused_update_tensors(const BlockState& b, const std::map<std::string, MasterMoments>& moments) {
  std::vector<kn::AdamWTensor> tensors;
  for (const StreamedParam& p : b.streamed) {
    const auto problem = [&](const std::string& what) {
      return std::invalid_argument(fmt::format("StreamedModel::update_masters: {}.{} {}", b.block.name, p.name, what));
    };
    const torch::Tensor& grad = p.master.grad();
    if (!grad.defined() || grad.scalar_type() != torch::kFloat32 || !grad.is_contiguous() ||
        grad.numel() != p.master.numel() || !grad.device().is_cpu()) {
      throw problem("has no fp32 contiguous host gradient in .grad of the master's size");
    }
    const MasterMoments* found = moments_of(moments, p.name);
    if (found == nullptr) throw problem("has no AdamW moments (exp_avg and exp_avg_sq) in the map given");
    const MasterMoments& moment = *found;
    tensors.push_back(kn::AdamWTensor{p.master.data_ptr<float>(), grad.data_ptr<float>(), moment.exp_avg,
                                      moment.exp_avg_sq, kn::TensorShape{p.rows, p.cols}, moment.decay, moment.dtype,
                                      moment.rounding, moment.seed});
  }
  return tensors;
}

// Whether every element of the block's master gradients is finite (an absent gradient counts
// as finite: fused_update_tensors() refuses it by name).
bool gradients_finite(const BlockState& b) {
  for (const StreamedParam& p : b.streamed) {
    const torch::Tensor& grad = p.master.grad();
    if (!grad.defined() || grad.scalar_type() != torch::kFloat32 || !grad.is_contiguous()) continue;
    const float* g = grad.data_ptr<float>();
    const std::int64_t n = grad.numel();
    bool finite = true;
    for (std::int64_t i = 0; i < n; ++i) finite &= std::isfinite(g[i]);
    if (!finite) return false;
  }
  return true;
}

}  // namespace

StateEntryError::StateEntryError(std::string entry, const std::string& detail)
    : std::invalid_argument(fmt::format("StreamedModel::restore_state: '{}': {}", entry, detail)),
      entry_(std::move(entry)),
      detail_(detail) {}

struct StreamedModel::Impl {
  StreamedModelOptions options;
  std::shared_ptr<spdlog::logger> log;
  torch::TensorOptions compute;
  std::vector<BlockState> blocks;
  std::unique_ptr<ad::TransferBackend> backend;
  std::unique_ptr<ad::StreamingEngine> engine;       // training passes: forward + backward
  std::unique_ptr<ad::StreamingEngine> eval_engine;  // forward-only passes
  std::unique_ptr<ad::Event> compute_done;
  std::unique_ptr<sp::host::PolicySession> policy;
  std::shared_ptr<Collectives> collectives;  // null: one process
  // The masters' gradients are reduced across ranks on the compute device, before they cross
  // to the host (probe_collectives()); else on the host, after.
  bool device_reductions = false;
  // Sharded data parallelism (StreamedModelOptions::shard_masters on more than one rank): each
  // block's masters live on its owner alone, which sends its images to the other ranks.
  bool sharded = false;
  // Per block, the same on every rank: the route of the image the ranks last shared.
  std::vector<ad::Precision> shared_route;
  // A block's master gradients of the current pass, flattened into one bucket, on their way
  // through an all-reduce started in the backward; folded into the masters at the pass's end.
  struct ReducingBucket {
    std::vector<StreamedParam*> params;
    torch::Tensor bucket;
    std::unique_ptr<Collectives::Pending> pending;
  };
  std::vector<ReducingBucket> reducing;

  enum class Pass { none, forwarded, in_backward };
  Pass pass = Pass::none;
  std::uint64_t pass_id = 0;
  std::int64_t engine_steps = 0, eval_engine_steps = 0;
  std::vector<bool> eval_image_stale;  // per block: its masters changed since the evaluation engine built its image
  // Per block, per streamed parameter: the master's version counter when the block's images
  // were last built from it. An in-place change since (an optimizer step after end_step())
  // would leave the engines streaming the old weights.
  std::vector<std::vector<std::int64_t>> image_versions;
  // The gradients of the current pass's unlisted inputs (unlisted_leaves.h), summed over blocks.
  std::vector<UnlistedLeaf> pass_unlisted;
  std::vector<torch::Tensor> pass_unlisted_grads;
  std::vector<bool> updated_in_step;   // per block: update_masters() wrote its image this step
  std::uint64_t evaluation_bytes = 0, calibration_bytes = 0;  // of the forward-only passes
  bool grads_staged = false;
  // The lowest block whose autograd node runs in the current pass: its backward ends the pass
  // (unset while no block of the pass has a node).
  std::optional<std::uint32_t> pass_end_block;
  std::uint32_t next_forward = 0;  // the block the current training pass's forward calls next
  bool eval_open = false;          // an evaluation pass is open; `eval_next` its next block
  std::uint32_t eval_next = 0;
  std::int64_t id = 0;  // in the registry of live models (StreamedBlockFunction)

  bool in_step = false;
  bool after_backward = false;
  std::int64_t step = 0;
  // The last step begun, in this run or the one whose state was restored: steps must increase,
  // as the plugin's window and its switch counts are measured in steps.
  std::optional<std::int64_t> last_step;
  Clock::time_point step_start;
  ad::StepTransferMetrics step_transfer;
  StepReport report;
  std::vector<sp_grad_moments_v1> moments;
  std::vector<sp_hint_v1> applied_hints;
  torch::Tensor last_input;  // first-block input of the latest training pass, for re-calibration

  // update_masters_during_backward(): the step's constants and moments while armed, and the
  // updates the backward began, each running on `worker` until wait_for_updates().
  struct ArmedUpdate {
    kn::AdamWStep step;
    std::vector<std::map<std::string, MasterMoments>> moments;  // per block
    std::vector<bool> begun;                                    // per block
  };
  std::optional<ArmedUpdate> armed;
  struct RunningUpdate {
    std::uint32_t block = 0;
    std::unique_ptr<ad::StreamingEngine::WeightUpdate> update;
    std::shared_ptr<bool> skipped;  // the task found a non-finite gradient
    std::future<void> done;
  };
  std::vector<RunningUpdate> running;
  std::vector<bool> deferred_updates;  // per block: its gradient reaches the host only at the pass's end
  std::vector<std::unique_ptr<ad::Event>> gradient_copied;  // per block: its staged gradient is on the host
  SerialWorker worker;  // last: destroyed first, after its tasks ran

  Impl(std::vector<Block> in, StreamedModelOptions opts)
      : options(std::move(opts)), log(options.logger), collectives(options.collectives) {
    if (!log) log = spdlog::default_logger();
    compute = torch::TensorOptions().dtype(options.compute_dtype).device(options.device);
    if (in.empty()) throw std::invalid_argument("StreamedModel: there are no blocks");
    if (options.shard_masters && !collectives) {
      throw std::invalid_argument(
          "StreamedModelOptions::shard_masters needs collectives: sharding spreads the masters over the ranks");
    }
    sharded = options.shard_masters && collectives->size() > 1;
    if (collectives) probe_collectives();
    refuse_shared_parameters(in);
    for (std::size_t b = 0; b < in.size(); ++b) adopt(std::move(in[b]), b);
    const auto called = [](const BlockState& b) { return b.params_are_masters; };
    if (options.recalibrate_every != 0 && std::any_of(blocks.begin(), blocks.end(), called)) {
      throw std::invalid_argument(
          "StreamedModelOptions::recalibrate_every: re-calibration feeds each block the output of the one before, one "
          "tensor, and these blocks compute through Block::call; set it to 0");
    }
    build_engines();
    if (sharded) shard_masters();
    build_policy();
    note_image_versions();
  }

  void note_image_versions() {
    image_versions.assign(blocks.size(), {});
    for (std::uint32_t b = 0; b < blocks.size(); ++b) {
      if (!owns(b)) continue;
      for (const StreamedParam& p : blocks[b].streamed) image_versions[b].push_back(p.master._version());
    }
  }

  // The first of block b's masters changed since its images were built, or null.
  const StreamedParam* changed_master(std::uint32_t b) const {
    for (std::size_t i = 0; i < image_versions[b].size(); ++i) {
      if (blocks[b].streamed[i].master._version() != image_versions[b][i]) return &blocks[b].streamed[i];
    }
    return nullptr;
  }

  // Masters changed since their images were built: a Block::call block's are its module's
  // parameters, which the host changes the usual way (a state dict loaded, an edit), so their
  // images are rebuilt here (one process: sharded, the ranks would have to share them); any
  // other is refused.
  void require_current_images(const std::string& call) {
    for (std::uint32_t b = 0; b < blocks.size(); ++b) {
      if (!owns(b)) continue;
      if (blocks[b].params_are_masters && !sharded && changed_master(b)) {
        engine->on_weights_updated(b);
        eval_image_stale[b] = true;
        for (std::size_t i = 0; i < blocks[b].streamed.size(); ++i) {
          image_versions[b][i] = blocks[b].streamed[i].master._version();
        }
        continue;
      }
      if (const StreamedParam* p = changed_master(b)) {
        throw std::logic_error(fmt::format(
            "StreamedModel::{}: {}'s master '{}' changed after its transfer images were built (an optimizer step "
            "after end_step()?), so the engines would stream the old weights. Step the optimizer between "
            "post_backward() and end_step() (the Python step() context does), or call refresh_images() after "
            "changing the masters",
            call, blocks[b].block.name, p->name));
      }
    }
  }

  ~Impl() {
    // Nor must an update still write the masters and a slab.
    try {
      wait_for_updates();
    } catch (const std::exception& e) {
      log->warn("StreamedModel: an update during the backward failed: {}", e.what());
    }
    // The engines must not outlive a pass that an exception cut short.
    try {
      if (pass != Pass::none) engine->end_step();
    } catch (const std::exception& e) {
      log->warn("StreamedModel: closing the open training pass: {}", e.what());
    }
    try {
      if (eval_open) end_eval_pass();
    } catch (const std::exception& e) {
      log->warn("StreamedModel: closing the open evaluation pass: {}", e.what());
    }
  }

  // A parameter in two blocks would get a master per block (streamed), or be listed, reduced and
  // stepped once per block (resident): refused, naming both places.
  static void refuse_shared_parameters(const std::vector<Block>& in) {
    // Where each tensor was first met: its block's index, and "block's 'name'" for the message.
    std::map<const c10::TensorImpl*, std::pair<std::size_t, std::string>> first_place;
    for (std::size_t b = 0; b < in.size(); ++b) {
      if (!in[b].parameters) continue;  // adopt() names that
      const std::string block = in[b].name.empty() ? fmt::format("block{}", b) : in[b].name;
      for (const auto& [name, tensor] : in[b].parameters()) {
        const std::string place = fmt::format("{}'s '{}'", block, name);
        const auto [it, added] = first_place.emplace(tensor.unsafeGetTensorImpl(), std::make_pair(b, place));
        if (!added && it->second.first != b) {
          throw std::invalid_argument(fmt::format(
              "StreamedModel: {} is {} too: a parameter shared by two blocks is not supported (each block would "
              "update it); give each block its own, or keep the shared one outside the streamed blocks",
              place, it->second.second));
        }
      }
    }
  }

  void adopt(Block block, std::size_t index) {
    if (block.name.empty()) block.name = fmt::format("block{}", index);
    const std::string& name = block.name;
    if (!block.parameters)
      throw std::invalid_argument(fmt::format("StreamedModel: {} has no parameters callable", name));
    if (!block.forward && !block.call) {
      throw std::invalid_argument(fmt::format("StreamedModel: {} has neither a forward nor a call", name));
    }
    BlockState state;
    state.params_are_masters = static_cast<bool>(block.call);
    const NamedParameters params = block.parameters();
    for (const std::string& wanted : block.streamed) {
      if (std::count(block.streamed.begin(), block.streamed.end(), wanted) > 1) {
        throw std::invalid_argument(fmt::format("StreamedModel: {}: parameter '{}' is listed twice", name, wanted));
      }
      const torch::Tensor* found = find(params, wanted);
      if (!found) {
        std::string known;
        for (const auto& item : params) known += (known.empty() ? "" : ", ") + item.first;
        throw std::invalid_argument(
            fmt::format("StreamedModel: {} has no parameter '{}' (it has: {})", name, wanted, known));
      }
      if (!found->is_floating_point() || found->numel() == 0) {
        throw std::invalid_argument(
            fmt::format("StreamedModel: {}: parameter '{}' is {} with {} elements; a streamed parameter is a non-empty "
                        "floating-point tensor",
                        name, wanted, c10::toString(found->scalar_type()), found->numel()));
      }
      StreamedParam p;
      p.name = wanted;
      p.block = static_cast<std::uint32_t>(index);
      p.param = *found;
      p.shape = found->sizes().vec();
      p.rows = found->dim() >= 2 ? static_cast<std::uint64_t>(found->size(0)) : 1;
      p.cols = static_cast<std::uint64_t>(found->numel()) / p.rows;
      torch::Tensor master;
      if (state.params_are_masters) {
        if (!found->device().is_cpu() || found->scalar_type() != torch::kFloat32 || !found->is_contiguous() ||
            !found->is_leaf()) {
          throw std::invalid_argument(fmt::format(
              "StreamedModel: {}: parameter '{}' is a {} tensor on {}; a block computing through Block::call keeps "
              "its streamed parameters as the fp32 masters: contiguous float32 leaf tensors on the CPU",
              name, wanted, c10::toString(found->scalar_type()), found->device().str()));
        }
        master = *found;
      } else {
        master = found->detach().to(torch::kCPU, torch::kFloat32, /*non_blocking=*/false, /*copy=*/true);
        if (options.device.is_cuda()) master = master.pin_memory();
        master.set_requires_grad(found->requires_grad());
      }
      state.trainable_masters = state.trainable_masters || found->requires_grad();
      if (options.device.is_cuda() && found->requires_grad() && !device_reductions) {
        p.staging = torch::empty_like(master).pin_memory();
      }
      p.master = master;
      if (state.params_are_masters) {
        p.param = torch::empty({0}, compute);
        p.placeholder = master.options();  // what the module's parameter must stay
      } else {
        {
          torch::NoGradGuard no_grad;
          p.param.set_data(torch::empty({0}, compute));
        }
        p.placeholder = p.param.options();  // its device with an index, where `compute`'s may have none
      }
      state.masters.emplace(wanted, master);
      state.streamed.push_back(std::move(p));
    }
    for (const auto& [key, value] : params) {
      if (std::find(block.streamed.begin(), block.streamed.end(), key) != block.streamed.end()) continue;
      state.resident.push_back(value);
      state.resident_names.push_back(key);
      state.resident_kinds.push_back(value.options());
      if (value.requires_grad()) state.trainable_resident.push_back(value);
    }
    if (state.streamed.empty()) {
      throw std::invalid_argument(fmt::format("StreamedModel: {} streams no parameter; list at least one", name));
    }
    for (const std::string& wanted : block.moments_from) {
      const torch::Tensor* found = find(params, wanted);
      if (!found) {
        throw std::invalid_argument(fmt::format(
            "StreamedModel: {}: moments_from names '{}', which is not one of its parameters", name, wanted));
      }
      const auto streamed = std::find_if(state.streamed.begin(), state.streamed.end(),
                                         [&](const StreamedParam& p) { return p.name == wanted; });
      state.moment_sources.push_back(streamed != state.streamed.end() ? streamed->master : *found);
    }
    set_autograd_inputs(state);
    for (const StreamedParam& p : state.streamed) state.weights.emplace_back(p.name, p.param);
    if (state.params_are_masters) {
      state.call = block.call;
    } else {
      state.call = [forward = block.forward, name](const std::vector<torch::Tensor>& inputs, const NamedParameters&) {
        if (inputs.size() != 1) {
          throw std::invalid_argument(fmt::format(
              "StreamedModel: {} takes one tensor (Block::forward), not {}; give the block a Block::call", name,
              inputs.size()));
        }
        return std::vector<torch::Tensor>{forward(inputs[0])};
      };
    }
    state.block = std::move(block);
    blocks.push_back(std::move(state));
  }

  static void set_autograd_inputs(BlockState& block) {
    block.autograd_inputs = block.trainable_resident;
    for (const StreamedParam& p : block.streamed) {
      if (!p.master.requires_grad()) continue;
      block.autograd_inputs.push_back(p.master);
      break;
    }
  }

  void build_engines() {
    std::vector<ad::BlockSpec> specs;
    for (const BlockState& b : blocks) {
      ad::BlockSpec spec;
      spec.name = b.block.name;
      for (const StreamedParam& p : b.streamed) {
        spec.tensors.push_back(ad::TensorSpec{p.name, p.master.data_ptr<float>(), p.rows, p.cols});
      }
      specs.push_back(std::move(spec));
    }
    ad::StreamingConfig config;
    config.prefetch_window = options.prefetch_window;
    config.int8_group_size = options.int8_group_size;
    config.nf4_group_size = options.nf4_group_size;
    ad::size_streaming_config(config, specs, options.spare_slabs);
    config.backward = true;
    config.metrics_path = options.metrics_path;
    backend = make_backend(options);
    engine = std::make_unique<ad::StreamingEngine>(*backend, config, specs);
    config.backward = false;
    config.metrics_path.clear();
    eval_engine = std::make_unique<ad::StreamingEngine>(*backend, config, specs);
    compute_done = backend->create_event();
    eval_image_stale.assign(blocks.size(), false);
    deferred_updates.assign(blocks.size(), false);
    updated_in_step.assign(blocks.size(), false);
  }

  void build_policy() {
    policy = open_policy_session(*engine, options.plugin_file,
                                 sp::host::PolicyConfig{options.config_yaml, options.config_source}, options.host_name,
                                 options.output_dir, log, options.plugin_hook_deadline);
  }

  // ---- data parallelism ----------------------------------------------------------------------

  // The layer's own collectives (moments, hint checks, losses, images) run on host tensors, so
  // the group must take those. The masters' gradients are born on the compute device: where the
  // group reduces tensors there without the host (NCCL), each block's is reduced there in the
  // backward, and only the result crosses to the host (sharded, to its owner only). The ranks
  // agree on a CPU tensor before any device tensor is reduced, so that none waits on a device
  // collective another rank never starts.
  void probe_collectives() {
    try {
      torch::Tensor one = torch::zeros({1}, torch::kFloat32);
      collectives->all_reduce(one, Reduction::sum, "a probe of CPU tensors")->wait();
    } catch (const CollectiveError&) {
      throw;  // a rank failed: not an answer about the group
    } catch (const std::exception& e) {
      const std::string why = e.what();
      throw std::invalid_argument(fmt::format(
          "StreamedModelOptions::collectives: rank {} of {}: the group refused an all-reduce of a CPU tensor ({}). "
          "The layer's collectives run on host tensors: give it a group that takes them, as Gloo does, or "
          "one with a backend per device (init_process_group(\"cpu:gloo,cuda:nccl\")); NCCL alone takes "
          "device tensors only",
          collectives->rank(), collectives->size(), why.substr(0, why.find('\n'))));
    }
    if (!options.device.is_cuda()) return;
    const bool here = collectives->reduces_on(options.device);
    torch::Tensor everywhere = torch::tensor({here ? 1 : 0}, torch::kInt32);
    collectives->all_reduce(everywhere, Reduction::min, "whether every rank's group reduces device tensors")->wait();
    device_reductions = everywhere.item<std::int32_t>() == 1;
    log->info("StreamedModel: the masters' gradients are reduced across ranks {}",
              device_reductions ? fmt::format("on {}, before they cross to the host", options.device.str())
              : here            ? std::string("on the host: another rank's group does not reduce device tensors")
                                : std::string("on the host: the group does not reduce device tensors without it"));
  }

  torch::Device gradient_reduction_device() const { return device_reductions ? options.device : torch::kCPU; }

  // ---- sharded data parallelism ------------------------------------------------------------

  int owner(std::uint32_t b) const {
    return sharded ? static_cast<int>(b % static_cast<std::uint32_t>(collectives->size()))
                   : (collectives ? collectives->rank() : 0);
  }
  bool owns(std::uint32_t b) const { return owner(b) == (collectives ? collectives->rank() : 0); }

  // Every rank starts from the owners' weights, whatever its host initialized, and keeps only
  // the masters of its own blocks. The module's parameters were freed by adopt() already.
  void shard_masters() {
    shared_route.assign(blocks.size(), ad::Precision::bf16);  // every engine starts on BF16
    for (std::uint32_t b = 0; b < blocks.size(); ++b) {
      share_image(*engine, b, ad::Precision::bf16);
      if (owns(b)) continue;
      engine->forget_masters(b);
      eval_engine->forget_masters(b);
      eval_image_stale[b] = true;
      BlockState& block = blocks[b];
      for (StreamedParam& p : block.streamed) {
        if (block.params_are_masters) {
          // The module's parameter is the master: emptied in place, so that it stays the module's.
          torch::NoGradGuard no_grad;
          p.master.set_data(torch::empty({0}, torch::kFloat32));
          continue;
        }
        torch::Tensor placeholder = torch::empty({0}, torch::kFloat32);
        placeholder.set_requires_grad(p.master.requires_grad());
        p.master = placeholder;
      }
      block.masters.clear();
      // The owner computes the block's moments; an anchor keeps the block's backward running.
      block.moment_sources.clear();
      set_autograd_inputs(block);
    }
  }

  // Block b's image on `precision` from its owner into `target` on every other rank (each
  // rank's engine of the same role: the training engines, or the evaluation engines).
  void share_image(ad::StreamingEngine& target, std::uint32_t b, ad::Precision precision) {
    const int root = owner(b);
    const std::string what = fmt::format("the {} image of {}", ad::precision_name(precision), blocks[b].block.name);
    const auto send = [&](std::uint8_t* data, std::uint64_t bytes) {
      collectives->broadcast(torch::from_blob(data, {static_cast<std::int64_t>(bytes)}, torch::kUInt8), root, what);
    };
    if (owns(b)) {
      const ad::StreamingEngine::ImageBytes image = target.image(b, precision);
      // A broadcast's root only reads its tensor.
      send(const_cast<std::uint8_t*>(image.data), image.bytes);
    } else {
      target.receive_image(b, precision, send);
    }
  }

  // After the owners rebuilt their images (end_step, refresh_images, restore_state), or at a
  // step's start: every block whose image changed since the ranks last shared it goes out
  // again, in the route it takes next. Which ones is decided alike on every rank: all blocks
  // when `all`, else those whose masters train (their owner updated them) or whose route moved.
  void share_images(bool all, bool trained) {
    if (!sharded) return;
    for (std::uint32_t b = 0; b < blocks.size(); ++b) {
      const ad::Precision route = engine->policy_bridge().route(b);
      if (!all && !(trained && blocks[b].trainable_masters) && shared_route[b] == route) continue;
      share_image(*engine, b, route);
      shared_route[b] = route;
      eval_image_stale[b] = true;
    }
  }

  // The evaluation engines' images of every block on one route (calibration's pinned passes).
  void share_eval_images(ad::Precision precision) {
    if (!sharded) return;
    for (std::uint32_t b = 0; b < blocks.size(); ++b) {
      if (owns(b) && eval_image_stale[b]) eval_engine->on_weights_updated(b);
      share_image(*eval_engine, b, precision);
      eval_image_stale[b] = false;
    }
  }

  // A block's evaluation image after its masters changed: rebuilt by its owner, copied from the
  // training engine's (which the owner sent) elsewhere.
  void refresh_eval_image(std::uint32_t b) {
    if (eval_engine->has_masters(b)) {
      eval_engine->on_weights_updated(b);
      return;
    }
    const ad::Precision route = eval_engine->policy_bridge().route(b);
    const ad::StreamingEngine::ImageBytes image = engine->image(b, route);
    eval_engine->receive_image(b, route,
                               [&](std::uint8_t* data, std::uint64_t bytes) { std::memcpy(data, image.data, bytes); });
  }

  // The moments of the blocks this rank owns, added across ranks: the other ranks give zeros,
  // so every rank ends with the owner's numbers exactly.
  void gather_moments(std::vector<sp_grad_moments_v1>& moments) {
    constexpr std::int64_t kFields = 5;
    torch::Tensor values = torch::zeros({static_cast<std::int64_t>(moments.size()) * kFields}, torch::kFloat64);
    double* v = values.data_ptr<double>();
    for (std::uint32_t b = 0; b < moments.size(); ++b, v += kFields) {
      if (!owns(b)) continue;
      const sp_grad_moments_v1& m = moments[b];
      v[0] = m.sum_sq, v[1] = m.sum, v[2] = m.max_abs;
      v[3] = static_cast<double>(m.count), v[4] = static_cast<double>(m.nonfinite);
    }
    collectives->all_reduce(values, Reduction::sum, "the blocks' gradient moments")->wait();
    v = values.data_ptr<double>();
    for (std::uint32_t b = 0; b < moments.size(); ++b, v += kFields) {
      sp_grad_moments_v1& m = moments[b];
      m.sum_sq = v[0], m.sum = v[1], m.max_abs = v[2];
      m.count = static_cast<std::uint64_t>(v[3]), m.nonfinite = static_cast<std::uint64_t>(v[4]);
    }
  }

  // StreamedModel::restore_state() on this rank: everything checked before anything changes.
  void restore_state(const std::map<std::string, torch::Tensor>& state) {
    const auto entry = [&](const std::string& key, torch::ScalarType type) -> torch::Tensor {
      const auto it = state.find(key);
      if (it == state.end()) throw StateEntryError(key, "missing");
      if (it->second.scalar_type() != type || !it->second.device().is_cpu()) {
        throw StateEntryError(key,
                              fmt::format("{} on {}; expected {} on the CPU", c10::toString(it->second.scalar_type()),
                                          it->second.device().str(), c10::toString(type)));
      }
      return it->second.contiguous();
    };
    // Everything is checked before anything changes.
    std::vector<std::pair<StreamedParam*, torch::Tensor>> masters;
    for (std::uint32_t b = 0; b < blocks.size(); ++b) {
      if (!owns(b)) continue;  // sharded: its owner restores it; an entry for it is not read
      for (StreamedParam& p : blocks[b].streamed) {
        const std::string key = master_key(blocks[b], p);
        torch::Tensor saved = entry(key, torch::kFloat32);
        if (saved.sizes() != p.master.sizes()) {
          throw StateEntryError(
              key, fmt::format("shape {}; expected {}", fmt::join(saved.sizes(), "x"), fmt::join(p.master.sizes(), "x")));
        }
        masters.emplace_back(&p, std::move(saved));
      }
    }
    const torch::Tensor blob = entry("policy/state", torch::kUInt8);
    const torch::Tensor hints = entry("policy/hints", torch::kUInt8);
    const torch::Tensor passes = entry("layer/passes", torch::kInt64);
    // Absent from states written before steps were checked: the count starts afresh.
    std::optional<std::int64_t> restored_last_step;
    if (state.count("layer/last_step")) {
      const torch::Tensor last = entry("layer/last_step", torch::kInt64);
      if (last.numel() != 1 || last.data_ptr<std::int64_t>()[0] < -1) {
        throw StateEntryError("layer/last_step", "expected one step number, or -1 for none");
      }
      if (last.data_ptr<std::int64_t>()[0] >= 0) restored_last_step = last.data_ptr<std::int64_t>()[0];
    }
    const std::size_t hint_bytes = static_cast<std::size_t>(hints.numel());
    if (hint_bytes % sizeof(sp_hint_v1) != 0 || (hint_bytes != 0 && hint_bytes != blocks.size() * sizeof(sp_hint_v1))) {
      throw StateEntryError("policy/hints",
                            fmt::format("holds {} bytes; expected none or {} hints", hint_bytes, blocks.size()));
    }
    if (passes.numel() != 2)
      throw StateEntryError("layer/passes", fmt::format("holds {} values; expected 2", passes.numel()));
    std::vector<sp_hint_v1> restored(hint_bytes / sizeof(sp_hint_v1));
    if (hint_bytes) std::memcpy(restored.data(), hints.data_ptr(), hint_bytes);
    // The bridges check every hint before taking any; the plugin's state comes after them, and
    // a plugin that rejects it leaves the previous hints in force.
    const std::vector<sp_hint_v1> previous = applied_hints;
    // No hints (a state exported before the plugin's first ones): the default routes again.
    const auto put_hints = [&](const std::vector<sp_hint_v1>& hints) {
      if (!hints.empty()) return apply_hints(hints);
      engine->policy_bridge().clear_plugin_hints();
      eval_engine->policy_bridge().clear_plugin_hints();
      applied_hints.clear();
    };
    try {
      put_hints(restored);
    } catch (const std::invalid_argument& e) {
      throw StateEntryError("policy/hints", e.what());
    }
    try {
      if (blob.numel() == 0) {
        log->warn("StreamedModel: the state holds no plugin state (it could not be exported); the policy starts over");
      } else {
        policy->restore_state(
            std::vector<std::uint8_t>(blob.data_ptr<std::uint8_t>(), blob.data_ptr<std::uint8_t>() + blob.numel()));
      }
    } catch (...) {
      put_hints(previous);
      throw;
    }
    {
      torch::NoGradGuard no_grad;
      for (auto& [p, saved] : masters) p->master.copy_(saved);
    }
    engine_steps = passes.data_ptr<std::int64_t>()[0];
    eval_engine_steps = passes.data_ptr<std::int64_t>()[1];
    last_step = restored_last_step;
    note_image_versions();
    for (std::uint32_t b = 0; b < blocks.size(); ++b) {
      if (owns(b)) engine->on_weights_updated(b);
    }
    eval_image_stale.assign(blocks.size(), true);
  }

  // ---- weights in and out of the module ----------------------------------------------------

  // A parameter the host replaced under the layer (module->weight = new tensor) would be
  // computed with its own, stale values and trained without the layer knowing: refused.
  void check_parameters_unchanged() const {
    for (const BlockState& b : blocks) {
      const NamedParameters params = b.block.parameters();
      for (const StreamedParam& p : b.streamed) {
        const torch::Tensor* now = find(params, p.name);
        const torch::Tensor& held = b.params_are_masters ? p.master : p.param;
        if (!now || now->unsafeGetTensorImpl() != held.unsafeGetTensorImpl()) {
          throw std::logic_error(fmt::format(
              "StreamedModel: {}: parameter '{}' was replaced or removed after the model was wrapped; the layer "
              "owns streamed parameters ({})",
              b.block.name, p.name,
              b.params_are_masters ? "they are its masters: change them in place"
                                   : "change the masters instead, then call refresh_images()"));
        }
        refuse_converted(b, p.name, held, p.placeholder);
      }
      for (std::size_t i = 0; i < b.resident.size(); ++i) {
        refuse_converted(b, b.resident_names[i], b.resident[i], b.resident_kinds[i]);
      }
    }
  }

  // A .to() of the model after wrapping converts the blocks' parameters in place: the
  // placeholders of the streamed weights and the resident parameters, which the layer's
  // passes would then mix with weights in the wrapped dtype and device.
  static void refuse_converted(const BlockState& b, const std::string& name, const torch::Tensor& now,
                               const torch::TensorOptions& wrapped) {
    if (now.scalar_type() == c10::typeMetaToScalarType(wrapped.dtype()) && now.device() == wrapped.device()) return;
    throw std::logic_error(fmt::format(
        "StreamedModel: {}: parameter '{}' is now {} on {}, and was {} on {} when the blocks were wrapped (a .to() "
        "after wrapping?). The layer keeps the blocks' parameters where they were: move and cast the model before "
        "wrapping it (StreamedModelOptions::device and compute_dtype say where and in what the streamed weights "
        "compute)",
        b.block.name, name, c10::toString(now.scalar_type()), now.device().str(),
        c10::toString(c10::typeMetaToScalarType(wrapped.dtype())), wrapped.device().str()));
  }

  void attach(BlockState& b, const ad::BlockView& view, bool trainable) {
    torch::NoGradGuard no_grad;
    for (std::size_t i = 0; i < b.streamed.size(); ++i) {
      StreamedParam& p = b.streamed[i];
      torch::Tensor w = torch::from_blob(view.tensors[i].bf16, p.shape,
                                         torch::TensorOptions().dtype(torch::kBFloat16).device(options.device));
      if (options.compute_dtype != torch::kBFloat16) w = w.to(options.compute_dtype);
      p.param.set_data(w);
      p.param.set_requires_grad(trainable && p.master.requires_grad());
    }
  }

  void detach(BlockState& b) {
    torch::NoGradGuard no_grad;
    for (StreamedParam& p : b.streamed) p.param.set_data(torch::empty({0}, compute));
  }

  // ---- passes --------------------------------------------------------------------------------

  // The plugin's step ends too, marked as failed (a NaN loss), so that its hooks stay paired.
  void end_plugin_step_as_failed() {
    sp_step_feedback_v1 feedback = step_transfer.to_feedback();
    feedback.loss = std::numeric_limits<double>::quiet_NaN();
    feedback.step_seconds = std::chrono::duration<double>(Clock::now() - step_start).count();
    policy->end_step(step, feedback);
  }

  void require_step(const char* call) const {
    if (!in_step) throw std::logic_error(fmt::format("StreamedModel::{}: no step is active; call begin_step()", call));
  }

  void add_transfer(const ad::StepTransferMetrics& m) {
    ad::StepTransferMetrics& t = step_transfer;
    t.h2d_bytes_bf16 += m.h2d_bytes_bf16;
    t.h2d_bytes_int8 += m.h2d_bytes_int8;
    t.h2d_bytes_nf4 += m.h2d_bytes_nf4;
    t.h2d_bytes_all_bf16 += m.h2d_bytes_all_bf16;
    t.fetches_bf16 += m.fetches_bf16;
    t.fetches_int8 += m.fetches_int8;
    t.fetches_nf4 += m.fetches_nf4;
    t.fetches_bf16_by_transfer_policy += m.fetches_bf16_by_transfer_policy;
    t.fetches_int8_by_transfer_policy += m.fetches_int8_by_transfer_policy;
    t.fetches_pinned += m.fetches_pinned;
    t.prefetch_hits += m.prefetch_hits;
    t.prefetch_misses += m.prefetch_misses;
    t.prefetch_unused += m.prefetch_unused;
    t.stalls += m.stalls;
    t.stall_seconds += m.stall_seconds;
    t.image_rebuilds += m.image_rebuilds;
    ++report.training_passes;
  }

  // A grad-mode forward whose backward never ran (the graph was dropped): its pass ends here.
  void close_abandoned_pass(const char* why) {
    if (pass == Pass::none) return;
    if (pass == Pass::in_backward) {
      throw std::logic_error(fmt::format(
          "StreamedModel::{}: the backward of the current training pass stopped before block 0; a pass's backward "
          "must run through every block",
          why));
    }
    log->debug("StreamedModel: a training pass ended without a backward ({})", why);
    add_transfer(engine->end_step());
    pass = Pass::none;
  }

  // ---- evaluation passes: the evaluation engine, forward only, one block at a time ----------

  void begin_eval_pass(const ad::RuntimeLimitHints& limits) {
    if (eval_open) end_eval_pass();  // one the host left before its last block
    for (std::uint32_t b = 0; b < blocks.size(); ++b) {
      if (!eval_image_stale[b]) continue;
      refresh_eval_image(b);
      eval_image_stale[b] = false;
    }
    eval_engine->begin_step(eval_engine_steps++, limits);
    eval_open = true;
    eval_next = 0;
  }

  ad::StepTransferMetrics end_eval_pass() {
    eval_open = false;
    return eval_engine->end_step();
  }

  // Block b's turn in the open evaluation pass: run(weights) computes it on its delivered
  // weights. The block is released, and the pass ended, even when run() throws.
  template <typename Run>
  auto eval_block(std::uint32_t b, Run&& run) {
    const ad::BlockView& view = eval_engine->acquire(b);
    attach(blocks[b], view, false);
    try {
      auto out = run(blocks[b].weights);
      detach(blocks[b]);
      eval_engine->release(b);
      eval_next = b + 1;
      return out;
    } catch (...) {
      detach(blocks[b]);
      eval_engine->release(b);
      end_eval_pass();
      throw;
    }
  }

  // A whole evaluation pass under `limits` (calibration's); run(b, weights) computes block b.
  template <typename Run>
  void eval_pass(const ad::RuntimeLimitHints& limits, std::uint64_t& bytes, Run&& run) {
    begin_eval_pass(limits);
    for (std::uint32_t b = 0; b < blocks.size(); ++b) {
      eval_block(b, [&](const NamedParameters& weights) {
        run(b, weights);
        return 0;
      });
    }
    const ad::StepTransferMetrics m = end_eval_pass();
    bytes += m.h2d_bytes_bf16 + m.h2d_bytes_int8 + m.h2d_bytes_nf4;
  }

  // A no-grad call of block b: block 0 opens an evaluation pass, the last one ends it.
  std::vector<torch::Tensor> eval_forward(std::uint32_t b, const std::vector<torch::Tensor>& inputs,
                                          const BlockCall& call) {
    if (b == 0) {
      wait_for_updates();  // the evaluation engine reads the masters
      require_current_images("forward");
      begin_eval_pass({});
    } else {
      require_in_order(b, eval_open ? eval_next : 0, "an evaluation pass (no grad)");
    }
    std::vector<torch::Tensor> out =
        eval_block(b, [&](const NamedParameters& weights) { return call(inputs, weights); });
    if (eval_next == blocks.size()) {
      const ad::StepTransferMetrics m = end_eval_pass();
      const std::uint64_t bytes = m.h2d_bytes_bf16 + m.h2d_bytes_int8 + m.h2d_bytes_nf4;
      evaluation_bytes += bytes;
      report.eval_h2d_bytes += bytes;
    }
    return out;
  }

  void require_in_order(std::uint32_t b, std::uint32_t expected, const char* pass_kind) const {
    if (b == expected) return;
    throw std::logic_error(fmt::format(
        "StreamedModel: {} was called where {} came next: {} calls every streamed block once, in order from "
        "block 0 (the streaming engine fetches them ahead in that order)",
        blocks[b].block.name, expected < blocks.size() ? blocks[expected].block.name : std::string("block 0"),
        pass_kind));
  }

  // ---- training passes: forward, then the backward's recompute -----------------------------

  // A grad-mode call of block b, inside a step: block 0 opens a training pass.
  std::vector<torch::Tensor> train_forward(std::uint32_t b, const std::vector<torch::Tensor>& inputs,
                                           BlockCall call);

  // Inside the autograd node's forward: block b on its delivered weights, without a graph.
  std::vector<torch::Tensor> forward_block(std::uint32_t b, const std::vector<torch::Tensor>& inputs) {
    const ad::BlockView& view = engine->acquire(b);
    attach(blocks[b], view, false);
    blocks[b].forward_state = ForwardState::capture(options.device);
    std::vector<torch::Tensor> out;
    try {
      out = blocks[b].pass_call(inputs, blocks[b].weights);
    } catch (...) {
      detach(blocks[b]);
      engine->release(b);
      throw;
    }
    detach(blocks[b]);
    engine->release(b);
    return out;
  }

  // Recomputes block b's forward on the delivered weights and differentiates it. Returns the
  // gradient of each block input (undefined for those that need none), then one per trainable
  // resident parameter.
  variable_list backward_block(std::uint32_t b, std::uint64_t id, const variable_list& xs,
                               const variable_list& grad_outs) {
    if (id != pass_id || pass == Pass::none) {
      throw std::logic_error(fmt::format(
          "StreamedModel: backward through {} of a training pass that has ended (a later grad-mode forward, or "
          "post_backward(), closed it); run each pass's backward before the next grad-mode forward",
          blocks[b].block.name));
    }
    if (next_forward != blocks.size()) {
      const std::string stopped = blocks[next_forward].block.name;
      abandon_pass();
      throw std::logic_error(fmt::format(
          "StreamedModel: the backward reached {} of a training pass whose forward stopped before {}: a training "
          "pass calls every streamed block, in order, before its backward",
          blocks[b].block.name, stopped));
    }
    pass = Pass::in_backward;
    BlockState& block = blocks[b];
    const ad::BlockView& view = engine->acquire(b);
    attach(block, view, true);
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
        const ReplayedForward replayed(*block.forward_state);
        outputs = block.pass_call(inputs, block.weights);
      }
      if (outputs.size() != grad_outs.size()) {
        throw std::logic_error(fmt::format("StreamedModel: {}'s recompute returned {} tensors where its forward returned {}",
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
        if (p.param.requires_grad()) wrt.push_back(p.param);
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
      if (!unlisted.leaves.empty() && collectives) {
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
      engine->release(b);
      abandon_pass();
      throw;
    }
    detach(block);
    engine->release(b);

    std::size_t next = input_slots.size();
    ReducingBucket bucket;
    std::vector<torch::Tensor> flat;
    std::vector<StreamedParam*> staged_here;
    for (StreamedParam& p : block.streamed) {
      if (!p.master.requires_grad()) continue;
      torch::Tensor g = grads[next++];
      // Every rank's bucket holds every trainable parameter, whether or not it got a gradient here.
      if (!g.defined() && collectives) g = torch::zeros(p.shape, p.master.options());
      if (!g.defined()) continue;
      if (collectives && !p.staging.defined()) {
        bucket.params.push_back(&p);
        flat.push_back(g.reshape({-1}).to(gradient_reduction_device(), torch::kFloat32));
        continue;
      }
      stage_master_gradient(p, g.reshape(p.shape));
      if (p.staged) staged_here.push_back(&p);
    }
    // The update during the backward: what must happen, on the worker, before the block's
    // gradient is final on the host.
    const bool update_now = armed && block.trainable_masters && owns(b) && !armed->begun[b];
    std::function<void()> gradient_ready;
    if (!flat.empty()) {
      // Started now, so that it runs while the backward goes on through the blocks before.
      bucket.bucket = torch::cat(flat);
      const std::string what = fmt::format("gradients of {}", block.block.name);
      bucket.pending = sharded ? collectives->reduce(bucket.bucket, owner(b), Reduction::sum, what)
                               : collectives->all_reduce(bucket.bucket, Reduction::sum, what);
      if (update_now) {
        auto owned = std::make_shared<ReducingBucket>(std::move(bucket));
        gradient_ready = [this, owned] {
          owned->pending->wait();
          fold_averaged(owned->params, owned->bucket);
        };
      } else {
        reducing.push_back(std::move(bucket));
      }
    }
    if (update_now && !staged_here.empty()) {
      if (collectives) {
        // Staged gradients of several ranks are reduced in one bucket at the pass's end.
        deferred_updates[b] = true;
      } else {
        ad::Event& copied = gradient_copied_event(b);
        backend->record(copied, ad::Queue::compute);
        for (StreamedParam* p : staged_here) p->staged = false;
        gradient_ready = [this, &copied, staged_here] {
          backend->synchronize(copied);
          for (StreamedParam* p : staged_here) add_to_master_grad(*p, p->staging);
        };
      }
    }
    variable_list out(xs.size());
    for (std::size_t i = 0; i < input_slots.size(); ++i) out[input_slots[i]] = grads[i];
    for (std::size_t i = 0; i < block.trainable_resident.size(); ++i) {
      torch::Tensor g = grads[next++];
      if (!g.defined() && collectives) g = torch::zeros_like(block.trainable_resident[i]);
      out.push_back(g);
    }
    // Summed over the pass's blocks, and added to each one's .grad once, at the pass's end.
    for (const UnlistedLeaf& leaf : unlisted.leaves) {
      torch::Tensor g = grads[next++];
      if (!g.defined()) continue;
      const auto same = [&](const UnlistedLeaf& l) { return l.tensor.is_same(leaf.tensor); };
      const auto it = std::find_if(pass_unlisted.begin(), pass_unlisted.end(), same);
      if (it == pass_unlisted.end()) {
        pass_unlisted.push_back(leaf);
        pass_unlisted_grads.push_back(std::move(g));
      } else {
        torch::Tensor& sum = pass_unlisted_grads[static_cast<std::size_t>(it - pass_unlisted.begin())];
        sum = sum + g;
      }
    }
    if (collectives) {
      // Averaged before autograd adds them to the .grad, into tensors of their own (autograd's
      // may alias the upstream gradient, or be expanded views): every rank's resident
      // parameters see the same gradient, whatever the host does next.
      const auto first_resident = out.begin() + static_cast<std::ptrdiff_t>(xs.size());
      std::vector<torch::Tensor> resident(first_resident, out.end());
      try {
        resident = averaged(resident, fmt::format("gradients of {}'s resident parameters", block.block.name));
      } catch (...) {
        abandon_pass();
        throw;
      }
      std::copy(resident.begin(), resident.end(), first_resident);
    }
    try {
      if (update_now && !deferred_updates[b]) begin_block_update(b, std::move(gradient_ready));
    } catch (...) {
      abandon_pass();
      throw;
    }
    if (pass_end_block && b == *pass_end_block) finish_pass();
    return out;
  }

  ad::Event& gradient_copied_event(std::uint32_t b) {
    if (gradient_copied.empty()) gradient_copied.resize(blocks.size());
    if (!gradient_copied[b]) gradient_copied[b] = backend->create_event();
    return *gradient_copied[b];
  }

  // Begins block b's armed update: its slab is picked here, the sweep runs on the worker once
  // `gradient_ready` (if any) has made the gradient final on the host.
  void begin_block_update(std::uint32_t b, std::function<void()> gradient_ready) {
    // Everything that can fail to allocate comes before the engine marks the block busy, and
    // `running` has room for every block (reserved when armed), so that the entry is in place
    // before the task that uses it exists.
    RunningUpdate running_update;
    running_update.block = b;
    running_update.update = std::make_unique<ad::StreamingEngine::WeightUpdate>();
    running_update.skipped = std::make_shared<bool>(false);
    *running_update.update = engine->begin_update(b);
    armed->begun[b] = true;
    ad::StreamingEngine::WeightUpdate* update = running_update.update.get();
    bool* skipped = running_update.skipped.get();
    const BlockState* block = &blocks[b];
    const std::map<std::string, MasterMoments>* moments = &armed->moments[b];
    const kn::AdamWStep step = armed->step;
    running.push_back(std::move(running_update));
    try {
      running.back().done = worker.submit([=, ready = std::move(gradient_ready)] {
        if (ready) ready();
        if (!gradients_finite(*block)) {
          *skipped = true;
          return;
        }
        update->run(step, fused_update_tensors(*block, *moments));
      });
    } catch (...) {
      engine->finish_update(*update);  // never ran: a cancel
      running.pop_back();
      throw;
    }
  }

  // Waits for the updates begun in the backward and installs their images. Every update is
  // waited for before the first error is rethrown.
  void wait_for_updates() {
    std::exception_ptr first_error;
    for (RunningUpdate& r : running) {
      bool ok = true;
      try {
        r.done.get();
      } catch (...) {
        ok = false;
        if (!first_error) first_error = std::current_exception();
      }
      try {
        engine->finish_update(*r.update);
      } catch (...) {
        ok = false;
        if (!first_error) first_error = std::current_exception();
      }
      if (!ok) continue;
      if (*r.skipped) {
        report.updates_skipped.push_back(r.block);
        log->warn("StreamedModel: step {}: {} was not updated: its gradient holds a non-finite element", step,
                  blocks[r.block].block.name);
      } else {
        eval_image_stale[r.block] = true;
      }
      updated_in_step[r.block] = true;
    }
    running.clear();
    if (first_error) std::rethrow_exception(first_error);
  }

  // The fused update of one block now, for the route in force (update_masters(), and the armed
  // blocks the backward did not reach), skipping a non-finite gradient when `skip_nonfinite`.
  void update_block(std::uint32_t b, const kn::AdamWStep& adam, const std::map<std::string, MasterMoments>& moments,
                    bool skip_nonfinite) {
    std::vector<kn::AdamWTensor> tensors = fused_update_tensors(blocks[b], moments);
    if (skip_nonfinite && !gradients_finite(blocks[b])) {
      report.updates_skipped.push_back(b);
      log->warn("StreamedModel: step {}: {} was not updated: its gradient holds a non-finite element", step,
                blocks[b].block.name);
    } else {
      engine->update_weights(b, adam, tensors);
      eval_image_stale[b] = true;
    }
    updated_in_step[b] = true;
  }

  // The master's gradient, accumulated across passes. On a GPU it travels to pinned staging
  // without a host sync; the pass's end folds it in after one synchronization.
  void stage_master_gradient(StreamedParam& p, const torch::Tensor& g) {
    if (p.staging.defined()) {
      p.staging.copy_(g, /*non_blocking=*/true);
      p.staged = true;
      grads_staged = true;
      return;
    }
    add_to_master_grad(p, g.to(torch::kCPU, torch::kFloat32));
  }

  // The first contribution is copied: it is a view (of the backward's result, reshaped) or the
  // staging buffer the next pass reuses, and a .grad must own its storage (zero_grad() detaches
  // it in place).
  static void add_to_master_grad(StreamedParam& p, const torch::Tensor& g) {
    torch::Tensor& grad = p.master.mutable_grad();
    if (grad.defined()) {
      grad.add_(g);
    } else {
      grad = g.clone();
    }
  }

  // A pass cut short (an exception in its backward, or a step aborted): the collectives in
  // flight are waited for and dropped, the engine's pass ends, the model takes new passes.
  // Gradients already folded into the masters stay: the host discards the step's.
  void abandon_pass() noexcept {
    try {
      wait_for_updates();
    } catch (const std::exception& e) {
      log->warn("StreamedModel: an update during the backward of an abandoned pass failed: {}", e.what());
    }
    armed.reset();
    pass_unlisted.clear();
    pass_unlisted_grads.clear();
    std::fill(deferred_updates.begin(), deferred_updates.end(), false);
    for (ReducingBucket& r : reducing) {
      try {
        r.pending->wait();
      } catch (const std::exception& e) {
        log->warn("StreamedModel: dropping an all-reduce of an abandoned pass: {}", e.what());
      }
    }
    reducing.clear();
    try {
      if (pass != Pass::none) engine->end_step();
    } catch (const std::exception& e) {
      log->warn("StreamedModel: ending an abandoned pass: {}", e.what());
    }
    pass = Pass::none;
    grads_staged = false;
    for (BlockState& b : blocks) {
      for (StreamedParam& p : b.streamed) p.staged = false;
    }
  }

  void finish_pass() {
    try {
      for (ReducingBucket& r : reducing) r.pending->wait();
      // Into .grad as autograd accumulates it. (Its tensor hooks ran in each block's grad(), on that
      // block's share; post-accumulate-grad hooks do not run.)
      std::vector<UnlistedLeaf> leaves = std::move(pass_unlisted);
      std::vector<torch::Tensor> sums = std::move(pass_unlisted_grads);
      pass_unlisted.clear();
      pass_unlisted_grads.clear();
      for (std::size_t i = 0; i < leaves.size(); ++i) (*leaves[i].accumulate)({std::move(sums[i])});
    } catch (...) {
      abandon_pass();
      throw;
    }
    add_transfer(engine->end_step());
    pass = Pass::none;
    for (ReducingBucket& r : reducing) fold_averaged(r.params, r.bucket);
    reducing.clear();
    if (!grads_staged) return;
    backend->record(*compute_done, ad::Queue::compute);
    backend->synchronize(*compute_done);
    std::vector<StreamedParam*> staged;
    for (BlockState& b : blocks) {
      for (StreamedParam& p : b.streamed) {
        if (!p.staged) continue;
        staged.push_back(&p);
        p.staged = false;
      }
    }
    if (collectives) {
      // On a GPU the gradients reach the host only here: one bucket for the whole pass.
      std::vector<torch::Tensor> flat;
      for (StreamedParam* p : staged) flat.push_back(p->staging.reshape({-1}));
      torch::Tensor bucket = torch::cat(flat);
      collectives->all_reduce(bucket, Reduction::sum, "gradients of the pass")->wait();
      fold_averaged(staged, bucket);
    } else {
      for (StreamedParam* p : staged) add_to_master_grad(*p, p->staging);
    }
    grads_staged = false;
    std::vector<std::uint32_t> deferred;
    for (std::uint32_t b = 0; b < deferred_updates.size(); ++b) {
      if (deferred_updates[b]) deferred.push_back(b);
    }
    std::fill(deferred_updates.begin(), deferred_updates.end(), false);
    try {
      for (std::uint32_t b : deferred) begin_block_update(b, {});
    } catch (...) {
      abandon_pass();
      throw;
    }
  }

  // A bucket of summed gradients, one slice per parameter in order, divided by the ranks. A
  // bucket reduced on the device crosses to the host here, and only to a rank that keeps one of
  // its parameters (sharded, the owner).
  void fold_averaged(const std::vector<StreamedParam*>& params, const torch::Tensor& summed) {
    if (std::none_of(params.begin(), params.end(), [&](const StreamedParam* p) { return owns(p->block); })) return;
    torch::Tensor bucket = summed.to(torch::kCPU);
    bucket.div_(collectives->size());
    std::int64_t offset = 0;
    for (StreamedParam* p : params) {
      const std::int64_t n = c10::multiply_integers(p->shape);
      if (owns(p->block)) add_to_master_grad(*p, bucket.narrow(0, offset, n).view(p->shape));
      offset += n;
    }
  }

  // The mean across ranks of tensors of any dtype and shape (one bucket), as new tensors.
  std::vector<torch::Tensor> averaged(const std::vector<torch::Tensor>& tensors, const std::string& what) {
    if (!collectives || tensors.empty()) return tensors;
    std::vector<torch::Tensor> flat;
    for (const torch::Tensor& t : tensors) flat.push_back(t.reshape({-1}).to(torch::kFloat32));
    torch::Tensor bucket = torch::cat(flat);
    collectives->all_reduce(bucket, Reduction::sum, what)->wait();
    bucket.div_(collectives->size());
    std::vector<torch::Tensor> out;
    std::int64_t offset = 0;
    for (const torch::Tensor& t : tensors) {
      out.push_back(bucket.narrow(0, offset, t.numel()).view(t.sizes()).to(t.scalar_type()).clone());
      offset += t.numel();
    }
    return out;
  }

  // The same, into the tensors themselves (gradients the host owns).
  void average_in_place(const std::vector<torch::Tensor>& tensors, const std::string& what) {
    if (!collectives || tensors.empty()) return;
    const std::vector<torch::Tensor> means = averaged(tensors, what);
    torch::NoGradGuard no_grad;
    for (std::size_t i = 0; i < tensors.size(); ++i) tensors[i].copy_(means[i]);
  }

  // Every rank's plugin hints must be the same: the blocks where they differ, by name.
  void check_ranks_agree(const std::vector<std::int32_t>& values, const std::string& what) {
    if (!collectives) return;
    const torch::Tensor mine = torch::tensor(values, torch::kInt32);
    torch::Tensor high = mine.clone(), low = mine.clone();
    auto max = collectives->all_reduce(high, Reduction::max, what);
    auto min = collectives->all_reduce(low, Reduction::min, what);
    max->wait();
    min->wait();
    std::vector<std::string> differ;
    for (std::size_t b = 0; b < values.size(); ++b) {
      if (high[b].item<std::int32_t>() != low[b].item<std::int32_t>()) {
        differ.push_back(fmt::format("{} ({} to {})", b < blocks.size() ? blocks[b].block.name : "plugin",
                                     low[b].item<std::int32_t>(), high[b].item<std::int32_t>()));
      }
    }
    if (!differ.empty()) {
      throw RankMismatchError(fmt::format("step {}: rank {} of {}: {} differ across ranks for {}", step,
                                          collectives->rank(), collectives->size(), what, fmt::join(differ, ", ")));
    }
  }

  // ---- policy --------------------------------------------------------------------------------

  void apply_hints(const std::vector<sp_hint_v1>& hints) {
    if (hints.empty()) return;
    engine->policy_bridge().set_plugin_hints(hints.data(), static_cast<std::uint32_t>(hints.size()));
    eval_engine->policy_bridge().set_plugin_hints(hints.data(), static_cast<std::uint32_t>(hints.size()));
    applied_hints = hints;
  }

  std::vector<sp_grad_moments_v1> block_moments() {
    std::vector<torch::Tensor> keep;  // host copies of device gradients, alive for the call
    std::vector<kn::GradTensor> tensors;
    const auto add = [&](const torch::Tensor& g, std::uint32_t b) {
      if (!g.defined()) return;
      torch::Tensor host = g.device().is_cpu() && g.scalar_type() == torch::kFloat32 && g.is_contiguous()
                               ? g
                               : g.to(torch::kCPU, torch::kFloat32).contiguous();
      keep.push_back(host);
      tensors.push_back({host.data_ptr<float>(), static_cast<std::size_t>(host.numel()), kn::DType::kFloat32, b});
    };
    for (std::uint32_t b = 0; b < blocks.size(); ++b) {
      if (!owns(b)) continue;
      if (!blocks[b].moment_sources.empty()) {
        for (const torch::Tensor& t : blocks[b].moment_sources) add(t.grad(), b);
      } else if (blocks[b].trainable_masters) {
        for (const StreamedParam& p : blocks[b].streamed) add(p.master.grad(), b);
      } else {
        for (const torch::Tensor& r : blocks[b].trainable_resident) add(r.grad(), b);
      }
    }
    std::vector<sp_grad_moments_v1> out(blocks.size());
    kn::grad_moments(tensors.data(), tensors.size(), static_cast<std::uint32_t>(blocks.size()), out.data());
    if (sharded) gather_moments(out);
    return out;
  }

  std::vector<sp_precision> current_routes() const {
    std::vector<sp_precision> routes;
    for (std::uint32_t b = 0; b < blocks.size(); ++b)
      routes.push_back(ad::abi_precision(engine->policy_bridge().route(b)));
    return routes;
  }

  // ---- calibration ---------------------------------------------------------------------------

  // Every block of the evaluation engine on one route for a whole pass: a runtime pin, which
  // neither the plugin's hints nor a transfer gate override, since the errors describe the
  // formats, not what pays on this machine.
  ad::RuntimeLimitHints pinned_to(sp_precision precision) const {
    ad::RuntimeLimitHints limits;
    for (std::uint32_t b = 0; b < blocks.size(); ++b) limits.block_precision_map[b] = route_of(precision);
    return limits;
  }

  CalibrationErrors measure_calibration_errors(const std::vector<torch::Tensor>& samples) {
    if (in_step) throw std::logic_error("StreamedModel: calibrate between steps, not inside one");
    if (samples.empty()) throw std::invalid_argument("StreamedModel: calibration without samples");
    for (const BlockState& b : blocks) {
      if (b.params_are_masters) {
        throw std::logic_error(fmt::format(
            "StreamedModel: calibration feeds each block the output of the one before, one tensor; {} computes "
            "through Block::call, whose inputs the layer cannot make up",
            b.block.name));
      }
    }
    torch::NoGradGuard no_grad;
    const std::size_t n = blocks.size();
    CalibrationErrors errors{std::vector<double>(n, 0.0), std::vector<double>(n, 0.0)};
    const auto on_host = [](const torch::Tensor& t) { return t.to(torch::kCPU, torch::kFloat32).contiguous(); };
    // One route at a time over every sample, so that a sharded model shares each route's
    // images once: the BF16 outputs of every block are kept for the quantized passes.
    std::vector<std::vector<torch::Tensor>> references;
    share_eval_images(ad::Precision::bf16);
    for (const torch::Tensor& sample : samples) {
      std::vector<torch::Tensor>& reference = references.emplace_back(std::vector<torch::Tensor>{sample});
      eval_pass(pinned_to(SP_PRECISION_BF16), calibration_bytes,
                [&](std::uint32_t b, const NamedParameters&) {
                  reference.push_back(blocks[b].block.forward(reference.back()));
                });
    }
    for (auto [precision, sums] :
         {std::pair{SP_PRECISION_INT8, &errors.int8}, std::pair{SP_PRECISION_NF4, &errors.nf4}}) {
      share_eval_images(route_of(precision));
      for (const std::vector<torch::Tensor>& reference : references) {
        eval_pass(pinned_to(precision), calibration_bytes, [&, sums = sums](std::uint32_t b, const NamedParameters&) {
          const torch::Tensor quantized = on_host(blocks[b].block.forward(reference[b]));
          const torch::Tensor expected = on_host(reference[b + 1]);
          (*sums)[b] += kn::relative_error(expected.data_ptr<float>(), kn::DType::kFloat32, quantized.data_ptr<float>(),
                                           kn::DType::kFloat32, static_cast<std::size_t>(expected.numel()));
        });
      }
    }
    // The evaluation images are the pinned route's now: the next evaluation takes the routes in
    // force again (rebuilt by the owner, copied elsewhere).
    if (sharded) eval_image_stale.assign(blocks.size(), true);
    // The last pass's pins would stand until the next evaluation pass; dropped now, so that an
    // image rebuilt in between is built for the route the block takes next.
    eval_engine->policy_bridge().begin_step();
    for (double& e : errors.int8) e /= static_cast<double>(samples.size());
    for (double& e : errors.nf4) e /= static_cast<double>(samples.size());
    return errors;
  }

  bool set_calibration_errors(CalibrationErrors& errors) {
    if (collectives) {
      // Measured on every rank from the same weights and samples, but given from rank 0, so
      // that no rounding difference between machines can split the ranks' decisions.
      torch::Tensor values =
          torch::empty({static_cast<std::int64_t>(errors.int8.size() + errors.nf4.size())}, torch::kFloat64);
      std::copy(errors.int8.begin(), errors.int8.end(), values.data_ptr<double>());
      std::copy(errors.nf4.begin(), errors.nf4.end(), values.data_ptr<double>() + errors.int8.size());
      collectives->broadcast(values, 0, "calibration errors");
      std::copy_n(values.data_ptr<double>(), errors.int8.size(), errors.int8.begin());
      std::copy_n(values.data_ptr<double>() + errors.int8.size(), errors.nf4.size(), errors.nf4.begin());
    }
    bool accepted = true;
    for (const auto& [precision, values, name] :
         {std::tuple{SP_PRECISION_INT8, &errors.int8, "INT8"}, std::tuple{SP_PRECISION_NF4, &errors.nf4, "NF4"}}) {
      if (policy->set_calibration_errors(precision, *values)) continue;
      log->warn("calibration: the plugin rejected the {} errors; it decides without them", name);
      accepted = false;
    }
    return accepted;
  }
};

// The autograd node of one streamed block: its forward fetches the block and runs it without
// a graph; its backward fetches it again, recomputes and differentiates (see backward_block).
namespace {

// The models alive, by id: a graph that outlives its model (closed, or replaced while a loss
// was kept) finds it gone, instead of reading freed memory, and a backward keeps its model
// alive until it returns.
std::mutex g_models_mutex;
std::unordered_map<std::int64_t, std::weak_ptr<StreamedModel::Impl>> g_models;
std::int64_t g_next_model_id = 1;

std::shared_ptr<StreamedModel::Impl> live_model(std::int64_t id) {
  std::lock_guard<std::mutex> lock(g_models_mutex);
  const auto it = g_models.find(id);
  return it == g_models.end() ? nullptr : it->second.lock();
}

}  // namespace

struct StreamedBlockFunction : public torch::autograd::Function<StreamedBlockFunction> {
  // `anchors`: what the node takes besides the block's inputs (BlockState::autograd_inputs), so
  // that autograd routes their gradients.
  static variable_list forward(AutogradContext* ctx, StreamedModel::Impl* impl, std::int64_t block,
                               std::int64_t pass, at::TensorList inputs, at::TensorList anchors) {
    ctx->saved_data["block"] = block;
    ctx->saved_data["pass"] = pass;
    ctx->saved_data["model"] = impl->id;
    ctx->saved_data["anchors"] = static_cast<std::int64_t>(anchors.size());
    ctx->save_for_backward(inputs.vec());
    variable_list outputs = impl->forward_block(static_cast<std::uint32_t>(block), inputs.vec());
    variable_list integral;
    for (const torch::Tensor& y : outputs) {
      if (y.defined() && !y.is_floating_point() && !y.is_complex()) integral.push_back(y);
    }
    ctx->mark_non_differentiable(integral);
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const std::shared_ptr<StreamedModel::Impl> impl = live_model(ctx->saved_data["model"].toInt());
    const auto block = static_cast<std::uint32_t>(ctx->saved_data["block"].toInt());
    if (!impl) {
      throw std::logic_error(
          fmt::format("StreamedModel: backward through block {} of a model that was destroyed or closed", block));
    }
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

std::vector<torch::Tensor> StreamedModel::Impl::train_forward(std::uint32_t b, const std::vector<torch::Tensor>& inputs,
                                                              BlockCall call) {
  if (b != 0) require_in_order(b, pass == Pass::forwarded ? next_forward : 0, "a training pass");
  require_step("forward");
  if (after_backward) {
    throw std::logic_error("StreamedModel::forward: post_backward() already ran in this step; call end_step()");
  }
  if (b == 0) {
    close_abandoned_pass("forward");
    if (armed && std::find(armed->begun.begin(), armed->begun.end(), true) != armed->begun.end()) {
      throw std::logic_error(
          "StreamedModel::forward: update_masters_during_backward() updated the masters in this step's last backward; "
          "call post_backward() (a pass after it would add gradients that no update sees)");
    }
    wait_for_updates();  // the pass fetches the blocks they update
    if (options.recalibrate_every != 0) last_input = inputs.at(0).detach();
    engine->begin_step(engine_steps++);
    pass = Pass::forwarded;
    ++pass_id;
    pass_end_block.reset();
    next_forward = 0;
  }
  BlockState& block = blocks[b];
  block.pass_call = std::move(call);
  // The backward reaches down to the lowest block whose node exists: whose inputs need a
  // gradient, or which trains something itself.
  const bool node = !block.autograd_inputs.empty() ||
                    std::any_of(inputs.begin(), inputs.end(), [](const torch::Tensor& x) { return x.defined() && x.requires_grad(); });
  std::vector<torch::Tensor> out;
  try {
    out = StreamedBlockFunction::apply(this, static_cast<std::int64_t>(b), static_cast<std::int64_t>(pass_id),
                                       at::TensorList(inputs), at::TensorList(block.autograd_inputs));
  } catch (...) {
    engine->end_step();
    pass = Pass::none;
    throw;
  }
  if (node && !pass_end_block) pass_end_block = b;
  next_forward = b + 1;
  return out;
}

std::unique_ptr<sp::host::PolicySession> open_policy_session(const ad::StreamingEngine& engine,
                                                             const std::filesystem::path& plugin_file,
                                                             sp::host::PolicyConfig config, std::string host_name,
                                                             std::filesystem::path output_dir,
                                                             std::shared_ptr<spdlog::logger> logger,
                                                             std::chrono::milliseconds hook_deadline) {
  std::vector<sp::host::BlockDescription> blocks;
  for (const sp_block_desc_v1& d : engine.block_descs()) {
    sp::host::BlockDescription block;
    block.id = d.block_id;
    block.num_params = d.num_params;
    block.bf16_bytes = d.bf16_bytes;
    block.int8_bytes = d.int8_bytes;
    block.nf4_bytes = engine.nf4_image_bytes(d.block_id);
    block.name = d.name;
    blocks.push_back(std::move(block));
  }
  sp::host::PolicyHostOptions host;
  host.host_name = std::move(host_name);
  host.output_dir = std::move(output_dir);
  host.logger = std::move(logger);
  host.fallback = sp::host::FallbackMode::last_good;
  host.hook_deadline = hook_deadline;
  host.supported_precisions =
      SP_PRECISION_BIT(SP_PRECISION_BF16) | SP_PRECISION_BIT(SP_PRECISION_INT8) | SP_PRECISION_BIT(SP_PRECISION_NF4);
  return std::make_unique<sp::host::PolicySession>(plugin_file, std::move(config), std::move(blocks), std::move(host));
}

StreamedModel::StreamedModel(std::vector<Block> blocks, StreamedModelOptions options)
    : impl_(std::make_shared<Impl>(std::move(blocks), std::move(options))) {
  std::lock_guard<std::mutex> lock(g_models_mutex);
  impl_->id = g_next_model_id++;
  g_models.emplace(impl_->id, impl_);
}

StreamedModel::~StreamedModel() {
  std::lock_guard<std::mutex> lock(g_models_mutex);
  g_models.erase(impl_->id);
}

std::uint32_t StreamedModel::num_blocks() const { return static_cast<std::uint32_t>(impl_->blocks.size()); }

std::vector<torch::Tensor> StreamedModel::master_parameters() const {
  std::vector<torch::Tensor> out;
  for (std::uint32_t b = 0; b < impl_->blocks.size(); ++b) {
    if (!impl_->owns(b)) continue;
    for (const StreamedParam& p : impl_->blocks[b].streamed) out.push_back(p.master);
  }
  return out;
}

const std::map<std::string, torch::Tensor>& StreamedModel::masters(std::uint32_t block) const {
  return impl_->blocks.at(block).masters;
}

std::vector<torch::Tensor> StreamedModel::resident_parameters() const {
  std::vector<torch::Tensor> out;
  for (const BlockState& b : impl_->blocks) out.insert(out.end(), b.resident.begin(), b.resident.end());
  return out;
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
  if (block == 0) m.check_parameters_unchanged();
  if (!call) call = m.blocks[block].call;
  if (!torch::GradMode::is_enabled()) return m.eval_forward(block, inputs, call);
  return m.train_forward(block, inputs, std::move(call));
}

std::int64_t StreamedModel::next_step() const { return impl_->last_step ? *impl_->last_step + 1 : 0; }

void StreamedModel::begin_step(std::int64_t step) {
  Impl& m = *impl_;
  if (m.in_step) {
    throw std::logic_error(
        fmt::format("StreamedModel::begin_step({}): step {} has not ended; call end_step()", step, m.step));
  }
  if (step < 0) throw std::invalid_argument(fmt::format("StreamedModel::begin_step({}): steps start at 0", step));
  if (m.last_step && step <= *m.last_step) {
    throw std::invalid_argument(fmt::format(
        "StreamedModel::begin_step({}): step {} already began, and steps must increase over the whole run (the "
        "policy's windows are counted in steps): number them across epochs, and after restore_state() go on from "
        "step {}",
        step, *m.last_step, *m.last_step + 1));
  }
  m.require_current_images(fmt::format("begin_step({})", step));
  m.policy->begin_step(step);
  m.last_step = step;
  m.report = StepReport{};
  m.report.step = step;
  m.report.swap = m.policy->take_swap_outcome();
  m.step_transfer = ad::StepTransferMetrics{};
  m.step_transfer.step = step;
  m.step = step;
  m.step_start = Clock::now();
  try {
    if (m.collectives) {
      // Every rank was asked to swap at this boundary (poll_plugin): each must have the same
      // outcome, or their plugins would now differ.
      const bool swapped = m.report.swap && m.report.swap->outcome == sp::host::SwapResult::Outcome::swapped;
      m.check_ranks_agree({swapped ? 1 : 0}, "plugin swap outcomes (1: swapped)");
    }
    // Routes that moved since the images were last shared (hints restored, or a step aborted
    // after its post_backward) get their owners' images before the first fetch.
    m.share_images(/*all=*/false, /*trained=*/false);
  } catch (...) {
    m.end_plugin_step_as_failed();  // it began: the next begin_step can then come
    throw;
  }
  m.in_step = true;
  m.after_backward = false;
  m.updated_in_step.assign(m.blocks.size(), false);
  m.armed.reset();
}

const std::vector<sp_grad_moments_v1>& StreamedModel::post_backward() {
  Impl& m = *impl_;
  m.require_step("post_backward");
  if (m.after_backward) throw std::logic_error("StreamedModel::post_backward: already called in this step");
  m.close_abandoned_pass("post_backward");
  m.wait_for_updates();
  std::vector<sp_grad_moments_v1> moments = m.block_moments();
  // The plugin takes the blocks that have gradient elements (ABI: the others are left out).
  std::vector<sp_grad_moments_v1> measured;
  for (const sp_grad_moments_v1& block : moments) {
    if (block.count != 0) measured.push_back(block);
  }
  const bool any_trains = std::any_of(m.blocks.begin(), m.blocks.end(), [&](const BlockState& b) {
    return b.trainable_masters || !b.trainable_resident.empty() ||
           std::any_of(b.moment_sources.begin(), b.moment_sources.end(),
                       [](const torch::Tensor& t) { return t.requires_grad(); });
  });
  // Blocks with nothing to train (the host trains only its own parameters) report none.
  if (measured.empty() && any_trains) {
    throw std::logic_error(fmt::format(
        "StreamedModel::post_backward: no block has a gradient in step {}: no backward ran through the streamed "
        "blocks since begin_step(), or their gradients were cleared before this call. Run the backward first; to "
        "drop a step without one, call abort_step()",
        m.step));
  }
  m.moments = std::move(moments);
  m.policy->post_backward(m.step, measured);
  m.apply_hints(m.policy->compute_hints(m.step));
  if (m.collectives) {
    std::vector<std::int32_t> precisions(m.blocks.size(), -1);
    for (const sp_hint_v1& h : m.applied_hints) precisions[h.block_id] = h.precision;
    m.check_ranks_agree(precisions, "the plugin's hints");
  }
  m.after_backward = true;
  if (m.armed) {
    // Armed blocks whose backward did not run (no training pass, or one that ended above them).
    const Impl::ArmedUpdate armed = std::move(*m.armed);
    m.armed.reset();
    for (std::uint32_t b = 0; b < m.blocks.size(); ++b) {
      if (m.blocks[b].trainable_masters && m.owns(b) && !armed.begun[b]) {
        m.update_block(b, armed.step, armed.moments[b], /*skip_nonfinite=*/true);
      }
    }
  }
  return m.moments;
}

StepReport StreamedModel::end_step(double loss) {
  Impl& m = *impl_;
  m.require_step("end_step");
  if (!m.after_backward) {
    throw std::logic_error(
        "StreamedModel::end_step: call post_backward() first: the plugin's hints must reach the engines before "
        "the images of the updated weights are rebuilt");
  }
  refresh_images();
  sp_step_feedback_v1 feedback = m.step_transfer.to_feedback();
  feedback.loss = loss;
  feedback.step_seconds = std::chrono::duration<double>(Clock::now() - m.step_start).count();
  m.policy->end_step(m.step, feedback);
  m.in_step = false;
  m.after_backward = false;
  const std::uint32_t every = m.options.recalibrate_every;
  if (every != 0 && m.last_input.defined() && (m.step + 1) % every == 0) {
    // On the updated weights, between steps (where the ABI takes calibration errors): the
    // plugin decides with them from the next step on.
    const auto start = Clock::now();
    m.report.calibration = m.measure_calibration_errors({m.last_input});
    m.set_calibration_errors(*m.report.calibration);
    m.report.calibration_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  }
  StepReport report = m.report;
  report.h2d_bytes_bf16 = m.step_transfer.h2d_bytes_bf16;
  report.h2d_bytes_int8 = m.step_transfer.h2d_bytes_int8;
  report.h2d_bytes_nf4 = m.step_transfer.h2d_bytes_nf4;
  report.h2d_bytes_all_bf16 = m.step_transfer.h2d_bytes_all_bf16;
  report.routes = m.current_routes();
  return report;
}

void StreamedModel::abort_step() {
  Impl& m = *impl_;
  m.abandon_pass();
  if (!m.in_step) return;
  m.in_step = false;
  m.after_backward = false;
  m.end_plugin_step_as_failed();
}

void StreamedModel::refresh_images() {
  Impl& m = *impl_;
  for (std::uint32_t b = 0; b < m.blocks.size(); ++b) {
    // A frozen block's masters change only when the host loads or edits them.
    if (!m.owns(b) || (!m.blocks[b].trainable_masters && !m.changed_master(b))) continue;
    const bool written_by_update = m.updated_in_step[b];
    m.updated_in_step[b] = false;
    // update_masters() wrote its image; the host changed its masters since, or not.
    if (written_by_update && !m.changed_master(b)) continue;
    m.engine->on_weights_updated(b);
    m.eval_image_stale[b] = true;
  }
  m.share_images(/*all=*/false, /*trained=*/true);
  m.note_image_versions();
}

void StreamedModel::update_masters(std::uint32_t block, const sp::kernels::AdamWStep& step,
                                   const std::map<std::string, MasterMoments>& moments) {
  Impl& m = *impl_;
  m.require_step("update_masters");
  if (!m.after_backward) {
    throw std::logic_error(
        "StreamedModel::update_masters: call post_backward() first: the image is written for the route the plugin "
        "decides there");
  }
  if (block >= m.blocks.size()) {
    throw std::invalid_argument(fmt::format("StreamedModel::update_masters: block {} is out of range (there are {})",
                                            block, m.blocks.size()));
  }
  if (!m.owns(block)) {
    throw std::logic_error(fmt::format(
        "StreamedModel::update_masters: {} is owned by rank {}, which updates it (shard_masters); this is rank {}",
        m.blocks[block].block.name, m.owner(block), rank()));
  }
  if (m.updated_in_step[block]) {
    throw std::logic_error(fmt::format("StreamedModel::update_masters: block {} was already updated in step {}",
                                       m.blocks[block].block.name, m.step));
  }
  m.update_block(block, step, moments, /*skip_nonfinite=*/false);
}

void StreamedModel::update_masters_during_backward(const sp::kernels::AdamWStep& step,
                                                   std::vector<std::map<std::string, MasterMoments>> moments) {
  Impl& m = *impl_;
  m.require_step("update_masters_during_backward");
  if (m.after_backward) {
    throw std::logic_error(
        "StreamedModel::update_masters_during_backward: post_backward() already ran in this step; use "
        "update_masters()");
  }
  if (m.pass == Impl::Pass::in_backward) {
    throw std::logic_error(
        "StreamedModel::update_masters_during_backward: a backward is running; arm the update before it starts");
  }
  if (m.armed) {
    throw std::logic_error(
        fmt::format("StreamedModel::update_masters_during_backward: already armed in step {}", m.step));
  }
  if (moments.size() != m.blocks.size()) {
    throw std::invalid_argument(
        fmt::format("StreamedModel::update_masters_during_backward: {} moment maps for {} blocks; give one per block",
                    moments.size(), m.blocks.size()));
  }
  for (std::uint32_t b = 0; b < m.blocks.size(); ++b) {
    if (!m.blocks[b].trainable_masters || !m.owns(b)) continue;
    for (const StreamedParam& p : m.blocks[b].streamed) {
      if (moments_of(moments[b], p.name) == nullptr) {
        throw std::invalid_argument(fmt::format(
            "StreamedModel::update_masters_during_backward: {}.{} has no AdamW moments (exp_avg and exp_avg_sq) in "
            "the map given",
            m.blocks[b].block.name, p.name));
      }
    }
  }
  m.running.reserve(m.blocks.size());
  m.armed = Impl::ArmedUpdate{step, std::move(moments), std::vector<bool>(m.blocks.size(), false)};
}

CalibrationErrors StreamedModel::calibrate(const std::vector<torch::Tensor>& samples) {
  CalibrationErrors errors = impl_->measure_calibration_errors(samples);
  impl_->set_calibration_errors(errors);
  return errors;
}

CalibrationErrors StreamedModel::measure_calibration_errors(const std::vector<torch::Tensor>& samples) {
  return impl_->measure_calibration_errors(samples);
}

bool StreamedModel::set_calibration_errors(const CalibrationErrors& errors) {
  if (impl_->in_step) throw std::logic_error("StreamedModel::set_calibration_errors: call it between steps");
  CalibrationErrors given = errors;
  return impl_->set_calibration_errors(given);
}

void StreamedModel::set_transfer_gate(sp::adapters::TransferGate gate) {
  impl_->engine->policy_bridge().set_transfer_gate(gate);
  impl_->eval_engine->policy_bridge().set_transfer_gate(std::move(gate));
}

std::optional<sp::host::SwapResult> StreamedModel::poll_plugin(bool force) {
  if (impl_->in_step) throw std::logic_error("StreamedModel::poll_plugin: call it between steps");
  Impl& m = *impl_;
  if (!m.collectives) return m.policy->check_for_new_version(force);
  // Rank 0 looks at the file; every rank then asks for the swap at the same step boundary.
  std::optional<sp::host::SwapResult> request;
  if (m.collectives->rank() == 0) request = m.policy->check_for_new_version(force);
  torch::Tensor requested =
      torch::tensor({request && request->outcome != sp::host::SwapResult::Outcome::failed ? 1 : 0}, torch::kInt32);
  m.collectives->broadcast(requested, 0, "plugin swap request");
  if (requested.item<std::int32_t>() == 0) return request;
  if (m.collectives->rank() != 0) request = m.policy->check_for_new_version(/*force=*/true);
  // All or nothing: the lowest rank that could not stage the new version, or the world size
  // when every rank did. Where one failed, every rank drops its staged copy and keeps the old.
  const bool staged = request && request->outcome == sp::host::SwapResult::Outcome::pending;
  torch::Tensor first_failure = torch::tensor({staged ? m.collectives->size() : m.collectives->rank()}, torch::kInt32);
  m.collectives->all_reduce(first_failure, Reduction::min, "plugin swap staging")->wait();
  const int failed_rank = first_failure.item<std::int32_t>();
  if (failed_rank == m.collectives->size()) return request;
  const std::string why =
      fmt::format("rank {} of {} could not load the new version, so every rank keeps the old one{}", failed_rank,
                  m.collectives->size(), staged ? "" : fmt::format(" ({})", request ? request->message : "no file"));
  if (staged) return m.policy->cancel_swap(why);
  if (request) request->message = why;
  return request;
}

std::map<std::string, torch::Tensor> StreamedModel::export_state() const {
  const Impl& m = *impl_;
  if (m.in_step) throw std::logic_error("StreamedModel::export_state: call it between steps");
  std::map<std::string, torch::Tensor> state;
  for (std::uint32_t b = 0; b < m.blocks.size(); ++b) {
    if (!m.owns(b)) continue;
    for (const StreamedParam& p : m.blocks[b].streamed) state.emplace(master_key(m.blocks[b], p), p.master.detach());
  }
  std::vector<std::uint8_t> blob;
  try {
    blob = m.policy->export_state();
  } catch (const sp::host::PluginError& e) {
    // The rest of the state is the run's: a checkpoint without the plugin's beats none. An
    // empty entry says so, and a resume starts the policy over (restore_state).
    m.log->error(
        "StreamedModel: the plugin's state is left out of this state ({}); a resume from it starts the "
        "policy over",
        e.what());
  }
  state.emplace("policy/state", torch::from_blob(const_cast<std::uint8_t*>(blob.data()),
                                                 {static_cast<std::int64_t>(blob.size())}, torch::kUInt8)
                                    .clone());
  torch::Tensor hints =
      torch::empty({static_cast<std::int64_t>(m.applied_hints.size() * sizeof(sp_hint_v1))}, torch::kUInt8);
  if (!m.applied_hints.empty()) std::memcpy(hints.data_ptr(), m.applied_hints.data(), hints.numel());
  state.emplace("policy/hints", hints);
  state.emplace("layer/passes", torch::tensor({m.engine_steps, m.eval_engine_steps}, torch::kInt64));
  state.emplace("layer/last_step", torch::tensor({m.last_step.value_or(-1)}, torch::kInt64));
  return state;
}

void StreamedModel::restore_state(const std::map<std::string, torch::Tensor>& state) {
  Impl& m = *impl_;
  if (m.in_step) throw std::logic_error("StreamedModel::restore_state: call it between steps");
  if (!m.sharded) {
    m.restore_state(state);
    return;
  }
  // Sharded, the ranks then share their blocks' images: a rank that could not restore must
  // not leave the others waiting in that exchange, so all first learn whether every one did.
  std::exception_ptr failure;
  try {
    m.restore_state(state);
  } catch (...) {
    failure = std::current_exception();
  }
  const int size = m.collectives->size();
  torch::Tensor first_failure = torch::tensor({failure ? rank() : size}, torch::kInt32);
  m.collectives->all_reduce(first_failure, Reduction::min, "state restore outcomes")->wait();
  if (failure) std::rethrow_exception(failure);
  const int failed = first_failure.item<std::int32_t>();
  if (failed != size) {
    throw RankMismatchError(fmt::format(
        "StreamedModel::restore_state: rank {} of {} could not restore its state (it says why), so no rank goes on "
        "from it",
        failed, size));
  }
  m.share_images(/*all=*/true, /*trained=*/false);
}

std::uint64_t StreamedModel::image_bytes(std::uint32_t block, sp_precision precision) const {
  return impl_->engine->image_bytes(block, route_of(precision));
}

const sp::host::PolicySession& StreamedModel::policy() const { return *impl_->policy; }

std::vector<sp_precision> StreamedModel::routes() const { return impl_->current_routes(); }

const std::vector<sp_hint_v1>& StreamedModel::hints() const { return impl_->applied_hints; }

std::uint64_t StreamedModel::evaluation_h2d_bytes() const { return impl_->evaluation_bytes; }

std::uint64_t StreamedModel::calibration_h2d_bytes() const { return impl_->calibration_bytes; }

void StreamedModel::flush_metrics() { impl_->engine->flush_metrics(); }

std::uint64_t StreamedModel::metrics_records_lost() const { return impl_->engine->metrics_records_lost(); }

bool StreamedModel::sharded() const { return impl_->sharded; }
torch::Device StreamedModel::gradient_reduction_device() const { return impl_->gradient_reduction_device(); }

int StreamedModel::owner(std::uint32_t block) const {
  if (block >= impl_->blocks.size()) {
    throw std::invalid_argument(fmt::format("StreamedModel::owner: block {} is out of range (there are {})", block,
                                            impl_->blocks.size()));
  }
  return impl_->owner(block);
}

int StreamedModel::rank() const { return impl_->collectives ? impl_->collectives->rank() : 0; }

int StreamedModel::world_size() const { return impl_->collectives ? impl_->collectives->size() : 1; }

Collectives* StreamedModel::collectives() const { return impl_->collectives.get(); }

void StreamedModel::average_gradients(const std::vector<torch::Tensor>& parameters) {
  std::vector<torch::Tensor> grads;
  for (const torch::Tensor& p : parameters) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  impl_->average_in_place(grads, "gradients of the host's parameters");
}

double StreamedModel::average(double value) {
  if (!impl_->collectives) return value;
  torch::Tensor sum = torch::tensor({value}, torch::kFloat64);
  impl_->collectives->all_reduce(sum, Reduction::sum, "mean across ranks")->wait();
  return sum.item<double>() / impl_->collectives->size();
}

}  // namespace sp::torch_layer
