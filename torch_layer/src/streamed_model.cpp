// StreamedModel: a block's adoption (its masters, the engines, the policy) and the public accessors.
#include "streamed_model_impl.h"

#include <yaml-cpp/yaml.h>

#include "sp/kernels/nf4.h"

namespace sp::torch_layer {

StateEntryError::StateEntryError(std::string entry, const std::string& detail)
    : ErrorAs(ErrorKind::bad_input, fmt::format("StreamedModel::restore_state: '{}': {}", entry, detail)),
      entry_(std::move(entry)),
      detail_(detail) {}

namespace {

// The NF4 group size, stated once: the option, else the policy section's nf4_group_size, else 64
// (sp/kernels/nf4.h). YAML this cannot read is left to the plugin, which names the error.
std::uint32_t nf4_group_size(const StreamedModelOptions& options) {
  std::optional<std::int64_t> in_config;
  try {
    const YAML::Node document = YAML::Load(options.config_yaml);
    YAML::Node section = document["selective_precision"];
    if (!section && document["memory"] && document["memory"]["stagehand"]) {
      section = document["memory"]["stagehand"]["selective_precision"];
    }
    if (section && section.IsMap() && section["nf4_group_size"]) {
      in_config = section["nf4_group_size"].as<std::int64_t>();
    }
  } catch (const YAML::Exception&) {
  }
  if (options.nf4_group_size == 0) {
    return in_config ? static_cast<std::uint32_t>(*in_config) : kn::kNf4DefaultGroupSize;
  }
  if (in_config && *in_config != static_cast<std::int64_t>(options.nf4_group_size)) {
    throw std::invalid_argument(fmt::format(
        "nf4_group_size is {} (the layer's option), but {} sets the policy's nf4_group_size to {}; state it once "
        "(leave the option unset to take the policy's)",
        options.nf4_group_size, options.config_source, *in_config));
  }
  return options.nf4_group_size;
}

}  // namespace

StreamedModel::Impl::Impl(std::vector<Block> in, StreamedModelOptions opts)
    : options(std::move(opts)), log(options.logger) {
  if (!log) log = spdlog::default_logger();
  options.nf4_group_size = nf4_group_size(options);
  compute = torch::TensorOptions().dtype(options.compute_dtype).device(options.device);
  if (in.empty()) throw std::invalid_argument("StreamedModel: there are no blocks");
  shards.connect(options.collectives, options.shard_masters, policy_link);
  const bool recompute = options.recompute.value_or(shards.group() != nullptr);
  if (!recompute && shards.group()) {
    throw std::invalid_argument(
        "StreamedModelOptions::recompute is false with collectives: with data parallelism each block's backward "
        "averages its resident parameters' gradients across the ranks, which needs the recompute; leave it unset "
        "or set it to true");
  }
  backward = recompute ? make_recompute_backward(*this) : make_kept_backward(*this);
  reducer.connect(shards.shared_group(), [this](std::uint32_t b) { return shards.owns(b); });
  if (shards.group()) reducer.probe(options.device, *log);
  refuse_shared_parameters(in);
  assign_units(in);
  const BlockGroup::Adoption adoption{options.device, compute, recomputes(),
                                      options.device.is_cuda() && !reducer.reduces_on_device()};
  for (std::size_t b = 0; b < in.size(); ++b)
    blocks.emplace_back(std::move(in[b]), static_cast<std::uint32_t>(b), adoption);
  const auto called = [](const BlockGroup& b) { return b.params_are_masters; };
  if (options.recalibrate_every != 0 && std::any_of(blocks.begin(), blocks.end(), called)) {
    throw std::invalid_argument(
        "StreamedModelOptions::recalibrate_every: re-calibration feeds each block the output of the one before, one "
        "tensor, and these blocks compute through Block::call; set it to 0");
  }
  build_engines();
  if (shards.sharded()) shard_masters();
  build_policy();
  // A route the policy forces holds from the first fetch, of a step or of an inference pass.
  if (policy_link.session().take_initial_hints()) route_first_hints();
  if (!options.transfer_policy.empty()) apply_transfer_policy(options.transfer_policy);
  note_image_versions();
}

void StreamedModel::Impl::assign_units(const std::vector<Block>& in) {
  const auto block_count = static_cast<std::uint32_t>(in.size());
  std::vector<std::uint32_t> unit_of;
  std::vector<std::string> unit_names;
  if (options.units.empty()) {
    for (std::uint32_t b = 0; b < block_count; ++b) {
      unit_of.push_back(b);
      unit_names.push_back(in[b].name.empty() ? fmt::format("block{}", b) : in[b].name);  // as BlockGroup names it
    }
    policy_link.set_units(std::move(unit_of), std::move(unit_names));
    return;
  }
  for (std::uint32_t u = 0; u < options.units.size(); ++u) {
    const PolicyUnit& unit = options.units[u];
    if (unit.blocks == 0 || unit_of.size() + unit.blocks > block_count) {
      throw std::invalid_argument(fmt::format(
          "StreamedModelOptions::units[{}] ('{}') takes {} blocks from block {}, but there are {}: the units cover "
          "the blocks in order, each block once, each unit at least one",
          u, unit.name, unit.blocks, unit_of.size(), block_count));
    }
    if (unit.name.empty()) throw std::invalid_argument(fmt::format("StreamedModelOptions::units[{}] has no name", u));
    unit_of.insert(unit_of.end(), unit.blocks, u);
    unit_names.push_back(unit.name);
  }
  if (unit_of.size() != block_count) {
    throw std::invalid_argument(fmt::format(
        "StreamedModelOptions::units cover {} of the {} blocks: the units cover the blocks in order, each block once",
        unit_of.size(), block_count));
  }
  if (unit_names.size() != block_count && options.recalibrate_every != 0) {
    throw std::invalid_argument(
        "StreamedModelOptions::recalibrate_every with units of several blocks: calibration errors are measured per "
        "block; set it to 0 (policy v3 decides without them)");
  }
  policy_link.set_units(std::move(unit_of), std::move(unit_names));
}

void StreamedModel::Impl::rebuild_changed_images(const std::string& call) {
  for (std::uint32_t b = 0; b < blocks.size(); ++b) {
    if (!shards.owns(b)) continue;
    const StreamedParameter* changed = blocks[b].changed_master();
    if (changed == nullptr) continue;
    if (shards.sharded()) {
      throw std::logic_error(fmt::format(
          "StreamedModel::{}: {}'s master '{}' changed after its transfer images were built. With sharded masters "
          "the ranks share each image at collective points only: change the masters between post_backward() and "
          "end_step() (an optimizer step), or call refresh_images() on every rank after changing them",
          call, blocks[b].block.name, changed->name));
    }
    engines.train->on_weights_updated(b);
    blocks[b].images_rebuilt();
  }
}

std::vector<std::int64_t> StreamedModel::Impl::trainable_versions() const {
  std::vector<std::int64_t> versions;
  for (std::uint32_t b = 0; b < blocks.size(); ++b) {
    if (shards.owns(b)) blocks[b].append_trainable_versions(versions);
  }
  return versions;
}

StreamedModel::Impl::~Impl() {
  // Nor must an update still write the masters and a slab.
  try {
    wait_for_updates();
  } catch (const std::exception& e) {
    log->warn("StreamedModel: an update during the backward failed: {}", e.what());
  }
  // The engines must not outlive a pass that an exception cut short.
  try {
    passes.abandon();
  } catch (const std::exception& e) {
    log->warn("StreamedModel: closing the open training pass: {}", e.what());
  }
  try {
    if (evaluation.is_open()) evaluation.end_pass();
  } catch (const std::exception& e) {
    log->warn("StreamedModel: closing the open evaluation pass: {}", e.what());
  }
  // The blocks outlive the backend (declared before it): their events go while it is there.
  for (BlockGroup& block : blocks) block.drop_events();
}

void StreamedModel::Impl::refuse_shared_parameters(const std::vector<Block>& in) {
  // Where each tensor was first met: its block's index, and "block's 'name'" for the message.
  std::map<const c10::TensorImpl*, std::pair<std::size_t, std::string>> first_place;
  for (std::size_t b = 0; b < in.size(); ++b) {
    if (!in[b].parameters) continue;  // BlockGroup refuses it by name
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

void StreamedModel::Impl::build_engines() {
  std::vector<ad::BlockSpec> specs;
  for (const BlockGroup& b : blocks) {
    ad::BlockSpec spec;
    spec.name = b.block.name;
    for (const StreamedParameter& p : b.streamed) {
      spec.tensors.push_back(ad::TensorSpec{p.name, p.master.data_ptr<float>(), p.rows, p.cols});
    }
    specs.push_back(std::move(spec));
  }
  for (BlockGroup& b : blocks) {
    for (StreamedParameter& p : b.streamed) p.note_engine_storage();
  }
  ad::StreamingConfig config;
  config.prefetch_window = options.prefetch_window;
  config.int8_group_size = options.int8_group_size;
  config.nf4_group_size = options.nf4_group_size;
  ad::size_streaming_config(config, specs, options.spare_slabs);
  config.backward = true;
  config.metrics_path = options.metrics_path;
  config.host_exec = intra_op_exec();
  engines.backend = make_backend(options);
  engines.train = std::make_unique<ad::StreamingEngine>(*engines.backend, config, specs);
  config.backward = false;
  config.metrics_path.clear();
  engines.eval = std::make_unique<ad::StreamingEngine>(*engines.backend, config, specs);
  evaluation.use_engine(*engines.eval);
  passes.use_engine(*engines.train, *log);
  engines.compute_done = engines.backend->create_event();
}

void StreamedModel::Impl::build_policy() {
  PolicyLink::AgreeAcrossRanks agree;
  if (shards.group()) {
    agree = [this](const std::vector<std::int32_t>& values, const std::string& what) {
      check_ranks_agree(values, what);
    };
  }
  policy_link.open(*engines.train, options.plugin_file,
                   sp::host::PolicyConfig{options.config_yaml, options.config_source}, options.host_name,
                   options.output_dir, log, options.plugin_hook_deadline, std::move(agree));
}

std::unique_ptr<sp::host::PolicySession> open_policy_session(const ad::StreamingEngine& engine,
                                                             const std::filesystem::path& plugin_file,
                                                             sp::host::PolicyConfig config, std::string host_name,
                                                             std::filesystem::path output_dir,
                                                             std::shared_ptr<spdlog::logger> logger,
                                                             std::chrono::milliseconds hook_deadline) {
  return policy_session_per_block(engine, plugin_file, std::move(config), std::move(host_name), std::move(output_dir),
                                  std::move(logger), hook_deadline);
}

StreamedModel::StreamedModel(std::vector<Block> blocks, StreamedModelOptions options)
    : impl_(std::make_shared<Impl>(std::move(blocks), std::move(options))) {
  impl_->self = impl_;
}

StreamedModel::~StreamedModel() = default;

std::uint32_t StreamedModel::num_blocks() const { return static_cast<std::uint32_t>(impl_->blocks.size()); }

std::uint32_t StreamedModel::num_units() const { return impl_->num_units(); }

std::uint32_t StreamedModel::unit_of(std::uint32_t block) const {
  if (block >= impl_->blocks.size()) {
    throw std::invalid_argument(
        fmt::format("StreamedModel::unit_of: block {} is out of range (there are {})", block, impl_->blocks.size()));
  }
  return impl_->policy_link.unit_of(block);
}

std::vector<torch::Tensor> StreamedModel::master_parameters() const {
  std::vector<torch::Tensor> out;
  for (std::uint32_t b = 0; b < impl_->blocks.size(); ++b) {
    if (!impl_->shards.owns(b)) continue;
    for (const StreamedParameter& p : impl_->blocks[b].streamed) out.push_back(p.master);
  }
  return out;
}

const std::map<std::string, torch::Tensor>& StreamedModel::masters(std::uint32_t block) const {
  return impl_->blocks.at(block).masters;
}

std::vector<torch::Tensor> StreamedModel::resident_parameters() const {
  std::vector<torch::Tensor> out;
  for (const BlockGroup& b : impl_->blocks) out.insert(out.end(), b.resident.begin(), b.resident.end());
  return out;
}

std::int64_t StreamedModel::next_step() const { return impl_->step_state.next(); }

std::uint64_t StreamedModel::image_bytes(std::uint32_t block, Precision precision) const {
  return impl_->engines.train->image_bytes(block, precision);
}

const sp::host::PolicySession& StreamedModel::policy() const { return impl_->policy_link.session(); }

std::vector<Precision> StreamedModel::routes() const { return impl_->current_routes(); }
std::vector<std::vector<Precision>> StreamedModel::unit_routes() const {
  return impl_->policy_link.unit_routes(impl_->current_routes());
}

const std::vector<sp::host::UnitHint>& StreamedModel::hints() const { return impl_->policy_link.session().hints(); }

std::uint64_t StreamedModel::evaluation_h2d_bytes() const { return impl_->evaluation.evaluation_bytes(); }

std::uint64_t StreamedModel::calibration_h2d_bytes() const { return impl_->evaluation.calibration_bytes(); }

void StreamedModel::flush_metrics() { impl_->engines.train->flush_metrics(); }

std::uint64_t StreamedModel::metrics_records_lost() const { return impl_->engines.train->metrics_records_lost(); }

bool StreamedModel::sharded() const { return impl_->shards.sharded(); }

bool StreamedModel::recomputes() const { return impl_->recomputes(); }

void StreamedModel::set_compute_dtype(torch::Dtype dtype) {
  Impl& m = *impl_;
  if (m.step_state.in_step()) {
    throw std::logic_error(fmt::format("StreamedModel::set_compute_dtype({}): inside step {}; call it between steps",
                                       c10::toString(dtype), m.step_state.number()));
  }
  if (!c10::isFloatingType(dtype)) {
    throw std::invalid_argument(fmt::format(
        "StreamedModel::set_compute_dtype: {} is not a floating-point dtype", c10::toString(dtype)));
  }
  m.options.compute_dtype = dtype;
  m.compute = m.compute.dtype(dtype);
  for (BlockGroup& b : m.blocks) b.set_compute_dtype(m.compute);
}

torch::Device StreamedModel::gradient_reduction_device() const { return impl_->gradient_reduction_device(); }

int StreamedModel::owner(std::uint32_t block) const {
  if (block >= impl_->blocks.size()) {
    throw std::invalid_argument(
        fmt::format("StreamedModel::owner: block {} is out of range (there are {})", block, impl_->blocks.size()));
  }
  return impl_->shards.owner(block);
}

int StreamedModel::rank() const { return impl_->shards.rank(); }

int StreamedModel::world_size() const { return impl_->shards.group() ? impl_->shards.group()->size() : 1; }

Collectives* StreamedModel::collectives() const { return impl_->shards.group(); }

void StreamedModel::average_gradients(const std::vector<torch::Tensor>& parameters) {
  std::vector<torch::Tensor> grads;
  for (const torch::Tensor& p : parameters) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  impl_->reducer.average_in_place(grads, "gradients of the host's parameters");
}

double StreamedModel::average(double value) {
  if (!impl_->shards.group()) return value;
  torch::Tensor sum = torch::tensor({value}, torch::kFloat64);
  impl_->shards.group()->all_reduce(sum, Reduction::sum, "mean across ranks")->wait();
  return sum.item<double>() / impl_->shards.group()->size();
}

}  // namespace sp::torch_layer
