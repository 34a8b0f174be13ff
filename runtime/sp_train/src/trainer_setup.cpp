// sp-train's setup: joining the ranks and agreeing with them, the run directory, the model, the
// streaming layer, the optimizer, and calibration.
#include "trainer_impl.h"

#include <algorithm>
#include <cctype>

namespace sp::train {

namespace {

constexpr std::uint64_t kCalibrationSalt = 0xca11b7a7e5eedull;

// A count torchrun passes in the environment (LOCAL_RANK, LOCAL_WORLD_SIZE): `fallback` when
// unset; anything but a whole number of at least `minimum` is refused by name, where atoi
// would have read it as 0.
int environment_count(const char* name, int fallback, int minimum) {
  const char* text = std::getenv(name);
  if (text == nullptr) return fallback;
  const char* end = text + std::strlen(text);
  int value = 0;
  const auto [stop, error] = std::from_chars(text, end, value);
  if (text == end || error != std::errc() || stop != end || value < minimum) {
    throw ConfigError(
        fmt::format("environment variable {}='{}': a whole number of at least {} expected (as "
                    "torchrun sets it)",
                    name, text, minimum));
  }
  return value;
}

// Cuts a JSONL log back to its leading complete records whose `key` is below `step`: on
// resume the steps after the checkpoint run again and must not appear twice, and a fresh run
// starts its logs empty. In place, with one truncate: the plugin and the transfer engine
// already hold the file open for appending, and a replaced file would lose their writes.
void keep_records_before(const fs::path& file, const char* key, std::int64_t step) {
  std::ifstream in(file, std::ios::binary);
  if (!in) return;
  std::uintmax_t kept_bytes = 0;
  std::string line;
  while (std::getline(in, line) && !in.eof()) {
    const nlohmann::json record = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!record.is_object() || !record.contains(key) || !record[key].is_number_integer() ||
        record[key].get<std::int64_t>() >= step) {
      break;
    }
    kept_bytes += line.size() + 1;
  }
  in.close();
  std::error_code error;
  if (fs::file_size(file, error) != kept_bytes && !error) fs::resize_file(file, kept_bytes, error);
  if (error)
    throw std::runtime_error(
        fmt::format("{}: cannot cut it back to the records before step {}: {}", file.string(), step, error.message()));
}

// The device and dtype of the model's math. Checked before anything is built: a LibTorch
// without CUDA would otherwise fail deep inside the first GPU allocation.
torch::TensorOptions compute_options(const TrainConfig& config) {
  const bool bf16 = config.train.compute_dtype == ComputeDtype::bf16;
  torch::TensorOptions options = torch::TensorOptions().dtype(bf16 ? torch::kBFloat16 : torch::kFloat32);
  if (config.train.device == ComputeDevice::cpu) return options.device(torch::kCPU);
  if (!torch::cuda::is_available()) {
    throw ConfigError(
        fmt::format("{}: train.device: cuda, but LibTorch sees no CUDA device (this LibTorch was built "
                    "without CUDA, or no GPU is visible); use train.device: cpu",
                    config.source_name));
  }
  // Data-parallel ranks on one node take one GPU each (torchrun's LOCAL_RANK).
  const int index = environment_count("LOCAL_RANK", 0, 0);
  const int devices = static_cast<int>(torch::cuda::device_count());  // its type changed within 2.x
  if (index >= devices) {
    throw ConfigError(fmt::format("{}: train.device: cuda, but LOCAL_RANK={} and this node has {} GPU(s)",
                                  config.source_name, index, devices));
  }
  return options.device(torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index)));
}

std::uint64_t hash_tensor(const torch::Tensor& t, std::uint64_t state) {
  const torch::Tensor c = t.contiguous();
  return sp::runtime::fnv1a64(c.data_ptr(), static_cast<std::size_t>(c.numel()) * c.element_size(), state);
}

}  // namespace

Trainer::Impl::Impl(TrainConfig cfg, RunOptions opts)
    : config(std::move(cfg)), options(std::move(opts)), log(options.logger), compute(compute_options(config)) {
  if (!log) log = spdlog::default_logger();
  n_blocks = config.model.n_blocks;
  if (config.train.threads != 0) torch::set_num_threads(static_cast<int>(config.train.threads));
  join_ranks();
  // Nothing in the run directory is rewritten until everything that can reject the run has
  // passed: a mistyped resume must not lose the directory's config or logs.
  prepare_run_directory();
  run_lock = std::make_unique<RunDirectoryLock>(run_dir);
  for (const fs::path& stale :
       remove_stale_temporaries(run_dir, {kRunCheckpointFile, kRunSummaryFile, kRunConfigFile}, {kShardPrefix}))
    log->info("removed {}, left by a write that was killed", stale.string());
  // Before the plugin is loaded: its create() is the first call that can crash the run.
  previous_crash = take_crash_marker(run_dir / kCrashMarkerFile);
  if (previous_crash) log->error("the previous run in {} crashed: {}", run_dir.string(), *previous_crash);
  if (options.crash_marker) install_crash_marker(run_dir / kCrashMarkerFile);

  corpus = std::make_unique<TextCorpus>(config.data.path, config.data.val_fraction, config.data.chunk_bytes,
                                        config.model.seq_len);
  log->info("data: {} file(s) from {}: {} train bytes, {} validation bytes", corpus->stats().files, config.data.path,
            corpus->stats().train_bytes, corpus->stats().val_bytes);
  resident_before_build = resident_bytes();
  refuse_what_cannot_fit();

  std::optional<CheckpointSections> checkpoint = find_checkpoint();
  if (checkpoint)
    next_step = read_checkpoint_meta(*checkpoint, checkpoint_path(options.out_dir)).at("next_step").get<std::int64_t>();
  agree_across_ranks();

  model = std::make_unique<GptModel>(config.model, config.train.mode, config.train.lora, config.train.seed, compute);
  if (!checkpoint) {
    if (!config.train.init_checkpoint.empty()) load_initial_weights(config.train.init_checkpoint);
    // A resumed run's masters carry the outliers already.
    model->plant_outlier_channels(config.train.seed);
  }
  // Of the initial weights, which the layer then takes over (sharded, each rank keeps only
  // its own blocks' masters).
  std::optional<nlohmann::json> calibration_id;
  if (!checkpoint && config.policy_keys.run_calibration) calibration_id = calibration_identity();
  build_layer();
  build_optimizer();
  // The layer set the transfer gate before anything streamed. Calibration does not depend on
  // it: the layer pins its routes, and a pin outranks the gate.
  if (checkpoint) {
    restore(*checkpoint);
  } else if (config.policy_keys.run_calibration) {
    calibrate(*calibration_id);
    const std::optional<sp_budget_status_v1> budget = layer->budget_status();
    calibration_step_due = budget && budget->kind != SP_BUDGET_NONE && budget->reads_step_signals != 0;
  }

  sp::runtime::write_file_atomically(run_dir / kRunConfigFile, config.resolved_yaml);
  keep_records_before(run_dir / kRunTrainMetricsFile, "step", next_step);
  if (!config.streaming.metrics_file.empty()) {
    keep_records_before(run_dir / config.streaming.metrics_file, "step", next_step);
  }
  if (config.policy_keys.telemetry_enabled) {
    keep_records_before(run_dir / config.policy_keys.telemetry_file, "step_id", next_step);
  }
  train_metrics = std::make_unique<ad::MetricsJsonlWriter>(run_dir / kRunTrainMetricsFile);
}

void Trainer::Impl::join_ranks() {
  try {
    collectives = tl::from_environment(std::chrono::seconds(config.train.collective_timeout_seconds), compute.device());
  } catch (const std::invalid_argument& e) {
    throw ConfigError(e.what());
  } catch (const tl::CollectiveError& e) {
    throw DistributedError(e.what());
  }
  run_dir = rank() == 0 ? options.out_dir : options.out_dir / fmt::format("rank{}", rank());
  if (collectives) {
    log->info("data parallel: rank {} of {}, run files in {}", rank(), world_size(), run_dir.string());
  }
}

void Trainer::Impl::refuse_what_cannot_fit() const {
  // Ranks on one node share its memory (torchrun's LOCAL_WORLD_SIZE).
  const auto ranks_here = static_cast<std::uint64_t>(environment_count("LOCAL_WORLD_SIZE", 1, 1));
  const std::uint64_t needed = estimated_host_bytes(config, shards()) * ranks_here;
  const std::uint64_t available = available_host_bytes();
  if (available == 0 || needed <= available) return;
  const ModelConfig& m = config.model;
  throw ConfigError(fmt::format(
      "{}: model.d_model {} x model.n_blocks {} (mlp_ratio {}, train.mode {}, train.batch_size {}) needs about "
      "{:.1f} "
      "GiB of host memory for the ranks on this node (fp32 masters{}, the transfer images of two engines, "
      "activations); this machine has {:.1f} "
      "GiB available (MemAvailable); lower model.d_model, model.n_blocks or train.batch_size, or train in lora mode",
      config.source_name, m.d_model, m.n_blocks, m.mlp_ratio, mode_name(config.train.mode), config.train.batch_size,
      needed / 1073741824.0, config.train.mode == TrainMode::full ? ", their gradients and AdamW moments" : "",
      available / 1073741824.0));
}

void Trainer::Impl::agree_across_ranks() {
  if (!collectives) return;
  const std::string plugin_bytes = [&] {
    std::ifstream in(plugin_file(), std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }();
  const std::vector<std::pair<const char*, std::int64_t>> mine = {
      {"config",
       static_cast<std::int64_t>(sp::runtime::fnv1a64(config.resolved_yaml.data(), config.resolved_yaml.size()))},
      {"plugin file", static_cast<std::int64_t>(sp::runtime::fnv1a64(plugin_bytes.data(), plugin_bytes.size()))},
      {"step to resume at", next_step}};
  std::vector<std::string> differ_in;
  try {
    torch::Tensor theirs = torch::empty({static_cast<std::int64_t>(mine.size())}, torch::kInt64);
    for (std::size_t i = 0; i < mine.size(); ++i) theirs[static_cast<std::int64_t>(i)] = mine[i].second;
    collectives->broadcast(theirs, 0, "rank 0's config, plugin and step digests");
    for (std::size_t i = 0; i < mine.size(); ++i) {
      if (theirs[static_cast<std::int64_t>(i)].item<std::int64_t>() != mine[i].second)
        differ_in.push_back(mine[i].first);
    }
    torch::Tensor text = torch::tensor({static_cast<std::int64_t>(config.resolved_yaml.size())}, torch::kInt64);
    collectives->broadcast(text, 0, "the length of rank 0's config");
    torch::Tensor rank0_yaml = torch::empty({text.item<std::int64_t>()}, torch::kUInt8);
    if (rank() == 0) std::memcpy(rank0_yaml.data_ptr(), config.resolved_yaml.data(), config.resolved_yaml.size());
    collectives->broadcast(rank0_yaml, 0, "rank 0's config");
    if (!differ_in.empty()) {
      log->error("this rank ({}) differs from rank 0 in: {}{}", rank(), fmt::join(differ_in, ", "),
                 first_difference(std::string(reinterpret_cast<const char*>(rank0_yaml.data_ptr()),
                                              static_cast<std::size_t>(rank0_yaml.numel())),
                                  config.resolved_yaml));
    }
    torch::Tensor differing = torch::zeros({world_size()}, torch::kInt32);
    differing[rank()] = differ_in.empty() ? 0 : 1;
    collectives->all_reduce(differing, tl::Reduction::sum, "which ranks differ from rank 0")->wait();
    std::vector<int> ranks;
    for (int r = 0; r < world_size(); ++r) {
      if (differing[r].item<std::int32_t>() != 0) ranks.push_back(r);
    }
    if (ranks.empty()) return;
    throw ConfigError(fmt::format(
        "data parallel: rank(s) {} run another config, plugin file or resume step than rank 0 (each such rank logs "
        "which); start every rank with the same arguments and files",
        fmt::join(ranks, ", ")));
  } catch (const tl::CollectiveError& e) {
    throw DistributedError(e.what());
  }
}

std::string Trainer::Impl::first_difference(const std::string& rank0, const std::string& own) {
  if (rank0 == own) return "";
  std::istringstream a(rank0), b(own);
  std::string line_a, line_b;
  for (int line = 1;; ++line) {
    const bool more_a = static_cast<bool>(std::getline(a, line_a)), more_b = static_cast<bool>(std::getline(b, line_b));
    if (!more_a && !more_b) return "";
    if (!more_a || !more_b || line_a != line_b) {
      return fmt::format(" (config line {}: rank 0 '{}', this rank '{}')", line, more_a ? line_a : "<end>",
                         more_b ? line_b : "<end>");
    }
  }
}

std::optional<int> Trainer::Impl::first_failing_rank(bool ok, const std::string& what) {
  if (!collectives) return ok ? std::nullopt : std::optional<int>(0);
  torch::Tensor first = torch::tensor({ok ? world_size() : rank()}, torch::kInt32);
  collectives->all_reduce(first, tl::Reduction::min, what)->wait();
  const int failed = first.item<std::int32_t>();
  return failed == world_size() ? std::nullopt : std::optional<int>(failed);
}

void Trainer::Impl::prepare_run_directory() const {
  std::error_code error;
  if (!options.out_dir.empty()) fs::create_directories(run_dir, error);
  if (options.out_dir.empty() || error || !fs::is_directory(run_dir)) {
    throw ConfigError(fmt::format("run directory '{}' (--out): cannot create it as a directory: {}", run_dir.string(),
                                  options.out_dir.empty() ? "the path is empty"
                                  : error                 ? error.message()
                                                          : "a file of that name exists"));
  }
  // Refused now rather than after the run has rewritten its config and cut its logs.
  std::vector<std::string> files = {kRunConfigFile, kRunTrainMetricsFile, kRunCheckpointFile, kRunSummaryFile};
  if (!config.streaming.metrics_file.empty()) files.push_back(config.streaming.metrics_file);
  if (config.policy_keys.telemetry_enabled) files.push_back(config.policy_keys.telemetry_file);
  for (const std::string& name : files) {
    const fs::file_status status = fs::symlink_status(run_dir / name, error);
    if (fs::exists(status) && !fs::is_regular_file(status)) {
      throw ConfigError(
          fmt::format("run directory '{}' (--out): {} is not a regular file; remove it or use "
                      "another run directory",
                      run_dir.string(), name));
    }
  }
}

void Trainer::Impl::build_layer() {
  tl::StreamedModelOptions o;
  o.plugin_file = plugin_file();
  o.config_yaml = config.resolved_yaml;
  o.config_source = config.source_name;
  o.output_dir = run_dir;
  o.logger = log;
  o.host_name = "sp-train";
  o.device = compute.device();
  o.compute_dtype = c10::typeMetaToScalarType(compute.dtype());
  o.host_bandwidth_cap_gbps = config.streaming.bandwidth_cap_gbps;
  o.prefetch_window = config.streaming.prefetch_window;
  o.spare_slabs = config.streaming.spare_slabs;
  o.int8_group_size = config.streaming.int8_group_size;
  o.nf4_group_size = config.policy_keys.nf4_group_size;
  o.recalibrate_every = config.train.recalibrate_every;
  o.collectives = collectives;
  o.shard_masters = config.train.data_parallel == DataParallelMode::sharded;
  // The host-memory check before the model is built (estimated_host_bytes, docs/training.md)
  // counts the recompute's activations: each unit's input and one block's working set.
  o.recompute = true;
  o.plugin_hook_deadline = std::chrono::milliseconds(
      static_cast<std::int64_t>(std::llround(config.train.plugin_hook_deadline_seconds * 1000.0)));
  if (!config.streaming.metrics_file.empty()) o.metrics_path = (run_dir / config.streaming.metrics_file).string();
  o.transfer_policy = config.streaming.transfer_policy_path;
  try {
    layer = std::make_unique<tl::StreamedModel>(model->layer_blocks(), std::move(o));
    n_units = layer->num_blocks();
  } catch (const std::invalid_argument& e) {
    // What the model builds is valid by construction; the device is the config's part.
    if (config.train.device != ComputeDevice::cuda) throw;
    throw ConfigError(
        fmt::format("{}: train.device: cuda, but the streaming layer refuses it ({}); use train.device: cpu",
                    config.source_name, e.what()));
  }
  log->info("policy plugin {} {} from {}", layer->policy().host().plugin_name(), layer->policy().plugin_version(),
            (options.plugin_dir / ("lib" + config.train.plugin + ".so")).string());
}

MomentStorage Trainer::Impl::moment_storage(AdamMoments moments) {
  if (moments == AdamMoments::fp32) return {};
  return {sp::kernels::DType::kBFloat16, moments == AdamMoments::bf16_stochastic ? sp::kernels::Rounding::kStochastic
                                                                                 : sp::kernels::Rounding::kNearestEven};
}

void Trainer::Impl::build_optimizer() {
  const TrainLoopConfig& t = config.train;
  adam = std::make_unique<AdamW>(sp::kernels::AdamWHyperparameters{t.beta1, t.beta2, t.eps, t.weight_decay},
                                 moment_storage(t.adam_moments));
  std::vector<bool> is_adapter(model->resident().size(), false);
  for (std::uint32_t b = 0; b < n_blocks; ++b) {
    for (std::size_t r : model->block_adapters(b)) is_adapter[r] = true;
  }
  for (std::size_t r = 0; r < is_adapter.size(); ++r) {
    if (!is_adapter[r]) non_adapter_resident.push_back(r);
  }
  for (ResidentParam& p : model->resident()) {
    adam_resident.push_back(adam->add(p.name, p.value.data_ptr<float>(), p.grad.data_ptr<float>(),
                                      static_cast<std::size_t>(p.value.numel()), p.decay));
  }
  if (t.mode != TrainMode::full) return;
  unit_moments.resize(n_units);
  for (std::uint32_t b = 0; b < n_blocks; ++b) {
    for (std::size_t i = 0; i < kStreamedPerBlock; ++i) {
      const char* name = kStreamedNames[i];
      // Sharded, another rank keeps (and updates) this one.
      if (layer->owner(model->unit_of(b, i)) != rank()) continue;
      torch::Tensor master = layer->masters(model->unit_of(b, i)).at(name);
      // A defined .grad: the layer adds each pass's gradient into it in place, where AdamW
      // reads it.
      torch::Tensor grad = model->host_gradient_buffer(master);
      master.mutable_grad() = grad;
      master_grads.push_back(grad);
      adam_masters.push_back(adam->add(fmt::format("block{}.{}", b, name), master.data_ptr<float>(),
                                       grad.data_ptr<float>(), static_cast<std::size_t>(master.numel()), true));
      const std::size_t index = adam_masters.back();
      const sp::kernels::AdamWTensor t = adam->tensor(index);
      unit_moments[model->unit_of(b, i)].emplace(
          name, tl::MasterMoments{t.exp_avg, t.exp_avg_sq, t.decay, t.moment_dtype, t.moment_rounding, t.moment_seed});
    }
  }
}

nlohmann::json Trainer::Impl::calibration_identity() {
  std::uint64_t weights = 0xcbf29ce484222325ull;
  const std::uint32_t units = model->num_units();
  std::vector<nlohmann::json> unit_tensors(units, nlohmann::json::array());
  for (std::uint32_t b = 0; b < n_blocks; ++b) {
    for (std::size_t i = 0; i < kStreamedPerBlock; ++i) {
      const std::uint32_t unit = model->unit_of(b, i);
      const torch::Tensor& master = model->streamed()[b][i];
      weights = hash_tensor(master.detach(), weights);
      unit_tensors[unit].push_back({kStreamedNames[i], master.size(0), master.size(1)});
    }
  }
  nlohmann::json layout = nlohmann::json::array();
  for (std::uint32_t u = 0; u < units; ++u)
    layout.push_back({{"name", model->unit_name(u)}, {"tensors", unit_tensors[u]}});
  for (const ResidentParam& p : model->resident()) weights = hash_tensor(p.value.detach(), weights);
  return {{"model", model_identity()},
          {"weights_fnv1a64", fmt::format("{:016x}", weights)},
          {"quant",
           {{"int8", {{"format", "int8 symmetric"}, {"group_size", config.streaming.int8_group_size}}},
            {"nf4", {{"format", "nf4 absmax, bf16 scales"}, {"group_size", config.policy_keys.nf4_group_size}}}}},
          {"blocks", layout},
          {"calibration",
           {{"samples", config.policy_keys.calibration_samples},
            {"batch_size", config.train.batch_size},
            {"data_fnv1a64", fmt::format("{:016x}", corpus->fingerprint())},
            {"seed", config.train.seed},
            // The errors are measured in the compute dtype on the compute device,
            // so a bf16 GPU run and an fp32 CPU run do not share them.
            {"device", compute_device_name(config.train.device)},
            {"compute_dtype", compute_dtype_name(config.train.compute_dtype)},
            // Every route is pinned while measuring (measure_calibration_errors),
            // and a pin outranks the transfer gate: the errors cannot depend on a
            // gate, so no gate is part of the identity. The entry also retires
            // caches of an sp-train that forced routes through plugin hints, which
            // a gate could filter into BF16 against BF16 (errors of 0).
            {"routes", "runtime pins"}}}};
}

std::vector<torch::Tensor> Trainer::Impl::calibration_samples() {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> samples;
  std::vector<std::int64_t> tokens;
  for (std::uint32_t s = 0; s < config.policy_keys.calibration_samples; ++s) {
    corpus->train_batch(config.train.seed ^ kCalibrationSalt, s, config.train.batch_size, tokens);
    samples.push_back(model->embed(tensors_of(tokens, config.train.batch_size).first));
  }
  return samples;
}

void Trainer::Impl::calibrate(const nlohmann::json& identity) {
  const auto start = Clock::now();
  const std::string fingerprint = calibration_fingerprint(identity);
  const fs::path dir = config.train.calibration_cache_dir.empty() ? default_calibration_cache_dir()
                                                                  : fs::path(config.train.calibration_cache_dir);
  const fs::path file = calibration_cache_file(dir, fingerprint);
  CacheLookup cached = read_calibration_cache(file, fingerprint, n_units);
  // Sharded, measuring is a collective: a rank that finds the cache (another rank may be
  // writing it right now) measures with the rest unless every rank found it.
  const bool missed_elsewhere =
      layer->sharded() && first_failing_rank(cached.status == CacheStatus::hit, "calibration cache hits");
  if (cached.status == CacheStatus::hit && !missed_elsewhere) {
    calibration_errors = std::move(cached.errors);
    calibration_status = "hit";
    log->info("calibration: cache hit {}", file.string());
  } else {
    if (cached.status == CacheStatus::hit) {
      log->info("calibration: another rank has no cached errors for fingerprint {}; measuring with it", fingerprint);
    } else if (cached.status == CacheStatus::missing) {
      log->info("calibration: no cached errors for fingerprint {}; measuring", fingerprint);
    } else {
      log->warn("calibration: {}; measuring again", cached.detail);
    }
    calibration_errors = layer->measure_calibration_errors(calibration_samples());
    calibration_status = fmt::format("computed ({})", cache_status_name(cached.status));
    std::string where;
    try {
      write_calibration_cache(file, fingerprint, identity, calibration_errors);
      where = fmt::format("cached in {}", file.string());
    } catch (const std::exception& e) {
      log->warn("calibration: could not write the cache (the next run measures again): {}", e.what());
      where = "not cached";
    }
    log->info("calibration: {} samples per block in {:.1f}s, {}", config.policy_keys.calibration_samples,
              seconds_since(start), where);
  }
  for (const Precision precision : kPrecisions) {
    if (!is_quantized(precision)) continue;
    std::string name = precision_name(precision);
    std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::toupper(c); });
    log->info("calibration: {} relative output error per block: {:.4f}", name,
              fmt::join(calibration_errors[precision], " "));
  }
  layer->set_calibration_errors(calibration_errors);
}

}  // namespace sp::train
