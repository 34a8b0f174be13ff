#include "trainer.h"

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "adamw.h"
#include "calibration_cache.h"
#include "checkpoint_file.h"
#include "checkpoint_meta.h"
#include "gpt_model.h"
#include "progress.h"
#include "crash_marker.h"
#include "run_lock.h"
#include "sp/adapters/metrics.h"
#include "sp/precision_abi.h"
#include "sp/runtime/atomic_file.h"
#include "sp/runtime/hash.h"
#include "sp/torch_layer/streamed_model.h"
#include "text_corpus.h"

namespace sp::train {
namespace fs = std::filesystem;
namespace ad = sp::adapters;
namespace tl = sp::torch_layer;
using Clock = std::chrono::steady_clock;

namespace {

constexpr std::uint64_t kCalibrationSalt = 0xca11b7a7e5eedull;
// Steps in a row with a non-finite loss or gradient (each skipped) before the run gives up.
constexpr int kMaxNonFiniteSteps = 8;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

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
    throw ConfigError(fmt::format("environment variable {}='{}': a whole number of at least {} expected (as "
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

// The host memory a run of `c` adds at its peak to what the process holds before it builds
// anything (LibTorch, the corpus: resident_bytes() then), by its largest parts:
//   - the fp32 masters of the streamed matrices (in full mode also their gradients and AdamW's
//     two moments; on a GPU also the pinned buffers the gradients cross to the host in);
//   - the slabs of the training and the evaluation engine (one per unit plus the spares, each
//     as large as the largest unit's BF16 image, which an NF4 or INT8 image never exceeds); on
//     the CPU also the two engines' "device" slots (prefetch window + 2 per engine, each room
//     for a BF16 image and a quantized one), which a GPU keeps in its own memory;
//   - on the CPU, the activations: the input of every unit, which the recompute keeps, and the
//     working set of one block's recompute and backward (per token about 7 + 2 x mlp_ratio
//     widths saved for the backward, half as much again for their gradients, and the attention
//     scores and probabilities with theirs).
// Checked against heaptrack and the measured peaks in docs/results.md ("Host memory estimate").
//
// Sharded data parallelism keeps the masters' part of the blocks a rank owns (each rank owns
// every shards-th unit), but never less than one fp32 copy of every streamed matrix: the
// model's own initialization, which the layer takes over and frees.
std::uint64_t estimated_host_bytes(const TrainConfig& c, std::uint32_t shards) {
  const ModelConfig& m = c.model;
  const std::uint64_t d = m.d_model, tokens = std::uint64_t{c.train.batch_size} * m.seq_len;
  const std::uint64_t attention = 4 * d * d, mlp = 2 * std::uint64_t{m.mlp_ratio} * d * d;
  const std::uint64_t streamed = (attention + mlp) * m.n_blocks;
  const bool sublayers = m.streaming_unit == StreamingUnit::sublayer;
  const std::uint64_t units = sublayers ? 2 * std::uint64_t{m.n_blocks} : m.n_blocks;
  const std::uint64_t largest_unit = sublayers ? std::max(attention, mlp) : attention + mlp;
  const bool full = c.train.mode == TrainMode::full, on_cpu = c.train.device == ComputeDevice::cpu;
  // Full mode: master and gradient in fp32, and the two moments (fp32, or bf16).
  const std::uint64_t moment_bytes = c.train.adam_moments == AdamMoments::fp32 ? 8 : 4;
  const std::uint64_t owned_units = (units + shards - 1) / shards;
  const std::uint64_t masters = std::max(streamed * 4, streamed * (full ? 8 + moment_bytes : 4) * owned_units / units) +
                                (full && !on_cpu ? streamed * 4 : 0);
  const std::uint64_t slabs = 2 * (units + c.streaming.spare_slabs) * largest_unit * 2;
  if (!on_cpu) return masters + slabs;
  // A quantized image is at most INT8's byte per weight and its scales.
  const std::uint64_t slots = 2 * (std::uint64_t{c.streaming.prefetch_window} + 2) * largest_unit * 3;
  const std::uint64_t scores = std::uint64_t{c.train.batch_size} * m.n_heads * m.seq_len * m.seq_len * 4;
  const std::uint64_t activations =
      tokens * d * 4 * (units + 3 * (7 + 2 * std::uint64_t{m.mlp_ratio}) / 2) + 4 * scores;
  return masters + slabs + slots + activations;
}

// A kB line of /proc/self/status ("VmRSS:", "VmHWM:"), in bytes; 0 where /proc does not say.
std::uint64_t process_status_bytes(const std::string& key) {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind(key, 0) == 0) return std::stoull(line.substr(key.size())) * 1024;
  }
  return 0;
}

// This process's resident set now.
std::uint64_t resident_bytes() { return process_status_bytes("VmRSS:"); }

// MemAvailable of /proc/meminfo, in bytes; 0 where it does not say.
std::uint64_t available_host_bytes() {
  std::ifstream meminfo("/proc/meminfo");
  for (std::string line; std::getline(meminfo, line);) {
    if (line.rfind("MemAvailable:", 0) == 0) return std::stoull(line.substr(13)) * 1024;
  }
  return 0;
}

// This process's peak resident set.
std::uint64_t peak_rss_bytes() { return process_status_bytes("VmHWM:"); }

template <typename T>
std::vector<std::uint8_t> pod_bytes(const T& value) {
  const auto* p = reinterpret_cast<const std::uint8_t*>(&value);
  return {p, p + sizeof value};
}

}  // namespace

fs::path checkpoint_path(const fs::path& out_dir) { return out_dir / kRunCheckpointFile; }

struct Trainer::Impl {
  TrainConfig config;
  RunOptions options;
  std::shared_ptr<spdlog::logger> log;
  std::uint32_t n_blocks = 0;  // transformer blocks
  std::uint32_t n_units = 0;   // streaming units: what the plugin decides for (model.streaming_unit)

  // Data parallelism: the ranks (null in one process), and this rank's own run directory
  // (--out itself on rank 0, --out/rank<r> on the others; the checkpoint is rank 0's alone).
  std::shared_ptr<tl::Collectives> collectives;
  fs::path run_dir;
  std::unique_ptr<RunDirectoryLock> run_lock;
  std::optional<std::string> previous_crash;  // what the crash marker of the run before said
  std::unique_ptr<TextCorpus> corpus;
  std::unique_ptr<GptModel> model;
  torch::TensorOptions compute;  // device and dtype of the model's math
  std::uint64_t resident_before_build = 0;  // VmRSS with LibTorch and the corpus loaded, before the model
  // The streamed blocks: engines, masters, autograd, the policy session.
  std::unique_ptr<tl::StreamedModel> layer;
  std::vector<torch::Tensor> master_grads;  // full mode: the masters' .grad, which AdamW reads
  std::unique_ptr<AdamW> adam;
  std::vector<std::size_t> adam_resident;         // resident index -> adam index
  std::vector<std::size_t> adam_masters;          // full mode: adam indices of the masters
  // Full mode, fused host optimizer: each streaming unit's masters' moments by parameter name.
  std::vector<std::map<std::string, tl::MasterMoments>> unit_moments;
  std::vector<std::size_t> non_adapter_resident;  // resident tensors outside the block moments
  std::unique_ptr<ad::MetricsJsonlWriter> train_metrics;

  std::int64_t next_step = 0;
  std::string calibration_status = "disabled";
  CalibrationErrors calibration_errors;
  int nonfinite_streak = 0;
  std::optional<double> previous_grad_norm;  // the last finite one: the overlapped update's clipping
  std::uint64_t checkpoint_exchanges = 0;     // names each agreement on a checkpoint write

  // Totals over the whole run, carried across resumes.
  struct Totals {
    PerPrecision<std::uint64_t> h2d;
    std::uint64_t h2d_all_bf16 = 0;
    // Of the runs before a resume; this one's are the layer's counters.
    std::uint64_t eval_h2d_before = 0, calibration_h2d_before = 0;
    std::uint64_t tokens = 0;
    PerPrecision<std::uint64_t> block_steps;
    double train_seconds = 0.0;
    double update_seconds = 0.0;
    std::vector<std::pair<std::int64_t, double>> val_history;
    std::vector<nlohmann::json> swaps;
    double last_loss = NAN;
  } totals;

  Impl(TrainConfig cfg, RunOptions opts)
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

  // torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): one rank of a
  // data-parallel run over Gloo (and NCCL for the gradients on a GPU, where the build has it);
  // without them, the one process.
  void join_ranks() {
    try {
      collectives =
          tl::from_environment(std::chrono::seconds(config.train.collective_timeout_seconds), compute.device());
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

  // The run's largest parts in host memory, estimated before any of them is allocated, against
  // what the machine has available (which what the process holds already is not part of): a
  // model far larger than memory is refused by name instead of meeting the OOM killer minutes
  // later.
  void refuse_what_cannot_fit() const {
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

  // Before anything is built: every rank must run the same config, plugin build and step, or
  // they would part at a collective minutes later (a hang until its timeout, or a hint
  // mismatch). Rank 0's config text and the digests of the rest are broadcast; each rank
  // compares, and all learn which ranks differ and in what. A rank's own --out and data
  // position are not compared: they differ by design.
  void agree_across_ranks() {
    if (!collectives) return;
    const std::string plugin_bytes = [&] {
      std::ifstream in(plugin_file(), std::ios::binary);
      return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    }();
    const std::vector<std::pair<const char*, std::int64_t>> mine = {
        {"config", static_cast<std::int64_t>(sp::runtime::fnv1a64(config.resolved_yaml.data(), config.resolved_yaml.size()))},
        {"plugin file", static_cast<std::int64_t>(sp::runtime::fnv1a64(plugin_bytes.data(), plugin_bytes.size()))},
        {"step to resume at", next_step}};
    std::vector<std::string> differ_in;
    try {
      torch::Tensor theirs = torch::empty({static_cast<std::int64_t>(mine.size())}, torch::kInt64);
      for (std::size_t i = 0; i < mine.size(); ++i) theirs[static_cast<std::int64_t>(i)] = mine[i].second;
      collectives->broadcast(theirs, 0, "rank 0's config, plugin and step digests");
      for (std::size_t i = 0; i < mine.size(); ++i) {
        if (theirs[static_cast<std::int64_t>(i)].item<std::int64_t>() != mine[i].second) differ_in.push_back(mine[i].first);
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

  // Where two config texts part, as " (config line N: rank 0 'a', this rank 'b')".
  static std::string first_difference(const std::string& rank0, const std::string& own) {
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

  fs::path plugin_file() const { return options.plugin_dir / ("lib" + config.train.plugin + ".so"); }

  int rank() const { return collectives ? collectives->rank() : 0; }
  int world_size() const { return collectives ? collectives->size() : 1; }
  // The ranks the masters are spread over: the world size when sharded, else 1.
  std::uint32_t shards() const {
    return config.train.data_parallel == DataParallelMode::sharded ? static_cast<std::uint32_t>(world_size()) : 1;
  }
  // Whether `ok` holds on every rank; where it does not, the lowest rank where it fails (every
  // rank learns it, so that all take the same branch after a step that can fail on one).
  std::optional<int> first_failing_rank(bool ok, const std::string& what) {
    if (!collectives) return ok ? std::nullopt : std::optional<int>(0);
    torch::Tensor first = torch::tensor({ok ? world_size() : rank()}, torch::kInt32);
    collectives->all_reduce(first, tl::Reduction::min, what)->wait();
    const int failed = first.item<std::int32_t>();
    return failed == world_size() ? std::nullopt : std::optional<int>(failed);
  }

  // The requests signals left for this step boundary (stop: SIGINT or SIGTERM; look at the
  // plugin file: SIGHUP), each set when any rank has it, agreed in one collective.
  struct BoundaryRequests {
    bool stop = false;
    bool check_plugin = false;
  };
  BoundaryRequests boundary_requests() const {
    BoundaryRequests r{options.stop_requested && options.stop_requested->load(),
                       options.plugin_check_requested && options.plugin_check_requested->exchange(false)};
    if (!collectives) return r;
    torch::Tensor flags = torch::tensor({r.stop ? 1 : 0, r.check_plugin ? 1 : 0}, torch::kInt32);
    collectives->all_reduce(flags, tl::Reduction::max, "stop and swap requests")->wait();
    return {flags[0].item<std::int32_t>() != 0, flags[1].item<std::int32_t>() != 0};
  }

  void prepare_run_directory() const {
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

  std::optional<CheckpointSections> find_checkpoint() {
    const fs::path file = checkpoint_path(options.out_dir);
    if (config.train.resume == ResumePolicy::never || !fs::exists(file)) return std::nullopt;
    try {
      return CheckpointSections::read(file);
    } catch (const CheckpointError& e) {
      throw ResumeError(fmt::format("{} (remove it, or pass --set train.resume=never to start over)", e.what()));
    }
  }

  nlohmann::json model_identity() const {
    const ModelConfig& m = config.model;
    return {{"d_model", m.d_model},
            {"n_heads", m.n_heads},
            {"n_blocks", m.n_blocks},
            {"seq_len", m.seq_len},
            {"mlp_ratio", m.mlp_ratio},
            {"streaming_unit", streaming_unit_name(m.streaming_unit)},
            {"mode", mode_name(config.train.mode)},
            {"lora_rank", config.train.mode == TrainMode::lora ? config.train.lora.rank : 0},
            {"int8_group_size", config.streaming.int8_group_size},
            {"nf4_group_size", config.policy_keys.nf4_group_size}};
  }

  // The model's weights from another run's checkpoint: the same shape is required, the mode
  // may differ. Tensors the checkpoint does not have (LoRA adapters of a full-mode base) keep
  // their initialization.
  void load_initial_weights(const fs::path& file) {
    const std::string what = fmt::format("train.init_checkpoint {}", file.string());
    try {
      const CheckpointSections in = CheckpointSections::read(file);
      const nlohmann::json meta = read_checkpoint_meta(in, file);
      const nlohmann::json expected = model_identity();
      for (const char* key : {"d_model", "n_heads", "n_blocks", "seq_len", "mlp_ratio"}) {
        if (!meta["model"].contains(key) || meta["model"][key] != expected[key]) {
          throw ResumeError(fmt::format("{}: made for model.{} = {}, this config has {}", what, key,
                                        meta["model"].value(key, nlohmann::json()).dump(), expected[key].dump()));
        }
      }
      for (std::uint32_t b = 0; b < n_blocks; ++b) {
        for (std::size_t i = 0; i < kStreamedPerBlock; ++i) {
          torch::Tensor& w = model->streamed()[b][i];
          in.get_into(fmt::format("master/block{}.{}", b, kStreamedNames[i]), w.data_ptr(), w.numel() * sizeof(float));
        }
      }
      std::size_t loaded = 0;
      for (ResidentParam& p : model->resident()) {
        if (!in.has("resident/" + p.name)) continue;
        in.get_into("resident/" + p.name, p.value.data_ptr(), p.value.numel() * sizeof(float));
        ++loaded;
      }
      model->refresh_compute();
      log->info("initial weights from {} (step {}): every streamed block and {} resident tensors", file.string(),
                meta["next_step"].get<std::int64_t>(), loaded);
    } catch (const CheckpointError& e) {
      throw ResumeError(fmt::format("{}: {}", what, e.what()));
    } catch (const nlohmann::json::exception& e) {
      throw ResumeError(fmt::format("{}: section 'meta' is malformed: {}", what, e.what()));
    }
  }

  // The streamed blocks go to the LibTorch layer, which sizes the engines from their shapes
  // and opens the policy session.
  void build_layer() {
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

  static MomentStorage moment_storage(AdamMoments moments) {
    if (moments == AdamMoments::fp32) return {};
    return {sp::kernels::DType::kBFloat16, moments == AdamMoments::bf16_stochastic ? sp::kernels::Rounding::kStochastic
                                                                                   : sp::kernels::Rounding::kNearestEven};
  }

  void build_optimizer() {
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

  // The plugin's hints in force, one sp_precision per block (BF16 before its first hints).
  std::vector<std::uint8_t> decisions() const {
    std::vector<std::uint8_t> out(n_units, SP_PRECISION_BF16);
    for (const sp_hint_v1& h : layer->hints()) out[h.block_id] = static_cast<std::uint8_t>(h.precision);
    return out;
  }

  std::uint64_t eval_h2d() const { return totals.eval_h2d_before + layer->evaluation_h2d_bytes(); }
  std::uint64_t calibration_h2d() const { return totals.calibration_h2d_before + layer->calibration_h2d_bytes(); }

  std::pair<torch::Tensor, torch::Tensor> tensors_of(std::vector<std::int64_t>& tokens, std::uint32_t batch) const {
    const std::int64_t window = config.model.seq_len + 1;
    const torch::Tensor all = torch::from_blob(tokens.data(), {batch, window}, torch::kInt64);
    const auto place = [&](const torch::Tensor& t) {
      return t.to(compute.device(), torch::kInt64, /*non_blocking=*/false, /*copy=*/true);
    };
    return {place(all.narrow(1, 0, window - 1)), place(all.narrow(1, 1, window - 1))};
  }

  double evaluate() {
    torch::NoGradGuard no_grad;
    std::vector<std::int64_t> tokens;
    double sum = 0.0;
    for (std::uint32_t i = 0; i < config.train.eval_batches; ++i) {
      // Each rank takes its share of a batch of batch_size * world_size rows, as in training.
      const std::uint32_t rows = config.train.batch_size;
      corpus->val_batch(i, config.train.eval_batches, rows * world_size(), tokens, rows * rank(), rows);
      auto [idx, targets] = tensors_of(tokens, rows);
      sum += model->head_loss(layer->forward(model->embed(idx)), targets).item<double>();
    }
    return layer->average(sum / config.train.eval_batches);
  }

  // ---- calibration -----------------------------------------------------------------------

  // What the calibration errors depend on, from the model's initial weights (before the layer
  // takes them over).
  nlohmann::json calibration_identity() {
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

  // The first-block inputs calibration measures on: the embeddings of its own batches.
  std::vector<torch::Tensor> calibration_samples() {
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> samples;
    std::vector<std::int64_t> tokens;
    for (std::uint32_t s = 0; s < config.policy_keys.calibration_samples; ++s) {
      corpus->train_batch(config.train.seed ^ kCalibrationSalt, s, config.train.batch_size, tokens);
      samples.push_back(model->embed(tensors_of(tokens, config.train.batch_size).first));
    }
    return samples;
  }

  void calibrate(const nlohmann::json& identity) {
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
    for (const auto& [name, errors] :
         {std::pair{"INT8", &calibration_errors.int8}, std::pair{"NF4", &calibration_errors.nf4}}) {
      log->info("calibration: {} relative output error per block: {:.4f}", name, fmt::join(*errors, " "));
    }
    layer->set_calibration_errors(calibration_errors);
  }

  // ---- the training step -----------------------------------------------------------------

  double learning_rate(std::int64_t step) const {
    const TrainLoopConfig& t = config.train;
    if (step < t.lr_warmup_steps) return t.lr * static_cast<double>(step + 1) / t.lr_warmup_steps;
    const double span = std::max<std::int64_t>(1, t.steps - t.lr_warmup_steps);
    const double progress = std::min(1.0, static_cast<double>(step - t.lr_warmup_steps) / span);
    const double cosine = 0.5 * (1.0 + std::cos(M_PI * progress));
    return t.lr * (t.min_lr_ratio + (1.0 - t.min_lr_ratio) * cosine);
  }

  // Global gradient norm for clipping: the block moments already hold the streamed (or
  // adapter) part; the resident tensors that are not adapters add theirs. Returns NaN when any
  // gradient element is not finite.
  double global_grad_norm(const std::vector<sp_grad_moments_v1>& moments) const {
    double sum_sq = 0.0;
    for (const sp_grad_moments_v1& m : moments) {
      if (m.nonfinite != 0) return NAN;
      sum_sq += m.sum_sq;
    }
    for (std::size_t r : non_adapter_resident) sum_sq += model->resident()[r].grad.pow(2).sum().item<double>();
    return std::sqrt(sum_sq);
  }

  // AdamW over the resident tensors, then over the masters. Fused, each unit's masters are
  // updated in the sweep that writes its next transfer image; unfused, the layer rebuilds the
  // images of the updated masters at end_step, in the precision each block travels next.
  double clip_scale(double grad_norm) const {
    const double clip = config.train.grad_clip;
    return clip > 0.0 && grad_norm > clip ? clip / grad_norm : 1.0;
  }

  void update_resident() {
    for (std::size_t index : adam_resident) adam->step_parameter(index);
    model->refresh_compute();
  }

  void optimizer_step(double lr, double grad_norm) {
    adam->begin_step(lr, clip_scale(grad_norm));
    update_resident();
    if (config.train.host_optimizer != HostOptimizer::unfused) {
      for (std::uint32_t u = 0; u < unit_moments.size(); ++u) {
        if (layer->owner(u) == rank()) layer->update_masters(u, adam->step_constants(), unit_moments[u]);
      }
    } else {
      for (std::size_t index : adam_masters) adam->step_parameter(index);
    }
  }

  StepRecord train_step(std::int64_t step) {
    const auto start = Clock::now();
    const std::uint32_t batch = config.train.batch_size;
    StepRecord record;
    record.step = step;
    record.lr = learning_rate(step);

    layer->begin_step(step);
    record.plugin_version = std::string(layer->policy().plugin_version());
    for (Precision route : layer->routes()) record.routes.push_back(static_cast<std::uint8_t>(to_abi(route)));

    std::vector<std::int64_t> tokens;
    corpus->train_batch(config.train.seed, step, batch, tokens,
                        std::uint64_t{batch} * static_cast<std::uint64_t>(rank()));
    auto [idx, targets] = tensors_of(tokens, batch);
    model->clear_gradients();
    for (torch::Tensor& g : master_grads) g.zero_();
    // The overlapped update steps the masters during the backward, before this step's gradient
    // norm exists: it clips by the previous step's (the last finite one). A run's first step,
    // or a resume from a checkpoint without that norm, has none and updates after the backward.
    const bool overlapped = config.train.mode == TrainMode::full &&
                            config.train.host_optimizer == HostOptimizer::overlapped && previous_grad_norm;
    if (overlapped) {
      adam->begin_step(record.lr, clip_scale(*previous_grad_norm));
      layer->update_masters_during_backward(adam->step_constants(), unit_moments);
    }

    // The layer fetches each block for the forward and again, in reverse, for the backward,
    // where it recomputes and differentiates it; the masters' gradients land in their .grad.
    const torch::Tensor loss = model->head_loss(layer->forward(model->embed(idx)), targets);
    loss.backward();
    // The layer averaged across ranks the gradients its blocks produced; the embedding and
    // the head are this host's.
    layer->average_gradients(model->outside_blocks());
    model->queue_resident_gradients_to_host();
    // The backward's one host synchronization. Reading the loss waits for the compute stream,
    // on which every gradient copy to the host was queued before it, so the host gradients
    // are complete from here on. Read earlier, the loss would stall the host before the
    // backward was queued. Every rank records, and the plugin sees, the mean across ranks.
    record.loss = layer->average(loss.item<double>());

    const std::vector<sp_grad_moments_v1>& moments = layer->post_backward();
    record.decisions = decisions();
    record.grad_norm = global_grad_norm(moments);
    const auto update_start = Clock::now();
    if (std::isfinite(record.grad_norm) && std::isfinite(record.loss)) {
      nonfinite_streak = 0;
      if (overlapped) {
        update_resident();  // the streamed masters were updated during the backward
      } else {
        optimizer_step(record.lr, record.grad_norm);
      }
      previous_grad_norm = record.grad_norm;
    } else if (++nonfinite_streak >= kMaxNonFiniteSteps) {
      throw DivergedError(
          fmt::format("step {}: loss {}, gradient norm {}; {} steps in a row were skipped "
                      "(lower train.lr?)",
                      step, record.loss, record.grad_norm, nonfinite_streak));
    } else if (overlapped) {
      log->warn(
          "step {}: non-finite loss or gradients; the resident parameters are not updated, the streamed blocks "
          "whose gradients are finite were, during the backward",
          step);
    } else {
      log->warn("step {}: non-finite loss or gradients; the update is skipped", step);
    }

    const tl::StepReport report = layer->end_step(record.loss);
    record.update_seconds = seconds_since(update_start);
    // A non-finite step that the overlap left wholly unapplied (no block updated, nor the
    // resident parameters) does not count for the bias correction, as in the exact modes; one
    // that updated some blocks does.
    if (overlapped && nonfinite_streak > 0) {
      // Sharded, each rank updates its own units: the step is unapplied only where every rank
      // skipped all of them, and every rank's bias correction must follow the same count.
      std::uint32_t owned = 0;
      for (std::uint32_t u = 0; u < n_units; ++u) owned += layer->owner(u) == rank() ? 1 : 0;
      bool unapplied = report.updates_skipped.size() == owned;
      if (layer->sharded()) unapplied = !first_failing_rank(unapplied, "whether any rank updated a block");
      if (unapplied) adam->set_steps_taken(adam->steps_taken() - 1);
    }
    if (report.swap) note_swap(step, *report.swap, record);
    if (report.calibration) {
      calibration_errors = *report.calibration;
      calibration_status = fmt::format("re-calibrated at step {}", step);
      record.recalibration = nlohmann::json{
          {"seconds", report.calibration_seconds}, {"int8", calibration_errors.int8}, {"nf4", calibration_errors.nf4}};
      log->debug("step {}: re-calibrated in {:.3f}s: INT8 {:.4f}, NF4 {:.4f}", step, report.calibration_seconds,
                 fmt::join(calibration_errors.int8, " "), fmt::join(calibration_errors.nf4, " "));
    }
    record.h2d_bytes = report.h2d_bytes;
    record.h2d_bytes_all_bf16 = report.h2d_bytes_all_bf16;
    record.seconds = seconds_since(start);
    return record;
  }

  void note_swap(std::int64_t step, const sp::host::SwapResult& swap, StepRecord& record) {
    const bool swapped = swap.outcome == sp::host::SwapResult::Outcome::swapped;
    record.swap_note = swapped ? fmt::format("swapped {} -> {}", swap.old_version, swap.new_version)
                               : fmt::format("swap failed, kept {}: {}", swap.old_version, swap.message);
    (swapped ? log->info("step {}: plugin {}", step, record.swap_note)
             : log->warn("step {}: plugin {}", step, record.swap_note));
    totals.swaps.push_back({{"step", step},
                            {"outcome", swapped ? "swapped" : "failed"},
                            {"old_version", swap.old_version},
                            {"new_version", swap.new_version},
                            {"message", swap.message}});
  }

  // `forced` is the same on every rank (boundary_requests), so every rank takes the same
  // branch: the layer's poll is a collective.
  void poll_plugin(std::int64_t step, bool forced) {
    const std::int64_t every = config.train.plugin_poll_steps;
    if (!forced && (every == 0 || step % every != 0)) return;
    if (std::optional<sp::host::SwapResult> request = layer->poll_plugin(forced)) {
      if (request->outcome == sp::host::SwapResult::Outcome::failed) {
        log->warn("plugin file changed but cannot be swapped in; keeping {}: {}", layer->policy().plugin_version(),
                  request->message);
        totals.swaps.push_back({{"step", step}, {"outcome", "failed"}, {"message", request->message}});
      } else {
        log->info("plugin file changed: swapping to {} at the start of step {}", request->new_version, step);
      }
    }
  }

  // ---- checkpoint ------------------------------------------------------------------------

  nlohmann::json totals_json() const {
    nlohmann::json val = nlohmann::json::array();
    for (const auto& [step, loss] : totals.val_history) val.push_back({step, loss});
    nlohmann::json out = {{"h2d_all_bf16", totals.h2d_all_bf16},
                          {"eval_h2d", eval_h2d()},
                          {"calibration_h2d", calibration_h2d()},
                          {"tokens", totals.tokens},
                          {"train_seconds", totals.train_seconds},
                          {"update_seconds", totals.update_seconds},
                          {"val_history", val},
                          {"swaps", totals.swaps},
                          {"last_loss", totals.last_loss}};
    for (Precision precision : kPrecisions) {
      out[fmt::format("h2d_{}", precision_name(precision))] = totals.h2d[precision];
      out[fmt::format("{}_block_steps", precision_name(precision))] = totals.block_steps[precision];
    }
    return out;
  }

  // Sharded, each rank's masters and their AdamW moments go to a file of its own, named by the
  // checkpoint's step, in its run directory; the main checkpoint names that step.
  fs::path shard_path(std::int64_t step) const { return run_dir / fmt::format("{}{}.bin", kShardPrefix, step); }
  static constexpr const char* kShardPrefix = "checkpoint.shard-step";

  static bool is_master_entry(const std::string& key) { return key.rfind("master/", 0) == 0; }

  // Rank 0 writes the replicated state; a rank's own state is its data position, which is
  // the step and its rank. Sharded, every rank first writes its shard; rank 0 writes the main
  // file (which makes the checkpoint the current one) only once every shard is on disk, and
  // the shards of older checkpoints go only once the main file names the new ones. The ranks
  // wait for each other's writes up to train.checkpoint_timeout_seconds, not the collectives'
  // timeout: a large checkpoint may take longer to write than any collective should wait. They
  // first meet within the collectives' timeout, so that a rank that died before the write is
  // noticed as soon as in a collective.
  void save_checkpoint() {
    const bool sharded = layer->sharded();
    const auto start = Clock::now();
    if (collectives) {
      collectives->exchange(fmt::format("checkpoint{}/arrive", ++checkpoint_exchanges), "",
                            std::chrono::seconds(config.train.collective_timeout_seconds));
    }
    const std::map<std::string, torch::Tensor> layer_state =
        rank() == 0 || sharded ? layer->export_state() : std::map<std::string, torch::Tensor>{};
    if (sharded) {
      std::string failure;
      try {
        CheckpointSections shard;
        const std::string meta =
            nlohmann::json{{"next_step", next_step}, {"rank", rank()}, {"world_size", world_size()}}.dump();
        shard.put("shard", meta.data(), meta.size());
        for (const auto& [key, t] : layer_state) {
          if (is_master_entry(key)) shard.put_view(key, t.data_ptr(), t.numel() * t.element_size());
        }
        for (std::size_t i : adam_masters) put_moments(shard, i);
        shard.write_atomically(shard_path(next_step));
      } catch (const std::exception& e) {
        failure = fmt::format("its shard ({})", e.what());
      }
      agree_on_checkpoint("shards", failure);
    }
    std::string failure;
    if (rank() == 0) {
      try {
        write_main_checkpoint(layer_state);
      } catch (const std::exception& e) {
        if (!collectives) throw;
        failure = fmt::format("the checkpoint ({})", e.what());
      }
    }
    if (collectives) agree_on_checkpoint("main", failure);
    if (sharded) remove_other_shards(next_step);
    if (rank() != 0 && !sharded) return;
    log->info("checkpoint at step {} written to {} in {:.2f}s", next_step,
              sharded ? fmt::format("{} and the ranks' {}{}.bin", checkpoint_path(options.out_dir).string(),
                                    kShardPrefix, next_step)
                      : checkpoint_path(options.out_dir).string(),
              seconds_since(start));
  }

  // Every rank learns every rank's outcome of one part of a checkpoint write (empty: written),
  // waiting up to train.checkpoint_timeout_seconds; a failure anywhere is thrown everywhere.
  void agree_on_checkpoint(const char* part, const std::string& failure) {
    const std::vector<std::string> outcomes =
        collectives->exchange(fmt::format("checkpoint{}/{}", ++checkpoint_exchanges, part), failure,
                              std::chrono::seconds(config.train.checkpoint_timeout_seconds));
    for (std::size_t r = 0; r < outcomes.size(); ++r) {
      if (outcomes[r].empty()) continue;
      throw CheckpointError(fmt::format("checkpoint at step {}: rank {} could not write {}; {} still holds the "
                                        "previous checkpoint",
                                        next_step, r, outcomes[r], checkpoint_path(options.out_dir).string()));
    }
  }

  // AdamW's moments of parameter `i`, written from the optimizer's own buffers.
  void put_moments(CheckpointSections& out, std::size_t i) {
    const std::vector<std::uint8_t>& exp_avg = adam->exp_avg_bytes(i);
    const std::vector<std::uint8_t>& exp_avg_sq = adam->exp_avg_sq_bytes(i);
    out.put_view("adam/" + adam->name(i) + "/exp_avg", exp_avg.data(), exp_avg.size());
    out.put_view("adam/" + adam->name(i) + "/exp_avg_sq", exp_avg_sq.data(), exp_avg_sq.size());
  }

  void write_main_checkpoint(const std::map<std::string, torch::Tensor>& layer_state) {
    const bool sharded = layer->sharded();
    CheckpointSections out;
    nlohmann::json meta = {
        {"version", kCheckpointMetaVersion},
        {"next_step", next_step},
        {"model", model_identity()},
        {"seed", config.train.seed},
        {"world_size", world_size()},
        {"data_fnv1a64", fmt::format("{:016x}", corpus->fingerprint())},
        {"plugin", {{"name", layer->policy().host().plugin_name()}, {"version", layer->policy().plugin_version()}}},
        {"calibration_status", calibration_status},
        {"calibration_errors", calibration_errors.int8},
        {"nf4_calibration_errors", calibration_errors.nf4},
        {"decisions", decisions()},
        {"totals", totals_json()},
        {"adam_moments", adam_moments_name(config.train.adam_moments)},
        {"data_parallel", sharded ? "sharded" : "replicated"}};
    // The overlapped update's next clipping: only that mode has one.
    if (config.train.host_optimizer == HostOptimizer::overlapped && previous_grad_norm) {
      meta["previous_grad_norm"] = *previous_grad_norm;
    }
    const std::string meta_text = meta.dump();
    out.put("meta", meta_text.data(), meta_text.size());
    // The layer's state: the masters (sharded: in the shards), the plugin state, the hints in
    // force, its pass counters.
    for (const auto& [key, t] : layer_state) {
      if (!sharded || !is_master_entry(key)) out.put_view(key, t.data_ptr(), t.numel() * t.element_size());
    }
    for (const ResidentParam& p : model->resident()) {
      out.put_view("resident/" + p.name, p.value.data_ptr(), p.value.numel() * sizeof(float));
    }
    // Sharded, the masters' moments are in the shards: the resident tensors' only.
    if (sharded) {
      for (std::size_t i : adam_resident) put_moments(out, i);
    } else {
      for (std::size_t i = 0; i < adam->size(); ++i) put_moments(out, i);
    }
    out.put("adam/steps", pod_bytes(adam->steps_taken()));
    const torch::Tensor rng = at::detail::getDefaultCPUGenerator().get_state();
    out.put("rng/torch", rng.data_ptr(), static_cast<std::size_t>(rng.numel()));
    out.write_atomically(checkpoint_path(options.out_dir));
  }

  // This rank's shards of checkpoints other than `keep`'s, and temporaries a killed write left.
  void remove_other_shards(std::int64_t keep) {
    const std::string current = shard_path(keep).filename().string();
    std::error_code ec;
    for (const fs::directory_entry& entry : fs::directory_iterator(run_dir, ec)) {
      const std::string name = entry.path().filename().string();
      if (name.rfind(kShardPrefix, 0) != 0 || name == current) continue;
      std::error_code removed;
      fs::remove(entry.path(), removed);
      if (removed) log->warn("checkpoint: could not remove {}: {}", entry.path().string(), removed.message());
    }
    remove_stale_temporaries(run_dir, {}, {kShardPrefix});
  }

  // Sharded: this rank's shard of the checkpoint at `step`, its sections checked against it.
  // Every rank learns whether every rank could read its own, so that none waits for another
  // in the restore that follows.
  CheckpointSections read_shard(std::int64_t step) {
    const fs::path file = shard_path(step);
    CheckpointSections shard;
    std::string failure;
    try {
      shard = CheckpointSections::read(file);
      const Bytes& bytes = shard.get("shard");
      const nlohmann::json meta = nlohmann::json::parse(bytes.begin(), bytes.end(), nullptr, false);
      const nlohmann::json expected = {{"next_step", step}, {"rank", rank()}, {"world_size", world_size()}};
      if (meta != expected) {
        throw CheckpointError(fmt::format("{}: section 'shard' is {}; expected {} (the shard of this rank at the main "
                                          "checkpoint's step)",
                                          file.string(), meta.dump(), expected.dump()));
      }
    } catch (const CheckpointError& e) {
      failure = fs::exists(file) ? e.what()
                                 : fmt::format("{}: missing (the checkpoint {} names this rank's shard of step {})",
                                               file.string(), checkpoint_path(options.out_dir).string(), step);
    }
    const std::optional<int> failed = first_failing_rank(failure.empty(), "checkpoint shards read");
    if (!failure.empty()) throw ResumeError(failure);
    if (failed) {
      throw ResumeError(fmt::format("rank {} could not read its checkpoint shard (its log says why)", *failed));
    }
    return shard;
  }

  // The layer's state entries from the checkpoint sections of the same names, each shaped as
  // the layer's own export shows (a 1-D byte entry takes the section's length).
  std::map<std::string, torch::Tensor> read_layer_state(const CheckpointSections& in) const {
    const std::string file = checkpoint_path(options.out_dir).string();
    std::map<std::string, torch::Tensor> state;
    for (const auto& [key, like] : layer->export_state()) {
      if (key == "layer/passes" && !in.has(key)) {
        // A checkpoint from before the layer: one training pass per step, evaluation passes
        // uncounted (they only number the evaluation engine's steps).
        state.emplace(key, torch::tensor({next_step, std::int64_t{0}}, torch::kInt64));
        continue;
      }
      if (like.dim() == 1 && like.scalar_type() == torch::kUInt8) {
        const Bytes& bytes = in.get(key);
        if (key == "policy/hints" && (bytes.size() % sizeof(sp_hint_v1) != 0 ||
                                      (!bytes.empty() && bytes.size() != n_units * sizeof(sp_hint_v1)))) {
          throw ResumeError(fmt::format("{}: section 'policy/hints' holds {} bytes; expected none or {} hints", file,
                                        bytes.size(), n_units));
        }
        torch::Tensor t = torch::empty({static_cast<std::int64_t>(bytes.size())}, torch::kUInt8);
        if (!bytes.empty()) std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
        state.emplace(key, std::move(t));
      } else {
        torch::Tensor t = torch::empty(like.sizes(), like.options());
        in.get_into(key, t.data_ptr(), static_cast<std::size_t>(t.numel()) * t.element_size());
        state.emplace(key, std::move(t));
      }
    }
    return state;
  }

  void restore(const CheckpointSections& main) {
    const nlohmann::json meta = read_checkpoint_meta(main, checkpoint_path(options.out_dir));
    std::map<std::string, torch::Tensor> layer_state;
    // Sharded, the main file's sections and this rank's shard's, read as one.
    CheckpointSections merged;
    const CheckpointSections* source = &main;
    try {
      const nlohmann::json expected = model_identity();
      // The mode first: a LoRA config resuming a full run differs in lora_rank too, and the
      // mode is the difference to report.
      for (const char* key : {"mode", "d_model", "n_heads", "n_blocks", "seq_len", "mlp_ratio", "lora_rank",
                              "streaming_unit", "int8_group_size", "nf4_group_size"}) {
        const nlohmann::json& value = expected.at(key);
        const nlohmann::json saved = meta["model"].value(key, nlohmann::json());
        // A run that never sent an NF4 image (checkpoint_meta.h) fits any NF4 group size.
        if (std::string_view(key) == "nf4_group_size" && meta["model"].contains(key) && saved.is_null()) continue;
        if (saved.is_null() || saved != value) {
          throw ResumeError(
              fmt::format("{}: made for {} = {}, this config has {} (use another --out, or "
                          "--set train.resume=never)",
                          checkpoint_path(options.out_dir).string(), key,
                          meta["model"].value(key, nlohmann::json()).dump(), value.dump()));
        }
      }
      if (meta.at("seed") != config.train.seed) {
        throw ResumeError(fmt::format("{}: made with train.seed {}, this run has {}",
                                      checkpoint_path(options.out_dir).string(), meta.at("seed").dump(),
                                      config.train.seed));
      }
      // Each rank's share of a step's batch depends on the world size, and with it the data
      // order: a run resumes on the world size it was made with.
      if (meta.at("world_size") != world_size()) {
        throw ResumeError(
            fmt::format("{}: made with {} data-parallel rank(s), this run has {} (WORLD_SIZE); resume "
                        "on the same number of ranks, or use another --out",
                        checkpoint_path(options.out_dir).string(), meta.at("world_size").dump(), world_size()));
      }
      const std::string saved_mode = meta.at("data_parallel").get<std::string>();
      const std::string mode = layer->sharded() ? "sharded" : "replicated";  // sharding one rank changes nothing
      if (saved_mode != mode) {
        throw ResumeError(fmt::format(
            "{}: made with its masters {}, this run keeps them {} (train.data_parallel); resume in the same mode, or "
            "use another --out",
            checkpoint_path(options.out_dir).string(), saved_mode, mode));
      }
      if (layer->sharded()) {
        merged = main;
        merged.merge(read_shard(next_step));
        source = &merged;
      }
      const CheckpointSections& in = *source;
      layer_state = read_layer_state(in);
      for (ResidentParam& p : model->resident()) {
        in.get_into("resident/" + p.name, p.value.data_ptr(), p.value.numel() * sizeof(float));
      }
      model->refresh_compute();
      // The moments' storage decides their size: a checkpoint resumes with the storage it was
      // written with.
      const std::string saved_moments = meta.at("adam_moments").get<std::string>();
      if (saved_moments != adam_moments_name(config.train.adam_moments)) {
        throw ResumeError(fmt::format(
            "{}: made with train.adam_moments {}, this config has {} (resume with the same storage, or use "
            "another --out)",
            checkpoint_path(options.out_dir).string(), saved_moments, adam_moments_name(config.train.adam_moments)));
      }
      for (std::size_t i = 0; i < adam->size(); ++i) {
        std::vector<std::uint8_t>& exp_avg = adam->exp_avg_bytes(i);
        std::vector<std::uint8_t>& exp_avg_sq = adam->exp_avg_sq_bytes(i);
        in.get_into("adam/" + adam->name(i) + "/exp_avg", exp_avg.data(), exp_avg.size());
        in.get_into("adam/" + adam->name(i) + "/exp_avg_sq", exp_avg_sq.data(), exp_avg_sq.size());
      }
      std::int64_t steps = 0;
      in.get_into("adam/steps", &steps, sizeof steps);
      if (steps < 0 || steps > next_step) {
        throw CheckpointError(fmt::format("{}: section 'adam/steps' holds {}; expected a count in [0, next_step = {}]",
                                          checkpoint_path(options.out_dir).string(), steps, next_step));
      }
      adam->set_steps_taken(steps);
      const Bytes& rng = in.get("rng/torch");
      torch::Tensor state = torch::empty({static_cast<std::int64_t>(rng.size())}, torch::kUInt8);
      std::memcpy(state.data_ptr(), rng.data(), rng.size());
      at::Generator generator = at::detail::getDefaultCPUGenerator();
      try {
        generator.set_state(state);
      } catch (const c10::Error&) {
        throw CheckpointError(fmt::format("{}: section 'rng/torch' ({} bytes) is not a CPU generator state",
                                          checkpoint_path(options.out_dir).string(), rng.size()));
      }

      if (const auto norm = meta.find("previous_grad_norm"); norm != meta.end()) {
        if (!norm->is_number() || !std::isfinite(norm->get<double>()) || norm->get<double>() < 0.0) {
          throw CheckpointError(fmt::format("{}: section 'meta': previous_grad_norm is {}; expected a finite number >= 0",
                                            checkpoint_path(options.out_dir).string(), norm->dump()));
        }
        previous_grad_norm = norm->get<double>();
      }
      calibration_errors.int8 = meta.at("calibration_errors").get<std::vector<double>>();
      calibration_errors.nf4 = meta.at("nf4_calibration_errors").get<std::vector<double>>();
      for (const auto& [key, errors] :
           {std::pair<const char*, const std::vector<double>*>{"calibration_errors", &calibration_errors.int8},
            {"nf4_calibration_errors", &calibration_errors.nf4}}) {
        const bool errors_valid =
            std::all_of(errors->begin(), errors->end(), [](double e) { return std::isfinite(e) && e >= 0.0; });
        if ((!errors->empty() && errors->size() != n_units) || !errors_valid) {
          throw CheckpointError(
              fmt::format("{}: section 'meta': {} holds {} values; expected none or {} finite "
                          "values >= 0",
                          checkpoint_path(options.out_dir).string(), key, errors->size(), n_units));
        }
      }
      calibration_status = "restored from checkpoint";
      const nlohmann::json& t = meta.at("totals");
      for (Precision precision : kPrecisions) {
        totals.h2d[precision] = t.at(fmt::format("h2d_{}", precision_name(precision))).get<std::uint64_t>();
        totals.block_steps[precision] =
            t.at(fmt::format("{}_block_steps", precision_name(precision))).get<std::uint64_t>();
      }
      totals.h2d_all_bf16 = t.at("h2d_all_bf16");
      totals.eval_h2d_before = t.at("eval_h2d");
      totals.calibration_h2d_before = t.at("calibration_h2d");
      totals.tokens = t.at("tokens");
      totals.train_seconds = t.at("train_seconds");
      totals.update_seconds = t.at("update_seconds");
      for (const nlohmann::json& v : t.at("val_history")) totals.val_history.emplace_back(v.at(0), v.at(1));
      for (const nlohmann::json& s : t.at("swaps")) totals.swaps.push_back(s);
      totals.last_loss = t.at("last_loss").is_number() ? t.at("last_loss").get<double>() : NAN;
    } catch (const nlohmann::json::exception& e) {
      throw ResumeError(
          fmt::format("{}: section 'meta' is malformed: {}", checkpoint_path(options.out_dir).string(), e.what()));
    } catch (const CheckpointError& e) {
      throw ResumeError(e.what());
    }
    const std::string file = checkpoint_path(options.out_dir).string();
    try {
      layer->restore_state(layer_state);
    } catch (const tl::StateEntryError& e) {
      throw ResumeError(fmt::format("{}: section '{}': {}", file, e.entry(), e.detail()));
    } catch (const tl::CollectiveError&) {
      throw;  // a rank died or stalled during a sharded restore: not a defect of the checkpoint
    } catch (const tl::RankMismatchError&) {
      throw;  // another rank could not restore: it names itself, and its checkpoint
    } catch (const std::logic_error&) {
      throw;                             // a bug on this side, not a defect of the checkpoint
    } catch (const std::exception& e) {  // the plugin rejected the state
      throw ResumeError(fmt::format("{}: {}", file, e.what()));
    }
    log->info("resumed from {} at step {}", checkpoint_path(options.out_dir).string(), next_step);
  }

  // ---- the run ---------------------------------------------------------------------------

  void write_step_record(const StepRecord& r) {
    nlohmann::json record = {{"step", r.step},
                             {"loss", r.loss},
                             {"lr", r.lr},
                             {"grad_norm", r.grad_norm},
                             {"routes", r.routes},
                             {"decisions", r.decisions},
                             {"h2d_bytes_all_bf16", r.h2d_bytes_all_bf16},
                             {"seconds", r.seconds},
                             {"update_seconds", r.update_seconds},
                             {"plugin_version", r.plugin_version}};
    for (Precision precision : kPrecisions) {
      record[fmt::format("h2d_bytes_{}", precision_name(precision))] = r.h2d_bytes[precision];
    }
    if (r.val_loss) record["val_loss"] = *r.val_loss;
    if (!r.swap_note.empty()) record["plugin_swap"] = r.swap_note;
    if (r.recalibration) record["recalibration"] = *r.recalibration;
    train_metrics->append(record);
  }

  nlohmann::json summary(RunOutcome outcome, double wall_seconds) const {
    const std::uint64_t moved = totals.h2d.total();
    const std::uint64_t saved = totals.h2d_all_bf16 - moved;
    const double tokens_per_second = totals.train_seconds > 0 ? totals.tokens / totals.train_seconds : 0.0;
    return {
        {"outcome", outcome == RunOutcome::completed ? "completed" : "interrupted"},
        {"steps", next_step},
        {"final_val_loss",
         totals.val_history.empty() ? nlohmann::json() : nlohmann::json(totals.val_history.back().second)},
        {"final_train_loss", std::isfinite(totals.last_loss) ? nlohmann::json(totals.last_loss) : nlohmann::json()},
        {"val_loss_history", totals_json()["val_history"]},
        {"h2d_bytes",
         {{"bf16", totals.h2d[Precision::bf16]},
          {"int8", totals.h2d[Precision::int8]},
          {"nf4", totals.h2d[Precision::nf4]},
          {"total", moved},
          {"all_bf16_equivalent", totals.h2d_all_bf16},
          {"saved", saved},
          {"saved_fraction", totals.h2d_all_bf16 ? static_cast<double>(saved) / totals.h2d_all_bf16 : 0.0}}},
        {"eval_h2d_bytes", eval_h2d()},
        {"calibration_h2d_bytes", calibration_h2d()},
        {"block_steps",
         {{"bf16", totals.block_steps[Precision::bf16]},
          {"int8", totals.block_steps[Precision::int8]},
          {"nf4", totals.block_steps[Precision::nf4]}}},
        {"final_decisions", decisions()},
        {"tokens", totals.tokens},
        {"tokens_per_second", tokens_per_second},
        {"train_seconds", totals.train_seconds},
        {"update_seconds", totals.update_seconds},
        {"wall_seconds", wall_seconds},
        {"mode", mode_name(config.train.mode)},
        // Full mode only: LoRA's streamed masters are frozen.
        {"host_optimizer", config.train.mode == TrainMode::full ? nlohmann::json(host_optimizer_name(
                                                                        config.train.host_optimizer))
                                                                  : nlohmann::json()},
        {"adam_moments", adam_moments_name(config.train.adam_moments)},
        {"device", compute_device_name(config.train.device)},
        {"compute_dtype", compute_dtype_name(config.train.compute_dtype)},
        {"model", model_identity()},
        {"plugin",
         {{"name", layer->policy().host().plugin_name()},
          {"version", layer->policy().plugin_version()},
          {"hook_failures", layer->policy().host().hook_failures().total()}}},
        {"plugin_swaps", totals.swaps},
        {"calibration",
         {{"status", calibration_status}, {"errors", calibration_errors.int8}, {"nf4_errors", calibration_errors.nf4}}},
        {"config", config.source_name},
        {"model_outliers",
         {{"blocks", config.model.outlier_blocks},
          {"magnitude", config.model.outlier_magnitude},
          {"channels", config.model.outlier_channels}}},
        {"torch_threads", torch::get_num_threads()},
        {"data_parallel",
         {{"rank", rank()},
          {"world_size", world_size()},
          {"mode", data_parallel_name(config.train.data_parallel)},
          {"gradients_reduced_on", layer->gradient_reduction_device().str()}}},
        {"peak_rss_bytes", peak_rss_bytes()},
        {"previous_crash", previous_crash ? nlohmann::json(*previous_crash) : nlohmann::json()},
        // The peak RSS expected: what the process held before it built the model, and the estimate.
        {"estimated_host_bytes", resident_before_build + estimated_host_bytes(config, shards())},
        {"resident_before_model_bytes", resident_before_build},
        // Records the run could not write (disk full, ...): each loss was logged when it happened.
        {"log_records_lost",
         {{kRunTrainMetricsFile, train_metrics->lost()}, {"transfer_metrics", layer->metrics_records_lost()}}}};
  }

  RunSummary run() {
    const auto wall_start = Clock::now();
    RunSummary result;
    ProgressLine no_progress(stdout, false);
    ProgressLine& progress = options.progress && rank() == 0 ? *options.progress : no_progress;
    const std::int64_t total = config.train.steps;
    const std::uint64_t tokens_per_step = std::uint64_t{config.train.batch_size} * config.model.seq_len;
    if (next_step >= total) log->info("nothing to do: the run is already at step {} of {}", next_step, total);
    const auto run_start = Clock::now();
    const std::int64_t first = next_step;
    while (next_step < total) {
      const BoundaryRequests requests = boundary_requests();
      if (requests.stop) {
        progress.finish();
        log->warn("interrupted: writing a checkpoint at step {}", next_step);
        result.outcome = RunOutcome::interrupted;
        break;
      }
      poll_plugin(next_step, requests.check_plugin);
      StepRecord record = train_step(next_step);
      ++next_step;
      totals.h2d += record.h2d_bytes;
      totals.h2d_all_bf16 += record.h2d_bytes_all_bf16;
      totals.tokens += tokens_per_step;
      totals.train_seconds += record.seconds;
      totals.update_seconds += record.update_seconds;
      totals.last_loss = record.loss;
      PerPrecision<std::uint64_t> blocks_per_route;
      for (std::uint8_t code : record.routes) ++blocks_per_route[from_abi(code).value()];
      totals.block_steps += blocks_per_route;
      if (next_step % config.train.eval_interval == 0 || next_step == total) {
        record.val_loss = evaluate();
        totals.val_history.emplace_back(next_step, *record.val_loss);
      }
      write_step_record(record);

      ProgressState state;
      state.step = next_step;
      state.total = total;
      state.loss = record.loss;
      state.val_loss =
          totals.val_history.empty() ? std::nullopt : std::optional<double>(totals.val_history.back().second);
      state.tokens_per_second = totals.train_seconds > 0 ? totals.tokens / totals.train_seconds : 0.0;
      state.bf16_blocks = static_cast<std::uint32_t>(blocks_per_route[Precision::bf16]);
      state.int8_blocks = static_cast<std::uint32_t>(blocks_per_route[Precision::int8]);
      state.nf4_blocks = static_cast<std::uint32_t>(blocks_per_route[Precision::nf4]);
      state.bytes_all_bf16 = totals.h2d_all_bf16;
      state.bytes_saved = totals.h2d_all_bf16 - totals.h2d.total();
      state.eta_seconds = seconds_since(run_start) / (next_step - first) * (total - next_step);
      progress.update(state);

      if (options.on_step) options.on_step(record);
      result.steps.push_back(std::move(record));
      if (config.train.checkpoint_interval > 0 && next_step % config.train.checkpoint_interval == 0 &&
          next_step < total) {
        save_checkpoint();
      }
    }
    progress.finish();
    layer->flush_metrics();
    save_checkpoint();
    result.json = summary(result.outcome, seconds_since(wall_start));
    if (const std::uint64_t lost = train_metrics->lost() + layer->metrics_records_lost()) {
      log->error("{} log record(s) could not be written (disk full?); summary.json counts them per file", lost);
    }
    result.summary_file = run_dir / kRunSummaryFile;
    sp::runtime::write_file_atomically(
        result.summary_file, result.json.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n");
    return result;
  }
};

namespace {

// LibTorch's errors carry a C++ backtrace meant for its own developers; the user gets the
// message. Running out of memory is a model or batch too big for this machine: a config matter.
// The layer's data-parallel failures end the run with their own exit code.
template <typename Work>
auto reporting_torch_errors(Work&& work) {
  constexpr const char* kTooBig =
      "not enough memory for this model and batch (model.d_model, model.n_blocks, model.seq_len, "
      "train.batch_size); lower them: {}";
  try {
    return work();
  } catch (const tl::CollectiveError& e) {
    throw DistributedError(e.what());
  } catch (const tl::RankMismatchError& e) {
    throw DistributedError(e.what());
  } catch (const std::bad_alloc& e) {
    throw ConfigError(fmt::format(kTooBig, e.what()));
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    if (message.find("can't allocate memory") != std::string::npos) throw ConfigError(fmt::format(kTooBig, message));
    throw std::runtime_error(message);
  }
}

}  // namespace

Trainer::Trainer(TrainConfig config, RunOptions options)
    : impl_(reporting_torch_errors([&] { return std::make_unique<Impl>(std::move(config), std::move(options)); })) {}
Trainer::~Trainer() = default;
RunSummary Trainer::run() {
  return reporting_torch_errors([&] { return impl_->run(); });
}
std::int64_t Trainer::next_step() const { return impl_->next_step; }
const std::string& Trainer::calibration_status() const { return impl_->calibration_status; }
const CalibrationErrors& Trainer::calibration_errors() const { return impl_->calibration_errors; }

}  // namespace sp::train
